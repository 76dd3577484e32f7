"""``torch.library`` custom ops ``vitbal::plan``, ``vitbal::redistribute`` and ``vitbal::restore``.

These are the one implementation of balancing: the eager wrapper calls them directly, the FX pass
inserts them into graphs, and ``torch.compile`` traces them through their fake kernels.

Conventions (each one fixes a failure seen on torch 2.13):
- The group travels as ``group_name: str`` and the world size as an ``int`` argument; fake
  kernels read nothing but their arguments, so a graph compiled for 2 ranks can never be served
  from a cache to 4 ranks.
- Data-dependent row counts are fresh unbacked sizes (``new_dynamic_size``, ``min=0``: a rank
  may receive nothing). ``restore`` takes its output row count as a ``SymInt`` so the rest of the
  model sees ordinary (backed) sizes.
- The routing tensor lives on the CPU: reading it never syncs a GPU.
- All three are ordered side effects, so no compiler pass reorders or drops a collective.
- Each move's backward is the opposite move (``redistribute`` <-> ``restore``).
"""

import torch
import torch.distributed as dist
from torch._library.effects import EffectType

from fx_vitbal.exchange import (
    Routing,
    balanced_grid,
    exchange,
    gather_grids,
    local_routing,
    plan_units,
    routing_size,
)


def resolve_group(group_name: str) -> dist.ProcessGroup:
    """The process group registered under ``group_name``."""
    return dist.distributed_c10d._resolve_process_group(group_name)


@torch.library.custom_op("vitbal::plan", mutates_args=())
def plan(
    pixel_values: torch.Tensor,
    grid_thw: torch.Tensor,
    merge_size: int,
    planner: str,
    world_size: int,
    group_name: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather all ranks' grids, solve the plan, return ``(balanced grid, routing)``.

    The balanced grid lists this rank's units in arrival order (the original grid when the plan
    is not applied). ``planner`` is ``exchange.planner_spec(config, cost_model)``.
    """
    group = resolve_group(group_name)
    if dist.get_world_size(group) != world_size:
        raise ValueError(
            f"world_size={world_size} but group {group_name!r} has {dist.get_world_size(group)} "
            "ranks"
        )
    rank = dist.get_rank(group)
    grids_R = gather_grids(pixel_values, grid_thw, merge_size, group)
    solved, units_R = plan_units(grids_R, rank, planner)
    routing = local_routing(solved, units_R, rank).to_tensor()
    if not solved.applied:
        return grid_thw.clone(), routing
    rows = balanced_grid(solved, units_R, rank)
    grid = torch.tensor(rows, dtype=grid_thw.dtype, device=grid_thw.device).reshape(-1, 3)
    return grid, routing


@plan.register_fake
def _(pixel_values, grid_thw, merge_size, planner, world_size, group_name):
    ctx = torch.library.get_ctx()
    grid = grid_thw.new_empty(ctx.new_dynamic_size(min=0), 3)
    routing = torch.empty(
        routing_size(ctx.new_dynamic_size(min=0), world_size), dtype=torch.int64, device="cpu"
    )
    return grid, routing


@torch.library.custom_op("vitbal::redistribute", mutates_args=())
def redistribute(
    xs: list[torch.Tensor],
    routing: torch.Tensor,
    shrink: int,
    out_rows: int | None,
    group_name: str,
) -> list[torch.Tensor]:
    """Send each local unit's rows to the rank computing it; returns the balanced tensors.

    ``shrink`` divides pixel rows into the tensors' rows (1 for pixels, merge_size**2 for merged
    outputs). ``out_rows`` is only known in backward graphs, where it is the forward's input rows.
    """
    return _move(xs, routing, shrink, False, group_name)


@redistribute.register_fake
def _(xs, routing, shrink, out_rows, group_name):
    rows = out_rows if out_rows is not None else torch.library.get_ctx().new_dynamic_size(min=0)
    return [x.new_empty(rows, *x.shape[1:]) for x in xs]


@torch.library.custom_op("vitbal::restore", mutates_args=())
def restore(
    xs: list[torch.Tensor],
    routing: torch.Tensor,
    shrink: int,
    out_rows: int,
    group_name: str,
) -> list[torch.Tensor]:
    """Send computed rows back to each unit's home rank and original position."""
    return _move(xs, routing, shrink, True, group_name)


@restore.register_fake
def _(xs, routing, shrink, out_rows, group_name):
    return [x.new_empty(out_rows, *x.shape[1:]) for x in xs]


def _move(xs, routing, shrink, reverse, group_name):
    if not xs:
        raise ValueError("vitbal moves need at least one tensor")
    if len({x.shape[0] for x in xs}) != 1:
        raise ValueError(f"tensors moved together must share rows, got {[x.shape for x in xs]}")
    route = Routing.from_tensor(routing)
    if not route.applied:  # every rank agrees (the plan is global): nothing to send anywhere
        return [x.clone() for x in xs]
    return exchange(xs, route, shrink, reverse, resolve_group(group_name))


def _setup_context(ctx, inputs, output):
    xs, routing, shrink, _, group_name = inputs
    ctx.routing, ctx.shrink, ctx.group_name = routing, shrink, group_name
    ctx.in_rows = xs[0].shape[0]
    ctx.out_like = [torch.empty_like(o, device="meta") for o in output]
    ctx.devices = [o.device for o in output]


def _gradients(ctx, grads):
    # A collective needs every tensor on every rank: unused outputs get zero gradients.
    return [
        g if g is not None else torch.zeros(like.shape, dtype=like.dtype, device=device)
        for g, like, device in zip(grads, ctx.out_like, ctx.devices, strict=True)
    ]


def _redistribute_backward(ctx, grads):
    moved = restore(_gradients(ctx, grads), ctx.routing, ctx.shrink, ctx.in_rows, ctx.group_name)
    return moved, None, None, None, None


def _restore_backward(ctx, grads):
    moved = redistribute(
        _gradients(ctx, grads), ctx.routing, ctx.shrink, ctx.in_rows, ctx.group_name
    )
    return moved, None, None, None, None


redistribute.register_autograd(_redistribute_backward, setup_context=_setup_context)
restore.register_autograd(_restore_backward, setup_context=_setup_context)
for _op in (plan, redistribute, restore):
    _op.register_effect(EffectType.ORDERED)
