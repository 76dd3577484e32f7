"""Qwen3.5-MoE: Qwen3.5 with a mixture-of-experts text model; one ``<vs> pads <ve>`` group per
video frame."""

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
    config = transformers.Qwen3_5MoeConfig(
        vision_config=dict(VISION, num_position_embeddings=144),
        text_config=dict(
            TEXT,
            **linear_attention(),
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            rope_parameters=mrope(mrope_interleaved=True, partial_rotary_factor=1.0),
        ),
        **QWEN_TOKENS,
    )
    return instantiate(transformers.Qwen3_5MoeForConditionalGeneration, config)


def batch(model, images, videos, seed):
    return qwen_style_batch(model, images, videos, seed, per_frame_groups=True)
