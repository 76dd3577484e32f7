"""The one balanced ViT call: plan -> redistribute -> ViT -> restore (``run_balanced``), which
the eager call, the in-place wrapper and the Hugging Face towers all go through, and compiled
wrappers trace (the FX pass writes the same ops into a graph).
"""

import math

import torch
from torch import nn

from fx_vitbal.measure import clock as step_clock
from fx_vitbal.runtime.agree import planning
from fx_vitbal.runtime.agree.problems import DEVICE_TYPES, PROBLEMS, device_code, problem_code
from fx_vitbal.runtime.bands.view import bands_for_vit
from fx_vitbal.runtime.transport import collectives, ops, refetch, transfer
from fx_vitbal.runtime.transport.routing import Routing
from fx_vitbal.runtime.transport.state import route_of, state_of_routing
from fx_vitbal.runtime.vit.registry import unwrap_module, vision_encoder_spec
from fx_vitbal.runtime.vit.settings import BalancedCall


def run_balanced(
    run,
    pixel_values,
    image_grid_thw,
    call: BalancedCall,
    module=None,
    *,
    grad_without_images=False,
    output_rows=None,
    refetch_pixels=False,
):
    """plan -> redistribute -> ``run(pixels, grid, bands)`` -> restore, the one balanced ViT call
    of every eager and in-place path (and of compiled wrappers, which trace it).

    ``run`` returns ``(outputs, extra)``: the embeddings to move home (pre-merger or merged
    layout each) and anything else, passed back untouched. Returns ``(restored outputs, extra,
    routing)``: the routing tensor names the call's host state (``runtime.transport.state``), which
    holds the host copy of this rank's grid (``vits.regenerate_window_index`` reads it).
    An empty ``[0, 0]`` ``pixel_values`` (what ``None`` becomes) receives rows in the other
    ranks' layout.

    Every decision below comes from the gathered metadata, so all ranks take the same branch:
    - a skipped plan runs ``run`` on the local batch with no copy (its units as the plan lists
      them: frames split where the ViT allows), except on a rank with no image, which goes
      through the ops so its ViT computes the dummy unit, never zero rows;
    - when no rank has an image, every rank runs the dummy unit to learn the outputs' widths and
      returns them empty, or returns ``(None, extra)`` if no rank passed a pixel tensor at all.
      It runs under ``no_grad`` (the ViT's parameters get no gradient, as when a parent skips
      its ViT on text-only batches, like Hugging Face's) unless ``grad_without_images``: then the
      empty outputs stay in the graph and the parameters get zero gradients, as when a parent
      calls its ViT on zero rows (LoongForge's ``encode_images``; DDP without
      ``find_unused_parameters`` needs it). The choice is the caller's, the same on every rank,
      so FSDP's backward collectives stay matched. (Under ``torch.compile`` the dummy unit always
      runs with gradients: zeros.)
    ``call``: the call's facts (``settings.BalancedCall``): its group, planner, the ViT's layout
    token (its agreed output layouts, a plan made ahead for it), a problem the caller found (the
    plan raises it on every rank), its replica ranks, and whether it runs bands: ``run`` then
    gets the batch's ``Bands`` (``runtime.bands.view``; under ``torch.compile`` their tensor form,
    on every step), else None. ``module``: the ViT, whose trainable parameters' gradients mark the
    end of its backward for the measured times (``fx_vitbal.measure.clock``; eager only).
    ``output_rows``: ``unit (t, h, w) -> rows`` of every output, for a ViT whose outputs have
    other row counts than ``t*h*w`` or ``t*h*w / merge**2`` per unit (eager only): ``restore``
    then moves each unit's rows by a routing that counts them so (``planning._rows_routing``).

    ``refetch_pixels``: ``pixel_values`` are the caller's own, kept through its step, on every
    rank alike (the same entry point: a rule, not this rank's data). On an eager step that
    splits a frame, the exchanged pixels ``run`` computed from are then released once
    ``restore`` is done, and its backward fetches them again from ``pixel_values``
    (``runtime.transport.refetch``): ``extra`` must not lead a backward into the ViT other than
    through ``restore`` (the callers' ``extra`` is a window index, or a tower output whose every
    gradient-carrying field is replaced by its restored rows).

    Host reads: the plan's one (its gathered metadata; none planned ahead), then none: ``restore``
    never waits for the ViT (``ops.restore``).
    """
    area = call.merge_size * call.merge_size
    compiling = torch.compiler.is_compiling()
    grid, routing = planning.plan(pixel_values, image_grid_thw, *call.op_args())
    # A problem is raised by the plan on every rank; its output keeps the op in the graph. With
    # a plan made ahead (no gather), the rank's batch counts as not planned instead: it takes
    # part in the exchange, and every rank raises in restore (``runtime.agree.handover``).
    if call.problem and (compiling or not route_of(routing).mismatched):
        return None, grid[:0], routing
    bands = None
    if not compiling:
        route, kept = route_of(routing), state_of_routing(routing)
        run = _timed(run, kept.clock if kept is not None else None, module)
        bands = kept.bands if kept is not None and call.runs_bands else None
        if not route.any_units:
            return (*_without_images(run, pixel_values, route, area, grad_without_images), routing)
        if not route.applied and pixel_values.shape[0]:  # skipped on every rank: no copies
            return (*run(pixel_values, grid, bands), routing)
        pixel_values = _taking_part(pixel_values, route)
    group_name = call.group_name
    (pixels,) = ops.redistribute([pixel_values], routing, area, [area], None, group_name)
    if compiling:
        bands = bands_for_vit(routing, grid, group_name, call.runs_bands)
    outputs, extra = run(pixels, grid, bands)
    check_now = ops.no_backward_will_come(outputs)
    refetched = None
    if refetch_pixels and not compiling:
        refetched = refetch.offer(routing, pixel_values, area, group_name)
    try:
        if output_rows is not None:
            restored = _restore_rows(
                outputs, routing, output_rows, pixels.shape[0], group_name, check_now
            )
        else:
            layouts = ops.output_block_rows(outputs, pixels.shape[0], area)
            rows = ops.home_rows(layouts, pixel_values.shape[0], area)
            restored = ops.restore(
                outputs, routing, area, layouts, rows, group_name, True, check_now
            )
    finally:  # an offer lives for this call's restore only
        refetch.withdraw()
    if refetched is not None:  # the exchanged pixels, until the backward fetches them again
        refetched.release(pixels, outputs)
    return restored, extra, routing


def _restore_rows(outputs, routing, output_rows, pixel_rows, group_name, check_now):
    """``restore`` of outputs with ``output_rows(unit)`` rows per unit: one row is one block."""
    kept = state_of_routing(routing)
    counted = kept.output_routing(output_rows)
    home = [sum(route_of(counted).unit_rows)] * len(outputs)
    ones = [1] * len(outputs)
    restored = ops.restore(outputs, counted, 1, ones, home, group_name, True, check_now)
    if kept.clock is not None and pixel_rows:  # per pixel row, as the exchange model prices them
        sent = sum(o.numel() * o.element_size() for o in outputs)
        kept.clock.output_bytes_per_row = sent // pixel_rows
    return restored


def _timed(run, clock, module):
    """``run`` with this rank's clock of the call around it (``fx_vitbal.measure.clock``)."""
    if clock is None:
        return run

    def timed(pixels, grid, bands):
        clock.forward_started(pixels.device)
        outputs, extra = run(pixels, grid, bands)
        clock.forward_ended(outputs, pixels, step_clock.watch_parameters(module))
        return outputs, extra

    return timed


def _taking_part(pixel_values: torch.Tensor, route: Routing) -> torch.Tensor:
    """This rank's pixels as every rank's exchange expects them: a rank that passed None gets an
    empty tensor in the others' row layout (so it can receive rows), and when any rank's pixels
    require gradients, every rank's do, so all ranks run the backward exchange together (the
    gradient of a stand-in is simply dropped)."""
    pixel_values = ops.in_agreed_layout(pixel_values, route)
    if route.pixels_need_grad and not pixel_values.requires_grad:
        pixel_values = pixel_values.detach().requires_grad_(True)
    return pixel_values


def _without_images(run, pixel_values, route, area, grad):
    if not route.row_numel:
        return None, None
    dummy = torch.zeros(area, route.row_numel, dtype=route.dtype, device=pixel_values.device)
    side = math.isqrt(area)
    grid = transfer.to_device(torch.tensor([[1, side, side]], device="cpu"), pixel_values.device)
    with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
        outputs, extra = run(dummy, grid, None)
    return [o[:0] for o in outputs], extra


def call_inputs(
    vit: nn.Module,
    pixel_values: torch.Tensor | None,
    image_grid_thw: torch.Tensor | None,
    group_name: str | None,
    rows_2d: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(pixels, grid, problem)``: a balanced call's batch as the plan takes it, and a
    ``problems.problem_code`` (0: none) that the plan raises on every rank.

    A rank without images may pass None for both (or None pixels with an empty grid): it takes
    part with stand-in pixels (``stand_in_pixels``) and an empty grid. None on one side only
    would lose images or crash this rank alone inside the first collective, so it is a problem,
    as are pixels that are not 2-D ``[rows, features]`` (``rows_2d``: the ViT contract; a
    Hugging Face tower's rows may have more dims) and tensors on a device the group cannot
    exchange or the host cannot read (``input_problem``). Pixels on such a device are replaced
    by a stand-in on the exchange device, a grid with a problem by an empty one.
    ``group_name`` None: a plan made ahead (``fx_vitbal.plan_ahead``), whose pixels may be
    anywhere (``meta`` too) and whose stand-ins live on the host.
    """
    exchanged = group_device_types(group_name) if group_name is not None else None
    problem = input_problem(pixel_values, image_grid_thw, rows_2d, exchanged)
    kind = problem & 0xFF
    if pixel_values is None and group_name is None:
        pixel_values = torch.empty(0, 0, device="cpu")
    elif pixel_values is None:
        pixel_values, missing = stand_in_pixels(vit, group_name)
        problem = problem or missing
    elif kind == PROBLEMS["pixels_device"]:
        width = math.prod(pixel_values.shape[1:])
        pixel_values = empty_pixels(group_name, width, pixel_values.dtype)
    if image_grid_thw is None or kind in _GRID_REPLACED:
        image_grid_thw = torch.empty(0, 3, dtype=torch.long, device=pixel_values.device)
    return pixel_values, image_grid_thw, problem


_GRID_REPLACED = tuple(PROBLEMS[n] for n in ("pixels_none", "grid_none", "grid_device"))


def input_problem(
    pixel_values: torch.Tensor | None,
    image_grid_thw: torch.Tensor | None,
    rows_2d: bool,
    exchanged: tuple[str, ...] | None = None,
) -> int:
    """The problem of a call's pixels and grid that only this rank can see before the plan's
    gather (``problems.problem_code``; 0: none): one side None while the other holds rows,
    pixels not 2-D where ``rows_2d``, pixels on a device type not in ``exchanged`` (the
    group's; None: anywhere) or a grid on ``meta`` (it cannot be read). The gather checks
    shapes, dtypes and values itself. No host read: only sizes and devices are looked at."""
    if pixel_values is None:
        rows = _leading_size(image_grid_thw)
        return problem_code("pixels_none", rows) if rows else 0
    if image_grid_thw is None:
        rows = _leading_size(pixel_values)
        return problem_code("grid_none", rows) if rows else 0
    if rows_2d and pixel_values.dim() != 2:
        return problem_code("pixels_not_rows")
    if exchanged is not None and pixel_values.device.type not in exchanged:
        return problem_code("pixels_device", device_code(pixel_values.device))
    if image_grid_thw.device.type == "meta":
        return problem_code("grid_device", device_code(image_grid_thw.device))
    return 0


def _leading_size(x: torch.Tensor | None) -> int:
    return 0 if x is None or x.dim() == 0 else x.shape[0]


@torch.compiler.assume_constant_result
def group_device_types(group_name: str) -> tuple[str, ...]:
    """Where the group's exchanges may run (``collectives.exchange_device_types``; a backend
    that does not say: any device but ``meta``)."""
    types = collectives.exchange_device_types(collectives.resolve_group(group_name))
    if types is None:
        return tuple(t for t in DEVICE_TYPES if t != "meta")
    return tuple(sorted(types))


def stand_in_pixels(vit: nn.Module, group_name: str) -> tuple[torch.Tensor, int]:
    """Empty pixels for a rank that passed None, and a ``problems.PROBLEMS`` code (0: none).

    They live where the group's exchanges run (``collectives.exchange_device``), not where the
    ViT's parameters are: under CPU offload those are on the host, and a host tensor in an NCCL
    exchange fails on this rank alone while the others wait. Eagerly they have no width: the
    plan tells the rank the others' (``_taking_part``). A compiled graph fixes its shapes when
    traced, so there the width must be known then: the registered ``pixel_width``
    (``VisionEncoderSpec``), with the ViT's parameter dtype. Without one, every rank raises
    (the stand-in only carries the problem code to the plan).
    """
    if not torch.compiler.is_compiling():
        return empty_pixels(group_name), 0
    params = list(vit.parameters())
    pixel_width = vision_encoder_spec(vit).pixel_width
    dtype = params[0].dtype if params else torch.float32
    if pixel_width is None:
        return empty_pixels(group_name, 0, dtype), PROBLEMS["compiled_without_pixels"]
    return empty_pixels(group_name, pixel_width(unwrap_module(vit)), dtype), 0


def empty_pixels(group_name: str, width: int = 0, dtype=torch.float32) -> torch.Tensor:
    """``[0, width]`` pixels where the group's exchanges run (``stand_in_pixels``); a width of
    0 takes the other ranks' (``_taking_part``)."""
    return torch.empty(0, width, dtype=dtype, device=_exchange_device(group_name))


@torch.compiler.assume_constant_result
def _exchange_device(group_name: str) -> torch.device:
    return collectives.exchange_device(collectives.resolve_group(group_name))
