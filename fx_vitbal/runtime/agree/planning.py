"""The ``vitbal::plan`` custom op and its body: gather every rank's metadata, cost the units,
solve the plan, and give this rank its balanced grid and routing
(``fx_vitbal.runtime.transport.ops`` states the conventions every ``vitbal`` op keeps).

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
from fx_vitbal.measure.measurements import measurements_for
from fx_vitbal.measure.stats import defer, publish
from fx_vitbal.plan.step import plan_step
from fx_vitbal.plan.units import Plan
from fx_vitbal.runtime.agree import handover
from fx_vitbal.runtime.agree.metadata import gather_grids, settings_fingerprint
from fx_vitbal.runtime.agree.replicas import routing_for_sets
from fx_vitbal.runtime.bands.view import Bands, band_layout, whole_attention, whole_units
from fx_vitbal.runtime.transport import status, transfer
from fx_vitbal.runtime.transport.collectives import group_ranks, resolve_group
from fx_vitbal.runtime.transport.layouts import layout_key, layouts_agreed
from fx_vitbal.runtime.transport.routing import (
    Routing,
    balanced_grid,
    local_outputs,
    local_routing,
    max_units,
    routing_size,
)
from fx_vitbal.runtime.transport.rows import DTYPES
from fx_vitbal.runtime.transport.state import StepState, register
from fx_vitbal.runtime.vit.settings import BalancedCall, parse_planner_spec, plan_key, plan_settings


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
    runs_bands: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather all ranks' grids, solve the plan, return ``(balanced grid, routing)``; the
    arguments after the grid are a ``settings.BalancedCall``'s, flat (``BalancedCall.op_args``).

    The balanced grid lists this rank's units in arrival order (the original grid when the plan
    is not applied), or the dummy unit ``[1, m, m]`` when there are none. The planner's
    fingerprint rides in the metadata, so ranks with different settings all raise. An inactive
    call (balancing off, e.g. eval mode) gathers nothing: the local batch stays home and no
    collective runs in any op. A plan made ahead for the ViT (``module_key``) replaces the
    gather and the solve (``runtime.agree.handover``). The call's host state
    (``runtime.transport.state``) is registered under the routing's step.
    """
    call = BalancedCall(
        *(merge_size, planner, world_size, group_name, active, module_key, problem, grad_fixed),
        tuple(replicas or ()),
        runs_bands,
    )
    group = resolve_group(group_name)
    if dist.get_world_size(group) != world_size:
        raise ValueError(
            f"world_size={world_size} but group {group_name!r} has {dist.get_world_size(group)} "
            "ranks"
        )
    if not active:
        return local_outputs(pixel_values, grid_thw, merge_size, world_size)
    status.check(group_name)  # a step whose backward never ran: its outputs' verdict first
    owner = (module_key, group_name, dist.get_rank(group))
    planned = handover.take(module_key) if module_key else None
    if planned is not None:  # made ahead (fx_vitbal.plan_ahead): no gather, no solve
        units = max_units(pixel_values.shape[0], merge_size)
        grid, routing, kept = handover.step_outputs(
            planned, pixel_values, grid_thw, call, group, units
        )
    else:
        grid, routing, kept, _ = solve_for_rank(pixel_values, grid_thw, call, group)
        grid = transfer.to_device(grid, grid_thw.device)
    if kept is not None:
        register(kept, owner)
    return grid, routing


def solve_for_rank(
    pixel_values: torch.Tensor,
    grid_thw: torch.Tensor,
    call: BalancedCall,
    group: dist.ProcessGroup,
    *,
    device_type: str | None = None,
    check_pixels: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, StepState, Plan]:
    """The body of an active ``plan``, also run ahead of the step by ``fx_vitbal.plan_ahead``:
    gather (``metadata.gather_grids``) and solve; ``(balanced grid, routing, state, plan)``, the
    grid on the host (the op copies it to the device), ``state`` the call's host state
    (``runtime.transport.state``), for the caller to register. ``device_type``: where the step's ViT
    runs, for its autocast state (default: the pixels' device); ``check_pixels`` as
    ``gather_grids`` takes it."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    merge_size, planner = call.merge_size, call.planner
    # --- measured times (fx_vitbal.measure): report an earlier call in the header, fit from
    # every rank's reports, plan with the fitted models. Ranks whose fits saw different calls
    # would plan differently: the fingerprint covers the count, so they raise together instead.
    state = measurements_for(
        group.group_name, plan_key(planner), lambda: parse_planner_spec(planner)[1]
    )
    fingerprint = settings_fingerprint(planner, merge_size, world_size, state.calls())
    report = state.report()
    dtype_code = DTYPES.index(pixel_values.dtype) if pixel_values.dtype in DTYPES else -1
    key = layout_key(call.module_key, dtype_code, device_type or pixel_values.device.type)
    ranks = group_ranks(group)
    gathered = gather_grids(
        pixel_values,
        grid_thw,
        merge_size,
        group,
        fingerprint,
        report,
        problem=call.problem,
        grad_fixed=call.grad_fixed,
        new_layout=layouts_agreed(ranks, key) is None,
        replica_ranks=call.replicas,
        check_pixels=check_pixels,
        runs_bands=call.runs_bands,
    )
    measured = state.observe(gathered.reports_R)
    pixel_bytes = gathered.row_numel * DTYPES[gathered.dtype_code].itemsize
    exchange_model = state.exchange_model(pixel_bytes, gathered.pixels_need_grad)
    settings = plan_settings(planner)
    cost_model = state.cost_model() or settings.cost_model  # fitted this step (online)
    settings = dataclasses.replace(settings, cost_model=cost_model)
    if exchange_model is not None:  # measured: costs are seconds, and so is the exchange
        settings = dataclasses.replace(
            settings,
            exchange_seconds=exchange_model.step_seconds,
            exchange_latency=exchange_model.latency,
            exchange_seconds_per_byte=exchange_model.seconds_per_byte,
        )
    if not gathered.runs_bands:  # some rank's call does not run them
        settings = dataclasses.replace(settings, band_rule=None)
    step = state.next_step()
    describe = step if rank == 0 and settings.config.verbose else None
    planned = plan_step(gathered.grids_R, settings, gathered.sets, describe)
    solved, units_R, units_O = planned.plan, planned.units_R, planned.units_O
    call_id = next(_CALL_IDS)
    clock = state.begin(step, solved, units_R, merge_size)
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
    split = bool(planned.frames)
    route = dataclasses.replace(
        route,
        any_units=any(units_R),
        row_numel=gathered.row_numel,
        dtype_code=gathered.dtype_code,
        pixels_need_grad=gathered.pixels_need_grad,
        step=call_id,
        layout_key=key,
        check_layouts=gathered.check_layouts,
        split=split,
    )
    # A plan not applied keeps every unit home: the local units (frames split where they may
    # be), which a tower fed one frame per grid row needs; or the dummy unit.
    rows = rows or balanced_grid(solved, units_R, rank, merge_size)
    grid = torch.tensor(rows, dtype=grid_thw.dtype, device="cpu")
    routing = route.to_tensor(max_units(pixel_values.shape[0], merge_size))
    kept = StepState(
        routing,
        route,
        clock=clock,
        home_grid=gathered.grids_R[rank],
        output_routing=functools.partial(_rows_routing, route, routed),
    )
    # The batch as the ViT gets it (``Bands``): its units, and on a step that splits a frame
    # the exchange of the frame's keys and values.
    if split:
        band_units, layout, attending = band_layout(planned, arrivals, rank, world_size, merge_size)
        layout = dataclasses.replace(layout, step=call_id)
        packed = layout.to_tensor()
        kept.bands = Bands(band_units, packed, group.group_name, attending=attending)
        kept.band_layout = (packed, layout)
    else:
        units = whole_units(rows)
        kept.bands = Bands(units, None, group.group_name, attending=whole_attention(units))
    facts = (planned.deduplicated_rows, [planned.exchanges[n] for n in sorted(planned.frames)])
    defer(
        call_id,
        planned.note,
        lambda: state.stats(step, rank, solved, units_R, measured, exchange_model, *facts),
    )
    if not route.applied:  # nothing moves: the gather was the call's last collective
        publish(call_id)
    return grid, routing, kept, solved


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
    runs_bands=False,
):
    ctx = torch.library.get_ctx()
    grid = grid_thw.new_empty(ctx.new_dynamic_size(min=1), 3)  # >= 1: the dummy unit
    replicated = len(replicas or ()) > 1
    size = routing_size(max_units(pixel_values.shape[0], merge_size), world_size, replicated)
    routing = torch.empty(size, dtype=torch.int64, device="cpu")
    return grid, routing
