"""The ``vitbal::plan`` custom op and its body: gather every rank's metadata, cost the units,
solve the plan, and give this rank its balanced grid and routing (``fx_vitbal.runtime.ops``
states the conventions every ``vitbal`` op keeps).

The measured times attach here, at fixed points (``fx_vitbal.measure``): this rank's report
rides in the gathered header, every rank's reports feed the fits before the solve, the call's
clock starts after it, and what the call reports is published after its last forward
collective.
"""

import dataclasses
import functools
import itertools

import torch
import torch.distributed as dist

from fx_vitbal._compat import CUDAGRAPH_UNSAFE
from fx_vitbal.cost.static import ArchitectureCost
from fx_vitbal.measure.measurements import measurements_for
from fx_vitbal.measure.stats import defer, publish
from fx_vitbal.plan.bands import exchange_scale
from fx_vitbal.plan.step import describe_plan, plan_step
from fx_vitbal.plan.units import Plan, is_band
from fx_vitbal.runtime import handover, status, transfer
from fx_vitbal.runtime.bands import Bands, band_layout, whole_units
from fx_vitbal.runtime.collectives import group_ranks, resolve_group
from fx_vitbal.runtime.layouts import layout_key, layouts_agreed
from fx_vitbal.runtime.metadata import gather_grids, settings_fingerprint
from fx_vitbal.runtime.replicas import routing_for_sets
from fx_vitbal.runtime.routing import (
    Routing,
    balanced_grid,
    local_outputs,
    local_routing,
    max_units,
    routing_size,
)
from fx_vitbal.runtime.rows import DTYPES
from fx_vitbal.runtime.settings import parse_planner_spec, plan_key, plan_settings


@torch.library.custom_op("vitbal::plan", mutates_args=(), tags=CUDAGRAPH_UNSAFE)
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
    replicas: list[int] | None = None,
    bands: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather all ranks' grids, solve the plan, return ``(balanced grid, routing)``.

    The balanced grid lists this rank's units in arrival order (the original grid when the plan
    is not applied), or the dummy unit ``[1, m, m]`` when there are none. ``planner`` is
    ``settings.planner_spec(config, cost_model)``; its fingerprint rides in the metadata, so
    ranks with different settings all raise. ``active=False`` (balancing off for this call,
    e.g. eval mode) gathers nothing: the local batch stays home and no collective runs in any op.
    ``module_key`` names the ViT (its ``settings.layout_token``; 0: none) for its agreed output
    layouts (``layouts.layout_key``) and for a plan made ahead for it, which replaces the gather
    and the solve (``runtime.handover``); ``problem`` is a ``problems.PROBLEMS`` code the caller
    found, raised on every rank; ``grad_fixed``: this call is compiled, so its pixels'
    ``requires_grad`` cannot follow the other ranks'. ``replicas``: the group ranks holding this
    rank's batch, itself included (``runtime.replicas``; None or one rank: its own set).
    ``bands``: this call's ViT can run row bands (``runtime.bands``); the plan splits a frame
    only if every rank's can, and the routing then carries the ``Bands`` the ViT is given.
    """
    group = resolve_group(group_name)
    if dist.get_world_size(group) != world_size:
        raise ValueError(
            f"world_size={world_size} but group {group_name!r} has {dist.get_world_size(group)} "
            "ranks"
        )
    if not active:
        return local_outputs(pixel_values, grid_thw, merge_size, world_size)
    status.check(group_name)  # a step whose backward never ran: its outputs' verdict first
    planned = handover.take(module_key) if module_key else None
    if planned is not None:  # made ahead (fx_vitbal.plan_ahead): no gather, no solve
        units = max_units(pixel_values.shape[0], merge_size)
        settings = (planner, merge_size)
        return handover.step_outputs(
            planned,
            pixel_values,
            grid_thw,
            settings,
            group,
            units,
            grad_fixed,
            problem,
            tuple(replicas or ()),
            bands,
        )
    grid, routing, _ = solve_for_rank(
        pixel_values,
        grid_thw,
        merge_size,
        planner,
        group,
        module_key,
        problem,
        grad_fixed,
        tuple(replicas or ()),
        bands=bands,
    )
    return transfer.to_device(grid, grid_thw.device), routing


def solve_for_rank(
    pixel_values: torch.Tensor,
    grid_thw: torch.Tensor,
    merge_size: int,
    planner: str,
    group: dist.ProcessGroup,
    module_key: int = 0,
    problem: int = 0,
    grad_fixed: bool = False,
    replicas: tuple[int, ...] = (),
    device_type: str | None = None,
    check_pixels: bool = True,
    bands: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, Plan]:
    """The body of an active ``plan``, also run ahead of the step by ``fx_vitbal.plan_ahead``:
    gather (``metadata.gather_grids``) and solve; ``(balanced grid, routing, plan)``, the
    grid on the host (the op copies it to the device).
    ``device_type``: where the step's ViT runs, for its autocast state (default: the pixels'
    device); ``check_pixels``, ``bands``: as ``gather_grids`` takes them."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    # --- measured times (fx_vitbal.measure): report an earlier call in the header, fit from
    # every rank's reports, plan with the fitted models. Ranks whose fits saw different calls
    # would plan differently: the fingerprint covers the count, so they raise together instead.
    state = measurements_for(
        group.group_name, plan_key(planner), lambda: parse_planner_spec(planner)[1]
    )
    fingerprint = settings_fingerprint(planner, merge_size, world_size, state.calls())
    report = state.report()
    dtype_code = DTYPES.index(pixel_values.dtype) if pixel_values.dtype in DTYPES else -1
    key = layout_key(module_key, dtype_code, device_type or pixel_values.device.type)
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
        replica_ranks=replicas,
        check_pixels=check_pixels,
        bands=bands,
    )
    measured = state.observe(gathered.reports_R)
    pixel_bytes = gathered.row_numel * DTYPES[gathered.dtype_code].itemsize
    exchange_model = state.exchange_model(pixel_bytes, gathered.pixels_need_grad)
    cost_model = state.cost_model()
    settings = plan_settings(planner)
    cost_model = cost_model or settings.cost_model  # fitted this step (online), else the spec's
    settings = dataclasses.replace(
        settings,
        cost_model=cost_model,
        band_scale=_band_scale(cost_model, exchange_model),
        exchange_seconds=exchange_model.step_seconds if exchange_model is not None else None,
    )
    if not gathered.bands:  # some rank's call cannot run them
        settings = dataclasses.replace(settings, bands=None)
    planned = plan_step(gathered.grids_R, settings, gathered.sets)
    solved, units_R, units_O = planned.plan, planned.units_R, planned.units_O
    call_id = next(_CALL_IDS)
    step, clock = state.begin(solved, units_R, merge_size)
    if planned.sets is None:
        routed = functools.partial(local_routing, solved, units_R, rank, merge_size)
        route, rows = routed(), None
        arrivals = solved.assignment[rank]
    else:  # the local units are the set's
        sets = (solved, planned.held, planned.sets, units_O, rank, merge_size)
        route, arrivals = routing_for_sets(*sets)

        def routed(rows_of):
            return routing_for_sets(*sets, rows_of)[0]

        rows = [list(units_O[s][i][:3]) for s, i in arrivals] or None
    route = dataclasses.replace(
        route,
        any_units=any(units_R),
        row_numel=gathered.row_numel,
        dtype_code=gathered.dtype_code,
        pixels_need_grad=gathered.pixels_need_grad,
        step=call_id,
        layout_key=key,
        check_layouts=gathered.check_layouts,
    )
    # A plan not applied keeps every unit home: the local units (frames split where they may
    # be), which a tower fed one frame per grid row needs; or the dummy unit.
    rows = rows or balanced_grid(solved, units_R, rank, merge_size)
    grid = torch.tensor(rows, dtype=grid_thw.dtype, device="cpu")
    routing = route.to_tensor(max_units(pixel_values.shape[0], merge_size))
    routing._vitbal_clock = clock  # eager moves and ViT calls find their clock here
    routing._vitbal_home_grid = gathered.grids_R[rank]  # ``vits.regenerate_window_index``
    routing._vitbal_output_routing = functools.partial(_rows_routing, route, routed)
    # The batch as the ViT gets it (``Bands``): its units, and on a step that splits a frame
    # the exchange of the frame's keys and values.
    if any(is_band(u) for units in units_O for u in units):
        band_units, layout = band_layout(
            units_O, planned.computed_by, arrivals, rank, world_size, merge_size
        )
        routing._vitbal_bands = Bands(band_units, layout.to_tensor(), group.group_name)
    else:
        routing._vitbal_bands = Bands(whole_units(rows), None, group.group_name)
    note = describe_plan(planned, step) if rank == 0 and settings.config.verbose else None
    deduplicated = planned.deduplicated_rows()
    defer(
        call_id,
        note,
        lambda: state.stats(step, rank, solved, units_R, measured, exchange_model, deduplicated),
    )
    if not route.applied:  # nothing moves: the gather was the call's last collective
        publish(call_id)
    return grid, routing, solved


def _rows_routing(route: Routing, routed, rows_of, **changes) -> torch.Tensor:
    """``route`` with each unit's rows counted by ``rows_of`` (``routed(rows_of=...)`` lays them
    out) and ``changes`` made, packed: the routing that restores the outputs of a tower whose
    outputs have other row counts than its pixels (``call.run_balanced``'s ``output_rows``)."""
    moved = routed(rows_of=rows_of)
    rows = {f: getattr(moved, f) for f in ("unit_rows", "send_rows", "recv_rows", "dummy_rows")}
    changed = dataclasses.replace(route, **rows, **changes)
    return changed.to_tensor(max(1, len(changed.unit_rows)))


# Ids of the calls planned in this process, for their status words and deferred reports.
_CALL_IDS = itertools.count(1)


def _band_scale(cost_model, exchange_model):
    """What prices a band's exchange (``plan.bands.exchange_scale``): the measured exchange when
    costs are in seconds, the H100-class constants when they are in multiply-accumulates, else
    nothing (``l**2`` and polynomial costs have no scale for bytes)."""
    if exchange_model is not None:
        return exchange_scale(True, exchange_model.latency, exchange_model.seconds_per_byte)
    if isinstance(cost_model, ArchitectureCost):
        return exchange_scale(False)
    return None


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
    replicas=None,
    bands=False,
):
    ctx = torch.library.get_ctx()
    grid = grid_thw.new_empty(ctx.new_dynamic_size(min=1), 3)  # >= 1: the dummy unit
    replicated = len(replicas or ()) > 1
    size = routing_size(max_units(pixel_values.shape[0], merge_size), world_size, replicated)
    routing = torch.empty(size, dtype=torch.int64, device="cpu")
    return grid, routing
