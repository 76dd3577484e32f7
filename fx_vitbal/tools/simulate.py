"""What balancing would do on thousands of ranks, computed without any process group.

The sizes where ViT imbalance hurts most (hundreds to thousands of data-parallel ranks) cannot run
on a workstation, but the planner is pure, deterministic Python: every rank would compute exactly
the plan computed here. This samples per-rank image grids from ``tools.workloads``, costs each
unit (a frame: Qwen-family towers attend per frame) with Qwen2-VL-7B's ViT dimensions, solves the
plan as the runtime does, and reports imbalance, the predicted ViT speed-up (makespan before /
after), the pixel rows moved and the planning time; ``--plot`` draws per-rank loads.

Speed-ups are always also judged by the architecture-aware model, the closest to measured time, so
``--cost-model quadratic`` shows what planning with the seed's ``l**2`` model really buys.
``--ranks-per-node 8`` plans node-aware and reports the rows and bytes crossing nodes, next to
what node-blind planning of the same step would send.

    python -m fx_vitbal.tools.simulate --ranks 512 --images-per-rank 8 --plot load.png
    python -m fx_vitbal.tools.simulate --ranks 2048 --images-per-rank 8 --ranks-per-node 8
"""

import argparse
import dataclasses
import time
from collections.abc import Sequence

from fx_vitbal.config import COST_MODELS, BalanceConfig, add_vit_balance_args
from fx_vitbal.cost.static import (
    ArchitectureCost,
    CostModel,
    OnlineCost,
    PolynomialCost,
    QuadraticCost,
    choose_cost_model,
)
from fx_vitbal.plan.solve import solve_plan
from fx_vitbal.plan.step import split_units
from fx_vitbal.plan.units import Plan, imbalance
from fx_vitbal.tools.workloads import MIXES, sample_batches

# Qwen2-VL-7B vision_config: embed_dim 1280, mlp_ratio 4, depth 32, 3*2*14*14 inputs per patch,
# merged into the LM's hidden size 3584; every layer attends over whole frames.
QWEN2_VL_7B = ArchitectureCost(hidden=1280, mlp_hidden=5120, depth=32, in_dim=1176, out_dim=3584)
# Bytes a moved pixel row costs at Qwen2-VL-7B's widths in bf16: its 1176 input values go out, and
# its share of the merged output (3584 values per 2x2 = 4 rows) comes back.
BYTES_PER_ROW = 2 * (QWEN2_VL_7B.in_dim + QWEN2_VL_7B.out_dim // 4)
_COST_NAMES = {
    ArchitectureCost: "architecture",
    QuadraticCost: "quadratic",
    PolynomialCost: "polynomial",
    OnlineCost: "online",  # with no timings here, it plans with its prior
}


@dataclasses.dataclass(frozen=True)
class Simulation:
    """One planned step: the plan, and its loads re-costed with the architecture-aware model."""

    plan: Plan
    planner_cost: str
    """Cost model the planner used: ``architecture``, ``quadratic``, ``polynomial`` or ``online``
    (its prior: a single step has no timings yet; ``tools.simulate_online`` feeds some)."""
    num_images: int
    num_units: int
    total_rows: int
    loads_before: list[float]
    """Per-rank architecture-model cost before balancing (what the step would really take)."""
    loads_after: list[float]
    largest_unit: float
    cost_seconds: float
    solve_seconds: float
    unit_rows: list[list[int]] = dataclasses.field(default_factory=list, repr=False)
    """``unit_rows[r][i]``: pixel rows of unit ``i`` of rank ``r`` (for ``inter_node_rows``)."""

    def inter_node_rows(self, ranks_per_node: int) -> int:
        """Rows the plan computes on another node than their home rank's, with
        ``ranks_per_node`` contiguous ranks per node (whatever the plan was solved with)."""
        return sum(
            self.unit_rows[src][idx]
            for dest, assigned in enumerate(self.plan.assignment)
            for src, idx in assigned
            if src // ranks_per_node != dest // ranks_per_node
        )

    @property
    def speedup(self) -> float:
        """Architecture-model makespan before / after: the predicted ViT step speed-up."""
        after = max(self.loads_after)
        return max(self.loads_before) / after if after > 0 else 1.0

    @property
    def lower_bound(self) -> float:
        """No plan beats ``max(mean load, largest unit)``, in architecture-model cost."""
        return max(sum(self.loads_before) / len(self.loads_before), self.largest_unit)


def simulate(
    num_ranks: int,
    images_per_rank: int,
    *,
    mix: str = "realistic",
    seed: int = 0,
    config: BalanceConfig | None = None,
) -> Simulation:
    """Sample one step's grids, cost and plan them as every rank would.

    Raises:
        ValueError: ``num_ranks`` < 1, ``images_per_rank`` < 0 or an unknown ``mix``.
    """
    if num_ranks < 1 or images_per_rank < 0:
        raise ValueError(
            f"need num_ranks >= 1 and images_per_rank >= 0, got {num_ranks}, {images_per_rank}"
        )
    if mix not in MIXES:
        raise ValueError(f"mix must be one of {sorted(MIXES)}, got {mix!r}")
    config = config or BalanceConfig()
    grids = sample_batches(num_ranks, images_per_rank, mix=mix, seed=seed)
    units = [split_units(rank_grids, config.split_frames) for rank_grids in grids]
    planner_cost = choose_cost_model(config.cost_model, config.cost_coeffs, QWEN2_VL_7B)

    start = time.perf_counter()
    costs = _cost(units, planner_cost)
    tokens = [[t * h * w for t, h, w in rank_units] for rank_units in units]
    solve_start = time.perf_counter()
    plan = solve_plan(costs, tokens, config=config)
    solve_end = time.perf_counter()

    true_costs = costs if planner_cost == QWEN2_VL_7B else _cost(units, QWEN2_VL_7B)
    loads_after = [0.0] * num_ranks
    for dest, assigned in enumerate(plan.assignment):
        loads_after[dest] = sum(true_costs[src][idx] for src, idx in assigned)
    return Simulation(
        plan=plan,
        planner_cost=_COST_NAMES[type(planner_cost)],
        num_images=sum(map(len, grids)),
        num_units=sum(map(len, units)),
        total_rows=sum(map(sum, tokens)),
        loads_before=[sum(rank_costs) for rank_costs in true_costs],
        loads_after=loads_after,
        largest_unit=max((c for rank_costs in true_costs for c in rank_costs), default=0.0),
        cost_seconds=solve_start - start,
        solve_seconds=solve_end - solve_start,
        unit_rows=tokens,
    )


def _cost(units: Sequence[Sequence[tuple[int, int, int]]], model: CostModel) -> list[list[float]]:
    memo: dict[tuple[int, int, int], float] = {}  # grids repeat a lot; the runtime memoizes too
    for rank_units in units:
        for unit in rank_units:
            if unit not in memo:
                memo[unit] = model(*unit)
    return [[memo[unit] for unit in rank_units] for rank_units in units]


def report(sim: Simulation, config: BalanceConfig, blind: Simulation | None = None) -> str:
    """The printed summary, one ``name: value`` line per quantity; with ``ranks_per_node`` set,
    the rows crossing nodes, and node-blind planning's (``blind``: the same step planned with
    ``ranks_per_node=None``) for comparison."""
    plan, bound = sim.plan, sim.lower_bound
    lines = [
        f"units: {sim.num_units} ({'frames' if config.split_frames else 'images'}) from "
        f"{sim.num_images} images on {len(plan.loads_before)} ranks",
        f"decision: {plan.reason}",
        f"imbalance: {imbalance(sim.loads_before):.3f} -> {imbalance(sim.loads_after):.3f}",
        f"predicted ViT step speed-up: {sim.speedup:.3f}x (makespan before / after)",
        f"makespan / lower bound: {_relative(max(sim.loads_before), bound):.3f} -> "
        f"{_relative(max(sim.loads_after), bound):.3f}",
        f"pixel rows moved: {plan.moved_tokens / max(1, sim.total_rows):.1%} "
        f"({plan.moved_tokens} of {sim.total_rows})",
        f"planning time: {1e3 * (sim.cost_seconds + sim.solve_seconds):.1f} ms "
        f"(costs {1e3 * sim.cost_seconds:.1f} ms, solve_plan {1e3 * sim.solve_seconds:.1f} ms)",
    ]
    rpn = config.ranks_per_node
    if rpn is not None:
        lines.append(f"inter-node rows ({rpn} ranks per node): {_inter(sim, rpn)}")
    if rpn is not None and blind is not None:
        lines += [
            f"node-blind inter-node rows: {_inter(blind, rpn)}",
            f"node-blind makespan / lower bound: {_relative(max(blind.loads_after), bound):.3f}",
            f"node-blind solve_plan: {1e3 * blind.solve_seconds:.1f} ms",
        ]
    if sim.planner_cost != "architecture":
        lines.insert(
            3,
            f"imbalance as planned ({sim.planner_cost} model): {plan.imbalance_before:.3f} -> "
            f"{plan.imbalance_after:.3f}",
        )
    return "\n".join(lines)


def _inter(sim: Simulation, ranks_per_node: int) -> str:
    rows = sim.inter_node_rows(ranks_per_node)
    return (
        f"{rows / max(1, sim.total_rows):.1%} ({rows} of {sim.total_rows}, "
        f"{rows * BYTES_PER_ROW / 1e9:.2f} GB at Qwen2-VL-7B widths in bf16)"
    )


def _relative(value: float, reference: float) -> float:
    return value / reference if reference > 0 else 1.0


def plot(sim: Simulation, path: str, *, order: str = "sorted", title: str = "") -> None:
    """Per-rank load before and after, relative to the mean, as a PNG (or any matplotlib format).

    ``order="sorted"`` puts ranks in descending order of their load before balancing (each rank
    keeps its position in both curves); ``"rank"`` plots them by rank id.

    Raises:
        ImportError: matplotlib is not installed.
    """
    try:
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError("--plot needs matplotlib: pip install 'fx_vitbal[plot]'") from error
    num_ranks = len(sim.loads_before)
    mean = sum(sim.loads_before) / num_ranks or 1.0
    ranks = list(range(num_ranks))
    if order == "sorted":
        ranks.sort(key=lambda r: -sim.loads_before[r])
    before = [sim.loads_before[r] / mean for r in ranks]
    after = [sim.loads_after[r] / mean for r in ranks]
    fig = Figure(figsize=(9, 4.5), layout="constrained")
    ax = fig.add_subplot()
    xs = range(num_ranks)
    ax.fill_between(xs, before, step="mid", color="0.75", label="before (no balancing)")
    ax.step(xs, after, where="mid", color="tab:blue", lw=1.5, label="after balancing")
    ax.axhline(1.0, color="black", ls=":", lw=1, label="mean (ideal)", zorder=3)
    ax.set_xlim(-0.5, num_ranks - 0.5)
    ax.set_ylim(0, None)
    ax.set_xlabel("ranks, sorted by load before balancing" if order == "sorted" else "rank")
    ax.set_ylabel("ViT load / mean load")
    ax.set_title(title)
    ax.legend(loc="upper right")
    fig.savefig(path, dpi=120)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=512, help="data-parallel ranks")
    parser.add_argument(
        "--images-per-rank",
        type=int,
        default=8,
        help="mean images per rank (each holds 0 to 2x this)",
    )
    parser.add_argument("--mix", choices=sorted(MIXES), default="realistic", help="workload mix")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument(
        "--cost-model",
        dest="dp_balance_cost_model_vit",
        choices=COST_MODELS,
        default=argparse.SUPPRESS,
        help="planner cost model, same as --dp-balance-cost-model-vit (auto = architecture)",
    )
    parser.add_argument(
        "--ranks-per-node",
        dest="dp_balance_ranks_per_node_vit",
        type=int,
        default=argparse.SUPPRESS,
        help="plan node-aware with this many ranks per node and report inter-node rows, same as "
        "--dp-balance-ranks-per-node-vit",
    )
    parser.add_argument("--plot", metavar="PATH", help="write per-rank loads to this image")
    parser.add_argument(
        "--plot-order", choices=("sorted", "rank"), default="sorted", help="x axis of --plot"
    )
    add_vit_balance_args(parser)  # --use-vit-dp-balance is implied: the simulator always plans
    args = parser.parse_args(argv)
    config = BalanceConfig.from_args(args)
    try:
        sim = simulate(
            args.ranks, args.images_per_rank, mix=args.mix, seed=args.seed, config=config
        )
        blind = None
        if config.ranks_per_node is not None:
            blind_config = dataclasses.replace(config, ranks_per_node=None)
            blind = simulate(
                args.ranks, args.images_per_rank, mix=args.mix, seed=args.seed, config=blind_config
            )
    except ValueError as error:
        parser.error(str(error))
    print(
        f"fx_vitbal simulation: {args.ranks} ranks, {args.images_per_rank} images/rank, "
        f"mix {args.mix!r}, seed {args.seed}, Qwen2-VL-7B ViT"
    )
    print(report(sim, config, blind))
    if args.plot:
        title = (
            f"{args.ranks} ranks, {args.images_per_rank} images/rank ({args.mix}): imbalance "
            f"{imbalance(sim.loads_before):.2f} → {imbalance(sim.loads_after):.2f}, "
            f"ViT step {sim.speedup:.2f}x faster"
        )
        plot(sim, args.plot, order=args.plot_order, title=title)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
