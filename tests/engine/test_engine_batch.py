"""The engine serving many requests at once (abbench.engine.runtime.scheduler): a prompt's greedy ids and logprobs
are bitwise the same alone and in any batch, in every prefill mode and every model family, with the decode slot
cache missing; a prefill batch streams one bank per window for all of its prompts; sequences join and leave
between decode steps; one cancelled sequence disturbs no other; admission is bounded by max_num_seqs and
max_prefill_batch_tokens; each sequence cache keeps its own prefix. And the same through the HTTP server.

Small shapes where the properties hold: 64-token chunks (the delta rule's block), a few hundred tokens, windows
that span prompts. Set ABBENCH_ENGINE_TEST_DEVICE=cuda to run them on a GPU.
"""

from __future__ import annotations

import json
import os
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
import torch

from abbench.engine.config import EngineConfig
from abbench.engine.contract import Cancelled, GenerateRequest
from abbench.engine.runtime.engine import Engine
from abbench.engine.tools import gpucheck_batch
from abbench.engine.tools.gpucheck_batch import run_alone, run_together

DEVICE = os.environ.get("ABBENCH_ENGINE_TEST_DEVICE", "cpu")
KNOBS = dict(chunk_tokens=64, layer_major_window_tokens=256, max_context=1024, bandwidth_probe_bytes=0,
             device=DEVICE)
MODELS = ("tiny", "qwen3.5-tiny", "qwen4-exp-tiny")


def _prompts(engine: Engine, lengths, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, engine.model_config.vocab_size, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module", params=MODELS)
def family(request) -> Engine:
    return Engine(EngineConfig(model=request.param, prefill_mode="layer-major", **KNOBS))


def test_a_prefill_batch_is_bitwise_each_prompt_alone_and_streams_one_bank_per_window(family):
    engine = family
    prompts = _prompts(engine, (150, 64, 300, 20))  # 3 + 1 + 5 + 1 chunks; windows of 4 span prompts
    solo = []
    for p in prompts:
        engine.reset()
        solo.append(run_alone(engine, p, 6))
    engine.reset()
    rows, _ = run_together(engine, prompts, 6)
    for r, s in zip(rows, solo, strict=True):
        assert r["ids"] == s["ids"] and r["logprobs"] == s["logprobs"]
    st = rows[0]["stats"]
    assert all(r["stats"].prefill_batch == 4 and r["stats"].prefill_path == "layer-major" for r in rows)
    assert st.n_windows == 3 and st.prefill_h2d_bytes == 3 * engine.bank_bytes  # 10 chunks, 4 a window
    alone = sum(s["stats"].prefill_h2d_bytes for s in solo)  # 1 + 1 + 2 + 1 banks (windows of 4 chunks)
    assert alone == 5 * engine.bank_bytes


@pytest.fixture(scope="module")
def offloaded() -> Engine:
    """Experts offloaded with a slot cache that misses (8 of 16 experts a layer): decode copies experts."""
    return Engine(EngineConfig(model="tiny", expert_slots_per_layer=8, max_num_seqs=4, **KNOBS))


@pytest.mark.parametrize("mode", ["chunked", "layer-major", "demand"])
def test_sequences_join_and_leave_between_decode_steps_with_the_ids_they_get_alone(offloaded, mode):
    engine = offloaded
    prompts = _prompts(engine, (200, 90, 130, 40, 70), seed=1)
    lengths = [20, 5, 12, 9, 3]
    solo = []
    for p, n in zip(prompts, lengths, strict=True):
        engine.reset()
        ev, _ = engine.run(p, n, prefill_mode=mode, ignore_eos=True)
        solo.append([e.token_id for e in ev])
    engine.reset()
    outs = [[] for _ in prompts]
    sched, most = engine.scheduler, 0

    def submit(i: int) -> None:
        req = engine.resolve(GenerateRequest(prompts[i], lengths[i], prefill_mode=mode, ignore_eos=True))
        sched.submit(req, None, outs[i].append)

    submit(0)
    arrivals = {2: [1, 2], 5: [3], 9: [4]}  # step -> requests arriving then
    step = 0
    while sched.busy or any(s > step for s in arrivals):
        for i in arrivals.get(step, []):
            submit(i)
        sched.step()
        most = max(most, len(sched.running))
        step += 1
    assert most >= 3  # several decoding at once
    for out, want in zip(outs, solo, strict=True):
        assert [e.token_id for e in out[:-1]] == want
        assert out[-1].stats.completion_tokens == len(want)
    assert sum(out[-1].stats.slot_misses for out in outs) > 0  # the slot cache missed: decode copied experts


def test_one_cancelled_sequence_disturbs_no_other(offloaded):
    engine = offloaded
    prompts = _prompts(engine, (120, 80, 100), seed=2)
    solo = []
    for p in prompts:
        engine.reset()
        solo.append([e.token_id for e in engine.run(p, 10, ignore_eos=True)[0]])
    engine.reset()
    outs = [[] for _ in prompts]
    flags = [threading.Event() for _ in prompts]
    for i, p in enumerate(prompts):
        engine.scheduler.submit(engine.resolve(GenerateRequest(p, 10, ignore_eos=True)), flags[i], outs[i].append)
    for _ in range(4):
        engine.scheduler.step()
    flags[1].set()  # mid-decode
    cancelled0 = engine.counters["requests_cancelled"]
    while engine.scheduler.busy:
        engine.scheduler.step()
    assert isinstance(outs[1][-1], Cancelled)
    assert [e.token_id for e in outs[1][:-1]] == solo[1][: len(outs[1]) - 1]
    for i in (0, 2):
        assert [e.token_id for e in outs[i][:-1]] == solo[i]
    assert engine.counters["requests_cancelled"] == cancelled0 + 1
    assert engine.scheduler.pool.free() == 4  # every cache back


def test_max_num_seqs_and_max_prefill_batch_tokens_bound_admission():
    engine = Engine(EngineConfig(model="tiny", prefill_mode="layer-major", max_num_seqs=3,
                                 max_prefill_batch_tokens=400, **KNOBS))
    prompts = _prompts(engine, (300, 300, 90, 90), seed=3)
    solo = [run_alone(engine, p, 4) for p in prompts if engine.reset() is None]
    engine.reset()
    rows, _ = run_together(engine, prompts, 4)
    assert [r["ids"] for r in rows] == [s["ids"] for s in solo]
    # 300 + 300 > 400 tokens: the first runs alone; the second and third share a batch (the two other caches);
    # the fourth waits for a cache
    assert [r["stats"].prefill_batch for r in rows] == [1, 2, 2, 1]
    assert rows[3]["stats"].queue_s > rows[0]["stats"].queue_s


def test_each_sequence_cache_keeps_its_own_prefix():
    """Two conversations at once, then each one's next turn: each reuses its own cache's prompt and output."""
    engine = Engine(EngineConfig(model="tiny", max_num_seqs=2, **KNOBS))
    a, b = _prompts(engine, (150, 110), seed=4)
    rows, _ = run_together(engine, [a, b], 5)
    turn2 = [a + rows[0]["ids"] + [7, 8, 9], b + rows[1]["ids"] + [10]]
    rows2, _ = run_together(engine, turn2, 3)
    assert [r["stats"].cached_prompt_tokens for r in rows2] == [len(a) + 4, len(b) + 4]  # the last output's KV
    engine.reset()
    cold = [run_alone(engine, p, 3) for p in turn2 if engine.reset() is None]
    assert [r["ids"] for r in rows2] == [c["ids"] for c in cold]


def test_gpucheck_batch_passes_on_cpu(tmp_path):
    out = tmp_path / "batch.json"
    rc = gpucheck_batch.main(["--model", "tiny", "--device", DEVICE, "--prompts", "3", "--tokens", "200",
                              "--chunk-tokens", "64", "--window-tokens", "256", "--decode-seqs", "3",
                              "--decode-prompt", "100", "--decode-tokens", "6", "--repeats", "1",
                              "--max-over-floor", "1000", "--expert-dtype", "fp8", "--out", str(out)])
    report = json.loads(out.read_text())
    assert rc == 0 and report["pass"] and report["expert_format"].startswith("fp8")
    assert report["decode"]["ids_equal_solo"] and report["decode"]["step_s_together"] > 0
    assert report["max_context"] == 200 + 8  # the prefill batch's prompts and checked tokens
    rc = gpucheck_batch.main(["--model", "tiny", "--device", DEVICE, "--prompts", "0", "--decode-seqs", "2",
                              "--decode-prompt", "100", "--decode-tokens", "6", "--profile", "--out", str(out)])
    report = json.loads(out.read_text())
    assert rc == 0 and report["max_context"] == 106  # decode only: its caches sized for it, not for --tokens
    prof = report["profile"]  # CUDA: the decode's kernels a step; elsewhere no device activity to read
    if DEVICE.startswith("cuda"):
        for way in ("alone", "together"):
            assert prof[way]["steps"] == 5 and prof[way]["busy_ms"] > 0 and prof[way]["top_kernels_ms_per_step"]
            assert prof[way]["busy_ms"] <= prof[way]["span_ms"] + 1e-9 and prof[way]["concurrency"] >= 1.0
    else:
        assert prof is None


def test_a_kernel_timeline_says_what_ran_at_once_and_beside_the_prefetch():
    """gpucheck_batch.kernel_timeline over 2 steps (us): a main kernel 0-100, a copy kernel 50-150 (half of it
    beside the main one), another main kernel 200-260 and a copy kernel 300-340 alone. Busy = the union (150 +
    60 + 40 = 250 us), the kernels' sum 300 us, idle 340 - 250 = 90 us, the copies 140 us of which 50 us had
    another kernel beside them; a step is half of each."""
    kern = [("gemv", 0.0, 100.0), ("_fetch_rows", 50.0, 150.0), ("attn", 200.0, 260.0), ("_fetch_rows", 300.0, 340.0)]
    got = gpucheck_batch.kernel_timeline(kern, steps=2)
    assert got["span_ms"] == pytest.approx(0.17) and got["busy_ms"] == pytest.approx(0.125)
    assert got["kernel_sum_ms"] == pytest.approx(0.15) and got["concurrency"] == pytest.approx(1.2)
    assert got["idle_ms"] == pytest.approx(0.045)
    assert got["mark_ms"] == pytest.approx(0.07) and got["mark_overlapped_ms"] == pytest.approx(0.025)
    # a copy kernel spanning two others and a gap: only the parts with a kernel beside it count
    got = gpucheck_batch.kernel_timeline([("_fetch_rows", 0.0, 100.0), ("a", 10.0, 20.0), ("b", 15.0, 30.0),
                                          ("c", 90.0, 120.0)], steps=1)
    assert got["mark_overlapped_ms"] == pytest.approx(0.030) and got["mark_ms"] == pytest.approx(0.1)
    assert gpucheck_batch.kernel_timeline([], steps=3) == {"steps": 3, "kernels": 0}


def test_a_decode_step_is_put_against_its_copy_floor():
    """gpucheck_batch's copy floor: a step's H2D bytes (alone: the sequence's; together: every sequence's share of
    the batched steps) over the measured bandwidth, and the measured step over it; none without a bandwidth."""
    def row(h2d: int) -> dict:
        return {"stats": SimpleNamespace(decode_h2d_bytes=h2d)}

    got = gpucheck_batch._copy_floor(row(10 * 10**9), [row(40 * 10**9), row(60 * 10**9)], steps=10, alone_tps=100.0,
                                     together_tps=10.0, gbps=50.0)
    assert got["copy_floor_s_alone"] == pytest.approx(0.02) and got["copy_floor_s_together"] == pytest.approx(0.2)
    assert got["step_s_together"] == pytest.approx(0.2) and got["together_over_copy_floor"] == pytest.approx(1.0)
    assert got["alone_over_copy_floor"] == pytest.approx(0.5)
    assert "copy_floor_s_alone" not in gpucheck_batch._copy_floor(row(1), [row(1)], 1, 1.0, 1.0, float("nan"))


def test_the_server_batches_concurrent_requests_with_the_ids_they_get_alone():
    from abbench.engine.serve.server import create_app
    from abbench.tokenizers import load_tokenizer
    from tests.support.uvicorn_thread import ServerThread

    engine = Engine(EngineConfig(model="tiny", prefill_mode="layer-major", max_num_seqs=4, **KNOBS))
    prompts = _prompts(engine, (900, 200, 180, 160), seed=5)
    server = ServerThread(create_app(engine, load_tokenizer("qwen3"), queue_limit=8))
    try:
        with httpx.Client(base_url=server.url, timeout=120) as c:
            alone = []
            for p in prompts:
                c.post("/reset")
                r = c.post("/v1/completions", json={"prompt": p, "max_tokens": 4, "temperature": 0,
                                                    "ignore_eos": True})
                alone.append(r.json()["choices"][0]["token_ids"])
            c.post("/reset")
            results: dict[int, dict] = {}

            def send(i: int) -> None:
                with httpx.Client(base_url=server.url, timeout=120) as own:
                    results[i] = own.post("/v1/completions", json={"prompt": prompts[i], "max_tokens": 4,
                                                                   "temperature": 0, "ignore_eos": True}).json()

            first = threading.Thread(target=send, args=(0,))  # a long prompt: the others queue behind it
            first.start()
            while not engine.scheduler.running:
                pass
            rest = [threading.Thread(target=send, args=(i,)) for i in (1, 2, 3)]
            for t in rest:
                t.start()
            for t in [first, *rest]:
                t.join(120)
            assert [results[i]["choices"][0]["token_ids"] for i in range(4)] == alone
            assert max(results[i]["abbench"]["prefill_batch"] for i in (1, 2, 3)) > 1  # queued prompts batched
            metrics = c.get("/metrics").text
            assert "abbench_engine_requests_running 0.0" in metrics
    finally:
        server.stop()


def test_a_decoding_sequence_gets_a_token_every_iteration_while_others_are_admitted(offloaded):
    """The policy between prefill and decode: prefill first, one prefill batch per iteration, then every sequence
    that already had its first token decodes one: so a decoding sequence waits at most one prefill batch per
    token, whatever arrives meanwhile."""
    engine = offloaded
    engine.reset()
    a, *rest = _prompts(engine, (60, 300, 250, 280), seed=6)
    out_a: list = []
    sched = engine.scheduler
    sched.submit(engine.resolve(GenerateRequest(a, 12, ignore_eos=True)), None, out_a.append)
    sched.step()  # a's prefill and first token
    for i, p in enumerate(rest):  # a long prompt arrives at each of the next iterations
        sched.submit(engine.resolve(GenerateRequest(p, 2, ignore_eos=True)), None, lambda _item: None)
        before = len(out_a)
        sched.step()
        assert len(out_a) == before + 1, i  # one prefill batch, then a's next token
    while sched.busy:
        sched.step()
    assert out_a[-1].stats.completion_tokens == 12


def _metric(c: httpx.Client, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(c.get("/metrics").text):
        for sample in fam.samples:
            if sample.name == name:
                return sample.value
    raise AssertionError(f"no {name}")


def test_clients_that_leave_mid_stream_disturb_no_other_request_on_the_server():
    """Six streamed requests at once on four sequence caches; two clients hang up after their first tokens. The
    other four get the ids they get alone, the two are counted as cancelled, and the engine ends idle with
    every cache free and serves the next request as it would alone."""
    from abbench.engine.serve.server import create_app
    from abbench.tokenizers import load_tokenizer
    from tests.support.uvicorn_thread import ServerThread

    engine = Engine(EngineConfig(model="tiny", prefill_mode="layer-major", max_num_seqs=4, **KNOBS))
    prompts = _prompts(engine, (150,) * 6, seed=7)
    leaving = {1, 4}
    body = lambda i, n: {"prompt": prompts[i], "max_tokens": n, "temperature": 0, "ignore_eos": True}  # noqa: E731
    server = ServerThread(create_app(engine, load_tokenizer("qwen3"), queue_limit=8))
    try:
        with httpx.Client(base_url=server.url, timeout=120) as c:
            alone = {}
            for i in range(6):
                if i not in leaving:
                    c.post("/reset")
                    alone[i] = c.post("/v1/completions", json=body(i, 24)).json()["choices"][0]["token_ids"]
            c.post("/reset")
            cancelled0 = _metric(c, "abbench_engine_requests_cancelled_total")
            got: dict[int, list[int]] = {}

            def send(i: int) -> None:
                with httpx.Client(base_url=server.url, timeout=120) as own:
                    if i in leaving:  # read two events of a long stream, then hang up
                        with own.stream("POST", "/v1/completions", json={**body(i, 500), "stream": True}) as r:
                            events = 0
                            for line in r.iter_lines():
                                events += line.startswith("data: {")
                                if events == 2:
                                    break
                        return
                    got[i] = own.post("/v1/completions", json=body(i, 24)).json()["choices"][0]["token_ids"]

            threads = [threading.Thread(target=send, args=(i,)) for i in range(6)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            assert got == alone
            deadline = time.monotonic() + 30
            while engine.scheduler.busy:  # the two that left stop at their next layer step
                assert time.monotonic() < deadline
                time.sleep(0.02)
            assert _metric(c, "abbench_engine_requests_cancelled_total") == cancelled0 + 2
            assert _metric(c, "abbench_engine_requests_running") == 0 and engine.scheduler.pool.free() == 4
            c.post("/reset")
            again = c.post("/v1/completions", json=body(0, 24)).json()["choices"][0]["token_ids"]
            assert again == alone[0]
    finally:
        server.stop()
