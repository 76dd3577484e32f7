"""The row cap, candidate assignments (as the units they move), and the ``Plan`` made of the one
chosen.

A candidate lists only the units computed away from home, with every rank's fixed-point load,
rows and unit count kept exact move by move. The plan's lists and reported float loads are
rebuilt only on the ranks those moves touch: every other rank computes its own units, in order.

Each function that reads every unit or every move has two executions side by side: torch ops for
large inputs, Python lists for small ones (``Units.small``); ``test_planner`` proves them equal.
"""

import math
import operator
from array import array
from collections.abc import Sequence
from functools import reduce
from itertools import accumulate, compress, pairwise, repeat
from typing import NamedTuple

import torch

from fx_vitbal.plan.assignment import Assignment
from fx_vitbal.plan.units import (
    Plan,
    Units,
    imbalance_of,
    int_tensor,
    keeps_row_cap,
    sequential_sums,
)


def row_cap(units: Units, ratio: float | None, max_rows: float = math.inf) -> float:
    """The most pixel rows a rank may compute (``config.max_len_ratio``), and at most
    ``max_rows`` (a memory budget's: ``plan.step.PlanSettings.max_rows``); ``math.inf``: no cap.

    ``None`` caps at the fullest rank's current rows: the layout the job already fits in. Rows
    are integers, so flooring ``mean * ratio`` changes no comparison and keeps row room exact.
    """
    if ratio is None:
        cap = max(units.home_rows) if units.small else int(units.home_rows_R.max())
    elif ratio == math.inf:
        cap = math.inf
    else:
        cap = math.floor(units.total_tokens / units.num_ranks * ratio)
    return min(cap, max_rows)


def cap_unkeepable(units: Units, cap: float) -> bool:
    """Whether no assignment at all keeps the cap (``max_len_ratio=1.0`` with no unit above it,
    typically: the rows exceed ``ranks * floor(mean)``).

    At best the units above the cap sit alone and every other rank is full to the cap, so more
    rows than that fit in no assignment.
    """
    if cap == math.inf:
        return False
    if units.small:
        excess = sum(map(max, repeat(0), map(operator.sub, units.tokens, repeat(cap))))
    else:
        excess = int((units.tokens_U - cap).clamp(min=0).sum())
    return units.total_tokens > cap * units.num_ranks + excess


class Candidate(NamedTuple):
    """An assignment and what the planner weighs: ``moves[u]`` is the rank computing unit ``u``
    for every unit away from home; ``loads`` (fixed point), ``rows`` and ``counts`` are every
    rank's under it; ``makespan`` the largest load; ``cap_respected`` whether it keeps the row
    cap."""

    moves: dict[int, int]
    loads: list[int]
    rows: list[int]
    counts: list[int]
    makespan: int
    cap_respected: bool


def moves_of(ids: list[int], placed: list[int], homes: list[int]) -> dict[int, int]:
    """``{unit: rank}`` for the placed units that left home (in C)."""
    return dict(compress(zip(ids, placed, strict=True), map(operator.ne, placed, homes)))


def make_candidate(
    moves: dict[int, int], loads: list[int], rows: list[int], counts: list[int], cap: float
) -> Candidate:
    """A candidate of its moves and every rank's load, rows and unit count under them."""
    return Candidate(moves, loads, rows, counts, max(loads), keeps_row_cap(rows, counts, cap))


def candidate_from_dest(dest: Sequence[int], units: Units, cap: float) -> Candidate:
    """The candidate of a full assignment (``dest[u]``: the rank computing unit ``u``), as the
    greedy passes that deal every unit make them."""
    if units.small:
        loads, rows, counts = units.base_fixed[:], [0] * units.num_ranks, [0] * units.num_ranks
        cost, tokens, src, moves = units.cost, units.tokens, units.src, {}
        for u, d in enumerate(dest):
            loads[d] += cost[u]
            rows[d] += tokens[u]
            counts[d] += 1
            if d != src[u]:
                moves[u] = d
        return make_candidate(moves, loads, rows, counts, cap)
    dest_U = int_tensor(list(dest))
    num_ranks = units.num_ranks
    zeros = torch.zeros(num_ranks, dtype=torch.int64)
    loads = zeros.index_add(0, dest_U, units.cost_U).tolist()
    loads = [b + x for b, x in zip(units.base_fixed, loads, strict=True)]
    rows = zeros.index_add(0, dest_U, units.tokens_U).tolist()
    counts = torch.bincount(dest_U, minlength=num_ranks).tolist()
    away = (dest_U != units.src_U).nonzero().squeeze(1)
    moves = dict(zip(away.tolist(), dest_U[away].tolist(), strict=True))
    return make_candidate(moves, loads, rows, counts, cap)


def full_dest(candidate: Candidate, units: Units) -> list[int]:
    """``dest[u]`` for every unit (for the passes that need it)."""
    dest = units.src[:]
    for u, d in candidate.moves.items():
        dest[u] = d
    return dest


def _moved(candidate: Candidate, units: Units) -> tuple[list[int], list[int], list[int]]:
    """Sources, destinations and rows of the moved units, in ``moves`` order."""
    if units.small:
        moved = list(candidate.moves)
        src, tokens = units.src, units.tokens
        return [src[u] for u in moved], list(candidate.moves.values()), [tokens[u] for u in moved]
    ids = int_tensor(list(candidate.moves))
    return (
        units.src_U[ids].tolist(),
        list(candidate.moves.values()),
        units.tokens_U[ids].tolist(),
    )


def rows_away(
    candidate: Candidate, units: Units, ranks_per_node: int | None = None
) -> tuple[int, int]:
    """Pixel rows computed away from home, and how many of them on another node than their home
    rank's (rank ``r`` on node ``r // ranks_per_node``; 0 when nodes are unknown, ``None``)."""
    if not candidate.moves:
        return 0, 0
    if units.small:
        tokens, src = units.tokens, units.src
        moved = sum(map(tokens.__getitem__, candidate.moves))
        if ranks_per_node is None:
            return moved, 0
        n = ranks_per_node
        return moved, sum(tokens[u] for u, d in candidate.moves.items() if src[u] // n != d // n)
    ids = int_tensor(list(candidate.moves))
    return _rows_away(units, ids, int_tensor(list(candidate.moves.values())), ranks_per_node)


def _rows_away(units: Units, ids, dests, ranks_per_node: int | None) -> tuple[int, int]:
    """``rows_away`` of the units ``ids`` computed on ``dests`` (tensors)."""
    rows = units.tokens_U.index_select(0, ids)
    if ranks_per_node is None:
        return int(rows.sum()), 0
    crossing = units.src_U.index_select(0, ids) // ranks_per_node != dests // ranks_per_node
    return int(rows.sum()), int(rows[crossing].sum())


def crossing_rows(candidate: Candidate, units: Units) -> tuple[list[int], list[int]]:
    """Per rank, rows sent to other ranks and rows received from them."""
    send, recv = [0] * units.num_ranks, [0] * units.num_ranks
    if candidate.moves:
        for s, d, n in zip(*_moved(candidate, units), strict=True):
            send[s] += n
            recv[d] += n
    return send, recv


def make_plan(
    candidate: Candidate,
    units: Units,
    applied: bool,
    reason: str,
    ranks_per_node: int | None = None,
) -> Plan:
    """The ``Plan`` of ``candidate``.

    Every rank's units, grouped by a stable sort of their destinations, come out in ``(src,
    idx)`` order (each rank's list is made when read: ``Assignment``); their reported float
    loads are summed afresh in that order, as ``Units`` sums the home ones, so a rank no move
    touches reports the same bits before and after."""
    moved_tokens = inter_node = 0
    if not candidate.moves:
        starts = units.starts
        if units.small:
            src = array("q", units.src)
            assignment = Assignment(array("q", range(units.num_units)), starts, src, src, starts)
        else:
            ids = torch.arange(units.num_units)
            assignment = Assignment(ids, starts, units.src_U, units.src_U, starts)
        loads_after = units.loads_before[:]
        imbalance_after = units.imbalance_before
    elif units.small:
        dest = units.src[:]
        for u, d in candidate.moves.items():
            dest[u] = d
        ids = sorted(range(units.num_units), key=dest.__getitem__)  # stable, as torch.sort
        bounds = [0, *accumulate(candidate.counts)]
        cost = units.float_cost
        loads_after = [
            reduce(operator.add, map(cost.__getitem__, ids[a:b]), 0.0) for a, b in pairwise(bounds)
        ]
        if units.history is not None:
            loads_after = [s + b for s, b in zip(loads_after, units.base, strict=True)]
        imbalance_after = imbalance_of(max(loads_after), sum(loads_after), units.num_ranks)
        ids_A, dest_U, src_U = array("q", ids), array("q", dest), array("q", units.src)
        assignment = Assignment(ids_A, bounds, dest_U, src_U, units.starts)
        moved_tokens, inter_node = rows_away(candidate, units, ranks_per_node)
    else:
        ids, dests = int_tensor(list(candidate.moves)), int_tensor(list(candidate.moves.values()))
        dest_U = units.src_U.clone()
        dest_U.index_copy_(0, ids, dests)
        order_U = torch.sort(dest_U, stable=True).indices
        sizes_R = torch.bincount(dest_U, minlength=units.num_ranks)
        sums_R = sequential_sums(
            units.cost_F.index_select(0, order_U), dest_U.index_select(0, order_U), sizes_R
        )
        if units.history is not None:
            sums_R = sums_R + torch.tensor(units.base, dtype=torch.float64)
        loads_after = sums_R.tolist()
        imbalance_after = imbalance_of(float(sums_R.max()), sum(loads_after), units.num_ranks)
        bounds = [0, *accumulate(sizes_R.tolist())]
        assignment = Assignment(order_U, bounds, dest_U, units.src_U, units.starts)
        moved_tokens, inter_node = _rows_away(units, ids, dests, ranks_per_node)
    return Plan(
        assignment=assignment,
        applied=applied,
        reason=reason,
        loads_before=units.loads_before,
        loads_after=loads_after,
        imbalance_before=units.imbalance_before,
        imbalance_after=imbalance_after,
        moved_tokens=moved_tokens,
        cap_respected=candidate.cap_respected,
        inter_node_tokens=inter_node,
    )
