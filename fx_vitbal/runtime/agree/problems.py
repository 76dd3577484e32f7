"""What can be wrong with a rank's input, as numbers that ride in the metadata header (a status
and two arguments, the pixels' shape), and the message every rank raises for each: the same
text on every rank, made from gathered numbers only (``fx_vitbal.runtime.agree.metadata``).
"""

from collections.abc import Sequence

import torch

from fx_vitbal.runtime.transport.rows import DTYPES

# The pixels' dims and first sizes ride in the header (``shape_fields``), for messages.
SHAPE_DIMS = 4


# Problems the caller found before the plan (a status of their own: every rank raises them).
# A problem passed to the plan is ``code | detail << 8`` (``problem_code``): the detail, a count or
# a device, is what its message names.
PROBLEMS = {
    "mm_encoder_outputs": 8,
    "hidden_states": 9,
    "compiled_without_pixels": 10,
    "modalities_differ": 11,
    "call_convention": 12,
    "pixels_none": 13,
    "grid_none": 14,
    "pixels_not_rows": 15,
    "pixels_device": 16,
    "grid_device": 17,
}

# Device types a message can name (a problem's detail is the index; -1: another).
DEVICE_TYPES = ("cpu", "cuda", "meta", "xpu", "hpu", "mps", "privateuseone")


def problem_code(name: str, detail: int = 0) -> int:
    """The ``PROBLEMS`` code ``name`` with its ``detail`` (a count, a ``DEVICE_TYPES`` index)."""
    return PROBLEMS[name] | max(detail, 0) << 8


def device_code(device: torch.device) -> int:
    """``device``'s type as a ``problem_code`` detail."""
    return DEVICE_TYPES.index(device.type) if device.type in DEVICE_TYPES else -1


def shape_fields(pixel_values: torch.Tensor) -> list[int]:
    """The header's ``_SHAPE`` fields: dims, then the first ``SHAPE_DIMS`` sizes (zero-padded)."""
    sizes = list(pixel_values.shape[:SHAPE_DIMS])
    return [pixel_values.dim(), *sizes, *[0] * (SHAPE_DIMS - len(sizes))]


def _shape_text(fields: Sequence[int]) -> str:
    dims, sizes = fields[0], [str(s) for s in fields[1 : 1 + min(fields[0], SHAPE_DIMS)]]
    sizes += ["..."] if dims > SHAPE_DIMS else []
    return f"({', '.join(sizes)}{',' if dims == 1 else ''})"


def describe_problem(code: int, pixel_values: torch.Tensor | None = None) -> str:
    """The message of a ``problem`` code (``pixel_values``: the shape it names, if any)."""
    shape = shape_fields(pixel_values) if pixel_values is not None else [0] * (1 + SHAPE_DIMS)
    return describe(code & 0xFF, code >> 8, 0, shape)


def _device_name(code: int) -> str:
    return DEVICE_TYPES[code] if 0 <= code < len(DEVICE_TYPES) else "another device type"


def describe(status: int, arg0: int, arg1: int, shape: Sequence[int]) -> str:
    """The message of a status (the gather's own checks, 1 to 7, or a ``PROBLEMS`` code) with
    its two arguments and the pixels' ``shape_fields``."""
    return {
        1: f"pixel_values must have >= 2 dims (rows, features), got shape {_shape_text(shape)}",
        2: f"pixel_values dtype must be one of {[str(d) for d in DTYPES]}",
        3: f"image_grid_thw must be 2-D with 3 columns [t, h, w], got {arg0} dims, {arg1} columns",
        4: "image_grid_thw must have an integer dtype",
        5: f"image_grid_thw row {arg0} has a non-positive size ({arg1})",
        6: f"image_grid_thw row {arg0}: h and w must be multiples of the merge size {arg1}",
        7: f"pixel_values has {arg0} rows but image_grid_thw sums to {arg1} (t*h*w)",
        PROBLEMS["mm_encoder_outputs"]: (
            "mm_encoder_outputs was passed to a model whose vision tower is balanced"
        ),
        PROBLEMS["hidden_states"]: (
            "a balanced vision tower returns no hidden states or attentions "
            "(output_hidden_states / output_attentions)"
        ),
        PROBLEMS["compiled_without_pixels"]: (
            "a compiled call got pixel_values=None and the ViT's pixel row width is not known "
            "when the graph is traced; pass an empty [0, C] tensor of the pixels' dtype, or "
            "register the ViT with register_vision_encoder(..., pixel_width=C)"
        ),
        PROBLEMS["modalities_differ"]: (
            "image and video pixels have different row widths, so one tower call cannot encode both"
        ),
        PROBLEMS["call_convention"]: (
            "the tower's pixels or grid do not fit the call convention its rule declares "
            "(HFTowerRule.convention)"
        ),
        PROBLEMS["pixels_none"]: (
            f"pixel_values is None but image_grid_thw has {arg0} rows (its images would be "
            "lost); a rank without images passes None for both, or an empty [0, 3] grid"
        ),
        PROBLEMS["grid_none"]: (
            f"image_grid_thw is None but pixel_values has {arg0} rows; pass each image's "
            "[t, h, w] row"
        ),
        PROBLEMS["pixels_not_rows"]: (
            "pixel_values must be 2-D [rows, features] (t*h*w rows per grid row), got shape "
            f"{_shape_text(shape)}"
        ),
        PROBLEMS["pixels_device"]: (
            f"pixel_values are on {_device_name(arg0)}, where the balancing group's backend "
            "cannot exchange them (gloo: cpu; nccl: cuda; never meta)"
        ),
        PROBLEMS["grid_device"]: (
            f"image_grid_thw is on {_device_name(arg0)}; it must be readable (the CPU or the "
            "pixels' device)"
        ),
    }[status]
