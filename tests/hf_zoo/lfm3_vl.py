"""LFM3-VL: conv and attention layers in both tower and text model, 1-D text positions (no
mm_token_type_ids); Qwen-style layout, one ``<vs> pads <ve>`` group per video frame."""

import transformers

from hf_zoo._common import QWEN_TOKENS, TEXT, instantiate, qwen_style_batch


def build():
    config = transformers.Lfm3VlConfig(
        vision_config=dict(
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            layer_types=["conv", "full_attention"],
        ),
        text_config=dict(
            TEXT,
            model_type="lfm3",
            hidden_size=96,
            layer_types=["conv", "full_attention"],
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
        projector_hidden_size=128,
        **QWEN_TOKENS,
    )
    return instantiate(transformers.Lfm3VlForConditionalGeneration, config)


def batch(model, images, videos, seed):
    return qwen_style_batch(model, images, videos, seed, per_frame_groups=True, token_types=False)
