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

import dataclasses

import torch
import torch.distributed as dist
from torch.fx.experimental.symbolic_shapes import guard_or_false

from fx_vitbal.exchange import (
    Routing,
    as_blocks,
    balanced_grid,
    exchange,
    from_blocks,
    local_only_routing,
    local_routing,
    plan_units,
    routing_size,
    with_dummy,
)
from fx_vitbal.measured import measurements_for, publish
from fx_vitbal.metadata import check_output_layouts, gather_grids, row_numel, settings_fingerprint
from fx_vitbal.planner import Plan


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
    active: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather all ranks' grids, solve the plan, return ``(balanced grid, routing)``.

    The balanced grid lists this rank's units in arrival order (the original grid when the plan
    is not applied), or the dummy unit ``[1, m, m]`` when there are none. ``planner`` is
    ``exchange.planner_spec(config, cost_model)``; its fingerprint rides in the metadata, so
    ranks with different settings all raise. ``active=False`` (balancing off for this call,
    e.g. eval mode) gathers nothing: the local batch stays home and no collective runs in any op.
    """
    group = resolve_group(group_name)
    if dist.get_world_size(group) != world_size:
        raise ValueError(
            f"world_size={world_size} but group {group_name!r} has {dist.get_world_size(group)} "
            "ranks"
        )
    if not active:
        rank = dist.get_rank(group)
        units = max_units(pixel_values.shape[0], merge_size)
        routing = local_only_routing(grid_thw.tolist(), rank, world_size, merge_size)
        rows = grid_thw.tolist() or [[1, merge_size, merge_size]]
        grid = torch.tensor(rows, dtype=grid_thw.dtype, device=grid_thw.device)
        return grid, routing.to_tensor(units)
    grid, routing, _ = solve_for_rank(pixel_values, grid_thw, merge_size, planner, group)
    return grid, routing


def solve_for_rank(
    pixel_values: torch.Tensor,
    grid_thw: torch.Tensor,
    merge_size: int,
    planner: str,
    group: dist.ProcessGroup,
) -> tuple[torch.Tensor, torch.Tensor, Plan]:
    """The body of an active ``plan``, also run ahead of the step by ``fx_vitbal.plan_ahead``:
    gather (``metadata.gather_grids``) and solve; ``(balanced grid, routing, plan)``."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    # --- measured times (fx_vitbal.measured): report an earlier call in the header, fit from
    # every rank's reports, plan with the fitted models. Ranks whose fits saw different calls
    # would plan differently: the fingerprint covers the count, so they raise together instead.
    state = measurements_for(group.group_name, planner)
    fingerprint = settings_fingerprint(planner, merge_size, world_size, state.calls())
    report = state.report()
    gathered = gather_grids(pixel_values, grid_thw, merge_size, group, fingerprint, report)
    measured = state.observe(gathered.reports_R)
    exchange_model = state.exchange_model(
        gathered.row_numel, gathered.dtype_code, gathered.pixels_need_grad
    )
    solved, units_R = plan_units(
        gathered.grids_R,
        rank,
        planner,
        cost_model=state.cost_model(),
        exchange_seconds=exchange_model.step_seconds if exchange_model is not None else None,
    )
    clock = state.begin(solved, units_R, merge_size, pixel_values.device)
    routing = dataclasses.replace(
        local_routing(solved, units_R, rank, merge_size),
        any_units=any(units_R),
        row_numel=gathered.row_numel,
        dtype_code=gathered.dtype_code,
        pixels_need_grad=gathered.pixels_need_grad,
    )
    rows = balanced_grid(solved, units_R, rank, merge_size)
    if not solved.applied:  # the original batch, plus the dummy unit if it is empty
        rows = grid_thw.tolist() or rows
    grid = torch.tensor(rows, dtype=grid_thw.dtype, device=grid_thw.device)
    units = max_units(pixel_values.shape[0], merge_size)
    routing = routing.to_tensor(units)
    routing._vitbal_clock = clock  # the step's moves and ViT call find their clock here
    publish(lambda: state.stats(clock, rank, solved, units_R, measured, exchange_model))
    return grid, routing, solved


def max_units(pixel_rows: int, merge_size: int) -> int:
    """Upper bound on a rank's units: each has at least ``merge_size**2`` rows."""
    return pixel_rows // (merge_size * merge_size)


@plan.register_fake
def _(pixel_values, grid_thw, merge_size, planner, world_size, group_name, active=True):
    ctx = torch.library.get_ctx()
    grid = grid_thw.new_empty(ctx.new_dynamic_size(min=1), 3)  # >= 1: the dummy unit
    size = routing_size(max_units(pixel_values.shape[0], merge_size), world_size)
    routing = torch.empty(size, dtype=torch.int64, device="cpu")
    return grid, routing


@torch.library.custom_op("vitbal::redistribute", mutates_args=())
def redistribute(
    xs: list[torch.Tensor],
    routing: torch.Tensor,
    merge_area: int,
    block_rows: list[int],
    out_rows: list[int] | None,
    group_name: str,
) -> list[torch.Tensor]:
    """Send each local unit's rows to the rank computing it; returns the balanced tensors.

    Tensors move in whole merge blocks (``merge_area`` pixel rows each): ``block_rows[i]`` is how
    many rows of ``xs[i]`` make one block (``merge_area`` for pixels and pre-merger outputs, 1 for
    merged outputs). ``out_rows`` (each result's rows) is only known in backward graphs (the
    forward's input rows); otherwise the result has a fresh data-dependent size of at least one
    block (every rank computes at least the dummy unit).
    """
    return _move(xs, routing, merge_area, block_rows, False, group_name)


@redistribute.register_fake
def _(xs, routing, merge_area, block_rows, out_rows, group_name):
    if out_rows is not None:
        return [x.new_empty(n, *x.shape[1:]) for x, n in zip(xs, out_rows, strict=True)]
    # Forward: one fresh row count, not ``blocks * n``. A product would reach a ViT marked as a
    # nested_compile_region as an expression in place of its size symbol, which AOTAutograd's
    # partitioner of the region rejects ("Node ... was invalid, but is output").
    if len(set(block_rows)) != 1:
        raise ValueError(f"tensors redistributed together must share a layout, got {block_rows}")
    rows = torch.library.get_ctx().new_dynamic_size(min=block_rows[0])
    # Whole blocks: ViTs that merge them (``unflatten(0, (-1, m * m))``) need this known, and
    # torch before 2.10 cannot prove it from the symbol alone.
    torch._check(rows % block_rows[0] == 0)
    return [x.new_empty(rows, *x.shape[1:]) for x in xs]


@torch.library.custom_op("vitbal::restore", mutates_args=())
def restore(
    xs: list[torch.Tensor],
    routing: torch.Tensor,
    merge_area: int,
    block_rows: list[int],
    out_rows: list[int],
    group_name: str,
    check_layouts: bool = True,
) -> list[torch.Tensor]:
    """Send computed rows back to each unit's home rank and original position.

    ``block_rows`` as in ``redistribute`` (``output_block_rows`` reads it from the ViT's outputs);
    ``out_rows`` is each result's rows on the home rank (``home_rows``). Before
    moving anything, every rank checks every rank's row layouts (one small gather), so a ViT
    output of the wrong size raises the same ``ValueError`` everywhere instead of a hang.
    ``redistribute``'s backward skips that check (``check_layouts=False``): autograd gives the
    gradients the shapes and dtypes of ``redistribute``'s outputs, so on every rank they are the
    rows the forward exchange already moved, in the layout it moved them.
    """
    return _move(xs, routing, merge_area, block_rows, True, group_name, check_layouts)


@restore.register_fake
def _(xs, routing, merge_area, block_rows, out_rows, group_name, check_layouts=True):
    for rows, n in zip(out_rows, block_rows, strict=True):
        if n == merge_area:  # pre-merger rows: whole blocks, for parents that merge them
            torch._check(rows % merge_area == 0)
    return [x.new_empty(n, *x.shape[1:]) for x, n in zip(xs, out_rows, strict=True)]


def home_rows(block_rows: list[int], pixel_rows: int, merge_area: int) -> list[int]:
    """Rows each restored output has on a home rank with ``pixel_rows`` pixel rows, given its
    rows per merge block (``output_block_rows``).

    Pre-merger outputs get ``pixel_rows`` itself rather than ``pixel_rows // merge_area *
    merge_area``: equal in value, but downstream code then sees the input's own size symbol,
    where torch before 2.10 cannot reason about the product (``4*(u0//4) <= 0`` in a layer
    norm's backward, for one)."""
    return [pixel_rows if n == merge_area else pixel_rows // merge_area * n for n in block_rows]


def output_block_rows(xs: list[torch.Tensor], pixel_rows: int, merge_area: int) -> list[int]:
    """Rows per merge block of each ViT output computed from ``pixel_rows`` pixel rows:
    ``merge_area`` for the pre-merger layout (``t*h*w`` rows per unit), 1 for the merged layout
    (``t*h*w / merge_area``), 0 for neither (``restore`` then raises on every rank).

    Works on symbolic sizes without adding guards where the relation is provable, so a compiled
    graph keeps one layout for every batch.
    """
    layouts = []
    for x in xs:
        rows = x.shape[0]
        if guard_or_false(rows == pixel_rows):
            layouts.append(merge_area)
        elif guard_or_false(rows == pixel_rows // merge_area):
            layouts.append(1)
        else:
            layouts.append(0)
    return layouts


def _move(xs, routing, merge_area, block_rows, reverse, group_name, check_layouts=False):
    if not xs or len(xs) != len(block_rows):
        raise ValueError(f"vitbal moves need one block_rows entry per tensor, got {block_rows}")
    route = Routing.of(routing)
    group = resolve_group(group_name)
    dummy = route.dummy_rows // merge_area
    if check_layouts and route.applied:
        blocks = (sum(route.recv_rows) + route.dummy_rows) // merge_area
        check_output_layouts(xs, block_rows, blocks, group, route.mismatched)
    blocks_xs = [as_blocks(x, n) for x, n in zip(xs, block_rows, strict=True)]
    if reverse:
        blocks_xs = with_dummy(blocks_xs, dummy, add=False)
    if route.applied:
        clock = getattr(routing, "_vitbal_clock", None)
        timed = clock is not None and clock.timing_exchange(reverse)
        start = clock.mark() if timed else None
        blocks_xs = exchange(blocks_xs, route, merge_area, reverse, group)
        if timed:  # --- a forward exchange of measured times (fx_vitbal.timing)
            moved = _crossing_bytes(xs, block_rows, merge_area, route, group)
            clock.add_exchange(start, clock.mark(), moved)
            if reverse:
                clock.output_bytes_per_row = _bytes_per_pixel_row(xs, block_rows, merge_area)
    else:  # every rank agrees (the plan is global): nothing to send anywhere
        blocks_xs = [x.clone() for x in blocks_xs]
    if not reverse:
        blocks_xs = with_dummy(blocks_xs, dummy, add=True)
    return [from_blocks(b, x, n) for b, x, n in zip(blocks_xs, xs, block_rows, strict=True)]


def _bytes_per_pixel_row(xs, block_rows, merge_area) -> int:
    """Bytes the tensors ``xs`` hold per pixel row (``block_rows`` rows per merge block)."""
    return sum(
        row_numel(x) * x.element_size() * n // merge_area
        for x, n in zip(xs, block_rows, strict=True)
    )


def _crossing_bytes(xs, block_rows, merge_area, route: Routing, group) -> int:
    """Bytes this rank sends to and receives from other ranks in one move of ``xs``."""
    rank = dist.get_rank(group)
    rows = sum(route.send_rows) + sum(route.recv_rows) - route.send_rows[rank]
    rows -= route.recv_rows[rank]
    return rows * _bytes_per_pixel_row(xs, block_rows, merge_area)


def _setup_context(ctx, inputs, output):
    xs, routing, merge_area, block_rows, _, group_name = inputs[:6]
    ctx.routing, ctx.merge_area, ctx.block_rows, ctx.group_name = (
        routing,
        merge_area,
        block_rows,
        group_name,
    )
    ctx.in_rows = [x.shape[0] for x in xs]
    ctx.out_like = [torch.empty_like(o, device="meta") for o in output]
    ctx.devices = [o.device for o in output]


def _gradients(ctx, grads):
    # A collective needs every tensor on every rank: unused outputs get zero gradients.
    return [
        g if g is not None else torch.zeros(like.shape, dtype=like.dtype, device=device)
        for g, like, device in zip(grads, ctx.out_like, ctx.devices, strict=True)
    ]


def _backward_by(reverse_op, *extra):
    """A move's backward: the opposite move of the gradients, to the forward's input blocks."""

    def backward(ctx, grads):
        moved = reverse_op(
            _gradients(ctx, grads),
            ctx.routing,
            ctx.merge_area,
            ctx.block_rows,
            ctx.in_rows,
            ctx.group_name,
            *extra,
        )
        # One gradient per argument the op was called with (the dispatcher drops trailing
        # arguments equal to their defaults, and ``needs_input_grad`` follows it).
        return moved, *[None] * (len(ctx.needs_input_grad) - 1)

    return backward


redistribute.register_autograd(_backward_by(restore, False), setup_context=_setup_context)
restore.register_autograd(_backward_by(redistribute), setup_context=_setup_context)
