"""Count what a step would cost on an accelerator, on the CPU: collectives per phase, and host
reads of tensors that would live on the device.

``simulated_accelerator()`` runs the library's accelerator branches on CPU tensors. Tensors that
would be on the device are ``OnAccelerator`` (a ``torch.Tensor`` subclass): the inputs the test
passes, whatever the library copies "to the device" (``transfer.to_device``), everything
gathered or exchanged, and what torch ops outside the custom ops compute from them (the ViT's
outputs, say). The group is treated as having no CPU backend (NCCL), so metadata is gathered
"on the device". Every ``.tolist()``, ``.item()``, ``.cpu()``, ``.numpy()``, ``.to("cpu")`` and
``bool``/``int``/``float``/index of such a tensor made by the library's own code (not the ViT's,
the model's or the test's) is a blocking device-to-host read on a GPU, and is recorded with the
line that made it.

The routing tensor is the one output that stays a host tensor: ``vitbal::plan`` makes it on the
CPU by design, so reading it waits for nothing.

Inside a custom op, torch gives subclasses no ``__torch_function__`` (its results are plain
tensors there), so the storage of everything gathered, exchanged or copied to the device is
tracked too: reads of views of it count. What it cannot see: a read, inside a custom op, of a
new tensor the op computed from device tensors.
"""

import contextlib
import os
import sys

import torch
from dist_utils import phase

import fx_vitbal
from fx_vitbal.runtime import collectives, transfer

_LIBRARY = os.path.dirname(fx_vitbal.__file__)
_PASSES = os.path.join(os.path.dirname(_LIBRARY), "passes")
_TORCH = os.path.dirname(torch.__file__)


class OnAccelerator(torch.Tensor):
    """A CPU tensor standing for one on the accelerator (see the module doc)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.vitbal.plan.default:  # its routing is a host tensor by design
            with torch._C.DisableTorchFunctionSubclass():
                grid, routing = func(*args, **(kwargs or {}))
            return grid.as_subclass(cls), routing
        return super().__torch_function__(func, types, args, kwargs)


_READS = ("tolist", "item", "cpu", "numpy", "to", "__bool__", "__int__", "__float__", "__index__")


def _reading(name: str, original):
    """``torch.Tensor.<name>``, recording a library read of a tensor on the "device"."""

    def method(self, *args, **kwargs):
        if _RECORD is not None and _on_device(self) and _reads_host(name, args, kwargs):
            caller = _library_caller()
            if caller is not None:
                _RECORD["reads"].append(caller)
        return original(self, *args, **kwargs)

    return method


def _reads_host(name: str, args, kwargs) -> bool:
    if name != "to":
        return True
    targets = [*args, kwargs.get("device")]
    return any(str(t) == "cpu" or getattr(t, "type", None) == "cpu" for t in targets)


def _on_device(tensor: torch.Tensor) -> bool:
    """An ``OnAccelerator``, or a view of storage the library gathered, exchanged or copied
    to the device (inside a custom op, where views are plain tensors)."""
    if isinstance(tensor, OnAccelerator):
        return True
    pointer = tensor.untyped_storage().data_ptr()
    return bool(pointer) and pointer in _RECORD["storages"]


def _mark(tensor: torch.Tensor) -> None:
    """``tensor``'s storage is on the "device" (kept alive, so no host tensor reuses it)."""
    _RECORD["storages"][tensor.untyped_storage().data_ptr()] = tensor


_RECORD: dict | None = None


def _library_caller() -> str | None:
    """``file:line`` of the first frame outside torch and this module, if it is the library's."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(_TORCH) and name != __file__:
            break
        frame = frame.f_back
    if frame is None:
        return None
    name = frame.f_code.co_filename
    ours = name.startswith(_LIBRARY) or name.startswith(_PASSES)
    if not ours or name.endswith("models.py"):  # the reference ViT is user code
        return None
    return f"{os.path.basename(name)}:{frame.f_lineno}"


def on_accelerator(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as one that would live on the accelerator (same storage)."""
    return tensor.as_subclass(OnAccelerator)


@contextlib.contextmanager
def simulated_accelerator():
    """Yield ``{"reads": [...], "collectives": [(phase, name), ...]}`` for what runs inside."""
    global _RECORD
    record = {"reads": [], "collectives": [], "storages": {}}
    patched = [
        (transfer, "on_host"),
        (transfer, "to_device"),
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
        _mark(output)  # gathered "on the device"

    def exchange(output, input, output_splits, input_splits, group):
        record["collectives"].append((phase(), "all_to_all"))
        all_to_all(output, input, output_splits, input_splits, group)
        _mark(output)

    def copied(values, device):
        moved = to_device(values, device)
        _mark(moved)
        return on_accelerator(moved)

    transfer.on_host = lambda t: not _on_device(t)
    transfer.to_device = copied
    collectives.gathers_on_host = lambda group: False
    collectives.meta_device = lambda group, like: like  # the data's device
    collectives.all_gather, collectives.all_to_all = gather, exchange
    for name in _READS:
        setattr(torch.Tensor, name, _reading(name, getattr(torch.Tensor, name)))
    _RECORD = record
    try:
        yield record
    finally:
        _RECORD = None
        for (owner, name), original in zip(patched, saved, strict=True):
            setattr(owner, name, original)
        del record["storages"]
