"""Which Hugging Face vision towers can be balanced, and what balancing must know of each: an
open registry of rules (``register_hf_tower``), matched through the tower class's MRO
(``hf_tower_rule``).

Why a rule and not inference: what the tower computes is not visible from its outputs. Whether a
video's frames may be computed on different ranks (a tower attending across the frames of a clip
gives silently wrong results if they are split), which output fields its parent reads, and where
its config keeps the dimensions the cost model needs all differ between families. The rules
shipped here are keyed by class name, so this module never imports transformers; classes users
register are keyed by the class itself, inherited by subclasses (a shipped rule is not)."""

import dataclasses
import inspect
import math
from collections.abc import Callable

from torch import nn

from fx_vitbal.cost.static import ArchitectureCost
from fx_vitbal.integrations.hf_inputs import STRIPS, CallConvention


def _channels(c) -> int:  # configs call it either
    return getattr(c, "num_channels", None) or c.in_channels


def _patch_width(c) -> int:
    return _channels(c) * c.temporal_patch_size * c.patch_size**2


def _merge_attribute(tower: nn.Module) -> int:
    return tower.spatial_merge_size


@dataclasses.dataclass(frozen=True, kw_only=True)
class HFTowerRule:
    """What balancing must know about one tower class.

    Every balanced tower keeps the Qwen contract: ``forward(pixels, grid_thw=grid)`` with one
    pixel row per grid cell (``t*h*w`` per grid row), returning a ModelOutput whose restored
    fields have, per grid row, ``t*h*w`` rows or ``t*h*w / merge**2`` rows (or ``output_rows``),
    in grid order. The parent's own ``get_image_features`` / ``get_video_features`` then runs on
    the restored outputs, so projectors, resamplers and splits are never the rule's business.
    """

    family: str
    """Who uses the tower, for messages and docs."""
    dims: Callable[[object], tuple[int, int, int]]
    """``vision config -> (block width, MLP width, output width)`` for the cost model."""
    gated_mlp: bool = False
    depth: Callable[[object], int] = lambda c: c.depth
    """``vision config -> number of blocks``."""
    pixel_width: Callable[[object], int] = _patch_width
    """``vision config -> values per pixel row`` (a rank without pixels sends rows this wide)."""
    merge_size: Callable[[nn.Module], int] = _merge_attribute
    """``tower -> spatial merge size``."""
    frames_independent: bool = False
    """Every frame is encoded on its own (attention, positions, windows per frame), so a video's
    frames may be computed on different ranks. False moves each clip whole: the safe default,
    since declaring it wrongly gives silently wrong outputs and gradients."""
    one_frame_rows: bool = False
    """The tower fails on grid rows with ``t > 1`` and its parent feeds videos one row per frame
    (GLM): balancing feeds them the same way."""
    batched_pixels: bool = False
    """The tower takes its pixels with a leading batch dimension of 1 (its parent adds it)."""
    pixel_shape: Callable[[object], tuple[int, ...]] | None = None
    """``vision config -> shape of one pixel row`` as the tower takes it, when not flat (rows may
    arrive flat from another rank)."""
    batched_outputs: bool = False
    """The tower's restored fields carry a leading batch dimension of 1."""
    bands: str | None = None
    """The tower runs row bands of a frame (``fx_vitbal.integrations.hf_bands``) by this recipe
    of precomputed kwargs: ``qwen2`` (positions and segments), ``qwen2_5`` (and windows),
    ``qwen3`` (and the interpolated position table), ``glm`` (and whole-frame image shapes).
    None: never split."""
    outputs: tuple[str, ...] = ("pooler_output",)
    """The output fields restored to their home rank (what the parent's feature code reads);
    a list field (Qwen3-VL's ``deepstack_features``) is restored entry by entry, its None
    entries kept. Fields not named come back as None."""
    hidden_state: int | None = None
    """The one entry of ``hidden_states`` the parent reads (Ovis2.5: ``-1``, the last block's
    output before the final norm), asked for with ``output_hidden_states=<index>``: the balanced
    tower computes that entry and restores it (name ``hidden_states`` in ``outputs``). Any other
    ``output_hidden_states`` request raises on every rank, as it does without this field."""
    output_rows: Callable[[int, int, int, int], int] | None = None
    """``(t, h, w, merge) -> rows`` every restored field has for one grid row, when not
    ``t*h*w`` or ``t*h*w / merge**2``: a merger that adds a row per line and begin/end rows
    (HunYuanVL: ``h/m * (w/m + 1) + 2``), or pools a clip's frames into one (Kimi-K2.5:
    ``h*w / m**2``). With ``frames_independent`` it is also called per frame (``t=1``) and must
    add up over them. Restored by a routing that counts these rows; eager only (the balanced
    tower runs outside compiled graphs), never split into bands."""
    grid_argument: str = "grid_thw"
    """The name the tower's forward takes its grid by (Inkling2: ``image_grid_thw``)."""
    convention: CallConvention | None = None
    """How the tower and its parent pass pixels and grid, when not as the Qwen contract does."""
    text_only_embeds: bool = False
    """A rank without pixels ties its empty tower output into the autograd graph through the
    parent's input embeddings (plus the output's empty sum, an exact +0.0) instead of an empty
    image entry: the parent checks its image entries against start/end tokens (Ovis2.5)."""

    def __post_init__(self):
        if self.output_rows is not None and self.bands is not None:
            raise ValueError(f"{self.family}: a rule with output_rows runs no bands")


_BY_CLASS: dict[type, HFTowerRule] = {}


def register_hf_tower(cls: type, **fields) -> type:
    """Declare a Hugging Face vision tower class balanceable (and its subclasses) with the
    ``HFTowerRule`` these fields make (``family`` defaults to the class name); returns ``cls``.
    A class registered here wins over a shipped rule for it or its bases.

    Raises:
        TypeError: a field ``HFTowerRule`` does not have, or ``dims`` missing.
    """
    _BY_CLASS[cls] = HFTowerRule(**{"family": cls.__name__, **fields})
    return cls


def _qwen2_dims(c):
    return c.embed_dim, int(c.embed_dim * c.mlp_ratio), c.hidden_size


def _qwen_dims(c):
    return c.hidden_size, c.intermediate_size, c.out_hidden_size


def _glm_dims(c):  # Glm4vVisionMlp's hidden width is out_hidden_size (modeling_glm4v.py)
    return c.hidden_size, c.out_hidden_size, c.out_hidden_size


def _plain_dims(c):  # the blocks' width is the tower's output width (the parent projects it)
    return c.hidden_size, c.intermediate_size, c.hidden_size


def _layers(c) -> int:
    return c.num_hidden_layers


def _frame_patch_width(c) -> int:  # no temporal patch: one frame per pixel row
    return _channels(c) * c.patch_size**2


def _config_merge(tower: nn.Module) -> int:
    return tower.config.spatial_merge_size


def _rgb_patch(c) -> tuple[int, int, int]:  # Kimi-K2.5's patch convolution takes 3 channels
    side = c.patch_size if isinstance(c.patch_size, int) else c.patch_size[0]
    return 3, side, side


def _token_block(c) -> tuple[int, int, int]:  # one LM token's (m*p, m*p, C) pixels
    side = c.spatial_merge_size * c.patch_size
    return side, side, _channels(c)


def _lines(t, h, w, m) -> int:  # a row after each line of merged patches
    return t * (h // m) * (w // m + 1)


def _lines_and_ends(t, h, w, m) -> int:  # and begin/end rows
    return t * (h // m * (w // m + 1) + 2)


_QWEN = dict(dims=_qwen_dims, frames_independent=True)
_QWEN2_5 = dict(_QWEN, gated_mlp=True, bands="qwen2_5")
_MUSE = dict(  # the tower's own pixel shuffle merges 2x2 blocks into its output rows
    dims=lambda c: (c.hidden_size, c.intermediate_size, c.hidden_size * c.merge_size**2),
    depth=_layers,
    pixel_width=lambda c: 3 * c.patch_temporal * c.patch_size**2,
    merge_size=lambda tower: tower.config.merge_size,
    frames_independent=True,
    outputs=("last_hidden_state",),
)
_QWEN3 = dict(_QWEN, outputs=("pooler_output", "deepstack_features"))
_QWEN3_BANDS = dict(_QWEN3, bands="qwen3")
# Towers whose parent projects ``last_hidden_state``, with HF-style config names.
_PROJECTED = dict(
    dims=_plain_dims, depth=_layers, merge_size=_config_merge, outputs=("last_hidden_state",)
)
_MINICPM = dict(  # a strip of patches and target sizes; the parent's merger projects
    dims=_plain_dims,
    depth=_layers,
    pixel_width=_frame_patch_width,
    merge_size=lambda tower: 2,  # its vit_merger's 2x2 windows ("16x"; "4x": a row per patch)
    frames_independent=True,  # every frame is a row of its own in the target sizes
    batched_outputs=True,
    outputs=("last_hidden_state",),
    grid_argument="target_sizes",
    convention=STRIPS,
)
_GLM = dict(dims=_glm_dims, gated_mlp=True, frames_independent=True, one_frame_rows=True)

SHIPPED_RULES: dict[str, HFTowerRule] = {
    "Qwen2VisionTransformerPretrainedModel": HFTowerRule(
        family="Qwen2-VL", dims=_qwen2_dims, frames_independent=True, bands="qwen2"
    ),
    "Qwen2_5_VisionTransformerPretrainedModel": HFTowerRule(
        family="Qwen2.5-VL, MiMo-VL", **_QWEN2_5
    ),
    "Qwen2_5OmniVisionEncoder": HFTowerRule(family="Qwen2.5-Omni", **_QWEN2_5),
    "Qwen3VLVisionModel": HFTowerRule(family="Qwen3-VL", **_QWEN3_BANDS),
    "Qwen3VLMoeVisionModel": HFTowerRule(family="Qwen3-VL-MoE", **_QWEN3_BANDS),
    "Qwen3OmniMoeVisionEncoder": HFTowerRule(family="Qwen3-Omni-MoE", **_QWEN3_BANDS),
    "Qwen3_5VisionModel": HFTowerRule(family="Qwen3.5", bands="qwen3", **_QWEN),
    "Qwen3_5MoeVisionModel": HFTowerRule(family="Qwen3.5-MoE", bands="qwen3", **_QWEN),
    "Qwen4ExpVisionModel": HFTowerRule(family="Qwen4-Exp", bands="qwen3", **_QWEN),
    "CohereCompassVisionModel": HFTowerRule(family="Cohere-Compass", **_QWEN3_BANDS),
    "Exaone4_5_VisionModel": HFTowerRule(family="EXAONE-4.5", **_QWEN2_5),
    "Dots3NoteVisionModel": HFTowerRule(
        family="dots3-note",
        dims=lambda c: (c.hidden_size, c.intermediate_size, c.adapter_out_dim),
        depth=_layers,
        pixel_width=_frame_patch_width,
        merge_size=_config_merge,
        gated_mlp=True,
        frames_independent=True,
    ),
    "Ernie4_5_VLMoeVisionTransformerPretrainedModel": HFTowerRule(
        family="ERNIE-4.5-VL",
        dims=_plain_dims,
        pixel_width=_frame_patch_width,
        frames_independent=True,
        outputs=("last_hidden_state",),  # the parent's resampler reads it
    ),
    "Lfm3VlVisionModel": HFTowerRule(
        family="LFM3-VL", gated_mlp=True, frames_independent=True, **_PROJECTED
    ),
    "Cosmos3EdgeVisionModel": HFTowerRule(
        family="Cosmos3-Edge",
        pixel_width=_frame_patch_width,
        frames_independent=True,
        **_PROJECTED,
    ),
    "MuseGlimmerVisionModel": HFTowerRule(family="Muse-Glimmer", **_MUSE),
    "MuseSparkVisionModel": HFTowerRule(family="Muse-Spark", **_MUSE),
    "MiniMaxM3VLVisionModel": HFTowerRule(
        family="MiniMax-M3-VL",
        frames_independent=False,  # attention spans every frame of a grid row
        batched_outputs=True,
        **_PROJECTED,
    ),
    "PaddleOCRVisionModel": HFTowerRule(
        family="PaddleOCR-VL",
        pixel_width=_frame_patch_width,
        frames_independent=True,
        batched_pixels=True,
        pixel_shape=lambda c: (c.num_channels, c.patch_size, c.patch_size),
        **_PROJECTED,
    ),
    "LlavaOnevision15VisionModel": HFTowerRule(  # each frame with its own class row
        family="LLaVA-OneVision-1.5", pixel_width=_frame_patch_width, **_QWEN
    ),
    "Ovis2_5VisionModel": HFTowerRule(
        family="Ovis2.5",
        frames_independent=True,  # windows, positions and attention per frame
        hidden_state=-1,
        text_only_embeds=True,
        **dict(_PROJECTED, outputs=("hidden_states",)),
    ),
    "HunYuanVLVisionTransformer": HFTowerRule(  # images only (its merger takes one frame)
        family="HunYuanVL",
        pixel_width=_frame_patch_width,
        batched_outputs=True,
        output_rows=_lines_and_ends,
        **dict(_PROJECTED, dims=_qwen_dims, outputs=("pooler_output",)),
    ),
    "HYV4VLVisionModel": HFTowerRule(  # frames merged one by one, each with its line rows
        family="HY-V4-VL",
        pixel_width=_frame_patch_width,
        frames_independent=True,
        batched_outputs=True,
        output_rows=_lines,
        **dict(_PROJECTED, dims=_qwen_dims, outputs=("pooler_output",)),
    ),
    "Inkling2VisionModel": HFTowerRule(  # a class row per image: clips stay whole
        family="Inkling2, Inkling2-Loop",
        dims=lambda c: (c.hidden_size, c.intermediate_size, c.text_hidden_size),
        depth=_layers,
        pixel_width=lambda c: math.prod(_token_block(c)),
        pixel_shape=_token_block,
        merge_size=lambda tower: 1,  # its grid counts LM tokens, one pixel block each
        grid_argument="image_grid_thw",
    ),
    "Kimi_K25VisionModel": HFTowerRule(
        family="Kimi-K2.5",
        dims=lambda c: (c.hidden_size, c.intermediate_size, c.hidden_size),
        depth=_layers,
        pixel_width=lambda c: math.prod(_rgb_patch(c)),
        pixel_shape=_rgb_patch,
        merge_size=lambda tower: tower.merge_kernel_size[0],
        frames_independent=False,  # a clip's frames attend to each other, then are averaged
        output_rows=lambda t, h, w, m: h * w // m**2,  # one (m*m, C) row per merged patch
    ),
    "MiniCPMOcrVisionModel": HFTowerRule(family="MiniCPM-OCR", **_MINICPM),
    "MiniCPMV4_6VisionModel": HFTowerRule(family="MiniCPM-V 4.6", **_MINICPM),
    "MiniCPMV4_7VisionModel": HFTowerRule(family="MiniCPM-V 4.7", **_MINICPM),
    "Glm4vVisionModel": HFTowerRule(family="GLM-4.1V, GLM-4.6V", bands="glm", **_GLM),
    "Glm4vMoeVisionModel": HFTowerRule(family="GLM-4.5V", bands="glm", **_GLM),
    "GlmOcrVisionModel": HFTowerRule(family="GLM-OCR", **dict(_GLM, dims=_qwen_dims)),
    "Glm5NextVisionModel": HFTowerRule(family="GLM-5-Next", **dict(_GLM, dims=_qwen_dims)),
}  # The towers of transformers 5.x this package ships rules for, by class name.

REFUSED_TOWERS: dict[str, str] = {
    "Step3p7VisionModel": (
        "Step3p7's tower takes no grid (each call is one view size) and its parent calls it "
        "twice per step, for the global views and then the local crops"
    ),
    "VideoLlama3VisionModel": (
        "VideoLLaMA3's tower takes a merge size per grid row (1 for images, 2 for videos) as an "
        "input that would have to travel with each moved image, and a rule has no per-unit inputs"
    ),
    "GlmImageVisionModel": (
        "GLM-Image generates images: its grid holds target grids that have no pixels, and its "
        "tower's outputs become discrete VQ codes that no gradient goes through"
    ),
}  # Tower classes that cannot be balanced, and why.

REFUSED_PARENTS: dict[str, str] = {
    "ColQwen2ForRetrieval": (
        "its forward calls the vision tower itself and then its VLM without pixels, so ranks "
        "with images would make one more balanced tower call than text-only ranks"
    ),
}
"""Model classes around a tower whose own code keeps the ranks from calling it in step, and why."""


def refuse_parents(model: nn.Module) -> None:
    """Raise if a module of ``model`` is (a subclass of) a ``REFUSED_PARENTS`` class.

    Raises:
        TypeError: naming the class and why.
    """
    for module in model.modules():
        for base in type(module).__mro__:
            if base.__module__.startswith("transformers.") and base.__name__ in REFUSED_PARENTS:
                raise TypeError(
                    f"{base.__name__} cannot be balanced: {REFUSED_PARENTS[base.__name__]}"
                )


def hf_tower_rule(cls: type) -> HFTowerRule:
    """The rule of a tower class: the first class in its MRO registered by
    ``register_hf_tower``, else the shipped (or refused) rule of its own transformers class, the
    first in the MRO (FSDP2's ``FSDP<name>`` is seen through). A transformers tower subclassing
    another family's (ERNIE's, LFM3's: Qwen2-VL's) does not inherit its rule: LFM3 adds a conv.

    Raises:
        TypeError: refused, no grid, or no rule (the message names the registry).
    """
    registered = next((_BY_CLASS[base] for base in cls.__mro__ if base in _BY_CLASS), None)
    if registered is not None:
        return registered
    own = next((b.__name__ for b in cls.__mro__ if b.__module__.startswith("transformers.")), None)
    if own in REFUSED_TOWERS:
        raise TypeError(f"{own} cannot be balanced: {REFUSED_TOWERS[own]}")
    if own in SHIPPED_RULES:
        return SHIPPED_RULES[own]
    takes = inspect.signature(cls.forward).parameters
    if "pixel_values" in takes and not any("grid" in p or "sizes" in p for p in takes):
        raise TypeError(  # LLaVA's CLIPVisionModel: its work grows with its image count alone
            f"{cls.__qualname__} takes no image grid (grid_thw): its images are fixed-size, so "
            "there is nothing to balance by grid (fx_vitbal balances towers whose cost follows "
            "each image's [t, h, w])"
        )
    raise TypeError(
        f"{cls.__qualname__} is not a known Hugging Face vision tower: if it keeps the contract "
        "fx_vitbal.HFTowerRule describes, declare it with fx_vitbal.register_hf_tower(cls, "
        "dims=..., frames_independent=...); shipped: " + ", ".join(SHIPPED_RULES)
    )


def known_tower_names() -> set[str]:
    """Class names of the towers with a rule (shipped or registered), for the compile backend."""
    return set(SHIPPED_RULES) | {cls.__name__ for cls in _BY_CLASS}


def architecture_cost(tower: nn.Module) -> ArchitectureCost:
    """The FLOP cost model of a tower with a rule, from its config."""
    c, rule = tower.config, hf_tower_rule(type(tower))
    hidden, mlp_hidden, out_dim = rule.dims(c)
    full = getattr(c, "fullatt_block_indexes", None)  # Qwen2.5-VL: the rest attend in windows
    windowed = "window_attention" in (getattr(c, "layer_types", None) or ())
    if full is None and windowed and hasattr(c, "window_size"):  # Ovis2.5
        full = [kind for kind in c.layer_types if kind == "full_attention"]
    return ArchitectureCost(
        hidden=hidden,
        mlp_hidden=mlp_hidden,
        depth=rule.depth(c),
        in_dim=rule.pixel_width(c),
        out_dim=out_dim,
        spatial_merge_size=rule.merge_size(tower),
        full_attention_layers=None if full is None else len(full),
        window_patches=None if full is None else (c.window_size // c.patch_size) ** 2,
        per_frame=rule.frames_independent,
        gated_mlp=rule.gated_mlp,
        num_mergers=1 + len(getattr(c, "deepstack_visual_indexes", None) or ()),
    )
