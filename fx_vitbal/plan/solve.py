"""``solve_plan``: the candidates each strategy offers and the choice among them (see the package
docstring for the strategies)."""

from collections.abc import Callable, Sequence

from fx_vitbal.config import BalanceConfig
from fx_vitbal.plan import nodes
from fx_vitbal.plan.greedy import lpt_assign, lpt_assign_within, refine
from fx_vitbal.plan.min_move import min_move, shed_and_place
from fx_vitbal.plan.units import (
    Candidate,
    Plan,
    Units,
    cap_unkeepable,
    crossing_rows,
    imbalance,
    keeps_row_cap,
    make_candidate,
    make_plan,
    moved_rows,
    row_cap,
    sum_loads,
    validate_inputs,
)

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

    Returns:
        A ``Plan``; when ``applied`` is False the assignment is the identity.

    Raises:
        ValueError: mismatched shapes, negative or non-finite costs, negative token counts.
    """
    config = config or BalanceConfig()
    validate_inputs(costs, tokens, history)
    num_ranks = len(costs)
    ranks_per_node = config.ranks_per_node
    # Node-aware planning needs two nodes or more; 1 rank per node leaves no move inside a node.
    node_aware = ranks_per_node is not None and 1 < ranks_per_node < num_ranks
    units = Units(costs, tokens)
    base = [float(h) for h in history] if history is not None else [0.0] * num_ranks
    loads_before = sum_loads(units, base, {})
    cap = row_cap(units, config.max_len_ratio)
    home_keeps_cap = keeps_row_cap(units.home_rows, units.counts, cap)
    home = Candidate(units.src, loads_before, home_keeps_cap, {}, units.home_rows)

    def skip(reason: str) -> Plan:
        return make_plan(home, units, base, loads_before, False, reason, ranks_per_node)

    if num_ranks == 1:
        return skip("single-rank")
    if not units.cost or sum(loads_before) == 0:
        return skip("empty")
    mean_load = sum(loads_before) / num_ranks
    if imbalance(loads_before) < config.trigger_threshold:
        return skip("balanced")
    if config.skip_rule == "seed" and max(units.cost) > mean_load:
        return skip("dominant-unit")

    def apply(best: Candidate) -> Plan:
        if not best.cap_respected and home_keeps_cap:
            return skip("cap")
        plan = make_plan(best, units, base, loads_before, True, "applied", ranks_per_node)
        if max(plan.loads_after) >= max(loads_before) * (1.0 - config.min_gain):
            return skip("no-gain")
        return plan

    # min-move aims first at the lower bound of any plan's makespan + the slack, without LPT
    # (its sort and per-unit heap are the seed's whole cost). LPT's makespan is at least the
    # bound, so a plan reaching it that keeps the cap is within the slack of every candidate
    # below, and it is taken without asking them. The one thing given up: on a few ranks LPT
    # (or, node-aware, node-blind min-move) may move fewer rows by chance. The exchange model
    # weighs seconds, not the slack: it always takes the full path.
    if config.strategy == "min-move" and exchange_seconds is None and home_keeps_cap:
        bound = max(mean_load, max(base), min(base) + max(units.cost))
        accept = bound * (1.0 + MAKESPAN_SLACK)
        if node_aware:
            first = nodes.node_shed_and_place(
                units, base, cap, accept, ranks_per_node, repair=False
            )
        else:
            first = shed_and_place(units, base, cap, accept)
        if max(first.loads) <= accept and first.cap_respected:
            return apply(first)

    order = units.by_cost_desc()
    # The plain greedy balances cost, not rows: it cannot keep a cap that no assignment keeps,
    # nor one at or below the mean rows unless every rank ends exactly at the cap, and where it
    # keeps the cap the capped pass makes the same choices. Only try it when the cap has slack.
    slack = cap * units.num_ranks > sum(units.tokens)
    keepable = home_keeps_cap or not cap_unkeepable(units, cap)
    free = lpt_assign(units, order, base) if keepable and slack else None
    free_plan = make_candidate(free, units, base, cap) if free is not None else None
    lpt = refine(
        free
        if free_plan is not None and free_plan.cap_respected
        else lpt_assign_within(units, order, base, cap),
        units,
        base,
        cap,
        mean_load * (1 + config.tolerance),
        config.max_iters,
    )
    candidates = [lpt]
    # Under a cap no assignment keeps, or that neither the current layout nor the capped greedy
    # keeps, the rows press against it everywhere, so keeping units home cannot work: min-move
    # would shed from nearly every rank and end as a worse greedy.
    hopeless = not keepable or not (home_keeps_cap or lpt.cap_respected)
    if config.strategy == "min-move" and not hopeless:
        target = max(lpt.loads)
        if target >= max(loads_before):
            # LPT deals every unit from scratch, so under a cap the current rows nearly fill it
            # can gain nothing where a few moves do: aim at uncapped LPT's makespan instead.
            if free_plan is None:
                free_plan = make_candidate(lpt_assign(units, order, base), units, base, cap)
            target = max(free_plan.loads)
        # With an exchange model the trade-off, not a fixed slack, decides how far min-move may
        # trail: it offers plans at several slacks and the cheapest makespan + exchange wins.
        slacks = EXCHANGE_SLACKS if exchange_seconds is not None else (MAKESPAN_SLACK,)
        for slack in slacks:
            accept = target * (1.0 + slack)
            if node_aware:
                candidates += nodes.node_min_move(units, order, base, cap, accept, ranks_per_node)
            else:
                candidates.append(min_move(units, order, base, cap, accept))
    # Plans keeping the row cap if any; among them, those within the slack of the best makespan;
    # then less traffic: rows moved, inter-node rows weighing more (LPT, the reference, wins ties).
    pool = [c for c in candidates if c.cap_respected] or candidates
    if exchange_seconds is not None:  # --- measured exchange trade-off (fx_vitbal.measure)
        seconds = [exchange_seconds(*crossing_rows(c.dest, units)) for c in pool]
        best, cost = min(
            zip(pool, seconds, strict=True),
            key=lambda pair: (max(pair[0].loads) + pair[1], moved_rows(pair[0].dest, units)),
        )
        if not best.cap_respected and home_keeps_cap:
            return skip("cap")
        if not worth_moving(max(loads_before), max(best.loads), cost):
            return skip("exchange")
        return make_plan(best, units, base, loads_before, True, "applied", ranks_per_node)
    good_enough = min(max(c.loads) for c in pool) * (1.0 + MAKESPAN_SLACK)

    def traffic(c: Candidate) -> float:
        if node_aware:
            return nodes.traffic(c.dest, units, ranks_per_node)
        return moved_rows(c.dest, units)

    return apply(min(pool, key=lambda c: (max(c.loads) > good_enough, traffic(c))))


def worth_moving(makespan_before: float, makespan_after: float, exchange_seconds: float) -> bool:
    """The measured-time rule: move only when the compute time a plan saves on the slowest rank
    beats the time its exchanges are predicted to take (all in seconds; ties stay home)."""
    return makespan_before - makespan_after > exchange_seconds
