"""Layer traces of the vendored engine (``trace_layers``, abbench/engine/trace.py): they observe without
changing a bit, every prefill path traces the same states, a different float order shows up at a named layer
and sub-block, and the server gives them only behind ``--allow-request-overrides``."""

from __future__ import annotations

import httpx
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("fastapi")

from abbench.engine import Engine, EngineConfig  # noqa: E402
from abbench.engine.server import create_app  # noqa: E402
from abbench.engine.tokenizer import load_tokenizer  # noqa: E402
from abbench.engine.trace import BLOCKS, LayerTrace, entry  # noqa: E402

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


def test_another_chunk_size_differs_at_a_named_layer_and_block() -> None:
    # float32: CPU sgemm picks its blocking by the number of rows, so another chunk length sums in another
    # order. bf16 does not always: on a CPU without AVX-512 (an AMD EPYC, 2026-12-01) bf16 matmuls gave
    # bitwise-equal traces at chunk lengths 64 and 24.
    a, b = (Engine(EngineConfig(model="tiny", weights="random:0", chunk_tokens=c, dtype="float32"))
            .run(PROMPT, 1, trace_layers=True)[1].layer_trace for c in (64, 24))
    first = next(x for x, y in zip(a, b, strict=True) if x["hash"] != y["hash"])
    assert first["block"] in BLOCKS and 0 <= first["layer"] < 4
    assert a[0]["hash"] == b[0]["hash"]  # layer 0's attention at the last position sees the same inputs


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
