"""Row bands end to end on gloo CPU ranks: a step whose one large image binds it, computed with
bands against whole units, printed as Markdown tables.

1. 2 ranks: rank 0 holds one 48 x 48-patch image (2,304 patches) and small ones, rank 1 small
   ones; the reference tower (``QwenStyleViT``, e2e.py's widths at depth 8) forward + backward
   through ``dp_balance_vit_encoder``, whole units (``split_images=False``) against bands,
   beside the ideal (the whole tower's work over the ranks). Goal: bands >= 1.6x whole units.
2. 4 ranks as 2 replica sets of 2 (``replica_group``), set 0 holding the large image.
3. What each rank computes and keeps: pixel rows, and the keys and values it gathers per step
   (every full-attention layer, kept for the backward).

The plan is made with the l**2 cost model (it prices no exchange; the architecture model prices
it at H100 speeds, where this small tower's exchange would cost more than its compute) and
always applied (no trigger, no minimum gain). Each number is a median over ``--repeats`` runs
after a warm-up, runs interleaved and started at a barrier; the step ends when the slowest rank's
does. CPU time (the process, gloo's threads included) is a rank's own work, robust to other jobs
on a shared machine; wall time is what the step took here. fp32, one thread per rank.

    python benchmarks/bands_e2e.py [--repeats 7] [--depth 8]
"""

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fx_vitbal
from fx_vitbal.tools.models import QwenStyleViT, ViTConfig
from fx_vitbal.tools.omni import make_inputs

IN_DIM = 1176
LARGE = [1, 48, 48]
SMALL = [[1, 8, 8], [1, 12, 8], [1, 8, 6], [1, 6, 6]]
GRIDS_2 = [[LARGE, *SMALL[:2]], SMALL]
GRIDS_SETS = [[LARGE, *SMALL[:2]], SMALL]  # per replica set
WHOLE = fx_vitbal.BalanceConfig(
    cost_model="quadratic", trigger_threshold=0.0, min_gain=0.0, split_images=False
)
BANDS = fx_vitbal.BalanceConfig(
    cost_model="quadratic", trigger_threshold=0.0, min_gain=0.0, min_band_patches=256
)


class CountingViT(QwenStyleViT):
    """The reference tower, noting the pixel rows of its last call and the key and value rows
    its bands gathered (every layer attends over whole frames here)."""

    def forward(self, pixel_values, image_grid_thw, vitbal_bands=None):
        self.rows = pixel_values.shape[0]
        self.gathered = 0
        if vitbal_bands is not None:
            local = pixel_values.shape[0]
            self.gathered = (sum(vitbal_bands.key_rows) - local) * self.config.depth
        return super().forward(pixel_values, image_grid_thw, vitbal_bands)


def _tower(depth: int) -> CountingViT:
    torch.manual_seed(0)
    config = ViTConfig(
        in_dim=IN_DIM,
        hidden=256,
        num_heads=4,
        depth=depth,
        mlp_hidden=1024,
        out_dim=512,
        merged_output=True,
    )
    return CountingViT(config)


def _step(vit, pixels, grid, config, replicas) -> None:
    vit.zero_grad(set_to_none=True)
    embeds = fx_vitbal.dp_balance_vit_encoder(
        vit, pixels, grid, config=config, replica_group=replicas
    )[0]
    embeds.sum().backward()


def _rank(rank: int, world: int, repeats: int, depth: int, out: str) -> None:
    vit = _tower(depth)
    sets = [[0, 1], [2, 3]] if world == 4 else None
    replicas = sets[rank // 2] if sets else None
    grids = GRIDS_SETS[rank // 2] if sets else GRIDS_2[rank]
    _, pixels, grid = make_inputs(grids, in_dim=IN_DIM, seed=rank // 2 if sets else rank)
    # The whole tower's work, alone, for the ideal: each set's (or rank's) batch once.
    runs = {"whole": (WHOLE, replicas), "bands": (BANDS, replicas)}
    samples = {name: [] for name in ("whole", "bands", "alone")}
    for repeat in range(repeats + 1):
        for name, (config, reps) in runs.items():
            dist.barrier()
            wall, cpu = time.perf_counter(), time.process_time()
            _step(vit, pixels, grid, config, reps)
            if repeat:
                samples[name].append((time.perf_counter() - wall, time.process_time() - cpu))
        dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        if not sets or rank % 2 == 0:  # one replica computes its set's batch alone
            vit.zero_grad(set_to_none=True)
            vit(pixels, grid)[0].sum().backward()
        if repeat:
            samples["alone"].append((time.perf_counter() - wall, time.process_time() - cpu))
    medians = {
        name: tuple(statistics.median(s[k] for s in runs_) for k in (0, 1))
        for name, runs_ in samples.items()
    }
    result = {"medians": medians, "rows": {}, "kv": 0}
    stats = []
    handle = fx_vitbal.add_stats_callback(stats.append)
    for name, (config, reps) in runs.items():
        _step(vit, pixels, grid, config, reps)
        result["rows"][name] = vit.rows
    handle.remove()
    result["split"] = stats[-1].split_units
    # Keys and values side by side, fp32: 2 x hidden x 4 bytes a gathered row and layer.
    result["kv"] = vit.gathered * 2 * vit.config.hidden * 4
    torch.save(result, os.path.join(out, f"{rank}.pt"))


def _entry(rank, world, tmp, repeats, depth):
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(tmp, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        _rank(rank, world, repeats, depth, tmp)
    finally:
        dist.destroy_process_group()


def run(world: int, repeats: int, depth: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _entry, args=(world, tmp, repeats, depth), nprocs=world, start_method="spawn"
        )
        return [torch.load(os.path.join(tmp, f"{r}.pt")) for r in range(world)]


def report(title: str, results: list[dict], alone_ranks: list[int]) -> None:
    print(f"### {title}\n")
    print("| clock | whole units ms | bands ms | ideal ms | bands vs whole | of the ideal |")
    print("|---|---:|---:|---:|---:|---:|")
    for clock, k in (("CPU", 1), ("wall", 0)):
        whole = max(r["medians"]["whole"][k] for r in results)
        split = max(r["medians"]["bands"][k] for r in results)
        ideal = sum(results[r]["medians"]["alone"][k] for r in alone_ranks) / len(results)
        print(
            f"| {clock} | {1e3 * whole:.0f} | {1e3 * split:.0f} | {1e3 * ideal:.0f} | "
            f"{whole / split:.2f}x | {ideal / split:.0%} |"
        )
    print(f"\nunits computed as bands: {results[0]['split']}\n")
    print("| rank | pixel rows computed, whole units | with bands | keys and values gathered |")
    print("|---:|---:|---:|---:|")
    for rank, r in enumerate(results):
        rows = r["rows"]
        print(f"| {rank} | {rows['whole']} | {rows['bands']} | {r['kv'] / 2**20:.1f} MiB |")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--depth", type=int, default=8, help="the tower's blocks")
    parser.add_argument("--small", action="store_true", help="2 repeats, depth 2 (a smoke run)")
    args = parser.parse_args()
    repeats, depth = (2, 2) if args.small else (args.repeats, args.depth)
    report(f"1. 2 ranks, depth {depth}", run(2, repeats, depth), [0, 1])
    report(f"2. 4 ranks as 2 replica sets of 2, depth {depth}", run(4, repeats, depth), [0, 2])


if __name__ == "__main__":
    main()
