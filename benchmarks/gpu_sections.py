"""The GPU check's sections on several ranks (``benchmarks/gpu_check.py`` runs each in a child
process): eager paths and edge cases, compiled paths, CUDA graphs.

The ranks are threads of one process on torch's threaded test process group
(``multi_threaded_pg``, backend ``threaded``, cpu + cuda): NCCL refuses two ranks on one GPU and
gloo has no CUDA ``all_to_all``. Real device tensors go through every op; the collectives are
Python copies made by one rank's thread, so these sections prove correctness, not speed. Each
path runs on a fresh group, so a path that fails (or leaves the group's abort flag set) does not
fail the next one.

What each path asserts, against the same model run unbalanced on each rank:
- outputs equal on every rank, and gradients equal once all-reduced (a rank's own gradients
  come from the images it computed, so only the data-parallel sum is the unbalanced one's),
  within a stated tolerance on ``max |got - want| / max |want|``, printed;
- units really moved (a passthrough also matches), counted per path from the exchanges;
- on CUDA, the library's host syncs per step: synchronizing calls from its own lines
  (``torch.cuda.set_sync_debug_mode("warn")``) and event waits (``runtime.transfer.wait``).
"""

import copy
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
from fx_vitbal.passes import apply_vit_balance_pass, symbolic_trace
from fx_vitbal.passes.backend import vitbal_backend
from fx_vitbal.runtime import ops, transfer
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
    the library blocks on an event, where it has it). On the CPU nothing waits for a device."""

    def __init__(self, device: torch.device) -> None:
        self.counted = device.type == "cuda"
        self.waits_counted = self.counted and hasattr(transfer, "wait")
        self._syncs: dict[int, list[str]] = defaultdict(list)
        self._waits: Counter = Counter()
        self._lock = threading.Lock()
        if not self.counted:
            return
        warnings.filterwarnings("always", message=".*synchroniz")  # every one, not once a line
        self._show = warnings.showwarning
        warnings.showwarning = self._warning
        torch.cuda.set_sync_debug_mode("warn")
        if self.waits_counted:
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
        if not self.waits_counted:
            return syncs, "not counted (no transfer.wait in this library)"
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
    (compiled graphs call the ops' bodies too)."""

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

# ---- section 1: several ranks, eager ---------------------------------------------------------

# Rank 0 sheds units, rank 1 receives them, rank 2 has no image (it computes a dummy unit).
GRIDS = [[[1, 16, 12], [2, 4, 6]], [[1, 2, 2]], []]
MANY = [[[1, 2, 2]] * 36 + [[1, 16, 12]], [[1, 2, 2]], []]  # 37 grid rows: past the inline 32


@dataclasses.dataclass(frozen=True)
class Path:
    name: str
    how: str = "in_place"  # eager (dp_balance_vit_encoder) | in_place | fx | ahead
    grids: list = dataclasses.field(default_factory=lambda: GRIDS)
    bf16: bool = False  # bf16 pixels under autocast
    pixel_grads: bool = False
    syncs: int = 1  # library host syncs per steady step: the gathered metadata
    error: str = ""  # the same ValueError expected on every rank


RANK_PATHS = [
    Path("eager", how="eager"),
    Path("in_place"),
    Path("fx", how="fx"),
    Path("ahead", how="ahead", syncs=0),
    Path("bf16_autocast", bf16=True),
    Path("pixel_grads", pixel_grads=True),
    Path("many_images", grids=MANY, syncs=2),  # the grids' second gather is read too
    Path("bad_grid", error="rank 1: image_grid_thw row 0: h and w must be multiples"),
    Path(
        "not_as_planned",
        how="ahead",
        grids=[GRIDS[0], [[1, 2, 4]], []],  # rank 1's step gets [1, 4, 2]: same pixel rows
        error="planned ahead for it (fx_vitbal.plan_ahead) on rank(s) [1]",
    ),
]


def ranks_section(ctx: Context) -> None:
    """Three threaded ranks, each path on its own group; table + one row per path."""
    waits, moves = HostWaits(ctx.device), Moves()
    base = omni_model(ctx.device)
    steady = 2 if ctx.small else 3
    print(f"## Several ranks on one device: 3 threaded ranks ({ctx.device}), eager paths\n")
    print(f"{1 + steady} steps a path (the first agrees on the output layouts). Differences: max "
          "|got - want| / max |want| over ranks and steps. Host syncs: library lines, first "
          "step / steady steps, the set over ranks.\n")  # fmt: skip
    print("| path | outputs | grads (all-reduced) | pixel grads | tolerance | units sent "
          "| host syncs | event waits | result |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for path in RANK_PATHS:
        name = f"ranks/{path.name}"
        if ctx.expired():
            ctx.record(name, "SKIP", "section time limit")
            continue
        models = [balanced_and_reference(path.how, base) for _ in path.grids]
        try:
            run = functools.partial(
                rank_path, path, models, waits=waits, moves=moves, steady=steady
            )
            results = run_ranks(len(path.grids), run)
        except Exception as error:  # noqa: BLE001  (one path's failure; the next still runs)
            traceback.print_exc()
            print(f"| {path.name} | {'exception (traceback above) | ' * 7}**FAIL** |")
            ctx.record(name, "FAIL", f"raised {error_line(error)}")
            continue
        if path.error:
            same = len(set(results)) == 1 and results[0] is not None and path.error in results[0]
            note = f"every rank raised: {results[0]!r}"[:200] if same else f"got {results}"[:300]
            print(f"| {path.name} | {note} | | | | | | | {'PASS' if same else '**FAIL**'} |")
            summary = "the same ValueError on every rank" if same else f"got {results}"[:200]
            ctx.record(name, "PASS" if same else "FAIL", summary)
            continue
        tol = TOL.bf16 if path.bf16 else TOL.fp32
        diffs, close = diff_cells(results, tol)
        per_step = [[(s, w) for _, s, w in steps] for steps in results]
        syncs, event_waits = waits.describe(per_step)
        sent = moves.sent[path.name]
        ok = close and sent > 0 and waits.check(per_step, path.syncs)
        print(f"| {path.name} | {diffs} | {tol:g} | {sent} | {syncs} (expected {path.syncs}) | "
              f"{event_waits} | {'PASS' if ok else '**FAIL**'} |")  # fmt: skip
        note = f"match {close}, {sent} units sent, syncs {waits.check(per_step, path.syncs)}"
        ctx.record(name, "PASS" if ok else "FAIL", note)


def balanced_and_reference(how: str, base) -> tuple:
    """One rank's balanced model (the FX pass itself runs in the rank's thread: it reads the
    group) and its unbalanced copy."""
    balanced, reference = copy.deepcopy(base), copy.deepcopy(base)
    if how == "eager":
        return balanced.visual, reference.visual
    if how == "fx":
        return symbolic_trace(balanced), reference
    return fx_vitbal.enable_vit_balance(balanced), reference


def rank_path(path: Path, models, rank: int, *, waits: HostWaits, moves: Moves, steady: int):
    """One rank's steps of ``path``: per step ``(differences, library syncs, event waits)``,
    or for an error path the ``ValueError``'s message (None if none was raised)."""
    moves.path.name = path.name
    model, reference = models[rank]
    if path.how == "fx":
        with LOCK:
            model = apply_vit_balance_pass(model)
    device = next(reference.parameters()).device
    dtype = torch.bfloat16 if path.bf16 else torch.float32
    inputs = inputs_for(path.grids[rank], rank, device, dtype)
    kwargs = {"bf16": path.bf16, "pixel_grads": path.pixel_grads}
    if path.how == "eager":
        kwargs["vit_call"] = plain_vit
    if path.error:
        return rank_error(path, model, inputs, rank)
    want = train_step(reference, inputs, **kwargs)
    if path.how == "eager":
        kwargs["vit_call"] = fx_vitbal.dp_balance_vit_encoder
    steps = []
    for _ in range(1 + steady):
        if path.how == "ahead":
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=path.bf16):
                planned = fx_vitbal.plan_ahead(model, inputs[1], inputs[2], group=dist.group.WORLD)
            fx_vitbal.use_plan(model, planned)
        waits.take()
        got = train_step(model, inputs, **kwargs)
        syncs, event_waits = waits.take()
        steps.append((compare(got, want, reference), syncs, event_waits))
    return steps


def rank_error(path: Path, model, inputs, rank: int) -> str | None:
    """bad_grid: rank 1's grid ``[1, 1, 4]`` has h = 1, not a multiple of the merge size 2 (its
    pixel rows fit). not_as_planned: rank 1 plans ``[1, 2, 4]``, its step gets ``[1, 4, 2]``."""
    input_ids, pixels, grid = inputs
    step_grid = grid
    if rank == 1:
        bad = [[1, 1, 4]] if path.name == "bad_grid" else [[1, 4, 2]]
        step_grid = torch.tensor(bad, device=grid.device)
    try:
        if path.how == "ahead":
            planned = fx_vitbal.plan_ahead(model, pixels, grid, group=dist.group.WORLD)
            fx_vitbal.use_plan(model, planned)
        train_step(model, (input_ids, pixels, step_grid))
    except ValueError as error:
        return str(error)
    return None


# ---- section 2: compiled, and section 4: CUDA graphs ----------------------------------------

# Per step, per rank: every rank's image count changes (0 to 3), so a graph that specialized on
# them would recompile; steps 0 and 2 move units.
COMPILED_STEPS = [
    [[[1, 16, 12], [2, 4, 6]], [[1, 2, 2]], []],
    [[[1, 8, 8]], [[1, 12, 8], [1, 2, 4], [1, 2, 2]], [[1, 2, 2]]],
    [[[1, 16, 16], [1, 4, 4], [1, 2, 2]], [], [[1, 4, 4]]],
]


@dataclasses.dataclass(frozen=True)
class CompiledPath:
    name: str
    fx: bool  # the FX-pass graph (else the model balanced in place, then a plan made ahead)
    cudagraphs: bool = False  # compiled with CUDA graphs: each step marks its start


def compiled_section(ctx: Context) -> None:
    """The FX-pass graph and the in-place model, compiled ``fullgraph=True`` through the
    ``vitbal`` backend on the three threaded ranks."""
    paths = [CompiledPath("fx_fullgraph", fx=True), CompiledPath("wrapped_ahead", fx=False)]
    run_compiled(ctx, "compiled", paths, {"options": {"inner": ctx.inner}}, ctx.inner)


def cudagraphs_section(ctx: Context) -> None:
    """One ``mode="reduce-overhead"`` compile (CUDA graphs) of the in-place model: the ops must
    stay out of the graphs (``torch.Tag.cudagraph_unsafe``) and the steps exact."""
    if ctx.device.type != "cuda":
        print("## CUDA graphs (mode=\"reduce-overhead\")\n\nSkipped: CUDA graphs need a CUDA "
              "device.\n")  # fmt: skip
        ctx.record("cudagraphs/reduce_overhead", "SKIP", "CUDA graphs need a CUDA device")
        return
    path = CompiledPath("reduce_overhead", fx=False, cudagraphs=True)
    status = run_compiled(ctx, "cudagraphs", [path], {"mode": "reduce-overhead"}, "inductor")
    if "unexpected keyword argument" in status[path.name]:
        # The backend could not take the mode (it handed it to inductor's compile_fx): still
        # check the ops under CUDA graphs, with inductor's own switch for them.
        print("The backend refused mode=\"reduce-overhead\"; again with inductor's "
              "triton.cudagraphs = True:\n")  # fmt: skip
        torch._inductor.config.triton.cudagraphs = True
        path = CompiledPath("triton_cudagraphs", fx=False, cudagraphs=True)
        run_compiled(ctx, "cudagraphs", [path], {"options": {"inner": "inductor"}}, "inductor")
    skips = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
    print(f"Graphs CUDA graphs skipped (inductor's cudagraph_skips counter): {skips}.\n")


def run_compiled(ctx: Context, section: str, paths, compile_kwargs: dict, compiler: str) -> dict:
    """Each path on three threaded ranks, its table row and summary row; returns each path's
    note (its exception's last line when it raised)."""
    torch._dynamo.config.capture_dynamic_output_shape_ops = True  # fullgraph implies it >= 2.10
    waits, moves = HostWaits(ctx.device), Moves()
    base = omni_model(ctx.device)
    backend, status = vitbal_registered(), {}
    print(f"## Compiled on 3 threaded ranks ({ctx.device}): backend=\"vitbal\" ({compiler}), "
          f"fullgraph, {compile_kwargs}\n")  # fmt: skip
    print("Steps with 2/1/0, 1/3/1 and 3/0/1 images on ranks 0/1/2 (batch dims unbacked): one "
          "graph per rank must serve them all (the ranks are threads sharing dynamo's cache, "
          "one entry per rank). The in-place model then takes a plan made ahead for step 0's "
          "batch. Host syncs: first step / later steps (the planned step: its own "
          "column).\n")  # fmt: skip
    print("| path | outputs | grads (all-reduced) | pixel grads | tolerance | units sent | graphs "
          "after step 0 / at the end | step seconds (rank 0) | host syncs | event waits | "
          "planned step: applied, syncs | result |\n|---|---|---|---|---|---|---|---|---|---|---|"
          "---|")  # fmt: skip
    for path in paths:
        name = f"{section}/{path.name}"
        if ctx.expired():
            ctx.record(name, "SKIP", "section time limit")
            continue
        torch._dynamo.utils.counters.clear()
        models = [balanced_and_reference("fx" if path.fx else "in_place", base) for _ in range(3)]
        graphs = {}

        kwargs = {"waits": waits, "moves": moves, "graphs": graphs, "backend": backend}
        run = functools.partial(
            compiled_rank, path, models, compile_kwargs=compile_kwargs, **kwargs
        )
        try:
            results = run_ranks(3, run)
        except Exception as error:  # noqa: BLE001
            traceback.print_exc()
            print(f"| {path.name} | {'exception (traceback above) | ' * 10}**FAIL** |")
            status[path.name] = str(error)
            ctx.record(name, "FAIL", f"raised {error_line(error)}")
            continue
        diffs, close = diff_cells([r["steps"] for r in results], TOL.compiled)
        per_step = [[(s, w) for _, s, w in r["steps"]] for r in results]
        syncs, event_waits = waits.describe(per_step)
        one_graph = graphs["first"] == graphs["end"] == 3
        sent = moves.sent[path.name]
        ok = close and one_graph and sent > 0 and waits.check(per_step, 1)
        planned = "n/a"
        if not path.fx:
            applied = all(r["planned"][1] for r in results)
            planned_diffs, planned_close = diff_cells(
                [[r["planned"][0]] for r in results], TOL.compiled
            )
            planned_syncs = sorted({len(r["planned"][0][1]) for r in results})
            syncs_ok = not waits.counted or planned_syncs == [0]
            shown = planned_syncs if waits.counted else "not counted on CPU"
            planned = f"{applied}, {shown}; {planned_diffs}"
            ok = ok and applied and planned_close and syncs_ok
        seconds = ", ".join(f"{s:.1f}" for s in results[0]["seconds"])
        print(f"| {path.name} | {diffs} | {TOL.compiled:g} | {sent} | {graphs['first']} / "
              f"{graphs['end']} | {seconds} | {syncs} | {event_waits} | {planned} | "
              f"{'PASS' if ok else '**FAIL**'} |")  # fmt: skip
        status[path.name] = f"match {close}, one graph a rank {one_graph}, {sent} units sent"
        ctx.record(name, "PASS" if ok else "FAIL", status[path.name])
    print()
    return status


def compiled_rank(path, models, rank, *, waits, moves, graphs, backend, compile_kwargs) -> dict:
    """One rank's compiled steps (and, for the in-place model, a planned step)."""
    moves.path.name = path.name
    model, reference = models[rank]
    if path.fx:
        with LOCK:
            model = apply_vit_balance_pass(model)
    run = torch.compile(model, backend=backend, fullgraph=True, **compile_kwargs)
    device = next(reference.parameters()).device
    steps, seconds = [], []
    for i, step_grids in enumerate(COMPILED_STEPS):
        inputs = inputs_for(step_grids[rank], 10 * i + rank, device)
        want = train_step(reference, inputs)
        torch._dynamo.decorators.mark_unbacked(inputs[1], 0)
        torch._dynamo.decorators.mark_unbacked(inputs[2], 0)
        torch._dynamo.mark_dynamic(inputs[0], 0)
        if path.cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        waits.take()
        start = time.perf_counter()
        got = train_step(run, inputs)
        seconds.append(time.perf_counter() - start)
        syncs, event_waits = waits.take()
        steps.append((compare(got, want, reference), syncs, event_waits))
        if i in (0, len(COMPILED_STEPS) - 1):  # every rank has compiled (or not): count
            dist.barrier()
            if rank == 0:
                graphs["first" if i == 0 else "end"] = torch._dynamo.utils.counters["stats"][
                    "unique_graphs"
                ]
    planned = None
    if not path.fx:  # a plan made ahead, taken inside the same compiled graph
        inputs = inputs_for(COMPILED_STEPS[0][rank], rank, device)
        want = train_step(reference, inputs)
        ahead = fx_vitbal.plan_ahead(run, inputs[1], inputs[2], group=dist.group.WORLD)
        fx_vitbal.use_plan(run, ahead)
        waits.take()
        got = train_step(run, inputs)
        syncs, event_waits = waits.take()
        planned = ((compare(got, want, reference), syncs, event_waits), ahead.plan.applied)
        dist.barrier()
        if rank == 0:
            graphs["end"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return {"steps": steps, "seconds": seconds, "planned": planned}


SECTIONS = {"ranks": ranks_section, "compiled": compiled_section, "cudagraphs": cudagraphs_section}
