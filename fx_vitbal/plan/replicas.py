"""Replica sets: ranks that hold the same batch (context or sequence parallelism, an encoder group
spanning tensor-parallel ranks), planned so each unit is computed once in the whole group.

The reduction: each unit of a set gets a *holder*, one of the set's ranks (``holders``: LPT by
cost over the set's ranks), and ``solve_plan`` then balances the whole group as if each rank held
only its holdings. Every quality of the ordinary plan (LPT's makespan, the row cap, min-move,
node-aware planning, online costs) carries over unchanged. The planner counts a unit that ends on
another replica of its set as moved; it is not (that replica has the pixels too), so its count
of rows moved is an upper bound of the pixels that travel.

Deterministic like every plan: the same gathered grids give the same holders on every rank.
"""

import math
from collections.abc import Callable, Sequence

from fx_vitbal.config import BalanceConfig
from fx_vitbal.plan.solve import solve_plan
from fx_vitbal.plan.units import Plan


def holders(costs: Sequence[float], replicas: int) -> list[int]:
    """Each unit's holder, as an index among its set's ``replicas`` ranks: units by cost, largest
    first, each to the least loaded replica (ties: the lower unit, then the lower replica).
    Holding is where a unit's pixels come from when it leaves its set, so this also spreads the
    sending over the replicas."""
    loads = [0.0] * replicas
    held = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        j = min(range(replicas), key=loads.__getitem__)
        loads[j] += costs[i]
        held[i] = j
    return held


def solve_for_sets(
    set_costs: Sequence[Sequence[float]],
    set_tokens: Sequence[Sequence[int]],
    sets: Sequence[Sequence[int]],
    *,
    config: BalanceConfig | None = None,
    exchange_seconds: Callable[[list[int], list[int]], float] | None = None,
    max_rows: float = math.inf,
) -> tuple[Plan, list[list[int]]]:
    """One plan over every rank of every set, each unit computed once.

    Args:
        set_costs, set_tokens: ``[s][i]``: cost and pixel rows of unit ``i`` of set ``s``.
        sets: ``sets[s]``: the ranks of set ``s``, ascending; together they are ranks
            ``0 .. N-1``, each once.
        config, exchange_seconds, max_rows: as ``solve_plan`` takes them.

    Returns:
        ``(plan, held)``: ``plan`` is ``solve_plan``'s over the holdings, and ``held[r]`` the
        indices in its set of the units rank ``r`` holds, ascending (``plan``'s unit ``(r, j)``
        is unit ``held[r][j]`` of ``r``'s set).
    """
    held: list[list[int]] = [[] for _ in range(sum(map(len, sets)))]
    for ranks, costs in zip(sets, set_costs, strict=True):
        for i, j in enumerate(holders(costs, len(ranks))):
            held[ranks[j]].append(i)
    costs_R, tokens_R = as_held(set_costs, sets, held), as_held(set_tokens, sets, held)
    plan = solve_plan(
        costs_R, tokens_R, config=config, exchange_seconds=exchange_seconds, max_rows=max_rows
    )
    return plan, held


def set_of_ranks(sets: Sequence[Sequence[int]]) -> list[int]:
    """Each rank's set: ``sets`` inverted."""
    set_of = [0] * sum(map(len, sets))
    for s, ranks in enumerate(sets):
        for r in ranks:
            set_of[r] = s
    return set_of


def as_held(per_set: Sequence[Sequence], sets: Sequence[Sequence[int]], held) -> list[list]:
    """Values of each set's units (``per_set[s][i]``) as the plan holds them: rank ``r``'s list
    is its set's values at ``held[r]``."""
    set_of = set_of_ranks(sets)
    return [[per_set[set_of[r]][i] for i in units] for r, units in enumerate(held)]
