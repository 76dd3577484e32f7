"""Planner quality and speed: no balancing vs the seed's LPT vs min-move, as a Markdown table.

``seed ms`` times a plain-Python restatement of the seed's solver (sort by cost, each unit onto
the least-loaded rank through a heap, then up to 20 move/swap steps between the most and least
loaded ranks while they differ by 5% or more), the reference the planner's speed is held to.

Units are whole ``image_grid_thw`` rows of a mix (default ``realistic``), costed with
Qwen2-VL-7B's ViT. Makespans are relative to the lower bound ``max(total / ranks, largest unit)``.
LPT and min-move run without a row cap; ``safe`` is min-move under the default cap (no rank above
the fullest rank's rows before balancing) and ``cap 1.0`` under ``max_len_ratio=1.0``.

Times are the best of several runs in CPU time (other jobs on a shared machine add wall time, not
CPU time), the configurations interleaved so drifting load hits them alike, each after a full
garbage collection so a collection the earlier plans' garbage triggers is not billed to this one.

    python benchmarks/planner.py [--quick] [--mix documents]
"""

import argparse
import gc
import heapq
import math
import os
import platform
import time

from fx_vitbal.config import BalanceConfig
from fx_vitbal.cost import ArchitectureCost
from fx_vitbal.plan.solve import solve_plan
from fx_vitbal.tools.workloads import MIXES, sample_batches

# Qwen2-VL-7B vision_config: embed_dim 1280, mlp_ratio 4, depth 32, 3*2*14*14 inputs per patch,
# merged into the LM's hidden size 3584; all layers attend over whole frames.
QWEN2_VL_7B = ArchitectureCost(hidden=1280, mlp_hidden=5120, depth=32, in_dim=1176, out_dim=3584)
# Always plan (no trigger, no minimum gain) so the table compares the plans themselves.
LPT = BalanceConfig(strategy="lpt", trigger_threshold=0.0, min_gain=0.0, max_len_ratio=math.inf)
MIN_MOVE = BalanceConfig(trigger_threshold=0.0, min_gain=0.0, max_len_ratio=math.inf)
SAFE = BalanceConfig(trigger_threshold=0.0, min_gain=0.0)
CAP_1 = BalanceConfig(trigger_threshold=0.0, min_gain=0.0, max_len_ratio=1.0)
CONFIGS = (LPT, MIN_MOVE, SAFE, CAP_1)


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


COLUMNS = [
    ("ranks", "{}"),
    ("units/rank", "{:.1f}"),
    ("none", "{:.3f}"),
    ("LPT", "{:.3f}"),
    ("min-move", "{:.3f}"),
    ("safe", "{:.3f}"),
    ("cap 1.0", "{:.3f}"),
    ("min-move peak rows", "{:.2f}"),
    ("LPT moved", "{:.1%}"),
    ("min-move moved", "{:.1%}"),
    ("seed ms", "{:.1f}"),
    ("LPT ms", "{:.1f}"),
    ("min-move ms", "{:.1f}"),
    ("safe ms", "{:.1f}"),
    ("cap 1.0 ms", "{:.1f}"),
    ("min-move / seed", "{:.2f}"),
    ("safe / seed", "{:.2f}"),
    ("cap 1.0 / min-move", "{:.2f}"),
]


def measure(ranks: int, units_per_rank: int, repeats: int, mix: str) -> list[float]:
    """One table row, in ``COLUMNS`` order."""
    grids = sample_batches(ranks, units_per_rank, mix=mix, seed=0)
    costs = [[QWEN2_VL_7B(*g) for g in rank] for rank in grids]
    tokens = [[t * h * w for t, h, w in rank] for rank in grids]
    total_cost = sum(map(sum, costs))
    total_tokens = sum(map(sum, tokens))
    bound = max(total_cost / ranks, max(c for rank in costs for c in rank))
    plans, millis = [None] * len(CONFIGS), [math.inf] * len(CONFIGS)
    seed_millis = math.inf
    for _ in range(repeats):
        gc.collect()
        start = time.process_time()
        seed_lpt_refine(costs)
        seed_millis = min(seed_millis, 1e3 * (time.process_time() - start))
        for i, config in enumerate(CONFIGS):
            gc.collect()
            start = time.process_time()
            plans[i] = solve_plan(costs, tokens, config=config)
            millis[i] = min(millis[i], 1e3 * (time.process_time() - start))
    makespans = [max(plan.loads_after) / bound for plan in plans]
    moved = [plan.moved_tokens / total_tokens for plan in plans[:2]]
    # What the default cap prevents: uncapped min-move's fullest rank over the fullest before.
    peak_rows = max(sum(tokens[s][i] for s, i in units) for units in plans[1].assignment)
    num_units = sum(map(len, costs))
    return [
        ranks,
        num_units / ranks,
        max(map(sum, costs)) / bound,
        *makespans,
        peak_rows / max(map(sum, tokens)),
        *moved,
        seed_millis,
        *millis,
        millis[1] / seed_millis,
        millis[2] / seed_millis,
        millis[3] / millis[1],
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes, one run each")
    parser.add_argument("--mix", choices=sorted(MIXES), default="realistic", help="image mix")
    parser.add_argument(
        "--ranks", type=int, nargs="+", default=[8, 64, 512, 2048], help="world sizes"
    )
    args = parser.parse_args()
    if args.quick:
        all_ranks, all_units, repeats = (8, 64), (1, 8), 1
    else:
        all_ranks, all_units, repeats = args.ranks, (1, 4, 8, 16), 5

    print(f"{platform.platform()}, Python {platform.python_version()}, {os.cpu_count()} CPUs")
    print(f"mix: {args.mix}\n")
    print("| " + " | ".join(name for name, _ in COLUMNS) + " |")
    print("|" + "---:|" * len(COLUMNS))
    for ranks in all_ranks:
        for units in all_units:
            row = measure(ranks, units, repeats, args.mix)
            cells = [fmt.format(value) for (_, fmt), value in zip(COLUMNS, row, strict=True)]
            print("| " + " | ".join(cells) + " |")
    print(
        "\nnone / LPT / min-move / safe / cap 1.0: makespan over the lower bound "
        "max(total / ranks, largest unit); LPT and min-move uncapped, safe = min-move under the "
        "default row cap, cap 1.0 = max_len_ratio=1.0; min-move peak rows: uncapped min-move's "
        "fullest rank over the fullest before; moved: share of tokens leaving their rank; "
        "ms: best-of-N planning CPU time; seed: the seed's solver restated in plain Python; "
        "x / y: the ratio of those two times."
    )


if __name__ == "__main__":
    main()
