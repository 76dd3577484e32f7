"""min-move: keep units home, shed from overloaded ranks just enough to reach a target
(``shed.shed_over_target``, torch ops over every rank), place the shed units best-fit (Python,
the units that move only), and let the refinement repair any overshoot."""

import bisect
import heapq
import math
import operator
from collections.abc import Sequence
from itertools import repeat

from fx_vitbal.plan.candidates import Candidate, candidate_from_dest, make_candidate, moves_of
from fx_vitbal.plan.greedy import lpt_assign_within, place, refine
from fx_vitbal.plan.shed import Shed, shed_over_target
from fx_vitbal.plan.units import Units


def min_move(units: Units, order: list[int], cap: float, accept: int) -> Candidate:
    """Keep units home: overloaded ranks shed just enough to reach ``accept``, shed units are
    placed best-fit, and a refinement repairs any overshoot.

    Returns the first attempt when it reaches ``accept``, else the better of it and a second
    attempt (``order``: every unit by cost descending)."""
    first = shed_and_place(units, cap, accept)
    if first.makespan <= accept:
        return first
    # Neither may reach the target (the row cap binds): the lower makespan, for solve_plan to weigh.
    return min(first, _fill_homes_first(units, order, cap, accept), key=lambda c: c.makespan)


def shed_and_place(units: Units, cap: float, accept: int, shed: Shed | None = None) -> Candidate:
    """min-move's first attempt: shed down to ``accept`` (unless ``shed`` did), best-fit the shed
    units, refine."""
    shed = shed if shed is not None else shed_over_target(units, cap, accept)
    loads, rows, counts = shed.loads, shed.rows, shed.counts
    placed = best_fit(
        shed.costs, shed.needs, shed.homes, loads, rows, counts, cap, accept, shed.by_load
    )
    moves = moves_of(shed.ids, placed, shed.homes)
    candidate = make_candidate(moves, loads, rows, counts, cap)
    return refine(candidate, units, cap, accept, units.num_ranks)


# Where the current layout breaks the row cap, the first attempt is tried only if the shed units'
# rows leave this share of the room the cap leaves free.
SPARE_ROOM = 0.1


def room_to_spare(shed: Shed, cap: float) -> bool:
    """Whether the shed units' rows leave ``SPARE_ROOM`` of the room under the cap free. Best-fit
    places by load and packs rows only loosely: where the shed rows fill (nearly) all the room,
    it breaks the cap, and an attempt that must keep it is wasted (at ``max_len_ratio=1.0`` the
    rows ranks above the mean shed fill 99.9% of the room below it from 4 images per rank on)."""
    room = sum(map(max, repeat(0), map(operator.sub, repeat(cap), shed.rows)))
    return sum(shed.needs) <= (1.0 - SPARE_ROOM) * room


def _fill_homes_first(units: Units, order: list[int], cap: float, accept: int) -> Candidate:
    """min-move's second attempt, when shedding and best-fit leave the makespan above ``accept``."""
    # Fragmented room (a near-perfect LPT leaves ~1% slack): LPT order again, but each unit
    # stays home while its home has room below the target, so large units stay and only the
    # smallest overflow moves.
    dest = lpt_assign_within(units, order, cap, home_fill=accept)
    return refine(candidate_from_dest(dest, units, cap), units, cap, accept, units.num_ranks)


def best_fit(
    costs: Sequence[int],
    needs: Sequence[int],
    homes: Sequence[int],
    loads: list[int],
    rows: list[int],
    counts: list[int],
    cap: float,
    limit: int,
    by_load: list[int] | None = None,
) -> list[int]:
    """Best-fit decreasing: each unit (``costs`` descending, with its rows and home rank) onto the
    rank whose load stays at most ``limit`` with the least room left (the fullest; ties to the
    highest rank), among ranks with row room for it; returns each unit's rank. Units that fit
    nowhere go to the least-loaded rank (``place``) and the refinement repairs the overshoot.
    Loads are integers. Mutates ``loads``, ``rows`` and ``counts``.

    A rank is keyed by its load and id packed into one int (``load << bits | rank``); ``by_load``
    may give every rank's key, ascending (made by torch ops over every rank), else they are
    sorted here. A unit of cost ``c`` may go to ranks keyed at most ``top(limit - c)``, a bound
    that only grows as units get cheaper, while ranks only get fuller. So the ranks no unit has
    reached yet are a sorted list revealed onto a stack as the bound passes them (the stack's
    top is the fullest of them), and the ranks a unit reached wait in a max-heap (under the
    bound) or a min-heap (above it, until the bound passes them). A rank found on top without
    room for a unit is parked (``_Parked``): a later unit with fewer rows asks for the fullest
    parked rank with room for it. The answer is the fullest of those three. A rank too loaded
    for the cheapest unit, or over the cap, leaves for good. Per unit: a bisection and a few heap
    operations, no Python step for ranks no unit reaches, and a few tree steps while ranks are
    parked.
    """
    num_units = len(costs)
    dest = [-1] * num_units
    if not num_units:
        return dest
    bits = max(1, (len(loads) - 1).bit_length())
    mask = (1 << bits) - 1
    if by_load is None:
        by_load = sorted((load << bits) | r for r, load in enumerate(loads))
    # Loads are integers: a float limit is its floor, no limit one above any load.
    limit = math.floor(limit) if limit != math.inf else max(loads) + sum(costs)
    reach = limit - costs[-1]  # loaded above this, a rank can take no unit
    end = bisect.bisect_right(by_load, (reach << bits) | mask)
    revealed = 0
    stack: list[int] = []  # keys of ranks the bound passed, ascending
    heap: list[int] = []  # negated keys of ranks back under the bound
    later: list[int] = []  # keys of ranks back, above the bound
    parked = None  # made when a rank is first parked (its tree takes a few thousand entries)
    misfits = []
    heappush, heappop = heapq.heappush, heapq.heappop
    for k in range(num_units):
        cost, need = costs[k], needs[k]
        bound = limit - cost
        top = (bound << bits) | mask  # the largest key of a load at most the bound
        if revealed < end and by_load[revealed] <= top:
            upto = bisect.bisect_right(by_load, top, revealed, end)
            stack += by_load[revealed:upto]
            revealed = upto
        while later and later[0] <= top:
            heappush(heap, -heappop(later))
        best, source = -1, None
        while stack or heap:
            if heap and (not stack or -heap[0] > stack[-1]):
                key = -heap[0]
                source = heap
            else:
                key = stack[-1]
                source = stack
            r = key & mask
            if rows[r] + need <= cap or not counts[r]:
                best = key
                break
            if source is heap:
                heappop(heap)
            else:
                stack.pop()
            source = None
            if rows[r] <= cap:  # else it can take no unit again: it leaves
                parked = parked or _Parked(cap, mask)
                parked.park(key, cap - rows[r])
        if parked is not None and parked.size:
            key = parked.fullest(need, best, rows)
            if key > best:
                best, source = key, parked
        if best < 0:
            misfits.append(k)
            continue
        if source is stack:
            stack.pop()
        elif source is heap:
            heappop(heap)
        elif source is parked:
            parked.take(best)
        chosen = best & mask
        dest[k] = chosen
        load = loads[chosen] + cost
        loads[chosen] = load
        rows[chosen] += need
        counts[chosen] += 1
        if load <= bound:
            heappush(heap, -((load << bits) | chosen))
        elif load <= reach:
            heappush(later, (load << bits) | chosen)
    if misfits:
        placed = place(
            [costs[k] for k in misfits],
            [needs[k] for k in misfits],
            [homes[k] for k in misfits],
            loads,
            rows,
            counts,
            cap,
        )
        for k, d in zip(misfits, placed, strict=True):
            dest[k] = d
    return dest


class _Parked:
    """Ranks parked for want of row room (``best_fit``), for "the fullest parked rank with at
    least ``need`` rows of room": a max-tree over room buckets (leaf ``room >> shift``), each
    leaf a heap of its ranks' keys. A parked rank's load and rows do not change until it is
    taken, so entries never go stale. Rooms above ``2**12`` buckets share leaves: the one leaf
    holding ``need`` is looked into, the others' tops come from the tree."""

    def __init__(self, cap: int, mask: int):
        self.shift = max(0, (cap + 1).bit_length() - 12)
        self.width = 1 << ((cap >> self.shift) + 1).bit_length()
        self.tree = [-1] * (2 * self.width)
        self.leaves: dict[int, list[int]] = {}
        self.leaf_of: dict[int, int] = {}
        self.cap, self.mask, self.size = cap, mask, 0

    def park(self, key: int, room: int) -> None:
        leaf = room >> self.shift
        heapq.heappush(self.leaves.setdefault(leaf, []), -key)
        self.leaf_of[key] = leaf
        self.size += 1
        tree, node = self.tree, self.width + leaf
        while node and tree[node] < key:
            tree[node] = key
            node >>= 1

    def take(self, key: int) -> None:
        """Unpark ``key``: the top of its leaf (``fullest`` returned it)."""
        leaf = self.leaf_of.pop(key)
        heap = self.leaves[leaf]
        if -heap[0] == key:
            heapq.heappop(heap)
        else:  # found inside the shared leaf
            heap.remove(-key)
            heapq.heapify(heap)
        self.size -= 1
        tree, node = self.tree, self.width + leaf
        tree[node] = -heap[0] if heap else -1
        node >>= 1
        while node:
            value = max(tree[2 * node], tree[2 * node + 1])
            if tree[node] == value:
                break
            tree[node] = value
            node >>= 1

    def fullest(self, need: int, above: int, rows: list[int]) -> int:
        """The largest parked key above ``above`` whose rank has ``need`` rows of room, else -1."""
        first = need >> self.shift
        if first >= self.width:
            return -1
        best = -1
        if self.shift and self.leaves.get(first):  # a shared leaf: rooms below ``need`` too
            cap, mask = self.cap, self.mask
            for entry in sorted(self.leaves[first]):  # fullest first
                key = -entry
                if key <= above:
                    break
                if rows[key & mask] + need <= cap:
                    best = key
                    break
            first += 1
        tree, low, high = self.tree, first + self.width, 2 * self.width
        while low < high:
            if low & 1:
                best = max(best, tree[low])
                low += 1
            if high & 1:
                high -= 1
                best = max(best, tree[high])
            low >>= 1
            high >>= 1
        return best if best > above else -1
