"""Plan ahead: gather and solve a batch's plan in the data pipeline, off the step's critical path,
and hand it to the balanced ViT call, which then runs no metadata gather and no planner.

    plan_group = dist.new_group(backend="gloo")  # once, on every rank, in the main thread
    # in a data-loading thread (e.g. the one that pins memory), for each batch, on every rank:
    planned = fx_vitbal.plan_ahead(vit, pixel_values, image_grid_thw, group=plan_group)
    # in the step:
    fx_vitbal.dp_balance_vit_encoder(vit, pixel_values, image_grid_thw, plan=planned)
    # or, for a model balanced in place, an FX graph the pass rewrote, a compiled model
    # (fullgraph=True too) or a Hugging Face VLM: fx_vitbal.use_plan(model, planned); model(...)

For a Hugging Face VLM, ``plan_ahead(model, pixel_values, image_grid_thw,
pixel_values_videos=..., video_grid_thw=...)`` plans the parent's images and videos as its one
tower call will see them.

Rules that keep the ranks in lockstep:
- ``plan_ahead`` is a collective on ``group`` (one small gather, the one the step would issue):
  every rank calls it for the same batches in the same order. When it runs in another thread
  than the step, ``group`` must be a group of its own, so its gather never interleaves with the
  step's collectives on another communicator; its ranks must be the step group's, in the same
  order (checked at the step, from group membership: the same answer on every rank).
- The step takes the plan inside its ``vitbal::plan`` op and compares its batch with the planned
  one without communicating (``runtime.agree.handover``): a batch that differs makes every rank
  raise the same ``ValueError`` before any optimizer step can use the outputs, with no collective
  and no host read added.
- The output-layout key of a planned call (``runtime.transport.layouts.layout_key``: the ViT,
  pixel dtype, autocast) is taken when it is planned: plan under the autocast state of the step.
- ``torch.compile``: the plan op's body runs eagerly in any graph, so a compiled call uses a plan
  handed over with ``use_plan`` before it, ``fullgraph=True`` included.
"""

import logging
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import fx, nn

from fx_vitbal.config import BalanceConfig
from fx_vitbal.runtime.agree import handover
from fx_vitbal.runtime.agree.handover import PlannedBatch, batch_key
from fx_vitbal.runtime.agree.planning import solve_for_rank
from fx_vitbal.runtime.call import call_inputs
from fx_vitbal.runtime.transport import transfer
from fx_vitbal.runtime.transport.collectives import group_ranks
from fx_vitbal.runtime.vit.registry import (
    entry_points,
    find_vit,
    is_balanced_in_place,
    unwrap_module,
)
from fx_vitbal.runtime.vit.settings import (
    DEFAULT_CONFIG,
    layout_token,
    planner_for,
    python_call,
    replica_ranks,
)

__all__ = ["PlannedBatch", "plan_ahead", "use_plan"]

log = logging.getLogger(__name__)


def plan_ahead(
    vit: nn.Module,
    pixel_values: torch.Tensor | None,
    image_grid_thw: torch.Tensor | None,
    *,
    group: dist.ProcessGroup,
    config: BalanceConfig | None = None,
    replica_group: dist.ProcessGroup | Sequence[int] | None = None,
    pixel_values_videos: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
) -> PlannedBatch:
    """Gather every rank's grid over ``group`` and solve this batch's plan now, for a later
    balanced ViT call (``dp_balance_vit_encoder(..., plan=...)`` or ``use_plan``).

    A collective on ``group``: every rank calls it for the same batches in the same order. Call
    it where the batch is known before the step (a data-loading thread of the training process;
    DataLoader worker *processes* hold no process group). From another thread than the step's,
    ``group`` must be a group of its own (``dist.new_group(backend="gloo")``), with the step
    group's ranks in the same order.

    Args:
        vit: the ViT the step calls, or a model it is balanced in (``enable_vit_balance``: it
            brings the config it was given, unless ``config`` is passed), or a Hugging Face VLM
            or tower balanced by it.
        pixel_values: the pixels exactly as the ViT will get them (shape, dtype,
            ``requires_grad``; a ``device="meta"`` tensor of that shape and dtype is enough, and
            copies nothing), or None on a rank without images (as in the step). For a Hugging
            Face VLM: the batch's ``pixel_values`` as the processor gave them. With
            ``replica_group``, the replicas' grids are compared here; their pixel values only
            where they are on the host (a checksum, computed on this thread), since reading
            pixels on a device would wait for the step's queued work and ``meta`` pixels hold
            none: replicas whose device pixels differ are caught only by a plan made in the
            step.
        image_grid_thw: their ``[t, h, w]`` rows (on the CPU: reading them waits for nothing).
        group: the group to gather over (gloo: everything stays on the CPU).
        config: balancing settings; must be the step's.
        replica_group: the ranks holding this rank's batch, as the step names them
            (``dp_balance_vit_encoder``; global ranks or a process group); must be the step's.
        pixel_values_videos, video_grid_thw: a Hugging Face VLM's videos of the batch.

    Returns:
        This rank's ``PlannedBatch``, for one step's ViT call.

    Raises:
        ValueError: on every rank, when any rank's input or settings are bad (as in the step).
        TypeError: videos given for a ViT that is not a Hugging Face one.
    """
    module, settings, _ = _planned_module(vit, None, config)
    entry = _entry_of(module)
    if entry is not None:  # the one tower call its parent will make (images, then videos)
        pixel_values, image_grid_thw = entry.plan_input(
            module, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw
        )
    elif pixel_values_videos is not None or video_grid_thw is not None:
        raise TypeError("videos are planned apart only for Hugging Face VLMs; pass them as pixels")
    # A rank without images passes None (host stand-ins); a bad batch raises on every rank.
    pixel_values, image_grid_thw, problem = call_inputs(
        module, pixel_values, image_grid_thw, None, rows_2d=entry is None
    )
    planner, merge = settings
    replicas = replica_ranks(group, replica_group)
    dist_info = (group.group_name, dist.get_world_size(group), replicas)
    call = python_call(module, planner, merge, dist_info, problem)
    grid, routing, state, solved = solve_for_rank(
        pixel_values,
        image_grid_thw,
        call,
        group,
        device_type=_step_device_type(module, pixel_values),
        # Reading pixels on a device here would wait for the step's queued work: replicas'
        # pixels are compared only from the host (``fx_vitbal.runtime.agree.replicas``).
        check_pixels=transfer.on_host(pixel_values),
    )
    return PlannedBatch(
        plan=solved,
        grid=grid,
        routing=routing,
        settings=settings,
        ranks=group_ranks(group),
        batch=batch_key(pixel_values, state.home_grid),  # the grid as gathered
        replicas=replicas,
        state=state,
    )


def use_plan(model: nn.Module, plan: PlannedBatch, *, vit: str | nn.Module | None = None) -> None:
    """Hand ``plan`` to the next balanced call of the ViT in ``model``: one balanced in place by
    ``enable_vit_balance`` (compiled or not, ``fullgraph=True`` too), a Hugging Face tower, the
    ViT of an FX graph that ``apply_vit_balance_pass`` rewrote, or ``model`` itself when it is
    the ViT (for the ``dp_balance_vit_encoder`` calls of a compiled function). That call
    consumes it; a later one plans in the step again. Call it outside any compiled function,
    before the call.

    Raises:
        ValueError: the ViT is not balanced.
    """
    module, _, balanced = _planned_module(model, vit, None)
    if not balanced:
        raise ValueError(
            f"{type(module).__qualname__} is not balanced: call enable_vit_balance on it or its "
            "model, or rewrite the model's graph with apply_vit_balance_pass"
        )
    handover.hand_over(layout_token(module), plan)


def _planned_module(model, vit, config) -> tuple[nn.Module, tuple[str, int], bool]:
    """The module whose balanced call a plan is for, its ``(planner spec, merge size)``, and
    whether that call is balanced by itself (a ViT balanced in place, a Hugging Face tower, the
    ViT of a rewritten graph), so a plan handed to it is taken."""
    inner = unwrap_module(model)
    plan_node = _plan_node(inner)
    if vit is None and is_balanced_in_place(inner):
        module = inner
    elif vit is None and _entry_of(inner) is not None:
        module = next(m for m in inner.modules() if hasattr(m, "_vitbal_hf"))
    else:
        module = find_vit(inner, vit)
    if hasattr(module, "_vitbal_hf"):  # a Hugging Face tower
        settings = (module._vitbal_hf.planner, module._vitbal_hf.merge)
    elif plan_node is not None:  # the pass baked them into the graph
        settings = (plan_node.args[3], plan_node.args[2])
    elif "_vitbal_planner" in vars(module) and config is None:
        settings = module._vitbal_planner
    else:
        settings = planner_for(module, config or DEFAULT_CONFIG)  # the step's default, cached
    # A ViT passed itself: the dp_balance_vit_encoder calls of a compiled function take its plan.
    balanced = is_balanced_in_place(module) or plan_node is not None or module is inner
    return module, settings, balanced


def _step_device_type(module: nn.Module, pixel_values: torch.Tensor) -> str:
    """The device type the step's ViT runs on, whose autocast state keys its output layouts:
    the pixels', or for ``meta`` pixels the ViT's parameters', else the current accelerator's."""
    if pixel_values.device.type != "meta":
        return pixel_values.device.type
    param = next(iter(module.parameters()), None)
    if param is not None and param.device.type != "meta":
        return param.device.type
    if not torch.accelerator.is_available():
        return "cpu"
    return torch.accelerator.current_accelerator().type


def _entry_of(module: nn.Module):
    """The entry point planning ``module``'s tower input (a Hugging Face VLM or tower), if any."""
    if not any(hasattr(m, "_vitbal_hf") for m in module.modules()):
        return None
    return next((e for e in entry_points() if e.plan_input and e.accepts(module)), None)


def _plan_node(model: nn.Module) -> fx.Node | None:
    """The ``vitbal::plan`` node of an FX graph the pass rewrote, else None."""
    if not isinstance(model, fx.GraphModule):
        return None
    plan_op = torch.ops.vitbal.plan.default
    return next((n for n in model.graph.nodes if n.target is plan_op), None)
