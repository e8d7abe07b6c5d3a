"""Output for machines: `--json` on gate, compare, profiles and prompts (documents whose fields docs/json.md
lists), `abbench export --csv` (one row per sample) and `abbench --version`; on the committed runs and the
compare fixtures."""

from __future__ import annotations

import io
import json
import re
import tomllib
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

import abbench
from abbench.cli import app
from abbench.results import load_run

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "results"
FIXTURES = REPO / "tests" / "support" / "fixtures" / "compare"
cli = CliRunner()


def document(args: list[str], exit_code: int = 0) -> dict:
    r = cli.invoke(app, args)
    assert r.exit_code == exit_code, r.output
    return json.loads(r.stdout)


def test_version() -> None:
    r = cli.invoke(app, ["--version"])
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert r.exit_code == 0 and r.stdout == f"abbench {abbench.__version__}\n" and abbench.__version__ == pyproject


def test_gate_json_passes_and_fails_as_the_gate_does() -> None:
    ok = document(["gate", str(RESULTS / "readme-cpu-tiny"), "--json"])
    assert ok["schema"] == "abbench.gate/1" and ok["passed"] is True and ok["exit_code"] == 0
    assert ok["run"]["run_id"] == "readme-cpu-tiny" and ok["run"]["profile"] == "cpu-tiny"
    assert [c["name"] for c in ok["checks"]][:2] == ["run-complete", "samples"] and ok["declared"] == []
    assert ok["notes"] and ok["failures"] == []
    bad = document(["gate", str(RESULTS / "20261130-h200-qwen3-30b-a3b"), "--checks-from", "h200-qwen3-30b-a3b",
                    "--json"], exit_code=1)
    assert bad["passed"] is False and bad["exit_code"] == 1
    x_floor = next(d for d in bad["declared"] if d["metric"] == "x_floor")
    cell = next(c for c in x_floor["cells"] if c["tokens"] == 16384)
    assert cell["status"] == "inconclusive" and round(cell["value"], 3) == 1.139 and cell["low"] < 1.15 < cell["high"]
    assert any(f.startswith("x_floor[layer-major, fresh] <= 1.15: fresh 16384: inconclusive") for f in bad["failures"])
    # a bad expression is a usage error: exit 2, a message, no document
    r = cli.invoke(app, ["gate", str(RESULTS / "readme-cpu-tiny"), "--check", "ttft_ratio <= 0.15", "--json"])
    assert r.exit_code == 2 and r.stdout == "" and "not of the form" in r.stderr


def test_compare_json() -> None:
    same = document(["compare", str(FIXTURES / "base"), str(FIXTURES / "cand"), "--json"])
    assert same["schema"] == "abbench.compare/1" and same["regressions"] == 0 and same["exit_code"] == 0
    assert same["base"]["run_id"] == "base" and same["candidate"]["run_id"] == "cand"
    assert len(same["cells"]) == 30 and {c["metric"] for c in same["cells"]} == {"ttft_s", "decode_tok_s", "h2d_bytes"}
    drift = document(["compare", str(FIXTURES / "cand"), str(FIXTURES / "base"), "--json"], exit_code=1)
    regs = [c for c in drift["cells"] if c["regression"]]
    assert drift["regressions"] == len(regs) == 5 and all(c["ci_low"] > 0.05 or c["ci_high"] < -0.05 for c in regs)
    assert any("Every arm moved the worse way" in n for n in drift["notes"])
    r = cli.invoke(app, ["compare", str(RESULTS / "readme-cpu-tiny"), str(RESULTS / "cpu-tiny-auto"), "--json"])
    assert r.exit_code == 2 and r.stdout == "" and "different profiles" in r.stderr


def test_profiles_json_and_names_never_cut() -> None:
    doc = document(["profiles", "--json"])
    names = {p["name"]: p for p in doc["profiles"]}
    assert doc["schema"] == "abbench.profiles/1" and doc["search"][-1]["source"] == "bundled"
    assert names["cpu-tiny"]["arms"] == ["chunked", "layer-major", "demand"] and names["cpu-tiny"]["error"] is None
    longest = max(names, key=len)
    assert longest == "h200-qwen3-30b-a3b-giant-chunk-128k"
    narrow = cli.invoke(app, ["profiles"], env={"COLUMNS": "60"})
    assert narrow.exit_code == 0 and re.search(rf"\b{re.escape(longest)}\b", narrow.stdout)
    assert re.search(r"cpu-tiny .*bundled", narrow.stdout)  # what CI greps


def test_prompts_json() -> None:
    doc = document(["prompts", "--lengths", "256,512", "--json"])
    assert doc["schema"] == "abbench.prompts/1" and doc["profile"] == "cpu-tiny" and doc["tokenizer"] == "qwen3"
    fresh = [p for p in doc["prompts"] if p["kind"] == "fresh"]
    assert [p["target_tokens"] for p in fresh] == [256, 512]
    assert all(p["token_count"] == p["target_tokens"] and len(p["sha256"]) == 64 for p in doc["prompts"])
    assert doc["total_tokens"] == sum(p["token_count"] for p in doc["prompts"])


def test_export_csv_one_row_per_sample(tmp_path: Path) -> None:
    run = RESULTS / "readme-cpu-tiny"
    record, _ = load_run(run)
    r = cli.invoke(app, ["export", str(run), "--csv"])
    assert r.exit_code == 0, r.output
    df = pd.read_csv(io.StringIO(r.stdout))
    assert len(df) == len(record.samples) and set(df["run_id"]) == {"readme-cpu-tiny"}
    assert list(df["ttft_s"]) == pytest.approx([s.ttft_s for s in record.samples])
    assert df["output_ids"].iloc[0].split() == [str(i) for i in record.samples[0].output_ids]
    assert {"measured", "ok", "decode_tok_s", "tpot_s", "h2d_bytes", "prefill_path"} <= set(df.columns)
    out = tmp_path / "x" / "samples.csv"
    assert cli.invoke(app, ["export", str(run), "--csv", "--out", str(out)]).exit_code == 0
    assert pd.read_csv(out).shape == df.shape
    r = cli.invoke(app, ["export", str(run)])
    assert r.exit_code == 2 and "choose a format: --csv" in r.output


def _documented(section: str) -> set[str]:
    """The field names a section's table in docs/json.md names (in backticks), and those of a run."""
    text = (REPO / "docs" / "json.md").read_text()
    run = text.split("A run, wherever", 1)[1].split("\n## ", 1)[0]
    text = text.split(f"## `{section}", 1)[1].split("\n## ", 1)[0]
    names = set()
    for row in re.findall(r"(?m)^\|.*\|$", text + run):
        for span in re.findall(r"`([^`]+)`", row):
            names |= set(re.findall(r"[a-z_][a-z_0-9]*", span))
    return names


@pytest.mark.parametrize("section, args, code", [
    ("abbench gate --json", ["gate", str(RESULTS / "cpu-tiny-auto"), "--json"], 0),
    ("abbench compare --json", ["compare", str(FIXTURES / "base"), str(FIXTURES / "cand"), "--json"], 0),
    ("abbench profiles --json", ["profiles", "--json"], 0),
    ("abbench prompts --json", ["prompts", "--json"], 0),
])
def test_docs_json_lists_every_field(section: str, args: list[str], code: int) -> None:
    doc = document(args, code)
    documented = _documented(section)
    assert set(doc) <= documented, f"{section}: undocumented fields {set(doc) - documented}"
    nested = {"gate": ("checks", "declared"), "compare": ("cells",), "profiles": ("profiles", "search"),
              "prompts": ("prompts",)}[section.split()[1]]
    for key in nested:
        items = doc[key] if key != "declared" else [c for d in doc["declared"] for c in d["cells"]] + doc["declared"]
        for item in items + [doc.get("run") or doc.get("base") or {}]:
            assert set(item) <= documented, f"{section} {key}: undocumented fields {set(item) - documented}"


def test_gate_json_declares_the_profiles_own_checks_as_well_as_the_given_ones() -> None:
    """`gate --json`'s `declared` holds the run's profile's `[gate] checks` (judged by the gate as well), then
    those given with --check: a document listing only --check would hide what the verdict rests on."""
    run = RESULTS / "cpu-tiny-auto"
    own = json.loads((run / "run.json").read_text())["profile"]["gate"]["checks"]
    assert len(own) == 3
    doc = json.loads(cli.invoke(app, ["gate", str(run), "--json"]).stdout)
    assert [d["check"] for d in doc["declared"]] == own
    assert all(d["cells"] for d in doc["declared"])  # each judged on the run's cells
    extra = "ttft_ratio[layer-major, cold] <= 3"
    r = cli.invoke(app, ["gate", str(run), "--check", extra, "--json"])
    doc = json.loads(r.stdout)
    assert [d["check"] for d in doc["declared"]] == own + [extra]
    assert r.exit_code == doc["exit_code"]
    names = [c["name"] for c in doc["checks"]]
    assert all(any(x in n for n in names) for x in own + [extra]), names  # the verdict's checks: the same ones


def test_export_csv_tpot_is_the_reports_definition(tmp_path: Path) -> None:
    """`export --csv`'s tpot_s = (total - TTFT) / (output tokens - 1), computed here from run.json's own
    fields, and the same values the report's latency table takes its TPOT from; empty for one output token."""
    from abbench.analysis.latency import tpot_values

    src = RESULTS / "readme-cpu-tiny"
    run = json.loads((src / "run.json").read_text())
    one = next(i for i, s in enumerate(run["samples"]) if s["ok"] and s["ttft_s"] is not None)
    run["samples"][one]["completion_tokens"] = 1  # one output token: no TPOT
    dst = tmp_path / "run"
    dst.mkdir()
    (dst / "run.json").write_text(json.dumps(run))
    (dst / "requests.jsonl").write_text("".join(json.dumps(s) + "\n" for s in run["samples"]))
    r = cli.invoke(app, ["export", str(dst), "--csv"])
    assert r.exit_code == 0, r.output
    df = pd.read_csv(io.StringIO(r.stdout))
    assert len(df) == len(run["samples"])
    checked = 0
    for s, (_, row) in zip(run["samples"], df.iterrows()):
        tok = s.get("completion_tokens")
        if s.get("total_s") is None or s.get("ttft_s") is None or not tok or tok <= 1:
            assert pd.isna(row["tpot_s"]), (s["step"], row["tpot_s"])
            continue
        assert row["tpot_s"] == pytest.approx((s["total_s"] - s["ttft_s"]) / (tok - 1), rel=1e-12)
        checked += 1
    assert checked > 20 and pd.isna(df["tpot_s"].iloc[one])
    record = load_run(dst)[0]
    report = sorted(tpot_values(record)["value"].round(12))
    measured = df[df["measured"].astype(bool) & df["ok"].astype(bool) & df["tpot_s"].notna()]
    assert sorted(measured["tpot_s"].round(12)) == report
