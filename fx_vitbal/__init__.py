"""fx_vitbal: move images (frames; row bands of one huge frame) between data-parallel ranks before
the ViT so every rank does similar work, and move the outputs back so the rest of the model sees
exactly what it would have.
"""

from fx_vitbal.ahead import PlannedBatch, plan_ahead, use_plan
from fx_vitbal.config import BalanceConfig, add_vit_balance_args
from fx_vitbal.cost import ArchitectureCost, PolynomialCost, QuadraticCost
from fx_vitbal.encoder import dp_balance_vit_encoder, enable_vit_balance
from fx_vitbal.integrations import hf  # noqa: F401  (registers its entry point; no transformers import)
from fx_vitbal.integrations.hf_inputs import CallConvention
from fx_vitbal.integrations.hf_towers import HFTowerRule, register_hf_tower
from fx_vitbal.measure import BalanceStats, add_stats_callback
from fx_vitbal.plan import Plan, solve_plan
from fx_vitbal.runtime.agree import planning  # noqa: F401  (register the vitbal::plan op)
from fx_vitbal.runtime.bands.view import Bands, BandUnit
from fx_vitbal.runtime.transport import ops  # noqa: F401  (register the vitbal:: custom ops)
from fx_vitbal.runtime.vit.registry import BandSupport, VisionEncoderSpec, register_vision_encoder
from fx_vitbal.tools.check import VisionEncoderReport, check_vision_encoder

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
    "register_hf_tower",
    "HFTowerRule",
    "CallConvention",
    # row bands of one frame on several ranks (a ViT that runs them)
    "BandSupport",
    "Bands",
    "BandUnit",
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
