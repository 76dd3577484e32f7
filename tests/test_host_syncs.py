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
from fx_vitbal.runtime.agree.metadata import INLINE_GRID_ROWS
from fx_vitbal.runtime.transport.collectives import exchange_device, meta_device
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


# Paths past the five above, run in the world of own sets: each its own way in, 3 steps.
EXTRA_PATHS = ["none", "windowed", "online", "bf16", "gloo", "bands"]
# The bands path: rank 0's 16x12 frame split across the 3 ranks (rank 2 text-only) on every
# step; its keys and values are exchanged in each of the tower's 2 layers, forward (one batch)
# and backward (the 2 other blocks fetched one a step, each block's gradients home a step
# later: 4 batches).
BANDS = fx_vitbal.BalanceConfig(cost_model="quadratic", min_band_patches=32)
BAND_LAYERS, BAND_BACKWARD_BATCHES = 2, 4
HF_PATHS = {"qwen2_5_vl": "Qwen2.5-VL (windowed)", "qwen3_vl": "Qwen3-VL", "glm4v": "GLM-4V"}
HF_RUN = [f"hf_{family}" for family in HF_PATHS]
# Per rank, (images, videos) of the Hugging Face paths; GLM samples hold one kind only.
HF_BATCHES = [([(1, 16, 12), (1, 8, 8)], [(2, 8, 8)]), ([(1, 4, 4)], []), ([], [])]
GLM_BATCHES = [([], [(2, 8, 8)]), ([(1, 16, 12), (1, 8, 8)], []), ([], [])]


def _model(path: str, replicas=None):
    torch.manual_seed(0)
    window = dict(window_size=2, fullatt_block_indexes=(1,)) if path == "windowed" else {}
    model = OmniEncoderModel(ViTConfig(deepstack_indexes=(0,), **window), LMConfig(num_layers=1))
    if path == "bf16":
        model = model.to(torch.bfloat16)
    if path == "fx":
        return apply_vit_balance_pass(symbolic_trace(model), replica_group=replicas)
    if path == "compiled":  # one graph for every step (its layouts agreed while compiling)
        model = fx_vitbal.enable_vit_balance(model, replica_group=replicas)
        return torch.compile(model, backend="vitbal", options=ONE_GRAPH, fullgraph=True)
    if path == "bands":
        return fx_vitbal.enable_vit_balance(model, config=BANDS)
    if path not in ("eager", "none"):
        config = fx_vitbal.BalanceConfig(cost_model="online" if path == "online" else "auto")
        return fx_vitbal.enable_vit_balance(model, config=config, replica_group=replicas)
    return model


ONE_GRAPH = {"inner": "aot_eager"}


def _batch(model, path: str, rank: int, step: int, group, replicas=None):
    """The step's inputs, its plan handed over first when planned ahead."""
    seed = rank if replicas is None else replicas[0]  # a set's ranks hold the same pixels
    dtype = torch.bfloat16 if path == "bf16" else torch.float32
    input_ids, pixels, grid = make_inputs(
        _grids(rank, step, replicas), in_dim=24, seed=seed, dtype=dtype
    )
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
        input_ids = simulation.on_accelerator(input_ids)
        if path != "none":  # there: the parameters offloaded to the host (FSDP2 CPU offload)
            simulation.place(model)
    if path == "compiled":
        torch._dynamo.decorators.mark_unbacked(pixels, 0)
        torch._dynamo.decorators.mark_unbacked(grid, 0)
        torch._dynamo.mark_dynamic(input_ids, 0)
    if path in ("eager", "none"):  # the bare ViT through the functional wrapper
        if path == "none" and not pixels.shape[0]:  # a rank without images passes None
            pixels, grid = None, None
        call = fx_vitbal.dp_balance_vit_encoder
        embeds, _, deep = call(model.visual, pixels, grid, replica_group=replicas)
        (embeds.pow(2).sum() + deep[0].sum()).backward()
    else:
        with fullgraph_capture(path == "compiled"):
            model(input_ids, pixels, grid).float().pow(2).mean().backward()


def _steps(rank: int, world: int, path: str, replicas=None) -> list[dict]:
    """Training steps of ``path`` on the simulated accelerator; what each one cost."""
    model = _model(path, replicas)
    group = dist.new_group(backend="gloo") if path == "ahead" else None
    if path == "compiled":  # compiled first: dynamo does not compile under a dispatch mode
        for step in range(4):
            _step(model, path, _batch(model, path, rank, step, group, replicas), None, replicas)
    graphs = dict(torch._dynamo.utils.counters["stats"])
    stats = []
    handle = fx_vitbal.add_stats_callback(stats.append) if path == "online" else None
    per_step = []
    for step in range(4 if path in PATHS else 3):
        batch = _batch(model, path, rank, step, group, replicas)
        with simulated_accelerator(path == "compiled", path == "gloo") as simulation:
            _step(model, path, batch, simulation, replicas)
        per_step.append(simulation.record)
    if handle is not None:
        handle.remove()
        assert len(stats) == 3 and stats[-1].measured_seconds is not None, stats
    assert dict(torch._dynamo.utils.counters["stats"]) == graphs, "recompiled while counting"
    return per_step


def _plan_ahead(rank: int) -> list[dict]:
    """``plan_ahead`` itself, on the data thread, with the batch already on the device."""
    model = _model("ahead")
    group = dist.new_group(backend="gloo")
    per_step = []
    for step in range(3):
        _, pixels, grid = make_inputs(_grids(rank, step), in_dim=24, seed=rank)
        with simulated_accelerator(gloo=True) as simulation:
            pixels, grid = simulation.on_accelerator(pixels), simulation.on_accelerator(grid)
            fx_vitbal.plan_ahead(model.visual, pixels, grid, group=group)
        per_step.append(simulation.record)
    return per_step


def _hf_steps(rank: int, family: str) -> list[dict]:
    """A Hugging Face VLM of ``family`` (``tests/hf_zoo``), images and a video, balanced."""
    import importlib

    zoo = importlib.import_module(f"hf_zoo.{family}")
    model = fx_vitbal.enable_vit_balance(zoo.build())
    images, videos = (GLM_BATCHES if family == "glm4v" else HF_BATCHES)[rank]
    per_step = []
    for step in range(3):
        batch = zoo.batch(model, images, videos, seed=10 * step + rank)
        with simulated_accelerator() as simulation:
            batch = {k: simulation.on_accelerator(v) for k, v in batch.items()}
            simulation.place(model)
            model(**batch).loss.backward()
        per_step.append(simulation.record)
    return per_step


PATHS = ["eager", "in_place", "fx", "ahead"] + (["compiled"] if UNBACKED_BATCH_SIZES else [])


def _every_path(rank: int, world: int, sets) -> dict[str, list[dict]]:
    replicas = None if sets is None else next(s for s in sets if rank in s)
    counted = {path: _steps(rank, world, path, replicas) for path in PATHS}
    if sets is None:  # the paths past the five, in the world of own sets
        counted |= {path: _steps(rank, world, path) for path in EXTRA_PATHS}
        counted["plan_ahead"] = _plan_ahead(rank)
        counted |= {f"hf_{family}": _hf_steps(rank, family) for family in HF_PATHS}
    return counted


@pytest.fixture(scope="module")
def own_sets() -> list[dict[str, list[dict]]]:
    """Every path's steps, per rank, each rank its own set: one group of 3 processes for all."""
    return run_ranks(_every_path, len(GRIDS), None, timeout=900)


@pytest.fixture(scope="module", params=["own sets", "replica sets"])
def counted(request) -> list[dict[str, list[dict]]]:
    """The five paths' steps, per rank: each rank its own set (3 ranks), or 2 replica sets of
    2 ranks (``replica_group``)."""
    if request.param == "own sets":
        return request.getfixturevalue("own_sets")
    return run_ranks(_every_path, 4, SETS, timeout=600)


def _check_step(path: str, rank: int, step: int, record: dict, first: bool) -> None:
    """One step's cost: the library reads the gathered metadata once (none planned ahead; the
    padded grids of a rank with many rows once more; the first step also reads the agreed
    layouts, unless gathered on the host), waits once (the outputs' status words, in restore's
    backward), mixes no host tensor with device tensors, and issues gather + 2 exchanges
    forward, 1 backward (+1 with pixel gradients: ``_batch``'s steps); on a split step, one
    batch of point-to-point messages more in the backward where a rank moves pixels (fetched
    again, ``runtime.transport.refetch``)."""
    context = f"{path} rank {rank} step {step}: {record}"
    ahead = path == "ahead"
    gathers = 0 if ahead else 1 + (step == MANY_ROWS_STEP)
    assert len(record["syncs"]) == gathers + (first and path != "gloo"), context
    files = {"metadata.py"} | ({"layouts.py"} if first else set())
    assert {r.split(":")[0] for r in record["syncs"]} <= files, context
    assert len(record["waits"]) == 1 and "status.py" in record["waits"][0], context
    assert record["mixed"] == [], context
    # A band's keys and values move among its frame's ranks only (point to point: one batch a
    # layer forward, ``BAND_BACKWARD_BATCHES`` backward); a rank without a band sends none.
    bands = record["collectives"].count(("forward", "p2p"))
    assert bands in ((0, BAND_LAYERS) if path == "bands" else (0,)), context
    # A split step's pixels come again point to point: one batch on a rank that moves any.
    backward_p2p = record["collectives"].count(("backward", "p2p"))
    refetch = backward_p2p - BAND_BACKWARD_BATCHES * bands
    assert refetch in ((0, 1) if path == "bands" else (0,)), context
    forward = [n for phase, n in record["collectives"] if phase == "forward" and n != "p2p"]
    expected = ["all_gather"] * gathers + ["all_to_all"]
    expected += (["all_gather"] if first else []) + ["all_to_all"]
    assert forward == expected, context
    backward = Counter(p for p, n in record["collectives"] if n != "p2p")["backward"]
    pixel_grads = step == PIXEL_GRADS_STEP and not path.startswith("hf_")
    assert backward == 1 + pixel_grads, context


@pytest.mark.parametrize(
    "path", [*PATHS[:4], pytest.param("compiled", marks=needs_unbacked_batch_sizes)]
)
def test_a_step_syncs_the_host_once_waits_once_and_issues_three_plus_two_collectives(path, counted):
    """The same with replica sets: the checksum of their pixels joins the one read."""
    for rank, by_path in enumerate(counted):
        for step, record in enumerate(by_path[path]):
            _check_step(path, rank, step, record, first=step == 0 and path != "compiled")


@pytest.mark.parametrize("path", EXTRA_PATHS + HF_RUN)
def test_every_other_way_in_costs_the_library_the_same(path, own_sets):
    """A rank passing None while the ViT's parameters are offloaded to the host (its stand-in
    pixels are made where the exchanges run, not beside the parameters), a windowed ViT (its
    window index regenerated from the plan's host copy of the grid), online costs with a stats
    callback, bf16 pixels, a group that gathers on the host (``cpu:gloo,cuda:nccl``) with the
    batch on the device, a frame split into bands on every step (rank 2 text-only: its bands'
    ranks exchange keys and values among themselves in every layer, the others nothing), and
    Hugging Face VLMs (images and a video; the
    parent's feature code replayed): one read, one wait, the same collectives, no host tensor
    in a device op."""
    for rank, by_path in enumerate(own_sets):
        for step, record in enumerate(by_path[path]):
            _check_step(path, rank, step, record, first=step == 0)
    if path == "bands":  # every step split the frame: some ranks exchanged its keys and values
        for step in range(len(own_sets[0][path])):
            exchanged = [
                ("forward", "p2p") in by_path[path][step]["collectives"] for by_path in own_sets
            ]
            assert sum(exchanged) >= 2, (step, exchanged)


# What the model's own code (the ViT, the tower, the parent) reads on the host in a steady step,
# per rank (rank 2 has no images): counted apart from the library's, shown in
# docs/guarantees.md. The reference ViT finds its attention segments on the host (2 reads) and
# its windows from the balanced grid. A Hugging Face tower that runs bands gets every
# grid-derived input from the plan's host copy and reads nothing; its parent still reads its
# grids (feature splits, the rope index). Compiled graphs are not followed inside (0).
MODEL_SYNCS = {
    "eager": [2, 2, 2],
    "in_place": [2, 2, 2],
    "fx": [2, 2, 2],
    "ahead": [2, 2, 2],
    "compiled": [0, 0, 0],
    "none": [2, 2, 2],
    "windowed": [7, 11, 7],
    "online": [2, 2, 2],
    "bf16": [2, 2, 2],
    "gloo": [2, 2, 2],
    "bands": [2, 2, 2],
    "hf_qwen2_5_vl": [25, 14, 6],
    "hf_qwen3_vl": [54, 24, 16],
    "hf_glm4v": [20, 18, 6],
}


@pytest.mark.parametrize("path", [p for p in MODEL_SYNCS if p in PATHS + EXTRA_PATHS + HF_RUN])
def test_the_models_own_reads_are_counted_apart_from_the_librarys(path, own_sets):
    for rank, by_path in enumerate(own_sets):
        steady = [len(record["model_syncs"]) for record in by_path[path][1:]]
        assert steady == [MODEL_SYNCS[path][rank]] * len(steady), (path, rank, by_path[path][1])
        assert all(record["model_waits"] == [] for record in by_path[path]), path


def test_plan_ahead_reads_a_device_grid_once_and_no_pixel(own_sets):
    for by_path in own_sets:
        for record in by_path["plan_ahead"]:
            assert [r.split(":")[0] for r in record["syncs"]] == ["metadata.py"], record
            assert record["waits"] == record["mixed"] == [], record
            assert [name for _, name in record["collectives"]] == ["all_gather"], record


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


class _FakeCuda:
    """A CUDA module whose device was (not) selected yet."""

    def __init__(self, initialized: bool) -> None:
        self.initialized = initialized

    def is_initialized(self) -> bool:
        return self.initialized


def test_exchanges_without_a_tensor_run_on_the_selected_device_or_rank_modulo_devices(
    monkeypatch, caplog
):
    """Where a rank without images makes its stand-ins (and a host batch its metadata): the
    group's bound device; gloo alone: the host; else the current device once one was selected,
    and before that global rank modulo the devices on the host (as DeviceMesh and NCCL pick
    it), with a warning, instead of device 0 on every rank."""
    group = types.SimpleNamespace(group_name="g", bound_device_id=None)
    backends = {"g": "nccl"}
    cuda = _FakeCuda(initialized=False)
    monkeypatch.setattr(dist, "get_backend", lambda g: backends[g.group_name])
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 6)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 4)
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    monkeypatch.setattr(torch, "get_device_module", lambda kind: cuda)
    with caplog.at_level("WARNING"):
        assert exchange_device(group) == torch.device("cuda", 2)  # rank 6 of 4 per host
    assert "no cuda device was selected" in caplog.text and "cuda:2" in caplog.text
    cuda.initialized = True  # torch.cuda.set_device (or any use) selected one
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 1)
    assert exchange_device(group) == torch.device("cuda", 1)
    assert meta_device(group, torch.device("cpu")) == torch.device("cuda", 1)
    backends["g"] = "cpu:gloo,cuda:nccl"  # exchanges on the device, metadata on the host
    assert exchange_device(group) == torch.device("cuda", 1)
    assert meta_device(group, torch.device("cpu")) == torch.device("cpu")
    backends["g"] = "gloo"  # host tensors only
    assert exchange_device(group) == torch.device("cpu")
    group.bound_device_id = torch.device("cuda", 3)
    assert exchange_device(group) == torch.device("cuda", 3)
