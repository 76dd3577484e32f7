"""Qwen4-Exp: a hybrid MoE text model with hyper-connections and indexed (sparse) attention;
Qwen-style layout, one ``<vs> pads <ve>`` group per video frame."""

import transformers

from hf_zoo._common import (
    QWEN_TOKENS,
    TEXT,
    VISION,
    instantiate,
    linear_attention,
    mrope,
    qwen_style_batch,
)


def build():
    config = transformers.Qwen4ExpConfig(
        vision_config=dict(VISION, num_position_embeddings=144),
        text_config=dict(
            TEXT,
            **linear_attention("indexed_attention"),
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            hc_count=2,  # hyper-connections need at least 2 streams
            hc_lowrank=8,
            # indexed_attention, the only full-attention type, needs the indexer's fields
            indexer_n_heads=2,
            indexer_kv_heads=1,
            indexer_head_dim=16,
            indexer_budget=16,
            indexer_compress_ratio=4,
            rope_parameters=mrope(mrope_interleaved=True, partial_rotary_factor=1.0),
        ),
        **QWEN_TOKENS,
    )
    return instantiate(transformers.Qwen4ExpForConditionalGeneration, config)


def batch(model, images, videos, seed):
    return qwen_style_batch(model, images, videos, seed, per_frame_groups=True)
