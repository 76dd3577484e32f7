"""Every strategy and option gives, bit for bit, the recorded plans (``tests/recorded_plans.py``
holds the inputs and the record). Recorded before the planner's code was moved into
``fx_vitbal.plan`` (2cdf1be; the move changed none), and again once by the fixed-point rewrite
(35487be), whose message says why 15 capped plans changed."""

import json

import recorded_plans


def test_every_plan_is_the_recorded_one():
    recorded = json.loads(recorded_plans.RECORD.read_text())
    solved = recorded_plans.solve_all()
    assert solved.keys() == recorded.keys()
    changed = [name for name in recorded if solved[name] != recorded[name]]
    assert not changed, f"{len(changed)} of {len(recorded)} plans changed: {changed[:10]}"
