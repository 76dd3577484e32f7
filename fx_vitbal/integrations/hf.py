"""Balance the vision tower of a Hugging Face VLM (transformers >= 5) across data-parallel ranks.

``enable_hf_vit_balance(model)`` changes two things in place and keeps every parameter, buffer,
``state_dict`` key and FSDP unit:

1. The tower's ``forward`` (found with ``model.get_encoder(modality="image")``, or named with
   ``vit=``) becomes plan -> redistribute -> original forward -> restore, returning the tower's
   own ModelOutput class with the fields its ``HFTowerRule`` names (``pooler_output``, Qwen3-VL's
   ``deepstack_features`` list...) in the local layout.
2. A forward pre-hook on the module that calls the tower (e.g. ``Qwen2VLModel``) encodes images
   and videos together in **one** tower call, on **every** rank. Why: HF calls the tower once per
   modality present, and not at all for text-only samples, so ranks would disagree on the number
   of collectives and hang. One call per forward on every rank also means one ``restore`` per
   step, so backward issues its collective exactly once too. Then the parent's own
   ``get_image_features`` / ``get_video_features`` runs for each modality, its tower call answered
   by the restored outputs (``hf_outputs.replay``), and hands its result to the parent's forward
   through ``mm_encoder_outputs``: projectors, resamplers, reshapes and per-image splits run as the
   family wrote them, on the rank and in the order the images came from. A rank without pixels
   passes its (empty) tower output as an empty image entry: the parent's ``masked_scatter``
   keeps it in the autograd graph, so the backward of ``restore`` (a collective) runs there as
   well, at the same point as on the other ranks (or, where the rule says the parent refuses an
   empty entry, its input embeddings plus the output's empty sum, an exact +0.0).

Balancing is active with more than one rank while the tower trains (or always, with
``BalanceConfig(when="always")``); otherwise (``generate``, where ranks take different numbers of
steps) the tower runs unchanged and issues no collective.
The balanced tower returns the fields its rule names and None for the rest (restoring
``last_hidden_state`` where no parent reads it would more than double the return traffic), and
rejects ``output_hidden_states`` (but for the one entry a rule names) / ``output_attentions``.
Precomputed per-batch kwargs (``cu_seqlens``, ``window_index``, ...) are dropped: they describe
the unbalanced batch, and the tower recomputes them from its grid.
"""

import dataclasses
import functools
import inspect
import sys
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from fx_vitbal.config import BalanceConfig
from fx_vitbal.integrations import hf_bands
from fx_vitbal.integrations.hf_inputs import (
    as_rows,
    modalities,
    tower_batch,
    tower_call,
    tower_parts,
)
from fx_vitbal.integrations.hf_outputs import (
    as_tuple,
    asks_only,
    empty_per_image,
    fields_of,
    modality_rows,
    output_with,
    replay,
    replayed,
    restored_rows,
    tied_to_embeddings,
)
from fx_vitbal.integrations.hf_towers import (
    HFTowerRule,
    architecture_cost,
    hf_tower_rule,
    known_tower_names,
    refuse_parents,
)
from fx_vitbal.runtime.agree.problems import PROBLEMS, describe_problem
from fx_vitbal.runtime.call import (
    empty_pixels,
    group_device_types,
    input_problem,
    run_balanced,
)
from fx_vitbal.runtime.transport import collectives
from fx_vitbal.runtime.vit.registry import EntryPoint, is_vision_encoder_class, register_entry_point
from fx_vitbal.runtime.vit.settings import (
    active_group,
    layout_token,
    planner_spec_for,
    python_call,
)

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


class _Balance(NamedTuple):
    config: BalanceConfig
    group: dist.ProcessGroup | None
    replica_group: dist.ProcessGroup | None
    planner: str
    rule: HFTowerRule
    merge: int


def is_hf_model(module: nn.Module) -> bool:
    """True for a transformers ``PreTrainedModel`` (never imports transformers itself)."""
    modeling = sys.modules.get("transformers.modeling_utils")
    return modeling is not None and isinstance(module, modeling.PreTrainedModel)


def enable_hf_vit_balance(
    model: nn.Module,
    *,
    config: BalanceConfig | None = None,
    group: dist.ProcessGroup | None = None,
    replica_group: dist.ProcessGroup | None = None,
    tower: nn.Module | None = None,
) -> nn.Module:
    """Balance the vision tower of an HF VLM (or the tower itself) in place; returns ``model``.

    With a parent model, a normal training step (``model(**batch)``, loss, backward) is balanced
    with no other change, including ranks without images. With a bare tower, every rank must
    call it at the same steps (with ``[0, C]`` pixels and a ``[0, 3]`` grid when it has none).
    ``tower``: the tower when ``model.get_encoder(modality="image")`` does not find it. Calling
    it again updates config and groups. ``replica_group``: the ranks of ``group`` holding this
    rank's batch (``fx_vitbal.dp_balance_vit_encoder`` says more).

    Raises:
        TypeError: the tower's class has no rule (``register_hf_tower``) or is refused, or a
            module around it is (``REFUSED_PARENTS``).
        ValueError: the parent does not accept ``mm_encoder_outputs`` or has no
            ``get_image_features`` (whose replay gives the features).
    """
    config = config or BalanceConfig()
    refuse_parents(model)
    tower = tower if tower is not None else _find_tower(model)
    rule = _rule_of(tower)
    # A tower fed one frame per grid row gets its videos as frames from the plan's units (no
    # host read of the grid), so its frames are always planned as units.
    planned = dataclasses.replace(config, split_frames=True) if rule.one_frame_rows else config
    support = None
    if rule.bands is not None and config.split_images:  # it runs bands (its recipe)
        hf_bands.install(tower, rule.bands)
        support = hf_bands.band_support(tower, rule.bands, rule.dims(tower.config)[0])
    arch = architecture_cost(tower)
    planner = planner_spec_for(planned, arch, rule.frames_independent, support)
    merge = rule.merge_size(tower)
    tower._vitbal_hf = _Balance(config, group, replica_group, planner, rule, merge)
    layout_token(tower)  # made now, so graphs traced later read it as a constant
    original = getattr(tower, "_vitbal_original_forward", tower.forward)
    tower._vitbal_original_forward = original
    forward = functools.partial(_balanced_forward, tower, original)
    # Rows a rule counts are restored by the plan's host objects: eager only, outside graphs.
    tower.forward = torch.compiler.disable(forward) if rule.output_rows else forward
    owner = next((m for m in model.modules() if any(c is tower for c in m.children())), None)
    if owner is not None and not hasattr(owner, "_vitbal_hf_hook"):
        params = list(inspect.signature(owner.forward).parameters)
        if "mm_encoder_outputs" not in params or not hasattr(owner, "get_image_features"):
            raise ValueError(
                f"{type(owner).__qualname__} takes no mm_encoder_outputs or has no "
                "get_image_features; enable balancing on its vision tower instead and call the "
                "tower on every rank"
            )
        hook = functools.partial(_encode_before_parent, tower, params)
        owner._vitbal_hf_hook = owner.register_forward_pre_hook(hook, with_kwargs=True)
    return model


def _find_tower(model: nn.Module) -> nn.Module:
    """``model`` if its class has a tower rule (or is refused), else its image encoder."""
    try:
        hf_tower_rule(type(model))
    except TypeError as error:
        if "cannot be balanced" in str(error) or not hasattr(model, "get_encoder"):
            raise
        return model.get_encoder(modality="image")
    return model


def _rule_of(tower: nn.Module) -> HFTowerRule:
    """``hf_tower_rule``, telling a tower declared for the other contract what to do instead."""
    try:
        return hf_tower_rule(type(tower))
    except TypeError:
        if not is_vision_encoder_class(type(tower)):
            raise
        raise TypeError(
            f"{type(tower).__qualname__} is a Hugging Face tower, declared with "
            "register_vision_encoder: that contract returns (embeddings, window_index, "
            "deepstack), this tower a ModelOutput; declare it with fx_vitbal.register_hf_tower"
            "(cls, dims=..., frames_independent=...) instead"
        ) from None


def _balanced_forward(tower, original, *args, vitbal_problem=0, vitbal_parent=False, **kwargs):
    """The tower's forward, balanced; pixels and outputs in the tower's own format (with a
    leading batch dimension where its rule says so). ``vitbal_parent``: called by its parent
    (``_encode_before_parent``), whose pixels may be copies made for this call (cast to the
    tower's dtype, images and videos joined)."""
    config, group, replica_group, planner, rule, merge = tower._vitbal_hf
    pixels = args[0] if args else kwargs.pop(_pixels_argument(original))
    grid_thw = args[1] if len(args) > 1 else kwargs.pop(rule.grid_argument)
    pending = tower.__dict__.get("_vitbal_replay")
    if pending is not None:  # the parent's feature code, run on restored outputs (replay)
        return replayed(tower, pending, pixels, kwargs.get("return_dict", True))
    dist_info = active_group(tower, config, group, replica_group)
    if dist_info is None:
        return original(pixels, **{rule.grid_argument: grid_thw}, **kwargs)
    # Problems found here raise on every rank, through the plan (never here, alone).
    problem = vitbal_problem
    for flag in ("output_hidden_states", "output_attentions"):
        asked = kwargs.pop(flag, None)
        if asked and not (flag == "output_hidden_states" and asks_only(asked, rule.hidden_state)):
            problem = problem or PROBLEMS["hidden_states"]
    if rule.hidden_state is not None:  # what the parent reads, asked for on every rank
        kwargs["output_hidden_states"] = rule.hidden_state
    return_dict = kwargs.pop("return_dict", True)
    for name in PRECOMPUTED_KWARGS:
        kwargs.pop(name, None)

    def run(rows, grid, split):
        if rule.pixel_shape is not None:
            rows = rows.reshape(-1, *rule.pixel_shape(tower.config))
        extra = {}
        if split is not None:  # the tower's inputs from the plan's host copy (it runs bands)
            extra = hf_bands.band_kwargs(tower, rule.bands, split, rows.device)
        fed, extra[rule.grid_argument] = tower_call(rule, tower, rows, extra.pop("grid_thw", grid))
        out = original(fed, return_dict=True, **kwargs, **extra)
        return restored_rows(rule, out), out

    # A text-only rank calling the tower on its own passes None (its own call would fail):
    # it takes part with empty rows, in the others' layout (``call.call_inputs``).
    problem = problem or input_problem(pixels, grid_thw, False, group_device_types(dist_info[0]))
    rows = None
    if pixels is not None and not problem:
        rows, grid_thw, problem = as_rows(rule, tower, pixels, grid_thw)
    if rows is None or problem:  # only the plan runs: the tower never sees these pixels
        width = 0 if not torch.compiler.is_compiling() else rule.pixel_width(tower.config)
        rows = empty_pixels(dist_info[0], width, tower.dtype)
        grid_thw = torch.zeros(0, 3, dtype=torch.long, device=rows.device)
    call = python_call(tower, planner, merge, dist_info, problem)
    outputs, out, _ = run_balanced(
        run,
        rows,
        grid_thw,
        call,
        tower,
        output_rows=None if rule.output_rows is None else lambda u: rule.output_rows(*u, merge),
        # The rows are the caller's own pixels (a view) only when called directly, without a
        # call convention that rearranges them: then a split step may fetch them again.
        refetch_pixels=not vitbal_parent and rule.convention is None,
    )
    if problem:  # (compiled: the plan's empty output keeps the op in the graph)
        return out
    result = output_with(out, fields_of(rule, out, outputs))
    return result if return_dict else as_tuple(result)


def _pixels_argument(forward) -> str:
    """The name of a tower forward's first argument (``hidden_states``, ``pixel_values``)."""
    return next(iter(inspect.signature(forward).parameters))


def _encode_before_parent(tower, params, module, args, kwargs):
    """Encode this rank's images and videos in one balanced tower call, then run the parent's
    own feature code of each modality on their restored outputs (see the module doc).

    When balancing is not active (eval mode, one rank) the same single tower call runs plainly
    on ranks that have pixels, so a wrapped parent never reaches its own feature code except
    through here: the ``vitbal`` backend refuses graphs that do (an unwrapped VLM).
    """
    config, group, _, _, rule, merge = tower._vitbal_hf
    active = active_group(tower, config, group) is not None
    kwargs = {**dict(zip(params[: len(args)], args, strict=True)), **kwargs}
    if not active and all(kwargs.get(key) is None for _, key, _ in modalities(rule)):
        return None
    problem = 0  # raised on every rank by the tower call's plan, never here alone
    if kwargs.get("mm_encoder_outputs") is not None:
        problem = PROBLEMS["mm_encoder_outputs"]
    parts = tower_parts(tower, rule, kwargs, one_frame_rows=not active)
    device = tower.device if not active else collectives.exchange_device(tower._vitbal_hf.group)
    pixels, grid, mixed = tower_batch(tower, parts, device)
    problem = problem or mixed
    if problem and not active:  # no collective to keep: this rank alone raises
        raise ValueError(f"vit dp balance: {describe_problem(problem)}")
    fed, fed_grid = tower_call(rule, tower, pixels, grid)
    convention = rule.convention
    called = convention.tower_kwargs(module, kwargs) if convention is not None else {}
    out = tower(
        fed, **{rule.grid_argument: fed_grid}, **called, vitbal_problem=problem, vitbal_parent=True
    )
    # What the parent's forward passes its feature methods besides pixels and grid.
    passed = convention.feature_kwargs if convention is not None else ()
    extra = {k: v for k, v in kwargs.items() if k not in params or k in passed}
    extra.pop("return_dict", None)
    features, start = {}, 0
    for modality, part_pixels, part_grid, part_rows, fed_grid in parts:
        stop = start + part_rows.shape[0]
        area = merge**2
        if rule.output_rows is not None:  # (a host read of a device grid, as such towers do)
            stop, area = start + sum(rule.output_rows(*g, merge) for g in fed_grid.tolist()), 0
        restored = modality_rows(out, rule, start, stop, pixels.shape[0], area)
        method = f"get_{modality}_features"
        features[modality] = replay(module, tower, method, part_pixels, part_grid, restored, extra)
        start = stop
    if not parts and rule.text_only_embeds:
        return (), tied_to_embeddings(module, kwargs, restored_rows(rule, out))
    if not parts:  # the empty entry ties this rank's output into the graph (module doc, 2.)
        fields = {n: empty_per_image(out[n]) for n in rule.outputs}
        # What the parent's forward reads of a modality: its (here empty) per-image features.
        fields["pooler_output"] = (restored_rows(rule, out)[0],)
        features["image"] = output_with(out, fields)
    return (), {**kwargs, "mm_encoder_outputs": features}


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
    parts = tower_parts(tower, tower._vitbal_hf.rule, batch, one_frame_rows=False)
    pixels, grid, problem = tower_batch(tower, parts, torch.device("cpu"))
    if problem:
        raise ValueError(f"vit dp balance: {describe_problem(problem)}")
    return pixels, grid


def tower_files() -> dict[str, str]:
    """The modeling files of the towers with a rule imported so far -> their class name."""
    files, names = {}, known_tower_names()
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("transformers.models."):
            for name in names & set(vars(module)):
                files[inspect.getsourcefile(getattr(module, name))] = name
    return files


register_entry_point(
    EntryPoint(__file__, is_hf_model, enable_hf_vit_balance, tower_files, plan_input)
)
