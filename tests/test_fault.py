"""Randomized fault test: 8 gloo ranks, 40 seeded steps mixing everything lockstep must survive.

Each step draws, from one RNG seeded alike on every rank (so all ranks agree on the scenario):
image and video counts per rank (ranks with no image pass an empty ``[0, C]`` tensor or ``None``),
skewed or balanced batches, a trigger threshold that skips every plan, the eager or the in-place
path, eval mode on every rank, and a bad input on one random rank. A second RNG (so the first
keeps its draws) picks the autograd entry point (``.backward()``, ``torch.autograd.grad`` over
every parameter or with ``inputs=`` half of them, ``retain_graph=True`` and a second backward, a
non-reentrant checkpoint; not around a bad step on torch < 2.13, see
``dist_utils.CHECKPOINT_CLOSES_ON_ERROR``) and whether the eager call runs under
``torch.compile``. Each step must equal the unbalanced run on every rank (outputs, deepstack,
window_index, all-reduced parameter gradients) or raise the same ``ValueError`` on every rank; a
good step follows every bad one. The collectives each rank issues
(``runtime.transport.collectives``: kind, phase, gather size) must be the same sequence on every
rank in every step. Pixels do not require gradients, as in training (``test_lockstep.py`` covers
ranks whose pixels differ in that).

Every collective runs on a group with a short timeout, so a rank left waiting fails the test
within seconds instead of stalling CI.
"""

import contextlib
import datetime
import random
import time
from collections import Counter

import torch
import torch.distributed as dist
from dist_utils import CHECKPOINT_CLOSES_ON_ERROR, record_collectives, record_moves, run_ranks
from torch.utils.checkpoint import checkpoint

import fx_vitbal
import fx_vitbal.runtime.agree.planning
from fx_vitbal.tools.models import QwenStyleViT, ViTConfig
from fx_vitbal.tools.omni import make_inputs

WORLD, STEPS, SEED = 8, 40, 2  # this seed draws every bad case (asserted below)
# Long enough for 8 processes sharing 2 cores, short enough that a hang fails fast.
STEP_TIMEOUT = datetime.timedelta(seconds=20)
# Compiled steps run on a group of their own: 8 processes compiling on 2 cores arrive at a
# collective up to a minute apart, the first time a graph is traced.
COMPILE_TIMEOUT = datetime.timedelta(seconds=180)
VIT = ViTConfig(
    in_dim=4,
    hidden=8,
    num_heads=2,
    mlp_hidden=16,
    out_dim=8,
    window_size=2,
    fullatt_block_indexes=(1,),
    deepstack_indexes=(0,),
)
BAD_CASES = ("rows", "merge", "non-positive", "float grid", "pixel dtype", "row width")
NEVER = fx_vitbal.BalanceConfig(trigger_threshold=1e9)  # every plan skipped
ENTRIES = ("backward", "grad", "grad_inputs", "retain_graph_twice", "checkpoint")


def _scenario(rng: random.Random, extra: random.Random, world: int, allow_bad: bool) -> dict:
    """One step's scenario for every rank; the draws are the same on every rank. ``extra``
    draws the entry point and compilation, so ``rng`` keeps the draws ``SEED`` was chosen for."""
    layout = rng.choices(["skewed", "balanced", "no_images"], weights=[4, 1, 1])[0]
    if layout == "skewed":
        grids = [
            [[rng.choice([1, 1, 2]), 2 * rng.randint(1, 3), 2 * rng.randint(1, 3)]]
            * rng.randint(0, 2)
            for _ in range(world)
        ]
        grids[rng.randrange(world)] += [[2, 6, 4], [1, 6, 6]]  # one heavy rank
    elif layout == "balanced":
        grids = [[[1, 4, 4], [1, 2, 2]]] * world
    else:
        grids = [[] for _ in range(world)]
    passes_none = [not g and rng.random() < 0.5 for g in grids]
    eval_mode = allow_bad and rng.random() < 0.12  # right after a bad step: a training step
    bad_rank = bad_case = None
    if allow_bad and not eval_mode and rng.random() < 0.35:  # eval calls are plain: no check
        bad_rank, bad_case = rng.randrange(world), rng.choice(BAD_CASES)
        passes_none[bad_rank] = False
        others_have_pixels = any(not n for r, n in enumerate(passes_none) if r != bad_rank)
        if bad_case in ("pixel dtype", "row width") and not others_have_pixels:
            bad_case = "rows"  # a dtype or width is only wrong next to another rank's
    return {
        "entry": extra.choice(ENTRIES),
        "compiled": extra.random() < 0.3,
        "layout": layout,
        "grids": grids,
        "passes_none": passes_none,
        "config": NEVER if rng.random() < 0.15 else fx_vitbal.BalanceConfig(),
        "path": rng.choice(["eager", "in_place"]),
        "eval": eval_mode,
        "bad_rank": bad_rank,
        "bad_case": bad_case,
    }


def _corrupt(pixels: torch.Tensor, grid: torch.Tensor, case: str):
    """``(pixels, grid)`` broken the way ``case`` names (cases of ``test_exchange.py``)."""
    if case == "rows":
        return torch.cat([pixels, pixels.new_zeros(1, pixels.shape[1])]), grid
    if case == "merge":
        return pixels, torch.tensor([[1, 3, 4]])
    if case == "non-positive":
        return pixels, torch.tensor([[1, -2, 2]])
    if case == "float grid":
        return pixels, grid.double()
    if case == "pixel dtype":
        return pixels.float(), grid
    return pixels[:, :-1], grid  # row width


@contextlib.contextmanager
def _count_plans():
    """Count ``vitbal::plan`` calls (the metadata gather): an eval step must make none."""
    original = fx_vitbal.runtime.agree.planning.plan
    calls = []

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    fx_vitbal.runtime.agree.planning.plan = counting
    try:
        yield calls
    finally:
        fx_vitbal.runtime.agree.planning.plan = original


def _loss(outputs: list[torch.Tensor]) -> torch.Tensor:
    # Position-dependent: a row restored to the wrong slot changes the loss and its gradients.
    return sum(
        (x * torch.linspace(-1, 1, x.numel(), dtype=x.dtype).view_as(x)).sum() for x in outputs
    )


def _grads(vit: torch.nn.Module, group) -> torch.Tensor:
    """All-reduced parameter gradients (None read as zeros)."""
    flat = torch.cat(
        [p.grad.flatten() if p.grad is not None else 0 * p.flatten() for p in vit.parameters()]
    )
    dist.all_reduce(flat, group=group)
    vit.zero_grad(set_to_none=True)
    return flat


_COMPILED = torch.compile(fx_vitbal.dp_balance_vit_encoder, backend="eager")


def _call(vit, pixels, grid, scenario, group, balanced: bool):
    """One ViT call (balanced or not) and, in training, its backward by the scenario's entry
    point: ``(triple, grads)``."""

    def forward():
        if not balanced:
            return vit._vitbal_original_forward(pixels, grid)
        if scenario["path"] == "eager":
            call = _COMPILED if scenario["compiled"] else fx_vitbal.dp_balance_vit_encoder
            return call(vit, pixels, grid, config=scenario["config"], group=group)
        return vit(pixels, grid)  # enable_vit_balance made this call balanced

    if not balanced and pixels is None:  # what the balanced call must return without images
        if scenario["eval"] or all(scenario["passes_none"]):
            return (None, None, []), None
        pixels = torch.zeros(0, VIT.in_dim, dtype=torch.float64)
        grid = torch.zeros(0, 3, dtype=torch.long)
    if scenario["eval"]:
        return forward(), None
    entry = scenario["entry"]
    raises = scenario["bad_rank"] is not None
    checkpointed = entry == "checkpoint" and (CHECKPOINT_CLOSES_ON_ERROR or not raises)
    out = checkpoint(forward, use_reentrant=False) if checkpointed else forward()
    loss = _loss([out[0], *out[2]]) if out[0] is not None else torch.zeros(())
    if loss.requires_grad:  # not when no rank has an image: nothing ran with gradients
        params = list(vit.parameters())
        if entry in ("grad", "grad_inputs"):
            chosen = params if entry == "grad" else params[::2]
            found = torch.autograd.grad(loss, chosen, allow_unused=True)
            for p, g in zip(chosen, found, strict=True):
                p.grad = g
        else:
            loss.backward(retain_graph=entry == "retain_graph_twice")
            if entry == "retain_graph_twice":
                loss.backward()
    return out, _grads(vit, group)


def _check_equal(got, want, step: int, rank: int) -> None:
    (embeds, window, deep), grads = got
    (want_embeds, want_window, want_deep), want_grads = want
    where = f"step {step} rank {rank}"
    if want_embeds is None:
        assert (embeds, window, deep) == (None, None, []), where
    else:
        close = dict(rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(embeds, want_embeds, **close, msg=f"embeds {where}")
        torch.testing.assert_close(window, want_window, rtol=0, atol=0, msg=f"window {where}")
        assert len(deep) == len(want_deep) == len(VIT.deepstack_indexes), where
        for d, w in zip(deep, want_deep, strict=True):
            torch.testing.assert_close(d, w, **close, msg=f"deepstack {where}")
    if want_grads is not None:
        torch.testing.assert_close(grads, want_grads, rtol=1e-9, atol=1e-9, msg=f"grads {where}")


def _step(rank, vit, scenario, groups, step) -> dict:
    group = groups[scenario["compiled"] and scenario["path"] == "eager"]
    grids = scenario["grids"][rank]
    _, pixels, grid = make_inputs(
        grids, in_dim=VIT.in_dim, seed=1000 * step + rank, dtype=torch.float64
    )
    if scenario["passes_none"][rank]:
        pixels = grid = None
    vit.train(not scenario["eval"])
    fx_vitbal.enable_vit_balance(vit, config=scenario["config"], group=group)
    summary = {"error": None, "kind": "eval" if scenario["eval"] else None}
    if scenario["bad_rank"] is not None:
        if rank == scenario["bad_rank"]:
            pixels, grid = _corrupt(pixels, grid, scenario["bad_case"])
        with record_collectives() as issued, record_moves() as moves, _count_plans() as plans:
            try:
                _call(vit, pixels, grid, scenario, group, balanced=True)
            except ValueError as error:
                summary["error"] = str(error)
        vit.zero_grad(set_to_none=True)
        summary["collectives"] = _kinds(issued)
        return {**summary, "kind": "bad", "moves": moves, "plans": len(plans)}
    with torch.set_grad_enabled(not scenario["eval"]):
        want = _call(vit, pixels, grid, scenario, group, balanced=False)
        with record_collectives() as issued, record_moves() as moves, _count_plans() as plans:
            got = _call(vit, pixels, grid, scenario, group, balanced=True)
    _check_equal(got, want, step, rank)
    summary["collectives"] = _kinds(issued)
    if summary["kind"] is None:
        summary["kind"] = "applied" if moves else "skipped"
    return {**summary, "moves": moves, "plans": len(plans)}


def _kinds(issued: list) -> list:
    """What must match across ranks: phase, kind and (for a gather) size; not the splits."""
    return [
        (phase, name, size if name == "all_gather" else None) for phase, name, size, _ in issued
    ]


def _random_steps(rank: int, world: int) -> list[dict]:
    group = dist.new_group(timeout=STEP_TIMEOUT)  # every collective of the steps runs on it
    compile_group = dist.new_group(timeout=COMPILE_TIMEOUT)  # ... but the compiled steps'
    groups = (group, compile_group)
    torch.manual_seed(0)  # same weights on every rank, like a data-parallel replica
    vit = QwenStyleViT(VIT).double()
    # The first vitbal op imports torch._dynamo (seconds on a busy machine): do it before any
    # short-timeout collective, with a plan that gathers nothing.
    fx_vitbal.runtime.agree.planning.plan(
        torch.zeros(4, 4), torch.tensor([[1, 2, 2]]), 2, "", world, group.group_name, False
    )
    dist.barrier()
    rng, extra = random.Random(SEED), random.Random(SEED + 1)
    summaries, after_bad = [], False
    for step in range(STEPS):
        # A good training step follows every bad one (and the last step is good).
        scenario = _scenario(rng, extra, world, allow_bad=not after_bad and step < STEPS - 1)
        start = time.monotonic()
        summary = _step(rank, vit, scenario, groups, step)
        summary.update(
            seconds=time.monotonic() - start,
            bad_rank=scenario["bad_rank"],
            bad_case=scenario["bad_case"],
            none=scenario["passes_none"][rank],
            path=scenario["path"],
            layout=scenario["layout"],
            entry=scenario["entry"],
            compiled=scenario["compiled"] and scenario["path"] == "eager",
        )
        summaries.append(summary)
        after_bad = scenario["bad_rank"] is not None
    return summaries


def test_random_faults_keep_every_rank_in_lockstep_and_every_good_step_exact():
    results = run_ranks(_random_steps, WORLD, timeout=480)
    kinds = Counter()
    for step, per_rank in enumerate(zip(*results, strict=True)):
        first = per_rank[0]
        # Every rank took the same branch and issued the same collectives, in the same order.
        assert {s["kind"] for s in per_rank} == {first["kind"]}, step
        assert all(s["collectives"] == first["collectives"] for s in per_rank), step
        assert {(len(s["moves"]), s["plans"]) for s in per_rank} == {
            (len(first["moves"]), first["plans"])
        }, step
        kinds[first["kind"]] += 1
        kinds[first["path"]] += first["kind"] != "eval"
        kinds[first["entry"]] += first["kind"] not in ("eval", "bad")
        kinds["compiled"] += first["compiled"] and first["kind"] != "eval"
        kinds["compiled_bad"] += first["compiled"] and first["kind"] == "bad"
        kinds["with_none"] += any(s["none"] for s in per_rank)
        kinds["no_images"] += first["layout"] == "no_images" and first["kind"] != "bad"
        kinds["skipped_with_images"] += (
            first["layout"] != "no_images" and first["kind"] == "skipped"
        )
        # A checkpointed call runs again in its backward, plan included, on every rank.
        plans_per_call = 2 if first["entry"] == "checkpoint" else 1
        if first["kind"] == "bad":
            # The same error on every rank, naming the bad rank, before anything moved.
            assert {s["error"] for s in per_rank} == {first["error"]}, step
            assert first["error"] and f"rank {first['bad_rank']}" in first["error"], first["error"]
            assert first["plans"] == 1 and not first["moves"], step
            assert results[0][step + 1]["kind"] != "bad", step  # a good step follows
        elif first["kind"] == "eval":
            assert first["plans"] == 0 and not first["moves"], step  # a plain call
        elif first["kind"] == "applied":
            assert first["plans"] == plans_per_call
            assert any(sum(s["moves"]) for s in per_rank), f"step {step}: no unit moved"
        else:
            assert first["plans"] == plans_per_call
        if not first["compiled"]:  # the first compiled call of a shape compiles
            assert max(s["seconds"] for s in per_rank) < STEP_TIMEOUT.total_seconds(), step
    assert kinds["applied"] >= 8 and kinds["skipped_with_images"] >= 3, kinds
    assert kinds["bad"] >= 5 and kinds["eval"] >= 3, kinds
    assert {s["bad_case"] for s in results[0] if s["bad_case"]} == set(BAD_CASES)
    assert kinds["eager"] >= 5 and kinds["in_place"] >= 5, kinds
    assert kinds["with_none"] >= 10 and kinds["no_images"] >= 2, kinds
    assert all(kinds[entry] >= 2 for entry in ENTRIES), kinds
    assert kinds["compiled"] >= 4 and kinds["compiled_bad"] >= 1, kinds
