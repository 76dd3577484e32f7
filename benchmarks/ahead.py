"""The plan's share of the balanced step, planned in the step vs planned ahead, on 2 gloo CPU ranks,
printed as a Markdown table.

Same ViT and batches as ``e2e.py``: a skewed batch (the plan moves images) and an even one (the
plan is skipped). Each step is the ViT's forward+backward through ``dp_balance_vit_encoder``;
"in step" plans inside it (``vitbal::plan``: the metadata gather and the solve), "ahead" is handed
a plan made before by ``fx_vitbal.plan_ahead`` over a gloo group of its own, so the step only
checks that its batch is the planned one. The plan's time is measured inside each timed step
(``vitbal::plan`` wrapped with a clock: in the step it gathers and solves, ahead it takes the
plan handed over and checks the batch), so the share is of the same run.
Medians over ``--repeats`` runs, modes interleaved run by run, each run after a barrier.

    python benchmarks/ahead.py [--repeats 15]
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from e2e import EVEN, SKEWED, VIT, WORLD, _table, inputs, launch, print_machine

import fx_vitbal
from fx_vitbal.runtime import planning
from fx_vitbal.runtime.planning import plan_units
from fx_vitbal.runtime.settings import planner_for
from fx_vitbal.tools.models import QwenStyleViT
from fx_vitbal.tools.workloads import sample_batches


class Clock:
    """Seconds spent in the wrapped functions since the last ``reset``."""

    def __init__(self) -> None:
        self.spent = 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent += time.perf_counter() - start

        return timed


def step(vit, pixels, grid_thw, plan=None) -> None:
    vit.zero_grad(set_to_none=True)
    fx_vitbal.dp_balance_vit_encoder(vit, pixels, grid_thw, plan=plan)[0].sum().backward()


def measure(rank: int, vit, batch, plan_group, repeats: int, clock: Clock) -> dict:
    pixels, grid_thw = inputs(batch, VIT.in_dim, rank)
    runs = repeats + 2  # two warm-up runs
    ahead_s, plans = [], []
    for _ in range(runs):  # what the data pipeline would do, one plan per step
        start = time.perf_counter()
        plans.append(fx_vitbal.plan_ahead(vit, pixels, grid_thw, group=plan_group))
        ahead_s.append(time.perf_counter() - start)
    applied = plans[0].plan.applied
    modes = {
        "in step": lambda: step(vit, pixels, grid_thw),
        "ahead": lambda: step(vit, pixels, grid_thw, plans.pop()),
    }
    samples = {mode: [] for mode in modes}
    for i in range(runs):
        for mode, fn in modes.items():
            dist.barrier()
            clock.spent = 0.0
            start = time.perf_counter()
            fn()
            if i >= 2:
                samples[mode].append((time.perf_counter() - start, clock.spent))
    result = {
        mode: (
            statistics.median(s for s, _ in runs),
            statistics.median(p for _, p in runs),
            statistics.median(p / s for s, p in runs),
        )
        for mode, runs in samples.items()
    }
    result["plan_ahead"] = statistics.median(ahead_s[2:])
    result["applied"] = applied
    return result


def rank_main(rank: int, repeats: int) -> None:
    torch.manual_seed(0)
    vit = QwenStyleViT(VIT)
    plan_group = dist.new_group(backend="gloo")
    clock = Clock()
    planning.plan = clock.wrap(planning.plan)  # gather + solve, or the hand-over
    results = {
        "skewed": measure(rank, vit, SKEWED[rank], plan_group, repeats, clock),
        "even": measure(rank, vit, EVEN, plan_group, repeats, clock),
    }
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, results)
    if rank == 0:
        print_machine(repeats)
        print_shares(gathered)
        print_at_scale(vit, gathered)


def print_at_scale(vit, per_rank: list[dict]) -> None:
    """What the in-step solve alone (``plan_units``, no gather) costs on a simulated 2048-rank
    world of the realistic mix, next to this machine's balanced step (skewed, in step)."""
    spec, _ = planner_for(vit, fx_vitbal.BalanceConfig())
    step = max(r["skewed"]["in step"][0] for r in per_rank)
    rows = []
    for images in (1, 8, 16):
        grids_R = sample_batches(2048, images, seed=0)
        times = []
        for _ in range(3):
            start = time.perf_counter()
            plan_units(grids_R, 1, spec)
            times.append(time.perf_counter() - start)
        units = sum(len(g) for g in grids_R)
        rows.append(
            [str(images), str(units), f"{1e3 * min(times):.1f}", f"{min(times) / step:.0%}"]
        )
    _table(
        f"Solving alone at 2048 ranks (realistic mix, best of 3) vs the {1e3 * step:.0f} ms "
        "balanced step above (planned ahead, it leaves the step)",
        ["images/rank", "units", "solve ms", "share of that step"],
        rows,
    )


def print_shares(per_rank: list[dict]) -> None:
    rows = []
    for batch, label in (("skewed", "skewed (plan applied)"), ("even", "even (plan skipped)")):
        applied = per_rank[0][batch]["applied"]
        assert applied == (batch == "skewed"), f"{batch}: applied={applied}"
        for mode in ("in step", "ahead"):
            runs = [r[batch][mode] for r in per_rank]
            rows.append(
                [
                    label,
                    mode,
                    " / ".join(f"{1e3 * s:.1f}" for s, _, _ in runs),
                    " / ".join(f"{1e3 * p:.2f}" for _, p, _ in runs),
                    " / ".join(f"{share:.2%}" for _, _, share in runs),
                    " / ".join(f"{1e3 * r[batch]['plan_ahead']:.2f}" for r in per_rank)
                    if mode == "ahead"
                    else "",
                ]
            )
    _table(
        "Plan's share of the balanced step (wall, rank 0 / rank 1)",
        [
            "batch",
            "planning",
            "step ms",
            "plan in the step ms",
            "plan / step",
            "plan_ahead ms (data thread)",
        ],
        rows,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15, help="timed runs per measurement")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    launch(rank_main, args.repeats)


if __name__ == "__main__":
    main()
