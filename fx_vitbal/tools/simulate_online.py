"""The online cost model against fixed ones, on synthetic per-rank timings (no ViT, no group).

Each step samples every rank's images (``fx_vitbal.tools.workloads``), plans them with a cost model,
"measures" each rank's ViT time with a known true time function (``TrueTime``: a ViT whose time
departs from its FLOPs, plus noise and occasional stragglers) and, for the online models, feeds
those timings into the fit, as the runtime does with measured times. The balance of a step is
``max / mean`` of the ranks' noise-free true times; the oracle plans with the true function.

Two true times (``TRUTHS``): one departing from the FLOPs, one proportional to them.

    python -m fx_vitbal.tools.simulate_online --ranks 16 --steps 40 --seeds 5
"""

import argparse
import dataclasses
import random
import statistics
from collections.abc import Sequence

from fx_vitbal.config import BalanceConfig
from fx_vitbal.cost.online import OnlineFit, Unit
from fx_vitbal.cost.static import CostModel, OnlineCost, QuadraticCost
from fx_vitbal.plan.solve import solve_plan
from fx_vitbal.plan.step import cost_units, split_units, unit_costs
from fx_vitbal.tools.simulate import QWEN2_VL_7B
from fx_vitbal.tools.workloads import sample_batches

MODELS = ("quadratic", "architecture", "online-quadratic", "online-architecture", "oracle")
# Always plan (no trigger, no minimum gain): the table compares cost models, not skip rules.
CONFIG = BalanceConfig(trigger_threshold=0.0, min_gain=0.0)
DUMMY_UNIT = (1, 2, 2)  # what a rank with nothing to compute runs (merge size 2)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrueTime:
    """Forward + backward seconds of a Qwen2-VL-7B-sized ViT on an accelerator that does not run
    at its FLOPs: GEMMs at a fixed rate, attention slower per pair on short frames, a fixed
    overhead per unit and per step. Callable as a cost model (the oracle's)."""

    token: float = 12e-6
    """Seconds per token: 3.8 GFLOP fwd+bwd of linear layers at ~400 TFLOP/s, plus ~25% for the
    memory-bound norms, activations and rotary embeddings."""
    pair: float = 1.6e-9
    """Seconds per attention pair at full efficiency: 4*d*depth FLOPs fwd, ~3x fwd+bwd, at
    ~300 TFLOP/s."""
    efficiency_floor: float = 0.3
    efficiency_half: float = 4096.0
    """Attention efficiency ``floor + (1 - floor) * p / (p + half)`` of a ``p``-token frame:
    short frames leave tiles and SMs idle."""
    unit: float = 2e-3
    """Seconds per unit: per-image launches and position tables, fwd+bwd."""
    step: float = 10e-3
    """Seconds per rank and step, whatever it computes."""

    def __call__(self, t: int, h: int, w: int) -> float:
        p = h * w
        efficiency = self.efficiency_floor + (1 - self.efficiency_floor) * p / (
            p + self.efficiency_half
        )
        return self.unit + t * (self.token * p + self.pair * p * p / efficiency)

    def rank_seconds(self, units: Sequence[Unit]) -> float:
        return self.step + sum(self(*u) for u in units)


TRUTHS = {
    "departs": TrueTime(),
    # Time proportional to the architecture model's FLOPs (no overheads, attention at full speed):
    # what the online model must not lose to.
    "flops": TrueTime(unit=0.0, step=0.0, efficiency_floor=1.0),
}


@dataclasses.dataclass(frozen=True)
class Run:
    """Per-step balance (true ``max / mean``) of one model, and of the oracle on the same data."""

    balance: list[float]
    oracle: list[float]

    def steps_to_reach(self, within: float = 0.02, span: int = 3) -> int | None:
        """First step (1-based) that starts ``span`` steps in a row whose balance is within
        ``within`` of the oracle's on the same data; ``None`` if none."""
        ratio = [b / o for b, o in zip(self.balance, self.oracle, strict=True)]
        for s in range(len(ratio) - span + 1):
            if max(ratio[s : s + span]) <= 1 + within:
                return s + 1
        return None


def run(
    model: str,
    *,
    num_ranks: int = 16,
    images_per_rank: int = 8,
    steps: int = 40,
    seed: int = 0,
    split_frames: bool = True,
    truth: TrueTime | None = None,
    noise: float = 0.03,
    outliers: float = 0.02,
) -> Run:
    """Plan ``steps`` steps with ``model`` (one of ``MODELS``), measuring with ``truth``.

    Timings are the true time times ``1 + noise * N(0, 1)``; a fraction ``outliers`` of them
    (stragglers) is also multiplied by 1.5-4.
    """
    truth = truth or TrueTime()
    rng = random.Random(seed)
    fit = None
    if model.startswith("online-"):
        prior = QuadraticCost() if model == "online-quadratic" else QWEN2_VL_7B
        fit = OnlineFit(OnlineCost(prior=prior))
    fixed: dict[str, CostModel] = {
        "quadratic": QuadraticCost(),
        "architecture": QWEN2_VL_7B,
        "oracle": truth,
    }
    balance, oracle = [], []
    for step in range(steps):
        grids = sample_batches(num_ranks, images_per_rank, seed=seed * 100_003 + step)
        units_R = [split_units(g, split_frames) for g in grids]
        cost_model = fit.model if fit is not None else fixed[model]
        computed_R = _plan(units_R, cost_model)
        true_R = [truth.rank_seconds(u) for u in computed_R]
        balance.append(max(true_R) / statistics.fmean(true_R))
        oracle_R = [truth.rank_seconds(u) for u in _plan(units_R, truth)]
        oracle.append(max(oracle_R) / statistics.fmean(oracle_R))
        if fit is not None:
            measured = []
            for seconds in true_R:
                seconds *= 1 + noise * rng.gauss(0.0, 1.0)
                if rng.random() < outliers:
                    seconds *= rng.uniform(1.5, 4.0)
                measured.append(seconds)
            fit.observe(computed_R, measured)
    return Run(balance, oracle)


def _plan(units_R: list[list[Unit]], cost_model: CostModel) -> list[list[Unit]]:
    """The units each rank computes under a plan made with ``cost_model``."""
    costs, tokens = cost_units(units_R, unit_costs(cost_model))
    plan = solve_plan(costs, tokens, config=CONFIG)
    return [[units_R[s][i] for s, i in assigned] or [DUMMY_UNIT] for assigned in plan.assignment]


def table(*, num_ranks: int, images_per_rank: int, steps: int, seeds: int, warmup: int) -> str:
    """The README's Markdown table: for frames and whole images as units, each model under each
    of ``TRUTHS``: balance (median true max/mean over the steps after ``warmup``, all seeds), the
    same relative to the oracle's, and the steps to come within 2% of the oracle (median and
    worst over seeds; ``-`` when not within ``steps``)."""
    header, rule = "| units | cost model |", "|---|---|"
    for name in TRUTHS:
        header += f" {name}: balance | vs oracle | steps to 2% |"
        rule += "---:|---:|---:|"
    lines = [header, rule]
    for split in (True, False):
        for model in MODELS:
            line = f"| {'frames' if split else 'images'} | {model} |"
            for truth in TRUTHS.values():
                runs = [
                    run(
                        model,
                        num_ranks=num_ranks,
                        images_per_rank=images_per_rank,
                        steps=steps,
                        seed=seed,
                        split_frames=split,
                        truth=truth,
                    )
                    for seed in range(seeds)
                ]
                balance = statistics.median(b for r in runs for b in r.balance[warmup:])
                oracle = statistics.median(b for r in runs for b in r.oracle[warmup:])
                line += f" {balance:.3f} | {balance / oracle:.3f} | {_steps(runs, steps)} |"
            lines.append(line)
    return "\n".join(lines)


def _steps(runs: list[Run], steps: int) -> str:
    reached = [r.steps_to_reach() for r in runs]
    median = statistics.median(s if s is not None else steps + 1 for s in reached)
    if median > steps:
        return "-"
    worst = max(s if s is not None else steps + 1 for s in reached)
    return f"{median:g} ({'-' if worst > steps else worst})"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=16, help="data-parallel ranks")
    parser.add_argument("--images-per-rank", type=int, default=8, help="mean images per rank")
    parser.add_argument("--steps", type=int, default=40, help="steps per run")
    parser.add_argument("--seeds", type=int, default=5, help="runs per model")
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the balance")
    args = parser.parse_args(argv)
    print(
        f"fx_vitbal online cost model: {args.ranks} ranks, {args.images_per_rank} images/rank "
        f"(realistic mix), {args.steps} steps x {args.seeds} seeds, synthetic timings"
    )
    print(
        table(
            num_ranks=args.ranks,
            images_per_rank=args.images_per_rank,
            steps=args.steps,
            seeds=args.seeds,
            warmup=args.warmup,
        )
    )


if __name__ == "__main__":
    main()
