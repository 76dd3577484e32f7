"""Balancing configuration and the Megatron-style command-line flags. The dataclass is the one
source of truth; argparse lives only at the edge, so library code never reads global arguments.

[Note: flags] ``_FLAGS`` is the one table of the flags (spelling, field, argparse options, help):
``add_vit_balance_args`` adds its rows, each help ending with the default, and ``from_args`` reads
them back; ``docs/flags.md`` documents them (a test keeps it in step). ``__post_init__`` alone
judges values and raises ``ValueError`` naming the field; the flags layer maps it to the flag:

- a value judged alone (a negative ``--dp-balance-trigger-threshold-vit``) fails while parsing:
  the flag's ``type=`` builds a ``BalanceConfig`` with it, so argparse reports it (exit status 2);
- a rule across flags (``--dp-balance-cost-model-vit polynomial`` without coefficients) or a value
  the parser never judged (``set_defaults``) fails in ``from_args``, which holds the namespace,
  not the parser: it prints ``PROG: error: argument --flag: ...`` and raises ``SystemExit(2)``
  like ``parser.error``, without the usage line. ``BalanceConfig(...)`` itself raises ValueError.
"""

import argparse
import dataclasses
import os
import re
import sys
import warnings
from collections.abc import Callable
from typing import NamedTuple

from fx_vitbal.config_checks import (
    BAND_EXCHANGES,
    COST_MODELS,
    SKIP_RULES,
    STRATEGIES,
    WHEN,
    FieldError,
    check_config,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BalanceConfig:
    """How (and whether) images are moved between data-parallel ranks before the ViT."""

    enabled: bool = True
    """Master switch (``--use-vit-dp-balance``); disabled means a plain ViT call."""

    when: str = "training"
    """``training``: balance while the ViT is in training mode, and issue no collective at all in
    eval mode (validation or generation often runs on some ranks only). ``always``: also in eval
    mode, e.g. for a frozen ViT kept in ``eval()`` while the LM trains; every rank must then call
    the ViT at the same steps in eval mode too."""

    trigger_threshold: float = 0.2
    """Skip when ``max(loads) / mean(loads) - 1`` is below this."""

    max_len_ratio: float | None = None
    """Memory guard on the pixel rows each rank computes.

    ``None`` (default): no rank gets more rows than the fullest rank held before balancing, so a
    batch that fits in memory unbalanced also fits balanced. LoongForge's ``None`` meant no cap;
    this default differs for memory safety: a plan that balances cost, not rows, can raise the
    peak rows (by 7-14% in some 64-rank batches of the planner benchmark), enough to turn a step
    that fit into an out-of-memory error. A number ``R``: at most ``mean_rows * R`` rows per rank,
    unless a single unit alone is larger. ``math.inf``: no cap."""

    tolerance: float = 0.05
    """Refinement stops once the plan's imbalance is below this."""

    max_iters: int = 20
    """Maximum move/swap refinement steps."""

    verbose: bool = False
    """Print one line per step on rank 0 (no logging set-up needed): step number, decision,
    imbalance before/after, heaviest and lightest load relative to the mean, rows moved."""

    cost_model: str = "auto"
    """``auto`` (architecture-aware when the ViT's dimensions are known, else quadratic),
    ``quadratic`` (``(t*h*w)**2``), ``polynomial`` (needs ``cost_coeffs``), ``architecture``
    or ``online`` (fitted every step from every rank's measured ViT time, starting from
    ``auto``'s model; ``fx_vitbal.cost.online``)."""

    cost_coeffs: tuple[float, float, float] | None = None
    """``(a, b, c)`` of ``a*l**2 + b*l + c`` for the polynomial model (``PolynomialCost.fit``)."""

    strategy: str = "min-move"
    """``min-move``: near-LPT makespan while keeping most units home; ``lpt``: plain LPT plus
    refinement (it moves most units)."""

    skip_rule: str = "no-gain"
    """``no-gain``: skip only when the plan would not lower the makespan by ``min_gain``.
    ``seed``: additionally skip whenever one unit costs more than the mean load."""

    min_gain: float = 0.02
    """Relative makespan reduction below which a plan is not worth its communication."""

    split_frames: bool = True
    """Move single video frames when the ViT attends per frame (exact for Qwen-family towers)."""

    split_images: bool = True
    """Split a frame that would bind the step alone into row bands computed on several ranks
    (``fx_vitbal.plan.bands``), when the tower can run bands (a split rule: the reference
    ``QwenStyleViT``, the Qwen2-VL, Qwen2.5-VL, Qwen3-VL and GLM-4V towers, or a ViT registered
    with ``bands=``) and the predicted makespan, with the bands' per-layer exchange, falls by
    ``min_gain``. A ViT without a split rule is never split."""

    min_band_patches: int = 1024
    """No band has fewer patches: below a few thousand, per-layer collectives cost more than a
    split saves on most interconnects (torchtitan measured images of 256-9,000 patches ~5% slower
    split on NVLink); the cost model decides above it."""

    ranks_per_node: int | None = None
    """Data-parallel ranks per node, for node-aware planning (``fx_vitbal.plan.nodes``): moves stay
    inside a node where they can, and plans report the rows crossing nodes. Rank ``r`` of the
    balancing group is on node ``r // ranks_per_node`` (contiguous ranks, as torchrun numbers
    them). ``None`` or 1: node-blind. Every rank must use the same value (ranks compare a
    fingerprint of the config and raise when they differ). ``from_args`` defaults it to
    ``LOCAL_WORLD_SIZE`` when that is set; with model parallelism inside a node pass the number
    of data-parallel ranks per node instead."""

    band_exchange: str = "auto"
    """How the ranks computing a split frame's bands exchange what its attention needs, in each
    layer that attends over the whole frame: ``gather`` (each band rank gets the other bands'
    keys and values), ``ulysses`` (an all-to-all of heads: each rank attends over the whole
    frame for a share of the heads; the heads must divide among the frame's ranks), ``ring``
    (the keys and values pass around the frame's ranks in k-1 steps, an online softmax merging
    the blocks), ``usp`` (``ulysses`` inside groups of a node's bands, ``ring`` across the
    groups: the heads need divide among a node's bands only), or ``auto``: per frame, the kind
    the exchange model prices lowest where the frame's ranks sit (``fx_vitbal.plan.bands``). A
    forced kind the heads cannot run becomes ``ring`` by rule. A tower that only gathers
    (``Bands.gather``) always gathers."""

    memory_budget: int | None = None
    """Bytes of ViT activations one rank may hold in a call (``None``: no budget), counted by
    ``fx_vitbal.cost.memory`` (bf16, no checkpointing) from the tower's dimensions: a frame
    holding more is cut into as many bands as it needs to fit, whether or not it binds the
    step, and no rank computes more patches than fit (a row cap beside ``max_len_ratio``'s,
    kept even where balancing gains nothing; a frame that cannot be cut may exceed it alone).
    Where no plan found keeps it, the plan says so (``Plan.cap_respected``, the verbose line).
    Needs the held bytes: a tower that runs bands, or the architecture cost model."""

    def __post_init__(self) -> None:
        check_config(self)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "BalanceConfig":
        """Build a config from the flags added by ``add_vit_balance_args`` (see [Note: flags]).

        ``ranks_per_node`` comes from ``--dp-balance-ranks-per-node-vit``, else from the
        ``LOCAL_WORLD_SIZE`` torchrun sets (this is the edge where the environment is read; the
        library itself never reads it).

        Args:
            args: the namespace ``parser.parse_args()`` returned.

        Returns:
            The config the flags describe; a ``UserWarning`` for ``--dp-balance-verbose`` without
            ``--use-vit-dp-balance`` (it prints nothing then).

        Raises:
            SystemExit: status 2, after a message naming the flag, for a value or combination of
                flags that ``BalanceConfig`` rejects.
            ValueError: ``LOCAL_WORLD_SIZE`` is not a positive integer.
        """
        values = {row.field: getattr(args, row.flag[2:].replace("-", "_")) for row in _FLAGS}
        local = os.environ.get("LOCAL_WORLD_SIZE")
        if values["ranks_per_node"] is None and local:
            if not local.isdigit() or int(local) < 1:
                raise ValueError(f"LOCAL_WORLD_SIZE must be a positive integer, got {local!r}")
            values["ranks_per_node"] = int(local)
        if values["verbose"] and not values["enabled"]:
            message = "--dp-balance-verbose does nothing without --use-vit-dp-balance"
            warnings.warn(message, UserWarning, stacklevel=2)
        try:
            return cls(**values)
        except FieldError as err:  # parser.error without the parser: see [Note: flags]
            prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
            flag, problem = _FLAG_OF[err.field], _flag_problem(err)
            sys.stderr.write(f"{prog}: error: argument {flag}: {problem}\n")
            raise SystemExit(2) from err


_DEFAULT = BalanceConfig()


class _Flag(NamedTuple):
    """One row of the flag table: see [Note: flags]."""

    flag: str
    field: str
    help: str
    """Ends with ``(default: ...)``, as ``docs/flags.md`` words the default."""
    options: dict[str, object]
    """``add_argument`` keywords besides ``help``, ``default`` included."""


def _flag(flag: str, field: str, help: str, shown: str | None = None, **options) -> _Flag:
    """A row; ``default`` is the field's unless given, ``shown`` words it where its value won't."""
    default = options.setdefault("default", getattr(_DEFAULT, field))
    if shown is None:
        shown = ("on" if default else "off") if isinstance(default, bool) else str(default)
    return _Flag(flag, field, f"{help} (default: {shown})", options)


_FLAGS = (
    _flag(
        "--use-vit-dp-balance",
        "enabled",
        "balance ViT work across data-parallel ranks",
        action="store_true",
        default=False,
    ),
    _flag(
        "--dp-balance-when-vit",
        "when",
        "balance while the ViT trains (no collective in eval mode) or always, e.g. for a frozen "
        "ViT kept in eval()",
        choices=WHEN,
    ),
    _flag(
        "--dp-balance-max-len-ratio-vit",
        "max_len_ratio",
        "cap pixel rows per rank at mean*ratio, inf for no cap",
        "no rank above the fullest rank's rows before balancing",
        type=float,
    ),
    _flag(
        "--dp-balance-trigger-threshold-vit",
        "trigger_threshold",
        "skip when max/mean-1 of the ViT loads is below this",
        type=float,
    ),
    _flag(
        "--dp-balance-verbose",
        "verbose",
        "print one line per step on rank 0: decision, imbalance, loads relative to the mean, rows "
        "moved; does nothing without --use-vit-dp-balance",
        action="store_true",
    ),
    _flag(
        "--dp-balance-tolerance-vit",
        "tolerance",
        "stop refining once imbalance is below this",
        type=float,
    ),
    _flag("--dp-balance-max-iters-vit", "max_iters", "maximum refinement moves/swaps", type=int),
    _flag(
        "--dp-balance-cost-model-vit",
        "cost_model",
        "per-image cost model (polynomial: with --dp-balance-cost-coeffs-vit; online: fitted from "
        "measured per-rank ViT times)",
        choices=COST_MODELS,
    ),
    _flag(
        "--dp-balance-cost-coeffs-vit",
        "cost_coeffs",
        "a*l^2+b*l+c coefficients for --dp-balance-cost-model-vit polynomial",
        "none",
        type=float,
        nargs=3,
        metavar=("A", "B", "C"),
    ),
    _flag("--dp-balance-strategy-vit", "strategy", "min-move or plain lpt", choices=STRATEGIES),
    _flag(
        "--dp-balance-skip-rule-vit",
        "skip_rule",
        "no-gain or seed: LoongForge's rule, also skip when one image costs more than the mean "
        "load",
        choices=SKIP_RULES,
    ),
    _flag(
        "--dp-balance-min-gain-vit",
        "min_gain",
        "skip plans that lower the predicted makespan by less than this fraction",
        type=float,
    ),
    _flag(
        "--dp-balance-split-frames-vit",
        "split_frames",
        "move single video frames when the ViT attends per frame",
        action=argparse.BooleanOptionalAction,
    ),
    _flag(
        "--dp-balance-split-images-vit",
        "split_images",
        "split a frame that binds the step alone into row bands on several ranks, when the tower "
        "can run them and it pays with their per-layer exchange",
        action=argparse.BooleanOptionalAction,
    ),
    _flag(
        "--dp-balance-min-band-patches-vit",
        "min_band_patches",
        "no band has fewer patches",
        type=int,
        metavar="N",
    ),
    _flag(
        "--dp-balance-band-exchange-vit",
        "band_exchange",
        "how a split frame's ranks exchange in each whole-frame attention layer: gather, "
        "ulysses (heads), ring, usp (ulysses in a node, ring across), or auto (the cheapest "
        "where the ranks sit)",
        choices=BAND_EXCHANGES,
    ),
    _flag(
        "--dp-balance-memory-budget-vit",
        "memory_budget",
        "bytes of ViT activations one rank may hold; frames above it are split, ranks capped",
        "none",
        type=int,
        metavar="BYTES",
    ),
    _flag(
        "--dp-balance-ranks-per-node-vit",
        "ranks_per_node",
        "data-parallel ranks per node (contiguous) for node-aware planning: keep moves inside "
        "nodes; 1 = node-blind",
        "LOCAL_WORLD_SIZE when set, else node-blind",
        type=int,
        metavar="N",
    ),
)
_FLAG_OF = {row.field: row.flag for row in _FLAGS}


def add_vit_balance_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``--use-vit-dp-balance`` family of flags (LoongForge's, and ours in the same naming)
    to a parser, each help ending with its default; see [Note: flags].

    Args:
        parser: the program's own parser; its formatter and other arguments are left alone.

    Returns:
        The parser, so it can be chained.
    """
    group = parser.add_argument_group(
        "ViT data-parallel balance",
        "move images, video frames, or row bands of one large frame between data-parallel ranks "
        "before the vision encoder so every rank does similar work (fx_vitbal; the flags of "
        "LoongForge's --use-vit-dp-balance)",
    )
    for row in _FLAGS:
        options = dict(row.options)
        if "type" in options and "nargs" not in options:  # a multi-value flag: in from_args
            options["type"] = _checked_type(row.field, options["type"])
        action = group.add_argument(row.flag, **options)
        # Not given to add_argument: Python 3.10's BooleanOptionalAction would add its own default.
        action.help = row.help
    return parser


def _flag_problem(err: FieldError) -> str:
    """The problem in flags' words: the other fields its rule names become their flags."""
    problem = err.problem
    for field in err.related:
        problem = re.sub(rf"\b{field}\b", _FLAG_OF[field], problem)
    return problem


def _checked_type(field: str, convert: Callable[[str], object]) -> Callable[[str], object]:
    """An argparse ``type``: ``convert`` the text, then let ``BalanceConfig`` judge the value."""

    def check(text: str) -> object:
        value = convert(text)  # a ValueError here: argparse says "invalid float value: 'x'"
        try:
            BalanceConfig(**{field: value})
        except FieldError as err:
            raise argparse.ArgumentTypeError(_flag_problem(err)) from None
        return value

    check.__name__ = convert.__name__
    return check
