"""Python's garbage collector paused while a step is planned (``plan.step.plan_step``)."""

import contextlib
import gc


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector off while a step is planned, on again after (where it
    was on: a process that runs its collections itself, as Megatron's ``--manual-gc`` does,
    keeps it off).

    A plan at scale holds some 10^5 young objects at once (units, bands, their lists). Every
    collection that ran meanwhile promoted the live ones, and that set off a full collection of
    the whole process every second or third plan of a 2048-rank step with bands: 130-190 ms in
    a process tracking 0.3 M objects (a training process tracks more), each rank at its own
    moment, a straggler of the balancer's own making (``docs/benchmarks.md``). The planner makes no
    reference cycles (``tests/test_band_planning.py``), so reference counting frees whatever
    it drops, collector or not. The pause is the process's: while a data thread plans ahead
    (``fx_vitbal.plan_ahead``), the other threads' collections wait for it too."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
