"""abbench.report: the Markdown report and its plots, on RunRecords built by tests/harness/test_analysis.py's
``make_run`` (with and without engine/NVML data)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd

from abbench import report as rp

from tests.harness.test_analysis import find, make_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SECTIONS = [
    "# abbench report: ", "## Verdict", "## TTFT per arm and prompt length", "## Paired ratios",
    "## Host-to-device transfers", "## Memory", "## Parity", "## Active path", "## Client overhead",
    "## Environment", "## Small-n notes", "## Problems and missing data", "## Plots",
]


def is_png(path: Path) -> bool:
    data = path.read_bytes()
    return data[:8] == PNG_MAGIC and data[12:16] == b"IHDR" and len(data) > 1000


def render(tmp_path: Path, record, problems: list[str] | None = None, draw: bool = True) -> tuple[str, Path, Path]:
    """The report's Markdown, its path and its plots' folder (``draw=False``: the same Markdown, no plot drawn,
    for tests that read the text alone)."""
    md, plots = rp.report_paths(tmp_path / "reports", record.run_id)
    out = rp.write_report(record, problems or [], md, plots, draw_plots=draw)
    assert out == md
    return md.read_text(encoding="utf-8"), md, plots


def test_full_run_renders_every_section_and_plot(tmp_path: Path) -> None:
    rec = make_run(pairs=True, rounds=3, arms=("A", "B", "C"))
    text, md, plots = render(tmp_path, rec)
    for heading in SECTIONS:
        assert heading in text, heading
    assert "**Gate: PASS**" in text
    assert "**Command:** `abbench run test`" in text
    for name in rp.PLOTS:
        png = plots / f"{name}.png"
        assert png.is_file() and is_png(png), name
        link = f"({rec.run_id}/{name}.png)"
        assert link in text  # relative to the .md
        assert (md.parent / rec.run_id / f"{name}.png").is_file()
    # human units
    assert "ms |" in text and " GB |" in text and " GiB |" in text and "x |" in text
    assert "1.9" in text and "x faster" in text
    assert "not drawn" not in text
    env = text.split("## Environment")[1].split("\n## ")[0]
    assert "- **GPU:** `NVIDIA H200`" in env and "- **PCIe link (GPU 0):** `Gen5 x16`" in env
    assert "- **torch:** `2.13.0`" in env and "- **Engine commit:** `0123abcd`" in env
    assert "gpus[0].name: `NVIDIA H200`" in env  # the full fingerprint, flattened


def test_arms_of_two_engines_are_shown_side_by_side_by_one_yardstick(tmp_path: Path) -> None:
    """A run whose arms speak two wire formats (the vendored engine and llama.cpp, say) gets one table with
    TTFT, the paired ratio, NVML's PCIe bytes and peak device memory for every arm (the engine's own counters
    beside them where it has them: llama.cpp reports none) and the decode rate; a run of one engine does not."""
    rec = make_run(arms=("A", "B"))
    rec.profile["arms"][1]["adapter"] = "llamacpp"
    for s in rec.samples:
        if s.arm == "B":
            s.engine = None  # llama.cpp: no transfer counters
    text, _, _ = render(tmp_path, rec, draw=False)
    side = text.split("## Engines side by side")[1].split("\n## ")[0]
    assert text.index("## Engines side by side") < text.index("## Paired ratios")
    rows = {(r[0], r[2]): r for r in ([c.strip() for c in line.strip("|").split("|")] for line in side.splitlines()
                                      if line.startswith("| A ") or line.startswith("| B "))}
    assert set(rows) == {("A", "1024"), ("A", "4096"), ("B", "1024"), ("B", "4096")}
    assert rows[("B", "4096")][1] == "llamacpp" and rows[("A", "4096")][1] == "openai"
    assert rows[("B", "4096")][4] == "0.514x" and rows[("A", "4096")][4] == "—"  # vs the reference, A
    assert rows[("B", "4096")][5].endswith(" GB") and rows[("B", "4096")][6] == "—"  # NVML yes, engine no
    assert rows[("A", "4096")][6].endswith(" GB")
    one, _, _ = render(tmp_path / "one", make_run(arms=("A", "B")), draw=False)
    assert "## Engines side by side" not in one
    assert "TTFT per arm and length](" in one.split("## Paired ratios")[0][-200:]  # no empty section between


def test_host_cpu_section_from_the_request_windows(tmp_path: Path) -> None:
    """The per-request host CPU figures become a per arm and length table; a run without them (recorded
    before they were measured) has no such section."""
    rec = make_run(arms=("A", "B"))
    for s in rec.samples:
        s.telemetry.host_cpu_busy = 0.25 if s.arm == "A" else 0.5
        s.telemetry.host_cpu_steal = 0.0 if s.arm == "A" else 0.125
        s.telemetry.service_cpu_s = 1.5 if s.arm == "A" else 4.0
    text, _, _ = render(tmp_path, rec, draw=False)
    sec = text.split("## Host CPU")[1].split("\n## ")[0]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in sec.splitlines() if line.startswith("| B ")]
    assert len(rows) == 2 and all(r[-3:] == ["50.0%", "12.5%", "4.00 s"] for r in rows), rows
    assert text.index("## Host CPU") < text.index("## Memory")
    plain, _, _ = render(tmp_path / "plain", make_run(arms=("A", "B")), draw=False)
    assert "## Host CPU" not in plain


def test_constant_columns_are_dropped_and_stated_once() -> None:
    df = pd.DataFrame({"arm": ["A", "B"], "kind": ["fresh", "fresh"], "median_s": [0.5, 0.5]})
    cols = [rp.Col("arm", "Arm", descriptive=True, right=False), rp.Col("kind", "Kind", descriptive=True),
            rp.Col("median_s", "Median", rp.fmt_s)]
    out = rp.table(df, cols)
    lines = out.splitlines()
    assert lines[0] == "Same in every row: Kind: fresh."
    assert lines[2] == "| Arm | Median |"  # the measured column stays even though it is constant
    assert lines[4] == "| A | 500.0 ms |"
    one = rp.table(df.head(1), cols)  # one row: nothing to compare, every column shown
    assert one.splitlines()[0] == "| Arm | Kind | Median |"
    assert rp.table(df.iloc[0:0], cols) == "_No rows._"
    assert "a \\| b" in rp.table(pd.DataFrame({"x": ["a | b"]}), [rp.Col("x", "X")])


def test_report_tables_drop_constant_columns(tmp_path: Path) -> None:
    text, _, _ = render(tmp_path, make_run(rounds=2, lengths=(1024, 4096)), draw=False)
    ttft = text.split("## TTFT per arm and prompt length")[1].split("##")[0]
    assert "Same in every row: Kind: fresh; n: 2" in ttft
    assert "| Arm | Prompt tokens | Median | Min | Max |" in ttft


def test_run_without_engine_nvml_or_memory_states_what_is_missing(tmp_path: Path) -> None:
    rec = make_run(engine=False, nvml=False, memory=False, gpu=False, logprobs=False,
                   gate={"require_active_path": False}, environment={})
    # a previous render left plots behind: they must not survive as if current
    _, plots = rp.report_paths(tmp_path / "reports", rec.run_id)
    plots.mkdir(parents=True)
    (plots / "h2d.png").write_bytes(b"stale")
    text, _md, plots = render(tmp_path, rec)
    for heading in SECTIONS:
        assert heading in text, heading
    assert "No H2D data" in text
    assert "client overhead is not measured" in text
    assert "No memory samples" in text
    assert "No environment fingerprint was recorded." in text
    assert "the engine reported no per-request object" in text
    assert "no NVML PCIe estimate" in text
    assert "no logprobs captured" in text
    assert "plot h2d.png not drawn" in text and "plot memory.png not drawn" in text
    assert not (plots / "h2d.png").exists() and not (plots / "memory.png").exists()
    assert is_png(plots / "ttft.png") and is_png(plots / "ratios.png")
    assert "**Gate: PASS**" in text


def test_cpu_only_run_plots_host_rss(tmp_path: Path) -> None:
    rec = make_run(gpu=False, nvml=False)
    text, _, plots = render(tmp_path, rec)
    assert is_png(plots / "memory.png")
    mem = text.split("## Memory")[1].split("\n## ")[0]
    assert "Host RSS peak" in mem and "62.00 GiB" in mem


def test_failing_partial_run_states_missing_data_and_failures(tmp_path: Path) -> None:
    rec = make_run(status="partial")
    rec.status_reason = "interrupted by the user"
    rec.samples.remove(find(rec, "B", "fresh-4096-0", 2))
    find(rec, "B", "fresh-1024-0", 1).output_ids[2] += 1
    text, _, _ = render(tmp_path, rec, problems=["requests.jsonl line 9: unreadable sample (3 errors); skipped"],
                        draw=False)
    assert "- **Status:** partial (interrupted by the user)" in text
    assert "**Gate: FAIL**" in text
    problems = text.split("## Problems and missing data")[1]
    assert "requests.jsonl line 9: unreadable sample" in problems
    assert "run status is partial: interrupted by the user" in problems
    assert "missing: prompt fresh-4096-0, arm B, round 2 (position 0), step" in problems
    assert "7/8 measured planned steps have an ok sample" in problems
    parity = text.split("## Parity")[1].split("\n## ")[0]
    assert "Rows that diverge anywhere or could not be checked:" in parity
    assert "| fresh-1024-0 | B | 1 | A r1 | no | 2 | 2/16 | 1.000 | 1.000 | divergence |" in parity


def test_fallback_and_near_tie_appear_in_tables(tmp_path: Path) -> None:
    rec = make_run(gate={"allow_fallback": ["B"]})
    s = find(rec, "B", "fresh-1024-0", 1)
    s.engine = {**(s.engine or {}), "prefill_path": "chunked", "fallback_reason": "single chunk"}
    text, _, _ = render(tmp_path, rec, draw=False)
    path = text.split("## Active path")[1].split("\n## ")[0]
    assert "layer-major ×3, chunked ×1" in path and "1 (1 one-chunk)" in path
    assert "single chunk ×1" in path
    assert "**Gate: PASS**" in text and "allowed fallback" in text


def test_empty_run_renders(tmp_path: Path) -> None:
    rec = make_run(memory=False)
    rec.samples = []
    text, _, plots = render(tmp_path, rec)
    for heading in SECTIONS:
        assert heading in text, heading
    assert "**Gate: FAIL**" in text
    assert "No measured ok sample with a TTFT" in text
    assert not list(plots.glob("*.png"))


def test_formatters() -> None:
    assert rp.fmt_s(0.0004) == "0.400 ms" and rp.fmt_s(0.0123) == "12.30 ms"
    assert rp.fmt_s(0.5234) == "523.4 ms" and rp.fmt_s(1.234) == "1234 ms" and rp.fmt_s(12.345) == "12.35 s"
    assert rp.fmt_gb(58e9) == "58.00 GB" and rp.fmt_gb(1.5e6) == "1.50 MB"
    assert rp.fmt_gib(20 * 2**30) == "20.00 GiB" and rp.fmt_gib(512 * 2**20) == "512.0 MiB"
    assert rp.fmt_ratio(0.5) == "0.500x"
    for f in (rp.fmt_s, rp.fmt_gb, rp.fmt_gib, rp.fmt_ratio, rp.fmt_int):
        assert f(None) == rp.DASH and f(float("nan")) == rp.DASH and f(pd.NA) == rp.DASH


def test_import_does_not_load_matplotlib() -> None:
    code = "import sys, abbench.report; assert 'matplotlib' not in sys.modules"
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


def test_the_header_says_when_every_arm_ran_on_this_hosts_cpu() -> None:
    """A run whose host has no GPU and whose servers it launched itself ran on the CPU: the header says so, and
    that its timings are not a GPU's. A GPU host, or an arm attached by base_url (a server elsewhere), does not
    get the line."""
    import copy

    from abbench.report.sections.summary import cpu_only
    from abbench.results import load_run

    repo = Path(__file__).resolve().parents[2]
    cpu, _ = load_run(repo / "results" / "readme-cpu-tiny")
    gpu, _ = load_run(repo / "results" / "20261129b-h200-qwen3-30b-a3b")
    assert cpu_only(cpu) and not cpu_only(gpu)
    assert "- **Device:** CPU only" in (repo / "reports" / "readme-cpu-tiny.md").read_text()
    assert "- **Device:**" not in (repo / "reports" / "20261129b-h200-qwen3-30b-a3b.md").read_text()
    attached = copy.deepcopy(cpu)
    attached.profile["arms"][1]["base_url"] = "http://127.0.0.1:8001"
    assert not cpu_only(attached)
    older = copy.deepcopy(cpu)
    older.environment.pop("gpus")  # a run that did not record the host's GPUs
    assert not cpu_only(older)
