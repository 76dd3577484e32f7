"""The README's Python snippets, then docs/usage.md's, run in order as one script on 2 gloo ranks,
launched the way the README says: ``torchrun --nproc-per-node 2 my_script.py``.

Each rank gets the environment torchrun gives its workers, and the script's own
``torch.distributed.init_process_group("gloo")`` meets the other rank through it (``env://``),
at a store this process hosts on a port the OS picked, as torchrun's agent hosts one
(``TORCHELASTIC_USE_AGENT_STORE``: every rank a client of it)."""

import os
import pathlib
import re

import torch.distributed as dist
from dist_utils import assert_units_moved, record_collectives, record_moves, run_ranks

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = (ROOT / "README.md", ROOT / "docs" / "usage.md")  # the script, in this order
WORLD_SIZE = 2  # the README's --nproc-per-node


def snippets() -> list[tuple[str, str]]:
    """``(file, code)`` of every Python block of the docs, in script order; each block's code
    starts on its line of the file, so a traceback names the doc's own line."""
    code = []
    for path in DOCS:
        text = path.read_text()
        for block in re.finditer(r"```python\n(.*?)```", text, flags=re.DOTALL):
            code.append((str(path), "\n" * text.count("\n", 0, block.start(1)) + block[1]))
    return code


def torchrun_environment(rank: int, world_size: int, port: int) -> dict[str, str]:
    """What ``torchrun --nproc-per-node {world_size}`` sets for worker ``rank`` on one node
    (``torch.distributed.elastic``'s local agent), its store at ``127.0.0.1:{port}``."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "ROLE_NAME": "default",
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": "none",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "OMP_NUM_THREADS": "1",
    }


def _run_script(rank: int, world_size: int, code: list[tuple[str, str]], port: int) -> dict:
    # run_ranks starts each rank in a process group of its own; the script makes its own from
    # torchrun's environment, as under torchrun, so this rank leaves that one first.
    dist.destroy_process_group()
    os.environ.update(torchrun_environment(rank, world_size, port))
    namespace: dict = {"__name__": "__main__"}
    issued = {}
    with record_moves() as moves:
        for i, (path, block) in enumerate(code):
            with record_collectives() as issued[i]:
                exec(compile(block, path, "exec"), namespace)
    assert dist.is_initialized() and dist.get_world_size() == world_size  # by the script
    return {"moves": moves, "issued": issued}


def test_readme_snippets_run_under_torchrun_on_two_ranks_and_move_images():
    code = snippets()
    files = [pathlib.Path(path).name for path, _ in code]
    assert files == ["README.md"] * 4 + ["usage.md"] * 6, (
        "README: unregistered ViT (the launch), eager, in place, statistics; docs/usage.md: a "
        "Hugging Face tower with other row counts, FX pass, backend, plan ahead, replica sets, "
        "bands"
    )
    first = code[0][1]
    assert "torchrun --nproc-per-node 2" in first and 'init_process_group("gloo")' in first
    # The launcher's store, on a port the OS picked and held from here on (no race for it).
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    results = run_ranks(_run_script, WORLD_SIZE, code, store.port)
    assert_units_moved(results)
    # The tower with other row counts moved images there and their rows (end rows too) back.
    rows = next(i for i, (_, block) in enumerate(code) if "EndRowTower" in block)
    for res in results:
        forward = [name for phase, name, _, _ in res["issued"][rows] if phase == "forward"]
        assert forward.count("all_to_all") == 2, forward
    # The bands snippet's call exchanged the large frame's keys and values in its attention
    # layer, point to point among the frame's two ranks, besides the all_to_alls that move the
    # pixels and bring the outputs home.
    bands = next(i for i, (_, block) in enumerate(code) if "MyBandViT" in block)
    for res in results:
        forward = [name for phase, name, _, _ in res["issued"][bands] if phase == "forward"]
        assert forward.count("all_to_all") == 2 and forward.count("p2p") == 1, forward
