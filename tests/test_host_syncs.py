"""Collectives, host syncs and host waits per step on a simulated accelerator
(``accelerator_sim``), and where metadata is gathered for each backend."""

import types
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from accelerator_sim import simulated_accelerator
from dist_utils import UNBACKED_BATCH_SIZES, fullgraph_capture, run_ranks

import fx_vitbal
from fx_vitbal.passes import apply_vit_balance_pass, symbolic_trace
from fx_vitbal.runtime.collectives import meta_device
from fx_vitbal.runtime.metadata import INLINE_GRID_ROWS
from fx_vitbal.tools.models import QwenStyleViT, ViTConfig
from fx_vitbal.tools.omni import LMConfig, OmniEncoderModel, make_inputs

needs_unbacked_batch_sizes = pytest.mark.skipif(
    not UNBACKED_BATCH_SIZES, reason="one graph for every image count needs torch >= 2.11 here"
)
# Per rank: skewed (the plan is applied), small, and a rank without images.
GRIDS = [[[1, 16, 12], [2, 4, 6]], [[1, 2, 2]], []]
# The last step: rank 1 holds more grid rows than the metadata header carries inline.
MANY = [[1, 2, 2]] * (INLINE_GRID_ROWS + 2)
PIXEL_GRADS_STEP, MANY_ROWS_STEP = 2, 3


# With replica sets: 2 sets x 2 ranks, set 0 holding rank 0's batch, set 1 none but in the
# last step, when it holds more grid rows than the header carries inline.
SETS = [[0, 1], [2, 3]]


def _grids(rank: int, step: int, replicas=None) -> list[list[int]]:
    if replicas is not None:  # a set's batch
        return MANY if (replicas, step) == (SETS[1], MANY_ROWS_STEP) else GRIDS[2 * (rank // 2)]
    return MANY if (rank, step) == (1, MANY_ROWS_STEP) else GRIDS[rank]


def _model(path: str, replicas=None) -> OmniEncoderModel:
    torch.manual_seed(0)
    model = OmniEncoderModel(ViTConfig(deepstack_indexes=(0,)), LMConfig(num_layers=1))
    if path == "fx":
        return apply_vit_balance_pass(symbolic_trace(model), replica_group=replicas)
    if path == "compiled":  # one graph for every step (its layouts agreed while compiling)
        model = fx_vitbal.enable_vit_balance(model, replica_group=replicas)
        return torch.compile(model, backend="vitbal", options=ONE_GRAPH, fullgraph=True)
    if path != "eager":
        return fx_vitbal.enable_vit_balance(model, replica_group=replicas)
    return model


ONE_GRAPH = {"inner": "aot_eager"}


def _batch(model, path: str, rank: int, step: int, group, replicas=None):
    """The step's inputs, its plan handed over first when planned ahead."""
    seed = rank if replicas is None else replicas[0]  # a set's ranks hold the same pixels
    input_ids, pixels, grid = make_inputs(_grids(rank, step, replicas), in_dim=24, seed=seed)
    pixels.requires_grad_(step == PIXEL_GRADS_STEP)  # its gradients go home too
    if path == "ahead":  # planned from the host's copy of the batch, before the step
        planned = fx_vitbal.plan_ahead(
            model.visual, pixels, grid, group=group, replica_group=replicas
        )
        fx_vitbal.use_plan(model, planned)
    return input_ids, pixels, grid


def _step(model, path: str, batch, simulation=None, replicas=None) -> None:
    input_ids, pixels, grid = batch
    if simulation is not None:
        pixels, grid = simulation.on_accelerator(pixels), simulation.on_accelerator(grid)
    if path == "compiled":
        torch._dynamo.decorators.mark_unbacked(pixels, 0)
        torch._dynamo.decorators.mark_unbacked(grid, 0)
        torch._dynamo.mark_dynamic(input_ids, 0)
    if path == "eager":  # the bare ViT through the functional wrapper
        call = fx_vitbal.dp_balance_vit_encoder
        embeds, _, deep = call(model.visual, pixels, grid, replica_group=replicas)
        (embeds.pow(2).sum() + deep[0].sum()).backward()
    else:
        with fullgraph_capture(path == "compiled"):
            model(input_ids, pixels, grid).pow(2).mean().backward()


def _steps(rank: int, world: int, path: str, replicas=None) -> list[dict]:
    """Four training steps of ``path`` on the simulated accelerator; what each one cost."""
    model = _model(path, replicas)
    group = dist.new_group(backend="gloo") if path == "ahead" else None
    if path == "compiled":  # compiled first: dynamo does not compile under a dispatch mode
        for step in range(4):
            _step(model, path, _batch(model, path, rank, step, group, replicas), None, replicas)
    graphs = dict(torch._dynamo.utils.counters["stats"])
    per_step = []
    for step in range(4):
        batch = _batch(model, path, rank, step, group, replicas)
        with simulated_accelerator(compiled=path == "compiled") as simulation:
            _step(model, path, batch, simulation, replicas)
        per_step.append(simulation.record)
    assert dict(torch._dynamo.utils.counters["stats"]) == graphs, "recompiled while counting"
    return per_step


PATHS = ["eager", "in_place", "fx", "ahead"] + (["compiled"] if UNBACKED_BATCH_SIZES else [])


def _every_path(rank: int, world: int, sets) -> dict[str, list[dict]]:
    replicas = None if sets is None else next(s for s in sets if rank in s)
    return {path: _steps(rank, world, path, replicas) for path in PATHS}


@pytest.fixture(scope="module", params=["own sets", "replica sets"])
def counted(request) -> list[dict[str, list[dict]]]:
    """Every path's steps, per rank: one group of processes for them all; each rank its own set
    (3 ranks), or 2 replica sets of 2 ranks (``replica_group``)."""
    if request.param == "own sets":
        return run_ranks(_every_path, len(GRIDS), None, timeout=600)
    return run_ranks(_every_path, 4, SETS, timeout=600)


@pytest.mark.parametrize(
    "path", [*PATHS[:4], pytest.param("compiled", marks=needs_unbacked_batch_sizes)]
)
def test_a_step_syncs_the_host_once_waits_once_and_issues_three_plus_two_collectives(path, counted):
    """The same with replica sets: the checksum of their pixels joins the one read."""
    for rank, by_path in enumerate(counted):
        for step, record in enumerate(by_path[path]):
            context = f"{path} rank {rank} step {step}: {record}"
            ahead = path == "ahead"
            first = step == 0 and path != "compiled"  # compiled: agreed while compiling
            # The gathered metadata is read once (none planned ahead), the padded grids of a
            # rank with many rows once more, and the first step reads the agreed layouts.
            gathers = 0 if ahead else 1 + (step == MANY_ROWS_STEP)
            assert len(record["syncs"]) == gathers + first, context
            files = {"metadata.py"} | ({"layouts.py"} if first else set())
            assert {r.split(":")[0] for r in record["syncs"]} <= files, context
            # The status words of the outputs, read once in restore's backward.
            assert len(record["waits"]) == 1 and "status.py" in record["waits"][0], context
            forward = [name for phase, name in record["collectives"] if phase == "forward"]
            expected = ["all_gather"] * gathers + ["all_to_all"]
            expected += (["all_gather"] if first else []) + ["all_to_all"]
            assert forward == expected, context
            backward = Counter(phase for phase, _ in record["collectives"])["backward"]
            assert backward == 1 + (step == PIXEL_GRADS_STEP), context


class _ShortWhenTold(QwenStyleViT):
    """The reference ViT, one output row short while ``short`` is set."""

    short = False

    def forward(self, pixel_values, image_grid_thw):
        embeds, window_index, deepstack = super().forward(pixel_values, image_grid_thw)
        return embeds[1:] if self.short else embeds, window_index, deepstack


def _eval_calls(rank: int, world: int) -> dict:
    """Three no-grad calls of a ViT balanced in eval mode (``when="always"``), sound, then the
    same with the second call one row short on rank 2."""
    torch.manual_seed(0)
    model = OmniEncoderModel(ViTConfig(deepstack_indexes=(0,)), LMConfig(num_layers=1))
    model.visual.__class__ = _ShortWhenTold
    config = fx_vitbal.BalanceConfig(when="always")
    model = fx_vitbal.enable_vit_balance(model, config=config).eval()
    input_ids, pixels, grid = make_inputs(GRIDS[rank], in_dim=24, seed=rank)
    runs = {}
    for bad_rank in (None, 2):
        records, error = [], None
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
        runs[bad_rank] = {"records": records, "error": error}
    return runs


@pytest.fixture(scope="module")
def eval_calls() -> list[dict]:
    return run_ranks(_eval_calls, len(GRIDS))


def test_a_no_grad_call_waits_for_nothing_and_the_next_call_reads_its_status_words(eval_calls):
    for rank, runs in enumerate(eval_calls):
        result = runs[None]
        first, *later = result["records"]
        context = f"rank {rank}: {result}"
        assert result["error"] is None and first["waits"] == [], context  # returns at once
        for record in later:  # the call before, read at this call's plan: already landed
            assert len(record["waits"]) == 1 and "status.py" in record["waits"][0], context
            assert len(record["syncs"]) == 1, context  # the gathered metadata


def test_a_bad_no_grad_output_raises_on_every_rank_at_the_next_call(eval_calls):
    errors = [runs[2]["error"] for runs in eval_calls]
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
