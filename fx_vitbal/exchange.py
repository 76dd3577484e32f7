"""The moving half of balancing: plan the gathered units, route them, move rows and move them
back (the gathers that come first live in ``metadata.py``).

Lockstep rule: every function here that talks to other ranks issues the same collectives in the
same order on every rank, whatever that rank holds (no images, bad input). Every decision is taken
from gathered data, so it is the same everywhere.

Row layout: a unit (one grid row, or one frame of it) owns ``t*h*w`` consecutive pixel rows, and
``t*h*w / shrink`` consecutive rows of an output that shrinks rows by ``shrink`` (4 for a 2x2
patch merger). Destinations receive units grouped by source rank in local order (``all_to_all``
order), which is exactly ``Plan.assignment`` order, so only the sender permutes on the way out
and only the home rank permutes (back to its original positions) on the way back.

Shape suffixes: ``_R`` per rank, ``_U`` per local unit.
"""

import dataclasses
import itertools
import json
from collections.abc import Sequence

import torch
import torch.distributed as dist

from fx_vitbal.config import BalanceConfig
from fx_vitbal.cost import CostModel, cost_from_spec, cost_to_spec
from fx_vitbal.metadata import DTYPES, row_numel
from fx_vitbal.planner import Plan, solve_plan

_plan_calls = itertools.count(1)  # the step number --dp-balance-verbose prints


# Values before the per-rank and per-unit parts of a packed routing tensor (see Routing).
ROUTING_HEADER = 8


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
    ``restore``'s layout check then makes every rank raise.

    Packed into one int64 CPU tensor so it can flow through custom ops and compiled graphs:
    ``[applied | 2 * mismatched, num_units, world, dummy_rows, any_units, row_numel, dtype_code,
    pixels_need_grad, send_rows_R, recv_rows_R, unit_rows_U, dest_U]``, zero-padded to
    ``routing_size(max_units, world)``. The padding gives the tensor a size known from the
    inputs (``max_units`` follows from the pixel rows), so compiled graphs need no fresh
    data-dependent size for it.
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
    permutations: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)
    """Row permutations already built for this step, ``(forward, inverse)`` by ``(shrink,
    device)``: the four moves of a step (two forward, two backward) build and copy each once."""

    def to_tensor(self, max_units: int) -> torch.Tensor:
        header = [
            int(self.applied) | 2 * int(self.mismatched),
            len(self.unit_rows),
            len(self.send_rows),
            self.dummy_rows,
            int(self.any_units),
            self.row_numel,
            self.dtype_code,
            int(self.pixels_need_grad),
        ]
        assert len(header) == ROUTING_HEADER
        values = header + self.send_rows + self.recv_rows + self.unit_rows + self.dest
        padding = routing_size(max_units, len(self.send_rows)) - len(values)
        if padding < 0:
            raise ValueError(f"{len(self.unit_rows)} units do not fit in max_units={max_units}")
        return torch.tensor(values + [0] * padding, dtype=torch.int64)

    @classmethod
    def of(cls, routing: torch.Tensor) -> "Routing":
        """``from_tensor``, parsed once per routing tensor (every op of a step shares it)."""
        parsed = getattr(routing, "_vitbal_routing", None)
        if parsed is None:
            parsed = cls.from_tensor(routing)
            routing._vitbal_routing = parsed
        return parsed

    def permutation(
        self, shrink: int, device: torch.device, inverse: bool = False
    ) -> torch.Tensor | None:
        """Row indices that put this rank's units in destination order (None: identity), or
        (``inverse``) that put rows in destination order back in local order: both directions
        are gathers (``index_select``), which run at copy speed where a scatter
        (``index_copy_``) of the same rows is several times slower."""
        key = (shrink, device)
        if key not in self.permutations:
            rows_U = [n // shrink for n in self.unit_rows]
            order_U = sorted(range(len(rows_U)), key=lambda i: (self.dest[i], i))
            perm = _row_permutation(rows_U, order_U)
            if perm is None:
                self.permutations[key] = None, None
            else:
                self.permutations[key] = perm.to(device), torch.argsort(perm).to(device)
        return self.permutations[key][inverse]

    @classmethod
    def from_tensor(cls, routing: torch.Tensor) -> "Routing":
        values = routing.tolist()  # CPU tensor: no device sync
        applied, num_units, world, dummy_rows, any_units, row_numel, dtype_code, grad = values[
            :ROUTING_HEADER
        ]
        body = values[ROUTING_HEADER:]
        if len(body) < 2 * num_units + 2 * world:
            raise ValueError(f"malformed routing tensor of {len(values)} values")
        return cls(
            applied=bool(applied & 1),
            mismatched=bool(applied & 2),
            send_rows=body[:world],
            recv_rows=body[world : 2 * world],
            unit_rows=body[2 * world : 2 * world + num_units],
            dest=body[2 * world + num_units : 2 * world + 2 * num_units],
            dummy_rows=dummy_rows,
            any_units=bool(any_units),
            row_numel=row_numel,
            dtype_code=dtype_code,
            pixels_need_grad=bool(grad),
        )

    @property
    def dtype(self) -> torch.dtype:
        """The pixel dtype the ranks with pixels agree on."""
        return DTYPES[self.dtype_code]


def routing_size(max_units: int, world_size: int) -> int:
    """Length of a packed routing tensor."""
    return ROUTING_HEADER + 2 * world_size + 2 * max_units


def planner_spec(config: BalanceConfig, cost_model: CostModel) -> str:
    """Everything ``plan_units`` needs besides the data, as one string (a custom-op argument,
    so it is part of the compiled graph and of every cache key).

    It also names the routing layout (``ROUTING_HEADER``): the ``plan`` fake kernel's output
    size depends on it, and inductor's on-disk caches key compiled graphs on their code, not on
    fake kernels, so a graph compiled by an older layout must not be served to a newer one (seen:
    ``expected size 14==13 ... Error in op: torch.ops.vitbal.plan.default``).
    """
    fields = dataclasses.asdict(config)
    fields["cost_coeffs"] = list(config.cost_coeffs) if config.cost_coeffs else None
    if config.ranks_per_node is None:  # node-blind specs (and their cache keys) stay as they were
        del fields["ranks_per_node"]
    spec = {"config": fields, "cost": cost_to_spec(cost_model), "routing": ROUTING_HEADER}
    return json.dumps(spec, sort_keys=True)


def parse_planner_spec(spec: str) -> tuple[BalanceConfig, CostModel]:
    fields = json.loads(spec)
    config = fields["config"]
    if config["cost_coeffs"] is not None:
        config["cost_coeffs"] = tuple(config["cost_coeffs"])
    return BalanceConfig(**config), cost_from_spec(fields["cost"])


def split_units(grid: Sequence[Sequence[int]], split_frames: bool) -> list[tuple[int, int, int]]:
    """A rank's units: its grid rows, or one ``(1, h, w)`` unit per frame."""
    if split_frames:
        return [(1, h, w) for t, h, w in grid for _ in range(t)]
    return [(t, h, w) for t, h, w in grid]


def plan_units(
    grids_R: list[list[list[int]]],
    rank: int,
    spec: str,
    cost_model: CostModel | None = None,
    exchange_seconds=None,
) -> tuple[Plan, list[list[tuple[int, int, int]]]]:
    """Cost every unit of every rank and solve the plan (same result on every rank).

    ``cost_model`` replaces the spec's (the online model fitted this step, ``fx_vitbal.measured``);
    ``exchange_seconds`` goes to ``solve_plan``. The memo of unit costs lives for this call only.
    """
    config, spec_cost = parse_planner_spec(spec)
    cost_model = spec_cost if cost_model is None else cost_model
    units_R = [split_units(grid, config.split_frames) for grid in grids_R]
    costs, tokens = cost_units(units_R, cost_model)
    plan = solve_plan(costs, tokens, config=config, exchange_seconds=exchange_seconds)
    step = next(_plan_calls)
    if config.verbose and rank == 0:
        print(describe_plan(plan, step, sum(map(sum, tokens))), flush=True)
    return plan, units_R


def cost_units(
    units_R: list[list[tuple[int, int, int]]], cost_model: CostModel
) -> tuple[list[list[float]], list[list[int]]]:
    """``(costs, tokens)`` of every rank's units for ``solve_plan``; each distinct unit is costed
    once (grids repeat a lot, and cost models are Python)."""
    memo: dict[tuple[int, int, int], float] = {}
    for units in units_R:
        for u in units:
            if u not in memo:
                memo[u] = cost_model(*u)
    costs = [[memo[u] for u in units] for units in units_R]
    tokens = [[t * h * w for t, h, w in units] for units in units_R]
    return costs, tokens


def describe_plan(plan: Plan, step: int, total_rows: int) -> str:
    """The ``--dp-balance-verbose`` line: decision, imbalance, the heaviest and lightest rank's
    load relative to the mean load, and the pixel rows moved."""
    mean = sum(plan.loads_before) / len(plan.loads_before)
    if not mean:
        return f"[vit dp balance] step {step}: {plan.reason}, no images on any rank"
    before = f"max {max(plan.loads_before) / mean:.2f} min {min(plan.loads_before) / mean:.2f}"
    after = f"max {max(plan.loads_after) / mean:.2f} min {min(plan.loads_after) / mean:.2f}"
    return (
        f"[vit dp balance] step {step}: {plan.reason}, imbalance {plan.imbalance_before:.3f} -> "
        f"{plan.imbalance_after:.3f}, load/mean {before} -> {after}, moved {plan.moved_tokens} of "
        f"{total_rows} rows ({plan.moved_tokens / max(total_rows, 1):.1%})"
    )


def local_routing(
    plan: Plan, units_R: list[list[tuple[int, int, int]]], rank: int, merge_size: int = 1
) -> Routing:
    """This rank's send/receive layout under ``plan`` (with a dummy unit of ``merge_size**2``
    rows if the rank would compute nothing)."""
    world = len(units_R)
    rows_R = [[t * h * w for t, h, w in units] for units in units_R]
    dest = plan.destinations([len(units) for units in units_R])[rank]
    send_rows = [0] * world
    for i, d in enumerate(dest):
        send_rows[d] += rows_R[rank][i]
    recv_rows = [0] * world
    for src, idx in plan.assignment[rank]:
        recv_rows[src] += rows_R[src][idx]
    dummy_rows = merge_size**2 if not plan.assignment[rank] else 0
    return Routing(plan.applied, rows_R[rank], dest, send_rows, recv_rows, dummy_rows)


def local_only_routing(
    grid: list[list[int]], rank: int, world_size: int, merge_size: int
) -> Routing:
    """Routing that keeps every local unit home and moves nothing (balancing inactive), with
    the dummy unit when the local batch is empty, as every compiled graph expects."""
    rows = [t * h * w for t, h, w in grid]
    return Routing(
        applied=False,
        unit_rows=rows,
        dest=[rank] * len(rows),
        send_rows=[0] * world_size,
        recv_rows=[0] * world_size,
        dummy_rows=0 if rows else merge_size**2,
    )


def balanced_grid(
    plan: Plan, units_R: list[list[tuple[int, int, int]]], rank: int, merge_size: int
) -> list[list[int]]:
    """Grid rows this rank computes, in arrival order (no collective needed); the dummy unit
    ``[1, m, m]`` when there is nothing else."""
    rows = [list(units_R[src][idx]) for src, idx in plan.assignment[rank]]
    return rows or [[1, merge_size, merge_size]]


def with_dummy(xs: Sequence[torch.Tensor], rows: int, add: bool) -> list[torch.Tensor]:
    """Append ``rows`` zero rows to each tensor (``add``) or drop its last ``rows`` rows."""
    if not rows:
        return list(xs)
    if add:
        return [torch.cat([x, x.new_zeros(rows, *x.shape[1:])]) for x in xs]
    return [x[: x.shape[0] - rows] for x in xs]


def as_blocks(x: torch.Tensor, block_rows: int) -> torch.Tensor:
    """``x`` as one row per merge block, ``[rows / block_rows, block_rows * row numel]`` (a view
    when ``x`` is contiguous): pre-merger and merged outputs then line up unit by unit."""
    if block_rows < 1 or x.shape[0] % block_rows:
        raise ValueError(f"{tuple(x.shape)} cannot be cut into blocks of {block_rows} rows")
    return x.reshape(x.shape[0] // block_rows, block_rows * row_numel(x))


def from_blocks(blocks: torch.Tensor, like: torch.Tensor, block_rows: int) -> torch.Tensor:
    """Inverse of ``as_blocks``: rows of ``like``'s trailing shape."""
    return blocks.reshape(blocks.shape[0] * block_rows, *like.shape[1:])


def exchange(
    xs: Sequence[torch.Tensor],
    routing: Routing,
    shrink: int,
    reverse: bool,
    group: dist.ProcessGroup,
) -> list[torch.Tensor]:
    """Move unit rows to their computing ranks (``reverse=False``) or back home (``True``).

    All tensors travel in one ``all_to_all_single`` when they share a dtype (their trailing dims
    are flattened and concatenated), which is how deepstack layers ride with the embeddings.
    Going out, the rows are put in destination order while they are packed; coming home, each
    tensor's columns are gathered straight into their original order in a fresh output tensor.
    """
    send_R = [n // shrink for n in routing.send_rows]
    recv_R = [n // shrink for n in routing.recv_rows]
    in_splits, out_splits = (recv_R, send_R) if reverse else (send_R, recv_R)
    outs: list[torch.Tensor | None] = [None] * len(xs)
    for dtype in dict.fromkeys(x.dtype for x in xs):  # one exchange per dtype, in first-use order
        members = [i for i, x in enumerate(xs) if x.dtype == dtype]
        flats = [xs[i].reshape(xs[i].shape[0], row_numel(xs[i])) for i in members]
        perm = routing.permutation(shrink, flats[0].device, inverse=reverse)
        flat = flats[0] if len(flats) == 1 else torch.cat(flats, 1)
        if perm is not None and not reverse:
            flat = flat.index_select(0, perm)
        moved = flat.new_empty(sum(out_splits), flat.shape[1])
        dist.all_to_all_single(moved, flat.contiguous(), out_splits, in_splits, group=group)
        columns = moved.split([f.shape[1] for f in flats], dim=1)
        if reverse and perm is not None:
            parts = [column.index_select(0, perm) for column in columns]
        elif len(flats) > 1:  # custom-op outputs must not alias each other (even empty ones)
            parts = [column.clone(memory_format=torch.contiguous_format) for column in columns]
        else:
            parts = [moved]
        for i, part in zip(members, parts, strict=True):
            outs[i] = part.reshape(part.shape[0], *xs[i].shape[1:])
    return outs


def _row_permutation(rows_U: list[int], order_U: list[int]) -> torch.Tensor | None:
    """Row indices of the units in ``order_U`` (None when that is the identity order)."""
    if order_U == sorted(order_U):
        return None
    rows = torch.tensor(rows_U, dtype=torch.int64)
    starts = torch.cumsum(rows, 0) - rows
    order = torch.tensor(order_U, dtype=torch.int64)
    ordered_rows = rows[order]
    # Each output row r of unit k maps to starts[k] + (r - first output row of k).
    shift = starts[order] - (torch.cumsum(ordered_rows, 0) - ordered_rows)
    total = int(rows.sum())
    return torch.repeat_interleave(shift, ordered_rows, output_size=total) + torch.arange(total)
