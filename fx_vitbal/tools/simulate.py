"""What balancing would do on thousands of ranks, computed without any process group.

The sizes where ViT imbalance hurts most (hundreds to thousands of data-parallel ranks) cannot run
on a workstation, but the planner is pure, deterministic Python: every rank would compute exactly
the plan computed here. This samples per-rank image grids from ``tools.workloads`` (``--add-image
T H W``, repeatable: one more on the first rank), plans the step as the runtime does
(``plan.step.plan_step``, Qwen2-VL-7B's ViT costs and band rule: frames are cut into row bands
where ``--[no-]dp-balance-split-images-vit`` lets it and it pays), and reports imbalance, the
predicted ViT speed-up (makespan before / after), the pixel rows moved, the planning time, the
frames split, their bands and exchanges, the bytes those move per step inside and across nodes
(8 ranks a node unless said), and the most activation memory one rank holds (``cost.memory``);
``--plot`` draws per-rank loads. Speed-ups are judged by the architecture-aware model, the closest
to measured time, whatever the planner used (``--cost-model quadratic``). ``--ranks-per-node 8``
plans node-aware (bands priced where they sit) and reports the rows crossing nodes, next to
node-blind planning of the same step.

    python -m fx_vitbal.tools.simulate --ranks 512 --images-per-rank 8 --plot load.png
    python -m fx_vitbal.tools.simulate --ranks 2048 --images-per-rank 8 --ranks-per-node 8
    python -m fx_vitbal.tools.simulate --ranks 2048 --images-per-rank 2 --ranks-per-node 8 \
        --add-image 1 288 288
"""

import argparse
import collections
import dataclasses
import functools
import time
from collections.abc import Sequence

from fx_vitbal.config import COST_MODELS, BalanceConfig, add_vit_balance_args
from fx_vitbal.cost.memory import held_bytes_per_patch
from fx_vitbal.cost.static import (
    ArchitectureCost,
    OnlineCost,
    PolynomialCost,
    QuadraticCost,
)
from fx_vitbal.plan.band_plan import nodes_of
from fx_vitbal.plan.band_prices import exchange_prices, step_traffic
from fx_vitbal.plan.bands import band_cost
from fx_vitbal.plan.step import StepPlan, plan_step, split_units
from fx_vitbal.plan.units import Plan, imbalance, is_band, unit_rows
from fx_vitbal.runtime.vit.settings import plan_settings, planner_spec_for
from fx_vitbal.tools.workloads import MIXES, sample_batches

# Qwen2-VL-7B vision_config: embed_dim 1280, mlp_ratio 4, depth 32, 3*2*14*14 inputs per patch,
# merged into the LM's hidden size 3584; every layer attends over whole frames.
QWEN2_VL_7B = ArchitectureCost(hidden=1280, mlp_hidden=5120, depth=32, in_dim=1176, out_dim=3584)
# Qwen2-VL-7B's tower runs bands (``BandSupport.of``): bands of whole merge rows (2 patch rows),
# 32 layers attending over whole frames, keys and values 1280 wide, 16 heads.
QWEN2_VL_7B_BANDS = (2, 32, 1280, False, 16)
# Nodes the bytes of bands are split by when planning is node-blind.
REPORT_RANKS_PER_NODE = 8
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
    step: StepPlan | None = dataclasses.field(default=None, repr=False)
    """The planning step's result (its split frames, their bands and exchanges)."""
    band_bytes: tuple[float, float] = (0.0, 0.0)
    """Bytes the bands' exchanges move in the step, forward and backward, inside nodes and
    across them (nodes of ``ranks_per_node``, else ``REPORT_RANKS_PER_NODE``, ranks)."""
    held_bytes: tuple[float, float] = (0.0, 0.0)
    """The most activation bytes one rank holds (``cost.memory``), before and after."""

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
        """No plan of these units beats ``max(mean load, largest unit)`` (a band being a unit),
        in architecture-model cost."""
        return max(sum(self.loads_before) / len(self.loads_before), self.largest_unit)


def simulate(
    num_ranks: int,
    images_per_rank: int,
    *,
    mix: str = "realistic",
    seed: int = 0,
    config: BalanceConfig | None = None,
    add_images: Sequence[Sequence[int]] = (),
    nodes: int | None = None,
) -> Simulation:
    """Sample one step's grids (``add_images``: more grids ``[t, h, w]`` on the first rank),
    cost and plan them as every rank would; bands are judged where they sit with ``nodes``
    ranks a node (default: ``config.ranks_per_node``; the plan may have been node-blind).

    Raises:
        ValueError: ``num_ranks`` < 1, ``images_per_rank`` < 0, an unknown ``mix``, or an added
            image that is not three positive numbers with ``h`` and ``w`` even.
    """
    if num_ranks < 1 or images_per_rank < 0:
        raise ValueError(
            f"need num_ranks >= 1 and images_per_rank >= 0, got {num_ranks}, {images_per_rank}"
        )
    if mix not in MIXES:
        raise ValueError(f"mix must be one of {sorted(MIXES)}, got {mix!r}")
    for grid in add_images:
        if len(grid) != 3 or min(grid) < 1 or grid[1] % 2 or grid[2] % 2:
            raise ValueError(f"an added image is [t, h, w] with h and w even, got {list(grid)}")
    config = config or BalanceConfig()
    grids = sample_batches(num_ranks, images_per_rank, mix=mix, seed=seed)
    grids[0] += [list(grid) for grid in add_images]
    planner = planner_spec_for(config, QWEN2_VL_7B, True, QWEN2_VL_7B_BANDS)
    settings = plan_settings(planner)
    planner_cost = settings.cost_model

    start = time.perf_counter()
    step = plan_step(grids, settings)
    end = time.perf_counter()

    nodes = nodes or config.ranks_per_node
    true_of = _true_costs(step, settings.band_rule, nodes)
    loads_after = [0.0] * num_ranks
    largest = 0.0
    for dest, assigned in enumerate(step.plan.assignment):
        for src, idx in assigned:
            cost = true_of(src, idx)
            loads_after[dest] += cost
            largest = max(largest, cost)
    arch = functools.cache(lambda unit: QWEN2_VL_7B(*unit))  # grids repeat a lot
    whole = [[arch(u) for u in split_units(g, config.split_frames)] for g in grids]
    return Simulation(
        plan=step.plan,
        planner_cost=_COST_NAMES[type(planner_cost)],
        num_images=sum(map(len, grids)),
        num_units=sum(map(len, step.units_R)),
        total_rows=sum(map(sum, step.rows_O)),
        loads_before=[sum(rank_costs) for rank_costs in whole],
        loads_after=loads_after,
        largest_unit=largest,
        cost_seconds=0.0,
        solve_seconds=end - start,
        unit_rows=[[unit_rows(u) for u in units] for units in step.units_R],
        step=step,
        band_bytes=step_traffic(step, settings.band_rule, nodes or REPORT_RANKS_PER_NODE),
        held_bytes=_held_bytes(grids, step, held_bytes_per_patch(QWEN2_VL_7B)),
    )


def _true_costs(step: StepPlan, rule, ranks_per_node: int | None):
    """``cost(rank, index)`` of each unit a rank holds under Qwen2-VL-7B's architecture model:
    a band its share of its frame plus its exchange at H100 rates where it sits."""
    priced: dict[tuple[int, int], float] = {}
    for name, indices in step.frames.items():
        prices = exchange_prices(rule, macs=True, ranks_per_node=ranks_per_node)
        nodes = nodes_of([step.computed_by(name[0], i) for i in indices], ranks_per_node)
        sizes = [step.units_O[name[0]][i].h * step.units_O[name[0]][i].w for i in indices]
        got = prices.frame_prices(sizes, step.exchanges[name], nodes)
        priced.update(((name[0], i), p) for i, p in zip(indices, got, strict=True))

    def cost_of(rank: int, idx: int) -> float:
        owner = rank if step.sets is None else step.set_of[rank]
        index = idx if step.sets is None else step.held[rank][idx]
        u = step.units_O[owner][index]
        if not is_band(u):
            return QWEN2_VL_7B(*u)
        return band_cost(QWEN2_VL_7B(1, u.full_h, u.w), u) + priced[(owner, index)]

    return cost_of


def _held_bytes(grids, step: StepPlan, held: int) -> tuple[float, float]:
    """``Simulation.held_bytes``: per rank, the patches it computes times ``held`` a patch."""
    before = max(sum(t * h * w for t, h, w in rank_grids) for rank_grids in grids)
    after = [0] * len(step.units_R)
    for dest, assigned in enumerate(step.plan.assignment):
        for src, idx in assigned:
            after[dest] += unit_rows(step.units_R[src][idx])
    return float(before * held), float(max(after) * held)


def report(sim: Simulation, config: BalanceConfig, blind: Simulation | None = None) -> str:
    """The printed summary, one ``name: value`` line per quantity; with ``ranks_per_node`` set,
    the rows crossing nodes, and node-blind planning's (``blind``: the same step planned with
    ``ranks_per_node=None``) for comparison."""
    plan, bound = sim.plan, sim.lower_bound
    frames = sim.step.frames if sim.step is not None else {}
    num_bands = sum(map(len, frames.values()))
    lines = [
        f"units: {sim.num_units} ({'frames' if config.split_frames else 'images'}"
        f"{f', {num_bands} of them bands' if frames else ''}) from "
        f"{sim.num_images} images on {len(plan.loads_before)} ranks",
        f"decision: {plan.reason}",
        f"imbalance: {imbalance(sim.loads_before):.3f} -> {imbalance(sim.loads_after):.3f}",
        f"predicted ViT step speed-up: {sim.speedup:.3f}x (makespan before / after)",
        f"makespan / lower bound: {_relative(max(sim.loads_before), bound):.3f} -> "
        f"{_relative(max(sim.loads_after), bound):.3f}",
        f"pixel rows moved: {plan.moved_tokens / max(1, sim.total_rows):.1%} "
        f"({plan.moved_tokens} of {sim.total_rows})",
        f"planning time: {1e3 * sim.solve_seconds:.1f} ms (plan_step: costs, plan and bands)",
    ]
    if config.split_images:
        per_frame = collections.Counter(map(len, frames.values()))
        kinds = collections.Counter(sim.step.exchanges.values()) if frames else {}
        rpn = config.ranks_per_node or REPORT_RANKS_PER_NODE
        lines += [
            f"frames split: {len(frames)}"
            + (
                f" (bands per frame: {_counts(per_frame)}; exchanges: {_counts(kinds)})"
                if frames
                else ""
            ),
            f"band exchange bytes per step ({rpn} ranks a node): "
            f"{sim.band_bytes[0] / 1e9:.2f} GB inside nodes, {sim.band_bytes[1] / 1e9:.2f} GB "
            "across nodes",
        ]
    lines.append(
        f"most activation memory on one rank: {sim.held_bytes[0] / 2**30:.1f} -> "
        f"{sim.held_bytes[1] / 2**30:.1f} GiB (bf16, no checkpointing: cost.memory)"
    )
    rpn = config.ranks_per_node
    if rpn is not None:
        lines.append(f"inter-node rows ({rpn} ranks per node): {_inter(sim, rpn)}")
    if rpn is not None and blind is not None:
        lines += [
            f"node-blind inter-node rows: {_inter(blind, rpn)}",
            f"node-blind makespan / lower bound: {_relative(max(blind.loads_after), bound):.3f}",
            f"node-blind planning time: {1e3 * blind.solve_seconds:.1f} ms",
        ]
    if sim.planner_cost != "architecture":
        lines.insert(
            3,
            f"imbalance as planned ({sim.planner_cost} model): {plan.imbalance_before:.3f} -> "
            f"{plan.imbalance_after:.3f}",
        )
    return "\n".join(lines)


def _counts(counter) -> str:
    """``{16: 1, 3: 2}`` as ``16 x1, 3 x2`` (most common first, then by value)."""
    return ", ".join(
        f"{k} x{n}" for k, n in sorted(counter.items(), key=lambda kn: (-kn[1], str(kn[0])))
    )


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
    parser.add_argument(
        "--add-image",
        nargs=3,
        type=int,
        action="append",
        default=[],
        metavar=("T", "H", "W"),
        help="one more image of grid [T, H, W] patches on the first rank (repeatable)",
    )
    parser.add_argument("--plot", metavar="PATH", help="write per-rank loads to this image")
    parser.add_argument(
        "--plot-order", choices=("sorted", "rank"), default="sorted", help="x axis of --plot"
    )
    add_vit_balance_args(parser)  # --use-vit-dp-balance is implied: the simulator always plans
    args = parser.parse_args(argv)
    config = BalanceConfig.from_args(args)
    try:
        step = functools.partial(
            simulate,
            args.ranks,
            args.images_per_rank,
            mix=args.mix,
            seed=args.seed,
            add_images=args.add_image,
        )
        sim, blind = step(config=config), None
        if config.ranks_per_node is not None:  # the same step planned node-blind, judged alike
            blind_config = dataclasses.replace(config, ranks_per_node=None)
            blind = step(config=blind_config, nodes=config.ranks_per_node)
    except ValueError as error:
        parser.error(str(error))
    print(
        f"fx_vitbal simulation: {args.ranks} ranks, {args.images_per_rank} images/rank, "
        f"mix {args.mix!r}, seed {args.seed}, Qwen2-VL-7B ViT"
        + "".join(f", +[{t}, {h}, {w}] on rank 0" for t, h, w in args.add_image)
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
