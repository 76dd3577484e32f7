"""The package's layering holds: no import cycles, no module over 400 lines, at most 8 modules
flat in ``fx_vitbal/``, the planner free of ``torch.distributed``, the entry points
independent of each other, and the runtime's rooms importing only the rooms below them
(``benchmarks/layout.py`` reads the imports)."""

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("layout", ROOT / "benchmarks" / "layout.py")
layout = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(layout)

# Each entry point's modules (the FX pass and the backend are one: the backend applies the pass).
ENTRY_POINTS = [
    {"fx_vitbal.encoder"},
    {"fx_vitbal.ahead"},
    {
        "fx_vitbal.integrations.hf",
        "fx_vitbal.integrations.hf_towers",
        "fx_vitbal.integrations.hf_outputs",
        "fx_vitbal.integrations.hf_inputs",
    },
    {"fx_vitbal.passes.backend", "fx_vitbal.passes.vit_balance", "fx_vitbal.passes.subgraph"},
]


def test_no_import_cycles_and_no_module_over_400_lines():
    found = layout.modules()
    assert layout.cycles(layout.import_graph(found)) == []
    sizes = {name: len(path.read_text().splitlines()) for name, path in found.items()}
    assert {name: n for name, n in sizes.items() if n > 400} == {}
    assert len(list((ROOT / "fx_vitbal").glob("*.py"))) <= 8


def test_lower_layers_never_import_higher_ones():
    graph = layout.import_graph(layout.modules())
    reach = {name: layout._reachable(graph, name) for name in graph}
    for name, reached in reach.items():
        if name.startswith("fx_vitbal.plan."):  # pure planning: no runtime, no collectives
            assert not any(
                r.startswith(("fx_vitbal.runtime", "fx_vitbal.measure")) for r in reached
            )
            assert (
                "torch.distributed"
                not in (ROOT / name.replace(".", "/")).with_suffix(".py").read_text()
            ), name
        if name.startswith(("fx_vitbal.cost.", "fx_vitbal.measure.")):
            assert not any(r.startswith("fx_vitbal.runtime") for r in reached), (name, reached)
        every_entry = set().union(*ENTRY_POINTS)
        if name.startswith("fx_vitbal.runtime."):
            assert not reached & every_entry, (name, reached & every_entry)
        for entry in ENTRY_POINTS:  # an entry point builds on the runtime, never on another
            if name in entry:
                assert not reached & (every_entry - entry), (name, reached & (every_entry - entry))


# The runtime's rooms, lowest first: each imports only itself and the rooms before it, and
# ``call.py`` sits on top of them all (docs/design.md draws them).
ROOMS = ["transport", "bands", "vit", "agree", "call"]


def _room(name: str) -> int | None:
    parts = name.split(".")
    if parts[:2] != ["fx_vitbal", "runtime"] or len(parts) < 3:
        return None
    return ROOMS.index(parts[2])


def test_the_runtimes_rooms_import_only_the_rooms_below_them():
    found = layout.modules()
    runtime = [n for n in found if n.startswith("fx_vitbal.runtime.")]
    flat = {n for n in runtime if n.count(".") == 2 and found[n].name != "__init__.py"}
    assert flat == {"fx_vitbal.runtime.call"}  # nothing flat in runtime/ but the call on top
    graph = layout.import_graph(found)
    upward = [
        (name, target)
        for name in runtime
        for target in graph.get(name, ())
        if _room(target) is not None and _room(target) > _room(name)
    ]
    assert upward == []
