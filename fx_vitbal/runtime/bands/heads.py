"""Exchanges of heads (``bands.kinds``): ``ulysses``, an all-to-all among a frame's ranks that
gives each rank all of the frame's rows for its share of the heads, and ``usp``, the same
inside each group of a node's bands with a ring across the groups (``bands.ring``)."""

import dataclasses
import itertools

import torch
from torch.autograd.function import once_differentiable

from fx_vitbal.runtime.bands.blocks import (
    FrameBand,
    attend,
    block_grads,
    whole_backward,
    whole_forward,
)
from fx_vitbal.runtime.bands.p2p import KV, Phase
from fx_vitbal.runtime.bands.ring import ring_backward, ring_forward

# ---- ulysses ----------------------------------------------------------------------------------


class Ulysses(torch.autograd.Function):
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
        whole_saved = _whole_forward(q, k, v, whole, out)
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
        ctx.save_for_backward(*whole_saved, *frames)
        ctx.whole, ctx.bands, ctx.group = whole, bands, group
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        saved = ctx.saved_tensors  # once: checkpointing unpacks each saved tensor only once
        frames = saved[5:]
        dq, dk, dv = (torch.zeros_like(dout) for _ in range(3))
        phase = Phase(ctx.group)
        dout_in = [_rows_of_frame(phase, band, dout[:, a:b]) for band, a, b in ctx.bands]
        phase.start()
        _whole_backward(saved[:5], dout, ctx.whole, (dq, dk, dv))
        phase.wait()
        back, dqkv_in = Phase(ctx.group), []
        for n, (band, _, _) in enumerate(ctx.bands):
            qkv, out_f, lse_f = frames[3 * n : 3 * n + 3]
            dout_f = torch.cat(dout_in[n], 1)  # [h, N, D]
            grads = block_grads(*qkv.chunk(3, -1), dout_f, out_f, lse_f)
            dqkv_in.append(_heads_of_band(back, band, torch.cat(grads, -1)))
        back.start().wait()
        for (_, a, b), pieces in zip(ctx.bands, dqkv_in, strict=True):
            dq[:, a:b], dk[:, a:b], dv[:, a:b] = torch.cat(pieces, 0).chunk(3, -1)
        return dq, dk, dv, None, None, None


# ---- usp --------------------------------------------------------------------------------------


class Usp(torch.autograd.Function):
    """Ulysses inside each group of ``node_bands`` consecutive bands, ring across the groups
    (USP, Fang and Zhao, arXiv 2405.07719): band ``g*u + l`` gets its group's rows for heads
    ``[l*h, (l+1)*h)`` (h = H/u) by an all-to-all among the group, then the groups' blocks of
    those heads go round the ring of the bands with the same ``l`` (``ring_forward`` on the
    head-sliced tensors), and the outputs go back by the group's all-to-all. So the heads need
    divide among a node's bands only, and what crosses nodes is one ring of ``1/u`` of the keys
    and values, each step behind a block of attention. Backward: the same way, the ring's
    backward in the middle.

    Saves, per band, its group's head-sliced rows (Q, K, V ``[h, N_g, D]``, out, lse: 1/k of the
    frame's when bands are equal) and the whole units' rows, as ``Ulysses`` does.
    """

    @staticmethod
    def forward(ctx, q, k, v, whole, bands, group):
        out = torch.zeros_like(q)
        phase = Phase(group)
        qkv_in = [
            _rows_of_frame(
                phase, _node_group(band), torch.cat([q[:, a:b], k[:, a:b], v[:, a:b]], -1)
            )
            for band, a, b in bands
        ]
        phase.start()
        whole_saved = _whole_forward(q, k, v, whole, out)
        phase.wait()
        qkv = torch.cat([torch.cat(pieces, 1) for pieces in qkv_in], 1)  # [h, sum N_g, 3D]
        rings = _rings(bands)
        out_r, lse_r = ring_forward(*qkv.chunk(3, -1), [], rings, group)
        back = Phase(group)
        out_in = [
            _heads_of_band(back, _node_group(band), out_r[:, a:b])
            for (band, _, _), (_, a, b) in zip(bands, rings, strict=True)
        ]
        back.start().wait()
        for (_, a, b), pieces in zip(bands, out_in, strict=True):
            out[:, a:b] = torch.cat(pieces, 0)
        ctx.save_for_backward(*whole_saved, qkv, out_r, lse_r)
        ctx.whole, ctx.bands, ctx.group = whole, bands, group
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        saved = ctx.saved_tensors  # once: checkpointing unpacks each saved tensor only once
        qkv, out_r, lse_r = saved[5:]
        dq, dk, dv = (torch.zeros_like(dout) for _ in range(3))
        phase = Phase(ctx.group)
        dout_in = [
            _rows_of_frame(phase, _node_group(band), dout[:, a:b]) for band, a, b in ctx.bands
        ]
        phase.start()
        _whole_backward(saved[:5], dout, ctx.whole, (dq, dk, dv))
        phase.wait()
        dout_r = torch.cat([torch.cat(pieces, 1) for pieces in dout_in], 1)
        rings = _rings(ctx.bands)
        grads = ring_backward(*qkv.chunk(3, -1), out_r, lse_r, dout_r, [], rings, ctx.group)
        dqkv = torch.cat(grads, -1)
        back = Phase(ctx.group)
        dqkv_in = [
            _heads_of_band(back, _node_group(band), dqkv[:, a:b])
            for (band, _, _), (_, a, b) in zip(ctx.bands, rings, strict=True)
        ]
        back.start().wait()
        for (_, a, b), pieces in zip(ctx.bands, dqkv_in, strict=True):
            dq[:, a:b], dk[:, a:b], dv[:, a:b] = torch.cat(pieces, 0).chunk(3, -1)
        return dq, dk, dv, None, None, None


def _node_group(band: FrameBand) -> FrameBand:
    """The Ulysses group of ``band``: its ``node_bands`` consecutive bands, as a frame of its
    own (the same id: its messages are the frame's)."""
    u = band.node_bands
    g, local = divmod(band.index, u)
    return dataclasses.replace(
        band,
        kind="ulysses",
        ranks=band.ranks[g * u : (g + 1) * u],
        index=local,
        band_rows=band.band_rows[g * u : (g + 1) * u],
        node_bands=1,
    )


def _rings(bands) -> list[tuple[FrameBand, int, int]]:
    """Each band's ring across its frame's groups (the bands at its place in every group, each
    block a group's rows), with its span in the concatenated head-sliced group rows."""
    rings, first = [], 0
    for band, _, _ in bands:
        u = band.node_bands
        g, local = divmod(band.index, u)
        groups = band.num_bands // u
        rows = tuple(sum(band.band_rows[j * u : (j + 1) * u]) for j in range(groups))
        ring = dataclasses.replace(
            band,
            kind="ring",
            ranks=tuple(band.ranks[j * u + local] for j in range(groups)),
            index=g,
            band_rows=rows,
            node_bands=1,
        )
        rings.append((ring, first, first + rows[g]))
        first += rows[g]
    return rings


def _whole_forward(q, k, v, whole, out) -> tuple[torch.Tensor, ...]:
    """The whole units' attention into ``out``; returns what their backward needs (their q, k,
    v, out and lse), copied out of the local tensors so that no saved view keeps the caller's
    band rows alive."""
    q_w, k_w, v_w = (_rows(t, whole) for t in (q, k, v))
    out_w, lse_w = torch.zeros_like(q_w), q_w.new_zeros(q_w.shape[:-1])
    whole_forward(q_w, k_w, v_w, _packed(whole), out_w, lse_w)
    _put_rows(out, whole, out_w)
    return q_w, k_w, v_w, out_w, lse_w


def _whole_backward(saved, dout, whole, grads) -> None:
    """The whole units' gradients (``_whole_forward``'s ``saved``) into ``grads`` (dq, dk, dv)."""
    q_w = saved[0]
    grads_w = [torch.zeros_like(q_w) for _ in range(3)]
    whole_backward(*saved[:3], _rows(dout, whole), *saved[3:], _packed(whole), *grads_w)
    for grad, grad_w in zip(grads, grads_w, strict=True):
        _put_rows(grad, whole, grad_w)


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
