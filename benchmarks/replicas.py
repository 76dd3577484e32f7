"""Replica sets in the simulator: issue 29's table, with rows moved and rows crossing nodes.

Each row samples one batch per replica set as ``tools.simulate_replicas`` does (video frames as
units, Qwen2-VL-7B ViT costs, 8 ranks per node) and compares the four strategies: every replica
computes its set, Megatron-Core's count split in the set, LPT in the set, and one plan across the
group (``solve_plan``, node-aware, always planning). Makespans are over the mean load ``total /
N`` (every set's work counted once); rows are percentages of all rows (each set's counted once).
Every value is the mean over the seeds. A simulation of the planned reduction, not the runtime.

    python benchmarks/replicas.py [--seeds 3]
"""

import argparse
import os
import platform
import time

from fx_vitbal.tools.simulate_replicas import STRATEGIES, summarize

# (label, dp, replicas, images per set, mix): issue 29's rows.
ROWS = [
    ("8 × 2, ~4", 8, 2, 4, "realistic"),
    ("64 × 4, ~8", 64, 4, 8, "realistic"),
    ("512 × 2, ~8", 512, 2, 8, "realistic"),
    ("photos only, 512 × 2, ~8", 512, 2, 8, "photos"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0 to N-1 (means are printed)")
    parser.add_argument("--ranks-per-node", type=int, default=8, help="contiguous ranks per node")
    args = parser.parse_args()
    print(f"{platform.platform()}, Python {platform.python_version()}, {os.cpu_count()} CPUs")
    start, seeds = time.perf_counter(), range(args.seeds)
    results = [
        (label, *summarize(dp, r, n, mix=mix, seeds=seeds, ranks_per_node=args.ranks_per_node))
        for label, dp, r, n, mix in ROWS
    ]
    names = list(STRATEGIES)
    print("\nMakespan / mean load (lower bound: max(1, largest unit / mean)):\n")
    print("| DP × R, images per set | " + " | ".join(names) + " | lower bound |")
    print("|---|" + "---:|" * (len(names) + 1))
    for label, bound, summaries in results:
        cells = [f"{summaries[name].makespan:.2f}" for name in names]
        print(f"| {label} | " + " | ".join(cells) + f" | {bound:.2f} |")
    print("\nPixel rows moved / crossing nodes, % of all rows:\n")
    print("| DP × R, images per set | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for label, _, summaries in results:
        cells = [f"{summaries[n].moved:.1%} / {summaries[n].crossing:.1%}" for n in names]
        print(f"| {label} | " + " | ".join(cells) + " |")
    print(f"\n{args.seeds} seeds, {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
