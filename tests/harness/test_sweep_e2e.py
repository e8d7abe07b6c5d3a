"""End to end: the bundled cpu-tiny-sweep profile against the vendored engine (tiny preset, CPU), through the real
CLI, as the examples of `abbench sweep --help` show it: the sweep runs the uncached suffix's grid, refines and
records the sweep in run.json; `abbench report` has the Sweep section and plot; `abbench gate` passes (parity
and the profile's counter check: nothing here depends on which arm the CPU happened to make faster); `abbench
compare` reads the run; `abbench gate --check crossover[...]` judges a crossover check on it (its verdict is
the CPU's, so only its form is asserted); the second example's flags and its JSON document. The first sweep runs
as a process of its own; the second, report, gate and compare go through the same CLI in this process
(tests/support/cli.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import cli

pytestmark = pytest.mark.slow


def abbench(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "abbench", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=900)


@pytest.fixture(scope="module")
def sweep_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("sweep-e2e")
    res = abbench("sweep", "-p", "cpu-tiny-sweep", "--out", str(work / "run"), "--quiet", "--no-report", cwd=work)
    assert res.returncode == 0, res.stderr[-3000:]
    return work / "run"


def test_the_sweep_ran_its_grid_and_recorded_its_passes(sweep_run: Path) -> None:
    record = json.loads((sweep_run / "run.json").read_text())
    assert record["status"] == "complete" and record["profile"]["name"] == "cpu-tiny-sweep"
    samples = [json.loads(x) for x in (sweep_run / "requests.jsonl").read_text().splitlines()]
    assert len(samples) == len(record["plan"]) and all(s["ok"] for s in samples)
    state = record["sweep"]
    grid = record["profile"]["sweep"]["points"]
    assert state["passes"][0] == {"stage": 0, "arms": ["demand", "chunked", "layer-major"], "points": grid,
                                  "pairs": [], "why": "grid"}
    assert len(state["decisions"]) == len(state["passes"]) and state["stopped"]
    for p in state["passes"][1:]:  # a refinement point lies strictly inside the grid, between two measured points
        assert p["why"].startswith("refine ") and all(grid[0] < x < grid[-1] and x not in grid for x in p["points"])
    points = sorted({x for p in state["passes"] for x in p["points"]})
    assert [[q["x"] for q in pair["points"]] for pair in state["result"]["pairs"]] == [points, points]
    # every continuation hit the prefix cache: its uncached suffix is exactly the point
    for s in samples:
        if s["kind"] == "continuation":
            assert s["engine"]["cached_prompt_tokens"] == 256, s["prompt_id"]
            assert s["engine"]["prefill_path"] == s["arm"] or s["engine"]["n_chunks"] == 1
        if s["kind"] == "cold":
            assert s["engine"]["prefill_path"] == "layer-major" and s["excluded"]  # sweep.prefix_request


def test_report_gate_and_compare_read_the_sweep(sweep_run: Path, tmp_path: Path) -> None:
    res = cli.abbench("report", str(sweep_run), "--out", str(tmp_path), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    md = (tmp_path / "run.md").read_text()
    assert "## Sweep: where the arms cross" in md and "### demand vs chunked" in md and "**Crossover:**" in md
    assert (tmp_path / "run" / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    res = cli.abbench("gate", str(sweep_run), cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:]
    res = cli.abbench("gate", str(sweep_run), "--check", "crossover[demand, layer-major] >= 1", cwd=tmp_path)
    assert res.returncode in (0, 1) and "check crossover[demand, layer-major] >= 1:" in res.stdout
    assert "suffix: " in res.stdout
    res = cli.abbench("compare", str(sweep_run), str(sweep_run), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]


def test_the_second_example_sweeps_two_arms_and_prints_its_document(tmp_path: Path) -> None:
    res = cli.abbench("sweep", "-p", "cpu-tiny-sweep", "--arms", "demand,chunked", "--points", "16,256",
                      "--max-refinements", "1", "--json", "--out", str(tmp_path / "run"), "--no-report", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    doc = json.loads(res.stdout)
    assert doc["schema"] == "abbench.sweep/1" and doc["run"]["profile"] == "cpu-tiny-sweep"
    assert doc["vary"] == "suffix" and doc["passes"][0]["points"] == [16, 256] and len(doc["passes"]) <= 2
    (pair,) = doc["pairs"]  # the crossover naming layer-major went with --arms
    assert (pair["a"], pair["b"]) == ("demand", "chunked") and pair["crossover"]["status"] in (
        "crossing", "above", "below")
    assert [p["x"] for p in pair["points"]][0] == 16 and [p["x"] for p in pair["points"]][-1] == 256
