"""The planner's data: the flat unit arrays (torch tensors for large inputs, Python lists for
small ones), the integer fixed-point costs every decision is made in, and the ``Plan`` every
rank gets.

Shape suffixes: ``_U`` one entry per unit (all ranks' units, rank by rank), ``_R`` one per rank.

Why two executions: a torch op costs 2-8 us whatever its size (70-190 us for the first one after
a garbage collection), and planning by tensor ops runs about 250 of them, a floor of 2-3 ms that
plain Python over lists undercuts below a few thousand units. ``Units.small`` (``SMALL_UNITS``)
says which one runs; the steps that have both (here, ``shed``, ``candidates``) keep them side by
side, every other step is the same Python for both, and ``test_planner`` proves that the two
give the same plans, bit for bit.

Why fixed point: every rank must reach the same plan. Integer sums are exact, so they do not
depend on the order a reduction runs in (thread count, vector width), and a running sum equals a
fresh one: a plan's loads are kept up to date move by move and never summed again. The floats a
``Plan`` reports are summed separately, rank by rank in unit order (``sequential_sums``).
"""

import dataclasses
import functools
import math
import operator
from array import array
from collections import deque
from collections.abc import Sequence
from functools import reduce
from itertools import accumulate, chain, compress, pairwise, repeat

import torch

from fx_vitbal.plan.assignment import Assignment


def unit_rows(unit: Sequence[int]) -> int:
    """Pixel rows of a unit ``(t, h, w)`` or a band (``plan.bands.Band``)."""
    return unit[0] * unit[1] * unit[2]


def is_band(unit: Sequence[int]) -> bool:
    """Whether a unit is a band of a frame (``plan.bands.Band``: five fields) rather than a
    whole unit ``(t, h, w)``."""
    return len(unit) == 5


@dataclasses.dataclass(frozen=True)
class Plan:
    """Which rank computes which unit, and what that is predicted to achieve.

    ``assignment[d]`` lists the ``(src_rank, local_idx)`` units computed on rank ``d``, sorted by
    ``(src_rank, local_idx)`` so received data arrives in plan order without a permutation. It
    is an ``Assignment`` (a sequence of those lists, each made when first read); plain lists
    given here are wrapped in one.
    """

    assignment: Sequence[list[tuple[int, int]]]
    applied: bool
    reason: str
    """``applied``, ``balanced`` (below the trigger), ``no-gain``, ``cap`` (every plan found breaks
    the row cap the current layout keeps), ``dominant-unit`` (seed rule), ``single-rank``,
    ``empty`` or ``exchange`` (measured times: the exchange would cost more than it saves)."""
    loads_before: list[float]
    loads_after: list[float]
    imbalance_before: float
    imbalance_after: float
    moved_tokens: int
    cap_respected: bool = True
    """False when no assignment found keeps every rank under the row cap. Only an explicit
    ``max_len_ratio`` can do that: the default cap is one the current layout keeps."""
    inter_node_tokens: int = 0
    """Pixel rows computed on another node than their home rank's (nodes of
    ``BalanceConfig.ranks_per_node`` contiguous ranks); 0 when ``ranks_per_node`` is None."""

    def __post_init__(self):
        if not isinstance(self.assignment, Assignment):
            object.__setattr__(self, "assignment", Assignment.from_lists(self.assignment))

    def destinations(self, rank: int) -> list[int]:
        """``dest[i]``: the rank computing unit ``i`` of rank ``rank``."""
        return self.assignment.destinations_of(rank)


def imbalance(loads: Sequence[float]) -> float:
    """``max(loads) / mean(loads) - 1`` (0 for all-zero loads)."""
    return imbalance_of(max(loads), sum(loads), len(loads))


def imbalance_of(largest: float, total: float, count: int) -> float:
    """``imbalance`` from the loads' maximum, sum and count."""
    return largest * count / total - 1.0 if total > 0 else 0.0


# Inputs of at most this many units are planned on Python lists, larger ones by torch ops (the
# module docstring says why; ``benchmarks/planner.py`` measures both sides of the line).
SMALL_UNITS = 2048


def is_small(num_units: int) -> bool:
    """Whether an input of ``num_units`` units is planned on Python lists (``SMALL_UNITS``)."""
    return num_units <= SMALL_UNITS


class Units:
    """All ranks' units; unit ``u`` is ``(src, idx)`` with ``src`` its home rank and
    ``idx = u - starts[src]``, so ids ascend in ``(src, idx)`` order.

    ``small`` inputs (at most ``SMALL_UNITS`` units) are held as Python lists (``float_cost``,
    ``tokens``, ``src``, ``home_rows``) and no torch op runs for them. Large ones are built and
    validated with a few C-level passes and torch ops over the whole input (``cost_F``,
    ``tokens_U``, ``src_U``, ``counts_R``, ``starts_R``, ``home_rows_R``); Python lists of every
    unit are then made only for the paths that deal every unit (LPT), and the default path
    touches per-unit Python only for the units that move.

    Args:
        costs, tokens, history: as ``solve_plan`` takes them.

    Raises:
        ValueError: as ``solve_plan`` documents.
    """

    def __init__(self, costs, tokens, history=None):
        num_ranks = len(costs)
        if num_ranks == 0:
            raise ValueError("solve_plan needs at least one rank, got costs for 0 ranks")
        if len(tokens) != num_ranks:
            raise ValueError(f"costs has {num_ranks} ranks but tokens has {len(tokens)}")
        self.num_ranks = num_ranks
        self.counts = list(map(len, costs))
        if self.counts != list(map(len, tokens)):
            _name_invalid_rank(costs, tokens)
        self.num_units = sum(self.counts)
        self.small = is_small(self.num_units)
        flat_cost = _flat(costs, "d")  # float64: what plans report
        try:
            flat_tokens = _flat(tokens, "q")
        except TypeError:  # floats holding whole numbers, say: truncated as int() does
            if min(chain.from_iterable(tokens)) < 0:
                _name_invalid_rank(costs, tokens)
            flat_tokens = array("q", map(int, chain.from_iterable(tokens)))
        if self.small:
            self.float_cost, self.tokens = flat_cost.tolist(), flat_tokens.tolist()
            valid = not self.num_units or (
                all(map(math.isfinite, self.float_cost))
                and min(self.float_cost) >= 0
                and min(self.tokens) >= 0
            )
        else:
            self.cost_F = _tensor(flat_cost, torch.float64)
            self.tokens_U = _tensor(flat_tokens, torch.int64)
            valid = not self.num_units or (
                bool(torch.isfinite(self.cost_F).all())
                and float(self.cost_F.min()) >= 0
                and int(self.tokens_U.min()) >= 0
            )
        if not valid:
            _name_invalid_rank(costs, tokens)
        if history is not None:
            if len(history) != num_ranks:
                raise ValueError(f"history has {len(history)} ranks, expected {num_ranks}")
            if not all(math.isfinite(h) and h >= 0 for h in history):
                raise ValueError(f"history must be finite and >= 0, got {list(history)!r}")
        self.history = history
        if self.small:
            spans = list(pairwise(self.starts))
            self.src = list(chain.from_iterable(map(repeat, range(num_ranks), self.counts)))
            self.home_rows = [sum(self.tokens[a:b]) for a, b in spans]
            self.total_tokens = sum(self.home_rows)
            # In order from 0.0, as ``sequential_sums`` adds (``sum`` may not: Python 3.12's
            # compensates for rounding).
            sums = [reduce(operator.add, self.float_cost[a:b], 0.0) for a, b in spans]
            if history is not None:
                sums = [float(h) + s for h, s in zip(history, sums, strict=True)]
            self.loads_before = sums
            self.max_before = max(sums)
        else:
            self.counts_R = int_tensor(self.counts)
            self.starts_R = torch.cumsum(self.counts_R, 0) - self.counts_R
            self.src_U = torch.repeat_interleave(torch.arange(num_ranks), self.counts_R)
            self.home_rows_R = torch.zeros(num_ranks, dtype=torch.int64).index_add_(
                0, self.src_U, self.tokens_U
            )
            self.total_tokens = int(self.home_rows_R.sum())
            sums_R = sequential_sums(self.cost_F, self.src_U, self.counts_R)
            if history is not None:
                history_R = torch.frombuffer(array("d", map(float, history)), dtype=torch.float64)
                sums_R = history_R + sums_R
            self.loads_before = sums_R.tolist()
            self.max_before = float(sums_R.max())  # a max is exact in any order
        if self.total_tokens >= 1 << (62 - self.rank_bits):  # they must pack with a rank id
            raise ValueError(
                f"token counts must sum to less than 2**{62 - self.rank_bits} for "
                f"{num_ranks} ranks, got {self.total_tokens}"
            )
        self.total_before = sum(self.loads_before)
        self.imbalance_before = imbalance_of(self.max_before, self.total_before, num_ranks)

    @functools.cached_property
    def base(self) -> list[float]:
        """Per-rank history (0.0 without)."""
        return [0.0] * self.num_ranks if self.history is None else list(map(float, self.history))

    @functools.cached_property
    def largest_float_cost(self) -> float:
        if self.small:
            return max(self.float_cost, default=0.0)
        return float(self.cost_F.max()) if self.num_units else 0.0

    # --- fixed point: made only once a plan is needed (skipped steps never pay for it)

    @functools.cached_property
    def scale_exp(self) -> int:
        """Costs are ``round(cost * 2**scale_exp)``: the total load stays below
        ``2**(62 - rank_bits)``, so a load and a rank id pack into one int64 (``rank_bits``)."""
        # Any bound of the total will do (within a factor of 2): the loads' sum, or past the
        # float range, the largest value times the number of values.
        total = math.fsum(self.loads_before)
        if math.isfinite(total):
            exponent = math.frexp(total)[1]
        else:
            biggest = max(max(self.base), self.largest_float_cost)
            exponent = math.frexp(biggest)[1] + (self.num_units + self.num_ranks).bit_length()
        return 61 - self.rank_bits - exponent

    @property
    def rank_bits(self) -> int:
        return max(1, (self.num_ranks - 1).bit_length())

    def to_fixed(self, values_F: torch.Tensor) -> torch.Tensor:
        """Fixed-point int64 of non-negative float64 values (two exact power-of-two factors, so
        neither under- nor overflows)."""
        half = self.scale_exp // 2
        scaled = values_F * 2.0**half * 2.0 ** (self.scale_exp - half)
        return torch.round(scaled).to(torch.int64)

    def to_fixed_list(self, values: Sequence[float]) -> list[int]:
        """``to_fixed`` in Python: the same two products, rounded half to even as
        ``torch.round`` rounds."""
        half = self.scale_exp // 2
        low, high = repeat(2.0**half), repeat(2.0 ** (self.scale_exp - half))
        return list(map(round, map(operator.mul, map(operator.mul, values, low), high)))

    def to_float(self, value: int) -> float:
        """A fixed-point load in the costs' unit (for the exchange model's seconds)."""
        return math.ldexp(float(value), -self.scale_exp)

    @functools.cached_property
    def cost_U(self) -> torch.Tensor:
        return self.to_fixed(self.cost_F)

    @functools.cached_property
    def base_fixed(self) -> list[int]:
        if self.history is None:
            return [0] * self.num_ranks
        if self.small:
            return self.to_fixed_list(self.base)
        return self.to_fixed(torch.frombuffer(array("d", self.base), dtype=torch.float64)).tolist()

    @functools.cached_property
    def home_loads_R(self) -> torch.Tensor:
        sums = torch.zeros(self.num_ranks, dtype=torch.int64).index_add_(0, self.src_U, self.cost_U)
        return sums + int_tensor(self.base_fixed)

    @functools.cached_property
    def home_loads(self) -> list[int]:
        if self.small:
            cost, spans = self.cost, pairwise(self.starts)
            return [b + sum(cost[x:y]) for b, (x, y) in zip(self.base_fixed, spans, strict=True)]
        return self.home_loads_R.tolist()

    @functools.cached_property
    def largest_cost(self) -> int:
        if self.small:
            return max(self.cost, default=0)
        return int(self.cost_U.max()) if self.num_units else 0

    # --- every unit as Python lists: set by ``__init__`` for small inputs; for large ones made
    # only for the paths that deal every unit (LPT, the refinement)

    @functools.cached_property
    def cost(self) -> list[int]:
        return self.to_fixed_list(self.float_cost) if self.small else self.cost_U.tolist()

    @functools.cached_property
    def tokens(self) -> list[int]:
        return self.tokens_U.tolist()

    @functools.cached_property
    def src(self) -> list[int]:
        return self.src_U.tolist()

    @functools.cached_property
    def home_rows(self) -> list[int]:
        return self.home_rows_R.tolist()

    def by_cost_desc(self) -> list[int]:
        """Unit ids by cost, descending; ties by (src, idx), i.e. by id (the sorts are stable,
        ``reverse`` too)."""
        if self.small:
            return sorted(range(self.num_units), key=self.cost.__getitem__, reverse=True)
        return torch.sort(-self.cost_U, stable=True).indices.tolist()

    def keeps_cap_at_home(self, cap: float) -> bool:
        """Whether the current layout keeps the row cap (``keeps_row_cap``)."""
        if self.small:
            return keeps_row_cap(self.home_rows, self.counts, cap)
        return bool(((self.home_rows_R <= cap) | (self.counts_R <= 1)).all())

    @functools.cached_property
    def starts(self) -> list[int]:
        """Rank ``r``'s unit ids are ``starts[r]`` to ``starts[r + 1] - 1``."""
        return [0, *accumulate(self.counts)]

    def home_ids(self, rank: int) -> range:
        return range(self.starts[rank], self.starts[rank + 1])


def sequential_sums(values_F: torch.Tensor, group_U: torch.Tensor, sizes_G: torch.Tensor):
    """Per group, the float64 sum of its values in order from 0.0, as a plain loop adds them: the
    bits depend on nothing but the values. ``group_U`` (non-decreasing) names each value's
    group; ``sizes_G`` are the group sizes.

    One group per row, zero-padded: ``torch.cumsum`` runs one float64 sum along each row in
    order (threads split rows, never a row; ``x + 0.0 == x`` for the padding), so its last column
    is each group's sum, in one op for every group (``test_planner`` checks the bits against a
    plain loop on every torch the suite runs). Groups longer than ``_COLUMNS`` (a few) would pad
    every row to their length: each is summed by a cumsum of its own.
    """
    num_groups = len(sizes_G)
    widest = int(sizes_G.max()) if num_groups else 0
    if widest == 0:
        return torch.zeros(num_groups, dtype=torch.float64)
    columns = min(widest, _COLUMNS)
    starts_G = torch.cumsum(sizes_G, 0) - sizes_G
    column_U = torch.arange(len(values_F)) - starts_G.index_select(0, group_U)
    short_F, short_G, short_U = values_F, group_U, column_U
    if columns < widest:  # the long groups' first columns only, for now
        inside = column_U < columns
        short_F, short_G, short_U = values_F[inside], group_U[inside], column_U[inside]
    padded = torch.zeros(num_groups * columns, dtype=torch.float64)
    padded.index_copy_(0, short_G * columns + short_U, short_F)
    total = padded.view(num_groups, columns).cumsum(1)[:, -1].clone()
    if columns < widest:  # a few very long groups, each in order on its own
        for g in (sizes_G > _COLUMNS).nonzero().squeeze(1).tolist():
            start, size = int(starts_G[g]), int(sizes_G[g])
            total[g] = values_F[start : start + size].cumsum(0)[-1]
    return total


# The widest row ``sequential_sums`` pads groups to: past it, groups are few and long.
_COLUMNS = 64


def int_tensor(values: list[int]) -> torch.Tensor:
    """An int64 tensor of a list of ints, made in C (``torch.tensor`` parses item by item)."""
    if not values:
        return torch.zeros(0, dtype=torch.int64)
    return torch.frombuffer(array("q", values), dtype=torch.int64)


def _flat(rows, typecode: str) -> array:
    """All ranks' values in one float64 (``d``) or int64 (``q``) array, converted in C: list by
    list where the ranks are lists, else item by item (``TypeError`` for other values)."""
    flat = array(typecode)
    try:
        deque(map(flat.fromlist, rows), maxlen=0)
    except TypeError:  # not lists (or not numbers: raised again below)
        flat = array(typecode, chain.from_iterable(rows))
    return flat


def _tensor(flat: array, dtype: torch.dtype) -> torch.Tensor:
    """The tensor over an array's buffer (``frombuffer`` refuses an empty one)."""
    return torch.frombuffer(flat, dtype=dtype) if flat else torch.zeros(0, dtype=dtype)


def _name_invalid_rank(costs, tokens) -> None:
    for r, (rank_costs, rank_tokens) in enumerate(zip(costs, tokens, strict=True)):
        if len(rank_costs) != len(rank_tokens):
            raise ValueError(
                f"rank {r}: {len(rank_costs)} costs but {len(rank_tokens)} token counts"
            )
        if rank_costs and not (all(map(math.isfinite, rank_costs)) and min(rank_costs) >= 0):
            raise ValueError(f"rank {r}: costs must be finite and >= 0, got {list(rank_costs)!r}")
        if rank_tokens and min(rank_tokens) < 0:
            raise ValueError(f"rank {r}: token counts must be >= 0, got {list(rank_tokens)!r}")
    raise AssertionError("an invalid input that no rank shows")


def keeps_row_cap(rows: Sequence[int], counts: Sequence[int], cap: float) -> bool:
    """No rank above ``cap`` rows, but for ranks holding a single unit."""
    if max(rows) <= cap:  # in C: the usual answer
        return True
    over = compress(counts, map(operator.gt, rows, repeat(cap)))  # still in C
    return all(map(operator.ge, repeat(1), over))
