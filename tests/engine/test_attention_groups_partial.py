"""Layer-major attention batching with k > 2 (``plan_attention_groups``): a window's last, partial group (fewer
than k chunks left) runs one call per chunk and is counted once as "window-end", never batched, whether one or
several chunks are left over. At k = 2 a partial group is a single chunk, so "batched as a short group" and
"fell back" cannot be told apart there; at k = 3 and 4 they can."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from abbench.engine.runtime.steps import BatchingStats, plan_attention_groups  # noqa: E402


@pytest.mark.parametrize("k, chunks, full_groups", [(3, 7, 2), (3, 8, 2), (4, 6, 1), (4, 7, 1), (4, 11, 2)])
def test_a_windows_partial_last_group_falls_back_as_window_end(k: int, chunks: int, full_groups: int) -> None:
    window = [(a, a + 64) for a in range(0, 64 * chunks, 64)]  # every chunk full, far below the context limit
    stats = BatchingStats()
    groups = plan_attention_groups(window, k, 64, 1 << 20, True, stats)
    assert [c for g in groups for c in g] == list(range(chunks))  # every chunk once, in order
    batched = [g for g in groups if len(g) > 1]
    assert batched == [list(range(i * k, (i + 1) * k)) for i in range(full_groups)]
    left = chunks - full_groups * k
    assert 0 < left < k
    assert groups[len(batched):] == [[c] for c in range(full_groups * k, chunks)]  # the rest alone
    assert (stats.batched, stats.fallbacks) == (full_groups, {"window-end": 1})


def test_a_window_of_whole_groups_has_no_window_end() -> None:
    window = [(a, a + 64) for a in range(0, 64 * 9, 64)]
    stats = BatchingStats()
    groups = plan_attention_groups(window, 3, 64, 1 << 20, True, stats)
    assert groups == [[0, 1, 2], [3, 4, 5], [6, 7, 8]] and (stats.batched, stats.fallbacks) == (3, {})
