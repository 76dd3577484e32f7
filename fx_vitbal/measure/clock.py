"""This rank's clock of one balanced ViT call: ViT forward + backward time and the time of the
pixels' exchange, for the online cost model and the exchange model (``fx_vitbal.measure``).

A clock exists only when something reads it (``cost_model="online"`` or a stats callback):
without one, a balanced call installs no hook at all.

Where the marks are taken (eager and in-place paths; ``call.run_balanced``):
- ViT forward: right before and right after the ViT call, i.e. between ``redistribute`` and
  ``restore`` (or around the local call when the plan moves nothing), on the device the ViT
  runs on (the balanced pixels'), whatever device the plan was made on;
- ViT backward: from the first gradient of a ViT output (after ``restore``'s backward moved
  them in) to the last gradient of a trainable ViT parameter (or of the ViT's input, if it
  requires one) in the same backward pass. Tensor hooks mark both, and a callback queued on
  the autograd engine closes the span when that pass ends, so every entry point works alike
  (``.backward()``, ``torch.autograd.grad`` with or without ``inputs=``, ``retain_graph``,
  activation checkpointing): the parameters' hooks stay registered (``ParameterWatch``), one
  per parameter, because hooking 400 parameters per call would cost milliseconds. A pass
  that computes no ViT parameter gradient (``autograd.grad`` of something else) reports
  nothing, and a retained graph's second pass is not timed again;
- the pixels' exchange: inside ``vitbal::redistribute``, which follows the metadata gather
  that aligns the ranks. The outputs' exchange follows the ViT, whose imbalance it would
  absorb as waiting, so it is predicted from its bytes instead.

On the CPU the marks are ``time.perf_counter_ns()``; on CUDA they are events recorded on the
current stream of the device the data lives on (not the current device's), read only once both
have completed (``Event.query()``, no sync): a step whose events have not completed when the
next plan is made is reported later or not at all.
"""

import time
import weakref

import torch

# Phases of one call, in order.
PLANNED, FORWARD, FORWARD_DONE, BACKWARD, DONE = range(5)


class StepClock:
    """The marks of one balanced ViT call on this rank (one per plan)."""

    def __init__(self, step: int, siblings=()) -> None:
        self.step = step
        self.siblings = siblings
        """The other calls' clocks of the same ViT: their hooks go when this call starts."""
        self.device = torch.device("cpu")
        self.phase = PLANNED
        self.marks: dict[str, object] = {}
        self.exchanges: list[tuple[object, object]] = []
        self.exchange_bytes = 0
        self.output_bytes_per_row = 0
        self.reported = False
        self._task = None
        self._handles: list = []
        self._watch: ParameterWatch | None = None
        self._without_backward = False

    def at(self, device: torch.device) -> None:
        """Take the next marks on ``device``'s clock (its current stream, on CUDA)."""
        self.device = device

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def mark(self) -> object:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            return event
        return time.perf_counter_ns()

    def _elapsed_ns(self, start: object, end: object) -> int | None:
        if not self.cuda:
            return end - start
        if not (start.query() and end.query()):
            return None  # still running on the device: never wait for it
        return round(start.elapsed_time(end) * 1e6)

    def forward_started(self, device: torch.device) -> None:
        for other in list(self.siblings):
            if other is not self:
                other.release()
        self.at(device)
        self.phase = FORWARD
        self.marks["forward"] = self.mark()

    def forward_ended(self, outputs, pixels, watch: "ParameterWatch | None") -> None:
        """After the ViT call: ``outputs`` its tensors; its backward ends with the last
        gradient ``watch`` (the ViT's trainable parameters) or ``pixels`` sees."""
        self.marks["forward_end"] = self.mark()
        self.phase = FORWARD_DONE
        grad_outputs = [o for o in outputs if o.requires_grad]
        if not grad_outputs or not torch.is_grad_enabled():
            self._without_backward = True  # the forward (and the restore after it) is the call
            return
        if watch is None and not pixels.requires_grad:
            return  # its backward's end cannot be seen: never reported
        if watch is not None:
            watch.clock = self
            self._watch = watch
        self._handles = [o.register_hook(self._backward_started) for o in grad_outputs]
        if pixels.requires_grad:
            self._handles.append(pixels.register_hook(self.gradient_reached))

    def _backward_started(self, _grad) -> None:
        if self.phase != FORWARD_DONE:
            return
        self.marks["backward"] = self.mark()
        self._task = torch._C._current_graph_task_id()
        self.phase = BACKWARD
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_finished)

    def gradient_reached(self, _grad=None) -> None:
        """A gradient the ViT's backward ends with was computed (see ``forward_ended``)."""
        if self.phase != BACKWARD or torch._C._current_graph_task_id() != self._task:
            return
        if self.cuda:  # one event, recorded again at each gradient: no event per parameter
            event = self.marks.setdefault("backward_end", torch.cuda.Event(enable_timing=True))
            event.record(torch.cuda.current_stream(self.device))
        else:
            self.marks["backward_end"] = time.perf_counter_ns()

    def _backward_finished(self) -> None:
        if self.phase == BACKWARD:  # reported only if some end was reached in this pass
            self.phase = DONE if "backward_end" in self.marks else FORWARD_DONE
            self._without_backward = False
        self.release()

    def release(self) -> None:
        """Drop the backward hooks (when the backward ends or the next balanced call starts)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._watch is not None and self._watch.clock is self:
            self._watch.clock = None

    def timing_exchange(self, reverse: bool, device: torch.device) -> bool:
        """Whether a move now, of tensors on ``device``, is the exchange this clock times:
        pixels out, before the ViT (then its marks are taken on ``device``)."""
        timed = not reverse and self.phase == PLANNED
        if timed:
            self.at(device)
        return timed

    def add_exchange(self, start: object, end: object, num_bytes: int) -> None:
        self.exchanges.append((start, end))
        self.exchange_bytes += num_bytes

    def totals_ns(self) -> tuple[int, int] | None:
        """``(ViT forward + backward ns, pixels' exchange ns)`` once complete, else None."""
        if self.phase != DONE and not (self.phase == FORWARD_DONE and self._without_backward):
            return None
        spans = [("forward", "forward_end")]
        if self.phase == DONE:
            spans.append(("backward", "backward_end"))
        vit = [self._elapsed_ns(self.marks[a], self.marks[b]) for a, b in spans]
        exchange = [self._elapsed_ns(a, b) for a, b in self.exchanges]
        if None in vit or None in exchange:
            return None
        return max(1, sum(vit)), sum(exchange)


class ParameterWatch:
    """Persistent tensor hooks on a module's trainable parameters, telling the current clock
    each time one gets its gradient (the last one marks the end of the module's backward).
    Registered once per module and parameter set, only once a clock needs them."""

    def __init__(self, params: tuple[torch.Tensor, ...]) -> None:
        self.params = params
        self.clock: StepClock | None = None
        self.handles = [p.register_hook(self._reached) for p in params]

    def _reached(self, _grad) -> None:
        if self.clock is not None:
            self.clock.gradient_reached()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


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
        watch.remove()
        watch = None
    if watch is None and params:
        watch = _WATCHES[module] = ParameterWatch(params)
    return watch
