"""Cuts: which frames become bands and how many, what a cut costs where its bands sit, and
the bookkeeping shared by the ways of placing them (``plan.step``, ``plan.band_nodes``).

- ``plan_cuts`` / ``cut_frame``: a frame costing more than the mean load (it binds the step:
  no plan of whole units ends below it) is cut into the fewest even bands whose share of the
  frame plus their exchange (``band_prices``: the cheapest kind where they would sit) comes to
  the mean, up to one band a rank; when no count does, the count whose dearest band costs
  least, if that beats the whole frame. With a memory budget, a frame whose held activations
  exceed it (``cost.memory``: ``bands_needed``) is cut into at least ``ceil(held / budget)``
  bands, binding or not.
- ``price_cut`` / ``settle``: a cut's kind and prices where its bands sit.
- ``expand``, ``rebuild``: units with cuts, and the plan of a full assignment.
- ``spread`` / ``spread_bands``: bands of one frame on one rank moved to ranks without one,
  then levelled (``_level_bands``).

Deterministic: frames in owner and unit order, ties to the lower rank and the fewer bands.
"""

import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

from fx_vitbal.config import BalanceConfig
from fx_vitbal.plan.band_prices import ExchangePrices, kinds_for
from fx_vitbal.plan.bands import Band, BandRule, band_cost
from fx_vitbal.plan.candidates import candidate_from_dest, make_plan, row_cap
from fx_vitbal.plan.nodes import node_ranks
from fx_vitbal.plan.units import Plan, Units, is_band, unit_rows

# Loads within this fraction of each other tie where bands are spread (``spread``).
TIE = 1e-9


class Cut(NamedTuple):
    """A frame's bands, their exchange, and where they were priced."""

    bands: list[Band]
    kind: str
    prices: list[float]
    """Each band's exchange (``band_prices.ExchangePrices.frame_prices``; zeros without a scale)."""
    nodes: tuple[int, ...] | None
    """Each band's node as priced (``ExchangePrices.packed_nodes`` until placed)."""
    required: bool = False
    """The memory budget needs this many bands: kept whether or not they pay."""

    def costs(self, frame_cost: float) -> list[float]:
        """Each band's cost: its share of its frame's plus its exchange."""
        return [band_cost(frame_cost, b) + p for b, p in zip(self.bands, self.prices, strict=True)]


def price_cut(
    bands: list[Band],
    rule: BandRule,
    prices: ExchangePrices | None,
    nodes,
    config: BalanceConfig,
    ranks: Sequence[int] | None = None,
) -> tuple[str, list[float]]:
    """``(kind, prices)`` of bands placed on ``nodes`` (computed on ``ranks``, when known): the
    cheapest kind (``auto``) or the one ``config.band_exchange`` forces; without a scale for
    bytes, no price and ``gather`` for ``auto``. Two bands of the frame on one rank:
    ``gather``, forced or not (the runtime gathers there, whatever the kind)."""
    distinct = len(set(ranks)) if ranks is not None else len(bands)
    if prices is None:
        forced = config.band_exchange
        if forced == "auto" or distinct < len(bands):
            return "gather", [0.0] * len(bands)
        return kinds_for(rule, forced, distinct, config.ranks_per_node)[0], [0.0] * len(bands)
    kind, priced = _priced(prices, tuple(b.h * b.w for b in bands), nodes, distinct)
    return kind, list(priced)


def forget_prices() -> None:
    """Empty ``price_cut``'s memo of priced shapes: to time a plan as a step whose shapes the
    process has not priced before (``benchmarks/bands.py``)."""
    _priced.cache_clear()


@functools.lru_cache(maxsize=4096)
def _priced(prices: ExchangePrices, sizes: tuple[int, ...], nodes, distinct: int):
    """``price_cut``'s answer, once per shape and place (frames repeat their shapes)."""
    if distinct < len(sizes):
        return "gather", tuple(prices.frame_prices(sizes, "gather", nodes))
    kind, priced = prices.cheapest(sizes, nodes, distinct)
    return kind, tuple(priced)


class Placed(NamedTuple):
    """Units with some frames cut (``expand``): each owner's units and costs, and each cut's
    name in ``StepPlan.frames`` (``(owner, index of its first band)``) by its frame's
    ``(owner, index)`` among the whole units."""

    units_O: list[list[tuple]]
    costs_O: list[list[float]]
    names: dict[tuple[int, int], tuple[int, int]]
    first_O: list[Sequence[int]]
    """``first_O[o][i]``: where whole unit ``i`` of owner ``o`` (its first band) now is."""
    origin_O: list[Sequence[int]]
    """``origin_O[o][j]``: the whole unit unit ``j`` of owner ``o`` is (a band: its frame)."""


def expand(units_O, costs_O, cuts: dict[tuple[int, int], Cut]) -> Placed:
    """``units_O`` (costs ``costs_O``) with each frame of ``cuts`` as its bands. An owner
    without a cut keeps its own lists (most owners, at scale: read, never written)."""
    placed = Placed([], [], {}, [], [])
    cut_owners = {o for o, _ in cuts}
    for o, (units, costs) in enumerate(zip(units_O, costs_O, strict=True)):
        if o not in cut_owners:
            placed.units_O.append(units)
            placed.costs_O.append(costs)
            placed.first_O.append(range(len(units)))
            placed.origin_O.append(range(len(units)))
            continue
        split, split_costs, first, origin = [], [], [], []
        for i, (u, cost) in enumerate(zip(units, costs, strict=True)):
            cut = cuts.get((o, i))
            first.append(len(split))
            if cut is None:
                split.append(u)
                split_costs.append(cost)
                origin.append(i)
                continue
            placed.names[(o, i)] = (o, len(split))
            split += cut.bands
            split_costs += cut.costs(cost)
            origin += [i] * len(cut.bands)
        placed.units_O.append(split)
        placed.costs_O.append(split_costs)
        placed.first_O.append(first)
        placed.origin_O.append(origin)
    return placed


def reprice(placed: Placed, costs_O, cuts: dict[tuple[int, int], Cut]) -> None:
    """``placed`` (``expand`` of ``costs_O`` by cuts of the same bands) with each band's cost
    as ``cuts`` price it now (``settle``): only prices changed, so no expand again."""
    for (o, i), cut in cuts.items():
        first = placed.names[(o, i)][1]
        placed.costs_O[o][first : first + len(cut.bands)] = cut.costs(costs_O[o][i])


def bands_needed(
    unit: Sequence[int], held_per_patch: int, config: BalanceConfig, align: int
) -> int:
    """The fewest bands of whole ``align`` rows a frame must be cut into for each to fit
    ``memory_budget`` (``cost.memory``): at least ``ceil(held / budget)``, more where rows
    round up. A budget below one ``align`` block: a band a block (as many as rows allow)."""
    if config.memory_budget is None or not held_per_patch:
        return 1
    if unit[1] * unit[2] * held_per_patch <= config.memory_budget:
        return 1
    blocks = max(1, unit[1] // align)
    most = config.memory_budget // (held_per_patch * align * unit[2])  # blocks a band holds
    return blocks if most < 1 else -(-blocks // most)


def plan_cuts(
    units_O: Sequence[Sequence[tuple]],
    costs_O: Sequence[Sequence[float]],
    num_ranks: int,
    rule: BandRule,
    prices: ExchangePrices | None,
    config: BalanceConfig,
    held_per_patch: int,
) -> dict[tuple[int, int], Cut]:
    """The frames to cut, by ``(owner, index)``, and how (see the module doc)."""
    mean = sum(map(sum, costs_O)) / num_ranks
    memo: dict[tuple, Cut | None] = {}
    cuts = {}
    for o, (units, costs) in enumerate(zip(units_O, costs_O, strict=True)):
        for i, (u, cost) in enumerate(zip(units, costs, strict=True)):
            if is_band(u) or u[0] != 1:
                continue
            need = bands_needed(u, held_per_patch, config, rule.align)
            if need < 2 and not cost > mean:
                continue
            key = (tuple(u), cost, need)
            if key not in memo:
                memo[key] = cut_frame(u, cost, mean, need, num_ranks, rule, prices, config)
            if memo[key] is not None:
                cuts[(o, i)] = memo[key]
    return cuts


def cut_frame(u, cost, mean, need, cap, rule, prices, config) -> Cut | None:
    """One frame's cut: the fewest bands (from ``need``) reaching the mean, else the cheapest."""

    def option(k: int) -> tuple[float, Cut] | None:
        bands = rule.bands(u, k)
        if len(bands) < k:
            return None
        nodes = prices.packed_nodes(k) if prices is not None else None
        kind, priced = price_cut(bands, rule, prices, nodes, config)
        return cost / k + max(priced), Cut(bands, kind, priced, nodes, need > 1)

    start = max(2, need)
    first = max(start, math.ceil(cost / mean)) if mean > 0 else start
    options = []
    for k in range(first, cap + 1):
        found = option(k)
        if found is None:
            break
        if found[0] <= mean:
            return found[1]
        options.append((found[0], k, found[1]))
    # Fewer bands, each above the mean: the most the rule allows first, stopping where a band's
    # share of the frame alone exceeds the best yet (fewer bands only raise it, and prices are
    # never negative): the cut trying every count finds, without pricing the 70 counts of a
    # 4032 px frame's 72 bands.
    top = min(first - 1, cap)
    most = len(rule.bands(u, top)) if top >= start else 0
    lowest = min((found[0] for found in options), default=math.inf)
    for k in range(most, start - 1, -1):
        if cost / k > lowest:
            break
        found = option(k)
        options.append((found[0], k, found[1]))
        lowest = min(lowest, found[0])
    best = min(options, key=lambda option: option[:2], default=None)
    if best is None:  # fewer bands than the budget asks fit the rule: as many as fit
        bands = rule.bands(u, min(need, cap))
        if need < 2 or len(bands) < 2:
            return None
        nodes = prices.packed_nodes(len(bands)) if prices is not None else None
        kind, priced = price_cut(bands, rule, prices, nodes, config)
        return Cut(bands, kind, priced, nodes, True)
    if need < 2 and best[0] >= cost:
        return None
    return best[2]


def nodes_of(ranks: Sequence[int], ranks_per_node: int | None) -> tuple[int, ...] | None:
    """Each rank's node, numbered in order of first appearance (prices read only which bands
    share a node); None where planning is node-blind or all are on one node."""
    if ranks_per_node is None or ranks_per_node <= 1:
        return None
    names: dict[int, int] = {}
    nodes = tuple(names.setdefault(r // ranks_per_node, len(names)) for r in ranks)
    return None if len(names) == 1 else nodes


def rebuild(
    units_O: list[list[tuple]],
    costs_O: list[list[float]],
    dest_O: list[list[int]],
    config: BalanceConfig,
    max_rows: float = math.inf,
) -> tuple[Plan, list[list[int]]]:
    """The ``Plan`` of a full assignment (``dest_O[o][i]``: the rank computing unit ``i`` of
    owner ``o``, owners being ranks), and each owner's rows; ``cap_respected`` as ``solve_plan``
    with ``max_rows`` says it."""
    tokens = [[unit_rows(u) for u in units] for units in units_O]
    units = Units(costs_O, tokens)
    cap = row_cap(units, config.max_len_ratio, max_rows)
    dest = [d for ds in dest_O for d in ds]
    candidate = candidate_from_dest(dest, units, cap)
    return make_plan(candidate, units, True, "applied", config.ranks_per_node), tokens


def spread(
    slots: list[tuple[list[int], int]],
    loads: list[float],
    costs: Sequence[float],
    ranks_per_node: int | None = None,
) -> bool:
    """Move bands of one frame off ranks computing another band of it, each to the least loaded
    rank computing none, of its node while the node has one (``ranks_per_node``; None: any
    rank; a band moved to another node makes its frame pay for crossing nodes), on ties
    (``TIE``) the next after it (nearby ranks share a node; frames crowded alike go round, not
    to one rank); ``slots``: where each band's rank is written (a list and an index), ``costs``
    each band's, ``loads`` updated. False when there are fewer ranks than bands."""
    if len(slots) > len(loads):
        return False
    taken: set[int] = set()
    for (dest, j), cost in zip(slots, costs, strict=True):
        if dest[j] in taken:
            here, n = dest[j], len(loads)
            free = []
            if ranks_per_node is not None:
                free = [r for r in node_ranks(here, ranks_per_node, n) if r not in taken]
            free = free or [r for r in range(n) if r not in taken]
            least = min(loads[r] for r in free)
            # Loads equal but for rounding (a band moved off and another on) tie.
            tied = (r for r in free if loads[r] <= least + abs(least) * TIE)
            target = min(tied, key=lambda r: (r - here) % n)
            loads[here] -= cost
            loads[target] += cost
            dest[j] = target
        taken.add(dest[j])
    return True


def spread_bands(
    dest_O, loads: list[float], placed: Placed, cuts, ranks_per_node: int | None = None
) -> bool:
    """Every split frame's bands on ranks of their own (``spread``, in their node where it has
    room: ``ranks_per_node``; ``dest_O[o][i]``: the rank computing unit ``i`` of owner ``o``,
    owners being ranks; ``loads`` kept up to date), then levelled (``_level_bands``); whether
    any moved. Two bands of a frame on one rank hold twice a band's memory and pay for an
    exchange that brings them nothing of each other."""
    moved, frames = False, []
    for key, cut in cuts.items():
        o, first = placed.names[key]
        frames.append((o, range(first, first + len(cut.bands))))
        slots = [(dest_O[o], i) for i in frames[-1][1]]
        if len({dest[j] for dest, j in slots}) < len(slots):
            costs = [placed.costs_O[o][i] for _, i in slots]
            moved |= spread(slots, loads, costs, ranks_per_node)
    if moved:
        _level_bands(frames, dest_O, loads, placed.costs_O, ranks_per_node)
    return moved


def _level_bands(frames, dest_O, loads: list[float], costs_O, ranks_per_node=None) -> None:
    """After ``spread``, which moves each frame's bands without looking back: while a band on
    the fullest rank can go to the least loaded one (of its node, by nodes), which computes no
    band of its frame, and lower the fullest's load, the dearest such band goes (four 3-band
    frames on four ranks, spread one after another, end 4, 3, 3, 2 bands a rank; levelled, 3
    each). ``frames``: each split frame's ``(owner, its bands' indexes)``; ties to the first
    band."""
    for _ in range(sum(len(bands) for _, bands in frames)):
        top = max(range(len(loads)), key=loads.__getitem__)
        group = range(len(loads))
        if ranks_per_node is not None:
            group = node_ranks(top, ranks_per_node, len(loads))
        low = min(group, key=loads.__getitem__)
        best = None  # (cost, owner, index)
        for o, bands in frames:
            ranks = [dest_O[o][i] for i in bands]
            if low in ranks:
                continue
            for i, r in zip(bands, ranks, strict=True):
                cost = costs_O[o][i]
                if r == top and loads[low] + cost < loads[top] and (best is None or cost > best[0]):
                    best = (cost, o, i)
        if best is None:
            return
        cost, o, i = best
        loads[top] -= cost
        loads[low] += cost
        dest_O[o][i] = low


def settle(cuts: dict, placed: Placed, rank_of, rule: BandRule, prices, config) -> dict:
    """``cuts`` each priced again where its bands are computed (``rank_of(o, i)``: the rank
    computing unit ``i`` of owner ``o`` among ``placed``'s), its kind chosen again there
    (``price_cut``)."""
    rpn = prices.ranks_per_node if prices is not None else None
    settled = {}
    for key, cut in cuts.items():
        o, first = placed.names[key]
        ranks = [rank_of(o, i) for i in range(first, first + len(cut.bands))]
        nodes = nodes_of(ranks, rpn)
        kind, priced = price_cut(cut.bands, rule, prices, nodes, config, ranks)
        settled[key] = cut._replace(kind=kind, prices=priced, nodes=nodes)
    return settled
