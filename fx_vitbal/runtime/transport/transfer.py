"""Host <-> device copies that never block the host: pinned memory and ``non_blocking``.

A copy from pageable host memory to a CUDA device waits for the device's stream (it must
finish reading the buffer before Python may reuse it), and so does any read of a device tensor
on the host. Plans, grids and status words therefore travel through pinned buffers: the host
queues the copy and goes on. The caching host allocator keeps a pinned buffer alive until the
copies queued on it have run, so a buffer is never overwritten under a pending copy.

Every host tensor here is made with ``device="cpu"``: a caller's ``torch.set_default_device``
must not move the library's bookkeeping to its device.
"""

import torch


def on_host(tensor: torch.Tensor) -> bool:
    """Whether reading ``tensor``'s values waits for no device. Every branch of the library on
    where a tensor lives asks this, so a test can run the accelerator's branches on the CPU."""
    return tensor.device.type == "cpu"


def to_device(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``values`` (a CPU tensor) on ``device``, queued without waiting (a no-op on the CPU and
    for a tensor already there)."""
    if device.type == "cpu" or values.device == device:
        return values
    return values.pin_memory().to(device, non_blocking=True)


def queues_copies(device: torch.device) -> bool:
    """Whether copies between the host and ``device`` are queued on the device's stream (CUDA),
    so a host buffer must be pinned and read only once an event says the copy landed."""
    return device.type == "cuda"


def copy_event(device: torch.device):
    """An event recorded on ``device``'s current stream, the stream its copies are queued on
    (not the current device's: they differ when a rank's data lives on another GPU than the
    one selected, and an event there could complete before the copy lands)."""
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def wait(event) -> None:
    """Block the host until ``event`` has completed: the one place the library waits for a
    device (``HostCopy.values``), so it can be counted."""
    event.synchronize()


class HostCopy:
    """A device tensor's values on the host, copied without waiting; ``values()`` waits only
    for that copy, and only if it has not landed yet."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._event = None
        if on_host(tensor):
            self._host = tensor
            return
        queued = queues_copies(tensor.device)
        # Pinned memory needs a CUDA host allocator (``is_cuda``); the simulated accelerator of
        # the tests queues copies from the CPU.
        pinned = queued and tensor.is_cuda
        self._host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pinned)
        self._host.copy_(tensor, non_blocking=queued)
        if queued:
            self._event = copy_event(tensor.device)

    def values(self) -> list:
        """The copied values as Python numbers (waits for the copy if it is still queued)."""
        if self._event is not None:
            wait(self._event)
        return self._host.tolist()
