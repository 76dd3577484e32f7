"""``gather``: a split frame's keys and values, point to point among its ranks, for each band's
attention over the whole frame; in the backward fetched again one block a step, straight from
its owner ([Note: what autograd keeps] in ``bands.kinds``)."""

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


class Gather(torch.autograd.Function):
    """All of a frame's K/V, point to point among its ranks, in one phase; fetched again in the
    backward one block a step.

    Forward: post the gather; while it flies, attend the whole units and each band's own block;
    then merge the arrived blocks. Backward: at step s band i computes the gradients of block
    ``i + s`` while block ``i + s + 1`` flies from its owner (which sends its own block to band
    ``i - s - 1``), and sends block ``i + s``'s dK/dV straight home a step later (receiving its
    own block's from band ``i - s``), as ``ring``'s walk but without the hops: a rank holds
    two blocks of keys and values and two of their gradients at a time, not the frame's (the
    frame's dK/dV held at once set the peak of a checkpointed tower). The whole units'
    gradients hide the last step. Saves q, k, v, out, lse (all local).
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
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        bands = ctx.bands
        current = [torch.cat([k[:, a:b], v[:, a:b]], -1) for _, a, b in bands]  # step 0: own
        own = list(current)
        done: list[torch.Tensor | None] = [None] * len(bands)  # dK/dV of the last step's block
        last = max((band.num_bands for band, _, _ in bands), default=0)
        for step in range(last + 1):  # one more step than blocks: the last dK/dV go home
            phase, fetched, returned = Phase(ctx.group), {}, {}
            for n, (band, _, _) in enumerate(bands):
                if step + 1 < band.num_bands:
                    fetched[n] = _fetch(phase, band, own[n], step + 1)
                if 2 <= step <= band.num_bands:
                    returned[n] = _send_home(phase, band, done[n], step - 1)
            phase.start()
            if step == last:  # no block left to compute: hide the last step
                whole_backward(q, k, v, dout, out, lse, ctx.whole, dq, dk, dv)
            for n, (band, a, b) in enumerate(bands):
                if step >= band.num_bands:
                    continue
                dq_s, dk_s, dv_s = block_grads(
                    q[:, a:b], *current[n].chunk(2, -1), dout[:, a:b], out[:, a:b], lse[:, a:b]
                )
                dq[:, a:b] += dq_s
                if step == 0:
                    dk[:, a:b], dv[:, a:b] = dk_s, dv_s
                else:
                    done[n] = torch.cat([dk_s, dv_s], -1)
            phase.wait()
            del phase  # its messages hold the blocks sent: dropped once arrived
            for n, (_, a, b) in enumerate(bands):
                if n in returned:
                    dk_home, dv_home = returned[n].chunk(2, -1)
                    dk[:, a:b] += dk_home
                    dv[:, a:b] += dv_home
                current[n] = fetched.get(n)
        return dq, dk, dv, None, None, None


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
