"""This rank's clock of one balanced ViT call: ViT forward + backward time and the time of the
forward exchanges, for the online cost model and the exchange model (``fx_vitbal.measured``).

Where the marks are taken (eager and in-place paths; ``encoder.run_balanced``):
- ViT forward: right before and right after the ViT call, i.e. between ``redistribute`` and
  ``restore`` (or around the local call when the plan moves nothing);
- ViT backward: from the moment every ViT output has its gradient (after ``restore``'s backward
  moved them in) to the moment every trainable ViT parameter (and the ViT's input, if it
  requires gradients) has its gradient: a ``register_multi_grad_hook`` on the outputs per call,
  and one kept on the parameters (``ParameterWatch``), so activation checkpointing's
  recomputation is counted and the LM's backward is not;
- exchanges: inside ``vitbal::redistribute`` and ``vitbal::restore`` in the forward, after
  ``restore``'s layout gather, so a rank's wait for slower ranks (absorbed by that gather) is not
  counted as communication. Backward exchanges are predicted from the forward ones (the same
  rows move), not timed: nothing aligns the ranks before them.

On the CPU the marks are ``time.perf_counter_ns()``; on CUDA they are events recorded on the
current stream, read only once both have completed (``Event.query()``, no sync): a step whose
events have not completed when the next plan is made is reported later or not at all.
A call whose backward never completes in order (its hooks are released when the next balanced
call starts) is never reported: missing timings are 0 in the header and the fit skips them.
"""

import time
import weakref

import torch

# Phases of one call, in order.
PLANNED, FORWARD, FORWARD_DONE, BACKWARD, DONE = range(5)


class StepClock:
    """The marks of one balanced ViT call on this rank (one per plan)."""

    def __init__(self, step: int, device: torch.device, siblings=()) -> None:
        self.step = step
        self.siblings = siblings
        """The other calls' clocks of the same ViT: their hooks go when this call starts."""
        self.cuda = device.type == "cuda"
        self.phase = PLANNED
        self.marks: dict[str, object] = {}
        self.exchanges: list[tuple[object, object]] = []
        self.exchange_bytes = 0
        self.output_bytes_per_row = 0
        self.reported = False
        self._task = None
        self._handles: list = []
        self._watch: ParameterWatch | None = None
        self._ends_left = 0
        self._without_backward = False

    def mark(self) -> object:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter_ns()

    def _elapsed_ns(self, start: object, end: object) -> int | None:
        if not self.cuda:
            return end - start
        if not (start.query() and end.query()):
            return None  # still running on the device: never wait for it
        return round(start.elapsed_time(end) * 1e6)

    def forward_started(self) -> None:
        for other in list(self.siblings):
            if other is not self:
                other.release()
        self.phase = FORWARD
        self.marks["forward"] = self.mark()

    def forward_ended(self, outputs, pixels, watch: "ParameterWatch | None") -> None:
        """After the ViT call: ``outputs`` its tensors; its backward ends when ``watch`` (the
        ViT's trainable parameters) fires and ``pixels`` has its gradient, if it needs one."""
        self.marks["forward_end"] = self.mark()
        self.phase = FORWARD_DONE
        grad_outputs = [o for o in outputs if o.requires_grad]
        if not grad_outputs or not torch.is_grad_enabled():
            self._without_backward = True  # the forward (and the restore after it) is the call
            return
        ends = []
        if watch is not None:
            watch.clock = self
            ends.append(watch)
        if pixels.requires_grad:
            ends.append(pixels)
        if not ends:
            return  # its backward's end cannot be seen: never reported
        self._ends_left = len(ends)
        self._watch = watch
        hooks = torch.autograd.graph.register_multi_grad_hook
        self._handles = [hooks(grad_outputs, self._backward_started, mode="all")]
        if pixels.requires_grad:
            self._handles.append(pixels.register_hook(self.backward_ended))

    def _backward_started(self, _grads) -> None:
        if self.phase == FORWARD_DONE:
            self.marks["backward"] = self.mark()
            self._task = torch._C._current_graph_task_id()
            self.phase = BACKWARD

    def backward_ended(self, _grads=None) -> None:
        """One of the ends of the ViT's backward was reached (see ``forward_ended``)."""
        if self.phase == BACKWARD and torch._C._current_graph_task_id() == self._task:
            self._ends_left -= 1
            if not self._ends_left:
                self.marks["backward_end"] = self.mark()
                self.phase = DONE

    def release(self) -> None:
        """Drop the backward hooks (called when the next balanced call starts)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._watch is not None and self._watch.clock is self:
            self._watch.clock = None

    def timing_exchange(self, reverse: bool) -> bool:
        """Whether a move now is one of the forward exchanges this clock times: pixels out
        before the ViT, outputs home after it (not the output gradients, which go out while
        the phase is still ``FORWARD_DONE``)."""
        return self.phase == (FORWARD_DONE if reverse else PLANNED)

    def add_exchange(self, start: object, end: object, num_bytes: int) -> None:
        self.exchanges.append((start, end))
        self.exchange_bytes += num_bytes

    def totals_ns(self) -> tuple[int, int] | None:
        """``(ViT forward + backward ns, forward exchanges ns)`` once complete, else None."""
        if self.phase != DONE and not (self.phase == FORWARD_DONE and self._without_backward):
            return None
        spans = [("forward", "forward_end")]
        if "backward" in self.marks:
            spans.append(("backward", "backward_end"))
        vit = [self._elapsed_ns(self.marks[a], self.marks[b]) for a, b in spans]
        exchange = [self._elapsed_ns(a, b) for a, b in self.exchanges]
        if None in vit or None in exchange:
            return None
        return max(1, sum(vit)), sum(exchange)


class ParameterWatch:
    """One persistent ``register_multi_grad_hook`` over a module's trainable parameters, telling
    the current clock when all of them have their gradients (the end of the module's backward).
    Registered once per module and parameter set, not per call: hooking every parameter each
    call would cost ~2.5 ms per call for 400 parameters."""

    def __init__(self, params: tuple[torch.Tensor, ...]) -> None:
        self.params = params
        self.clock: StepClock | None = None
        hooks = torch.autograd.graph.register_multi_grad_hook
        self.handle = hooks(params, self._all_done, mode="all")

    def _all_done(self, _grads) -> None:
        if self.clock is not None:
            self.clock.backward_ended()


_WATCHES: "weakref.WeakKeyDictionary[torch.nn.Module, ParameterWatch]" = (
    weakref.WeakKeyDictionary()  # not a module attribute: deepcopy must not copy a watch
)


def watch_parameters(module: torch.nn.Module | None) -> ParameterWatch | None:
    """The ``ParameterWatch`` of ``module``'s trainable parameters (None: it has none)."""
    if module is None:
        return None
    params = tuple(p for p in module.parameters() if p.requires_grad)
    watch = _WATCHES.get(module)
    if watch is not None and (
        len(watch.params) != len(params)
        or any(a is not b for a, b in zip(watch.params, params, strict=True))
    ):
        watch.handle.remove()
        watch = None
    if watch is None and params:
        watch = _WATCHES[module] = ParameterWatch(params)
    return watch
