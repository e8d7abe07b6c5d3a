"""Engine wire-format adapters: how one engine's completion endpoint is asked and how its stream is read.

Contract
--------
An :class:`Adapter` owns one wire format, and nothing about transport, timing or verification (those are
:class:`abbench.client.EngineClient`'s): it builds the request (``completion_path`` and the JSON body, the
RequestSpec's fields in the engine's own names plus the profile's and arm's extra fields, with the fields
the protocol depends on protected), says whether a decoded event carries text (``has_text``, cheap: it runs
on every event until the first text), and turns one decoded event into :class:`EventParts` (text, ids,
finish reason in OpenAI's words, usage, logprobs best first, the engine's own object). It also names the
engine's default health, cache-reset and metrics paths (its class attributes; :data:`ADAPTER_PATHS` collects
the reset and metrics defaults, which the profile fills in when it leaves them out), its done marker, and the
Prometheus counters behind the report's common keys (:func:`engine_counters`). The request's fields come from
any object with :class:`RequestParams`'s attributes (the profile's ``RequestSpec`` is one), so this module
imports nothing of the profile.

Adapters are registered in :data:`ADAPTERS` under the ``EngineSpec.adapter`` name and looked up with
:func:`get_adapter`. The documented wire formats each one follows (its docstring cites them in full):

* ``openai`` (:class:`OpenAIAdapter`): the vendored engine and any server with OpenAI's
  ``/v1/completions`` streamed ``text_completion`` chunks (native ids in ``choices[].token_ids``, logprobs
  with ids in ``top_logprob_ids``);
* ``vllm`` (:class:`VLLMAdapter`): the same with vLLM's ``return_token_ids``/``return_tokens_as_token_ids``
  switched on; follows vllm ``vllm/entrypoints/openai/completion/serving.py``,
  ``vllm/entrypoints/serve/cache/api_router.py`` and docs.vllm.ai "OpenAI-Compatible Server" and "Metrics";
* ``sglang`` (:class:`SGLangAdapter`): SGLang's native ``/generate`` (cumulative events:
  ``EventParts.cumulative``); follows sglang ``docs/sampling_params.md``,
  ``python/sglang/srt/entrypoints/http_server.py`` and the tokenizer manager's output handler;
* ``llamacpp`` (:class:`LlamaCppAdapter`): llama.cpp's native ``/completion`` (no done marker: its last
  event says ``stop: true``); follows llama.cpp ``tools/server/README.md``,
  ``tools/server/server-task.cpp`` and ``server-context.cpp``.

Logprobs are kept only with token ids (the vendored engine's ``top_logprob_ids``, vLLM's ``token_id:N``
keys, SGLang's ``[logprob, id, text]`` and llama.cpp's ``{"id", "logprob"}`` entries), best first.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar, Literal, Protocol

from abbench.errors import ConfigError, RequestError
from abbench.prometheus import ENGINE_COUNTERS, Counters, common_counters

__all__ = ["ADAPTERS", "ADAPTER_PATHS", "Adapter", "AdapterName", "EventParts", "LlamaCppAdapter", "OpenAIAdapter",
           "RequestParams", "SGLangAdapter", "VLLMAdapter", "engine_counters", "get_adapter"]

TopLogprobs = list[tuple[int, float]]
Prompt = str | list[int]  # text, or token ids (an engine that takes them: all four adapters' engines do)
AdapterName = Literal["openai", "vllm", "sglang", "llamacpp"]
"""The names :data:`ADAPTERS` registers (``EngineSpec.adapter``/``ArmSpec.adapter`` take one)."""


class RequestParams(Protocol):
    """The request fields an adapter sends (``abbench.profile.RequestSpec`` has them)."""

    max_tokens: int
    temperature: float
    ignore_eos: bool
    logprobs: int | None
    stream: bool
    extra: dict[str, Any]


@dataclass(slots=True)
class EventParts:
    """What one stream event (or a whole non-streamed body) says. ``None`` = the event did not say it."""

    text: str = ""
    token_ids: list[int] | None = None  # None: no ids field at all (not "zero ids")
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    logprobs: list[TopLogprobs] | None = None  # per output position, best first
    engine: dict[str, Any] | None = None  # the engine's own per-request object
    final: bool = False  # this event ends the stream (for formats without a done marker)
    cumulative: bool = False  # text, token_ids and logprobs are the whole output so far, not an addition


class Adapter:
    """One wire format. Subclass it, set the class attributes, implement the three methods, and add an
    instance to :data:`ADAPTERS` under the ``EngineSpec.adapter`` name. ``build_body`` sends the
    RequestSpec's fields in the engine's own names (``merge_extra`` adds the profile's and arm's fields);
    ``has_text`` runs on each event as it arrives until the first text (keep it cheap); ``parse_event`` runs
    after the stream, reports ``finish_reason`` in OpenAI's words (``length``/``stop``), and may raise
    ``RequestError`` or let ``KeyError``/``TypeError``/``ValueError`` escape (reported as ``protocol``). A
    format whose stream has no done marker sets ``done_marker = None`` and marks its last event ``final``
    (the client then refuses any event after it); a format whose events repeat the whole output so far sets
    ``EventParts.cumulative``.

    ``reset_path``/``metrics_path`` are the engine's own defaults ("" = none; collected in
    :data:`ADAPTER_PATHS`, which the profile fills in when it leaves them out). ``counters`` names the engine's Prometheus
    counters behind the report's common keys (``prompt_tokens``: prompt tokens the engine processed or
    looked up; ``cached_prompt_tokens``: prompt tokens served from its prefix cache); the per-request
    ``engine`` dict uses the keys ``cached_prompt_tokens`` and ``engine_prompt_tokens`` where the engine
    reports them."""

    name: ClassVar[str] = ""
    completion_path: ClassVar[str] = "/v1/completions"
    health_path: ClassVar[str] = "/health"
    reset_path: ClassVar[str] = "/reset"  # the vendored engine's
    metrics_path: ClassVar[str] = "/metrics"
    done_marker: ClassVar[str | None] = "[DONE]"  # data payload ending the stream; None: see EventParts.final
    protected_fields: ClassVar[frozenset[str]] = frozenset({"prompt", "stream", "stream_options"})
    counters: ClassVar[Counters] = MappingProxyType({})
    # the server's stream may leave out ids that its usage counts; the client then asks again, not streamed,
    # for the ids alone (see EngineClient.complete)
    refetch_short_stream_ids: ClassVar[bool] = False
    # the server closes the connection after every streamed response, without saying so (no "Connection:
    # close"): the client then asks for the close itself, so that it never sends the next request on it
    closes_after_stream: ClassVar[bool] = False
    # what to do when the server refuses its reset or metrics path (HTTP status -> the remedy), said by the
    # start-up probe of every service (abbench.runner.slot.probe_control_paths)
    reset_hints: ClassVar[Mapping[int, str]] = MappingProxyType({})
    metrics_hints: ClassVar[Mapping[int, str]] = MappingProxyType({})

    def build_body(
        self, prompt: Prompt, *, request: RequestParams, extra: Mapping[str, Any], model: str | None
    ) -> dict[str, Any]:
        raise NotImplementedError

    def ignore_eos_sent(self, body: Mapping[str, Any]) -> bool:
        """Whether the body built by :meth:`build_body` asks the engine to ignore EOS (the finish reason is
        judged by what was sent, arm overrides included)."""
        return bool(body.get("ignore_eos", False))

    def has_text(self, event: Any) -> bool:
        raise NotImplementedError

    def parse_event(self, event: Any) -> EventParts:
        raise NotImplementedError

    def merge_extra(self, body: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
        """Add profile/arm request fields to ``body``; fields the protocol depends on cannot be overridden."""
        clash = sorted(set(extra) & self.protected_fields)
        if clash:
            raise ConfigError(
                f"request field(s) {', '.join(clash)} cannot be set through request.extra or an arm's request: "
                "the client sets them itself"
            )
        body.update(extra)
        return body


@dataclass(frozen=True)
class OpenAIAdapter(Adapter):
    """``POST /v1/completions`` with OpenAI's streamed ``text_completion`` chunks.

    Native ids are read from ``choices[0].token_ids`` (the vendored engine always sends them; vLLM does when
    the request has ``return_token_ids: true``, which ``return_token_ids=True`` adds). Logprobs with ids come
    from ``top_logprob_ids`` ([[id, logprob], ...] per position, in ``logprobs`` or in the choice), or, with
    ``tokens_as_ids=True`` (vLLM's ``return_tokens_as_token_ids``), from ``top_logprobs`` keys
    ``"token_id:N"``. The engine's own object is the event's top-level ``abbench`` field."""

    name: ClassVar[str] = "openai"
    counters: ClassVar[Counters] = ENGINE_COUNTERS["openai"]
    reset_hints: ClassVar[Mapping[int, str]] = MappingProxyType({
        404: "the server has no such route (the vendored engine serves POST /reset); for a server without a "
             "prefix cache to flush, set reset_path = \"\"",
        405: "the route does not take POST; for a server without a prefix cache to flush, set reset_path = \"\"",
    })
    return_token_ids: bool = False
    tokens_as_ids: bool = False

    def build_body(
        self, prompt: Prompt, *, request: RequestParams, extra: Mapping[str, Any], model: str | None
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "prompt": prompt,
            "max_tokens": request.max_tokens,
            "temperature": request.temperature,
            "ignore_eos": request.ignore_eos,
            "stream": request.stream,
        }
        if request.stream:
            body["stream_options"] = {"include_usage": True}
        if request.logprobs is not None:
            body["logprobs"] = request.logprobs
        if getattr(request, "full_logprobs", False):  # the vendored engine's / reference's whole first row
            body["full_logprobs"] = True
        if model is not None:
            body["model"] = model
        if self.return_token_ids:
            body["return_token_ids"] = True
        if self.tokens_as_ids:
            body["return_tokens_as_token_ids"] = True
        return self.merge_extra(body, {**request.extra, **extra})

    def has_text(self, event: Any) -> bool:
        choices = event.get("choices") if isinstance(event, dict) else None
        if not choices:
            return False
        for c in choices:
            if isinstance(c, dict) and c.get("text"):
                return True
        return False

    def parse_event(self, event: Any) -> EventParts:
        if not isinstance(event, dict):
            raise TypeError(f"an event is a JSON object, got {type(event).__name__}")
        error = event.get("error")
        if error is not None:
            raise _error_event(error)
        parts = EventParts(usage=event.get("usage"), engine=event.get("abbench"))
        choices = event.get("choices") or []
        if len(choices) > 1 or any(c.get("index", 0) != 0 for c in choices):
            raise ValueError(f"expected one choice with index 0, got {len(choices)}")
        if not choices:
            return parts
        c = choices[0]
        parts.text = c.get("text") or ""
        parts.finish_reason = c.get("finish_reason")
        ids = c.get("token_ids")
        if ids is not None:
            parts.token_ids = [int(i) for i in ids]
        parts.logprobs = self._logprobs(c)
        return parts

    def _logprobs(self, choice: dict[str, Any]) -> list[TopLogprobs] | None:
        lp = choice.get("logprobs")
        by_id = choice.get("top_logprob_ids")
        if by_id is None and isinstance(lp, dict):
            by_id = lp.get("top_logprob_ids")
        if by_id is not None:
            return [_best_first((int(i), v) for i, v in pos) for pos in by_id]
        if self.tokens_as_ids and isinstance(lp, dict) and lp.get("top_logprobs") is not None:
            return [
                _best_first((int(k.removeprefix("token_id:")), v) for k, v in (pos or {}).items())
                for pos in lp["top_logprobs"]
            ]
        return None


def _best_first(pairs: Any) -> TopLogprobs:
    """(id, logprob) pairs sorted best first; a null logprob (the engines send -inf as null) is dropped."""
    return sorted(((i, float(v)) for i, v in pairs if v is not None), key=lambda p: -p[1])


def _error_event(error: Any) -> RequestError:
    status = None
    message = error
    if isinstance(error, dict):
        message = error.get("message", error)
        code = error.get("code")
        status = code if isinstance(code, int) else None
    return RequestError("http", f"the server reported an error inside the stream: {message}", status=status)


@dataclass(frozen=True)
class VLLMAdapter(OpenAIAdapter):
    """vLLM's OpenAI server, ``POST /v1/completions``.

    Followed: vllm ``vllm/entrypoints/openai/completion/serving.py`` (``completion_stream_generator``,
    ``_create_completion_logprobs``) and ``vllm/entrypoints/serve/cache/api_router.py``
    (``reset_prefix_cache``); docs.vllm.ai "OpenAI-Compatible Server" (extra parameters) and "Metrics".

    * ``return_token_ids: true`` makes every streamed choice carry ``token_ids`` (this chunk's output ids;
      the first chunk also ``prompt_token_ids``), so ids are native; ``ignore_eos`` is one of vLLM's extra
      sampling parameters; ``stream_options.include_usage`` adds a last ``choices: []`` chunk with
      ``usage`` before ``data: [DONE]``; an error after the stream started is ``data: {"error": ...}``.
    * ``logprobs: k`` with ``return_tokens_as_token_ids: true`` keys each position's ``top_logprobs`` by
      ``"token_id:N"`` (k+1 entries: the top k and the sampled token), so candidates are ids, not texts.
    * ``usage.prompt_tokens_details.cached_tokens`` (prefix-cache hits of this request) is sent only when
      the server runs with ``--enable-prompt-tokens-details``; it becomes ``engine.cached_prompt_tokens``.
    * Reset: ``POST /reset_prefix_cache``, served only with ``VLLM_SERVER_DEV_MODE=1`` in the server's
      environment. Metrics (``/metrics``, always on): ``vllm:prompt_tokens_total``,
      ``vllm:prefix_cache_queries_total``/``vllm:prefix_cache_hits_total`` (V1 engine; tokens), or
      ``vllm:gpu_prefix_cache_*`` in releases before them.
    """

    name: ClassVar[str] = "vllm"
    reset_path: ClassVar[str] = "/reset_prefix_cache"  # needs VLLM_SERVER_DEV_MODE=1
    metrics_path: ClassVar[str] = "/metrics"
    counters: ClassVar[Counters] = ENGINE_COUNTERS["vllm"]
    reset_hints: ClassVar[Mapping[int, str]] = MappingProxyType({
        404: "vLLM serves POST /reset_prefix_cache only in development mode: start it with "
             "VLLM_SERVER_DEV_MODE=1 in its environment (in the profile: env = { VLLM_SERVER_DEV_MODE = \"1\" } "
             "under [engine] or the arm)",
    })
    return_token_ids: bool = True
    tokens_as_ids: bool = True

    def parse_event(self, event: Any) -> EventParts:
        parts = super().parse_event(event)
        usage = parts.usage
        if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
            engine: dict[str, Any] = {"engine_prompt_tokens": usage["prompt_tokens"]}
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                engine["cached_prompt_tokens"] = details["cached_tokens"]
            parts.engine = {**(parts.engine or {}), **engine}
        return parts


@dataclass(frozen=True)
class SGLangAdapter(Adapter):
    """SGLang's native ``POST /generate``.

    Followed: sglang ``docs/sampling_params.md`` (the ``/generate`` arguments and streaming example) and
    ``python/sglang/srt/entrypoints/http_server.py`` (``generate_request``: each output is one
    ``data: {...}`` event, an error is ``data: {"error": {"message"}}``, the stream ends with
    ``data: [DONE]``; ``flush_cache``: ``GET``/``POST /flush_cache``, 400 while requests run), and the
    tokenizer manager's output handler (``meta_info``: ``prompt_tokens``, ``completion_tokens``,
    ``cached_tokens``, ``finish_reason`` as ``{"type": "length"|"stop"|"abort", ...}``,
    ``output_token_logprobs``/``output_top_logprobs`` as ``[logprob, token_id, text]``).

    Request: ``{"text" (or "input_ids" for an id prompt), "sampling_params": {"temperature",
    "max_new_tokens", "ignore_eos"}, "stream": true}`` plus ``"return_logprob": true, "top_logprobs_num": k``
    when logprobs are asked for. A profile's or arm's ``sampling_params`` table is merged into the sampling
    parameters; its other fields go to the top level.

    Streams are **cumulative** by default: every event repeats the whole text, ``output_ids`` and logprobs
    so far (``--incremental-streaming-output`` makes them deltas). The adapter tells the two apart per event
    (cumulative when ``len(output_ids) == meta_info.completion_tokens``; with ``incremental`` set, it is not
    guessed) and marks cumulative events, so the client keeps the last one instead of concatenating.
    ``has_text`` needs no delta: the first event whose cumulative text is non-empty is the first with new
    text. Engine extras: ``cached_prompt_tokens`` (``meta_info.cached_tokens``), ``engine_prompt_tokens``,
    and the rest of the last ``meta_info`` (logprob arrays left out) under ``sglang``.

    Metrics need ``--enable-metrics``: ``sglang:prompt_tokens_total``, ``sglang:cached_tokens_total``."""

    name: ClassVar[str] = "sglang"
    completion_path: ClassVar[str] = "/generate"
    reset_path: ClassVar[str] = "/flush_cache"
    metrics_path: ClassVar[str] = "/metrics"  # needs --enable-metrics
    protected_fields: ClassVar[frozenset[str]] = frozenset({"text", "input_ids", "stream"})
    counters: ClassVar[Counters] = ENGINE_COUNTERS["sglang"]
    reset_hints: ClassVar[Mapping[int, str]] = MappingProxyType({
        404: "SGLang's own HTTP server serves /flush_cache; is base_url a router or proxy in front of it?",
        400: "SGLang refuses /flush_cache while requests are running: is another client using this server?",
    })
    metrics_hints: ClassVar[Mapping[int, str]] = MappingProxyType({
        404: "SGLang serves /metrics only when started with --enable-metrics",
    })
    incremental: bool | None = None  # None: detect per event; True/False: the server's streaming mode

    def build_body(
        self, prompt: Prompt, *, request: RequestParams, extra: Mapping[str, Any], model: str | None
    ) -> dict[str, Any]:
        sampling: dict[str, Any] = {
            "temperature": request.temperature,
            "max_new_tokens": request.max_tokens,
            "ignore_eos": request.ignore_eos,
        }
        body: dict[str, Any] = {"input_ids" if isinstance(prompt, list) else "text": prompt,
                                "sampling_params": sampling, "stream": request.stream}
        if request.logprobs is not None:
            body["return_logprob"] = True
            body["top_logprobs_num"] = request.logprobs
        merged = {**request.extra, **extra}
        merged.pop("sampling_params", None)
        for fields in (request.extra, extra):  # the profile's sampling parameters, then the arm's
            more = fields.get("sampling_params")
            if more is not None:
                if not isinstance(more, Mapping):
                    raise ConfigError("request field sampling_params must be a table (SGLang's sampling parameters)")
                sampling.update(more)
        return self.merge_extra(body, merged)

    def ignore_eos_sent(self, body: Mapping[str, Any]) -> bool:
        return bool((body.get("sampling_params") or {}).get("ignore_eos", False))

    def has_text(self, event: Any) -> bool:
        return isinstance(event, dict) and bool(event.get("text"))

    def parse_event(self, event: Any) -> EventParts:
        if not isinstance(event, dict):
            raise TypeError(f"an event is a JSON object, got {type(event).__name__}")
        if event.get("error") is not None:
            raise _error_event(event["error"])
        meta = event["meta_info"]
        if not isinstance(meta, dict):
            raise TypeError("meta_info is not an object")
        ids = event.get("output_ids")
        completion = meta.get("completion_tokens")
        if self.incremental is not None:
            cumulative = not self.incremental
        elif ids is not None and isinstance(completion, int):
            cumulative = len(ids) == completion
        else:
            cumulative = True  # SGLang's default streaming mode
        parts = EventParts(text=event.get("text") or "", cumulative=cumulative)
        if ids is not None:
            parts.token_ids = [int(i) for i in ids]
        prompt_tokens = meta.get("prompt_tokens")
        if isinstance(prompt_tokens, int) and isinstance(completion, int):
            parts.usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion}
        parts.finish_reason = self._finish_reason(meta.get("finish_reason"))
        parts.logprobs = self._logprobs(meta)
        if parts.finish_reason is not None:
            parts.engine = {
                "engine_prompt_tokens": prompt_tokens,
                "cached_prompt_tokens": meta.get("cached_tokens"),
                "sglang": {k: v for k, v in meta.items()
                           if not k.startswith(("input_", "output_")) and k not in ("hidden_states", "routed_experts")},
            }
        return parts

    @staticmethod
    def _finish_reason(reason: Any) -> str | None:
        if reason is None:
            return None
        if isinstance(reason, str):
            return reason
        kind = reason.get("type")
        if kind == "abort":
            code = reason.get("status_code")
            raise RequestError("http", f"the server aborted the request: {reason.get('message', reason)}",
                               status=code if isinstance(code, int) else None)
        return "length" if kind == "length" else "stop" if kind == "stop" else str(kind)

    @staticmethod
    def _logprobs(meta: dict[str, Any]) -> list[TopLogprobs] | None:
        top = meta.get("output_top_logprobs")
        chosen = meta.get("output_token_logprobs")
        if top is None and chosen is None:
            return None
        n = len(top) if top is not None else len(chosen)
        out: list[TopLogprobs] = []
        for j in range(n):
            pos = top[j] if top is not None else None
            if not pos and chosen is not None and j < len(chosen) and chosen[j] is not None:
                pos = [chosen[j]]
            out.append(_best_first((int(e[1]), e[0]) for e in (pos or [])))
        return out


@dataclass(frozen=True)
class LlamaCppAdapter(Adapter):
    """llama.cpp's server, native ``POST /completion`` (not its OpenAI ``/v1/completions``).

    Followed: llama.cpp ``tools/server/README.md`` ("POST /completion", "GET /metrics",
    "POST /slots/{id_slot}?action=erase") and ``tools/server/server-task.cpp``
    (``server_task_result_cmpl_partial::to_json_non_oaicompat``, ``..._final::to_json_non_oaicompat``,
    ``completion_token_output::probs_vector_to_json``) with ``server-context.cpp`` (the stream handler writes
    no ``[DONE]`` for the native endpoint; an error is ``data: {"error": {...}}``).

    Request: ``{"prompt" (text or token ids), "n_predict", "temperature", "ignore_eos", "stream": true,
    "return_tokens": true}`` plus ``"n_probs": max(k, 1)`` when logprobs are asked for.

    Stream: one event per token, ``{"content" (this token's text, possibly "" while a UTF-8 character is
    incomplete), "tokens": [id], "stop": false, "completion_probabilities": [{"id", "logprob",
    "top_logprobs": [{"id", "logprob"}, ...]}]}``, then a final event with ``"stop": true`` (its ``content``
    and ``tokens`` are empty when streaming), ``stop_type`` (``limit`` -> "length"; ``eos``/``word`` ->
    "stop"; older servers: ``stopped_limit``/``stopped_eos``/``stopped_word``), ``tokens_evaluated``
    (prompt tokens) and ``tokens_predicted``, ``timings`` (``cache_n``: prompt tokens reused from the
    cache, ``prompt_n``, ``prompt_ms``, ``predicted_ms``...). There is no done marker: ``done_marker`` is
    None and that final event is marked ``final``. Usage is read from it. With ``post_sampling_probs``
    the server sends ``prob``/``top_probs`` instead; they are turned into logprobs.

    Mid-character tokens (seen against a real llama-server, commit 0c1e570): while the generated text ends
    inside a UTF-8 character the server sends no event, and the event that completes the character lists
    only its own token, so a stream carries fewer ids than ``tokens_predicted``. Not streamed, the final
    body's ``tokens`` has every id but ``completion_probabilities`` leaves those positions out: the ids are
    kept and the logprobs dropped (they cannot be aligned). A short stream is therefore completed by one more
    request, not streamed, from the prompt the server has just cached (``refetch_short_stream_ids``; see
    ``EngineClient.complete``): its ids replace the stream's only if they contain every streamed id in order
    and give the same text and count; TTFT and total time stay the stream's.

    Cold samples: the default reset is ``POST /slots/0?action=erase`` (slot 0's KV cache). The server
    serves slot actions only with ``--slot-save-path DIR`` (even erase), the erase covers every slot only
    with ``-np 1``, and ``--cache-ram 0`` keeps it from restoring the prompt from its host-memory prompt
    cache. The alternative, ``cache_prompt: false``, would also stop continuations from reusing the cold
    prompt, which the pairs exist to measure, so it is not used. Metrics need ``--metrics``:
    ``llamacpp:prompt_tokens_total`` counts prompt tokens actually processed (cache hits excluded).

    Connections (0c1e570's ``server-http.cpp`` with its vendored cpp-httplib): the stream's content provider
    returns false on its last call, right after ``sink.done()``, which cpp-httplib's
    ``write_content_chunked`` takes for a cancelled write, so the server closes the connection after every
    streamed response, once the completion callback has run, with the response complete and no
    ``Connection: close`` header. A request the client sends on that connection meanwhile is dropped
    unanswered ("Server disconnected without sending a response": one request per H200 run). So a streamed
    completion asks for ``Connection: close`` itself (``closes_after_stream``) and the next request opens a
    new connection; the completion itself goes on the connection its reset or metrics scrape just used (the
    runner sends both by default), so no connect falls inside TTFT."""

    name: ClassVar[str] = "llamacpp"
    completion_path: ClassVar[str] = "/completion"
    reset_path: ClassVar[str] = "/slots/0?action=erase"  # erase slot 0's KV: needs --slot-save-path and -np 1
    metrics_path: ClassVar[str] = "/metrics"  # needs --metrics
    done_marker: ClassVar[str | None] = None
    protected_fields: ClassVar[frozenset[str]] = frozenset({"prompt", "stream"})
    counters: ClassVar[Counters] = ENGINE_COUNTERS["llamacpp"]
    refetch_short_stream_ids: ClassVar[bool] = True
    closes_after_stream: ClassVar[bool] = True
    reset_hints: ClassVar[Mapping[int, str]] = MappingProxyType({
        501: "llama-server serves slot actions, erase included, only when started with --slot-save-path DIR "
             "(run it with -np 1 and --cache-ram 0 too: see this adapter's docstring)",
        400: "llama-server has no such slot: the erase names slot 0 (start it with -np 1)",
    })
    metrics_hints: ClassVar[Mapping[int, str]] = MappingProxyType({
        501: "llama-server serves /metrics only when started with --metrics",
    })

    def build_body(
        self, prompt: Prompt, *, request: RequestParams, extra: Mapping[str, Any], model: str | None
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "prompt": prompt,
            "n_predict": request.max_tokens,
            "temperature": request.temperature,
            "ignore_eos": request.ignore_eos,
            "stream": request.stream,
            "return_tokens": True,
        }
        if request.logprobs is not None:
            body["n_probs"] = max(request.logprobs, 1)
        if model is not None:
            body["model"] = model  # used by the server's router mode only
        return self.merge_extra(body, {**request.extra, **extra})

    def has_text(self, event: Any) -> bool:
        return isinstance(event, dict) and bool(event.get("content"))

    def parse_event(self, event: Any) -> EventParts:
        if not isinstance(event, dict):
            raise TypeError(f"an event is a JSON object, got {type(event).__name__}")
        if event.get("error") is not None:
            raise _error_event(event["error"])
        parts = EventParts(text=event.get("content") or "")
        tokens = event.get("tokens")
        if tokens is not None:
            parts.token_ids = [int(i) for i in tokens]
        probs = event.get("completion_probabilities")
        if probs is not None:
            parts.logprobs = [self._position(p) for p in probs]
            if tokens is not None and len(probs) < len(tokens):
                # Non-streamed: the server leaves out the probabilities of tokens whose text ended inside a
                # UTF-8 character (server-context.cpp process_token: slot.add_token is skipped while the text
                # is incomplete), while `tokens` holds every id. The ids stay; the logprobs cannot be placed.
                parts.logprobs = None
        if event.get("stop") is True:
            parts.final = True
            parts.finish_reason = self._finish_reason(event)
            evaluated, predicted = event.get("tokens_evaluated"), event.get("tokens_predicted")
            if isinstance(evaluated, int) and isinstance(predicted, int):
                parts.usage = {"prompt_tokens": evaluated, "completion_tokens": predicted}
            timings = event.get("timings") if isinstance(event.get("timings"), dict) else {}
            parts.engine = {
                "engine_prompt_tokens": evaluated,
                "cached_prompt_tokens": timings.get("cache_n"),
                "llamacpp": {k: event.get(k) for k in ("stop_type", "stopping_word", "tokens_cached", "truncated",
                                                       "id_slot", "timings") if k in event},
            }
        return parts

    @staticmethod
    def _finish_reason(event: dict[str, Any]) -> str | None:
        kind = event.get("stop_type")
        if kind is None:  # servers before stop_type (late 2024)
            kind = ("limit" if event.get("stopped_limit") else "eos" if event.get("stopped_eos")
                    else "word" if event.get("stopped_word") else None)
        return {"limit": "length", "eos": "stop", "word": "stop"}.get(kind) if kind else None

    @staticmethod
    def _position(p: dict[str, Any]) -> TopLogprobs:
        if "top_logprobs" in p:
            return _best_first((int(c["id"]), c.get("logprob")) for c in p["top_logprobs"] or [])
        if "top_probs" in p:  # post_sampling_probs: probabilities
            return _best_first((int(c["id"]), math.log(c["prob"]) if c.get("prob") else None)
                               for c in p["top_probs"] or [])
        return []


ADAPTERS: Mapping[str, Adapter] = MappingProxyType(
    {
        "openai": OpenAIAdapter(),
        "vllm": VLLMAdapter(),
        "sglang": SGLangAdapter(),
        "llamacpp": LlamaCppAdapter(),
    }
)

ADAPTER_PATHS: Mapping[str, Mapping[str, str]] = MappingProxyType({
    name: MappingProxyType({"reset_path": a.reset_path, "metrics_path": a.metrics_path})
    for name, a in ADAPTERS.items()
})
"""Per adapter name, its engine's default ``reset_path`` and ``metrics_path`` ("" = none): what a profile's
``engine``, or an arm that names an adapter, gets when it leaves them out."""


def engine_counters(adapter: str | Adapter, metrics: Mapping[str, float] | None) -> dict[str, float]:
    """The adapter's common counters (``Adapter.counters``) read from parsed Prometheus text
    (:func:`abbench.prometheus.parse_prometheus`, or a :func:`~abbench.prometheus.metrics_delta`); see
    :func:`abbench.prometheus.common_counters`."""
    return common_counters(get_adapter(adapter).counters, metrics)


def get_adapter(name: str | Adapter) -> Adapter:
    """The adapter registered under ``name`` (``EngineSpec.adapter``); an instance is returned as is."""
    if isinstance(name, Adapter):
        return name
    try:
        return ADAPTERS[name]
    except KeyError:
        raise ConfigError(
            f"engine.adapter {name!r} has no client adapter yet; available: {', '.join(ADAPTERS)}"
        ) from None
