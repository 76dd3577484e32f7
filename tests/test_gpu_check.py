"""``benchmarks/gpu_check.py --small`` runs on CPU and prints every table (so it cannot rot)."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_gpu_check_small_passes_and_prints_every_table():
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--small"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "## Compile check" in out and "| result | PASS |" in out, out
    assert "| graphs compiled for 3 steps | 1 |" in out, out
    assert "## Several ranks on one device: 3 threaded ranks" in out, out
    for path in ("eager", "in_place", "fx", "ahead"):
        assert f"| {path} | True | not on CPU |" in out, out
    assert "Units sent away per rank" in out and "Result: PASS." in out, out
    assert "## Overhead" in out and "| balancing in all |" in out, out
    assert "## Cost-model fidelity" in out and "| architecture |" in out, out
