"""What the family modules share: placeholder ids, tiny text and vision configs, model
instantiation, random pixel rows, and the batch builders of the Qwen-style (and Omni), GLM-style
and Muse chat layouts."""

import torch

# Placeholder ids (the tiny vocabularies have 256 entries; 5-11 stand in for text).
IMAGE, VIDEO, VSTART, VEND = 120, 121, 122, 123
BOV, EOV = 124, 125  # GLM: begin/end of video
QWEN_TOKENS = dict(
    image_token_id=IMAGE,
    video_token_id=VIDEO,
    vision_start_token_id=VSTART,
    vision_end_token_id=VEND,
)
"""The placeholder ids of a Qwen-style config."""
GLM_TOKENS = dict(
    image_token_id=IMAGE,
    video_token_id=VIDEO,
    image_start_token_id=VSTART,
    image_end_token_id=VEND,
    video_start_token_id=BOV,
    video_end_token_id=EOV,
)
"""The placeholder ids of a GLM-style config."""

TEXT = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)
"""A tiny text model: 2 layers, 4 query heads and 2 KV heads of 16."""

VISION = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=64)
"""A tiny Qwen-style vision tower (2 blocks of 4 heads, merger out width 64)."""

GLM_VISION = dict(VISION, image_size=112)
"""A tiny GLM-4V-style vision tower."""


def mrope(**extra) -> dict:
    """Default rope with M-RoPE sections (t, h, w) = (2, 3, 3) of a 16-wide head (a new dict)."""
    return {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0, **extra}


def glm_text(**extra) -> dict:
    """A tiny GLM-4V text model: M-RoPE sections (1, 1, 2) over half of each head."""
    rope = mrope(mrope_section=[1, 1, 2], partial_rotary_factor=0.5)
    return dict(TEXT, rope_parameters=rope, **extra)


def linear_attention(second: str = "full_attention") -> dict:
    """Text fields of a Qwen3.5-style hybrid: linear attention in layer 0, ``second`` in layer 1."""
    return dict(
        layer_types=["linear_attention", second],
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
    )


def instantiate(model_cls, config, attn="sdpa", vision_attn=None):
    """The model of ``config``: seeded with 0, float32, in training mode."""
    config._attn_implementation = attn
    if vision_attn is not None:
        config.vision_config._attn_implementation = vision_attn
    torch.manual_seed(0)
    return model_cls(config).float().train()


def pixel_width(vision_config) -> int:
    """The width of a Qwen-VL pixel row: channels x temporal patch x patch x patch."""
    c = vision_config
    return c.in_channels * c.temporal_patch_size * c.patch_size**2


def add_pixels(out: dict, images, videos, seed: int, row_shape: tuple) -> dict:
    """Random pixel rows of ``row_shape`` (t*h*w per grid row, images then videos, from one
    generator seeded with ``seed``) and the grid rows, for whichever of the two are present."""
    gen = torch.Generator().manual_seed(seed)
    for grids, pixels, grid in (
        (images, "pixel_values", "image_grid_thw"),
        (videos, "pixel_values_videos", "video_grid_thw"),
    ):
        if grids:
            rows = sum(t * h * w for t, h, w in grids)
            out[pixels] = torch.randn(rows, *row_shape, generator=gen)
            out[grid] = torch.tensor([list(g) for g in grids])
    return out


def _sample(ids, types=None, attention_mask=False) -> dict:
    out = {"input_ids": torch.tensor([ids])}
    if attention_mask:
        out["attention_mask"] = torch.ones(1, len(ids), dtype=torch.long)
    if types is not None:
        out["mm_token_type_ids"] = torch.tensor([types])
    out["labels"] = torch.tensor([ids])
    return out


def qwen_style_batch(
    model,
    images,
    videos,
    seed,
    *,
    per_frame_groups,
    token_types=True,
    attention_mask=False,
    row_shape=None,
) -> dict:
    """A sample in the Qwen-VL chat layout: ``<vs> pads <ve>`` per image; per video one such group
    for the whole clip, or one per frame (``per_frame_groups``), each after a stand-in timestamp
    token. ``token_types`` adds ``mm_token_type_ids``, ``attention_mask`` an all-ones mask; pixel
    rows default to ``pixel_width``."""
    vc = model.config.vision_config
    merge = vc.spatial_merge_size
    ids, types = [5, 6], [0, 0]
    for t, h, w in images:
        n = t * h * w // merge**2
        ids += [VSTART] + [IMAGE] * n + [VEND, 7]
        types += [0] + [1] * n + [0, 0]
    for t, h, w in videos:
        groups = [h * w // merge**2] * t if per_frame_groups else [t * h * w // merge**2]
        for n in groups:
            ids += [8, VSTART] + [VIDEO] * n + [VEND]
            types += [0, 0] + [2] * n + [0]
    ids += [9, 10, 11]
    types += [0, 0, 0]
    out = _sample(ids, types if token_types else None, attention_mask)
    return add_pixels(out, images, videos, seed, row_shape or (pixel_width(vc),))


def omni_batch(model, images, videos, seed) -> dict:
    """A sample for the Omni Thinkers: one ``<vs> pads <ve>`` group per clip and no
    mm_token_type_ids (media are found by token ids), plus the attention mask and
    video_second_per_grid that their M-RoPE needs."""
    out = qwen_style_batch(
        model,
        images,
        videos,
        seed,
        per_frame_groups=False,
        token_types=False,
        attention_mask=True,
    )
    if videos:
        out["video_second_per_grid"] = torch.ones(len(videos))
    return out


def glm_batch(model, images, videos, seed, *, mixed_ok=False) -> dict:
    """A sample in the GLM-4V chat layout: ``<boi> pads <eoi>`` per image; per video
    ``<bov>``, then ``<boi> pads <eoi> <timestamp>`` per frame with the IMAGE token, then ``<eov>``.
    Unless ``mixed_ok``, refuses a sample holding images and videos: the family's placeholder mask
    counts every image token for both modalities."""
    if images and videos and not mixed_ok:
        raise ValueError(
            f"{type(model).__name__}: one sample cannot hold images and videos (video frames use "
            "the image token and get_placeholder_mask counts all image tokens for both modalities)"
        )
    vc = model.config.vision_config
    merge = vc.spatial_merge_size
    ids, types = [5, 6], [0, 0]
    for t, h, w in images:
        n = t * h * w // merge**2
        ids += [VSTART] + [IMAGE] * n + [VEND, 7]
        types += [0] + [1] * n + [0, 0]
    for t, h, w in videos:
        ids += [BOV]
        types += [0]
        for _ in range(t):
            n = h * w // merge**2
            ids += [VSTART] + [IMAGE] * n + [VEND, 8]
            types += [0] + [2] * n + [0, 0]
        ids += [EOV]
        types += [0]
    ids += [9, 10, 11]
    types += [0, 0, 0]
    return add_pixels(_sample(ids, types), images, videos, seed, (pixel_width(vc),))


def muse_batch(model, images, videos, seed) -> dict:
    """A sample in the Muse chat layout: ``<vs> pads <ve>`` per image; per video ``<vid>``, then
    per frame a stand-in timestamp and its pads, closed by ``<sep>`` (``<eov>`` after the last)."""
    vid_start, vid_sep, vid_end = 124, 125, 126
    vc = model.config.vision_config
    merge = vc.merge_size
    ids = [5, 6]
    for t, h, w in images:
        ids += [VSTART] + [IMAGE] * (t * h * w // merge**2) + [VEND, 7]
    for t, h, w in videos:
        ids += [vid_start]
        for g in range(t):
            ids += [8] + [VIDEO] * (h * w // merge**2) + [vid_sep if g < t - 1 else vid_end]
    ids += [9, 10, 11]
    width = vc.patch_temporal * 3 * vc.patch_size**2
    return add_pixels(_sample(ids), images, videos, seed, (width,))
