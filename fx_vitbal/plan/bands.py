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
goes cheapest first: whole units and frames (``solve_plan``), then bands of the costliest frame,
one frame at a time, kept only while the predicted makespan falls by ``min_gain`` each time.

Deterministic like every plan: the same units give the same bands on every rank.
"""

import dataclasses
import math
from collections.abc import Callable, Sequence

from fx_vitbal.plan.units import Band, Plan, is_band, unit_rows

# At most this many frames are split in one plan: each try re-solves the plan.
MAX_SPLIT_FRAMES = 4

# What one all_to_all and one byte cost, in multiply-accumulates of a ViT, on an H100-class GPU:
# bf16 dense 989 TFLOP/s (NVIDIA's datasheet) at ~40% MFU is ~2e14 MAC/s; NVLink all-to-all moves
# ~350 GB/s at ~11 us a collective, one 400 Gb/s InfiniBand NIC ~48 GB/s
# (../shared/notes/bands.md: this model reproduces torchtitan's 82,944-patch speed-ups within 1%).
MACS_PER_SECOND = 2e14
NVLINK_BYTES_PER_SECOND = 350e9
INFINIBAND_BYTES_PER_SECOND = 48e9
COLLECTIVE_SECONDS = 11e-6


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
) -> tuple[Plan, object, list[list[tuple]]]:
    """``solve``'s plan of ``units_O``, or of ``units_O`` with its costliest frames split into
    bands when that lowers the predicted makespan by ``min_gain`` each time.

    Args:
        units_O: every owner's units ``(t, h, w)`` (an owner is a rank, or a replica set).
        cost_of: a unit's cost (a ``Band``'s with its exchange priced in).
        solve: ``units -> (plan, anything)``: ``solve_plan`` (or ``solve_for_sets``) over their
            costs and rows.
        rule: the tower's bands, or None: never split.
        num_ranks: the ranks the plan spreads over.
        min_gain: the relative makespan reduction each split must bring.
        collective_cost: what every rank pays per exchanging layer and direction on a step with
            bands (the collectives are the whole group's), in cost units.

    Returns:
        ``(plan, what solve returned besides it, units)``: the units planned, bands among them
        (a split frame's bands replace it in its owner's list, in order).
    """
    plan, extra = solve(units_O)
    if rule is None or num_ranks < 2:
        return plan, extra, units_O
    best = (plan, extra, units_O)
    best_span = _makespan(plan)
    mean = sum(cost_of(u) for units in units_O for u in units) / num_ranks
    split = units_O
    for _ in range(MAX_SPLIT_FRAMES):
        frames = [
            (cost_of(u), -o, -i)
            for o, units in enumerate(split)
            for i, u in enumerate(units)
            if not is_band(u) and u[0] == 1 and unit_rows(u) >= 2 * rule.min_patches
        ]
        if not frames:
            break
        cost, o, i = max(frames)
        o, i = -o, -i
        if cost <= mean:  # it does not bind the step alone
            break
        bands = rule.bands(split[o][i], min(num_ranks, math.ceil(cost / mean)))
        if len(bands) < 2:
            break
        split = [*split[:o], [*split[o][:i], *bands, *split[o][i + 1 :]], *split[o + 1 :]]
        plan, extra = solve(split)
        span = _makespan(plan) + 2 * rule.exchange_layers * collective_cost
        if span >= best_span * (1.0 - min_gain):
            break
        best, best_span = (plan, extra, split), span
    return best


def _makespan(plan: Plan) -> float:
    return max(plan.loads_after if plan.applied else plan.loads_before)


def exchange_scale(
    seconds: bool, cross_node: bool, latency: float = 0.0, seconds_per_byte: float = 0.0
) -> tuple[float, float] | None:
    """``(bytes per cost unit, cost of one collective)`` for ``BandRule.price``: from a measured
    exchange model when costs are in seconds (``latency``, ``seconds_per_byte``), else from the
    H100-class constants above for costs in multiply-accumulates (NVLink, or InfiniBand when
    bands may cross nodes)."""
    if seconds:
        if seconds_per_byte <= 0.0:
            return None
        return 1.0 / seconds_per_byte, latency
    bandwidth = INFINIBAND_BYTES_PER_SECOND if cross_node else NVLINK_BYTES_PER_SECOND
    return bandwidth / MACS_PER_SECOND, COLLECTIVE_SECONDS * MACS_PER_SECOND
