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

Authentication: with ``--api-key KEY`` (or ``ABBENCH_ENGINE_API_KEY`` in the environment, which keeps the key
out of the process list) every route except ``GET /health`` needs ``Authorization: Bearer KEY``; anything
else is a 401 in OpenAI's shape (``code: invalid_api_key``) before the body is read, and the key is never
logged. Without a key the server binds loopback addresses only: ``--host`` naming any other address is
refused (exit 2) unless ``--insecure-no-auth`` says so explicitly.

Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: 400 for malformed JSON,
unknown fields, bad values and prompts over the context, 404 for another model name or route, 413 for a
body over the size cap, 429 when the wait queue is full, 503 when the device runs out of memory (the
engine stays usable). An error after a stream started is sent as a ``data: {"error": ...}`` event followed
by ``[DONE]``, as vLLM does. Nothing in a request names a file; the server reads none on its behalf.
Device OOM can be injected for tests with ``ABBENCH_ENGINE_FAULT=oom-once`` (see ``runtime``).

Layout: the request schema, API errors and response pieces are :mod:`abbench.engine.api`; the queue (one
request at a time, FIFO, cancellable) and the Prometheus metrics are :mod:`abbench.engine.serving`; this
module holds the routes (module-level functions reading :class:`ServerState` from ``app.state``),
:func:`create_app` and the command line.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import ipaddress
import json
import logging
import os
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from abbench.engine.api import (
    APIError,
    CompletionRequest,
    RequestContext,
    abbench_object,
    decode_request,
    engine_error,
    logprobs_block,
    sse_event,
    usage,
)
from abbench.engine.config import DTYPES, PREFILL_MODES, PRESETS, EngineConfig
from abbench.engine.serving import ClientGone, EngineService, Finished, Job, ReceivedAt, ServiceMetrics, next_item
from abbench.engine.tokenizer import IncrementalDetokenizer, TokenizerSpecError, load_tokenizer

__all__ = ["CompletionRequest", "ServerState", "create_app", "build_arg_parser", "main"]

log = logging.getLogger("abbench.engine.server")

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024


@dataclass
class ServerState:
    """Everything the routes use, built once by :func:`create_app` (``app.state.server``); nothing is global."""

    engine: Any  # an abbench.engine.runtime.Engine, or anything with its contract
    tokenizer: Any
    service: EngineService
    metrics: ServiceMetrics
    name: str  # the served model name
    max_context: int
    vocab_size: int
    allow_request_overrides: bool
    max_body_bytes: int


API_KEY_ENV = "ABBENCH_ENGINE_API_KEY"
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


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` resolves to is a loopback address (``localhost``, 127.0.0.0/8, ::1).
    A wildcard (``0.0.0.0``, ``::``, empty) is not."""
    if host in ("", "0.0.0.0", "::"):
        return False
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


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
                                        "owned_by": "abbench", "root": st.engine.model_config.name,
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
    req = await _parse(request, st.max_body_bytes)
    if req.model is not None and req.model != st.name:
        raise APIError(404, f"the model '{req.model}' does not exist; this server serves '{st.name}'",
                       param="model", code="model_not_found")
    for field in ("prefill_mode", "chunk_tokens", "attention_batch", "trace_layers"):
        if getattr(req, field) not in (None, False) and not st.allow_request_overrides:
            raise APIError(400, f"per-request {field} needs the server flag --allow-request-overrides",
                           param=field, code="override_not_allowed")
    ids = await _prompt_ids(req, st)
    ctx = RequestContext(rid=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()), model=st.name,
                         received=received, logprobs=req.logprobs)
    gen_kwargs = dict(prompt_ids=ids, max_tokens=req.max_tokens or 16, temperature=req.temperature,
                      seed=req.seed, ignore_eos=req.ignore_eos, logprobs=req.logprobs,
                      prefill_mode=req.prefill_mode)
    if req.trace_layers:
        gen_kwargs["trace_layers"] = True
    if req.chunk_tokens is not None:
        gen_kwargs["chunk_tokens"] = req.chunk_tokens
    if req.attention_batch is not None:
        gen_kwargs["attention_batch"] = req.attention_batch
    queued = time.perf_counter()
    try:
        await st.service.acquire(request)
    except APIError:
        st.metrics.outcomes.labels("rejected").inc()
        raise
    except ClientGone:
        log.info("%s: client left while queued", ctx.rid)
        st.metrics.outcomes.labels("client_gone").inc()
        return Response(status_code=499)
    ctx.queue_wait_s = time.perf_counter() - queued
    job = st.service.start(gen_kwargs)
    try:
        first = await next_item(job, request)
        ctx.first_item = time.perf_counter()
    except ClientGone:
        log.info("%s: client left before the first token; cancelled", ctx.rid)
        st.metrics.outcomes.labels("client_gone").inc()
        return Response(status_code=499)
    if isinstance(first, BaseException):
        st.metrics.outcomes.labels("error").inc()
        raise engine_error(first)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(_stream(st, job, first, ctx, include_usage, request),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await _complete(st, job, first, ctx, request)


async def _parse(request: Request, max_body_bytes: int) -> CompletionRequest:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > max_body_bytes:
        raise APIError(413, f"request body over {max_body_bytes} bytes", code="body_too_large")
    body = await request.body()
    if len(body) > max_body_bytes:
        raise APIError(413, f"request body over {max_body_bytes} bytes", code="body_too_large")
    return decode_request(body)


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
    return abbench_object(ctx, item.stats, item.finished, st.engine)


async def _complete(st: ServerState, job: Job, first: Any, ctx: RequestContext, request: Request) -> Response:
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
    choice = {"index": 0, "text": st.tokenizer.decode(out_ids), "finish_reason": stats.finish_reason,
              "logprobs": logprobs_block(st.tokenizer, events) if ctx.logprobs is not None else None,
              "token_ids": out_ids}
    return JSONResponse({"id": ctx.rid, "object": "text_completion", "created": ctx.created, "model": ctx.model,
                         "choices": [choice], "usage": usage(stats), "abbench": abbench})


async def _stream(st: ServerState, job: Job, first: Any, ctx: RequestContext, include_usage: bool,
                  request: Request) -> AsyncIterator[bytes]:
    detok = IncrementalDetokenizer(st.tokenizer)
    head = {"id": ctx.rid, "object": "text_completion", "created": ctx.created, "model": ctx.model}
    offset, item, finished_ok = 0, first, False
    try:
        while not isinstance(item, (Finished, BaseException)):
            piece = detok.push(item.token_id)
            lp = None
            if ctx.logprobs is not None:
                lp = logprobs_block(st.tokenizer, [item], offset)
                offset += len(lp["tokens"][0])
            yield sse_event({**head, "choices": [{"index": 0, "text": piece, "finish_reason": None,
                                                  "logprobs": lp, "token_ids": [int(item.token_id)]}]})
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
        last = {**head, "choices": [{"index": 0, "text": detok.flush(), "finish_reason": stats.finish_reason,
                                     "logprobs": None, "token_ids": []}]}
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


def create_app(engine: Any, tokenizer: Any, *, served_model_name: str | None = None,
               allow_request_overrides: bool = False, queue_limit: int = 64,
               max_context: int | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               api_key: str | None = None) -> FastAPI:
    """The ASGI app serving ``engine`` (an ``abbench.engine.runtime.Engine`` or anything with its
    contract). Its state is one :class:`ServerState` in ``app.state.server``; nothing is global. With
    ``api_key`` every route but /health needs ``Authorization: Bearer <api_key>`` (:class:`RequireAPIKey`)."""
    model_field = engine.config.model
    name = served_model_name or (model_field if isinstance(model_field, str) else engine.model_config.name)
    if max_context is None:
        max_context = engine.config.max_context or engine.model_config.max_position_embeddings
    service = EngineService(engine, queue_limit=queue_limit)
    state = ServerState(engine=engine, tokenizer=tokenizer, service=service, metrics=ServiceMetrics(service),
                        name=name, max_context=max_context, vocab_size=int(engine.model_config.vocab_size),
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


# ----------------------------------------------------------------------------------------------- command line


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m abbench.engine",
                                description="Serve the vendored offloaded-MoE engine over an OpenAI-compatible API.")
    e = p.add_argument_group("engine")
    e.add_argument("--model", default=None, help=f"preset ({', '.join(PRESETS)}) or a local HF model directory "
                   "with config.json (default: tiny, or the checkpoint's config when --weights is a directory)")
    e.add_argument("--weights", default="random:0", help="'random:SEED', an HF checkpoint directory, or "
                   "'tiny-qwen3-moe:SEED' (a random tiny Qwen3-MoE checkpoint written once into abbench's cache)")
    e.add_argument("--tokenizer", default=None, help="qwen3, qwen3.6 or a local HF tokenizer directory "
                   "(default: qwen3.6 for the qwen3.5-* presets, qwen3 for the other presets, the model "
                   "directory otherwise)")
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
    e.add_argument("--no-warm-decode-graphs", dest="warm_decode_graphs", action="store_false", default=None,
                   help="CUDA: capture a decode KV length's graphs when a request first reaches it, instead of "
                   "every length's at start (then that request's first steps run eagerly and capture, slower)")
    e.add_argument("--no-prefill-graphs", dest="prefill_graphs", action="store_false", default=None,
                   help="CUDA, hybrid models: run every prefill layer step eagerly instead of replaying CUDA graphs "
                   "of full chunks' fixed-shape steps")
    e.add_argument("--attention-batch", type=int, default=None, metavar="K",
                   help="layer-major prefill: K adjacent chunks share one attention call in full-attention layers "
                   "where that is bit-identical on the device and the group ends within "
                   "--attention-batch-max-context (default 1: one call per chunk; hybrid Qwen3.5/3.6 models)")
    e.add_argument("--attention-batch-max-context", type=int, default=None, metavar="TOKENS",
                   help="the longest context a batched attention group may end at (default 16384: on the H200 the "
                   "joint call was faster below ~6K tokens, even at 16K-64K and slower at 128K)")
    e.add_argument("--d2d-from-slot-cache", action="store_true", default=None)
    e.add_argument("--max-context", type=int, default=None)
    e.add_argument("--deterministic", action="store_true", default=None,
                   help="ask the engine for deterministic kernels")
    s = p.add_argument_group("server")
    s.add_argument("--allow-request-overrides", action="store_true",
                   help="accept the per-request prefill_mode, chunk_tokens, attention_batch and trace_layers fields")
    s.add_argument("--queue-limit", type=int, default=64, help="max waiting requests; more get 429 (default 64)")
    s.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only; any other address "
                   "needs --api-key or --insecure-no-auth)")
    s.add_argument("--api-key", default=None, help=f"require 'Authorization: Bearer KEY' on every route but "
                   f"/health (default: ${API_KEY_ENV}, which keeps the key out of the process list)")
    s.add_argument("--insecure-no-auth", action="store_true",
                   help="allow a non-loopback --host without an API key (anyone who can reach it can use it)")
    s.add_argument("--port", type=int, default=8000, help="port (0 picks a free one; default 8000)")
    s.add_argument("--served-model-name", default=None, help="model name in the API (default: --model)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return p


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    kwargs: dict[str, Any] = dict(model=args.model, weights=args.weights, device=args.device,
                                  prefill_mode=args.prefill_mode, chunk_tokens=args.chunk_tokens)
    for field in ("dtype", "layer_major_window_tokens", "demand_max_tokens", "gpu_memory_budget_gb",
                  "expert_slots_per_layer", "host_memory_check", "decode_graphs", "warm_decode_graphs",
                  "prefill_graphs", "attention_batch", "attention_batch_max_context", "d2d_from_slot_cache",
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
    for name in ("model", "weights"):  # tiny-qwen3-moe:SEED -> the cached tiny checkpoint (made on first use)
        value = getattr(args, name)
        if isinstance(value, str) and value.startswith("tiny-qwen3-moe:"):
            from abbench.engine.reference import resolve_checkpoint

            setattr(args, name, resolve_checkpoint(value))
    if args.model is None:  # tiny, unless --weights names a checkpoint: then its own config.json
        args.model = args.weights if os.path.isdir(args.weights) else "tiny"
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    api_key = api_key.strip() if api_key else None
    if args.api_key is not None and not api_key:
        parser.error("--api-key is empty")
    if not api_key and not args.insecure_no_auth and not is_loopback(args.host):
        parser.error(f"--host {args.host} is not a loopback address and no API key is set: anyone who can reach "
                     f"it could use the engine (/v1/completions, /reset). Set {API_KEY_ENV} (or --api-key), or "
                     "pass --insecure-no-auth to serve it open anyway")

    model_dir = args.model if os.path.isdir(args.model) else os.path.dirname(args.model) or None
    if args.model in PRESETS or not os.path.exists(args.model):
        model_dir = None
    try:
        preset = PRESETS.get(args.model)
        default_tokenizer = "qwen3.6" if preset is not None and preset.is_hybrid else "qwen3"
        tokenizer = load_tokenizer(args.tokenizer or model_dir or default_tokenizer)
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
    if engine.decode_warmup is not None:
        log.info("decode graphs captured for KV lengths %s in %.2fs",
                 ", ".join(map(str, engine.decode_warmup["kv_buckets"])), engine.decode_warmup["seconds"])

    app = create_app(engine, tokenizer, served_model_name=args.served_model_name or args.model,
                     allow_request_overrides=args.allow_request_overrides, queue_limit=args.queue_limit,
                     api_key=api_key)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    server = _Server(uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=5, lifespan="on"))
    auth = "API key required" if api_key else "no API key"
    server.ready_message = (f"abbench engine ready: http://{shown}:{port} (model {args.model}, "
                            f"prefill {args.prefill_mode}, device {args.device}, {auth})")
    server.run(sockets=[sock])
    return 0
