"""The ViT registry, and how a ViT is found and seen through wrappers.

The ViT contract is the one of LoongForge's ``--use-vit-dp-balance``: ``vit(pixel_values,
image_grid_thw)`` returns ``(pixel_embeds, window_index, deepstack_pixel_embeds)``, and the
instance has a ``spatial_merge_size``. Each output tensor has, per grid row ``[t, h, w]``, either
``t*h*w`` rows (pre-merger) or ``t*h*w / merge**2`` rows (merged); the layout of each is read from
its row count. Any such module is balanceable as is: whole grid rows move, costed by ``l**2``.
``register_vision_encoder`` declares what cannot be guessed (frames encoded independently, the
dimensions behind the architecture cost model).

The registry lives in the runtime, below every entry point, because all of them read it (the
eager call, plan-ahead, the FX pass and the backend); ``fx_vitbal.register_vision_encoder`` is
its public face. Entry points register themselves here (``EntryPoint``), so
``enable_vit_balance`` hands Hugging Face VLMs over and the compile backend knows their files,
without one entry point importing another.
"""

import dataclasses
import logging
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from fx_vitbal.cost.static import ArchitectureCost
from fx_vitbal.runtime.transport import transfer
from fx_vitbal.runtime.transport.state import state_of_routing

log = logging.getLogger(__name__)

VIT_CHILD_NAMES = ("visual", "vision_model", "vision_tower", "image_encoder")


# Child names under which torch.compile's OptimizedModule, checkpoint_wrapper / offload_wrapper
# and FSDP1 hold the module they wrap (DDP and DataParallel use `module`, checked by class).
WRAPPED_CHILD_NAMES = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")


@dataclasses.dataclass(frozen=True, kw_only=True)
class VisionEncoderSpec:
    """What balancing knows about a ViT class beyond the contract (``UNDECLARED`` when nothing
    was registered). ``fx_vitbal.check_vision_encoder`` tests a ViT against these promises."""

    frame_independent: bool
    """True when every frame is encoded on its own (attention, positions, windows per frame).
    Consequence: a video's frames become separate units that may be computed on different ranks
    (finer balance). Declared wrongly, outputs and gradients are silently wrong, which is why
    nothing assumes it: an undeclared ViT moves whole grid rows."""
    spatial_merge_size: int | None = None
    """The merge size ``m``: grid ``h`` and ``w`` are multiples of it and merged outputs have
    ``t*h*w / m**2`` rows per grid row. None: read the instance's ``spatial_merge_size``
    attribute (Qwen and GLM towers have one)."""
    cost_model: Callable[[nn.Module], ArchitectureCost] | None = None
    """Builds the architecture-aware cost model (linear layers, per-frame or windowed
    attention) from a ViT instance. Consequence: the default ``cost_model="auto"`` plans with
    it instead of ``(t*h*w)**2``, which misjudges most real images (attention only dominates
    past ~6x the hidden size in tokens per frame)."""
    pixel_width: Callable[[nn.Module], int] | None = None
    """Values per pixel row from a ViT instance. Consequence: a compiled call may pass
    ``pixel_values=None`` on a rank without images (the graph needs the stand-in's width when
    traced; eagerly the other ranks' width is learned from the plan)."""

    bands: "BandSupport | None" = None
    """How the ViT runs row bands of a frame. Consequence: a frame that would bind the step
    alone may be split across ranks (``BalanceConfig.split_images``); without it, never."""

    def merge_size(self, vit: nn.Module) -> int:
        """The declared merge size, else ``vit.spatial_merge_size``.

        Raises:
            TypeError: neither is a positive int.
        """
        vit = unwrap_module(vit)
        size = self.spatial_merge_size or getattr(vit, "spatial_merge_size", None)
        if not isinstance(size, int) or size < 1:
            raise TypeError(
                f"{type(vit).__qualname__} has no spatial_merge_size attribute (a positive int: "
                "merged outputs have t*h*w/spatial_merge_size**2 rows per grid row); set it on the "
                "instance, or register the class with register_vision_encoder(..., "
                "spatial_merge_size=...)"
            )
        return size


@dataclasses.dataclass(frozen=True, kw_only=True)
class BandSupport:
    """A ViT that computes row bands of a frame (``fx_vitbal.plan.bands``): on a step whose plan
    splits a frame, its ``forward`` gets a keyword ``vitbal_bands`` (a ``fx_vitbal.Bands``; on
    other steps none; compiled, with ``compiled``, its tensor form on every step): it places
    each band's patches at the frame's rows
    (``Bands.units[i].first_row``), and in every layer that attends over whole frames it
    attends from a band's queries over ``Bands.gather``'s keys and values (the whole frame's).
    Each field is a number, or a function of the ViT instance giving it. ``width`` is a feature
    width (its keys' values per patch), not ``BandUnit.width`` (a unit's patch columns)."""

    align_rows: int | Callable[[nn.Module], int]
    """Patch rows a band starts at a multiple of: the merge size, or the window height in
    patch rows where some layers attend in windows (windows then stay inside a band)."""
    exchange_layers: int | Callable[[nn.Module], int]
    """Layers that attend over whole frames (each gathers keys and values once)."""
    width: int | Callable[[nn.Module], int]
    """The key/value width: values per patch of its keys (and of its values) in one exchanging
    layer, heads x head size (e.g. 1280 for Qwen2-VL's tower: 16 heads of 80); not patch
    columns (``BandUnit.width``). It only prices the exchange when the planner decides whether
    a split pays (what a band's rank receives per exchanging layer, in the forward and again in
    the backward: ``2 x width`` bf16 values for each other patch of its frame), so a wrong value
    changes which frames are split, never what a split computes."""
    compiled: bool = False
    """Its ``forward`` also runs under ``torch.compile`` from the tensor form of ``Bands``
    (``unit_table`` and ``gather``; then it gets ``vitbal_bands`` on every step). Without it, a
    compiled call plans whole frames."""
    heads: int | Callable[[nn.Module], int] = 0
    """Attention heads of its layers (0: not said): a frame's ranks can then share them out
    (``band_exchange="ulysses"``, when the heads divide among them); with ``Bands.attention``
    only (a tower that only gathers gets gathered keys and values)."""

    def of(self, vit: nn.Module) -> tuple[int, int, int, bool, int]:
        """``(align rows, exchanging layers, width, compiled, heads)`` of ``vit``."""
        align, layers, width, heads = (
            value(vit) if callable(value) else value
            for value in (self.align_rows, self.exchange_layers, self.width, self.heads)
        )
        return align, layers, width, self.compiled, heads


_REGISTRY: dict[type, VisionEncoderSpec] = {}


def register_vision_encoder(
    cls: type,
    *,
    frame_independent: bool,
    spatial_merge_size: int | None = None,
    cost_model: Callable[[nn.Module], ArchitectureCost] | None = None,
    pixel_width: Callable[[nn.Module], int] | None = None,
    bands: BandSupport | None = None,
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
        pixel_width=pixel_width,
        bands=bands,
    )
    return cls


# What balancing assumes of a ViT nobody declared: whole grid rows move (nothing says its frames
# are independent), its merge size is the instance's attribute, and it is costed by l**2.
UNDECLARED = VisionEncoderSpec(frame_independent=False)


_told_undeclared: set[type] = set()


def vision_encoder_spec(vit: nn.Module) -> VisionEncoderSpec:
    """The registered spec of ``vit``'s class (or of its nearest registered base class), else
    ``UNDECLARED``. Wrappers (DDP, FSDP1, checkpoint_wrapper, torch.compile) are seen through."""
    vit = unwrap_module(vit)
    for cls in type(vit).__mro__:
        if cls in _REGISTRY:
            return _REGISTRY[cls]
    if type(vit) not in _told_undeclared and not (dist.is_initialized() and dist.get_rank()):
        log.warning(
            "vit dp balance: %s is not registered, so whole images move and are costed by "
            "(t*h*w)**2; fx_vitbal.register_vision_encoder(%s, frame_independent=..., "
            "cost_model=...) unlocks frame splitting and the architecture cost model",
            type(vit).__qualname__,
            type(vit).__name__,
        )
        _told_undeclared.add(type(vit))
    return UNDECLARED


def unwrap_module(module: nn.Module) -> nn.Module:
    """The module inside the wrappers users put around models: ``torch.compile``'s
    ``OptimizedModule``, DDP and ``DataParallel``, FSDP1, ``checkpoint_wrapper`` (and
    accelerate's, which are the same classes). FSDP2 and in-place ``module.compile()`` keep the
    module's own class, so there is nothing to see through."""
    while True:
        if isinstance(module, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            module = module.module
            continue
        # A plain loop: dynamo before 2.10 cannot trace next() over a generator.
        for name in WRAPPED_CHILD_NAMES:
            if name in module._modules:
                module = module._modules[name]
                break
        else:
            return module


def find_vit(model: nn.Module, vit: str | nn.Module | None = None) -> nn.Module:
    """Locate the ViT as ``enable_vit_balance`` documents, seeing through wrappers around
    ``model``; a ViT inside a wrapper is returned as its outermost wrapper. A module with none
    of those inside that follows the contract itself (a ``spatial_merge_size`` attribute) is
    its own ViT: the contract needs no registration.

    Raises:
        ValueError: no ViT found.
    """
    if isinstance(vit, nn.Module):
        return vit
    if _is_registered(model):
        return model
    outer, model = model, unwrap_module(model)
    if isinstance(vit, str):
        return model.get_submodule(vit)
    named = list(model.named_modules())  # pre-order: a wrapper comes before what it wraps
    for name, module in named:
        if name.rsplit(".", 1)[-1] in VIT_CHILD_NAMES:
            return module
    for _, module in named:
        if _is_registered(module):
            return module
    if isinstance(getattr(model, "spatial_merge_size", None), int):
        return outer
    raise ValueError(
        f"no vision encoder found in {type(model).__qualname__}: pass vit='path.to.vit', name "
        f"it one of {VIT_CHILD_NAMES}, register its class with register_vision_encoder, or "
        "give a ViT that follows the contract (a spatial_merge_size attribute)"
    )


def plain_forward(vit: nn.Module) -> Callable:
    """``vit``'s own call, without the balancing ``enable_vit_balance`` put in front of it (so
    a ViT already wrapped is never balanced twice, and a local check issues no collective)."""
    return getattr(vit, "_vitbal_original_forward", vit)


def regenerate_window_index(
    vit: nn.Module, grid_thw: torch.Tensor, routing: torch.Tensor | None = None
) -> torch.Tensor:
    """``vit.get_window_index(grid)`` as a tensor (some ViTs return ``(index, cu_seqlens)``).

    ``routing``: the call's plan (``vitbal::plan``'s routing tensor), whose call's state holds a
    host copy of this rank's grid (``runtime.transport.state``): the index is then made from it and
    copied to the grid's device without waiting, since towers read their grid on the host (a
    device grid would cost a host sync every step)."""
    eager = routing is not None and not torch.compiler.is_compiling()  # traced: tensors only
    kept = state_of_routing(routing) if eager else None
    host_rows = kept.home_grid if kept is not None else None
    if host_rows is not None:
        host = torch.tensor(host_rows, dtype=grid_thw.dtype, device="cpu").view(-1, 3)
        index = unwrap_module(vit).get_window_index(host)
        index = index[0] if isinstance(index, tuple) else index
        return transfer.to_device(index, grid_thw.device)
    index = unwrap_module(vit).get_window_index(grid_thw)
    return index[0] if isinstance(index, tuple) else index


def registered_vision_encoders() -> list[type]:
    """Every class declared with ``register_vision_encoder``."""
    return list(_REGISTRY)


def is_vision_encoder_class(cls: type) -> bool:
    """True for classes declared with ``register_vision_encoder`` (and their subclasses)."""
    return any(base in _REGISTRY for base in cls.__mro__)


def is_balanced_in_place(module: nn.Module) -> bool:
    """True when ``enable_vit_balance`` replaced ``module``'s forward (it balances every call)."""
    return "_vitbal_original_forward" in vars(module)


def _is_registered(module: nn.Module) -> bool:
    return is_vision_encoder_class(type(unwrap_module(module)))


@dataclasses.dataclass(frozen=True)
class EntryPoint:
    """A module that runs ViTs through the runtime (``fx_vitbal.encoder``,
    ``fx_vitbal.integrations.hf``), as the others must know it without importing it."""

    source_file: str
    """Its file: frames there run ViTs, balanced or (balancing off) plainly, so the compile
    backend tells graphs traced through it from ViTs compiled without balancing."""
    accepts: Callable[[nn.Module], bool] | None = None
    """Whole models it balances (wrappers seen through): ``enable_vit_balance`` hands them to
    ``enable(model, config=..., group=..., replica_group=..., tower=...)`` (``tower``: the ViT
    the user named, or None)."""
    enable: Callable[..., nn.Module] | None = None
    vit_code: Callable[[], dict[str, str]] = dict
    """Source files of the ViT classes it knows, imported so far -> class name."""
    plan_input: Callable[..., tuple] | None = None
    """``plan_input(module, pixel_values, image_grid_thw, pixel_values_videos,
    video_grid_thw) -> (pixels, grid)``: a batch of a model it balances as the one balanced call
    will see it, for ``fx_vitbal.plan_ahead``."""


_ENTRY_POINTS: list[EntryPoint] = []


def register_entry_point(entry: EntryPoint) -> None:
    """Add ``entry`` (once, at the entry point's import)."""
    if entry not in _ENTRY_POINTS:
        _ENTRY_POINTS.append(entry)


def entry_points() -> list[EntryPoint]:
    """Every registered ``EntryPoint``, in registration order."""
    return list(_ENTRY_POINTS)
