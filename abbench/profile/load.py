"""The ``[load]`` table: load levels (closed-loop concurrency, open-loop request rate), how requests arrive, the
prompt and output lengths they draw, the measured window, the SLOs of goodput and the parity reference.

A profile with ``[load]`` runs every (arm, level) as a cell; the arms run at each level in the rounds' ABBA
order (:mod:`abbench.loadgen` builds and drives a level; :mod:`abbench.analysis.load` measures it). Every
value is checked before any request: a level of 0, a negative rate, an unknown SLO metric, an empty
distribution are :class:`~abbench.errors.ConfigError` naming the field. :func:`parse_levels` reads the
command line's ``--concurrency 1,4,16`` / ``--rate 2,8,inf``.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, field_serializer, field_validator, model_validator

from abbench.checkexpr import parse_slo
from abbench.errors import ConfigError
from abbench.profile.specs import PositiveInt, _Model

__all__ = ["LengthDist", "LoadSpec", "parse_levels"]


class LengthDist(_Model):
    """A token-count distribution: exactly one of ``fixed``, ``uniform`` (both ends included) or ``values``
    (with optional ``weights``, default equal). Draws are seeded (``[load] seed``)."""

    fixed: PositiveInt | None = Field(None, description="Every request has this many tokens.")
    uniform: tuple[PositiveInt, PositiveInt] | None = Field(
        None, description="[low, high]: a whole number drawn uniformly between them, both included.")
    values: list[PositiveInt] | None = Field(None, description="Token counts to draw from (with weights).")
    weights: list[float] | None = Field(None, description="Relative weights of values (default: equal).")

    @model_validator(mode="after")
    def _one(self) -> LengthDist:
        given = [k for k in ("fixed", "uniform", "values") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of fixed = N, uniform = [LOW, HIGH] or values = [...] (with weights)"
                             + (f"; got {', '.join(given)}" if given else ""))
        if self.uniform is not None and self.uniform[0] > self.uniform[1]:
            raise ValueError(f"uniform = [{self.uniform[0]}, {self.uniform[1]}]: low is above high")
        if self.values is not None and not self.values:
            raise ValueError("values is empty")
        if self.weights is not None:
            if self.values is None or len(self.weights) != len(self.values):
                raise ValueError("weights needs values of the same length")
            if any(w < 0 or not math.isfinite(w) for w in self.weights) or sum(self.weights) <= 0:
                raise ValueError("weights must be finite, >= 0 and not all 0")
        return self

    @property
    def largest(self) -> int:
        if self.fixed is not None:
            return self.fixed
        if self.uniform is not None:
            return self.uniform[1]
        return max(self.values or [1])

    def describe(self) -> str:
        if self.fixed is not None:
            return f"{self.fixed}"
        if self.uniform is not None:
            return f"uniform {self.uniform[0]}-{self.uniform[1]}"
        w = self.weights or [1.0] * len(self.values or [])
        return ", ".join(f"{v} (w {x:g})" for v, x in zip(self.values or [], w))


class LoadSpec(_Model):
    """``[load]``: the levels, arrivals, lengths, windows, SLOs and parity reference of a load run."""

    concurrency: list[PositiveInt] = Field(
        default_factory=list, description="Closed-loop levels: N requests always in flight (e.g. [1, 4, 16]).")
    rate: list[float] = Field(
        default_factory=list, description="Open-loop levels: requests/s arriving on a seeded schedule, sent on time "
        "however slow the server is (e.g. [2, 8, inf]; inf: all at once).")
    arrival: Literal["poisson", "gamma"] = Field(
        "poisson", description="Open loop: the inter-arrival distribution (gamma with shape = burstiness, mean "
        "1/rate, as vLLM's --burstiness; poisson is gamma with burstiness 1).")
    burstiness: float = Field(1.0, gt=0, description="arrival = \"gamma\": below 1 burstier, above 1 more regular.")
    seed: int = Field(0, description="Seed of arrivals, prompt lengths, output lengths and the prompts' text.")
    requests: PositiveInt | None = Field(
        None, description="Requests sent per level (default 32 when duration_s is not set).")
    duration_s: float | None = Field(
        None, gt=0, description="Instead of requests: send for this long per level (then let in-flight ones end).")
    prompts: PositiveInt | None = Field(
        None, description="Distinct prompts; requests cycle through them (default: requests, or 64 with "
        "duration_s). Every level uses the same set, so each prompt's run alone is the parity reference of all.")
    warmup_s: float = Field(0.0, ge=0, description="Seconds from a level's start whose requests are sent but not "
                                                   "measured (excluded).")
    cooldown_s: float = Field(0.0, ge=0, description="Seconds before a level's last send whose requests, and after "
                                                     "which finishes, are not measured (excluded).")
    warmup_requests: int = Field(
        0, ge=0, description="Requests sent before each level (not before the parity reference), closed loop at "
        "the level's concurrency (a rate level: all at once), on warm-up prompts of the load's lengths that are "
        "none of the measured ones; never recorded; the engine's cache is reset after them. A launched service "
        "starts fresh at every change of arm, so each level otherwise meets a cold engine: its first prefill "
        "compiles kernels and captures graphs inside the measured window.")
    prompt_tokens: LengthDist = Field(
        default_factory=lambda: LengthDist(fixed=256), description="Prompt length distribution (exact lengths).")
    output_tokens: LengthDist | None = Field(
        None, description="Output length distribution (max_tokens per request, with ignore_eos); default: "
        "request.max_tokens for every request.")
    slo: list[str] = Field(
        default_factory=list, description="Goodput SLOs, each 'METRIC <= SECONDS' with METRIC one of ttft_s, "
        "tpot_s, itl_s (the request's longest gap), e2e_s, e.g. [\"ttft_s <= 2\", \"tpot_s <= 0.05\"].")
    parity_reference: bool = Field(
        True, description="Run every prompt alone (concurrency 1, same arm and service) as the reference its "
        "greedy ids under load are checked against.")
    scrape_interval_s: float = Field(
        1.0, gt=0, description="Seconds between scrapes of the engine's metrics path during a level.")

    @field_validator("concurrency")
    @classmethod
    def _levels(cls, v: list[int]) -> list[int]:
        if len(set(v)) != len(v):
            raise ValueError("concurrency levels must be distinct")
        return v

    @field_validator("rate", mode="before")
    @classmethod
    def _rates(cls, v: Any) -> Any:
        if not isinstance(v, list):
            return v
        out = []
        for x in v:
            r = float(x) if isinstance(x, (int, float, str)) and not isinstance(x, bool) else x
            if isinstance(r, float) and (math.isnan(r) or r <= 0):
                raise ValueError(f"rate {x!r}: a rate is requests/s above 0 (or inf for all at once); "
                                 "a rate of 0 would send nothing")
            out.append(r)
        if len(set(out)) != len(out):
            raise ValueError("rate levels must be distinct")
        return out

    @field_serializer("rate")
    def _rates_out(self, v: list[float]) -> list[float | str]:
        """inf as "inf": JSON has no infinity (the run records the profile as JSON; the validator reads it back)."""
        return ["inf" if math.isinf(x) else x for x in v]

    @field_validator("slo")
    @classmethod
    def _slo(cls, v: list[str]) -> list[str]:
        for e in v:
            try:
                parse_slo(e)
            except ConfigError as err:
                raise ValueError(str(err)) from None
        return v

    @model_validator(mode="after")
    def _shape(self) -> LoadSpec:
        if not self.concurrency and not self.rate:
            raise ValueError("give at least one level: concurrency = [1, 4, 16] and/or rate = [2, 8, inf]")
        if self.requests is not None and self.duration_s is not None:
            raise ValueError("give requests or duration_s per level, not both")
        if self.duration_s is not None and any(math.isinf(r) for r in self.rate):
            raise ValueError("rate = inf sends every request at once: give it requests, not duration_s")
        if self.arrival == "poisson" and self.burstiness != 1.0:
            raise ValueError("burstiness applies to arrival = \"gamma\" (poisson is burstiness 1)")
        return self

    @property
    def n_requests(self) -> int | None:
        """Requests per level (None: duration_s decides)."""
        if self.duration_s is not None:
            return self.requests
        return self.requests or 32

    @property
    def n_prompts(self) -> int:
        return self.prompts or self.n_requests or 64

    def levels(self) -> list[tuple[str, float]]:
        """Every level as (kind, value): ("concurrency", N) then ("rate", R), in profile order."""
        return [("concurrency", float(c)) for c in self.concurrency] + [("rate", float(r)) for r in self.rate]


def parse_levels(text: str, kind: Literal["concurrency", "rate"]) -> list[float]:
    """``--concurrency 1,4,16`` / ``--rate 2,8,inf``: the levels, or a :class:`ConfigError` naming the bad one."""
    flag = f"--{kind}"
    out: list[float] = []
    for part in (p.strip() for p in text.split(",")):
        try:
            v = float(part)
        except ValueError:
            raise ConfigError(f"{flag} {text}: {part!r} is not a number") from None
        if kind == "concurrency" and (not v.is_integer() or v < 1):
            raise ConfigError(f"{flag} {text}: {part} is not a concurrency (a whole number of requests in flight, "
                              ">= 1)")
        if kind == "rate" and not v > 0:
            raise ConfigError(f"{flag} {text}: {part} is not a rate (requests/s above 0, or inf)")
        out.append(v)
    return out
