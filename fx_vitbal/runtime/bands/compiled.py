"""``Bands.attention`` in the tensor form (a compiled tower): each split frame's planned exchange
(``bands.kinds``) run inside two custom ops, ``vitbal::band_attention`` and its backward, so a
compiled tower gets the kinds, the traffic among a frame's ranks only, and the saved bytes of
an eager one.

A graph cannot hold the plan's Python layout, so the ops take it packed
(``AttentionLayout.to_tensor``, made by ``vitbal::band_tables`` from the call's host state): a
backward then runs whenever it runs, its call's state kept or not (two micro-batches' forwards
before their backwards). Each kind's ``torch.autograd.Function`` is run by hand with a plain
context: the forward op returns its output and logsumexp, which the compiled graph saves
beside q, k, v. The backward op hands ``gather`` and ``ring`` those (what their backwards
read); ``ulysses`` and ``usp`` keep head-sliced rows that cannot ride in a graph, so for them
it runs the forward again (its all-to-all and attention: one more forward of that layer's
attention, as checkpointing it would) and then the backward.
"""

import torch

from fx_vitbal._compat import CUDAGRAPH_UNSAFE
from fx_vitbal.runtime.bands.blocks import AttentionLayout
from fx_vitbal.runtime.bands.kinds import kind_calls
from fx_vitbal.runtime.transport.collectives import resolve_group

RERUN = ("ulysses", "usp")  # kinds whose backward reads what only their forward makes


class _Context:
    """What an autograd Function's forward and backward read and write of ``ctx``."""

    def save_for_backward(self, *tensors: torch.Tensor) -> None:
        self.saved_tensors = tensors


@torch.library.custom_op("vitbal::band_attention", mutates_args=(), tags=CUDAGRAPH_UNSAFE)
def band_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attending: torch.Tensor,
    group_name: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, logsumexp)`` of every local unit's attention over its frame (``Bands.attention``);
    ``q``, ``k``, ``v`` ``[heads, rows, head_dim]``, ``attending`` the packed layout."""
    layout = AttentionLayout.from_tensor(attending)
    out, lse = torch.zeros_like(q), q.new_zeros(q.shape[:-1])
    for kind, function, whole, chosen in kind_calls(layout, q.shape[0]):
        ctx = _Context()
        out += function.forward(ctx, q, k, v, whole, chosen, resolve_group(group_name))
        if kind not in RERUN:  # gather and ring saved (q, k, v, out, lse) of their rows
            lse += ctx.saved_tensors[4]
    return out, lse


@band_attention.register_fake
def _(q, k, v, attending, group_name):
    return torch.empty_like(q), q.new_empty(q.shape[:-1])


@torch.library.custom_op("vitbal::band_attention_backward", mutates_args=(), tags=CUDAGRAPH_UNSAFE)
def band_attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    attending: torch.Tensor,
    group_name: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of ``vitbal::band_attention`` (module doc)."""
    layout = AttentionLayout.from_tensor(attending)
    group = resolve_group(group_name)
    grads = [torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)]
    for kind, function, whole, chosen in kind_calls(layout, q.shape[0]):
        ctx = _Context()
        if kind in RERUN:
            function.forward(ctx, q, k, v, whole, chosen, group)
        else:
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.whole, ctx.bands, ctx.group = whole, chosen, group
        for total, part in zip(grads, function.backward(ctx, dout)[:3], strict=True):
            total += part  # each fills its own rows, zeros elsewhere
    return tuple(grads)


@band_attention_backward.register_fake
def _(dout, q, k, v, out, lse, attending, group_name):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output):
    q, k, v, attending, group_name = inputs
    ctx.save_for_backward(q, k, v, *output, attending)
    ctx.group_name = group_name


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, attending = ctx.saved_tensors
    grads = band_attention_backward(dout, q, k, v, out, lse, attending, ctx.group_name)
    return *grads, None, None


band_attention.register_autograd(_backward, setup_context=_setup)
