"""MiniCPM-OCR: its tower takes no ``grid_thw`` but a ``(1, C, p, N*p)`` strip of patches (images
joined along its width, each in raster order, as the processor's ``reshape_by_patch`` lays them)
and ``(h, w)`` target sizes, one per image or video frame; "4x" mode by default (a row per
patch), MiniCPM-V 4.6 and 4.7 "16x" (a 2x2 merge inside the tower). They share its tower and
build and batch through this module."""

import torch
import transformers

from hf_zoo._common import (
    IMAGE,
    TEXT,
    VEND,
    VIDEO,
    VSTART,
    _sample,
    add_pixels,
    instantiate,
    linear_attention,
    mrope,
)


def build(config_cls="MiniCPMOcrConfig", model_cls="MiniCPMOcrForConditionalGeneration", **extra):
    config = getattr(transformers, config_cls)(
        text_config=dict(
            TEXT,
            hidden_size=96,
            **linear_attention(),
            rope_parameters=mrope(mrope_interleaved=True, partial_rotary_factor=1.0),
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
        vision_config=dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            patch_size=14,
            image_size=224,  # 16x16 learned positions
        ),
        insert_layer_id=0,  # the window-attention merger after layer 0 of 2 ("16x" mode)
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        **extra,
    )
    return instantiate(getattr(transformers, model_cls), config)


def strip(rows: torch.Tensor, channels: int, patch: int) -> torch.Tensor:
    """Rows of ``C*p*p`` (channel, row, column) as the ``(1, C, p, N*p)`` strip, patch ``n`` in
    columns ``[n*p, (n+1)*p)``."""
    n = rows.shape[0]
    return (
        rows.reshape(n, channels, patch, patch).permute(1, 2, 0, 3).reshape(1, channels, patch, -1)
    )


def batch(model, images, videos, seed, markers=False):
    """``markers``: each image and frame as ``<start> pads <end>`` with ``mm_token_type_ids``
    (MiniCPM-V 4.7's canvas M-RoPE needs them); else the pads alone."""
    vc, per = model.config.vision_config, 4 if model.config.downsample_mode == "4x" else 16
    ids, types = [5, 6], [0, 0]
    for token, kind, grids in ((IMAGE, 1, images), (VIDEO, 2, videos)):
        for t, h, w in grids:
            for _ in range(t):  # one group per frame, frames back to back
                pads = [token] * (h * w // per)
                ids += [VSTART, *pads, VEND] if markers else pads
                types += [0, *[kind] * len(pads), 0] if markers else [kind] * len(pads)
            ids += [7]
            types += [0]
    ids += [9, 10, 11]
    types += [0, 0, 0]
    out = add_pixels(_sample(ids, types if markers else None), images, videos, seed, (3 * 14 * 14,))
    for pixels, grid, sizes in (
        ("pixel_values", "image_grid_thw", "target_sizes"),
        ("pixel_values_videos", "video_grid_thw", "target_sizes_videos"),
    ):
        if pixels in out:
            out[pixels] = strip(out[pixels], vc.num_channels, vc.patch_size)
            thw = out.pop(grid)
            out[sizes] = thw[:, 1:].repeat_interleave(thw[:, 0], 0).int()
    return out
