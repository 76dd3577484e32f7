"""How rows are laid out: pixel dtypes that travel, values per row, and rows cut into merge blocks.

A unit (one grid row, or one frame of it) owns ``t*h*w`` consecutive pixel rows, and
``t*h*w / shrink`` consecutive rows of an output that shrinks rows by ``shrink`` (4 for a 2x2
patch merger). Pre-merger and merged outputs line up unit by unit once cut into merge blocks
(``as_blocks``).
"""

from collections.abc import Sequence

import torch

# Dtypes a pixel tensor may have; the index is what travels in the metadata header.
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def row_numel(x: torch.Tensor) -> int:
    """Values per row of ``x`` (the product of its trailing dims)."""
    numel = 1
    for size in x.shape[1:]:
        numel *= size
    return numel


def with_dummy(xs: Sequence[torch.Tensor], rows: int, add: bool) -> list[torch.Tensor]:
    """Append ``rows`` zero rows to each tensor (``add``) or drop its last ``rows`` rows."""
    if not rows:
        return list(xs)
    if add:
        return [torch.cat([x, x.new_zeros(rows, *x.shape[1:])]) for x in xs]
    return [x[: x.shape[0] - rows] for x in xs]


def as_blocks(x: torch.Tensor, block_rows: int) -> torch.Tensor:
    """``x`` as one row per merge block, ``[rows / block_rows, block_rows * row numel]`` (a view
    when ``x`` is contiguous): pre-merger and merged outputs then line up unit by unit."""
    if block_rows < 1 or x.shape[0] % block_rows:
        raise ValueError(f"{tuple(x.shape)} cannot be cut into blocks of {block_rows} rows")
    return x.reshape(x.shape[0] // block_rows, block_rows * row_numel(x))


def from_blocks(blocks: torch.Tensor, like: torch.Tensor, block_rows: int) -> torch.Tensor:
    """Inverse of ``as_blocks``: rows of ``like``'s trailing shape."""
    return blocks.reshape(blocks.shape[0] * block_rows, *like.shape[1:])
