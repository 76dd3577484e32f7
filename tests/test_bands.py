"""Row bands of one frame computed on several ranks (``fx_vitbal.plan.bands``,
``fx_vitbal.runtime.bands.view``): the planner's bands cover each split frame exactly, aligned and
never too small, and split only where it lowers the makespan; on 2 and 4 gloo ranks every path
that runs bands gives the unsplit run's outputs and gradients (fp32, 1e-5 relative), every rank
issuing the same collectives, and the paths that cannot run bands plan whole frames."""

import contextlib
import dataclasses
import io
import types

import pytest
import torch
import torch.distributed as dist
from dist_utils import (
    UNBACKED_BATCH_SIZES,
    fullgraph_capture,
    record_collectives,
    record_moves,
    run_ranks,
    train_step,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import fx_vitbal
from fx_vitbal.cost import ArchitectureCost
from fx_vitbal.passes import apply_vit_balance_pass, symbolic_trace
from fx_vitbal.plan.bands import Band, BandRule
from fx_vitbal.plan.step import plan_step
from fx_vitbal.plan.units import is_band, unit_rows
from fx_vitbal.runtime.bands.exchange import LOCAL
from fx_vitbal.runtime.bands.view import band_layout
from fx_vitbal.runtime.vit.registry import vision_encoder_spec
from fx_vitbal.runtime.vit.settings import band_rule_of, plan_settings, planner_spec_for
from fx_vitbal.tools.models import QwenStyleViT, ViTConfig
from fx_vitbal.tools.omni import LMConfig, OmniEncoderModel, make_inputs

# The tiny test tower's exchange would cost more than its compute at H100 speeds (the
# architecture model prices it so): the l**2 model, which prices no exchange, lets it split.
CONFIG = fx_vitbal.BalanceConfig(min_band_patches=64, cost_model="quadratic")
WINDOWS = {"window_size": 2, "fullatt_block_indexes": (1,)}  # bands start at 4 patch rows


# --- the planner (pure: no process group)


@given(
    h=st.integers(1, 40),
    w=st.integers(1, 12),
    align=st.sampled_from([2, 4, 8]),
    min_patches=st.integers(1, 200),
    parts=st.integers(1, 9),
)
def test_a_frames_bands_cover_it_in_order_aligned_and_never_too_small(
    h, w, align, min_patches, parts
):
    h *= 2
    rule = BandRule(align=align, min_patches=min_patches, exchange_layers=1, kv_bytes_per_patch=4)
    bands = rule.bands((1, h, w), parts)
    assert sum(b.h for b in bands) == h and bands[0].first_row == 0
    for before, after in zip(bands, bands[1:], strict=False):
        assert after.first_row == before.first_row + before.h
    if len(bands) > 1:
        assert len(bands) <= parts
        assert all(b.first_row % align == 0 and b.h % align == 0 for b in bands)
        assert all(b.h * w >= min_patches and (b.t, b.w, b.full_h) == (1, w, h) for b in bands)
        assert max(b.h for b in bands) - min(b.h for b in bands) <= align  # as even as rows allow


# Qwen2-VL's tower (d 1280, 32 layers of full attention), where bands pay from a few thousand
# patches on NVLink.
_ARCH = ArchitectureCost(hidden=1280, mlp_hidden=5120, depth=32, in_dim=1176, out_dim=3584)


def _plan(grids, split: bool = True, **config):
    """``(plan, units per rank)`` as the plan op plans them when every rank runs bands, their
    exchange priced at NVLink speed on an H100 (``plan.bands``)."""
    config = {"min_band_patches": 1024, **config}
    config = fx_vitbal.BalanceConfig(split_images=split, **config)
    spec = planner_spec_for(config, _ARCH, True, (2, 32, 1280, False, 16))
    planned = plan_step(grids, plan_settings(spec))  # architecture costs: priced at NVLink
    return planned.plan, planned.units_R


grids_strategy = st.lists(
    st.lists(
        st.tuples(st.integers(1, 2), st.integers(1, 96), st.integers(1, 96)).map(
            lambda g: [g[0], 2 * g[1], 2 * g[2]]
        ),
        max_size=4,
    ),
    min_size=2,
    max_size=6,
)


@settings(max_examples=150, deadline=None)
@given(grids=grids_strategy)
def test_plans_with_bands_compute_every_row_once_and_never_do_worse(grids):
    plan, units_R = _plan(grids)
    whole, _ = _plan(grids, split=False)
    # Every rank's units cover its own rows exactly, in order, each unit computed once.
    for grid, units in zip(grids, units_R, strict=True):
        assert sum(unit_rows(u) for u in units) == sum(t * h * w for t, h, w in grid)
    computed = sorted(pair for assigned in plan.assignment for pair in assigned)
    assert computed == sorted((r, i) for r, units in enumerate(units_R) for i in range(len(units)))
    bands = [u for units in units_R for u in units if is_band(u)]
    if bands:  # only when it lowered the predicted makespan by the minimum gain
        span = max(plan.loads_after if plan.applied else plan.loads_before)
        whole_span = max(whole.loads_after if whole.applied else whole.loads_before)
        assert span < whole_span
        assert all(b.first_row % 2 == 0 and b.h * b.w >= 1024 for b in bands)
        for r, units in enumerate(units_R):  # a split frame is computed on two ranks or more
            frames: list[set[int]] = []
            for u, d in zip(units, plan.destinations(r), strict=True):
                if is_band(u) and u.first_row == 0:
                    frames.append(set())
                if is_band(u):
                    frames[-1].add(d)
            assert all(len(ranks) >= 2 for ranks in frames), (r, units, plan.destinations(r))
    else:
        assert plan.assignment == whole.assignment


def test_a_frame_that_binds_the_step_is_split_and_the_makespan_falls():
    grids = [[[1, 128, 128]], [[1, 16, 16]], [], [[1, 32, 32]]]  # 16k patches binds
    plan, units_R = _plan(grids)
    whole, _ = _plan(grids, split=False)
    assert sum(map(is_band, units_R[0])) == 4
    assert max(plan.loads_after) < 0.35 * max(whole.loads_before)


def test_frames_are_not_split_where_the_exchange_costs_more_than_it_saves():
    # 1,536 patches: two bands would save ~2.4 ms of compute on an H100 and cost ~1.4 ms of
    # per-layer collectives (64 x 11 us): under the minimum gain of 0.5.
    grids = [[[1, 48, 32]], [[1, 4, 4]]]
    _, units_R = _plan(grids, min_gain=0.5, min_band_patches=256)
    assert not any(is_band(u) for units in units_R for u in units)
    _, units_R = _plan(grids, min_band_patches=256)  # the default gain: it pays
    assert any(is_band(u) for units in units_R for u in units)


# --- on gloo ranks


def _vit(windows: bool, dtype=torch.float32) -> QwenStyleViT:
    torch.manual_seed(0)
    config = ViTConfig(deepstack_indexes=(0,), depth=3, **(WINDOWS if windows else {}))
    return QwenStyleViT(config).to(dtype)


def _weights(x: torch.Tensor) -> torch.Tensor:
    return torch.linspace(-1, 2, x.numel(), dtype=x.dtype).view_as(x)


def _loss(embeds, deepstack):
    return (embeds * _weights(embeds)).sum() + (deepstack[0] * _weights(deepstack[0])).sum()


def _grads(vit, pixels, grid, balanced, config=CONFIG, **kwargs):
    """Outputs, pixel gradient and all-reduced parameter gradients by ``torch.autograd.grad``."""
    if balanced:
        embeds, _, deep = fx_vitbal.dp_balance_vit_encoder(
            vit, pixels, grid, config=config, **kwargs
        )
    else:
        embeds, _, deep = vit(pixels, grid)
    params = list(vit.parameters())
    grads = torch.autograd.grad(_loss(embeds, deep), [pixels, *params])
    flat = torch.cat([g.flatten() for g in grads[1:]])
    dist.all_reduce(flat)
    return [embeds.detach(), deep[0].detach(), grads[0], flat]


GRIDS = {
    2: [[[1, 32, 32]], [[1, 4, 4], [1, 8, 4]]],
    4: [[[1, 32, 32]], [[1, 4, 4]], [], [[2, 8, 8]]],  # a rank without images, a video
}


def _eager(rank: int, world: int, windows: bool) -> dict:
    vit = _vit(windows)
    _, pixels, grid = make_inputs(GRIDS[world][rank], in_dim=24, seed=rank)
    pixels.requires_grad_(True)
    want = _grads(vit, pixels, grid, balanced=False)
    stats, printed = [], io.StringIO()
    handle = fx_vitbal.add_stats_callback(stats.append)
    verbose = dataclasses.replace(CONFIG, verbose=True)
    with (
        record_collectives() as issued,
        record_moves() as moves,
        contextlib.redirect_stdout(printed),
    ):
        got = _grads(vit, pixels, grid, balanced=True, config=verbose)
    handle.remove()
    # The same batch without splitting: no per-layer exchange.
    with record_collectives() as whole:
        _grads(
            vit, pixels, grid, balanced=True, config=dataclasses.replace(CONFIG, split_images=False)
        )
    return {
        "got": got,
        "want": want,
        "issued": [(phase, name) for phase, name, _, _ in issued],
        "whole": [(phase, name) for phase, name, _, _ in whole],
        "moves": moves,
        "split_units": stats[-1].split_units,
        "printed": printed.getvalue(),
    }


def _check(results, split_units: int) -> None:
    for rank, res in enumerate(results):
        for got, want, what in zip(
            res["got"],
            res["want"],
            ["embeds", "deepstack", "pixel grad", "param grads"],
            strict=True,
        ):
            # Relative to the tensor's scale: summation orders differ, near-zero entries too.
            assert got.shape == want.shape, (rank, what)
            if want.numel():
                error = (got - want).abs().max() / want.abs().max()
                assert error <= 1e-5, (rank, what, float(error))
    assert len({tuple(res["issued"]) for res in results}) == 1  # lockstep
    assert [res["split_units"] for res in results] == [split_units] * len(results)
    assert any(sum(res["moves"]) for res in results)
    # The verbose line (rank 0) names the frame split and its bands.
    assert f", 1 frame split into {split_units} bands" in results[0]["printed"]
    assert [res["printed"] for res in results[1:]] == [""] * (len(results) - 1)


@pytest.mark.parametrize("windows", [False, True], ids=["full attention", "windows"])
@pytest.mark.parametrize("world", [2, 4])
def test_bands_give_the_unsplit_outputs_and_gradients_on_every_rank(world, windows):
    results = run_ranks(_eager, world, windows)
    _check(results, split_units={2: 2, 4: 4}[world])
    full_layers = 1 if windows else 3
    issued, whole = results[0]["issued"], results[0]["whole"]
    # Pixels out and outputs home; per full-attention layer, the frame's keys and values among
    # its ranks only (point to point: one batch forward; backward, the k - 1 other blocks
    # fetched one a step and each block's gradients home a step later: k + 1 batches, 2 for
    # k = 2); the same batch unsplit exchanges none.
    assert issued.count(("forward", "all_to_all")) == 2
    assert issued.count(("backward", "all_to_all")) == 2  # + pixel gradients
    assert issued.count(("forward", "p2p")) == full_layers
    # + the pixels rank 0 sends its frame's other bands again (released after the forward:
    # ``runtime.transport.refetch``), one batch
    assert issued.count(("backward", "p2p")) == {2: 2, 4: 5}[world] * full_layers + 1
    assert whole.count(("forward", "all_to_all")) <= 2 and ("forward", "p2p") not in whole


def _paths(rank: int, world: int) -> dict:
    """In place, planned ahead, through the FX pass and the same graph compiled (the vitbal
    backend over aot_eager, graph breaks at the ops) on the reference VLM, then replica sets
    (2 x 2) on the bare ViT, eagerly and compiled with ``fullgraph=True``: each against the
    unsplit run."""
    grids = GRIDS[4][rank]

    def model():
        torch.manual_seed(0)
        vit = ViTConfig(deepstack_indexes=(0,), depth=3, **WINDOWS)
        return OmniEncoderModel(vit, LMConfig(num_layers=1))

    want = train_step(model(), grids, rank)
    stats = []
    handle = fx_vitbal.add_stats_callback(stats.append)
    results = {}
    in_place = fx_vitbal.enable_vit_balance(model(), config=CONFIG)
    results["in_place"] = (train_step(in_place, grids, rank), stats[-1].split_units)
    planned_model = fx_vitbal.enable_vit_balance(model(), config=CONFIG)
    _, pixels, grid = make_inputs(grids, in_dim=24, seed=rank)
    group = dist.new_group(backend="gloo")
    planned = fx_vitbal.plan_ahead(planned_model, pixels.to("meta"), grid, group=group)
    fx_vitbal.use_plan(planned_model, planned)
    with record_collectives() as issued:
        step = train_step(planned_model, grids, rank)
    gathers = sum(name == "all_gather" for _, name, _, _ in issued)
    results["ahead"] = (step, planned.plan.applied and stats[-1].split_units, gathers)
    gm = apply_vit_balance_pass(symbolic_trace(model()), config=CONFIG)
    results["fx"] = (train_step(gm, grids, rank), stats[-1].split_units)
    # The same graph compiled through the vitbal backend (graph breaks at the ops): its ViT
    # takes the tensor form of Bands.
    compiled = apply_vit_balance_pass(symbolic_trace(model()), config=CONFIG)
    compiled = torch.compile(compiled, backend="vitbal", options={"inner": "aot_eager"})
    results["compiled"] = (train_step(compiled, grids, rank), stats[-1].split_units)
    # Replica sets: ranks 0 and 1 hold the big frame, 2 and 3 a small batch.
    sets = [[0, 1], [2, 3]]
    vit = _vit(windows=False)
    _, pixels, grid = make_inputs(GRIDS[2][rank // 2], in_dim=24, seed=rank // 2)

    def balanced(pixels, grid):
        return fx_vitbal.dp_balance_vit_encoder(
            vit, pixels, grid, config=CONFIG, replica_group=sets[rank // 2]
        )[0]

    want_embeds = vit(pixels, grid)[0]
    results["replicas"] = (balanced(pixels, grid), want_embeds)
    compiled = torch.compile(balanced, backend="aot_eager", fullgraph=True)
    with fullgraph_capture():
        embeds = compiled(pixels, grid)
    results["replicas_compiled"] = (embeds, want_embeds, stats[-1].split_units)
    handle.remove()
    return {"want": want, **results}


def test_in_place_planned_ahead_fx_compiled_and_replica_sets_split_exactly():
    results = run_ranks(_paths, 4)
    for rank, res in enumerate(results):
        want_logits, want_grads = res["want"]
        for path in ("in_place", "ahead", "fx", "compiled"):
            (logits, grads), *split = res[path]
            for got, want in ((logits, want_logits), (grads, want_grads)):
                error = (got - want).abs().max() / want.abs().max()
                assert error <= 1e-5, (rank, path, float(error))
        assert res["in_place"][1] == 4 and res["ahead"][1] == 4 and res["ahead"][2] <= 1
        assert res["fx"][1] == 4 and res["compiled"][1] == 4
        embeds, want = res["replicas"]
        assert (embeds - want).abs().max() <= 1e-5 * want.abs().max()
        embeds, want, split = res["replicas_compiled"]  # fullgraph: the tensor form
        assert (embeds - want).abs().max() <= 1e-5 * want.abs().max() and split == 4


# A step that splits the big frame, then one that splits nothing.
COMPILED_STEPS = [GRIDS[2], [[[1, 8, 8]], [[1, 4, 4], [1, 8, 4]]]]


def _compiled(rank: int, world: int) -> dict:
    """The reference VLM through ``backend="vitbal"`` with ``fullgraph=True``: steps with and
    without a split frame against the unsplit run, and the collectives of each step against the
    same compiled model with ``split_images=False``. ``ring`` forced: the tensor form runs it
    (``vitbal::band_attention``)."""

    def model():
        torch.manual_seed(0)
        return OmniEncoderModel(ViTConfig(deepstack_indexes=(0,), depth=3), LMConfig(num_layers=1))

    want = [train_step(model(), step[rank], rank) for step in COMPILED_STEPS]
    stats = []
    handle = fx_vitbal.add_stats_callback(stats.append)
    options = {"inner": "aot_eager"}
    results = {}
    for name, config in (
        ("split", dataclasses.replace(CONFIG, band_exchange="ring")),
        ("whole", dataclasses.replace(CONFIG, split_images=False)),
    ):
        run = fx_vitbal.enable_vit_balance(model(), config=config)
        run = torch.compile(run, backend="vitbal", fullgraph=True, options=options)
        torch._dynamo.utils.counters.clear()
        steps = []
        for step in COMPILED_STEPS:
            with fullgraph_capture(), record_collectives() as issued:
                got = train_step(run, step[rank], rank, unbacked=UNBACKED_BATCH_SIZES)
            issued = [(p, n) for p, n, _, _ in issued]
            steps.append((got, stats[-1].split_units, issued, stats[-1].band_exchanges))
        results[name] = (steps, torch._dynamo.utils.counters["stats"]["unique_graphs"])
    # A tower that runs bands only as Python: compiled, its plan keeps frames whole.
    torch.manual_seed(0)
    vit = _EagerBandsViT(ViTConfig(deepstack_indexes=(0,), depth=3))
    _, pixels, grid = make_inputs(GRIDS[2][rank], in_dim=24, seed=rank)

    def balanced(pixels, grid):
        return fx_vitbal.dp_balance_vit_encoder(vit, pixels, grid, config=CONFIG)[0]

    splits = []
    for call in (balanced, torch.compile(balanced, backend="aot_eager", fullgraph=True)):
        with fullgraph_capture():
            embeds = call(pixels, grid)
        splits.append(stats[-1].split_units)
    results["eager_bands_only"] = (embeds, vit(pixels, grid)[0], splits)
    handle.remove()
    return {"want": want, **results}


class _EagerBandsViT(QwenStyleViT):
    """The reference tower declared to run bands as Python only (``compiled=False``)."""


_SPEC = vision_encoder_spec(QwenStyleViT(ViTConfig()))
fx_vitbal.register_vision_encoder(
    _EagerBandsViT,
    frame_independent=True,
    cost_model=_SPEC.cost_model,
    bands=dataclasses.replace(_SPEC.bands, compiled=False),
)


def test_compiled_fullgraph_steps_split_exactly_and_a_step_without_a_split_keeps_collectives():
    """The reference tower (the tensor form of bands) compiled with ``fullgraph=True``; a tower
    that runs bands only as Python splits eagerly and keeps frames whole compiled."""
    results = run_ranks(_compiled, 2)
    for rank, res in enumerate(results):
        steps, graphs = res["split"]
        for (got, *_), want in zip(steps, res["want"], strict=True):
            for g, w in zip(got, want, strict=True):
                assert (g - w).abs().max() <= 1e-5 * w.abs().max(), rank
        assert [split for _, split, *_ in steps] == [2, 0]
        assert [exchanges for *_, exchanges in steps] == [("ring",), ()]
        if UNBACKED_BATCH_SIZES:  # one graph serves the split step and the other
            assert graphs == 1, graphs
        split_step, other_step = (issued for _, _, issued, _ in steps)
        assert other_step == res["whole"][0][1][2]  # no split: the collectives of whole frames
        # Split: pixels out and outputs home, and the ring of each full-attention layer among
        # the frame's ranks (3 layers, point to point: one block passed); backward, the
        # outputs' gradients out (the pixels need none) and the ring's two phases a layer (the
        # block again, then its dK/dV accumulator home), as eagerly.
        assert split_step.count(("forward", "all_to_all")) == 2, split_step
        assert split_step.count(("forward", "p2p")) == 3, split_step
        assert split_step.count(("backward", "all_to_all")) == 1, split_step
        assert split_step.count(("backward", "p2p")) == 6, split_step
    assert results[0]["split"][0][0][2] == results[1]["split"][0][0][2]  # lockstep
    for res in results:  # eagerly split, compiled whole: exact both ways
        embeds, want, splits = res["eager_bands_only"]
        assert splits == [2, 0] and (embeds - want).abs().max() <= 1e-5 * want.abs().max()


def _bf16(rank: int, world: int) -> dict:
    """The same step in bf16, split and unsplit, each against the fp32 unsplit run."""
    fp32 = _vit(windows=True)
    bf16 = _vit(windows=True, dtype=torch.bfloat16)
    _, pixels, grid = make_inputs(GRIDS[2][rank], in_dim=24, seed=rank)
    want = fp32(pixels, grid)[0]
    errors = {}
    for split in (False, True):
        config = dataclasses.replace(CONFIG, split_images=split, trigger_threshold=0.0)
        embeds, _, _ = fx_vitbal.dp_balance_vit_encoder(
            bf16, pixels.bfloat16(), grid, config=config
        )
        errors[split] = float((embeds.float() - want).abs().max() / want.abs().max())
    return errors


def test_bands_in_bf16_stay_within_the_unsplit_runs_own_noise():
    for errors in run_ranks(_bf16, 2):
        assert errors[True] <= 2 * errors[False] + 1e-3, errors


def test_a_measured_exchange_prices_bands_out_when_it_is_slow():
    """With costs in seconds (``cost_model="online"``), the fitted exchange model prices a band:
    a fast interconnect splits the frame that binds the step, a slow one keeps it whole."""
    grids = [[[1, 128, 128]], [[1, 16, 16]]]
    config = fx_vitbal.BalanceConfig(min_band_patches=1024)
    spec = planner_spec_for(config, _ARCH, True, (2, 32, 1280, False, 16))

    def plan_with(latency, seconds_per_byte):
        settings = plan_settings(
            spec,
            cost_model=_Seconds(_ARCH),
            exchange_latency=latency,
            exchange_seconds_per_byte=seconds_per_byte,
        )
        units_R = plan_step(grids, settings).units_R
        return sum(is_band(u) for units in units_R for u in units)

    assert plan_with(11e-6, 1 / 350e9) == 2  # NVLink: two bands
    assert plan_with(1e-3, 1 / 1e9) == 0  # 1 GB/s and a millisecond a collective: whole


class _Seconds:
    """An architecture model in seconds: forward MACs at 2e14 a second, three for training."""

    def __init__(self, macs: ArchitectureCost) -> None:
        self.macs = macs

    def __call__(self, t: int, h: int, w: int) -> float:
        return 3 * self.macs(t, h, w) / 2e14


def test_the_collectives_latency_alone_keeps_a_frame_whole_when_it_outweighs_the_saving():
    """Bytes priced at nothing: every rank still pays each exchanging layer's collectives
    (forward and backward) their latency, and a split saving less than that keeps the frame
    whole; without latency it splits."""
    grids = [[[1, 128, 128]], [[1, 16, 16]]]
    config = fx_vitbal.BalanceConfig(min_band_patches=1024)
    spec = planner_spec_for(config, _ARCH, True, (2, 32, 1280, False, 16))
    rule, cost = band_rule_of(spec), _Seconds(_ARCH)

    def plan_with(latency):
        settings = plan_settings(  # bytes cost ~nothing
            spec, cost_model=cost, exchange_latency=latency, exchange_seconds_per_byte=1e-30
        )
        planned = plan_step(grids, settings)
        plan, units_R = planned.plan, planned.units_R
        return plan, sum(is_band(u) for units in units_R for u in units)

    def span(plan):
        return max(plan.loads_after if plan.applied else plan.loads_before)

    split, bands = plan_with(0.0)
    whole, no_bands = plan_with(1.0)
    assert (bands, no_bands) == (2, 0)
    # The latency at which the split stops beating the whole plan by the minimum gain.
    even = (span(whole) * (1 - config.min_gain) - span(split)) / (2 * rule.exchange_layers)
    assert even > 0
    assert plan_with(0.9 * even)[1] == 2
    assert plan_with(1.1 * even)[1] == 0


# 36 patch rows: whole merge blocks (2 rows) and windows (4 rows), but half of it (18) is not a
# window's multiple: its bands split at row 20, where whole windows end.
WINDOW_GRIDS = [[[1, 36, 32]], [[1, 4, 4], [1, 8, 4]]]


def _windows_off_center(rank: int, world: int) -> dict:
    vit = _vit(windows=True)
    _, pixels, grid = make_inputs(WINDOW_GRIDS[rank], in_dim=24, seed=rank)
    pixels.requires_grad_(True)
    want = _grads(vit, pixels, grid, balanced=False)
    stats, printed = [], io.StringIO()
    handle = fx_vitbal.add_stats_callback(stats.append)
    verbose = dataclasses.replace(CONFIG, verbose=True)
    with (
        record_collectives() as issued,
        record_moves() as moves,
        contextlib.redirect_stdout(printed),
    ):
        got = _grads(vit, pixels, grid, balanced=True, config=verbose)
    handle.remove()
    return {
        "got": got,
        "want": want,
        "issued": [(phase, name) for phase, name, _, _ in issued],
        "moves": moves,
        "split_units": stats[-1].split_units,
        "printed": printed.getvalue(),
    }


def test_windowed_bands_split_at_whole_windows_where_halving_the_frame_would_cut_one():
    """Bands of a windowed tower start at whole windows (its ``align_rows``), not merge rows:
    a band starting inside a window would attend over another window than the unsplit run."""
    _check(run_ranks(_windows_off_center, 2), split_units=2)


# --- the exchange ops on a hand-built layout

# One frame of 6 x 4 patches owned by rank 0, as three bands of 2 rows, and the rank computing
# each band: with 2 ranks, rank 0 computes two of them (the planner never plans that, the ops
# allow it); with 1 rank, all three.
BAND_FRAME = [Band(1, 2, 4, 6, first) for first in (0, 2, 4)]
BAND_PLACEMENT = {1: [0, 0, 0], 2: [0, 0, 1]}


def _band_ops(rank: int, world: int) -> dict:
    """``vitbal::band_gather`` and its backward ``vitbal::band_scatter`` on every rank's layout
    from ``band_layout``, against autograd of the same rows gathered by slicing (``torch.cat``):
    each band attends over its whole frame, so each local unit gets the frame's rows."""
    placement = BAND_PLACEMENT[world]
    units_O = [BAND_FRAME] + [[] for _ in range(world - 1)]

    def computed_by(owner, index):
        return placement[index]

    # Every rank's local rows (its bands', in order), made alike on every rank for the reference.
    rows_R = [8 * placement.count(r) for r in range(world)]
    xs_R = [
        torch.randn(n, 3, 2, generator=torch.Generator().manual_seed(r), requires_grad=True)
        for r, n in enumerate(rows_R)
    ]
    frame = torch.cat(  # the frame's rows, band by band, from the rank computing each band
        [
            xs_R[p][8 * placement[:i].count(p) : 8 * placement[:i].count(p) + 8]
            for i, p in enumerate(placement)
        ]
    )
    wants = [torch.cat([frame] * placement.count(r)) for r in range(world)]
    weights = [torch.linspace(-1, 2, w.numel()).view_as(w) + r for r, w in enumerate(wants)]
    loss = sum((w * c).sum() for w, c in zip(wants, weights, strict=True))
    want_grad = torch.autograd.grad(loss, xs_R[rank])[0]
    x = xs_R[rank].detach().clone().requires_grad_(True)
    arrivals = [(0, i) for i, p in enumerate(placement) if p == rank]
    planned = types.SimpleNamespace(  # the planning step's part band_layout reads
        units_O=units_O,
        rows_O=[[8] * len(BAND_FRAME)] + [[] for _ in range(world - 1)],
        frames={(0, 0): list(range(len(BAND_FRAME)))},
        computed_by=computed_by,
    )
    layout = band_layout(planned, arrivals, rank, world, 2)[1]
    got = torch.ops.vitbal.band_gather(x, layout.to_tensor(), dist.group.WORLD.group_name)
    (got_grad,) = torch.autograd.grad((got * weights[rank]).sum(), x)
    return {
        "got": got.detach(),
        "want": wants[rank].detach(),
        "grad": (got_grad, want_grad),
        "local_twice": sum(s == LOCAL for s, _, _ in layout.pieces) >= 2,
    }


@pytest.mark.parametrize("world", [1, 2])
def test_band_scatter_sums_the_gradients_of_local_rows_gathered_twice(world):
    """Two bands of one frame on one rank: each gathers the frame, so its local rows appear in
    two pieces and their gradients must add up (with rows that arrived from another rank)."""
    results = run_ranks(_band_ops, world)
    for rank, res in enumerate(results):
        if rank == 0:
            assert res["local_twice"], "the layout should hold rank 0's rows twice"
        torch.testing.assert_close(res["got"], res["want"], rtol=0, atol=0)
        torch.testing.assert_close(
            *res["grad"], rtol=1e-6, atol=1e-6, msg=lambda m, r=rank: f"rank {r}: {m}"
        )
