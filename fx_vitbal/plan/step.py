"""The planning step of one balanced call, pure: every rank's grids in, the plan out, the same on
every rank. The runtime gathers the grids and fits the cost models, calls ``plan_step`` once,
and lays out its own part of the result (routing, bands); nothing here calls back up.

The step: each rank's grid rows become units (``split_units``: a video's frames, where the ViT
encodes them independently), each unit is costed (``unit_costs``), and ``solve_plan`` (or
``solve_for_sets`` for replica sets) assigns them. Where the tower runs bands, frames that bind
the step (or exceed the memory budget) are cut into bands, each split frame's exchange priced
where its bands sit and chosen by that price (``solve_with_bands``: [Note: how bands are
planned] in ``plan.bands``), kept only when the predicted makespan falls by ``min_gain`` (or
the budget needs them).
"""

import collections
import dataclasses
import functools
import itertools
from collections.abc import Callable, Sequence

from fx_vitbal.config import BalanceConfig
from fx_vitbal.cost.memory import held_bytes_per_patch, rows_within
from fx_vitbal.cost.static import ArchitectureCost, CostModel, OnlineCost
from fx_vitbal.plan.band_gaps import close_gaps
from fx_vitbal.plan.band_nodes import by_nodes, cross_cuts, solve_by_nodes, solve_sets
from fx_vitbal.plan.band_plan import (
    plan_cuts,
)
from fx_vitbal.plan.band_prices import ExchangePrices, exchange_prices, usp_degree
from fx_vitbal.plan.bands import BandRule, exchange_scale
from fx_vitbal.plan.collector import collector_paused
from fx_vitbal.plan.replicas import as_held, set_of_ranks, solve_for_sets
from fx_vitbal.plan.solve import solve_plan
from fx_vitbal.plan.units import Plan, is_band, unit_rows

Unit = tuple  # ``(t, h, w)``, or a ``Band``


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanSettings:
    """Everything the planning step needs besides the grids, parsed (the runtime keeps them as
    one spec string per ViT and config, ``runtime.vit.settings.planner_spec``)."""

    config: BalanceConfig
    cost_model: CostModel
    """The unit cost: the ViT's static model, or the online model fitted this step."""
    band_rule: BandRule | None = None
    """The frames that bind the step alone may be split into bands by it (None: never)."""
    exchange_seconds: Callable[[list[int], list[int]], float] | None = None
    """The measured exchange model, weighed against the saving (``solve_plan``)."""
    exchange_latency: float = 0.0
    exchange_seconds_per_byte: float = 0.0
    """The measured exchange's fitted latency and seconds per byte (0: not measured): with
    costs in seconds, what prices a band's exchange (``band_scale``)."""

    @property
    def band_scale(self) -> tuple[float, float] | None:
        """``(bytes per cost unit, cost of one collective)`` pricing a band's exchange
        (``plan.bands.exchange_scale``): the measured exchange when costs are in seconds, the
        H100-class constants when they are in multiply-accumulates, else None (``l**2`` and
        polynomial costs have no scale for bytes)."""
        if self.exchange_seconds_per_byte > 0.0:
            return exchange_scale(True, self.exchange_latency, self.exchange_seconds_per_byte)
        if isinstance(self.cost_model, ArchitectureCost):
            return exchange_scale(False)
        return None

    @property
    def exchange_prices(self) -> ExchangePrices | None:
        """What a split frame's exchange costs where its ranks sit (``plan.band_prices``), in
        the units ``band_scale`` names; None without a band rule or a scale for bytes."""
        if self.band_rule is None:
            return None
        return exchange_prices(
            self.band_rule,
            macs=isinstance(self.cost_model, ArchitectureCost),
            ranks_per_node=self.config.ranks_per_node,
            forced=self.config.band_exchange,
            latency=self.exchange_latency,
            seconds_per_byte=self.exchange_seconds_per_byte,
        )

    @property
    def held_bytes_per_patch(self) -> int:
        """Activation bytes a patch holds through the tower (``cost.memory``), from the
        architecture where the cost model knows it, else from the band rule; 0 without
        either (nothing to weigh a memory budget with)."""
        architecture = self.cost_model
        if isinstance(architecture, OnlineCost):
            architecture = architecture.prior
        if not isinstance(architecture, ArchitectureCost):
            architecture = None
        if self.band_rule is not None:
            return self.band_rule.held_bytes_per_patch(architecture)
        return held_bytes_per_patch(architecture) if architecture is not None else 0

    @property
    def max_rows(self) -> float:
        """The most pixel rows (patches) a rank may compute within ``memory_budget``: a row cap
        beside ``max_len_ratio``'s (``solve_plan``'s ``max_rows``); ``math.inf`` without a
        budget or a count of held bytes."""
        return rows_within(self.config.memory_budget, self.held_bytes_per_patch)


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """A call's plan and the units it was made of."""

    plan: Plan
    units_O: list[list[Unit]]
    """Every owner's units as planned (an owner is a rank, or a replica set), a split frame's
    ``Band``s consecutive in its owner's list, in place of the frame."""
    units_R: list[list[Unit]]
    """The units each rank holds in the plan's layout (``units_O`` without replica sets)."""
    sets: list[tuple[int, ...]] | None = None
    """Replica sets (``plan.replicas``), or None."""
    held: list[list[int]] | None = None
    """With replica sets: the indices in its set of the units each rank holds."""
    deduplicated_rows: int = 0
    """Pixel rows replica sets no longer compute once per replica (0 without sets)."""
    rows_O: list[list[int]] = dataclasses.field(default_factory=list)
    """Each owner's units' pixel rows (``units_O``'s)."""
    frames: dict[tuple[int, int], list[int]] = dataclasses.field(default_factory=dict)
    """The split frames, by name ``(owner, index of their first band)``: their bands' indices
    in the owner's units, in order. Empty on a step that splits nothing."""
    exchanges: dict[tuple[int, int], str] = dataclasses.field(default_factory=dict)
    """Each split frame's exchange (``BalanceConfig.band_exchange``: ``gather``, ``ulysses``,
    ``ring`` or ``usp``), by frame name as in ``frames``."""
    node_bands: dict[tuple[int, int], int] = dataclasses.field(default_factory=dict)
    """Each ``usp`` frame's bands per Ulysses group (``band_prices.usp_degree``), by name."""
    note: str | None = None
    """The ``--dp-balance-verbose`` line (``describe_plan``), when asked for."""

    @functools.cached_property
    def _where(self) -> dict[int, list[int]]:
        """Each owner's units' ranks, listed when ``computed_by`` first asks of that owner."""
        return {}

    @functools.cached_property
    def set_of(self) -> list[int]:
        """Each rank's owner: itself, or its replica set."""
        if self.sets is None:
            return list(range(len(self.units_R)))
        return set_of_ranks(self.sets)

    def computed_by(self, owner: int, index: int) -> int:
        """The rank computing unit ``index`` of ``owner`` (a layout asks of its frames' owners)."""
        where = self._where.get(owner)
        if where is None:
            if self.sets is None:
                where = self.plan.destinations(owner)
            else:  # the set's units, each from the replica holding it
                where = [0] * len(self.units_O[owner])
                for r in self.sets[owner]:
                    for j, d in enumerate(self.plan.destinations(r)):
                        where[self.held[r][j]] = d
            self._where[owner] = where
        return where[index]


def split_units(grid: Sequence[Sequence[int]], split_frames: bool) -> list[tuple[int, int, int]]:
    """A rank's units: its grid rows, or one ``(1, h, w)`` unit per frame (a video's frames share
    one tuple: every rank splits every rank's grid, each step)."""
    if split_frames:
        return [unit for t, h, w in grid for unit in itertools.repeat((1, h, w), t)]
    return list(map(tuple, grid))


def unit_costs(cost_model: CostModel) -> Callable[[Unit], float]:
    """A whole unit's cost under ``cost_model``, each distinct unit costed once (grids repeat a
    lot, and cost models are Python). Bands are costed where they are cut
    (``plan.band_plan``): their share of their frame's cost plus their exchange's price."""
    memo: dict[tuple, float] = {}

    def cost_of(unit) -> float:
        if unit not in memo:
            memo[unit] = cost_model(*unit)
        return memo[unit]

    return cost_of


def cost_units(units_R: list[list[Unit]], cost_of) -> tuple[list[list[float]], list[list[int]]]:
    """``(costs, tokens)`` of every rank's units for ``solve_plan``: ``cost_of`` each unit
    (``unit_costs``), and its pixel rows."""
    costs = [[cost_of(u) for u in units] for units in units_R]
    tokens = [[unit_rows(u) for u in units] for units in units_R]
    return costs, tokens


def plan_step(
    grids_R: list[list[list[int]]],
    settings: PlanSettings,
    sets: list[tuple[int, ...]] | None = None,
    describe_as: int | None = None,
) -> StepPlan:
    """Cost every unit of every rank and solve the plan (the same result on every rank).

    ``sets``: replica sets, whose ranks hold one grid each: their units are planned once
    (``plan.replicas.solve_for_sets``). ``describe_as``: the call's ``BalanceStats.step``, to
    write the ``--dp-balance-verbose`` line for (``StepPlan.note``; None: none). The memo of
    unit costs lives for this call only.
    """
    with collector_paused():
        split = settings.config.split_frames
        if sets is None:
            units_O = [split_units(grid, split) for grid in grids_R]
        else:
            units_O = [split_units(grids_R[ranks[0]], split) for ranks in sets]
        planned = solve_with_bands(
            units_O, unit_costs(settings.cost_model), settings, len(grids_R), sets
        )
        if describe_as is None:
            return planned
        return dataclasses.replace(planned, note=describe_plan(planned, describe_as))


def _solve(units_O, costs_O, settings: PlanSettings, sets) -> StepPlan:
    tokens = [[unit_rows(u) for u in units] for units in units_O]
    config, seconds = settings.config, settings.exchange_seconds
    frames = _split_frames(units_O)
    rows = settings.max_rows
    if sets is None:
        plan = solve_plan(costs_O, tokens, config=config, exchange_seconds=seconds, max_rows=rows)
        return StepPlan(plan, units_O, units_O, rows_O=tokens, frames=frames)
    plan, held = solve_for_sets(
        costs_O, tokens, sets, config=config, exchange_seconds=seconds, max_rows=rows
    )
    deduplicated = sum(  # each set's rows, once instead of once per replica
        (len(ranks) - 1) * sum(tokens_S) for ranks, tokens_S in zip(sets, tokens, strict=True)
    )
    units_R = as_held(units_O, sets, held)
    return StepPlan(plan, units_O, units_R, list(sets), held, deduplicated, tokens, frames)


def _split_frames(units_O: list[list[Unit]]) -> dict[tuple[int, int], list[int]]:
    """``StepPlan.frames``: each split frame's bands, consecutive in its owner's units."""
    frames: dict[tuple[int, int], list[int]] = {}
    for o, units in enumerate(units_O):
        for i, u in enumerate(units):
            if is_band(u):
                name = (o, i) if u.first_row == 0 else next(reversed(frames))
                frames.setdefault(name, []).append(i)
    return frames


def solve_with_bands(
    units_O: list[list[Unit]], cost_of, settings: PlanSettings, num_ranks: int, sets=None
) -> StepPlan:
    """The plan of ``units_O``, with frames cut into bands where that pays (see [Note: how
    bands are planned] in ``plan.bands``); ``StepPlan.exchanges`` names each split frame's
    exchange."""
    costs_O = [[cost_of(u) for u in units] for units in units_O]
    rule, config = settings.band_rule, settings.config

    def solve(units, costs):
        return _solve(units, costs, settings, sets)

    if rule is None or num_ranks < 2:
        return solve(units_O, costs_O)
    prices, held = settings.exchange_prices, settings.held_bytes_per_patch
    rpn = config.ranks_per_node

    def cuts_of(units, costs, only_required=False):
        cuts = plan_cuts(units, costs, num_ranks, rule, prices, config, held)
        return {key: cut for key, cut in cuts.items() if cut.required or not only_required}

    def with_bands(cuts, only_required=False):
        if sets is not None:
            return _with_sets(units_O, costs_O, settings, sets, only_required, cuts_of)
        if only_required:
            cuts = {key: cut for key, cut in cuts.items() if cut.required}
        cross = cross_cuts(cuts, rpn) if by_nodes(rpn, num_ranks) else {}
        done = solve_by_nodes(
            units_O,
            costs_O,
            cross,
            rule,
            prices,
            config,
            held,
            only_required,
            settings.exchange_seconds,
        )
        if done is None:
            return None
        plan, final, settled, rows_O = done
        frames = _split_frames(final.units_O)
        planned = StepPlan(plan, final.units_O, final.units_O, rows_O=rows_O, frames=frames)
        exchanges = {final.names[key]: cut.kind for key, cut in settled.items()}
        return planned, final.units_O, final.costs_O, exchanges

    cuts = cuts_of(units_O, costs_O)
    whole = None
    placed = with_bands(cuts) if cuts else None
    if placed is not None:
        span = _makespan(placed[0].plan)
        largest = max((c for costs in costs_O for c in costs), default=0.0)
        bound = max(sum(map(sum, costs_O)) / num_ranks, largest)  # no whole plan ends below
        # Bands that break the row cap where whole units keep it are worth nothing (a budget's
        # bands are kept: whole, their frames break it more).
        breaks_cap = not placed[0].plan.cap_respected
        if breaks_cap or span >= bound * (1.0 - config.min_gain):
            whole = solve(units_O, costs_O)
            worse = breaks_cap and whole.plan.cap_respected
            if worse or span >= _makespan(whole.plan) * (1.0 - config.min_gain):
                required = any(cut.required for cut in cuts.values())
                placed = with_bands(cuts, only_required=True) if required else None
    if placed is None:
        planned, units, costs, exchanges = whole or solve(units_O, costs_O), units_O, costs_O, {}
    else:
        planned, units, costs, exchanges = placed
    worth_a_look = planned.plan.applied or planned.plan.reason == "no-gain"
    if sets is None and prices is not None and worth_a_look:
        closed = close_gaps(
            planned.plan, units, costs, planned.rows_O, exchanges, prices, config, settings.max_rows
        )
        if closed is not None:
            plan, units, rows_O = closed
            planned = StepPlan(plan, units, units, rows_O=rows_O, frames=_split_frames(units))
    node_bands = {
        name: usp_degree(rule.heads, len(planned.frames[name]), rpn)
        for name, kind in exchanges.items()
        if kind == "usp"
    }
    return dataclasses.replace(planned, exchanges=exchanges, node_bands=node_bands)


def _with_sets(units_S, costs_S, settings: PlanSettings, sets, only_required, cuts_of):
    """``with_bands`` for replica sets (``band_nodes.solve_sets``)."""
    done = solve_sets(
        units_S,
        costs_S,
        sets,
        settings.band_rule,
        settings.exchange_prices,
        settings.config,
        settings.held_bytes_per_patch,
        lambda units, costs: cuts_of(units, costs, only_required),
    )
    if done is None:
        return None
    plan, units_S, held, rows_S, names, settled = done
    deduplicated = sum((len(r) - 1) * sum(rows) for r, rows in zip(sets, rows_S, strict=True))
    units_R = as_held(units_S, sets, held)
    frames = _split_frames(units_S)
    planned = StepPlan(plan, units_S, units_R, list(sets), held, deduplicated, rows_S, frames)
    return planned, None, None, {names[key]: cut.kind for key, cut in settled.items()}


def _makespan(plan: Plan) -> float:
    return max(plan.loads_after if plan.applied else plan.loads_before)


# What the --dp-balance-verbose line says for each ``Plan.reason`` of a plan kept home.
KEPT_BECAUSE = {
    "balanced": "already balanced (imbalance below the trigger threshold)",
    "no-gain": "no plan lowers the makespan by min_gain",
    "cap": "every plan found breaks the row cap",
    "dominant-unit": "one unit outweighs the mean load (seed skip rule)",
    "single-rank": "one rank",
    "empty": "no images on any rank",
    "exchange": "the measured exchange would cost more than it saves",
}


def describe_plan(step_plan: StepPlan, step: int) -> str:
    """The ``--dp-balance-verbose`` line of call ``step`` (``BalanceStats.step``): whether the
    plan moved work or kept every unit home and why (``Plan.reason`` as ``reason=``), rows
    moved, imbalance and the heaviest and lightest rank's load relative to the mean, and
    whether the plan breaks the row cap (no plan found keeps it); then the frames split into
    bands, and the rows replica sets no longer compute twice."""
    plan = step_plan.plan
    total = sum(unit_rows(u) for units in step_plan.units_R for u in units)
    if plan.applied:
        head = f"applied, moved {plan.moved_tokens:,} of {total:,} rows"
        head += f" ({plan.moved_tokens / max(total, 1):.1%})"
    else:
        why = KEPT_BECAUSE.get(plan.reason, plan.reason)
        head = f"kept home: {why} (reason={plan.reason}), {total:,} rows"
    line = f"[vit dp balance] step {step}: {head}"
    mean = sum(plan.loads_before) / len(plan.loads_before)
    if mean and len(plan.loads_before) > 1:  # (one rank has no imbalance)
        before = f"max {max(plan.loads_before) / mean:.2f} min {min(plan.loads_before) / mean:.2f}"
        line += f", imbalance {plan.imbalance_before:.3f}"
        if plan.applied:
            after = f"max {max(plan.loads_after) / mean:.2f} min {min(plan.loads_after) / mean:.2f}"
            line += f" -> {plan.imbalance_after:.3f}, load/mean {before} -> {after}"
            if not plan.cap_respected:
                line += ", above the row cap (max_len_ratio or memory budget): none found keeps it"
        else:
            line += f", load/mean {before}"
    if step_plan.frames:
        frames, bands = len(step_plan.frames), sum(map(len, step_plan.frames.values()))
        line += f", {frames} frame{'s' * (frames > 1)} split into {bands} bands"
        kinds = sorted(collections.Counter(step_plan.exchanges.values()).items())
        line += f" ({', '.join(f'{kind} {n}' for kind, n in kinds)})" if kinds else ""
    deduplicated = step_plan.deduplicated_rows
    if deduplicated:
        line += f", replica sets: {deduplicated:,} rows no longer computed twice"
    return line
