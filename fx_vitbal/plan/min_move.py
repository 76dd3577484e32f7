"""min-move: keep units home, shed from overloaded ranks just enough to reach a target, place the
shed units best-fit, and let the refinement repair any overshoot."""

import bisect
import heapq
import math

from fx_vitbal.plan.greedy import place, refine
from fx_vitbal.plan.units import Candidate, Units, row_rooms, sum_loads


def min_move(
    units: Units, order: list[int], base: list[float], cap: float, accept: float
) -> Candidate:
    """Keep units home: overloaded ranks shed just enough to reach ``accept``, shed units are
    placed LPT-style, and a refinement repairs any overshoot.

    Returns an assignment and its loads: the first attempt reaching ``accept``, else the better
    of the two attempts."""
    first = shed_and_place(units, base, cap, accept)
    if max(first.loads) <= accept:
        return first
    # Neither may reach the target (the row cap binds): the lower makespan, for solve_plan to weigh.
    return min(first, _fill_homes_first(units, order, base, cap, accept), key=_makespan)


def shed_and_place(units: Units, base: list[float], cap: float, accept: float) -> Candidate:
    """min-move's first attempt: shed down to ``accept``, best-fit the shed units, refine."""
    shed, dest, loads, rank_tokens, rank_units = shed_over_target(units, base, cap, accept)
    best_fit(shed, dest, loads, rank_tokens, rank_units, units, cap, accept)
    return refine(dest, units, base, cap, accept, units.num_ranks)


def _makespan(candidate: Candidate) -> float:
    return max(candidate.loads)


def shed_over_target(
    units: Units, base: list[float], cap: float, accept: float
) -> tuple[list[int], list[int], list[float], list[int], list[int]]:
    """Every rank above ``accept`` (or above the row cap) sheds units until it is not.

    Returns ``(shed, dest, loads, rank_tokens, rank_units)``: the shed units by cost descending,
    ties by id (``by_cost_desc``'s order), and the home assignment without them (their ``dest``
    still says home) with its loads, rows and unit counts, ready for placement."""
    dest = units.src[:]
    loads = sum_loads(units, base, {})
    rank_tokens, rank_units = units.home_rows[:], units.counts[:]
    cost, starts = units.cost, units.starts
    over = (r for r, load in enumerate(loads) if load > accept)
    crowded = (r for r, n in enumerate(rank_tokens) if n > cap)
    shed: list[int] = []
    # Only these ranks need their units in order: no global sort.
    for r in sorted({*over, *(r for r in crowded if rank_units[r] > 1)}):
        # Cost-ascending, ties by id descending: what reversing the global order gives.
        keep = sorted(range(starts[r + 1] - 1, starts[r] - 1, -1), key=cost.__getitem__)
        while keep and (loads[r] > accept or (rank_tokens[r] > cap and len(keep) > 1)):
            for u in _units_to_shed(keep, loads[r] - accept, units):
                keep.remove(u)
                shed.append(u)
                loads[r] -= units.cost[u]
                rank_tokens[r] -= units.tokens[u]
                rank_units[r] -= 1
    shed.sort(key=lambda u: (-units.cost[u], u))
    return shed, dest, loads, rank_tokens, rank_units


def _fill_homes_first(
    units: Units, order: list[int], base: list[float], cap: float, accept: float
) -> Candidate:
    """min-move's second attempt, when shedding and best-fit leave the makespan above ``accept``."""
    # Fragmented room (a near-perfect LPT leaves ~1% slack): LPT order again, but each unit
    # stays home while its home has room below the target, so large units stay and only the
    # smallest overflow moves.
    dest = [-1] * len(units.cost)
    zeros = [0] * units.num_ranks
    place(order, dest, base[:], zeros[:], zeros[:], units, cap, home_fill=accept)
    return refine(dest, units, base, cap, accept, units.num_ranks)


def best_fit(
    order: list[int],
    dest: list[int],
    loads: list[float],
    rank_tokens: list[int],
    rank_units: list[int],
    units: Units,
    cap: float,
    limit: float,
) -> None:
    """Best-fit decreasing: each unit onto the rank whose load stays at most ``limit`` with the
    least room left, which keeps large holes for large units. Units that fit nowhere go to the
    least-loaded rank (``place``) and the refinement repairs the overshoot. Mutates its arguments.

    As in ``place``, a rank with too few rows of room for a unit leaves the search (``full``, by
    room) until a unit it has room for comes, instead of being skipped again for every unit. One
    with room for the next unit is only passed over: rows of consecutive units often alternate
    (photos, then videos with more rows at lower cost), and setting such a rank aside only to
    take it back for the next unit costs far more than stepping past it once.
    """
    by_load = sorted(zip(loads, range(len(loads)), strict=True))
    full: list[tuple[float, int]] = []  # only ranks in by_load take units, so rooms stay exact
    room = row_rooms(rank_tokens, rank_units, cap)
    needs = list(map(units.tokens.__getitem__, order))
    misfits = []
    for k, u in enumerate(order):
        need = needs[k]
        next_need = needs[k + 1] if k + 1 < len(needs) else 0
        while full and -full[0][0] >= need:
            r = heapq.heappop(full)[1]
            bisect.insort(by_load, (loads[r], r))
        # The fullest rank that still fits is just below limit - cost in load order.
        i = bisect.bisect_right(by_load, (limit - units.cost[u], math.inf)) - 1
        while i >= 0 and room[by_load[i][1]] < need:
            if room[by_load[i][1]] < next_need:
                r = by_load.pop(i)[1]
                heapq.heappush(full, (-room[r], r))
            i -= 1
        if i < 0:
            misfits.append(u)
            continue
        load, r = by_load.pop(i)
        dest[u] = r
        loads[r] = load + units.cost[u]
        rank_tokens[r] += need
        rank_units[r] += 1
        room[r] = cap - rank_tokens[r]
        bisect.insort(by_load, (loads[r], r))
    place(misfits, dest, loads, rank_tokens, rank_units, units, cap)


def _units_to_shed(ascending: list[int], excess: float, units: Units) -> list[int]:
    """Units of one rank whose costs cover ``excess`` with few rows (``ascending`` by cost).

    Two candidates: the cheapest single unit that covers the excess, or the largest units below
    it while they leave some of it, closed by the cheapest other unit covering the rest. The one
    moving fewer rows wins (the second on ties): large units carry fewer rows per cost, small
    ones place more easily. With no excess (only the row cap is exceeded) the largest unit goes;
    with nothing covering the excess (history alone exceeds the target), every unit goes.
    """
    if excess <= 0:
        return [ascending[-1]]
    cost, tokens = units.cost, units.tokens
    single = next((u for u in ascending if cost[u] >= excess), None)
    several: list[int] = []
    covered = 0.0
    for u in reversed(ascending):
        if 0 < cost[u] < excess:
            if covered + cost[u] >= excess:
                break
            several.append(u)
            covered += cost[u]
    taken = set(several)
    closing = next((u for u in ascending if u not in taken and cost[u] >= excess - covered), None)
    if closing is None:
        return list(ascending)
    several.append(closing)
    if single is None or sum(tokens[u] for u in several) <= tokens[single]:
        return several
    return [single]
