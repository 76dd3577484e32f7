"""Run a function on N gloo ranks in new processes (FileStore rendezvous, no ports)."""

import contextlib
import datetime
import json
import multiprocessing
import os
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)

# Ranks fork from a server process that imported these once (ImportErrors skipped), instead of
# each spawned rank importing torch, the package and dynamo again: about 8 s per 2-rank world
# and 13 s per 3-rank world on 2 busy cores, 0.2 - 0.6 s forked. Every world still starts from
# the same fresh state: the server only imports, it never runs a collective, compiles or
# starts threads of its own (numpy's BLAS pool is fork-safe), and each rank is a new process.
_PRELOAD = [
    "dist_utils",
    "fx_vitbal",
    "fx_vitbal.tools.omni",
    "torch._dynamo",
    "torch._functorch.aot_autograd",
    "torch._inductor.compile_fx",
    "transformers",
]
multiprocessing.get_context("forkserver").set_forkserver_preload(_PRELOAD)


TORCH_VERSION = tuple(int(part) for part in torch.__version__.split(".")[:2])
UNBACKED_BATCH_SIZES = TORCH_VERSION >= (2, 11)
"""Whether one compiled graph can serve every image count (``mark_unbacked`` batch dims) for the
test models, balanced or not. On torch 2.8, dynamo cannot trace the seed-style test ViT with
unbacked rows even unbalanced (``Eq(64*((u0//4)), 0)`` in its indexing), and inductor's CPU
lowering of the reference model guards on ``Eq((u3//4), 1)``; 2.11 and newer trace both
(2.9 and 2.10 untested). Tests there compile per size instead."""


CHECKPOINT_CLOSES_ON_ERROR = TORCH_VERSION >= (2, 13)
"""Whether ``torch.utils.checkpoint(use_reentrant=False)`` takes its saved-tensor hooks off when
the checkpointed function raises. Before 2.13 it does not (``ret = function(*args, **kwargs)``
outside any ``try``; 2.13 adds ``gen.throw``): the hooks stay installed while anything still
references the failed call's frames, and they then pack the next step's tensors, whose backward
re-runs the failed forward, collectives included. Torch 2.8's dynamo can keep those frames alive
after compiling the call (seen in ``test_fault.py``: a rank recomputing a failed compiled step in
the next step's backward, the others waiting). Tests on older torch do not checkpoint a call
that is meant to raise."""


def fullgraph_capture(enabled: bool = True):
    """The dynamo setting under which ``fullgraph=True`` captures the ops' data-dependent sizes
    on every supported torch: ``fullgraph=True`` implies it from torch 2.10 on; 2.8 and 2.9 need it
    set. Read when a frame is traced, so it wraps the calls, not ``torch.compile``."""
    if not enabled:
        return contextlib.nullcontext()
    return torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True)


def run_ranks(fn, world_size: int, *args, timeout: float = 240.0) -> list:
    """Call ``fn(rank, world_size, *args)`` on every rank; return each rank's return value.

    A failure on any rank raises ``RankFailed`` here with the traceback of the rank that failed
    first (by the time each rank's ``fn`` raised), then one line for each other rank: the rank
    whose error started it, not a survivor's gloo error ("Connection closed by peer", a timeout)
    that followed, whichever process exited first. A hang past ``timeout`` kills the ranks and
    fails (with any failure a rank recorded before).
    """
    with tempfile.TemporaryDirectory() as tmp:
        context = mp.start_processes(
            _worker,
            args=(fn, world_size, tmp, args, dict(os.environ)),
            nprocs=world_size,
            join=False,
            start_method="forkserver",
        )
        deadline = time.monotonic() + timeout
        paths = [os.path.join(tmp, f"result{r}.pt") for r in range(world_size)]
        try:
            while not context.join(timeout=1.0):
                if time.monotonic() > deadline:
                    for process in context.processes:
                        process.kill()
                    for process in context.processes:
                        process.join()
                    failures = _read_failures(tmp, context.processes)
                    raise TimeoutError(
                        f"{world_size} ranks did not finish within {timeout} s"
                        + (f"; {failures}" if failures else "")
                    )
        # join killed the other ranks: every record is in.
        except (mp.ProcessRaisedException, mp.ProcessExitedException):
            failures = _read_failures(tmp, context.processes)
            if not failures:
                raise  # no rank recorded an error (killed by a signal): torch's own report
            raise RankFailed(failures) from None  # torch's names the first rank to exit
        return [torch.load(path) for path in paths]


class RankFailed(Exception):
    """Some rank of ``run_ranks`` raised; the message is the first failing rank's traceback."""


def _failure_path(tmp: str, rank: int) -> str:
    return os.path.join(tmp, f"failure{rank}.json")


def _record_failure(tmp: str, rank: int, error: BaseException) -> None:
    """Write ``error``'s traceback and the time it reached ``_worker``, whole (written, synced,
    then renamed), before this rank tears its connections down: a peer that fails because of
    them fails later than this record says."""
    record = {
        "time": time.time(),
        "summary": traceback.format_exception_only(error)[-1].strip(),
        "traceback": traceback.format_exc(),
    }
    path = _failure_path(tmp, rank)
    with open(path + ".part", "w") as file:
        json.dump(record, file)
        file.flush()
        os.fsync(file.fileno())
    os.replace(path + ".part", path)


def _read_failures(tmp: str, processes) -> str:
    """The first failing rank's traceback, then one line per other rank (its error, how much
    later, or how it ended without one); empty when no rank recorded a failure."""
    records = {}
    for rank in range(len(processes)):
        with contextlib.suppress(FileNotFoundError), open(_failure_path(tmp, rank)) as file:
            records[rank] = json.load(file)
    if not records:
        return ""
    first = min(records, key=lambda rank: records[rank]["time"])
    lines = [f"rank {first} failed first (of {len(processes)} ranks):", records[first]["traceback"]]
    for rank, process in enumerate(processes):
        if rank == first:
            continue
        if rank in records:
            later = records[rank]["time"] - records[first]["time"]
            lines.append(f"then rank {rank} (+{later:.2f} s): {records[rank]['summary']}")
        else:
            lines.append(f"then rank {rank}: no error of its own (exit code {process.exitcode})")
    return "\n".join(lines)


@contextlib.contextmanager
def record_moves():
    """Record, per exchange the ops run, which local units left or came home (``dest != rank``).

    Compiled graphs call the ops' Python implementations at run time too, so this proves real
    movement in eager and compiled runs alike (matching outputs alone would not: a passthrough
    also matches).
    """
    import fx_vitbal.runtime.transport.ops

    original = fx_vitbal.runtime.transport.ops.exchange
    moves = []

    def recording(xs, routing, shrink, reverse, group, *args):
        rank = dist.get_rank(group)
        moves.append(sum(d != rank for d in routing.dest))
        return original(xs, routing, shrink, reverse, group, *args)

    fx_vitbal.runtime.transport.ops.exchange = recording
    try:
        yield moves
    finally:
        fx_vitbal.runtime.transport.ops.exchange = original


def phase() -> str:
    """``backward`` inside the autograd engine, else ``forward``."""
    return "backward" if torch._C._current_graph_task_id() != -1 else "forward"


@contextlib.contextmanager
def record_collectives():
    """Record every collective the library issues (its ``fx_vitbal.runtime.transport.collectives``
    seam), as ``(phase, name, input elements of a gather or input rows of an exchange, output
    splits)``; phase is ``forward`` or ``backward`` (inside the autograd engine). A batch of
    point-to-point messages (a band exchange among a frame's ranks) is ``(phase, "p2p",
    messages, peers)``; a rank that posts none records nothing."""
    from fx_vitbal.runtime.transport import collectives

    original = (collectives.all_gather, collectives.all_to_all, collectives.send_receive)
    record = []

    def gather(output, input, group):
        record.append((phase(), "all_gather", input.numel(), None))
        original[0](output, input, group)

    def exchange(output, input, output_splits, input_splits, group):
        record.append((phase(), "all_to_all", input.shape[0], tuple(output_splits)))
        original[1](output, input, output_splits, input_splits, group)

    def send_receive(messages, group):
        if messages:
            peers = tuple(sorted({peer for _, _, peer, _ in messages}))
            record.append((phase(), "p2p", len(messages), peers))
        return original[2](messages, group)

    collectives.all_gather, collectives.all_to_all = gather, exchange
    collectives.send_receive = send_receive
    try:
        yield record
    finally:
        collectives.all_gather, collectives.all_to_all, collectives.send_receive = original


def assert_units_moved(results) -> None:
    """Every rank exchanged in lockstep, and some rank sent a unit away."""
    counts = [len(res["moves"]) for res in results]
    assert len(set(counts)) == 1 and counts[0] > 0, f"exchanges per rank: {counts}"
    assert any(sum(res["moves"]) for res in results), "no unit moved: a passthrough also matches"


def train_step(
    model, grids, rank: int, *, in_dim: int = 24, unbacked: bool = False, reduce_grads: bool = True
):
    """One step of the reference model on ``make_inputs(grids)``: ``(logits, all-reduced grads)``,
    or only the logits with ``reduce_grads=False`` (the gradients stay in ``.grad``).

    ``unbacked`` marks the batch dims so one compiled graph serves every image count.
    """
    from fx_vitbal.tools.omni import make_inputs

    input_ids, pixels, grid = make_inputs(grids, in_dim=in_dim, seed=rank)
    if unbacked:
        torch._dynamo.decorators.mark_unbacked(pixels, 0)
        torch._dynamo.decorators.mark_unbacked(grid, 0)
        torch._dynamo.mark_dynamic(input_ids, 0)
    logits = model(input_ids, pixels, grid)
    logits.pow(2).mean().backward()
    if not reduce_grads:
        return logits.detach()
    grads = torch.cat(  # frozen parameters have no gradient: zeros stand in
        [
            p.grad.flatten() if p.grad is not None else p.new_zeros(p.numel())
            for p in model.parameters()
        ]
    )
    dist.all_reduce(grads)
    model.zero_grad(set_to_none=True)
    return logits.detach(), grads


def _worker(rank, fn, world_size, tmp, args, environ):
    # The caller's environment as it is now, not the server's from when it started.
    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(tmp, "store"), world_size)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT
    )
    try:
        result = fn(rank, world_size, *args)
        path = os.path.join(tmp, f"result{rank}.pt")
        torch.save(result, path + ".part")
        os.replace(path + ".part", path)  # whole or absent, even if this rank dies right after
        dist.barrier()  # every rank saved before any rank tears its connections down
    except Exception as error:
        # Recorded before ``finally`` closes this rank's connections; then re-raised, so torch
        # writes its error file and the process exits non-zero (never reaching ``os._exit(0)``).
        _record_failure(tmp, rank, error)
        raise
    finally:
        dist.destroy_process_group()
    # No interpreter finalization: a group something still holds (FSDP2's DTensors do) keeps
    # gloo's worker threads alive, and one that takes the GIL while Python finalizes is killed
    # inside a destructor ("terminate called without an active exception", SIGABRT, seen about
    # 1 run in 8 of some tests). Everything this rank computed is saved and flushed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
