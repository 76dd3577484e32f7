"""What a band rank keeps for its backward, against the whole frame on one rank: the Hugging Face
Qwen2-VL tower (sdpa, width 256, MLP 4x), one frame cut into k bands on k gloo ranks.

    python benchmarks/band_memory.py [--ks 2 4 8] [--side 64] [--checkpointing]

Saved bytes: every tensor autograd keeps during the tower's forward
(``torch.autograd.graph.saved_tensors_hooks``), counted once per storage, of the busiest band
rank, over those of the plain tower on the whole frame. Peak: the largest bytes held at once
by tensors made during the forward and backward, tracked by a ``TorchDispatchMode`` over the
step (CPU; what a GPU's allocator would hold, but for its caching), the busiest rank over
the whole frame's. Target (the bands-at-scale issue): both at most 1.25/k.
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
                    weakref.finalize(storage, self._freed, key)
        return out

    def _freed(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)


def _saved_and_peak(run) -> tuple[int, int]:
    """``run()``'s forward saved bytes (distinct storages) and its forward+backward peak."""
    storages: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    peak = _Peak()
    with peak:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = run()
        out.pooler_output.float().pow(2).mean().backward()
    return sum(storages.values()), peak.peak


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
        saved, peak = _saved_and_peak(lambda: tower(pixels, grid_thw=grid))
    else:  # the other ranks hold no image: each computes a band of rank 0's frame
        saved, peak = _saved_and_peak(lambda: tower(None, grid_thw=None))
    handle.remove()
    queue.put((rank, saved, peak, stats[-1].split_units))
    dist.barrier()
    dist.destroy_process_group()


def measure(k: int, side: int, checkpointing: bool) -> tuple[float, float, int]:
    """``(saved ratio, peak ratio, bands)`` of the busiest of ``k`` band ranks."""
    tower = _tower(checkpointing)
    tower.train()
    pixels, grid = _frame(side)
    whole_saved, whole_peak = _saved_and_peak(lambda: tower(pixels, grid_thw=grid))
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
    saved = max(r[1] for r in results)
    peak = max(r[2] for r in results)
    return saved / whole_saved, peak / whole_peak, results[0][3]


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
        "| k | checkpointing | bands | saved x k | peak x k | target |\n|---|---|---|---|---|---|"
    )
    for checkpointing in (False, True):
        for k in args.ks:
            saved, peak, bands = measure(k, args.side, checkpointing)
            ok = "met" if max(saved, peak) * k <= 1.25 else "missed"
            print(
                f"| {k} | {'on' if checkpointing else 'off'} | {bands} | {saved * k:.2f} | "
                f"{peak * k:.2f} | <= 1.25: {ok} |"
            )
            sys.stdout.flush()


if __name__ == "__main__":
    main()
