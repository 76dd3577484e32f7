"""Tests for ``BalanceConfig`` validation and the Megatron-style flags that build it."""

import argparse
import dataclasses
import math
import re

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


def parse(argv: list[str]) -> BalanceConfig:
    return BalanceConfig.from_args(add_vit_balance_args(argparse.ArgumentParser()).parse_args(argv))


@pytest.mark.parametrize(
    ("field", "value"),
    [
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
    ],
)
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


def test_invalid_flag_combination_raises_value_error_in_from_args():
    with pytest.raises(ValueError, match="cost_coeffs"):
        parse(["--dp-balance-cost-model-vit", "polynomial"])
    with pytest.raises(ValueError, match="min_gain"):
        parse(["--dp-balance-min-gain-vit", "1.5"])


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
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "eight")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        parse([])


def test_ranks_per_node_is_in_the_planner_spec_and_fingerprint_but_node_blind_specs_are_unchanged():
    from fx_vitbal.cost import QuadraticCost
    from fx_vitbal.runtime.metadata import settings_fingerprint
    from fx_vitbal.runtime.settings import parse_planner_spec, planner_spec

    specs = {
        n: planner_spec(BalanceConfig(ranks_per_node=n), QuadraticCost()) for n in (None, 4, 8)
    }
    assert "ranks_per_node" not in specs[None]  # compiled graphs' cache keys stay as they were
    for n, spec in specs.items():
        assert parse_planner_spec(spec)[0].ranks_per_node == n
    # Ranks compare this fingerprint every step: one with another ranks_per_node raises on all.
    fingerprints = {settings_fingerprint(spec, 2, 16) for spec in specs.values()}
    assert len(fingerprints) == 3
