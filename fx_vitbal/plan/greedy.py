"""The seed's greedy pieces: LPT onto the least-loaded rank (with or without the row cap) and the
move/swap refinement between the most and least loaded ranks."""

import bisect
import heapq
import math

from fx_vitbal.plan.units import Candidate, Units, make_candidate, rank_groups, row_rooms


def place(
    order: list[int],
    dest: list[int],
    loads: list[float],
    rank_tokens: list[int],
    rank_units: list[int],
    units: Units,
    cap: float,
    home_fill: float = -math.inf,
) -> None:
    """LPT placement of ``order`` (cost-descending) onto the least-loaded rank that fits the cap.

    A unit stays home instead when that keeps its home's load at most ``home_fill``. Ties go to
    the unit's home rank, then to the lowest rank. When no rank fits, the one with the fewest rows
    takes the unit (the plan then reports the broken cap). Mutates its arguments.

    Every rank has one entry in one of two heaps: ``open`` by load, or ``full`` by row room (most
    first) once it had no room for some unit. Before each unit, full ranks with room for it
    reopen, so the first open rank that fits is the answer; a rank too full for large units waits
    in ``full`` instead of being popped again for each of them. Units come roughly in descending
    rows, so each rank changes heaps a few times: O(units * log ranks) in practice.
    """
    if not order:  # best-fit placed every unit: skip the per-rank set-up
        return
    cost, tokens, src = units.cost, units.tokens, units.src
    room = row_rooms(rank_tokens, rank_units, cap)
    # A rank with room for none of the units starts in ``full``: placing units that fit nowhere
    # (best-fit's leftovers on nearly full ranks) would otherwise first move every rank there.
    least = min((tokens[u] for u in order), default=0)
    # Loads only grow and rooms only shrink, so an entry older than its rank is a bound: refresh
    # it when it surfaces instead of pushing on every change. The open top taking the unit (the
    # common case) is updated at once, saving its refresh on the next unit.
    open_ = [(load, r) for r, load in enumerate(loads) if room[r] >= least]
    full = [(-room[r], r) for r in range(len(loads)) if room[r] < least]
    heapq.heapify(open_)
    heapq.heapify(full)
    for u in order:
        need, home = tokens[u], src[u]
        if loads[home] + cost[u] <= home_fill and room[home] >= need:
            chosen = home
        else:
            while full and -full[0][0] >= need:
                r = heapq.heappop(full)[1]
                heapq.heappush(open_, (loads[r], r))
            chosen = -1
            while open_:
                load, r = open_[0]
                if load != loads[r]:
                    heapq.heapreplace(open_, (loads[r], r))
                elif room[r] >= need:
                    chosen = r
                    break
                else:
                    heapq.heappop(open_)
                    heapq.heappush(full, (-room[r], r))
            if chosen < 0:
                while -full[0][0] != room[full[0][1]]:
                    heapq.heapreplace(full, (-room[full[0][1]], full[0][1]))
                chosen = full[0][1]  # the most room is the fewest rows
            elif chosen != home and loads[home] == loads[chosen] and room[home] >= need:
                chosen = home  # an LPT tie: staying home moves nothing
            else:
                heapq.heapreplace(open_, (loads[chosen] + cost[u], chosen))
        dest[u] = chosen
        loads[chosen] += cost[u]
        rank_tokens[chosen] += need
        rank_units[chosen] += 1
        room[chosen] = cap - rank_tokens[chosen]


def lpt_assign(units: Units, order: list[int], base: list[float]) -> list[int]:
    """The seed's greedy: each unit, cost-descending, onto the least-loaded rank (no row cap)."""
    dest = [-1] * len(units.cost)
    heap = [(load, r) for r, load in enumerate(base)]
    heapq.heapify(heap)
    cost = units.cost
    for u in order:  # the hot path: one heapreplace per unit
        load, r = heap[0]
        dest[u] = r
        heapq.heapreplace(heap, (load + cost[u], r))
    return dest


def lpt_assign_within(units: Units, order: list[int], base: list[float], cap: float) -> list[int]:
    """LPT onto the least-loaded rank with row room for each unit: the plan when the seed's
    greedy breaks the cap."""
    dest = [-1] * len(units.cost)
    zeros = [0] * units.num_ranks
    place(order, dest, base[:], zeros[:], zeros[:], units, cap)
    return dest


def refine(
    dest: list[int], units: Units, base: list[float], cap: float, stop_load: float, max_iters: int
) -> Candidate:
    """The seed's refinement: move or swap one unit between the most and least loaded ranks
    until the makespan is at most ``stop_load``, nothing helps, or ``max_iters`` steps ran.

    Returns the new assignment with its loads and whether it keeps the row cap (every candidate
    plan comes out of here, so the per-rank sums are made once)."""
    first = make_candidate(dest[:], units, base, cap)
    if max(first.loads) <= stop_load or not max_iters:  # the usual case: no per-rank unit lists
        return first
    dest, loads = first.dest, first.loads
    rank_tokens = first.rows[:]
    groups, starts = rank_groups(first, units), units.starts
    held = [
        groups[r] if r in groups else list(range(starts[r], starts[r + 1]))
        for r in range(units.num_ranks)
    ]
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
            held[hi],
            held[lo],
            loads[hi] - loads[lo],
            loads[hi],
            loads[lo],
            rank_tokens[hi],
            rank_tokens[lo],
            units,
            cap,
        )
        if step is None:
            break
        for k, frm, to in ((step[0], hi, lo), (step[1], lo, hi)):
            if k < 0:
                continue
            held[frm].remove(k)
            held[to].append(k)
            dest[k] = to
            loads[frm] -= units.cost[k]
            loads[to] += units.cost[k]
            rank_tokens[frm] -= units.tokens[k]
            rank_tokens[to] += units.tokens[k]
        for r in (hi, lo):
            heapq.heappush(highest, (-loads[r], r))
            heapq.heappush(lowest, (loads[r], r))
    keeps_cap = all(n <= cap or len(h) <= 1 for n, h in zip(rank_tokens, held, strict=True))
    # Running sums, and no groups (moves appended out of id order): a plan chosen from here is
    # grouped and summed afresh by ``make_plan``, so the plan's loads do not depend on the path.
    return Candidate(dest, loads, keeps_cap, None, rank_tokens)


def _best_step(
    on_hi: list[int],
    on_lo: list[int],
    gap: float,
    load_hi: float,
    load_lo: float,
    tokens_hi: int,
    tokens_lo: int,
    units: Units,
    cap: float,
) -> tuple[int, int] | None:
    """Best move (``(u, -1)``) or swap (``(u, v)``) between two ranks that keeps both under the
    row cap: the one minimizing the pair's new maximum; ties go to the lowest unit ids.

    For a unit ``u`` the new maximum is V-shaped in the partner's cost, lowest at
    ``cost[u] - gap / 2``, so on each side only the nearest partner keeping the cap can win (the
    lowest id among equally near ones). They are found by bisection and a walk past partners that
    break the cap, instead of trying every pair.
    """
    cost, tokens = units.cost, units.tokens
    partners = sorted((cost[v], v) for v in on_lo)
    partner_costs = [c for c, _ in partners]

    def keeps_cap(u: int, v: int) -> bool:
        shift = tokens[u] - (tokens[v] if v >= 0 else 0)
        return tokens_lo + shift <= cap and tokens_hi - shift <= cap

    best = None
    for u in on_hi:
        i = bisect.bisect_left(partner_costs, cost[u] - gap / 2)
        candidates = [-1] if keeps_cap(u, -1) else []
        nearest = None  # cost of the nearest cheaper partner keeping the cap
        for c, v in reversed(partners[:i]):  # nearest first; equal costs by descending id
            if cost[u] - c >= gap or (nearest is not None and c != nearest):
                break
            if keeps_cap(u, v):
                candidates.append(v)
                nearest = c
        for c, v in partners[i:]:  # nearest first; equal costs by ascending id
            if c >= cost[u]:
                break
            if keeps_cap(u, v):
                candidates.append(v)
                break
        for v in candidates:
            delta = cost[u] - (cost[v] if v >= 0 else 0.0)
            if 0 < delta < gap:
                key = (max(load_hi - delta, load_lo + delta), u, v)
                if best is None or key < best:
                    best = key
    return None if best is None else (best[1], best[2])
