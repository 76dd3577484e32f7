"""HunYuanVL: a tower for images only whose merger adds a newline row after each line of merged
patches and begin/end rows (``h/2 * (w/2 + 1) + 2`` output rows per image); the parent's
placeholder spans hold exactly those rows, typed 1 for its multimodal RoPE."""

import transformers

from hf_zoo._common import IMAGE, TEXT, VEND, VSTART, _sample, add_pixels, instantiate


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


def batch(model, images, videos, seed):
    vc = model.config.vision_config
    merge = vc.spatial_merge_size
    ids, types = [5, 6], [0, 0]
    for _, h, w in images:
        n = h // merge * (w // merge + 1) + 2
        ids += [IMAGE] * n + [7]
        types += [1] * n + [0]
    ids += [9, 10, 11]
    types += [0, 0, 0]
    width = vc.num_channels * vc.patch_size**2
    return add_pixels(_sample(ids, types), images, [], seed, (width,))
