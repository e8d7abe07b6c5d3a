"""Running a sweep (abbench.runner.sweep) against the fake engine (tests/support/fakeserver.py): the grid, the
refinement passes and what run.json records of them, resuming, one stage per shared service, a pass of its own
services when arms do not share one, the prefix's request fields, the report's Sweep section, ``abbench
sweep`` and the profile's rules. Arm ``a``'s first token waits 0.5 ms per prompt token, arm ``b``'s a flat 0.1 s,
so a answers 10x faster at 20 tokens and 4x slower at 800: every assertion rests on that sign pattern alone
(which point is refined next), never on a timing's value."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from abbench import analysis, runner
from abbench.cli import app
from abbench.errors import ConfigError
from abbench.profile import profile_from_dict
from abbench.report import render_markdown, write_report
from abbench.results import RUN_FILE, SAMPLES_FILE, RunRecord, load_run
from abbench.runner import sweep as sweeps
from abbench.tokenizers import load_tokenizer
from tests.support import faultkit as fk

SLOW_A = {"fake_delay_per_token_s": 0.0005}
FLAT_B = {"fake_mode": "slow-first-token", "fake_delay_s": 0.1}
GRID = [20, 800]
FIRST_MIDPOINT = round(math.sqrt(20 * 800))  # 126


def sweep_profile(mark: str, *, arms: list[dict] | None = None, sweep: dict | None = None, **kw: Any) -> dict:
    prof = fk.fake_profile(mark, arms=arms or [{"name": "a", "request": SLOW_A}, {"name": "b", "request": FLAT_B}],
                           prompts={"warmup": 1, "lengths": []}, **kw)
    prof["run"] = {"rounds": 2, **kw.get("run", {})}
    prof["sweep"] = {"vary": "length", "points": GRID, "crossovers": [["a", "b"]], "max_refinements": 1,
                     **(sweep or {})}
    prof["gate"] = {"checks": ["crossover[a, b] >= 20", "crossover[a, b] <= 800"]}
    return prof


def execute(prof: dict, run_dir: Path, **kw: Any) -> RunRecord:
    return runner.execute(profile_from_dict(prof), run_dir, **kw)


@pytest.fixture(scope="module")
def shared_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path, RunRecord]:
    """A length sweep of a and b on one shared service: the grid and one refinement."""
    mark = fk.new_mark()
    prof = sweep_profile(mark, engine={"shared_service": True})
    run_dir = tmp_path_factory.mktemp("sweep") / "run"
    rec = execute(prof, run_dir)
    fk.assert_no_leftovers(mark)
    return prof, run_dir, rec


def test_a_sweep_runs_the_grid_then_bisects_the_bracket(shared_run: tuple[dict, Path, RunRecord],
                                                         tmp_path: Path) -> None:
    prof, run_dir, rec = shared_run
    assert rec.status == "complete" and all(s.ok for s in rec.samples)
    state = rec.sweep
    assert [(p["why"], p["points"]) for p in state["passes"]] == [("grid", GRID), ("refine a vs b",
                                                                                   [FIRST_MIDPOINT])]
    first = state["decisions"][0]["crossovers"][0]
    assert first["status"] == "crossing" and first["action"] == f"add point {FIRST_MIDPOINT}"
    assert state["decisions"][-1]["next"] == "stop" and "a vs b:" in state["stopped"]
    # every point ran every arm in both rounds, on the one shared service, each a fresh prompt of its own
    fresh = {s.prompt_id: s for s in rec.plan if s.kind == "fresh"}
    assert sorted({p.target_tokens for p in rec.prompts if p.id in fresh}) == sorted([*GRID, FIRST_MIDPOINT])
    assert sum(1 for s in rec.plan if s.kind == "fresh") == 3 * 2 * 2 and {s.service for s in rec.plan} == {"shared"}
    assert len(rec.services) == 1 and [s.index for s in rec.plan] == list(range(len(rec.plan)))
    # the plan is what the recorded passes rebuild, step for step (a resume relies on it)
    rebuilt = sweeps.sweep_plan(profile_from_dict(prof), rec.prompts, state)
    assert [s.model_dump() for s in rebuilt] == [s.model_dump() for s in rec.plan]
    # the result: the crossover lies between the grid's points, so both declared checks pass
    (pair,) = state["result"]["pairs"]
    assert [p["x"] for p in pair["points"]] == sorted([*GRID, FIRST_MIDPOINT])
    verdict = analysis.gate(rec)
    assert verdict.passed, verdict.failures
    saved = json.loads((run_dir / RUN_FILE).read_text())
    assert saved["sweep"]["result"] == json.loads(json.dumps(state["result"]))
    # the report: the Sweep section with a row per point, the crossover and the plot
    md = write_report(rec, [], tmp_path / "rep" / "run.md", tmp_path / "rep" / "run")
    text = md.read_text()
    assert "## Sweep: where the arms cross" in text and "### a vs b" in text and "**Crossover:**" in text
    assert f"| {FIRST_MIDPOINT} |" in text and "- refine a vs b: 126" in text
    assert (tmp_path / "rep" / "run" / "sweep.png").read_bytes()[:4] == b"\x89PNG" and "(run/sweep.png)" in text


def test_a_resumed_sweep_rebuilds_its_passes_and_goes_on(shared_run: tuple[dict, Path, RunRecord],
                                                          tmp_path: Path) -> None:
    prof, run_dir, full = shared_run
    mark = prof["engine"]["env"]["ABBENCH_TEST_MARK"]
    # cut inside the refinement pass, as an interrupt leaves a run
    cut = tmp_path / "cut"
    shutil.copytree(run_dir, cut)
    raw = json.loads((cut / RUN_FILE).read_text())
    keep = next(s["index"] for s in raw["plan"] if s["prompt_id"].startswith(f"sweep-{FIRST_MIDPOINT}-")) + 1
    raw["samples"] = raw["samples"][:keep]
    raw["status"], raw["status_reason"] = "partial", "interrupted (test)"
    for k in ("stopped", "result"):
        raw["sweep"].pop(k)
    raw["sweep"]["decisions"].pop()
    (cut / RUN_FILE).write_text(json.dumps(raw))
    lines = (cut / SAMPLES_FILE).read_bytes().splitlines(keepends=True)[:keep]
    (cut / SAMPLES_FILE).write_bytes(b"".join(lines))
    resumed = runner.execute(profile_from_dict(prof), cut, resume=True)
    assert resumed.status == "complete" and len(resumed.samples) == len(full.plan)
    assert [s.model_dump() for s in resumed.plan] == [s.model_dump() for s in full.plan]
    assert [p["points"] for p in resumed.sweep["passes"]] == [GRID, [FIRST_MIDPOINT]]
    assert resumed.sweep["stopped"] and resumed.sweep["result"]["pairs"]
    fk.assert_no_leftovers(mark)


def test_each_shared_service_is_a_stage_launched_once(tmp_path: Path) -> None:
    mark = fk.new_mark()
    arms = [{"name": "a-u", "service": "u", "request": SLOW_A}, {"name": "b-u", "service": "u", "request": FLAT_B},
            {"name": "a-z", "service": "z", "request": SLOW_A}, {"name": "b-z", "service": "z", "request": FLAT_B}]
    prof = sweep_profile(mark, arms=arms, engine={"shared_service": True},
                         sweep={"crossovers": [["a-u", "b-u"], ["a-z", "b-z"]]})
    prof["run"]["rounds"] = 1  # one pair a point: no interval, so the bracket alone decides
    prof["gate"] = {}
    rec = execute(prof, tmp_path / "run")
    assert rec.status == "complete"
    assert [(p["stage"], p["why"], p["points"]) for p in rec.sweep["passes"]] == [
        (0, "grid", GRID), (0, "refine a-u vs b-u", [FIRST_MIDPOINT]),
        (1, "grid", GRID), (1, "refine a-z vs b-z", [FIRST_MIDPOINT])]
    assert [s.key for s in rec.services] == ["u", "z"]  # each launched once, for all its points
    assert [s.service for s in rec.plan] == sorted((s.service for s in rec.plan), key=lambda k: k != "u")
    assert sum(1 for s in rec.plan if s.kind == "warmup") == 4  # each arm warms up once, when its service starts
    fk.assert_no_leftovers(mark)


def test_separate_services_launch_again_for_each_pass(tmp_path: Path) -> None:
    mark = fk.new_mark()
    prof = sweep_profile(mark)
    prof["run"]["rounds"] = 1
    prof["gate"] = {}
    rec = execute(prof, tmp_path / "run")
    assert rec.status == "complete"
    assert [s.key for s in rec.services] == ["a@r1", "b@r1", "a@r1.p1", "b@r1.p1"]
    assert sum(1 for s in rec.plan if s.kind == "warmup") == 4  # a relaunched service warms up again
    fk.assert_no_leftovers(mark)


def test_a_suffix_sweep_builds_the_prefix_with_its_own_request_fields(tmp_path: Path) -> None:
    mark = fk.new_mark()
    prof = sweep_profile(mark, engine={"shared_service": True},
                         sweep={"vary": "suffix", "prefix_tokens": 64, "points": [8, 32], "max_refinements": 0,
                                "prefix_request": {"prefill_mode": "layer-major"}})
    prof["arms"] = [{"name": "a", "request": {"prefill_mode": "demand"}},
                    {"name": "b", "request": {"prefill_mode": "chunked"}}]
    prof["run"].update(rounds=1, exclude_kinds=["warmup", "jit", "cold"])
    prof["gate"] = {}
    rec = execute(prof, tmp_path / "run")
    assert rec.status == "complete" and [p["why"] for p in rec.sweep["passes"]] == ["grid"]
    by_kind: dict[str, set] = {}
    for s in rec.samples:
        by_kind.setdefault(s.kind, set()).add((s.arm, s.engine["prefill_path"]))
    assert by_kind["cold"] == {("a", "layer-major"), ("b", "layer-major")}  # sweep.prefix_request
    assert by_kind["continuation"] == {("a", "demand"), ("b", "chunked")}  # the arm's own fields
    conts = {p.id: p for p in rec.prompts if p.kind == "continuation"}
    assert sorted(p.target_tokens for p in conts.values()) == [72, 96]
    assert analysis.sweep.points(rec) == {"sweep-8-0-cont": 8, "sweep-32-0-cont": 32}
    assert all(s.excluded == (s.kind in ("warmup", "cold")) for s in rec.plan)
    fk.assert_no_leftovers(mark)


def test_a_points_prompts_depend_on_the_point_alone() -> None:
    prof = profile_from_dict(sweep_profile("x", sweep={"per_point": 2}))
    tok = load_tokenizer("qwen3")
    alone = {b.record.id: b.record.sha256 for b in sweeps.build_points(tok, prof, [126])}
    among = {b.record.id: b.record.sha256 for b in sweeps.build_points(tok, prof, [20, 126, 800])}
    assert set(alone) == {"sweep-126-0", "sweep-126-1"} and all(among[k] == v for k, v in alone.items())
    assert len(set(among.values())) == 6  # every prompt its own text


@pytest.mark.parametrize("change, words", [
    ({"sweep": {"vary": "suffix", "points": [8, 32]}}, "needs prefix_tokens"),
    ({"sweep": {"vary": "length", "points": [8, 32], "prefix_tokens": 64}}, "only with vary"),
    ({"sweep": {"vary": "length", "points": [8]}}, "at least 2"),
    ({"sweep": {"vary": "length", "points": [8, 8]}}, "distinct"),
    ({"sweep": {"vary": "length", "points": [8, 32], "crossovers": [["a", "x"]]}}, "unknown arm 'x'"),
    ({"sweep": {"vary": "length", "points": [8, 32], "crossovers": [["a", "a"]]}}, "with itself"),
    ({"sweep": {"vary": "suffix", "points": [8, 32], "prefix_tokens": 64, "prefix_request": {"x": 1}}},
     "exclude them"),
    ({"run": {"rounds": "auto", "target_halfwidth": 0.1, "max_rounds": 3}}, "fixed number of rounds"),
    ({"run": {"exclude_kinds": ["fresh"]}}, "the prompts a length sweep measures"),
    ({"gate": {"checks": ["crossover[a, b] >= 1"]}, "sweep": None}, "needs a \\[sweep\\] table"),
])
def test_the_profile_refuses_a_sweep_it_cannot_run(change: dict, words: str) -> None:
    prof = sweep_profile("x")
    for k, v in change.items():
        if v is None:
            prof.pop(k)
        elif k == "run":
            prof["run"].update(v)
        else:
            prof[k] = v
    with pytest.raises(ConfigError, match=words):
        profile_from_dict(prof)


def test_crossover_arms_must_share_a_service() -> None:
    prof = sweep_profile("x", engine={"shared_service": True})
    prof["arms"][1]["service"] = "other"
    with pytest.raises(ConfigError, match="on different services"):
        profile_from_dict(prof)


def test_a_sweep_has_no_default_fresh_prompts_and_arms_override_keeps_its_pairs() -> None:
    prof = sweep_profile("x")
    prof["prompts"].pop("lengths")
    p = profile_from_dict(prof)
    assert p.prompts.lengths == []
    prof["arms"].append({"name": "c"})
    prof["sweep"]["crossovers"].append(["c", "b"])
    assert profile_from_dict(prof).with_overrides(arms=["a", "b"]).sweep.crossovers == [("a", "b")]


def test_abbench_sweep_builds_the_table_from_its_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mark = fk.new_mark()
    prof = sweep_profile(mark, engine={"shared_service": True})
    prof.pop("sweep")
    prof["gate"] = {}
    (tmp_path / "p.toml").write_text(fk.to_toml(prof))
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, ["sweep", "-p", str(tmp_path / "p.toml"), "--vary", "length", "--points", "20,800",
                                   "--rounds", "1", "--max-refinements", "0", "--json", "-q", "--no-report"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)  # the document alone on stdout
    assert data["schema"] == "abbench.sweep/1" and data["vary"] == "length" and data["stopped"]
    assert [p["why"] for p in data["passes"]] == ["grid"]
    (pair,) = data["pairs"]
    assert (pair["a"], pair["b"], [p["x"] for p in pair["points"]]) == ("a", "b", GRID)
    run_dir = next((tmp_path / "results").iterdir())
    rec, _ = load_run(run_dir)
    assert rec.profile["sweep"]["points"] == GRID and rec.profile["prompts"]["lengths"] == []
    res = CliRunner().invoke(app, ["sweep", "-p", str(tmp_path / "p.toml"), "--points", "20,800"])
    assert res.exit_code == 2 and "give --vary" in res.output
    fk.assert_no_leftovers(mark)


def test_render_without_a_sweep_has_no_sweep_section(tmp_path: Path) -> None:
    from tests.harness.test_sweep_analysis import power_law, synthetic

    rec = synthetic(power_law(700))
    assert "## Sweep: where the arms cross" in render_markdown(rec, [], analysis.analyze(rec), {}, {})
    rec.profile.pop("sweep")
    assert "## Sweep" not in render_markdown(rec, [], analysis.analyze(rec), {}, {})


def test_the_sweep_document_lists_what_docs_json_documents() -> None:
    """abbench sweep --json's document, on the committed cpu-tiny-sweep run: every field in docs/json.md."""
    from abbench.cli.documents import clean, sweep_document
    from tests.harness.test_machine_readable import RESULTS, _documented

    rec, _ = load_run(RESULTS / "cpu-tiny-sweep")
    doc = json.loads(json.dumps(clean(sweep_document(rec)), allow_nan=False))
    documented = _documented("abbench sweep --json")
    assert doc["schema"] == "abbench.sweep/1" and doc["run"]["run_id"] == "cpu-tiny-sweep"
    items = [doc, doc["run"], *doc["passes"], *doc["pairs"]]
    for pair in doc["pairs"]:
        items += [*pair["points"], pair["crossover"], *pair["crossover"]["crossings"]]
    for item in items:
        assert set(item) <= documented, f"undocumented fields {set(item) - documented}"
    assert [len(p["points"]) for p in doc["pairs"]] == [8, 8] and doc["stopped"]


def test_sweep_tick_labels_never_crowd_and_keep_the_ends() -> None:
    """Refined points bunch up near a crossover (4096, 4323, 4871, 5793 between 64 and 8192): every point keeps
    its tick, and labelled ones lie at least the minimum gap apart on the log axis."""
    from abbench.report.plots import _spaced_labels

    xs = [64.0, 512.0, 2048.0, 4096.0, 8192.0, 5793.0, 4871.0]
    left, right = min(xs) / 1.5, max(xs) * 1.5
    labels = _spaced_labels(xs, left, right, min_gap=0.07)
    assert len(labels) == len(xs) and labels[0] == "64" and labels[3] == "4096"
    shown = sorted(x for x, lab in zip(xs, labels) if lab)
    assert all(math.log(b / a) >= 0.07 * math.log(right / left) for a, b in zip(shown, shown[1:]))
    assert {lab for lab in labels if lab} == {f"{int(x)}" for x in shown}
    assert "" in labels  # 4871 and 5793 sit too close to 4096 to be named
