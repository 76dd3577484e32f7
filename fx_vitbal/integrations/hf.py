"""Balance the vision tower of a Hugging Face VLM (transformers >= 5) across data-parallel ranks.

``enable_hf_vit_balance(model)`` changes two things in place and keeps every parameter, buffer,
``state_dict`` key and FSDP unit:

1. The tower's ``forward`` (found with ``model.get_encoder(modality="image")``) becomes
   plan -> redistribute -> original forward -> restore, returning the tower's own ModelOutput
   class with ``pooler_output`` (and Qwen3-VL's ``deepstack_features`` list) in the local layout.
2. A forward pre-hook on the module that calls the tower (e.g. ``Qwen2VLModel``) encodes images
   and videos together in **one** tower call, on **every** rank, and hands the features to the
   parent through its ``mm_encoder_outputs`` argument. Why: HF calls the tower once per modality
   present, and not at all for text-only samples, so ranks would disagree on the number of
   collectives and hang. One call per forward on every rank also means one ``restore`` per step,
   so backward issues its collective exactly once too. A rank without pixels passes its (empty)
   output as an empty image entry: the parent's ``masked_scatter`` keeps it in the autograd graph,
   so the backward of ``restore`` (a collective) runs there as well, at the same point as on the
   other ranks.

Balancing is active with more than one rank while the tower trains (or always, with
``BalanceConfig(when="always")``); otherwise (``generate``, where ranks take different numbers of
steps) the tower runs unchanged and issues no collective.
The balanced tower returns ``last_hidden_state=None`` (no parent reads it; restoring it would
more than double the return traffic), and rejects ``output_hidden_states`` /
``output_attentions``. Precomputed per-batch kwargs (``cu_seqlens``, ``window_index``, ...) are
dropped: they describe the unbalanced batch, and the tower recomputes them from its grid.
"""

import dataclasses
import functools
import inspect
import sys
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from fx_vitbal.config import BalanceConfig
from fx_vitbal.cost.static import ArchitectureCost
from fx_vitbal.runtime.call import run_balanced
from fx_vitbal.runtime.metadata import PROBLEMS, describe_problem
from fx_vitbal.runtime.settings import active_group, layout_token, planner_spec_for
from fx_vitbal.runtime.vits import EntryPoint, register_entry_point

# Popped by transformers.vision_utils helpers; they describe the pre-balance packed batch.
PRECOMPUTED_KWARGS = (
    "cu_seqlens",
    "max_seqlen",
    "position_ids",
    "window_index",
    "cu_window_seqlens",
    "max_window_seqlen",
    "interp_indices",
    "interp_weights",
    "bilinear_indices",
    "bilinear_weights",
    "merged_shape",
    "frame_index",
    "temporal_merge_index",
)
_MODALITIES = (
    ("image", "pixel_values", "image_grid_thw"),
    ("video", "pixel_values_videos", "video_grid_thw"),
)


@dataclasses.dataclass(frozen=True)
class TowerRule:
    """What balancing must know about one tower class beyond its config.

    Every supported tower has the same contract: ``forward(pixels, grid_thw)``, pixel rows
    ``t*h*w``, ``pooler_output`` (and each ``deepstack_features`` entry) ``t*h*w/merge**2`` rows in
    grid order, attention, positions and windows per frame (so frames may be computed on
    different ranks, exactly). Window attention (``fullatt_block_indexes``) and deepstack mergers
    (``deepstack_visual_indexes``) are read from the config.
    """

    family: str
    dims: Callable[[object], tuple[int, int, int]]
    """``config -> (block width, MLP width, output width)`` for the cost model."""
    gated_mlp: bool
    one_frame_rows: bool = False
    """The tower fails on grid rows with ``t > 1`` (GLM): videos are fed one row per frame."""


class _Balance(NamedTuple):
    config: BalanceConfig
    group: dist.ProcessGroup | None
    planner: str
    rule: TowerRule


def _qwen2_dims(c):
    return c.embed_dim, int(c.embed_dim * c.mlp_ratio), c.hidden_size


def _qwen_dims(c):
    return c.hidden_size, c.intermediate_size, c.out_hidden_size


def _glm_dims(c):  # Glm4vVisionMlp's hidden width is out_hidden_size (modeling_glm4v.py)
    return c.hidden_size, c.out_hidden_size, c.out_hidden_size


SUPPORTED_TOWERS: dict[str, TowerRule] = {
    "Qwen2VisionTransformerPretrainedModel": TowerRule("Qwen2-VL", _qwen2_dims, False),
    "Qwen2_5_VisionTransformerPretrainedModel": TowerRule("Qwen2.5-VL, MiMo-VL", _qwen_dims, True),
    "Qwen2_5OmniVisionEncoder": TowerRule("Qwen2.5-Omni", _qwen_dims, True),
    "Qwen3VLVisionModel": TowerRule("Qwen3-VL", _qwen_dims, False),
    "Qwen3VLMoeVisionModel": TowerRule("Qwen3-VL-MoE", _qwen_dims, False),
    "Qwen3OmniMoeVisionEncoder": TowerRule("Qwen3-Omni-MoE", _qwen_dims, False),
    "Qwen3_5VisionModel": TowerRule("Qwen3.5", _qwen_dims, False),
    "Qwen3_5MoeVisionModel": TowerRule("Qwen3.5-MoE", _qwen_dims, False),
    "Glm4vVisionModel": TowerRule("GLM-4.1V, GLM-4.6V", _glm_dims, True, one_frame_rows=True),
    "Glm4vMoeVisionModel": TowerRule("GLM-4.5V", _glm_dims, True, one_frame_rows=True),
    "GlmOcrVisionModel": TowerRule("GLM-OCR", _qwen_dims, True, one_frame_rows=True),
}
"""Supported tower class names (transformers 5.x) and their rules."""

REFUSED_TOWERS: dict[str, str] = {
    "Kimi_K25VisionModel": (
        "Kimi-K2.5's MoonViT attends across the frames of a clip and averages them, and its "
        "pooler rows are (h/2)*(w/2) blocks of shape (4, C), not t*h*w/4 rows"
    ),
}


def is_hf_model(module: nn.Module) -> bool:
    """True for a transformers ``PreTrainedModel`` (never imports transformers itself)."""
    modeling = sys.modules.get("transformers.modeling_utils")
    return modeling is not None and isinstance(module, modeling.PreTrainedModel)


def enable_hf_vit_balance(
    model: nn.Module,
    *,
    config: BalanceConfig | None = None,
    group: dist.ProcessGroup | None = None,
) -> nn.Module:
    """Balance the vision tower of an HF VLM (or the tower itself) in place; returns ``model``.

    With a parent model, a normal training step (``model(**batch)``, loss, backward) is balanced
    with no other change, including ranks without images. With a bare tower, every rank must
    call it at the same steps (with ``[0, C]`` pixels and a ``[0, 3]`` grid when it has none).
    Calling it again updates config and group.

    Raises:
        TypeError: the tower is unknown, or refused (Kimi-K2.5; see ``REFUSED_TOWERS``).
        ValueError: the parent does not accept ``mm_encoder_outputs``.
    """
    config = config or BalanceConfig()
    tower = model
    if (
        hasattr(model, "get_encoder")
        and _class_name(model) not in SUPPORTED_TOWERS | REFUSED_TOWERS
    ):
        tower = model.get_encoder(modality="image")
    rule = tower_rule(tower)
    planner = planner_spec_for(config, architecture_cost(tower), frame_independent=True)
    tower._vitbal_hf = _Balance(config, group, planner, rule)
    layout_token(tower)  # made now, so graphs traced later read it as a constant
    original = getattr(tower, "_vitbal_original_forward", tower.forward)
    tower._vitbal_original_forward = original
    tower.forward = functools.partial(_balanced_forward, tower, original)
    owner = next((m for m in model.modules() if any(c is tower for c in m.children())), None)
    if owner is not None and not hasattr(owner, "_vitbal_hf_hook"):
        params = list(inspect.signature(owner.forward).parameters)
        if "mm_encoder_outputs" not in params:
            raise ValueError(
                f"{type(owner).__qualname__}.forward takes no mm_encoder_outputs; enable balancing "
                "on its vision tower instead and call the tower on every rank"
            )
        hook = functools.partial(_encode_before_parent, tower, params)
        owner._vitbal_hf_hook = owner.register_forward_pre_hook(hook, with_kwargs=True)
    return model


def tower_rule(tower: nn.Module) -> TowerRule:
    """The ``SUPPORTED_TOWERS`` rule of ``tower``'s class.

    Raises:
        TypeError: refused or unknown class. The name matched is that of the first transformers
            class in the MRO, so wrappers like FSDP2's ``FSDP<name>`` classes are seen through.
    """
    name = _class_name(tower)
    if name in REFUSED_TOWERS:
        raise TypeError(f"{name} cannot be balanced: {REFUSED_TOWERS[name]}")
    if name not in SUPPORTED_TOWERS:
        raise TypeError(
            f"{type(tower).__qualname__} is not a supported vision tower; supported: "
            f"{', '.join(SUPPORTED_TOWERS)}"
        )
    return SUPPORTED_TOWERS[name]


def architecture_cost(tower: nn.Module) -> ArchitectureCost:
    """The FLOP cost model of a supported tower, from its config."""
    c, rule = tower.config, tower_rule(tower)
    hidden, mlp_hidden, out_dim = rule.dims(c)
    full = getattr(c, "fullatt_block_indexes", None)  # Qwen2.5-VL: the rest attend in windows
    return ArchitectureCost(
        hidden=hidden,
        mlp_hidden=mlp_hidden,
        depth=c.depth,
        in_dim=c.in_channels * c.temporal_patch_size * c.patch_size**2,
        out_dim=out_dim,
        spatial_merge_size=c.spatial_merge_size,
        full_attention_layers=None if full is None else len(full),
        window_patches=None if full is None else (c.window_size // c.patch_size) ** 2,
        per_frame=True,
        gated_mlp=rule.gated_mlp,
        num_mergers=1 + len(getattr(c, "deepstack_visual_indexes", None) or ()),
    )


def _balanced_forward(tower, original, hidden_states, grid_thw, vitbal_problem=0, **kwargs):
    config, group, planner, _ = tower._vitbal_hf
    dist_info = active_group(tower, config, group)
    if dist_info is None:
        return original(hidden_states, grid_thw=grid_thw, **kwargs)
    # Problems found here raise on every rank, through the plan (never here, alone).
    problem = vitbal_problem
    for flag in ("output_hidden_states", "output_attentions"):
        if kwargs.pop(flag, None):
            problem = problem or PROBLEMS["hidden_states"]
    return_dict = kwargs.pop("return_dict", True)
    for name in PRECOMPUTED_KWARGS:
        kwargs.pop(name, None)

    def run(pixels, grid):
        out = original(pixels, grid_thw=grid, return_dict=True, **kwargs)
        return [out.pooler_output, *(getattr(out, "deepstack_features", None) or ())], out

    merge = tower.spatial_merge_size
    if problem:  # only the plan runs: the tower never sees these pixels
        hidden_states = hidden_states.new_empty(0, *hidden_states.shape[1:])
        grid_thw = torch.zeros(0, 3, dtype=torch.long, device=hidden_states.device)
    outputs, out = run_balanced(
        run, hidden_states, grid_thw, merge, planner, dist_info, module=tower, problem=problem
    )
    if problem:  # (compiled: the plan's empty output keeps the op in the graph)
        return out
    fields = {"pooler_output": outputs[0]}
    if "deepstack_features" in out:
        fields["deepstack_features"] = list(outputs[1:])
    result = type(out)(last_hidden_state=None, **fields)
    return result if return_dict else (None, *result.to_tuple())


def _encode_before_parent(tower, params, module, args, kwargs):
    """Encode this rank's images and videos in one balanced tower call (see the module doc).

    When balancing is not active (eval mode, one rank) the same single tower call runs plainly
    on ranks that have pixels, so a wrapped parent never reaches its own ``get_image_features``:
    the ``vitbal`` backend refuses graphs that do (an unwrapped VLM).
    """
    config, group, _, rule = tower._vitbal_hf
    active = active_group(tower, config, group) is not None
    kwargs = {**dict(zip(params[: len(args)], args, strict=True)), **kwargs}
    if not active and all(kwargs.get(key) is None for _, key, _ in _MODALITIES):
        return None
    problem = 0  # raised on every rank by the tower call's plan, never here alone
    if kwargs.get("mm_encoder_outputs") is not None:
        problem = PROBLEMS["mm_encoder_outputs"]
    parts = _tower_parts(tower, rule, kwargs)
    pixels, grid, mixed = _tower_batch(tower, parts)
    problem = problem or mixed
    if problem and not active:  # no collective to keep: this rank alone raises
        raise ValueError(f"vit dp balance: {describe_problem(problem)}")
    # Each image's rows, for the per-image split the parent expects: read before the tower, so
    # the read never waits for it (one read for every modality).
    merge2 = tower.spatial_merge_size**2
    sound = parts and all(_is_integer_grid(p[2]) for p in parts)  # else the plan raises
    counts = [p[2].shape[0] if sound else 0 for p in parts]
    sizes = torch.cat([p[2].prod(-1) // merge2 for p in parts]).tolist() if sound else []
    out = tower(pixels, grid_thw=grid, vitbal_problem=problem)
    features, start = {}, 0
    for (modality, _, _, _), count in zip(parts, counts, strict=True):
        mine, sizes = sizes[:count], sizes[count:]
        features[modality] = _rows(out, start, mine)
        start += sum(mine)
    if not parts:  # the empty entry ties this rank's output into the graph (module doc, 2.)
        features["image"] = _rows(out, 0, [0])
    return (), {**kwargs, "mm_encoder_outputs": features}


def _tower_parts(tower, rule: TowerRule, kwargs: dict) -> list[tuple]:
    """``(modality, pixels, grid as given, grid as fed to the tower)`` of each modality present,
    popped from ``kwargs``, pixels in the tower's dtype."""
    parts = []
    for modality, pixel_key, grid_key in _MODALITIES:
        if kwargs.get(pixel_key) is not None:
            grid = kwargs[grid_key]
            split = rule.one_frame_rows and modality == "video" and _is_integer_grid(grid)
            fed = _one_frame_rows(grid) if split else grid
            parts.append((modality, kwargs.pop(pixel_key).type(tower.dtype), grid, fed))
    return parts


def _tower_batch(tower, parts: list[tuple]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The one tower call's ``(pixels, grid, problem)``: the parts joined (images, then videos),
    or an empty batch with a problem code when their row widths differ, or none is present."""
    problem = PROBLEMS["modalities_differ"] if len({p[1].shape[1:] for p in parts}) > 1 else 0
    if parts and not problem:
        pixels = torch.cat([p[1] for p in parts]) if len(parts) > 1 else parts[0][1]
        grid = torch.cat([p[3] for p in parts]) if len(parts) > 1 else parts[0][3]
        return pixels, grid, 0
    c = tower.config
    width = c.in_channels * c.temporal_patch_size * c.patch_size**2
    pixels = torch.zeros(0, width, dtype=tower.dtype, device=tower.device)
    return pixels, torch.zeros(0, 3, dtype=torch.long, device=tower.device), problem


def plan_input(module, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw):
    """A batch of a balanced VLM (or tower, ``module``) as its one balanced tower call will see
    it: ``(pixels, grid)`` for ``fx_vitbal.plan_ahead``.

    Raises:
        ValueError: the images' and videos' pixel rows differ in width (one tower call cannot
            take both; the step would raise this on every rank).
    """
    tower = next(m for m in module.modules() if hasattr(m, "_vitbal_hf"))
    batch = {
        "pixel_values": pixel_values,
        "image_grid_thw": image_grid_thw,
        "pixel_values_videos": pixel_values_videos,
        "video_grid_thw": video_grid_thw,
    }
    pixels, grid, problem = _tower_batch(tower, _tower_parts(tower, tower._vitbal_hf.rule, batch))
    if problem:
        raise ValueError(f"vit dp balance: {describe_problem(problem)}")
    return pixels, grid


def _rows(out, start, sizes):
    """``out`` restricted to rows ``start:start+sum(sizes)``, split per image like
    ``get_image_features`` does (Qwen3-VL: ``deepstack_features`` a list of per-image tuples)."""

    def take(x):
        return x[start : start + sum(sizes)].split(sizes)

    fields = {"pooler_output": take(out.pooler_output)}
    if "deepstack_features" in out:
        fields["deepstack_features"] = [take(d) for d in out.deepstack_features]
    return type(out)(**fields)


def _is_integer_grid(grid) -> bool:
    """A grid ``_one_frame_rows`` can split; any other reaches the plan as given, which then
    raises its error on every rank."""
    return grid.dim() == 2 and grid.shape[1] == 3 and not grid.dtype.is_floating_point


def _one_frame_rows(grid):
    """``[t, h, w]`` rows as ``t`` rows ``[1, h, w]`` (what GLM's ``get_video_features`` feeds).
    A non-positive ``t`` gives no row (the plan then raises on the rows it cannot match)."""
    hw = torch.repeat_interleave(grid[:, 1:], grid[:, 0].clamp(min=0), dim=0)
    return torch.cat([hw.new_ones(hw.shape[0], 1), hw], dim=1)


def _class_name(module: nn.Module) -> str:
    for cls in type(module).__mro__:
        if cls.__module__.startswith("transformers."):
            return cls.__name__
    return type(module).__name__


def tower_files() -> dict[str, str]:
    """The modeling files of the supported towers imported so far -> their class name."""
    files = {}
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("transformers.models."):
            for name in SUPPORTED_TOWERS:
                if hasattr(module, name):
                    files[inspect.getsourcefile(getattr(module, name))] = name
    return files


register_entry_point(
    EntryPoint(__file__, is_hf_model, enable_hf_vit_balance, tower_files, plan_input)
)
