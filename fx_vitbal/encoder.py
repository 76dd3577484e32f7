"""Balanced ViT calls: ``dp_balance_vit_encoder`` and in-place ``enable_vit_balance``.

The ViT contract is the one of LoongForge's ``--use-vit-dp-balance``: ``vit(pixel_values,
image_grid_thw)`` returns ``(pixel_embeds, window_index, deepstack_pixel_embeds)``, and the
instance has a ``spatial_merge_size``. Each output tensor has, per grid row ``[t, h, w]``, either
``t*h*w`` rows (pre-merger) or ``t*h*w / merge**2`` rows (merged); the layout of each is read from
its row count. Any such module is balanceable as is: whole grid rows move, costed by ``l**2``.
``register_vision_encoder`` declares what cannot be guessed (frames encoded independently, the
dimensions behind the architecture cost model).
"""

import dataclasses
import functools
import itertools
import logging
import math
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from fx_vitbal import _compat, ops, timing, transfer
from fx_vitbal.config import BalanceConfig
from fx_vitbal.cost import ArchitectureCost, choose_cost_model
from fx_vitbal.exchange import Routing, planner_spec
from fx_vitbal.metadata import PROBLEMS

if TYPE_CHECKING:
    from fx_vitbal.ahead import PlannedBatch

log = logging.getLogger(__name__)


# One object, so settings kept for ``config=None`` calls are found again (``planner_for``).
DEFAULT_CONFIG = BalanceConfig()
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


_REGISTRY: dict[type, VisionEncoderSpec] = {}


def register_vision_encoder(
    cls: type,
    *,
    frame_independent: bool,
    spatial_merge_size: int | None = None,
    cost_model: Callable[[nn.Module], ArchitectureCost] | None = None,
    pixel_width: Callable[[nn.Module], int] | None = None,
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


def dp_balance_vit_encoder(
    vit: nn.Module,
    pixel_values: torch.Tensor,
    image_grid_thw: torch.Tensor,
    *,
    config: BalanceConfig | None = None,
    group: dist.ProcessGroup | None = None,
    plan: "PlannedBatch | None" = None,
) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
    """Run ``vit`` on a batch balanced across the data-parallel group; return its outputs in the
    original layout, as if ``vit(pixel_values, image_grid_thw)`` had run locally.

    Every rank of ``group`` must call this at the same step (with zero images if it has none).
    Without an initialised process group, with one rank, or with ``config.enabled`` False it is a
    plain call. ``vit`` needs no registration (see the module doc). ``plan``: this batch's plan,
    made ahead by ``fx_vitbal.plan_ahead`` (then no metadata gather and no planning runs here;
    eager only); every rank passes one or none does.

    Returns:
        ``(pixel_embeds, window_index, deepstack_pixel_embeds)``, each embedding in the layout
        the ViT gave it; ``window_index`` is regenerated from the original grid (a tensor, or None
        when the ViT returns None).

    Raises:
        ValueError: on every rank, when any rank's input or ViT output is malformed, or its
            batch is not the one ``plan`` was made for (``fx_vitbal.ahead``).
        TypeError: ``vit`` has no ``spatial_merge_size``.
    """
    call = plain_forward(vit)
    return _balanced_call(vit, call, pixel_values, image_grid_thw, config, group, planned=plan)


def enable_vit_balance(
    model: nn.Module,
    *,
    config: BalanceConfig | None = None,
    group: dist.ProcessGroup | None = None,
    vit: str | nn.Module | None = None,
) -> nn.Module:
    """Balance the ViT inside ``model`` (or ``model`` itself) in place; returns ``model``.

    The ViT's ``forward`` is replaced on the instance, so parameter names, ``state_dict`` keys,
    hooks and FSDP wrapping are untouched. When the ViT sits in a wrapper (``checkpoint_wrapper``,
    FSDP1, ``torch.compile``), the wrapper's ``forward`` is the one replaced, so images move
    before it runs. Calling it again updates config and group. Balancing runs while the ViT is
    in training mode (or always, with ``config.when="always"``): in eval mode (generation),
    ranks need not step together and no collective runs. Hugging Face VLMs
    and towers go to ``fx_vitbal.integrations.hf``. Wrappers around ``model`` (DDP, FSDP1,
    ``torch.compile``) are seen through.

    Args:
        vit: the ViT, or its dotted path in ``model``. Default: ``model`` if its class is
            registered, else the first submodule named one of ``VIT_CHILD_NAMES``, else the first
            submodule of a registered class.

    Raises:
        ValueError: no ViT found.
    """
    from fx_vitbal.integrations import hf  # it builds on this module

    inner = unwrap_module(model)
    if vit is None and hf.is_hf_model(inner):
        hf.enable_hf_vit_balance(inner, config=config, group=group)
        return model
    module = find_vit(inner, vit)
    original = getattr(module, "_vitbal_original_forward", module.forward)
    module._vitbal_original_forward = original
    module._vitbal_planner = planner_for(module, config or BalanceConfig())
    module.forward = functools.partial(_in_place_call, module, original, config, group)
    return model


def find_vit(model: nn.Module, vit: str | nn.Module | None = None) -> nn.Module:
    """Locate the ViT as ``enable_vit_balance`` documents, seeing through wrappers around
    ``model``; a ViT inside a wrapper is returned as its outermost wrapper.

    Raises:
        ValueError: no ViT found.
    """
    if isinstance(vit, nn.Module):
        return vit
    if _is_registered(model):
        return model
    model = unwrap_module(model)
    if isinstance(vit, str):
        return model.get_submodule(vit)
    named = list(model.named_modules())  # pre-order: a wrapper comes before what it wraps
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
    """``(group_name, world_size)`` of ``group`` (default: WORLD); None when not distributed.

    Warns once when the environment says several ranks were launched (``WORLD_SIZE`` > 1, as
    torchrun sets it) but no process group is initialised: balancing would silently be off.
    """
    if not (dist.is_available() and dist.is_initialized()):
        if not torch.compiler.is_compiling():  # eager calls warn; dynamo would trace the cache
            _warn_if_launched_without_group()
        return None
    group = group or dist.group.WORLD
    size = dist.get_world_size(group)
    return (group.group_name, size) if size > 1 else None


@functools.cache
def _warn_if_launched_without_group() -> None:
    launched = os.environ.get("WORLD_SIZE", "1")
    if launched.isdigit() and int(launched) > 1:
        log.warning(
            "vit dp balance: WORLD_SIZE=%s but no torch.distributed process group is "
            "initialised, so ViT balancing is off; call torch.distributed.init_process_group() "
            "before the first step",
            launched,
        )


def planner_for(vit: nn.Module, config: BalanceConfig) -> tuple[str, int]:
    """``(planner spec string, merge size)`` for ``vit`` under ``config``.

    Kept on the ViT for the last config it was asked with, so a step pays for the JSON once.
    Under ``torch.compile`` it is a constant (the ViT's class and the config do not change
    while a compiled graph lives, and the string is an argument of the ``plan`` op, so it is
    part of the graph and of every cache key). Dynamo before torch 2.13 cannot make a constant
    of a call on a module, so there the settings must have been made before the trace.

    Raises:
        RuntimeError: traced by dynamo before torch 2.13 with no settings made yet.
    """
    cached = getattr(vit, "_vitbal_settings", None)
    if cached is not None and cached[0] is config:
        return cached[1]
    if torch.compiler.is_compiling() and not _compat.DYNAMO_CALLS_ON_MODULES_ARE_CONSTANTS:
        raise RuntimeError(
            f"vit dp balance: torch {torch.__version__} cannot trace the balancing settings of "
            f"a {type(vit).__qualname__} (torch >= 2.13 can); make them before compiling: "
            "call fx_vitbal.enable_vit_balance on the ViT or its model, or call "
            "dp_balance_vit_encoder once outside torch.compile with the same config object"
        )
    settings = _settings(vit, config)
    if not torch.compiler.is_compiling():
        vit._vitbal_settings = (config, settings)
        layout_token(vit)  # made here too, so graphs traced later read it as a constant
    return settings


def layout_token(vit: nn.Module) -> int:
    """A number naming ``vit`` for the output layouts the ranks agreed on
    (``metadata.layout_key``): unique in this process, never reused by a later ViT the way
    ``id()`` is once the first is freed. Kept on the ViT; a graph traced before it had one
    bakes a fresh one in as a constant (its first call then agrees on layouts again)."""
    token = getattr(vit, "_vitbal_layout_token", None)
    if token is None:
        token = _new_layout_token()
        if not torch.compiler.is_compiling():
            vit._vitbal_layout_token = token
    return token


_LAYOUT_TOKENS = itertools.count(1)


@torch.compiler.assume_constant_result
def _new_layout_token() -> int:
    return next(_LAYOUT_TOKENS)


@torch.compiler.assume_constant_result
def _settings(vit: nn.Module, config: BalanceConfig) -> tuple[str, int]:
    spec = vision_encoder_spec(vit)
    architecture = spec.cost_model(unwrap_module(vit)) if spec.cost_model is not None else None
    cost_model = choose_cost_model(config.cost_model, config.cost_coeffs, architecture)
    split = config.split_frames and spec.frame_independent
    return planner_spec(dataclasses.replace(config, split_frames=split), cost_model), (
        spec.merge_size(vit)
    )


def regenerate_window_index(vit: nn.Module, grid_thw: torch.Tensor) -> torch.Tensor:
    """``vit.get_window_index(grid)`` as a tensor (some ViTs return ``(index, cu_seqlens)``)."""
    index = unwrap_module(vit).get_window_index(grid_thw)
    return index[0] if isinstance(index, tuple) else index


def balancing_active(vit: nn.Module, config: BalanceConfig) -> bool:
    """The one rule of every path: enabled, and the ViT trains or ``config.when == "always"``.
    (Whether a multi-rank group exists is the caller's other condition.)"""
    return config.enabled and in_balancing_mode(vit, config.when)


def in_balancing_mode(vit: nn.Module, when: str) -> bool:
    """``vit`` trains, or ``when == "always"``; rewritten graphs call this when they run."""
    return vit.training or when == "always"


def _balanced_call(
    vit, call, pixel_values, image_grid_thw, config=None, group=None, planner=None, planned=None
):
    config = config or DEFAULT_CONFIG
    dist_info = group_name_and_size(group)
    if not (dist_info is not None and balancing_active(vit, config)):
        if pixel_values is None:  # no images here and nothing to take part in
            return None, None, []
        return call(pixel_values, image_grid_thw)
    planner, merge = planner or planner_for(vit, config)
    # Unbalanced, a parent that passes a tensor runs the ViT on it even with zero rows, so the
    # ViT's parameters get (zero) gradients; DDP fails the next step if they get none.
    problem = 0
    if pixel_values is None:  # no images here: take part with rows in the others' layout
        pixel_values, problem = _stand_in_pixels(vit)
        image_grid_thw = torch.empty(0, 3, dtype=torch.long, device=pixel_values.device)

    def run(pixels, grid):
        embeds, window_index, deepstack = call(pixels, grid)
        return [embeds, *deepstack], window_index

    outputs, window_index = run_balanced(
        run, pixel_values, image_grid_thw, merge, planner, dist_info, True, planned, vit, problem
    )
    if outputs is None:  # no pixel tensor anywhere, or a problem every rank raises
        # (A compiled rank returns the plan's empty output: it keeps the op in the graph.)
        return (window_index if problem else None), None, []
    if window_index is not None:
        window_index = regenerate_window_index(vit, image_grid_thw)
    return outputs[0], window_index, list(outputs[1:])


def _stand_in_pixels(vit: nn.Module) -> tuple[torch.Tensor, int]:
    """Empty pixels for a rank that passed None, and a ``metadata.PROBLEMS`` code (0: none).

    Eagerly they have no width: the plan tells the rank the others' (``_taking_part``). A
    compiled graph fixes its shapes when traced, so there the width must be known then: the
    registered ``pixel_width`` (``VisionEncoderSpec``), with the ViT's parameter dtype. Without
    one, every rank raises (the stand-in only carries the problem code to the plan).
    """
    params = list(vit.parameters())
    device = params[0].device if params else torch.device("cpu")
    if not torch.compiler.is_compiling():
        return torch.empty(0, 0, device=device), 0
    pixel_width = vision_encoder_spec(vit).pixel_width
    dtype = params[0].dtype if params else torch.float32
    if pixel_width is None:
        return torch.empty(0, 0, dtype=dtype, device=device), PROBLEMS["compiled_without_pixels"]
    return torch.empty(0, pixel_width(unwrap_module(vit)), dtype=dtype, device=device), 0


def run_balanced(
    run,
    pixel_values,
    image_grid_thw,
    merge,
    planner,
    dist_info,
    grad_without_images=False,
    planned=None,
    module=None,
    problem=0,
):
    """plan -> redistribute -> ``run(pixels, grid)`` -> restore, the one balanced ViT call of
    every eager and in-place path (and of compiled wrappers, which trace it).

    ``run`` returns ``(outputs, extra)``: the embeddings to move home (pre-merger or merged
    layout each) and anything else, passed back untouched. Returns ``(restored outputs, extra)``.
    An empty ``[0, 0]`` ``pixel_values`` (what ``None`` becomes) receives rows in the other
    ranks' layout.

    Every decision below comes from the gathered metadata, so all ranks take the same branch:
    - a skipped plan runs ``run`` on the local batch with no copy, except on a rank with no
      image, which goes through the ops so its ViT computes the dummy unit, never zero rows;
    - when no rank has an image, every rank runs the dummy unit to learn the outputs' widths and
      returns them empty, or returns ``(None, extra)`` if no rank passed a pixel tensor at all.
      It runs under ``no_grad`` (the ViT's parameters get no gradient, as when a parent skips
      its ViT on text-only batches, like Hugging Face's) unless ``grad_without_images``: then the
      empty outputs stay in the graph and the parameters get zero gradients, as when a parent
      calls its ViT on zero rows (LoongForge's ``encode_images``; DDP without
      ``find_unused_parameters`` needs it). The choice is the caller's, the same on every rank,
      so FSDP's backward collectives stay matched. (Under ``torch.compile`` the dummy unit always
      runs with gradients: zeros.)
    ``planned`` (a ``fx_vitbal.ahead.PlannedBatch``) replaces the ``plan`` op's gather and solve.
    ``module``: the ViT, which names its agreed output layouts (``metadata.layout_key``) and
    whose trainable parameters' gradients mark the end of its backward for the measured times
    (``fx_vitbal.timing``; eager only: compiled calls report no time). ``problem``: a
    ``metadata.PROBLEMS`` code the caller found; the plan raises it on every rank.

    Host reads: the plan's one (its gathered metadata; none planned ahead), then none: ``restore``
    never waits for the ViT (``ops.restore``).
    """
    group_name, world_size = dist_info
    area = merge * merge
    compiling = torch.compiler.is_compiling()
    if planned is None:
        module_key = layout_token(module) if module is not None else 0
        grid, routing = ops.plan(
            pixel_values,
            image_grid_thw,
            merge,
            planner,
            world_size,
            group_name,
            True,
            module_key,
            problem,
            compiling,
        )
        if problem:  # raised by the plan on every rank; its output keeps the op in the graph
            return None, grid[:0]
    else:
        pixel_values, grid, routing = _planned_inputs(
            planned, pixel_values, image_grid_thw, (planner, merge), group_name
        )
    if not compiling:
        route = Routing.of(routing)
        run = _timed(run, getattr(routing, "_vitbal_clock", None), module)
        if not route.any_units:
            return _without_images(run, pixel_values, route, area, grad_without_images)
        if not route.applied and pixel_values.shape[0]:
            return run(pixel_values, image_grid_thw)  # skipped on every rank: no copies at all
        pixel_values = _taking_part(pixel_values, route)
    (pixels,) = ops.redistribute([pixel_values], routing, area, [area], None, group_name)
    outputs, extra = run(pixels, grid)
    layouts = ops.output_block_rows(outputs, pixels.shape[0], area)
    rows = ops.home_rows(layouts, pixel_values.shape[0], area)
    check_now = ops.no_backward_will_come(outputs)
    restored = ops.restore(outputs, routing, area, layouts, rows, group_name, True, check_now)
    return restored, extra


def _timed(run, clock, module):
    """``run`` with this rank's clock of the call around it (``fx_vitbal.timing``)."""
    if clock is None:
        return run

    def timed(pixels, grid):
        clock.forward_started(pixels.device)
        outputs, extra = run(pixels, grid)
        clock.forward_ended(outputs, pixels, timing.watch_parameters(module))
        return outputs, extra

    return timed


# Under torch.compile, dynamo runs it eagerly between graphs; fullgraph=True refuses it.
@torch.compiler.disable(
    reason="a plan made ahead (fx_vitbal.plan_ahead) is handed over eagerly; with "
    "fullgraph=True, let the compiled graph plan in the step (pass no plan)"
)
def _planned_inputs(planned, pixel_values, image_grid_thw, settings, group_name):
    return planned.for_step(pixel_values, image_grid_thw, settings, group_name)


def _taking_part(pixel_values: torch.Tensor, route: Routing) -> torch.Tensor:
    """This rank's pixels as every rank's exchange expects them: a rank that passed None gets an
    empty tensor in the others' row layout (so it can receive rows), and when any rank's pixels
    require gradients, every rank's do, so all ranks run the backward exchange together (the
    gradient of a stand-in is simply dropped)."""
    width = math.prod(pixel_values.shape[1:])
    if not pixel_values.shape[0] and route.row_numel and width != route.row_numel:
        pixel_values = pixel_values.new_empty(0, route.row_numel, dtype=route.dtype)
    if route.pixels_need_grad and not pixel_values.requires_grad:
        pixel_values = pixel_values.detach().requires_grad_(True)
    return pixel_values


def _without_images(run, pixel_values, route, area, grad):
    if not route.row_numel:
        return None, None
    dummy = torch.zeros(area, route.row_numel, dtype=route.dtype, device=pixel_values.device)
    side = math.isqrt(area)
    grid = transfer.to_device(torch.tensor([[1, side, side]]), pixel_values.device)
    with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
        outputs, extra = run(dummy, grid)
    return [o[:0] for o in outputs], extra


def _in_place_call(vit, original, config, group, pixel_values, image_grid_thw):
    planner = vit._vitbal_planner
    planned = None
    if getattr(vit, "_vitbal_next_plan", None) is not None:  # fx_vitbal.use_plan: for one call
        planned = _take_plan(vit)
    return _balanced_call(
        vit, original, pixel_values, image_grid_thw, config, group, planner, planned
    )


@torch.compiler.disable(
    reason="a plan made ahead (fx_vitbal.plan_ahead) is handed over eagerly; with "
    "fullgraph=True, let the compiled graph plan in the step (use no plan)"
)
def _take_plan(vit: nn.Module) -> "PlannedBatch":
    planned, vit._vitbal_next_plan = vit._vitbal_next_plan, None
    return planned


def plain_forward(vit: nn.Module) -> Callable:
    """``vit``'s own call, without the balancing ``enable_vit_balance`` put in front of it (so
    a ViT already wrapped is never balanced twice, and a local check issues no collective)."""
    return getattr(vit, "_vitbal_original_forward", vit)


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
