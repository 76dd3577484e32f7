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
import itertools

import torch
import torch.distributed as dist
from torch.fx.experimental.symbolic_shapes import guard_or_false

from fx_vitbal import status, transfer
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
from fx_vitbal.metadata import (
    DTYPES,
    agree_layouts,
    check_output_layouts,
    gather_grids,
    layout_key,
    layouts_agreed,
    output_layout,
    row_numel,
    settings_fingerprint,
)
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
    module_key: int = 0,
    problem: int = 0,
    grad_fixed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather all ranks' grids, solve the plan, return ``(balanced grid, routing)``.

    The balanced grid lists this rank's units in arrival order (the original grid when the plan
    is not applied), or the dummy unit ``[1, m, m]`` when there are none. ``planner`` is
    ``exchange.planner_spec(config, cost_model)``; its fingerprint rides in the metadata, so
    ranks with different settings all raise. ``active=False`` (balancing off for this call,
    e.g. eval mode) gathers nothing: the local batch stays home and no collective runs in any op.
    ``module_key`` names the ViT for its agreed output layouts (``metadata.layout_key``; 0 in
    compiled graphs); ``problem`` is a ``metadata.PROBLEMS`` code the caller found, raised on
    every rank; ``grad_fixed``: this call is compiled, so its pixels' ``requires_grad`` cannot
    follow the other ranks'.
    """
    group = resolve_group(group_name)
    if dist.get_world_size(group) != world_size:
        raise ValueError(
            f"world_size={world_size} but group {group_name!r} has {dist.get_world_size(group)} "
            "ranks"
        )
    if not active:
        units = max_units(pixel_values.shape[0], merge_size)
        routing = local_only_routing(grid_thw.shape[0], world_size, merge_size)
        if grid_thw.shape[0]:
            return grid_thw.clone(), routing.to_tensor(units)
        dummy = torch.tensor([[1, merge_size, merge_size]], dtype=grid_thw.dtype)
        return transfer.to_device(dummy, grid_thw.device), routing.to_tensor(units)
    status.check(group_name)  # a step whose backward never ran: its outputs' verdict first
    grid, routing, _ = solve_for_rank(
        pixel_values, grid_thw, merge_size, planner, group, module_key, problem, grad_fixed
    )
    return grid, routing


def solve_for_rank(
    pixel_values: torch.Tensor,
    grid_thw: torch.Tensor,
    merge_size: int,
    planner: str,
    group: dist.ProcessGroup,
    module_key: int = 0,
    problem: int = 0,
    grad_fixed: bool = False,
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
    dtype_code = DTYPES.index(pixel_values.dtype) if pixel_values.dtype in DTYPES else -1
    key = layout_key(module_key, dtype_code, pixel_values.device.type)
    ranks = group_ranks(group)
    gathered = gather_grids(
        pixel_values,
        grid_thw,
        merge_size,
        group,
        fingerprint,
        report,
        problem=problem,
        grad_fixed=grad_fixed,
        new_layout=layouts_agreed(ranks, key) is None,
    )
    measured = state.observe(gathered.reports_R)
    exchange_model = state.exchange_model(
        gathered.row_numel, gathered.dtype_code, gathered.pixels_need_grad
    )
    solved, units_R, note = plan_units(
        gathered.grids_R,
        rank,
        planner,
        cost_model=state.cost_model(),
        exchange_seconds=exchange_model.step_seconds if exchange_model is not None else None,
    )
    call_id = next(_CALL_IDS)
    step, clock = state.begin(solved, units_R, merge_size)
    routing = dataclasses.replace(
        local_routing(solved, units_R, rank, merge_size),
        any_units=any(units_R),
        row_numel=gathered.row_numel,
        dtype_code=gathered.dtype_code,
        pixels_need_grad=gathered.pixels_need_grad,
        step=call_id,
        layout_key=key,
        check_layouts=gathered.check_layouts,
    )
    rows = balanced_grid(solved, units_R, rank, merge_size)
    if not solved.applied:  # the original batch (as gathered: no device read), or the dummy
        rows = gathered.grids_R[rank] or rows
    grid = transfer.to_device(torch.tensor(rows, dtype=grid_thw.dtype), grid_thw.device)
    routing = routing.to_tensor(max_units(pixel_values.shape[0], merge_size))
    routing._vitbal_clock = clock  # eager moves and ViT calls find their clock here
    state.defer(
        call_id, note, lambda: state.stats(step, rank, solved, units_R, measured, exchange_model)
    )
    if not solved.applied:  # nothing moves: the gather was the call's last collective
        publish(call_id)
    return grid, routing, solved


# Ids of the calls planned in this process, for their status words and deferred reports.
_CALL_IDS = itertools.count(1)


def group_ranks(group: dist.ProcessGroup) -> tuple[int, ...]:
    """The global ranks of ``group``, in group order (what its agreed layouts are kept by)."""
    return tuple(dist.get_process_group_ranks(group))


def max_units(pixel_rows: int, merge_size: int) -> int:
    """Upper bound on a rank's units: each has at least ``merge_size**2`` rows."""
    return pixel_rows // (merge_size * merge_size)


@plan.register_fake
def _(
    pixel_values,
    grid_thw,
    merge_size,
    planner,
    world_size,
    group_name,
    active=True,
    module_key=0,
    problem=0,
    grad_fixed=False,
):
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
    check_status: bool = False,
) -> list[torch.Tensor]:
    """Send each local unit's rows to the rank computing it; returns the balanced tensors.

    Tensors move in whole merge blocks (``merge_area`` pixel rows each): ``block_rows[i]`` is how
    many rows of ``xs[i]`` make one block (``merge_area`` for pixels and pre-merger outputs, 1 for
    merged outputs). ``out_rows`` (each result's rows) is only known in backward graphs (the
    forward's input rows); otherwise the result has a fresh data-dependent size of at least one
    block (every rank computes at least the dummy unit). ``check_status`` (``restore``'s
    backward): first read the status words of the outputs' exchange (``fx_vitbal.status``), so
    an unsound output raises on every rank before its gradients move.
    """
    route = Routing.of(routing)
    if check_status:
        status.check(group_name, route.step)
    blocks_xs = [as_blocks(x, n) for x, n in zip(xs, block_rows, strict=True)]
    if route.applied:
        clock = getattr(routing, "_vitbal_clock", None)
        timed = clock is not None and clock.timing_exchange(reverse=False)
        start = clock.mark() if timed else None
        blocks_xs, _ = exchange(blocks_xs, route, merge_area, False, resolve_group(group_name))
        if timed:  # --- the pixels' exchange, timed (fx_vitbal.timing)
            moved = _crossing_bytes(xs, block_rows, merge_area, route, group_name)
            clock.add_exchange(start, clock.mark(), moved)
    else:  # every rank agrees (the plan is global): nothing to send anywhere
        blocks_xs = [x.clone() for x in blocks_xs]
    blocks_xs = with_dummy(blocks_xs, route.dummy_rows // merge_area, add=True)
    return [from_blocks(b, x, n) for b, x, n in zip(blocks_xs, xs, block_rows, strict=True)]


@redistribute.register_fake
def _(xs, routing, merge_area, block_rows, out_rows, group_name, check_status=False):
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
    check_now: bool = False,
) -> list[torch.Tensor]:
    """Send computed rows back to each unit's home rank and original position.

    ``block_rows`` as in ``redistribute`` (``output_block_rows`` reads it from the ViT's outputs);
    ``out_rows`` is each result's rows on the home rank (``home_rows``).

    A ViT output of the wrong size or layout on one rank must raise the same ``ValueError``
    everywhere, never hang nor corrupt (``check_layouts``, the outputs' restore). On a call
    whose layouts the ranks have not agreed on (``Routing.check_layouts``), one small gather
    checks them first. Otherwise nothing waits: each rank compares its outputs with the agreed
    layouts on the host, sends zeros of those sizes if they differ, and its status word rides
    in the same exchange (``fx_vitbal.status``); the words are read in this op's backward, or at
    its end with ``check_now`` (no backward will come). ``redistribute``'s backward passes
    ``check_layouts=False``: autograd gives the gradients the shapes and dtypes of
    ``redistribute``'s outputs, so on every rank they are the rows the forward exchange already
    moved, in the layout it moved them.
    """
    route = Routing.of(routing)
    blocks = (sum(route.recv_rows) + route.dummy_rows) // merge_area
    dummy = route.dummy_rows // merge_area
    if not route.applied:  # every rank agrees (the plan is global): nothing to send anywhere
        blocks_xs = [as_blocks(x, n) for x, n in zip(xs, block_rows, strict=True)]
        moved = [b.clone() for b in with_dummy(blocks_xs, dummy, add=False)]
        return [from_blocks(b, x, n) for b, x, n in zip(moved, xs, block_rows, strict=True)]
    group = resolve_group(group_name)
    word, outputs, unsound = None, xs, False
    if check_layouts:
        ranks = group_ranks(group)
        # A plan made ahead whose batch's grid differs on this rank (``fx_vitbal.ahead``): known
        # on the host, or as a device flag that joins the status word without a read.
        grid_differs = getattr(routing, "_vitbal_grid_differs", None)
        if route.check_layouts:  # this call blocks anyway: the device flag is read too
            mismatched = route.mismatched or (grid_differs is not None and bool(grid_differs))
            agreed = check_output_layouts(xs, block_rows, blocks, group, mismatched)
            agree_layouts(ranks, route.layout_key, agreed)
        xs, word = _as_agreed(xs, block_rows, blocks, layouts_agreed(ranks, route.layout_key))
        unsound = status.kind(word) != status.OK  # a host word: no read of the device
        if route.mismatched:
            word = status.word(status.NOT_AS_PLANNED)
        elif grid_differs is not None:
            bad = transfer.to_device(status.word(status.NOT_AS_PLANNED), grid_differs.device)
            word = torch.where(grid_differs, bad, transfer.to_device(word, bad.device))
        block_rows = [n for n, _, _ in layouts_agreed(ranks, route.layout_key)]
    blocks_xs = [as_blocks(x, n) for x, n in zip(xs, block_rows, strict=True)]
    blocks_xs = with_dummy(blocks_xs, dummy, add=False)
    moved, words_R = exchange(blocks_xs, route, merge_area, True, group, word)
    if words_R is not None:
        status.expect(group_name, route.step, words_R)
        clock = getattr(routing, "_vitbal_clock", None)
        if clock is not None:
            clock.output_bytes_per_row = _bytes_per_pixel_row(xs, block_rows, merge_area)
        if check_now:
            status.check(group_name, route.step)
        publish(route.step)  # the step's last forward collective is done
        if unsound:  # raised later, on every rank: zeros meanwhile
            return [x.new_zeros(n, *x.shape[1:]) for x, n in zip(outputs, out_rows, strict=True)]
    return [from_blocks(b, x, n) for b, x, n in zip(moved, xs, block_rows, strict=True)]


def no_backward_will_come(outputs: list[torch.Tensor]) -> bool:
    """No backward will read the status words of these ViT outputs' restore (gradients off,
    or no output requires one): ``restore`` must read them itself (its ``check_now``)."""
    return not (torch.is_grad_enabled() and any(o.requires_grad for o in outputs))


def _as_agreed(xs, block_rows, blocks, agreed):
    """``(tensors to send, status word)``: ``xs`` if they fit the ``agreed`` layouts (rows,
    dtype, width per output) for ``blocks`` merge blocks, else zeros of those layouts and the
    word naming the first misfit, so the exchange keeps every rank's sizes."""
    word = status.word()
    if len(xs) != len(agreed):
        word = status.word(status.COUNT, value=len(xs))
    else:
        for i, (x, n, want) in enumerate(zip(xs, block_rows, agreed, strict=True)):
            if x.shape[0] != blocks * want[0] or (n, *output_layout(x, n)[1:]) != want:
                kind = status.LAYOUT if n and x.shape[0] == blocks * n else status.ROWS
                word = status.word(kind, i, x.shape[0])
                break
    if status.kind(word) == status.OK:
        return xs, word
    like = xs[0]
    zeros = [
        torch.zeros(blocks * n, numel, dtype=DTYPES[dtype], device=like.device)
        for n, dtype, numel in agreed
    ]
    return zeros, word


@restore.register_fake
def _(
    xs, routing, merge_area, block_rows, out_rows, group_name, check_layouts=True, check_now=False
):
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


def _bytes_per_pixel_row(xs, block_rows, merge_area) -> int:
    """Bytes the tensors ``xs`` hold per pixel row (``block_rows`` rows per merge block)."""
    return sum(
        row_numel(x) * x.element_size() * n // merge_area
        for x, n in zip(xs, block_rows, strict=True)
    )


def _crossing_bytes(xs, block_rows, merge_area, route: Routing, group_name: str) -> int:
    """Bytes this rank sends to and receives from other ranks in one move of ``xs``."""
    rank = dist.get_rank(resolve_group(group_name))
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
restore.register_autograd(_backward_by(redistribute, True), setup_context=_setup_context)
