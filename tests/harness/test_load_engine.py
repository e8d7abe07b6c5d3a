"""Load levels against the vendored engine on its tiny model (a real server, real exact-length prompts): every
request verified as the sequential client verifies it, and, as the engine serves one request at a time, its
greedy ids at 4 in flight identical to each prompt run alone."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from abbench.analysis import load as al
from abbench.loadgen import Level, Target, build_load_prompts, run_level
from abbench.ports import free_port
from abbench.profile import LengthDist, LoadSpec, PromptsSpec, RequestSpec, profile_from_dict
from abbench.results import RunRecord
from abbench.tokenizers import load_tokenizer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine() -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "abbench.engine", "--model", "tiny", "--weights", "random:0",
                             "--device", "cpu", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        with httpx.Client(timeout=1, trust_env=False) as poll:  # one client for every poll, not one each
            while True:
                assert proc.poll() is None, "the engine exited"
                try:
                    if poll.get(url + "/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, "the engine did not become healthy"
                time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        proc.wait(15)


def test_load_levels_against_the_vendored_engine(engine: str) -> None:
    load = LoadSpec(concurrency=[4], rate=[20], requests=8, prompt_tokens=LengthDist(values=[24, 40]), seed=1)
    prompts = build_load_prompts(load_tokenizer("qwen3"), PromptsSpec(), load, 6)
    target = Target(engine, RequestSpec(max_tokens=6), arm="engine", metrics_path="/metrics")
    levels = [run_level(Level.from_spec(load, "concurrency", 1, role="reference"), target, prompts)]
    levels += [run_level(Level.from_spec(load, kind, v), target, prompts) for kind, v in load.levels()]
    for lv in levels:
        assert all(r.ok for r in lv.requests), [r.error for r in lv.requests if not r.ok]
        assert all(r.prompt_tokens == r.target_tokens and r.completion_tokens == 6 for r in lv.requests)
        assert all(r.ids_source == "native" and r.logprobs for r in lv.requests)
        sha = {p.id: p.record.sha256 for p in prompts if p.record is not None}
        assert all(r.prompt_sha256 == sha[r.prompt_id] for r in lv.requests)  # what a replay checks
    assert max(n for _, n in al.in_flight(levels[1])) == 4  # sent at once; the engine queues them
    assert levels[1].scrapes
    prof = profile_from_dict({"name": "e", "engine": {"base_url": engine}, "arms": [{"name": "engine"}],
                              "load": load.model_dump(), "request": {"max_tokens": 6}})
    record = RunRecord(run_id="e", status="complete", created_at=0.0, abbench_version="0", profile=prof.model_dump(),
                       load=levels)
    p = al.parity_under_load(record)
    assert list(p["level"]) == ["c=4", "rate=20"]
    assert (p["identical"] == p["prompts"]).all() and (p["prompts"] == len(prompts)).all()
