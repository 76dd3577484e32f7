"""A balanced Hugging Face tower's inputs: the parent's pixels and grid of each modality joined
into the one tower call, as pixel rows and ``[t, h, w]`` grid rows, and converted to and from
the tower's own call convention (``CallConvention``) where it takes no ``(pixel rows,
grid_thw)``.

Why one format inside: the plan, the moves and the restore know units of ``t*h*w`` pixel rows;
a tower that takes a strip of patches and target sizes (MiniCPM-V) is the same batch in
another shape, converted losslessly at both ends of the balanced call.
"""

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from fx_vitbal.runtime.agree.problems import PROBLEMS


@dataclasses.dataclass(frozen=True, kw_only=True)
class CallConvention:
    """How a tower that takes no ``(pixel rows, grid_thw)`` gets its batch, and its parent
    passes it. The balanced call works in pixel rows and ``[t, h, w]`` grid rows: the tower's
    pixels and grid become rows where it begins, and each rank's balanced batch goes back to the
    tower's format for its call. Pixels or a grid that do not convert raise on every rank."""

    modalities: tuple[tuple[str, str, str], ...]
    """``(modality, pixels argument, grid argument)`` of the parent's forward, for each modality
    it takes (the Qwen contract's: ``("image", "pixel_values", "image_grid_thw")`` and
    ``("video", "pixel_values_videos", "video_grid_thw")``)."""
    rows: Callable[[torch.Tensor, object], torch.Tensor]
    """``(the tower's pixels, vision config) -> pixel rows``, one per grid cell."""
    pixels: Callable[[torch.Tensor, object], torch.Tensor]
    """``(pixel rows, vision config) -> the tower's pixels``: ``rows`` undone."""
    grid: Callable[[torch.Tensor], torch.Tensor]
    """``the tower's grid -> [t, h, w] rows`` (without a host read)."""
    tower_grid: Callable[[torch.Tensor], torch.Tensor]
    """``[t, h, w] rows -> the tower's grid``: ``grid`` undone."""
    feature_kwargs: tuple[str, ...] = ()
    """Arguments of the parent's forward that it passes its feature methods too (MiniCPM-V:
    ``downsample_mode``): the replay passes them as well."""
    tower_kwargs: Callable[[nn.Module, dict], dict] = lambda parent, kwargs: {}
    """``(parent, its forward's arguments) -> what its feature methods pass the tower besides
    pixels and grid`` (MiniCPM-V: ``use_vit_merger``), for the one balanced tower call."""


def _strip_rows(pixels: torch.Tensor, config) -> torch.Tensor:
    """A ``(B, C, p, N*p)`` strip's first entry (the one its parent reads) as ``N`` rows of
    ``C*p*p``: patch ``n`` is columns ``[n*p, (n+1)*p)``, flattened as the patch convolution's
    weight is (channel, row, column)."""
    c, p = config.num_channels, config.patch_size
    strip = pixels[0]
    n = strip.shape[-1] // p
    return strip.reshape(c, p, n, p).permute(2, 0, 1, 3).reshape(n, c * p * p)


def _strip(rows: torch.Tensor, config) -> torch.Tensor:
    c, p = config.num_channels, config.patch_size
    n = rows.shape[0]
    return rows.reshape(n, c, p, p).permute(1, 2, 0, 3).reshape(1, c, p, n * p)


def _vit_merger(parent: nn.Module, kwargs: dict) -> dict:  # as MiniCPM-V's feature methods
    mode = kwargs.get("downsample_mode") or parent.config.downsample_mode
    return {"use_vit_merger": mode != "4x"}


STRIPS = CallConvention(
    modalities=(
        ("image", "pixel_values", "target_sizes"),
        ("video", "pixel_values_videos", "target_sizes_videos"),
    ),
    rows=_strip_rows,
    pixels=_strip,
    grid=lambda sizes: torch.cat([torch.ones_like(sizes[:, :1]), sizes], 1).long(),
    tower_grid=lambda grid: grid[:, 1:].int(),
    feature_kwargs=("downsample_mode",),
    tower_kwargs=_vit_merger,
)
"""MiniCPM-V's: a ``(1, C, p, N*p)`` strip of patches (images joined along its width, each in
raster order) and ``(h, w)`` target sizes, one per image or video frame; its parent reads
``pixel_values[:1]`` and picks ``use_vit_merger`` from ``downsample_mode``."""


_MODALITIES = (
    ("image", "pixel_values", "image_grid_thw"),
    ("video", "pixel_values_videos", "video_grid_thw"),
)


def tower_parts(tower, rule, kwargs: dict, one_frame_rows: bool) -> list[tuple]:
    """``(modality, pixels, grid as given, pixel rows, grid rows as fed to the tower)`` of each
    modality present, popped from ``kwargs``, pixels in the tower's dtype. ``one_frame_rows``:
    videos as one grid row per frame where the rule says the tower needs it (a host read of a
    device grid); a balanced call gets its frames from the plan's units instead."""
    parts = []
    for modality, pixel_key, grid_key in modalities(rule):
        if kwargs.get(pixel_key) is not None:
            pixels, grid = kwargs.pop(pixel_key).type(tower.dtype), kwargs[grid_key]
            if rule.convention is not None:
                rows, fed, _ = as_rows(rule, tower, pixels, grid)  # (unfit: rows None)
                parts.append((modality, pixels, grid, rows, fed))
                continue
            split = one_frame_rows and rule.one_frame_rows and modality == "video"
            split = split and _is_integer_grid(grid)
            fed = _one_frame_rows(grid) if split else grid
            parts.append((modality, pixels, grid, pixels, fed))
    return parts


def modalities(rule) -> tuple[tuple[str, str, str], ...]:
    return rule.convention.modalities if rule.convention is not None else _MODALITIES


def tower_call(rule, tower, rows, grid) -> tuple:
    """Pixel rows and ``[t, h, w]`` rows as the tower takes them: ``(pixels, grid)``."""
    if rule.convention is not None:
        return rule.convention.pixels(rows, tower.config), rule.convention.tower_grid(grid)
    return (rows.unsqueeze(0) if rule.batched_pixels else rows), grid


def as_rows(rule, tower, pixels, grid) -> tuple:
    """``tower_call`` undone: ``(pixel rows, [t, h, w] rows, problem)``. Pixels or a grid that
    do not fit the rule's call convention give ``(None, None, PROBLEMS code)``: the caller
    passes the plan an empty batch and the code, and every rank raises."""
    if rule.convention is None:
        return (pixels.squeeze(0) if rule.batched_pixels else pixels), grid, 0
    try:
        return rule.convention.rows(pixels, tower.config), rule.convention.grid(grid), 0
    except (RuntimeError, ValueError, IndexError):
        return None, None, PROBLEMS["call_convention"]


def tower_batch(tower, parts: list[tuple], device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The one tower call's ``(pixels, grid, problem)``: the parts joined (images, then videos),
    or an empty batch on ``device`` with a problem code when their row widths differ or do not
    fit the call convention, or none is present."""
    problem = PROBLEMS["modalities_differ"] if len({p[3].shape[1:] for p in parts}) > 1 else 0
    if any(p[3] is None for p in parts):
        problem = PROBLEMS["call_convention"]
    if parts and not problem:
        pixels = torch.cat([p[3] for p in parts]) if len(parts) > 1 else parts[0][3]
        grid = torch.cat([p[4] for p in parts]) if len(parts) > 1 else parts[0][4]
        return pixels, grid, 0
    width = tower._vitbal_hf.rule.pixel_width(tower.config)
    pixels = torch.zeros(0, width, dtype=tower.dtype, device=device)
    return pixels, torch.zeros(0, 3, dtype=torch.long, device=device), problem


def _is_integer_grid(grid) -> bool:
    """A grid ``_one_frame_rows`` can split; any other reaches the plan as given, which then
    raises its error on every rank."""
    return grid.dim() == 2 and grid.shape[1] == 3 and not grid.dtype.is_floating_point


def _one_frame_rows(grid):
    """``[t, h, w]`` rows as ``t`` rows ``[1, h, w]`` (what GLM's ``get_video_features`` feeds).
    A non-positive ``t`` gives no row (the plan then raises on the rows it cannot match)."""
    hw = torch.repeat_interleave(grid[:, 1:], grid[:, 0].clamp(min=0), dim=0)
    return torch.cat([hw.new_ones(hw.shape[0], 1), hw], dim=1)
