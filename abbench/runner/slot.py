"""The service slot: owns the one service of the current plan block (launch, attach, stop) and its monitor.

Every launch or attach is appended to the run record's ``services`` as it happens (a failed launch too,
with its error), and replaced by the final record when the service stops. The arm -> service rule is
:meth:`abbench.profile.Profile.launch_spec`; :func:`check_launch_commands` refuses launched commands without
a ``{port}`` placeholder before anything starts.

Once a service is healthy, :func:`probe_control_paths` tries its reset and metrics paths once, before any
of its requests (the result is the service record's ``control``). A reset the run will need that the server
refuses stops the run there with a :class:`~abbench.errors.ConfigError` carrying the adapter's remedy for
that status (``Adapter.reset_hints``: vLLM's 404 without ``VLLM_SERVER_DEV_MODE=1``, llama.cpp's 501 without
``--slot-save-path``, ...), instead of failing every sample that follows. A metrics path that fails, or that
holds none of an engine adapter's counters, is a warning (the report's engine counters will lack that arm).
"""

from __future__ import annotations

from pathlib import Path

from typing import Any

from abbench.adapters import get_adapter
from abbench.auth import Credentials, auth_failure, is_auth_failure
from abbench.client import EngineClient
from abbench.errors import AuthError, ConfigError, RequestError, ServiceError
from abbench.nvml import gpu_idle
from abbench.profile import Profile
from abbench.prometheus import parse_prometheus
from abbench.results import LOGS_DIR, RunRecord, ServiceRecord
from abbench.services import Service
from abbench.telemetry import ServiceMonitor


def check_launch_commands(profile: Profile) -> None:
    """Every launched command must say where to listen: abbench picks a free port per service and passes it
    through the ``{port}`` placeholder, then health-checks that port. A command without it could only be
    health-checked on the wrong port (or, with a fixed port, against someone else's server)."""
    for spec in profile.launch_specs():
        if spec.argv is not None and not any("{port}" in str(a) for a in spec.argv):
            raise ConfigError(
                f"{spec.source}: {spec.argv!r} has no {{port}} placeholder; abbench picks a free port for every "
                "service and health-checks it there, so pass it to the engine (e.g. \"--port\", \"{port}\") "
                "instead of a fixed port"
            )


def health_check(client: EngineClient, path: str, credentials: Credentials, api_key_env: str | None,
                 field: str):  # type: ignore[no-untyped-def]
    """The health check of one service: ``GET path`` with its key; a 401/403 is an :class:`AuthError` at
    once and a TLS failure a :class:`ServiceError` at once (waiting for either cannot help)."""
    headers = credentials.headers(api_key_env)

    def check(base_url: str) -> bool:
        try:
            return client.health(base_url, path, headers=headers)
        except RequestError as e:
            if is_auth_failure(e):
                raise auth_failure(e, api_key_env, field, credentials) from None
            raise ServiceError(credentials.redact(e.detail)) from None

    return check


def probe_control_paths(client: EngineClient, base_url: str, adapter: str, *, reset_path: str | None,
                        metrics_path: str | None, headers: dict[str, str], resets: bool,
                        where: str) -> dict[str, Any]:
    """Try a healthy service's reset path (``POST``, only when the run ``resets``) and metrics path (``GET``)
    once. Returns what was seen (``reset``/``metrics``: path and HTTP status; ``counters``: the adapter's
    counters the page holds; ``warnings``). A refused reset raises :class:`ConfigError` naming ``where``, the
    status and the remedy; a refused key raises the :class:`RequestError` (the caller makes it an
    :class:`AuthError`)."""
    ad = get_adapter(adapter)
    out: dict[str, Any] = {"warnings": []}
    if reset_path and resets:
        try:
            client.reset(base_url, reset_path, headers=headers)
            out["reset"] = {"path": reset_path, "status": "ok"}
        except RequestError as e:
            if is_auth_failure(e):
                raise
            hint = ad.reset_hints.get(e.status) if e.status is not None else None
            raise ConfigError(
                f"{where}: the cache reset the run sends before every sample group failed at start-up "
                f"({e.detail}). " + (f"{hint}. " if hint else "")
                + "To run without resets set reset_path = \"\" (cold samples may then be served from the "
                "engine's prefix cache). Stopped before any request to this service.") from None
    if metrics_path:
        status: int | str | None = None
        try:
            text = client.metrics_text(base_url, metrics_path, headers=headers)
            status = "ok" if text is not None else 404
        except RequestError as e:
            if is_auth_failure(e):
                raise
            text, status = None, e.status if e.status is not None else e.kind
        out["metrics"] = {"path": metrics_path, "status": status}
        if text is None:
            hint = ad.metrics_hints.get(status) if isinstance(status, int) else None
            out["warnings"].append(
                f"{where}: GET {metrics_path} failed ({status}): the report's engine counters will lack this "
                "service" + (f"; {hint}" if hint else "") + " (metrics_path = \"\" turns the scrape off)")
        elif ad.counters:
            names = [n for names in ad.counters.values() for n in names]
            samples = parse_prometheus(text, strict=False)
            found = [n for n in names if any(k == n or k.startswith(n + "{") for k in samples)]
            out["counters"] = found
            if not found and ad.name != "openai":  # any OpenAI server: the vendored engine's counters are optional
                out["warnings"].append(f"{where}: GET {metrics_path} holds none of the {ad.name} adapter's "
                                       f"counters ({', '.join(names)}) yet: the report's engine counters may "
                                       "lack this service")
    return out


class ServiceSlot:
    """Owns the service of the current plan block: launch, restart, stop, records."""

    def __init__(self, profile: Profile, run_dir: Path, client: EngineClient, record: RunRecord,
                 credentials: Credentials | None = None) -> None:
        self.profile = profile
        self.credentials = credentials or Credentials()
        self.run_dir = run_dir
        self.client = client
        self.record = record
        self.service: Service | None = None
        self.monitor: ServiceMonitor | None = None
        self.key: str | None = None
        self.launches: dict[str, int] = {}
        for s_rec in record.services:  # resumed: a relaunched service gets a log of its own (KEY.restartN.log)
            self.launches[s_rec.key] = self.launches.get(s_rec.key, 0) + 1

    def start(self, key: str, arm: str | None, round_no: int | None) -> Service:
        """Launch (or attach to) the service ``key`` serving ``arm`` (None: the engine's own command)."""
        self.stop()
        eng = self.profile.engine
        health_path = self.profile.arm_engine(arm).health_path
        spec = self.profile.launch_spec(arm)
        n = self.launches.get(key, 0)
        self.launches[key] = n + 1
        log_name = (f"{key}.log" if n == 0 else f"{key}.restart{n}.log").replace("@", "_")
        if eng.shared_service:
            arms = [a.name for a in self.profile.service_groups().get(key, self.profile.arms)]
        else:
            arms = [arm or key]
        idle_before = gpu_idle()
        check = health_check(self.client, health_path, self.credentials, spec.api_key_env, spec.api_key_field)
        try:
            if spec.base_url:
                svc = Service.attach(key, spec.base_url, health_path=health_path,
                                     health_timeout_s=eng.health_timeout_s, health_check=check,
                                     arms=arms, round=round_no)
            else:
                assert spec.argv is not None
                svc = Service.launch(key, spec.argv, env=spec.env, log_path=self.run_dir / LOGS_DIR / log_name,
                                     health_path=health_path, health_timeout_s=eng.health_timeout_s,
                                     stop_timeout_s=eng.stop_timeout_s, health_check=check,
                                     profile_dir=spec.profile_dir, arms=arms, round=round_no)
        except (ServiceError, AuthError, KeyboardInterrupt) as e:  # the launch stopped what it started already
            error = str(e).splitlines()[0] if isinstance(e, (ServiceError, AuthError)) else "interrupted while starting"
            self.record.services.append(ServiceRecord(
                key=key, arms=arms, round=round_no, command=spec.argv, env=spec.env, base_url=spec.base_url or "",
                log=None if spec.base_url else f"{LOGS_DIR}/{log_name}", gpu_idle_before=idle_before,
                error=error))
            raise
        svc.gpu_idle_before = idle_before
        self.service = svc
        self.key = key
        try:
            self._probe(svc, arm, spec)
        finally:
            self.record.services.append(svc.record(self.run_dir))
        self.monitor = ServiceMonitor(key, svc.pid).start()
        return svc

    def _probe(self, svc: Service, arm: str | None, spec: Any) -> None:
        """:func:`probe_control_paths` on the new service; a refusal is recorded as its error and raised."""
        ae = self.profile.arm_engine(arm)
        try:
            svc.control = probe_control_paths(
                self.client, svc.base_url, ae.adapter, reset_path=ae.reset_path, metrics_path=ae.metrics_path,
                headers=self.credentials.headers(spec.api_key_env), resets=self.profile.run.reset_between_samples,
                where=f"service {svc.key} ({ae.adapter} adapter, {svc.base_url})")
        except RequestError as e:  # only a refused key gets here
            svc.error = "the server refused the API key"
            raise auth_failure(e, spec.api_key_env, spec.api_key_field, self.credentials) from None
        except ConfigError as e:
            svc.error = str(e)
            raise

    def stop(self, error: str | None = None) -> None:
        """Stop the current service (if any); ``error`` says why when it is being replaced because it died."""
        if self.monitor is not None:
            self.monitor.stop()
            self.record.memory.extend(self.monitor.points())
            self.monitor = None
        if self.service is not None:
            svc, self.service, self.key = self.service, None, None
            if error:
                svc.error = error
            svc.stop()
            svc.gpu_idle_after = gpu_idle()
            self.record.services[-1] = svc.record(self.run_dir)
