"""Multi-rank (gloo) tests of the eager runtime: exact results, lockstep errors, round trips."""

import contextlib
import io
import random
import re
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from dist_utils import record_collectives, run_ranks

import fx_vitbal
from fx_vitbal.plan.units import Plan
from fx_vitbal.runtime.transport.exchange import exchange
from fx_vitbal.runtime.transport.routing import Routing, local_routing
from fx_vitbal.tools.models import QwenStyleViT, ViTConfig
from fx_vitbal.tools.omni import make_inputs

# Skewed per-rank batches: rank 0 holds a large image and a video, rank 1 a thumbnail, rank 3
# nothing at all (it must still take part in every collective).
GRIDS = [
    [[1, 16, 12], [2, 4, 6], [1, 8, 8]],
    [[1, 2, 2]],
    [[1, 4, 4], [1, 6, 2]],
    [],
]
VIT = ViTConfig(window_size=2, fullatt_block_indexes=(1,), deepstack_indexes=(0, 1))


def _vit_and_batch(rank: int, grids: list) -> tuple[QwenStyleViT, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)  # same weights on every rank, like a data-parallel replica
    vit = QwenStyleViT(VIT).double()
    _, pixels, grid = make_inputs(grids[rank], in_dim=VIT.in_dim, seed=rank, dtype=torch.float64)
    return vit, pixels.requires_grad_(True), grid


def _loss(embeds: torch.Tensor, deepstack: list[torch.Tensor]) -> torch.Tensor:
    # A fixed, position-dependent projection: rows landing in the wrong slot change the loss.
    def weight(x):
        return torch.linspace(-1, 1, x.numel(), dtype=x.dtype).view_as(x)

    return (embeds * weight(embeds)).sum() + sum((d * weight(d)).pow(2).sum() for d in deepstack)


def _grads(vit: torch.nn.Module) -> torch.Tensor:
    flat = torch.cat([p.grad.flatten() for p in vit.parameters()])
    dist.all_reduce(flat)
    return flat


def _balanced_vs_local(rank: int, world: int, grids: list) -> dict:
    vit, pixels, grid = _vit_and_batch(rank, grids)
    ref_embeds, ref_window, ref_deep = vit(pixels, grid)
    _loss(ref_embeds, ref_deep).backward()
    ref_grads, ref_pixel_grad = _grads(vit), pixels.grad.clone()

    seen = []
    vit.register_forward_pre_hook(lambda mod, args: seen.append(args[1].tolist()))
    vit.zero_grad()
    pixels.grad = None
    embeds, window, deep = fx_vitbal.dp_balance_vit_encoder(vit, pixels, grid)
    _loss(embeds, deep).backward()
    return {
        "embeds": (embeds.detach(), ref_embeds.detach()),
        "window": (window, ref_window),
        "deep": ([d.detach() for d in deep], [d.detach() for d in ref_deep]),
        "grads": (_grads(vit), ref_grads),
        "pixel_grad": (pixels.grad, ref_pixel_grad),
        "seen": seen,
        "local": grid.tolist(),
    }


@pytest.mark.parametrize("world", [2, 4])
def test_balanced_outputs_and_gradients_equal_unbalanced(world):
    results = run_ranks(_balanced_vs_local, world, GRIDS[:world])
    for rank, res in enumerate(results):
        for key in ("embeds", "grads", "pixel_grad"):
            got, want = res[key]
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9, msg=f"{key} rank {rank}")
        torch.testing.assert_close(res["window"][0], res["window"][1], rtol=0, atol=0)
        assert len(res["deep"][0]) == len(VIT.deepstack_indexes)
        for got, want in zip(*res["deep"], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    # Proof that images really moved: some rank's ViT computed a batch other than its own.
    assert any(len(res["seen"]) == 1 and res["seen"][0] != res["local"] for res in results)
    frames = Counter(tuple(row) for res in results for row in res["seen"][0])
    expected = Counter((1, h, w) for grids in GRIDS[:world] for t, h, w in grids for _ in range(t))
    # Every frame computed exactly once (videos split into frames); a rank left without work
    # computes one dummy [1, 2, 2] unit instead, whose output is dropped.
    assert set((frames - expected).keys()) <= {(1, 2, 2)}
    assert frames - (frames - expected) == expected


def _bad_inputs(rank: int, world: int) -> list[str]:
    vit, pixels, grid = _vit_and_batch(rank, GRIDS)
    cases = {
        "rows": (pixels[:-1], grid),
        "grid shape": (pixels, grid[:, :2]),
        "non-positive": (pixels, grid * torch.tensor([1, -1, 1])),
        "merge": (pixels, torch.tensor([[1, 3, 4]])),
        "float grid": (pixels, grid.double()),
        "pixel dtype": (pixels.float(), grid),
    }
    messages = []
    for name, (bad_pixels, bad_grid) in cases.items():
        args = (bad_pixels, bad_grid) if rank == 1 else (pixels, grid)
        with pytest.raises(ValueError) as info:
            fx_vitbal.dp_balance_vit_encoder(vit, *args)
        messages.append(f"{name}: {info.value}")
    # After the errors every rank is still in lockstep: a good step works.
    embeds, _, _ = fx_vitbal.dp_balance_vit_encoder(vit, pixels, grid)
    assert embeds.shape[0] == pixels.shape[0]  # pre-merger rows
    return messages


def test_bad_input_on_one_rank_raises_the_same_value_error_on_every_rank():
    messages = run_ranks(_bad_inputs, 2)
    assert messages[0] == messages[1]
    assert all("rank 1" in m for m in messages[0])
    assert all("rank 0" not in m for m in messages[0] if not m.startswith("pixel dtype"))
    text = "\n".join(messages[0])
    assert "rows but image_grid_thw sums to" in text
    assert "2-D with 3 columns" in text
    assert "non-positive" in text
    assert "multiples of the merge size 2" in text
    assert "integer dtype" in text
    assert "disagree on pixel_values dtype" in text


def _random_round_trips(rank: int, world: int) -> int:
    rng = random.Random(1234)  # same sequence on every rank: plans must agree
    checked = 0
    for _ in range(20):
        units_R = [
            [(rng.randint(1, 3), 2 * rng.randint(1, 3), 2 * rng.randint(1, 3)) for _ in range(n)]
            for n in (rng.randint(0, 4) for _ in range(world))
        ]
        assignment = [[] for _ in range(world)]
        for src, units in enumerate(units_R):
            for idx in range(len(units)):
                assignment[rng.randrange(world)].append((src, idx))
        plan = Plan([sorted(a) for a in assignment], True, "applied", [], [], 0.0, 0.0, 0)
        routing = local_routing(plan, units_R, rank)
        # Each pixel row encodes (home rank, unit, row) so misplaced rows are caught.
        rows = [
            torch.tensor([[rank, i, r, 0.5]], dtype=torch.float64)
            for i, (t, h, w) in enumerate(units_R[rank])
            for r in range(t * h * w)
        ]
        x = torch.cat(rows) if rows else torch.zeros(0, 4, dtype=torch.float64)
        extra = x[:, :2].float() * 3  # a second dtype rides in its own exchange
        (there, there_extra), _ = exchange([x, extra], routing, 1, False, dist.group.WORLD)
        expected = [
            [src, idx, r]
            for src, idx in plan.assignment[rank]
            for r in range(units_R[src][idx][0] * units_R[src][idx][1] * units_R[src][idx][2])
        ]
        assert there[:, :3].tolist() == expected
        assert torch.equal(there_extra, there[:, :2].float() * 3)
        (back, back_extra), _ = exchange([there, there_extra], routing, 1, True, dist.group.WORLD)
        assert torch.equal(back, x) and torch.equal(back_extra, extra)
        checked += int(Routing.from_tensor(routing.to_tensor(len(routing.dest) + 2)) == routing)
    return checked


def test_random_plans_deliver_units_in_assignment_order_and_round_trip_exactly():
    assert run_ranks(_random_round_trips, 3) == [20, 20, 20]


def _skip_and_world_of_one(rank: int, world: int) -> dict:
    vit, pixels, grid = _vit_and_batch(0, [[[1, 4, 4]]])  # identical batches: nothing to gain
    calls = []
    vit.register_forward_pre_hook(lambda mod, args: calls.append(args[0].data_ptr()))
    embeds, _, _ = fx_vitbal.dp_balance_vit_encoder(vit, pixels, grid)
    singles = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    verbose = fx_vitbal.BalanceConfig(verbose=True)
    alone_printed, stats = io.StringIO(), []
    handle = fx_vitbal.add_stats_callback(stats.append)
    with contextlib.redirect_stdout(alone_printed), record_collectives() as issued:
        alone, _, _ = fx_vitbal.dp_balance_vit_encoder(
            vit, pixels, grid, group=singles[rank], config=verbose
        )
    handle.remove()
    same_input_object = calls[0] == pixels.data_ptr() == calls[1]
    # Verbose: one printed line per step, on rank 0 only, with no logging set up.
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        for grids in (GRIDS, [[[1, 4, 4]]] * world):  # skewed, then balanced
            _, pixels, grid = make_inputs(grids[rank], in_dim=VIT.in_dim, dtype=torch.float64)
            fx_vitbal.dp_balance_vit_encoder(vit, pixels, grid, config=verbose)
    return {
        "same_input_object": same_input_object,
        "equal": torch.equal(embeds, alone),
        "log": printed.getvalue().splitlines(),
        "alone": (
            alone_printed.getvalue().splitlines(),
            issued,
            [(s.step, s.reason, s.applied, s.total_rows) for s in stats],
        ),
    }


def test_skips_without_copies_single_rank_groups_are_plain_calls_and_verbose_logs_on_rank_0():
    results = run_ranks(_skip_and_world_of_one, 2)
    for res in results:
        assert (res["same_input_object"], res["equal"]) == (True, True)
        # A group of one rank computes plainly, issues no collective, and still reports.
        log, issued, stats = res["alone"]
        assert log == ["[vit dp balance] step 1: kept home: one rank (reason=single-rank), 16 rows"]
        assert issued == []
        assert stats == [(1, "single-rank", False, 16)]
    assert results[1]["log"] == []
    applied, skipped = results[0]["log"]
    # Steps count this ViT's calls on this group (BalanceStats.step): one came first, and the
    # one-rank group counts its own.
    assert re.match(r"\[vit dp balance\] step 2: applied, moved \d+ of \d+ rows \(", applied)
    assert ", imbalance " in applied and "load/mean max " in applied
    assert skipped.startswith("[vit dp balance] step 3: kept home: already balanced")
    assert "(reason=balanced), 32 rows, imbalance 0.000, load/mean max 1.00 min 1.00" in skipped
