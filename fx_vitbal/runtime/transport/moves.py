"""Which rows one exchange sends to each rank, and how what arrives is put in order (``Move``),
worked out from a rank's ``Routing`` once per step and direction.

Four moves make a step: the pixels to the computing ranks and the outputs home (forward), the
output gradients to the computing ranks and the pixel gradients home (backward). Without replica
sets each rank's units are its own and the moves pair up as exact inverses: units go out in
destination order and come home grouped by computing rank, in local order.

With replica sets (``Routing.replicated``) every rank of a set holds the set's units:
- pixels go out only from each unit's sender (``Routing.sender``: the computing rank itself when
  it is in the set, so a unit computed in its set moves no pixel);
- outputs go home to *every* rank of the unit's set, one copy per rank in the same
  ``all_to_all`` (a computing rank sends each set the rows it received from that set's ranks);
- output gradients come from every rank of the set and are summed on the computing rank (the
  transpose of sending one row to many), in a fixed order: the same sum on every run;
- pixel gradients go to the sender only; the set's other ranks get zeros for that unit, so the
  pixels' gradient summed over a set is the replicated run's.
Rows from one source arrive in the order ``(sender, local index)`` of the set's units: the order
both sides of every move agree on.
"""

import dataclasses
import itertools

from fx_vitbal.runtime.transport.routing import Routing


@dataclasses.dataclass(frozen=True)
class Move:
    """One exchange as this rank sees it, in rows of ``shrink`` pixel rows each."""

    send: list[tuple[int, int]] | None
    """Row ranges of the local tensor, concatenated in this order to make the buffer sent (a
    range may repeat: one copy per destination); None: the local tensor as it is."""
    in_splits: list[int]
    """Rows of the buffer sent to each rank."""
    out_splits: list[int]
    """Rows arriving from each rank."""
    home: list[tuple[int, int, int]] | None
    """``(source rank, first, end)`` ranges of the arrived chunks that make the result, in
    order (source -1: that many rows of zeros); None: the rows as they arrived."""
    sums: list[list[int]] = dataclasses.field(default_factory=list)
    """Ranks whose arrived chunks are summed, onto the first one's chunk, before ``home``."""


def move_of(routing: Routing, shrink: int, outputs: bool, reverse: bool) -> Move:
    """The move of ``routing``'s rows: to the computing ranks (``reverse=False``) or back
    (``True``), of pixels (``outputs=False``) or of outputs (``True``: with replica sets they
    go to every rank of a set, and their gradients come from every one)."""
    key = (shrink, outputs and routing.replicated, reverse)
    if key not in routing.runs:
        if outputs and routing.replicated:
            make = _to_every_replica if reverse else _from_every_replica
        else:
            make = _home_back if reverse else _out
        routing.runs[key] = make(routing, shrink)
    return routing.runs[key]


def _sends(route: Routing, i: int) -> bool:
    """Whether this rank sends local unit ``i``'s pixels: every unit of its own, or with replica
    sets the units it is the sender of."""
    return not route.replicated or route.sender[i] == route.rank


def _out(route: Routing, shrink: int) -> Move:
    """Each unit this rank sends to the rank computing it, in destination order."""
    mine = [i for i in range(len(route.dest)) if _sends(route, i)]
    order = sorted(mine, key=lambda i: (route.dest[i], i))
    send_R = [n // shrink for n in route.send_rows]
    recv_R = [n // shrink for n in route.recv_rows]
    return Move(_ranges(route, shrink, order), send_R, recv_R, None)


def _home_back(route: Routing, shrink: int) -> Move:
    """Each computed unit back to the rank that sent it, where it takes its place in local
    order (a source returns the units it computed for this rank in local order); with replica
    sets, zeros for the units another rank of the set sent."""
    filled = [0] * len(route.send_rows)
    pieces = []
    for i, (d, n) in enumerate(zip(route.dest, route.unit_rows, strict=True)):
        rows = n // shrink
        if _sends(route, i):
            pieces.append((d, filled[d], filled[d] + rows))
            filled[d] += rows
        else:
            pieces.append((-1, 0, rows))
    send_R = [n // shrink for n in route.send_rows]
    recv_R = [n // shrink for n in route.recv_rows]
    return Move(None, recv_R, send_R, _merged_pieces(pieces))


def _to_every_replica(route: Routing, shrink: int) -> Move:
    """Replica sets: each computed unit to every rank of its set. What arrived from a source
    belongs to that source's set, so a set's ranks get the rows that arrived from its ranks."""
    world = len(route.send_rows)
    recv_R = [n // shrink for n in route.recv_rows]
    starts = [0, *itertools.accumulate(recv_R)]
    ranges, in_R = [], []
    for d in range(world):
        sources = [s for s in range(world) if route.set_of[s] == route.set_of[d]]
        ranges += [(starts[s], starts[s + 1]) for s in sources]
        in_R.append(sum(recv_R[s] for s in sources))
    out_R, pieces = _by_computing_rank(route, shrink)
    home = [None] * len(route.unit_rows)
    for d, units in pieces.items():
        first = 0
        for i in units:
            rows = route.unit_rows[i] // shrink
            home[i] = (d, first, first + rows)
            first += rows
    return Move(merged_ranges(ranges), in_R, out_R, _merged_pieces(home))


def _from_every_replica(route: Routing, shrink: int) -> Move:
    """Replica sets: output gradients from every rank of each set to the computing rank, summed
    there per set (rank by rank, ascending), then put in the order the units arrived in."""
    back = move_of(route, shrink, True, True)  # its reverse: what each rank sends back
    in_R, pieces = _by_computing_rank(route, shrink)
    order = [i for d in sorted(pieces) for i in pieces[d]]
    world = len(route.send_rows)
    members: dict[int, list[int]] = {}
    for r in range(world):
        members.setdefault(route.set_of[r], []).append(r)
    filled = dict.fromkeys(members, 0)
    home = []
    for s in range(world):  # arrival order: by source rank
        rows = route.recv_rows[s] // shrink
        first = members[route.set_of[s]][0]
        home.append((first, filled[route.set_of[s]], filled[route.set_of[s]] + rows))
        filled[route.set_of[s]] += rows
    sums = [ranks for ranks in members.values() if len(ranks) > 1]
    return Move(_ranges(route, shrink, order), in_R, back.in_splits, _merged_pieces(home), sums)


def _by_computing_rank(route: Routing, shrink: int) -> tuple[list[int], dict[int, list[int]]]:
    """Rows of the local units each rank computes, and those units by computing rank, each in
    the order it sends them home: ``(sender, local index)``."""
    rows_R = [0] * len(route.send_rows)
    pieces: dict[int, list[int]] = {}
    for i in sorted(range(len(route.dest)), key=lambda i: (route.sender[i], i)):
        rows_R[route.dest[i]] += route.unit_rows[i] // shrink
        pieces.setdefault(route.dest[i], []).append(i)
    return rows_R, pieces


def _ranges(route: Routing, shrink: int, order: list[int]) -> list[tuple[int, int]]:
    """The rows of the local units ``order`` lists, in that order."""
    starts = [0, *itertools.accumulate(n // shrink for n in route.unit_rows)]
    return merged_ranges((starts[i], starts[i + 1]) for i in order)


def merged_ranges(ranges) -> list[tuple[int, int]]:
    """Non-empty ``(first, end)`` ranges, each merged into the previous one it continues."""
    merged: list[tuple[int, int]] = []
    for a, b in ranges:
        if merged and merged[-1][1] == a:
            merged[-1] = (merged[-1][0], b)
        elif b > a:
            merged.append((a, b))
    return merged


def _merged_pieces(pieces) -> list[tuple[int, int, int]]:
    """Non-empty ``(source, first, end)`` pieces, each merged into the previous one it
    continues (zero pieces, source -1, into the previous zero piece)."""
    merged: list[tuple[int, int, int]] = []
    for d, a, b in pieces:
        if merged and merged[-1][0] == d and (d < 0 or merged[-1][2] == a):
            last = merged[-1]
            merged[-1] = (d, last[1], last[2] + b - a)
        elif b > a:
            merged.append((d, a, b))
    return merged
