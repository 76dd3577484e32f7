"""Hugging Face towers and parents: balanced runs equal unbalanced ones (2 gloo ranks).

Tiny random models (no downloads). Each spawn builds several families, so the whole file costs
two spawns plus one transformers import here.
"""

import importlib
import subprocess
import sys
import types
import warnings

import pytest
import torch
import torch.distributed as dist
from dist_utils import assert_units_moved, record_collectives, record_moves, run_ranks
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.parallel import DistributedDataParallel

transformers = pytest.importorskip("transformers")

import fx_vitbal  # noqa: E402
from fx_vitbal.config import BalanceConfig  # noqa: E402
from fx_vitbal.cost import ArchitectureCost  # noqa: E402
from fx_vitbal.integrations import hf, hf_towers  # noqa: E402
from fx_vitbal.integrations.hf_inputs import STRIPS  # noqa: E402
from fx_vitbal.runtime.vit import registry as vits  # noqa: E402
from fx_vitbal.runtime.vit.settings import parse_planner_spec  # noqa: E402

TEXT = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)
TOKENS = dict(
    image_token_id=120, video_token_id=121, vision_start_token_id=122, vision_end_token_id=123
)
QWEN2_VISION = dict(depth=2, embed_dim=64, hidden_size=64, num_heads=4, mlp_ratio=2)
QWEN25_VISION = dict(
    depth=4,
    hidden_size=64,
    intermediate_size=128,
    num_heads=4,
    out_hidden_size=64,
    fullatt_block_indexes=[1, 3],
    window_size=112,
)
QWEN35_VISION = dict(
    depth=4,
    hidden_size=64,
    intermediate_size=128,
    num_heads=4,
    out_hidden_size=64,
    num_position_embeddings=144,
)
QWEN3_VISION = dict(QWEN35_VISION, deepstack_visual_indexes=[0, 2])
GLM_VISION = dict(
    depth=2, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=64, image_size=112
)
MROPE = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
# family -> (config class, model class, vision config, extra text config)
PARENTS = {
    "qwen2_vl": (
        "Qwen2VLConfig",
        "Qwen2VLForConditionalGeneration",
        QWEN2_VISION,
        {"rope_parameters": MROPE},
    ),
    "qwen2_5_vl": (
        "Qwen2_5_VLConfig",
        "Qwen2_5_VLForConditionalGeneration",
        QWEN25_VISION,
        {"rope_parameters": MROPE},
    ),
    "qwen3_vl": (
        "Qwen3VLConfig",
        "Qwen3VLForConditionalGeneration",
        QWEN3_VISION,
        {"rope_parameters": {**MROPE, "mrope_interleaved": True}},
    ),
    "glm4v": (
        "Glm4vConfig",
        "Glm4vForConditionalGeneration",
        GLM_VISION,
        {"rope_parameters": {**MROPE, "mrope_section": [1, 1, 2], "partial_rotary_factor": 0.5}},
    ),
    "qwen3_5": (
        "Qwen3_5Config",
        "Qwen3_5ForConditionalGeneration",
        QWEN35_VISION,
        {
            "layer_types": ["linear_attention", "full_attention"],
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "rope_parameters": {**MROPE, "mrope_interleaved": True, "partial_rotary_factor": 1.0},
        },
    ),
}
# Families whose chat template wraps every video frame in its own vision_start/end group.
PER_FRAME_TOKENS = {"qwen3_vl", "qwen3_5", "glm4v"}
# (image grids, video grids) per step and rank. Step 0: skewed, rank 1 a thumbnail (GLM: a
# 2-frame video, since GLM cannot mix images and videos in one sample); step 1: rank 1 text-only
# while rank 0 is heavy (it must take over work and still run backward's collective); step 2:
# text-only everywhere. Sizes include non-multiples of Qwen2.5's 8x8-patch window.
STEPS = [
    [([[1, 16, 12], [1, 6, 10]], [[2, 4, 6]]), ([[1, 2, 2]], [])],
    [([[1, 10, 14], [1, 4, 6], [1, 2, 4]], [[2, 4, 4]]), ([], [])],
    [([], []), ([], [])],
]


def build_parent(family: str):
    config_cls, model_cls, vision, text = PARENTS[family]
    config = getattr(transformers, config_cls)(
        vision_config=vision, text_config={**TEXT, **text}, **TOKENS
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)  # identical weights on every rank and in both runs
    return getattr(transformers, model_cls)(config).float().train()


def make_batch(family: str, rank: int, step: int, width: int) -> dict:
    images, videos = STEPS[step][rank]
    if family == "glm4v" and (step, rank) == (0, 1):
        images, videos = [], [[2, 4, 4]]
    if family == "glm4v" and images:
        videos = []  # GLM counts video frames as image tokens: one modality per sample
    ids, types = [5, 6], [0, 0]
    for grid in images:
        n = grid[0] * grid[1] * grid[2] // 4
        ids += [122] + [120] * n + [123, 7]
        types += [0] + [1] * n + [0, 0]
    video_token = 120 if family == "glm4v" else 121
    for t, h, w in videos:
        for n in [h * w // 4] * t if family in PER_FRAME_TOKENS else [t * h * w // 4]:
            ids += [8, 122] + [video_token] * n + [123]
            types += [0, 0] + [2] * n + [0]
    ids += [9, 10, 11]
    types += [0, 0, 0]
    batch = {
        # The LM's hidden states stay available (the balanced tower returns none of its own).
        "output_hidden_states": step == 0,
        "input_ids": torch.tensor([ids]),
        "mm_token_type_ids": torch.tensor([types]),
        "labels": torch.tensor([ids]),
    }
    generator = torch.Generator().manual_seed(100 * step + rank)
    for grids, pixels_key, grid_key in (
        (images, "pixel_values", "image_grid_thw"),
        (videos, "pixel_values_videos", "video_grid_thw"),
    ):
        if grids:
            rows = sum(t * h * w for t, h, w in grids)
            batch[pixels_key] = torch.randn(rows, width, generator=generator)
            batch[grid_key] = torch.tensor(grids)
    return batch


def _pixel_width(tower) -> int:
    c = tower.config
    return c.in_channels * c.temporal_patch_size * c.patch_size**2


def _all_reduced_grads(model: torch.nn.Module) -> torch.Tensor:
    grads = [
        p.grad.flatten() if p.grad is not None else torch.zeros(p.numel())
        for p in model.parameters()
    ]
    flat = torch.cat(grads)
    dist.all_reduce(flat)
    return flat


def _train_step(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    return out.logits.detach(), _all_reduced_grads(model)


def _parents_balanced_vs_local(rank: int, world: int, families: list) -> dict:
    results = {}
    for family in families:
        model = build_parent(family)
        tower = model.get_encoder(modality="image")
        keys = list(model.state_dict())
        batches = [make_batch(family, rank, s, _pixel_width(tower)) for s in range(len(STEPS))]
        reference = [_train_step(model, batch) for batch in batches]
        hf.enable_hf_vit_balance(model)
        hf.enable_hf_vit_balance(model)  # idempotent
        computed_rows = []
        tower.patch_embed.register_forward_pre_hook(
            lambda module, args, rows=computed_rows: rows.append(args[0].shape[0])
        )
        balanced = [_train_step(model, batch) for batch in batches]
        local_rows = [
            sum(b[k].shape[0] for k in ("pixel_values", "pixel_values_videos") if k in b)
            for b in batches
        ]
        results[family] = {
            "width": _pixel_width(tower),
            "reference": reference,
            "balanced": balanced,
            "computed_rows": computed_rows,
            "local_rows": local_rows,
            "same_keys": keys == list(model.state_dict()),
        }
    # The same through DDP (and a balancing group of its own): the wrapper is seen through.
    family = families[0]
    ddp = DistributedDataParallel(build_parent(family))
    fx_vitbal.enable_vit_balance(ddp, group=dist.new_group())
    batches = [make_batch(family, rank, s, results[family]["width"]) for s in range(len(STEPS))]
    with record_moves() as moves:
        results["ddp"] = {"balanced": [_train_step(ddp, batch) for batch in batches]}
    results["ddp"]["moves"] = moves
    return results


def test_parents_balanced_equal_unbalanced_logits_and_gradients():
    families = list(PARENTS)
    results = run_ranks(_parents_balanced_vs_local, 2, families)
    for family in families:
        for rank, res in enumerate(r[family] for r in results):
            assert res["same_keys"], family
            for step, (got, want) in enumerate(zip(res["balanced"], res["reference"], strict=True)):
                msg = f"{family} rank {rank} step {step}"
                torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5, msg=msg)
                torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5, msg=msg)
            # One tower call per step on every rank, text-only steps included.
            assert len(res["computed_rows"]) == len(STEPS), family
        rows = [r[family]["computed_rows"] for r in results]
        local = [r[family]["local_rows"] for r in results]
        # Images really moved: at step 0 the thumbnail rank computed more than its own rows, and
        # at step 1 the text-only rank computed some of rank 0's images (not just the 4-row dummy).
        assert rows[1][0] > local[1][0], (family, rows, local)
        assert rows[1][1] > 4 and rows[0][1] < local[0][1], (family, rows, local)
    for rank, res in enumerate(results):  # DDP(model): DDP's mean gradients, all-reduced
        want = res[families[0]]["reference"]
        for step, (got, wanted) in enumerate(zip(res["ddp"]["balanced"], want, strict=True)):
            msg = f"ddp rank {rank} step {step}"
            torch.testing.assert_close(got[0], wanted[0], rtol=1e-5, atol=1e-5, msg=msg)
            torch.testing.assert_close(got[1], wanted[1], rtol=1e-5, atol=1e-5, msg=msg)
    assert_units_moved([res["ddp"] for res in results])


SIBLINGS = {
    "qwen2_5_omni.modeling_qwen2_5_omni.Qwen2_5OmniVisionEncoder": (
        "qwen2_5_omni.configuration_qwen2_5_omni.Qwen2_5OmniVisionEncoderConfig",
        QWEN25_VISION,
    ),
    "qwen3_vl_moe.modeling_qwen3_vl_moe.Qwen3VLMoeVisionModel": (
        "qwen3_vl_moe.configuration_qwen3_vl_moe.Qwen3VLMoeVisionConfig",
        QWEN3_VISION,
    ),
    "qwen3_omni_moe.modeling_qwen3_omni_moe.Qwen3OmniMoeVisionEncoder": (
        "qwen3_omni_moe.configuration_qwen3_omni_moe.Qwen3OmniMoeVisionEncoderConfig",
        QWEN3_VISION,
    ),
    "qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeVisionModel": (
        "qwen3_5_moe.configuration_qwen3_5_moe.Qwen3_5MoeVisionConfig",
        QWEN35_VISION,
    ),
    "glm4v_moe.modeling_glm4v_moe.Glm4vMoeVisionModel": (
        "glm4v_moe.configuration_glm4v_moe.Glm4vMoeVisionConfig",
        GLM_VISION,
    ),
    "glm_ocr.modeling_glm_ocr.GlmOcrVisionModel": (
        "glm_ocr.configuration_glm_ocr.GlmOcrVisionConfig",
        GLM_VISION,
    ),
}
TOWER_GRIDS = [[[1, 16, 12], [1, 2, 2], [1, 6, 10], [1, 10, 14]], []]


def _plan_ahead(model, batch: dict, group):
    return fx_vitbal.plan_ahead(
        model,
        batch.get("pixel_values"),
        batch.get("image_grid_thw"),
        pixel_values_videos=batch.get("pixel_values_videos"),
        video_grid_thw=batch.get("video_grid_thw"),
        group=group,
    )


def _parents_planned_ahead(rank: int, world: int, families: list) -> dict:
    plan_group = dist.new_group(backend="gloo")
    results = {}
    for family in families:
        model = build_parent(family)
        width = _pixel_width(model.get_encoder(modality="image"))
        batches = [make_batch(family, rank, s, width) for s in range(2)]
        reference = [_train_step(model, batch) for batch in batches]
        fx_vitbal.enable_vit_balance(model)
        steps = []
        for batch in batches:  # the parent's images and videos, planned as its tower sees them
            fx_vitbal.use_plan(model, _plan_ahead(model, batch, plan_group))
            with record_collectives() as issued, record_moves() as moves:
                got = _train_step(model, batch)
            forward = [name for phase, name, _, _ in issued if phase == "forward"]
            steps.append({"got": got, "forward": forward, "moves": moves})
        # A batch that differs from its plan on rank 1 (rank 0's batch): every rank raises.
        planned = fx_vitbal.plan_ahead(
            model,
            batches[1].get("pixel_values"),
            batches[1].get("image_grid_thw"),
            group=plan_group,
        )
        fx_vitbal.use_plan(model, planned)
        try:
            _train_step(model, make_batch(family, 0, 1, width) if rank == 1 else batches[1])
            error = None
        except ValueError as caught:
            error = str(caught)
        results[family] = {"reference": reference, "steps": steps, "error": error}
    return results


def test_a_parents_images_and_videos_planned_ahead_train_exactly_without_a_metadata_gather():
    families = ["qwen2_vl", "glm4v"]  # GLM feeds its tower one-frame video rows
    results = run_ranks(_parents_planned_ahead, 2, families)
    for family in families:
        for rank, res in enumerate(r[family] for r in results):
            for step, (got, want) in enumerate(
                zip([s["got"] for s in res["steps"]], res["reference"], strict=True)
            ):
                msg = f"{family} rank {rank} step {step}"
                torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5, msg=msg)
                torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5, msg=msg)
            # The pixels out and the outputs home, no metadata gather (the group's first step
            # also agrees on the output layouts).
            for step, planned in enumerate(res["steps"]):
                expected = ["all_to_all"] + ["all_gather"] * (step == 0) + ["all_to_all"]
                assert planned["forward"] == expected, (family, rank, step, planned["forward"])
        errors = {r[family]["error"] for r in results}
        assert len(errors) == 1 and None not in errors, errors
        assert "not the batch planned ahead" in errors.pop()
        assert_units_moved([s for r in results for s in r[family]["steps"]])


def _load(path: str):
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(f"transformers.models.{module}"), name)


def build_tower(path: str):
    config_path, vision = SIBLINGS[path]
    config = _load(config_path)(**vision)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return _load(path)(config).float().train()


def _tower_loss(out) -> torch.Tensor:
    outputs = [out.pooler_output, *(out.get("deepstack_features") or ())]
    return sum((x * torch.linspace(-1, 1, x.numel()).view_as(x)).sum() for x in outputs)


def _towers_balanced_vs_local(rank: int, world: int, paths: list) -> dict:
    results = {}
    grids = TOWER_GRIDS[rank]
    for path in paths:
        tower = build_tower(path)
        width = _pixel_width(tower)
        rows = sum(t * h * w for t, h, w in grids)
        pixels = torch.randn(rows, width, generator=torch.Generator().manual_seed(rank))
        grid = torch.tensor(grids, dtype=torch.long).reshape(-1, 3)
        want = None
        if grids:  # HF towers cannot run on zero rows; the balanced one can
            want = tower(pixels, grid_thw=grid)
            _tower_loss(want).backward()
        want_grads = _all_reduced_grads(tower)
        hf.enable_hf_vit_balance(tower)
        with pytest.raises(ValueError, match="output_hidden_states"):
            tower(pixels, grid_thw=grid, output_hidden_states=True)
        tower.zero_grad(set_to_none=True)
        seen = []
        tower.patch_embed.register_forward_pre_hook(
            lambda m, a, rows=seen: rows.append(a[0].shape[0])
        )
        got = tower(pixels, grid_thw=grid, cu_seqlens=torch.tensor([0, 1]))  # stale: dropped
        _tower_loss(got).backward()
        as_tuple = tower(pixels, grid_thw=grid, return_dict=False)
        results[path] = {
            "got": [got.pooler_output.detach(), *(got.get("deepstack_features") or ())],
            "want": None
            if want is None
            else [want.pooler_output.detach()] + list(want.get("deepstack_features") or ()),
            "grads": (_all_reduced_grads(tower), want_grads),
            "type": (type(got).__name__, type(want).__name__ if want is not None else None),
            "last_hidden_state": got.last_hidden_state,
            "tuple_head": as_tuple[0],
            "tuple_pooler": as_tuple[1].detach(),
            "seen": seen[0],
            "rows": rows,
        }
    return results


def test_sibling_towers_balanced_equal_unbalanced():
    paths = list(SIBLINGS)
    results = run_ranks(_towers_balanced_vs_local, 2, paths)
    for path in paths:
        home, empty = results[0][path], results[1][path]
        for got, want in zip(home["got"], home["want"], strict=True):
            torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(home["tuple_pooler"], home["want"][0], rtol=1e-5, atol=1e-5)
        assert home["tuple_head"] is None and home["last_hidden_state"] is None
        assert home["type"][0] == home["type"][1], path
        assert all(x.shape[0] == 0 for x in empty["got"]), path
        for res in (home, empty):
            torch.testing.assert_close(*res["grads"], rtol=1e-5, atol=1e-5, msg=path)
        assert empty["seen"] > 0 and home["seen"] < home["rows"], path  # the empty rank worked


def test_a_refused_tower_and_unknown_towers_raise():
    video_llama = pytest.importorskip("transformers.models.video_llama_3.modeling_video_llama_3")
    config = video_llama.VideoLlama3VisionConfig(
        num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64
    )
    with pytest.raises(TypeError, match="VideoLlama3VisionModel cannot be balanced: .*per-unit"):
        hf.enable_hf_vit_balance(video_llama.VideoLlama3VisionModel(config))
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**{k: v for k, v in TEXT.items() if k != "head_dim"})
    )
    with pytest.raises(
        TypeError,
        match="LlamaForCausalLM is not a known Hugging Face vision tower.*register_hf_tower",
    ):
        hf.enable_hf_vit_balance(llama)
    with pytest.raises(TypeError, match="not a known Hugging Face vision tower"):
        hf.enable_hf_vit_balance(torch.nn.Linear(2, 2))
    # A wrapper's subclass (FSDP2's FSDP<name>) keeps its tower's rule; another family's
    # transformers tower that subclasses it does not inherit it (it may compute differently).
    qwen2 = importlib.import_module("transformers.models.qwen2_vl.modeling_qwen2_vl")
    tower_cls = qwen2.Qwen2VisionTransformerPretrainedModel
    wrapped = type("FSDPQwen2Tower", (tower_cls,), {"__module__": "torch.distributed.fsdp"})
    assert hf_towers.hf_tower_rule(wrapped) is hf_towers.SHIPPED_RULES[tower_cls.__name__]
    other = type("OtherTower", (tower_cls,), {"__module__": "transformers.models.other.modeling"})
    with pytest.raises(TypeError, match="OtherTower is not a known Hugging Face vision tower"):
        hf_towers.hf_tower_rule(other)


def test_an_unknown_tower_works_once_registered_with_register_hf_tower(monkeypatch):
    qwen2 = importlib.import_module("transformers.models.qwen2_vl.modeling_qwen2_vl")
    tower_cls = qwen2.Qwen2VisionTransformerPretrainedModel
    monkeypatch.delitem(hf_towers.SHIPPED_RULES, tower_cls.__name__)  # as a tower nobody knew
    model = build_parent("qwen2_vl")
    batch = make_batch("qwen2_vl", 0, 0, _pixel_width(model.get_encoder(modality="image")))
    want = model(**batch).logits
    with pytest.raises(TypeError, match="not a known Hugging Face vision tower.*register_hf_tower"):
        fx_vitbal.enable_vit_balance(model)
    monkeypatch.setitem(hf_towers._BY_CLASS, tower_cls, None)  # restored after the test
    fx_vitbal.register_hf_tower(
        tower_cls, dims=lambda c: (c.embed_dim, 2 * c.embed_dim, c.hidden_size)
    )
    fx_vitbal.enable_vit_balance(model)
    tower = model.get_encoder(modality="image")
    assert tower._vitbal_hf.rule.family == tower_cls.__name__
    assert not tower._vitbal_hf.rule.frames_independent  # the safe default: clips move whole
    torch.testing.assert_close(model(**batch).logits, want, rtol=0, atol=0)


def test_a_tower_declared_with_register_vision_encoder_is_told_to_use_register_hf_tower(
    monkeypatch,
):
    qwen2 = importlib.import_module("transformers.models.qwen2_vl.modeling_qwen2_vl")
    tower_cls = qwen2.Qwen2VisionTransformerPretrainedModel
    monkeypatch.delitem(hf_towers.SHIPPED_RULES, tower_cls.__name__)
    monkeypatch.setitem(vits._REGISTRY, tower_cls, None)  # restored after the test
    fx_vitbal.register_vision_encoder(tower_cls, frame_independent=True)
    with pytest.raises(TypeError, match="declared with register_vision_encoder.*register_hf_tower"):
        fx_vitbal.enable_vit_balance(build_parent("qwen2_vl"))


def test_a_feature_method_that_cannot_be_replayed_raises_instead_of_being_bypassed():
    model = build_parent("qwen2_vl")
    batch = make_batch("qwen2_vl", 0, 0, _pixel_width(model.get_encoder(modality="image")))
    fx_vitbal.enable_vit_balance(model)
    parent, tower = model.model, model.model.visual
    original = parent.get_image_features

    def without_the_tower(pixel_values, image_grid_thw, **kwargs):
        return tower._vitbal_original_forward(pixel_values, grid_thw=image_grid_thw)

    parent.get_image_features = without_the_tower
    with pytest.raises(RuntimeError, match="never called its vision tower"):
        model(**batch)

    def twice(pixel_values, image_grid_thw, **kwargs):
        tower(pixel_values, grid_thw=image_grid_thw)
        return original(pixel_values, image_grid_thw, **kwargs)

    parent.get_image_features = twice
    with pytest.raises(RuntimeError, match="called Qwen2VisionTransformerPretrainedModel twice"):
        model(**batch)
    del parent.get_image_features  # the class's own method again: the replay is exact
    assert "_vitbal_replay" not in vars(tower)  # nothing left over from the failed calls
    model(**batch)


def test_vit_names_a_hugging_face_tower():
    model = build_parent("qwen2_vl")
    batch = make_batch("qwen2_vl", 0, 0, _pixel_width(model.get_encoder(modality="image")))
    want = model(**batch).logits
    fx_vitbal.enable_vit_balance(model, vit="model.visual")
    assert model.model.visual._vitbal_hf.rule.family == "Qwen2-VL"
    torch.testing.assert_close(model(**batch).logits, want, rtol=0, atol=0)
    with pytest.raises(TypeError, match="Qwen2VLTextModel is not a known Hugging Face vision"):
        fx_vitbal.enable_vit_balance(build_parent("qwen2_vl"), vit="model.language_model")


def test_check_vision_encoder_checks_a_hugging_face_tower_through_its_rule():
    qwen3 = build_parent("qwen3_vl").get_encoder(modality="image").eval()
    report = fx_vitbal.check_vision_encoder(qwen3)  # width, merge size, frames: from the rule
    assert report.ok and report.frame_independent, str(report)
    assert report.layouts == {
        "embeddings": "merged",
        "deepstack[0]": "merged",
        "deepstack[1]": "merged",
    }
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**{k: v for k, v in TEXT.items() if k != "head_dim"})
    )
    with pytest.raises(TypeError, match="register_hf_tower"):
        fx_vitbal.check_vision_encoder(llama)


def test_without_process_group_is_plain_and_keeps_the_model():
    model = build_parent("qwen2_5_vl")
    tower = model.get_encoder(modality="image")
    batch = make_batch("qwen2_5_vl", 0, 0, _pixel_width(tower))
    want = model(**batch).logits
    keys = list(model.state_dict())
    assert hf.enable_hf_vit_balance(model) is model
    assert list(model.state_dict()) == keys and tower.dtype == torch.float32
    torch.testing.assert_close(model(**batch).logits, want, rtol=0, atol=0)
    assert hf.is_hf_model(model) and hf.is_hf_model(tower)
    assert not hf.is_hf_model(torch.nn.Linear(2, 2))


def test_cost_model_comes_from_the_tower_config():
    model = build_parent("qwen2_5_vl")
    cost = hf_towers.architecture_cost(model.get_encoder(modality="image"))
    assert cost == ArchitectureCost(
        hidden=64,
        mlp_hidden=128,
        depth=4,
        in_dim=1176,
        out_dim=64,
        full_attention_layers=2,
        window_patches=64,
        gated_mlp=True,
    )
    qwen3 = build_parent("qwen3_vl").get_encoder(modality="image")
    assert hf_towers.architecture_cost(qwen3).num_mergers == 3
    glm = build_parent("glm4v").get_encoder(modality="image")
    # Glm4vVisionMlp is out_hidden_size wide
    assert hf_towers.architecture_cost(glm).mlp_hidden == 64
    hf.enable_hf_vit_balance(qwen3, config=BalanceConfig())  # cost_model="auto"
    _, chosen = parse_planner_spec(qwen3._vitbal_hf.planner)
    assert chosen == hf_towers.architecture_cost(qwen3)


def test_is_hf_model_does_not_import_transformers():
    code = (
        "import sys, torch; from fx_vitbal.integrations import hf; "
        "assert not hf.is_hf_model(torch.nn.Linear(1, 1)); "
        "assert 'transformers' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_vitbal_backend_refuses_an_unwrapped_hf_vlm_and_compiles_a_wrapped_one():
    model = build_parent("qwen2_vl")
    batch = make_batch("qwen2_vl", 0, 0, _pixel_width(model.get_encoder(modality="image")))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="vitbal", options={"inner": "eager"})
    with pytest.raises(Exception, match="Qwen2VisionTransformer.* compiled without balancing"):
        compiled(**batch)
    torch._dynamo.reset()
    fx_vitbal.enable_vit_balance(model)  # one process: a plain call, but a wrapped one
    compiled = torch.compile(model, backend="vitbal", options={"inner": "eager"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logits = compiled(**batch).logits
    torch.testing.assert_close(logits, model(**batch).logits)
    ours = [str(w.message) for w in caught if "fx_vitbal" in str(w.message)]
    assert ours == [], ours  # the library's own code makes dynamo warn about nothing


def _eval_on_rank_0_only(rank: int, world: int) -> list:
    results = []
    if rank == 0:  # validation on one rank: a collective would wait for rank 1 forever
        for family in ("qwen2_vl", "qwen3_vl"):
            model = build_parent(family).eval()
            batch = make_batch(family, 0, 0, _pixel_width(model.get_encoder(modality="image")))
            with torch.no_grad():
                want = model(**batch).logits
                fx_vitbal.enable_vit_balance(model)
                got = model(**batch).logits  # one plain tower call from the parent's pre-hook
            results.append((got, want))
    dist.barrier()
    return results


def test_wrapped_hf_vlm_in_eval_mode_issues_no_collective_and_matches():
    results = run_ranks(_eval_on_rank_0_only, 2)
    assert len(results[0]) == 2 and results[1] == []
    for got, want in results[0]:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _bad_input_on_rank_1(rank: int, world: int, case: str) -> str:
    model = build_parent("qwen2_vl")
    tower = model.get_encoder(modality="image")
    width = _pixel_width(tower)
    fx_vitbal.enable_vit_balance(model)
    batch = make_batch("qwen2_vl", rank, 0, width)
    batch.pop("labels")
    if rank == 1 and case == "mm_encoder_outputs":
        batch["mm_encoder_outputs"] = {"image": None}
    if rank == 1 and case == "grid":  # h not a multiple of the merge size
        batch["pixel_values"] = torch.randn(12, width)
        batch["image_grid_thw"] = torch.tensor([[1, 3, 4]])
    if rank == 1 and case == "modalities_differ":
        batch["pixel_values_videos"] = torch.randn(2 * 4 * 6, width + 1)
        batch["video_grid_thw"] = torch.tensor([[2, 4, 6]])
    with pytest.raises(ValueError) as info:
        if case == "hidden_states":  # a direct tower call
            pixels, grid = batch["pixel_values"], batch["image_grid_thw"]
            tower(pixels, grid_thw=grid, output_hidden_states=rank == 1)
        else:
            model(**batch)
    return str(info.value)


@pytest.mark.parametrize(
    "case", ["mm_encoder_outputs", "grid", "modalities_differ", "hidden_states"]
)
def test_a_bad_input_on_one_rank_raises_the_same_error_on_every_rank(case):
    messages = run_ranks(_bad_input_on_rank_1, 2, case)
    assert messages[0] == messages[1], messages
    assert "rank 1" in messages[0] and "rank 0" not in messages[0], messages[0]


# --- MiniCPM-V's strips (``hf_inputs.STRIPS``): a tower balanced on its own, and the geometry


def _processor_strip(image: torch.Tensor, patch: int) -> torch.Tensor:
    """A ``(C, H, W)`` image as MiniCPM-V's processor lays it out (``reshape_by_patch``):
    ``(C, p, (H/p)*(W/p)*p)``, its patches in raster order along the width."""
    channels = image.shape[0]
    patches = torch.nn.functional.unfold(image[None], (patch, patch), stride=(patch, patch))
    patches = patches.reshape(channels, patch, patch, -1).permute(0, 1, 3, 2)
    return patches.reshape(channels, patch, -1)


_STRIP_CONFIG = st.builds(
    lambda c, p: types.SimpleNamespace(num_channels=c, patch_size=p),
    st.integers(1, 3),
    st.integers(1, 4),
)
_SIZES = st.lists(st.tuples(st.integers(1, 5), st.integers(1, 5)), min_size=1, max_size=4)


@settings(max_examples=50, deadline=None)
@given(config=_STRIP_CONFIG, patches=st.integers(0, 12))
def test_a_strip_round_trips_through_pixel_rows(config, patches):
    c, p = config.num_channels, config.patch_size
    strip = torch.randn(1, c, p, patches * p)
    rows = STRIPS.rows(strip, config)
    assert rows.shape == (patches, c * p * p)
    torch.testing.assert_close(STRIPS.pixels(rows, config), strip, rtol=0, atol=0)


@given(sizes=_SIZES)
def test_target_sizes_round_trip_through_grid_rows(sizes):
    target_sizes = torch.tensor(sizes, dtype=torch.int32)
    grid = STRIPS.grid(target_sizes)
    assert grid.shape == (len(sizes), 3) and grid[:, 0].eq(1).all()
    torch.testing.assert_close(STRIPS.tower_grid(grid), target_sizes, rtol=0, atol=0)


@settings(max_examples=50, deadline=None)
@given(config=_STRIP_CONFIG, sizes=_SIZES)
def test_an_images_pixel_rows_are_its_patches_in_raster_order_of_its_grid_row(config, sizes):
    """The ``[t, h, w]`` grid row of ``(h, w)`` target sizes reads the image's pixel rows
    row-major over ``(h, w)``, as every ``grid_thw`` does: non-square images tell ``h`` from
    ``w``."""
    c, p = config.num_channels, config.patch_size
    images = [torch.randn(c, h * p, w * p) for h, w in sizes]
    strip = torch.cat([_processor_strip(image, p) for image in images], dim=-1)[None]
    rows = STRIPS.rows(strip, config)
    grid = STRIPS.grid(torch.tensor(sizes, dtype=torch.int32))
    first = 0
    for image, (t, h, w) in zip(images, grid.tolist(), strict=True):
        assert (t, h * p, w * p) == (1, *image.shape[1:]), "the grid row is not the image's"
        patches = rows[first : first + t * h * w].reshape(h, w, c, p, p)
        for i in range(h):
            for j in range(w):
                want = image[:, i * p : (i + 1) * p, j * p : (j + 1) * p]
                torch.testing.assert_close(patches[i, j], want, rtol=0, atol=0)
        first += t * h * w
    assert first == rows.shape[0]


# Non-square target sizes in patches; rank 0 holds most of the work, so units move to rank 1.
MINICPM_SIZES = [[[4, 6], [2, 4], [6, 4]], [[2, 4]]]


def _minicpm_step(tower, strip, sizes, merger: bool) -> tuple:
    """The tower's output, pixel gradient and all-reduced parameter gradients."""
    pixels = strip.clone().requires_grad_(True)
    out = tower(pixels, target_sizes=sizes, use_vit_merger=merger).last_hidden_state
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    grads = _all_reduced_grads(tower)
    tower.zero_grad(set_to_none=True)
    return out.detach(), pixels.grad, grads


def _minicpm_tower(rank: int, world: int) -> dict:
    from hf_zoo import minicpm_ocr

    sizes = torch.tensor(MINICPM_SIZES[rank], dtype=torch.int32)
    results = {}
    for merger in (True, False):  # the tower's default, and "4x" mode's call (a row a patch)
        tower = minicpm_ocr.build().model.vision_tower
        c, p = tower.config.num_channels, tower.config.patch_size
        seed = torch.Generator().manual_seed(rank)
        strip = minicpm_ocr.strip(
            torch.randn(int(sizes.prod(1).sum()), c * p * p, generator=seed), c, p
        )
        want = _minicpm_step(tower, strip, sizes, merger)
        fx_vitbal.enable_vit_balance(tower, config=BalanceConfig(trigger_threshold=0.0))
        with record_moves() as moves:
            got = _minicpm_step(tower, strip, sizes, merger)
        results[merger] = {"got": got, "want": want, "moves": moves}
    return results


def test_a_minicpm_tower_balanced_on_its_own_with_non_square_strips_equals_its_plain_call():
    results = run_ranks(_minicpm_tower, 2)
    for merger in (True, False):
        for rank, res in enumerate(r[merger] for r in results):
            for got, want, what in zip(
                res["got"], res["want"], ["output", "pixel grad", "grads"], strict=True
            ):
                where = f"use_vit_merger={merger} rank {rank} {what}"
                torch.testing.assert_close(
                    got, want, rtol=1e-5, atol=1e-5, msg=lambda m, where=where: f"{where}: {m}"
                )
        assert_units_moved([r[merger] for r in results])
