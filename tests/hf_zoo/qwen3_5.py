"""Qwen3.5: a hybrid text model (linear, then full attention); Qwen-style layout, one
``<vs> pads <ve>`` group per video frame."""

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

# The MoE text fields the Qwen3.5-MoE and Qwen4-Exp variants share.
MOE = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
)


def build():
    return build_variant(transformers.Qwen3_5Config, transformers.Qwen3_5ForConditionalGeneration)


def build_variant(config_cls, model_cls, layer="full_attention", **text):
    """A Qwen3.5-line model: its tower and hybrid text model, with ``text`` added to the latter."""
    config = config_cls(
        vision_config=dict(VISION, num_position_embeddings=144),
        text_config=dict(
            TEXT,
            **linear_attention(layer),
            **text,
            rope_parameters=mrope(mrope_interleaved=True, partial_rotary_factor=1.0),
        ),
        **QWEN_TOKENS,
    )
    return instantiate(model_cls, config)


def batch(model, images, videos, seed):
    return qwen_style_batch(model, images, videos, seed, per_frame_groups=True)
