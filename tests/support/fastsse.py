"""A fast streaming completion server for load tests: asyncio, HTTP/1.1 keep-alive, OpenAI ``text_completion``
chunks in the vendored engine's format, stamped on the server's own clock.

Run it in-process (``with FastServer(...) as srv: srv.base_url``: its own event loop in a thread) or as a
process (``python tests/support/fastsse.py --port N [--token-delay S] [--first-delay S]``; it prints
``ready PORT`` once listening).

``POST /v1/completions`` (streamed only): ``max_tokens`` events of one token each (``choices[0].text`` and
``token_ids``; ``logprobs`` with ``top_logprob_ids`` when asked), the last with ``finish_reason`` "length",
then a ``usage`` chunk and ``data: [DONE]``. Output ids are a deterministic function of the prompt's words
(whitespace-separated; their number is ``usage.prompt_tokens``); a body field ``diverge_at: K`` changes them
from position K on, ``flip_tie: true`` chooses the runner-up at the server's ``tie_at`` position (where every
output is a near tie: the runner-up 0.01 nats below; elsewhere 2.5 nats), ``status: S`` answers HTTP S instead (e.g. 429) and ``token_delay_s`` / ``first_delay_s``
override the server's delays. The first event's top-level ``abbench`` object holds the server's
``time.perf_counter`` stamps (``t_received``: the request's body read; ``t_first``: just before the first
event was written), so a client on the same machine can tell its own latency from the server's.
``GET /health`` 200; ``GET /metrics`` a gauge of running requests and a counter of completions; ``GET /stats``
the server's own TTFT of every completion since the last ``/stats`` (``t_first - t_received``, seconds), then
forgets them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import threading
import time
from typing import Any


def output_ids(prompt: str, n: int, diverge_at: int | None = None) -> list[int]:
    base = sum(len(w) * (i + 1) for i, w in enumerate(prompt.split())) % 9973
    return [(base * 31 + i * 7919 + (5 if diverge_at is not None and i >= diverge_at else 0)) % 32000
            for i in range(n)]


class _Proto(asyncio.Protocol):
    def __init__(self, server: FastServer) -> None:
        self.server = server
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.busy = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.busy:
            self._next()

    def _next(self) -> None:
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        head = bytes(self.buf[:end]).decode("latin-1").split("\r\n")
        length = 0
        for line in head[1:]:
            k, _, v = line.partition(":")
            if k.strip().lower() == "content-length":
                length = int(v.strip())
        if len(self.buf) < end + 4 + length:
            return
        body = bytes(self.buf[end + 4:end + 4 + length])
        del self.buf[:end + 4 + length]
        method, path = head[0].split(" ")[:2]
        self.busy = True
        asyncio.ensure_future(self._answer(method, path, body, time.perf_counter()))

    def _write(self, status: int, ctype: str, body: bytes) -> None:
        assert self.transport is not None
        self.transport.write(f"HTTP/1.1 {status} X\r\ncontent-type: {ctype}\r\ncontent-length: {len(body)}\r\n\r\n"
                             .encode() + body)

    async def _answer(self, method: str, path: str, body: bytes, t_received: float) -> None:
        srv = self.server
        try:
            if method == "GET" and path == "/health":
                self._write(200, "application/json", b'{"status":"ok"}')
            elif method == "GET" and path == "/metrics":
                text = (f"# TYPE fast_running gauge\nfast_running {srv.running}\n"
                        f"# TYPE fast_completions_total counter\nfast_completions_total {srv.completions}\n")
                self._write(200, "text/plain; version=0.0.4", text.encode())
            elif method == "GET" and path == "/stats":
                stats, srv.server_ttfts = srv.server_ttfts, []
                self._write(200, "application/json", json.dumps({"ttft_s": stats}).encode())
            elif method == "POST" and path == "/v1/completions":
                await self._complete(json.loads(body), t_received)
            else:
                self._write(404, "application/json", b'{"error":{"message":"no such route"}}')
        finally:
            self.busy = False
            if self.transport is not None and not self.transport.is_closing():
                self._next()

    async def _complete(self, req: dict[str, Any], t_received: float) -> None:
        srv = self.server
        if req.get("status"):
            msg = json.dumps({"error": {"message": "refused: too many requests", "code": req["status"]}}).encode()
            self._write(int(req["status"]), "application/json", msg)
            return
        prompt, n = str(req.get("prompt", "")), int(req.get("max_tokens", 16))
        ids = output_ids(prompt, n, req.get("diverge_at"))
        tie, flip = srv.tie_at, bool(req.get("flip_tie"))
        token_delay = float(req.get("token_delay_s", srv.token_delay_s))
        first_delay = float(req.get("first_delay_s", srv.first_delay_s))
        lp = req.get("logprobs") is not None
        tr = self.transport
        assert tr is not None
        srv.running += 1
        tr.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        if first_delay:
            await asyncio.sleep(first_delay)
        for i, tok in enumerate(ids):
            choice: dict[str, Any] = {"index": 0, "text": f"t{tok} ", "token_ids": [tok],
                                      "finish_reason": "length" if i == n - 1 else None}
            if lp:
                other = (tok + 1) % 32000
                top = [[tok, -0.5], [other, -0.51 if tie == i else -3.0]]
                if flip and tie == i:  # the runner-up was chosen: a near-tie flip
                    choice["text"], choice["token_ids"], top = f"t{other} ", [other], [[other, -0.5], [tok, -0.51]]
                choice["logprobs"] = {"top_logprob_ids": [top]}
            ev: dict[str, Any] = {"object": "text_completion", "choices": [choice]}
            if i == 0:
                t_first = time.perf_counter()
                ev["abbench"] = {"t_received": t_received, "t_first": t_first}
                srv.server_ttfts.append(t_first - t_received)
            tr.write(_chunk(b"data: " + json.dumps(ev).encode() + b"\n\n"))
            if token_delay and i < n - 1:
                await asyncio.sleep(token_delay)
        usage = {"choices": [], "usage": {"prompt_tokens": len(prompt.split()), "completion_tokens": n,
                                          "total_tokens": len(prompt.split()) + n}}
        tr.write(_chunk(b"data: " + json.dumps(usage).encode() + b"\n\n") + _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        srv.running -= 1
        srv.completions += 1


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


class FastServer:
    """The server on a free loopback port, in a thread of its own (module docstring)."""

    def __init__(self, *, token_delay_s: float = 0.0, first_delay_s: float = 0.0, port: int = 0,
                 tie_at: int | None = None) -> None:
        self.token_delay_s, self.first_delay_s, self.tie_at = token_delay_s, first_delay_s, tie_at
        self.running = 0
        self.completions = 0
        self.server_ttfts: list[float] = []
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.port = self.sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.AbstractServer | None = None

    async def serve(self) -> asyncio.AbstractServer:
        self.loop = asyncio.get_running_loop()
        self._server = await self.loop.create_server(lambda: _Proto(self), sock=self.sock, backlog=1024)
        return self._server

    def __enter__(self) -> FastServer:
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            loop.run_until_complete(self.serve())
            ready.set()
            loop.run_forever()
            pending = asyncio.all_tasks(loop)  # answers still streaming when the server stops
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.close()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.loop is not None and self._server is not None:
            self.loop.call_soon_threadsafe(self._server.close)
            self.loop.call_soon_threadsafe(self.loop.stop)
        if self._thread is not None:
            self._thread.join(10)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--token-delay", type=float, default=0.0)
    ap.add_argument("--first-delay", type=float, default=0.0)
    a = ap.parse_args(argv)
    srv = FastServer(token_delay_s=a.token_delay, first_delay_s=a.first_delay, port=a.port)

    async def go() -> None:
        s = await srv.serve()
        print(f"ready {srv.port}", flush=True)
        async with s:
            await s.serve_forever()

    try:
        asyncio.run(go())
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
