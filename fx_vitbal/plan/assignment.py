"""``Plan.assignment``: the units each rank computes, kept as flat arrays and made into Python
lists rank by rank, on first access.

Why lazy: a rank's step reads only its own list (what it receives, in order) and its own units'
destinations (where it sends them). Building every rank's list costs one tuple per unit on every
rank: 0.8 ms at 2048 ranks with one image each, over a quarter of the seed's whole solve there, for
lists no rank reads but one. Iterating or comparing the whole assignment builds every list once.

Shape suffixes: ``_A`` one entry per unit in assignment order (grouped by the rank computing
it, ``(src, idx)`` order inside), ``_U`` one per unit id (``(src, idx)`` order).
"""

import bisect
from array import array
from collections.abc import Sequence
from itertools import accumulate, chain, repeat

import torch


class Assignment(Sequence):
    """``assignment[d]``: the ``(src_rank, local_idx)`` units rank ``d`` computes, sorted.

    Args:
        ids_A: unit ids (``starts[src] + idx``) grouped by the rank computing them.
        bounds: rank ``d``'s units are ``ids_A[bounds[d]:bounds[d + 1]]``.
        dest_U: the rank computing each unit id.
        src_U: each unit id's home rank (``Units.src_U``).
        starts: rank ``r``'s unit ids are ``starts[r]`` to ``starts[r + 1] - 1``.

    ``ids_A``, ``dest_U`` and ``src_U`` are int64 tensors, or ``array("q")`` for plans made
    without torch (small inputs, ``from_lists``): both slice, and their slices have ``tolist``.
    """

    def __init__(
        self,
        ids_A: torch.Tensor,
        bounds: list[int],
        dest_U: torch.Tensor,
        src_U: torch.Tensor,
        starts: list[int],
    ):
        self._ids_A, self._bounds, self._dest_U = ids_A, bounds, dest_U
        self._src_U, self._starts = src_U, starts
        self._lists: dict[int, list[tuple[int, int]]] = {}
        self._every: list[list[tuple[int, int]]] | None = None

    @classmethod
    def from_lists(cls, lists: Sequence[Sequence[tuple[int, int]]]) -> "Assignment":
        """The assignment of explicit per-rank lists (every unit listed exactly once)."""
        counts = [0] * len(lists)
        for units in lists:
            for src, _ in units:
                counts[src] += 1
        starts = [0, *accumulate(counts)]
        ids = [starts[src] + idx for units in lists for src, idx in units]
        dest = [0] * len(ids)
        for d, units in enumerate(lists):
            for src, idx in units:
                dest[starts[src] + idx] = d
        bounds = [0, *accumulate(map(len, lists))]
        src = chain.from_iterable(map(repeat, range(len(lists)), counts))
        assignment = cls(array("q", ids), bounds, array("q", dest), array("q", src), starts)
        assignment._every = [list(units) for units in lists]
        return assignment

    def __len__(self) -> int:
        return len(self._bounds) - 1

    def __getitem__(self, rank):
        if isinstance(rank, slice) or self._every is not None:
            return self._all()[rank]
        rank = range(len(self))[rank]  # negative indices, and IndexError past the end
        if rank not in self._lists:
            ids = self._ids_A[self._bounds[rank] : self._bounds[rank + 1]].tolist()
            starts = self._starts
            sources = [bisect.bisect_right(starts, u) - 1 for u in ids]
            self._lists[rank] = [(s, u - starts[s]) for s, u in zip(sources, ids, strict=True)]
        return self._lists[rank]

    def __iter__(self):
        return iter(self._all())

    def __eq__(self, other) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return self._all() == [list(units) for units in other]

    __hash__ = None  # mutable lists inside, as a list of lists

    def __repr__(self) -> str:
        return repr(self._all())

    def destinations_of(self, rank: int) -> list[int]:
        """``dest[i]``: the rank computing unit ``i`` of rank ``rank``."""
        return self._dest_U[self._starts[rank] : self._starts[rank + 1]].tolist()

    def _all(self) -> list[list[tuple[int, int]]]:
        """Every rank's list, made by tensor ops (or a pass in Python for arrays) and one pass
        in C."""
        if self._every is None:
            if isinstance(self._ids_A, torch.Tensor):
                src_A = self._src_U.index_select(0, self._ids_A)
                # On the CPU whatever the caller's default device: read long after the solve.
                starts = torch.tensor(self._starts, dtype=torch.int64, device="cpu")
                idx_A = self._ids_A - starts.index_select(0, src_A)
                src_A, idx_A = src_A.tolist(), idx_A.tolist()
            else:
                src_A = list(map(self._src_U.__getitem__, self._ids_A))
                idx_A = [u - self._starts[s] for u, s in zip(self._ids_A, src_A, strict=True)]
            pairs = list(zip(src_A, idx_A, strict=True))
            bounds = self._bounds
            self._every = list(map(pairs.__getitem__, map(slice, bounds, bounds[1:])))
        return self._every
