"""Executes a run: builds the prompts, walks the ABBA plan, launches each service, sends each request,
gathers telemetry and records every sample the moment it finishes.

:func:`execute` opens a :class:`Run` (:meth:`Run.open`: prompts, plan, record, sample log) and executes it:
``start_service`` / ``prime`` / ``measure(step) -> Sample`` / ``on_failure`` / ``finish``. What is planned, and
what comes next when the planned steps have run, is the profile's kind of plan (:mod:`abbench.runner.plans`:
fixed rounds, auto rounds, a sweep, load levels), one strategy behind one interface, so the run is one loop: a
plan's steps of its own kind (a load level's cell) are taken by the same loop after the ordinary ones, their
service started or reused by the same slot, and run by the strategy (``PlanStrategy.execute``). The service slot
is :mod:`abbench.runner.slot`, the lock and signals :mod:`abbench.runner.lock`, the resume checks
:mod:`abbench.runner.resume`.

Contract:

* ``execute(profile, run_dir, ...)`` returns the final :class:`RunRecord`; ``run.json`` is rewritten at every
  service boundary and at the end, and every finished request is appended to ``requests.jsonl`` at once
  (before it is added to the record), so a crash or Ctrl-C loses nothing that finished. A new run that ends
  before its first sample (nothing measured: a ``base_url`` nothing answers at, a service that never became
  healthy, Ctrl-C while starting) leaves no run behind: :func:`discard_unmeasured` removes it, keeping only
  the logs of launched services, which the error names.
* Before the first sample, the service of every arm is checked (:mod:`abbench.runner.preflight`): an attached
  server's health, cache reset and model, a launched command's program. A service that cannot serve stops the
  run there, naming the arm and the URL or command, before any other arm's service starts.
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
  exit code 130); a second signal during that teardown is ignored.
* Every stop that leaves a partial run behind (a signal, a service that dies or cannot start, a refused
  request) says so with the exact command that finishes it (:func:`resume_hint`).
* ``resume=True`` continues a partial run (or a complete one with failed samples) in its planned order,
  running the steps without a sample and, unless ``keep_failed``, those whose sample failed (the failed samples leave ``run.json`` and
  ``requests.jsonl``; the resume's entry lists them: :mod:`abbench.runner.resume`); it refuses when the
  prompts, the plan or the key environment fields differ, or when another process still holds the run
  (``run.lock``). Each resume is listed in ``environment["resumed"]``.
* The warnings say what happens to the service by its kind: a launched one is launched again, an attached
  one (``base_url``) is waited for, never "restarted".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from abbench import __version__
from abbench import auth
from abbench.auth import Credentials, auth_failure, is_auth_failure
from abbench.client import EngineClient
from abbench.response import Completion
from abbench.errors import AbbenchError, AuthError, RequestError, ServiceError
from abbench.fingerprint import environment_fingerprint
from abbench.profile import Profile, profile_from_dict
from abbench.prometheus import parse_prometheus
from abbench.prompts import BuiltPrompt, build_prompts
from abbench.loadrecords import LoadLevel
from abbench import vocabrows
from abbench.results import RunRecord, Sample, SampleLog, Step, Telemetry, save_run
from abbench.runner.lock import RunLock
from abbench.signals import signals_as_interrupt, signals_deferred, signals_held
from abbench.runner.preflight import check_context, check_services
from abbench.runner.resume import check_resumable, drop_failed, mark_resumed, rewrite_log
from abbench.runner.rundir import discard_unmeasured, load_for_resume, open_log, resume_hint
from abbench.runner import plans
from abbench.runner.slot import ServiceSlot, check_launch_commands
from abbench.services import Service, stop_all
from abbench.telemetry import ServiceMonitor
from abbench.tokenizers import describe_tokenizer, load_tokenizer

logger = logging.getLogger(__name__)

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
    return profile.profile_dir


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



def execute(
    profile: Profile,
    run_dir: Path,
    *,
    resume: bool = False,
    keep_failed: bool = False,
    observer: Observer | None = None,
    cache_dir: Path | None = None,
    argv: list[str] | None = None,
    check_only: bool = False,
) -> RunRecord:
    """Run the profile into ``run_dir`` (or resume the partial run there: its failed samples are run again
    unless ``keep_failed``). ``check_only``: build the prompts and the plan and check every arm's service as the
    run would before its first request (:meth:`Run.preflight`), then stop: nothing is launched or measured, and
    ``run_dir`` is removed again."""
    lock = RunLock(run_dir)
    run: Run | None = None
    try:
        with signals_as_interrupt():
            run = Run.open(profile, run_dir, lock, resume=resume, keep_failed=keep_failed, observer=observer,
                           cache_dir=cache_dir, argv=argv)
            if check_only:
                run.check()
                return run.record
            return run.execute()
    except KeyboardInterrupt as e:  # before the first request: nothing ran, nothing to tear down
        what = "the resumed run is unchanged" if resume else "no run was saved"
        raise Interrupted(f"interrupted ({e or 'SIGINT'}) while preparing the run; {what}") from None
    finally:
        lock.release()
        if run is not None and not resume and not run.record.samples and not run.record.load:
            kept = discard_unmeasured(run_dir)
            if observer is not None and not check_only:
                observer(ProgressEvent("warning", f"nothing was measured, so no run was saved in {run_dir}"
                                       + (f" (the service logs stay in {kept})" if kept else "")))


def _scrape(client: EngineClient, base_url: str, path: str | None,
            headers: dict[str, str] | None = None) -> dict[str, float] | None:
    if not path:
        return None
    try:
        text = client.metrics_text(base_url, path, headers=headers)
        return parse_prometheus(text) if text else None
    except RequestError as e:
        if is_auth_failure(e):  # the key is refused: the request itself would be too
            raise
        return None
    except ValueError:
        return None


def run_credentials(profile: Profile) -> Credentials:
    """The keys of every service of ``profile``, read from the environment before anything starts
    (:class:`AuthError` naming the variable when one is unset)."""
    specs = [profile.launch_spec(a.name) for a in profile.arms]
    return auth.resolve_keys((s.api_key_field, s.api_key_env) for s in specs)


def _close_window(monitor: ServiceMonitor, mark: int) -> None:
    """Close the telemetry window of a request that failed (an open one keeps fast PCIe sampling on)."""
    try:
        monitor.window(mark, settle_s=0.0)
    except Exception:  # noqa: BLE001 - telemetry never breaks the run
        logger.debug("closing telemetry window %s failed", mark, exc_info=True)


def _step_fields(step: Step) -> dict[str, Any]:
    """The fields of a :class:`Sample` that come from its plan step."""
    return dict(step=step.index, arm=step.arm, round=step.round, position=step.position, prompt_id=step.prompt_id,
                kind=step.kind, excluded=step.excluded, service=step.service)


def _failed_sample(step: Step, kind: str, message: str) -> Sample:
    return Sample(**_step_fields(step), ok=False, error_kind=kind, error=message, started_at=time.time())


class Run:
    """One execution of a plan: the record, the sample log, the client and the service slot.

    :meth:`execute` walks the steps still to do: :meth:`start_service` when the step needs another (or a
    dead) service, :meth:`prime` a service launched in the middle of its block, :meth:`measure` the step
    into a :class:`Sample`, :meth:`on_failure` applies ``run.on_request_failure`` to a failed request, and
    :meth:`finish` tears everything down and saves the record, whatever happened."""

    def __init__(self, profile: Profile, run_dir: Path, record: RunRecord, log: SampleLog, tokenizer: Any,
                 prompts: list[BuiltPrompt], observer: Observer | None = None,
                 credentials: Credentials | None = None, strategy: plans.PlanStrategy | None = None) -> None:
        self.profile = profile
        self.run_dir = run_dir
        self.record = record
        self.log = log
        self.tokenizer = tokenizer
        self.prompts = {b.record.id: b for b in prompts}
        self.observer = observer
        self.plan = record.plan
        self.strategy = strategy or plans.for_profile(profile)
        self.credentials = credentials or Credentials()
        self.client = EngineClient(verify=auth.tls_verify(profile.ca_bundle_path()))
        self.slot = ServiceSlot(profile, run_dir, self.client, record, self.credentials)
        self._key_env = {a.name: profile.launch_spec(a.name) for a in profile.arms}
        self.skipped_arms: set[str] = set()
        # A server that tokenizes with special tokens (a BOS) counts them in usage.prompt_tokens.
        self.added_tokens = int(record.environment.get("tokenizer", {}).get("special_tokens_added") or 0)

    @classmethod
    def open(cls, profile: Profile, run_dir: Path, lock: RunLock, *, resume: bool = False, keep_failed: bool = False,
             observer: Observer | None = None, cache_dir: Path | None = None,
             argv: list[str] | None = None) -> Run:
        """Build the prompts and the plan, create the record (or check and reopen the partial run's, its failed
        samples taken out to be run again unless ``keep_failed``), save run.json and open the sample log."""
        notify = observer or (lambda ev: None)
        retried: list[dict[str, Any]] = []
        existing = load_for_resume(run_dir, lock, lambda m: notify(ProgressEvent("warning", m)),
                                   keep_failed=keep_failed) if resume else None
        if existing is not None:
            profile = profile_from_dict(existing.profile, where=f"{run_dir}/run.json profile")
        check_launch_commands(profile)
        credentials = run_credentials(profile)
        ca_bundle = profile.ca_bundle_path()
        notify(ProgressEvent("prompts", "building exact-length prompts"))
        strategy = plans.for_profile(profile)
        if strategy.sequential:
            tok, built = prepare(profile, cache_dir=cache_dir)
        else:  # a plan of its own steps alone (load levels): the profile's [prompts] are not sent
            tok, built = load_tokenizer(profile.tokenizer.source, base_dir=profile_dir(profile), cache_dir=cache_dir), []
        state = strategy.state(existing)
        built += strategy.prompts(tok, state)  # a sweep's points': the grid's, or (resumed) every recorded pass's
        prompt_records = [b.record for b in built]
        plan = strategy.plan(prompt_records, state, existing.plan if existing is not None else None)
        env = environment_fingerprint([s.argv for s in profile.launch_specs() if s.argv is not None])
        if existing is not None:
            notes = check_resumable(run_dir, existing, prompt_records, plan, env)
            record = existing
            mark_resumed(record, env, argv, notes)
            retried = [] if keep_failed else drop_failed(record)
            for n in notes:
                notify(ProgressEvent("warning", f"resuming with {n.removeprefix('note: ')}"))
        else:
            env["tokenizer"] = describe_tokenizer(tok)
            env["argv"] = [credentials.redact(a) for a in (argv or [])]
            env["auth"] = auth.fingerprint((s.api_key_env for s in profile.launch_specs()), ca_bundle)
            record = RunRecord(run_id=run_dir.name, status="running", created_at=time.time(),
                               abbench_version=__version__, profile=profile.model_dump(mode="json"),
                               environment=env, prompts=prompt_records, plan=plan,
                               **strategy.record_fields(state))
        with signals_held():  # run.json and requests.jsonl lose the retried samples together
            log = open_log(run_dir, record, lock, resume=resume)
            if existing is not None and retried:
                log.close()
                rewrite_log(run_dir, {r["step"] for r in retried})
                log = SampleLog(run_dir)
        if existing is not None and retried:
            notify(ProgressEvent("warning", f"resuming: {len(retried)} failed sample(s) run again (steps "
                                 f"{', '.join(str(r['step']) for r in retried)}); --keep-failed keeps them"))
        if log.repaired:
            notify(ProgressEvent("warning", log.repaired))
        return cls(profile, run_dir, record, log, tok, built, observer, credentials, strategy)

    # ------------------------------------------------------------------------------------------ reporting

    def headers(self, arm: str) -> dict[str, str]:
        """The headers every request to ``arm``'s service carries (its API key, if the profile names one)."""
        return self.credentials.headers(self._key_env[arm].api_key_env)

    def auth_error(self, arm: str, e: RequestError) -> AuthError:
        spec = self._key_env[arm]
        return auth_failure(e, spec.api_key_env, spec.api_key_field, self.credentials)

    def notify(self, kind: str, message: str, sample: Sample | None = None, *, done: int | None = None,
               total: int | None = None) -> None:
        """A progress event; ``done`` / ``total`` default to the samples recorded and the steps planned (a load
        run counts its cells instead)."""
        if self.observer is not None:
            self.observer(ProgressEvent(kind, message, len(self.record.samples) if done is None else done,
                                        len(self.plan) if total is None else total, sample))

    def record_load(self, level: LoadLevel) -> None:
        """Append a load level to the record and save run.json at once (a crash loses no finished level)."""
        with signals_held():
            self.record.load.append(level)
            save_run(self.run_dir, self.record)
        s = level.summary()
        self.notify("sample", f"{s['arm']} {s['level']}: {s['ok']}/{s['requests']} ok")

    def step_context(self) -> plans.StepContext:
        """What the run lends a plan's own steps (:class:`abbench.runner.plans.StepContext`)."""
        def reset(arm: str, base_url: str) -> None:
            path = self.profile.arm_engine(arm).reset_path
            if path:
                self.client.reset(base_url, path, headers=self.headers(arm))

        return plans.StepContext(tokenizer=self.tokenizer, headers=self.headers,
                                 verify=auth.tls_verify(self.profile.ca_bundle_path()), reset=reset,
                                 record_load=self.record_load, notify=self.notify)

    def record_sample(self, sample: Sample) -> None:
        with signals_held():  # requests.jsonl and run.json hold the same samples, whenever a signal comes
            vocabrows.take_row(self.run_dir, sample)  # a whole first row (request.full_logprobs) goes aside
            self.log.append(sample)  # the durable copy first
            self.record.samples.append(sample)
        self.notify("sample", f"{sample.arm} {sample.prompt_id}", sample)

    # ------------------------------------------------------------------------------------------- the steps

    def execute(self) -> RunRecord:
        """Walk the steps that have no sample yet; always :meth:`finish`. Raises :class:`Interrupted` after
        a signal (the record is saved as partial)."""
        done = {s.step for s in self.record.samples}
        interrupted = False
        try:
            self.preflight()
            self._steps([s for s in self.plan if s.index not in done] + self.strategy.own_steps(self.record))
        except KeyboardInterrupt as e:
            interrupted = True
            self._partial(f"interrupted ({e or 'SIGINT'})")
        except AbbenchError as e:
            self._partial(str(e).splitlines()[0])
            if self.kept():
                e.args = (f"{e}\nthe run is saved as partial ({self.measured()}); "
                          f"{resume_hint(self.run_dir)}",)
            raise
        finally:
            self.finish()
        if interrupted:
            if not self.kept():
                raise Interrupted("interrupted before the first sample; nothing was measured")
            raise Interrupted(f"interrupted; {self.measured()} saved in {self.run_dir} "
                              f"({resume_hint(self.run_dir)})")
        return self.record

    def kept(self) -> bool:
        """Whether the run stays behind when it stops now (it has samples, or it is a resumed run)."""
        return bool(self.record.samples or self.record.load or self.record.environment.get("resumed"))

    def measured(self) -> str:
        """What the record holds, for a line: its samples, and its load levels when it has any."""
        n = f"{len(self.record.samples)} samples"
        return n + (f", {len(self.record.load)} load levels" if self.record.load else "")

    def check(self) -> None:
        """:meth:`preflight` alone: nothing is launched; what :meth:`open` opened is closed again."""
        try:
            self.preflight()
        finally:
            self.client.close()
            self.log.close()

    def preflight(self) -> None:
        """Check the service of every arm before the first of them starts (a sweep's later stages and the
        rounds auto adds use the same arms): :func:`abbench.runner.preflight.check_services`."""
        arms = [a.name for a in self.profile.arms]
        self.notify("service", "checking the services of " + ", ".join(arms))
        check_services(self.profile, self.client, self.credentials, arms, lambda m: self.notify("warning", m),
                       lambda m: self.notify("service", m))
        for arm in arms:
            url = self.profile.launch_spec(arm).base_url
            if url is not None and arm not in self.skipped_arms:
                self.check_context(url, arm)

    def check_context(self, base_url: str, arm: str) -> None:
        """The longest prompt ``arm`` will be sent, plus ``request.max_tokens``, fits the context the server
        lists (:func:`abbench.runner.preflight.check_context`); a launched service is checked once healthy."""
        lengths = [(st.prompt_id, self.prompts[st.prompt_id].record.token_count)
                   for st in self.record.plan if st.arm == arm and st.prompt_id in self.prompts]
        max_tokens = self.profile.request.max_tokens
        if not self.strategy.sequential:  # a plan of its own steps (load levels) sends every prompt it built
            lengths = [(pid, b.record.token_count) for pid, b in self.prompts.items()]
            out = self.profile.load.output_tokens if self.profile.load is not None else None
            max_tokens = out.largest if out is not None else max_tokens
        check_context(self.client, base_url, self.headers(arm), self.profile.arm_engine(arm).model,
                      longest=max(lengths, key=lambda x: x[1], default=None),
                      max_tokens=max_tokens, where=f"arm {arm} ({base_url})")

    def _partial(self, reason: str) -> None:
        self.record.status = "partial"
        self.record.status_reason = reason

    def _steps(self, todo: list[Any]) -> None:
        while True:
            for step in todo:
                if not isinstance(step, Step):  # a step of the plan's own kind (a load level's cell)
                    svc = None if step.arm in self.skipped_arms else self.service_for(step)
                    if svc is not None:  # a skipped arm's cells stay unrecorded: the gate names them missing
                        self.strategy.execute(step, svc.base_url, self.step_context())
                    continue
                if step.arm in self.skipped_arms:
                    self.record_sample(_failed_sample(step, "service", "arm skipped: its service failed"))
                    continue
                svc = self.service_for(step)
                if svc is None:
                    continue
                try:
                    self.record_sample(self.measure(svc, step))
                except RequestError as e:
                    if is_auth_failure(e):  # every request would be refused alike: stop now, record nothing
                        raise self.auth_error(step.arm, e) from None
                    e = RequestError(e.kind, self.credentials.redact(e.detail), status=e.status)
                    if self.on_failure(svc, step, e):
                        return
            todo = self.more_steps()
            if not todo:
                break
        self.record.status = "complete"

    def more_steps(self) -> list[Step]:
        """When every planned step has run: the plan's next steps (:meth:`PlanStrategy.next
        <abbench.runner.plans.base.PlanStrategy.next>`), appended to the plan with their prompts and the decision
        and saved together, or [] when the run ends."""
        ext = self.strategy.next(self.record, self.tokenizer, self.notify)
        if ext is None:
            return []
        with signals_held():  # the decision, its prompts and its steps: all in run.json, or none
            for b in ext.prompts:
                self.record.prompts.append(b.record)
                self.prompts[b.record.id] = b
            steps = ext.commit(self.record)
            self.record.plan.extend(steps)
            save_run(self.run_dir, self.record)
        return steps

    def service_for(self, step: Step | plans.OwnStep) -> Service | None:
        """The running service of ``step``'s block, started (and primed) when needed; None when it could not
        start and its arm is skipped (``run.on_service_failure = "skip-arm"``)."""
        slot = self.slot
        if slot.key == step.service and slot.service is not None and slot.service.alive():
            return slot.service
        if slot.key == step.service and slot.service is not None:
            slot.stop(error=f"exited before step {step.index}")  # died between requests
        svc = self.start_service(step)
        if svc is not None and isinstance(step, Step):
            self.prime(svc, step)
        return svc

    def start_service(self, step: Step | plans.OwnStep) -> Service | None:
        again = step.service in self.slot.launches
        url = self.profile.launch_spec(step.arm).base_url
        self.notify("service", (f"attaching {'again ' if again else ''}to {step.service} at {url}" if url
                                else f"{'restarting' if again else 'starting'} {step.service}"))
        try:
            svc = self.slot.start(step.service, step.arm, step.round)
        except ServiceError as e:
            save_run(self.run_dir, self.record)
            if self.profile.run.on_service_failure == "stop" or self.profile.engine.shared_service:
                raise
            self.skipped_arms.add(step.arm)
            self.notify("warning", f"arm {step.arm} skipped (run.on_service_failure = skip-arm): {e}")
            if isinstance(step, Step):
                self.record_sample(_failed_sample(step, "service", str(e).splitlines()[0]))
            return None
        save_run(self.run_dir, self.record)
        for warning in (svc.control or {}).get("warnings", []):
            self.notify("warning", warning)
        if not url:
            for arm in svc.arms:
                self.check_context(svc.base_url, arm)
        return svc

    def _reset_if_planned(self, svc: Service, step: Step) -> None:
        reset_path = self.profile.arm_engine(step.arm).reset_path
        if step.reset_before and reset_path:
            self.client.reset(svc.base_url, reset_path, headers=self.headers(step.arm))

    def _complete(self, svc: Service, step: Step) -> Completion:
        """The request of ``step`` (the one place a plan step becomes a request)."""
        eng, req = self.profile.arm_engine(step.arm), self.profile.request
        bp = self.prompts[step.prompt_id]
        return self.client.complete(
            svc.base_url, bp.text, request=req,
            extra={**req.extra, **self.profile.arm(step.arm).request, **self.strategy.request_fields(step)},
            target_prompt_tokens=bp.record.target_tokens + self.added_tokens, model=eng.model,
            retokenize=lambda text: self.tokenizer.encode(text, add_special_tokens=False), adapter=eng.adapter,
            headers=self.headers(step.arm))

    def prime(self, svc: Service, step: Step) -> None:
        """Re-send the requests a service launched just before ``step`` must see first (not recorded)."""
        steps = priming_steps(self.plan, step)
        if not steps:
            return
        self.notify("service", f"priming {step.service}: re-sending {len(steps)} earlier request(s)")
        for st in steps:
            try:
                self._reset_if_planned(svc, st)
                self._complete(svc, st)
            except RequestError as e:
                if is_auth_failure(e):
                    raise self.auth_error(st.arm, e) from None
                logger.warning("priming %s with step %d failed: %s", step.service, st.index,
                               self.credentials.redact(str(e)))

    def measure(self, svc: Service, step: Step) -> Sample:
        """Send ``step``'s request (after the planned reset), with the telemetry window and the metrics
        scrapes around it; raises :class:`RequestError` when it fails."""
        metrics_path = self.profile.arm_engine(step.arm).metrics_path
        monitor = self.slot.monitor
        mark: int | None = None
        try:
            self._reset_if_planned(svc, step)
            headers = self.headers(step.arm)
            before = _scrape(self.client, svc.base_url, metrics_path, headers)
            mark = monitor.mark() if monitor is not None else None  # the window spans the request alone
            c = self._complete(svc, step)
            window = monitor.window(mark) if monitor is not None and mark is not None else {}
            mark = None
            after = _scrape(self.client, svc.base_url, metrics_path, headers)
        finally:
            if mark is not None and monitor is not None:  # a failed or interrupted request
                _close_window(monitor, mark)
        return Sample(**_step_fields(step), ok=True, **c.sample_fields(),
                      telemetry=Telemetry(metrics_before=before, metrics_after=after, **window))

    def on_failure(self, svc: Service, step: Step, e: RequestError) -> bool:
        """Record the failed sample and apply ``run.on_request_failure``; True when the run must stop."""
        self.record_sample(_failed_sample(step, e.kind, e.detail))
        policy = self.profile.run.on_request_failure
        if policy == "stop":
            self._partial(f"stopped after a failed request at step {step.index} (run.on_request_failure = "
                          f"stop): {e}")
            return True
        dead = self._why_dead(svc, step, e)
        if dead:
            self.notify("warning", f"service {step.service} {dead}; " + (
                "it is launched again for the next step" if svc.launched else
                f"abbench did not start it ({svc.base_url}), so cannot restart it: the next step waits up to "
                f"{self.profile.engine.health_timeout_s:g} s for it to answer again, and the run stops if nothing "
                "listens there"))
            self.slot.stop(error=dead)
        elif policy == "restart":
            self.slot.stop()  # the next step launches it again
        return False

    def _why_dead(self, svc: Service, step: Step, e: RequestError) -> str | None:
        """Why the service cannot serve the next step, or None when it still can."""
        if svc.launched:
            deadline = time.monotonic() + (DEATH_GRACE_S if e.kind == "connect" else 0.0)
            while True:
                if not svc.alive():
                    return f"exited during step {step.index} ({e.kind} failure)"
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.02)
        if e.kind in ("connect", "timeout") and not self._healthy(svc, step.arm):
            return f"stopped answering its health check after step {step.index} ({e.kind} failure)"
        return None

    def _healthy(self, svc: Service, arm: str) -> bool:
        try:
            return self.client.health(svc.base_url, self.profile.arm_engine(arm).health_path, headers=self.headers(arm))
        except RequestError:
            return False

    def _vocab_kl(self) -> None:
        """Record the whole-vocabulary KLs of the rows kept aside (:mod:`abbench.vocabrows`), beside those an
        earlier part of the run recorded; a complete run drops its rows."""
        if not vocabrows.has_rows(self.run_dir):
            return
        record = self.record
        try:
            new = vocabrows.vocab_kls(self.run_dir, record, self.profile.parity_reference_arm)
        except Exception as e:  # noqa: BLE001 - in finish(): the record is saved whatever happens here
            self.notify("warning", f"the whole-vocabulary KLs were not recorded ({e}); the rows stay in "
                        f"{self.run_dir / vocabrows.ROWS_DIR}")
            return
        steps = {s.step for s in record.samples}
        done = {(v.step, v.against) for v in new}
        record.vocab_kl = sorted([v for v in record.vocab_kl if (v.step, v.against) not in done
                                  and v.step in steps and v.against in steps] + new,
                                 key=lambda v: (v.step, v.against))
        if record.status == "complete":
            vocabrows.drop_rows(self.run_dir)

    def finish(self) -> None:
        """Tear every service down and save the record (a second signal meanwhile is ignored)."""
        record = self.record
        with signals_deferred():
            try:
                self.slot.stop()
            finally:
                stop_all()
                self.client.close()
                self.log.close()
                if record.status == "running":
                    self._partial(record.status_reason or "ended unexpectedly")
                self._vocab_kl()
                record.finished_at = time.time()
                save_run(self.run_dir, record)
                self.notify("done", record.status)
