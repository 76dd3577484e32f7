"""Tiny Qwen3-Omni-MoE *Thinker* (Qwen3OmniMoeThinkerForConditionalGeneration).

The full Qwen3OmniMoeForConditionalGeneration wraps thinker + talker + code2wav; the Thinker is the
smallest class that generates text and calls the vision tower (thinker.model.visual). A tiny audio
tower is built too (the Thinker always owns one) but the batch carries no audio.
"""

import torch
import transformers

MODEL_TYPE = "qwen3_omni_moe"
TOWER_ATTR = "model.visual"  # Qwen3OmniMoeVisionEncoder
IMAGE, VIDEO, VSTART, VEND = 120, 121, 122, 123
AUDIO, ASTART, AEND = 124, 125, 126


def build():
    config = transformers.Qwen3OmniMoeThinkerConfig(
        vision_config=dict(
            depth=2,
            hidden_size=64,
            intermediate_size=128,
            num_heads=4,
            out_hidden_size=64,
            num_position_embeddings=144,
            deepstack_visual_indexes=[0, 1],
        ),
        audio_config=dict(
            num_mel_bins=16,
            encoder_layers=1,
            encoder_attention_heads=2,
            encoder_ffn_dim=64,
            d_model=32,
            output_dim=64,
            n_window=4,
            max_source_positions=64,
            downsample_hidden_size=16,
            n_window_infer=8,
            conv_chunksize=8,
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
            rope_parameters={
                "rope_type": "default",
                "mrope_section": [2, 3, 3],
                "rope_theta": 10000.0,
            },
        ),
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        audio_token_id=AUDIO,
        audio_start_token_id=ASTART,
        audio_end_token_id=AEND,  # audio_end: undeclared extra
        vision_start_token_id=VSTART,
        vision_end_token_id=VEND,  # read by get_rope_index, not declared fields
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.Qwen3OmniMoeThinkerForConditionalGeneration(config).float().train()


def _pixel_width(model):
    c = model.config.vision_config
    return c.in_channels * c.temporal_patch_size * c.patch_size**2


def batch(model, images, videos, seed):
    """Omni rope index finds media by token ids (vision_start followed by image/video pad), one
    <vs> pads <ve> group per image and per whole clip; mrope is only computed when attention_mask is
    given, and videos then need video_second_per_grid. No mm_token_type_ids (not an argument)."""
    merge = model.config.vision_config.spatial_merge_size
    ids = [5, 6]
    for t, h, w in images:
        ids += [VSTART] + [IMAGE] * (t * h * w // merge**2) + [VEND, 7]
    for t, h, w in videos:
        ids += [8, VSTART] + [VIDEO] * (t * h * w // merge**2) + [VEND]
    ids += [9, 10, 11]
    out = {
        "input_ids": torch.tensor([ids]),
        "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
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
    if videos:
        out["video_second_per_grid"] = torch.ones(len(videos))
    return out
