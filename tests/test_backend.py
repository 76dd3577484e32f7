"""torch.compile: the ``vitbal`` backend, and compiled FX-pass graphs (aot_eager and inductor)."""

import time

import pytest
import torch
import torch.distributed as dist
from dist_utils import (
    UNBACKED_BATCH_SIZES,
    assert_units_moved,
    fullgraph_capture,
    record_collectives,
    record_moves,
    run_ranks,
    train_step,
)

import fx_vitbal
from fx_vitbal import _compat
from fx_vitbal.passes import apply_vit_balance_pass, symbolic_trace
from fx_vitbal.passes.backend import make_vitbal_backend
from fx_vitbal.tools.models import ViTConfig
from fx_vitbal.tools.omni import LMConfig, OmniEncoderModel, make_inputs

# Per step, per rank. Image counts change every step (0 to 3), so a compiled graph that
# specialized on them would recompile.
STEPS = [
    [[[1, 8, 8], [2, 4, 6]], [[1, 2, 2]]],
    [[[1, 4, 4]], [[1, 12, 8], [1, 2, 4], [1, 2, 2]]],
    [[], [[1, 10, 6], [1, 4, 4]]],
]


@torch.compiler.nested_compile_region
def _vit_region(vit, pixel_values, image_grid_thw):
    return vit(pixel_values, image_grid_thw)


class _RegionModel(OmniEncoderModel):
    """The reference model with its ViT call marked as a nested compile region."""

    def encode_images(self, pixel_values, image_grid_thw):
        vis = _vit_region(self.visual, pixel_values, image_grid_thw)
        deepstack = [vis[2][k] for k in range(len(self.vit_config.deepstack_indexes))]
        return self.projector(vis[0]), deepstack  # the ViT's rows are pre-merger


needs_unbacked_batch_sizes = pytest.mark.skipif(
    not UNBACKED_BATCH_SIZES, reason="one graph for every image count needs torch >= 2.11 here"
)


def _model(cls=OmniEncoderModel) -> OmniEncoderModel:
    torch.manual_seed(0)
    return cls(ViTConfig(deepstack_indexes=(0,)), LMConfig(num_layers=1))


def _compiled_vs_reference(rank: int, world: int, mode: str, steps=STEPS) -> dict:
    reference = _model()
    wanted = [train_step(reference, step[rank], rank) for step in steps]
    model = _model(_RegionModel if mode == "region_vitbal_aot_eager" else OmniEncoderModel)
    unbacked = mode in ("inductor_single_graph", "region_vitbal_aot_eager", "wrapped_inductor")
    if mode == "region_vitbal_aot_eager":
        _compat.keep_nested_compile_regions()
        options = {"inner": "aot_eager", "vit": model.visual}
        run = torch.compile(model, backend="vitbal", fullgraph=True, options=options)
    elif mode == "wrapped_vitbal_aot_eager":
        fx_vitbal.enable_vit_balance(model)
        run = torch.compile(model, backend="vitbal", options={"inner": "aot_eager"})
    elif mode == "wrapped_inductor":
        fx_vitbal.enable_vit_balance(model)
        run = torch.compile(model, backend="vitbal", fullgraph=True)
    else:
        run = torch.compile(apply_vit_balance_pass(symbolic_trace(model)), fullgraph=True)
    torch._dynamo.utils.counters.clear()
    start = time.perf_counter()
    with record_moves() as moves, fullgraph_capture(mode != "wrapped_vitbal_aot_eager"):
        got = [train_step(run, step[rank], rank, unbacked=unbacked) for step in steps]
    seconds = time.perf_counter() - start
    planned = None
    if mode == "wrapped_inductor":  # a plan made ahead enters the same inductor graph
        _, pixels, grid = make_inputs(steps[0][rank], in_dim=24, seed=rank)
        ahead = fx_vitbal.plan_ahead(run, pixels, grid, group=dist.group.WORLD)
        fx_vitbal.use_plan(run, ahead)
        with record_collectives() as issued, record_moves() as moved, fullgraph_capture():
            got_planned = train_step(run, steps[0][rank], rank, unbacked=unbacked)
        forward = [name for phase, name, _, _ in issued if phase == "forward"]
        planned = (got_planned, forward, ahead.plan.applied, moved)
    return {
        "got": got,
        "wanted": wanted,
        "moves": moves,
        "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
        "seconds": seconds,
        "planned": planned,
    }


def _check(results) -> None:
    for res in results:
        for (logits, grads), (want_logits, want_grads) in zip(
            res["got"], res["wanted"], strict=True
        ):
            torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(grads, want_grads, rtol=1e-4, atol=1e-5)
    assert_units_moved(results)


def test_wrapped_model_through_the_vitbal_backend_matches_and_moves_images():
    _check(run_ranks(_compiled_vs_reference, 2, "wrapped_vitbal_aot_eager"))


@pytest.mark.slow
@needs_unbacked_batch_sizes
def test_inductor_wrapped_model_compiles_once_for_all_image_counts_and_takes_plans_made_ahead():
    results = run_ranks(_compiled_vs_reference, 2, "wrapped_inductor", timeout=900)
    _check(results)
    assert [res["graphs"] for res in results] == [1, 1]  # the planned step compiled nothing
    for res in results:  # the planned step: the first step's results, no metadata gather
        (logits, grads), forward, applied, _ = res["planned"]
        assert applied
        want_logits, want_grads = res["wanted"][0]
        torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(grads, want_grads, rtol=1e-4, atol=1e-5)
        assert forward == ["all_to_all", "all_to_all"], forward
    assert_units_moved([{"moves": res["planned"][3]} for res in results])  # by the plan ahead


@pytest.mark.slow
@needs_unbacked_batch_sizes
def test_fx_pass_under_inductor_fullgraph_compiles_once_for_all_image_counts():
    results = run_ranks(_compiled_vs_reference, 2, "inductor_single_graph", timeout=900)
    _check(results)
    for res in results:
        print(f"inductor single graph: {res['graphs']} graph(s), {res['seconds']:.0f} s")
        assert res["graphs"] == 1


def test_vit_marked_as_nested_compile_region_is_balanced_by_the_backend_in_one_graph():
    results = run_ranks(_compiled_vs_reference, 2, "region_vitbal_aot_eager")
    _check(results)
    assert [res["graphs"] for res in results] == [1, 1]


def _own_graph_breaks(rank: int, world: int) -> list:
    """A tower with windows (it reads them on the host: a graph break inside the ViT, whose
    ``forward`` dynamo then compiles as a frame of its own) through the backend, balanced in
    place and as a rewritten FX graph: differences from the unbalanced run."""

    def model():
        torch.manual_seed(0)
        vit = ViTConfig(deepstack_indexes=(0,), window_size=2, fullatt_block_indexes=(1,))
        return OmniEncoderModel(vit, LMConfig(num_layers=1))

    want = train_step(model(), STEPS[0][rank], rank)
    options = {"inner": "aot_eager"}
    runs = [
        fx_vitbal.enable_vit_balance(model()),
        apply_vit_balance_pass(symbolic_trace(model())),
    ]
    diffs = []
    for run in runs:
        with record_moves() as moves:
            got = train_step(
                torch.compile(run, backend="vitbal", options=options), STEPS[0][rank], rank
            )
        diffs.append(([float((g - w).abs().max()) for g, w in zip(got, want, strict=True)], moves))
    return diffs


def test_a_vit_breaking_its_own_graph_is_balanced_through_the_backend_not_refused():
    results = run_ranks(_own_graph_breaks, 2)
    for path in range(2):  # in place, FX graph
        assert all(max(res[path][0]) <= 1e-5 for res in results), results
        assert any(sum(res[path][1]) for res in results), results  # units moved


@pytest.mark.parametrize("how", ["by_name", "factory"])
def test_unbalanced_vit_through_the_vitbal_backend_is_refused(how):
    torch._dynamo.reset()
    model = _model()
    if how == "by_name":
        compiled = torch.compile(model, backend="vitbal", options={"inner": "aot_eager"})
    else:
        compiled = torch.compile(model, backend=make_vitbal_backend(inner="aot_eager"))
    input_ids, pixels, grid = make_inputs([[1, 4, 4]], in_dim=24)
    with pytest.raises(Exception, match="compiled without balancing"):
        compiled(input_ids, pixels, grid)


def test_vitbal_backend_is_registered_through_the_entry_point():
    assert "vitbal" in torch._dynamo.list_backends(exclude_tags=())


def test_inductor_compiles_balancing_ops_with_the_settings_this_torch_needs(monkeypatch):
    # One rank is enough: the pass is given the group and world size, so the graph holds the ops.
    model = OmniEncoderModel(ViTConfig(), LMConfig(num_layers=1))
    gm = apply_vit_balance_pass(symbolic_trace(model), group_name="0", world_size=2)
    seen = {}

    def inner(name):
        def compile_fn(gm, example_inputs, **kwargs):
            seen[name] = kwargs
            return gm

        return compile_fn

    monkeypatch.setattr(torch._dynamo, "lookup_backend", inner)
    make_vitbal_backend(inner="inductor")(gm, [])
    needed = _compat.INDUCTOR_CONFIG_PATCHES  # none on a torch that needs none (2.8)
    assert seen["inductor"] == ({"config_patches": needed} if needed else {})
    if hasattr(torch._inductor.config.triton, "mix_order_reduction"):  # torch 2.11's failure
        assert _compat.INDUCTOR_CONFIG_PATCHES == {"triton.mix_order_reduction": False}
    # A user's own inductor options win; other inner backends get theirs untouched.
    options = {"inner": "inductor", "triton.mix_order_reduction": True, "max_autotune": True}
    fx_vitbal.passes.backend.vitbal_backend(gm, [], options=options)
    assert seen["inductor"]["config_patches"]["triton.mix_order_reduction"] is True
    assert seen["inductor"]["config_patches"]["max_autotune"] is True
    make_vitbal_backend(inner="aot_eager")(gm, [])
    assert seen["aot_eager"] == {}
    # torch.compile(..., backend="vitbal", mode="reduce-overhead") hands the backend its mode.
    make_vitbal_backend(inner="inductor")(gm, [], mode="reduce-overhead")
    assert seen["inductor"]["config_patches"]["triton.cudagraphs"] is True
