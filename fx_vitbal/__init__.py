"""fx_vitbal: move whole images between data-parallel ranks before the ViT so every rank does
similar work, and move the outputs back so the rest of the model sees exactly what it would have.
"""

from fx_vitbal import ops  # noqa: F401  (registers the vitbal:: custom ops)
from fx_vitbal.ahead import PlannedBatch, plan_ahead, use_plan
from fx_vitbal.check import VisionEncoderReport, check_vision_encoder
from fx_vitbal.config import BalanceConfig, add_vit_balance_args
from fx_vitbal.cost import ArchitectureCost, PolynomialCost, QuadraticCost
from fx_vitbal.encoder import (
    VisionEncoderSpec,
    dp_balance_vit_encoder,
    enable_vit_balance,
    register_vision_encoder,
)
from fx_vitbal.measured import BalanceStats, add_stats_callback
from fx_vitbal.planner import Plan, solve_plan

__all__ = [
    # configuration
    "BalanceConfig",
    "add_vit_balance_args",
    # planning
    "Plan",
    "solve_plan",
    "QuadraticCost",
    "PolynomialCost",
    "ArchitectureCost",
    # runtime
    "dp_balance_vit_encoder",
    "enable_vit_balance",
    "register_vision_encoder",
    "VisionEncoderSpec",
    # planning ahead, in the data pipeline
    "plan_ahead",
    "use_plan",
    "PlannedBatch",
    # per-call statistics, as data (imbalance, rows moved, measured and predicted times)
    "BalanceStats",
    "add_stats_callback",
    # checking a ViT before balancing it
    "check_vision_encoder",
    "VisionEncoderReport",
]
