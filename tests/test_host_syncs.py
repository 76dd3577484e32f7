"""Collectives, host syncs and host waits per step on a simulated accelerator
(``accelerator_sim``), and where metadata is gathered for each backend."""

import types
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from accelerator_sim import simulated_accelerator
from dist_utils import run_ranks

import fx_vitbal
from fx_vitbal.passes import apply_vit_balance_pass, symbolic_trace
from fx_vitbal.runtime.collectives import meta_device
from fx_vitbal.runtime.metadata import INLINE_GRID_ROWS
from fx_vitbal.tools.models import QwenStyleViT, ViTConfig
from fx_vitbal.tools.omni import LMConfig, OmniEncoderModel, make_inputs

# Per rank: skewed (the plan is applied), small, and a rank without images.
GRIDS = [[[1, 16, 12], [2, 4, 6]], [[1, 2, 2]], []]
# The last step: rank 1 holds more grid rows than the metadata header carries inline.
MANY = [[1, 2, 2]] * (INLINE_GRID_ROWS + 2)
PIXEL_GRADS_STEP, MANY_ROWS_STEP = 2, 3


def _grids(rank: int, step: int) -> list[list[int]]:
    return MANY if (rank, step) == (1, MANY_ROWS_STEP) else GRIDS[rank]


def _model(path: str) -> OmniEncoderModel:
    torch.manual_seed(0)
    model = OmniEncoderModel(ViTConfig(deepstack_indexes=(0,)), LMConfig(num_layers=1))
    if path == "fx":
        return apply_vit_balance_pass(symbolic_trace(model))
    if path != "eager":
        return fx_vitbal.enable_vit_balance(model)
    return model


def _steps(rank: int, world: int, path: str) -> list[dict]:
    """Four training steps of ``path`` on the simulated accelerator; what each one cost."""
    model = _model(path)
    group = dist.new_group(backend="gloo") if path == "ahead" else None
    per_step = []
    for step in range(4):
        input_ids, pixels, grid = make_inputs(_grids(rank, step), in_dim=24, seed=rank)
        pixels.requires_grad_(step == PIXEL_GRADS_STEP)  # its gradients go home too
        if path == "ahead":  # planned from the host's copy of the batch, before the step
            fx_vitbal.use_plan(model, fx_vitbal.plan_ahead(model.visual, pixels, grid, group=group))
        with simulated_accelerator() as simulation:
            pixels, grid = simulation.on_accelerator(pixels), simulation.on_accelerator(grid)
            if path == "eager":  # the bare ViT through the functional wrapper
                embeds, _, deep = fx_vitbal.dp_balance_vit_encoder(model.visual, pixels, grid)
                (embeds.pow(2).sum() + deep[0].sum()).backward()
            else:
                model(input_ids, pixels, grid).pow(2).mean().backward()
        per_step.append(simulation.record)
    return per_step


@pytest.mark.parametrize("path", ["eager", "in_place", "fx", "ahead"])
def test_a_step_syncs_the_host_once_waits_once_and_issues_three_plus_two_collectives(path):
    for rank, steps in enumerate(run_ranks(_steps, len(GRIDS), path)):
        for step, record in enumerate(steps):
            context = f"{path} rank {rank} step {step}: {record}"
            ahead = path == "ahead"
            # The gathered metadata is read once (none planned ahead), the padded grids of a
            # rank with many rows once more, and the first step reads the agreed layouts.
            gathers = 0 if ahead else 1 + (step == MANY_ROWS_STEP)
            assert len(record["syncs"]) == gathers + (step == 0), context
            files = {"metadata.py"} | ({"layouts.py"} if step == 0 else set())
            assert {r.split(":")[0] for r in record["syncs"]} <= files, context
            # The status words of the outputs, read once in restore's backward.
            assert len(record["waits"]) == 1 and "status.py" in record["waits"][0], context
            forward = [name for phase, name in record["collectives"] if phase == "forward"]
            expected = ["all_gather"] * gathers + ["all_to_all"]
            expected += (["all_gather"] if step == 0 else []) + ["all_to_all"]
            assert forward == expected, context
            backward = Counter(phase for phase, _ in record["collectives"])["backward"]
            assert backward == 1 + (step == PIXEL_GRADS_STEP), context


class _ShortWhenTold(QwenStyleViT):
    """The reference ViT, one output row short while ``short`` is set."""

    short = False

    def forward(self, pixel_values, image_grid_thw):
        embeds, window_index, deepstack = super().forward(pixel_values, image_grid_thw)
        return embeds[1:] if self.short else embeds, window_index, deepstack


def _eval_calls(rank: int, world: int, bad_rank: int | None) -> dict:
    """Three no-grad calls of a ViT balanced in eval mode (``when="always"``), the second one
    short of a row on ``bad_rank``."""
    torch.manual_seed(0)
    model = OmniEncoderModel(ViTConfig(deepstack_indexes=(0,)), LMConfig(num_layers=1))
    model.visual.__class__ = _ShortWhenTold
    config = fx_vitbal.BalanceConfig(when="always")
    model = fx_vitbal.enable_vit_balance(model, config=config).eval()
    records, error = [], None
    input_ids, pixels, grid = make_inputs(GRIDS[rank], in_dim=24, seed=rank)
    for call in range(3):
        model.visual.short = call == 1 and rank == bad_rank
        with simulated_accelerator() as simulation, torch.no_grad():
            pixels, grid = simulation.on_accelerator(pixels), simulation.on_accelerator(grid)
            try:
                model(input_ids, pixels, grid)
            except ValueError as raised:
                error = (call, str(raised))
        records.append(simulation.record)
        if error is not None:
            break
    return {"records": records, "error": error}


def test_a_no_grad_call_waits_for_nothing_and_the_next_call_reads_its_status_words():
    for rank, result in enumerate(run_ranks(_eval_calls, len(GRIDS), None)):
        first, *later = result["records"]
        context = f"rank {rank}: {result}"
        assert result["error"] is None and first["waits"] == [], context  # returns at once
        for record in later:  # the call before, read at this call's plan: already landed
            assert len(record["waits"]) == 1 and "status.py" in record["waits"][0], context
            assert len(record["syncs"]) == 1, context  # the gathered metadata


def test_a_bad_no_grad_output_raises_on_every_rank_at_the_next_call():
    errors = [result["error"] for result in run_ranks(_eval_calls, len(GRIDS), 2)]
    assert errors[0] is not None and errors[0][0] == 2, errors  # the call after the bad one
    assert "rank 2: ViT output 0 has" in errors[0][1], errors
    assert errors == [errors[0]] * len(GRIDS), errors


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
