"""The services of a run checked before its first sample, so that a profile whose second arm cannot be served
fails in seconds, not after the first arm's samples have run.

:func:`check_services` looks at every service the steps still to do will use, once each (a shared service
once for all its arms), in the order the profile names the arms:

* **An attached server** (a ``base_url``): its health path must answer (a port that refuses connections fails
  within :data:`abbench.services.REFUSED_GRACE_S`, a host that does not resolve at once; a server that accepts
  but is not healthy yet is waited for up to ``engine.health_timeout_s``, as the run itself would); the cache
  reset the run will send is tried once (:func:`abbench.runner.slot.probe_control_paths`: a refusal is a
  :class:`~abbench.errors.ConfigError` with the engine's remedy); and when the arm names a ``model`` and the
  server lists its models (``GET /v1/models``, OpenAI's shape), the model must be among them. A server that
  has no such list is not judged on it; llama.cpp's server answers whatever model is asked for, so its list
  is not consulted.
* **A launched command**: its placeholders expand (``{profile_dir}`` needs a profile file) and its program
  exists and is executable (looked up on the ``PATH`` the service will get). Nothing is started: the rest
  (health, reset) is checked when the service starts, before its first request. One exception: the vendored
  engine (``-m abbench.engine``, ``abbench serve``) on a GPU or with ``--gpu-memory-budget`` runs once with
  ``--check-plan`` (:func:`check_engine_plan`): its configuration and device-memory plan, as the service would
  check them at start, in seconds and without weights. So an arm whose experts cannot fit the card fails the run
  before the other arms' rounds, not when its turn comes minutes later.

Lengths against the server's context (:func:`check_context`): where a server lists its models with a
``max_model_len`` (vLLM, the vendored engine), the longest prompt an arm will send plus ``request.max_tokens``
must fit it; an attached server is checked here, a launched one as soon as it is healthy, before its first
request. Too long is a :class:`~abbench.errors.ConfigError` naming the arm, the limit and the prompt, instead of
a run whose every sample is an HTTP 400.

A failure is a :class:`~abbench.errors.ServiceError` (or the reset's :class:`ConfigError`, or the key's
:class:`~abbench.errors.AuthError`) whose first line names the arm(s) and the URL or command. With
``run.on_service_failure = "skip-arm"`` (and separate services) a service that cannot be reached is a warning
instead, and its arm is skipped when its turn comes, as it would be without this check.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable
from typing import Any

from abbench.auth import Credentials, auth_failure, is_auth_failure
from abbench.client import EngineClient
from abbench.errors import ConfigError, RequestError, ServiceError
from abbench.profile import LaunchSpec, Profile
from abbench.runner.slot import health_check, probe_control_paths
from abbench.services import Service, expand_command

MODELS_PATH = "/v1/models"
IGNORES_MODEL = frozenset({"llamacpp"})
"""Adapters whose servers answer any ``model`` a request names (the list is not consulted)."""

Warn = Callable[[str], None]


def _services(profile: Profile, arms: list[str]) -> list[tuple[list[str], LaunchSpec]]:
    """The distinct services of ``arms`` (a shared service once, with every arm of it that is to run)."""
    out: dict[Any, tuple[list[str], LaunchSpec]] = {}
    for a in profile.arms:
        if a.name not in arms:
            continue
        spec = profile.launch_spec(a.name)
        key = (a.service or "shared") if profile.engine.shared_service else a.name
        out.setdefault(key, ([], spec))[0].append(a.name)
    return list(out.values())


def _who(arms: list[str], where: str) -> str:
    return f"arm{'s' if len(arms) > 1 else ''} {', '.join(arms)} ({where})"


def check_command(spec: LaunchSpec) -> str | None:
    """Why ``spec``'s command cannot be started, or None when its program is there to run."""
    assert spec.argv is not None
    try:
        argv = expand_command(list(spec.argv), port=0, profile_dir=spec.profile_dir)
    except ConfigError as e:
        return str(e)
    if not argv or not argv[0]:
        return f"empty command; set {spec.source}"
    program = argv[0]
    field = "engine.command" if spec.source.startswith("engine.command") else spec.source  # where argv[0] is
    if os.sep in program:
        if not os.path.isfile(program):
            return f"command not found: {program}; check {field} in the profile"
        if not os.access(program, os.X_OK):
            return f"command not executable: {program}; check {field} in the profile"
        return None
    path = {**os.environ, **spec.env}.get("PATH", os.defpath)
    if shutil.which(program, path=path) is None:
        return f"command not found: {program} (not on the PATH); check {field} in the profile"
    return None


ENGINE_MODULE = "abbench.engine"
PLAN_CHECK_TIMEOUT_S = 300.0
"""How long ``--check-plan`` may take (importing torch and starting CUDA) before the check is given up, with a
warning: it cannot judge then, and the service's own start still will."""


def _last_value(argv: list[str], flag: str) -> str | None:
    """The value of the last ``flag VALUE`` or ``flag=VALUE`` in ``argv`` (argparse's last one wins); None when
    absent."""
    value = None
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


def engine_plan_argv(argv: list[str]) -> list[str] | None:
    """``argv`` with ``--check-plan`` where it runs the vendored engine (``-m abbench.engine`` or ``abbench serve``,
    its engine backend) on a device other than the CPU or with ``--gpu-memory-budget``: a plan worth checking
    before the run. None for any other command (the CPU engine without a budget has no plan and starts in
    seconds)."""
    runs_engine = any((a == "-m" and argv[i + 1:i + 2] == [ENGINE_MODULE])  # python -m abbench.engine ...
                      or (os.path.basename(a) == "abbench" or (a == "-m" and argv[i + 1:i + 2] == ["abbench"]))
                      and "serve" in argv[i + 1:i + 3]  # abbench serve ..., python -m abbench serve ...
                      for i, a in enumerate(argv))
    if not runs_engine or (_last_value(argv, "--backend") or "engine") != "engine":
        return None
    if (_last_value(argv, "--device") or "cpu") == "cpu" and _last_value(argv, "--gpu-memory-budget") is None:
        return None
    return [*argv, "--check-plan"]


def start_engine_plan_check(spec: LaunchSpec) -> subprocess.Popen | str | None:
    """The vendored engine's ``--check-plan`` for the command ``spec`` launches, started and not waited for (so
    that a run's checks overlap: each imports torch and, on a GPU, starts CUDA); None when the command is not such
    an engine (:func:`engine_plan_argv`), a string when it cannot be started (why)."""
    assert spec.argv is not None
    argv = engine_plan_argv(expand_command(list(spec.argv), port=0, profile_dir=spec.profile_dir))
    if argv is None:
        return None
    try:
        return subprocess.Popen(argv, env={**os.environ, **{k: str(v) for k, v in spec.env.items()}},
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    except OSError as e:
        return f"cannot run {argv[0]}: {e}"


def engine_plan_result(check: subprocess.Popen | str | None, warn: Warn) -> tuple[str | None, str | None]:
    """(why, plan) of the engine whose ``--check-plan`` is ``check`` (:func:`start_engine_plan_check`): why it
    cannot start (the engine's own message, such as a budget that cannot hold one token's experts), else None;
    and the plan it printed when it can (its chunk length and device-memory plan: fixed part, expert slots per
    layer, total), else None. Both None when there was nothing to check, or when the check did not finish in
    :data:`PLAN_CHECK_TIMEOUT_S` (a warning then)."""
    if not isinstance(check, subprocess.Popen):
        return check, None
    try:
        out, err = check.communicate(timeout=PLAN_CHECK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        check.kill()
        check.communicate()
        warn(f"the engine's --check-plan took over {PLAN_CHECK_TIMEOUT_S:.0f} s; not judged before the run")
        return None, None
    if check.returncode == 0:
        lines = [ln for ln in (out or "").splitlines() if ln.strip()]
        return None, (lines[-1].split(": ", 1)[-1] if lines else None)  # less the engine's "abbench engine: "
    lines = [ln for ln in (err or out or "").splitlines() if ln.strip()]
    return (f"its --check-plan failed (exit {check.returncode}): " + (lines[-1] if lines else "no message")
            + "; the service would fail the same way at start"), None


def engine_plan_verdict(check: subprocess.Popen | str | None, warn: Warn) -> str | None:
    """Why the engine whose ``--check-plan`` is ``check`` cannot start (:func:`engine_plan_result`), or None."""
    return engine_plan_result(check, warn)[0]


def check_engine_plan(spec: LaunchSpec, warn: Warn) -> str | None:
    """:func:`start_engine_plan_check` and :func:`engine_plan_verdict` for one command."""
    return engine_plan_verdict(start_engine_plan_check(spec), warn)


def _model_list(client: EngineClient, base_url: str, headers: dict[str, str]) -> list[dict[str, Any]] | None:
    """The entries of ``GET /v1/models`` (OpenAI's shape); None when the server has no such list (404, another
    shape, an error other than a refused key, which raises)."""
    try:
        text = client.metrics_text(base_url, MODELS_PATH, headers=headers)  # a plain GET of a text page
    except RequestError as e:
        if is_auth_failure(e):
            raise
        return None
    try:
        data = json.loads(text) if text else None
        entries = list(data["data"]) if isinstance(data, dict) else None
    except (ValueError, KeyError, TypeError):
        return None
    if not entries or not all(isinstance(m, dict) and "id" in m for m in entries):
        return None
    return entries


def served_models(client: EngineClient, base_url: str, headers: dict[str, str]) -> list[str] | None:
    """The model ids the server lists at ``GET /v1/models``; None when it has no such list."""
    entries = _model_list(client, base_url, headers)
    return [str(m["id"]) for m in entries] if entries else None


def served_context(client: EngineClient, base_url: str, headers: dict[str, str], model: str | None) -> int | None:
    """The context (``max_model_len``, prompt and output tokens together) the server lists for ``model`` (for
    its only model when ``model`` is None or not listed); None when it says none."""
    entries = _model_list(client, base_url, headers) or []
    mine = [m for m in entries if model is not None and str(m["id"]) == model] or (entries if len(entries) == 1 else [])
    limit = mine[0].get("max_model_len") if mine else None
    return int(limit) if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else None


def check_context(client: EngineClient, base_url: str, headers: dict[str, str], model: str | None, *,
                  longest: tuple[str, int] | None, max_tokens: int, where: str) -> int | None:
    """Raise :class:`ConfigError` when the longest prompt (``(prompt id, tokens)``) plus ``max_tokens`` exceeds
    the context the server lists; returns that context (None: the server lists none, nothing is judged)."""
    limit = served_context(client, base_url, headers, model)
    if limit is None or longest is None:
        return limit
    pid, n = longest
    if n + max_tokens > limit:
        raise ConfigError(f"{where}: the server's context is {limit:,} tokens (max_model_len at {MODELS_PATH}) but "
                          f"prompt {pid} has {n:,} tokens and each request asks for {max_tokens:,} more "
                          f"({n + max_tokens:,}): every such request would be refused. Use shorter --lengths (at "
                          f"most {limit - max_tokens:,} prompt tokens), fewer request.max_tokens, or a server with "
                          "a longer context. Stopped before any request to it.")
    return limit


def _check_attached(profile: Profile, client: EngineClient, credentials: Credentials, arms: list[str],
                    spec: LaunchSpec) -> None:
    assert spec.base_url is not None
    ae = profile.arm_engine(arms[0])
    who = _who(arms, spec.base_url)
    check = health_check(client, ae.health_path, credentials, spec.api_key_env, spec.api_key_field)
    key = ",".join(arms)
    try:
        Service.attach(key, spec.base_url, health_path=ae.health_path,
                       health_timeout_s=profile.engine.health_timeout_s, health_check=check, arms=arms)
    except ServiceError as e:
        raise type(e)(f"{who}: {str(e).removeprefix(f'service {key}: ')}") from None
    headers = credentials.headers(spec.api_key_env)
    try:
        probe_control_paths(client, spec.base_url, ae.adapter, reset_path=ae.reset_path, metrics_path=None,
                            headers=headers, resets=profile.run.reset_between_samples, where=who)
        for arm in arms:
            model = profile.arm_engine(arm).model
            if not model or profile.arm_engine(arm).adapter in IGNORES_MODEL:
                continue
            served = served_models(client, spec.base_url, headers)
            if served is not None and model not in served:
                raise ConfigError(f"{_who([arm], spec.base_url)}: the server serves {', '.join(map(repr, served))}, "
                                  f"not the profile's model {model!r}; every request would be refused. Set the "
                                  "arm's (or engine's) model to the served name")
    except RequestError as e:  # only a refused key gets here
        raise auth_failure(e, spec.api_key_env, spec.api_key_field, credentials) from None


def check_services(profile: Profile, client: EngineClient, credentials: Credentials, arms: list[str],
                   warn: Warn, note: Warn | None = None) -> None:
    """Check every service of ``arms`` (module docstring); raise at the first that cannot serve its arms.
    ``note``: told each checked vendored engine's plan ("arm NAME: 2048-token prefill chunks; device-memory plan:
    ..."), so a run's log and ``abbench run --dry-run`` say what each service will hold on the card."""
    skip = profile.run.on_service_failure == "skip-arm" and not profile.engine.shared_service
    todo = _services(profile, arms)
    missing = [check_command(spec) if spec.base_url is None else None for _, spec in todo]
    plans = [start_engine_plan_check(spec) if spec.base_url is None and why is None else None
             for (_, spec), why in zip(todo, missing)]  # all started now: they run side by side
    try:
        for (service_arms, spec), why, plan in zip(todo, missing, plans):
            try:
                if spec.base_url is not None:
                    _check_attached(profile, client, credentials, service_arms, spec)
                else:
                    planned = None
                    if why is None:
                        why, planned = engine_plan_result(plan, warn)
                    if planned is not None and note is not None:
                        note(f"arm{'s' if len(service_arms) > 1 else ''} {', '.join(service_arms)}: {planned}")
                    if why is not None:
                        raise ServiceError(f"{_who(service_arms, ' '.join(map(str, spec.argv or [])))}: {why}")
            except ServiceError as e:
                if not skip:
                    raise type(e)(f"{e} (checked before this run sent any request)") from None
                warn(f"{str(e).splitlines()[0]}; the arm is skipped when its turn comes (run.on_service_failure = "
                     "skip-arm)")
    finally:  # a check not waited for (an earlier service failed) is not left running
        for plan in plans:
            if isinstance(plan, subprocess.Popen) and plan.poll() is None:
                plan.kill()
                plan.communicate()
