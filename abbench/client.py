"""Streaming client for OpenAI-compatible, vLLM, SGLang and llama.cpp servers: one pooled HTTP client, exact
TTFT, native token ids, loud failures.

Contract
--------
:class:`EngineClient` owns ONE pooled ``httpx.Client`` for the whole run (keep-alive, ``trust_env=False`` so
no proxy or ``.netrc`` from the environment is used; completions go straight through its transport, without
the client's cookie and redirect hooks in the timed window; an idle connection is dropped after
:data:`KEEPALIVE_EXPIRY_S`, before the usual servers close it themselves). The control requests (``reset``,
``metrics_text``: idempotent) are sent once more on a fresh connection when the first attempt's connection was
dropped before any response; a completion never is. ``complete()`` sends one request and returns a
:class:`Completion` only when the response is complete and correct; anything else raises
:class:`abbench.errors.RequestError` whose ``kind`` says what went wrong:

* ``http``          the server answered 3xx/4xx/5xx (``status`` is set; the message holds the server's own
                    error text), or sent an ``{"error": ...}`` event inside the stream;
* ``connect``       connection refused, reset, or dropped before the response was complete;
* ``timeout``       no complete response within ``RequestSpec.timeout_s`` (whole response, enforced by a
                    watchdog that closes the socket, not only per read), or no connection within
                    ``connect_timeout_s``;
* ``sse``           the event stream is malformed: a line that is no SSE field, bytes that are not UTF-8,
                    ``data`` that is not JSON, data after ``[DONE]`` (or after the final event of a
                    format without a done marker), or a last event cut off mid-way;
* ``no-done``       the stream ended cleanly but without ``data: [DONE]`` (llama.cpp: without its final
                    ``stop: true`` event);
* ``finish-reason`` ``finish_reason`` is missing, not ``length`` when ``ignore_eos`` is set, or not one of
                    ``length``/``stop`` otherwise;
* ``usage``         ``usage.prompt_tokens`` differs from the exact length the prompt was built to;
* ``protocol``      no ``usage``; ``usage.completion_tokens`` differs from the number of native ids; a body
                    or event of the wrong shape; no event carried text (TTFT undefined).

Timing (DESIGN §2): the request body is serialised first; then ``started_at = time.time()``, and the
``perf_counter`` clock starts when the request starts to go out: at httpcore's ``send_request_headers`` (or its
``connect_tcp`` where the pool has no connection to reuse), stamped through httpcore's ``trace`` extension, so the
client's own work before that (httpx's transport, httpcore's pool) is not in the server's times; where no such
event comes, immediately before the request is handed to the transport. ``ttft_s`` is taken when the network chunk
that completes the first SSE event with non-empty text arrives (it is stamped before that chunk is parsed);
``total_s`` when the response body has ended; ``token_times_s`` (streamed only), on the same clock, when each
output token arrived: the arrival of the chunk that completed the event carrying it (one entry per native id;
without ids, one per event that carried text). Inter-token latency and time per output token are derived from them
(:mod:`abbench.analysis.latency`). SSE is parsed incrementally from the raw bytes (events split across chunks,
``\\r\\n``/``\\n``/``\\r`` line ends, comments, multi-line data). Until the first text event each event is decoded
(a small ``json.loads``) to test for text; after it, events are only collected and decoded once the stream has
ended, so the client does no heavy work per event.

The SSE parser is :mod:`abbench.sse`; merging a response's events and verifying them is
:mod:`abbench.response` (:class:`Completion`). Wire formats are :class:`~abbench.adapters.Adapter` subclasses (:mod:`abbench.adapters`), looked up by
``EngineSpec.adapter`` in :data:`~abbench.adapters.ADAPTERS`. An adapter builds the request (path and JSON
body), says whether a decoded event carries text, and turns one event into
:class:`~abbench.adapters.EventParts`; the client merges the parts and checks them. The adapter names are
re-exported here.

Native token ids are used whenever the engine sends them (``ids_source='native'``, and their count must
equal ``usage.completion_tokens``); otherwise the text is re-tokenized with the caller's ``retokenize``
(``'retokenized'``), or no ids are recorded (``'none'``). Logprobs are kept only with token ids (the
vendored engine's ``top_logprob_ids``, vLLM's ``token_id:N`` keys, SGLang's ``[logprob, id, text]`` and
llama.cpp's ``{"id", "logprob"}`` entries), best first.
"""

from __future__ import annotations

import json
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import httpx

from abbench.adapters import (
    ADAPTERS,
    Adapter,
    EventParts,
    LlamaCppAdapter,
    OpenAIAdapter,
    Prompt,
    SGLangAdapter,
    VLLMAdapter,
    engine_counters,
    get_adapter,
)
from abbench.auth import default_tls_context
from abbench.errors import RequestError
from abbench.profile import RequestSpec
from abbench.response import Completion, IdsSource, RawResponse, ShortIds, finish
from abbench.sse import SNIPPET as _SNIPPET
from abbench.sse import SSEEvent, SSEParser

__all__ = [
    "ADAPTERS",
    "Adapter",
    "Completion",
    "EngineClient",
    "IdsSource",
    "EventParts",
    "LlamaCppAdapter",
    "OpenAIAdapter",
    "SGLangAdapter",
    "SSEEvent",
    "SSEParser",
    "VLLMAdapter",
    "engine_counters",
    "get_adapter",
]

KEEPALIVE_EXPIRY_S = 2.0
"""Seconds an idle pooled connection is kept: below the 5 s keep-alive timeout of uvicorn and cpp-httplib."""
_ERROR_BODY_LIMIT = 64 * 1024  # bytes of an error body read for its message
_SEND_EVENTS = frozenset({"connection.connect_tcp.started", "http11.send_request_headers.started"})
"""httpcore's trace events at which a request starts to go out (a connect where there is none to reuse)."""


# ---------------------------------------------------------------------------------------------- the client


class _Deadline:
    """The whole-response deadline of one request, enforced by the client's :class:`_Watchdog`."""

    __slots__ = ("seconds", "when", "fired", "done", "sock")

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.when = time.monotonic() + seconds
        self.fired = False
        self.done = False
        self.sock: socket.socket | None = None


class _Watchdog:
    """One thread per client that shuts a response's socket down when its whole-response deadline passes
    (httpx's timeouts apply per read, so a server that keeps trickling bytes would never trip them; a
    shutdown wakes the blocked read). :meth:`arm` returns only once the thread has taken the new deadline and
    is asleep again, so the thread never runs inside a timed window except when a deadline fires.
    :meth:`disarm` must run before the connection can go back to the pool."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._armed: set[_Deadline] = set()
        self._asked = 0  # arm() requests
        self._seen = 0  # requests the thread has taken
        self._closed = False
        self._thread: threading.Thread | None = None

    def arm(self, seconds: float) -> _Deadline:
        d = _Deadline(seconds)
        with self._cond:
            if self._closed:
                raise RuntimeError("the EngineClient is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="abbench-request-watchdog", daemon=True)
                self._thread.start()
            self._armed.add(d)
            self._asked += 1
            asked = self._asked
            self._cond.notify_all()
            while self._seen < asked:
                if not self._cond.wait(5.0) and not self._thread.is_alive():
                    raise RuntimeError("the request watchdog thread died")
        return d

    def attach(self, d: _Deadline, response: httpx.Response) -> None:
        stream = response.extensions.get("network_stream")
        sock = stream.get_extra_info("socket") if stream is not None else None
        with self._cond:
            d.sock = sock
            if d.fired:
                _shutdown(sock)

    def disarm(self, d: _Deadline) -> None:
        with self._cond:
            d.done = True
            d.sock = None
            self._armed.discard(d)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(5)

    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                now = time.monotonic()
                for d in [d for d in self._armed if d.when <= now]:
                    self._armed.discard(d)
                    if not d.done:
                        d.fired = True
                        _shutdown(d.sock)
                if self._seen != self._asked:
                    self._seen = self._asked
                    self._cond.notify_all()
                wait = min(d.when for d in self._armed) - now if self._armed else None
                self._cond.wait(wait)


def _shutdown(sock: socket.socket | None) -> None:
    if sock is None:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class EngineClient:
    """The one HTTP client of a run. Use as a context manager or call :meth:`close`.

    ``base_url`` arguments are the server root (``http://127.0.0.1:8000``); paths are appended to it.
    """

    def __init__(
        self,
        *,
        connect_timeout_s: float = 10.0,
        health_timeout_s: float = 2.0,
        control_timeout_s: float = 60.0,
        max_connections: int = 64,
        verify: ssl.SSLContext | bool = True,
    ) -> None:
        """``verify``: how https servers are checked (:func:`abbench.auth.tls_verify`: a context trusting a
        profile's ``engine.ca_bundle``, or True for the default public CAs)."""
        self.connect_timeout_s = connect_timeout_s
        self.health_timeout_s = health_timeout_s
        self.control_timeout_s = control_timeout_s
        # Idle pooled connections are dropped before the common servers' own keep-alive timeouts (uvicorn's and
        # cpp-httplib's, llama-server's, are 5 s): a connection the server is closing as a request goes out
        # fails with "Server disconnected without sending a response".
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections,
                              keepalive_expiry=KEEPALIVE_EXPIRY_S)
        if verify is True:  # the public CAs: the process's one context, not certifi's bundle loaded again (~25 ms)
            verify = default_tls_context()
        self._transport = httpx.HTTPTransport(trust_env=False, verify=verify, limits=limits)
        self._http = httpx.Client(transport=self._transport, trust_env=False, follow_redirects=False,
                                  timeout=httpx.Timeout(control_timeout_s, connect=connect_timeout_s),
                                  headers={"accept-encoding": "identity"})
        self._watchdog = _Watchdog()

    def close(self) -> None:
        self._watchdog.close()
        self._http.close()

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -------------------------------------------------------------------------------- control endpoints

    def health(self, base_url: str, path: str = "/health", *, headers: Mapping[str, str] | None = None) -> bool:
        """True when ``GET path`` answers 2xx within ``health_timeout_s``; False otherwise, never raises for
        connection errors or timeouts. A 401/403 raises ``RequestError`` (``status`` set): a server that
        refuses the key will never become healthy, so waiting for it would only hide why."""
        url = _url(base_url, path)
        try:
            r = self._http.get(url, timeout=self.health_timeout_s, headers=headers)
        except httpx.ConnectError as e:
            if _tls_failure(e):  # a certificate that is not trusted will not become trusted by waiting
                raise _transport_error(e, f"GET {url}", self.health_timeout_s) from None
            return False
        except httpx.HTTPError:
            return False
        if r.status_code in (401, 403):
            raise RequestError("http", f"GET {url}: HTTP {r.status_code}: {_error_message(r.content)}",
                               status=r.status_code)
        return 200 <= r.status_code < 300

    def reset(self, base_url: str, path: str, *, headers: Mapping[str, str] | None = None) -> None:
        """``POST path`` (flush the engine's caches). ``RequestError`` unless it answers 2xx."""
        url = _url(base_url, path)
        try:
            r = self._control("POST", url, headers)
        except httpx.HTTPError as e:
            raise _transport_error(e, f"POST {url}", self.control_timeout_s) from None
        if not 200 <= r.status_code < 300:
            raise RequestError(
                "http", f"POST {url}: HTTP {r.status_code}: {_error_message(r.content)}", status=r.status_code
            )

    def metrics_text(self, base_url: str, path: str | None, *,
                     headers: Mapping[str, str] | None = None) -> str | None:
        """The Prometheus text of ``GET path``; None when ``path`` is None or the server has no such page
        (404). ``RequestError`` for other failures (the caller decides whether telemetry may fail)."""
        if path is None:
            return None
        url = _url(base_url, path)
        try:
            r = self._control("GET", url, headers)
        except httpx.HTTPError as e:
            raise _transport_error(e, f"GET {url}", self.control_timeout_s) from None
        if r.status_code == 404:
            return None
        if not 200 <= r.status_code < 300:
            raise RequestError(
                "http", f"GET {url}: HTTP {r.status_code}: {_error_message(r.content)}", status=r.status_code
            )
        return r.text

    def _control(self, method: str, url: str, headers: Mapping[str, str] | None) -> httpx.Response:
        """A control request (reset, metrics: idempotent), sent once more on a fresh connection when the
        first attempt's connection was dropped before any response came back (a pooled keep-alive
        connection the server closed as the request went out). A second drop, or any other error, raises."""
        try:
            return self._http.request(method, url, timeout=self.control_timeout_s, headers=headers)
        except httpx.TransportError as e:
            if not _dropped_unanswered(e):
                raise
        return self._http.request(method, url, timeout=self.control_timeout_s, headers=headers)

    # ------------------------------------------------------------------------------------------ requests

    def complete(
        self,
        base_url: str,
        prompt: Prompt,
        *,
        request: RequestSpec,
        extra: Mapping[str, Any],
        target_prompt_tokens: int,
        model: str | None = None,
        retokenize: Callable[[str], list[int]] | None = None,
        adapter: str | Adapter = "openai",
        headers: Mapping[str, str] | None = None,
    ) -> Completion:
        """Send one completion request and return it verified (see the module docstring for the checks).

        ``prompt`` is text, or token ids (sent as the engine takes them: ``prompt`` for OpenAI servers and
        llama.cpp, ``input_ids`` for SGLang). ``extra`` (an arm's request fields) is merged over
        ``request.extra`` (the fields the protocol depends on, e.g. ``prompt``, ``stream`` and
        ``stream_options``, cannot be overridden: ConfigError); an arm that overrides ``ignore_eos`` is judged
        by what it sent. ``adapter`` is an ``EngineSpec.adapter`` name or an :class:`Adapter`; ``headers`` are
        added to the request (e.g. an API key). ``retokenize`` is used only when the engine sends no ids."""
        ad = get_adapter(adapter)
        body = ad.build_body(prompt, request=request, extra=extra, model=model)
        ignore_eos = ad.ignore_eos_sent(body)
        stream = bool(body.get("stream"))
        url = _url(base_url, ad.completion_path)
        what = f"POST {url}"
        timeout = request.timeout_s
        http_request = self._http.build_request(
            "POST",
            url,
            content=json.dumps(body, ensure_ascii=False).encode("utf-8"),
            headers={
                "content-type": "application/json",
                "accept": "text/event-stream" if stream else "application/json",
                **({"connection": "close"} if stream and ad.closes_after_stream else {}),
                **(headers or {}),
            },
            timeout=httpx.Timeout(timeout, connect=min(self.connect_timeout_s, timeout)),
        )
        deadline = self._watchdog.arm(timeout)
        try:
            sent: list[float] = []

            def trace(name: str, _info: object) -> None:
                if not sent and name in _SEND_EVENTS:
                    sent.append(time.perf_counter())

            http_request.extensions["trace"] = trace
            started_at = time.time()
            t0 = time.perf_counter()
            try:
                response = self._send(http_request)
            except httpx.HTTPError as e:
                raise _transport_error(e, what, timeout, deadline, "before the response headers") from None
            t0 = sent[0] if sent else t0
            try:
                self._watchdog.attach(deadline, response)
                _check_status(response, what, deadline)
                if stream:
                    raw = self._read_stream(response, ad, t0, what, deadline)
                else:
                    raw = self._read_body(response, t0, what, deadline)
            finally:
                self._watchdog.disarm(deadline)
                response.close()
        finally:
            self._watchdog.disarm(deadline)
        try:
            return finish(raw, ad, ignore_eos, started_at, target_prompt_tokens, retokenize, what)
        except ShortIds as short:
            if not ad.refetch_short_stream_ids or raw.ttft is None:
                raise
            again = self.complete(base_url, prompt, request=request.model_copy(update={"stream": False}),
                                  extra=extra, target_prompt_tokens=target_prompt_tokens, model=model,
                                  retokenize=retokenize, adapter=ad, headers=headers)
            return _with_refetched_ids(short, again, raw, started_at, what)

    def _send(self, request: httpx.Request) -> httpx.Response:
        """A completion straight through the pooled transport, streamed: ``httpx.Client.send`` would also extract
        cookies (an ``http.cookiejar`` pass over a ``urllib`` request) inside the timed window. No cookies kept."""
        response = self._transport.handle_request(request)
        response.request = request
        return response

    def _read_stream(
        self, response: httpx.Response, ad: Adapter, t0: float, what: str, deadline: _Deadline
    ) -> RawResponse:
        _check_content_type(response, "text/event-stream", what, deadline)
        parser = SSEParser()
        has_text = ad.has_text
        marker = ad.done_marker
        decoded: list[Any] = []  # events decoded on arrival, up to the first with text
        later: list[str] = []  # data of the events after it, decoded once the stream has ended
        arrived: list[float] = []  # per event (decoded, then later), when the chunk completing it arrived
        ttft: float | None = None
        saw_done = False
        nbytes = 0
        perf = time.perf_counter
        try:
            for chunk in response.iter_bytes():
                t = perf()
                nbytes += len(chunk)
                for ev in parser.feed(chunk):
                    data = ev.data
                    if saw_done:
                        raise RequestError("sse", f"data after [DONE]: {data[:_SNIPPET]!r}")
                    if data == marker:
                        saw_done = True
                        continue
                    arrived.append(t - t0)
                    if ttft is None:
                        obj = _loads(data, len(decoded))
                        decoded.append(obj)
                        if has_text(obj):
                            ttft = t - t0
                    else:
                        later.append(data)
            total = perf() - t0
            parser.close()
            offset = len(decoded)
            events = decoded + [_loads(d, offset + i) for i, d in enumerate(later)]
        except httpx.HTTPError as e:
            n = len(decoded) + len(later)
            raise _transport_error(
                e, what, deadline.seconds, deadline, f"after {n} events ({nbytes} bytes)"
            ) from None
        except RequestError as e:
            if deadline.fired:
                raise _timeout(what, deadline.seconds) from None
            raise RequestError(e.kind, f"{what}: {e.detail}", status=e.status) from None
        if deadline.fired:
            raise _timeout(what, deadline.seconds)
        return RawResponse(events=events, ttft=ttft, total=total, saw_done=saw_done, streamed=True,
                           event_times=arrived)

    def _read_body(self, response: httpx.Response, t0: float, what: str, deadline: _Deadline) -> RawResponse:
        _check_content_type(response, "application/json", what, deadline)
        try:
            content = response.read()
            total = time.perf_counter() - t0
        except httpx.HTTPError as e:
            raise _transport_error(e, what, deadline.seconds, deadline, "while reading the body") from None
        if deadline.fired:
            raise _timeout(what, deadline.seconds)
        try:
            obj = json.loads(content)
        except ValueError:
            raise RequestError("protocol", f"{what}: the body is not JSON: {content[:_SNIPPET]!r}") from None
        return RawResponse(events=[obj], ttft=None, total=total, saw_done=False, streamed=False)


# --------------------------------------------------------------------------------------------- helpers


def _with_refetched_ids(short: ShortIds, again: Completion, raw: RawResponse, started_at: float,
                         what: str) -> Completion:
    """The streamed completion with the ids of a non-streamed repeat of the request (same prompt, now cached by
    the server), if that repeat agrees with everything the stream did carry: the same text (or the stream's
    text plus the tail of an output ending inside a character, see below), as many ids as the stream's usage
    counted, and every streamed id in order among them. The text stays the stream's. Else the stream's
    protocol error."""
    ids = again.output_ids
    pos, in_order = 0, True
    for i in short.streamed_ids:  # each streamed id, in order, among the repeat's
        while pos < len(ids) and ids[pos] != i:
            pos += 1
        if pos == len(ids):
            in_order = False
            break
        pos += 1
    # An output that ends inside a UTF-8 character: the stream never sent its last token(s), and the body
    # holds their text up to U+FFFD for the incomplete bytes. So the repeat may add such a tail after the
    # stream's text, only where ids follow the last streamed one.
    tail = again.text[len(short.text):] if again.text.startswith(short.text) else None
    same_text = again.text == short.text or (
        in_order and pos < len(ids) and tail is not None and tail.endswith("\ufffd"))
    if not (again.ids_source == "native" and len(ids) == short.completion_tokens and same_text
            and in_order and again.finish_reason == short.finish_reason):
        raise RequestError("protocol", f"{short.detail}; a non-streamed repeat did not reproduce the stream "
                                       f"({len(ids)} ids, same text: {same_text}, streamed ids in "
                                       f"order: {in_order})")
    engine = dict(short.engine or {})
    engine["ids_refetched"] = {"streamed_ids": len(short.streamed_ids), "ids": len(ids),
                               "why": "the stream left out ids of tokens ending inside a UTF-8 character"}
    return Completion(started_at=started_at, ttft_s=raw.ttft, total_s=raw.total, output_ids=list(ids),
                      ids_source="native", text=short.text, finish_reason=again.finish_reason,
                      prompt_tokens=again.prompt_tokens, completion_tokens=short.completion_tokens,
                      saw_done=True, logprobs=again.logprobs, engine=engine,
                      token_times_s=short.token_times)  # the ids the stream carried


def _dropped_unanswered(e: httpx.HTTPError) -> bool:
    """Whether a request failed because its connection closed or reset before a response began."""
    if isinstance(e, httpx.RemoteProtocolError):
        return "without sending a response" in str(e)
    return isinstance(e, (httpx.ReadError, httpx.WriteError))


def _url(base_url: str, path: str) -> str:
    return base_url.rstrip("/") + "/" + path.lstrip("/")


def _loads(data: str, n: int) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        raise RequestError("sse", f"event {n} is not JSON: {data[:_SNIPPET]!r}") from None


def _timeout(what: str, seconds: float) -> RequestError:
    return RequestError("timeout", f"{what}: no complete response within {seconds:g} s (request.timeout_s)")


def _transport_error(
    e: httpx.HTTPError, what: str, seconds: float, deadline: _Deadline | None = None, where: str = ""
) -> RequestError:
    """Map an httpx error (or the watchdog's shutdown) to a RequestError kind."""
    at = f" {where}" if where else ""
    if deadline is not None and deadline.fired:
        return RequestError("timeout", f"{what}: no complete response within {seconds:g} s (request.timeout_s){at}")
    if isinstance(e, httpx.ConnectTimeout):
        return RequestError("timeout", f"{what}: could not connect within the connect timeout ({e})")
    if isinstance(e, httpx.TimeoutException):  # the read limit is the same timeout_s: whichever fires first
        return RequestError("timeout", f"{what}: no complete response within {seconds:g} s (request.timeout_s)"
                            f"{at} ({type(e).__name__})")
    if isinstance(e, httpx.ConnectError):
        if _tls_failure(e):
            return RequestError("connect", f"{what}: TLS handshake failed: {e}; if the server's certificate is "
                                "signed by a private CA, set engine.ca_bundle to that CA's PEM file")
        return RequestError("connect", f"{what}: cannot connect: {e}")
    if isinstance(e, (httpx.ReadError, httpx.WriteError, httpx.CloseError)):
        return RequestError("connect", f"{what}: the connection failed{at}: {e or type(e).__name__}")
    if isinstance(e, httpx.RemoteProtocolError):
        msg = str(e)
        if "disconnected" in msg or "peer closed" in msg or "incomplete" in msg:
            return RequestError("connect", f"{what}: the connection was dropped{at}: {msg}")
        return RequestError("protocol", f"{what}: invalid HTTP from the server{at}: {msg}")
    return RequestError("connect", f"{what}: {type(e).__name__}{at}: {e}")


def _tls_failure(e: BaseException) -> bool:
    """Whether a connect error is a TLS failure (an untrusted or mismatched certificate, a bad handshake)."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, ssl.SSLError):
            return True
        seen = seen.__cause__ or seen.__context__
    text = str(e)
    return "CERTIFICATE_VERIFY_FAILED" in text or "SSL" in text


def _read_limited(response: httpx.Response, deadline: _Deadline, what: str) -> bytes:
    buf = bytearray()
    try:
        for chunk in response.iter_bytes():
            buf += chunk
            if len(buf) >= _ERROR_BODY_LIMIT:
                break
    except httpx.HTTPError as e:
        if deadline.fired:
            raise _timeout(what, deadline.seconds) from None
        buf += f" [body cut off: {type(e).__name__}]".encode()
    return bytes(buf)


def _check_status(response: httpx.Response, what: str, deadline: _Deadline) -> None:
    status = response.status_code
    if 200 <= status < 300:
        return
    message = _error_message(_read_limited(response, deadline, what))
    raise RequestError("http", f"{what}: HTTP {status} {response.reason_phrase}: {message}", status=status)


def _check_content_type(response: httpx.Response, expected: str, what: str, deadline: _Deadline) -> None:
    ctype = response.headers.get("content-type", "")
    if ctype.split(";", 1)[0].strip().lower() == expected:
        encoding = response.headers.get("content-encoding", "identity").lower()
        if encoding != "identity":
            raise RequestError("protocol", f"{what}: compressed response ({encoding}) although identity was asked")
        return
    snippet = _read_limited(response, deadline, what)[:_SNIPPET]
    raise RequestError("protocol", f"{what}: content-type {ctype!r}, expected {expected}: {snippet!r}")


def _error_message(content: bytes) -> str:
    """The server's own error text: OpenAI/vLLM ``{"error": {"message"}}``, FastAPI ``{"detail"}``, or text."""
    text = content.decode("utf-8", "replace").strip()
    try:
        obj = json.loads(text)
    except ValueError:
        return text[:500] or "(empty body)"
    if isinstance(obj, dict):
        err = obj.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        for key in ("error", "detail", "message"):
            if obj.get(key):
                return str(obj[key])
    return text[:500]
