"""Planner speed and quality against the seed's solver and the planner before fixed point, as a
Markdown table.

``seed ms`` times a plain-Python restatement of the seed's solver (sort by cost, each unit onto
the least-loaded rank through a heap, then up to 20 move/swap steps between the most and least
loaded ranks while they differ by 5% or more), the reference the planner's speed is held to.

``today``: the planner as it was before fixed point (``--baseline``, by default the commit this
work started from), extracted with ``git show`` into a temporary package and run on the same
inputs in the same run, so every ``x / today`` column compares plans made side by side.

Units are whole ``image_grid_thw`` rows of a mix (default ``realistic``), costed with
Qwen2-VL-7B's ViT. ``default`` is min-move under the default row cap (no rank above the fullest
rank's rows before balancing), ``min-move`` the same without a cap, ``cap 1.0`` under
``max_len_ratio=1.0``. Makespans are relative to the lower bound ``max(total / ranks, largest
unit)``, or to today's plan under the same configuration.

``default ms``, ``min-move ms`` and ``cap 1.0 ms`` include what one rank's step then reads of
the plan (its own list and its units' destinations: ``Plan.assignment`` makes each rank's list
when it is first read).

Times are the best of several runs in CPU time (other jobs on a shared machine add wall time, not
CPU time), the configurations interleaved so drifting load hits them alike, each after a full
garbage collection so a collection the earlier plans' garbage triggers is not billed to this one.

Small worlds (``--small-ranks``, a second table): the default plan (with what one rank reads of
it) against the seed at 8-512 ranks, warm (runs back to back) and after a ``gc.collect()`` before
each run, which leaves the caches cold; ``lists ms`` and ``torch ms`` force each of the planner's
two executions (``Units.small``, warm), showing where ``SMALL_UNITS`` draws the line.
torch runs one intra-op thread (``--threads``), as torchrun sets ``OMP_NUM_THREADS=1`` for
multi-process jobs: the planner's tensors are small, and idle helper threads spinning between
ops would be billed as CPU time. Plans are the same for any thread count.

    python benchmarks/planner.py [--quick] [--mix realistic|photos|documents|all]
"""

import argparse
import atexit
import gc
import heapq
import importlib
import math
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from unittest import mock

import torch

from fx_vitbal.config import BalanceConfig
from fx_vitbal.cost import ArchitectureCost
from fx_vitbal.plan import units as plan_units
from fx_vitbal.plan.solve import solve_plan
from fx_vitbal.tools.workloads import MIXES, sample_batches

# Qwen2-VL-7B vision_config: embed_dim 1280, mlp_ratio 4, depth 32, 3*2*14*14 inputs per patch,
# merged into the LM's hidden size 3584; all layers attend over whole frames.
QWEN2_VL_7B = ArchitectureCost(hidden=1280, mlp_hidden=5120, depth=32, in_dim=1176, out_dim=3584)
# Always plan (no trigger, no minimum gain) so the table compares the plans themselves.
DEFAULT = BalanceConfig(trigger_threshold=0.0, min_gain=0.0)
MIN_MOVE = BalanceConfig(trigger_threshold=0.0, min_gain=0.0, max_len_ratio=math.inf)
CAP_1 = BalanceConfig(trigger_threshold=0.0, min_gain=0.0, max_len_ratio=1.0)
CONFIGS = (DEFAULT, MIN_MOVE, CAP_1)
# The commit this work started from: the planner before fixed point.
BASELINE = "57339bc"


def seed_lpt_refine(costs: list[list[float]], max_iters: int = 20, tolerance: float = 0.05):
    """The seed's solver restated in plain Python, as ``(assignment, loads)``."""
    num_ranks = len(costs)
    items = [(c, i, r) for r, rank_costs in enumerate(costs) for i, c in enumerate(rank_costs)]
    items.sort(key=lambda item: item[0], reverse=True)
    loads = [0.0] * num_ranks
    buckets: list[list[tuple[float, int, int]]] = [[] for _ in range(num_ranks)]
    heap = [(0.0, r) for r in range(num_ranks)]
    for item in items:
        load, r = heap[0]
        buckets[r].append(item)
        loads[r] = load + item[0]
        heapq.heapreplace(heap, (loads[r], r))
    for _ in range(max_iters):
        hi = max(range(num_ranks), key=loads.__getitem__)
        lo = min(range(num_ranks), key=loads.__getitem__)
        if (loads[hi] - loads[lo]) / max(loads[lo], 1e-6) < tolerance:
            break
        if not buckets[hi] or not buckets[lo]:
            break
        a, b = max(buckets[hi]), min(buckets[lo])
        gap = max(loads) - min(loads)
        move = loads[:]
        move[hi] -= a[0]
        move[lo] += a[0]
        swap = loads[:]
        swap[hi] += b[0] - a[0]
        swap[lo] += a[0] - b[0]
        move_gap, swap_gap = max(move) - min(move), max(swap) - min(swap)
        if min(move_gap, swap_gap) >= gap:
            break
        buckets[hi].remove(a)
        buckets[lo].append(a)
        if move_gap <= swap_gap:
            loads = move
        else:
            buckets[lo].remove(b)
            buckets[hi].append(b)
            loads = swap
    return [[(r, i) for _, i, r in bucket] for bucket in buckets], loads


def load_baseline(revision: str):
    """``solve_plan`` of ``fx_vitbal.plan`` at ``revision``, from a temporary package that
    ``git show`` fills (its imports of ``fx_vitbal.plan`` pointed at itself)."""
    root = pathlib.Path(__file__).resolve().parent.parent
    git = ["git", "-C", str(root)]
    names = subprocess.run(
        [*git, "ls-tree", "--name-only", revision, "fx_vitbal/plan/"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    folder = pathlib.Path(tempfile.mkdtemp(prefix="planner_baseline_"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    package = folder / "_baseline_plan"
    package.mkdir()
    for name in names:
        source = subprocess.run(
            [*git, "show", f"{revision}:{name}"], check=True, capture_output=True, text=True
        ).stdout
        source = source.replace("from fx_vitbal.plan import ", "from _baseline_plan import ")
        source = source.replace("fx_vitbal.plan.", "_baseline_plan.")
        (package / pathlib.Path(name).name).write_text(source)
    sys.path.insert(0, str(folder))
    return importlib.import_module("_baseline_plan.solve").solve_plan


COLUMNS = [
    ("ranks", "{}"),
    ("units/rank", "{:.1f}"),
    ("units", "{}"),
    ("none", "{:.3f}"),
    ("default", "{:.3f}"),
    ("moved", "{:.1%}"),
    ("seed ms", "{:.1f}"),
    ("default ms", "{:.1f}"),
    ("default / seed", "{:.2f}"),
    ("min-move ms", "{:.1f}"),
    ("cap 1.0 ms", "{:.1f}"),
    ("cap 1.0 / min-move", "{:.2f}"),
    ("default makespan / today", "{:.4f}"),
    ("default rows / today", "{:.3f}"),
    ("min-move makespan / today", "{:.4f}"),
    ("min-move rows / today", "{:.3f}"),
    ("cap 1.0 makespan / today", "{:.4f}"),
    ("cap 1.0 rows / today", "{:.3f}"),
    ("cap 1.0 peak rows / today", "{:.3f}"),
    ("today default ms", "{:.1f}"),
    ("today cap 1.0 ms", "{:.1f}"),
]


def read_as_one_rank(plan, rank: int) -> None:
    """What a rank's step reads of the plan (``runtime.transport.routing``): its own list and its
    units' destinations, each made on first read. Today's planner built every rank's lists in
    ``solve_plan``, so its times hold them already."""
    plan.assignment[rank]
    plan.destinations(rank)


def measure(ranks: int, units_per_rank: int, repeats: int, mix: str, today) -> list[float]:
    """One table row, in ``COLUMNS`` order."""
    grids = sample_batches(ranks, units_per_rank, mix=mix, seed=0)
    costs = [[QWEN2_VL_7B(*g) for g in rank] for rank in grids]
    tokens = [[t * h * w for t, h, w in rank] for rank in grids]
    total_cost = sum(map(sum, costs))
    total_tokens = sum(map(sum, tokens))
    bound = max(total_cost / ranks, max(c for rank in costs for c in rank))
    runs = [(seed_lpt_refine, None)] + [(solve_plan, c) for c in CONFIGS]
    runs += [(today, DEFAULT), (today, MIN_MOVE), (today, CAP_1)]
    plans, millis = [None] * len(runs), [math.inf] * len(runs)
    for _ in range(repeats):
        for i, (solve, config) in enumerate(runs):
            gc.collect()
            start = time.process_time()
            if config is None:
                solve(costs)
            else:
                plans[i] = solve(costs, tokens, config=config)
                if solve is solve_plan:
                    read_as_one_rank(plans[i], ranks - 1)
            millis[i] = min(millis[i], 1e3 * (time.process_time() - start))
    _, default, min_move, capped, today_default, today_min_move, today_capped = plans

    def peak_rows(plan) -> int:
        return max(sum(tokens[s][i] for s, i in units) for units in plan.assignment)

    def versus(plan, old) -> tuple[float, float]:
        rows = plan.moved_tokens / old.moved_tokens if old.moved_tokens else 1.0
        return max(plan.loads_after) / max(old.loads_after), rows

    return [
        ranks,
        sum(map(len, costs)) / ranks,
        sum(map(len, costs)),
        max(map(sum, costs)) / bound,
        max(default.loads_after) / bound,
        default.moved_tokens / total_tokens,
        millis[0],
        millis[1],
        millis[1] / millis[0],
        millis[2],
        millis[3],
        millis[3] / millis[2],
        *versus(default, today_default),
        *versus(min_move, today_min_move),
        *versus(capped, today_capped),
        peak_rows(capped) / peak_rows(today_capped),
        millis[4],
        millis[6],
    ]


SMALL_COLUMNS = [
    ("ranks", "{}"),
    ("units/rank", "{:.1f}"),
    ("units", "{}"),
    ("runs on", "{}"),
    ("seed ms", "{:.3f}"),
    ("default ms", "{:.3f}"),
    ("default / seed", "{:.2f}"),
    ("seed ms, gc", "{:.3f}"),
    ("default ms, gc", "{:.3f}"),
    ("default / seed, gc", "{:.2f}"),
    ("lists ms", "{:.3f}"),
    ("torch ms", "{:.3f}"),
]


def measure_small(ranks: int, units_per_rank: int, repeats: int, mix: str) -> list:
    """One row of the small-worlds table, in ``SMALL_COLUMNS`` order: best-of times in CPU time,
    the seed and the default plan interleaved, warm, then each run after a ``gc.collect()``."""
    grids = sample_batches(ranks, units_per_rank, mix=mix, seed=0)
    costs = [[QWEN2_VL_7B(*g) for g in rank] for rank in grids]
    tokens = [[t * h * w for t, h, w in rank] for rank in grids]
    num_units = sum(map(len, costs))

    def default() -> None:
        read_as_one_rank(solve_plan(costs, tokens, config=DEFAULT), ranks - 1)

    def forced(limit: int):
        def run() -> None:
            with mock.patch.object(plan_units, "SMALL_UNITS", limit):
                default()

        return run

    runs = {"seed": lambda: seed_lpt_refine(costs), "default": default}
    runs |= {"lists": forced(1 << 62), "torch": forced(-1)}
    best = {}
    for collect in (False, True):
        for _ in range(repeats):
            for name, run in runs.items():
                if collect and name in ("lists", "torch"):
                    continue
                if collect:
                    gc.collect()
                start = time.process_time()
                run()
                elapsed = 1e3 * (time.process_time() - start)
                best[name, collect] = min(best.get((name, collect), math.inf), elapsed)
    return [
        ranks,
        num_units / ranks,
        num_units,
        "lists" if plan_units.is_small(num_units) else "torch",
        best["seed", False],
        best["default", False],
        best["default", False] / best["seed", False],
        best["seed", True],
        best["default", True],
        best["default", True] / best["seed", True],
        best["lists", False],
        best["torch", False],
    ]


def print_table(columns, rows) -> None:
    print("| " + " | ".join(name for name, _ in columns) + " |")
    print("|" + "---:|" * len(columns))
    for row in rows:
        cells = [fmt.format(value) for (_, fmt), value in zip(columns, row, strict=True)]
        print("| " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes, one run each")
    parser.add_argument(
        "--mix", choices=[*sorted(MIXES), "all"], default="realistic", help="image mix"
    )
    parser.add_argument("--ranks", type=int, nargs="*", default=[2048, 8192], help="world sizes")
    parser.add_argument(
        "--small-ranks",
        type=int,
        nargs="*",
        default=[8, 32, 128, 512],
        help="world sizes of the small-worlds table (none: skip it)",
    )
    parser.add_argument(
        "--small-repeats",
        type=int,
        default=100,
        help="runs per small-worlds cell (fewer for 4k+ units)",
    )
    parser.add_argument(
        "--units", type=int, nargs="+", default=[1, 4, 8, 16], help="images per rank"
    )
    parser.add_argument("--repeats", type=int, default=5, help="runs per configuration")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--baseline", default=BASELINE, help="git revision of today's planner")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    today = load_baseline(args.baseline)
    all_ranks, all_units, repeats = args.ranks, args.units, args.repeats
    if args.quick:
        all_ranks, all_units, repeats = all_ranks[:1], (1, 8), 1
    mixes = sorted(MIXES) if args.mix == "all" else [args.mix]

    print(
        f"{platform.platform()}, Python {platform.python_version()}, torch {torch.__version__}, "
        f"{os.cpu_count()} CPUs, {torch.get_num_threads()} torch thread(s), "
        f"today = {args.baseline}, best of {repeats}"
    )
    small_ranks, small_repeats = args.small_ranks, args.small_repeats
    if args.quick:
        small_ranks, small_repeats = small_ranks[:2], 10
    for mix in mixes:
        if small_ranks:
            print(f"\nsmall worlds, mix: {mix} (best of up to {small_repeats})\n")
            print_table(
                SMALL_COLUMNS,
                (
                    measure_small(
                        ranks, units, max(5, min(small_repeats, 40000 // (ranks * units))), mix
                    )
                    for ranks in small_ranks
                    for units in all_units
                ),
            )
        print(f"\nmix: {mix}\n")
        print_table(
            COLUMNS,
            (
                measure(ranks, units, repeats, mix, today)
                for ranks in all_ranks
                for units in all_units
            ),
        )
    print(
        "\nnone / default: makespan over the lower bound max(total / ranks, largest unit), "
        "before balancing and under the default plan (min-move, default row cap); moved: share "
        "of tokens the default plan moves; ms: best-of-N planning CPU time; seed: the seed's "
        "solver restated in plain Python; min-move: no row cap; cap 1.0: max_len_ratio=1.0; "
        "x / today: against the planner at the baseline revision, same inputs, same run "
        "(makespan, rows moved, the fullest rank's rows); x / y: the ratio of those two times. "
        "Small worlds: the default plan with one rank's reads against the seed, warm and after a "
        "gc.collect() before each run (gc); runs on: the execution SMALL_UNITS picks; lists / "
        "torch ms: each execution forced (warm)."
    )


if __name__ == "__main__":
    main()
