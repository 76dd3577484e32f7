"""Every collective fx_vitbal issues, in one place: the metadata gathers and the exchanges, and
what the runtime asks of a group (by name, its ranks, where its small gathers live).

One seam, so tests can record the sequence each rank issues (it must be the same on every
rank, step after step, whatever each rank holds) and count the collectives of a step.
"""

import torch
import torch.distributed as dist

from fx_vitbal import _compat


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
    result syncs no device), else the device of the data (``like``), else the device the group
    is bound to, else the current accelerator (else the CPU, if the backend serves it). Never a
    hard-coded ``cuda``."""
    if gathers_on_host(group):
        return torch.device("cpu")
    if like.type != "cpu":
        return like
    bound = getattr(group, "bound_device_id", None)
    if bound is not None:
        return bound
    # A CUDA build on a machine without a GPU still names CUDA: only a usable one counts.
    accelerator = (
        torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    )
    if accelerator is None:
        # A backend that also serves the CPU, on a machine without an accelerator (torch's
        # threaded test process group, say): the data's CPU.
        if "cpu" in dist.Backend.backend_capability.get(str(dist.get_backend(group)), ()):
            return like
        raise ValueError(f"group {group.group_name!r} has no CPU backend and no device was found")
    return torch.device(accelerator.type, torch.accelerator.current_device_index())
