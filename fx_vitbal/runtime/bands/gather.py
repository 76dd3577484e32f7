"""``gather``: a split frame's keys and values, point to point among its ranks, for each band's
attention over the whole frame; in the backward fetched again one block a step, straight from
its owner ([Note: what autograd keeps] in ``bands.kinds``)."""

import torch
from torch.autograd.function import once_differentiable

from fx_vitbal.runtime.bands.blocks import OnlineSoftmax, whole_forward
from fx_vitbal.runtime.bands.p2p import KV, Phase
from fx_vitbal.runtime.bands.ring import ring_backward


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
    gradients hide the last step (``ring_backward`` with ``hops=False``). Saves q, k, v, out, lse
    (all local).
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
        grads = ring_backward(*ctx.saved_tensors, dout, ctx.whole, ctx.bands, ctx.group, hops=False)
        return *grads, None, None, None
