"""Attention over whole frames whose row bands lie on different ranks (``Bands.attention``), with
traffic only among each frame's own band ranks and autograd memory that falls as 1/k.

A rank computes some local units in batch order; their rows are concatenated in ``q``, ``k``,
``v`` (``[heads, rows, head_dim]``). A whole unit attends over its own rows. A band of a frame
cut into k bands on k ranks attends over the whole frame's rows, of which it holds 1/k. Its
frame's ``kind`` (``BalanceConfig.band_exchange``, chosen per frame by the plan) brings it the
rest:

- ``gather``: every band rank receives the other bands' keys and values (point to point, one
  phase), attends, drops them; its backward fetches them again one block a step from each
  block's owner and sends each block's dK/dV home a step later (never the whole frame's).
- ``ring``: key/value blocks travel round the frame's ring in k-1 steps, merged by an online
  softmax, the next block's messages posted before the current block is computed; the backward
  sends them round again with their dK/dV accumulators (FlashAttention-2 / ring attention).
- ``ulysses``: an all-to-all of heads: each rank attends over all of the frame's rows for
  heads/k of the heads, then the outputs go back (heads that do not divide among the frame's
  ranks: ``ring``, by rule, on every rank of the frame alike).
- ``usp``: ``ulysses`` inside each group of ``FrameBand.node_bands`` consecutive bands (a node's,
  as the plan places them), ``ring`` across the groups on the head-sliced rows: the heads need
  divide among a group only, and what crosses nodes is a ring of 1/u of the keys and values
  (fewer than two groups of two bands, or heads a group does not divide: ``ring``, by rule).

Each kind has its module: ``bands.gather``, ``bands.ring``, ``bands.heads`` (``ulysses`` and
``usp``). Messages: [Note: one batch per phase] in ``bands.p2p``. Kinds run in a fixed order
(gather, ring, ulysses, usp), so a rank in frames of two kinds meets each frame's ranks in the
same order.

[Note: what autograd keeps] Each kind is one ``torch.autograd.Function`` whose forward runs
without autograd, so the only tensors kept for the backward are those it saves: the local q, k,
v, out and the logsumexp for ``gather`` and ``ring`` (remote keys and values are fetched again
by the backward), and for ``ulysses`` the head-sliced frame tensors of its heads (``N * H/k``
rows each, one band's size when bands are equal) plus its whole units' own rows; ``usp`` the
same of its group's rows (``N_g * H/u``, again one band's size).
"""

import torch

from fx_vitbal.runtime.bands.blocks import KINDS, AttentionLayout, FrameBand
from fx_vitbal.runtime.bands.gather import Gather
from fx_vitbal.runtime.bands.heads import Ulysses, Usp
from fx_vitbal.runtime.bands.ring import Ring


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
    out = None
    for _, function, whole, chosen in kind_calls(layout, q.shape[0]):
        part = function.apply(q, k, v, whole, chosen, group)
        out = part if out is None else out + part  # each fills its own rows, zeros elsewhere
    return out


def kind_calls(layout: AttentionLayout, heads: int) -> list[tuple[str, type, list, list]]:
    """``(kind, its autograd Function, whole spans, bands)`` per kind that runs, in ``KINDS``
    order (the first also computes the whole units; ``gather`` alone when no band exchanges)."""
    whole, bands = layout.split()
    by_kind = {kind: [] for kind in KINDS}
    for band, a, b in bands:
        by_kind[runs(band, heads)].append((band, a, b))
    calls = [(kind, chosen) for kind, chosen in by_kind.items() if chosen] or [("gather", [])]
    functions = {"gather": Gather, "ring": Ring, "ulysses": Ulysses, "usp": Usp}
    return [
        (kind, functions[kind], whole if n == 0 else [], chosen)
        for n, (kind, chosen) in enumerate(calls)
    ]


def runs(band: FrameBand, heads: int) -> str:
    """The kind ``band``'s frame runs: its planned kind, or ``ring`` by rule where the heads do
    not divide as it needs (``ulysses``: among the frame's bands; ``usp``: among a group's, with
    at least two groups of at least two bands). Every rank of the frame decides alike."""
    if band.kind == "ulysses" and heads % band.num_bands:
        return "ring"
    if band.kind == "usp":
        u = band.node_bands
        if u < 2 or band.num_bands // u < 2 or heads % u:
            return "ring"
    return band.kind
