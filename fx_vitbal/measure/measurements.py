"""Measured times in the loop: what each rank reports in the metadata header, the models every
rank fits from the gathered reports (``cost_model="online"``), and per-step ``BalanceStats``.

Per balanced call, on every rank (``planning.solve_for_rank``):
1. ``Measurements.report()``: this rank's newest completed, not yet reported call (a
   ``clock.StepClock``) as ``REPORT_FIELDS`` int64s that ride in the metadata header the plan
   gathers anyway (no extra collective): ``[step, ViT ns, exchange ns, exchange bytes, output
   bytes per pixel row]``; all zero when there is none (0 = no timing).
2. ``Measurements.observe(gathered)``: every rank feeds the same gathered reports to the same
   ``OnlineFit`` (ViT time) and ``ExchangeFit`` (latency + bandwidth), pairing each report with
   the units that rank computed in that step, rebuilt from that step's plan (kept for
   ``HISTORY`` steps): the same integers on every rank, pure-Python fits, so the same bits.
3. The plan is solved with the fitted model (online) and, once both fits have data, with the
   exchange trade-off (``plan.worth_moving``); then ``Measurements.begin`` keeps the units
   each rank computes and starts this rank's clock, and ``BalanceStats`` go to the callbacks.

State lives per (process group name, planner spec): the spec names the online settings (prior,
window), never the coefficients, so ranks agree on it through the settings fingerprint.
"""

import collections
import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence

from fx_vitbal.cost.exchange_time import ExchangeFit, ExchangeModel
from fx_vitbal.cost.online import FittedCost, OnlineFit
from fx_vitbal.cost.static import CostModel, OnlineCost
from fx_vitbal.measure.clock import StepClock
from fx_vitbal.measure.stats import BalanceStats, has_callbacks
from fx_vitbal.plan.units import Plan, is_band, unit_rows

log = logging.getLogger(__name__)

Unit = tuple[int, int, int]

HISTORY = 8
"""Steps whose computed units are kept: a report for an older step is dropped."""
# This rank's report of an earlier call, as it rides in the metadata header
# (``runtime.agree.metadata``): [step, ViT ns, exchange ns, exchange bytes, output bytes per pixel
# row].
REPORT_FIELDS = 5


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

    def exchange_model(self, pixel_bytes_per_row: int, pixels_need_grad: bool):
        """The fitted ``ExchangeModel`` once both the ViT time and the exchanges have been
        measured (costs are then seconds), else None (the FLOP-era rule decides)."""
        if self.fit is None or not self.fit.model.num_observations or self.exchange is None:
            return None
        if self.exchange.coeffs is None or not pixel_bytes_per_row:
            return None
        latency, spb = self.exchange.coeffs
        return ExchangeModel(
            latency=latency,
            seconds_per_byte=spb,
            pixel_bytes_per_row=pixel_bytes_per_row,
            output_bytes_per_row=self.output_bytes_per_row,
            pixels_need_grad=pixels_need_grad,
        )

    def next_step(self) -> int:
        """This call's number (``BalanceStats.step``), taken before it is planned (its verbose
        line is written with the plan); ``begin`` then keeps what it planned under it."""
        with self._lock:
            step = self._next_step
            self._next_step += 1
        return step

    def begin(
        self, step: int, plan: Plan, units_R: list[list[Unit]], merge_size: int
    ) -> StepClock | None:
        """Keep the units each rank computes under ``plan`` for call ``step`` (``next_step``);
        this rank's clock of the call, None when nothing reads measured times (no online fit,
        no stats callback): then the call installs no hook at all."""
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
            self._history[step] = _Step(computed, predicted)
            while len(self._history) > HISTORY:
                self._history.popitem(last=False)
            clock = None
            if self.fit is not None or has_callbacks():
                clock = StepClock(step, self._clocks)
                self._clocks.append(clock)
        return clock

    def stats(
        self, step, rank, plan, units_R, measured, exchange, deduplicated=0, band_exchanges=()
    ) -> BalanceStats:
        model = self.cost_model()
        past = self._history.get(step)
        coeffs = None
        if model is not None and model.num_observations:
            coeffs = tuple(model.coeffs)
        predicted_exchange = None
        if exchange is not None:
            send, recv = plan_crossing_rows(plan, units_R)
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
            total_rows=sum(unit_rows(u) for units in units_R for u in units),
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
            split_units=sum(is_band(u) for units in units_R for u in units),
            deduplicated_rows=deduplicated,
            band_exchanges=tuple(band_exchanges),
        )


_STATES: dict[tuple[str, str], Measurements] = {}
_STATES_LOCK = threading.Lock()


def measurements_for(
    group_name: str, planner: str, cost_model: Callable[[], CostModel]
) -> Measurements:
    """The state of the ViT planned with ``planner`` (``runtime.vit.settings.planner_spec``) on
    ``group_name``, created on first use with the spec's ``cost_model()``."""
    key = (group_name, planner)
    with _STATES_LOCK:
        if key not in _STATES:
            _STATES[key] = Measurements(cost_model())
        return _STATES[key]


def reset() -> None:
    """Forget every ViT's measurements (tests; a new run in the same process). Call it on every
    rank: a rank whose online fit starts over alone makes the next balanced call raise the same
    ``ValueError`` on every rank (its calls no longer match theirs)."""
    with _STATES_LOCK:
        _STATES.clear()


def plan_crossing_rows(plan: Plan, units_R: Sequence[Sequence[tuple]]):
    """Per rank, pixel rows it sends to other ranks and rows it receives from them under
    ``plan``, from every rank's units (``crossing_rows`` on the planner's arrays)."""
    world = len(units_R)
    send, recv = [0] * world, [0] * world
    for d, assigned in enumerate(plan.assignment):
        for src, idx in assigned:
            if src != d:
                rows = unit_rows(units_R[src][idx])
                send[src] += rows
                recv[d] += rows
    return send, recv
