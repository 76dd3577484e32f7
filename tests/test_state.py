"""A call's host state lives in one registry keyed by its step (``runtime.transport.state``): found
through the step any copy of its tensors carries, released by the next call of the same ViT and
group, never carried on a tensor as a Python attribute."""

import torch
import torch.distributed as dist
from dist_utils import run_ranks

import fx_vitbal
from fx_vitbal.runtime.agree import planning
from fx_vitbal.runtime.bands.blocks import AttentionLayout, AttentionUnit, FrameBand
from fx_vitbal.runtime.bands.view import band_tables
from fx_vitbal.runtime.transport import state
from fx_vitbal.runtime.transport.routing import Routing
from fx_vitbal.runtime.vit.settings import BalancedCall, planner_for
from fx_vitbal.tools.models import QwenStyleViT, ViTConfig
from fx_vitbal.tools.omni import make_inputs


def _state(step: int, split: bool = False) -> state.StepState:
    route = Routing(True, [4], [0], [4], [4], step=step, split=split)
    return state.StepState(route.to_tensor(1), route)


def test_the_next_call_of_the_same_vit_and_group_releases_a_state_and_no_other():
    first, other, second = _state(101), _state(102), _state(103)
    state.register(first, (7, "g", 0))
    state.register(other, (8, "g", 0))  # another ViT on the same group keeps its own
    assert state.state_of(101) is first
    state.register(second, (7, "g", 0))
    assert state.state_of(101) is None
    assert state.state_of(102) is other and state.state_of(103) is second


def test_a_copy_of_a_tensor_finds_its_calls_state_and_a_stranger_is_parsed_afresh():
    kept = _state(201)
    state.register(kept, (9, "g", 0))
    assert state.route_of(kept.routing) is kept.route  # parsed once
    copy = kept.routing.clone()
    assert state.route_of(copy) == kept.route and state.route_of(copy) is not kept.route
    assert state.state_of_routing(copy) is kept  # the state itself: through the step


def test_a_route_that_split_a_frame_but_has_no_state_raises_instead_of_attending_locally():
    gone = _state(301, split=True)  # never registered: its bands are nowhere
    grid = torch.tensor([[1, 4, 4]])
    try:
        band_tables(gone.routing, grid)
    except RuntimeError as error:
        assert "split a frame into bands but its call's state is gone" in str(error)
    else:
        raise AssertionError("a split route without its state must raise")
    whole = _state(302)  # a plan that split nothing: whole units, read from the grid
    table, _, attending = band_tables(whole.routing, grid)
    assert table.tolist() == [[1, 4, 0, 4, 4]]
    assert AttentionLayout.from_tensor(attending) == AttentionLayout(
        units=(AttentionUnit(rows=16),)
    )


def _one_split_call(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    vit = QwenStyleViT(ViTConfig())
    config = fx_vitbal.BalanceConfig(min_band_patches=64, cost_model="quadratic")
    planner, merge = planner_for(vit, config)
    grids = [[[1, 32, 32]], [[1, 4, 4]]][rank]
    _, pixels, grid = make_inputs(grids, in_dim=24, seed=rank)
    call = BalancedCall(
        merge_size=merge,
        planner=planner,
        world_size=world,
        group_name=dist.group.WORLD.group_name,
        module_key=11,
        runs_bands=True,
    )
    balanced_grid, routing = planning.plan(pixels, grid, *call.op_args())
    kept = state.state_holding(routing)
    table, layout, attending = band_tables(routing.clone(), balanced_grid)  # a compiler's copy
    return {
        "attributes": [name for name in vars(routing) if name.startswith("_vitbal")],
        "layout attributes": [name for name in vars(layout) if name.startswith("_vitbal")],
        "split": state.route_of(routing).split,
        "bands": kept.bands.split,
        "first rows": table[:, 2].tolist(),
        "attending": AttentionLayout.from_tensor(attending) == kept.bands.attending,
    }


def test_a_split_call_keeps_its_bands_in_its_state_and_nothing_on_its_tensors():
    results = run_ranks(_one_split_call, 2)
    for res in results:
        assert res["attributes"] == [] and res["layout attributes"] == []
        assert res["split"] and res["bands"] and res["attending"]
    # The frame's two bands, each at its first row, found from a copy of the routing.
    assert sorted(results[0]["first rows"] + results[1]["first rows"])[-2:] == [0, 16]


def test_an_attention_layout_packs_for_the_tensor_form_and_back_unchanged():
    """What a compiled graph carries to ``vitbal::band_attention``: every field of every unit."""
    band = FrameBand(
        frame=3, kind="usp", ranks=(4, 0, 2, 6), index=2, band_rows=(64, 64, 48, 48), node_bands=2
    )
    ring = FrameBand(frame=0, kind="ring", ranks=(1, 2), index=1, band_rows=(32, 16))
    layout = AttentionLayout(
        units=(
            AttentionUnit(rows=16),
            AttentionUnit(rows=48, band=band),
            AttentionUnit(rows=16, band=ring),
        )
    )
    packed = layout.to_tensor()
    assert packed.dtype == torch.int64 and packed.device.type == "cpu"
    assert AttentionLayout.from_tensor(packed) == layout
