"""The :class:`Profile`: the tables of :mod:`abbench.profile.specs` put together, what spans them validated
(unique arms, references that exist, declared checks naming arms of the profile, shared services launched
alike, the rule of ``rounds = "auto"``), and the rules that read it: :meth:`Profile.launch_spec` (arm ->
service), :meth:`Profile.arm_engine` (arm -> wire format and paths), :meth:`Profile.with_overrides` (the
``abbench run`` flags). :func:`profile_from_dict` validates a profile given as a dict; every error is a
:class:`~abbench.errors.ConfigError` naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, model_validator

from abbench.checkexpr import NUMERICS, check_arms, checks_within, level_label, numerics_checked, parse_checks
from abbench.errors import ConfigError
from abbench.profile.load import LoadSpec
from abbench.profile.specs import (
    ArmSpec,
    EngineSpec,
    GateSpec,
    PromptsSpec,
    RequestSpec,
    RunSpec,
    SweepSpec,
    TokenizerSpec,
    _Model,
)

__all__ = ["ArmEngine", "LaunchSpec", "Profile", "profile_from_dict"]


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


AUTO_DEFAULTS = {"target_halfwidth": 0.05, "max_rounds": 10}
"""``--rounds auto`` on a profile that sets no rule of its own: stop when every declared ratio's interval is within
5% of its median, or after 10 rounds."""


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
    sweep: SweepSpec | None = None
    load: LoadSpec | None = None
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
        try:
            check_arms(parse_checks(self.gate.checks), names, self.reference_arm, "gate.checks")
        except ConfigError as e:
            raise ValueError(str(e)) from None
        self._check_sweep()
        self._check_load()
        self._check_auto_rounds()
        self._check_numerics()
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

    def _check_load(self) -> None:
        checks = [c for c in parse_checks(self.gate.checks) if c.load]
        ld = self.load
        if ld is None:
            if checks:
                raise ValueError(f"gate.checks: {checks[0].expr!r} judges load levels; add a [load] table "
                                 "(concurrency = [...] and/or rate = [...])")
            return
        if not self.request.stream:
            raise ValueError("[load] measures TTFT and inter-token latency from the stream: request.stream must be "
                             "true")
        if self.sweep is not None:
            raise ValueError("[load] and [sweep] are different runs; give one of them")
        if self.run.rounds == "auto":
            raise ValueError("[load] runs a fixed number of rounds at every level; set run.rounds to a number")
        labels = {level_label("c" if k == "concurrency" else "rate", v) for k, v in ld.levels()}
        for c in checks:
            if c.level is not None and c.level not in labels:
                raise ValueError(f"gate.checks: {c.expr!r} selects {c.level}, which is not a level of [load] "
                                 f"({', '.join(sorted(labels))})")
            if c.metric == "parity_under_load" and not ld.parity_reference:
                raise ValueError(f"gate.checks: {c.expr!r} needs load.parity_reference = true (each prompt run "
                                 "alone)")
            if c.metric == "goodput" and not ld.slo:
                raise ValueError(f"gate.checks: {c.expr!r} needs load.slo (the objectives goodput counts)")

    def _check_numerics(self) -> None:
        """An arm with ``parity = "numerics"`` is judged by numerics checks instead of bitwise ids: it needs one,
        and it cannot be the yardstick of ids itself. An arm's own ``parity_reference`` is another arm, and its
        ids are judged against it: not an arm judged by numerics instead."""
        checked = numerics_checked(self.gate.checks)
        names = [a.name for a in self.arms]
        whole = sorted({c.arm for c in parse_checks(self.gate.checks) if c.metric == "kl_vocab_mean"})
        if whole and not self.request.full_logprobs:
            raise ValueError(f"gate.checks judge {', '.join(whole)} by kl_vocab_mean, the KL over the whole "
                             "vocabulary: set request.full_logprobs = true (the engines return their whole rows)")
        if self.request.full_logprobs:
            other = [a.name for a in self.arms if self.arm_engine(a.name).adapter != "openai"]
            if other:
                raise ValueError(f"request.full_logprobs asks for the vendored engine's whole first row (the openai "
                                 f"adapter: the engine or the transformers reference); arms {', '.join(other)} use "
                                 "another adapter")
            if self.load is not None:
                raise ValueError("request.full_logprobs is for runs of single requests: each of a [load] level's "
                                 "requests would carry a whole row (about 4 bytes a vocabulary entry)")
        for arm in self.arms:
            if arm.parity_reference is not None:
                if arm.parity_reference not in names:
                    raise ValueError(f"arm {arm.name!r}: parity_reference {arm.parity_reference!r} is not an arm; "
                                     f"arms are {', '.join(names)}")
                if arm.parity_reference == arm.name:
                    raise ValueError(f"arm {arm.name!r}: parity_reference names the arm itself")
                if arm.parity == "numerics":
                    raise ValueError(f"arm {arm.name!r} has parity = \"numerics\" (its ids are not judged) and a "
                                     f"parity_reference (its ids must equal {arm.parity_reference!r}'s): choose one")
        for arm in self.arms:
            if arm.parity != "numerics":
                continue
            if arm.name == self.parity_reference_arm:
                raise ValueError(f"arm {arm.name!r} has parity = \"numerics\" but is the parity reference; the "
                                 "reference's ids are what the other arms are checked against")
            if arm.name not in checked:
                raise ValueError(f"arm {arm.name!r} has parity = \"numerics\": the gate judges it by numerics "
                                 f"checks instead of bitwise ids, and gate.checks declares none for it; add e.g. "
                                 f"\"kl_mean[{arm.name}] <= 0.01\" and \"same_top[{arm.name}] >= 0.98\" "
                                 f"({', '.join(NUMERICS)})")

    def _check_sweep(self) -> None:
        sw, names = self.sweep, [a.name for a in self.arms]
        if sw is None:
            if any(c.metric == "crossover" for c in parse_checks(self.gate.checks)):
                raise ValueError("gate.checks: crossover[...] needs a [sweep] table (the quantity it crosses over)")
            return
        if "lengths" not in self.prompts.model_fields_set:  # a sweep's points are its prompts: no default 512
            self.prompts.lengths = []
        if self.run.rounds == "auto":
            raise ValueError("[sweep] runs a fixed number of rounds at every point; set run.rounds to a number")
        for a, b in sw.crossovers:
            for arm in (a, b):
                if arm not in names:
                    raise ValueError(f"sweep.crossovers: [{a}, {b}]: unknown arm {arm!r}; arms are {', '.join(names)}")
            if self.engine.shared_service and (self.arm(a).service or "shared") != (self.arm(b).service or "shared"):
                raise ValueError(f"sweep.crossovers: [{a}, {b}] are on different services; a sweep runs one service "
                                 "at a time, so the arms it compares must share one")
        measured = "continuation" if sw.vary == "suffix" else "fresh"
        if measured in self.run.exclude_kinds:
            raise ValueError(f"run.exclude_kinds excludes {measured!r}, the prompts a {sw.vary} sweep measures")
        if sw.prefix_request and "cold" not in self.run.exclude_kinds:
            raise ValueError("sweep.prefix_request runs every arm's cold prompts alike, so they measure no arm: "
                             "exclude them (run.exclude_kinds = [\"warmup\", \"jit\", \"cold\"])")

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
        self, *, arms: list[str] | None = None, rounds: int | str | None = None, lengths: list[int] | None = None,
        concurrency: list[float] | None = None, rate: list[float] | None = None, engine_args: list[str] | None = None,
    ) -> Profile:
        """The profile with ``abbench run`` flag overrides applied (validated again). ``rounds`` is a count, or
        "auto" with the profile's rule (its ``target_halfwidth`` and ``max_rounds``, else
        :data:`AUTO_DEFAULTS`). ``concurrency``/``rate`` (``--concurrency 1,4,16``, ``--rate 2,8,inf``: read by
        :func:`abbench.profile.load.parse_levels`) replace the ``[load]`` levels, and the other kind's when only
        one is given (declared checks on a level no longer run are left out); a profile without ``[load]`` gets
        one with its defaults. ``engine_args`` go at the end of every arm's launch command (``--engine-args``: one
        flag set for every arm, e.g. a chunk size, without editing the profile); an arm that attaches to a running
        server (``base_url``) cannot take them, and that is a ``ConfigError``."""
        data = self.model_dump()
        if engine_args:
            for a in data["arms"]:
                if self.launch_spec(a["name"]).base_url:
                    raise ConfigError(f"--engine-args: arm {a['name']!r} attaches to a running server (base_url), "
                                      "so abbench does not launch it and cannot add arguments; leave it out with "
                                      "--arms")
                key = "command" if a.get("command") else "args"
                a[key] = [*a[key], *engine_args]
        if concurrency is not None or rate is not None:
            load = dict(data.get("load") or {})
            load["concurrency"] = [int(c) for c in concurrency or []]
            load["rate"] = list(rate or [])
            data["load"] = load
            # the profile's checks on levels these flags do not run are left out, as --arms leaves out arms'
            labels = {level_label("c", float(c)) for c in load["concurrency"]} | {
                level_label("rate", float(r)) for r in load["rate"]}
            data["gate"]["checks"] = [e for e, c in zip(data["gate"]["checks"], parse_checks(data["gate"]["checks"]))
                                      if c.level is None or c.level in labels]
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
            reference = data["run"]["reference"]
            if reference is not None and reference not in arms and known[arms[0]].get("parity") == "numerics":
                raise ConfigError(
                    f"{where}: leaves out the run's reference {reference!r}, and its first arm {arms[0]!r} would take "
                    f"its place, but {arms[0]!r} has parity = \"numerics\": its numerics are judged against the "
                    f"reference's outputs. Add the reference: --arms {','.join([reference, *arms])}")
            if data["run"]["reference"] not in arms:
                data["run"]["reference"] = None
            if data["gate"]["parity_reference"] not in arms:
                data["gate"]["parity_reference"] = None
            data["gate"]["allow_fallback"] = [a for a in data["gate"]["allow_fallback"] if a in arms]
            data["gate"]["checks"] = checks_within(data["gate"]["checks"], arms, data["run"]["reference"] or arms[0])
            numerics = numerics_checked(data["gate"]["checks"])
            for a in data["arms"]:  # an arm whose own yardstick of ids is left out: its numerics judge it, if any
                if a.get("parity_reference") is not None and a["parity_reference"] not in arms:
                    a["parity_reference"] = None
                    if a["name"] in numerics:
                        a["parity"] = "numerics"
            if data.get("sweep"):
                data["sweep"]["crossovers"] = [p for p in data["sweep"]["crossovers"] if set(p) <= set(arms)]
        if rounds == "auto":
            data["run"]["rounds"] = "auto"
            for k, v in AUTO_DEFAULTS.items():
                data["run"][k] = data["run"].get(k) or v
        elif rounds is not None:  # a fixed number of rounds replaces "auto" and its rule
            data["run"].update(rounds=rounds, target_halfwidth=None, max_rounds=None)
        if lengths is not None:
            data["prompts"]["lengths"] = lengths
        return _validate(data, self.source_path or "<overrides>")



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


def _model_at(loc: tuple[Any, ...]) -> Any:
    """The pydantic model class that holds the field at ``loc`` (a validation error's location), or None."""
    import typing

    from pydantic import BaseModel

    def models(t: Any) -> list[Any]:
        if isinstance(t, type) and issubclass(t, BaseModel):
            return [t]
        return [m for a in typing.get_args(t) for m in models(a)]

    current: list[Any] = [Profile]
    for part in loc[:-1]:
        if isinstance(part, int):
            continue  # a list's element: the same model type
        nxt = [m for c in current if part in c.model_fields for m in models(c.model_fields[part].annotation)]
        if not nxt:
            return None
        current = nxt
    return current[0] if current else None


def _closest_field(loc: tuple[Any, ...]) -> str | None:
    """The known field closest in spelling to the unknown one at ``loc`` (difflib), or None."""
    import difflib

    model = _model_at(tuple(loc))
    if model is None or not loc or not isinstance(loc[-1], str):
        return None
    near = difflib.get_close_matches(loc[-1], list(model.model_fields), n=1, cutoff=0.6)
    return near[0] if near else None


def _format_validation_error(err: ValidationError, path: str) -> str:
    lines = [f"{path}: invalid profile"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            near = _closest_field(e["loc"])
            msg = (f"unknown field (did you mean {near!r}?{' ' if near else ''}" if near else "unknown field (") + \
                "check the spelling; see the profile reference in docs/profiles.md)"
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



def profile_from_dict(data: dict[str, Any], where: str = "<profile>") -> Profile:
    """Validate a profile given as a dict (e.g. read back from run.json)."""
    return _validate(dict(data), where)
