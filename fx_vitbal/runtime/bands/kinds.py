"""Attention over whole frames whose row bands lie on different ranks (``Bands.attention``), with
traffic only among each frame's own band ranks and autograd memory that falls as 1/k.

A rank computes some local units in batch order; their rows are concatenated in ``q``, ``k``,
``v`` (``[heads, rows, head_dim]``). A whole unit attends over its own rows. A band of a frame
cut into k bands on k ranks attends over the whole frame's rows, of which it holds 1/k. Its
frame's ``kind`` (``BalanceConfig.band_exchange``, chosen per frame by the plan) brings it the
rest:

- ``gather``: every band rank receives the other bands' keys and values (point to point),
  attends, drops them; its backward gathers them again and sends each remote block's dK/dV home.
- ``ring``: key/value blocks travel round the frame's ring in k-1 steps, merged by an online
  softmax, the next block's messages posted before the current block is computed; the backward
  sends them round again with their dK/dV accumulators (FlashAttention-2 / ring attention).
- ``ulysses``: an all-to-all of heads: each rank attends over all of the frame's rows for
  heads/k of the heads, then the outputs go back (heads that do not divide among the frame's
  ranks: ``ring``, by rule, on every rank of the frame alike).

Messages: [Note: one batch per phase] in ``bands.p2p``. Kinds run in a fixed order (gather,
ring, ulysses), so a rank in frames of two kinds meets each frame's ranks in the same order.

[Note: what autograd keeps] Each kind is one ``torch.autograd.Function`` whose forward runs
without autograd, so the only tensors kept for the backward are those it saves: the local q, k,
v, out and the logsumexp for ``gather`` and ``ring`` (remote keys and values are fetched again
by the backward), and for ``ulysses`` the head-sliced frame tensors of its heads (``N * H/k``
rows each, one band's size when bands are equal) plus its whole units' own rows.
"""

import itertools

import torch
from torch.autograd.function import once_differentiable

from fx_vitbal.runtime.bands.blocks import (
    AttentionLayout,
    FrameBand,
    OnlineSoftmax,
    attend,
    block_grads,
    whole_backward,
    whole_forward,
)
from fx_vitbal.runtime.bands.p2p import ACC, KV, Phase

KINDS = ("gather", "ring", "ulysses")


def band_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: AttentionLayout, group
) -> torch.Tensor:
    """Attention of every local unit over its unit's keys: its own rows for a whole unit, its
    whole frame's for a band (softmax of scaled dot products, scale ``head_dim ** -0.5``).

    Args:
        q, k, v: ``[heads, layout.rows, head_dim]``, the local units' rows in batch order.
        layout: this rank's units; its ranks are ranks of ``group``.
        group: the balancing group (used only by ranks holding a band of a split frame).

    Returns:
        ``[heads, layout.rows, head_dim]``, differentiable in ``q``, ``k``, ``v``.
    """
    whole, bands = layout.split()
    by_kind = {kind: [] for kind in KINDS}
    for band, a, b in bands:
        kind = band.kind
        if kind == "ulysses" and q.shape[0] % band.num_bands:
            kind = "ring"  # the heads do not divide: every rank of the frame sees the same
        by_kind[kind].append((band, a, b))
    calls = [(kind, chosen) for kind, chosen in by_kind.items() if chosen] or [("gather", [])]
    out = None
    for n, (kind, chosen) in enumerate(calls):
        function = {"gather": _Gather, "ring": _Ring, "ulysses": _Ulysses}[kind]
        part = function.apply(q, k, v, whole if n == 0 else [], chosen, group)
        out = part if out is None else out + part  # each fills its own rows, zeros elsewhere
    return out


def _gather_kv(bands, k, v, group) -> tuple[Phase, list[dict[int, torch.Tensor]]]:
    """Start sending every band's K/V (side by side, ``[H, n, 2D]``) to the frame's other ranks
    and receiving theirs; returns the phase and, per band, ``{band index: buffer}``."""
    phase, arrived = Phase(group), []
    for band, a, b in bands:
        kv = torch.cat([k[:, a:b], v[:, a:b]], -1)
        buffers = {}
        for j, peer in enumerate(band.ranks):
            if j != band.index:
                phase.send(kv, peer, band.frame, KV)
                shape = (k.shape[0], band.band_rows[j], 2 * k.shape[2])
                buffers[j] = phase.recv(shape, k, peer, band.frame, KV)
        arrived.append(buffers)
    return phase.start(), arrived


# ---- gather -----------------------------------------------------------------------------------


class _Gather(torch.autograd.Function):
    """All of a frame's K/V, point to point among its ranks; re-gathered in the backward.

    Forward: post the gather; while it flies, attend the whole units and each band's own block;
    then merge the arrived blocks. Backward: post the re-gather; while it flies, each band's own
    block's gradients; then the arrived blocks', whose dK/dV go home in a second phase, during
    which the whole units' gradients are computed. Saves q, k, v, out, lse (all local).
    """

    @staticmethod
    def forward(ctx, q, k, v, whole, bands, group):
        out, lse = torch.zeros_like(q), q.new_zeros(q.shape[:-1])
        phase, arrived = _gather_kv(bands, k, v, group)
        whole_forward(q, k, v, whole, out, lse)
        softmaxes = []
        for _, a, b in bands:
            softmaxes.append(OnlineSoftmax(q[:, a:b]))
            softmaxes[-1].add(k[:, a:b], v[:, a:b])
        phase.wait()
        for (_, a, b), softmax, buffers in zip(bands, softmaxes, arrived, strict=True):
            for kv in buffers.values():
                softmax.add(*kv.chunk(2, -1))
            out[:, a:b], lse[:, a:b] = softmax.result()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.whole, ctx.bands, ctx.group = whole, bands, group
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        delta = (dout * out).sum(-1)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        phase, arrived = _gather_kv(ctx.bands, k, v, ctx.group)
        for _, a, b in ctx.bands:
            dq[:, a:b], dk[:, a:b], dv[:, a:b] = block_grads(
                q[:, a:b], k[:, a:b], v[:, a:b], dout[:, a:b], lse[:, a:b], delta[:, a:b]
            )
        phase.wait()
        home, returned = Phase(ctx.group), []
        for (band, a, b), buffers in zip(ctx.bands, arrived, strict=True):
            for j, kv in buffers.items():
                dq_j, dk_j, dv_j = block_grads(
                    q[:, a:b], *kv.chunk(2, -1), dout[:, a:b], lse[:, a:b], delta[:, a:b]
                )
                dq[:, a:b] += dq_j
                home.send(torch.cat([dk_j, dv_j], -1), band.ranks[j], band.frame, KV)
                shape = (k.shape[0], b - a, 2 * k.shape[2])
                returned.append((a, b, home.recv(shape, k, band.ranks[j], band.frame, KV)))
        home.start()
        whole_backward(q, k, v, dout, lse, delta, ctx.whole, dq, dk, dv)
        home.wait()
        for a, b, dkv in returned:
            dk_r, dv_r = dkv.chunk(2, -1)
            dk[:, a:b] += dk_r
            dv[:, a:b] += dv_r
        return dq, dk, dv, None, None, None


# ---- ring -------------------------------------------------------------------------------------


class _Ring(torch.autograd.Function):
    """K/V blocks passed round each frame's ring (band order: band i sends to band i+1).

    At step s band i holds block ``(i - s) mod k``; the next block's send/receive is posted
    before the current block is computed (step 0 also computes the whole units). Backward
    (FlashAttention-2 ring): the same walk of K/V blocks, plus a dK/dV accumulator per block that
    starts one rank after the block's owner, gains each rank's contribution and comes home after
    k-1 hops (the owner adds its own, kept from step 0). An accumulator is sent in the phase
    after the step that computed it, so it flies during the next block's compute; the whole
    units' gradients hide the last hop. Saves q, k, v, out, lse (all local).
    """

    @staticmethod
    def forward(ctx, q, k, v, whole, bands, group):
        out, lse = torch.zeros_like(q), q.new_zeros(q.shape[:-1])
        softmaxes = [OnlineSoftmax(q[:, a:b]) for _, a, b in bands]
        current = [torch.cat([k[:, a:b], v[:, a:b]], -1) for _, a, b in bands]
        for step in range(max(1, _most_bands(bands))):  # step 0 runs even without bands
            phase, following = Phase(group), {}
            for n, (band, _, _) in enumerate(bands):
                if step < band.num_bands - 1:
                    following[n] = _pass_block(phase, band, current[n], step + 1)
            phase.start()
            if step == 0:
                whole_forward(q, k, v, whole, out, lse)
            for n, (band, _, _) in enumerate(bands):
                if step < band.num_bands:
                    softmaxes[n].add(*current[n].chunk(2, -1))
            phase.wait()
            for n, block in following.items():
                current[n] = block
        for (_, a, b), softmax in zip(bands, softmaxes, strict=True):
            out[:, a:b], lse[:, a:b] = softmax.result()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.whole, ctx.bands, ctx.group = whole, bands, group
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        bands = ctx.bands
        delta = (dout * out).sum(-1)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        current = [torch.cat([k[:, a:b], v[:, a:b]], -1) for _, a, b in bands]
        acc: list[torch.Tensor | None] = [None] * len(bands)  # dK/dV [H, rows, 2D] of a block
        last = _most_bands(bands)  # one more phase than blocks: accumulators come home
        for step in range(last + 1):
            phase, following, incoming = Phase(ctx.group), {}, {}
            for n, (band, _, _) in enumerate(bands):
                if step < band.num_bands - 1:
                    following[n] = _pass_block(phase, band, current[n], step + 1)
                if 2 <= step <= band.num_bands:
                    incoming[n] = _pass_acc(phase, band, acc[n], step)
            phase.start()
            if step == last:  # the last phase has no block to compute: hide its hop
                whole_backward(q, k, v, dout, lse, delta, ctx.whole, dq, dk, dv)
            for n, (band, a, b) in enumerate(bands):
                if step >= band.num_bands:
                    continue
                dq_s, dk_s, dv_s = block_grads(
                    q[:, a:b], *current[n].chunk(2, -1), dout[:, a:b], lse[:, a:b], delta[:, a:b]
                )
                dq[:, a:b] += dq_s
                if step == 0:  # own block: kept here until its accumulator comes home
                    dk[:, a:b], dv[:, a:b] = dk_s, dv_s
                else:
                    acc[n] = torch.cat([dk_s, dv_s], -1)
            phase.wait()
            for n, (band, a, b) in enumerate(bands):
                if n in incoming and step < band.num_bands:
                    acc[n] += incoming[n]
                elif n in incoming:  # step == k: this band's own block, every rank's share
                    dk_home, dv_home = incoming[n].chunk(2, -1)
                    dk[:, a:b] += dk_home
                    dv[:, a:b] += dv_home
            for n, block in following.items():
                current[n] = block
        return dq, dk, dv, None, None, None


def _most_bands(bands) -> int:
    return max((band.num_bands for band, _, _ in bands), default=0)


def _pass_block(phase: Phase, band: FrameBand, block: torch.Tensor, step: int) -> torch.Tensor:
    """Send ``block`` to the next band's rank; receive the block this band holds at ``step``."""
    kb, i = band.num_bands, band.index
    phase.send(block, band.ranks[(i + 1) % kb], band.frame, KV)
    shape = (block.shape[0], band.band_rows[(i - step) % kb], block.shape[2])
    return phase.recv(shape, block, band.ranks[(i - 1) % kb], band.frame, KV)


def _pass_acc(phase: Phase, band: FrameBand, acc: torch.Tensor, step: int) -> torch.Tensor:
    """Send the accumulator computed at ``step - 1`` on; receive the one of ``step``'s block
    (at ``step == k``: this band's own block's, complete)."""
    kb, i = band.num_bands, band.index
    phase.send(acc, band.ranks[(i + 1) % kb], band.frame, ACC)
    shape = (acc.shape[0], band.band_rows[(i - step) % kb], acc.shape[2])
    return phase.recv(shape, acc, band.ranks[(i - 1) % kb], band.frame, ACC)


# ---- ulysses ----------------------------------------------------------------------------------


class _Ulysses(torch.autograd.Function):
    """An all-to-all of heads among each frame's ranks: band i gets every band's rows for heads
    ``[i*h, (i+1)*h)`` (h = H/k), attends over the whole frame, and sends each band its output
    rows back. Backward: dout goes the way q, k, v went; dQ/dK/dV the way out came back. The
    whole units are computed while the first exchange flies.

    Saves, per band, the head-sliced frame tensors: Q, K, V side by side ``[h, N, 3D]``, out
    ``[h, N, D]``, lse ``[h, N]``; and the whole units' q, k, v, out, lse, copied out of the
    local tensors so that no view keeps the caller's band rows alive.
    """

    @staticmethod
    def forward(ctx, q, k, v, whole, bands, group):
        out = torch.zeros_like(q)
        phase = Phase(group)
        qkv_in = [
            _rows_of_frame(phase, band, torch.cat([q[:, a:b], k[:, a:b], v[:, a:b]], -1))
            for band, a, b in bands
        ]
        phase.start()
        # The whole units' rows, copied out so that no saved view keeps the caller's bands.
        q_w, k_w, v_w = (_rows(t, whole) for t in (q, k, v))
        out_w, lse_w = torch.zeros_like(q_w), q_w.new_zeros(q_w.shape[:-1])
        whole_forward(q_w, k_w, v_w, _packed(whole), out_w, lse_w)
        _put_rows(out, whole, out_w)
        phase.wait()
        back, frames, out_in = Phase(group), [], []
        for (band, _, _), pieces in zip(bands, qkv_in, strict=True):
            qkv = torch.cat(pieces, 1)  # [h, N, 3D]
            out_f, lse_f = attend(*qkv.chunk(3, -1))
            frames += [qkv, out_f, lse_f]
            out_in.append(_heads_of_band(back, band, out_f))
        back.start().wait()
        for (_, a, b), pieces in zip(bands, out_in, strict=True):
            out[:, a:b] = torch.cat(pieces, 0)
        ctx.save_for_backward(q_w, k_w, v_w, out_w, lse_w, *frames)
        ctx.whole, ctx.bands, ctx.group = whole, bands, group
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        q_w, k_w, v_w, out_w, lse_w, *frames = ctx.saved_tensors
        dq, dk, dv = (torch.zeros_like(dout) for _ in range(3))
        phase = Phase(ctx.group)
        dout_in = [_rows_of_frame(phase, band, dout[:, a:b]) for band, a, b in ctx.bands]
        phase.start()
        dout_w = _rows(dout, ctx.whole)
        grads_w = [torch.zeros_like(q_w) for _ in range(3)]
        delta_w = (dout_w * out_w).sum(-1)
        whole_backward(q_w, k_w, v_w, dout_w, lse_w, delta_w, _packed(ctx.whole), *grads_w)
        for grad, grad_w in zip((dq, dk, dv), grads_w, strict=True):
            _put_rows(grad, ctx.whole, grad_w)
        phase.wait()
        back, dqkv_in = Phase(ctx.group), []
        for n, (band, _, _) in enumerate(ctx.bands):
            qkv, out_f, lse_f = frames[3 * n : 3 * n + 3]
            dout_f = torch.cat(dout_in[n], 1)  # [h, N, D]
            grads = block_grads(*qkv.chunk(3, -1), dout_f, lse_f, (dout_f * out_f).sum(-1))
            dqkv_in.append(_heads_of_band(back, band, torch.cat(grads, -1)))
        back.start().wait()
        for (_, a, b), pieces in zip(ctx.bands, dqkv_in, strict=True):
            dq[:, a:b], dk[:, a:b], dv[:, a:b] = torch.cat(pieces, 0).chunk(3, -1)
        return dq, dk, dv, None, None, None


def _rows(x: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    """The ``spans`` of ``x``'s rows (dim 1), one copy."""
    return torch.cat([x[:, a:b] for a, b in spans], 1) if spans else x[:, :0].clone()


def _put_rows(x: torch.Tensor, spans: list[tuple[int, int]], rows: torch.Tensor) -> None:
    """``rows`` (``_rows``' layout) written back into ``x``'s ``spans``."""
    for (a, b), (c, d) in zip(spans, _packed(spans), strict=True):
        x[:, a:b] = rows[:, c:d]


def _packed(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``spans`` renumbered as the consecutive rows of their concatenation."""
    return list(itertools.pairwise([0, *itertools.accumulate(b - a for a, b in spans)]))


def _rows_of_frame(phase: Phase, band: FrameBand, x: torch.Tensor) -> list[torch.Tensor]:
    """Heads to rows: send band j its heads of this band's rows ``x`` ``[H, n_i, C]``; returns
    per band j (buffers until the phase is waited) its rows of this band's heads
    ``[h, n_j, C]``, which make ``[h, N, C]`` concatenated."""
    h = x.shape[0] // band.num_bands
    pieces = []
    for j, peer in enumerate(band.ranks):
        mine = x[j * h : (j + 1) * h]
        if j == band.index:
            pieces.append(mine)
            continue
        phase.send(mine, peer, band.frame, KV)
        pieces.append(phase.recv((h, band.band_rows[j], x.shape[2]), x, peer, band.frame, KV))
    return pieces


def _heads_of_band(phase: Phase, band: FrameBand, y: torch.Tensor) -> list[torch.Tensor]:
    """Rows to heads, the inverse of ``_rows_of_frame``: send band j its rows of ``y``
    ``[h, N, C]``; returns per band j this band's rows of band j's heads ``[h, n_i, C]``, which
    make ``[H, n_i, C]`` concatenated."""
    starts, i = band.starts(), band.index
    pieces = []
    for j, peer in enumerate(band.ranks):
        rows = y[:, starts[j] : starts[j + 1]]
        if j == i:
            pieces.append(rows)
            continue
        phase.send(rows, peer, band.frame, KV)
        shape = (y.shape[0], band.band_rows[i], y.shape[2])
        pieces.append(phase.recv(shape, y, peer, band.frame, KV))
    return pieces
