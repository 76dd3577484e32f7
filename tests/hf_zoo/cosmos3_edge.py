"""Cosmos3-Edge: a SigLIP2-style tower with a learned position grid resized per frame and no
temporal patch (a pixel row is one frame's patch); one ``<vs> pads <ve>`` group per video frame."""

import transformers

from hf_zoo._common import QWEN_TOKENS, TEXT, instantiate, mrope, qwen_style_batch


def build():
    config = transformers.Cosmos3EdgeConfig(
        vision_config=dict(
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            patch_size=16,
            num_patches=16,  # a 4x4 learned position grid
            spatial_merge_size=2,
        ),
        text_config=dict(TEXT, hidden_size=96, rope_parameters=mrope()),
        projector_hidden_size=128,
        **QWEN_TOKENS,
    )
    return instantiate(transformers.Cosmos3EdgeForConditionalGeneration, config)


def batch(model, images, videos, seed):
    c = model.config.vision_config
    width = c.num_channels * c.patch_size**2
    return qwen_style_batch(model, images, videos, seed, per_frame_groups=True, row_shape=(width,))
