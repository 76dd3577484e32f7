"""Coverage of Hugging Face VLM families: every family of the installed transformers whose
modeling code uses ``grid_thw`` is balanced exactly on 2 gloo ranks, or refused when it is
wrapped. A family the walk finds without an entry in ``FAMILIES`` fails, so a new transformers
release is checked as soon as it is installed (``make test-hf`` runs this file on the newest).

Exact means: logits and all-reduced gradients equal the unbalanced run's, images really moved,
and videos went through where the family takes them. One pair of ranks runs every family in
turn (each family costs its modeling module's import and a few tiny steps).
"""

import importlib
import pathlib
import re

import pytest
import torch
import torch.distributed as dist
from dist_utils import record_collectives, record_moves, run_ranks

transformers = pytest.importorskip("transformers")

from hf_families import Exact, Refused, counts, installed, markdown_table  # noqa: E402

import fx_vitbal  # noqa: E402
from fx_vitbal.runtime.vit.settings import runs_bands  # noqa: E402

FAMILIES = installed(transformers.__version__)
"""The entries of the families the installed transformers has (the pinned one or a newer)."""

# (images, videos) per rank and step. Step 0: rank 0 heavy, rank 1 a thumbnail (units move to
# it); step 1: rank 1 text-only (it still takes part, and runs backward's collective).
STEPS = [
    [([(1, 16, 12), (1, 8, 8)], [(2, 8, 8)]), ([(1, 4, 4)], [])],
    [([(1, 12, 12), (1, 4, 8)], []), ([], [])],
]
# Families whose samples hold images or videos, not both (GLM: its placeholder mask counts video
# frames as image tokens): rank 1 holds the video instead of the thumbnail.
UNMIXED_STEPS = [[(STEPS[0][0][0], []), ([], STEPS[0][0][1])], STEPS[1]]


def grid_thw_families() -> set[str]:
    """Model types of the installed transformers whose modeling code uses ``grid_thw``."""
    models = pathlib.Path(transformers.__file__).parent / "models"
    return {
        path.parent.name
        for path in models.glob("*/modeling_*.py")
        if "grid_thw" in path.read_text(encoding="utf-8")
    }


def test_every_grid_thw_family_has_an_entry():
    found = grid_thw_families()
    assert sorted(found - set(FAMILIES)) == [], "families without an entry in hf_families.py"
    assert sorted(set(FAMILIES) - found) == [], "entries for families this transformers lacks"


def _zoo(model_type: str):
    return importlib.import_module(f"hf_zoo.{model_type}")


def _step(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    grads = [
        p.grad.flatten() if p.grad is not None else torch.zeros(p.numel())
        for p in model.parameters()
    ]
    flat = torch.cat(grads)
    dist.all_reduce(flat)
    return out.logits.detach(), flat


# A split step: rank 0's one image of 1,024 patches binds the step; planned by l**2 (which prices
# no exchange) with bands of 64 patches or more, it is split across both ranks.
SPLIT_STEP = [([(1, 32, 32)], []), ([(1, 4, 4)], [])]
SPLIT = fx_vitbal.BalanceConfig(cost_model="quadratic", min_band_patches=64)


def _family_balanced_vs_local(rank: int, model_type: str, videos: bool, bands: bool) -> dict:
    zoo = _zoo(model_type)
    model = zoo.build()
    steps = STEPS if getattr(zoo, "MIXED_OK", True) else UNMIXED_STEPS
    batches = [
        zoo.batch(model, images, grids if videos else [], seed=10 * step + rank)
        for step, (images, grids) in enumerate(s[rank] for s in steps)
    ]
    reference = [_step(model, batch) for batch in batches]
    fx_vitbal.enable_vit_balance(model)
    with record_moves() as moves:
        balanced = [_step(model, batch) for batch in batches]
    differences = [
        max(_difference(got, want) for got, want in zip(b, r, strict=True))
        for b, r in zip(balanced, reference, strict=True)
    ]
    tower = next(m for m in model.modules() if hasattr(m, "_vitbal_hf"))
    runs = runs_bands(tower._vitbal_hf.planner)
    result = {"differences": differences, "moves": moves, "runs_bands": runs}
    if bands:  # the same family, one frame split across the ranks
        model = zoo.build()
        batch = zoo.batch(model, *SPLIT_STEP[rank], seed=rank)
        want = _step(model, batch)
        fx_vitbal.enable_vit_balance(model, config=SPLIT)
        stats = []
        handle = fx_vitbal.add_stats_callback(stats.append)
        got = _step(model, batch)
        handle.remove()
        result["differences"].append(max(map(_difference, got, want)))
        result["split_units"] = stats[-1].split_units
    return result


def _difference(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference, relative to the reference's scale (float32 sums in another order)."""
    return (got - want).abs().max().item() / (1.0 + want.abs().max().item())


def _all_families(rank: int, world: int, families: list) -> dict:
    results = {}
    for model_type, videos, bands in families:
        try:
            results[model_type] = _family_balanced_vs_local(rank, model_type, videos, bands)
        except Exception as error:  # the next family still runs: one report names them all
            results[model_type] = {"error": f"{type(error).__name__}: {error}"}
    return results


def test_supported_families_are_exact_on_two_ranks():
    """Split-capable families (their tower runs row bands) also with one frame split across the
    ranks; a family whose rule says it runs bands and the table says not (or the reverse)
    fails."""
    families = [(name, e.videos, e.bands) for name, e in FAMILIES.items() if isinstance(e, Exact)]
    results = run_ranks(_all_families, 2, families, timeout=600.0)
    problems = []
    for model_type, _, bands in families:
        per_rank = [r[model_type] for r in results]
        for rank, res in enumerate(per_rank):
            if "error" in res:
                problems.append(f"{model_type} rank {rank}: {res['error']}")
            elif max(res["differences"]) > 1e-5:
                problems.append(f"{model_type} rank {rank}: differs by {res['differences']}")
            elif res["runs_bands"] != bands or res.get("split_units", 2) != 2:
                problems.append(f"{model_type} rank {rank}: bands {bands}, got {res}")
        moved = [sum(res.get("moves", [])) for res in per_rank]
        if not any(moved):
            problems.append(f"{model_type}: no unit moved (a passthrough also matches)")
    assert problems == []


def _checkpointed_split(rank: int, world: int, model_type: str, reentrant: bool) -> dict:
    zoo = _zoo(model_type)
    model = zoo.build()
    batch = zoo.batch(model, *SPLIT_STEP[rank], seed=rank)
    want = _step(model, batch)
    model = zoo.build()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    fx_vitbal.enable_vit_balance(model, config=SPLIT)
    stats = []
    handle = fx_vitbal.add_stats_callback(stats.append)
    with record_collectives() as issued:
        got = _step(model, batch)
    handle.remove()
    backward = [name for phase, name, _, _ in issued if phase == "backward"]
    return {
        "difference": max(map(_difference, got, want)),
        "split_units": stats[-1].split_units,
        "homing": backward.count("all_to_all"),
        "band_exchanges": backward.count("p2p"),
    }


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_split_frame_under_gradient_checkpointing_recomputes_its_exchange_in_lockstep(reentrant):
    """Hugging Face gradient checkpointing inside a tower running bands: the recompute runs each
    full-attention layer's key/value exchange again during backward, on every rank, and the
    gradients stay exact (Qwen2-VL's tiny tower: 2 full-attention layers)."""
    for res in run_ranks(_checkpointed_split, 2, "qwen2_vl", reentrant):
        assert res["difference"] < 1e-5 and res["split_units"] == 2, res
        # The outputs' gradients home once (a parent's pixels may be copies made for the call:
        # not fetched again, ``runtime.transport.refetch``); each full-attention layer's band
        # exchange runs point to point: its recompute gathers keys and values again, its
        # backward fetches them once more and sends their gradients to their owners.
        assert res["homing"] == 1 and res["band_exchanges"] == 2 * (1 + 2), res


@pytest.mark.parametrize(
    "model_type", [name for name, e in FAMILIES.items() if isinstance(e, Refused)]
)
def test_refused_families_raise_when_wrapped(model_type):
    model = _zoo(model_type).build()
    entry = FAMILIES[model_type]
    with pytest.raises(
        TypeError, match=f"{entry.cls} cannot be balanced: {re.escape(entry.reason)}"
    ):
        fx_vitbal.enable_vit_balance(model)


def test_the_docs_show_this_table_and_the_readme_its_count():
    root = pathlib.Path(__file__).resolve().parents[1]
    assert markdown_table() in (root / "docs" / "design.md").read_text(encoding="utf-8")
    assert counts() in (root / "README.md").read_text(encoding="utf-8")
