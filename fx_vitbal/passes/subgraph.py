"""Balance a ViT that dynamo captured as one ``invoke_subgraph`` node.

A ViT called through ``torch.compiler.nested_compile_region`` (with
``torch._dynamo.config.inline_single_use_invoke_subgraph = False``) reaches a backend as::

    out = invoke_subgraph(subgraph_0, 'subgraph_0', s0, pixel_values, s1, grid_thw, *params)
    embeds, deep0 = out[0], out[1]          # the region's flat outputs (None outputs dropped)

which this rewrites into::

    grid_b, routing = vitbal.plan(pixel_values, grid_thw, ...)
    pixels_b = vitbal.redistribute([pixel_values], routing, ...)[0]
    out = invoke_subgraph(subgraph_0, 'subgraph_0', sym_size(pixels_b, 0), pixels_b,
                          sym_size(grid_b, 0), grid_b, *params)
    embeds, deep0 = vitbal.restore([out[0], out[1]], routing, ...)

Each output's row layout (pre-merger or merged) is read from its traced size against the pixels'
and fixed in the graph.

The region must have been traced with data-dependent batch sizes (``mark_unbacked`` on the
pixel and grid batch dims): sizes specialized to the local batch would be wrong for the balanced
one. Operands are recognized by kind: the one floating-point non-parameter tensor (pixels), the
one integer ``[n, 3]`` tensor (grid), and the size symbols of those two.
"""

import operator

import torch
from torch import fx, nn

from fx_vitbal.runtime.transport.ops import home_rows, no_backward_will_come, output_block_rows
from fx_vitbal.runtime.vit.registry import is_vision_encoder_class
from fx_vitbal.runtime.vit.settings import BalancedCall

_PLAN = torch.ops.vitbal.plan.default
_REDISTRIBUTE = torch.ops.vitbal.redistribute.default
_RESTORE = torch.ops.vitbal.restore.default
_SYM_SIZE = torch.ops.aten.sym_size.int


def insert_plan_and_redistribute(
    graph: fx.Graph, pixels: fx.Node, grid: fx.Node, call: BalancedCall
) -> tuple[fx.Node, fx.Node, fx.Node]:
    """Add ``plan`` and ``redistribute`` at the insertion point; return the balanced pixels,
    the balanced grid and the routing (shared by both kinds of ViT call). ``call``: the call's
    facts (``settings.BalancedCall``), some of them nodes decided as the graph runs (whether
    balancing is active, the ViT's layout token, the batch's problem, whether it runs bands)."""
    plan = graph.call_function(_PLAN, (pixels, grid, *call.op_args()))
    grid_b = graph.call_function(operator.getitem, (plan, 0))
    routing = graph.call_function(operator.getitem, (plan, 1))
    area = call.merge_size * call.merge_size
    moved = graph.call_function(
        _REDISTRIBUTE, ([pixels], routing, area, [area], None, call.group_name)
    )
    return graph.call_function(operator.getitem, (moved, 0)), grid_b, routing


def vit_subgraph_calls(gm: fx.GraphModule) -> list[fx.Node]:
    """``invoke_subgraph`` nodes whose region is a registered ViT, not yet balanced."""
    return [
        node
        for node in gm.graph.nodes
        if node.target is torch.ops.higher_order.invoke_subgraph
        and _is_vit_region(getattr(gm, node.args[0].target))
        and not any(
            a.target is operator.getitem and a.args[0].target is _REDISTRIBUTE
            for a in node.args[2:]
            if isinstance(a, fx.Node)
        )
    ]


def rewrite_subgraph_call(gm: fx.GraphModule, node: fx.Node, call: BalancedCall) -> None:
    """Insert plan -> redistribute before ``node`` and restore after it (see module doc).

    ``call.active`` is decided when the backend compiles: dynamo guards the ViT's training flag,
    so toggling it compiles another graph.

    Raises:
        ValueError: operands or outputs the rewrite cannot place (see module doc).
    """
    graph = gm.graph
    operands = list(node.args[2:])
    pixels, grid = _pixels_and_grid(operands)
    outputs = sorted(node.users, key=lambda user: user.args[1])
    for out in outputs:
        value = out.meta.get("example_value")
        if out.target is not operator.getitem or not (
            isinstance(value, torch.Tensor) and value.is_floating_point()
        ):
            raise ValueError(
                f"the ViT region output {out.format_node()} is not an embedding; window indices "
                "and other outputs need the FX pass on a call_module ViT"
            )
    with graph.inserting_before(node):
        pixels_b, grid_b, routing = insert_plan_and_redistribute(graph, pixels, grid, call)
        sizes = {
            _symbol(pixels): graph.call_function(_SYM_SIZE, (pixels_b, 0)),
            _symbol(grid): graph.call_function(_SYM_SIZE, (grid_b, 0)),
        }
    replaced = {pixels: pixels_b, grid: grid_b}
    node.args = node.args[:2] + tuple(
        replaced.get(a) or sizes.get(_symbol_of_operand(a), a) for a in operands
    )
    area, group_name = call.merge_size * call.merge_size, call.group_name
    pixel_rows = pixels.meta["example_value"].shape[0]
    layouts = output_block_rows([out.meta["example_value"] for out in outputs], pixel_rows, area)
    with graph.inserting_before(outputs[-1].next):  # new nodes land in creation order
        rows = graph.call_function(
            home_rows, (layouts, graph.call_function(_SYM_SIZE, (pixels, 0)), area)
        )
        check_now = graph.call_function(no_backward_will_come, (outputs,))
        restored = graph.call_function(
            _RESTORE, (outputs, routing, area, layouts, rows, group_name, True, check_now)
        )
        items = [graph.call_function(operator.getitem, (restored, i)) for i in range(len(outputs))]
    for out, item in zip(outputs, items, strict=True):
        out.replace_all_uses_with(
            item, delete_user_cb=lambda user: user not in (restored, check_now)
        )


def _is_vit_region(subgraph: nn.Module) -> bool:
    for node in subgraph.graph.nodes:
        for _, cls in (node.meta.get("nn_module_stack") or {}).values():
            if isinstance(cls, type) and is_vision_encoder_class(cls):
                return True
    return False


def _pixels_and_grid(operands: list) -> tuple[fx.Node, fx.Node]:
    tensors = [
        (a, a.meta.get("example_value"))
        for a in operands
        if isinstance(a, fx.Node)
        and isinstance(a.meta.get("example_value"), torch.Tensor)
        and not _is_module_state(a)
    ]
    pixels = [a for a, v in tensors if v.is_floating_point()]
    grids = [a for a, v in tensors if not v.is_floating_point() and v.shape[-1:] == (3,)]
    if len(pixels) != 1 or len(grids) != 1:
        raise ValueError(
            f"the ViT region must take one pixel tensor and one [n, 3] grid besides parameters; "
            f"found {len(pixels)} and {len(grids)}"
        )
    return pixels[0], grids[0]


def _is_module_state(node: fx.Node) -> bool:
    """A parameter or buffer lifted into the graph (dynamo records where inputs came from)."""
    grapharg = node.meta.get("grapharg")
    source = grapharg.source.name if grapharg is not None and grapharg.source else ""
    source = source() if callable(source) else source
    return isinstance(grapharg and grapharg.example, nn.Parameter) or any(
        key in source for key in ("_parameters", "_buffers")
    )


def _symbol(tensor_node: fx.Node) -> str:
    return str(tensor_node.meta["example_value"].shape[0])


def _symbol_of_operand(operand) -> str | None:
    value = operand.meta.get("example_value") if isinstance(operand, fx.Node) else None
    return str(value) if isinstance(value, torch.SymInt) else None
