"""Hugging Face towers that differ from the Qwen contract in their geometry or call. A tower
whose grid rows make other row counts than ``t*h*w`` or ``t*h*w / merge**2``
(``HFTowerRule.output_rows``) is balanced exactly on every path its rows go through (in place
with a text-only rank, planned ahead, replica sets), and a rule that counts them wrongly raises on
every rank instead of restoring rows into the wrong images. A tower with a call convention of its
own (MiniCPM-V's strips, ``CallConvention``) given pixels that do not fit it raises on every
rank, not on its own while the others wait. (Every shipped family runs in
``test_hf_families.py``.)"""

import pytest
import torch
import torch.distributed as dist
from dist_utils import record_moves, run_ranks

transformers = pytest.importorskip("transformers")

from transformers.models.qwen2_vl.modeling_qwen2_vl import (  # noqa: E402
    Qwen2VisionTransformerPretrainedModel,
    Qwen2VLVisionConfig,
)

import fx_vitbal  # noqa: E402

WIDTH = 3 * 2 * 14 * 14  # channels x temporal patch x patch x patch
# Rank 0 heavy, rank 1 a thumbnail (images move to it); then rank 1 text-only.
STEPS = [[[[1, 16, 12], [2, 4, 6]], [[1, 2, 2]]], [[[1, 8, 8], [1, 4, 4]], []]]


class EndRowTower(Qwen2VisionTransformerPretrainedModel):
    """Qwen2-VL's tower with one learned end row after each grid row's merged rows."""

    def __init__(self, config):
        super().__init__(config)
        self.end_row = torch.nn.Parameter(torch.randn(1, config.hidden_size))

    def forward(self, hidden_states, grid_thw, **kwargs):
        out = super().forward(hidden_states, grid_thw, **kwargs)
        merged = out.pooler_output.split((grid_thw.prod(-1) // 4).tolist())
        out.pooler_output = torch.cat([torch.cat([x, self.end_row]) for x in merged])
        return out


class MiscountedTower(EndRowTower):
    """The same tower, declared without its end rows."""


def _end_rows(t, h, w, m):
    return t * h * w // m**2 + 1


def _register():
    dims = dict(dims=lambda c: (c.embed_dim, 4 * c.embed_dim, c.hidden_size))
    fx_vitbal.register_hf_tower(EndRowTower, output_rows=_end_rows, **dims)
    fx_vitbal.register_hf_tower(
        MiscountedTower, output_rows=lambda t, h, w, m: t * h * w // 4, **dims
    )


def _tower(cls=EndRowTower):
    torch.manual_seed(0)
    config = Qwen2VLVisionConfig(depth=2, embed_dim=32, num_heads=2, hidden_size=32)
    return cls(config).train()


def _batch(grids, seed):
    rows = sum(t * h * w for t, h, w in grids)
    pixels = torch.randn(rows, WIDTH, generator=torch.Generator().manual_seed(seed))
    return pixels, torch.tensor(grids, dtype=torch.long).view(-1, 3)


def _step(tower, pixels, grid) -> tuple[torch.Tensor, torch.Tensor]:
    """The restored rows and the all-reduced parameter gradients of a weighted sum of them
    (through ``torch.autograd.grad``: the other tests of towers use ``.backward()``)."""
    out = tower(pixels, grid_thw=grid).pooler_output
    weights = torch.arange(out.numel(), dtype=out.dtype).view_as(out).sin()
    params = list(tower.parameters())
    grads = torch.autograd.grad((out * weights).sum(), params, allow_unused=True)
    flat = torch.cat(
        [
            g.flatten() if g is not None else p.new_zeros(p.numel())
            for g, p in zip(grads, params, strict=True)
        ]
    )
    dist.all_reduce(flat)
    return out.detach(), flat


def _reference(batches) -> list:
    """Each step's rows and gradients without balancing: every rank computes the others' batch
    too, so the all-reduced gradients need no collective in the tower."""
    tower = _tower()
    results = []
    for per_rank in batches:
        tower.zero_grad(set_to_none=True)
        outs = []
        for pixels, grid in per_rank:
            if grid.shape[0]:
                out = tower(pixels, grid_thw=grid).pooler_output
                weights = torch.arange(out.numel(), dtype=out.dtype).view_as(out).sin()
                (out * weights).sum().backward()
                outs.append(out.detach())
            else:
                outs.append(torch.zeros(0, 32))
        grads = [p.grad.flatten() for p in tower.parameters()]
        results.append((outs, torch.cat(grads)))
    return results


def _paths(rank: int, world: int) -> dict:
    _register()
    batches = [
        [_batch(grids, 10 * s + r) for r, grids in enumerate(step)] for s, step in enumerate(STEPS)
    ]
    reference = _reference(batches)
    results = {}
    tower = fx_vitbal.enable_vit_balance(_tower())
    with record_moves() as moves:
        results["in place"] = [_step(tower, *b[rank]) for b in batches]
    results["moves"] = sum(moves)
    plan_group = dist.new_group(backend="gloo")
    ahead = []
    for b in batches:
        fx_vitbal.use_plan(tower, fx_vitbal.plan_ahead(tower, *b[rank], group=plan_group))
        ahead.append(_step(tower, *b[rank]))
    results["planned ahead"] = ahead
    # One replica set of both ranks holding rank 0's batch: each image computed once.
    replicas = fx_vitbal.enable_vit_balance(_tower(), replica_group=dist.new_group([0, 1]))
    results["replica sets"] = [_step(replicas, *b[0]) for b in batches]
    want = {
        "in place": [(outs[rank], grads) for outs, grads in reference],
        "planned ahead": [(outs[rank], grads) for outs, grads in reference],
    }
    # A replica set's gradients: both ranks' batches are rank 0's, so twice its own gradient.
    single = _reference([[b[0]] for b in batches])
    want["replica sets"] = [(outs[0], 2 * grads) for outs, grads in single]
    return {"got": results, "want": want}


def test_a_tower_with_end_rows_equals_the_unbalanced_tower_on_every_path():
    results = run_ranks(_paths, 2)
    assert any(res["got"]["moves"] for res in results)  # moved (a passthrough also matches)
    for res in results:
        for path, steps in res["want"].items():
            for (got_out, got_grads), (out, grads) in zip(res["got"][path], steps, strict=True):
                torch.testing.assert_close(got_out, out, rtol=1e-5, atol=1e-6, msg=path)
                torch.testing.assert_close(got_grads, grads, rtol=1e-5, atol=1e-6, msg=path)


def _miscounted(rank: int, world: int) -> str:
    _register()
    tower = fx_vitbal.enable_vit_balance(_tower(MiscountedTower))
    pixels, grid = _batch(STEPS[0][rank], rank)
    with pytest.raises(ValueError) as caught:
        tower(pixels, grid_thw=grid).pooler_output.sum().backward()
    return str(caught.value)


def test_a_rule_that_miscounts_the_rows_raises_on_every_rank():
    errors = run_ranks(_miscounted, 2)
    assert all("output_rows counts" in error for error in errors), errors


def _unfit_strip(rank: int, world: int) -> str:
    from hf_zoo import minicpm_ocr

    tower = fx_vitbal.enable_vit_balance(minicpm_ocr.build().model.vision_tower)
    c, p = tower.config.num_channels, tower.config.patch_size
    patches = 8 * 8 if rank == 0 else 8 * 8 - 1  # rank 1's strip is a column short of 8x8
    strip = torch.randn(1, c, p, patches * p - (rank == 1))
    with pytest.raises(ValueError) as caught:
        tower(strip, target_sizes=torch.tensor([[8, 8]], dtype=torch.int32))
    return str(caught.value)


def test_pixels_that_do_not_fit_a_call_convention_raise_on_every_rank():
    errors = run_ranks(_unfit_strip, 2)
    assert all("rank 1: the tower's pixels or grid do not fit" in e for e in errors), errors
