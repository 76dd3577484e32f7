"""The README's Python snippets run, in order, on 2 gloo ranks."""

import pathlib
import re

from dist_utils import assert_units_moved, record_collectives, record_moves, run_ranks

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


def _run_snippets(rank: int, world: int, code: list[str]) -> dict:
    namespace: dict = {}
    issued = {}
    with record_moves() as moves:
        for i, block in enumerate(code):
            with record_collectives() as issued[i]:
                exec(compile(block, str(README), "exec"), namespace)
    return {"moves": moves, "issued": issued}


def test_readme_snippets_run_on_two_ranks_and_move_images():
    code = snippets()
    assert len(code) == 10, (
        "unregistered ViT, eager, in place, a Hugging Face tower with other row counts, FX pass, "
        "backend, plan ahead, replica sets, bands, statistics"
    )
    results = run_ranks(_run_snippets, 2, code)
    assert_units_moved(results)
    # The bands snippet's call exchanged the large frame's keys and values in its attention
    # layer: a third forward all_to_all besides the pixels' and the outputs'.
    # The tower with other row counts moved images there and their rows (end rows too) back.
    rows = next(i for i, block in enumerate(code) if "EndRowTower" in block)
    for res in results:
        forward = [name for phase, name, _, _ in res["issued"][rows] if phase == "forward"]
        assert forward.count("all_to_all") == 2, forward
    bands = next(i for i, block in enumerate(code) if "MyBandViT" in block)
    for res in results:
        forward = [name for phase, name, _, _ in res["issued"][bands] if phase == "forward"]
        assert forward.count("all_to_all") == 3, forward
