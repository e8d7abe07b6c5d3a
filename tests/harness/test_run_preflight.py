"""Every arm's service is checked before the first sample of any arm (abbench.runner.preflight): a ``base_url``
where nothing listens, a server that refuses the run's cache reset or does not serve the profile's model, and a
launched command that does not exist each stop the run in seconds, naming the arm and the URL or command,
before the other arm's service is even launched. Real loopback servers throughout (tests/support/fakeserver.py
launched by the runner, tests/support/fake_engines.py and a small model-listing server in-process)."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import pytest

from abbench import runner, services
from abbench.auth import Credentials
from abbench.client import EngineClient
from abbench.errors import ConfigError, ServiceError
from abbench.profile import profile_from_dict
from abbench.runner.preflight import check_command, check_engine_plan, check_services, engine_plan_argv
from abbench.runner.run import ProgressEvent

from tests.support import fake_engines
from tests.support import faultkit as fk


def _dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def _execute(prof: dict, out: Path) -> tuple[list[ProgressEvent], BaseException | None, float]:
    events: list[ProgressEvent] = []
    t0 = time.perf_counter()
    try:
        runner.execute(profile_from_dict(prof), out, observer=events.append)
        err = None
    except Exception as e:  # noqa: BLE001 - the test looks at it
        err = e
    return events, err, time.perf_counter() - t0


def _checked_at(events: list[ProgressEvent]) -> int:
    return next(i for i, e in enumerate(events) if e.message.startswith("checking the services"))


def test_a_dead_base_url_fails_in_seconds_before_the_other_arm_starts(tmp_path: Path) -> None:
    mark = fk.new_mark()
    url = _dead_url()
    prof = fk.fake_profile(mark, arms=[{"name": "a"}, {"name": "b", "base_url": url}])
    out = tmp_path / "run"
    events, err, _ = _execute(prof, out)
    assert isinstance(err, ServiceError), err
    first = str(err).splitlines()[0]
    assert first.startswith(f"arm b ({url}): connection refused") and "before this run sent any request" in first
    assert not [e for e in events if e.kind == "sample"]
    assert _checked_at(events) >= 0 and not [e for e in events if e.message.startswith("starting")]  # a: never
    assert not out.exists()  # nothing measured, nothing launched: no run, no logs
    fk.assert_no_leftovers(mark)
    assert services.live_services() == []


def test_the_check_takes_seconds_not_the_health_timeout(tmp_path: Path) -> None:
    prof = profile_from_dict(fk.fake_profile("x", arms=[{"name": "b", "base_url": _dead_url()}],
                                             engine={"health_timeout_s": 120}))
    t0 = time.perf_counter()
    with EngineClient() as client, pytest.raises(ServiceError, match="connection refused"):
        check_services(prof, client, Credentials(), ["b"], lambda m: None)
    assert time.perf_counter() - t0 < services.REFUSED_GRACE_S + 30  # far below the 120 s health timeout


@pytest.mark.parametrize(("command", "said"), [
    (["/nonexistent/engine-xyz", "--port", "{port}"], "command not found: /nonexistent/engine-xyz"),
    (["no-such-engine-xyz", "--port", "{port}"], "command not found: no-such-engine-xyz (not on the PATH)"),
    (["{profile_dir}/engine", "--port", "{port}"], "uses {profile_dir}, but the profile has no directory"),
])
def test_a_missing_command_fails_before_any_service_launches(tmp_path: Path, command: list[str], said: str) -> None:
    mark = fk.new_mark()
    prof = fk.fake_profile(mark, arms=[{"name": "a"}, {"name": "b", "command": command}])
    out = tmp_path / "run"
    events, err, _ = _execute(prof, out)
    assert isinstance(err, ServiceError), err
    first = str(err).splitlines()[0]
    assert first.startswith("arm b (") and said in first, first
    assert "check arms[1].command (arm b) in the profile" in first or "{profile_dir}" in said
    assert not [e for e in events if e.kind == "sample"] and not out.exists()
    fk.assert_no_leftovers(mark)


def test_a_program_that_is_there_passes(tmp_path: Path) -> None:
    spec = profile_from_dict(fk.fake_profile("x")).launch_spec("a")
    assert check_command(spec) is None
    script = tmp_path / "engine.sh"
    script.write_text("#!/bin/sh\n")
    bad = profile_from_dict(fk.fake_profile("x", engine={"command": [str(script), "{port}"]})).launch_spec("a")
    assert check_command(bad) == f"command not executable: {script}; check engine.command in the profile"
    script.chmod(0o755)
    assert check_command(bad) is None


@pytest.mark.parametrize(("argv", "checked"), [
    (["py", "-m", "abbench.engine", "--device", "cuda", "--port", "0"], True),
    (["py", "-m", "abbench.engine", "--device=cuda:1"], True),
    (["py", "-m", "abbench.engine", "--gpu-memory-budget", "16"], True),  # a budget on the CPU too
    (["py", "-m", "abbench.engine", "--device", "cuda", "--device", "cpu"], False),  # argparse's last wins
    (["py", "-m", "abbench.engine", "--port", "0"], False),  # the CPU without a budget: no plan
    (["py", "-m", "abbench.engine", "--backend", "transformers", "--device", "cuda"], False),
    (["/venv/bin/abbench", "serve", "--device", "cuda"], True),
    (["py", "-m", "abbench", "serve", "--gpu-memory-budget=24"], True),
    (["py", "-m", "abbench", "run", "--device", "cuda"], False),
    (["vllm", "serve", "m", "--device", "cuda"], False),
    (["py", "-m", "abbench.engine.tools.gpucheck", "--device", "cuda"], False),
])
def test_which_commands_get_the_engines_plan_check(argv: list[str], checked: bool) -> None:
    assert engine_plan_argv(argv) == ([*argv, "--check-plan"] if checked else None)


def _engine_arm(name: str, budget_gib: str) -> dict:
    return {"name": name, "command": ["{python}", "-m", "abbench.engine", "--port", "{port}", "--gpu-memory-budget",
                                      budget_gib]}


def test_an_engine_whose_budget_cannot_hold_its_experts_fails_before_any_service_launches(tmp_path: Path) -> None:
    """The vendored engine (tiny model, on the CPU) under a budget below its fixed part: the run stops at the
    check with the engine's own reason and remedy, before arm a's service (the fake server) is launched. Arm c's
    check, started beside b's, is not left running."""
    mark = fk.new_mark()
    prof = fk.fake_profile(mark, arms=[{"name": "a"}, _engine_arm("b", "0.5"), _engine_arm("c", "3")])
    out = tmp_path / "run"
    events, err, _ = _execute(prof, out)
    assert isinstance(err, ServiceError), err
    first = str(err).splitlines()[0]
    assert first.startswith("arm b (") and "--check-plan failed (exit 1)" in first, first
    assert "the device-memory budget holds 0 expert slots per layer" in first and "Raise --gpu-memory-budget" in first
    assert "before this run sent any request" in first
    assert not [e for e in events if e.message.startswith("starting")] and not out.exists()
    fk.assert_no_leftovers(mark)


def test_an_engine_whose_plan_fits_passes_the_check() -> None:
    warned: list[str] = []
    spec = profile_from_dict(fk.fake_profile("x", arms=[_engine_arm("b", "3")])).launch_spec("b")
    assert check_engine_plan(spec, warned.append) is None and warned == []


def test_skip_arm_warns_up_front_and_runs_the_other_arm(tmp_path: Path) -> None:
    mark = fk.new_mark()
    prof = fk.fake_profile(mark, arms=[{"name": "a"}, {"name": "b", "command": ["no-such-engine-xyz", "{port}"]}],
                           prompts={"warmup": 0}, run={"on_service_failure": "skip-arm"})
    events, err, _ = _execute(prof, tmp_path / "run")
    assert err is None, err
    warned = [i for i, e in enumerate(events) if e.kind == "warning" and e.message.startswith("arm b (")]
    first_sample = next(i for i, e in enumerate(events) if e.kind == "sample")
    assert warned and warned[0] < first_sample and "skip-arm" in events[warned[0]].message
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert {(s["arm"], s["ok"]) for s in record["samples"]} == {("a", True), ("b", False)}
    fk.assert_no_leftovers(mark)


def test_an_attached_server_that_refuses_the_reset_stops_before_the_other_arm(tmp_path: Path) -> None:
    mark = fk.new_mark()
    with fake_engines.FakeEngine(fake_engines.FakeEngineConfig("vllm", vllm_dev_mode=False)) as eng:
        prof = fk.fake_profile(mark, arms=[{"name": "a"}, {"name": "b", "base_url": eng.base_url, "adapter": "vllm"}])
        events, err, _ = _execute(prof, tmp_path / "run")
        assert eng.stats()["completions"] == 0
    assert isinstance(err, ConfigError) and "VLLM_SERVER_DEV_MODE=1" in str(err), err
    assert str(err).startswith(f"arm b ({eng.base_url}): ")
    assert _checked_at(events) >= 0 and not [e for e in events if e.message.startswith("starting")]
    fk.assert_no_leftovers(mark)


# ------------------------------------------------------------------------------------------------ the model


class _Models(BaseHTTPRequestHandler):
    """/health, /reset and /v1/models listing ``served`` (404 when None)."""

    served: list[str] | None = None
    context: int | None = None

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _reply(self, status: int, obj: Any) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/v1/models" and self.served is not None:
            extra = {"max_model_len": self.context} if self.context else {}
            self._reply(200, {"object": "list", "data": [{"id": m, "object": "model", **extra} for m in self.served]})
        elif self.path == "/health":
            self._reply(200, {"status": "ok"})
        else:
            self._reply(404, {"error": "not found"})

    def do_POST(self) -> None:
        self._reply(200 if self.path == "/reset" else 404, {})


@pytest.fixture
def models_server() -> Iterator[tuple[str, type[_Models]]]:
    handler = type("Handler", (_Models,), {"served": ["served-model"]})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", handler
    finally:
        srv.shutdown()
        srv.server_close()


def _check(url: str, **arm: Any) -> None:
    prof = profile_from_dict(fk.fake_profile("x", arms=[{"name": "a"}, {"name": "b", "base_url": url, **arm}]))
    with EngineClient() as client:
        check_services(prof, client, Credentials(), ["b"], lambda m: None)


def test_an_attached_server_must_serve_the_arms_model(models_server: tuple[str, type[_Models]]) -> None:
    url, handler = models_server
    with pytest.raises(ConfigError) as e:
        _check(url, model="other-model")
    assert str(e.value).startswith(f"arm b ({url}): the server serves 'served-model', not the profile's model "
                                   "'other-model'")
    _check(url, model="served-model")
    _check(url)  # no model named: nothing to compare
    _check(url, model="other-model", adapter="llamacpp", reset_path="/reset")  # llama.cpp serves any name
    handler.served = None
    _check(url, model="other-model")  # no list at /v1/models: not judged on it


# ------------------------------------------------------------------------------------------------ the context


def test_a_prompt_longer_than_a_launched_servers_context_stops_before_its_first_request(tmp_path: Path) -> None:
    """The server lists max_model_len 40 at /v1/models; a 24-token prompt plus 4 output tokens fits, a 48-token
    one does not: the run stops once the service is healthy, naming the arm, the limit and the prompt."""
    mark = fk.new_mark()
    prof = fk.fake_profile(mark, args=("--max-model-len", "40"), prompts={"lengths": [24, 48]})
    events, err, _ = _execute(prof, tmp_path / "run")
    assert isinstance(err, ConfigError), err
    msg = str(err)
    assert msg.startswith("arm a (http://127.0.0.1:") and "the server's context is 40 tokens" in msg
    assert "prompt fresh-48-0 has 48 tokens and each request asks for 4 more (52)" in msg
    assert "at most 36 prompt tokens" in msg
    assert not [e for e in events if e.kind == "sample"]
    fk.assert_no_leftovers(mark)
    prof = fk.fake_profile(mark, args=("--max-model-len", "52"), prompts={"lengths": [24, 48]})
    events, err, _ = _execute(prof, tmp_path / "fits")
    assert err is None and [e for e in events if e.kind == "sample"]
    fk.assert_no_leftovers(mark)


def test_an_attached_servers_context_is_checked_up_front(models_server: tuple[str, type[_Models]],
                                                         tmp_path: Path) -> None:
    url, handler = models_server
    handler.context = 20  # the 24-token prompt alone is longer
    mark = fk.new_mark()
    prof = fk.fake_profile(mark, arms=[{"name": "a"}, {"name": "b", "base_url": url}])
    events, err, _ = _execute(prof, tmp_path / "run")
    assert isinstance(err, ConfigError) and str(err).startswith(f"arm b ({url}): the server's context is 20")
    assert not [e for e in events if e.message.startswith("starting")]  # before arm a's service even launches
    fk.assert_no_leftovers(mark)


def test_a_dry_run_checks_every_arm_and_launches_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``abbench run --dry-run``: the run's preflight alone. A profile whose services can start passes (exit 0)
    with no service started and no run written, and prints the plan of each vendored engine it checked; one whose
    second arm's engine cannot fit its budget fails (exit 2) with the engine's reason; --dry-run with --resume is
    refused."""
    from typer.testing import CliRunner

    from abbench.cli import app

    monkeypatch.chdir(tmp_path)  # a run would be written under ./results
    mark = fk.new_mark()
    good = fk.write_profile(tmp_path / "good.toml", fk.fake_profile(mark, arms=[{"name": "a"}, _engine_arm("b", "3")]))
    res = CliRunner().invoke(app, ["run", "-p", str(good), "--dry-run"])
    assert res.exit_code == 0, res.output
    assert "every arm's service passed the run's checks (a, b)" in res.output and "starting" not in res.output
    out = " ".join(res.output.split())  # the console wraps long lines
    assert "arm b: 2048-token prefill chunks; device-memory plan: budget 3.00 GiB" in out and "slots per layer" in out
    assert "arm a:" not in out  # the fake server has no plan to show
    assert not (tmp_path / "results").exists() and not fk.marked_processes(mark)
    bad = fk.write_profile(tmp_path / "bad.toml", fk.fake_profile(mark, arms=[{"name": "a"}, _engine_arm("b", "0.5")]))
    res = CliRunner().invoke(app, ["run", "-p", str(bad), "--dry-run", "-q"])
    assert res.exit_code == 2 and "arm b (" in res.output and "holds 0 expert slots per layer" in res.output
    res = CliRunner().invoke(app, ["run", "--resume", str(tmp_path), "--dry-run"])
    assert res.exit_code == 2 and "--dry-run checks a profile before a run" in res.output
    fk.assert_no_leftovers(mark)
