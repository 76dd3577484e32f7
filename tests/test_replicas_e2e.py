"""``benchmarks/replicas_e2e.py --small`` runs on 4 CPU ranks and prints every table, with each
image computed once in the group under one plan (twice replicated) and the plan's outputs the
replicated ones (the script asserts that on every rank before timing)."""

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow  # four spawned ranks
def test_replicas_e2e_small_prints_every_table():
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "replicas_e2e.py"), "--small", "--repeats", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    for batch in ("(a) balanced across sets", "(b) skewed across sets"):
        assert f"### {batch} " in out, out
    # Pixel rows computed over the rows the sets hold: 2 replicated, 1 under one plan (made in
    # the step, then ahead), per batch.
    computed = re.findall(r"^\| (replicated|one plan)[^|]*\|(?:[^|]*\|){4} ([\d.]+) \|$", out, re.M)
    assert computed == [("replicated", "2.00"), ("one plan", "1.00"), ("one plan", "1.00")] * 2
    assert out.count("Goal, one plan at least") == 2, out
    assert "### Per rank: median wall / CPU ms" in out, out
