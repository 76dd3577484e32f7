"""Bands: a frame cut into row bands computed on several ranks.

With whole units a step is never faster than its costliest unit, and one huge image can run its
rank out of memory. A *band* (``Band``) is a run of whole rows of one frame, starting at a
multiple of the tower's alignment (its merge rows, or its window rows where it has windowed
layers, so that every window stays whole); each band is computed on a rank of its own, and in the
tower's full-attention layers the band ranks exchange what attention over the whole frame needs
(``fx_vitbal.runtime.bands``: gather, ulysses or ring, chosen per frame).

To the planner a band is one more unit, with its rows and its cost: the frame's cost shared by
rows (a band of ``n`` of the frame's ``N`` rows attends from ``n`` queries to ``N`` keys, so its
attention pairs ``n*N`` sum to the frame's ``N**2``, and its linear work is its rows), plus the
price of its exchange where its ranks sit (``plan.band_prices``), when the cost model has a scale
for bytes.

[Note: how bands are planned] (``plan.step.solve_with_bands``; the parts in ``plan.band_*``)

1. Cuts (``band_plan.plan_cuts``): every frame costing more than the mean load (it binds the
   step) is cut into the fewest even bands whose share plus exchange (``band_prices``: the
   cheapest kind, priced as if the bands filled as few nodes as they can) comes to the mean, up
   to one a rank, spanning nodes where the priced exchange still pays; else the count whose
   dearest band costs least, when it beats the whole frame. With ``memory_budget``, a frame
   holding more (``cost.memory``) is cut into at least ``ceil(held / budget)`` bands.
2. Placement (``band_nodes``, [Note: bands by node]): frames needing more bands than a node
   has ranks are cut across nodes first; whole frames are balanced over the nodes; inside each
   node the frames that bind are poured over its ranks to one level (``band_fill``, [Note:
   pouring frames]). Node-blind, the frames are planned as pieces by ``solve_plan`` over every
   rank and each rank's pieces of a frame made one band. Replica sets: each set's units held
   by its replicas, then planned as each rank's own. Every split frame is then priced where
   its bands sit (its kind chosen there: ``band_plan.settle``).
3. The plan with bands is kept when its makespan beats the whole-unit plan's by ``min_gain``
   (the whole plan is not even solved when the bands beat its lower bound, the mean or the
   costliest unit); else only the bands a budget needs are kept.
4. A gap (``band_gaps``): where the plan still ends above the mean (owners being ranks, with a
   scale for bytes), one whole frame of the fullest rank is cut unevenly in two bands, the
   second computed on the least loaded rank, when that lowers the makespan by ``min_gain``.

Deterministic like every plan: the same units give the same bands on every rank.
"""

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

from fx_vitbal.cost.memory import held_bytes_per_patch, held_bytes_per_patch_of_width
from fx_vitbal.cost.static import ArchitectureCost

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

    def held_bytes_per_patch(self, architecture: ArchitectureCost | None = None) -> int:
        """Activation bytes one patch holds for the backward through the tower
        (``cost.memory``): from its ``architecture`` when known, else from the keys' width
        and the exchanging layers (an MLP 4x as wide)."""
        if architecture is not None:
            return held_bytes_per_patch(architecture)
        return held_bytes_per_patch_of_width(self.kv_bytes_per_patch // 4, self.exchange_layers)


def band_cost(frame_cost: float, band: Band) -> float:
    """A band's share of its frame's cost: its rows' share (see the module doc)."""
    return frame_cost * band.h / band.full_h


def exchange_scale(
    seconds: bool, latency: float = 0.0, seconds_per_byte: float = 0.0
) -> tuple[float, float] | None:
    """``(bytes per cost unit, cost of one collective)``, what prices bands (``plan.band_prices``):
    from a measured exchange model when costs are in seconds (``latency``, ``seconds_per_byte``),
    else from the H100-class constants above for costs in forward multiply-accumulates, at NVLink
    rates (a frame's bands stay on one node where a node-aware plan can keep them there)."""
    if seconds:
        if seconds_per_byte <= 0.0:
            return None
        return 1.0 / seconds_per_byte, latency
    per_second = MACS_PER_SECOND / TRAINING_MACS_PER_FORWARD_MAC  # forward MACs a second
    return NVLINK_BYTES_PER_SECOND / per_second, COLLECTIVE_SECONDS * per_second
