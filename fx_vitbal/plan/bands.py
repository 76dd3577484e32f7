"""Bands: a frame that would bind the step alone, split into row bands computed on several ranks.

With whole units a step is never faster than its costliest unit, and one huge image can run its
rank out of memory. A *band* (``Band``) is a run of whole rows of one frame, starting at a
multiple of the tower's alignment (its merge rows, or its window rows where it has windowed
layers, so that every window stays whole); each band is computed on a rank of its own, and in the
tower's full-attention layers the band ranks exchange keys and values so every band attends over
the whole frame (``fx_vitbal.runtime.bands``).

To the planner a band is one more unit, with its rows and its cost: the frame's cost shared by
rows (a band of ``n`` of the frame's ``N`` rows attends from ``n`` queries to ``N`` keys, so its
attention pairs ``n*N`` sum to the frame's ``N**2``, and its linear work is its rows), plus the
price of its exchange when the cost model has a scale for bytes (``BandRule.price``). Granularity
goes cheapest first: whole units and frames (``solve_plan``), then bands of every frame that
binds the step alone, kept only when the predicted makespan falls by ``min_gain``.

Deterministic like every plan: the same units give the same bands on every rank.
"""

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

from fx_vitbal.plan.units import Plan

# What one all_to_all and one byte cost, in multiply-accumulates of a ViT, on an H100-class GPU:
# bf16 dense 989 TFLOP/s (NVIDIA's datasheet) at ~40% MFU is ~2e14 MAC/s, and a forward MAC costs
# three in training (the backward, ~2x the forward); NVLink all-to-all moves ~350 GB/s at ~11 us a
# collective, one 400 Gb/s InfiniBand NIC ~48 GB/s (../shared/notes/bands.md: this model
# reproduces torchtitan's 82,944-patch speed-ups within 2%).
MACS_PER_SECOND = 2e14
TRAINING_MACS_PER_FORWARD_MAC = 3
NVLINK_BYTES_PER_SECOND = 350e9
INFINIBAND_BYTES_PER_SECOND = 48e9
COLLECTIVE_SECONDS = 11e-6


class Band(NamedTuple):
    """A band of a frame as a planner unit: ``(1, h, w)`` are its own
    patch rows and columns (what it moves and what the row cap counts), ``full_h`` the frame's
    rows, ``first_row`` where it starts in the frame. The bands of one frame are consecutive
    units of their owner, in order."""

    t: int
    h: int
    w: int
    full_h: int
    first_row: int


def unit_rows(unit: Sequence[int]) -> int:
    """Pixel rows of a unit ``(t, h, w)`` or a ``Band``."""
    return unit[0] * unit[1] * unit[2]


def is_band(unit: Sequence[int]) -> bool:
    """Whether a unit is a ``Band`` of a frame (five fields) rather than a whole unit."""
    return len(unit) == 5


@dataclasses.dataclass(frozen=True, kw_only=True)
class BandRule:
    """What a tower that can run bands says about them (``fx_vitbal.runtime.vits``), with the
    caller's limits; every rank plans with the same one (it is in the planner spec)."""

    align: int
    """Patch rows a band starts at a multiple of: the merge size, or the window height in patch
    rows where the tower has windowed layers (Qwen2.5-VL: 8), so its windows stay whole."""
    min_patches: int
    """No band has fewer patches (``BalanceConfig.min_band_patches``)."""
    exchange_layers: int
    """Layers that attend over the whole frame: each exchanges the bands' keys and values."""
    kv_bytes_per_patch: int
    """Bytes of one patch's keys and values in one such layer (2 x hidden x 2 bytes in bf16)."""

    def bands(self, unit: Sequence[int], parts: int) -> list[Band]:
        """``unit`` (a frame ``(1, h, w)``) as up to ``parts`` bands of whole ``align`` rows, as
        even as rows allow (the first bands get the extra rows), each of at least
        ``min_patches`` patches; one band (the frame) when it cannot be split."""
        t, h, w = unit
        blocks = h // self.align if h % self.align == 0 else 0
        least = -(-self.min_patches // (self.align * w))  # blocks the smallest band needs
        parts = min(parts, blocks // max(least, 1))
        if t != 1 or parts < 2:
            return [Band(1, h, w, h, 0)]
        base, extra = divmod(blocks, parts)
        bands, first = [], 0
        for i in range(parts):
            rows = (base + (i < extra)) * self.align
            bands.append(Band(1, rows, w, h, first))
            first += rows
        return bands

    def price(self, band: Band, bytes_per_cost: float) -> float:
        """The bytes ``band``'s rank receives, in cost units: per exchanging layer, forward and
        backward, the other bands' keys and values (their gradients going back). The
        collectives' latency is every rank's (``solve_with_bands``' ``collective_cost``)."""
        other_patches = (band.full_h - band.h) * band.w
        return 2 * self.exchange_layers * other_patches * self.kv_bytes_per_patch / bytes_per_cost


def band_cost(frame_cost: float, band: Band) -> float:
    """A band's share of its frame's cost: its rows' share (see the module doc)."""
    return frame_cost * band.h / band.full_h


def solve_with_bands(
    units_O: list[list[tuple]],
    cost_of: Callable[[Sequence[int]], float],
    solve: Callable[[list[list[tuple]]], tuple[Plan, object]],
    rule: BandRule | None,
    *,
    num_ranks: int,
    min_gain: float,
    collective_cost: float = 0.0,
    max_bands: int | None = None,
    computed_by: Callable[[Plan, object], Callable[[int, int], int]] | None = None,
) -> tuple[Plan, object, list[list[tuple]]]:
    """``solve``'s plan of ``units_O``, or of ``units_O`` with the frames that bind the step
    split into bands, when that lowers the predicted makespan by ``min_gain``.

    A frame binds when it costs more than the mean load (no plan of whole units ends below its
    cost); each is split into as many bands as bring it to the mean (at most ``max_bands``, one a
    rank, as the rule's alignment and minimum allow), and the whole step is planned again. A
    frame whose bands all land on one rank is put back whole, and the step planned again (a
    split that moves no work would only add collectives).

    Args:
        units_O: every owner's units ``(t, h, w)`` (an owner is a rank, or a replica set).
        cost_of: a unit's cost (a ``Band``'s with its exchange priced in).
        solve: ``units -> (plan, anything)``: ``solve_plan`` (or ``solve_for_sets``) over their
            costs and rows.
        rule: the tower's bands, or None: never split.
        num_ranks: the ranks the plan spreads over.
        min_gain: the relative makespan reduction the split plan must bring.
        collective_cost: what every rank pays per exchanging layer and direction on a step with
            bands (the collectives are the whole group's), in cost units.
        max_bands: the most bands a frame is split into (node-aware plans: a node's ranks, so
            its bands can stay on its node). None: ``num_ranks``.
        computed_by: ``(plan, what solve returned besides it) -> ((owner, index) -> the rank
            computing that unit)``. None: owners are ranks (``plan.destinations``).

    Returns:
        ``(plan, what solve returned besides it, units)``: the units planned, bands among them
        (a split frame's bands replace it in its owner's list, in order).
    """
    plan, extra = solve(units_O)
    max_bands = min(num_ranks, max_bands or num_ranks)
    if rule is None or num_ranks < 2:
        return plan, extra, units_O
    mean = sum(cost_of(u) for units in units_O for u in units) / num_ranks
    split, any_split = [], False
    for units in units_O:
        kept = []
        for u in units:
            parts = 1
            if not is_band(u) and u[0] == 1 and cost_of(u) > mean:
                parts = min(max_bands, math.ceil(cost_of(u) / mean))
            bands = rule.bands(u, parts) if parts > 1 else [u]
            any_split |= len(bands) > 1
            kept += bands if len(bands) > 1 else [u]
        split.append(kept)
    if not any_split:
        return plan, extra, units_O
    computed_by = computed_by or (lambda p, _: lambda o, i: p.destinations(o)[i])
    for _ in range(MAX_REPLANS):
        banded, banded_extra = solve(split)
        where = computed_by(banded, banded_extra)
        kept = [_whole_where_idle(units, o, where) for o, units in enumerate(split)]
        if kept == split:
            break
        split = kept
    if not any(is_band(u) for units in split for u in units):
        return plan, extra, units_O
    span = _makespan(banded) + 2 * rule.exchange_layers * collective_cost
    if span >= _makespan(plan) * (1.0 - min_gain):
        return plan, extra, units_O
    return banded, banded_extra, split


# Plans made while putting back frames whose bands landed on one rank (each puts back at least one).
MAX_REPLANS = 3


def _whole_where_idle(units: list[tuple], owner: int, where) -> list[tuple]:
    """``units`` with every frame whose bands are all computed on one rank whole again."""
    out, frame = [], []
    for i, u in enumerate([*units, None]):
        if frame and (u is None or not is_band(u) or u.first_row == 0):
            if len({where(owner, j) for j, _ in frame}) == 1:
                out.append((1, frame[0][1].full_h, frame[0][1].w))
            else:
                out += [band for _, band in frame]
            frame = []
        if u is not None and is_band(u):
            frame.append((i, u))
        elif u is not None:
            out.append(u)
    return out


def _makespan(plan: Plan) -> float:
    return max(plan.loads_after if plan.applied else plan.loads_before)


def exchange_scale(
    seconds: bool, latency: float = 0.0, seconds_per_byte: float = 0.0
) -> tuple[float, float] | None:
    """``(bytes per cost unit, cost of one collective)`` for ``BandRule.price``: from a measured
    exchange model when costs are in seconds (``latency``, ``seconds_per_byte``), else from the
    H100-class constants above for costs in forward multiply-accumulates, at NVLink rates (a
    frame's bands stay on one node where a node-aware plan can keep them there)."""
    if seconds:
        if seconds_per_byte <= 0.0:
            return None
        return 1.0 / seconds_per_byte, latency
    per_second = MACS_PER_SECOND / TRAINING_MACS_PER_FORWARD_MAC  # forward MACs a second
    return NVLINK_BYTES_PER_SECOND / per_second, COLLECTIVE_SECONDS * per_second
