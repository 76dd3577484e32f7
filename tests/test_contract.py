"""The ViT contract of LoongForge's ``--use-vit-dp-balance``, for any ViT: a module returning
``(pixel_embeds, window_index, deepstack)`` with a ``spatial_merge_size`` is balanced as is, in
every path, whether its embeddings are pre-merger (``t*h*w`` rows) or merged (``t*h*w/m**2``).

``SeedViT`` below is written the way a user would write one for that contract, and is never
registered: whole grid rows move (it attends across the frames of a video) and the cost model is
``l**2``. Every check compares against the unbalanced run on 3 gloo ranks (one with no image, one
with a video) and proves that units really moved.
"""

from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_utils import (
    UNBACKED_BATCH_SIZES,
    assert_units_moved,
    fullgraph_capture,
    record_moves,
    run_ranks,
)
from torch import nn

import fx_vitbal
from fx_vitbal.passes import apply_vit_balance_pass, symbolic_trace
from fx_vitbal.runtime.vit.registry import vision_encoder_spec
from fx_vitbal.tools.models import ViTConfig
from fx_vitbal.tools.omni import LMConfig, OmniEncoderModel, make_inputs

IN_DIM, HIDDEN, M = 24, 16, 2
GRIDS = [[[1, 16, 12], [2, 4, 6], [1, 8, 8]], [[1, 2, 2]], []]  # skewed; rank 2 has nothing


class SeedViT(nn.Module):
    """A ViT written to the seed's contract only: attention over each whole grid row (so across
    a video's frames), a window order (each image's merge blocks reversed), merged deepstack
    features, and pre-merger embeddings unless ``merged``. Tensor ops only, so it also traces
    with unbacked sizes."""

    def __init__(self, merged: bool = False) -> None:
        super().__init__()
        self.spatial_merge_size = M
        self.merged = merged
        self.embed = nn.Linear(IN_DIM, HIDDEN)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.deepstack_merger = nn.Linear(M * M * HIDDEN, HIDDEN)
        self.merger = nn.Linear(M * M * HIDDEN, HIDDEN) if merged else None

    def get_window_index(self, grid_thw, num_blocks=None):
        """``(window_index, cu_window_seqlens)``, like Qwen2.5-VL's."""
        blocks = grid_thw.prod(-1) // (M * M)
        image = torch.repeat_interleave(
            torch.arange(grid_thw.shape[0]), blocks, output_size=num_blocks
        )
        start = torch.cumsum(blocks, 0) - blocks
        index = 2 * start[image] + blocks[image] - 1 - torch.arange(image.shape[0])
        cu_window_seqlens = F.pad(torch.cumsum(blocks * M * M, 0), (1, 0))
        return index, cu_window_seqlens

    def forward(self, pixel_values, image_grid_thw):
        rows = image_grid_thw.prod(-1)
        image = torch.repeat_interleave(
            torch.arange(image_grid_thw.shape[0]), rows, output_size=pixel_values.shape[0]
        )
        x = self.embed(pixel_values)
        q, k, v = self.qkv(x).chunk(3, -1)
        x = x + F.scaled_dot_product_attention(q, k, v, attn_mask=image[:, None] == image[None])
        window_index = self.get_window_index(image_grid_thw, pixel_values.shape[0] // (M * M))[0]
        x = x.unflatten(0, (-1, M * M))[window_index].flatten(0, 1)
        deepstack = [self.deepstack_merger(x.unflatten(0, (-1, M * M)).flatten(1))]
        embeds = self.merger(x.unflatten(0, (-1, M * M)).flatten(1)) if self.merged else x
        return embeds, window_index, deepstack


class SeedVLM(nn.Module):
    """The seed's ``OmniEncoderModel.encode_images``: ViT, then (at home, after the restore)
    window un-permute, merge/project, deepstack added; a per-row head stands in for the LM."""

    def __init__(self, merged: bool = False) -> None:
        super().__init__()
        self.visual = SeedViT(merged)
        self.projector = nn.Identity() if merged else nn.Linear(M * M * HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, 8)
        self.merged = merged

    def forward(self, pixel_values, image_grid_thw):
        vis = self.visual(pixel_values, image_grid_thw)
        reverse = torch.argsort(vis[1])
        if self.merged:
            embeds = vis[0][reverse]
        else:  # whole blocks of M*M pre-merger rows, side by side for the projector
            embeds = vis[0].unflatten(0, (-1, M * M))[reverse].flatten(1)
        return self.head(self.projector(embeds) + vis[2][0][reverse])


def _reference(merged: bool, windows: bool) -> OmniEncoderModel:
    # The reference ViT computes windows in Python loops: dynamo can only trace it without.
    window = {"window_size": 2, "fullatt_block_indexes": (1,)} if windows else {}
    vit = ViTConfig(**window, deepstack_indexes=(0,), merged_output=merged)
    return OmniEncoderModel(vit, LMConfig(num_layers=1))


VARIANTS = {  # name: (model factory taking `windows`, registered)
    "seed_premerger": (lambda windows: SeedVLM(merged=False), False),
    "seed_merged": (lambda windows: SeedVLM(merged=True), False),
    "reference_premerger": (lambda windows: _reference(False, windows), True),
    "reference_merged": (lambda windows: _reference(True, windows), True),
}


def _model(variant: str, windows: bool = True) -> nn.Module:
    torch.manual_seed(0)  # same weights on every rank, like a data-parallel replica
    return VARIANTS[variant][0](windows).double()


def _inputs(rank: int, variant: str):
    input_ids, pixels, grid = make_inputs(
        GRIDS[rank], in_dim=IN_DIM, seed=rank, dtype=torch.float64
    )
    args = (pixels, grid) if variant.startswith("seed") else (input_ids, pixels, grid)
    return args, pixels, grid


def _loss(out: torch.Tensor) -> torch.Tensor:
    # Position-dependent: rows restored to the wrong slot change it.
    return (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum()


def _step(model, args) -> tuple[torch.Tensor, torch.Tensor]:
    out = model(*args)
    _loss(out).backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    dist.all_reduce(grads)
    model.zero_grad(set_to_none=True)
    return out.detach(), grads


def _eager_vit_call(rank: int, variant: str) -> dict:
    """``dp_balance_vit_encoder`` on the bare ViT: every output, window_index and gradient."""
    vit = _model(variant).visual
    _, pixels, grid = _inputs(rank, variant)
    pixels.requires_grad_(True)
    results = {}
    for balanced in (False, True):
        seen = []
        hook = vit.register_forward_pre_hook(lambda mod, a, seen=seen: seen.append(a[1].tolist()))
        call = fx_vitbal.dp_balance_vit_encoder if balanced else (lambda v, p, g: v(p, g))
        embeds, window, deep = call(vit, pixels, grid)
        hook.remove()
        (_loss(embeds) + sum(_loss(d) for d in deep)).backward()
        grads = torch.cat([p.grad.flatten() for p in vit.parameters()])
        dist.all_reduce(grads)
        vit.zero_grad(set_to_none=True)
        detached = [embeds.detach(), window, *[d.detach() for d in deep], grads, pixels.grad]
        pixels.grad = None
        results[balanced] = (detached, seen)
    return {"got": results[True][0], "want": results[False][0], "seen": results[True][1]}


def _paths(rank: int, world: int, variants: list[str]) -> dict:
    out = {}
    for variant in variants:
        args, _, grid = _inputs(rank, variant)
        want = _step(_model(variant), args)
        with record_moves() as moves:
            eager = _eager_vit_call(rank, variant)
        out[variant, "eager"] = {**eager, "moves": moves, "local": grid.tolist()}
        in_place = fx_vitbal.enable_vit_balance(_model(variant))
        with record_moves() as moves:
            out[variant, "in_place"] = {"got": _step(in_place, args), "want": want, "moves": moves}
        gm = apply_vit_balance_pass(symbolic_trace(_model(variant)))
        with record_moves() as moves:
            out[variant, "fx"] = {"got": _step(gm, args), "want": want, "moves": moves}
    return out


def _check(results: list[dict], key) -> None:
    for rank, res in enumerate(results):
        got, want = res[key]["got"], res[key]["want"]
        assert len(got) == len(want)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            if w is None:
                assert g is None, f"{key} rank {rank} item {i}"
                continue
            torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9, msg=f"{key} rank {rank} {i}")
    assert_units_moved([res[key] for res in results])


def test_any_vit_with_the_contract_is_balanced_exactly_in_every_eager_path():
    results = run_ranks(_paths, 3, list(VARIANTS))
    for variant, (_, registered) in VARIANTS.items():
        for path in ("eager", "in_place", "fx"):
            _check(results, (variant, path))
        # What moved: whole grid rows for an unregistered ViT (a video stays whole), single
        # frames for a registered frame-independent one; each exactly once (+ dummy units).
        seen = Counter(tuple(row) for res in results for row in res[variant, "eager"]["seen"][0])
        local = [row for res in results for row in res[variant, "eager"]["local"]]
        units = Counter(
            tuple(r) if not registered else (1, r[1], r[2])
            for r in local
            for _ in range(1 if not registered else r[0])
        )
        assert seen - Counter({(1, M, M): len(results)}) <= units <= seen, (variant, seen)
        assert any(
            res[variant, "eager"]["seen"][0] != res[variant, "eager"]["local"] for res in results
        )


# Each compiled path with two ViTs, between them pre-merger and merged outputs, and the
# unregistered ViT under every path (a compile costs 10-15 s a path and ViT on 2 cores).
COMPILED = [
    ("seed_premerger", "backend"),
    ("seed_premerger", "wrapped_fullgraph"),
    ("seed_merged", "backend"),
    ("seed_merged", "fx_fullgraph"),
    ("reference_premerger", "fx_fullgraph"),
    ("reference_merged", "wrapped_fullgraph"),
]


def _compiled(rank: int, world: int) -> dict:
    out = {}
    for variant, path in COMPILED:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        model = _model(variant, windows=False)
        if path == "fx_fullgraph":
            gm = apply_vit_balance_pass(symbolic_trace(model))
            run = torch.compile(gm, backend="aot_eager", fullgraph=True)
        else:
            fx_vitbal.enable_vit_balance(model)
            run = torch.compile(
                model,
                backend="vitbal",
                options={"inner": "aot_eager"},
                fullgraph=path == "wrapped_fullgraph",
            )
        with record_moves() as moves, fullgraph_capture(path != "backend"):
            got = []
            for step in range(2):  # a second step with other sizes: no recompile needed
                step_args, _, _ = _inputs((rank + step) % world, variant)
                if path != "backend" and UNBACKED_BATCH_SIZES:
                    for t in step_args:
                        torch._dynamo.decorators.mark_unbacked(t, 0)
                got.append(_step(run, step_args))
        want = [
            _step(_model(variant, windows=False), _inputs((rank + step) % world, variant)[0])
            for step in range(2)
        ]
        out[variant, path] = {
            "got": [t for pair in got for t in pair],
            "want": [t for pair in want for t in pair],
            "moves": moves,
            "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
        }
    return out


def test_any_vit_with_the_contract_is_balanced_exactly_under_torch_compile():
    results = run_ranks(_compiled, 3, timeout=600)
    for variant, path in COMPILED:
        _check(results, (variant, path))
        if path != "backend":  # unbacked sizes: one graph, 2 steps
            graphs = [res[variant, path]["graphs"] for res in results]
            assert graphs == [1, 1, 1] or not UNBACKED_BATCH_SIZES, (variant, path, graphs)


def test_an_unregistered_vit_gets_whole_rows_l2_costs_and_its_own_merge_size():
    vit = SeedViT()
    spec = vision_encoder_spec(vit)
    assert spec.frame_independent is False and spec.cost_model is None
    assert spec.merge_size(vit) == M
    planner, merge = fx_vitbal.runtime.vit.settings.planner_for(vit, fx_vitbal.BalanceConfig())
    assert merge == M and '\\"kind\\": \\"quadratic\\"' in planner
    del vit.spatial_merge_size
    with pytest.raises(TypeError, match="SeedViT has no spatial_merge_size attribute"):
        spec.merge_size(vit)


class _BrokenOnRank1(SeedViT):
    """Rank 1's outputs break the contract in the way ``fault`` names."""

    fault = ""

    def forward(self, pixel_values, image_grid_thw):
        embeds, window_index, deepstack = super().forward(pixel_values, image_grid_thw)
        if dist.get_rank() == 1 and self.fault == "rows":
            embeds = embeds[1:]
        if dist.get_rank() == 1 and self.fault == "layouts":  # merged where rank 0 is pre-merger
            embeds = embeds.unflatten(0, (-1, M * M)).mean(1)
        return embeds, window_index, deepstack


def _bad_outputs(rank: int, world: int) -> list[tuple[str, str]]:
    torch.manual_seed(0)
    vit = _BrokenOnRank1().double()
    _, pixels, grid = _inputs(rank, "seed_premerger")
    messages = []
    # Before the group's first good restore, a blocking check raises in the call. After it the
    # outputs' status words ride in their exchange and raise where reading them costs nothing:
    # in the backward, or in the call itself when no backward will come (no_grad).
    steps = [("rows", True), ("layouts", True), ("", True), ("rows", True), ("layouts", True)]
    steps += [("", True), ("rows", False), ("layouts", False)]
    for fault, grad in steps:
        vit.fault = fault
        with torch.set_grad_enabled(grad):
            if not fault:  # every rank is still in lockstep: a good step works
                embeds, _, deep = fx_vitbal.dp_balance_vit_encoder(vit, pixels, grid)
                (embeds.sum() + deep[0].sum()).backward()
                torch.testing.assert_close(embeds, vit(pixels, grid)[0], rtol=0, atol=0)
                continue
            where = "call"
            with pytest.raises(ValueError) as info:
                embeds, _, deep = fx_vitbal.dp_balance_vit_encoder(vit, pixels, grid)
                where = "backward"
                (embeds.sum() + deep[0].sum()).backward()
        messages.append((where, str(info.value)))
    return messages


def test_a_vit_output_of_the_wrong_size_on_one_rank_raises_the_same_error_on_every_rank():
    messages = run_ranks(_bad_outputs, 3)
    assert messages[0] == messages[1] == messages[2]
    assert [where for where, _ in messages[0]] == ["call", "call"] + ["backward"] * 2 + ["call"] * 2
    rows, layouts, rows_later, layouts_later, rows_no_grad, layouts_no_grad = (
        message for _, message in messages[0]
    )
    for message in (rows, rows_later, rows_no_grad):
        assert "rank 1: ViT output 0 has" in message and "rank 0" not in message
        assert "expected t*h*w (pre-merger) or t*h*w/merge**2 (merged) rows" in message
    for message in (layouts_later, layouts_no_grad):
        assert "rank 1: ViT output 0 changed its layout" in message and "rank 0" not in message
    assert "ranks disagree on the ViT's outputs" in layouts
    assert "rank 0: outputs (layout, dtype, row width) [('pre-merger'" in layouts
    assert "rank 1: outputs (layout, dtype, row width) [('merged'" in layouts


def _changing_layouts(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    premerger = SeedViT(merged=False).double()
    merged = SeedViT(merged=True).double()
    _, pixels, grid = _inputs(rank, "seed_premerger")
    results = {"close": [], "exchanges": []}
    # Every rank switches alike: to merged rows, to float32, back to pre-merger float64.
    for vit, dtype in (
        (premerger, torch.float64),
        (merged, torch.float64),
        (merged, torch.float32),
        (premerger, torch.float64),
    ):
        vit.to(dtype)
        x = pixels.to(dtype)
        with record_moves() as moves:
            embeds, _, deepstack = fx_vitbal.dp_balance_vit_encoder(vit, x, grid)
        want, _, want_deepstack = vit(x, grid)
        # Rows computed in another batch differ in the last bits: the dense masked attention
        # sums over the whole batch's length, in a vectorized order that depends on it (and on
        # the CPU's vector width), so float64 agrees to 1e-12, not to the bit.
        tol = 1e-12 if dtype == torch.float64 else 1e-5
        results["close"].append(
            torch.allclose(embeds, want, rtol=tol, atol=tol)
            and torch.allclose(deepstack[0], want_deepstack[0], rtol=tol, atol=tol)
        )
        results["exchanges"].append(len(moves))
        results["moves"] = results.get("moves", []) + moves
    return results


def test_outputs_may_change_layout_between_calls_on_every_rank_alike():
    results = run_ranks(_changing_layouts, 3)
    for res in results:
        assert res["close"] == [True] * 4
        assert res["exchanges"] == [2] * 4  # pixels out, outputs home
    assert_units_moved(results)
