"""ERNIE-4.5-VL-MoE: no temporal patch (a pixel row is one frame's patch) but a temporal merge of
2 in the tower; separate image and video start/end ids, and ``moe_mm_token_type_ids`` that count
the start/end markers as vision for the MoE. One group per clip."""

import torch
import transformers

from hf_zoo._common import IMAGE, TEXT, VEND, VIDEO, VSTART, add_pixels, instantiate, mrope

VID_START, VID_END = 124, 125


def build():
    config = transformers.Ernie4_5_VLMoeConfig(
        vision_config=dict(
            depth=2,
            hidden_size=64,
            intermediate_size=128,
            num_heads=4,
            patch_size=14,
            spatial_merge_size=2,
            temporal_merge_size=2,
        ),
        text_config=dict(
            TEXT,
            hidden_size=96,
            mlp_layer_types=["dense", "sparse"],
            moe_num_experts=4,
            moe_k=2,
            moe_intermediate_size=[32, 32],
            moe_num_shared_experts=1,
            rope_parameters=mrope(mrope_section=[3, 3, 2]),
        ),
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        image_start_token_id=VSTART,
        image_end_token_id=VEND,
        video_start_token_id=VID_START,
        video_end_token_id=VID_END,
    )
    return instantiate(transformers.Ernie4_5_VLMoeForConditionalGeneration, config)


def batch(model, images, videos, seed):
    c = model.config.vision_config
    merge, tmerge = c.spatial_merge_size, c.temporal_merge_size
    ids, types, moe_types = [5, 6], [0, 0], [0, 0]
    for t, h, w in images:
        n = t * h * w // merge**2
        ids += [VSTART] + [IMAGE] * n + [VEND, 7]
        types += [0] + [1] * n + [0, 0]
        moe_types += [1] + [1] * n + [1, 0]
    for t, h, w in videos:
        n = t * h * w // merge**2 // tmerge
        ids += [8, VID_START] + [VIDEO] * n + [VID_END]
        types += [0, 0] + [2] * n + [0]
        moe_types += [0, 2] + [2] * n + [2]
    ids += [9, 10, 11]
    types += [0, 0, 0]
    moe_types += [0, 0, 0]
    out = {
        "input_ids": torch.tensor([ids]),
        "mm_token_type_ids": torch.tensor([types]),
        "moe_mm_token_type_ids": torch.tensor([moe_types]),
        "labels": torch.tensor([ids]),
    }
    return add_pixels(out, images, videos, seed, (c.in_channels * c.patch_size**2,))
