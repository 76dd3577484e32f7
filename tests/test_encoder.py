"""Finding, declaring and wrapping the ViT; wrapped calls against the unbalanced ones on 3 ranks."""

import pytest
import torch
import torch.distributed as dist
from dist_utils import assert_units_moved, record_moves, run_ranks
from torch import nn

import fx_vitbal
from fx_vitbal.runtime.vit.registry import (
    UNDECLARED,
    VisionEncoderSpec,
    find_vit,
    vision_encoder_spec,
)
from fx_vitbal.tools.models import QwenStyleViT, ViTConfig
from fx_vitbal.tools.omni import LMConfig, OmniEncoderModel, make_inputs


def _model() -> OmniEncoderModel:
    torch.manual_seed(0)
    return OmniEncoderModel(ViTConfig(deepstack_indexes=(0,)), LMConfig())


class _Holder(nn.Module):
    def __init__(self, name: str, module: nn.Module) -> None:
        super().__init__()
        self.add_module(name, module)


def test_find_vit_by_path_by_child_name_by_registered_class_and_itself():
    model = _model()
    assert find_vit(model) is model.visual  # a child named "visual"
    nested = _Holder("backbone", model)
    assert find_vit(nested) is model.visual
    assert find_vit(nested, "backbone.visual") is model.visual
    assert find_vit(nested, model.visual) is model.visual
    renamed = _Holder("encoder", QwenStyleViT(ViTConfig()))
    assert find_vit(renamed) is renamed.encoder  # found by its registered class
    assert find_vit(model.visual) is model.visual


def test_no_vit_found_raises_value_error_naming_the_ways_to_declare_one():
    with pytest.raises(ValueError, match="register its class with register_vision_encoder"):
        find_vit(_Holder("head", nn.Linear(2, 2)))


def test_unregistered_class_gets_the_undeclared_spec_and_registration_is_validated():
    assert vision_encoder_spec(nn.Linear(2, 2)) is UNDECLARED
    assert not UNDECLARED.frame_independent and UNDECLARED.cost_model is None
    with pytest.raises(ValueError, match="spatial_merge_size"):
        fx_vitbal.register_vision_encoder(nn.Linear, frame_independent=False, spatial_merge_size=0)


def test_merge_size_comes_from_the_spec_or_the_instance():
    vit = QwenStyleViT(ViTConfig(spatial_merge_size=1))
    assert vision_encoder_spec(vit).merge_size(vit) == 1
    assert VisionEncoderSpec(frame_independent=True, spatial_merge_size=2).merge_size(vit) == 2
    with pytest.raises(TypeError, match="spatial_merge_size"):
        VisionEncoderSpec(frame_independent=True).merge_size(nn.Linear(2, 2))


GRIDS = [[[1, 8, 4], [2, 4, 4], [1, 12, 8]], [[1, 2, 2]], []]  # skewed; rank 2 has nothing


def _wrapped_vs_plain(rank: int, world: int) -> dict:
    model = _model()
    keys = list(model.state_dict())
    original = model.visual.forward
    assert fx_vitbal.enable_vit_balance(model) is model
    config = fx_vitbal.BalanceConfig(trigger_threshold=0.1)
    fx_vitbal.enable_vit_balance(model, config=config)
    wrapped_once = model.visual._vitbal_original_forward == original
    input_ids, pixels, grid = make_inputs(GRIDS[rank], in_dim=24, seed=rank)
    out = {"wrapped_once": wrapped_once, "replaced": model.visual.forward != original}
    out["same_keys"] = list(model.state_dict()) == keys
    for name, net in (("got", model), ("want", _model())):
        with record_moves() as moves:
            logits = net(input_ids, pixels, grid)
            logits.pow(2).mean().backward()
        grads = torch.cat([p.grad.flatten() for p in net.parameters()])
        dist.all_reduce(grads)
        out[name] = (logits.detach(), grads)
        out.setdefault("moves", moves)
    # The functional wrapper on a windowed ViT: outputs and the regenerated window index.
    vit = QwenStyleViT(ViTConfig(window_size=2, fullatt_block_indexes=(1,)))
    _, pixels, grid = make_inputs(GRIDS[rank], in_dim=24, seed=rank)
    with record_moves() as moves:
        got = fx_vitbal.dp_balance_vit_encoder(vit, pixels, grid)
    out["vit"] = ([got[0].detach(), got[1]], [t.detach() for t in vit(pixels, grid)[:2]], moves)
    return out


def test_enable_wraps_in_place_once_and_balances_exactly_like_the_plain_model():
    results = run_ranks(_wrapped_vs_plain, 3)
    for rank, res in enumerate(results):
        assert res["wrapped_once"] and res["replaced"] and res["same_keys"]
        for got, want in zip(res["got"], res["want"], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"rank {rank}")
        got, want, _ = res["vit"]
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6, msg=f"rank {rank}")
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)  # the window index
    assert_units_moved(results)
    assert_units_moved([{"moves": res["vit"][2]} for res in results])


def test_without_a_process_group_the_balanced_call_is_the_plain_call():
    vit = QwenStyleViT(ViTConfig(window_size=2, fullatt_block_indexes=(1,)))
    _, pixels, grid = make_inputs([[1, 8, 4]], in_dim=24)
    got = fx_vitbal.dp_balance_vit_encoder(vit, pixels, grid)
    want = vit(pixels, grid)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)


class _Undeclared(nn.Module):
    spatial_merge_size = 2

    def forward(self, pixel_values, image_grid_thw):
        return pixel_values, None, []


def test_an_undeclared_vit_is_logged_once_with_what_registering_would_unlock(caplog):
    vit = _Undeclared()
    with caplog.at_level("WARNING", logger="fx_vitbal.encoder"):
        for _ in range(3):
            fx_vitbal.runtime.vit.settings.planner_for(vit, fx_vitbal.BalanceConfig())
    messages = [r.getMessage() for r in caplog.records if "_Undeclared" in r.getMessage()]
    assert len(messages) == 1
    assert "frame splitting and the architecture cost model" in messages[0]


def test_world_size_without_a_process_group_warns_once_and_runs_plain(caplog, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    fx_vitbal.runtime.vit.settings._warn_if_launched_without_group.cache_clear()
    vit = QwenStyleViT(ViTConfig())
    _, pixels, grid = make_inputs([[1, 4, 4]], in_dim=24)
    with caplog.at_level("WARNING", logger="fx_vitbal.encoder"):
        for _ in range(2):
            got = fx_vitbal.dp_balance_vit_encoder(vit, pixels, grid)
    warnings = [r.getMessage() for r in caplog.records if "WORLD_SIZE=4" in r.getMessage()]
    assert len(warnings) == 1 and "init_process_group" in warnings[0]
    torch.testing.assert_close(got[0], vit(pixels, grid)[0], rtol=0, atol=0)
    fx_vitbal.runtime.vit.settings._warn_if_launched_without_group.cache_clear()
