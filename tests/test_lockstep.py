"""Lockstep at every seam: eval mode, settings that differ between ranks, ranks passing None, ranks
and steps without images. Each test would hang or raise on one rank only without the guarantee
(gloo's collective timeout is 60 s, so a hang fails the test instead of stalling it)."""

import contextlib
import io

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
from fx_vitbal.tools.models import QwenStyleViT, ViTConfig
from fx_vitbal.tools.omni import LMConfig, OmniEncoderModel, make_inputs

SKEWED = [[[1, 16, 12], [2, 4, 6]], [[1, 2, 2]], []]
EMPTY_RANKS = [[[1, 16, 12], [2, 4, 6], [1, 2, 2]], [], []]  # rank 0 holds every image


def _model() -> OmniEncoderModel:
    torch.manual_seed(0)
    return OmniEncoderModel(ViTConfig(deepstack_indexes=(0,)), LMConfig(num_layers=1))


class _NoEmptyBatches(QwenStyleViT):
    """Like many real towers, it cannot take a batch without rows."""

    def forward(self, pixel_values, image_grid_thw):
        if not pixel_values.shape[0]:
            raise RuntimeError("empty batch")
        return super().forward(pixel_values, image_grid_thw)


def _compiled_with_bands(model, *inputs):
    """The model balanced in place with bands, compiled whole (the ViT's tensor form: its
    attention through ``vitbal::band_attention``, which finds no plan in eval mode)."""
    config = fx_vitbal.BalanceConfig(split_images=True, min_band_patches=64)
    balanced = fx_vitbal.enable_vit_balance(model, config=config)
    with fullgraph_capture():
        return torch.compile(balanced, backend="vitbal", fullgraph=True)(*inputs)


def _eval_on_rank_0_only(rank: int, world: int) -> tuple[int, bool]:
    paths = {
        "eager": lambda m, *a: fx_vitbal.dp_balance_vit_encoder(m.visual, *a[1:])[0],
        "in_place": lambda m, *a: fx_vitbal.enable_vit_balance(m)(*a),
        "fx": lambda m, *a: apply_vit_balance_pass(symbolic_trace(m))(*a),
        "compiled": _compiled_with_bands,
    }
    ran, same = 0, True
    if rank == 0:  # validation on one rank: any collective would wait for rank 1 forever
        inputs = make_inputs(SKEWED[0], in_dim=24)
        with torch.no_grad():
            want = _model().eval()(*inputs)
        for name, run in paths.items():
            model = _model().eval()
            with torch.no_grad():
                got = run(model, *inputs)
            if name == "compiled":  # the ViT's every frame whole, read from the unit table
                same = bool(torch.allclose(got, want, rtol=1e-5, atol=1e-6))
            ran += 1
    dist.barrier()
    return ran, same


def test_eval_mode_issues_no_collective_in_any_path():
    assert run_ranks(_eval_on_rank_0_only, 2) == [(4, True), (0, True)]


def _frozen_vit_always(rank: int, world: int) -> dict:
    config = fx_vitbal.BalanceConfig(when="always")
    reference = _model()
    reference.visual.eval().requires_grad_(False)  # LLaVA-style stage 2: a frozen ViT
    want = train_step(reference, SKEWED[rank], rank)
    model = _model()
    model.visual.eval().requires_grad_(False)
    fx_vitbal.enable_vit_balance(model, config=config)
    with record_moves() as moves:
        got = train_step(model, SKEWED[rank], rank)
    return {"got": got, "want": want, "moves": moves}


def test_a_frozen_vit_in_eval_mode_is_balanced_with_when_always():
    results = run_ranks(_frozen_vit_always, 3)
    for res in results:
        for got, want in zip(res["got"], res["want"], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert_units_moved(results)


def _settings_differ(rank: int, world: int) -> list[str]:
    vit = _model().visual
    _, pixels, grid = make_inputs(SKEWED[rank], in_dim=24, seed=rank)
    coeffs = (1.0, 2.0, 3.0) if rank != 2 else (1.0, 2.0, 4.0)
    config = fx_vitbal.BalanceConfig(cost_model="polynomial", cost_coeffs=coeffs)
    with pytest.raises(ValueError) as info:
        fx_vitbal.dp_balance_vit_encoder(vit, pixels, grid, config=config)
    fx_vitbal.dp_balance_vit_encoder(vit, pixels, grid)  # same settings again: a good step
    # Printing on rank 0 only shapes no plan: not a disagreement.
    printing = fx_vitbal.BalanceConfig(verbose=rank == 0)
    with contextlib.redirect_stdout(io.StringIO()):
        fx_vitbal.dp_balance_vit_encoder(vit, pixels, grid, config=printing)
    return [str(info.value)]


def test_ranks_with_different_settings_all_raise_the_same_error():
    messages = run_ranks(_settings_differ, 3)
    assert messages[0] == messages[1] == messages[2]
    text = messages[0][0]
    assert "ranks disagree on the balancing settings" in text
    fingerprints = [text.split(f"rank {r}: settings ")[1][:14] for r in range(3)]
    assert fingerprints[0] == fingerprints[1] != fingerprints[2]


def _none_and_empty(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    vit = _NoEmptyBatches(ViTConfig(deepstack_indexes=(0,)))
    out = {}
    # Rank 2 has no image and says so with None; rank 1 has an empty tensor on a skipped step.
    # Applied: three equal images on rank 0, so the balanced plan gives one to rank 2.
    applied = [[[1, 8, 8]] * 3, [[1, 2, 2]], []]
    steps = {"applied": applied, "skipped": [[[1, 4, 4]], [], [[1, 4, 4]]], "no_images": [[]] * 3}
    for name, grids in steps.items():
        _, pixels, grid = make_inputs(grids[rank], in_dim=24, seed=rank)
        args = (None, None) if rank == 2 else (pixels, grid)
        with record_moves() as moves:
            embeds, _, deepstack = fx_vitbal.dp_balance_vit_encoder(vit, *args)
        loss = embeds.sum() + deepstack[0].sum()
        if loss.requires_grad:  # not on rank 2 without images anywhere: nothing ran there
            loss.backward()
        grads = [p.grad for p in vit.parameters()]
        zero = all(g is not None and not g.any() for g in grads)
        out[name] = {
            "shapes": [tuple(embeds.shape), tuple(deepstack[0].shape)],
            "rows": pixels.shape[0],
            "moves": moves,
            "grads": "none" if all(g is None for g in grads) else "zero" if zero else "some",
        }
        vit.zero_grad(set_to_none=True)
    return out


def test_none_pixels_and_empty_ranks_take_part_and_the_vit_never_sees_zero_rows():
    results = run_ranks(_none_and_empty, 3)
    for rank, res in enumerate(results):
        for name in ("applied", "skipped", "no_images"):
            rows = res[name]["rows"] if rank != 2 else 0
            # Empty outputs of the ViT's width on ranks without images (pre-merger 32, deepstack
            # merged 32), the full ones elsewhere.
            assert res[name]["shapes"] == [(rows, 32), (rows // 4, 32)], (rank, name)
        # No image anywhere: the ViT ran on zero rows, as a parent that calls it with an empty
        # batch would (zero gradients, which DDP needs), on every rank alike (FSDP's backward
        # collectives need that), the None rank included.
        assert res["no_images"]["grads"] == "zero", rank
        assert res["applied"]["grads"] == "some"
    assert_units_moved([res["applied"] for res in results])


def _pixel_grads_on_some_ranks(rank: int, world: int) -> list:
    torch.manual_seed(0)
    vit = QwenStyleViT(ViTConfig(deepstack_indexes=(0,))).double()
    _, pixels, grid = make_inputs(SKEWED[rank], in_dim=24, seed=rank, dtype=torch.float64)
    results = []
    for other in ("none", "no_grad"):  # what the ranks other than 0 pass
        if rank == 0:
            pixels.requires_grad_(True)
            args = (pixels, grid)
        else:
            args = (None, None) if other == "none" else (pixels, grid)
        with record_moves() as moves:
            embeds, _, deepstack = fx_vitbal.dp_balance_vit_encoder(vit, *args)
            (embeds.pow(2).sum() + deepstack[0].sum()).backward()
        if rank == 0:
            got = pixels.grad
            pixels.grad = None
            ref_embeds, _, ref_deep = vit(pixels, grid)
            (ref_embeds.pow(2).sum() + ref_deep[0].sum()).backward()
            results.append((got, pixels.grad, len(moves)))
            pixels.grad = None
        else:
            results.append((None, None, len(moves)))
        vit.zero_grad(set_to_none=True)
    return results


def test_pixel_gradients_on_one_rank_keep_every_rank_in_the_backward_exchange():
    results = run_ranks(_pixel_grads_on_some_ranks, 3)
    for got, want, _ in results[0]:
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    # Pixels out, outputs home, output grads out, pixel grads home: 4 exchanges on every rank.
    assert [[n for *_, n in res] for res in results] == [[4, 4]] * 3


def _empty_ranks_compiled(rank: int, world: int, fullgraph: bool) -> dict:
    torch.manual_seed(0)
    vit = QwenStyleViT(ViTConfig(deepstack_indexes=(0,))).double()
    _, pixels, grid = make_inputs(EMPTY_RANKS[rank], in_dim=24, seed=rank, dtype=torch.float64)
    # Rank 1 passes None, rank 2 an empty [0, C] tensor.
    args = (None, None) if rank == 1 else (pixels, grid)

    def call(pixels, grid):
        embeds, _, deepstack = fx_vitbal.dp_balance_vit_encoder(vit, pixels, grid)
        return embeds, deepstack[0]

    compiled = torch.compile(call, backend="aot_eager", fullgraph=fullgraph)
    out = {}
    for name, fn in (("eager", call), ("compiled", compiled)):
        with record_collectives() as sequence, record_moves() as moves:
            with fullgraph_capture(fullgraph and name == "compiled"):
                embeds, deep = fn(*args)
            (embeds.pow(2).sum() + deep.sum()).backward()
        grads = torch.cat([p.grad.flatten() for p in vit.parameters()])
        dist.all_reduce(grads)
        vit.zero_grad(set_to_none=True)
        out[name] = {
            "outputs": [embeds.detach(), deep.detach()],
            "grads": grads,
            "sequence": sequence,
            "moves": moves,
        }
    return out


@pytest.mark.parametrize("fullgraph", [False, True])
def test_ranks_without_images_work_compiled_as_in_eager(fullgraph):
    results = run_ranks(_empty_ranks_compiled, 3, fullgraph)
    for rank, res in enumerate(results):
        eager, compiled = res["eager"], res["compiled"]
        for got, want in zip(compiled["outputs"], eager["outputs"], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9, msg=f"rank {rank}")
        torch.testing.assert_close(compiled["grads"], eager["grads"], rtol=1e-9, atol=1e-9)
        # The same collectives, of the same sizes, as the eager call (and on every rank).
        assert compiled["sequence"] == eager["sequence"], rank
        assert [op[:2] for op in compiled["sequence"]] == [
            op[:2] for op in results[0]["compiled"]["sequence"]
        ]
    assert results[1]["eager"]["outputs"][0].shape == (0, 32)  # the None rank: empty outputs
    assert_units_moved([res["compiled"] for res in results])


class _UndeclaredWidthViT(QwenStyleViT):
    """Registered as a subclass of QwenStyleViT would be, but without a pixel width."""


def _compiled_none_without_width(rank: int, world: int) -> str:
    fx_vitbal.register_vision_encoder(_UndeclaredWidthViT, frame_independent=True)
    torch.manual_seed(0)
    vit = _UndeclaredWidthViT(ViTConfig(deepstack_indexes=(0,))).double()
    _, pixels, grid = make_inputs(SKEWED[rank], in_dim=24, seed=rank, dtype=torch.float64)
    args = (None, None) if rank == 1 else (pixels, grid)
    fx_vitbal.dp_balance_vit_encoder(vit, *args)  # eager: fine (and torch < 2.13 needs it first)
    call = torch.compile(fx_vitbal.dp_balance_vit_encoder, backend="aot_eager")
    with pytest.raises(ValueError) as info:
        call(vit, *args)
    return str(info.value)


def test_a_compiled_rank_with_none_and_no_known_pixel_width_raises_on_every_rank():
    messages = run_ranks(_compiled_none_without_width, 3)
    assert messages[0] == messages[1] == messages[2]
    assert "rank 1: a compiled call got pixel_values=None" in messages[0]
    assert "register_vision_encoder(..., pixel_width=C)" in messages[0]


def _raising_callback(rank: int, world: int) -> dict:
    import logging

    torch.manual_seed(0)
    vit = QwenStyleViT(ViTConfig(deepstack_indexes=(0,))).double()
    _, pixels, grid = make_inputs(SKEWED[rank], in_dim=24, seed=rank, dtype=torch.float64)
    logged = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    logging.getLogger("fx_vitbal.measure").addHandler(handler)
    seen = []

    def metrics_writer(stats):  # a rank-0 writer that fails, every call
        seen.append((stats.step, len(sequence)))
        if stats.rank == 0:
            raise OSError("disk full")

    handle = fx_vitbal.add_stats_callback(metrics_writer)
    steps = []
    try:
        for _ in range(3):
            with record_collectives() as sequence:
                embeds, _, deepstack = fx_vitbal.dp_balance_vit_encoder(vit, pixels, grid)
                issued = len(sequence)
                (embeds.pow(2).sum() + deepstack[0].sum()).backward()
            steps.append(issued)
    finally:
        handle.remove()
    return {"seen": seen, "issued": steps, "logged": logged}


def test_a_raising_stats_callback_is_logged_once_after_the_steps_collectives():
    results = run_ranks(_raising_callback, 3)
    for rank, res in enumerate(results):
        # Called once per step, after the step's last forward collective (on every rank).
        assert [n for _, n in res["seen"]] == res["issued"] and len(res["seen"]) == 3, res
        assert res["issued"] == [4, 3, 3]  # the first step also agrees on output layouts
        expected = 1 if rank == 0 else 0
        assert len(res["logged"]) == expected, res["logged"]
    assert "stats callback" in results[0]["logged"][0] and "raised" in results[0]["logged"][0]
