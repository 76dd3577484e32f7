"""Bands at run time: what a tower computing row bands of a frame is told (``Bands``, eagerly
or in its tensor form when compiled), and each rank's part of the exchange of their keys and
values (``band_layout``; the exchange itself: ``fx_vitbal.runtime.bands.exchange``).

A band (``fx_vitbal.plan.bands``) is one more unit to routing, moves and restore: its pixel rows
are a contiguous run of its frame's, so they move like any unit's and its outputs go home in
order. Only inside the tower does it differ: its positions are the frame's (it starts at
``first_row``), and in every layer that attends over whole frames its queries need the whole
frame's keys and values, which lie on the ranks computing the other bands. ``Bands.gather``
moves them: one ``all_to_all`` over the balancing group per call, issued by every rank (a rank
with no band sends and receives nothing, but takes part), in the same layers in the same order
(every rank runs the same tower, the dummy unit if it has nothing else). It returns, for each
local unit in order, the rows its queries attend over: its own for a whole unit, the whole
frame's for a band. Its backward sends each gradient back to the rank whose rows it belongs to
and sums it there (``vitbal::band_scatter``, the adjoint).

Shape suffixes: ``_U`` per local unit, ``_R`` per rank.
"""

import dataclasses
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from fx_vitbal._compat import CUDAGRAPH_UNSAFE
from fx_vitbal.plan.step import StepPlan
from fx_vitbal.runtime.bands.blocks import AttentionLayout, AttentionUnit, FrameBand
from fx_vitbal.runtime.bands.compiled import band_attention as compiled_attention
from fx_vitbal.runtime.bands.exchange import LOCAL, BandLayout
from fx_vitbal.runtime.bands.kinds import band_attention
from fx_vitbal.runtime.transport import transfer
from fx_vitbal.runtime.transport.collectives import resolve_group
from fx_vitbal.runtime.transport.moves import merged_ranges
from fx_vitbal.runtime.transport.state import route_of, state_of_routing


@dataclasses.dataclass(frozen=True)
class BandUnit:
    """A local unit as a tower running bands sees it (in patches)."""

    frames: int
    """Its frames (1 for a band)."""
    rows: int
    """Its patch rows per frame (a band's own)."""
    first_row: int
    """Its first patch row in its frame (0 for a whole unit)."""
    full_rows: int
    """Its frame's patch rows (``rows`` for a whole unit)."""
    width: int
    """Its patch columns (the grid row's ``w``; a band has its frame's). Not a feature width:
    ``BandSupport.width`` is the tower's key/value width (heads x head size)."""


class Bands:
    """What a tower running bands is told, as its ``vitbal_bands`` keyword (``fx_vitbal.Bands``),
    on a step whose plan splits a frame (``split``); on other steps it gets none. (A runner that
    precomputes a tower's grid-derived inputs reads ``units`` on every step.)

    ``units[i]`` describes the ``i``-th unit (grid row) of the balanced batch it is given: a
    whole unit, or a band of a frame (``first_row``, ``full_rows``): its positions are the
    frame's rows ``first_row`` to ``first_row + rows``. In every layer that attends over whole
    frames, ``gather(keys)`` and ``gather(values)`` (or both at once, concatenated along a
    trailing dimension) return, unit by unit, the rows its queries attend over: its own for a
    whole unit, the whole frame's for a band (``key_rows``). Every rank of the group must call
    ``gather`` in the same layers, in the same order: a rank without bands too (its tower runs
    anyway), and never in a window layer (windows stay inside a band).

    Under ``torch.compile`` (a tower declared ``BandSupport(compiled=True)``) the graph cannot
    branch on the plan, so the tower gets ``vitbal_bands`` on every step, in its tensor form:
    ``units`` is None and ``unit_table`` holds the same numbers; ``attention`` runs the plan's
    exchange inside ``vitbal::band_attention`` (``bands.compiled``); on a step that splits
    nothing, ``gather`` returns a copy of its input and no collective runs.
    """

    def __init__(
        self,
        units: list[BandUnit] | None,
        layout: torch.Tensor | None,
        group_name: str,
        table: torch.Tensor | None = None,
        attending: AttentionLayout | None = None,
        attending_packed: torch.Tensor | None = None,
    ) -> None:
        self.units = units
        self.layout = layout
        self.group_name = group_name
        self.table = table
        self.attending = attending
        """For ``attention``: each local frame's rows, a band's place among its frame's ranks
        and the frame's exchange kind; None where a rank computes two bands of one frame."""
        self.attending_packed = attending_packed
        """The tensor form's ``attending``, packed (``AttentionLayout.to_tensor``), for
        ``vitbal::band_attention`` (``bands.compiled``)."""

    @property
    def split(self) -> bool:
        """Whether this step's plan splits a frame (``gather`` may only be called then); always
        True in the tensor form (the graph serves every step)."""
        return self.layout is not None

    @property
    def key_rows(self) -> list[int]:
        """Per unit: the patch rows ``gather`` returns for it (every frame's, for a whole unit)."""
        return [u.frames * u.full_rows * u.width for u in self.units]

    def unit_table(self, device: torch.device) -> torch.Tensor:
        """``units`` as an int64 ``[units, 5]`` tensor on ``device``, one row ``(frames, rows,
        first_row, full_rows, width)`` per unit: what a tower needs to place its bands with
        tensor ops only (the one form a compiled tower has)."""
        if self.table is not None:
            return self.table
        values = [[u.frames, u.rows, u.first_row, u.full_rows, u.width] for u in self.units]
        table = torch.tensor(values, dtype=torch.int64, device="cpu").view(-1, 5)
        return transfer.to_device(table, device)

    def tensor_form(self, device: torch.device) -> "Bands":
        """These bands as a compiled tower gets them: ``units`` None, ``unit_table`` on
        ``device`` (``check_vision_encoder`` runs a tower so)."""
        return type(self)(None, self.layout, self.group_name, self.unit_table(device))

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (one row per local patch, in batch order) as the rows each unit attends over:
        a collective of the balancing group, with autograd (see the class doc)."""
        rows = torch.ops.vitbal.band_gather(x, self.layout, self.group_name)
        if torch.compiler.is_compiling():  # every rank computes a unit: a compiler cannot know
            torch._check(rows.shape[0] >= 1)
        return rows

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention of every local patch's query over its frame's keys: its own frame's rows
        for a whole unit (each of its frames on its own), the whole frame's for a band; ``q``,
        ``k``, ``v`` ``[heads, local rows, head_dim]`` in batch order, the result alike (scale
        ``head_dim ** -0.5``, no mask inside a frame). In place of ``gather`` in a layer that
        attends over whole frames: the library then runs the exchange each split frame's plan
        chose (``BalanceConfig.band_exchange``: gather, ulysses, ring, usp; ``bands.kinds``), among
        the frame's ranks only, and autograd keeps only this rank's own rows (memory falls as
        1/k). A rank with no band of a split frame sends nothing; every rank of the group still
        calls it in the same layers (its tower runs anyway). In the tensor form (compiled) the
        same, inside the custom ops of ``bands.compiled``."""
        if self.units is None:
            return compiled_attention(q, k, v, self.attending_packed, self.group_name)[0]
        if self.attending is not None:
            return band_attention(q, k, v, self.attending, resolve_group(self.group_name))
        return _gathered_attention(self, q, k, v, self.units)


def _gathered_attention(bands: Bands, q, k, v, units: Sequence[BandUnit]) -> torch.Tensor:
    """Two bands of one frame on this rank: gathered keys, each frame's attention apart."""
    kv = bands.gather(torch.cat([k, v], -1).transpose(0, 1)).transpose(0, 1)
    keys, values = kv.chunk(2, -1)
    queries = [u.rows * u.width for u in units for _ in range(u.frames)]
    lengths = [u.full_rows * u.width for u in units for _ in range(u.frames)]
    parts = zip(q.split(queries, 1), keys.split(lengths, 1), values.split(lengths, 1), strict=True)
    return torch.cat([F.scaled_dot_product_attention(*qkv) for qkv in parts], 1)


class _OneProcess(Bands):
    """``Bands`` whose every band is on this process: ``gather`` is local, no collective;
    ``attention`` over the gathered rows, in the tensor form too (its units read from the
    table: ``check_vision_encoder`` runs eagerly)."""

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x[a:b] for _, a, b in BandLayout.from_tensor(self.layout).pieces])

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        units = self.units or [BandUnit(*row) for row in self.table.tolist()]
        return _gathered_attention(self, q, k, v, units)


def frame_in_bands(frame: tuple[int, int, int], parts: int) -> Bands:
    """A batch of ``frame`` (``[1, h, w]``) as ``parts`` equal bands, all on this process
    (``check_vision_encoder``'s band promise): each attends over the whole frame's rows."""
    _, h, w = frame
    rows = h // parts
    pieces = [(LOCAL, 0, h * w)] * parts
    layout = BandLayout(send=[], in_splits=[0], out_splits=[0], pieces=pieces).to_tensor()
    return _OneProcess([BandUnit(1, rows, i * rows, h, w) for i in range(parts)], layout, "")


def bands_for_vit(
    routing: torch.Tensor, grid: torch.Tensor, group_name: str, runs: bool
) -> Bands | None:
    """The ``vitbal_bands`` a call gives its ViT: None unless it ``runs`` bands
    (``settings.runs_bands``); then as Python, the plan's (``runtime.transport.state``) on a step
    that splits a frame, else None; under ``torch.compile`` (a ViT that runs their tensor form) that
    form, on every step (``vitbal::band_tables``)."""
    if not runs:
        return None
    if torch.compiler.is_compiling():
        table, layout, attending = torch.ops.vitbal.band_tables(routing, grid)
        return Bands(None, layout, group_name, table, attending_packed=attending)
    kept = state_of_routing(routing)
    bands = kept.bands if kept is not None else None
    return bands if bands is not None and bands.split else None


@torch.library.custom_op("vitbal::band_tables", mutates_args=(), tags=CUDAGRAPH_UNSAFE)
def band_tables(
    routing: torch.Tensor, grid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tensor form of a step's ``Bands``: its ``unit_table`` on the grid's device, its
    exchange's layout (``BandLayout``) and its ``attending`` packed (``AttentionLayout``, on the
    host), from the call's state (``runtime.transport.state``). A plan that splits nothing (or
    made none: balancing off) gives whole units, read from the grid (the table on its device;
    without a state, the attention layout from the grid read on the host), and a layout that
    exchanges nothing.

    Raises:
        RuntimeError: the routing says the plan split a frame but its call's state is gone
            (the bands' exchange cannot be made up: each band would attend only within
            itself), or the plan put two bands of one frame on this rank (plans never do:
            ``test_band_planning.py`` holds them to a band a rank).
    """
    kept = state_of_routing(routing)
    bands = kept.bands if kept is not None else None
    if bands is not None and bands.split:
        if bands.attending is None:
            raise RuntimeError(
                "vit dp balance: this rank computes two bands of one frame, which the tensor "
                "form's attention cannot run (plans put a band a rank)"
            )
        return bands.unit_table(grid.device), bands.layout, bands.attending.to_tensor()
    if route_of(routing).split:
        raise RuntimeError(
            "vit dp balance: the plan split a frame into bands but its call's state is gone "
            "(a routing tensor used after a later call of the same ViT planned?)"
        )
    t, h, w = grid.to(torch.int64).unbind(1)
    table = torch.stack([t, h, torch.zeros_like(h), h, w], 1)
    if bands is not None:
        attending = bands.attending
    else:  # no plan's state: the grid read on the host
        attending = whole_attention(whole_units(grid.tolist()))
    exchange = BandLayout([], [], [], [], exchange=False).to_tensor()
    return table, exchange, attending.to_tensor()


@band_tables.register_fake
def _(routing, grid):
    ctx = torch.library.get_ctx()
    layout = routing.new_empty(ctx.new_dynamic_size())
    attending = routing.new_empty(ctx.new_dynamic_size())
    return grid.new_empty(grid.shape[0], 5, dtype=torch.int64), layout, attending


def whole_attention(units: Sequence[BandUnit]) -> AttentionLayout:
    """The ``AttentionLayout`` of a batch of whole units: each frame on its own."""
    frames = [AttentionUnit(rows=u.rows * u.width) for u in units for _ in range(u.frames)]
    return AttentionLayout(units=tuple(frames))


def whole_units(rows: Sequence[Sequence[int]]) -> list[BandUnit]:
    """The ``BandUnit``s of a batch of whole units, from its grid rows ``(t, h, w)``."""
    return [BandUnit(t, h, 0, h, w) for t, h, w in rows]


def band_layout(
    planned: StepPlan,
    arrivals: Sequence[tuple[int, int]],
    rank: int,
    world: int,
    merge_size: int,
) -> tuple[list[BandUnit], BandLayout, AttentionLayout | None]:
    """This rank's ``BandUnit``s, the exchange ``gather`` runs, and the ``attention_layout``
    under a plan.

    Args:
        planned: the step's plan (``plan.step.StepPlan``): every owner's units (an owner is a
            rank, or a replica set) and their rows, the split frames (by name ``(owner, index
            of their first band)``, their bands in order) and who computes each unit.
        arrivals: ``(owner, index)`` of the units this rank computes, in batch order.
        rank, world: this rank, and the group's size.
        merge_size: a rank computing nothing else computes the dummy unit ``[1, m, m]``.

    Two ranks exchange the rows of every frame both compute bands of, frame by frame in name
    order, band by band.
    """
    units_O, rows_O, bands_of = planned.units_O, planned.rows_O, planned.frames
    computed_by = planned.computed_by
    frame_of = _frames_of(bands_of, arrivals)
    starts = [0]
    local = {}
    for o, i in arrivals:
        local.setdefault((o, i), len(starts) - 1)
        starts.append(starts[-1] + rows_O[o][i])
    mine = sorted({frame_of[a] for a in arrivals if a in frame_of})
    # Per peer rank, in frame then band order: the local bands sent, the bands received (only
    # the peers sharing a frame: a loop over the whole group cost every rank ~1 ms at 2048).
    send_R: dict[int, list[int]] = {}
    recv_R: dict[int, list[tuple[int, int]]] = {}
    for name in mine:
        o = name[0]
        ranks = {computed_by(o, i) for i in bands_of[name]}
        for peer in sorted(ranks - {rank}):
            sent = [local[(o, i)] for i in bands_of[name] if (o, i) in local]
            send_R.setdefault(peer, []).extend(sent)
            got = [(o, i) for i in bands_of[name] if computed_by(o, i) == peer]
            recv_R.setdefault(peer, []).extend(got)
    send = [(starts[u], starts[u + 1]) for peer in sorted(send_R) for u in send_R[peer]]
    in_splits = [0] * world
    for peer, sent in send_R.items():
        in_splits[peer] = sum(starts[u + 1] - starts[u] for u in sent)
    arrived: dict[tuple[int, int], tuple[int, int, int]] = {}
    out_splits = [0] * world
    for peer in sorted(recv_R):
        first = 0
        for o, i in recv_R[peer]:
            rows = rows_O[o][i]
            arrived[(o, i)] = (peer, first, first + rows)
            first += rows
        out_splits[peer] = first
    units, pieces = [], []
    if not arrivals:  # the dummy unit: its own rows
        units.append(BandUnit(1, merge_size, 0, merge_size, merge_size))
        pieces.append((LOCAL, 0, merge_size * merge_size))
    for j, (o, i) in enumerate(arrivals):
        u = units_O[o][i]
        if (o, i) not in frame_of:  # a whole unit
            t, h, w = u
            units.append(BandUnit(t, h, 0, h, w))
            pieces.append((LOCAL, starts[j], starts[j + 1]))
            continue
        units.append(BandUnit(1, u.h, u.first_row, u.full_h, u.w))
        for b in bands_of[frame_of[(o, i)]]:
            if (o, b) in local:
                k = local[(o, b)]
                pieces.append((LOCAL, starts[k], starts[k + 1]))
            else:
                pieces.append(arrived[(o, b)])
    layout = BandLayout(merged_ranges(send), in_splits, out_splits, _merged_pieces(pieces))
    return units, layout, attention_layout(planned, arrivals, rank, merge_size)


def attention_layout(
    planned: StepPlan, arrivals: Sequence[tuple[int, int]], rank: int, merge_size: int
) -> AttentionLayout | None:
    """This rank's ``AttentionLayout`` under a plan (``band_layout``'s arguments): each frame
    of its units in batch order, a band with its frame's ranks in band order, their rows and
    the frame's exchange kind; frame ids number the split frames in name order, alike on every
    rank. None when this rank computes two bands of one frame (``Bands.attention`` gathers)."""
    ids = {name: n for n, name in enumerate(sorted(planned.frames))}
    frame_of = _frames_of(planned.frames, arrivals)
    units = [] if arrivals else [AttentionUnit(rows=merge_size * merge_size)]
    for o, i in arrivals:
        u = planned.units_O[o][i]
        if (o, i) not in frame_of:
            units += [AttentionUnit(rows=u[1] * u[2])] * u[0]  # its frames, each on its own
            continue
        name = frame_of[(o, i)]
        ranks = tuple(planned.computed_by(o, b) for b in planned.frames[name])
        if len(set(ranks)) < len(ranks):
            return None
        band = FrameBand(
            frame=ids[name],
            kind=planned.exchanges.get(name, "gather"),
            node_bands=planned.node_bands.get(name, 1),
            ranks=ranks,
            index=ranks.index(rank),
            band_rows=tuple(planned.rows_O[o][b] for b in planned.frames[name]),
        )
        units.append(AttentionUnit(rows=u.h * u.w, band=band))
    return AttentionLayout(units=tuple(units))


def _frames_of(bands_of: dict, arrivals) -> dict[tuple[int, int], tuple[int, int]]:
    """Each band's frame name (``StepPlan.frames``), for the owners of ``arrivals`` only."""
    owners = {o for o, _ in arrivals}
    return {
        (name[0], i): name
        for name, indices in bands_of.items()
        if name[0] in owners
        for i in indices
    }


def _merged_pieces(pieces) -> list[tuple[int, int, int]]:
    """Non-empty ``(source, first, end)`` pieces, each merged into the previous one it
    continues in the same source (local rows included: unlike the exchange's zero pieces,
    ``LOCAL`` rows are real rows and merge only where contiguous)."""
    merged: list[tuple[int, int, int]] = []
    for s, a, b in pieces:
        if merged and merged[-1][0] == s and merged[-1][2] == a:
            merged[-1] = (s, merged[-1][1], b)
        elif b > a:
            merged.append((s, a, b))
    return merged
