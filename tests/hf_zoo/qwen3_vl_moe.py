"""Qwen3-VL-MoE: Qwen3-VL with a mixture-of-experts text model; one ``<vs> pads <ve>`` group per
video frame."""

import transformers

from hf_zoo._common import QWEN_TOKENS, TEXT, VISION, instantiate, mrope, qwen_style_batch


def build():
    config = transformers.Qwen3VLMoeConfig(
        vision_config=dict(VISION, num_position_embeddings=144, deepstack_visual_indexes=[0, 1]),
        text_config=dict(
            TEXT,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            decoder_sparse_step=1,
            rope_parameters=mrope(mrope_interleaved=True),
        ),
        **QWEN_TOKENS,
    )
    return instantiate(transformers.Qwen3VLMoeForConditionalGeneration, config)


def batch(model, images, videos, seed):
    return qwen_style_batch(model, images, videos, seed, per_frame_groups=True)
