"""Planning ahead (``fx_vitbal.ahead``): a plan made in a background thread over a gloo group of
its own gives the step exactly the in-step result, with no metadata gather in the step; a batch
that differs from its plan on one rank makes every rank raise the same error, and the next step
works. 3 gloo ranks, one without images."""

import re
import threading

import pytest
import torch
import torch.distributed as dist
from dist_utils import (
    assert_units_moved,
    fullgraph_capture,
    record_collectives,
    record_moves,
    run_ranks,
    train_step,
)

import fx_vitbal
from fx_vitbal.passes import apply_vit_balance_pass, symbolic_trace
from fx_vitbal.runtime.agree import handover
from fx_vitbal.runtime.vit.settings import layout_token
from fx_vitbal.tools.models import ViTConfig
from fx_vitbal.tools.omni import LMConfig, OmniEncoderModel, make_inputs

SKEWED = [[[1, 16, 12], [2, 4, 6]], [[1, 2, 2]], []]  # the plan is applied; rank 2 has nothing
EVEN = [[[1, 4, 4]], [[1, 4, 4]], [[1, 4, 4]]]  # the plan is skipped
OTHER = [[1, 8, 8]]  # what rank 1 gets instead of its planned batch


def _model() -> OmniEncoderModel:
    torch.manual_seed(0)
    return OmniEncoderModel(ViTConfig(deepstack_indexes=(0,)), LMConfig(num_layers=1))


def _plan_in_background(vit, batches, group, config=None) -> list:
    """``plan_ahead`` for each batch in a thread, while this thread runs collectives on the
    default group (as a training step would)."""
    planned, errors = [], []

    def work():
        try:
            for pixels, grid in batches:
                planned.append(fx_vitbal.plan_ahead(vit, pixels, grid, group=group, config=config))
        except Exception as error:  # noqa: BLE001  (re-raised in the main thread)
            errors.append(error)

    thread = threading.Thread(target=work)
    thread.start()
    busy = torch.ones(1)
    while busy.item():  # the main group stays in use, in lockstep, until every rank's plans are in
        busy.fill_(float(thread.is_alive()))
        dist.all_reduce(busy)
    thread.join()
    if errors:
        raise errors[0]
    return planned


def _gathers(issued: list) -> dict:
    """The library's gathers among the collectives ``record_collectives`` saw (host reads are
    counted in test_host_syncs.py)."""
    return {"all_gather": sum(name == "all_gather" for _, name, _, _ in issued)}


def _same_results(rank: int, world: int) -> dict:
    plan_group = dist.new_group(backend="gloo")
    vit = _model().visual
    input_ids, pixels, grid = make_inputs(SKEWED[rank], in_dim=24, seed=rank)
    # The eager call on rank 2 passes None; the in-place parent passes its empty tensors.
    batches = [(pixels, grid) if SKEWED[rank] else (None, None), (pixels, grid)]
    eager, inplace = _plan_in_background(vit, batches, plan_group)
    pixels, grid = batches[0]
    results = {"applied": eager.plan.applied}

    def vit_call(plan=None, balanced=True):
        vit.zero_grad(set_to_none=True)
        px = None if pixels is None else pixels.clone().requires_grad_(False)
        if balanced:
            out = fx_vitbal.dp_balance_vit_encoder(vit, px, grid, plan=plan)
        else:
            out = vit(px, grid) if px is not None else (None, None, [])
        embeds, _, deepstack = out
        loss = sum(o.pow(2).sum() / 1e3 for o in [embeds, *deepstack] if o is not None)
        if torch.is_tensor(loss):
            loss.backward()
        grads = torch.cat(
            [
                p.grad.flatten() if p.grad is not None else p.new_zeros(p.numel())
                for p in vit.parameters()
            ]
        )
        dist.all_reduce(grads)
        return embeds.detach() if embeds is not None else None, grads

    results["unbalanced"] = vit_call(balanced=False)
    results["in_step"] = vit_call()
    with record_collectives() as issued, record_moves() as moves:
        results["ahead"] = vit_call(eager)
    results["moves"], results["counts"] = moves, _gathers(issued)
    # In place: the same model trained with the plan handed over by use_plan.
    reference = train_step(_model(), SKEWED[rank], rank)
    model = fx_vitbal.enable_vit_balance(_model())
    fx_vitbal.use_plan(model, inplace)
    results["in_place"] = (train_step(model, SKEWED[rank], rank), reference)
    results["consumed"] = handover.take(layout_token(model.visual)) is None
    return results


def test_a_plan_made_ahead_in_a_thread_gives_the_in_step_results_without_a_metadata_gather():
    results = run_ranks(_same_results, 3)
    assert all(res["applied"] for res in results)
    for res in results:
        ahead_embeds, ahead_grads = res["ahead"]
        step_embeds, step_grads = res["in_step"]
        if res["unbalanced"][0] is not None:
            torch.testing.assert_close(ahead_embeds, res["unbalanced"][0], rtol=0, atol=0)
        torch.testing.assert_close(ahead_grads, res["unbalanced"][1], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ahead_embeds, step_embeds, rtol=0, atol=0)
        torch.testing.assert_close(ahead_grads, step_grads, rtol=0, atol=0)
        (got_logits, got_grads), (want_logits, want_grads) = res["in_place"]
        torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got_grads, want_grads, rtol=1e-5, atol=1e-6)
        assert res["consumed"]
        # No metadata gather in the step. Its one gather: restore's output-layout check, since
        # this plan was made before the group had agreed on the ViT's layouts.
        assert res["counts"] == {"all_gather": 1}, res["counts"]
    assert_units_moved(results)


def _mismatch(rank: int, world: int) -> dict:
    plan_group = dist.new_group(backend="gloo")
    model = fx_vitbal.enable_vit_balance(_model())
    batches = [make_inputs(SKEWED[rank], in_dim=24, seed=rank) for _ in range(2)]
    even = make_inputs(EVEN[rank], in_dim=24, seed=rank)
    grids = [b[1:] for b in batches] + [even[1:], batches[0][1:]]
    planned = _plan_in_background(model.visual, grids, plan_group)
    results = {}

    def step_on_another_batch(plan) -> str | None:
        # Rank 1 gets another batch than planned; the plan moves rows, so every rank raises.
        got = make_inputs(OTHER, in_dim=24, seed=7) if rank == 1 else batches[0]
        fx_vitbal.use_plan(model, plan)
        try:
            model(*got).pow(2).mean().backward()
            return None
        except ValueError as error:
            return str(error)
        finally:
            model.zero_grad(set_to_none=True)

    # Step 1: the first balanced step of the group.
    results["error"] = step_on_another_batch(planned[0])
    # Step 2: the planned batch again: balanced, exact.
    fx_vitbal.use_plan(model, planned[1])
    with record_moves() as moves:
        logits = model(*batches[1])
    logits.pow(2).mean().backward()
    results["good"] = logits.detach()
    results["moves"] = moves
    results["want"] = _model()(*batches[1]).detach()
    # Step 3: a plan that moves nothing, and rank 1's batch differs: it runs its own batch.
    got = make_inputs(OTHER, in_dim=24, seed=7) if rank == 1 else even
    fx_vitbal.use_plan(model, planned[2])
    results["skipped"] = (model(*got).detach(), _model()(*got).detach(), planned[2].plan.applied)
    # Step 4: the same after good steps.
    results["error_later"] = step_on_another_batch(planned[3])
    return results


def test_a_batch_that_differs_from_its_plan_on_one_rank_raises_the_same_error_on_every_rank():
    results = run_ranks(_mismatch, 3)
    errors = {res["error"] for res in results} | {res["error_later"] for res in results}
    assert len(errors) == 1, errors
    (error,) = errors
    assert error is not None and "not the batch planned ahead" in error and "rank(s) [1]" in error
    for res in results:
        torch.testing.assert_close(res["good"], res["want"], rtol=1e-5, atol=1e-6)
        got, want, applied = res["skipped"]
        assert not applied
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert_units_moved(results)


def _compiled(rank: int, world: int) -> dict:
    plan_group = dist.new_group(backend="gloo")
    vit = _model().visual
    _, pixels, grid = make_inputs(SKEWED[rank], in_dim=24, seed=rank)
    planned = [fx_vitbal.plan_ahead(vit, pixels, grid, group=plan_group) for _ in range(4)]

    def call(pixels, grid, plan):
        return fx_vitbal.dp_balance_vit_encoder(vit, pixels, grid, plan=plan)[0]

    def call_fullgraph(pixels, grid, plan):  # a code object of its own: dynamo caches per code
        return fx_vitbal.dp_balance_vit_encoder(vit, pixels, grid, plan=plan)[0]

    out = {"eager": call(pixels, grid, planned[0]).detach()}
    with record_collectives() as issued:
        out["compiled"] = torch.compile(call, backend="aot_eager")(pixels, grid, planned[1])
    out["counts"] = _gathers(issued)
    with pytest.raises(Exception, match="handed over eagerly") as caught:
        torch.compile(call_fullgraph, backend="aot_eager", fullgraph=True)(pixels, grid, planned[2])
    out["fullgraph"] = type(caught.value).__name__
    # In place, the whole model compiled: use_plan hands the plan to the compiled step.
    model = torch.compile(fx_vitbal.enable_vit_balance(_model()), backend="aot_eager")
    fx_vitbal.use_plan(model, planned[3])
    with record_moves() as moves:
        out["in_place"] = (
            train_step(model, SKEWED[rank], rank),
            train_step(_model(), SKEWED[rank], rank),
        )
    out["moves"] = moves
    return out


def test_a_plan_runs_eagerly_between_compiled_graphs_and_fullgraph_refuses_it():
    results = run_ranks(_compiled, 3)
    for res in results:
        torch.testing.assert_close(
            res["compiled"], res["eager"], rtol=1e-5, atol=1e-6
        )  # dense attention
        assert res["counts"] == {"all_gather": 1}, res["counts"]  # as above
        assert res["fullgraph"] == "Unsupported"
        (got_logits, got_grads), (want_logits, want_grads) = res["in_place"]
        torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got_grads, want_grads, rtol=1e-5, atol=1e-6)
    assert_units_moved(results)


STEADY = ["all_to_all", "all_to_all"]
FIRST = ["all_to_all", "all_gather", "all_to_all"]


def _ahead_on_every_path(rank: int, world: int) -> dict:
    """Plans handed over with use_plan to an FX graph the pass rewrote, to a ViT called inside a
    fullgraph=True compiled function, and to a whole model compiled with fullgraph=True."""
    plan_group = dist.new_group(backend="gloo")
    _, pixels, grid = make_inputs(SKEWED[rank], in_dim=24, seed=rank)
    want = train_step(_model(), SKEWED[rank], rank)
    out = {}

    def step(name, model, planned_for):
        planned = fx_vitbal.plan_ahead(planned_for, pixels, grid, group=plan_group)
        fx_vitbal.use_plan(model, planned)
        with record_collectives() as issued, record_moves() as moves, fullgraph_capture():
            got = train_step(model, SKEWED[rank], rank)
        forward = [name for phase, name, _, _ in issued if phase == "forward"]
        out[name] = {
            "got": got,
            "forward": forward,
            "moves": moves,
            "applied": planned.plan.applied,
        }

    gm = apply_vit_balance_pass(symbolic_trace(_model()))
    step("fx", gm, gm)
    compiled = torch.compile(fx_vitbal.enable_vit_balance(_model()), backend="aot_eager")
    step("compiled", compiled, compiled)
    fullgraph = torch.compile(
        fx_vitbal.enable_vit_balance(_model()), backend="aot_eager", fullgraph=True
    )
    step("fullgraph model", fullgraph, fullgraph)
    # A ViT called inside a fullgraph compiled function, its plan handed over before the call.
    vit = _model().visual
    embeds_eager = fx_vitbal.dp_balance_vit_encoder(vit, pixels, grid)[0].detach()

    def call(pixels, grid):
        return fx_vitbal.dp_balance_vit_encoder(vit, pixels, grid)[0]

    fx_vitbal.use_plan(vit, fx_vitbal.plan_ahead(vit, pixels, grid, group=plan_group))
    with record_collectives() as issued, fullgraph_capture():
        embeds = torch.compile(call, backend="aot_eager", fullgraph=True)(pixels, grid)
    out["fullgraph call"] = (embeds.detach(), embeds_eager, [n for _, n, _, _ in issued])
    # A batch that differs from its plan on rank 1, in the fullgraph model: every rank raises.
    planned = fx_vitbal.plan_ahead(fullgraph, pixels, grid, group=plan_group)
    fx_vitbal.use_plan(fullgraph, planned)
    other = OTHER if rank == 1 else SKEWED[rank]
    try:
        with fullgraph_capture():
            train_step(fullgraph, other, rank)
        out["error"] = None
    except ValueError as error:  # torch 2.8 appends the compiled backward's traceback
        out["error"] = re.search("vit dp balance:.*?the order of the steps", str(error)).group(0)
    out["want"] = want
    return out


def test_plans_made_ahead_serve_fx_graphs_and_fullgraph_compiled_models_alike():
    results = run_ranks(_ahead_on_every_path, 3, timeout=480)
    for res in results:
        (want_logits, want_grads) = res["want"]
        for name in ("fx", "compiled", "fullgraph model"):
            got_logits, got_grads = res[name]["got"]
            torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-6, msg=name)
            torch.testing.assert_close(got_grads, want_grads, rtol=1e-5, atol=1e-6, msg=name)
            # No metadata gather in the step: the pixels out and the outputs home (a new ViT's
            # first call also agrees on its output layouts, between the two).
            assert res[name]["forward"] in (STEADY, FIRST), (name, res[name]["forward"])
            assert res[name]["applied"], name
        embeds, eager, issued = res["fullgraph call"]
        torch.testing.assert_close(embeds, eager, rtol=1e-5, atol=1e-6)
        assert issued == STEADY, issued  # its eager call agreed on the layouts
    errors = {res["error"] for res in results}
    assert len(errors) == 1, errors
    (error,) = errors
    assert error is not None and "not the batch planned ahead" in error and "rank(s) [1]" in error
    assert_units_moved([res[name] for res in results for name in ("fx", "fullgraph model")])


def _online_ahead(rank: int, world: int) -> list:
    from fx_vitbal.measure.stats import add_stats_callback

    plan_group = dist.new_group(backend="gloo")
    vit = _model().visual
    config = fx_vitbal.BalanceConfig(cost_model="online", trigger_threshold=0.0, min_gain=0.0)
    stats = []
    handle = add_stats_callback(stats.append)
    try:
        for step in range(4):
            _, pixels, grid = make_inputs(SKEWED[rank] or [[1, 2, 2]], in_dim=24, seed=step)
            (planned,) = _plan_in_background(vit, [(pixels, grid)], plan_group, config)
            embeds, _, _ = fx_vitbal.dp_balance_vit_encoder(
                vit, pixels, grid, config=config, plan=planned
            )
            embeds.pow(2).sum().backward()
    finally:
        handle.remove()
    return [(s.applied, s.measured_steps, s.measured_seconds) for s in stats]


def test_online_costs_are_timed_and_reported_through_plans_made_ahead():
    results = run_ranks(_online_ahead, 3)
    assert results[0] == results[1] == results[2]  # every rank saw every rank's times
    applied, steps, seconds = zip(*results[0], strict=True)
    assert any(applied)
    # Each plan made ahead reports the previous planned call's ViT times, from every rank.
    assert all(s is not None and s > 0 for s in seconds[-1])
    assert len(set(steps[-1])) == 1


def _any_vit(rank: int, world: int) -> dict:
    """An unregistered ViT written to the seed's contract (``test_contract.SeedViT``), passed
    to ``plan_ahead`` itself, with its pixels on the host and as ``meta``; then all three ranks
    as one replica set, planned from ``meta`` pixels."""
    from test_contract import GRIDS, SeedViT

    plan_group = dist.new_group(backend="gloo")
    torch.manual_seed(0)
    vit = SeedViT()
    _, pixels, grid = make_inputs(GRIDS[rank], in_dim=24, seed=rank)
    want = vit(pixels, grid)[0].detach()
    results = {}
    for kind in ("host", "meta"):
        planned_pixels = pixels if kind == "host" else pixels.to("meta")
        planned = fx_vitbal.plan_ahead(vit, planned_pixels, grid, group=plan_group)
        with record_collectives() as issued, record_moves() as moves:
            got = fx_vitbal.dp_balance_vit_encoder(vit, pixels, grid, plan=planned)[0]
        results[kind] = {
            "exact": torch.allclose(got, want, rtol=1e-5, atol=1e-6),
            "gathers": _gathers(issued),
            "moves": moves,
        }
    _, pixels, grid = make_inputs(GRIDS[0], in_dim=24, seed=0)  # every rank: one set's batch
    planned = fx_vitbal.plan_ahead(
        vit, pixels.to("meta"), grid, group=plan_group, replica_group=[0, 1, 2]
    )
    got = fx_vitbal.dp_balance_vit_encoder(vit, pixels, grid, plan=planned, replica_group=[0, 1, 2])
    results["replicas"] = torch.allclose(got[0], vit(pixels, grid)[0], rtol=1e-5, atol=1e-6)
    return results


def test_any_vit_plans_ahead_from_host_or_meta_pixels_with_or_without_replica_sets():
    results = run_ranks(_any_vit, 3)
    for kind in ("host", "meta"):
        runs = [res[kind] for res in results]
        assert all(run["exact"] for run in runs), runs
        # The step gathers nothing but the layout agreement of the ViT's first planned call.
        assert [run["gathers"] for run in runs] == [{"all_gather": kind == "host"}] * 3, runs
        assert_units_moved(runs)
    assert all(res["replicas"] for res in results)


AUTOCAST = [[[1, 16, 12], [2, 4, 6]], [[1, 2, 2]]]  # 2 ranks: units move to rank 1


def _meta_under_autocast(rank: int, world: int) -> dict:
    """A plan made from ``meta`` pixels inside CPU bf16 autocast, for a step under the same
    autocast: it must key its output layouts on the autocast of the ViT's device (the CPU, where
    its parameters are), not on the ``meta`` pixels' device, which has no autocast."""
    plan_group = dist.new_group(backend="gloo")
    vit = _model().visual
    _, pixels, grid = make_inputs(AUTOCAST[rank], in_dim=24, seed=rank)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = vit(pixels, grid)[0].detach()
        # An earlier step under this autocast: the group agrees on its output layouts (bf16).
        fx_vitbal.dp_balance_vit_encoder(vit, pixels, grid)
        planned = fx_vitbal.plan_ahead(vit, pixels.to("meta"), grid, group=plan_group)
        with record_collectives() as issued, record_moves() as moves:
            got = fx_vitbal.dp_balance_vit_encoder(vit, pixels, grid, plan=planned)[0].detach()
    return {
        "got": got,
        "want": want,
        "gathers": _gathers(issued),
        "moves": moves,
        "applied": planned.plan.applied,
    }


def test_a_plan_made_from_meta_pixels_under_autocast_keys_the_steps_autocast_layouts():
    results = run_ranks(_meta_under_autocast, 2)
    for rank, res in enumerate(results):
        assert res["applied"], rank
        assert res["got"].dtype == res["want"].dtype == torch.bfloat16, rank
        # The layouts this autocast state agreed on serve the step: no metadata gather and no
        # layout agreement (a plan keyed without autocast would agree on new ones here).
        assert res["gathers"] == {"all_gather": 0}, (rank, res["gathers"])
        torch.testing.assert_close(res["got"], res["want"], rtol=1.6e-2, atol=1e-3)
    assert_units_moved(results)
