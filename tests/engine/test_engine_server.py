"""End-to-end tests of the vendored engine's HTTP server (``abbench.engine.serve.server``).

A real uvicorn server on a free loopback port, a real httpx client. Most tests drive the real ``tiny``
engine on the CPU. A scripted stand-in engine (same contract as ``runtime.Engine``) is used only where a
test must control time: queueing order and 429, client disconnects mid-prefill, device OOM, and the
UTF-8 hold-back of a streamed multi-byte character.
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

torch = pytest.importorskip("torch")  # the engine extra: torch, fastapi, uvicorn, prometheus-client
pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from abbench.engine.config import PRESETS, EngineConfig  # noqa: E402
from abbench.engine.contract import (  # noqa: E402
    BackendInfo, Cancelled, ContextOverflow, RequestStats, SerialScheduler, TokenEvent,
)
from abbench.engine.runtime.engine import Engine  # noqa: E402
from abbench.engine.serve.server import create_app  # noqa: E402
from abbench.engine.serve.tokenizer import IncrementalDetokenizer, TokenizerSpecError, load_tokenizer  # noqa: E402
from tests.support.uvicorn_thread import ServerThread  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
MAX_CONTEXT = 128
ABBENCH_FIELDS = {"prefill_path", "fallback_reason", "h2d_bytes", "d2d_bytes", "prefill_h2d_bytes",
                  "decode_h2d_bytes", "bank_bytes", "expert_copies", "cached_prompt_tokens", "n_chunks",
                  "n_windows", "measured_h2d_gbps", "timings", "queue_wait_s"}
FLAMINGO = "🦩"  # qwen3: two tokens, the first ends in an incomplete UTF-8 sequence


# --------------------------------------------------------------------------------------------------
# Harness: a uvicorn server in a thread, SSE parsing, the scripted stand-in engine
# --------------------------------------------------------------------------------------------------


def sse_events(response: httpx.Response) -> tuple[list[dict], bool]:
    """The JSON payloads of a streamed response, and whether it ended with ``data: [DONE]``."""
    events, done = [], False
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        assert not done, "nothing may follow [DONE]"
        payload = line[len("data: "):]
        if payload == "[DONE]":
            done = True
        else:
            events.append(json.loads(payload))
    return events, done


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


class ScriptedEngine:
    """Stand-in with ``runtime.Engine``'s contract. Prefill is ``layers`` steps of ``step_s``, checking
    ``cancel`` at every step like the real engine; while ``hold`` is clear, prefill waits on it. Output is
    ``outputs`` (cycled), so tests choose the exact ids."""

    def __init__(self, outputs=(785, 3974), layers=10, step_s=0.01):
        self.config = EngineConfig(model="tiny", max_context=MAX_CONTEXT).resolved()
        tiny = PRESETS["tiny"]
        self.info = BackendInfo(model="tiny", model_name=tiny.name, vocab_size=tiny.vocab_size,
                                max_context=MAX_CONTEXT, startup_s=0.01, decode_mode="scripted",
                                measured_h2d_gbps=12.5, bank_bytes=4096, slots_per_layer=0)
        self.counters = {"h2d_bytes_total": 0, "d2d_bytes_total": 0, "requests_by_path": {},
                         "prefill_tokens_by_path": {}}
        self.outputs, self.layers, self.step_s = list(outputs), layers, step_s
        self.hold = threading.Event()
        self.hold.set()
        self.prefill_started = threading.Event()
        self.cancel_observed = threading.Event()
        self.fail_next: BaseException | None = None
        self.started: list[list[int]] = []  # prompts in the order the engine began them
        self.outcomes: list[str] = []
        self.active = self.max_active = self.resets = 0
        self.scheduler = SerialScheduler(self)  # one request at a time, as the contract's serial backends

    def generate(self, request, cancel=None):
        prompt_ids, max_tokens, logprobs = request.prompt_ids, request.max_tokens, request.logprobs
        if len(prompt_ids) + max_tokens > self.config.max_context:
            raise ContextOverflow(f"{len(prompt_ids)} + {max_tokens} > {self.config.max_context}")
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        self.started.append(list(prompt_ids))
        try:
            if self.fail_next is not None:
                exc, self.fail_next = self.fail_next, None
                raise exc
            t0 = time.perf_counter()
            self.prefill_started.set()
            for _ in range(self.layers):
                self._step(cancel)
                while not self.hold.is_set():
                    self._step(cancel, 0.002)
            t1 = time.perf_counter()
            first = None
            for i in range(max_tokens):
                self._step(cancel)
                first = first or time.perf_counter()
                tid = self.outputs[i % len(self.outputs)]
                yield TokenEvent(tid, -0.5 if logprobs is not None else None,
                                 [(tid, -0.5)] if logprobs else None)
            self.outcomes.append("ok")
            path = request.prefill_mode or self.config.prefill_mode
            self.counters["requests_by_path"][path] = self.counters["requests_by_path"].get(path, 0) + 1
            return RequestStats(prefill_path=path, fallback_reason=None, h2d_bytes=0, d2d_bytes=0,
                                prefill_h2d_bytes=0, decode_h2d_bytes=0, bank_bytes=self.info.bank_bytes,
                                expert_copies=0, cached_prompt_tokens=0, prompt_tokens=len(prompt_ids),
                                completion_tokens=max_tokens, n_chunks=1, n_windows=0, prefill_start=t0,
                                prefill_end=t1, first_token=first, finish_reason="length")
        except Cancelled:
            self.outcomes.append("cancelled")
            raise
        finally:
            self.active -= 1

    def _step(self, cancel, seconds=None):
        if cancel is not None and cancel.is_set():
            self.cancel_observed.set()
            raise Cancelled()
        time.sleep(self.step_s if seconds is None else seconds)

    def reset(self):
        self.resets += 1


# --------------------------------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3():
    return load_tokenizer("qwen3")


@pytest.fixture(scope="module")
def tiny(qwen3):
    """The real tiny engine (CPU, random weights) behind a server that allows per-request overrides."""
    engine = Engine(EngineConfig(model="tiny", weights="random:0", device="cpu", chunk_tokens=16,
                                 max_context=MAX_CONTEXT))
    server = ServerThread(create_app(engine, qwen3, allow_request_overrides=True, served_model_name="tiny"))
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client, engine
    server.stop()


@pytest.fixture()
def scripted(qwen3):
    engine = ScriptedEngine()
    server = ServerThread(create_app(engine, qwen3, queue_limit=2, max_body_bytes=64 * 1024))
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client, engine, server
    engine.hold.set()
    server.stop()


def greedy(prompt, max_tokens=6, **extra):
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}


PROMPT_IDS = [785, 3974, 13876, 38835, 34208, 916, 279, 15678, 5562, 13]  # "The quick brown fox ..."


# --------------------------------------------------------------------------------------------------
# The real tiny engine
# --------------------------------------------------------------------------------------------------


def test_streamed_and_non_streamed_completions_agree(tiny, qwen3):
    client, _ = tiny
    client.post("/reset")
    r = client.post("/v1/completions", json=greedy(PROMPT_IDS))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == "tiny" and body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    ids = choice["token_ids"]
    assert len(ids) == 6 and all(isinstance(i, int) for i in ids)
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None
    assert choice["text"] == qwen3.decode(ids)
    assert body["usage"]["prompt_tokens"] == len(PROMPT_IDS)
    assert body["usage"]["completion_tokens"] == 6 and body["usage"]["total_tokens"] == len(PROMPT_IDS) + 6
    ab = body["abbench"]
    assert ABBENCH_FIELDS <= set(ab) and ab["prefill_path"] == "chunked"
    t = ab["timings"]
    assert t["received"] == 0.0 <= t["prefill_start"] <= t["prefill_end"] <= t["first_token"] <= t["finished"]
    assert ab["queue_wait_s"] >= 0 and ab["n_chunks"] == 1

    client.post("/reset")  # the same work again, not a prefix-cache hit
    with client.stream("POST", "/v1/completions",
                       json=greedy(PROMPT_IDS, stream=True, stream_options={"include_usage": True})) as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        events, done = sse_events(s)
    assert done
    token_chunks = [e for e in events if e["choices"] and e["choices"][0]["token_ids"]]
    assert [c["choices"][0]["token_ids"] for c in token_chunks] == [[i] for i in ids]
    assert all(c["choices"][0]["finish_reason"] is None for c in token_chunks)
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == choice["text"]
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"
    final = events[-1]
    assert final["choices"] == [] and final["usage"] == body["usage"]
    assert ABBENCH_FIELDS <= set(final["abbench"]) and final["abbench"]["prefill_path"] == "chunked"
    assert all("abbench" not in e for e in events[:-1])


def test_text_prompt_and_token_prompt_forms_are_equivalent(tiny, qwen3):
    client, _ = tiny
    text = "The quick brown fox jumps over the lazy dog."
    ids = qwen3.encode(text)
    outs = []
    for prompt in (text, [text], ids, [ids]):
        r = client.post("/v1/completions", json=greedy(prompt, max_tokens=3))
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(ids)
        outs.append(r.json()["choices"][0]["token_ids"])
    assert outs[0] == outs[1] == outs[2] == outs[3]


def test_logprobs_are_openai_shaped_with_ids(tiny):
    client, _ = tiny
    r = client.post("/v1/completions", json=greedy(PROMPT_IDS, max_tokens=4, logprobs=3))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 4
    for pos, (tid, chosen) in enumerate(zip(choice["token_ids"], lp["token_logprobs"])):
        top_ids = lp["top_logprob_ids"][pos]
        assert len(top_ids) == 3 and len(lp["top_logprobs"][pos]) <= 3
        best_id, best_lp = max(top_ids, key=lambda p: p[1])
        assert best_id == tid and chosen == pytest.approx(best_lp)  # greedy picks the top-1


def test_prefill_mode_override_keeps_greedy_ids(tiny):
    client, _ = tiny
    long_prompt = (PROMPT_IDS * 4)[:40]  # 3 chunks of 16
    runs = {}
    for mode in ("chunked", "layer-major"):
        assert client.post("/reset").status_code == 200  # no prefix-cache reuse between the two
        r = client.post("/v1/completions", json=greedy(long_prompt, max_tokens=4, prefill_mode=mode))
        assert r.status_code == 200, r.text
        runs[mode] = r.json()
        ab = r.json()["abbench"]
        assert (ab["prefill_path"], ab["fallback_reason"], ab["n_chunks"]) == (mode, None, 3)
    ids = {mode: run["choices"][0]["token_ids"] for mode, run in runs.items()}
    assert ids["layer-major"] == ids["chunked"]  # bitwise-equal prefill -> the same greedy ids
    # a per-request chunk length: 8-token chunks in layer-major, and one chunk for the whole prompt
    for mode, chunk, n_chunks in (("layer-major", 8, 5), ("chunked", 40, 1)):
        assert client.post("/reset").status_code == 200
        r = client.post("/v1/completions", json=greedy(long_prompt, max_tokens=4, prefill_mode=mode,
                                                       chunk_tokens=chunk))
        assert r.status_code == 200, r.text
        ab = r.json()["abbench"]
        assert (ab["prefill_path"], ab["chunk_tokens"], ab["n_chunks"]) == (mode, chunk, n_chunks)
    assert runs["chunked"]["abbench"]["chunk_tokens"] == 16


@pytest.mark.parametrize("content, status, param", [
    (b'{"prompt": "hi", "max_tokens": ', 400, None),                       # malformed JSON
    (b'[1, 2]', 400, None),                                                # not an object
    (json.dumps({"prompt": "hi", "frobnicate": 1}).encode(), 400, "frobnicate"),
    (json.dumps({"prompt": "hi", "max_tokens": 0}).encode(), 400, "max_tokens"),
    (json.dumps({"prompt": "hi", "max_tokens": -3}).encode(), 400, "max_tokens"),
    (json.dumps({"prompt": "hi", "max_tokens": "5"}).encode(), 400, "max_tokens"),
    (json.dumps({"prompt": "hi", "logprobs": 21}).encode(), 400, "logprobs"),
    (json.dumps({"prompt": "hi", "chunk_tokens": 0}).encode(), 400, "chunk_tokens"),
    (json.dumps({"prompt": "hi", "n": 2}).encode(), 400, "n"),
    (json.dumps({"prompt": "hi", "stop": ["\n"]}).encode(), 400, "stop"),
    (json.dumps({"prompt": ["a", "b"]}).encode(), 400, "prompt"),
    (json.dumps({"prompt": ""}).encode(), 400, "prompt"),
    (json.dumps({"prompt": [1, 10**9]}).encode(), 400, "prompt"),
    (json.dumps({"prompt": "hi", "temperature": -1}).encode(), 400, "temperature"),
    (json.dumps({"prompt": "hi", "model": "gpt-4"}).encode(), 404, "model"),
    (json.dumps({"prompt": "x " * MAX_CONTEXT, "max_tokens": 4}).encode(), 400, "prompt"),  # over context
])
def test_bad_requests_get_openai_errors_and_the_server_stays_up(tiny, content, status, param):
    client, _ = tiny
    r = client.post("/v1/completions", content=content, headers={"content-type": "application/json"})
    assert_openai_error(r, status, param)
    ok = client.post("/v1/completions", json=greedy(PROMPT_IDS, max_tokens=1, n=1, top_p=1, echo=False,
                                                    stop=None, user="u", model="tiny"))
    assert ok.status_code == 200, ok.text


def test_prompt_over_context_is_a_clear_400_streamed_too(tiny):
    client, _ = tiny
    for stream in (False, True):
        r = client.post("/v1/completions", json=greedy([13] * (MAX_CONTEXT - 2), max_tokens=8, stream=stream))
        err = assert_openai_error(r, 400, "prompt")
        assert err["code"] == "context_length_exceeded" and str(MAX_CONTEXT) in err["message"]


def test_metrics_parse_and_move(tiny):
    client, engine = tiny

    def scrape() -> dict[tuple[str, tuple], float]:
        text = client.get("/metrics").text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}

    before = scrape()
    for name in ("abbench_engine_h2d_bytes_total", "abbench_engine_d2d_bytes_total",
                 "abbench_engine_h2d_bandwidth_bytes_per_second", "abbench_engine_bank_bytes",
                 "abbench_engine_startup_seconds", "abbench_engine_queue_waiting"):
        assert (name, ()) in before, name
    r = client.post("/v1/completions", json=greedy(PROMPT_IDS, max_tokens=5))
    assert r.status_code == 200
    after = scrape()
    path = (("path", "chunked"),)
    assert after[("abbench_engine_requests_total", path)] == before.get(("abbench_engine_requests_total", path), 0) + 1
    assert after[("abbench_engine_prefill_tokens_total", path)] >= \
        before.get(("abbench_engine_prefill_tokens_total", path), 0) + len(PROMPT_IDS) - \
        r.json()["abbench"]["cached_prompt_tokens"]
    assert after[("abbench_engine_prompt_tokens_total", ())] == \
        before[("abbench_engine_prompt_tokens_total", ())] + len(PROMPT_IDS)
    assert after[("abbench_engine_generation_tokens_total", ())] == \
        before[("abbench_engine_generation_tokens_total", ())] + 5
    assert after[("abbench_engine_queue_waiting", ())] == 0
    ab = r.json()["abbench"]  # the lifetime counters move by exactly what the request reports
    assert after[("abbench_engine_h2d_bytes_total", ())] - before[("abbench_engine_h2d_bytes_total", ())] \
        == ab["h2d_bytes"]
    assert after[("abbench_engine_bank_bytes", ())] == ab["bank_bytes"] == engine.bank_bytes
    assert after[("abbench_engine_h2d_bandwidth_bytes_per_second", ())] == \
        pytest.approx(ab["measured_h2d_gbps"] * 1e9)


def test_a_request_at_an_idle_engine_finds_its_first_layer_primed(tiny):
    """The server asks the idle engine to start the first layer's copy as a completion arrives, before the body
    is read (``EngineService.prime``): the prefill takes it (``first_layer_primed``) and still reports one bank
    per chunk. A request refused before its prefill leaves no prime behind for a later one."""
    client, engine = tiny
    store = engine.store
    client.post("/reset")
    taken0 = store.primes_taken
    r = client.post("/v1/completions", json=greedy(PROMPT_IDS, max_tokens=2))
    ab = r.json()["abbench"]
    assert ab["first_layer_primed"] is True and store.primes_taken == taken0 + 1
    assert ab["prefill_h2d_bytes"] == ab["n_chunks"] * ab["bank_bytes"]
    primes = {s.labels["outcome"]: s.value for fam in text_string_to_metric_families(client.get("/metrics").text)
              for s in fam.samples if s.name == "abbench_engine_first_layer_primes_total"}
    assert primes["taken"] == store.primes_taken and primes["dropped"] == store.primes_dropped
    assert client.post("/v1/completions", json=greedy(PROMPT_IDS, max_tokens=0)).status_code == 400
    deadline = time.monotonic() + 10  # the engine thread drops it (or, when the refusal came first, never made it)
    while store._prime is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store._prime is None


def test_reset_flushes_the_prefix_cache(tiny):
    client, engine = tiny
    prompt = (PROMPT_IDS * 5)[:48]
    assert client.post("/reset").json() == {"status": "ok"}
    first = client.post("/v1/completions", json=greedy(prompt, max_tokens=2)).json()
    again = client.post("/v1/completions", json=greedy(prompt, max_tokens=2)).json()
    assert first["abbench"]["cached_prompt_tokens"] == 0
    assert again["abbench"]["cached_prompt_tokens"] > 0  # the prefix cache served the repeat
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == again["abbench"]["cached_prompt_tokens"]
    assert client.post("/reset").json() == {"status": "ok"}
    flushed = client.post("/v1/completions", json=greedy(prompt, max_tokens=2)).json()
    assert flushed["abbench"]["cached_prompt_tokens"] == 0
    assert flushed["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]


def _metric(client, name: str) -> float:
    """A sample without labels from the server's /metrics."""
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_real_engine_is_cancelled_when_a_streaming_client_hangs_up(tiny):
    client, engine = tiny
    cancelled_before = engine.counters["requests_cancelled"]
    checks = _metric(client, "abbench_engine_cancel_checks_total")
    flagged = _metric(client, "abbench_engine_cancel_checks_set_total")
    with httpx.Client(base_url=str(client.base_url), timeout=30) as own:
        with own.stream("POST", "/v1/completions", json=greedy(PROMPT_IDS, max_tokens=100, stream=True)) as s:
            assert json.loads(next(s.iter_lines()).removeprefix("data: "))["choices"][0]["token_ids"]
    _wait_for(lambda: engine.counters["requests_cancelled"] == cancelled_before + 1, timeout=30)
    # counted in the engine's steps, not in wall time: it stopped at the first check that saw the flag, and
    # ran fewer layer steps than the 100 tokens need (each decode step checks once per layer and once more)
    assert _metric(client, "abbench_engine_cancel_checks_set_total") - flagged == 1
    layers = engine.model_config.num_hidden_layers
    assert _metric(client, "abbench_engine_cancel_checks_total") - checks < 99 * (layers + 1)
    r = client.post("/v1/completions", json=greedy(PROMPT_IDS, max_tokens=2))
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 2


def test_models_and_health(tiny):
    client, _ = tiny
    assert client.get("/health").json() == {"status": "ok"}
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny"
    assert models["data"][0]["max_model_len"] == MAX_CONTEXT
    assert_openai_error(client.get("/v1/nothing"), 404)


@pytest.mark.slow
def test_cli_main_serves_and_refuses_overrides_by_default():
    """``python -m abbench.engine`` end to end: the ready line, a completion, refusal of prefill_mode; Ctrl-C
    (SIGINT) ends it with one line and exit 130, not a traceback (uvicorn raises the signal again after its
    shutdown)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "abbench.engine", "--port", "0", "--max-context", "64",
                             "--log-level", "warning"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            # SIGINT as a terminal gives it (a suite started in the background passes it ignored)
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        lines = []
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, f"server exited early: {''.join(lines)}"
            lines.append(line)
            m = re.match(r"abbench engine ready: (http://127\.0\.0\.1:\d+)", line)
            if m:
                break
        else:
            pytest.fail("no ready line")
        with httpx.Client(base_url=m.group(1), timeout=30) as client:
            assert client.get("/health").status_code == 200
            r = client.post("/v1/completions", json=greedy("Hello", max_tokens=2))
            assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 2
            for field, value in (("prefill_mode", "layer-major"), ("chunk_tokens", 64), ("decode_misses", "host")):
                refused = client.post("/v1/completions", json=greedy("Hello", max_tokens=2, **{field: value}))
                assert assert_openai_error(refused, 400, field)["code"] == "override_not_allowed"
            # output alone (the whole first row): no flag needed
            whole = client.post("/v1/completions", json=greedy("Hello", max_tokens=2, full_logprobs=True))
            assert whole.status_code == 200, whole.text
            row = np.frombuffer(base64.b64decode(whole.json()["abbench"]["full_logprobs"]), dtype="<f4")
            assert int(np.argmax(row)) == whole.json()["choices"][0]["token_ids"][0]
    finally:
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=20)
    assert proc.returncode == 130, rest
    assert "Traceback" not in rest and rest.rstrip().endswith("abbench engine: stopped (SIGINT)"), rest


# --------------------------------------------------------------------------------------------------
# The scripted stand-in: scheduling, cancellation, OOM, UTF-8 hold-back
# --------------------------------------------------------------------------------------------------


def _queue_waiting(client) -> float:
    for fam in text_string_to_metric_families(client.get("/metrics").text):
        if fam.name == "abbench_engine_queue_waiting":
            return fam.samples[0].value
    raise AssertionError("no queue gauge")


def _wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_requests_run_one_at_a_time_in_arrival_order_and_overflow_gets_429(scripted):
    client, engine, _ = scripted
    engine.hold.clear()  # the first request parks in prefill until released
    results: dict[int, httpx.Response] = {}

    def send(n):
        results[n] = client.post("/v1/completions", json=greedy([n], max_tokens=2))

    threads = [threading.Thread(target=send, args=(n,)) for n in (1, 2, 3)]
    threads[0].start()
    _wait_for(engine.prefill_started.is_set)
    for n, t in ((2, threads[1]), (3, threads[2])):  # queue_limit=2: both may wait
        t.start()
        _wait_for(lambda n=n: _queue_waiting(client) == n - 1)
    rejected = client.post("/v1/completions", json=greedy([4], max_tokens=2))
    assert assert_openai_error(rejected, 429)["code"] == "queue_full"
    engine.hold.set()
    for t in threads:
        t.join(10)
    assert [results[n].status_code for n in (1, 2, 3)] == [200, 200, 200]
    assert engine.started == [[1], [2], [3]] and engine.max_active == 1
    waits = [results[n].json()["abbench"]["queue_wait_s"] for n in (1, 2, 3)]
    assert waits[1] > waits[0] and waits[2] > waits[0]


def _raw_post(server: ServerThread, body: dict) -> socket.socket:
    """POST with a raw socket, so the test can hang up whenever it likes."""
    host, port = server.url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
    return sock


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_mid_prefill_cancels_and_next_request_runs(scripted, stream):
    client, engine, server = scripted
    engine.hold.clear()  # prefill would never end on its own
    sock = _raw_post(server, greedy([7, 8, 9], max_tokens=4, stream=stream))
    assert engine.prefill_started.wait(10)
    sock.close()
    assert engine.cancel_observed.wait(30), "the engine never saw the cancel"  # prefill is held: only a cancel ends it
    _wait_for(lambda: engine.outcomes == ["cancelled"])
    assert _metric(client, "abbench_engine_cancel_checks_set_total") == 1  # stopped at the first check that saw it
    engine.hold.set()
    r = client.post("/v1/completions", json=greedy([1, 2], max_tokens=2))
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == [785, 3974]
    assert engine.outcomes == ["cancelled", "ok"] and engine.max_active == 1


def test_client_disconnect_mid_stream_cancels_decode(scripted):
    client, engine, server = scripted
    engine.layers, engine.step_s = 2, 0.05  # ~5 s of decode if nobody cancels it
    with httpx.Client(base_url=server.url, timeout=10) as own:
        with own.stream("POST", "/v1/completions", json=greedy([5], max_tokens=100, stream=True)) as s:
            first = next(s.iter_lines())
            assert json.loads(first.removeprefix("data: "))["choices"][0]["token_ids"] == [785]
            assert engine.active == 1 and engine.outcomes == []  # on the wire while the engine still decodes
    assert engine.cancel_observed.wait(30)
    _wait_for(lambda: engine.outcomes == ["cancelled"])
    # counted in steps, not seconds: stopped at the first check that saw the flag, long before step 102
    assert _metric(client, "abbench_engine_cancel_checks_set_total") == 1
    assert _metric(client, "abbench_engine_cancel_checks_total") < engine.layers + 100
    assert client.post("/v1/completions", json=greedy([1], max_tokens=1)).status_code == 200


def test_client_leaving_the_queue_never_reaches_the_engine(scripted):
    client, engine, server = scripted
    engine.hold.clear()
    blocker = threading.Thread(target=lambda: client.post("/v1/completions", json=greedy([1], max_tokens=1)))
    blocker.start()
    _wait_for(engine.prefill_started.is_set)
    sock = _raw_post(server, greedy([2], max_tokens=1))
    _wait_for(lambda: _queue_waiting(client) == 1)
    sock.close()
    _wait_for(lambda: _queue_waiting(client) == 0)
    engine.hold.set()
    blocker.join(10)
    assert client.post("/v1/completions", json=greedy([3], max_tokens=1)).status_code == 200
    assert engine.started == [[1], [3]]


def test_device_oom_is_503_and_the_server_keeps_serving(scripted):
    client, engine, _ = scripted
    for stream in (False, True):
        engine.fail_next = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        r = client.post("/v1/completions", json=greedy([1], max_tokens=2, stream=stream))
        err = assert_openai_error(r, 503)
        assert err["code"] == "out_of_memory" and "2.00 GiB" in err["message"]
        assert client.post("/v1/completions", json=greedy([1], max_tokens=2, stream=stream)).status_code == 200


def test_oversized_body_is_413(scripted):
    client, engine, _ = scripted
    r = client.post("/v1/completions", json=greedy([1] * 40_000, max_tokens=1))
    assert assert_openai_error(r, 413)["code"] == "body_too_large"
    assert engine.started == []
    assert client.post("/v1/completions", json=greedy([1], max_tokens=1)).status_code == 200


def test_reset_runs_engine_reset(scripted):
    client, engine, _ = scripted
    assert client.post("/reset").json() == {"status": "ok"} and engine.resets == 1


def test_stream_holds_back_a_split_multibyte_character(scripted, qwen3):
    client, engine, _ = scripted
    head, tail = qwen3.encode(FLAMINGO)
    engine.outputs = [qwen3.encode("Hi")[0], head, tail]
    with client.stream("POST", "/v1/completions", json=greedy([1], max_tokens=3, stream=True)) as s:
        events, done = sse_events(s)
    assert done
    texts = [e["choices"][0]["text"] for e in events if e["choices"] and e["choices"][0]["token_ids"]]
    assert texts == ["Hi", "", FLAMINGO]  # never a U+FFFD on the wire
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == "Hi" + FLAMINGO


# --------------------------------------------------------------------------------------------------
# Tokenizers and the incremental detokenizer (real Qwen vocabularies)
# --------------------------------------------------------------------------------------------------


def test_detokenizer_holds_back_incomplete_utf8(qwen3):
    ids = qwen3.encode("a" + FLAMINGO + "b龘")
    assert qwen3.decode(ids[1:2]).endswith("\ufffd")  # the flamingo's first token is an incomplete sequence
    detok = IncrementalDetokenizer(qwen3)
    pieces = [detok.push(i) for i in ids]
    assert "\ufffd" not in "".join(pieces)
    assert pieces[:3] == ["a", "", FLAMINGO]
    assert "".join(pieces) + detok.flush() == qwen3.decode(ids) == "a" + FLAMINGO + "b龘"


def test_detokenizer_flush_emits_an_unfinished_tail_and_matches_decode(qwen3):
    import random

    detok = IncrementalDetokenizer(qwen3)
    head = qwen3.encode(FLAMINGO)[0]
    assert detok.push(qwen3.encode("x")[0]) == "x" and detok.push(head) == ""
    assert detok.flush() == "\ufffd"
    rng = random.Random(0)
    for _ in range(20):  # any id sequence, incl. ids the vocabulary lacks (a model's padded rows)
        ids = [rng.randrange(0, PRESETS["tiny"].vocab_size) for _ in range(30)]
        detok = IncrementalDetokenizer(qwen3)
        text = "".join(detok.push(i) for i in ids) + detok.flush()
        assert text == qwen3.decode(ids)


def test_load_tokenizer_specs(qwen3, tmp_path):
    assert qwen3.encode("Hello world") == [9707, 1879] and qwen3.decode([9707, 1879]) == "Hello world"
    new = load_tokenizer("qwen3.6")
    assert new.decode(new.encode("Hello 世界")) == "Hello 世界"
    for bad in ("gpt2", str(tmp_path / "missing"), ""):
        with pytest.raises(TokenizerSpecError, match="qwen3"):
            load_tokenizer(bad)
    with pytest.raises(TokenizerSpecError, match="could not load"):
        load_tokenizer(str(tmp_path))  # a directory without a tokenizer


def test_hf_directory_tokenizer(tmp_path):
    """A local Hugging Face tokenizer directory (built here from a byte-level BPE, no network)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(["hello world, hello there"] * 10, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<eos>"]))
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>").save_pretrained(tmp_path)
    tok = load_tokenizer(str(tmp_path))
    text = "hello " + FLAMINGO + "<eos>"
    ids = tok.encode(text)
    assert tok.eos_token_id == ids[-1] and tok.decode(ids) == text  # no special-token skipping
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push(i) for i in ids]
    assert "\ufffd" not in "".join(pieces) and FLAMINGO in pieces
    assert "".join(pieces) + detok.flush() == text


@pytest.mark.parametrize("backend", ["engine", "transformers"])
def test_serve_help_explains_every_option_and_its_examples_parse(backend: str) -> None:
    """`abbench serve --help`: every option has a help text, and each `abbench serve` example in its epilog
    parses with the engine's own parser (`abbench memory-plan` examples are typer's, checked there)."""
    import shlex

    from abbench.engine.serve.launch import EXAMPLES, build_arg_parser

    parser = build_arg_parser(backend)
    assert [a.option_strings for a in parser._actions if not a.help] == []
    assert parser.format_help().rstrip().endswith(EXAMPLES.rstrip().splitlines()[-1])
    lines = EXAMPLES.replace("\\\n", " ").splitlines()
    serves = [shlex.split(line.partition("#")[0])[2:] for line in lines if line.strip().startswith("abbench serve")]
    assert len(serves) >= 3
    for argv in serves:
        chosen = "transformers" if "--backend" in argv and argv[argv.index("--backend") + 1] == "transformers" \
            else "engine"
        build_arg_parser(chosen).parse_args(argv)  # SystemExit(2) on an option that does not exist


def test_the_memory_plan_example_in_serve_help_runs() -> None:
    import shlex

    from typer.testing import CliRunner

    from abbench.cli import app
    from abbench.engine.serve.launch import EXAMPLES

    (line,) = [ln for ln in EXAMPLES.splitlines() if ln.strip().startswith("abbench memory-plan")]
    r = CliRunner().invoke(app, shlex.split(line.partition("#")[0])[1:], env={"COLUMNS": "200"})
    assert r.exit_code == 0 and "max context 65,536, budget 16 GiB" in r.output, r.output
