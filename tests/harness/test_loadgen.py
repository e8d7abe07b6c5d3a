"""The load generator against real streaming servers on loopback: closed and open loop, stamps, errors counted,
seeded arrivals, prompts built to exact lengths."""

from __future__ import annotations

import math
import socket
import statistics

import numpy as np
import pytest

from abbench.loadgen import Level, LoadPrompt, Target, arrivals, draw_lengths, prompt_plan, run_level
from abbench.profile import LengthDist, LoadSpec, RequestSpec
from tests.support.fakeserver import FakeConfig, FakeServer
from tests.support.fakeserver import output_ids as fake_ids
from tests.support.fastsse import FastServer
from tests.support.fastsse import output_ids as fast_ids


def _prompts(n: int = 6, out: int = 8) -> list[LoadPrompt]:
    return [LoadPrompt(f"load-{i}", 4 + i, out, " ".join(f"w{i}x{j}" for j in range(4 + i))) for i in range(n)]


def test_closed_loop_keeps_n_in_flight_and_records_every_stamp() -> None:
    prompts = _prompts()
    with FastServer(token_delay_s=0.002) as srv:
        rec = run_level(Level("concurrency", 4, requests=24), Target(srv.base_url, RequestSpec(max_tokens=8), arm="a"),
                        prompts)
    assert [r.index for r in rec.requests] == list(range(24)) and all(r.ok for r in rec.requests)
    assert [r.prompt_id for r in rec.requests[:7]] == [f"load-{i % 6}" for i in range(7)]  # they cycle
    for r in rec.requests:
        p = prompts[int(r.prompt_id.split("-")[1])]
        assert r.output_ids == fast_ids(p.prompt, 8) and r.ids_source == "native"
        assert r.prompt_tokens == p.target_tokens and r.completion_tokens == 8 and r.scheduled_s is None
        assert 0 <= r.sent_s < r.first_token_s <= r.end_s  # type: ignore[operator]
        assert len(r.token_times_s) == 8 and r.token_times_s == sorted(r.token_times_s)
        assert abs(r.sent_s + r.token_times_s[0] - r.first_token_s) < 1e-5  # type: ignore[operator]
        assert r.token_times_s[-1] >= 7 * 0.002 * 0.9  # the last token left the server after its seven pauses
    # each token is stamped as it arrives, not once per response (a busy client may read two at once, never all)
    assert sum(len(set(r.token_times_s)) for r in rec.requests) > 24
    from abbench.analysis.load import in_flight

    steps = in_flight(rec)
    assert max(n for _, n in steps) == 4 and steps[-1][1] == 0
    assert rec.window_start_s == 0 and rec.window_end_s == max(r.sent_s for r in rec.requests)


def test_open_loop_sends_on_schedule_while_the_server_is_slow() -> None:
    """Each response takes ~0.6 s, arrivals come every ~25 ms: the generator must not wait for answers.

    The response time sets what a paced (omitting) sender would lag: about one response, 0.6 s. The bound on
    the lag is 0.5 s, strictly below that; with 0.3 s responses and a 0.25 s bound a loaded CI machine (a
    descheduled event loop, a connect) had 0.05 s of room."""
    with FastServer(first_delay_s=0.6) as srv:
        rec = run_level(Level("rate", 40, requests=20, seed=3), Target(srv.base_url, RequestSpec(max_tokens=4)),
                        _prompts(out=4))
    due = arrivals(40, n=20, seed=3)
    assert [r.scheduled_s for r in rec.requests] == [round(t, 6) for t in due]
    lags = [r.sent_s - r.scheduled_s for r in rec.requests]  # type: ignore[operator]
    assert min(lags) >= 0 and max(lags) < 0.5, lags  # below the 0.6 s a paced (omitting) sender would lag
    assert rec.requests[-1].sent_s < 0.6 + due[-1]  # the last was sent before the first answers could pace it
    from abbench.analysis.load import in_flight

    assert max(n for _, n in in_flight(rec)) >= 8
    assert all(r.ok and r.ttft_s >= 0.59 for r in rec.requests)  # type: ignore[operator]


def test_refusals_and_failures_are_counted_never_dropped() -> None:
    prompts = _prompts(4)
    with FastServer() as srv:
        refused = run_level(Level("concurrency", 2, requests=4),
                            Target(srv.base_url, RequestSpec(max_tokens=4), extra={"status": 429}), prompts)
        bad_usage = run_level(Level("concurrency", 1, requests=2), Target(srv.base_url, RequestSpec(max_tokens=4)),
                              [LoadPrompt("load-0", 99, 4, "only three words")])
    assert [(r.ok, r.error_kind, r.status) for r in refused.requests] == [(False, "http", 429)] * 4
    assert "too many requests" in (refused.requests[0].error or "")
    assert [(r.ok, r.error_kind) for r in bad_usage.requests] == [(False, "usage")] * 2
    with FakeServer(FakeConfig(mode="malformed-sse")) as srv:
        sse = run_level(Level("rate", math.inf, requests=3), Target(srv.base_url, RequestSpec(max_tokens=4)), prompts)
    assert [r.error_kind for r in sse.requests] == ["sse"] * 3
    with FakeServer(FakeConfig(mode="hang")) as srv:
        hung = run_level(Level("concurrency", 2, requests=2),
                         Target(srv.base_url, RequestSpec(max_tokens=4, timeout_s=0.3)), prompts)
    # the hung server never answers: a level that waited on it would not end; two 0.3 s deadlines end it (5 s:
    # room for a loaded machine, no room for a wait on the server)
    assert [r.error_kind for r in hung.requests] == ["timeout"] * 2 and hung.elapsed_s < 5
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there
    refused_conn = run_level(Level("rate", 50, requests=3), Target(f"http://127.0.0.1:{port}", RequestSpec()),
                             prompts)
    assert [r.error_kind for r in refused_conn.requests] == ["connect"] * 3


def test_the_fake_engine_of_the_other_tests_works_too() -> None:
    """The threaded fake of the engine's wire format (its ids are its own function of the prompt)."""
    prompts = _prompts(3, out=5)
    with FakeServer(FakeConfig()) as srv:
        rec = run_level(Level("rate", 100, requests=6), Target(srv.base_url, RequestSpec(max_tokens=5),
                                                               metrics_path="/metrics"), prompts)
    assert all(r.ok for r in rec.requests)
    assert rec.requests[1].output_ids == fake_ids(prompts[1].prompt, 5)


def test_scrapes_during_the_level() -> None:
    with FastServer(first_delay_s=0.2) as srv:  # each request in flight for 4 scrape intervals
        rec = run_level(Level("concurrency", 2, requests=10, scrape_interval_s=0.05),
                        Target(srv.base_url, RequestSpec(max_tokens=4), metrics_path="/metrics"), _prompts(out=4))
    assert len(rec.scrapes) >= 3 and rec.scrape_error is None
    assert {"fast_running", "fast_completions_total"} <= set(rec.scrapes[-1].metrics)
    assert max(s.metrics["fast_running"] for s in rec.scrapes) >= 1


def test_seeded_arrivals_are_reproducible_and_have_the_asked_rate() -> None:
    a = arrivals(10, n=2000, seed=7)
    assert a == arrivals(10, n=2000, seed=7) and a[0] == 0.0
    assert a != arrivals(10, n=2000, seed=7, round=2) and a != arrivals(10, n=2000, seed=8)
    g = np.diff(a)
    assert abs(g.mean() - 0.1) < 0.01 and abs(g.std() / g.mean() - 1) < 0.1  # exponential: CV 1
    bursty = np.diff(arrivals(10, n=2000, seed=7, burstiness=0.25))
    assert abs(bursty.mean() - 0.1) < 0.02 and bursty.std() / bursty.mean() > 1.6  # gamma k=0.25: CV 2
    timed = arrivals(10, duration_s=5, seed=1)
    assert max(timed) < 5 and 30 < len(timed) < 75
    assert arrivals(math.inf, n=4) == [0.0] * 4
    with pytest.raises(ValueError):
        arrivals(0, n=3)


def test_length_draws() -> None:
    rng = np.random.default_rng(0)
    assert draw_lengths(LengthDist(fixed=9), 3, rng) == [9, 9, 9]
    u = draw_lengths(LengthDist(uniform=(4, 6)), 600, rng)
    assert set(u) == {4, 5, 6}
    w = draw_lengths(LengthDist(values=[8, 64], weights=[3, 1]), 4000, rng)
    assert set(w) == {8, 64} and abs(w.count(8) / 4000 - 0.75) < 0.03
    spec = LoadSpec(concurrency=[2], requests=5, prompt_tokens=LengthDist(uniform=(8, 12)),
                    output_tokens=LengthDist(values=[3, 5]), seed=4)
    plan = prompt_plan(spec, 16)
    assert plan == prompt_plan(spec, 16) and [p[0] for p in plan] == [f"load-{i}" for i in range(5)]
    assert all(8 <= n <= 12 and o in (3, 5) for _, n, o in plan)
    assert [o for _, _, o in prompt_plan(LoadSpec(concurrency=[1], requests=2), 16)] == [16, 16]


def test_load_prompts_are_built_to_exact_lengths() -> None:
    from abbench.loadgen import build_load_prompts
    from abbench.profile import PromptsSpec
    from abbench.tokenizers import encode_ids, load_tokenizer

    tok = load_tokenizer("qwen3")
    spec = LoadSpec(concurrency=[1], requests=3, prompt_tokens=LengthDist(values=[16, 40]), seed=2)
    built = build_load_prompts(tok, PromptsSpec(), spec, 8)
    assert [p.id for p in built] == ["load-0", "load-1", "load-2"]
    for p in built:
        assert len(encode_ids(tok, p.prompt)) == p.target_tokens and p.record is not None
        assert p.record.token_count == p.target_tokens
    again = build_load_prompts(tok, PromptsSpec(), spec, 8)
    assert [p.record.sha256 for p in again] == [p.record.sha256 for p in built]  # type: ignore[union-attr]
    assert len({p.record.sha256 for p in built}) == 3  # type: ignore[union-attr]
    assert statistics.mean(p.max_tokens for p in built) == 8


def test_the_http_reader_takes_odd_framings() -> None:
    """A stream written in odd-sized pieces with CRLF line ends, comments and two-line data; an error body
    framed by content-length; the same ids as a plain stream."""
    prompts = _prompts(2, out=5)
    with FakeServer(FakeConfig(mode="split-chunks")) as srv:
        split = run_level(Level("concurrency", 2, requests=4), Target(srv.base_url, RequestSpec(max_tokens=5)),
                          prompts)
    assert all(r.ok for r in split.requests), [r.error for r in split.requests]
    assert split.requests[1].output_ids == fake_ids(prompts[1].prompt, 5)
    with FakeServer(FakeConfig(mode="http-500")) as srv:
        err = run_level(Level("concurrency", 1, requests=3), Target(srv.base_url, RequestSpec(max_tokens=5)),
                        prompts)
    assert [(r.error_kind, r.status) for r in err.requests] == [("http", 500)] * 3


def test_the_reader_by_hand() -> None:
    """Framing fed byte by byte: chunk sizes split, a chunk extension, trailers, an interim 100, a keep-alive
    that the server refuses, and a body delimited by the close."""
    import asyncio

    from abbench.adapters import get_adapter
    from abbench.loadgen.wire import Connection, Exchange

    class _T:
        def __init__(self) -> None:
            self.aborted = False

        def write(self, data: bytes) -> None:
            pass

        def abort(self) -> None:
            self.aborted = True

        def get_extra_info(self, name: str) -> None:
            return None

    ev = (b'data: {"choices":[{"index":0,"text":"a","token_ids":[7],"finish_reason":"length"}]}\n\n'
          b'data: {"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1}}\n\ndata: [DONE]\n\n')

    async def run(resp: bytes, step: int) -> tuple[Exchange, Connection, _T]:
        loop = asyncio.get_running_loop()
        c, t = Connection("h"), _T()
        c.connection_made(t)  # type: ignore[arg-type]
        ex = Exchange(get_adapter("openai"), "POST x", loop)
        c.send(ex, b"")
        for i in range(0, len(resp), step):
            c.data_received(resp[i:i + step])
        if not ex.done.done():
            c.eof_received()
        if not ex.done.done():  # the transport closes after an EOF
            c.connection_lost(None)
        await asyncio.wait_for(ex.done, 1)
        return ex, c, t

    half = len(ev) // 2
    chunked = (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
               b"transfer-encoding: chunked\r\n\r\n" + f"{half:x};ext=1\r\n".encode() + ev[:half] + b"\r\n"
               + f"{len(ev) - half:X}\r\n".encode() + ev[half:] + b"\r\n0\r\nx-trailer: 1\r\n\r\n")
    for step in (1, 7, len(chunked)):
        ex, c, t = asyncio.run(run(chunked, step))
        assert ex.error is None and ex.saw_done and ex.status == 200 and c.reusable and not t.aborted
        assert ex.raw().events[0]["choices"][0]["token_ids"] == [7]
    closing = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n" + ev)
    ex, c, t = asyncio.run(run(closing, 5))
    assert ex.error is None and ex.saw_done and not c.reusable
    short = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: 999\r\n\r\n" + ev
    ex, c, _ = asyncio.run(run(short, 9))
    assert ex.error is not None and ex.error.kind == "connect"  # cut short: a dropped connection, not a success
    bad = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n"
    ex, c, t = asyncio.run(run(bad, 4))
    assert ex.error is not None and ex.error.kind == "protocol" and t.aborted


def test_duration_and_windows() -> None:
    """Sends stop after duration_s; the window cuts warmup_s off the start and cooldown_s off the last send."""
    from abbench.analysis.load import measured

    # a 20 ms answer gives ~90 sends in 1 s; a loaded 2-core machine has stalled one pair of requests for ~0.4 s,
    # so the level runs long enough that the window holds sends however the scheduler treats it
    with FastServer(first_delay_s=0.02) as srv:
        rec = run_level(Level("concurrency", 2, requests=None, duration_s=1.0, warmup_s=0.1, cooldown_s=0.1),
                        Target(srv.base_url, RequestSpec(max_tokens=4)), _prompts(out=4))
        timed = run_level(Level("rate", 50, requests=None, duration_s=0.3, seed=2),
                          Target(srv.base_url, RequestSpec(max_tokens=4)), _prompts(out=4))
    sends = [r.sent_s for r in rec.requests]
    assert max(sends) < 1.0 + 0.05 and len(sends) >= 6 and all(r.ok for r in rec.requests)
    assert rec.window_start_s == 0.1 and rec.window_end_s == pytest.approx(max(sends) - 0.1, abs=1e-6)
    inside = measured(rec)
    assert inside and all(0.1 <= r.sent_s <= rec.window_end_s for r in inside) and len(inside) < len(sends)
    assert [r.scheduled_s for r in timed.requests] == [round(t, 6) for t in arrivals(50, duration_s=0.3, seed=2)]


def test_an_interrupt_keeps_what_finished() -> None:
    """SIGINT in the middle of a level: the requests that ended are kept, those in flight are marked, and the
    level says it stopped."""
    import os
    import signal
    import threading
    import time

    # asyncio's runner takes SIGINT only over Python's default handler, and a process started in the background
    # by a shell inherits SIGINT ignored: the test puts the default in place, and back what was there
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    with FastServer(first_delay_s=0.15) as srv:
        done = threading.Event()

        def interrupt() -> None:  # once two requests have ended for the client (not at a fixed time: a loaded
            # machine is slow): the server has answered a fourth, so each connection sent a request after one ended
            while not done.is_set() and srv.completions < 4:
                time.sleep(0.01)
            if not done.is_set():
                os.kill(os.getpid(), signal.SIGINT)

        sender = threading.Thread(target=interrupt, daemon=True)
        sender.start()
        try:
            rec = run_level(Level("concurrency", 2, requests=40), Target(srv.base_url, RequestSpec(max_tokens=4)),
                            _prompts(out=4))
        finally:
            done.set()
            sender.join(5)
            signal.signal(signal.SIGINT, inherited)
    assert rec.stopped and rec.stopped.startswith("interrupted")
    kinds = [r.error_kind for r in rec.requests]
    assert 2 <= sum(r.ok for r in rec.requests) < 40 and "interrupted" in kinds
    assert all(r.ok or r.error_kind == "interrupted" for r in rec.requests)


from tests.harness.test_auth import _https_fake, tls_files  # noqa: E402,F401 (a private CA and its server)


def test_https_with_a_private_ca_and_a_key(tls_files) -> None:  # noqa: F811
    from abbench.auth import tls_verify

    prompts = _prompts(2, out=4)
    with _https_fake(tls_files, api_key="sekrit") as srv:
        url = srv.base_url.replace("http://", "https://")
        good = run_level(Level("concurrency", 2, requests=4),
                         Target(url, RequestSpec(max_tokens=4), headers={"Authorization": "Bearer sekrit"},
                                verify=tls_verify(tls_files["ca"])), prompts)
        untrusted = run_level(Level("concurrency", 1, requests=1), Target(url, RequestSpec(max_tokens=4)), prompts)
        no_key = run_level(Level("concurrency", 1, requests=1),
                           Target(url, RequestSpec(max_tokens=4), verify=tls_verify(tls_files["ca"])), prompts)
    assert all(r.ok for r in good.requests), [r.error for r in good.requests]
    assert untrusted.requests[0].error_kind == "connect" and "TLS" in (untrusted.requests[0].error or "")
    assert (no_key.requests[0].error_kind, no_key.requests[0].status) == ("http", 401)


def test_gpus_are_sampled_through_nvml_during_a_level(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stand-in for pynvml (this machine has no GPU): two GPUs, their memory and utilisation sampled during
    the level beside the metrics path; without NVML nothing is sampled and nothing fails."""
    import types

    import abbench.loadgen.drive as drive
    import abbench.nvml as nvml

    calls = {"n": 0}

    def util(h: int) -> types.SimpleNamespace:
        calls["n"] += 1
        return types.SimpleNamespace(gpu=40 + h)

    fake = types.SimpleNamespace(
        nvmlDeviceGetCount=lambda: 2, nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=(h + 1) * 2**30), nvmlDeviceGetUtilizationRates=util)
    assert nvml.gpu_sample() is None or isinstance(nvml.gpu_sample(), dict)
    monkeypatch.setattr(nvml, "module", lambda: fake)
    monkeypatch.setattr(drive, "nvml_available", lambda: True)
    assert nvml.gpu_sample([1]) == {'nvml_gpu_memory_used_bytes{gpu="1"}': 2.0 * 2**30,
                                    'nvml_gpu_utilization_pct{gpu="1"}': 41.0}
    with FastServer(first_delay_s=0.05) as srv:
        rec = run_level(Level("concurrency", 2, requests=8, scrape_interval_s=0.05),
                        Target(srv.base_url, RequestSpec(max_tokens=4)), _prompts(out=4))
    assert len(rec.scrapes) >= 3 and calls["n"] >= 6
    assert rec.scrapes[-1].metrics == {'nvml_gpu_memory_used_bytes{gpu="0"}': 2.0**30,
                                       'nvml_gpu_utilization_pct{gpu="0"}': 40.0,
                                       'nvml_gpu_memory_used_bytes{gpu="1"}': 2.0 * 2**30,
                                       'nvml_gpu_utilization_pct{gpu="1"}': 41.0}
    monkeypatch.setattr(drive, "nvml_available", lambda: False)
    with FastServer() as srv:
        plain = run_level(Level("concurrency", 1, requests=2), Target(srv.base_url, RequestSpec(max_tokens=4)),
                          _prompts(out=4))
    assert plain.scrapes == [] and all(r.ok for r in plain.requests)


def test_a_server_that_closes_after_every_stream_gets_a_new_connection_each_time() -> None:
    """llama.cpp's adapter says its server closes the connection after each stream: never reused."""
    from abbench.adapters import OpenAIAdapter

    class Closing(OpenAIAdapter):
        closes_after_stream = True

    with FakeServer(FakeConfig()) as srv:
        rec = run_level(Level("concurrency", 1, requests=4),
                        Target(srv.base_url, RequestSpec(max_tokens=3), adapter=Closing()), _prompts(out=3))
        stats = srv.stats()
    assert all(r.ok for r in rec.requests) and stats["connections"] >= 4


@pytest.mark.parametrize("engine", ["vllm", "sglang", "llamacpp"])
def test_every_adapter_under_load(engine: str) -> None:
    """The fakes of vLLM, SGLang (cumulative events) and llama.cpp (no done marker, a closed connection after
    every stream) in their own wire formats, with real exact-length prompts: every request verified."""
    from abbench.loadgen import build_load_prompts
    from abbench.profile import PromptsSpec
    from abbench.tokenizers import load_tokenizer
    from tests.support.fake_engines import FakeEngine, FakeEngineConfig

    load = LoadSpec(concurrency=[3], requests=6, prompts=3, prompt_tokens=LengthDist(values=[12, 20]), seed=5)
    prompts = build_load_prompts(load_tokenizer("qwen3"), PromptsSpec(), load, 5)
    cfg = FakeEngineConfig(engine, llamacpp_close_after_stream_s=0.0 if engine == "llamacpp" else None)
    with FakeEngine(cfg) as eng:
        rec = run_level(Level("concurrency", 3, requests=6), Target(eng.base_url, RequestSpec(max_tokens=5),
                                                                    adapter=engine), prompts)
    assert all(r.ok for r in rec.requests), [r.error for r in rec.requests]
    assert all(r.completion_tokens == 5 and len(r.output_ids) == 5 and r.ids_source == "native"
               and r.prompt_tokens == r.target_tokens for r in rec.requests)
    assert rec.requests[0].output_ids == rec.requests[3].output_ids  # the same prompt, the same greedy ids


def test_a_llamacpp_stream_short_of_ids_is_completed_after_the_level() -> None:
    """Tokens ending inside a UTF-8 character send no id in llama.cpp's stream: the request is repeated, not
    streamed, after the level, and its ids taken when they agree with the stream (as the sequential client)."""
    from abbench.loadgen import build_load_prompts
    from abbench.profile import PromptsSpec
    from abbench.tokenizers import load_tokenizer
    from tests.support.fake_engines import FakeEngine, FakeEngineConfig

    load = LoadSpec(concurrency=[2], requests=2, prompts=2, prompt_tokens=LengthDist(fixed=16))
    prompts = build_load_prompts(load_tokenizer("qwen3"), PromptsSpec(), load, 6)
    with FakeEngine(FakeEngineConfig("llamacpp")) as eng:
        rec = run_level(Level("concurrency", 2, requests=2),
                        Target(eng.base_url, RequestSpec(max_tokens=6), adapter="llamacpp",
                               extra={"fake_mid_char": [2]}), prompts)
    for r in rec.requests:
        assert r.ok, r.error
        assert len(r.output_ids) == 6 and len(r.token_times_s or []) == 5  # the stream's own arrivals stay
        assert r.engine is not None and r.engine["ids_refetched"]["streamed_ids"] == 5


def test_a_connection_lost_before_the_send_fails_at_once() -> None:
    import asyncio

    from abbench.adapters import get_adapter
    from abbench.loadgen.wire import Connection, Exchange

    async def go() -> Exchange:
        c = Connection("h")
        c.connection_made(type("T", (), {"get_extra_info": lambda self, n: None, "abort": lambda self: None,
                                         "write": lambda self, d: None})())  # type: ignore[arg-type]
        c.connection_lost(None)
        ex = Exchange(get_adapter("openai"), "POST x", asyncio.get_running_loop())
        c.send(ex, b"")
        await asyncio.wait_for(ex.done, 1)
        return ex

    ex = asyncio.run(go())
    assert ex.error is not None and ex.error.kind == "connect" and "closed before the request" in ex.error.detail
