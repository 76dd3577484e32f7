"""Train the reference OmniEncoderModel on CPU ranks, without and with ViT balancing, and compare.

What it shows, on a deliberately skewed workload (rank 0 holds the high-resolution documents):
each balanced call's statistics as the runtime reports them (``fx_vitbal.add_stats_callback``:
decision, predicted imbalance before and after, rows moved, each rank's measured ViT time and
what the online cost model had predicted for it), the ViT time of every rank with and without
balancing (medians over the steps after the warm-up), and that training itself is unchanged (same
losses). With matplotlib (the ``plot`` extra) it writes a PNG: per-rank ViT CPU time unbalanced vs
balanced (left), and per-rank ViT wall-clock time as the runtime measured it and as the online
model predicted it, over the steps (right). Steps are numbered as ``BalanceStats.step`` numbers
the balanced calls: each run's untimed warm-up call comes before step 1 and is forgotten
(``fx_vitbal.measure.reset()``).

Both runs start from the same weights, see the same data and take real AdamW steps with gradients
averaged over ranks; they are interleaved step by step so both see the same machine load. The
balanced run uses the online cost model unless ``--dp-balance-cost-model-vit`` says otherwise.

    python examples/train_omni.py                        # 4 ranks, 8 steps, both runs, PNG
    python examples/train_omni.py --use-vit-dp-balance   # the balanced run only
    python examples/train_omni.py --steps 1 --ranks 2 --dp-balance-verbose
"""

import argparse
import copy
import dataclasses
import logging
import math
import os
import random
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import fx_vitbal
from fx_vitbal.tools.models import ViTConfig
from fx_vitbal.tools.omni import LMConfig, OmniEncoderModel, make_inputs
from fx_vitbal.tools.workloads import sample_grid

# Small enough for ~0.1-1 s ViT steps on one CPU thread, with the real towers' structure: per-frame
# attention, a 2x2 patch merger and one deepstack layer (Qwen3-VL style).
VIT = ViTConfig(
    in_dim=96, hidden=64, num_heads=4, depth=4, mlp_hidden=256, out_dim=64, deepstack_indexes=(1,)
)
LM = LMConfig(vocab_size=64, hidden=64, num_layers=2, num_heads=4)
# Grids of fx_vitbal.tools.workloads divided by this per side: a 1.5-2.8k px document becomes ~30x20
# patches instead of ~120x90, and costs keep their relative sizes.
DOWNSCALE = 4
TEXT_PER_IMAGE = 16
IGNORE = -100

HEADER = """\
OmniEncoderModel (ViT: hidden {vit.hidden}, depth {vit.depth}; LM: {lm.num_layers} layers) on \
{ranks} gloo CPU ranks, {steps} step(s), {runs}.
ViT time: CPU seconds of each rank's process from the ViT call to its return (plan, redistribute,
ViT, restore) plus from the first gradient reaching the ViT outputs to the end of backward (the
reverse move, ViT backward). CPU time, not wall-clock: {ranks} ranks share {cpus} cores and other
jobs, so a wall clock would time the OS scheduler; idle waiting for other ranks is not counted.
Runtime: the balanced call's statistics (fx_vitbal.BalanceStats); its own clock is the wall clock
around the ViT alone, reported one step later. Cost model: {cost_model}. fp32, 1 thread per rank.
Step k is the balanced ViT's call k (BalanceStats.step): an untimed warm-up call per run comes
first, and the runtime forgets it (fx_vitbal.measure.reset())."""


def step_grids(step: int, num_ranks: int) -> list[list[list[int]]]:
    """Deterministic skewed grids: rank 0 draws 8 images from the ``documents`` mix (high-res
    scans and thumbnails), every other rank 4 from the ``realistic`` mix."""
    rng = random.Random(step)
    return [
        [
            _downscale(sample_grid(rng, "documents" if rank == 0 else "realistic"))
            for _ in range(8 if rank == 0 else 4)
        ]
        for rank in range(num_ranks)
    ]


def _downscale(grid: list[int]) -> list[int]:
    t, h, w = grid
    return [t, 2 * max(1, round(h / (2 * DOWNSCALE))), 2 * max(1, round(w / (2 * DOWNSCALE)))]


class ViTClock:
    """CPU seconds this process spends in the ViT region of one training step (see HEADER)."""

    def __init__(self, vit: torch.nn.Module) -> None:
        self.seconds = 0.0
        self.forward_started = 0.0
        self.backward_started: float | None = None
        vit.register_forward_pre_hook(self._start_forward)
        vit.register_forward_hook(self._stop_forward)

    def _start_forward(self, module, args) -> None:
        self.forward_started = time.process_time()

    def _stop_forward(self, module, args, outputs) -> None:
        self.seconds = time.process_time() - self.forward_started
        self.backward_started = None
        embeds, _, deepstack = outputs
        for output in (embeds, *deepstack):
            output.register_hook(self._start_backward)

    def _start_backward(self, grad: torch.Tensor) -> None:
        if self.backward_started is None:
            self.backward_started = time.process_time()

    def stop(self) -> float:
        """Call right after ``backward()``; returns the step's ViT seconds."""
        self.seconds += time.process_time() - self.backward_started
        return self.seconds


@dataclasses.dataclass
class Run:
    model: OmniEncoderModel
    optimizer: torch.optim.Optimizer
    clock: ViTClock


def make_run(base: OmniEncoderModel, config: fx_vitbal.BalanceConfig | None) -> Run:
    model = copy.deepcopy(base)
    if config is not None:
        fx_vitbal.enable_vit_balance(model, config=config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return Run(model, optimizer, ViTClock(model.visual))


def train_step(run: Run, inputs, world: int) -> tuple[float, float]:
    """One AdamW step on gradients averaged over ranks; returns ``(global loss, ViT seconds)``."""
    input_ids, pixel_values, grid_thw = inputs
    run.optimizer.zero_grad()
    logits = run.model(input_ids, pixel_values, grid_thw)
    # Next-token loss on text targets only (image placeholders are inputs, not predictions).
    targets = input_ids[1:].masked_fill(input_ids[1:] == LM.image_token_id, IGNORE)
    loss = F.cross_entropy(logits[:-1], targets, ignore_index=IGNORE)
    loss.backward()
    vit_seconds = run.clock.stop()
    grads = [p.grad for p in run.model.parameters()]
    flat = torch.cat([g.flatten() for g in grads] + [loss.detach().reshape(1)])
    dist.all_reduce(flat)  # one collective for every gradient and the loss
    flat /= world
    *values, mean_loss = flat.split([g.numel() for g in grads] + [1])
    for grad, value in zip(grads, values, strict=True):
        grad.copy_(value.view_as(grad))
    run.optimizer.step()
    return mean_loss.item(), vit_seconds


def rank_main(rank: int, world: int, config: fx_vitbal.BalanceConfig, options: dict) -> None:
    steps, both, warmup = options["steps"], options["both"], options["warmup"]
    if config.verbose:
        # stdout, so the runtime's line lands inside the step it belongs to.
        logging.basicConfig(level=logging.INFO, format="  runtime: %(message)s", stream=sys.stdout)
    torch.manual_seed(0)  # same initial weights on every rank and in every run
    base = OmniEncoderModel(VIT, LM)
    runs = {"on": make_run(base, config)}
    if both:
        runs = {"off": make_run(base, None), **runs}
    if rank == 0:
        runs_text = "without and with ViT balancing" if both else "with ViT balancing"
        header = HEADER.format(
            vit=VIT,
            lm=LM,
            ranks=world,
            steps=steps,
            runs=runs_text,
            cpus=os.cpu_count(),
            cost_model=config.cost_model,
        )
        print(header, flush=True)
        if config.verbose:  # the warm-up call's line comes next
            print("\nwarm-up (untimed, then forgotten):", flush=True)
    # One untimed forward+backward per run: the first call of the vitbal ops imports
    # torch._dynamo (seconds), and allocator and kernels warm up. No optimizer step is taken.
    warm_up_inputs = make_inputs(step_grids(0, world)[rank], **_input_kwargs(0, rank))
    for run in runs.values():
        run.model(*warm_up_inputs).sum().backward()
        run.optimizer.zero_grad()
    # Forget the warm-up call, on every rank: its time (first-call costs included) would feed the
    # online fit, and the balanced calls are numbered from 1 again (BalanceStats.step), so call k
    # is step k.
    fx_vitbal.measure.reset()
    stats: list[fx_vitbal.BalanceStats] = []
    fx_vitbal.add_stats_callback(stats.append)  # every balanced call, on every rank
    report = {name: {"loss": [], "per_rank": []} for name in runs}
    for step in range(1, steps + 1):
        grids = step_grids(step - 1, world)
        if rank == 0:
            patches = [sum(t * h * w for t, h, w in rank_grids) for rank_grids in grids]
            print(f"\nstep {step}: patches per rank {' '.join(map(str, patches))}")
        inputs = make_inputs(grids[rank], **_input_kwargs(step - 1, rank))
        results = {name: train_step(run, inputs, world) for name, run in runs.items()}
        assert stats[-1].step == step, (stats[-1].step, step)  # one balanced call a step
        seconds = {name: vit for name, (_, vit) in results.items()}
        gathered = [None] * world
        dist.all_gather_object(gathered, seconds)
        if rank == 0:
            _print_step(stats[-1], results, gathered, report)
    if rank == 0:
        _print_summary(report, warmup)
        if options["plot"]:
            plot(report, stats, warmup, options["plot"])


def _input_kwargs(step: int, rank: int) -> dict:
    return dict(
        in_dim=VIT.in_dim,
        text_per_image=TEXT_PER_IMAGE,
        image_token_id=LM.image_token_id,
        vocab_size=LM.vocab_size,
        seed=1000 * step + rank,
    )


def _print_step(stats: fx_vitbal.BalanceStats, results, gathered, report) -> None:
    moved = stats.moved_rows / max(stats.total_rows, 1)
    print(
        f"  runtime: {stats.reason} (predicted imbalance {stats.imbalance_before:.2f} -> "
        f"{stats.imbalance_after:.2f}, {moved:.0%} of pixel rows moved)"
    )
    if stats.coefficients is not None:
        a, b, c, d = stats.coefficients
        print(f"  online fit: {a:.2e} s/pair {b:.2e} s/token {c:.2e} s/unit {d:.2e} s/call")
    measured = [s for s in stats.measured_seconds if s is not None]
    if len(measured) == len(stats.measured_seconds):
        step = max(stats.measured_steps)
        cells = _cells(measured, 1e-3, "5.0f")
        print(f"  step {step} measured ViT wall ms per rank:  {cells}")
        predicted = stats.measured_predicted_seconds
        if None not in predicted:
            cells = _cells(predicted, 1e-3, "5.0f")
            print(f"  step {step} predicted ViT wall ms per rank: {cells}")
    for name, (loss, _) in results.items():
        per_rank = [1e3 * rank_seconds[name] for rank_seconds in gathered]
        report[name]["loss"].append(loss)
        report[name]["per_rank"].append(per_rank)
        cells = _cells(per_rank, 1, "5.0f")
        print(f"  balance {name:<3} ViT CPU ms per rank: {cells}  loss {loss:.7f}")
    if len(results) == 2:
        off, on = max(report["off"]["per_rank"][-1]), max(report["on"]["per_rank"][-1])
        print(f"  slowest rank: {off:.0f} ms -> {on:.0f} ms, speed-up {off / on:.2f}x")


def _cells(values, scale, fmt) -> str:
    return " ".join(format(v / scale, fmt) for v in values)


def _print_summary(report, warmup: int) -> None:
    print()
    warmup = warmup if len(report["on"]["per_rank"]) > warmup else 0  # too few steps: keep all
    timed = slice(warmup, None)
    kept = len(report["on"]["per_rank"][timed])
    medians = {
        name: [statistics.median(col) for col in zip(*runs["per_rank"][timed], strict=True)]
        for name, runs in report.items()
    }
    for name, per_rank in medians.items():
        efficiency = statistics.fmean(per_rank) / max(per_rank)
        print(
            f"balance {name:<3} median ViT CPU ms per rank over {kept} steps after {warmup} "
            f"warm-up: {_cells(per_rank, 1, '5.0f')} (efficiency mean/max {efficiency:.0%})"
        )
    if "off" not in report:
        return
    speedups = [
        max(off) / max(on)
        for off, on in zip(
            report["off"]["per_rank"][timed], report["on"]["per_rank"][timed], strict=True
        )
    ]
    diff = max(abs(a - b) for a, b in zip(report["off"]["loss"], report["on"]["loss"], strict=True))
    verdict = "bit-identical" if diff == 0 else "identical up to fp32 rounding"
    print(f"median slowest-rank ViT speed-up: {statistics.median(speedups):.2f}x")
    print(f"losses: max |balanced - unbalanced| = {diff:.3g} over all steps, fp32 ({verdict})")


def runtime_times(
    stats: list[fx_vitbal.BalanceStats],
) -> tuple[list[dict[int, float]], list[dict[int, float]]]:
    """``(measured, predicted)``, per rank ``{step: ms}``: the ViT wall-clock time of every step
    the runtime reported one for (a call reports each rank's previous timed call, so the last
    step's time is never reported), and what the online fit predicted for it when that step was
    planned, where it did (only once the fit no longer blends in the prior: a blended model gives
    no per-rank time)."""
    world = len(stats[0].measured_steps) if stats else 0
    measured: list[dict[int, float]] = [{} for _ in range(world)]
    predicted: list[dict[int, float]] = [{} for _ in range(world)]
    for s in stats:
        for r, step in enumerate(s.measured_steps):
            if step == 0 or s.measured_seconds[r] is None:  # rank r reported no time
                continue
            measured[r][step] = 1e3 * s.measured_seconds[r]
            if s.measured_predicted_seconds[r] is not None:
                predicted[r][step] = 1e3 * s.measured_predicted_seconds[r]
    return measured, predicted


def figure(report, stats, warmup: int):
    """Left: each rank's median ViT CPU time, unbalanced vs balanced. Right: each rank's ViT
    wall-clock time per step as the runtime measured it and as the online model predicted it when
    it planned the step (``runtime_times``). Needs matplotlib."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.8), layout="constrained")
    left, right = fig.subplots(1, 2)
    num_steps = len(report["on"]["per_rank"])
    if num_steps <= warmup:
        warmup = 0  # too few steps: keep all, as the summary does
    world = len(report["on"]["per_rank"][0])
    width = 0.8 / len(report)
    for i, (name, runs) in enumerate(report.items()):
        cols = zip(*runs["per_rank"][warmup:], strict=True)
        medians = [statistics.median(col) for col in cols]
        label = "balanced" if name == "on" else "unbalanced"
        xs = [r + (i - (len(report) - 1) / 2) * width for r in range(world)]
        left.bar(xs, medians, width, label=label, color="tab:blue" if name == "on" else "0.65")
    left.set_xticks(range(world), [f"rank {r}" for r in range(world)])
    left.set_ylabel("ViT forward + backward: CPU time, ms")
    kept = f"steps {warmup + 1}-{num_steps}" if num_steps > warmup + 1 else f"step {num_steps}"
    left.set_title(f"process CPU time, median of {kept}\n(the slowest rank sets the step)")
    left.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, fontsize="small")
    measured, predicted = runtime_times(stats)
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown"]
    for r in range(len(measured)):
        color = colors[r % len(colors)]
        steps = sorted(measured[r])
        ms = [measured[r][k] for k in steps]
        right.plot(steps, ms, "-o", ms=3, color=color, label=f"rank {r}")
        if predicted[r]:  # NaN where the fit predicted nothing: a gap, not a line across it
            steps = range(min(predicted[r]), max(predicted[r]) + 1)
            ms = [predicted[r].get(k, math.nan) for k in steps]
            right.plot(steps, ms, "--x", ms=4, color=color)
    right.plot([], [], "k-o", ms=3, label="measured (reported by the next step)")
    right.plot([], [], "k--x", ms=4, label="predicted (none while the fit blends in its prior)")
    right.set_xlabel("step (BalanceStats.step)")
    right.set_ylabel("ViT forward + backward: wall-clock time, ms")
    right.set_title("wall-clock time, balanced run:\nruntime clock vs online cost model")
    right.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3, fontsize="small")
    return fig


def plot(report, stats, warmup: int, path: str) -> None:
    """Write ``figure(...)`` to ``path`` (a note instead without matplotlib)."""
    try:
        fig = figure(report, stats, warmup)
    except ImportError:
        print("(no PNG: matplotlib is not installed; pip install 'fx_vitbal[plot]')")
        return
    fig.savefig(path, dpi=90)
    measured, predicted = runtime_times(stats)
    print(
        f"wrote {path} (right: measured steps {_steps_text(measured)}, "
        f"predicted steps {_steps_text(predicted)})"
    )


def _steps_text(per_rank: list[dict[int, float]]) -> str:
    steps = sorted(set().union(*per_rank))
    return " ".join(map(str, steps)) if steps else "none"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="training steps per run")
    parser.add_argument("--ranks", type=int, default=4, help="data-parallel CPU ranks (gloo)")
    parser.add_argument(
        "--warmup", type=int, default=2, help="first steps left out of the medians and the PNG"
    )
    parser.add_argument(
        "--plot", default="train_omni.png", help="PNG to write ('' for none; needs matplotlib)"
    )
    fx_vitbal.add_vit_balance_args(parser)
    parser.set_defaults(dp_balance_cost_model_vit="online")
    args = parser.parse_args()
    if args.steps < 1 or args.ranks < 2:
        parser.error(f"need --steps >= 1 and --ranks >= 2, got {args.steps} and {args.ranks}")
    # --use-vit-dp-balance: train balanced only, as a training script would; else compare both.
    # The balanced run reads the --dp-balance-* flags either way.
    both = not args.use_vit_dp_balance
    args.use_vit_dp_balance = True
    config = fx_vitbal.BalanceConfig.from_args(args)
    options = {"steps": args.steps, "both": both, "warmup": args.warmup, "plot": args.plot}
    launch(rank_main, args.ranks, config, options)


def launch(fn, world: int, *args) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned gloo ranks (FileStore rendezvous)."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _rank_entry, args=(fn, world, tmp, args), nprocs=world, start_method="spawn"
        )


def _rank_entry(rank: int, fn, world: int, tmp: str, args: tuple) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(tmp, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
