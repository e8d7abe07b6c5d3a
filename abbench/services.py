"""Launching, health-waiting, logging and tearing down engine services (ports and hosts: :mod:`abbench.ports`).

Contract
--------
* :func:`expand_command` substitutes exactly three placeholders in every argv element: ``{python}`` (this
  interpreter, ``sys.executable``), ``{port}`` and ``{profile_dir}``. Nothing else is touched: a literal
  brace (a JSON argument, ``{"a": 1}``) survives as is. ``str.format`` is never used.
* :meth:`Service.launch` starts an argv **without a shell** in a new session (its own process group), with
  stdout and stderr going to ONE log file (a header line written by abbench first, then the service's own
  output; ``PYTHONUNBUFFERED=1`` so Python services write line by line). The environment is
  ``os.environ`` + ``PYTHONUNBUFFERED=1`` + the profile's env (the profile wins). Before launching, the
  port is checked to be free (connect + bind): a port held by another process is a clear
  :class:`ServiceError` naming the port, never a silent health check against someone else's server. It
  then polls ``GET base_url + health_path`` (200 = healthy; every 0.1 s, backing off to 0.25 s) or a custom
  ``health_check(base_url) -> bool``, until healthy or ``health_timeout_s``:

  - the process exits first -> :class:`ServiceError` with its exit code and the tail of its log;
  - the answer comes from another process on the port, one running before the launch and outside the
    service's process tree (:meth:`Service._stranger_on_port`, where psutil can see listeners): it does not
    count; if the service then exits (it could not bind), that is :class:`PortTaken`, and a port abbench picked
    is picked again, up to :data:`PORT_ATTEMPTS` launches in all;
  - the timeout passes -> the whole process tree is killed, then :class:`HealthTimeout` with the log tail;
  - the command does not exist / is not executable -> :class:`ServiceError` ("command not found: X; check
    engine.command in the profile").

* :meth:`Service.attach` wraps an already running server (a profile's ``base_url``): health is checked the
  same way, nothing is launched, ``stop()`` does nothing, ``pid`` is None. It fails fast with the cause
  where waiting cannot help: a host that does not resolve at once, and a port that refuses connections for
  :data:`REFUSED_GRACE_S` (a server that accepts but is not healthy yet, e.g. still loading its weights,
  is waited for up to ``health_timeout_s``).
* :meth:`Service.stop` is idempotent and safe from a ``finally`` block or a signal handler: it captures the
  process tree with psutil (so children that left the process group, e.g. by ``setsid``, are known even if
  the root dies first), sends SIGTERM to the process group and to those strays, waits ``stop_timeout_s``,
  then SIGKILLs the group and every survivor, reaps the root and records its exit code (negative = killed
  by that signal, as in :mod:`subprocess`). It never blocks without a bound (no un-timed ``wait()``, which
  could deadlock when a signal handler interrupts a ``wait`` in the same thread).
* Every launched service is held in a module registry until stopped; :func:`stop_all` tears all of them
  down (newest first) and is registered with :mod:`atexit`, so the runner's SIGINT/SIGTERM handler (or a
  plain interpreter exit) leaves no engine process behind. A SIGKILL of abbench itself cannot be caught:
  services run in their own session and would survive it.

Known limits: :func:`free_port` is the usual bind-to-0 trick, so another process may take the port between
the check and the service's bind. The service then fails to bind and exits, but the other process may answer
the health check first: that answer is refused where psutil can see the listener (on Linux, a process of the
same user), and the service is launched again on another port. A service whose listener is not in its own
process tree (``docker run -p``) works, but the port check can only see the host side.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import psutil

from abbench.errors import AbbenchError, ConfigError, HealthTimeout, PortTaken, ServiceError
from abbench.ports import describe_pid, free_port, listening_pids, port_in_use, port_owner, unreachable, url_host
from abbench.results import ServiceRecord
from abbench.signals import signals_held

log = logging.getLogger(__name__)

POLL_FIRST_S = 0.1
POLL_MAX_S = 0.25
PORT_ATTEMPTS = 3  # launches on a port abbench picked, when another process takes it as the service starts
HEALTH_REQUEST_TIMEOUT_S = 1.0
LOG_TAIL_BYTES = 64 * 1024
_REAP_GRACE_S = 5.0
REFUSED_GRACE_S = 3.0
"""How long an attached server's port may refuse connections before the attach fails (a server being
restarted by hand gets these seconds; one that is not running fails in them, not after its health timeout)."""

HealthCheck = Callable[[str], bool]


# ----------------------------------------------------------------------------------------------- helpers


def expand_command(argv: list[str], *, port: int, profile_dir: Path | None) -> list[str]:
    """``argv`` with ``{python}``, ``{port}`` and ``{profile_dir}`` substituted in every element.

    Only these three placeholders are replaced (plain substring replacement, never ``str.format``), so
    any other brace survives. ``{profile_dir}`` without a profile directory is a :class:`ConfigError`."""
    out: list[str] = []
    for arg in argv:
        a = str(arg)
        if "{profile_dir}" in a:
            if profile_dir is None:
                raise ConfigError(
                    f"command argument {arg!r} uses {{profile_dir}}, but the profile has no directory "
                    "(it was not loaded from a file); use an absolute path"
                )
            a = a.replace("{profile_dir}", str(profile_dir))
        a = a.replace("{python}", sys.executable).replace("{port}", str(port))
        out.append(a)
    return out


def _http_health_check(url: str) -> HealthCheck:
    import httpx

    from abbench.auth import default_tls_context

    def check(_base_url: str) -> bool:
        try:
            # trust_env=False: a proxy from the environment must not sit between us and a local server.
            r = httpx.get(url, timeout=HEALTH_REQUEST_TIMEOUT_S, trust_env=False, verify=default_tls_context())
        except httpx.HTTPError:
            return False
        return r.status_code == 200

    return check


def _is_gone(p: psutil.Process) -> bool:
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def _wait_gone(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Wait (bounded, polling) until ``procs`` are gone; a zombie counts as gone (its reaper may be slow,
    it runs nothing). Returns the survivors."""
    deadline = time.monotonic() + timeout_s
    alive = list(procs)
    while True:
        alive = [p for p in alive if not _is_gone(p)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.02)


def _read_tail(path: Path | None, n_lines: int) -> str:
    if path is None:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - LOG_TAIL_BYTES))
            data = f.read()
    except OSError:
        return ""
    lines = data.decode("utf-8", errors="replace").splitlines()
    return "\n".join(lines[-n_lines:]) if n_lines > 0 else ""


# ---------------------------------------------------------------------------------------------- registry

_registry_lock = threading.RLock()  # reentrant: stop_all may run in a signal handler of the same thread
_live: dict[int, Service] = {}


def live_services() -> list[Service]:
    """Launched services that have not been stopped yet, oldest first."""
    with _registry_lock:
        return list(_live.values())


def stop_all() -> list[str]:
    """Stop every live launched service (newest first). Returns their keys. Never raises."""
    stopped: list[str] = []
    for svc in reversed(live_services()):
        try:
            svc.stop()
        except Exception:  # noqa: BLE001 - teardown must go on for the others
            log.exception("stopping service %s failed", svc.key)
        stopped.append(svc.key)
    return stopped


atexit.register(stop_all)


# ----------------------------------------------------------------------------------------------- Service


class Service:
    """One engine service: launched by abbench (:meth:`launch`) or already running (:meth:`attach`).

    Use as a context manager (``with Service.launch(...) as svc:``) or call :meth:`stop` in a
    ``finally``. The runner may set ``gpu_idle_before``/``gpu_idle_after``/``error`` before
    :meth:`record`."""

    def __init__(
        self,
        key: str,
        *,
        base_url: str,
        argv: list[str] | None,
        profile_env: dict[str, str],
        log_path: Path | None,
        stop_timeout_s: float,
        arms: list[str],
        round: int | None,
    ) -> None:
        self.key = key
        self._base_url = base_url.rstrip("/")
        self.argv = argv
        self.profile_env = dict(profile_env)
        self.log_path = log_path
        self.stop_timeout_s = stop_timeout_s
        self.arms = list(arms)
        self.round = round
        self.started_at: float | None = None
        self.stopped_at: float | None = None
        self.exit_code: int | None = None
        self.gpu_idle_before: bool | None = None
        self.gpu_idle_after: bool | None = None
        self.error: str | None = None
        self.control: dict | None = None  # the runner's start-up probe of the reset and metrics paths
        self._ready_s: float | None = None
        self._t0: float | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._ps: psutil.Process | None = None  # the root, pinned by create time (safe against pid reuse)
        self._port: int | None = None  # the port a launched service was given
        self._stranger: str | None = None  # another process that answered on that port (_stranger_on_port)
        self._stopped = False
        self._stop_lock = threading.RLock()

    # -- construction -------------------------------------------------------------------------------

    @classmethod
    def launch(
        cls,
        key: str,
        argv: list[str],
        *,
        env: dict[str, str],
        log_path: Path,
        host: str = "127.0.0.1",
        port: int | None = None,
        health_path: str = "/health",
        health_timeout_s: float = 180.0,
        stop_timeout_s: float = 15.0,
        health_check: HealthCheck | None = None,
        profile_dir: Path | None = None,
        arms: list[str] | None = None,
        round: int | None = None,
        check_port: bool = True,
    ) -> Service:
        """Launch ``argv`` and wait until it is healthy; see the module docstring for the failure modes.

        ``port`` None picks a free one. Placeholders left in ``argv`` are expanded here (``{profile_dir}``
        needs ``profile_dir``). ``env`` is the profile's env (recorded; added on top of ``os.environ``).
        ``check_port=False`` skips the "port already in use" pre-check (tests use it to see the service's
        own bind failure)."""
        if not argv:
            raise ServiceError(f"service {key}: empty command; set engine.command (or the arm's command)")
        picked = port is None
        for attempt in range(1, PORT_ATTEMPTS + 1):
            p = free_port(host) if picked else port
            assert p is not None
            base_url = f"http://{url_host(host)}:{p}"
            if check_port and port_in_use(host, p):
                owner = port_owner(p)
                raise ServiceError(
                    f"service {key}: port {p} on {host} is already in use"
                    + (f" by {owner}" if owner else " by another process")
                    + "; stop that process or let abbench pick a free port ({port} placeholder)"
                )
            svc = cls(
                key,
                base_url=base_url,
                argv=expand_command(list(argv), port=p, profile_dir=profile_dir),
                profile_env=env,
                log_path=Path(log_path),
                stop_timeout_s=stop_timeout_s,
                arms=arms or [],
                round=round,
            )
            svc._port = p
            svc._start(env)
            check = health_check or _http_health_check(base_url + health_path)
            try:
                svc._wait_healthy(check, health_timeout_s, what=f"GET {health_path}")
            except PortTaken as e:
                svc.stop()
                if not picked or attempt == PORT_ATTEMPTS:
                    raise
                log.warning("service %s: %s; launching it again on another port", key, str(e).splitlines()[0])
                continue
            except BaseException:  # KeyboardInterrupt while waiting too: leave nothing running
                svc.stop()
                raise
            return svc
        raise AssertionError("unreachable")  # every attempt returns or raises

    @classmethod
    def attach(
        cls,
        key: str,
        base_url: str,
        *,
        health_path: str = "/health",
        health_timeout_s: float = 30.0,
        health_check: HealthCheck | None = None,
        arms: list[str] | None = None,
        round: int | None = None,
    ) -> Service:
        """Wrap a server that is already running at ``base_url``; wait for it to be healthy."""
        svc = cls(
            key,
            base_url=base_url,
            argv=None,
            profile_env={},
            log_path=None,
            stop_timeout_s=0.0,
            arms=arms or [],
            round=round,
        )
        svc.started_at = time.time()
        svc._t0 = time.perf_counter()
        inner = health_check or _http_health_check(svc.base_url + health_path)
        refused_since: list[float] = []

        def check(url: str) -> bool:
            if inner(url):
                return True
            why = unreachable(url)
            if why is None:
                refused_since.clear()
                return False
            refused_since.append(time.perf_counter())
            if why.startswith("cannot resolve") or refused_since[-1] - refused_since[0] >= REFUSED_GRACE_S:
                svc.error = why
                raise ServiceError(f"service {key}: {why}; start the server first, or fix base_url in the "
                                   "profile")
            return False

        svc._wait_healthy(check, health_timeout_s, what=f"GET {health_path}")
        return svc

    def _start(self, profile_env: dict[str, str]) -> None:
        assert self.argv is not None and self.log_path is not None
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **{k: str(v) for k, v in profile_env.items()}}
        self.started_at = time.time()
        self._t0 = time.perf_counter()
        # a SIGINT/SIGTERM between the fork and the registration would leave a process no teardown knows of:
        # held over both, and raised as KeyboardInterrupt once the service is registered (stop_all finds it)
        with signals_held(), open(self.log_path, "ab", buffering=0) as logf:
            stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(self.started_at))
            logf.write(f"=== abbench: service {self.key} launched {stamp}: {self.argv!r}\n".encode())
            try:
                self._proc = subprocess.Popen(
                    self.argv,
                    stdin=subprocess.DEVNULL,
                    stdout=logf,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                    close_fds=True,
                )
            except FileNotFoundError:
                msg = f"command not found: {self.argv[0]}; check engine.command in the profile"
                logf.write(f"=== abbench: {msg}\n".encode())
                raise ServiceError(f"service {self.key}: {msg}") from None
            except PermissionError:
                msg = f"command not executable: {self.argv[0]}; check engine.command in the profile"
                logf.write(f"=== abbench: {msg}\n".encode())
                raise ServiceError(f"service {self.key}: {msg}") from None
            except OSError as e:
                msg = f"cannot start {self.argv[0]}: {e}"
                logf.write(f"=== abbench: {msg}\n".encode())
                raise ServiceError(f"service {self.key}: {msg}") from None
            with _registry_lock:
                _live[id(self)] = self
        try:
            self._ps = psutil.Process(self._proc.pid)
        except psutil.Error:
            self._ps = None  # already gone; the health loop reports its exit
        log.info("service %s: pid %d, %s, log %s", self.key, self._proc.pid, self.base_url, self.log_path)

    def _wait_healthy(self, check: HealthCheck, timeout_s: float, *, what: str) -> None:
        t0 = time.perf_counter()
        deadline = t0 + timeout_s
        delay = POLL_FIRST_S
        while True:
            if self._proc is not None:
                rc = self._proc.poll()
                if rc is not None and self._stranger is not None:
                    self.stop()
                    self.error = (f"port {self._port} was taken by {self._stranger}, which answered the health "
                                  f"check, and the service exited with code {rc}")
                    raise PortTaken(f"service {self.key}: {self.error} ({self.base_url}); see {self.log_path}",
                                    log_tail=self.log_tail())
                if rc is not None:
                    self.stop()
                    self.error = f"exited with code {rc} before becoming healthy"
                    raise ServiceError(
                        f"service {self.key}: {self.error} ({self.base_url}); see {self.log_path}",
                        log_tail=self.log_tail(),
                    )
            try:
                healthy = bool(check(self.base_url))
            except AbbenchError:  # the check says waiting cannot help (a refused API key, an untrusted cert)
                self.stop()
                raise
            except Exception as e:  # noqa: BLE001 - a custom check that raises means "not yet"
                log.debug("service %s: health check raised %r", self.key, e)
                healthy = False
            if healthy and self._proc is not None:
                # The answer must come from our process, not from one that just died (or a stranger).
                if self._proc.poll() is not None:
                    continue  # loop again: the exit branch reports it
                stranger = self._stranger_on_port()
                if stranger is not None:  # not ours: wait for ours to bind, or to exit (PortTaken)
                    if self._stranger is None:
                        log.warning("service %s: %s answers on port %s, not the service", self.key, stranger,
                                    self._port)
                    self._stranger, healthy = stranger, False
            if healthy:
                self._ready_s = time.perf_counter() - (self._t0 if self._t0 is not None else t0)
                log.info("service %s: healthy after %.2f s", self.key, self._ready_s)
                return
            now = time.perf_counter()
            if now >= deadline:
                self.error = f"not healthy after {timeout_s:g} s ({what} at {self.base_url})" + (
                    f"; {self._stranger} answered on its port instead" if self._stranger else "")
                if self._proc is not None:
                    self.stop()
                    raise HealthTimeout(
                        f"service {self.key}: {self.error}; the process was killed; see {self.log_path}",
                        log_tail=self.log_tail(),
                    )
                raise HealthTimeout(f"service {self.key}: {self.error}")
            time.sleep(min(delay, max(0.0, deadline - now)))
            delay = min(delay * 1.5, POLL_MAX_S)

    def _stranger_on_port(self) -> str | None:
        """'pid N (name)' of a process listening on this launched service's port that is not in its process
        tree and was running before the service was launched: someone else's server, which answered for it.
        None when there is none or psutil cannot tell. A listener started after the launch outside the tree
        (``docker run -p``'s proxy) is taken for the service's own."""
        if self._port is None or self._ps is None or self.started_at is None:
            return None
        pids = listening_pids(self._port)
        if not pids:
            return None
        try:
            ours = {self._ps.pid} | {c.pid for c in self._ps.children(recursive=True)}
        except psutil.Error:
            return None
        for pid in sorted(pids - ours):
            try:
                if psutil.Process(pid).create_time() < self.started_at:
                    return describe_pid(pid)
            except psutil.Error:
                continue
        return None

    # -- properties ---------------------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        return self._base_url

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def ready_s(self) -> float | None:
        """Seconds from launch (or attach) to the first healthy answer."""
        return self._ready_s

    @property
    def launched(self) -> bool:
        return self._proc is not None

    def alive(self) -> bool:
        """Launched: the root process is still running. Attached: True (abbench cannot tell without a
        request; use a health check)."""
        if self._proc is None:
            return not self._stopped
        return self._proc.poll() is None

    def log_tail(self, n_lines: int = 40) -> str:
        """The last ``n_lines`` of the service log ("" for an attached server)."""
        return _read_tail(self.log_path, n_lines)

    def record(self, run_dir: Path | None = None) -> ServiceRecord:
        """This service as a :class:`ServiceRecord`; the log path is relative to ``run_dir`` when inside."""
        log_s: str | None = None
        if self.log_path is not None:
            log_s = str(self.log_path)
            if run_dir is not None:
                try:
                    log_s = str(Path(self.log_path).resolve().relative_to(Path(run_dir).resolve()))
                except ValueError:
                    pass
        return ServiceRecord(
            key=self.key,
            arms=self.arms,
            round=self.round,
            command=self.argv,
            env=self.profile_env,
            base_url=self.base_url,
            log=log_s,
            started_at=self.started_at,
            ready_s=self._ready_s,
            stopped_at=self.stopped_at,
            exit_code=self.exit_code,
            gpu_idle_before=self.gpu_idle_before,
            gpu_idle_after=self.gpu_idle_after,
            error=self.error,
            control=self.control,
        )

    # -- teardown -----------------------------------------------------------------------------------

    def _tree(self) -> list[psutil.Process]:
        """Descendants of the root (captured now, while the root still links them). Empty once the root
        is reaped or gone: its pid may then belong to an unrelated process."""
        if self._proc is None or self._ps is None or self._proc.returncode is not None:
            return []
        try:
            if not self._ps.is_running():  # compares create time: false for a reused pid
                return []
            return self._ps.children(recursive=True)
        except psutil.Error:
            return []

    def _reaped_or_zombie(self) -> bool:
        assert self._proc is not None
        if self._proc.poll() is not None:
            return True
        if self._ps is None:
            return True
        return _is_gone(self._ps)

    def _wait_root(self, timeout_s: float) -> bool:
        """Bounded wait for the root to exit (poll-based: never blocks on Popen's wait lock)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self._reaped_or_zombie():
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)

    def _signal_group(self, sig: int) -> None:
        assert self._proc is not None
        try:
            os.killpg(self._proc.pid, sig)  # start_new_session: pgid == pid of the root
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self) -> int | None:
        """Tear the service down (see the module docstring). Returns the root's exit code. Idempotent."""
        with self._stop_lock:
            if self._stopped:
                return self.exit_code
            self._stopped = True
            if self._proc is None:  # attached: nothing of ours to stop
                self.stopped_at = time.time()
                return None
            try:
                tree = self._tree()
                self._signal_group(signal.SIGTERM)
                for p in tree:  # strays that left the group (setsid) get it too; psutil checks pid reuse
                    try:
                        p.terminate()
                    except psutil.Error:
                        pass
                t_end = time.monotonic() + max(0.0, self.stop_timeout_s)
                self._wait_root(max(0.0, t_end - time.monotonic()))
                alive = _wait_gone(tree, max(0.0, t_end - time.monotonic()))
                # Whatever is left (root, group members, strays): SIGKILL.
                self._signal_group(signal.SIGKILL)
                for p in alive + self._tree():
                    try:
                        p.kill()
                    except psutil.Error:
                        pass
                self._wait_root(_REAP_GRACE_S)
                _wait_gone(alive, _REAP_GRACE_S)
                try:
                    self.exit_code = self._proc.wait(timeout=_REAP_GRACE_S)
                except subprocess.TimeoutExpired:
                    self.exit_code = self._proc.returncode
            finally:
                self.stopped_at = time.time()
                with _registry_lock:
                    _live.pop(id(self), None)
            log.info("service %s: stopped, exit code %s", self.key, self.exit_code)
            return self.exit_code

    def __enter__(self) -> Service:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "attached" if self._proc is None else ("stopped" if self._stopped else f"pid {self.pid}")
        return f"Service({self.key!r}, {self.base_url}, {state})"
