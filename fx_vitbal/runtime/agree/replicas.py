"""Replica sets at run time: what each rank declares in the gathered header, the checks every
rank makes of every rank's declaration (the same verdict everywhere, so all raise or none), and
this rank's routing under one plan over the sets (``fx_vitbal.plan.replicas``).

A rank's ``replicas`` are the ranks of the call's group (group ranks, ascending) that hold the
same batch as it, itself included: its context-, sequence- or tensor-parallel peers. Each rank
declares its set (lowest rank, size, a digest of the members) and a checksum of its pixels in the
header it gathers anyway (``metadata.gather_grids``): no collective is added, and the checksum
is computed where the pixels live, so on an accelerator it joins the header without a host read
when the header is gathered there too.
"""

import hashlib
from collections.abc import Callable, Sequence

import torch

from fx_vitbal.plan.replicas import set_of_ranks
from fx_vitbal.plan.units import Plan
from fx_vitbal.plan.units import unit_rows as rows_of
from fx_vitbal.runtime.transport.routing import Routing

# Header fields of a rank's declaration (``declare``) and of its pixels' checksum.
DECLARED_FIELDS = 3
CHECKSUM_FIELDS = 3


def declare(replicas: Sequence[int], rank: int) -> list[int]:
    """This rank's declaration: ``[lowest rank, size, digest]`` of its set; the lowest rank is
    -1 when the set does not hold this rank or names a rank outside the group (-1 here), and
    the size 0 without a set."""
    if not replicas:
        return [rank, 0, 0]
    members = sorted(replicas)
    first = members[0] if rank in members and members[0] >= 0 else -1
    digest = hashlib.blake2b(",".join(map(str, members)).encode(), digest_size=7).digest()
    return [first, len(members), int.from_bytes(digest, "big")]


def pixel_checksum(pixel_values: torch.Tensor) -> torch.Tensor:
    """Three int64 that pixels equal in value give alike on every rank, computed where the
    pixels live: 1 (a checksum is present), the sum of their bits as integers, and that sum row
    by row weighted by the row's position (so rows swapped between images differ). Integer
    sums are exact in any order. Values, not bits: ``-0.0`` counts as ``0.0`` (adding ``0.0``
    turns it into ``+0.0``); a NaN still compares by its bits."""
    x = pixel_values.detach()
    if x.dim() < 2 or not x.numel():  # made where the pixels are: no copy, no wait
        return (torch.arange(CHECKSUM_FIELDS, device=x.device) == 0).to(torch.int64)
    bits = torch.int16 if x.element_size() == 2 else torch.int32  # float64: two words a value
    per_row = (x.reshape(x.shape[0], -1) + 0.0).view(bits).sum(1, dtype=torch.int64)
    weights = torch.arange(1, x.shape[0] + 1, dtype=torch.int64, device=x.device)
    return torch.stack([per_row.new_ones(()), per_row.sum(), (per_row * weights).sum()])


def check_declarations(declared_R: list[list[int]]) -> tuple[list[tuple[int, ...]] | None, list]:
    """The replica sets every rank's declaration (``declare``) makes, ordered by lowest rank,
    or None when every set is one rank (today's plan); and the problems found, the same on
    every rank: a rank its set does not hold, sets of different sizes, or sets that do not
    partition the group (overlapping, or a rank in none)."""
    problems = [
        f"rank {r}: its replica_group does not hold it, or names a rank outside the group"
        for r, (first, _, _) in enumerate(declared_R)
        if first < 0
    ]
    if problems:
        return None, problems
    sizes = {max(size, 1) for _, size, _ in declared_R}
    if len(sizes) > 1:
        listed = [f"rank {r}: {max(size, 1)}" for r, (_, size, _) in enumerate(declared_R)]
        return None, ["replica groups must all have the same size; sizes " + ", ".join(listed)]
    size = sizes.pop()
    sets: dict[tuple[int, int], list[int]] = {}
    for r, (first, _, digest) in enumerate(declared_R):
        sets.setdefault((first, digest), []).append(r)
    bad = [(key, ranks) for key, ranks in sets.items() if len(ranks) != size or key[0] != ranks[0]]
    if bad:
        claims = "; ".join(
            f"ranks {ranks} declare a set of {size} ranks from rank {first}"
            for (first, _), ranks in bad
        )
        return None, [f"replica groups do not partition the group: {claims}"]
    return (None if size == 1 else [tuple(ranks) for ranks in sets.values()]), []


def check_agreement(sets, grids_R, checksums_R) -> list[str]:
    """The problems of sets whose ranks hold different batches: grids, or pixels by checksum
    (a data loader that gave replicas different samples would otherwise train silently wrong)."""
    problems = []
    for ranks in sets:
        first = ranks[0]
        grids = [r for r in ranks if grids_R[r] != grids_R[first]]
        # Ranks whose pixels were not checked (``pixel_checksum``'s first field 0: pixels of
        # a plan made ahead on a device or as ``meta``) agree with any.
        checked = [r for r in ranks if checksums_R[r][0]]
        pixels = [r for r in checked if checksums_R[r] != checksums_R[checked[0]]]
        if grids:
            problems.append(
                f"replica set {list(ranks)}: image_grid_thw of rank(s) {grids} differs from "
                f"rank {first}'s"
            )
        elif pixels:
            problems.append(
                f"replica set {list(ranks)}: pixel_values of rank(s) {pixels} differ from rank "
                f"{checked[0]}'s (checksum); every rank of a set must hold the same batch"
            )
    return problems


def routing_for_sets(
    plan: Plan,
    held: list[list[int]],
    sets: Sequence[Sequence[int]],
    units_S: list[list[tuple]],
    rank: int,
    merge_size: int,
    rows_of: Callable[[Sequence[int]], int] = rows_of,
) -> tuple[Routing, list[tuple[int, int]]]:
    """This rank's ``Routing`` under ``plan`` (``plan.replicas``'s, with the holdings ``held``),
    where the local units are the set's, ``units_S[s]`` for set ``s``, and the ``(set, index)``
    of the units it computes, in the order they arrive (its balanced batch).

    A unit computed inside its set takes its pixels from the computing rank's own copy; one
    computed outside is sent by its holder. Units arrive grouped by sender, in the set's order:
    the ``(sender, index)`` order every move of ``moves`` keeps.
    ``rows_of`` as ``routing.local_routing`` takes it.
    """
    set_of = set_of_ranks(sets)
    world = len(set_of)
    mine = set_of[rank]
    units = units_S[mine]
    dest, sender = [0] * len(units), [0] * len(units)
    for h in sets[mine]:
        for j, d in enumerate(plan.destinations(h)):
            i = held[h][j]
            dest[i], sender[i] = d, d if set_of[d] == mine else h
    unit_rows = [rows_of(u) for u in units]
    send_rows = [0] * world
    for i, rows in enumerate(unit_rows):
        if sender[i] == rank:
            send_rows[dest[i]] += rows
    arrivals = sorted(
        (rank if set_of[h] == mine else h, held[h][j], set_of[h]) for h, j in plan.assignment[rank]
    )
    recv_rows = [0] * world
    for source, i, s in arrivals:
        recv_rows[source] += rows_of(units_S[s][i])
    route = Routing(
        applied=True,  # each unit once: the sets' work is shared even when the plan moves nothing
        unit_rows=unit_rows,
        dest=dest,
        send_rows=send_rows,
        recv_rows=recv_rows,
        dummy_rows=0 if arrivals else rows_of((1, merge_size, merge_size)),
        set_of=set_of,
        sender=sender,
        rank=rank,
    )
    return route, [(s, i) for _, i, s in arrivals]
