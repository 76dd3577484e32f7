"""What a balanced call reports, as data: ``BalanceStats`` to the callbacks users add, and the
``--dp-balance-verbose`` line, both held back until the call's last forward collective is done
(``publish``), so user code never runs between a call's collectives."""

import collections
import dataclasses
import logging
import threading
from collections.abc import Callable

from torch.utils.hooks import RemovableHandle

log = logging.getLogger(__name__)

# Calls whose reports wait for ``publish``; older ones are dropped (their restore never ran).
MAX_DEFERRED = 32


@dataclasses.dataclass(frozen=True, kw_only=True)
class BalanceStats:
    """One balanced ViT call, as data (every rank gets the same values except ``rank``).

    Times are seconds. ``measured_*`` describe earlier calls: each rank's newest timed call,
    ``measured_steps[r]`` (0: rank ``r`` reported none), which is usually the previous step.
    """

    step: int
    """This call's number (1, 2, ...) for this ViT's settings on this group: one per balanced
    call, so k micro-batches of gradient accumulation advance it k times per optimizer step.
    The ``--dp-balance-verbose`` line prints it."""
    rank: int
    applied: bool
    reason: str
    """``Plan.reason``: ``applied``, or why every unit stayed home (``balanced``, ``no-gain``,
    ``cap``, ``dominant-unit``, ``empty``, ``exchange`` when the predicted exchange outweighed
    the saving, ``single-rank`` on a process group of one rank)."""
    imbalance_before: float
    """Predicted ``max/mean - 1`` of per-rank cost without and with the plan."""
    imbalance_after: float
    moved_rows: int
    total_rows: int
    """Pixel rows of the call's units, each counted once (a replica set's once, not once per
    replica)."""
    inter_node_rows: int
    """Pixel rows computed on another node than their own (``Plan.inter_node_tokens``; 0
    without ``BalanceConfig.ranks_per_node``). Bytes: times the pixel and output row sizes."""
    predicted_seconds: list[float] | None
    """Per rank, this call's ViT forward + backward under the fitted model (online only, once
    the fit has ``online.MIN_OBSERVATIONS`` rank-steps and no longer blends in the prior)."""
    predicted_exchange_seconds: float | None
    """This plan's exchanges (forward and backward) under the exchange model, once fitted."""
    measured_steps: list[int]
    measured_seconds: list[float | None]
    """Per rank, the measured ViT forward + backward of call ``measured_steps[r]``."""
    measured_predicted_seconds: list[float | None]
    """What the model predicted for those same calls when they were planned (online only)."""
    measured_exchange_seconds: list[float | None]
    """Per rank, the timed forward exchanges of those calls (None: nothing moved)."""
    coefficients: tuple[float, float, float, float] | None
    """Online model ``(a, b, c, d)``: seconds per attention pair, token, unit, call."""
    exchange_latency: float | None
    exchange_bandwidth: float | None
    """Bytes per second of the fitted exchange model."""
    split_units: int = 0
    """Units computed as row bands of a frame in this call (``BalanceConfig.split_images``):
    every band of every split frame."""
    band_exchanges: tuple[str, ...] = ()
    """Per frame split into bands (in the plan's frame order), the exchange its ranks ran in
    each whole-frame attention layer (``BalanceConfig.band_exchange``: ``gather``, ``ulysses``,
    ``ring`` or ``usp``; eagerly and compiled alike); a tower that calls only
    ``Bands.gather`` gathers whatever this says."""
    deduplicated_rows: int = 0
    """Pixel rows that replica sets (``replica_group``) no longer compute twice: without
    balancing every rank of a set computes the set's whole batch, so this is the sum over sets
    of ``(ranks in the set - 1) * the set's rows``. 0 without replica sets."""


_CALLBACKS: "collections.OrderedDict[int, Callable[[BalanceStats], None]]" = (
    collections.OrderedDict()  # RemovableHandle needs a weakref-able dict
)


def add_stats_callback(fn: Callable[[BalanceStats], None]) -> RemovableHandle:
    """Call ``fn(stats)`` after every balanced call's plan, on every rank (where the plan is
    made: in the step, or in the thread that runs ``plan_ahead``). Returns a handle whose
    ``remove()`` unregisters it. Send what rank 0 gets to TensorBoard or wandb, e.g.
    ``lambda s: s.rank == 0 and writer.add_scalar("vit/imbalance", s.imbalance_after, s.step)``.
    """
    handle = RemovableHandle(_CALLBACKS)
    _CALLBACKS[handle.id] = fn
    return handle


def has_callbacks() -> bool:
    """Whether some stats callback listens (only then does a call keep a clock)."""
    return bool(_CALLBACKS)


def defer(call_id: int, note: str | None, make_stats: Callable[[], BalanceStats]) -> None:
    """Keep what call ``call_id`` reports (``note``, the verbose line; ``make_stats()``, its
    ``BalanceStats``) until ``publish(call_id)``: user code runs only after the call's last
    collective."""
    with _DEFERRED_LOCK:
        _DEFERRED[call_id] = (note, make_stats)
        while len(_DEFERRED) > MAX_DEFERRED:
            _DEFERRED.popitem(last=False)


_DEFERRED: "collections.OrderedDict[int, tuple]" = collections.OrderedDict()


_DEFERRED_LOCK = threading.Lock()


_FAILED: set[int] = set()  # callbacks whose exception was logged already


def publish(call_id: int) -> None:
    """Print call ``call_id``'s verbose line and give the callbacks its statistics (built
    only if some callback listens: they walk every rank's units). Called after the call's last
    forward collective; a callback that raises is logged (with its traceback, once per
    callback) and never reaches the exchange."""
    with _DEFERRED_LOCK:
        note, make_stats = _DEFERRED.pop(call_id, (None, None))
    if note is not None:
        print(note, flush=True)
    callbacks = list(_CALLBACKS.items())
    if make_stats is None or not callbacks:
        return
    stats = make_stats()
    for handle_id, fn in callbacks:
        try:
            fn(stats)
        except Exception:
            if handle_id not in _FAILED:
                _FAILED.add(handle_id)
                log.exception("vit dp balance: stats callback %r raised; it keeps being called", fn)
