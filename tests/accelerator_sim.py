"""Count what a step would cost on an accelerator, on the CPU: collectives per phase, host syncs,
host waits, and host tensors mixed with device tensors; the library's apart from the model's.

``simulated_accelerator()`` runs the library's accelerator branches on CPU tensors. A tensor is
"on the device" when its storage is marked: the inputs and modules the test places there
(``on_accelerator``, ``place``), whatever the library copies there (``transfer.to_device``),
everything gathered or exchanged, and, followed by a ``TorchDispatchMode`` through every op (the
ViT's, the model's, the backward's, and the ``vitbal`` custom ops' own bodies), whatever an op
computes from device tensors or makes on the device. Marked tensors report the simulated device
``DEVICE`` (``cpu:1``) as their ``.device``, so code that places a tensor "where that one is"
(``torch.zeros(..., device=x.device)``, ``y.to(x.device)``) is seen doing so, and a copy
between the host and the device is seen as one. The group is treated as having no CPU backend
(NCCL), so metadata is gathered "on the device", unless ``gloo=True`` (a ``cpu:gloo,cuda:nccl``
group: metadata on the host, exchanges on the device).

Recorded, each with the line that caused it: under ``syncs``, ``waits``, ``mixed`` and
``copies`` when that line is the library's (``fx_vitbal``, but for the reference models in
``fx_vitbal/tools``), under ``model_syncs`` (and so on) when it is anyone else's (the ViT, a
Hugging Face tower or parent, the replayed feature code, the test's own code):

- ``syncs``, what blocks the host on a GPU: an op that reads a device tensor's values on the
  host (``_local_scalar_dense``, which ``.item()``, ``bool()``, ``int()``, ``float()`` and
  indexing with a 0-d tensor become; ``allclose``, ``equal``, ``is_nonzero``), an op whose
  output size depends on device values (``nonzero``, ``masked_select``, ``unique*``,
  ``bincount``, ``histc``, ``repeat_interleave`` without ``output_size``, indexing or
  assignment with a boolean mask), a blocking copy either way (``copy_``, ``.to()``,
  ``.type()``, ``.cpu()``, ``torch.tensor(..., device=)``, ``new_tensor``), a tensor built from
  device values (``torch.tensor([t0, t1])``), and the host reads that dispatch no op
  (``.tolist()``, ``.numpy()``);
- ``waits``: host waits on the device: an event the library waits for (``transfer.wait``),
  ``torch.cuda.synchronize``, ``torch.accelerator.synchronize``, a stream's or an event's
  ``synchronize`` (CUDA's sync debug mode flags none of these);
- ``mixed``: an op given both device tensors and host tensors with dimensions (0-d host
  tensors are scalars, which CUDA kernels take): on a GPU an error, or for an index a blocking
  copy to the device;
- ``copies``: non-blocking copies (queued; their event wait is what may block);
- ``collectives``: ``(phase, name)`` of each gather and exchange the library issues.

What it cannot see: work inside a compiled graph (only the ``vitbal`` ops' bodies are followed
there, ``compiled=True``); tensors made on ``x.device.type`` (a string: "cpu" here, "cuda"
there); C++ code that reads a device tensor without dispatching an op; and time (a
non-blocking copy is counted, not timed).
"""

import contextlib
import os
import sys

import torch
from dist_utils import phase
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import fx_vitbal
from fx_vitbal.runtime.agree import planning
from fx_vitbal.runtime.bands import exchange as band_exchange
from fx_vitbal.runtime.bands import view as bands
from fx_vitbal.runtime.transport import collectives, ops, transfer

DEVICE = torch.device("cpu", 1)
_LIBRARY = os.path.dirname(fx_vitbal.__file__)
_TOOLS = os.path.join(_LIBRARY, "tools")
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
    aten.allclose.default,
    aten.bincount.default,
    aten.histc.default,
    aten._unique.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
}
_REPEAT_BY_INT = aten.repeat_interleave.self_int
_INDEX_OPS = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default}
_COPIES = {aten._to_copy.default, aten.copy_.default}
# The custom ops' Python bodies: run under the mode, so the ops inside them are followed too.
_BODIES = {
    torch.ops.vitbal.plan.default: planning.plan._init_fn,
    torch.ops.vitbal.redistribute.default: ops.redistribute._init_fn,
    torch.ops.vitbal.restore.default: ops.restore._init_fn,
    torch.ops.vitbal.band_gather.default: band_exchange.band_gather._init_fn,
    torch.ops.vitbal.band_scatter.default: band_exchange.band_scatter._init_fn,
    torch.ops.vitbal.band_tables.default: bands.band_tables._init_fn,
}
_DEVICE_PROPERTY = torch._C.TensorBase.device


class _Event:
    """A device event that has always landed: waiting on it is what is counted."""


class _Simulation(TorchDispatchMode):
    """Follows device tensors through every op and records what would sync (module doc)."""

    def __init__(self) -> None:
        super().__init__()
        self.record = {
            kind: []
            for kind in ("syncs", "waits", "mixed", "collectives", "copies")
            + ("model_syncs", "model_waits", "model_mixed", "model_copies")
        }
        # By storage, so views count too; an empty tensor has no storage, so by the tensor
        # itself (the same Python object for every op it reaches). Kept alive: no host tensor
        # reuses a key.
        self._device: dict[object, torch.Tensor] = {}

    def on_accelerator(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``, now counted as living on the device (same storage)."""
        self._device[_key(tensor)] = tensor
        return tensor

    def place(self, module: torch.nn.Module) -> torch.nn.Module:
        """``module`` with its parameters, their gradients and its buffers on the device (in
        place, no copy)."""
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        for tensor in [*module.parameters(), *grads, *module.buffers()]:
            self.on_accelerator(tensor)
        return module

    def on_device(self, tensor: torch.Tensor) -> bool:
        return _key(tensor) in self._device

    def note(self, kind: str, what: str, within: str = "") -> None:
        who, where = _caller(within)
        self.record[kind if who == "library" else f"model_{kind}"].append(f"{where} {what}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        on_device = [self.on_device(t) for t in tensors]
        from_device = any(on_device)
        target = kwargs.get("device")
        target = None if target is None else torch.device(target)
        # A backward formula's own ops (C++, called by the autograd engine) work where the
        # gradients are, on the device; their buffers are made on the CPU here, some unseen.
        engine = phase() == "backward" and _issued_by_torch()
        if engine:
            if from_device and _syncs(func, args, kwargs):
                self.note("syncs", func.__name__)
        elif func in _COPIES:
            self._copy(func, args, kwargs, target)
        elif from_device:
            if _syncs(func, args, kwargs):
                self.note("syncs", func.__name__)
            host = [t for t, dev in zip(tensors, on_device, strict=True) if not dev and t.dim()]
            if host and func not in _BODIES:  # (their routing and band layouts: host tensors)
                self.note("mixed", f"{func.__name__} with a host tensor of {tuple(host[0].shape)}")
        body = _BODIES.get(func)
        if body is not None:  # its own body, followed op by op: its outputs are marked already
            with self:
                return body(*args, **kwargs)
        out = func(*args, **kwargs)
        made_here = target == DEVICE or engine
        if not (made_here or (from_device and (target is None or target == DEVICE))):
            return out
        if func is aten.copy_.default and not (engine or self.on_device(args[0])):  # host
            return out
        written = [
            a for a, spec in zip(args, func._schema.arguments, strict=False) if _writes(spec)
        ]
        for t in pytree.tree_leaves((out, written)):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.on_accelerator(t)
        return out

    def _copy(self, func, args, kwargs, target) -> None:
        """Record a copy between the host and the device (``_to_copy`` or ``copy_``)."""
        if func is aten.copy_.default:
            dst, src = args[0], args[1]
            blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
            to_device, to_host = self.on_device(dst), self.on_device(src)
            if to_device == to_host:
                return
        else:
            blocking = not kwargs.get("non_blocking", False)
            src_on_device = self.on_device(args[0])
            to_device = not src_on_device and target == DEVICE
            to_host = src_on_device and target is not None and target != DEVICE
            if not (to_device or to_host):
                return
        what = "host-to-device copy" if to_device else "device-to-host copy"
        self.note("syncs" if blocking else "copies", what)


def _key(tensor: torch.Tensor) -> object:
    pointer = tensor.untyped_storage().data_ptr()
    return pointer if pointer else ("empty", id(tensor))


def _syncs(func, args, kwargs) -> bool:
    if func in _SYNC_OPS:
        return True
    if func.overloadpacket is aten.repeat_interleave and func is not _REPEAT_BY_INT:
        return kwargs.get("output_size") is None  # repeats in a tensor: their sum sizes it
    if func in _INDEX_OPS:  # a boolean mask: its True count sizes the result
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices or ())
    return False


def _writes(spec) -> bool:
    return spec.alias_info is not None and spec.alias_info.is_write


def _issued_by_torch() -> bool:
    """Whether the op being dispatched comes from torch itself with no Python code of anyone's
    between (the autograd engine running a C++ formula), not from Python code (a custom op's
    backward, the library's or the model's own)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back
    return frame is None or frame.f_code.co_filename.startswith(_TORCH)


def _caller(within: str = "") -> tuple[str, str]:
    """``(who, "file:line")`` of the first frame outside torch, this module and the file
    ``within``: who is ``library`` for fx_vitbal's own code (not the reference models in
    ``fx_vitbal/tools``), else ``model``."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        inside = name.startswith(_TORCH) or name == __file__
        if not inside and not (within and name.endswith(within)):
            break
        frame = frame.f_back
    if frame is None:
        return "model", "torch"
    name = frame.f_code.co_filename
    library = name.startswith(_LIBRARY) and not name.startswith(_TOOLS)
    return ("library" if library else "model"), f"{os.path.basename(name)}:{frame.f_lineno}"


def _device_of(value) -> torch.device | None:
    """The device a ``.to()`` argument names (a device, its name, or a tensor's), else None."""
    if isinstance(value, torch.Tensor):
        return value.device  # the patched property: the simulated device for device tensors
    if isinstance(value, (str, torch.device)):
        try:
            return torch.device(value)
        except RuntimeError:  # a dtype's name, say
            return None
    return None


@contextlib.contextmanager
def simulated_accelerator(compiled: bool = False, gloo: bool = False):
    """Yield the simulation: ``.record`` (module doc) for what runs inside, ``on_accelerator``
    and ``place`` to put a test's inputs and modules on the device.

    ``compiled``: the step runs graphs compiled beforehand. Dynamo runs a compiled frame eagerly
    while a ``TorchDispatchMode`` is active, so then the mode follows only the ``vitbal`` ops'
    bodies, entered from their kernels: all of the library a compiled graph runs (the
    Python-level reads are counted either way). ``gloo``: the group also has a CPU backend.
    """
    simulation = _Simulation()
    record = simulation.record
    all_gather, all_to_all = collectives.all_gather, collectives.all_to_all
    send_receive_ = collectives.send_receive
    tensor, as_tensor = torch.tensor, torch.as_tensor
    methods = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy", "cpu", "to")}
    new_tensor = torch.Tensor.new_tensor

    def gather(output, input, group):
        record["collectives"].append((phase(), "all_gather"))
        all_gather(output, input, group)
        if not gloo:
            simulation.on_accelerator(output)  # gathered "on the device"

    def exchange(output, input, output_splits, input_splits, group):
        record["collectives"].append((phase(), "all_to_all"))
        all_to_all(output, input, output_splits, input_splits, group)
        simulation.on_accelerator(output)

    def send_receive(messages, group):
        if messages:  # a rank with no band of a split frame posts nothing
            record["collectives"].append((phase(), "p2p"))
        works = send_receive_(messages, group)
        for send, buffer, _, _ in messages:
            if not send:
                simulation.on_accelerator(buffer)  # received "on the device"
        return works

    def device(self):
        return DEVICE if simulation.on_device(self) else _DEVICE_PROPERTY.__get__(self)

    def read(name):
        def method(self, *args, **kwargs):
            if simulation.on_device(self):
                simulation.note("syncs", f".{name}()")
            return methods[name](self, *args, **kwargs)

        return method

    def to(self, *args, **kwargs):
        targets = [_device_of(a) for a in (*args, kwargs.get("device"))]
        host = next((d for d in targets if d is not None), None) == torch.device("cpu")
        seen = len(record["syncs"]) + len(record["model_syncs"])
        out = methods["to"](self, *args, **kwargs)
        # To the host from a device tensor: the dispatcher sees no copy (it is on the CPU).
        if (
            host
            and simulation.on_device(self)
            and seen == len(record["syncs"]) + len(record["model_syncs"])
        ):
            blocking = not kwargs.get("non_blocking", False)
            simulation.note("syncs" if blocking else "copies", "device-to-host copy (.to)")
        return out

    def built(make):
        def build(data, *args, **kwargs):
            leaves = [x for x in pytree.tree_leaves(data) if isinstance(x, torch.Tensor)]
            if any(simulation.on_device(x) for x in leaves):
                simulation.note("syncs", f"torch.{make.__name__} of device values")
            out = make(data, *args, **kwargs)
            if _device_of(kwargs.get("device")) == DEVICE:
                simulation.note("syncs", f"host-to-device copy (torch.{make.__name__})")
                simulation.on_accelerator(out)
            return out

        return build

    def new_from(self, data, *args, **kwargs):
        out = new_tensor(self, data, *args, **kwargs)
        if _device_of(kwargs.get("device")) == DEVICE or (
            "device" not in kwargs and simulation.on_device(self)
        ):
            simulation.note("syncs", "host-to-device copy (new_tensor)")
            simulation.on_accelerator(out)
        return out

    def waiting(what):
        return lambda *args, **kwargs: simulation.note("waits", what)

    patches = {
        (transfer, "on_host"): lambda t: not simulation.on_device(t),
        (transfer, "to_device"): lambda values, device: (
            # A copy of its own: the host tensor stays on the host.
            simulation.on_accelerator(values.clone()) if device == DEVICE else values
        ),
        (transfer, "queues_copies"): lambda device: True,
        (transfer, "copy_event"): lambda device: _Event(),
        # Counted where the library asks for the values (``HostCopy.values``'s caller).
        (transfer, "wait"): lambda event: simulation.note("waits", "event wait", "transfer.py"),
        (collectives, "gathers_on_host"): lambda group: gloo,
        (collectives, "meta_device"): lambda group, like: torch.device("cpu") if gloo else like,
        (collectives, "exchange_device"): lambda group: DEVICE,
        (collectives, "all_gather"): gather,
        (collectives, "all_to_all"): exchange,
        (collectives, "send_receive"): send_receive,
        (torch.Tensor, "device"): property(device),
        (torch.Tensor, "tolist"): read("tolist"),
        (torch.Tensor, "numpy"): read("numpy"),
        (torch.Tensor, "cpu"): read("cpu"),
        (torch.Tensor, "to"): to,
        (torch.Tensor, "new_tensor"): new_from,
        (torch, "tensor"): built(tensor),
        (torch, "as_tensor"): built(as_tensor),
        (torch.cuda, "synchronize"): waiting("torch.cuda.synchronize"),
        (torch.cuda.Event, "synchronize"): waiting("event synchronize"),
        (torch.cuda.Stream, "synchronize"): waiting("stream synchronize"),
    }
    if hasattr(torch, "accelerator") and hasattr(torch.accelerator, "synchronize"):
        patches[(torch.accelerator, "synchronize")] = waiting("torch.accelerator.synchronize")
    saved = {key: vars(key[0]).get(key[1], getattr(key[0], key[1])) for key in patches}
    for (owner, name), value in patches.items():
        setattr(owner, name, value)
    kernels = {op: op._backend_fns[None] for op in (planning.plan, ops.redistribute, ops.restore)}
    if compiled:
        for op, kernel in kernels.items():
            op._backend_fns[None] = _followed(simulation, kernel)
    try:
        with contextlib.nullcontext() if compiled else simulation:
            yield simulation
    finally:
        for (owner, name), original in saved.items():
            if owner is torch.Tensor and name == "device":
                delattr(torch.Tensor, "device")  # the C property shows through again
            else:
                setattr(owner, name, original)
        for op, kernel in kernels.items():
            op._backend_fns[None] = kernel


def _followed(simulation: _Simulation, kernel):
    """A custom op's kernel that runs under ``simulation``. The tensors a compiled graph hands
    it are on the device (the graph ran from device inputs, unfollowed), but for the routing,
    which the library keeps on the host by design."""

    def run(*args, **kwargs):
        for tensor in pytree.tree_leaves(args[0]):
            if isinstance(tensor, torch.Tensor):
                simulation.on_accelerator(tensor)
        with simulation:
            return kernel(*args, **kwargs)

    return run
