"""Balanced ViT calls: ``dp_balance_vit_encoder`` and in-place ``enable_vit_balance`` (the ViT
contract is in ``fx_vitbal.runtime.vit.registry``).

Composition: ``enable_vit_balance`` replaces the ``forward`` of the ViT *instance* (or of the
wrapper around it), as LoongForge's flag does inside the model. The alternatives were weighed:
- a subclass swapped in (FSDP2's ``fully_shard`` way) changes ``type(vit)``, which other code
  keys on: registered specs and Hugging Face tower rules match classes, and FSDP2 itself swaps
  the class of a module it shards, so two swaps would have to compose in either order;
- a forward pre-hook can rewrite the inputs but not replace the call: the ViT would still run
  on the unbalanced batch.
The instance attribute leaves parameters, ``state_dict`` keys, hooks, the class and FSDP2's
swap untouched, and ``plain_forward`` finds the original again.
"""

import functools
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from fx_vitbal.config import BalanceConfig
from fx_vitbal.runtime.agree import handover
from fx_vitbal.runtime.agree.problems import PROBLEMS, describe_problem
from fx_vitbal.runtime.call import call_inputs, input_problem, run_balanced
from fx_vitbal.runtime.vit.registry import (
    EntryPoint,
    entry_points,
    find_vit,
    plain_forward,
    regenerate_window_index,
    register_entry_point,
    unwrap_module,
)
from fx_vitbal.runtime.vit.settings import (
    DEFAULT_CONFIG,
    active_group,
    layout_token,
    planner_for,
    python_call,
)


def dp_balance_vit_encoder(
    vit: nn.Module,
    pixel_values: torch.Tensor,
    image_grid_thw: torch.Tensor,
    *,
    config: BalanceConfig | None = None,
    group: dist.ProcessGroup | None = None,
    replica_group: dist.ProcessGroup | Sequence[int] | None = None,
    plan=None,
) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
    """Run ``vit`` on a batch balanced across the data-parallel group; return its outputs in the
    original layout, as if ``vit(pixel_values, image_grid_thw)`` had run locally.

    Every rank of ``group`` must call this at the same step (with zero images if it has none).
    Without an initialised process group, with one rank, or with ``config.enabled`` False it is a
    plain call. ``vit`` needs no registration (see the module doc). ``plan``: this batch's plan,
    made ahead by ``fx_vitbal.plan_ahead`` (then no metadata gather and no planning runs here);
    every rank passes one or none does. Inside a compiled function, hand the plan over before
    the call with ``fx_vitbal.use_plan(vit, plan)`` instead (``fullgraph=True`` cannot leave the
    graph to take it here).

    ``replica_group``: the ranks of ``group`` that hold the same batch as this rank, itself
    included (its context-, sequence- or tensor-parallel group; a process group or its global
    ranks): each image is then computed once in the whole group and its outputs come back to
    every rank of the set, and the output gradients of the set's ranks are summed where it was
    computed. Pixel gradients go to one rank of the set per unit (the one that sent them, or
    the computing rank when it is in the set), zeros on the others: summed over the set they
    are the unbalanced run's. None: each rank is its own set (the same plan and collectives).
    Every rank of a set must pass the same batch; replica groups must partition ``group`` into
    sets of one size.

    Returns:
        ``(pixel_embeds, window_index, deepstack_pixel_embeds)``, each embedding in the layout
        the ViT gave it; ``window_index`` is regenerated from the original grid (a tensor, or None
        when the ViT returns None).

    Raises:
        ValueError: on every rank, when any rank's input or ViT output is malformed, its
            batch is not the one ``plan`` was made for (``fx_vitbal.ahead``), the replica
            groups do not partition ``group``, or the ranks of a set hold different grids or
            pixels.
        TypeError: ``vit`` has no ``spatial_merge_size``.
    """
    if plan is not None:
        _hand_over(vit, plan)
    call = plain_forward(vit)
    return _balanced_call(vit, call, pixel_values, image_grid_thw, config, group, replica_group)


def enable_vit_balance(
    model: nn.Module,
    *,
    config: BalanceConfig | None = None,
    group: dist.ProcessGroup | None = None,
    replica_group: dist.ProcessGroup | Sequence[int] | None = None,
    vit: str | nn.Module | None = None,
) -> nn.Module:
    """Balance the ViT inside ``model`` (or ``model`` itself) in place; returns ``model``.

    The ViT's ``forward`` is replaced on the instance, so parameter names, ``state_dict`` keys,
    hooks and FSDP wrapping are untouched. When the ViT sits in a wrapper (``checkpoint_wrapper``,
    FSDP1, ``torch.compile``), the wrapper's ``forward`` is the one replaced, so images move
    before it runs. Calling it again updates config and group. Balancing runs while the ViT is
    in training mode (or always, with ``config.when="always"``): in eval mode (generation),
    ranks need not step together and no collective runs. Hugging Face VLMs
    and towers go to ``fx_vitbal.integrations.hf``. Wrappers around ``model`` (DDP, FSDP1,
    ``torch.compile``) are seen through.

    Args:
        replica_group: the ranks of ``group`` holding this rank's batch
            (``dp_balance_vit_encoder``).
        vit: the ViT, or its dotted path in ``model`` (a Hugging Face VLM's tower too). Default:
            ``model`` if its class is registered, else the first submodule named one of
            ``VIT_CHILD_NAMES``, else the first submodule of a registered class.

    Raises:
        ValueError: no ViT found.
    """
    inner = unwrap_module(model)
    for entry in entry_points():  # models of a kind another entry point balances (Hugging Face)
        if entry.accepts is not None and entry.accepts(inner):
            tower = None if vit is None else find_vit(inner, vit)
            entry.enable(
                inner, config=config, group=group, replica_group=replica_group, tower=tower
            )
            return model
    module = find_vit(inner, vit)
    original = getattr(module, "_vitbal_original_forward", module.forward)
    module._vitbal_original_forward = original
    module._vitbal_planner = planner_for(module, config or BalanceConfig())
    module.forward = functools.partial(
        _in_place_call, module, original, config, group, replica_group
    )
    return model


def _balanced_call(
    vit, call, pixel_values, image_grid_thw, config=None, group=None, replicas=None, planner=None
):
    config = config or DEFAULT_CONFIG
    dist_info = active_group(vit, config, group, replicas)
    if dist_info is None:
        return _plain_call(call, pixel_values, image_grid_thw)
    planner, merge = planner or planner_for(vit, config)
    # Unbalanced, a parent that passes a tensor runs the ViT on it even with zero rows, so the
    # ViT's parameters get (zero) gradients; DDP fails the next step if they get none. A rank
    # that passed None takes part with stand-in pixels (``call_inputs``).
    pixel_values, image_grid_thw, problem = call_inputs(
        vit, pixel_values, image_grid_thw, dist_info[0]
    )

    def run(pixels, grid, bands):
        kwargs = {"vitbal_bands": bands} if bands is not None and bands.split else {}
        embeds, window_index, deepstack = call(pixels, grid, **kwargs)
        return [embeds, *deepstack], window_index

    facts = python_call(vit, planner, merge, dist_info, problem)
    outputs, window_index, routing = run_balanced(
        run, pixel_values, image_grid_thw, facts, vit, grad_without_images=True, refetch_pixels=True
    )
    if outputs is None:  # no pixel tensor anywhere, or a problem every rank raises
        # (A compiled rank returns the plan's empty output: it keeps the op in the graph.)
        return (window_index if problem else None), None, []
    if window_index is not None:
        window_index = regenerate_window_index(vit, image_grid_thw, routing)
    return outputs[0], window_index, list(outputs[1:])


def _plain_call(call, pixel_values, image_grid_thw):
    """The call without balancing (no process group, balancing off, eval mode): the ViT's own,
    except that None on one side only raises (it would drop images), and no images at all
    return ``(None, None, [])``."""
    problem = input_problem(pixel_values, image_grid_thw, rows_2d=False)
    if problem and (problem & 0xFF) in (PROBLEMS["pixels_none"], PROBLEMS["grid_none"]):
        raise ValueError(f"vit dp balance: {describe_problem(problem)}")
    if pixel_values is None:  # no images here and nothing to take part in
        return None, None, []
    return call(pixel_values, image_grid_thw)


def _in_place_call(vit, original, config, group, replicas, pixel_values, image_grid_thw):
    planner = vit._vitbal_planner
    return _balanced_call(
        vit, original, pixel_values, image_grid_thw, config, group, replicas, planner
    )


@torch.compiler.disable(
    reason="a plan made ahead (fx_vitbal.plan_ahead) is handed over eagerly; inside a compiled "
    "function, call fx_vitbal.use_plan(vit, plan) before the compiled call instead"
)
def _hand_over(vit: nn.Module, plan) -> None:
    handover.hand_over(layout_token(vit), plan)


register_entry_point(EntryPoint(__file__))
