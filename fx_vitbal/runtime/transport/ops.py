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
- Tagged ``cudagraph_unsafe``: with ``mode="reduce-overhead"`` inductor's graph partitioning
  runs them outside CUDA graphs, since a replay would reuse recorded split sizes (rows to the
  wrong rank, or a hang) and skip the host-side checks.
"""

import torch
import torch.distributed as dist
from torch.fx.experimental.symbolic_shapes import guard_or_false

from fx_vitbal._compat import CUDAGRAPH_UNSAFE
from fx_vitbal.measure.stats import publish
from fx_vitbal.runtime.transport import refetch, status, transfer
from fx_vitbal.runtime.transport.collectives import group_ranks, resolve_group
from fx_vitbal.runtime.transport.exchange import exchange
from fx_vitbal.runtime.transport.layouts import (
    agree_layouts,
    as_agreed,
    check_output_layouts,
    layouts_agreed,
)
from fx_vitbal.runtime.transport.routing import Routing
from fx_vitbal.runtime.transport.rows import as_blocks, from_blocks, row_numel, with_dummy
from fx_vitbal.runtime.transport.state import clock_of, route_of


@torch.library.custom_op("vitbal::redistribute", mutates_args=(), tags=CUDAGRAPH_UNSAFE)
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
    backward): first read the status words of the outputs' exchange (``runtime.transport.status``),
    so an unsound output raises on every rank before its gradients move.
    """
    route = route_of(routing)
    if check_status:
        status.check(group_name, route.step)
    if route.mismatched and out_rows is None:  # a batch not as planned: the planned sizes move
        xs = [_as_planned(x, route, n, merge_area) for x, n in zip(xs, block_rows, strict=True)]
    elif out_rows is None:  # a rank that passed None receives rows in the others' layout
        xs = [in_agreed_layout(x, route) for x in xs]
    blocks_xs = [as_blocks(x, n) for x, n in zip(xs, block_rows, strict=True)]
    if route.applied:
        clock = clock_of(routing)
        timed = clock is not None and clock.timing_exchange(False, xs[0].device)
        start = clock.mark() if timed else None
        group = resolve_group(group_name)
        # ``check_status`` marks output gradients: with replica sets, they come from every rank.
        blocks_xs, _ = exchange(blocks_xs, route, merge_area, False, group, None, check_status)
        if timed:  # --- the pixels' exchange, timed (fx_vitbal.measure.clock)
            moved = _crossing_bytes(xs, block_rows, merge_area, route, group_name)
            clock.add_exchange(start, clock.mark(), moved)
    else:  # every rank agrees (the plan is global): nothing to send anywhere
        blocks_xs = [x.clone() for x in blocks_xs]
    blocks_xs = with_dummy(blocks_xs, route.dummy_rows // merge_area, add=True)
    return [from_blocks(b, x, n) for b, x, n in zip(blocks_xs, xs, block_rows, strict=True)]


def in_agreed_layout(x: torch.Tensor, route: Routing) -> torch.Tensor:
    """``x``, or, for stand-in pixels with no rows and no width (a rank that passed None,
    ``call.stand_in_pixels``), an empty tensor of the row width and dtype every rank with
    pixels has (the plan gathered them)."""
    if x.shape[0] or not route.row_numel or row_numel(x) == route.row_numel:
        return x
    return x.new_empty(0, route.row_numel, dtype=route.dtype)


def _as_planned(x: torch.Tensor, route: Routing, block_rows: int, merge_area: int):
    """``x`` if it has the rows and row layout of this rank's planned units, else zeros of
    them (the ranks expect those sizes; the flagged routing makes every rank raise later)."""
    rows = sum(route.unit_rows) // merge_area * block_rows
    if x.shape[0] == rows and x.dtype == route.dtype and row_numel(x) == route.row_numel:
        return x
    shape = x.shape[1:] if row_numel(x) == route.row_numel else (route.row_numel,)
    return torch.zeros(rows, *shape, dtype=route.dtype, device=x.device)


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


@torch.library.custom_op("vitbal::restore", mutates_args=(), tags=CUDAGRAPH_UNSAFE)
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
    in the same exchange (``runtime.transport.status``); the words are read in this op's backward,
    or at its end with ``check_now`` when no backward will come and they are on the host (on a
    device the next call reads them: ``no_backward_will_come``). ``redistribute``'s backward passes
    ``check_layouts=False``: autograd gives the gradients the shapes and dtypes of
    ``redistribute``'s outputs, so on every rank they are the rows the forward exchange already
    moved, in the layout it moved them.
    """
    route = route_of(routing)
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
        if route.check_layouts:  # some rank has no layouts agreed for this key: agree now
            agree_layouts(
                ranks, route.layout_key, check_output_layouts(xs, block_rows, blocks, group)
            )
        agreed = layouts_agreed(ranks, route.layout_key)
        xs, word = as_agreed(xs, block_rows, blocks, agreed)
        # Zeros in the home layout for unsound outputs, or a batch not as planned (its outputs
        # would not fit the parent's batch): the rank's forward goes on, every rank raises later.
        unsound = status.kind(word) != status.OK or route.mismatched  # host-known: no read
        grid_differs = status.take_not_as_planned(group_name, route.step)
        word = _not_as_planned(word, route, grid_differs)
        block_rows = [n for n, _, _ in agreed]
    blocks_xs = [as_blocks(x, n) for x, n in zip(xs, block_rows, strict=True)]
    blocks_xs = with_dummy(blocks_xs, dummy, add=False)
    # ``check_layouts`` marks ViT outputs: with replica sets, they go to every rank of a set.
    moved, words_R = exchange(blocks_xs, route, merge_area, True, group, word, check_layouts)
    if words_R is not None:
        status.expect(group_name, route.step, words_R)
        clock = clock_of(routing)
        if clock is not None:
            clock.output_bytes_per_row = _bytes_per_pixel_row(xs, block_rows, merge_area)
        if check_now and transfer.on_host(words_R):  # on a device: the next call's read
            status.check(group_name, route.step)
        publish(route.step)  # the step's last forward collective is done
        if unsound:  # raised later, on every rank: zeros meanwhile
            return [x.new_zeros(n, *x.shape[1:]) for x, n in zip(outputs, out_rows, strict=True)]
    return [from_blocks(b, x, n) for b, x, n in zip(moved, xs, block_rows, strict=True)]


def _not_as_planned(word, route: Routing, grid_differs):
    """``word``, or ``NOT_AS_PLANNED`` when this rank's batch is not the one planned ahead for it
    (``fx_vitbal.ahead``): known on the host (``route.mismatched``), or as a device flag (a grid
    compared on the device), joined without a read."""
    if route.mismatched:
        return status.word(status.NOT_AS_PLANNED)
    if grid_differs is None:
        return word
    bad = transfer.to_device(status.word(status.NOT_AS_PLANNED), grid_differs.device)
    return torch.where(grid_differs, bad, transfer.to_device(word, bad.device))


def no_backward_will_come(outputs: list[torch.Tensor]) -> bool:
    """No backward will read the status words of these ViT outputs' restore (gradients off,
    or no output requires one): ``restore`` reads them itself (its ``check_now``) when they are
    on the host. Words on a device are read by the group's next balanced call instead, as a
    step whose backward never ran: reading them at once would block the host until the ViT and
    the exchange finish, on every eval or no-grad call. A rank whose own outputs were unsound
    returns zeros meanwhile, and every rank raises at that next call."""
    return not (torch.is_grad_enabled() and any(o.requires_grad for o in outputs))


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


_output_gradients_out = _backward_by(redistribute, True)


def _restore_setup_context(ctx, inputs, output):
    _setup_context(ctx, inputs, output)
    ctx.refetch = refetch.take()


def _restore_backward(ctx, grads):
    """The output gradients to the computing ranks, then, on a step whose exchanged pixels were
    released, the pixels again (``runtime.transport.refetch``): before any ViT backward."""
    moved = _output_gradients_out(ctx, grads)
    if ctx.refetch is not None:
        ctx.refetch.refill()
    return moved


redistribute.register_autograd(_backward_by(restore, False), setup_context=_setup_context)
restore.register_autograd(_restore_backward, setup_context=_restore_setup_context)
