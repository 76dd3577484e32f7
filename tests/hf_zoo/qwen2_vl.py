"""Qwen2-VL: Qwen-style layout, one ``<vs> pads <ve>`` group per video clip."""

import transformers

from hf_zoo._common import QWEN_TOKENS, TEXT, instantiate, mrope, qwen_style_batch


def build():
    config = transformers.Qwen2VLConfig(
        vision_config=dict(depth=2, embed_dim=64, hidden_size=64, num_heads=4, mlp_ratio=2),
        text_config=dict(TEXT, rope_parameters=mrope()),
        **QWEN_TOKENS,
    )
    return instantiate(transformers.Qwen2VLForConditionalGeneration, config)


def batch(model, images, videos, seed):
    return qwen_style_batch(model, images, videos, seed, per_frame_groups=False)
