"""The planner's data: the flat unit arrays (torch, built and checked for the whole input at
once), the integer fixed-point costs every decision is made in, the row cap, and the ``Plan``
every rank gets.

Shape suffixes: ``_U`` one entry per unit (all ranks' units, rank by rank), ``_R`` one per rank.

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
from itertools import accumulate, chain, compress, repeat

import torch

from fx_vitbal.plan.assignment import Assignment


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


class Units:
    """All ranks' units as flat tensors; unit ``u`` is ``(src, idx)`` with ``src`` its home rank
    and ``idx = u - starts[src]``, so ids ascend in ``(src, idx)`` order.

    Built and validated with a few C-level passes and torch ops over the whole input. Python
    lists of every unit (``cost``, ``tokens``, ``src``) exist only for the paths that deal every
    unit (LPT); the default path touches per-unit Python only for the units that move.

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
        self.cost_F = _flat_tensor(costs, "d", self.num_units)  # float64: what plans report
        try:
            self.tokens_U = _flat_tensor(tokens, "q", self.num_units)
        except TypeError:  # floats holding whole numbers, say: truncated as int() does
            if min(chain.from_iterable(tokens)) < 0:
                _name_invalid_rank(costs, tokens)
            whole = array("q", map(int, chain.from_iterable(tokens)))
            self.tokens_U = torch.frombuffer(whole, dtype=torch.int64)
        if self.num_units and not (
            bool(torch.isfinite(self.cost_F).all())
            and float(self.cost_F.min()) >= 0
            and int(self.tokens_U.min()) >= 0
        ):
            _name_invalid_rank(costs, tokens)
        if history is not None:
            if len(history) != num_ranks:
                raise ValueError(f"history has {len(history)} ranks, expected {num_ranks}")
            if not all(math.isfinite(h) and h >= 0 for h in history):
                raise ValueError(f"history must be finite and >= 0, got {list(history)!r}")
        self.history = history
        self.counts_R = int_tensor(self.counts)
        self.starts_R = torch.cumsum(self.counts_R, 0) - self.counts_R
        self.src_U = torch.repeat_interleave(torch.arange(num_ranks), self.counts_R)
        self.home_rows_R = torch.zeros(num_ranks, dtype=torch.int64).index_add_(
            0, self.src_U, self.tokens_U
        )
        self.total_tokens = int(self.home_rows_R.sum())
        if self.total_tokens >= 1 << (62 - self.rank_bits):  # they must pack with a rank id
            raise ValueError(
                f"token counts must sum to less than 2**{62 - self.rank_bits} for "
                f"{num_ranks} ranks, got {self.total_tokens}"
            )
        sums_R = sequential_sums(self.cost_F, self.src_U, self.counts_R)
        if history is not None:
            sums_R = torch.frombuffer(array("d", map(float, history)), dtype=torch.float64) + sums_R
        self.loads_before = sums_R.tolist()
        self.total_before = sum(self.loads_before)
        self.max_before = float(sums_R.max())  # a max is exact in any order
        self.imbalance_before = imbalance_of(self.max_before, self.total_before, num_ranks)

    @functools.cached_property
    def base(self) -> list[float]:
        """Per-rank history (0.0 without)."""
        return [0.0] * self.num_ranks if self.history is None else list(map(float, self.history))

    @functools.cached_property
    def home_rows(self) -> list[int]:
        return self.home_rows_R.tolist()

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
            biggest = max(max(self.base), float(self.cost_F.max()))
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
        return self.to_fixed(torch.frombuffer(array("d", self.base), dtype=torch.float64)).tolist()

    @functools.cached_property
    def home_loads_R(self) -> torch.Tensor:
        sums = torch.zeros(self.num_ranks, dtype=torch.int64).index_add_(0, self.src_U, self.cost_U)
        return sums + int_tensor(self.base_fixed)

    @functools.cached_property
    def home_loads(self) -> list[int]:
        return self.home_loads_R.tolist()

    @functools.cached_property
    def largest_cost(self) -> int:
        return int(self.cost_U.max()) if self.num_units else 0

    # --- every unit as Python lists: for the paths that deal every unit (LPT, the refinement)

    @functools.cached_property
    def cost(self) -> list[int]:
        return self.cost_U.tolist()

    @functools.cached_property
    def tokens(self) -> list[int]:
        return self.tokens_U.tolist()

    @functools.cached_property
    def src(self) -> list[int]:
        return self.src_U.tolist()

    def by_cost_desc(self) -> list[int]:
        """Unit ids by cost, descending; ties by (src, idx), i.e. by id (the sort is stable)."""
        return torch.sort(-self.cost_U, stable=True).indices.tolist()

    def keeps_cap_at_home(self, cap: float) -> bool:
        """Whether the current layout keeps the row cap (``keeps_row_cap``, by tensor ops)."""
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


def _flat_tensor(rows, typecode: str, num_units: int) -> torch.Tensor:
    """All ranks' values in one float64 (``d``) or int64 (``q``) tensor, converted in C: list
    by list where the ranks are lists, else item by item (``TypeError`` for other values)."""
    dtype = torch.float64 if typecode == "d" else torch.int64
    if num_units == 0:
        return torch.zeros(0, dtype=dtype)
    flat = array(typecode)
    try:
        deque(map(flat.fromlist, rows), maxlen=0)
    except TypeError:  # not lists (or not numbers: raised again below)
        flat = array(typecode, chain.from_iterable(rows))
    return torch.frombuffer(flat, dtype=dtype)


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


def row_cap(units: Units, ratio: float | None) -> float:
    """The most pixel rows a rank may compute (``config.max_len_ratio``); ``math.inf``: no cap.

    ``None`` caps at the fullest rank's current rows: the layout the job already fits in. Rows
    are integers, so flooring ``mean * ratio`` changes no comparison and keeps row room exact.
    """
    if ratio is None:
        return int(units.home_rows_R.max())
    if ratio == math.inf:
        return math.inf
    return math.floor(units.total_tokens / units.num_ranks * ratio)


def keeps_row_cap(rows: Sequence[int], counts: Sequence[int], cap: float) -> bool:
    """No rank above ``cap`` rows, but for ranks holding a single unit."""
    if max(rows) <= cap:  # in C: the usual answer
        return True
    over = compress(counts, map(operator.gt, rows, repeat(cap)))  # still in C
    return all(map(operator.ge, repeat(1), over))


def cap_unkeepable(units: Units, cap: float) -> bool:
    """Whether no assignment at all keeps the cap (``max_len_ratio=1.0`` with no unit above it,
    typically: the rows exceed ``ranks * floor(mean)``).

    At best the units above the cap sit alone and every other rank is full to the cap, so more
    rows than that fit in no assignment.
    """
    if cap == math.inf:
        return False
    excess = int((units.tokens_U - cap).clamp(min=0).sum())
    return units.total_tokens > cap * units.num_ranks + excess


def plan_crossing_rows(plan: Plan, units_R: Sequence[Sequence[tuple[int, int, int]]]):
    """Per rank, pixel rows it sends to other ranks and rows it receives from them under
    ``plan``, from every rank's ``(t, h, w)`` units (``crossing_rows`` on the planner's arrays)."""
    world = len(units_R)
    send, recv = [0] * world, [0] * world
    for d, assigned in enumerate(plan.assignment):
        for src, idx in assigned:
            if src != d:
                t, h, w = units_R[src][idx]
                send[src] += t * h * w
                recv[d] += t * h * w
    return send, recv
