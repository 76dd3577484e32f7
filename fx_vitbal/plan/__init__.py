"""Assign ViT units (images or frames) to data-parallel ranks so every rank gets similar work.

Layers, each importing only those above it in this list: ``assignment`` (a plan's per-rank
unit lists, each made when first read), ``units`` (the flat unit arrays, the fixed-point costs,
``Plan``), ``candidates`` (the row cap, assignments as the units they move, and the plan made of
one), ``shed`` (which units overloaded ranks shed), ``greedy`` (LPT and the refinement),
``min_move`` (best-fit and min-move's attempts), ``nodes`` (node-aware min-move), ``solve``
(``solve_plan``: the candidates and the choice), ``replicas`` (replica sets: ranks holding the
same batch, reduced to one ``solve_plan`` over holdings, ``solve_for_sets``); then the bands of
frames split across ranks: ``bands`` (the rule), ``band_prices`` (their exchanges, by kind and
place), ``band_plan`` (which frames are cut and how), ``band_fill`` and ``band_nodes`` (bands on
a cluster of nodes), ``band_gaps`` (uneven cuts), ``band_caps`` (the row cap kept with bands);
and ``step``, the planning step of one call over all of them (``plan_step``, with Python's
garbage collector paused by ``collector`` while it plans).

Deterministic: every rank runs ``solve_plan`` on the same gathered input and must get the same
answer. Decisions are made on integer fixed-point costs, whose sums are exact in any order (so
a rank's thread count or vector width changes no bit); every sort is stable, and every tie is
broken by a total order (cost, then source rank, then local index); the float loads a plan
reports are summed rank by rank in unit order. No hashing, randomness or float reduction order
depends on anything else.

Two strategies:
- ``lpt``: the seed's plan. Greedy longest-processing-time onto the least-loaded rank, then
  move/swap refinement between the most and least loaded ranks. It reaches a makespan close to the
  lower bound but moves nearly every unit (each lands wherever the heap says).
- ``min-move`` (default): keep units home and move only what must move. Overloaded ranks shed
  units down to a target makespan (and ranks above the row cap shed rows), the shed units are
  placed best-fit, and the seed's move/swap refinement repairs any overshoot. The target is first
  the lower bound of any plan's makespan plus 1%, which needs no LPT (node-aware planning too);
  only when that fails (or an exchange model weighs the plans) does LPT run, and the target
  becomes LPT's makespan plus 1% (uncapped LPT's when LPT under the row cap gains nothing), with
  LPT itself a candidate.

What runs where: one algorithm, executed two ways by the input's size (``Units.small``). Up to
``units.SMALL_UNITS`` units it runs on Python lists and makes no tensor: a torch op's fixed cost
(2-8 us, 70-190 us after a garbage collection) would dominate there. Above, torch ops over the
whole input flatten and check it, sum every rank's load and rows, find the lower bound, the
ranks over the target and the units they shed. The steps with two executions (taking the input,
shedding, a candidate's sums, the plan's lists and loads) keep them side by side, and a property
test holds them to the same plan bit for bit. Either way Python loops run only for the units
that move and the ranks they touch (best-fit, the refinement), and LPT deals every unit in Python
when it runs; the list execution's other passes over every unit are C-level (``map``,
``sorted``, ``functools.reduce``). Plans move few units: a candidate lists only its moves, and
a plan's per-rank lists are made only for the ranks that read them (a step reads its own).

Both keep a cap on the pixel rows each rank computes (``BalanceConfig.max_len_ratio``); by default
no rank may end with more rows than the fullest rank holds before balancing, so balancing never
raises peak memory.
"""

from fx_vitbal.plan.solve import MAKESPAN_SLACK, solve_plan, worth_moving
from fx_vitbal.plan.units import Plan, imbalance

__all__ = ["MAKESPAN_SLACK", "Plan", "imbalance", "solve_plan", "worth_moving"]
