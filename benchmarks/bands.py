"""Row bands of one frame across ranks, in the runtime's planner, printed as Markdown tables.

1. At cluster scale (8 ranks a node unless ``--ranks-per-node``): makespan over the mean load,
   whole frames against bands, for Qwen2-VL-7B's ViT (``ArchitectureCost``: d 1280, 32 layers
   that attend over whole frames, 16 heads) in forward multiply-accumulates, each split frame's
   exchange priced where its bands sit (``plan.band_prices``: H100 NVLink inside a node, one
   InfiniBand NIC a GPU across) and chosen per frame. The mean is of the whole frames' costs,
   so a band's exchange counts against the makespan. Steps: two 4K pages among photos
   (``documents``) on 512 and 2048 ranks, one 4032 px image among 2048 x 2 small images
   (``one_large``), the simulator's documents mix at 1 and 2 images a rank. Also: frames
   split, bands a frame, exchanges, the bytes they move per step inside and across nodes, the
   most activation memory one rank holds (``cost.memory``), and the planning time of each.
2. The smaller steps of the first bands benchmark (same model, same columns).
3. One image split into k bands: its exchange by kind and the projected speed-up, inside a node
   and across nodes, beside torchtitan's measured Kimi K3 figures (``../shared/notes/bands.md``).
4. The documents mix at one image a rank with a memory budget a rank (``--budget-gib``, 10
   and 14 by default): makespan, the most activation memory one rank holds, the steps whose
   plan keeps the budget, and the planning time.
5. The at-scale steps planned several times in a row (``--plans``) with the garbage collector
   on, as in training: the collections that ran while they planned and their time
   (``--only-collections``: this table alone).

No timed assertion: the tables are printed.

    python benchmarks/bands.py [--seeds 3] [--ranks-per-node 8] [--repeats 3] [--budget-gib 10 14]
        [--plans 6] [--only-collections]
"""

import argparse
import collections
import gc
import random
import statistics
import time

from fx_vitbal.config import BalanceConfig
from fx_vitbal.cost.memory import held_bytes_per_patch
from fx_vitbal.plan import bands
from fx_vitbal.plan import step as planning
from fx_vitbal.plan.band_plan import forget_prices
from fx_vitbal.plan.band_prices import exchange_prices, step_traffic
from fx_vitbal.plan.units import unit_rows
from fx_vitbal.runtime.vit.settings import plan_settings, planner_spec_for
from fx_vitbal.tools.simulate import QWEN2_VL_7B, QWEN2_VL_7B_BANDS
from fx_vitbal.tools.workloads import sample_batches, sample_grid

PAGE_4K = [1, 274, 154]  # 3840 x 2160 px in 14 px patches: 42,196 patches
TITAN_2016, TITAN_4032 = [1, 144, 144], [1, 288, 288]  # 20,736 and 82,944 patches
HELD = held_bytes_per_patch(QWEN2_VL_7B)


def realistic(ranks: int, per_rank: int, seed: int) -> list[list[list[int]]]:
    return sample_batches(ranks, per_rank, seed=seed)


def documents(ranks: int, per_rank: int, seed: int) -> list[list[list[int]]]:
    """Photos, and two 4K pages on the first ranks."""
    grids = sample_batches(ranks, per_rank, mix="photos", seed=seed)
    grids[0].append(PAGE_4K)
    grids[1 % ranks].append(PAGE_4K)
    return grids


def documents_mix(ranks: int, per_rank: int, seed: int) -> list[list[list[int]]]:
    """The simulator's ``documents`` mix: 60% thumbnails, 40% 1.5-2.8k px scans."""
    return sample_batches(ranks, per_rank, mix="documents", seed=seed)


def one_large(image: list[int]):
    def sample(ranks: int, per_rank: int, seed: int) -> list[list[list[int]]]:
        rng = random.Random(seed)
        grids = [[sample_grid(rng, "realistic") for _ in range(per_rank)] for _ in range(ranks)]
        grids[0].append(image)
        return grids

    return sample


# (label, sampler, ranks, images per rank or set, replicas per set, target, measured before)
AT_SCALE = [
    ("two 4K pages among photos, 512 ranks x 4", documents, 512, 4, 1, 1.15, 1.43),
    ("two 4K pages among photos, 2048 ranks x 4", documents, 2048, 4, 1, 1.15, 1.48),
    ("one 4032 px image among 2048 x 2 small ones", one_large(TITAN_4032), 2048, 2, 1, 1.5, 9.61),
    ("documents mix, 512 ranks x 1", documents_mix, 512, 1, 1, 1.15, None),
    ("documents mix, 512 ranks x 2", documents_mix, 512, 2, 1, 1.15, None),
    ("documents mix, 2048 ranks x 1", documents_mix, 2048, 1, 1, 1.15, None),
    ("documents mix, 2048 ranks x 2", documents_mix, 2048, 2, 1, 1.15, None),
]
SMALL = [
    ("realistic, 8 ranks x 4", realistic, 8, 4, 1, None, 1.02),
    ("realistic, 64 ranks x 8", realistic, 64, 8, 1, None, 1.01),
    ("replica sets, 8 x 2, ~4 a set", realistic, 16, 4, 2, None, 1.04),
    ("replica sets, 64 x 4, ~8 a set", realistic, 256, 8, 4, None, 1.08),
    ("two 4K pages among photos, 16 ranks x 4", documents, 16, 4, 1, None, 1.06),
    ("one 2016 px image among small ones, 4 ranks x 2", one_large(TITAN_2016), 4, 2, 1, None, 1.07),
    ("one 4032 px image among small ones, 4 ranks x 2", one_large(TITAN_4032), 4, 2, 1, None, 1.04),
    ("one 4032 px image among small ones, 8 ranks x 2", one_large(TITAN_4032), 8, 2, 1, None, 1.07),
]


def plan_step(
    grids, replicas: int, split: bool, ranks_per_node: int | None, repeats: int, budget=None
) -> dict:
    """Plan one step as the runtime does (the fastest of ``repeats`` plans timed, the garbage
    collector on and no shape priced before, as in a training step whose images are new); the
    makespan over the mean and what bands cost. ``budget``: ``BalanceConfig.memory_budget``."""
    config = BalanceConfig(split_images=split, ranks_per_node=ranks_per_node, memory_budget=budget)
    settings = plan_settings(planner_spec_for(config, QWEN2_VL_7B, True, QWEN2_VL_7B_BANDS))
    ranks = len(grids) * replicas
    sets = None
    if replicas > 1:  # every replica of a set holds the set's grids
        sets = [tuple(range(s * replicas, (s + 1) * replicas)) for s in range(len(grids))]
        grids = [grids[r // replicas] for r in range(ranks)]
    seconds = []
    for _ in range(repeats):
        gc.collect()
        forget_prices()
        start = time.perf_counter()
        planned = planning.plan_step(grids, settings, sets)
        seconds.append(time.perf_counter() - start)
    plan = planned.plan
    whole = [
        QWEN2_VL_7B(*u)
        for units in (grids if sets is None else grids[::replicas])
        for t, h, w in units
        for u in [(1, h, w)] * t
    ]
    mean = sum(whole) / ranks
    rows = [
        sum(unit_rows(planned.units_R[s][i]) for s, i in assigned) for assigned in plan.assignment
    ]
    inside, across = step_traffic(planned, settings.band_rule, ranks_per_node or ranks)
    return {
        "makespan": max(plan.loads_after if plan.applied else plan.loads_before) / mean,
        "bound": max(whole) / mean,
        "frames": len(planned.frames),
        "bands": max(map(len, planned.frames.values()), default=0),
        "kinds": collections.Counter(planned.exchanges.values()),
        "inside": inside / 1e9,
        "across": across / 1e9,
        "held": max(rows) * HELD / 2**30,
        "ms": min(seconds) * 1e3,
        "within": plan.cap_respected,
    }


def table(rows, seeds: int, ranks_per_node: int, repeats: int) -> None:
    print(
        "| step | whole frames | bands | target (before) | lone unit bound | frames split | "
        "most bands a frame | exchanges | band GB/step inside / across | peak activations GiB, "
        "whole -> bands | planning ms, whole / bands (x) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---|---:|---|---:|")
    for label, sampler, ranks, per, replicas, target, before in rows:
        whole, split = [], []
        for seed in range(seeds):
            grids = sampler(ranks // replicas, per, seed)
            whole.append(plan_step(grids, replicas, False, ranks_per_node, repeats))
            split.append(plan_step(grids, replicas, True, ranks_per_node, repeats))

        def mean(runs, key):
            return statistics.fmean(run[key] for run in runs)

        kinds = sum((run["kinds"] for run in split), collections.Counter())
        kinds = ", ".join(f"{k} {n / seeds:.1f}" for k, n in sorted(kinds.items()))
        goal = f"<= {target:.2f}" if target else ""
        goal += f" ({before:.2f})" if before else ""
        ms_whole, ms_split = mean(whole, "ms"), mean(split, "ms")
        print(
            f"| {label} | {mean(whole, 'makespan'):.2f} | {mean(split, 'makespan'):.3f} | "
            f"{goal} | {mean(whole, 'bound'):.2f} | {mean(split, 'frames'):.1f} | "
            f"{max(run['bands'] for run in split)} | {kinds or '-'} | "
            f"{mean(split, 'inside'):.1f} / {mean(split, 'across'):.1f} | "
            f"{mean(whole, 'held'):.1f} -> {mean(split, 'held'):.1f} | "
            f"{ms_whole:.1f} / {ms_split:.1f} "
            f"({ms_split / ms_whole:.1f}x) |"
        )


# (label, ranks, images a rank) of the documents mix planned with a memory budget.
BUDGETED = [
    ("documents mix, 32 ranks x 1", 32, 1),
    ("documents mix, 512 ranks x 1", 512, 1),
    ("documents mix, 2048 ranks x 1", 2048, 1),
]


def budget_table(seeds: int, ranks_per_node: int, repeats: int, budgets: list[int]) -> None:
    """The documents mix planned with bands, without and with each of ``budgets`` bytes a rank
    may hold (``cost.memory``: bf16, no checkpointing): makespan, the most one rank holds, the
    steps whose plan keeps the budget (``Plan.cap_respected``), frames split, planning time."""
    print(
        "| step | budget GiB (x the mean rank's) | whole frames | bands | bands, budget | "
        "most held by a rank, GiB: bands -> budget | steps within | frames split | "
        "planning ms, bands / budget |"
    )
    print("|---|---:|---:|---:|---:|---|---:|---:|---:|")
    for label, ranks, per in BUDGETED:
        steps = [documents_mix(ranks, per, seed) for seed in range(seeds)]
        whole = [plan_step(grids, 1, False, ranks_per_node, repeats) for grids in steps]
        bands = [plan_step(grids, 1, True, ranks_per_node, repeats) for grids in steps]
        mean_held = statistics.fmean(
            sum(t * h * w for grid in grids for t, h, w in grid) * HELD / ranks for grids in steps
        )
        for budget in budgets:
            runs = [plan_step(grids, 1, True, ranks_per_node, repeats, budget) for grids in steps]

            def mean(runs, key):
                return statistics.fmean(run[key] for run in runs)

            print(
                f"| {label} | {budget / 2**30:g} ({budget / mean_held:.2f}) | "
                f"{mean(whole, 'makespan'):.2f} | {mean(bands, 'makespan'):.3f} | "
                f"{mean(runs, 'makespan'):.3f} | {mean(bands, 'held'):.1f} -> "
                f"{mean(runs, 'held'):.1f} | {sum(run['within'] for run in runs)} of {seeds} | "
                f"{mean(runs, 'frames'):.1f} | {mean(bands, 'ms'):.1f} / {mean(runs, 'ms'):.1f} |"
            )


def collections_table(ranks_per_node: int, plans: int) -> None:
    """The at-scale steps (seed 0) planned ``plans`` times in a row with bands, Python's garbage
    collector on and nothing collected between plans, as a training process plans each step:
    the collections that ran while they planned, by generation, and the time spent in them
    (a full collection walks every object the process tracks, printed)."""
    print(f"process tracking {len(gc.get_objects()):,} objects\n")
    print(
        "| step | plans | ms a plan, median / longest | collections: young / middle / full | "
        "ms in collections |"
    )
    print("|---|---:|---:|---:|---:|")
    config = BalanceConfig(split_images=True, ranks_per_node=ranks_per_node)
    settings = plan_settings(planner_spec_for(config, QWEN2_VL_7B, True, QWEN2_VL_7B_BANDS))
    seen, spent, started = collections.Counter(), [0.0], [0.0]

    def heard(phase, info):
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            seen[info["generation"]] += 1
            spent[0] += time.perf_counter() - started[0]

    for label, sampler, ranks, per, replicas, *_ in AT_SCALE:
        grids = sampler(ranks // replicas, per, 0)
        seen.clear()
        spent[0] = 0.0
        gc.collect()
        gc.callbacks.append(heard)
        seconds = []
        try:
            planned = None
            for _ in range(plans):
                forget_prices()
                start = time.perf_counter()
                planned = planning.plan_step(grids, settings)
                seconds.append(time.perf_counter() - start)
        finally:
            gc.callbacks.remove(heard)
        del planned
        print(
            f"| {label} | {plans} | {statistics.median(seconds) * 1e3:.1f} / "
            f"{max(seconds) * 1e3:.1f} | {seen[0]} / {seen[1]} / {seen[2]} | "
            f"{spent[0] * 1e3:.1f} |"
        )


def projection(patches: int, k: int, across: bool) -> tuple[str, float]:
    """The cheapest exchange of one image of ``patches`` patches in ``k`` even bands, inside a
    node or each band on a node of its own, and the projected speed-up of its forward and
    backward (compute / (a band's compute + its exchange))."""
    side = int(patches**0.5)
    rule = bands.BandRule(
        align=2, min_patches=64, exchange_layers=32, kv_bytes_per_patch=4 * 1280, heads=16
    )
    prices = exchange_prices(rule, macs=True, ranks_per_node=8)
    sizes = [b.h * b.w for b in rule.bands((1, side, patches // side), k)]
    kind, priced = prices.cheapest(sizes, tuple(range(k)) if across else None)
    cost = QWEN2_VL_7B(1, side, patches // side)
    return kind, cost / (cost * max(sizes) / sum(sizes) + max(priced))


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
    parser.add_argument("--repeats", type=int, default=3, help="plans timed a step (fastest)")
    parser.add_argument(
        "--budget-gib",
        type=float,
        nargs="+",
        default=[10.0, 14.0],
        help="the memory budgets of table 4 (GiB a rank)",
    )
    parser.add_argument("--plans", type=int, default=6, help="plans in a row of table 5")
    parser.add_argument("--only-collections", action="store_true", help="table 5 alone")
    args = parser.parse_args()
    rpn = args.ranks_per_node
    if args.only_collections:
        collections_table(rpn, args.plans)
        return
    print(f"\n1. At scale: makespan / mean load, whole frames -> bands ({rpn} ranks a node; means")
    print(f"over {args.seeds} seeds; target and, in brackets, bands measured before):\n")
    table(AT_SCALE, args.seeds, rpn, args.repeats)
    print(f"\n2. Smaller steps ({rpn} ranks a node; in brackets: bands measured before):\n")
    table(SMALL, args.seeds, rpn, args.repeats)
    print(
        "\n3. One image in k bands (Qwen2-VL-7B's ViT, H100 at "
        f"{bands.MACS_PER_SECOND:.0e} MAC/s): the cheapest exchange and the projected speed-up, "
        "inside a node (NVLink) and each band on a node of its own (one IB NIC a GPU), beside "
        "torchtitan's measured Kimi K3 tower on 4 x H100:\n"
    )
    print("| patches | k | one node | across nodes | torchtitan measured |")
    print("|---:|---:|---|---|---:|")
    for patches in (16_384, 20_736, 65_536, 82_944):
        for k in (2, 4, 8, 16):
            cells = []
            for across in (False, True):
                kind, speedup = projection(patches, k, across)
                cells.append(f"{speedup:.2f}x ({kind})")
            measured = TORCHTITAN.get((patches, k))
            got = f"{measured:.2f}x" if measured else ""
            print(f"| {patches:,} | {k} | {cells[0]} | {cells[1]} | {got} |")
    budgets = [int(gib * 2**30) for gib in args.budget_gib]
    print(
        "\n4. A memory budget a rank (``BalanceConfig.memory_budget``; "
        f"{rpn} ranks a node; means over {args.seeds} seeds):\n"
    )
    budget_table(args.seeds, rpn, args.repeats, budgets)
    print(
        f"\n5. Plans in a row, the garbage collector on ({rpn} ranks a node; seed 0; "
        f"{args.plans} plans a step, no shape priced before):\n"
    )
    collections_table(rpn, args.plans)


if __name__ == "__main__":
    main()
