"""A split step's exchanged pixels: released once the forward's exchanges are done, fetched again
by the backward's first exchange.

A ViT keeps the pixel rows it computed from for its backward (its patch embedding saves them for
its weight gradient), from its forward to the end of its backward: in a VLM, through the
language model's forward, where memory peaks. The home rank's pixels are the caller's and held
anyway; the rows ``redistribute`` made on the rank computing them are not. On a step that splits
a frame they are the largest thing a band rank keeps beside the tower's checkpoints (Qwen2-VL's
1,176 values a patch against 2 x 256 a layer for a narrow tower under gradient checkpointing;
3% of a band's at 32 layers of width 1280).

So on such a step (``Routing.split``) the eager call hands a ``Refetch`` to ``restore``'s autograd
context, and once ``restore`` is done it releases the exchanged pixels' storage (``release``).
``restore``'s backward, which runs before any of the ViT's backward (the ViT's outputs reach the
rest of the model only through it), moves the home pixels again, the forward's move, and writes
them into that storage (``refill``): every tensor saved on it (a view, a reshape) is whole again
before a backward reads it. Read in between, it raises ("data is not allocated"), never returns
stale rows.

The home pixels are the caller's own (``run_balanced``'s ``refetch_pixels``: the eager call and a
Hugging Face tower called directly, whose rows are a view of its input; not a parent's call,
whose pixels may be copies cast or joined for it), held through the step anyway, and read again
in the backward: modified in place before it, the refill raises on that rank (as autograd does
for a tensor saved for backward), before anything moves.

Lockstep: the refill runs in every restore backward of such a step, on every rank (the plan is
global), as point-to-point messages between the ranks the forward moved pixels between, one each
way a pair, posted as one batch (a rank that moved none posts nothing); whether a rank released
its pixels is its own choice, and a rank that kept them takes part and drops what it receives.
A rank keeps them where a ViT output shares their storage. A call run inside a backward (a
checkpoint's recompute) offers nothing: its ``restore`` may never see a backward (a
non-reentrant checkpoint keeps only the tensors the recompute saves), so nothing would refill
it. Compiled graphs never release (their buffers are inductor's).
"""

import dataclasses
import itertools
import threading

import torch
import torch.distributed as dist

from fx_vitbal.runtime.transport import collectives
from fx_vitbal.runtime.transport.moves import Move, move_of
from fx_vitbal.runtime.transport.rows import as_blocks
from fx_vitbal.runtime.transport.state import route_of

# The refill's messages' tag: one message a pair of ranks each way, in a batch of their own
# (band exchanges tag theirs by frame, from 0).
REFILL_TAG = 1 << 20


@dataclasses.dataclass(eq=False)
class Refetch:
    """What ``restore``'s backward needs to write a step's exchanged pixels again."""

    routing: torch.Tensor
    """The step's pixel routing (``restore``'s may count output rows instead)."""
    home: torch.Tensor | None
    """This rank's pixels as they entered ``redistribute`` (the caller's)."""
    merge_area: int
    group_name: str
    exchanged: torch.Tensor | None = None
    """The exchanged pixels whose storage was released (None: kept, or refilled already)."""
    nbytes: int = 0
    """Their storage's size before it was released."""
    taken: bool = False
    """``restore``'s autograd context holds it: a backward will refill."""
    version: int = dataclasses.field(init=False)
    """``home``'s version counter when offered."""

    def __post_init__(self) -> None:
        self.version = self.home._version

    def release(self, pixels: torch.Tensor, outputs: list[torch.Tensor]) -> None:
        """Release ``pixels``' storage if a backward will refill it and nothing else reads it
        before (module doc)."""
        storage = pixels.untyped_storage()
        if not self.taken or not storage.nbytes() or not pixels.is_contiguous():
            return
        if any(o.untyped_storage().data_ptr() == storage.data_ptr() for o in outputs):
            return
        self.exchanged, self.nbytes = pixels, storage.nbytes()
        storage.resize_(0)

    def refill(self) -> None:
        """The forward's pixel move again, into the released storage (every rank runs it)."""
        home, exchanged = self.home, self.exchanged
        self.home = self.exchanged = None  # once: a retained graph's next backward has them
        if home is None:
            return
        if home._version != self.version:
            raise RuntimeError(
                "vit dp balance: the pixels passed to a balanced ViT call that split a frame "
                "were modified in place before its backward, which fetches them again (as "
                "autograd refuses for a tensor saved for backward); pass a tensor the step "
                "leaves unchanged"
            )
        route = route_of(self.routing)
        blocks = as_blocks(home, self.merge_area)
        into = None
        with torch.no_grad():
            # The rows land in place, the dummy unit's zeros after; a tensor made from the home
            # pixels (where the exchange runs) takes the storage back.
            if exchanged is not None:
                storage = exchanged.untyped_storage()
                storage.resize_(self.nbytes)
                target = home.new_empty(0, dtype=exchanged.dtype).set_(
                    storage, exchanged.storage_offset(), exchanged.shape, exchanged.stride()
                )
                arrived = as_blocks(target, self.merge_area)
                into = arrived[: arrived.shape[0] - route.dummy_rows // self.merge_area]
                arrived[into.shape[0] :].zero_()
            move = move_of(route, self.merge_area, False, False)
            _move_again(blocks, into, move, collectives.resolve_group(self.group_name))


def _move_again(blocks: torch.Tensor, into: torch.Tensor | None, move: Move, group) -> None:
    """``move`` of the rows ``blocks`` (merge blocks, as ``redistribute`` moved them) into
    ``into`` (None: received and dropped), point to point: each rank's rows for a peer are a
    slice of its own (a copy only where they are not one run), and land in their slice of
    ``into``. No buffer of the whole batch on either side, as an ``all_to_all_single`` needs
    in destination order: at the backward's start a frame's home rank holds its checkpoints
    (its band last of 8 in a 96 x 96 frame: 43 MB of pixels copied, its activation peak 1.12
    -> 1.33 x k of the whole frame's)."""
    rank = dist.get_rank(group)
    runs = move.send if move.send is not None else [(0, blocks.shape[0])]
    pieces = _cut(runs, move.in_splits)
    starts = list(itertools.accumulate(move.out_splits, initial=0))
    messages = []
    for peer, (first, n) in enumerate(zip(starts, move.out_splits, strict=False)):
        if n and peer != rank:
            slot = (
                into[first : first + n]
                if into is not None
                else blocks.new_empty(n, *blocks.shape[1:])
            )
            messages.append((False, slot, peer, REFILL_TAG))
    for peer, ranges in enumerate(pieces):
        if not ranges:
            continue
        rows = blocks[ranges[0][0] : ranges[0][1]] if len(ranges) == 1 else _joined(blocks, ranges)
        if peer != rank:
            messages.append((True, rows, peer, REFILL_TAG))
        elif into is not None:  # this rank's own rows, in their place among the arrivals
            into[starts[rank] : starts[rank + 1]].copy_(rows)
    for work in collectives.send_receive(messages, group):
        work.wait()


def _cut(runs: list[tuple[int, int]], splits: list[int]) -> list[list[tuple[int, int]]]:
    """``runs`` (row ranges, in destination order) cut into each destination's ``splits[d]``
    rows."""
    pieces: list[list[tuple[int, int]]] = [[] for _ in splits]
    runs = iter(runs)
    a, b = next(runs, (0, 0))
    for d, n in enumerate(splits):
        while n:
            if a == b:
                a, b = next(runs)
            take = min(n, b - a)
            pieces[d].append((a, a + take))
            a, n = a + take, n - take
    return pieces


def _joined(blocks: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
    """The rows of ``ranges``, one after the other (the units a peer gets that are not one
    run of rows here)."""
    return torch.cat([blocks[a:b] for a, b in ranges])


def offer(routing: torch.Tensor, home: torch.Tensor, merge_area: int, group_name: str):
    """A ``Refetch`` for the ``restore`` this thread calls next to take (``take``), on a step
    that splits a frame; else None. Eager calls only: a compiled graph's ``restore`` runs no
    Python in its backward."""
    route = route_of(routing)
    if not (route.applied and route.split) or route.mismatched or _in_backward():
        return None
    _OFFERED.refetch = Refetch(routing, home, merge_area, group_name)
    return _OFFERED.refetch


def take() -> Refetch | None:
    """The offered ``Refetch``, now held by ``restore``'s autograd context only."""
    refetch = getattr(_OFFERED, "refetch", None)
    if refetch is not None:
        _OFFERED.refetch = None
        refetch.taken = True
    return refetch


def withdraw() -> None:
    """Drop an offer ``restore`` did not take (no autograd recorded it)."""
    _OFFERED.refetch = None


# The offer, from the eager call to its ``restore``'s autograd context, on the calling thread
# (ranks may be threads of one process).
_OFFERED = threading.local()


def _in_backward() -> bool:
    """Whether this runs inside a backward (a checkpoint's recompute)."""
    return torch._C._current_graph_task_id() != -1
