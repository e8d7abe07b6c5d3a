"""The vLLM, SGLang and llama.cpp adapters against loopback fakes of those servers (tests/support/fake_engines.py):
full requests through ``EngineClient.complete``, the cache resets, the metrics, the profile's default-path
rule, and a whole ``runner.execute`` run per engine launched as a service."""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from abbench.client import ADAPTERS, EngineClient, LlamaCppAdapter, SGLangAdapter, engine_counters, get_adapter
from abbench.errors import ConfigError, RequestError
from abbench.profile import ADAPTER_PATHS, EngineSpec, RequestSpec, profile_from_dict
from abbench.prometheus import metrics_delta, parse_prometheus

from tests.support import fake_engines

FAKE_ENGINES = Path(fake_engines.__file__).resolve()
PROMPT = ("The river ran past the old mill, where the miller's daughter counted sacks of grain by lamplight "
          "and wondered whether the bridge would hold another winter.")
ENGINES = ("vllm", "sglang", "llamacpp")
# Each case: (adapter, fake-engine config overrides)
CASES = {
    "vllm": ("vllm", {}),
    "sglang": ("sglang", {}),
    "sglang-incremental": ("sglang", {"sglang_incremental": True}),
    "llamacpp": ("llamacpp", {"llamacpp_close_after_stream_s": 0.02}),  # as llama-server closes after a stream
}
RESET = {"vllm": "/reset_prefix_cache", "sglang": "/flush_cache", "llamacpp": "/slots/0?action=erase"}


@pytest.fixture(scope="module", params=list(CASES))
def engine(request: pytest.FixtureRequest) -> Iterator[tuple[str, fake_engines.FakeEngine]]:
    adapter, overrides = CASES[request.param]
    with fake_engines.FakeEngine(fake_engines.FakeEngineConfig(adapter, **overrides)) as eng:
        yield adapter, eng


@pytest.fixture
def client() -> Iterator[EngineClient]:
    with EngineClient(connect_timeout_s=2.0) as c:
        yield c


def spec(**kw: object) -> RequestSpec:
    return RequestSpec(**{"max_tokens": 8, "logprobs": 2, "timeout_s": 10.0, **kw})


def expected(eng: fake_engines.FakeEngine, prompt_ids: list[int], n: int) -> tuple[list[int], str]:
    ids = fake_engines.output_ids(prompt_ids, n, eng.tokenizer.encode(fake_engines._SENTENCE))
    return ids, eng.tokenizer.decode(ids)


def test_llamacpp_stream_asks_to_close_its_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    """llama-server closes the connection after a streamed response, a moment later and without saying so,
    dropping a request sent on it meanwhile. The adapter asks for the close, so back-to-back streamed
    completions (and the reset between them) each go out on a connection that will answer; without that the
    second completion is dropped unanswered."""
    from abbench.adapters import LlamaCppAdapter

    cfg = fake_engines.FakeEngineConfig("llamacpp", llamacpp_close_after_stream_s=0.3)
    with fake_engines.FakeEngine(cfg) as eng, EngineClient(connect_timeout_s=2.0) as c:
        n = len(eng.tokenizer.encode(PROMPT))
        for _ in range(3):
            got = c.complete(eng.base_url, PROMPT, request=spec(), extra={}, target_prompt_tokens=n,
                             adapter="llamacpp")
            assert got.saw_done and len(got.output_ids) == 8
            c.reset(eng.base_url, RESET["llamacpp"])
        monkeypatch.setattr(LlamaCppAdapter, "closes_after_stream", False)
        c.complete(eng.base_url, PROMPT, request=spec(), extra={}, target_prompt_tokens=n, adapter="llamacpp")
        with pytest.raises(RequestError) as e:  # sent on the connection the server is about to close
            c.complete(eng.base_url, PROMPT, request=spec(), extra={}, target_prompt_tokens=n, adapter="llamacpp")
        assert e.value.kind == "connect" and "without sending a response" in str(e.value)


# ------------------------------------------------------------------------------------------ round trips


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "body"])
def test_round_trip(engine: tuple[str, fake_engines.FakeEngine], client: EngineClient, stream: bool) -> None:
    adapter, eng = engine
    prompt_ids = eng.tokenizer.encode(PROMPT)
    c = client.complete(eng.base_url, PROMPT, request=spec(stream=stream), extra={},
                        target_prompt_tokens=len(prompt_ids), adapter=adapter)
    ids, text = expected(eng, prompt_ids, 8)
    assert c.output_ids == ids and c.ids_source == "native"
    assert c.text == text  # SGLang's cumulative text is kept once, not concatenated
    assert c.finish_reason == "length" and c.prompt_tokens == len(prompt_ids) and c.completion_tokens == 8
    assert c.saw_done is stream
    assert (c.ttft_s is not None) is stream and c.total_s > 0
    # logprobs: (id, logprob) best first, the chosen (greedy) id on top
    assert c.logprobs is not None and len(c.logprobs) == 8
    for i, top in zip(ids, c.logprobs):
        assert top[0] == (i, pytest.approx(fake_engines.logprob_of(i)))
        assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True) and len(top) >= 2
    assert c.engine is not None and c.engine["engine_prompt_tokens"] == len(prompt_ids)
    assert isinstance(c.engine["cached_prompt_tokens"], int)


def test_token_id_prompt(engine: tuple[str, fake_engines.FakeEngine], client: EngineClient) -> None:
    """An id prompt (the probe's forced continuation) goes as ids: same output as the text prompt."""
    adapter, eng = engine
    prompt_ids = eng.tokenizer.encode(PROMPT) + [1393, 2613]
    c = client.complete(eng.base_url, prompt_ids, request=spec(max_tokens=3), extra={},
                        target_prompt_tokens=len(prompt_ids), adapter=adapter)
    assert c.output_ids == expected(eng, prompt_ids, 3)[0]


def test_usage_is_checked(engine: tuple[str, fake_engines.FakeEngine], client: EngineClient) -> None:
    adapter, eng = engine
    n = len(eng.tokenizer.encode(PROMPT))
    with pytest.raises(RequestError) as e:
        client.complete(eng.base_url, PROMPT, request=spec(), extra={}, target_prompt_tokens=n + 1, adapter=adapter)
    assert e.value.kind == "usage" and f"usage.prompt_tokens={n}" in e.value.detail


def test_ttft_waits_for_text_not_for_ids(engine: tuple[str, fake_engines.FakeEngine], client: EngineClient) -> None:
    """The first token arrives with empty text (an incomplete character, or SGLang's cumulative text still
    empty); time to first token is the event that brings text."""
    adapter, eng = engine
    prompt_ids = eng.tokenizer.encode(PROMPT)
    c = client.complete(eng.base_url, PROMPT, request=spec(), extra={"fake_hold_first_text_s": 0.3},
                        target_prompt_tokens=len(prompt_ids), adapter=adapter)
    assert c.ttft_s is not None and c.ttft_s >= 0.3
    assert c.output_ids == expected(eng, prompt_ids, 8)[0] and c.text == expected(eng, prompt_ids, 8)[1]


def test_reset_and_prefix_cache(engine: tuple[str, fake_engines.FakeEngine], client: EngineClient) -> None:
    adapter, eng = engine
    n = len(eng.tokenizer.encode(PROMPT))
    resets = eng.stats()["resets"]
    client.reset(eng.base_url, get_adapter(adapter).reset_path)
    assert eng.stats()["resets"] == resets + 1

    def cached() -> int:
        c = client.complete(eng.base_url, PROMPT, request=spec(max_tokens=2), extra={}, target_prompt_tokens=n,
                            adapter=adapter)
        return c.engine["cached_prompt_tokens"]

    assert cached() == 0  # cold after the reset
    assert cached() == n - 1  # the same prompt again: all but its last token from the cache
    client.reset(eng.base_url, get_adapter(adapter).reset_path)
    assert cached() == 0


def test_metrics_map_to_common_counters(engine: tuple[str, fake_engines.FakeEngine], client: EngineClient) -> None:
    adapter, eng = engine
    n = len(eng.tokenizer.encode(PROMPT))
    path = get_adapter(adapter).metrics_path
    before = parse_prometheus(client.metrics_text(eng.base_url, path) or "")
    client.reset(eng.base_url, get_adapter(adapter).reset_path)
    client.complete(eng.base_url, PROMPT, request=spec(max_tokens=2), extra={}, target_prompt_tokens=n, adapter=adapter)
    client.complete(eng.base_url, PROMPT, request=spec(max_tokens=2), extra={}, target_prompt_tokens=n, adapter=adapter)
    after = parse_prometheus(client.metrics_text(eng.base_url, path) or "")
    delta = engine_counters(adapter, metrics_delta(before, after))
    if adapter == "llamacpp":  # llama.cpp counts prompt tokens it processed: the second request hit the cache
        assert delta == {"prompt_tokens": n + 1}
    else:
        assert delta["prompt_tokens"] == 2 * n and delta["cached_prompt_tokens"] == n - 1


# --------------------------------------------------------------------------------- wire-format details


def test_default_paths_and_registry() -> None:
    assert set(ADAPTERS) == {"openai", "vllm", "sglang", "llamacpp"}
    for name, paths in ADAPTER_PATHS.items():
        ad = get_adapter(name)
        assert (ad.reset_path, ad.metrics_path) == (paths["reset_path"], paths["metrics_path"])
    assert get_adapter("llamacpp").done_marker is None and get_adapter("sglang").done_marker == "[DONE]"


def test_engine_spec_fills_adapter_defaults() -> None:
    assert EngineSpec(adapter="sglang").reset_path == "/flush_cache"
    assert EngineSpec(adapter="llamacpp").reset_path == "/slots/0?action=erase"
    assert EngineSpec().reset_path == "/reset" and EngineSpec().metrics_path == "/metrics"
    assert EngineSpec(adapter="vllm", reset_path="/my_reset").reset_path == "/my_reset"  # the profile wins
    off = EngineSpec(adapter="vllm", reset_path="", metrics_path="")  # "": the engine has none
    assert off.reset_path == "" and off.metrics_path == ""
    # the recorded profile says the path used, and reads back the same
    assert EngineSpec.model_validate(off.model_dump()).reset_path == ""
    assert EngineSpec.model_validate(EngineSpec(adapter="vllm").model_dump()).reset_path == "/reset_prefix_cache"


def test_sglang_body() -> None:
    ad = SGLangAdapter()
    body = ad.build_body("hi", request=spec(extra={"sampling_params": {"top_k": 1}}),
                         extra={"sampling_params": {"ignore_eos": False}, "rid": "x"}, model="m")
    assert body == {"text": "hi", "stream": True, "return_logprob": True, "top_logprobs_num": 2, "rid": "x",
                    "sampling_params": {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": False, "top_k": 1}}
    assert ad.ignore_eos_sent(body) is False  # the arm's override is what is judged
    assert "input_ids" in ad.build_body([1, 2], request=spec(logprobs=None), extra={}, model=None)
    with pytest.raises(ConfigError):
        ad.build_body("hi", request=spec(), extra={"text": "other"}, model=None)


def test_llamacpp_body() -> None:
    body = LlamaCppAdapter().build_body("hi", request=spec(logprobs=0), extra={"cache_prompt": False}, model=None)
    assert body == {"prompt": "hi", "n_predict": 8, "temperature": 0.0, "ignore_eos": True, "stream": True,
                    "return_tokens": True, "n_probs": 1, "cache_prompt": False}
    with pytest.raises(ConfigError):
        LlamaCppAdapter().build_body("hi", request=spec(), extra={"stream": False}, model=None)


def test_sglang_abort_is_an_error(client: EngineClient) -> None:
    with fake_engines.FakeEngine(fake_engines.FakeEngineConfig("sglang")) as eng:
        n = len(eng.tokenizer.encode(PROMPT))
        with pytest.raises(RequestError) as e:
            client.complete(eng.base_url, PROMPT, request=spec(), extra={"fake_mode": "abort"},
                            target_prompt_tokens=n, adapter="sglang")
    assert e.value.kind == "http" and e.value.status == 503 and "aborted" in e.value.detail


@pytest.fixture(scope="module")
def llamacpp() -> Iterator[fake_engines.FakeEngine]:
    with fake_engines.FakeEngine(fake_engines.FakeEngineConfig("llamacpp")) as eng:
        yield eng


@pytest.mark.parametrize(("mode", "kind", "words"), [
    ("no-final", "no-done", "without its final event"),
    ("after-final", "sse", "data after the final event"),
])
def test_llamacpp_stream_end(llamacpp: fake_engines.FakeEngine, client: EngineClient, mode: str, kind: str,
                             words: str) -> None:
    n = len(llamacpp.tokenizer.encode(PROMPT))
    with pytest.raises(RequestError) as e:
        client.complete(llamacpp.base_url, PROMPT, request=spec(), extra={"fake_mode": mode}, target_prompt_tokens=n,
                        adapter="llamacpp")
    assert e.value.kind == kind and words in e.value.detail


def test_llamacpp_stream_without_mid_character_ids_is_completed_by_a_refetch(
        llamacpp: fake_engines.FakeEngine, client: EngineClient) -> None:
    """llama.cpp's stream sends no id for a token whose text ends inside a UTF-8 character (the fake does as
    the real server: `fake_mid_char`). The client asks once more, not streamed, and keeps the stream's TTFT
    with the repeat's ids, which must contain every streamed id in order; the logprobs cannot be placed."""
    prompt_ids = llamacpp.tokenizer.encode(PROMPT)
    ids, text = expected(llamacpp, prompt_ids, 8)
    before = llamacpp.stats()["completions"]
    c = client.complete(llamacpp.base_url, PROMPT, request=spec(), extra={"fake_mid_char": [2, 5]},
                        target_prompt_tokens=len(prompt_ids), adapter="llamacpp")
    assert c.output_ids == ids and c.ids_source == "native" and c.text == text and c.completion_tokens == 8
    assert c.ttft_s is not None and c.saw_done and c.logprobs is None
    assert c.engine["ids_refetched"] == {"streamed_ids": 6, "ids": 8, "why": c.engine["ids_refetched"]["why"]}
    assert llamacpp.stats()["completions"] == before + 2  # the stream and its repeat
    # without the need, one request and the logprobs
    c = client.complete(llamacpp.base_url, PROMPT, request=spec(), extra={}, target_prompt_tokens=len(prompt_ids),
                        adapter="llamacpp")
    assert c.output_ids == ids and c.logprobs is not None and "ids_refetched" not in (c.engine or {})


def test_llamacpp_output_ending_inside_a_character_is_completed_by_the_refetch(
        llamacpp: fake_engines.FakeEngine, client: EngineClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """The last token ends inside a UTF-8 character: the stream never carries it, the body's text ends with
    U+FFFD for the incomplete bytes (as the real server, 0c1e570, at 6 of 200 two-token outputs of the tiny
    preset). The refetch completes the ids and keeps the stream's text; a tail without that mark, or one
    where the stream carried the last id, is still a protocol error."""
    prompt_ids = llamacpp.tokenizer.encode(PROMPT)
    ids, text = expected(llamacpp, prompt_ids, 8)
    c = client.complete(llamacpp.base_url, PROMPT, request=spec(), extra={"fake_mid_char": [7]},
                        target_prompt_tokens=len(prompt_ids), adapter="llamacpp")
    last = llamacpp.tokenizer.decode(ids[7:])
    assert c.output_ids == ids and c.completion_tokens == 8 and c.text == text[:len(text) - len(last)]
    assert c.engine["ids_refetched"]["streamed_ids"] == 7
    real = EngineClient.complete

    def unmarked(self, *a, **kw):  # the repeat's tail lacks the replacement character: not that case
        got = real(self, *a, **kw)
        return got if kw["request"].stream else dataclasses.replace(got, text=got.text[:-1] + "x")

    monkeypatch.setattr(EngineClient, "complete", unmarked)
    with pytest.raises(RequestError) as e:
        client.complete(llamacpp.base_url, PROMPT, request=spec(), extra={"fake_mid_char": [7]},
                        target_prompt_tokens=len(prompt_ids), adapter="llamacpp")
    assert e.value.kind == "protocol" and "same text: False" in e.value.detail


def test_a_short_stream_is_not_refetched_from_other_engines_or_against_a_changed_answer(
        llamacpp: fake_engines.FakeEngine, client: EngineClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only an adapter that declares it refetches; a repeat that disagrees with the stream is a protocol error."""
    prompt_ids = llamacpp.tokenizer.encode(PROMPT)
    monkeypatch.setattr(LlamaCppAdapter, "refetch_short_stream_ids", False)
    with pytest.raises(RequestError) as e:
        client.complete(llamacpp.base_url, PROMPT, request=spec(), extra={"fake_mid_char": [3]},
                        target_prompt_tokens=len(prompt_ids), adapter="llamacpp")
    assert e.value.kind == "protocol" and "carried 7 token ids" in e.value.detail
    monkeypatch.setattr(LlamaCppAdapter, "refetch_short_stream_ids", True)
    real = EngineClient.complete

    def changed(self, *a, **kw):  # the repeat (not streamed) diverges from position 1 on
        if not kw["request"].stream:
            kw["extra"] = {**kw["extra"], "fake_diverge_at": 1}
        return real(self, *a, **kw)

    monkeypatch.setattr(EngineClient, "complete", changed)
    with pytest.raises(RequestError) as e:
        client.complete(llamacpp.base_url, PROMPT, request=spec(), extra={"fake_mid_char": [3]},
                        target_prompt_tokens=len(prompt_ids), adapter="llamacpp")
    assert e.value.kind == "protocol" and "a non-streamed repeat did not reproduce the stream" in e.value.detail


def test_llamacpp_older_and_probability_fields(llamacpp: fake_engines.FakeEngine, client: EngineClient) -> None:
    n = len(llamacpp.tokenizer.encode(PROMPT))
    c = client.complete(llamacpp.base_url, PROMPT, request=spec(), target_prompt_tokens=n, adapter="llamacpp",
                        extra={"fake_mode": "old-stop-fields", "post_sampling_probs": True})
    assert c.finish_reason == "length"
    i = c.output_ids[0]
    assert c.logprobs[0][0] == (i, pytest.approx(fake_engines.logprob_of(i)))


def test_llamacpp_slot_actions_need_slot_save_path(client: EngineClient) -> None:
    cfg = fake_engines.FakeEngineConfig("llamacpp", llamacpp_slot_save_path=None, llamacpp_metrics=False)
    with fake_engines.FakeEngine(cfg) as eng:
        with pytest.raises(RequestError) as e:
            client.reset(eng.base_url, get_adapter("llamacpp").reset_path)
        assert e.value.status == 501 and "--slot-save-path" in str(e.value)
        with pytest.raises(RequestError) as e:
            client.metrics_text(eng.base_url, "/metrics")
        assert "--metrics" in str(e.value)


# ----------------------------------------------------------------------------------- the runner, per engine


def tiny_profile(adapter: str) -> dict:
    command = [sys.executable, str(FAKE_ENGINES), "--engine", adapter, "--port", "{port}"]
    env: dict[str, str] = {}
    if adapter == "vllm":
        env["VLLM_SERVER_DEV_MODE"] = "1"
    elif adapter == "sglang":
        command += ["--enable-metrics"]
    else:
        command += ["--slot-save-path", "/tmp", "-np", "1", "--metrics"]
    return {
        "name": f"fake-{adapter}",
        "tokenizer": {"source": "qwen3"},
        "prompts": {"lengths": [96], "pairs": [{"cold": 64, "extend": 16}], "warmup": 1, "warmup_tokens": 16},
        "request": {"max_tokens": 8, "logprobs": 2, "timeout_s": 30},
        "engine": {"adapter": adapter, "command": command, "env": env, "health_timeout_s": 30},
        "arms": [{"name": "a"}, {"name": "b", "args": ["--token-delay", "0.001"]}],
        "run": {"rounds": 2},
    }


@pytest.mark.parametrize("adapter", ENGINES)
def test_runner_against_engine_service(adapter: str, tmp_path: Path) -> None:
    from abbench import analysis, runner
    from abbench.report import write_report

    profile = profile_from_dict(tiny_profile(adapter))
    assert profile.engine.reset_path == ADAPTER_PATHS[adapter]["reset_path"]  # omitted: the adapter's default
    record = runner.execute(profile, tmp_path / "run")
    assert record.status == "complete", record.status_reason
    failed = [(s.prompt_id, s.error) for s in record.samples if not s.ok]
    assert not failed
    measured = [s for s in record.samples if not s.excluded]
    assert measured and all(s.ids_source == "native" and len(s.output_ids) == 8 for s in measured)
    # resets before every cold sample (fresh and cold prompts start empty), none before a continuation
    for s in measured:
        cached = s.engine["cached_prompt_tokens"]
        assert cached == (64 if s.kind == "continuation" else 0), (s.prompt_id, cached)
        assert s.telemetry.metrics_after is not None
    verdict = analysis.gate(record)
    assert verdict.passed, verdict.failures
    assert json.loads((tmp_path / "run" / "run.json").read_text())["profile"]["engine"]["reset_path"] == RESET[adapter]
    md = write_report(record, [], tmp_path / "r.md", tmp_path / "r", draw_plots=False).read_text()  # the text alone
    assert "## Engine counters" in md


# ------------------------------------------------------------------------------------- per-arm engines


def _fake_arm(name: str, adapter: str) -> dict:
    arm = tiny_profile(adapter)
    return {"name": name, "adapter": adapter, "command": arm["engine"]["command"], "env": arm["engine"]["env"]}


def test_arms_on_different_engines_in_one_run(tmp_path: Path) -> None:
    """Arm A on the fake vLLM, arm B on the fake llama.cpp, arm C on the fake SGLang, under one plan: each arm
    is spoken to in its own wire format, reset at its own path and scraped with its own counters."""
    from abbench import analysis, runner
    from abbench.report import write_report

    data = tiny_profile("vllm")
    data["engine"] = {"health_timeout_s": 30}  # no engine-wide command: each arm brings its own
    order = ("vllm", "llamacpp", "sglang")
    data["arms"] = [_fake_arm(f"on-{e}", e) for e in order]
    profile = profile_from_dict(data)
    assert [profile.arm_engine(a.name).reset_path for a in profile.arms] == [RESET[e] for e in order]
    assert profile.arm_engine("on-llamacpp").adapter == "llamacpp"
    record = runner.execute(profile, tmp_path / "run")
    assert record.status == "complete", record.status_reason
    assert not [(s.arm, s.prompt_id, s.error) for s in record.samples if not s.ok]
    measured = [s for s in record.samples if not s.excluded]
    assert {s.arm for s in measured} == {"on-vllm", "on-llamacpp", "on-sglang"}
    for s in measured:
        assert s.ids_source == "native" and len(s.output_ids) == 8
        assert s.engine["cached_prompt_tokens"] == (64 if s.kind == "continuation" else 0), (s.arm, s.prompt_id)
        assert s.telemetry.metrics_after is not None
    verdict = analysis.gate(record)  # the fakes share one "model": the engines agree token for token
    assert verdict.passed, verdict.failures
    counters = analysis.transfer.engine_counter_table(record)
    assert set(counters["arm"]) == {"on-vllm", "on-llamacpp", "on-sglang"}
    assert counters["metrics_prompt"].notna().all()  # each arm's /metrics read with its own engine's names
    arms = json.loads((tmp_path / "run" / "run.json").read_text())["profile"]["arms"]
    assert [a["reset_path"] for a in arms] == [RESET[e] for e in order]  # the paths used are recorded
    md = write_report(record, [], tmp_path / "r.md", tmp_path / "r", draw_plots=False).read_text()  # the text alone
    assert "on-vllm `vllm`" in md and "on-llamacpp `llamacpp`" in md


def test_arm_engine_defaults_and_shared_service_agreement() -> None:
    base = {"name": "x", "engine": {"adapter": "vllm", "command": ["e", "--port", "{port}"], "reset_path": "/r",
                                    "model": "m"}}
    p = profile_from_dict({**base, "arms": [{"name": "a"}, {"name": "b", "adapter": "sglang", "model": "n"},
                                            {"name": "c", "reset_path": "", "health_path": "/ok"}]})
    assert p.arm_engine("a") == p.arm_engine(None)
    assert (p.arm_engine("a").adapter, p.arm_engine("a").reset_path, p.arm_engine("a").model) == ("vllm", "/r", "m")
    b = p.arm_engine("b")
    assert (b.adapter, b.reset_path, b.metrics_path, b.model) == ("sglang", "/flush_cache", "/metrics", "n")
    c = p.arm_engine("c")
    assert (c.adapter, c.reset_path, c.health_path) == ("vllm", "", "/ok")
    shared = {**base, "engine": {**base["engine"], "shared_service": True}}
    with pytest.raises(ConfigError, match="talk to it differently"):
        profile_from_dict({**shared, "arms": [{"name": "a"}, {"name": "b", "adapter": "sglang"}]})
    ok = profile_from_dict({**shared, "arms": [{"name": "a"}, {"name": "b", "adapter": "sglang", "service": "s2"}]})
    assert ok.arm_engine("b").adapter == "sglang"
