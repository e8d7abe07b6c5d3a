"""The start-up probe of every service's reset and metrics paths (abbench.runner.slot.probe_control_paths),
against loopback fakes of vLLM, SGLang and llama.cpp (tests/support/fake_engines.py) launched or attached by
the real runner: a server that refuses the reset the run needs stops the run before any request to it, with
the engine's remedy; a missing metrics page is a warning; a healthy server passes and is recorded."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from abbench import analysis, runner, services
from abbench.errors import ConfigError
from abbench.profile import profile_from_dict
from abbench.results import RunRecord
from abbench.runner.run import ProgressEvent

from tests.support import fake_engines

FAKE_ENGINES = Path(fake_engines.__file__).resolve()


def _profile(adapter: str, *, flags: list[str] | None = None, env: dict[str, str] | None = None,
             base_url: str | None = None, run: dict | None = None) -> dict:
    engine: dict = {"adapter": adapter, "health_timeout_s": 30, "env": env or {}}
    if base_url:
        engine["base_url"] = base_url
    else:
        engine["command"] = [sys.executable, str(FAKE_ENGINES), "--engine", adapter, "--port", "{port}",
                             *(flags or [])]
    return {"name": f"probe-{adapter}", "tokenizer": {"source": "qwen3"},
            "prompts": {"lengths": [48], "pairs": [{"cold": 48, "extend": 8}], "warmup": 0},
            "request": {"max_tokens": 4, "logprobs": 2, "timeout_s": 30},
            "engine": engine, "arms": [{"name": "a"}], "run": {"rounds": 1, **(run or {})}}


def _run(data: dict, out: Path) -> tuple[RunRecord | None, list[ProgressEvent], Exception | None]:
    events: list[ProgressEvent] = []
    try:
        record = runner.execute(profile_from_dict(data), out, observer=events.append)
        return record, events, None
    except ConfigError as e:
        return None, events, e


def _saved(out: Path) -> dict:
    return json.loads((out / "run.json").read_text())


def test_vllm_without_dev_mode_stops_before_any_request(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM serves POST /reset_prefix_cache only with VLLM_SERVER_DEV_MODE=1: without it the run stops at the
    service's start, before any request, the error naming the variable; nothing measured, so no run is kept
    (the service's log is) and no service is left running."""
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    out = tmp_path / "run"
    _, events, err = _run(_profile("vllm"), out)
    assert isinstance(err, ConfigError)
    assert "VLLM_SERVER_DEV_MODE=1" in str(err) and "HTTP 404" in str(err) and "reset_path = \"\"" in str(err)
    assert "Stopped before any request" in str(err)
    assert not (out / "run.json").exists() and [p.name for p in (out / "logs").iterdir()] == ["a_r1.log"]
    assert not [e for e in events if e.kind == "sample"] and services.live_services() == []


def test_vllm_in_dev_mode_passes_and_records_what_it_saw(tmp_path: Path) -> None:
    record, events, err = _run(_profile("vllm", env={"VLLM_SERVER_DEV_MODE": "1"}), tmp_path / "run")
    assert err is None and record is not None and record.status == "complete"
    control = record.services[0].control
    assert control["reset"] == {"path": "/reset_prefix_cache", "status": "ok"}
    assert control["metrics"] == {"path": "/metrics", "status": "ok"}
    assert "vllm:prefix_cache_hits_total" in control["counters"] and control["warnings"] == []
    assert not [e for e in events if e.kind == "warning"]
    assert _saved(tmp_path / "run")["services"][0]["control"] == control
    # the cold prompt's 48 tokens come from the prefix cache for its continuation, the response and /metrics agree
    checks = ["cached_tokens[a, continuation] == 48", "metrics_cached_tokens[a, continuation] == 48",
              "cached_tokens[a, cold] == 0", "metrics_cached_tokens[a, cold] == 0"]
    verdict = analysis.gate(record, checks=checks)
    assert verdict.passed, verdict.failures
    assert not analysis.gate(record, checks=["cached_tokens[a, continuation] >= 49"]).passed


def test_llamacpp_without_slot_save_path_stops_and_without_metrics_warns(tmp_path: Path) -> None:
    _, _, err = _run(_profile("llamacpp", flags=["-np", "1"]), tmp_path / "no-slots")
    assert isinstance(err, ConfigError) and "--slot-save-path" in str(err) and "HTTP 501" in str(err)
    assert not (tmp_path / "no-slots" / "run.json").exists()  # nothing measured
    record, events, err = _run(_profile("llamacpp", flags=["-np", "1", "--slot-save-path", str(tmp_path)]),
                               tmp_path / "no-metrics")
    assert err is None and record is not None and record.status == "complete"
    control = record.services[0].control
    assert control["reset"]["status"] == "ok" and control["metrics"]["status"] == 501
    warnings = [e.message for e in events if e.kind == "warning"]
    assert len(warnings) == 1 and "--metrics" in warnings[0] and warnings == control["warnings"]
    assert all(s.ok for s in record.samples)  # a missing metrics page costs the counters, not the samples


def test_sglang_busy_flush_stops_and_without_metrics_warns(tmp_path: Path) -> None:
    """SGLang answers 400 to /flush_cache while other requests run (an attached server someone else uses):
    the run stops with that reason. Without --enable-metrics it has no /metrics: a warning."""
    busy = fake_engines.FakeEngineConfig("sglang", sglang_flush_busy=True)
    with fake_engines.FakeEngine(busy) as eng:
        _, _, err = _run(_profile("sglang", base_url=eng.base_url), tmp_path / "busy")
        assert eng.stats()["completions"] == 0 and eng.stats()["resets"] == 0
    assert isinstance(err, ConfigError) and "HTTP 400" in str(err) and "requests are running" in str(err)
    record, events, err = _run(_profile("sglang"), tmp_path / "no-metrics")
    assert err is None and record is not None and record.status == "complete"
    assert record.services[0].control["reset"] == {"path": "/flush_cache", "status": "ok"}
    warnings = [e.message for e in events if e.kind == "warning"]
    assert len(warnings) == 1 and "--enable-metrics" in warnings[0] and "404" in warnings[0]


def test_no_reset_probe_when_the_run_never_resets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """reset_between_samples = false: the reset path is never used, so a server without it is fine."""
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    record, _, err = _run(_profile("vllm", run={"reset_between_samples": False}), tmp_path / "run")
    assert err is None and record is not None and record.status == "complete"
    assert "reset" not in record.services[0].control
