"""The GPU check's harness for several ranks on one device: ranks as threads of torch's threaded
test process group, the library's host waits and moved units counted per rank, one training step
and its comparison with the unbalanced model.

NCCL refuses two ranks on one GPU and gloo has no CUDA ``all_to_all``, so the ranks are threads
of one process on ``multi_threaded_pg`` (backend ``threaded``, cpu + cuda). Real device tensors
go through every op; the collectives are Python copies that one rank's thread makes for all,
and the band exchanges' point-to-point messages (which that group cannot send) go through a
mailbox in place of the library's seam, so this proves correctness, not speed.
"""

import dataclasses
import functools
import os
import re
import threading
import time
import traceback
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable

import torch
import torch.distributed as dist

import fx_vitbal
from fx_vitbal.passes.backend import vitbal_backend
from fx_vitbal.runtime.transport import collectives, ops, transfer
from fx_vitbal.tools.models import ViTConfig
from fx_vitbal.tools.omni import LMConfig, OmniEncoderModel, make_inputs


@dataclasses.dataclass(frozen=True)
class Context:
    """What every section gets: the device, the run's size, and where its results go."""

    device: torch.device
    small: bool
    inner: str
    """The compiler under the ``vitbal`` backend: inductor on CUDA, aot_eager on the CPU."""
    deadline: float
    """``time.monotonic()`` after which a section adds no more work."""
    record: Callable[[str, str, str], None]
    """``record(name, status, note)``: one summary row (PASS, FAIL or SKIP)."""

    @classmethod
    def make(cls, args, record) -> "Context":
        cuda = torch.cuda.is_available()
        device = torch.device("cuda:0" if cuda else "cpu")
        if cuda:
            torch.cuda.set_device(device)
        torch.set_float32_matmul_precision("highest")  # no TF32: fp32 is compared to fp32
        inner = args.inner or ("inductor" if cuda and not args.small else "aot_eager")
        deadline = time.monotonic() + 0.85 * args.limit_s  # what is left: the stack dump's
        return cls(device, args.small, inner, deadline, record)

    def expired(self) -> bool:
        return time.monotonic() > self.deadline


# ---- ranks as threads ----------------------------------------------------------------------


class _Mailbox:
    """Point-to-point messages between ranks that are threads of one threaded process group,
    which has no send or receive: in place of ``collectives.send_receive`` (the library's seam
    for the band exchanges among a frame's ranks), a send leaves a copy in its peer's box
    (first in, first out per sender, receiver and tag) and a receive's ``wait`` takes it."""

    def __init__(self) -> None:
        self.boxes: defaultdict = defaultdict(list)
        self.arrived = threading.Condition()

    def send_receive(self, messages, group) -> list:
        rank = dist.get_rank(group)
        works = []
        with self.arrived:
            for send, tensor, peer, tag in messages:
                if send:
                    self.boxes[(group.group_name, rank, peer, tag)].append(tensor.clone())
                else:
                    works.append(_Receipt(self, (group.group_name, peer, rank, tag), tensor))
            self.arrived.notify_all()
        return works


@dataclasses.dataclass
class _Receipt:
    mailbox: _Mailbox
    key: tuple
    into: torch.Tensor

    def wait(self) -> None:
        with self.mailbox.arrived:
            self.mailbox.arrived.wait_for(lambda: self.mailbox.boxes[self.key])
            self.into.copy_(self.mailbox.boxes[self.key].pop(0))


def run_ranks(world: int, fn) -> list:
    """``fn(rank)`` on ``world`` threads, each a rank of a fresh threaded process group.

    Returns every rank's result, or raises with every failed rank's traceback. A rank that
    raises wakes the ranks waiting in a collective (they exit it). Daemon threads: a hung rank
    cannot keep the process alive past its section's limit (the watchdog dumps its stack).
    """
    from torch.testing._internal.distributed import multi_threaded_pg as threaded

    threaded._install_threaded_pg()  # also runs backward on the calling thread, not a pool's
    threaded.ProcessLocalGroup.reset()  # a failed path leaves the abort flag set
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    seam, collectives.send_receive = collectives.send_receive, _Mailbox().send_receive
    store = dist.HashStore()
    results, errors = [None] * world, []

    def worker(rank: int) -> None:
        dist.init_process_group("threaded", rank=rank, world_size=world, store=store)
        try:
            results[rank] = fn(rank)
        except BaseException as error:  # noqa: BLE001  (reported below, after every thread)
            errors.append(f"rank {rank}: {traceback.format_exc()}")
            threaded.ProcessLocalGroup.exception_handle(error)
        finally:
            dist.destroy_process_group()

    threads = [threading.Thread(target=worker, args=(r,), daemon=True) for r in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    torch._C._distributed_c10d._set_thread_isolation_mode(False)
    collectives.send_receive = seam
    threaded._uninstall_threaded_pg()
    if errors:
        raise RuntimeError("\n".join(sorted(errors)))
    return results


LIBRARY = os.path.dirname(fx_vitbal.__file__) + os.sep
REFERENCE_MODELS = os.path.join(LIBRARY, "tools") + os.sep  # the test towers: not the library


class HostWaits:
    """The library's host waits per rank thread, on CUDA: synchronizing calls made from its own
    lines (``set_sync_debug_mode("warn")`` warnings, attributed by file and line; the models'
    and this check's are not the library's) and event waits (``transfer.wait``, the one place
    the library blocks on an event). On the CPU nothing waits for a device. One
    per process (``counters``)."""

    def __init__(self, device: torch.device) -> None:
        self.counted = device.type == "cuda"
        self._syncs: dict[int, list[str]] = defaultdict(list)
        self._waits: Counter = Counter()
        self._lock = threading.Lock()
        if not self.counted:
            return
        warnings.filterwarnings("always", message=".*synchroniz")  # every one, not once a line
        self._show = warnings.showwarning
        warnings.showwarning = self._warning
        torch.cuda.set_sync_debug_mode("warn")
        wait = transfer.wait

        def counting_wait(*args, **kwargs):
            with self._lock:
                self._waits[threading.get_ident()] += 1
            return wait(*args, **kwargs)

        transfer.wait = counting_wait

    def _warning(self, message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" not in str(message):
            self._show(message, category, filename, lineno, file, line)
        elif filename.startswith(LIBRARY) and not filename.startswith(REFERENCE_MODELS):
            with self._lock:
                self._syncs[threading.get_ident()].append(f"{filename[len(LIBRARY) :]}:{lineno}")

    def take(self) -> tuple[list[str], int]:
        """This thread's library syncs (file:line each) and event waits since the last take."""
        with self._lock:
            ident = threading.get_ident()
            return self._syncs.pop(ident, []), self._waits.pop(ident, 0)

    def describe(self, per_step: list[list[tuple[list[str], int]]]) -> tuple[str, str]:
        """``(syncs, event waits)`` cells: first step / steady steps over the ranks."""
        if not self.counted:
            return "not counted on CPU", "not counted on CPU"
        first = sorted({len(steps[0][0]) for steps in per_step})
        steady = sorted({len(s) for steps in per_step for s, _ in steps[1:]})
        lines = sorted({line for steps in per_step for s, _ in steps for line in s})
        syncs = f"{first} / {steady}" + (f" ({', '.join(lines)})" if lines else "")
        waits = sorted({steps[0][1] for steps in per_step})
        return syncs, f"{waits} / {sorted({w for steps in per_step for _, w in steps[1:]})}"

    def check(self, per_step, expected: int) -> bool:
        """Every steady step made ``expected`` library syncs, the first at most one more (the
        output layouts' agreement)."""
        if not self.counted:
            return True
        steady = all(len(s) == expected for steps in per_step for s, _ in steps[1:])
        return steady and all(len(steps[0][0]) <= expected + 1 for steps in per_step)


class Moves:
    """Units each path sends to other ranks, once per plan, from the exchanges the ops run
    (compiled graphs call the ops' bodies too). One per process (``counters``)."""

    def __init__(self) -> None:
        self.sent: Counter = Counter()
        self.path = threading.local()  # each rank thread says which path it runs
        self._seen: set = set()
        self._lock = threading.Lock()
        original = ops.exchange

        def counting(xs, routing, shrink, reverse, group, *args):
            rank = dist.get_rank(group)
            with self._lock:
                if (rank, routing.step) not in self._seen:
                    self._seen.add((rank, routing.step))
                    self.sent[self.path.name] += sum(d != rank for d in routing.dest)
            return original(xs, routing, shrink, reverse, group, *args)

        ops.exchange = counting


@functools.cache
def counters(device: torch.device) -> tuple[HostWaits, Moves]:
    """The process's one ``HostWaits`` and ``Moves``: each wraps a library function, once."""
    return HostWaits(device), Moves()


def error_line(error: BaseException) -> str:
    """The last ``SomeError: message`` line of ``error``'s text (the ranks' tracebacks)."""
    lines = str(error).strip().splitlines() or [type(error).__name__]
    named = [line for line in lines if re.match(r"[\w.]*(Error|Exception|Failed)\b.*: ", line)]
    return (named or lines)[-1][:200]


def vitbal_registered() -> str:
    """``"vitbal"``, registered here when the package is not installed (no entry point)."""
    from torch._dynamo.backends.registry import list_backends, register_backend

    if "vitbal" not in list_backends(exclude_tags=()):
        register_backend(vitbal_backend, name="vitbal")
    return "vitbal"


# ---- one training step, compared --------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Tolerance:
    fp32: float = 1e-4  # eager, fp32: the ViT sees other batch shapes (other kernels)
    compiled: float = 1e-3  # the compiled tower fuses differently from the eager reference
    bf16: float = 3e-2  # bf16 rounds at 2**-8; the balanced batch changes kernel choices


TOL = Tolerance()


@dataclasses.dataclass
class Got:
    out: torch.Tensor
    grads: dict[str, torch.Tensor]
    pixel_grad: torch.Tensor | None


def train_step(model, inputs, *, vit_call=None, bf16=False, pixel_grads=False) -> Got:
    """Forward + backward of ``model`` on ``inputs``; ``vit_call(vit, pixels, grid)``: the
    model is a ViT, called this way (``dp_balance_vit_encoder`` or a plain call)."""
    input_ids, pixels, grid = inputs
    if pixel_grads:
        pixels = pixels.detach().clone().requires_grad_(True)
    with torch.autocast(pixels.device.type, dtype=torch.bfloat16, enabled=bf16):
        if vit_call is None:
            out = model(input_ids, pixels, grid)
        else:
            embeds, _, deepstack = vit_call(model, pixels, grid)
            out = torch.cat([embeds.unflatten(0, (-1, 4)).flatten(1), deepstack[0]], 1)
    (out.float().pow(2).sum() / max(out.numel(), 1)).backward()
    grads = {
        name.removeprefix("_orig_mod."): p.grad.clone()  # torch.compile's wrapper adds it
        for name, p in model.named_parameters()
        if p.grad is not None
    }
    model.zero_grad(set_to_none=True)
    pixel_grad = pixels.grad.clone() if pixel_grads else None
    return Got(out.detach().float().clone(), grads, pixel_grad)  # a CUDA graph reuses outputs


def rel_diff(got: torch.Tensor | None, want: torch.Tensor | None) -> float:
    if got is None or not got.numel():
        return 0.0
    if got.shape != want.shape:
        return float("inf")
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def compare(got: Got, want: Got, model) -> tuple[float, float, float]:
    """``(outputs, all-reduced gradients, pixel gradients)`` relative differences; a
    parameter with a gradient on one side only makes the gradients' difference infinite."""
    names = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    flat = [
        torch.cat([g.get(n, torch.zeros_like(p)).float().flatten() for n, p in names])
        for g in (got.grads, want.grads)
    ]
    both = torch.stack(flat)
    dist.all_reduce(both)  # every rank, always: the collective count never depends on data
    grads = rel_diff(both[0], both[1]) if got.grads.keys() == want.grads.keys() else float("inf")
    return rel_diff(got.out, want.out), grads, rel_diff(got.pixel_grad, want.pixel_grad)


def inputs_for(grid_rows, seed: int, device, dtype=torch.float32):
    input_ids, pixels, grid = make_inputs(grid_rows, in_dim=24, seed=seed)
    # clone: make_inputs' grid is a view, whose base dynamo would size-specialize
    return input_ids.to(device), pixels.to(device, dtype), grid.clone().to(device)


def omni_model(device) -> OmniEncoderModel:
    torch.manual_seed(0)
    return OmniEncoderModel(ViTConfig(deepstack_indexes=(0,)), LMConfig(num_layers=1)).to(device)


def plain_vit(vit, pixels, grid):
    return vit(pixels, grid)


def diff_cells(per_rank: list[list[tuple]], tol: float) -> tuple[str, bool]:
    """The largest differences over ranks and steps, and whether all are within ``tol``."""
    worst = [max(step[0][k] for steps in per_rank for step in steps) for k in range(3)]
    return " | ".join(f"{d:.1e}" for d in worst), all(d <= tol for d in worst)


LOCK = threading.Lock()  # model copies and FX passes touch global state: one rank at a time
