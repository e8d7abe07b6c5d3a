"""Derived numbers and the gate's verdict, computed from one :class:`~abbench.results.RunRecord` (pure).

Contract
--------
Every function here reads a ``RunRecord`` and returns pandas DataFrames or dataclasses: no I/O, no
printing, no randomness beyond a fixed-seed bootstrap. Nothing computed here is written back into the run
(derived metrics are never stored twice). Units: seconds (``*_s``), bytes (``*_bytes``), ratios as plain
floats; :mod:`abbench.report` formats them for humans.

Which samples count
-------------------
*Measured* samples are those the profile's pre-registered rule did not exclude (``Sample.excluded`` is
False); only measured samples with ``ok`` enter the statistics. When one planned step has several samples
(a retried request), the last ok one is used.

Pairing (ABBA)
--------------
A pair is (arm sample, reference sample) for the same prompt **in the same round**; the arm order reverses
every round, so drift falls equally on both sides. The paired ratio is TTFT(arm) / TTFT(reference): below
1 the arm is faster. Per (arm, prompt kind, prompt length) the summary gives the median ratio and a 95%
percentile-bootstrap interval of that median (``scipy.stats.bootstrap``, seed 0); verdict "faster" when the
whole interval is below 1, "slower" when above, "not significant" when it contains 1, and "undetermined"
when there is no interval (one pair). Fewer than :data:`SMALL_N` pairs carry a plain note.

Parity
------
Each measured ok sample of a non-reference arm is compared with the reference arm's sample of the same
prompt in the same round (the nearest other round when that one is missing, failed or carries no ids; the
row says so). The first K ids (``gate.parity_tokens``) must be equal. Rows also give the first diverging
position over the whole output, the agreeing prefix out of ``request.max_tokens``, and at the divergence
the top-2 logprob margin of both sides: "near-tie" when either margin is below :data:`NEAR_TIE_NATS`,
"divergence" when both are clear, "margin unknown" without logprobs. The reference arm is checked against
itself across rounds (its lowest round is the baseline): a reference that is not deterministic makes
parity meaningless. ``ids_source`` 'retokenized' is flagged; 'none' cannot be checked.

Gate rules (:func:`gate`)
-------------------------
The gate passes only when every check passes; it never passes on missing data.

* ``run-complete``: ``status`` is "complete" (a partial or still-running run fails).
* ``samples``: the plan has measured steps and at least one ok sample; every measured planned step has a
  sample (a missing step always fails), no sample contradicts the plan (a step index that is not planned,
  or planned for another arm or prompt), and at most ``gate.max_failed_samples`` steps have only failed
  samples.
* ``reference``: the reference arm has ok measured samples.
* ``token-ids``: no measured ok sample has ``ids_source`` 'none'.
* ``parity``: every non-reference sample equals the reference over the first K ids, and every prompt has
  a reference sample to compare with.
* ``reference-stable``: the reference's first K ids are equal across rounds.
* ``active-path`` (when ``gate.require_active_path``): for an arm with ``expect_path``, each measured ok
  sample must report that path, or another path *with* the engine's ``fallback_reason`` where either the
  prompt was *ineligible* (the engine reports ``n_chunks`` <= 1: one chunk, where a multi-chunk path and
  chunked prefill are the same loop, so the fallback is legitimate) or the arm is in
  ``gate.allow_fallback``. A path that differs without a reason (silent fallback) or no reported path at all
  fails whatever allow_fallback says; so does a fallback on an eligible (or unknown-eligibility) prompt of
  an arm not in allow_fallback. And each such arm must show its path at least once: an arm whose every
  sample fell back proved nothing, allowed or not. Allowed fallbacks are listed in the verdict's notes.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import pandas as pd
from pydantic import ValidationError

from abbench.errors import ResultsError
from abbench.profile import GateSpec
from abbench.results import RunRecord, Sample, Step

NEAR_TIE_NATS = 0.05
"""A top-2 logprob margin below this (nats) at the divergence makes it a near-tie flip, not a bug."""
SMALL_N = 5
"""Fewer pairs than this get a 'too few pairs' note."""
BOOTSTRAP_SEED = 0
BOOTSTRAP_RESAMPLES = 4000
CONFIDENCE = 0.95

KIND_ORDER = {"fresh": 0, "cold": 1, "continuation": 2, "jit": 3, "warmup": 4}


# --------------------------------------------------------------------------------------------- basics


def arm_names(record: RunRecord) -> list[str]:
    """Arms in profile order, then any arm that only the plan or the samples name."""
    names: list[str] = []
    for a in record.profile.get("arms") or []:
        if isinstance(a, dict) and a.get("name") and a["name"] not in names:
            names.append(a["name"])
    for x in [*record.plan, *record.samples]:
        if x.arm not in names:
            names.append(x.arm)
    return names


def reference_arm(record: RunRecord) -> str | None:
    """``run.reference`` of the profile, else its first arm, else the first arm of the plan."""
    ref = (record.profile.get("run") or {}).get("reference")
    if ref:
        return str(ref)
    names = arm_names(record)
    return names[0] if names else None


def gate_spec(record: RunRecord) -> GateSpec:
    """The profile's ``gate`` table, with the schema's defaults filled in."""
    try:
        return GateSpec.model_validate(record.profile.get("gate") or {})
    except ValidationError as e:
        raise ResultsError(f"run {record.run_id}: the recorded profile's gate table is invalid: {e}") from None


def expected_paths(record: RunRecord) -> dict[str, str | None]:
    return {
        a["name"]: a.get("expect_path")
        for a in record.profile.get("arms") or []
        if isinstance(a, dict) and a.get("name")
    }


def max_tokens(record: RunRecord) -> int | None:
    v = (record.profile.get("request") or {}).get("max_tokens")
    return int(v) if v else None


def _targets(record: RunRecord) -> dict[str, int]:
    return {p.id: p.target_tokens for p in record.prompts}


def _arm_rank(record: RunRecord) -> dict[str, int]:
    return {a: i for i, a in enumerate(arm_names(record))}


def _sort(df: pd.DataFrame, record: RunRecord, by: list[str]) -> pd.DataFrame:
    """Sort by arm in profile order, kind in a fixed order, then the other columns as they are."""
    if df.empty:
        return df.reset_index(drop=True)
    ranks = _arm_rank(record)
    keys: dict[str, Any] = {}
    for col in by:
        if col in ("arm", "against_arm"):
            keys[col] = lambda s: s.map(lambda a: ranks.get(a, len(ranks)))
        elif col == "kind":
            keys[col] = lambda s: s.map(lambda k: KIND_ORDER.get(k, 9))
    return df.sort_values(by, key=lambda s: keys[s.name](s) if s.name in keys else s, kind="stable").reset_index(
        drop=True
    )


def _frame(rows: list[dict[str, Any]], columns: list[str], ints: Iterable[str] = (), bools: Iterable[str] = ()) -> pd.DataFrame:
    df = pd.DataFrame(rows, columns=columns)
    for c in ints:
        df[c] = pd.array([None if _missing(v) else int(v) for v in df[c]], dtype="Int64")
    for c in bools:
        df[c] = pd.array([None if _missing(v) else bool(v) for v in df[c]], dtype="boolean")
    return df


def _missing(v: Any) -> bool:
    if v is None or v is pd.NA:
        return True
    return isinstance(v, float) and math.isnan(v)


def _is(v: Any, value: bool) -> bool:
    """``v`` is a known boolean equal to ``value`` (False for None/NA)."""
    return not _missing(v) and bool(v) is value


def _num(v: Any) -> float | None:
    if v is None or isinstance(v, bool):
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) else f


def _median(values: Iterable[Any]) -> float | None:
    xs = [x for x in (_num(v) for v in values) if x is not None]
    return float(np.median(xs)) if xs else None


def _int_or_none(v: Any) -> int | None:
    f = _num(v)
    return None if f is None else int(f)


def _max(values: Iterable[Any]) -> float | None:
    xs = [x for x in (_num(v) for v in values) if x is not None]
    return max(xs) if xs else None


def measured_ok(record: RunRecord) -> list[Sample]:
    """Measured ok samples, one per planned step (the last ok one when a step was retried)."""
    by_step: dict[tuple[int, str, int, str], Sample] = {}
    for s in record.samples:
        if s.ok and not s.excluded:
            by_step[(s.step, s.arm, s.round, s.prompt_id)] = s
    return list(by_step.values())


def where(s: Sample | Step) -> str:
    """'prompt P, arm A, round R (position N)' — how failures name a sample or step."""
    return f"prompt {s.prompt_id}, arm {s.arm}, round {s.round} (position {s.position})"


# ---------------------------------------------------------------------------------------- samples


SAMPLE_COLUMNS = [
    "step", "arm", "round", "position", "prompt_id", "kind", "target_tokens", "excluded", "measured",
    "service", "ok", "error_kind", "error", "started_at", "ttft_s", "total_s", "decode_s", "decode_tok_s",
    "prompt_tokens", "completion_tokens", "n_output_ids", "ids_source", "finish_reason", "has_logprobs",
    "prefill_path", "fallback_reason", "n_chunks", "n_windows", "cached_prompt_tokens", "h2d_bytes",
    "prefill_h2d_bytes", "decode_h2d_bytes", "d2d_bytes", "bank_bytes", "expert_copies", "measured_h2d_gbps",
    "engine_ttft_s", "engine_prefill_s", "queue_wait_s", "client_overhead_s", "after_write_s", "nvml_pcie_rx_bytes",
    "gpu_mem_used_peak", "proc_gpu_mem_peak", "host_rss_peak",
]


def _engine_ttft(engine: dict[str, Any] | None) -> float | None:
    t = (engine or {}).get("timings") or {}
    first, received = _num(t.get("first_token")), _num(t.get("received"))
    if first is None:
        return None
    return first - (received or 0.0)


def samples_frame(record: RunRecord) -> pd.DataFrame:
    """One row per sample (all of them: ``measured`` says which count). Derived columns:
    ``decode_s`` = total - TTFT; ``decode_tok_s`` = (completion_tokens - 1) / decode_s; ``engine_ttft_s`` =
    the engine's first_token - received; ``client_overhead_s`` = harness TTFT - engine_ttft_s."""
    return _sample_frame(record, record.samples)


def _sample_frame(record: RunRecord, samples: list[Sample]) -> pd.DataFrame:
    targets = _targets(record)
    rows = []
    for s in samples:
        e = s.engine or {}
        t = e.get("timings") or {}
        decode_s = s.total_s - s.ttft_s if s.total_s is not None and s.ttft_s is not None else None
        tok_s = None
        if decode_s and decode_s > 0 and s.completion_tokens and s.completion_tokens > 1:
            tok_s = (s.completion_tokens - 1) / decode_s
        eng_ttft = _engine_ttft(s.engine)
        first_event = _num(t.get("first_event"))
        pf_start, pf_end = _num(t.get("prefill_start")), _num(t.get("prefill_end"))
        rows.append(
            {
                "step": s.step, "arm": s.arm, "round": s.round, "position": s.position,
                "prompt_id": s.prompt_id, "kind": s.kind,
                "target_tokens": targets.get(s.prompt_id, s.prompt_tokens),
                "excluded": s.excluded, "measured": not s.excluded, "service": s.service, "ok": s.ok,
                "error_kind": s.error_kind, "error": s.error, "started_at": s.started_at,
                "ttft_s": s.ttft_s, "total_s": s.total_s, "decode_s": decode_s, "decode_tok_s": tok_s,
                "prompt_tokens": s.prompt_tokens, "completion_tokens": s.completion_tokens,
                "n_output_ids": len(s.output_ids), "ids_source": s.ids_source,
                "finish_reason": s.finish_reason, "has_logprobs": bool(s.logprobs),
                "prefill_path": e.get("prefill_path"), "fallback_reason": e.get("fallback_reason"),
                "n_chunks": _num(e.get("n_chunks")), "n_windows": _num(e.get("n_windows")),
                "cached_prompt_tokens": _num(e.get("cached_prompt_tokens")),
                "h2d_bytes": _num(e.get("h2d_bytes")), "prefill_h2d_bytes": _num(e.get("prefill_h2d_bytes")),
                "decode_h2d_bytes": _num(e.get("decode_h2d_bytes")), "d2d_bytes": _num(e.get("d2d_bytes")),
                "bank_bytes": _num(e.get("bank_bytes")), "expert_copies": _num(e.get("expert_copies")),
                "measured_h2d_gbps": _num(e.get("measured_h2d_gbps")),
                "engine_ttft_s": eng_ttft,
                "engine_prefill_s": pf_end - pf_start if pf_start is not None and pf_end is not None else None,
                "queue_wait_s": _num(e.get("queue_wait_s")),
                "client_overhead_s": s.ttft_s - eng_ttft if s.ttft_s is not None and eng_ttft is not None else None,
                "after_write_s": s.ttft_s - first_event if s.ttft_s is not None and first_event is not None else None,
                "nvml_pcie_rx_bytes": s.telemetry.nvml_pcie_rx_bytes,
                "gpu_mem_used_peak": s.telemetry.gpu_mem_used_peak,
                "proc_gpu_mem_peak": s.telemetry.proc_gpu_mem_peak,
                "host_rss_peak": s.telemetry.host_rss_peak,
            }
        )
    df = pd.DataFrame(rows, columns=SAMPLE_COLUMNS)
    return _sort(df, record, ["step"])


def _measured_ok_frame(record: RunRecord) -> pd.DataFrame:
    return _sample_frame(record, measured_ok(record))


# ------------------------------------------------------------------------------------------- TTFT


def ttft_table(record: RunRecord) -> pd.DataFrame:
    """TTFT per arm, prompt kind and length: n, median, min, max (seconds), measured ok samples only."""
    df = _measured_ok_frame(record)
    df = df[df["ttft_s"].notna()]
    rows = []
    for (arm, kind, tokens), g in df.groupby(["arm", "kind", "target_tokens"], sort=False, dropna=False):
        t = g["ttft_s"].astype(float)
        rows.append(
            {"arm": arm, "kind": kind, "target_tokens": _int_or_none(tokens), "n": len(t), "median_s": float(t.median()),
             "min_s": float(t.min()), "max_s": float(t.max()),
             "decode_tok_s": _median(g["decode_tok_s"])}
        )
    out = _frame(rows, ["arm", "kind", "target_tokens", "n", "median_s", "min_s", "max_s", "decode_tok_s"],
                 ints=["target_tokens"])
    return _sort(out, record, ["arm", "kind", "target_tokens"])


# ---------------------------------------------------------------------------------- paired ratios


PAIR_COLUMNS = ["arm", "reference", "prompt_id", "kind", "target_tokens", "round", "arm_position",
                "ref_position", "arm_ttft_s", "ref_ttft_s", "ratio"]


def paired_ratios(record: RunRecord) -> pd.DataFrame:
    """One row per (non-reference arm, prompt, round) where both the arm and the reference have a measured
    ok sample with a TTFT in that round: ``ratio`` = arm TTFT / reference TTFT."""
    ref = reference_arm(record)
    targets = _targets(record)
    latest: dict[tuple[str, str, int], Sample] = {}
    for s in sorted(measured_ok(record), key=lambda x: x.step):
        if s.ttft_s is not None and s.ttft_s > 0:
            latest[(s.arm, s.prompt_id, s.round)] = s
    rows = []
    for (arm, pid, rnd), s in latest.items():
        if arm == ref:
            continue
        r = latest.get((ref, pid, rnd)) if ref else None
        if r is None:
            continue
        assert s.ttft_s is not None and r.ttft_s is not None
        rows.append(
            {"arm": arm, "reference": ref, "prompt_id": pid, "kind": s.kind,
             "target_tokens": targets.get(pid, s.prompt_tokens), "round": rnd, "arm_position": s.position,
             "ref_position": r.position, "arm_ttft_s": s.ttft_s, "ref_ttft_s": r.ttft_s,
             "ratio": s.ttft_s / r.ttft_s}
        )
    out = _frame(rows, PAIR_COLUMNS, ints=["target_tokens"])
    return _sort(out, record, ["arm", "kind", "target_tokens", "prompt_id", "round"])


@dataclass(frozen=True)
class MedianCI:
    median: float
    low: float | None
    high: float | None
    note: str | None


def median_ci(values: Iterable[float], *, seed: int = BOOTSTRAP_SEED, n_resamples: int = BOOTSTRAP_RESAMPLES,
              confidence: float = CONFIDENCE) -> MedianCI:
    """Median of ``values`` and a percentile-bootstrap interval of it (None when n < 2 or it fails)."""
    from scipy import stats

    xs = np.asarray([float(v) for v in values], dtype=float)
    if xs.size == 0:
        raise ValueError("median_ci of no values")
    med = float(np.median(xs))
    if xs.size < 2:
        return MedianCI(med, None, None, "n=1: a single pair, no interval")
    kwargs: dict[str, Any] = {}
    if "rng" in inspect.signature(stats.bootstrap).parameters:
        kwargs["rng"] = np.random.default_rng(seed)
    else:  # scipy < 1.15
        kwargs["random_state"] = np.random.default_rng(seed)
    try:
        res = stats.bootstrap(
            (xs,), np.median, n_resamples=n_resamples, confidence_level=confidence, method="percentile",
            vectorized=True, axis=-1, **kwargs,
        )
    except Exception as e:  # noqa: BLE001 - any failure means: no interval, said plainly
        return MedianCI(med, None, None, f"bootstrap failed ({type(e).__name__}: {e}); no interval")
    low, high = float(res.confidence_interval.low), float(res.confidence_interval.high)
    if math.isnan(low) or math.isnan(high):
        return MedianCI(med, None, None, "bootstrap gave no interval")
    note = f"n={xs.size}: too few pairs for a reliable interval" if xs.size < SMALL_N else None
    return MedianCI(med, low, high, note)


def verdict(low: float | None, high: float | None) -> str:
    """'faster' (interval below 1), 'slower' (above 1), 'not significant' (contains 1), 'undetermined'."""
    if low is None or high is None:
        return "undetermined"
    if high < 1.0:
        return "faster"
    if low > 1.0:
        return "slower"
    return "not significant"


RATIO_COLUMNS = ["arm", "reference", "kind", "target_tokens", "n", "median_ratio", "ci_low", "ci_high",
                 "verdict", "note"]


def ratio_summary(record: RunRecord, pairs: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per (arm, kind, length): n pairs, median paired ratio, its 95% bootstrap interval and the verdict."""
    if pairs is None:
        pairs = paired_ratios(record)
    rows = []
    for (arm, ref, kind, tokens), g in pairs.groupby(["arm", "reference", "kind", "target_tokens"], sort=False, dropna=False):
        ci = median_ci(g["ratio"].astype(float))
        rows.append(
            {"arm": arm, "reference": ref, "kind": kind, "target_tokens": _int_or_none(tokens), "n": len(g),
             "median_ratio": ci.median, "ci_low": ci.low, "ci_high": ci.high,
             "verdict": verdict(ci.low, ci.high), "note": ci.note}
        )
    out = _frame(rows, RATIO_COLUMNS, ints=["target_tokens"])
    return _sort(out, record, ["arm", "kind", "target_tokens"])


# ------------------------------------------------------------------------------------------ parity


PARITY_COLUMNS = [
    "check", "prompt_id", "kind", "target_tokens", "arm", "round", "position", "step", "against_arm",
    "against_round", "other_round", "k", "match", "first_diverging", "agree", "max_tokens", "n_ids",
    "n_ids_against", "id", "id_against", "margin", "margin_against", "classification", "ids_source",
    "ids_source_against", "note",
]


def _lp_margin(logprobs: list[list[tuple[int, float]]] | None, pos: int) -> float | None:
    """Top-2 logprob margin (nats) at output position ``pos``, when captured with at least two entries."""
    if not logprobs or pos >= len(logprobs):
        return None
    top = logprobs[pos]
    if not top or len(top) < 2:
        return None
    a, b = _num(top[0][1]), _num(top[1][1])
    return None if a is None or b is None else a - b


def compare_ids(a: list[int], b: list[int], k: int) -> tuple[bool, int | None, int]:
    """(match within the first k ids, first diverging position or None when identical, agreeing prefix).
    Outputs of different lengths diverge where the shorter one ends."""
    n = min(len(a), len(b))
    agree = next((i for i in range(n) if a[i] != b[i]), n)
    if agree < n or len(a) != len(b):
        first: int | None = agree
    else:
        first = None
    return (first is None or first >= k), first, agree


def _classify(first: int | None, margins: list[float | None], near_tie: float) -> str:
    if first is None:
        return "identical"
    known = [m for m in margins if m is not None]
    if not known:
        return "margin unknown"
    return "near-tie" if min(known) < near_tie else "divergence"


def parity_tokens_of(record: RunRecord, parity_tokens: int | None = None) -> int:
    return int(parity_tokens) if parity_tokens else gate_spec(record).parity_tokens


def parity_frame(record: RunRecord, *, parity_tokens: int | None = None,
                 near_tie_nats: float = NEAR_TIE_NATS) -> pd.DataFrame:
    """Parity rows: ``check`` 'parity' (a non-reference sample vs the reference) and 'stability' (a
    reference sample of a later round vs its lowest round). ``match`` is None when the row could not be
    checked (``note`` says why); ``classification``: identical / near-tie / divergence / margin unknown /
    unchecked."""
    k = parity_tokens_of(record, parity_tokens)
    ref = reference_arm(record)
    n_max = max_tokens(record)
    targets = _targets(record)
    samples = sorted(measured_ok(record), key=lambda s: s.step)
    ref_by: dict[str, dict[int, Sample]] = {}
    for s in samples:
        if s.arm == ref and s.ids_source != "none":
            ref_by.setdefault(s.prompt_id, {})[s.round] = s  # the last usable one per round
    rows: list[dict[str, Any]] = []

    def row(check: str, s: Sample, r: Sample | None, other_round: bool, note: list[str]) -> None:
        base = {
            "check": check, "prompt_id": s.prompt_id, "kind": s.kind,
            "target_tokens": targets.get(s.prompt_id, s.prompt_tokens), "arm": s.arm, "round": s.round,
            "position": s.position, "step": s.step, "k": k, "max_tokens": n_max or len(s.output_ids),
            "n_ids": len(s.output_ids), "ids_source": s.ids_source,
        }
        if s.ids_source == "retokenized":
            note.append(f"{s.arm} ids retokenized from text")
        if r is None or s.ids_source == "none":
            if s.ids_source == "none":
                note.append("engine returned no token ids")
            rows.append({**base, "against_arm": ref, "match": None, "classification": "unchecked",
                         "other_round": other_round, "note": "; ".join(note)})
            return
        if r.ids_source == "retokenized":
            note.append(f"{r.arm} ids retokenized from text")
        match, first, agree = compare_ids(s.output_ids, r.output_ids, k)
        m_s = m_r = None
        id_s = id_r = None
        if first is not None:
            m_s, m_r = _lp_margin(s.logprobs, first), _lp_margin(r.logprobs, first)
            id_s = s.output_ids[first] if first < len(s.output_ids) else None
            id_r = r.output_ids[first] if first < len(r.output_ids) else None
            if m_s is None and m_r is None:
                note.append("no logprobs at the divergence")
        rows.append(
            {**base, "against_arm": r.arm, "against_round": r.round, "other_round": other_round,
             "match": match, "first_diverging": first, "agree": agree, "n_ids_against": len(r.output_ids),
             "id": id_s, "id_against": id_r, "margin": m_s, "margin_against": m_r,
             "classification": _classify(first, [m_s, m_r], near_tie_nats),
             "ids_source_against": r.ids_source, "note": "; ".join(note)}
        )

    for s in samples:
        if s.arm == ref:
            continue
        by_round = ref_by.get(s.prompt_id, {})
        if s.round in by_round:
            row("parity", s, by_round[s.round], False, [])
        elif by_round:
            other = min(by_round, key=lambda rr: (abs(rr - s.round), rr))
            row("parity", s, by_round[other], True,
                [f"reference round {s.round} missing or failed; compared with its round {other}"])
        else:
            row("parity", s, None, False, [f"no usable {ref} sample of this prompt in any round"])
    for by_round in ref_by.values():
        base_round = min(by_round)
        for rnd, s in sorted(by_round.items()):
            if rnd != base_round:
                row("stability", s, by_round[base_round], False, [])
    for s in samples:  # reference samples without ids: unchecked stability rows, so nothing hides
        if s.arm == ref and s.ids_source == "none":
            row("stability", s, None, False, [])
    out = _frame(rows, PARITY_COLUMNS, ints=["target_tokens", "against_round", "first_diverging", "agree",
                                             "n_ids_against", "id", "id_against"],
                 bools=["match", "other_round"])
    return _sort(out, record, ["check", "arm", "kind", "target_tokens", "prompt_id", "round"])


# ------------------------------------------------------------------------------------- active path


PATH_COLUMNS = ["arm", "prompt_id", "kind", "target_tokens", "round", "position", "step", "expect_path",
                "prefill_path", "fallback_reason", "n_chunks", "eligible", "status", "allowed"]


def active_path_samples(record: RunRecord) -> pd.DataFrame:
    """Per measured ok sample: the expected and the reported prefill path, and a ``status``:
    'active' (as expected), 'fallback' (another path, with the engine's reason), 'silent' (another path,
    no reason), 'unreported' (the engine reported no path), 'no expectation' (the arm sets none).
    ``eligible`` is False for a one-chunk prompt (engine n_chunks <= 1), True for more, NA when unknown.
    ``allowed`` is the gate's judgement of the sample alone (see the module docstring; the gate also needs
    each arm with expect_path to show its path at least once)."""
    expect = expected_paths(record)
    allow = set(gate_spec(record).allow_fallback)
    targets = _targets(record)
    rows = []
    for s in sorted(measured_ok(record), key=lambda x: x.step):
        e = s.engine or {}
        exp, got, reason = expect.get(s.arm), e.get("prefill_path"), e.get("fallback_reason")
        n_chunks = _num(e.get("n_chunks"))
        if exp is None:
            status = "no expectation"
        elif got is None:
            status = "unreported"
        elif got == exp:
            status = "active"
        elif reason:
            status = "fallback"
        else:
            status = "silent"
        eligible = None if n_chunks is None else n_chunks > 1
        allowed = status in ("active", "no expectation") or (
            status == "fallback" and (s.arm in allow or eligible is False)
        )
        rows.append(
            {"arm": s.arm, "prompt_id": s.prompt_id, "kind": s.kind,
             "target_tokens": targets.get(s.prompt_id, s.prompt_tokens), "round": s.round,
             "position": s.position, "step": s.step, "expect_path": exp, "prefill_path": got,
             "fallback_reason": reason, "n_chunks": n_chunks,
             "eligible": eligible, "status": status, "allowed": allowed}
        )
    out = _frame(rows, PATH_COLUMNS, ints=["target_tokens", "n_chunks"], bools=["eligible", "allowed"])
    return _sort(out, record, ["arm", "step"])


def _counts(values: Iterable[Any], none_label: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        key = none_label if _missing(v) else str(v)
        out[key] = out.get(key, 0) + 1
    return out


PATH_SUMMARY_COLUMNS = ["arm", "expect_path", "n", "paths", "fallback_reasons", "active", "fallback",
                        "fallback_ineligible", "silent", "unreported", "allow_fallback", "passed"]


def active_path_summary(record: RunRecord, samples: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per arm: expected path, counts of reported paths (``paths``: dict) and fallback reasons, and how
    many samples were active / fell back (with a reason; of which on ineligible one-chunk prompts) /
    silently differed / reported nothing; ``passed`` is the gate's judgement of the arm."""
    if samples is None:
        samples = active_path_samples(record)
    allow = set(gate_spec(record).allow_fallback)
    expect = expected_paths(record)
    rows = []
    for arm in arm_names(record):
        g = samples[samples["arm"] == arm]
        if g.empty:
            continue
        st = g["status"]
        fb = g[st == "fallback"]
        rows.append(
            {"arm": arm, "expect_path": expect.get(arm), "n": len(g),
             "paths": _counts(g["prefill_path"], "(not reported)"),
             "fallback_reasons": _counts(g["fallback_reason"].dropna(), ""),
             "active": int((st == "active").sum()), "fallback": len(fb),
             "fallback_ineligible": int((fb["eligible"] == False).sum()),
             "silent": int((st == "silent").sum()), "unreported": int((st == "unreported").sum()),
             "allow_fallback": arm in allow,
             "passed": bool(g["allowed"].all()) and (expect.get(arm) is None or bool((st == "active").any()))}
        )
    return _frame(rows, PATH_SUMMARY_COLUMNS)


# --------------------------------------------------------------------------------------------- H2D


FLOOR_KINDS = ("fresh", "cold")
H2D_COLUMNS = ["arm", "kind", "target_tokens", "n", "h2d_bytes", "prefill_h2d_bytes", "decode_h2d_bytes",
               "bank_bytes", "banks", "nvml_bytes", "engine_over_nvml", "n_windows", "measured_h2d_gbps",
               "floor_s", "ttft_s", "ttft_over_floor"]


def h2d_table(record: RunRecord) -> pd.DataFrame:
    """Per arm, kind and length (medians over measured ok samples): the engine's H2D bytes (whole request,
    and its prefill/decode split), the prefill bytes in banks (prefill_h2d / bank_bytes; the whole request's
    bytes when the engine gives no split), NVML's PCIe RX estimate and engine/NVML (median of per-sample
    ratios of the whole request's bytes), and the copy floor = n_windows x bank_bytes / measured H2D
    bandwidth (GB/s = 1e9 bytes/s; one bank per window), with the median TTFT over that floor. The floor is
    given only for prompts that start from an empty cache (kinds in :data:`FLOOR_KINDS`): a continuation
    served from the prefix cache may legitimately copy less. Rows only where the engine or NVML gave
    numbers."""
    df = _measured_ok_frame(record)
    rows = []
    for (arm, kind, tokens), g in df.groupby(["arm", "kind", "target_tokens"], sort=False, dropna=False):
        if g["h2d_bytes"].isna().all() and g["nvml_pcie_rx_bytes"].isna().all():
            continue
        h2d, bank, nvml = g["h2d_bytes"], g["bank_bytes"], g["nvml_pcie_rx_bytes"]
        ratio = (h2d / nvml.where(nvml > 0)).dropna()
        windows = g["n_windows"].fillna(1.0).clip(lower=1.0)
        gbps = g["measured_h2d_gbps"]
        floor = (bank * windows / (gbps.where(gbps > 0) * 1e9)).dropna()
        if kind not in FLOOR_KINDS:
            floor = floor.iloc[0:0]
        prefill = g["prefill_h2d_bytes"].where(g["prefill_h2d_bytes"].notna(), h2d)
        med_h2d, med_bank = _median(h2d), _median(bank)
        floor_s, ttft = _median(floor), _median(g["ttft_s"])
        rows.append(
            {"arm": arm, "kind": kind, "target_tokens": _int_or_none(tokens), "n": len(g), "h2d_bytes": med_h2d,
             "prefill_h2d_bytes": _median(g["prefill_h2d_bytes"]),
             "decode_h2d_bytes": _median(g["decode_h2d_bytes"]), "bank_bytes": med_bank,
             "banks": _median((prefill / bank.where(bank > 0)).dropna()),
             "nvml_bytes": _median(nvml), "engine_over_nvml": _median(ratio),
             "n_windows": _median(g["n_windows"]), "measured_h2d_gbps": _median(gbps), "floor_s": floor_s,
             "ttft_s": ttft, "ttft_over_floor": ttft / floor_s if ttft and floor_s else None}
        )
    out = _frame(rows, H2D_COLUMNS, ints=["target_tokens"])
    return _sort(out, record, ["arm", "kind", "target_tokens"])


def floor_table(record: RunRecord) -> pd.DataFrame:
    """The physical floor of a fresh prompt's TTFT, per kind and length (prompts that start from an empty
    cache): max(compute floor, copy floor), where the compute floor is the median TTFT of the arm(s) whose
    expected path is ``resident`` (nothing streamed) and the copy floor is one bank over the measured H2D
    bandwidth. Each arm's median TTFT over that floor says how close it gets (1.0 = at the floor). Empty
    when the run has neither a resident arm nor engine bank/bandwidth numbers."""
    df = _measured_ok_frame(record)
    if df.empty:
        return _frame([], FLOOR_COLUMNS)
    df = df[df["kind"].isin(FLOOR_KINDS)]
    resident_arms = [a for a, p in expected_paths(record).items() if p == "resident"]
    rows = []
    for (kind, tokens), g in df.groupby(["kind", "target_tokens"], sort=False, dropna=False):
        gbps = g["measured_h2d_gbps"]
        copy = (g["bank_bytes"] / (gbps.where(gbps > 0) * 1e9)).dropna()
        copy_s = _median(copy)
        compute_s = _median(g[g["arm"].isin(resident_arms)]["ttft_s"]) if resident_arms else None
        known = [v for v in (copy_s, compute_s) if v is not None]
        if not known:
            continue
        floor_s = max(known)
        bound = "copy" if copy_s is not None and floor_s == copy_s else "compute"
        for arm, ga in g.groupby("arm", sort=False):
            ttft = _median(ga["ttft_s"])
            rows.append({"arm": arm, "kind": kind, "target_tokens": _int_or_none(tokens), "n": len(ga),
                         "ttft_s": ttft, "compute_floor_s": compute_s, "copy_floor_s": copy_s,
                         "floor_s": floor_s, "bound": bound,
                         "over_floor": ttft / floor_s if ttft and floor_s else None})
    out = _frame(rows, FLOOR_COLUMNS, ints=["target_tokens"])
    return _sort(out, record, ["arm", "kind", "target_tokens"])


FLOOR_COLUMNS = ["arm", "kind", "target_tokens", "n", "ttft_s", "compute_floor_s", "copy_floor_s", "floor_s",
                 "bound", "over_floor"]


# --------------------------------------------------------------------------------- client overhead


def overhead_table(record: RunRecord) -> pd.DataFrame:
    """Per arm: harness TTFT minus the engine's own (first_token - received), in seconds: n, median, min,
    max; and the median of harness TTFT minus the engine's ``first_event`` (when the server handed the first
    event to the transport): the share of the socket and the client alone. Only samples whose engine
    reports timings."""
    df = _measured_ok_frame(record)
    df = df[df["client_overhead_s"].notna()]
    rows = []
    for arm, g in df.groupby("arm", sort=False):
        o = g["client_overhead_s"].astype(float)
        rows.append({"arm": arm, "n": len(o), "median_s": float(o.median()), "min_s": float(o.min()),
                     "max_s": float(o.max()), "after_write_s": _median(g["after_write_s"]),
                     "queue_wait_s": _median(g["queue_wait_s"])})
    out = _frame(rows, ["arm", "n", "median_s", "min_s", "max_s", "after_write_s", "queue_wait_s"])
    return _sort(out, record, ["arm"])


# ------------------------------------------------------------------------------------------ memory


MEMORY_COLUMNS = ["arms", "services", "n_points", "gpu_mem_used_peak", "proc_gpu_mem_peak", "host_rss_peak"]


def service_arms(record: RunRecord) -> dict[str, list[str]]:
    """Arms served by each service key (from the service records, else the plan and samples)."""
    out: dict[str, list[str]] = {s.key: list(s.arms) for s in record.services}
    for x in [*record.plan, *record.samples]:
        arms = out.setdefault(x.service, [])
        if x.arm not in arms and not any(s.key == x.service for s in record.services):
            arms.append(x.arm)
    ranks = _arm_rank(record)
    return {k: sorted(v, key=lambda a: ranks.get(a, len(ranks))) for k, v in out.items()}


def memory_table(record: RunRecord) -> pd.DataFrame:
    """Peak memory (bytes) per arm — or per set of arms sharing a service — over the background samples
    (RunRecord.memory) and the per-request peaks (Sample.telemetry): whole-GPU used, the service's
    processes on the GPU, host RSS of the service's process tree."""
    by_service = service_arms(record)
    peaks: dict[str, dict[str, list[Any]]] = {}
    points: dict[str, int] = {}
    services: dict[str, set[str]] = {}

    def label(service: str) -> str:
        return ", ".join(by_service.get(service) or [service])

    for m in record.memory:
        lab = label(m.service)
        d = peaks.setdefault(lab, {"gpu": [], "proc": [], "rss": []})
        d["gpu"].append(m.gpu_mem_used)
        d["proc"].append(m.proc_gpu_mem)
        d["rss"].append(m.host_rss)
        points[lab] = points.get(lab, 0) + 1
        services.setdefault(lab, set()).add(m.service)
    for s in record.samples:
        lab = label(s.service)
        d = peaks.setdefault(lab, {"gpu": [], "proc": [], "rss": []})
        d["gpu"].append(s.telemetry.gpu_mem_used_peak)
        d["proc"].append(s.telemetry.proc_gpu_mem_peak)
        d["rss"].append(s.telemetry.host_rss_peak)
        services.setdefault(lab, set()).add(s.service)
    rows = []
    for lab, d in peaks.items():
        gpu, proc, rss = _max(d["gpu"]), _max(d["proc"]), _max(d["rss"])
        if gpu is None and proc is None and rss is None:
            continue
        rows.append({"arms": lab, "services": len(services.get(lab, ())), "n_points": points.get(lab, 0),
                     "gpu_mem_used_peak": gpu, "proc_gpu_mem_peak": proc, "host_rss_peak": rss})
    out = _frame(rows, MEMORY_COLUMNS, ints=["gpu_mem_used_peak", "proc_gpu_mem_peak", "host_rss_peak"])
    ranks = _arm_rank(record)
    if not out.empty:
        order = out["arms"].map(lambda a: ranks.get(a.split(", ")[0], len(ranks)))
        out = out.iloc[np.argsort(order.to_numpy(), kind="stable")].reset_index(drop=True)
    return out


# ------------------------------------------------------------------------------------ completeness


@dataclass(frozen=True)
class Completeness:
    """Planned measured steps against what the run holds."""

    status: str
    status_reason: str | None
    planned: int
    """Measured (not excluded) steps in the plan."""
    present: int
    """...of which have at least one sample."""
    ok: int
    """...of which have an ok sample."""
    missing: list[Step]
    """Measured planned steps with no sample at all."""
    failed: list[Sample]
    """The last failed sample of each measured planned step that has samples but none ok."""
    unplanned: list[Sample]
    """Samples whose step index is not in the plan (a plan/sample mismatch)."""
    excluded_planned: int
    excluded_ok: int

    @property
    def has_plan(self) -> bool:
        return self.planned > 0 or self.excluded_planned > 0


def completeness(record: RunRecord) -> Completeness:
    plan = {st.index: st for st in record.plan}
    by_step: dict[int, list[Sample]] = {}
    unplanned = []
    for s in sorted(record.samples, key=lambda x: x.step):
        if s.step in plan and plan[s.step].arm == s.arm and plan[s.step].prompt_id == s.prompt_id:
            by_step.setdefault(s.step, []).append(s)
        else:
            unplanned.append(s)
    measured = [st for st in record.plan if not st.excluded]
    excluded = [st for st in record.plan if st.excluded]
    missing = [st for st in measured if st.index not in by_step]
    failed = [by_step[st.index][-1] for st in measured
              if st.index in by_step and not any(s.ok for s in by_step[st.index])]
    ok = sum(1 for st in measured if any(s.ok for s in by_step.get(st.index, [])))
    return Completeness(
        status=record.status, status_reason=record.status_reason, planned=len(measured),
        present=len(measured) - len(missing), ok=ok, missing=missing, failed=failed, unplanned=unplanned,
        excluded_planned=len(excluded),
        excluded_ok=sum(1 for st in excluded if any(s.ok for s in by_step.get(st.index, []))),
    )


# -------------------------------------------------------------------------------------------- notes


def small_n_notes(record: RunRecord, ratios: pd.DataFrame | None = None, ttft: pd.DataFrame | None = None) -> list[str]:
    """Plain notes where the numbers rest on too few samples."""
    ratios = ratio_summary(record) if ratios is None else ratios
    ttft = ttft_table(record) if ttft is None else ttft
    notes = []
    for r in ratios.itertuples():
        if r.note:
            notes.append(f"{r.arm} vs {r.reference}, {r.kind} {r.target_tokens} tokens: {r.note}")
    rounds = {s.round for s in record.plan if not s.excluded} or {s.round for s in record.samples}
    if len(rounds) == 1:
        notes.append("one round only: no ABBA order reversal, and the reference's stability across rounds "
                     "is not checked")
    thin = ttft[ttft["n"] < 3] if not ttft.empty else ttft
    if not thin.empty:
        notes.append(f"{len(thin)} TTFT cell(s) rest on fewer than 3 samples (min/max say little)")
    return notes


# --------------------------------------------------------------------------------------------- gate


class Check(NamedTuple):
    name: str
    passed: bool
    detail: str


@dataclass
class GateVerdict:
    """The gate's verdict. ``failures`` name prompt, arm, round and position (and the token position for
    parity); ``notes`` are things that passed but a reader should know (allowed fallbacks, tolerated
    failures, retokenized ids)."""

    passed: bool
    checks: list[Check]
    failures: list[str]
    parity_tokens: int
    notes: list[str] = field(default_factory=list)


def _fmt_margin(m: Any) -> str:
    return "n/a" if _missing(m) else f"{float(m):.3f}"


def _parity_failure(r: Any, ref: str | None) -> str:
    head = f"prompt {r.prompt_id}, arm {r.arm}, round {r.round} (position {r.position})"
    if _missing(r.match):
        return f"{head}: not checked ({r.note or 'no reference'})"
    d = int(r.first_diverging)
    if _missing(r.id) or _missing(r.id_against):
        what = f"output length differs at token {d} ({r.n_ids} vs {r.n_ids_against} ids)"
    else:
        what = f"token {d} differs ({r.arm} {int(r.id)} vs {r.against_arm} {int(r.id_against)})"
    against = f"{r.against_arm} round {int(r.against_round)}"
    margins = f"top-2 margin {_fmt_margin(r.margin)} / {_fmt_margin(r.margin_against)} nats: {r.classification}"
    extra = f"; {r.note}" if r.note else ""
    return f"{head}: {what} from {against}; agree {int(r.agree)}/{r.max_tokens}; {margins}{extra}"


@dataclass
class Analysis:
    """Everything :mod:`abbench.report` shows, computed once."""

    reference: str | None
    arms: list[str]
    parity_tokens: int
    samples: pd.DataFrame
    ttft: pd.DataFrame
    pairs: pd.DataFrame
    ratios: pd.DataFrame
    parity: pd.DataFrame
    path_samples: pd.DataFrame
    path_summary: pd.DataFrame
    h2d: pd.DataFrame
    floor: pd.DataFrame
    overhead: pd.DataFrame
    memory: pd.DataFrame
    completeness: Completeness
    notes: list[str]
    gate: GateVerdict


def analyze(record: RunRecord, *, parity_tokens: int | None = None, near_tie_nats: float = NEAR_TIE_NATS) -> Analysis:
    k = parity_tokens_of(record, parity_tokens)
    ttft = ttft_table(record)
    pairs = paired_ratios(record)
    ratios = ratio_summary(record, pairs)
    parity = parity_frame(record, parity_tokens=k, near_tie_nats=near_tie_nats)
    path_samples = active_path_samples(record)
    path_summary = active_path_summary(record, path_samples)
    comp = completeness(record)
    return Analysis(
        reference=reference_arm(record), arms=arm_names(record), parity_tokens=k,
        samples=samples_frame(record), ttft=ttft, pairs=pairs, ratios=ratios, parity=parity,
        path_samples=path_samples, path_summary=path_summary, h2d=h2d_table(record),
        floor=floor_table(record), overhead=overhead_table(record), memory=memory_table(record), completeness=comp,
        notes=small_n_notes(record, ratios, ttft),
        gate=_gate(record, k, comp, parity, path_samples),
    )


def gate(record: RunRecord, *, parity_tokens: int | None = None) -> GateVerdict:
    """The gate's verdict on a run (rules in the module docstring). ``parity_tokens`` overrides
    ``gate.parity_tokens`` of the recorded profile."""
    k = parity_tokens_of(record, parity_tokens)
    return _gate(record, k, completeness(record), parity_frame(record, parity_tokens=k),
                 active_path_samples(record))


def _gate(record: RunRecord, k: int, comp: Completeness, parity: pd.DataFrame, paths: pd.DataFrame) -> GateVerdict:
    spec = gate_spec(record)
    ref = reference_arm(record)
    checks: list[Check] = []
    failures: list[str] = []
    notes: list[str] = []
    ok_samples = measured_ok(record)

    # run-complete
    if record.status == "complete":
        checks.append(Check("run-complete", True, "status complete"))
    else:
        why = f" ({record.status_reason})" if record.status_reason else ""
        checks.append(Check("run-complete", False, f"status {record.status}{why}"))
        failures.append(f"run {record.run_id} is {record.status}{why}: the gate does not pass an unfinished run")

    # samples
    fails: list[str] = []
    if not comp.has_plan:
        fails.append("the run holds no plan: completeness cannot be checked")
    elif comp.planned == 0:
        fails.append("the plan has no measured steps (every step is excluded)")
    if comp.has_plan and comp.planned and comp.ok == 0:
        fails.append("no measured step has an ok sample")
    for st in comp.missing:
        fails.append(f"missing: {where(st)}, step {st.index}: no sample")
    if comp.has_plan:  # results that do not match their own plan are not trusted
        for s in comp.unplanned:
            fails.append(f"unplanned: the sample of step {s.step} ({where(s)}) matches no planned step")
    if len(comp.failed) > spec.max_failed_samples:
        for s in comp.failed:
            fails.append(f"failed: {where(s)}, step {s.step}: {s.error_kind or 'error'}: {s.error or ''}".rstrip(": "))
    elif comp.failed:
        notes.append(f"{len(comp.failed)} failed measured sample(s) tolerated "
                     f"(gate.max_failed_samples = {spec.max_failed_samples})")
    detail = (f"{comp.ok}/{comp.planned} measured steps ok, {len(comp.missing)} missing, "
              f"{len(comp.failed)} failed (tolerated: {spec.max_failed_samples})")
    if comp.has_plan and comp.unplanned:
        detail += f", {len(comp.unplanned)} unplanned"
    checks.append(Check("samples", not fails, detail))
    failures.extend(fails)

    # reference
    ref_ok = [s for s in ok_samples if s.arm == ref]
    if ref is None or not ref_ok:
        msg = "no reference arm" if ref is None else f"reference arm {ref} has no ok measured sample"
        checks.append(Check("reference", False, msg))
        failures.append(msg)
    else:
        checks.append(Check("reference", True, f"{ref}: {len(ref_ok)} ok measured samples"))

    # token ids
    none = sorted((s for s in ok_samples if s.ids_source == "none"), key=lambda s: s.step)
    retok = [s for s in ok_samples if s.ids_source == "retokenized"]
    for s in none:
        failures.append(f"token ids: {where(s)}: the engine returned no token ids (ids_source none); "
                        "parity cannot be checked")
    detail = f"{len(none)} sample(s) without token ids"
    if retok:
        detail += f", {len(retok)} retokenized from text"
        notes.append(f"{len(retok)} sample(s) carry ids retokenized from text, not the engine's own")
    checks.append(Check("token-ids", not none, detail))

    # parity and reference stability
    for check, name in (("parity", "parity"), ("stability", "reference-stable")):
        rows = parity[parity["check"] == check]
        mismatch = (rows["match"] == False).fillna(False)
        unchecked = rows["match"].isna() & (rows["ids_source"] != "none")
        bad = rows[(mismatch | unchecked).to_numpy(dtype=bool)]
        for r in bad.itertuples():
            failures.append(f"{name}: {_parity_failure(r, ref)}")
        n_checked = int(rows["match"].notna().sum())
        if check == "stability" and rows.empty:
            detail = "one round of the reference per prompt: stability not checked"
        else:
            detail = f"{n_checked - int((rows['match'] == False).sum())}/{n_checked} equal over the first {k} ids"
            unchecked = int(rows["match"].isna().sum())
            if unchecked:
                detail += f", {unchecked} not checked"
        if check == "parity" and rows.empty:
            detail = "no non-reference sample to compare"
        if check == "parity" and not rows.empty and (rows["other_round"] == True).any():
            notes.append(f"{int((rows['other_round'] == True).sum())} parity row(s) compared with the reference "
                         "of another round (its own round's sample missing or failed)")
        checks.append(Check(name, bad.empty, detail))

    # active path
    if not spec.require_active_path:
        checks.append(Check("active-path", True, "not required (gate.require_active_path = false)"))
    else:
        expecting = paths[paths["expect_path"].notna()]
        bad = expecting[(expecting["allowed"] == False).fillna(False).to_numpy(dtype=bool)]
        for r in bad.itertuples():
            head = f"active path: prompt {r.prompt_id}, arm {r.arm}, round {r.round} (position {r.position})"
            if r.status == "unreported":
                failures.append(f"{head}: expected {r.expect_path}, the engine reported no prefill path")
            elif r.status == "silent":
                failures.append(f"{head}: expected {r.expect_path}, engine ran {r.prefill_path} "
                                "with no fallback reason (silent fallback)")
            else:
                elig = ("a multi-chunk prompt" if _is(r.eligible, True) else
                        "a prompt of unknown eligibility (the engine gave no n_chunks)")
                failures.append(f"{head}: expected {r.expect_path}, engine fell back to {r.prefill_path} on {elig} "
                                f"({r.fallback_reason}); list {r.arm} in gate.allow_fallback if this is expected")
        never: list[str] = []
        for arm, g in expecting.groupby("arm", sort=False):
            if not (g["status"] == "active").any():
                never.append(str(arm))
                failures.append(f"active path: arm {arm} never reported {g['expect_path'].iloc[0]} on any of its "
                                f"{len(g)} measured sample(s): the path was not shown to run")
        allowed_fb = expecting[((expecting["status"] == "fallback") & (expecting["allowed"] == True)).fillna(False).to_numpy(dtype=bool)]
        if not allowed_fb.empty:
            why = sorted({f"{a}: {r} ({'one-chunk prompt' if _is(e, False) else 'gate.allow_fallback'})"
                          for a, r, e in zip(allowed_fb["arm"], allowed_fb["fallback_reason"], allowed_fb["eligible"])})
            notes.append(f"{len(allowed_fb)} allowed fallback(s): " + ", ".join(why))
        if expecting.empty:
            detail = "no arm sets expect_path" if not any(expected_paths(record).values()) else \
                "no measured ok sample of an arm with expect_path"
        else:
            detail = (f"{int((expecting['status'] == 'active').sum())}/{len(expecting)} on the expected path, "
                      f"{len(allowed_fb)} allowed fallback(s), {len(bad)} not allowed")
            if never:
                detail += f"; never on the expected path: {', '.join(never)}"
        checks.append(Check("active-path", bad.empty and not never, detail))

    return GateVerdict(passed=all(c.passed for c in checks), checks=checks, failures=failures,
                       parity_tokens=k, notes=notes)
