"""Wrappers users put around the model or the ViT are seen through (DDP, FSDP1,
``checkpoint_wrapper``, ``torch.compile``'s ``OptimizedModule``), and a ViT is never balanced
twice. 2 gloo ranks, one of them without images; results equal the unbalanced run."""

import torch
import torch.distributed as dist
from dist_utils import assert_units_moved, record_moves, run_ranks, train_step
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.nn.parallel import DistributedDataParallel

import fx_vitbal
from fx_vitbal.passes import apply_vit_balance_pass, symbolic_trace
from fx_vitbal.runtime.vit.registry import find_vit, unwrap_module
from fx_vitbal.tools.models import QwenStyleViT, ViTConfig
from fx_vitbal.tools.omni import LMConfig, OmniEncoderModel

GRIDS = [[[1, 16, 12], [2, 4, 6], [1, 4, 4]], []]


def _model() -> OmniEncoderModel:
    torch.manual_seed(0)
    return OmniEncoderModel(ViTConfig(deepstack_indexes=(0,)), LMConfig(num_layers=1))


def _wrapped(how: str, group: dist.ProcessGroup):
    """``(module to step, module whose parameters hold the gradients)`` for one way of wrapping."""
    model = _model()
    if how == "ddp_parent":
        return fx_vitbal.enable_vit_balance(DistributedDataParallel(model), group=group), model
    if how == "fsdp1_parent":
        fsdp = FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=True)
        return fx_vitbal.enable_vit_balance(fsdp, group=group), fsdp
    if how == "compiled_parent":
        compiled = torch.compile(model, backend="eager")
        return fx_vitbal.enable_vit_balance(compiled, group=group), model
    if how == "checkpointed_vit":
        model.visual = checkpoint_wrapper(model.visual)
    elif how == "compiled_vit":
        model.visual = torch.compile(model.visual, backend="eager")
    elif how == "fsdp1_vit":
        model.visual = FullyShardedDataParallel(
            model.visual, device_id=torch.device("cpu"), use_orig_params=True
        )
    if how == "fx_of_balanced_in_place":  # the pass must leave a balanced ViT alone
        gm = apply_vit_balance_pass(symbolic_trace(fx_vitbal.enable_vit_balance(model)))
        assert "vitbal" not in gm.code
        return gm, gm
    if how == "fx_of_checkpointed_vit":
        model.visual = checkpoint_wrapper(model.visual)
        gm = apply_vit_balance_pass(symbolic_trace(model), group=group)
        assert gm.code.count("vitbal.plan") == 1
        return gm, gm
    return fx_vitbal.enable_vit_balance(model, group=group), model


def _grads(module) -> torch.Tensor:
    if isinstance(module, FullyShardedDataParallel):
        with FullyShardedDataParallel.summon_full_params(module, with_grads=True):
            return _grads_of(module)
    if isinstance(module.visual, FullyShardedDataParallel):
        with FullyShardedDataParallel.summon_full_params(module.visual, with_grads=True):
            return _grads_of(module)
    return _grads_of(module)


def _grads_of(module) -> torch.Tensor:
    grads = torch.cat([p.grad.flatten() for p in module.parameters()])
    dist.all_reduce(grads)
    return grads


def _all_wrappers(rank: int, world: int, hows: list[str]) -> dict:
    group = dist.new_group()  # balancing collectives apart from DDP's and FSDP's
    want_logits, want_grads = train_step(_model(), GRIDS[rank], rank)
    out = {}
    for how in hows:
        run, holder = _wrapped(how, group)
        with record_moves() as moves:
            logits = train_step(run, GRIDS[rank], rank, reduce_grads=False)
        grads = _grads(holder)  # DDP's means, all-reduced, are the reference's sums too
        out[how] = {"got": (logits, grads), "want": (want_logits, want_grads), "moves": moves}
    return out


HOWS = [
    "ddp_parent",
    "fsdp1_parent",
    "compiled_parent",
    "checkpointed_vit",
    "compiled_vit",
    "fsdp1_vit",
    "fx_of_balanced_in_place",
    "fx_of_checkpointed_vit",
]


def test_wrappers_around_the_model_or_the_vit_are_seen_through_and_balance_once():
    results = run_ranks(_all_wrappers, 2, HOWS)
    for how in HOWS:
        for rank, res in enumerate(r[how] for r in results):
            for got, want in zip(res["got"], res["want"], strict=True):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"{how} {rank}")
        assert_units_moved([r[how] for r in results])
        # Exactly one balanced ViT call: forward out, forward home, backward out (2 ranks alike).
        assert [len(r[how]["moves"]) for r in results] == [3, 3], how


def test_find_vit_sees_through_wrappers_and_returns_the_outermost_one():
    model = _model()
    assert find_vit(torch.compile(model, backend="eager")) is model.visual
    wrapped = checkpoint_wrapper(model.visual)
    model.visual = wrapped
    assert find_vit(model) is wrapped and unwrap_module(wrapped).__class__ is QwenStyleViT
    renamed = torch.nn.Sequential(checkpoint_wrapper(QwenStyleViT(ViTConfig())))
    assert find_vit(renamed) is renamed[0]  # found by its registered class, wrapper kept
