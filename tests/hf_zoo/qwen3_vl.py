"""Qwen3-VL: a deepstack tower; Qwen-style layout, one ``<vs> pads <ve>`` group per video frame."""

import transformers

from hf_zoo._common import QWEN_TOKENS, TEXT, VISION, instantiate, mrope, qwen_style_batch


def build():
    config = transformers.Qwen3VLConfig(
        vision_config=dict(VISION, num_position_embeddings=144, deepstack_visual_indexes=[0, 1]),
        text_config=dict(TEXT, rope_parameters=mrope(mrope_interleaved=True)),
        **QWEN_TOKENS,
    )
    return instantiate(transformers.Qwen3VLForConditionalGeneration, config)


def batch(model, images, videos, seed):
    return qwen_style_batch(model, images, videos, seed, per_frame_groups=True)
