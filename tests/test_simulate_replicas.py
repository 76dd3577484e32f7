"""``tools.simulate_replicas``: each strategy computes every unit where it should, its loads and
traffic are counted right, and one plan across the group is never worse than LPT in the set."""

import collections
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fx_vitbal.config import BalanceConfig
from fx_vitbal.plan.solve import solve_plan
from fx_vitbal.tools.simulate_replicas import (
    STRATEGIES,
    Step,
    count_split,
    evaluate,
    main,
    one_plan,
    replicated,
    sample_step,
)

steps = st.builds(
    sample_step,
    dp=st.integers(1, 6),
    replicas=st.integers(1, 4),
    images_per_set=st.integers(0, 5),
    mix=st.sampled_from(["realistic", "photos", "documents"]),
    seed=st.integers(0, 10_000),
    ranks_per_node=st.sampled_from([1, 2, 4, 8]),
)


def _counts(computed):
    return collections.Counter(unit for units in computed for unit in units)


def _all_units(step):
    return {(s, i) for s, units in enumerate(step.units) for i in range(len(units))}


@settings(max_examples=40, deadline=None)
@given(steps)
def test_every_unit_is_computed_once_and_replicated_once_per_replica(step):
    for name, strategy in STRATEGIES.items():
        computed = strategy(step)
        assert len(computed) == step.num_ranks, name
        counts = _counts(computed)
        assert set(counts) == _all_units(step), name
        expected = step.replicas if name == "replicated" else 1
        assert set(counts.values()) <= {expected}, name
    for d, units in enumerate(replicated(step)):
        assert {s for s, _ in units} <= {step.set_of(d)}


@settings(max_examples=40, deadline=None)
@given(steps)
def test_replicated_loads_are_the_set_total_on_every_replica(step):
    out = evaluate(step, replicated(step))
    for d, load in enumerate(out.loads):
        assert load == pytest.approx(sum(step.costs[step.set_of(d)]))
    assert out.moved_rows == out.crossing_rows == 0


@settings(max_examples=40, deadline=None)
@given(steps)
def test_no_strategy_beats_the_lower_bound_and_one_plan_beats_lpt_in_set(step):
    outs = {name: evaluate(step, strategy(step)) for name, strategy in STRATEGIES.items()}
    for name, out in outs.items():
        assert out.makespan >= step.lower_bound * (1 - 1e-9), name
        assert math.fsum(out.loads) == pytest.approx(
            step.total * (step.replicas if name == "replicated" else 1)
        )
    assert outs["one plan"].makespan <= outs["LPT in set"].makespan * (1 + 1e-9)
    # Only one plan sends units out of their set.
    for name in ("replicated", "count split", "LPT in set"):
        assert outs[name].moved_rows == 0, name
    assert outs["one plan"].crossing_rows <= outs["one plan"].moved_rows


@settings(max_examples=40, deadline=None)
@given(steps)
def test_lpt_in_set_keeps_each_replica_within_one_unit_of_the_sets_mean(step):
    loads = evaluate(step, STRATEGIES["LPT in set"](step)).loads
    for s, costs in enumerate(step.costs):
        # Greedy to the least loaded replica: no replica ends above the mean + its last unit.
        bound = sum(costs) / step.replicas + max(costs, default=0.0)
        assert max(loads[s * step.replicas : (s + 1) * step.replicas]) <= bound * (1 + 1e-9)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_one_plan_beats_lpt_in_set_and_count_split_on_realistic_steps(seed):
    step = sample_step(16, 2, 6, seed=seed)
    spans = {name: evaluate(step, f(step)).makespan for name, f in STRATEGIES.items()}
    assert spans["one plan"] <= spans["LPT in set"] <= spans["replicated"]
    assert spans["one plan"] < spans["count split"]


@pytest.mark.parametrize("seed", [0, 5])
@pytest.mark.parametrize("ranks_per_node", [2, 8])
def test_one_replica_per_set_is_solve_plans_plan(seed, ranks_per_node):
    step = sample_step(12, 1, 5, seed=seed, ranks_per_node=ranks_per_node)
    config = BalanceConfig(trigger_threshold=0.0, min_gain=0.0, ranks_per_node=ranks_per_node)
    plan = solve_plan(step.costs, step.rows, config=config)
    assert plan.applied
    assert one_plan(step) == [list(assigned) for assigned in plan.assignment]
    out = evaluate(step, one_plan(step))
    assert out.moved_rows == plan.moved_tokens
    assert out.crossing_rows == plan.inter_node_tokens


def _two_sets_of_two(ranks_per_node: int) -> Step:
    # Set 0 (ranks 0, 1) holds units of 10 and 20 rows, set 1 (ranks 2, 3) one of 30.
    return Step(
        replicas=2,
        ranks_per_node=ranks_per_node,
        units=[[(1, 2, 5), (1, 4, 5)], [(1, 5, 6)]],
        costs=[[1.0, 2.0], [3.0]],
        rows=[[10, 20], [30]],
    )


def test_a_unit_that_stays_in_its_set_is_not_moved():
    step = _two_sets_of_two(ranks_per_node=2)
    # Unit (0, 1) on rank 1, the other replica of its set: no pixel leaves the set.
    out = evaluate(step, [[(0, 0)], [(0, 1)], [(1, 0)], []])
    assert (out.moved_rows, out.crossing_rows) == (0, 0)
    assert out.loads == [1.0, 2.0, 3.0, 0.0]
    assert out.makespan == pytest.approx(3.0 / (6.0 / 4))
    # The same unit on rank 3, in set 1 and on node 1: moved, and across nodes.
    out = evaluate(step, [[(0, 0)], [], [(1, 0)], [(0, 1)]])
    assert (out.moved_rows, out.crossing_rows) == (20, 20)


def test_a_moved_unit_crosses_nodes_only_where_no_replica_of_its_set_is():
    # One node of 4 ranks holds both sets: moved, but no row leaves the node.
    step = _two_sets_of_two(ranks_per_node=4)
    out = evaluate(step, [[(0, 0)], [], [(1, 0)], [(0, 1)]])
    assert (out.moved_rows, out.crossing_rows) == (20, 0)
    # Sets of 3 on nodes of 2 ranks: set 0 is ranks 0-2 (nodes 0, 1), set 1 ranks 3-5 (nodes 1,
    # 2). Set 0's unit on rank 3 stays on node 1, where rank 2 can send it; on rank 4 it crosses.
    step = Step(3, 2, [[(1, 2, 5)], [(1, 5, 6)]], [[1.0], [3.0]], [[10], [30]])
    out = evaluate(step, [[], [], [], [(0, 0)], [(1, 0)], []])
    assert (out.moved_rows, out.crossing_rows) == (10, 0)
    out = evaluate(step, [[], [], [], [], [(0, 0), (1, 0)], []])
    assert (out.moved_rows, out.crossing_rows) == (10, 10)


def test_count_split_gives_the_remainder_to_the_last_replica():
    step = Step(2, 8, [[(1, 2, 2)] * 5, [(1, 2, 2)]], [[1.0] * 5, [1.0]], [[4] * 5, [4]])
    assert count_split(step) == [
        [(0, 0), (0, 1)],
        [(0, 2), (0, 3), (0, 4)],
        [],  # fewer units than replicas: all on the last (Megatron pads the others)
        [(1, 0)],
    ]


def test_cli_prints_every_strategy(capsys):
    main(["--dp", "4", "--replicas", "2", "--images-per-set", "3", "--seeds", "2"])
    lines = capsys.readouterr().out.splitlines()
    bound = float(lines[1].rsplit(" ", 1)[1])
    spans = {
        line.split(":")[0]: float(line.split("makespan / mean ")[1].split(",")[0])
        for line in lines[2:]
    }
    assert list(spans) == list(STRATEGIES)
    assert all(span >= bound - 1e-3 for span in spans.values())
    with pytest.raises(SystemExit):
        main(["--dp", "0"])
