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

4. ``--three-frames`` (issue 43, item 6: uneven bands where they close a gap), instead of 1-3:
   rank 0 holds three large frames (40x40, 36x36 and 32x32 patches), rank 1 two small ones
   (16x16, 8x8), through Hugging Face's Qwen2-VL tower (depth 4, width 128, 4 heads) balanced
   in place (``enable_vit_balance``: ``dp_balance_vit_encoder`` wants the ViT contract's tuple,
   not a tower's ``ModelOutput``). No frame costs more than the mean load, so none binds the
   step; the best whole-frame plan (the 40x40 frame moves) leaves rank 0 above the mean (5% by
   this tower's architecture model), a gap only an uneven band of one of rank 0's frames can
   close, and the planner cuts one only where the cost model prices the exchange: the
   architecture model at H100 rates, or the online model from measured times (``l**2`` prices
   none). So each cost model runs with whole frames and with bands, beside the unbalanced step
   and the ideal (both ranks' unbalanced work over 2); times are the best of ``--repeats`` (3)
   steps with the median beside, a run's steps with and without bands apart, and every timed
   step's outputs and all-reduced parameter gradients are compared with the unbalanced run's.

    python benchmarks/bands_e2e.py [--repeats 7] [--depth 8]
    python benchmarks/bands_e2e.py --three-frames [--repeats 3] [--depth 4]
"""

import argparse
import dataclasses
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


def _entry(rank, world, tmp, repeats, depth, body):
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(tmp, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        body(rank, world, repeats, depth, tmp)
    finally:
        dist.destroy_process_group()


def run(world: int, repeats: int, depth: int, body=_rank) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _entry, args=(world, tmp, repeats, depth, body), nprocs=world, start_method="spawn"
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


# 4. Three large frames on rank 0, two small on rank 1, Hugging Face's Qwen2-VL tower.
THREE_GRIDS = [[[1, 40, 40], [1, 36, 36], [1, 32, 32]], [[1, 16, 16], [1, 8, 8]]]
COST_MODELS = ("auto", "quadratic", "online")  # auto: the architecture model (H100 prices)
ONLINE_WARMUP = 10  # calls before timing: the online fit stands alone after 16 rank-steps


def _three_runs() -> dict:
    """Each run's config (None: the tower unbalanced)."""
    runs = {"unbalanced": None}
    for model in COST_MODELS:
        base = fx_vitbal.BalanceConfig(
            cost_model=model, trigger_threshold=0.0, min_gain=0.0, min_band_patches=64
        )
        runs[f"whole frames, {model}"] = dataclasses.replace(base, split_images=False)
        runs[f"bands, {model}"] = base
    return runs


def _hf_tower(depth: int):
    from transformers.models.qwen2_vl import modeling_qwen2_vl as qwen2_vl

    vision = qwen2_vl.Qwen2VLVisionConfig(
        depth=depth, embed_dim=128, hidden_size=256, num_heads=4, mlp_ratio=4
    )
    vision._attn_implementation = "sdpa"
    return qwen2_vl.Qwen2VisionTransformerPretrainedModel._from_config(vision)


def _hf_step(tower, pixels, grid) -> torch.Tensor:
    tower.zero_grad(set_to_none=True)
    out = tower(pixels, grid_thw=grid).pooler_output
    # Position-dependent: a row restored to the wrong slot changes the loss and its gradients.
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach()


def _computed(kwargs: dict) -> list[str]:
    """The units a block computes here, in patches: a band as its rows of its frame's."""
    bands = kwargs.get("vitbal_bands")
    if bands is None:
        cu = kwargs["cu_seqlens"].tolist()
        return [str(b - a) for a, b in zip(cu, cu[1:], strict=False)]
    return [
        f"{u.rows * u.width} of {u.full_rows * u.width} (rows {u.first_row}-{u.first_row + u.rows})"
        if u.rows < u.full_rows
        else str(u.frames * u.rows * u.width)
        for u in bands.units
    ]


def _three_rank(rank: int, world: int, repeats: int, depth: int, out: str) -> None:
    torch.manual_seed(0)
    plain = _hf_tower(depth)
    towers, seen = {}, []
    for name, config in _three_runs().items():
        towers[name] = _hf_tower(depth)
        towers[name].load_state_dict(plain.state_dict())
        if config is not None:
            fx_vitbal.enable_vit_balance(towers[name], config=config)
        towers[name].blocks[0].register_forward_pre_hook(
            lambda module, args, kwargs: seen.append(_computed(kwargs)), with_kwargs=True
        )
    grid = torch.tensor(THREE_GRIDS[rank])
    pixels = torch.randn(
        int(grid.prod(1).sum()), 1176, generator=torch.Generator().manual_seed(rank)
    )
    stats = []  # every balanced call's (a callback keeps a clock: the online model's does)
    handle = fx_vitbal.add_stats_callback(stats.append)
    for name, tower in towers.items():  # warm-up; the online model's fit
        for _ in range(ONLINE_WARMUP if "online" in name else 1):
            dist.barrier()
            _hf_step(tower, pixels, grid)
    samples = {name: [] for name in towers}
    # Per run: timed steps with bands, the largest differences from the unbalanced run (its
    # embeddings and all-reduced parameter gradients), and the plan shown (the last with bands).
    result = {"samples": samples, "split": {name: [] for name in towers}, "diff": {}, "shown": {}}
    for _ in range(repeats):  # runs interleaved, each started at a barrier
        for name, tower in towers.items():
            dist.barrier()
            wall, cpu = time.perf_counter(), time.process_time()
            embeds = _hf_step(tower, pixels, grid)
            samples[name].append((time.perf_counter() - wall, time.process_time() - cpu))
            grads = torch.cat([p.grad.flatten() for p in tower.parameters()])
            dist.all_reduce(grads)
            if name == "unbalanced":  # first in each round
                want = embeds, grads
                result["split"][name].append(False)
                continue
            diff = [float((a - b).abs().max()) for a, b in zip((embeds, grads), want, strict=True)]
            old = result["diff"].get(name, [0.0, 0.0])
            result["diff"][name] = [*map(max, old, diff), float(grads.abs().max())]
            bands = stats[-1].split_units > 0
            result["split"][name].append(bands)
            if bands or not any(result["split"][name]):
                result["shown"][name] = dataclasses.asdict(stats[-1]), seen[-1]
    handle.remove()
    torch.save(result, os.path.join(out, f"{rank}.pt"))


def report_three(depth: int, repeats: int, results: list[dict]) -> None:
    def makespans(name: str, k: int, steps) -> list[float]:  # the slowest rank's, per step
        return [max(r["samples"][name][i][k] for r in results) for i in steps]

    every = range(repeats)
    ideal = {  # per repeat: both ranks' unbalanced work over the ranks
        k: [sum(r["samples"]["unbalanced"][i][k] for r in results) / 2 for i in every]
        for k in (0, 1)
    }
    print(
        f"### 4. Three large frames on rank 0, two small on rank 1, Qwen2-VL tower, depth {depth}\n"
    )
    print(
        f"Best of {repeats} steps (median), ms; speed-up over unbalanced and fraction of the "
        "ideal's. A run whose timed steps were planned both with and without bands is shown "
        "twice, its steps apart.\n"
    )
    print("| run | steps | CPU | speed-up | of the ideal | wall | speed-up | of the ideal |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    rows = [("unbalanced", "", every), ("ideal", "", every)]
    for name, split in list(results[0]["split"].items())[1:]:
        with_bands = [i for i in every if split[i]]
        without = [i for i in every if not split[i]]
        rows += [(name, "with bands", with_bands)] if with_bands else []
        rows += [(name, "no band" if with_bands else "", without)] if without else []
    for name, label, steps in rows:
        cells = []
        for k in (1, 0):
            times = [ideal[k][i] for i in steps] if name == "ideal" else makespans(name, k, steps)
            best, base = min(times), min(makespans("unbalanced", k, every))
            cells += [
                f"{1e3 * best:.0f} ({1e3 * statistics.median(times):.0f})",
                f"{base / best:.2f}x",
                f"{min(ideal[k]) / best:.0%}",
            ]
        print(f"| {name} | {f'{len(steps)} {label}'.strip()} | " + " | ".join(cells) + " |")
    print(
        "\n| run | plan (reason) | planned imbalance | bands (exchange) | rank 0 computes, "
        "patches | rank 1 computes | max abs diff embeds | grads (max abs grad) | timed steps "
        "with bands |"
    )
    print("|---|---|---:|---|---|---|---:|---:|---:|")
    for name, (s, _) in results[0]["shown"].items():
        exchanges = ", ".join(s["band_exchanges"]) or "-"
        units = [" + ".join(r["shown"][name][1]) for r in results]
        embeds = max(r["diff"][name][0] for r in results)  # each rank's own outputs
        _, grads, scale = results[0]["diff"][name]
        print(
            f"| {name} | {'applied' if s['applied'] else 'kept home'} ({s['reason']}) | "
            f"{s['imbalance_before']:.3f} -> {s['imbalance_after']:.3f} | "
            f"{s['split_units']} ({exchanges}) | "
            f"{units[0]} | {units[1]} | {embeds:.1e} | {grads:.1e} ({scale:.1e}) | "
            f"{sum(results[0]['split'][name])} of {repeats} |"
        )
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, help="7; 3 with --three-frames")
    parser.add_argument("--depth", type=int, help="the tower's blocks: 8; 4 with --three-frames")
    parser.add_argument("--small", action="store_true", help="2 repeats, depth 2 (a smoke run)")
    parser.add_argument("--three-frames", action="store_true", help="section 4 only")
    args = parser.parse_args()
    repeats = args.repeats or (3 if args.three_frames else 7)
    depth = args.depth or (4 if args.three_frames else 8)
    repeats, depth = (2, 2) if args.small else (repeats, depth)
    if args.three_frames:
        report_three(depth, repeats, run(2, repeats, depth, _three_rank))
        return
    report(f"1. 2 ranks, depth {depth}", run(2, repeats, depth), [0, 1])
    report(f"2. 4 ranks as 2 replica sets of 2, depth {depth}", run(4, repeats, depth), [0, 2])


if __name__ == "__main__":
    main()
