"""The seed's greedy pieces: LPT onto the least-loaded rank (with or without the row cap) and the
move/swap refinement between the most and least loaded ranks."""

import bisect
import heapq
import math
from collections.abc import Sequence

from fx_vitbal.plan.candidates import Candidate, make_candidate
from fx_vitbal.plan.units import Units


def place(
    costs: Sequence[int],
    needs: Sequence[int],
    homes: Sequence[int],
    loads: list[int],
    rows: list[int],
    counts: list[int],
    cap: float,
    home_fill: float = -math.inf,
) -> list[int]:
    """LPT placement of units (``costs`` descending, each with its rows and home rank) onto the
    least-loaded rank that fits the cap; returns each unit's rank.

    A unit stays home instead when that keeps its home's load at most ``home_fill``. Ties go to
    the unit's home rank, then to the lowest rank. When no rank fits, the one with the fewest rows
    takes the unit (the plan then reports the broken cap). An empty rank may always hold one unit
    alone, however large (the cap's documented exception). Mutates ``loads``, ``rows`` and
    ``counts``.

    Every rank has one entry in one of two heaps: ``open`` by load, or ``full`` by row room (most
    first) once it had no room for some unit. Before each unit, full ranks with room for it
    reopen, so the first open rank that fits is the answer; a rank too full for large units waits
    in ``full`` instead of being popped again for each of them. Units come roughly in descending
    rows, so each rank changes heaps a few times: O(units * log ranks) in practice.
    """
    dest = [-1] * len(costs)
    if not dest:  # best-fit placed every unit: skip the per-rank set-up
        return dest
    # Heap entries are ``value << bits | rank`` ints (loads and rows are integers): one int
    # comparison per step, ties to the lowest rank.
    bits = max(1, (len(loads) - 1).bit_length())
    mask = (1 << bits) - 1
    room = [cap - n if k else math.inf for n, k in zip(rows, counts, strict=True)]
    # A rank with room for none of the units starts in ``full``: placing units that fit nowhere
    # (best-fit's leftovers on nearly full ranks) would otherwise first move every rank there.
    least = min(needs)
    # Loads only grow and rooms only shrink, so an entry older than its rank is a bound: refresh
    # it when it surfaces instead of pushing on every change. The open top taking the unit (the
    # common case) is updated at once, saving its refresh on the next unit.
    open_ = [(load << bits) | r for r, load in enumerate(loads) if room[r] >= least]
    full = [(rows[r] << bits) | r for r in range(len(loads)) if room[r] < least]  # most room first
    heapq.heapify(open_)
    heapq.heapify(full)
    heappush, heappop, heapreplace = heapq.heappush, heapq.heappop, heapq.heapreplace
    for k, (cost, need, home) in enumerate(zip(costs, needs, homes, strict=True)):
        if loads[home] + cost <= home_fill and room[home] >= need:
            chosen = home
        else:
            while full and cap - (full[0] >> bits) >= need:
                r = heappop(full) & mask
                heappush(open_, (loads[r] << bits) | r)
            chosen = -1
            while open_:
                key = open_[0]
                r = key & mask
                if key >> bits != loads[r]:
                    heapreplace(open_, (loads[r] << bits) | r)
                elif room[r] >= need:
                    chosen = r
                    break
                else:
                    heappop(open_)
                    heappush(full, (rows[r] << bits) | r)
            if chosen < 0:
                while full[0] >> bits != rows[full[0] & mask]:
                    r = full[0] & mask
                    heapreplace(full, (rows[r] << bits) | r)
                chosen = full[0] & mask  # the most room is the fewest rows
            elif chosen != home and loads[home] == loads[chosen] and room[home] >= need:
                chosen = home  # an LPT tie: staying home moves nothing
            else:
                heapreplace(open_, ((loads[chosen] + cost) << bits) | chosen)
        dest[k] = chosen
        loads[chosen] += cost
        rows[chosen] += need
        counts[chosen] += 1
        room[chosen] = cap - rows[chosen]
    return dest


def lpt_assign(units: Units, order: list[int]) -> list[int]:
    """The seed's greedy: each unit, cost-descending, onto the least-loaded rank (no row cap)."""
    dest = [-1] * units.num_units
    bits = units.rank_bits
    mask = (1 << bits) - 1
    heap = [(load << bits) | r for r, load in enumerate(units.base_fixed)]  # (load, rank) packed
    heapq.heapify(heap)
    cost, heapreplace = units.cost, heapq.heapreplace
    for u in order:  # the hot path: one heapreplace per unit
        key = heap[0]
        dest[u] = key & mask
        heapreplace(heap, key + (cost[u] << bits))
    return dest


def lpt_assign_within(
    units: Units, order: list[int], cap: float, home_fill: float = -math.inf
) -> list[int]:
    """LPT onto the least-loaded rank with row room for each unit: the plan when the seed's
    greedy breaks the cap (``home_fill``: see ``place``)."""
    cost, tokens, src = units.cost, units.tokens, units.src
    zeros = [0] * units.num_ranks
    placed = place(
        [cost[u] for u in order],
        [tokens[u] for u in order],
        [src[u] for u in order],
        units.base_fixed[:],
        zeros[:],
        zeros[:],
        cap,
        home_fill,
    )
    dest = [-1] * units.num_units
    for u, d in zip(order, placed, strict=True):
        dest[u] = d
    return dest


def refine(
    candidate: Candidate, units: Units, cap: float, stop_load: float, max_iters: int
) -> Candidate:
    """The seed's refinement: move or swap one unit between the most and least loaded ranks
    until the makespan is at most ``stop_load``, nothing helps, or ``max_iters`` steps ran.

    The per-rank unit lists are made only for the ranks a step looks at; loads stay exact."""
    if candidate.makespan <= stop_load or not max_iters:  # the usual case
        return candidate
    moves = dict(candidate.moves)
    loads, rows, counts = candidate.loads[:], candidate.rows[:], candidate.counts[:]
    arriving: dict[int, list[int]] = {}
    for u, d in moves.items():
        arriving.setdefault(d, []).append(u)
    held: dict[int, list[int]] = {}

    def held_by(r: int) -> list[int]:
        # Built before any step moves a unit to or from ``r``, so ``arriving`` is still true.
        if r not in held:
            held[r] = [u for u in units.home_ids(r) if u not in moves] + arriving.get(r, [])
        return held[r]

    cost, tokens, src = units.cost, units.tokens, units.src
    highest = [(-load, r) for r, load in enumerate(loads)]
    lowest = [(load, r) for r, load in enumerate(loads)]
    heapq.heapify(highest)
    heapq.heapify(lowest)
    for _ in range(max_iters):
        while -highest[0][0] != loads[highest[0][1]]:  # drop stale entries
            heapq.heappop(highest)
        while lowest[0][0] != loads[lowest[0][1]]:
            heapq.heappop(lowest)
        hi, lo = highest[0][1], lowest[0][1]
        if loads[hi] <= stop_load:
            break
        step = _best_step(
            held_by(hi),
            held_by(lo),
            loads[hi] - loads[lo],
            loads[hi],
            loads[lo],
            rows[hi],
            rows[lo],
            cost,
            tokens,
            cap,
        )
        if step is None:
            break
        for k, frm, to in ((step[0], hi, lo), (step[1], lo, hi)):
            if k < 0:
                continue
            held[frm].remove(k)
            held[to].append(k)
            if to == src[k]:
                del moves[k]
            else:
                moves[k] = to
            loads[frm] -= cost[k]
            loads[to] += cost[k]
            rows[frm] -= tokens[k]
            rows[to] += tokens[k]
            counts[frm] -= 1
            counts[to] += 1
        for r in (hi, lo):
            heapq.heappush(highest, (-loads[r], r))
            heapq.heappush(lowest, (loads[r], r))
    return make_candidate(moves, loads, rows, counts, cap)


def _best_step(
    on_hi: list[int],
    on_lo: list[int],
    gap: int,
    load_hi: int,
    load_lo: int,
    tokens_hi: int,
    tokens_lo: int,
    cost: Sequence[int],
    tokens: Sequence[int],
    cap: float,
) -> tuple[int, int] | None:
    """Best move (``(u, -1)``) or swap (``(u, v)``) between two ranks that keeps both under the
    row cap: the one minimizing the pair's new maximum; ties go to the lowest unit ids.

    For a unit ``u`` the new maximum is V-shaped in the partner's cost, lowest at
    ``cost[u] - gap / 2``, so on each side only the nearest partner keeping the cap can win (the
    lowest id among equally near ones). They are found by bisection and a walk past partners that
    break the cap, instead of trying every pair. Costs are integers, so the middle is compared
    doubled, exactly. No step of ``u`` lowers the pair's maximum below ``load_hi - cost[u]``, so
    units go costliest first and the search stops at the first that cannot beat the best found.
    """
    partners = sorted((2 * cost[v], v) for v in on_lo)
    partner_costs = [c for c, _ in partners]
    # Shifting ``s`` rows from hi to lo keeps both under the cap when ``least <= s <= most``.
    most, least = cap - tokens_lo, tokens_hi - cap
    best = None
    for u in sorted(on_hi, key=cost.__getitem__, reverse=True):
        cost_u, tokens_u = cost[u], tokens[u]
        if cost_u <= 0 or (best is not None and load_hi - cost_u > best[0]):
            break
        twice = 2 * cost_u
        i = bisect.bisect_left(partner_costs, twice - gap)
        steps = [-1] if least <= tokens_u <= most else []
        nearest = None  # cost of the nearest cheaper partner keeping the cap
        for k in range(i - 1, -1, -1):  # nearest first; equal costs by descending id
            c, v = partners[k]
            if twice - c >= 2 * gap or (nearest is not None and c != nearest):
                break
            if least <= tokens_u - tokens[v] <= most:
                steps.append(v)
                nearest = c
        for k in range(i, len(partners)):  # nearest first; equal costs by ascending id
            c, v = partners[k]
            if c >= twice:
                break
            if least <= tokens_u - tokens[v] <= most:
                steps.append(v)
                break
        for v in steps:
            delta = cost_u - (cost[v] if v >= 0 else 0)
            if 0 < delta < gap:
                key = (max(load_hi - delta, load_lo + delta), u, v)
                if best is None or key < best:
                    best = key
    return None if best is None else (best[1], best[2])
