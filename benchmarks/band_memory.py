"""What a band rank keeps for its backward, against the whole frame on one rank: the Hugging Face
Qwen2-VL tower (sdpa, width 256, MLP 4x), one frame cut into k bands on k gloo ranks.

    python benchmarks/band_memory.py [--ks 2 4 8] [--side 64] [--checkpointing]

Saved bytes: every tensor autograd keeps during the tower's forward
(``torch.autograd.graph.saved_tensors_hooks``), counted once per storage, of the busiest band
rank, over those of the plain tower on the whole frame. Peak: the largest bytes held at once
by tensors made during the forward and backward, tracked by a ``TorchDispatchMode`` over the
step (CPU; what a GPU's allocator would hold, but for its caching), the busiest rank over
the whole frame's. Target (the bands-at-scale issue): both at most 1.25/k.

Both are printed twice: of every storage (the weights a layer saves for its backward and the
weights' gradients included: the same on every rank whatever k, 25 MB here), and of
activations only (those left out): what splitting a frame can shrink, and what the target
means; at k = 8 the fixed bytes are a third of a band rank's.
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


class _Peak(TorchDispatchMode):
    """Bytes held by live tensors made under this mode: now, and at most."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.now = self.peak = 0
        self.grads = 0  # of the weights' gradients, once accumulated
        self.counted_grads: set[int] = set()
        self.peak_activations = 0  # the most held at once, the weights' gradients left out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.live:
                    self.live[key] = storage.nbytes()
                    self.now += storage.nbytes()
                    self.peak = max(self.peak, self.now)
                    self.peak_activations = max(self.peak_activations, self.now - self.grads)
                    weakref.finalize(storage, self._freed, key)
        return out

    def accumulated(self, parameter: torch.Tensor) -> None:
        """A weight's gradient landed (a hook after accumulation): from now on not an
        activation."""
        key = parameter.grad.untyped_storage().data_ptr()
        if key in self.live and key not in self.counted_grads:
            self.counted_grads.add(key)
            self.grads += self.live[key]

    def _freed(self, key: int) -> None:
        nbytes = self.live.pop(key, 0)
        self.now -= nbytes
        if key in self.counted_grads:
            self.counted_grads.discard(key)
            self.grads -= nbytes


def _saved_and_peak(tower, run) -> tuple[int, int, int, int]:
    """``run()``'s forward saved bytes (distinct storages) and its forward+backward peak, then
    both without the tower's weights and their gradients."""
    storages: dict[int, int] = {}
    weights = {p.untyped_storage().data_ptr() for p in tower.parameters()}

    def pack(t):
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    peak = _Peak()
    hooks = [p.register_post_accumulate_grad_hook(peak.accumulated) for p in tower.parameters()]
    with peak:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = run()
        out.pooler_output.float().pow(2).mean().backward()
    for hook in hooks:
        hook.remove()
    activations = sum(n for key, n in storages.items() if key not in weights)
    return sum(storages.values()), peak.peak, activations, peak.peak_activations


def _tower(checkpointing: bool):
    from transformers.models.qwen2_vl import modeling_qwen2_vl as qwen2

    config = qwen2.Qwen2VLVisionConfig(**VISION)
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


def _rank(rank: int, world: int, store: str, side: int, checkpointing: bool, queue) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    torch.set_num_threads(1)
    tower = _tower(checkpointing)
    tower.train()
    config = fx_vitbal.BalanceConfig(cost_model="quadratic", min_band_patches=64)
    fx_vitbal.enable_vit_balance(tower, config=config)
    pixels, grid = _frame(side)
    stats = []
    handle = fx_vitbal.add_stats_callback(stats.append)
    if rank == 0:
        measured = _saved_and_peak(tower, lambda: tower(pixels, grid_thw=grid))
    else:  # the other ranks hold no image: each computes a band of rank 0's frame
        measured = _saved_and_peak(tower, lambda: tower(None, grid_thw=None))
    handle.remove()
    queue.put((rank, measured, stats[-1].split_units))
    dist.barrier()
    dist.destroy_process_group()


def measure(k: int, side: int, checkpointing: bool) -> tuple[list[float], int]:
    """The busiest of ``k`` band ranks over the whole frame (saved, peak, then both of
    activations only), and the bands."""
    tower = _tower(checkpointing)
    tower.train()
    pixels, grid = _frame(side)
    whole = _saved_and_peak(tower, lambda: tower(pixels, grid_thw=grid))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        args = (k, store, side, checkpointing, queue)
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
    args = parser.parse_args()
    print(
        f"## Band rank memory: HF Qwen2-VL tower {VISION}, one {args.side}x{args.side}-patch "
        "frame, torch " + torch.__version__
    )
    print(
        "| k | checkpointing | bands | saved x k | peak x k | activations: saved x k | "
        "peak x k | target (activations) |\n|---|---|---|---|---|---|---|---|"
    )
    for checkpointing in (False, True):
        for k in args.ks:
            ratios, bands = measure(k, args.side, checkpointing)
            ok = "met" if max(ratios[2:]) * k <= 1.25 else "missed"
            cells = " | ".join(f"{r * k:.2f}" for r in ratios)
            print(
                f"| {k} | {'on' if checkpointing else 'off'} | {bands} | {cells} | <= 1.25: {ok} |"
            )
            sys.stdout.flush()


if __name__ == "__main__":
    main()
