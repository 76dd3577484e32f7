"""Every collective fx_vitbal issues, in one place: the metadata gathers and the exchanges.

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
