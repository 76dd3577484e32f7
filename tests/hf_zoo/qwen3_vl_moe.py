"""Tiny Qwen3-VL-MoE (Qwen3VLMoeForConditionalGeneration)."""

import torch
import transformers

MODEL_TYPE = "qwen3_vl_moe"
TOWER_ATTR = "model.visual"  # Qwen3VLMoeVisionModel
IMAGE, VIDEO, VSTART, VEND = 120, 121, 122, 123
PER_FRAME_GROUPS = True  # a <timestamp> <vs> frame-pads <ve> group per frame


def build():
    config = transformers.Qwen3VLMoeConfig(
        vision_config=dict(
            depth=2,
            hidden_size=64,
            intermediate_size=128,
            num_heads=4,
            out_hidden_size=64,
            num_position_embeddings=144,
            deepstack_visual_indexes=[0, 1],
        ),
        text_config=dict(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            decoder_sparse_step=1,
            rope_parameters={
                "rope_type": "default",
                "mrope_section": [2, 3, 3],
                "rope_theta": 10000.0,
                "mrope_interleaved": True,
            },
        ),
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=VSTART,
        vision_end_token_id=VEND,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.Qwen3VLMoeForConditionalGeneration(config).float().train()


def _pixel_width(model):
    c = model.config.vision_config
    return c.in_channels * c.temporal_patch_size * c.patch_size**2


def batch(model, images, videos, seed):
    merge = model.config.vision_config.spatial_merge_size
    ids, types = [5, 6], [0, 0]
    for t, h, w in images:
        n = t * h * w // merge**2
        ids += [VSTART] + [IMAGE] * n + [VEND, 7]
        types += [0] + [1] * n + [0, 0]
    for t, h, w in videos:
        groups = [h * w // merge**2] * t if PER_FRAME_GROUPS else [t * h * w // merge**2]
        for n in groups:  # per-frame groups get a stand-in timestamp token (8) each
            ids += [8, VSTART] + [VIDEO] * n + [VEND]
            types += [0, 0] + [2] * n + [0]
    ids += [9, 10, 11]
    types += [0, 0, 0]
    out = {
        "input_ids": torch.tensor([ids]),
        "mm_token_type_ids": torch.tensor([types]),
        "labels": torch.tensor([ids]),
    }
    gen = torch.Generator().manual_seed(seed)
    width = _pixel_width(model)
    for grids, pk, gk in (
        (images, "pixel_values", "image_grid_thw"),
        (videos, "pixel_values_videos", "video_grid_thw"),
    ):
        if grids:
            rows = sum(t * h * w for t, h, w in grids)
            out[pk] = torch.randn(rows, width, generator=gen)
            out[gk] = torch.tensor([list(g) for g in grids])
    return out
