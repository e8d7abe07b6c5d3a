"""End to end: the bundled ``cpu-tiny-load`` profile through ``abbench run`` (the vendored engine on CPU, one
shared service, chunked vs layer-major at 1, 2 and 4 in flight), one of its two rounds (``--rounds 1``: the
second round's reversed order is tests/harness/test_load_run.py's, on a fake engine): run.json's load levels,
the report's Load section and ``abbench gate``'s verdict. About 20 s on 2 cores."""

from __future__ import annotations

from pathlib import Path

import pytest

from abbench.results import load_run

from tests.support import cli
from tests.support import faultkit as fk

pytestmark = pytest.mark.slow


def test_cpu_tiny_load_runs_its_levels_reports_them_and_passes_the_gate(tmp_path: Path) -> None:
    out = tmp_path / "results" / "load"
    res = fk.abbench("run", "-p", "cpu-tiny-load", "--rounds", "1", "--out", str(out), "-q", cwd=tmp_path,
                     timeout=600)
    err = fk.flat(res.stderr)
    assert res.returncode == 0, err
    assert res.stdout.strip().splitlines()[-1] == "gate: PASS", res.stdout
    assert "run complete: 8 load levels, 56 requests (56 ok)" in err

    record, problems = load_run(out)
    assert record.status == "complete" and not problems and not record.samples
    cells = [(lv.round, lv.role, lv.label, lv.arm) for lv in record.load]
    assert len(cells) == 2 * (1 + 3) and len(set(cells)) == len(cells)
    assert cells[:2] == [(1, "reference", "c=1", "chunked"), (1, "reference", "c=1", "layer-major")]
    assert [c[2] for c in cells[2:]] == ["c=1", "c=1", "c=2", "c=2", "c=4", "c=4"]
    for lv in record.load:
        assert lv.stopped is None and all(r.ok and r.ids_source == "native" for r in lv.requests)
        engine = [r.engine or {} for r in lv.requests]
        assert any(e.get("prefill_path") == lv.arm for e in engine), lv.label  # the arm's mode reached the engine
        # a prompt sent again within a level can meet the prefix cache: one chunk left, where the engine runs
        # chunked prefill and says why
        assert all(e.get("prefill_path") == lv.arm or e.get("fallback_reason") for e in engine), lv.label
    c4 = [lv for lv in record.load if lv.label == "c=4"]
    assert max(s.metrics.get("abbench_engine_requests_running", 0) + s.metrics.get("abbench_engine_queue_waiting", 0)
               for lv in c4 for s in lv.scrapes) >= 2  # the engine saw the requests in flight

    report = (tmp_path / "reports" / "load.md").read_text(encoding="utf-8")
    assert "## Load levels" in report and "### Parity under load" in report
    assert "| layer-major | c=4 |" in report and (tmp_path / "reports" / "load.html").is_file()

    gate = cli.abbench("gate", str(out), cwd=tmp_path)  # in this process: reading a run needs none of its own
    assert gate.returncode == 0, gate.stdout
    text = fk.flat(gate.stdout)
    assert "gate: PASS" in text and "parity-under-load" in text and "8/8 planned levels complete" in text
