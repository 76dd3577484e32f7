"""Tests for the planner: property tests over random batches, then hand-built cases for each rule.

The properties hold for any input; the hand cases pin down each documented decision (skip reasons,
the memory cap, history) on inputs small enough to check by eye.
"""

import contextlib
import copy
import dataclasses
import functools
import itertools
import math
from unittest import mock

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode

from fx_vitbal.config import BalanceConfig
from fx_vitbal.cost import ArchitectureCost, PolynomialCost, QuadraticCost
from fx_vitbal.plan import units as _units_module
from fx_vitbal.plan.candidates import cap_unkeepable as _cap_unkeepable
from fx_vitbal.plan.greedy import _best_step
from fx_vitbal.plan.greedy import place as _place
from fx_vitbal.plan.min_move import best_fit as _best_fit
from fx_vitbal.plan.shed import shed_over_target as _shed_over_target
from fx_vitbal.plan.solve import MAKESPAN_SLACK, solve_plan
from fx_vitbal.plan.units import Units as _Units
from fx_vitbal.plan.units import imbalance
from fx_vitbal.plan.units import sequential_sums as _sequential_sums
from fx_vitbal.tools.workloads import sample_batches

REASONS = {"applied", "balanced", "no-gain", "cap", "dominant-unit", "single-rank", "empty"}
QWEN2_VL_7B = ArchitectureCost(hidden=1280, mlp_hidden=5120, depth=32, in_dim=1176, out_dim=3584)
COST_MODELS = [
    QuadraticCost(),
    PolynomialCost(1e-4, 1.0, 100.0),
    QWEN2_VL_7B,
    dataclasses.replace(QWEN2_VL_7B, full_attention_layers=4, window_patches=64),
]
# Sized so the file runs in well under 30 s on two cores.
PROPERTY_SETTINGS = settings(max_examples=100, deadline=None)


@dataclasses.dataclass
class Case:
    costs: list[list[float]]
    tokens: list[list[int]]
    config: BalanceConfig
    history: list[float] | None


# One integer per unit (drawing three per unit made generation the bottleneck); it shrinks towards
# the smallest grid (1, 2, 2).
GRID_CODES = st.integers(0, 4 * 48 * 48 - 1)


def decode_grid(code: int) -> tuple[int, int, int]:
    t, hw = divmod(code, 48 * 48)
    h, w = divmod(hw, 48)
    return 1 + t, 2 + 2 * h, 2 + 2 * w


CONFIGS = st.builds(
    BalanceConfig,
    trigger_threshold=st.sampled_from([0.0, 0.05, 0.2]),
    max_len_ratio=st.sampled_from([None, math.inf, 1.0, 1.2, 2.0]),
    tolerance=st.sampled_from([0.0, 0.05]),
    max_iters=st.sampled_from([0, 3, 20]),
    strategy=st.sampled_from(["min-move", "lpt"]),
    skip_rule=st.sampled_from(["no-gain", "seed"]),
    min_gain=st.sampled_from([0.0, 0.02, 0.1]),
)


@st.composite
def cases(draw, configs=CONFIGS) -> Case:
    num_ranks = draw(st.integers(1, 16))
    if draw(st.integers(0, 9)) == 0:
        grids = [[] for _ in range(num_ranks)]  # sometimes nothing at all
    else:
        codes = st.lists(st.lists(GRID_CODES, max_size=12), min_size=num_ranks, max_size=num_ranks)
        grids = [[decode_grid(c) for c in rank] for rank in draw(codes)]
    model = draw(st.sampled_from(COST_MODELS))
    costs = [[model(*g) for g in rank] for rank in grids]
    tokens = [[math.prod(g) for g in rank] for rank in grids]
    history = None
    if draw(st.booleans()):
        scale = max((c for rank in costs for c in rank), default=1.0)
        fractions = st.floats(0.0, 3.0, allow_nan=False)
        history = [
            f * scale for f in draw(st.lists(fractions, min_size=num_ranks, max_size=num_ranks))
        ]
    return Case(costs, tokens, draw(configs), history)


def plan_of(case: Case, **overrides):
    config = dataclasses.replace(case.config, **overrides)
    return solve_plan(case.costs, case.tokens, config=config, history=case.history)


@contextlib.contextmanager
def executed(*, small: bool):
    """Plan (and build ``Units``) on Python lists (``small``) or by torch ops, whatever the size."""
    with mock.patch.object(_units_module, "SMALL_UNITS", 1 << 62 if small else -1):
        yield


def identity(counts: list[int]) -> list[list[tuple[int, int]]]:
    return [[(r, i) for i in range(n)] for r, n in enumerate(counts)]


def recomputed_loads(case: Case, assignment) -> list[float]:
    loads = list(case.history) if case.history is not None else [0.0] * len(case.costs)
    for d, units in enumerate(assignment):
        for src, idx in units:
            loads[d] += case.costs[src][idx]
    return loads


def makespan(plan) -> float:
    return max(plan.loads_after)


def rows_of(case: Case, assignment) -> list[int]:
    return [sum(case.tokens[s][i] for s, i in units) for units in assignment]


def row_cap(case: Case) -> float:
    """The cap ``BalanceConfig.max_len_ratio`` documents, computed independently."""
    ratio = case.config.max_len_ratio
    if ratio is None:
        return max(map(sum, case.tokens))
    return ratio * sum(map(sum, case.tokens)) / len(case.tokens)


# Values whose sums depend on the order they are added in (1e16 + 1.0 == 1e16).
ORDER_SENSITIVE = st.sampled_from([1e16, 7e15, 1.0, 3.3, 0.1, 1e-8, 0.0, 2.5e-300, 1.7e308])


@PROPERTY_SETTINGS
@given(st.lists(st.lists(ORDER_SENSITIVE, max_size=90), min_size=1, max_size=40))
@example([[1e16] + [1.0] * 69, [1.0] * 3])  # a group past the padded width
def test_sequential_sums_add_each_group_in_order_as_a_plain_loop(groups):
    """The reported loads' bits: each group summed in order from 0.0 (short groups by one
    cumsum over rows, long ones each by its own), on the torch the suite runs."""
    sizes_G = torch.tensor([len(g) for g in groups], dtype=torch.int64)
    values_F = torch.tensor([v for g in groups for v in g], dtype=torch.float64)
    group_U = torch.repeat_interleave(torch.arange(len(groups)), sizes_G)
    got = _sequential_sums(values_F, group_U, sizes_G).tolist()
    want = [functools.reduce(float.__add__, g, 0.0) for g in groups]
    assert [x.hex() for x in got] == [x.hex() for x in want]


@PROPERTY_SETTINGS
@given(cases())
def test_assignment_is_a_sorted_permutation_of_all_units(case):
    plan = plan_of(case)
    counts = [len(rank) for rank in case.costs]
    assert len(plan.assignment) == len(counts)
    assert sorted(u for units in plan.assignment for u in units) == sum(identity(counts), [])
    assert all(units == sorted(units) for units in plan.assignment)


@PROPERTY_SETTINGS
@given(cases(), st.randoms(use_true_random=False))
def test_one_ranks_reads_match_the_whole_assignment(case, rng):
    """A step reads only its own rank's list and destinations, each made on first read: in any
    order, before or after the whole is built, they are the whole assignment's."""
    whole = list(plan_of(case).assignment)
    plan = plan_of(case)
    ranks = list(range(len(whole)))
    rng.shuffle(ranks)
    for rank in ranks:
        assert plan.assignment[rank] == whole[rank]
        dest = plan.destinations(rank)
        assert len(dest) == len(case.costs[rank])
        assert all((rank, i) in whole[d] for i, d in enumerate(dest))
    assert plan.assignment[-1] == whole[-1] and plan.assignment[1:] == whole[1:]
    assert plan.assignment == whole and list(plan.assignment) == whole


@PROPERTY_SETTINGS
@given(cases())
def test_skipped_plan_is_the_identity_and_reason_is_documented(case):
    plan = plan_of(case)
    assert plan.reason in REASONS
    assert plan.applied == (plan.reason == "applied")
    if not plan.applied:
        assert plan.assignment == identity([len(rank) for rank in case.costs])
        assert plan.moved_tokens == 0
        assert plan.loads_after == plan.loads_before


@PROPERTY_SETTINGS
@given(cases())
def test_makespan_never_grows_and_applied_plans_gain_at_least_min_gain(case):
    plan = plan_of(case)
    assert makespan(plan) <= max(plan.loads_before)
    if plan.applied:
        assert makespan(plan) <= max(plan.loads_before) * (1 - case.config.min_gain)


@PROPERTY_SETTINGS
@given(cases())
def test_reported_loads_imbalance_and_moved_tokens_match_the_assignment(case):
    plan = plan_of(case)
    home = identity([len(rank) for rank in case.costs])
    assert plan.loads_before == pytest.approx(recomputed_loads(case, home), rel=1e-12)
    assert plan.loads_after == pytest.approx(recomputed_loads(case, plan.assignment), rel=1e-12)
    assert plan.imbalance_before == pytest.approx(imbalance(plan.loads_before), rel=1e-12)
    assert plan.imbalance_after == pytest.approx(imbalance(plan.loads_after), rel=1e-12)
    moved = sum(
        case.tokens[src][idx]
        for d, units in enumerate(plan.assignment)
        for src, idx in units
        if src != d
    )
    assert plan.moved_tokens == moved


@PROPERTY_SETTINGS
@given(cases())
def test_history_is_added_to_the_loads_before(case):
    plan = plan_of(case)
    base = case.history or [0.0] * len(case.costs)
    expected = [h + sum(rank) for h, rank in zip(base, case.costs, strict=True)]
    assert plan.loads_before == pytest.approx(expected, rel=1e-12)


@PROPERTY_SETTINGS
@given(cases())
def test_same_input_gives_the_same_plan(case):
    first = plan_of(case)
    again = solve_plan(
        copy.deepcopy(case.costs),
        copy.deepcopy(case.tokens),
        config=case.config,
        history=copy.deepcopy(case.history),
    )
    assert again == first


@PROPERTY_SETTINGS
@given(cases())
def test_cap_respected_flag_is_truthful(case):
    plan = plan_of(case)
    cap = row_cap(case)
    rows = rows_of(case, plan.assignment)
    within = all(
        n <= cap or len(units) <= 1 for n, units in zip(rows, plan.assignment, strict=True)
    )
    assert plan.cap_respected == within


@st.composite
def default_cap_cases(draw) -> Case:
    """Any case under the default cap, sometimes with one unit larger than all the others
    together (its rank alone sets the cap)."""
    case = draw(cases(configs=CONFIGS.map(lambda c: dataclasses.replace(c, max_len_ratio=None))))
    if draw(st.booleans()):
        r = draw(st.integers(0, len(case.costs) - 1))
        total = sum(map(sum, case.tokens))
        case.tokens[r].append(2 * total + 1)
        case.costs[r].append(2.0 * sum(map(sum, case.costs)) + 1.0)
    return case


@settings(max_examples=300, deadline=None)
@given(default_cap_cases())
def test_default_plan_never_raises_any_rank_above_the_fullest_rank_before(case):
    plan = plan_of(case)
    assert plan.cap_respected
    assert max(rows_of(case, plan.assignment)) <= max(map(sum, case.tokens))


@PROPERTY_SETTINGS
@given(cases(configs=CONFIGS.filter(lambda c: c.max_len_ratio not in (None, math.inf))))
def test_explicit_ratio_kept_whenever_the_current_layout_keeps_it(case):
    cap = row_cap(case)
    home_rows = list(map(sum, case.tokens))
    if any(n > cap and len(rank) > 1 for n, rank in zip(home_rows, case.tokens, strict=True)):
        return
    plan = plan_of(case)
    assert plan.cap_respected
    for n, units in zip(rows_of(case, plan.assignment), plan.assignment, strict=True):
        assert n <= cap or len(units) == 1  # only a lone unit may exceed it


@PROPERTY_SETTINGS
@given(cases())
def test_applied_plan_respects_a_cap_with_room_for_the_largest_unit(case):
    total = sum(sum(rank) for rank in case.tokens)
    largest = max((n for rank in case.tokens for n in rank), default=0)
    if total == 0:
        return
    mean = total / len(case.tokens)
    # mean * ratio >= mean + largest: the least-filled rank can always take one more unit.
    ratio = 1 + largest / mean
    plan = plan_of(case, max_len_ratio=ratio)
    if not plan.applied:
        return
    assert plan.cap_respected
    for units in plan.assignment:
        if len(units) > 1:
            assert sum(case.tokens[s][i] for s, i in units) <= mean * ratio


NO_TRIGGER = CONFIGS.map(lambda c: dataclasses.replace(c, trigger_threshold=0.0, min_gain=0.0))


@PROPERTY_SETTINGS
@given(cases(configs=NO_TRIGGER))
def test_min_move_makespan_is_within_the_slack_of_lpt(case):
    min_move = plan_of(case, strategy="min-move")
    lpt = plan_of(case, strategy="lpt")
    if min_move.cap_respected == lpt.cap_respected:  # keeping a cap LPT breaks comes first
        assert makespan(min_move) <= makespan(lpt) * (1 + MAKESPAN_SLACK) * (1 + 1e-9)
    # Unless min-move got within the slack of the lower bound on its own (then LPT never ran),
    # LPT is one of its candidates: while it is as good, min-move moves no more.
    if (
        makespan(min_move) > lower_bound(case) * (1 + MAKESPAN_SLACK)
        and min_move.applied
        and lpt.applied
        and min_move.cap_respected == lpt.cap_respected
        and makespan(lpt) <= makespan(min_move) * (1 + MAKESPAN_SLACK)
    ):
        assert min_move.moved_tokens <= lpt.moved_tokens


@PROPERTY_SETTINGS
@given(cases(configs=NO_TRIGGER.map(lambda c: dataclasses.replace(c, max_len_ratio=math.inf))))
def test_min_move_keeps_every_unit_home_when_home_is_within_the_slack(case):
    lpt = plan_of(case, strategy="lpt")
    if max(lpt.loads_before) > makespan(lpt) * (1 + MAKESPAN_SLACK) * (1 - 1e-9):
        return
    min_move = plan_of(case, strategy="min-move")
    # A plan within the slack of the lower bound is taken before LPT runs (solve_plan's
    # documented trade-off): with min_gain=0 it may move rows where home trails LPT by < 1%.
    if makespan(min_move) <= lower_bound(case) * (1 + MAKESPAN_SLACK):
        return
    assert min_move.moved_tokens == 0


@PROPERTY_SETTINGS
@given(
    cases(
        configs=NO_TRIGGER.map(
            lambda c: dataclasses.replace(
                c, max_len_ratio=None, strategy="min-move", skip_rule="no-gain"
            )
        )
    )
)
def test_default_cap_still_lowers_the_makespan_when_one_move_can(case):
    plan = plan_of(case)
    loads = plan.loads_before
    hi = loads.index(max(loads))
    lo = loads.index(min(loads))
    others = max((x for r, x in enumerate(loads) if r != hi), default=0.0)
    rows = list(map(sum, case.tokens))
    # min-move may stay within MAKESPAN_SLACK of the best plan it knows: ask for more gain.
    lowers = [
        max(loads[hi] - c, loads[lo] + c, others) * (1 + MAKESPAN_SLACK) < loads[hi]
        and rows[lo] + n <= max(rows)
        for c, n in zip(case.costs[hi], case.tokens[hi], strict=True)
    ]
    if len(loads) > 1 and any(lowers):
        assert plan.applied
        assert makespan(plan) < max(loads)


@dataclasses.dataclass
class Placement:
    """A placement problem: units in the order they are placed (cost descending, ties by id),
    each with its integer cost, rows and home rank, and every rank's load, rows and units."""

    costs: list[int]
    needs: list[int]
    homes: list[int]
    loads: list[int]
    rows: list[int]
    counts: list[int]
    cap: int
    home_fill: float

    def state(self):
        return self.loads[:], self.rows[:], self.counts[:]


@st.composite
def placements(draw):
    """A placement problem with many ties: small integer costs, loads and rows."""
    num_ranks = draw(st.integers(1, 12))
    small = st.integers(0, 6)
    units = draw(st.lists(st.tuples(small, small, st.integers(0, num_ranks - 1)), max_size=30))
    units.sort(key=lambda unit: -unit[0])  # stable: ties keep their (id) order
    loads = draw(st.lists(small, min_size=num_ranks, max_size=num_ranks))
    rows = draw(st.lists(small, min_size=num_ranks, max_size=num_ranks))
    counts = draw(st.lists(st.integers(0, 2), min_size=num_ranks, max_size=num_ranks))
    cap = draw(st.integers(0, 12))
    home_fill = draw(st.sampled_from([-math.inf, 3.0, 8.0]))
    costs, needs, homes = (list(c) for c in zip(*units, strict=True)) if units else ([], [], [])
    return Placement(costs, needs, homes, loads, rows, counts, cap, home_fill)


def place_by_scanning(problem: Placement, loads, rows, counts, home_fill, units=None, dest=None):
    """What ``_place`` documents, by scanning every rank for every unit."""
    units = range(len(problem.costs)) if units is None else units
    dest = [-1] * len(problem.costs) if dest is None else dest
    for k in units:
        home, need, cost = problem.homes[k], problem.needs[k], problem.costs[k]
        fitting = [r for r in range(len(loads)) if counts[r] == 0 or rows[r] + need <= problem.cap]
        if home in fitting and loads[home] + cost <= home_fill:
            d = home
        elif not fitting:
            d = min(range(len(loads)), key=lambda r: (rows[r], r))
        else:
            d = min(fitting, key=lambda r: (loads[r], r))
            if home in fitting and loads[home] == loads[d]:
                d = home
        dest[k] = d
        loads[d] += cost
        rows[d] += need
        counts[d] += 1
    return dest


@settings(max_examples=300, deadline=None)
@given(placements())
def test_capped_placement_is_the_documented_scan(problem):
    loads, rows, counts = problem.state()
    expected = place_by_scanning(problem, *problem.state(), problem.home_fill)
    p = problem
    placed = _place(p.costs, p.needs, p.homes, loads, rows, counts, p.cap, p.home_fill)
    assert placed == expected


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 8), st.integers(0, 6)), max_size=6),
    st.lists(st.tuples(st.integers(0, 8), st.integers(0, 6)), max_size=6),
    st.integers(0, 20),
    st.sampled_from([math.inf, 6, 10, 14]),
)
def test_refinement_step_is_the_best_over_every_pair(hi, lo, base_gap, cap):
    cost = [c for c, _ in hi] + [c for c, _ in lo]
    tokens = [n for _, n in hi] + [n for _, n in lo]
    on_hi, on_lo = list(range(len(hi))), list(range(len(hi), len(hi) + len(lo)))
    load_lo = sum(c for c, _ in lo)
    load_hi = max(sum(c for c, _ in hi), load_lo + base_gap)
    tokens_hi, tokens_lo = sum(n for _, n in hi), sum(n for _, n in lo)
    gap = load_hi - load_lo
    steps = [
        (max(load_hi - delta, load_lo + delta), u, v)
        for u in on_hi
        for v in [-1, *on_lo]
        if 0 < (delta := cost[u] - (cost[v] if v >= 0 else 0)) < gap
        and tokens_lo + (shift := tokens[u] - (tokens[v] if v >= 0 else 0)) <= cap
        and tokens_hi - shift <= cap
    ]
    expected = min(steps)[1:] if steps else None
    args = (on_hi, on_lo, gap, load_hi, load_lo, tokens_hi, tokens_lo, cost, tokens, cap)
    assert _best_step(*args) == expected


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 4),
    st.lists(st.integers(0, 12), max_size=5),
    st.integers(0, 30),
)
def test_cap_called_unkeepable_is_broken_by_every_assignment(num_ranks, rows, cap):
    units = _Units([[1.0] * len(rows)] + [[]] * (num_ranks - 1), [rows] + [[]] * (num_ranks - 1))
    if not _cap_unkeepable(units, cap):
        return
    for dest in itertools.product(range(num_ranks), repeat=len(rows)):
        held = [[n for d, n in zip(dest, rows, strict=True) if d == r] for r in range(num_ranks)]
        assert any(len(h) > 1 and sum(h) > cap for h in held)


def best_fit_by_scanning(problem: Placement, limit):
    """What ``_best_fit`` documents, by scanning every rank for every unit."""
    loads, rows, counts = problem.state()
    dest, misfits = [-1] * len(problem.costs), []
    for k, (cost, need) in enumerate(zip(problem.costs, problem.needs, strict=True)):
        fitting = [
            r
            for r in range(len(loads))
            if (counts[r] == 0 or rows[r] + need <= problem.cap) and loads[r] <= limit - cost
        ]
        if not fitting:
            misfits.append(k)
            continue
        d = max(fitting, key=lambda r: (loads[r], r))  # the least room left under the limit
        dest[k] = d
        loads[d] += cost
        rows[d] += need
        counts[d] += 1
    return place_by_scanning(problem, loads, rows, counts, -math.inf, misfits, dest)


@settings(max_examples=300, deadline=None)
@given(placements(), st.sampled_from([0.0, 5.0, 9.0, 14.0, math.inf]), st.booleans())
def test_best_fit_is_the_documented_scan(problem, limit, keyed):
    expected = best_fit_by_scanning(problem, limit)
    loads, rows, counts = problem.state()
    bits = max(1, (len(loads) - 1).bit_length())
    # The ranks by load as the planner hands them over (torch-sorted keys), or sorted inside.
    by_load = sorted((load << bits) | r for r, load in enumerate(loads)) if keyed else None
    p = problem
    placed = _best_fit(p.costs, p.needs, p.homes, loads, rows, counts, p.cap, limit, by_load)
    assert placed == expected


@st.composite
def shedding_problems(draw):
    """Small integer costs and rows with many ties and zeros, sometimes history and a cap."""
    num_ranks = draw(st.integers(1, 10))
    small = st.sampled_from([0, 1, 2, 3, 5, 8, 13, 40])
    costs = draw(
        st.lists(st.lists(small.map(float), max_size=7), min_size=num_ranks, max_size=num_ranks)
    )
    tokens = [draw(st.lists(st.integers(0, 9), min_size=len(r), max_size=len(r))) for r in costs]
    history = draw(
        st.none() | st.lists(st.integers(0, 30).map(float), min_size=num_ranks, max_size=num_ranks)
    )
    return (
        costs,
        tokens,
        history,
        draw(st.sampled_from([math.inf, 0, 3, 8, 15, 30])),
        draw(st.integers(0, 60)),
    )


@settings(max_examples=500, deadline=None)
@given(shedding_problems())
def test_shedding_by_torch_ops_is_the_rule_rank_by_rank(problem):
    costs, tokens, history, cap, target = problem
    with executed(small=True):
        units = _Units(costs, tokens, history)
    with executed(small=False):
        tensors = _Units(costs, tokens, history)
    if not units.num_units or units.total_before == 0:
        return
    accept = target << units.scale_exp if units.scale_exp >= 0 else target >> -units.scale_exp
    shed = _shed_over_target(units, cap, accept)
    assert _shed_over_target(tensors, cap, accept) == shed
    gone = set(shed.ids)
    assert shed.ids == sorted(gone, key=lambda u: (-units.cost[u], u))
    for r in range(units.num_ranks):
        kept = [u for u in units.home_ids(r) if u not in gone]
        assert shed.loads[r] == units.base_fixed[r] + sum(units.cost[u] for u in kept)
        assert shed.rows[r] == sum(units.tokens[u] for u in kept)
        assert shed.counts[r] == len(kept)
        assert shed.rows[r] <= cap or shed.counts[r] <= 1


def realistic_case(num_ranks: int, images_per_rank: int, seed: int) -> Case:
    grids = sample_batches(num_ranks, images_per_rank, mix="realistic", seed=seed)
    costs = [[QWEN2_VL_7B(*g) for g in rank] for rank in grids]
    tokens = [[math.prod(g) for g in rank] for rank in grids]
    return Case(costs, tokens, BalanceConfig(trigger_threshold=0.0, min_gain=0.0), None)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_min_move_moves_far_fewer_tokens_than_lpt_on_realistic_batches(seed):
    case = realistic_case(64, 8, seed)
    min_move = plan_of(case, strategy="min-move")
    lpt = plan_of(case, strategy="lpt")
    assert min_move.applied and lpt.applied
    assert makespan(min_move) <= makespan(lpt) * (1 + MAKESPAN_SLACK) * (1 + 1e-9)
    assert min_move.moved_tokens < 0.6 * lpt.moved_tokens


# Regression cases: each once broke the property it tests.


@pytest.mark.parametrize(
    ("costs", "tokens", "overrides"),
    [
        pytest.param(
            [[], [16.0, 64.0, 64.0], []],
            [[], [4, 8, 8], []],
            {},
            id="excess-covered-by-two-large-units",
        ),
        pytest.param(
            [[], [16.0, 1600.0]],
            [[], [4, 40]],
            {"max_len_ratio": 1.0, "trigger_threshold": 0.0, "min_gain": 0.0},
            id="row-cap-only",
        ),
    ],
)
def test_min_move_moves_no_more_tokens_than_lpt(costs, tokens, overrides):
    config = dataclasses.replace(BalanceConfig(), **overrides)
    min_move = solve_plan(costs, tokens, config=config)
    lpt = solve_plan(costs, tokens, config=dataclasses.replace(config, strategy="lpt"))
    assert min_move.moved_tokens <= lpt.moved_tokens


def test_zero_gain_plan_is_skipped_even_with_min_gain_zero():
    config = BalanceConfig(strategy="lpt", trigger_threshold=0.0, min_gain=0.0)
    plan = solve_plan([[1.0, 1.0], [2.0]], [[1, 1], [2]], config=config)
    assert (plan.reason, plan.moved_tokens) == ("no-gain", 0)


@pytest.mark.parametrize(
    ("costs", "tokens", "ratio"),
    [
        ([[0.0, 0.0, 1.0, 1.0], [0.0]], [[1, 1, 1, 1], [4]], 1.0),
        ([[8.0, 8.0], [1.0], [4.0]], [[10, 10], [30], [2]], 1.5),
    ],
)
@pytest.mark.parametrize("strategy", ["min-move", "lpt"])
def test_applied_plan_keeps_a_row_cap_that_the_identity_respects(costs, tokens, ratio, strategy):
    config = BalanceConfig(max_len_ratio=ratio, strategy=strategy)
    identity_plan = solve_plan(
        costs, tokens, config=dataclasses.replace(config, trigger_threshold=9.0)
    )
    assert identity_plan.cap_respected
    assert solve_plan(costs, tokens, config=config).cap_respected


# Hand cases: one per decision.


def test_imbalance_is_max_over_mean_minus_one():
    assert imbalance([3.0, 1.0]) == 0.5
    assert imbalance([2.0, 2.0]) == 0.0
    assert imbalance([0.0, 0.0]) == 0.0


def test_imbalance_below_trigger_is_skipped_as_balanced():
    plan = solve_plan([[10.0], [11.0]], [[1], [1]])
    assert (plan.applied, plan.reason) == (False, "balanced")
    assert plan.assignment == [[(0, 0)], [(1, 0)]]


def test_equal_loads_are_balanced_and_without_trigger_give_no_gain():
    costs, tokens = [[3.0, 3.0]] * 3, [[1, 1]] * 3
    assert solve_plan(costs, tokens).reason == "balanced"
    assert (
        solve_plan(costs, tokens, config=BalanceConfig(trigger_threshold=0.0)).reason == "no-gain"
    )


DOMINANT = (
    [[100.0, 10.0, 10.0, 10.0], [10.0], [10.0], [10.0]],
    [[100, 10, 10, 10], [10], [10], [10]],
)


def test_seed_rule_skips_when_one_unit_costs_more_than_the_mean_load():
    plan = solve_plan(*DOMINANT, config=BalanceConfig(skip_rule="seed"))
    assert (plan.applied, plan.reason) == (False, "dominant-unit")


@pytest.mark.parametrize("strategy", ["min-move", "lpt"])
def test_default_rule_sheds_the_other_units_of_the_dominant_units_rank(strategy):
    plan = solve_plan(*DOMINANT, config=BalanceConfig(strategy=strategy))
    assert (plan.applied, plan.reason) == (True, "applied")
    assert plan.assignment[0] == [(0, 0)]  # the 100 stays home, alone
    assert makespan(plan) == 100.0  # the lower bound: 130 before


@pytest.mark.parametrize("strategy", ["min-move", "lpt"])
def test_unsplittable_makespan_is_skipped_as_no_gain(strategy):
    plan = solve_plan([[100.0], [1.0]], [[1], [1]], config=BalanceConfig(strategy=strategy))
    assert (plan.applied, plan.reason) == (False, "no-gain")
    assert plan.assignment == [[(0, 0)], [(1, 0)]]


def test_gain_below_min_gain_is_skipped():
    costs, tokens = [[10.0, 1.0], [9.0]], [[10, 1], [9]]  # best plan: 11 -> 10, a 9% gain
    skipped = solve_plan(costs, tokens, config=BalanceConfig(trigger_threshold=0.0, min_gain=0.1))
    applied = solve_plan(costs, tokens, config=BalanceConfig(trigger_threshold=0.0, min_gain=0.05))
    assert skipped.reason == "no-gain"
    assert applied.reason == "applied"
    assert (applied.loads_after, applied.moved_tokens) == ([10.0, 10.0], 1)


def test_single_rank_is_skipped():
    plan = solve_plan([[5.0, 1.0]], [[5, 1]])
    assert (plan.applied, plan.reason) == (False, "single-rank")
    assert plan.assignment == [[(0, 0), (0, 1)]]


@pytest.mark.parametrize(
    ("costs", "history"),
    [([[], [], []], None), ([[], [], []], [5.0, 0.0, 0.0]), ([[0.0], [0.0, 0.0], []], None)],
)
def test_no_work_is_skipped_as_empty(costs, history):
    tokens = [[1] * len(rank) for rank in costs]
    plan = solve_plan(costs, tokens, history=history)
    assert (plan.applied, plan.reason) == (False, "empty")
    assert plan.assignment == identity([len(rank) for rank in costs])


@pytest.mark.parametrize("strategy", ["min-move", "lpt"])
def test_empty_ranks_receive_work(strategy):
    costs, tokens = [[5.0] * 4, [], [], []], [[5] * 4, [], [], []]
    plan = solve_plan(costs, tokens, config=BalanceConfig(strategy=strategy))
    assert plan.applied
    assert [len(units) for units in plan.assignment] == [1, 1, 1, 1]
    assert plan.loads_after == [5.0] * 4
    assert plan.moved_tokens == 15


@pytest.mark.parametrize("strategy", ["min-move", "lpt"])
def test_giant_unit_stays_home_and_small_ones_spread(strategy):
    costs = [[1000.0, 50.0, 50.0], [50.0, 50.0], [50.0], []]
    tokens = [[1000, 50, 50], [50, 50], [50], []]
    plan = solve_plan(costs, tokens, config=BalanceConfig(strategy=strategy))
    assert plan.applied
    assert plan.assignment[0] == [(0, 0)]
    assert makespan(plan) == 1000.0


def test_min_move_sends_only_what_must_move():
    # LPT deals the three 100s onto ranks 0, 1, 2 (all move); min-move ships one 50 to rank 0.
    costs = [[], [100.0, 50.0], [100.0], [100.0]]
    tokens = [[], [100, 50], [100], [100]]
    plan = solve_plan(costs, tokens)
    assert plan.assignment == [[(1, 1)], [(1, 0)], [(2, 0)], [(3, 0)]]
    assert plan.moved_tokens == 50
    assert solve_plan(costs, tokens, config=BalanceConfig(strategy="lpt")).moved_tokens == 350


def test_history_makes_a_loaded_rank_shed_work():
    costs, tokens = [[5.0, 5.0], [5.0, 5.0]], [[5, 5], [1, 1]]
    plan = solve_plan(costs, tokens, history=[10.0, 0.0])
    assert plan.loads_before == [20.0, 10.0]
    assert plan.loads_after == [15.0, 15.0]
    assert [len(units) for units in plan.assignment] == [1, 3]
    assert plan.moved_tokens == 5


def test_default_cap_skips_a_plan_that_would_raise_peak_rows():
    # The same loads, but rank 1 already holds as many rows as rank 0: taking a unit would raise
    # the peak from 10 to 15 rows.
    costs, tokens = [[5.0, 5.0], [5.0, 5.0]], [[5, 5], [5, 5]]
    plan = solve_plan(costs, tokens, history=[10.0, 0.0])
    assert (plan.applied, plan.assignment) == (False, identity([2, 2]))
    free = solve_plan(
        costs, tokens, history=[10.0, 0.0], config=BalanceConfig(max_len_ratio=math.inf)
    )
    assert free.applied


def test_row_cap_keeps_work_off_a_rank_already_full_of_rows():
    # Rank 1 holds one 30-row unit and the cap is 26 rows: uncapped, rank 1 takes more work;
    # capped, rank 0's spare unit goes to rank 2 instead.
    costs, tokens = [[8.0, 8.0], [1.0], [1.0]], [[10, 10], [30], [2]]
    free = solve_plan(costs, tokens, config=BalanceConfig(max_len_ratio=math.inf))
    capped = solve_plan(costs, tokens, config=BalanceConfig(max_len_ratio=1.5))
    assert free.applied and len(free.assignment[1]) > 1
    assert capped.applied and capped.cap_respected
    assert capped.assignment == [[(0, 0)], [(1, 0)], [(0, 1), (2, 0)]]
    assert makespan(capped) == 9.0


def test_unavoidable_cap_violation_is_reported():
    # Three 30-row units on two ranks under a 45-row cap: some rank must hold two.
    plan = solve_plan(
        [[5.0, 5.0], [1.0]], [[30, 30], [30]], config=BalanceConfig(max_len_ratio=1.0)
    )
    assert plan.cap_respected is False


@pytest.mark.parametrize(
    ("costs", "tokens", "history", "message"),
    [
        ([], [], None, "at least one rank"),
        ([[1.0]], [[1], [1]], None, "ranks but tokens"),
        ([[1.0, 2.0]], [[1]], None, "rank 0"),
        ([[1.0], [-1.0]], [[1], [1]], None, "rank 1: costs"),
        ([[math.nan]], [[1]], None, "costs must be finite"),
        ([[math.inf]], [[1]], None, "costs must be finite"),
        ([[1.0]], [[-1]], None, "token counts"),
        ([[1.0], [1.0]], [[1], [1]], [0.0], "history has 1 ranks"),
        ([[1.0], [1.0]], [[1], [1]], [0.0, -1.0], "history must be"),
        ([[1.0], [1.0]], [[1], [1]], [0.0, math.nan], "history must be"),
    ],
)
def test_invalid_input_raises_value_error(costs, tokens, history, message):
    with pytest.raises(ValueError, match=message):
        solve_plan(costs, tokens, history=history)


def test_any_sequences_of_numbers_give_the_plan_of_lists():
    costs, tokens = [[], [100.0, 50.0], [100.0], [100.0]], [[], [100, 50], [100], [100]]
    plan = solve_plan(costs, tokens)
    as_tuples = solve_plan(tuple(map(tuple, costs)), tuple(map(tuple, tokens)))
    # Whole numbers as floats, and ints as costs: converted as float() and int() convert them.
    as_other_numbers = solve_plan(
        [[int(c) for c in r] for r in costs], [[float(n) for n in r] for r in tokens]
    )
    assert plan == as_tuples == as_other_numbers
    assert plan.moved_tokens == 50


def test_destinations_invert_the_assignment():
    plan = solve_plan([[5.0] * 4, [], [], []], [[5] * 4, [], [], []])
    dest = [plan.destinations(r) for r in range(4)]
    assert [len(d) for d in dest] == [4, 0, 0, 0]
    for d, units in enumerate(plan.assignment):
        for src, idx in units:
            assert dest[src][idx] == d


# Node-aware planning (``BalanceConfig.ranks_per_node``, ``fx_vitbal.plan.nodes``).

NODE_CONFIGS = st.builds(
    dataclasses.replace, CONFIGS, ranks_per_node=st.sampled_from([None, 1, 2, 3, 4, 16])
)


def inter_node_rows(case: Case, assignment, ranks_per_node: int) -> int:
    """Rows computed on another node than their home rank's, recomputed from the assignment."""
    return sum(
        case.tokens[src][idx]
        for d, units in enumerate(assignment)
        for src, idx in units
        if src // ranks_per_node != d // ranks_per_node
    )


@PROPERTY_SETTINGS
@given(cases(configs=NODE_CONFIGS))
def test_node_aware_plans_keep_every_planner_property(case):
    plan = plan_of(case)
    # A sorted permutation of all units; a skipped plan is the identity.
    every = sorted((r, i) for r, rank in enumerate(case.costs) for i in range(len(rank)))
    assert sorted(u for units in plan.assignment for u in units) == every
    assert all(units == sorted(units) for units in plan.assignment)
    if not plan.applied:
        assert plan.assignment == identity([len(rank) for rank in case.costs])
    # The makespan never grows; reported fields match the assignment.
    assert makespan(plan) <= max(plan.loads_before)
    assert plan.loads_after == pytest.approx(recomputed_loads(case, plan.assignment), rel=1e-12)
    moved = sum(
        case.tokens[s][i] for d, units in enumerate(plan.assignment) for s, i in units if s != d
    )
    assert plan.moved_tokens == moved
    rpn = case.config.ranks_per_node
    expected = 0 if rpn is None else inter_node_rows(case, plan.assignment, rpn)
    assert plan.inter_node_tokens == expected <= moved
    # The cap flag is truthful, and the plan is the same when solved again.
    cap = row_cap(case)
    rows = rows_of(case, plan.assignment)
    assert plan.cap_respected == all(
        n <= cap or len(units) <= 1 for n, units in zip(rows, plan.assignment, strict=True)
    )
    assert (
        solve_plan(
            copy.deepcopy(case.costs),
            copy.deepcopy(case.tokens),
            config=case.config,
            history=copy.deepcopy(case.history),
        )
        == plan
    )


@PROPERTY_SETTINGS
@given(cases(configs=NO_TRIGGER.map(lambda c: dataclasses.replace(c, strategy="min-move"))))
def test_node_aware_min_move_stays_within_the_slack_of_lpt(case):
    # Crossing fewer rows than node-blind min-move is a heuristic's outcome, not a guarantee on
    # tiny inputs: the realistic-batch test below measures it.
    aware = plan_of(case, ranks_per_node=2)
    lpt = plan_of(case, strategy="lpt")
    if aware.cap_respected == lpt.cap_respected:
        assert makespan(aware) <= makespan(lpt) * (1 + MAKESPAN_SLACK) * (1 + 1e-9)


@PROPERTY_SETTINGS
@given(cases(configs=NODE_CONFIGS))
def test_one_rank_per_node_or_a_single_node_plans_as_node_blind(case):
    blind = plan_of(case, ranks_per_node=None)
    assert blind.inter_node_tokens == 0
    per_rank = plan_of(case, ranks_per_node=1)  # every rank its own node: every move crosses
    assert per_rank.assignment == blind.assignment
    assert per_rank.inter_node_tokens == blind.moved_tokens
    one_node = plan_of(case, ranks_per_node=max(1, len(case.costs)))
    assert one_node.assignment == blind.assignment
    assert one_node.inter_node_tokens == 0


def test_a_move_inside_the_node_is_preferred_to_one_across_nodes():
    # Rank 3 must shed its 2.0 unit; rank 1 (1.0 loaded, the other node) and rank 2 (empty, its
    # own node) both end at most at the 3.0 makespan.
    costs, tokens = [[], [1.0], [], [3.0, 2.0]], [[], [4], [], [12, 8]]
    config = BalanceConfig(trigger_threshold=0.0, min_gain=0.0, max_len_ratio=math.inf)
    blind = solve_plan(costs, tokens, config=config)
    assert blind.assignment[1] == [(1, 0), (3, 1)]  # best fit: the fuller rank
    aware = solve_plan(costs, tokens, config=dataclasses.replace(config, ranks_per_node=2))
    assert aware.assignment[2] == [(3, 1)]
    assert makespan(aware) == makespan(blind) == 3.0
    assert (aware.moved_tokens, aware.inter_node_tokens) == (8, 0)


def test_what_a_node_cannot_hold_crosses_nodes_and_is_reported():
    # Node 0 (ranks 0, 1) holds 16 of 16 units of work for 4 ranks: half must leave it.
    costs, tokens = [[4.0, 4.0], [4.0, 4.0], [], []], [[10, 10], [10, 10], [], []]
    config = BalanceConfig(trigger_threshold=0.0, min_gain=0.0, ranks_per_node=2)
    plan = solve_plan(costs, tokens, config=config)
    assert makespan(plan) == 4.0
    assert plan.inter_node_tokens == plan.moved_tokens == 20


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("images_per_rank", [4, 8, 16])
def test_node_aware_plans_cross_far_fewer_rows_at_the_same_makespan(seed, images_per_rank):
    case = realistic_case(64, images_per_rank, seed)
    blind = plan_of(case)
    aware = plan_of(case, ranks_per_node=8)
    assert makespan(aware) <= makespan(blind) * 1.005
    assert aware.inter_node_tokens <= 0.8 * inter_node_rows(case, blind.assignment, 8)


# min-move aims at the lower bound of any plan's makespan + MAKESPAN_SLACK first, without LPT.


def lower_bound(case: Case) -> float:
    """No assignment's makespan is below this: the mean load, the largest history, or the
    largest unit on the least loaded history."""
    base = case.history if case.history is not None else [0.0] * len(case.costs)
    largest = max((c for rank in case.costs for c in rank), default=0.0)
    total = sum(base) + sum(map(sum, case.costs))
    return max(total / len(case.costs), max(base), min(base) + largest)


@settings(max_examples=300, deadline=None)
@given(cases(configs=NO_TRIGGER.map(lambda c: dataclasses.replace(c, strategy="min-move"))))
def test_plans_near_the_lower_bound_are_within_the_slack_of_lpt(case):
    plan = plan_of(case)
    lpt = plan_of(case, strategy="lpt")
    if not (plan.applied and lpt.applied and plan.cap_respected and lpt.cap_respected):
        return
    # Within the slack of the bound is within the slack of LPT. LPT may move fewer rows then
    # (few ranks, where it keeps units home by chance): that plan is not weighed against it.
    if makespan(plan) <= lower_bound(case) * (1 + MAKESPAN_SLACK):
        assert makespan(plan) <= makespan(lpt) * (1 + MAKESPAN_SLACK) * (1 + 1e-9)


def test_a_plan_near_the_lower_bound_is_taken_even_where_lpt_moves_fewer_rows():
    # Rank 1 holds everything. Min-move sheds the 576.8 and 188.8 units (544 rows) to 765.6 vs
    # 778.4, within 1% of the bound (772); LPT's 784.8 vs 759.2 moves 464 rows but misses it.
    costs = [[], [104.0016] * 5 + [188.7744, 258.4336, 576.7936]]
    tokens = [[], [4] * 5 + [88, 156, 456]]
    case = Case(costs, tokens, BalanceConfig(trigger_threshold=0.0, min_gain=0.0), None)
    plan, lpt = plan_of(case), plan_of(case, strategy="lpt")
    assert makespan(plan) <= lower_bound(case) * (1 + MAKESPAN_SLACK) < makespan(lpt)
    assert (plan.moved_tokens, lpt.moved_tokens) == (544, 464)


def test_lpt_runs_when_the_lower_bound_is_out_of_reach():
    # Four equal units on three ranks: the bound is 8/3, but some rank must hold two (4.0).
    # Aiming at the bound leaves 4.0, above it; min-move then aims at LPT's makespan instead.
    costs, tokens = [[2.0] * 4, [], []], [[4] * 4, [], []]
    case = Case(costs, tokens, BalanceConfig(), None)
    plan = plan_of(case)
    assert makespan(plan) == 4.0 > lower_bound(case) * (1 + MAKESPAN_SLACK)
    assert plan.applied and plan.moved_tokens == 8
    assert [len(units) for units in plan.assignment] == [2, 1, 1]


@pytest.mark.parametrize(("num_ranks", "seed", "reaches_bound"), [(256, 0, True), (32, 1, False)])
def test_both_paths_give_the_same_plan_every_time(num_ranks, seed, reaches_bound):
    case = realistic_case(num_ranks, 8, seed)
    plan = plan_of(case)
    assert (makespan(plan) <= lower_bound(case) * (1 + MAKESPAN_SLACK)) == reaches_bound
    for _ in range(3):
        again = solve_plan(
            copy.deepcopy(case.costs), copy.deepcopy(case.tokens), config=case.config
        )
        assert again == plan


# Determinism across ranks: the same plan whatever a rank's torch threads or default device.


def test_plan_is_the_same_for_any_thread_count():
    # Over 32k units, so torch would split the planner's elementwise ops across threads.
    case = realistic_case(4096, 8, 3)
    threads = torch.get_num_threads()
    plans = []
    try:
        for count in (1, 4):
            torch.set_num_threads(count)
            plans += [plan_of(case), plan_of(case, max_len_ratio=1.0)]
    finally:
        torch.set_num_threads(threads)
    assert plans[0] == plans[2] and plans[1] == plans[3]
    assert plans[0].applied


@pytest.mark.parametrize("num_ranks", [64, 512])  # planned on Python lists, by torch ops
def test_a_default_device_leaves_the_plan_on_the_host(num_ranks):
    case = realistic_case(num_ranks, 8, 0)
    host = plan_of(case)
    with torch.device("meta"):  # as torch.set_default_device("cuda") would, on any machine
        on_meta = plan_of(case)
        # Read under it too, as a step (or the online model's bookkeeping) reads it later.
        every = list(on_meta.assignment)
        one = [on_meta.assignment[d] for d in range(num_ranks)]
    assert on_meta == host and every == list(host.assignment) == one


# Two executions of one planner: Python lists for small inputs, torch ops for large ones
# (``Units.small``). Forced each way on any input, they must give the same plan, bit for bit.


def made_up_exchange_seconds(send: list[int], recv: list[int]) -> float:
    """An exchange model (seconds from the rows each rank sends and receives), as
    ``ExchangeModel.step_seconds`` prices a plan."""
    return 2e-5 + max(max(send), max(recv)) * 4e-9


@st.composite
def any_inputs(draw):
    """``(costs, tokens, solve_plan keywords)``: grids under any cost model, or small integer
    costs and rows full of ties, duplicates and zeros; empty ranks, history, every option,
    node-aware planning and the exchange model's path."""
    if draw(st.booleans()):
        case = draw(cases(configs=NODE_CONFIGS))
        costs, tokens, config, history = case.costs, case.tokens, case.config, case.history
    else:
        num_ranks = draw(st.integers(1, 12))
        pairs = st.tuples(st.sampled_from([0.0, 1.0, 2.0, 3.0, 5.0, 8.0]), st.integers(0, 6))
        ranks = draw(st.lists(st.lists(pairs, max_size=8), min_size=num_ranks, max_size=num_ranks))
        costs = [[c for c, _ in rank] for rank in ranks]
        tokens = [[n for _, n in rank] for rank in ranks]
        config, history = draw(NODE_CONFIGS), None
        if draw(st.booleans()):
            history = draw(
                st.lists(
                    st.sampled_from([0.0, 1.0, 4.0, 9.0]), min_size=num_ranks, max_size=num_ranks
                )
            )
    keywords = {"config": config, "history": history}
    if draw(st.booleans()):
        keywords["exchange_seconds"] = made_up_exchange_seconds
    return costs, tokens, keywords


def plan_bits(plan, num_ranks: int):
    """Everything a plan says, floats as their exact bits: first what each rank reads of it
    (its own list and its units' destinations, made when first read), then the whole."""
    reads = [(plan.assignment[r], plan.destinations(r)) for r in range(num_ranks)]
    floats = [*plan.loads_before, *plan.loads_after, plan.imbalance_before, plan.imbalance_after]
    return (
        reads,
        list(plan.assignment),
        plan.applied,
        plan.reason,
        [x.hex() for x in floats],
        plan.moved_tokens,
        plan.cap_respected,
        plan.inter_node_tokens,
    )


@settings(max_examples=400, deadline=None)
@given(any_inputs())
def test_python_lists_and_torch_ops_give_the_same_plan_bit_for_bit(inputs):
    costs, tokens, keywords = inputs
    with executed(small=True):
        lists = solve_plan(costs, tokens, **keywords)
    with executed(small=False):
        tensors = solve_plan(costs, tokens, **keywords)
    assert plan_bits(lists, len(costs)) == plan_bits(tensors, len(costs))


@pytest.mark.parametrize(("num_ranks", "images"), [(8, 4), (32, 8), (128, 8), (256, 8)])
@pytest.mark.parametrize(
    "overrides", [{}, {"max_len_ratio": 1.0}, {"strategy": "lpt"}, {"ranks_per_node": 8}]
)
def test_both_executions_agree_on_realistic_batches(num_ranks, images, overrides):
    case = realistic_case(num_ranks, images, num_ranks + images)
    config = dataclasses.replace(case.config, trigger_threshold=0.2, **overrides)
    with executed(small=True):
        lists = solve_plan(case.costs, case.tokens, config=config)
    with executed(small=False):
        tensors = solve_plan(case.costs, case.tokens, config=config)
    assert plan_bits(lists, num_ranks) == plan_bits(tensors, num_ranks)


class _CountTorchCalls(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls.append(getattr(func, "__name__", repr(func)))
        return func(*args, **(kwargs or {}))


@PROPERTY_SETTINGS
@given(any_inputs())
def test_small_inputs_plan_without_a_torch_op(inputs):
    costs, tokens, keywords = inputs
    with _CountTorchCalls() as counted:
        plan = solve_plan(costs, tokens, **keywords)
        plan_bits(plan, len(costs))
    assert counted.calls == []
