"""The plan's share of the balanced step, planned in the step vs planned ahead, on 2 gloo CPU ranks,
printed as a Markdown table.

Same ViT and batches as ``e2e.py``: a skewed batch (the plan moves images) and an even one (the
plan is skipped, eager only). Each step is the ViT's forward+backward on each path: the eager
``dp_balance_vit_encoder``, a ViT balanced in place, an FX graph the pass rewrote and a ViT
balanced in place compiled with ``fullgraph=True`` (aot_eager). "in step" plans inside it
(``vitbal::plan``: the metadata gather and the solve), "ahead" is handed a plan made before by
``fx_vitbal.plan_ahead`` over a gloo group of its own, so the step only checks that its batch is
the planned one. The plan's time is measured inside each timed step (the plan op's body wrapped
with a clock on every path: ``planning.solve_for_rank`` in the step, ``handover.step_outputs``
ahead), so the share is of the same run; the op's dispatch is not in it. Hugging Face towers run
the same op as a ViT balanced in place and are not measured here.
Medians over ``--repeats`` runs, modes interleaved run by run, each run after a barrier.

    python benchmarks/ahead.py [--repeats 15]
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from e2e import EVEN, SKEWED, VIT, WORLD, _table, inputs, launch, print_machine
from torch import nn

import fx_vitbal
from fx_vitbal.passes import apply_vit_balance_pass, symbolic_trace
from fx_vitbal.plan.step import plan_step
from fx_vitbal.runtime.agree import handover, planning
from fx_vitbal.runtime.vit.settings import plan_settings, planner_for
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


class Parent(nn.Module):
    """The smallest parent of the ViT, for the FX pass to rewrite."""

    def __init__(self, vit: nn.Module) -> None:
        super().__init__()
        self.visual = vit

    def forward(self, pixels: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        return self.visual(pixels, grid_thw)[0]


def paths(vit) -> dict:
    """Per path: ``(what plan_ahead and use_plan take, the step's call)``, all on copies of
    ``vit`` (the same weights). The eager call takes its plan as ``plan=`` (``takes_plan``);
    every other path is handed it with ``use_plan`` before the call."""

    def copy():
        twin = QwenStyleViT(VIT)
        twin.load_state_dict(vit.state_dict())
        return twin

    in_place = fx_vitbal.enable_vit_balance(copy())
    compiled = torch.compile(
        fx_vitbal.enable_vit_balance(copy()), backend="aot_eager", fullgraph=True
    )
    graph = apply_vit_balance_pass(symbolic_trace(Parent(copy())))

    def eager(p, g, plan):
        return fx_vitbal.dp_balance_vit_encoder(vit, p, g, plan=plan)[0]

    eager.takes_plan = vit
    calls = {
        "in place": (in_place, lambda p, g, plan: in_place(p, g)[0]),
        "FX pass": (graph, lambda p, g, plan: graph(p, g)),
        "compiled, fullgraph": (compiled, lambda p, g, plan: compiled(p, g)[0]),
    }
    for _, call in calls.values():
        call.takes_plan = None
    return {"eager": (vit, eager), **calls}


def measure(rank: int, target, call, batch, plan_group, repeats: int, clock: Clock) -> dict:
    pixels, grid_thw = inputs(batch, VIT.in_dim, rank)
    runs = repeats + 2  # two warm-up runs
    ahead_s, plans = [], []
    for _ in range(runs):  # what the data pipeline would do, one plan per step
        start = time.perf_counter()
        plans.append(fx_vitbal.plan_ahead(target, pixels, grid_thw, group=plan_group))
        ahead_s.append(time.perf_counter() - start)
    applied = plans[0].plan.applied

    def step(plan=None) -> None:
        if plan is not None and target is not call.takes_plan:  # handed over before the call
            fx_vitbal.use_plan(target, plan)
        call(pixels, grid_thw, plan).sum().backward()

    modes = {"in step": lambda: step(), "ahead": lambda: step(plans.pop())}
    samples = {mode: [] for mode in modes}
    for i in range(runs):
        for mode, fn in modes.items():
            dist.barrier()
            clock.spent = 0.0
            start = time.perf_counter()
            with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
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
    # The plan op's body on every path: the gather and the solve, or the hand-over.
    planning.solve_for_rank = clock.wrap(planning.solve_for_rank)
    handover.step_outputs = clock.wrap(handover.step_outputs)
    results = {}
    for name, (target, call) in paths(vit).items():
        results[(name, "skewed")] = measure(
            rank, target, call, SKEWED[rank], plan_group, repeats, clock
        )
    target, call = paths(vit)["eager"]
    results[("eager", "even")] = measure(rank, target, call, EVEN, plan_group, repeats, clock)
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, results)
    if rank == 0:
        print_machine(repeats)
        print_shares(gathered)
        print_at_scale(vit, gathered)


def print_at_scale(vit, per_rank: list[dict]) -> None:
    """What the in-step solve alone (``plan_step``, no gather) costs on a simulated 2048-rank
    world of the realistic mix, next to this machine's balanced step (skewed, in step)."""
    spec, _ = planner_for(vit, fx_vitbal.BalanceConfig())
    settings = plan_settings(spec)
    step = max(r[("eager", "skewed")]["in step"][0] for r in per_rank)
    rows = []
    for images in (1, 8, 16):
        grids_R = sample_batches(2048, images, seed=0)
        times = []
        for _ in range(3):
            start = time.perf_counter()
            plan_step(grids_R, settings)
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
    for path, batch in per_rank[0]:
        applied = per_rank[0][(path, batch)]["applied"]
        assert applied == (batch == "skewed"), f"{path} {batch}: applied={applied}"
        label = f"{path}, {'skewed (plan applied)' if batch == 'skewed' else 'even (plan skipped)'}"
        for mode in ("in step", "ahead"):
            runs = [r[(path, batch)][mode] for r in per_rank]
            rows.append(
                [
                    label,
                    mode,
                    " / ".join(f"{1e3 * s:.1f}" for s, _, _ in runs),
                    " / ".join(f"{1e3 * p:.2f}" for _, p, _ in runs),
                    " / ".join(f"{share:.2%}" for _, _, share in runs),
                    " / ".join(f"{1e3 * r[(path, batch)]['plan_ahead']:.2f}" for r in per_rank)
                    if mode == "ahead"
                    else "",
                ]
            )
    _table(
        "Plan's share of the balanced step (wall, rank 0 / rank 1)",
        [
            "path, batch",
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
