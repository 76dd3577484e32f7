"""A bad input on one rank raises the same ``ValueError`` on every rank, on every entry point, and
never drops an image nor leaves a rank waiting.

The family: entry point (``dp_balance_vit_encoder``, a ViT balanced in place, an FX graph the
pass rewrote, ``plan_ahead``, a Hugging Face tower balanced with ``enable_vit_balance``) x
argument (pixels, grid) x bad value (None, wrong tensor rank, wrong shape, wrong dtype, wrong
device), the bad value on rank 1 only. Each case runs on a group with a short timeout, so a
rank left waiting fails within seconds; a good step follows every bad one (the ranks are still
in lockstep). A group of one rank and no group at all raise too instead of dropping images.
"""

import datetime

import pytest
import torch
import torch.distributed as dist
from dist_utils import record_collectives, run_ranks

import fx_vitbal
from fx_vitbal.passes import apply_vit_balance_pass, symbolic_trace
from fx_vitbal.tools.models import ViTConfig
from fx_vitbal.tools.omni import LMConfig, OmniEncoderModel, make_inputs

GRIDS = ([[1, 4, 8], [1, 2, 2]], [[1, 2, 4]])  # per rank: skewed, so a good step moves units
KINDS = ("none", "rank", "shape", "dtype", "device")
CASES = [(arg, kind) for arg in ("pixels", "grid") for kind in KINDS]
ENTRIES = ("eager", "in_place", "fx", "plan_ahead", "hf_tower")
TIMEOUT = datetime.timedelta(seconds=30)  # a rank left waiting fails the case within it

# What every rank's message must say, per case (the rank named is always rank 1).
SAYS = {
    ("pixels", "none"): "pixel_values is None but image_grid_thw has 1 rows",
    ("pixels", "rank"): "must be 2-D [rows, features]",
    ("pixels", "shape"): "rows but image_grid_thw sums to",
    ("pixels", "dtype"): "pixel_values dtype must be one of",
    ("pixels", "device"): "pixel_values are on meta",
    ("grid", "none"): "image_grid_thw is None but pixel_values has 8 rows",
    ("grid", "rank"): "must be 2-D with 3 columns",
    ("grid", "shape"): "must be 2-D with 3 columns",
    ("grid", "dtype"): "must have an integer dtype",
    ("grid", "device"): "image_grid_thw is on meta",
}
# A Hugging Face tower's pixel rows may have more dims than two (they are checked as rows
# against the grid), and plan_ahead takes meta pixels on purpose (a batch's shape is enough).
HF_SAYS = {("pixels", "rank"): "rows but image_grid_thw sums to"}


def _broken(pixels, grid, arg: str, kind: str):
    """``(pixels, grid)`` with ``arg`` made bad the way ``kind`` says."""
    if arg == "pixels":
        bad = {
            "none": None,
            "rank": pixels[None],
            "shape": pixels[:-1],
            "dtype": pixels.long(),
            "device": pixels.to("meta"),
        }
        return bad[kind], grid
    bad = {
        "none": None,
        "rank": grid.flatten(),
        "shape": grid[:, :2],
        "dtype": grid.double(),
        "device": grid.to("meta"),
    }
    return pixels, bad[kind]


def _hf_tower():
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen2_vl.modeling_qwen2_vl import (
        Qwen2VisionTransformerPretrainedModel,
        Qwen2VLVisionConfig,
    )

    config = Qwen2VLVisionConfig(depth=1, embed_dim=32, num_heads=2, hidden_size=32)
    assert transformers  # imported for its towers
    return Qwen2VisionTransformerPretrainedModel(config), 3 * 2 * 14 * 14


def _entry(entry: str, group, input_ids):
    """``(call(pixels, grid), pixel width)`` for one entry point, built alike on every rank;
    the FX graph's LM gets ``input_ids`` (the good batch's: a bad one raises before the LM)."""
    torch.manual_seed(0)
    if entry == "hf_tower":
        tower, width = _hf_tower()
        fx_vitbal.enable_vit_balance(tower, group=group)
        return (lambda p, g: tower(p, grid_thw=g)), width
    model = OmniEncoderModel(ViTConfig(), LMConfig())
    vit = model.visual
    if entry == "eager":
        return (lambda p, g: fx_vitbal.dp_balance_vit_encoder(vit, p, g, group=group)), 24
    if entry == "in_place":
        fx_vitbal.enable_vit_balance(vit, group=group)
        return vit, 24
    if entry == "plan_ahead":
        return (lambda p, g: fx_vitbal.plan_ahead(vit, p, g, group=group)), 24
    gm = apply_vit_balance_pass(symbolic_trace(model), group=group)
    return (lambda p, g: gm(input_ids, p, g)), 24


def _bad_inputs_on_rank_1(rank: int, world: int, entry: str) -> dict:
    group = dist.new_group(timeout=TIMEOUT)
    width = 3 * 2 * 14 * 14 if entry == "hf_tower" else 24
    input_ids, pixels, grid = make_inputs(GRIDS[rank], in_dim=width, seed=rank)
    call, _ = _entry(entry, group, input_ids)
    messages = {}
    for arg, kind in CASES:
        if entry == "plan_ahead" and (arg, kind) == ("pixels", "device"):
            continue  # meta pixels are what plan_ahead is for
        bad_pixels, bad_grid = _broken(pixels, grid, arg, kind) if rank == 1 else (pixels, grid)
        try:
            call(bad_pixels, bad_grid)
            messages[(arg, kind)] = None
        except ValueError as error:
            messages[(arg, kind)] = str(error)
        good = call(pixels, grid)  # every rank is still in lockstep
        if entry == "plan_ahead":
            assert good.plan.applied
    return messages


@pytest.mark.parametrize("entry", ENTRIES)
def test_a_bad_value_on_one_rank_raises_the_same_value_error_on_every_rank(entry):
    messages = run_ranks(_bad_inputs_on_rank_1, 2, entry, timeout=300)
    assert messages[0].keys() == messages[1].keys()
    for case, message in messages[0].items():
        assert message is not None, f"{entry} {case}: no error"
        assert message == messages[1][case], f"{entry} {case}: ranks differ"
        assert "rank 1: " in message and "rank 0: " not in message, message
        says = HF_SAYS.get(case, SAYS[case]) if entry == "hf_tower" else SAYS[case]
        assert says in message, f"{entry} {case}: {message}"


def _text_only_tower_rank(rank: int, world: int) -> dict:
    tower, width = _hf_tower()
    fx_vitbal.enable_vit_balance(tower)
    grid = torch.tensor([[1, 4, 8], [1, 2, 2]])
    pixels = torch.randn(36, width)
    with record_collectives() as issued:
        # Rank 1 is text only: it calls the tower with nothing.
        out = tower(None, grid_thw=None) if rank == 1 else tower(pixels, grid_thw=grid)
        out.pooler_output.sum().backward()
    plain = tower._vitbal_original_forward(pixels, grid_thw=grid).pooler_output
    return {
        "rows": out.pooler_output.shape,
        "same": rank == 1 or torch.allclose(out.pooler_output, plain, atol=1e-6),
        "collectives": [(phase, name) for phase, name, _, _ in issued],
    }


def test_a_text_only_rank_calls_a_balanced_hf_tower_with_none_and_gets_empty_outputs():
    results = run_ranks(_text_only_tower_rank, 2)
    assert results[1]["rows"] == (0, 32)  # the tower's width, no rows
    assert results[0]["rows"] == (36 // 4, 32) and results[0]["same"]
    assert results[0]["collectives"] == results[1]["collectives"]
    assert ("backward", "all_to_all") in results[1]["collectives"]


def _none_pixels_with_a_grid_alone(rank: int, world: int) -> list[str]:
    torch.manual_seed(0)
    vit = OmniEncoderModel(ViTConfig(), LMConfig()).visual
    grid = torch.tensor([[1, 2, 4]])
    single = [dist.new_group([r]) for r in range(world)][rank]  # a world of one rank
    messages = []
    for group in (single, None):
        try:
            fx_vitbal.dp_balance_vit_encoder(vit, None, grid, group=group)
        except ValueError as error:
            messages.append(str(error))
    dist.destroy_process_group()  # and no process group at all
    try:
        fx_vitbal.dp_balance_vit_encoder(vit, None, grid)
    except ValueError as error:
        messages.append(str(error))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return messages


def test_none_pixels_with_a_grid_raise_on_one_rank_and_without_a_group_too():
    for messages in run_ranks(_none_pixels_with_a_grid_alone, 2):
        assert len(messages) == 3
        assert all("pixel_values is None but image_grid_thw has 1 rows" in m for m in messages)


def test_a_tower_without_a_grid_is_refused_as_having_nothing_to_balance():
    transformers = pytest.importorskip("transformers")
    config = transformers.CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
    )
    with pytest.raises(TypeError, match="takes no image grid") as info:
        fx_vitbal.enable_vit_balance(transformers.CLIPVisionModel(config))
    assert "shipped:" not in str(info.value)  # not the list of towers it could be
