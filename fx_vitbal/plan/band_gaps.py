"""Uneven cuts where a plan still ends above the mean (step 4 of [Note: how bands are
planned] in ``plan.bands``): one whole frame of the fullest rank cut in two bands of whole
``align`` rows, the second computed on the least loaded rank (or the least loaded of the fullest
rank's node), sized so both ranks end level, when that lowers the makespan by ``min_gain``, the
exchange priced where the two ranks sit. Owners being ranks; deterministic (frames in owner and
unit order, ties to the lower rank).
"""

import math
from collections.abc import Sequence
from typing import NamedTuple

from fx_vitbal.config import BalanceConfig
from fx_vitbal.plan.band_caps import owners_row_cap
from fx_vitbal.plan.band_plan import Cut, nodes_of, price_cut, rebuild
from fx_vitbal.plan.band_prices import ExchangePrices
from fx_vitbal.plan.bands import Band
from fx_vitbal.plan.nodes import node_ranks
from fx_vitbal.plan.units import Plan, is_band

# Uneven cuts one plan may get (each cuts one frame of the fullest rank, then looks again).
MAX_GAP_CUTS = 4


class GapCut(NamedTuple):
    """An uneven cut ``close_gap`` found: frame ``index`` of ``owner`` as ``bands``, the first
    staying on ``ranks[0]``, the second going to ``ranks[1]``."""

    owner: int
    index: int
    cut: Cut
    ranks: tuple[int, int]
    makespan: float


def find_gap_cut(
    plan: Plan,
    units_O: Sequence[Sequence[tuple]],
    costs_O: Sequence[Sequence[float]],
    rows_O: Sequence[Sequence[int]],
    cap: float,
    prices: ExchangePrices,
    config: BalanceConfig,
) -> GapCut | None:
    """The uneven cut of ``plan`` (owners being ranks) that lowers the makespan most, if by the
    minimum gain (module doc). Reads only the fullest rank's units and its receivers'."""
    loads = plan.loads_after if plan.applied else plan.loads_before
    num_ranks = len(loads)
    top = max(loads)
    fullest = loads.index(top)
    if top <= sum(loads) / num_ranks:
        return None
    receivers = [min(range(num_ranks), key=loads.__getitem__)]
    rpn = prices.ranks_per_node
    if rpn is not None:  # the least loaded rank of the fullest's node too (NVLink prices)
        receivers.append(min(node_ranks(fullest, rpn, num_ranks), key=loads.__getitem__))
    frames = [
        (o, i, units_O[o][i])
        for o, i in plan.assignment[fullest]
        if not is_band(units_O[o][i]) and units_O[o][i][0] == 1
    ]
    best = None
    for r in dict.fromkeys(receivers):
        if r == fullest or not frames:
            continue
        rest = max((x for j, x in enumerate(loads) if j not in (fullest, r)), default=0.0)
        room = cap - sum(rows_O[o][i] for o, i in plan.assignment[r])
        nodes = nodes_of((fullest, r), rpn)
        for o, i, u in frames:
            found = _gap_cut(u, costs_O[o][i], top, loads[r], rest, nodes, prices, config)
            if found is None or found[1].bands[1].h * u[2] > room:
                continue
            if best is None or found[0] < best.makespan:
                best = GapCut(o, i, found[1], (fullest, r), found[0])
    if best is None or best.makespan >= top * (1.0 - config.min_gain) or best.makespan >= top:
        return None
    return best


def _gap_cut(u, cost, top, low, rest, nodes, prices: ExchangePrices, config):
    """``(makespan, Cut)`` of the best two-band cut of ``u`` between loads ``top`` and ``low``."""
    rule = prices.rule
    _, h, w = u
    align = rule.align
    if h % align:
        return None
    blocks = h // align
    least = max(1, -(-rule.min_patches // (align * w)))  # blocks a band needs
    if blocks < 2 * least:
        return None
    moved = blocks * (top - low) / (2 * cost)  # blocks to move for level loads (bytes aside)
    best = None
    for go in sorted({math.floor(moved), math.ceil(moved)}):
        go = min(max(go, least), blocks - least)
        stay = (blocks - go) * align
        bands = [Band(1, stay, w, h, 0), Band(1, h - stay, w, h, stay)]
        kind, priced = price_cut(bands, rule, prices, nodes, config)
        cut = Cut(bands, kind, priced, nodes)
        here, there = cut.costs(cost)
        span = max(top - cost + here, low + there, rest)
        if best is None or span < best[0]:
            best = (span, cut)
    return best


def close_gaps(
    plan: Plan,
    units_O: Sequence[Sequence[tuple]],
    costs_O: Sequence[Sequence[float]],
    rows_O: Sequence[Sequence[int]],
    exchanges: dict[tuple[int, int], str],
    prices: ExchangePrices,
    config: BalanceConfig,
    max_rows: float = math.inf,
) -> tuple[Plan, list[list[tuple]], list[list[int]]] | None:
    """``(plan, units, rows)`` after up to ``MAX_GAP_CUTS`` uneven cuts (``find_gap_cut``;
    owners being ranks), or None when none pays; ``exchanges`` (by frame name) takes their
    kinds, the names after a cut moved along. ``max_rows``: a memory budget's rows
    (``solve_plan``'s), a cap beside ``max_len_ratio``'s that a cut keeps."""
    units_O, costs_O = [list(u) for u in units_O], [list(c) for c in costs_O]
    tokens = [list(rows) for rows in rows_O]
    cap = owners_row_cap(tokens, config.max_len_ratio, max_rows)
    changed, dest_O = False, None
    for _ in range(MAX_GAP_CUTS):
        found = find_gap_cut(plan, units_O, costs_O, tokens, cap, prices, config)
        if found is None:
            break
        if dest_O is None:  # every unit's rank: only once a cut is made
            dest_O = [plan.destinations(o) for o in range(len(units_O))]
        o, i, cut = found.owner, found.index, found.cut
        units_O[o][i : i + 1] = cut.bands
        costs_O[o][i : i + 1] = cut.costs(costs_O[o][i])
        dest_O[o][i : i + 1] = found.ranks
        for name in sorted((n for n in exchanges if n[0] == o and n[1] > i), reverse=True):
            exchanges[(o, name[1] + 1)] = exchanges.pop(name)
        exchanges[(o, i)] = cut.kind
        plan, tokens = rebuild(units_O, costs_O, dest_O, config, max_rows)
        changed = True
    return (plan, units_O, tokens) if changed else None
