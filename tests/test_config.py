"""Tests for ``BalanceConfig`` validation and the Megatron-style flags that build it."""

import argparse
import dataclasses
import math
import pathlib
import pickle
import re
import warnings

import pytest

from fx_vitbal.config import BalanceConfig, add_vit_balance_args

SEED_FLAGS = [
    "--use-vit-dp-balance",
    "--dp-balance-max-len-ratio-vit",
    "1.5",
    "--dp-balance-trigger-threshold-vit",
    "0.3",
    "--dp-balance-verbose",
]


FLAGS_DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "flags.md"

FLAG_OF = {
    "enabled": "--use-vit-dp-balance",
    "when": "--dp-balance-when-vit",
    "trigger_threshold": "--dp-balance-trigger-threshold-vit",
    "max_len_ratio": "--dp-balance-max-len-ratio-vit",
    "tolerance": "--dp-balance-tolerance-vit",
    "max_iters": "--dp-balance-max-iters-vit",
    "verbose": "--dp-balance-verbose",
    "cost_model": "--dp-balance-cost-model-vit",
    "cost_coeffs": "--dp-balance-cost-coeffs-vit",
    "strategy": "--dp-balance-strategy-vit",
    "skip_rule": "--dp-balance-skip-rule-vit",
    "min_gain": "--dp-balance-min-gain-vit",
    "split_frames": "--dp-balance-split-frames-vit",
    "split_images": "--dp-balance-split-images-vit",
    "min_band_patches": "--dp-balance-min-band-patches-vit",
    "ranks_per_node": "--dp-balance-ranks-per-node-vit",
    "band_exchange": "--dp-balance-band-exchange-vit",
    "memory_budget": "--dp-balance-memory-budget-vit",
}

BAD_VALUES = [
    ("band_exchange", "all-gather"),
    ("memory_budget", 0),
    ("trigger_threshold", -0.1),
    ("trigger_threshold", math.nan),
    ("max_len_ratio", 0.5),
    ("max_len_ratio", math.nan),
    ("tolerance", -0.01),
    ("max_iters", -1),
    ("cost_model", "cubic"),
    ("strategy", "greedy"),
    ("skip_rule", "never"),
    ("when", "eval"),
    ("min_gain", -0.1),
    ("min_gain", 1.0),
    ("min_gain", math.nan),
]


def make_parser() -> argparse.ArgumentParser:
    return add_vit_balance_args(argparse.ArgumentParser(prog="train.py"))


def parse(argv: list[str]) -> BalanceConfig:
    return BalanceConfig.from_args(make_parser().parse_args(argv))


def balance_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [action for action in parser._actions if action.dest != "help"]


def shown(default: object) -> str:
    """A default as the help and docs/flags.md word it (None: a flag's own words)."""
    return ("on" if default else "off") if isinstance(default, bool) else str(default)


def help_default(action: argparse.Action) -> str:
    found = re.search(r"\(default: (.*)\)$", action.help or "")
    assert found, f"{action.option_strings[0]}: no (default: ...) at the end of {action.help!r}"
    return found.group(1)


@pytest.mark.parametrize(("field", "value"), BAD_VALUES)
def test_bad_field_raises_value_error_naming_field_and_value(field, value):
    with pytest.raises(ValueError, match=re.escape(f"BalanceConfig.{field}")) as info:
        BalanceConfig(**{field: value})
    assert repr(value) in str(info.value)


@pytest.mark.parametrize(
    "coeffs",
    [None, (1.0, 2.0), (1.0, 2.0, 3.0, 4.0), (-1.0, 0.0, 0.0), (0.0, 0.0, 0.0), (math.nan, 1, 1)],
)
def test_polynomial_model_needs_three_non_negative_finite_coeffs(coeffs):
    with pytest.raises(ValueError, match=re.escape("BalanceConfig.cost_coeffs")) as info:
        BalanceConfig(cost_model="polynomial", cost_coeffs=coeffs)
    assert repr(coeffs) in str(info.value)


@pytest.mark.parametrize("model", ["auto", "quadratic", "architecture", "online"])
def test_coeffs_without_polynomial_model_raise_naming_cost_model(model):
    with pytest.raises(ValueError, match=re.escape("BalanceConfig.cost_model")) as info:
        BalanceConfig(cost_model=model, cost_coeffs=(1.0, 2.0, 3.0))
    assert repr(model) in str(info.value)


def test_valid_edge_values_are_accepted():
    cfg = BalanceConfig(
        trigger_threshold=0.0,
        max_len_ratio=1.0,
        tolerance=0.0,
        max_iters=0,
        min_gain=0.0,
        cost_model="polynomial",
        cost_coeffs=(0.0, 1.0, 0.0),
    )
    assert (cfg.max_len_ratio, cfg.max_iters, cfg.cost_coeffs) == (1.0, 0, (0.0, 1.0, 0.0))


def test_config_is_frozen():
    cfg = BalanceConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.trigger_threshold = 0.5  # type: ignore[misc]


def test_config_is_keyword_only():
    with pytest.raises(TypeError):
        BalanceConfig(True, 0.2)  # type: ignore[misc]


def test_seed_flags_round_trip():
    assert parse(SEED_FLAGS) == BalanceConfig(
        enabled=True, max_len_ratio=1.5, trigger_threshold=0.3, verbose=True
    )


def test_every_flag_reaches_its_field():
    cfg = parse(
        [
            *SEED_FLAGS,
            "--dp-balance-cost-model-vit",
            "polynomial",
            "--dp-balance-cost-coeffs-vit",
            "1",
            "2",
            "3",
            "--no-dp-balance-split-frames-vit",
            "--dp-balance-strategy-vit",
            "lpt",
            "--dp-balance-skip-rule-vit",
            "seed",
            "--dp-balance-min-gain-vit",
            "0.1",
            "--dp-balance-tolerance-vit",
            "0.01",
            "--dp-balance-max-iters-vit",
            "7",
            "--dp-balance-when-vit",
            "always",
            "--dp-balance-ranks-per-node-vit",
            "8",
            "--no-dp-balance-split-images-vit",
            "--dp-balance-min-band-patches-vit",
            "4096",
            "--dp-balance-band-exchange-vit",
            "ring",
            "--dp-balance-memory-budget-vit",
            "1000000",
        ]
    )
    expected = BalanceConfig(
        enabled=True,
        when="always",
        trigger_threshold=0.3,
        max_len_ratio=1.5,
        tolerance=0.01,
        max_iters=7,
        verbose=True,
        cost_model="polynomial",
        cost_coeffs=(1.0, 2.0, 3.0),
        strategy="lpt",
        skip_rule="seed",
        min_gain=0.1,
        split_frames=False,
        split_images=False,
        min_band_patches=4096,
        band_exchange="ring",
        memory_budget=1_000_000,
        ranks_per_node=8,
    )
    assert cfg == expected
    assert isinstance(cfg.cost_coeffs, tuple)
    # Every field differs from what no flags give, so a flag that is not wired through shows here.
    default = parse([])
    unchanged = [
        f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) == getattr(default, f.name)
    ]
    assert unchanged == []


def test_no_flags_give_the_defaults_but_disabled():
    assert parse([]) == BalanceConfig(enabled=False)


def test_split_frames_flag_can_be_turned_back_on():
    assert parse(["--dp-balance-split-frames-vit"]).split_frames is True
    assert parse(["--no-dp-balance-split-frames-vit"]).split_frames is False


def test_split_images_is_on_by_default_and_a_flag_turns_it_off():
    assert parse([]).split_images is True and BalanceConfig().split_images is True
    assert parse(["--no-dp-balance-split-images-vit"]).split_images is False
    with pytest.raises(ValueError, match="min_band_patches"):
        BalanceConfig(min_band_patches=0)


@pytest.mark.parametrize(
    ("argv", "flag", "also"),
    [
        (
            ["--dp-balance-cost-model-vit", "polynomial"],
            FLAG_OF["cost_coeffs"],
            FLAG_OF["cost_model"],
        ),
        (
            ["--dp-balance-cost-coeffs-vit", "1", "2", "3"],
            FLAG_OF["cost_model"],
            FLAG_OF["cost_coeffs"],
        ),
        (
            [
                "--dp-balance-cost-model-vit",
                "polynomial",
                "--dp-balance-cost-coeffs-vit",
                "0",
                "0",
                "0",
            ],
            FLAG_OF["cost_coeffs"],
            FLAG_OF["cost_model"],
        ),
    ],
)
def test_bad_flag_combination_is_an_argparse_error_naming_both_flags(capsys, argv, flag, also):
    args = make_parser().parse_args(argv)  # each flag is fine alone
    with pytest.raises(SystemExit) as info:
        BalanceConfig.from_args(args)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"error: argument {flag}: must be" in err and also in err, err
    assert "BalanceConfig." not in err  # flags' words, not the dataclass's


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--dp-balance-trigger-threshold-vit", "-0.1"),
        ("--dp-balance-trigger-threshold-vit", "nan"),
        ("--dp-balance-max-len-ratio-vit", "0.5"),
        ("--dp-balance-tolerance-vit", "-0.01"),
        ("--dp-balance-max-iters-vit", "-1"),
        ("--dp-balance-min-gain-vit", "1.5"),
        ("--dp-balance-min-band-patches-vit", "0"),
        ("--dp-balance-ranks-per-node-vit", "0"),
    ],
)
def test_bad_value_is_an_argparse_error_naming_the_flag_at_parse_time(capsys, flag, value):
    with pytest.raises(SystemExit) as info:
        make_parser().parse_args([flag, value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: train.py")  # the parser's own error
    assert f"train.py: error: argument {flag}: must be" in err and f"got {value}" in err, err


def test_unparsable_value_keeps_argparses_own_message(capsys):
    with pytest.raises(SystemExit):
        make_parser().parse_args(["--dp-balance-max-iters-vit", "1.5"])
    assert (
        "argument --dp-balance-max-iters-vit: invalid int value: '1.5'" in capsys.readouterr().err
    )


@pytest.mark.parametrize(("field", "value"), BAD_VALUES)
def test_every_rejected_value_from_the_namespace_names_its_flag(capsys, field, value):
    # Values the parser never judged (set_defaults, another flag with the same dest): from_args.
    parser = make_parser()
    parser.set_defaults(**{FLAG_OF[field][2:].replace("-", "_"): value})
    with pytest.raises(SystemExit) as info:
        BalanceConfig.from_args(parser.parse_args([]))
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"error: argument {FLAG_OF[field]}: must be" in err and repr(value) in err, err


def test_library_errors_stay_value_errors_and_pickle_across_processes():
    with pytest.raises(ValueError) as info:
        BalanceConfig(cost_model="polynomial")
    copy = pickle.loads(pickle.dumps(info.value))
    assert isinstance(copy, ValueError) and str(copy) == str(info.value)
    assert str(copy).startswith("BalanceConfig.cost_coeffs must be")


def test_help_shows_every_flags_default(monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # no wrapping inside a default's words
    parser = make_parser()
    text = " ".join(parser.format_help().split())
    for action in balance_actions(parser):
        default = parser.get_default(action.dest)
        words = help_default(action)
        if default is not None:
            assert words == shown(default), action.option_strings
        assert f"(default: {words})" in text, action.option_strings
    assert text.count("(default: ") == len(balance_actions(parser))


def test_add_args_leaves_the_users_formatter_alone():
    parser = argparse.ArgumentParser(formatter_class=argparse.RawTextHelpFormatter)
    add_vit_balance_args(parser)
    assert parser.formatter_class is argparse.RawTextHelpFormatter


def test_help_says_what_moves(monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")
    text = " ".join(make_parser().format_help().split())
    assert "whole images" not in text
    assert "move images, video frames, or row bands of one large frame" in text


def test_verbose_without_balance_warns_and_its_help_says_so(monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")
    with pytest.warns(UserWarning, match="--dp-balance-verbose does nothing without --use-vit"):
        cfg = parse(["--dp-balance-verbose"])
    assert cfg.verbose and not cfg.enabled
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert parse(["--dp-balance-verbose", "--use-vit-dp-balance"]).verbose
    text = " ".join(make_parser().format_help().split())
    assert "does nothing without --use-vit-dp-balance" in text


@pytest.mark.filterwarnings("ignore:--dp-balance-verbose does nothing")
@pytest.mark.parametrize(
    ("argv", "changes"),
    [
        (["--use-vit-dp-balance"], {"enabled": True}),
        (["--dp-balance-when-vit", "always"], {"when": "always"}),
        (["--dp-balance-max-len-ratio-vit", "inf"], {"max_len_ratio": math.inf}),
        (["--dp-balance-trigger-threshold-vit", "0"], {"trigger_threshold": 0.0}),
        (["--dp-balance-verbose"], {"verbose": True}),
        (["--dp-balance-tolerance-vit", "0.5"], {"tolerance": 0.5}),
        (["--dp-balance-max-iters-vit", "0"], {"max_iters": 0}),
        (["--dp-balance-cost-model-vit", "quadratic"], {"cost_model": "quadratic"}),
        (
            [
                "--dp-balance-cost-model-vit",
                "polynomial",
                "--dp-balance-cost-coeffs-vit",
                "0",
                "1",
                "0",
            ],
            {"cost_model": "polynomial", "cost_coeffs": (0.0, 1.0, 0.0)},
        ),
        (["--dp-balance-strategy-vit", "lpt"], {"strategy": "lpt"}),
        (["--dp-balance-skip-rule-vit", "seed"], {"skip_rule": "seed"}),
        (["--dp-balance-min-gain-vit", "0"], {"min_gain": 0.0}),
        (["--no-dp-balance-split-frames-vit"], {"split_frames": False}),
        (["--no-dp-balance-split-images-vit"], {"split_images": False}),
        (["--dp-balance-min-band-patches-vit", "1"], {"min_band_patches": 1}),
        (["--dp-balance-ranks-per-node-vit", "4"], {"ranks_per_node": 4}),
    ],
    ids=lambda case: case[0] if isinstance(case, list) else "+".join(case),
)
def test_each_flag_alone_round_trips_to_the_config_built_directly(monkeypatch, argv, changes):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert parse(argv) == BalanceConfig(**{"enabled": False, **changes})


def test_every_field_has_exactly_one_flag():
    parser = make_parser()
    dests = [action.dest for action in balance_actions(parser)]
    assert sorted(dests) == sorted(flag[2:].replace("-", "_") for flag in FLAG_OF.values())
    assert sorted(FLAG_OF) == sorted(f.name for f in dataclasses.fields(BalanceConfig))
    for field, flag in FLAG_OF.items():
        assert flag in parser._option_string_actions, (field, flag)


def doc_table() -> dict[str, str]:
    """docs/flags.md's table: every option string it names, to its default column."""
    rows = {}
    for line in FLAGS_DOC.read_text().splitlines():
        if not line.startswith("| `"):
            continue
        flag_cell, default_cell = (cell.strip() for cell in line.strip("|").split("|")[:2])
        for flag in re.findall(r"--(?:\[no-\])?[a-z0-9-]+", flag_cell):
            names = [flag.replace("[no-]", ""), flag.replace("[no-]", "no-")]
            for name in dict.fromkeys(names):
                assert name not in rows, f"{name} twice in {FLAGS_DOC.name}"
                rows[name] = default_cell.replace("`", "")
    return rows


def test_flags_doc_lists_exactly_the_parsers_flags_with_their_defaults():
    parser = make_parser()
    expected = {}
    for action in balance_actions(parser):
        default = parser.get_default(action.dest)
        words = help_default(action) if default is None else shown(default)
        expected.update(dict.fromkeys(action.option_strings, words))
    assert doc_table() == expected


def test_unknown_choice_is_rejected_by_argparse():
    parser = add_vit_balance_args(argparse.ArgumentParser())
    with pytest.raises(SystemExit):
        parser.parse_args(["--dp-balance-strategy-vit", "random"])


def test_add_args_returns_the_parser_for_chaining():
    parser = argparse.ArgumentParser()
    assert add_vit_balance_args(parser) is parser


def test_online_cost_model_flag():
    assert parse(["--dp-balance-cost-model-vit", "online"]) == BalanceConfig(
        enabled=False, cost_model="online"
    )


@pytest.mark.parametrize("value", [0, -8, 8.0, True, "8"])
def test_ranks_per_node_must_be_none_or_a_positive_int(value):
    with pytest.raises(ValueError, match=re.escape("BalanceConfig.ranks_per_node")) as info:
        BalanceConfig(ranks_per_node=value)
    assert repr(value) in str(info.value)


def test_ranks_per_node_defaults_to_local_world_size_and_the_flag_overrides_it(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert parse([]).ranks_per_node is None
    assert BalanceConfig().ranks_per_node is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert parse([]).ranks_per_node == 8
    assert parse(["--dp-balance-ranks-per-node-vit", "1"]).ranks_per_node == 1
    assert BalanceConfig().ranks_per_node is None  # the library never reads the environment
    for bad in ("eight", "0"):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", bad)
        with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
            parse([])


def test_ranks_per_node_is_in_the_planner_spec_and_fingerprint_but_node_blind_specs_are_unchanged():
    from fx_vitbal.cost import QuadraticCost
    from fx_vitbal.runtime.agree.metadata import settings_fingerprint
    from fx_vitbal.runtime.vit.settings import parse_planner_spec, planner_spec

    specs = {
        n: planner_spec(BalanceConfig(ranks_per_node=n), QuadraticCost()) for n in (None, 4, 8)
    }
    assert "ranks_per_node" not in specs[None]  # compiled graphs' cache keys stay as they were
    for n, spec in specs.items():
        assert parse_planner_spec(spec)[0].ranks_per_node == n
    # Ranks compare this fingerprint every step: one with another ranks_per_node raises on all.
    fingerprints = {settings_fingerprint(spec, 2, 16) for spec in specs.values()}
    assert len(fingerprints) == 3
