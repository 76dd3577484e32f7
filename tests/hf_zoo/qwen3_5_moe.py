"""Qwen3.5-MoE: Qwen3.5 with a mixture-of-experts text model; one ``<vs> pads <ve>`` group per
video frame."""

import transformers

from hf_zoo._common import qwen_style_batch
from hf_zoo.qwen3_5 import MOE, build_variant


def build():
    return build_variant(
        transformers.Qwen3_5MoeConfig, transformers.Qwen3_5MoeForConditionalGeneration, **MOE
    )


def batch(model, images, videos, seed):
    return qwen_style_batch(model, images, videos, seed, per_frame_groups=True)
