"""Properties of the verdicts users act on, each stated so that a plausible slip in the code breaks it:

* ``abbench compare`` judges a regression on the change's interval, not its point estimate, and one
  regression is enough to exit 1;
* the report's "Verdict per prompt" shows the worst verdict over a prompt's rounds, whichever round it was;
* every kind the profile's ``run.exclude_kinds`` names stays out of every table, check and gate verdict (the
  runner marks it excluded, and nothing downstream reads an excluded sample);
* llama.cpp's refetch of ids that a stream left out accepts a repeat only when it holds every streamed id in
  order.

The runs are built by ``tests/harness/test_analysis.py``'s ``make_run`` (complete, clean records) with the
numbers each property needs, or made by the real runner against the loopback fake engine.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from abbench import analysis as an
from abbench import report as rp
from abbench.cli import app
from abbench.client import EngineClient
from abbench.errors import RequestError
from abbench.profile import RequestSpec
from abbench.results import RunRecord, save_run

from tests.harness.test_analysis import find, make_run
from tests.support import mdtables

cli = CliRunner()

# ---------------------------------------------------------------------------------------------- compare

ROUNDS = 8  # samples per cell and side: enough for any bootstrap (and for "too few to judge" rules)
BASE = 1 + np.array([-4, -2, -1, 0, 0.5, 1, 2, 4]) * 1e-3  # a tight spread around 1
NOISE = np.array([3, -3, 1.5, -1, -2.5, 0.5, 2, -0.5]) * 1e-3  # another tight spread, not a copy of BASE's
CLEAR_8 = 1.08 + NOISE  # +8%, the whole interval within about [+7.6%, +8.4%]
WIDE_10 = np.array([1.015, 1.025, 1.035, 1.09, 1.11, 1.165, 1.175, 1.185])  # median +10%, interval ~[+2.5%, +17%]
FASTER = 0.7 + NOISE


def timed_run(ttft: dict[tuple[str, int], np.ndarray], decode_s: dict[tuple[str, int], np.ndarray] | None = None
              ) -> RunRecord:
    """A clean run of arms A and B at 1024 and 4096 tokens, ``ROUNDS`` rounds, whose measured TTFT (and decode
    time) in round r of a cell (arm, length) is ``values[r - 1]``; decode 0.3 s unless given."""
    rec = make_run(rounds=ROUNDS, lengths=(1024, 4096))
    for s in rec.samples:
        if s.excluded:
            continue
        key = (s.arm, int(s.prompt_id.split("-")[1]))
        s.ttft_s = float(ttft[key][s.round - 1])
        s.total_s = s.ttft_s + (float(decode_s[key][s.round - 1]) if decode_s and key in decode_s else 0.3)
    return rec


def write(record: RunRecord, run_dir: Path) -> Path:
    save_run(run_dir, record)
    return run_dir


def compare_cli(base: RunRecord, cand: RunRecord, tmp_path: Path, *args: str):
    b, c = write(base, tmp_path / "base"), write(cand, tmp_path / "cand")
    return cli.invoke(app, ["compare", str(b), str(c), *args])


def regressions(base: RunRecord, cand: RunRecord, threshold: float = 0.05) -> set[tuple[str, int, str]]:
    from abbench.compare import compare

    regs = compare(base, cand, threshold=threshold).regressions
    return {(r.arm, int(r.target_tokens), r.metric) for r in regs.itertuples()}


BASE_TTFT = {("A", 1024): BASE, ("A", 4096): BASE * 4, ("B", 1024): BASE * 0.5, ("B", 4096): BASE * 2}


def test_one_regression_judged_on_its_interval_is_enough_to_exit_1(tmp_path: Path) -> None:
    """Four cells: +8% with its whole interval beyond 5% (the one regression), +10% at the median with an
    interval reaching below 5% (not one), 30% faster, and unchanged."""
    base = timed_run(BASE_TTFT)
    cand = timed_run({("A", 1024): CLEAR_8, ("A", 4096): WIDE_10 * 4, ("B", 1024): FASTER * 0.5,
                      ("B", 4096): BASE * 2})
    assert regressions(base, cand) == {("A", 1024, "ttft_s")}
    r = compare_cli(base, cand, tmp_path)
    assert r.exit_code == 1, r.output
    # the threshold moves the judgement: at 10% no interval lies wholly beyond it
    assert regressions(base, cand, 0.10) == set()
    r = cli.invoke(app, ["compare", str(tmp_path / "base"), str(tmp_path / "cand"), "--threshold", "0.1"])
    assert r.exit_code == 0, r.output


def test_a_median_past_the_threshold_with_an_interval_across_it_is_not_a_regression(tmp_path: Path) -> None:
    base = timed_run(BASE_TTFT)
    cand = timed_run({**BASE_TTFT, ("A", 4096): WIDE_10 * 4})
    assert float(np.median(WIDE_10)) - 1 > 0.05  # the point change is past the threshold
    assert regressions(base, cand) == set()
    r = compare_cli(base, cand, tmp_path)
    assert r.exit_code == 0, r.output


def test_a_lower_decode_rate_is_the_regression_a_higher_one_is_not(tmp_path: Path) -> None:
    """Decode rate: lower is worse (TTFT: higher is worse). 25% more decode time is a 20% lower rate."""
    slow, fast = {("B", 4096): 0.3 * (1.25 + NOISE)}, {("B", 4096): 0.3 * (0.8 + NOISE)}
    base = timed_run(BASE_TTFT, {("B", 4096): 0.3 * BASE})
    assert regressions(base, timed_run(BASE_TTFT, slow)) == {("B", 4096, "decode_tok_s")}
    assert regressions(base, timed_run(BASE_TTFT, fast)) == set()
    assert compare_cli(base, timed_run(BASE_TTFT, slow), tmp_path / "slow").exit_code == 1
    assert compare_cli(base, timed_run(BASE_TTFT, fast), tmp_path / "fast").exit_code == 0


def test_same_is_said_only_of_the_same_samples(tmp_path: Path) -> None:
    """"same" (and "identical in every sample of both runs") means both runs hold the same values: a
    candidate with the base's median but another spread is not the same, a reordering of the base's is."""
    from abbench.compare import compare

    stretched = BASE.copy()  # the same middle values (so the same median), tails 20x as long
    stretched[[0, 1, 6, 7]] = 1 + (BASE[[0, 1, 6, 7]] - 1) * 20
    assert float(np.median(stretched)) == float(np.median(BASE))
    base = timed_run(BASE_TTFT)
    c = compare(base, timed_run({**BASE_TTFT, ("A", 1024): stretched}))
    row = c.changes[(c.changes["arm"] == "A") & (c.changes["target_tokens"] == 1024)
                    & (c.changes["metric"] == "ttft_s")].iloc[0]
    assert row["verdict"] != "same" and "TTFT" not in " ".join(c.identical), (row["verdict"], c.identical)
    c = compare(base, timed_run({**BASE_TTFT, ("A", 1024): BASE[::-1]}))
    assert (c.changes[c.changes["metric"] == "ttft_s"]["verdict"] == "same").all()


@pytest.mark.parametrize("short", ["base", "cand"])
def test_a_cell_too_few_to_judge_on_either_side_is_never_a_regression(short: str, tmp_path: Path) -> None:
    """A cell that one run holds only two ok samples of (the others failed) is "too few to judge" however
    clear its change looks, whichever run is short; the other cells are judged as usual."""
    from abbench.compare import MIN_N, TOO_FEW, compare

    base, cand = timed_run(BASE_TTFT), timed_run({**BASE_TTFT, ("A", 1024): 1.5 + NOISE, ("B", 4096): CLEAR_8 * 2})
    for s in (base if short == "base" else cand).samples:
        if s.arm == "A" and s.prompt_id.startswith("fresh-1024") and s.round > MIN_N - 1:
            s.ok, s.error_kind, s.error = False, "timeout", "no answer"
    c = compare(base, cand)
    row = c.changes[(c.changes["arm"] == "A") & (c.changes["target_tokens"] == 1024)
                    & (c.changes["metric"] == "ttft_s")].iloc[0]
    assert row["verdict"].startswith(TOO_FEW) and not row["regression"], row.to_dict()
    assert regressions(base, cand) == {("B", 4096, "ttft_s")}


@pytest.mark.parametrize("field", ["vocab_sha256", "normalizer"])
@pytest.mark.parametrize("missing_in", ["base", "cand"])
def test_a_tokenizer_fact_recorded_in_one_run_only_refuses(field: str, missing_in: str) -> None:
    """A tokenizer described by one run and not the other cannot be shown to be the same tokenizer: the
    comparison is refused (exit 2), naming the field, as for a tokenizer that differs."""
    from abbench.compare import CompareRefused, compare

    tok = {"source": "qwen3", "class": "Qwen2TokenizerFast", "vocab_size": 151669, "vocab_sha256": "a" * 64,
           "normalizer": "NFC"}
    base, cand = timed_run(BASE_TTFT), timed_run(BASE_TTFT)
    for rec in (base, cand):
        rec.environment = {**rec.environment, "tokenizer": dict(tok)}
    compare(base, cand)  # the same description: compared
    del (base if missing_in == "base" else cand).environment["tokenizer"][field]
    with pytest.raises(CompareRefused, match=f"the tokenizers differ \\({field}"):
        compare(base, cand)


# -------------------------------------------------------------------------------- verdict per prompt


VERDICT_ORDER = ["equal", "near-tie flip", "broken"]


def _per_prompt(record: RunRecord) -> dict[tuple[str, str], dict[str, str]]:
    md = rp.render_markdown(record, [], an.analyze(record), {}, {})
    parity = mdtables.sections(md)["Parity"]
    part = parity.split("Verdict per prompt", 1)[1]
    rows = mdtables.tables(part)[0]
    return {(r["Prompt"], r["Arm"]): r for r in rows}


def _break(rec: RunRecord, rnd: int, how: str, prompt: str = "fresh-1024-0", pos: int = 3) -> None:
    """Make arm B's sample of ``prompt`` in round ``rnd`` diverge from A's at ``pos``: 'broken' (another token
    with a clear margin) or 'near-tie flip' (each side's choice is the other's runner-up, 0.01 nats apart)."""
    b, a = find(rec, "B", prompt, rnd), find(rec, "A", prompt, rnd)
    ref = a.output_ids[pos]
    b.output_ids = list(b.output_ids)
    if how == "broken":
        b.output_ids[pos] = ref + 1000
        return
    b.output_ids[pos] = ref + 1
    a.logprobs = [list(x) for x in a.logprobs]
    b.logprobs = [list(x) for x in b.logprobs]
    a.logprobs[pos] = [(ref, -0.69), (ref + 1, -0.70)]
    b.logprobs[pos] = [(ref + 1, -0.69), (ref, -0.70)]


@pytest.mark.parametrize("verdicts", [
    ("broken", "equal", "equal"), ("equal", "broken", "equal"), ("equal", "equal", "broken"),
    ("near-tie flip", "broken", "equal"), ("equal", "near-tie flip", "equal"), ("broken", "near-tie flip", "equal"),
], ids=lambda v: "-".join(x.replace(" ", "") for x in v))
def test_a_prompt_shows_its_worst_round(verdicts: tuple[str, ...]) -> None:
    rec = make_run(rounds=len(verdicts), lengths=(1024, 4096))
    for rnd, how in enumerate(verdicts, 1):
        if how != "equal":
            _break(rec, rnd, how)
    rows = _per_prompt(rec)
    worst = max(verdicts, key=VERDICT_ORDER.index)
    assert rows[("fresh-1024-0", "B")]["Verdict"] == worst
    assert rows[("fresh-1024-0", "B")]["Rounds"] == str(len(verdicts))
    assert rows[("fresh-4096-0", "B")]["Verdict"] == "equal"  # the other prompt is untouched
    assert not an.gate(rec).passed  # and the gate, which accepts no mismatch here, fails either way


@pytest.mark.parametrize("k", [1, 4, 8, 15])  # make_run outputs 16 ids
def test_parity_over_the_first_k_ids_includes_the_kth(k: int) -> None:
    """Parity over the first K ids: a divergence at any of positions 0..K-1 fails the gate and names the
    position; the first divergence at position K is outside the promise (reported, not failed)."""
    for pos, fails in ((0, True), (k - 1, True), (k, False)):
        rec = make_run(rounds=2, lengths=(1024,), gate={"parity_tokens": k})
        s = find(rec, "B", "fresh-1024-0", 2)
        s.output_ids = list(s.output_ids)
        s.output_ids[pos] += 1000
        verdict = an.gate(rec)
        assert verdict.passed is not fails, (k, pos, verdict.failures)
        if fails:
            assert any(f"token {pos} differs" in f for f in verdict.failures), verdict.failures


# ------------------------------------------------------------------------------------------ exclusion


EXCLUDE = ["warmup", "jit", "continuation"]  # more than the default, so the rule itself is exercised


@pytest.fixture(scope="module")
def excluded_run(tmp_path_factory: pytest.TempPathFactory) -> RunRecord:
    """A real run (the runner against the loopback fake engine, two arms, two rounds) with warm-ups, a JIT
    warm-up, a fresh prompt and a cold/continuation pair; ``exclude_kinds`` = :data:`EXCLUDE`; declared checks
    on every kind."""
    from abbench import runner
    from abbench.engine.serve.tokenizer import load_tokenizer
    from abbench.profile import profile_from_dict

    from tests.support import faultkit as fk
    from tests.support.fakeserver import FakeConfig, FakeServer

    with FakeServer(FakeConfig(), tokenizer=load_tokenizer("qwen3")) as srv:
        prof = fk.fake_profile(
            "unused", engine={"base_url": srv.base_url, "command": []},
            prompts={"lengths": [24], "warmup": 1, "warmup_tokens": 16, "jit_warmup_tokens": 40,
                     "pairs": [{"cold": 32, "extend": 8}]},
            arms=[{"name": "a"}, {"name": "b"}],
            run={"rounds": 2, "exclude_kinds": EXCLUDE},
            request={"max_tokens": 4})
        prof["gate"] = {"checks": ["ttft_s[a] <= 30", "ttft_s[b] <= 30", "decode_tok_s[b] >= 1"]}
        record = runner.execute(profile_from_dict(prof), tmp_path_factory.mktemp("excl") / "run")
    assert record.status == "complete", record.status_reason
    assert all(s.ok for s in record.samples), [s.error for s in record.samples if not s.ok]
    return record


def test_the_runner_marks_every_excluded_kind(excluded_run: RunRecord) -> None:
    kinds = {s.kind for s in excluded_run.samples}
    assert kinds == {"warmup", "jit", "fresh", "cold", "continuation"}
    for s in excluded_run.samples:
        assert s.excluded is (s.kind in EXCLUDE), (s.prompt_id, s.kind, s.excluded)
    for st in excluded_run.plan:
        assert st.excluded is (st.kind in EXCLUDE), (st.prompt_id, st.kind)


def _poisoned(record: RunRecord) -> RunRecord:
    """A copy whose excluded samples are absurd in every way a table, check or gate could read: 1000x
    slower, other output ids, another prefill path without a reason, huge transfers and memory."""
    rec = record.model_copy(deep=True)
    for s in rec.samples:
        if not s.excluded:
            continue
        s.ttft_s = (s.ttft_s or 0.01) * 1000
        s.total_s = s.ttft_s + 500.0
        s.output_ids = [i + 7 for i in s.output_ids]
        s.engine = {**(s.engine or {}), "prefill_path": "something-else", "fallback_reason": None,
                    "h2d_bytes": 10**15, "prefill_h2d_bytes": 10**15, "bank_bytes": 10**9,
                    "peak_device_bytes": 10**14}
        s.telemetry = s.telemetry.model_copy(update={"gpu_mem_used_peak": 10**14, "proc_gpu_mem_peak": 10**14})
    return rec


def test_excluded_samples_reach_no_table_check_or_gate(excluded_run: RunRecord) -> None:
    poisoned = _poisoned(excluded_run)
    a, b = an.analyze(excluded_run), an.analyze(poisoned)
    clean_md = mdtables.sections(rp.render_markdown(excluded_run, [], a, {}, {}))
    dirty_md = mdtables.sections(rp.render_markdown(poisoned, [], b, {}, {}))
    # "Memory" is the services' peaks over their whole life (the background sampler's view, warm-ups
    # included), not a statistic of measured samples: the one section the excluded samples may move
    assert dirty_md["Memory"] != clean_md["Memory"]
    assert {k: v for k, v in dirty_md.items() if k != "Memory"} == {k: v for k, v in clean_md.items()
                                                                    if k != "Memory"}
    clean, dirty = an.gate(excluded_run), an.gate(poisoned)
    assert (dirty.passed, dirty.failures) == (clean.passed, clean.failures)
    assert clean.passed, clean.failures  # the declared checks hold on the measured samples
    # and no table of the analysis has a row of an excluded kind
    for name, value in vars(a).items():
        if hasattr(value, "columns") and "kind" in value.columns and "measured" not in value.columns:
            assert not set(value["kind"].dropna()) & set(EXCLUDE), name


# ------------------------------------------------------------------------------- llama.cpp refetch order


PROMPT = ("The river ran past the old mill, where the miller's daughter counted sacks of grain by lamplight "
          "and wondered whether the bridge would hold another winter.")


@pytest.fixture(scope="module")
def llamacpp():
    from tests.support import fake_engines

    with fake_engines.FakeEngine(fake_engines.FakeEngineConfig("llamacpp")) as eng:
        yield eng


def _repeat_as(order, monkeypatch: pytest.MonkeyPatch) -> None:
    """The non-streamed repeat returns its ids rearranged by ``order`` (text, count and finish unchanged)."""
    real = EngineClient.complete

    def rearranged(self, *a, **kw):
        got = real(self, *a, **kw)
        return got if kw["request"].stream else dataclasses.replace(got, output_ids=order(list(got.output_ids)))

    monkeypatch.setattr(EngineClient, "complete", rearranged)


def _swap(i: int, j: int):
    def f(ids: list[int]) -> list[int]:
        ids[i], ids[j] = ids[j], ids[i]
        return ids
    return f


@pytest.mark.parametrize("order", [_swap(0, 1), _swap(4, 7), lambda ids: ids[::-1]],
                         ids=["first-two", "apart", "reversed"])
def test_a_refetch_whose_ids_reorder_the_stream_is_refused(llamacpp, order, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stream leaves out the id at position 2 (a token ending inside a character); a repeat holding the
    same ids in another order has the right count and text but is another answer: ``protocol``."""
    spec = RequestSpec(max_tokens=8, logprobs=2, timeout_s=10.0)
    n = len(llamacpp.tokenizer.encode(PROMPT))
    with EngineClient(connect_timeout_s=2.0) as c:
        ok = c.complete(llamacpp.base_url, PROMPT, request=spec, extra={"fake_mid_char": [2]},
                        target_prompt_tokens=n, adapter="llamacpp")
        assert "ids_refetched" in ok.engine  # the refetch applies here, and in order it is accepted
        _repeat_as(order, monkeypatch)
        with pytest.raises(RequestError) as e:
            c.complete(llamacpp.base_url, PROMPT, request=spec, extra={"fake_mid_char": [2]},
                       target_prompt_tokens=n, adapter="llamacpp")
    assert e.value.kind == "protocol", e.value
    assert json.dumps(ok.output_ids) != json.dumps(order(list(ok.output_ids)))


# ------------------------------------------------------------------------------ declared counter checks


def _banks(record: RunRecord, arm: str, rnd: int, prompt: str, banks: float) -> None:
    """Arm ``arm``'s sample of ``prompt`` in round ``rnd`` copies ``banks`` banks in prefill."""
    s = find(record, arm, prompt, rnd)
    e = dict(s.engine)
    e["prefill_h2d_bytes"] = int(banks * e["bank_bytes"])
    e["h2d_bytes"] = e["prefill_h2d_bytes"] + e["decode_h2d_bytes"]
    s.engine = e


@pytest.mark.parametrize("rnd", [1, 2, 3])
def test_a_counter_check_fails_on_any_one_sample_past_its_bound(rnd: int) -> None:
    """A counter check (``h2d_banks``: layer-major copies one bank per prompt) holds for every sample, not
    for a typical one: one request of three that copied the bank twice fails ``<= 1``, one that copied half
    of it fails ``>= 1``, either fails ``== 1``; the others alone pass all three."""
    checks = ["h2d_banks[B] <= 1", "h2d_banks[B] >= 1", "h2d_banks[B] == 1"]
    clean = make_run(rounds=3, lengths=(4096,))
    assert all(c.result == "pass" for c in an.gate(clean, checks=checks).checks if c.name in checks)
    for banks, failing in ((2.0, {"h2d_banks[B] <= 1", "h2d_banks[B] == 1"}),
                           (0.5, {"h2d_banks[B] >= 1", "h2d_banks[B] == 1"})):
        rec = make_run(rounds=3, lengths=(4096,))
        _banks(rec, "B", rnd, "fresh-4096-0", banks)
        v = an.gate(rec, checks=checks)
        got = {c.name for c in v.checks if c.name in checks and c.result != "pass"}
        assert got == failing, (banks, [(c.name, c.result, c.detail) for c in v.checks])
        assert not v.passed
