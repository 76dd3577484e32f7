"""An exception inside the ViT on one rank (gloo): that rank gets its own exception unchanged, no
collective is added for it, and the peers, waiting in the exchange after the ViT, fail within the
group's timeout instead of hanging. And ``run_ranks`` reports the rank that failed first."""

import datetime
import threading
import time
import traceback

import pytest
import torch
import torch.distributed as dist
from dist_utils import RankFailed, record_collectives, record_moves, run_ranks

import fx_vitbal
from fx_vitbal.tools.models import QwenStyleViT, ViTConfig
from fx_vitbal.tools.omni import make_inputs

TIMEOUT_S = 5.0
SKEWED = [[[1, 16, 12], [2, 4, 6]], [[1, 2, 2]]]  # the plan moves units from rank 0 to rank 1


class _RaisingViT(QwenStyleViT):
    """A tower with a bug on one rank: with ``fail`` set, it raises before computing anything."""

    fail = False
    raised: RuntimeError | None = None
    raised_at = 0.0

    def forward(self, pixel_values, image_grid_thw):
        if self.fail:
            self.raised, self.raised_at = RuntimeError("tower bug on rank 1"), time.time()
            raise self.raised  # the raising line
        return super().forward(pixel_values, image_grid_thw)


def _raise_in_the_vit(rank: int, world: int, path: str) -> dict:
    group = dist.new_group(timeout=datetime.timedelta(seconds=TIMEOUT_S))
    torch.manual_seed(0)
    vit = _RaisingViT(ViTConfig(deepstack_indexes=(0,)))
    _, pixels, grid = make_inputs(SKEWED[rank], in_dim=24, seed=rank)
    if path == "in_place":
        fx_vitbal.enable_vit_balance(vit, group=group, vit=vit)

    def call():
        if path == "in_place":
            return vit(pixels, grid)
        return fx_vitbal.dp_balance_vit_encoder(vit, pixels, grid, group=group)

    # A good step first: the group has agreed on its output layouts, so the failing step issues
    # a steady step's collectives (gather, exchange out, the ViT, exchange home).
    embeds, _, deepstack = call()
    (embeds.sum() + deepstack[0].sum()).backward()
    vit.fail = rank == 1
    caught = None
    with record_moves() as moves, record_collectives() as collectives:
        start = time.time()
        try:
            call()
        except Exception as error:
            caught = error
        failed = time.time()
    # Rank 1 stays alive (its process has not died: it caught the error) and touches the group no
    # more, so rank 0 is freed by the group's timeout alone, not by closed connections.
    dist.barrier()
    frames = traceback.extract_tb(caught.__traceback__) if caught is not None else []
    return {
        "type": type(caught).__name__,  # torch.load takes no classes
        "runtime_error": isinstance(caught, RuntimeError),
        "message": str(caught),
        "same_object": caught is not None and caught is vit.raised,
        "chained": caught is not None and (caught.__cause__, caught.__context__) != (None, None),
        "first_frame": frames[0].name if frames else None,
        "last_frame": (frames[-1].filename, frames[-1].name, frames[-1].line) if frames else None,
        "collectives": [name for _, name, _, _ in collectives],
        "moves": sum(moves),
        "raised_at": vit.raised_at,
        "waited": failed - start,
        "failed": failed,
    }


@pytest.mark.parametrize("path", ["eager", "in_place"])
def test_an_exception_in_the_vit_reaches_its_rank_unchanged_and_peers_fail_by_the_timeout(path):
    rank0, rank1 = run_ranks(_raise_in_the_vit, 2, path, timeout=120.0)
    assert rank0["moves"] + rank1["moves"] > 0, "the failing step moved no unit"
    # Rank 1: the very exception its tower raised, its traceback from the call to the raise.
    assert rank1["type"] == "RuntimeError" and rank1["message"] == "tower bug on rank 1"
    assert rank1["same_object"] and not rank1["chained"]
    assert rank1["first_frame"] == "_raise_in_the_vit"
    filename, name, line = rank1["last_frame"]
    assert filename == __file__ and name == "forward" and line.startswith("raise self.raised")
    # No collective added for the error: rank 1 stopped after the exchange out, rank 0 issued a
    # steady step's collectives and failed in the last one (the exchange home).
    assert rank1["collectives"] == ["all_gather", "all_to_all"]
    assert rank0["collectives"] == ["all_gather", "all_to_all", "all_to_all"]
    # Rank 0: gloo's timeout error, after the group's timeout and well before a hang.
    assert rank0["runtime_error"], rank0["type"]
    assert "timed out" in rank0["message"].lower(), rank0["message"]
    after_raise = rank0["failed"] - rank1["raised_at"]
    print(
        f"{path}: rank 0 failed {after_raise:.2f} s after rank 1 raised, its call took "
        f"{rank0['waited']:.2f} s: {rank0['type']}: {rank0['message'][:160]}"
    )
    assert rank0["waited"] >= 0.9 * TIMEOUT_S and after_raise < 3 * TIMEOUT_S + 20, rank0


def _rank_1_raises_rank_0_waits(rank: int, world: int) -> None:
    group = dist.new_group(timeout=datetime.timedelta(seconds=2 * TIMEOUT_S))
    if rank == 1:
        # A live thread (a data loader's, say) keeps this process from exiting for a while after
        # its error, so rank 0, failing on the closed connections, exits first: torch's join then
        # reports rank 0's gloo error, which is the one run_ranks must not show first.
        threading.Thread(target=time.sleep, args=(3.0,)).start()
        raise ValueError("rank 1's own error")
    dist.all_reduce(torch.zeros(1), group=group)


def test_run_ranks_shows_the_first_failing_ranks_own_traceback_first():
    with pytest.raises(RankFailed) as info:
        run_ranks(_rank_1_raises_rank_0_waits, 2, timeout=60.0)
    message = str(info.value)
    print(message)
    assert message.startswith("rank 1 failed first (of 2 ranks):\nTraceback")
    own = message.index("ValueError: rank 1's own error")
    assert 'raise ValueError("rank 1\'s own error")' in message[:own]
    assert "then rank 0 (+" in message[own:]  # rank 0's gloo error, listed after
    assert "rank 0" not in message[:own]
