"""The row cap kept by a plan with bands: ``max_len_ratio``'s, and a memory budget's rows.

Bands are placed by cost (the node level, ``band_plan.spread_bands``; the pour counts rows
only where a rank has room, ``band_fill``), so a rank can end above the cap where whole units
would not: the documents mix on 512 ranks of 8 a node at ``max_len_ratio=1.3``, one image a
rank, ended with a rank at 1.07x the cap. ``keep_row_cap`` then moves units off each rank
above it, fullest first: the cheapest unit whose rows bring the rank within the cap (else the
one with the most rows, and again), each to the least loaded rank of its node it fits on (a
band never to a rank computing another band of its frame). Where no unit fits in the node,
whole ``align`` rows of one of the rank's bands go to another band of its frame, the nearest
first, whose rank has room (bands cut evenly for cost can leave two bands of 2,400 and 2,448
rows on a rank capped at 4,818 while their frames' other bands sit on ranks with room: no
whole band fits there, 160 rows do; the bands between keep their sizes, shifted along the
frame); else a unit goes to another node, whole units first (a band there makes its frame pay
for crossing nodes: what a tight budget costs, ``docs/benchmarks.md``). A rank holding one
unit keeps it (the cap's exception: a unit alone; a memory budget cuts frames above it into
bands first). Where nothing fits, the cap stays broken, and the plan says so
(``Plan.cap_respected``). Deterministic: ranks and units in order, ties to the lower index.
"""

import math
from collections import Counter
from collections.abc import Sequence

from fx_vitbal.plan.band_plan import Placed
from fx_vitbal.plan.bands import BandRule
from fx_vitbal.plan.nodes import node_ranks
from fx_vitbal.plan.units import unit_rows


def owners_row_cap(rows_O: Sequence[Sequence[int]], ratio: float | None, max_rows: float) -> float:
    """``candidates.row_cap`` of owners' rows (owners being ranks), without a ``Units``."""
    if ratio is None:
        cap = max(map(sum, rows_O))
    elif ratio == math.inf:
        cap = math.inf
    else:
        cap = math.floor(sum(map(sum, rows_O)) / len(rows_O) * ratio)
    return min(cap, max_rows)


def keep_row_cap(
    dest_O: list[list[int]],
    loads: list[float],
    placed: Placed,
    cuts: dict,
    cap: float,
    rule: BandRule,
    ranks_per_node: int | None = None,
) -> bool:
    """Move units off ranks above ``cap`` rows as the module doc says (``dest_O[o][i]``: the
    rank computing unit ``i`` of owner ``o`` among ``placed``'s, owners being ranks; ``loads``
    kept up to date; ``cuts`` the split frames, by ``placed.names``, their bands and
    ``placed``'s updated where rows move between them); whether any moved."""
    if cap == math.inf:
        return False
    num_ranks = len(loads)
    rows = [0] * num_ranks
    held: list[list[tuple[int, int]]] = [[] for _ in range(num_ranks)]
    for o, (units, dests) in enumerate(zip(placed.units_O, dest_O, strict=True)):
        for i, (u, d) in enumerate(zip(units, dests, strict=True)):
            rows[d] += unit_rows(u)
            held[d].append((o, i))
    over = [r for r in range(num_ranks) if rows[r] > cap and len(held[r]) > 1]
    if not over:
        return False
    frame_of, bands_on = {}, {}
    for key, cut in cuts.items():
        o, first = placed.names[key]
        frame_of.update(((o, i), key) for i in range(first, first + len(cut.bands)))
        bands_on[key] = Counter(dest_O[o][i] for i in range(first, first + len(cut.bands)))
    open_ranks = [r for r in range(num_ranks) if rows[r] < cap or not held[r]]
    moved = False
    for r in sorted(over, key=lambda r: (-rows[r], r)):
        node = node_ranks(r, ranks_per_node, num_ranks) if ranks_per_node else None
        args = (r, rows, held, loads, placed, frame_of, bands_on, open_ranks, cap)
        while rows[r] > cap and len(held[r]) > 1:
            move = _move_off(*args, node)
            if move is None:
                shifted = _shift_rows(
                    r, rows, held, loads, dest_O, placed, cuts, frame_of, cap, rule
                )
                if shifted is not None:
                    if rows[shifted] >= cap and shifted in open_ranks:
                        open_ranks.remove(shifted)
                    moved = True
                    continue
                if node is not None:  # across nodes a band makes its frame pay for crossing
                    move = _move_off(*args, None, whole=True) or _move_off(*args, None)
            if move is None:
                break
            (o, i), target = move
            n, cost = unit_rows(placed.units_O[o][i]), placed.costs_O[o][i]
            held[r].remove((o, i))
            held[target].append((o, i))
            rows[r] -= n
            rows[target] += n
            loads[r] -= cost
            loads[target] += cost
            dest_O[o][i] = target
            if (o, i) in frame_of:
                counts = bands_on[frame_of[(o, i)]]
                counts[r] -= 1
                counts[target] += 1
            if rows[target] >= cap:
                open_ranks.remove(target)
            moved = True
        if rows[r] < cap:
            open_ranks.append(r)
            open_ranks.sort()
    return moved


def _move_off(r, rows, held, loads, placed, frame_of, bands_on, open_ranks, cap, node, whole=False):
    """``((owner, index), rank)``: the unit rank ``r`` sheds and where it goes, as the module
    doc says, among the ranks of ``node`` (None: any; ``whole``: no band); None where no unit
    of ``r`` fits."""
    excess = rows[r] - cap
    units = [(placed.costs_O[o][i], unit_rows(placed.units_O[o][i]), (o, i)) for o, i in held[r]]
    enough = sorted(unit for unit in units if unit[1] >= excess)
    short = sorted((unit for unit in units if unit[1] < excess), key=lambda u: (-u[1], u[0], u[2]))
    targets = open_ranks if node is None else sorted(set(node) & set(open_ranks))
    for _, n, key in [*enough, *short]:
        frame = frame_of.get(key)
        if whole and frame is not None:
            continue
        fits = [
            t
            for t in targets
            if t != r
            and (rows[t] + n <= cap or not held[t])
            and (frame is None or not bands_on[frame][t])
        ]
        if fits:
            return key, min(fits, key=lambda t: (loads[t], t))
    return None


def _shift_rows(r, rows, held, loads, dest_O, placed, cuts, frame_of, cap, rule: BandRule):
    """Whole ``align`` rows of a band of rank ``r`` moved to another band of its frame (the
    nearest first, the one before on ties) on a rank with room for them, at most what brings
    ``r`` within ``cap`` and leaving the band ``min_patches``; the rank that took them, or None.
    The bands between keep their rows, each starting ``moved`` rows later (or earlier), so every
    band stays a run of the frame's rows and only the two ends change size. The bands' units
    (in ``placed`` and the frame's cut), ``rows`` and ``loads`` updated (the cost moved as the
    rows' share of the band's; ``band_plan.reprice`` prices them again)."""
    excess = rows[r] - cap
    for o, i in sorted(held[r]):
        key = frame_of.get((o, i))
        if key is None:
            continue
        band = placed.units_O[o][i]
        block = rule.align * band.w
        least = max(1, -(-rule.min_patches // block))
        first = placed.names[key][1]
        others = sorted(range(first, first + len(cuts[key].bands)), key=lambda j: (abs(j - i), j))
        for j in others:
            t = dest_O[o][j]
            if t == r:
                continue
            blocks = min(
                -(-excess // block), (cap - rows[t]) // block, band.h // rule.align - least
            )
            if blocks < 1:
                continue
            moved = blocks * rule.align
            step = moved if j < i else -moved  # where the bands from j to i start, shifted
            bands = list(cuts[key].bands)
            for b in range(min(i, j), max(i, j) + 1):
                u = placed.units_O[o][b]
                if b == j:
                    u = u._replace(h=u.h + moved, first_row=u.first_row + min(step, 0))
                elif b == i:
                    u = u._replace(h=u.h - moved, first_row=u.first_row + max(step, 0))
                else:
                    u = u._replace(first_row=u.first_row + step)
                placed.units_O[o][b] = bands[b - first] = u
            cuts[key] = cuts[key]._replace(bands=bands)
            cost = placed.costs_O[o][i] * moved / band.h
            rows[r] -= blocks * block
            rows[t] += blocks * block
            loads[r] -= cost
            loads[t] += cost
            return t
    return None
