"""The GPU check's sections on several ranks (``benchmarks/gpu_check.py`` runs each in a child
process): eager paths and edge cases, compiled paths, CUDA graphs. The ranks are threads on one
device (``gpu_harness``); each path runs on a fresh group, so a path that fails (or leaves the
group's abort flag set) does not fail the next one.

What each path asserts, against the same model run unbalanced on each rank:
- outputs equal on every rank, and gradients equal once all-reduced (a rank's own gradients
  come from the images it computed, so only the data-parallel sum is the unbalanced one's),
  within a stated tolerance on ``max |got - want| / max |want|``, printed;
- units really moved (a passthrough also matches), counted per path from the exchanges;
- on CUDA, the library's host syncs per step: synchronizing calls from its own lines
  (``torch.cuda.set_sync_debug_mode("warn")``) and event waits
  (``runtime.transport.transfer.wait``).
"""

import copy
import dataclasses
import functools
import time
import traceback

import torch
import torch.distributed as dist
from gpu_harness import (
    LOCK,
    TOL,
    Context,
    HostWaits,
    Moves,
    compare,
    counters,
    diff_cells,
    error_line,
    inputs_for,
    omni_model,
    plain_vit,
    run_ranks,
    train_step,
    vitbal_registered,
)

import fx_vitbal
from fx_vitbal.passes import apply_vit_balance_pass, symbolic_trace

# ---- section 1: several ranks, eager ---------------------------------------------------------

# Rank 0 sheds units, rank 1 receives them, rank 2 has no image (it computes a dummy unit).
GRIDS = [[[1, 16, 12], [2, 4, 6]], [[1, 2, 2]], []]
MANY = [[[1, 2, 2]] * 36 + [[1, 16, 12]], [[1, 2, 2]], []]  # 37 grid rows: past the inline 32
# One 32x32-patch frame binds the step: split into row bands on the three ranks (the l**2 model
# prices no exchange; the tiny tower's would cost more than its compute at GPU speeds).
BANDS = fx_vitbal.BalanceConfig(cost_model="quadratic", min_band_patches=64)
BAND_GRIDS = [[[1, 32, 32]], [[1, 4, 4]], []]


@dataclasses.dataclass(frozen=True)
class Path:
    name: str
    how: str = "in_place"  # eager (dp_balance_vit_encoder) | in_place | fx | ahead
    grids: list = dataclasses.field(default_factory=lambda: GRIDS)
    bf16: bool = False  # bf16 pixels under autocast
    pixel_grads: bool = False
    syncs: int = 1  # library host syncs per steady step: the gathered metadata
    error: str = ""  # the same ValueError expected on every rank
    sets: tuple = ()  # replica sets (``replica_group``): a set's ranks hold its batch
    config: fx_vitbal.BalanceConfig | None = None  # BANDS: a frame must be split every step


RANK_PATHS = [
    Path("eager", how="eager"),
    Path("in_place"),
    Path("fx", how="fx"),
    Path("ahead", how="ahead", syncs=0),
    Path("bf16_autocast", bf16=True),
    Path("pixel_grads", pixel_grads=True),
    Path("many_images", grids=MANY, syncs=2),  # the grids' second gather is read too
    # 2 replica sets of 2: set 0 holds rank 0's skewed batch, set 1 (ranks 2, 3) none.
    Path("replica_sets", grids=[GRIDS[0], GRIDS[0], [], []], sets=((0, 1), (2, 3))),
    Path("bands", grids=BAND_GRIDS, config=BANDS),  # keys and values exchanged in every layer
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
    waits, moves = counters(ctx.device)
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
        models = [balanced_and_reference(path.how, base, path.config) for _ in path.grids]
        splits = SplitUnits()
        try:
            run = functools.partial(
                rank_path, path, models, waits=waits, moves=moves, steady=steady
            )
            with splits:
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
        split = splits.every_step(path.config)
        ok = close and sent > 0 and waits.check(per_step, path.syncs) and split
        result = "PASS" if ok else "**FAIL**"
        print(f"| {path.name} | {diffs} | {tol:g} | {sent}{splits.cell(path.config)} | {syncs} "
              f"(expected {path.syncs}) | {event_waits} | {result} |")  # fmt: skip
        note = f"match {close}, {sent} units sent, syncs {waits.check(per_step, path.syncs)}"
        note += f", split every step {split}" if path.config else ""
        ctx.record(name, "PASS" if ok else "FAIL", note)
    print()


def balanced_and_reference(how: str, base, config=None) -> tuple:
    """One rank's balanced model (the FX pass itself runs in the rank's thread: it reads the
    group; ``config`` goes to the in-place model) and its unbalanced copy."""
    balanced, reference = copy.deepcopy(base), copy.deepcopy(base)
    if how == "eager":
        return balanced.visual, reference.visual
    if how == "fx":
        return symbolic_trace(balanced), reference
    return fx_vitbal.enable_vit_balance(balanced, config=config), reference


class SplitUnits:
    """Within ``with``: every balanced call's ``BalanceStats.split_units`` (the ranks are
    threads: one callback hears them all), to tell a path meant to split whether it did."""

    def __enter__(self):
        self.counts = []
        self._handle = fx_vitbal.add_stats_callback(lambda s: self.counts.append(s.split_units))
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()

    def every_step(self, config) -> bool:
        """True for a path not meant to split; else whether every call split a frame."""
        return config is None or (bool(self.counts) and min(self.counts) > 0)

    def cell(self, config) -> str:
        return "" if config is None else f" (bands per call: {sorted(set(self.counts))})"


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
    replicas = next((list(s) for s in path.sets if rank in s), None)
    seed = rank if replicas is None else replicas[0]  # a set's ranks hold the same pixels
    if replicas is not None:
        fx_vitbal.enable_vit_balance(model, replica_group=replicas)
    inputs = inputs_for(path.grids[rank], seed, device, dtype)
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


# A step that splits the big frame (the reference tower takes the tensor form of the bands in
# the graph), then steps that split nothing: one graph must serve them all.
BAND_STEPS = [BAND_GRIDS, COMPILED_STEPS[1], BAND_GRIDS]


@dataclasses.dataclass(frozen=True)
class CompiledPath:
    name: str
    fx: bool  # the FX-pass graph (else the model balanced in place, then a plan made ahead)
    cudagraphs: bool = False  # compiled with CUDA graphs: each step marks its start
    config: fx_vitbal.BalanceConfig | None = None  # BANDS: in-place model, BAND_STEPS


def compiled_section(ctx: Context) -> None:
    """The FX-pass graph and the in-place model, compiled ``fullgraph=True`` through the
    ``vitbal`` backend on the three threaded ranks."""
    paths = [
        CompiledPath("fx_fullgraph", fx=True),
        CompiledPath("wrapped_ahead", fx=False),
        CompiledPath("wrapped_bands", fx=False, config=BANDS),
    ]
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
    run_compiled(ctx, "cudagraphs", [path], {"mode": "reduce-overhead"}, "inductor")
    skips = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
    print(f"Graphs that CUDA graphs skipped (inductor's cudagraph_skips counter): {skips}.\n")


def run_compiled(ctx: Context, section: str, paths, compile_kwargs: dict, compiler: str) -> dict:
    """Each path on three threaded ranks, its table row and summary row; returns each path's
    note (its exception's text when it raised)."""
    torch._dynamo.config.capture_dynamic_output_shape_ops = True  # fullgraph implies it >= 2.10
    waits, moves = counters(ctx.device)
    base = omni_model(ctx.device)
    backend, status = vitbal_registered(), {}
    title = "Compiled" if section == "compiled" else "CUDA graphs"
    print(f"## {title} on 3 threaded ranks ({ctx.device}): backend=\"vitbal\" ({compiler}), "
          f"fullgraph, {compile_kwargs}\n")  # fmt: skip
    print("Steps with 2/1/0, 1/3/1 and 3/0/1 images on ranks 0/1/2 (batch dims unbacked): one "
          "graph per rank must serve them all (the ranks are threads sharing dynamo's cache, "
          "one entry per rank). The in-place model then takes a plan made ahead for step 0's "
          "batch. With CUDA graphs, step 0's batch runs twice more first (recorded, then "
          "replayed). Host syncs: first step / later steps (the planned step: its own "
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
        how = "fx" if path.fx else "in_place"
        models = [balanced_and_reference(how, base, path.config) for _ in range(3)]
        graphs, splits = {}, SplitUnits()

        kwargs = {"waits": waits, "moves": moves, "graphs": graphs, "backend": backend}
        run = functools.partial(
            compiled_rank, path, models, compile_kwargs=compile_kwargs, **kwargs
        )
        try:
            with splits:
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
        # Bands: the band steps split (each call's plan reports it), the others not.
        split = path.config is None or splits.counts.count(0) < len(splits.counts)
        ok = close and one_graph and sent > 0 and waits.check(per_step, 1) and split
        planned = "n/a"
        if not path.fx:
            applied = all(r["planned"][1] for r in results)
            planned_diffs = [r["planned"][0][0] for r in results]
            worst = max(max(d) for d in planned_diffs)
            planned_close = worst <= TOL.compiled
            planned_syncs = sorted({len(r["planned"][0][1]) for r in results})
            syncs_ok = not waits.counted or planned_syncs == [0]
            shown = planned_syncs if waits.counted else "not counted on CPU"
            planned = f"{applied}, {shown}, max diff {worst:.1e}"
            ok = ok and applied and planned_close and syncs_ok
        seconds = ", ".join(f"{s:.1f}" for s in results[0]["seconds"])
        print(f"| {path.name} | {diffs} | {TOL.compiled:g} | {sent}{splits.cell(path.config)} | "
              f"{graphs['first']} / "
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
    # CUDA graphs warm up on a batch size's first run, record on its second and replay from its
    # third: step 0's batch comes back twice (and once more, planned ahead).
    first = BAND_STEPS if path.config else COMPILED_STEPS
    schedule = first + [first[0]] * (2 if path.cudagraphs else 0)
    steps, seconds = [], []
    for i, step_grids in enumerate(schedule):
        inputs = inputs_for(step_grids[rank], 10 * (i % len(first)) + rank, device)
        want = train_step(reference, inputs)
        marked(inputs, path.cudagraphs)
        waits.take()
        start = time.perf_counter()
        got = train_step(run, inputs)
        seconds.append(time.perf_counter() - start)
        syncs, event_waits = waits.take()
        steps.append((compare(got, want, reference), syncs, event_waits))
        if i in (0, len(schedule) - 1):  # every rank has compiled (or not): count
            dist.barrier()
            if rank == 0:
                graphs["first" if i == 0 else "end"] = torch._dynamo.utils.counters["stats"][
                    "unique_graphs"
                ]
    planned = None
    if not path.fx:  # a plan made ahead, taken inside the same compiled graph
        inputs = inputs_for(first[0][rank], rank, device)
        want = train_step(reference, inputs)
        ahead = fx_vitbal.plan_ahead(run, inputs[1], inputs[2], group=dist.group.WORLD)
        fx_vitbal.use_plan(run, ahead)
        marked(inputs, path.cudagraphs)
        waits.take()
        got = train_step(run, inputs)
        syncs, event_waits = waits.take()
        planned = ((compare(got, want, reference), syncs, event_waits), ahead.plan.applied)
        dist.barrier()
        if rank == 0:
            graphs["end"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return {"steps": steps, "seconds": seconds, "planned": planned}


def marked(inputs, cudagraphs: bool) -> None:
    """Batch dims unbacked (one graph for every image count); a new CUDA-graph step begins."""
    torch._dynamo.decorators.mark_unbacked(inputs[1], 0)
    torch._dynamo.decorators.mark_unbacked(inputs[2], 0)
    torch._dynamo.mark_dynamic(inputs[0], 0)
    if cudagraphs:
        torch.compiler.cudagraph_mark_step_begin()


SECTIONS = {"ranks": ranks_section, "compiled": compiled_section, "cudagraphs": cudagraphs_section}
