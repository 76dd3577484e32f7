"""The planner's data: units as flat arrays, candidate assignments with their per-rank sums,
the row cap, and the ``Plan`` every rank gets.

Per-plan sums (loads, rows, the plan's lists) start from each rank's home values and revisit only
the ranks moves touch: plans move few units, and per-unit Python loops are what planning time is
made of.
"""

import bisect
import collections
import dataclasses
import math
import operator
from collections.abc import Sequence
from itertools import accumulate, chain, compress, pairwise, repeat
from typing import NamedTuple


@dataclasses.dataclass(frozen=True)
class Plan:
    """Which rank computes which unit, and what that is predicted to achieve.

    ``assignment[d]`` lists the ``(src_rank, local_idx)`` units computed on rank ``d``, sorted by
    ``(src_rank, local_idx)`` so received data arrives in plan order without a permutation.
    """

    assignment: list[list[tuple[int, int]]]
    applied: bool
    reason: str
    """``applied``, ``balanced`` (below the trigger), ``no-gain``, ``cap`` (every plan found breaks
    the row cap the current layout keeps), ``dominant-unit`` (seed rule), ``single-rank``,
    ``empty`` or ``exchange`` (measured times: the exchange would cost more than it saves)."""
    loads_before: list[float]
    loads_after: list[float]
    imbalance_before: float
    imbalance_after: float
    moved_tokens: int
    cap_respected: bool = True
    """False when no assignment found keeps every rank under the row cap. Only an explicit
    ``max_len_ratio`` can do that: the default cap is one the current layout keeps."""
    inter_node_tokens: int = 0
    """Pixel rows computed on another node than their home rank's (nodes of
    ``BalanceConfig.ranks_per_node`` contiguous ranks); 0 when ``ranks_per_node`` is None."""

    def destinations(self, num_units: Sequence[int]) -> list[list[int]]:
        """``dest[r][i]``: the rank computing unit ``i`` of rank ``r``."""
        dest = [[r] * n for r, n in enumerate(num_units)]
        for d, units in enumerate(self.assignment):
            for src, idx in units:
                dest[src][idx] = d
        return dest


def imbalance(loads: Sequence[float]) -> float:
    """``max(loads) / mean(loads) - 1`` (0 for all-zero loads)."""
    total = sum(loads)
    return max(loads) * len(loads) / total - 1.0 if total > 0 else 0.0


class Candidate(NamedTuple):
    """An assignment (``dest[u]``: the rank computing unit ``u``) with what the planner weighs:
    its loads, summed afresh (``sum_loads``), whether it keeps the row cap, and the units on the
    ranks its moves touch (``touched_ranks``; None: not grouped yet, see ``rank_groups``), which
    the plan's lists are made from, with every rank's rows."""

    dest: list[int]
    loads: list[float]
    cap_respected: bool
    touched: dict[int, list[int]] | None
    rows: list[int]


class Units:
    """Flat arrays over all units of all ranks; unit ``u`` is ``pairs[u] = (src, idx)``, and rank
    ``r``'s units are ``starts[r]`` to ``starts[r + 1] - 1``.

    Built with C-level iterators, and with each rank's home cost and rows, because plans move few
    units: per-plan sums start from the home ones and visit only the ranks moves touch.
    """

    def __init__(self, costs: Sequence[Sequence[float]], tokens: Sequence[Sequence[int]]):
        self.num_ranks = len(costs)
        self.counts = list(map(len, costs))
        self.starts = [0, *accumulate(self.counts)]
        self.src = list(chain.from_iterable(map(repeat, range(self.num_ranks), self.counts)))
        # ``(src, idx)`` of each unit: what plans list.
        self.pairs = list(zip(self.src, chain.from_iterable(map(range, self.counts)), strict=True))
        self.cost = list(map(float, chain.from_iterable(costs)))
        self.tokens = list(map(int, chain.from_iterable(tokens)))
        spans = list(pairwise(self.starts))  # rank r's ids: range(*spans[r])
        # Summed in id order from 0.0, as ``sum_loads`` sums the ranks a plan touches.
        self.home_cost = [sum(self.cost[a:b]) for a, b in spans]
        self.home_rows = [sum(self.tokens[a:b]) for a, b in spans]

    def by_cost_desc(self) -> list[int]:
        """Unit ids by cost, descending; ties by (src, idx), i.e. by id (the sort is stable)."""
        negated = [-c for c in self.cost]
        return sorted(range(len(negated)), key=negated.__getitem__)


def validate_inputs(costs, tokens, history) -> None:
    if len(costs) == 0:
        raise ValueError("solve_plan needs at least one rank, got costs for 0 ranks")
    if len(tokens) != len(costs):
        raise ValueError(f"costs has {len(costs)} ranks but tokens has {len(tokens)}")
    # Whole-input checks in C first; the per-rank loop only runs to name what is wrong.
    if (
        list(map(len, costs)) != list(map(len, tokens))
        or not all(map(math.isfinite, chain.from_iterable(costs)))
        or min(chain.from_iterable(costs), default=0) < 0
        or min(chain.from_iterable(tokens), default=0) < 0
    ):
        _name_invalid_rank(costs, tokens)
    if history is not None:
        if len(history) != len(costs):
            raise ValueError(f"history has {len(history)} ranks, expected {len(costs)}")
        if not all(math.isfinite(h) and h >= 0 for h in history):
            raise ValueError(f"history must be finite and >= 0, got {list(history)!r}")


def _name_invalid_rank(costs, tokens) -> None:
    for r, (rank_costs, rank_tokens) in enumerate(zip(costs, tokens, strict=True)):
        if len(rank_costs) != len(rank_tokens):
            raise ValueError(
                f"rank {r}: {len(rank_costs)} costs but {len(rank_tokens)} token counts"
            )
        if rank_costs and not (all(map(math.isfinite, rank_costs)) and min(rank_costs) >= 0):
            raise ValueError(f"rank {r}: costs must be finite and >= 0, got {list(rank_costs)!r}")
        if rank_tokens and min(rank_tokens) < 0:
            raise ValueError(f"rank {r}: token counts must be >= 0, got {list(rank_tokens)!r}")


def moved_units(dest: list[int], units: Units) -> list[int]:
    """Ids of the units ``dest`` computes away from home, ascending (found in C)."""
    return list(compress(range(len(dest)), map(operator.ne, dest, units.src)))


def touched_ranks(dest: list[int], units: Units, moves: list[int]) -> dict[int, list[int]]:
    """The units (ascending ids: ``(src, idx)`` order) that ``dest`` puts on each rank that
    ``moves`` sends a unit to or from; every other rank computes its own units.

    Units leaving or reaching those ranks stay among them, so a stable sort of their home units
    by ``dest`` groups them, in C, whether few ranks or all take part."""
    src, starts = units.src, units.starts
    ranks = sorted({src[u] for u in moves} | {dest[u] for u in moves})
    ids = list(chain.from_iterable(range(starts[r], starts[r + 1]) for r in ranks))
    ids.sort(key=dest.__getitem__)
    owners = list(map(dest.__getitem__, ids))
    bounds = [*(bisect.bisect_left(owners, r) for r in ranks), len(ids)]
    return {r: ids[bounds[i] : bounds[i + 1]] for i, r in enumerate(ranks)}


def sum_loads(units: Units, base: list[float], touched: dict[int, list[int]]) -> list[float]:
    """Per-rank loads of an assignment whose ``touched`` ranks hold those units (``touched_ranks``),
    the others their own: history plus the rank's costs summed in id order (the same bits for
    the same assignment however it was reached)."""
    loads = list(map(operator.add, base, units.home_cost))
    for r, ids in touched.items():
        loads[r] = base[r] + sum(map(units.cost.__getitem__, ids))
    return loads


def _rows_and_counts(units: Units, touched: dict[int, list[int]]) -> tuple[list[int], list[int]]:
    """Per-rank rows and unit counts, the home ones but on the ranks moves touch."""
    rows, counts = units.home_rows[:], units.counts[:]
    for r, ids in touched.items():
        rows[r] = sum(map(units.tokens.__getitem__, ids))
        counts[r] = len(ids)
    return rows, counts


def row_cap(units: Units, ratio: float | None) -> float:
    """The most pixel rows a rank may compute (``config.max_len_ratio``); ``math.inf``: no cap.

    ``None`` caps at the fullest rank's current rows: the layout the job already fits in. Rows
    are integers, so flooring ``mean * ratio`` changes no comparison and keeps row room exact.
    """
    if ratio is None:
        return max(units.home_rows)
    if ratio == math.inf:
        return math.inf
    return math.floor(sum(units.tokens) / units.num_ranks * ratio)


def cap_unkeepable(units: Units, cap: float) -> bool:
    """Whether no assignment at all keeps the cap (``max_len_ratio=1.0`` with no unit above it,
    typically: the rows exceed ``ranks * floor(mean)``).

    At best the units above the cap sit alone and every other rank is full to the cap, so more
    rows than that fit in no assignment.
    """
    excess = sum(n - cap for n in units.tokens if n > cap)
    return sum(units.tokens) > cap * units.num_ranks + excess


def row_rooms(rank_tokens: list[int], rank_units: list[int], cap: float) -> list[float]:
    """Rows each rank can still take. An empty rank may always hold one unit alone, however
    large (the cap's documented exception)."""
    return [cap - n if k else math.inf for n, k in zip(rank_tokens, rank_units, strict=True)]


def make_candidate(dest: list[int], units: Units, base: list[float], cap: float) -> Candidate:
    """``dest`` with its fresh loads (running sums may differ in the last bits) and row check."""
    moves = moved_units(dest, units)
    if 4 * len(moves) <= len(dest):
        touched = touched_ranks(dest, units, moves)
        loads = sum_loads(units, base, touched)
        rows, counts = _rows_and_counts(units, touched)
    else:  # most units move (LPT): one pass over them all; grouped only if a plan needs it
        touched = None
        costs, rows = [0.0] * units.num_ranks, [0] * units.num_ranks
        for d, c, n in zip(dest, units.cost, units.tokens, strict=True):
            costs[d] += c  # in id order from 0.0: the bits ``sum_loads`` gives
            rows[d] += n
        loads = list(map(operator.add, base, costs))
        counts = collections.Counter(dest)  # counted in C
    return Candidate(dest, loads, keeps_row_cap(rows, counts, cap), touched, rows)


def rank_groups(candidate: Candidate, units: Units) -> dict[int, list[int]]:
    """The units (ascending ids) of each rank the candidate's moves touch: ``touched``, or every
    rank's, grouped now when ``make_candidate`` left that for later."""
    if candidate.touched is not None:
        return candidate.touched
    held: list[list[int]] = [[] for _ in range(units.num_ranks)]
    for u, d in enumerate(candidate.dest):
        held[d].append(u)
    return dict(enumerate(held))


def keeps_row_cap(rows: list[int], counts: Sequence[int], cap: float) -> bool:
    """No rank above ``cap`` rows, but for ranks holding a single unit."""
    return all(counts[r] <= 1 for r, n in enumerate(rows) if n > cap)


def make_plan(
    candidate: Candidate,
    units: Units,
    base: list[float],
    loads_before: list[float],
    applied: bool,
    reason: str,
    ranks_per_node: int | None = None,
) -> Plan:
    dest, loads_after = candidate.dest, candidate.loads
    groups = rank_groups(candidate, units)
    if candidate.touched is None:  # the refinement's running sums: summed afresh
        loads_after = sum_loads(units, base, groups)
    # Ranks no move touches compute their own units, in order: slices of the home pairs.
    starts, pairs = units.starts, units.pairs
    assignment = list(map(pairs.__getitem__, map(slice, starts, starts[1:])))
    for r, ids in groups.items():
        assignment[r] = list(map(pairs.__getitem__, ids))
    return Plan(
        assignment=assignment,
        applied=applied,
        reason=reason,
        loads_before=loads_before,
        loads_after=loads_after,
        imbalance_before=imbalance(loads_before),
        imbalance_after=imbalance(loads_after),
        moved_tokens=moved_rows(dest, units),
        cap_respected=candidate.cap_respected,
        inter_node_tokens=inter_node_rows(dest, units, ranks_per_node),
    )


def moved_rows(dest: list[int], units: Units) -> int:
    return sum(map(units.tokens.__getitem__, moved_units(dest, units)))


def inter_node_rows(dest: list[int], units: Units, ranks_per_node: int | None) -> int:
    """Rows computed on another node than their home rank's (rank ``r`` on node
    ``r // ranks_per_node``); 0 when nodes are unknown (``None``)."""
    if ranks_per_node is None:
        return 0
    src, tokens = units.src, units.tokens
    return sum(
        tokens[u]
        for u in moved_units(dest, units)
        if dest[u] // ranks_per_node != src[u] // ranks_per_node
    )


def plan_crossing_rows(plan: Plan, units_R: Sequence[Sequence[tuple[int, int, int]]]):
    """Per rank, pixel rows it sends to other ranks and rows it receives from them under
    ``plan``, from every rank's ``(t, h, w)`` units (``crossing_rows`` on the planner's arrays)."""
    world = len(units_R)
    send, recv = [0] * world, [0] * world
    for d, assigned in enumerate(plan.assignment):
        for src, idx in assigned:
            if src != d:
                t, h, w = units_R[src][idx]
                send[src] += t * h * w
                recv[d] += t * h * w
    return send, recv


def crossing_rows(dest: list[int], units: "Units") -> tuple[list[int], list[int]]:
    """Per rank, rows sent to other ranks and rows received from them under ``dest``."""
    send, recv = [0] * units.num_ranks, [0] * units.num_ranks
    for u, d in enumerate(dest):
        if d != units.src[u]:
            send[units.src[u]] += units.tokens[u]
            recv[d] += units.tokens[u]
    return send, recv
