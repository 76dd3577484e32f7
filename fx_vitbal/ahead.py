"""Plan ahead: gather and solve a batch's plan in the data pipeline, off the step's critical path,
and hand it to the balanced ViT call, which then runs no metadata gather and no planner.

    plan_group = dist.new_group(backend="gloo")  # once, on every rank, in the main thread
    # in a data-loading thread (e.g. the one that pins memory), for each batch, on every rank:
    planned = fx_vitbal.plan_ahead(vit, pixel_values, image_grid_thw, group=plan_group)
    # in the step:
    fx_vitbal.dp_balance_vit_encoder(vit, pixel_values, image_grid_thw, plan=planned)
    # or, for a model balanced in place: fx_vitbal.use_plan(model, planned); model(...)

Rules that keep the ranks in lockstep:
- ``plan_ahead`` is a collective on ``group`` (one small gather, the one the step would issue):
  every rank calls it for the same batches in the same order. When it runs in another thread
  than the step, ``group`` must be a group of its own, so its gather never interleaves with the
  step's collectives on another communicator; its ranks must be the step group's, in the same
  order (checked at the step, from group membership: the same answer on every rank).
- The step compares, on each rank and without communicating, the batch the ViT gets (pixel
  shape, dtype and ``requires_grad``, the grid's values) and the settings (planner, merge size)
  with what was planned. A rank whose batch differs still takes part in the exchange with the
  planned shapes (zeros stand in for its pixels when the shapes differ) and sets a flag: in its
  routing when the host knows it, or, for a grid on the device, as a device boolean compared
  there. The flag rides in the rank's status word inside the outputs' exchange
  (``fx_vitbal.runtime.status``): every rank then raises the same ``ValueError`` in ``restore``'s
  backward (or at the end of ``restore`` when no backward will come), before any optimizer step
  can use the outputs. No collective and no host read are added for it.
- The output-layout key of a planned call (``runtime.layouts.layout_key``: the ViT, pixel dtype,
  autocast) is taken when it is planned: plan under the autocast state of the step.
- When the plan moves nothing (``plan.applied`` is False, the same on every rank), the step has
  no collective at all: a rank whose batch differs runs its ViT on the batch it got, locally,
  which is exactly the unbalanced call (a malformed batch then fails there as it would
  unbalanced); it logs a warning. Nothing crosses ranks, so no other rank can be corrupted.
- ``torch.compile``: with ``fullgraph=False`` the hand-over runs eagerly between graphs (it is
  ``torch.compiler.disable``d), so a compiled call uses the plan; ``fullgraph=True`` cannot
  leave the graph and refuses a plan (``runtime.call._planned_inputs``): the graph plans in the
  step.
"""

import dataclasses
import logging

import torch
import torch.distributed as dist
from torch import nn

from fx_vitbal.config import BalanceConfig
from fx_vitbal.plan.units import Plan
from fx_vitbal.runtime import planning, status, transfer
from fx_vitbal.runtime.planning import group_ranks, max_units, resolve_group, solve_for_rank
from fx_vitbal.runtime.routing import Routing
from fx_vitbal.runtime.settings import layout_token, planner_for
from fx_vitbal.runtime.vits import find_vit, is_balanced_in_place

log = logging.getLogger(__name__)

# What a step compares with the batch it was planned for: pixel shape, dtype, requires_grad, grid.
BatchKey = tuple[tuple[int, ...], torch.dtype, bool, list]


@dataclasses.dataclass(frozen=True, eq=False)
class PlannedBatch:
    """One rank's plan for one batch, made by ``plan_ahead``; every tensor is on the CPU."""

    plan: Plan
    """The solved plan, the same on every rank (``applied``, ``reason``, loads, rows moved)."""
    grid: torch.Tensor
    """The grid rows this rank's ViT computes, in arrival order (``vitbal::plan``'s grid)."""
    routing: torch.Tensor
    """This rank's packed ``routing.Routing`` (``vitbal::plan``'s second output), parsed."""
    settings: tuple[str, int]
    """``(planner spec, merge size)`` it was solved with; the step must use the same."""
    ranks: tuple[int, ...]
    """Global ranks of the planning group, in group order."""
    batch: BatchKey
    """This rank's batch as planned (see ``batch_key``)."""

    def for_step(
        self,
        pixel_values: torch.Tensor,
        image_grid_thw: torch.Tensor,
        settings: tuple[str, int],
        group_name: str,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(pixels, balanced grid, routing)`` for ``runtime.call.run_balanced``, in place of
        ``vitbal::plan``'s outputs (see the module doc for a batch that differs).

        Raises:
            ValueError: the planning group's ranks are not the step group's, in the same order.
        """
        step_ranks = group_ranks(resolve_group(group_name))
        if step_ranks != self.ranks:
            raise ValueError(
                f"plan_ahead planned over ranks {list(self.ranks)} but the ViT call's group has "
                f"ranks {list(step_ranks)}; plan over a group with the same ranks, in order"
            )
        status.check(group_name)  # a step whose backward never ran: its outputs' verdict first
        route = Routing.of(self.routing)
        if not route.applied:  # nothing moves anywhere: this rank's own batch, as it is
            if settings != self.settings or not _same_shapes(
                self.batch, pixel_values, image_grid_thw
            ):
                log.warning(
                    "vit dp balance: rank %d's batch or settings differ from the ones planned "
                    "ahead; the plan moves nothing, so this rank runs its ViT on its own batch",
                    dist.get_rank(resolve_group(group_name)),
                )
            return _local_step(pixel_values, image_grid_thw, settings, route, group_name)
        grid = transfer.to_device(self.grid, image_grid_thw.device).to(image_grid_thw.dtype)
        if settings == self.settings and _same_shapes(self.batch, pixel_values, image_grid_thw):
            routing = self.routing
            if transfer.on_host(image_grid_thw):
                if image_grid_thw.tolist() != self.batch[3]:  # a host read: waits for nothing
                    routing = _flagged(self.routing)
            else:  # compared where the grid lives; the verdict rides in the status word
                planned = transfer.to_device(torch.tensor(self.batch[3]), image_grid_thw.device)
                routing._vitbal_grid_differs = (image_grid_thw != planned).any()
            return pixel_values, grid, routing
        shape, dtype, _, _ = self.batch
        stand_in = torch.zeros(shape, dtype=dtype, device=pixel_values.device)
        return stand_in, grid, _flagged(self.routing)


def _same_shapes(batch: "BatchKey", pixel_values, image_grid_thw) -> bool:
    """The host-known part of ``batch_key``: pixel shape, dtype, requires_grad, grid rows."""
    shape, dtype, grad, grid = batch
    return (tuple(pixel_values.shape), pixel_values.dtype, pixel_values.requires_grad) == (
        shape,
        dtype,
        grad,
    ) and tuple(image_grid_thw.shape) == (len(grid), 3)


def _flagged(routing: torch.Tensor) -> torch.Tensor:
    """``routing`` marked ``Routing.mismatched``: restore's status word then makes every rank
    raise."""
    return Routing.of(routing).repacked(routing, mismatched=True)


def plan_ahead(
    vit: nn.Module,
    pixel_values: torch.Tensor | None,
    image_grid_thw: torch.Tensor | None,
    *,
    group: dist.ProcessGroup,
    config: BalanceConfig | None = None,
) -> PlannedBatch:
    """Gather every rank's grid over ``group`` and solve this batch's plan now, for a later
    balanced ViT call (``dp_balance_vit_encoder(..., plan=...)`` or ``use_plan``).

    A collective on ``group``: every rank calls it for the same batches in the same order. Call
    it where the batch is known before the step (a data-loading thread of the training process;
    DataLoader worker *processes* hold no process group). From another thread than the step's,
    ``group`` must be a group of its own (``dist.new_group(backend="gloo")``), with the step
    group's ranks in the same order.

    Args:
        vit: the ViT the step calls; a ViT balanced in place by ``enable_vit_balance`` brings
            the config it was given, unless ``config`` is passed.
        pixel_values: the pixels exactly as the ViT will get them (shape, dtype,
            ``requires_grad``; a ``device="meta"`` tensor of that shape and dtype is enough, and
            copies nothing), or None on a rank without images (as in the step).
        image_grid_thw: their ``[t, h, w]`` rows (on the CPU: reading them waits for nothing).
        group: the group to gather over (gloo: everything stays on the CPU).
        config: balancing settings; must be the step's.

    Returns:
        This rank's ``PlannedBatch``, for one step's ViT call.

    Raises:
        ValueError: on every rank, when any rank's input or settings are bad (as in the step).
    """
    if "_vitbal_planner" in vars(vit) and config is None:
        settings = vit._vitbal_planner
    else:
        settings = planner_for(vit, config or BalanceConfig())
    if pixel_values is None:  # the stand-ins the step uses for a rank without images
        pixel_values = torch.empty(0, 0)
        image_grid_thw = torch.empty(0, 3, dtype=torch.long)
    planner, merge = settings
    grid, routing, solved = solve_for_rank(
        pixel_values, image_grid_thw, merge, planner, group, module_key=layout_token(vit)
    )
    Routing.of(routing)  # parse it here, not in the step
    return PlannedBatch(
        plan=solved,
        grid=grid.cpu(),
        routing=routing,
        settings=settings,
        ranks=group_ranks(group),
        batch=batch_key(pixel_values, image_grid_thw),
    )


def use_plan(model: nn.Module, plan: PlannedBatch, *, vit: str | nn.Module | None = None) -> None:
    """Hand ``plan`` to the next call of the ViT that ``enable_vit_balance`` balances in ``model``
    (``model`` may be that ViT); that call consumes it, a later one plans in the step again.

    Raises:
        ValueError: the ViT is not balanced in place.
        TypeError: a Hugging Face tower (not supported with plan-ahead yet).
    """
    module = model if vit is None and is_balanced_in_place(model) else find_vit(model, vit)
    if not is_balanced_in_place(module):
        raise ValueError(f"{type(module).__qualname__} is not balanced: call enable_vit_balance")
    if hasattr(module, "_vitbal_hf"):
        raise TypeError("plan-ahead does not support Hugging Face vision towers yet")
    module._vitbal_next_plan = plan


def batch_key(pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> BatchKey:
    """What a step compares with the planned batch: pixel shape, dtype, ``requires_grad`` and
    grid values (read here, ahead of the step; the step compares a device grid on the device)."""
    shape = tuple(pixel_values.shape)
    return shape, pixel_values.dtype, pixel_values.requires_grad, image_grid_thw.tolist()


def _local_step(pixel_values, image_grid_thw, settings, route, group_name):
    """A rank's own batch, kept home (the plan moved nothing anywhere): ``vitbal::plan``'s
    inactive outputs, with the pixel layout the ranks agreed on, so a rank without images still
    runs the dummy unit in their row width."""
    planner, merge = settings
    world = dist.get_world_size(resolve_group(group_name))
    grid, routing = planning.plan(
        pixel_values, image_grid_thw, merge, planner, world, group_name, active=False
    )
    local = dataclasses.replace(
        Routing.of(routing),
        any_units=route.any_units or bool(pixel_values.shape[0]),
        row_numel=route.row_numel,
        dtype_code=route.dtype_code,
    )
    return pixel_values, grid, local.to_tensor(max_units(pixel_values.shape[0], merge))
