"""Timing: TTFT tables, ABBA pairs and their paired ratios with bootstrap intervals, the client overhead,
and the notes where numbers rest on too few samples.

Pairing (ABBA)
--------------
A pair is (arm sample, reference sample) for the same prompt **in the same round**; the arm order reverses
every round, so drift falls equally on both sides. The paired ratio is TTFT(arm) / TTFT(reference): below
1 the arm is faster. Per (arm, prompt kind, prompt length) the summary gives the median ratio and a 95%
percentile-bootstrap interval of that median (``scipy.stats.bootstrap``, seed 0); verdict "faster" when the
whole interval is below 1, "slower" when above, "not significant" when it contains 1, and "undetermined"
when there is no interval (one pair). Fewer than :data:`SMALL_N` pairs carry a plain note.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from abbench.analysis.frames import (
    frame,
    int_or_none,
    measured_ok,
    measured_ok_frame,
    median_of,
    prompt_targets,
    reference_arm,
    sort_rows,
)
from abbench.results import RunRecord, Sample

SMALL_N = 5
"""Fewer pairs than this get a 'too few pairs' note."""
BOOTSTRAP_SEED = 0
BOOTSTRAP_RESAMPLES = 4000
CONFIDENCE = 0.95


# ------------------------------------------------------------------------------------------- TTFT


def ttft_table(record: RunRecord) -> pd.DataFrame:
    """TTFT per arm, prompt kind and length: n, median, min, max (seconds), measured ok samples only."""
    df = measured_ok_frame(record)
    df = df[df["ttft_s"].notna()]
    rows = []
    for (arm, kind, tokens), g in df.groupby(["arm", "kind", "target_tokens"], sort=False, dropna=False):
        t = g["ttft_s"].astype(float)
        rows.append(
            {"arm": arm, "kind": kind, "target_tokens": int_or_none(tokens), "n": len(t), "median_s": float(t.median()),
             "min_s": float(t.min()), "max_s": float(t.max()),
             "decode_tok_s": median_of(g["decode_tok_s"])}
        )
    out = frame(rows, ["arm", "kind", "target_tokens", "n", "median_s", "min_s", "max_s", "decode_tok_s"],
                 ints=["target_tokens"])
    return sort_rows(out, record, ["arm", "kind", "target_tokens"])


# ---------------------------------------------------------------------------------- paired ratios


PAIR_COLUMNS = ["arm", "reference", "prompt_id", "kind", "target_tokens", "round", "arm_position",
                "ref_position", "arm_ttft_s", "ref_ttft_s", "ratio"]


def _ttft(s: Sample) -> float | None:
    return s.ttft_s


def paired_ratios(record: RunRecord, against: str | None = None,
                  value: Callable[[Sample], float | None] = _ttft) -> pd.DataFrame:
    """One row per (arm other than the reference, prompt, round) where both the arm and the reference have a
    measured ok sample with a positive TTFT in that round (the latest of each): ``ratio`` = arm TTFT /
    reference TTFT. ``against`` pairs with that arm instead of the run's reference; ``value`` divides another
    per-sample figure (``arm_ttft_s``/``ref_ttft_s`` then hold it)."""
    ref = against or reference_arm(record)
    targets = prompt_targets(record)
    latest: dict[tuple[str, str, int], tuple[Sample, float]] = {}
    for s in sorted(measured_ok(record), key=lambda x: x.step):
        v = value(s)
        if v is not None and v > 0:
            latest[(s.arm, s.prompt_id, s.round)] = (s, v)
    rows = []
    for (arm, pid, rnd), (s, v) in latest.items():
        if arm == ref:
            continue
        got = latest.get((ref, pid, rnd)) if ref else None
        if got is None:
            continue
        r, rv = got
        rows.append(
            {"arm": arm, "reference": ref, "prompt_id": pid, "kind": s.kind,
             "target_tokens": targets.get(pid, s.prompt_tokens), "round": rnd, "arm_position": s.position,
             "ref_position": r.position, "arm_ttft_s": v, "ref_ttft_s": rv, "ratio": v / rv}
        )
    out = frame(rows, PAIR_COLUMNS, ints=["target_tokens"])
    return sort_rows(out, record, ["arm", "kind", "target_tokens", "prompt_id", "round"])


@dataclass(frozen=True)
class MedianCI:
    median: float
    low: float | None
    high: float | None
    note: str | None


def median_ci(values: Iterable[float], *, seed: int = BOOTSTRAP_SEED, n_resamples: int = BOOTSTRAP_RESAMPLES,
              confidence: float = CONFIDENCE) -> MedianCI:
    """Median of ``values`` and a percentile-bootstrap interval of it (None when n < 2 or it fails)."""
    return quantile_ci(values, 0.5, seed=seed, n_resamples=n_resamples, confidence=confidence)


def quantile_ci(values: Iterable[float], q: float, *, seed: int = BOOTSTRAP_SEED,
                n_resamples: int = BOOTSTRAP_RESAMPLES, confidence: float = CONFIDENCE) -> MedianCI:
    """The ``q`` quantile of ``values`` (numpy's linear interpolation, as ``vllm bench serve`` reports its
    percentiles) and a percentile-bootstrap interval of it, in a :class:`MedianCI` (``median`` holds the
    quantile); None bounds when n < 2 or the bootstrap fails."""
    from scipy import stats

    xs = np.asarray([float(v) for v in values], dtype=float)
    if xs.size == 0:
        raise ValueError("quantile_ci of no values")
    est = float(np.quantile(xs, q))
    if xs.size < 2:
        return MedianCI(est, None, None, "n=1: a single pair, no interval")
    kwargs: dict[str, Any] = {}
    if "rng" in inspect.signature(stats.bootstrap).parameters:
        kwargs["rng"] = np.random.default_rng(seed)
    else:  # scipy < 1.15
        kwargs["random_state"] = np.random.default_rng(seed)
    statistic = np.median if q == 0.5 else (lambda x, axis=-1: np.quantile(x, q, axis=axis))
    try:
        res = stats.bootstrap(
            (xs,), statistic, n_resamples=n_resamples, confidence_level=confidence, method="percentile",
            vectorized=True, axis=-1, **kwargs,
        )
    except Exception as e:  # noqa: BLE001 - any failure means: no interval, said plainly
        return MedianCI(est, None, None, f"bootstrap failed ({type(e).__name__}: {e}); no interval")
    low, high = float(res.confidence_interval.low), float(res.confidence_interval.high)
    if math.isnan(low) or math.isnan(high):
        return MedianCI(est, None, None, "bootstrap gave no interval")
    note = f"n={xs.size}: too few pairs for a reliable interval" if xs.size < SMALL_N else None
    return MedianCI(est, low, high, note)


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
            {"arm": arm, "reference": ref, "kind": kind, "target_tokens": int_or_none(tokens), "n": len(g),
             "median_ratio": ci.median, "ci_low": ci.low, "ci_high": ci.high,
             "verdict": verdict(ci.low, ci.high), "note": ci.note}
        )
    out = frame(rows, RATIO_COLUMNS, ints=["target_tokens"])
    return sort_rows(out, record, ["arm", "kind", "target_tokens"])


# --------------------------------------------------------------------------------- client overhead


def overhead_table(record: RunRecord) -> pd.DataFrame:
    """Per arm, what the harness adds to TTFT, in seconds. ``harness_*`` (median, p90, max): harness TTFT minus
    the engine's own span from receiving the request to handing its first event to the transport
    (``first_event``): the client, the socket, and the server's HTTP parsing before the application sees the
    request; the protocol's target is at most 1 ms median and 1.5 ms p90. ``with_write_s`` (median): harness
    TTFT minus the engine's first_token - received, i.e. also the server's own time from its first token to
    that event (its HTTP/SSE stack). Only samples whose engine reports timings; ``harness_*`` only where it
    reports ``first_event`` (a streamed response)."""
    df = measured_ok_frame(record)
    df = df[df["client_overhead_s"].notna()]
    rows = []
    for arm, g in df.groupby("arm", sort=False):
        h = pd.to_numeric(g["after_write_s"], errors="coerce").dropna().astype(float)
        rows.append({"arm": arm, "n": len(g),
                     "harness_s": float(h.median()) if len(h) else None,
                     "harness_p90_s": float(h.quantile(0.9)) if len(h) else None,
                     "harness_max_s": float(h.max()) if len(h) else None,
                     "with_write_s": median_of(g["client_overhead_s"]),
                     "queue_wait_s": median_of(g["queue_wait_s"])})
    out = frame(rows, ["arm", "n", "harness_s", "harness_p90_s", "harness_max_s", "with_write_s", "queue_wait_s"])
    return sort_rows(out, record, ["arm"])


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
