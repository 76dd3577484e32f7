"""Cosmos3-Omni's reasoner: Qwen3-VL's tower and text model (built from their sub-configs);
Qwen-style layout, one ``<vs> pads <ve>`` group per video frame."""

import transformers

from hf_zoo._common import QWEN_TOKENS, TEXT, VISION, instantiate, mrope, qwen_style_batch


def build():
    config = transformers.Cosmos3OmniConfig(
        vision_config=dict(
            VISION,
            model_type="qwen3_vl_vision",
            out_hidden_size=96,
            num_position_embeddings=144,
            deepstack_visual_indexes=[0, 1],
        ),
        text_config=dict(
            TEXT,
            model_type="qwen3_vl_text",
            hidden_size=96,
            rope_parameters=mrope(mrope_interleaved=True),
        ),
        **QWEN_TOKENS,
    )
    return instantiate(transformers.Cosmos3OmniForConditionalGeneration, config)


def batch(model, images, videos, seed):
    return qwen_style_batch(model, images, videos, seed, per_frame_groups=True)
