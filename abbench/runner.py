"""Executes a run: builds the prompts, walks the ABBA plan, launches each service, sends each request,
gathers telemetry and records every sample the moment it finishes.

Contract:

* ``execute(profile, run_dir, ...)`` returns the final :class:`RunRecord`; ``run.json`` is rewritten at every
  service boundary and at the end, and every finished request is appended to ``requests.jsonl`` at once, so
  a crash or Ctrl-C loses nothing that finished.
* A failed request is a failed sample (``ok=False`` with ``error_kind``/``error``), never a timing. What
  happens next is the profile's choice (``run.on_request_failure``; a dead service is restarted unless the
  profile says stop). A service that cannot start stops the run or skips the arm (``run.on_service_failure``);
  the skipped steps are recorded as failed samples, so nothing is silently missing.
* SIGINT/SIGTERM tear every service down and leave a valid run marked ``partial``. ``resume=True`` continues
  a partial run in its planned order without repeating steps that already have a sample.
"""

from __future__ import annotations

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
from abbench.profile import ArmSpec, Profile, profile_from_dict
from abbench.prompts import BuiltPrompt, build_prompts
from abbench.results import (
    LOGS_DIR,
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
from abbench.telemetry import Sampler, environment_fingerprint, gpu_idle, parse_prometheus
from abbench.tokenizers import describe_tokenizer, load_tokenizer


class Interrupted(AbbenchError):
    """The run was interrupted by a signal; results so far are saved and marked partial."""

    exit_code = 130


@dataclass
class ProgressEvent:
    """What the runner tells its observer (the CLI's progress display)."""

    kind: str  # "prompts" | "service" | "sample" | "done"
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


class _ServiceSlot:
    """Owns the service of the current plan block: launch, restart, stop, records."""

    def __init__(self, profile: Profile, run_dir: Path, client: EngineClient, record: RunRecord) -> None:
        self.profile = profile
        self.run_dir = run_dir
        self.client = client
        self.record = record
        self.service: Service | None = None
        self.sampler: Sampler | None = None
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
        except ServiceError as e:
            self.record.services.append(ServiceRecord(
                key=key, arms=arms, round=round_no, command=argv, env=env, base_url=base_url or "",
                log=None if base_url else f"{LOGS_DIR}/{log_name}", gpu_idle_before=idle_before,
                error=str(e).splitlines()[0]))
            raise
        svc.gpu_idle_before = idle_before
        self.service = svc
        self.key = key
        self.record.services.append(svc.record(self.run_dir))
        self.sampler = Sampler(key, svc.pid).start()
        return svc

    def stop(self) -> None:
        if self.sampler is not None:
            self.sampler.stop()
            self.record.memory.extend(self.sampler.points())
            self.sampler = None
        if self.service is not None:
            svc, self.service, self.key = self.service, None, None
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


def _failed_sample(step: Step, service: str, kind: str, message: str) -> Sample:
    return Sample(step=step.index, arm=step.arm, round=step.round, position=step.position,
                  prompt_id=step.prompt_id, kind=step.kind, excluded=step.excluded, service=service,
                  ok=False, error_kind=kind, error=message, started_at=time.time())


def prepare(profile: Profile, *, cache_dir: Path | None = None) -> tuple[object, list[BuiltPrompt]]:
    """Load the tokenizer and build every prompt of the profile (exact lengths, checked)."""
    tok = load_tokenizer(profile.tokenizer.source, base_dir=profile_dir(profile), cache_dir=cache_dir)
    built = build_prompts(tok, profile.prompts, base_dir=profile_dir(profile))
    return tok, built


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
    notify = observer or (lambda ev: None)
    existing: RunRecord | None = None
    if resume:
        existing, _ = load_run(run_dir)
        if existing.status == "complete":
            raise ResultsError(f"{run_dir}: this run is already complete; nothing to resume")
        profile = profile_from_dict(existing.profile, where=f"{run_dir}/run.json profile")

    notify(ProgressEvent("prompts", "building exact-length prompts"))
    tok, built = prepare(profile, cache_dir=cache_dir)
    by_id = {b.record.id: b for b in built}
    prompt_records = [b.record for b in built]
    arms = [a.name for a in profile.arms]
    plan = build_plan(prompt_records, arms, profile.run.rounds, shared_service=profile.engine.shared_service,
                      reset_between_samples=profile.run.reset_between_samples,
                      exclude_kinds=list(profile.run.exclude_kinds))

    if existing is not None:
        old = {p.id: p.sha256 for p in existing.prompts}
        new = {p.id: p.sha256 for p in prompt_records}
        if old != new:
            raise ResultsError(f"{run_dir}: the prompts rebuilt now differ from the run's (tokenizer or "
                               "corpus changed); cannot resume")
        if [s.model_dump() for s in existing.plan] != [s.model_dump() for s in plan]:
            raise ResultsError(f"{run_dir}: the plan rebuilt now differs from the run's; cannot resume")
        record = existing
        record.status = "running"
        record.status_reason = None
    else:
        commands = []
        for a in profile.arms:
            cmd = a.command or (profile.engine.command + a.args if profile.engine.command else None)
            if cmd:
                commands.append(cmd)
        env = environment_fingerprint(commands)
        env["tokenizer"] = describe_tokenizer(tok)
        env["argv"] = argv or []
        record = RunRecord(run_id=run_dir.name, status="running", created_at=time.time(),
                           abbench_version=__version__, profile=profile.model_dump(mode="json"),
                           environment=env, prompts=prompt_records, plan=plan)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / LOGS_DIR).mkdir(exist_ok=True)
    save_run(run_dir, record)

    done_steps = {s.step for s in record.samples}
    todo = [s for s in plan if s.index not in done_steps]
    total = len(plan)
    client = EngineClient()
    slot = _ServiceSlot(profile, run_dir, client, record)
    skipped_arms: set[str] = set()
    log = SampleLog(run_dir)
    req = profile.request
    retok = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    # A server that tokenizes with special tokens (a BOS) counts them in usage.prompt_tokens.
    added = int(record.environment.get("tokenizer", {}).get("special_tokens_added") or 0)

    def record_sample(sample: Sample) -> None:
        record.samples.append(sample)
        log.append(sample)
        notify(ProgressEvent("sample", f"{sample.arm} {sample.prompt_id}", len(record.samples), total, sample))

    try:
        with _signals_as_interrupt():
            for step in todo:
                arm = profile.arm(step.arm)
                if step.arm in skipped_arms:
                    record_sample(_failed_sample(step, step.service, "service", "arm skipped: its service failed"))
                    continue
                if slot.key != step.service or slot.service is None or not slot.service.alive():
                    restarting = slot.key == step.service
                    notify(ProgressEvent("service", f"{'restarting' if restarting else 'starting'} {step.service}",
                                         len(record.samples), total))
                    try:
                        slot.start(step.service, None if profile.engine.shared_service else arm, step.round)
                        save_run(run_dir, record)
                    except ServiceError as e:
                        save_run(run_dir, record)
                        if profile.run.on_service_failure == "stop" or profile.engine.shared_service:
                            raise
                        skipped_arms.add(step.arm)
                        record_sample(_failed_sample(step, step.service, "service", str(e).splitlines()[0]))
                        continue
                svc = slot.service
                assert svc is not None
                bp = by_id[step.prompt_id]
                extra = {**req.extra, **arm.request}
                try:
                    if step.reset_before and profile.engine.reset_path:
                        client.reset(svc.base_url, profile.engine.reset_path)
                    before = _scrape(client, svc.base_url, profile.engine.metrics_path)
                    mark = slot.sampler.mark() if slot.sampler is not None else 0
                    c = client.complete(svc.base_url, bp.text, request=req, extra=extra,
                                        target_prompt_tokens=bp.record.target_tokens + added, model=profile.engine.model,
                                        retokenize=retok, adapter=profile.engine.adapter)
                    window = slot.sampler.window(mark) if slot.sampler is not None else {}
                    after = _scrape(client, svc.base_url, profile.engine.metrics_path)
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
                    record_sample(_failed_sample(step, step.service, e.kind, e.detail))
                    policy = profile.run.on_request_failure
                    if policy == "stop":
                        record.status = "partial"
                        record.status_reason = f"stopped after a failed request at step {step.index}: {e}"
                        break
                    if policy == "restart" or not svc.alive():
                        slot.stop()  # the next step launches it again
            else:
                record.status = "complete"
    except KeyboardInterrupt as e:
        record.status = "partial"
        record.status_reason = f"interrupted ({e or 'SIGINT'})"
        raise Interrupted(f"interrupted; {len(record.samples)} samples saved in {run_dir} (resume with "
                          f"`abbench run --resume {run_dir}`)") from None
    except AbbenchError as e:
        record.status = "partial"
        record.status_reason = str(e).splitlines()[0]
        raise
    finally:
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
    return record


def check_run_dir_free(run_dir: Path) -> None:
    if (run_dir / "run.json").exists():
        raise ConfigError(f"--out {run_dir}: a run already exists there; choose another directory or use --resume")
