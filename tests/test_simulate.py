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
