"""The report's Decode section, pinned figure by figure against the committed offloaded H200 run.

Every cell is recomputed here from ``requests.jsonl`` with plain Python (no abbench analysis code) and compared
with the Markdown cell as printed (``abbench report`` through the CLI): decode rate and step, decode H2D per
step, the slot-cache hit rate, the expected step (decode H2D per step / measured bandwidth + the step of an arm
that copied nothing for the same prompt), step over expected and the peak device memory.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pandas as pd
import pytest

from tests.support import cli
from tests.support import mdtables as mt

REPO = Path(__file__).resolve().parents[2]
RUN = REPO / "results" / "20261130-h200-qwen3-30b-a3b"


def _s(cell: str) -> float:
    v, unit = cell.split()
    return float(v) * {"s": 1.0, "ms": 1e-3}[unit]


def _bytes(cell: str) -> float:
    v, unit = cell.split()
    return float(v) * {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9, "MiB": 2**20, "GiB": 2**30}[unit]


def _close(printed: float, want: float, digits_rel: float = 5e-3) -> bool:
    return abs(printed - want) <= digits_rel * max(abs(want), 1e-12) + 1e-12


@pytest.fixture(scope="module")
def decode_rows(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    out = tmp_path_factory.mktemp("reports")
    res = cli.abbench("report", str(RUN), "--out", str(out), cwd=REPO)
    assert res.returncode == 0, res.stderr
    section = mt.sections((out / f"{RUN.name}.md").read_text())["Decode"]
    (rows,) = mt.tables(section)
    return rows


def _samples() -> list[dict]:
    prompts = {p["id"]: p["target_tokens"] for p in json.loads((RUN / "run.json").read_text())["prompts"]}
    last: dict[int, dict] = {}
    for line in (RUN / "requests.jsonl").read_text().splitlines():
        s = json.loads(line)
        if s["ok"] and not s["excluded"]:
            last[s["step"]] = s
    out = []
    for s in last.values():
        e = s["engine"]
        steps = s["completion_tokens"] - 1
        out.append({"arm": s["arm"], "kind": s["kind"], "tokens": prompts[s["prompt_id"]], "prompt": s["prompt_id"],
                    "step": (s["total_s"] - s["ttft_s"]) / steps, "h2d": e["decode_h2d_bytes"] / steps,
                    "hits": e["decode"]["slot_hits"], "misses": e["decode"]["slot_misses"],
                    "gbps": e["measured_h2d_gbps"], "peak": e["peak_device_bytes"],
                    "copied": e["decode_h2d_bytes"]})
    return out


def test_decode_section_figures(decode_rows: list[dict[str, str]]) -> None:
    samples = _samples()
    cached: dict[str, list[float]] = {}
    for s in samples:
        if s["copied"] == 0:
            cached.setdefault(s["prompt"], []).append(s["step"])
    cells: dict[tuple, list[dict]] = {}
    for s in samples:
        cells.setdefault((s["arm"], s["kind"], s["tokens"]), []).append(s)
    assert len(decode_rows) == len(cells) == 28  # 4 arms x (5 fresh lengths + cold + continuation)
    for row in decode_rows:
        g = cells[(row["Arm"], row["Kind"], int(row["Prompt tokens"]))]
        step = statistics.median(x["step"] for x in g)
        assert _close(_s(row["Step"]), step), row
        assert abs(float(row["Decode tok/s"]) - 1 / step) <= 0.051, row
        per_step = statistics.median(x["h2d"] for x in g)
        if per_step == 0:
            assert row["Decode H2D/step"] == "0 B" and row["Slot hit rate"] == "—"
        else:
            assert _close(_bytes(row["Decode H2D/step"]), per_step), row
            hits = sum(x["hits"] for x in g)
            rate = 100 * hits / (hits + sum(x["misses"] for x in g))
            assert abs(float(row["Slot hit rate"].rstrip("%")) - rate) <= 0.051, row
        cached_step = statistics.median(statistics.median(cached[x["prompt"]]) for x in g)
        expected = per_step / (statistics.median(x["gbps"] for x in g) * 1e9) + cached_step
        assert _close(_s(row["Expected step"]), expected), row
        assert _close(_s(row["Cached"]), cached_step), row  # the step's breakdown: cached + copies + other
        assert _close(_s(row["Copies"]), expected - cached_step), row
        if abs(step - expected) > 1e-5:  # (a zero "other" prints as 0.000 ms)
            assert _close(abs(_s(row["Other"].lstrip("-"))), abs(step - expected)), row
        assert abs(float(row["Step/expected"].rstrip("x")) - step / expected) <= 0.0006, row
        assert _close(_bytes(row["Peak device (engine)"]), max(x["peak"] for x in g)), row
    resident = [r for r in decode_rows if r["Arm"] == "resident"]
    assert all(r["Step/expected"] == "1.000x" for r in resident)  # the resident arm is its own cached step


def test_ttft_memory_table_pairs_median_ttft_with_the_highest_peak() -> None:
    from abbench import analysis as an
    from abbench.results import load_run

    record, _ = load_run(RUN)
    table = an.ttft_memory_table(record)
    prompts = {p["id"]: p["target_tokens"] for p in json.loads((RUN / "run.json").read_text())["prompts"]}
    raw: dict[tuple, list[dict]] = {}
    for line in (RUN / "requests.jsonl").read_text().splitlines():
        s = json.loads(line)
        if s["ok"] and not s["excluded"]:
            raw.setdefault((s["arm"], s["kind"], prompts[s["prompt_id"]]), []).append(s)
    assert len(table) == len(raw) == 28 and set(table["peak_source"]) == {"engine"}
    for r in table.itertuples():
        g = raw[(r.arm, r.kind, r.target_tokens)]
        assert r.peak_bytes == max(s["engine"]["peak_device_bytes"] for s in g)
        assert r.ttft_s == pytest.approx(statistics.median(s["ttft_s"] for s in g))
    resident = table[table["arm"] == "resident"]["peak_bytes"]
    offloaded = table[table["arm"] != "resident"]["peak_bytes"]
    assert offloaded.max() < 24e9 < resident.min()  # torch's own peak stays under the 24 GB budget


def test_copy_wait_column_and_a_moved_run(tmp_path: Path) -> None:
    """Engine copy-stall times (``copy_wait_s``) appear as the H2D section's "Copy wait" column, medians per
    cell; a run whose directory was renamed is reported under the new name, with a note of the recorded id.
    Runs without the figure (every committed one) show no such column."""
    run = tmp_path / "moved-run"
    run.mkdir()
    record = json.loads((RUN / "run.json").read_text())

    def wait(s: dict) -> float:
        return 0.001 * (s["step"] % 7) + (0.5 if s["arm"] == "layer-major" else 0.0)

    for s in record["samples"]:
        s["engine"]["copy_wait_s"] = wait(s)
    (run / "run.json").write_text(json.dumps(record))
    waits: dict[tuple, list[float]] = {}
    lines = []
    for line in (RUN / "requests.jsonl").read_text().splitlines():
        s = json.loads(line)
        s["engine"]["copy_wait_s"] = wait(s)
        if s["ok"] and not s["excluded"]:
            waits.setdefault((s["arm"], s["kind"], s["prompt_tokens"]), []).append(wait(s))
        lines.append(json.dumps(s))
    (run / "requests.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "reports"
    res = cli.abbench("report", str(run), "--out", str(out), cwd=REPO)
    assert res.returncode == 0, res.stderr
    text = (out / "moved-run.md").read_text()
    assert "# abbench report: moved-run" in text
    assert f"run recorded as '{RUN.name}'; named after its directory, 'moved-run'" in text
    (rows,) = mt.tables(mt.sections(text)["Host-to-device transfers"])
    assert len(rows) == 28
    for r in rows:
        want = statistics.median(waits[(r["Arm"], r["Kind"], int(r["Prompt tokens"]))])
        assert _close(_s(r["Copy wait"]), want), (r, want)
    res = cli.abbench("report", str(RUN), "--out", str(tmp_path / "plain"), cwd=REPO)
    assert res.returncode == 0, res.stderr
    assert "Copy wait" not in (tmp_path / "plain" / f"{RUN.name}.md").read_text()


def test_memory_added_by_each_request_next_to_its_peak() -> None:
    """An engine that reports what it held when a request started (``start_device_bytes``) gets an "Added"
    column: the most any request of the cell added to that (peak - start), in GiB. The committed runs predate
    the figure and show no such column."""
    from abbench import analysis as an
    from abbench.analysis.decode import decode_table
    from abbench.report.sections import ReportInput, decode_section
    from abbench.results import load_run

    record, _ = load_run(RUN)
    assert not any("Added" in line for line in decode_section(ReportInput(record=record, analysis=an.analyze(record))))
    added: dict[tuple, list[int]] = {}
    for s in record.samples:
        peak = s.engine["peak_device_bytes"]
        start = 14 * 2**30 + (s.step % 5) * 2**28  # a different start per request: the column takes peak - start
        s.engine["start_device_bytes"] = start
        if s.ok and not s.excluded and s.completion_tokens and s.completion_tokens > 1:
            added.setdefault((s.arm, s.kind, s.prompt_tokens), []).append(peak - start)
    table = decode_table(record)
    assert len(table) == len(added) and table["added_device_bytes"].notna().all()
    for row in table.itertuples():
        assert row.added_device_bytes == max(added[(row.arm, row.kind, row.target_tokens)])
    text = "\n".join(decode_section(ReportInput(record=record, analysis=an.analyze(record))))
    (rows,) = mt.tables(text)
    for r in rows:  # "1.23 GiB"
        assert r["Added (engine)"].endswith(" GiB")
        assert _close(float(r["Added (engine)"].split()[0]), max(added[(r["Arm"], r["Kind"], int(r["Prompt tokens"]))])
                      / 2**30)
    assert "Added = the most a request added" in text


def test_where_a_streaming_arms_time_goes_on_the_qwen4_run() -> None:
    """TTFT = the resident arm's TTFT at the same chunk length + copy wait + the rest, per cell, from the
    committed Qwen4-Exp run that timed its copy waits (recomputed here from its samples); the report's floor
    section shows the table; runs without copy waits show none."""
    from abbench import analysis as an
    from abbench.analysis.frames import measured_ok
    from abbench.analysis.transfer import gap_table
    from abbench.report.sections import ReportInput, floor_section
    from abbench.results import load_run

    record, _ = load_run(REPO / "results" / "20261201-h200-qwen4-exp-half")
    cell: dict[tuple, list] = {}
    for s in measured_ok(record):
        cell.setdefault((s.arm, s.kind, s.prompt_tokens), []).append(s)
    gap = gap_table(record)
    assert set(gap["arm"]) == {"chunked", "layer-major", "demand"} and set(gap["kind"]) == {"fresh", "cold"}
    for r in gap.itertuples():
        mine = cell[(r.arm, r.kind, r.target_tokens)]
        resident = statistics.median(s.ttft_s for s in cell[("resident", r.kind, r.target_tokens)])
        wait = statistics.median(s.engine["copy_wait_s"] for s in mine)
        ttft = statistics.median(s.ttft_s for s in mine)
        assert (r.chunk_tokens, r.resident_arm) == (2048, "resident")
        assert r.gap_s == pytest.approx(ttft - resident) and r.copy_wait_s == pytest.approx(wait)
        assert r.rest_s == pytest.approx(ttft - resident - wait) and r.rest_share == pytest.approx(r.rest_s / r.gap_s)
    lm16 = gap[(gap["arm"] == "layer-major") & (gap["kind"] == "fresh") & (gap["target_tokens"] == 16384)].iloc[0]
    assert lm16.copy_wait_s > 0.4 and lm16.rest_share < 0.3  # the indexed-attention run: copies not hidden
    text = "\n".join(floor_section(ReportInput(record=record, analysis=an.analyze(record))))
    assert "Where a streaming arm's time goes" in text and "| Rest / gap |" in text
    old, _ = load_run(RUN)  # no copy waits recorded
    assert gap_table(old).empty
    assert "Where a streaming" not in "\n".join(floor_section(ReportInput(record=old, analysis=an.analyze(old))))


def test_the_gap_is_taken_to_the_resident_arm_at_the_same_chunk_length() -> None:
    """With resident arms at two chunk lengths, a streaming arm pairs with the one at its own length (the same
    kernels), not with the faster one; with none at its length, with the fastest."""
    from abbench.analysis.transfer import gap_table
    from tests.harness.test_analysis import make_run

    def ttft(arm: str, prompt, rnd: int) -> float:
        return {"A": 4.0, "B": 3.0, "C": 2.5, "R2k": 2.0, "R8k": 1.5}[arm] * prompt.target_tokens / 4096

    record = make_run(arms=("A", "B", "C", "R2k", "R8k"), lengths=(4096,), ttft=ttft,
                      expect_path={"B": "layer-major", "C": "layer-major", "R2k": "resident", "R8k": "resident"})
    chunk = {"A": 2048, "B": 2048, "C": 4096, "R2k": 2048, "R8k": 8192}
    for s in record.samples:
        s.engine["chunk_tokens"] = chunk[s.arm]
        if s.arm in ("B", "C"):
            s.engine["copy_wait_s"] = 0.25
    rows = {r.arm: r for r in gap_table(record).itertuples()}
    assert set(rows) == {"B", "C"}  # A timed no copy waits; resident arms are the reference, not rows
    assert (rows["B"].resident_arm, rows["B"].gap_s, rows["B"].rest_s) == ("R2k", pytest.approx(1.0),
                                                                          pytest.approx(0.75))
    assert (rows["C"].resident_arm, rows["C"].gap_s, rows["C"].rest_share) == ("R8k", pytest.approx(1.0),
                                                                              pytest.approx(0.75))


def test_expected_step_takes_its_cached_step_from_the_same_decode_kernels() -> None:
    """An offloaded arm's floor is the step of an arm that copied nothing with the same decode kernels: on the
    committed decode-kernels run with each sample's ``decode.kernels`` filled in as its service ran them, the
    Triton offloaded arm's cached step is the Triton resident arm's, not the median over both resident arms
    (which is what a record without ``decode.kernels`` gives)."""
    from abbench import analysis as an
    from abbench.results import load_run

    record, _ = load_run(REPO / "results" / "20261201n-h200-decode-kernels")
    before = an.decode_table(record).set_index(["arm", "target_tokens"])
    for s in record.samples:
        triton = s.arm.endswith("-triton")
        s.engine["decode"]["kernels"] = "experts=triton, attention=triton" if triton else \
            "experts=grouped, attention=torch"
    after = an.decode_table(record).set_index(["arm", "target_tokens"])
    for tokens in (4096, 32768):
        assert after.loc[("offloaded-triton", tokens), "cached_step_s"] == \
            after.loc[("resident-triton", tokens), "step_s"]
        assert after.loc[("offloaded", tokens), "cached_step_s"] == after.loc[("resident", tokens), "step_s"]
        assert after.loc[("resident-triton", tokens), "over_expected"] == pytest.approx(1.0)
        mixed = before.loc[("offloaded-triton", tokens), "cached_step_s"]
        assert before.loc[("resident-triton", tokens), "step_s"] < mixed < before.loc[("resident", tokens), "step_s"]
        assert after.loc[("offloaded-triton", tokens), "over_expected"] > 1.2  # the floor it really misses


def test_who_handled_the_misses_and_the_step_breakdown_on_the_offloaded_decode_run() -> None:
    """On the committed run of h200-decode-offload: each offloaded arm names who handled its misses, both copied
    the same bytes (one policy), each step is its copies + the cached step + the rest, and only the device-side
    misses come within 1.10 of the floor (results/20261202-h200-decode-offload/README.md)."""
    from abbench import analysis as an
    from abbench.results import load_run

    record, _ = load_run(REPO / "results" / "20261202-h200-decode-offload")
    t = an.decode_table(record).set_index(["arm", "target_tokens"])
    for tokens in (4096, 32768, 131072):
        host, device = t.loc[("offloaded-host", tokens)], t.loc[("offloaded-device", tokens)]
        assert (host["decode_misses"], device["decode_misses"]) == ("host", "device")
        assert host["h2d_per_step"] == device["h2d_per_step"] > 0
        for row in (host, device):
            assert row["copy_s"] + row["cached_step_s"] + row["other_s"] == pytest.approx(row["step_s"])
        assert device["over_expected"] < 1.10 < host["over_expected"]
        assert device["other_s"] < host["other_s"] / 2
    assert pd.isna(t.loc[("resident", 4096), "decode_misses"])  # nothing can miss

