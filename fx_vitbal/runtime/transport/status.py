"""Status words: how every rank learns, without a collective of its own and without waiting,
whether every rank's ViT outputs were sound, and raises the same ``ValueError`` if not.

Each rank checks its own outputs against the layouts the ranks agreed on (sizes and dtypes only,
known on the host) and sends its status word to every rank inside the outputs' exchange
(``exchange.exchange``); a rank whose outputs are unsound sends zeros of the agreed sizes
instead, so the exchange itself can never hang or mix up rows. The received words are copied
to the host without waiting (``transfer.HostCopy``) and read where that costs nothing:

- in ``restore``'s backward, before the output gradients move (every rank reaches it, and by
  then the forward's copy has long landed): before any optimizer step can use the outputs;
- at the end of ``restore`` itself when no backward will come (gradients off, or no output
  requires one);
- at the next balanced call on the group, for a step whose backward never ran.

Words are two int64: ``[kind | output_index << 8, value]``.
"""

import threading

import torch
import torch.distributed as dist

from fx_vitbal.runtime.transport.transfer import HostCopy

OK, ROWS, LAYOUT, COUNT, NOT_AS_PLANNED = range(5)


def word(kind: int = OK, index: int = 0, value: int = 0) -> torch.Tensor:
    """One rank's status word (a CPU tensor)."""
    return torch.tensor([kind | index << 8, value], dtype=torch.int64, device="cpu")


def kind(word: torch.Tensor) -> int:
    """What a status word says (``OK``, ``ROWS``, ...)."""
    return int(word[0]) & 0xFF


# Pending words by (group name, rank): ranks that are threads of one process (torch's threaded
# test process group) keep their own.
_PENDING: dict[tuple[str, int], dict[int, HostCopy]] = {}
_FLAGS: dict[tuple[tuple[str, int], int], torch.Tensor] = {}
_LOCK = threading.Lock()


def _key(group_name: str) -> tuple[str, int]:
    group = dist.distributed_c10d._resolve_process_group(group_name)
    return group_name, dist.get_rank(group)


def expect(group_name: str, step: int, words_R: torch.Tensor) -> None:
    """Keep every rank's received words (``[world, 2]`` int64, on any device) of
    ``step`` for a later ``check``; the copy to the host is queued, not waited for."""
    key = _key(group_name)
    with _LOCK:
        _PENDING.setdefault(key, {})[step] = HostCopy(words_R)


def flag_not_as_planned(group_name: str, step: int, differs: torch.Tensor) -> None:
    """Keep a device boolean saying whether call ``step``'s batch is not the one planned ahead
    for it (``runtime.agree.handover``), for its ``restore`` to fold into the status word."""
    with _LOCK:
        _FLAGS[(_key(group_name), step)] = differs


def take_not_as_planned(group_name: str, step: int) -> torch.Tensor | None:
    """The device flag of call ``step`` (``flag_not_as_planned``), if any (taken)."""
    with _LOCK:
        return _FLAGS.pop((_key(group_name), step), None)


def check(group_name: str, step: int | None = None) -> None:
    """Read the words of ``step`` (None: of every step still pending on the group) and forget
    them.

    Raises:
        ValueError: some rank's outputs were unsound; the same message on every rank.
    """
    key = _key(group_name)
    with _LOCK:
        pending = _PENDING.get(key, {})
        steps = sorted(pending) if step is None else [step] if step in pending else []
        taken = [pending.pop(s) for s in steps]
    for copy in taken:
        words = copy.values()
        kinds = [w[0] & 0xFF for w in words]
        problems = [
            _describe(r, *w) for r, w in enumerate(words) if kinds[r] not in (OK, NOT_AS_PLANNED)
        ]
        not_as_planned = [r for r, k in enumerate(kinds) if k == NOT_AS_PLANNED]
        if not_as_planned:  # one problem naming every such rank
            problems.insert(0, _NOT_AS_PLANNED.format(ranks=not_as_planned))
        if problems:
            raise ValueError("vit dp balance: bad ViT output; " + "; ".join(problems))


_NOT_AS_PLANNED = (
    "the batch the ViT got is not the batch planned ahead for it (fx_vitbal.plan_ahead) on "
    "rank(s) {ranks}, so every rank raises before any gradient moves. Plan each batch with the "
    "pixels "
    "(shape, dtype, requires_grad), grid and balancing settings the ViT call gets, on every "
    "rank, in the order of the steps"
)


def _describe(rank: int, code: int, value: int) -> str:
    kind, index = code & 0xFF, code >> 8
    if kind == ROWS:
        return (
            f"rank {rank}: ViT output {index} has {value} rows; expected t*h*w (pre-merger) or "
            "t*h*w/merge**2 (merged) rows summed over the units, or those a Hugging Face "
            "rule's output_rows counts"
        )
    if kind == LAYOUT:
        return (
            f"rank {rank}: ViT output {index} changed its layout, dtype or row width from the "
            "one every rank agreed on for this ViT (outputs may change layout only together "
            "with the ViT instance, the pixel dtype or autocast, on every rank alike)"
        )
    assert kind == COUNT, kind
    return f"rank {rank}: the ViT returned {value} outputs, not the number agreed on"
