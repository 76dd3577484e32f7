"""Node-aware min-move: move units inside a node where possible, across nodes only what must.

Nodes are ``ranks_per_node`` contiguous ranks: rank ``r`` lives on node ``r // ranks_per_node``,
as torchrun numbers ranks (``--nproc-per-node`` ranks per node, in order). With model parallelism
the ranks here are data-parallel ranks: ``ranks_per_node`` is then the number of data-parallel
ranks per node, which are contiguous in Megatron's default order (tensor parallelism innermost).

Why: inside a node a moved row rides NVLink-class links; across nodes it takes the network, about
8x slower per GPU (``INTER_NODE_WEIGHT``). Node-blind min-move places each shed unit on the
best-fitting rank anywhere, so with ``N`` nodes nearly every moved row crosses nodes. What must
cross is far less: only each node's work above what its own ranks can take, and node loads (sums
of ``ranks_per_node`` ranks) are much more even than single ranks' (at 8 ranks per node on the
realistic mix, 9-10% of the work where ranks shed 20-27% of the rows).

Two levels in one pass, aiming at exactly node-blind min-move's per-rank target ``accept`` (so
the makespan stays the same):

1. every rank above ``accept`` sheds as in min-move (``min_move.shed_over_target``);
2. each node gets an import budget: its ranks' room below ``accept`` minus what they shed (the
   node level: negative means the node must export, positive how much it can take);
3. best-fit decreasing over all shed units, with tiers: the fullest rank of the unit's own node
   that stays within ``accept``; else the fullest rank of a node whose budget covers the unit;
   else the fullest rank anywhere. A single cost-descending pass over all nodes keeps large holes
   for large units: placing every node's own units first and the exports after fragments the
   holes (tried: the makespan then missed the target by 5-20% at 8 images per rank);
4. units that fit nowhere are placed first in a second pass (they take the large holes); what
   still fits nowhere goes to min-move's global best-fit, then the usual refinement;
5. ranks still above ``accept`` (large units left on a rank, small holes elsewhere: the
   refinement, pairing it with the least loaded rank only, stalls) are repaired by moves or swaps
   with any rank (``_repair``).

When that still misses ``accept``, node-blind min-move is offered as well and ``solve_plan``
weighs both (there, an inter-node row counts ``INTER_NODE_WEIGHT`` moved rows).
"""

import bisect
import math

from fx_vitbal.plan.candidates import (
    Candidate,
    candidate_from_dest,
    full_dest,
    make_candidate,
    moves_of,
    rows_away,
)
from fx_vitbal.plan.greedy import refine
from fx_vitbal.plan.min_move import best_fit, min_move
from fx_vitbal.plan.shed import Shed, shed_over_target
from fx_vitbal.plan.units import Units

# Moving a row across nodes costs this many times moving it inside a node: NVLink 4 gives an H100
# ~450 GB/s per direction, a node's network one 400 Gb/s NIC (50 GB/s) per GPU: ~9x; rounded down.
INTER_NODE_WEIGHT = 8.0


def node_ranks(rank: int, ranks_per_node: int, num_ranks: int) -> range:
    """The ranks on ``rank``'s node (the last node may have fewer)."""
    first = rank - rank % ranks_per_node
    return range(first, min(first + ranks_per_node, num_ranks))


def traffic(candidate: Candidate, units: Units, ranks_per_node: int) -> float:
    """What ``solve_plan`` minimizes among plans within the makespan slack: rows moved, an
    inter-node row weighing ``INTER_NODE_WEIGHT`` intra-node ones."""
    moved, inter = rows_away(candidate, units, ranks_per_node)
    return moved + (INTER_NODE_WEIGHT - 1.0) * inter


def node_min_move(
    units: Units,
    order: list[int],
    cap: float,
    accept: int,
    ranks_per_node: int,
) -> list[Candidate]:
    """min-move that keeps moves inside nodes (module docstring); same arguments as
    ``min_move.min_move`` plus ``ranks_per_node``.

    Returns the node-aware candidate, and node-blind min-move's too when the node-aware one ends
    above ``accept``."""
    candidate = node_shed_and_place(units, cap, accept, ranks_per_node)
    if candidate.makespan <= accept:
        return [candidate]
    return [candidate, min_move(units, order, cap, accept)]


def node_shed_and_place(
    units: Units,
    cap: float,
    accept: int,
    ranks_per_node: int,
    repair: bool = True,
    shed: Shed | None = None,
) -> Candidate:
    """The node-aware attempt alone (steps 1-5 of the module docstring, step 5 only with
    ``repair``): no global order, so ``solve_plan`` can aim it at the lower bound before any LPT
    runs. It does so without the repair, which is slow where it fails (at 2048 ranks, the bound
    out of reach: ~0.1 s) and the full path runs it anyway. ``shed``: step 1 made already."""
    shed = shed if shed is not None else shed_over_target(units, cap, accept)
    state = (shed.loads, shed.rows, shed.counts)
    loads, rows, counts = (x[:] for x in state)
    everything = list(range(len(shed.ids)))
    placed, misfits = _best_fit_nodes_first(
        everything, shed, loads, rows, counts, cap, accept, ranks_per_node
    )
    if misfits:
        loads, rows, counts = (x[:] for x in state)
        first = set(misfits)
        again = misfits + [k for k in everything if k not in first]
        placed, misfits = _best_fit_nodes_first(
            again, shed, loads, rows, counts, cap, accept, ranks_per_node
        )
    if misfits:
        fitted = best_fit(
            [shed.costs[k] for k in misfits],
            [shed.needs[k] for k in misfits],
            [shed.homes[k] for k in misfits],
            loads,
            rows,
            counts,
            cap,
            accept,
        )
        for k, d in zip(misfits, fitted, strict=True):
            placed[k] = d
    moves = moves_of(shed.ids, placed, shed.homes)
    candidate = make_candidate(moves, loads, rows, counts, cap)
    candidate = refine(candidate, units, cap, accept, units.num_ranks)
    if repair and candidate.makespan > accept:
        candidate = _repair(candidate, units, cap, accept, ranks_per_node)
    return candidate


def _best_fit_nodes_first(
    order: list[int],
    shed,
    loads: list[int],
    rows: list[int],
    counts: list[int],
    cap: float,
    limit: int,
    ranks_per_node: int,
) -> tuple[list[int], list[int]]:
    """Best-fit decreasing in three tiers: the unit's own node, then nodes with import budget
    left, then any rank (module docstring, steps 2-3). Each tier takes the fullest rank whose
    load stays at most ``limit`` and whose rows stay under the cap; ties go to the highest rank
    (``min_move.best_fit``'s order). ``order`` lists positions in ``shed``. Mutates ``loads``,
    ``rows`` and ``counts``.

    Returns each shed unit's rank (-1: not placed) and the positions no rank could take within
    ``limit``, in ``order``."""
    num_ranks = len(loads)
    node_ranks = [
        range(n, min(num_ranks, n + ranks_per_node)) for n in range(0, num_ranks, ranks_per_node)
    ]
    budget = [sum(max(0, limit - loads[r]) for r in ranks) for ranks in node_ranks]
    costs, needs, homes = shed.costs, shed.needs, shed.homes
    for k in order:
        budget[homes[k] // ranks_per_node] -= costs[k]
    by_load = sorted((load, r) for r, load in enumerate(loads))
    by_node = [sorted((loads[r], r) for r in ranks) for ranks in node_ranks]
    room = [cap - n if c else math.inf for n, c in zip(rows, counts, strict=True)]
    placed = [-1] * len(costs)
    misfits = []
    for k in order:
        cost, need, home = costs[k], needs[k], homes[k] // ranks_per_node
        top = bisect.bisect_right(by_load, (limit - cost, math.inf)) - 1
        node = by_node[home]
        i = _fullest_fitting(node, limit - cost, need, room)
        if i >= 0:
            load, r = node.pop(i)
            del by_load[bisect.bisect_left(by_load, (load, r))]
        else:
            i = top  # a node that can import it, else anywhere
            while i >= 0 and (
                room[by_load[i][1]] < need or budget[by_load[i][1] // ranks_per_node] < cost
            ):
                i -= 1
            if i < 0:
                i = _fullest_fitting(by_load, limit - cost, need, room)
            if i < 0:
                misfits.append(k)
                continue
            load, r = by_load.pop(i)
            node = by_node[r // ranks_per_node]
            del node[bisect.bisect_left(node, (load, r))]
            budget[r // ranks_per_node] -= cost
            budget[home] += cost
        placed[k] = r
        loads[r] = load + cost
        rows[r] += need
        counts[r] += 1
        room[r] = cap - rows[r]
        bisect.insort(by_load, (loads[r], r))
        bisect.insort(node, (loads[r], r))
    return placed, misfits


def _fullest_fitting(by_load: list[tuple[int, int]], most: float, need: int, room) -> int:
    """Index in ``by_load`` (sorted ``(load, rank)``) of the fullest rank with load at most
    ``most`` and ``need`` rows of room, else -1."""
    i = bisect.bisect_right(by_load, (most, math.inf)) - 1
    while i >= 0 and room[by_load[i][1]] < need:
        i -= 1
    return i


# The repair examines at most this many partner units per unit of an overloaded rank: the nearest
# in cost come first, so a partner that fits is almost always among them.
_REPAIR_SCAN = 64


def _repair(
    candidate: Candidate,
    units: Units,
    cap: float,
    accept: int,
    ranks_per_node: int,
) -> Candidate:
    """Bring ranks above ``accept`` down to it: move one of their units to a rank with room for
    it, or swap it for a cheaper unit of any rank with room for the difference.

    The refinement only pairs the most loaded rank with the least loaded one, which stalls when
    node-first placement leaves large units on a rank and only small holes elsewhere (0.2-7%
    above ``accept`` at 8 images per rank). Here every rank is a partner. A step bringing the
    rank to ``accept`` is preferred, the one adding the fewest inter-node rows, then the smallest
    shift of cost; else the step lowering it most. Then ties by the lowest unit ids and rank.
    Ranks go most loaded first (ties by rank), each for at most as many steps as it has units.
    """
    cost, tokens, src = units.cost, units.tokens, units.src
    dest, loads = full_dest(candidate, units), candidate.loads[:]
    num_ranks = len(loads)
    held: list[list[int]] = [[] for _ in range(num_ranks)]
    for u, d in enumerate(dest):
        held[d].append(u)
    rank_tokens = candidate.rows[:]
    by_cost = sorted((c, v) for v, c in enumerate(cost))

    def crossing(u: int, r: int) -> int:
        return tokens[u] if src[u] // ranks_per_node != r // ranks_per_node else 0

    def keeps_cap(r: int, shift: int, count: int) -> bool:
        return rank_tokens[r] + shift <= cap or count <= 1

    for hi in sorted(range(num_ranks), key=lambda r: (-loads[r], r)):
        if loads[hi] <= accept:
            break
        for _ in range(len(held[hi])):
            excess = loads[hi] - accept
            if excess <= 0:
                break
            best = _repair_steps(hi, held, loads, accept, by_cost, cost, dest, src, ranks_per_node)
            steps = []
            for u, x, v in best:
                shift = tokens[u] - (tokens[v] if v >= 0 else 0)
                if not (
                    keeps_cap(x, shift, len(held[x]) + (v < 0))
                    and keeps_cap(hi, -shift, len(held[hi]))
                ):
                    continue
                shifted = cost[u] - (cost[v] if v >= 0 else 0)
                added = crossing(u, x) - crossing(u, hi)
                if v >= 0:
                    added += crossing(v, hi) - crossing(v, x)
                if shifted >= excess:
                    steps.append((0, added, shifted, u, v, x))
                else:
                    steps.append((1, -shifted, added, u, v, x))
            if not steps:
                break
            *_, u, v, x = min(steps)
            for k, frm, to in ((u, hi, x), (v, x, hi)):
                if k < 0:
                    continue
                held[frm].remove(k)
                held[to].append(k)
                dest[k] = to
                loads[frm] -= cost[k]
                loads[to] += cost[k]
                rank_tokens[frm] -= tokens[k]
                rank_tokens[to] += tokens[k]
    return candidate_from_dest(dest, units, cap)


def _repair_steps(
    hi, held, loads, accept, by_cost, cost, dest, src, ranks_per_node
) -> list[tuple[int, int, int]]:
    """``(u, x, v)`` steps for ``_repair``: unit ``u`` of rank ``hi`` onto rank ``x``, taking
    back unit ``v`` of ``x`` (-1: none), that leave ``x`` at most at ``accept`` and lower ``hi``.
    For each ``u``, the partners nearest below its cost come first, at most ``_REPAIR_SCAN``."""
    least = min(range(len(loads)), key=loads.__getitem__)
    out = []
    for u in held[hi]:
        # Plain moves: the least loaded rank of u's home node, and of all (their inter-node rows
        # are all any move can add or save).
        home = min(node_ranks(src[u], ranks_per_node, len(loads)), key=loads.__getitem__)
        for x in (home,) if home == least else (home, least):
            if loads[x] + cost[u] <= accept:
                out.append((u, x, -1))
        below = bisect.bisect_left(by_cost, (cost[u], -1)) - 1
        for k in range(below, max(-1, below - _REPAIR_SCAN), -1):
            c, v = by_cost[k]
            if c <= cost[u] - (accept - loads[least]):
                break
            x = dest[v]
            if x != hi and c < cost[u] and loads[x] + cost[u] - c <= accept:
                out.append((u, x, v))
    return out
