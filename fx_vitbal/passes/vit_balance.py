"""FX pass: rewrite every call of the ViT into plan -> redistribute -> ViT -> restore.

Invariants:
- The ViT module itself is untouched and still called once per original call, on the balanced
  batch; everything downstream receives tensors of the original rows and order.
- Only nodes that read the ViT's output are rewired; no other node changes.
- Idempotent: a ViT call whose input already comes from ``vitbal::redistribute`` is left alone.
- New nodes carry no fake metadata; passes that need it re-run shape propagation (dynamo and
  AOTAutograd re-trace the graph through the ops' fake kernels anyway).
"""

import inspect
import logging
import operator
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import fx, nn

from fx_vitbal.config import BalanceConfig
from fx_vitbal.passes.subgraph import (
    insert_plan_and_redistribute,
    rewrite_subgraph_call,
    vit_subgraph_calls,
)
from fx_vitbal.runtime.bands.view import bands_for_vit
from fx_vitbal.runtime.call import call_inputs
from fx_vitbal.runtime.transport.ops import home_rows, no_backward_will_come, output_block_rows
from fx_vitbal.runtime.vit.registry import (
    find_vit,
    is_balanced_in_place,
    regenerate_window_index,
    unwrap_module,
)
from fx_vitbal.runtime.vit.settings import (
    BalancedCall,
    group_name_and_size,
    in_balancing_mode,
    layout_token,
    planner_for,
    replica_ranks,
    runs_bands,
)

log = logging.getLogger(__name__)

_REDISTRIBUTE = torch.ops.vitbal.redistribute.default
_RESTORE = torch.ops.vitbal.restore.default


class ViTLeafTracer(fx.Tracer):
    """``torch.fx.Tracer`` that keeps one module (the ViT) as a single ``call_module`` node."""

    def __init__(self, vit: nn.Module) -> None:
        super().__init__()
        self.vit = vit

    def is_leaf_module(self, module: nn.Module, qualname: str) -> bool:
        return module is self.vit or super().is_leaf_module(module, qualname)


def symbolic_trace(model: nn.Module, *, vit: str | nn.Module | None = None) -> fx.GraphModule:
    """``torch.fx.symbolic_trace`` keeping the ViT (found as ``enable_vit_balance`` finds it) as
    one ``call_module`` leaf, ready for ``apply_vit_balance_pass``.

    Wrappers around ``model`` (DDP, FSDP1, ``torch.compile``) cannot be traced: the graph is the
    module inside them; wrap the returned ``GraphModule`` again. A wrapper around the ViT
    (``checkpoint_wrapper``, FSDP1) stays in the graph as the leaf."""
    model = unwrap_module(model)
    tracer = ViTLeafTracer(find_vit(model, vit))
    graph = tracer.trace(model)
    return fx.GraphModule(tracer.root, graph, type(model).__name__)


def apply_vit_balance_pass(
    gm: fx.GraphModule,
    *,
    config: BalanceConfig | None = None,
    group: dist.ProcessGroup | None = None,
    replica_group: dist.ProcessGroup | Sequence[int] | None = None,
    vit: str | nn.Module | None = None,
    group_name: str | None = None,
    world_size: int | None = None,
) -> fx.GraphModule:
    """Balance every call of the ViT in ``gm`` across the data-parallel group.

    Two kinds of call are rewritten: a ``call_module`` leaf (``symbolic_trace``), and in dynamo
    graphs an ``invoke_subgraph`` node of a ViT marked with ``nested_compile_region``
    (``passes/subgraph.py``; it needs ``vit=`` the module, since dynamo graphs hold none).

    Before::

        vis = visual(pixel_values, image_grid_thw)
        embeds, window, deep0 = vis[0], vis[1], vis[2][0]

    After (``area = merge**2``)::

        pixel_values, image_grid_thw, problem = call_inputs(visual, pixel_values, image_grid_thw,
                                                            group)  # None: a stand-in
        active = in_balancing_mode(visual, when)  # the ViT trains, or when == "always"
        token = layout_token(visual)  # names the ViT for its agreed output layouts
        grid_b, routing = vitbal.plan(pixel_values, image_grid_thw, merge, planner, world, group,
                                      active, token, problem)  # raised on every rank
        pixels_b = vitbal.redistribute([pixel_values], routing, area, [area], None, group)[0]
        vis = visual(pixels_b, grid_b)
        layouts = output_block_rows([vis[0], vis[2][0]], pixels_b.size(0), area)
        rows = home_rows(layouts, pixel_values.size(0), area)  # each output's rows at home
        check_now = no_backward_will_come([vis[0], vis[2][0]])  # restore reads its status
        embeds, deep0 = vitbal.restore([vis[0], vis[2][0]], routing, area, layouts, rows, group,
                                       True, check_now)
        window = regenerate_window_index(visual, image_grid_thw, routing)  # host grid copy

    Only the deepstack items the graph reads are moved back; ``layouts`` reads each output's row
    layout (pre-merger or merged) when the graph runs or is traced. A ViT balanced in place by
    ``enable_vit_balance`` already balances its own calls and is left alone.

    Args:
        vit: the ViT module, or its qualified name in ``gm`` (default: found like
            ``enable_vit_balance``).
        replica_group: the ranks of the group holding this rank's batch (as
            ``dp_balance_vit_encoder`` takes it); the plan node then names them (group ranks).
        group_name, world_size: override the group (e.g. fixed values for graph snapshots);
            ``replica_group`` then lists ranks of that group.

    Returns:
        ``gm``, rewritten in place (a logged no-op without a ViT call or a process group).

    Raises:
        ValueError: the ViT's output is used other than by indexing (the pass cannot tell which
            rows belong to which image), only one of group_name/world_size is given, or a ViT
            region is found without ``vit=`` the module.
    """
    config = config or BalanceConfig()
    if (group_name is None) != (world_size is None):
        raise ValueError("pass both group_name and world_size, or neither")
    dist_info = (group_name, world_size) if group_name else group_name_and_size(group)
    if dist_info is None or not config.enabled:
        log.debug("apply_vit_balance_pass: nothing to do (group %s)", dist_info)
        return gm
    if group_name:  # overridden (a snapshot): the replica ranks are that group's own
        dist_info = (*dist_info, tuple(sorted(replica_group or ())))
    else:
        dist_info = (*dist_info, replica_ranks(group, replica_group))
    target = vit if isinstance(vit, str) else _vit_target(gm, vit)
    calls = [
        n
        for n in gm.graph.nodes
        if n.op == "call_module" and n.target == target and not _already_balanced(n)
    ]
    if calls and is_balanced_in_place(gm.get_submodule(target)):
        log.debug("apply_vit_balance_pass: %s is balanced in place already", target)
        calls = []
    if calls:
        module = gm.get_submodule(target)
        planner, merge = planner_for(module, config)
        for node in calls:
            _rewrite(gm, node, module, planner, merge, config.when, *dist_info)
    regions = vit_subgraph_calls(gm)
    if regions:
        if not isinstance(vit, nn.Module):
            raise ValueError(
                "found a ViT captured by nested_compile_region; pass vit=<the ViT module> "
                "(backend option 'vit') so the pass knows its merge size and cost model"
            )
        planner, merge = planner_for(vit, config)
        call = BalancedCall(
            merge_size=merge,
            planner=planner,
            world_size=dist_info[1],
            group_name=dist_info[0],
            active=in_balancing_mode(vit, config.when),
            module_key=layout_token(vit),
            replicas=dist_info[2],
        )
        for node in regions:
            rewrite_subgraph_call(gm, node, call)
    if calls or regions:
        gm.graph.lint()
        gm.recompile()
    log.debug("apply_vit_balance_pass: balanced %d call(s)", len(calls) + len(regions))
    return gm


def _vit_target(gm: fx.GraphModule, vit: nn.Module | None) -> str | None:
    try:
        vit = vit or find_vit(gm)
    except ValueError:
        return None
    names = [name for name, module in gm.named_modules() if module is vit]
    return names[0] if names and names[0] else None


def _already_balanced(node: fx.Node) -> bool:
    source = node.args[0] if node.args else None
    return (
        isinstance(source, fx.Node)
        and source.target is operator.getitem
        and isinstance(source.args[0], fx.Node)
        and source.args[0].target is _REDISTRIBUTE
    )


def _rewrite(gm, node, module, planner, merge, when, group_name, world_size, replicas) -> None:
    graph = gm.graph
    uses = _index_users(node)
    bound = inspect.signature(unwrap_module(module).forward).bind(*node.args, **node.kwargs)
    pixels_name, grid_name = list(bound.arguments)[:2]
    pixels, grid = bound.arguments[pixels_name], bound.arguments[grid_name]
    may_split = runs_bands(planner)  # ever (the pass runs eagerly); the graph asks each call
    with graph.inserting_before(node):
        # Decided as the graph runs: in eval mode (unless when="always") nothing is collective.
        vit = graph.get_attr(node.target)
        # None on a rank without images, or a bad batch the plan raises on every rank.
        checked = graph.call_function(call_inputs, (vit, pixels, grid, group_name))
        pixels, grid, problem = (
            graph.call_function(operator.getitem, (checked, i)) for i in range(3)
        )
        active = graph.call_function(in_balancing_mode, (vit, when))
        token = graph.call_function(layout_token, (vit,))
        asks = graph.call_function(runs_bands, (planner,)) if may_split else False
        call = BalancedCall(
            merge_size=merge,
            planner=planner,
            world_size=world_size,
            group_name=group_name,
            active=active,
            module_key=token,
            problem=problem,
            replicas=replicas,
            runs_bands=asks,
        )
        pixels_b, grid_b, routing = insert_plan_and_redistribute(graph, pixels, grid, call)
        if may_split:
            split = (routing, grid_b, group_name, asks)
            bands = graph.call_function(bands_for_vit, split)
    bound.arguments[pixels_name] = pixels_b
    bound.arguments[grid_name] = grid_b
    node.args, node.kwargs = bound.args, bound.kwargs
    if may_split:  # as Python on a step that splits a frame; compiled, its tensor form
        node.kwargs = {**node.kwargs, "vitbal_bands": bands}

    deep_keys = sorted(k for k in uses if len(k) == 2)
    with graph.inserting_before(node.next):  # new nodes land in creation order
        items = [graph.call_function(operator.getitem, (node, 0))]
        if deep_keys:
            deep = graph.call_function(operator.getitem, (node, 2))
            items += [graph.call_function(operator.getitem, (deep, k)) for _, k in deep_keys]
        area = merge * merge
        rows_b = graph.call_method("size", (pixels_b, 0))
        layouts = graph.call_function(output_block_rows, (items, rows_b, area))
        rows = graph.call_function(
            home_rows, (layouts, graph.call_method("size", (pixels, 0)), area)
        )
        check_now = graph.call_function(no_backward_will_come, (items,))
        restored = graph.call_function(
            _RESTORE, (items, routing, area, layouts, rows, group_name, True, check_now)
        )
        new = {
            key: graph.call_function(operator.getitem, (restored, i))
            for i, key in enumerate([(0,), *deep_keys])
        }
        if (1,) in uses:
            vit = graph.get_attr(node.target)
            new[(1,)] = graph.call_function(regenerate_window_index, (vit, grid, routing))
    for key, replacement in new.items():
        for old in uses.get(key, []):
            old.replace_all_uses_with(replacement)
            graph.erase_node(old)
    for holder in uses.get((2,), []):
        graph.erase_node(holder)


def _index_users(node: fx.Node) -> dict[tuple[int, ...], list[fx.Node]]:
    """Readers of the ViT output by index: ``(0,)``, ``(1,)``, ``(2, k)`` for ``vis[2][k]`` and
    ``(2,)`` for the ``vis[2]`` list nodes themselves.

    Raises:
        ValueError: any other use of the ViT output.
    """
    found: dict[tuple[int, ...], list[fx.Node]] = {}
    for user in node.users:
        if user.target is not operator.getitem or user.args[1] not in (0, 1, 2):
            raise ValueError(
                f"the ViT output is used by {user.format_node()}; the pass needs vis[0], vis[1] "
                "and vis[2][k] indexing to know which rows each output holds"
            )
        found.setdefault((user.args[1],), []).append(user)
        if user.args[1] != 2:
            continue
        for item in user.users:
            if item.target is not operator.getitem or not isinstance(item.args[1], int):
                raise ValueError(
                    f"the deepstack list is used by {item.format_node()}; index it as vis[2][k]"
                )
            found.setdefault((2, item.args[1]), []).append(item)
    return found
