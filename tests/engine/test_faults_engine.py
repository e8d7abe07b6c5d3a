"""Faults injected for real into the vendored engine's server (``python -m abbench.engine``), in its own
process: what it binds, requests that must not make it read a file, bodies that are malformed in new ways,
clients that hang up mid-prefill (cancel counter and RSS), a full queue, device out-of-memory (through the
test-only ``ABBENCH_ENGINE_FAULT=oom-once`` hook, also driven through the harness), a busy port.

What tests/engine/test_engine_server.py already covers in-process (malformed JSON, unknown and out-of-range
fields, max_tokens <= 0, prompts over the context, FIFO order and 429 with a scripted engine, disconnects
with a scripted engine, a scripted OOM) is not repeated here.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx
import psutil
import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from abbench import runner  # noqa: E402
from abbench.engine.serve.tokenizer import load_tokenizer  # noqa: E402
from abbench.profile import profile_from_dict  # noqa: E402

from tests.support import faultkit as fk

AUDIT = Path(fk.__file__).resolve().parent / "engine_audit.py"
MAX_CONTEXT = 8192
LONG = 7000  # prompt tokens: ~55 chunks of 128 x 4 layers, a couple of seconds of prefill on 2 CPU cores


class EngineProc:
    """``python -m abbench.engine`` (under the audit wrapper) on a free loopback port, stopped at the end."""

    def __init__(self, tmp: Path, *extra: str, env: dict[str, str] | None = None) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.marker = str(tmp / "SENTINEL-secret-dir")
        self.audit_log = tmp / "audit.log"
        self.log = tmp / "engine.log"
        args = ["--model", "tiny", "--weights", "random:0", "--device", "cpu", "--chunk-tokens", "128",
                "--max-context", str(MAX_CONTEXT), "--port", str(self.port), "--log-level", "warning", *extra]
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen(
                [sys.executable, str(AUDIT), "--audit-log", str(self.audit_log), "--audit-marker", self.marker,
                 "--", *args], stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, cwd=tmp)
        self.ps = psutil.Process(self.proc.pid)
        deadline = time.monotonic() + 120
        with httpx.Client(timeout=1) as poll:  # one client for every poll (httpx.get builds one each, ~40 ms)
            while True:
                assert self.proc.poll() is None, self.log.read_text()
                try:
                    if poll.get(self.url + "/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, "engine did not start"
                time.sleep(0.1)
        self.client = httpx.Client(base_url=self.url, timeout=120)

    def metric(self, name: str, **labels: str) -> float:
        for fam in text_string_to_metric_families(self.client.get("/metrics").text):
            for s in fam.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    return s.value
        return 0.0

    def rss(self) -> int:
        return self.ps.memory_info().rss

    def stop(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def greedy(prompt, max_tokens: int = 2, **extra) -> dict:  # type: ignore[no-untyped-def]
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}


def raw_post(url: str, body: dict) -> socket.socket:
    """POST with a raw socket, so the test can hang up whenever it likes."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
    return sock


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProc]:
    eng = EngineProc(tmp_path_factory.mktemp("engine"), "--queue-limit", "1", "--max-num-seqs", "1")
    try:
        yield eng
    finally:
        eng.stop()


pytestmark = pytest.mark.slow  # every test here starts (or drives) a real engine process


# --------------------------------------------------------------------------------------------- binding


def test_binds_loopback_only(engine: EngineProc) -> None:
    listening = [c for c in engine.ps.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    assert listening, "no listening socket"
    assert {c.laddr.ip for c in listening} == {"127.0.0.1"}
    assert {c.laddr.port for c in listening} == {engine.port}


def test_busy_port_fails_at_once_with_the_reason(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = subprocess.run([sys.executable, "-m", "abbench.engine", "--port", str(port)], capture_output=True,
                             text=True, timeout=120)
    assert res.returncode == 1
    assert f"abbench engine: cannot bind 127.0.0.1:{port}" in res.stderr and "in use" in res.stderr
    assert "engine built in" not in res.stderr  # refused before the engine is built (it logs that at info)


def test_unknown_fault_value_refuses_to_start(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "abbench.engine", "--port", "0", "--max-context", "64"],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "ABBENCH_ENGINE_FAULT": "bogus"})
    assert res.returncode == 1
    assert "cannot build the engine: ABBENCH_ENGINE_FAULT='bogus': unknown fault (known: oom-once)" in res.stderr


# ------------------------------------------------------------------------------ input it must refuse


@pytest.mark.parametrize("content, param, fragment", [
    (b"[" * 100_000, None, "nested too deeply"),  # valid-looking JSON too deep to decode (was a bare 500)
    (b"\xff\xfe{}", None, "not valid JSON"),
    (json.dumps(greedy("hi", temperature=1e-320)).encode(), "temperature", "at least 1e-05"),  # was a 500 (NaN)
    (json.dumps(greedy("hi", seed=2**64, temperature=0.5)).encode(), "seed", "less than or equal"),
    (json.dumps(greedy("hi", max_tokens=10**30)).encode(), "prompt", "exceeds max_context"),
])
def test_more_bad_bodies_get_openai_400s_and_the_server_stays_up(engine: EngineProc, content: bytes,
                                                                  param: str | None, fragment: str) -> None:
    r = engine.client.post("/v1/completions", content=content, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param
    assert fragment in err["message"]
    ok = engine.client.post("/v1/completions", json=greedy("The quick brown fox"))
    assert ok.status_code == 200


class DirWatch:
    """inotify on one directory: every open (files and the directory itself) and read in it, by any process
    and from any code (C extensions, mmap'd loaders included), not only Python's ``open``."""

    IN_ACCESS, IN_OPEN, IN_ISDIR, IN_NONBLOCK = 0x1, 0x20, 0x40000000, 0o4000

    def __init__(self, path: Path) -> None:
        import ctypes
        import ctypes.util

        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        self.fd = libc.inotify_init1(self.IN_NONBLOCK)
        assert self.fd >= 0, os.strerror(ctypes.get_errno())
        wd = libc.inotify_add_watch(self.fd, os.fsencode(path), self.IN_ACCESS | self.IN_OPEN)
        assert wd >= 0, os.strerror(ctypes.get_errno())

    def events(self) -> list[tuple[str, str]]:
        """(what, name) since the last call: 'open' or 'read', name '' for the directory itself."""
        import struct

        out = []
        while True:
            try:
                buf = os.read(self.fd, 65536)
            except BlockingIOError:
                return out
            i = 0
            while i < len(buf):
                _wd, mask, _cookie, n = struct.unpack_from("iIII", buf, i)
                name = buf[i + 16:i + 16 + n].rstrip(b"\0").decode()
                out.append(("open" if mask & self.IN_OPEN else "read", name))
                i += 16 + n

    def close(self) -> None:
        os.close(self.fd)


def test_no_request_field_makes_it_read_a_file(engine: EngineProc) -> None:
    """Two audits: the wrapper's Python audit hook (every ``open`` whose path holds the marker) and an
    OS-level inotify watch on the secret directory (any open or read there, from C code too)."""
    secret_dir = Path(engine.marker)
    secret = secret_dir / "weights.safetensors"
    secret.write_text("this must never be read by the server\n")
    path = str(secret)
    watch = DirWatch(secret_dir)  # from here on, only the server could touch the directory
    tok = load_tokenizer("qwen3")
    c = engine.client
    r = c.post("/v1/completions", json=greedy(path))  # a prompt that looks like a path is text
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(tok.encode(path))
    r = c.post("/v1/completions", json=greedy([path], user=path))  # list form; 'user' is accepted and ignored
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(tok.encode(path))
    r = c.post("/v1/completions", json=greedy("hi", model=path))
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    for field in ("tokenizer", "weights", "model_path", "file", "lora_path"):
        r = c.post("/v1/completions", json=greedy("hi", **{field: path}))
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    r = c.post("/v1/completions", json=greedy("hi", stream_options={"include_usage": True, "path": path}))
    assert r.status_code == 400
    assert c.get("/" + path.lstrip("/")).status_code == 404
    assert c.get("/v1/models", params={"path": path}).status_code == 200
    assert c.post("/reset", params={"path": path}).status_code == 200
    opened = engine.audit_log.read_text().splitlines()
    assert opened == [str(secret_dir / "probe")], opened  # the hook worked, and saw nothing else
    try:
        assert watch.events() == []  # no open or read in the directory at the OS level either
        assert secret.read_text()  # and the watch does see one (this test's own read)
        assert ("open", "weights.safetensors") in watch.events()
    finally:
        watch.close()


# ------------------------------------------------------------------------- disconnects mid-prefill


def test_client_gone_mid_prefill_stops_within_a_layer_step_and_frees_memory(engine: EngineProc) -> None:
    """Counted in the engine's layer steps, not in wall time: the engine checks the request's cancel flag
    once per layer step (``abbench_engine_cancel_checks``: a full prefill checks exactly n_chunks x 4 layers
    times), and a request whose client hung up mid-prefill stops at the first check that finds the flag
    set (``abbench_engine_cancel_checks_set`` grows by exactly one), having run fewer layer steps than the
    full prefill. Memory: RSS stays flat over 10 cancelled prefills."""
    c = engine.client
    prompt = [13] * LONG
    c.post("/reset")
    checks0 = engine.metric("abbench_engine_cancel_checks_total")
    t0 = time.perf_counter()
    full = c.post("/v1/completions", json=greedy(prompt, max_tokens=1))
    full_s = time.perf_counter() - t0
    assert full.status_code == 200
    steps = full.json()["abbench"]["n_chunks"] * 4  # chunk-layer steps of the tiny model's 4 layers
    assert engine.metric("abbench_engine_cancel_checks_total") - checks0 == steps  # a check at every layer step
    assert engine.metric("abbench_engine_cancel_checks_set_total") == 0

    def cancel_once() -> tuple[float, float, float]:
        c.post("/reset")  # no prefix-cache hit: the whole prompt is prefilled again
        cancelled = engine.metric("abbench_engine_requests_cancelled_total")
        checks = engine.metric("abbench_engine_cancel_checks_total")
        flagged = engine.metric("abbench_engine_cancel_checks_set_total")
        sock = raw_post(engine.url, greedy(prompt, max_tokens=1))
        # the marker: the prefill has run a couple of layer steps (no sleep)
        fk.wait_for(lambda: engine.metric("abbench_engine_cancel_checks_total") - checks >= 2, 30, "prefill to run")
        at_hangup = engine.metric("abbench_engine_cancel_checks_total") - checks
        hung_up = time.perf_counter()
        sock.close()
        fk.wait_for(lambda: engine.metric("abbench_engine_requests_cancelled_total") == cancelled + 1, 30,
                    "the engine to count the cancel")
        latency = time.perf_counter() - hung_up
        fk.wait_for(lambda: engine.metric("abbench_engine_requests_running") == 0, 10, "the engine to be free")
        ran = engine.metric("abbench_engine_cancel_checks_total") - checks
        assert engine.metric("abbench_engine_cancel_checks_set_total") - flagged == 1  # stopped at the first check
        assert at_hangup <= ran < steps, (at_hangup, ran, steps)  # inside the prefill, never to its end
        return latency, at_hangup, ran

    for _ in range(3):  # warm-up: allocator pools, first-use buffers
        cancel_once()
    rss_warm = engine.rss()
    runs = [cancel_once() for _ in range(10)]
    rss_after = engine.rss()
    growth = rss_after - rss_warm
    print(f"\nfull prefill {full_s:.2f} s over {steps} layer steps ({full_s / steps * 1e3:.1f} ms/step); after the "
          f"hang-up the engine ran {min(r - h for _, h, r in runs):.0f}-{max(r - h for _, h, r in runs):.0f} more "
          f"layer steps (the disconnect poll, then one check); wall time to the counted cancel max "
          f"{max(x for x, _, _ in runs) * 1e3:.0f} ms (informative, not asserted); RSS {rss_warm / 2**20:.0f} -> "
          f"{rss_after / 2**20:.0f} MiB over 10 cancelled {LONG}-token prompts")
    assert growth < 32 * 2**20, f"RSS grew {growth / 2**20:.1f} MiB over 10 cancelled prefills"
    r = c.post("/v1/completions", json=greedy(prompt[:64]))
    assert r.status_code == 200  # and it serves the next one


def test_full_queue_gets_429_while_the_real_engine_is_busy(engine: EngineProc) -> None:
    """--queue-limit 1 --max-num-seqs 1: one request runs, one waits, the third is refused; both accepted ones
    complete."""
    c = engine.client
    c.post("/reset")
    results: dict[str, httpx.Response] = {}

    def send(name: str, body: dict) -> None:
        with httpx.Client(base_url=engine.url, timeout=120) as own:
            results[name] = own.post("/v1/completions", json=body)

    long = threading.Thread(target=send, args=("long", greedy([13] * LONG, max_tokens=1)))
    long.start()
    fk.wait_for(lambda: engine.metric("abbench_engine_requests_running") == 1, 30, "the long request to run")
    waiting = threading.Thread(target=send, args=("waiting", greedy("short one")))
    waiting.start()
    fk.wait_for(lambda: engine.metric("abbench_engine_queue_waiting") == 1, 30, "the second to wait")
    refused = c.post("/v1/completions", json=greedy("one too many"))
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_full"
    long.join(120)
    waiting.join(120)
    assert results["long"].status_code == 200 and results["waiting"].status_code == 200
    assert results["waiting"].json()["abbench"]["queue_wait_s"] > 0.1


# ------------------------------------------------------------------------------------ out of memory


def test_device_oom_is_a_503_and_the_engine_serves_the_next(engine: EngineProc, tmp_path: Path) -> None:
    """ABBENCH_ENGINE_FAULT=oom-once: the first prefill raises torch.OutOfMemoryError inside its layer loop.
    The request gets an OpenAI-shaped 503 with the reason; the next request is served, with the same ids and
    logprobs as an engine that never ran out of memory (this module's engine: another process, the same weights
    and chunks, reset first) gives. Then the harness, attached to the same server, records such a failure as a
    failed sample and carries on."""
    eng = EngineProc(tmp_path, env={"ABBENCH_ENGINE_FAULT": "oom-once"})
    try:
        prompt = list(range(1000, 1300))
        r = eng.client.post("/v1/completions", json=greedy(prompt, max_tokens=4))
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] == "out_of_memory" and err["type"] == "server_error"
        assert "device out of memory while serving this request" in err["message"] and "oom-once" in err["message"]
        assert eng.metric("abbench_engine_request_outcomes_total", outcome="error") == 1
        after = eng.client.post("/v1/completions", json=greedy(prompt, max_tokens=4, logprobs=2))
        assert after.status_code == 200
    finally:
        eng.stop()
    # against an engine that never ran out of memory (not the same process after /reset): same ids and the same
    # top-2 logprobs, so nothing the failed request left behind changed the next one
    assert engine.client.post("/reset").status_code == 200
    clean = engine.client.post("/v1/completions", json=greedy(prompt, max_tokens=4, logprobs=2))
    assert clean.status_code == 200 and clean.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    a, b = after.json()["choices"][0], clean.json()["choices"][0]
    assert a["token_ids"] == b["token_ids"] and len(a["token_ids"]) == 4 and a["logprobs"]
    assert a["logprobs"] == b["logprobs"]

    # the harness against an engine that runs out of memory once (a fresh one, attached by base_url)
    (tmp_path / "again").mkdir()
    eng = EngineProc(tmp_path / "again", env={"ABBENCH_ENGINE_FAULT": "oom-once"})
    try:
        prof = fk.fake_profile("unused", prompts={"lengths": [64], "per_length": 2}, request={"max_tokens": 2})
        prof["engine"] = {"base_url": eng.url, "health_timeout_s": 10}
        record = runner.execute(profile_from_dict(prof), tmp_path / "run")
    finally:
        eng.stop()
    assert record.status == "complete"
    first, *rest = record.samples
    assert first.kind == "warmup" and first.error_kind == "http" and first.ttft_s is None
    assert "HTTP 503" in first.error and "device out of memory" in first.error
    assert rest and all(s.ok for s in rest)
