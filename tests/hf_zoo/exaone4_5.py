"""EXAONE 4.5: a Qwen2.5-VL-style window-attention tower with grouped KV heads and an EXAONE 4
text model with 1-D positions (no mm_token_type_ids); one ``<vs> pads <ve>`` group per clip."""

import transformers

from hf_zoo._common import IMAGE, TEXT, VIDEO, VISION, instantiate, qwen_style_batch


def build():
    config = transformers.Exaone4_5_Config(
        vision_config=dict(
            VISION, num_key_value_heads=2, fullatt_block_indexes=[1], window_size=112
        ),
        text_config=dict(
            TEXT,
            model_type="exaone4",
            sliding_window=None,
            layer_types=["full_attention", "full_attention"],
        ),
        image_token_id=IMAGE,
        video_token_id=VIDEO,
    )
    return instantiate(transformers.Exaone4_5_ForConditionalGeneration, config)


def batch(model, images, videos, seed):
    return qwen_style_batch(model, images, videos, seed, per_frame_groups=False, token_types=False)
