"""``ring``: a split frame's key/value blocks passed round its ranks, merged by an online
softmax, each step's messages flying during a block's attention (``bands.kinds``); its forward
and backward also serve ``usp``'s ring across groups (``bands.heads``), and its backward,
routed straight to each block's owner, ``gather``'s (``bands.gather``)."""

import torch
from torch.autograd.function import once_differentiable

from fx_vitbal.runtime.bands.blocks import (
    FrameBand,
    OnlineSoftmax,
    block_grads,
    whole_backward,
    whole_forward,
)
from fx_vitbal.runtime.bands.p2p import ACC, KV, Phase


class Ring(torch.autograd.Function):
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
        out, lse = ring_forward(q, k, v, whole, bands, group)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.whole, ctx.bands, ctx.group = whole, bands, group
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        grads = ring_backward(*ctx.saved_tensors, dout, ctx.whole, ctx.bands, ctx.group)
        return *grads, None, None, None


def ring_forward(q, k, v, whole, bands, group) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of ``Ring``'s forward."""
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
    return out, lse


def ring_backward(
    q, k, v, out, lse, dout, whole, bands, group, hops: bool = True
) -> tuple[torch.Tensor, ...]:
    """``(dq, dk, dv)`` of ``Ring``'s backward; with ``hops=False``, ``Gather``'s: the same walk
    of blocks, but each block fetched from its owner and each block's dK/dV sent straight to
    it a step later (``_fetch``, ``_send_home``) instead of passed on by the next band."""
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    own = [torch.cat([k[:, a:b], v[:, a:b]], -1) for _, a, b in bands]
    current = list(own)
    acc: list[torch.Tensor | None] = [None] * len(bands)  # dK/dV [H, rows, 2D] of a block
    last = _most_bands(bands)  # one more phase than blocks: accumulators come home
    for step in range(last + 1):
        phase, following, incoming = Phase(group), {}, {}
        for n, (band, _, _) in enumerate(bands):
            if step < band.num_bands - 1:
                following[n] = (
                    _pass_block(phase, band, current[n], step + 1)
                    if hops
                    else _fetch(phase, band, own[n], step + 1)
                )
            if 2 <= step <= band.num_bands:
                incoming[n] = (
                    _pass_acc(phase, band, acc[n], step)
                    if hops
                    else _send_home(phase, band, acc[n], step - 1)
                )
        phase.start()
        if step == last:  # the last phase has no block to compute: hide its hop
            whole_backward(q, k, v, dout, out, lse, whole, dq, dk, dv)
        for n, (band, a, b) in enumerate(bands):
            if step >= band.num_bands:
                continue
            dq_s, dk_s, dv_s = block_grads(
                q[:, a:b], *current[n].chunk(2, -1), dout[:, a:b], out[:, a:b], lse[:, a:b]
            )
            dq[:, a:b] += dq_s
            if step == 0:  # own block: kept here until its accumulator comes home
                dk[:, a:b], dv[:, a:b] = dk_s, dv_s
            else:
                acc[n] = torch.cat([dk_s, dv_s], -1)
        phase.wait()
        del phase  # its messages hold the blocks sent: dropped once arrived
        for n, (band, a, b) in enumerate(bands):
            if n in incoming and hops and step < band.num_bands:
                acc[n] += incoming[n]
            elif n in incoming:  # this band's own block, every rank's share (hops: summed)
                dk_home, dv_home = incoming[n].chunk(2, -1)
                dk[:, a:b] += dk_home
                dv[:, a:b] += dv_home
            current[n] = following.get(n)
    return dq, dk, dv


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


def _fetch(phase: Phase, band: FrameBand, own: torch.Tensor, step: int) -> torch.Tensor:
    """Send this band's K/V (``own``) to the band that computes it at ``step`` (``i - step``);
    receive the block this band computes at ``step`` (``i + step``) from its owner."""
    kb, i = band.num_bands, band.index
    phase.send(own, band.ranks[(i - step) % kb], band.frame, KV)
    shape = (own.shape[0], band.band_rows[(i + step) % kb], own.shape[2])
    return phase.recv(shape, own, band.ranks[(i + step) % kb], band.frame, KV)


def _send_home(phase: Phase, band: FrameBand, grads: torch.Tensor, step: int) -> torch.Tensor:
    """Send the dK/dV of the block computed at ``step`` to its owner (``i + step``); receive this
    band's own block's from the band that computed it then (``i - step``)."""
    kb, i = band.num_bands, band.index
    phase.send(grads, band.ranks[(i + step) % kb], band.frame, ACC)
    shape = (grads.shape[0], band.band_rows[i], grads.shape[2])
    return phase.recv(shape, grads, band.ranks[(i - step) % kb], band.frame, ACC)
