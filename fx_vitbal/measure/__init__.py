"""Measurement, attached to the runtime at fixed points: this rank's clock of a call (``clock``),
the per-group state the online fits live in (``measurements``), and what a call reports to
users (``stats``)."""

from fx_vitbal.measure.measurements import reset
from fx_vitbal.measure.stats import BalanceStats, add_stats_callback

__all__ = ["BalanceStats", "add_stats_callback", "reset"]
