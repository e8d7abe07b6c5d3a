"""The records of load levels: what one level of one arm sent, when, and what came back.

Contract
--------
A :class:`LoadLevel` is one (arm, level, round) cell as it ran against one service: the level (``kind``
"concurrency" or "rate" and its ``value``; ``role`` "reference" for the parity reference, every prompt run
alone), the arrival process and seed, the measured window and one :class:`LoadRequest` per request sent,
finished, failed or refused, in the order they were planned. Nothing is dropped: a request that failed keeps
its error kind (:class:`abbench.errors.RequestError`'s ``kind``: ``http`` with ``status`` 429 for a refusal,
``connect``, ``timeout``, ``sse``, ``protocol``...) and the stamps it reached. ``RunRecord.load`` holds the
levels of a run (empty for runs without ``[load]``, so older runs read and report as before).

Clocks: every ``*_s`` stamp of a request is ``time.perf_counter`` seconds since the level's start
(``LoadLevel.started_at`` is that start on the wall clock), except ``token_times_s``, which counts from the
request's ``sent_s`` as :class:`abbench.results.Sample`'s does from its send. ``scheduled_s`` is when an
open-loop request was due (None in a closed loop); ``sent_s`` when the generator wrote it, so the lag of the
generator is ``sent_s - scheduled_s``, and a latency can be counted from either.

The measured window is ``[window_start_s, window_end_s]`` on the level's clock: from ``warmup_s`` after the
start to ``cooldown_s`` before the last send. Requests sent in it are measured; throughput counts what
arrived in it (:mod:`abbench.analysis.load`). Only raw observations are stored.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_serializer

from abbench.checkexpr import level_label

__all__ = ["LoadLevel", "LoadRequest", "LoadScrape"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LoadRequest(_Model):
    """One request of a load level (sent, or refused before an answer: it is counted either way)."""

    index: int = Field(description="Position in the level's plan (the order requests were due).")
    prompt_id: str = Field(description="The load prompt it sent (load-<i>: rebuilt from the profile's seed).")
    target_tokens: int = Field(description="Exact prompt length it was built to.")
    prompt_sha256: str | None = Field(None, description="sha256 of the prompt's UTF-8 text (a replay rebuilds the "
                                      "text from the profile's seed and checks it against this).")
    max_tokens: int = Field(description="Output tokens asked for (the output-length draw).")
    scheduled_s: float | None = Field(None, description="Open loop: when it was due (level clock); None closed.")
    sent_s: float = Field(description="When its bytes were written (level clock).")
    first_token_s: float | None = Field(None, description="Arrival of the first event with text (level clock).")
    end_s: float | None = Field(None, description="End of the response, or when it failed (level clock).")
    token_times_s: list[float] | None = Field(
        None, description="Each output token's arrival, seconds after sent_s (one per native id).")
    ok: bool
    error_kind: str | None = None
    error: str | None = None
    status: int | None = Field(None, description="HTTP status (429: refused by the server).")
    output_ids: list[int] = Field(default_factory=list)
    ids_source: Literal["native", "retokenized", "none"] = "none"
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    logprobs: list[list[tuple[int, float]]] | None = None
    engine: dict[str, Any] | None = Field(None, description="The engine's own per-request object, as it sent it.")

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.sent_s

    @property
    def e2e_s(self) -> float | None:
        return None if self.end_s is None or not self.ok else self.end_s - self.sent_s


class LoadScrape(_Model):
    """One scrape of the engine's metrics path during a level: the gauges it held (histograms left out)."""

    t: float = Field(description="Level clock when the scrape's answer arrived.")
    metrics: dict[str, float] = Field(default_factory=dict)


class LoadLevel(_Model):
    """One (arm, level, round) cell as it ran (module docstring)."""

    arm: str
    round: int
    position: int = Field(0, description="Index of the arm in this round's arm order at this level.")
    service: str = ""
    role: Literal["load", "reference"] = Field(
        "load", description="'reference': every prompt run alone (concurrency 1), the parity reference.")
    kind: Literal["concurrency", "rate"]
    value: float = Field(description="Requests in flight, or requests/s (inf: all at once).")
    arrival: Literal["poisson", "gamma"] | None = None
    burstiness: float | None = None
    seed: int = 0
    adapter: str = "openai"
    base_url: str = ""
    started_at: float = Field(description="Wall-clock time (unix seconds) of the level's start.")
    clock_s: float | None = Field(None, description="time.perf_counter() at the level's start: the level clock's "
                                  "origin, so stamps another process of this machine took compare with its own.")
    warmup_s: float = 0.0
    cooldown_s: float = 0.0
    window_start_s: float = Field(description="Measured window start (level clock).")
    window_end_s: float = Field(description="Measured window end (level clock).")
    elapsed_s: float = Field(description="From the start to the end of the last response.")
    requests: list[LoadRequest] = Field(default_factory=list)
    scrapes: list[LoadScrape] = Field(default_factory=list)
    scrape_error: str | None = Field(None, description="Why scraping stopped, when it failed.")
    stopped: str | None = Field(None, description="Why the level ended before its plan (interrupt, error).")

    @field_serializer("value")
    def _value_out(self, v: float) -> float | str:
        """inf as "inf": JSON has no infinity (pydantic reads "inf" back as a float)."""
        return "inf" if math.isinf(v) else v

    @property
    def label(self) -> str:
        """``c=16``, ``rate=8``, ``rate=inf`` (the checks' level selector)."""
        return level_label(self.kind, self.value)

    @property
    def window_s(self) -> float:
        return max(0.0, self.window_end_s - self.window_start_s)

    def summary(self) -> dict[str, Any]:
        """A short line's worth for logs: level, requests, ok, errors."""
        ok = sum(r.ok for r in self.requests)
        return {"arm": self.arm, "level": self.label, "round": self.round, "requests": len(self.requests), "ok": ok,
                "failed": len(self.requests) - ok}
