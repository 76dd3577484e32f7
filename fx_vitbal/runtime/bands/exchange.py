"""The exchange of a split frame's keys and values between the ranks computing its bands
(``vitbal::band_gather``, and its adjoint ``vitbal::band_scatter``), laid out by ``BandLayout``.

Each is one batch of point-to-point messages among the ranks that share a frame
(``bands.p2p``), in the same layers in the same order on every rank of the frame; a rank without
a band of a split frame sends and receives nothing. On a step that splits nothing (the layout's
``exchange`` is False: a compiled tower gathers on every step) no message moves.
"""

import dataclasses

import torch

from fx_vitbal._compat import CUDAGRAPH_UNSAFE
from fx_vitbal.runtime.bands.p2p import Phase
from fx_vitbal.runtime.transport.collectives import resolve_group
from fx_vitbal.runtime.transport.state import state_holding

# A piece's source when it is a run of the local tensor rather than of what arrived.
LOCAL = -1


@dataclasses.dataclass(frozen=True)
class BandLayout:
    """One rank's exchange of band rows for one step, in rows of the tensors exchanged (one row
    per patch): which local rows go to which rank, and how the result is made of local and
    arrived rows."""

    send: list[tuple[int, int]]
    """Runs of local rows sent, in order (destination by destination)."""
    in_splits: list[int]
    """Rows sent to each rank."""
    out_splits: list[int]
    """Rows arriving from each rank."""
    pieces: list[tuple[int, int, int]]
    """``(source, first, end)`` runs of the local tensor (``LOCAL``) or of what arrived from a
    rank, which make the result in order."""
    exchange: bool = True
    """False on a step that splits no frame (a compiled tower gathers on every step): each unit
    attends over its own rows, the result is the local tensor and no collective runs."""

    step: int = 0
    """The call it belongs to (``Routing.step``), whose state keeps this layout parsed."""

    def to_tensor(self) -> torch.Tensor:
        world = len(self.in_splits)
        values = [world, len(self.send), len(self.pieces), int(self.exchange), self.step]
        values += [*self.in_splits, *self.out_splits]
        values += [v for run in self.send for v in run]
        values += [v for piece in self.pieces for v in piece]
        return torch.tensor(values, dtype=torch.int64, device="cpu")

    @classmethod
    def from_tensor(cls, layout: torch.Tensor) -> "BandLayout":
        values = layout.tolist()  # a CPU tensor: no device sync
        world, sends, pieces, exchange, step = values[:5]
        body = values[5:]
        runs = body[2 * world : 2 * world + 2 * sends]
        parts = body[2 * world + 2 * sends : 2 * world + 2 * sends + 3 * pieces]
        return cls(
            send=[tuple(runs[i : i + 2]) for i in range(0, len(runs), 2)],
            in_splits=body[:world],
            out_splits=body[world : 2 * world],
            pieces=[tuple(parts[i : i + 3]) for i in range(0, len(parts), 3)],
            exchange=bool(exchange),
            step=step,
        )

    @property
    def rows(self) -> int:
        """Rows of the result."""
        return sum(end - first for _, first, end in self.pieces)


@torch.library.custom_op("vitbal::band_gather", mutates_args=(), tags=CUDAGRAPH_UNSAFE)
def band_gather(x: torch.Tensor, layout: torch.Tensor, group_name: str) -> torch.Tensor:
    """``Bands.gather``: the rows each local unit attends over, local rows and the other bands'
    rows arrived in one ``all_to_all`` (``BandLayout``)."""
    plan = band_layout_of(layout)
    if not plan.exchange:  # a step that splits nothing: every unit attends over its own rows
        return x.clone(memory_format=torch.contiguous_format)  # the layout the fake promises
    flat = x.reshape(x.shape[0], -1)
    sent = _rows(flat, plan.send)
    chunks = _exchange(sent, plan.in_splits, plan.out_splits, resolve_group(group_name))
    parts = [flat[a:b] if s == LOCAL else chunks[s][a:b] for s, a, b in plan.pieces]
    out = torch.cat(parts) if parts else flat[:0].clone()
    return out.reshape(out.shape[0], *x.shape[1:])


@band_gather.register_fake
def _(x, layout, group_name):
    rows = torch.library.get_ctx().new_dynamic_size()
    return x.new_empty(rows, *x.shape[1:])


@torch.library.custom_op("vitbal::band_scatter", mutates_args=(), tags=CUDAGRAPH_UNSAFE)
def band_scatter(
    grad: torch.Tensor, layout: torch.Tensor, group_name: str, rows: int
) -> torch.Tensor:
    """The adjoint of ``band_gather``: each row's gradient summed where the row came from (the
    local rows' here, in piece order; the arrived rows' sent back, then summed in send order);
    ``rows``: the local rows."""
    plan = band_layout_of(layout)
    if not plan.exchange:
        return grad.clone(memory_format=torch.contiguous_format)
    flat = grad.reshape(grad.shape[0], -1)
    local = flat.new_zeros(rows, flat.shape[1])
    back = [flat.new_zeros(n, flat.shape[1]) for n in plan.out_splits]
    first = 0
    for s, a, b in plan.pieces:
        piece = flat[first : first + b - a]
        first += b - a
        if s == LOCAL:
            local[a:b] += piece
        else:
            back[s][a:b] += piece
    sent = torch.cat(back) if back else flat[:0]
    returned = torch.cat(
        _exchange(sent, plan.out_splits, plan.in_splits, resolve_group(group_name))
    )
    first = 0
    for a, b in plan.send:
        local[a:b] += returned[first : first + b - a]
        first += b - a
    return local.reshape(rows, *grad.shape[1:])


@band_scatter.register_fake
def _(grad, layout, group_name, rows):
    return grad.new_empty(rows, *grad.shape[1:])


def band_layout_of(layout: torch.Tensor) -> BandLayout:
    """``layout`` parsed: its call's parse when that call's state holds this very tensor, else
    parsed afresh (``runtime.transport.state``)."""
    state = state_holding(layout)
    if state is not None and state.band_layout is not None and state.band_layout[0] is layout:
        return state.band_layout[1]
    return BandLayout.from_tensor(layout)


def _exchange(sent: torch.Tensor, send_splits, receive_splits, group) -> list[torch.Tensor]:
    """``sent``'s rows to each rank by ``send_splits``, and each rank's rows by
    ``receive_splits`` (a list, one chunk per rank: empty where nothing comes), point to point
    with the ranks it shares a frame with only (``bands.p2p``): a rank without a band of a
    split frame sends and receives nothing."""
    phase = Phase(group)
    for peer, chunk in enumerate(sent.split(send_splits)):
        if chunk.shape[0]:
            phase.send(chunk, peer, frame=0)
    chunks = [
        phase.recv((n, sent.shape[1]), sent, peer, frame=0) if n else sent[:0]
        for peer, n in enumerate(receive_splits)
    ]
    phase.start().wait()
    return chunks


def _rows(flat: torch.Tensor, runs: list[tuple[int, int]]) -> torch.Tensor:
    if not runs:
        return flat[:0]
    return torch.cat([flat[a:b] for a, b in runs])


def _gather_setup(ctx, inputs, output):
    x, layout, group_name = inputs
    ctx.layout, ctx.group_name, ctx.rows = layout, group_name, x.shape[0]


def _gather_backward(ctx, grad):
    return band_scatter(grad, ctx.layout, ctx.group_name, ctx.rows), None, None


def _scatter_setup(ctx, inputs, output):
    _, layout, group_name, _ = inputs
    ctx.layout, ctx.group_name = layout, group_name


def _scatter_backward(ctx, grad):
    return band_gather(grad, ctx.layout, ctx.group_name), None, None, None


band_gather.register_autograd(_gather_backward, setup_context=_gather_setup)
band_scatter.register_autograd(_scatter_backward, setup_context=_scatter_setup)
