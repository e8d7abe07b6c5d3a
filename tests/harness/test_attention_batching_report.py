"""The report's attention-batching table against the engine's stated rule, on the committed H200 run.

``results/20261201g-h200-qwen3.5-35b-a3b-long``: 2048-token chunks, 131,072-token windows, the Qwen3.5-35B-A3B
shape's 10 full-attention layers, two chunks per call up to 16,384 tokens. The rule (abbench.engine.runtime.steps) says
what each prompt must show: per attention layer the first 4 pairs run batched, every later pair falls back as
long-context, and a window with an odd number of chunks leaves one window-end group.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from abbench.analysis.paths import attention_batching_table
from abbench.analysis.summary import analyze
from abbench.report.sections import render_markdown
from abbench.results import load_run

RUN = Path(__file__).resolve().parents[2] / "results" / "20261201g-h200-qwen3.5-35b-a3b-long"


@pytest.fixture(scope="module")
def record():
    if not (RUN / "run.json").exists():
        pytest.skip("the committed run is not in this checkout")
    return load_run(RUN)[0]


def test_batched_and_fallback_counts_follow_the_rule(record):
    t = attention_batching_table(record)
    assert set(t["arm"]) == {"layer-major-k2"}  # only the arm that asked for two chunks per call
    layers, pairs_within_limit = 10, 16384 // (2 * 2048)
    for _, row in t.iterrows():
        chunks = -(-row["target_tokens"] // 2048)
        windows = [min(64, chunks - w) for w in range(0, chunks, 64)]
        expect_long = sum(c // 2 for c in windows) - pairs_within_limit
        expect = {"long-context": layers * expect_long}
        if any(c % 2 for c in windows):
            expect["window-end"] = layers * sum(c % 2 for c in windows)
        assert (row["attention_batch"], row["batched"], row["fallbacks"]) == (
            2, layers * pairs_within_limit, expect), row["target_tokens"]


def test_the_section_appears_only_for_runs_that_batched(record):
    text = render_markdown(record, [], analyze(record), {}, {})
    assert "## Attention batching" in text and "long-context ×590" in text
    other = load_run(RUN.parent / "20261130-h200-qwen3.5-35b-a3b")[0]
    assert "## Attention batching" not in render_markdown(other, [], analyze(other), {}, {})
