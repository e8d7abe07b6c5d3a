"""A finished response: the adapter's parsed events merged, then verified, into a :class:`Completion`.

:func:`finish` merges the :class:`~abbench.adapters.EventParts` of every event (:func:`merge_events`:
cumulative parts replace, incremental ones append; a format without a done marker ends at its final
event), then checks the result in the order of the error kinds' priority (:func:`verify`): ``no-done``,
``protocol`` (no usage), ``usage`` (prompt tokens differ from the built length), ``finish-reason``,
``protocol`` (ids against usage and logprobs, no text event). Ids are native when the engine sent them,
else retokenized with the caller's ``retokenize``, else ``none``. See :mod:`abbench.client` for the
meaning of each kind.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from abbench.adapters import Adapter, TopLogprobs
from abbench.errors import RequestError
from abbench.sse import SNIPPET

IdsSource = Literal["native", "retokenized", "none"]


class ShortIds(RequestError):
    """A stream carried fewer native ids than its usage counts (llama.cpp sends no id for a token whose text
    ends inside a UTF-8 character). Holds what the stream did carry, for a caller that can recover the rest."""

    def __init__(self, message: str, *, streamed_ids: list[int], text: str, completion_tokens: int,
                 finish_reason: str | None, engine: dict[str, Any] | None,
                 token_times: list[float] | None = None) -> None:
        super().__init__("protocol", message)
        self.streamed_ids, self.text, self.completion_tokens = streamed_ids, text, completion_tokens
        self.finish_reason, self.engine, self.token_times = finish_reason, engine, token_times


@dataclass(slots=True)
class Completion:
    """One complete, verified response: the fields a :class:`abbench.results.Sample` takes from it."""

    started_at: float  # time.time() just before the request
    ttft_s: float | None  # None only for a non-streamed request
    total_s: float
    output_ids: list[int]
    ids_source: IdsSource
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    saw_done: bool
    logprobs: list[TopLogprobs] | None
    engine: dict[str, Any] | None
    token_times_s: list[float] | None = None  # streamed: each output token's arrival (see merge_events)

    def sample_fields(self) -> dict[str, Any]:
        """The fields as keyword arguments for ``Sample(...)``."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclass(slots=True)
class RawResponse:
    """What the client read: the decoded events (one body for a non-streamed request) and its timing."""

    events: list[Any]
    ttft: float | None
    total: float
    saw_done: bool
    streamed: bool
    event_times: list[float] | None = None  # streamed: per event, when the chunk completing it arrived


@dataclass
class Merged:
    """The events' parts merged."""

    text: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    native: bool = False
    finish: str | None = None
    usage: dict[str, Any] | None = None
    logprobs: list[TopLogprobs] = field(default_factory=list)
    have_logprobs: bool = False
    engine: dict[str, Any] | None = None
    saw_done: bool = False
    times: list[float] = field(default_factory=list)
    """Per output token, the arrival of the event that carried it (one per event with text, without ids)."""


def _arrivals(m: Merged, p: Any, t: float, ids_before: int, text_before: int) -> None:
    """Add the arrival time ``t`` of event ``p`` (already merged) for each output token it added: one per new
    native id, else one when it added text (an engine that sends no ids: a chunk stands for its tokens)."""
    if p.token_ids is not None:
        m.times.extend([t] * max(0, len(m.ids) - ids_before))
    elif p.text and not m.native and (not p.cumulative or len(p.text) > text_before):
        m.times.append(t)


def merge_events(raw: RawResponse, ad: Adapter, what: str) -> Merged:
    """Parse every event with the adapter and merge the parts (``protocol``/``sse`` errors on bad events)."""
    m = Merged(saw_done=raw.saw_done)
    final_at: int | None = None  # the event that ended a stream without a done marker
    times = raw.event_times if raw.streamed else None
    for n, obj in enumerate(raw.events):
        if final_at is not None:
            raise RequestError(
                "sse", f"{what}: data after the final event (event {final_at}): {json.dumps(obj)[:SNIPPET]}"
            )
        try:
            p = ad.parse_event(obj)
        except RequestError as e:
            raise RequestError(e.kind, f"{what}: {e.detail}", status=e.status) from None
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise RequestError(
                "protocol", f"{what}: event {n} has an unexpected shape ({e}): {json.dumps(obj)[:SNIPPET]}"
            ) from None
        ids_before = len(m.ids) if not p.cumulative else len(m.times)
        text_before = len(m.text[0]) if p.cumulative and m.text else 0
        if p.cumulative:  # the whole output so far: replaces what earlier events said
            if p.text:
                m.text = [p.text]
            if p.token_ids is not None:
                m.native = True
                m.ids = list(p.token_ids)
            if p.logprobs is not None:
                m.have_logprobs = True
                m.logprobs = list(p.logprobs)
        else:
            if p.text:
                m.text.append(p.text)
            if p.token_ids is not None:
                m.native = True
                m.ids.extend(p.token_ids)
            if p.logprobs is not None:
                m.have_logprobs = True
                m.logprobs.extend(p.logprobs)
        if times is not None:
            _arrivals(m, p, times[n], ids_before, text_before)
        if p.finish_reason is not None:
            m.finish = p.finish_reason
        if p.usage is not None:
            m.usage = p.usage
        if p.engine is not None:
            m.engine = {**m.engine, **p.engine} if m.engine else dict(p.engine)
        if p.final and raw.streamed:  # a body is complete by itself: saw_done speaks of streams only
            m.saw_done = True
            final_at = n
    return m


def verify(m: Merged, raw: RawResponse, ad: Adapter, *, ignore_eos: bool, target_prompt_tokens: int,
           what: str) -> tuple[int, int]:
    """Check the merged response; returns (prompt_tokens, completion_tokens) from its usage."""
    if raw.streamed and not m.saw_done:
        end = "[DONE]" if ad.done_marker == "[DONE]" else (
            f"data: {ad.done_marker}" if ad.done_marker else "its final event")
        raise RequestError("no-done", f"{what}: the stream ended after {len(raw.events)} events without {end}")
    usage = m.usage
    if usage is None:
        raise RequestError("protocol", f"{what}: the response has no usage (stream_options.include_usage)")
    prompt_tokens = usage.get("prompt_tokens")
    completion_tokens = usage.get("completion_tokens")
    if not isinstance(prompt_tokens, int) or not isinstance(completion_tokens, int):
        raise RequestError("protocol", f"{what}: usage lacks integer prompt_tokens/completion_tokens: {usage}")
    if prompt_tokens != target_prompt_tokens:
        raise RequestError(
            "usage",
            f"{what}: the server counted usage.prompt_tokens={prompt_tokens}, the prompt was built to "
            f"{target_prompt_tokens} tokens (a tokenizer or chat-template mismatch?)",
        )
    finish = m.finish
    if ignore_eos:
        if finish != "length":
            raise RequestError(
                "finish-reason", f"{what}: finish_reason={finish!r} with ignore_eos set; expected 'length'"
            )
    elif finish not in ("length", "stop"):
        raise RequestError("finish-reason", f"{what}: finish_reason={finish!r}; expected 'length' or 'stop'")
    if m.native and raw.streamed and completion_tokens > len(m.ids):
        raise ShortIds(f"{what}: usage.completion_tokens={completion_tokens} but the stream carried {len(m.ids)} "
                       "token ids", streamed_ids=list(m.ids), text="".join(m.text),
                       completion_tokens=completion_tokens, finish_reason=m.finish, engine=m.engine,
                       token_times=_rounded(m.times) if raw.event_times is not None else None)
    if m.native and completion_tokens != len(m.ids):
        raise RequestError(
            "protocol",
            f"{what}: usage.completion_tokens={completion_tokens} but the stream carried {len(m.ids)} token ids",
        )
    if m.native and m.have_logprobs and len(m.logprobs) != len(m.ids):
        raise RequestError(
            "protocol", f"{what}: logprobs for {len(m.logprobs)} positions but {len(m.ids)} token ids"
        )
    if raw.streamed and raw.ttft is None:
        raise RequestError("protocol", f"{what}: no event carried text, so there is no time to first token")
    return prompt_tokens, completion_tokens


def finish(
    raw: RawResponse,
    ad: Adapter,
    ignore_eos: bool,
    started_at: float,
    target_prompt_tokens: int,
    retokenize: Callable[[str], list[int]] | None,
    what: str,
) -> Completion:
    """Merge the events' parts and check them; the order of the checks is the order of the kinds' priority."""
    m = merge_events(raw, ad, what)
    prompt_tokens, completion_tokens = verify(m, raw, ad, ignore_eos=ignore_eos,
                                              target_prompt_tokens=target_prompt_tokens, what=what)
    full_text = "".join(m.text)
    ids = m.ids
    source: IdsSource = "native"
    if not m.native:
        if retokenize is not None:
            ids, source = list(retokenize(full_text)), "retokenized"
        else:
            source = "none"
    assert m.finish is not None
    return Completion(
        started_at=started_at,
        ttft_s=raw.ttft,
        total_s=raw.total,
        output_ids=ids,
        ids_source=source,
        text=full_text,
        finish_reason=m.finish,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        saw_done=m.saw_done,
        logprobs=m.logprobs if m.have_logprobs and m.native else None,
        engine=m.engine,
        token_times_s=_rounded(m.times) if raw.streamed and raw.event_times is not None else None,
    )


def _rounded(times: list[float]) -> list[float]:
    """Microseconds: the clock's useful resolution here, and a compact run.json."""
    return [round(t, 6) for t in times]
