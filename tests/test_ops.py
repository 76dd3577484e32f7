"""The vitbal custom ops pass torch.library.opcheck (schema, fake, autograd, AOT) on 2 ranks."""

import dataclasses

import torch
from dist_utils import run_ranks

import fx_vitbal
from fx_vitbal.cost import QuadraticCost
from fx_vitbal.runtime.agree import planning
from fx_vitbal.runtime.transport import ops
from fx_vitbal.runtime.transport.routing import Routing
from fx_vitbal.runtime.vit.settings import planner_spec

DEFAULT_CHECKS = torch.library._OPCHECK_DEFAULT_UTILS
PLAN_CHECKS = tuple(u for u in DEFAULT_CHECKS if u != "test_aot_dispatch_dynamic")

GRIDS = [[[1, 4, 6], [1, 2, 2]], [[2, 2, 4], [1, 6, 6], [1, 2, 2]]]


def _opcheck_all(rank: int, world: int) -> list[str]:
    torch.manual_seed(rank)
    grid = torch.tensor(GRIDS[rank])
    pixels = torch.randn(int(grid.prod(-1).sum()), 6, dtype=torch.float64)
    spec = planner_spec(fx_vitbal.BalanceConfig(trigger_threshold=0.0), QuadraticCost())
    plan_args = (pixels, grid, 2, spec, world, "0")
    balanced_grid, routing = planning.plan(*plan_args)
    assert bool(routing[0]), "the plan must move something for this test to mean anything"
    rows = int(balanced_grid.prod(-1).sum())
    # One pre-merger output (a row per pixel row) and one merged (a row per 2x2 block), together.
    pre_merger = torch.randn(rows, 5, dtype=torch.float64, requires_grad=True)
    deep = torch.randn(rows // 4, 2, 3, dtype=torch.float64, requires_grad=True)
    checked = []
    for op, args in (
        (torch.ops.vitbal.plan.default, plan_args),
        (
            torch.ops.vitbal.redistribute.default,
            ([pixels.clone().requires_grad_(True)], routing, 4, [4], None, "0"),
        ),
        (
            torch.ops.vitbal.restore.default,
            ([pre_merger, deep], routing, 4, [4, 1], ops.home_rows([4, 1], len(pixels), 4), "0"),
        ),
    ):
        # A plan's routing names its call (``Routing.step``, what its status words and deferred
        # stats are kept by): new on every call, like a random op's output, so the check that
        # compares two calls' outputs cannot apply to it. Everything else must match exactly.
        utils = PLAN_CHECKS if op is torch.ops.vitbal.plan.default else DEFAULT_CHECKS
        torch.library.opcheck(op, args, test_utils=utils)  # raises on any failure
        checked.append(str(op))
    first, second = (Routing.from_tensor(planning.plan(*plan_args)[1]) for _ in range(2))
    assert second.step == first.step + 1
    assert dataclasses.replace(second, step=first.step) == first
    return checked


def test_every_vitbal_op_passes_opcheck_on_two_ranks():
    results = run_ranks(_opcheck_all, 2)
    assert (
        results[0]
        == results[1]
        == [
            "vitbal.plan.default",
            "vitbal.redistribute.default",
            "vitbal.restore.default",
        ]
    )


def test_every_op_is_kept_out_of_cuda_graphs():
    # Inductor's graph partitioning (mode="reduce-overhead") splits out ops with this tag; a
    # captured move would replay its recorded split sizes and skip the status checks.
    assert torch.Tag.cudagraph_unsafe in fx_vitbal._compat.CUDAGRAPH_UNSAFE
    for op in (torch.ops.vitbal.plan, torch.ops.vitbal.redistribute, torch.ops.vitbal.restore):
        assert torch.Tag.cudagraph_unsafe in op.default.tags, op
