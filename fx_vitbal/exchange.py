"""The collective half of balancing: gather metadata, route units, move rows and move them back.

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
import hashlib
import itertools
import json
from collections.abc import Sequence

import torch
import torch.distributed as dist

from fx_vitbal.config import BalanceConfig
from fx_vitbal.cost import CostModel, cost_from_spec, cost_to_spec
from fx_vitbal.planner import Plan, solve_plan

_plan_calls = itertools.count(1)  # the step number --dp-balance-verbose prints

# Dtypes a pixel tensor may have; the index is what travels in the metadata header.
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
# Grid rows that ride in the metadata header; ranks with more need a second gather.
INLINE_GRID_ROWS = 32
# Header fields gathered from every rank, one int64 row per rank.
_STATUS, _ARG0, _ARG1, _NUM_ROWS, _PIXEL_ROWS, _ROW_NUMEL, _DTYPE, _FINGERPRINT, _GRAD = range(9)


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
    ``pixels_need_grad`` says whether any rank's pixels require gradients.

    Packed into one int64 CPU tensor so it can flow through custom ops and compiled graphs:
    ``[applied, num_units, world, dummy_rows, any_units, row_numel, dtype_code,
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
    permutations: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)
    """Row permutations already built for this step, by ``(shrink, device)``: the four moves
    of a step (two forward, two backward) build and copy each one once."""

    def to_tensor(self, max_units: int) -> torch.Tensor:
        header = [
            int(self.applied),
            len(self.unit_rows),
            len(self.send_rows),
            self.dummy_rows,
            int(self.any_units),
            self.row_numel,
            self.dtype_code,
            int(self.pixels_need_grad),
        ]
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

    def permutation(self, shrink: int, device: torch.device) -> torch.Tensor | None:
        """Row indices that put this rank's units in destination order (None: identity)."""
        key = (shrink, device)
        if key not in self.permutations:
            rows_U = [n // shrink for n in self.unit_rows]
            order_U = sorted(range(len(rows_U)), key=lambda i: (self.dest[i], i))
            perm = _row_permutation(rows_U, order_U)
            self.permutations[key] = None if perm is None else perm.to(device)
        return self.permutations[key]

    @classmethod
    def from_tensor(cls, routing: torch.Tensor) -> "Routing":
        values = routing.tolist()  # CPU tensor: no device sync
        applied, num_units, world, dummy_rows, any_units, row_numel, dtype_code, grad = values[:8]
        body = values[8:]
        if len(body) < 2 * num_units + 2 * world:
            raise ValueError(f"malformed routing tensor of {len(values)} values")
        return cls(
            applied=bool(applied),
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
        return _DTYPES[self.dtype_code]


def routing_size(max_units: int, world_size: int) -> int:
    """Length of a packed routing tensor."""
    return 8 + 2 * world_size + 2 * max_units


def planner_spec(config: BalanceConfig, cost_model: CostModel) -> str:
    """Everything ``plan_units`` needs besides the data, as one string (a custom-op argument,
    so it is part of the compiled graph and of every cache key)."""
    fields = dataclasses.asdict(config)
    fields["cost_coeffs"] = list(config.cost_coeffs) if config.cost_coeffs else None
    return json.dumps({"config": fields, "cost": cost_to_spec(cost_model)}, sort_keys=True)


def parse_planner_spec(spec: str) -> tuple[BalanceConfig, CostModel]:
    fields = json.loads(spec)
    config = fields["config"]
    if config["cost_coeffs"] is not None:
        config["cost_coeffs"] = tuple(config["cost_coeffs"])
    return BalanceConfig(**config), cost_from_spec(fields["cost"])


@dataclasses.dataclass(frozen=True)
class Gathered:
    """What ``gather_grids`` learned from every rank."""

    grids_R: list[list[list[int]]]
    """Every rank's ``[t, h, w]`` rows."""
    row_numel: int
    """Values per pixel row, as the ranks that passed a pixel tensor have them (0: none did)."""
    dtype_code: int
    """Index in ``_DTYPES`` of their pixel dtype."""
    pixels_need_grad: bool
    """Some rank's pixels require gradients: every rank must then run the pixels' backward
    exchange, whatever its own pixels say."""


def gather_grids(
    pixel_values: torch.Tensor,
    grid_thw: torch.Tensor,
    merge_size: int,
    group: dist.ProcessGroup,
    fingerprint: int = 0,
) -> Gathered:
    """Validate local input and settings and gather every rank's ``[t, h, w]`` rows.

    One gather of a fixed-size header (status, counts, dtype, settings fingerprint) that also
    carries the first ``INLINE_GRID_ROWS`` grid rows; only when some rank has more rows does a
    second gather send the grids padded to the largest count. A bad input or a settings mismatch
    anywhere is detected from the header, so every rank raises the same ``ValueError`` after the
    first gather and none is left waiting in the second.

    Raises:
        ValueError: on every rank, naming each bad rank and its problem.
    """
    world = dist.get_world_size(group)
    device = meta_device(group, pixel_values.device)
    header, rows = _local_header(pixel_values, grid_thw, merge_size, fingerprint)
    inline = rows[:INLINE_GRID_ROWS] + [[0, 0, 0]] * (INLINE_GRID_ROWS - len(rows))
    local = torch.tensor(header + sum(inline, []), dtype=torch.int64, device=device)
    gathered = torch.empty(world * local.numel(), dtype=torch.int64, device=device)
    dist.all_gather_single(gathered, local, group)
    values = gathered.view(world, local.numel()).tolist()
    headers = [v[: len(header)] for v in values]
    _raise_on_bad_input(headers)
    with_pixels = [h for h in headers if h[_ROW_NUMEL]] or [[0] * len(header)]
    numel, dtype_code = with_pixels[0][_ROW_NUMEL], with_pixels[0][_DTYPE]
    agreed = (numel, dtype_code, any(h[_GRAD] for h in headers))
    max_rows = max(h[_NUM_ROWS] for h in headers)
    if max_rows <= INLINE_GRID_ROWS:  # the usual step: one collective, one host read
        flat_R = [v[len(header) :] for v in values]
        grids_R = [
            [flat[3 * i : 3 * i + 3] for i in range(h[_NUM_ROWS])]
            for flat, h in zip(flat_R, headers, strict=True)
        ]
        return Gathered(grids_R, *agreed)
    padded = torch.zeros(max_rows, 3, dtype=torch.int64, device=device)
    if rows:
        padded[: len(rows)] = torch.tensor(rows, dtype=torch.int64)
    grids_R = torch.empty(world * max_rows * 3, dtype=torch.int64, device=device)
    dist.all_gather_single(grids_R, padded.flatten(), group)
    grids = grids_R.view(world, max_rows, 3).tolist()
    return Gathered([grids[r][: headers[r][_NUM_ROWS]] for r in range(world)], *agreed)


def settings_fingerprint(planner: str, merge_size: int, world_size: int) -> int:
    """A 56-bit digest of everything that shapes the plan besides the data (config, cost model,
    unit rule: all in ``planner``), the same in every process: ranks compare it."""
    text = f"{planner}|{merge_size}|{world_size}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=7).digest(), "big")


def split_units(grid: Sequence[Sequence[int]], split_frames: bool) -> list[tuple[int, int, int]]:
    """A rank's units: its grid rows, or one ``(1, h, w)`` unit per frame."""
    if split_frames:
        return [(1, h, w) for t, h, w in grid for _ in range(t)]
    return [(t, h, w) for t, h, w in grid]


def plan_units(
    grids_R: list[list[list[int]]], rank: int, spec: str
) -> tuple[Plan, list[list[tuple[int, int, int]]]]:
    """Cost every unit of every rank and solve the plan (same result on every rank)."""
    config, cost_model = parse_planner_spec(spec)
    units_R = [split_units(grid, config.split_frames) for grid in grids_R]
    memo: dict[tuple[int, int, int], float] = {}  # grids repeat a lot; cost models are Python
    for units in units_R:
        for u in units:
            if u not in memo:
                memo[u] = cost_model(*u)
    costs = [[memo[u] for u in units] for units in units_R]
    tokens = [[t * h * w for t, h, w in units] for units in units_R]
    plan = solve_plan(costs, tokens, config=config)
    step = next(_plan_calls)
    if config.verbose and rank == 0:
        print(describe_plan(plan, step, sum(map(sum, tokens))), flush=True)
    return plan, units_R


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
    return x.reshape(x.shape[0] // block_rows, block_rows * _row_numel(x))


def from_blocks(blocks: torch.Tensor, like: torch.Tensor, block_rows: int) -> torch.Tensor:
    """Inverse of ``as_blocks``: rows of ``like``'s trailing shape."""
    return blocks.reshape(blocks.shape[0] * block_rows, *like.shape[1:])


# Outputs whose layouts one rank reports to the others in ``check_output_layouts``.
MAX_OUTPUTS = 16


def check_output_layouts(
    xs: Sequence[torch.Tensor], block_rows: Sequence[int], blocks: int, group: dist.ProcessGroup
) -> None:
    """Raise the same ``ValueError`` on every rank unless every rank's ViT outputs have rows
    that fit their layout (``blocks * block_rows[i]``) and all ranks agree on each output's
    layout, dtype and row width (one small gather of a fixed-size header).

    Raises:
        ValueError: on every rank, naming each rank and output at fault.
    """
    world = dist.get_world_size(group)
    header = [len(xs)]
    for x, n in list(zip(xs, block_rows, strict=True))[:MAX_OUTPUTS]:
        fits = n > 0 and x.shape[0] == blocks * n
        dtype = _DTYPES.index(x.dtype) if x.dtype in _DTYPES else len(_DTYPES)
        header += [n if fits else -x.shape[0] - 1, dtype, _row_numel(x)]
    header += [0] * (1 + 3 * MAX_OUTPUTS - len(header))
    device = meta_device(group, xs[0].device)
    gathered = torch.empty(world * len(header), dtype=torch.int64, device=device)
    local = torch.tensor(header, dtype=torch.int64, device=device)
    dist.all_gather_single(gathered, local, group)
    headers = gathered.view(world, len(header)).tolist()
    problems = []
    for r, h in enumerate(headers):
        if h[0] > MAX_OUTPUTS:
            problems.append(f"rank {r}: {h[0]} ViT outputs, at most {MAX_OUTPUTS} can be restored")
        for i in range(min(h[0], MAX_OUTPUTS)):
            if h[1 + 3 * i] < 0:
                problems.append(
                    f"rank {r}: ViT output {i} has {-h[1 + 3 * i] - 1} rows; expected t*h*w "
                    "(pre-merger) or t*h*w/merge**2 (merged) rows summed over the units"
                )
    if not problems and len({tuple(h) for h in headers}) > 1:
        problems = [
            f"rank {r}: outputs (layout, dtype, row width) {_layouts(h)}"
            for r, h in enumerate(headers)
        ]
        problems.insert(0, "ranks disagree on the ViT's outputs")
    if problems:
        raise ValueError("vit dp balance: bad ViT output; " + "; ".join(problems))


def _layouts(header: list[int]) -> list[tuple[str, str, int]]:
    names = [str(d).removeprefix("torch.") for d in _DTYPES] + ["other"]
    return [
        ("pre-merger" if n > 1 else "merged", names[dtype], numel)
        for n, dtype, numel in zip(header[1::3], header[2::3], header[3::3], strict=True)
    ][: header[0]]


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
    tensor's columns are written straight to their original rows of a fresh output tensor.
    """
    send_R = [n // shrink for n in routing.send_rows]
    recv_R = [n // shrink for n in routing.recv_rows]
    in_splits, out_splits = (recv_R, send_R) if reverse else (send_R, recv_R)
    outs: list[torch.Tensor | None] = [None] * len(xs)
    for dtype in dict.fromkeys(x.dtype for x in xs):  # one exchange per dtype, in first-use order
        members = [i for i, x in enumerate(xs) if x.dtype == dtype]
        flats = [xs[i].reshape(xs[i].shape[0], _row_numel(xs[i])) for i in members]
        perm = routing.permutation(shrink, flats[0].device)
        flat = flats[0] if len(flats) == 1 else torch.cat(flats, 1)
        if perm is not None and not reverse:
            flat = flat.index_select(0, perm)
        moved = flat.new_empty(sum(out_splits), flat.shape[1])
        dist.all_to_all_single(moved, flat.contiguous(), out_splits, in_splits, group=group)
        widths = [f.shape[1] for f in flats]
        if reverse and (perm is not None or len(flats) > 1):
            parts = [moved.new_empty(moved.shape[0], w) for w in widths]
            for part, column in zip(parts, moved.split(widths, dim=1), strict=True):
                if perm is None:
                    part.copy_(column)
                else:
                    part.index_copy_(0, perm, column)
        elif len(flats) > 1:  # custom-op outputs must not alias each other (even empty ones)
            parts = [p.clone(memory_format=torch.contiguous_format) for p in moved.split(widths, 1)]
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


def _row_numel(x: torch.Tensor) -> int:
    numel = 1
    for size in x.shape[1:]:
        numel *= size
    return numel


def meta_device(group: dist.ProcessGroup, like: torch.device) -> torch.device:
    """Where metadata is gathered: the CPU when the group has a CPU backend (gloo: reading the
    result syncs no device), else the device of the data (``like``), else the device the group
    is bound to, else the current accelerator. Never a hard-coded ``cuda``."""
    if "gloo" in str(dist.get_backend(group)):
        return torch.device("cpu")
    if like.type != "cpu":
        return like
    bound = getattr(group, "bound_device_id", None)
    if bound is not None:
        return bound
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None:
        raise ValueError(f"group {group.group_name!r} has no CPU backend and no device was found")
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def _local_header(
    pixel_values: torch.Tensor, grid_thw: torch.Tensor, merge_size: int, fingerprint: int
) -> tuple[list[int], list[list[int]]]:
    """``(header, grid rows)``; a bad input sets a status code and sends no rows."""
    dtype_code = _DTYPES.index(pixel_values.dtype) if pixel_values.dtype in _DTYPES else -1
    numel = _row_numel(pixel_values) if pixel_values.dim() >= 1 else 0
    pixel_rows = pixel_values.shape[0] if pixel_values.dim() >= 1 else 0
    status, arg0, arg1, rows = _check_grid(pixel_values, grid_thw, merge_size, dtype_code)
    grad = int(pixel_values.requires_grad)
    header = [status, arg0, arg1, len(rows), pixel_rows, numel, dtype_code, fingerprint, grad]
    return header, rows


def _check_grid(pixel_values, grid_thw, merge_size, dtype_code):
    if pixel_values.dim() < 2:
        return 1, pixel_values.dim(), 0, []
    if dtype_code < 0:
        return 2, 0, 0, []
    if grid_thw.dim() != 2 or grid_thw.shape[1] != 3:
        return 3, grid_thw.dim(), grid_thw.shape[-1] if grid_thw.dim() else 0, []
    if grid_thw.dtype.is_floating_point or grid_thw.dtype == torch.bool:
        return 4, 0, 0, []
    rows = grid_thw.tolist()
    for i, (t, h, w) in enumerate(rows):
        if min(t, h, w) <= 0:
            return 5, i, min(t, h, w), []
        if h % merge_size or w % merge_size:
            return 6, i, merge_size, []
    expected = sum(t * h * w for t, h, w in rows)
    if expected != pixel_values.shape[0]:
        return 7, pixel_values.shape[0], expected, []
    return 0, 0, 0, rows


def _describe(status: int, arg0: int, arg1: int) -> str:
    return {
        1: f"pixel_values must have >= 2 dims (rows, features), got {arg0}",
        2: f"pixel_values dtype must be one of {[str(d) for d in _DTYPES]}",
        3: f"image_grid_thw must be 2-D with 3 columns [t, h, w], got {arg0} dims, {arg1} columns",
        4: "image_grid_thw must have an integer dtype",
        5: f"image_grid_thw row {arg0} has a non-positive size ({arg1})",
        6: f"image_grid_thw row {arg0}: h and w must be multiples of the merge size {arg1}",
        7: f"pixel_values has {arg0} rows but image_grid_thw sums to {arg1} (t*h*w)",
    }[status]


def _raise_on_bad_input(headers: list[list[int]]) -> None:
    problems = [
        f"rank {r}: {_describe(h[_STATUS], h[_ARG0], h[_ARG1])}"
        for r, h in enumerate(headers)
        if h[_STATUS]
    ]
    if not problems and len({h[_FINGERPRINT] for h in headers}) > 1:
        problems = [
            "ranks disagree on the balancing settings (config, cost model, merge size, "
            "world size or unit rule; every rank must use the same)"
        ]
        problems += [f"rank {r}: settings {h[_FINGERPRINT]:014x}" for r, h in enumerate(headers)]
    if not problems:
        # A rank that passed None (a [0, 0] stand-in) receives rows in the others' layout.
        kinds = {(h[_DTYPE], h[_ROW_NUMEL]) for h in headers if h[_ROW_NUMEL]}
        if len(kinds) > 1:
            problems = [
                f"rank {r}: pixel_values dtype {_DTYPES[h[_DTYPE]]}, {h[_ROW_NUMEL]} values/row"
                for r, h in enumerate(headers)
                if h[_ROW_NUMEL]
            ]
            problems.insert(0, "ranks disagree on pixel_values dtype or row width")
    if problems:
        raise ValueError("vit dp balance: bad input; " + "; ".join(problems))
