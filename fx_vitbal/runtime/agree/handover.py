"""Plans made ahead (``fx_vitbal.plan_ahead``), handed over to the ``vitbal::plan`` op of the
ViT call they were made for.

A plan waits here, keyed by the ViT's layout token and this rank, until that ViT's next
balanced call: its ``vitbal::plan`` op takes it and returns the planned grid and routing instead
of gathering and solving. The hand-over lives inside the op, so every path that calls the op
uses it alike: the eager call, a ViT balanced in place, a Hugging Face tower, an FX graph the
pass rewrote, and compiled graphs, ``fullgraph=True`` included (the op's body runs eagerly
whatever graph holds it).

The op compares, on each rank and without communicating, the batch it gets (pixel shape, dtype
and ``requires_grad``, the grid's values) and the settings (planner, merge size) with what was
planned. A rank whose batch differs still takes part in the exchange with the planned sizes
(``redistribute`` sends zeros of the planned shape in place of pixels that do not fit) and its
routing is flagged, or, for a grid on the device, a device flag is compared there; the flag
rides in the rank's status word inside the outputs' exchange (``runtime.transport.status``), so
every rank raises the same ``ValueError`` in ``restore``'s backward (or at the end of ``restore``
when no backward will come). No collective and no host read are added for it. When the plan moves
nothing (the same on every rank), a rank runs its own batch locally, which is exactly the
unbalanced call; a batch that differs then only logs a warning.
"""

import dataclasses
import functools
import logging
import threading

import torch
import torch.distributed as dist

from fx_vitbal.plan.units import Plan
from fx_vitbal.runtime.transport import status, transfer
from fx_vitbal.runtime.transport.routing import Routing, local_outputs, routing_size
from fx_vitbal.runtime.transport.state import StepState
from fx_vitbal.runtime.vit.settings import BalancedCall

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
    replicas: tuple[int, ...] = ()
    """The group ranks holding this rank's batch it was planned with (``runtime.agree.replicas``);
    the step must name the same."""
    state: StepState | None = None
    """The call's host state (``runtime.transport.state``), registered by the step that takes the
    plan."""


def batch_key(pixel_values: torch.Tensor, grid_rows: list[list[int]]) -> BatchKey:
    """What a step compares with the planned batch: pixel shape, dtype, ``requires_grad`` and
    grid values (``grid_rows``: as the plan gathered them, on the host; the step compares a
    device grid on the device)."""
    shape = tuple(pixel_values.shape)
    return shape, pixel_values.dtype, pixel_values.requires_grad, grid_rows


# Plans waiting for their ViT's next call, by (layout token, global rank): ranks that are
# threads of one process (torch's threaded test process group) keep their own.
_WAITING: dict[tuple[int, int], PlannedBatch] = {}
_LOCK = threading.Lock()


def hand_over(layout_token: int, planned: PlannedBatch) -> None:
    """Keep ``planned`` for the next balanced call of the ViT with ``layout_token``."""
    with _LOCK:
        _WAITING[(layout_token, dist.get_rank())] = planned


def take(layout_token: int) -> PlannedBatch | None:
    """The plan waiting for this call of the ViT with ``layout_token``, if any (taken)."""
    with _LOCK:
        return _WAITING.pop((layout_token, dist.get_rank()), None)


def step_outputs(
    planned: PlannedBatch,
    pixel_values: torch.Tensor,
    grid_thw: torch.Tensor,
    call: BalancedCall,
    group: dist.ProcessGroup,
    max_units: int,
) -> tuple[torch.Tensor, torch.Tensor, StepState | None]:
    """``vitbal::plan``'s outputs ``(balanced grid, routing)`` from ``planned`` (module doc),
    and the call's host state to register (``runtime.transport.state``: the planned state,
    re-keyed; None when nothing of it applies). ``call``: the step's; its planner and merge size
    must be the planned ones, its replicas too, and a plan that splits a frame needs a call that
    runs bands (``call.runs_bands``): else the batch counts as not planned. Compiled calls
    (``call.grad_fixed``) do not compare ``requires_grad``; a ``call.problem`` with no gather to
    carry it makes this rank's batch not the one planned. ``max_units``: the routing size the
    op's fake kernel gives this call.

    Raises:
        ValueError: the planning group's ranks are not the step group's, in the same order.
    """
    step_ranks = tuple(dist.get_process_group_ranks(group))
    if step_ranks != planned.ranks:
        raise ValueError(
            f"plan_ahead planned over ranks {list(planned.ranks)} but the ViT call's group has "
            f"ranks {list(step_ranks)}; plan over a group with the same ranks, in order"
        )
    kept = planned.state
    route = kept.route
    same = (
        not call.problem
        and (call.planner, call.merge_size) == planned.settings
        and call.replicas == planned.replicas
        and (call.runs_bands or not route.split)
        and _same_shapes(planned.batch, pixel_values, grid_thw, call.grad_fixed)
    )
    if not route.applied:  # nothing moves anywhere: this rank's own batch, as it is
        if not same:
            log.warning(
                "vit dp balance: rank %d's batch or settings differ from the ones planned "
                "ahead; the plan moves nothing, so this rank runs its ViT on its own batch",
                dist.get_rank(group),
            )
        local_grid, routing = local_outputs(  # with the pixel layout the ranks agreed on
            pixel_values,
            grid_thw,
            call.merge_size,
            len(step_ranks),
            any_units=route.any_units or bool(pixel_values.shape[0]),
            row_numel=route.row_numel,
            dtype_code=route.dtype_code,
            step=route.step,
        )
        if not same:
            return local_grid, routing, None
        # As planned: its units (frames split where they may be), and the grid's host copy.
        local = StepState(routing, Routing.from_tensor(routing), home_grid=kept.home_grid)
        return transfer.to_device(planned.grid, grid_thw.device).to(grid_thw.dtype), routing, local
    grid = transfer.to_device(planned.grid, grid_thw.device).to(grid_thw.dtype)
    mismatched = not same
    if same and transfer.on_host(grid_thw):
        mismatched = grid_thw.tolist() != planned.batch[3]  # a host read: waits for nothing
    elif same:  # compared where the grid lives; the verdict joins the status word
        # ``view``: a rank without images planned ``[]``, which must compare as ``[0, 3]``.
        want = torch.tensor(planned.batch[3], dtype=torch.int64, device="cpu").view(-1, 3)
        want = transfer.to_device(want, grid_thw.device)
        status.flag_not_as_planned(group.group_name, route.step, (grid_thw != want).any())
    units = max(max_units, len(route.unit_rows))  # only a batch that differs needs more
    size = routing_size(units, len(step_ranks), route.replicated)
    if not mismatched and planned.routing.numel() == size:
        return grid, planned.routing, kept  # as planned
    routing = route.repacked(planned.routing, mismatched=mismatched, max_units=units)
    output_routing = kept.output_routing
    if output_routing is not None:  # ``planning._rows_routing``, as mismatched as this one
        output_routing = functools.partial(output_routing, mismatched=mismatched)
    repacked = dataclasses.replace(
        kept,
        routing=routing,
        route=Routing.from_tensor(routing),
        home_grid=None if mismatched else kept.home_grid,
        output_routing=output_routing,
    )
    return grid, routing, repacked


def _same_shapes(batch: BatchKey, pixel_values, grid_thw, grad_fixed: bool) -> bool:
    """The host-known part of ``batch_key``: pixel shape, dtype, requires_grad, grid rows."""
    shape, dtype, grad, grid = batch
    return (
        (tuple(pixel_values.shape), pixel_values.dtype) == (shape, dtype)
        and (grad_fixed or pixel_values.requires_grad == grad)
        and tuple(grid_thw.shape) == (len(grid), 3)
    )
