"""LLaVA-OneVision-1.5 (transformers 5.25): a RiceViT tower (one pixel row per patch, no
temporal patch; each frame attends to itself with its own class row; the projector runs in the
tower, as ``pooler_output``) and a Qwen3 text model with 1-D positions."""

import transformers

from hf_zoo._common import QWEN_TOKENS, TEXT, VISION, instantiate, qwen_style_batch


def build():
    config = transformers.LlavaOnevision15Config(
        vision_config=dict(VISION), text_config=dict(TEXT), **QWEN_TOKENS
    )
    return instantiate(transformers.LlavaOnevision15ForConditionalGeneration, config)


def batch(model, images, videos, seed):
    vc = model.config.vision_config
    return qwen_style_batch(
        model,
        images,
        videos,
        seed,
        per_frame_groups=False,
        token_types=False,
        row_shape=(vc.in_channels * vc.patch_size**2,),
    )
