"""A balanced Hugging Face tower's outputs as its parent expects them: the restored fields in
the tower's own ModelOutput class and format, sliced per modality, and the replay of the parent's
own feature code (``get_image_features``...) on them.

Why replay rather than reimplement: what a parent does with its tower's output (projectors,
resamplers, reshapes, per-image splits) differs between families, and a wrapper that skips any of
it trains silently wrong. Answering the parent's one tower call with the restored outputs runs
its own code unchanged.
"""

import dataclasses

import torch

from fx_vitbal.integrations.hf_towers import HFTowerRule


def listed(value) -> list:
    """A field's tensors: the field, or its entries that are not None."""
    if isinstance(value, (list, tuple)):
        return [x for x in value if x is not None]
    return [value]


def asks_only(asked, layer: int | None) -> bool:
    """``output_hidden_states=asked`` selects exactly the entry ``layer`` of ``hidden_states``
    (an index, or a list of one)."""
    if layer is None or isinstance(asked, bool):
        return False
    return list(asked) == [layer] if isinstance(asked, (list, tuple)) else asked == layer


def fields_of(rule: HFTowerRule, out, restored: list) -> dict:
    """The restored tensors (``restored_rows``' order) placed into ``out``'s fields as the rule
    names them, list fields keeping their None entries and type."""
    restored = iter(restored)
    fields = {}
    for name in rule.outputs:
        value = out[name]
        entries = [
            None if x is None else next(restored)
            for x in (value if isinstance(value, (list, tuple)) else [value])
        ]
        if rule.batched_outputs:
            entries = [None if x is None else x.unsqueeze(0) for x in entries]
        fields[name] = type(value)(entries) if isinstance(value, (list, tuple)) else entries[0]
    return fields


def as_tuple(out) -> tuple:
    """``return_dict=False``'s tuple with each field at its place: ``to_tuple`` drops the None
    fields, and a restored output has no ``last_hidden_state`` in front of its pooler."""
    values = [getattr(out, field.name) for field in dataclasses.fields(out)]
    while values and values[-1] is None:
        values.pop()
    return tuple(values)


def output_with(like, fields: dict):
    """A ModelOutput of ``like``'s class holding only ``fields`` (every other field None)."""
    return type(like)(**{"last_hidden_state": None, **fields})


def modality_rows(out, rule: HFTowerRule, start: int, stop: int, pixel_rows: int, merge2: int):
    """``out``'s restored fields restricted to the pixel rows ``start:stop`` of a call of
    ``pixel_rows`` rows: each field (or list entry) has one row per pixel row or one per
    ``merge2`` (merged), told apart by its length. No host read: the bounds are row counts.
    With ``merge2=0``, ``start:stop`` are the fields' own rows (a rule's ``output_rows``)."""

    def take(x):
        if x is None:
            return None
        x = x.squeeze(0) if rule.batched_outputs else x
        per = 1 if x.shape[0] == pixel_rows or not merge2 else merge2
        x = x[start // per : stop // per]
        return x.unsqueeze(0) if rule.batched_outputs else x

    fields = {}
    for name in rule.outputs:
        value = out[name]
        fields[name] = (
            type(value)(map(take, value)) if isinstance(value, (list, tuple)) else take(value)
        )
    return output_with(out, fields)


@torch.compiler.disable
def replay(owner, tower, method: str, pixels, grid, restored, extra: dict):
    """``owner.<method>(pixels, grid)`` (``get_image_features``...) with its tower call answered
    by ``restored``, the balanced tower's outputs for exactly these pixels: projectors,
    resamplers and per-image splits run as the parent wrote them.

    Never compiled: the parent's feature code reads split sizes on the host (a graph break
    anyway), and the ``vitbal`` backend must only see a parent's feature code when the parent
    was not wrapped (it refuses those graphs).

    Raises:
        RuntimeError: the method did not call the tower exactly once (it cannot be replayed).
    """
    tower._vitbal_replay = [restored, pixels.numel()]
    try:
        features = getattr(owner, method)(pixels, grid, return_dict=True, **extra)
    finally:
        pending = tower.__dict__.pop("_vitbal_replay")
    if pending[0] is not None:
        raise RuntimeError(
            f"{type(owner).__qualname__}.{method} never called its vision tower: its features "
            "cannot be computed from the balanced tower's outputs"
        )
    return features


def replayed(tower, replay: list, pixels, return_dict: bool):
    restored, numel = replay
    if restored is None or pixels.numel() != numel:
        raise RuntimeError(
            f"a feature method called {type(tower).__qualname__} twice, or on other pixels "
            f"({pixels.numel()} values, balanced {numel}): it cannot be replayed on the "
            "balanced tower's outputs"
        )
    replay[0] = None
    return restored if return_dict else as_tuple(restored)


def empty_per_image(value):
    """An empty output as ``get_image_features`` returns it: one (empty) tensor per image."""
    if isinstance(value, list):
        return [(x,) for x in value]
    return (value,)


def restored_rows(rule: HFTowerRule, out) -> list:
    """The restored fields of a tower output, flat, each with its rows in dim 0."""
    values = [x for name in rule.outputs for x in listed(out[name])]
    return [x.squeeze(0) for x in values] if rule.batched_outputs else values


def tied_to_embeddings(module, kwargs: dict, empty: list) -> dict:
    """The parent's kwargs with its input embeddings (from ``input_ids`` unless given) plus the
    sums of this text-only rank's empty outputs, each exactly +0.0: the outputs' restore is then
    in the autograd graph, and its backward collective runs here too (``integrations.hf``, 2.)."""
    ids = kwargs.pop("input_ids", None)
    embeds = kwargs.get("inputs_embeds")
    embeds = module.get_input_embeddings()(ids) if embeds is None else embeds
    for x in empty:
        embeds = embeds + x.sum()
    return {**kwargs, "inputs_embeds": embeds}
