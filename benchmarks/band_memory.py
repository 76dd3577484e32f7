"""What a band rank keeps for its backward, against the whole frame on one rank: the Hugging Face
Qwen2-VL tower (sdpa, width 256, MLP 4x), one frame cut into k bands on k gloo ranks.

    python benchmarks/band_memory.py [--ks 2 4 8] [--side 64] [--kinds gather ring ulysses]
        [--depth 8] [--width 256]

Saved bytes: what the tensors autograd keeps during the tower's forward
(``torch.autograd.graph.saved_tensors_hooks``) hold once the forward is done, while the rest of
a model's forward runs, counted once per storage, of the busiest band rank, over those of the
plain tower on the whole frame (a split step's exchanged pixels are released by then and
fetched again in the backward: ``runtime.transport.refetch``). Peak: the largest bytes held at
once by storages the step allocates during the forward and backward, tracked by a
``TorchDispatchMode`` that reads every live storage's size after each op (CPU; what a GPU's
allocator would hold, but for its caching; a view or an in-place result is counted where its
storage was made, so a weight's transpose or the input pixels reshaped count nothing; a
storage released and filled again in place counts its bytes while it holds them), the busiest
rank over the whole frame's. Target (the bands-at-scale issue): both at most 1.25/k.

Both are printed twice: of every storage (the weights a layer saves for its backward, the
input pixels and the weights' gradients included: the same on every rank whatever k, 25 MB
here, but for the pixels), and of activations only (saved: without the weights and the input
pixels, held before the step; peak: without the weights' gradients): what splitting a frame
can shrink, and what the target means. A band rank's exchanged pixels are made by the step:
counted while held. Each exchange kind forced (``--kinds``).
"""

import argparse
import os
import sys
import tempfile
import weakref

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import fx_vitbal

VISION = dict(depth=8, embed_dim=256, hidden_size=256, num_heads=8, mlp_ratio=4)


def _vision(depth: int, width: int) -> dict:
    return {**VISION, "depth": depth, "embed_dim": width, "hidden_size": width}


class _Peak(TorchDispatchMode):
    """Bytes held by the live storages made under this mode: now, and at most.

    Each storage counts its bytes now (``nbytes``, read at every op), so one released and
    filled again in place (``untyped_storage().resize_``, a split step's exchanged pixels)
    counts nothing in between, and its refill is not a new storage."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, weakref.ref] = {}  # by storage (``_cdata``: kept across resizes)
        self.grads: set[int] = set()  # the weights' gradients, once accumulated
        self.peak = 0
        self.peak_activations = 0  # the most held at once, the weights' gradients left out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # An output on an argument's storage (a view, an in-place op) allocated nothing: it is
        # counted where that storage was made, or was held before the step (a weight's
        # transpose, the input pixels reshaped).
        given = {
            t.untyped_storage()._cdata
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor) and t.device.type != "meta"
        }
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key = storage._cdata
                if storage.nbytes() and key not in self.live and key not in given:
                    self.live[key] = weakref.ref(storage)
                    weakref.finalize(storage, self._freed, key)
        held = {key: ref() for key, ref in self.live.items()}
        now = sum(s.nbytes() for s in held.values() if s is not None)
        grads = sum(held[key].nbytes() for key in self.grads if held.get(key) is not None)
        self.peak = max(self.peak, now)
        self.peak_activations = max(self.peak_activations, now - grads)
        return out

    def accumulated(self, parameter: torch.Tensor) -> None:
        """A weight's gradient landed (a hook after accumulation): from now on not an
        activation."""
        key = parameter.grad.untyped_storage()._cdata
        if key in self.live:
            self.grads.add(key)

    def _freed(self, key: int) -> None:
        self.live.pop(key, None)
        self.grads.discard(key)


def _saved_and_peak(tower, run, pixels=None) -> tuple[int, int, int, int]:
    """``run()``'s forward saved bytes (distinct storages) and its forward+backward peak, then
    both of activations only (module doc: saved without the weights and ``pixels``, peak
    without the weights' gradients)."""
    storages: dict[int, torch.UntypedStorage] = {}
    held = [*tower.parameters(), *([] if pixels is None else [pixels])]
    before = {t.untyped_storage().data_ptr() for t in held}  # held before the step

    def pack(t):
        storage = t.untyped_storage()
        storages.setdefault(storage.data_ptr(), storage)
        return t

    peak = _Peak()
    hooks = [p.register_post_accumulate_grad_hook(peak.accumulated) for p in tower.parameters()]
    with peak:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = run()
        # What the saved tensors hold once the forward is done, while the rest of a model's
        # forward runs (a split step's exchanged pixels are released by then).
        saved = {key: storage.nbytes() for key, storage in storages.items()}
        out.pooler_output.float().pow(2).mean().backward()
    for hook in hooks:
        hook.remove()
    activations = sum(n for key, n in saved.items() if key not in before)
    return sum(saved.values()), peak.peak, activations, peak.peak_activations


def _tower(checkpointing: bool, vision: dict):
    from transformers.models.qwen2_vl import modeling_qwen2_vl as qwen2

    config = qwen2.Qwen2VLVisionConfig(**vision)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    tower = qwen2.Qwen2VisionTransformerPretrainedModel._from_config(config)
    if checkpointing:
        tower.activation_checkpointing_enable({"use_reentrant": False})
    return tower


def _frame(side: int) -> tuple[torch.Tensor, torch.Tensor]:
    grid = torch.tensor([[1, side, side]])
    gen = torch.Generator().manual_seed(0)
    return torch.randn(side * side, 3 * 2 * 14 * 14, generator=gen), grid


def _rank(
    rank: int,
    world: int,
    store: str,
    side: int,
    checkpointing: bool,
    kind: str,
    vision: dict,
    queue,
) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    torch.set_num_threads(1)
    tower = _tower(checkpointing, vision)
    tower.train()
    config = fx_vitbal.BalanceConfig(
        cost_model="quadratic", min_band_patches=64, band_exchange=kind
    )
    fx_vitbal.enable_vit_balance(tower, config=config)
    pixels, grid = _frame(side)
    stats = []
    handle = fx_vitbal.add_stats_callback(stats.append)
    if rank == 0:
        measured = _saved_and_peak(tower, lambda: tower(pixels, grid_thw=grid), pixels)
    else:  # the other ranks hold no image: each computes a band of rank 0's frame
        measured = _saved_and_peak(tower, lambda: tower(None, grid_thw=None))
    handle.remove()
    queue.put((rank, measured, stats[-1].split_units))
    dist.barrier()
    dist.destroy_process_group()


def measure(
    k: int, side: int, checkpointing: bool, kind: str, vision: dict
) -> tuple[list[float], int]:
    """The busiest of ``k`` band ranks over the whole frame (saved, peak, then both of
    activations only), and the bands."""
    tower = _tower(checkpointing, vision)
    tower.train()
    pixels, grid = _frame(side)
    whole = _saved_and_peak(tower, lambda: tower(pixels, grid_thw=grid), pixels)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        args = (k, store, side, checkpointing, kind, vision, queue)
        procs = [ctx.Process(target=_rank, args=(r, *args)) for r in range(k)]
        for p in procs:
            p.start()
        results = [queue.get(timeout=600) for _ in range(k)]
        for p in procs:
            p.join(timeout=60)
    busiest = [max(r[1][i] for r in results) for i in range(4)]
    return [b / w for b, w in zip(busiest, whole, strict=True)], results[0][2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--side", type=int, default=64, help="the frame's patches per side")
    parser.add_argument(
        "--kinds", nargs="+", default=["gather", "ring", "ulysses"], help="exchanges forced"
    )
    parser.add_argument("--depth", type=int, default=VISION["depth"])
    parser.add_argument("--width", type=int, default=VISION["hidden_size"])
    args = parser.parse_args()
    vision = _vision(args.depth, args.width)
    print(
        f"## Band rank memory: HF Qwen2-VL tower {vision}, one {args.side}x{args.side}-patch "
        "frame, torch " + torch.__version__
    )
    print(
        "| k | checkpointing | exchange | bands | saved x k | peak x k | activations: saved x k "
        "| peak x k | target (activations) |\n|---|---|---|---|---|---|---|---|---|"
    )
    for checkpointing in (False, True):
        for k in args.ks:
            for kind in args.kinds:
                ratios, bands = measure(k, args.side, checkpointing, kind, vision)
                ok = "met" if max(ratios[2:]) * k <= 1.25 else "missed"
                cells = " | ".join(f"{r * k:.2f}" for r in ratios)
                on = "on" if checkpointing else "off"
                print(f"| {k} | {on} | {kind} | {bands} | {cells} | <= 1.25: {ok} |")
                sys.stdout.flush()


if __name__ == "__main__":
    main()
