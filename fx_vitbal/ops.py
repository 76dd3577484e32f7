"""``torch.library`` custom ops ``vitbal::plan``, ``vitbal::redistribute`` and ``vitbal::restore``.

These are the one implementation of balancing: the eager wrapper calls them directly, the FX pass
inserts them into graphs, and ``torch.compile`` traces them through their fake kernels.

Conventions (each one fixes a failure seen on torch 2.13):
- The group travels as ``group_name: str`` and the world size as an ``int`` argument; fake
  kernels read nothing but their arguments, so a graph compiled for 2 ranks can never be served
  from a cache to 4 ranks.
- Data-dependent row counts are fresh unbacked sizes (``new_dynamic_size``) with a true ``min``:
  every rank computes at least one unit (a dummy one if it has nothing else), which also keeps
  inductor's CPU bmm lowering from guarding on ``rows == 1``. ``restore`` takes its output row
  count as a ``SymInt`` so the rest of the model sees ordinary (backed) sizes; ``routing`` has a
  size derived from the pixel rows, so ``plan`` adds a single fresh size (the balanced grid's).
- The routing tensor lives on the CPU: reading it never syncs a GPU.
- No effect tokens: registering the ops as ``EffectType.ORDERED`` breaks inductor on torch 2.13
  (lowering ``with_effects`` re-creates the ops' unbacked sizes and the scheduler then fails
  with ``AssertionError: u8 not in {...}``). Order is already fixed by data: ``plan`` feeds
  ``routing`` to both moves, ``restore`` consumes the ViT's output, and every output is used.
- Each move's backward is the opposite move (``redistribute`` <-> ``restore``).
"""

import torch
import torch.distributed as dist

from fx_vitbal.exchange import (
    Routing,
    balanced_grid,
    exchange,
    gather_grids,
    local_routing,
    plan_units,
    routing_size,
    with_dummy,
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
    routing = local_routing(solved, units_R, rank, merge_size)
    routing = routing.to_tensor(max_units(pixel_values.shape[0], merge_size))
    rows = balanced_grid(solved, units_R, rank, merge_size)
    if not solved.applied:  # the original batch, plus the dummy unit if it is empty
        rows = grid_thw.tolist() or rows
    grid = torch.tensor(rows, dtype=grid_thw.dtype, device=grid_thw.device)
    return grid, routing


def max_units(pixel_rows: int, merge_size: int) -> int:
    """Upper bound on a rank's units: each has at least ``merge_size**2`` rows."""
    return pixel_rows // (merge_size * merge_size)


@plan.register_fake
def _(pixel_values, grid_thw, merge_size, planner, world_size, group_name):
    ctx = torch.library.get_ctx()
    grid = grid_thw.new_empty(ctx.new_dynamic_size(min=1), 3)  # >= 1: the dummy unit
    size = routing_size(max_units(pixel_values.shape[0], merge_size), world_size)
    routing = torch.empty(size, dtype=torch.int64, device="cpu")
    return grid, routing


@torch.library.custom_op("vitbal::redistribute", mutates_args=())
def redistribute(
    xs: list[torch.Tensor],
    routing: torch.Tensor,
    shrink: int,
    min_rows: int,
    out_rows: int | None,
    group_name: str,
) -> list[torch.Tensor]:
    """Send each local unit's rows to the rank computing it; returns the balanced tensors.

    ``shrink`` divides pixel rows into the tensors' rows (1 for pixels, merge_size**2 for merged
    outputs). ``min_rows`` is a true lower bound on the result's rows (the dummy unit's rows),
    declared to the compiler. ``out_rows`` is only known in backward graphs, where it is the
    forward's input rows.
    """
    return _move(xs, routing, shrink, False, group_name)


@redistribute.register_fake
def _(xs, routing, shrink, min_rows, out_rows, group_name):
    if out_rows is None:
        out_rows = torch.library.get_ctx().new_dynamic_size(min=min_rows)
    return [x.new_empty(out_rows, *x.shape[1:]) for x in xs]


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
    dummy = route.dummy_rows // shrink
    if reverse:
        xs = with_dummy(xs, dummy, add=False)
    if route.applied:
        xs = exchange(xs, route, shrink, reverse, resolve_group(group_name))
    else:  # every rank agrees (the plan is global): nothing to send anywhere
        xs = [x.clone() for x in xs]
    return xs if reverse else with_dummy(xs, dummy, add=True)


def _setup_context(ctx, inputs, output):
    xs, routing, shrink, group_name = inputs[0], inputs[1], inputs[2], inputs[-1]
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
    return moved, None, None, None, None, None


def _restore_backward(ctx, grads):
    moved = redistribute(
        _gradients(ctx, grads), ctx.routing, ctx.shrink, 0, ctx.in_rows, ctx.group_name
    )
    return moved, None, None, None, None


redistribute.register_autograd(_redistribute_backward, setup_context=_setup_context)
restore.register_autograd(_restore_backward, setup_context=_setup_context)
