"""Which units the ranks above the target (or above the row cap) shed: for large inputs torch ops
over every rank at once, in integer fixed point, so no Python runs per rank or per unit here;
for small ones (``Units.small``) the same rule rank by rank in Python (``_shed_by_rank``, which
``test_planner`` proves equal to the torch ops).

Shape suffixes: ``_R`` per rank, ``_G`` per rank that sheds (a group), ``_P`` per unit of those
ranks, grouped, in the order the rule reads them (positions).

Each group's units are ordered by one sort of a composite key ``group << shift | value`` (values
stay below ``2**shift``), so every per-group question the rule asks (the first unit worth at
least so much, the longest run of units summing below so much) is a ``searchsorted`` over all
groups at once.
"""

import math
from typing import NamedTuple

import torch

from fx_vitbal.plan.units import Units

# Above any sum of rows or fixed-point costs (both stay below 2**62): an option that is not one.
_NONE = 1 << 62


class Shed(NamedTuple):
    """The shed units, by cost descending (ties by id), each with its cost, rows and home rank;
    every rank's load, rows and unit count without them; and the ranks by load, as keys
    ``load << rank_bits | rank`` ascending (``min_move.best_fit``'s)."""

    ids: list[int]
    costs: list[int]
    needs: list[int]
    homes: list[int]
    loads: list[int]
    rows: list[int]
    counts: list[int]
    by_load: list[int]


def shed_over_target(units: Units, cap: float, accept: int) -> Shed:
    """Every rank above ``accept`` sheds units until it is not, then every rank above the row cap
    with more than one unit left sheds rows until it is not or holds one unit.

    The load rule, per rank: the cheapest single unit covering the excess, or the largest units
    below it while they leave some of it, closed by the cheapest other unit covering the rest;
    the one moving fewer rows wins (the second on ties). Large units carry fewer rows per cost,
    small ones place more easily. With nothing covering the excess (history alone exceeds the
    target), every unit goes.

    The row rule: the fewest rows among the same two options over rows, and shedding all but the
    unit with the most rows (one unit alone may exceed the cap); ties in that order.
    """
    if units.small:
        return _shed_by_rank(units, cap, accept)
    loads_R, rows_R, counts_R = units.home_loads_R, units.home_rows_R, units.counts_R
    accept = min(accept, _NONE)  # loads are below it: any higher target sheds the same
    sheds_R = loads_R > accept
    if cap != math.inf:
        sheds_R |= (rows_R > cap) & (counts_R > 1)
    ranks_G = sheds_R.nonzero().squeeze(1)
    if not len(ranks_G) or not int(counts_R.index_select(0, ranks_G).sum()):
        return _shed(units, [], units.home_loads_R, rows_R, counts_R)
    loads_G = loads_R.index_select(0, ranks_G)
    rows_G = rows_R.index_select(0, ranks_G)
    counts_G = counts_R.index_select(0, ranks_G)
    cost_U, tokens_U = units.cost_U, units.tokens_U
    shift = 62 - units.rank_bits  # fixed-point costs stay below 2**shift (``Units.scale_exp``)

    # Load rule: each group's units by cost ascending, ties by id descending.
    group_P, ids_P = _group_units(units, ranks_G, counts_G)
    key_P, ids_P = _sorted_within(group_P, ids_P, cost_U.index_select(0, ids_P), shift)
    cost_P = key_P & ((1 << shift) - 1)
    rows_P = tokens_U.index_select(0, ids_P)
    groups = _Groups(counts_G, shift)
    excess_G = (loads_G - accept).clamp(min=0)
    rule = _cover(key_P, cost_P, rows_P, groups, excess_G)
    over_G = excess_G > 0
    # Shed positions: an interval per group, plus the closing unit of the several.
    several_G = over_G & ~rule.all & ~rule.use_single
    lo = torch.where(rule.all, groups.start, torch.where(rule.use_single, rule.single, rule.first))
    hi = torch.where(rule.all, groups.end, rule.single + rule.use_single)
    lo, hi = torch.where(over_G, lo, 0), torch.where(over_G, hi, 0)
    shed_P = _mark(len(ids_P), lo, hi, torch.where(several_G, rule.closing, -1))
    total_cost, total_rows = groups.totals(rule.cum_cost), groups.totals(rule.cum_rows)
    shed_cost = torch.where(
        rule.all, total_cost, torch.where(rule.use_single, rule.single_cost, rule.several_cost)
    )
    shed_rows = torch.where(
        rule.all, total_rows, torch.where(rule.use_single, rule.single_rows, rule.several_rows)
    )
    shed_count = torch.where(
        rule.all, counts_G, torch.where(rule.use_single, 1, rule.single - rule.first + 1)
    )
    loads_G = loads_G - torch.where(over_G, shed_cost, 0)
    rows_G = rows_G - torch.where(over_G, shed_rows, 0)
    counts_G = counts_G - torch.where(over_G, shed_count, 0)
    shed = [ids_P[shed_P]]

    crowded_G = (rows_G > cap) & (counts_G > 1) if cap != math.inf else None
    if crowded_G is not None and bool(crowded_G.any()):
        kept_P = (~shed_P & crowded_G.index_select(0, group_P)).nonzero().squeeze(1)
        ids_Q, shed_Q, cut = _shed_rows(
            units, ids_P.index_select(0, kept_P), group_P.index_select(0, kept_P), rows_G, cap
        )
        loads_G, rows_G, counts_G = loads_G - cut[0], rows_G - cut[1], counts_G - cut[2]
        shed.append(ids_Q[shed_Q])

    loads_R, rows_R, counts_R = loads_R.clone(), rows_R.clone(), counts_R.clone()
    loads_R.index_copy_(0, ranks_G, loads_G)
    rows_R.index_copy_(0, ranks_G, rows_G)
    counts_R.index_copy_(0, ranks_G, counts_G)
    return _shed(units, shed, loads_R, rows_R, counts_R)


def _shed_by_rank(units: Units, cap: float, accept: int) -> Shed:
    """``shed_over_target`` rank by rank on Python lists, for small inputs: the rule as its
    docstring states it."""
    cost, tokens, src = units.cost, units.tokens, units.src
    loads, rows, counts = units.home_loads[:], units.home_rows[:], units.counts[:]
    shed = []
    for r in range(units.num_ranks):
        over = loads[r] > accept
        if not (over or (rows[r] > cap and counts[r] > 1)):
            continue
        held = sorted(reversed(units.home_ids(r)), key=cost.__getitem__)  # ties: id descending
        gone = []
        if over:
            several, single = _options(held, loads[r] - accept, cost)
            if several is None:
                gone = held
            elif single is None or sum(map(tokens.__getitem__, several)) <= tokens[single]:
                gone = several
            else:
                gone = [single]
        left = rows[r] - sum(map(tokens.__getitem__, gone))
        if left > cap and counts[r] - len(gone) > 1:
            held = sorted(sorted(set(held).difference(gone), reverse=True), key=tokens.__getitem__)
            several, single = _options(held, left - cap, tokens)
            options = [several] if several is not None and len(several) < len(held) else []
            options += [[single]] if single is not None else []
            options.append(held[:-1])  # the unit with the most rows stays, alone
            gone = gone + min(options, key=lambda out: sum(map(tokens.__getitem__, out)))
        for u in gone:
            loads[r] -= cost[u]
            rows[r] -= tokens[u]
            counts[r] -= 1
        shed += gone
    shed.sort()
    shed.sort(key=cost.__getitem__, reverse=True)  # by cost descending, ties by id
    bits = units.rank_bits
    return Shed(
        shed,
        [cost[u] for u in shed],
        [tokens[u] for u in shed],
        [src[u] for u in shed],
        loads,
        rows,
        counts,
        sorted((load << bits) | r for r, load in enumerate(loads)),
    )


def _options(ascending: list[int], excess: int, value: list[int]):
    """The rule's two options for one rank's units (``ascending`` by ``value``, ties by id
    descending): the several (the largest units below the excess while they leave some of it,
    closed by the cheapest other unit covering the rest; None when nothing covers it) and the
    single (the cheapest unit covering the excess; None when none does)."""
    single = next((u for u in ascending if value[u] >= excess), None)
    several, covered = [], 0
    for u in reversed(ascending):
        if 0 < value[u] < excess:
            if covered + value[u] >= excess:
                break
            several.append(u)
            covered += value[u]
    rest = excess - covered
    closing = next((u for u in ascending if value[u] >= rest and u not in several), None)
    return (None if closing is None else [*several, closing]), single


def _shed_rows(units: Units, ids_Q, group_Q, rows_G, cap):
    """The row rule on the units (``ids_Q``, grouped ascending) the crowded groups keep.

    Returns the units by rows ascending within their groups, which of them are shed, and each
    group's shed cost, rows and count."""
    shift = 62 - units.rank_bits
    order = torch.sort(ids_Q).indices  # ids are distinct: any sort is stable
    ids_Q, group_Q = ids_Q.index_select(0, order), group_Q.index_select(0, order)
    rows_Q = units.tokens_U.index_select(0, ids_Q)
    key_Q, ids_Q = _sorted_within(group_Q, ids_Q, rows_Q, shift)
    rows_Q = units.tokens_U.index_select(0, ids_Q)
    cost_Q = units.cost_U.index_select(0, ids_Q)
    groups = _Groups(torch.bincount(group_Q, minlength=len(rows_G)), shift)
    excess_G = (rows_G - cap).clamp(min=0)
    crowded_G = (excess_G > 0) & (groups.count > 1)
    rule = _cover(key_Q, rows_Q, rows_Q, groups, excess_G)
    last = (groups.end - 1).clamp(min=0)
    # Several: valid unless it sheds every unit; single: one unit goes; lone: all but the last.
    several = torch.where(
        rule.all | (rule.single - rule.first + 1 >= groups.count), _NONE, rule.several_rows
    )
    lone = groups.totals(rule.cum_rows) - rows_Q.index_select(0, last)
    pick = torch.stack([several, rule.single_rows, lone], dim=1).argmin(dim=1)  # first of equals
    lo = torch.where(pick == 0, rule.first, torch.where(pick == 1, rule.single, groups.start))
    hi = torch.where(pick == 0, rule.single, torch.where(pick == 1, rule.single + 1, last))
    lo, hi = torch.where(crowded_G, lo, 0), torch.where(crowded_G, hi, 0)
    closing = torch.where(crowded_G & (pick == 0), rule.closing, -1)
    shed_Q = _mark(len(ids_Q), lo, hi, closing)
    cum_cost = torch.cat([cost_Q.new_zeros(1), torch.cumsum(cost_Q, 0)])
    cut_cost = cum_cost.index_select(0, hi) - cum_cost.index_select(0, lo)
    cut_cost = cut_cost + torch.where(closing >= 0, cost_Q.index_select(0, closing.clamp(min=0)), 0)
    cut_rows = rule.cum_rows.index_select(0, hi) - rule.cum_rows.index_select(0, lo)
    cut_rows = cut_rows + torch.where(closing >= 0, rows_Q.index_select(0, closing.clamp(min=0)), 0)
    cut_count = hi - lo + (closing >= 0)
    return ids_Q, shed_Q, (cut_cost, cut_rows, cut_count)


def _shed(units: Units, shed: list, loads_R, rows_R, counts_R) -> Shed:
    """The ``Shed`` of the shed ids (tensors, any order) and the ranks' state without them."""
    ids = torch.cat(shed) if shed else torch.zeros(0, dtype=torch.int64)
    ids = torch.sort(ids).values
    ids = ids.index_select(0, torch.sort(-units.cost_U.index_select(0, ids), stable=True).indices)
    keys_R = (loads_R << units.rank_bits) | torch.arange(units.num_ranks)
    return Shed(
        ids.tolist(),
        units.cost_U.index_select(0, ids).tolist(),
        units.tokens_U.index_select(0, ids).tolist(),
        units.src_U.index_select(0, ids).tolist(),
        loads_R.tolist(),
        rows_R.tolist(),
        counts_R.tolist(),
        torch.sort(keys_R).values.tolist(),
    )


def _group_units(units: Units, ranks_G, counts_G):
    """Each group's position per unit, and the unit ids (ascending within each group)."""
    group_P = torch.repeat_interleave(torch.arange(len(ranks_G)), counts_G)
    first_G = units.starts_R.index_select(0, ranks_G) - (torch.cumsum(counts_G, 0) - counts_G)
    return group_P, first_G.index_select(0, group_P) + torch.arange(len(group_P))


def _sorted_within(group_P, ids_P, value_P, shift):
    """The composite keys ``group << shift | value`` ascending, ties by id descending (``ids_P``
    ascending within each group), and the ids in that order: a stable sort of the positions
    reversed, so equal keys keep the reversed (descending) id order."""
    key = ((group_P << shift) | value_P).flip(0)
    order = torch.sort(key, stable=True).indices
    return key.index_select(0, order), ids_P.flip(0).index_select(0, order)


class _Groups:
    """Where each group's positions start and end, and its smallest composite key."""

    def __init__(self, counts_G: torch.Tensor, shift: int):
        self.count = counts_G
        self.end = torch.cumsum(counts_G, 0)
        self.start = self.end - counts_G
        self.base = torch.arange(len(counts_G)) << shift

    def totals(self, cumulative: torch.Tensor) -> torch.Tensor:
        return cumulative.index_select(0, self.end) - cumulative.index_select(0, self.start)


class _Rule(NamedTuple):
    single: torch.Tensor  # position of the single unit covering the excess; ``end``: none
    first: torch.Tensor  # the several units below it are positions first .. single - 1
    closing: torch.Tensor  # position of the unit closing them; -1: none
    all: torch.Tensor  # nothing covers the excess: every unit goes
    use_single: torch.Tensor  # the single unit moves fewer rows than the several
    single_cost: torch.Tensor
    single_rows: torch.Tensor  # ``_NONE``: no single unit
    several_cost: torch.Tensor
    several_rows: torch.Tensor
    cum_cost: torch.Tensor  # exclusive prefix sums over positions (length P + 1)
    cum_rows: torch.Tensor


def _cover(key_P, value_P, rows_P, groups: _Groups, excess_G) -> _Rule:
    """The two options of the shedding rule per group, for positions by ``value`` ascending
    within each group (``key_P``: their composite keys): ``single`` is the first position
    covering the excess; ``first`` starts the longest run of positive values below it summing to
    less than the excess; ``closing`` is the first position before the run covering the rest,
    else ``single``. Values are non-negative, so prefix sums never decrease and each of these is
    one ``searchsorted`` for all groups."""
    last = len(key_P) - 1
    single = torch.searchsorted(key_P, groups.base | excess_G)
    positive = torch.searchsorted(key_P, groups.base | 1)
    cum_cost = torch.cat([value_P.new_zeros(1), torch.cumsum(value_P, 0)])
    cum_rows = torch.cat([rows_P.new_zeros(1), torch.cumsum(rows_P, 0)])
    upto = cum_cost.index_select(0, single)
    first = torch.searchsorted(cum_cost, upto - excess_G, right=True)
    first = torch.maximum(torch.minimum(first, single), positive)
    rest = excess_G - (upto - cum_cost.index_select(0, first))
    closer = torch.searchsorted(key_P, groups.base | rest)
    has_single = single < groups.end
    closing = torch.where(closer < first, closer, torch.where(has_single, single, -1))
    at_closing = closing.clamp(min=0)
    several_cost = upto - cum_cost.index_select(0, first) + value_P.index_select(0, at_closing)
    several_rows = cum_rows.index_select(0, single) - cum_rows.index_select(0, first)
    several_rows = several_rows + rows_P.index_select(0, at_closing)
    at_single = single.clamp(max=last)
    single_rows = torch.where(has_single, rows_P.index_select(0, at_single), _NONE)
    return _Rule(
        single=single,
        first=first,
        closing=closing,
        all=closing < 0,
        use_single=has_single & (several_rows > single_rows),
        single_cost=value_P.index_select(0, at_single),
        single_rows=single_rows,
        several_cost=several_cost,
        several_rows=torch.where(closing < 0, _NONE, several_rows),
        cum_cost=cum_cost,
        cum_rows=cum_rows,
    )


def _mark(num_positions: int, lo_G, hi_G, extra_G) -> torch.Tensor:
    """Positions in each group's ``[lo, hi)`` (disjoint intervals) or at its ``extra`` (-1:
    none), as a mask: +1 at each start, -1 at each end, summed."""
    ones = torch.ones_like(lo_G)
    edges = torch.zeros(num_positions + 1, dtype=torch.int64)
    edges.index_add_(0, lo_G, ones).index_add_(0, hi_G, -ones)
    mask = torch.cumsum(edges, 0)[:num_positions] > 0
    return mask.index_fill_(0, extra_G[extra_G >= 0], True)
