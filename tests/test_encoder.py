"""Finding, declaring and wrapping the ViT (single process: without a group every call is plain)."""

import pytest
import torch
from torch import nn

import fx_vitbal
from fx_vitbal.encoder import UNDECLARED, VisionEncoderSpec, find_vit, vision_encoder_spec
from fx_vitbal.models import LMConfig, OmniEncoderModel, QwenStyleViT, ViTConfig, make_inputs


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


def test_enable_wraps_in_place_once_and_keeps_state_dict_keys():
    model = _model()
    keys = list(model.state_dict())
    original = model.visual.forward
    assert fx_vitbal.enable_vit_balance(model) is model
    fx_vitbal.enable_vit_balance(model, config=fx_vitbal.BalanceConfig(trigger_threshold=0.5))
    assert model.visual._vitbal_original_forward == original  # wrapped once, not twice
    assert model.visual.forward != original
    assert list(model.state_dict()) == keys
    input_ids, pixels, grid = make_inputs([[1, 4, 4], [2, 2, 2]], in_dim=24)
    plain = _model()
    torch.testing.assert_close(model(input_ids, pixels, grid), plain(input_ids, pixels, grid))


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
            fx_vitbal.encoder.planner_for(vit, fx_vitbal.BalanceConfig())
    messages = [r.getMessage() for r in caplog.records if "_Undeclared" in r.getMessage()]
    assert len(messages) == 1
    assert "frame splitting and the architecture cost model" in messages[0]


def test_world_size_without_a_process_group_warns_once_and_runs_plain(caplog, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    fx_vitbal.encoder._warn_if_launched_without_group.cache_clear()
    vit = QwenStyleViT(ViTConfig())
    _, pixels, grid = make_inputs([[1, 4, 4]], in_dim=24)
    with caplog.at_level("WARNING", logger="fx_vitbal.encoder"):
        for _ in range(2):
            got = fx_vitbal.dp_balance_vit_encoder(vit, pixels, grid)
    warnings = [r.getMessage() for r in caplog.records if "WORLD_SIZE=4" in r.getMessage()]
    assert len(warnings) == 1 and "init_process_group" in warnings[0]
    torch.testing.assert_close(got[0], vit(pixels, grid)[0], rtol=0, atol=0)
    fx_vitbal.encoder._warn_if_launched_without_group.cache_clear()
