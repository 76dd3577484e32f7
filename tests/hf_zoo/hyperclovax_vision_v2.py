"""HyperCLOVAX-Vision-V2: a Qwen2.5-VL tower, then a projector to a wider LM on
``pooler_output`` in the parent's ``get_image_features``."""

import torch
import transformers

IMAGE, VIDEO = 250, 251


def build():
    vision = dict(
        depth=2,
        hidden_size=64,
        intermediate_size=128,
        num_heads=4,
        out_hidden_size=48,  # the projector maps 48 -> 96, as the real one maps 3584 -> 4096
        fullatt_block_indexes=[1],
        window_size=112,
    )
    text = dict(
        vocab_size=256,
        hidden_size=96,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    config = transformers.HyperCLOVAXVisionV2Config(
        vision_config=vision, text_config=text, image_token_id=IMAGE, video_token_id=VIDEO
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.HyperCLOVAXVisionV2ForConditionalGeneration(config).float().train()


def batch(model, images, videos, seed):
    ids = [5, 6]
    for grids, token in ((images, IMAGE), (videos, VIDEO)):
        for t, h, w in grids:
            ids += [token] * (t * h * w // 4) + [7]
    ids += [9, 10]
    out = {"input_ids": torch.tensor([ids]), "labels": torch.tensor([ids])}
    generator = torch.Generator().manual_seed(seed)
    for grids, pixels, grid in (
        (images, "pixel_values", "image_grid_thw"),
        (videos, "pixel_values_videos", "video_grid_thw"),
    ):
        if grids:
            rows = sum(t * h * w for t, h, w in grids)
            out[pixels] = torch.randn(rows, 3 * 2 * 14 * 14, generator=generator)
            out[grid] = torch.tensor(grids)
    return out
