"""Every strategy and option gives, bit for bit, the recorded plans (``tests/recorded_plans.py``
holds the inputs and the record). Recorded before the planner's code was moved into
``fx_vitbal.plan`` (2cdf1be; the move changed none), and again once by the fixed-point rewrite
(35487be), whose message says why 15 capped plans changed. Both of the planner's executions
(Python lists, torch ops: ``Units.small``) are held to the record, whatever the input's size."""

import json
from unittest import mock

import pytest
import recorded_plans

from fx_vitbal.plan import units


@pytest.mark.parametrize(
    ("execution", "small_units"), [("python-lists", 1 << 62), ("torch-ops", -1)]
)
def test_every_plan_is_the_recorded_one(execution, small_units):
    recorded = json.loads(recorded_plans.RECORD.read_text())
    with mock.patch.object(units, "SMALL_UNITS", small_units):
        solved = recorded_plans.solve_all()
    assert solved.keys() == recorded.keys()
    changed = [name for name in recorded if solved[name] != recorded[name]]
    assert not changed, (
        f"{execution}: {len(changed)} of {len(recorded)} plans changed: {changed[:10]}"
    )
