"""``benchmarks/gpu_check.py --small`` runs on the CPU, prints every table and passes every row
of its summary (so the one command a GPU machine runs cannot rot)."""

import pathlib
import re
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Every row the summary must hold, as section/path.
RANK_PATHS = [
    "eager",
    "in_place",
    "fx",
    "ahead",
    "bf16_autocast",
    "pixel_grads",
    "many_images",
    "replica_sets",
]
ROWS = [f"ranks/{p}" for p in [*RANK_PATHS, "bad_grid", "not_as_planned"]] + [
    "compiled/fx_fullgraph",
    "compiled/wrapped_ahead",
    "profile/balanced_step",
    "cost/fidelity",
]


@pytest.mark.slow  # five child processes, two of them compiling on three ranks
def test_gpu_check_small_passes_every_section_and_path():
    # From the checkout, not installed: the script finds the package itself.
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--small"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "| torch | " + torch.__version__ in out, out
    summary = dict(re.findall(r"^\| ([\w/]+) \| (\S+) \|", out.split("## Summary")[1], re.M))
    for row in ROWS:
        assert summary.get(row) == "PASS", (row, summary)
    want_cuda = "PASS" if torch.cuda.is_available() else "SKIP"
    assert summary.get("cudagraphs", summary.get("cudagraphs/reduce_overhead")) == want_cuda
    assert "ALL PASSED." in out, out
    for heading in ("## Several ranks", "## Compiled on 3 threaded ranks", "## Balancing's own"):
        assert heading in out, out
    assert "## Cost-model fidelity" in out and "| architecture |" in out, out
    for path in RANK_PATHS:  # on the CPU no host sync is counted, and it says so
        assert re.search(rf"^\| {path} \|.*\| not counted on CPU \(expected \d\) \|", out, re.M)
