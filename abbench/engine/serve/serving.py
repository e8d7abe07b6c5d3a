"""Serving the engine: every request through the backend's scheduler, in one engine thread; and its metrics.

Scheduling: the backend's :class:`~abbench.engine.contract.Scheduler` decides what runs: the vendored engine's
continuous batching (:mod:`abbench.engine.runtime.scheduler`: up to ``max_num_seqs`` sequences at once, queued
layer-major prompts prefilled together), or one request at a time in arrival order
(:class:`~abbench.engine.contract.SerialScheduler`, the reference backend). One engine thread calls its ``step``
while there is work and sleeps otherwise; requests are submitted from the event loop and their events come back
through an ``asyncio.Queue`` per request. More than ``queue_limit`` requests queued beyond what can start at
once -> 429. ``/reset`` runs in the engine thread once nothing is queued or running.

Cancellation: while a request waits (queued or running) the handler polls ``request.is_disconnected()`` every
:data:`DISCONNECT_POLL_S`; a stream's generator also sets the cancel flag when Starlette cancels it. A queued
request then leaves the queue; a running one stops at its next layer step (prefill and decode check the flag at
every layer step); the others go on.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from typing import Any

from fastapi import Request
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from abbench.engine.serve.api import APIError
from abbench.engine.contract import Backend, Finished, GenerateRequest, Handle, RequestStats

__all__ = ["ClientGone", "EngineService", "Finished", "Job", "ReceivedAt", "ServiceMetrics", "next_item"]

DISCONNECT_POLL_S = 0.02
log = logging.getLogger("abbench.engine")


class ClientGone(Exception):
    """The client disconnected while its request waited."""


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
    """One request on the engine: events flow engine thread -> ``queue``; ``cancel`` flows back."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.cancel = threading.Event()
        self.handle: Handle | None = None

    def put(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # event loop closed during shutdown: nobody is listening any more
            pass

    @property
    def queue_wait_s(self) -> float:
        """Seconds from submission until the request started on the engine (so far, while still queued)."""
        h = self.handle
        if h is None:
            return 0.0
        return (h.admitted if h.admitted is not None else time.perf_counter()) - h.submitted


class CountedCancel:
    """A job's cancel flag as the engine sees it: the engine looks at it once per layer step of prefill and
    decode (``check_cancel``), and every look is counted on the service: ``cancel_checks`` (layer steps that
    checked) and ``cancel_checks_set`` (checks that found the flag set; the engine stops a running request at the
    first, so this grows by one per cancelled request). Lets a test say in layer steps, not wall time, where a
    cancelled request stopped. Only the engine thread writes them."""

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
    """Owns the backend's engine thread and the queue limit; the other methods run on the event loop."""

    def __init__(self, engine: Backend, *, queue_limit: int):
        self.engine = engine
        self.scheduler = engine.scheduler
        self.queue_limit = queue_limit
        self.cancel_checks = 0
        self.cancel_checks_set = 0
        self._jobs: set[Job] = set()
        self._controls: deque[tuple[Any, asyncio.Future, asyncio.AbstractEventLoop]] = deque()
        self._ask: str | None = None  # "prime" or "drop" for the engine thread (prime, unprime)
        self._wake = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="abbench-engine", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        """Requests queued for the engine, not started."""
        return len(self.scheduler.waiting)

    @property
    def running(self) -> int:
        """Requests running on the engine."""
        return len(self.scheduler.running)

    def submit(self, request: GenerateRequest) -> Job:
        """Queue ``request`` for the engine; APIError(429) when ``queue_limit`` requests already wait beyond
        what can start now."""
        if self.waiting >= self.queue_limit + self.scheduler.free:
            raise APIError(429, f"too many waiting requests (queue limit {self.queue_limit})", code="queue_full")
        job = Job(asyncio.get_running_loop())
        self._jobs.add(job)

        def emit(item: Any) -> None:
            if isinstance(item, (Finished, BaseException)):
                self._jobs.discard(job)
            job.put(item)

        with self._wake:
            job.handle = self.scheduler.submit(request, CountedCancel(job.cancel, self), emit)
            self._wake.notify()
        return job

    def prime(self) -> None:
        """A completion request has arrived (called before its body is read): unless sequences are running, the
        engine thread starts what every streamed prefill needs first (``Backend.prime_prefill``), before it starts
        anything queued, so that the copy overlaps the parsing and tokenization. Never waits."""
        if self.scheduler.running:
            return
        with self._wake:
            self._ask = "prime"
            self._wake.notify()

    def unprime(self) -> None:
        """The request a prime was for failed before its prefill: the engine thread forgets the prime, if it is
        still there and the engine idle (``Backend.drop_prime``)."""
        with self._wake:
            self._ask = "drop"
            self._wake.notify()

    def withdraw(self, job: Job) -> bool:
        """Take ``job`` out of the engine's queue if it has not started (its client left); True if it was queued."""
        return job.handle is not None and self.scheduler.withdraw(job.handle)

    def _loop(self) -> None:  # the engine thread
        while True:
            with self._wake:
                while not (self._stop or self.scheduler.busy or self._controls or self._ask):
                    self._wake.wait()
                if self._stop:
                    return
                control = self._controls.popleft() if self._controls and not self.scheduler.busy else None
                ask, self._ask = self._ask, None
            if ask is not None and not self.scheduler.running:
                fn = getattr(self.engine, "prime_prefill" if ask == "prime" else "drop_prime", None)
                try:
                    if fn is not None:  # a backend without it streams nothing ahead
                        fn()
                except Exception:  # noqa: BLE001 - an optimisation: the request copies for itself
                    log.exception("engine %s failed", ask)
            if control is not None:
                self._control(*control)
                continue
            if not self.scheduler.busy:
                continue
            try:
                self.scheduler.step()
            except BaseException as exc:  # noqa: BLE001 - a bug: every request hears of it, the thread goes on
                log.exception("engine step failed; failing every request")
                self.scheduler.fail_all(exc)

    @staticmethod
    def _control(fn: Any, fut: asyncio.Future, loop: asyncio.AbstractEventLoop) -> None:
        try:
            result = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            err = exc
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_exception(err))
            return
        loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(result))

    async def run_exclusive(self, fn: Any) -> Any:
        """Run ``fn()`` in the engine thread once nothing is queued or running (used by /reset)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._wake:
            self._controls.append((fn, fut, loop))
            self._wake.notify()
        return await fut

    def shutdown(self) -> None:
        for job in list(self._jobs):
            job.cancel.set()
        with self._wake:
            self._stop = True
            self._wake.notify()


async def wait_unless_disconnected(aw: asyncio.Future[Any], request: Request) -> Any:
    """Await ``aw`` while polling the client's connection; raises ClientGone when it goes away."""
    while True:
        done, _ = await asyncio.wait({aw}, timeout=DISCONNECT_POLL_S)
        if done:
            return aw.result()
        if await request.is_disconnected():
            raise ClientGone()


async def next_item(job: Job, request: Request) -> Any:
    """Next item from the engine; cancels the job if the client disconnects meanwhile (ClientGone)."""
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
        store = getattr(engine, "store", None)
        if store is not None and hasattr(store, "primes_taken"):
            family = CounterMetricFamily(
                "abbench_engine_first_layer_primes", "First-layer bank copies started as a request reached the idle "
                "engine, by outcome: taken by its prefill (its bytes are in h2d_bytes), or dropped (the request "
                "failed first, or a demand prefill wrote over it; one layer's bank each, not in h2d_bytes).",
                labels=["outcome"])
            family.add_metric(["taken"], store.primes_taken)
            family.add_metric(["dropped"], store.primes_dropped)
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
        yield GaugeMetricFamily("abbench_engine_requests_running", "Requests running on the engine.",
                                value=self.service.running)


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
