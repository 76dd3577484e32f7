"""The pieces of attention over frames whose row bands lie on different ranks: what a rank holds
(``AttentionLayout``: its units in batch order, a band's place in its frame) and the block math
every exchange kind shares (``bands.kinds``).

The block math (``attend``, ``OnlineSoftmax``, ``block_grads``): on CPU the fused kernel behind
SDPA (it returns the logsumexp that merging blocks needs); elsewhere written out (scores made
one block at a time), exact in float64, the seam where a device's fused kernel would go.

Shape letters: H heads, n local rows, N a frame's rows, D head_dim.
"""

import dataclasses
import itertools
import math

import torch

# The exchange kinds (``BalanceConfig.band_exchange`` but ``auto``), in the order a rank runs
# them (``bands.kinds``); a packed layout numbers them so.
KINDS = ("gather", "ring", "ulysses", "usp")


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

    def to_tensor(self) -> torch.Tensor:
        """This layout as int64 numbers on the host, what a compiled graph carries to
        ``vitbal::band_attention`` (``bands.compiled``): the units, then per unit its rows and
        whether it is a band, and a band's frame, kind, group size, index, ranks and rows."""
        values = [len(self.units)]
        for unit in self.units:
            band = unit.band
            values += [unit.rows, int(band is not None)]
            if band is not None:
                values += [band.frame, KINDS.index(band.kind), band.node_bands, band.index]
                values += [band.num_bands, *band.ranks, *band.band_rows]
        return torch.tensor(values, dtype=torch.int64, device="cpu")

    @classmethod
    def from_tensor(cls, packed: torch.Tensor) -> "AttentionLayout":
        """The layout ``to_tensor`` packed."""
        values, at, units = packed.tolist(), 1, []
        for _ in range(values[0]):
            rows, is_band = values[at : at + 2]
            at += 2
            band = None
            if is_band:
                frame, kind, node_bands, index, k = values[at : at + 5]
                ranks, band_rows = values[at + 5 : at + 5 + k], values[at + 5 + k : at + 5 + 2 * k]
                at += 5 + 2 * k
                band = FrameBand(
                    frame=frame,
                    kind=KINDS[kind],
                    ranks=tuple(ranks),
                    index=index,
                    band_rows=tuple(band_rows),
                    node_bands=node_bands,
                )
            units.append(AttentionUnit(rows=rows, band=band))
        return cls(units=tuple(units))

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


# The fused kernel behind SDPA on CPU, which returns the logsumexp that merging blocks needs
# (the same schema from torch 2.8 to 2.15), and the dtypes it takes.
_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_CPU_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
_FLASH_CPU_DTYPES = (torch.float32, torch.float64, torch.bfloat16)


def _fused(q: torch.Tensor, k: torch.Tensor) -> bool:
    return (
        q.device.type == "cpu" and q.dtype in _FLASH_CPU_DTYPES and min(q.shape[1], k.shape[1]) > 0
    )


def _scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    return (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5


def attend(q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [H, n, D], logsumexp [H, n])`` of ``q``'s attention over one key/value block: the
    fused CPU kernel where it runs (2-3x faster than written out, and it never holds the scores),
    else written out (the seam for a device's fused kernel that returns a logsumexp)."""
    if _fused(q, k):
        out, lse = _FLASH_CPU(q[None], k[None], v[None])
        return out[0], lse[0]
    s = _scores(q, k)
    lse = torch.logsumexp(s, -1)
    return torch.exp(s - lse[..., None]) @ v, lse


class OnlineSoftmax:
    """Attention of ``q`` over key/value blocks added one at a time: each block's normalised
    output and logsumexp (``attend``) are merged into the running ones, weighted by
    ``exp(lse_block - lse_new)``, so the result equals attention over all the blocks at once, up
    to rounding. Every block has at least one row (``FrameBand`` checks)."""

    def __init__(self, q: torch.Tensor) -> None:
        self.q = q
        self.out = torch.zeros_like(q)  # [H, n, D]
        self.lse = q.new_full(q.shape[:-1], -math.inf)  # [H, n]

    def add(self, k: torch.Tensor, v: torch.Tensor) -> None:
        out, lse = attend(self.q, k, v)
        new = torch.logaddexp(self.lse, lse)
        self.out = (
            self.out * torch.exp(self.lse - new)[..., None] + out * torch.exp(lse - new)[..., None]
        )
        self.lse = new

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out [H, n, D], logsumexp [H, n])``."""
        return self.out, self.lse


def block_grads(q, k, v, dout, out, lse) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of the part of attention that ``q``'s rows pay to one key/value block,
    from the whole attention's ``out`` and ``lse`` (FlashAttention-2: ``delta = rowsum(dout *
    out)``, the block's probabilities ``exp(s - lse)``): blocks are independent, so their
    gradients can be computed in any order, anywhere. The fused CPU kernel's backward computes
    exactly this when handed the whole attention's ``out`` and ``lse``."""
    if _fused(q, k):
        grads = _FLASH_CPU_BACKWARD(
            dout[None], q[None], k[None], v[None], out[None], lse[None], 0.0, False
        )
        return tuple(g[0] for g in grads)
    delta = (dout * out).sum(-1)
    p = torch.exp(_scores(q, k) - lse[..., None])
    ds = p * (dout @ v.transpose(-2, -1) - delta[..., None]) * q.shape[-1] ** -0.5
    return ds @ k, ds.transpose(-2, -1) @ q, p.transpose(-2, -1) @ dout


def whole_forward(q, k, v, whole, out, lse) -> None:
    for a, b in whole:
        out[:, a:b], lse[:, a:b] = attend(q[:, a:b], k[:, a:b], v[:, a:b])


def whole_backward(q, k, v, dout, out, lse, whole, dq, dk, dv) -> None:
    for a, b in whole:
        dq[:, a:b], dk[:, a:b], dv[:, a:b] = block_grads(
            q[:, a:b], k[:, a:b], v[:, a:b], dout[:, a:b], out[:, a:b], lse[:, a:b]
        )
