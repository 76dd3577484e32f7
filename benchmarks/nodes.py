"""Node-aware planning vs node-blind min-move in the simulator, as a Markdown table.

Each step is sampled as ``tools.simulate`` samples it (realistic mix, video frames as
units, Qwen2-VL-7B ViT costs, default row cap) and planned twice: node-blind
(``ranks_per_node=None``) and node-aware with 8 ranks per node. Both always plan (no trigger, no
minimum gain) so the plans themselves are compared. Makespans are over the lower bound
``max(total / ranks, largest unit)``; inter-node rows are those computed on another node than
their home rank's (nodes of 8 contiguous ranks, for both plans); GB is what they carry at
Qwen2-VL-7B widths in bf16 (1176 input values out, a quarter of 3584 merged output values back);
ms is solve_plan's best-of-N CPU time.

    python benchmarks/nodes.py [--ranks 512 2048] [--seeds 0 1 2]
"""

import argparse
import dataclasses
import gc
import math
import os
import platform
import time

from fx_vitbal.config import BalanceConfig
from fx_vitbal.plan.solve import solve_plan
from fx_vitbal.plan.step import split_units
from fx_vitbal.tools.simulate import BYTES_PER_ROW, QWEN2_VL_7B
from fx_vitbal.tools.workloads import sample_batches

BLIND = BalanceConfig(trigger_threshold=0.0, min_gain=0.0)
RANKS_PER_NODE = 8

COLUMNS = [
    ("ranks", "{}"),
    ("images/rank", "{}"),
    ("seed", "{}"),
    ("units/rank", "{:.1f}"),
    ("blind makespan", "{:.3f}"),
    ("aware makespan", "{:.3f}"),
    ("aware / blind", "{:.4f}"),
    ("aware moved", "{:.1%}"),
    ("blind inter-node", "{:.1%}"),
    ("aware inter-node", "{:.1%}"),
    ("blind GB", "{:.1f}"),
    ("aware GB", "{:.1f}"),
    ("blind ms", "{:.0f}"),
    ("aware ms", "{:.0f}"),
]


def measure(ranks: int, images_per_rank: int, seed: int, repeats: int) -> list[float]:
    """One table row, in ``COLUMNS`` order."""
    grids = sample_batches(ranks, images_per_rank, mix="realistic", seed=seed)
    units = [split_units(rank_grids, split_frames=True) for rank_grids in grids]
    memo = {u: QWEN2_VL_7B(*u) for rank_units in units for u in rank_units}
    costs = [[memo[u] for u in rank_units] for rank_units in units]
    tokens = [[t * h * w for t, h, w in rank_units] for rank_units in units]
    aware = dataclasses.replace(BLIND, ranks_per_node=RANKS_PER_NODE)
    plans, millis = [None, None], [math.inf, math.inf]
    for _ in range(repeats):  # interleaved, best of N, as benchmarks/planner.py
        for i, config in enumerate((BLIND, aware)):
            gc.collect()
            start = time.process_time()
            plans[i] = solve_plan(costs, tokens, config=config)
            millis[i] = min(millis[i], 1e3 * (time.process_time() - start))
    total_rows = sum(map(sum, tokens))
    bound = max(sum(map(sum, costs)) / ranks, max(c for rank in costs for c in rank))
    spans = [max(plan.loads_after) / bound for plan in plans]
    inter = [
        sum(
            tokens[src][idx]
            for dest, assigned in enumerate(plan.assignment)
            for src, idx in assigned
            if src // RANKS_PER_NODE != dest // RANKS_PER_NODE
        )
        for plan in plans
    ]
    assert inter[1] == plans[1].inter_node_tokens
    return [
        ranks,
        images_per_rank,
        seed,
        sum(map(len, units)) / ranks,
        *spans,
        spans[1] / spans[0],
        plans[1].moved_tokens / total_rows,
        *(n / total_rows for n in inter),
        *(n * BYTES_PER_ROW / 1e9 for n in inter),
        *millis,
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[512, 2048], help="world sizes")
    parser.add_argument(
        "--images-per-rank", type=int, nargs="+", default=[1, 4, 8, 16], help="mean images"
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="workload seeds")
    parser.add_argument("--repeats", type=int, default=3, help="timing runs (best is kept)")
    args = parser.parse_args()
    print(f"{platform.platform()}, Python {platform.python_version()}, {os.cpu_count()} CPUs\n")
    print("| " + " | ".join(name for name, _ in COLUMNS) + " |")
    print("|" + "---:|" * len(COLUMNS))
    for ranks in args.ranks:
        for images in args.images_per_rank:
            for seed in args.seeds:
                row = measure(ranks, images, seed, args.repeats)
                cells = [fmt.format(v) for (_, fmt), v in zip(COLUMNS, row, strict=True)]
                print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
