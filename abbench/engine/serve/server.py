"""OpenAI-compatible HTTP server for the vendored engine (FastAPI + uvicorn).

Contract
--------
``create_app(engine, tokenizer, ...)`` builds the ASGI app around an already-built backend: the vendored
:class:`abbench.engine.runtime.engine.Engine` or the transformers :class:`abbench.engine.serve.reference.ReferenceEngine`,
both of which honour the contract of :mod:`abbench.engine.contract` (the route hands each completion to the
backend as a :class:`~abbench.engine.contract.GenerateRequest`). The command line that builds a backend,
binds the socket and serves (``abbench serve``, ``python -m abbench.engine``) is :mod:`abbench.engine.serve.launch`;
this module does not import it.

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

Priming: a completion (either route) that reaches an idle engine first asks the engine thread to start what
every streamed prefill needs first (``EngineService.prime``, ``Backend.prime_prefill``: the first layer's bank
copy), before its body is read, so the copy overlaps reading, parsing and tokenizing it; a request that fails
before its prefill takes it back (``unprime``).

Authentication: with ``api_key`` (the launcher's ``--api-key``) every route except ``GET /health`` needs
``Authorization: Bearer KEY``; anything else is a 401 in OpenAI's shape (``code: invalid_api_key``) before the
body is read, and the key is never logged. The launcher refuses to bind beyond loopback without a key.

Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: 400 for malformed JSON,
unknown fields, bad values and prompts over the context, 404 for another model name or route, 413 for a
body over the size cap, 429 when the wait queue is full, 503 when the device runs out of memory (the
engine stays usable). An error after a stream started is sent as a ``data: {"error": ...}`` event followed
by ``[DONE]``, as vLLM does. Nothing in a request names a file; the server reads none on its behalf.
Device OOM can be injected for tests with ``ABBENCH_ENGINE_FAULT=oom-once`` (:mod:`abbench.engine.serve.faults`).

Layout: the request schema, API errors and response pieces are :mod:`abbench.engine.serve.api`; the queue (the
backend's scheduler in one engine thread, cancellable) and the Prometheus metrics are
:mod:`abbench.engine.serve.serving`; this module holds the routes (module-level functions reading :class:`ServerState` from ``app.state``) and
:func:`create_app`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from abbench.engine.serve.chat import ChatFormat, CompletionFormat, decode_chat
from abbench.engine.serve.api import (
    APIError, CompletionRequest, RequestContext, abbench_object, decode_request, engine_error, logprobs_block,
    sse_event, usage,
)
from abbench.engine.contract import Backend, GenerateRequest
from abbench.engine.serve.serving import (
    ClientGone, EngineService, Finished, Job, ReceivedAt, ServiceMetrics, next_item,
)
from abbench.engine.serve.tokenizer import IncrementalDetokenizer

__all__ = ["CompletionRequest", "RequireAPIKey", "ServerState", "create_app"]

log = logging.getLogger("abbench.engine.serve.server")

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024


@dataclass
class ServerState:
    """Everything the routes use, built once by :func:`create_app` (``app.state.server``); nothing is global."""

    engine: Backend  # the vendored Engine or the transformers ReferenceEngine
    tokenizer: Any
    service: EngineService
    metrics: ServiceMetrics
    name: str  # the served model name
    max_context: int
    vocab_size: int
    allow_request_overrides: bool
    max_body_bytes: int


OPEN_PATHS = frozenset({"/health"})


class RequireAPIKey:
    """Pure ASGI middleware: every HTTP request except :data:`OPEN_PATHS` must carry
    ``Authorization: Bearer <key>`` (compared in constant time); otherwise a 401 in OpenAI's shape, sent
    before the body is read or the request reaches a route."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path") in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope.get("headers", []) if k == b"authorization"), b"")
        if hmac.compare_digest(given, self._expected):
            await self.app(scope, receive, send)
            return
        body = json.dumps({"error": {"message": "missing or invalid API key: send 'Authorization: Bearer <key>'",
                                     "type": "authentication_error", "param": None,
                                     "code": "invalid_api_key"}}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})


def _state(request: Request) -> ServerState:
    return request.app.state.server


router = APIRouter()


# ------------------------------------------------------------------------------------------------- routes


@router.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    st = _state(request)
    return {"object": "list", "data": [{"id": st.name, "object": "model", "created": int(time.time()),
                                        "owned_by": "abbench", "root": st.engine.info.model_name,
                                        "max_model_len": st.max_context}]}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(generate_latest(_state(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.post("/reset")
async def reset(request: Request) -> dict[str, str]:
    st = _state(request)
    await st.service.run_exclusive(st.engine.reset)
    return {"status": "ok"}


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    st = _state(request)
    received = request.scope.get("abbench_received", time.perf_counter())

    async def serve() -> Response:
        req = decode_request(await _body(request, st.max_body_bytes))
        return await _serve(st, request, req, received, CompletionFormat(st.tokenizer))
    return await _primed(st, serve)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    """OpenAI's chat API: the conversation rendered by the model's chat template, then served as a completion
    (:mod:`abbench.engine.serve.chat`)."""
    st = _state(request)
    received = request.scope.get("abbench_received", time.perf_counter())

    async def serve() -> Response:
        req, _chat = decode_chat(await _body(request, st.max_body_bytes), st.tokenizer)
        return await _serve(st, request, req, received, ChatFormat(st.tokenizer))
    return await _primed(st, serve)


async def _primed(st: ServerState, serve: Any) -> Response:
    """``await serve()`` with the engine primed first (``EngineService.prime``: the first layer's copy overlaps
    reading, parsing and tokenizing the request), and the prime taken back if the request fails first."""
    st.service.prime()
    try:
        return await serve()
    except BaseException:
        st.service.unprime()
        raise


async def _serve(st: ServerState, request: Request, req: CompletionRequest, received: float,
                 fmt: CompletionFormat) -> Response:
    """One parsed request through the engine, answered in ``fmt``'s shapes (completions or chat)."""
    if req.model is not None and req.model != st.name:
        raise APIError(404, f"the model '{req.model}' does not exist; this server serves '{st.name}'",
                       param="model", code="model_not_found")
    for field, o in GenerateRequest.overrides().items():
        if o.gated and getattr(req, field) not in (None, False) and not st.allow_request_overrides:
            raise APIError(400, f"per-request {field} needs the server flag --allow-request-overrides",
                           param=field, code="override_not_allowed")
    ids = await _prompt_ids(req, st)
    work = GenerateRequest.build(ids, req)  # a null takes the contract's default (max_tokens: 16)
    ctx = RequestContext(rid=f"{'chatcmpl' if isinstance(fmt, ChatFormat) else 'cmpl'}-{uuid.uuid4().hex}",
                         created=int(time.time()), model=st.name, received=received, logprobs=req.logprobs)
    try:
        job = st.service.submit(work)
    except APIError:
        st.metrics.outcomes.labels("rejected").inc()
        raise
    try:
        first = await next_item(job, request)
        ctx.first_item = time.perf_counter()
    except ClientGone:
        queued = st.service.withdraw(job)
        log.info("%s: client left %s", ctx.rid, "while queued" if queued else "before the first token; cancelled")
        st.metrics.outcomes.labels("client_gone").inc()
        return Response(status_code=499)
    ctx.queue_wait_s = job.queue_wait_s
    if isinstance(first, BaseException):
        st.metrics.outcomes.labels("error").inc()
        raise engine_error(first)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(_stream(st, job, first, ctx, include_usage, request, fmt),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await _complete(st, job, first, ctx, request, fmt)


async def _body(request: Request, max_body_bytes: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > max_body_bytes:
        raise APIError(413, f"request body over {max_body_bytes} bytes", code="body_too_large")
    body = await request.body()
    if len(body) > max_body_bytes:
        raise APIError(413, f"request body over {max_body_bytes} bytes", code="body_too_large")
    return body


async def _prompt_ids(req: CompletionRequest, st: ServerState) -> list[int]:
    prompt = req.single_prompt()
    if isinstance(prompt, str):  # off the event loop: a long prompt takes milliseconds to encode
        ids = await asyncio.to_thread(st.tokenizer.encode, prompt)
    else:
        ids = [int(i) for i in prompt]
    if not ids:
        raise APIError(400, "prompt encodes to zero tokens", param="prompt")
    bad = next((i for i in ids if not 0 <= i < st.vocab_size), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is outside the model's vocabulary [0, {st.vocab_size})",
                       param="prompt", code="invalid_token_id")
    return ids


def _finished_ok(st: ServerState, ctx: RequestContext, item: Finished) -> dict[str, Any]:
    """Count a finished request and log it; returns its ``abbench`` object."""
    st.metrics.observe(item.stats)
    st.metrics.outcomes.labels("ok").inc()
    _log_done(ctx, item.stats, item.finished)
    return abbench_object(ctx, item.stats, item.finished, st.engine.info)


async def _complete(st: ServerState, job: Job, first: Any, ctx: RequestContext, request: Request,
                    fmt: CompletionFormat) -> Response:
    events, item = [], first
    try:
        while not isinstance(item, (Finished, BaseException)):
            events.append(item)
            item = await next_item(job, request)
    except ClientGone:
        log.info("%s: client left during generation; cancelled", ctx.rid)
        st.metrics.outcomes.labels("client_gone").inc()
        return Response(status_code=499)
    if isinstance(item, BaseException):
        st.metrics.outcomes.labels("error").inc()
        raise engine_error(item)
    stats = item.stats
    abbench = _finished_ok(st, ctx, item)
    out_ids = [int(ev.token_id) for ev in events]
    lp = fmt.logprobs(logprobs_block(st.tokenizer, events)) if ctx.logprobs is not None else None
    choice = fmt.whole_choice(st.tokenizer.decode(out_ids), stats.finish_reason, lp, out_ids)
    return JSONResponse({"id": ctx.rid, "object": fmt.object, "created": ctx.created, "model": ctx.model,
                         "choices": [choice], "usage": usage(stats), "abbench": abbench})


async def _stream(st: ServerState, job: Job, first: Any, ctx: RequestContext, include_usage: bool,
                  request: Request, fmt: CompletionFormat) -> AsyncIterator[bytes]:
    detok = IncrementalDetokenizer(st.tokenizer)
    head = {"id": ctx.rid, "object": fmt.chunk, "created": ctx.created, "model": ctx.model}
    offset, item, finished_ok = 0, first, False
    try:
        for choice in fmt.opening():
            yield sse_event({**head, "choices": [choice]})
        while not isinstance(item, (Finished, BaseException)):
            piece = detok.push(item.token_id)
            lp = None
            if ctx.logprobs is not None:
                block = logprobs_block(st.tokenizer, [item], offset)
                offset += len(block["tokens"][0])
                lp = fmt.logprobs(block)
            yield sse_event({**head, "choices": [fmt.token_choice(piece, item.token_id, lp)]})
            if ctx.first_event is None:
                ctx.first_event = time.perf_counter()
            item = await next_item(job, request)
        if isinstance(item, BaseException):
            st.metrics.outcomes.labels("error").inc()
            yield sse_event(engine_error(item).body())
            yield b"data: [DONE]\n\n"
            return
        stats = item.stats
        finished_ok = True  # the engine is done; a hang-up from here on cancels nothing
        abbench = _finished_ok(st, ctx, item)
        last = {**head, "choices": [fmt.last_choice(detok.flush(), stats.finish_reason)]}
        if include_usage:
            yield sse_event(last)
            last = {**head, "choices": [], "usage": usage(stats)}
        yield sse_event({**last, "abbench": abbench})
        yield b"data: [DONE]\n\n"
    except ClientGone:
        log.info("%s: client left mid-stream; cancelled", ctx.rid)
    finally:
        if not finished_ok:
            job.cancel.set()  # Starlette cancels this generator when the client disconnects
            if not isinstance(item, BaseException):
                st.metrics.outcomes.labels("client_gone").inc()


def _log_done(ctx: RequestContext, stats: Any, finished: float) -> None:
    log.info("%s: path=%s prompt=%d cached=%d out=%d ttft=%.3fs total=%.3fs queue=%.3fs h2d=%d",
             ctx.rid, stats.prefill_path, stats.prompt_tokens, stats.cached_prompt_tokens,
             stats.completion_tokens, (stats.first_token or finished) - ctx.received, finished - ctx.received,
             ctx.queue_wait_s, stats.h2d_bytes)


# ------------------------------------------------------------------------------------------------ the app


async def _api_error(_req: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def _http_error(_req: Request, exc: StarletteHTTPException) -> JSONResponse:
    return APIError(exc.status_code, str(exc.detail)).response()


def create_app(engine: Backend, tokenizer: Any, *, served_model_name: str | None = None,
               allow_request_overrides: bool = False, queue_limit: int = 64,
               max_context: int | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               api_key: str | None = None) -> FastAPI:
    """The ASGI app serving ``engine`` (a :class:`~abbench.engine.contract.Backend`). Its state is one :class:`ServerState` in ``app.state.server``; nothing is global. With
    ``api_key`` every route but /health needs ``Authorization: Bearer <api_key>`` (:class:`RequireAPIKey`)."""
    info = engine.info
    name = served_model_name or info.model
    if max_context is None:
        max_context = info.max_context
    service = EngineService(engine, queue_limit=queue_limit)
    state = ServerState(engine=engine, tokenizer=tokenizer, service=service, metrics=ServiceMetrics(service),
                        name=name, max_context=max_context, vocab_size=int(info.vocab_size),
                        allow_request_overrides=allow_request_overrides, max_body_bytes=max_body_bytes)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        service.shutdown()

    app = FastAPI(title="abbench engine", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(ReceivedAt)
    if api_key:
        app.add_middleware(RequireAPIKey, api_key=api_key)  # outermost: refused before anything else runs
    app.state.server = state
    app.state.engine = engine
    app.state.tokenizer = tokenizer
    app.state.service = service
    app.state.metrics = state.metrics
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.include_router(router)
    return app
