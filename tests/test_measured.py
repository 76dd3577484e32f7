"""Measured times in the loop: per-rank ViT and exchange times ride in the metadata header, every
rank fits the same models, plans use them, and each call's statistics come out as data."""

import dataclasses
import json
import math
import random
import statistics
import time

import pytest
import torch
from dist_utils import run_ranks, train_step
from torch import nn

import fx_vitbal
from fx_vitbal.cost import ArchitectureCost, OnlineCost, QuadraticCost
from fx_vitbal.cost.exchange_time import MIN_EXCHANGES, STALE_AFTER, ExchangeFit, ExchangeModel
from fx_vitbal.measure.clock import watch_parameters
from fx_vitbal.measure.measurements import reset
from fx_vitbal.measure.stats import add_stats_callback
from fx_vitbal.plan.solve import MAKESPAN_SLACK, solve_plan, worth_moving
from fx_vitbal.runtime.agree.metadata import settings_fingerprint
from fx_vitbal.runtime.vit.settings import planner_spec

PER_UNIT_SECONDS = 0.003


def _busy(seconds: float) -> None:
    """Wall-clock busy wait: the same duration however loaded the machine is (no sleep, so the
    process stays runnable, like a CPU-bound launch overhead)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class OverheadViT(nn.Module):
    """A ViT whose time departs from its FLOPs: a fixed per-image overhead (launches, position
    tables, ``cu_seqlens``) dwarfs its tiny matmuls, so l**2 and FLOPs both misjudge it."""

    spatial_merge_size = 2

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 8)

    def forward(self, pixel_values, image_grid_thw):
        for _ in range(image_grid_thw.shape[0]):
            _busy(PER_UNIT_SECONDS)
        return self.embed(pixel_values), None, []


class RegisteredOverheadViT(OverheadViT):
    """The same ViT, registered with its (FLOP) architecture cost."""


def _grids(step: int, rank: int) -> list[list[int]]:
    """Rank 0: 1-3 large images (most tokens, few units); rank 1: 8-14 thumbnails."""
    rng = random.Random(100 * step + rank)
    if rank == 0:
        return [
            [1, 2 * rng.randint(6, 10), 2 * rng.randint(6, 10)] for _ in range(rng.randint(1, 3))
        ]
    return [[1, 2, 2 * rng.randint(1, 2)] for _ in range(rng.randint(8, 14))]


def _train(vit, config, steps, rank) -> list:
    stats = []
    handle = add_stats_callback(stats.append)
    try:
        for step in range(steps):
            grid = torch.tensor(_grids(step, rank))
            pixels = torch.randn(int(grid.prod(-1).sum()), 8)
            embeds, _, _ = fx_vitbal.dp_balance_vit_encoder(vit, pixels, grid, config=config)
            embeds.sum().backward()
    finally:
        handle.remove()
    return stats


def _summary(stats) -> dict:
    return {
        "reasons": [s.reason for s in stats],
        "coefficients": [s.coefficients and [c.hex() for c in s.coefficients] for s in stats],
        "exchange": [(s.exchange_latency, s.exchange_bandwidth) for s in stats],
        "measured": [(s.measured_steps, s.measured_seconds) for s in stats],
        "predicted": [s.measured_predicted_seconds for s in stats],
        "ranks": {s.rank for s in stats},
    }


def _node_rows(rank: int, world: int) -> list[tuple[bool, int, int]]:
    # One rank per node: every row that moves crosses a node.
    config = fx_vitbal.BalanceConfig(max_len_ratio=math.inf, ranks_per_node=1)
    return [
        (s.applied, s.moved_rows, s.inter_node_rows) for s in _train(OverheadViT(), config, 3, rank)
    ]


def test_stats_report_the_rows_crossing_nodes():
    results = run_ranks(_node_rows, 2)
    assert results[0] == results[1]
    assert any(applied for applied, _, _ in results[0])
    assert all(moved == crossing for _, moved, crossing in results[0])


def _three_runs(rank: int, world: int) -> dict:
    fx_vitbal.register_vision_encoder(
        RegisteredOverheadViT,
        frame_independent=True,
        cost_model=lambda vit: ArchitectureCost(
            hidden=8, mlp_hidden=8, depth=1, in_dim=8, out_dim=8
        ),
    )
    uncapped = dict(max_len_ratio=math.inf)  # thumbnails must be free to join the large images
    torch.manual_seed(0)
    online = _train(
        OverheadViT(), fx_vitbal.BalanceConfig(cost_model="online", **uncapped), 14, rank
    )
    torch.manual_seed(0)
    config = fx_vitbal.BalanceConfig(cost_model="architecture", **uncapped)
    architecture = _train(RegisteredOverheadViT(), config, 14, rank)
    # A slow interconnect: every all_to_all takes 60 ms longer than its bytes need.
    reset()
    original = fx_vitbal.runtime.transport.ops.exchange

    def slow(*args, **kwargs):
        _busy(0.06)
        return original(*args, **kwargs)

    fx_vitbal.runtime.transport.ops.exchange = slow
    try:
        torch.manual_seed(0)
        config = fx_vitbal.BalanceConfig(cost_model="online", **uncapped)
        slow_stats = _train(OverheadViT(), config, 12, rank)
    finally:
        fx_vitbal.runtime.transport.ops.exchange = original
    return {
        "online": _summary(online),
        "architecture": _summary(architecture),
        "slow": _summary(slow_stats),
    }


def _measured_balance(summary, first: int) -> float:
    """Median over calls from ``first`` on of measured max/mean per-rank ViT time."""
    ratios = []
    for steps, seconds in summary["measured"][first:]:
        if all(seconds) and len(set(steps)) == 1:
            ratios.append(max(seconds) / statistics.fmean(seconds))
    assert len(ratios) >= 3, summary["measured"]
    return statistics.median(ratios)


@pytest.fixture(scope="module")
def three_runs():
    results = run_ranks(_three_runs, 2)
    for run in ("online", "architecture", "slow"):
        for field in ("reasons", "coefficients", "exchange", "measured", "predicted"):
            # Every rank got every rank's times and fitted the same bits.
            assert results[0][run][field] == results[1][run][field], (run, field)
    assert [r["online"]["ranks"] for r in results] == [{0}, {1}]
    return results[0]


def test_an_unregistered_vit_with_the_l2_prior_is_balanced_by_measured_time_within_10_steps(
    three_runs,
):
    online, architecture = three_runs["online"], three_runs["architecture"]
    assert all(c is None for c in online["coefficients"][:1])  # nothing measured at call 1
    assert online["coefficients"][-1] is not None
    # From call 10 the fit predicts how each call's time splits between the ranks (each rank's
    # share of the mean): median error under 40%, generous for a 2-core machine that other jobs
    # load 4x over (0.04-0.37 seen there). Absolute times follow the machine's load, which changes
    # between the fit and the call on a shared machine; shares, which balance needs, do not.
    errors = []
    late = zip(online["predicted"][9:], online["measured"][9:], strict=True)
    for predicted, (_, seconds) in late:
        if None not in predicted and None not in seconds:
            for p, s in zip(predicted, seconds, strict=True):
                share = (p / statistics.fmean(predicted)) / (s / statistics.fmean(seconds))
                errors.append(abs(share - 1))
    assert len(errors) >= 6 and statistics.median(errors) < 0.4, errors
    coeffs = [float.fromhex(c) for c in online["coefficients"][-1]]
    assert coeffs[2] >= 0.8 * PER_UNIT_SECONDS, coeffs  # seconds per unit
    # Measured balance from call 10 on: near even with online; FLOPs move the wrong images.
    online_balance = _measured_balance(online, 9)
    architecture_balance = _measured_balance(architecture, 9)
    # (Seen on a shared 2-core machine: online 1.02-1.33, architecture 1.67-1.87.)
    assert online_balance + 0.2 < architecture_balance and architecture_balance > 1.5, (
        online_balance,
        architecture_balance,
    )


def test_a_slow_exchange_keeps_plans_home_and_every_rank_decides_the_same(three_runs):
    slow, online = three_runs["slow"], three_runs["online"]
    latency, bandwidth = slow["exchange"][-1]
    assert latency > 0.05, slow["exchange"]  # the 60 ms per all_to_all was measured
    # Once measured (from 4 calls that moved), no plan saves the ~200 ms its exchanges take.
    assert slow["reasons"][-4:] == ["exchange"] * 4, slow["reasons"]
    assert online["reasons"][-5:].count("applied") >= 3, online["reasons"]
    assert online["exchange"][-1][0] < latency


def test_worth_moving_flips_exactly_at_the_break_even():
    assert worth_moving(3.0, 2.0, 0.999)
    assert not worth_moving(3.0, 2.0, 1.0)  # a tie stays home
    assert not worth_moving(3.0, 2.0, 1.001)


def _break_even_plan(latency: float) -> object:
    # Two ranks, in seconds: rank 0 holds 3 s + 1 s, rank 1 holds 1 s. Moving the 1 s unit
    # (16 rows) saves exactly 1 s on the slowest rank (4 s -> 3 s).
    costs = [[3.0, 1.0], [1.0]]
    tokens = [[64, 16], [16]]
    model = ExchangeModel(
        latency=latency, seconds_per_byte=1e-3, pixel_bytes_per_row=8, output_bytes_per_row=4
    )
    config = fx_vitbal.BalanceConfig(max_len_ratio=math.inf)
    return solve_plan(costs, tokens, config=config, exchange_seconds=model.step_seconds)


def test_the_decision_flips_where_the_exchange_model_says_it_should():
    # Predicted exchange: 3 all_to_alls (pixels out, outputs home, output gradients out) of
    # latency L each, plus 1e-3 s per byte of the busiest rank: it sends (or receives) 16 rows of
    # 8 pixel bytes and moves 4 output bytes per row twice, 256 bytes: 3 L + 0.256 s.
    break_even = (1.0 - 0.256) / 3
    below = _break_even_plan(math.nextafter(break_even, 0.0) - 1e-12)
    assert below.applied and below.moved_tokens == 16
    at = _break_even_plan(break_even + 1e-12)
    assert not at.applied and at.reason == "exchange"
    # Without the exchange model (costs not in seconds), today's rule applies the plan.
    assert solve_plan([[3.0, 1.0], [1.0]], [[64, 16], [16]]).applied


def test_the_exchange_trade_off_decides_how_far_min_move_may_trail_lpt():
    rng = random.Random(0)
    for _ in range(30):
        costs = [[rng.uniform(0.1, 1.0) for _ in range(rng.randint(1, 6))] for _ in range(4)]
        tokens = [[rng.randint(4, 400) for _ in rank] for rank in costs]
        config = fx_vitbal.BalanceConfig(max_len_ratio=math.inf, trigger_threshold=0.0)
        crossing = []
        for spb in (0.0, 1e-6, 1e-5, 1e-4, 1e-2):
            model = ExchangeModel(
                latency=0.0, seconds_per_byte=spb, pixel_bytes_per_row=4, output_bytes_per_row=4
            )
            plan = solve_plan(costs, tokens, config=config, exchange_seconds=model.step_seconds)
            send, recv = _crossing(plan, tokens)
            crossing.append(max(s + r for s, r in zip(send, recv, strict=True)))
            if plan.applied:  # what it saves beats what its exchange costs
                saving = max(plan.loads_before) - max(plan.loads_after)
                assert saving > model.step_seconds(send, recv)
        # Dearer bytes never load the busiest link more, and at 10 ms per byte nothing moves.
        assert crossing == sorted(crossing, reverse=True) and crossing[-1] == 0, crossing


def test_dear_bytes_let_min_move_trail_lpt_by_more_than_the_fixed_slack():
    # Balancing exactly (LPT, or min-move within 1%) moves 1000-row units; at 20 us per byte a
    # plan 6% behind LPT that moves one 1000-row unit is predicted faster overall.
    costs = [[1.71, 1.55, 0.58, 1.04], [1.0, 0.82, 0.5]]
    tokens = [[1000, 10, 1000, 1000], [10, 1000, 500]]
    config = fx_vitbal.BalanceConfig(max_len_ratio=math.inf, trigger_threshold=0.0)
    model = ExchangeModel(
        latency=0.0, seconds_per_byte=2e-5, pixel_bytes_per_row=4, output_bytes_per_row=4
    )
    priced = solve_plan(costs, tokens, config=config, exchange_seconds=model.step_seconds)
    fixed = solve_plan(costs, tokens, config=dataclasses.replace(config, min_gain=0.0))
    lpt = solve_plan(costs, tokens, config=dataclasses.replace(config, strategy="lpt"))

    def total(plan):
        return max(plan.loads_after) + model.step_seconds(*_crossing(plan, tokens))

    assert priced.applied
    assert max(priced.loads_after) > max(lpt.loads_after) * (1 + MAKESPAN_SLACK)
    assert total(priced) < min(total(fixed), total(lpt))


def _crossing(plan, tokens):
    send, recv = [0] * len(tokens), [0] * len(tokens)
    for d, units in enumerate(plan.assignment):
        for src, idx in units:
            if src != d:
                send[src] += tokens[src][idx]
                recv[d] += tokens[src][idx]
    return send, recv


def test_exchange_fit_recovers_latency_and_bandwidth_and_forgets_a_stale_model():
    fit = ExchangeFit(window=20)
    for i, num_bytes in enumerate((1_000, 50_000, 200_000, 10_000_000, 3_000_000)):
        # The fastest rank's time is the collective's; the slower ones waited for others.
        seconds = 1e-4 + num_bytes / 1e9  # one timed all_to_all: the pixels'
        fit.observe([num_bytes, num_bytes // 2], [seconds, seconds + 0.01])
        assert (fit.coeffs is None) == (i + 1 < MIN_EXCHANGES)  # one slow call decides nothing
    assert fit.coeffs == pytest.approx((1e-4, 1e-9), rel=1e-6)
    for _ in range(STALE_AFTER):
        fit.observe([0, 0], [0.0, 0.0])  # plans kept home: nothing measured
    assert fit.coeffs is not None
    fit.observe([0, 0], [0.0, 0.0])
    assert fit.coeffs is None  # stale: the FLOP-era rule decides again, exchanges are re-measured


def test_the_settings_fingerprint_covers_the_online_settings_not_the_coefficients():
    config = fx_vitbal.BalanceConfig(cost_model="online")
    specs = [
        planner_spec(config, OnlineCost(prior=QuadraticCost())),
        planner_spec(config, OnlineCost(prior=QuadraticCost(), window=10)),
        planner_spec(
            config,
            OnlineCost(
                prior=ArchitectureCost(hidden=8, mlp_hidden=8, depth=1, in_dim=8, out_dim=8)
            ),
        ),
    ]
    assert len({settings_fingerprint(spec, 2, 2) for spec in specs}) == 3
    cost = json.loads(json.loads(specs[0])["cost"])
    assert set(cost) == {"kind", "prior", "window", "per_frame"}  # no coefficient in it


def _compiled_and_fx(rank: int, world: int) -> dict:
    from fx_vitbal.passes import apply_vit_balance_pass, symbolic_trace
    from fx_vitbal.tools.models import ViTConfig
    from fx_vitbal.tools.omni import LMConfig, OmniEncoderModel

    config = fx_vitbal.BalanceConfig(cost_model="online")
    grids = [[[1, 16, 12], [2, 4, 6]], [[1, 2, 2]]][rank]

    def model():
        torch.manual_seed(0)
        return OmniEncoderModel(ViTConfig(deepstack_indexes=(0,)), LMConfig(num_layers=1))

    results = {}
    ways = {
        "compiled": lambda: torch.compile(
            fx_vitbal.enable_vit_balance(model(), config=config), backend="aot_eager"
        ),
        "fx": lambda: apply_vit_balance_pass(symbolic_trace(model()), config=config),
    }
    for name, build in ways.items():
        reset()
        stats = []
        handle = add_stats_callback(stats.append)
        step = build()
        for _ in range(2):
            train_step(step, grids, rank, reduce_grads=False)
        handle.remove()
        results[name] = [(s.reason, s.measured_seconds) for s in stats]
    return results


def test_compiled_and_fx_graph_calls_plan_online_but_report_no_time():
    results = run_ranks(_compiled_and_fx, 2)
    for name in ("compiled", "fx"):
        calls = results[0][name]
        assert len(calls) == 2 and all(reason == "applied" for reason, _ in calls), calls
        # Nothing timed (the same ViT in eager reports its first call at the second: the test
        # above), so the plan op plans with the online model's prior.
        assert all(seconds == [None, None] for _, seconds in calls), calls


class _Event:
    """A stand-in ``torch.cuda.Event``: done once ``_Event.done``; 1 ms between records."""

    done = False
    clock = 0.0

    def __init__(self, enable_timing: bool) -> None:
        assert enable_timing

    def record(self, stream) -> None:
        assert stream == ("stream of", torch.device("cuda", 1)), stream  # the data's device
        _Event.clock += 1.0
        self.at = _Event.clock

    def query(self) -> bool:
        return _Event.done

    def elapsed_time(self, end) -> float:
        assert _Event.done, "elapsed_time would wait for the device"
        return end.at - self.at


def test_a_cuda_clock_reports_a_call_only_once_its_events_completed(monkeypatch):
    from fx_vitbal.measure.measurements import Measurements
    from fx_vitbal.plan.units import Plan

    monkeypatch.setattr(torch.cuda, "Event", _Event)
    # The current device is cuda:0; the ViT's data lives on cuda:1: its stream must be marked.
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: ("stream of", device))
    state = Measurements(OnlineCost(prior=QuadraticCost()))
    plan = Plan([[(0, 0)], [(1, 0)]], False, "balanced", [1.0, 1.0], [1.0, 1.0], 0.0, 0.0, 0)
    clock = state.begin(state.next_step(), plan, [[(1, 2, 2)], [(1, 2, 2)]], 2)
    vit = nn.Linear(1, 1)
    clock.forward_started(torch.device("cuda", 1))  # the ViT's device: records at 1 ms
    output = vit(torch.ones(1))
    clock.forward_ended([output], torch.ones(1), watch_parameters(vit))  # 2 ms
    output.sum().backward()  # backward from 3 ms to 4 ms
    assert state.report() == [0] * 5  # events still running: nothing reported, nothing waited
    _Event.done = True
    # Call 1: 1 ms forward + 2 ms backward (its end is recorded again at each parameter's
    # gradient: the weight's, then the bias's).
    assert state.report() == [1, 3_000_000, 0, 0, 0]
    assert state.report() == [0] * 5  # reported once


def test_the_clock_times_the_pixels_exchange_only():
    from fx_vitbal.measure.clock import StepClock

    clock = StepClock(1)
    timed = [clock.timing_exchange(False, torch.device("cpu"))]  # redistribute: pixels out
    clock.forward_started(torch.device("cpu"))
    output = nn.Linear(1, 1)(torch.ones(1))
    clock.forward_ended([output], torch.ones(1), None)
    # The outputs' exchange follows the ViT, whose imbalance it would absorb as waiting.
    timed.append(clock.timing_exchange(True, torch.device("cpu")))  # restore: outputs home
    # restore's backward: gradients out
    timed.append(clock.timing_exchange(False, torch.device("cpu")))
    assert timed == [True, False, False]


def test_a_call_without_backward_is_complete_after_its_forward():
    from fx_vitbal.measure.clock import StepClock

    clock = StepClock(1)
    clock.forward_started(torch.device("cpu"))
    clock.forward_ended([torch.ones(1)], torch.ones(1), None)  # a frozen ViT, eval or no_grad
    assert clock.totals_ns() is not None


def _reset_alone(rank: int, world: int) -> dict:
    config = fx_vitbal.BalanceConfig(cost_model="online", max_len_ratio=math.inf)
    vit = OverheadViT()
    out = {}
    _train(vit, config, 3, rank)
    if rank == 1:  # its fit starts over; rank 0's has seen 3 calls
        reset()
    with pytest.raises(ValueError) as info:
        _train(vit, config, 1, rank)
    out["error"] = str(info.value)
    reset()  # on every rank: the next call is in lockstep again
    out["after"] = _summary(_train(vit, config, 2, rank))["reasons"]
    return out


def test_an_online_fit_reset_on_one_rank_raises_the_same_error_on_every_rank():
    results = run_ranks(_reset_alone, 2)
    assert results[0]["error"] == results[1]["error"]
    assert "on the calls measured" in results[0]["error"]
    assert results[0]["after"] == results[1]["after"] and len(results[0]["after"]) == 2
    assert "applied" in results[0]["after"]  # balanced again, in lockstep


def test_a_cuda_clock_marks_the_pixels_exchange_on_the_datas_device(monkeypatch):
    from fx_vitbal.measure.clock import StepClock

    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: ("stream of", device))
    clock = StepClock(1)
    assert clock.timing_exchange(False, torch.device("cuda", 1))  # redistribute: pixels out
    assert isinstance(clock.mark(), _Event)  # recorded on cuda:1's stream (``_Event.record``)
