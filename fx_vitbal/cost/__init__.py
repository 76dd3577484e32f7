"""What a unit costs: static models (``static``), the online fit from measured times
(``online``), and the exchange-time model (``exchange_time``)."""

from fx_vitbal.cost.static import (
    ArchitectureCost,
    CostModel,
    OnlineCost,
    PolynomialCost,
    QuadraticCost,
    choose_cost_model,
    cost_from_spec,
    cost_to_spec,
)

__all__ = [
    "ArchitectureCost",
    "CostModel",
    "OnlineCost",
    "PolynomialCost",
    "QuadraticCost",
    "choose_cost_model",
    "cost_from_spec",
    "cost_to_spec",
]
