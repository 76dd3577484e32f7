"""Bands at cluster scale, the planning side (``fx_vitbal.plan.band_prices``, ``band_plan``,
``band_nodes``, ``band_fill``, ``band_gaps``, ``cost.memory``; pure, no process group): each
split frame's exchange priced where its ranks sit and chosen by that price (or forced), frames cut
across nodes where that pays, memory budgets, uneven cuts that close a gap, and the invariants
every plan keeps (bands of whole ``align`` rows covering their frame in order, each unit computed
once, the same plan on every call)."""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fx_vitbal
from fx_vitbal.cost import ArchitectureCost
from fx_vitbal.cost.memory import held_bytes_per_patch
from fx_vitbal.plan.band_fill import wrap
from fx_vitbal.plan.band_plan import cut_frame, price_cut, spread
from fx_vitbal.plan.band_prices import (
    INTER_NODE_COLLECTIVE_SECONDS,
    band_receives,
    exchange_prices,
    frame_traffic,
    received_patches,
    usp_degree,
)
from fx_vitbal.plan.bands import MACS_PER_SECOND, TRAINING_MACS_PER_FORWARD_MAC, BandRule
from fx_vitbal.plan.step import describe_plan, plan_step
from fx_vitbal.plan.units import is_band, unit_rows
from fx_vitbal.runtime.vit.settings import plan_settings, planner_spec_for

# Qwen2-VL-7B's tower: d 1280, MLP 5120, 32 layers that all attend over whole frames, 16 heads.
QWEN2_VL = ArchitectureCost(hidden=1280, mlp_hidden=5120, depth=32, in_dim=1176, out_dim=3584)
RULE = BandRule(align=2, min_patches=64, exchange_layers=32, kv_bytes_per_patch=4 * 1280, heads=16)
MS = 1e3 / (MACS_PER_SECOND / TRAINING_MACS_PER_FORWARD_MAC)  # milliseconds a cost unit


def _plan(grids, heads: int = 16, sets=None, **config):
    """The step's plan as the runtime makes it for Qwen2-VL's tower (architecture costs:
    exchanges priced at H100 rates)."""
    config = fx_vitbal.BalanceConfig(**config)
    spec = planner_spec_for(config, QWEN2_VL, True, (2, 32, 1280, False, heads))
    return plan_step(grids, plan_settings(spec), sets)


def _ranks(planned, name) -> list[int]:
    return [planned.computed_by(name[0], i) for i in planned.frames[name]]


def _makespan(plan) -> float:
    return max(plan.loads_after if plan.applied else plan.loads_before)


ONE_BINDS = [[[1, 128, 128]], [[1, 16, 16]], [], [[1, 32, 32]]]  # 16k patches on 4 ranks


# --- the exchange: forced, by rule, or by price


def test_a_forced_exchange_is_recorded_for_every_split_frame():
    for kind in ("gather", "ring", "ulysses", "usp"):
        planned = _plan(ONE_BINDS, band_exchange=kind)
        assert len(planned.frames) == 1
        assert set(planned.exchanges.values()) == {kind}, kind
        # usp's groups: 2 of the 4 bands each (node-blind: the most that leaves two groups).
        assert planned.node_bands == ({name: 2 for name in planned.frames} if kind == "usp" else {})


def test_auto_gives_ulysses_and_usp_only_bands_about_even():
    """Ulysses and usp share a frame's (a group's) attention out by heads, evenly whatever the
    bands' rows: ``auto`` gives them only bands within ``EVEN_SPREAD`` of each other, or an
    uneven cut's small band would compute far more than its rows were costed at."""
    prices = exchange_prices(RULE, macs=True, ranks_per_node=8)
    even = [b.h * b.w for b in RULE.bands((1, 288, 288), 16)]  # 18 rows each
    assert prices.cheapest(even, None)[0] == "ulysses"
    uneven = [2 * even[0], *even[1:]]  # one band twice the others
    assert prices.cheapest(uneven, None)[0] not in ("ulysses", "usp")
    # Forced, the kind runs as asked: its price is the user's to pay.
    forced = exchange_prices(RULE, macs=True, ranks_per_node=8, forced="ulysses")
    assert forced.cheapest(uneven, None)[0] == "ulysses"
    across = tuple(i // 8 for i in range(16))
    assert prices.cheapest(even, across)[0] == "usp"
    assert prices.cheapest(uneven, across)[0] not in ("ulysses", "usp")


def test_usp_groups_divide_the_heads_and_fit_a_node_else_ring_by_rule():
    assert usp_degree(16, 64, 8) == 8  # a node's 8 ranks share 16 heads out; 8 rings of 8
    assert usp_degree(16, 16, None) == 8  # node-blind: the most that leaves two groups
    assert usp_degree(12, 24, 8) == 6 and usp_degree(16, 12, 8) == 4
    assert usp_degree(16, 3, 8) == 0 and usp_degree(16, 2, 8) == 0 and usp_degree(7, 10, 8) == 0
    assert usp_degree(0, 16, 8) == 0  # heads unknown (BandSupport without heads)
    planned = _plan(ONE_BINDS, heads=3, band_exchange="usp")  # 4 bands: no group divides 3
    assert set(planned.exchanges.values()) == {"ring"} and planned.node_bands == {}
    planned = _plan(ONE_BINDS, heads=6, band_exchange="usp", ranks_per_node=2)
    (name,) = planned.frames
    assert planned.exchanges[name] == "usp" and planned.node_bands[name] == 2
    # Each group of two consecutive bands sits on one node of two ranks.
    assert [r // 2 for r in _ranks(planned, name)] == [0, 0, 1, 1]


def test_a_frame_cut_into_more_bands_than_the_heads_runs_usp_with_each_group_on_one_node():
    """A 4032 px image (288 x 288 patches, 9.25 s of Qwen2-VL-7B's tower a step) among 63 small
    ones on 64 ranks of 8 a node: Ulysses alone stops at 16 bands (16 heads), ring and gather
    across nodes cost 0.8 s a band; usp cuts it into a multiple of 8 bands, each node's 8 bands
    one group (Ulysses on NVLink), the groups' ring across nodes hidden behind their attention
    (18 ms a band)."""
    grids = [[[1, 288, 288]]] + [[[1, 16, 16]] for _ in range(63)]
    planned = _plan(grids, ranks_per_node=8)
    (name,) = planned.frames
    ranks = _ranks(planned, name)
    assert planned.exchanges[name] == "usp" and planned.node_bands[name] == 8
    assert len(ranks) > 16 and len(ranks) % 8 == 0 and len(set(ranks)) == len(ranks)
    assert all(len({r // 8 for r in ranks[g : g + 8]}) == 1 for g in range(0, len(ranks), 8))
    mean = sum(planned.plan.loads_before) / 64
    assert _makespan(planned.plan) / mean < 1.35  # whole frame: 63x the mean


def test_ulysses_falls_back_to_ring_by_rule_where_the_heads_do_not_divide():
    planned = _plan(ONE_BINDS, heads=6, band_exchange="ulysses")  # 4 ranks, 6 heads
    (name,) = planned.frames
    assert len(set(_ranks(planned, name))) == 4
    assert planned.exchanges[name] == "ring"
    assert _plan(ONE_BINDS, heads=8, band_exchange="ulysses").exchanges[name] == "ulysses"


def test_auto_gathers_inside_a_node_where_collectives_dominate_and_not_across_nodes():
    """Per step, forward and backward of 32 layers, on an H100: a 24 x 24-patch frame in 3
    bands inside a node (NVLink, 11 us a collective; 3 ranks do not share 16 heads):
    gather 1.53 ms (one latency a layer forward, two steps of its backward's walk), ring
    1.86 ms (two latencies a layer and direction that its tiny blocks cannot hide). A 4032 px
    image (288 x 288) in 16 bands over 2 nodes (one 48 GB/s NIC a GPU, 30 us a collective):
    usp 11.8 ms (Ulysses among each node's 8 bands, a ring of the two nodes' blocks of 2
    heads behind their attention), Ulysses 39 ms (70 ms with every band on a node of its
    own), ring 330 ms, gather 481 ms."""
    prices = exchange_prices(RULE, macs=True, ranks_per_node=8)
    small = [b.h * b.w for b in RULE.bands((1, 24, 24), 3)]
    costs = {kind: max(prices.frame_prices(small, kind, None)) * MS for kind in ("gather", "ring")}
    assert math.isclose(costs["gather"], 1.53, rel_tol=0.01), costs
    assert math.isclose(costs["ring"], 1.86, rel_tol=0.01), costs
    assert prices.cheapest(small, None)[0] == "gather"
    large = [b.h * b.w for b in RULE.bands((1, 288, 288), 16)]
    across = (0,) * 8 + (1,) * 8
    costs = {k: max(prices.frame_prices(large, k, across)) * MS for k in ("gather", "ring")}
    costs["ulysses"] = max(prices.frame_prices(large, "ulysses", across)) * MS
    costs["usp"] = max(prices.frame_prices(large, "usp", across)) * MS
    apart = max(prices.frame_prices(large, "ulysses", tuple(range(16)))) * MS
    assert math.isclose(costs["usp"], 11.8, rel_tol=0.01), costs
    assert math.isclose(costs["ulysses"], 39.2, rel_tol=0.01), costs
    assert math.isclose(apart, 70.2, rel_tol=0.01), apart
    assert costs["usp"] < costs["ulysses"] < costs["ring"] < costs["gather"], costs
    assert prices.cheapest(large, across)[0] == "usp"
    # And as planned: the small frame gathers on one node, the large one goes usp across.
    planned = _plan([[[1, 24, 24]], [], []], min_band_patches=64)
    assert list(planned.exchanges.values()) == ["gather"]
    grids = [[[1, 288, 288]]] + [[[1, 16, 16]] for _ in range(15)]
    planned = _plan(grids, ranks_per_node=8)
    (name,) = planned.frames
    assert [r // 8 for r in _ranks(planned, name)] == [0] * 8 + [1] * 8
    assert planned.exchanges[name] == "usp" and planned.node_bands[name] == 8


def test_bytes_per_layer_and_direction_are_the_issues_formulas():
    """``4*N*d*(k-1)/k`` for gather and ring, ``8*N*d*(k-1)/k**2`` for Ulysses (even bands),
    the backward's on top (gather and ring fetch the keys and values again with their
    gradients: twice; Ulysses the same again)."""
    one_layer = BandRule(align=2, min_patches=64, exchange_layers=1, kv_bytes_per_patch=4 * 1280)
    patches, d = 4096, 1280
    for k in (2, 4, 8, 16):
        sizes = [patches // k] * k
        for kind, directions in (("gather", 3), ("ring", 3), ("ulysses", 2)):
            inside, across = frame_traffic(one_layer, sizes, kind, None)
            assert across == 0
            per_rank = inside / k / directions
            want = 8 * patches * d * (k - 1) / k**2 if kind == "ulysses" else 4 * patches * d
            want = want if kind == "ulysses" else want * (k - 1) / k
            assert per_rank == want, (k, kind)
    crossing = frame_traffic(one_layer, [1024] * 4, "gather", (0, 0, 1, 1))
    assert crossing[1] == 2 * crossing[0]  # each rank: one band from its node, two from the other


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 60), min_size=2, max_size=9), st.data())
def test_what_prices_gather_and_ring_is_the_sum_of_what_each_band_receives(sizes, data):
    """For any bands, ``received_patches`` (what ``frame_prices`` counts for gather and ring) is
    the sum of ``band_receives`` (what the runtime sends, checked on ranks in
    ``test_band_exchanges.py``), and the frame's ranks receive the same bytes under gather and
    ring: each band's keys and values reach every other band twice and its dK/dV come home once,
    whichever way they travel."""
    i = data.draw(st.integers(0, len(sizes) - 1))
    rule = BandRule(align=1, min_patches=1, exchange_layers=1, kv_bytes_per_patch=3)
    for kind in ("gather", "ring"):
        got = band_receives(rule, sizes, i, kind)
        assert sum(b for _, b in got) == 3 * received_patches(sizes, i, kind, sum(sizes))
    totals = [frame_traffic(rule, sizes, kind, None)[0] for kind in ("gather", "ring")]
    assert totals[0] == totals[1] == 3 * 3 * sum(sizes) * (len(sizes) - 1)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 60), min_size=2, max_size=9), st.sampled_from([None, "across"]))
def test_ring_bands_of_one_size_are_priced_by_the_band_before_them(sizes, where):
    """A ring band receives every block's accumulator but the band before's, so two bands of
    one size whose bands before differ receive different bytes and pay apart: for any bands,
    on one node or each on its own, the prices of two bands of one size differ by what they
    receive, times what a patch's transfer leaves exposed (these bands are too small to hide
    it)."""
    prices = exchange_prices(RULE, macs=True, ranks_per_node=8)
    nodes = None if where is None else tuple(range(len(sizes)))
    link = prices.inside if nodes is None else prices.across
    priced = prices.frame_prices(sizes, "ring", nodes)
    total = sum(sizes)
    for i, n in enumerate(sizes):
        exposed = RULE.kv_bytes_per_patch / link.bytes_per_cost - prices.pair_cost * n
        assert exposed > 0
        for j in range(i + 1, len(sizes)):
            if sizes[j] == n:
                apart = received_patches(sizes, j, "ring", total)
                apart -= received_patches(sizes, i, "ring", total)
                want = RULE.exchange_layers * apart * exposed
                assert math.isclose(priced[j] - priced[i], want, rel_tol=1e-6, abs_tol=1e-3)


def test_a_frame_spanning_nodes_pays_infiniband_and_its_latency():
    """A 64 x 64 frame in two bands gathers in 1.66 ms a step on one node (0.70 ms of it the
    collectives: 11 us, a layer and direction; the backward's fetches hide behind its
    attention) and 19.5 ms across two (30 us a collective, the forward's bytes at 48 GB/s
    instead of 350, and twice what the backward's attention cannot hide of them)."""
    prices = exchange_prices(RULE, macs=True, ranks_per_node=8)
    sizes = [b.h * b.w for b in RULE.bands((1, 64, 64), 2)]
    inside = max(prices.frame_prices(sizes, "gather", None)) * MS
    across = max(prices.frame_prices(sizes, "gather", (0, 1))) * MS
    latency_inside, latency_across = 64 * 11e-3, 64 * INTER_NODE_COLLECTIVE_SECONDS * 1e3
    forward_inside = 32 * RULE.kv_bytes_per_patch * sizes[1] / 350e9 * 1e3
    assert math.isclose(inside, latency_inside + forward_inside, rel_tol=1e-9)
    forward_across = forward_inside * 350 / 48
    hidden = 32 * sizes[1] * prices.pair_cost * sizes[0] * MS  # one block's attention a layer
    want = latency_across + forward_across + 2 * (forward_across - hidden)
    assert math.isclose(across, want, rel_tol=1e-9)
    assert math.isclose(inside, 1.66, rel_tol=0.01) and math.isclose(across, 19.5, rel_tol=0.01)


# --- how many bands, across nodes


def test_the_cap_is_lifted_across_nodes_where_the_priced_exchange_pays():
    """16 ranks, 8 a node: a 4032 px image is cut in 16 bands on both nodes (Ulysses, its
    all-to-all across one NIC a GPU still pays: the old cap was one node's 8 bands); a 160 x
    160 frame on a tower whose heads Ulysses cannot use is cut in 8, on one node (ring or gather
    across a NIC would cost more than the 8 more ranks save)."""
    large = [[[1, 288, 288]]] + [[[1, 16, 16]] for _ in range(15)]
    planned = _plan(large, ranks_per_node=8)
    (name,) = planned.frames
    assert len(set(_ranks(planned, name))) == 16
    middling = [[[1, 160, 160]]] + [[[1, 16, 16]] for _ in range(15)]
    planned = _plan(middling, heads=0, ranks_per_node=8)
    (name,) = planned.frames
    assert len(set(_ranks(planned, name))) == 8
    assert {r // 8 for r in _ranks(planned, name)} == {0}


@settings(max_examples=60, deadline=None)
@given(
    side=st.sampled_from([16, 48, 96, 160, 288]),
    width=st.sampled_from([16, 64, 288]),
    mean_share=st.floats(0.01, 0.9),
    cap=st.integers(2, 96),
    ranks_per_node=st.sampled_from([None, 8]),
)
def test_a_frame_above_every_band_count_gets_the_count_whose_dearest_band_costs_least(
    side, width, mean_share, cap, ranks_per_node
):
    """A frame no count of bands brings to the mean load gets the count (of those the rule
    allows, up to ``cap``) whose band share plus exchange is least, the fewer on ties:
    counts are searched from the most down and stop early, which must find what trying every
    count finds (a 4032 px frame: 72 counts priced before)."""
    unit = (1, side, width)
    cost = float(QWEN2_VL(*unit))
    mean = cost * mean_share
    config = fx_vitbal.BalanceConfig(ranks_per_node=ranks_per_node)
    prices = exchange_prices(RULE, macs=True, ranks_per_node=ranks_per_node)
    cut = cut_frame(unit, cost, mean, 1, cap, RULE, prices, config)
    values = {}
    for k in range(2, cap + 1):
        bands = RULE.bands(unit, k)
        if len(bands) < k:
            break
        _, priced = price_cut(bands, RULE, prices, prices.packed_nodes(k), config)
        values[k] = cost / k + max(priced)
    if any(value <= mean for value in values.values()):
        return  # a count reaches the mean: the fewest that does (another test's business)
    best = min(values, key=lambda k: (values[k], k), default=None)
    if best is None or values[best] >= cost:
        assert cut is None
    else:
        assert cut is not None and len(cut.bands) == best, (len(cut.bands), best, values)


def test_one_rank_a_node_plans_bands_as_node_blind_planning_does():
    planned = _plan(ONE_BINDS, ranks_per_node=1)
    assert [len(set(_ranks(planned, n))) for n in planned.frames] == [4]
    assert planned.frames == _plan(ONE_BINDS).frames


def test_a_frame_alone_on_empty_ranks_is_cut_as_evenly_as_its_rows_allow():
    """One frame, every other rank empty, costs by l**2 (no exchange priced): its bands'
    rows differ by at most one ``align`` block (2 rows), so the makespan is the even share's
    but for rounding. Planned as twice as many pieces, regrouped a rank a band: 48 rows in 8
    bands were 8, 8, 8, 8, 4, 4, 4, 4 (the pieces, 4 and 2 rows, were paired by count, not
    rows), a third above the mean; 16 rows in 3 bands were 4, 4, 8 (four pieces of the
    smallest band, one rank two) where 6, 6, 4 fit. Node-aware alike, nodes of 2 or 4 ranks,
    the last node short too (5 ranks, 4 a node: the lone rank got a 20-row band of 48)."""
    for ranks_per_node in (None, 2, 4):
        config = fx_vitbal.BalanceConfig(
            cost_model="quadratic", min_band_patches=64, ranks_per_node=ranks_per_node
        )
        settings = plan_settings(planner_spec_for(config, None, True, (2, 8, 256, False, 8)))
        for side in (16, 20, 30, 40, 48, 64, 96):
            for k in range(2, 9):
                planned = plan_step([[[1, side, side]]] + [[] for _ in range(k - 1)], settings)
                rows = [u[1] for u in planned.units_O[0]]
                assert sum(rows) == side, (ranks_per_node, side, k, rows)
                assert max(rows) - min(rows) <= 2, (ranks_per_node, side, k, rows)
                if k == 8 and side == 48:
                    assert rows == [6] * 8
                    assert _makespan(planned.plan) == side**4 / 8


def test_a_nodes_frames_are_poured_to_the_lowest_level_that_takes_them():
    """Two nodes of 8 ranks holding alike four frames of 1.6 to 3.3 times the mean load and a
    few thumbnails (a node of the documents mix at 2048 ranks): bands of at least 1,024
    patches. Poured by whole ``align`` blocks rounded down, every rank fell a sliver short, the
    node's tail spilled, and the level raised by the spill left the last rank at 0.81 of the
    mean and the fullest at 1.10; rounded to the nearest block and the level searched between
    one that spills and one that does not, the fullest rank ends at 1.03."""
    node = [[[1, 128, 98]], [], [], [[1, 14, 26], [1, 14, 8]], [[1, 18, 26]]]
    node += [[[1, 122, 66], [1, 112, 78]], [[1, 110, 74]], [[1, 14, 22]]]
    grids = node + node
    planned = _plan(grids, ranks_per_node=8, split_images=True)
    mean = sum(QWEN2_VL(*u) for units in grids for u in units) / len(grids)
    assert len(planned.frames) == 8
    assert _makespan(planned.plan) <= 1.05 * mean


# --- memory


def test_held_activations_follow_the_architecture():
    # 14 hidden-wide and 3 MLP-wide values a patch and layer in bf16: 52 * d bytes for MLP 4x.
    assert held_bytes_per_patch(QWEN2_VL) == 32 * 2 * (14 * 1280 + 3 * 5120)
    assert held_bytes_per_patch(QWEN2_VL) == 32 * 52 * 1280
    assert RULE.held_bytes_per_patch() == held_bytes_per_patch(QWEN2_VL)  # from the width alone


def _saved_values_per_patch(cls, config, side: int = 16) -> float:
    """Values autograd keeps for the backward of ``cls``'s tower on one ``side x side`` frame
    (distinct storages, without its weights and the input pixels), a patch."""
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    tower = cls._from_config(config)
    c = tower.config
    grid = torch.tensor([[1, side, side]])
    pixels = torch.randn(side * side, c.in_channels * c.temporal_patch_size * c.patch_size**2)
    held = {p.untyped_storage().data_ptr() for p in tower.parameters()}
    held.add(pixels.untyped_storage().data_ptr())
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in held:
            saved[storage.data_ptr()] = storage.nbytes() // t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        tower(pixels, grid_thw=grid)
    return sum(saved.values()) / side**2


def test_held_activations_cover_what_the_hugging_face_towers_keep():
    """Per layer and patch, the values each Hugging Face tower (SDPA, float32) keeps for its
    backward (measured: two depths' difference) are at most what ``cost.memory`` counts for
    its architecture (``integrations.hf_towers.architecture_cost``), and not far below it:
    a memory budget cut by the count fits (the count of 8 and 2 widths it replaced was
    1.26-1.43x below every tower here)."""
    from transformers.models.glm4v import modeling_glm4v as glm4v
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as qwen2_5_vl
    from transformers.models.qwen2_vl import modeling_qwen2_vl as qwen2_vl
    from transformers.models.qwen3_vl import modeling_qwen3_vl as qwen3_vl

    from fx_vitbal.integrations.hf_towers import architecture_cost

    small = dict(hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=64)
    towers = {  # family: (tower, its config at a depth)
        "qwen2_vl": (
            qwen2_vl.Qwen2VisionTransformerPretrainedModel,
            lambda depth: qwen2_vl.Qwen2VLVisionConfig(
                depth=depth, embed_dim=64, hidden_size=64, num_heads=4, mlp_ratio=2
            ),
        ),
        "qwen2_5_vl": (
            qwen2_5_vl.Qwen2_5_VisionTransformerPretrainedModel,
            lambda depth: qwen2_5_vl.Qwen2_5_VLVisionConfig(
                depth=depth, fullatt_block_indexes=list(range(depth)), window_size=112, **small
            ),
        ),
        "qwen3_vl": (
            qwen3_vl.Qwen3VLVisionModel,
            lambda depth: qwen3_vl.Qwen3VLVisionConfig(
                depth=depth, num_position_embeddings=144, deepstack_visual_indexes=[0], **small
            ),
        ),
        "glm4v": (
            glm4v.Glm4vVisionModel,
            lambda depth: glm4v.Glm4vVisionConfig(depth=depth, image_size=112, **small),
        ),
    }
    for family, (cls, config_at) in towers.items():
        kept = [_saved_values_per_patch(cls, config_at(depth)) for depth in (2, 4)]
        per_layer = (kept[1] - kept[0]) / 2
        architecture = architecture_cost(cls._from_config(config_at(4)))
        counted = held_bytes_per_patch(architecture) / architecture.depth / 2  # bf16 values
        assert 0.7 * counted <= per_layer <= counted, (family, per_layer, counted)


def test_a_band_spread_off_its_rank_goes_round_where_loads_tie_but_for_rounding():
    """Rank 2 holds both bands of a frame; every rank's load is 2 bands' but rank 1's, which
    lost one band and gained another of the same cost and ends a rounding below: the band goes
    to rank 3, the next after rank 2, not to rank 1 (where a third band would follow: four
    frames budget-cut in two on four ranks ended 2, 3, 2, 1 bands a rank)."""
    band = 0.1 + 0.2  # 0.30000000000000004
    loads = [2 * band, 2 * band - band + band - 1e-16, 2 * band, 2 * band]
    assert loads[1] < loads[3]
    dest = [2, 2]
    assert spread([(dest, 0), (dest, 1)], loads, [band, band])
    assert dest == [2, 3]


def test_a_budget_cuts_frames_that_bind_nothing_on_ranks_of_their_own():
    """Four equal 64 x 64 frames (8.7 GB of activations each) on four ranks: balanced, no plan
    of whole units moves anything; a 5 GB budget cuts each in two bands of at most 5 GB, a 3 GB
    one in three of at most 3 GB, each band on a rank of its own, kept though the makespan gains
    nothing, and every rank computes as many bands (three-band frames spread one after another
    left one rank four and another two: ``band_plan._level_bands``)."""
    grids = [[[1, 64, 64]] for _ in range(4)]
    assert not _plan(grids).frames
    held = held_bytes_per_patch(QWEN2_VL)
    for budget, k in ((5 * 10**9, 2), (3 * 10**9, 3)):
        assert math.ceil(64 * 64 * held / budget) == k
        for ranks_per_node in (None, 2):
            planned = _plan(grids, memory_budget=budget, ranks_per_node=ranks_per_node)
            assert len(planned.frames) == 4
            for name, indices in planned.frames.items():
                bands = [planned.units_O[name[0]][i] for i in indices]
                assert len(bands) == k
                assert all(unit_rows(b) * held <= budget for b in bands)
                assert len(set(_ranks(planned, name))) == len(bands)
            per_rank = [0] * 4
            for name in planned.frames:
                for r in _ranks(planned, name):
                    per_rank[r] += 1
            assert per_rank == [k] * 4, (budget, ranks_per_node, per_rank)


def test_bands_a_budget_needs_stay_on_their_frames_node_and_the_ranks_level():
    """The documents mix on 4 nodes of 8 ranks, 2 images a rank, 4 GiB a rank: frames the
    budget cuts into no more bands than a node has ranks keep them on one node (moved to other
    nodes' least loaded ranks, 7 frames paid for crossing nodes and the plan ended at an
    imbalance of 0.23), and the loads end within 10% of the mean (0.056)."""
    from fx_vitbal.tools.workloads import sample_batches

    planned = _plan(
        sample_batches(32, 2, mix="documents", seed=0), ranks_per_node=8, memory_budget=4 * 2**30
    )
    held = held_bytes_per_patch(QWEN2_VL)
    assert len(planned.frames) > 20
    for name, indices in planned.frames.items():
        bands = [planned.units_O[name[0]][i] for i in indices]
        assert all(unit_rows(b) * held <= 4 * 2**30 for b in bands)
        if len(bands) <= 8:
            assert len({r // 8 for r in _ranks(planned, name)}) == 1, name
    assert planned.plan.imbalance_after < 0.1


def _rows(planned) -> list[int]:
    """The pixel rows (patches) each rank computes in ``planned``."""
    return [
        sum(unit_rows(planned.units_R[o][i]) for o, i in assigned)
        for assigned in planned.plan.assignment
    ]


def test_a_memory_budget_bounds_what_each_rank_holds_bands_and_whole_frames_together():
    """Rank 1 holds three frames (68x72, 72x6 and 94x80 patches), the other three ranks none,
    and each rank may hold 4,818 patches of activations (10.3 GB): both large frames exceed it
    and are cut, and every rank ends within it, its bands and whole frames together (a budget
    that bounded each band alone left a rank with bands of both frames, 4,848 patches), by
    nodes of two ranks and node-blind."""
    held = held_bytes_per_patch(QWEN2_VL)
    grids = [[], [[1, 68, 72], [1, 72, 6], [1, 94, 80]], [], []]
    for ranks_per_node in (None, 2):
        planned = _plan(grids, memory_budget=4818 * held, ranks_per_node=ranks_per_node)
        assert len(planned.frames) == 2
        assert max(_rows(planned)) <= 4818, (ranks_per_node, _rows(planned))
        assert planned.plan.cap_respected
        assert "above the row cap" not in describe_plan(planned, 0)


def test_a_memory_budget_the_layout_breaks_is_kept_though_balancing_gains_nothing():
    """A 60x60 frame on rank 0 binds the step alone and nine 20x20 frames sit on rank 1 (3,600
    patches each rank, two ranks with one 10x10 frame): no plan of whole frames lowers the
    makespan, so none was applied; with 2,500 patches a rank, rank 1 gives frames away anyway
    and the lone frame alone may exceed it (the cap's exception), or is cut where bands run."""
    held = held_bytes_per_patch(QWEN2_VL)
    grids = [[[1, 60, 60]], [[1, 20, 20]] * 9, [[1, 10, 10]], [[1, 10, 10]]]
    assert not _plan(grids, split_images=False).plan.applied
    whole = _plan(grids, memory_budget=2500 * held, split_images=False)
    assert whole.plan.applied and whole.plan.cap_respected
    assert _rows(whole)[0] == 3600 and max(_rows(whole)[1:]) <= 2500
    cut = _plan(grids, memory_budget=2500 * held)
    assert len(cut.frames) == 1 and max(_rows(cut)) <= 2500


def test_a_budget_no_plan_keeps_is_reported_and_every_frame_still_computed_once():
    """Two 64x64 frames on two ranks, 3,000 patches a rank: each frame is cut into two bands
    that fit, but the ranks hold 8,192 patches between them; the plan says it breaks the cap
    (``Plan.cap_respected``, the verbose line) and still computes every row once."""
    held = held_bytes_per_patch(QWEN2_VL)
    planned = _plan([[[1, 64, 64]], [[1, 64, 64]]], memory_budget=3000 * held)
    assert len(planned.frames) == 2
    assert sorted(_rows(planned)) == [4096, 4096]
    assert not planned.plan.cap_respected
    assert "above the row cap (max_len_ratio or memory budget)" in describe_plan(planned, 0)


def test_a_pour_passes_over_ranks_without_room_for_a_band():
    """A 40x40 frame (20 blocks of 80 patches, 0.1 a block) poured at level 1.0 into three
    empty ranks of a node, rank 0 already computing 1,500 patches under a cap of 1,600: it
    takes the one block it has room for, not the ten its load allows (2,300 patches), and the
    other ranks the rest, all within the cap."""
    loads, rows = [0.0, 0.0, 0.0], [1500, 0, 0]
    give, _, spilled = wrap(
        loads, rows, [0, 1, 2], 0, 0, (1, 40, 40), 2.0, RULE, 20, 0.0, 1.0, 1600
    )
    assert give == {0: 1, 1: 10, 2: 9} and spilled == 0.0
    assert rows == [1580, 800, 720]


def test_rows_above_a_budget_go_to_any_band_of_their_frame_with_room():
    """Two frames on rank 0 of three (18x32 and 42x20 patches), 566 patches a rank: both are
    cut, and where no whole band fits elsewhere the rows a rank holds above the budget go to
    a band of the same frame whose rank has room, the bands between shifted along the frame
    (rows shifted only to the next band left a rank above it). Every band stays a run of its
    frame's rows (the property test checks the general case)."""
    held = held_bytes_per_patch(QWEN2_VL)
    grids = [[[1, 18, 32], [1, 42, 20]], [], []]
    planned = _plan(grids, memory_budget=566 * held, ranks_per_node=2, min_band_patches=64)
    assert len(planned.frames) == 2
    assert max(_rows(planned)) <= 566 and planned.plan.cap_respected
    for name, indices in planned.frames.items():
        bands = [planned.units_O[name[0]][i] for i in indices]
        assert [b.first_row for b in bands] == [
            sum(b.h for b in bands[:k]) for k in range(len(bands))
        ]


def test_a_tight_budget_at_scale_is_kept():
    """The documents mix on 512 ranks of 8 a node, one image a rank, 10 GiB a rank (1.2x the
    mean rank's activations): the pour, counting no rows, left ranks at 10.0-10.4 GiB that no
    repair could bring back; pouring within each rank's room keeps every rank within it."""
    from fx_vitbal.tools.workloads import sample_batches

    held = held_bytes_per_patch(QWEN2_VL)
    for seed in (0, 2):
        grids = sample_batches(512, 1, mix="documents", seed=seed)
        planned = _plan(grids, ranks_per_node=8, memory_budget=10 * 2**30)
        assert planned.frames
        assert max(_rows(planned)) * held <= 10 * 2**30, seed
        assert planned.plan.cap_respected


def test_bands_keep_the_row_cap():
    """Four ranks as two nodes of two, ``max_len_ratio=1.1`` (3,174 rows a rank): a 68x80
    frame is cut into bands, poured by cost, which counts no rows, and the plan ended with a
    rank at 3,212 rows; units moved off it keep the cap."""
    grids = [
        [[1, 26, 2], [1, 68, 80], [1, 54, 10]],
        [[1, 30, 30]],
        [[1, 50, 62], [1, 2, 56], [1, 28, 50]],
        [],
    ]
    planned = _plan(grids, max_len_ratio=1.1, ranks_per_node=2)
    assert planned.frames
    assert max(_rows(planned)) <= 3174
    assert planned.plan.cap_respected


# --- uneven bands that close a gap


def test_an_uneven_cut_closes_the_gap_whole_frames_leave():
    """Three large frames (40x40, 36x36, 32x32 patches) on rank 0, two small ones on rank 1,
    nothing binds the step: the best plan of whole frames ends 8% above the mean. One frame is
    cut in two bands of different sizes, one on each rank: the loads end level to within half
    of one ``align`` block of the frame (rows move in whole blocks; each band paying its
    exchange, 0.7 and 1.7 ms a step at NVLink rates) and the makespan falls by over a quarter of the
    gap."""
    grids = [[[1, 40, 40], [1, 36, 36], [1, 32, 32]], [[1, 16, 16], [1, 8, 8]]]
    planned = _plan(grids, min_gain=0.0, min_band_patches=64)
    whole = _plan(grids, min_gain=0.0, min_band_patches=64, split_images=False)
    mean = sum(QWEN2_VL(*u) for g in grids for u in g) / 2
    assert _makespan(whole.plan) > 1.07 * mean
    (name,) = planned.frames
    bands = [planned.units_O[name[0]][i] for i in planned.frames[name]]
    assert len(bands) == 2 and bands[0].h != bands[1].h
    assert sorted(_ranks(planned, name)) == [0, 1]
    block = QWEN2_VL(1, bands[0].full_h, bands[0].w) * RULE.align / bands[0].full_h
    assert planned.plan.imbalance_after <= block / 2 / mean
    assert _makespan(whole.plan) - _makespan(planned.plan) > (_makespan(whole.plan) - mean) / 4


# --- every plan


grids_strategy = st.lists(
    st.lists(
        st.tuples(st.integers(1, 2), st.integers(1, 80), st.integers(1, 80)).map(
            lambda g: [g[0], 2 * g[1], 2 * g[2]]
        ),
        max_size=4,
    ),
    min_size=2,
    max_size=10,
)


@settings(max_examples=120, deadline=None)
@given(
    grids=grids_strategy,
    ranks_per_node=st.sampled_from([None, 1, 2, 4]),
    exchange=st.sampled_from(["auto", "gather", "ring", "ulysses"]),
    budget=st.sampled_from([None, 4 * 10**9, 12 * 10**9]),
    heads=st.sampled_from([0, 6, 16]),
)
def test_every_plan_cuts_frames_into_aligned_bands_covering_them_once_and_alike(
    grids, ranks_per_node, exchange, budget, heads
):
    config = {
        "ranks_per_node": ranks_per_node,
        "band_exchange": exchange,
        "memory_budget": budget,
        "min_band_patches": 256,
    }
    planned = _plan(grids, heads, **config)
    again = _plan(grids, heads, **config)
    assert planned.plan.assignment == again.plan.assignment
    assert (planned.units_O, planned.frames, planned.exchanges) == (
        again.units_O,
        again.frames,
        again.exchanges,
    )
    computed = sorted(pair for assigned in planned.plan.assignment for pair in assigned)
    assert computed == sorted(
        (r, i) for r, us in enumerate(planned.units_R) for i in range(len(us))
    )
    for grid, units in zip(grids, planned.units_O, strict=True):
        assert sum(unit_rows(u) for u in units) == sum(t * h * w for t, h, w in grid)
    assert set(planned.exchanges) == set(planned.frames)
    for name, indices in planned.frames.items():
        bands = [planned.units_O[name[0]][i] for i in indices]
        assert indices == list(range(indices[0], indices[0] + len(indices)))  # consecutive
        assert all(is_band(b) for b in bands) and len(bands) >= 2
        assert bands[0].first_row == 0 and sum(b.h for b in bands) == bands[0].full_h
        for before, after in zip(bands, bands[1:], strict=False):
            assert after.first_row == before.first_row + before.h
        assert all(b.first_row % 2 == 0 and b.h % 2 == 0 for b in bands)
        assert all(b.h * b.w >= 256 for b in bands)
        ranks = _ranks(planned, name)
        assert len(set(ranks)) == len(ranks)  # a band a rank
        kind = planned.exchanges[name]
        if exchange != "auto":
            divides = heads and heads % len(ranks) == 0
            assert kind == (exchange if exchange != "ulysses" or divides else "ring")
        elif kind == "ulysses":
            assert heads and heads % len(ranks) == 0
    cap = max(sum(t * h * w for t, h, w in grid) for grid in grids)  # the default row cap
    if budget is not None:
        cap = min(cap, budget // held_bytes_per_patch(QWEN2_VL))
    counts = [len(assigned) for assigned in planned.plan.assignment]
    keeps = all(n <= cap or c <= 1 for n, c in zip(_rows(planned), counts, strict=True))
    assert planned.plan.cap_respected == keeps  # what the plan says of the cap is true
    if budget is not None:  # each band within it, or as many bands as ranks and rows allow
        held = held_bytes_per_patch(QWEN2_VL)
        for name, indices in planned.frames.items():
            bands = [planned.units_O[name[0]][i] for i in indices]
            most = len(RULE.bands((1, bands[0].full_h, bands[0].w), len(grids)))
            assert len(bands) == most or all(unit_rows(b) * held <= budget for b in bands)
        for units in planned.units_O:
            for u in units:
                if not is_band(u) and u[0] == 1 and unit_rows(u) * held > budget:
                    assert len(RULE.bands(u, 2)) == 1 or u[1] * u[2] < 2 * 256, u


@settings(max_examples=60, deadline=None)
@given(
    grids=grids_strategy,
    ranks_per_node=st.sampled_from([None, 2]),
    budget=st.sampled_from([None, 4 * 10**9]),
)
def test_replica_sets_plan_bands_covering_each_frame_once(grids, ranks_per_node, budget):
    """Pairs of ranks holding one batch (replica sets) plan bands by the flat path: each
    split frame's bands aligned, in order, covering it, each computed once."""
    sets = [(2 * s, 2 * s + 1) for s in range(len(grids))]
    per_rank = [grid for grid in grids for _ in range(2)]
    config = {"ranks_per_node": ranks_per_node, "memory_budget": budget, "min_band_patches": 256}
    planned = _plan(per_rank, sets=sets, **config)
    assert planned.plan.assignment == _plan(per_rank, sets=sets, **config).plan.assignment
    for grid, units in zip(grids, planned.units_O, strict=True):
        assert sum(unit_rows(u) for u in units) == sum(t * h * w for t, h, w in grid)
    computed = sorted(pair for assigned in planned.plan.assignment for pair in assigned)
    held = planned.units_R
    assert computed == sorted((r, i) for r, us in enumerate(held) for i in range(len(us)))
    assert set(planned.exchanges) == set(planned.frames)
    for name, indices in planned.frames.items():
        bands = [planned.units_O[name[0]][i] for i in indices]
        assert bands[0].first_row == 0 and sum(b.h for b in bands) == bands[0].full_h
        assert all(b.first_row % 2 == 0 and b.h % 2 == 0 and b.h * b.w >= 256 for b in bands)


def test_two_bands_of_a_frame_on_one_rank_are_priced_as_the_gather_the_runtime_runs():
    """Plans put a band a rank, but a cut priced on fewer ranks than bands (two on one) is
    what the runtime gathers, whatever the kind: forced ``usp`` there divided by a Ulysses
    group of no bands (five bands on four ranks). On five ranks the forced kind holds (five
    bands divide neither the heads nor into groups: ``ulysses`` and ``usp`` become ``ring``)."""
    bands = RULE.bands((1, 96, 96), 5)
    for forced in ("auto", "gather", "ulysses", "ring", "usp"):
        config = fx_vitbal.BalanceConfig(band_exchange=forced)
        priced = exchange_prices(RULE, macs=True, ranks_per_node=8, forced=forced)
        for prices in (priced, None):
            kind, _ = price_cut(bands, RULE, prices, None, config, ranks=[0, 0, 1, 2, 3])
            assert kind == "gather", (forced, prices)
            if forced != "auto":
                kind, _ = price_cut(bands, RULE, prices, None, config, ranks=[0, 1, 2, 3, 4])
                assert kind == ("gather" if forced == "gather" else "ring"), (forced, prices)


def test_a_plan_runs_no_garbage_collection_and_makes_no_reference_cycles():
    """A 256-rank step of the documents mix, planned with bands by nodes of 8, allocates far
    past the collector's first threshold (700 objects) and holds much of it at once (13
    collections ran in it before, one of them of the middle generation): no collection runs while it
    plans (the collector is paused inside, then on again; at most one of the young generation
    runs as it returns, for what the plan keeps), it makes no reference cycles (nothing is left
    for a collection to find), and it leaves a collector that was off, off."""
    import gc

    from fx_vitbal.tools.workloads import sample_batches

    grids = sample_batches(256, 1, mix="documents", seed=0)
    config = fx_vitbal.BalanceConfig(ranks_per_node=8)
    settings = plan_settings(planner_spec_for(config, QWEN2_VL, True, (2, 32, 1280, False, 16)))
    collections = []

    def heard(phase, info):
        if phase == "start":
            collections.append(info["generation"])

    assert gc.isenabled()
    gc.collect()
    gc.callbacks.append(heard)
    try:
        planned = plan_step(grids, settings)
    finally:
        gc.callbacks.remove(heard)
    assert planned.frames and collections in ([], [0])
    assert gc.isenabled()
    gc.disable()
    try:
        del planned
        plan_step(grids, settings)
        assert not gc.isenabled()
        assert gc.collect() == 0  # unreachable objects found: none
    finally:
        gc.enable()
