"""The pieces of attention over frames whose row bands lie on different ranks: what a rank holds
(``AttentionLayout``: its units in batch order, a band's place in its frame) and the block math
every exchange kind shares (``bands.kinds``).

The block math (``OnlineSoftmax``, ``block_grads``) is written out (scores made one block at a
time), exact in float64; it is the seam where a fused kernel returning a logsumexp would go.

Shape letters: H heads, n local rows, N a frame's rows, D head_dim.
"""

import dataclasses
import itertools
import math

import torch


@dataclasses.dataclass(frozen=True, kw_only=True)
class FrameBand:
    """This rank's band of a frame cut into row bands (one per rank)."""

    frame: int
    """The frame's id, the same on every rank computing one of its bands and unique in a step:
    it orders and tags the exchanges (ranks sharing bands of two frames must agree on which is
    which, and their batch orders may differ)."""
    kind: str = "gather"
    """How its ranks exchange (``BalanceConfig.band_exchange``: gather, ulysses, ring, usp)."""
    ranks: tuple[int, ...]
    """The ranks (of the group) computing the frame's bands, in band (row) order."""
    index: int
    """This band's position in ``ranks``."""
    band_rows: tuple[int, ...]
    """Every band's rows (patches), in band order: bands may be uneven."""
    node_bands: int = 1
    """For ``usp``: the bands of each Ulysses group (consecutive in band order, one group a
    node where the plan could place them so); the groups then exchange by ring."""

    def __post_init__(self) -> None:
        if self.frame < 0:
            raise ValueError(f"frame ids must be >= 0 (they make message tags), got {self.frame}")
        if len(self.ranks) != len(self.band_rows) or not self.ranks:
            raise ValueError(
                f"one rank per band expected, got ranks {self.ranks} and rows {self.band_rows}"
            )
        if len(set(self.ranks)) != len(self.ranks):
            raise ValueError(f"a rank computes at most one band of a frame, got {self.ranks}")
        if not 0 <= self.index < len(self.ranks):
            raise ValueError(f"band index {self.index} outside ranks {self.ranks}")
        if min(self.band_rows) < 1:
            raise ValueError(f"every band needs rows, got {self.band_rows}")
        if self.node_bands < 1 or len(self.ranks) % self.node_bands:
            raise ValueError(
                f"{self.node_bands} bands a group do not divide {len(self.ranks)} bands"
            )

    @property
    def num_bands(self) -> int:
        return len(self.ranks)

    @property
    def frame_rows(self) -> int:
        return sum(self.band_rows)

    def starts(self) -> list[int]:
        """Each band's first row in the frame, then the frame's rows."""
        return [0, *itertools.accumulate(self.band_rows)]


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionUnit:
    """One local unit: ``rows`` query (and key) rows; a band when ``band`` is given."""

    rows: int
    band: FrameBand | None = None

    def __post_init__(self) -> None:
        if self.rows < 0:
            raise ValueError(f"rows must be >= 0, got {self.rows}")
        if self.band is not None and self.band.band_rows[self.band.index] != self.rows:
            raise ValueError(
                f"unit has {self.rows} rows but its band {self.band.index} of frame "
                f"{self.band.frame} has {self.band.band_rows[self.band.index]}"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionLayout:
    """One rank's part of a step: its units in batch order (their rows concatenated make the
    tensors ``band_attention`` takes). Heads and head_dim come from the tensors."""

    units: tuple[AttentionUnit, ...]

    def __post_init__(self) -> None:
        frames = [u.band.frame for u in self.units if u.band is not None]
        if len(set(frames)) != len(frames):
            raise ValueError(f"at most one band of a frame per rank, got frames {frames}")

    @property
    def rows(self) -> int:
        return sum(u.rows for u in self.units)

    def spans(self) -> list[tuple[int, int]]:
        """Each unit's ``(first, end)`` rows in the local tensors."""
        return list(itertools.pairwise([0, *itertools.accumulate(u.rows for u in self.units)]))

    def split(self) -> tuple[list[tuple[int, int]], list[tuple[FrameBand, int, int]]]:
        """``(whole, bands)``: the spans attended locally (whole units, and bands of frames on
        one rank), and the bands to exchange with their spans, by frame id (the order of every
        batch: [Note: one batch per phase])."""
        whole, bands = [], []
        for unit, (a, b) in zip(self.units, self.spans(), strict=True):
            if unit.band is None or unit.band.num_bands == 1:
                whole.append((a, b))
            else:
                bands.append((unit.band, a, b))
        return whole, sorted(bands, key=lambda item: item[0].frame)


def _scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    return (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5


class OnlineSoftmax:
    """Attention of ``q`` over key/value blocks added one at a time: a running max and sum per
    query row rescale what came before, so the result equals attention over all the blocks at
    once, up to rounding. Every block has at least one row (``FrameBand`` checks)."""

    def __init__(self, q: torch.Tensor) -> None:
        self.q = q
        self.max = q.new_full(q.shape[:-1], -math.inf)  # [H, n]
        self.sum = q.new_zeros(q.shape[:-1])  # [H, n]
        self.acc = torch.zeros_like(q)  # [H, n, D]: sum of exp(s - max) v

    def add(self, k: torch.Tensor, v: torch.Tensor) -> None:
        s = _scores(self.q, k)
        new_max = torch.maximum(self.max, s.amax(-1))
        rescale = torch.exp(self.max - new_max)
        p = torch.exp(s - new_max[..., None])
        self.sum = self.sum * rescale + p.sum(-1)
        self.acc = self.acc * rescale[..., None] + p @ v
        self.max = new_max

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out [H, n, D], logsumexp [H, n])``."""
        return self.acc / self.sum[..., None], self.max + torch.log(self.sum)


def attend(q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
    softmax = OnlineSoftmax(q)
    softmax.add(k, v)
    return softmax.result()


def block_grads(q, k, v, dout, lse, delta) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of the part of attention that ``q``'s rows pay to one key/value block,
    from the whole attention's ``lse`` and ``delta = rowsum(dout * out)`` (FlashAttention-2):
    blocks are independent, so their gradients can be computed in any order, anywhere."""
    p = torch.exp(_scores(q, k) - lse[..., None])
    ds = p * (dout @ v.transpose(-2, -1) - delta[..., None]) * q.shape[-1] ** -0.5
    return ds @ k, ds.transpose(-2, -1) @ q, p.transpose(-2, -1) @ dout


def whole_forward(q, k, v, whole, out, lse) -> None:
    for a, b in whole:
        out[:, a:b], lse[:, a:b] = attend(q[:, a:b], k[:, a:b], v[:, a:b])


def whole_backward(q, k, v, dout, lse, delta, whole, dq, dk, dv) -> None:
    for a, b in whole:
        dq[:, a:b], dk[:, a:b], dv[:, a:b] = block_grads(
            q[:, a:b], k[:, a:b], v[:, a:b], dout[:, a:b], lse[:, a:b], delta[:, a:b]
        )
