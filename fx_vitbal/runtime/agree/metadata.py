"""The gather every rank checks before the plan: input metadata, settings and measured times
(the ViT's output layouts are agreed in ``layouts``).

Lockstep rule: ``gather_grids`` issues one fixed-size gather on every rank (a second, padded
one only when some rank has more than ``INLINE_GRID_ROWS`` grid rows, known to all from the
first), whatever that rank holds, and every decision (including which error to raise) is taken
from the gathered data, so all ranks raise the same ``ValueError`` or none does.
"""

import dataclasses
import functools
import hashlib
import json
from collections.abc import Sequence

import torch
import torch.distributed as dist

from fx_vitbal.measure.measurements import REPORT_FIELDS
from fx_vitbal.runtime.agree import replicas
from fx_vitbal.runtime.agree.problems import SHAPE_DIMS, describe, shape_fields
from fx_vitbal.runtime.transport import collectives, transfer
from fx_vitbal.runtime.transport.rows import DTYPES, row_numel

# Grid rows that ride in the metadata header; ranks with more need a second gather.
INLINE_GRID_ROWS = 32


# Header fields gathered from every rank, one int64 row per rank.
(
    _STATUS,
    _ARG0,
    _ARG1,
    _NUM_ROWS,
    _ROW_NUMEL,
    _DTYPE,
    _FINGERPRINT,
    _GRAD,
    _GRAD_FIXED,
    _NEW_LAYOUT,
    _RUNS_BANDS,
    _SHAPE,  # the pixels' dims, then their first SHAPE_DIMS sizes (for messages)
) = range(12)
_SET = _SHAPE + 1 + SHAPE_DIMS  # replicas.declare's fields, then its checksum's
_CHECKSUM = _SET + replicas.DECLARED_FIELDS
_REPORT = _CHECKSUM + replicas.CHECKSUM_FIELDS


@dataclasses.dataclass(frozen=True)
class Gathered:
    """What ``gather_grids`` learned from every rank."""

    grids_R: list[list[list[int]]]
    """Every rank's ``[t, h, w]`` rows."""
    row_numel: int
    """Values per pixel row, as the ranks that passed a pixel tensor have them (0: none did)."""
    dtype_code: int
    """Index in ``DTYPES`` of their pixel dtype."""
    pixels_need_grad: bool
    """Some rank's pixels require gradients: every rank must then run the pixels' backward
    exchange, whatever its own pixels say."""
    reports_R: list[list[int]] = dataclasses.field(default_factory=list)
    """Every rank's ``REPORT_FIELDS`` measured-time fields (``fx_vitbal.measure``)."""
    check_layouts: bool = False
    """Some rank has no output layouts agreed for this call's key (``layouts_agreed``)."""
    sets: list[tuple[int, ...]] | None = None
    """The replica sets, ranks ascending, ordered by lowest rank (``runtime.agree.replicas``); None
    when each rank is its own."""
    runs_bands: bool = False
    """Every rank's call runs bands (``settings.runs_bands``): the plan may split a frame."""


def gather_grids(
    pixel_values: torch.Tensor,
    grid_thw: torch.Tensor,
    merge_size: int,
    group: dist.ProcessGroup,
    fingerprint: int = 0,
    report: Sequence[int] = (),
    *,
    problem: int = 0,
    grad_fixed: bool = False,
    new_layout: bool = False,
    replica_ranks: Sequence[int] = (),
    check_pixels: bool = True,
    runs_bands: bool = False,
) -> Gathered:
    """Validate local input and settings and gather every rank's ``[t, h, w]`` rows.

    One gather of a fixed-size header (status, counts, dtype, settings fingerprint) that also
    carries the first ``INLINE_GRID_ROWS`` grid rows; only when some rank has more rows does a
    second gather send the grids padded to the largest count. A bad input or a settings mismatch
    anywhere is detected from the header, so every rank raises the same ``ValueError`` after the
    first gather and none is left waiting in the second. ``report`` (at most ``REPORT_FIELDS``
    int64s, zero-padded) rides in the same header: this rank's measured times of an earlier call.
    ``problem``: a ``PROBLEMS`` code the caller found (it wins over the input's own status);
    ``grad_fixed``: this rank's pixels cannot be made to require gradients (a compiled call);
    ``new_layout``: this rank has no output layouts agreed for the call; ``runs_bands``: this
    rank's call runs bands (the plan splits only if every rank's does); ``replica_ranks``: the
    ranks of ``group`` that hold this rank's batch (``runtime.agree.replicas``: its declaration and
    pixel checksum ride in the header; sets that do not partition the group, or whose ranks
    hold different grids or pixels, make every rank raise; ``check_pixels=False`` leaves this
    rank's pixels out of the comparison: ``fx_vitbal.plan_ahead`` with pixels it cannot read
    without waiting, on a device or as ``meta``).

    Where the metadata lives on a device (a group without a CPU backend), a grid on that device
    is checked there, so the gathered header is the only value read back: one host sync. With
    replica sets the pixels' checksum is copied into the header where it lives, or joins the
    grid's read (a device grid, a host header); pixels on a device with a host grid and a
    CPU-backend group are the one case where it is a read of its own.

    Raises:
        ValueError: on every rank, naming each bad rank and its problem.
    """
    world = dist.get_world_size(group)
    device = collectives.meta_device(group, pixel_values.device)
    status, arg0, arg1 = _static_status(pixel_values, grid_thw)
    if problem:  # the caller's find wins: nothing of this rank's input is read
        status, arg0, arg1 = problem & 0xFF, problem >> 8, 0
    on_device = (
        not status and not transfer.on_host(grid_thw) and not collectives.gathers_on_host(group)
    )
    replicated = len(replica_ranks) > 1 and not status
    checksum = replicas.pixel_checksum(pixel_values) if replicated and check_pixels else None
    rows, sums = [], [0] * replicas.CHECKSUM_FIELDS
    if not status and not on_device:  # a CUDA grid with a gloo group: its one read
        # The checksum joins that read when it cannot reach the header otherwise (a device
        # checksum, a host header), and it is on the grid's device.
        joined = (
            checksum is not None
            and checksum.device != device
            and checksum.device == grid_thw.device
        )
        grid_rows, sums = _read_grid(grid_thw, checksum if joined else None)
        checksum = None if joined else checksum
        status, arg0, arg1, rows = _check_grid(pixel_values, grid_rows, merge_size)
    fields = [
        len(rows) if not on_device or problem else grid_thw.shape[0],
        row_numel(pixel_values) if pixel_values.dim() >= 1 else 0,
        DTYPES.index(pixel_values.dtype) if pixel_values.dtype in DTYPES else -1,
        fingerprint,
        int(pixel_values.requires_grad),
        int(grad_fixed),
        int(new_layout),
        int(runs_bands),
        *shape_fields(pixel_values),
        *replicas.declare(replica_ranks, dist.get_rank(group)),
        *sums,
        *report,
        *[0] * (REPORT_FIELDS - len(report)),
    ]
    if on_device and not problem:
        local = _device_header(pixel_values, grid_thw, merge_size, fields)
    else:
        inline = rows[:INLINE_GRID_ROWS] + [[0, 0, 0]] * (INLINE_GRID_ROWS - len(rows))
        values = [status, arg0, arg1, *fields, *sum(inline, [])]
        local = transfer.to_device(torch.tensor(values, dtype=torch.int64, device="cpu"), device)
    if checksum is not None and not problem:  # copied into the header where it lives
        if transfer.on_host(checksum):
            checksum = transfer.to_device(checksum, local.device)
        # A device checksum into a host header (pixels on a device, grid and header on the
        # host) is the one case where this is a read.
        local[_CHECKSUM:_REPORT] = checksum
    gathered = _all_gather(local, group, world)
    values = gathered.view(world, local.numel()).tolist()  # the step's one host read
    size = 3 + len(fields)
    headers = [v[:size] for v in values]
    sets = _raise_on_bad_input(headers)
    with_pixels = [h for h in headers if h[_ROW_NUMEL]] or [[0] * size]
    numel, dtype_code = with_pixels[0][_ROW_NUMEL], with_pixels[0][_DTYPE]
    agreed = (numel, dtype_code, any(h[_GRAD] for h in headers))
    reports_R = [h[_REPORT:] for h in headers]
    check = any(h[_NEW_LAYOUT] for h in headers)
    runs_bands = all(h[_RUNS_BANDS] for h in headers)
    max_rows = max(h[_NUM_ROWS] for h in headers)
    if max_rows <= INLINE_GRID_ROWS:  # the usual step: one collective, one host read
        grids_R = [
            [v[size + 3 * i : size + 3 * i + 3] for i in range(h[_NUM_ROWS])]
            for v, h in zip(values, headers, strict=True)
        ]
        gathered = Gathered(grids_R, *agreed, reports_R, check, sets, runs_bands)
        return _agreed_in_sets(gathered, headers)
    if on_device:
        padded = grid_thw.new_zeros(max_rows, 3, dtype=torch.int64)
        padded[: grid_thw.shape[0]] = grid_thw
    else:
        padded = torch.zeros(max_rows, 3, dtype=torch.int64, device="cpu")
        padded[: len(rows)] = torch.tensor(rows, dtype=torch.int64, device="cpu").view(-1, 3)
        padded = transfer.to_device(padded, device)
    grids_R = _all_gather(padded.flatten(), group, world)
    grids = grids_R.view(world, max_rows, 3).tolist()
    grids_R = [grids[r][: headers[r][_NUM_ROWS]] for r in range(world)]
    gathered = Gathered(grids_R, *agreed, reports_R, check, sets, runs_bands)
    return _agreed_in_sets(gathered, headers)


def _all_gather(local: torch.Tensor, group: dist.ProcessGroup, world: int) -> torch.Tensor:
    """Every rank's ``local``, rank-major; a group of one rank issues no collective."""
    if world == 1:
        return local
    gathered = local.new_empty(world * local.numel())
    collectives.all_gather(gathered, local, group)
    return gathered


def _agreed_in_sets(gathered: Gathered, headers: list[list[int]]) -> Gathered:
    """``gathered``, once every replica set's ranks hold the same grids and pixels.

    Raises:
        ValueError: on every rank, naming each set whose ranks disagree.
    """
    if gathered.sets is not None:
        checksums_R = [h[_CHECKSUM:_REPORT] for h in headers]
        problems = replicas.check_agreement(gathered.sets, gathered.grids_R, checksums_R)
        if problems:
            raise ValueError("vit dp balance: bad input; " + "; ".join(problems))
    return gathered


def settings_fingerprint(planner: str, merge_size: int, world_size: int, calls: int = 0) -> int:
    """A 56-bit digest of everything that shapes the plan besides the data (config, cost model,
    unit rule: all in ``planner``), the same in every process: ranks compare it. ``verbose``
    shapes nothing (``verbose=(rank == 0)`` is a common set-up), so it is left out. ``calls``:
    with ``cost_model="online"``, the calls the fit has seen (``Measurements.calls``), since
    the fitted coefficients shape the plan too and only ranks that saw the same calls agree."""
    digest = _settings_digest(planner, merge_size, world_size)
    if not calls:
        return digest
    # Folded into the cached digest: the count changes every call, the settings never do.
    text = digest.to_bytes(7, "big") + calls.to_bytes(8, "big")
    return int.from_bytes(hashlib.blake2b(text, digest_size=7).digest(), "big")


@functools.lru_cache(maxsize=64)  # one config per model: parse and hash it once
def _settings_digest(planner: str, merge_size: int, world_size: int) -> int:
    spec = json.loads(planner)
    spec["config"]["verbose"] = False
    text = f"{json.dumps(spec, sort_keys=True)}|{merge_size}|{world_size}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=7).digest(), "big")


def _static_status(pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[int, int, int]:
    """The checks shapes and dtypes decide: ``(status, arg0, arg1)``, status 0 when they pass."""
    if pixel_values.dim() < 2:
        return 1, pixel_values.dim(), 0
    if pixel_values.dtype not in DTYPES:
        return 2, 0, 0
    if grid_thw.dim() != 2 or grid_thw.shape[1] != 3:
        return 3, grid_thw.dim(), grid_thw.shape[-1] if grid_thw.dim() else 0
    if grid_thw.dtype.is_floating_point or grid_thw.dtype == torch.bool:
        return 4, 0, 0
    return 0, 0, 0


def _read_grid(grid_thw: torch.Tensor, checksum: torch.Tensor | None) -> tuple[list, list[int]]:
    """The grid's rows and the pixels' checksum (zeros without one) as host values, in one read
    when they live on one device."""
    if checksum is None:
        return grid_thw.tolist(), [0] * replicas.CHECKSUM_FIELDS
    if checksum.device != grid_thw.device:  # the checksum alone is read (free on the host)
        return grid_thw.tolist(), checksum.tolist()
    values = torch.cat([grid_thw.to(torch.int64).flatten(), checksum]).tolist()
    flat, sums = values[: -replicas.CHECKSUM_FIELDS], values[-replicas.CHECKSUM_FIELDS :]
    return [flat[i : i + 3] for i in range(0, len(flat), 3)], sums


def _check_grid(pixel_values, rows, merge_size):
    """The checks of the grid's values, on the host: ``(status, arg0, arg1, rows to send)``."""
    for i, (t, h, w) in enumerate(rows):
        if min(t, h, w) <= 0:
            return 5, i, min(t, h, w), []
        if h % merge_size or w % merge_size:
            return 6, i, merge_size, []
    expected = sum(t * h * w for t, h, w in rows)
    if expected != pixel_values.shape[0]:
        return 7, pixel_values.shape[0], expected, []
    return 0, 0, 0, rows


def _device_header(pixel_values, grid_thw, merge_size, fields) -> torch.Tensor:
    """``_check_grid``'s status and the inline rows computed where the grid lives, joined with
    ``fields`` (host values, copied without waiting): the header with no host read."""
    grid = grid_thw.to(torch.int64)
    n, rows = grid.shape[0], pixel_values.shape[0]
    # A last row that passes every check: the first bad row's index is n when none is bad.
    padded = torch.cat([grid, grid.new_full((1, 3), merge_size)])
    nonpositive = (padded <= 0).any(1)
    bad = nonpositive | (padded[:, 1:] % merge_size != 0).any(1)
    first = torch.where(bad, torch.arange(n + 1, device=grid.device), n).min()
    # Indexed by a one-element tensor: a 0-d index is read on the host (ATen's ``.item()``).
    at_first = first.view(1)
    total = grid.prod(1).sum()
    any_bad, first_nonpositive = first < n, nonpositive.index_select(0, at_first)[0]
    status = torch.where(
        any_bad, torch.where(first_nonpositive, 5, 6), torch.where(total != rows, 7, 0)
    )
    arg0 = torch.where(any_bad, first, rows)
    smallest = padded.index_select(0, at_first).min()
    arg1 = torch.where(any_bad, torch.where(first_nonpositive, smallest, merge_size), total)
    inline = grid.new_zeros(INLINE_GRID_ROWS, 3)
    inline[: min(n, INLINE_GRID_ROWS)] = grid[:INLINE_GRID_ROWS]
    inline = inline * (status == 0)  # a bad grid sends no rows
    host = transfer.to_device(torch.tensor(fields, dtype=torch.int64, device="cpu"), grid.device)
    return torch.cat([torch.stack([status, arg0, arg1]).to(torch.int64), host, inline.flatten()])


def _raise_on_bad_input(headers: list[list[int]]) -> list[tuple[int, ...]] | None:
    """Raise every rank's problems, the same on every rank; else return the replica sets."""
    problems = [
        f"rank {r}: {describe(h[_STATUS], h[_ARG0], h[_ARG1], h[_SHAPE:_SET])}"
        for r, h in enumerate(headers)
        if h[_STATUS]
    ]
    if not problems and len({h[_FINGERPRINT] for h in headers}) > 1:
        problems = [
            "ranks disagree on the balancing settings (config, cost model, merge size, "
            "world size or unit rule; every rank must use the same) or, with "
            "cost_model='online', on the calls measured (a rank that called "
            "fx_vitbal.measure.reset() or restarted alone: reset every rank)"
        ]
        problems += [f"rank {r}: settings {h[_FINGERPRINT]:014x}" for r, h in enumerate(headers)]
    if not problems and any(h[_GRAD] for h in headers):
        problems = [
            f"rank {r}: its pixels do not require gradients while another rank's do, and its "
            "call is compiled (torch.compile fixes requires_grad in the graph, so it cannot join "
            "the pixels' backward exchange); give every rank's pixel_values the same "
            "requires_grad"
            for r, h in enumerate(headers)
            if h[_GRAD_FIXED] and not h[_GRAD]
        ]
    if not problems:
        # A rank that passed None (a [0, 0] stand-in) receives rows in the others' layout.
        kinds = {(h[_DTYPE], h[_ROW_NUMEL]) for h in headers if h[_ROW_NUMEL]}
        if len(kinds) > 1:
            problems = [
                f"rank {r}: pixel_values dtype {DTYPES[h[_DTYPE]]}, {h[_ROW_NUMEL]} values/row"
                for r, h in enumerate(headers)
                if h[_ROW_NUMEL]
            ]
            problems.insert(0, "ranks disagree on pixel_values dtype or row width")
    sets = None
    if not problems:
        sets, problems = replicas.check_declarations([h[_SET:_CHECKSUM] for h in headers])
    if problems:
        raise ValueError("vit dp balance: bad input; " + "; ".join(problems))
    return sets
