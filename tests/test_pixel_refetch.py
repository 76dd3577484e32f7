"""A split step's exchanged pixels are released once the forward is done and fetched again by the
backward (``runtime.transport.refetch``): the gradients stay the unsplit run's through every
autograd entry point, a retained graph, checkpoints around the call and calls without a
backward, and the refetch is one more exchange on every rank, in the backward only.

2 gloo ranks, the reference tower in float64 (its patch embedding saves its input pixels):
rank 0's 32x32-patch frame binds the step and is split, a band on each rank; then replica
sets of 2 on 4 ranks.
"""

import dataclasses

import torch
import torch.distributed as dist
from dist_utils import record_collectives, run_ranks
from torch.utils.checkpoint import checkpoint

import fx_vitbal
from fx_vitbal.tools.models import QwenStyleViT, ViTConfig
from fx_vitbal.tools.omni import make_inputs

GRIDS = [[[1, 32, 32]], [[1, 4, 4]]]
# Whole frames only: one of rank 0's two frames moves to rank 1.
WHOLE_GRIDS = [[[1, 16, 16], [1, 16, 16]], [[1, 4, 4]]]
CONFIG = fx_vitbal.BalanceConfig(cost_model="quadratic", min_band_patches=64)
ENTRIES = ("grad", "backward", "retain_graph", "checkpoint", "reentrant_checkpoint")


def _loss(outputs) -> torch.Tensor:
    # Position-dependent: a row restored to the wrong slot changes the loss and its gradients.
    return sum(
        (x * torch.linspace(-1, 1, x.numel(), dtype=x.dtype).view_as(x)).sum() for x in outputs
    )


def _gradients(vit, pixels, grid, call, entry: str) -> list[torch.Tensor]:
    """Pixel and all-reduced parameter gradients of ``call``'s step through ``entry``."""
    pixels = pixels.detach().requires_grad_(True)
    params = list(vit.parameters())
    if entry in ("checkpoint", "reentrant_checkpoint"):
        reentrant = entry == "reentrant_checkpoint"
        # Flat: a reentrant checkpoint passes gradients only to the tensors it returns itself.
        embeds, *deep = checkpoint(
            lambda p: _outputs(call, p, grid, flat=True), pixels, use_reentrant=reentrant
        )
    else:
        embeds, deep = _outputs(call, pixels, grid)
    loss = _loss([embeds, *deep])
    if entry in ("backward", "checkpoint", "reentrant_checkpoint"):
        loss.backward()
        grads = [pixels.grad, *(_or_zeros(p.grad, p) for p in params)]
        for p in params:
            p.grad = None
    elif entry == "retain_graph":  # twice through one graph: the second is the first's again
        first = torch.autograd.grad(loss, [pixels, *params], retain_graph=True)
        grads = torch.autograd.grad(loss, [pixels, *params])
        assert all(torch.equal(a, b) for a, b in zip(first, grads, strict=True))
    else:
        grads = torch.autograd.grad(loss, [pixels, *params])
    flat = torch.cat([g.flatten() for g in grads[1:]])
    dist.all_reduce(flat)
    return [grads[0], flat]


def _or_zeros(grad, param):
    return torch.zeros_like(param) if grad is None else grad


def _outputs(call, pixels, grid, flat=False):
    embeds, _, deep = call(pixels, grid)
    return (embeds, *deep) if flat else (embeds, tuple(deep))


def _close(got, want) -> float:
    return max(
        float((g - w).abs().max() / (w.abs().max() + 1e-30)) for g, w in zip(got, want, strict=True)
    )


def _setup(grids, rank: int):
    torch.manual_seed(0)
    vit = QwenStyleViT(ViTConfig(deepstack_indexes=(0,))).double()
    _, pixels, grid = make_inputs(grids[rank], in_dim=24, seed=rank, dtype=torch.float64)
    return vit, pixels, grid


def _exchanges(issued) -> list[str]:
    """The backward's collectives of the whole group (point-to-point batches left out)."""
    return [name for phase, name, _, _ in issued if phase == "backward" and name != "p2p"]


def _batches(issued) -> dict[str, int]:
    """Point-to-point batches posted, by phase: a split frame's exchange (one batch a layer
    forward, two backward for a ring of 2 bands), and the pixels fetched again."""
    phases = [phase for phase, name, _, _ in issued if name == "p2p"]
    return {"forward": phases.count("forward"), "backward": phases.count("backward")}


def _entries(rank: int, world: int) -> dict:
    vit, pixels, grid = _setup(GRIDS, rank)
    want = _gradients(vit, pixels, grid, vit, "grad")
    seen = []  # the pixels the tower computes from, as the exchange made them
    vit.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    stats = []
    handle = fx_vitbal.add_stats_callback(stats.append)

    def balanced(p, g, config=CONFIG):
        return fx_vitbal.dp_balance_vit_encoder(vit, p, g, config=config)

    results = {}
    for entry in ENTRIES:
        with record_collectives() as issued:
            got = _gradients(vit, pixels, grid, balanced, entry)
        results[entry] = {
            "difference": _close(got, want),
            "split": stats[-1].split_units,
            "backward exchanges": _exchanges(issued),
            "batches": _batches(issued),
        }
    # After a forward that a backward will follow, the exchanged pixels hold no memory.
    embeds, deep = _outputs(balanced, pixels.detach().requires_grad_(True), grid)
    results["released"] = seen[-1].untyped_storage().nbytes() == 0
    torch.autograd.grad(_loss([embeds, *deep]), list(vit.parameters()))
    results["refilled"] = seen[-1].untyped_storage().nbytes() > 0
    # Without one (evaluation), nothing is released: nothing would fetch them again.
    with torch.no_grad():
        _outputs(balanced, pixels, grid)
    results["kept without a backward"] = seen[-1].untyped_storage().nbytes() > 0
    # A step that splits nothing keeps its exchange as it was: no refetch.
    vit, pixels, grid = _setup(WHOLE_GRIDS, rank)
    want = _gradients(vit, pixels, grid, vit, "grad")
    vit.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    whole = dataclasses.replace(CONFIG, split_images=False)
    with record_collectives() as issued:
        got = _gradients(vit, pixels, grid, lambda p, g: balanced(p, g, whole), "grad")
    results["whole"] = {
        "difference": _close(got, want),
        "moved": stats[-1].applied,
        "backward exchanges": _exchanges(issued),
        "released": seen[-1].untyped_storage().nbytes() == 0,
    }
    handle.remove()
    return results


def test_split_pixels_are_released_after_the_forward_and_fetched_again_exactly():
    results = run_ranks(_entries, 2)
    for rank, res in enumerate(results):
        for entry in ENTRIES:
            assert res[entry]["split"], (rank, entry)
            assert res[entry]["difference"] <= 1e-9, (rank, entry, res[entry]["difference"])
        assert res["released"] and res["refilled"], rank
        assert res["kept without a backward"], rank
        assert res["whole"]["moved"] and res["whole"]["difference"] <= 1e-9, rank
        assert not res["whole"]["released"], rank
    # The backward's collectives stay the unsplit step's (output gradients out, pixel gradients
    # home); the pixels come again point to point, one batch on each rank (rank 0 sends rank
    # 1's band, rank 1 receives it), beside the ring's two a layer. A retained graph's second
    # backward has its pixels: nothing more.
    for entry in ("grad", "backward", "retain_graph"):
        assert {tuple(r[entry]["backward exchanges"]) for r in results} == {
            ("all_to_all", "all_to_all") * (1 + (entry == "retain_graph"))
        }, entry
    assert {tuple(r["whole"]["backward exchanges"]) for r in results} == {
        ("all_to_all", "all_to_all")
    }
    for rank, res in enumerate(results):
        ring = 2 * res["grad"]["batches"]["forward"]
        assert ring > 0 and res["grad"]["batches"]["backward"] == ring + 1, (rank, res)
        assert res["retain_graph"]["batches"]["backward"] == 2 * ring + 1, (rank, res)


# Replica sets of 2 on 4 ranks: set 0 holds the frame that is split, set 1 a small one.
SET_GRIDS = [[[1, 32, 32], [1, 4, 4]], [[1, 8, 4]]]


def _replicas(rank: int, world: int) -> dict:
    s = rank // 2
    vit, pixels, grid = _setup(SET_GRIDS, s)  # both replicas of a set hold its batch
    want = _gradients(vit, pixels, grid, vit, "grad")
    seen = []
    vit.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    stats = []
    handle = fx_vitbal.add_stats_callback(stats.append)

    def balanced(p, g):
        return fx_vitbal.dp_balance_vit_encoder(
            vit, p, g, config=CONFIG, replica_group=[2 * s, 2 * s + 1]
        )

    embeds, deep = _outputs(balanced, pixels.detach().requires_grad_(True), grid)
    released = seen[-1].untyped_storage().nbytes() == 0
    with record_collectives() as issued:
        params = list(vit.parameters())
        grads = torch.autograd.grad(_loss([embeds, *deep]), params)
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat)
    handle.remove()
    return {
        "difference": _close([flat], want[1:]),
        "split": stats[-1].split_units,
        "released": released,
        "backward exchanges": _exchanges(issued),
        "batches": _batches(issued),
    }


def test_split_pixels_with_replica_sets_are_fetched_again_from_their_senders_exactly():
    """Each unit's pixels come again from the replica that sent them in the forward."""
    results = run_ranks(_replicas, 4)
    for rank, res in enumerate(results):
        assert res["split"] and res["released"], (rank, res)
        assert res["difference"] <= 1e-9, (rank, res["difference"])
    assert {tuple(r["backward exchanges"]) for r in results} == {("all_to_all",)}
    # The split frame's rows move among set 0's ranks and any rank computing a band of it.
    assert sum(r["batches"]["backward"] > 2 * r["batches"]["forward"] for r in results) >= 2


def _modified(rank: int, world: int) -> str:
    vit, pixels, grid = _setup(GRIDS, rank)
    embeds, _, deep = fx_vitbal.dp_balance_vit_encoder(vit, pixels, grid, config=CONFIG)
    pixels.mul_(2.0)  # the pixels the backward fetches again, changed under it
    try:
        torch.autograd.grad(_loss([embeds, *deep]), list(vit.parameters()))
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_pixels_modified_in_place_before_the_backward_raise_instead_of_wrong_gradients():
    for message in run_ranks(_modified, 2):
        assert "modified in place before its backward" in message, message
