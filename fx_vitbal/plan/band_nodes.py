"""Bands on a cluster of nodes: whole frames balanced across nodes first, then cut inside the
node that computes them.

[Note: bands by node] A plan solved over ranks with bands as units spreads a frame's bands over
whatever ranks have room, on any node, so a frame that fits one node pays for InfiniBand (and
the plan, which prices bands before it places them, cannot know). Node-aware plans (owners being
ranks) therefore plan in levels:

1. Frames that need more bands than a node has ranks (their priced exchange pays across nodes,
   or the memory budget asks for that many) are cut first (``band_plan.plan_cuts``), priced as
   if each band sat on a node of its own (placing cannot raise that price).
2. Nodes: every node's units (whole frames, with the exchange of the bands a node will cut
   them into, and those bands) are balanced over the nodes by ``solve_plan``, a node counting
   as one rank, refined finer than a step (``NODE_TOLERANCE``): frames cross nodes whole.
3. Ranks, node by node: the node's frames that cost more than the mean load (or exceed the
   memory budget) are poured over its ranks, the rest placed whole ([Note: pouring frames] in
   ``band_fill``), priced at NVLink rates.

Node-blind (``ranks_per_node`` None or 1, or one node): step 3 over every rank, the frames
planned as ``PIECES`` times as many pieces as their cost asks for by ``solve_plan``, then each
rank's pieces of a frame one band (``_merged``). Then each split frame is priced where its
bands sit (its kind chosen there), and bands the budget needs that share a rank are spread
(``band_plan.spread_bands``). Deterministic: nodes and ranks in order, ties to the lower index.
"""

import dataclasses
import functools
import math

from fx_vitbal.config import BalanceConfig
from fx_vitbal.cost.memory import rows_within
from fx_vitbal.plan.band_caps import keep_row_cap, owners_row_cap
from fx_vitbal.plan.band_fill import fill_ranks, held_by_ranks, most_blocks
from fx_vitbal.plan.band_plan import (
    Cut,
    Placed,
    bands_needed,
    cut_frame,
    expand,
    price_cut,
    rebuild,
    reprice,
    settle,
    spread_bands,
)
from fx_vitbal.plan.band_prices import ExchangePrices, usp_degree
from fx_vitbal.plan.bands import Band, BandRule
from fx_vitbal.plan.replicas import as_held, holders, set_of_ranks
from fx_vitbal.plan.solve import MAKESPAN_SLACK, solve_plan
from fx_vitbal.plan.units import Plan, is_band, unit_rows

# The node level's refinement (``BalanceConfig.tolerance``, ``max_iters`` at least these).
NODE_TOLERANCE, NODE_ITERS = 0.01, 400
# Pieces a frame cut inside a node is planned in, per band its cost alone would ask for: bands
# of about the mean load pack badly (nine such bands on a node of eight ranks leave a rank with
# two), pieces of about half of it pack well; each rank's pieces of a frame are then one band.
PIECES = 2


def solve_by_nodes(
    units_O: list[list[tuple]],
    costs_O: list[list[float]],
    cross: dict,
    rule: BandRule,
    prices: ExchangePrices | None,
    config: BalanceConfig,
    held_per_patch: int,
    only_required: bool = False,
    exchange_seconds=None,
) -> tuple[Plan, Placed, dict, list[list[int]]] | None:
    """``(plan, units, cuts, rows)`` of ``units_O`` (owners being ranks) planned by nodes (see
    [Note: bands by node]; node-blind: one node of every rank) with the frames of ``cross`` cut
    across nodes; None when no frame ends split. ``only_required``: cut only where the memory
    budget asks for bands. ``exchange_seconds``: the measured exchange model (``solve_plan``),
    weighed where one solve plans every rank (node-blind)."""
    num_ranks = len(units_O)
    rpn = config.ranks_per_node if by_nodes(config.ranks_per_node, num_ranks) else num_ranks
    mean = sum(map(sum, costs_O)) / num_ranks
    max_rows = rows_within(config.memory_budget, held_per_patch)
    home_rows = [[unit_rows(u) for u in units] for units in units_O]
    cap = owners_row_cap(home_rows, config.max_len_ratio, max_rows)
    blind = dataclasses.replace(config, ranks_per_node=None)
    # Nothing below the node level evens out what it leaves between nodes: it refines to a
    # finer tolerance, and a node's rows are its ranks' business (each rank's, in its node).
    nodes_config = dataclasses.replace(
        blind,
        max_len_ratio=math.inf,
        tolerance=min(config.tolerance, NODE_TOLERANCE),
        max_iters=max(config.max_iters, NODE_ITERS),
    )
    # Prices of bands on one node. By node, ``prices`` gives them as they are (its node size
    # tells apart only frames of more bands than a node has ranks), and shares their memo with
    # the step's cuts; node-blind, one "node" is every rank.
    inside = prices
    if prices is not None and rpn == num_ranks:
        inside = dataclasses.replace(prices, ranks_per_node=None)
    first = expand(units_O, costs_O, cross)
    # A frame binds above the mean, or above the dearest band cut across nodes (no plan ends
    # below that: cutting what costs less buys nothing).
    floor = max((c for (o, i), cut in cross.items() for c in cut.costs(costs_O[o][i])), default=0.0)
    binds = max(mean, floor)
    nodes = [range(n, min(n + rpn, num_ranks)) for n in range(0, num_ranks, rpn)]
    refs = [[(r, j) for r in ranks for j in range(len(first.units_O[r]))] for ranks in nodes]
    cut_at = _cuts_inside(first, binds, mean, len(nodes[0]), rule, inside, config, held_per_patch)
    if only_required:
        cut_at = {key: cut for key, cut in cut_at.items() if cut.required}

    def halve(u) -> Cut:
        """``u`` in two bands inside a node (``fill_ranks``' ``bar``)."""
        bands = rule.bands(u, 2)
        return Cut(bands, *price_cut(bands, rule, inside, None, config), None)

    if len(nodes) > 1:  # a frame a node cuts costs it its bands' exchange too
        group_of = _usp_groups(first, cross, rule, rpn)
        items = [_node_items(ref, group_of) for ref in refs]
        price = {key: sum(cut.prices) for key, cut in cut_at.items()}
        node_costs = [
            [
                sum(first.costs_O[r][j] + price.get((r, j), 0.0) for r, j in item)
                for item in node_items
            ]
            for node_items in items
        ]
        node_plan = solve_plan(
            node_costs,
            [[sum(unit_rows(first.units_O[r][j]) for r, j in item) for item in i] for i in items],
            config=nodes_config,
            max_rows=max_rows * rpn,  # a node's ranks' rows
        )
        assigned = [
            [ref for src, j in node_plan.assignment[n] for ref in items[src][j]]
            for n in range(len(nodes))
        ]
    else:
        assigned = refs
    pieces: dict[tuple[int, int], Cut] = {}  # in-node cuts
    where: dict[tuple[int, int, int], int] = {}  # (owner, whole index, band or piece) -> rank
    held = [
        held_by_ranks(first, ranks, members, cut_at)
        for ranks, members in zip(nodes, assigned, strict=True)
    ]
    most = functools.partial(most_blocks, rule=rule, held=held_per_patch, config=config)
    if len(nodes) == 1:  # node-blind: pieces, by the step's own solver over every rank
        (units, frames), ranks = held[0], nodes[0]
        for k, r, i, u, cost, cut in frames:
            cut = pieces[(r, i)] = _in_pieces(cut, u, rule)
            pieces_of = zip(cut.costs(cost), cut.bands, strict=True)
            units[k] += [(r, i, b, c, unit_rows(p)) for b, (c, p) in enumerate(pieces_of)]
        sub = solve_plan(
            [[entry[3] for entry in unit] for unit in units],
            [[entry[4] for entry in unit] for unit in units],
            config=blind,
            exchange_seconds=exchange_seconds,
            max_rows=max_rows,
        )
        filled = [([sub.destinations(k) for k in range(len(units))], [], 0.0, 0.0, units, [])]
    else:  # by node: whole units first, then frames poured up to each node's level
        filled = [fill_ranks(*state, first, rule, halve, most, cap=cap) for state in held]
        # No plan ends below the fullest node's level: a node's rank above it by the minimum
        # gain has its costliest frame poured too (nine frames of nearly the mean on eight
        # ranks), where an exchange model prices the bands that costs (else nothing says it
        # pays, as for ``band_gaps``).
        bar = max(floor, *(f[3] for f in filled)) * (1.0 + MAKESPAN_SLACK)
        for n, state in enumerate(held):
            if prices is not None and filled[n][2] > bar * (1.0 + config.min_gain):
                filled[n] = fill_ranks(*state, first, rule, halve, most, bar, cap)
    for ranks, (dests, placed, _, _, units, frames) in zip(nodes, filled, strict=True):
        for (_, r, i, u, _, cut), (bands, on) in zip(frames, placed, strict=True):
            if cut.required and max(b.h for b in bands) > most(u) * rule.align:
                # Its node had too few ranks with room: its even bands, spread below.
                bands, on = cut.bands, [on[0]] * len(cut.bands)
            if len(bands) > 1:
                pieces[(r, i)] = cut._replace(bands=bands, prices=[0.0] * len(bands))
            where.update(((r, i, b), ranks[d]) for b, d in enumerate(on))
        for unit, ds in zip(units, dests, strict=True):
            for entry, d in zip(unit, ds, strict=True):
                where[entry[:3]] = ranks[d]
    _by_node(cross, where)
    cuts = _merged({**cross, **pieces}, where)
    if not cuts:
        return None
    final = expand(units_O, costs_O, cuts)
    dest_O = [[0] * len(units) for units in final.units_O]
    for (o, i, band), r in where.items():
        dest_O[o][final.first_O[o][i] + band] = r
    cuts = settle(cuts, final, lambda o, i: dest_O[o][i], rule, prices, config)
    reprice(final, costs_O, cuts)
    loads = [0.0] * num_ranks
    for costs, dests in zip(final.costs_O, dest_O, strict=True):
        for cost, d in zip(costs, dests, strict=True):
            loads[d] += cost
    spread_by = rpn if rpn < num_ranks else None
    moved = spread_bands(dest_O, loads, final, cuts, spread_by)  # budget bands, two on a rank
    if keep_row_cap(dest_O, loads, final, cuts, cap, rule, spread_by) or moved:
        cuts = settle(cuts, final, lambda o, i: dest_O[o][i], rule, prices, config)
        reprice(final, costs_O, cuts)
    plan, rows_O = rebuild(final.units_O, final.costs_O, dest_O, config, max_rows)
    return plan, final, cuts, rows_O


def _cuts_inside(first: Placed, binds, mean, ranks, rule, inside, config, held_per_patch) -> dict:
    """Each frame of ``first`` a node cuts, by ``(owner, index)``: those costing more than
    ``binds`` or holding more than the memory budget, each cut for a node's ``ranks``
    (``cut_frame``, priced inside a node: ``inside``), once a shape."""
    memo: dict[tuple, Cut | None] = {}
    cut_at = {}
    for r, (units, costs) in enumerate(zip(first.units_O, first.costs_O, strict=True)):
        for j, (u, cost) in enumerate(zip(units, costs, strict=True)):
            if (cost <= binds and config.memory_budget is None) or is_band(u) or u[0] != 1:
                continue
            need = bands_needed(u, held_per_patch, config, rule.align)
            if need < 2 and cost <= binds:
                continue
            key = (u, cost, need)
            if key not in memo:
                memo[key] = cut_frame(u, cost, mean, need, ranks, rule, inside, config)
            if memo[key] is not None:
                cut_at[(r, j)] = memo[key]
    return cut_at


def _usp_groups(first: Placed, cross: dict, rule: BandRule, rpn: int) -> dict:
    """Each band of a ``usp`` frame cut across nodes, by its ``(owner, index)`` in ``first``:
    ``(its frame's first band, its Ulysses group)`` (``usp_degree`` consecutive bands)."""
    group_of = {}
    for (o, i), cut in cross.items():
        if cut.kind == "usp":
            u = usp_degree(rule.heads, len(cut.bands), rpn)
            start = first.names[(o, i)][1]
            group_of.update({(o, start + b): ((o, start), b // u) for b in range(len(cut.bands))})
    return group_of


def _node_items(ref: list, group_of: dict) -> list[tuple]:
    """A node's units for the node level, as tuples of ``first``'s ``(owner, index)``: one
    unit each, but a ``usp`` frame's bands in their Ulysses groups (``_usp_groups``), which
    cross nodes whole so that each group's all-to-all stays on one node's links."""
    items, groups = [], {}
    for key in ref:
        if key not in group_of:
            items.append((key,))
        elif group_of[key] in groups:
            items[groups[group_of[key]]] += (key,)
        else:
            groups[group_of[key]] = len(items)
            items.append((key,))
    return items


def _by_node(cross: dict, where: dict) -> None:
    """Each frame cut across nodes in even bands has its bands renumbered in rank order, so a
    node's bands of it are consecutive: a ring crosses each node boundary once, and ``usp``'s
    groups of consecutive bands sit on one node where the node holds a whole group. Even bands
    cost alike, so no load changes."""
    for (o, i), cut in cross.items():
        keys = [(o, i, b) for b in range(len(cut.bands))]
        if len({(b.h, b.w) for b in cut.bands}) == 1 and all(key in where for key in keys):
            where.update(zip(keys, sorted(where[key] for key in keys), strict=True))


def _in_pieces(cut: Cut, unit, rule: BandRule) -> Cut:
    """``cut`` as ``PIECES`` times as many even pieces (not a cut the budget needs), each
    priced as its rows' share of ``cut``'s exchange; ``cut`` itself where rows allow fewer
    pieces: four pieces of a frame that its three even bands would cut 6, 6 and 4 rows are
    4 rows each, and one rank of the three gets two."""
    k = len(cut.bands)
    if cut.required:
        return cut
    bands = rule.bands(unit, k * PIECES)
    if len(bands) < k * PIECES:
        return cut
    per_row = sum(cut.prices) / unit[1]  # the exchange, shared by rows
    return cut._replace(bands=bands, prices=[per_row * b.h for b in bands])


def _merged(cuts: dict, where: dict) -> dict:
    """``cuts`` with each frame's pieces regrouped so each rank computing some holds one
    run of the frame's rows, as many as its pieces had (ranks in the order of their first
    piece), one band: a band costs its rows' share of the frame, so every rank's load stays
    as planned, even where the pieces are not (24 row blocks in 16 pieces: 8 of two blocks, 8
    of one; a rank holding one of each gets three blocks, not its first two pieces). A frame
    on one rank is whole again; cuts the budget needs keep their bands. ``where``: ``(owner,
    whole index, band)`` -> rank, the pieces' entries replaced by the bands' in place."""
    merged = {}
    for (o, i), cut in cuts.items():
        ranks = [where.pop((o, i, b)) for b in range(len(cut.bands))]
        rows = dict.fromkeys(ranks, 0)
        for r, piece in zip(ranks, cut.bands, strict=True):
            rows[r] += piece.h
        if cut.required or len(rows) == len(ranks):
            merged[(o, i)] = cut
            where.update(((o, i, b), r) for b, r in enumerate(ranks))
            continue
        if len(rows) == 1:
            where[(o, i, 0)] = ranks[0]
            continue
        first, bands = cut.bands[0], []
        at = first.first_row
        for b, (r, h) in enumerate(rows.items()):
            bands.append(Band(1, h, first.w, first.full_h, at))
            where[(o, i, b)] = r
            at += h
        merged[(o, i)] = cut._replace(bands=bands, prices=[0.0] * len(bands))
    return merged


def by_nodes(ranks_per_node: int | None, num_ranks: int) -> bool:
    """Whether bands are planned by nodes: two nodes or more, all of ``ranks_per_node`` ranks.
    Else node-blind (each split frame still priced where its bands sit): the node level
    balances nodes as equals, so a last node of one rank among nodes of four would take a
    node's share of the work (a 48-row frame alone on 5 ranks, 4 a node: bands of 10, 10, 8
    rows and one of 20, twice the even share, on the lone rank)."""
    return (
        ranks_per_node is not None
        and 1 < ranks_per_node < num_ranks
        and (num_ranks % ranks_per_node == 0)
    )


def cross_cuts(cuts: dict, ranks_per_node: int) -> dict:
    """The cuts with more bands than a node has ranks (step 1 of [Note: bands by node])."""
    return {key: cut for key, cut in cuts.items() if len(cut.bands) > ranks_per_node}


def solve_sets(units_S, costs_S, sets, rule, prices, config, held_per_patch, plan_cuts):
    """``solve_by_nodes`` for replica sets (``plan.replicas``): each set's units held by its
    replicas as ``solve_for_sets`` holds them (``holders``), planned as each rank's own, then
    seen from the sets again: ``(plan, units_S, held, rows_S, frames names, cuts)``,
    a cut frame's bands consecutive in its set's units and held by the rank holding the frame;
    None when no frame ends split. ``plan_cuts``: the cuts of each rank's units."""
    held: list[list[int]] = [[] for _ in range(sum(map(len, sets)))]
    for ranks, costs in zip(sets, costs_S, strict=True):
        for i, j in enumerate(holders(costs, len(ranks))):
            held[ranks[j]].append(i)
    units_R, costs_R = as_held(units_S, sets, held), as_held(costs_S, sets, held)
    rpn = config.ranks_per_node
    cuts = plan_cuts(units_R, costs_R)
    cross = cross_cuts(cuts, rpn) if by_nodes(rpn, len(units_R)) else {}
    only_required = all(cut.required for cut in cuts.values())
    done = solve_by_nodes(
        units_R, costs_R, cross, rule, prices, config, held_per_patch, only_required
    )
    if done is None:
        return None
    plan, _, settled, _ = done
    set_of = set_of_ranks(sets)
    cut_at = {(set_of[r], held[r][j]): cut for (r, j), cut in settled.items()}
    units_new, new_index = [], []
    for s, units in enumerate(units_S):
        listed, index = [], []
        for i, u in enumerate(units):
            index.append(len(listed))
            listed += cut_at[(s, i)].bands if (s, i) in cut_at else [u]
        units_new.append(listed)
        new_index.append(index)
    held_new = []
    for r, ids in enumerate(held):
        s = set_of[r]
        held_new.append([new_index[s][i] + b for i in ids for b in range(_count(cut_at, s, i))])
    names = {
        key: (set_of[key[0]], new_index[set_of[key[0]]][held[key[0]][key[1]]]) for key in settled
    }
    rows_S = [[unit_rows(u) for u in units] for units in units_new]
    return plan, units_new, held_new, rows_S, names, settled


def _count(cut_at: dict, s: int, i: int) -> int:
    return len(cut_at[(s, i)].bands) if (s, i) in cut_at else 1
