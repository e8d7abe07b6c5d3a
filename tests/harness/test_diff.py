"""Divergence diagnostics: `abbench diff` aligns two arms' ids and classifies the first divergence; `abbench
probe` feeds an arm the reference's ids and finds where its own choice changes. Unit tests on a synthetic
run, then a real run against a fake SGLang server whose second arm flips one near-tied choice."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from abbench.diagnostics.diff import diff_prompt, format_diff, format_probe, logprob_delta
from abbench.diagnostics.probe import probe_prompt
from abbench.errors import ConfigError
from abbench.results import PromptRecord, RunRecord, Sample, save_run

from tests.support import fake_engines

FAKE_ENGINES = Path(fake_engines.__file__).resolve()


# ------------------------------------------------------------------------------------ a synthetic run


def sample(step: int, arm: str, rnd: int, ids: list[int], *, prompt: str = "p", margins: list[float] | None = None,
           kind: str = "fresh", excluded: bool = False) -> Sample:
    lps = None
    if margins is not None:
        lps = [[(i, -0.1), (i + 1, -0.1 - m)] for i, m in zip(ids, margins)]
    return Sample(step=step, arm=arm, round=rnd, position=0, prompt_id=prompt, kind=kind, excluded=excluded,
                  service=f"{arm}@r{rnd}", ok=True, started_at=time.time(), ttft_s=0.01, total_s=0.02,
                  output_ids=ids, ids_source="native", finish_reason="length", prompt_tokens=10,
                  completion_tokens=len(ids), saw_done=True, logprobs=lps)


def record(samples: list[Sample]) -> RunRecord:
    prompts = [PromptRecord(id="p", kind="fresh", target_tokens=10, token_count=10, sha256="0" * 64, corpus="essays"),
               PromptRecord(id="warmup-0", kind="warmup", target_tokens=4, token_count=4, sha256="1" * 64,
                            corpus="essays")]
    return RunRecord(run_id="synthetic", status="complete", created_at=time.time(), abbench_version="test",
                     profile={"name": "x", "arms": [{"name": "ref"}, {"name": "b"}, {"name": "c"}],
                              "run": {"reference": "ref"}, "request": {"max_tokens": 6}},
                     prompts=prompts, samples=samples)


REF = [1, 2, 3, 4, 5, 6]


@pytest.fixture
def run() -> RunRecord:
    return record([
        sample(0, "ref", 1, REF, margins=[1, 1, 1, 0.5, 1, 1]),
        sample(1, "b", 1, REF, margins=[1] * 6),  # identical in round 1
        sample(2, "c", 1, REF, margins=[1] * 6),
        sample(3, "ref", 2, REF, margins=[1, 1, 1, 0.5, 1, 1]),
        sample(4, "b", 2, [1, 2, 3, 9, 8, 7], margins=[1, 1, 1, 0.01, 1, 1]),  # flips a near tie at 3
        sample(5, "c", 2, [1, 2, 30, 40, 50, 60], margins=[1, 1, 0.9, 1, 1, 1]),  # a clear divergence at 2
        sample(6, "ref", 1, [7, 7], prompt="warmup-0", kind="warmup", excluded=True),
        sample(7, "b", 1, [7, 8], prompt="warmup-0", kind="warmup", excluded=True),
    ])


def test_diff_finds_the_divergence(run: RunRecord) -> None:
    d = diff_prompt(run, "p")  # default: the first arm and lowest round that differ
    assert (d.arm, d.ref_round, d.arm_round) == ("b", 2, 2)
    assert d.first_diverging == 3 and d.agree == 3 and d.classification == "near-tie"
    p = d.positions[3]
    assert (p.ref.id, p.arm.id) == (4, 9) and p.ref.margin == pytest.approx(0.5) and p.arm.margin == pytest.approx(0.01)
    assert [q.same for q in d.positions] == [True, True, True, False, False, False]
    c = diff_prompt(run, "p", arm="c")
    assert (c.first_diverging, c.classification) == (2, "divergence")


def test_diff_explicit_round_and_identical(run: RunRecord) -> None:
    d = diff_prompt(run, "p", arm="b", round=1)
    assert d.first_diverging is None and d.classification == "identical" and d.agree == 6


def test_diff_uses_excluded_samples_with_a_note(run: RunRecord) -> None:
    d = diff_prompt(run, "warmup-0")
    assert d.first_diverging == 1 and any("excluded" in n for n in d.notes)


def test_diff_errors(run: RunRecord) -> None:
    with pytest.raises(ConfigError, match="no prompt 'nope'.*prompts are p, warmup-0"):
        diff_prompt(run, "nope")
    with pytest.raises(ConfigError, match="no arm 'zzz'.*arms are ref, b, c"):
        diff_prompt(run, "p", arm="zzz")
    with pytest.raises(ConfigError, match="is the reference arm"):
        diff_prompt(run, "p", arm="ref")
    with pytest.raises(ConfigError, match="arm c has no ok sample"):
        diff_prompt(run, "warmup-0", arm="c")
    with pytest.raises(ConfigError, match="in round 3"):
        diff_prompt(run, "p", round=3)


def test_format_diff(run: RunRecord) -> None:
    text = format_diff(diff_prompt(run, "p"))
    lines = text.splitlines()
    assert "first divergence at position 3 (agree 3/6)" in lines[1] and "near-tie" in lines[1]
    marked = [ln for ln in lines if ln.startswith(">>")]
    assert len(marked) == 1 and marked[0].split()[1:3] == ["3", "4"]
    assert sum(ln.startswith("!") for ln in lines) == 2
    short = format_diff(diff_prompt(run, "p"), context=1)
    assert "positions 2..4 of 0..5" in short


def test_logprob_delta() -> None:
    assert logprob_delta([(1, -0.1), (2, -0.5)], [(2, -0.4), (1, -0.1)]) == pytest.approx(0.1)
    assert logprob_delta([(1, -0.1)], [(2, -0.1)]) == float("inf")
    assert logprob_delta(None, [(1, 0.0)]) is None


# ------------------------------------------------------------------- a real run with a near-tie flip


@pytest.fixture(scope="module")
def flip_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, RunRecord]]:
    """SGLang fakes: arm `b` flips a near-tied choice when the history is 99 tokens long, i.e. at output
    position 3 of the 96-token prompt (the shorter prompts never get there)."""
    from abbench import runner
    from abbench.profile import profile_from_dict

    command = [sys.executable, str(FAKE_ENGINES), "--engine", "sglang", "--port", "{port}", "--enable-metrics"]
    profile = profile_from_dict({
        "name": "flip", "tokenizer": {"source": "qwen3"},
        "prompts": {"lengths": [96], "pairs": [{"cold": 48, "extend": 16}], "warmup": 1, "warmup_tokens": 16},
        "request": {"max_tokens": 8, "logprobs": 2, "timeout_s": 30},
        "engine": {"adapter": "sglang", "command": command, "health_timeout_s": 30},
        "arms": [{"name": "a"}, {"name": "b", "args": ["--flip-at-length", "99"]}],
        "run": {"rounds": 2},
    })
    run_dir = tmp_path_factory.mktemp("flip") / "run"
    rec = runner.execute(profile, run_dir)
    assert rec.status == "complete"
    yield run_dir, rec


def test_parity_classifies_the_flip(flip_run: tuple[Path, RunRecord]) -> None:
    from abbench import analysis

    _, rec = flip_run
    parity = analysis.parity_frame(rec)
    rows = parity[(parity["check"] == "parity") & (parity["prompt_id"] == "fresh-96-0")]
    assert len(rows) == 2
    assert list(rows["first_diverging"]) == [3, 3] and list(rows["classification"]) == ["near-tie"] * 2
    assert rows["margin"].iloc[0] == pytest.approx(0.002) and rows["margin_against"].iloc[0] == pytest.approx(1.0)
    others = parity[(parity["check"] == "parity") & (parity["prompt_id"] != "fresh-96-0")]
    assert set(others["classification"]) == {"identical"}


def test_diff_command(flip_run: tuple[Path, RunRecord]) -> None:
    from abbench.cli import app

    run_dir, _ = flip_run
    res = CliRunner().invoke(app, ["diff", str(run_dir), "--prompt", "fresh-96-0"])
    assert res.exit_code == 0, res.output
    assert "first divergence at position 3 (agree 3/8)" in res.output and "near-tie" in res.output
    assert any(ln.startswith(">>  3") for ln in res.output.splitlines())
    bad = CliRunner().invoke(app, ["diff", str(run_dir), "--prompt", "fresh-96-0", "--arm", "zzz"])
    assert bad.exit_code == 2 and "no arm 'zzz'" in bad.output


def test_probe_launches_the_arm_and_finds_the_flip(flip_run: tuple[Path, RunRecord]) -> None:
    run_dir, rec = flip_run
    p = probe_prompt(rec, "fresh-96-0", "b")
    assert [s.index for s in p.steps] == list(range(8))
    change = p.first_choice_change
    assert change is not None and change.index == 3 and change.probe_margin == pytest.approx(0.002)
    assert [s.same for s in p.steps] == [True, True, True, False, True, True, True, True]  # one flip, not a drift
    assert p.first_over_threshold is change and p.steps[0].delta == 0.0
    assert p.free_run_divergence == 3 and p.free_run_arm_id == change.probe_id
    text = format_probe(p)
    assert "the probe reproduces it" in text and "near-tie" in text


def test_probe_against_a_running_server(flip_run: tuple[Path, RunRecord]) -> None:
    """--base-url: the same probe against a server already running (here the reference's own config: no
    flip, so the reference is consistent with itself everywhere)."""
    from abbench.cli import app

    run_dir, rec = flip_run
    with fake_engines.FakeEngine(fake_engines.FakeEngineConfig("sglang")) as eng:
        p = probe_prompt(rec, "fresh-96-0", "b", base_url=eng.base_url, positions=5, reset_each=True)
        assert len(p.steps) == 5 and p.first_choice_change is None and p.first_over_threshold is None
        assert eng.stats()["resets"] == 5
        res = CliRunner().invoke(app, ["probe", str(run_dir), "--prompt", "fresh-96-0", "--arm", "b",
                                       "--base-url", eng.base_url, "--positions", "4"])
    assert res.exit_code == 0, res.output
    assert "chooses the reference's token at every probed position" in res.output
    with pytest.raises(ConfigError, match="no arm 'zzz'"):
        probe_prompt(rec, "fresh-96-0", "zzz", base_url="http://127.0.0.1:9")


def test_diff_of_a_saved_synthetic_run(run: RunRecord, tmp_path: Path) -> None:
    """The command on a run whose tokenizer is the built-in one (token texts decoded)."""
    from abbench.cli import app

    run.profile["tokenizer"] = {"source": "qwen3"}
    save_run(tmp_path / "r", run)
    res = CliRunner().invoke(app, ["diff", str(tmp_path / "r"), "--prompt", "p", "--arm", "c"])
    assert res.exit_code == 0, res.output
    assert "first divergence at position 2" in res.output and "divergence" in res.output
    assert '"#"' in res.output  # id 2 decodes to "#" in the Qwen vocabulary
