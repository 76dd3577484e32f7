"""The demo (``make demo``) runs end to end on 2 ranks, balances, and trains identically."""

import importlib.util
import math
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


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
    assert "call 2 measured ViT ms per rank" in out, out  # the runtime's clock, one step later
    if importlib.util.find_spec("matplotlib") is not None:
        assert png.stat().st_size > 10_000, out


def _train_hf(ranks: int, *args: str) -> str:
    """``examples/train_hf.py`` under torchrun on ``ranks`` CPU ranks: its stdout."""
    pytest.importorskip("transformers")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    command += [str(ranks), str(ROOT / "examples" / "train_hf.py"), *args]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def _losses(out: str, steps: int) -> list[float]:
    losses = [float(x) for x in re.findall(r"^step \d+ loss (\S+)$", out, re.M)]
    assert len(losses) == steps and all(math.isfinite(x) for x in losses), out
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("wrap", ["ddp", "fsdp2"])
def test_train_hf_runs_under_torchrun_with_finite_losses(wrap):
    out = _train_hf(
        2, "--wrap", wrap, "--steps", "2", "--grad-accum", "2", "--use-vit-dp-balance",
        "--dp-balance-verbose",
    )  # fmt: skip
    _losses(out, 2)
    assert "applied" in out, out  # images really moved


@pytest.mark.slow
def test_train_hf_with_sp_replicas_computes_each_image_once_and_trains_as_replicated():
    """4 ranks as 2 DP x 2 SP: the SP groups are replica groups, each replica's loss reads its
    half of the sequence; against the unbalanced run, where each replica computes its batch."""
    args = ["--sp", "2", "--steps", "2", "--grad-accum", "2"]
    balanced = _train_hf(4, *args, "--use-vit-dp-balance")
    replicated = _train_hf(4, *args)
    # Losses: the first before any update; the second after one, so through the gradients.
    for got, want in zip(_losses(balanced, 2), _losses(replicated, 2), strict=True):
        assert math.isclose(got, want, rel_tol=1e-5), (balanced, replicated)
    rows = r"vision rows computed per rank \[.*\] = (\d+); the SP groups' batches hold .* = (\d+)"
    computed, held = map(int, re.search(rows, balanced).groups())
    # Each image once in the world, plus a 4-row dummy unit per tower call of a rank that
    # computes nothing (4 ranks, 2 steps x 2 micro-batches, an image and a video call each).
    assert held <= computed <= held + 4 * 4 * 4 * 2, balanced
    computed, held = map(int, re.search(rows, replicated).groups())
    assert computed == 2 * held, replicated  # each of the 2 replicas computes its batch
