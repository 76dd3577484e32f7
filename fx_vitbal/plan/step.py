"""The planning step of one balanced call, pure: every rank's grids in, the plan out, the same on
every rank. The runtime gathers the grids and fits the cost models, calls ``plan_step`` once,
and lays out its own part of the result (routing, bands); nothing here calls back up.

The step: each rank's grid rows become units (``split_units``: a video's frames, where the ViT
encodes them independently), each unit is costed (``unit_costs``), and ``solve_plan`` (or
``solve_for_sets`` for replica sets) assigns them. Where the tower runs bands, the frames that
bind the step alone are then split (``solve_with_bands``) and the step is planned again, kept
only when the predicted makespan falls by ``min_gain``.
"""

import dataclasses
import functools
import itertools
from collections.abc import Callable, Sequence

from fx_vitbal.config import BalanceConfig
from fx_vitbal.cost.static import ArchitectureCost, CostModel
from fx_vitbal.plan.bands import (
    BandRule,
    band_cost,
    bands_of_binding_frames,
    exchange_scale,
    whole_where_idle,
)
from fx_vitbal.plan.replicas import as_held, solve_for_sets
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
    """Each split frame's exchange (``BalanceConfig.band_exchange``: ``gather``, ``ulysses`` or
    ``ring``), by frame name as in ``frames``."""
    note: str | None = None
    """The ``--dp-balance-verbose`` line (``describe_plan``), when asked for."""

    @functools.cached_property
    def _where(self) -> dict[tuple[int, int], int]:
        where = {}
        for r, _ in enumerate(self.units_R):
            for j, d in enumerate(self.plan.destinations(r)):
                owner, index = (r, j) if self.sets is None else (self.set_of[r], self.held[r][j])
                where[(owner, index)] = d
        return where

    @functools.cached_property
    def set_of(self) -> list[int]:
        """Each rank's owner: itself, or its replica set."""
        if self.sets is None:
            return list(range(len(self.units_R)))
        set_of = [0] * len(self.units_R)
        for s, ranks in enumerate(self.sets):
            for r in ranks:
                set_of[r] = s
        return set_of

    def computed_by(self, owner: int, index: int) -> int:
        """The rank computing unit ``index`` of ``owner``."""
        return self._where[(owner, index)]


def split_units(grid: Sequence[Sequence[int]], split_frames: bool) -> list[tuple[int, int, int]]:
    """A rank's units: its grid rows, or one ``(1, h, w)`` unit per frame (a video's frames share
    one tuple: every rank splits every rank's grid, each step)."""
    if split_frames:
        return [unit for t, h, w in grid for unit in itertools.repeat((1, h, w), t)]
    return list(map(tuple, grid))


def unit_costs(
    cost_model: CostModel, rule: BandRule | None = None, scale: tuple[float, float] | None = None
) -> Callable[[Unit], float]:
    """A unit's cost under ``cost_model``, each distinct unit costed once (grids repeat a lot,
    and cost models are Python); a ``Band``'s is its share of its frame's, plus the bytes of
    its exchange priced by ``scale`` (``plan.bands``)."""
    memo: dict[tuple, float] = {}

    def cost_of(unit) -> float:
        if unit not in memo:
            if is_band(unit):
                frame = cost_of((1, unit.full_h, unit.w))
                price = rule.price(unit, scale[0]) if scale is not None else 0.0
                memo[unit] = band_cost(frame, unit) + price
            else:
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
    split = settings.config.split_frames
    if sets is None:
        units_O = [split_units(grid, split) for grid in grids_R]
    else:
        units_O = [split_units(grids_R[ranks[0]], split) for ranks in sets]
    cost_of = unit_costs(settings.cost_model, settings.band_rule, settings.band_scale)
    planned = solve_with_bands(units_O, cost_of, settings, len(grids_R), sets)
    planned = dataclasses.replace(planned, exchanges=choose_exchanges(planned, settings))
    if describe_as is None:
        return planned
    return dataclasses.replace(planned, note=describe_plan(planned, describe_as))


def _solve(units_O, cost_of, settings: PlanSettings, num_ranks: int, sets) -> StepPlan:
    costs, tokens = cost_units(units_O, cost_of)
    config, seconds = settings.config, settings.exchange_seconds
    frames = _split_frames(units_O)
    if sets is None:
        plan = solve_plan(costs, tokens, config=config, exchange_seconds=seconds)
        return StepPlan(plan, units_O, units_O, rows_O=tokens, frames=frames)
    plan, held = solve_for_sets(costs, tokens, sets, config=config, exchange_seconds=seconds)
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
    """The plan of ``units_O``, or of ``units_O`` with the frames that bind the step split into
    bands (``plan.bands.bands_of_binding_frames``), when that lowers the predicted makespan by
    ``min_gain``, the collectives' latency counted (every rank pays it per exchanging layer and
    direction). A frame whose bands all land on one rank is put back whole, and the step
    planned again (a split that moves no work would only add collectives)."""
    whole = _solve(units_O, cost_of, settings, num_ranks, sets)
    rule, config = settings.band_rule, settings.config
    if rule is None or num_ranks < 2:
        return whole
    max_bands = min(num_ranks, config.ranks_per_node or num_ranks)
    costs_O = [[cost_of(u) for u in units] for units in units_O]
    split = bands_of_binding_frames(units_O, costs_O, num_ranks, rule, max_bands)
    if split == units_O:
        return whole
    for _ in range(MAX_REPLANS):
        banded = _solve(split, cost_of, settings, num_ranks, sets)
        where_O = [[banded.computed_by(o, i) for i in range(len(us))] for o, us in enumerate(split)]
        kept = [whole_where_idle(units, where) for units, where in zip(split, where_O, strict=True)]
        if kept == split:
            break
        split = kept
    if not any(is_band(u) for units in split for u in units):
        return whole
    latency = settings.band_scale[1] if settings.band_scale is not None else 0.0
    span = _makespan(banded.plan) + 2 * rule.exchange_layers * latency
    if span >= _makespan(whole.plan) * (1.0 - config.min_gain):
        return whole
    return banded


def choose_exchanges(planned: StepPlan, settings: PlanSettings) -> dict[tuple[int, int], str]:
    """Each split frame's exchange kind: the config's when forced (``ulysses`` only where the
    tower's heads divide among the frame's ranks: else ``ring``, by rule), else ``gather``."""
    forced, rule = settings.config.band_exchange, settings.band_rule
    kinds = {}
    for name, bands in planned.frames.items():
        k = len({planned.computed_by(name[0], i) for i in bands})
        kind = "gather" if forced == "auto" else forced
        if kind == "ulysses" and not (rule is not None and rule.heads and rule.heads % k == 0):
            kind = "ring"  # the heads do not divide among the frame's ranks
        kinds[name] = kind
    return kinds


# Plans made while putting back frames whose bands landed on one rank (each puts back at least one).
MAX_REPLANS = 3


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
    moved, imbalance and the heaviest and lightest rank's load relative to the mean; then the
    frames split into bands, and the rows replica sets no longer compute twice."""
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
        else:
            line += f", load/mean {before}"
    if step_plan.frames:
        frames, bands = len(step_plan.frames), sum(map(len, step_plan.frames.values()))
        line += f", {frames} frame{'s' * (frames > 1)} split into {bands} bands"
    deduplicated = step_plan.deduplicated_rows
    if deduplicated:
        line += f", replica sets: {deduplicated:,} rows no longer computed twice"
    return line
