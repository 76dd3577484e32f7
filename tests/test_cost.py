"""Tests for the per-unit cost models and how a config name resolves to one."""

import dataclasses
import json

import pytest

from fx_vitbal.cost import (
    ArchitectureCost,
    OnlineCost,
    PolynomialCost,
    QuadraticCost,
    choose_cost_model,
    cost_from_spec,
    cost_to_spec,
)

# Qwen2-VL-7B's vision tower (vision_config): embed_dim 1280, mlp_ratio 4, depth 32,
# 3 * 2 * 14 * 14 = 1176 inputs per patch, merger to the LM's hidden size 3584; every layer attends
# over whole frames.
QWEN2_VL_7B = ArchitectureCost(hidden=1280, mlp_hidden=5120, depth=32, in_dim=1176, out_dim=3584)
# The same tower with Qwen2.5-VL's layout: 4 full-attention layers, the rest in 8x8-patch windows.
WINDOWED = ArchitectureCost(
    hidden=1280,
    mlp_hidden=5120,
    depth=32,
    in_dim=1176,
    out_dim=3584,
    full_attention_layers=4,
    window_patches=64,
)


def test_quadratic_cost_is_tokens_squared():
    assert QuadraticCost()(2, 3, 5) == 900.0
    assert QuadraticCost()(1, 64, 64) == 4096.0**2


def test_polynomial_cost_evaluates_in_tokens():
    assert PolynomialCost(2.0, 3.0, 5.0)(2, 2, 5) == 2 * 20**2 + 3 * 20 + 5


@pytest.mark.parametrize("coeffs", [(2e-9, 3e-6, 1e-3), (0.0, 1e-5, 2e-2), (1e-8, 0.0, 0.0)])
def test_polynomial_fit_recovers_exact_coefficients(coeffs):
    a, b, c = coeffs
    tokens = [64, 256, 1024, 4096, 16384, 36864]
    seconds = [a * n * n + b * n + c for n in tokens]
    fitted = PolynomialCost.fit(tokens, seconds)
    assert (fitted.a, fitted.b, fitted.c) == pytest.approx(coeffs, rel=1e-6, abs=1e-15)


def test_polynomial_fit_clips_negative_coefficients_to_keep_cost_monotone():
    tokens = [100, 400, 900, 1600]
    seconds = [n**0.5 for n in tokens]  # concave: an unconstrained fit has a < 0
    fitted = PolynomialCost.fit(tokens, seconds)
    assert min(fitted.a, fitted.b, fitted.c) >= 0.0
    assert fitted.a == 0.0


@pytest.mark.parametrize(
    ("tokens", "seconds"),
    [
        ([64, 256], [1.0, 2.0]),  # fewer than three samples
        ([64, 256, 1024], [1.0, 2.0]),  # mismatched lengths
        ([64, 256, 1024], [1.0, 0.0, 3.0]),  # zero time
        ([64, 256, 1024], [1.0, -2.0, 3.0]),  # negative time
        ([0, 256, 1024], [1.0, 2.0, 3.0]),  # zero tokens
    ],
)
def test_polynomial_fit_rejects_too_few_or_non_positive_samples(tokens, seconds):
    with pytest.raises(ValueError, match="fit needs"):
        PolynomialCost.fit(tokens, seconds)


@pytest.mark.parametrize(
    "model",
    [
        QuadraticCost(),
        PolynomialCost(1.5, 2.0, 3.0),
        QWEN2_VL_7B,
        WINDOWED,
        OnlineCost(prior=QuadraticCost()),
        OnlineCost(prior=WINDOWED, window=7, per_frame=False),
    ],
)
def test_spec_round_trip_gives_an_equal_model(model):
    spec = cost_to_spec(model)
    assert isinstance(json.loads(spec), dict)
    restored = cost_from_spec(spec)
    assert type(restored) is type(model)
    assert restored == model
    assert restored(3, 16, 24) == model(3, 16, 24)


def test_spec_rejects_custom_callables():
    with pytest.raises(TypeError, match="built-in"):
        cost_to_spec(lambda t, h, w: float(t * h * w))


def test_spec_is_deterministic_text():
    # It travels as a custom-op argument: equal models must give identical strings.
    assert cost_to_spec(PolynomialCost(1.0, 2.0, 3.0)) == cost_to_spec(
        PolynomialCost(1.0, 2.0, 3.0)
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"hidden": 0}, "hidden"),
        ({"mlp_hidden": -1}, "mlp_hidden"),
        ({"depth": 0}, "depth"),
        ({"in_dim": 0}, "in_dim"),
        ({"out_dim": 0}, "out_dim"),
        ({"spatial_merge_size": 0}, "spatial_merge_size"),
        ({"full_attention_layers": 33}, "full_attention_layers"),
        ({"full_attention_layers": -1}, "full_attention_layers"),
        ({"full_attention_layers": 4}, "window_patches"),
    ],
)
def test_architecture_cost_rejects_bad_dimensions(overrides, message):
    dims = dict(hidden=1280, mlp_hidden=5120, depth=32, in_dim=1176, out_dim=3584)
    with pytest.raises(ValueError, match=message):
        ArchitectureCost(**{**dims, **overrides})


def test_per_frame_attention_makes_a_video_cheaper_than_one_frame_of_equal_tokens():
    video, image = (4, 32, 32), (1, 64, 64)  # 4096 tokens each
    assert QWEN2_VL_7B(*video) < QWEN2_VL_7B(*image)
    # Attending over the whole clip removes the difference: only tokens matter then.
    whole_clip = ArchitectureCost(
        hidden=1280, mlp_hidden=5120, depth=32, in_dim=1176, out_dim=3584, per_frame=False
    )
    assert whole_clip(*video) == whole_clip(*image)


def test_window_layers_make_large_images_cheaper_than_full_attention():
    assert WINDOWED(1, 128, 128) < QWEN2_VL_7B(1, 128, 128)
    # An image that fits in one window attends to the same keys either way.
    assert WINDOWED(1, 8, 8) == QWEN2_VL_7B(1, 8, 8)


def test_gated_mlp_and_extra_mergers_add_cost():
    dims = dict(hidden=64, mlp_hidden=256, depth=2, in_dim=24, out_dim=32)
    plain = ArchitectureCost(**dims)
    assert ArchitectureCost(**dims, gated_mlp=True)(1, 8, 8) > plain(1, 8, 8)
    assert ArchitectureCost(**dims, num_mergers=3)(1, 8, 8) > plain(1, 8, 8)


def test_architecture_cost_ranks_many_small_images_above_one_of_their_total_size():
    """Below ~6*hidden tokens the per-token linear layers dominate, so three 1024-token images
    cost more than one 2048-token image (more tokens); ``l**2`` only sees the attention term and
    says the opposite."""
    one, three = (1, 32, 64), (1, 32, 32)
    quadratic = QuadraticCost()
    assert quadratic(*one) > 3 * quadratic(*three)
    assert QWEN2_VL_7B(*one) < 3 * QWEN2_VL_7B(*three)


def test_architecture_cost_agrees_with_quadratic_for_very_large_images():
    """At 32k-65k tokens per frame attention (2*d*l per token) outweighs the linear layers
    (12*d**2 per token) about 4-9x, so halving an image almost halves its per-token cost: one
    65536-token image costs more than two 32768-token ones under both models (l**2: 2x,
    architecture: ~1.8x)."""
    one, two = (1, 256, 256), (1, 128, 256)
    for model in (QuadraticCost(), QWEN2_VL_7B):
        assert model(*one) > 2 * model(*two)
    ratio = QWEN2_VL_7B(*one) / (2 * QWEN2_VL_7B(*two))
    assert 1.5 < ratio < 2.0


def test_choose_quadratic_ignores_known_architecture():
    assert choose_cost_model("quadratic", None, QWEN2_VL_7B) == QuadraticCost()


def test_choose_polynomial_uses_the_coefficients():
    assert choose_cost_model("polynomial", (1.0, 2.0, 3.0), QWEN2_VL_7B) == PolynomialCost(1, 2, 3)


def test_choose_auto_prefers_the_architecture_when_known():
    assert choose_cost_model("auto", None, QWEN2_VL_7B) is QWEN2_VL_7B
    assert choose_cost_model("auto", None, None) == QuadraticCost()


def test_choose_architecture_needs_known_dimensions():
    assert choose_cost_model("architecture", None, WINDOWED) is WINDOWED
    with pytest.raises(ValueError, match="dimensions"):
        choose_cost_model("architecture", None, None)


def test_choose_online_starts_from_the_best_prior():
    assert choose_cost_model("online", None, WINDOWED) == OnlineCost(prior=WINDOWED)
    assert choose_cost_model("online", None, None) == OnlineCost(prior=QuadraticCost())
    clip = dataclasses.replace(QWEN2_VL_7B, per_frame=False)
    assert choose_cost_model("online", None, clip).per_frame is False


def test_online_spec_names_kind_prior_and_window_not_coefficients():
    """Ranks must agree on it, and the fitted coefficients change every step: they are computed
    alike on every rank from gathered timings, so the spec (and the planner fingerprint built on
    it) holds only the settings."""
    spec = json.loads(cost_to_spec(OnlineCost(prior=QWEN2_VL_7B, window=12)))
    assert set(spec) == {"kind", "prior", "window", "per_frame"}
    assert spec["kind"] == "online" and spec["window"] == 12
    assert spec["prior"] == json.loads(cost_to_spec(QWEN2_VL_7B))


def test_online_cost_without_timings_is_its_prior():
    assert OnlineCost(prior=WINDOWED)(2, 32, 48) == WINDOWED(2, 32, 48)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [({"prior": PolynomialCost(1, 2, 3)}, "prior"), ({"window": 0}, "window")],
)
def test_online_cost_rejects_bad_settings(overrides, message):
    with pytest.raises(ValueError, match=f"OnlineCost.{message}"):
        OnlineCost(**{"prior": QuadraticCost(), **overrides})
