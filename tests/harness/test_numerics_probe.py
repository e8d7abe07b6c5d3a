"""The numerics probe (``abbench probe RUN --numerics``) on a committed CPU run of ``cpu-tiny-fp8``
(``results/20261205t-cpu-tiny-fp8``): the vendored engine's bf16 arm (the run's parity reference) and its FP8 arm,
each served once from the run's recorded profile, asked for their whole distributions."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

pytest.importorskip("torch")

from abbench.client import EngineClient  # noqa: E402
from abbench.diagnostics.layers import serving  # noqa: E402
from abbench.diagnostics.numerics_probe import (  # noqa: E402
    format_numerics_summary,
    probe_numerics,
    probe_numerics_prompts,
)
from abbench.profile import profile_from_dict  # noqa: E402
from abbench.results import load_run  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
RUN = REPO / "results" / "20261205t-cpu-tiny-fp8"


@pytest.fixture(scope="module")
def urls():
    """The committed run's bf16 (its parity reference) and fp8 arms, each served once from its recorded profile."""
    record, _ = load_run(RUN, REPO / "results")
    profile = profile_from_dict(record.profile)
    with EngineClient() as client, contextlib.ExitStack() as stack:
        yield {arm: stack.enter_context(serving(profile, arm, client)) for arm in ("bf16", "fp8")}


def test_the_full_kl_is_at_least_the_runs_bound_and_zero_against_itself(urls, monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from abbench.cli import app

    record, _ = load_run(RUN, REPO / "results")
    got = probe_numerics(record, "fresh-256-0", "fp8", base_urls=urls, positions=3)
    assert (got.reference, got.vocab, got.k, len(got.steps)) == ("bf16", 151936, 20, 3)
    # FP8's rounding moves every distribution; the run's top-20 bucket bound is a lower bound of it
    assert all(s.kl > 0 and 0 <= s.kl_topk <= s.kl + 1e-12 for s in got.steps), got.steps
    assert [s.ref_id for s in got.steps] == next(
        s.output_ids[:3] for s in record.samples if s.arm == "bf16" and s.prompt_id == "fresh-256-0")
    itself = probe_numerics(record, "fresh-256-0", "bf16", base_urls=urls, positions=2)
    assert [(s.kl, s.kl_topk, s.same_top, s.delta_p) for s in itself.steps] == [(0.0, 0.0, 1, 0.0)] * 2
    # several prompts on the same two services: each prompt's histories from its own reference output
    both = probe_numerics_prompts(record, ["fresh-256-0", "fresh-512-0"], "fp8", base_urls=urls, positions=2)
    assert [b.prompt_id for b in both] == ["fresh-256-0", "fresh-512-0"] and both[0].steps[:2] == got.steps[:2]
    summary = format_numerics_summary(both)
    assert "2 prompts" in summary and "every compared position (4): mean KL over the whole vocabulary" in summary
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, ["probe", str(RUN), "--arm", "fp8", "--numerics", "--positions", "1",
                                 "--base-url", urls["fp8"], "--ref-base-url", urls["bf16"]])
    assert r.exit_code == 0, r.output
    out = " ".join(r.output.split())
    assert "--prompt fresh-256-0: arm fp8's first measured prompt" in out and "151,936 ids" in out
    assert f"mean KL over the whole vocabulary {got.steps[0].kl:.4e} nats" in out


def test_a_run_that_asks_for_whole_rows_records_their_kl_and_drops_them(urls, tmp_path: Path) -> None:
    """``request.full_logprobs``: a run against the two services (and the bf16 one again as a third arm) keeps
    each measured sample's whole first row aside, records the whole-vocabulary KL of every sample against every
    reference sample of its prompt, and drops the rows when complete; nothing of a row reaches requests.jsonl.
    FP8's KL is at least the run's own top-20 bound at that position; bf16 against itself is exactly 0; the
    declared check ``kl_vocab_mean`` is judged on it and the report shows it."""
    import json

    from abbench import runner
    from abbench.analysis.numerics import numerics_positions, numerics_table
    from abbench.report import write_report

    prof = {"name": "whole-rows", "tokenizer": {"source": "qwen3"},
            "prompts": {"lengths": [96], "per_length": 2, "warmup": 0},
            "request": {"max_tokens": 4, "logprobs": 20, "full_logprobs": True, "timeout_s": 60},
            "engine": {"reset_path": "/reset", "metrics_path": "/metrics"},
            "arms": [{"name": "bf16", "base_url": urls["bf16"]}, {"name": "again", "base_url": urls["bf16"]},
                     {"name": "fp8", "base_url": urls["fp8"], "parity": "numerics"}],
            "run": {"rounds": 2, "reference": "bf16"},
            "gate": {"parity_tokens": 4, "checks": ["kl_vocab_mean[fp8] <= 0.5", "kl_mean[fp8] <= 0.5"]}}
    run_dir = tmp_path / "run"
    record = runner.execute(profile_from_dict(prof), run_dir)
    assert record.status == "complete" and not (run_dir / "rows").exists()
    assert "full_logprobs" not in (run_dir / "requests.jsonl").read_text()
    saved = json.loads((run_dir / "run.json").read_text())["vocab_kl"]
    arm_of = {s.step: s.arm for s in record.samples}
    # every sample against both of its prompt's reference samples, less a reference sample against itself
    assert len(saved) == 3 * 2 * 2 * 2 - 2 * 2 and {v["vocab"] for v in saved} == {151936}
    assert all(v["kl"] == 0.0 for v in saved if arm_of[v["step"]] != "fp8"), saved
    fp8 = [v for v in saved if arm_of[v["step"]] == "fp8"]
    assert all(v["kl"] > 0 for v in fp8)
    pos = numerics_positions(record, ["fp8"])
    first = pos[pos["position"] == 0]
    assert first["kl_vocab"].notna().all() and (pos[pos["position"] > 0]["kl_vocab"].isna()).all()
    assert (first["kl"] <= first["kl_vocab"] + 1e-12).all(), first[["kl", "kl_vocab"]]
    table = numerics_table(record)
    row = table[table["arm"] == "fp8"].iloc[0]
    assert row["kl_vocab_pairs"] == 4 and row["kl_vocab_mean"] == pytest.approx(first["kl_vocab"].mean())
    from abbench.analysis.declared import judge, parse_check

    cells = judge(record, parse_check("kl_vocab_mean[fp8] <= 0.5"))
    assert [(c.status, c.n) for c in cells] == [("pass", 4)], cells
    assert cells[0].value == pytest.approx(first["kl_vocab"].mean())
    md = write_report(record, [], tmp_path / "r.md", tmp_path / "r", draw_plots=False).read_text()
    assert "Whole-vocabulary KL, first position (nats)" in md and "`request.full_logprobs`" in md
