"""A per-rank ViT time model fitted online from measured step times, bitwise alike on every rank.

A rank's ViT forward + backward time is modelled as ``a*A + b*P + c*N + d`` over the units it
computed: ``A`` = the sum of per-frame ``p**2`` (attention pairs; ``(t*h*w)**2`` per unit when the
ViT attends over whole clips), ``P`` = the sum of ``p`` (tokens: linear layers, norms, rotary),
``N`` = the number of units (per-unit overhead: launches, position tables, ``cu_seqlens``) and 1
(per-step overhead). The planner's cost of a unit is ``a*A_u + b*p_u + c``: ``d`` is the same for
every rank and cannot change an assignment.

Every rank fits from the same gathered timings and must get the same coefficients down to the last
bit, or ranks would plan differently and deadlock in the exchange. So the fit uses only Python
floats: ``+ - * /``, comparisons, sorting and ``math.fsum`` (correctly rounded, hence independent
of summation order); no numpy/torch reduction, whose order may change with threads or SIMD width,
and no ``exp``/``log``/``pow`` (libm results may differ between machines). The fit is a symmetric
function of its observations: permuting them gives the same bits.

Robustness: iteratively reweighted least squares of the *relative* error (a straggling rank or a
timer hiccup is wrong by a factor, not by seconds), first with Huber weights (convex: a safe start
however bad the plain fit), then with Tukey's biweight (wild outliers get weight 0), a fixed number
of iterations each, the scale being the median absolute residual. Every weighted solve is an exact
non-negative least-squares over four variables: all 15 supports are solved and the best feasible
one kept (a cost cannot be negative).
"""

import collections
import dataclasses
import math
from collections.abc import Sequence

from fx_vitbal.cost.static import OnlineCost

Unit = tuple[int, int, int]

MIN_OBSERVATIONS = 16
"""Observations (rank-steps) before the full fit is trusted alone: about 4 per coefficient."""
MAX_OBSERVATIONS = 1024
"""Observations kept over the window, at any world size: the pure-Python fit of 1024 takes about
20 ms (measured on a busy 2-core CPU at 2048 ranks; under 16 observations it is negligible)."""
HUBER_ITERATIONS = 4
TUKEY_ITERATIONS = 4
# Tuning constants at 95% efficiency under Gaussian noise (Holland & Welsch 1977); 1.4826 makes
# the median absolute deviation a consistent estimate of a Gaussian's sigma.
HUBER_K = 1.345
TUKEY_C = 4.685
MAD_TO_SIGMA = 1.4826
# Relative-error floor of the residual scale: noiseless data would otherwise divide by zero.
MIN_SIGMA = 1e-9
# Timings outside this range are not ViT steps (a broken timer, a sentinel): dropped, which also
# keeps every ``features / seconds`` finite.
MIN_SECONDS = 1e-9
MAX_SECONDS = 1e9
# Pivots below this fraction of the largest diagonal entry mean a singular support: skip it.
PIVOT_TOLERANCE = 1e-12


def unit_features(unit: Unit, per_frame: bool) -> tuple[float, float, float]:
    """``(attention pairs, tokens, 1)`` of one unit ``(t, h, w)``, or of a band of a frame
    (``fx_vitbal.plan.units.Band``, five fields: its ``h`` rows attend over the frame's
    ``full_h``)."""
    pairs, tokens = _pairs_and_tokens(unit, per_frame)
    return float(pairs), float(tokens), 1.0


def rank_features(units: Sequence[Unit], per_frame: bool) -> tuple[float, float, float, float]:
    """``(A, P, N, 1)`` of the units one rank computed in a step (exact integer sums)."""
    pairs = tokens = 0
    for unit in units:
        unit_pairs, unit_tokens = _pairs_and_tokens(unit, per_frame)
        pairs += unit_pairs
        tokens += unit_tokens
    return float(pairs), float(tokens), float(len(units)), 1.0


def _pairs_and_tokens(unit: Unit, per_frame: bool) -> tuple[int, int]:
    t, h, w = unit[:3]
    if len(unit) == 5:  # a band: its queries over its frame's keys
        return h * w * unit[3] * w, h * w
    return (t * (h * w) ** 2 if per_frame else (t * h * w) ** 2), t * h * w


def fit_nonnegative(rows: Sequence[Sequence[float]], seconds: Sequence[float]) -> tuple[float, ...]:
    """Outlier-robust, non-negative least squares of relative error: ``seconds ~ rows @ coeffs``.

    Args:
        rows: one feature vector per observation (all the same length, at most 4 here).
        seconds: the measured time of each observation, > 0.

    Returns:
        The non-negative coefficients (all zero when there is no observation).
    """
    if not rows:
        return ()
    num_features = len(rows[0])
    # Relative error: each row divided by its time, so the target is 1. Columns are then scaled
    # to a maximum of 1 (max is exact and order-free), which keeps the normal equations of
    # features spanning 1e0..1e9 well conditioned.
    rel = [[x / y for x in row] for row, y in zip(rows, seconds, strict=True)]
    col_scale = [max(abs(r[j]) for r in rel) for j in range(num_features)]
    z = [[r[j] / s if s > 0 else 0.0 for j, s in enumerate(col_scale)] for r in rel]
    pairs = [(i, j) for i in range(num_features) for j in range(i, num_features)]
    products = [[zk[i] * zk[j] for zk in z] for i, j in pairs]
    columns = [[zk[i] for zk in z] for i in range(num_features)]

    def solve(weights: list[float]) -> list[float]:
        gram = [[0.0] * num_features for _ in range(num_features)]
        for (i, j), col in zip(pairs, products, strict=True):
            gram[i][j] = gram[j][i] = math.fsum([w * p for w, p in zip(weights, col, strict=True)])
        rhs = [math.fsum([w * x for w, x in zip(weights, col, strict=True)]) for col in columns]
        return _nnls(gram, rhs)

    theta = solve([1.0] * len(z))
    for iteration in range(HUBER_ITERATIONS + TUKEY_ITERATIONS):
        residuals = [1.0 - _dot(zk, theta) for zk in z]
        sigma = max(MAD_TO_SIGMA * _median([abs(r) for r in residuals]), MIN_SIGMA)
        if iteration < HUBER_ITERATIONS:
            cut = HUBER_K * sigma
            weights = [1.0 if abs(r) <= cut else cut / abs(r) for r in residuals]
        else:
            cut = TUKEY_C * sigma
            weights = [_tukey(r / cut) for r in residuals]
        theta = solve(weights)
    return tuple(t / s if s > 0 else 0.0 for t, s in zip(theta, col_scale, strict=True))


def _tukey(u: float) -> float:
    if abs(u) >= 1.0:
        return 0.0
    v = 1.0 - u * u
    return v * v


def _dot(x: Sequence[float], y: Sequence[float]) -> float:
    total = 0.0
    for a, b in zip(x, y, strict=True):  # fixed order: deterministic
        total += a * b
    return total


def _median(values: list[float]) -> float:
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def _nnls(gram: list[list[float]], rhs: list[float]) -> list[float]:
    """Exact NNLS for a handful of variables: the optimum is the unconstrained solution on its own
    support, so solving every support and keeping the best feasible one finds it. Ties keep the
    first support in mask order, so the result is a function of the inputs alone."""
    n = len(rhs)
    best, best_value = [0.0] * n, 0.0
    for mask in range(1, 1 << n):
        support = [j for j in range(n) if mask >> j & 1]
        solution = _cholesky_solve([[gram[i][j] for j in support] for i in support], support, rhs)
        if solution is None or min(solution) < 0.0:
            continue
        theta = [0.0] * n
        for j, value in zip(support, solution, strict=True):
            theta[j] = value
        # 0.5 * theta' G theta - rhs' theta, the least-squares objective up to a constant.
        terms = [0.5 * theta[i] * gram[i][j] * theta[j] for i in support for j in support]
        terms += [-rhs[i] * theta[i] for i in support]
        value = math.fsum(terms)
        if value < best_value:
            best, best_value = theta, value
    return best


def _cholesky_solve(
    matrix: list[list[float]], support: list[int], rhs: list[float]
) -> list[float] | None:
    n = len(support)
    tolerance = PIVOT_TOLERANCE * max(matrix[i][i] for i in range(n))
    if tolerance <= 0.0:
        return None
    lower = [[0.0] * n for _ in range(n)]
    for i in range(n):
        for j in range(i + 1):
            acc = matrix[i][j] - _dot(lower[i][:j], lower[j][:j])
            if i == j:
                if acc <= tolerance:
                    return None
                lower[i][i] = math.sqrt(acc)  # IEEE sqrt: correctly rounded everywhere
            else:
                lower[i][j] = acc / lower[j][j]
    y = [0.0] * n
    for i in range(n):
        y[i] = (rhs[support[i]] - _dot(lower[i][:i], y[:i])) / lower[i][i]
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (y[i] - _dot([lower[k][i] for k in range(i + 1, n)], x[i + 1 :])) / lower[i][i]
    return x


@dataclasses.dataclass(frozen=True, kw_only=True)
class FittedCost:
    """The online model at one step: a cost model ``(t, h, w) -> seconds`` for the planner.

    Before ``MIN_OBSERVATIONS`` timings, a unit's cost blends the full fit with the prior scaled
    to seconds (one fitted scale, plus a per-step constant): with a few rank-steps, four
    coefficients are poorly determined (the features of a step's ranks are strongly correlated,
    and balancing makes them more so), and a wrong fit can plan worse than the prior it replaces,
    while a one-parameter scale is well determined from the first step. The full fit's weight
    grows linearly with the observations in the window.
    """

    settings: OnlineCost
    coeffs: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    """``(a, b, c, d)``: seconds per attention pair, per token, per unit, per step."""
    prior_scale: float = 1.0
    """Seconds per unit of the prior's cost."""
    blend: float = 0.0
    """Weight of the full fit in a unit's cost; the prior has ``1 - blend``."""
    num_observations: int = 0

    def __call__(self, t: int, h: int, w: int) -> float:
        if self.blend == 0.0:
            return self.prior_scale * self.settings.prior(t, h, w)
        a, b, c, _ = self.coeffs
        pairs, tokens, one = unit_features((t, h, w), self.settings.per_frame)
        fitted = a * pairs + b * tokens + c * one
        if self.blend == 1.0:
            return fitted
        prior = self.prior_scale * self.settings.prior(t, h, w)
        return self.blend * fitted + (1.0 - self.blend) * prior

    def rank_seconds(self, units: Sequence[Unit]) -> float:
        """Predicted ViT time of a rank computing ``units`` (the full fit, ``d`` included)."""
        return _dot(self.coeffs, rank_features(units, self.settings.per_frame))


class OnlineFit:
    """The window of per-rank timings and the model fitted from it; one per balanced ViT.

    Every rank feeds it the same gathered timings in the same order, so every rank holds the same
    state and the same ``model``.
    """

    def __init__(self, settings: OnlineCost) -> None:
        self.settings = settings
        self.model = FittedCost(settings=settings)
        self._steps: collections.deque[list[tuple[tuple[float, ...], float, float]]] = (
            collections.deque(maxlen=settings.window)
        )
        self._num_steps = 0

    def observe(self, units_R: Sequence[Sequence[Unit]], seconds_R: Sequence[float]) -> FittedCost:
        """Add one step's timings and refit.

        Args:
            units_R: the units each rank *computed* that step (after balancing, a dummy unit
                included), in rank order.
            seconds_R: each rank's measured ViT forward + backward seconds; an entry outside
                ``[MIN_SECONDS, MAX_SECONDS]`` (0, a negative sentinel, NaN) means "no timing" and
                is skipped.

        Returns:
            The new model (also ``self.model``).

        Raises:
            ValueError: ``units_R`` and ``seconds_R`` differ in length.
        """
        if len(units_R) != len(seconds_R):
            raise ValueError(f"{len(units_R)} ranks of units but {len(seconds_R)} timings")
        # Past MAX_OBSERVATIONS over the window, keep a stride of ranks that rotates each step.
        per_step = max(1, MAX_OBSERVATIONS // self.settings.window)
        stride = -(-len(units_R) // per_step)
        offset = self._num_steps % stride
        self._num_steps += 1
        prior_memo: dict[Unit, float] = {}
        step = []
        for rank in range(offset, len(units_R), stride):
            seconds = float(seconds_R[rank])
            if not MIN_SECONDS <= seconds <= MAX_SECONDS:  # NaN fails too
                continue
            units = [tuple(u) for u in units_R[rank]]
            for u in units:
                if u not in prior_memo:  # a band: its rows' share of its frame's (plan.bands)
                    t, h, w = u[:3]
                    frame_h = u[3] if len(u) == 5 else h
                    prior_memo[u] = self.settings.prior(t, frame_h, w) * h / frame_h
            prior = math.fsum(prior_memo[u] for u in units)
            step.append((rank_features(units, self.settings.per_frame), prior, seconds))
        self._steps.append(step)
        self.model = self._fit()
        return self.model

    def _fit(self) -> FittedCost:
        observations = [obs for step in self._steps for obs in step]
        n = len(observations)
        if n == 0:
            return FittedCost(settings=self.settings)
        seconds = [s for _, _, s in observations]
        coeffs = fit_nonnegative([f for f, _, _ in observations], seconds)
        blend = min(1.0, n / MIN_OBSERVATIONS)
        scale = 1.0
        if blend < 1.0:  # only then is the prior part of a unit's cost
            scale, _ = fit_nonnegative([(p, 1.0) for _, p, _ in observations], seconds)
        if not all(map(math.isfinite, (*coeffs, scale))):  # not seen; cheap insurance
            return FittedCost(settings=self.settings, num_observations=n)
        if coeffs[0] == coeffs[1] == coeffs[2] == 0.0:
            blend = 0.0  # time does not grow with work: no unit costs to learn, keep the prior
        if scale <= 0.0:  # the prior explains nothing: its ratios alone, or the fit alone
            scale, blend = (1.0, 0.0) if blend == 0.0 else (0.0, 1.0)
        return FittedCost(
            settings=self.settings,
            coeffs=tuple(coeffs),
            prior_scale=scale,
            blend=blend,
            num_observations=n,
        )
