"""The layer probe (``abbench probe --layers``): trace comparison on constructed traces, its renderings, and a
real probe of two vendored-engine arms whose float order differs (bf16, two chunk sizes) against one whose
does not (layer-major with the reference's chunks)."""

from __future__ import annotations

import base64
import contextlib
import sys
from pathlib import Path

import numpy as np
import pytest

from abbench.diagnostics.layertrace import LayerProbe, compare_traces, format_layers, layers_markdown


def _e(layer: int, block: str, values: list[float] | None, h: str | None = None) -> dict:
    if values is None:
        return {"layer": layer, "block": block, "hash": h or "ids", "rms": None, "values": None}
    v = np.asarray(values, dtype="<f4")
    return {"layer": layer, "block": block, "hash": h or v.tobytes().hex()[:16], "rms": float(np.sqrt((v ** 2).mean())),
            "values": base64.b64encode(v.tobytes()).decode()}


def test_compare_traces_names_the_first_differing_block_and_the_growth() -> None:
    ref = [_e(0, "attention", [1, 1]), _e(0, "router", None), _e(0, "residual", [2, 2]),
           _e(1, "attention", [1, 2]), _e(1, "experts", [3, 4]), _e(1, "residual", [4, 4])]
    arm = [_e(1, "residual", [4, 4.5]), _e(0, "attention", [1, 1]), _e(0, "router", None),  # any order
           _e(0, "residual", [2, 2]), _e(1, "attention", [1, 2]), _e(1, "experts", [3, 4.1])]
    rows = compare_traces(ref, arm)
    assert [(r.layer, r.block) for r in rows] == [(0, "attention"), (0, "router"), (0, "residual"),
                                                   (1, "attention"), (1, "experts"), (1, "residual")]
    p = LayerProbe(prompt_id="p", arm="b", reference="a", position=0, n_tokens=10, rows=rows, ref_choice=5,
                   arm_choice=6, ref_top=[(5, -0.1), (6, -0.2)], arm_top=[(6, -0.1), (5, -0.15)])
    first = p.first_difference
    assert (first.layer, first.block) == (1, "experts")
    assert first.diff_rms == pytest.approx(np.sqrt(0.01 / 2), rel=1e-5)
    assert rows[-1].diff_rms == pytest.approx(np.sqrt(0.25 / 2), rel=1e-5) and rows[1].same is True
    text = format_layers(p)
    assert "first difference: layer 1, experts" in text and ">>" in text and "different tokens" in text
    md = layers_markdown(p, plot="x.png", command="abbench probe r --layers")
    assert "| >> | 1 | experts | differs |" in md and "![RMS of the difference per layer](x.png)" in md
    same = LayerProbe(prompt_id="p", arm="b", reference="a", position=3, n_tokens=13, rows=compare_traces(ref, ref))
    assert same.first_difference is None and "bitwise equal (6 of 6)" in format_layers(same)
    assert compare_traces(ref, arm[:2])[2].same is None  # a block only one side traced


@pytest.mark.slow
def test_probe_layers_on_real_engine_services(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    from abbench import runner, services
    from abbench.client import EngineClient
    from abbench.diagnostics.layers import probe_layers, serving
    from abbench.profile import profile_from_dict

    pytest.importorskip("torch")
    command = [sys.executable, "-m", "abbench.engine", "--model", "tiny", "--weights", "random:0", "--device", "cpu",
               "--dtype", "float32", "--port", "{port}"]  # float32: see test_layer_trace's chunk-size test
    data = {
        "name": "layers", "tokenizer": {"source": "qwen3"},
        "prompts": {"lengths": [200], "warmup": 0},
        "request": {"max_tokens": 2, "logprobs": 2, "timeout_s": 60},
        "engine": {"command": command, "health_timeout_s": 60},
        "arms": [{"name": "c64", "args": ["--chunk-tokens", "64"]},
                 {"name": "c24", "args": ["--chunk-tokens", "24"]},
                 {"name": "bf16", "args": ["--chunk-tokens", "64", "--dtype", "bfloat16"]},
                 {"name": "lm64", "args": ["--chunk-tokens", "64", "--prefill-mode", "layer-major"]}],
        "run": {"rounds": 1},
    }
    profile = profile_from_dict(data)
    # each arm's server is launched once, from the profile (``serving``: its command plus the overrides flag the
    # trace needs), and serves both the run (the arms attach to it by base_url) and the probes (each resets its
    # prefix cache before it traces); the run's teardown stops what it launched (here nothing), not these
    with EngineClient() as client, contextlib.ExitStack() as stack:
        urls = {a["name"]: stack.enter_context(serving(profile, a["name"], client)) for a in data["arms"]}
        ours = {id(s) for s in services.live_services()}
        assert len(ours) == 4
        monkeypatch.setattr(importlib.import_module("abbench.runner.run"), "stop_all",
                            lambda: [s.stop() or s.key for s in reversed(services.live_services()) if id(s) not in ours])
        attached = {**data, "arms": [{**a, "base_url": urls[a["name"]]} for a in data["arms"]]}
        record = runner.execute(profile_from_dict(attached), tmp_path / "run")
        assert record.status == "complete", record.status_reason
        assert not [s.error for s in record.samples if not s.ok] and len(services.live_services()) == 4
        prompt = next(p.id for p in record.prompts if p.kind == "fresh")
        # another dtype differs on every CPU, from layer 0's attention on
        other = probe_layers(record, prompt, "bf16", base_urls=urls)
        first = other.first_difference
        assert first is not None and (first.layer, first.block) == (0, "attention") and first.diff_rms > 0
        # another chunk length sums in another order only where the CPU's GEMM blocking depends on the number of
        # rows (float32 on an Intel Xeon and an AMD EPYC did): where it differs, the first difference is named
        other = probe_layers(record, prompt, "c24", base_urls=urls)
        first = other.first_difference
        if first is not None:
            assert first.diff_rms > 0 and first.block in ("attention", "experts", "residual")
            assert all(r.same for r in other.rows[:other.rows.index(first)])
        same = probe_layers(record, prompt, "lm64", position=1, base_urls=urls)  # layer-major, same chunks: bitwise
        assert same.first_difference is None and same.n_tokens == 201 and same.notes
    from abbench.errors import ConfigError

    with pytest.raises(ConfigError, match="reference arm"):
        probe_layers(record, prompt, "c64")
