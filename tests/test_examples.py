"""The demo (``make demo``) runs end to end on 2 ranks, balances, and trains identically."""

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_demo_balances_and_reports_identical_losses():
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_omni.py"), "--steps", "1", "--ranks", "2"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "decision: applied" in out, out
    losses = re.findall(r"balance (?:off|on) .* loss (\S+)", out)
    assert len(losses) == 2 and losses[0] == losses[1], out
    diff = re.search(r"max \|balanced - unbalanced\| = (\S+)", out)
    assert diff is not None and float(diff.group(1)) <= 1e-6, out
