"""``abbench run`` with load levels: the runner's load strategy against a real server on loopback
(tests/support/fakeserver.py, launched by the run as one shared service), what run.json records, the gate's load
checks (complete cells, failed requests, parity between arms and under load; never a pass on missing data),
``--concurrency``/``--rate`` and their errors before any request, and a resume of a run stopped mid-level."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from abbench import analysis, runner
from abbench.analysis.load import load_levels
from abbench.results import RunRecord, load_run, save_run
from abbench.runner import plans
from abbench.profile import profile_from_dict

from tests.support import cli
from tests.support import faultkit as fk

LOAD = {"concurrency": [1, 3], "rate": [40.0], "requests": 6, "prompts": 3, "prompt_tokens": {"values": [20, 28]},
        "output_tokens": {"fixed": 4}, "slo": ["ttft_s <= 5"]}


def _profile(mark: str, **load: Any) -> dict[str, Any]:
    prof = fk.fake_profile(mark, name="load-run", arms=[{"name": "a", "request": {"prefill_mode": "chunked"}},
                                                         {"name": "b", "request": {"prefill_mode": "layer-major"}}],
                           run={"rounds": 2}, engine={"shared_service": True, "reset_path": "/reset",
                                                      "metrics_path": "/metrics"})
    prof["load"] = {**LOAD, **load}
    prof["gate"] = {"checks": ["parity_under_load[b, c=3]", "goodput[b, rate=40] >= 1"]}
    return prof


@pytest.fixture(scope="module")
def load_run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One load run through the command line, in this process (module-wide: each test copies what it changes)."""
    tmp = tmp_path_factory.mktemp("loadrun")
    mark = fk.new_mark()
    toml = fk.write_profile(tmp / "p.toml", _profile(mark))
    res = cli.abbench("run", "-p", str(toml), "--out", str(tmp / "run"), "-q", "--no-report", cwd=tmp)
    fk.assert_no_leftovers(mark)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines()[-1] == "gate: PASS", res.stdout
    assert "run complete: 16 load levels, 84 requests (84 ok)" in fk.flat(res.stderr)
    return tmp / "run"


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("run.lock"))
    return dst


def _checks(record: RunRecord) -> dict[str, Any]:
    return {c.name: c for c in analysis.gate(record).checks}


def test_a_load_profile_gets_the_load_strategy_and_no_sequential_plan() -> None:
    prof = profile_from_dict(_profile("x"))
    strategy = plans.for_profile(prof)
    assert type(strategy) is plans.LoadLevels and not strategy.sequential
    cells = strategy.cells()
    assert len(cells) == 2 * 2 * 4 and {c.service for c in cells} == {"shared"}
    round2 = [(c.level.role, c.level.kind, c.level.value, c.arm) for c in cells if c.round == 2][:4]
    assert round2 == [("reference", "concurrency", 1.0, "b"), ("reference", "concurrency", 1.0, "a"),
                      ("load", "concurrency", 1.0, "b"), ("load", "concurrency", 1.0, "a")]  # reversed: ABBA


def test_the_run_records_every_cell_in_abba_order_on_one_shared_service(load_run_dir: Path) -> None:
    record, problems = load_run(load_run_dir)
    assert record.status == "complete" and not problems
    assert record.plan == [] and record.samples == []
    assert [p.id for p in record.prompts] == ["load-0", "load-1", "load-2"]
    assert [(s.key, s.error) for s in record.services] == [("shared", None)]  # one service, reused by every cell
    order = [(lv.round, lv.role, lv.label, lv.arm, lv.position) for lv in record.load]
    assert order[:4] == [(1, "reference", "c=1", "a", 0), (1, "reference", "c=1", "b", 1),
                         (1, "load", "c=1", "a", 0), (1, "load", "c=1", "b", 1)]
    assert order[8:10] == [(2, "reference", "c=1", "b", 0), (2, "reference", "c=1", "a", 1)]
    for lv in record.load:
        assert lv.stopped is None and lv.service == "shared" and all(r.ok for r in lv.requests)
        assert len(lv.requests) == (3 if lv.role == "reference" else 6)
        assert {r.prompt_sha256 for r in lv.requests} <= {p.sha256 for p in record.prompts}
        assert all(r.engine and r.engine.get("prefill_path") == {"a": "chunked", "b": "layer-major"}[lv.arm]
                   for r in lv.requests)  # the arm's request fields reached the server
    rate = [lv for lv in record.load if lv.kind == "rate"]
    assert rate and all(r.scheduled_s is not None for lv in rate for r in lv.requests)
    checks = _checks(record)
    assert [c for c in checks][:6] == ["run-complete", "load-levels", "reference", "token-ids", "parity",
                                       "parity-under-load"]
    assert all(c.passed for c in checks.values())
    assert checks["load-levels"].detail.startswith("16/16 planned levels complete; 84/84 measured requests ok")
    assert checks["parity"].detail == "6/6 runs alone equal to a's over the first 8 ids"


def test_the_gate_never_passes_a_load_run_with_a_missing_or_stopped_cell(load_run_dir: Path) -> None:
    record, _ = load_run(load_run_dir)
    gone = record.model_copy(deep=True)
    dropped = gone.load.pop(5)
    verdict = analysis.gate(gone)
    assert not verdict.passed
    assert f"missing: arm {dropped.arm} concurrency 3, round 1: no complete level recorded" in verdict.failures
    stopped = record.model_copy(deep=True)
    stopped.load[5].stopped = "interrupted"
    assert not _checks(stopped)["load-levels"].passed
    nothing = record.model_copy(deep=True, update={"load": []})
    checks = _checks(nothing)
    assert not checks["load-levels"].passed and not checks["reference"].passed
    assert checks["parity"].result == "not checked" and checks["parity-under-load"].result == "not checked"


def test_failed_load_requests_fail_the_gate_beyond_max_failed_samples(load_run_dir: Path) -> None:
    record, _ = load_run(load_run_dir)
    rec = record.model_copy(deep=True)
    req = rec.load[5].requests[2]
    req.ok, req.error_kind, req.status, req.error, req.output_ids = False, "http", 429, "too many requests", []
    checks = _checks(rec)
    assert not checks["load-levels"].passed
    assert "failed: arm b c=3, round 1, request 2 (load-2): http 429: too many requests" in analysis.gate(rec).failures
    rec.profile["gate"]["max_failed_samples"] = 1
    verdict = analysis.gate(rec)
    assert _checks(rec)["load-levels"].passed
    assert "1 failed load request(s) tolerated (gate.max_failed_samples = 1)" in verdict.notes


def test_parity_between_arms_and_under_load_name_where_ids_differ(load_run_dir: Path) -> None:
    record, _ = load_run(load_run_dir)
    rec = record.model_copy(deep=True)
    alone_b = next(lv for lv in rec.load if lv.role == "reference" and lv.arm == "b" and lv.round == 1)
    r = next(x for x in alone_b.requests if x.prompt_id == "load-1")
    r.output_ids = r.output_ids[:2] + [r.output_ids[2] + 1] + r.output_ids[3:]
    r.logprobs = None  # no runner-up to show: not a near tie
    verdict = analysis.gate(rec)
    checks = _checks(rec)
    assert not checks["parity"].passed and not checks["parity-under-load"].passed
    assert "parity: prompt load-1, arm b alone, round 1: broken at token 2 against a" in verdict.failures
    assert any(f.startswith("parity-under-load: arm b c=1: 2/3 prompts kept") for f in verdict.failures)
    assert checks["parity_under_load[b, c=3] >= 1"].result == "FAIL"


def test_a_run_stopped_mid_level_resumes_at_that_level(load_run_dir: Path, tmp_path: Path) -> None:
    run_dir = _copy(load_run_dir, tmp_path / "run")
    record, _ = load_run(run_dir)
    whole = record.model_copy(deep=True)
    record.load = record.load[:6]
    stopped = record.load[5]
    stopped.requests = stopped.requests[:2]
    stopped.stopped = "interrupted: the requests that finished are kept"
    record.status, record.status_reason = "partial", "interrupted (SIGINT)"
    save_run(run_dir, record)
    mark = fk.new_mark()
    record.profile["engine"]["env"] = {"ABBENCH_TEST_MARK": mark}
    save_run(run_dir, record)
    events: list = []
    out = runner.execute(profile_from_dict(record.profile), run_dir, resume=True, observer=events.append)
    fk.assert_no_leftovers(mark)
    assert out.status == "complete" and len(out.load) == 17
    # progress counts the cells (a load run has no samples): from the resumed one (5 done of 16) to 16 of 16
    shown = [(e.done, e.total) for e in events if e.kind == "service" and e.message.startswith("load:")]
    assert shown[0] == (5, 16) and shown[-1] == (16, 16) and {t for _, t in shown} == {16}
    assert out.load[5].stopped is not None and len(out.load[5].requests) == 2  # the finished requests are kept
    again = out.load[6]
    assert (again.round, again.role, again.label, again.arm) == (1, "load", "c=3", "b") and again.stopped is None
    assert [(lv.round, lv.label, lv.arm) for lv in out.load[6:]] == [
        (lv.round, lv.label, lv.arm) for lv in whole.load[5:]]
    assert stopped not in load_levels(out) and len(load_levels(out)) == 12  # the complete cell replaces it
    assert analysis.gate(out).passed
    assert out.environment.get("resumed")


@pytest.mark.parametrize(("flags", "message"), [
    (("--concurrency", "0"), "--concurrency 0: 0 is not a concurrency"),
    (("--concurrency", "2,x"), "--concurrency 2,x: 'x' is not a number"),
    (("--rate", "-1"), "--rate -1: -1 is not a rate"),
])
def test_bad_levels_on_the_command_line_fail_before_any_request(tmp_path: Path, flags: tuple[str, ...],
                                                                message: str) -> None:
    mark = fk.new_mark()
    toml = fk.write_profile(tmp_path / "p.toml", _profile(mark))
    res = cli.abbench("run", "-p", str(toml), "--out", str(tmp_path / "run"), "-q", *flags, cwd=tmp_path)
    assert res.returncode == 2 and message in fk.flat(res.stderr), res.stderr
    assert not (tmp_path / "run").exists() and not fk.marked_processes(mark)


def test_levels_need_a_streaming_profile_and_a_fresh_run(tmp_path: Path) -> None:
    mark = fk.new_mark()
    prof = fk.fake_profile(mark, request={"stream": False})
    toml = fk.write_profile(tmp_path / "p.toml", prof)
    res = cli.abbench("run", "-p", str(toml), "--out", str(tmp_path / "run"), "-q", "--concurrency", "2", cwd=tmp_path)
    assert res.returncode == 2 and "request.stream must be true" in fk.flat(res.stderr), res.stderr
    res = cli.abbench("run", "--resume", str(tmp_path / "run"), "--rate", "2", cwd=tmp_path)
    assert res.returncode == 2 and "--resume continues a run with its recorded profile" in fk.flat(res.stderr)
    assert not fk.marked_processes(mark)


def test_the_load_plan_sits_on_the_plans_floor() -> None:
    from tests.harness.test_import_layers import graph

    deps = graph()["abbench.runner.plans.load"]
    assert "abbench.loadgen" in deps or any(d.startswith("abbench.loadgen") for d in deps)
    assert not [d for d in deps if d in ("abbench.runner.run", "abbench.runner.slot", "abbench.client")]


def test_the_recorded_prompts_are_the_load_generators_own(load_run_dir: Path) -> None:
    from abbench.loadgen import build_load_prompts
    from abbench.tokenizers import load_tokenizer

    record, _ = load_run(load_run_dir)
    prof = profile_from_dict(record.profile)
    assert prof.load is not None
    rebuilt = build_load_prompts(load_tokenizer("qwen3"), prof.prompts, prof.load, prof.request.max_tokens)
    assert [(p.id, p.target_tokens, p.record.sha256 if p.record else None) for p in rebuilt] == [
        (p.id, p.target_tokens, p.sha256) for p in record.prompts]


def test_sigint_mid_level_keeps_the_finished_requests_and_the_resume_completes_the_run(tmp_path: Path) -> None:
    import json
    import signal

    mark = fk.new_mark()
    prof = _profile(mark, concurrency=[1, 2], rate=[], requests=8)
    for arm in prof["arms"]:
        arm["request"]["fake_token_delay_s"] = 0.05  # a level takes about a second and a half
    prof["gate"] = {}
    toml = fk.write_profile(tmp_path / "p.toml", prof)
    run_dir = tmp_path / "run"

    def levels() -> int:
        try:
            return len(json.loads((run_dir / "run.json").read_text())["load"])
        except (OSError, ValueError, KeyError):
            return 0

    proc = fk.abbench_popen("run", "-p", str(toml), "--out", str(run_dir), "-q", "--no-report", cwd=tmp_path,
                            out=tmp_path / "out.txt")
    try:
        fk.wait_for(lambda: levels() >= 3, timeout=60, what="three levels recorded")
        time.sleep(0.5)  # inside the next level
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 130, (tmp_path / "out.txt").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    fk.assert_no_leftovers(mark)
    record, _ = load_run(run_dir)
    assert record.status == "partial"
    last = record.load[-1]
    assert last.stopped is not None and len(last.requests) <= 8
    n = len(record.load)
    res = cli.abbench("run", "--resume", str(run_dir), "-q", "--no-report", cwd=tmp_path)
    fk.assert_no_leftovers(mark)
    assert res.returncode == 0, res.stderr
    done, _ = load_run(run_dir)
    assert done.status == "complete" and done.load[:n] == record.load
    assert (done.load[n].arm, done.load[n].label, done.load[n].round) == (last.arm, last.label, last.round)
    assert len(done.load) == n + 12 - (n - 1) and analysis.gate(done).passed


def test_the_report_of_a_load_run_shows_its_levels_and_leaves_the_sequential_sections_out(
        load_run_dir: Path, tmp_path: Path) -> None:
    from abbench.report import write_report

    record, problems = load_run(load_run_dir)
    text = write_report(record, problems, tmp_path / "r.md", tmp_path / "r").read_text(encoding="utf-8")
    assert "## Load levels" in text and "### Parity under load" in text and "- **Rounds:** 2" in text
    for gone in ("## TTFT per arm", "## Paired ratios", "## Parity\n", "## Active path", "the run holds no plan",
                 "ttft.png: not drawn"):
        assert gone not in text, gone
    assert "16 load levels (0 stopped by an interrupt), 84 requests, 84 ok; no sequential samples" in text
    assert "| load-levels | pass | 16/16 planned levels complete" in text


def test_load_prompts_past_the_servers_context_stop_the_run_before_any_request(tmp_path: Path) -> None:
    mark = fk.new_mark()
    prof = _profile(mark, prompt_tokens={"fixed": 40}, output_tokens={"fixed": 30})
    prof["engine"]["command"] = [*prof["engine"]["command"], "--max-model-len", "64"]
    toml = fk.write_profile(tmp_path / "p.toml", prof)
    res = cli.abbench("run", "-p", str(toml), "--out", str(tmp_path / "run"), "-q", cwd=tmp_path)
    fk.assert_no_leftovers(mark)
    err = fk.flat(res.stderr)
    assert res.returncode == 2, err
    assert "the server's context is 64 tokens" in err and "prompt load-0 has 40 tokens" in err
    assert "asks for 30 more (70)" in err
    assert not (tmp_path / "run" / "run.json").exists()


def _warm_run(tmp: Path, warmup_requests: int) -> tuple[dict[str, int], RunRecord]:
    """A load run against an in-process fake server (two arms, c=2 and rate=inf): the server's counters, the
    record."""
    from abbench.engine.serve.tokenizer import load_tokenizer as engine_tokenizer

    from tests.support.fakeserver import FakeConfig, FakeServer

    tmp.mkdir()
    with FakeServer(FakeConfig(), tokenizer=engine_tokenizer("qwen3")) as srv:
        prof = {"name": "warm", "tokenizer": {"source": "qwen3"},
                "request": {"max_tokens": 4, "logprobs": 2, "timeout_s": 10},
                "engine": {"base_url": srv.base_url, "reset_path": "/reset"},
                "arms": [{"name": "a"}, {"name": "b"}], "run": {"rounds": 1},
                "load": {"concurrency": [2], "rate": ["inf"], "requests": 4, "prompts": 2,
                         "prompt_tokens": {"fixed": 20}, "output_tokens": {"fixed": 3},
                         "warmup_requests": warmup_requests}}
        toml = fk.write_profile(tmp / "p.toml", prof)
        res = cli.abbench("run", "-p", str(toml), "--out", str(tmp / "run"), "-q", "--no-report", cwd=tmp)
        assert res.returncode == 0, res.stderr
        stats = srv.stats()
    record, _ = load_run(tmp / "run")
    return stats, record


def test_warm_up_requests_run_before_each_level_unrecorded_then_the_cache_is_reset(tmp_path: Path) -> None:
    """``warmup_requests``: that many requests before each level (not before the parity reference), none of
    them in the record, and a reset after them; the measured requests are the same as without."""
    cold_stats, cold = _warm_run(tmp_path / "cold", 0)
    warm_stats, warm = _warm_run(tmp_path / "warm", 3)
    levels = 2 * 2  # 2 arms x (c=2, rate=inf); the parity reference cells get none
    shape = [(lv.arm, lv.role, lv.kind, lv.value, len(lv.requests)) for lv in warm.load]
    assert shape == [(lv.arm, lv.role, lv.kind, lv.value, len(lv.requests)) for lv in cold.load]
    assert warm_stats["completions"] - cold_stats["completions"] == 3 * levels
    assert warm_stats["resets"] - cold_stats["resets"] == levels
    assert {r.prompt_id for lv in warm.load for r in lv.requests} == {"load-0", "load-1"}


def test_warm_up_prompts_are_none_of_the_measured_ones() -> None:
    from abbench.loadgen import build_load_prompts, build_warmup_prompts
    from abbench.profile import LoadSpec, PromptsSpec
    from abbench.tokenizers import load_tokenizer

    tok = load_tokenizer("qwen3")
    load = LoadSpec(concurrency=[4], requests=8, prompts=4, prompt_tokens={"values": [40, 64]},
                    output_tokens={"fixed": 5}, warmup_requests=6)
    measured = build_load_prompts(tok, PromptsSpec(), load, 16)
    warm = build_warmup_prompts(tok, PromptsSpec(), load, 16)
    assert len(warm) == 6 and {p.target_tokens for p in warm} <= {40, 64}
    assert {p.max_tokens for p in warm} == {5}
    assert all(len(tok.encode(p.prompt, add_special_tokens=False)) == p.target_tokens for p in warm)
    firsts = {p.prompt[:40] for p in measured}
    assert not any(p.prompt[:40] in firsts for p in warm)  # not even a shared opening
    assert build_warmup_prompts(tok, PromptsSpec(), load.model_copy(update={"warmup_requests": 0}), 16) == []
