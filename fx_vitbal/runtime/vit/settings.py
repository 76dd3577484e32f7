"""The settings of a balanced ViT call, worked out once per ViT and config: the planner spec
(config + cost model, one string that every op takes and every cache key contains), the merge
size, the ViT's layout token, and the one rule saying whether balancing is active.
"""

import dataclasses
import functools
import itertools
import json
import logging
import os
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from fx_vitbal import _compat
from fx_vitbal.config import BalanceConfig
from fx_vitbal.cost.static import (
    ArchitectureCost,
    CostModel,
    choose_cost_model,
    cost_from_spec,
    cost_to_spec,
)
from fx_vitbal.plan.bands import BandRule
from fx_vitbal.plan.step import PlanSettings
from fx_vitbal.runtime.transport.routing import ROUTING_HEADER
from fx_vitbal.runtime.vit.registry import unwrap_module, vision_encoder_spec

log = logging.getLogger(__name__)

# One object, so settings kept for ``config=None`` calls are found again (``planner_for``).
DEFAULT_CONFIG = BalanceConfig()


def planner_spec(
    config: BalanceConfig, cost_model: CostModel, bands: BandRule | None = None
) -> str:
    """Everything ``plan_units`` needs besides the data, as one string (a custom-op argument,
    so it is part of the compiled graph and of every cache key).

    It also names the routing layout (``ROUTING_HEADER``): the ``plan`` fake kernel's output
    size depends on it, and inductor's on-disk caches key compiled graphs on their code, not on
    fake kernels, so a graph compiled by an older layout must not be served to a newer one (seen:
    ``expected size 14==13 ... Error in op: torch.ops.vitbal.plan.default``).
    """
    fields = dataclasses.asdict(config)
    fields["cost_coeffs"] = list(config.cost_coeffs) if config.cost_coeffs else None
    if config.ranks_per_node is None:  # node-blind specs (and their cache keys) stay as they were
        del fields["ranks_per_node"]
    spec = {"config": fields, "cost": cost_to_spec(cost_model), "routing": ROUTING_HEADER}
    if bands is None:  # a ViT that runs no bands: its specs (and cache keys) stay as they were
        del fields["split_images"], fields["min_band_patches"]
    else:
        spec["bands"] = dataclasses.asdict(bands)
    return json.dumps(spec, sort_keys=True)


def parse_planner_spec(spec: str) -> tuple[BalanceConfig, CostModel]:
    fields = json.loads(spec)
    config = fields["config"]
    if config["cost_coeffs"] is not None:
        config["cost_coeffs"] = tuple(config["cost_coeffs"])
    return BalanceConfig(**config), cost_from_spec(fields["cost"])


@functools.lru_cache(maxsize=64)
def plan_key(spec: str) -> str:
    """``spec`` without what shapes no plan (``verbose``): a ViT's calls on a group are counted
    and measured under this key (``fx_vitbal.measure``), so turning the verbose line on or off
    neither restarts ``BalanceStats.step`` nor forgets the measured times."""
    fields = json.loads(spec)
    fields["config"]["verbose"] = False
    return json.dumps(fields, sort_keys=True)


def plan_settings(spec: str, **changes) -> PlanSettings:
    """The ``plan.step.PlanSettings`` a planner spec stands for (``changes``: fields replaced,
    e.g. the cost model fitted this step): its config, cost model and band rule."""
    config, cost_model = parse_planner_spec(spec)
    settings = PlanSettings(config=config, cost_model=cost_model, band_rule=band_rule_of(spec))
    return dataclasses.replace(settings, **changes)


def band_rule_of(spec: str) -> BandRule | None:
    """The bands a planner spec allows (``planner_spec``), or None."""
    bands = json.loads(spec).get("bands")
    return None if bands is None else BandRule(**bands)


def runs_bands(planner: str) -> bool:
    """The one answer to whether a call planned by ``planner`` runs row bands (its plan may
    split a frame, its ViT then gets ``Bands``): the planner has a band rule (the ViT runs bands
    and ``split_images`` is on: ``planner_spec_for``) and, under ``torch.compile``, the ViT runs
    their tensor form (``BandRule.compiled``)."""
    support = _band_support(planner)
    return support == _COMPILED_TOO or (support == _EAGER and not torch.compiler.is_compiling())


_NONE, _EAGER, _COMPILED_TOO = range(3)


@torch.compiler.assume_constant_result
def _band_support(planner: str) -> int:
    rule = band_rule_of(planner)
    return _NONE if rule is None else _COMPILED_TOO if rule.compiled else _EAGER


def planner_spec_for(
    config: BalanceConfig,
    architecture: ArchitectureCost | None,
    frame_independent: bool,
    bands: "tuple[int, int, int, bool, int] | None" = None,
) -> str:
    """The planner spec of a ViT under ``config``: its cost model chosen from ``config`` and the
    ViT's architecture cost (None: unknown), frames split only if the ViT encodes them
    independently, bands only if it runs them (``bands``: its ``(align rows, exchanging layers,
    key and value width, compiled too, heads)``, ``BandSupport``) and ``config.split_images``.
    The one rule of every path (registered ViTs, Hugging Face towers)."""
    cost_model = choose_cost_model(config.cost_model, config.cost_coeffs, architecture)
    split = config.split_frames and frame_independent
    rule = None
    if bands is not None and config.split_images:
        align, layers, width, compiled, heads = bands
        rule = BandRule(
            align=align,
            min_patches=config.min_band_patches,
            exchange_layers=layers,
            kv_bytes_per_patch=KV_BYTES * width,
            compiled=compiled,
            heads=heads,
        )
    return planner_spec(dataclasses.replace(config, split_frames=split), cost_model, rule)


# Bytes of a patch's key and value per unit of their width: two tensors in bf16, what training
# runs in (an fp32 run moves twice as many; the decision errs towards splitting there).
KV_BYTES = 2 * 2


def planner_for(vit: nn.Module, config: BalanceConfig) -> tuple[str, int]:
    """``(planner spec string, merge size)`` for ``vit`` under ``config``.

    Kept on the ViT for the last config it was asked with, so a step pays for the JSON once.
    Under ``torch.compile`` it is a constant (the ViT's class and the config do not change
    while a compiled graph lives, and the string is an argument of the ``plan`` op, so it is
    part of the graph and of every cache key). Dynamo before torch 2.13 cannot make a constant
    of a call on a module, so there the settings must have been made before the trace.

    Raises:
        RuntimeError: traced by dynamo before torch 2.13 with no settings made yet.
    """
    cached = getattr(vit, "_vitbal_settings", None)
    if cached is not None and cached[0] is config:
        return cached[1]
    if torch.compiler.is_compiling() and not _compat.DYNAMO_CALLS_ON_MODULES_ARE_CONSTANTS:
        raise RuntimeError(
            f"vit dp balance: torch {torch.__version__} cannot trace the balancing settings of "
            f"a {type(vit).__qualname__} (torch >= 2.13 can); make them before compiling: "
            "call fx_vitbal.enable_vit_balance on the ViT or its model, or call "
            "dp_balance_vit_encoder once outside torch.compile with the same config object"
        )
    settings = _settings(vit, config)
    if not torch.compiler.is_compiling():
        vit._vitbal_settings = (config, settings)
        layout_token(vit)  # made here too, so graphs traced later read it as a constant
    return settings


def layout_token(vit: nn.Module) -> int:
    """A number naming ``vit`` for the output layouts the ranks agreed on
    (``layouts.layout_key``): unique in this process, never reused by a later ViT the way
    ``id()`` is once the first is freed. Kept on the ViT; a graph traced before it had one
    bakes a fresh one in as a constant (its first call then agrees on layouts again)."""
    token = getattr(vit, "_vitbal_layout_token", None)
    if token is None:
        token = _new_layout_token()
        if not torch.compiler.is_compiling():
            vit._vitbal_layout_token = token
    return token


_LAYOUT_TOKENS = itertools.count(1)


@torch.compiler.assume_constant_result
def _new_layout_token() -> int:
    return next(_LAYOUT_TOKENS)


@torch.compiler.assume_constant_result
def _settings(vit: nn.Module, config: BalanceConfig) -> tuple[str, int]:
    spec = vision_encoder_spec(vit)
    inner = unwrap_module(vit)
    architecture = spec.cost_model(inner) if spec.cost_model is not None else None
    bands = spec.bands.of(inner) if spec.bands is not None else None
    planner = planner_spec_for(config, architecture, spec.frame_independent, bands)
    return planner, spec.merge_size(vit)


class BalancedCall(NamedTuple):
    """The facts of one balanced ViT call besides its batch, passed whole from the entry point
    through the runtime (a named tuple: ``torch.compile`` traces it). The ``vitbal::plan`` op
    takes them flat (``op_args``) and rebuilds them (its schema is flat)."""

    merge_size: int
    planner: str
    """The planner spec (``planner_spec``): config, cost model, band rule."""
    world_size: int
    group_name: str
    active: bool = True
    """Balancing is on for this call (``balancing_active``); off, nothing is collective."""
    module_key: int = 0
    """The ViT's ``layout_token`` (0: none): its agreed output layouts, a plan made ahead."""
    problem: int = 0
    """A ``problems.problem_code`` the caller found: every rank raises it."""
    grad_fixed: bool = False
    """The call is compiled: its pixels' ``requires_grad`` cannot follow the other ranks'."""
    replicas: tuple[int, ...] = ()
    """The group ranks holding this rank's batch (``replica_ranks``; empty: its own set)."""
    runs_bands: bool = False
    """The call runs row bands (``runs_bands``)."""

    def op_args(self) -> tuple:
        """The ``vitbal::plan`` op's arguments after the pixels and the grid, in its order."""
        return (
            self.merge_size,
            self.planner,
            self.world_size,
            self.group_name,
            self.active,
            self.module_key,
            self.problem,
            self.grad_fixed,
            list(self.replicas) or None,
            self.runs_bands,
        )


def python_call(
    module: nn.Module, planner: str, merge_size: int, dist_info: tuple, problem: int
) -> BalancedCall:
    """The facts of a call made from Python code (``dp_balance_vit_encoder``, a tower
    balanced in place, ``plan_ahead``): ``dist_info`` is ``(group name, world size,
    replicas)``; compiled only when dynamo traces that code."""
    return BalancedCall(
        merge_size=merge_size,
        planner=planner,
        world_size=dist_info[1],
        group_name=dist_info[0],
        module_key=layout_token(module),
        problem=problem,
        grad_fixed=torch.compiler.is_compiling(),
        replicas=dist_info[2],
        runs_bands=runs_bands(planner),
    )


def active_group(
    vit: nn.Module,
    config: BalanceConfig,
    group: dist.ProcessGroup | None,
    replica_group: "dist.ProcessGroup | Sequence[int] | None" = None,
) -> tuple[str, int, tuple[int, ...]] | None:
    """``(group_name, world_size, replicas)`` to balance this call over (``replica_ranks``), or
    None when it runs plainly: no process group, or balancing inactive
    (``balancing_active``). The one gate of every path. A group of one rank is balanced too:
    its plan (``single-rank``) moves nothing and gathers nothing, but the call is reported
    like any other (the verbose line, the stats callbacks)."""
    dist_info = group_name_and_size(group)
    if dist_info is None or not balancing_active(vit, config):
        return None
    return (*dist_info, replica_ranks(group, replica_group))


@torch.compiler.assume_constant_result
def replica_ranks(
    group: dist.ProcessGroup | None, replica_group: "dist.ProcessGroup | Sequence[int] | None"
) -> tuple[int, ...]:
    """The ranks of ``group`` (default WORLD) that hold this rank's batch, as ranks in
    ``group`` (ascending; -1 for a rank outside it): ``replica_group``'s, a process group or
    its global ranks. Empty for None: each rank is its own set. The ranks are checked by the
    plan, on every rank alike (``runtime.agree.replicas``), not here: a wrong group must raise the
    same error everywhere."""
    if replica_group is None:
        return ()
    group = group or dist.group.WORLD
    if isinstance(replica_group, dist.ProcessGroup):
        members = dist.get_process_group_ranks(replica_group)
    else:
        members = [int(r) for r in replica_group]
    in_group = dict(zip(dist.get_process_group_ranks(group), itertools.count(), strict=False))
    return tuple(sorted(in_group.get(r, -1) for r in members))


def balancing_active(vit: nn.Module, config: BalanceConfig) -> bool:
    """The one rule of every path: enabled, and the ViT trains or ``config.when == "always"``.
    (Whether a process group exists is the caller's other condition.)"""
    return config.enabled and in_balancing_mode(vit, config.when)


def in_balancing_mode(vit: nn.Module, when: str) -> bool:
    """``vit`` trains, or ``when == "always"``; rewritten graphs call this when they run."""
    return vit.training or when == "always"


def group_name_and_size(group: dist.ProcessGroup | None) -> tuple[str, int] | None:
    """``(group_name, world_size)`` of ``group`` (default: WORLD); None when not distributed.

    Warns once when the environment says several ranks were launched (``WORLD_SIZE`` > 1, as
    torchrun sets it) but no process group is initialised: balancing would silently be off.
    """
    if not (dist.is_available() and dist.is_initialized()):
        if not torch.compiler.is_compiling():  # eager calls warn; dynamo would trace the cache
            _warn_if_launched_without_group()
        return None
    group = group or dist.group.WORLD
    return group.group_name, dist.get_world_size(group)


@functools.cache
def _warn_if_launched_without_group() -> None:
    launched = os.environ.get("WORLD_SIZE", "1")
    if launched.isdigit() and int(launched) > 1:
        log.warning(
            "vit dp balance: WORLD_SIZE=%s but no torch.distributed process group is "
            "initialised, so ViT balancing is off; call torch.distributed.init_process_group() "
            "before the first step",
            launched,
        )
