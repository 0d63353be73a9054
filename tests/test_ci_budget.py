"""The full tier's budget is written once (tests/cost.py: BUDGET) and docs/contributing.md's table says the same."""

import re
from pathlib import Path

from tests.cost import BUDGET, Cost, summary

CONTRIBUTING = Path(__file__).resolve().parent.parent / "docs" / "contributing.md"


def test_the_contributing_guide_states_each_lanes_budget_as_the_summary_checks_it():
    rows = dict(re.findall(r"^\| (\S+) \|[^|]*\| (\d+) s \|$", CONTRIBUTING.read_text(encoding="utf-8"), re.M))
    assert {lane: int(seconds) for lane, seconds in rows.items()} == BUDGET


def test_the_summary_says_which_lane_is_over_its_budget_and_names_the_costliest_tests():
    costs = [Cost("tests/test_a.py::test_heavy", 30.0, 25.0, "main"), Cost("tests/test_b.py::test_light", 2.0, 1.0, "beside")]
    lines = summary(costs, {"main": (100, 100 + BUDGET["main"] + 1), "beside": (100, 200)}, 0, 100,
                    200 + BUDGET["main"], top=1)
    assert "OVER ITS BUDGET" in next(line for line in lines if line.startswith("main"))
    assert "OVER" not in next(line for line in lines if line.startswith("beside"))
    assert lines[-1].endswith("tests/test_a.py::test_heavy") and "25.0 CPU-s" in lines[-1]
