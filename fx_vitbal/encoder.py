"""Balanced ViT calls: ``dp_balance_vit_encoder`` and in-place ``enable_vit_balance``.

The ViT contract is the seed's: ``vit(pixel_values, image_grid_thw)`` returns
``(pixel_embeds, window_index, deepstack_pixel_embeds)`` with ``t*h*w / merge**2`` rows per grid
row in every embedding. What the balancer must know about a ViT class (merge size, whether it
attends per frame, its dimensions for the cost model) comes from ``register_vision_encoder``:
nothing is guessed.
"""

import dataclasses
import functools
import logging
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from fx_vitbal import ops
from fx_vitbal.config import BalanceConfig
from fx_vitbal.cost import ArchitectureCost, choose_cost_model
from fx_vitbal.exchange import planner_spec

log = logging.getLogger(__name__)

VIT_CHILD_NAMES = ("visual", "vision_model", "vision_tower", "image_encoder")


@dataclasses.dataclass(frozen=True, kw_only=True)
class VisionEncoderSpec:
    """What balancing needs to know about a ViT class."""

    frame_independent: bool
    """True when every frame is encoded on its own (attention, positions, windows per frame), so
    a video's frames may be computed on different ranks with identical results."""
    spatial_merge_size: int | None = None
    """Output rows per grid row are ``t*h*w / spatial_merge_size**2``; h and w must divide.
    None: read the instance's ``spatial_merge_size`` attribute (Qwen and GLM towers have one)."""
    cost_model: Callable[[nn.Module], ArchitectureCost] | None = None
    """Builds the architecture-aware cost model from a ViT instance."""

    def merge_size(self, vit: nn.Module) -> int:
        size = self.spatial_merge_size or getattr(vit, "spatial_merge_size", None)
        if not isinstance(size, int) or size < 1:
            raise TypeError(
                f"{type(vit).__qualname__} has no spatial_merge_size attribute; register it with "
                "an explicit spatial_merge_size"
            )
        return size


_REGISTRY: dict[type, VisionEncoderSpec] = {}


def register_vision_encoder(
    cls: type,
    *,
    frame_independent: bool,
    spatial_merge_size: int | None = None,
    cost_model: Callable[[nn.Module], ArchitectureCost] | None = None,
) -> type:
    """Declare a ViT class balanceable (see ``VisionEncoderSpec`` for the fields). Returns ``cls``.

    Raises:
        ValueError: ``spatial_merge_size`` < 1.
    """
    if spatial_merge_size is not None and spatial_merge_size < 1:
        raise ValueError(f"spatial_merge_size must be >= 1 or None, got {spatial_merge_size}")
    _REGISTRY[cls] = VisionEncoderSpec(
        spatial_merge_size=spatial_merge_size,
        frame_independent=frame_independent,
        cost_model=cost_model,
    )
    return cls


def vision_encoder_spec(vit: nn.Module) -> VisionEncoderSpec:
    """The registered spec of ``vit``'s class (or of its nearest registered base class).

    Raises:
        TypeError: the class was never registered.
    """
    for cls in type(vit).__mro__:
        if cls in _REGISTRY:
            return _REGISTRY[cls]
    raise TypeError(
        f"{type(vit).__qualname__} is not a known vision encoder; declare it with "
        "fx_vitbal.register_vision_encoder(cls, frame_independent=...)"
    )


def dp_balance_vit_encoder(
    vit: nn.Module,
    pixel_values: torch.Tensor,
    image_grid_thw: torch.Tensor,
    *,
    config: BalanceConfig | None = None,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
    """Run ``vit`` on a batch balanced across the data-parallel group; return its outputs in the
    original layout, as if ``vit(pixel_values, image_grid_thw)`` had run locally.

    Every rank of ``group`` must call this at the same step (with zero images if it has none).
    Without an initialised process group, with one rank, or with ``config.enabled`` False it is a
    plain call.

    Returns:
        ``(pixel_embeds, window_index, deepstack_pixel_embeds)``; ``window_index`` is regenerated
        from the original grid (a tensor, or None when the ViT returns None).

    Raises:
        ValueError: on every rank, when any rank's input is malformed.
        TypeError: ``vit``'s class is not registered.
    """
    return _balanced_call(vit, _unwrapped(vit), pixel_values, image_grid_thw, config, group)


def enable_vit_balance(
    model: nn.Module,
    *,
    config: BalanceConfig | None = None,
    group: dist.ProcessGroup | None = None,
    vit: str | nn.Module | None = None,
) -> nn.Module:
    """Balance the ViT inside ``model`` (or ``model`` itself) in place; returns ``model``.

    The ViT's ``forward`` is replaced on the instance, so parameter names, ``state_dict`` keys,
    hooks and FSDP wrapping are untouched. Calling it again updates config and group. Balancing
    runs while the ViT is in training mode: in eval mode (generation), ranks need not step
    together. Hugging Face VLMs and towers go to ``fx_vitbal.integrations.hf``.

    Args:
        vit: the ViT, or its dotted path in ``model``. Default: ``model`` if its class is
            registered, else the first submodule named one of ``VIT_CHILD_NAMES``, else the first
            submodule of a registered class.

    Raises:
        ValueError: no ViT found.
    """
    from fx_vitbal.integrations import hf  # it builds on this module

    if vit is None and hf.is_hf_model(model):
        return hf.enable_hf_vit_balance(model, config=config, group=group)
    module = find_vit(model, vit)
    original = getattr(module, "_vitbal_original_forward", module.forward)
    module._vitbal_original_forward = original
    module.forward = functools.partial(_training_call, module, original, config, group)
    return model


def find_vit(model: nn.Module, vit: str | nn.Module | None = None) -> nn.Module:
    """Locate the ViT as ``enable_vit_balance`` documents.

    Raises:
        ValueError: no ViT found.
    """
    if isinstance(vit, nn.Module):
        return vit
    if isinstance(vit, str):
        return model.get_submodule(vit)
    if _is_registered(model):
        return model
    named = list(model.named_modules())
    for name, module in named:
        if name.rsplit(".", 1)[-1] in VIT_CHILD_NAMES:
            return module
    for _, module in named:
        if _is_registered(module):
            return module
    raise ValueError(
        f"no vision encoder found in {type(model).__qualname__}: pass vit='path.to.vit', name "
        f"it one of {VIT_CHILD_NAMES}, or register its class with register_vision_encoder"
    )


def group_name_and_size(group: dist.ProcessGroup | None) -> tuple[str, int] | None:
    """``(group_name, world_size)`` of ``group`` (default: WORLD); None when not distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    group = group or dist.group.WORLD
    size = dist.get_world_size(group)
    return (group.group_name, size) if size > 1 else None


def planner_for(vit: nn.Module, config: BalanceConfig) -> tuple[str, int]:
    """``(planner spec string, merge size)`` for ``vit`` under ``config``."""
    spec = vision_encoder_spec(vit)
    architecture = spec.cost_model(vit) if spec.cost_model is not None else None
    cost_model = choose_cost_model(config.cost_model, config.cost_coeffs, architecture)
    split = config.split_frames and spec.frame_independent
    return planner_spec(dataclasses.replace(config, split_frames=split), cost_model), (
        spec.merge_size(vit)
    )


def regenerate_window_index(vit: nn.Module, grid_thw: torch.Tensor) -> torch.Tensor:
    """``vit.get_window_index(grid)`` as a tensor (some ViTs return ``(index, cu_seqlens)``)."""
    index = vit.get_window_index(grid_thw)
    return index[0] if isinstance(index, tuple) else index


def _balanced_call(vit, call, pixel_values, image_grid_thw, config=None, group=None):
    config = config or BalanceConfig()
    dist_info = group_name_and_size(group)
    if not config.enabled or dist_info is None:
        return call(pixel_values, image_grid_thw)
    group_name, world_size = dist_info
    planner, merge = planner_for(vit, config)
    grid, routing = ops.plan(pixel_values, image_grid_thw, merge, planner, world_size, group_name)
    if not torch.compiler.is_compiling() and not routing[0]:
        return call(pixel_values, image_grid_thw)  # skipped on every rank: no copies at all
    (pixels,) = ops.redistribute([pixel_values], routing, 1, merge * merge, None, group_name)
    embeds, window_index, deepstack = call(pixels, grid)
    out_rows = pixel_values.shape[0] // (merge * merge)
    restored = ops.restore([embeds, *deepstack], routing, merge * merge, out_rows, group_name)
    if window_index is not None:
        window_index = regenerate_window_index(vit, image_grid_thw)
    return restored[0], window_index, list(restored[1:])


def _training_call(vit, original, config, group, pixel_values, image_grid_thw):
    if not vit.training:
        return original(pixel_values, image_grid_thw)
    return _balanced_call(vit, original, pixel_values, image_grid_thw, config, group)


def _unwrapped(vit: nn.Module) -> Callable:
    # A ViT already wrapped by enable_vit_balance must not be balanced twice.
    return getattr(vit, "_vitbal_original_forward", vit)


def is_vision_encoder_class(cls: type) -> bool:
    """True for classes declared with ``register_vision_encoder`` (and their subclasses)."""
    return any(base in _REGISTRY for base in cls.__mro__)


def _is_registered(module: nn.Module) -> bool:
    return is_vision_encoder_class(type(module))
