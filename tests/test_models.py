"""Tests for the reference models: the properties the balancer relies on (row rules, per-image and
per-frame independence, window order) and the traceability its FX pass and dynamo path need."""

import dataclasses
import re

import pytest
import torch
import torch.fx
import torch.nn.functional as F
from dist_utils import fullgraph_capture
from torch.testing import assert_close

from fx_vitbal.tools.models import QwenStyleViT, ViTConfig, _patch_layout
from fx_vitbal.tools.omni import LMConfig, OmniEncoderModel, make_inputs

IN_DIM = 24
WINDOWED = ViTConfig(depth=3, window_size=2, fullatt_block_indexes=(1,), deepstack_indexes=(0, 2))
PLAIN = ViTConfig(depth=3, deepstack_indexes=(1,))


def make_vit(config: ViTConfig, dtype: torch.dtype = torch.float64) -> QwenStyleViT:
    torch.manual_seed(0)
    return QwenStyleViT(config).to(dtype)


def pixels(grids: list[list[int]], dtype=torch.float64, seed: int = 0):
    _, pixel_values, grid_thw = make_inputs(grids, in_dim=IN_DIM, seed=seed, dtype=dtype)
    return pixel_values, grid_thw


def in_input_order(out: tuple) -> list[torch.Tensor]:
    """pixel_embeds and deepstack tensors, un-permuted (by whole merge blocks) when the tower
    used windows."""
    embeds, window_index, deepstack = out
    rows = [embeds, *deepstack]
    if window_index is None:
        return rows
    reverse = torch.argsort(window_index)
    return [r.unflatten(0, (reverse.numel(), -1))[reverse].flatten(0, 1) for r in rows]


@pytest.mark.parametrize(
    ("kwargs", "bad"),
    [
        (
            {"hidden": 24, "num_heads": 4},
            "divisible by 4, got 6",
        ),
        ({"hidden": 30, "num_heads": 4}, "hidden (30)"),
        ({"window_size": 0}, "window_size must be None or >= 1, got 0"),
        ({"depth": 2, "fullatt_block_indexes": (2,)}, "got (2,)"),
        ({"deepstack_indexes": (1, 0)}, "got (1, 0)"),
        ({"spatial_merge_size": 0}, "spatial_merge_size must be >= 1, got 0"),
        ({"in_dim": 0}, "in_dim must be >= 1, got 0"),
    ],
)
def test_vit_config_rejects_bad_values_naming_them(kwargs, bad):
    with pytest.raises(ValueError, match=re.escape(bad)):
        ViTConfig(**kwargs)


def test_configs_accept_lists_and_lm_width_must_match_vit():
    assert ViTConfig(depth=3, deepstack_indexes=[0, 2]).deepstack_indexes == (0, 2)
    with pytest.raises(ValueError, match="image_token_id"):
        LMConfig(vocab_size=4, image_token_id=4)
    with pytest.raises(ValueError, match="48"):
        OmniEncoderModel(ViTConfig(out_dim=48), LMConfig(hidden=32))


def test_patch_positions_follow_merge_block_order():
    grid = torch.tensor([[2, 4, 6]])
    frame_id, row, col = _patch_layout(grid, 48, 2)
    assert frame_id.tolist() == [0] * 24 + [1] * 24
    # First merge block is the top-left 2x2 square, the next one is to its right.
    assert row[:8].tolist() == [0, 0, 1, 1, 0, 0, 1, 1]
    assert col[:8].tolist() == [0, 1, 0, 1, 2, 3, 2, 3]
    # Every (row, col) of the 4x6 frame appears once, and both frames share positions.
    assert sorted(zip(row[:24].tolist(), col[:24].tolist(), strict=True)) == [
        (r, c) for r in range(4) for c in range(6)
    ]
    assert torch.equal(row[:24], row[24:]) and torch.equal(col[:24], col[24:])


MERGED = dataclasses.replace(WINDOWED, merged_output=True, hidden=48, num_heads=4)


@pytest.mark.parametrize("config", [PLAIN, WINDOWED, MERGED], ids=["plain", "windowed", "merged"])
def test_embeds_have_a_row_per_patch_or_per_merge_block_and_deepstack_per_block(config):
    grids = [[1, 4, 6], [2, 4, 4], [1, 6, 10]]
    pixel_values, grid_thw = pixels(grids)
    embeds, window_index, deepstack = make_vit(config)(pixel_values, grid_thw)
    patches = sum(t * h * w for t, h, w in grids)
    merged = patches // 4
    if config.merged_output:
        assert embeds.shape == (merged, config.out_dim)
    else:
        assert embeds.shape == (patches, config.hidden)
    assert len(deepstack) == len(config.deepstack_indexes)
    assert all(d.shape == (merged, config.out_dim) for d in deepstack)
    if config.window_size is None:
        assert window_index is None
    else:
        assert window_index.dtype == torch.long
        assert torch.equal(window_index.sort().values, torch.arange(merged))


@pytest.mark.parametrize("config", [PLAIN, WINDOWED, MERGED], ids=["plain", "windowed", "merged"])
def test_each_image_depends_only_on_itself(config):
    grids = [[1, 4, 6], [2, 4, 4], [1, 6, 10]]
    pixel_values, grid_thw = pixels(grids)
    vit = make_vit(config)
    batch = vit(pixel_values, grid_thw)

    singles, offset, merged_offset = [], 0, 0
    for g in grids:
        n = g[0] * g[1] * g[2]
        singles.append(vit(pixel_values[offset : offset + n], torch.tensor([g])))
        offset += n
    for got, *parts in zip(in_input_order(batch), *map(in_input_order, singles), strict=True):
        assert_close(got, torch.cat(parts), rtol=1e-12, atol=1e-12)

    if config.window_size is not None:
        expected = []
        for g, single in zip(grids, singles, strict=True):
            expected.append(single[1] + merged_offset)
            merged_offset += g[0] * g[1] * g[2] // 4
        assert torch.equal(batch[1], torch.cat(expected))


@pytest.mark.parametrize("config", [PLAIN, WINDOWED], ids=["plain", "windowed"])
def test_no_gradient_flows_between_images(config):
    grids = [[1, 4, 6], [1, 4, 4]]
    pixel_values, grid_thw = pixels(grids)
    pixel_values.requires_grad_(True)
    rows = in_input_order(make_vit(config)(pixel_values, grid_thw))
    # The first image's rows only: 24 of 40 patches, in either layout.
    sum(r[: r.shape[0] * 24 // 40].sum() for r in rows).backward()
    assert pixel_values.grad[:24].abs().sum() > 0
    assert torch.count_nonzero(pixel_values.grad[24:]) == 0


@pytest.mark.parametrize("config", [PLAIN, WINDOWED], ids=["plain", "windowed"])
def test_video_gives_exactly_the_outputs_of_its_frames(config):
    vit = make_vit(config, torch.float32)
    pixel_values, _ = pixels([[2, 4, 4]], dtype=torch.float32)
    video = vit(pixel_values, torch.tensor([[2, 4, 4]]))
    frames = vit(pixel_values, torch.tensor([[1, 4, 4], [1, 4, 4]]))
    for got, expected in zip(in_input_order(video), in_input_order(frames), strict=True):
        assert torch.equal(got, expected)
    if config.window_size is not None:
        assert torch.equal(video[1], frames[1])


def test_window_order_is_a_non_identity_permutation_that_argsort_undoes():
    vit = make_vit(ViTConfig(window_size=2))
    window_index = vit.get_window_index(torch.tensor([[1, 12, 20]]))
    merged = torch.arange(6 * 10)
    assert not torch.equal(window_index, merged)
    assert window_index[:8].tolist() == [0, 1, 10, 11, 2, 3, 12, 13]
    assert torch.equal(window_index[torch.argsort(window_index)], merged)
    assert torch.equal(merged[window_index][torch.argsort(window_index)], merged)


def test_windows_are_padded_per_frame_and_never_span_images():
    vit = make_vit(ViTConfig(window_size=2))
    # Merged grids 3x3 (padded to 4x4: windows of 4, 2, 2, 1) twice, then 1x2 (one window of 2).
    index, lengths = vit._window_index_and_lengths(torch.tensor([[2, 6, 6], [1, 2, 4]]))
    assert lengths.tolist() == [16, 8, 8, 4, 16, 8, 8, 4, 8]
    assert index[:9].tolist() == [0, 1, 3, 4, 2, 5, 6, 7, 8]
    assert index[9:18].tolist() == [i + 9 for i in [0, 1, 3, 4, 2, 5, 6, 7, 8]]
    assert index[18:].tolist() == [18, 19]


def test_get_window_index_matches_forward_and_needs_windows():
    pixel_values, grid_thw = pixels([[1, 4, 6], [2, 8, 4]])
    vit = make_vit(WINDOWED)
    assert torch.equal(vit.get_window_index(grid_thw), vit(pixel_values, grid_thw)[1])
    with pytest.raises(ValueError, match="window_size"):
        make_vit(PLAIN).get_window_index(grid_thw)


def test_window_blocks_attend_only_inside_their_window():
    vit = make_vit(ViTConfig(depth=2, window_size=2, merged_output=True))
    pixel_values, grid_thw = pixels([[1, 4, 8]])  # merged 2x4: windows {0,1,4,5} and {2,3,6,7}
    pixel_values.requires_grad_(True)
    embeds, window_index, _ = vit(pixel_values, grid_thw)
    assert window_index.tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    embeds[:4].sum().backward()  # first window's outputs
    # Patch rows are in merge-block order: merged token j owns rows 4j .. 4j+3.
    touched = pixel_values.grad.abs().sum(1).view(8, 4).sum(1) > 0
    assert touched.tolist() == [True, True, False, False, True, True, False, False]


def test_windows_with_only_full_blocks_match_the_plain_tower_after_unpermuting():
    # Same weights, every block full: only the row reordering differs, so un-permuted outputs
    # must equal the plain tower's. This checks the reorder of rows, rotary and merge blocks.
    plain = make_vit(ViTConfig(depth=2, deepstack_indexes=(0,)))
    windowed = make_vit(
        ViTConfig(depth=2, deepstack_indexes=(0,), window_size=2, fullatt_block_indexes=(0, 1))
    )
    windowed.load_state_dict(plain.state_dict())
    pixel_values, grid_thw = pixels([[1, 8, 12], [2, 4, 6]])
    out = windowed(pixel_values, grid_thw)
    assert not torch.equal(out[1], torch.arange(out[1].numel()))
    for got, expected in zip(
        in_input_order(out), in_input_order(plain(pixel_values, grid_thw)), strict=True
    ):
        assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_rotary_turns_half_the_pairs_with_row_and_half_with_column():
    vit = make_vit(ViTConfig(hidden=32, num_heads=2))  # head_dim 16: 4 row, 4 col frequencies
    cos, sin = vit._rotary(torch.tensor([1, 0]), torch.tensor([0, 1]), torch.float64)
    assert cos.shape == (2, 1, 16)
    cos = cos[:, 0]
    unturned = torch.ones(4, dtype=torch.float64)
    # Patch (row 1, col 0): row frequencies turn, column ones do not; (0, 1) the other way round.
    assert (cos[0, :4] < 1).all() and torch.equal(cos[0, 4:8], unturned)
    assert torch.equal(cos[1, :4], unturned) and (cos[1, 4:8] < 1).all()
    assert torch.equal(cos[:, :8], cos[:, 8:])  # rotate_half pairs dim i with i + head_dim / 2


@pytest.mark.parametrize(
    ("config", "sizes"),
    [(ViTConfig(depth=1), [24, 16, 16]), (ViTConfig(depth=1, window_size=2), [16, 8, 16, 16])],
    ids=["per_frame", "per_window"],
)
def test_eager_attention_runs_once_per_segment(monkeypatch, config, sizes):
    seen = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        seen.append(q.shape[-2])
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    make_vit(config)(*pixels([[1, 4, 6], [2, 4, 4]]))
    assert seen == sizes


@pytest.mark.parametrize("config", [PLAIN, WINDOWED], ids=["plain", "windowed"])
def test_empty_batch_gives_empty_outputs_and_zero_grads(config):
    vit = make_vit(config, torch.float32)
    pixel_values, grid_thw = pixels([], dtype=torch.float32)
    assert pixel_values.shape == (0, IN_DIM) and grid_thw.shape == (0, 3)
    embeds, window_index, deepstack = vit(pixel_values, grid_thw)
    assert embeds.shape == (0, config.hidden)
    assert [d.shape for d in deepstack] == [(0, config.out_dim)] * len(config.deepstack_indexes)
    if config.window_size is not None:
        assert window_index.dtype == torch.long and window_index.numel() == 0
    (embeds.sum() + sum(d.sum() for d in deepstack)).backward()
    for name, p in vit.named_parameters():
        assert p.grad is not None, name
        assert torch.count_nonzero(p.grad) == 0, name


def test_make_inputs_is_deterministic_and_places_image_tokens():
    grids = [[1, 4, 6], [2, 4, 4]]
    input_ids, pixel_values, grid_thw = make_inputs(grids, in_dim=IN_DIM, seed=3)
    again = make_inputs(grids, in_dim=IN_DIM, seed=3)
    assert all(
        torch.equal(a, b) for a, b in zip((input_ids, pixel_values, grid_thw), again, strict=True)
    )
    assert not torch.equal(pixel_values, make_inputs(grids, in_dim=IN_DIM, seed=4)[1])
    assert grid_thw.dtype == torch.long and grid_thw.tolist() == grids
    assert pixel_values.shape == (24 + 32, IN_DIM)
    is_image = (input_ids == 3).tolist()
    assert is_image == [False] * 3 + [True] * 6 + [False] * 3 + [True] * 8
    assert make_inputs(grids, in_dim=IN_DIM, dtype=torch.float64)[1].dtype == torch.float64

    text_ids, empty_pixels, empty_grid = make_inputs([], in_dim=IN_DIM)
    assert text_ids.shape == (3,) and not (text_ids == 3).any()
    assert empty_pixels.shape == (0, IN_DIM) and empty_grid.shape == (0, 3)
    with pytest.raises(ValueError, match="5"):
        make_inputs([[1, 4, 5]], in_dim=IN_DIM)


def test_make_inputs_text_tokens_cover_the_vocab_except_the_image_token():
    input_ids, _, _ = make_inputs([], in_dim=IN_DIM, text_per_image=2000, vocab_size=8)
    assert sorted(set(input_ids.tolist())) == [0, 1, 2, 4, 5, 6, 7]


def make_omni(vit_config: ViTConfig) -> OmniEncoderModel:
    torch.manual_seed(0)
    return OmniEncoderModel(vit_config, LMConfig())


def test_omni_logits_shape_and_deepstack_reaches_the_lm():
    model = make_omni(ViTConfig(deepstack_indexes=(0, 1)))
    input_ids, pixel_values, grid_thw = make_inputs([[1, 4, 6], [2, 4, 4]], in_dim=IN_DIM)
    logits = model(input_ids, pixel_values, grid_thw)
    assert logits.shape == (input_ids.shape[0], 64)
    assert torch.isfinite(logits).all()
    with torch.no_grad():
        for merger in model.visual.deepstack_mergers:
            merger.mlp[-1].weight.zero_()
            merger.mlp[-1].bias.zero_()
    without = model(input_ids, pixel_values, grid_thw)
    # Causal LM: the text before the first image cannot see any image feature.
    assert_close(without[:3], logits[:3])
    assert not torch.allclose(without[3:], logits[3:])


def test_omni_unpermutes_window_order_before_scattering_images():
    # With every block full, windows change only the row order inside the tower, so the parent
    # must produce the plain model's logits once it un-permutes embeds and deepstack.
    plain = make_omni(ViTConfig(depth=2, deepstack_indexes=(0,))).double()
    windowed = make_omni(
        ViTConfig(depth=2, deepstack_indexes=(0,), window_size=2, fullatt_block_indexes=(0, 1))
    ).double()
    windowed.load_state_dict(plain.state_dict())
    inputs = make_inputs([[1, 8, 12], [2, 4, 6]], in_dim=IN_DIM, dtype=torch.float64)
    assert_close(windowed(*inputs), plain(*inputs), rtol=1e-12, atol=1e-12)


def test_omni_text_only_sequence_works():
    model = make_omni(WINDOWED)
    input_ids, pixel_values, grid_thw = make_inputs([], in_dim=IN_DIM)
    assert model(input_ids, pixel_values, grid_thw).shape == (3, 64)


class _LeafTracer(torch.fx.Tracer):
    def is_leaf_module(self, m: torch.nn.Module, qualname: str) -> bool:
        return isinstance(m, QwenStyleViT) or super().is_leaf_module(m, qualname)


@pytest.mark.parametrize("config", [PLAIN, WINDOWED], ids=["plain", "windowed"])
def test_fx_trace_keeps_the_tower_as_one_call_and_same_logits(config):
    model = make_omni(config)
    graph = _LeafTracer().trace(model)
    traced = torch.fx.GraphModule(model, graph)
    calls = [n.target for n in graph.nodes if n.op == "call_module"]
    assert calls.count("visual") == 1
    assert not any(str(t).startswith("visual.") for t in calls)
    inputs = make_inputs([[1, 4, 6], [2, 4, 4]], in_dim=IN_DIM)
    assert torch.equal(traced(*inputs), model(*inputs))


def test_dynamo_fullgraph_matches_eager_with_unbacked_sizes():
    # One ViT block keeps the compile short; its deepstack level feeds the first of 2 LM layers.
    model = make_omni(ViTConfig(depth=1, deepstack_indexes=(0,)))
    torch._dynamo.reset()  # other tests in this process may have compiled the same code
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    # One compile must serve every batch, including an empty one, so sizes are unbacked.
    for step, grids in enumerate([[[1, 4, 6], [2, 8, 4]], [[1, 2, 2]], []]):
        inputs = make_inputs(grids, in_dim=IN_DIM, seed=step)
        for t in inputs:
            torch._dynamo.decorators.mark_unbacked(t, 0)
        stance = "default" if step == 0 else "fail_on_recompile"
        with torch.compiler.set_stance(stance), fullgraph_capture():
            got = compiled(*inputs)
        assert_close(got, model(*inputs), rtol=1e-5, atol=1e-5)
