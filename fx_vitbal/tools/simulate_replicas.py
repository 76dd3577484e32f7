"""Replica sets: what computing each unit once across a group would save, without a process group.

Under context parallelism, Ulysses sequence parallelism or an encoder group spanning tensor-parallel
ranks, the ``r`` ranks of a replica set hold the same batch and each runs the whole ViT on it.
This samples one batch per set (``tools.workloads``), costs its units as ``tools.simulate`` does
(video frames as units, Qwen2-VL-7B ``ArchitectureCost``) and compares four ways to compute them:

- ``replicated``: every replica computes its whole set (today, under CP / SP).
- ``count split``: a set's units dealt by count in contiguous chunks, the tail replica taking the
  remainder (Megatron-Core's ``split_to_context_parallel_ranks_dynamic_res``, Bridge's
  ``vision_dp_over_cp``).
- ``LPT in set``: a set's units by cost over its own replicas only.
- ``one plan``: the runtime's (``replica_group``): each unit gets a holder replica in its set
  (``LPT in set``), then ``solve_plan`` balances all ``N = dp * r`` ranks from those holdings
  (``plan.replicas.solve_for_sets``).

It simulates the plans, not the exchange. Set ``s`` is ranks ``s*r`` to
``s*r + r - 1``; every replica holds the set's pixels, so a unit computed anywhere in its set moves
no pixel, and only rows leaving their set count as moved. A moved row crosses nodes when no
replica of its set is on the computing rank's node (the sender can be any replica).

    python -m fx_vitbal.tools.simulate_replicas --dp 8 --replicas 2 --images-per-set 4 --seeds 3
"""

import argparse
import dataclasses
import statistics
from collections.abc import Callable, Sequence

from fx_vitbal.config import BalanceConfig
from fx_vitbal.plan.replicas import holders, solve_for_sets
from fx_vitbal.plan.step import split_units
from fx_vitbal.tools.simulate import QWEN2_VL_7B
from fx_vitbal.tools.workloads import MIXES, sample_batches

# A unit of the group: (set, index in the set's units).
UnitId = tuple[int, int]


@dataclasses.dataclass(frozen=True)
class Step:
    """One sampled step: each replica set's units, their architecture-model costs and rows."""

    replicas: int
    ranks_per_node: int
    units: list[list[tuple[int, int, int]]]
    """``units[s]``: set ``s``'s ``(t, h, w)`` units (a video's frames), held by every replica."""
    costs: list[list[float]]
    rows: list[list[int]]

    @property
    def num_sets(self) -> int:
        return len(self.units)

    @property
    def num_ranks(self) -> int:
        return self.num_sets * self.replicas

    @property
    def total(self) -> float:
        """Every set's units counted once: the work one computation of the batch takes."""
        return sum(map(sum, self.costs))

    @property
    def mean(self) -> float:
        """``total / N``: the load of a perfect split of that work over all ranks."""
        return self.total / self.num_ranks

    @property
    def lower_bound(self) -> float:
        """No strategy's makespan over the mean is below this: ``max(1, largest unit / mean)``."""
        largest = max((c for set_costs in self.costs for c in set_costs), default=0.0)
        return max(1.0, largest / self.mean) if self.mean > 0 else 1.0

    def set_of(self, rank: int) -> int:
        return rank // self.replicas


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What one strategy does with a step."""

    computed: list[list[UnitId]]
    """``computed[d]``: the units rank ``d`` computes."""
    loads: list[float]
    moved_rows: int
    """Rows computed outside their set: the pixels that must be sent."""
    crossing_rows: int
    """Moved rows computed on a node that holds no replica of their set."""
    makespan: float
    """``max(loads) / (total / N)``."""


def sample_step(
    dp: int,
    replicas: int,
    images_per_set: int,
    *,
    mix: str = "realistic",
    seed: int = 0,
    ranks_per_node: int = 8,
) -> Step:
    """Sample one batch per replica set and cost its units.

    Raises:
        ValueError: ``dp``, ``replicas`` or ``ranks_per_node`` < 1, ``images_per_set`` < 0 or an
            unknown ``mix``.
    """
    if dp < 1 or replicas < 1 or ranks_per_node < 1 or images_per_set < 0:
        raise ValueError(
            "need dp, replicas, ranks_per_node >= 1 and images_per_set >= 0, got "
            f"{dp}, {replicas}, {ranks_per_node}, {images_per_set}"
        )
    if mix not in MIXES:
        raise ValueError(f"mix must be one of {sorted(MIXES)}, got {mix!r}")
    grids = sample_batches(dp, images_per_set, mix=mix, seed=seed)
    units = [split_units(set_grids, split_frames=True) for set_grids in grids]
    memo = {u: QWEN2_VL_7B(*u) for set_units in units for u in set_units}  # grids repeat a lot
    return Step(
        replicas=replicas,
        ranks_per_node=ranks_per_node,
        units=units,
        costs=[[memo[u] for u in set_units] for set_units in units],
        rows=[[t * h * w for t, h, w in set_units] for set_units in units],
    )


def replicated(step: Step) -> list[list[UnitId]]:
    """Every replica computes every unit of its set (each unit ``r`` times in the group)."""
    return [
        [(s, i) for i in range(len(step.units[s]))]
        for s in range(step.num_sets)
        for _ in range(step.replicas)
    ]


def count_split(step: Step) -> list[list[UnitId]]:
    """Megatron-Core's split: ``n // r`` contiguous units per replica, the rest on the last one
    (so ``n < r`` puts them all there: Megatron pads the others with a dummy image)."""
    computed = []
    for s, set_units in enumerate(step.units):
        per = len(set_units) // step.replicas
        for j in range(step.replicas):
            end = len(set_units) if j == step.replicas - 1 else (j + 1) * per
            computed.append([(s, i) for i in range(j * per, end)])
    return computed


def lpt_in_set(step: Step) -> list[list[UnitId]]:
    """Each set's units by cost over its own replicas only (``plan.replicas.holders``: largest
    first, each to the least loaded replica), so every rank computes the same split."""
    computed = []
    for s, set_costs in enumerate(step.costs):
        held = holders(set_costs, step.replicas)
        computed += [[(s, i) for i, j in enumerate(held) if j == k] for k in range(step.replicas)]
    return computed


def one_plan(step: Step, config: BalanceConfig | None = None) -> list[list[UnitId]]:
    """The runtime's plan (``plan.replicas.solve_for_sets``): ``solve_plan`` over all ranks,
    each holding the units ``lpt_in_set`` gives it.

    The planner counts a move to another replica of the same set as a move; it is not one (that
    replica has the pixels too), which ``evaluate`` accounts for, not the plan.

    Args:
        config: the planner's; by default always plans (no trigger, no minimum gain), node-aware
            with ``step.ranks_per_node``.
    """
    if config is None:
        config = BalanceConfig(
            trigger_threshold=0.0, min_gain=0.0, ranks_per_node=step.ranks_per_node
        )
    r = step.replicas
    sets = [list(range(s * r, (s + 1) * r)) for s in range(step.num_sets)]
    plan, held = solve_for_sets(step.costs, step.rows, sets, config=config)
    return [[(src // r, held[src][idx]) for src, idx in assigned] for assigned in plan.assignment]


STRATEGIES: dict[str, Callable[[Step], list[list[UnitId]]]] = {
    "replicated": replicated,
    "count split": count_split,
    "LPT in set": lpt_in_set,
    "one plan": one_plan,
}


def evaluate(step: Step, computed: Sequence[Sequence[UnitId]]) -> Outcome:
    """Loads, makespan and traffic of an assignment of the step's units to ranks."""
    rpn, r = step.ranks_per_node, step.replicas
    loads, moved, crossing = [], 0, 0
    for d, units in enumerate(computed):
        loads.append(sum(step.costs[s][i] for s, i in units))
        node = d // rpn
        for s, i in units:
            if s != step.set_of(d):
                moved += step.rows[s][i]
                # The set's replicas span nodes s*r // rpn to (s*r + r - 1) // rpn.
                if not s * r // rpn <= node <= (s * r + r - 1) // rpn:
                    crossing += step.rows[s][i]
    mean = step.mean
    return Outcome(
        computed=[list(units) for units in computed],
        loads=loads,
        moved_rows=moved,
        crossing_rows=crossing,
        makespan=max(loads) / mean if mean > 0 else 1.0,
    )


@dataclasses.dataclass(frozen=True)
class Summary:
    """One strategy's means over seeds; rows as fractions of all rows (each set's counted once)."""

    makespan: float
    moved: float
    crossing: float


def summarize(
    dp: int,
    replicas: int,
    images_per_set: int,
    *,
    mix: str = "realistic",
    seeds: Sequence[int] = (0, 1, 2),
    ranks_per_node: int = 8,
) -> tuple[float, dict[str, Summary]]:
    """The mean lower bound and each strategy's ``Summary`` over ``seeds``.

    Raises:
        ValueError: as ``sample_step``, or no seeds.
    """
    if not seeds:
        raise ValueError("need at least one seed")
    bounds, results = [], {name: [] for name in STRATEGIES}
    for seed in seeds:
        step = sample_step(
            dp, replicas, images_per_set, mix=mix, seed=seed, ranks_per_node=ranks_per_node
        )
        bounds.append(step.lower_bound)
        rows = max(1, sum(map(sum, step.rows)))
        for name, strategy in STRATEGIES.items():
            out = evaluate(step, strategy(step))
            results[name].append((out.makespan, out.moved_rows / rows, out.crossing_rows / rows))
    summaries = {
        name: Summary(*(statistics.fmean(column) for column in zip(*values, strict=True)))
        for name, values in results.items()
    }
    return statistics.fmean(bounds), summaries


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=8, help="replica sets (data-parallel size)")
    parser.add_argument("--replicas", type=int, default=2, help="ranks per set (CP / SP size)")
    parser.add_argument(
        "--images-per-set", type=int, default=4, help="mean images per set (0 to 2x this)"
    )
    parser.add_argument("--mix", choices=sorted(MIXES), default="realistic", help="workload mix")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0 to N-1; means are printed")
    parser.add_argument("--ranks-per-node", type=int, default=8, help="contiguous ranks per node")
    args = parser.parse_args(argv)
    try:
        bound, summaries = summarize(
            args.dp,
            args.replicas,
            args.images_per_set,
            mix=args.mix,
            seeds=range(args.seeds),
            ranks_per_node=args.ranks_per_node,
        )
    except ValueError as error:
        parser.error(str(error))
    print(
        f"fx_vitbal replica sets (simulated): {args.dp} sets x {args.replicas} replicas, "
        f"~{args.images_per_set} images per set, mix {args.mix!r}, {args.ranks_per_node} ranks "
        f"per node, Qwen2-VL-7B ViT, mean of {args.seeds} seeds"
    )
    print(f"lower bound (makespan / mean): {bound:.3f}")
    for name, summary in summaries.items():
        print(
            f"{name}: makespan / mean {summary.makespan:.3f}, rows moved {summary.moved:.1%}, "
            f"rows crossing nodes {summary.crossing:.1%}"
        )


if __name__ == "__main__":
    main()
