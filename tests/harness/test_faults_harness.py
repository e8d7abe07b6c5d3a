"""Faults injected for real into the harness: misbehaving engine services (tests/support/fakeserver.py launched as a
subprocess by the runner), a busy port, a missing binary, signals sent to a real ``abbench run``, resumed
runs, damaged result files, invalid profiles through the CLI.

Every test that launches services marks them (``ABBENCH_TEST_MARK`` in their environment) and checks at the
end that none of them is left running.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sys
from pathlib import Path
from typing import Any, Iterator

import psutil
import pytest

from abbench import analysis, runner, services
from abbench.errors import ConfigError, ServiceError
from abbench.profile import profile_from_dict
from abbench.report import write_report
from abbench.results import RUN_FILE, SAMPLES_FILE, RunRecord, Sample, load_run, read_samples

from tests.support import cli
from tests.support import faultkit as fk


@pytest.fixture(autouse=True, scope="module")
def one_tokenizer_per_module() -> Iterator[None]:
    """Every run here (in this process: runner.execute and the in-process CLI) builds its prompts with the same
    qwen3 tokenizer: it is read from the on-disk cache once for the module instead of once a run (~0.5 s each).
    What a run does with it is unchanged; tests/harness/test_tokenizers.py tests the loading itself."""
    import importlib

    run_module = importlib.import_module("abbench.runner.run")
    load, loaded = run_module.load_tokenizer, {}

    def load_once(source: str, *, base_dir: Path | None = None, cache_dir: Path | None = None) -> Any:
        key = (source, base_dir, cache_dir, os.environ.get("ABBENCH_CACHE_DIR"))
        if key not in loaded:
            loaded[key] = load(source, base_dir=base_dir, cache_dir=cache_dir)
        return loaded[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(run_module, "load_tokenizer", load_once)
        yield


def run_profile(profile: dict[str, Any], run_dir: Path, events: list | None = None) -> RunRecord:
    obs = events.append if events is not None else None
    return runner.execute(profile_from_dict(profile), run_dir, observer=obs)


def samples_by_step(record: RunRecord) -> dict[int, Sample]:
    return {s.step: s for s in record.samples}


def assert_failed_sample(s: Sample, kind: str, *fragments: str) -> None:
    """A failed sample: the reason is recorded, no timing is."""
    assert not s.ok and s.error_kind == kind, (s.error_kind, s.error)
    assert s.ttft_s is None and s.total_s is None and s.output_ids == []
    for frag in fragments:
        assert frag in (s.error or ""), (frag, s.error)


# ------------------------------------------------------------------------------------ service start-up


def test_never_healthy_stops_the_run_with_the_log_tail(tmp_path: Path) -> None:
    mark = fk.new_mark()
    prof = fk.fake_profile(mark, args=("--never-healthy",), engine={"health_timeout_s": 1.0})
    toml = fk.write_profile(tmp_path / "sick.toml", prof)
    res = cli.abbench("run", "-p", str(toml), "--out", str(tmp_path / "run"), "-q", "--no-report", cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    err = fk.flat(res.stderr)
    assert "service a@r1: not healthy after 1 s (GET /health at http://127.0.0.1:" in err
    assert "the process was killed" in err and "--- last lines of the service log ---" in err
    assert "fakeserver starting (mode=normal" in err  # the service's own words, from its log
    # nothing was measured: no run is left to become "the latest run"; the log the error names stays
    assert f"nothing was measured, so no run was saved in {tmp_path / 'run'} (the service logs stay in" in err
    assert not (tmp_path / "run" / RUN_FILE).exists() and not (tmp_path / "run" / SAMPLES_FILE).exists()
    assert (tmp_path / "run" / "logs" / "a_r1.log").read_text().count("fakeserver starting") == 1
    fk.assert_no_leftovers(mark)


def test_never_healthy_skip_arm_records_failed_samples_and_runs_the_others(tmp_path: Path) -> None:
    mark = fk.new_mark()
    prof = fk.fake_profile(mark, arms=[{"name": "good"}, {"name": "sick", "args": ["--never-healthy"]}],
                           run={"rounds": 2, "on_service_failure": "skip-arm"},
                           engine={"health_timeout_s": 6.0})  # the good arm's start on a loaded 2-core machine
    events: list[runner.ProgressEvent] = []
    record = run_profile(prof, tmp_path / "run", events)
    assert record.status == "complete"
    assert len(record.samples) == len(record.plan)  # nothing silently missing
    good = [s for s in record.samples if s.arm == "good"]
    sick = [s for s in record.samples if s.arm == "sick"]
    assert good and all(s.ok for s in good), [(s.prompt_id, s.error) for s in good]
    assert sick and all(s.error_kind == "service" and s.ttft_s is None for s in sick)
    assert "not healthy after 6 s" in sick[0].error
    assert all(s.error == "arm skipped: its service failed" for s in sick[1:])
    # the sick arm was launched once (round 1), not again in round 2
    assert [s.key for s in record.services if "sick" in s.arms] == ["sick@r1"]
    warning = [e.message for e in events if e.kind == "warning"]
    assert len(warning) == 1 and "arm sick skipped" in warning[0] and "last lines of the service log" in warning[0]
    verdict = analysis.gate(record)
    assert not verdict.passed and any("failed:" in f and "sick" in f for f in verdict.failures)
    fk.assert_no_leftovers(mark)


def test_command_not_found(tmp_path: Path) -> None:
    prof = fk.fake_profile(fk.new_mark())
    prof["engine"]["command"] = ["/nonexistent/bin/engine-server", "--port", "{port}"]
    toml = fk.write_profile(tmp_path / "p.toml", prof)
    res = cli.abbench("run", "-p", str(toml), "--out", str(tmp_path / "run"), "-q", "--no-report", cwd=tmp_path)
    assert res.returncode == 2
    assert ("command not found: /nonexistent/bin/engine-server; check engine.command in the profile"
            in fk.flat(res.stderr))
    assert not (tmp_path / "run" / RUN_FILE).exists()  # nothing was measured: no run left behind


def test_a_base_url_nothing_answers_at_fails_fast_and_leaves_no_run(tmp_path: Path) -> None:
    """A server the harness did not start and that is not there: exit 2 within seconds (not the 180 s health
    timeout) naming the cause and the URL, and no run directory left behind."""
    import time

    port = services.free_port()
    prof = fk.fake_profile(fk.new_mark(), engine={"health_timeout_s": 180})
    del prof["engine"]["command"]
    prof["engine"]["base_url"] = f"http://127.0.0.1:{port}"
    toml = fk.write_profile(tmp_path / "p.toml", prof)
    t0 = time.perf_counter()
    res = cli.abbench("run", "-p", str(toml), "--out", str(tmp_path / "run"), "-q", cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    # the CLI's start and tokenizer load, then REFUSED_GRACE_S: strictly under the 180 s health timeout it must not
    # wait out (60 s gave a loaded 2-core machine's start-up too little room)
    assert time.perf_counter() - t0 < 120
    err = fk.flat(res.stderr)
    assert f"connection refused at http://127.0.0.1:{port}: nothing listens on 127.0.0.1 port {port}" in err
    assert "start the server first, or fix base_url in the profile" in err
    assert f"nothing was measured, so no run was saved in {tmp_path / 'run'}" in err
    assert not (tmp_path / "run").exists()


def test_fixed_port_in_the_command_is_refused_before_anything_starts(tmp_path: Path) -> None:
    """A command with a fixed port (no {port}) would be health-checked on the port abbench chose, or worse,
    find someone else's server on its own: refused with the field and the fix."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        prof = fk.fake_profile(fk.new_mark())
        prof["engine"]["command"] = [sys.executable, str(fk.FAKESERVER), "--port", str(busy.getsockname()[1])]
        toml = fk.write_profile(tmp_path / "p.toml", prof)
        res = cli.abbench("run", "-p", str(toml), "--out", str(tmp_path / "run"), "-q", cwd=tmp_path)
    assert res.returncode == 2
    err = fk.flat(res.stderr)
    assert "engine.command + arms[0].args (arm a)" in err and "has no {port} placeholder" in err
    assert '"--port", "{port}"' in err
    assert not (tmp_path / "run").exists()


def test_port_taken_between_pick_and_launch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The free-port race: another process binds the port abbench picked before the service starts."""
    mark = fk.new_mark()
    with socket.socket() as thief:
        thief.bind(("127.0.0.1", 0))
        thief.listen()
        port = thief.getsockname()[1]
        monkeypatch.setattr(services, "free_port", lambda host="127.0.0.1": port)
        with pytest.raises(ServiceError, match=f"port {port} on 127.0.0.1 is already in use") as e:
            run_profile(fk.fake_profile(mark), tmp_path / "run")
    assert "stop that process or let abbench pick a free port" in str(e.value)
    # the owner is named: this test process holds the port (psutil sees every listener's pid as root; as
    # another user it may not, and the message then says so)
    owner = f"already in use by pid {os.getpid()} ({psutil.Process().name()});"
    if os.geteuid() == 0:
        assert owner in str(e.value), str(e.value)
    else:
        assert owner in str(e.value) or "already in use by another process;" in str(e.value), str(e.value)
    assert not (tmp_path / "run" / RUN_FILE).exists()  # nothing was measured: no run left behind
    fk.assert_no_leftovers(mark)


def test_out_that_is_a_file_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "taken").write_text("not a directory")
    prof = fk.write_profile(tmp_path / "p.toml", fk.fake_profile(fk.new_mark()))
    for out in (tmp_path / "taken", tmp_path / "taken" / "run"):  # a file there, or on the way
        res = cli.abbench("run", "-p", str(prof), "--out", str(out), "-q", cwd=tmp_path)
        assert res.returncode == 2 and "Traceback" not in res.stderr
        assert "cannot write there" in fk.flat(res.stderr) and "choose another --out" in fk.flat(res.stderr)
        assert "is a file" in fk.flat(res.stderr)


# ------------------------------------------------------------------------------- a service that dies


@pytest.mark.parametrize("policy", ["continue", "restart", "stop"])
def test_service_dies_mid_run(tmp_path: Path, policy: str) -> None:
    """The service exits while answering step 3. The sample is failed with the reason; the finished ones are
    kept; the service is launched again for the next step (primed with the block's warm-up) or the run
    stops, as the profile says."""
    mark = fk.new_mark()
    prof = fk.fake_profile(mark, args=("--die-after-requests", "3"), prompts={"per_length": 4},
                           run={"on_request_failure": policy})
    events: list[runner.ProgressEvent] = []
    record = run_profile(prof, tmp_path / "run", events)
    by_step = samples_by_step(record)
    assert [by_step[i].ok for i in (0, 1, 2)] == [True, True, True]  # warm-up and two fresh prompts
    assert_failed_sample(by_step[3], "connect", "POST http://127.0.0.1:")
    first = record.services[0]
    assert first.exit_code == 17  # tests/support/fakeserver.py EXIT_ON_DIE: it died, it was not stopped
    if policy == "stop":
        assert record.status == "partial" and "stopped after a failed request at step 3" in record.status_reason
        assert sorted(by_step) == [0, 1, 2, 3] and len(record.services) == 1
    else:
        assert record.status == "complete"
        assert by_step[4].ok  # served by the relaunched service
        assert "exited during step 3 (connect failure)" in first.error
        assert [s.key for s in record.services] == ["a@r1", "a@r1"]
        assert record.services[1].log == "logs/a_r1.restart1.log" and record.services[1].error is None
        assert any(e.kind == "warning" and "launched again" in e.message for e in events)
        assert any(e.kind == "service" and "priming a@r1: re-sending 1" in e.message for e in events)
    on_disk = [Sample.model_validate(x) for x in fk.jsonl_lines(tmp_path / "run" / SAMPLES_FILE)]
    assert on_disk == record.samples
    fk.assert_no_leftovers(mark)


@pytest.mark.parametrize("policy, launches, n_samples", [("continue", 1, 2), ("restart", 2, 2), ("stop", 1, 1)])
def test_hanging_request_times_out(tmp_path: Path, policy: str, launches: int, n_samples: int) -> None:
    """Every request hangs (the server reads it and never answers; its health check stays fine): each is a
    failed 'timeout' sample after request.timeout_s, and the profile decides what happens next."""
    mark = fk.new_mark()
    prof = fk.fake_profile(mark, arms=[{"name": "a", "request": {"fake_mode": "hang"}}],
                           prompts={"per_length": 2, "warmup": 0}, request={"timeout_s": 0.3},
                           run={"on_request_failure": policy})
    record = run_profile(prof, tmp_path / "run")
    assert len(record.samples) == n_samples
    for s in record.samples:
        assert_failed_sample(s, "timeout", "no complete response within 0.3 s (request.timeout_s)")
    assert len(record.services) == launches
    assert record.status == ("partial" if policy == "stop" else "complete")
    fk.assert_no_leftovers(mark)


def test_a_service_stuck_after_a_timeout_is_launched_again(tmp_path: Path) -> None:
    """The service stops answering while still alive (step 3's request hangs, then its health check fails):
    the sample is a 'timeout' failure and, whatever ``on_request_failure`` says, the service is stopped and
    launched again for the next step, which it serves; the first launch's record says why."""
    mark = fk.new_mark()
    prof = fk.fake_profile(mark, args=("--wedge-after-requests", "3"), prompts={"per_length": 4},
                           request={"timeout_s": 0.5}, run={"on_request_failure": "continue"})
    record = run_profile(prof, tmp_path / "run")
    by_step = samples_by_step(record)
    assert [by_step[i].ok for i in (0, 1, 2)] == [True, True, True]
    assert_failed_sample(by_step[3], "timeout", "no complete response within 0.5 s")
    assert "stopped answering its health check after step 3 (timeout failure)" in (record.services[0].error or "")
    assert len(record.services) == 2 and by_step[4].ok  # served by the service launched again
    assert record.status == "complete"
    fk.assert_no_leftovers(mark)


# ---------------------------------------------------------------------- broken responses, one per arm


BROKEN = {  # fake mode -> (error_kind, a fragment of the recorded reason)
    "malformed-sse": ("sse", "is not JSON"),
    "no-done": ("no-done", "without [DONE]"),
    "bad-finish-reason": ("finish-reason", "finish_reason='stop'"),
    "usage-mismatch": ("usage", "prompt_tokens"),
    "http-500": ("http", "HTTP 500"),
    "http-400": ("http", "HTTP 400"),
    "error-event": ("http", "the server reported an error inside the stream"),
    "count-mismatch": ("protocol", "completion_tokens"),
}


def test_broken_responses_are_failed_samples_with_precise_reasons(tmp_path: Path) -> None:
    mark = fk.new_mark()
    arms = [{"name": "normal"}] + [{"name": m, "request": {"fake_mode": m}} for m in BROKEN]
    prof = fk.fake_profile(mark, arms=arms, prompts={"warmup": 0}, engine={"shared_service": True})
    record = run_profile(prof, tmp_path / "run")
    assert record.status == "complete" and len(record.services) == 1  # one service took all the abuse
    by_arm = {s.arm: s for s in record.samples}
    assert by_arm["normal"].ok and by_arm["normal"].ttft_s is not None
    for mode, (kind, fragment) in BROKEN.items():
        assert_failed_sample(by_arm[mode], kind, fragment)
    verdict = analysis.gate(record)
    assert not verdict.passed
    for mode in BROKEN:
        assert any(f.startswith("failed:") and f"arm {mode}," in f for f in verdict.failures), mode
    fk.assert_no_leftovers(mark)


# --------------------------------------------------------------------------------- signals and resume


def _interrupted_run(tmp_path: Path, sig: int, *, at_startup: bool = False) -> tuple[Path, str, str]:
    """A real `abbench run` (two arms, two rounds, a service per arm and round), stopped by ``sig`` once five
    samples are on disk (or, ``at_startup``, while the first service is starting and not yet healthy).
    Returns the run directory, the test mark and the command's output."""
    mark = fk.new_mark()
    args = ("--token-delay", "0.05") + (("--startup-delay", "3") if at_startup else ())
    prof = fk.fake_profile(mark, args=args, arms=[{"name": "a"}, {"name": "b"}], prompts={"per_length": 3},
                           run={"rounds": 2})
    toml = fk.write_profile(tmp_path / "p.toml", prof)
    run_dir = tmp_path / "run"
    out = tmp_path / "out.txt"
    proc = fk.abbench_popen("run", "-p", str(toml), "--out", str(run_dir), "-q", "--no-report", cwd=tmp_path,
                            out=out)
    try:
        jsonl = run_dir / SAMPLES_FILE
        if at_startup:
            fk.wait_for(lambda: fk.marked_processes(mark) or proc.poll() is not None, timeout=90,
                        what="the first service")
        else:
            fk.wait_for(lambda: jsonl.exists() and jsonl.read_bytes().count(b"\n") >= 5 or proc.poll() is not None,
                        timeout=90, what="five samples")
        assert proc.poll() is None, out.read_text()
        assert fk.marked_processes(mark), "no service running at the moment of the signal"
        os.kill(proc.pid, sig)
        rc = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = out.read_text()
    assert rc == 130, text
    return run_dir, mark, text


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_leaves_a_valid_partial_run_and_no_process(tmp_path: Path, sig: int) -> None:
    run_dir, mark, text = _interrupted_run(tmp_path, sig)
    fk.assert_no_leftovers(mark, grace_s=0.5)  # torn down before abbench exited, not some time later
    assert "interrupted" in fk.flat(text) and f"abbench run --resume {run_dir}" in fk.flat(text)
    raw = json.loads((run_dir / RUN_FILE).read_text())
    assert raw["status"] == "partial" and raw["status_reason"].startswith("interrupted")
    lines = fk.jsonl_lines(run_dir / SAMPLES_FILE)  # every line whole and valid
    assert [Sample.model_validate(x).step for x in lines] == [s["step"] for s in raw["samples"]]
    assert len(lines) >= 5 and len(lines) < len(raw["plan"])
    assert all(s["stopped_at"] is not None and s["exit_code"] is not None for s in raw["services"])
    if sig == signal.SIGINT:  # then finish it
        _check_resume(tmp_path, run_dir, mark)


@pytest.mark.slow
def test_signal_while_a_service_starts(tmp_path: Path) -> None:
    """SIGTERM while abbench waits for the first service to become healthy: nothing is left running, and as
    nothing was measured no run is left behind (the service's log stays)."""
    run_dir, mark, text = _interrupted_run(tmp_path, signal.SIGTERM, at_startup=True)
    fk.assert_no_leftovers(mark, grace_s=0.5)
    assert "interrupted before the first sample; nothing was measured" in fk.flat(text)
    assert not (run_dir / RUN_FILE).exists() and not (run_dir / SAMPLES_FILE).exists()
    assert (run_dir / "logs" / "a_r1.log").is_file()


def _check_resume(tmp_path: Path, run_dir: Path, mark: str) -> None:
    before = (run_dir / SAMPLES_FILE).read_bytes()
    done = [json.loads(x)["step"] for x in before.splitlines()]
    res = cli.abbench("run", "--resume", str(run_dir), "-q", "--no-report", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    after = (run_dir / SAMPLES_FILE).read_bytes()
    assert after.startswith(before)  # the finished samples are untouched, byte for byte
    new = [json.loads(x)["step"] for x in after[len(before):].splitlines()]
    record, problems = load_run(run_dir)
    assert problems == [] and record.status == "complete"
    plan = [st.index for st in record.plan]
    assert done + new == plan  # nothing repeated, nothing skipped, the planned order kept
    assert [s.step for s in record.samples] == plan and all(s.ok for s in record.samples)
    (resumed,) = record.environment["resumed"]
    assert resumed["after_samples"] == len(done) and resumed["previous_status"] == "partial"
    assert analysis.gate(record).passed
    fk.assert_no_leftovers(mark)


def _cut_run(src: Path, dst: Path, keep: int, *, torn: bytes = b"") -> list[bytes]:
    """A copy of the run in ``src`` as if it had been interrupted after its first ``keep`` samples (with an
    optional torn fragment at the end of requests.jsonl). Returns the kept lines."""
    shutil.copytree(src, dst)
    raw = json.loads((src / RUN_FILE).read_text())
    raw["samples"] = raw["samples"][:keep]
    raw["status"], raw["status_reason"] = "partial", "interrupted (test)"
    (dst / RUN_FILE).write_text(json.dumps(raw))
    lines = (src / SAMPLES_FILE).read_bytes().splitlines(keepends=True)[:keep]
    (dst / SAMPLES_FILE).write_bytes(b"".join(lines) + torn)
    return lines


def test_resume_primes_a_service_started_mid_block_and_repairs_a_torn_line(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Cut a finished run after the cold prompt of a pair (with a torn half-line after it, as a crash leaves)
    and resume it: the continuation must meet a warm service whose prefix cache holds the cold prompt, as in
    the original run, and requests.jsonl must stay valid."""
    mark = fk.new_mark()
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")  # the fake vLLM's reset route
    prof = fk.fake_profile(mark, prompts={"lengths": [24], "pairs": [{"cold": 32, "extend": 8}]})
    prof["engine"].update(adapter="vllm", command=[sys.executable, str(fk.FAKE_ENGINES), "--engine", "vllm",
                                                   "--port", "{port}"])
    full = run_profile(prof, tmp_path / "full")
    assert full.status == "complete"
    kinds = [st.kind for st in full.plan]
    assert kinds == ["warmup", "fresh", "cold", "continuation"]
    assert full.samples[3].engine["cached_prompt_tokens"] == 32  # the prefix cache served the continuation

    kept = _cut_run(tmp_path / "full", tmp_path / "cut", keep=3, torn=b'{"step": 3, "arm": "a", "rou')
    events: list[runner.ProgressEvent] = []
    record = runner.execute(profile_from_dict(prof), tmp_path / "cut", resume=True, observer=events.append)
    assert record.status == "complete" and [s.step for s in record.samples] == [0, 1, 2, 3]
    cont = record.samples[3]
    assert cont.ok and cont.engine["cached_prompt_tokens"] == 32  # primed: warm-up, reset, cold prompt
    assert cont.output_ids == full.samples[3].output_ids
    data = (tmp_path / "cut" / SAMPLES_FILE).read_bytes()
    assert data.startswith(b"".join(kept)) and data.count(b"\n") == 4 and b'"rou\n' not in data
    assert any(e.kind == "warning" and "cut off a torn last line" in e.message for e in events)
    assert any(e.kind == "service" and "re-sending 2 earlier request(s)" in e.message for e in events)
    assert [s.log for s in record.services] == ["logs/a_r1.log", "logs/a_r1.restart1.log"]  # a log of its own
    fk.assert_no_leftovers(mark)


def test_a_resumed_run_keeps_a_failed_step_and_does_not_repeat_it(tmp_path: Path) -> None:
    """A run stopped by a failed request (the service died answering step 3) is resumed with keep_failed
    (``--keep-failed``): step 3 keeps its failed sample and the run goes on from step 4, on a service launched
    again. (Without it step 3 runs again: test_resume_retry.py.)"""
    mark = fk.new_mark()
    prof = fk.fake_profile(mark, args=("--die-after-requests", "3"), prompts={"per_length": 4},
                           run={"on_request_failure": "stop"})
    first = run_profile(prof, tmp_path / "run")
    assert first.status == "partial" and [s.step for s in first.samples] == [0, 1, 2, 3]
    record = runner.execute(profile_from_dict(prof), tmp_path / "run", resume=True, keep_failed=True)
    assert [s.step for s in record.samples] == [0, 1, 2, 3, 4]
    assert [s.ok for s in record.samples] == [True, True, True, False, True]
    assert record.status == "complete"
    fk.assert_no_leftovers(mark)


def test_resume_refuses_a_run_another_process_holds(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    src = RunRecord(run_id="run", status="running", created_at=0.0, abbench_version="0",
                    profile=fk.fake_profile(fk.new_mark()))
    (run_dir / RUN_FILE).write_text(src.model_dump_json())
    lock = runner.RunLock(run_dir).acquire()  # as a live `abbench run` holds it
    try:
        res = cli.abbench("run", "--resume", str(run_dir), "-q", cwd=tmp_path)
    finally:
        lock.release()
    assert res.returncode == 2
    assert f"another abbench process (pid {os.getpid()}) is running this run" in fk.flat(res.stderr)


def test_resume_of_a_complete_run_is_refused(tmp_path: Path, finished_run: Path) -> None:
    res = cli.abbench("run", "--resume", str(finished_run), "-q", cwd=tmp_path)
    assert res.returncode == 2 and "already complete; nothing to resume" in fk.flat(res.stderr)


# --------------------------------------------------------------------- report and gate on damaged runs


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A complete run of two arms x two rounds against the fake engine (the gate passes on it)."""
    mark = fk.new_mark()
    prof = fk.fake_profile(mark, arms=[{"name": "a"}, {"name": "b"}], prompts={"per_length": 2},
                           run={"rounds": 2})
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    record = run_profile(prof, run_dir)
    assert record.status == "complete" and analysis.gate(record).passed
    fk.assert_no_leftovers(mark)
    return run_dir


def _damage(src: Path, dst: Path, how: str) -> None:
    shutil.copytree(src, dst)
    run_json, jsonl = dst / RUN_FILE, dst / SAMPLES_FILE
    raw = json.loads(run_json.read_text())
    lines = jsonl.read_bytes().splitlines(keepends=True)
    if how == "corrupt-run-json":
        run_json.write_bytes(run_json.read_bytes()[: run_json.stat().st_size // 2])
    elif how == "schema-version":
        raw["schema_version"] = 99
        run_json.write_text(json.dumps(raw))
    elif how == "missing-run-json":
        run_json.unlink()
    elif how == "crash-torn-line":  # a crash: run.json from the last service boundary, a half-written line
        raw["status"], raw["samples"] = "running", raw["samples"][:4]
        run_json.write_text(json.dumps(raw))
        jsonl.write_bytes(b"".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])
    elif how == "missing-jsonl":
        raw["status"], raw["samples"] = "partial", raw["samples"][:-2]
        run_json.write_text(json.dumps(raw))
        jsonl.unlink()
    elif how == "garbage-line":  # bytes that are not even UTF-8 in the middle of the log
        raw["status"], raw["samples"] = "running", []
        run_json.write_text(json.dumps(raw))
        jsonl.write_bytes(lines[0] + b"\xff\xfe\x00garbage\n" + b"".join(lines[2:]))  # step 1: a measured one
    elif how == "unplanned-sample":
        raw["samples"][-1]["step"] = 999
        run_json.write_text(json.dumps(raw))
        jsonl.write_text("".join(json.dumps(s) + "\n" for s in raw["samples"]))
    else:
        raise ValueError(how)


@pytest.mark.parametrize("how, fragment", [
    ("corrupt-run-json", "corrupt JSON"),
    ("schema-version", "schema_version 99, this abbench reads 1"),
    ("missing-run-json", "no run.json; this is not an abbench run directory"),
])
def test_unreadable_run_is_an_error_for_report_and_gate(tmp_path: Path, finished_run: Path, how: str,
                                                        fragment: str) -> None:
    _damage(finished_run, tmp_path / "run", how)
    for cmd in (["gate"], ["report", "--out", str(tmp_path / "reports")]):
        res = cli.abbench(*cmd[:1], str(tmp_path / "run"), *cmd[1:], cwd=tmp_path)
        assert res.returncode == 2, (cmd, res.stdout, res.stderr)
        assert fragment in fk.flat(res.stderr) and "Traceback" not in res.stderr
        assert "PASS" not in res.stdout
    assert not (tmp_path / "reports").exists()


@pytest.mark.parametrize("how, gate_says, report_says", [
    ("crash-torn-line", ["run run is running", "missing: prompt"], ["torn last line", "missing: prompt"]),
    ("missing-jsonl", ["run run is partial", "missing: prompt"], ["requests.jsonl is missing", "missing: prompt"]),
    ("garbage-line", ["missing: prompt", "step 1: no sample"], ["line 2: unreadable sample", "step 1: no sample"]),
    ("unplanned-sample", ["unplanned: the sample of step 999", "missing: prompt"],
     ["sample of step 999", "does not match the plan"]),
])
def test_gate_never_passes_on_missing_data_and_the_report_says_what_is_missing(
        tmp_path: Path, finished_run: Path, how: str, gate_says: list[str], report_says: list[str]) -> None:
    _damage(finished_run, tmp_path / "run", how)
    gate = cli.abbench("gate", str(tmp_path / "run"), cwd=tmp_path)
    assert gate.returncode == 1, gate.stdout + gate.stderr
    out = fk.flat(gate.stdout)
    assert "gate: FAIL" in out and "gate: PASS" not in out
    for frag in gate_says:
        assert frag in out, (frag, out)
    record, problems = load_run(tmp_path / "run")  # what `abbench report` does (its CLI path: the test above)
    md = write_report(record, problems, tmp_path / "reports" / "run.md", tmp_path / "reports" / "run").read_text()
    problems = fk.flat(md[md.index("## Problems and missing data"):])
    for frag in report_says:
        assert frag in problems, (frag, problems[:2000])


def test_read_samples_survives_any_bytes(tmp_path: Path) -> None:
    path = tmp_path / SAMPLES_FILE
    path.write_bytes(b"\x00\xff\n{\"step\": 1}\n\xc3\x28 not utf-8\n{torn")
    samples, problems = read_samples(path)
    assert samples == [] and len(problems) == 4 and "torn last line" in problems[-1]


# ----------------------------------------------------------------------- invalid profiles, via the CLI


INVALID = [
    ("unknown field", '[[arms]]\nname = "a"\nbogus = 1\n', ["arms.0.bogus: unknown field", "check the spelling"]),
    ("bad value", '[engine]\ncommand = ["x", "{port}"]\n[[arms]]\nname = "a"\n[run]\nrounds = 0\n'
     'on_service_failure = "explode"\n',
     ["run.rounds: Input should be greater than 0", "run.on_service_failure: Input should be 'stop' or 'skip-arm'"]),
    ("no arms", "", ["arms: required: add at least one [[arms]] table"]),
    ("not TOML", 'name = "x\n', ["not valid TOML", "line 1"]),
    ("reference", '[engine]\ncommand = ["x", "{port}"]\n[[arms]]\nname = "a"\n[run]\nreference = "b"\n',
     ["run.reference 'b' is not an arm; arms are a"]),
    ("no engine", '[[arms]]\nname = "a"\n',
     ["arm 'a' has no way to reach an engine: set engine.command, engine.base_url"]),
    ("command as a string", '[engine]\ncommand = "server --port {port}"\n[[arms]]\nname = "a"\n',
     ["engine.command: Input should be a valid list"]),
    ("tokenizer path", '[tokenizer]\nsource = "/nonexistent/tokenizer"\n[engine]\ncommand = ["x", "{port}"]\n'
     '[[arms]]\nname = "a"\n',
     ["tokenizer.source '/nonexistent/tokenizer': no such directory", "pass a directory containing tokenizer.json",
      "or one of the built-in names qwen3, qwen3.6"]),
    ("tokenizer dir without one", '[tokenizer]\nsource = "EMPTY"\n[engine]\ncommand = ["x", "{port}"]\n'
     '[[arms]]\nname = "a"\n', ["holds neither tokenizer.json nor tokenizer_config.json"]),
    ("profile name", None, ["no profile named", "pass a path to a .toml file or one of: cpu-tiny"]),
]


@pytest.mark.parametrize("text, expect", [(t, e) for _, t, e in INVALID], ids=[n for n, _, _ in INVALID])
def test_invalid_profiles_name_the_field_and_the_fix(tmp_path: Path, text: str | None, expect: list[str]) -> None:
    if text is None:
        target = "no-such-profile"
    else:
        (tmp_path / "empty").mkdir()
        text = text.replace('"EMPTY"', json.dumps(str(tmp_path / "empty")))
        text = text if text.startswith("name =") else 'name = "bad"\n' + text
        target = str(fk.write_profile(tmp_path / "bad.toml", text))
    res = cli.abbench("run", "-p", target, "--out", str(tmp_path / "run"), "-q", cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    assert res.stdout == "" and "Traceback" not in res.stderr
    err = fk.flat(res.stderr)
    assert err.startswith("error:")
    for frag in expect:
        assert frag in err, (frag, err)
    assert not (tmp_path / "run").exists()


def test_run_stopped_by_a_failed_request_exits_nonzero(tmp_path: Path) -> None:
    """on_request_failure = stop: the run is saved partial, the report is still written, the exit code says
    the run did not finish."""
    mark = fk.new_mark()
    prof = fk.fake_profile(mark, arms=[{"name": "a", "request": {"fake_mode": "http-500"}}],
                           run={"on_request_failure": "stop"})
    toml = fk.write_profile(tmp_path / "p.toml", prof)
    res = cli.abbench("run", "-p", str(toml), "--out", str(tmp_path / "run"), "-q", cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    err = fk.flat(res.stderr)
    assert "1 failed sample(s): 1 http" in err and "the run is partial: stopped after a failed request" in err
    assert "abbench run --resume" in err and "report ->" in err
    fk.assert_no_leftovers(mark)


def test_check_launch_commands_names_the_arm() -> None:
    prof = profile_from_dict(fk.fake_profile("x", arms=[{"name": "a"}, {"name": "b", "command": ["srv", "-p", "80"]}]))
    with pytest.raises(ConfigError, match=r"arms\[1\]\.command \(arm b\)"):
        runner.check_launch_commands(prof)


# ------------------------------------------------------------------------------- runner bugs, one each


def test_telemetry_window_does_not_depend_on_the_samplers_truth_value(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner used to test ``if slot.sampler``; Sampler defines __len__ (its point count), so with no
    point yet no window was opened (no telemetry), and a point landing mid-request made window() get a
    mark that mark() never made (KeyError). Every request now gets its window, and every window opened is
    closed, a failed request's too."""
    from abbench import telemetry

    opened: list[int] = []
    closed: list[int] = []
    mark, window = telemetry.Sampler.mark, telemetry.Sampler.window
    monkeypatch.setattr(telemetry.Sampler, "__len__", lambda self: 0)  # always falsy
    monkeypatch.setattr(telemetry.Sampler, "mark", lambda self: opened.append(mark(self)) or opened[-1])
    monkeypatch.setattr(telemetry.Sampler, "window",
                        lambda self, m, **kw: closed.append(m) or window(self, m, **kw))
    test_mark = fk.new_mark()
    prof = fk.fake_profile(test_mark, arms=[{"name": "a"}, {"name": "bad", "request": {"fake_mode": "http-500"}}])
    record = run_profile(prof, tmp_path / "run")
    assert len(opened) == len(record.samples) == len(record.plan) and sorted(closed) == sorted(opened)
    ok = [s for s in record.samples if s.ok]
    assert ok and all(s.telemetry.host_rss_peak for s in ok)  # the window was read
    assert all(not s.ok for s in record.samples if s.arm == "bad")
    fk.assert_no_leftovers(test_mark)


@pytest.mark.slow
def test_second_signal_during_teardown_is_ignored(tmp_path: Path) -> None:
    """Ctrl-C pressed twice: the teardown still stops every service and saves run.json."""
    mark = fk.new_mark()
    prof = fk.fake_profile(mark, args=("--token-delay", "0.05", "--ignore-sigterm"), prompts={"per_length": 6},
                           engine={"stop_timeout_s": 1.5})  # the service ignores SIGTERM: teardown takes 1.5 s
    toml = fk.write_profile(tmp_path / "p.toml", prof)
    run_dir, out = tmp_path / "run", tmp_path / "out.txt"
    proc = fk.abbench_popen("run", "-p", str(toml), "--out", str(run_dir), "-q", "--no-report", cwd=tmp_path, out=out)
    try:
        jsonl = run_dir / SAMPLES_FILE
        fk.wait_for(lambda: jsonl.exists() and jsonl.read_bytes().count(b"\n") >= 2 or proc.poll() is not None,
                    timeout=90, what="two samples")
        assert proc.poll() is None, out.read_text()
        os.kill(proc.pid, signal.SIGINT)
        log = run_dir / "logs" / "a_r1.log"  # inside the teardown: the service has been sent SIGTERM
        fk.wait_for(lambda: b"SIGTERM received, ignored" in log.read_bytes(), timeout=30, what="the teardown")
        os.kill(proc.pid, signal.SIGINT)
        rc = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 130, out.read_text()
    fk.assert_no_leftovers(mark, grace_s=0.5)
    raw = json.loads((run_dir / RUN_FILE).read_text())
    assert raw["status"] == "partial" and raw["services"][0]["exit_code"] == -signal.SIGKILL
    fk.jsonl_lines(jsonl)
