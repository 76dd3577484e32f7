"""Attention of the reference models (``fx_vitbal.tools.models``, ``fx_vitbal.tools.omni``),
with the same math on every path: eagerly one ``scaled_dot_product_attention`` per segment (a
frame's cost grows with its own tokens squared, which the benchmarks rely on); under
``torch.compile`` one dense attention under a block-diagonal mask built from tensor ops only (so
the towers trace with ``fullgraph=True`` and unbacked row counts); and, on a step with bands, over
the keys and values ``Bands.gather`` brings (a band's: its whole frame's).
"""

import torch
import torch.nn.functional as F
from torch import Tensor

# Attention segments are either a list of row counts (eager: one attention call per segment) or a
# boolean [N, N] block-diagonal mask (compiling: one dense call, no data-dependent Python).
Segments = list[int] | Tensor


def segments_of(ids: Tensor) -> Segments:
    """Segments from per-row segment ids, where each segment is one contiguous run of equal ids."""
    if torch.compiler.is_compiling():
        return ids[:, None] == ids[None, :]
    return torch.unique_consecutive(ids, return_counts=True)[1].tolist()


def masked_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """Attention of ``[heads, N, head_dim]`` tensors under a boolean ``mask``, written out: torch
    2.14's ``scaled_dot_product_attention`` cannot be traced by dynamo with an unbacked ``N``
    (it guards on ``N == 0``), and the same graph on every torch keeps snapshots stable."""
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v


def attend(q: Tensor, k: Tensor, v: Tensor, segments: Segments) -> Tensor:
    """Attention of ``[heads, N, head_dim]`` tensors restricted to ``segments``."""
    if isinstance(segments, Tensor):
        return masked_attention(q, k, v, segments)
    if not segments:
        # Empty batch: a zero-row attention keeps the parameters in the autograd graph.
        return F.scaled_dot_product_attention(q, k, v)
    parts = zip(q.split(segments, 1), k.split(segments, 1), v.split(segments, 1), strict=True)
    # 4-D inputs: CUDA then runs a flash / memory-efficient kernel; with 3-D ones it falls back
    # to the math kernel, which stores every [N, N] score matrix (OOM at Qwen2-VL sizes).
    return torch.cat([sdpa_4d(*qkv) for qkv in parts], 1)


def sdpa_4d(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    return F.scaled_dot_product_attention(q[None], k[None], v[None])[0]
