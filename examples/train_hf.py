"""Train a small Hugging Face Qwen2-VL (built from a config, no download) under torchrun, with
DDP or FSDP2, gradient accumulation and the ``--use-vit-dp-balance`` flags.

The workload is skewed on purpose: rank 0 holds a large image and a video every step, odd ranks are
text-only every other step, the rest hold thumbnails. Rank 0 prints the loss of every step
(the mean over ranks and micro-batches), so runs with and without balancing can be compared.

    torchrun --standalone --nproc-per-node 4 examples/train_hf.py --use-vit-dp-balance
    torchrun --standalone --nproc-per-node 2 examples/train_hf.py --wrap fsdp2 --grad-accum 2 \\
        --use-vit-dp-balance --dp-balance-verbose
    torchrun --standalone --nproc-per-node 4 examples/train_hf.py --sp 2 --use-vit-dp-balance

``--sp N`` lays the ranks out as DP x SP (world = dp * N): the N contiguous ranks of an SP group
(``rank // N``) hold the same batch, sampled by their DP index as "rank" above, and each keeps
only its slice of the sequence for the loss (replica ``k`` of ``N``: labels ``[k*L/N,
(k+1)*L/N)``, the rest -100), as under Ulysses / context parallelism, so the replicas' gradients
differ. The SP group goes to ``enable_vit_balance`` as ``replica_group``: each image is computed
once in the whole world and its outputs come back to every replica. The LM itself is *not*
sequence-parallel here (no Ulysses all-to-all in attention: every replica runs the whole
sequence); the example shows what fx_vitbal needs, the groups, the identical batches and the
per-replica loss slice. Gradients are synchronised over the whole world, as without ``--sp``.
Rank 0 also prints, at the end, the vision rows each rank's tower computed against the rows the
SP groups' batches hold (without balancing, each replica computes its group's rows itself).

gloo on CPU, NCCL on the GPU ``LOCAL_RANK`` when CUDA is available.
"""

import argparse
import contextlib
import os
import random
import sys

import torch
import torch.distributed as dist
import transformers
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import fx_vitbal

# Qwen2-VL's token ids in the tiny config below.
IMAGE, VIDEO, VISION_START, VISION_END = 120, 121, 122, 123
TEXT_VOCAB = 100  # text tokens are drawn below the special ids


def build_model(device: torch.device) -> transformers.Qwen2VLForConditionalGeneration:
    """A tiny random Qwen2-VL; the same weights on every rank (seeded)."""
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
        ),
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.Qwen2VLForConditionalGeneration(config).to(device).train()


def sample_grids(rank: int, step: int, micro: int) -> tuple[list, list]:
    """``(image grids, video grids)`` in patches for one micro-batch of one rank (skewed)."""
    rng = random.Random(f"{rank}-{step}-{micro}")
    if rank == 0:  # a document-sized image and a short video
        return [[1, 2 * rng.randint(6, 10), 2 * rng.randint(6, 10)]], [[2, 4, 6]]
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
    """DDP, or FSDP2 on every ViT block, every LM layer and the whole model."""
    if how == "ddp":
        # Unbalanced, text-only ranks never call the vision tower: its parameters go unused there.
        return DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            find_unused_parameters=not balanced,
        )
    for block in model.model.visual.blocks:
        fully_shard(block)
    for layer in model.model.language_model.layers:
        fully_shard(layer)
    return fully_shard(model)


def sync_gradients(model: torch.nn.Module, how: str, last: bool):
    """Reduce gradients on the last micro-batch only (DDP: ``no_sync``; FSDP2: its switch)."""
    if how == "ddp":
        return contextlib.nullcontext() if last else model.no_sync()
    model.set_requires_gradient_sync(last)
    return contextlib.nullcontext()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wrap", choices=("ddp", "fsdp2"), default="ddp")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--sp", type=int, default=1, help="ranks per SP group (same batch)")
    args = fx_vitbal.add_vit_balance_args(parser).parse_args()
    if args.wrap == "fsdp2" and not args.use_vit_dp_balance:
        # Unbalanced, text-only ranks never call the tower, so they skip FSDP2's collectives for
        # its parameters while the other ranks wait in them (gloo: "Connection reset by peer").
        # Balanced, every rank calls the tower every step.
        parser.error("--wrap fsdp2 needs --use-vit-dp-balance here (some ranks are text-only)")

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

    model = build_model(device)
    vision = model.model.visual.config
    width = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    computed_rows, held_rows = count_rows(model.model.visual), 0
    model = wrap(model, args.wrap, device, args.use_vit_dp_balance)
    # After wrapping: the tower is found through DDP, and FSDP2 keeps the module tree. The group
    # is the whole world (DP x SP); the SP group holds this rank's batch.
    fx_vitbal.enable_vit_balance(
        model,
        config=fx_vitbal.BalanceConfig.from_args(args),
        group=dist.group.WORLD,
        replica_group=sp_group,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    for step in range(args.steps):
        total = torch.zeros((), device=device)
        for micro in range(args.grad_accum):
            grids = sample_grids(dp_rank, step, micro)
            batch = make_batch(grids, dp_rank, step, micro, width)
            held_rows += sum(t * h * w for t, h, w in grids[0] + grids[1])
            if args.sp > 1:
                batch["labels"] = keep_slice(batch["labels"], sp_rank, args.sp)
            batch = {k: v.to(device) for k, v in batch.items()}
            with sync_gradients(model, args.wrap, last=micro == args.grad_accum - 1):
                loss = model(**batch).loss / args.grad_accum
                loss.backward()
            total += loss.detach()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(total)  # gloo has no AVG
        if rank == 0:
            print(f"step {step} loss {total.item() / world:.6f}", flush=True)
    if args.sp > 1:
        rows = torch.tensor([sum(computed_rows), held_rows], device=device)
        every = [torch.empty_like(rows) for _ in range(world)]
        dist.all_gather(every, rows)
        computed = [int(r[0]) for r in every]
        held = [int(r[1]) for r in every[:: args.sp]]  # one replica per SP group
        if rank == 0:
            print(
                f"vision rows computed per rank {computed} = {sum(computed)}; "
                f"the SP groups' batches hold {held} = {sum(held)}",
                flush=True,
            )
    dist.barrier()  # no rank tears its connections down while another still uses them
    # Drop the wrapped model before the process group. gloo's group is only torn down when its
    # last reference goes, and its destructor joins gloo's worker threads. A worker that has just
    # finished a collective may still hold that work; releasing it drops Python objects (its
    # tensors), which takes the GIL. Left to the end of main, the last reference is DDP's
    # reducer, whose destructor holds the GIL: the join and the worker then wait for each other
    # forever, and the rank (and torchrun) never exits. With the model gone first, the last
    # reference is dropped in destroy_process_group, which releases the GIL for the teardown.
    # Under FSDP2, torch's DTensors keep the group alive until the process exits, so gloo's
    # worker threads outlive main; one that takes the GIL while Python finalizes is killed inside
    # a destructor ("terminate called without an active exception"). Hence the exit below,
    # which skips finalization once every output is flushed.
    del model, optimizer, sp_group
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
