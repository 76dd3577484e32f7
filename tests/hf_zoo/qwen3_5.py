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


def build():
    config = transformers.Qwen3_5Config(
        vision_config=dict(VISION, num_position_embeddings=144),
        text_config=dict(
            TEXT,
            **linear_attention(),
            rope_parameters=mrope(mrope_interleaved=True, partial_rotary_factor=1.0),
        ),
        **QWEN_TOKENS,
    )
    return instantiate(transformers.Qwen3_5ForConditionalGeneration, config)


def batch(model, images, videos, seed):
    return qwen_style_batch(model, images, videos, seed, per_frame_groups=True)
