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
import math
import threading
from collections.abc import Callable, Sequence

import torch
from torch.utils.hooks import RemovableHandle

from fx_vitbal.cost import OnlineCost
from fx_vitbal.metadata import DTYPES, REPORT_FIELDS
from fx_vitbal.online import FittedCost, OnlineFit, fit_nonnegative
from fx_vitbal.planner import Plan
from fx_vitbal.timing import StepClock

Unit = tuple[int, int, int]

HISTORY = 8
"""Steps whose computed units are kept: a report for an older step is dropped."""
MIN_EXCHANGES = 4
"""Steps with a timed exchange before the exchange model decides (a robust fit of 2 coefficients
needs a few more points than 2 to see an outlier)."""
STALE_AFTER = 10
"""Steps without any exchange after which the exchange model is dropped and measured anew: at
most one exchange in this many is spent re-measuring an interconnect too slow to be worth it."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExchangeModel:
    """Seconds of a step's exchanges on one rank: ``latency`` per ``all_to_all`` plus
    ``seconds_per_byte`` per byte that rank sends to or receives from other ranks.

    A plan moves rows ``c_r`` = rows rank ``r`` sends away plus rows it receives, so its exchanges
    carry ``c_r * (pixel + output)`` bytes in the forward (pixels out, outputs home) and
    ``c_r * (output + pixel if pixels need grad)`` in the backward (output gradients out, pixel
    gradients home), in 3 or 4 ``all_to_all``s. The step waits for the slowest rank: ``max_r``.
    """

    latency: float
    seconds_per_byte: float
    pixel_bytes_per_row: int
    output_bytes_per_row: int
    pixels_need_grad: bool = False

    def step_seconds(self, send_rows_R: Sequence[int], recv_rows_R: Sequence[int]) -> float:
        """Predicted exchange seconds of a plan whose rank ``r`` sends ``send_rows_R[r]`` rows
        to other ranks and receives ``recv_rows_R[r]`` (0 when nothing moves)."""
        if not any(send_rows_R):
            return 0.0
        calls = 4 if self.pixels_need_grad else 3
        grad = self.pixel_bytes_per_row if self.pixels_need_grad else 0
        per_row = self.pixel_bytes_per_row + 2 * self.output_bytes_per_row + grad
        crossing = max(s + r for s, r in zip(send_rows_R, recv_rows_R, strict=True))
        return self.latency * calls + self.seconds_per_byte * crossing * per_row


class ExchangeFit:
    """Latency + bandwidth fitted from the timed forward exchanges (two ``all_to_all``s) of the
    last ``window`` steps that moved anything: ``seconds ~ 2 * latency + bytes * spb`` by
    ``fit_nonnegative`` (robust, non-negative, bitwise alike on every rank).

    One observation per step: the fastest rank's time against the most bytes any rank moved.
    Each rank's clock also counts its wait for ranks that arrive later (the planning and
    scheduling skew, which the step pays anyway, moved or not); the last rank to arrive waits
    for nobody, and the collective lasts until the rank moving most bytes is done.

    The model is used from ``MIN_EXCHANGES`` observed steps on (one slow step alone would keep
    every later plan home), and dropped once ``STALE_AFTER`` steps have passed without an
    exchange, so a stale, pessimistic estimate cannot keep every plan home (and the exchange
    unmeasured) for ever: the FLOP-era rule decides meanwhile, so plans move and exchanges are
    measured again.
    """

    def __init__(self, window: int) -> None:
        self.window = window
        self._observations: collections.deque[tuple[tuple[float, float], float]] = (
            collections.deque(maxlen=window)
        )
        self._steps_since = 0
        self.coeffs: tuple[float, float] | None = None

    def observe(self, bytes_R: Sequence[int], seconds_R: Sequence[float]) -> None:
        """Add one step's reports (``seconds <= 0``: none from that rank) and refit."""
        reported = [r for r, s in enumerate(seconds_R) if s > 0.0]
        self._steps_since += 1
        if not reported:
            if self._steps_since > STALE_AFTER:
                self._observations.clear()
                self.coeffs = None
            return
        self._steps_since = 0
        seconds = min(seconds_R[r] for r in reported)
        self._observations.append(((2.0, float(max(bytes_R[r] for r in reported))), seconds))
        rows = [f for f, _ in self._observations]
        latency, spb = fit_nonnegative(rows, [s for _, s in self._observations])
        usable = len(self._observations) >= MIN_EXCHANGES and (latency or spb)
        if usable and math.isfinite(latency) and math.isfinite(spb):
            self.coeffs = (latency, spb)


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
    inter_node_bytes: int
    """Bytes crossing node boundaries; 0 until node-aware planning fills it in."""
    predicted_seconds: list[float] | None
    """Per rank, this call's ViT forward + backward under the fitted model (online only)."""
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
        self, plan: Plan, units_R: list[list[Unit]], merge_size: int, device: torch.device
    ) -> StepClock:
        """Keep the units each rank computes under ``plan`` and start this rank's clock."""
        computed = [
            [units_R[src][idx] for src, idx in assigned] or [(1, merge_size, merge_size)]
            for assigned in plan.assignment
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
            clock = StepClock(step, device, self._clocks)
            self._clocks.append(clock)
        return clock

    def stats(self, clock, rank, plan, units_R, measured, exchange) -> BalanceStats:
        model = self.cost_model()
        past = self._history[clock.step]
        coeffs = None
        if model is not None and model.num_observations:
            coeffs = tuple(model.coeffs)
        predicted_exchange = None
        if exchange is not None:
            send, recv = crossing_rows(plan, units_R)
            predicted_exchange = exchange.step_seconds(send, recv) if plan.applied else 0.0
        fitted = self.exchange.coeffs if self.exchange is not None else None
        return BalanceStats(
            step=clock.step,
            rank=rank,
            applied=plan.applied,
            reason=plan.reason,
            imbalance_before=plan.imbalance_before,
            imbalance_after=plan.imbalance_after,
            moved_rows=plan.moved_tokens,
            total_rows=sum(t * h * w for units in units_R for t, h, w in units),
            inter_node_bytes=0,  # node-aware planning (Plan.inter_node_tokens) connects it
            predicted_seconds=past.predicted_R,
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


def measurements_for(group_name: str, planner: str, cost_model) -> Measurements:
    """The state of the ViT planned with ``planner`` on ``group_name`` (created on first use)."""
    key = (group_name, planner)
    with _STATES_LOCK:
        if key not in _STATES:
            _STATES[key] = Measurements(cost_model)
        return _STATES[key]


def publish(stats: BalanceStats) -> None:
    for fn in list(_CALLBACKS.values()):
        fn(stats)


def reset() -> None:
    """Forget every ViT's measurements (tests; a new run in the same process)."""
    with _STATES_LOCK:
        _STATES.clear()
