"""Drive one load level of one arm against one running service, and record it.

Contract
--------
:func:`run_level` runs a :class:`Level` (closed loop: ``concurrency`` N, N requests always in flight; open loop:
``rate`` R, requests sent at the seeded due times of :func:`abbench.loadgen.plan.arrivals` whether or not
earlier ones have finished, so a slow server cannot slow the arrivals: no coordinated omission) against a
:class:`Target` (base URL, adapter, request fields) with the load prompts, in a fresh asyncio event loop, and
returns a :class:`~abbench.loadrecords.LoadLevel` holding every request: finished, failed, refused (HTTP 429)
or cut off by an interrupt (``error_kind`` "interrupted", and ``LoadLevel.stopped`` says so). Nothing is
dropped.

Request bodies are built before the level starts, by the target's :class:`~abbench.adapters.Adapter`
(:meth:`~abbench.adapters.Adapter.build_body`, the arm's fields merged as the synchronous client merges them);
streams are read by :mod:`abbench.loadgen.wire` and, after the level, verified by
:func:`abbench.response.finish` (the synchronous client's checks and error kinds: ``usage`` when the server
counted another prompt length, ``finish-reason``, ``no-done``...). Verifying after the level keeps the event
loop free to stamp arrivals while the level runs; a llama.cpp stream that left out the ids of tokens ending
inside a UTF-8 character is completed then as the synchronous client completes it (the request once more, not
streamed: :meth:`_Driver.refetch`).

Connections: a closed loop opens its N connections before the level's clock starts and keeps each busy; an
open loop opens :data:`PREOPEN` before it starts and a new one whenever no idle connection is free when a
request is due (the connect then counts in ``sent_s - scheduled_s``, the generator's lag, not in TTFT).

The engine's metrics path, when given, is scraped every ``scrape_interval_s`` from a thread, and the GPUs are
sampled through NVML where it is available (:mod:`abbench.loadgen.scrape`).
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from abbench.adapters import Adapter, get_adapter
from abbench.client import EngineClient
from abbench.client import _with_refetched_ids as with_refetched_ids
from abbench.errors import RequestError
from abbench.loadgen.plan import LoadPrompt, arrivals, request_prompt
from abbench.loadgen.scrape import Scraper
from abbench.loadgen.wire import Connection, Exchange, Pool, request_bytes
from abbench.loadrecords import LoadLevel, LoadRequest, LoadScrape
from abbench.nvml import nvml_available
from abbench.profile import LoadSpec, RequestSpec
from abbench.response import Completion, RawResponse, ShortIds, finish

__all__ = ["PREOPEN", "Level", "Target", "run_level"]

PREOPEN = 16
"""Connections an open-loop level opens before its clock starts."""


@dataclass(frozen=True)
class Level:
    """One level as it is run: kind ("concurrency" | "rate"), value, how many requests or how long, the windows
    excluded from the measurement, and the arrival process (open loop)."""

    kind: str
    value: float
    requests: int | None = 32
    duration_s: float | None = None
    warmup_s: float = 0.0
    cooldown_s: float = 0.0
    arrival: str = "poisson"
    burstiness: float = 1.0
    seed: int = 0
    round: int = 1
    role: str = "load"
    scrape_interval_s: float = 1.0

    @classmethod
    def from_spec(cls, load: LoadSpec, kind: str, value: float, *, round: int = 1, role: str = "load") -> Level:
        """A level of a profile's ``[load]`` table; ``role`` "reference" is concurrency 1 over every prompt once."""
        if role == "reference":
            return cls("concurrency", 1.0, requests=load.n_prompts, seed=load.seed, round=round, role=role,
                       scrape_interval_s=load.scrape_interval_s)
        return cls(kind, value, requests=load.n_requests, duration_s=load.duration_s, warmup_s=load.warmup_s,
                   cooldown_s=load.cooldown_s, arrival=load.arrival, burstiness=load.burstiness, seed=load.seed,
                   round=round, role=role, scrape_interval_s=load.scrape_interval_s)

    @classmethod
    def warmup_of(cls, load: LoadSpec, kind: str, value: float, *, round: int = 1) -> Level:
        """The warm-up sent before a level (``load.warmup_requests``, never recorded): closed loop at the level's
        concurrency, or for a rate level every warm-up request in flight at once."""
        n = load.warmup_requests
        c = min(value, n) if kind == "concurrency" else n
        return cls("concurrency", float(c), requests=n, seed=load.seed, round=round,
                   scrape_interval_s=load.scrape_interval_s)


@dataclass(frozen=True)
class Target:
    """Where and how requests go: one running service, one arm's wire format and request fields."""

    base_url: str
    request: RequestSpec
    adapter: str | Adapter = "openai"
    extra: Mapping[str, Any] = field(default_factory=dict)
    model: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    metrics_path: str = ""
    arm: str = ""
    service: str = ""
    position: int = 0
    verify: ssl.SSLContext | bool = True
    """https: the CA rules (:func:`abbench.auth.tls_verify`)."""
    gpus: list[int] | None = None
    """NVML indices of the service's GPUs, sampled during a level where NVML is available (None: every GPU)."""
    sample_gpus: bool = True


class _Req:
    __slots__ = ("k", "prompt", "scheduled", "attempt", "ex", "error")

    def __init__(self, k: int, prompt: LoadPrompt, scheduled: float | None) -> None:
        self.k, self.prompt, self.scheduled = k, prompt, scheduled
        self.attempt: float | None = None  # perf_counter when it was started (its send, or its connect)
        self.ex: Exchange | None = None
        self.error: RequestError | None = None


class _Driver:
    """The level's state inside the event loop."""

    def __init__(self, level: Level, target: Target, prompts: list[LoadPrompt]) -> None:
        self.level, self.target, self.prompts = level, target, prompts
        self.ad = get_adapter(target.adapter)
        self.pool = Pool(target.base_url, connect_timeout_s=min(10.0, target.request.timeout_s), verify=target.verify)
        self.path = self.pool.prefix + self.ad.completion_path
        self.what = f"POST {target.base_url.rstrip('/')}{self.ad.completion_path}"
        self.headers = [("connection", "close")] if self.ad.closes_after_stream else []
        self.headers += [(k.lower(), v) for k, v in target.headers.items()]
        self.bodies: dict[str, bytes] = {}  # the whole request, head and body
        self.ignore_eos: dict[str, bool] = {}
        host = self.pool.host_header
        for p in prompts:
            req = target.request.model_copy(update={"max_tokens": p.max_tokens})
            body = self.ad.build_body(p.prompt, request=req, extra=target.extra, model=target.model)
            self.bodies[p.id] = request_bytes(host, self.path, json.dumps(body, ensure_ascii=False).encode("utf-8"),
                                              self.headers)
            self.ignore_eos[p.id] = self.ad.ignore_eos_sent(body)
        self.reqs: list[_Req] = []
        self.t0 = 0.0
        self._sync: EngineClient | None = None  # after the level: the non-streamed repeats of short streams

    def refetch(self, p: LoadPrompt, short: ShortIds, raw: RawResponse, started_at: float,
                retokenize: Callable[[str], list[int]] | None) -> Completion:
        """A stream that left out ids of tokens ending inside a UTF-8 character (llama.cpp), completed as the
        synchronous client completes it: the same request once more, not streamed, after the level; its ids
        replace the stream's only if they agree with everything the stream carried. Timings stay the stream's."""
        if self._sync is None:
            self._sync = EngineClient(verify=self.target.verify)
        t = self.target
        again = self._sync.complete(t.base_url, p.prompt, request=t.request.model_copy(
            update={"max_tokens": p.max_tokens, "stream": False}), extra=t.extra, target_prompt_tokens=p.target_tokens,
            model=t.model, retokenize=retokenize, adapter=self.ad, headers=t.headers)
        return with_refetched_ids(short, again, raw, started_at, self.what)

    def close(self) -> None:
        if self._sync is not None:
            self._sync.close()

    def _send(self, r: _Req, conn: Connection) -> Exchange:
        loop = asyncio.get_running_loop()
        ex = Exchange(self.ad, self.what, loop)
        r.ex = ex
        conn.send(ex, self.bodies[r.prompt.id], close_after=self.ad.closes_after_stream)
        r.attempt = ex.t0 or time.perf_counter()
        timer = loop.call_later(self.target.request.timeout_s, _expire, ex, conn, self.target.request.timeout_s)
        ex.done.add_done_callback(lambda _f: timer.cancel())
        return ex

    async def _one(self, r: _Req, conn: Connection | None) -> Connection | None:
        """Send ``r`` (on ``conn``, or a new connection) and wait for its end; the connection, if reusable."""
        if conn is not None and not conn.reusable:  # closed by the server since its last response
            conn.abort()
            conn = None
        if conn is None:
            r.attempt = time.perf_counter()
            try:
                conn = await self.pool.connect()
            except RequestError as e:
                r.error = e
                return None
        ex = self._send(r, conn)
        await ex.done
        return conn if conn.reusable else None

    async def closed_loop(self, n_conc: int) -> None:
        lv = self.level
        n = lv.requests
        conns: list[Connection | None] = []
        for _ in range(n_conc if n is None else min(n_conc, n)):
            try:
                conns.append(await self.pool.connect())
            except RequestError:
                conns.append(None)
        self.t0 = time.perf_counter()
        counter = iter(range(n if n is not None else 1 << 62))

        async def worker(conn: Connection | None) -> None:
            for k in counter:
                if lv.duration_s is not None and time.perf_counter() - self.t0 >= lv.duration_s:
                    return
                r = _Req(k, request_prompt(self.prompts, k), None)
                self.reqs.append(r)
                conn = await self._one(r, conn)
            if conn is not None:
                conn.abort()

        await asyncio.gather(*(worker(c) for c in conns))

    async def open_loop(self, rate: float) -> None:
        lv = self.level
        due = arrivals(rate, n=lv.requests if lv.duration_s is None else None, duration_s=lv.duration_s,
                       burstiness=lv.burstiness if lv.arrival == "gamma" else 1.0, seed=lv.seed, round=lv.round)
        for _ in range(min(PREOPEN, len(due))):
            try:
                self.pool.give_back(await self.pool.connect())
            except RequestError:
                break
        tasks: list[asyncio.Future[Any]] = []
        self.t0 = time.perf_counter()
        for k, at in enumerate(due):
            wait = self.t0 + at - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            r = _Req(k, request_prompt(self.prompts, k), at)
            self.reqs.append(r)
            conn = self.pool.take_idle()
            if conn is not None:  # sent now, in this callback: no task switch between due and sent
                ex = self._send(r, conn)
                tasks.append(asyncio.ensure_future(self._back(ex, conn)))
            else:
                tasks.append(asyncio.ensure_future(self._connect_and_send(r)))
        await asyncio.gather(*tasks)

    async def _back(self, ex: Exchange, conn: Connection) -> None:
        await ex.done
        self.pool.give_back(conn)

    async def _connect_and_send(self, r: _Req) -> None:
        conn = await self._one(r, None)
        if conn is not None:
            self.pool.give_back(conn)


def _expire(ex: Exchange, conn: Connection, seconds: float) -> None:
    if not ex.done.done():
        conn.abort()
        ex.fail(RequestError("timeout", f"{ex.what}: no complete response within {seconds:g} s (request.timeout_s)"))


def run_level(level: Level, target: Target, prompts: list[LoadPrompt], *,
              retokenize: Callable[[str], list[int]] | None = None) -> LoadLevel:
    """Run ``level`` against ``target`` with ``prompts`` (module docstring) and return its record."""
    if not prompts:
        raise ValueError("a load level needs at least one prompt")
    if level.kind == "concurrency" and not (level.value >= 1 and float(level.value).is_integer()):
        raise ValueError(f"concurrency {level.value!r}: a whole number of requests in flight, >= 1")
    if level.kind == "rate" and not level.value > 0:
        raise ValueError(f"rate {level.value!r}: requests/s above 0")
    drv = _Driver(level, target, prompts)
    scraper = None
    gpus = target.sample_gpus and nvml_available()
    if target.metrics_path or gpus:
        url = target.base_url.rstrip("/") + "/" + target.metrics_path.lstrip("/") if target.metrics_path else None
        scraper = Scraper(url, level.scrape_interval_s, target.headers, target.verify,
                          gpus=target.gpus if gpus else False)
    started_at = time.time()
    stopped: str | None = None

    if scraper is not None:
        scraper.start()

    async def main() -> None:
        try:
            if level.kind == "concurrency":
                await drv.closed_loop(int(level.value))
            else:
                await drv.open_loop(level.value)
        finally:
            drv.pool.close()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        stopped = "interrupted: the requests that finished are kept; the level runs again when the run resumes"
    finally:
        scrapes = scraper.stop() if scraper is not None else []
    if scraper is not None:  # the scraper's clock started before the level's: shift it onto the level's
        scrapes = [LoadScrape(t=round(s.t - (drv.t0 - scraper.t0), 6), metrics=s.metrics) for s in scrapes]
    return _record(drv, level, target, started_at, scrapes, scraper.error if scraper else None, stopped, retokenize)


def _record(drv: _Driver, level: Level, target: Target, started_at: float, scrapes: list[LoadScrape],
            scrape_error: str | None, stopped: str | None,
            retokenize: Callable[[str], list[int]] | None) -> LoadLevel:
    t0 = drv.t0
    try:
        rows = [_request(drv, r, t0, started_at, retokenize) for r in sorted(drv.reqs, key=lambda r: r.k)]
    finally:
        drv.close()
    sends = [x.sent_s for x in rows]
    last_send = max(sends) if sends else 0.0
    ends = [x.end_s for x in rows if x.end_s is not None]
    return LoadLevel(
        arm=target.arm, round=level.round, position=target.position, service=target.service,
        role=level.role,  # type: ignore[arg-type]
        kind=level.kind,  # type: ignore[arg-type]
        value=level.value, arrival=level.arrival if level.kind == "rate" else None,  # type: ignore[arg-type]
        burstiness=level.burstiness if level.kind == "rate" else None, seed=level.seed,
        adapter=drv.ad.name, base_url=target.base_url, started_at=started_at, clock_s=t0, warmup_s=level.warmup_s,
        cooldown_s=level.cooldown_s, window_start_s=level.warmup_s,
        window_end_s=max(level.warmup_s, last_send - level.cooldown_s),
        elapsed_s=round(max(ends) if ends else last_send, 6), requests=rows, scrapes=scrapes,
        scrape_error=scrape_error, stopped=stopped)


def _request(drv: _Driver, r: _Req, t0: float, started_at: float,
             retokenize: Callable[[str], list[int]] | None) -> LoadRequest:
    p, ex = r.prompt, r.ex
    sent = (ex.t0 if ex is not None and ex.t0 else r.attempt or t0) - t0
    base: dict[str, Any] = {"index": r.k, "prompt_id": p.id, "target_tokens": p.target_tokens,
                            "prompt_sha256": p.record.sha256 if p.record is not None else None,
                            "max_tokens": p.max_tokens, "sent_s": round(sent, 6),
                            "scheduled_s": None if r.scheduled is None else round(r.scheduled, 6)}
    if ex is None or r.error is not None:
        err = r.error or RequestError("interrupted", "the level was interrupted before this request was sent")
        return LoadRequest(**base, ok=False, error_kind=err.kind, error=err.detail, status=err.status,
                           end_s=round(sent, 6))
    base["end_s"] = None if ex.end is None else round(ex.end - t0, 6)
    if ex.ttft is not None:
        base["first_token_s"] = round(ex.t0 + ex.ttft - t0, 6)
    if not ex.done.done() or ex.done.cancelled() or ex.end is None:  # cut off by an interrupt
        return LoadRequest(**base, ok=False, error_kind="interrupted",
                           error="the level was interrupted before this response ended", status=ex.status)
    sent_at = started_at + (ex.t0 - t0)
    try:
        if ex.error is not None:
            raise ex.error
        raw = ex.raw()
        try:
            c = finish(raw, drv.ad, drv.ignore_eos[p.id], sent_at, p.target_tokens, retokenize, drv.what)
        except ShortIds as short:
            if not drv.ad.refetch_short_stream_ids or raw.ttft is None:
                raise
            c = drv.refetch(p, short, raw, sent_at, retokenize)
    except RequestError as e:
        return LoadRequest(**base, ok=False, error_kind=e.kind, error=e.detail, status=e.status or ex.status)
    return LoadRequest(**base, ok=True, status=ex.status, token_times_s=c.token_times_s, output_ids=c.output_ids,
                       ids_source=c.ids_source, finish_reason=c.finish_reason, prompt_tokens=c.prompt_tokens,
                       completion_tokens=c.completion_tokens, logprobs=c.logprobs, engine=c.engine)

