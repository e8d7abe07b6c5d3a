"""Latency distributions (abbench.analysis.latency): TTFT, TPOT and ITL percentiles where n allows them, in the
report and in declared checks; on records built here with known token arrival times, and on a real run against
the loopback fake server."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from abbench import analysis as an
from abbench.analysis.declared import judge, parse_check
from abbench.analysis.latency import gaps, itl_values, latency_table, min_n, percentile, tpot_values
from abbench.report import render_markdown
from abbench.results import RunRecord, Sample

from tests.harness.test_analysis import make_run
from tests.support import faultkit as fk


def with_token_times(record: RunRecord, step_s: float = 0.01) -> RunRecord:
    """Each measured sample's 16 tokens arrive ``step_s`` apart after its TTFT, except tokens 8 and 9, which
    come in one chunk; arm B's gaps are twice A's."""
    for s in record.samples:
        if s.ttft_s is None:
            continue
        d = step_s * (2 if s.arm == "B" else 1)
        times = [s.ttft_s + d * i for i in range(16)]
        times[9] = times[8]
        s.token_times_s = times
        s.total_s = times[-1] + 0.001
    return record


def test_a_percentile_needs_enough_values() -> None:
    assert (min_n(0.5), min_n(0.9), min_n(0.99)) == (1, 10, 100)
    assert percentile(np.arange(9.0), 90) is None and percentile(np.arange(10.0), 90) == pytest.approx(8.1)
    assert percentile(np.arange(99.0), 99) is None and percentile(np.arange(100.0), 99) == pytest.approx(98.01)
    assert percentile(np.array([3.0]), 50) == 3.0 and percentile(np.empty(0), 50) is None


def test_tokens_of_one_chunk_are_one_arrival() -> None:
    s = Sample(step=0, arm="A", round=1, position=0, prompt_id="p", kind="fresh", excluded=False, service="A@r1",
               ok=True, started_at=0.0, ttft_s=0.1, token_times_s=[0.1, 0.2, 0.2, 0.35])
    assert gaps(s).tolist() == pytest.approx([0.1, 0.15])
    assert gaps(s.model_copy(update={"token_times_s": None})).size == 0  # a run made before token times


def test_latency_table_per_cell() -> None:
    record = with_token_times(make_run(rounds=2, lengths=(1024,)))
    lat = latency_table(record)
    a = lat[lat["arm"] == "A"].iloc[0]
    assert a["n"] == 2 and a["ttft_p50_s"] == pytest.approx(1.024 * 1.0015) and a["ttft_p90_s"] is None
    # 16 tokens, 15 arrivals, 14 gaps per request, two requests: 28 ITLs, all 10 ms apart but one of 20 ms
    assert a["n_itl"] == 28 and a["itl_p50_s"] == pytest.approx(0.01) and a["itl_p90_s"] == pytest.approx(0.01)
    assert a["itl_p99_s"] is None
    b = lat[lat["arm"] == "B"].iloc[0]
    assert b["itl_p50_s"] == pytest.approx(0.02) and b["n_tpot"] == 2
    assert b["tpot_p50_s"] == pytest.approx((15 * 0.02 + 0.001) / 15)  # (total - TTFT) / (16 - 1)
    assert len(itl_values(record)) == 4 * 14 and len(tpot_values(record)) == 4


def test_the_report_shows_percentiles_where_n_allows() -> None:
    record = with_token_times(make_run(rounds=2, lengths=(1024,)))
    md = render_markdown(record, [], an.analyze(record), {}, {})
    section = md.split("## Latency percentiles", 1)[1].split("\n## ", 1)[0]
    assert "Not shown, n too small in every cell: TTFT p90, TTFT p99, TPOT p90, TPOT p99, ITL p99." in section
    header = next(line for line in section.splitlines() if line.startswith("| Arm"))
    assert header.split(" | ")[-3:] == ["TPOT p50", "ITL p50", "ITL p90 |"]
    plain = render_markdown(make_run(), [], an.analyze(make_run()), {}, {})  # no token times: no ITL columns
    assert "no ITL" in plain and "ITL p50" not in plain


def test_declared_checks_name_the_latency_metrics() -> None:
    record = with_token_times(make_run(rounds=10, lengths=(1024,)))
    ok = judge(record, parse_check("itl_s[A] <= 0.011"))
    assert [c.status for c in ok] == ["pass"] and ok[0].n == 10 * 14
    assert [c.status for c in judge(record, parse_check("itl_p90_s[B] <= 0.015"))] == ["fail"]
    assert [c.status for c in judge(record, parse_check("tpot_s[A] <= 0.02"))] == ["pass"]
    p90 = judge(record, parse_check("ttft_p90_s[A] <= 1.1"))  # 10 rounds: 10 TTFTs, enough for a p90
    assert [c.status for c in p90] == ["pass"] and p90[0].n == 10
    few = judge(record, parse_check("ttft_p99_s[A] <= 1.1"))
    assert few[0].status == "inconclusive" and "a p99 needs at least 100 values" in few[0].why
    v = an.gate(record, checks=["itl_p99_s[A] <= 0.021", "tpot_p90_s[B] >= 0.01"])  # p99: the chunk's gap
    assert v.passed, v.failures


@pytest.mark.slow
def test_a_real_run_records_token_times_and_reports_itl(tmp_path: Path) -> None:
    """`abbench run` against the fake server with 20 ms between token events: every measured sample holds one
    arrival per output token, token j no earlier than j x 20 ms, and the latency table has every gap."""
    from abbench import runner
    from abbench.profile import profile_from_dict
    from abbench.results import load_run

    mark = fk.new_mark()
    prof = fk.fake_profile(mark, args=("--token-delay", "0.02"), request={"max_tokens": 6}, run={"rounds": 2})
    record = runner.execute(profile_from_dict(prof), tmp_path / "run")
    assert record.status == "complete", record.status_reason
    loaded, _ = load_run(tmp_path / "run")
    measured = [s for s in loaded.samples if not s.excluded]
    assert measured and all(len(s.token_times_s or []) == s.completion_tokens == 6 for s in measured)
    assert all(t >= j * 0.02 for s in measured for j, t in enumerate(s.token_times_s or []))
    lat = latency_table(loaded)
    assert (lat["n_itl"] == 2 * 5).all() and (lat["itl_p50_s"] > 0).all()
    fk.assert_no_leftovers(mark)
