"""Fixed planner inputs and a compact record of the plans they give, to prove that moving code
leaves every plan as it was: ``python tests/recorded_plans.py`` records them into
``tests/data/recorded_plans.json`` (run it only when a plan is meant to change, and say why).

Each case names a workload (ranks, images per rank, mix, seed), a cost model and the options;
a plan is recorded as its decision, its rows moved, and a digest of its assignment and exact
loads (``float.hex``), so any change of any bit shows.
"""

import hashlib
import json
import pathlib
import random

from fx_vitbal import BalanceConfig, solve_plan
from fx_vitbal.cost import ArchitectureCost, QuadraticCost
from fx_vitbal.tools.workloads import sample_batches

RECORD = pathlib.Path(__file__).parent / "data" / "recorded_plans.json"
ARCHITECTURE = ArchitectureCost(hidden=1280, mlp_hidden=3420, depth=32, in_dim=1176, out_dim=3584)
COSTS = {"quadratic": QuadraticCost(), "architecture": ARCHITECTURE}
OPTIONS = [
    {},
    {"strategy": "lpt"},
    {"max_len_ratio": 1.0},
    {"max_len_ratio": 1.5},
    {"max_len_ratio": float("inf")},
    {"strategy": "lpt", "max_len_ratio": 1.0},
    {"ranks_per_node": 8},
    {"ranks_per_node": 4, "max_len_ratio": 1.2},
    {"skip_rule": "seed"},
    {"trigger_threshold": 0.0, "min_gain": 0.0},
    {"tolerance": 0.0, "max_iters": 200},
]
WORKLOADS = [
    (2, 4, "realistic"),
    (8, 1, "realistic"),
    (8, 8, "documents"),
    (64, 4, "realistic"),
    (64, 16, "photos"),
    (256, 8, "realistic"),
]


def _exchange_seconds(send: list[int], recv: list[int]) -> float:
    """A made-up exchange model (seconds from rows), like ``ExchangeModel.step_seconds``."""
    return 2e-5 + max(max(send), max(recv)) * 4e-9


def cases():
    """``(name, costs, tokens, solve_plan keyword arguments)`` for every recorded case."""
    for num_ranks, images, mix in WORKLOADS:
        grids = sample_batches(num_ranks, images, mix=mix, seed=num_ranks + images)
        tokens = [[t * h * w for t, h, w in rank] for rank in grids]
        for cost_name, model in COSTS.items():
            costs = [[model(*g) for g in rank] for rank in grids]
            for i, options in enumerate(OPTIONS):
                name = f"{num_ranks}x{images}-{mix}-{cost_name}-{i}"
                yield name, costs, tokens, {"config": BalanceConfig(**options)}
        history = [
            float(r % 3) * max(map(max, filter(None, tokens)), default=1) for r in range(num_ranks)
        ]
        costs = [[float(n) ** 2 / 1e6 for n in rank] for rank in tokens]
        yield f"{num_ranks}x{images}-{mix}-history", costs, tokens, {"history": history}
        seconds = [[c * 1e-6 for c in rank] for rank in costs]
        yield (
            f"{num_ranks}x{images}-{mix}-exchange",
            seconds,
            tokens,
            {"exchange_seconds": _exchange_seconds},
        )
    # Ties everywhere: small integer costs and rows.
    rng = random.Random(7)
    for k in range(40):
        num_ranks = rng.randint(1, 12)
        tokens = [
            [rng.randint(1, 4) * 4 for _ in range(rng.randint(0, 6))] for _ in range(num_ranks)
        ]
        costs = [[float(n // 4) for n in rank] for rank in tokens]
        options = OPTIONS[k % len(OPTIONS)]
        yield f"ties-{k}", costs, tokens, {"config": BalanceConfig(**options)}


def describe(plan) -> dict:
    """The record of one plan: decision, rows moved, and a digest of everything else."""
    body = json.dumps(
        [
            list(plan.assignment),
            [x.hex() for x in plan.loads_before],
            [x.hex() for x in plan.loads_after],
            plan.imbalance_before.hex(),
            plan.imbalance_after.hex(),
            plan.cap_respected,
            plan.inter_node_tokens,
        ]
    )
    return {
        "reason": plan.reason,
        "moved": plan.moved_tokens,
        "digest": hashlib.sha256(body.encode()).hexdigest()[:32],
    }


def solve_all() -> dict:
    return {name: describe(solve_plan(c, t, **kw)) for name, c, t, kw in cases()}


if __name__ == "__main__":
    RECORD.write_text(json.dumps(solve_all(), indent=0, sort_keys=True) + "\n")
    print(f"recorded {len(json.loads(RECORD.read_text()))} plans in {RECORD}")
