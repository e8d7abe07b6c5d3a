"""abbench.analysis: paired statistics, parity, active path, completeness and the gate, on small explicit
RunRecords built here (no engine, no files)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd
import pytest

from abbench import analysis as an
from abbench.results import MemoryPoint, PromptRecord, RunRecord, Sample, ServiceRecord
from abbench.schedule import build_plan

GB = 1_000_000_000
BANK = 58 * GB
MAX_TOKENS = 16
ENVIRONMENT = {  # the shape abbench.telemetry.environment_fingerprint records (abridged)
    "hostname": "h200-box", "driver_version": "570.86", "cuda_driver_version": "12.8",
    "gpus": [{"index": 0, "name": "NVIDIA H200", "pcie": {"gen_current": 5, "width_current": 16}}],
    "packages": {"torch": "2.13.0", "transformers": "4.51.0"}, "engine_commit": "0123abcd",
    "python": {"version": "3.11.7"}, "argv": ["abbench", "run", "test"],
}


def ref_ids(prompt_id: str) -> list[int]:
    base = sum(map(ord, prompt_id)) * 7
    return [base + i for i in range(MAX_TOKENS)]


def default_ttft(arm: str, prompt: PromptRecord, rnd: int) -> float:
    """The reference 'A' takes tokens/1000 s; 'B' half of it (+ a little round noise); others equal to A."""
    base = prompt.target_tokens / 1000.0
    if arm == "B":
        return base * (0.5 + 0.01 * rnd)
    return base * (1.0 + 0.001 * rnd)


def make_run(
    *,
    arms: tuple[str, ...] = ("A", "B"),
    rounds: int = 2,
    lengths: tuple[int, ...] = (1024, 4096),
    per_length: int = 1,
    pairs: bool = False,
    warmup: int = 1,
    engine: bool = True,
    nvml: bool = True,
    memory: bool = True,
    gpu: bool = True,
    logprobs: bool = True,
    expect_path: dict[str, str] | None = None,
    paths: dict[str, str] | None = None,
    gate: dict[str, Any] | None = None,
    ttft: Callable[[str, PromptRecord, int], float] = default_ttft,
    status: str = "complete",
    environment: dict[str, Any] | None = None,
) -> RunRecord:
    """A complete, clean run: every arm emits the reference ids, logprob margins of 1 nat, the engine
    reports its path (B: layer-major, others: chunked) and counters."""
    prompts: list[PromptRecord] = []
    for w in range(warmup):
        prompts.append(PromptRecord(id=f"warmup-{w}", kind="warmup", target_tokens=32, token_count=32,
                                    sha256="0" * 64, corpus="essays"))
    for n in lengths:
        for i in range(per_length):
            prompts.append(PromptRecord(id=f"fresh-{n}-{i}", kind="fresh", target_tokens=n, token_count=n,
                                        sha256=f"{n:064d}", corpus="essays", preview="Once upon"))
    if pairs:
        prompts.append(PromptRecord(id="pair0-cold", kind="cold", target_tokens=2048, token_count=2048,
                                    sha256="1" * 64, corpus="science"))
        prompts.append(PromptRecord(id="pair0-cont", kind="continuation", target_tokens=2560,
                                    token_count=2560, sha256="2" * 64, corpus="science", parent="pair0-cold"))
    expect = {"B": "layer-major"} if expect_path is None else expect_path
    reported = {"B": "layer-major"} if paths is None else paths
    profile = {
        "name": "test-profile",
        "arms": [{"name": a, "expect_path": expect.get(a)} for a in arms],
        "run": {"rounds": rounds, "reference": None},
        "request": {"max_tokens": MAX_TOKENS},
        "gate": {"parity_tokens": 8, "require_active_path": True, "allow_fallback": [], "max_failed_samples": 0,
                 **(gate or {})},
    }
    plan = build_plan(prompts, list(arms), rounds, shared_service=False, reset_between_samples=True,
                      exclude_kinds=["warmup", "jit"])
    by_id = {p.id: p for p in prompts}
    samples: list[Sample] = []
    t0 = 1_700_000_000.0
    for st in plan:
        p = by_id[st.prompt_id]
        t = ttft(st.arm, p, st.round)
        ids = ref_ids(p.id)
        eng = None
        if engine:
            n_chunks = max(1, math.ceil(p.target_tokens / 2048))
            path = reported.get(st.arm, "chunked")
            eng = {
                "prefill_path": path, "fallback_reason": None,
                "h2d_bytes": BANK * (1 if path == "layer-major" else n_chunks) + GB,
                "prefill_h2d_bytes": BANK * (1 if path == "layer-major" else n_chunks),
                "decode_h2d_bytes": GB, "d2d_bytes": 0, "bank_bytes": BANK, "expert_copies": 0,
                "cached_prompt_tokens": 0, "n_chunks": n_chunks, "n_windows": 1, "measured_h2d_gbps": 55.0,
                "timings": {"received": 0.0, "prefill_start": 0.001, "prefill_end": t - 0.004,
                            "first_token": t - 0.002, "finished": t + 0.3},
                "queue_wait_s": 0.0005,
            }
        tel: dict[str, Any] = {}
        if nvml:
            tel["nvml_pcie_rx_bytes"] = (eng["h2d_bytes"] * 1.02) if eng else 50 * GB
        if gpu:
            tel.update(gpu_mem_used_peak=20 * 2**30 + st.index, proc_gpu_mem_peak=18 * 2**30, host_rss_peak=70 * 2**30)
        samples.append(
            Sample(
                step=st.index, arm=st.arm, round=st.round, position=st.position, prompt_id=st.prompt_id,
                kind=st.kind, excluded=st.excluded, service=st.service, ok=True, started_at=t0 + st.index,
                ttft_s=t, total_s=t + 0.3, output_ids=ids, ids_source="native", finish_reason="length",
                prompt_tokens=p.target_tokens, completion_tokens=MAX_TOKENS, saw_done=True,
                logprobs=[[(i, -0.1), (i + 1, -1.1)] for i in ids] if logprobs else None,
                engine=eng, telemetry=tel,
            )
        )
    services = [ServiceRecord(key=f"{a}@r{r}", arms=[a], round=r, command=["python", "-m", "engine", a],
                              base_url="http://127.0.0.1:8000") for r in range(1, rounds + 1) for a in arms]
    mem: list[MemoryPoint] = []
    if memory:
        for i, svc in enumerate(services):
            for j in range(3):
                mem.append(MemoryPoint(t=t0 + 10 * i + j, service=svc.key,
                                       gpu_mem_used=(20 * 2**30 + j * 2**28) if gpu else None,
                                       proc_gpu_mem=(18 * 2**30) if gpu else None, host_rss=(60 + j) * 2**30))
    return RunRecord(
        run_id="20260101-000000-test", status=status, created_at=t0, finished_at=t0 + 100,
        abbench_version="0.1.0", profile=profile,
        environment=environment if environment is not None else ENVIRONMENT,
        prompts=prompts, plan=plan, samples=samples, services=services, memory=mem,
    )


def find(record: RunRecord, arm: str, prompt_id: str, rnd: int) -> Sample:
    return next(s for s in record.samples if s.arm == arm and s.prompt_id == prompt_id and s.round == rnd)


# ------------------------------------------------------------------------------------- frames


def test_samples_frame_derives_decode_rate_and_overhead() -> None:
    rec = make_run(rounds=1, lengths=(1024,))
    df = an.samples_frame(rec)
    assert len(df) == len(rec.samples)
    row = df[(df["arm"] == "A") & (df["prompt_id"] == "fresh-1024-0")].iloc[0]
    assert row["measured"] and row["target_tokens"] == 1024
    assert row["decode_tok_s"] == pytest.approx((MAX_TOKENS - 1) / 0.3)
    assert row["client_overhead_s"] == pytest.approx(0.002)
    assert not df[df["kind"] == "warmup"]["measured"].any()


def test_ttft_table_uses_measured_ok_samples_only() -> None:
    rec = make_run(rounds=2, lengths=(1024,))
    find(rec, "A", "fresh-1024-0", 2).ok = False
    t = an.ttft_table(rec)
    a = t[(t["arm"] == "A")].iloc[0]
    assert a["n"] == 1 and a["median_s"] == pytest.approx(1.024 * 1.001)
    assert set(t["kind"]) == {"fresh"}  # warm-ups excluded


# ------------------------------------------------------------------------------------- ratios


def test_paired_ratio_pairs_within_the_same_round() -> None:
    rec = make_run(rounds=2, lengths=(1024,))
    pairs = an.paired_ratios(rec)
    assert list(pairs["round"]) == [1, 2]
    for r in pairs.itertuples():
        assert r.ratio == pytest.approx((0.5 + 0.01 * r.round) / (1.0 + 0.001 * r.round))
        assert r.arm == "B" and r.reference == "A"
    # ABBA: the positions swap between rounds
    assert list(pairs["arm_position"]) == [1, 0] and list(pairs["ref_position"]) == [0, 1]


def test_paired_ratio_skips_a_round_without_reference() -> None:
    rec = make_run(rounds=2, lengths=(1024,))
    find(rec, "A", "fresh-1024-0", 1).ok = False
    pairs = an.paired_ratios(rec)
    assert list(pairs["round"]) == [2]


def test_bootstrap_ci_absent_for_one_pair_present_for_more() -> None:
    one = an.ratio_summary(make_run(rounds=1, lengths=(1024,)))
    assert one.iloc[0]["n"] == 1
    assert one.iloc[0]["ci_low"] is None or math.isnan(one.iloc[0]["ci_low"])
    assert one.iloc[0]["verdict"] == "undetermined"
    assert "n=1" in one.iloc[0]["note"]

    six = an.ratio_summary(make_run(rounds=6, lengths=(1024,)))
    r = six.iloc[0]
    assert r["n"] == 6 and r["ci_low"] <= r["median_ratio"] <= r["ci_high"]
    assert r["ci_high"] < 1.0 and r["verdict"] == "faster"
    assert r["note"] is None or (isinstance(r["note"], float) and math.isnan(r["note"]))


def test_small_n_note_and_fixed_seed() -> None:
    s1 = an.ratio_summary(make_run(rounds=3, lengths=(1024,)))
    s2 = an.ratio_summary(make_run(rounds=3, lengths=(1024,)))
    assert s1.iloc[0]["note"] == "n=3: too few pairs for a reliable interval"
    assert s1.iloc[0]["ci_low"] == s2.iloc[0]["ci_low"] and s1.iloc[0]["ci_high"] == s2.iloc[0]["ci_high"]
    notes = an.small_n_notes(make_run(rounds=3, lengths=(1024,)))
    assert any("B vs A, fresh 1024 tokens: n=3" in n for n in notes)


def test_not_significant_when_the_interval_spans_one() -> None:
    noise = {1: 0.9, 2: 1.1, 3: 0.95, 4: 1.05, 5: 1.0, 6: 1.02}

    def ttft(arm: str, p: PromptRecord, rnd: int) -> float:
        return 1.0 * (noise[rnd] if arm == "B" else 1.0)

    s = an.ratio_summary(make_run(rounds=6, lengths=(1024,), ttft=ttft)).iloc[0]
    assert s["ci_low"] < 1.0 < s["ci_high"]
    assert s["verdict"] == "not significant"
    assert an.verdict(1.1, 1.3) == "slower" and an.verdict(0.5, 0.9) == "faster"
    assert an.verdict(None, None) == "undetermined"


def test_median_ci_direct() -> None:
    ci = an.median_ci([2.0, 2.0, 2.0])
    assert (ci.median, ci.low, ci.high) == (2.0, 2.0, 2.0)
    with pytest.raises(ValueError):
        an.median_ci([])


# ------------------------------------------------------------------------------------- parity


def test_clean_run_parity_all_identical() -> None:
    rec = make_run()
    p = an.parity_frame(rec)
    par = p[p["check"] == "parity"]
    assert len(par) == 4  # B: 2 prompts x 2 rounds
    assert par["match"].all() and set(par["classification"]) == {"identical"}
    assert (par["agree"] == MAX_TOKENS).all() and (par["max_tokens"] == MAX_TOKENS).all()
    stab = p[p["check"] == "stability"]
    assert len(stab) == 2 and stab["match"].all()  # A round 2 vs A round 1, per prompt


def test_parity_first_divergence_and_clear_margin() -> None:
    rec = make_run()
    s = find(rec, "B", "fresh-4096-0", 2)
    s.output_ids[3] += 1
    p = an.parity_frame(rec)
    row = p[(p["check"] == "parity") & (p["arm"] == "B") & (p["prompt_id"] == "fresh-4096-0") & (p["round"] == 2)].iloc[0]
    assert not row["match"] and row["first_diverging"] == 3 and row["agree"] == 3
    assert row["margin"] == pytest.approx(1.0) and row["margin_against"] == pytest.approx(1.0)
    assert row["classification"] == "divergence"
    assert row["against_arm"] == "A" and row["against_round"] == 2


def test_parity_near_tie_from_logprobs_in_either_arm() -> None:
    rec = make_run()
    s = find(rec, "B", "fresh-1024-0", 1)
    s.output_ids[5] += 1
    r = find(rec, "A", "fresh-1024-0", 1)
    assert r.logprobs is not None
    r.logprobs[5] = [(r.output_ids[5], -0.70), (r.output_ids[5] + 1, -0.72)]  # reference nearly tied
    row = an.parity_frame(rec).query("check == 'parity' and arm == 'B' and round == 1 and prompt_id == 'fresh-1024-0'").iloc[0]
    assert row["first_diverging"] == 5
    assert row["margin_against"] == pytest.approx(0.02)
    assert row["classification"] == "near-tie"
    # the threshold is a parameter
    row = an.parity_frame(rec, near_tie_nats=0.01).query("check == 'parity' and arm == 'B' and round == 1 and prompt_id == 'fresh-1024-0'").iloc[0]
    assert row["classification"] == "divergence"


def test_parity_divergence_beyond_k_matches_but_is_reported() -> None:
    rec = make_run()
    find(rec, "B", "fresh-1024-0", 1).output_ids[12] += 1
    row = an.parity_frame(rec).query("check == 'parity' and arm == 'B' and round == 1 and prompt_id == 'fresh-1024-0'").iloc[0]
    assert row["match"] and row["first_diverging"] == 12 and row["agree"] == 12
    assert an.gate(rec).passed
    assert not an.gate(rec, parity_tokens=16).passed


def test_parity_without_logprobs_is_margin_unknown() -> None:
    rec = make_run(logprobs=False)
    find(rec, "B", "fresh-1024-0", 1).output_ids[0] += 1
    row = an.parity_frame(rec).query("check == 'parity' and arm == 'B' and round == 1 and prompt_id == 'fresh-1024-0'").iloc[0]
    assert row["classification"] == "margin unknown" and row["first_diverging"] == 0


def test_parity_falls_back_to_another_reference_round_and_says_so() -> None:
    rec = make_run(rounds=3, lengths=(1024,))
    find(rec, "A", "fresh-1024-0", 2).ok = False
    row = an.parity_frame(rec).query("check == 'parity' and round == 2").iloc[0]
    assert row["match"] and row["other_round"] and row["against_round"] == 1
    assert "reference round 2 missing or failed" in row["note"]


def test_reference_stability_across_rounds() -> None:
    rec = make_run(rounds=3, lengths=(1024,))
    find(rec, "A", "fresh-1024-0", 3).output_ids[2] += 1
    p = an.parity_frame(rec)
    stab = p[p["check"] == "stability"]
    assert list(stab["round"]) == [2, 3] and list(stab["match"]) == [True, False]
    assert stab.iloc[1]["against_round"] == 1 and stab.iloc[1]["first_diverging"] == 2
    v = an.gate(rec)
    assert not v.passed
    assert {c.name: c.passed for c in v.checks}["reference-stable"] is False
    assert any(f.startswith("reference-stable: prompt fresh-1024-0, arm A, round 3") for f in v.failures)


def test_retokenized_flagged_and_none_unchecked() -> None:
    rec = make_run(rounds=1, lengths=(1024, 4096))
    find(rec, "B", "fresh-1024-0", 1).ids_source = "retokenized"
    b = find(rec, "B", "fresh-4096-0", 1)
    b.ids_source, b.output_ids = "none", []
    p = an.parity_frame(rec).set_index("prompt_id")
    assert "retokenized" in p.loc["fresh-1024-0", "note"] and p.loc["fresh-1024-0", "match"]
    assert p.loc["fresh-4096-0", "classification"] == "unchecked"
    v = an.gate(rec)
    assert not v.passed
    assert any("token ids: prompt fresh-4096-0, arm B, round 1" in f for f in v.failures)
    assert any("retokenized" in n for n in v.notes)


def test_compare_ids_lengths() -> None:
    assert an.compare_ids([1, 2, 3], [1, 2, 3], 8) == (True, None, 3)
    assert an.compare_ids([1, 2], [1, 2, 3], 8) == (False, 2, 2)
    assert an.compare_ids([1, 2, 9], [1, 2, 3], 2) == (True, 2, 2)


# -------------------------------------------------------------------------------- active path


def test_active_path_counts_and_statuses() -> None:
    rec = make_run(rounds=2, lengths=(1024, 4096), paths={"B": "layer-major"})
    # B falls back on the one-chunk 1024 prompt with a reason; silently on 4096 round 2
    for s in rec.samples:
        if s.arm == "B" and s.prompt_id == "fresh-1024-0" and not s.excluded:
            s.engine = {**(s.engine or {}), "prefill_path": "chunked", "fallback_reason": "single chunk"}
    silent = find(rec, "B", "fresh-4096-0", 2)
    silent.engine = {**(silent.engine or {}), "prefill_path": "chunked", "fallback_reason": None}
    summ = an.active_path_summary(rec).set_index("arm")
    b = summ.loc["B"]
    assert b["expect_path"] == "layer-major" and b["n"] == 4
    assert b["paths"] == {"layer-major": 1, "chunked": 3}
    assert b["fallback_reasons"] == {"single chunk": 2}
    assert (b["active"], b["fallback"], b["fallback_ineligible"], b["silent"]) == (1, 2, 2, 1)
    assert not b["passed"]
    assert pd.isna(summ.loc["A"]["expect_path"]) and summ.loc["A"]["passed"]


# --------------------------------------------------------------------------------------- gate


def checks(v: an.GateVerdict) -> dict[str, bool]:
    return {c.name: c.passed for c in v.checks}


def test_gate_passes_a_clean_run() -> None:
    v = an.gate(make_run(pairs=True))
    assert v.passed, v.failures
    assert v.failures == [] and v.parity_tokens == 8
    assert set(checks(v)) == {"run-complete", "samples", "reference", "token-ids", "parity",
                              "reference-stable", "active-path"}


def test_gate_fails_on_a_changed_id_naming_prompt_arm_round_position() -> None:
    rec = make_run()
    find(rec, "B", "fresh-4096-0", 2).output_ids[6] = 4242
    v = an.gate(rec)
    assert not v.passed and checks(v)["parity"] is False
    assert len(v.failures) == 1
    f = v.failures[0]
    assert "prompt fresh-4096-0" in f and "arm B" in f and "round 2" in f and "position 0" in f
    assert "token 6 differs" in f and "4242" in f and "divergence" in f


def test_gate_fails_on_a_missing_measured_step() -> None:
    rec = make_run()
    gone = find(rec, "B", "fresh-1024-0", 1)
    rec.samples.remove(gone)
    v = an.gate(rec)
    assert not v.passed and checks(v)["samples"] is False
    assert any(f.startswith("missing: prompt fresh-1024-0, arm B, round 1 (position 1)") for f in v.failures)
    # tolerance for failed samples does not cover missing data
    rec.profile["gate"]["max_failed_samples"] = 5
    assert not an.gate(rec).passed


def test_gate_tolerates_failed_samples_up_to_the_limit() -> None:
    rec = make_run()
    s = find(rec, "B", "fresh-1024-0", 1)
    s.ok, s.error_kind, s.error = False, "http", "500 Internal Server Error"
    v = an.gate(rec)
    assert not v.passed
    assert any("failed: prompt fresh-1024-0, arm B, round 1" in f and "http" in f for f in v.failures)
    rec.profile["gate"]["max_failed_samples"] = 1
    v = an.gate(rec)
    assert v.passed, v.failures
    assert any("tolerated" in n for n in v.notes)


def test_gate_fails_a_partial_run_and_an_empty_run() -> None:
    rec = make_run(status="partial")
    rec.status_reason = "interrupted"
    rec.samples = rec.samples[: len(rec.samples) // 2]
    v = an.gate(rec)
    assert not v.passed and checks(v)["run-complete"] is False and checks(v)["samples"] is False
    assert any("interrupted" in f for f in v.failures)

    empty = make_run()
    empty.samples = []
    v = an.gate(empty)
    assert not v.passed and checks(v)["reference"] is False
    assert any("no measured step has an ok sample" in f for f in v.failures)

    no_plan = make_run()
    no_plan.plan = []
    assert not an.gate(no_plan).passed


def test_gate_fails_when_reference_missing() -> None:
    rec = make_run()
    rec.samples = [s for s in rec.samples if s.arm != "A" or s.excluded]
    rec.plan = [st for st in rec.plan if st.arm != "A" or st.excluded]
    v = an.gate(rec)
    assert not v.passed and checks(v)["reference"] is False and checks(v)["parity"] is False
    assert any("no usable A sample" in f for f in v.failures)


def test_gate_fails_on_a_silent_fallback() -> None:
    rec = make_run(gate={"allow_fallback": ["B"]})
    s = find(rec, "B", "fresh-4096-0", 1)
    s.engine = {**(s.engine or {}), "prefill_path": "chunked", "fallback_reason": None}
    v = an.gate(rec)
    assert not v.passed and checks(v)["active-path"] is False
    assert any("active path: prompt fresh-4096-0, arm B, round 1" in f and "silent" in f for f in v.failures)


def test_gate_fails_an_undeclared_fallback_and_passes_an_allowed_one() -> None:
    rec = make_run()
    s = find(rec, "B", "fresh-4096-0", 1)  # two chunks: eligible for layer-major
    s.engine = {**(s.engine or {}), "prefill_path": "chunked", "fallback_reason": "activation budget"}
    v = an.gate(rec)
    assert not v.passed and checks(v)["active-path"] is False
    assert any(f.startswith("active path: prompt fresh-4096-0, arm B, round 1 (position 1)")
               and "multi-chunk prompt" in f and "gate.allow_fallback" in f for f in v.failures)
    rec.profile["gate"]["allow_fallback"] = ["B"]
    v = an.gate(rec)
    assert v.passed, v.failures
    assert any("allowed fallback" in n and "activation budget (gate.allow_fallback)" in n for n in v.notes)


def test_gate_passes_a_fallback_with_reason_on_a_one_chunk_prompt() -> None:
    rec = make_run()
    s = find(rec, "B", "fresh-1024-0", 2)  # one chunk: layer-major has nothing to reorder
    s.engine = {**(s.engine or {}), "prefill_path": "chunked", "fallback_reason": "single chunk"}
    v = an.gate(rec)
    assert v.passed, v.failures
    assert any("B: single chunk (one-chunk prompt)" in n for n in v.notes)
    # a reason that starts with the arm's name (the vendored engine's start with the mode, an arm's usual name)
    # does not name it twice
    s.engine = {**s.engine, "fallback_reason": "B: prompt fits in one chunk"}
    v = an.gate(rec)
    assert v.passed and any("fallback(s): B: prompt fits in one chunk (one-chunk prompt)" in n for n in v.notes)
    # without n_chunks the engine does not show the prompt ineligible: the fallback must be declared
    s.engine = {k: v for k, v in s.engine.items() if k != "n_chunks"}
    v = an.gate(rec)
    assert not v.passed and any("unknown eligibility" in f for f in v.failures)


def test_gate_fails_an_arm_that_never_ran_its_path_even_when_allowed() -> None:
    rec = make_run(gate={"allow_fallback": ["B"]})
    for s in rec.samples:
        if s.arm == "B":
            s.engine = {**(s.engine or {}), "prefill_path": "chunked", "fallback_reason": "disabled"}
    v = an.gate(rec)
    assert not v.passed and checks(v)["active-path"] is False
    assert any("arm B never reported layer-major on any of its 4 measured sample(s)" in f for f in v.failures)


def test_gate_fails_when_an_expected_path_is_unreported_unless_not_required() -> None:
    rec = make_run(engine=False)
    v = an.gate(rec)
    assert not v.passed and any("reported no prefill path" in f for f in v.failures)
    rec.profile["gate"]["require_active_path"] = False
    assert an.gate(rec).passed


# ------------------------------------------------------------------------- telemetry frames


def test_h2d_banks_nvml_and_floor() -> None:
    rec = make_run(rounds=2, lengths=(4096,))
    h = an.h2d_table(rec).set_index("arm")
    a, b = h.loc["A"], h.loc["B"]
    assert a["banks"] == pytest.approx(2.0)  # chunked: 2 chunks -> the bank crosses twice
    assert b["banks"] == pytest.approx(1.0)  # layer-major: once per prompt
    assert a["h2d_bytes"] == 2 * BANK + GB  # the whole request, decode included
    assert a["engine_over_nvml"] == pytest.approx(1 / 1.02)
    assert b["floor_s"] == pytest.approx(BANK / 55e9)
    assert b["ttft_over_floor"] == pytest.approx(b["ttft_s"] / b["floor_s"])
    assert an.h2d_table(make_run(engine=False, nvml=False)).empty
    # the vendored engine's first_layer_primed: k of the n requests that say; None where the engine does not say
    assert h["primed"].isna().all()
    b_samples = [x for x in rec.samples if x.arm == "B" and not x.excluded and x.ok]
    for i, x in enumerate(b_samples):
        x.engine["first_layer_primed"] = i % 2 == 0
    h = an.h2d_table(rec).set_index("arm")
    assert pd.isna(h.loc["A"]["primed"]) and h.loc["B"]["primed"] == f"{(len(b_samples) + 1) // 2}/{len(b_samples)}"
    cont = an.h2d_table(make_run(rounds=1, lengths=(), pairs=True)).set_index(["arm", "kind"])
    assert cont.loc[("A", "cold")]["floor_s"] > 0 and pd.isna(cont.loc[("A", "continuation")]["floor_s"])


def test_overhead_and_memory() -> None:
    rec = make_run()
    o = an.overhead_table(rec).set_index("arm")
    assert o.loc["A"]["with_write_s"] == pytest.approx(0.002) and o.loc["B"]["n"] == 4
    assert an.overhead_table(make_run(engine=False)).empty
    m = an.memory_table(rec).set_index("arms")
    assert list(m.index) == ["A", "B"] and m.loc["A"]["services"] == 2
    assert m.loc["A"]["gpu_mem_used_peak"] >= 20 * 2**30 + 2**29
    assert m.loc["A"]["host_rss_peak"] == 70 * 2**30
    cpu = an.memory_table(make_run(gpu=False, nvml=False)).set_index("arms")
    assert cpu.loc["A"]["host_rss_peak"] == 62 * 2**30 and cpu["gpu_mem_used_peak"].isna().all()


def test_completeness_counts() -> None:
    rec = make_run()
    c = an.completeness(rec)
    assert (c.planned, c.present, c.ok) == (8, 8, 8) and c.excluded_planned == 4
    rec.samples.remove(find(rec, "A", "fresh-4096-0", 2))
    find(rec, "B", "fresh-4096-0", 2).ok = False
    c = an.completeness(rec)
    assert (c.planned, c.present, c.ok) == (8, 7, 6)
    assert [(st.arm, st.prompt_id, st.round) for st in c.missing] == [("A", "fresh-4096-0", 2)]
    assert [(s.arm, s.round) for s in c.failed] == [("B", 2)]


def test_analyze_bundles_everything() -> None:
    a = an.analyze(make_run(pairs=True, arms=("A", "B", "C")))
    assert a.reference == "A" and a.arms == ["A", "B", "C"]
    assert set(a.ratios["arm"]) == {"B", "C"}
    assert set(a.ratios["kind"]) == {"fresh", "cold", "continuation"}
    assert a.gate.passed, a.gate.failures


def test_floor_is_the_larger_of_resident_compute_and_one_bank_over_bandwidth() -> None:
    """Copy floor = 58 GB / 55 GB/s = 1.0545 s. With R (resident) taking tokens/1000 s x 0.25, the 1024-token
    prompt is copy-bound and the 8192-token prompt compute-bound (2.048 s)."""

    def ttft(arm: str, prompt: PromptRecord, rnd: int) -> float:
        base = prompt.target_tokens / 1000.0
        return {"A": base * 2, "B": 1.1 if prompt.target_tokens < 8192 else 2.1, "R": base * 0.25}[arm]

    rec = make_run(arms=("A", "B", "R"), lengths=(1024, 8192), ttft=ttft,
                   expect_path={"B": "layer-major", "R": "resident"}, paths={"B": "layer-major", "R": "resident"})
    floor = an.floor_table(rec).set_index(["arm", "target_tokens"])
    copy = BANK / 55e9
    short, long_ = floor.loc[("B", 1024)], floor.loc[("B", 8192)]
    assert short["bound"] == "copy" and short["floor_s"] == pytest.approx(copy)
    assert short["compute_floor_s"] == pytest.approx(0.256)
    assert short["over_floor"] == pytest.approx(1.1 / copy)
    assert long_["bound"] == "compute" and long_["floor_s"] == pytest.approx(2.048)
    assert long_["over_floor"] == pytest.approx(2.1 / 2.048)
    assert floor.loc[("R", 8192)]["over_floor"] == pytest.approx(1.0)
    assert floor.loc[("A", 1024)]["over_floor"] == pytest.approx(2.048 / copy)


def test_the_fastest_resident_arm_sets_the_compute_floor_per_length() -> None:
    """Two resident arms (the profile's chunk size, and one chunk as long as the prompt): the honest floor is
    the faster of the two at each length, and the table says which set it."""

    def ttft(arm: str, prompt: PromptRecord, rnd: int) -> float:
        n = prompt.target_tokens / 1000.0
        return {"B": 9.0, "R": n * 0.30, "RG": 3.0 if n < 8 else n * 0.25}[arm]

    rec = make_run(arms=("B", "R", "RG"), lengths=(1024, 16384), ttft=ttft,
                   expect_path={"R": "resident", "RG": "resident"}, paths={"R": "resident", "RG": "resident"})
    floor = an.floor_table(rec).set_index(["arm", "target_tokens"])
    short, long_ = floor.loc[("B", 1024)], floor.loc[("B", 16384)]
    assert short["compute_floor_arm"] == "R" and short["compute_floor_s"] == pytest.approx(0.3072)
    assert long_["compute_floor_arm"] == "RG" and long_["compute_floor_s"] == pytest.approx(4.096)
    assert long_["over_floor"] == pytest.approx(9.0 / 4.096)
    assert floor.loc[("R", 16384)]["over_floor"] == pytest.approx(16.384 * 0.30 / 4.096)  # R is 1.2x the floor


def test_an_arm_whose_parity_reference_is_resident_takes_it_as_its_compute_floor() -> None:
    """F computes another arithmetic (e.g. FP8 in its GEMM) and names the resident arm Q of that arithmetic as its
    parity_reference: Q is F's compute floor and the gap table's resident arm, even where R (the run's own
    arithmetic, resident) is faster; B keeps the fastest resident arm."""
    from abbench.analysis.declared import VALUES

    def ttft(arm: str, prompt: PromptRecord, rnd: int) -> float:
        return {"B": 9.0, "F": 8.0, "R": 4.0, "Q": 5.0}[arm]

    rec = make_run(arms=("R", "B", "Q", "F"), lengths=(16384,), ttft=ttft,
                   expect_path={"R": "resident", "Q": "resident"}, paths={"R": "resident", "Q": "resident"})
    for a in rec.profile["arms"]:
        if a["name"] == "F":
            a["parity_reference"] = "Q"
    floor = an.floor_table(rec).set_index(["arm", "target_tokens"])
    assert floor.loc[("F", 16384)]["compute_floor_arm"] == "Q" and floor.loc[("F", 16384)]["floor_s"] == 5.0
    assert floor.loc[("B", 16384)]["compute_floor_arm"] == "R" and floor.loc[("B", 16384)]["floor_s"] == 4.0
    x = VALUES["x_floor"](rec)
    assert set(x[x["arm"] == "F"]["value"].round(9)) == {round(8.0 / 5.0, 9)}
    for s in rec.samples:
        if s.engine:
            s.engine["copy_wait_s"] = 0.5
    from abbench.analysis.transfer import gap_table

    gaps = gap_table(rec).set_index("arm")
    assert gaps.loc["F", "resident_arm"] == "Q" and gaps.loc["F", "gap_s"] == pytest.approx(3.0)
    assert gaps.loc["B", "resident_arm"] == "R"


def test_an_arm_with_a_smaller_bank_gets_its_own_copy_floor() -> None:
    """An FP8 bank beside a bf16 one: B's bank is half of A's (and R is resident), so at 1,024 tokens B's copy
    floor is half of A's and B is judged against it; x_floor divides by each arm's own floor."""
    from abbench.analysis.declared import VALUES

    def ttft(arm: str, prompt: PromptRecord, rnd: int) -> float:
        return {"A": 1.2, "B": 0.6, "R": 0.25}[arm]

    rec = make_run(arms=("A", "B", "R"), lengths=(1024,), ttft=ttft, expect_path={"R": "resident"},
                   paths={"R": "resident"})
    for s in rec.samples:
        if s.arm == "B" and s.engine:
            s.engine["bank_bytes"] //= 2
    floor = an.floor_table(rec).set_index(["arm", "target_tokens"])
    copy = BANK / 55e9
    assert floor.loc[("A", 1024)]["copy_floor_s"] == pytest.approx(copy)
    assert floor.loc[("B", 1024)]["copy_floor_s"] == pytest.approx(copy / 2)
    assert floor.loc[("B", 1024)]["over_floor"] == pytest.approx(0.6 / (copy / 2))
    x = VALUES["x_floor"](rec)
    assert set(x[x["arm"] == "B"]["value"].round(9)) == {round(0.6 / (copy / 2), 9)}
    assert set(x[x["arm"] == "A"]["value"].round(9)) == {round(1.2 / copy, 9)}


def test_floor_without_a_resident_arm_is_the_copy_floor_alone() -> None:
    rec = make_run()
    floor = an.floor_table(rec)
    assert set(floor["bound"]) == {"copy"}
    assert floor["compute_floor_s"].isna().all()
    assert an.floor_table(make_run(engine=False)).empty


def test_overhead_splits_out_what_happens_outside_the_server_application() -> None:
    rec = make_run(arms=("A",), rounds=1, lengths=(1024,), warmup=0)
    (s,) = rec.samples
    s.engine["timings"]["first_event"] = s.engine["timings"]["first_token"] + 0.0004
    row = an.overhead_table(rec).iloc[0]
    assert row["with_write_s"] == pytest.approx(0.002)  # harness TTFT - engine first_token (make_run: 2 ms)
    assert row["harness_s"] == pytest.approx(0.0016)  # harness TTFT - engine first_event
    assert row["harness_p90_s"] == pytest.approx(0.0016) and row["harness_max_s"] == pytest.approx(0.0016)


def test_the_harness_overhead_p90_is_over_the_arms_samples() -> None:
    """p90 and max of harness TTFT - (first_event - received), per arm, over its measured samples."""
    rec = make_run(arms=("A",), rounds=5, lengths=(1024, 2048), warmup=0)
    extra = []
    for i, s in enumerate(rec.samples):
        s.engine["timings"]["first_event"] = s.engine["timings"]["first_token"] + 0.0001 * i
        extra.append(s.ttft_s - s.engine["timings"]["first_event"])
    row = an.overhead_table(rec).iloc[0]
    assert row["n"] == len(extra) == 10
    assert row["harness_s"] == pytest.approx(float(np.median(extra)))
    assert row["harness_p90_s"] == pytest.approx(float(np.percentile(extra, 90)))
    assert row["harness_max_s"] == pytest.approx(max(extra))


# --------------------------------------------------------------------------- parity verdicts (near ties)


def _flip(rec: RunRecord, arm: str, prompt: str, rnd: int, pos: int, *, arm_top: list | None | str = "tie",
          ref_top: list | None | str = "tie", chosen_offset: int = 1) -> tuple[Sample, Sample]:
    """``arm`` picks reference id + ``chosen_offset`` at ``pos``; "tie" gives both sides top-2 logprobs of
    the two picks 0.02 nats apart, each side's own pick first."""
    s, r = find(rec, arm, prompt, rnd), find(rec, "A", prompt, rnd)
    ref_id = r.output_ids[pos]
    s.output_ids[pos] = ref_id + chosen_offset
    if arm_top == "tie":
        arm_top = [(ref_id + chosen_offset, -0.70), (ref_id, -0.72)]
    if ref_top == "tie":
        ref_top = [(ref_id, -0.70), (ref_id + chosen_offset, -0.72)]
    if arm_top is None:
        s.logprobs = None
    else:
        s.logprobs[pos] = arm_top
    if ref_top is None:
        r.logprobs = None
    else:
        r.logprobs[pos] = ref_top
    return s, r


def _row(rec: RunRecord, arm: str = "B", prompt: str = "fresh-1024-0", rnd: int = 1, **kw: Any) -> Any:
    p = an.parity_frame(rec, **kw)
    return p[(p["check"] == "parity") & (p["arm"] == arm) & (p["prompt_id"] == prompt) & (p["round"] == rnd)].iloc[0]


def test_verdict_near_tie_flip_is_reported_and_fails_unless_the_profile_accepts_it() -> None:
    rec = make_run()
    _flip(rec, "B", "fresh-1024-0", 1, 5)
    row = _row(rec)
    assert row["verdict"] == "near-tie flip" and row["flip_margin"] == pytest.approx(0.02)
    assert row["tolerance"] == pytest.approx(an.NEAR_TIE_NATS)
    assert (an.parity_frame(rec)["verdict"] == "equal").sum() == len(an.parity_frame(rec)) - 1
    v = an.gate(rec)  # not accepted by default, but named
    assert not v.passed and len(v.failures) == 1 and "verdict near-tie flip" in v.failures[0]
    assert an.gate(rec, accept_near_ties=0.05).passed  # `abbench gate --accept-near-ties 0.05`
    assert not an.gate(rec, accept_near_ties=0.01).passed
    accepting = make_run(gate={"accept_near_ties": 0.05})
    _flip(accepting, "B", "fresh-1024-0", 1, 5)
    v = an.gate(accepting)
    assert v.passed, v.failures
    parity = next(c for c in v.checks if c.name == "parity")
    assert "1 near-tie flip(s) accepted" in parity.detail
    assert any("accepted near-tie flip" in n and "fresh-1024-0" in n for n in v.notes)


def test_verdict_broken_when_the_margin_is_over_the_tolerance() -> None:
    rec = make_run(gate={"accept_near_ties": 0.01})
    _flip(rec, "B", "fresh-1024-0", 1, 5)  # 0.02 nats apart
    row = _row(rec)
    assert row["verdict"] == "broken" and row["tolerance"] == pytest.approx(0.01) and "0.02" in row["verdict_why"]
    v = an.gate(rec)
    assert not v.passed and "verdict broken" in v.failures[0]


def test_verdict_broken_when_the_token_is_not_the_runner_up() -> None:
    rec = make_run(gate={"accept_near_ties": 0.05})
    ref_id = find(rec, "A", "fresh-1024-0", 1).output_ids[2]
    _flip(rec, "B", "fresh-1024-0", 1, 2, chosen_offset=7,
          ref_top=[(ref_id, -0.70), (ref_id + 1, -0.71)])  # the reference's runner-up is another token
    row = _row(rec)
    assert row["verdict"] == "broken" and "not the runner-up" in row["verdict_why"]
    assert not an.gate(rec).passed


def test_verdict_from_one_side_and_none_without_logprobs() -> None:
    rec = make_run(gate={"accept_near_ties": 0.05})
    _flip(rec, "B", "fresh-1024-0", 1, 0, arm_top=None)  # only the reference shows the near tie
    assert _row(rec)["verdict"] == "near-tie flip"
    assert an.gate(rec).passed
    rec = make_run(gate={"accept_near_ties": 0.05})
    _flip(rec, "B", "fresh-1024-0", 1, 0, arm_top=None, ref_top=None)
    row = _row(rec)
    assert row["verdict"] == "broken" and "cannot be shown" in row["verdict_why"]


def test_verdict_equal_beyond_k_and_stability_never_accepts_a_flip() -> None:
    rec = make_run(rounds=3, lengths=(1024,), gate={"accept_near_ties": 0.05})
    _flip(rec, "B", "fresh-1024-0", 1, 12)  # after the first 8 ids: equal over K, still classified
    row = _row(rec)
    assert row["verdict"] == "equal" and row["classification"] == "near-tie"
    r1, r3 = find(rec, "A", "fresh-1024-0", 1), find(rec, "A", "fresh-1024-0", 3)
    i = r1.output_ids[4]
    r3.output_ids[4] = i + 1
    r3.logprobs[4] = [(i + 1, -0.70), (i, -0.72)]
    r1.logprobs[4] = [(i, -0.70), (i + 1, -0.72)]
    stab = an.parity_frame(rec).query("check == 'stability' and round == 3").iloc[0]
    assert stab["verdict"] == "near-tie flip"
    v = an.gate(rec)
    assert not v.passed and checks(v)["reference-stable"] is False  # the reference must be deterministic


def test_parity_reference_and_an_arms_own_tolerance() -> None:
    """gate.parity_reference: ids against C while ratios stay against A; an arm's own accept_near_ties
    accepts its flips (and only its), the others stay exact."""
    rec = make_run(arms=("A", "B", "C"), gate={"parity_reference": "C"})
    rec.profile["arms"][1]["accept_near_ties"] = 0.03  # B: another engine, say
    for arm in ("A", "B"):  # both flip against C at position 3, 0.02 nats apart
        s, r = find(rec, arm, "fresh-1024-0", 1), find(rec, "C", "fresh-1024-0", 1)
        ref_id = r.output_ids[3]
        s.output_ids[3] = ref_id + 1
        s.logprobs[3] = [(ref_id + 1, -0.70), (ref_id, -0.72)]
        r.logprobs[3] = [(ref_id, -0.70), (ref_id + 1, -0.72)]
    p = an.parity_frame(rec)
    assert set(p[p["check"] == "parity"]["arm"]) == {"A", "B"} and set(p["against_arm"]) == {"C"}
    assert set(p[p["check"] == "stability"]["arm"]) == {"C"}
    row_b, row_a = _row(rec, "B"), _row(rec, "A")
    assert row_b["verdict"] == "near-tie flip" and row_b["tolerance"] == pytest.approx(0.03) and row_b["accepts"]
    assert row_a["verdict"] == "near-tie flip" and row_a["tolerance"] == pytest.approx(an.NEAR_TIE_NATS)
    assert not row_a["accepts"]
    v = an.gate(rec)
    assert not v.passed and len(v.failures) == 1 and "arm A" in v.failures[0] and "vs C" in v.failures[0]
    assert any("arm B's accept_near_ties = 0.03" in n for n in v.notes)
    assert checks(v)["reference"] is True
    assert "A:" in next(c for c in v.checks if c.name == "reference").detail  # ratios still divide by A
    assert set(an.paired_ratios(rec)["reference"]) == {"A"}
    assert an.gate(rec, accept_near_ties=0.05).passed  # the gate-wide tolerance covers A; B keeps its own
    tight = make_run(arms=("A", "B", "C"), gate={"parity_reference": "C", "accept_near_ties": 0.05})
    tight.profile["arms"][1]["accept_near_ties"] = 0.01
    _flip_against(tight, "B", "C", 3)
    row = _row(tight, "B")
    assert row["verdict"] == "broken" and row["tolerance"] == pytest.approx(0.01)  # the arm's own wins
    assert not an.gate(tight).passed


def _flip_against(rec: RunRecord, arm: str, ref: str, pos: int) -> None:
    s, r = find(rec, arm, "fresh-1024-0", 1), find(rec, ref, "fresh-1024-0", 1)
    ref_id = r.output_ids[pos]
    s.output_ids[pos] = ref_id + 1
    s.logprobs[pos] = [(ref_id + 1, -0.70), (ref_id, -0.72)]
    r.logprobs[pos] = [(ref_id, -0.70), (ref_id + 1, -0.72)]


def test_parity_reference_missing_samples_fails_the_reference_check() -> None:
    rec = make_run(arms=("A", "B", "C"), gate={"parity_reference": "C"})
    for s in rec.samples:
        if s.arm == "C":
            s.ok, s.error_kind, s.error, s.output_ids = False, "connect", "down", []
    v = an.gate(rec)
    assert checks(v)["reference"] is False
    assert any("parity reference C has no ok measured sample" in f for f in v.failures)


def test_logprob_agreement_over_the_agreeing_prefix() -> None:
    rec = make_run()
    s, r = find(rec, "B", "fresh-1024-0", 1), find(rec, "A", "fresh-1024-0", 1)
    for pos, d in ((0, 0.10), (1, 0.02), (2, 0.04)):  # B's chosen-token logprob off by d; its runner-up not
        tok = s.output_ids[pos]
        s.logprobs[pos] = [(tok, r.logprobs[pos][0][1] - d), r.logprobs[pos][1]]
    row = _row(rec)
    assert row["lp_positions"] == MAX_TOKENS  # identical ids: every position counts
    assert row["lp_delta_max"] == pytest.approx(0.10) and row["margin_delta_max"] == pytest.approx(0.10)
    assert row["lp_delta_median"] == pytest.approx(0.0)
    _flip(rec, "B", "fresh-1024-0", 1, 1)  # diverging at 1: only position 0 is compared
    row = _row(rec)
    assert row["lp_positions"] == 1 and row["lp_delta_max"] == pytest.approx(0.10)


def test_profile_parity_reference_must_be_an_arm_and_arms_subset_drops_it() -> None:
    from abbench.profile import profile_from_dict

    base = {"name": "x", "engine": {"command": ["e", "{port}"]},
            "arms": [{"name": "a"}, {"name": "b", "accept_near_ties": 0.2}, {"name": "c"}]}
    with pytest.raises(Exception, match="parity_reference 'z' is not an arm"):
        profile_from_dict({**base, "gate": {"parity_reference": "z"}})
    with pytest.raises(Exception, match="accept_near_ties"):
        profile_from_dict({**base, "arms": [{"name": "a"}, {"name": "b", "accept_near_ties": -1}]})
    p = profile_from_dict({**base, "gate": {"parity_reference": "c"}})
    assert p.parity_reference_arm == "c" and p.reference_arm == "a" and p.arm("b").accept_near_ties == 0.2
    sub = p.with_overrides(arms=["b", "a"])
    assert sub.gate.parity_reference is None and sub.parity_reference_arm == "b"


def test_flip_verdict_rules() -> None:
    from abbench.analysis.parity import flip_verdict

    assert flip_verdict(1, 2, [(1, -0.5), (2, -0.5)], [(2, -0.5), (1, -0.5)], 0.05)[0] == "near-tie flip"  # exact tie
    assert flip_verdict(1, 2, [(2, -0.5), (1, -0.6)], None, 0.05)[0] == "broken"  # chose the less likely one
    assert flip_verdict(1, None, [(1, -0.5), (2, -0.51)], None, 0.05)[0] == "broken"  # lengths differ
    # three near-equal tokens: the other's choice third on this side, within the tolerance, is a near tie;
    # beyond it, or past the end of the list this side captured, it is not
    v, margin, why = flip_verdict(1, 2, [(1, -0.5), (3, -0.51), (2, -0.52)], [(2, -0.5), (1, -0.51)], 0.05)
    assert v == "near-tie flip" and margin == pytest.approx(0.02) and "rank 3" in why
    assert flip_verdict(1, 2, [(1, -0.5), (3, -0.51), (2, -0.6)], None, 0.05)[0] == "broken"  # third, 0.1 below
    v, _, why = flip_verdict(1, 2, [(1, -0.5), (3, -0.51)], [(2, -0.5), (1, -0.51)], 0.05)
    assert v == "broken" and "not the runner-up" in why  # top-2 only on this side: 2 is not shown there
    assert "at least 0.0100 nats below" in why and "ask for more" in why  # within the tolerance: more would tell
    v, _, why = flip_verdict(1, 2, [(1, -0.5), (3, -0.51), (4, -0.52)], None, 0.05)
    assert v == "broken" and "not among the top 3" in why and "ask for more" in why
    v, _, why = flip_verdict(1, 2, [(1, -0.5), (3, -0.6)], [(2, -0.5), (1, -0.51)], 0.05)
    assert v == "broken" and "at least 0.1000 nats below, not within 0.05" in why and "ask for more" not in why
    assert flip_verdict(1, 2, [(3, -0.5), (1, -0.51), (2, -0.52)], None, 0.05)[0] == "broken"  # 1 not greedy
    assert flip_verdict(1, 2, [(3, -0.5), (2, -0.51)], None, 0.05)[0] == "broken"  # 1 not in its own list
    assert flip_verdict(1, 2, [(1, -0.5), (2, -0.51)], [(2, -0.5), (1, -0.9)], 0.05)[0] == "broken"  # other side clear
    with pytest.raises(Exception, match="accept_near_ties"):
        from abbench.profile import profile_from_dict

        profile_from_dict({"name": "x", "engine": {"command": ["e", "{port}"]}, "arms": [{"name": "a"}],
                           "gate": {"accept_near_ties": 0}})
