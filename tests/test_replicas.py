"""Replica sets (``replica_group``): ranks holding the same batch compute each unit once in the
whole group, and every path gives each replica the replicated run's outputs and the group the
replicated run's gradients.

Each replica's loss reads a different slice of the outputs (as under context parallelism), so a
gradient that is not summed over the set's ranks, or summed on the wrong rank, fails. Worlds: 4
ranks (2 sets x 2, contiguous and interleaved) and 6 ranks (3 x 2 with a text-only set, 2 x 3
interleaved).
"""

import pytest
import torch
import torch.distributed as dist
from dist_utils import (
    UNBACKED_BATCH_SIZES,
    fullgraph_capture,
    record_collectives,
    record_moves,
    run_ranks,
)
from test_autograd import _check, _entries, _vit_forward
from test_backend import _RegionModel

import fx_vitbal
from fx_vitbal import _compat
from fx_vitbal.passes import apply_vit_balance_pass, symbolic_trace
from fx_vitbal.plan.step import StepPlan, describe_plan
from fx_vitbal.tools.models import QwenStyleViT, ViTConfig
from fx_vitbal.tools.omni import LMConfig, OmniEncoderModel, make_inputs

# Each set's batch, step by step (every replica of a set holds it); sets without images too.
SET_STEPS = [
    [[[1, 16, 12], [2, 4, 6], [1, 4, 4]], [[1, 2, 2]], [[1, 8, 8], [1, 4, 8]]],
    [[[1, 4, 4]], [[1, 12, 8], [1, 2, 4], [2, 2, 2]], []],
]
WORLDS = {
    "2x2": [[0, 1], [2, 3]],
    "2x2 interleaved": [[0, 2], [1, 3]],
    "3x2 with a text-only set": [[0, 1], [2, 3], [4, 5]],
    "2x3 interleaved": [[0, 2, 4], [1, 3, 5]],
}
# Always plan (no trigger, no minimum gain), so even small batches move units between sets.
CONFIG = fx_vitbal.BalanceConfig(trigger_threshold=0.0, min_gain=0.0)


def _place(rank: int, sets) -> tuple[int, list[int], int]:
    """``(set index, the set's ranks, this rank's position in it)``."""
    s = next(i for i, ranks in enumerate(sets) if rank in ranks)
    return s, sets[s], sets[s].index(rank)


def _set_grids(step: int, s: int) -> list[list[int]]:
    return SET_STEPS[step][s] if s < len(SET_STEPS[step]) else []


def _slice_weight(rows: int, k: int, r: int, dtype) -> torch.Tensor:
    """Replica ``k`` of ``r`` reads rows ``k/r`` to ``(k+1)/r`` of an output, position-weighted."""
    w = torch.zeros(rows, 1, dtype=dtype)
    w[k * rows // r : (k + 1) * rows // r] = 1.0
    return w * torch.linspace(-1, 2, rows, dtype=dtype).view(rows, 1)


def _model() -> OmniEncoderModel:
    torch.manual_seed(0)  # the same weights on every rank
    return OmniEncoderModel(ViTConfig(deepstack_indexes=(0,)), LMConfig(num_layers=1)).double()


def _vit_step(vit, balanced, pixels, grid, k, r, replicas, config=CONFIG):
    """One ViT step on a set's batch: outputs, the group's parameter gradients and this rank's
    pixel gradient (``torch.autograd.grad``)."""
    pixels = pixels.clone().requires_grad_(True)
    # A set without images passes None, as a text-only rank may.
    none = balanced and not pixels.shape[0]
    if balanced:
        call = fx_vitbal.dp_balance_vit_encoder
        given = None if none else pixels
        embeds, _, deep = call(vit, given, grid, config=config, replica_group=replicas)
    else:
        embeds, _, deep = vit(pixels, grid)
    loss = (embeds * _slice_weight(embeds.shape[0], k, r, embeds.dtype)).sum()
    loss = loss + (deep[0] * _slice_weight(deep[0].shape[0], k, r, embeds.dtype)).sum()
    params = list(vit.parameters())
    if none:  # .backward(): it reaches the stand-in pixels whose gradients the others want
        loss.backward()
        grads = (*[p.grad for p in params], torch.zeros_like(pixels))
        vit.zero_grad(set_to_none=True)
    else:
        grads = torch.autograd.grad(loss, [*params, pixels], allow_unused=True)
    flat = torch.cat([g.flatten() if g is not None else p.new_zeros(p.numel())
                      for g, p in zip(grads[:-1], params, strict=True)])  # fmt: skip
    dist.all_reduce(flat)
    return embeds.detach(), deep[0].detach(), flat, grads[-1]


def _computed_rows(vit) -> list[int]:
    """Records the pixel rows each call of ``vit`` computes."""
    rows = []
    vit.register_forward_pre_hook(lambda _, args: rows.append(args[0].shape[0]))
    return rows


def _eager(rank: int, world: int, sets, config=CONFIG, steps=2) -> dict:
    s, replicas, k = _place(rank, sets)
    torch.manual_seed(0)
    vit = QwenStyleViT(ViTConfig(deepstack_indexes=(0,))).double()
    computed = _computed_rows(vit)
    results = []
    for step in range(steps):
        grids = _set_grids(step % len(SET_STEPS), s)
        _, pixels, grid = make_inputs(grids, in_dim=24, seed=s, dtype=torch.float64)
        want = _vit_step(vit, False, pixels, grid, k, len(replicas), replicas)
        del computed[:]
        stats = []
        handle = fx_vitbal.add_stats_callback(stats.append)
        with record_moves() as moves, record_collectives() as issued:
            got = _vit_step(vit, True, pixels, grid, k, len(replicas), replicas, config)
        handle.remove()
        # Pixel gradients: one replica per unit gets it; summed over the set, the replicated
        # run's (each replica's own gradient, summed).
        pixel_grads = [None] * world
        dist.all_gather_object(pixel_grads, (got[3], want[3]))
        summed = [sum(pixel_grads[r][i] for r in replicas) for i in (0, 1)]
        results.append(
            {
                "got": got[:3],
                "want": want[:3],
                "pixel_grads": summed,
                "rows": sum(int(g.prod(1).sum()) for g in [grid]),
                "computed": list(computed),
                "moves": moves,
                "issued": issued,
                "reported": (stats[-1].total_rows, stats[-1].deduplicated_rows),
            }
        )
    return results


@pytest.mark.parametrize("name", list(WORLDS))
def test_each_unit_is_computed_once_and_every_replica_gets_the_replicated_outputs(name):
    _check_eager(WORLDS[name], run_ranks(_eager, sum(map(len, WORLDS[name])), WORLDS[name]))


# Every planner setting over replica sets stays exact: min-move (above), LPT, node-aware
# planning, an explicit row cap, online costs (fitted from measured times over several steps).
QUALITIES = {
    "lpt": fx_vitbal.BalanceConfig(strategy="lpt"),
    "node-aware": fx_vitbal.BalanceConfig(ranks_per_node=2, trigger_threshold=0.0, min_gain=0.0),
    "row cap": fx_vitbal.BalanceConfig(max_len_ratio=1.0, trigger_threshold=0.0, min_gain=0.0),
    "online": fx_vitbal.BalanceConfig(cost_model="online", trigger_threshold=0.0, min_gain=0.0),
}


@pytest.mark.parametrize("quality", list(QUALITIES))
def test_every_planner_setting_stays_exact_with_replica_sets(quality):
    sets = WORLDS["2x2 interleaved"]
    steps = 6 if quality == "online" else 2
    _check_eager(sets, run_ranks(_eager, 4, sets, QUALITIES[quality], steps))


def _check_eager(sets, results) -> None:
    world = sum(map(len, sets))
    for step in range(len(results[0])):
        per_rank = [res[step] for res in results]
        for rank, res in enumerate(per_rank):
            for got, want in zip(res["got"], res["want"], strict=True):
                torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9, msg=f"rank {rank}")
            torch.testing.assert_close(*res["pixel_grads"], rtol=1e-9, atol=1e-9)
        # Each unit once: the group computes each set's rows once (plus a 4-row dummy unit on
        # a rank that computes nothing), where the replicated run computes them r times.
        once = sum(per_rank[ranks[0]]["rows"] for ranks in sets)
        computed = sum(sum(res["computed"]) for res in per_rank)
        assert once <= computed <= once + 4 * world, (once, computed)
        # Reported: each set's rows once, and the rows its other replicas no longer compute.
        twice = sum((len(ranks) - 1) * per_rank[ranks[0]]["rows"] for ranks in sets)
        assert {res["reported"] for res in per_rank} == {(once, twice)}
        # Lockstep: every rank issued the same collectives, and units left their ranks.
        kinds = {tuple((p, n) for p, n, _, _ in res["issued"]) for res in per_rank}
        assert len(kinds) == 1, kinds
        assert any(sum(res["moves"]) for res in per_rank)


def _model_step(run, model, grids, s, k, r, unbacked=False):
    """One training step of a set's batch through ``run``: this replica's logits and the group's
    all-reduced gradients, the loss reading this replica's slice of the sequence."""
    input_ids, pixels, grid = make_inputs(grids, in_dim=24, seed=s, dtype=torch.float64)
    if unbacked:
        torch._dynamo.decorators.mark_unbacked(pixels, 0)
        torch._dynamo.decorators.mark_unbacked(grid, 0)
        torch._dynamo.mark_dynamic(input_ids, 0)
    logits = run(input_ids, pixels, grid)
    (logits * _slice_weight(logits.shape[0], k, r, logits.dtype)).sum().backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    dist.all_reduce(grads)
    model.zero_grad(set_to_none=True)
    return logits.detach(), grads


def _paths(rank: int, world: int, sets, paths) -> dict:
    s, replicas, k = _place(rank, sets)
    r = len(replicas)
    reference = _model()
    want = [_model_step(reference, reference, _set_grids(i, s), s, k, r) for i in range(2)]
    results = {}
    for path in paths:
        model = _model()
        if path == "region":  # a ViT region the backend rewrites, the sets in its options
            torch.manual_seed(0)
            model = _RegionModel(ViTConfig(deepstack_indexes=(0,)), LMConfig(num_layers=1))
            model = model.double()
            _compat.keep_nested_compile_regions()
            options = {"inner": "aot_eager", "vit": model.visual, "replica_group": replicas}
            run = torch.compile(model, backend="vitbal", fullgraph=True, options=options)
        elif path == "fx":
            run = apply_vit_balance_pass(
                symbolic_trace(model), config=CONFIG, replica_group=replicas
            )
        else:
            fx_vitbal.enable_vit_balance(model, config=CONFIG, replica_group=replicas)
            run = model
        if path == "compiled":  # fullgraph, one graph for every image count where torch can
            run = torch.compile(
                model, backend="vitbal", fullgraph=True, options={"inner": "aot_eager"}
            )
        got, forward_collectives = [], []
        for i in range(2):
            grids = _set_grids(i, s)
            if path == "ahead":
                _, pixels, grid = make_inputs(grids, in_dim=24, seed=s, dtype=torch.float64)
                planned = fx_vitbal.plan_ahead(
                    model,
                    pixels,
                    grid,
                    group=dist.group.WORLD,
                    config=CONFIG,
                    replica_group=replicas,
                )
                fx_vitbal.use_plan(model, planned)
            compiled = path in ("compiled", "region")
            # A ViT region is traced with unbacked sizes on every torch (test_backend's rule).
            unbacked = path == "region" or (compiled and UNBACKED_BATCH_SIZES)
            with record_collectives() as issued, fullgraph_capture(compiled):
                got.append(_model_step(run, model, grids, s, k, r, unbacked))
            forward_collectives.append([n for p, n, _, _ in issued if p == "forward"])
        results[path] = {"got": got, "forward": forward_collectives}
    return {"want": want, "paths": results}


@pytest.mark.parametrize("name", ["2x2", "3x2 with a text-only set"])
def test_in_place_fx_compiled_and_planned_ahead_match_the_replicated_run(name):
    sets = WORLDS[name]
    # Compiled graphs on 4 ranks (6 processes compiling on 2 cores cost a minute).
    paths = ("in_place", "fx", "ahead") + (("compiled", "region") if name == "2x2" else ())
    results = run_ranks(_paths, sum(map(len, sets)), sets, paths)
    for rank, res in enumerate(results):
        for path, outcome in res["paths"].items():
            for (logits, grads), (want_logits, want_grads) in zip(
                outcome["got"], res["want"], strict=True
            ):
                msg = f"{path} rank {rank}"
                torch.testing.assert_close(logits, want_logits, rtol=1e-9, atol=1e-9, msg=msg)
                torch.testing.assert_close(grads, want_grads, rtol=1e-9, atol=1e-9, msg=msg)
        # Planned in the step: the metadata gather, then the two exchanges (a new ViT's first
        # call also agrees its output layouts in a gather); planned ahead: no gather at all.
        first, steady = res["paths"]["in_place"]["forward"]
        assert first == ["all_gather", "all_to_all", "all_gather", "all_to_all"], first
        assert steady == ["all_gather", "all_to_all", "all_to_all"], steady
        assert res["paths"]["ahead"]["forward"][1] == ["all_to_all", "all_to_all"]


BAD_SETS = {
    "grids differ": ([[0, 1], [0, 1], [2, 3], [2, 3]], "image_grid_thw of rank(s) [1]"),
    "pixels differ": ([[0, 1], [0, 1], [2, 3], [2, 3]], "pixel_values of rank(s) [3] differ"),
    # The same values, two rows of different images swapped: only the row weighting sees it.
    "rows swapped": ([[0, 1], [0, 1], [2, 3], [2, 3]], "pixel_values of rank(s) [3] differ"),
    "overlap": ([[0, 1], [1, 2], [1, 2], [3, 0]], "do not partition the group"),
    # Sets that partition the group but for their sizes: the size rule alone refuses them, and
    # its message lists every rank's (no other rule's does).
    "sizes differ": ([[0, 1], [0, 1], [2], [3]], "rank 0: 2, rank 1: 2, rank 2: 1, rank 3: 1"),
    "some pass None": ([[0, 1], [0, 1], None, None], "must all have the same size"),
    "not its own set": ([[1, 2], [1, 2], [1, 2], [3]], "rank 0: its replica_group does not hold"),
    "outside the group": ([[0, 5], [1, 2], [1, 2], [3]], "rank 0: its replica_group does not hold"),
}


def _pixels(s: int, dtype=torch.float64, grids=((1, 4, 4), (1, 8, 4))) -> tuple:
    """Set ``s``'s batch, with a zero in every row (so the sign of zero can differ)."""
    _, pixels, grid = make_inputs([list(g) for g in grids], in_dim=24, seed=s, dtype=dtype)
    pixels[:, 0] = 0.0
    return pixels, grid


def _bad_then_good(rank: int, world: int) -> dict:
    """Every case of ``BAD_SETS`` in turn, each followed by a good step with the sets as
    process groups, whose rank 3 holds its set's pixels with every zero negated (``-0.0``:
    equal in value, so the replicas agree)."""
    torch.manual_seed(0)
    vit = QwenStyleViT(ViTConfig()).double()
    s = rank // 2
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    results = {}
    for case, (declared, _) in BAD_SETS.items():
        grids = ((1, 4, 4),) if case == "grids differ" and rank == 1 else ((1, 4, 4), (1, 8, 4))
        pixels, grid = _pixels(s + (case == "pixels differ" and rank == 3), grids=grids)
        if case == "rows swapped" and rank == 3:  # a row of each image, swapped
            pixels[[0, 16]] = pixels[[16, 0]]
        error = None
        try:
            fx_vitbal.dp_balance_vit_encoder(vit, pixels, grid, replica_group=declared[rank])
        except ValueError as e:
            error = str(e)
        pixels, grid = _pixels(s)
        if rank == 3:
            pixels[:, 0] = -0.0
        embeds, _, _ = fx_vitbal.dp_balance_vit_encoder(vit, pixels, grid, replica_group=groups[s])
        want, _, _ = vit(pixels, grid)
        results[case] = {"error": error, "good": torch.allclose(embeds, want, rtol=1e-9, atol=0)}
    return results


@pytest.fixture(scope="module")
def bad_then_good() -> list[dict]:
    return run_ranks(_bad_then_good, 4)


@pytest.mark.parametrize("case", list(BAD_SETS))
def test_replicas_that_disagree_or_sets_that_do_not_partition_raise_on_every_rank(
    case, bad_then_good
):
    results = [res[case] for res in bad_then_good]
    errors = {res["error"] for res in results}
    assert len(errors) == 1 and None not in errors, errors  # the same ValueError everywhere
    assert BAD_SETS[case][1] in errors.pop()
    assert all(res["good"] for res in results)  # and -0.0 agreed with 0.0


def _sliced(forward, k: int, r: int):
    """``forward``'s output, of which replica ``k`` of ``r`` keeps its slice of rows."""

    def sliced():
        out = forward()
        rows = out.shape[-2]
        keep = torch.zeros(rows, 1, dtype=out.dtype)
        keep[k * rows // r : (k + 1) * rows // r] = 1.0
        return out * keep

    return sliced


def _vit_entries(rank: int, world: int, sets) -> dict:
    s, replicas, k = _place(rank, sets)
    _, pixels, grid = make_inputs(_set_grids(0, s), in_dim=24, seed=s, dtype=torch.float64)
    reference, model = _model().visual, _model().visual

    def balanced():
        call = fx_vitbal.dp_balance_vit_encoder
        embeds, _, deep = call(model, pixels, grid, config=CONFIG, replica_group=replicas)
        return torch.cat([embeds.unflatten(0, (-1, 4)).flatten(1), deep[0]], 1)

    want = _sliced(_vit_forward(reference, False, pixels, grid), k, len(replicas))
    got = _sliced(balanced, k, len(replicas))
    return _entries(want, dict(reference.named_parameters()), got, dict(model.named_parameters()))


def _hf_entries(rank: int, world: int, sets) -> dict:
    from test_hf import _pixel_width, build_parent, make_batch

    s, replicas, k = _place(rank, sets)
    reference, model = build_parent("qwen2_vl").double(), build_parent("qwen2_vl").double()
    fx_vitbal.enable_vit_balance(model, config=CONFIG, replica_group=replicas)
    # test_hf's first step, one sample per set: set 0 has images and a video, set 1 an image.
    batch = make_batch("qwen2_vl", s, 0, _pixel_width(model.get_encoder(modality="image")))
    batch = {
        key: v.double() if torch.is_tensor(v) and v.is_floating_point() else v
        for key, v in batch.items()
        if key not in ("labels", "output_hidden_states")
    }

    def forward(vlm):
        return _sliced(lambda: vlm(**batch).logits, k, len(replicas))

    params = dict(model.named_parameters())
    return _entries(forward(reference), dict(reference.named_parameters()), forward(model), params)


def test_every_autograd_entry_point_matches_the_replicated_run():
    _check(run_ranks(_vit_entries, 4, WORLDS["2x2 interleaved"]))


def test_a_hugging_face_vlm_with_replicas_matches_the_replicated_run():
    pytest.importorskip("transformers")
    _check(run_ranks(_hf_entries, 4, WORLDS["2x2"]))


def _planned_with_other_sets(rank: int, world: int) -> dict:
    s, replicas, k = _place(rank, WORLDS["2x2"])
    model = fx_vitbal.enable_vit_balance(_model(), config=CONFIG)  # the step names no sets
    grids = _set_grids(0, s)
    _, pixels, grid = make_inputs(grids, in_dim=24, seed=s, dtype=torch.float64)
    planned = fx_vitbal.plan_ahead(
        model, pixels, grid, group=dist.group.WORLD, config=CONFIG, replica_group=replicas
    )
    fx_vitbal.use_plan(model, planned)
    error = None
    try:
        _model_step(model, model, grids, s, k, len(replicas))
    except ValueError as e:
        error = str(e)
    model.zero_grad(set_to_none=True)
    # Still in lockstep: the next step plans in the step.
    reference = _model()
    want = _model_step(reference, reference, grids, s, k, len(replicas))
    return {
        "error": error,
        "next": _model_step(model, model, grids, s, k, len(replicas)),
        "want": want,
    }


def test_a_plan_made_ahead_for_other_replica_sets_raises_on_every_rank():
    results = run_ranks(_planned_with_other_sets, 4)
    errors = {res["error"] for res in results}
    assert len(errors) == 1 and None not in errors, errors
    assert "not the batch planned ahead" in errors.pop()
    for res in results:
        for got, want in zip(res["next"], res["want"], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def _hf_planned_ahead(rank: int, world: int) -> dict:
    from test_hf import _pixel_width, build_parent, make_batch

    s, replicas, k = _place(rank, WORLDS["2x2"])
    reference, model = build_parent("qwen2_vl"), build_parent("qwen2_vl")
    fx_vitbal.enable_vit_balance(model, config=CONFIG, replica_group=replicas)
    batch = make_batch("qwen2_vl", s, 0, _pixel_width(model.get_encoder(modality="image")))
    batch = {key: v for key, v in batch.items() if key not in ("labels", "output_hidden_states")}
    results = []
    for vlm in (reference, model):
        if vlm is model:  # the set's images and videos, planned as its one tower call sees them
            planned = fx_vitbal.plan_ahead(
                model,
                batch.get("pixel_values"),
                batch.get("image_grid_thw"),
                pixel_values_videos=batch.get("pixel_values_videos"),
                video_grid_thw=batch.get("video_grid_thw"),
                group=dist.group.WORLD,
                config=CONFIG,
                replica_group=replicas,
            )
            fx_vitbal.use_plan(model, planned)
        with record_collectives() as issued, record_moves() as moves:
            logits = _sliced(lambda vlm=vlm: vlm(**batch).logits, k, len(replicas))()
            logits.pow(2).sum().backward()
        grads = torch.cat([p.grad.flatten() for p in vlm.parameters() if p.grad is not None])
        dist.all_reduce(grads)
        forward = [n for p, n, _, _ in issued if p == "forward"]
        results.append((logits.detach(), grads, forward, moves))
    return results


def test_a_hugging_face_vlm_planned_ahead_with_replicas_matches_the_replicated_run():
    pytest.importorskip("transformers")
    for rank, ((want, want_grads, _, _), (got, grads, forward, _)) in enumerate(
        run_ranks(_hf_planned_ahead, 4)
    ):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=f"rank {rank}")
        torch.testing.assert_close(grads, want_grads, rtol=1e-4, atol=1e-5, msg=f"rank {rank}")
        assert forward[0] == "all_to_all", forward  # no metadata gather in the step


def test_the_verbose_line_names_the_rows_replica_sets_no_longer_compute_twice():
    # One set of two ranks holding one 16-row image: planned once, 16 rows not computed twice.
    plan = fx_vitbal.solve_plan([[4.0], []], [[16], []])
    planned = StepPlan(plan, [[(1, 4, 4)]], [[(1, 4, 4)], []], [(0, 1)], [[0], []], 16)
    line = describe_plan(planned, 7)
    assert line.startswith("[vit dp balance] step 7: ")
    assert line.endswith(", replica sets: 16 rows no longer computed twice")
