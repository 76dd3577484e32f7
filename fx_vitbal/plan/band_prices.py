"""What a split frame's exchange costs each of its band ranks, by kind and by where the ranks sit.

[Note: exchange prices] In every layer that attends over the whole frame, a band of ``n`` of its
frame's ``N`` patches (``k`` bands; ``kv`` bytes of one patch's keys and values, ``4 * d`` in
bf16) needs the rest of the frame. Per exchanging layer, its rank moves (the runtime's kinds,
``runtime/bands/``):

- ``gather``: the other bands' keys and values, ``kv * (N - n)`` bytes in (``4*N*d*(k-1)/k``
  for even bands), in one collective; its backward fetches them again one block a step, each
  behind the gradients of the block before, and sends each block's gradients home a step later
  (``ring``'s backward below, straight from and to each block's owner): in, the blocks again
  and its own block's gradients from each peer, ``kv * (N - n + (k - 1) * n)`` (twice the
  forward's for even bands; a cut's large band gets more, its small ones less).
- ``ulysses``: an all-to-all of heads (q, k, v out, the outputs back: ``8*N*d*(k-1)/k**2`` for
  even bands), two collectives, the same again in the backward; only where the heads divide
  among the ``k`` ranks.
- ``ring``: the same bytes as ``gather`` in ``k - 1`` point-to-point steps, each overlapped with
  the attention of one block (``n`` queries over the ``m`` keys of the block in flight): a step
  costs its latency plus what of its transfer that compute does not hide, ``max(0, bytes /
  bandwidth - pairs * pair cost)``; the backward sends the blocks round again with their
  gradient accumulators (in: the blocks, ``N - n`` patches, and every block's accumulator but
  the one that starts here, ``N - m`` for the band ``m`` before: twice the forward's for even
  bands), behind about twice the compute.
- ``usp``: ``ulysses`` inside each group of ``u`` consecutive bands (``usp_degree``), then a
  ``ring`` of the ``k / u`` groups' blocks of ``1/u`` of the heads: per key patch ``kv / u``
  bytes behind the attention of the group's ``N_g`` queries for those heads. The heads need
  divide among ``u`` ranks only, and across nodes a band pays ``1/u`` of a ring's bytes, each
  step hidden behind ``u`` times a ring band's compute.

Where: ranks ``r`` and ``r'`` share a node iff ``r // ranks_per_node == r' // ranks_per_node``
(node-blind when ``ranks_per_node`` is None or 1: everything at NVLink rates). A frame whose
ranks are on one node moves at NVLink rates; one spanning nodes at one InfiniBand NIC per GPU
(``INFINIBAND_BYTES_PER_SECOND``, and ``INTER_NODE_COLLECTIVE_SECONDS`` a collective or step):
a gather's collective and a ring's synchronous steps go at the slowest link they cross, while an
all-to-all moves each peer's share on its own link (``ulysses``: the slower of its NVLink and
its InfiniBand share). With costs in seconds from a measured exchange (one fit of the balancing
group's exchanges), both links are the measured one.

All prices are in the cost model's units (``plan.bands.exchange_scale``), forward and backward
of every exchanging layer, so they add to a band's share of its frame's cost. Pure arithmetic:
the same prices on every rank.
"""

import dataclasses
import functools
from collections.abc import Sequence
from typing import NamedTuple

from fx_vitbal.plan.bands import (
    COLLECTIVE_SECONDS,
    INFINIBAND_BYTES_PER_SECOND,
    MACS_PER_SECOND,
    NVLINK_BYTES_PER_SECOND,
    TRAINING_MACS_PER_FORWARD_MAC,
    BandRule,
)

# The kinds an ``auto`` exchange chooses among, in the order that breaks ties (the simplest,
# which every tower runs, compiled ones too, first).
KINDS = ("gather", "ulysses", "ring", "usp")
# One collective across nodes: NCCL's small-message all-gather or send/recv over 400 Gb/s
# InfiniBand takes some 20-40 us on 2-8 nodes (the network's round trip, the NIC and the proxy
# thread on top of the ~11 us inside a node); no measurement here, the middle of that range.
INTER_NODE_COLLECTIVE_SECONDS = 30e-6
# The largest band over the smallest that ``auto`` still gives to ``ulysses`` or ``usp`` (whose
# ranks share the attention out evenly by heads): an even cut's bands differ by at most one
# ``align`` block of rows (4032 px in 64 bands: 2 or 3 blocks), an uneven cut's much more.
EVEN_SPREAD = 1.5
# What ulysses moves per patch, in units of a patch's keys and values (``kv``: 2 tensors): a
# peer's patch's queries, keys and values for a rank's heads (3 tensors), then the outputs of
# the rank's own patches for its peers' heads (1 tensor): ``8*N*d*(k-1)/k**2`` for even bands.
ULYSSES_QKV, ULYSSES_OUT = 1.5, 0.5


def usp_degree(heads: int, k: int, ranks_per_node: int | None) -> int:
    """The bands of each Ulysses group of a frame of ``k`` bands run as ``usp``
    (``runtime/bands/``): the most ``u`` that divides the heads and ``k``, leaves at
    least two groups, and fits a node (``ranks_per_node``; None or 1: node-blind, any); 0 where
    no ``u`` of at least 2 does, or the heads are unknown (0)."""
    if heads < 1:
        return 0
    fits = k // 2 if ranks_per_node is None or ranks_per_node < 2 else min(k // 2, ranks_per_node)
    return max((u for u in range(2, fits + 1) if heads % u == 0 and k % u == 0), default=0)


@functools.lru_cache(maxsize=1024)
def kinds_for(rule: BandRule, forced: str, k: int, ranks_per_node: int | None) -> tuple[str, ...]:
    """The kinds a frame of ``k`` bands (on ``k`` ranks) may use: the forced one (``ulysses``
    and ``usp`` become ``ring``, by rule, where the heads do not divide as they need), else
    every kind (``ulysses`` only where the heads divide among the ranks, ``usp`` where
    ``usp_degree`` finds groups)."""
    allowed = {
        "gather": True,
        "ulysses": rule.heads > 0 and rule.heads % k == 0,
        "ring": True,
        "usp": usp_degree(rule.heads, k, ranks_per_node) > 0,
    }
    if forced != "auto":
        return (forced,) if allowed[forced] else ("ring",)
    return tuple(kind for kind in KINDS if allowed[kind])


class Link(NamedTuple):
    """An interconnect in the cost model's units."""

    bytes_per_cost: float
    """Bytes it moves in one cost unit."""
    latency: float
    """The cost of one collective, or of one ring step."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExchangePrices:
    """Prices of split frames' exchanges (see [Note: exchange prices]).

    ``nodes`` (every method): each band's node, in band order (``packed_nodes`` before the plan
    says where bands land), or None: all on one node."""

    rule: BandRule
    inside: Link
    across: Link
    ranks_per_node: int | None
    """Ranks a node; None where planning is node-blind."""
    pair_cost: float
    """The forward cost of one query-key pair in one exchanging layer (``2 * d`` MACs)."""
    forced: str = "auto"
    """``BalanceConfig.band_exchange``."""

    def kinds(self, k: int) -> tuple[str, ...]:
        """``kinds_for`` this rule and forced kind."""
        return kinds_for(self.rule, self.forced, k, self.ranks_per_node)

    def packed_nodes(self, k: int) -> tuple[int, ...] | None:
        """Where ``k`` bands are assumed to land before the plan places them, the assumption a
        frame is first priced by: on one node when they fit on one (node-aware plans keep
        moves inside a node where they can), else each on a node of its own (the dearest
        place: the plan spreads a frame that fills more than a node over the ranks with room,
        wherever they are, so placing cannot raise its price)."""
        if self.ranks_per_node is None or k <= self.ranks_per_node:
            return None
        return tuple(range(k))

    def frame_prices(
        self, sizes: Sequence[int], kind: str, nodes: Sequence[int] | None
    ) -> list[float]:
        """Every band's exchange, on its rank, forward and backward of every exchanging layer
        (see [Note: exchange prices]): what the frame's bands share (its total, the link,
        ``usp``'s groups) worked out once, each band's price once a size where only its size
        tells bands apart (``gather``; ``ulysses`` with the bands on one node or each on its
        own). Plans price some thousand frame shapes a step at scale (``band_plan``)."""
        k = len(sizes)
        if k < 2:
            return [0.0] * k
        if kind == "usp":
            return self._usp_prices(sizes, nodes)
        layers = self.rule.exchange_layers
        if kind == "ulysses":
            by_size = nodes is None or len(set(nodes)) == len(nodes)

            def price(i: int) -> float:
                return layers * 2 * self._ulysses(sizes, i, nodes)

        else:
            # A ring band receives the accumulators of every block but the band before's: its
            # price depends on that band's size too.
            by_size = kind == "gather"
            total, kv = sum(sizes), self.rule.kv_bytes_per_patch
            link = self.across if nodes is not None and len(set(nodes)) > 1 else self.inside

            def price(i: int) -> float:
                n = sizes[i]
                other = total - n
                # k - 1 steps a direction, each behind one block's attention (gather: backward)
                exposed = max(0.0, kv / link.bytes_per_cost - self.pair_cost * n)
                patches = received_patches(sizes, i, kind, total)
                if kind == "gather":  # the forward's whole, then the backward's exposed
                    forward = link.latency + kv * other / link.bytes_per_cost
                    per_layer = forward + (k - 1) * link.latency + (patches - other) * exposed
                else:
                    per_layer = 2 * (k - 1) * link.latency + patches * exposed
                return layers * per_layer

        priced = {}
        for i, n in enumerate(sizes):
            key = n if by_size else i
            if key not in priced:
                priced[key] = price(i)
        return [priced[n if by_size else i] for i, n in enumerate(sizes)]

    def _ulysses(self, sizes: Sequence[int], i: int, nodes: Sequence[int] | None) -> float:
        """One direction of one layer: two all-to-alls, each peer's share on its own link."""
        k, n, kv = len(sizes), sizes[i], self.rule.kv_bytes_per_patch
        if nodes is None:  # one link (the sums in the same order as below)
            got = out = 0.0
            for j, m in enumerate(sizes):
                if j != i:
                    got += kv * (ULYSSES_QKV * m + ULYSSES_OUT * n) / k
                    out += kv * (ULYSSES_QKV * n + ULYSSES_OUT * m) / k
            return 2 * self.inside.latency + max(got, out) / self.inside.bytes_per_cost
        links = {}
        for j, m in enumerate(sizes):
            if j != i:
                far = nodes[j] != nodes[i]
                received = kv * (ULYSSES_QKV * m + ULYSSES_OUT * n) / k
                sent = kv * (ULYSSES_QKV * n + ULYSSES_OUT * m) / k
                got, out = links.get(far, (0.0, 0.0))
                links[far] = (got + received, out + sent)
        latency = self.across.latency if True in links else self.inside.latency
        seconds = max(
            max(got, out) / (self.across if far else self.inside).bytes_per_cost
            for far, (got, out) in links.items()
        )
        return 2 * latency + seconds

    def _usp_prices(self, sizes: Sequence[int], nodes: Sequence[int] | None) -> list[float]:
        """Each band's layers, forward and backward: ``ulysses`` in its group, then the ring of
        its place in every group (the groups' rows, ``1/u`` of the heads)."""
        k, u = len(sizes), usp_degree(self.rule.heads, len(sizes), self.ranks_per_node)
        groups = _group_rows(sizes, u)
        total, kv = sum(sizes), self.rule.kv_bytes_per_patch / u
        steps = k // u - 1
        rings = []  # each place's ring link
        for place in range(u):
            ring = range(place, k, u)
            far = nodes is not None and len({nodes[j] for j in ring}) > 1
            rings.append(self.across if far else self.inside)
        priced, heads_of = [], {}  # a group's all-to-alls, once a group and place
        for i in range(k):
            g, place = divmod(i, u)
            group = tuple(sizes[g * u : (g + 1) * u])
            group_nodes = None if nodes is None else tuple(nodes[g * u : (g + 1) * u])
            key = (group, place, group_nodes)
            if key not in heads_of:
                heads_of[key] = 2 * self._ulysses(group, place, group_nodes)
            heads = heads_of[key]
            link = rings[place]
            exposed = max(0.0, kv / link.bytes_per_cost - self.pair_cost * groups[g] / u)
            patches = received_patches(groups, g, "ring", total)
            per_layer = heads + 2 * steps * link.latency + patches * exposed
            priced.append(self.rule.exchange_layers * per_layer)
        return priced

    def cheapest(
        self, sizes: Sequence[int], nodes: Sequence[int] | None, ranks: int | None = None
    ) -> tuple[str, list[float]]:
        """The kind whose dearest band costs least (ties: ``KINDS`` order) among those a frame
        on ``ranks`` ranks may use (``kinds``; default: one a band), and its prices. ``auto``
        takes ``ulysses`` only for bands about even (``EVEN_SPREAD``) and ``usp`` only for
        bands about even in each group: they share the attention out by heads, so each rank
        computes an equal share of it whatever its rows, while a band is costed by its rows
        (an uneven cut's small band would compute far more than planned)."""
        best = None
        for kind in self.kinds(ranks or len(sizes)):
            if self.forced == "auto" and not _even_for(kind, sizes, self):
                continue
            prices = self.frame_prices(sizes, kind, nodes)
            if best is None or max(prices) < max(best[1]):
                best = (kind, prices)
        return best


def _even_for(kind: str, sizes: Sequence[int], prices: ExchangePrices) -> bool:
    """Whether ``kind``'s ranks compute about the shares of attention their bands are costed
    by (``ulysses``: the frame's bands, ``usp``: each group's, within ``EVEN_SPREAD``)."""
    if kind not in ("ulysses", "usp"):
        return True
    u = len(sizes)
    if kind == "usp":
        u = usp_degree(prices.rule.heads, len(sizes), prices.ranks_per_node)
    groups = [sizes[g : g + u] for g in range(0, len(sizes), u)]
    return all(max(group) <= EVEN_SPREAD * min(group) for group in groups)


def exchange_prices(
    rule: BandRule,
    *,
    macs: bool,
    ranks_per_node: int | None,
    forced: str = "auto",
    latency: float = 0.0,
    seconds_per_byte: float = 0.0,
) -> ExchangePrices | None:
    """The ``ExchangePrices`` of a cost model: in forward multiply-accumulates (``macs``, the
    architecture model) at H100 rates (``plan.bands``), or in seconds from a measured exchange
    (``latency``, ``seconds_per_byte`` > 0); None when neither (``l**2`` and polynomial costs
    have no scale for bytes)."""
    width = rule.kv_bytes_per_patch / 4  # keys and values in bf16: 4 bytes per unit of width
    aware = ranks_per_node if ranks_per_node is not None and ranks_per_node > 1 else None
    if seconds_per_byte > 0.0:
        link = Link(1.0 / seconds_per_byte, latency)
        pair = 2 * width / MACS_PER_SECOND
        return ExchangePrices(
            rule=rule,
            inside=link,
            across=link,
            ranks_per_node=aware,
            pair_cost=pair,
            forced=forced,
        )
    if not macs:
        return None
    per_second = MACS_PER_SECOND / TRAINING_MACS_PER_FORWARD_MAC  # forward MACs a second
    return ExchangePrices(
        rule=rule,
        inside=Link(NVLINK_BYTES_PER_SECOND / per_second, COLLECTIVE_SECONDS * per_second),
        across=Link(
            INFINIBAND_BYTES_PER_SECOND / per_second, INTER_NODE_COLLECTIVE_SECONDS * per_second
        ),
        ranks_per_node=aware,
        pair_cost=2 * width / TRAINING_MACS_PER_FORWARD_MAC,
        forced=forced,
    )


def frame_traffic(
    rule: BandRule,
    sizes: Sequence[int],
    kind: str,
    nodes: Sequence[int] | None,
    ranks_per_node: int | None = None,
) -> tuple[float, float]:
    """``(bytes inside nodes, bytes across nodes)`` the frame's ranks receive in one step,
    forward and backward of every exchanging layer (``band_receives``; ``nodes`` as in
    ``ExchangePrices``)."""
    inside = across = 0.0
    for i in range(len(sizes)):
        for j, size in band_receives(rule, sizes, i, kind, ranks_per_node):
            if nodes is not None and nodes[i] != nodes[j]:
                across += size
            else:
                inside += size
    return rule.exchange_layers * inside, rule.exchange_layers * across


def band_receives(
    rule: BandRule, sizes: Sequence[int], i: int, kind: str, ranks_per_node: int | None = None
) -> list[tuple[int, float]]:
    """``(band, bytes)``: what band ``i``'s rank receives from each other band's in one
    exchanging layer, forward and backward, as ``runtime/bands/`` sends it (a ring's blocks
    each from the band before; ``kv`` a patch's keys and values):

    - ``gather``: each peer's block twice and its share of this band's gradients,
      ``kv * (2 * m + n)``;
    - ``ring``: from the band before, the other blocks twice and the accumulators
      (``received_patches``);
    - ``ulysses``: each peer's q, k, v of this rank's heads and this band's outputs of the
      peer's, then their gradients the other way (``ULYSSES_QKV``, ``ULYSSES_OUT``);
    - ``usp``: ``ulysses`` inside its group of ``u`` bands, then ``ring`` across the groups on
      ``1/u`` of the heads."""
    k, kv = len(sizes), rule.kv_bytes_per_patch
    if k < 2:
        return []
    n = sizes[i]
    if kind == "gather":
        return [(j, kv * (2 * m + n)) for j, m in enumerate(sizes) if j != i]
    if kind == "ring":
        return [((i - 1) % k, kv * received_patches(sizes, i, kind, sum(sizes)))]
    u = usp_degree(rule.heads, k, ranks_per_node) if kind == "usp" else k
    g, place = divmod(i, u)
    group = range(g * u, (g + 1) * u)
    pieces = []
    for j in group:
        if j != i:  # in the forward the peer's q, k, v and outputs; their gradients come back
            m = sizes[j]
            forward, backward = ULYSSES_QKV * m + ULYSSES_OUT * n, ULYSSES_OUT * m + ULYSSES_QKV * n
            pieces.append((j, kv * (forward + backward) / u))
    if kind == "usp" and k > u:
        patches = received_patches(_group_rows(sizes, u), g, "ring", sum(sizes))
        pieces.append((((g - 1) % (k // u)) * u + place, kv / u * patches))
    return pieces


def _group_rows(sizes: Sequence[int], u: int) -> list[int]:
    """The patches of each group of ``u`` consecutive bands (``usp``'s ring runs over these)."""
    return [sum(sizes[j : j + u]) for j in range(0, len(sizes), u)]


def received_patches(sizes: Sequence[int], i: int, kind: str, total: int) -> int:
    """``band_receives``' sum for ``gather`` and ``ring``, in patches of keys and values (or
    of their gradients), closed-form (``total``: the sum of ``sizes``): forward the other
    blocks, ``N - n``; backward those again, and for ``gather`` this block's gradients from
    each peer, ``(k - 1) * n``, for ``ring`` every block's accumulator but the one that starts
    here (the block before's, ``m``): ``N - m``."""
    other = total - sizes[i]
    if kind == "gather":
        return 2 * other + (len(sizes) - 1) * sizes[i]
    return 2 * other + total - sizes[(i - 1) % len(sizes)]


def step_traffic(step, rule: BandRule | None, ranks_per_node: int) -> tuple[float, float]:
    """``(bytes inside nodes, bytes across nodes)`` every split frame of a planned step
    (``plan.step.StepPlan``) moves (``frame_traffic``, its exchange kind where its bands are
    computed), nodes being ``ranks_per_node`` contiguous ranks."""
    inside = across = 0.0
    for name, indices in step.frames.items():
        sizes = [step.units_O[name[0]][i].h * step.units_O[name[0]][i].w for i in indices]
        nodes = [step.computed_by(name[0], i) // ranks_per_node for i in indices]
        got = frame_traffic(rule, sizes, step.exchanges[name], nodes, ranks_per_node)
        inside, across = inside + got[0], across + got[1]
    return inside, across
