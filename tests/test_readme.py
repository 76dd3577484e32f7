"""The README's Python snippets run, in order, on 2 gloo ranks."""

import pathlib
import re

from dist_utils import assert_units_moved, record_moves, run_ranks

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


def _run_snippets(rank: int, world: int, code: list[str]) -> dict:
    namespace: dict = {}
    with record_moves() as moves:
        for block in code:
            exec(compile(block, str(README), "exec"), namespace)
    return {"moves": moves}


def test_readme_snippets_run_on_two_ranks_and_move_images():
    code = snippets()
    assert len(code) == 8, (
        "unregistered ViT, eager, in place, FX pass, backend, plan ahead, replica sets, statistics"
    )
    assert_units_moved(run_ranks(_run_snippets, 2, code))
