"""Row bands of one frame across ranks, in the runtime's planner, printed as Markdown tables.

1. Makespan over the mean load, whole units (frames) against bands, on sampled steps: the
   realistic mix, replica sets (one plan across the group), a documents mix with 4K pages, and
   torchtitan's image sizes (one 2016 px or 4032 px image among small ones). Costs are
   Qwen2-VL-7B's ViT (``ArchitectureCost``: d 1280, 32 full-attention layers) in
   multiply-accumulates; a band's exchange is priced at H100 NVLink rates (``plan.bands``), and
   every rank pays the per-layer collectives of a step with bands. Also: frames split, the
   fullest rank's pixel rows over the mean, and the largest keys and values a band rank gathers
   and keeps for the backward (bf16, every layer).
2. The speed-up the same cost model projects for one image of N patches on k ranks (NVLink, one
   InfiniBand NIC), beside torchtitan's measured Kimi K3 figures (``../shared/notes/bands.md``).

    python benchmarks/bands.py [--seeds 3]
"""

import argparse
import math
import random
import statistics

from fx_vitbal.config import BalanceConfig
from fx_vitbal.plan import bands
from fx_vitbal.plan import step as planning
from fx_vitbal.plan.units import is_band, unit_rows
from fx_vitbal.runtime.vit.settings import KV_BYTES, plan_settings, planner_spec_for
from fx_vitbal.tools.simulate import QWEN2_VL_7B
from fx_vitbal.tools.workloads import sample_batches, sample_grid

WIDTH, LAYERS = QWEN2_VL_7B.hidden, QWEN2_VL_7B.depth
SUPPORT = (2, LAYERS, WIDTH, False, 16)  # merge rows; every layer attends over whole frames
PAGE_4K = [1, 274, 154]  # 3840 x 2160 px in 14 px patches: 42,196 patches
TITAN_2016, TITAN_4032 = [1, 144, 144], [1, 288, 288]  # 20,736 and 82,944 patches


def realistic(ranks: int, per_rank: int, seed: int) -> list[list[list[int]]]:
    return sample_batches(ranks, per_rank, seed=seed)


def documents(ranks: int, per_rank: int, seed: int) -> list[list[list[int]]]:
    """Small images and photos, and two 4K pages on the first ranks."""
    grids = sample_batches(ranks, per_rank, mix="photos", seed=seed)
    grids[0].append(PAGE_4K)
    grids[1 % ranks].append(PAGE_4K)
    return grids


def one_large(image: list[int]):
    def sample(ranks: int, per_rank: int, seed: int) -> list[list[list[int]]]:
        rng = random.Random(seed)
        grids = [[sample_grid(rng, "realistic") for _ in range(per_rank)] for _ in range(ranks)]
        grids[0].append(image)
        return grids

    return sample


# (label, sampler, ranks, images per rank or set, replicas per set)
ROWS = [
    ("realistic, 8 ranks x 4", realistic, 8, 4, 1),
    ("realistic, 64 ranks x 8", realistic, 64, 8, 1),
    ("replica sets, 8 x 2, ~4 a set", realistic, 16, 4, 2),
    ("replica sets, 64 x 4, ~8 a set", realistic, 256, 8, 4),
    ("documents: two 4K pages among photos, 16 ranks x 4", documents, 16, 4, 1),
    ("one 2016 px image among small ones, 4 ranks x 2", one_large(TITAN_2016), 4, 2, 1),
    ("one 4032 px image among small ones, 4 ranks x 2", one_large(TITAN_4032), 4, 2, 1),
    ("one 4032 px image among small ones, 8 ranks x 2", one_large(TITAN_4032), 8, 2, 1),
]


def plan_step(grids, replicas: int, split: bool, ranks_per_node: int | None) -> dict:
    """Plan one step as the runtime does; the makespan over the mean load and what bands cost."""
    config = BalanceConfig(split_images=split, ranks_per_node=ranks_per_node)
    spec = planner_spec_for(config, QWEN2_VL_7B, True, SUPPORT)
    ranks = len(grids) * replicas
    sets = None
    if replicas > 1:  # every replica of a set holds the set's grids
        sets = [tuple(range(s * replicas, (s + 1) * replicas)) for s in range(len(grids))]
        grids = [grids[r // replicas] for r in range(ranks)]
    scale = bands.exchange_scale(False)
    planned = planning.plan_step(grids, plan_settings(spec), sets)  # priced at NVLink
    plan, units_R = planned.plan, planned.units_R
    owners = units_R if sets is None else [units for units in units_R]
    costs = [
        QWEN2_VL_7B(1, u[3], u[2]) * u[1] / u[3] if is_band(u) else QWEN2_VL_7B(*u)
        for units in owners
        for u in units
    ]
    mean = sum(costs) / ranks
    split_units = [u for units in units_R for u in units if is_band(u)]
    span = max(plan.loads_after if plan.applied else plan.loads_before)
    if split_units:  # every rank waits out the per-layer collectives
        span += 2 * LAYERS * scale[1]
    rows = [0] * ranks
    for d, assigned in enumerate(plan.assignment):
        rows[d] = sum(unit_rows(units_R[src][idx]) for src, idx in assigned)
    gathered = max(((u.full_h - u.h) * u.w for u in split_units), default=0)
    return {
        "makespan": span / mean,
        "bound": max(1.0, max(costs) / mean),
        "frames": sum(u.first_row == 0 for u in split_units),
        "rows": max(rows) / (sum(rows) / ranks),
        "kv_gb": gathered * KV_BYTES * WIDTH * LAYERS / 2**30,
    }


def projection(patches: int, ranks: int, bytes_per_second: float) -> float:
    """Projected speed-up of one image of ``patches`` patches split into ``ranks`` bands:
    forward + backward MACs (3x forward) over the rate, against a band's share plus its
    exchange (each layer: one collective and the other bands' keys and values, both ways)."""
    side = math.isqrt(patches)
    training = bands.TRAINING_MACS_PER_FORWARD_MAC
    compute = training * QWEN2_VL_7B(1, side, patches // side) / bands.MACS_PER_SECOND
    other = patches * (ranks - 1) / ranks
    per_layer = bands.COLLECTIVE_SECONDS + other * KV_BYTES * WIDTH / bytes_per_second
    return compute / (compute / ranks + 2 * LAYERS * per_layer)


TORCHTITAN = {  # 4 x H100, 27-layer dim-1024 tower, forward + backward seconds (PR #4380)
    (20_736, 2): 0.81 / 0.44,
    (20_736, 4): 0.81 / 0.27,
    (82_944, 2): 11.1 / 5.6,
    (82_944, 4): 11.1 / 2.9,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0 to N-1 (means are printed)")
    parser.add_argument("--ranks-per-node", type=int, default=8)
    args = parser.parse_args()
    print("\nMakespan / mean load, whole frames -> bands (means over seeds; ranks per node:")
    print(f"{args.ranks_per_node}; a lone unit's bound is its cost / mean):\n")
    print(
        "| step | whole frames | bands | lone unit bound | frames split | peak rows / mean, "
        "whole -> bands | keys and values gathered, GB (bf16) |"
    )
    print("|---|---:|---:|---:|---:|---|---:|")
    for label, sampler, ranks, per, replicas in ROWS:
        whole, split = [], []
        for seed in range(args.seeds):
            grids = sampler(ranks // replicas, per, seed)
            whole.append(plan_step(grids, replicas, False, args.ranks_per_node))
            split.append(plan_step(grids, replicas, True, args.ranks_per_node))

        def mean(runs, key):
            return statistics.fmean(run[key] for run in runs)

        print(
            f"| {label} | {mean(whole, 'makespan'):.2f} | {mean(split, 'makespan'):.2f} | "
            f"{mean(whole, 'bound'):.2f} | {mean(split, 'frames'):.1f} | "
            f"{mean(whole, 'rows'):.2f} -> {mean(split, 'rows'):.2f} | "
            f"{mean(split, 'kv_gb'):.2f} |"
        )
    print(
        "\nProjected speed-up of one image split into k bands (Qwen2-VL-7B's ViT, H100 at "
        f"{bands.MACS_PER_SECOND:.0e} MAC/s, {bands.COLLECTIVE_SECONDS * 1e6:.0f} us a "
        "collective), and torchtitan's measured Kimi K3 tower on 4 x H100:\n"
    )
    print("| patches | k | NVLink (350 GB/s) | one IB NIC (48 GB/s) | torchtitan measured |")
    print("|---:|---:|---:|---:|---:|")
    for patches in (16_384, 20_736, 65_536, 82_944):
        for ranks in (2, 4, 8):
            nvlink = projection(patches, ranks, bands.NVLINK_BYTES_PER_SECOND)
            ib = projection(patches, ranks, bands.INFINIBAND_BYTES_PER_SECOND)
            measured = TORCHTITAN.get((patches, ranks))
            cell = f"{measured:.2f}x" if measured else ""
            print(f"| {patches:,} | {ranks} | {nvlink:.2f}x | {ib:.2f}x | {cell} |")


if __name__ == "__main__":
    main()
