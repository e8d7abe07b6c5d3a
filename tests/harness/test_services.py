"""abbench.services with real processes: a tiny HTTP server (tests/support/svc_helper.py) launched as a service."""

from __future__ import annotations

import http.server
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from abbench import services
from abbench.errors import ConfigError, HealthTimeout, PortTaken, ServiceError
from abbench.services import Service, expand_command, free_port, port_in_use, stop_all
from abbench.signals import signals_as_interrupt

HELPER = str(Path(__file__).resolve().parents[1] / "support" / "svc_helper.py")


def helper_argv(*extra: str) -> list[str]:
    return ["{python}", HELPER, "--port", "{port}", *extra]


def launch(tmp_path: Path, *extra: str, **kw) -> Service:
    kw.setdefault("health_timeout_s", 10.0)
    kw.setdefault("stop_timeout_s", 3.0)
    kw.setdefault("env", {})
    return Service.launch("svc", helper_argv(*extra), log_path=tmp_path / "logs" / "svc.log", **kw)


def wait_pidfile(path: Path, timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, "helper never wrote its pid file"
        time.sleep(0.02)
    return [int(x) for x in path.read_text().split()]


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def assert_all_gone(pids: list[int], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(gone(p) for p in pids):
        assert time.monotonic() < deadline, f"still running: {[p for p in pids if not gone(p)]}"
        time.sleep(0.05)


@pytest.fixture(autouse=True)
def _no_leftovers():
    yield
    stop_all()
    assert services.live_services() == []


# ---------------------------------------------------------------------------------------- pure helpers


def test_expand_command_placeholders_only(tmp_path: Path) -> None:
    argv = ["{python}", "-m", "x", "--port={port}", "{profile_dir}/w.bin", '{"a": {"b": 1}}', "{other}", "{{port}}"]
    out = expand_command(argv, port=1234, profile_dir=tmp_path)
    assert out == [
        sys.executable, "-m", "x", "--port=1234", f"{tmp_path}/w.bin", '{"a": {"b": 1}}', "{other}", "{1234}",
    ]
    assert expand_command(["a", "{port}"], port=5, profile_dir=None) == ["a", "5"]
    with pytest.raises(ConfigError, match="profile_dir"):
        expand_command(["{profile_dir}/x"], port=1, profile_dir=None)


def test_free_port_is_bindable() -> None:
    p = free_port()
    assert 0 < p < 65536
    assert not port_in_use("127.0.0.1", p)
    with socket.socket() as s:
        s.bind(("127.0.0.1", p))
        s.listen()
        assert port_in_use("127.0.0.1", p)


# ------------------------------------------------------------------------------------------- launching


def test_launch_healthy_logs_record_and_stop(tmp_path: Path) -> None:
    svc = launch(tmp_path, "--delay", "0.3", "--say", "hello-from-helper", env={"SVC_HELPER_ENV": "xyz"})
    try:
        assert svc.alive() and svc.pid is not None
        assert svc in services.live_services()
        assert svc.ready_s is not None and svc.ready_s >= 0.3
        r = httpx.get(svc.base_url + "/health", trust_env=False)
        assert r.status_code == 200
        assert svc.base_url.startswith("http://127.0.0.1:")
        # stdout and stderr both land in the one log, unbuffered; the header names the command
        deadline = time.monotonic() + 5
        while "request:" not in svc.log_tail():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        text = (tmp_path / "logs" / "svc.log").read_text()
        assert "=== abbench: service svc launched" in text
        assert "hello-from-helper" in text and "env xyz" in text
        assert "helper stderr line" in text
        assert len(svc.log_tail(2).splitlines()) == 2
    finally:
        code = svc.stop()
    assert not svc.alive()
    assert code == svc.exit_code == -15  # SIGTERM
    assert svc.stop() == -15  # idempotent
    assert svc not in services.live_services()
    rec = svc.record(run_dir=tmp_path)
    assert rec.log == "logs/svc.log"
    assert rec.command is not None and rec.command[0] == sys.executable and "{port}" not in rec.command
    assert rec.env == {"SVC_HELPER_ENV": "xyz"}
    assert rec.exit_code == -15 and rec.ready_s == svc.ready_s
    assert rec.started_at is not None and rec.stopped_at is not None and rec.stopped_at >= rec.started_at


def test_context_manager_and_custom_health_check(tmp_path: Path) -> None:
    seen: list[str] = []

    def check(base_url: str) -> bool:
        seen.append(base_url)
        return httpx.get(base_url + "/metrics", trust_env=False).status_code == 200

    with launch(tmp_path, health_check=check, arms=["A", "B"], round=2) as svc:
        pid = svc.pid
        assert seen and seen[-1] == svc.base_url
        rec = svc.record()
        assert rec.arms == ["A", "B"] and rec.round == 2
    assert pid is not None and gone(pid)


def test_never_healthy_times_out_with_log_tail_and_kills(tmp_path: Path) -> None:
    pidfile = tmp_path / "pids"
    t0 = time.perf_counter()
    with pytest.raises(HealthTimeout) as ei:
        launch(tmp_path, "--never-healthy", "--children", "1", "--pidfile", str(pidfile), health_timeout_s=1.0)
    # 1 s of health timeout, then the stop (3 s at most): a launch that ignored the timeout would wait on a helper
    # that is never healthy for good; 30 s leaves a loaded machine room for the helper's start and stop
    assert time.perf_counter() - t0 < 30
    err = ei.value
    assert "not healthy after 1 s" in str(err)
    assert err.log_tail and "helper listening on" in err.log_tail
    assert "request:" in err.log_tail  # the 503 answers were logged
    assert_all_gone(wait_pidfile(pidfile))
    assert services.live_services() == []


def test_early_exit_is_service_error_with_exit_code(tmp_path: Path) -> None:
    t0 = time.perf_counter()
    with pytest.raises(ServiceError) as ei:
        launch(tmp_path, "--exit-early", "3")
    assert time.perf_counter() - t0 < 8  # strictly under the 10 s health timeout a launch blind to the exit waits
    assert not isinstance(ei.value, HealthTimeout)
    assert "exited with code 3" in str(ei.value)
    assert ei.value.log_tail and "helper exiting early with 3" in ei.value.log_tail


def test_command_not_found(tmp_path: Path) -> None:
    with pytest.raises(ServiceError, match=r"command not found: /nonexistent/engine-xyz; check engine.command"):
        Service.launch("svc", ["/nonexistent/engine-xyz", "--port", "{port}"], env={},
                       log_path=tmp_path / "x.log", health_timeout_s=2, stop_timeout_s=1)
    assert "command not found" in (tmp_path / "x.log").read_text()
    with pytest.raises(ServiceError, match="command not found: no-such-binary-abbench"):
        Service.launch("svc", ["no-such-binary-abbench"], env={}, log_path=tmp_path / "y.log",
                       health_timeout_s=2, stop_timeout_s=1)


def test_port_in_use_is_refused_before_launch(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ServiceError, match=f"port {port} on 127.0.0.1 is already in use"):
            launch(tmp_path, port=port)
        assert not (tmp_path / "logs" / "svc.log").exists()  # nothing was launched


def test_port_in_use_service_own_failure_detected(tmp_path: Path) -> None:
    # Without the pre-check, the service's own bind failure is seen (it exits) with its log.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ServiceError) as ei:
            launch(tmp_path, port=port, check_port=False)
    assert "exited with code 1" in str(ei.value)
    assert "Address already in use" in (ei.value.log_tail or "")


class _Stranger(http.server.BaseHTTPRequestHandler):
    """Someone else's server: healthy, and nothing more."""

    def do_GET(self) -> None:  # noqa: N802
        body = b"ok\n" if self.path == "/health" else b"not here\n"
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def stranger():
    """A server in this process (running before any launch) on a port of its own: the port another process
    takes between abbench's pick and the service's bind."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Stranger)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_a_stranger_on_a_picked_port_does_not_answer_for_the_service(tmp_path: Path, stranger: int,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The race of free_port: the port abbench picked is taken by a server that answers /health before the
    service (still starting) binds it. That answer is not the service's; the service exits (address in use) and
    is launched again on another port, where it answers itself."""
    picks = iter([stranger])
    monkeypatch.setattr(services, "free_port", lambda host="127.0.0.1": next(picks, None) or free_port(host))
    monkeypatch.setattr(services, "port_in_use", lambda host, port: False)  # taken after the check
    svc = launch(tmp_path, "--delay", "0.5")
    assert not svc.base_url.endswith(f":{stranger}")
    assert "helper_requests_total" in httpx.get(svc.base_url + "/metrics").text  # the service itself
    log = (tmp_path / "logs" / "svc.log").read_text()
    assert log.count("=== abbench: service svc launched") == 2 and "Address already in use" in log
    svc.stop()


def test_a_stranger_on_a_given_port_is_port_taken_not_healthy(tmp_path: Path, stranger: int) -> None:
    """On a port the profile fixed (no pick to repeat), the same race is PortTaken, naming the other process."""
    with pytest.raises(PortTaken, match=rf"port {stranger} was taken by pid {os.getpid()} .*exited with code 1"):
        launch(tmp_path, "--delay", "0.5", port=stranger, check_port=False)


def test_stop_kills_whole_tree_including_setsid_grandchild(tmp_path: Path) -> None:
    pidfile = tmp_path / "pids"
    svc = launch(tmp_path, "--children", "2", "--setsid-grandchild", "--pidfile", str(pidfile))
    pids = wait_pidfile(pidfile)
    assert len(pids) == 5 and pids[0] == svc.pid
    root = psutil.Process(svc.pid)
    grandchildren = pids[2::2]
    assert all(psutil.Process(g).pid in {c.pid for c in root.children(recursive=True)} for g in grandchildren)
    assert all(os.getpgid(g) != svc.pid for g in grandchildren)  # they left the group: killpg misses them
    svc.stop()
    assert_all_gone(pids)


def test_stop_escalates_to_sigkill(tmp_path: Path) -> None:
    pidfile = tmp_path / "pids"
    svc = launch(tmp_path, "--ignore-sigterm", "--children", "1", "--pidfile", str(pidfile), stop_timeout_s=0.5)
    pids = wait_pidfile(pidfile)
    t0 = time.perf_counter()
    assert svc.stop() == -9
    assert time.perf_counter() - t0 < 15  # 0.5 s of stop timeout, then SIGKILL; a stop that waited on SIGTERM never ends
    assert_all_gone(pids)


def test_stop_all_tears_down_every_live_service(tmp_path: Path) -> None:
    a = Service.launch("a", helper_argv(), env={}, log_path=tmp_path / "a.log", health_timeout_s=10, stop_timeout_s=2)
    b = Service.launch("b", helper_argv(), env={}, log_path=tmp_path / "b.log", health_timeout_s=10, stop_timeout_s=2)
    assert {s.key for s in services.live_services()} == {"a", "b"}
    assert stop_all() == ["b", "a"]
    assert not a.alive() and not b.alive()
    assert services.live_services() == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_as_the_process_starts_leaves_it_registered_for_teardown(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch,
                                                                          sig: int) -> None:
    """A signal that arrives while the service's process is being started (here: the moment Popen returns) is
    raised only once the service is registered, so the run's teardown (stop_all) finds the process and stops it
    instead of leaving it running."""
    started: list[subprocess.Popen] = []
    real = subprocess.Popen

    def popen_then_signal(*args, **kwargs):
        started.append(real(*args, **kwargs))
        os.kill(os.getpid(), sig)  # Python runs the handler at its next check: inside this call, unless held
        return started[-1]

    monkeypatch.setattr(services.subprocess, "Popen", popen_then_signal)
    try:
        with signals_as_interrupt(), pytest.raises(KeyboardInterrupt):
            launch(tmp_path)
        (proc,) = started
        assert [s.pid for s in services.live_services()] == [proc.pid]
        stop_all()
        assert_all_gone([proc.pid])
    finally:  # a process the service lost is not left to the next test
        for p in started:
            p.kill()
            p.wait()


def test_attach_existing_server(tmp_path: Path) -> None:
    with launch(tmp_path) as real:
        att = Service.attach("ext", real.base_url + "/", health_timeout_s=5)
        assert att.base_url == real.base_url and att.pid is None and att.ready_s is not None
        assert att.stop() is None  # does nothing
        assert real.alive()
        assert att.record().command is None and att.record().log is None
    port = free_port()
    with pytest.raises(HealthTimeout, match="not healthy after 0.5 s"):  # the health timeout comes first
        Service.attach("ext", f"http://127.0.0.1:{port}", health_timeout_s=0.5)


def test_attach_fails_fast_with_the_cause_where_waiting_cannot_help(tmp_path: Path) -> None:
    """A server the harness did not start: a port that refuses connections fails after REFUSED_GRACE_S (not
    the 180 s health timeout), a host that does not resolve at once; a server that accepts connections but is
    not healthy yet (still loading) is waited for up to the health timeout."""
    port = free_port()
    t0 = time.perf_counter()
    with pytest.raises(ServiceError, match=f"connection refused at http://127.0.0.1:{port}: nothing listens on "
                       f"127.0.0.1 port {port}; start the server first, or fix base_url") as e:
        Service.attach("ext", f"http://127.0.0.1:{port}", health_timeout_s=180)
    # the grace, then the error: far below the 180 s health timeout (30 s of room for a loaded machine)
    assert services.REFUSED_GRACE_S <= time.perf_counter() - t0 < services.REFUSED_GRACE_S + 30
    assert not isinstance(e.value, HealthTimeout)
    t0 = time.perf_counter()
    with pytest.raises(ServiceError, match="cannot resolve host 'no-such-host.invalid' of "
                       "http://no-such-host.invalid:8000"):
        Service.attach("ext", "http://no-such-host.invalid:8000", health_timeout_s=180)
    assert time.perf_counter() - t0 < services.REFUSED_GRACE_S
    listening = lambda url: port_in_use("127.0.0.1", int(url.rsplit(":", 1)[1]))  # noqa: E731
    with launch(tmp_path, "--never-healthy", health_check=listening) as sick:
        t0 = time.perf_counter()
        with pytest.raises(HealthTimeout, match="not healthy after 4 s"):
            Service.attach("ext", sick.base_url, health_timeout_s=4)
        assert time.perf_counter() - t0 >= 4


def test_stop_all_from_a_signal_handler(tmp_path: Path) -> None:
    import signal

    svc = launch(tmp_path)
    pid = svc.pid
    old = signal.signal(signal.SIGUSR1, lambda *_: stop_all())
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)  # the handler runs between bytecodes of this thread
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert pid is not None and gone(pid) and services.live_services() == []


def test_atexit_hook_stops_services_of_an_exiting_interpreter(tmp_path: Path) -> None:
    import subprocess

    pidfile = tmp_path / "pids"
    script = (
        "import sys; from pathlib import Path; from abbench.services import Service\n"
        f"Service.launch('x', ['{{python}}', {HELPER!r}, '--port', '{{port}}', '--children', '1', "
        f"'--pidfile', {str(pidfile)!r}], env={{}}, log_path=Path({str(tmp_path / 'x.log')!r}), "
        "health_timeout_s=10, stop_timeout_s=2)\n"
        "print('launched', flush=True)\n"  # exits without stop(): atexit must tear it down
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30,
                       cwd=Path(__file__).resolve().parents[2])
    assert r.returncode == 0, r.stderr
    assert "launched" in r.stdout
    assert_all_gone(wait_pidfile(pidfile))
