"""The GPU check's timing sections (``benchmarks/gpu_check.py`` runs each in a child process):
balancing's own cost inside a real balanced step, and cost-model fidelity.

Both use a Qwen2-VL-7B-width tower (``QwenStyleViT``: hidden 1280, MLP 5120, 32 layers, 16
heads, 1176 inputs per patch, merger to 3584), bf16 on CUDA as trained; ``--small`` uses a tiny
tower in fp32 on the CPU, whose numbers say only that the code runs.
"""

import contextlib
import copy
import functools
import random
import statistics
import time

import torch
from gpu_harness import Context, plain_vit, run_ranks

import fx_vitbal
from fx_vitbal.config import BalanceConfig
from fx_vitbal.cost import PolynomialCost, QuadraticCost
from fx_vitbal.plan.step import plan_step
from fx_vitbal.runtime.vit.registry import vision_encoder_spec
from fx_vitbal.runtime.vit.settings import plan_settings, planner_for
from fx_vitbal.tools.models import QwenStyleViT, ViTConfig
from fx_vitbal.tools.workloads import sample_grid

# Qwen2-VL-7B's vision tower; merged_output puts its patch merger (to the LM's 3584) inside.
FULL_TOWER = ViTConfig(
    in_dim=1176, hidden=1280, num_heads=16, depth=32, mlp_hidden=5120, out_dim=3584,
    merged_output=True,
)  # fmt: skip
SMALL_TOWER = ViTConfig(
    in_dim=1176, hidden=64, num_heads=4, depth=2, mlp_hidden=256, out_dim=64, merged_output=True
)


def tower(ctx: Context) -> tuple[QwenStyleViT, ViTConfig, torch.dtype]:
    config = SMALL_TOWER if ctx.small else FULL_TOWER
    dtype = torch.bfloat16 if ctx.device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with ctx.device:  # initialised where it runs (a 32-layer tower takes seconds on a CPU)
        vit = QwenStyleViT(config).to(dtype)
    return vit, config, dtype


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int, warmup: int = 1) -> float:
    """Median seconds of ``fn()`` after ``warmup`` calls (CUDA events on CUDA)."""
    samples = []
    for i in range(warmup + repeats):
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            end.synchronize()
            seconds = begin.elapsed_time(end) / 1e3
        else:
            start = time.perf_counter()
            fn()
            seconds = time.perf_counter() - start
        if i >= warmup:
            samples.append(seconds)
    return statistics.median(samples)


def forward_backward(vit, pixels, grid, call=plain_vit) -> None:
    embeds, _, deepstack = call(vit, pixels, grid)
    embeds.float().sum().backward()
    vit.zero_grad(set_to_none=True)


# ---- section 3: balancing's own cost in a real balanced step -------------------------------

IMAGES_PER_RANK = [6, 2, 1]  # skewed, so the plan moves units
PROFILED_STEPS = 2


def profile_section(ctx: Context) -> None:
    """torch.profiler over rank 0's balanced steps on three threaded ranks: the ``vitbal::*``
    ops' own CPU and device time, against the tower's forward + backward."""
    vit, config, dtype = tower(ctx)
    rng = random.Random(0)
    low, high = (2, 4) if ctx.small else (16, 32)  # 1k-4k patches an image (16-64 --small)
    grids_R = [
        [[1, 2 * rng.randint(low, high), 2 * rng.randint(low, high)] for _ in range(n)]
        for n in IMAGES_PER_RANK
    ]
    vits = [vit] + [copy.deepcopy(vit) for _ in grids_R[1:]]
    inputs = []
    for grids in grids_R:
        rows = sum(t * h * w for t, h, w in grids)
        pixels = torch.randn(rows, config.in_dim, device=ctx.device, dtype=dtype)
        inputs.append((pixels, torch.tensor(grids, device=ctx.device)))

    def rank_fn(rank: int, activities) -> dict:
        pixels, grid = inputs[rank]
        balanced = fx_vitbal.dp_balance_vit_encoder
        for call in (balanced, plain_vit):  # warm-up: layouts agreed, kernels chosen
            forward_backward(vits[rank], pixels, grid, call)
        sync(ctx.device)
        out = {}
        for name, call in (("balanced", balanced), ("unbalanced", plain_vit)):
            # Only rank 0's thread is profiled (the profiler's op callbacks are per thread); the
            # device's kernels of every rank are recorded, but only rank 0's are its ops'.
            profiler = torch.profiler.profile(activities=activities) if rank == 0 else None
            with profiler or contextlib.nullcontext():
                start = time.perf_counter()
                for _ in range(PROFILED_STEPS):
                    forward_backward(vits[rank], pixels, grid, call)
                sync(ctx.device)
                wall = (time.perf_counter() - start) / PROFILED_STEPS
            out[name] = (vitbal_times(profiler) if profiler else None, wall)
        return out

    activities = [torch.profiler.ProfilerActivity.CPU]
    if ctx.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities):  # Kineto starts in torch's own thread
        pass
    results = run_ranks(len(grids_R), functools.partial(rank_fn, activities=activities))
    (ops_ms, calls), balanced_wall = results[0]["balanced"]
    (_, unbalanced_calls), unbalanced_wall = results[0]["unbalanced"]
    everything = torch.cat([p for p, _ in inputs]), torch.cat([g for _, g in inputs])
    world = len(grids_R)
    repeats = 2 if ctx.small else 3
    tower_s = timed(lambda: forward_backward(vit, *everything), ctx.device, repeats) / world
    rank0_s = timed(lambda: forward_backward(vit, *inputs[0]), ctx.device, repeats)
    spec, _ = planner_for(vit, BalanceConfig())
    grids64 = grids_R + [[sample_grid(rng) for _ in range(8)] for _ in range(64 - world)]
    settings = plan_settings(spec)
    solve_s = timed(lambda: plan_step(grids64, settings), torch.device("cpu"), repeats)
    device_note = "" if ctx.device.type == "cuda" else " (no device on the CPU)"
    name = str(dtype).removeprefix("torch.")
    print(f"## Balancing's own cost in a balanced step: QwenStyleViT hidden {config.hidden}, depth "
          f"{config.depth}, {name}; 3 threaded ranks with {IMAGES_PER_RANK} images "
          f"({[sum(t * h * w for t, h, w in g) for g in grids_R]} patches)\n")  # fmt: skip
    tower_ms = tower_s * 1e3
    print("| what (rank 0, per step) | ms | share of the mean rank's tower forward + backward |")
    print("|---|---|---|")
    print(
        f"| tower forward + backward, the mean rank's share of all images | {tower_ms:.2f} | 100% |"
    )
    print(f"| tower forward + backward, rank 0's own images | {rank0_s * 1e3:.2f} | "
          f"{rank0_s / tower_s:.0%} |")  # fmt: skip
    for kind in ("cpu", "device"):
        ms = ops_ms[kind]
        print(f"| `vitbal::*` ops, {kind} time{device_note if kind == 'device' else ''} | "
              f"{ms:.2f} | {ms / tower_ms:.2%} |")  # fmt: skip
    print(f"| solve alone, 64-rank metadata ({sum(map(len, grids64))} images; in the plan op) | "
          f"{solve_s * 1e3:.2f} | {solve_s / tower_s:.2%} |")  # fmt: skip
    print(f"| rank 0's step, wall: balanced / unbalanced | {balanced_wall * 1e3:.1f} / "
          f"{unbalanced_wall * 1e3:.1f} | |\n")  # fmt: skip
    print(f"`vitbal::*` calls profiled on rank 0 ({PROFILED_STEPS} steps): {dict(calls)}; "
          f"unbalanced steps: {dict(unbalanced_calls) or 'none'}.\n")  # fmt: skip
    print("Read with care: the ranks are threads sharing one device and the GIL. The threaded "
          "group's collectives are Python copies that rank 0's thread makes for every rank, "
          "after waiting for the others to arrive, so the ops' CPU time includes those waits and "
          "the device time includes the other ranks' copies; NCCL on real ranks moves the same "
          "bytes without either. The step walls share the device with the other ranks' work. The "
          "ops' numbers are an upper bound on balancing's own cost.\n")  # fmt: skip
    ok = calls["vitbal::plan"] == PROFILED_STEPS and not unbalanced_calls
    ctx.record("profile/balanced_step", "PASS" if ok else "FAIL",
               f"vitbal ops {ops_ms['cpu']:.1f} ms CPU, {ops_ms['device']:.1f} ms device a step "
               f"vs tower {tower_ms:.1f} ms (measured; no threshold)")  # fmt: skip


def vitbal_times(prof) -> tuple[dict[str, float], dict[str, int]]:
    """Per profiled step: the ``vitbal::*`` ops' CPU and device milliseconds, outermost calls
    only (an op's autograd wrapper and its kernel are nested events of one call), and calls."""
    total = {"cpu": 0.0, "device": 0.0}
    calls: dict[str, int] = {}
    for event in prof.events():
        if not event.name.startswith("vitbal::"):
            continue
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith("vitbal::"):
            parent = parent.cpu_parent
        if parent is not None:
            continue
        calls[event.name] = calls.get(event.name, 0) + 1
        total["cpu"] += event.cpu_time_total / 1e3 / PROFILED_STEPS
        device = getattr(event, "device_time_total", None)
        device = getattr(event, "cuda_time_total", 0) if device is None else device
        total["device"] += device / 1e3 / PROFILED_STEPS
    return total, calls


# ---- section 5: cost-model fidelity -------------------------------------------------------

# (t, h, w) in patches; the reference first (always measured), then images, then videos.
FULL_UNITS = [(1, 64, 64)] + [
    (1, 16, 16), (1, 16, 32), (1, 32, 32), (1, 32, 64), (1, 64, 128), (1, 128, 128),
    (1, 24, 40), (1, 48, 80), (2, 32, 32), (4, 32, 32), (8, 32, 32), (4, 64, 64),
]  # fmt: skip
SMALL_UNITS = [(1, 16, 16)] + [(1, 8, 8), (1, 16, 32), (4, 8, 8)]
MIN_UNITS = 3  # PolynomialCost.fit needs three samples, whatever the budget


def cost_section(ctx: Context) -> None:
    """Each cost model's prediction of one unit's forward + backward time, as ratios to a
    reference unit (all the planner uses): ``(predicted / predicted[ref]) / (measured /
    measured[ref])``, 1.00 exact. The polynomial is fitted to these very measurements."""
    vit, config, dtype = tower(ctx)
    units = SMALL_UNITS if ctx.small else FULL_UNITS
    repeats, warmup = (2, 1) if ctx.small else (5, 2)
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    architecture = vision_encoder_spec(vit).cost_model(vit)  # as the planner builds it
    measured: dict[tuple[int, int, int], float] = {}
    skipped, last = [], 0.0
    for unit in units:
        start = time.monotonic()
        # The next unit may take about twice the last one (patches grow by 2x between sizes).
        if len(measured) >= MIN_UNITS and start + 2 * last > ctx.deadline:
            skipped.append(f"{unit}: time budget")
            continue
        t, h, w = unit
        pixels = torch.randn(t * h * w, config.in_dim, device=ctx.device, dtype=dtype)
        grid = torch.tensor([unit], device=ctx.device)
        try:
            run = functools.partial(forward_backward, vit, pixels, grid)
            measured[unit] = timed(run, ctx.device, repeats, warmup)
        except torch.OutOfMemoryError:
            skipped.append(f"{unit}: out of memory")
            vit.zero_grad(set_to_none=True)
        last = time.monotonic() - start
    tokens = [t * h * w for t, h, w in measured]
    models = {
        "quadratic (t·h·w)²": QuadraticCost(),
        "architecture": architecture,
        "polynomial (fitted here)": PolynomialCost.fit(tokens, list(measured.values())),
    }
    ref, errors = units[0], {name: [] for name in models}
    print(f"## Cost-model fidelity: QwenStyleViT hidden {config.hidden}, MLP {config.mlp_hidden}, "
          f"depth {config.depth}, heads {config.num_heads}, {str(dtype).removeprefix('torch.')}, "
          f"forward+backward per unit, median of {repeats} after {warmup} warm-up\n")  # fmt: skip
    print("Ratio = (predicted / predicted at ref) / (measured / measured at ref); 1.00 is exact.\n")
    print("| unit t×h×w | patches | measured ms | " + " | ".join(models) + " |")
    print("|---|---|---|" + "---|" * len(models))
    for unit, seconds in sorted(measured.items(), key=lambda kv: (kv[0][0] > 1, kv[0])):
        cells = []
        for name, model in models.items():
            ratio = (model(*unit) / model(*ref)) / (seconds / measured[ref])
            errors[name].append(abs(ratio - 1))
            cells.append(f"{ratio:.2f}")
        label = "×".join(map(str, unit)) + (" (ref)" if unit == ref else "")
        print(f"| {label} | {unit[0] * unit[1] * unit[2]} | {seconds * 1e3:.2f} | "
              + " | ".join(cells) + " |")  # fmt: skip
    print("\n| cost model | max relative error | mean relative error |\n|---|---|---|")
    for name, errs in errors.items():
        print(f"| {name} | {max(errs):.1%} | {statistics.mean(errs):.1%} |")
    poly = models["polynomial (fitted here)"]
    print(f"\nFitted polynomial: a={poly.a:.3e} s/patch², b={poly.b:.3e} s/patch, c={poly.c:.3e} s")
    if ctx.device.type == "cuda":
        print(f"Peak GPU memory: {torch.cuda.max_memory_allocated(ctx.device) / 2**30:.1f} GiB.")
    if skipped:
        print("Skipped: " + "; ".join(skipped) + ".")
    print()
    arch = errors["architecture"]
    ctx.record("cost/fidelity", "PASS",
               f"{len(measured)} units; architecture model max error {max(arch):.0%} "
               "(measured; no threshold)")  # fmt: skip


SECTIONS = {"profile": profile_section, "cost": cost_section}
