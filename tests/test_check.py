"""check_vision_encoder: which ViTs keep the promises balancing relies on, and what it names."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import fx_vitbal
from fx_vitbal.tools.check import check_vision_encoder
from fx_vitbal.tools.models import QwenStyleViT, ViTConfig

IN_DIM = 6
M = 2  # merge size of the test ViTs


def _reversed_blocks(image_grid_thw: Tensor) -> Tensor:
    """A window order: each unit's merge blocks reversed."""
    blocks = (image_grid_thw.prod(1) // M**2).tolist()
    return torch.cat([unit.flip(0) for unit in torch.arange(sum(blocks)).split(blocks)])


class _TinyViT(nn.Module):
    """Patch embed, one attention over segments of rows, then the output rows.

    ``attend``: the segments, "frame" (each frame), "unit" (each grid row, across its frames) or
    "batch" (everything). ``rows``: "merged" (``t*h*w/4``), "pre-merger" (``t*h*w``), "neither"
    (``t*h*w/2``) or "merged-in-batches" (pre-merger when called with one unit). ``windows``:
    return the outputs with each unit's merge blocks reversed, and that ``window_index``.
    """

    def __init__(self, *, attend: str = "unit", rows: str = "merged", windows: bool = False):
        super().__init__()
        self.spatial_merge_size = M
        self.attend, self.rows, self.windows = attend, rows, windows
        self.embed = nn.Linear(IN_DIM, 8)
        self.qkv = nn.Linear(8, 24)

    def get_window_index(self, image_grid_thw: Tensor) -> tuple[Tensor, None]:
        return _reversed_blocks(image_grid_thw), None  # like Qwen2.5-VL's (index, cu_seqlens)

    def forward(self, pixel_values: Tensor, image_grid_thw: Tensor):
        grid = image_grid_thw.tolist()
        segments = {
            "frame": [h * w for t, h, w in grid for _ in range(t)],
            "unit": [t * h * w for t, h, w in grid],
            "batch": [pixel_values.shape[0]],
        }[self.attend]
        x = self.embed(pixel_values)
        qkv = self.qkv(x).chunk(3, -1)
        parts = zip(*(a.split(segments) for a in qkv), strict=True)
        x = x + torch.cat([F.scaled_dot_product_attention(q, k, v) for q, k, v in parts])
        window_index = None
        if self.windows:
            window_index = _reversed_blocks(image_grid_thw)
            x = x.unflatten(0, (-1, M**2))[window_index].flatten(0, 1)
        merged = len(grid) > 1 if self.rows == "merged-in-batches" else self.rows == "merged"
        if merged:
            x = x.unflatten(0, (-1, M**2)).flatten(1)
        elif self.rows == "neither":
            x = x.unflatten(0, (-1, M)).flatten(1)
        return x, window_index, [2 * x]


class _FramesDeclaredViT(_TinyViT):
    pass


class _WrongWindowIndexViT(_TinyViT):
    def get_window_index(self, image_grid_thw: Tensor) -> Tensor:
        return torch.arange(int(image_grid_thw.prod(1).sum()) // M**2)


fx_vitbal.register_vision_encoder(_FramesDeclaredViT, frame_independent=True)


def _tiny(cls: type = _TinyViT, **kwargs) -> _TinyViT:
    torch.manual_seed(0)
    return cls(**kwargs)


@pytest.mark.parametrize(
    "config",
    [
        ViTConfig(),
        ViTConfig(window_size=2, fullatt_block_indexes=(1,), deepstack_indexes=(0, 1)),
    ],
    ids=["per-frame", "windows-deepstack"],
)
def test_reference_vit_passes_with_frames_checked_and_stays_untouched(config):
    torch.manual_seed(0)
    vit = QwenStyleViT(config)
    vit.train()
    report = check_vision_encoder(vit)  # in_dim from vit.config, frames from the registry
    assert report.ok, str(report)
    assert report.frame_independent
    assert report.dtype == torch.float64
    # The reference ViT's default: pre-merger embeddings, merged deepstack features.
    assert report.layouts == {"embeddings": "pre-merger"} | {
        f"deepstack[{k}]": "merged" for k in range(len(config.deepstack_indexes))
    }
    assert next(vit.parameters()).dtype == torch.float32
    assert vit.training


def test_attention_across_frames_breaks_the_declared_frame_promise_only():
    vit = _tiny(_FramesDeclaredViT, attend="unit")
    report = check_vision_encoder(vit, in_dim=IN_DIM)
    assert not report.ok
    assert all(p.startswith("frame promise broken") for p in report.problems), report.problems
    # Default grids: unit 1 [2, 4, 6] and unit 3 [3, 6, 4] are videos; both outputs break.
    assert len(report.problems) == 2 * (2 + 3)
    assert report.problems[0].startswith(
        "frame promise broken: frame 0 of unit 1 [2, 4, 6], embeddings: the video row run alone "
        "and the frame run alone differ (max abs diff "
    )
    assert check_vision_encoder(vit, in_dim=IN_DIM, frame_independent=False).ok


def test_attention_per_frame_keeps_the_frame_promise():
    assert check_vision_encoder(_tiny(_FramesDeclaredViT, attend="frame"), in_dim=IN_DIM).ok


def test_attention_across_the_batch_breaks_the_unit_promise():
    report = check_vision_encoder(_tiny(attend="batch"), in_dim=IN_DIM)
    assert not report.frame_independent  # unregistered: nothing declared
    assert not report.ok
    assert all(p.startswith("unit promise broken") for p in report.problems), report.problems
    assert report.problems[0].startswith(
        "unit promise broken: unit 0 [1, 8, 12], embeddings: the mixed batch and the unit run "
        "alone differ (max abs diff "
    )


def test_a_broken_unit_promise_is_not_blamed_on_frames():
    class ScaledByUnitCount(_FramesDeclaredViT):
        def forward(self, pixel_values, image_grid_thw):
            embeds, window_index, deepstack = super().forward(pixel_values, image_grid_thw)
            return embeds * len(image_grid_thw), window_index, deepstack

    report = check_vision_encoder(_tiny(ScaledByUnitCount, attend="frame"), in_dim=IN_DIM)
    assert report.frame_independent
    assert [p.split(":")[0] for p in report.problems] == ["unit promise broken"] * 4


def test_rows_in_neither_layout_are_named():
    report = check_vision_encoder(_tiny(rows="neither"), in_dim=IN_DIM)
    assert report.layouts == {"embeddings": "neither", "deepstack[0]": "neither"}
    assert report.problems == (
        "layout: embeddings has 110 rows for the mixed batch, neither t*h*w (220, pre-merger) "
        "nor t*h*w/m**2 (55, merged)",
        "layout: deepstack[0] has 110 rows for the mixed batch, neither t*h*w (220, pre-merger) "
        "nor t*h*w/m**2 (55, merged)",
    )


def test_a_layout_that_changes_with_the_batch_is_named_per_unit():
    report = check_vision_encoder(_tiny(rows="merged-in-batches"), in_dim=IN_DIM)
    assert report.layouts == {"embeddings": "merged", "deepstack[0]": "merged"}
    assert len(report.problems) == 2 * 4
    assert report.problems[0] == (
        "layout: unit 0 [1, 8, 12] run alone, embeddings: shape (96, 8), the layout of the mixed "
        "batch needs (24, 32)"
    )


@pytest.mark.parametrize("rows", ["merged", "pre-merger"])
@pytest.mark.parametrize("windows", [False, True], ids=["input-order", "window-order"])
def test_either_layout_passes_in_input_or_window_order(rows, windows):
    vit = _tiny(_FramesDeclaredViT, attend="frame", rows=rows, windows=windows)
    report = check_vision_encoder(vit, in_dim=IN_DIM)
    assert report.ok, str(report)
    assert report.layouts == {"embeddings": rows, "deepstack[0]": rows}


def test_get_window_index_that_disagrees_with_forward_is_named():
    report = check_vision_encoder(_tiny(_WrongWindowIndexViT, windows=True), in_dim=IN_DIM)
    assert report.problems == (
        "window index: get_window_index(grid) differs from the window_index that forward returns "
        "for the mixed batch",
    )


class _NoWindowIndexViT(nn.Module):
    """Merges its input rows; returns ``index(num_blocks)`` as window_index; no
    ``get_window_index``."""

    spatial_merge_size = M

    def __init__(self, index) -> None:
        super().__init__()
        self.index = index

    def forward(self, pixel_values: Tensor, image_grid_thw: Tensor):
        window_index = self.index(pixel_values.shape[0] // M**2)
        return pixel_values.unflatten(0, (-1, M**2)).flatten(1), window_index, []


@pytest.mark.parametrize(
    "index, problem",
    [
        (
            lambda n: torch.zeros(n, dtype=torch.long),
            "window index: the window_index returned for the mixed batch is not a permutation of "
            "its 55 merge blocks",
        ),
        (
            torch.arange,
            "window index: forward returns a window_index but the ViT has no "
            "get_window_index(grid) to regenerate it",
        ),
    ],
    ids=["not-a-permutation", "no-get_window_index"],
)
def test_a_window_index_that_cannot_be_used_is_named(index, problem):
    report = check_vision_encoder(_NoWindowIndexViT(index), in_dim=IN_DIM)
    assert report.problems == (problem,)


def test_a_vit_without_float64_is_checked_in_its_own_dtype():
    class Float32Only(_TinyViT):
        def forward(self, pixel_values, image_grid_thw):
            if pixel_values.dtype != torch.float32:
                raise RuntimeError("float32 kernels only")
            return super().forward(pixel_values, image_grid_thw)

    report = check_vision_encoder(_tiny(Float32Only), in_dim=IN_DIM)
    assert report.ok, str(report)
    assert report.dtype == torch.float32


def test_raise_on_failure_raises_the_report():
    vit = _tiny(attend="batch")
    report = check_vision_encoder(vit, in_dim=IN_DIM, grids=[[1, 2, 2], [1, 2, 4]])
    with pytest.raises(ValueError) as info:
        check_vision_encoder(
            vit, in_dim=IN_DIM, grids=[[1, 2, 2], [1, 2, 4]], raise_on_failure=True
        )
    assert str(info.value) == str(report)
    assert str(report).splitlines()[:3] == [
        "check_vision_encoder(_TinyViT): 4 problem(s)",
        "  grids [[1, 2, 2], [1, 2, 4]] in torch.float64; frames not declared independent, "
        "not checked",
        "  outputs: embeddings merged, deepstack[0] merged",
    ]
    assert str(report).splitlines()[3].startswith("  - unit promise broken: unit 0 [1, 2, 2]")


def test_bad_arguments_raise():
    with pytest.raises(TypeError, match="pass in_dim"):
        check_vision_encoder(_tiny())
    with pytest.raises(ValueError, match="multiples of the merge size 2"):
        check_vision_encoder(_tiny(), in_dim=IN_DIM, grids=[[1, 2, 3]])
    with pytest.raises(TypeError, match="spatial_merge_size"):
        check_vision_encoder(nn.Linear(IN_DIM, 4), in_dim=IN_DIM)


class _BandsIgnored(QwenStyleViT):
    """Declared as running bands (its class is registered so), but ``what`` it drops."""

    what = ""

    def forward(self, pixel_values, image_grid_thw, vitbal_bands=None):
        tensor_form = vitbal_bands is not None and vitbal_bands.units is None
        if vitbal_bands is not None and not tensor_form and self.what == "first_row":
            vitbal_bands.units = [dataclasses.replace(u, first_row=0) for u in vitbal_bands.units]
        if tensor_form and self.what == "tensor_first_row":  # only as compiled calls run it
            vitbal_bands.table = vitbal_bands.table.clone()
            vitbal_bands.table[:, 2] = 0
        if self.what == "gather":
            vitbal_bands = None
        return super().forward(pixel_values, image_grid_thw, vitbal_bands)


@pytest.mark.parametrize("what", ["first_row", "gather", "tensor_first_row"])
def test_a_vit_that_declares_bands_but_breaks_them_is_named(what):
    """Bands run in one process: a frame as three bands (each over the frame's keys and values)
    must give the frame's outputs, as Python and in the tensor form compiled calls run; the
    reference ViT does (windows too), a ViT that places bands at row 0 (in either form) or
    attends within its band only does not."""
    for config in (ViTConfig(), ViTConfig(window_size=2, fullatt_block_indexes=(1,))):
        assert fx_vitbal.check_vision_encoder(QwenStyleViT(config)).ok
    vit = _BandsIgnored(ViTConfig(deepstack_indexes=(0,)))
    vit.what = what
    report = fx_vitbal.check_vision_encoder(vit)
    assert [p for p in report.problems if p.startswith("band promise broken")], report
    tensor_form = [p for p in report.problems if "tensor form" in p]
    assert bool(tensor_form) == (what != "first_row"), report  # gather: both forms broken
