"""A local self-check of the ViT contract (DESIGN §3b) before balancing is turned on.

Balancing is exact only if every unit (grid row) gets outputs that depend only on its own pixel
rows, every frame of a video declared independent only on that frame, and, for a ViT that runs
row bands (``BandSupport``, a Hugging Face rule's ``bands``), a frame computed as bands (each over
the whole frame's keys and values) gives the frame's outputs. ``check_vision_encoder`` runs a copy
on a random mixed batch, then on each unit and frame alone, then on one frame as three bands (the
exchange local), and names what differs; one process, the user's module untouched. A Hugging Face
tower is checked through its ``HFTowerRule`` (its restored fields, merge size, pixel width, frame
independence and band recipe).
"""

import copy
import dataclasses
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from fx_vitbal.integrations import hf_bands
from fx_vitbal.runtime.bands.view import frame_in_bands
from fx_vitbal.runtime.vit.registry import (
    regenerate_window_index,
    unwrap_module,
    vision_encoder_spec,
)
from fx_vitbal.tools.plain_call import hf_rule, plain_call


@dataclasses.dataclass(frozen=True, kw_only=True)
class VisionEncoderReport:
    """What ``check_vision_encoder`` ran and every broken promise it found."""

    encoder: str
    """The ViT's class name."""
    grids: tuple[tuple[int, int, int], ...]
    """The ``[t, h, w]`` rows of the mixed batch."""
    dtype: torch.dtype
    """The dtype the check ran in: float64 unless the ViT could not run in it."""
    frame_independent: bool
    """Whether frames were checked (declared independent) or not."""
    layouts: dict[str, str]
    """Row layout of each output ("embeddings", "deepstack[k]") in the mixed batch: "pre-merger"
    (``t*h*w`` rows per unit), "merged" (``t*h*w/m**2``) or "neither"."""
    problems: tuple[str, ...]
    """One sentence per broken promise: which promise, output, unit or frame, and difference."""

    @property
    def ok(self) -> bool:
        """True when no promise is broken: balancing this ViT is exact."""
        return not self.problems

    def __str__(self) -> str:
        verdict = "ok" if self.ok else f"{len(self.problems)} problem(s)"
        frames = "checked" if self.frame_independent else "not declared independent, not checked"
        outputs = (
            ", ".join(f"{name} {layout}" for name, layout in self.layouts.items()) or "none read"
        )
        lines = [
            f"check_vision_encoder({self.encoder}): {verdict}",
            f"  grids {[list(g) for g in self.grids]} in {self.dtype}; frames {frames}",
            f"  outputs: {outputs}",
        ]
        return "\n".join(lines + [f"  - {problem}" for problem in self.problems])


def check_vision_encoder(
    vit: nn.Module,
    *,
    in_dim: int | None = None,
    grids: Sequence[Sequence[int]] | None = None,
    frame_independent: bool | None = None,
    atol: float = 1e-5,
    rtol: float = 1e-4,
    seed: int = 0,
    raise_on_failure: bool = False,
) -> VisionEncoderReport:
    """Check that balancing ``vit`` is exact: run a copy on a random mixed batch, then on every
    unit alone (every frame alone when frames are independent; one frame as three bands when it
    runs bands), and compare.

    Checked: each unit's outputs depend only on its pixel rows (unit promise); with independent
    frames, a video row ``[t, h, w]`` gives the outputs of ``t`` rows ``[1, h, w]`` (frame
    promise); bands give their frame's outputs (band promise); every output has ``t*h*w`` or
    ``t*h*w/m**2`` rows per unit, the same for all units (layout); a returned ``window_index``
    is a permutation of the merge blocks that ``vit.get_window_index(grid)`` reproduces. The
    copy runs without gradients in float64 (else its own dtype), in its train/eval mode.

    Args:
        vit: a module with the ViT contract and a ``spatial_merge_size`` (or a registered one).
        in_dim: width of a ``pixel_values`` row. Default: ``vit.config.in_dim``.
        grids: ``[t, h, w]`` rows of the mixed batch, h and w multiples of the merge size.
            Default: four units of different sizes, two of them videos.
        frame_independent: whether frames may be split across ranks. Default: the registered
            spec's value; False for an unregistered class.
        atol, rtol: a difference counts when ``|a - b| > atol + rtol * |b|``. The defaults suit
            float64 and float32; loosen them for a ViT that runs only in 16-bit types.
        seed: seed of the random pixels.
        raise_on_failure: raise instead of returning a failed report.

    Returns:
        The report; ``report.ok`` is True when every promise holds.

    Raises:
        TypeError: no ``spatial_merge_size``; no ``in_dim`` given or found; ``vit`` does not
            return ``(pixel_embeds, window_index, deepstack)``.
        ValueError: a grid row is not positive or h, w are not multiples of the merge size; or,
            with ``raise_on_failure``, a promise is broken (the message is the report).
    """
    rule = hf_rule(vit)
    inner = unwrap_module(vit)
    if rule is not None:
        m, declared = rule.merge_size(inner), rule.frames_independent
        if in_dim is None:
            in_dim = rule.pixel_width(inner.config)
        align = None if rule.bands is None else hf_bands.band_support(inner, rule.bands, 1)[0]
    else:
        spec = vision_encoder_spec(vit)  # unregistered: frames not independent
        m, declared = spec.merge_size(vit), spec.frame_independent
        align = None if spec.bands is None else spec.bands.of(inner)[0]
    compiled = rule is None and spec.bands is not None and spec.bands.compiled
    if in_dim is None:
        in_dim = getattr(getattr(vit, "config", None), "in_dim", None)
    if in_dim is None:
        raise TypeError(
            f"pass in_dim, the width of a pixel_values row: {type(vit).__qualname__} has no "
            "config.in_dim"
        )
    grids = _default_grids(m) if grids is None else _checked_grids(grids, m)
    if frame_independent is None:
        frame_independent = declared
    with torch.no_grad():
        model, pixels = _copy_for_check(vit, grids, in_dim, seed)
        checker = _Checker(model=model, m=m, atol=atol, rtol=rtol)
        layouts = _check(checker, pixels, grids, frame_independent)
        if align is not None:
            frame = (1, 3 * align, 2 * m)
            _check_bands(checker, frame, in_dim, seed, pixels.dtype, compiled)
    report = VisionEncoderReport(
        encoder=type(vit).__qualname__,
        grids=tuple(grids),
        dtype=pixels.dtype,
        frame_independent=frame_independent,
        layouts=layouts,
        problems=tuple(checker.problems),
    )
    if raise_on_failure and not report.ok:
        raise ValueError(str(report))
    return report


@dataclasses.dataclass
class _Checker:
    """The copy under test, its merge size, the tolerances and the problems found so far."""

    model: nn.Module
    m: int
    atol: float
    rtol: float
    problems: list[str] = dataclasses.field(default_factory=list)

    def outputs(
        self, pixels: Tensor, grids: list[tuple[int, int, int]], where: str, bands=None
    ) -> tuple[list[Tensor], Tensor | None] | None:
        """``([embeds, *deepstack] in input order, window_index)`` of one call (of ``bands``, a
        ``Bands``, when given), or None (problem noted) when the ``window_index`` is not a
        permutation of the merge blocks."""
        grid_thw = torch.tensor(grids, dtype=torch.long, device=pixels.device)
        embeds, window_index, deepstack = plain_call(self.model, pixels, grid_thw, bands)
        outputs = [embeds, *deepstack]
        if window_index is None:
            return outputs, None
        num_blocks = pixels.shape[0] // self.m**2
        blocks = torch.arange(num_blocks, device=window_index.device)
        if window_index.ndim != 1 or not torch.equal(window_index.sort().values, blocks):
            self.problems.append(
                f"window index: the window_index returned for {where} is not a permutation of "
                f"its {num_blocks} merge blocks"
            )
            return None
        # Whole blocks move: m**2 rows each in a pre-merger output, one row in a merged one.
        reverse = torch.argsort(window_index)
        return [
            out.unflatten(0, (num_blocks, -1))[reverse].flatten(0, 1)
            if out.shape[0] % num_blocks == 0
            else out  # neither layout: reported, never compared
            for out in outputs
        ], window_index

    def check_regenerated(self, window_index: Tensor, grids: list[tuple[int, int, int]]) -> None:
        """Note a problem unless ``get_window_index(grids)`` reproduces ``window_index``."""
        if not hasattr(self.model, "get_window_index"):
            self.problems.append(
                "window index: forward returns a window_index but the ViT has no "
                "get_window_index(grid) to regenerate it"
            )
            return
        grid_thw = torch.tensor(grids, dtype=torch.long, device=window_index.device)
        if not torch.equal(regenerate_window_index(self.model, grid_thw), window_index):
            self.problems.append(
                "window index: get_window_index(grid) differs from the window_index that "
                "forward returns for the mixed batch"
            )

    def compare_alone(
        self,
        pixels: Tensor,
        grid: tuple[int, int, int],
        expected: list[Tensor | None],
        promise: str,
        where: str,
        reference: str,
    ) -> list[Tensor | None]:
        """Run ``grid`` alone and compare with ``expected`` (None: not comparable) under the
        ``promise`` ("unit" or "frame"). Returns the alone outputs that have the expected shape,
        None for the others."""
        run = self.outputs(pixels, [grid], f"{where} alone")
        if run is None:
            return [None] * len(expected)
        got = run[0]
        if len(got) != len(expected):
            self.problems.append(
                f"outputs: {where} alone returns {len(got)} outputs, the mixed batch "
                f"{len(expected)}"
            )
            return [None] * len(expected)
        comparable = []
        for k, (have, want) in enumerate(zip(got, expected, strict=True)):
            comparable.append(have if want is not None and have.shape == want.shape else None)
            if want is None:
                continue
            if have.shape != want.shape:
                self.problems.append(
                    f"layout: {where} run alone, {_output_name(k)}: shape {tuple(have.shape)}, "
                    f"the layout of the mixed batch needs {tuple(want.shape)}"
                )
            elif not torch.allclose(have, want, rtol=self.rtol, atol=self.atol):
                diff = (have - want).abs().max().item()
                self.problems.append(
                    f"{promise} promise broken: {where}, {_output_name(k)}: {reference} and the "
                    f"{promise} run alone differ (max abs diff {diff:.3g})"
                )
        return comparable


def _check(
    checker: _Checker, pixels: Tensor, grids: list[tuple[int, int, int]], frame_independent: bool
) -> dict[str, str]:
    """Run every check, noting problems in ``checker``; returns the batch's output layouts."""
    m = checker.m
    num_rows = pixels.shape[0]
    batch = checker.outputs(pixels, grids, "the mixed batch")
    if batch is None:
        return {}
    outputs, window_index = batch
    if window_index is not None:
        checker.check_regenerated(window_index, grids)
    # Output rows per pixel row: 1 (pre-merger), m**2 (merged) or None (neither layout).
    divisors = [
        next((d for d in (1, m * m) if out.shape[0] * d == num_rows), None) for out in outputs
    ]
    layouts = {_output_name(k): _layout_name(d) for k, d in enumerate(divisors)}
    for k, (out, d) in enumerate(zip(outputs, divisors, strict=True)):
        if d is None:
            checker.problems.append(
                f"layout: {_output_name(k)} has {out.shape[0]} rows for the mixed batch, neither "
                f"t*h*w ({num_rows}, pre-merger) nor t*h*w/m**2 ({num_rows // m**2}, merged)"
            )
    start = 0
    for i, (t, h, w) in enumerate(grids):
        unit = f"unit {i} [{t}, {h}, {w}]"
        unit_pixels = pixels[start : start + t * h * w]
        expected = _rows(outputs, divisors, start, t * h * w)
        start += t * h * w
        alone = checker.compare_alone(
            unit_pixels, (t, h, w), expected, "unit", unit, "the mixed batch"
        )
        if not frame_independent or t == 1:
            continue
        for f in range(t):
            checker.compare_alone(
                unit_pixels[f * h * w : (f + 1) * h * w],
                (1, h, w),
                _rows(alone, divisors, f * h * w, h * w),
                "frame",
                f"frame {f} of {unit}",
                "the video row run alone",
            )
    return layouts


def _check_bands(
    checker: _Checker,
    frame: tuple[int, int, int],
    in_dim: int,
    seed: int,
    dtype: torch.dtype,
    compiled: bool,
) -> None:
    """The band promise: ``frame`` computed as three bands of its aligned rows, in one batch
    whose exchange of keys and values stays local, gives the frame's outputs run alone; for a
    tower that runs bands compiled (``compiled``), in their tensor form too."""
    t, h, w = frame
    rows, param = h // 3, next(checker.model.parameters(), None)
    generator = torch.Generator().manual_seed(seed + 1)
    pixels = torch.randn(t * h * w, in_dim, generator=generator, dtype=torch.float64)
    pixels = pixels.to(param.device if param is not None else "cpu", dtype)
    bands = frame_in_bands(frame, 3)
    forms = [("", bands)]
    if compiled:
        forms.append((" in their tensor form (as compiled)", bands.tensor_form(pixels.device)))
    whole = checker.outputs(pixels, [frame], f"frame {list(frame)} alone")
    for form, given in forms:
        where = f"frame {list(frame)} in bands{form}"
        banded = checker.outputs(pixels, [(1, rows, w)] * 3, where, given)
        pairs = zip(banded[0], whole[0], strict=True) if whole and banded else ()
        for k, (have, want) in enumerate(pairs):
            if have.shape == want.shape and torch.allclose(have, want, checker.rtol, checker.atol):
                continue
            checker.problems.append(
                f"band promise broken: {_output_name(k)} of frame {list(frame)} as 3 bands of "
                f"{rows} rows{form} differs from the frame alone (each band placed at its "
                "first_row? attending over Bands.gather's keys and values in whole-frame layers?)"
            )


def _copy_for_check(
    vit: nn.Module, grids: list[tuple[int, int, int]], in_dim: int, seed: int
) -> tuple[nn.Module, Tensor]:
    """A copy of ``vit`` in float64 if it runs in it, else in its own dtype; random pixels."""
    param = next(vit.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    num_rows = sum(t * h * w for t, h, w in grids)
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randn(num_rows, in_dim, generator=generator, dtype=torch.float64).to(device)
    model = copy.deepcopy(vit).double()
    try:
        plain_call(model, pixels, torch.tensor(grids, dtype=torch.long, device=device))
        return model, pixels
    except Exception:
        # Some kernels (flash attention, fused norms) have no float64 path. A ViT that fails for
        # another reason fails again, with its own error, in its own dtype.
        dtype = next((p.dtype for p in vit.parameters() if p.is_floating_point()), torch.float32)
        return copy.deepcopy(vit), pixels.to(dtype)


def _default_grids(m: int) -> list[tuple[int, int, int]]:
    # Different sizes, h != w both ways, a unit of one merge block, and two videos.
    return [(1, 4 * m, 6 * m), (2, 2 * m, 3 * m), (1, m, m), (3, 3 * m, 2 * m)]


def _checked_grids(grids: Sequence[Sequence[int]], m: int) -> list[tuple[int, int, int]]:
    rows = [tuple(int(v) for v in grid) for grid in grids]
    if not rows or any(len(r) != 3 or min(r) < 1 or r[1] % m or r[2] % m for r in rows):
        raise ValueError(
            f"grids must be [t, h, w] rows, positive, with h and w multiples of the merge size "
            f"{m}; got {[list(r) for r in rows]}"
        )
    return rows


def _rows(
    outputs: list[Tensor | None], divisors: list[int | None], start: int, num_pixels: int
) -> list[Tensor | None]:
    """The output rows of pixel rows ``[start, start + num_pixels)``; None where not comparable."""
    return [
        None if out is None or d is None else out[start // d : (start + num_pixels) // d]
        for out, d in zip(outputs, divisors, strict=True)
    ]


def _output_name(k: int) -> str:
    return "embeddings" if k == 0 else f"deepstack[{k - 1}]"


def _layout_name(divisor: int | None) -> str:
    return {None: "neither", 1: "pre-merger"}.get(divisor, "merged")
