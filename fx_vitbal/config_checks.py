"""The checks of a ``BalanceConfig``'s values: ``check_config`` raises a ``FieldError`` (a
``ValueError`` naming the field, and the flag when the value came from one: see [Note: flags] in
``fx_vitbal.config``)."""

import math

COST_MODELS = ("auto", "quadratic", "polynomial", "architecture", "online")
STRATEGIES = ("min-move", "lpt")
SKIP_RULES = ("no-gain", "seed")
WHEN = ("training", "always")
BAND_EXCHANGES = ("auto", "gather", "ulysses", "ring", "usp")


class FieldError(ValueError):
    """``BalanceConfig``'s ``ValueError``, knowing the fields it names: see [Note: flags]."""

    def __init__(self, field: str, problem: str, related: tuple[str, ...] = ()) -> None:
        super().__init__(field, problem, related)  # these args, so it pickles across processes
        self.field, self.problem, self.related = field, problem, related

    def __str__(self) -> str:
        return f"BalanceConfig.{self.field} {self.problem}"


def _check(
    ok: bool, field: str, value: object, expected: str, related: tuple[str, ...] = ()
) -> None:
    if not ok:
        raise FieldError(field, f"must be {expected}, got {value!r}", related)


def _positive_int_or_none(value) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1)


def check_config(config) -> None:
    """Raise a ``FieldError`` for the first value of ``config`` out of its range."""
    _check(config.trigger_threshold >= 0, "trigger_threshold", config.trigger_threshold, ">= 0")
    if config.max_len_ratio is not None:
        _check(
            config.max_len_ratio >= 1,
            "max_len_ratio",
            config.max_len_ratio,
            ">= 1 (inf for no cap) or None",
        )
    _check(config.tolerance >= 0, "tolerance", config.tolerance, ">= 0")
    _check(
        isinstance(config.max_iters, int) and config.max_iters >= 0,
        "max_iters",
        config.max_iters,
        "an int >= 0",
    )
    _check(config.cost_model in COST_MODELS, "cost_model", config.cost_model, f"in {COST_MODELS}")
    _check(config.strategy in STRATEGIES, "strategy", config.strategy, f"in {STRATEGIES}")
    _check(config.skip_rule in SKIP_RULES, "skip_rule", config.skip_rule, f"in {SKIP_RULES}")
    _check(config.when in WHEN, "when", config.when, f"in {WHEN}")
    _check(0 <= config.min_gain < 1, "min_gain", config.min_gain, "in [0, 1)")
    mbp = config.min_band_patches
    _check(
        isinstance(mbp, int) and not isinstance(mbp, bool) and mbp >= 1,
        "min_band_patches",
        mbp,
        "an int >= 1",
    )
    rpn = config.ranks_per_node
    _check(
        rpn is None or (isinstance(rpn, int) and not isinstance(rpn, bool) and rpn >= 1),
        "ranks_per_node",
        rpn,
        "None or an int >= 1",
    )
    coeffs = config.cost_coeffs
    if coeffs is not None:  # a list from argparse or JSON: keep the config hashable
        object.__setattr__(config, "cost_coeffs", tuple(coeffs))
    if config.cost_model == "polynomial" or coeffs is not None:
        _check(
            coeffs is not None
            and len(coeffs) == 3
            and all(math.isfinite(c) and c >= 0 for c in coeffs)
            and any(c > 0 for c in coeffs),
            "cost_coeffs",
            coeffs,
            "three finite non-negative numbers, not all zero, with cost_model 'polynomial'",
            related=("cost_model",),
        )
    if coeffs is not None:
        _check(
            config.cost_model == "polynomial",
            "cost_model",
            config.cost_model,
            "'polynomial' when cost_coeffs is given",
            related=("cost_coeffs",),
        )
    _check(
        config.band_exchange in BAND_EXCHANGES,
        "band_exchange",
        config.band_exchange,
        f"in {BAND_EXCHANGES}",
    )
    _check(
        _positive_int_or_none(config.memory_budget),
        "memory_budget",
        config.memory_budget,
        "None or an int >= 1 (bytes)",
    )
