"""The ViT's output layouts, agreed once per group and ViT: what every rank's outputs must look
like (rows per merge block, dtype, row width) for them to move home.

The first call for a layout key gathers every rank's layouts and checks them (one small
blocking gather: the same ``ValueError`` on every rank, or agreement); later calls compare their
outputs with the agreed layouts on the host, without communicating, and a misfit travels as a
status word (``fx_vitbal.runtime.transport.status``) with zeros of the agreed sizes in its place.
"""

import hashlib
import threading
from collections.abc import Sequence

import torch
import torch.distributed as dist

from fx_vitbal.runtime.transport import collectives, status, transfer
from fx_vitbal.runtime.transport.rows import DTYPES, row_numel

# Outputs whose layouts one rank reports to the others in ``check_output_layouts``.
MAX_OUTPUTS = 16


def check_output_layouts(
    xs: Sequence[torch.Tensor],
    block_rows: Sequence[int],
    blocks: int,
    group: dist.ProcessGroup,
) -> list[tuple[int, int, int]]:
    """Raise the same ``ValueError`` on every rank unless every rank's ViT outputs have rows
    that fit their layout (``blocks * block_rows[i]``) and all ranks agree on each output's
    layout, dtype and row width (one small gather of a fixed-size header).

    The blocking check of a call whose layouts are not agreed yet (``layouts_agreed``); returns
    them, ``(rows per block, dtype code, row width)`` per output, the same on every rank.

    Raises:
        ValueError: on every rank, naming each rank and output at fault.
    """
    world = dist.get_world_size(group)
    header = [len(xs)]
    for x, n in list(zip(xs, block_rows, strict=True))[:MAX_OUTPUTS]:
        fits = n > 0 and x.shape[0] == blocks * n
        _, dtype, numel = output_layout(x, n)
        header += [n if fits else -x.shape[0] - 1, dtype, numel]
    header += [0] * (1 + 3 * MAX_OUTPUTS - len(header))
    device = collectives.meta_device(group, xs[0].device)
    gathered = torch.empty(world * len(header), dtype=torch.int64, device=device)
    local = transfer.to_device(torch.tensor(header, dtype=torch.int64, device="cpu"), device)
    collectives.all_gather(gathered, local, group)
    headers = gathered.view(world, len(header)).tolist()
    problems = []
    for r, h in enumerate(headers):
        if h[0] > MAX_OUTPUTS:
            problems.append(f"rank {r}: {h[0]} ViT outputs, at most {MAX_OUTPUTS} can be restored")
        for i in range(min(h[0], MAX_OUTPUTS)):
            if h[1 + 3 * i] < 0:
                problems.append(
                    f"rank {r}: ViT output {i} has {-h[1 + 3 * i] - 1} rows; expected t*h*w "
                    "(pre-merger) or t*h*w/merge**2 (merged) rows summed over the units, or "
                    "those a Hugging Face rule's output_rows counts"
                )
    if not problems and len({tuple(h) for h in headers}) > 1:
        problems = [
            f"rank {r}: outputs (layout, dtype, row width) {_layouts(h)}"
            for r, h in enumerate(headers)
        ]
        problems.insert(0, "ranks disagree on the ViT's outputs")
    if problems:
        raise ValueError("vit dp balance: bad ViT output; " + "; ".join(problems))
    mine = headers[dist.get_rank(group)]
    return [tuple(mine[1 + 3 * i : 4 + 3 * i]) for i in range(mine[0])]


def output_layout(x: torch.Tensor, block_rows: int) -> tuple[int, int, int]:
    """``(rows per block, dtype code, row width)`` of one ViT output, as agreed layouts hold
    them (an unknown dtype has code ``len(DTYPES)``)."""
    dtype = DTYPES.index(x.dtype) if x.dtype in DTYPES else len(DTYPES)
    return block_rows, dtype, row_numel(x)


def as_agreed(xs, block_rows, blocks, agreed):
    """``(tensors to send, status word)``: ``xs`` if they fit the ``agreed`` layouts (rows,
    dtype, width per output) for ``blocks`` merge blocks, else zeros of those layouts and the
    word naming the first misfit, so the exchange keeps every rank's sizes."""
    word = status.word()
    if len(xs) != len(agreed):
        word = status.word(status.COUNT, value=len(xs))
    else:
        for i, (x, n, want) in enumerate(zip(xs, block_rows, agreed, strict=True)):
            if x.shape[0] != blocks * want[0] or (n, *output_layout(x, n)[1:]) != want:
                kind = status.LAYOUT if n and x.shape[0] == blocks * n else status.ROWS
                word = status.word(kind, i, x.shape[0])
                break
    if status.kind(word) == status.OK:
        return xs, word
    like = xs[0]
    zeros = [
        torch.zeros(blocks * n, numel, dtype=DTYPES[dtype], device=like.device)
        for n, dtype, numel in agreed
    ]
    return zeros, word


# --- agreed output layouts: per ranks of the group (a plan-ahead group and its step group
# share them) and per layout key (``layout_key``), what every rank's ViT outputs looked like at
# the call that agreed on them.
_AGREED: dict[tuple[tuple[int, ...], int], list[tuple[int, int, int]]] = {}


_AGREED_LOCK = threading.Lock()


def layout_key(module_key: int, pixels_dtype_code: int, device_type: str) -> int:
    """A rank's key for the layouts of a call: its ViT (``module_key``; 0 inside a compiled
    graph, whose layouts are fixed), the pixels' dtype and the autocast state, which is all that
    changes a sound ViT's output layouts between calls."""
    available = torch.amp.is_autocast_available(device_type)  # not for ``meta``, say
    autocast = available and torch.is_autocast_enabled(device_type)
    dtype = torch.get_autocast_dtype(device_type) if autocast else None
    text = f"{module_key}|{pixels_dtype_code}|{autocast}|{dtype}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=7).digest(), "big")


def layouts_agreed(ranks: tuple[int, ...], key: int) -> list[tuple[int, int, int]] | None:
    """The output layouts the ranks agreed on for ``key``, or None before any."""
    with _AGREED_LOCK:
        return _AGREED.get((ranks, key))


def agree_layouts(ranks: tuple[int, ...], key: int, layouts: list[tuple[int, int, int]]) -> None:
    with _AGREED_LOCK:
        _AGREED[(ranks, key)] = layouts


def _layouts(header: list[int]) -> list[tuple[str, str, int]]:
    names = [str(d).removeprefix("torch.") for d in DTYPES] + ["other"]
    return [
        ("pre-merger" if n > 1 else "merged", names[dtype], numel)
        for n, dtype, numel in zip(header[1::3], header[2::3], header[3::3], strict=True)
    ][: header[0]]
