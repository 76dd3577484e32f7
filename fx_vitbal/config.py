"""Balancing configuration and the Megatron-style command-line flags.

The dataclass is the one source of truth; argparse lives only at the edge (``add_vit_balance_args``
and ``BalanceConfig.from_args``) so library code never reads global arguments.
"""

import argparse
import dataclasses
import math
import os

COST_MODELS = ("auto", "quadratic", "polynomial", "architecture", "online")
STRATEGIES = ("min-move", "lpt")
SKIP_RULES = ("no-gain", "seed")
WHEN = ("training", "always")


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

    def __post_init__(self) -> None:
        _check(self.trigger_threshold >= 0, "trigger_threshold", self.trigger_threshold, ">= 0")
        if self.max_len_ratio is not None:
            _check(
                self.max_len_ratio >= 1,
                "max_len_ratio",
                self.max_len_ratio,
                ">= 1 (inf for no cap) or None",
            )
        _check(self.tolerance >= 0, "tolerance", self.tolerance, ">= 0")
        _check(
            isinstance(self.max_iters, int) and self.max_iters >= 0,
            "max_iters",
            self.max_iters,
            "an int >= 0",
        )
        _check(self.cost_model in COST_MODELS, "cost_model", self.cost_model, f"in {COST_MODELS}")
        _check(self.strategy in STRATEGIES, "strategy", self.strategy, f"in {STRATEGIES}")
        _check(self.skip_rule in SKIP_RULES, "skip_rule", self.skip_rule, f"in {SKIP_RULES}")
        _check(self.when in WHEN, "when", self.when, f"in {WHEN}")
        _check(0 <= self.min_gain < 1, "min_gain", self.min_gain, "in [0, 1)")
        mbp = self.min_band_patches
        _check(
            isinstance(mbp, int) and not isinstance(mbp, bool) and mbp >= 1,
            "min_band_patches",
            mbp,
            "an int >= 1",
        )
        rpn = self.ranks_per_node
        _check(
            rpn is None or (isinstance(rpn, int) and not isinstance(rpn, bool) and rpn >= 1),
            "ranks_per_node",
            rpn,
            "None or an int >= 1",
        )
        coeffs = self.cost_coeffs
        if coeffs is not None:  # a list from argparse or JSON: keep the config hashable
            object.__setattr__(self, "cost_coeffs", tuple(coeffs))
        if self.cost_model == "polynomial" or coeffs is not None:
            _check(
                coeffs is not None
                and len(coeffs) == 3
                and all(math.isfinite(c) and c >= 0 for c in coeffs)
                and any(c > 0 for c in coeffs),
                "cost_coeffs",
                coeffs,
                "three finite non-negative numbers, not all zero (for cost_model='polynomial')",
            )
        if coeffs is not None:
            _check(
                self.cost_model == "polynomial",
                "cost_model",
                self.cost_model,
                "'polynomial' when cost_coeffs is given",
            )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "BalanceConfig":
        """Build a config from the flags added by ``add_vit_balance_args``.

        ``ranks_per_node`` comes from ``--dp-balance-ranks-per-node-vit``, else from the
        ``LOCAL_WORLD_SIZE`` torchrun sets (this is the edge where the environment is read; the
        library itself never reads it).

        Raises:
            ValueError: an invalid flag value or combination, or a non-integer
                ``LOCAL_WORLD_SIZE``.
        """
        coeffs = args.dp_balance_cost_coeffs_vit
        ranks_per_node = args.dp_balance_ranks_per_node_vit
        if ranks_per_node is None and os.environ.get("LOCAL_WORLD_SIZE"):
            local = os.environ["LOCAL_WORLD_SIZE"]
            if not local.isdigit():
                raise ValueError(f"LOCAL_WORLD_SIZE must be a positive integer, got {local!r}")
            ranks_per_node = int(local)
        return cls(
            enabled=args.use_vit_dp_balance,
            when=args.dp_balance_when_vit,
            trigger_threshold=args.dp_balance_trigger_threshold_vit,
            max_len_ratio=args.dp_balance_max_len_ratio_vit,
            tolerance=args.dp_balance_tolerance_vit,
            max_iters=args.dp_balance_max_iters_vit,
            verbose=args.dp_balance_verbose,
            cost_model=args.dp_balance_cost_model_vit,
            cost_coeffs=tuple(coeffs) if coeffs is not None else None,
            strategy=args.dp_balance_strategy_vit,
            skip_rule=args.dp_balance_skip_rule_vit,
            min_gain=args.dp_balance_min_gain_vit,
            split_frames=args.dp_balance_split_frames_vit,
            split_images=args.dp_balance_split_images_vit,
            min_band_patches=args.dp_balance_min_band_patches_vit,
            ranks_per_node=ranks_per_node,
        )


def add_vit_balance_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``--use-vit-dp-balance`` family of flags (LoongForge's, and ours in the same naming)
    to a parser.

    Returns the parser so it can be chained.
    """
    d = BalanceConfig()
    g = parser.add_argument_group(
        "ViT data-parallel balance",
        "move whole images between data-parallel ranks before the vision encoder so every rank "
        "does similar work (fx_vitbal; the flags of LoongForge's --use-vit-dp-balance)",
    )
    g.add_argument(
        "--use-vit-dp-balance",
        action="store_true",
        help="balance ViT work across data-parallel ranks",
    )
    g.add_argument(
        "--dp-balance-when-vit",
        choices=WHEN,
        default=d.when,
        help="balance while the ViT trains (default; no collective in eval mode) or always, "
        "e.g. for a frozen ViT kept in eval()",
    )
    g.add_argument(
        "--dp-balance-max-len-ratio-vit",
        type=float,
        default=d.max_len_ratio,
        help="cap pixel rows per rank at mean*ratio, inf for no cap (default: no rank above the "
        "fullest rank's rows before balancing)",
    )
    g.add_argument(
        "--dp-balance-trigger-threshold-vit",
        type=float,
        default=d.trigger_threshold,
        help="skip when max/mean-1 of the ViT loads is below this",
    )
    g.add_argument(
        "--dp-balance-verbose",
        action="store_true",
        help="print one line per step on rank 0: decision, imbalance, loads relative to the mean, "
        "rows moved",
    )
    g.add_argument(
        "--dp-balance-tolerance-vit",
        type=float,
        default=d.tolerance,
        help="stop refining once imbalance is below this",
    )
    g.add_argument(
        "--dp-balance-max-iters-vit",
        type=int,
        default=d.max_iters,
        help="maximum refinement moves/swaps",
    )
    g.add_argument(
        "--dp-balance-cost-model-vit",
        choices=COST_MODELS,
        default=d.cost_model,
        help="per-image cost model (online: fitted from measured per-rank ViT times)",
    )
    g.add_argument(
        "--dp-balance-cost-coeffs-vit",
        type=float,
        nargs=3,
        metavar=("A", "B", "C"),
        default=None,
        help="a*l^2+b*l+c coefficients for --dp-balance-cost-model-vit polynomial",
    )
    g.add_argument(
        "--dp-balance-strategy-vit",
        choices=STRATEGIES,
        default=d.strategy,
        help="min-move (default) or plain lpt",
    )
    g.add_argument(
        "--dp-balance-skip-rule-vit",
        choices=SKIP_RULES,
        default=d.skip_rule,
        help="no-gain (default) or seed: LoongForge's rule, also skip when one image costs more "
        "than the mean load",
    )
    g.add_argument(
        "--dp-balance-min-gain-vit",
        type=float,
        default=d.min_gain,
        help="skip plans that lower the predicted makespan by less than this fraction",
    )
    g.add_argument(
        "--dp-balance-split-frames-vit",
        action=argparse.BooleanOptionalAction,
        default=d.split_frames,
        help="move single video frames when the ViT attends per frame",
    )
    g.add_argument(
        "--dp-balance-split-images-vit",
        action=argparse.BooleanOptionalAction,
        default=d.split_images,
        help="split a frame that binds the step alone into row bands on several ranks, when "
        "the tower can run them and it pays with their per-layer exchange",
    )
    g.add_argument(
        "--dp-balance-min-band-patches-vit",
        type=int,
        default=d.min_band_patches,
        metavar="N",
        help="no band has fewer patches",
    )
    g.add_argument(
        "--dp-balance-ranks-per-node-vit",
        type=int,
        default=None,
        metavar="N",
        help="data-parallel ranks per node (contiguous) for node-aware planning: keep moves "
        "inside nodes; 1 = node-blind (default: LOCAL_WORLD_SIZE when set, else node-blind)",
    )
    return parser


def _check(ok: bool, field: str, value: object, expected: str) -> None:
    if not ok:
        raise ValueError(f"BalanceConfig.{field} must be {expected}, got {value!r}")
