"""Collectives and host reads per step, and where metadata is gathered for each backend."""

import types
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from accelerator_sim import on_accelerator, simulated_accelerator
from dist_utils import run_ranks

import fx_vitbal
from fx_vitbal.passes import apply_vit_balance_pass, symbolic_trace
from fx_vitbal.runtime.collectives import meta_device
from fx_vitbal.tools.models import ViTConfig
from fx_vitbal.tools.omni import LMConfig, OmniEncoderModel, make_inputs

GRIDS = [[[1, 16, 12], [2, 4, 6]], [[1, 2, 2]]]  # skewed: the plan is applied


def _steps(rank: int, world: int, path: str) -> list[dict]:
    """Four training steps of ``path`` on the simulated accelerator; what each one cost."""
    torch.manual_seed(0)
    model = OmniEncoderModel(ViTConfig(deepstack_indexes=(0,)), LMConfig(num_layers=1))
    group = dist.new_group(backend="gloo") if path == "ahead" else None
    if path == "fx":
        model = apply_vit_balance_pass(symbolic_trace(model))
    elif path != "eager":
        model = fx_vitbal.enable_vit_balance(model)
    vit = model.visual
    per_step = []
    for step in range(4):
        input_ids, pixels, grid = make_inputs(GRIDS[rank], in_dim=24, seed=rank)
        pixels.requires_grad_(step == 3)  # the last step also sends pixel gradients home
        pixels, grid = on_accelerator(pixels), on_accelerator(grid)
        if path == "ahead":
            fx_vitbal.use_plan(model, fx_vitbal.plan_ahead(vit, pixels, grid, group=group))
        with simulated_accelerator() as record:
            if path == "eager":  # the bare ViT through the functional wrapper
                embeds, _, deep = fx_vitbal.dp_balance_vit_encoder(vit, pixels, grid)
                (embeds.pow(2).mean() + deep[0].sum()).backward()
            else:
                model(input_ids, pixels, grid).pow(2).mean().backward()
        per_step.append(record)
    return per_step


@pytest.mark.parametrize("path", ["eager", "in_place", "fx", "ahead"])
def test_a_step_reads_the_device_once_and_issues_three_plus_two_collectives(path):
    for rank, steps in enumerate(run_ranks(_steps, 2, path)):
        for step, record in enumerate(steps):
            phases = Counter(phase for phase, _ in record["collectives"])
            # The first step also agrees on the ViT's output layouts (one blocking gather).
            expected_reads = 0 if path == "ahead" else 1
            forward = (2 if path == "ahead" else 3) + (step == 0)
            backward = 2 if step == 3 else 1  # pixel gradients home when they are wanted
            context = f"{path} rank {rank} step {step}: {record}"
            if step == 0:  # + the layouts gathered (a grid that differs from its plan rides in
                # the status word, so planned ahead that is the step's only read)
                assert len(record["reads"]) == expected_reads + 1, context
            else:  # steady state: the gathered metadata is the one read (none planned ahead)
                assert len(record["reads"]) == expected_reads, context
                assert all(r.startswith("metadata.py:") for r in record["reads"]), context
            assert phases == {"forward": forward, "backward": backward}, context
            forward_names = [name for phase, name in record["collectives"] if phase == "forward"]
            # metadata (not when planned ahead), pixels out, (layouts, once), outputs home
            expected = (["all_gather"] if path != "ahead" else []) + ["all_to_all"]
            expected += (["all_gather"] if step == 0 else []) + ["all_to_all"]
            assert forward_names == expected, context


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
    monkeypatch.setitem(dist.Backend.backend_capability, "custom", ["cpu", "cuda"])
    assert meta_device(group, torch.device("cpu")) == torch.device("cpu")  # it serves the CPU
