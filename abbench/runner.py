"""Executes a run: builds the prompts, walks the ABBA plan, launches each service, sends each request,
gathers telemetry and records every sample the moment it finishes.

Contract:

* ``execute(profile, run_dir, ...)`` returns the final :class:`RunRecord`; ``run.json`` is rewritten at every
  service boundary and at the end, and every finished request is appended to ``requests.jsonl`` at once
  (before it is added to the record), so a crash or Ctrl-C loses nothing that finished.
* A failed request is a failed sample (``ok=False`` with ``error_kind``/``error``), never a timing. What
  happens next is the profile's choice, ``run.on_request_failure``:

  - ``continue``: go on with the same service, unless it is dead: its process exited, or (after a
    ``connect`` or ``timeout`` failure) it no longer answers its health check. A dead service is stopped
    (its record says why) and launched again for the next step.
  - ``restart``: stop the service and launch it again for the next step.
  - ``stop``: stop the run; it is saved as ``partial`` with the reason.

  A service that cannot start (command not found, exits, never healthy) stops the run or skips the arm
  (``run.on_service_failure``: ``stop`` | ``skip-arm``; a shared service always stops); the steps of a
  skipped arm are recorded as failed samples (``error_kind`` "service"), so nothing is silently missing.
* A service launched in the middle of its block (a restart, or a resumed run) is first *primed*: the
  block's warm-up steps that come before the next step are sent again, and when the next step continues a
  group (a continuation, no reset before it) so are the group's earlier steps. Priming requests are not
  recorded; they give the next measured step the state the plan meant it to meet (a warm service, a
  prefix cache holding the cold prompt).
* A launched command must contain the ``{port}`` placeholder (abbench picks the port and checks it is
  free): a :class:`ConfigError` before anything starts otherwise.
* SIGINT/SIGTERM tear every service down and leave a valid run marked ``partial`` (:class:`Interrupted`,
  exit code 130); a second signal during that teardown is ignored. ``resume=True`` continues a partial run
  in its planned order without repeating steps that already have a sample (failed ones included); it
  refuses when the prompts, the plan or the key environment fields differ, or when another process still
  holds the run (``run.lock``). Each resume is listed in ``environment["resumed"]``.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from abbench import __version__
from abbench.client import EngineClient
from abbench.errors import AbbenchError, ConfigError, RequestError, ResultsError, ServiceError
from abbench.fingerprint import KEY_FIELDS, environment_fingerprint, key_value
from abbench.profile import ArmSpec, Profile, profile_from_dict
from abbench.prometheus import parse_prometheus
from abbench.prompts import BuiltPrompt, build_prompts
from abbench.results import (
    LOGS_DIR,
    RUN_FILE,
    RunRecord,
    Sample,
    SampleLog,
    ServiceRecord,
    Step,
    Telemetry,
    load_run,
    save_run,
)
from abbench.schedule import build_plan
from abbench.services import Service, stop_all
from abbench.nvml import gpu_idle
from abbench.telemetry import ServiceMonitor
from abbench.tokenizers import describe_tokenizer, load_tokenizer

logger = logging.getLogger(__name__)

LOCK_FILE = "run.lock"
WARMUP_KINDS = ("warmup", "jit")
DEATH_GRACE_S = 0.5
"""After a ``connect`` failure, how long a launched service's process is given to finish exiting."""


class Interrupted(AbbenchError):
    """The run was interrupted by a signal; results so far are saved and marked partial."""

    exit_code = 130


@dataclass
class ProgressEvent:
    """What the runner tells its observer (the CLI's progress display)."""

    kind: str  # "prompts" | "service" | "sample" | "warning" | "done"
    message: str
    done: int = 0
    total: int = 0
    sample: Sample | None = None


Observer = Callable[[ProgressEvent], None]


def new_run_id(profile: Profile) -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{profile.name}"


def profile_dir(profile: Profile) -> Path | None:
    """The folder of the profile file (relative paths in a profile are relative to it)."""
    return Path(profile.source_path).parent if profile.source_path else None


@contextmanager
def _signals_as_interrupt() -> Iterator[None]:
    """Turn SIGTERM into KeyboardInterrupt in the main thread for the duration of a run."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


@contextmanager
def _signals_deferred() -> Iterator[list[int]]:
    """While tearing down: SIGINT/SIGTERM are noted (in the yielded list), not raised, so a second Ctrl-C
    cannot abort the teardown half-way and leave an engine running or run.json unsaved."""
    got: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield got
        return

    def note(signum: int, frame: object) -> None:
        got.append(signum)

    old_int = signal.signal(signal.SIGINT, note)
    old_term = signal.signal(signal.SIGTERM, note)
    try:
        yield got
    finally:
        signal.signal(signal.SIGINT, old_int)
        signal.signal(signal.SIGTERM, old_term)


class _RunLock:
    """An exclusive ``flock`` on ``run_dir/run.lock`` held while a run executes, so a second ``abbench run
    --resume`` of the same directory fails at once instead of interleaving samples. The kernel drops the
    lock when the process dies, however it dies."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> _RunLock:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = ""
            try:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
            except OSError:
                pass
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise ResultsError(
                    f"{self.path.parent}: another abbench process{f' (pid {holder})' if holder else ''} is "
                    "running this run; wait for it to end (or stop it) before resuming"
                ) from None
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.ftruncate(fd, 0)
            except OSError:
                pass
            os.close(fd)  # closing the descriptor drops the flock


def _launch_commands(profile: Profile) -> list[tuple[str, list[str]]]:
    """(profile field, argv) of every command abbench may launch for this profile."""
    eng = profile.engine
    out: list[tuple[str, list[str]]] = []
    if eng.shared_service:
        if not eng.base_url and eng.command:
            out.append(("engine.command", list(eng.command)))
        return out
    for i, a in enumerate(profile.arms):
        if a.base_url or (eng.base_url and not a.command):
            continue
        if a.command:
            out.append((f"arms[{i}].command (arm {a.name})", list(a.command)))
        elif eng.command:
            out.append((f"engine.command + arms[{i}].args (arm {a.name})", list(eng.command) + list(a.args)))
    return out


def check_launch_commands(profile: Profile) -> None:
    """Every launched command must say where to listen: abbench picks a free port per service and passes it
    through the ``{port}`` placeholder, then health-checks that port. A command without it could only be
    health-checked on the wrong port (or, with a fixed port, against someone else's server)."""
    for field, argv in _launch_commands(profile):
        if not any("{port}" in str(a) for a in argv):
            raise ConfigError(
                f"{field}: {argv!r} has no {{port}} placeholder; abbench picks a free port for every service "
                "and health-checks it there, so pass it to the engine (e.g. \"--port\", \"{port}\") instead "
                "of a fixed port"
            )


class _ServiceSlot:
    """Owns the service of the current plan block: launch, restart, stop, records."""

    def __init__(self, profile: Profile, run_dir: Path, client: EngineClient, record: RunRecord) -> None:
        self.profile = profile
        self.run_dir = run_dir
        self.client = client
        self.record = record
        self.service: Service | None = None
        self.sampler: ServiceMonitor | None = None
        self.key: str | None = None
        self.launches: dict[str, int] = {}

    def _argv_env(self, arm: ArmSpec | None) -> tuple[list[str] | None, dict[str, str], str | None]:
        eng = self.profile.engine
        if self.profile.engine.shared_service or arm is None:
            base_url = eng.base_url
            argv = list(eng.command) if eng.command else None
            env = dict(eng.env)
        else:
            base_url = arm.base_url or (None if arm.command else eng.base_url)
            argv = list(arm.command) if arm.command else (list(eng.command) + list(arm.args) if eng.command else None)
            env = {**eng.env, **arm.env}
        return (None if base_url else argv), env, base_url

    def start(self, key: str, arm: ArmSpec | None, round_no: int | None) -> Service:
        self.stop()
        eng = self.profile.engine
        argv, env, base_url = self._argv_env(arm)
        n = self.launches.get(key, 0)
        self.launches[key] = n + 1
        log_name = (f"{key}.log" if n == 0 else f"{key}.restart{n}.log").replace("@", "_")
        arms = [a.name for a in self.profile.arms] if eng.shared_service else [arm.name if arm else key]
        idle_before = gpu_idle()
        try:
            if base_url:
                svc = Service.attach(key, base_url, health_path=eng.health_path,
                                     health_timeout_s=eng.health_timeout_s, health_check=self.client.health,
                                     arms=arms, round=round_no)
            else:
                assert argv is not None
                svc = Service.launch(key, argv, env=env, log_path=self.run_dir / LOGS_DIR / log_name,
                                     health_path=eng.health_path, health_timeout_s=eng.health_timeout_s,
                                     stop_timeout_s=eng.stop_timeout_s, health_check=self.client.health,
                                     profile_dir=profile_dir(self.profile), arms=arms, round=round_no)
        except (ServiceError, KeyboardInterrupt) as e:  # the launch stopped what it started already
            error = str(e).splitlines()[0] if isinstance(e, ServiceError) else "interrupted while starting"
            self.record.services.append(ServiceRecord(
                key=key, arms=arms, round=round_no, command=argv, env=env, base_url=base_url or "",
                log=None if base_url else f"{LOGS_DIR}/{log_name}", gpu_idle_before=idle_before,
                error=error))
            raise
        svc.gpu_idle_before = idle_before
        self.service = svc
        self.key = key
        self.record.services.append(svc.record(self.run_dir))
        self.sampler = ServiceMonitor(key, svc.pid).start()
        return svc

    def stop(self, error: str | None = None) -> None:
        """Stop the current service (if any); ``error`` says why when it is being replaced because it died."""
        if self.sampler is not None:
            self.sampler.stop()
            self.record.memory.extend(self.sampler.points())
            self.sampler = None
        if self.service is not None:
            svc, self.service, self.key = self.service, None, None
            if error:
                svc.error = error
            svc.stop()
            svc.gpu_idle_after = gpu_idle()
            self.record.services[-1] = svc.record(self.run_dir)


def _scrape(client: EngineClient, base_url: str, path: str | None) -> dict[str, float] | None:
    if not path:
        return None
    try:
        text = client.metrics_text(base_url, path)
        return parse_prometheus(text) if text else None
    except (ValueError, RequestError):
        return None


def _close_window(sampler: ServiceMonitor, mark: int) -> None:
    """Close the telemetry window of a request that failed (an open one keeps fast PCIe sampling on)."""
    try:
        sampler.window(mark, settle_s=0.0)
    except Exception:  # noqa: BLE001 - telemetry never breaks the run
        logger.debug("closing telemetry window %s failed", mark, exc_info=True)


def _failed_sample(step: Step, service: str, kind: str, message: str) -> Sample:
    return Sample(step=step.index, arm=step.arm, round=step.round, position=step.position,
                  prompt_id=step.prompt_id, kind=step.kind, excluded=step.excluded, service=service,
                  ok=False, error_kind=kind, error=message, started_at=time.time())


def prepare(profile: Profile, *, cache_dir: Path | None = None) -> tuple[object, list[BuiltPrompt]]:
    """Load the tokenizer and build every prompt of the profile (exact lengths, checked)."""
    tok = load_tokenizer(profile.tokenizer.source, base_dir=profile_dir(profile), cache_dir=cache_dir)
    built = build_prompts(tok, profile.prompts, base_dir=profile_dir(profile))
    return tok, built


def priming_steps(plan: list[Step], step: Step) -> list[Step]:
    """What a service launched just before ``step`` in the middle of its block must see first (see the module
    docstring): the block's warm-up steps before ``step``, then, when ``step`` continues a group without a
    reset, the group's earlier steps of the same arm. Empty at the start of a block."""
    before = [s for s in plan if s.service == step.service and s.index < step.index]
    if not before:
        return []
    warm = [s for s in before if s.kind in WARMUP_KINDS]
    prefix: list[Step] = []
    if not step.reset_before and step.kind not in WARMUP_KINDS:
        for s in reversed(before):
            if s.arm != step.arm or s.group != step.group or s.kind in WARMUP_KINDS:
                break
            prefix.insert(0, s)
            if s.reset_before:
                break
    return warm + prefix


def _resume_environment_check(run_dir: Path, old: dict, new: dict) -> list[str]:
    """Key fingerprint fields that differ between the run and this process. A difference only in the
    local-changes hash of the checkout (``engine_commit`` ``+dirty.<hash>``) is returned as a note
    (prefixed ``note:``); any other difference refuses the resume."""
    notes: list[str] = []
    for field in KEY_FIELDS:
        a, b = key_value(old, field), key_value(new, field)
        if a == b:
            continue
        if field == "engine_commit" and isinstance(a, str) and isinstance(b, str) \
                and a.split("+dirty")[0] == b.split("+dirty")[0]:
            notes.append(f"note: engine_commit {a} -> {b} (same commit, other local changes)")
            continue
        raise ResultsError(
            f"{run_dir}: cannot resume: {field} was {a!r} when the run started and is {b!r} now; samples "
            "from two environments would be mixed in one run. Start a new run instead"
        )
    return notes


def execute(
    profile: Profile,
    run_dir: Path,
    *,
    resume: bool = False,
    observer: Observer | None = None,
    cache_dir: Path | None = None,
    argv: list[str] | None = None,
) -> RunRecord:
    """Run the profile into ``run_dir`` (or resume the partial run there)."""
    lock = _RunLock(run_dir)
    try:
        with _signals_as_interrupt():
            return _execute(profile, run_dir, lock, resume=resume, observer=observer, cache_dir=cache_dir,
                            argv=argv)
    except KeyboardInterrupt as e:  # before the first request: nothing ran, nothing to tear down
        what = "the resumed run is unchanged" if resume else "no run was saved"
        raise Interrupted(f"interrupted ({e or 'SIGINT'}) while preparing the run; {what}") from None
    finally:
        lock.release()


def _execute(
    profile: Profile,
    run_dir: Path,
    lock: _RunLock,
    *,
    resume: bool,
    observer: Observer | None,
    cache_dir: Path | None,
    argv: list[str] | None,
) -> RunRecord:
    notify = observer or (lambda ev: None)
    existing: RunRecord | None = None
    if resume:
        if (run_dir / RUN_FILE).is_file():
            try:
                lock.acquire()
            except OSError as e:
                raise ResultsError(f"{run_dir}: cannot lock the run for resuming: {e}") from None
        existing, problems = load_run(run_dir)
        for problem in problems:
            notify(ProgressEvent("warning", f"resuming {run_dir}: {problem}"))
        if existing.status == "complete":
            raise ResultsError(f"{run_dir}: this run is already complete; nothing to resume")
        profile = profile_from_dict(existing.profile, where=f"{run_dir}/run.json profile")
    check_launch_commands(profile)

    notify(ProgressEvent("prompts", "building exact-length prompts"))
    tok, built = prepare(profile, cache_dir=cache_dir)
    by_id = {b.record.id: b for b in built}
    prompt_records = [b.record for b in built]
    arms = [a.name for a in profile.arms]
    plan = build_plan(prompt_records, arms, profile.run.rounds, shared_service=profile.engine.shared_service,
                      reset_between_samples=profile.run.reset_between_samples,
                      exclude_kinds=list(profile.run.exclude_kinds))
    commands = [argv_ for _, argv_ in _launch_commands(profile)]
    env = environment_fingerprint(commands)

    if existing is not None:
        old = {p.id: p.sha256 for p in existing.prompts}
        new = {p.id: p.sha256 for p in prompt_records}
        if old != new:
            raise ResultsError(f"{run_dir}: the prompts rebuilt now differ from the run's (tokenizer or "
                               "corpus changed); cannot resume")
        if [s.model_dump() for s in existing.plan] != [s.model_dump() for s in plan]:
            raise ResultsError(f"{run_dir}: the plan rebuilt now differs from the run's; cannot resume")
        notes = _resume_environment_check(run_dir, existing.environment, env)
        record = existing
        record.environment.setdefault("resumed", []).append({
            "at": time.time(), "argv": argv or [], "after_samples": len(record.samples),
            "previous_status": record.status, "previous_reason": record.status_reason,
            "engine_commit": env.get("engine_commit"), "notes": notes,
        })
        for n in notes:
            notify(ProgressEvent("warning", f"resuming with {n.removeprefix('note: ')}"))
        record.status = "running"
        record.status_reason = None
    else:
        env["tokenizer"] = describe_tokenizer(tok)
        env["argv"] = argv or []
        record = RunRecord(run_id=run_dir.name, status="running", created_at=time.time(),
                           abbench_version=__version__, profile=profile.model_dump(mode="json"),
                           environment=env, prompts=prompt_records, plan=plan)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / LOGS_DIR).mkdir(exist_ok=True)
        if not resume:
            lock.acquire()
        save_run(run_dir, record)
        log = SampleLog(run_dir)
    except OSError as e:
        raise ConfigError(f"run directory {run_dir}: cannot write there ({e.strerror or e}); choose another "
                          "--out") from None
    if log.repaired:
        notify(ProgressEvent("warning", log.repaired))

    done_steps = {s.step for s in record.samples}
    todo = [s for s in plan if s.index not in done_steps]
    total = len(plan)
    client = EngineClient()
    slot = _ServiceSlot(profile, run_dir, client, record)
    for s_rec in record.services:  # resumed: a relaunched service gets a log of its own (KEY.restartN.log)
        slot.launches[s_rec.key] = slot.launches.get(s_rec.key, 0) + 1
    skipped_arms: set[str] = set()
    eng = profile.engine
    req = profile.request
    retok = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    # A server that tokenizes with special tokens (a BOS) counts them in usage.prompt_tokens.
    added = int(record.environment.get("tokenizer", {}).get("special_tokens_added") or 0)

    def record_sample(sample: Sample) -> None:
        log.append(sample)  # the durable copy first: an interrupt in between leaves it in requests.jsonl
        record.samples.append(sample)
        notify(ProgressEvent("sample", f"{sample.arm} {sample.prompt_id}", len(record.samples), total, sample))

    def send(svc: Service, st: Step) -> object:
        """The request of step ``st`` (after the engine's reset when the plan says so)."""
        if st.reset_before and eng.reset_path:
            client.reset(svc.base_url, eng.reset_path)
        bp = by_id[st.prompt_id]
        return client.complete(svc.base_url, bp.text, request=req, extra={**req.extra, **profile.arm(st.arm).request},
                               target_prompt_tokens=bp.record.target_tokens + added, model=eng.model,
                               retokenize=retok, adapter=eng.adapter)

    def prime(svc: Service, step: Step) -> None:
        steps = priming_steps(plan, step)
        if not steps:
            return
        notify(ProgressEvent("service", f"priming {step.service}: re-sending {len(steps)} earlier request(s)",
                             len(record.samples), total))
        for st in steps:
            try:
                send(svc, st)
            except RequestError as e:
                logger.warning("priming %s with step %d failed: %s", step.service, st.index, e)

    def why_dead(svc: Service, step: Step, e: RequestError) -> str | None:
        """Why the service cannot serve the next step, or None when it still can."""
        if svc.launched:
            deadline = time.monotonic() + (DEATH_GRACE_S if e.kind == "connect" else 0.0)
            while True:
                if not svc.alive():
                    return f"exited during step {step.index} ({e.kind} failure)"
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.02)
        if e.kind in ("connect", "timeout") and not client.health(svc.base_url, eng.health_path):
            return f"stopped answering its health check after step {step.index} ({e.kind} failure)"
        return None

    interrupted: BaseException | None = None
    try:
        for step in todo:
            arm = profile.arm(step.arm)
            if step.arm in skipped_arms:
                record_sample(_failed_sample(step, step.service, "service", "arm skipped: its service failed"))
                continue
            if slot.key != step.service or slot.service is None or not slot.service.alive():
                if slot.key == step.service and slot.service is not None:
                    slot.stop(error=f"exited before step {step.index}")  # died between requests
                restarting = step.service in slot.launches
                notify(ProgressEvent("service", f"{'restarting' if restarting else 'starting'} {step.service}",
                                     len(record.samples), total))
                try:
                    svc = slot.start(step.service, None if eng.shared_service else arm, step.round)
                    save_run(run_dir, record)
                except ServiceError as e:
                    save_run(run_dir, record)
                    if profile.run.on_service_failure == "stop" or eng.shared_service:
                        raise
                    skipped_arms.add(step.arm)
                    notify(ProgressEvent("warning", f"arm {step.arm} skipped (run.on_service_failure = "
                                         f"skip-arm): {e}", len(record.samples), total))
                    record_sample(_failed_sample(step, step.service, "service", str(e).splitlines()[0]))
                    continue
                prime(svc, step)
            svc = slot.service
            assert svc is not None
            sampler = slot.sampler
            mark: int | None = None
            try:
                if step.reset_before and eng.reset_path:
                    client.reset(svc.base_url, eng.reset_path)
                before = _scrape(client, svc.base_url, eng.metrics_path)
                bp = by_id[step.prompt_id]
                mark = sampler.mark() if sampler is not None else None  # the window spans the request alone
                c = client.complete(svc.base_url, bp.text, request=req, extra={**req.extra, **arm.request},
                                    target_prompt_tokens=bp.record.target_tokens + added, model=eng.model,
                                    retokenize=retok, adapter=eng.adapter)
                window = sampler.window(mark) if sampler is not None and mark is not None else {}
                mark = None
                after = _scrape(client, svc.base_url, eng.metrics_path)
                sample = Sample(step=step.index, arm=step.arm, round=step.round, position=step.position,
                                prompt_id=step.prompt_id, kind=step.kind, excluded=step.excluded,
                                service=step.service, ok=True, started_at=c.started_at, ttft_s=c.ttft_s,
                                total_s=c.total_s, output_ids=c.output_ids, ids_source=c.ids_source,
                                text=c.text, finish_reason=c.finish_reason, prompt_tokens=c.prompt_tokens,
                                completion_tokens=c.completion_tokens, saw_done=c.saw_done,
                                logprobs=c.logprobs, engine=c.engine,
                                telemetry=Telemetry(metrics_before=before, metrics_after=after, **window))
                record_sample(sample)
            except RequestError as e:
                if mark is not None and sampler is not None:
                    _close_window(sampler, mark)
                    mark = None
                record_sample(_failed_sample(step, step.service, e.kind, e.detail))
                policy = profile.run.on_request_failure
                if policy == "stop":
                    record.status = "partial"
                    record.status_reason = f"stopped after a failed request at step {step.index} " \
                                           f"(run.on_request_failure = stop): {e}"
                    break
                dead = why_dead(svc, step, e)
                if dead:
                    notify(ProgressEvent("warning", f"service {step.service} {dead}; it is launched again for "
                                         "the next step", len(record.samples), total))
                    slot.stop(error=dead)
                elif policy == "restart":
                    slot.stop()  # the next step launches it again
            finally:
                if mark is not None and sampler is not None:  # an interrupt mid-request
                    _close_window(sampler, mark)
        else:
            record.status = "complete"
    except KeyboardInterrupt as e:
        interrupted = e
        record.status = "partial"
        record.status_reason = f"interrupted ({e or 'SIGINT'})"
    except AbbenchError as e:
        record.status = "partial"
        record.status_reason = str(e).splitlines()[0]
        raise
    finally:
        with _signals_deferred():
            try:
                slot.stop()
            finally:
                stop_all()
                client.close()
                log.close()
                if record.status == "running":
                    record.status = "partial"
                    record.status_reason = record.status_reason or "ended unexpectedly"
                record.finished_at = time.time()
                save_run(run_dir, record)
                notify(ProgressEvent("done", record.status, len(record.samples), total))
    if interrupted is not None:
        raise Interrupted(f"interrupted; {len(record.samples)} samples saved in {run_dir} (resume with "
                          f"`abbench run --resume {run_dir}`)")
    return record


def check_run_dir_free(run_dir: Path) -> None:
    if (run_dir / "run.json").exists():
        raise ConfigError(f"--out {run_dir}: a run already exists there; choose another directory or use --resume")
