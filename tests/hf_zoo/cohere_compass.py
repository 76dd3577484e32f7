"""Cohere Compass: a Qwen3-VL tower copy and rope per layer type; Qwen-style layout, one
``<vs> pads <ve>`` group per video frame."""

import transformers

from hf_zoo._common import QWEN_TOKENS, TEXT, VISION, instantiate, qwen_style_batch


def build():
    config = transformers.CohereCompassConfig(
        vision_config=dict(VISION, num_position_embeddings=144, deepstack_visual_indexes=[0, 1]),
        text_config=dict(
            TEXT,  # head_dim is hidden_size // num_attention_heads = 16 whatever is given
            layer_types=["full_attention", "full_attention"],
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
            # M-RoPE is applied interleaved (t, h, w every third frequency)
            rope_parameters={
                "full_attention": {
                    "rope_type": "default",
                    "rope_theta": 10000.0,
                    "mrope_section": [2, 3, 3],
                }
            },
        ),
        **QWEN_TOKENS,
    )
    return instantiate(transformers.CohereCompassForConditionalGeneration, config)


def batch(model, images, videos, seed):
    return qwen_style_batch(model, images, videos, seed, per_frame_groups=True)
