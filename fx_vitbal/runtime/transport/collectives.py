"""Every collective fx_vitbal issues, in one place: the metadata gathers and the exchanges, and
what the runtime asks of a group (by name, its ranks, where its small gathers live).

One seam, so tests can record the sequence each rank issues (it must be the same on every
rank, step after step, whatever each rank holds) and count the collectives of a step.
"""

import functools
import logging

import torch
import torch.distributed as dist

from fx_vitbal import _compat

log = logging.getLogger(__name__)


def all_gather(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Gather ``input`` from every rank into ``output`` (rank-major, flat)."""
    _compat.all_gather_single(output, input, group)


def all_to_all(
    output: torch.Tensor,
    input: torch.Tensor,
    output_splits: list[int],
    input_splits: list[int],
    group: dist.ProcessGroup,
) -> None:
    """``all_to_all_single`` along dim 0: ``input_splits[r]`` rows to rank ``r``,
    ``output_splits[r]`` rows from it."""
    dist.all_to_all_single(output, input, output_splits, input_splits, group=group)


def send_receive(
    messages: list[tuple[bool, torch.Tensor, int, int]], group: dist.ProcessGroup
) -> list:
    """Post point-to-point ``messages`` (``(send, tensor, peer, tag)``: a send, else a receive
    into ``tensor``; peers as ranks of ``group``) as one batch, in order; returns the works to
    wait for. No message posts nothing: a rank outside every exchange of a step stays out of
    it (the exchanges of bands run among a frame's ranks only, ``bands.p2p``)."""
    ops = [
        dist.P2POp(dist.isend if send else dist.irecv, tensor, _global(group, peer), group, tag)
        for send, tensor, peer, tag in messages
    ]
    return dist.batch_isend_irecv(ops) if ops else []


def _global(group: dist.ProcessGroup, peer: int) -> int:
    return dist.get_global_rank(group, peer)


def resolve_group(group_name: str) -> dist.ProcessGroup:
    """The process group registered under ``group_name``."""
    return dist.distributed_c10d._resolve_process_group(group_name)


def group_ranks(group: dist.ProcessGroup) -> tuple[int, ...]:
    """The global ranks of ``group``, in group order (what its agreed layouts are kept by)."""
    return tuple(dist.get_process_group_ranks(group))


def gathers_on_host(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` has a CPU backend (gloo): metadata gathered there is read without
    waiting for any device."""
    return "gloo" in str(dist.get_backend(group))


def meta_device(group: dist.ProcessGroup, like: torch.device) -> torch.device:
    """Where metadata is gathered: the CPU when the group has a CPU backend (gloo: reading the
    result syncs no device), else the device of the data (``like``), else ``exchange_device``'s.
    Never a hard-coded ``cuda``."""
    if gathers_on_host(group):
        return torch.device("cpu")
    if like.type != "cpu":
        return like
    return exchange_device(group)


def exchange_device_types(group: dist.ProcessGroup) -> frozenset[str] | None:
    """The device types whose tensors ``group`` can exchange (``all_to_all``), or None when its
    backend does not say (a test backend): ``cpu:gloo,cuda:nccl`` both, gloo the CPU alone (it
    has no device ``all_to_all``), others what ``dist.Backend.backend_capability`` lists."""
    backend = str(dist.get_backend(group))
    if ":" in backend:  # "cpu:gloo,cuda:nccl"
        return frozenset(pair.split(":")[0] for pair in backend.split(","))
    if backend == "gloo":
        return frozenset({"cpu"})
    listed = dist.Backend.backend_capability.get(backend)
    return frozenset(listed) if listed else None


def exchange_device(group: dist.ProcessGroup | None) -> torch.device:
    """The device a rank's exchanges on ``group`` (default WORLD) run on when no tensor of its
    own says (a rank without images; pixels still on the host): the device the group is bound
    to; else, unless the group is gloo alone (host tensors only), the current accelerator's
    (``_current_device``); else the CPU, if the backend serves it."""
    group = group or dist.group.WORLD
    bound = getattr(group, "bound_device_id", None)
    if bound is not None:
        return bound
    backend = str(dist.get_backend(group))
    # A CUDA build on a machine without a GPU still names CUDA: only a usable one counts.
    accelerator = (
        torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    )
    if accelerator is not None and backend != "gloo":
        return _current_device(accelerator.type)
    if backend == "gloo" or "cpu" in dist.Backend.backend_capability.get(backend, ()):
        return torch.device("cpu")
    raise ValueError(f"group {group.group_name!r} has no CPU backend and no device was found")


def _current_device(kind: str) -> torch.device:
    """The current accelerator device, or, where nothing chose one yet (the accelerator is not
    initialised: every rank would name device 0), the one torch's ``DeviceMesh`` and NCCL pick
    then: global rank modulo the devices on the host (homogeneous hosts), with a warning."""
    module = torch.get_device_module(kind)
    initialised = getattr(module, "is_initialized", lambda: True)()
    if initialised:
        return torch.device(kind, torch.accelerator.current_device_index())
    index = dist.get_rank() % max(1, torch.accelerator.device_count())
    _warn_device_not_set(kind, index)
    return torch.device(kind, index)


@functools.cache
def _warn_device_not_set(kind: str, index: int) -> None:
    log.warning(
        "vit dp balance: no %s device was selected for this process (call torch.%s.set_device "
        "before the first step, or pass device_id to init_process_group); balancing uses "
        "%s:%d, global rank modulo the devices on the host, as torch's DeviceMesh does",
        kind,
        kind,
        kind,
        index,
    )
