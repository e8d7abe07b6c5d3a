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
from abbench.engine.tokenizer import load_tokenizer  # noqa: E402
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
        while True:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
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
    eng = EngineProc(tmp_path_factory.mktemp("engine"), "--queue-limit", "1")
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
        t0 = time.monotonic()
        res = subprocess.run([sys.executable, "-m", "abbench.engine", "--port", str(port)], capture_output=True,
                             text=True, timeout=120)
    assert res.returncode == 1
    assert f"abbench engine: cannot bind 127.0.0.1:{port}" in res.stderr and "in use" in res.stderr
    assert time.monotonic() - t0 < 30  # before the engine is built


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


def test_no_request_field_makes_it_read_a_file(engine: EngineProc) -> None:
    secret_dir = Path(engine.marker)
    secret = secret_dir / "weights.safetensors"
    secret.write_text("this must never be read by the server\n")
    path = str(secret)
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


# ------------------------------------------------------------------------- disconnects mid-prefill


def test_client_gone_mid_prefill_stops_within_a_layer_step_and_frees_memory(engine: EngineProc) -> None:
    c = engine.client
    prompt = [13] * LONG
    c.post("/reset")
    t0 = time.perf_counter()
    full = c.post("/v1/completions", json=greedy(prompt, max_tokens=1))
    full_s = time.perf_counter() - t0
    assert full.status_code == 200
    steps = full.json()["abbench"]["n_chunks"] * 4  # chunk-layer steps of the tiny model's 4 layers
    step_s = full_s / steps

    def cancel_once() -> float:
        c.post("/reset")  # no prefix-cache hit: the whole prompt is prefilled again
        before = engine.metric("abbench_engine_requests_cancelled_total")
        sock = raw_post(engine.url, greedy(prompt, max_tokens=1))
        fk.wait_for(lambda: engine.metric("abbench_engine_requests_running") == 1, 30, "prefill to start")
        time.sleep(min(0.3, full_s / 4))  # well inside the prefill
        hung_up = time.perf_counter()
        sock.close()
        fk.wait_for(lambda: engine.metric("abbench_engine_requests_cancelled_total") == before + 1, 10,
                    "the engine to count the cancel")
        latency = time.perf_counter() - hung_up
        fk.wait_for(lambda: engine.metric("abbench_engine_requests_running") == 0, 10, "the engine to be free")
        return latency

    for _ in range(3):  # warm-up: allocator pools, first-use buffers
        cancel_once()
    rss_warm = engine.rss()
    latencies = [cancel_once() for _ in range(10)]
    rss_after = engine.rss()
    growth = rss_after - rss_warm
    print(f"\nfull prefill {full_s:.2f} s over {steps} layer steps ({step_s * 1e3:.1f} ms/step); cancel latency "
          f"max {max(latencies) * 1e3:.0f} ms (incl. the {20} ms disconnect poll and a /metrics scrape); RSS "
          f"{rss_warm / 2**20:.0f} -> {rss_after / 2**20:.0f} MiB over 10 cancelled {LONG}-token prompts")
    assert max(latencies) < min(0.5, full_s / 2), latencies
    assert growth < 32 * 2**20, f"RSS grew {growth / 2**20:.1f} MiB over 10 cancelled prefills"
    r = c.post("/v1/completions", json=greedy(prompt[:64]))
    assert r.status_code == 200  # and it serves the next one


def test_full_queue_gets_429_while_the_real_engine_is_busy(engine: EngineProc) -> None:
    """--queue-limit 1: one request runs, one waits, the third is refused; both accepted ones complete."""
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


def test_device_oom_is_a_503_and_the_engine_serves_the_next(tmp_path: Path) -> None:
    """ABBENCH_ENGINE_FAULT=oom-once: the first prefill raises torch.OutOfMemoryError inside its layer loop.
    The request gets an OpenAI-shaped 503 with the reason; the next requests are served, with the same
    output as a clean engine gives. Then the harness, attached to the same server, records such a failure
    as a failed sample and carries on."""
    eng = EngineProc(tmp_path, env={"ABBENCH_ENGINE_FAULT": "oom-once"})
    try:
        prompt = list(range(1000, 1300))
        r = eng.client.post("/v1/completions", json=greedy(prompt, max_tokens=4))
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] == "out_of_memory" and err["type"] == "server_error"
        assert "device out of memory while serving this request" in err["message"] and "oom-once" in err["message"]
        assert eng.metric("abbench_engine_request_outcomes_total", outcome="error") == 1
        after = eng.client.post("/v1/completions", json=greedy(prompt, max_tokens=4))
        assert after.status_code == 200
        eng.client.post("/reset")
        clean = eng.client.post("/v1/completions", json=greedy(prompt, max_tokens=4))
        assert clean.json()["choices"][0]["token_ids"] == after.json()["choices"][0]["token_ids"]
    finally:
        eng.stop()

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
