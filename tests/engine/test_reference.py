"""The transformers reference backend (``abbench serve --backend transformers``, abbench/engine/serve/reference.py).

One random tiny Qwen3-MoE checkpoint (``save_tiny_qwen3_moe``: transformers' ``Qwen3MoeForCausalLM``,
``save_pretrained``, no hub) is served by the reference and loaded by the vendored engine (``--weights DIR``):
in-process the two agree id for id with logprobs within float32 summation noise; over HTTP the reference
speaks the vendored server's API (token_ids, top_logprob_ids, SSE, usage, /reset, errors); and a whole
``cpu-tiny-reference`` run (both as services, each arm its own) passes the gate's parity over 8 ids.
"""

from __future__ import annotations

import inspect
import json
import random
import threading
import tomllib
from pathlib import Path

import httpx
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")

from abbench.engine import Engine, EngineConfig  # noqa: E402
from abbench.engine.contract import GenerateRequest  # noqa: E402
from abbench.engine.serve.reference import ReferenceEngine, save_tiny_qwen3_moe  # noqa: E402
from abbench.engine.contract import Cancelled, ContextOverflow  # noqa: E402
from abbench.engine.serve.server import create_app  # noqa: E402
from abbench.engine.serve.tokenizer import load_tokenizer  # noqa: E402

from tests.engine.test_engine_server import ServerThread, assert_openai_error, sse_events  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CHECKPOINT_IN_PROFILE = "tiny-qwen3-moe:0"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_qwen3_moe(tmp_path_factory.mktemp("tiny-qwen3-moe"))


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> ReferenceEngine:
    return ReferenceEngine(str(checkpoint))


@pytest.fixture(scope="module")
def engine(checkpoint: Path) -> Engine:
    """The vendored engine on the same checkpoint (chunks of 32; a test wanting others asks per request)."""
    return Engine(EngineConfig(model=str(checkpoint), weights=str(checkpoint), device="cpu", chunk_tokens=32))


def test_reference_matches_the_vendored_engine_in_process(engine: Engine, reference: ReferenceEngine) -> None:
    engine.reset()
    rng = random.Random(0)
    for n in (5, 70):  # one chunk; three chunks on the engine
        prompt = [rng.randrange(100, 150000) for _ in range(n)]
        ref_events, ref_stats = reference.run(prompt, 8, logprobs=3, ignore_eos=True)
        eng_events, _ = engine.run(prompt, 8, logprobs=3, ignore_eos=True)
        assert [e.token_id for e in ref_events] == [e.token_id for e in eng_events]
        for a, b in zip(ref_events, eng_events, strict=True):
            assert [i for i, _ in a.top_logprobs] == [i for i, _ in b.top_logprobs]
            # equal ids are a property, not a coin flip of the CPU's summation order: top-2 margins far above 1e-4
            assert a.top_logprobs[0][1] - a.top_logprobs[1][1] > 1e-3
            assert max(abs(x - y) for (_, x), (_, y) in zip(a.top_logprobs, b.top_logprobs)) < 1e-4
        assert (ref_stats.prefill_path, ref_stats.prompt_tokens, ref_stats.completion_tokens) == ("reference", n, 8)
        assert ref_stats.cached_prompt_tokens == 0 and ref_stats.h2d_bytes == 0 and ref_stats.finish_reason == "length"
    # with its KV cache, token by token = the model run on the whole sequence each step
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(8):
            ids.append(int(reference.model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert ids[len(prompt):] == [e.token_id for e in ref_events]


def test_reference_layer_trace_localizes_against_the_engine(engine: Engine, reference: ReferenceEngine) -> None:
    """The reference traces attention / experts / residual per layer from forward hooks; against the vendored
    engine in float32 (chunks of 16) the states differ by summation order only (relative RMS of the difference
    < 1e-5)."""
    from abbench.diagnostics.layertrace import compare_traces

    engine.reset()  # no prefix-cache hit from another test: the whole prompt is prefilled, in three chunks
    prompt = list(range(1000, 1040))
    ref = reference.run(prompt, 1, trace_layers=True)[1].layer_trace
    eng, stats = engine.run(prompt, 1, trace_layers=True, chunk_tokens=16)
    assert stats.n_chunks == 3 and stats.cached_prompt_tokens == 0
    eng = stats.layer_trace
    assert [(e["layer"], e["block"]) for e in ref] == [(i, b) for i in range(2) for b in ("attention", "experts",
                                                                                            "residual")]
    rows = [r for r in compare_traces(ref, eng) if r.diff_rms is not None]
    assert len(rows) == 6 and all(r.rel < 1e-5 for r in rows)
    assert reference.run(prompt, 1)[1].layer_trace is None and not reference.model._forward_hooks


def test_full_logprobs_are_the_distribution_both_backends_choose_from(engine: Engine,
                                                                        reference: ReferenceEngine) -> None:
    """``full_logprobs``: the first output position's log_softmax over the whole vocabulary (base64 float32). Its
    top entries are the top-k logprobs the same request returns, bit for bit; it sums to 1; the greedy id is its
    argmax; later positions and requests without the flag carry none. The two backends' rows are near each other
    (float32, different summation orders): the KL between them is tiny where a run's top-k bound could not say."""
    from abbench.diagnostics.numerics_probe import compare_rows, decode_row

    engine.reset()
    prompt = list(range(2000, 2030))
    rows = {}
    for name, backend in (("engine", engine), ("reference", reference)):
        events, stats = backend.run(prompt, 3, logprobs=5, full_logprobs=True)
        row = decode_row(stats.full_logprobs)
        assert row.size == 151936 and abs(float(np.logaddexp.reduce(row))) < 1e-5, name
        assert [(i, float(np.float32(row[i]))) for i, _ in events[0].top_logprobs] == events[0].top_logprobs, name
        assert int(np.argmax(row)) == events[0].token_id, name
        assert backend.run(prompt, 1)[1].full_logprobs is None, name
        rows[name] = row
    kl, bound, same, _ = compare_rows(rows["reference"], rows["engine"], 5)
    assert same == 1 and 0 <= bound <= kl + 1e-12 and kl < 1e-6


def test_reference_validates_and_cancels(reference: ReferenceEngine) -> None:
    for field, value in (("prefill_mode", "chunked"), ("chunk_tokens", 64), ("attention_batch", 1),
                         ("decode_misses", "host")):
        with pytest.raises(ValueError, match=f"no {field} "):
            reference.generate(GenerateRequest([1, 2], 4, **{field: value}))
    with pytest.raises(ContextOverflow):
        reference.generate(GenerateRequest([1] * 2040, 16))
    with pytest.raises(ValueError, match="vocab|token ids"):
        reference.generate(GenerateRequest([10**7], 4))
    cancel = threading.Event()
    gen = reference.generate(GenerateRequest([1, 2, 3], 8), cancel)
    next(gen)
    cancel.set()
    with pytest.raises(Cancelled):
        next(gen)
    assert reference.counters["requests_cancelled"] == 1
    reference.reset()  # nothing to flush; usable afterwards
    events, _ = reference.run([1, 2, 3], 2)
    assert len(events) == 2


def test_reference_serves_the_engine_api(reference: ReferenceEngine) -> None:
    tok = load_tokenizer("qwen3")
    server = ServerThread(create_app(reference, tok, served_model_name="tiny-ref"))
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            assert c.get("/health").status_code == 200
            assert c.post("/reset").json() == {"status": "ok"}
            body = {"prompt": "The river ran past the old mill", "max_tokens": 4, "temperature": 0,
                    "ignore_eos": True, "logprobs": 2}
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            full = r.json()
            choice = full["choices"][0]
            assert len(choice["token_ids"]) == 4 and choice["finish_reason"] == "length"
            assert [row[0][0] for row in choice["logprobs"]["top_logprob_ids"]] == choice["token_ids"]
            assert full["usage"]["prompt_tokens"] == len(tok.encode(body["prompt"]))
            assert full["abbench"]["prefill_path"] == "reference" and full["abbench"]["measured_h2d_gbps"] is None
            with c.stream("POST", "/v1/completions",
                          json={**body, "stream": True, "stream_options": {"include_usage": True}}) as s:
                events, done = sse_events(s)
            assert done
            streamed = [i for ev in events for ch in ev.get("choices", []) for i in ch.get("token_ids", [])]
            assert streamed == choice["token_ids"]
            assert events[-1]["usage"]["completion_tokens"] == 4 and "abbench" in events[-1]
            assert_openai_error(c.post("/v1/completions", json={**body, "prefill_mode": "chunked"}), 400,
                                "prefill_mode")
            assert_openai_error(c.post("/v1/completions", json={**body, "chunk_tokens": 64}), 400, "chunk_tokens")
            metrics = c.get("/metrics").text
            assert 'abbench_engine_requests_total{path="reference"}' in metrics  # the engine's metrics, its path
    finally:
        server.stop()


@pytest.mark.parametrize("backend", [Engine, ReferenceEngine])
def test_both_backends_take_the_whole_request_contract(backend: type) -> None:
    """``generate`` of each backend takes the typed request whole (plus ``cancel``), so the server hands either
    one any request and a new field reaches both without a signature to edit (abbench.engine.contract)."""
    params = inspect.signature(backend.generate).parameters
    assert list(params) == ["self", "request", "cancel"] and params["cancel"].default is None


def test_reference_refuses_what_it_has_no_use_for(reference: ReferenceEngine) -> None:
    """With per-request overrides allowed, the reference answers each engine-only field with a 400 naming
    it (a ValueError from the backend), never a 500."""
    server = ServerThread(create_app(reference, load_tokenizer("qwen3"), allow_request_overrides=True))
    body = {"prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0}
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            for field, value in (("prefill_mode", "chunked"), ("chunk_tokens", 64), ("attention_batch", 2)):
                r = c.post("/v1/completions", json={**body, field: value})
                assert r.status_code == 400 and field in r.json()["error"]["message"], (field, r.text)
            assert c.post("/v1/completions", json={**body, "trace_layers": True}).status_code == 200
    finally:
        server.stop()


def test_run_engine_against_the_reference_passes_parity(checkpoint: Path, tmp_path: Path) -> None:
    """profiles/cpu-tiny-reference.toml with its checkpoint path pointed at this test's checkpoint, one round (a
    second repeats the same prompts on services launched the same way): both arms launched as services from
    their own commands, the gate's parity over 8 ids holds for every prompt."""
    from abbench import analysis, runner
    from abbench.profile import profile_from_dict

    data = tomllib.loads((REPO / "profiles" / "cpu-tiny-reference.toml").read_text())
    for arm in data["arms"]:
        assert CHECKPOINT_IN_PROFILE in arm["command"]
        arm["command"] = [str(checkpoint) if a == CHECKPOINT_IN_PROFILE else a for a in arm["command"]]
    data["run"]["rounds"] = 1
    data["source_path"] = str(REPO / "profiles" / "cpu-tiny-reference.toml")
    profile = profile_from_dict(data)
    record = runner.execute(profile, tmp_path / "run")
    assert record.status == "complete", record.status_reason
    assert not [(s.arm, s.prompt_id, s.error) for s in record.samples if not s.ok]
    verdict = analysis.gate(record)
    assert verdict.passed, verdict.failures
    measured = [s for s in record.samples if not s.excluded]
    assert {s.engine["prefill_path"] for s in measured if s.arm == "transformers"} == {"reference"}
    by = {(s.arm, s.prompt_id, s.round): s.output_ids for s in measured}
    for (arm, prompt, rnd), ids in by.items():
        assert len(ids) == 8 and ids == by[("transformers", prompt, rnd)]
    assert len({s.prompt_id for s in measured}) == 2
    json.loads((tmp_path / "run" / "run.json").read_text())  # the record is valid JSON (no NaN from /metrics)


def test_tiny_checkpoint_spec_is_written_once_into_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``tiny-qwen3-moe:SEED`` resolves to a folder in abbench's cache, written on first use only (into a
    temporary folder renamed into place); any other value passes through."""
    from abbench.engine.serve import reference as ref

    calls: list[int] = []

    def fake_save(out_dir: Path, *, seed: int = 0, shape: str = "tiny-qwen3-moe") -> Path:
        calls.append(seed if shape == "tiny-qwen3-moe" else (shape, seed))
        (Path(out_dir) / "config.json").write_text("{}")
        return Path(out_dir)

    monkeypatch.setattr(ref, "save_tiny_qwen3_moe", fake_save)
    monkeypatch.setenv("ABBENCH_CACHE_DIR", str(tmp_path))
    first = ref.resolve_checkpoint("tiny-qwen3-moe:7")
    assert first == str(tmp_path / "tiny-qwen3-moe-7") and (tmp_path / "tiny-qwen3-moe-7" / "config.json").is_file()
    assert ref.resolve_checkpoint("tiny-qwen3-moe:7") == first and calls == [7]
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-qwen3-moe-7"]  # no temporary folder left behind
    hd64 = ref.resolve_checkpoint("tiny-qwen3-moe-hd64:7")  # the head_dim-64 shape, a folder of its own
    assert hd64 == str(tmp_path / "tiny-qwen3-moe-hd64-7") and calls == [7, ("tiny-qwen3-moe-hd64", 7)]
    assert ref.TINY_SHAPES["tiny-qwen3-moe-hd64"]["head_dim"] == 64
    assert ref.resolve_checkpoint("/some/dir") == "/some/dir"
    assert ref.resolve_checkpoint("tiny-qwen3-moe-big:7") == "tiny-qwen3-moe-big:7"  # not a named shape
    with pytest.raises(ValueError, match="integer seed"):
        ref.resolve_checkpoint("tiny-qwen3-moe:x")
