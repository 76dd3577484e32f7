"""The online per-rank time model: exact, robust, non-negative, and bitwise alike on every rank."""

import math
import os
import pathlib
import random
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fx_vitbal.cost import ArchitectureCost, OnlineCost, QuadraticCost
from fx_vitbal.cost.online import (
    MAX_OBSERVATIONS,
    MIN_OBSERVATIONS,
    OnlineFit,
    fit_nonnegative,
    rank_features,
    unit_features,
)
from fx_vitbal.tools.simulate_online import main, run
from fx_vitbal.tools.workloads import sample_batches

ROOT = pathlib.Path(__file__).resolve().parents[1]
TRUE = (3e-9, 2e-5, 1e-3, 5e-3)  # (a, b, c, d): seconds per pair, token, unit, step
QWEN2_VL_7B = ArchitectureCost(hidden=1280, mlp_hidden=5120, depth=32, in_dim=1176, out_dim=3584)


def _frames(grids):
    return [(1, h, w) for t, h, w in grids for _ in range(t)]


def _step(num_ranks, seed):
    """Each rank's units (frames of a realistic mix) and its noiseless true time."""
    units_R = [_frames(g) or [(1, 2, 2)] for g in sample_batches(num_ranks, 8, seed=seed)]
    return units_R, [_true_seconds(rank_features(u, True)) for u in units_R]


def _true_seconds(features):
    return math.fsum(a * x for a, x in zip(TRUE, features, strict=True))


def _observations(num, seed=0):
    units_R, seconds = _step(num, seed)
    return [rank_features(u, True) for u in units_R], seconds


def test_features_count_attention_per_frame_or_per_clip():
    assert unit_features((3, 2, 5), per_frame=True) == (3 * 100.0, 30.0, 1.0)
    assert unit_features((3, 2, 5), per_frame=False) == (900.0, 30.0, 1.0)
    assert rank_features([(1, 2, 2), (2, 4, 4)], per_frame=True) == (16 + 2 * 256, 36, 2, 1)


def test_fit_recovers_true_coefficients_from_noiseless_timings():
    rows, seconds = _observations(64)
    assert fit_nonnegative(rows, seconds) == pytest.approx(TRUE, rel=1e-9)


def test_fit_ignores_a_few_wild_outliers():
    rows, seconds = _observations(64)
    for i, factor in [(3, 10.0), (17, 0.05), (30, 4.0), (41, 1e3)]:  # stragglers, a bad timer
        seconds[i] *= factor
    assert fit_nonnegative(rows, seconds) == pytest.approx(TRUE, rel=1e-6)


def test_fit_keeps_coefficients_non_negative():
    rows, _ = _observations(32)
    # Time falling with tokens: an unconstrained fit would give b < 0.
    seconds = [1.0 + 1e-10 * pairs - 1e-6 * tokens + 1e-3 for pairs, tokens, _, _ in rows]
    seconds = [max(s, 1e-3) for s in seconds]
    coeffs = fit_nonnegative(rows, seconds)
    assert min(coeffs) >= 0.0 and coeffs[1] == 0.0


@settings(max_examples=30, deadline=None)
@given(st.randoms(use_true_random=False), st.integers(1, 40))
def test_fit_is_bitwise_independent_of_observation_order(rng, num):
    rows, seconds = _observations(num, seed=rng.randrange(1000))
    seconds = [s * (1 + 0.05 * rng.gauss(0, 1)) for s in seconds]
    order = list(range(num))
    rng.shuffle(order)
    shuffled = fit_nonnegative([rows[i] for i in order], [seconds[i] for i in order])
    assert [c.hex() for c in shuffled] == [c.hex() for c in fit_nonnegative(rows, seconds)]


# Each process fits the same noisy timings (with outliers) over several steps and prints the bits.
# It imports fx_vitbal's pure-Python modules without the package's __init__ (which imports torch
# and registers the ops: ~3 s a process); torch, when asked for, only to set its thread count.
_FIT_SCRIPT = """
import random, sys, types
pkg = types.ModuleType("fx_vitbal")
pkg.__path__ = [{package!r}]
sys.modules["fx_vitbal"] = pkg
if {threads}:
    import torch
    torch.set_num_threads({threads})
from fx_vitbal.cost import ArchitectureCost, OnlineCost
from fx_vitbal.cost.online import OnlineFit
from fx_vitbal.tools.workloads import sample_batches
assert "torch" in sys.modules or not {threads}
rng = random.Random(0)
fit = OnlineFit(OnlineCost(prior=ArchitectureCost(
    hidden=1280, mlp_hidden=5120, depth=32, in_dim=1176, out_dim=3584), window=3))
for step in range(5):
    units_R = [[(1, h, w) for t, h, w in g for _ in range(t)] or [(1, 2, 2)]
               for g in sample_batches(12, 6, seed=step)]
    seconds = [(0.01 + sum(2e-3 + 1.2e-5 * h * w + 4e-9 * (h * w) ** 2 for _, h, w in u))
               * rng.uniform(0.9, 1.1) * (5 if rng.random() < 0.1 else 1) for u in units_R]
    model = fit.observe(units_R, seconds)
    print([c.hex() for c in model.coeffs], model.prior_scale.hex(), model.blend.hex(),
          model(1, 64, 48).hex(), model.num_observations)
"""


def test_fit_is_bitwise_identical_in_processes_with_different_threads_and_hash_seeds():
    processes = []
    for threads, hash_seed in [(0, "0"), (0, "1234"), (3, "random")]:
        env = dict(os.environ, PYTHONHASHSEED=hash_seed, OMP_NUM_THREADS=str(threads or 2))
        script = _FIT_SCRIPT.format(threads=threads, package=str(ROOT / "fx_vitbal"))
        processes.append(
            subprocess.Popen(
                [sys.executable, "-c", script],
                env=env,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outputs = []
    for process in processes:
        out, err = process.communicate(timeout=120)
        assert process.returncode == 0, err
        outputs.append(out)
    assert len(outputs[0].splitlines()) == 5
    assert outputs[0] == outputs[1] == outputs[2]


@pytest.mark.parametrize("prior", [QuadraticCost(), QWEN2_VL_7B])
def test_no_timings_plan_with_the_prior_exactly(prior):
    fit = OnlineFit(OnlineCost(prior=prior))
    units = [(1, 8, 8), (1, 64, 48), (4, 16, 16)]
    assert [fit.model(*u) for u in units] == [prior(*u) for u in units]
    # A step whose every timing is missing (0, a sentinel, NaN, inf) changes nothing.
    fit.observe([[(1, 8, 8)]] * 4, [0.0, -1.0, math.nan, math.inf])
    assert fit.model.num_observations == 0
    assert [fit.model(*u) for u in units] == [prior(*u) for u in units]


def test_prior_blends_into_the_fit_as_timings_arrive():
    fit = OnlineFit(OnlineCost(prior=QuadraticCost()))
    units_R, seconds = _step(4, seed=0)
    first = fit.observe(units_R, seconds)
    assert first.blend == 4 / MIN_OBSERVATIONS and first.prior_scale > 0
    for seed in range(1, 4):
        model = fit.observe(*_step(4, seed))
    assert model.blend == 1.0 and model.num_observations == MIN_OBSERVATIONS
    assert model.coeffs == pytest.approx(TRUE, rel=1e-9)
    pairs, tokens, _ = unit_features((1, 64, 48), True)
    assert model(1, 64, 48) == pytest.approx(TRUE[0] * pairs + TRUE[1] * tokens + TRUE[2])
    assert model.rank_seconds(units_R[0]) == pytest.approx(seconds[0])


def test_window_forgets_old_timings():
    fit = OnlineFit(OnlineCost(prior=QuadraticCost(), window=2))
    for seed in range(3):
        units_R, seconds = _step(16, seed)
        fit.observe(units_R, [10 * s for s in seconds])  # a slower machine, then ...
    for seed in range(3, 5):
        model = fit.observe(*_step(16, seed))  # ... back to normal: only these 2 steps count
    assert model.num_observations == 32
    assert model.coeffs == pytest.approx(TRUE, rel=1e-9)


def test_large_worlds_keep_a_rotating_subset_of_ranks():
    fit = OnlineFit(OnlineCost(prior=QuadraticCost(), window=4))
    units_R = [[(1, 16, 16)] * (1 + r % 5) for r in range(4096)]
    seconds = [1e-3 + 1e-6 * 256 * len(u) for u in units_R]
    model = fit.observe(units_R, seconds)
    assert model.num_observations == MAX_OBSERVATIONS // 4
    assert fit.observe(units_R, seconds).num_observations == 2 * MAX_OBSERVATIONS // 4


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.lists(
                st.tuples(st.integers(1, 16), st.integers(1, 128), st.integers(1, 128)),
                max_size=6,
            ),
            st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.floats(1e-9, 1e9)),
        ),
        min_size=1,
        max_size=24,
    ),
    st.booleans(),
)
def test_unit_costs_are_finite_non_negative_and_not_all_zero(observations, per_frame):
    fit = OnlineFit(OnlineCost(prior=QuadraticCost(), per_frame=per_frame))
    for start in range(0, len(observations), 6):
        chunk = observations[start : start + 6]
        fit.observe([units or [(1, 2, 2)] for units, _ in chunk], [s for _, s in chunk])
    costs = [fit.model(*u) for u in [(1, 2, 2), (1, 8, 8), (1, 64, 64), (8, 32, 32)]]
    assert all(math.isfinite(c) and c >= 0.0 for c in costs)
    assert any(c > 0.0 for c in costs)


def test_online_with_the_l2_prior_reaches_the_oracle_balance_within_10_steps():
    for seed in range(3):
        result = run("online-quadratic", num_ranks=8, steps=14, seed=seed)
        assert result.steps_to_reach(within=0.02) <= 10
        # ... and then beats the architecture model, whose FLOPs miss this ViT's time.
        architecture = run("architecture", num_ranks=8, steps=14, seed=seed)
        assert sum(result.balance[10:]) < sum(architecture.balance[10:])


def test_simulator_prints_one_row_per_model_and_unit_kind(capsys):
    main(["--ranks", "4", "--steps", "4", "--seeds", "1", "--warmup", "1"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + 2 * 5  # header + (frames, images) x models
    assert rows[5].startswith("| frames | oracle | ") and rows[5].count("| 1.000 |") == 2


def test_random_noise_does_not_break_the_fit():
    rng = random.Random(0)
    rows, seconds = _observations(128, seed=3)
    noisy = [s * (1 + 0.03 * rng.gauss(0, 1)) for s in seconds]
    fitted = fit_nonnegative(rows, noisy)
    # Predicted times within a few % of the truth on every rank.
    predicted = [math.fsum(c * x for c, x in zip(fitted, row, strict=True)) for row in rows]
    assert max(abs(p / s - 1) for p, s in zip(predicted, seconds, strict=True)) < 0.05
