"""A real HTTP/1.1 server that speaks the vendored engine's wire format and misbehaves on demand.

Built on ``http.server`` (one thread per connection, keep-alive, ``TCP_NODELAY``) so that every byte on the
wire is under control. Use it in-process (``with FakeServer(FakeConfig(...)) as srv: srv.base_url``, it
serves from a thread on a free loopback port) or as an engine service::

    python tests/support/fakeserver.py --port N [--mode MODE] [--startup-delay S] [--die-after-requests K]
                               [--wedge-after-requests K] [--never-healthy] [--ignore-sigterm] [--delay S]
                               [--token-delay S]
                               [--tokenizer SPEC] [--host H] [--api-key-env VAR]

Endpoints
---------
``GET /health``          200 ``{"status": "ok"}`` (503 with ``--never-healthy``, and once wedged);
``POST /reset``          200, counts resets;
``GET /metrics``         Prometheus text; counters move with every completion;
``GET /stats``           JSON counters (connections, requests) for tests;
``POST /v1/completions`` OpenAI ``text_completion``, streamed (SSE, ``stream_options.include_usage``) or
                         not. Output ids are a deterministic function of the prompt (:func:`output_ids`);
                         each token's text is :func:`token_text`; ``choices[0].token_ids``, ``logprobs``
                         (OpenAI shape plus ``top_logprob_ids``), ``usage`` and a top-level ``abbench``
                         object: ``prefill_path`` (the request's ``prefill_mode``, default "chunked"),
                         ``fallback_reason`` (the request's ``fake_fallback_reason``), ``h2d_bytes``,
                         ``timings`` (perf_counter seconds since the request line arrived:
                         ``request_received_s`` (headers and body read), ``first_event_s``, ``last_token_event_s``) and ``connection`` (``peer_port``,
                         ``requests_on_connection``).

Prompt tokens are whitespace-separated words (:func:`prompt_token_count`), or, with ``--tokenizer SPEC``,
the ids of ``abbench.engine.serve.tokenizer.load_tokenizer(SPEC)`` (then the output ids are real vocabulary words
and the text is their decoding). A request field ``fake_diverge_at: K`` changes the ids from position K on
(to test parity checks).

Modes (server-wide with ``--mode``; per request with the header ``X-Fake-Mode`` or the body field
``fake_mode``; ``X-Fake-Delay``/``fake_delay_s`` and ``X-Fake-Token-Delay``/``fake_token_delay_s`` likewise;
the body field ``fake_delay_per_token_s`` sleeps that long per prompt token before answering, in every mode)
are listed in :data:`MODES`. ``die-mid-stream`` and ``--die-after-requests`` exit the process when it runs
from the command line, and only drop the connection in-process. ``--wedge-after-requests K`` wedges the server
at completion K+1 (a stuck engine that is still alive): that completion and every later one are read and
never answered, and ``/health`` answers 503 from then on.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import MappingProxyType
from typing import Any

MODES = MappingProxyType(
    {
        "normal": "a correct stream",
        "malformed-sse": "the second event's data is cut-off JSON",
        "no-done": "the stream ends cleanly without data: [DONE]",
        "bad-finish-reason": "stops at half of max_tokens with finish_reason 'stop' (ignore_eos) or 'abort'",
        "usage-mismatch": "usage.prompt_tokens is one more than the prompt's count",
        "no-usage": "no usage anywhere",
        "count-mismatch": "usage.completion_tokens is one more than the ids sent",
        "error-event": "an {'error': ...} event after the first token, then [DONE]",
        "http-500": "HTTP 500 with an OpenAI-style error body",
        "http-400": "HTTP 400 with an OpenAI-style error body",
        "hang": "reads the request and never answers",
        "slow-first-token": "headers at once, the first event after the delay",
        "die-mid-stream": "after two events the process exits (CLI) or the connection is dropped (in-process)",
        "empty-text-first": "the first event carries a token id but empty text; text follows after the delay",
        "split-chunks": "CRLF, comments, id lines, two-line data, written in odd-sized pieces",
        "no-token-ids": "no token_ids and no top_logprob_ids",
    }
)

EXIT_ON_DIE = 17  # exit status of the process when it dies on purpose
_WORDS = (
    " the quick brown fox jumps over the lazy dog while seven small birds sing about rivers mountains"
    " and old stone bridges near a quiet town"
)


@dataclass(frozen=True)
class FakeConfig:
    mode: str = "normal"
    delay_s: float = 0.2  # slow-first-token / empty-text-first
    token_delay_s: float = 0.0  # between token events
    die_after_requests: int | None = None  # completion number K+1 dies before it is answered
    wedge_after_requests: int | None = None  # from completion K+1 on: no answer, and /health 503 (alive, stuck)
    never_healthy: bool = False
    exit_process: bool = False  # dying exits the process (CLI) instead of dropping the connection
    vocab_size: int = 32000
    model: str = "fake-model"
    api_key: str | None = None  # when set, every route but /health needs "Authorization: Bearer <api_key>"
    max_model_len: int | None = None  # when set, GET /v1/models lists the model with this context (else 404)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; modes: {', '.join(MODES)}")


# ------------------------------------------------------------------------------------ the fake "model"


def prompt_token_count(prompt: str) -> int:
    """The fake tokenizer: one token per whitespace-separated word."""
    return len(prompt.split())


def output_ids(prompt: str, n: int, *, vocab_size: int = 32000, diverge_at: int | None = None) -> list[int]:
    """Deterministic "greedy" output ids of a prompt."""
    seed = hashlib.sha256(prompt.encode("utf-8")).digest()
    ids = []
    for i in range(n):
        salt = b"diverged" if diverge_at is not None and i >= diverge_at else b""
        h = hashlib.sha256(seed + salt + i.to_bytes(4, "little")).digest()
        ids.append(int.from_bytes(h[:4], "little") % vocab_size)
    return ids


def token_text(token_id: int) -> str:
    """Text of one fake token (a two-byte UTF-8 character in every token, to exercise byte splits)."""
    return f" é{token_id}"


def retokenize(text: str) -> list[int]:
    """Inverse of :func:`token_text` over a concatenation (the fallback tests' re-tokenizer)."""
    return [int(m) for m in re.findall(r" é(\d+)", text)]


class _Vocab:
    """Token counting and output of the fake model: words by default, or a real tokenizer."""

    def __init__(self, config: FakeConfig, tokenizer: Any | None = None) -> None:
        self.config = config
        self.tok = tokenizer
        self._words = tokenizer.encode(_WORDS) if tokenizer is not None else None

    def count(self, prompt: str) -> int:
        return len(self.tok.encode(prompt)) if self.tok is not None else prompt_token_count(prompt)

    def generate(self, prompt: str, n: int, diverge_at: int | None) -> tuple[list[int], list[str]]:
        """Output ids and the text each token event carries."""
        if self._words is None:
            ids = output_ids(prompt, n, vocab_size=self.config.vocab_size, diverge_at=diverge_at)
            return ids, [token_text(i) for i in ids]
        raw = output_ids(prompt, n, vocab_size=len(self._words), diverge_at=diverge_at)
        ids = [self._words[r] for r in raw]
        from abbench.engine.serve.tokenizer import IncrementalDetokenizer

        detok = IncrementalDetokenizer(self.tok)
        texts = [detok.push(i) for i in ids]
        texts[-1] += detok.flush()
        return ids, texts

    def text(self, token_id: int) -> str:
        return self.tok.decode([token_id]) if self.tok is not None else token_text(token_id)


# ------------------------------------------------------------------------------------------- the server


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128  # a load generator opens many connections at once

    def __init__(self, addr: tuple[str, int], config: FakeConfig, vocab: _Vocab) -> None:
        super().__init__(addr, _Handler)
        self.config = config
        self.vocab = vocab
        self.stopping = threading.Event()
        self.wedged = threading.Event()
        self.lock = threading.Lock()
        self.counters = {
            "connections": 0,
            "requests": 0,
            "completions": 0,
            "resets": 0,
            "prompt_tokens": 0,
            "generation_tokens": 0,
            "h2d_bytes": 0,
            "authorized": 0,  # requests that carried the right key (with api_key set)
            "unauthorized": 0,  # requests refused with 401
        }
        self.open_sockets: set[socket.socket] = set()

    def count(self, **incr: int) -> dict[str, int]:
        with self.lock:
            for k, v in incr.items():
                self.counters[k] += v
            return dict(self.counters)


class _Died(Exception):
    """Raised inside a handler to drop its connection."""


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    server: _Server

    def setup(self) -> None:
        super().setup()
        self.requests_on_connection = 0
        self.t_recv = 0.0
        with self.server.lock:
            self.server.open_sockets.add(self.connection)
        self.server.count(connections=1)

    def finish(self) -> None:
        with self.server.lock:
            self.server.open_sockets.discard(self.connection)
        try:
            super().finish()
        except OSError:
            pass

    def log_message(self, format: str, *args: Any) -> None:
        logging.getLogger("fakeserver").debug("%s " + format, self.client_address[0], *args)

    def parse_request(self) -> bool:
        self.t_recv = time.perf_counter()  # the request line has just been read
        self.requests_on_connection += 1
        self.server.count(requests=1)
        return super().parse_request()

    def handle_one_request(self) -> None:
        try:
            super().handle_one_request()
        except _Died:
            self.close_connection = True
            _drop(self.connection)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    # ------------------------------------------------------------------------------------- plumbing

    def _send_json(self, status: int, obj: Any, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(obj, ensure_ascii=False).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _send_text(self, status: int, text: str, ctype: str = "text/plain; version=0.0.4") -> None:
        data = text.encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _chunk(self, data: bytes) -> None:
        if data:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    def _read_body(self) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _die(self) -> None:
        cfg = self.server.config
        if cfg.exit_process:
            logging.getLogger("fakeserver").warning("dying on purpose (exit %d)", EXIT_ON_DIE)
            logging.shutdown()
            os._exit(EXIT_ON_DIE)
        raise _Died

    # ------------------------------------------------------------------------------------- endpoints

    def _authorized(self, path: str) -> bool:
        """With ``api_key``: the request must carry it (except /health); a 401 is sent otherwise."""
        key = self.server.config.api_key
        if key is None or path == "/health":
            return True
        if self.headers.get("Authorization") == f"Bearer {key}":
            self.server.count(authorized=1)
            return True
        self.server.count(unauthorized=1)
        if self.command == "POST":
            self._read_body()
        self._send_json(401, {"error": {"message": "Unauthorized: missing or wrong API key",
                                        "type": "authentication_error", "code": 401}})
        return False

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if not self._authorized(path):
            return
        if path == "/health":
            if self.server.config.never_healthy or self.server.wedged.is_set():
                self._send_json(503, {"status": "loading"})
            else:
                self._send_json(200, {"status": "ok"})
        elif path == "/metrics":
            c = self.server.count()
            lines = []
            for name, key, what in (
                ("abbench_requests_total", "completions", "Completion requests served."),
                ("abbench_prompt_tokens_total", "prompt_tokens", "Prompt tokens prefilled."),
                ("abbench_generation_tokens_total", "generation_tokens", "Tokens generated."),
                ("abbench_h2d_bytes_total", "h2d_bytes", "Host-to-device bytes copied."),
                ("abbench_resets_total", "resets", "Cache resets."),
            ):
                lines += [f"# HELP {name} {what}", f"# TYPE {name} counter", f"{name} {c[key]}"]
            self._send_text(200, "\n".join(lines) + "\n")
        elif path == "/stats":
            self._send_json(200, self.server.count())
        elif path == "/v1/models" and self.server.config.max_model_len:
            cfg = self.server.config
            self._send_json(200, {"object": "list", "data": [{"id": cfg.model, "object": "model",
                                                              "max_model_len": cfg.max_model_len}]})
        else:
            self._send_json(404, {"error": {"message": f"no route {path}", "code": 404}})

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        if not self._authorized(path):
            return
        raw = self._read_body()
        if path == "/reset":
            self.server.count(resets=1)
            self._send_json(200, {"ok": True})
        elif path == "/v1/completions":
            self._completions(raw)
        else:
            self._send_json(404, {"error": {"message": f"no route {path}", "code": 404}})

    def _option(self, name: str, body: dict[str, Any], default: Any) -> Any:
        header = self.headers.get("X-Fake-" + "-".join(w.capitalize() for w in name.split("_")))
        if header is not None:
            return header
        return body.get(f"fake_{name}" + ("_s" if "delay" in name else ""), default)

    def _completions(self, raw: bytes) -> None:
        srv, cfg = self.server, self.server.config
        t_request = time.perf_counter() - self.t_recv  # the whole request (headers and body) is in
        try:
            body = json.loads(raw)
            prompt = body["prompt"]
            if not isinstance(prompt, str):
                raise TypeError("prompt must be a string")
        except (ValueError, KeyError, TypeError) as e:
            self._send_json(400, {"error": {"message": f"bad request: {e}", "type": "BadRequestError", "code": 400}})
            return
        mode = self._option("mode", body, cfg.mode)
        if mode not in MODES:
            self._send_json(400, {"error": {"message": f"unknown fake mode {mode!r}", "code": 400}})
            return
        delay = float(self._option("delay", body, cfg.delay_s))
        token_delay = float(self._option("token_delay", body, cfg.token_delay_s))
        counters = srv.count()
        if cfg.die_after_requests is not None and counters["completions"] >= cfg.die_after_requests:
            self._die()
        if mode == "http-500":
            self._send_json(
                500, {"error": {"message": "fake engine exploded (mode http-500)", "type": "InternalServerError", "code": 500}}
            )
            return
        if mode == "http-400":
            self._send_json(
                400,
                {"error": {"message": "max_tokens is too large (mode http-400)", "type": "BadRequestError", "code": 400}},
            )
            return
        if cfg.wedge_after_requests is not None and counters["completions"] >= cfg.wedge_after_requests:
            srv.wedged.set()
        if mode == "hang" or srv.wedged.is_set():
            srv.stopping.wait()
            raise _Died

        n = int(body.get("max_tokens", 16))
        ignore_eos = bool(body.get("ignore_eos", False))
        k = body.get("logprobs")
        diverge_at = body.get("fake_diverge_at")
        ids, texts = srv.vocab.generate(prompt, n, diverge_at)
        finish = "length"
        if mode == "bad-finish-reason":
            cut = max(1, n // 2)
            ids, texts = ids[:cut], texts[:cut]
            finish = "stop" if ignore_eos else "abort"
        prompt_tokens = srv.vocab.count(prompt)
        time.sleep(float(body.get("fake_delay_per_token_s") or 0.0) * prompt_tokens)  # a prefill's cost
        counters = srv.count(completions=1, prompt_tokens=prompt_tokens, generation_tokens=len(ids), h2d_bytes=4096 * prompt_tokens)
        usage = {
            "prompt_tokens": prompt_tokens + (mode == "usage-mismatch"),
            "completion_tokens": len(ids) + (mode == "count-mismatch"),
            "total_tokens": prompt_tokens + len(ids),
        }
        native = mode != "no-token-ids"
        created = int(time.time())
        rid = f"cmpl-fake-{counters['completions']}"

        def engine_obj(timings: dict[str, float]) -> dict[str, Any]:
            return {
                "prefill_path": body.get("prefill_mode", "chunked"),
                "fallback_reason": body.get("fake_fallback_reason"),
                "h2d_bytes": 4096 * prompt_tokens,
                "mode": mode,
                "timings": timings,
                "connection": {
                    "peer_port": self.client_address[1],
                    "requests_on_connection": self.requests_on_connection,
                },
            }

        def choice(text: str, tok: list[int], offset: int, fin: str | None) -> dict[str, Any]:
            c: dict[str, Any] = {"index": 0, "text": text}
            if native:
                c["token_ids"] = tok
            c["logprobs"] = _logprobs(srv.vocab, tok, k, offset, native) if k is not None else None
            c["finish_reason"] = fin
            return c

        if not body.get("stream"):
            if mode == "die-mid-stream":
                self._die()
            timings = {"request_received_s": t_request, "first_event_s": time.perf_counter() - self.t_recv}
            obj = {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": body.get("model") or cfg.model,
                "choices": [choice("".join(texts), ids, 0, finish)],
                "abbench": engine_obj(timings),
            }
            if mode != "no-usage":
                obj["usage"] = usage
            self._send_json(200, obj)
            return

        # Token events: (text, ids). empty-text-first holds the first token's text back one event.
        events: list[tuple[str, list[int]]] = [(t, [i]) for t, i in zip(texts, ids)]
        if mode == "empty-text-first":
            if len(events) > 1:
                events[1] = (events[0][0] + events[1][0], events[1][1])
                events[0] = ("", events[0][1])
            else:
                events.append((events[0][0], []))
                events[0] = ("", events[0][1])
        split = mode == "split-chunks"
        out = _Splitter(self) if split else None

        def write_event(obj: Any) -> None:
            data = json.dumps(obj, ensure_ascii=False)
            if split:
                # a comment, an id line, and the JSON over two data lines (joined by "\n": still JSON)
                payload = f": keep-alive\r\nid: {rid}\r\ndata: {data[:1]}\r\ndata: {data[1:]}\r\n\r\n"
                out.write(payload.encode("utf-8"))
            else:
                self._chunk(b"data: " + data.encode("utf-8") + b"\n\n")

        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        head = {"id": rid, "object": "text_completion", "created": created, "model": body.get("model") or cfg.model}
        t_first: float | None = None
        offset = 0
        for j, (text, tok) in enumerate(events):
            if j == 0 and mode == "slow-first-token":
                time.sleep(delay)
            elif j == 1 and mode == "empty-text-first":
                time.sleep(delay)
            elif j > 0 and token_delay:
                time.sleep(token_delay)
            if j == 2 and mode == "die-mid-stream":
                self._die()
            if j == 1 and mode == "malformed-sse":
                self._chunk(b'data: {"choices": [{"index": 0, "text": "cut of\n\n')
            if j == 1 and mode == "error-event":
                write_event({"error": {"message": "fake engine failed mid-stream", "type": "InternalServerError", "code": 500}})
                break
            if t_first is None and text:  # stamped before the write: once written, this thread may be
                t_first = time.perf_counter() - self.t_recv  # descheduled while the client already reads it
            write_event({**head, "choices": [choice(text, tok, offset, None)]})
            offset += len(text)
        else:
            # as the vendored engine: a finish chunk (no ids), then with include_usage a choices-[] chunk with
            # usage; the last chunk before [DONE] carries the abbench object
            t_last = time.perf_counter() - self.t_recv
            last: dict[str, Any] = {
                **head,
                "choices": [{"index": 0, "text": "", "finish_reason": finish, "logprobs": None, "token_ids": []}],
            }
            if not native:
                del last["choices"][0]["token_ids"]
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            if include_usage and mode != "no-usage":
                write_event(last)
                last = {**head, "choices": [], "usage": usage}
            timings = {"request_received_s": t_request, "first_event_s": t_first, "last_token_event_s": t_last}
            write_event({**last, "abbench": engine_obj(timings)})
        if mode != "no-done":
            if split:
                out.write(b"data: [DONE]\r\n\r\n")
            else:
                self._chunk(b"data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")


class _Splitter:
    """Writes SSE bytes as HTTP chunks of odd sizes (cutting through CRLFs, field names and UTF-8
    characters), pausing between them so they travel in separate TCP segments."""

    SIZES = (1, 7, 2, 13, 64, 3, 250, 5, 31)

    def __init__(self, handler: _Handler) -> None:
        self.h = handler
        self.i = 0

    def write(self, data: bytes) -> None:
        pos = 0
        while pos < len(data):
            size = self.SIZES[self.i % len(self.SIZES)]
            self.i += 1
            self.h._chunk(data[pos : pos + size])
            pos += size
            time.sleep(0.0002)


def _logprobs(vocab: _Vocab, ids: list[int], k: int, offset: int, with_ids: bool) -> dict[str, Any]:
    """OpenAI-shape logprobs for ``ids`` (the chosen token first, then k-1 alternatives), plus the
    vendored engine's ``top_logprob_ids``."""
    tokens, chosen, top_text, top_ids, offsets = [], [], [], [], []
    for i in ids:
        lp = -0.05 - (i % 97) / 1000
        pos = [(i, lp)] + [((i + 1 + j) % vocab.config.vocab_size, -2.0 - j) for j in range(max(k, 1) - 1)]
        tokens.append(vocab.text(i))
        chosen.append(lp)
        top_text.append({vocab.text(t): v for t, v in pos})
        top_ids.append([[t, v] for t, v in pos])
        offsets.append(offset)
        offset += len(tokens[-1])
    out: dict[str, Any] = {"tokens": tokens, "token_logprobs": chosen, "top_logprobs": top_text, "text_offset": offsets}
    if with_ids:
        out["top_logprob_ids"] = top_ids
    return out


def _drop(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


# --------------------------------------------------------------------------------- in-process and CLI


class FakeServer:
    """The fake engine serving from a background thread: ``with FakeServer(cfg) as srv: srv.base_url``."""

    def __init__(
        self,
        config: FakeConfig | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        tokenizer: Any | None = None,
    ) -> None:
        self.config = config or FakeConfig()
        self._httpd = _Server((host, port), self.config, _Vocab(self.config, tokenizer))
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self._httpd.server_address[1]

    @property
    def base_url(self) -> str:
        return f"http://{self._httpd.server_address[0]}:{self.port}"

    def stats(self) -> dict[str, int]:
        """Counters: connections accepted, requests, completions, resets, tokens."""
        return self._httpd.count()

    def start(self) -> FakeServer:
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="fakeserver", daemon=True
        )
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._httpd.serve_forever()

    def stop(self) -> None:
        self._httpd.stopping.set()
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join(5)
        with self._httpd.lock:
            socks = list(self._httpd.open_sockets)
        for s in socks:
            _drop(s)
        self._httpd.server_close()

    def __enter__(self) -> FakeServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _load_tokenizer(spec: str) -> Any:
    try:
        from abbench.engine.serve.tokenizer import load_tokenizer
    except ImportError:  # run as a script from a checkout: make the repository importable
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        from abbench.engine.serve.tokenizer import load_tokenizer
    return load_tokenizer(spec)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Fake OpenAI-compatible engine that misbehaves on demand.")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--mode", default="normal", choices=list(MODES))
    ap.add_argument("--delay", type=float, default=0.2, help="slow-first-token / empty-text-first delay (s)")
    ap.add_argument("--token-delay", type=float, default=0.0, help="delay between token events (s)")
    ap.add_argument("--startup-delay", type=float, default=0.0, help="sleep before listening (s)")
    ap.add_argument("--die-after-requests", type=int, default=None, help="exit when completion K+1 arrives")
    ap.add_argument("--wedge-after-requests", type=int, default=None,
                    help="from completion K+1 on: never answer, and /health answers 503 (alive but stuck)")
    ap.add_argument("--never-healthy", action="store_true", help="/health answers 503 forever")
    ap.add_argument("--ignore-sigterm", action="store_true", help="ignore SIGTERM (needs SIGKILL)")
    ap.add_argument("--tokenizer", default=None, help="count tokens with abbench.engine.serve.tokenizer (e.g. qwen3)")
    ap.add_argument("--api-key-env", default=None,
                    help="require 'Authorization: Bearer $VAR' on every route but /health (VAR names the key)")
    ap.add_argument("--max-model-len", type=int, default=None, help="list the model at /v1/models with this context")
    ap.add_argument("--log-level", default="INFO")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr, format="%(asctime)s fakeserver %(message)s")
    log = logging.getLogger("fakeserver")
    if args.ignore_sigterm:  # ignored, but said in the log (a marker tests wait for); os.write: signal-safe
        signal.signal(signal.SIGTERM, lambda *_: os.write(2, b"fakeserver: SIGTERM received, ignored\n"))
    else:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    log.info("starting (mode=%s, startup delay %.1f s)", args.mode, args.startup_delay)
    tokenizer = _load_tokenizer(args.tokenizer) if args.tokenizer else None
    time.sleep(args.startup_delay)
    config = FakeConfig(
        mode=args.mode,
        delay_s=args.delay,
        token_delay_s=args.token_delay,
        die_after_requests=args.die_after_requests,
        wedge_after_requests=args.wedge_after_requests,
        never_healthy=args.never_healthy,
        exit_process=True,
        api_key=os.environ[args.api_key_env] if args.api_key_env else None,
        max_model_len=args.max_model_len,
    )
    server = FakeServer(config, host=args.host, port=args.port, tokenizer=tokenizer)
    log.info("listening on %s", server.base_url)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        log.info("shutting down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
