"""Layer traces of the vendored engine (``trace_layers``, abbench/engine/ops/trace.py): they observe without
changing a bit, every prefill path traces the same states, a change shows up at the layer and sub-block where it
enters, one configuration traces the same bits every time, and the server gives them only behind
``--allow-request-overrides``."""

from __future__ import annotations

import httpx
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("fastapi")

from abbench.engine import Engine, EngineConfig  # noqa: E402
from abbench.engine.serve.server import create_app  # noqa: E402
from abbench.engine.serve.tokenizer import load_tokenizer  # noqa: E402
from abbench.engine.ops.trace import BLOCKS, LayerTrace, entry  # noqa: E402
from abbench.diagnostics.layertrace import compare_traces  # noqa: E402

from tests.engine.test_engine_server import ServerThread, assert_openai_error  # noqa: E402

PROMPT = list(range(2000, 2100))


@pytest.fixture(scope="module")
def bf16() -> Engine:
    return Engine(EngineConfig(model="tiny", weights="random:0", chunk_tokens=32, dtype="bfloat16",
                               demand_max_tokens=32))


def _hashes(stats) -> dict[tuple[int, str], str]:
    return {(e["layer"], e["block"]): e["hash"] for e in stats.layer_trace}


def test_trace_observes_without_changing_anything_and_every_path_traces_the_same(bf16: Engine) -> None:
    plain, _ = bf16.run(PROMPT, 3, logprobs=2)
    traced = {}
    for mode in ("chunked", "layer-major", "demand"):
        events, stats = bf16.run(PROMPT, 3, logprobs=2, prefill_mode=mode, trace_layers=True)
        assert [(e.token_id, e.top_logprobs) for e in events] == [(e.token_id, e.top_logprobs) for e in plain]
        traced[mode] = _hashes(stats)
        n = bf16.model_config.num_hidden_layers
        assert [e["layer"] for e in stats.layer_trace] == [i for i in range(n) for _ in range(4)]
        assert [e["block"] for e in stats.layer_trace[:4]] == ["attention", "router", "experts", "residual"]
    assert traced["chunked"] == traced["layer-major"] == traced["demand"]
    assert bf16.model.trace is None
    assert bf16.run(PROMPT, 1)[1].layer_trace is None


def _trace(engine: Engine) -> list[dict]:
    return engine.run(PROMPT, 1, trace_layers=True)[1].layer_trace


def test_a_difference_is_found_and_named_where_it_enters() -> None:
    # A change at a known place (layer 2's attention output projection, scaled by 1 + 2**-4) must be found there
    # and nowhere earlier: the same shapes on the same machine sum in the same order, so every state before it
    # is bitwise equal on any CPU.
    cfg = EngineConfig(model="tiny", weights="random:0", chunk_tokens=32, dtype="float32")
    plain, changed = Engine(cfg), Engine(cfg)
    lw = changed.model.w.layers[2]
    lw.o_proj = lw.o_proj * (1 + 2**-4)
    ref, arm = _trace(plain), _trace(changed)
    rows = compare_traces(ref, arm)
    first = next(r for r in rows if r.same is False)
    assert (first.layer, first.block) == (2, "attention")
    assert all(r.same for r in rows[:rows.index(first)])
    assert first.diff_rms is not None and first.diff_rms > 0


def test_the_trace_is_deterministic_and_another_chunk_size_is_named_where_it_differs() -> None:
    # Whether another chunk length changes any bit depends on the CPU's GEMM blocking (float32 sgemm picks it by
    # the number of rows: on an Intel Xeon with AVX-512 layer 0's attention already differs at chunk lengths 64
    # and 24, on an AMD EPYC it did not), so only the properties are asserted: one configuration traces
    # bitwise-equal states run after run, and where two chunk lengths differ, the first difference is a named
    # layer and sub-block, every state before it equal.
    traces = {c: [_trace(Engine(EngineConfig(model="tiny", weights="random:0", chunk_tokens=c, dtype="float32")))
                  for _ in range(2)] for c in (64, 24)}
    for c, (one, two) in traces.items():
        assert [e["hash"] for e in one] == [e["hash"] for e in two], f"chunk length {c} traced differently twice"
    rows = compare_traces(traces[64][0], traces[24][0])
    assert [(r.layer, r.block) for r in rows] == [(e["layer"], e["block"]) for e in traces[64][0]]
    first = next((r for r in rows if r.same is False), None)
    if first is not None:
        assert first.block in BLOCKS and 0 <= first.layer < 4
        assert all(r.same for r in rows[:rows.index(first)])


def test_entry_hashes_the_raw_dtype_and_keeps_float32_values() -> None:
    t = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.bfloat16)
    tr = LayerTrace()
    tr(0, "residual", t)
    (e,) = tr.export()
    assert e["rms"] == pytest.approx((12.5) ** 0.5) and e["values"]
    assert entry(0, "x", t[-1].float())["hash"] != e["hash"]  # same values, another dtype
    assert entry(0, "router", torch.tensor([3, 1]))["rms"] is None


def test_server_gives_the_trace_only_behind_the_overrides_flag(bf16: Engine) -> None:
    tok = load_tokenizer("qwen3")
    body = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0, "trace_layers": True}
    for allow in (False, True):
        server = ServerThread(create_app(bf16, tok, allow_request_overrides=allow))
        try:
            r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
        finally:
            server.stop()
        if not allow:
            assert_openai_error(r, 400, "trace_layers")
        else:
            trace = r.json()["abbench"]["layer_trace"]
            assert len(trace) == 16 and {e["block"] for e in trace} == {"attention", "router", "experts", "residual"}
