"""Count what a step would cost on an accelerator, on the CPU: collectives per phase, host syncs
and host waits on device events.

``simulated_accelerator()`` runs the library's accelerator branches on CPU tensors. A tensor is
"on the device" when its storage is: the inputs the test marks (``record.on_accelerator``),
whatever the library copies "to the device" (``transfer.to_device``), everything gathered or
exchanged, and, followed by a ``TorchDispatchMode`` through every op (the ViT's, the model's,
the backward's, and the ``vitbal`` custom ops' own bodies), whatever any op computes from or
writes with a device tensor. The group is treated as having no CPU backend (NCCL), so metadata
is gathered "on the device".

Recorded, with the library line that caused it (ops called from the ViT's, the model's or the
test's own code are not the library's):

- ``syncs``: what blocks the host on a GPU: an op that reads a device tensor's values on the
  host (``_local_scalar_dense``, which ``.item()``, ``bool()``, ``int()`` and indexing with a
  0-d tensor become), an op whose output size depends on device values (``nonzero``,
  ``masked_select``, ``unique*``, ``repeat_interleave`` without ``output_size``), ``equal`` and
  ``is_nonzero``, a blocking device-to-host ``copy_``, and the host reads that dispatch no op
  (``.tolist()``, ``.numpy()``, ``.cpu()``, ``.to("cpu")``);
- ``waits``: host waits on a device event (``transfer.wait``), which CUDA's sync debug mode does
  not flag;
- ``collectives``: ``(phase, name)`` of each gather and exchange.

A non-blocking device-to-host copy (into pinned memory) is not a sync; its event wait is. The
routing tensor is a host tensor by design (``vitbal::plan`` makes it on the CPU).
"""

import contextlib
import os
import sys

import torch
from dist_utils import phase
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import fx_vitbal
from fx_vitbal.runtime import collectives, ops, planning, transfer

_LIBRARY = os.path.dirname(fx_vitbal.__file__)
_TORCH = os.path.dirname(torch.__file__)
aten = torch.ops.aten

# Ops that read device values on the host, or whose output size depends on them. Inside a
# custom op's body (below autograd) composite ops arrive whole: ``item`` as itself.
_SYNC_OPS = {
    aten._local_scalar_dense.default,
    aten.item.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten.equal.default,
    aten.is_nonzero.default,
    aten._unique.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
}
# The custom ops' Python bodies: run under the mode, so the ops inside them are followed too.
_BODIES = {
    torch.ops.vitbal.plan.default: planning.plan._init_fn,
    torch.ops.vitbal.redistribute.default: ops.redistribute._init_fn,
    torch.ops.vitbal.restore.default: ops.restore._init_fn,
}
_READS = ("tolist", "numpy", "cpu", "to")  # host reads that dispatch no op


class _Event:
    """A device event that has always landed: waiting on it is what is counted."""


class _Simulation(TorchDispatchMode):
    """Follows device tensors through every op and records what would sync (module doc)."""

    def __init__(self) -> None:
        super().__init__()
        self.record = {"syncs": [], "waits": [], "collectives": [], "copies": []}
        # By storage, so views count too; an empty tensor has no storage, so by the tensor
        # itself (the same Python object for every op it reaches). Kept alive: no host tensor
        # reuses a key.
        self._device: dict[object, torch.Tensor] = {}

    def on_accelerator(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``, now counted as living on the device (same storage)."""
        self._device[_key(tensor)] = tensor
        return tensor

    def on_device(self, tensor: torch.Tensor) -> bool:
        return _key(tensor) in self._device

    def note(self, kind: str, what: str, within: str = "") -> None:
        caller = _library_caller(within)
        if caller is not None:
            self.record[kind].append(f"{caller} {what}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        from_device = any(self.on_device(t) for t in tensors)
        if from_device and _syncs(func, args, kwargs):
            self.note("syncs", func.__name__)
        body = _BODIES.get(func)
        if body is not None:  # its own body, followed op by op: its outputs are marked already
            with self:
                return body(*args, **kwargs)
        out = func(*args, **kwargs)
        if not from_device:
            return out
        if func is aten.copy_.default and not self.on_device(args[0]):  # device -> host
            blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
            self.note("syncs" if blocking else "copies", "device-to-host copy")
            return out
        written = [
            a for a, spec in zip(args, func._schema.arguments, strict=False) if _writes(spec)
        ]
        for t in pytree.tree_leaves((out, written)):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.on_accelerator(t)
        return out


def _key(tensor: torch.Tensor) -> object:
    pointer = tensor.untyped_storage().data_ptr()
    return pointer if pointer else ("empty", id(tensor))


def _syncs(func, args, kwargs) -> bool:
    if func in _SYNC_OPS:
        return True
    if func.overloadpacket is aten.repeat_interleave:
        return kwargs.get("output_size") is None
    return False


def _writes(spec) -> bool:
    return spec.alias_info is not None and spec.alias_info.is_write


def _library_caller(within: str = "") -> str | None:
    """``file:line`` of the first frame outside torch, this module and the library file
    ``within``, if it is the library's (the reference ViT in ``tools/models.py`` is user code)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        inside = name.startswith(_TORCH) or name == __file__
        if not inside and not (within and name.endswith(within)):
            break
        frame = frame.f_back
    if frame is None:
        return None
    name = frame.f_code.co_filename
    if not name.startswith(_LIBRARY) or name.endswith("models.py"):
        return None
    return f"{os.path.basename(name)}:{frame.f_lineno}"


def _reading(simulation: _Simulation, name: str, original):
    """``torch.Tensor.<name>``, recording a host read of a device tensor."""

    def method(self, *args, **kwargs):
        to_host = name != "to" or any(
            str(t) == "cpu" or getattr(t, "type", None) == "cpu"
            for t in (*args, kwargs.get("device"))
        )
        if to_host and simulation.on_device(self):
            simulation.note("syncs", f".{name}()")
        return original(self, *args, **kwargs)

    return method


@contextlib.contextmanager
def simulated_accelerator(compiled: bool = False):
    """Yield the simulation: ``.record`` (``syncs``, ``waits``, ``collectives``, ``copies``) for
    what runs inside, ``.on_accelerator(tensor)`` to place a test's input on the device.

    ``compiled``: the step runs graphs compiled beforehand. Dynamo runs a compiled frame eagerly
    while a ``TorchDispatchMode`` is active, so then the mode follows only the ``vitbal`` ops'
    bodies, entered from their kernels: all of the library a compiled graph runs (the
    Python-level reads are counted either way).
    """
    simulation = _Simulation()
    record = simulation.record
    patched = [
        (transfer, "on_host"),
        (transfer, "to_device"),
        (transfer, "queues_copies"),
        (transfer, "copy_event"),
        (transfer, "wait"),
        (collectives, "gathers_on_host"),
        (collectives, "meta_device"),
        (collectives, "all_gather"),
        (collectives, "all_to_all"),
    ] + [(torch.Tensor, name) for name in _READS]
    saved = [getattr(owner, name) for owner, name in patched]
    to_device, all_gather, all_to_all = (
        transfer.to_device,
        collectives.all_gather,
        collectives.all_to_all,
    )

    def gather(output, input, group):
        record["collectives"].append((phase(), "all_gather"))
        all_gather(output, input, group)
        simulation.on_accelerator(output)  # gathered "on the device"

    def exchange(output, input, output_splits, input_splits, group):
        record["collectives"].append((phase(), "all_to_all"))
        all_to_all(output, input, output_splits, input_splits, group)
        simulation.on_accelerator(output)

    transfer.on_host = lambda t: not simulation.on_device(t)
    transfer.to_device = lambda values, device: simulation.on_accelerator(
        to_device(values, device).clone()  # a copy of its own: the host tensor stays host
    )
    transfer.queues_copies = lambda device: True
    transfer.copy_event = lambda device: _Event()
    # Counted where the library asks for the values (``HostCopy.values``'s caller).
    transfer.wait = lambda event: simulation.note("waits", "event wait", within="transfer.py")
    collectives.gathers_on_host = lambda group: False
    collectives.meta_device = lambda group, like: like  # the data's device
    collectives.all_gather, collectives.all_to_all = gather, exchange
    for name in _READS:
        setattr(torch.Tensor, name, _reading(simulation, name, getattr(torch.Tensor, name)))
    kernels = {op: op._backend_fns[None] for op in (planning.plan, ops.redistribute, ops.restore)}
    if compiled:
        for op, kernel in kernels.items():
            op._backend_fns[None] = _followed(simulation, kernel)
    try:
        with contextlib.nullcontext() if compiled else simulation:
            yield simulation
    finally:
        for (owner, name), original in zip(patched, saved, strict=True):
            setattr(owner, name, original)
        for op, kernel in kernels.items():
            op._backend_fns[None] = kernel


def _followed(simulation: _Simulation, kernel):
    """A custom op's kernel that runs under ``simulation``."""

    def run(*args, **kwargs):
        with simulation:
            return kernel(*args, **kwargs)

    return run
