"""PaddleOCR-VL: images only (no video input, so ``videos`` is ignored); Qwen-style layout, pixel
rows of shape (C, P, P), one per patch."""

import transformers

from hf_zoo._common import QWEN_TOKENS, TEXT, instantiate, mrope, qwen_style_batch


def build():
    config = transformers.PaddleOCRVLConfig(
        vision_config=dict(
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            patch_size=14,
            image_size=56,  # a 4x4 learned position grid, resampled
            spatial_merge_size=2,
        ),
        text_config=dict(TEXT, hidden_size=96, rope_parameters=mrope()),
        **QWEN_TOKENS,
    )
    return instantiate(transformers.PaddleOCRVLForConditionalGeneration, config)


def batch(model, images, videos, seed):
    c = model.config.vision_config
    row = (c.num_channels, c.patch_size, c.patch_size)
    return qwen_style_batch(model, images, [], seed, per_frame_groups=False, row_shape=row)
