"""The order the suite's files run in (tests/conftest.py): longest recorded first, a file's tests together and in
their own order, a file with no record counted as the median one; and the recorded seconds are readable."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from tests import conftest

REPO = Path(__file__).resolve().parents[2]


def _items(*nodeids: str) -> list[SimpleNamespace]:
    return [SimpleNamespace(path=REPO / n.split("::")[0], nodeid=n) for n in nodeids]


def test_files_run_longest_first_and_keep_their_tests_together_in_order() -> None:
    items = _items("tests/a.py::t1", "tests/a.py::t2", "tests/b.py::t1", "tests/c.py::t1", "tests/c.py::t2",
                   "tests/d.py::t1", "tests/e.py::t1")
    costs = {"tests/a.py": 1.0, "tests/b.py": 30.0, "tests/c.py": 5.0, "tests/e.py": 0.5}
    ordered = [i.nodeid for i in conftest.longest_first(items, costs)]  # type: ignore[arg-type]
    # d.py has no record: the median (3.0 s), between c.py and a.py
    assert ordered == ["tests/b.py::t1", "tests/c.py::t1", "tests/c.py::t2", "tests/d.py::t1", "tests/a.py::t1",
                       "tests/a.py::t2", "tests/e.py::t1"]
    assert [i.nodeid for i in conftest.longest_first(items, {})] == [i.nodeid for i in items]  # type: ignore[arg-type]


def test_the_recorded_seconds_are_a_table_of_test_files() -> None:
    costs = conftest.file_costs()
    raw = json.loads(conftest.DURATIONS.read_text())
    assert costs and len(costs) == len(raw) and all(v >= 0 for v in costs.values())
    assert all(k.startswith("tests/") and k.endswith(".py") for k in costs)
    assert "tests/harness/test_e2e.py" in costs
