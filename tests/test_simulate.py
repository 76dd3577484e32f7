"""``python -m fx_vitbal.tools.simulate`` prints self-consistent numbers and draws its plot."""

import re

import pytest

from fx_vitbal import BalanceConfig
from fx_vitbal.tools.simulate import main, simulate


def _run(capsys, *argv: str) -> dict[str, str]:
    main(list(argv))
    lines = capsys.readouterr().out.splitlines()
    return dict(line.split(": ", 1) for line in lines[1:])


def _arrow(text: str) -> tuple[float, float]:
    before, after = re.match(r"([\d.]+) -> ([\d.]+)", text).groups()
    return float(before), float(after)


def _speedup(text: str) -> float:
    return float(re.match(r"([\d.]+)x", text).group(1))


def test_applied_plan_lowers_imbalance_and_speeds_up(capsys):
    out = _run(capsys, "--ranks", "32", "--images-per-rank", "4")
    assert out["decision"] == "applied"
    before, after = _arrow(out["imbalance"])
    assert after < before
    speedup = _speedup(out["predicted ViT step speed-up"])
    assert speedup >= 1.0
    # Makespans relative to the same lower bound: their ratio is the speed-up.
    span_before, span_after = _arrow(out["makespan / lower bound"])
    assert span_after >= 1.0 - 1e-3
    assert span_before / span_after == pytest.approx(speedup, rel=1e-2)
    # imbalance + 1 is the makespan over the mean load, so it tracks the same ratio.
    assert (before + 1) / (after + 1) == pytest.approx(speedup, rel=1e-2)
    moved, total = map(int, re.search(r"\((\d+) of (\d+)\)", out["pixel rows moved"]).groups())
    assert 0 < moved <= total


def test_skipped_plan_moves_nothing(capsys):
    out = _run(capsys, "--ranks", "8", "--dp-balance-trigger-threshold-vit", "1000")
    assert out["decision"] == "balanced"
    before, after = _arrow(out["imbalance"])
    assert before == after
    assert _speedup(out["predicted ViT step speed-up"]) == 1.0
    assert out["pixel rows moved"].startswith("0.0% (0 of")


def test_quadratic_planning_is_judged_by_the_architecture_model(capsys):
    out = _run(capsys, "--ranks", "64", "--cost-model", "quadratic")
    assert "imbalance as planned (quadratic model)" in out
    default = simulate(64, 8)
    quadratic = simulate(64, 8, config=BalanceConfig(cost_model="quadratic"))
    assert quadratic.loads_before == default.loads_before
    assert 1.0 <= quadratic.speedup <= default.speedup


def test_plot_writes_a_png(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "load.png"
    out = _run(capsys, "--ranks", "16", "--plot", str(path), "--plot-order", "rank")
    assert out["plot"] == str(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_sizes_are_rejected():
    with pytest.raises(SystemExit):
        main(["--ranks", "0"])


def test_ranks_per_node_reports_inter_node_rows_next_to_node_blind_planning(capsys):
    out = _run(capsys, "--ranks", "64", "--images-per-rank", "8", "--ranks-per-node", "8")
    rows = {
        key: int(re.search(r"\((\d+) of", out[key]).group(1))
        for key in ("inter-node rows (8 ranks per node)", "node-blind inter-node rows")
    }
    assert 0 < rows["inter-node rows (8 ranks per node)"] < rows["node-blind inter-node rows"]
    assert "GB at Qwen2-VL-7B widths" in out["node-blind inter-node rows"]
    after = _arrow(out["makespan / lower bound"])[1]
    assert after <= float(out["node-blind makespan / lower bound"]) * 1.005 + 1e-3


def test_add_image_puts_a_4032_px_image_on_the_first_rank_and_bands_split_it(capsys):
    """One 4032 px image (288 x 288 patches) added to a 64-rank step, 8 ranks a node: the
    simulator plans bands as ``--dp-balance-split-images-vit`` (on by default) asks, cuts the
    image across nodes, and reports its bands, their exchange, the bytes they move inside and
    across nodes and the memory the fullest rank holds; without the flag it keeps it whole."""
    argv = ["--ranks", "64", "--images-per-rank", "2", "--ranks-per-node", "8"]
    out = _run(capsys, *argv, "--add-image", "1", "288", "288")
    split = re.match(r"(\d+) \(bands per frame: (.*); exchanges: (.*)\)", out["frames split"])
    assert split is not None, out["frames split"]
    counts = [int(c.split(" x")[0]) for c in split.group(2).split(", ")]
    kinds = dict(c.split(" x") for c in split.group(3).split(", "))
    # The image across nodes in more bands than the heads (16) by usp (a node's 8 bands share
    # the heads, a ring goes across); frames above the new level are cut inside their nodes.
    assert max(counts) > 16 and kinds.get("usp") == "1", out["frames split"]
    bands = sum(int(c) * int(n) for c, n in (c.split(" x") for c in split.group(2).split(", ")))
    assert f", {bands} of them bands)" in out["units"]
    inside, across = map(
        float,
        re.match(
            r"([\d.]+) GB inside nodes, ([\d.]+) GB across",
            out["band exchange bytes per step (8 ranks a node)"],
        ).groups(),
    )
    assert across > 0
    held_before, held_after = _arrow(out["most activation memory on one rank"])
    assert held_after < held_before / 3  # 82,944 patches no longer on one rank
    assert _speedup(out["predicted ViT step speed-up"]) > 5
    whole = _run(
        capsys, *argv, "--add-image", "1", "288", "288", "--no-dp-balance-split-images-vit"
    )
    assert "frames split" not in whole
    assert _speedup(whole["predicted ViT step speed-up"]) < 1.1
    assert _arrow(whole["most activation memory on one rank"])[1] == held_before


def test_add_image_is_repeatable_and_checked(capsys):
    main(
        [
            "--ranks",
            "4",
            "--images-per-rank",
            "0",
            "--add-image",
            "1",
            "8",
            "8",
            "--add-image",
            "2",
            "16",
            "16",
        ]
    )
    header, *lines = capsys.readouterr().out.splitlines()
    assert header.endswith("+[1, 8, 8] on rank 0, +[2, 16, 16] on rank 0")
    assert dict(line.split(": ", 1) for line in lines)["units"].startswith("3 (frames")
    with pytest.raises(SystemExit):
        main(["--ranks", "4", "--add-image", "1", "7", "8"])  # a 2x2 merge needs even sides


def test_simulation_with_bands_reports_what_the_runtime_would_plan(capsys):
    sim = simulate(16, 2, mix="documents", config=BalanceConfig(ranks_per_node=8))
    blind = simulate(16, 2, mix="documents", config=BalanceConfig(split_images=False))
    assert sim.step.frames and not blind.step.frames
    assert max(sim.loads_after) < max(blind.loads_after)
    assert sum(sim.band_bytes) > 0
