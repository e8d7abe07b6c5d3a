"""OpenAI-compatible HTTP server for the vendored engine (FastAPI + uvicorn).

Contract
--------
``create_app(engine, tokenizer, ...)`` builds the ASGI app around an already-built
:class:`abbench.engine.runtime.Engine`; ``main(argv)`` parses the command line, builds the engine, binds
the socket and serves until SIGINT/SIGTERM (``python -m abbench.engine`` and ``abbench serve`` both end
here). The socket is bound before the engine is built (a busy port fails at once) but listens only after,
so "port accepts connections" means "ready"; one line ``abbench engine ready: http://HOST:PORT ...`` is
printed (and flushed) when it listens. ``--port 0`` picks a free port; the ready line names it.

Endpoints
* ``POST /v1/completions``: OpenAI text completions, streamed (SSE) or not, one prompt per request (text
  or token ids). Each response carries ``choices[0].token_ids`` (the native output ids, vLLM's field) and a
  top-level ``abbench`` object with the engine's per-request stats: prefill path and fallback reason,
  H2D/D2D bytes, expert copies, cached prompt tokens, chunks, windows, the measured H2D bandwidth, and
  ``timings`` in seconds relative to ``received`` (perf_counter when the handler started), plus
  ``queue_wait_s`` (seconds spent waiting for the engine). Streamed: one chunk per output token, then a
  chunk with ``finish_reason`` (and any text the detokenizer still held back), then (with
  ``stream_options.include_usage``) a ``choices: []`` chunk with ``usage``; the last chunk before
  ``data: [DONE]`` carries ``abbench``. Every event is written when it is produced. A stream's status
  line and headers go out together with the first token, so an error before it (context overflow, OOM)
  is a real HTTP status, as for a non-streamed request.
* ``POST /reset`` flushes the prefix cache and the decode slot cache. ``GET /health``, ``GET /v1/models``,
  ``GET /metrics`` (Prometheus text from a private registry).

Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: 400 for malformed JSON,
unknown fields, bad values and prompts over the context, 404 for another model name or route, 413 for a
body over the size cap, 429 when the wait queue is full, 503 when the device runs out of memory (the
engine stays usable). An error after a stream started is sent as a ``data: {"error": ...}`` event followed
by ``[DONE]``, as vLLM does. Nothing in a request names a file; the server reads none on its behalf.
Device OOM can be injected for tests with ``ABBENCH_ENGINE_FAULT=oom-once`` (see ``runtime``).

Scheduling: ONE request runs on the engine at a time, in a single worker thread. Others wait on an
``asyncio.Lock``, which is FIFO-fair (the first coroutine to wait is the first to proceed), so requests
run in arrival order. More than ``queue_limit`` waiting requests -> 429. The lock is held until the engine
generator has actually returned, not merely until the HTTP handler ends, so a cancelled request never
overlaps the next one.

Cancellation: while a request waits (in the queue or on the engine) the handler polls
``request.is_disconnected()`` every ``DISCONNECT_POLL_S``; a stream's generator also sets the cancel
event when Starlette cancels it. The engine checks the event every layer step and raises ``Cancelled``,
so a client that goes away stops its request within one layer step plus one poll interval.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import socket
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Literal

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, ValidationError, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from abbench.engine.config import DTYPES, PREFILL_MODES, PRESETS, EngineConfig
from abbench.engine.tokenizer import IncrementalDetokenizer, TokenizerSpecError, load_tokenizer

__all__ = ["CompletionRequest", "create_app", "build_arg_parser", "main"]

log = logging.getLogger("abbench.engine.server")

DISCONNECT_POLL_S = 0.02
MIN_TEMPERATURE = 1e-5  # below it (and above 0), logits / temperature overflows float32 to inf -> NaN probs
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024


# --------------------------------------------------------------------------------------------------
# Request schema
# --------------------------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = Field(False, description="Send a final chunk with choices [] and usage.")


class CompletionRequest(BaseModel):
    """``POST /v1/completions`` body. Unknown fields are refused; a few harmless OpenAI fields are
    accepted only at their neutral values (``n``=1, ``top_p``=1, ``stop`` null, ``echo`` false, ``user``)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="Must equal the served model name when given.")
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]] = Field(
        ..., description="Text, or token ids; a list holding one of either is accepted too (no batches)."
    )
    max_tokens: StrictInt | None = Field(16, gt=0, description="Output tokens to generate (null -> 16).")
    temperature: StrictFloat = Field(1.0, ge=0.0, allow_inf_nan=False,
                                     description="0 = greedy; >0 seeded sampling (OpenAI's default is 1). "
                                     f"Between 0 and {MIN_TEMPERATURE:g}: refused (logits / t overflow).")
    seed: StrictInt | None = Field(None, ge=-(2**63), le=2**64 - 1,
                                   description="Sampling seed, a 64-bit integer (only used when temperature > 0).")
    ignore_eos: StrictBool = Field(False, description="Keep generating past the EOS token.")
    stream: StrictBool = Field(False, description="Stream SSE chunks, one per output token.")
    stream_options: StreamOptions | None = Field(None, description="OpenAI stream options.")
    logprobs: StrictInt | None = Field(None, ge=0, le=20, description="Top-k logprobs per output token.")
    prefill_mode: Literal[PREFILL_MODES] | None = Field(  # type: ignore[valid-type]
        None, description="Per-request prefill mode; needs --allow-request-overrides."
    )
    # Accepted and ignored at their neutral values only.
    n: StrictInt | None = Field(None, description="Must be 1.")
    top_p: StrictFloat | None = Field(None, description="Must be 1.")
    stop: None = Field(None, description="Must be null.")
    echo: StrictBool | None = Field(None, description="Must be false.")
    user: str | None = Field(None, description="Ignored.")

    @field_validator("temperature")
    @classmethod
    def _temperature_not_tiny(cls, v: float) -> float:
        if 0.0 < v < MIN_TEMPERATURE:
            raise ValueError(f"must be 0 (greedy) or at least {MIN_TEMPERATURE:g} (got {v:g}: logits / temperature "
                             "would overflow)")
        return v

    @field_validator("n")
    @classmethod
    def _n_is_one(cls, v: int | None) -> int | None:
        if v not in (None, 1):
            raise ValueError("only n=1 is supported")
        return v

    @field_validator("top_p")
    @classmethod
    def _top_p_is_one(cls, v: float | None) -> float | None:
        if v not in (None, 1.0):
            raise ValueError("only top_p=1 is supported")
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("echo is not supported")
        return v

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request; raises APIError for batches and empty prompts."""
        p = self.prompt
        if isinstance(p, list) and p and not isinstance(p[0], int):
            if len(p) != 1:
                raise APIError(400, f"batched prompts are not supported (got {len(p)}); send one per request",
                               param="prompt")
            p = p[0]
        if len(p) == 0:
            raise APIError(400, "prompt is empty", param="prompt")
        return p


# --------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------

_ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
                413: "invalid_request_error", 429: "rate_limit_error", 499: "client_closed_request",
                500: "server_error", 503: "server_error"}


class APIError(Exception):
    """An error that becomes an OpenAI-shaped JSON response."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": _ERROR_TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


class ClientGone(Exception):
    """The client disconnected while its request waited."""


def _validation_error(exc: ValidationError) -> APIError:
    """The first problem of a request body, named by its field (``param``)."""
    first = exc.errors()[0]
    loc = [str(x) for x in first["loc"]]
    if first["type"] == "extra_forbidden":
        return APIError(400, f"unknown field '{'.'.join(loc)}'", param=".".join(loc), code="unknown_field")
    if loc and loc[0] == "prompt":  # a union: pydantic reports every alternative; say it plainly
        return APIError(400, "prompt must be a string, a list of token ids (integers), or a list holding "
                        "one of either", param="prompt", code="invalid_value")
    return APIError(400, f"{'.'.join(loc)}: {first['msg']}", param=".".join(loc) or None, code="invalid_value")


def _engine_error(exc: BaseException) -> APIError:
    """Map an exception raised by the engine (before the response started) to an APIError."""
    from abbench.engine.runtime import ContextOverflow

    import torch

    if isinstance(exc, ContextOverflow):
        return APIError(400, f"prompt does not fit the context: {exc}", param="prompt",
                        code="context_length_exceeded")
    if isinstance(exc, torch.OutOfMemoryError):
        return APIError(503, f"device out of memory while serving this request: {exc}", code="out_of_memory")
    if isinstance(exc, ValueError):
        return APIError(400, str(exc), code="invalid_value")
    log.exception("engine failed", exc_info=exc)
    return APIError(500, f"engine error: {type(exc).__name__}: {exc}", code="engine_error")


# --------------------------------------------------------------------------------------------------
# The engine service: one worker thread, a FIFO gate, per-request jobs
# --------------------------------------------------------------------------------------------------


@dataclass
class _Finished:
    stats: Any  # runtime.RequestStats
    finished: float  # perf_counter when the generator returned


class _ReceivedAt:
    """Pure ASGI middleware: stamps ``scope['abbench_received']`` (perf_counter) as the request reaches the
    application, before routing and body parsing, so the engine's timings start where the server got it."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            scope["abbench_received"] = time.perf_counter()
        await self.app(scope, receive, send)


class _Job:
    """One request on the engine: events flow worker thread -> ``queue``; ``cancel`` flows back."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.cancel = threading.Event()

    def put(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # event loop closed during shutdown: nobody is listening any more
            pass


class EngineService:
    """Owns the engine, its worker thread and the FIFO gate; all methods run on the event loop."""

    def __init__(self, engine: Any, *, queue_limit: int):
        self.engine = engine
        self.queue_limit = queue_limit
        self.waiting = 0
        self.running: _Job | None = None
        self._lock = asyncio.Lock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="abbench-engine")

    async def acquire(self, request: Request) -> None:
        """Wait for the engine in FIFO order; raises APIError(429) when the queue is full and
        ClientGone when the client disconnects while waiting."""
        if self._lock.locked() or self.waiting:
            if self.waiting >= self.queue_limit:
                raise APIError(429, f"too many waiting requests (queue limit {self.queue_limit})",
                               code="queue_full")
        self.waiting += 1
        acquiring = asyncio.ensure_future(self._lock.acquire())
        try:
            await _wait_unless_disconnected(acquiring, request)
        except BaseException:
            if not acquiring.done():
                acquiring.cancel()
            elif not acquiring.cancelled() and acquiring.exception() is None:
                self._lock.release()  # got the lock just as the client left: pass it on
            raise
        finally:
            self.waiting -= 1

    def start(self, gen_kwargs: dict[str, Any]) -> _Job:
        """Run one ``engine.generate`` in the worker thread (the caller holds the gate). The gate is
        released when the generator has returned or raised, whatever the HTTP side does."""
        job = _Job(asyncio.get_running_loop())
        self.running = job
        fut = job.loop.run_in_executor(self._executor, self._run, job, gen_kwargs)
        fut.add_done_callback(lambda _f: self._finish(job))
        return job

    def _finish(self, job: _Job) -> None:
        if self.running is job:
            self.running = None
        self._lock.release()

    def _run(self, job: _Job, gen_kwargs: dict[str, Any]) -> None:  # worker thread
        try:
            gen = self.engine.generate(cancel=job.cancel, **gen_kwargs)
            while True:
                try:
                    event = next(gen)
                except StopIteration as stop:
                    job.put(_Finished(stop.value, time.perf_counter()))
                    return
                job.put(event)
        except BaseException as exc:  # Cancelled, ContextOverflow, OOM, bugs: the consumer decides
            job.put(exc)

    async def run_exclusive(self, fn: Any) -> Any:
        """Run ``fn()`` in the worker thread under the gate (used by /reset)."""
        async with self._lock:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    def shutdown(self) -> None:
        if self.running is not None:
            self.running.cancel.set()
        self._executor.shutdown(wait=False, cancel_futures=True)


async def _wait_unless_disconnected(aw: asyncio.Future[Any], request: Request) -> Any:
    """Await ``aw`` while polling the client's connection; raises ClientGone when it goes away."""
    while True:
        done, _ = await asyncio.wait({aw}, timeout=DISCONNECT_POLL_S)
        if done:
            return aw.result()
        if await request.is_disconnected():
            raise ClientGone()


async def _next_item(job: _Job, request: Request) -> Any:
    """Next item from the worker; cancels the job if the client disconnects meanwhile (ClientGone)."""
    getter = asyncio.ensure_future(job.queue.get())
    try:
        return await _wait_unless_disconnected(getter, request)
    except BaseException:
        job.cancel.set()
        getter.cancel()
        raise


# --------------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------------


class _EngineCollector:
    """Reads the engine's lifetime counters and the service's queue at scrape time."""

    def __init__(self, service: EngineService):
        self.service = service

    def collect(self):  # noqa: ANN201 - prometheus_client collector protocol
        engine = self.service.engine
        counters = dict(engine.counters)
        yield CounterMetricFamily("abbench_engine_h2d_bytes", "Host-to-device bytes copied (lifetime).",
                                  value=counters.get("h2d_bytes_total", 0))
        yield CounterMetricFamily("abbench_engine_d2d_bytes", "Device-to-device bytes copied (lifetime).",
                                  value=counters.get("d2d_bytes_total", 0))
        for key, name, doc in (("requests_cancelled", "abbench_engine_requests_cancelled",
                                "Requests the engine stopped because the client went away."),
                               ("expert_copies_total", "abbench_engine_expert_copies",
                                "Experts copied to the device (lifetime).")):
            if key in counters:
                yield CounterMetricFamily(name, doc, value=counters[key])
        for key, name, doc in (("requests_by_path", "abbench_engine_requests", "Requests by prefill path."),
                               ("prefill_tokens_by_path", "abbench_engine_prefill_tokens",
                                "Prefilled prompt tokens by prefill path.")):
            family = CounterMetricFamily(name, doc, labels=["path"])
            for path, n in sorted(dict(counters.get(key, {})).items()):
                family.add_metric([str(path)], n)
            yield family
        yield GaugeMetricFamily("abbench_engine_h2d_bandwidth_bytes_per_second",
                                "Host-to-device bandwidth measured at startup.",
                                value=float(engine.measured_h2d_gbps) * 1e9)
        yield GaugeMetricFamily("abbench_engine_bank_bytes", "Bytes of one layer's expert bank x layers "
                                "(the whole offloaded bank).", value=engine.bank_bytes)
        yield GaugeMetricFamily("abbench_engine_startup_seconds", "Seconds the engine took to build.",
                                value=engine.startup_s)
        yield GaugeMetricFamily("abbench_engine_queue_waiting", "Requests waiting for the engine.",
                                value=self.service.waiting)
        yield GaugeMetricFamily("abbench_engine_requests_running", "Requests running on the engine (0/1).",
                                value=int(self.service.running is not None))


class Metrics:
    def __init__(self, service: EngineService):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineCollector(service))
        self.prompt_tokens = Counter("abbench_engine_prompt_tokens", "Prompt tokens of finished requests.",
                                     registry=self.registry)
        self.generation_tokens = Counter("abbench_engine_generation_tokens",
                                         "Output tokens of finished requests.", registry=self.registry)
        self.cached_prompt_tokens = Counter("abbench_engine_cached_prompt_tokens",
                                            "Prompt tokens served from the prefix cache.", registry=self.registry)
        self.outcomes = Counter("abbench_engine_request_outcomes", "Completion requests by outcome.",
                                ["outcome"], registry=self.registry)

    def observe(self, stats: Any) -> None:
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.generation_tokens.inc(stats.completion_tokens)
        self.cached_prompt_tokens.inc(stats.cached_prompt_tokens)


# --------------------------------------------------------------------------------------------------
# Response building
# --------------------------------------------------------------------------------------------------


@dataclass
class _Ctx:
    """What one completion request carries from parsing to its last byte."""

    rid: str
    created: int
    model: str
    received: float
    queue_wait_s: float = 0.0
    logprobs: int | None = None
    first_event: float | None = None  # streamed: perf_counter when the first event reached the transport
    first_item: float | None = None  # perf_counter when the event loop got the first token from the worker


def _abbench_object(ctx: _Ctx, stats: Any, finished: float, engine: Any) -> dict[str, Any]:
    def rel(t: float | None) -> float | None:
        return None if t is None else round(t - ctx.received, 6)

    return {
        "prefill_path": stats.prefill_path, "fallback_reason": stats.fallback_reason,
        "h2d_bytes": stats.h2d_bytes, "d2d_bytes": stats.d2d_bytes,
        "prefill_h2d_bytes": stats.prefill_h2d_bytes, "decode_h2d_bytes": stats.decode_h2d_bytes,
        "bank_bytes": stats.bank_bytes, "expert_copies": stats.expert_copies,
        "cached_prompt_tokens": stats.cached_prompt_tokens, "n_chunks": stats.n_chunks,
        "n_windows": stats.n_windows, "measured_h2d_gbps": _finite(engine.measured_h2d_gbps),
        "timings": {"received": 0.0, "prefill_start": rel(stats.prefill_start),
                    "prefill_end": rel(stats.prefill_end), "first_token": rel(stats.first_token),
                    "finished": rel(finished), "first_item": rel(ctx.first_item),
                    "first_event": rel(ctx.first_event)},
        "queue_wait_s": round(ctx.queue_wait_s, 6),
        "decode": {"slot_hits": stats.slot_hits, "slot_misses": stats.slot_misses,
                   "steps_whole": stats.decode_steps_whole, "steps_per_layer": stats.decode_steps_per_layer,
                   "mode": engine.decoder.mode, "slots_per_layer": engine.slots_per_layer},
        "peak_device_bytes": stats.peak_device_bytes,
    }


def _usage(stats: Any) -> dict[str, Any]:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.completion_tokens,
            "total_tokens": stats.prompt_tokens + stats.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": stats.cached_prompt_tokens}}


def _logprobs_block(tokenizer: Any, events: list[Any], offset0: int = 0) -> dict[str, Any]:
    """OpenAI completions logprobs for ``events`` plus ``top_logprob_ids`` (texts can collide)."""
    tokens, token_logprobs, top, top_ids, offsets = [], [], [], [], []
    offset = offset0
    for ev in events:
        text = tokenizer.decode([ev.token_id])
        tokens.append(text)
        token_logprobs.append(_finite(ev.logprob))
        pairs = [(int(i), _finite(lp)) for i, lp in (ev.top_logprobs or [])]
        top.append({tokenizer.decode([i]): lp for i, lp in pairs})
        top_ids.append([[i, lp] for i, lp in pairs])
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
            "text_offset": offsets, "top_logprob_ids": top_ids}


def _finite(x: float | None) -> float | None:
    """JSON has no -inf/NaN: a logprob that is not finite is sent as null."""
    return None if x is None or not math.isfinite(x) else float(x)


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


# --------------------------------------------------------------------------------------------------
# App factory
# --------------------------------------------------------------------------------------------------


def create_app(engine: Any, tokenizer: Any, *, served_model_name: str | None = None,
               allow_request_overrides: bool = False, queue_limit: int = 64,
               max_context: int | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The ASGI app serving ``engine`` (an ``abbench.engine.runtime.Engine`` or anything with its
    contract). All state lives in this closure and in ``app.state``; nothing is global."""
    model_field = engine.config.model
    name = served_model_name or (model_field if isinstance(model_field, str) else engine.model_config.name)
    if max_context is None:
        max_context = engine.config.max_context or engine.model_config.max_position_embeddings
    vocab_size = int(engine.model_config.vocab_size)
    svc = EngineService(engine, queue_limit=queue_limit)
    stats_metrics = Metrics(svc)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        svc.shutdown()

    app = FastAPI(title="abbench engine", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_ReceivedAt)
    app.state.engine = engine
    app.state.tokenizer = tokenizer
    app.state.service = svc
    app.state.metrics = stats_metrics

    @app.exception_handler(APIError)
    async def _api_error(_req: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_req: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": name, "object": "model", "created": int(time.time()),
                                            "owned_by": "abbench", "root": engine.model_config.name,
                                            "max_model_len": max_context}]}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(stats_metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/reset")
    async def reset() -> dict[str, str]:
        await svc.run_exclusive(engine.reset)
        return {"status": "ok"}

    async def parse(request: Request) -> CompletionRequest:
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > max_body_bytes:
            raise APIError(413, f"request body over {max_body_bytes} bytes", code="body_too_large")
        body = await request.body()
        if len(body) > max_body_bytes:
            raise APIError(413, f"request body over {max_body_bytes} bytes", code="body_too_large")
        try:
            obj = json.loads(body, parse_constant=_reject_constant)
        except (ValueError, UnicodeDecodeError) as exc:
            raise APIError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
        except RecursionError:  # e.g. "[[[[..." a few thousand deep: valid JSON but too deep to decode
            raise APIError(400, "request body is nested too deeply to decode", code="invalid_json") from None
        if not isinstance(obj, dict):
            raise APIError(400, "request body must be a JSON object", code="invalid_json")
        try:
            return CompletionRequest.model_validate(obj)
        except ValidationError as exc:
            raise _validation_error(exc) from None

    async def prompt_ids(req: CompletionRequest) -> list[int]:
        prompt = req.single_prompt()
        if isinstance(prompt, str):  # off the event loop: a long prompt takes milliseconds to encode
            ids = await asyncio.to_thread(tokenizer.encode, prompt)
        else:
            ids = [int(i) for i in prompt]
        if not ids:
            raise APIError(400, "prompt encodes to zero tokens", param="prompt")
        bad = next((i for i in ids if not 0 <= i < vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the model's vocabulary [0, {vocab_size})",
                           param="prompt", code="invalid_token_id")
        return ids

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        received = request.scope.get("abbench_received", time.perf_counter())
        req = await parse(request)
        if req.model is not None and req.model != name:
            raise APIError(404, f"the model '{req.model}' does not exist; this server serves '{name}'",
                           param="model", code="model_not_found")
        if req.prefill_mode is not None and not allow_request_overrides:
            raise APIError(400, "per-request prefill_mode needs the server flag --allow-request-overrides",
                           param="prefill_mode", code="override_not_allowed")
        ids = await prompt_ids(req)
        ctx = _Ctx(rid=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()), model=name, received=received,
                   logprobs=req.logprobs)
        gen_kwargs = dict(prompt_ids=ids, max_tokens=req.max_tokens or 16, temperature=req.temperature,
                          seed=req.seed, ignore_eos=req.ignore_eos, logprobs=req.logprobs,
                          prefill_mode=req.prefill_mode)
        queued = time.perf_counter()
        try:
            await svc.acquire(request)
        except APIError:
            stats_metrics.outcomes.labels("rejected").inc()
            raise
        except ClientGone:
            log.info("%s: client left while queued", ctx.rid)
            stats_metrics.outcomes.labels("client_gone").inc()
            return Response(status_code=499)
        ctx.queue_wait_s = time.perf_counter() - queued
        job = svc.start(gen_kwargs)
        try:
            first = await _next_item(job, request)
            ctx.first_item = time.perf_counter()
        except ClientGone:
            log.info("%s: client left before the first token; cancelled", ctx.rid)
            stats_metrics.outcomes.labels("client_gone").inc()
            return Response(status_code=499)
        if isinstance(first, BaseException):
            stats_metrics.outcomes.labels("error").inc()
            raise _engine_error(first)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(stream(job, first, ctx, include_usage, request),
                                            media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await complete(job, first, ctx, request)

    async def complete(job: _Job, first: Any, ctx: _Ctx, request: Request) -> Response:
        events, item = [], first
        try:
            while not isinstance(item, (_Finished, BaseException)):
                events.append(item)
                item = await _next_item(job, request)
        except ClientGone:
            log.info("%s: client left during generation; cancelled", ctx.rid)
            stats_metrics.outcomes.labels("client_gone").inc()
            return Response(status_code=499)
        if isinstance(item, BaseException):
            stats_metrics.outcomes.labels("error").inc()
            raise _engine_error(item)
        stats = item.stats
        stats_metrics.observe(stats)
        stats_metrics.outcomes.labels("ok").inc()
        out_ids = [int(ev.token_id) for ev in events]
        choice = {"index": 0, "text": tokenizer.decode(out_ids), "finish_reason": stats.finish_reason,
                  "logprobs": _logprobs_block(tokenizer, events) if ctx.logprobs is not None else None,
                  "token_ids": out_ids}
        body = {"id": ctx.rid, "object": "text_completion", "created": ctx.created, "model": ctx.model,
                "choices": [choice], "usage": _usage(stats),
                "abbench": _abbench_object(ctx, stats, item.finished, engine)}
        _log_done(ctx, stats, item.finished)
        return JSONResponse(body)

    async def stream(job: _Job, first: Any, ctx: _Ctx, include_usage: bool, request: Request
                     ) -> AsyncIterator[bytes]:
        detok = IncrementalDetokenizer(tokenizer)
        head = {"id": ctx.rid, "object": "text_completion", "created": ctx.created, "model": ctx.model}
        offset, item, finished_ok = 0, first, False
        try:
            while not isinstance(item, (_Finished, BaseException)):
                piece = detok.push(item.token_id)
                lp = None
                if ctx.logprobs is not None:
                    lp = _logprobs_block(tokenizer, [item], offset)
                    offset += len(lp["tokens"][0])
                yield _sse({**head, "choices": [{"index": 0, "text": piece, "finish_reason": None,
                                                 "logprobs": lp, "token_ids": [int(item.token_id)]}]})
                if ctx.first_event is None:
                    ctx.first_event = time.perf_counter()
                item = await _next_item(job, request)
            if isinstance(item, BaseException):
                stats_metrics.outcomes.labels("error").inc()
                yield _sse(_engine_error(item).body())
                yield b"data: [DONE]\n\n"
                return
            stats = item.stats
            finished_ok = True  # the engine is done; a hang-up from here on cancels nothing
            stats_metrics.observe(stats)
            stats_metrics.outcomes.labels("ok").inc()
            _log_done(ctx, stats, item.finished)
            abbench = _abbench_object(ctx, stats, item.finished, engine)
            last = {**head, "choices": [{"index": 0, "text": detok.flush(), "finish_reason": stats.finish_reason,
                                         "logprobs": None, "token_ids": []}]}
            if include_usage:
                yield _sse(last)
                last = {**head, "choices": [], "usage": _usage(stats)}
            yield _sse({**last, "abbench": abbench})
            yield b"data: [DONE]\n\n"
        except ClientGone:
            log.info("%s: client left mid-stream; cancelled", ctx.rid)
        finally:
            if not finished_ok:
                job.cancel.set()  # Starlette cancels this generator when the client disconnects
                if not isinstance(item, BaseException):
                    stats_metrics.outcomes.labels("client_gone").inc()

    return app


def _reject_constant(token: str) -> Any:
    raise ValueError(f"{token} is not valid JSON")


def _log_done(ctx: _Ctx, stats: Any, finished: float) -> None:
    log.info("%s: path=%s prompt=%d cached=%d out=%d ttft=%.3fs total=%.3fs queue=%.3fs h2d=%d",
             ctx.rid, stats.prefill_path, stats.prompt_tokens, stats.cached_prompt_tokens,
             stats.completion_tokens, (stats.first_token or finished) - ctx.received, finished - ctx.received,
             ctx.queue_wait_s, stats.h2d_bytes)


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m abbench.engine",
                                description="Serve the vendored offloaded-MoE engine over an OpenAI-compatible API.")
    e = p.add_argument_group("engine")
    e.add_argument("--model", default=None, help=f"preset ({', '.join(PRESETS)}) or a local HF model directory "
                   "with config.json (default: tiny, or the checkpoint's config when --weights is a directory)")
    e.add_argument("--weights", default="random:0", help="'random:SEED' or an HF checkpoint directory")
    e.add_argument("--tokenizer", default=None, help="qwen3, qwen3.6 or a local HF tokenizer directory "
                   "(default: qwen3 for presets, the model directory otherwise)")
    e.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    e.add_argument("--dtype", default=None, choices=DTYPES, help="default: float32 on cpu, bfloat16 on cuda")
    e.add_argument("--prefill-mode", default="chunked", choices=PREFILL_MODES)
    e.add_argument("--chunk-tokens", type=int, default=2048)
    e.add_argument("--layer-major-window-tokens", type=int, default=None)
    e.add_argument("--demand-max-tokens", type=int, default=None)
    e.add_argument("--gpu-memory-budget", dest="gpu_memory_budget_gb", type=float, default=None, metavar="GB",
                   help="device memory the engine may use, in GB (1e9 bytes), CUDA context included: the decode "
                   "slot cache gets what the dense weights, KV cache, prefill buffers and workspace leave; a "
                   "budget that cannot hold one token's experts per layer is refused (default: the device's "
                   "free memory at start; on CPU every expert)")
    e.add_argument("--expert-slots-per-layer", type=int, default=None, metavar="N",
                   help="decode slot cache size per layer (default: what --gpu-memory-budget leaves, at most "
                   "num_experts)")
    e.add_argument("--no-host-memory-check", dest="host_memory_check", action="store_false", default=None,
                   help="build the host expert bank even if /proc/meminfo says it will not fit")
    e.add_argument("--no-decode-graphs", dest="decode_graphs", action="store_false", default=None,
                   help="CUDA: run decode steps eagerly instead of replaying CUDA graphs")
    e.add_argument("--d2d-from-slot-cache", action="store_true", default=None)
    e.add_argument("--max-context", type=int, default=None)
    e.add_argument("--deterministic", action="store_true", default=None,
                   help="ask the engine for deterministic kernels")
    s = p.add_argument_group("server")
    s.add_argument("--allow-request-overrides", action="store_true",
                   help="accept a per-request prefill_mode field")
    s.add_argument("--queue-limit", type=int, default=64, help="max waiting requests; more get 429 (default 64)")
    s.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    s.add_argument("--port", type=int, default=8000, help="port (0 picks a free one; default 8000)")
    s.add_argument("--served-model-name", default=None, help="model name in the API (default: --model)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return p


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    kwargs: dict[str, Any] = dict(model=args.model, weights=args.weights, device=args.device,
                                  prefill_mode=args.prefill_mode, chunk_tokens=args.chunk_tokens)
    for field in ("dtype", "layer_major_window_tokens", "demand_max_tokens", "gpu_memory_budget_gb",
                  "expert_slots_per_layer", "host_memory_check", "decode_graphs", "d2d_from_slot_cache",
                  "max_context", "deterministic"):
        if getattr(args, field) is not None:  # leave the engine's defaults alone
            kwargs[field] = getattr(args, field)
    return EngineConfig(**kwargs)


def _bind(host: str, port: int) -> socket.socket:
    family, type_, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, type_, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(addr)
    sock.set_inheritable(True)
    return sock


class _Server(uvicorn.Server):
    ready_message = ""

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started and self.ready_message:
            print(self.ready_message, flush=True)


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, build the engine, serve until SIGINT/SIGTERM; returns 0 after a clean shutdown.
    Failures raise ``SystemExit`` (so a caller that ignores the return value still exits non-zero): 2 for
    usage errors (argparse, a bad tokenizer spec), 1 when the port cannot be bound or the engine cannot be
    built, each with a one-line message on stderr."""
    parser = build_arg_parser()
    args = parser.parse_args(argv)
    if args.queue_limit < 0:
        parser.error("--queue-limit must be >= 0")
    if args.model is None:  # tiny, unless --weights names a checkpoint: then its own config.json
        args.model = args.weights if os.path.isdir(args.weights) else "tiny"
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    model_dir = args.model if os.path.isdir(args.model) else os.path.dirname(args.model) or None
    if args.model in PRESETS or not os.path.exists(args.model):
        model_dir = None
    try:
        tokenizer = load_tokenizer(args.tokenizer or model_dir or "qwen3")
    except TokenizerSpecError as exc:
        parser.error(str(exc))

    try:  # bound (not listening) before the slow engine build: a busy port fails at once
        sock = _bind(args.host, args.port)
    except OSError as exc:
        print(f"abbench engine: cannot bind {args.host}:{args.port}: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None

    from abbench.engine.runtime import Engine

    try:
        engine = Engine(_engine_config(args))
    except (ValueError, TypeError, RuntimeError, OSError) as exc:
        print(f"abbench engine: cannot build the engine: {exc}", file=sys.stderr, flush=True)
        sock.close()
        raise SystemExit(1) from None
    log.info("engine built in %.2fs (bank %d bytes, measured H2D %.2f GB/s)", engine.startup_s,
             engine.bank_bytes, engine.measured_h2d_gbps)
    if engine.memory_plan is not None:
        log.info("device memory plan: %s", engine.memory_plan.describe())

    app = create_app(engine, tokenizer, served_model_name=args.served_model_name or args.model,
                     allow_request_overrides=args.allow_request_overrides, queue_limit=args.queue_limit)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    server = _Server(uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=5, lifespan="on"))
    server.ready_message = (f"abbench engine ready: http://{shown}:{port} (model {args.model}, "
                            f"prefill {args.prefill_mode}, device {args.device})")
    server.run(sockets=[sock])
    return 0
