"""Row bands of a frame in Hugging Face towers, through transformers' own seams: the grid-derived
tensors a tower takes precomputed through its kwargs (``transformers/vision_utils.py``), and
the attention function it looks up by name (``ALL_ATTENTION_FUNCTIONS``).

A tower whose rule names a band recipe (``HFTowerRule.bands``) gets, when balanced with
``split_images``, the attention implementation ``vitbal_flash`` on its vision config (set on the
config's attribute: ``set_attn_implementation`` would look for a hub kernel). A name with
"flash" makes each attention layer call it once, with the whole batch and its
``cu_seq_lens_q/k``; it computes exactly what the tower's own implementation (kept on each
attention module) computes, segment by segment or in one varlen call, so a step without bands
is unchanged. On a step with bands (``fx_vitbal.runtime.bands.view``) the tower is called with the
band recipe's kwargs: positions (and Qwen3-VL's interpolated position embedding) of each band's
whole frame, sliced to its rows; segments, windows (Qwen2.5-VL: a band starts at a whole window)
and lengths of the balanced batch; GLM-4V's per-segment image shapes of the whole frame; and
``vitbal_bands``, which the attention function of every full-attention layer uses to gather the
frame's keys and values. Everything is made on the host from the plan and copied without
waiting, so the tower reads nothing back either.
"""

import itertools
import math

import torch
from torch import nn

from fx_vitbal.runtime.bands.view import Bands
from fx_vitbal.runtime.transport import transfer

ATTENTION = "vitbal_flash"
RECIPES = ("qwen2", "qwen2_5", "qwen3", "glm")


def band_support(tower: nn.Module, recipe: str, width: int) -> tuple[int, int, int, bool, int]:
    """``(align rows, exchanging layers, key width, compiled, heads)`` of a tower with
    ``recipe`` (``BandSupport.of``): Qwen2.5-VL's bands start at whole windows and exchange in
    its full-attention blocks only; compiled calls of these towers plan whole frames (their
    positions and segments are read on the host)."""
    merge = tower.spatial_merge_size
    if recipe == "qwen2_5":
        window_rows = tower.window_size // tower.patch_size
        heads = tower.config.num_heads
        return math.lcm(merge, window_rows), len(tower.fullatt_block_indexes), width, False, heads
    return merge, len(tower.blocks), width, False, tower.config.num_heads


def install(tower: nn.Module, recipe: str) -> None:
    """Route ``tower``'s attention through ``band_attention`` (module doc), keeping its own
    implementation on each attention module. Idempotent."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, band_attention)
    config = tower.config
    original = getattr(tower, "_vitbal_attention", config._attn_implementation)
    full = set(tower.fullatt_block_indexes) if recipe == "qwen2_5" else None
    for i, block in enumerate(tower.blocks):
        block.attn._vitbal_attention = original  # plain attributes: not in the state_dict
        block.attn._vitbal_exchanges = full is None or i in full
    tower._vitbal_attention = original
    config._attn_implementation = ATTENTION


def band_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask=None,
    scaling: float | None = None,
    dropout: float = 0.0,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: int | None = None,
    max_length_k: int | None = None,
    is_causal: bool = False,
    vitbal_bands: Bands | None = None,
    vitbal_lengths: list[tuple[int, int]] | None = None,
    vitbal_window_lengths: list[int] | None = None,
    **kwargs,
):
    """The attention of one vision layer over ``[1, heads, S, head_dim]`` tensors packed by
    ``cu_seq_lens_q`` (transformers' varlen convention), returning ``([1, S, heads, head_dim],
    None)``: the tower's own implementation, per segment or in one varlen call; in a layer
    attending over whole frames on a step with bands, the library's (``Bands.attention``: a
    band's queries over its whole frame, by the exchange its plan chose). ``vitbal_lengths``
    (per segment, query and key rows) and ``vitbal_window_lengths`` come with the bands, from
    the host; without them the segment lengths are read from ``cu_seq_lens_q``, as the tower's
    own non-flash path reads them."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.qwen2_vl.modeling_qwen2_vl import eager_attention_forward

    name = module._vitbal_attention
    original = ALL_ATTENTION_FUNCTIONS.get_interface(name, eager_attention_forward)
    if vitbal_bands is not None and module._vitbal_exchanges:  # the library attends
        scale = query.shape[-1] ** -0.5
        if scaling is not None and abs(scaling - scale) > 1e-12 * scale:
            query = query * (scaling / scale)  # (Bands.attention scales by head_dim ** -0.5)
        groups = query.shape[1] // key.shape[1]  # grouped-query attention (EXAONE-4.5)
        if groups > 1:  # each key/value head serves ``groups`` query heads, as repeat_kv does
            key, value = (x.repeat_interleave(groups, dim=1) for x in (key, value))
        out = vitbal_bands.attention(query[0], key[0], value[0])  # [heads, S, head_dim]
        return out.transpose(0, 1)[None].contiguous(), None
    if vitbal_lengths is not None:  # lengths from the host: a balanced call
        queries = vitbal_window_lengths if not module._vitbal_exchanges else None
        queries = queries or [q for q, _ in vitbal_lengths]
        keys = queries
    else:
        queries = keys = (cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]).tolist()
    common = dict(attention_mask=None, scaling=scaling, dropout=dropout, is_causal=False)
    if "flash" in name:  # one varlen call, as the tower makes it
        cu_q, cu_k = _cumulative(queries, query.device), _cumulative(keys, query.device)
        out, _ = original(
            module,
            query,
            key,
            value,
            cu_seq_lens_q=cu_q,
            cu_seq_lens_k=cu_k,
            max_length_q=max(queries),
            max_length_k=max(keys),
            **common,
            **kwargs,
        )
        return out, None
    # Indexed, not zipped: Dynamo 2.8 cannot rebuild a zip(strict=True) live at a graph break.
    qs, ks, vs = query.split(queries, 2), key.split(keys, 2), value.split(keys, 2)
    outs = [original(module, qs[i], ks[i], vs[i], **common, **kwargs)[0] for i in range(len(qs))]
    return torch.cat(outs, 1), None


def band_kwargs(tower: nn.Module, recipe: str, bands: Bands, device: torch.device) -> dict:
    """The tower's kwargs for a balanced batch (module doc), bands or not, all made on the host
    from ``bands`` and copied to ``device`` without waiting, so the tower reads no grid back;
    ``grid_thw`` among them for GLM-4V (its position embedding reads each segment's image
    shape: the whole frame's)."""
    from transformers import vision_utils

    merge = tower.spatial_merge_size
    units = bands.units
    frames = torch.tensor([[u.frames, u.full_rows, u.width] for u in units], device="cpu")
    batch = torch.tensor([[u.frames, u.rows, u.width] for u in units], device="cpu")
    # Each unit's patches among its whole frames' (a band: its rows of its frame's).
    keep, start = [], 0
    for u in units:
        first = start + u.first_row * u.width
        keep.append(torch.arange(first, first + u.frames * u.rows * u.width))
        start += u.frames * u.full_rows * u.width
    keep = torch.cat(keep)
    lengths = [(u.rows * u.width, u.full_rows * u.width) for u in units for _ in range(u.frames)]
    queries = [q for q, _ in lengths]
    host = {
        "position_ids": vision_utils.get_vision_position_ids(frames, merge)[keep],
        "cu_seqlens": _cumulative(queries),
    }
    made = {"max_seqlen": max(queries), "vitbal_lengths": lengths}
    if bands.split:
        made["vitbal_bands"] = bands
    if recipe == "qwen2_5":  # windows of the batch as it is: a band starts at a whole window
        window_index, cu_windows = vision_utils.get_vision_window_index(
            batch, merge, tower.window_size, tower.patch_size
        )
        windows = (cu_windows[1:] - cu_windows[:-1]).tolist()
        host |= {"window_index": window_index, "cu_window_seqlens": cu_windows}
        made |= {"max_window_seqlen": max(windows), "vitbal_window_lengths": windows}
    if recipe == "qwen3":  # the learned table interpolated to the whole frame
        indices, weights = vision_utils.get_vision_interpolation_indices_and_weights(
            frames,
            num_grid_per_side=tower.num_grid_per_side,
            mode=tower.interpolation_mode,
            align_corners=tower.interpolation_align_corners,
            spatial_merge_size=tower.config.spatial_merge_size,
        )
        host |= {"interp_indices": indices[keep], "interp_weights": weights[keep]}
    if recipe == "glm":
        host["grid_thw"] = frames
    return made | {name: transfer.to_device(t, device) for name, t in host.items()}


def _cumulative(lengths: list[int], device: torch.device | None = None) -> torch.Tensor:
    values = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cpu")
    return values if device is None else transfer.to_device(values, device)
