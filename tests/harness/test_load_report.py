"""The report of a run with load levels: its Load section (per-cell table with intervals, throughput ratio,
parity under load, server gauges), its plot, the HTML page with the plot inline, and the load checks in the
gate; a run without load levels has no such section."""

from __future__ import annotations

from pathlib import Path

import pytest

from abbench import analysis as an
from abbench.loadgen import Level, LoadPrompt, Target, run_level
from abbench.profile import RequestSpec, profile_from_dict
from abbench.report import write_report
from abbench.report.html import write_html
from abbench.report.sections import load_section
from abbench.results import RunRecord, load_run, save_run
from tests.support.fastsse import FastServer

CHECKS = ["parity_under_load[b, c=4]", "parity_under_load[a, c=4]", "throughput_ratio[b, c=4] >= 0.01",
          "goodput[a, rate=300] >= 1"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    prof = profile_from_dict({
        "name": "load-report", "engine": {"base_url": "http://127.0.0.1:1"}, "arms": [{"name": "a"}, {"name": "b"}],
        "request": {"max_tokens": 6},
        "load": {"concurrency": [1, 4], "rate": [300], "requests": 12, "slo": ["ttft_s <= 1"]},
        "gate": {"checks": CHECKS}})
    prompts = [LoadPrompt(f"load-{i}", 3, 6, f"alpha{i} beta gamma") for i in range(4)]
    levels = []
    with FastServer(token_delay_s=0.0005, tie_at=1) as srv:
        for rnd, order in ((1, ("a", "b")), (2, ("b", "a"))):
            for pos, arm in enumerate(order):
                plain = Target(srv.base_url, RequestSpec(max_tokens=6), arm=arm, position=pos, metrics_path="/metrics")
                levels.append(run_level(Level.from_spec(prof.load, "concurrency", 1, round=rnd, role="reference"),
                                        plain, prompts))
                for kind, v in prof.load.levels():
                    flip = {"flip_tie": True} if arm == "b" and v == 4 else {}
                    t = Target(srv.base_url, RequestSpec(max_tokens=6), arm=arm, position=pos, extra=flip,
                               metrics_path="/metrics")
                    levels.append(run_level(Level.from_spec(prof.load, kind, v, round=rnd), t, prompts))
    record = RunRecord(run_id="load-report", status="complete", created_at=0.0, abbench_version="0",
                       profile=prof.model_dump(), load=levels)
    d = tmp_path_factory.mktemp("runs") / "load-report"
    save_run(d, record)
    return d


def test_the_load_section_and_plot(run_dir: Path, tmp_path: Path) -> None:
    record, problems = load_run(run_dir)
    assert len(record.load) == 16 and all(r.ok for lv in record.load for r in lv.requests)
    md = write_report(record, problems, tmp_path / "r.md", tmp_path / "r")
    text = md.read_text()
    assert "## Load levels" in text and "### Throughput against the reference arm" in text
    assert "### Parity under load" in text and "### Server metrics during the levels" in text
    assert "open loop (Poisson arrivals, seed 0" in text and "goodput SLOs: `ttft_s <= 1`" in text
    rows = [line for line in text.splitlines() if line.startswith("| a | c=4 ") or line.startswith("| b | c=4 ")]
    assert len(rows) >= 4  # the cell table and the parity table
    parity_b = next(line for line in text.splitlines() if line.startswith("| b | c=4 | 4 |"))
    assert parity_b.split("|")[3:9] == [" 4 ", " 0 ", " 4 ", " 0 ", " 0 ", " 0 "]  # 4 prompts, all near-tie flips
    assert "| b | c=4 | 2 |" in text  # the ratio row: two rounds
    assert (tmp_path / "r" / "load.png").stat().st_size > 10_000
    assert "![TTFT and ITL against achieved output tokens/s, per arm and level](r/load.png)" in text
    page = write_html(md).read_text()
    assert 'id="load-levels"' in page and "data:image/png;base64," in page


def test_the_gate_judges_the_load_checks(run_dir: Path) -> None:
    record, _ = load_run(run_dir)
    v = an.gate(record)
    results = {c.name: c.result for c in v.checks}
    assert results["parity_under_load[b, c=4] >= 1"] == "FAIL", results  # near ties, not accepted
    assert results["parity_under_load[a, c=4] >= 1"] == "pass"
    assert results["throughput_ratio[b, c=4] >= 0.01"] == "pass"
    assert results["goodput[a, rate=300] >= 1"] == "pass"


def test_a_run_without_load_levels_has_no_load_section() -> None:
    from abbench.report.sections import ReportInput

    record = RunRecord(run_id="x", status="complete", created_at=0.0, abbench_version="0",
                       profile={"name": "x", "arms": [{"name": "a"}]})
    assert load_section(ReportInput(record=record, analysis=an.analyze(record))) == []
    assert an.analyze(record).load is None


def test_export_csv_has_one_row_per_load_request(run_dir: Path, tmp_path: Path) -> None:
    import pandas as pd
    from typer.testing import CliRunner

    from abbench.cli import app

    out = tmp_path / "load.csv"
    r = CliRunner().invoke(app, ["export", str(run_dir), "--csv", "--load", "--out", str(out)])
    assert r.exit_code == 0, r.output
    df = pd.read_csv(out)
    assert len(df) == sum(len(lv.requests) for lv in load_run(run_dir)[0].load) == 16 * 12  # 4 reference levels, 12 load
    assert set(df["level"]) == {"c=1", "c=4", "rate=300"} and set(df["role"]) == {"load", "reference"}
    assert df["ok"].all() and (df["ttft_s"] > 0).all() and df["run_id"].eq("load-report").all()
    assert df[df["role"] == "load"]["measured"].any() and not df[df["role"] == "reference"]["measured"].any()
    assert df["output_ids"].str.split().map(len).eq(6).all()
    plain = CliRunner().invoke(app, ["export", str(run_dir), "--csv", "--out", str(tmp_path / "plain.csv")])
    assert plain.exit_code == 0 and "is a load run" in plain.output  # a load-only run has requests, not samples
    assert (tmp_path / "plain.csv").read_bytes() == out.read_bytes()


def _slower(record: RunRecord, factor: float) -> RunRecord:
    """The run with every stamp of every load request stretched by ``factor`` (a slower candidate)."""
    levels = []
    for lv in record.load:
        reqs = [r.model_copy(update={
            "sent_s": r.sent_s * factor, "first_token_s": None if r.first_token_s is None else r.first_token_s * factor,
            "end_s": None if r.end_s is None else r.end_s * factor,
            "token_times_s": None if r.token_times_s is None else [t * factor for t in r.token_times_s]})
            for r in lv.requests]
        levels.append(lv.model_copy(update={"requests": reqs, "window_end_s": lv.window_end_s * factor,
                                            "elapsed_s": lv.elapsed_s * factor}))
    return record.model_copy(update={"load": levels, "run_id": record.run_id + "-slower"})


def _synthetic() -> RunRecord:
    """Two arms at c=4, two rounds, 40 requests a level with seeded TTFTs of 10 ms +- 10% and 6 tokens 5 ms apart
    (the statistics of compare judged on data that does not depend on this machine's load)."""
    import numpy as np

    from abbench.loadrecords import LoadLevel, LoadRequest

    rng = np.random.default_rng(0)
    levels = []
    for rnd in (1, 2):
        for arm in ("a", "b"):
            reqs = []
            for k in range(40):
                sent, ttft = 0.01 * k, float(rng.uniform(0.009, 0.011))
                times = [round(ttft + 0.005 * j, 6) for j in range(6)]
                reqs.append(LoadRequest(index=k, prompt_id=f"load-{k % 4}", target_tokens=3, max_tokens=6,
                                        sent_s=sent, first_token_s=sent + times[0], end_s=sent + times[-1],
                                        token_times_s=times, ok=True, output_ids=list(range(6)),
                                        ids_source="native", completion_tokens=6))
            levels.append(LoadLevel(arm=arm, round=rnd, kind="concurrency", value=4.0, started_at=0.0,
                                    window_start_s=0.0, window_end_s=0.39, elapsed_s=0.43, requests=reqs))
    prof = profile_from_dict({"name": "s", "engine": {"base_url": "http://127.0.0.1:1"},
                              "arms": [{"name": "a"}, {"name": "b"}], "load": {"concurrency": [4]}})
    return RunRecord(run_id="s", status="complete", created_at=0.0, abbench_version="0", profile=prof.model_dump(),
                     load=levels)


def test_compare_judges_the_load_cells(run_dir: Path, tmp_path: Path) -> None:
    import json

    from typer.testing import CliRunner

    from abbench.cli import app
    from abbench.compare import compare

    live, _ = load_run(run_dir)  # a real run: compared with itself, nothing moves
    same = compare(live, live)
    assert same.exit_code == 0 and not same.load.empty
    assert set(same.load["verdict"]) <= {"not significant", "too few to judge"}
    assert set(same.load["metric"]) == {"output_tok_s", "decode_output_tok_s", "goodput", "ttft_p50_s", "ttft_p99_s",
                                        "itl_p99_s"}
    base = _synthetic()
    c = compare(base, _slower(base, 3.0))
    rows = c.load.set_index(["arm", "level", "metric"])
    for arm in ("a", "b"):
        assert rows.loc[(arm, "c=4", "ttft_p50_s"), "change"] == pytest.approx(2.0)
        assert rows.loc[(arm, "c=4", "ttft_p50_s"), "verdict"] == "worse"
        assert rows.loc[(arm, "c=4", "output_tok_s"), "change"] == pytest.approx(-2 / 3, abs=0.02)
        assert rows.loc[(arm, "c=4", "ttft_p99_s"), "verdict"] == "too few to judge"  # 80 requests: no p99
        assert rows.loc[(arm, "c=4", "itl_p99_s"), "verdict"] == "worse"  # 400 gaps
    assert c.exit_code == 1
    faster = compare(base, _slower(base, 0.5))
    assert set(faster.load.set_index("metric").loc["ttft_p50_s", "verdict"]) == {"better"}
    assert faster.exit_code == 0
    save_run(tmp_path / "base", base)
    save_run(tmp_path / "slower", _slower(base, 3.0))
    r = CliRunner().invoke(app, ["compare", str(tmp_path / "base"), str(tmp_path / "slower"),
                                 "--out", str(tmp_path / "c.md")])
    assert r.exit_code == 1, r.output
    text = (tmp_path / "c.md").read_text()
    assert "### Load levels" in text and "Regressions: a c=4: Output tok/s -66.7%" in text
    assert "a c=4: TTFT p50 +200.0% (CI +190.6% – +210.0%)" in text
    j = CliRunner().invoke(app, ["compare", str(tmp_path / "base"), str(tmp_path / "slower"), "--json"])
    doc = json.loads(j.stdout)  # the document alone (the closing line goes to stderr)
    assert j.exit_code == 1 and any(x["metric"] == "ttft_p50_s" and x["regression"] for x in doc["load"])


def test_a_level_without_a_measured_window_is_named() -> None:
    from abbench.loadrecords import LoadLevel, LoadRequest
    from abbench.report.sections import ReportInput

    req = LoadRequest(index=0, prompt_id="load-0", target_tokens=3, max_tokens=2, sent_s=0.0, first_token_s=0.1,
                      end_s=0.2, token_times_s=[0.1, 0.2], ok=True, output_ids=[1, 2], ids_source="native",
                      completion_tokens=2)
    lv = LoadLevel(arm="a", round=1, kind="rate", value=2.0, started_at=0.0, warmup_s=5.0, window_start_s=5.0,
                   window_end_s=5.0, elapsed_s=0.2, requests=[req])
    prof = profile_from_dict({"name": "w", "engine": {"base_url": "http://127.0.0.1:1"}, "arms": [{"name": "a"}],
                              "load": {"rate": [2], "warmup_s": 5}})
    record = RunRecord(run_id="w", status="complete", created_at=0.0, abbench_version="0", profile=prof.model_dump(),
                       load=[lv])
    text = "\n".join(load_section(ReportInput(record=record, analysis=an.analyze(record))))
    assert "No measured window (warm-up and cool-down cover every send" in text and "a rate=2 round 1" in text
