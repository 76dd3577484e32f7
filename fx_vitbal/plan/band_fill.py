"""Inside a node: its ranks' share of the node's units, frames poured to one level.

[Note: pouring frames] A node's whole units are placed first, costliest first, each on its rank
while that keeps the rank within the node's level (its mean load, the exchange of the bands it
will cut counted), else on the least loaded rank (``place_in_node``: LPT that keeps what it can
home). Its frames to cut are then poured over its ranks in order of load, costliest first, by
McNaughton's wrap-around rule for divisible work (``wrap``): each rank filled up to the level
before the next (to the nearest whole ``align`` rows: rounding down would leave every rank a
sliver short, and the node's tail spills), so a frame spans a few consecutive ranks and a rank
gets at most a couple of bands, each whole ``align`` rows of at least ``min_patches`` (a rank
with less room is passed over) and paying its exchange; what no rank takes at the level is
spread where it ends lowest (``_spill``). The level is then searched (``LEVEL_TRIES`` fills):
raised by what spilled until a fill spills nothing, then halved between the highest level that
spilled and the lowest that did not; the fill whose fullest rank ends lowest is kept (a level
too high leaves the last ranks empty, one too low spills its tail onto a few). Where
whole frames leave a rank above the step's floor (the fullest node's level), the costliest
frame of that rank is poured too (``fill_ranks``' ``bar``).

Under a row cap (``max_len_ratio``, a memory budget's rows: ``cap``) every step counts rows as
well as cost: a whole unit stays home or goes to the least loaded rank with room for its rows,
a rank takes no more blocks of a frame than its room holds, and ``_spill`` fills within the
ranks' rooms first. Cost alone filled the row-heavy ranks (many small images cost little a
row) past a tight budget, and no later move could bring them back: the documents mix on 512
ranks at 10 GiB a rank (1.2x the mean rank's) ended 2 of 3 steps above it, and now none
(``band_caps`` repairs what is left).

Plain Python over a few ranks and units: a ``solve_plan`` a node would cost ~0.5 ms each.
Deterministic: ranks and units in order, ties to the lower index.
"""

import heapq
import math

from fx_vitbal.config import BalanceConfig
from fx_vitbal.plan.band_plan import Placed
from fx_vitbal.plan.bands import Band, BandRule
from fx_vitbal.plan.solve import MAKESPAN_SLACK
from fx_vitbal.plan.units import is_band, unit_rows

# Levels a node's fill tries (``fill_ranks``), and the gap between a level that spilled and one
# that did not, over the node's mean load, below which it stops searching.
LEVEL_TRIES, LEVEL_GAP = 4, 0.01


def place_in_node(
    costs_R: list[list[float]], level: float, rows_R: list[list[int]], cap: float = math.inf
) -> tuple[list[list[int]], list, list]:
    """``(dests, loads, rows)``: where a node's units go (``dests[k][i]``: the local rank
    computing unit ``i`` of local rank ``k``), each rank's load and rows: costliest first
    (ties: the lower rank, then unit), each stays on its rank while that keeps it within
    ``level`` (or the costliest unit) plus ``MAKESPAN_SLACK`` and ``cap`` rows, else goes to
    the least loaded rank with room for its rows ``rows_R[k][i]`` (an empty rank has room for
    one unit; no rank with room: the least loaded; the lower on ties): LPT that keeps what it
    can home. A few ranks and units: plain Python, no ``solve_plan`` (whose fixed cost,
    ~0.5 ms, every node would pay)."""
    flat = [c for costs in costs_R for c in costs]
    target = max(level, max(flat, default=0.0)) * (1.0 + MAKESPAN_SLACK)
    loads, rows = [0.0] * len(costs_R), [0] * len(costs_R)
    dests = [[k] * len(costs) for k, costs in enumerate(costs_R)]
    order = sorted((-c, k, i) for k, costs in enumerate(costs_R) for i, c in enumerate(costs))
    for cost, k, i in order:
        n = rows_R[k][i]
        if loads[k] - cost <= target and (rows[k] + n <= cap or not rows[k]):
            d = k
        else:
            fits = [j for j in range(len(loads)) if rows[j] + n <= cap or not rows[j]]
            d = min(fits or range(len(loads)), key=loads.__getitem__)
        loads[d] -= cost
        rows[d] += n
        dests[k][i] = d
    return dests, loads, rows


def held_by_ranks(first: Placed, ranks: range, members, cut_at: dict) -> tuple[list, list]:
    """``(units, frames)`` of a node: by local rank, its whole units ``(owner, whole index,
    band, cost, rows)`` and the frames it cuts ``(local rank, owner, whole index, frame, cost,
    cut)``, as ``cut_at`` cuts them (by ``(owner, index)``); its own on their rank, what it
    receives on its least loaded, costliest first."""
    units: list[list[tuple]] = [[] for _ in ranks]
    frames: list[tuple] = []
    loads = [0.0] * len(ranks)
    received = [(r, j) for r, j in members if r not in ranks]
    received.sort(key=lambda rj: (-first.costs_O[rj[0]][rj[1]], rj))
    homes = [(r - ranks[0], r, j) for r, j in members if r in ranks]
    for k, r, j in [*homes, *((None, r, j) for r, j in received)]:
        if k is None:
            k = min(range(len(ranks)), key=loads.__getitem__)
        u, cost, i = first.units_O[r][j], first.costs_O[r][j], first.origin_O[r][j]
        cut = cut_at.get((r, j))
        if cut is not None:
            frames.append((k, r, i, u, cost, cut))
        else:
            units[k].append((r, i, j - first.first_O[r][i], cost, unit_rows(u)))
        loads[k] += cost
    return units, frames


def fill_ranks(units, frames, first: Placed, rule: BandRule, halve, most, bar=None, cap=math.inf):
    """``(dests, placed, makespan, level, units, frames)`` of a node (``fill_node``; ``units``
    its whole units by local rank, ``frames`` those it cuts, both as filled: copies) at the
    level searched as [Note: pouring frames] says. Each band poured pays the dearest
    band's exchange of its frame's cut (priced inside the node). With ``bar``: the costliest
    whole frame of each rank that ends above it is poured too, as cut by ``halve(frame)``."""
    units, frames = [list(unit) for unit in units], list(frames)
    for attempt in range(2):
        frames.sort(key=lambda f: (-f[4], f[:3]))
        est = [max(f[5].prices) for f in frames]
        work = sum(e[3] for unit in units for e in unit) + sum(f[4] for f in frames)
        work += sum(p * len(f[5].bands) for p, f in zip(est, frames, strict=True))
        level = start = work / len(units)
        whole = [[entry[3] for entry in unit] for unit in units]
        whole_rows = [[entry[4] for entry in unit] for unit in units]
        tops = [most(f[3]) for f in frames]
        best, low, high = None, start, None
        for _ in range(LEVEL_TRIES):
            tried = fill_node(whole, whole_rows, frames, est, tops, rule, level, cap)
            if best is None or max(tried[0]) < max(best[0]):
                best = tried
            if max(tried[0]) <= start * (1.0 + MAKESPAN_SLACK):
                break
            if tried[3]:
                low = level
            else:
                high = level
            if high is not None and high - low <= start * LEVEL_GAP:
                break
            level = (low + high) / 2 if high is not None else level + tried[3] / len(units)
        loads, dests, given, _ = best
        if attempt or bar is None or max(loads) <= bar:
            break
        costliest: dict[int, tuple[float, int, int]] = {}  # rank over -> (cost, rank, index)
        for k, unit in enumerate(units):
            for n, (entry, d) in enumerate(zip(unit, dests[k], strict=True)):
                if loads[d] <= bar or entry[3] <= costliest.get(d, (0.0,))[0]:
                    continue
                u = first.units_O[entry[0]][first.first_O[entry[0]][entry[1]] + entry[2]]
                if not is_band(u) and u[0] == 1 and len(rule.bands(u, 2)) == 2:  # it splits
                    costliest[d] = (entry[3], k, n)
        if not costliest:
            break
        for _, k, n in sorted(costliest.values(), key=lambda c: (c[1], -c[2])):
            entry = units[k].pop(n)
            u = first.units_O[entry[0]][first.first_O[entry[0]][entry[1]]]
            frames.append((k, entry[0], entry[1], u, entry[3], halve(u)))
    placed = [_as_bands(give, f[3], rule) for give, f in zip(given, frames, strict=True)]
    return dests, placed, max(loads, default=0.0), start, units, frames


def fill_node(whole_R, rows_R, frames, est, most, rule: BandRule, level: float, cap=math.inf):
    """``(loads, dests, given, spilled)``: a node's whole units placed
    (``place_in_node``), then its frames poured in, costliest first, by McNaughton's
    wrap-around rule (``wrap``) at ``level``, no rank above ``cap`` rows where it has room;
    ``given`` each frame's blocks by local rank, ``spilled`` the work that went above the
    level."""
    dests, loads, rows = place_in_node(whole_R, level, rows_R, cap)
    order = sorted(range(len(loads)), key=lambda k: (loads[k], k))
    at, given, spilled = 0, [], 0.0
    for (k, _, _, u, cost, _), price, top in zip(frames, est, most, strict=True):
        give, at, over = wrap(loads, rows, order, at, k, u, cost, rule, top, price, level, cap)
        given.append(give)
        spilled += over
    return loads, dests, given, spilled


def wrap(
    loads: list[float],
    rows: list[int],
    order: list[int],
    at: int,
    home: int,
    unit,
    cost: float,
    rule: BandRule,
    most: int,
    price: float,
    level: float,
    cap: float = math.inf,
) -> tuple[dict[int, int], int, float]:
    """``(give, at, spilled)``: frame ``unit`` (cost ``cost``) poured into a node's
    ranks in ``order`` from ``order[at]`` on, each filled up to ``level`` before the next
    (McNaughton's wrap-around rule for divisible work: a frame spans a few consecutive ranks,
    most ranks get at most two pieces), to the nearest ``align`` block, ``loads`` updated,
    ``at`` where the next frame starts. Each band pays ``price`` (its exchange) and is whole
    ``align`` rows of at least ``min_patches`` and at most ``most`` blocks (a budget;
    ``_spill`` may go over it, and ``band_nodes`` then spreads the frame's even bands); a rank
    whose room (in load, or in rows under ``cap``) is smaller than a band is passed over, and
    what the ranks cannot take at the level (``spilled``) goes where it ends lowest within the
    cap (``_spill``); ``rows`` updated too. ``give``: its ``align`` blocks
    by rank, in band order (the first band to ``home`` when it takes part; a frame that fits
    one rank stays whole)."""
    _, h, w = unit
    blocks = h // rule.align
    least = max(1, -(-rule.min_patches // (rule.align * w)))
    per = cost / blocks
    size = rule.align * w  # patches a block

    def room(r: int) -> float:
        return math.inf if cap == math.inf else (cap - rows[r]) // size

    give: dict[int, int] = {}
    left = blocks
    while left and at < len(order):
        r = order[at]
        extra = 0.0 if left == blocks and per * blocks + loads[r] <= level else price
        g = min(round((level - loads[r] - extra) / per), left, most, room(r))
        if 0 < left - g < least:  # leave the next rank a band worth cutting
            g = left - least
        if g < least and g < left:
            at += 1
            continue
        give[r] = g
        loads[r] += g * per + extra
        rows[r] += g * size
        left -= g
        if left:
            at += 1
    over = left * per
    taken = dict(give)
    if left:  # above the level: spread where it ends lowest (a new band at least whole)
        give = _spill(loads, order, give, left, per, least, price, room)
        for r, g in give.items():
            rows[r] += (g - taken.get(r, 0)) * size
    if home in give:
        give = {home: give.pop(home), **give}
    return give, at, over


def _as_bands(give: dict[int, int], unit, rule: BandRule) -> tuple[list[Band], list[int]]:
    """``(bands, ranks)``: a frame's ``align`` blocks by rank (``wrap``) as its bands, in order."""
    _, h, w = unit
    bands, first = [], 0
    for g in give.values():
        bands.append(Band(1, g * rule.align, w, h, first))
        first += g * rule.align
    return bands, list(give)


def _spill(loads, order, give: dict, left: int, per: float, least: int, price: float, room) -> dict:
    """``give`` with ``left`` more blocks over the frame's ranks and the ``j`` least loaded
    others with room for a band (each a new band of at least ``least`` blocks, paying
    ``price``), block by block to the rank that ends lowest among those with room
    (``room(r)``: blocks rank ``r`` may still take; where none has, to the lowest), for the
    ``j`` whose fullest rank ends lowest, a fill within the rooms first (``loads`` updated)."""
    others = sorted((r for r in order if r not in give), key=lambda r: (loads[r], r))
    others = [r for r in others if room(r) >= least] or others
    best = None
    for j in range(min(len(others), left // least) + 1):
        trial, ends = dict(give), {r: loads[r] for r in give}
        spare = {r: room(r) for r in give}
        spent = 0
        for r in others[:j]:
            trial[r], ends[r], spare[r] = least, loads[r] + least * per + price, room(r) - least
            spent += least
        if spent > left or not trial:
            continue
        lowest = [(end + per, r) for r, end in ends.items() if spare[r] >= 1]
        heapq.heapify(lowest)
        for _ in range(left - spent):
            # Where a block ends lowest, within its rank's room (none left: lowest of all).
            r = lowest[0][1] if lowest else min(ends, key=lambda r: (ends[r], r))
            ends[r] += per
            trial[r] += 1
            spare[r] -= 1
            if lowest and spare[r] >= 1:
                heapq.heapreplace(lowest, (ends[r] + per, r))
            elif lowest:
                heapq.heappop(lowest)
        key = (min(spare.values()) < 0, max(ends.values()))
        if best is None or key < best[0]:
            best = (key, trial, ends)
    if best is None:  # no band of the frame yet and too little for one: whole, where lowest
        r = min(order, key=lambda r: (loads[r], r))
        best = (None, {r: left}, {r: loads[r] + left * per})
    _, trial, ends = best
    for r, end in ends.items():
        loads[r] = end
    return trial


def most_blocks(unit, *, rule: BandRule, held: int, config: BalanceConfig) -> int:
    """The most ``align`` blocks of ``unit`` one band may hold within ``memory_budget``."""
    if config.memory_budget is None or not held:
        return unit[1]
    return max(1, config.memory_budget // (held * rule.align * unit[2]))
