"""This rank's part of a plan (``Routing``): where each local unit goes and how many rows travel,
packed into one CPU tensor that flows through the custom ops and compiled graphs.

Destinations receive units grouped by source rank in local order (``all_to_all`` order), which
is exactly ``Plan.assignment`` order, so only the sender permutes on the way out and only the
home rank permutes (back to its original positions) on the way back.

Shape suffixes: ``_R`` per rank, ``_U`` per local unit.
"""

import dataclasses
from collections.abc import Callable, Sequence

import torch

from fx_vitbal.plan.units import Plan
from fx_vitbal.plan.units import unit_rows as rows_of
from fx_vitbal.runtime.transport import transfer
from fx_vitbal.runtime.transport.rows import DTYPES

# Values before the per-rank and per-unit parts of a packed routing tensor (see Routing).
ROUTING_HEADER = 10


@dataclasses.dataclass(frozen=True)
class Routing:
    """This rank's part of a plan: where each local unit goes and how many rows travel.

    ``dummy_rows`` pixel rows of zeros (one ``[1, m, m]`` unit) are appended to this rank's ViT
    batch when it would otherwise compute nothing, and their outputs are dropped: every rank then
    runs the ViT every step (FSDP/ZeRO-3 all-gathers stay matched, towers that cannot take an
    empty batch work) and compiled graphs may assume a non-empty batch.

    ``any_units`` is False on a step where no rank has an image (every rank knows it from the
    gathered metadata); ``row_numel`` and ``dtype_code`` describe the pixel rows of the ranks
    that passed a pixel tensor (0: none did), so a rank that passed None can still receive rows;
    ``pixels_need_grad`` says whether any rank's pixels require gradients. ``mismatched`` (set
    only by a plan-ahead step, ``fx_vitbal.ahead``) says this rank's batch is not the one planned:
    its status word then makes every rank raise (``runtime.transport.status``). ``step`` names the
    call for its status words and its host state (``runtime.transport.state``); ``split`` says its
    plan splits a frame into bands (whose exchange only that state holds); ``layout_key`` names the
    output layouts this call is checked against, and ``check_layouts`` says whether some rank has
    none agreed for its key yet (``layouts.layouts_agreed``): then ``restore`` gathers every rank's
    layouts first.

    Packed into one int64 CPU tensor so it can flow through custom ops and compiled graphs:
    ``[applied | 2 * mismatched | 4 * check_layouts | 16 * split, num_units, world, dummy_rows,
    any_units,
    row_numel, dtype_code, pixels_need_grad, step, layout_key, send_rows_R, recv_rows_R,
    unit_rows_U, dest_U]`` (then ``set_of_R, rank, sender_U`` for replica sets, flag ``8``),
    zero-padded to ``routing_size(max_units, world, replicated)``. The padding gives
    the tensor a size known from the inputs (``max_units`` follows from the pixel rows), so
    compiled graphs need no fresh data-dependent size for it.
    """

    applied: bool
    unit_rows: list[int]
    dest: list[int]
    send_rows: list[int]
    recv_rows: list[int]
    dummy_rows: int = 0
    any_units: bool = True
    row_numel: int = 0
    dtype_code: int = 0
    pixels_need_grad: bool = False
    mismatched: bool = False
    step: int = 0
    layout_key: int = 0
    check_layouts: bool = False
    split: bool = False
    set_of: list[int] = dataclasses.field(default_factory=list)
    """Replica sets only (empty otherwise, ``replicated`` False): each rank's set. The local
    units are then the set's, held by every rank of it (``runtime.agree.replicas``)."""
    sender: list[int] = dataclasses.field(default_factory=list)
    """Replica sets only: the rank that sends each local unit's pixels to ``dest``, the rank
    computing it (``dest`` itself when that is in the set: it has the pixels)."""
    rank: int = -1
    """Replica sets only: this rank (which of the local units it sends)."""
    runs: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)
    """The moves already worked out for this step (``moves.move_of``): the four moves of a step
    (two forward, two backward) work each out once."""

    def to_tensor(self, max_units: int) -> torch.Tensor:
        header = [
            int(self.applied)
            | 2 * int(self.mismatched)
            | 4 * int(self.check_layouts)
            | 8 * int(self.replicated)
            | 16 * int(self.split),
            len(self.unit_rows),
            len(self.send_rows),
            self.dummy_rows,
            int(self.any_units),
            self.row_numel,
            self.dtype_code,
            int(self.pixels_need_grad),
            self.step,
            self.layout_key,
        ]
        assert len(header) == ROUTING_HEADER
        values = header + self.send_rows + self.recv_rows + self.unit_rows + self.dest
        values += self.set_of + [self.rank] * self.replicated + self.sender
        padding = routing_size(max_units, len(self.send_rows), self.replicated) - len(values)
        if padding < 0:
            raise ValueError(f"{len(self.unit_rows)} units do not fit in max_units={max_units}")
        return torch.tensor(values + [0] * padding, dtype=torch.int64, device="cpu")

    def repacked(self, routing: torch.Tensor, max_units: int | None = None, **changes):
        """This routing with ``changes`` made, packed for ``max_units`` (default: the size of
        ``routing``, its tensor)."""
        if max_units is None:
            per = 2 + self.replicated
            rest = routing.numel() - ROUTING_HEADER - per * len(self.send_rows) - self.replicated
            max_units = rest // per
        return dataclasses.replace(self, **changes).to_tensor(max_units)

    @classmethod
    def from_tensor(cls, routing: torch.Tensor) -> "Routing":
        values = routing.tolist()  # CPU tensor: no device sync
        flags, num_units, world, dummy_rows, any_units, row_numel, dtype_code, grad = values[:8]
        step, layout_key = values[8:ROUTING_HEADER]
        body = values[ROUTING_HEADER:]
        replicated = bool(flags & 8)
        if len(body) < (2 + replicated) * (num_units + world) + replicated:
            raise ValueError(f"malformed routing tensor of {len(values)} values")
        sets = body[2 * world + 2 * num_units :][: (world + 1 + num_units) * replicated]
        return cls(
            applied=bool(flags & 1),
            mismatched=bool(flags & 2),
            check_layouts=bool(flags & 4),
            split=bool(flags & 16),
            send_rows=body[:world],
            recv_rows=body[world : 2 * world],
            unit_rows=body[2 * world : 2 * world + num_units],
            dest=body[2 * world + num_units : 2 * world + 2 * num_units],
            dummy_rows=dummy_rows,
            any_units=bool(any_units),
            row_numel=row_numel,
            dtype_code=dtype_code,
            pixels_need_grad=bool(grad),
            step=step,
            layout_key=layout_key,
            set_of=sets[:world],
            rank=sets[world] if replicated else -1,
            sender=sets[world + 1 :],
        )

    @property
    def replicated(self) -> bool:
        """Whether ranks of this plan hold the same batch (``set_of``)."""
        return bool(self.set_of)

    @property
    def dtype(self) -> torch.dtype:
        """The pixel dtype the ranks with pixels agree on."""
        return DTYPES[self.dtype_code]


def max_units(pixel_rows: int, merge_size: int) -> int:
    """Upper bound on a rank's units: each has at least ``merge_size**2`` rows."""
    return pixel_rows // (merge_size * merge_size)


def local_outputs(
    pixel_values: torch.Tensor, grid_thw: torch.Tensor, merge_size: int, world_size: int, **agreed
) -> tuple[torch.Tensor, torch.Tensor]:
    """``vitbal::plan``'s outputs when nothing moves: the local grid (or the dummy unit) and
    ``local_only_routing``, with ``agreed`` fields (the pixel layout a plan made ahead knows)."""
    route = dataclasses.replace(
        local_only_routing(grid_thw.shape[0], world_size, merge_size), **agreed
    )
    routing = route.to_tensor(max_units(pixel_values.shape[0], merge_size))
    if grid_thw.shape[0]:
        return grid_thw.clone(), routing
    dummy = torch.tensor([[1, merge_size, merge_size]], dtype=grid_thw.dtype, device="cpu")
    return transfer.to_device(dummy, grid_thw.device), routing


def routing_size(max_units: int, world_size: int, replicated: bool = False) -> int:
    """Length of a packed routing tensor (``replicated``: with replica sets)."""
    extra = int(replicated)  # an int: sympy cannot add a bool to a symbolic size
    return ROUTING_HEADER + (2 + extra) * (world_size + max_units) + extra


def local_routing(
    plan: Plan,
    units_R: list[list[tuple[int, int, int]]],
    rank: int,
    merge_size: int = 1,
    rows_of: Callable[[Sequence[int]], int] = rows_of,
) -> Routing:
    """This rank's send/receive layout under ``plan`` (with a dummy unit ``(1, m, m)`` if the
    rank would compute nothing). It reads only this rank's units and the units it receives, not
    every rank's. ``rows_of``: the rows a unit has in the tensors moved (default: its pixel
    rows; a tower whose outputs have other row counts restores them with its own)."""
    world = len(units_R)
    unit_rows = [rows_of(u) for u in units_R[rank]]
    dest = plan.destinations(rank)
    send_rows = [0] * world
    for rows, d in zip(unit_rows, dest, strict=True):
        send_rows[d] += rows
    recv_rows = [0] * world
    assigned = plan.assignment[rank]
    for src, idx in assigned:
        recv_rows[src] += rows_of(units_R[src][idx])
    dummy_rows = rows_of((1, merge_size, merge_size)) if not assigned else 0
    return Routing(plan.applied, unit_rows, dest, send_rows, recv_rows, dummy_rows)


def local_only_routing(num_units: int, world_size: int, merge_size: int) -> Routing:
    """Routing that keeps every local unit home and moves nothing (balancing inactive), with
    the dummy unit when the local batch is empty, as every compiled graph expects. It lists no
    units: nothing reads them when nothing moves, and listing them would read the grid (a host
    sync when it lives on a device)."""
    return Routing(
        applied=False,
        unit_rows=[],
        dest=[],
        send_rows=[0] * world_size,
        recv_rows=[0] * world_size,
        dummy_rows=0 if num_units else merge_size**2,
    )


def balanced_grid(
    plan: Plan, units_R: list[list[tuple[int, int, int]]], rank: int, merge_size: int
) -> list[list[int]]:
    """Grid rows this rank computes, in arrival order (no collective needed); the dummy unit
    ``[1, m, m]`` when there is nothing else."""
    rows = [list(units_R[src][idx][:3]) for src, idx in plan.assignment[rank]]
    return rows or [[1, merge_size, merge_size]]
