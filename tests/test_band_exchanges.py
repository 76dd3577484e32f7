"""Each exchange a split frame's ranks can run (``BalanceConfig.band_exchange``: gather, ulysses,
ring, usp), forced, gives the unsplit run's outputs and gradients; its messages go among the
frame's ranks only, and autograd keeps a band rank's own rows, not the whole frame's.

4 gloo ranks as 2 nodes of 2 (``ranks_per_node=2``) where the planner may span nodes; the
reference tower in float64 on the eager, in-place, planned-ahead, replica-set and compiled
(tensor form, ``fullgraph=True``) paths, and
the Hugging Face Qwen2-VL (every kind, under gradient checkpointing), Qwen2.5-VL, Qwen3-VL and
GLM-4V towers in float32.
"""

import copy
import dataclasses
import functools

import pytest
import torch
import torch.distributed as dist
from dist_utils import fullgraph_capture, record_collectives, run_ranks

import fx_vitbal
from fx_vitbal.tools.models import QwenStyleViT, ViTConfig
from fx_vitbal.tools.omni import make_inputs

KINDS = ("gather", "ulysses", "ring", "usp")
# Rank 0's 32x32-patch frame binds the step: split into a band on every rank (rank 3 has no
# image of its own). Costs by l**2: no exchange priced, so the split is the planner's to make.
GRIDS = [[[1, 32, 32]], [[1, 4, 4]], [[1, 8, 4]], []]
CONFIG = fx_vitbal.BalanceConfig(cost_model="quadratic", min_band_patches=64)


def _loss(outputs) -> torch.Tensor:
    # Position-dependent: a row restored to the wrong slot changes the loss and its gradients.
    return sum(
        (x * torch.linspace(-1, 1, x.numel(), dtype=x.dtype).view_as(x)).sum() for x in outputs
    )


def _step(vit, pixels, grid, call) -> tuple[list[torch.Tensor], list]:
    """Outputs, then pixel and all-reduced parameter gradients, of ``call(pixels, grid)``."""
    pixels = pixels.detach().requires_grad_(True)
    embeds, _, deep = call(pixels, grid)
    params = list(vit.parameters())
    grads = torch.autograd.grad(_loss([embeds, *deep]), [pixels, *params])
    flat = torch.cat([g.flatten() for g in grads[1:]])
    dist.all_reduce(flat)
    return [embeds.detach(), *(d.detach() for d in deep), grads[0], flat]


def _close(got, want, tolerance: float) -> float:
    """The largest difference of ``got`` from ``want`` relative to ``want``'s scale."""
    return max(
        float((g - w).abs().max() / (w.abs().max() + 1e-30)) if w.numel() else 0.0
        for g, w in zip(got, want, strict=True)
    )


def _reference(rank: int) -> tuple:
    """The reference tower (4 heads, float64), this rank's batch of ``GRIDS`` and its unbalanced
    step."""
    torch.manual_seed(0)
    vit = QwenStyleViT(ViTConfig(deepstack_indexes=(0,))).double()
    _, pixels, grid = make_inputs(GRIDS[rank], in_dim=24, seed=rank, dtype=torch.float64)
    return vit, pixels, grid, _step(vit, pixels, grid, vit)


def _balanced(vit, pixels, grid, config) -> tuple:
    """``_step`` through ``dp_balance_vit_encoder``: its results, the call's ``BalanceStats``
    and the collectives it issued."""
    return _balanced_by(
        vit,
        pixels,
        grid,
        lambda p, g: fx_vitbal.dp_balance_vit_encoder(vit, p, g, config=config),
    )


def _balanced_by(vit, pixels, grid, call) -> tuple:
    """``_step`` through ``call``, its ``BalanceStats`` and the collectives it issued."""
    stats = []
    handle = fx_vitbal.add_stats_callback(stats.append)
    with record_collectives() as issued:
        got = _step(vit, pixels, grid, call)
    handle.remove()
    return got, stats[-1], issued


def _reference_kinds(rank: int, world: int) -> dict:
    vit, pixels, grid, want = _reference(rank)
    results = {}
    for kind in KINDS:
        config = dataclasses.replace(CONFIG, band_exchange=kind, ranks_per_node=2)
        got, stats, issued = _balanced(vit, pixels, grid, config)
        results[kind] = {
            "difference": _close(got, want, 1e-9),
            "split": (stats.split_units, stats.band_exchanges),
            "p2p": [(phase, peers) for phase, name, _, peers in issued if name == "p2p"],
            "backward messages": [
                n for p, name, n, _ in issued if name == "p2p" and p == "backward"
            ],
        }
    return results


def test_each_exchange_kind_forced_across_nodes_gives_the_unsplit_outputs_and_gradients():
    results = run_ranks(_reference_kinds, 4)
    for kind in KINDS:
        for rank, res in enumerate(r[kind] for r in results):
            assert res["difference"] <= 1e-9, (kind, rank, res["difference"])
            # The frame in four bands, one a rank, across both nodes, by the kind forced (usp:
            # ulysses inside each node's two bands, ring across the two nodes).
            assert res["split"] == (4, (kind,)), (kind, rank, res["split"])
            assert res["p2p"], (kind, rank)  # every rank holds a band: each exchanged
            assert {peer for _, peers in res["p2p"] for peer in peers} <= {0, 1, 2, 3} - {rank}
            if kind in ("gather", "ring"):  # a block and a block's dK/dV in flight each way,
                # never the frame's (gather's backward once fetched all 3 blocks at once)
                assert max(res["backward messages"]) == 4, (kind, rank, res["backward messages"])


def _compiled_kinds(rank: int, world: int) -> dict:
    """Each kind forced through the tensor form: ``dp_balance_vit_encoder`` compiled with
    ``fullgraph=True`` (the reference tower declares ``compiled=True``), whose whole-frame
    attention runs inside ``vitbal::band_attention`` and its backward."""
    vit, pixels, grid, want = _reference(rank)
    results = {}
    for kind in KINDS:
        config = dataclasses.replace(CONFIG, band_exchange=kind, ranks_per_node=2)

        def balanced(p, g, config=config):
            return fx_vitbal.dp_balance_vit_encoder(vit, p, g, config=config)

        # Eagerly first: the messages the kind sends, and the settings made before the trace
        # (dynamo before 2.13 needs them).
        _, _, eager = _balanced(vit, pixels, grid, config)
        compiled = torch.compile(balanced, backend="aot_eager", fullgraph=True)
        with fullgraph_capture():
            got, stats, issued = _balanced_by(vit, pixels, grid, compiled)
            # Two calls' forwards, then their backwards (micro-batches in a pipeline): each
            # backward runs with the layout its graph saved, whatever the state kept.
            twice = _step(vit, pixels, grid, functools.partial(_two_calls, compiled))
        results[kind] = {
            "difference": _close(got, want, 1e-9),
            "twice": _close(
                twice, _step(vit, pixels, grid, functools.partial(_two_calls, vit)), 1e-9
            ),
            "split": (stats.split_units, stats.band_exchanges),
            "p2p peers": {peer for _, name, _, peers in issued if name == "p2p" for peer in peers},
            "messages": (_messages(issued), _messages(eager)),
        }
    return results


def _messages(issued) -> dict[str, list]:
    """Per phase, the peers of each point-to-point batch in order: each kind's own pattern."""
    return {
        phase: [peers for p, name, _, peers in issued if p == phase and name == "p2p"]
        for phase in ("forward", "backward")
    }


def _two_calls(call, pixels, grid) -> tuple:
    """``call`` on ``pixels`` and on them reversed, before any backward; the outputs summed."""
    (embeds, window_index, deep), (again, _, deep_again) = (
        call(pixels, grid),
        call(pixels.flip(0), grid),
    )
    return embeds + again, window_index, [a + b for a, b in zip(deep, deep_again, strict=True)]


def test_each_exchange_kind_runs_in_the_compiled_tensor_form_exactly():
    for rank, by_kind in enumerate(run_ranks(_compiled_kinds, 4, timeout=600)):
        for kind, res in by_kind.items():
            assert res["difference"] <= 1e-9, (kind, rank, res["difference"])
            assert res["twice"] <= 1e-9, (kind, rank, res["twice"])
            # The kind forced ran: its forward messages are the eager call's, batch by batch;
            # gather's and ring's backward too (ulysses and usp run their forward again there).
            compiled, eager = res["messages"]
            assert compiled["forward"] == eager["forward"], (kind, rank)
            # The eager backward first fetches the pixels again (every rank here moves some:
            # ``runtime.transport.refetch``); a compiled graph keeps them.
            eager["backward"] = eager["backward"][1:]
            if kind in ("gather", "ring"):
                assert compiled["backward"] == eager["backward"], (kind, rank)
            else:
                assert len(compiled["backward"]) > len(eager["backward"]), (kind, rank)
            assert res["split"] == (4, (kind,)), (kind, rank, res["split"])
            assert res["p2p peers"] and res["p2p peers"] <= {0, 1, 2, 3} - {rank}, (kind, rank)


# One frame of 32x32 patches split in two (bands of at least 512 patches): two ranks exchange,
# the other two hold whole images only and must send nothing a layer.
TWO_BANDS = dataclasses.replace(CONFIG, min_band_patches=512)


def _two_band_ranks(rank: int, world: int) -> dict:
    vit, pixels, grid, want = _reference(rank)
    results = {}
    for kind in KINDS[:3]:  # (usp needs two groups of two bands: with two bands, ring)
        config = dataclasses.replace(TWO_BANDS, band_exchange=kind)
        got, _, issued = _balanced(vit, pixels, grid, config)
        results[kind] = {
            "difference": _close(got, want, 1e-9),
            "p2p": [(phase, peers) for phase, name, _, peers in issued if name == "p2p"],
            "others": [(phase, name) for phase, name, _, _ in issued if name != "p2p"],
        }
    return results


def test_a_rank_without_a_band_issues_no_per_layer_exchange():
    results = run_ranks(_two_band_ranks, 4)
    for kind in KINDS[:3]:
        per_rank = [r[kind] for r in results]
        assert all(res["difference"] <= 1e-9 for res in per_rank), kind
        band_ranks = [rank for rank, res in enumerate(per_rank) if res["p2p"]]
        assert len(band_ranks) == 2, (kind, band_ranks)
        for rank in band_ranks:  # each talks to the frame's other rank only
            peers = {peer for _, peers in per_rank[rank]["p2p"] for peer in peers}
            assert peers == set(band_ranks) - {rank}, (kind, rank, peers)
        # The whole group's collectives (gather, the two moves) stay in lockstep.
        assert len({tuple(res["others"]) for res in per_rank}) == 1, kind


def _paths(rank: int, world: int) -> dict:
    """Each kind across nodes on the other paths: a ViT balanced in place, a plan made ahead,
    and replica sets (ranks 0-1 and 2-3 each hold one batch)."""
    return {kind: _paths_of(rank, kind) for kind in KINDS}


def _paths_of(rank: int, kind: str) -> dict:
    config = dataclasses.replace(CONFIG, band_exchange=kind, ranks_per_node=2)
    vit, pixels, grid, want = _reference(rank)
    stats = []
    handle = fx_vitbal.add_stats_callback(stats.append)
    fx_vitbal.enable_vit_balance(vit, config=config)
    in_place = _step(vit, pixels, grid, vit)
    in_place_split = stats[-1].band_exchanges
    plan_group = dist.new_group(backend="gloo")
    as_stepped = pixels.detach().requires_grad_(True)  # the step's pixels need gradients
    planned = fx_vitbal.plan_ahead(vit, as_stepped, grid, group=plan_group, config=config)
    fx_vitbal.use_plan(vit, planned)
    ahead = _step(vit, pixels, grid, vit)
    ahead_split = stats[-1].band_exchanges
    # Replica sets: ranks 0-1 hold set 0's batch (the large frame), ranks 2-3 set 1's.
    s = rank // 2
    set_grids = [[[1, 32, 32], [1, 4, 4]], [[1, 8, 4]]][s]
    _, set_pixels, set_grid = make_inputs(set_grids, in_dim=24, seed=s, dtype=torch.float64)
    plain = vit._vitbal_original_forward

    def replicated(p, g):
        return fx_vitbal.dp_balance_vit_encoder(
            vit, p, g, config=config, replica_group=[2 * s, 2 * s + 1]
        )

    embeds, _, deep = plain(set_pixels, set_grid)
    got_embeds, _, got_deep = replicated(set_pixels, set_grid)
    handle.remove()
    return {
        "in place": (_close(in_place, want, 1e-9), in_place_split),
        "ahead": (_close(ahead, want, 1e-9), ahead_split),
        "replicas": (
            _close([got_embeds, *got_deep], [embeds, *deep], 1e-9),
            stats[-1].band_exchanges,
        ),
    }


def test_each_kind_across_nodes_on_every_path_gives_the_unsplit_outputs():
    for rank, by_kind in enumerate(run_ranks(_paths, 4)):
        for kind, res in by_kind.items():
            for path, (difference, exchanges) in res.items():
                assert difference <= 1e-9, (kind, path, rank, difference)
                assert exchanges == (kind,), (kind, path, rank, exchanges)


def _three_ranks_of_four_heads(rank: int, world: int) -> tuple:
    vit, pixels, grid, want = _reference(rank)  # 4 heads
    results = []
    for kind in ("ulysses", "usp"):
        config = dataclasses.replace(CONFIG, band_exchange=kind)
        got, stats, _ = _balanced(vit, pixels, grid, config)
        results.append((_close(got, want, 1e-9), stats.split_units, stats.band_exchanges))
    return results


def test_ulysses_with_heads_that_do_not_divide_among_the_frames_ranks_falls_back_to_ring():
    # 4 heads, 3 bands: ulysses cannot share the heads out, usp finds no two groups of two.
    for rank_results in run_ranks(_three_ranks_of_four_heads, 3):
        for difference, split_units, exchanges in rank_results:
            assert split_units == 3 and exchanges == ("ring",)  # by rule
            assert difference <= 1e-9


def _flat_grads(module: torch.nn.Module) -> torch.Tensor:
    """Every parameter's gradient, zeros for one that got none (an output nobody read)."""
    return torch.cat(
        [p.grad.flatten() if p.grad is not None else 0 * p.flatten() for p in module.parameters()]
    )


# A small vision config the Qwen2.5-VL, Qwen3-VL and GLM-4V towers share (4 heads: ulysses on
# 4 ranks shares one out to each).
SMALL = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=64)


def _hf_towers(rank: int, world: int) -> dict:
    from transformers.models.glm4v import modeling_glm4v
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl
    from transformers.models.qwen2_vl import modeling_qwen2_vl
    from transformers.models.qwen3_vl import modeling_qwen3_vl

    towers = {
        "qwen2_vl": (
            modeling_qwen2_vl.Qwen2VisionTransformerPretrainedModel,
            modeling_qwen2_vl.Qwen2VLVisionConfig(
                depth=2, embed_dim=64, hidden_size=64, num_heads=4, mlp_ratio=2
            ),
            KINDS,
        ),
        "qwen2_5_vl": (
            modeling_qwen2_5_vl.Qwen2_5_VisionTransformerPretrainedModel,
            modeling_qwen2_5_vl.Qwen2_5_VLVisionConfig(
                **SMALL,
                fullatt_block_indexes=[1],
                window_size=112,
            ),
            ("ring",),
        ),
        "qwen3_vl": (
            modeling_qwen3_vl.Qwen3VLVisionModel,
            modeling_qwen3_vl.Qwen3VLVisionConfig(
                **SMALL,
                num_position_embeddings=144,
                deepstack_visual_indexes=[0],
            ),
            ("ulysses",),
        ),
        "glm4v": (
            modeling_glm4v.Glm4vVisionModel,
            modeling_glm4v.Glm4vVisionConfig(
                **SMALL,
                image_size=112,
            ),
            ("gather",),
        ),
    }
    # Whole windows of 8 rows (Qwen2.5-VL); every rank an image (a tower cannot run on none).
    grids = [[[1, 32, 32]], [[1, 8, 8]], [[1, 8, 16]], [[1, 8, 8]]]
    results = {}
    for family, (cls, original_config, kinds) in towers.items():
        original_config._attn_implementation = "sdpa"
        for kind in kinds:
            vision_config = copy.deepcopy(original_config)  # balancing sets its attention
            torch.manual_seed(0)
            tower = cls._from_config(vision_config)
            width = tower.config.in_channels * tower.config.temporal_patch_size
            width *= tower.config.patch_size**2
            grid = torch.tensor(grids[rank], dtype=torch.long).view(-1, 3)
            gen = torch.Generator().manual_seed(rank)
            pixels = torch.randn(int(grid.prod(1).sum()), width, generator=gen)
            want = tower(pixels.clone().requires_grad_(True), grid_thw=grid).pooler_output
            config = dataclasses.replace(CONFIG, band_exchange=kind, ranks_per_node=2)
            if family == "qwen2_vl":  # every kind under checkpointing (non-reentrant)
                tower.gradient_checkpointing_enable({"use_reentrant": False})
            fx_vitbal.enable_vit_balance(tower, config=config)
            stats = []
            handle = fx_vitbal.add_stats_callback(stats.append)
            x = pixels.clone().requires_grad_(True)
            got = tower(x, grid_thw=grid).pooler_output
            handle.remove()
            weights = torch.linspace(-1, 1, got.numel()).view_as(got)
            (got * weights).sum().backward()
            grads = _flat_grads(tower)
            dist.all_reduce(grads)
            plain_tower = cls._from_config(copy.deepcopy(original_config))
            plain_tower.load_state_dict(tower.state_dict())
            y = pixels.clone().requires_grad_(True)
            plain = plain_tower(y, grid_thw=grid).pooler_output
            (plain * weights).sum().backward()
            want_grads = _flat_grads(plain_tower)
            dist.all_reduce(want_grads)
            results[(family, kind)] = {
                "difference": _close(
                    [got.detach(), x.grad, grads], [want.detach(), y.grad, want_grads], 1e-5
                ),
                "split": (stats[-1].split_units, stats[-1].band_exchanges),
            }
    return results


def test_hugging_face_towers_run_each_exchange_across_nodes_exactly():
    pytest.importorskip("transformers")
    for rank, res in enumerate(run_ranks(_hf_towers, 4, timeout=600)):
        for (family, kind), r in res.items():
            assert r["difference"] <= 1e-5, (family, kind, rank, r["difference"])
            split_units, exchanges = r["split"]
            assert split_units >= 2 and exchanges == (kind,), (family, kind, rank, r["split"])


def test_block_math_fused_on_cpu_and_written_out_agree_with_autograd(monkeypatch):
    """The block math every kind runs (``bands.blocks``): attention over two key blocks merged
    by their logsumexps, and each block's gradients from the whole attention's output and
    logsumexp, equal plain softmax attention and its autograd gradients, on CPU by the fused
    kernel and written out (the path of other devices)."""
    from fx_vitbal.runtime.bands import blocks

    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(3, n, 8, generator=gen, dtype=torch.float64) for n in (5, 9, 9, 5))
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    s = leaves[0] @ leaves[1].transpose(-2, -1) * 8**-0.5
    want = torch.softmax(s, -1) @ leaves[2]
    want_grads = torch.autograd.grad(want, leaves, dout)
    for fused in (True, False):
        monkeypatch.setattr(blocks, "_fused", lambda q, k, fused=fused: fused)
        softmax = blocks.OnlineSoftmax(q)
        softmax.add(k[:, :4], v[:, :4])
        softmax.add(k[:, 4:], v[:, 4:])
        out, lse = softmax.result()
        first, second = (
            blocks.block_grads(q, k[:, rows], v[:, rows], dout, out, lse)
            for rows in (slice(0, 4), slice(4, 9))
        )
        dq = first[0] + second[0]  # queries pay to both blocks
        dk, dv = (torch.cat([first[i], second[i]], 1) for i in (1, 2))  # each block its own keys
        assert torch.allclose(out, want, atol=1e-12, rtol=0), fused
        for got, expected in zip((dq, dk, dv), want_grads, strict=True):
            assert torch.allclose(got, expected, atol=1e-12, rtol=0), fused


# Three frames whose bands overlap on 4 ranks, uneven, in a batch order unlike the frames'
# (frame: its bands' rows and ranks in band order), and whole units beside them. Rank 2 holds
# bands of all three frames; frame 1's ranks are not in rank order.
OVERLAPPING = {0: ((5, 7, 3, 6), (0, 1, 2, 3)), 1: ((4, 4, 5), (2, 0, 3)), 2: ((6, 2), (3, 2))}
BATCHES = [  # per rank: a frame id (this rank's band of it) or a whole unit's rows ("whole", n)
    [("whole", 4), 1, 0],
    [0, ("whole", 3)],
    [2, 0, 1],
    [1, 0, ("whole", 2), 2],
]
# Per frame, the kind forced: each kind alone, then one of each (usp: two groups of two bands
# on frame 0, the others fall back to ring by rule; ulysses on 4 heads and 3 bands: ring).
KIND_SETS = [(kind, kind, kind) for kind in KINDS] + [("gather", "ring", "ulysses")]


def _frame_tensors(seed: int, rows: int, heads: int = 4, dim: int = 8) -> list[torch.Tensor]:
    """q, k, v and the output's gradient of a frame (seeded by its id: the same on every rank)
    or of a whole unit."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(heads, rows, dim, generator=gen, dtype=torch.float64) for _ in range(4)]


def _overlapping(rank: int, world: int) -> dict:
    from fx_vitbal.runtime.bands.blocks import AttentionLayout, AttentionUnit, FrameBand
    from fx_vitbal.runtime.bands.kinds import band_attention

    results = {}
    for kinds in KIND_SETS:
        units, pieces, want = [], [], []
        for entry in BATCHES[rank]:
            if isinstance(entry, tuple):  # a whole unit: attends over its own rows
                rows = entry[1]
                q, k, v, dout = _frame_tensors(100 + len(units), rows)
                units.append(AttentionUnit(rows=rows))
                a, b = 0, rows
            else:
                band_rows, ranks = OVERLAPPING[entry]
                index = ranks.index(rank)
                band = FrameBand(
                    frame=entry,
                    kind=kinds[entry],
                    ranks=ranks,
                    index=index,
                    band_rows=band_rows,
                    node_bands=2 if kinds[entry] == "usp" and len(ranks) == 4 else 1,
                )
                units.append(AttentionUnit(rows=band_rows[index], band=band))
                q, k, v, dout = _frame_tensors(entry, sum(band_rows))
                a = sum(band_rows[:index])
                b = a + band_rows[index]
            leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
            out = torch.nn.functional.scaled_dot_product_attention(*leaves)
            grads = torch.autograd.grad(out, leaves, dout)
            pieces.append((q[:, a:b], k[:, a:b], v[:, a:b], dout[:, a:b]))
            want.append([out[:, a:b].detach(), *(g[:, a:b] for g in grads)])
        q, k, v, dout = (torch.cat([p[i] for p in pieces], 1) for i in range(4))
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        with record_collectives() as issued:
            out = band_attention(*leaves, AttentionLayout(units=tuple(units)), dist.group.WORLD)
            grads = torch.autograd.grad(out, leaves, dout)
        got = [out.detach(), *grads]
        want = [torch.cat([w[i] for w in want], 1) for i in range(4)]
        results[kinds] = {
            "difference": _close(got, want, 1e-12),
            "peers": {peer for _, name, _, peers in issued if name == "p2p" for peer in peers},
        }
    return results


def test_frames_overlapping_on_ranks_exchange_exactly_whatever_the_kinds_and_batch_order():
    """``band_attention`` on hand-made layouts (no planner): three frames of 4, 3 and 2 uneven
    bands overlap on 4 ranks, one rank holding a band of each, batch orders unlike the
    frames' and one frame's ranks out of rank order, whole units beside them; each kind forced
    on every frame, and three kinds at once. Outputs and q, k, v gradients equal attention over
    each whole frame (float64, 1e-12 of the scale), messages only among a frame's ranks."""
    sharing = [set() for _ in range(4)]
    for _, ranks in OVERLAPPING.values():
        for r in ranks:
            sharing[r] |= set(ranks) - {r}
    for rank, by_kinds in enumerate(run_ranks(_overlapping, 4)):
        for kinds, res in by_kinds.items():
            assert res["difference"] <= 1e-12, (kinds, rank, res["difference"])
            assert res["peers"] and res["peers"] <= sharing[rank], (kinds, rank, res["peers"])


# One frame in four uneven bands (rows), for the byte counts below.
UNEVEN_ROWS = (6, 10, 2, 4)


def _received(rank: int, world: int) -> dict:
    """Per kind, the elements this rank received from each peer in one layer's forward and
    backward through ``band_attention`` (4 heads of 8: a patch's keys and values are 64)."""
    from fx_vitbal.runtime.bands.blocks import AttentionLayout, AttentionUnit, FrameBand
    from fx_vitbal.runtime.bands.kinds import band_attention
    from fx_vitbal.runtime.transport import collectives

    original, received = collectives.send_receive, {}

    def counting(messages, group):
        for is_send, tensor, peer, _ in messages:
            if not is_send:
                received[peer] = received.get(peer, 0) + tensor.numel()
        return original(messages, group)

    collectives.send_receive, results = counting, {}
    try:
        for kind in KINDS:
            received.clear()
            band = FrameBand(
                frame=0,
                kind=kind,
                ranks=(0, 1, 2, 3),
                index=rank,
                band_rows=UNEVEN_ROWS,
                node_bands=2 if kind == "usp" else 1,
            )
            layout = AttentionLayout(units=(AttentionUnit(rows=UNEVEN_ROWS[rank], band=band),))
            q, k, v, dout = _frame_tensors(rank, UNEVEN_ROWS[rank])
            leaves = [t.requires_grad_(True) for t in (q, k, v)]
            out = band_attention(*leaves, layout, dist.group.WORLD)
            torch.autograd.grad(out, leaves, dout)
            results[kind] = dict(received)
    finally:
        collectives.send_receive = original
    return results


def test_the_bytes_each_band_receives_are_what_the_planner_prices():
    """One frame in four uneven bands (6, 10, 2, 4 rows) on 4 ranks, each kind forced (usp:
    two groups of two): what each rank receives from each peer through one layer's forward and
    backward equals ``band_prices.band_receives``, which counts every kind's traffic
    (``frame_traffic``), and for gather and ring sums to what prices them
    (``received_patches``, in ``frame_prices``). Uneven bands
    tell the backwards apart: a gather band gets its own block's gradients from each peer, a
    ring band every accumulator but the one that starts on it."""
    from fx_vitbal.plan.band_prices import band_receives, received_patches
    from fx_vitbal.plan.bands import BandRule

    kv = 2 * 4 * 8  # a patch's keys and values: 2 tensors of 4 heads x 8
    rule = BandRule(align=1, min_patches=1, exchange_layers=1, kv_bytes_per_patch=kv, heads=4)
    for rank, by_kind in enumerate(run_ranks(_received, 4)):
        for kind, got in by_kind.items():
            want = dict(band_receives(rule, UNEVEN_ROWS, rank, kind, ranks_per_node=2))
            assert got == want, (kind, rank, got, want)
            if kind in ("gather", "ring"):  # what frame_prices counts
                priced = received_patches(UNEVEN_ROWS, rank, kind, sum(UNEVEN_ROWS))
                assert sum(got.values()) == kv * priced, (kind, rank)
