"""Serving the engine: one request at a time in one worker thread, FIFO, cancellable; and its metrics.

Scheduling: ONE request runs on the engine at a time, in a single worker thread. Others wait on an
``asyncio.Lock``, which is FIFO-fair (the first coroutine to wait is the first to proceed), so requests
run in arrival order. More than ``queue_limit`` waiting requests -> 429. The lock is held until the engine
generator has actually returned, not merely until the HTTP handler ends, so a cancelled request never
overlaps the next one.

Cancellation: while a request waits (in the queue or on the engine) the handler polls
``request.is_disconnected()`` every :data:`DISCONNECT_POLL_S`; a stream's generator also sets the cancel
event when Starlette cancels it. The engine checks the event every layer step and raises ``Cancelled``,
so a client that goes away stops its request within one layer step plus one poll interval.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from abbench.engine.serve.api import APIError
from abbench.engine.contract import Backend, GenerateRequest, RequestStats

DISCONNECT_POLL_S = 0.02


class ClientGone(Exception):
    """The client disconnected while its request waited."""


@dataclass
class Finished:
    stats: RequestStats
    finished: float  # perf_counter when the generator returned


class ReceivedAt:
    """Pure ASGI middleware: stamps ``scope['abbench_received']`` (perf_counter) as the request reaches the
    application, before routing and body parsing, so the engine's timings start where the server got it."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            scope["abbench_received"] = time.perf_counter()
        await self.app(scope, receive, send)


class Job:
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


class CountedCancel:
    """A job's cancel flag as the engine sees it: the engine looks at it once per layer step of prefill and
    decode (``check_cancel``), and every look is counted on the service: ``cancel_checks`` (layer steps that
    checked) and ``cancel_checks_set`` (checks that found the flag set; the engine stops at the first one, so
    this grows by one per cancelled request). Lets a test say in layer steps, not wall time, where a
    cancelled request stopped. Only the worker thread writes them (one request at a time)."""

    __slots__ = ("event", "service")

    def __init__(self, event: threading.Event, service: EngineService):
        self.event = event
        self.service = service

    def is_set(self) -> bool:
        flagged = self.event.is_set()
        self.service.cancel_checks += 1
        if flagged:
            self.service.cancel_checks_set += 1
        return flagged


class EngineService:
    """Owns the engine, its worker thread and the FIFO gate; all methods run on the event loop."""

    def __init__(self, engine: Backend, *, queue_limit: int):
        self.engine = engine
        self.queue_limit = queue_limit
        self.cancel_checks = 0
        self.cancel_checks_set = 0
        self.waiting = 0
        self.running: Job | None = None
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
            await wait_unless_disconnected(acquiring, request)
        except BaseException:
            if not acquiring.done():
                acquiring.cancel()
            elif not acquiring.cancelled() and acquiring.exception() is None:
                self._lock.release()  # got the lock just as the client left: pass it on
            raise
        finally:
            self.waiting -= 1

    def start(self, request: GenerateRequest) -> Job:
        """Run ``request`` on the engine (``engine.generate``) in the worker thread (the caller holds the
        gate). The gate is released when the generator has returned or raised, whatever the HTTP side does."""
        job = Job(asyncio.get_running_loop())
        self.running = job
        fut = job.loop.run_in_executor(self._executor, self._run, job, request)
        fut.add_done_callback(lambda _f: self._finish(job))
        return job

    def _finish(self, job: Job) -> None:
        if self.running is job:
            self.running = None
        self._lock.release()

    def _run(self, job: Job, request: GenerateRequest) -> None:  # worker thread
        try:
            gen = self.engine.generate(request, CountedCancel(job.cancel, self))
            while True:
                try:
                    event = next(gen)
                except StopIteration as stop:
                    job.put(Finished(stop.value, time.perf_counter()))
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


async def wait_unless_disconnected(aw: asyncio.Future[Any], request: Request) -> Any:
    """Await ``aw`` while polling the client's connection; raises ClientGone when it goes away."""
    while True:
        done, _ = await asyncio.wait({aw}, timeout=DISCONNECT_POLL_S)
        if done:
            return aw.result()
        if await request.is_disconnected():
            raise ClientGone()


async def next_item(job: Job, request: Request) -> Any:
    """Next item from the worker; cancels the job if the client disconnects meanwhile (ClientGone)."""
    getter = asyncio.ensure_future(job.queue.get())
    try:
        return await wait_unless_disconnected(getter, request)
    except BaseException:
        job.cancel.set()
        getter.cancel()
        raise


# ------------------------------------------------------------------------------------------------ metrics


class _EngineCollector:
    """Reads the engine's lifetime counters and the service's queue at scrape time."""

    def __init__(self, service: EngineService):
        self.service = service

    def collect(self):  # noqa: ANN201 - prometheus_client collector protocol
        engine = self.service.engine
        info, counters = engine.info, dict(engine.counters)
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
        yield CounterMetricFamily("abbench_engine_cancel_checks", "Layer steps (prefill and decode) that "
                                  "checked the request's cancel flag.", value=self.service.cancel_checks)
        yield CounterMetricFamily("abbench_engine_cancel_checks_set", "Cancel checks that found the flag set "
                                  "(the engine stops at the first).", value=self.service.cancel_checks_set)
        yield GaugeMetricFamily("abbench_engine_h2d_bandwidth_bytes_per_second",
                                "Host-to-device bandwidth measured at startup.",
                                value=float(info.measured_h2d_gbps) * 1e9)
        yield GaugeMetricFamily("abbench_engine_bank_bytes", "Bytes of one layer's expert bank x layers "
                                "(the whole offloaded bank).", value=info.bank_bytes)
        yield GaugeMetricFamily("abbench_engine_startup_seconds", "Seconds the engine took to build.",
                                value=info.startup_s)
        yield GaugeMetricFamily("abbench_engine_queue_waiting", "Requests waiting for the engine.",
                                value=self.service.waiting)
        yield GaugeMetricFamily("abbench_engine_requests_running", "Requests running on the engine (0/1).",
                                value=int(self.service.running is not None))


class ServiceMetrics:
    """The server's Prometheus registry: the engine's lifetime counters (read at scrape time) and the
    finished requests' token counts and outcomes."""

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

    def observe(self, stats: RequestStats) -> None:
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.generation_tokens.inc(stats.completion_tokens)
        self.cached_prompt_tokens.inc(stats.cached_prompt_tokens)
