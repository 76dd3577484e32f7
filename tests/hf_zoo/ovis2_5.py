"""Ovis2.5 (transformers 5.25): a windowed NaViT tower (one pixel row per patch; windows and
positions per frame) whose parent reads ``hidden_states[-1]``, the last layer's output before the
final norm, in window order, and turns it into probabilistic visual tokens; one
``<start> pads <end>`` group per image and per video."""

import transformers

from hf_zoo._common import IMAGE, TEXT, VEND, VIDEO, VSTART, _sample, add_pixels, instantiate

VIDEO_START, VIDEO_END = 124, 125


def build():
    config = transformers.Ovis2_5Config(
        vision_config=dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            patch_size=4,
            image_size=32,
            window_size=16,
            layer_types=["window_attention", "full_attention"],
            vocab_size=68,
        ),
        text_config=dict(TEXT),
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        image_start_token_id=VSTART,
        image_end_token_id=VEND,
        video_start_token_id=VIDEO_START,
        video_end_token_id=VIDEO_END,
    )
    return instantiate(transformers.Ovis2_5ForConditionalGeneration, config)


def batch(model, images, videos, seed):
    vc = model.config.vision_config
    merge = vc.spatial_merge_size
    ids = [5, 6]
    for t, h, w in images:
        ids += [VSTART] + [IMAGE] * (t * h * w // merge**2) + [VEND, 7]
    for t, h, w in videos:
        ids += [8, VIDEO_START] + [VIDEO] * (t * h * w // merge**2) + [VIDEO_END]
    ids += [9, 10, 11]
    width = vc.num_channels * vc.temporal_patch_size * vc.patch_size**2
    return add_pixels(_sample(ids), images, videos, seed, (width,))
