"""One streamed completion over an asyncio connection, stamped as the synchronous client stamps it.

Contract
--------
:class:`Connection` is one keep-alive HTTP/1.1 connection (``asyncio.Protocol``, ``TCP_NODELAY``, HTTP framing
by ``h11``) that carries one request at a time. :meth:`Connection.send` writes a request at once (no await
between the ``sent`` stamp and the write) and returns an :class:`Exchange`, whose future resolves when the
response has ended or failed. Every network chunk is stamped with ``time.perf_counter`` in
``data_received``, before it is parsed, as :class:`abbench.client.EngineClient` stamps its chunks; the body is
read with the SSE parser of :mod:`abbench.sse`, and, as there, events are decoded only up to the first that
carries text (the adapter's ``has_text``): the rest are kept as text and decoded after the level, so the loop
does no heavy work per event. :meth:`Exchange.raw` gives the :class:`abbench.response.RawResponse` that
:func:`abbench.response.finish` verifies, with the same error kinds.

An exchange fails with a :class:`~abbench.errors.RequestError`: ``http`` (any non-2xx status, 429 included;
``status`` set and the server's message), ``connect`` (refused, reset, closed before the end), ``timeout``
(no complete response within the whole-response deadline: the connection is aborted), ``sse`` or
``protocol`` (a stream that is not ``text/event-stream``, or malformed). A failed connection is never reused.

:class:`Pool` keeps idle connections to one server, drops those idle longer than
:data:`abbench.client.KEEPALIVE_EXPIRY_S` (the common servers close theirs after 5 s) and opens new ones.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections import deque
from typing import Any
from urllib.parse import urlsplit

import h11

from abbench.adapters import Adapter
from abbench.client import KEEPALIVE_EXPIRY_S
from abbench.client import _error_message as _message
from abbench.errors import RequestError
from abbench.response import RawResponse
from abbench.sse import SNIPPET, SSEParser

__all__ = ["Connection", "Exchange", "Pool"]

_ERROR_LIMIT = 64 * 1024  # bytes of an error body kept for its message


class Exchange:
    """One request on a :class:`Connection`: its stamps (perf_counter seconds), its events and its outcome."""

    __slots__ = ("adapter", "what", "t0", "ttft", "end", "status", "parser", "decoded", "later", "arrived",
                 "saw_done", "error", "done", "_body", "_stream", "_has_text", "_marker")

    def __init__(self, adapter: Adapter, what: str, loop: asyncio.AbstractEventLoop) -> None:
        self.adapter = adapter
        self.what = what
        self.t0 = 0.0  # perf_counter just before the write
        self.ttft: float | None = None  # seconds after t0
        self.end: float | None = None  # perf_counter at the end or failure
        self.status: int | None = None
        self.parser = SSEParser()
        self.decoded: list[Any] = []
        self.later: list[str] = []
        self.arrived: list[float] = []
        self.saw_done = False
        self.error: RequestError | None = None
        self.done: asyncio.Future[None] = loop.create_future()
        self._body = bytearray()  # an error body (non-2xx)
        self._stream = False
        self._has_text = adapter.has_text
        self._marker = adapter.done_marker

    def _headers(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.status = status
        if not 200 <= status < 300:
            return
        ctype = next((v for k, v in headers if k == b"content-type"), b"").decode("latin-1")
        if ctype.split(";", 1)[0].strip().lower() != "text/event-stream":
            raise RequestError("protocol", f"{self.what}: content-type {ctype!r}, expected text/event-stream")
        self._stream = True

    def _data(self, chunk: bytes, t: float) -> None:
        if not self._stream:
            if len(self._body) < _ERROR_LIMIT:
                self._body += chunk
            return
        for ev in self.parser.feed(chunk):
            data = ev.data
            if self.saw_done:
                raise RequestError("sse", f"{self.what}: data after [DONE]: {data[:SNIPPET]!r}")
            if data == self._marker:
                self.saw_done = True
                continue
            self.arrived.append(t - self.t0)
            if self.ttft is None:
                try:
                    obj = json.loads(data)
                except ValueError:
                    raise RequestError("sse", f"{self.what}: event {len(self.decoded)} is not JSON: "
                                              f"{data[:SNIPPET]!r}") from None
                self.decoded.append(obj)
                if self._has_text(obj):
                    self.ttft = t - self.t0
            else:
                self.later.append(data)

    def _finish(self, t: float) -> None:
        self.end = t
        if self.status is not None and not 200 <= self.status < 300:
            self.error = RequestError("http", f"{self.what}: HTTP {self.status}: {_message(bytes(self._body))}",
                                      status=self.status)
        else:
            try:
                self.parser.close()
            except RequestError as e:
                self.error = RequestError(e.kind, f"{self.what}: {e.detail}")
        if not self.done.done():
            self.done.set_result(None)

    def fail(self, error: RequestError, t: float | None = None) -> None:
        if self.done.done():
            return
        self.end = time.perf_counter() if t is None else t
        self.error = error
        self.done.set_result(None)

    def raw(self) -> RawResponse:
        """The response for :func:`abbench.response.finish` (the later events decoded now)."""
        offset = len(self.decoded)
        events = list(self.decoded)
        for i, d in enumerate(self.later):
            try:
                events.append(json.loads(d))
            except ValueError:
                raise RequestError("sse", f"{self.what}: event {offset + i} is not JSON: {d[:SNIPPET]!r}") from None
        total = (self.end or self.t0) - self.t0
        return RawResponse(events=events, ttft=self.ttft, total=total, saw_done=self.saw_done, streamed=True,
                           event_times=list(self.arrived))


class Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection (module docstring)."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.h11 = h11.Connection(h11.CLIENT)
        self.transport: asyncio.Transport | None = None
        self.current: Exchange | None = None
        self.closed = False
        self.idle_since = time.monotonic()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass

    def send(self, ex: Exchange, target: str, body: bytes, headers: list[tuple[str, str]]) -> None:
        """Write the request now; ``ex.t0`` is stamped just before the write."""
        assert self.current is None and self.transport is not None
        self.current = ex
        h = [("host", self.host), ("content-type", "application/json"), ("accept", "text/event-stream"),
             ("accept-encoding", "identity"), ("content-length", str(len(body))), *headers]
        try:
            data = self.h11.send(h11.Request(method="POST", target=target, headers=h))
            data += self.h11.send(h11.Data(data=body))
            data += self.h11.send(h11.EndOfMessage())
        except h11.LocalProtocolError as e:
            self.abort()
            ex.fail(RequestError("connect", f"{ex.what}: the connection cannot take a request ({e})"))
            return
        ex.t0 = time.perf_counter()
        self.transport.write(data)

    def data_received(self, data: bytes) -> None:
        t = time.perf_counter()
        ex = self.current
        try:
            self.h11.receive_data(data)
            while True:
                event = self.h11.next_event()
                if event is h11.NEED_DATA or event is h11.PAUSED:
                    return
                if ex is None:
                    raise RequestError("protocol", f"the server sent {type(event).__name__} with no request out")
                if isinstance(event, h11.Response):
                    ex._headers(event.status_code, list(event.headers))
                elif isinstance(event, h11.Data):
                    ex._data(bytes(event.data), t)
                elif isinstance(event, h11.EndOfMessage):
                    self.current = None
                    ex._finish(t)
                    self._recycle()
                    return
                elif isinstance(event, h11.ConnectionClosed):
                    raise RequestError("connect", "the connection was closed before the response ended")
        except h11.RemoteProtocolError as e:
            self._fail(RequestError("protocol", f"{ex.what if ex else 'response'}: invalid HTTP ({e})"), t)
        except RequestError as e:
            self._fail(e if ex is None or e.detail.startswith(ex.what) else
                       RequestError(e.kind, f"{ex.what}: {e.detail}", status=e.status), t)

    def eof_received(self) -> bool | None:
        try:
            self.h11.receive_data(b"")
        except h11.RemoteProtocolError:
            pass
        if self.current is not None:  # a response delimited by the close
            self.data_received(b"")
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        ex, self.current = self.current, None
        if ex is not None and not ex.done.done():
            ex.fail(RequestError("connect", f"{ex.what}: the connection was dropped after {len(ex.arrived)} "
                                            f"events{f': {exc}' if exc else ''}"))

    def _fail(self, error: RequestError, t: float) -> None:
        ex, self.current = self.current, None
        self.abort()
        if ex is not None:
            ex.fail(error, t)

    def _recycle(self) -> None:
        if self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE:
            self.h11.start_next_cycle()
            self.idle_since = time.monotonic()
        else:
            self.abort()

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    @property
    def reusable(self) -> bool:
        return (not self.closed and self.current is None and self.h11.our_state is h11.IDLE
                and time.monotonic() - self.idle_since < KEEPALIVE_EXPIRY_S)


class Pool:
    """Connections to one server (``base_url``): idle ones reused, stale ones closed, new ones opened."""

    def __init__(self, base_url: str, connect_timeout_s: float = 10.0) -> None:
        u = urlsplit(base_url)
        if u.scheme != "http" or not u.hostname:
            raise RequestError("connect", f"{base_url}: the load generator speaks plain http:// only")
        self.host, self.port = u.hostname, u.port or 80
        self.prefix = u.path.rstrip("/")
        self.connect_timeout_s = connect_timeout_s
        self.idle: deque[Connection] = deque()
        self.opened = 0

    def take_idle(self) -> Connection | None:
        while self.idle:
            c = self.idle.pop()  # the most recently used first
            if c.reusable:
                return c
            c.abort()
        return None

    async def connect(self) -> Connection:
        loop = asyncio.get_running_loop()
        host = self.host if self.port == 80 else f"{self.host}:{self.port}"
        try:
            _, proto = await asyncio.wait_for(
                loop.create_connection(lambda: Connection(host), self.host, self.port), self.connect_timeout_s)
        except asyncio.TimeoutError:
            raise RequestError("timeout", f"could not connect to {self.host}:{self.port} within "
                                          f"{self.connect_timeout_s:g} s") from None
        except OSError as e:
            raise RequestError("connect", f"cannot connect to {self.host}:{self.port}: {e}") from None
        self.opened += 1
        return proto

    def give_back(self, c: Connection) -> None:
        if c.reusable:
            self.idle.append(c)
        else:
            c.abort()

    def close(self) -> None:
        while self.idle:
            self.idle.pop().abort()

