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

from fx_vitbal import collectives, transfer
from fx_vitbal.config import BalanceConfig
from fx_vitbal.cost import CostModel, cost_from_spec, cost_to_spec
from fx_vitbal.metadata import DTYPES, row_numel
from fx_vitbal.planner import Plan, solve_plan

_plan_calls = itertools.count(1)  # the step number --dp-balance-verbose prints


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
    its status word then makes every rank raise (``fx_vitbal.status``). ``step`` names the call
    for its status words; ``layout_key`` names the output layouts this call is checked against,
    and ``check_layouts`` says whether some rank has none agreed for its key yet
    (``metadata.layouts_agreed``): then ``restore`` gathers every rank's layouts first.

    Packed into one int64 CPU tensor so it can flow through custom ops and compiled graphs:
    ``[applied | 2 * mismatched | 4 * check_layouts, num_units, world, dummy_rows, any_units,
    row_numel, dtype_code, pixels_need_grad, step, layout_key, send_rows_R, recv_rows_R,
    unit_rows_U, dest_U]``, zero-padded to ``routing_size(max_units, world)``. The padding gives
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
    runs: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)
    """Row ranges already worked out for this step, by ``(direction, shrink)``: the four moves
    of a step (two forward, two backward) work each out once."""

    def to_tensor(self, max_units: int) -> torch.Tensor:
        header = [
            int(self.applied) | 2 * int(self.mismatched) | 4 * int(self.check_layouts),
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

    def send_runs(self, shrink: int) -> list[tuple[int, int]]:
        """Row ranges of this rank's rows (``shrink`` pixel rows each) in destination order:
        the units sorted by ``(dest, index)``, neighbours in both orders merged."""
        key = ("send", shrink)
        if key not in self.runs:
            starts = [0, *itertools.accumulate(n // shrink for n in self.unit_rows)]
            order = sorted(range(len(self.dest)), key=lambda i: (self.dest[i], i))
            self.runs[key] = _merged((starts[i], starts[i + 1]) for i in order)
        return self.runs[key]

    def home_runs(self, shrink: int) -> list[tuple[int, int, int]]:
        """``(source rank, first, end)`` row ranges, within each source's chunk of a move back
        home, that put this rank's rows back in local order: a source returns the units it
        computed for this rank in local order."""
        key = ("home", shrink)
        if key not in self.runs:
            filled = [0] * len(self.send_rows)
            ranges = []
            for d, n in zip(self.dest, self.unit_rows, strict=True):
                ranges.append((d, filled[d], filled[d] + n // shrink))
                filled[d] += n // shrink
            merged: list[tuple[int, int, int]] = []
            for d, a, b in ranges:
                if merged and merged[-1][0] == d and merged[-1][2] == a:
                    merged[-1] = (d, merged[-1][1], b)
                elif b > a:
                    merged.append((d, a, b))
            self.runs[key] = merged
        return self.runs[key]

    @classmethod
    def from_tensor(cls, routing: torch.Tensor) -> "Routing":
        values = routing.tolist()  # CPU tensor: no device sync
        flags, num_units, world, dummy_rows, any_units, row_numel, dtype_code, grad = values[:8]
        step, layout_key = values[8:ROUTING_HEADER]
        body = values[ROUTING_HEADER:]
        if len(body) < 2 * num_units + 2 * world:
            raise ValueError(f"malformed routing tensor of {len(values)} values")
        return cls(
            applied=bool(flags & 1),
            mismatched=bool(flags & 2),
            check_layouts=bool(flags & 4),
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
        )

    @property
    def dtype(self) -> torch.dtype:
        """The pixel dtype the ranks with pixels agree on."""
        return DTYPES[self.dtype_code]


def _merged(ranges) -> list[tuple[int, int]]:
    """Non-empty ``(first, end)`` ranges, each merged into the previous one it continues."""
    merged: list[tuple[int, int]] = []
    for a, b in ranges:
        if merged and merged[-1][1] == a:
            merged[-1] = (merged[-1][0], b)
        elif b > a:
            merged.append((a, b))
    return merged


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
) -> tuple[Plan, list[list[tuple[int, int, int]]], str | None]:
    """Cost every unit of every rank and solve the plan (same result on every rank).

    ``cost_model`` replaces the spec's (the online model fitted this step, ``fx_vitbal.measured``);
    ``exchange_seconds`` goes to ``solve_plan``. The memo of unit costs lives for this call only.
    Returns ``(plan, units per rank, the --dp-balance-verbose line on rank 0 or None)``: the
    caller prints it once the call's last collective is done.
    """
    config, spec_cost = parse_planner_spec(spec)
    cost_model = spec_cost if cost_model is None else cost_model
    units_R = [split_units(grid, config.split_frames) for grid in grids_R]
    costs, tokens = cost_units(units_R, cost_model)
    plan = solve_plan(costs, tokens, config=config, exchange_seconds=exchange_seconds)
    step = next(_plan_calls)
    note = None
    if config.verbose and rank == 0:
        note = describe_plan(plan, step, sum(map(sum, tokens)))
    return plan, units_R, note


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
    status_word: torch.Tensor | None = None,
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """Move unit rows to their computing ranks (``reverse=False``) or back home (``True``).

    All tensors travel in one ``all_to_all_single`` when they share a dtype (their trailing dims
    are flattened and concatenated), which is how deepstack layers ride with the embeddings.
    Going out, the rows are put in destination order as slices of the input; coming home, they
    already travel grouped by home rank, and each tensor is cut back into its original order
    from slices of what arrived. Only slices are copied, into the one buffer each side needs.

    ``status_word`` (``fx_vitbal.status``: int64s) rides to every rank inside the first
    exchange, after each destination's rows; returns ``(moved tensors, every rank's words)``
    (``[world, len(status_word)]`` int64 on the rows' device, or None without a word).
    """
    send_R = [n // shrink for n in routing.send_rows]
    recv_R = [n // shrink for n in routing.recv_rows]
    in_splits, out_splits = (recv_R, send_R) if reverse else (send_R, recv_R)
    outs: list[torch.Tensor | None] = [None] * len(xs)
    words_R = None
    for dtype in dict.fromkeys(x.dtype for x in xs):  # one exchange per dtype, in first-use order
        members = [i for i, x in enumerate(xs) if x.dtype == dtype]
        flats = [xs[i].reshape(xs[i].shape[0], row_numel(xs[i])) for i in members]
        flat = flats[0] if len(flats) == 1 else torch.cat(flats, 1)
        if not reverse:  # home order -> destination order
            flat = _cat_rows(flat, routing.send_runs(shrink))
        widths = [f.shape[1] for f in flats]
        if status_word is not None and words_R is None:
            chunks, words = _all_to_all_with_word(flat, in_splits, out_splits, group, status_word)
            words_R = words.view(torch.int64).view(len(out_splits), -1)
        else:
            moved = flat.new_empty(sum(out_splits), flat.shape[1])
            collectives.all_to_all(moved, flat.contiguous(), out_splits, in_splits, group)
            chunks = moved.split(out_splits)
        if reverse:  # grouped by home rank -> this rank's original order, tensor by tensor
            parts = _home_order(chunks, routing.home_runs(shrink), widths)
        elif len(flats) == 1:
            parts = [moved]
        else:  # custom-op outputs must not alias each other (even empty ones)
            columns = moved.split(widths, dim=1)
            parts = [c.clone(memory_format=torch.contiguous_format) for c in columns]
        for i, part in zip(members, parts, strict=True):
            outs[i] = part.reshape(part.shape[0], *xs[i].shape[1:])
    return outs, words_R


def _cat_rows(flat: torch.Tensor, runs: list[tuple[int, int]]) -> torch.Tensor:
    """The rows ``runs`` select, in that order (``flat`` itself when they are all of it)."""
    if runs == [(0, flat.shape[0])] or not flat.shape[0]:
        return flat
    return torch.cat([flat[a:b] for a, b in runs])


def _all_to_all_with_word(flat, in_splits, out_splits, group, word):
    """Rows ``in_splits[r]`` of ``flat`` to rank ``r``, each destination's rows followed by
    ``word``; returns the rows from each rank (one ``[out_splits[r], width]`` view each) and
    every rank's word, one after the other.

    The move is flat, in elements: a word of two int64 is 16 bytes, whole elements of every
    dtype up to 16 bytes, reinterpreted in the rows' dtype and back."""
    width = flat.shape[1]
    word = transfer.to_device(word, flat.device).view(flat.dtype)
    sent = []
    for rows in flat.split(in_splits):
        sent += [rows.reshape(-1), word]
    size = word.numel()
    moved = flat.new_empty(sum(out_splits) * width + size * len(out_splits))
    collectives.all_to_all(
        moved,
        torch.cat(sent),
        [n * width + size for n in out_splits],
        [n * width + size for n in in_splits],
        group,
    )
    chunks, words = [], []
    for piece in moved.split([n * width + size for n in out_splits]):
        chunks.append(piece[: piece.numel() - size].view(-1, width))
        words.append(piece[piece.numel() - size :])
    return chunks, torch.cat(words)


def _home_order(chunks, runs, widths) -> list[torch.Tensor]:
    """Each tensor's columns of the rows ``runs`` take from the per-source ``chunks``."""
    parts, first = [], 0
    for width in widths:
        pieces = [chunks[d][a:b, first : first + width] for d, a, b in runs]
        parts.append(torch.cat(pieces) if pieces else chunks[0].new_empty(0, width))
        first += width
    return parts
