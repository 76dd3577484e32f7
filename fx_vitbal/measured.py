"""Measured times in the loop: what each rank reports in the metadata header, the models every
rank fits from the gathered reports (``cost_model="online"``), and per-step ``BalanceStats``.

Per balanced call, on every rank (``ops.solve_for_rank``):
1. ``Measurements.report()``: this rank's newest completed, not yet reported call (a
   ``timing.StepClock``) as ``REPORT_FIELDS`` int64s that ride in the metadata header the plan
   gathers anyway (no extra collective): ``[step, ViT ns, exchange ns, exchange bytes, output
   bytes per pixel row]``; all zero when there is none (0 = no timing).
2. ``Measurements.observe(gathered)``: every rank feeds the same gathered reports to the same
   ``OnlineFit`` (ViT time) and ``ExchangeFit`` (latency + bandwidth), pairing each report with
   the units that rank computed in that step, rebuilt from that step's plan (kept for
   ``HISTORY`` steps): the same integers on every rank, pure-Python fits, so the same bits.
3. The plan is solved with the fitted model (online) and, once both fits have data, with the
   exchange trade-off (``planner.worth_moving``); then ``Measurements.begin`` keeps the units
   each rank computes and starts this rank's clock, and ``BalanceStats`` go to the callbacks.

State lives per (process group name, planner spec): the spec names the online settings (prior,
window), never the coefficients, so ranks agree on it through the settings fingerprint.
"""

import collections
import dataclasses
import logging
import threading
from collections.abc import Callable

import torch
from torch.utils.hooks import RemovableHandle

from fx_vitbal.cost import OnlineCost
from fx_vitbal.exchange import parse_planner_spec
from fx_vitbal.exchange_time import ExchangeFit, ExchangeModel
from fx_vitbal.metadata import DTYPES, REPORT_FIELDS
from fx_vitbal.online import FittedCost, OnlineFit
from fx_vitbal.planner import Plan
from fx_vitbal.timing import StepClock

log = logging.getLogger(__name__)

Unit = tuple[int, int, int]

HISTORY = 8
"""Steps whose computed units are kept: a report for an older step is dropped."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class BalanceStats:
    """One balanced ViT call, as data (every rank gets the same values except ``rank``).

    Times are seconds. ``measured_*`` describe earlier calls: each rank's newest timed call,
    ``measured_steps[r]`` (0: rank ``r`` reported none), which is usually the previous step.
    """

    step: int
    """This call's number (1, 2, ...) for this ViT's settings on this group."""
    rank: int
    applied: bool
    reason: str
    """``Plan.reason``; ``exchange`` when the predicted exchange outweighed the saving."""
    imbalance_before: float
    """Predicted ``max/mean - 1`` of per-rank cost without and with the plan."""
    imbalance_after: float
    moved_rows: int
    total_rows: int
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


@dataclasses.dataclass
class _Step:
    units_R: list[list[Unit]]
    predicted_R: list[float] | None


class Measurements:
    """One balanced ViT's measured-time state on one group (see the module doc)."""

    def __init__(self, cost_model) -> None:
        self.fit = OnlineFit(cost_model) if isinstance(cost_model, OnlineCost) else None
        self.exchange = ExchangeFit(cost_model.window) if self.fit is not None else None
        self.output_bytes_per_row = 0
        self._history: collections.OrderedDict[int, _Step] = collections.OrderedDict()
        self._clocks: collections.deque[StepClock] = collections.deque(maxlen=HISTORY)
        self._next_step = 1
        self._lock = threading.Lock()

    def calls(self) -> int:
        """Balanced calls this state has begun, counted only with an online fit (what the
        fitted coefficients depend on besides the gathered reports); 0 without one."""
        with self._lock:
            return self._next_step - 1 if self.fit is not None else 0

    def report(self) -> list[int]:
        """This rank's newest completed, unreported call, as header fields (zeros: none)."""
        with self._lock:
            for clock in reversed(self._clocks):
                if clock.reported:
                    continue
                totals = clock.totals_ns()
                if totals is not None:
                    clock.reported = True
                    vit_ns, exchange_ns = totals
                    return [
                        clock.step,
                        vit_ns,
                        exchange_ns,
                        clock.exchange_bytes,
                        clock.output_bytes_per_row,
                    ]
        return [0] * REPORT_FIELDS

    def observe(self, reports_R: list[list[int]]) -> dict:
        """Feed the gathered reports to the fits; returns what ``stats`` shows of them."""
        world = len(reports_R)
        units_R: list[list[Unit]] = [[] for _ in range(world)]
        seconds_R = [0.0] * world
        measured = {"steps": [0] * world, "seconds": [None] * world}
        measured["predicted"] = [None] * world
        measured["exchange"] = [None] * world
        exchange_bytes = [0] * world
        exchange_seconds = [0.0] * world
        for r, (step, vit_ns, xch_ns, xch_bytes, out_bytes) in enumerate(reports_R):
            self.output_bytes_per_row = max(self.output_bytes_per_row, out_bytes)
            past = self._history.get(step)
            if not step or past is None or vit_ns <= 0:
                continue
            if self.fit is not None:
                units_R[r] = past.units_R[r]
            seconds_R[r] = vit_ns / 1e9
            measured["steps"][r] = step
            measured["seconds"][r] = seconds_R[r]
            if past.predicted_R is not None:
                measured["predicted"][r] = past.predicted_R[r]
            if xch_ns > 0:
                exchange_bytes[r], exchange_seconds[r] = xch_bytes, xch_ns / 1e9
                measured["exchange"][r] = exchange_seconds[r]
        if self.fit is not None and any(seconds_R):
            self.fit.observe([u or [(1, 1, 1)] for u in units_R], seconds_R)
        if self.exchange is not None:
            self.exchange.observe(exchange_bytes, exchange_seconds)
        return measured

    def cost_model(self) -> FittedCost | None:
        """The online model to plan with (None: plan with the spec's model)."""
        return self.fit.model if self.fit is not None else None

    def exchange_model(self, row_numel: int, dtype_code: int, pixels_need_grad: bool):
        """The fitted ``ExchangeModel`` once both the ViT time and the exchanges have been
        measured (costs are then seconds), else None (the FLOP-era rule decides)."""
        if self.fit is None or not self.fit.model.num_observations or self.exchange is None:
            return None
        if self.exchange.coeffs is None or not row_numel:
            return None
        latency, spb = self.exchange.coeffs
        element = torch.empty(0, dtype=DTYPES[dtype_code]).element_size()
        return ExchangeModel(
            latency=latency,
            seconds_per_byte=spb,
            pixel_bytes_per_row=row_numel * element,
            output_bytes_per_row=self.output_bytes_per_row,
            pixels_need_grad=pixels_need_grad,
        )

    def begin(
        self, plan: Plan, units_R: list[list[Unit]], merge_size: int
    ) -> tuple[int, StepClock | None]:
        """Keep the units each rank computes under ``plan``; ``(this call's id, this rank's
        clock)``, the clock None when nothing reads measured times (no online fit, no stats
        callback): then the call installs no hook at all."""
        # The units behind each rank's reported time: only an online fit reads them.
        computed = [
            [units_R[src][idx] for src, idx in assigned] or [(1, merge_size, merge_size)]
            for assigned in (plan.assignment if self.fit is not None else ())
        ]
        model = self.cost_model()
        predicted = None
        if model is not None and model.blend == 1.0:  # only then is it a per-rank time
            predicted = [model.rank_seconds(units) for units in computed]
        with self._lock:
            step = self._next_step
            self._next_step += 1
            self._history[step] = _Step(computed, predicted)
            while len(self._history) > HISTORY:
                self._history.popitem(last=False)
            clock = None
            if self.fit is not None or _CALLBACKS:
                clock = StepClock(step, self._clocks)
                self._clocks.append(clock)
        return step, clock

    def defer(self, call_id: int, note: str | None, make_stats) -> None:
        """Keep what call ``call_id`` reports (``note``, the verbose line; ``make_stats()``, its
        ``BalanceStats``) until ``publish(call_id)``: user code runs only after the call's last
        collective."""
        with _DEFERRED_LOCK:
            _DEFERRED[call_id] = (note, make_stats)
            while len(_DEFERRED) > 4 * HISTORY:  # calls whose restore never ran
                _DEFERRED.popitem(last=False)

    def stats(self, step, rank, plan, units_R, measured, exchange) -> BalanceStats:
        model = self.cost_model()
        past = self._history.get(step)
        coeffs = None
        if model is not None and model.num_observations:
            coeffs = tuple(model.coeffs)
        predicted_exchange = None
        if exchange is not None:
            send, recv = crossing_rows(plan, units_R)
            predicted_exchange = exchange.step_seconds(send, recv) if plan.applied else 0.0
        fitted = self.exchange.coeffs if self.exchange is not None else None
        return BalanceStats(
            step=step,
            rank=rank,
            applied=plan.applied,
            reason=plan.reason,
            imbalance_before=plan.imbalance_before,
            imbalance_after=plan.imbalance_after,
            moved_rows=plan.moved_tokens,
            total_rows=sum(t * h * w for units in units_R for t, h, w in units),
            inter_node_rows=plan.inter_node_tokens,
            predicted_seconds=past.predicted_R if past is not None else None,
            predicted_exchange_seconds=predicted_exchange,
            measured_steps=measured["steps"],
            measured_seconds=measured["seconds"],
            measured_predicted_seconds=measured["predicted"],
            measured_exchange_seconds=measured["exchange"],
            coefficients=coeffs,
            exchange_latency=fitted[0] if fitted else None,
            exchange_bandwidth=1.0 / fitted[1] if fitted and fitted[1] > 0 else None,
        )


def crossing_rows(plan: Plan, units_R: list[list[Unit]]) -> tuple[list[int], list[int]]:
    """Per rank, pixel rows it sends to other ranks and receives from them under ``plan``."""
    world = len(units_R)
    send, recv = [0] * world, [0] * world
    for d, assigned in enumerate(plan.assignment):
        for src, idx in assigned:
            if src != d:
                t, h, w = units_R[src][idx]
                send[src] += t * h * w
                recv[d] += t * h * w
    return send, recv


_STATES: dict[tuple[str, str], Measurements] = {}
_STATES_LOCK = threading.Lock()


def measurements_for(group_name: str, planner: str) -> Measurements:
    """The state of the ViT planned with ``planner`` (``exchange.planner_spec``) on
    ``group_name``, created on first use."""
    key = (group_name, planner)
    with _STATES_LOCK:
        if key not in _STATES:
            _STATES[key] = Measurements(parse_planner_spec(planner)[1])
        return _STATES[key]


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


def reset() -> None:
    """Forget every ViT's measurements (tests; a new run in the same process). Call it on every
    rank: a rank whose online fit starts over alone makes the next balanced call raise the same
    ``ValueError`` on every rank (its calls no longer match theirs)."""
    with _STATES_LOCK:
        _STATES.clear()
