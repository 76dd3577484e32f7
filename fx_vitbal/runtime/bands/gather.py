"""``gather``: a split frame's keys and values, point to point among its ranks, for each band's
attention over the whole frame; fetched again in the backward ([Note: what autograd keeps] in
``bands.kinds``)."""

import torch
from torch.autograd.function import once_differentiable

from fx_vitbal.runtime.bands.blocks import OnlineSoftmax, block_grads, whole_backward, whole_forward
from fx_vitbal.runtime.bands.p2p import KV, Phase


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
    """All of a frame's K/V, point to point among its ranks; re-gathered in the backward.

    Forward: post the gather; while it flies, attend the whole units and each band's own block;
    then merge the arrived blocks. Backward: post the re-gather; while it flies, each band's own
    block's gradients; then the arrived blocks', each dropped once used, whose dK/dV go home in
    a second phase, during which the whole units' gradients are computed. Saves q, k, v, out,
    lse (all local).
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
        phase, arrived = _gather_kv(ctx.bands, k, v, ctx.group)
        for _, a, b in ctx.bands:
            dq[:, a:b], dk[:, a:b], dv[:, a:b] = block_grads(
                q[:, a:b], k[:, a:b], v[:, a:b], dout[:, a:b], out[:, a:b], lse[:, a:b]
            )
        phase.wait()
        del phase  # its messages hold the arrived blocks: each is dropped once used
        home, returned = Phase(ctx.group), []
        for (band, a, b), buffers in zip(ctx.bands, arrived, strict=True):
            for j in list(buffers):
                kv = buffers.pop(j)
                dq_j, dk_j, dv_j = block_grads(
                    q[:, a:b], *kv.chunk(2, -1), dout[:, a:b], out[:, a:b], lse[:, a:b]
                )
                dq[:, a:b] += dq_j
                home.send(torch.cat([dk_j, dv_j], -1), band.ranks[j], band.frame, KV)
                shape = (k.shape[0], b - a, 2 * k.shape[2])
                returned.append((a, b, home.recv(shape, k, band.ranks[j], band.frame, KV)))
        home.start()
        whole_backward(q, k, v, dout, out, lse, ctx.whole, dq, dk, dv)
        home.wait()
        for a, b, dkv in returned:
            dk_r, dv_r = dkv.chunk(2, -1)
            dk[:, a:b] += dk_r
            dv[:, a:b] += dv_r
        return dq, dk, dv, None, None, None
