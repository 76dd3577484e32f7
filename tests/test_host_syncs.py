"""Collectives and host reads per step, and where metadata is gathered for each backend."""

import sys
import types

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks, train_step

import fx_vitbal
from fx_vitbal import _compat
from fx_vitbal.metadata import meta_device
from fx_vitbal.models import LMConfig, OmniEncoderModel, ViTConfig, make_inputs

GRIDS = [[[1, 16, 12], [2, 4, 6]], [[1, 2, 2]]]  # skewed: the plan is applied


def _count_step(rank: int, world: int) -> list[dict]:
    torch.manual_seed(0)
    model = fx_vitbal.enable_vit_balance(
        OmniEncoderModel(ViTConfig(deepstack_indexes=(0,)), LMConfig(num_layers=1))
    )
    counts = {"all_gather_single": 0, "all_to_all_single": 0, "tolist": 0, "item": 0}

    def counting(name, original):
        def wrapper(*args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if "fx_vitbal" in caller and "models.py" not in caller:  # the library, not the ViT
                counts[name] += 1
            return original(*args, **kwargs)

        return wrapper

    patched = [(_compat, "all_gather_single"), (dist, "all_to_all_single")]
    patched += [(torch.Tensor, "tolist"), (torch.Tensor, "item")]
    originals = [getattr(owner, name) for owner, name in patched]
    per_step = []
    try:
        for owner, name in patched:
            setattr(owner, name, counting(name, getattr(owner, name)))
        for _ in range(2):
            train_step(model, GRIDS[rank], rank, reduce_grads=False)
            per_step.append(dict(counts))
            counts.update(dict.fromkeys(counts, 0))
        input_ids, pixels, grid = make_inputs(GRIDS[rank], in_dim=24, seed=rank)
        model(input_ids, pixels.requires_grad_(True), grid).pow(2).mean().backward()
        per_step.append(dict(counts))
    finally:
        for (owner, name), original in zip(patched, originals, strict=True):
            setattr(owner, name, original)
    return per_step


def test_one_metadata_gather_and_four_host_reads_per_step():
    for *steps, pixel_grad_step in run_ranks(_count_step, 2):
        for counts in steps:
            # Gathers: the plan's metadata (grids inline) and the restore's output-layout check.
            # Exchanges: pixels out, outputs home, output gradients out in backward.
            # Host reads of small CPU tensors: the local grid, the gathered metadata, the
            # gathered layouts, the routing (parsed once for all four moves).
            assert counts == {
                "all_gather_single": 2,
                "all_to_all_single": 3,
                "tolist": 4,
                "item": 0,
            }
        # Pixel gradients go home in a fourth exchange, without a second layout check.
        assert pixel_grad_step == {
            "all_gather_single": 2,
            "all_to_all_single": 4,
            "tolist": 4,
            "item": 0,
        }


def test_metadata_device_follows_the_backend_the_data_and_the_bound_device(monkeypatch):
    group = types.SimpleNamespace(group_name="g", bound_device_id=None)
    backends = {"g": "gloo"}
    monkeypatch.setattr(dist, "get_backend", lambda g: backends[g.group_name])
    assert meta_device(group, torch.device("cuda", 1)) == torch.device("cpu")  # gloo: host
    backends["g"] = "cpu:gloo,cuda:nccl"
    assert meta_device(group, torch.device("cuda", 1)) == torch.device("cpu")
    for backend in ("nccl", "xccl", "hccl", "custom"):
        backends["g"] = backend
        assert meta_device(group, torch.device("cuda", 1)) == torch.device("cuda", 1)
        assert meta_device(group, torch.device("xpu", 0)) == torch.device("xpu", 0)
    group.bound_device_id = torch.device("cuda", 3)
    assert meta_device(group, torch.device("cpu")) == torch.device("cuda", 3)
    group.bound_device_id = None
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: None)
    with pytest.raises(ValueError, match="no CPU backend and no device"):
        meta_device(group, torch.device("cpu"))
