"""The profile's schema: one pydantic model per TOML table (``extra = "forbid"``: an unknown field is an
error), each field with its default and a description. :class:`~abbench.profile.model.Profile` puts them
together and checks what spans tables.

The adapter names and their default reset and metrics paths are the wire layer's
(:data:`abbench.adapters.ADAPTER_PATHS`); :class:`_AdapterPaths` fills them in once, for ``engine`` and for
an arm that names an adapter. Declared checks are parsed with :mod:`abbench.checkexpr`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from abbench.adapters import ADAPTER_PATHS, AdapterName
from abbench.checkexpr import GRAMMAR, parse_checks
from abbench.errors import ConfigError

__all__ = [
    "ArmSpec", "AdapterName", "EngineSpec", "EnvVarName", "GateSpec", "PairSpec", "PositiveInt", "PromptsSpec",
    "RequestSpec", "RunSpec", "SweepSpec", "TokenizerSpec",
]

PositiveInt = Annotated[int, Field(gt=0)]
EnvVarName = Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]


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
    full_logprobs: bool = Field(
        False, description="Ask for the first output position's whole next-token distribution (the vendored engine "
        "and the transformers reference: the request field full_logprobs; the openai adapter only). The run keeps "
        "the rows aside while it runs and records the whole-vocabulary KL of every arm's sample against the parity "
        "reference's (kl_vocab_mean), then drops them (about 4 bytes a vocabulary entry a request).")
    stream: bool = Field(True, description="Stream (SSE); TTFT needs it.")
    timeout_s: float = Field(300.0, gt=0, description="Per-request timeout (seconds, whole response).")
    extra: dict[str, Any] = Field(default_factory=dict, description="Extra body fields for every request.")



class _AdapterPaths(_Model):
    """The one place an omitted ``reset_path``/``metrics_path`` takes its adapter's default
    (:data:`abbench.adapters.ADAPTER_PATHS`): for ``engine`` always, for an arm when it names an adapter
    (otherwise :meth:`Profile.arm_engine` gives it ``engine``'s). Filled in at validation, so the run records
    the paths it used."""

    @model_validator(mode="after")
    def _adapter_paths(self) -> Any:
        adapter = getattr(self, "adapter")
        if adapter is not None:
            for path in ("reset_path", "metrics_path"):
                if getattr(self, path) is None:
                    setattr(self, path, ADAPTER_PATHS[adapter][path])
        return self


class EngineSpec(_AdapterPaths):
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



class ArmSpec(_AdapterPaths):
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
    parity: Literal["ids", "numerics"] = Field(
        "ids",
        description="How the gate judges this arm against the parity reference: \"ids\", its first "
        "gate.parity_tokens greedy ids must be equal (bitwise); \"numerics\", for an arm that changes arithmetic "
        "on purpose (FP8 weights, another kernel or dtype): its ids are shown but not gated, and declared numerics "
        "checks judge it (kl_mean, kl_p99, same_top, delta_p_rms; at least one is required). Ask for top-k "
        "logprobs (request.logprobs, up to 20): the KL is computed from them.",
    )
    parity_reference: str | None = Field(
        None,
        description="The arm whose ids this arm's must equal, instead of the run's parity reference "
        "(gate.parity_reference, else run.reference): an arm that changes arithmetic on purpose can be the "
        "yardstick of its own kind. E.g. an FP8 layer-major arm against a resident FP8 arm (bitwise: the "
        "streaming changes nothing), while its declared numerics checks still compare it with the run's "
        "parity reference (how far FP8 moves the model). That arm is checked for stability across rounds too.",
    )
    accept_near_ties: float | None = Field(
        None, gt=0,
        description="This arm's own parity tolerance (nats), replacing gate.accept_near_ties for its rows: a "
        "near-tie flip against the parity reference below it is accepted. For an arm of another engine, whose "
        "arithmetic differs from the reference's; say in the profile what measurement the value comes from.",
    )


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
        description=f"Declared checks, {GRAMMAR}, e.g. "
        "'ttft_ratio[layer-major, fresh, >=32768] <= 0.15' (see abbench.analysis.declared).",
    )

    @field_validator("checks")
    @classmethod
    def _parse_checks(cls, v: list[str]) -> list[str]:
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



class SweepSpec(_Model):
    """``[sweep]``: vary one quantity over a grid and locate where two arms' TTFT cross
    (:mod:`abbench.runner.sweep` runs it, :mod:`abbench.analysis.sweep` computes the crossover)."""

    vary: Literal["suffix", "length"] = Field(
        description="What the points are: 'suffix' = uncached tokens after a cached prefix (a cold prompt of "
        "prefix_tokens, then its continuation by that many tokens); 'length' = the tokens of a fresh prompt.")
    points: list[PositiveInt] = Field(min_length=2, description="The grid (token counts), e.g. [64, 256, 1024].")
    prefix_tokens: PositiveInt | None = Field(
        None, description="vary = 'suffix': tokens of the cached prefix (the cold prompt) at every point.")
    per_point: PositiveInt = Field(1, description="Distinct prompts (or cold/continuation pairs) per point.")
    prefix_request: dict[str, Any] = Field(
        default_factory=dict,
        description="vary = 'suffix': request fields of the cold prompts, replacing the arm's for them (e.g. "
        "{ prefill_mode = \"layer-major\" }: every arm builds its prefix the same, cheap way); the cold "
        "prompts must then be excluded (run.exclude_kinds).")
    crossovers: list[tuple[str, str]] = Field(
        default_factory=list,
        description="Arm pairs [A, B] whose TTFT crossing is located and refined; A is the arm expected to be "
        "faster below the crossover (e.g. [\"demand\", \"chunked\"]).")
    target_width: float = Field(
        0.25, gt=0, description="Refine a crossover until its 95% interval and its bracket (the two points it lies "
        "between) are each at most this fraction of it wide ((high - low) / crossover).")
    max_refinements: int = Field(
        3, ge=0, description="At most this many points are added per crossover (0: the grid only).")

    @field_validator("points")
    @classmethod
    def _points(cls, v: list[int]) -> list[int]:
        if len(set(v)) != len(v):
            raise ValueError("points must be distinct")
        return sorted(v)

    @model_validator(mode="after")
    def _shape(self) -> SweepSpec:
        if self.vary == "suffix" and self.prefix_tokens is None:
            raise ValueError("vary = \"suffix\" needs prefix_tokens (the cached prefix, e.g. 16384)")
        if self.vary != "suffix" and (self.prefix_tokens is not None or self.prefix_request):
            raise ValueError("prefix_tokens and prefix_request apply only with vary = \"suffix\"")
        for a, b in self.crossovers:
            if a == b:
                raise ValueError(f"crossovers: [{a!r}, {b!r}] pairs an arm with itself")
        return self
