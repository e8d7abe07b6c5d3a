"""Experiment profiles: the TOML files in ``profiles/``, validated into :class:`Profile`.

A profile says everything a run needs and nothing is decided after looking at numbers: the tokenizer, the
prompt sets, how to launch or reach the engine, the arms, the rounds, which samples are excluded (the
pre-registered rule), the request parameters and the gate's checks. ``abbench run`` flags may override the
arms (subset and order), the rounds and the fresh-prompt lengths; the effective profile is what the run
records.

Errors name the file, the field (dotted path) and what is allowed: they are raised as
:class:`abbench.errors.ConfigError`. Placeholders in commands: ``{python}`` (this interpreter), ``{port}``
(a free loopback port chosen per service), ``{profile_dir}`` (the profile file's folder).

:meth:`Profile.launch_spec` is the one rule that turns an arm into its service (argv, env, base URL to attach
to, profile folder): the runner, ``abbench probe`` and the launch-command checks all call it.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from abbench.errors import ConfigError

def _bundled_profiles_dir() -> Path:
    """The profiles that ship with abbench: ``abbench/bundled_profiles/`` in an installed package (the wheel
    carries the repository's top-level ``profiles/`` there), else ``profiles/`` beside the package (a checkout
    or an editable install, where ``profiles/`` itself is the source)."""
    here = Path(__file__).resolve().parent
    installed = here / "bundled_profiles"
    if installed.is_dir() and any(installed.glob("*.toml")):
        return installed
    return here.parent / "profiles"


BUNDLED_PROFILES_DIR = _bundled_profiles_dir()
PROFILES_DIR = BUNDLED_PROFILES_DIR  # the bundled profiles (the name older callers use)
LOCAL_PROFILES_DIR = Path("profiles")  # ./profiles in the working directory, looked at before the bundled ones
DEFAULT_PROFILE = "cpu-tiny"

PositiveInt = Annotated[int, Field(gt=0)]
EnvVarName = Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]


@dataclass(frozen=True)
class LaunchSpec:
    """How to reach one service: launch ``argv`` with ``env``, or attach to ``base_url`` (then ``argv`` is
    None). ``source`` names the profile field the command comes from (for error messages)."""

    argv: list[str] | None
    env: dict[str, str]
    base_url: str | None
    source: str
    profile_dir: Path | None
    api_key_env: str | None = None  # the environment variable holding the service's API key (never the key)
    api_key_field: str = "engine.api_key_env"  # the profile field that names it (for error messages)


@dataclass(frozen=True)
class ArmEngine:
    """How the harness talks to one arm's engine (:meth:`Profile.arm_engine`): its wire format, its health,
    cache-reset and metrics paths ("" = none) and the ``model`` field sent with each request."""

    adapter: str
    health_path: str
    reset_path: str
    metrics_path: str
    model: str | None


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)


class TokenizerSpec(_Model):
    source: str = Field(
        "qwen3",
        description="Built-in vocabulary name ('qwen3' = Qwen2/Qwen3, 'qwen3.6' = Qwen3.5/3.6) or the path "
        "of a local Hugging Face tokenizer directory (relative paths are relative to the profile).",
    )


class PairSpec(_Model):
    cold: PositiveInt = Field(description="Token count of the cold prompt.")
    extend: PositiveInt = Field(description="Tokens the continuation adds to the cold prompt.")


class PromptsSpec(_Model):
    lengths: list[PositiveInt] = Field(
        default_factory=lambda: [512], description="Token counts of the fresh (cold, unrelated) prompts."
    )
    per_length: PositiveInt = Field(1, description="Distinct fresh prompts at each length.")
    corpora: list[str] = Field(
        default_factory=lambda: ["essays", "science", "history", "fiction"],
        description="Text bodies the prompts are cut from: built-in corpus names or paths to UTF-8 .txt "
        "files. Prompts rotate through them so no two prompts share a prefix.",
    )
    pairs: list[PairSpec] = Field(
        default_factory=list,
        description="Cold/continuation pairs: the continuation extends the cold prompt token for token, so "
        "a prefix cache can reuse it. Always run back to back on the same arm.",
    )
    warmup: int = Field(2, ge=0, description="Short warm-up prompts per arm and service (excluded).")
    warmup_tokens: PositiveInt = Field(32, description="Token count of each warm-up prompt.")
    jit_warmup_tokens: int = Field(
        0,
        ge=0,
        description="If > 0, one long prompt of this many tokens runs per arm and service after the "
        "warm-ups, to warm JIT and allocator caches (excluded). 0 = none.",
    )
    seed: int = Field(0, description="Seed of the corpus rotation; same seed, same prompts.")

    @field_validator("lengths")
    @classmethod
    def _distinct(cls, v: list[int]) -> list[int]:
        if len(set(v)) != len(v):
            raise ValueError("lengths must be distinct")
        return v


class RequestSpec(_Model):
    max_tokens: PositiveInt = Field(16, description="Tokens generated per request.")
    temperature: float = Field(0.0, ge=0.0, description="0 = greedy (parity needs greedy).")
    ignore_eos: bool = Field(True, description="Generate exactly max_tokens even past EOS.")
    logprobs: int | None = Field(
        2, ge=0, le=20, description="Top-k logprobs per output token, for divergence margins; null = none."
    )
    stream: bool = Field(True, description="Stream (SSE); TTFT needs it.")
    timeout_s: float = Field(300.0, gt=0, description="Per-request timeout (seconds, whole response).")
    extra: dict[str, Any] = Field(default_factory=dict, description="Extra body fields for every request.")


AdapterName = Literal["openai", "vllm", "sglang", "llamacpp"]

ADAPTER_PATHS: dict[str, dict[str, str]] = {
    # The engine's own cache-reset and Prometheus paths (see abbench.adapters for the documents followed).
    "openai": {"reset_path": "/reset", "metrics_path": "/metrics"},  # the vendored engine
    "vllm": {"reset_path": "/reset_prefix_cache", "metrics_path": "/metrics"},  # reset needs VLLM_SERVER_DEV_MODE=1
    "sglang": {"reset_path": "/flush_cache", "metrics_path": "/metrics"},  # metrics need --enable-metrics
    # erase slot 0's KV: needs --slot-save-path and one slot (-np 1); metrics need --metrics
    "llamacpp": {"reset_path": "/slots/0?action=erase", "metrics_path": "/metrics"},
}
"""Default ``engine.reset_path``/``metrics_path`` per ``engine.adapter``; an empty string means none."""


class EngineSpec(_Model):
    adapter: AdapterName = Field(
        "openai",
        description="Wire format: 'openai' (/v1/completions with token_ids, the vendored engine and "
        "vLLM-compatible servers), or an engine-specific adapter.",
    )
    command: list[str] = Field(
        default_factory=list, description="argv of the service (no shell); arms append their args."
    )
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment of the service.")
    base_url: str | None = Field(None, description="URL of an already running server (no launch).")
    model: str | None = Field(None, description="'model' field sent with each request, if the server needs it.")
    api_key_env: EnvVarName | None = Field(
        None,
        description="Name of the environment variable holding the server's API key (e.g. VLLM_API_KEY); sent "
        "as 'Authorization: Bearer ...' on every request to the engine. The key itself is never written to "
        "the profile, run.json, logs or reports. Unset variable: an error before anything starts.",
    )
    ca_bundle: str | None = Field(
        None,
        description="PEM file of the CA certificate(s) that sign an https base_url's certificate (a private "
        "CA); relative paths are relative to the profile. Default: the system's public CAs (certifi).",
    )
    shared_service: bool = Field(
        False,
        description="Arms share services instead of getting a fresh one per round: each request carries its "
        "arm's fields and the service is reset before each sample group. By default all arms share one; arms "
        "that name a `service` share that one (e.g. offloaded arms on one, resident on its own).",
    )
    health_path: str = "/health"
    health_timeout_s: float = Field(180.0, gt=0)
    reset_path: str | None = Field(
        None,
        description="POSTed to flush caches before each cold sample. Omitted: the adapter's default "
        "(ADAPTER_PATHS; filled in when the profile is validated, so the run records the path it used); "
        "\"\" = the engine has none (no reset is sent).",
    )
    metrics_path: str | None = Field(
        None,
        description="Prometheus text endpoint scraped around requests. Omitted: the adapter's default; "
        "\"\" = none.",
    )
    stop_timeout_s: float = Field(15.0, gt=0, description="Grace period after SIGTERM before SIGKILL.")

    @model_validator(mode="after")
    def _adapter_paths(self) -> EngineSpec:
        defaults = ADAPTER_PATHS[self.adapter]
        if self.reset_path is None:
            self.reset_path = defaults["reset_path"]
        if self.metrics_path is None:
            self.metrics_path = defaults["metrics_path"]
        return self


class ArmSpec(_Model):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$", description="Arm name (used in files).")
    adapter: AdapterName | None = Field(
        None,
        description="This arm's wire format (default: engine.adapter), so one run can compare engines. An arm "
        "that names an adapter takes that adapter's default reset and metrics paths unless it sets its own.",
    )
    model: str | None = Field(None, description="'model' field of this arm's requests (default: engine.model).")
    health_path: str | None = Field(None, description="Default: engine.health_path.")
    reset_path: str | None = Field(
        None, description="Default: the arm's adapter's when the arm names one, else engine.reset_path; \"\" = none."
    )
    metrics_path: str | None = Field(
        None, description="Default: the arm's adapter's when the arm names one, else engine.metrics_path; \"\" = none."
    )
    args: list[str] = Field(default_factory=list, description="Appended to engine.command.")
    command: list[str] | None = Field(None, description="Replaces engine.command for this arm.")
    env: dict[str, str] = Field(default_factory=dict)
    base_url: str | None = Field(None, description="A running server for this arm (no launch).")
    api_key_env: EnvVarName | None = Field(
        None, description="This arm's API key variable (overrides engine.api_key_env)."
    )
    service: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$",
        description="With engine.shared_service: the name of the service this arm shares with the arms that "
        "name the same one (default 'shared'). Arms of one service must launch it the same way (the same "
        "args, command, env and base_url).",
    )
    request: dict[str, Any] = Field(default_factory=dict, description="Extra request body fields.")
    expect_path: str | None = Field(
        None, description="The engine must report this prefill path (abbench.prefill_path) when eligible."
    )
    accept_near_ties: float | None = Field(
        None, gt=0,
        description="This arm's own parity tolerance (nats), replacing gate.accept_near_ties for its rows: a "
        "near-tie flip against the parity reference below it is accepted. For an arm of another engine, whose "
        "arithmetic differs from the reference's; say in the profile what measurement the value comes from.",
    )

    @model_validator(mode="after")
    def _adapter_paths(self) -> ArmSpec:
        if self.adapter is not None:  # filled in, so the run records the paths it used
            defaults = ADAPTER_PATHS[self.adapter]
            if self.reset_path is None:
                self.reset_path = defaults["reset_path"]
            if self.metrics_path is None:
                self.metrics_path = defaults["metrics_path"]
        return self


class RunSpec(_Model):
    rounds: PositiveInt | Literal["auto"] = Field(
        2, description="Interleaved rounds; arm order reverses every round (ABBA). \"auto\": rounds go on until "
        "every declared ratio check's interval is narrow enough (target_halfwidth) or max_rounds have run.")
    target_halfwidth: float | None = Field(
        None, gt=0, lt=1, description="rounds = \"auto\": stop when every cell of every ratio check in gate.checks "
        "has a 95% interval whose half-width is at most this fraction of its median (e.g. 0.02).")
    max_rounds: PositiveInt | None = Field(None, description="rounds = \"auto\": stop after this many rounds.")
    min_rounds: PositiveInt = Field(2, description="rounds = \"auto\": always run at least this many rounds.")

    @field_validator("rounds", mode="before")
    @classmethod
    def _rounds(cls, v: Any) -> Any:
        """One message for a bad value (not the union's two): a positive count, or "auto"."""
        if v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v > 0):
            return v
        if isinstance(v, int) and not isinstance(v, bool):
            raise PydanticCustomError("greater_than", "Input should be greater than 0 (a number of rounds) or \"auto\"")
        raise PydanticCustomError("rounds", "Input should be a number of rounds (e.g. 2) or \"auto\"")
    reference: str | None = Field(None, description="Reference arm for parity and ratios (default: first).")
    exclude_kinds: list[Literal["warmup", "jit", "fresh", "cold", "continuation"]] = Field(
        default_factory=lambda: ["warmup", "jit"],
        description="Pre-registered exclusion rule: samples of these kinds are run but excluded.",
    )
    reset_between_samples: bool = Field(
        True, description="POST engine.reset_path before every fresh prompt and every pair."
    )
    on_service_failure: Literal["stop", "skip-arm"] = "stop"
    on_request_failure: Literal["continue", "restart", "stop"] = Field(
        "continue",
        description="After a failed request: carry on, restart the service first, or stop the run.",
    )


class GateSpec(_Model):
    parity_tokens: PositiveInt = Field(8, description="First K greedy ids that must match the reference.")
    require_active_path: bool = Field(True, description="Arms with expect_path must report that path.")
    allow_fallback: list[str] = Field(default_factory=list, description="Arms allowed to fall back.")
    max_failed_samples: int = Field(0, ge=0, description="Failed measured samples tolerated.")
    checks: list[str] = Field(
        default_factory=list,
        description="Declared checks, METRIC[ARM(, KIND)(, >=TOKENS|<=TOKENS)] OP VALUE, e.g. "
        "'ttft_ratio[layer-major, fresh, >=32768] <= 0.15' (see abbench.analysis.declared).",
    )

    @field_validator("checks")
    @classmethod
    def _parse_checks(cls, v: list[str]) -> list[str]:
        from abbench.analysis.declared import parse_checks

        try:
            parse_checks(v)
        except ConfigError as e:
            raise ValueError(str(e)) from None
        return v
    accept_near_ties: float | None = Field(
        None,
        gt=0,
        description="Tolerance (nats) under which a parity mismatch that is a near-tie flip (each side's choice "
        "is the other's runner-up, top-2 margin below this) is accepted; reported either way. Unset: every "
        "mismatch within parity_tokens fails (an arm's own accept_near_ties replaces it for that arm).",
    )
    parity_reference: str | None = Field(
        None,
        description="The arm every other arm's ids are checked against (default: run.reference, which stays the "
        "arm TTFT ratios divide by): e.g. an engine's own resident floor for parity, another engine for speed.",
    )


class Profile(_Model):
    name: str
    description: str = ""
    tokenizer: TokenizerSpec = Field(default_factory=TokenizerSpec)
    prompts: PromptsSpec = Field(default_factory=PromptsSpec)
    request: RequestSpec = Field(default_factory=RequestSpec)
    engine: EngineSpec = Field(default_factory=EngineSpec)
    arms: list[ArmSpec] = Field(min_length=1)
    run: RunSpec = Field(default_factory=RunSpec)
    gate: GateSpec = Field(default_factory=GateSpec)
    # Where the profile came from; not a TOML field (set by load_profile).
    source_path: str | None = Field(None, exclude=False)

    @model_validator(mode="after")
    def _check(self) -> Profile:
        names = [a.name for a in self.arms]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"arm names must be unique; repeated: {', '.join(dupes)}")
        if self.run.reference is not None and self.run.reference not in names:
            raise ValueError(f"run.reference {self.run.reference!r} is not an arm; arms are {', '.join(names)}")
        for arm in self.arms:
            launch = arm.command or self.engine.command
            if not (arm.base_url or self.engine.base_url or launch):
                raise ValueError(
                    f"arm {arm.name!r} has no way to reach an engine: set engine.command, engine.base_url, "
                    "or the arm's command/base_url"
                )
        if self.gate.parity_reference is not None and self.gate.parity_reference not in names:
            raise ValueError(f"gate.parity_reference {self.gate.parity_reference!r} is not an arm; arms are "
                             f"{', '.join(names)}")
        for name in self.gate.allow_fallback:
            if name not in names:
                raise ValueError(f"gate.allow_fallback names {name!r}, which is not an arm")
        from abbench.analysis.declared import check_arms, parse_checks

        try:
            check_arms(parse_checks(self.gate.checks), names, self.reference_arm, "gate.checks")
        except ConfigError as e:
            raise ValueError(str(e)) from None
        self._check_auto_rounds()
        named = [a.name for a in self.arms if a.service is not None]
        if named and not self.engine.shared_service:
            raise ValueError(f"arms {', '.join(named)} name a service but engine.shared_service is false; set "
                             "engine.shared_service = true (arms naming the same service share it)")
        for service, arms in (self.service_groups() if self.engine.shared_service else {}).items():
            launch = {(tuple(a.args), tuple(a.command or ()), tuple(sorted(a.env.items())), a.base_url,
                       a.api_key_env) for a in arms}
            if len(launch) > 1:
                raise ValueError(f"arms {', '.join(a.name for a in arms)} share service {service!r} but launch it "
                                 "differently (args, command, env, base_url or api_key_env); give them the same, "
                                 "or different services")
            engines = {self.arm_engine(a.name) for a in arms}
            if len(engines) > 1:
                raise ValueError(f"arms {', '.join(a.name for a in arms)} share service {service!r} but talk to it "
                                 "differently (adapter, model, health_path, reset_path or metrics_path); give "
                                 "them the same, or different services")
        return self

    def _check_auto_rounds(self) -> None:
        from abbench.analysis.declared import parse_checks

        r = self.run
        if r.rounds != "auto":
            if r.target_halfwidth is not None or r.max_rounds is not None:
                raise ValueError("run.target_halfwidth and run.max_rounds apply only with run.rounds = \"auto\"")
            return
        if r.target_halfwidth is None or r.max_rounds is None:
            raise ValueError("run.rounds = \"auto\" needs run.target_halfwidth (e.g. 0.02) and run.max_rounds")
        if r.max_rounds < r.min_rounds:
            raise ValueError(f"run.max_rounds ({r.max_rounds}) is below run.min_rounds ({r.min_rounds})")
        if not any(c.spec.ratio for c in parse_checks(self.gate.checks)):
            raise ValueError("run.rounds = \"auto\" narrows the intervals of declared ratio checks, and gate.checks "
                             "declares none: add e.g. \"ttft_ratio[ARM, fresh] <= 0.5\" (ttft_ratio, x_floor)")

    def arm_engine(self, arm: str | None = None) -> ArmEngine:
        """How to talk to ``arm``'s engine: the arm's own ``adapter``/``model``/paths where it sets them, else
        ``engine``'s (an arm naming an adapter has that adapter's default paths, filled in at validation).
        None: ``engine``'s own."""
        eng = self.engine
        a = self.arm(arm) if arm is not None else None

        def pick(field: str) -> Any:
            own = getattr(a, field) if a is not None else None
            return own if own is not None else getattr(eng, field)

        return ArmEngine(adapter=pick("adapter"), health_path=pick("health_path"),
                         reset_path=pick("reset_path") or "", metrics_path=pick("metrics_path") or "",
                         model=pick("model"))

    def service_groups(self) -> dict[str, list[ArmSpec]]:
        """With engine.shared_service: service name -> its arms, in profile order ('shared' by default)."""
        groups: dict[str, list[ArmSpec]] = {}
        for a in self.arms:
            groups.setdefault(a.service or "shared", []).append(a)
        return groups

    @property
    def reference_arm(self) -> str:
        return self.run.reference or self.arms[0].name

    @property
    def parity_reference_arm(self) -> str:
        """The arm parity compares with: gate.parity_reference, else the reference arm."""
        return self.gate.parity_reference or self.reference_arm

    def arm(self, name: str) -> ArmSpec:
        for a in self.arms:
            if a.name == name:
                return a
        raise KeyError(name)

    @property
    def profile_dir(self) -> Path | None:
        """The folder of the profile file (relative paths in a profile are relative to it)."""
        return Path(self.source_path).parent if self.source_path else None

    def launch_spec(self, arm: str | None = None) -> LaunchSpec:
        """The service that serves ``arm`` (None: the engine's own ``command``/``base_url``). An arm's
        ``base_url`` wins, then its own ``command``, then ``engine.command`` + the arm's ``args`` (or
        ``engine.base_url`` when the arm has no command). The env is ``engine.env`` updated with the arm's.
        With ``engine.shared_service`` the arms of one service launch it the same way (validated), so any
        of them gives its spec."""
        eng = self.engine
        if arm is None:
            argv = list(eng.command) if eng.command else None
            return LaunchSpec(argv=None if eng.base_url else argv, env=dict(eng.env), base_url=eng.base_url or None,
                              source="engine.command", profile_dir=self.profile_dir, api_key_env=eng.api_key_env)
        a, i = self.arm(arm), [x.name for x in self.arms].index(arm)
        base_url = a.base_url or (None if a.command else eng.base_url)
        argv = list(a.command) if a.command else (list(eng.command) + list(a.args) if eng.command else None)
        if eng.shared_service:
            service = a.service or "shared"
            source = (f"arms[{i}].command (service {service})" if a.command else
                      "engine.command" if not a.args else f"engine.command + args of service {service}")
        else:
            source = (f"arms[{i}].command (arm {a.name})" if a.command else
                      f"engine.command + arms[{i}].args (arm {a.name})")
        return LaunchSpec(argv=None if base_url else argv, env={**eng.env, **a.env}, base_url=base_url or None,
                          source=source, profile_dir=self.profile_dir,
                          api_key_env=a.api_key_env or eng.api_key_env,
                          api_key_field=f"arms[{i}].api_key_env" if a.api_key_env else "engine.api_key_env")

    def ca_bundle_path(self) -> Path | None:
        """``engine.ca_bundle`` as a path (relative to the profile's folder); None when not set. A missing
        file is a :class:`ConfigError` naming the field."""
        cb = self.engine.ca_bundle
        if not cb:
            return None
        p = Path(cb).expanduser()
        if not p.is_absolute() and self.profile_dir is not None:
            p = self.profile_dir / p
        if not p.is_file():
            raise ConfigError(f"engine.ca_bundle: {p} is not a file; give the PEM file of the CA that signed the "
                              "server's certificate (relative paths are relative to the profile)")
        return p

    def launch_specs(self) -> list[LaunchSpec]:
        """Every distinct service spec of this profile: one per shared service (its first arm's), else one
        per arm."""
        if self.engine.shared_service:
            return [self.launch_spec(arms[0].name) for arms in self.service_groups().values()]
        return [self.launch_spec(a.name) for a in self.arms]

    def with_overrides(
        self, *, arms: list[str] | None = None, rounds: int | None = None, lengths: list[int] | None = None
    ) -> Profile:
        """The profile with ``abbench run`` flag overrides applied (validated again)."""
        data = self.model_dump()
        where = "--arms"
        if arms is not None:
            known = {a["name"]: a for a in data["arms"]}
            unknown = [a for a in arms if a not in known]
            if unknown:
                raise ConfigError(
                    f"{where}: unknown arm(s) {', '.join(unknown)}; this profile has {', '.join(known)}"
                )
            if len(set(arms)) != len(arms):
                raise ConfigError(f"{where}: an arm is named twice")
            data["arms"] = [known[a] for a in arms]
            if data["run"]["reference"] not in arms:
                data["run"]["reference"] = None
            if data["gate"]["parity_reference"] not in arms:
                data["gate"]["parity_reference"] = None
            data["gate"]["allow_fallback"] = [a for a in data["gate"]["allow_fallback"] if a in arms]
            data["gate"]["checks"] = _checks_within(data["gate"]["checks"], arms, data["run"]["reference"] or arms[0])
        if rounds is not None:  # a fixed number of rounds replaces "auto" and its rule
            data["run"].update(rounds=rounds, target_halfwidth=None, max_rounds=None)
        if lengths is not None:
            data["prompts"]["lengths"] = lengths
        return _validate(data, self.source_path or "<overrides>")


def _checks_within(exprs: list[str], arms: list[str], reference: str) -> list[str]:
    """The declared checks that still apply after ``--arms`` picked ``arms``: those naming a dropped arm
    (their own, or the one a paired metric divides by) or pairing an arm with itself go, as allow_fallback
    entries do."""
    from abbench.analysis.declared import PAIRED, parse_check

    keep = []
    for e in exprs:
        c = parse_check(e)
        if c.arm in arms and (c.vs is None or c.vs in arms) and not (
                c.metric in PAIRED and c.arm == (c.vs or reference)):
            keep.append(e)
    return keep


_MISSING_HINTS = {
    "name": 'required: add name = "my-experiment" at the top of the file',
    "arms": 'required: add at least one [[arms]] table, e.g. [[arms]] with name = "baseline"',
}
_SHAPE_HINTS = {
    "command": ' (an argv list, e.g. command = ["{python}", "-m", "abbench.engine", "--port", "{port}"])',
    "args": ' (a list of strings, e.g. args = ["--prefill-mode", "chunked"])',
    "lengths": " (a list of token counts, e.g. lengths = [4096, 16384])",
    "env": ' (a table of strings, e.g. env = { CUDA_VISIBLE_DEVICES = "0" })',
    "request": ' (a table, e.g. request = { prefill_mode = "chunked" })',
}


def _format_validation_error(err: ValidationError, path: str) -> str:
    lines = [f"{path}: invalid profile"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown field (check the spelling; see the profile reference in the README)"
        elif e["type"] == "missing":
            msg = _MISSING_HINTS.get(loc, "required field is missing")
        elif e["type"] in ("list_type", "dict_type"):
            msg += _SHAPE_HINTS.get(e["loc"][-1] if e["loc"] else "", "")
        lines.append(f"  {loc}: {msg}")
    return "\n".join(lines)


def _validate(data: dict[str, Any], path: str) -> Profile:
    try:
        return Profile.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e, path)) from None


@dataclass(frozen=True)
class ProfileEntry:
    """One profile file found by :func:`available_profiles`: its name, path and where it came from
    (``"./profiles"`` or ``"bundled"``); ``shadowed_by`` is set on a bundled profile that a ``./profiles``
    file of the same name hides."""

    name: str
    path: Path
    source: str
    shadowed_by: Path | None = None


def _same_dir(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False


def profile_dirs(cwd: Path | None = None) -> list[tuple[str, Path]]:
    """Where profile names are looked up, in order: ``./profiles`` in the working directory (``cwd``), then
    the bundled profiles. In the repository root both are the same folder; it is listed once, as bundled."""
    local = (cwd or Path.cwd()) / LOCAL_PROFILES_DIR
    dirs: list[tuple[str, Path]] = []
    if local.is_dir() and not _same_dir(local, BUNDLED_PROFILES_DIR):
        dirs.append(("./profiles", local))
    dirs.append(("bundled", BUNDLED_PROFILES_DIR))
    return dirs


def available_profiles(cwd: Path | None = None) -> list[ProfileEntry]:
    """Every profile file a name can reach, the winning one first for each name (see :func:`profile_dirs`)."""
    entries: list[ProfileEntry] = []
    seen: dict[str, Path] = {}
    for source, d in profile_dirs(cwd):
        for p in sorted(d.glob("*.toml")):
            entries.append(ProfileEntry(p.stem, p, source, shadowed_by=seen.get(p.stem)))
            seen.setdefault(p.stem, p)
    return entries


def resolve_profile_path(name_or_path: str | None, cwd: Path | None = None) -> Path:
    """A path to a TOML file (used as given), or a profile name (``cpu-tiny``) looked up in ``./profiles``
    of the working directory first, then among the bundled profiles."""
    if name_or_path is None:
        name_or_path = DEFAULT_PROFILE
    p = Path(name_or_path)
    if p.suffix == ".toml" or p.exists() or "/" in name_or_path:
        if not p.is_file():
            raise ConfigError(f"profile file {p} does not exist")
        return p
    for _, d in profile_dirs(cwd):
        candidate = d / f"{name_or_path}.toml"
        if candidate.is_file():
            return candidate
    known = sorted({e.name for e in available_profiles(cwd)})
    looked = " and ".join(str(d) for _, d in profile_dirs(cwd))
    raise ConfigError(
        f"no profile named {name_or_path!r} (looked in {looked}): pass a path to a .toml file or one of: "
        f"{', '.join(known) or '(none)'}"
    )


def load_profile(name_or_path: str | None = None) -> Profile:
    """Load and validate a profile; every error is a :class:`ConfigError` naming the file and field."""
    path = resolve_profile_path(name_or_path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e}") from None
    if "source_path" in data:
        raise ConfigError(f"{path}: source_path: unknown field (it is set by abbench, not by the profile)")
    data["source_path"] = str(path.resolve())
    return _validate(data, str(path))


def profile_from_dict(data: dict[str, Any], where: str = "<profile>") -> Profile:
    """Validate a profile given as a dict (e.g. read back from run.json)."""
    return _validate(dict(data), where)
