"""The examples run end to end: the demo (``make demo``) on 2 ranks balances, trains identically
and plots every measured step; ``train_hf.py`` under torchrun times its copies without and with
balancing, splits its document into bands, and prints no warning of its own."""

import importlib.util
import math
import os
import pathlib
import re
import subprocess
import sys

import pytest

import fx_vitbal

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _example(name: str):
    """``examples/<name>.py`` imported as a module (its ``main`` is not run)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_demo_balances_and_reports_identical_losses(tmp_path):
    png = tmp_path / "demo.png"
    command = [sys.executable, str(ROOT / "examples" / "train_omni.py"), "--steps", "2"]
    result = subprocess.run(
        command + ["--ranks", "2", "--warmup", "1", "--plot", str(png)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "runtime: applied" in out, out
    losses = re.findall(r"balance (?:off|on) .* loss (\S+)", out)
    assert len(losses) == 4 and losses[0] == losses[1], out
    diff = re.search(r"max \|balanced - unbalanced\| = (\S+)", out)
    assert diff is not None and float(diff.group(1)) <= 1e-6, out
    # Steps are BalanceStats.step (the warm-up call is forgotten); the runtime's clock of step 1
    # comes with step 2.
    assert "step 1 measured ViT wall ms per rank" in out, out
    if importlib.util.find_spec("matplotlib") is not None:
        assert png.stat().st_size > 10_000, out
        assert "(right: measured steps 1, predicted steps" in out, out


def _stats(step: int, measured_steps, seconds, predicted) -> fx_vitbal.BalanceStats:
    return fx_vitbal.BalanceStats(
        step=step, rank=0, applied=True, reason="applied", imbalance_before=1.0,
        imbalance_after=0.0, moved_rows=1, total_rows=2, inter_node_rows=0,
        predicted_seconds=None, predicted_exchange_seconds=None, measured_steps=measured_steps,
        measured_seconds=seconds, measured_predicted_seconds=predicted,
        measured_exchange_seconds=[None] * len(seconds), coefficients=None,
        exchange_latency=None, exchange_bandwidth=None,
    )  # fmt: skip


def test_demo_figure_plots_every_measured_step_and_names_each_clock():
    """The right panel draws every step the runtime reported a time for, also those the online
    fit predicted nothing for (it still blends in its prior), and the panels say which clock."""
    demo = _example("train_omni")
    stats = [
        _stats(1, [0, 0], [None, None], [None, None]),  # nothing measured before step 1
        _stats(2, [1, 1], [0.5, 0.25], [None, None]),  # the fit still blends in its prior
        _stats(3, [2, 2], [0.375, 0.25], [None, None]),
        _stats(4, [3, 3], [0.25, 0.125], [0.5, 0.5]),
        _stats(5, [4, 0], [0.125, None], [0.25, None]),  # rank 1 reported no time
    ]
    measured, predicted = demo.runtime_times(stats)
    assert measured == [{1: 500, 2: 375, 3: 250, 4: 125}, {1: 250, 2: 250, 3: 125}]
    assert predicted == [{3: 500, 4: 250}, {3: 500}]

    pytest.importorskip("matplotlib")
    per_rank = [[100.0, 50.0]] * 5
    report = {name: {"loss": [1.0] * 5, "per_rank": per_rank} for name in ("off", "on")}
    left, right = demo.figure(report, stats, warmup=2).axes[:2]
    assert "CPU time" in left.get_ylabel() and "median of steps 3-5" in left.get_title()
    assert "wall-clock time" in right.get_ylabel() and "wall-clock" in right.get_title()
    lines = {line.get_label(): list(line.get_xdata()) for line in right.get_lines()}
    assert lines["rank 0"] == [1, 2, 3, 4] and lines["rank 1"] == [1, 2, 3], lines


def _train_hf(ranks: int, *args: str) -> subprocess.CompletedProcess:
    """``examples/train_hf.py`` under torchrun on ``ranks`` CPU ranks (it must succeed)."""
    pytest.importorskip("transformers")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    command += [str(ranks), str(ROOT / "examples" / "train_hf.py"), *args]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(command, capture_output=True, text=True, timeout=180, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


# Rank 0's line of a step: the balanced copy's loss, the unbalanced copy's when both train.
STEP = re.compile(r"^step (\d+) loss (\S+?)(?: \(unbalanced (\S+)\))?, step time (.*)$", re.M)
# Warnings the example used to print: DDP's, for a flag it needs only without balancing, and
# transformers', for the tiny config's out-of-vocabulary BOS/EOS ids; FSDP2's, for a view output.
# "Warning" is in the lines of Python's warnings and of torch's C++ ones.
WARNINGS = ("find_unused_parameters", "bos_token_id", "eos_token_id", "view tensor", "Warning")


def _losses(out: str, steps: int) -> list[tuple[float, float | None]]:
    """Each step's ``(balanced loss, unbalanced loss or None)``, steps numbered from 1."""
    found = STEP.findall(out)
    assert [int(step) for step, *_ in found] == list(range(1, steps + 1)), out
    losses = [(float(on), float(off) if off else None) for _, on, off, _ in found]
    assert all(math.isfinite(x) for pair in losses for x in pair if x is not None), out
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("wrap", ["ddp", "fsdp2"])
def test_train_hf_runs_under_torchrun_with_finite_losses(wrap):
    result = _train_hf(
        2, "--wrap", wrap, "--steps", "2", "--grad-accum", "2", "--use-vit-dp-balance",
        "--dp-balance-verbose",
    )  # fmt: skip
    out = result.stdout
    assert [off for _, off in _losses(out, 2)] == [None, None], out  # the balanced copy only
    assert "applied" in out, out  # images really moved
    # Calls numbered as the runtime numbers them (BalanceStats.step, the verbose line's step):
    # one per micro-batch, so optimizer step k holds calls 2k-1 and 2k.
    calls = [int(c) for c in re.findall(r"^  ViT call (\d+):", out, re.M)]
    assert calls == [1, 2, 3, 4], out
    assert [int(c) for c in re.findall(r"^\[vit dp balance\] step (\d+)", out, re.M)] == calls
    assert not [w for w in WARNINGS if w in result.stderr], result.stderr[-3000:]


@pytest.mark.slow
def test_train_hf_default_run_prints_speed_up_and_split_frames_without_warnings():
    """The run without arguments (2 ranks, DDP): both copies, their step times and speed-up,
    the document split into row bands (in the first balanced call at least), and no warning."""
    result = _train_hf(2)
    out = result.stdout
    for on, off in _losses(out, 4):
        assert math.isclose(on, off, rel_tol=1e-5), out
    speedups = re.findall(
        r"step time unbalanced \d+ ms, balanced \d+ ms: speed-up (\S+)x$", out, re.M
    )
    assert len(speedups) == 4 and all(float(s) > 0 for s in speedups), out
    assert re.search(r"^median step time over steps 2-4: .* median speed-up \S+x$", out, re.M), out
    split = [int(s) for s in re.findall(r"^  ViT call \d+: .* split units (\d+)", out, re.M)]
    # The first call splits the document into two bands or more: the online model has measured
    # no exchange yet, so it does not price theirs; later calls weigh the measured exchange.
    assert len(split) == 4 and split[0] >= 2, out
    total = re.search(r"^split units: (\d+) in \d+ of 4 balanced ViT calls$", out, re.M)
    assert total is not None and int(total.group(1)) == sum(split), out
    assert not [w for w in WARNINGS if w in result.stderr], result.stderr[-3000:]


@pytest.mark.slow
def test_train_hf_fsdp2_trains_the_unbalanced_baseline_beside_the_balanced_copy():
    """FSDP2 without balancing: rank 1 is text-only in step 2, its tower's parameters unused.
    A torch whose FSDP2 cannot reduce-scatter zeros for them (2.8) trains the balanced copy
    alone and says so."""
    from torch.distributed.fsdp import FSDPModule

    result = _train_hf(2, "--wrap", "fsdp2", "--steps", "2", "--grad-accum", "2")
    if hasattr(FSDPModule, "set_reduce_scatter_unused_params"):
        for on, off in _losses(result.stdout, 2):
            assert math.isclose(on, off, rel_tol=1e-5), result.stdout
    else:
        assert "no unbalanced FSDP2 baseline" in result.stdout, result.stdout
        assert all(off is None for _, off in _losses(result.stdout, 2)), result.stdout
    assert not [w for w in WARNINGS if w in result.stderr], result.stderr[-3000:]


@pytest.mark.slow
def test_train_hf_with_sp_replicas_computes_each_image_once_and_trains_as_replicated():
    """4 ranks as 2 DP x 2 SP: the SP groups are replica groups, each replica's loss reads its
    half of the sequence; against the unbalanced copy, where each replica computes its batch."""
    out = _train_hf(4, "--sp", "2", "--steps", "2", "--grad-accum", "2").stdout
    # Losses: the first before any update; the second after one, so through the gradients.
    for on, off in _losses(out, 2):
        assert math.isclose(on, off, rel_tol=1e-5), out
    rows = (
        r"^{}: vision rows computed per rank \[.*\] = (\d+), (\d+) of them dummy images; "
        r"the SP groups' batches hold .* = (\d+)$"
    )
    computed, dummy, held = map(int, re.search(rows.format("balanced"), out, re.M).groups())
    # Each image once in the world, plus a 4-row dummy unit per tower call of a rank that
    # computes nothing (4 ranks, 2 steps x 2 micro-batches, an image and a video call each).
    assert dummy == 0 and held <= computed <= held + 4 * 4 * 4 * 2, out
    computed, dummy, held = map(int, re.search(rows.format("unbalanced"), out, re.M).groups())
    # Each of the 2 replicas computes its batch; DDP's text-only batches add a dummy image.
    assert computed == 2 * held + dummy and dummy > 0, out
