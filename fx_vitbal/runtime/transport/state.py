"""A balanced call's host state (``StepState``), in one registry keyed by the call's step, the
number every packed tensor of the call carries (``Routing.step``, ``BandLayout.step``), and by
the identity of the tensors it holds (found without reading them).

What the plan makes on the host and the rest of the call reads: the parsed routing, the step
clock (``fx_vitbal.measure.clock``), the host copy of this rank's grid (window indexes), the
routing of outputs that have other row counts than their pixels, the ``Bands`` the ViT is given
and the parsed layout of their exchange. Readers find it through the step in the tensor they
hold, so a copy of a tensor (a compiler's) finds the same state, and a tensor without state is
parsed afresh; nothing rides on a tensor as a Python attribute.

[Note: step state lifetime] A state is registered by its call's plan (``vitbal::plan``; a plan
made ahead keeps its own until the call it was made for takes it, ``runtime.agree.handover``), and
lives until the next call of the same ViT on the same group and rank registers its own: after
its forward, the backward's exchanges have read its clock and any checkpoint recompute has run
its band exchange. A reader that finds none parses the tensor it holds (the same numbers) and
goes on without a clock; only a split frame cannot go on without its bands, and raises.
"""

import dataclasses
import threading
from collections.abc import Callable

import torch

from fx_vitbal.runtime.transport.routing import Routing


@dataclasses.dataclass(eq=False)
class StepState:
    """One call's host state (module doc); every field but ``route`` is optional."""

    routing: torch.Tensor
    """The call's packed routing, as the plan returned it."""
    route: Routing
    """``routing`` parsed."""
    clock: object | None = None
    """The call's ``measure.clock.StepClock`` (None: nothing reads measured times)."""
    home_grid: list[list[int]] | None = None
    """This rank's grid rows as the plan gathered them (``vits.regenerate_window_index``)."""
    output_routing: Callable[..., torch.Tensor] | None = None
    """``rows_of -> routing`` counting each unit's output rows by ``rows_of``
    (``call.run_balanced``'s ``output_rows``)."""
    bands: object | None = None
    """The ``runtime.bands.view.Bands`` the ViT is given (a split frame's exchange, or whole
    units)."""
    band_layout: tuple[torch.Tensor, object] | None = None
    """The bands' packed exchange layout and its parse (``runtime.bands.exchange.BandLayout``)."""


# States by step, and the newest step of each (ViT, group, rank): ranks that are threads of one
# process (torch's threaded test process group) keep their own; steps are unique per process.
# And by the identity of the packed tensors a state holds (it keeps them alive, so no other
# tensor can take their ``id`` while it is kept): found without reading a tensor.
_STATES: dict[int, StepState] = {}
_NEWEST: dict[tuple[int, str, int], int] = {}
_BY_TENSOR: dict[int, StepState] = {}
_LOCK = threading.Lock()


def register(state: StepState, owner: tuple[int, str, int]) -> None:
    """Keep ``state`` under its step, releasing the states of the earlier calls of ``owner``
    (``(ViT layout token, group name, rank)``): see [Note: step state lifetime]."""
    step = state.route.step
    with _LOCK:
        older = _NEWEST.get(owner)
        if older is not None and older != step:
            _release(_STATES.pop(older, None))
        _release(_STATES.get(step))
        _STATES[step] = state
        _NEWEST[owner] = step
        for tensor in _tensors(state):
            _BY_TENSOR[id(tensor)] = state


def _release(state: StepState | None) -> None:
    for tensor in _tensors(state) if state is not None else ():
        if _BY_TENSOR.get(id(tensor)) is state:
            del _BY_TENSOR[id(tensor)]


def _tensors(state: StepState) -> list[torch.Tensor]:
    layout = [state.band_layout[0]] if state.band_layout is not None else []
    return [state.routing, *layout]


def state_of(step: int) -> StepState | None:
    """The state of call ``step``, if it is still kept."""
    with _LOCK:
        return _STATES.get(step)


def state_holding(packed: torch.Tensor) -> StepState | None:
    """The kept state holding this very tensor (its routing or its band layout), or None."""
    with _LOCK:
        return _BY_TENSOR.get(id(packed))


def route_of(routing: torch.Tensor) -> Routing:
    """``routing`` parsed: its state's parse when a state holds this very tensor, else parsed
    afresh (a copy, a repacked routing, or a call whose state is gone)."""
    state = state_holding(routing)
    if state is not None and state.routing is routing:
        return state.route
    return Routing.from_tensor(routing)


def state_of_routing(routing: torch.Tensor) -> StepState | None:
    """The state of ``routing``'s call: the one holding it, else the one of the step it
    carries (a copy, or a routing repacked from it), if still kept."""
    state = state_holding(routing)
    return state if state is not None else state_of(route_of(routing).step)


def clock_of(routing: torch.Tensor):
    """The step clock of ``routing``'s call, or None."""
    state = state_of_routing(routing)
    return state.clock if state is not None else None
