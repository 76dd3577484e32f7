"""Host <-> device copies that never block the host: pinned memory and ``non_blocking``.

A copy from pageable host memory to a CUDA device waits for the device's stream (it must
finish reading the buffer before Python may reuse it), and so does any read of a device tensor
on the host. Plans, grids and status words therefore travel through pinned buffers: the host
queues the copy and goes on. The caching host allocator keeps a pinned buffer alive until the
copies queued on it have run, so a buffer is never overwritten under a pending copy.
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


class HostCopy:
    """A device tensor's values on the host, copied without waiting; ``values()`` waits only
    for that copy, and only if it has not landed yet."""

    def __init__(self, tensor: torch.Tensor) -> None:
        if on_host(tensor):
            self._host, self._event = tensor, None
            return
        cuda = tensor.device.type == "cuda"
        self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=cuda)
        self._host.copy_(tensor, non_blocking=cuda)
        self._event = torch.cuda.Event() if cuda else None
        if self._event is not None:
            self._event.record()

    def values(self) -> list:
        """The copied values as Python numbers (waits for the copy if it is still queued)."""
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()
