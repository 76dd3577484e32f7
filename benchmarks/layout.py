"""The package's shape: files and lines per package, import cycles, the longest import chain,
and the stops ``pixel_values`` makes from ``dp_balance_vit_encoder`` to the restored outputs.

    python benchmarks/layout.py

Imports are read from the source (``import`` and ``from ... import`` anywhere in a module,
function-level ones too; re-exports through a package ``__init__`` are not edges).

The stops: on rank 0 of two gloo ranks, one balanced call whose plan moves images, traced in
its forward and backward. A stop is a library function that gets the call's data as an
argument: pixel data (the pixels, or a floating-point tensor that a function given pixel data
returned: the balanced pixels, the ViT's outputs; not the grid or the routing), or the planning
step's (the grids the plan gathered, the plan and the units it was made of, from the gather
into ``plan/`` and back). Consecutive stops in one file count once; a stop in a file the path
has already left is a return. A call is upward when the callee's module imports the caller's
(directly or not): control climbing back up the layers (a callback, or a cycle). Also printed:
how often the path enters ``plan/`` and the plan op's module.
"""

import ast
import collections
import os
import pathlib
import sys
import tempfile
import threading

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "fx_vitbal"


def modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def import_graph(found: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """Module -> library modules it imports (package ``__init__`` targets left out)."""
    packages = {name for name, path in found.items() if path.name == "__init__.py"}
    graph = {}
    for name, path in found.items():
        if name in packages:
            continue
        here = name.rsplit(".", 1)[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            edges |= {t for t in targets if t in found and t not in packages and t != name}
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def longest_chain(graph: dict[str, set[str]]) -> list[str]:
    memo: dict[str, list[str]] = {}

    def chain(v):
        if v not in memo:
            memo[v] = [v]  # a cycle ends the chain
            memo[v] = max(([v, *chain(w)] for w in sorted(graph[v])), key=len, default=[v])
        return memo[v]

    return max((chain(v) for v in sorted(graph)), key=len)


def _traced_call(rank: int, world: int, store_path: str, queue) -> None:
    import fx_vitbal
    from fx_vitbal.tools import models

    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", rank=rank, world_size=world, store=store)
    torch.manual_seed(0)
    vit = models.QwenStyleViT(models.ViTConfig(deepstack_indexes=(0,)))
    grids = [[[1, 16, 16], [1, 8, 8]], [[1, 4, 4]]][rank]
    grid = torch.tensor(grids)
    pixels = torch.randn(int(grid.prod(1).sum()), 24, requires_grad=True)
    fx_vitbal.dp_balance_vit_encoder(vit, pixels, grid)  # warm: the first call agrees layouts
    vit_file = models.__file__
    stops, calls = [], []
    tracked = {id(pixels): pixels}  # pixel data by id (kept alive, so ids stay unique)
    following = set()  # frames that got pixel data: what they return is pixel data too

    planning = tuple(_planning_types())

    def tensors(value, depth=0):
        """Pixel data and the planning step's data in ``value`` (what is followed)."""
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            yield value
        elif isinstance(value, planning):
            yield value
            for part in vars(value).values():  # its grids, plan and units: followed too
                if isinstance(part, (list, *planning)):
                    yield part
        elif isinstance(value, (list, tuple)) and depth < 2:
            for v in value:
                yield from tensors(v, depth + 1)

    def library_file(frame):
        file = frame.f_code.co_filename if frame is not None else ""
        if file.startswith(str(PACKAGE)) and file != vit_file:
            return str(pathlib.Path(file).relative_to(PACKAGE))
        return None

    def profile(frame, event, arg):
        name = library_file(frame)
        if name is None:
            return
        if event == "return" and frame in following:
            following.discard(frame)
            tracked.update((id(t), t) for t in tensors(arg))
            return
        if event != "call":
            return
        code = frame.f_code
        args = [frame.f_locals.get(n) for n in code.co_varnames[: code.co_argcount]]
        if not any(id(a) in tracked or any(id(t) in tracked for t in tensors(a)) for a in args):
            return
        following.add(frame)
        if not stops or stops[-1] != name:
            stops.append(name)
        caller = library_file(frame.f_back)
        if caller is not None and caller != name:
            calls.append((caller, name))

    sys.setprofile(profile)
    threading.setprofile(profile)  # backward ops run in the autograd engine's threads
    embeds, _, deepstack = fx_vitbal.dp_balance_vit_encoder(vit, pixels, grid)
    (embeds.sum() + sum(d.sum() for d in deepstack)).backward()
    sys.setprofile(None)
    threading.setprofile(None)
    if rank == 0:
        queue.put((stops, calls))
    dist.destroy_process_group()


def _planning_types() -> list[type]:
    """What the planning step hands on: the gathered metadata, the step's plan, the plan."""
    from fx_vitbal.plan.step import StepPlan
    from fx_vitbal.plan.units import Plan
    from fx_vitbal.runtime.agree.metadata import Gathered

    return [Gathered, StepPlan, Plan]


def pixel_path() -> tuple[list[str], list[tuple[str, str]]]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_traced_call, args=(r, 2, store, queue)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=300)
        if any(p.exitcode for p in procs):
            raise RuntimeError(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
        stops = queue.get(timeout=10)
    return stops


def main() -> None:
    found = modules()
    per_package = collections.defaultdict(lambda: [0, 0])
    for name, path in found.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        per_package[package][0] += 1
        per_package[package][1] += len(path.read_text().splitlines())
    print("| package | files | lines |\n|---|---|---|")
    for package, (files, lines) in sorted(per_package.items()):
        print(f"| {package} | {files} | {lines} |")
    total = [sum(v[i] for v in per_package.values()) for i in (0, 1)]
    print(f"| all | {total[0]} | {total[1]} |")
    sizes = {n: len(p.read_text().splitlines()) for n, p in found.items()}
    flat = [p for p in PACKAGE.glob("*.py")]
    print(f"\nflat modules in fx_vitbal/: {len(flat)}")
    print("modules over 400 lines:", {n: s for n, s in sizes.items() if s > 400} or "none")
    graph = import_graph(found)
    print("import cycles:", cycles(graph) or "none")
    chain = longest_chain(graph)
    print(f"longest import chain ({len(chain)} modules):", " -> ".join(chain))
    stops, calls = pixel_path()
    seen, returns = set(), 0
    for stop in stops:
        returns += stop in seen
        seen.add(stop)

    def module(file):
        name = "fx_vitbal." + file.removesuffix(".py").replace("/", ".")
        return name.removesuffix(".__init__")

    reach = {v: _reachable(graph, v) for v in graph}
    upward = [
        (a, b) for a, b in calls if module(a) in reach.get(module(b), ()) and module(a) in graph
    ]
    print(f"\npixel_values: {len(stops)} stops in {len(seen)} files, {returns} returns to a file")
    print(
        f"calls between files: {len(calls)}; upward (into a module that imports the caller): "
        f"{len(upward)}: {sorted(collections.Counter(upward).items())}"
    )
    entries = sum(
        s.startswith("plan/") and (i == 0 or not stops[i - 1].startswith("plan/"))
        for i, s in enumerate(stops)
    )
    planning = sum(s == "runtime/agree/planning.py" for s in stops)
    print(f"enters plan/: {entries}; the plan op's module (runtime/agree/planning): {planning}")
    print(" -> ".join(s.removesuffix(".py") for s in stops))


def _reachable(graph, start):
    seen, todo = set(), [start]
    while todo:
        for w in graph[todo.pop()]:
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


if __name__ == "__main__":
    main()
