"""Bands: a frame that would bind the step alone, split into row bands computed on several ranks.

With whole units a step is never faster than its costliest unit, and one huge image can run its
rank out of memory. A *band* (``Band``) is a run of whole rows of one frame, starting at a
multiple of the tower's alignment (its merge rows, or its window rows where it has windowed
layers, so that every window stays whole); each band is computed on a rank of its own, and in the
tower's full-attention layers the band ranks exchange keys and values so every band attends over
the whole frame (``fx_vitbal.runtime.bands.view``).

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
from collections.abc import Sequence
from typing import NamedTuple

from fx_vitbal.plan.units import is_band

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


@dataclasses.dataclass(frozen=True, kw_only=True)
class BandRule:
    """What a tower that can run bands says about them (``fx_vitbal.runtime.vit.registry``), with
    the caller's limits; every rank plans with the same one (it is in the planner spec)."""

    align: int
    """Patch rows a band starts at a multiple of: the merge size, or the window height in patch
    rows where the tower has windowed layers (Qwen2.5-VL: 8), so its windows stay whole."""
    min_patches: int
    """No band has fewer patches (``BalanceConfig.min_band_patches``)."""
    exchange_layers: int
    """Layers that attend over the whole frame: each exchanges the bands' keys and values."""
    kv_bytes_per_patch: int
    """Bytes of one patch's keys and values in one such layer (2 x hidden x 2 bytes in bf16)."""
    compiled: bool = False
    """The tower runs bands under ``torch.compile`` too (``BandSupport.compiled``); without it a
    compiled call plans whole frames."""
    heads: int = 0
    """Attention heads of the exchanging layers (``BandSupport.heads``; 0: not said, no
    head-parallel exchange)."""

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
        collectives' latency is every rank's (``plan.step.solve_with_bands``)."""
        other_patches = (band.full_h - band.h) * band.w
        return 2 * self.exchange_layers * other_patches * self.kv_bytes_per_patch / bytes_per_cost


def band_cost(frame_cost: float, band: Band) -> float:
    """A band's share of its frame's cost: its rows' share (see the module doc)."""
    return frame_cost * band.h / band.full_h


def bands_of_binding_frames(
    units_O: list[list[tuple]],
    costs_O: list[list[float]],
    num_ranks: int,
    rule: BandRule,
    max_bands: int,
) -> list[list[tuple]]:
    """``units_O`` with every frame that binds the step alone as bands. A frame binds when it
    costs more than the mean load (``costs_O``: each unit's cost; no plan of whole units ends
    below it); it becomes as many bands as bring it to the mean, at most ``max_bands``, as the
    rule's alignment and minimum allow (``BandRule.bands``)."""
    mean = sum(map(sum, costs_O)) / num_ranks
    split = []
    for units, costs in zip(units_O, costs_O, strict=True):
        kept = []
        for u, cost in zip(units, costs, strict=True):
            parts = 1
            if not is_band(u) and u[0] == 1 and cost > mean:
                parts = min(max_bands, math.ceil(cost / mean))
            bands = rule.bands(u, parts) if parts > 1 else [u]
            kept += bands if len(bands) > 1 else [u]
        split.append(kept)
    return split


def whole_where_idle(units: list[tuple], where: list[int]) -> list[tuple]:
    """``units`` with every frame whose bands are all computed on one rank whole again
    (``where[i]``: the rank computing unit ``i``)."""
    out, frame = [], []
    for i, u in enumerate([*units, None]):
        if frame and (u is None or not is_band(u) or u.first_row == 0):
            if len({where[j] for j, _ in frame}) == 1:
                out.append((1, frame[0][1].full_h, frame[0][1].w))
            else:
                out += [band for _, band in frame]
            frame = []
        if u is not None and is_band(u):
            frame.append((i, u))
        elif u is not None:
            out.append(u)
    return out


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
