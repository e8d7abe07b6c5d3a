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

Layout: :mod:`~abbench.profile.specs` (the schema: one model per table; ``[load]`` in
:mod:`~abbench.profile.load`), :mod:`~abbench.profile.model` (the
:class:`Profile` and its rules), :mod:`~abbench.profile.lookup` (finding and loading profile files). Everything
is importable from ``abbench.profile``.
"""

from abbench.adapters import ADAPTER_PATHS, AdapterName
from abbench.profile.specs import (
    ArmSpec,
    EngineSpec,
    EnvVarName,
    GateSpec,
    PairSpec,
    PositiveInt,
    PromptsSpec,
    RequestSpec,
    RunSpec,
    SweepSpec,
    TokenizerSpec,
)
from abbench.profile.load import LengthDist, LoadSpec, parse_levels
from abbench.profile.model import ArmEngine, LaunchSpec, Profile, profile_from_dict
from abbench.profile.lookup import (
    BUNDLED_PROFILES_DIR,
    DEFAULT_PROFILE,
    LOCAL_PROFILES_DIR,
    PROFILES_DIR,
    ProfileEntry,
    available_profiles,
    load_profile,
    profile_dirs,
    resolve_profile_path,
)

__all__ = [
    "ADAPTER_PATHS", "BUNDLED_PROFILES_DIR", "DEFAULT_PROFILE", "LOCAL_PROFILES_DIR", "PROFILES_DIR",
    "AdapterName", "ArmEngine", "LengthDist", "LoadSpec", "parse_levels", "ArmSpec", "EngineSpec", "EnvVarName", "GateSpec", "LaunchSpec", "PairSpec",
    "PositiveInt", "Profile", "ProfileEntry", "PromptsSpec", "RequestSpec", "RunSpec", "SweepSpec", "TokenizerSpec",
    "available_profiles", "load_profile", "profile_dirs", "profile_from_dict", "resolve_profile_path",
]
