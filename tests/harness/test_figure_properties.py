"""Properties of the figures a report prints, each stated so that a plausible slip in the code breaks it:

* a paired ratio's verdict words say how many times faster (or slower) the arm is: "4.00x faster" for a
  quarter of the reference's TTFT, never the ratio itself;
* the copy floor of an arm that streams one bank per layer-major window grows with its windows (the bytes
  it must copy), so "TTFT over floor" does not flatter an arm that splits a prompt;
* decode's seconds per step divide the decode time by the steps after the first token (which prefill
  made), and agree with the decode rate that compare and declared checks judge;
* the parity summary counts as matches only rows that were checked and matched: a row that could not be
  checked (the engine returned no ids) is unchecked, never a match;
* the report of a run that did not finish (still "running": the process died; or "partial") lists its status
  among the problems, whatever its samples look like.

The runs are built by ``tests/harness/test_analysis.py``'s ``make_run`` (complete, clean records) with the
numbers each property needs; the report is read back with :mod:`tests.support.mdtables`.
"""

from __future__ import annotations

import pytest

from abbench import analysis as an
from abbench import report as rp
from abbench.results import RunRecord

from tests.harness.test_analysis import BANK, MAX_TOKENS, find, make_run
from tests.support import mdtables


def _report(record: RunRecord) -> dict[str, str]:
    return mdtables.sections(rp.render_markdown(record, [], an.analyze(record), {}, {}))


# ----------------------------------------------------------------------------------- verdict words


def test_the_verdict_words_say_how_many_times_faster_or_slower() -> None:
    """B takes a quarter of A's TTFT in every pair, C twice it, D the same."""
    factor = {"A": 1.0, "B": 0.25, "C": 2.0, "D": 1.0}
    rec = make_run(arms=("A", "B", "C", "D"), rounds=2, lengths=(1024, 4096),
                   ttft=lambda arm, p, rnd: p.target_tokens / 1000.0 * factor[arm])
    rows = mdtables.tables(_report(rec)["Paired ratios"])[0]
    words = {(r["Arm"], r["Prompt tokens"]): r["Verdict"] for r in rows}
    assert set(words) == {(arm, n) for arm in "BCD" for n in ("1024", "4096")}, words
    for n in ("1024", "4096"):
        assert words[("B", n)] == "4.00x faster"
        assert words[("C", n)] == "2.00x slower"
        assert "faster" not in words[("D", n)] and "slower" not in words[("D", n)]


# -------------------------------------------------------------------------------------- copy floor


def _windows(record: RunRecord, arm: str, windows: int) -> RunRecord:
    """Arm ``arm`` splits every prompt into ``windows`` layer-major windows, streaming the bank once per window."""
    for s in record.samples:
        if s.arm == arm and s.engine:
            e = dict(s.engine)
            e.update(n_windows=windows, prefill_h2d_bytes=windows * BANK,
                     h2d_bytes=windows * BANK + e["decode_h2d_bytes"])
            s.engine = e
    return record


@pytest.mark.parametrize("windows", [2, 3])
def test_the_copy_floor_grows_with_the_windows(windows: int) -> None:
    one = an.h2d_table(make_run(rounds=2, lengths=(4096,))).set_index("arm").loc["B"]
    split = an.h2d_table(_windows(make_run(rounds=2, lengths=(4096,)), "B", windows)).set_index("arm").loc["B"]
    assert one["floor_s"] == pytest.approx(BANK / 55e9)  # one bank over the measured 55 GB/s
    # the bytes it must copy, over the same bandwidth: windows x one bank
    assert split["floor_s"] == pytest.approx(split["prefill_h2d_bytes"] / 55e9)
    assert split["floor_s"] == pytest.approx(windows * one["floor_s"])
    assert split["ttft_over_floor"] == pytest.approx(one["ttft_over_floor"] / windows)


# ------------------------------------------------------------------------------------ decode steps


@pytest.mark.parametrize("tokens", [2, 5, MAX_TOKENS])
def test_seconds_per_decode_step_leave_out_the_first_token(tokens: int) -> None:
    """``tokens`` output tokens take 0.3 s after the first (make_run's total - TTFT): prefill made the
    first, so there are ``tokens - 1`` decode steps; the decode table and the rate compare and declared
    checks judge agree."""
    rec = make_run(rounds=2, lengths=(1024, 4096))
    for s in rec.samples:
        s.completion_tokens = tokens
    dec = an.decode_table(rec)
    assert len(dec) == 4, dec
    for row in dec.itertuples():
        assert row.step_s == pytest.approx(0.3 / (tokens - 1)), row
        assert row.tok_s == pytest.approx((tokens - 1) / 0.3), row
    cells = an.declared.judge(rec, an.declared.parse_check("decode_tok_s[B] >= 0"))
    assert cells and all(c.value == pytest.approx((tokens - 1) / 0.3) for c in cells)


# ------------------------------------------------------------------------------------ parity summary


def test_an_unchecked_row_is_not_a_match() -> None:
    """B's sample of one prompt in round 2 came back without ids: its row is unchecked, not a match."""
    rec = make_run(rounds=2, lengths=(1024, 4096))
    s = find(rec, "B", "fresh-1024-0", 2)
    s.output_ids, s.ids_source, s.logprobs = [], "none", None
    rows = mdtables.tables(_report(rec)["Parity"])[0]
    b = next(r for r in rows if r["Check"] == "parity" and r["Arm"] == "B")
    match = next(v for k, v in b.items() if k.startswith("Match"))
    assert (b["Compared"], match, b["Unchecked"]) == ("4", "3", "1"), b


# ------------------------------------------------------------------------------------------ run status


@pytest.mark.parametrize("status", ["running", "partial", "complete"])
def test_a_run_that_did_not_finish_says_so(status: str) -> None:
    """Every planned sample is there and ok: only the status tells that the run did not finish."""
    rec = make_run(status=status)
    problems = _report(rec)["Problems and missing data"]
    assert (f"run status is {status}" in problems) is (status != "complete"), problems
