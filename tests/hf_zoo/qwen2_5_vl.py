"""Qwen2.5-VL: a window-attention tower; Qwen-style layout, one ``<vs> pads <ve>`` group per
video clip."""

import transformers

from hf_zoo._common import QWEN_TOKENS, TEXT, VISION, instantiate, mrope, qwen_style_batch


def build():
    config = transformers.Qwen2_5_VLConfig(
        # layer 0 attends in windows of 8x8 patches, layer 1 over the whole frame
        vision_config=dict(VISION, fullatt_block_indexes=[1], window_size=112),
        text_config=dict(TEXT, rope_parameters=mrope()),
        **QWEN_TOKENS,
    )
    return instantiate(transformers.Qwen2_5_VLForConditionalGeneration, config)


def batch(model, images, videos, seed):
    return qwen_style_batch(model, images, videos, seed, per_frame_groups=False)
