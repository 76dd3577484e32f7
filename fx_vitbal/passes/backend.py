"""The ``vitbal`` torch.compile backend: balance the ViT, then hand the graph to a real compiler.

Registered through the ``torch_dynamo_backends`` entry point (see pyproject.toml), so
``torch.compile(model, backend="vitbal")`` works once the package is installed.

Where the balancing ops come from, per graph dynamo hands us:
- a model wrapped by ``enable_vit_balance``: dynamo traces the wrapper, so ``vitbal::*`` ops are
  already in the graph (or, by default, dynamo breaks the graph at them and runs them between
  compiled graphs, which also keeps the ViT compiled with ordinary shapes);
- a graph that still calls the ViT as a ``call_module`` leaf (a GraphModule handed to this
  backend directly), or a ViT marked with ``torch.compiler.nested_compile_region`` that dynamo
  captured as one ``invoke_subgraph`` node (pass ``options={"vit": model.visual}``):
  ``apply_vit_balance_pass`` rewrites it here.

A graph that holds ``vitbal`` ops with data-dependent sizes can only compile when the shape
environment allows dynamic output shapes. If it does not, AOTAutograd would fail, dynamo would
fall back to running the frame eagerly, and a graph this backend rewrote would then run *without*
balancing while still giving plausible results. The backend raises instead.
"""

import inspect
import linecache
import logging
import re
import sys

import torch
from torch import fx

from fx_vitbal import _compat
from fx_vitbal.config import BalanceConfig
from fx_vitbal.passes.vit_balance import apply_vit_balance_pass
from fx_vitbal.runtime.vit.registry import entry_points, registered_vision_encoders

log = logging.getLogger(__name__)

VITBAL_OPS = (
    torch.ops.vitbal.plan.default,
    torch.ops.vitbal.redistribute.default,
    torch.ops.vitbal.restore.default,
)


def make_vitbal_backend(
    *,
    inner: str = "inductor",
    config: BalanceConfig | None = None,
    group=None,
    replica_group=None,
    vit=None,
):
    """A ``torch.compile`` backend balancing the ViT and delegating to the ``inner`` backend.

    Args:
        inner: any registered backend name (``inductor``, ``aot_eager``, ...).
        config, group, replica_group, vit: passed to ``apply_vit_balance_pass``.
    """

    def backend(gm: fx.GraphModule, example_inputs, **kwargs):
        return vitbal_backend(
            gm,
            example_inputs,
            inner=inner,
            config=config,
            group=group,
            replica_group=replica_group,
            vit=vit,
            **kwargs,
        )

    return backend


def vitbal_backend(
    gm: fx.GraphModule,
    example_inputs,
    *,
    inner: str = "inductor",
    config: BalanceConfig | None = None,
    group=None,
    replica_group=None,
    vit=None,
    options: dict | None = None,
    **kwargs,
):
    """``torch.compile(model, backend="vitbal", options={"inner": "aot_eager"})``.

    ``options`` may carry ``inner``, ``config``, ``group``, ``replica_group`` and ``vit`` (the
    ViT module, needed to balance a ViT marked with ``nested_compile_region``); the rest goes to
    the inner backend (for
    inductor, as config patches, with ``torch.compile``'s ``mode``: ``mode="reduce-overhead"``
    is ``triton.cudagraphs``). A graph with balancing ops compiled by inductor gets the
    settings this torch needs for them (``_compat.INDUCTOR_CONFIG_PATCHES``), unless the options
    say otherwise.

    Raises:
        RuntimeError: the graph holds balancing ops but cannot compile them (see module doc).
    """
    options = dict(options or {})
    inner = options.pop("inner", inner)
    config = options.pop("config", config)
    group = options.pop("group", group)
    replica_group = options.pop("replica_group", replica_group)
    vit = options.pop("vit", vit)
    before = _count_ops(gm)
    apply_vit_balance_pass(gm, config=config, group=group, replica_group=replica_group, vit=vit)
    added = _count_ops(gm) - before
    if added:
        _require_dynamic_output_shapes(example_inputs)
    if not before + added:
        _refuse_unbalanced_vit(gm)
    log.debug("vitbal backend: %d balancing op(s) traced, %d inserted", before, added)
    compile_fn = torch._dynamo.lookup_backend(inner)
    if inner == "inductor":  # a mode and options are config patches, after what balancing needs
        needed = _compat.INDUCTOR_CONFIG_PATCHES if before + added else {}
        mode = kwargs.pop("mode", None)
        mode = torch._inductor.list_mode_options(mode) if mode else {}  # None: every mode's
        options = {**needed, **mode, **kwargs.pop("config_patches", {}), **options}
        if options:
            kwargs["config_patches"] = options
    elif options:
        kwargs["options"] = options
    return compile_fn(gm, example_inputs, **kwargs)


def _count_ops(gm: fx.GraphModule) -> int:
    return sum(1 for node in gm.graph.nodes if node.target in VITBAL_OPS)


def _refuse_unbalanced_vit(gm: fx.GraphModule) -> None:
    """Raise if dynamo compiled a known ViT outside the in-place wrappers: the ``forward`` of a
    registered class, or a Hugging Face parent's ``get_image_features`` / ``get_video_features``
    for a supported tower (a wrapped parent never calls them; its towers graph-break inside, so
    their own frames cannot be told apart).

    Nodes are attributed by their stack traces: a frame's own module never appears in its module
    stack. The wrappers run the ViT from their entry points' files (``fx_vitbal/encoder.py``,
    ``integrations/hf.py``: ``runtime.vit.registry.entry_points``), so a node with such a frame and
    none of those files was never wrapped. (ViTs nobody registered cannot
    be recognized, and are not refused.) A ViT that breaks its own graph (windows read on the
    host, a band exchange without ``fullgraph``) is run between graphs by its balanced caller,
    and dynamo compiles its ``forward`` as a frame of its own, with no caller in the traces: it
    is recognized by the balanced call on the live stack while dynamo compiles
    (``_inside_balanced_call``).
    """
    wrappers = [entry.source_file for entry in entry_points()]
    if _inside_balanced_call(wrappers):
        return
    forwards, hf_files = _vit_code()
    for node in gm.graph.nodes:
        trace = node.meta.get("stack_trace") or ""
        if not trace or any(file in trace for file in wrappers):
            continue
        for file, line, function in _FRAME.findall(trace):
            name = next((n for f, a, b, n in forwards if f == file and a <= int(line) <= b), None)
            if name is None and file in hf_files and "_features" in function:
                name = f"{hf_files[file]} (through {function})"
            if name is not None:
                raise RuntimeError(
                    f"vitbal: the vision encoder {name} was compiled without balancing; wrap the "
                    "model with fx_vitbal.enable_vit_balance(model) first, or compile an FX graph "
                    "rewritten by apply_vit_balance_pass"
                )


def _inside_balanced_call(wrappers: list[str]) -> bool:
    """Whether the frame dynamo compiles now runs inside a balanced ViT call: a live frame in an
    entry point's file, or of an FX graph's code the pass rewrote (FX keeps that source in
    ``linecache``)."""
    frame = sys._getframe()
    while frame is not None:
        file = frame.f_code.co_filename
        if file in wrappers:
            return True
        if file.startswith("<eval_with_key>") and "vitbal.restore" in "".join(
            linecache.getlines(file)
        ):
            return True
        frame = frame.f_back
    return False


_FRAME = re.compile(r'File "(.+?)", line (\d+), in (\w+)')


def _vit_code() -> tuple[list[tuple[str, int, int, str]], dict[str, str]]:
    """``(file, first line, last line, class name)`` of each registered ViT's ``forward``, and
    the files of the ViT classes the entry points know (Hugging Face towers) -> class name."""
    forwards = []
    for cls in registered_vision_encoders():
        forward = inspect.unwrap(cls.forward)
        lines, first = inspect.getsourcelines(forward)
        last = first + len(lines) - 1
        forwards.append((inspect.getsourcefile(forward), first, last, cls.__qualname__))
    known = {}
    for entry in entry_points():
        known.update(entry.vit_code())
    return forwards, known


def _require_dynamic_output_shapes(example_inputs) -> None:
    fake_mode = torch._guards.detect_fake_mode(example_inputs)
    shape_env = getattr(fake_mode, "shape_env", None)
    if shape_env is not None and not shape_env.allow_dynamic_output_shape_ops:
        raise RuntimeError(
            "vitbal: this graph balances the ViT with data-dependent sizes but the shape "
            "environment forbids them; compile with fullgraph=True or set "
            "torch._dynamo.config.capture_dynamic_output_shape_ops = True"
        )
