"""HyperCLOVAX-Vision-V2: a Qwen2.5-VL tower, then a projector to a wider text model on
``pooler_output`` in the parent's ``get_image_features``. Placeholders are runs of pad tokens
without start/end markers."""

import torch
import transformers

from hf_zoo._common import TEXT, VISION, add_pixels, instantiate, pixel_width

IMAGE, VIDEO = 250, 251


def build():
    config = transformers.HyperCLOVAXVisionV2Config(
        vision_config=dict(
            VISION,
            out_hidden_size=48,  # the projector maps 48 -> 96, as the real one maps 3584 -> 4096
            fullatt_block_indexes=[1],
            window_size=112,
        ),
        text_config=dict(TEXT, hidden_size=96),
        image_token_id=IMAGE,
        video_token_id=VIDEO,
    )
    return instantiate(transformers.HyperCLOVAXVisionV2ForConditionalGeneration, config)


def batch(model, images, videos, seed):
    ids = [5, 6]
    for grids, token in ((images, IMAGE), (videos, VIDEO)):
        for t, h, w in grids:
            ids += [token] * (t * h * w // 4) + [7]
    ids += [9, 10]
    out = {"input_ids": torch.tensor([ids]), "labels": torch.tensor([ids])}
    return add_pixels(out, images, videos, seed, (pixel_width(model.config.vision_config),))
