"""Assign ViT units (images or frames) to data-parallel ranks so every rank gets similar work.

Pure Python and deterministic: every rank runs ``solve_plan`` on the same gathered input and must
get the same answer, so every tie is broken by a total order (cost, then source rank, then local
index) and no hashing, randomness or float reduction order depends on anything else.

Two strategies:
- ``lpt``: the seed's plan. Greedy longest-processing-time onto the least-loaded rank, then
  move/swap refinement between the most and least loaded ranks. It reaches a makespan close to the
  lower bound but moves nearly every unit (each lands wherever the heap says).
- ``min-move`` (default): keep units home and move only what must move. Overloaded ranks shed
  units down to a target makespan, the shed units are placed best-fit, and the seed's move/swap
  refinement repairs any overshoot. The target is first the lower bound of any plan's makespan
  plus 1%, which needs no LPT (node-aware planning too); only when that fails (or an exchange
  model weighs the plans) does LPT run, and the target becomes LPT's makespan plus 1% (uncapped
  LPT's when LPT under the row cap gains nothing), with LPT itself a candidate.

Per-plan sums (loads, rows, the plan's lists) start from each rank's home values and revisit only
the ranks moves touch: plans move few units, and per-unit Python loops are what planning time is
made of.

Both keep a cap on the pixel rows each rank computes (``BalanceConfig.max_len_ratio``); by default
no rank may end with more rows than the fullest rank holds before balancing, so balancing never
raises peak memory.
"""

import bisect
import collections
import dataclasses
import heapq
import math
import operator
from collections.abc import Callable, Sequence
from itertools import accumulate, chain, compress, pairwise, repeat
from typing import NamedTuple

from fx_vitbal.config import BalanceConfig

# min-move may end this much above the refined LPT makespan (the communication it saves is worth
# far more than 1% of the ViT step).
MAKESPAN_SLACK = 0.01
# Slacks min-move plans at when an exchange model prices their traffic (costs in seconds).
EXCHANGE_SLACKS = (0.01, 0.03, 0.1, 0.3)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Which rank computes which unit, and what that is predicted to achieve.

    ``assignment[d]`` lists the ``(src_rank, local_idx)`` units computed on rank ``d``, sorted by
    ``(src_rank, local_idx)`` so received data arrives in plan order without a permutation.
    """

    assignment: list[list[tuple[int, int]]]
    applied: bool
    reason: str
    """``applied``, ``balanced`` (below the trigger), ``no-gain``, ``cap`` (every plan found breaks
    the row cap the current layout keeps), ``dominant-unit`` (seed rule), ``single-rank``,
    ``empty`` or ``exchange`` (measured times: the exchange would cost more than it saves)."""
    loads_before: list[float]
    loads_after: list[float]
    imbalance_before: float
    imbalance_after: float
    moved_tokens: int
    cap_respected: bool = True
    """False when no assignment found keeps every rank under the row cap. Only an explicit
    ``max_len_ratio`` can do that: the default cap is one the current layout keeps."""
    inter_node_tokens: int = 0
    """Pixel rows computed on another node than their home rank's (nodes of
    ``BalanceConfig.ranks_per_node`` contiguous ranks); 0 when ``ranks_per_node`` is None."""

    def destinations(self, num_units: Sequence[int]) -> list[list[int]]:
        """``dest[r][i]``: the rank computing unit ``i`` of rank ``r``."""
        dest = [[r] * n for r, n in enumerate(num_units)]
        for d, units in enumerate(self.assignment):
            for src, idx in units:
                dest[src][idx] = d
        return dest


def imbalance(loads: Sequence[float]) -> float:
    """``max(loads) / mean(loads) - 1`` (0 for all-zero loads)."""
    total = sum(loads)
    return max(loads) * len(loads) / total - 1.0 if total > 0 else 0.0


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
    _validate(costs, tokens, history)
    num_ranks = len(costs)
    ranks_per_node = config.ranks_per_node
    # Node-aware planning needs two nodes or more; 1 rank per node leaves no move inside a node.
    node_aware = ranks_per_node is not None and 1 < ranks_per_node < num_ranks
    if node_aware:
        from fx_vitbal import nodes  # built on this module's primitives: imported late
    units = _Units(costs, tokens)
    base = [float(h) for h in history] if history is not None else [0.0] * num_ranks
    loads_before = _loads(units, base, {})
    cap = _token_cap(units, config.max_len_ratio)
    home_keeps_cap = _keeps_cap(units.home_rows, units.counts, cap)
    home = _Candidate(units.src, loads_before, home_keeps_cap, {}, units.home_rows)

    def skip(reason: str) -> Plan:
        return _make_plan(home, units, base, loads_before, False, reason, ranks_per_node)

    if num_ranks == 1:
        return skip("single-rank")
    if not units.cost or sum(loads_before) == 0:
        return skip("empty")
    mean_load = sum(loads_before) / num_ranks
    if imbalance(loads_before) < config.trigger_threshold:
        return skip("balanced")
    if config.skip_rule == "seed" and max(units.cost) > mean_load:
        return skip("dominant-unit")

    def apply(best: _Candidate) -> Plan:
        if not best.cap_respected and home_keeps_cap:
            return skip("cap")
        plan = _make_plan(best, units, base, loads_before, True, "applied", ranks_per_node)
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
            first = _shed_and_place(units, base, cap, accept)
        if max(first.loads) <= accept and first.cap_respected:
            return apply(first)

    order = units.by_cost_desc()
    # The plain greedy balances cost, not rows: it cannot keep a cap that no assignment keeps,
    # nor one at or below the mean rows unless every rank ends exactly at the cap, and where it
    # keeps the cap the capped pass makes the same choices. Only try it when the cap has slack.
    slack = cap * units.num_ranks > sum(units.tokens)
    keepable = home_keeps_cap or not _cap_unkeepable(units, cap)
    free = _lpt(units, order, base) if keepable and slack else None
    free_plan = _candidate(free, units, base, cap) if free is not None else None
    lpt = _refine(
        free
        if free_plan is not None and free_plan.cap_respected
        else _lpt_within(units, order, base, cap),
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
                free_plan = _candidate(_lpt(units, order, base), units, base, cap)
            target = max(free_plan.loads)
        # With an exchange model the trade-off, not a fixed slack, decides how far min-move may
        # trail: it offers plans at several slacks and the cheapest makespan + exchange wins.
        slacks = EXCHANGE_SLACKS if exchange_seconds is not None else (MAKESPAN_SLACK,)
        for slack in slacks:
            accept = target * (1.0 + slack)
            if node_aware:
                candidates += nodes.node_min_move(units, order, base, cap, accept, ranks_per_node)
            else:
                candidates.append(_min_move(units, order, base, cap, accept))
    # Plans keeping the row cap if any; among them, those within the slack of the best makespan;
    # then less traffic: rows moved, inter-node rows weighing more (LPT, the reference, wins ties).
    pool = [c for c in candidates if c.cap_respected] or candidates
    if exchange_seconds is not None:  # --- measured exchange trade-off (fx_vitbal.measured)
        seconds = [exchange_seconds(*_crossing_rows(c.dest, units)) for c in pool]
        best, cost = min(
            zip(pool, seconds, strict=True),
            key=lambda pair: (max(pair[0].loads) + pair[1], _moved(pair[0].dest, units)),
        )
        if not best.cap_respected and home_keeps_cap:
            return skip("cap")
        if not worth_moving(max(loads_before), max(best.loads), cost):
            return skip("exchange")
        return _make_plan(best, units, base, loads_before, True, "applied", ranks_per_node)
    good_enough = min(max(c.loads) for c in pool) * (1.0 + MAKESPAN_SLACK)

    def traffic(c: _Candidate) -> float:
        if node_aware:
            return nodes.traffic(c.dest, units, ranks_per_node)
        return _moved(c.dest, units)

    return apply(min(pool, key=lambda c: (max(c.loads) > good_enough, traffic(c))))


def worth_moving(makespan_before: float, makespan_after: float, exchange_seconds: float) -> bool:
    """The measured-time rule: move only when the compute time a plan saves on the slowest rank
    beats the time its exchanges are predicted to take (all in seconds; ties stay home)."""
    return makespan_before - makespan_after > exchange_seconds


def _crossing_rows(dest: list[int], units: "_Units") -> tuple[list[int], list[int]]:
    """Per rank, rows sent to other ranks and rows received from them under ``dest``."""
    send, recv = [0] * units.num_ranks, [0] * units.num_ranks
    for u, d in enumerate(dest):
        if d != units.src[u]:
            send[units.src[u]] += units.tokens[u]
            recv[d] += units.tokens[u]
    return send, recv


class _Candidate(NamedTuple):
    """An assignment (``dest[u]``: the rank computing unit ``u``) with what the planner weighs:
    its loads, summed afresh (``_loads``), whether it keeps the row cap, and the units on the
    ranks its moves touch (``_touched``; None: not grouped yet, see ``_groups``), which the plan's
    lists are made from, with every rank's rows."""

    dest: list[int]
    loads: list[float]
    cap_respected: bool
    touched: dict[int, list[int]] | None
    rows: list[int]


class _Units:
    """Flat arrays over all units of all ranks; unit ``u`` is ``pairs[u] = (src, idx)``, and rank
    ``r``'s units are ``starts[r]`` to ``starts[r + 1] - 1``.

    Built with C-level iterators, and with each rank's home cost and rows, because plans move few
    units: per-plan sums start from the home ones and visit only the ranks moves touch.
    """

    def __init__(self, costs: Sequence[Sequence[float]], tokens: Sequence[Sequence[int]]):
        self.num_ranks = len(costs)
        self.counts = list(map(len, costs))
        self.starts = [0, *accumulate(self.counts)]
        self.src = list(chain.from_iterable(map(repeat, range(self.num_ranks), self.counts)))
        # ``(src, idx)`` of each unit: what plans list.
        self.pairs = list(zip(self.src, chain.from_iterable(map(range, self.counts)), strict=True))
        self.cost = list(map(float, chain.from_iterable(costs)))
        self.tokens = list(map(int, chain.from_iterable(tokens)))
        spans = list(pairwise(self.starts))  # rank r's ids: range(*spans[r])
        # Summed in id order from 0.0, as ``_loads`` sums the ranks a plan touches.
        self.home_cost = [sum(self.cost[a:b]) for a, b in spans]
        self.home_rows = [sum(self.tokens[a:b]) for a, b in spans]

    def by_cost_desc(self) -> list[int]:
        """Unit ids by cost, descending; ties by (src, idx), i.e. by id (the sort is stable)."""
        negated = [-c for c in self.cost]
        return sorted(range(len(negated)), key=negated.__getitem__)


def _validate(costs, tokens, history) -> None:
    if len(costs) == 0:
        raise ValueError("solve_plan needs at least one rank, got costs for 0 ranks")
    if len(tokens) != len(costs):
        raise ValueError(f"costs has {len(costs)} ranks but tokens has {len(tokens)}")
    # Whole-input checks in C first; the per-rank loop only runs to name what is wrong.
    if (
        list(map(len, costs)) != list(map(len, tokens))
        or not all(map(math.isfinite, chain.from_iterable(costs)))
        or min(chain.from_iterable(costs), default=0) < 0
        or min(chain.from_iterable(tokens), default=0) < 0
    ):
        _name_invalid_rank(costs, tokens)
    if history is not None:
        if len(history) != len(costs):
            raise ValueError(f"history has {len(history)} ranks, expected {len(costs)}")
        if not all(math.isfinite(h) and h >= 0 for h in history):
            raise ValueError(f"history must be finite and >= 0, got {list(history)!r}")


def _name_invalid_rank(costs, tokens) -> None:
    for r, (rank_costs, rank_tokens) in enumerate(zip(costs, tokens, strict=True)):
        if len(rank_costs) != len(rank_tokens):
            raise ValueError(
                f"rank {r}: {len(rank_costs)} costs but {len(rank_tokens)} token counts"
            )
        if rank_costs and not (all(map(math.isfinite, rank_costs)) and min(rank_costs) >= 0):
            raise ValueError(f"rank {r}: costs must be finite and >= 0, got {list(rank_costs)!r}")
        if rank_tokens and min(rank_tokens) < 0:
            raise ValueError(f"rank {r}: token counts must be >= 0, got {list(rank_tokens)!r}")


def _moves(dest: list[int], units: _Units) -> list[int]:
    """Ids of the units ``dest`` computes away from home, ascending (found in C)."""
    return list(compress(range(len(dest)), map(operator.ne, dest, units.src)))


def _touched(dest: list[int], units: _Units, moves: list[int]) -> dict[int, list[int]]:
    """The units (ascending ids: ``(src, idx)`` order) that ``dest`` puts on each rank that
    ``moves`` sends a unit to or from; every other rank computes its own units.

    Units leaving or reaching those ranks stay among them, so a stable sort of their home units
    by ``dest`` groups them, in C, whether few ranks or all take part."""
    src, starts = units.src, units.starts
    ranks = sorted({src[u] for u in moves} | {dest[u] for u in moves})
    ids = list(chain.from_iterable(range(starts[r], starts[r + 1]) for r in ranks))
    ids.sort(key=dest.__getitem__)
    owners = list(map(dest.__getitem__, ids))
    bounds = [*(bisect.bisect_left(owners, r) for r in ranks), len(ids)]
    return {r: ids[bounds[i] : bounds[i + 1]] for i, r in enumerate(ranks)}


def _loads(units: _Units, base: list[float], touched: dict[int, list[int]]) -> list[float]:
    """Per-rank loads of an assignment whose ``touched`` ranks hold those units (``_touched``),
    the others their own: history plus the rank's costs summed in id order (the same bits for
    the same assignment however it was reached)."""
    loads = list(map(operator.add, base, units.home_cost))
    for r, ids in touched.items():
        loads[r] = base[r] + sum(map(units.cost.__getitem__, ids))
    return loads


def _rows_and_counts(units: _Units, touched: dict[int, list[int]]) -> tuple[list[int], list[int]]:
    """Per-rank rows and unit counts, the home ones but on the ranks moves touch."""
    rows, counts = units.home_rows[:], units.counts[:]
    for r, ids in touched.items():
        rows[r] = sum(map(units.tokens.__getitem__, ids))
        counts[r] = len(ids)
    return rows, counts


def _token_cap(units: _Units, ratio: float | None) -> float:
    """The most pixel rows a rank may compute (``config.max_len_ratio``); ``math.inf``: no cap.

    ``None`` caps at the fullest rank's current rows: the layout the job already fits in. Rows
    are integers, so flooring ``mean * ratio`` changes no comparison and keeps row room exact.
    """
    if ratio is None:
        return max(units.home_rows)
    if ratio == math.inf:
        return math.inf
    return math.floor(sum(units.tokens) / units.num_ranks * ratio)


def _cap_unkeepable(units: _Units, cap: float) -> bool:
    """Whether no assignment at all keeps the cap (``max_len_ratio=1.0`` with no unit above it,
    typically: the rows exceed ``ranks * floor(mean)``).

    At best the units above the cap sit alone and every other rank is full to the cap, so more
    rows than that fit in no assignment.
    """
    excess = sum(n - cap for n in units.tokens if n > cap)
    return sum(units.tokens) > cap * units.num_ranks + excess


def _rooms(rank_tokens: list[int], rank_units: list[int], cap: float) -> list[float]:
    """Rows each rank can still take. An empty rank may always hold one unit alone, however
    large (the cap's documented exception)."""
    return [cap - n if k else math.inf for n, k in zip(rank_tokens, rank_units, strict=True)]


def _place(
    order: list[int],
    dest: list[int],
    loads: list[float],
    rank_tokens: list[int],
    rank_units: list[int],
    units: _Units,
    cap: float,
    home_fill: float = -math.inf,
) -> None:
    """LPT placement of ``order`` (cost-descending) onto the least-loaded rank that fits the cap.

    A unit stays home instead when that keeps its home's load at most ``home_fill``. Ties go to
    the unit's home rank, then to the lowest rank. When no rank fits, the one with the fewest rows
    takes the unit (the plan then reports the broken cap). Mutates its arguments.

    Every rank has one entry in one of two heaps: ``open`` by load, or ``full`` by row room (most
    first) once it had no room for some unit. Before each unit, full ranks with room for it
    reopen, so the first open rank that fits is the answer; a rank too full for large units waits
    in ``full`` instead of being popped again for each of them. Units come roughly in descending
    rows, so each rank changes heaps a few times: O(units * log ranks) in practice.
    """
    if not order:  # best-fit placed every unit: skip the per-rank set-up
        return
    cost, tokens, src = units.cost, units.tokens, units.src
    room = _rooms(rank_tokens, rank_units, cap)
    # A rank with room for none of the units starts in ``full``: placing units that fit nowhere
    # (best-fit's leftovers on nearly full ranks) would otherwise first move every rank there.
    least = min((tokens[u] for u in order), default=0)
    # Loads only grow and rooms only shrink, so an entry older than its rank is a bound: refresh
    # it when it surfaces instead of pushing on every change. The open top taking the unit (the
    # common case) is updated at once, saving its refresh on the next unit.
    open_ = [(load, r) for r, load in enumerate(loads) if room[r] >= least]
    full = [(-room[r], r) for r in range(len(loads)) if room[r] < least]
    heapq.heapify(open_)
    heapq.heapify(full)
    for u in order:
        need, home = tokens[u], src[u]
        if loads[home] + cost[u] <= home_fill and room[home] >= need:
            chosen = home
        else:
            while full and -full[0][0] >= need:
                r = heapq.heappop(full)[1]
                heapq.heappush(open_, (loads[r], r))
            chosen = -1
            while open_:
                load, r = open_[0]
                if load != loads[r]:
                    heapq.heapreplace(open_, (loads[r], r))
                elif room[r] >= need:
                    chosen = r
                    break
                else:
                    heapq.heappop(open_)
                    heapq.heappush(full, (-room[r], r))
            if chosen < 0:
                while -full[0][0] != room[full[0][1]]:
                    heapq.heapreplace(full, (-room[full[0][1]], full[0][1]))
                chosen = full[0][1]  # the most room is the fewest rows
            elif chosen != home and loads[home] == loads[chosen] and room[home] >= need:
                chosen = home  # an LPT tie: staying home moves nothing
            else:
                heapq.heapreplace(open_, (loads[chosen] + cost[u], chosen))
        dest[u] = chosen
        loads[chosen] += cost[u]
        rank_tokens[chosen] += need
        rank_units[chosen] += 1
        room[chosen] = cap - rank_tokens[chosen]


def _lpt(units: _Units, order: list[int], base: list[float]) -> list[int]:
    """The seed's greedy: each unit, cost-descending, onto the least-loaded rank (no row cap)."""
    dest = [-1] * len(units.cost)
    heap = [(load, r) for r, load in enumerate(base)]
    heapq.heapify(heap)
    cost = units.cost
    for u in order:  # the hot path: one heapreplace per unit
        load, r = heap[0]
        dest[u] = r
        heapq.heapreplace(heap, (load + cost[u], r))
    return dest


def _lpt_within(units: _Units, order: list[int], base: list[float], cap: float) -> list[int]:
    """LPT onto the least-loaded rank with row room for each unit: the plan when the seed's
    greedy breaks the cap."""
    dest = [-1] * len(units.cost)
    zeros = [0] * units.num_ranks
    _place(order, dest, base[:], zeros[:], zeros[:], units, cap)
    return dest


def _refine(
    dest: list[int], units: _Units, base: list[float], cap: float, stop_load: float, max_iters: int
) -> _Candidate:
    """The seed's refinement: move or swap one unit between the most and least loaded ranks
    until the makespan is at most ``stop_load``, nothing helps, or ``max_iters`` steps ran.

    Returns the new assignment with its loads and whether it keeps the row cap (every candidate
    plan comes out of here, so the per-rank sums are made once)."""
    first = _candidate(dest[:], units, base, cap)
    if max(first.loads) <= stop_load or not max_iters:  # the usual case: no per-rank unit lists
        return first
    dest, loads = first.dest, first.loads
    rank_tokens = first.rows[:]
    groups, starts = _groups(first, units), units.starts
    held = [
        groups[r] if r in groups else list(range(starts[r], starts[r + 1]))
        for r in range(units.num_ranks)
    ]
    highest = [(-load, r) for r, load in enumerate(loads)]
    lowest = [(load, r) for r, load in enumerate(loads)]
    heapq.heapify(highest)
    heapq.heapify(lowest)
    for _ in range(max_iters):
        while -highest[0][0] != loads[highest[0][1]]:  # drop stale entries
            heapq.heappop(highest)
        while lowest[0][0] != loads[lowest[0][1]]:
            heapq.heappop(lowest)
        hi, lo = highest[0][1], lowest[0][1]
        if loads[hi] <= stop_load:
            break
        step = _best_step(
            held[hi],
            held[lo],
            loads[hi] - loads[lo],
            loads[hi],
            loads[lo],
            rank_tokens[hi],
            rank_tokens[lo],
            units,
            cap,
        )
        if step is None:
            break
        for k, frm, to in ((step[0], hi, lo), (step[1], lo, hi)):
            if k < 0:
                continue
            held[frm].remove(k)
            held[to].append(k)
            dest[k] = to
            loads[frm] -= units.cost[k]
            loads[to] += units.cost[k]
            rank_tokens[frm] -= units.tokens[k]
            rank_tokens[to] += units.tokens[k]
        for r in (hi, lo):
            heapq.heappush(highest, (-loads[r], r))
            heapq.heappush(lowest, (loads[r], r))
    keeps_cap = all(n <= cap or len(h) <= 1 for n, h in zip(rank_tokens, held, strict=True))
    # Running sums, and no groups (moves appended out of id order): a plan chosen from here is
    # grouped and summed afresh by ``_make_plan``, so the plan's loads do not depend on the path.
    return _Candidate(dest, loads, keeps_cap, None, rank_tokens)


def _best_step(
    on_hi: list[int],
    on_lo: list[int],
    gap: float,
    load_hi: float,
    load_lo: float,
    tokens_hi: int,
    tokens_lo: int,
    units: _Units,
    cap: float,
) -> tuple[int, int] | None:
    """Best move (``(u, -1)``) or swap (``(u, v)``) between two ranks that keeps both under the
    row cap: the one minimizing the pair's new maximum; ties go to the lowest unit ids.

    For a unit ``u`` the new maximum is V-shaped in the partner's cost, lowest at
    ``cost[u] - gap / 2``, so on each side only the nearest partner keeping the cap can win (the
    lowest id among equally near ones). They are found by bisection and a walk past partners that
    break the cap, instead of trying every pair.
    """
    cost, tokens = units.cost, units.tokens
    partners = sorted((cost[v], v) for v in on_lo)
    partner_costs = [c for c, _ in partners]

    def keeps_cap(u: int, v: int) -> bool:
        shift = tokens[u] - (tokens[v] if v >= 0 else 0)
        return tokens_lo + shift <= cap and tokens_hi - shift <= cap

    best = None
    for u in on_hi:
        i = bisect.bisect_left(partner_costs, cost[u] - gap / 2)
        candidates = [-1] if keeps_cap(u, -1) else []
        nearest = None  # cost of the nearest cheaper partner keeping the cap
        for c, v in reversed(partners[:i]):  # nearest first; equal costs by descending id
            if cost[u] - c >= gap or (nearest is not None and c != nearest):
                break
            if keeps_cap(u, v):
                candidates.append(v)
                nearest = c
        for c, v in partners[i:]:  # nearest first; equal costs by ascending id
            if c >= cost[u]:
                break
            if keeps_cap(u, v):
                candidates.append(v)
                break
        for v in candidates:
            delta = cost[u] - (cost[v] if v >= 0 else 0.0)
            if 0 < delta < gap:
                key = (max(load_hi - delta, load_lo + delta), u, v)
                if best is None or key < best:
                    best = key
    return None if best is None else (best[1], best[2])


def _min_move(
    units: _Units, order: list[int], base: list[float], cap: float, accept: float
) -> _Candidate:
    """Keep units home: overloaded ranks shed just enough to reach ``accept``, shed units are
    placed LPT-style, and a refinement repairs any overshoot.

    Returns an assignment and its loads: the first attempt reaching ``accept``, else the better
    of the two attempts."""
    first = _shed_and_place(units, base, cap, accept)
    if max(first.loads) <= accept:
        return first
    # Neither may reach the target (the row cap binds): the lower makespan, for solve_plan to weigh.
    return min(first, _fill_homes_first(units, order, base, cap, accept), key=_makespan)


def _shed_and_place(units: _Units, base: list[float], cap: float, accept: float) -> _Candidate:
    """min-move's first attempt: shed down to ``accept``, best-fit the shed units, refine."""
    shed, dest, loads, rank_tokens, rank_units = _shed(units, base, cap, accept)
    _best_fit(shed, dest, loads, rank_tokens, rank_units, units, cap, accept)
    return _refine(dest, units, base, cap, accept, units.num_ranks)


def _makespan(candidate: _Candidate) -> float:
    return max(candidate.loads)


def _shed(
    units: _Units, base: list[float], cap: float, accept: float
) -> tuple[list[int], list[int], list[float], list[int], list[int]]:
    """Every rank above ``accept`` (or above the row cap) sheds units until it is not.

    Returns ``(shed, dest, loads, rank_tokens, rank_units)``: the shed units by cost descending,
    ties by id (``by_cost_desc``'s order), and the home assignment without them (their ``dest``
    still says home) with its loads, rows and unit counts, ready for placement."""
    dest = units.src[:]
    loads = _loads(units, base, {})
    rank_tokens, rank_units = units.home_rows[:], units.counts[:]
    cost, starts = units.cost, units.starts
    over = (r for r, load in enumerate(loads) if load > accept)
    crowded = (r for r, n in enumerate(rank_tokens) if n > cap)
    shed: list[int] = []
    # Only these ranks need their units in order: no global sort.
    for r in sorted({*over, *(r for r in crowded if rank_units[r] > 1)}):
        # Cost-ascending, ties by id descending: what reversing the global order gives.
        keep = sorted(range(starts[r + 1] - 1, starts[r] - 1, -1), key=cost.__getitem__)
        while keep and (loads[r] > accept or (rank_tokens[r] > cap and len(keep) > 1)):
            for u in _units_to_shed(keep, loads[r] - accept, units):
                keep.remove(u)
                shed.append(u)
                loads[r] -= units.cost[u]
                rank_tokens[r] -= units.tokens[u]
                rank_units[r] -= 1
    shed.sort(key=lambda u: (-units.cost[u], u))
    return shed, dest, loads, rank_tokens, rank_units


def _fill_homes_first(
    units: _Units, order: list[int], base: list[float], cap: float, accept: float
) -> _Candidate:
    """min-move's second attempt, when shedding and best-fit leave the makespan above ``accept``."""
    # Fragmented room (a near-perfect LPT leaves ~1% slack): LPT order again, but each unit
    # stays home while its home has room below the target, so large units stay and only the
    # smallest overflow moves.
    dest = [-1] * len(units.cost)
    zeros = [0] * units.num_ranks
    _place(order, dest, base[:], zeros[:], zeros[:], units, cap, home_fill=accept)
    return _refine(dest, units, base, cap, accept, units.num_ranks)


def _best_fit(
    order: list[int],
    dest: list[int],
    loads: list[float],
    rank_tokens: list[int],
    rank_units: list[int],
    units: _Units,
    cap: float,
    limit: float,
) -> None:
    """Best-fit decreasing: each unit onto the rank whose load stays at most ``limit`` with the
    least room left, which keeps large holes for large units. Units that fit nowhere go to the
    least-loaded rank (``_place``) and the refinement repairs the overshoot. Mutates its arguments.

    As in ``_place``, a rank with too few rows of room for a unit leaves the search (``full``, by
    room) until a unit it has room for comes, instead of being skipped again for every unit. One
    with room for the next unit is only passed over: rows of consecutive units often alternate
    (photos, then videos with more rows at lower cost), and setting such a rank aside only to
    take it back for the next unit costs far more than stepping past it once.
    """
    by_load = sorted(zip(loads, range(len(loads)), strict=True))
    full: list[tuple[float, int]] = []  # only ranks in by_load take units, so rooms stay exact
    room = _rooms(rank_tokens, rank_units, cap)
    needs = list(map(units.tokens.__getitem__, order))
    misfits = []
    for k, u in enumerate(order):
        need = needs[k]
        next_need = needs[k + 1] if k + 1 < len(needs) else 0
        while full and -full[0][0] >= need:
            r = heapq.heappop(full)[1]
            bisect.insort(by_load, (loads[r], r))
        # The fullest rank that still fits is just below limit - cost in load order.
        i = bisect.bisect_right(by_load, (limit - units.cost[u], math.inf)) - 1
        while i >= 0 and room[by_load[i][1]] < need:
            if room[by_load[i][1]] < next_need:
                r = by_load.pop(i)[1]
                heapq.heappush(full, (-room[r], r))
            i -= 1
        if i < 0:
            misfits.append(u)
            continue
        load, r = by_load.pop(i)
        dest[u] = r
        loads[r] = load + units.cost[u]
        rank_tokens[r] += need
        rank_units[r] += 1
        room[r] = cap - rank_tokens[r]
        bisect.insort(by_load, (loads[r], r))
    _place(misfits, dest, loads, rank_tokens, rank_units, units, cap)


def _units_to_shed(ascending: list[int], excess: float, units: _Units) -> list[int]:
    """Units of one rank whose costs cover ``excess`` with few rows (``ascending`` by cost).

    Two candidates: the cheapest single unit that covers the excess, or the largest units below
    it while they leave some of it, closed by the cheapest other unit covering the rest. The one
    moving fewer rows wins (the second on ties): large units carry fewer rows per cost, small
    ones place more easily. With no excess (only the row cap is exceeded) the largest unit goes;
    with nothing covering the excess (history alone exceeds the target), every unit goes.
    """
    if excess <= 0:
        return [ascending[-1]]
    cost, tokens = units.cost, units.tokens
    single = next((u for u in ascending if cost[u] >= excess), None)
    several: list[int] = []
    covered = 0.0
    for u in reversed(ascending):
        if 0 < cost[u] < excess:
            if covered + cost[u] >= excess:
                break
            several.append(u)
            covered += cost[u]
    taken = set(several)
    closing = next((u for u in ascending if u not in taken and cost[u] >= excess - covered), None)
    if closing is None:
        return list(ascending)
    several.append(closing)
    if single is None or sum(tokens[u] for u in several) <= tokens[single]:
        return several
    return [single]


def _moved(dest: list[int], units: _Units) -> int:
    return sum(map(units.tokens.__getitem__, _moves(dest, units)))


def _inter_node_rows(dest: list[int], units: _Units, ranks_per_node: int | None) -> int:
    """Rows computed on another node than their home rank's (rank ``r`` on node
    ``r // ranks_per_node``); 0 when nodes are unknown (``None``)."""
    if ranks_per_node is None:
        return 0
    src, tokens = units.src, units.tokens
    return sum(
        tokens[u]
        for u in _moves(dest, units)
        if dest[u] // ranks_per_node != src[u] // ranks_per_node
    )


def _candidate(dest: list[int], units: _Units, base: list[float], cap: float) -> _Candidate:
    """``dest`` with its fresh loads (running sums may differ in the last bits) and row check."""
    moves = _moves(dest, units)
    if 4 * len(moves) <= len(dest):
        touched = _touched(dest, units, moves)
        loads = _loads(units, base, touched)
        rows, counts = _rows_and_counts(units, touched)
    else:  # most units move (LPT): one pass over them all; grouped only if a plan needs it
        touched = None
        costs, rows = [0.0] * units.num_ranks, [0] * units.num_ranks
        for d, c, n in zip(dest, units.cost, units.tokens, strict=True):
            costs[d] += c  # in id order from 0.0: the bits ``_loads`` gives
            rows[d] += n
        loads = list(map(operator.add, base, costs))
        counts = collections.Counter(dest)  # counted in C
    return _Candidate(dest, loads, _keeps_cap(rows, counts, cap), touched, rows)


def _groups(candidate: _Candidate, units: _Units) -> dict[int, list[int]]:
    """The units (ascending ids) of each rank the candidate's moves touch: ``touched``, or every
    rank's, grouped now when ``_candidate`` left that for later."""
    if candidate.touched is not None:
        return candidate.touched
    held: list[list[int]] = [[] for _ in range(units.num_ranks)]
    for u, d in enumerate(candidate.dest):
        held[d].append(u)
    return dict(enumerate(held))


def _keeps_cap(rows: list[int], counts: Sequence[int], cap: float) -> bool:
    """No rank above ``cap`` rows, but for ranks holding a single unit."""
    return all(counts[r] <= 1 for r, n in enumerate(rows) if n > cap)


def _make_plan(
    candidate: _Candidate,
    units: _Units,
    base: list[float],
    loads_before: list[float],
    applied: bool,
    reason: str,
    ranks_per_node: int | None = None,
) -> Plan:
    dest, loads_after = candidate.dest, candidate.loads
    groups = _groups(candidate, units)
    if candidate.touched is None:  # the refinement's running sums: summed afresh
        loads_after = _loads(units, base, groups)
    # Ranks no move touches compute their own units, in order: slices of the home pairs.
    starts, pairs = units.starts, units.pairs
    assignment = list(map(pairs.__getitem__, map(slice, starts, starts[1:])))
    for r, ids in groups.items():
        assignment[r] = list(map(pairs.__getitem__, ids))
    return Plan(
        assignment=assignment,
        applied=applied,
        reason=reason,
        loads_before=loads_before,
        loads_after=loads_after,
        imbalance_before=imbalance(loads_before),
        imbalance_after=imbalance(loads_after),
        moved_tokens=_moved(dest, units),
        cap_respected=candidate.cap_respected,
        inter_node_tokens=_inter_node_rows(dest, units, ranks_per_node),
    )
