"""Exchange time in seconds, for plans weighed against their measured exchange
(``cost_model="online"``): a latency + bandwidth model and its fit from every rank's timed
exchanges (``fx_vitbal.measure`` feeds it the gathered reports; bitwise alike on every rank).
"""

import collections
import dataclasses
import math
from collections.abc import Sequence

from fx_vitbal.cost.online import fit_nonnegative

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
    """Latency + bandwidth fitted from the timed pixels' exchange (one ``all_to_all``,
    ``fx_vitbal.measure.clock``) of the last ``window`` steps that moved anything:
    ``seconds ~ latency + bytes * spb`` by
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
        self._observations.append(((1.0, float(max(bytes_R[r] for r in reported))), seconds))
        rows = [f for f, _ in self._observations]
        latency, spb = fit_nonnegative(rows, [s for _, s in self._observations])
        usable = len(self._observations) >= MIN_EXCHANGES and (latency or spb)
        if usable and math.isfinite(latency) and math.isfinite(spb):
            self.coeffs = (latency, spb)
