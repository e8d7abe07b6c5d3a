"""One streamed completion over an asyncio connection, stamped as the synchronous client stamps it.

Contract
--------
:class:`Connection` is one keep-alive HTTP/1.1 connection (``asyncio.Protocol``, ``TCP_NODELAY``; the response framed
by a small HTTP/1.1 reader of its own: chunked, content-length or close-delimited bodies, interim 1xx skipped)
that carries one request at a time. :meth:`Connection.send` writes a request built before the level at once
(no await between the ``sent`` stamp and the write) and returns an :class:`Exchange`, whose future resolves when the
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

:class:`Pool` keeps idle connections to one server (http, or https with the client's CA rules), drops those idle longer than
:data:`abbench.client.KEEPALIVE_EXPIRY_S` (the common servers close theirs after 5 s) and opens new ones.
"""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import time
from collections import deque
from typing import Any
from urllib.parse import urlsplit

from abbench.adapters import Adapter
from abbench.client import KEEPALIVE_EXPIRY_S
from abbench.client import _error_message as _message
from abbench.errors import RequestError
from abbench.response import RawResponse
from abbench.sse import SNIPPET, SSEParser

__all__ = ["Connection", "Exchange", "Pool", "request_bytes"]

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


_HEAD, _SIZE, _CHUNK, _CRLF, _TRAILER, _LENGTH, _TO_CLOSE, _DONE = range(8)
_HEAD_LIMIT = 64 * 1024  # bytes of a response head, and of a chunk-size or trailer line


def request_bytes(host: str, target: str, body: bytes, headers: list[tuple[str, str]]) -> bytes:
    """One POST of ``body`` (JSON) as HTTP/1.1 bytes, built once before a level so a send is one write."""
    lines = [f"POST {target} HTTP/1.1", f"host: {host}", "content-type: application/json",
             "accept: text/event-stream", "accept-encoding: identity", f"content-length: {len(body)}",
             *(f"{k}: {v}" for k, v in headers)]
    for line in lines:
        if "\r" in line or "\n" in line:
            raise ValueError(f"a header holds a line break: {line!r}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


class Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection (module docstring). The response is framed here (status line and
    headers; chunked, content-length or close-delimited body), with as little work per chunk as it takes."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.transport: asyncio.Transport | None = None
        self.current: Exchange | None = None
        self.closed = False
        self.idle_since = time.monotonic()
        self._buf = b""
        self._state = _DONE
        self._left = 0  # bytes left of a chunk or a content-length body
        self._keep = True  # the response allows another request on this connection
        self._close_after = False  # the client decided not to reuse it after this response

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass

    def send(self, ex: Exchange, data: bytes, *, close_after: bool = False) -> None:
        """Write the request bytes now (:func:`request_bytes`); ``ex.t0`` is stamped just before the write.
        ``close_after``: the connection is not reused after this response (a server that closes it after every
        stream without saying so: ``Adapter.closes_after_stream``)."""
        assert self.current is None and self.transport is not None
        if self.closed:  # never write into a connection already lost: that would wait for its timeout
            ex.t0 = time.perf_counter()
            ex.fail(RequestError("connect", f"{ex.what}: the connection was closed before the request went out"))
            return
        self.current = ex
        self._buf, self._state, self._keep = b"", _HEAD, True
        self._close_after = close_after
        ex.t0 = time.perf_counter()
        self.transport.write(data)

    def data_received(self, data: bytes) -> None:
        t = time.perf_counter()
        ex = self.current
        if ex is None:  # nothing was asked: a server that talks out of turn cannot be trusted with the next one
            self.abort()
            return
        try:
            self._feed(ex, self._buf + data if self._buf else data, t)
        except RequestError as e:
            self._fail(e if e.detail.startswith(ex.what) else RequestError(e.kind, f"{ex.what}: {e.detail}",
                                                                              status=e.status), t)
        except ValueError as e:
            self._fail(RequestError("protocol", f"{ex.what}: invalid HTTP from the server ({e})"), t)

    def _feed(self, ex: Exchange, buf: bytes, t: float) -> None:
        self._buf = b""
        pos, n = 0, len(buf)
        while True:
            st = self._state
            if st == _CHUNK or st == _LENGTH:
                take = min(self._left, n - pos)
                if take:
                    ex._data(buf[pos:pos + take], t)
                    pos += take
                    self._left -= take
                if self._left:
                    return
                if st == _LENGTH:
                    self._end(ex, t, pos < n)
                    return
                self._state = _CRLF
            elif st == _SIZE or st == _CRLF or st == _TRAILER:
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    self._keep_rest(buf, pos)
                    return
                line, pos = buf[pos:eol], eol + 2
                if st == _CRLF:
                    if line:
                        raise ValueError("a chunk is longer than its size")
                    self._state = _SIZE
                elif st == _SIZE:
                    self._left = int(line.split(b";", 1)[0].strip(), 16)
                    self._state = _CHUNK if self._left else _TRAILER
                elif not line:  # the blank line that ends the trailers: the response is complete
                    self._end(ex, t, pos < n)
                    return
            elif st == _HEAD:
                end = buf.find(b"\r\n\r\n", pos)
                if end < 0:
                    self._keep_rest(buf, pos)
                    return
                head, pos = buf[pos:end], end + 4
                self._head(ex, head)
                if self._state == _DONE:
                    self._end(ex, t, pos < n)
                    return
            elif st == _TO_CLOSE:
                if pos < n:
                    ex._data(buf[pos:], t)
                return
            else:
                raise ValueError("data after the response")
            if pos >= n and self._state in (_CHUNK, _LENGTH) and self._left:
                return

    def _keep_rest(self, buf: bytes, pos: int) -> None:
        rest = buf[pos:]
        if len(rest) > _HEAD_LIMIT:
            raise ValueError(f"a header or chunk line of over {_HEAD_LIMIT} bytes")
        self._buf = rest

    def _head(self, ex: Exchange, head: bytes) -> None:
        lines = head.split(b"\r\n")
        version, _, rest = lines[0].partition(b" ")
        if not version.startswith(b"HTTP/1."):
            raise ValueError(f"not an HTTP/1 status line: {lines[0][:80]!r}")
        status = int(rest[:3])
        headers = []
        for line in lines[1:]:
            k, sep, v = line.partition(b":")
            if not sep:
                raise ValueError(f"a header line without a colon: {line[:80]!r}")
            headers.append((k.strip().lower(), v.strip()))
        if 100 <= status < 200:  # an interim response (100 Continue): the real one follows
            self._state = _HEAD
            return
        names = dict(headers)
        conn = names.get(b"connection", b"").lower()
        self._keep = (b"close" not in conn and (version == b"HTTP/1.1" or b"keep-alive" in conn)
                      and not self._close_after)
        ex._headers(status, headers)
        if status in (204, 304):
            self._state = _DONE
        elif b"chunked" in names.get(b"transfer-encoding", b"").lower():
            self._state = _SIZE
        elif b"content-length" in names:
            self._left = int(names[b"content-length"])
            self._state = _LENGTH if self._left else _DONE
        else:
            self._state, self._keep = _TO_CLOSE, False

    def _end(self, ex: Exchange, t: float, extra: bool) -> None:
        self.current = None
        self._state = _DONE
        if extra:  # bytes after the end of the response: the connection is not reused
            self._keep = False
        ex._finish(t)
        if self._keep:
            self.idle_since = time.monotonic()
        else:
            self.abort()

    def eof_received(self) -> bool | None:
        ex = self.current
        if ex is not None and self._state == _TO_CLOSE:  # a response delimited by the close: complete
            self.current = None
            self.closed = True
            ex._finish(time.perf_counter())
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

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    @property
    def reusable(self) -> bool:
        return (not self.closed and self.current is None and self._keep
                and time.monotonic() - self.idle_since < KEEPALIVE_EXPIRY_S)


class Pool:
    """Connections to one server (``base_url``, http or https): idle ones reused, stale ones closed, new ones
    opened. ``verify`` is the client's (:func:`abbench.auth.tls_verify`: a context trusting a private CA, or
    True for the default public CAs)."""

    def __init__(self, base_url: str, connect_timeout_s: float = 10.0,
                 verify: ssl.SSLContext | bool = True) -> None:
        u = urlsplit(base_url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise RequestError("connect", f"{base_url}: not an http:// or https:// URL")
        self.default_port = 443 if u.scheme == "https" else 80
        self.host, self.port = u.hostname, u.port or self.default_port
        self.ssl: ssl.SSLContext | None = None
        if u.scheme == "https":
            if isinstance(verify, ssl.SSLContext):
                self.ssl = verify
            elif verify:  # the public CAs, as the HTTP client trusts them (one shared context)
                from abbench.auth import default_tls_context

                self.ssl = default_tls_context()
            else:  # no verification: a context of its own (the shared one is never changed)
                self.ssl = ssl.create_default_context()
                self.ssl.check_hostname = False
                self.ssl.verify_mode = ssl.CERT_NONE
        self.prefix = u.path.rstrip("/")
        self.connect_timeout_s = connect_timeout_s
        self.idle: deque[Connection] = deque()
        self.opened: list[Connection] = []  # every connection it opened (closed at the end of the level)

    @property
    def host_header(self) -> str:
        return self.host if self.port == self.default_port else f"{self.host}:{self.port}"

    def take_idle(self) -> Connection | None:
        while self.idle:
            c = self.idle.pop()  # the most recently used first
            if c.reusable:
                return c
            c.abort()
        return None

    async def connect(self) -> Connection:
        loop = asyncio.get_running_loop()
        try:
            _, proto = await asyncio.wait_for(
                loop.create_connection(lambda: Connection(self.host_header), self.host, self.port, ssl=self.ssl),
                self.connect_timeout_s)
        except asyncio.TimeoutError:
            raise RequestError("timeout", f"could not connect to {self.host}:{self.port} within "
                                          f"{self.connect_timeout_s:g} s") from None
        except ssl.SSLError as e:
            raise RequestError("connect", f"TLS handshake with {self.host}:{self.port} failed: {e}; if the server's "
                                          "certificate is signed by a private CA, set engine.ca_bundle") from None
        except OSError as e:
            raise RequestError("connect", f"cannot connect to {self.host}:{self.port}: {e}") from None
        self.opened.append(proto)
        return proto

    def give_back(self, c: Connection) -> None:
        if c.reusable:
            self.idle.append(c)
        else:
            c.abort()

    def close(self) -> None:
        """Abort every connection it opened, idle or busy (the end of a level, or an interrupt)."""
        self.idle.clear()
        for c in self.opened:
            if not c.closed:
                c.abort()

