"""Every autograd entry point, through every path, gives the unbalanced run's results.

Paths: ``dp_balance_vit_encoder`` on the bare ViT (eager), ``enable_vit_balance`` (in place), the
FX pass, the in-place model under ``torch.compile``, and a Hugging Face VLM. Entry points:
``.backward()``, ``torch.autograd.grad`` over every parameter and over half of them,
``.backward(inputs=)`` the other half, ``retain_graph=True`` then a second backward, a
non-reentrant ``torch.utils.checkpoint`` around the model, and ``no_grad`` / ``inference_mode``
forwards. Each runs once without the step clock (nothing reads measured times, so no hook is
installed) and once with it (a stats callback listens). 3 gloo ranks, the last without images;
float64, so balanced and unbalanced agree to rounding; the plan moves units (checked).
"""

import pytest
import torch
import torch.distributed as dist
from dist_utils import assert_units_moved, record_moves, run_ranks
from torch.utils.checkpoint import checkpoint

import fx_vitbal
from fx_vitbal.passes import apply_vit_balance_pass, symbolic_trace
from fx_vitbal.tools.models import ViTConfig
from fx_vitbal.tools.omni import LMConfig, OmniEncoderModel, make_inputs

GRIDS = [[[1, 16, 12], [2, 4, 6]], [[1, 2, 2]], []]  # skewed; rank 2 has nothing
ENTRIES = [
    "backward",
    "grad",
    "grad_some_inputs",
    "backward_some_inputs",
    "retain_graph_twice",
    "checkpoint",
    "no_grad",
    "inference_mode",
]


def _model() -> OmniEncoderModel:
    torch.manual_seed(0)  # the same weights on every rank, like a data-parallel replica
    model = OmniEncoderModel(ViTConfig(deepstack_indexes=(0,)), LMConfig(num_layers=1))
    return model.double()


def _weighted(out: torch.Tensor) -> torch.Tensor:
    """A position-dependent loss: rows restored to the wrong slot change it."""
    return (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum()


def _entry(entry: str, forward, params: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``forward()`` then ``entry``'s backward; ``(output, all-reduced gradient per parameter
    of ``params`` (name -> parameter), zeros where none)``."""
    grads: dict[str, torch.Tensor] = {}
    if entry in ("no_grad", "inference_mode"):
        with torch.no_grad() if entry == "no_grad" else torch.inference_mode():
            out = forward()
        return out.clone(), []
    out = checkpoint(forward, use_reentrant=False) if entry == "checkpoint" else forward()
    loss = _weighted(out)
    names = list(params)
    if entry in ("backward", "checkpoint"):
        loss.backward()
    elif entry == "retain_graph_twice":
        loss.backward(retain_graph=True)
        loss.backward()
    elif entry.startswith("grad"):
        chosen = names if entry == "grad" else names[1::2]
        found = torch.autograd.grad(loss, [params[n] for n in chosen], allow_unused=True)
        grads = {n: g for n, g in zip(chosen, found, strict=True) if g is not None}
    else:  # backward_some_inputs
        loss.backward(inputs=[params[n] for n in names[::2]])
    for name, p in params.items():
        if p.grad is not None:
            grads[name] = p.grad
        p.grad = None
    flat = torch.cat([grads[n].flatten() if n in grads else params[n].new_zeros(params[n].numel())
                      for n in names])  # fmt: skip
    dist.all_reduce(flat)
    return out.detach(), [flat]


def _vit_forward(vit, balanced: bool, pixels, grid):
    def forward():
        call = fx_vitbal.dp_balance_vit_encoder if balanced else (lambda v, p, g: v(p, g))
        embeds, _, deepstack = call(vit, pixels, grid)
        return torch.cat([embeds.unflatten(0, (-1, 4)).flatten(1), deepstack[0]], 1)

    return forward


def _paths(rank: int, world: int, path: str) -> dict:
    input_ids, pixels, grid = make_inputs(GRIDS[rank], in_dim=24, seed=rank, dtype=torch.float64)
    reference = _model()
    if path == "eager":
        model = _model().visual
        want_forward = _vit_forward(reference.visual, False, pixels, grid)
        got_forward = _vit_forward(model, True, pixels, grid)
        want_params = {f"visual.{n}": p for n, p in reference.visual.named_parameters()}
        got_params = {f"visual.{n}": p for n, p in model.named_parameters()}
    else:
        if path == "fx":
            model = apply_vit_balance_pass(symbolic_trace(_model()))
        else:
            model = fx_vitbal.enable_vit_balance(_model())
        run = torch.compile(model, backend="aot_eager") if path == "compiled" else model
        want_forward = lambda: reference(input_ids, pixels, grid)  # noqa: E731
        got_forward = lambda: run(input_ids, pixels, grid)  # noqa: E731
        want_params = dict(reference.named_parameters())
        got_params = dict(model.named_parameters())
    return _entries(want_forward, want_params, got_forward, got_params)


def _entries(want_forward, want_params, got_forward, got_params) -> dict:
    """Every entry point, without and with the step clock: got against want, and the moves."""
    seen = []
    results = {}
    for clock in (False, True):
        handle = fx_vitbal.add_stats_callback(seen.append) if clock else None
        try:
            for entry in ENTRIES:
                want = _entry(entry, want_forward, want_params)
                with record_moves() as moves:
                    got = _entry(entry, got_forward, got_params)
                results[clock, entry] = {"got": got, "want": want, "moves": moves}
        finally:
            if handle is not None:
                handle.remove()
    results["stats"] = len(seen)
    return results


def _check(results: list[dict]) -> None:
    for clock in (False, True):
        for entry in ENTRIES:
            for rank, res in enumerate(results):
                (got, got_grads), (want, want_grads) = (
                    res[clock, entry]["got"],
                    res[clock, entry]["want"],
                )
                context = f"clock={clock} {entry} rank {rank}"
                torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9, msg=context)
                for g, w in zip(got_grads, want_grads, strict=True):
                    torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9, msg=context)
            assert_units_moved([res[clock, entry] for res in results])
    # The clock's run reported its calls (one per balanced call, ranks alike); the other none.
    calls = [res["stats"] for res in results]
    assert len(set(calls)) == 1 and calls[0] >= len(ENTRIES), calls


def _hf(rank: int, world: int) -> dict:
    from test_hf import _pixel_width, build_parent, make_batch

    reference, model = build_parent("qwen2_vl").double(), build_parent("qwen2_vl").double()
    fx_vitbal.enable_vit_balance(model)
    # Step 1 of test_hf's batches: rank 0 has images and a video, rank 1 text only.
    batch = make_batch("qwen2_vl", rank, 1, _pixel_width(model.get_encoder(modality="image")))
    batch = {
        k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v
        for k, v in batch.items()
    }

    def forward(vlm):
        return lambda: vlm(**{k: v for k, v in batch.items() if k != "labels"}).logits

    params = dict(model.named_parameters())
    return _entries(forward(reference), dict(reference.named_parameters()), forward(model), params)


def test_every_autograd_entry_point_matches_the_unbalanced_run_in_a_hugging_face_vlm():
    pytest.importorskip("transformers")
    _check(run_ranks(_hf, 2))


def _paths_compiled(rank: int, world: int) -> dict:
    # A second backward through any compiled graph (balanced or not) needs torch's donated
    # buffers off, or AOTAutograd refuses retain_graph=True.
    with torch._functorch.config.patch(donated_buffer=False):
        return _paths(rank, world, "compiled")


@pytest.mark.parametrize("path", ["eager", "in_place", "fx"])
def test_every_autograd_entry_point_matches_the_unbalanced_run(path):
    _check(run_ranks(_paths, 3, path))


def test_every_autograd_entry_point_matches_the_unbalanced_run_compiled():
    _check(run_ranks(_paths_compiled, 3))
