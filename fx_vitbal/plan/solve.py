"""``solve_plan``: the candidates each strategy offers and the choice among them (see the package
docstring for the strategies)."""

import math
from collections.abc import Callable, Sequence

import torch

from fx_vitbal.config import BalanceConfig
from fx_vitbal.plan import nodes
from fx_vitbal.plan.candidates import (
    Candidate,
    candidate_from_dest,
    cap_unkeepable,
    crossing_rows,
    make_plan,
    row_cap,
    rows_away,
)
from fx_vitbal.plan.greedy import lpt_assign, lpt_assign_within, refine
from fx_vitbal.plan.min_move import min_move, room_to_spare, shed_and_place
from fx_vitbal.plan.shed import shed_over_target
from fx_vitbal.plan.units import Plan, Units, is_small

# min-move may end this much above the refined LPT makespan (the communication it saves is worth
# far more than 1% of the ViT step).
MAKESPAN_SLACK = 0.01
# Slacks min-move plans at when an exchange model prices their traffic (costs in seconds).
EXCHANGE_SLACKS = (0.01, 0.03, 0.1, 0.3)


def solve_plan(
    costs: Sequence[Sequence[float]],
    tokens: Sequence[Sequence[int]],
    *,
    config: BalanceConfig | None = None,
    history: Sequence[float] | None = None,
    exchange_seconds: Callable[[list[int], list[int]], float] | None = None,
    max_rows: float = math.inf,
) -> Plan:
    """Compute the same balanced assignment of units to ranks on every rank.

    Args:
        costs: ``costs[r][i]`` predicted cost of unit ``i`` held by rank ``r``.
        tokens: ``tokens[r][i]`` its pixel rows (what moving it costs, and what the cap limits).
        config: thresholds, strategy and cap; defaults to ``BalanceConfig()``.
        history: per-rank costs already accumulated (cross-micro-batch balancing); added to the
            loads before balancing.
        exchange_seconds: with costs in seconds (the online model), the predicted seconds of a
            plan's exchanges from the pixel rows each rank sends to and receives from other
            ranks (``exchange_time.ExchangeModel.step_seconds``). Then the plan with the lowest
            predicted makespan + exchange wins, and it is applied only when the makespan it
            saves beats its exchange (``worth_moving``; reason ``exchange`` otherwise), in
            place of ``MAKESPAN_SLACK`` and ``min_gain``. None: those FLOP-era rules.
        max_rows: the most pixel rows a rank may compute, whatever ``config.max_len_ratio``
            allows: a memory budget's rows (``plan.step.PlanSettings.max_rows``), a cap like
            the ratio's (kept unless no plan keeps it; a unit alone may exceed it).

    Returns:
        A ``Plan``; when ``applied`` is False the assignment is the identity.

    Raises:
        ValueError: mismatched shapes, negative or non-finite costs, negative token counts.
    """
    config = config or BalanceConfig()
    # A default device set for the model (``torch.set_default_device``) must not move the
    # planner's tensors: they are small, and on the host no op waits on a device. Small inputs
    # make none (``Units.small``), so they skip the question (it costs several us).
    if not is_small(sum(map(len, costs))) and torch.get_default_device().type != "cpu":
        with torch.device("cpu"):
            return _solve(costs, tokens, config, history, exchange_seconds, max_rows)
    return _solve(costs, tokens, config, history, exchange_seconds, max_rows)


def _solve(costs, tokens, config: BalanceConfig, history, exchange_seconds, max_rows) -> Plan:
    units = Units(costs, tokens, history)
    num_ranks = units.num_ranks
    ranks_per_node = config.ranks_per_node
    # Node-aware planning needs two nodes or more; 1 rank per node leaves no move inside a node.
    node_aware = ranks_per_node is not None and 1 < ranks_per_node < num_ranks
    cap = row_cap(units, config.max_len_ratio, max_rows)
    home_keeps_cap = units.keeps_cap_at_home(cap)

    def skip(reason: str) -> Plan:
        home = Candidate({}, [], [], [], 0, home_keeps_cap)
        return make_plan(home, units, False, reason, ranks_per_node)

    if num_ranks == 1:
        return skip("single-rank")
    if not units.num_units or units.total_before == 0:
        return skip("empty")
    # A memory budget the current layout breaks is kept whether or not balancing pays: the
    # layout may not fit (only the budget's rows: ``max_len_ratio`` caps what balancing does).
    over_budget = max_rows != math.inf and not units.keeps_cap_at_home(max_rows)
    if units.imbalance_before < config.trigger_threshold and not over_budget:
        return skip("balanced")
    dominant = units.largest_float_cost > units.total_before / num_ranks
    if config.skip_rule == "seed" and dominant and not over_budget:
        return skip("dominant-unit")

    def apply(best: Candidate) -> Plan:
        if not best.cap_respected and home_keeps_cap:
            return skip("cap")
        plan = make_plan(best, units, True, "applied", ranks_per_node)
        if over_budget and best.cap_respected:
            return plan
        if max(plan.loads_after) >= units.max_before * (1.0 - config.min_gain):
            return skip("no-gain")
        return plan

    # From here on, loads are fixed point (``Units.scale_exp``): exact, so comparisons and
    # running sums give the same answer on every rank.
    base = units.base_fixed
    total = sum(units.home_loads)
    mean_load = -(-total // num_ranks)  # no plan's makespan is below the mean, rounded up

    # min-move aims first at the lower bound of any plan's makespan + the slack, without LPT
    # (its sort and per-unit heap are the seed's whole cost). LPT's makespan is at least the
    # bound, so a plan reaching it that keeps the cap is within the slack of every candidate
    # below, and it is taken without asking them; that holds whether or not the current layout
    # keeps the cap. The one thing given up: on a few ranks LPT (or, node-aware, node-blind
    # min-move) may move fewer rows by chance. The exchange model weighs seconds, not the
    # slack: it always takes the full path; so does a cap no assignment keeps, and one the
    # current layout breaks unless the shed rows leave room to spare (``room_to_spare``).
    keepable = home_keeps_cap or not cap_unkeepable(units, cap)
    if config.strategy == "min-move" and exchange_seconds is None and keepable:
        bound = max(mean_load, units.largest_cost)
        if units.history is not None:
            bound = max(bound, max(base), min(base) + units.largest_cost)
        accept = int(bound * (1.0 + MAKESPAN_SLACK))
        shed = shed_over_target(units, cap, accept)
        if home_keeps_cap or room_to_spare(shed, cap):
            if node_aware:
                first = nodes.node_shed_and_place(
                    units, cap, accept, ranks_per_node, repair=False, shed=shed
                )
            else:
                first = shed_and_place(units, cap, accept, shed)
            if first.makespan <= accept and first.cap_respected:
                return apply(first)

    order = units.by_cost_desc()
    # The plain greedy balances cost, not rows: it cannot keep a cap that no assignment keeps,
    # nor one at or below the mean rows unless every rank ends exactly at the cap, and where it
    # keeps the cap the capped pass makes the same choices. Only try it when the cap has slack.
    slack = cap * num_ranks > units.total_tokens
    free = lpt_assign(units, order) if keepable and slack else None
    free_plan = candidate_from_dest(free, units, cap) if free is not None else None
    if free_plan is None or not free_plan.cap_respected:
        start = candidate_from_dest(lpt_assign_within(units, order, cap), units, cap)
    else:
        start = free_plan
    stop_load = total / num_ranks * (1 + config.tolerance)
    lpt = refine(start, units, cap, stop_load, config.max_iters)
    candidates = [lpt]
    # Under a cap no assignment keeps, or that neither the current layout nor the capped greedy
    # keeps, the rows press against it everywhere, so keeping units home cannot work: min-move
    # would shed from nearly every rank and end as a worse greedy.
    hopeless = not keepable or not (home_keeps_cap or lpt.cap_respected)
    if config.strategy == "min-move" and not hopeless:
        target = lpt.makespan
        if target >= max(units.home_loads):
            # LPT deals every unit from scratch, so under a cap the current rows nearly fill it
            # can gain nothing where a few moves do: aim at uncapped LPT's makespan instead.
            if free_plan is None:
                free_plan = candidate_from_dest(lpt_assign(units, order), units, cap)
            target = free_plan.makespan
        # With an exchange model the trade-off, not a fixed slack, decides how far min-move may
        # trail: it offers plans at several slacks and the cheapest makespan + exchange wins.
        slacks = EXCHANGE_SLACKS if exchange_seconds is not None else (MAKESPAN_SLACK,)
        for slack in slacks:
            accept = int(target * (1.0 + slack))
            if node_aware:
                candidates += nodes.node_min_move(units, order, cap, accept, ranks_per_node)
            else:
                candidates.append(min_move(units, order, cap, accept))
    # Plans keeping the row cap if any; among them, those within the slack of the best makespan;
    # then less traffic: rows moved, inter-node rows weighing more (LPT, the reference, wins ties).
    pool = [c for c in candidates if c.cap_respected] or candidates
    if exchange_seconds is not None:  # --- measured exchange trade-off (fx_vitbal.measure)
        seconds = [exchange_seconds(*crossing_rows(c, units)) for c in pool]
        best, cost = min(
            zip(pool, seconds, strict=True),
            key=lambda pair: (
                units.to_float(pair[0].makespan) + pair[1],
                rows_away(pair[0], units)[0],
            ),
        )
        if not best.cap_respected and home_keeps_cap:
            return skip("cap")
        plan = make_plan(best, units, True, "applied", ranks_per_node)
        if over_budget and best.cap_respected:
            return plan
        if not worth_moving(units.max_before, max(plan.loads_after), cost):
            return skip("exchange")
        return plan
    good_enough = min(c.makespan for c in pool) * (1.0 + MAKESPAN_SLACK)

    def traffic(c: Candidate) -> float:
        if node_aware:
            return nodes.traffic(c, units, ranks_per_node)
        return rows_away(c, units)[0]

    return apply(min(pool, key=lambda c: (c.makespan > good_enough, traffic(c))))


def worth_moving(makespan_before: float, makespan_after: float, exchange_seconds: float) -> bool:
    """The measured-time rule: move only when the compute time a plan saves on the slowest rank
    beats the time its exchanges are predicted to take (all in seconds; ties stay home)."""
    return makespan_before - makespan_after > exchange_seconds
