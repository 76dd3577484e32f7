"""GPU readiness check: one command for one CUDA device, within a time budget, exit status 1 on
any failure, a PASS / FAIL / SKIP row per section and path in the final summary.

    python benchmarks/gpu_check.py                # one CUDA device (H200: under 5 minutes)
    python benchmarks/gpu_check.py --small        # CPU smoke run (make test runs it), 1-3 min
    python benchmarks/gpu_check.py --budget-s 200 # a shorter budget (default 280 s)

It runs from a checkout with no install (it puts the checkout first on ``sys.path``, and
registers the ``vitbal`` backend when its entry point is missing). Each section runs in a
subprocess of its own with a time limit: a hang dumps every thread's stack
(``faulthandler.dump_traceback_later``) and ends that section only, and a crash ends only its
section, so every later table still prints. Each section gets a share of the time left; one
that finds its time spent stops adding work (its rows say SKIP and why).

Sections, in order (``benchmarks/gpu_sections.py``, ``gpu_timing.py``; ``gpu_harness.py`` runs
the ranks):
1. ranks: three ranks as threads on the one device (torch's threaded process group: NCCL
   refuses two ranks on one GPU, gloo has no CUDA all_to_all), eager paths and edge cases;
2. compiled: the same ranks compiled through the ``vitbal`` backend (inductor on CUDA,
   aot_eager on the CPU), with a plan applied inside the graph;
3. profile: balancing's own host and device time in a real balanced step (torch.profiler)
   against a Qwen2-VL-7B-width tower's forward + backward;
4. cudagraphs: one ``mode="reduce-overhead"`` compile (CUDA only);
5. cost: each cost model's prediction of per-unit tower time, for what budget is left.
"""

import argparse
import faulthandler
import json
import pathlib
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout's package, installed or not

# Section -> its share of the time left when it starts (the cheap several-ranks section first).
SECTIONS = {"ranks": 0.15, "compiled": 0.4, "profile": 0.14, "cudagraphs": 0.19, "cost": 0.12}
MIN_SECTION_S = 20.0  # less than this left: the section is skipped, not started
GRACE_S = 30.0  # the parent's limit over the child's own (its start-up, the stack dump)


def print_versions() -> bool:
    """torch, CUDA, NCCL, Triton, Python and the device, before anything can fail; whether a
    CUDA device is there."""
    import torch

    cuda = torch.cuda.is_available()
    nccl = torch.cuda.nccl.version() if cuda else "n/a"  # (major, minor, patch); an int before
    nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    device = torch.cuda.get_device_name(0) if cuda else "CPU (no CUDA device)"
    print("## GPU check\n\n| what | version |\n|---|---|")
    print(f"| torch | {torch.__version__} |\n| CUDA | {torch.version.cuda} |\n| NCCL | {nccl} |")
    print(f"| Triton | {triton_version} |\n| Python | {sys.version.split()[0]} |")
    print(f"| device | {device} |\n| checkout | {ROOT} |\n", flush=True)
    return cuda


def run_section(name: str, seconds: float, args, results: pathlib.Path) -> list[dict]:
    """Run one section in a child process limited to ``seconds``; its result rows, plus a FAIL
    row when it crashed or hung."""
    command = [sys.executable, "-u", __file__, "--section", name, "--results", str(results)]
    command += ["--limit-s", f"{seconds:.0f}", *(["--small"] if args.small else [])]
    command += ["--inner", args.inner] if args.inner else []
    started = time.monotonic()
    try:
        code = subprocess.run(command, timeout=seconds + GRACE_S, cwd=ROOT).returncode
        problem = f"exit status {code} (traceback above)" if code else ""
        if code and time.monotonic() - started >= seconds:
            problem = f"hit its {seconds:.0f} s limit (every thread's stack above)"
    except subprocess.TimeoutExpired:
        problem = f"killed after {time.monotonic() - started:.0f} s (hung past its own limit)"
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    if problem or not rows:
        rows.append({"name": name, "status": "FAIL", "note": problem or "no result rows"})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="tiny models and sizes (CPU smoke)")
    parser.add_argument("--budget-s", type=float, help="wall-clock budget (280 s; --small 480 s)")
    parser.add_argument(
        "--inner", help="inner compiler (default: inductor on CUDA, else aot_eager)"
    )
    parser.add_argument("--section", choices=SECTIONS, help=argparse.SUPPRESS)
    parser.add_argument("--results", type=pathlib.Path, help=argparse.SUPPRESS)
    parser.add_argument("--limit-s", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.section:
        return child(args)
    sys.stdout.reconfigure(line_buffering=True)  # the children write to the same stream
    # A shared CPU compiles three ranks' graphs slowly (aot_eager): --small gets more time.
    args.budget_s = args.budget_s or (480.0 if args.small else 280.0)
    started = time.monotonic()
    cuda = print_versions()
    rows, seconds = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        names = list(SECTIONS)
        for i, name in enumerate(names):
            left = args.budget_s - (time.monotonic() - started)
            share = left * SECTIONS[name] / sum(SECTIONS[n] for n in names[i:])
            if share < MIN_SECTION_S:
                rows.append({"name": name, "status": "SKIP", "note": "time budget spent"})
                continue
            if name == "cudagraphs" and not cuda:
                rows.append({"name": name, "status": "SKIP", "note": "CUDA graphs need CUDA"})
                continue
            results = pathlib.Path(tmp, f"{name}.jsonl")
            results.touch()
            start = time.monotonic()
            rows += run_section(name, share, args, results)
            seconds[name] = f"{time.monotonic() - start:.0f} s of {share:.0f} s"
    print(f"## Summary ({time.monotonic() - started:.0f} s of a {args.budget_s:.0f} s budget)\n")
    print("| section/path | result | note |\n|---|---|---|")
    for row in rows:
        status = row["status"] if row["status"] != "FAIL" else "**FAIL**"
        print(f"| {row['name']} | {status} | {row['note']} |")
    print(f"\nSections' time (of their limit): {seconds}.")
    failed = sum(row["status"] == "FAIL" for row in rows)
    print(f"\n{'FAILED: ' + str(failed) + ' row(s)' if failed else 'ALL PASSED'}.")
    return 1 if failed else 0


def child(args) -> int:
    """One section, in this process: its tables on stdout, its result rows in ``--results``."""
    faulthandler.enable()
    faulthandler.dump_traceback_later(args.limit_s, exit=True)  # a hang: every stack, then out
    import gpu_harness  # after the watchdog: importing torch may be what hangs
    import gpu_sections
    import gpu_timing

    def record(name: str, status: str, note: str = "") -> None:
        line = json.dumps({"name": name, "status": status, "note": note})
        with open(args.results, "a") as file:
            file.write(line + "\n")

    ctx = gpu_harness.Context.make(args, record)
    try:
        {**gpu_sections.SECTIONS, **gpu_timing.SECTIONS}[args.section](ctx)
    except Exception as error:  # noqa: BLE001  (the section's row says it; the rest still runs)
        traceback.print_exc()
        record(args.section, "FAIL", f"{type(error).__name__}: {str(error)[:200]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
