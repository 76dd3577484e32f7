"""The moving half of balancing: rows to their computing ranks and back, in one
``all_to_all_single`` per dtype (``moves`` says which rows go where, and in what order).

Lockstep rule: ``exchange`` issues the same collectives in the same order on every rank,
whatever that rank holds (no images, bad input): every size comes from the routing, which every
rank derives from the same gathered data.
"""

from collections.abc import Sequence

import torch
import torch.distributed as dist

from fx_vitbal.runtime.transport import collectives, transfer
from fx_vitbal.runtime.transport.moves import move_of
from fx_vitbal.runtime.transport.routing import Routing
from fx_vitbal.runtime.transport.rows import row_numel


def exchange(
    xs: Sequence[torch.Tensor],
    routing: Routing,
    shrink: int,
    reverse: bool,
    group: dist.ProcessGroup,
    status_word: torch.Tensor | None = None,
    outputs: bool = False,
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """Move unit rows to their computing ranks (``reverse=False``) or back home (``True``):
    pixels and their gradients, or (``outputs``) ViT outputs and their gradients, which with
    replica sets go to every rank of a set and come back summed (``moves``).

    All tensors travel in one ``all_to_all_single`` when they share a dtype (their trailing dims
    are flattened and concatenated), which is how deepstack layers ride with the embeddings.
    Going out, the rows are put in destination order as slices of the input; coming home, they
    already travel grouped by home rank, and each tensor is cut back into its original order
    from slices of what arrived. Only slices are copied, into the one buffer each side needs
    (and, with replica sets, the output gradients' sums).

    ``status_word`` (``fx_vitbal.runtime.transport.status``: int64s) rides to every rank inside the
    first exchange, after each destination's rows; returns ``(moved tensors, every rank's words)``
    (``[world, len(status_word)]`` int64 on the rows' device, or None without a word).
    """
    move = move_of(routing, shrink, outputs, reverse)
    in_splits, out_splits = move.in_splits, move.out_splits
    outs: list[torch.Tensor | None] = [None] * len(xs)
    words_R = None
    for dtype in dict.fromkeys(x.dtype for x in xs):  # one exchange per dtype, in first-use order
        members = [i for i, x in enumerate(xs) if x.dtype == dtype]
        flats = [xs[i].reshape(xs[i].shape[0], row_numel(xs[i])) for i in members]
        flat = flats[0] if len(flats) == 1 else torch.cat(flats, 1)
        if move.send is not None:  # local order -> destination order
            flat = _cat_rows(flat, move.send)
        widths = [f.shape[1] for f in flats]
        if status_word is not None and words_R is None:
            chunks, words = _all_to_all_with_word(flat, in_splits, out_splits, group, status_word)
            words_R = words.view(torch.int64).view(len(out_splits), -1)
        else:
            moved = flat.new_empty(sum(out_splits), flat.shape[1])
            collectives.all_to_all(moved, flat.contiguous(), out_splits, in_splits, group)
            chunks = moved.split(out_splits)
        if move.home is not None:  # grouped by source -> the result's order, tensor by tensor
            parts = _home_order(_summed(chunks, move.sums), move.home, widths)
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
    if not runs:  # a replica that sends nothing
        return flat[:0]
    return torch.cat([flat[a:b] for a, b in runs])


def _summed(chunks, sums: list[list[int]]) -> list[torch.Tensor]:
    """``chunks`` with each list of ranks' chunks summed onto its first rank's, in rank order."""
    if not sums:
        return chunks
    chunks = list(chunks)
    for ranks in sums:
        total = chunks[ranks[0]]
        for r in ranks[1:]:
            total = total + chunks[r]
        chunks[ranks[0]] = total
    return chunks


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
        pieces = [
            chunks[d][a:b, first : first + width] if d >= 0 else chunks[0].new_zeros(b - a, width)
            for d, a, b in runs
        ]
        parts.append(torch.cat(pieces) if pieces else chunks[0].new_empty(0, width))
        first += width
    return parts
