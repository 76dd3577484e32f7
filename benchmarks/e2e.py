"""End-to-end cost and benefit of balancing on 2 gloo CPU ranks, printed as Markdown tables.

1. A skewed batch: ViT forward+backward per rank without and with ``dp_balance_vit_encoder``,
   against the ideal (total compute / ranks); planning and exchange included.
2. Where the balanced step's time goes: plan, redistribute, ViT, restore and the gradients' move
   in backward, each timed on its own.
3. An already balanced batch: the overhead of the skip path.
4. The exchange (``ops.redistribute`` + ``ops.restore``) against raw ``all_to_all_single`` calls
   moving the same rows, at Qwen2-VL-7B row widths.

Each number is a median over ``--repeats`` runs after warm-up. Alternatives are interleaved run by
run, so machine load from other jobs hits them alike, and each run starts at a barrier; a rank's
time ends when its own work does. Wall-clock is what a step costs here; CPU time (whole process,
gloo threads included) is the rank's own work without idle waiting: what the step would take with
a core per rank, and robust to other jobs on a shared machine. fp32, one thread per rank.

    python benchmarks/e2e.py [--repeats 7]
"""

import argparse
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fx_vitbal
from fx_vitbal.plan.step import split_units
from fx_vitbal.runtime.agree import planning
from fx_vitbal.runtime.transport import ops
from fx_vitbal.runtime.transport.routing import Routing
from fx_vitbal.runtime.vit.settings import parse_planner_spec, planner_for, planner_spec
from fx_vitbal.tools.models import QwenStyleViT, ViTConfig
from fx_vitbal.tools.simulate import QWEN2_VL_7B
from fx_vitbal.tools.workloads import sample_batches

WORLD = 2
GROUP = "0"  # name of the default process group
MERGE = 2
SHRINK = MERGE * MERGE  # pixel rows per output row
# Big enough that matrix multiplies dominate; inputs as wide as Qwen2-VL's (3*2*14*14).
VIT = ViTConfig(  # merged outputs (HF's pooler layout): a quarter of the rows go home
    in_dim=1176, hidden=256, num_heads=4, depth=4, mlp_hidden=1024, out_dim=512, merged_output=True
)
# Rank 0 holds five photo-sized images, rank 1 thumbnails and a short video: ~7x the ViT work.
SKEWED = [
    [[1, 20, 14], [1, 16, 12], [1, 14, 14], [1, 12, 10], [1, 8, 8]],
    [[1, 8, 6], [1, 6, 6], [2, 4, 4], [1, 4, 4]],
]
# The same images on both ranks: the planner skips ("balanced").
EVEN = [[1, 16, 12], [1, 12, 10], [2, 8, 8], [1, 8, 6]]
# Row widths of Qwen2-VL-7B: 3*2*14*14 pixel values per patch, LM hidden 3584 per merged token.
PIXEL_WIDTH, EMBED_WIDTH = 1176, 3584
# Plan even small imbalances, so the exchange benchmark always moves rows.
ALWAYS = fx_vitbal.BalanceConfig(trigger_threshold=0.0, min_gain=0.0)

Timing = tuple[float, float]  # (wall, cpu) seconds


def timed(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, Timing]:
    """Median ``(wall, cpu)`` seconds of each function, interleaved, each run after a barrier."""
    samples: dict[str, list[Timing]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            dist.barrier()
            wall, cpu = time.perf_counter(), time.process_time()
            fn()
            samples[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    return {
        name: (statistics.median(s[0] for s in runs), statistics.median(s[1] for s in runs))
        for name, runs in samples.items()
    }


def inputs(grid: list[list[int]], width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    grid_thw = torch.tensor(grid, dtype=torch.long).reshape(-1, 3)
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(int(grid_thw.prod(1).sum()), width, generator=gen), grid_thw


def vit_step(vit, pixels, grid_thw, config=None) -> None:
    """Forward+backward of the ViT alone (``config=None``) or balanced."""
    vit.zero_grad(set_to_none=True)
    if config is None:
        embeds = vit(pixels, grid_thw)[0]
    else:
        embeds = fx_vitbal.dp_balance_vit_encoder(vit, pixels, grid_thw, config=config)[0]
    embeds.sum().backward()


# The three moves of a balanced step, called as the runtime calls them (see encoder.py, ops.py).
def move_pixels(pixels: torch.Tensor, routing: torch.Tensor) -> torch.Tensor:
    return ops.redistribute([pixels], routing, SHRINK, [SHRINK], None, GROUP)[0]


def move_home(embeds: torch.Tensor, routing: torch.Tensor, home_rows: int) -> torch.Tensor:
    return ops.restore([embeds], routing, SHRINK, [1], [home_rows], GROUP)[0]  # merged rows


def move_gradients(grads: torch.Tensor, routing: torch.Tensor, rows: int) -> torch.Tensor:
    return ops.redistribute([grads], routing, SHRINK, [1], [rows], GROUP)[0]


def measure_skewed(rank: int, vit, repeats: int) -> dict[str, Timing]:
    pixels, grid_thw = inputs(SKEWED[rank], VIT.in_dim, rank)
    config = fx_vitbal.BalanceConfig()
    spec, _ = planner_for(vit, config)
    grid, routing = planning.plan(pixels, grid_thw, MERGE, spec, WORLD, GROUP)
    moved = move_pixels(pixels, routing)
    embeds = vit(moved, grid)[0].detach()
    home_rows = pixels.shape[0] // SHRINK
    grads = torch.ones(home_rows, embeds.shape[1])
    steps = {
        "off": lambda: vit_step(vit, pixels, grid_thw),
        "on": lambda: vit_step(vit, pixels, grid_thw, config),
    }
    phases = {
        "plan (gather grids, solve)": lambda: planning.plan(
            pixels, grid_thw, MERGE, spec, WORLD, GROUP
        ),
        "redistribute pixels": lambda: move_pixels(pixels, routing),
        "ViT forward+backward, balanced batch": lambda: vit_step(vit, moved, grid),
        "restore embeddings": lambda: move_home(embeds, routing, home_rows),
        "move gradients (restore's backward)": lambda: move_gradients(
            grads, routing, embeds.shape[0]
        ),
    }
    timed({**steps, **phases}, 2)  # warm-up: allocator, kernels, first calls
    return {**timed(steps, repeats), **timed(phases, repeats)}


def measure_even(rank: int, vit, repeats: int) -> dict[str, Timing]:
    pixels, grid_thw = inputs(EVEN, VIT.in_dim, rank)
    config = fx_vitbal.BalanceConfig()
    spec, _ = planner_for(vit, config)
    _, routing = planning.plan(pixels, grid_thw, MERGE, spec, WORLD, GROUP)
    assert not Routing.from_tensor(routing).applied, "EVEN must take the skip path"
    fns = {
        "off": lambda: vit_step(vit, pixels, grid_thw),
        "on": lambda: vit_step(vit, pixels, grid_thw, config),
        "plan": lambda: planning.plan(pixels, grid_thw, MERGE, spec, WORLD, GROUP),
    }
    timed(fns, 1)
    return timed(fns, repeats)


def measure_exchange(rank: int, grid: list[list[int]], spec: str, repeats: int) -> dict:
    """``redistribute`` + ``restore`` vs ``all_to_all_single`` moving the same rows; the raw
    version allocates its outputs too, as any real caller must."""
    pixels, grid_thw = inputs(grid, PIXEL_WIDTH, rank)
    _, routing = planning.plan(pixels, grid_thw, MERGE, spec, WORLD, GROUP)
    route = Routing.from_tensor(routing)
    embeds = torch.randn(move_pixels(pixels, routing).shape[0] // SHRINK, EMBED_WIDTH)
    home_rows = pixels.shape[0] // SHRINK
    embed_send = [n // SHRINK for n in route.recv_rows]  # outputs go back where pixels came from
    embed_recv = [n // SHRINK for n in route.send_rows]

    def raw() -> None:
        moved = pixels.new_empty(sum(route.recv_rows), PIXEL_WIDTH)
        dist.all_to_all_single(moved, pixels, route.recv_rows, route.send_rows)
        home = embeds.new_empty(home_rows, EMBED_WIDTH)
        dist.all_to_all_single(home, embeds, embed_recv, embed_send)

    def vitbal() -> None:
        move_pixels(pixels, routing)
        move_home(embeds, routing, home_rows)

    fns = {"vitbal": vitbal, "raw": raw}
    timed(fns, 1)
    pixels_out = sum(n for d, n in enumerate(route.send_rows) if d != rank)
    embeds_out = sum(n for d, n in enumerate(embed_send) if d != rank)
    return {
        **timed(fns, repeats),
        "bytes": 4 * (pixels.numel() + embeds.numel()),
        "bytes_out": 4 * (pixels_out * PIXEL_WIDTH + embeds_out * EMBED_WIDTH),
        "rows_out": pixels_out,
        "rows": pixels.shape[0],
    }


def planned(vit) -> tuple[fx_vitbal.Plan, list[int]]:
    """The plan for SKEWED that every rank computes, and the units per rank."""
    spec, _ = planner_for(vit, fx_vitbal.BalanceConfig())
    config, cost_model = parse_planner_spec(spec)
    units = [split_units(grid, config.split_frames) for grid in SKEWED]
    costs = [[cost_model(*u) for u in rank_units] for rank_units in units]
    tokens = [[t * h * w for t, h, w in rank_units] for rank_units in units]
    return fx_vitbal.solve_plan(costs, tokens, config=config), [len(u) for u in units]


def rank_main(rank: int, repeats: int) -> None:
    torch.manual_seed(0)
    vit = QwenStyleViT(VIT)
    realistic = sample_batches(WORLD, 8, seed=3)[rank]
    results = {
        "skewed": measure_skewed(rank, vit, repeats),
        "even": measure_even(rank, vit, repeats),
        "exchange": {
            "skewed batch of table 1": measure_exchange(
                rank, SKEWED[rank], planner_for(vit, ALWAYS)[0], repeats
            ),
            "realistic mix, 8 images/rank": measure_exchange(
                rank, realistic, planner_spec(ALWAYS, QWEN2_VL_7B), repeats
            ),
        },
    }
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, results)
    if rank == 0:
        print_machine(repeats)
        print_skewed([r["skewed"] for r in gathered], *planned(vit))
        print_phases([r["skewed"] for r in gathered])
        print_even([r["even"] for r in gathered])
        print_exchange([r["exchange"] for r in gathered])


def print_machine(repeats: int) -> None:
    print(
        f"{platform.platform()}, {_cpu_name()}, {os.cpu_count()} CPUs (1-min load average "
        f"{os.getloadavg()[0]:.1f} at the end), Python {platform.python_version()}, torch "
        f"{torch.__version__}; {WORLD} gloo ranks x 1 thread, fp32, medians of {repeats}.\n"
    )
    print(
        f"ViT: hidden {VIT.hidden}, depth {VIT.depth}, mlp {VIT.mlp_hidden}, in_dim "
        f"{VIT.in_dim}, out_dim {VIT.out_dim}, per-frame attention, 2x2 merge.\n"
    )


def print_skewed(per_rank: list[dict], plan: fx_vitbal.Plan, num_units: list[int]) -> None:
    patches = [sum(t * h * w for t, h, w in grid) for grid in SKEWED]
    mean_load = statistics.mean(plan.loads_before)
    rows = [
        ["patches (units)", *[f"{p} ({u})" for p, u in zip(patches, num_units, strict=True)]],
        ["planned load / mean, before", *[f"{x / mean_load:.2f}" for x in plan.loads_before]],
        ["planned load / mean, after", *[f"{x / mean_load:.2f}" for x in plan.loads_after]],
    ]
    rows = [row + ["", "", ""] for row in rows]
    for clock, k in (("wall", 0), ("CPU", 1)):
        for mode, label in (("off", "no balancing"), ("on", "fx_vitbal")):
            ms = [1e3 * r[mode][k] for r in per_rank]
            mean, slowest = statistics.mean(ms), max(ms)
            cells = [f"{x:.0f}" for x in ms] + [f"{mean:.0f}", f"{slowest:.0f}"]
            rows.append([f"{clock} ms, {label}", *cells, f"{mean / slowest:.1%}"])
    ranks = [f"rank {r}" for r in range(WORLD)]
    _table(
        "1. Skewed batch: ViT forward+backward per rank",
        ["", *ranks, "mean", "max", "efficiency (mean/max)"],
        rows,
    )
    rows = []
    for clock, k in (("wall", 0), ("CPU", 1)):
        off = [r["off"][k] for r in per_rank]
        on = max(r["on"][k] for r in per_rank)
        ideal = max(off) / statistics.mean(off)
        achieved = max(off) / on
        rows.append(
            [
                clock,
                f"{1e3 * max(off):.0f}",
                f"{1e3 * statistics.mean(off):.0f}",
                f"{1e3 * on:.0f}",
                f"{ideal:.2f}x",
                f"{achieved:.2f}x",
                f"{achieved / ideal:.0%} (goal >= 85%)",
            ]
        )
    _table(
        "Slowest rank vs the ideal (total compute / ranks)",
        [
            "clock",
            "no balancing ms",
            "ideal ms",
            "fx_vitbal ms",
            "ideal speed-up",
            "achieved",
            "% of ideal",
        ],
        rows,
    )
    slowest_off = max(per_rank, key=lambda r: r["off"][1])["off"]
    slowest_on = max(per_rank, key=lambda r: r["on"][1])["on"]
    print(
        f"CPU / wall of the slowest rank: {slowest_off[1] / slowest_off[0]:.0%} without "
        f"balancing (the other rank idles after {1e3 * min(r['off'][0] for r in per_rank):.0f} "
        f"ms), {slowest_on[1] / slowest_on[0]:.0%} with it (both ranks busy): the share of a "
        "core each rank gets next to other jobs on this machine.\n"
    )


def print_phases(per_rank: list[dict]) -> None:
    names = [name for name in per_rank[0] if name not in ("off", "on")]
    rows = []
    for name in names:
        ms = [1e3 * r[name][0] for r in per_rank]
        share = [r[name][0] / r["on"][0] for r in per_rank]
        rows.append([name, *[f"{x:.1f}" for x in ms], " / ".join(f"{s:.1%}" for s in share)])
    total = [1e3 * sum(r[name][0] for name in names) for r in per_rank]
    step = [1e3 * r["on"][0] for r in per_rank]
    rows.append(["sum of the phases", *[f"{x:.1f}" for x in total], ""])
    rows.append(["balanced step (table 1)", *[f"{x:.1f}" for x in step], ""])
    _table(
        "2. Where the balanced step's time goes (wall ms, each phase timed alone)",
        ["phase", *[f"rank {r}" for r in range(WORLD)], "share of each rank's step"],
        rows,
    )


def print_even(per_rank: list[dict]) -> None:
    rows = []
    for clock, k in (("wall", 0), ("CPU", 1)):
        off, on, plan = (max(r[name][k] for r in per_rank) for name in ("off", "on", "plan"))
        rows.append(
            [
                clock,
                f"{1e3 * off:.1f}",
                f"{1e3 * on:.1f}",
                f"{(on - off) / off:+.1%}",
                f"{1e3 * plan:.2f}",
                f"{plan / off:.2%} (goal <= 2%)",
            ]
        )
    _table(
        "3. Balanced batch, skip path: slowest rank",
        [
            "clock",
            "plain ViT ms",
            "fx_vitbal ms",
            "difference",
            "plan op alone ms",
            "plan / ViT step",
        ],
        rows,
    )


def print_exchange(per_rank: list[dict]) -> None:
    rows = []
    for name in per_rank[0]:
        runs = [r[name] for r in per_rank]
        vitbal, raw = (1e3 * max(run[kind][0] for run in runs) for kind in ("vitbal", "raw"))
        moved = sum(run["rows_out"] for run in runs) / sum(run["rows"] for run in runs)
        rows.append(
            [
                name,
                f"{sum(run['bytes'] for run in runs) / 2**20:.0f}",
                f"{sum(run['bytes_out'] for run in runs) / 2**20:.1f} ({moved:.0%} of rows)",
                f"{vitbal:.1f}",
                f"{raw:.1f}",
                f"{vitbal / raw:.2f}x (goal <= 1.5x)",
            ]
        )
    _table(
        "4. Exchange: redistribute 1176-wide pixel rows + restore 3584-wide output rows "
        "(slowest rank, wall ms)",
        ["batch", "MiB held", "MiB crossing ranks", "vitbal ops", "raw all_to_all_single", "ratio"],
        rows,
    )


def _table(title: str, header: list[str], rows: list[list[str]]) -> None:
    print(f"### {title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print()


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per measurement")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    launch(rank_main, args.repeats)


def launch(rank_main: Callable[[int, int], None], repeats: int) -> None:
    """Run ``rank_main(rank, repeats)`` on ``WORLD`` spawned gloo ranks, one thread each."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _rank_entry, args=(tmp, rank_main, repeats), nprocs=WORLD, start_method="spawn"
        )


def _rank_entry(rank: int, tmp: str, rank_main: Callable[[int, int], None], repeats: int) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(tmp, "store"), WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    try:
        rank_main(rank, repeats)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
