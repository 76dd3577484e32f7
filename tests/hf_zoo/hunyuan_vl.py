"""HunYuanVL: its merger adds a newline row per line and begin/end rows per image, so it is
refused."""

import transformers

from hf_zoo._common import IMAGE, TEXT, VEND, VSTART, instantiate


def build():
    config = transformers.HunYuanVLConfig(
        vision_config=dict(
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_hidden_layers=2,
            patch_size=16,
            spatial_merge_size=2,
            max_image_size=256,  # a 16x16 learned position grid
        ),
        text_config=dict(
            TEXT,
            hidden_size=96,
            # 4 axes (text position, width, height, image index); half-head sections sum to 8
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [2, 2, 2, 2],
            },
        ),
        image_token_id=IMAGE,
        im_start_id=VSTART,
        im_end_id=VEND,
        im_newline_id=124,
    )
    return instantiate(transformers.HunYuanVLForConditionalGeneration, config)
