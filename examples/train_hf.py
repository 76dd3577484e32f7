"""Train a small Hugging Face Qwen2-VL (built from a config, no download) under torchrun, with
DDP or FSDP2 and gradient accumulation, without and with ViT balancing (the
``--use-vit-dp-balance`` flags), and time both.

The workload is skewed on purpose: rank 0 holds a document-sized image and a short video every
step, odd ranks are text-only every other step, the rest hold thumbnails. The document (48 patch
rows, 2,300-2,700 patches) is at least twice ``BalanceConfig.min_band_patches`` (1,024), so the
planner can split it into two row bands computed on two ranks, which exchange keys and values in
every ViT layer (``BalanceStats.split_units``: the bands of a call). The balanced copy uses the
online cost model unless ``--dp-balance-cost-model-vit`` says otherwise: it times this machine
and prices a band's exchange from the exchanges it has measured (none before the first call),
where the architecture model (``auto``'s choice here) prices it at H100-class rates
(``fx_vitbal.plan.bands``: 11 us a collective), too dear for this tiny ViT's frames.

By default two copies of the model (same weights, same data) train side by side, interleaved step
by step so both see the same machine load: one without balancing, one balanced with the
``--dp-balance-*`` flags. ``--use-vit-dp-balance`` trains the balanced copy only, as a training
script would. Rank 0 prints, per step, the loss of each (the mean over ranks and micro-batches),
the step time of each (wall clock: every rank starts the step together and ends it in the loss's
all-reduce, so it is the slowest rank's) and the speed-up, and each balanced ViT call's
statistics (``fx_vitbal.add_stats_callback``); at the end, the median step times and speed-up
after step 1 (first-call costs), the largest loss difference and the split units. On a machine
with fewer free cores than ranks, the balanced copy's ranks, busy at the same time, wait for
cores: its wall clock then times the machine's load more than the balancing. Steps count from 1,
as ``BalanceStats.step`` (and the ``--dp-balance-verbose`` line) counts the balanced ViT's calls,
one per micro-batch: step ``k`` holds calls ``(k-1)*G+1`` to ``k*G`` with ``--grad-accum G``.

    torchrun --standalone --nproc-per-node 2 examples/train_hf.py
    torchrun --standalone --nproc-per-node 4 examples/train_hf.py --use-vit-dp-balance
    torchrun --standalone --nproc-per-node 2 examples/train_hf.py --wrap fsdp2 --grad-accum 2 \\
        --dp-balance-verbose
    torchrun --standalone --nproc-per-node 4 examples/train_hf.py --sp 2

Without balancing, a text-only rank never calls the vision tower, so its parameters get no
gradient there while the other ranks' do. Under DDP, such a rank adds a dummy image's output
times zero to its loss, so every parameter gets a gradient, zero (``find_unused_parameters=True``
would do too, but it warns on every rank whose step uses every parameter); under FSDP2, the tower
stays in the root's parameter group, gathered on every rank, and the root reduce-scatters zeros
for the parameters a rank did not use (``set_reduce_scatter_unused_params``; torch 2.8's FSDP2
has no such switch, so there ``--wrap fsdp2`` trains the balanced copy alone and says why).
Balanced, every rank calls the tower every step: neither is needed, and FSDP2 shards each ViT
block on its own.

``--sp N`` lays the ranks out as DP x SP (world = dp * N): the N contiguous ranks of an SP group
(``rank // N``) hold the same batch, sampled by their DP index as "rank" above, and each keeps
only its slice of the sequence for the loss (replica ``k`` of ``N``: labels ``[k*L/N,
(k+1)*L/N)``, the rest -100), as under Ulysses / context parallelism, so the replicas' gradients
differ. The SP group goes to ``enable_vit_balance`` as ``replica_group``: each image is computed
once in the whole world and its outputs come back to every replica. The LM itself is *not*
sequence-parallel here (no Ulysses all-to-all in attention: every replica runs the whole
sequence); the example shows what fx_vitbal needs, the groups, the identical batches and the
per-replica loss slice. Gradients are synchronised over the whole world, as without ``--sp``.
Rank 0 also prints, at the end, the vision rows each copy's towers computed against the rows the
SP groups' batches hold (without balancing, each replica computes its group's rows itself).

gloo on CPU, NCCL on the GPU ``LOCAL_RANK`` when CUDA is available.
"""

import argparse
import contextlib
import dataclasses
import math
import os
import random
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
import transformers
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel

import fx_vitbal

# Qwen2-VL's token ids in the tiny config below.
IMAGE, VIDEO, VISION_START, VISION_END = 120, 121, 122, 123
TEXT_VOCAB = 100  # text tokens are drawn below the special ids
# Whether FSDP2 can reduce-scatter zeros for parameters a rank did not use (not on torch 2.8).
UNUSED_GRADIENTS_REDUCED = hasattr(FSDPModule, "set_reduce_scatter_unused_params")
DUMMY_GRID = (1, 2, 2)  # a text-only rank's dummy image without balancing (DDP): one 2x2 merge


def build_config() -> transformers.Qwen2VLConfig:
    """A tiny Qwen2-VL."""
    config = transformers.Qwen2VLConfig(
        vision_config=dict(depth=2, embed_dim=64, hidden_size=64, num_heads=4, mlp_ratio=2),
        text_config=dict(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            rope_parameters={
                "rope_type": "default",
                "mrope_section": [2, 3, 3],
                "rope_theta": 10000.0,
            },
            # The samples have no BOS or EOS, and Qwen2's default ids (151643, 151645) lie outside
            # this vocabulary, which transformers warns about.
            bos_token_id=None,
            eos_token_id=None,
        ),
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
    )
    config._attn_implementation = "sdpa"
    return config


def build_model(device: torch.device) -> transformers.Qwen2VLForConditionalGeneration:
    """A tiny random Qwen2-VL; the same weights on every rank and in every copy (seeded)."""
    torch.manual_seed(0)
    return transformers.Qwen2VLForConditionalGeneration(build_config()).to(device).train()


def sample_grids(rank: int, step: int, micro: int) -> tuple[list, list]:
    """``(image grids, video grids)`` in patches for one micro-batch of one rank (skewed)."""
    rng = random.Random(f"{rank}-{step}-{micro}")
    if rank == 0:  # a document (bands, see the module doc) and a short video
        return [[1, 48, 2 * rng.randint(24, 28)]], [[2, 4, 6]]
    if rank % 2 and step % 2 == 0:
        return [], []  # text-only
    return [[1, 2 * rng.randint(1, 2), 2 * rng.randint(1, 2)]], []


def make_batch(grids: tuple[list, list], rank: int, step: int, micro: int, width: int) -> dict:
    """One packed sample: text, then each image's and video's placeholder tokens."""
    images, videos = grids
    gen = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    ids = torch.randint(0, TEXT_VOCAB, (8,), generator=gen).tolist()
    types = [0] * len(ids)
    for grids_, token, kind in ((images, IMAGE, 1), (videos, VIDEO, 2)):
        for t, h, w in grids_:
            n = t * h * w // 4  # 2x2 patches merge into one token
            ids += [VISION_START] + [token] * n + [VISION_END]
            types += [0] + [kind] * n + [0]
    batch = {
        "input_ids": torch.tensor([ids]),
        "mm_token_type_ids": torch.tensor([types]),
        "labels": torch.tensor([ids]),
    }
    for grids_, pixels, grid in (
        (images, "pixel_values", "image_grid_thw"),
        (videos, "pixel_values_videos", "video_grid_thw"),
    ):
        if grids_:
            rows = sum(t * h * w for t, h, w in grids_)
            batch[pixels] = torch.randn(rows, width, generator=gen)
            batch[grid] = torch.tensor(grids_)
    return batch


def keep_slice(labels: torch.Tensor, k: int, n: int) -> torch.Tensor:
    """``labels`` with only replica ``k`` of ``n``'s slice of the sequence kept (the rest -100)."""
    length = labels.shape[-1]
    keep = torch.zeros(length, dtype=torch.bool)
    keep[k * length // n : (k + 1) * length // n] = True
    return labels.masked_fill(~keep, -100)


def count_rows(tower: torch.nn.Module) -> list[int]:
    """A list that gets the pixel rows of every call of ``tower`` on this rank (after balancing:
    the rows this rank computes)."""
    rows = []
    tower.patch_embed.register_forward_pre_hook(lambda _, args: rows.append(args[0].shape[0]))
    return rows


def wrap(model: torch.nn.Module, how: str, device: torch.device, balanced: bool) -> torch.nn.Module:
    """DDP, or FSDP2 on every LM layer, every ViT block when balanced, and the whole model (see
    the module doc for text-only ranks without balancing)."""
    if how == "ddp":
        return DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    if balanced:  # every rank runs every block every step, so a block can gather on its own
        for block in model.model.visual.blocks:
            fully_shard(block)
    for layer in model.model.language_model.layers:
        fully_shard(layer)
    model = fully_shard(model)
    if not balanced:
        model.set_reduce_scatter_unused_params(True)
    # The model's output holds its image features split per image, views, and FSDP2 warns that an
    # in-place op on a view returned by the root would skip its pre-backward hook: none here.
    warnings.filterwarnings("ignore", r"FSDP2-wrapped module .* returned a view tensor")
    return model


def sync_gradients(model: torch.nn.Module, how: str, last: bool):
    """Reduce gradients on the last micro-batch only (DDP: ``no_sync``; FSDP2: its switch)."""
    if how == "ddp":
        return contextlib.nullcontext() if last else model.no_sync()
    model.set_requires_gradient_sync(last)
    return contextlib.nullcontext()


@dataclasses.dataclass
class Run:
    """One copy of the model in training, and what rank 0 reports of it."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    balanced: bool
    computed_rows: list[int]
    """This rank's tower's pixel rows, per call (``count_rows``)."""
    dummy_rows: int = 0
    """Of those, the dummy images of text-only batches (unbalanced DDP, see the module doc)."""
    losses: list[float] = dataclasses.field(default_factory=list)
    seconds: list[float] = dataclasses.field(default_factory=list)
    """Wall-clock seconds of each step."""

    @property
    def name(self) -> str:
        return "balanced" if self.balanced else "unbalanced"


def make_run(args, device: torch.device, config, sp_group) -> Run:
    """A copy of the model, wrapped, balanced with ``config`` (None: not balanced)."""
    model = build_model(device)
    rows = count_rows(model.model.visual)
    model = wrap(model, args.wrap, device, balanced=config is not None)
    if config is not None:
        # After wrapping: the tower is found through DDP, and FSDP2 keeps the module tree. The
        # group is the whole world (DP x SP); the SP group holds this rank's batch.
        fx_vitbal.enable_vit_balance(
            model, config=config, group=dist.group.WORLD, replica_group=sp_group
        )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    return Run(model, optimizer, config is not None, rows)


def train_step(run: Run, micro_batches: list, how: str, width: int, world: int) -> None:
    """One optimizer step of ``run`` over ``micro_batches`` (``(grids, batch)`` pairs); appends
    the mean loss over ranks and micro-batches and the step's wall-clock seconds to ``run``."""
    dist.barrier()  # every rank starts the step here: the time below is the slowest rank's step
    start = time.perf_counter()
    device = next(run.model.parameters()).device
    total = torch.zeros((), device=device)
    for micro, (grids, batch) in enumerate(micro_batches):
        with sync_gradients(run.model, how, last=micro == len(micro_batches) - 1):
            loss = run.model(**batch).loss
            if how == "ddp" and not run.balanced and not (grids[0] or grids[1]):
                loss = loss + dummy_image_loss(run, width, device)
            loss = loss / len(micro_batches)
            loss.backward()
        total += loss.detach()
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    dist.all_reduce(total)  # gloo has no AVG; every rank's step ends here
    run.losses.append(total.item() / world)  # .item() waits for the device too
    run.seconds.append(time.perf_counter() - start)


def dummy_image_loss(run: Run, width: int, device: torch.device) -> torch.Tensor:
    """Zero, computed through the vision tower from a dummy image: added to a text-only rank's
    loss under DDP without balancing, it gives every tower parameter a gradient (zero), as on the
    ranks with images (see the module doc)."""
    rows = math.prod(DUMMY_GRID)
    run.dummy_rows += rows
    tower = run.model.module.model.visual
    grid = torch.tensor([DUMMY_GRID], device=device)
    return 0.0 * tower(torch.zeros(rows, width, device=device), grid_thw=grid).pooler_output.sum()


def print_step(step: int, runs: list[Run], calls: list[fx_vitbal.BalanceStats]) -> None:
    """Rank 0's lines of one step: losses and step times, then each balanced ViT call's
    statistics, numbered as the runtime numbers them (``BalanceStats.step``)."""
    balanced = runs[-1]
    line = f"step {step} loss {balanced.losses[-1]:.6f}"
    ms = {run.name: 1e3 * run.seconds[-1] for run in runs}
    if len(runs) == 2:
        line += (
            f" (unbalanced {runs[0].losses[-1]:.6f}), step time unbalanced "
            f"{ms['unbalanced']:.0f} ms, balanced {ms['balanced']:.0f} ms: "
            f"speed-up {ms['unbalanced'] / ms['balanced']:.2f}x"
        )
    else:
        line += f", step time {ms['balanced']:.0f} ms"
    print(line)
    for s in calls:
        moved = s.moved_rows / max(s.total_rows, 1)
        print(
            f"  ViT call {s.step}: {s.reason}, predicted imbalance {s.imbalance_before:.2f} -> "
            f"{s.imbalance_after:.2f}, {moved:.0%} of pixel rows moved, split units "
            f"{s.split_units} (row bands of a frame on several ranks)"
        )


def print_summary(runs: list[Run], stats: list[fx_vitbal.BalanceStats]) -> None:
    """Rank 0's last lines: median step times after step 1, loss difference, bands."""
    steps = len(runs[0].seconds)
    first = 2 if steps > 1 else 1  # step 1 pays first-call costs
    median_ms = {run.name: 1e3 * statistics.median(run.seconds[first - 1 :]) for run in runs}
    cells = ", ".join(f"{name} {ms:.0f} ms" for name, ms in median_ms.items())
    line = f"median step time over steps {first}-{steps}: {cells}"
    if len(runs) == 1:
        print(line)
    else:
        off, on = runs
        speedups = [a / b for a, b in zip(off.seconds, on.seconds, strict=True)][first - 1 :]
        print(f"{line}; median speed-up {statistics.median(speedups):.2f}x")
        diff = max(abs(a - b) for a, b in zip(off.losses, on.losses, strict=True))
        print(f"losses: max |balanced - unbalanced| = {diff:.3g} over all steps")
    split = sum(s.split_units for s in stats)
    calls = sum(s.split_units > 0 for s in stats)
    print(f"split units: {split} in {calls} of {len(stats)} balanced ViT calls")


def report_rows(runs: list[Run], held_rows: int, sp: int, rank: int, world: int) -> None:
    """Rank 0 prints the vision rows each copy computed against those the SP groups' batches
    hold (``--sp``)."""
    device = next(runs[0].model.parameters()).device
    for run in runs:
        rows = torch.tensor([sum(run.computed_rows), held_rows, run.dummy_rows], device=device)
        every = [torch.empty_like(rows) for _ in range(world)]
        dist.all_gather(every, rows)
        computed = [int(r[0]) for r in every]
        held = [int(r[1]) for r in every[::sp]]  # one replica per SP group
        dummy = sum(int(r[2]) for r in every)
        if rank == 0:
            print(
                f"{run.name}: vision rows computed per rank {computed} = {sum(computed)}, "
                f"{dummy} of them dummy images; the SP groups' batches hold {held} = {sum(held)}",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wrap", choices=("ddp", "fsdp2"), default="ddp")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--sp", type=int, default=1, help="ranks per SP group (same batch)")
    fx_vitbal.add_vit_balance_args(parser)
    parser.set_defaults(dp_balance_cost_model_vit="online")  # see the module doc
    args = parser.parse_args()
    if args.steps < 1 or args.grad_accum < 1:
        parser.error(f"need --steps and --grad-accum >= 1, got {args.steps}, {args.grad_accum}")

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % args.sp or not 1 <= args.sp <= 4:
        # At most 4: each replica's slice of an 8-token text-only sample keeps a target (no NaN).
        parser.error(f"--sp must divide the {world} ranks and be 1 to 4, got {args.sp}")
    # DP x SP: SP groups are contiguous ranks; every rank creates every group, in the same order.
    dp_rank, sp_rank = divmod(rank, args.sp)
    sp_group = None  # each rank holds its own batch
    if args.sp > 1:
        sp_starts = range(0, world, args.sp)
        sp_group = [dist.new_group(list(range(s, s + args.sp))) for s in sp_starts][dp_rank]

    # --use-vit-dp-balance: the balanced copy only, as a training script would; else both. The
    # balanced copy reads the --dp-balance-* flags either way.
    compare = not args.use_vit_dp_balance
    if compare and args.wrap == "fsdp2" and not UNUSED_GRADIENTS_REDUCED:
        compare = False
        if rank == 0:
            print(
                "no unbalanced FSDP2 baseline: this torch's FSDP2 cannot reduce-scatter zeros "
                "for a text-only rank's unused tower parameters (set_reduce_scatter_unused_params)"
                "; training the balanced copy alone"
            )
    args.use_vit_dp_balance = True
    runs = [make_run(args, device, fx_vitbal.BalanceConfig.from_args(args), sp_group)]
    if compare:
        runs.insert(0, make_run(args, device, None, sp_group))
    vision = build_config().vision_config
    width = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    stats: list[fx_vitbal.BalanceStats] = []
    fx_vitbal.add_stats_callback(stats.append)  # every balanced call, on every rank
    held_rows = 0
    for step in range(1, args.steps + 1):
        micro_batches = []
        for micro in range(args.grad_accum):
            grids = sample_grids(dp_rank, step, micro)
            batch = make_batch(grids, dp_rank, step, micro, width)
            held_rows += sum(t * h * w for t, h, w in grids[0] + grids[1])
            if args.sp > 1:
                batch["labels"] = keep_slice(batch["labels"], sp_rank, args.sp)
            micro_batches.append((grids, {k: v.to(device) for k, v in batch.items()}))
        calls = len(stats)
        for run in runs:
            train_step(run, micro_batches, args.wrap, width, world)
        if rank == 0:
            print_step(step, runs, stats[calls:])
            sys.stdout.flush()
    if rank == 0:
        print_summary(runs, stats)
    if args.sp > 1:
        report_rows(runs, held_rows, args.sp, rank, world)
    dist.barrier()  # no rank tears its connections down while another still uses them
    # Drop the wrapped models before the process group. gloo's group is only torn down when its
    # last reference goes, and its destructor joins gloo's worker threads. A worker that has just
    # finished a collective may still hold that work; releasing it drops Python objects (its
    # tensors), which takes the GIL. Left to the end of main, the last reference is DDP's
    # reducer, whose destructor holds the GIL: the join and the worker then wait for each other
    # forever, and the rank (and torchrun) never exits. With the models gone first, the last
    # reference is dropped in destroy_process_group, which releases the GIL for the teardown.
    # Under FSDP2, torch's DTensors keep the group alive until the process exits, so gloo's
    # worker threads outlive main; one that takes the GIL while Python finalizes is killed inside
    # a destructor ("terminate called without an active exception"). Hence the exit below,
    # which skips finalization once every output is flushed.
    del runs, sp_group
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
