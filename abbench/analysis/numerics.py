"""Numerics: how far an arm that changes arithmetic on purpose (FP8 weights, another kernel, another dtype) moves
the model's next-token distribution away from the parity reference, from the top-k logprobs both sides return.

An arm declares ``parity = "numerics"``: its ids are still compared and shown (:mod:`~abbench.analysis.parity`),
but the gate judges it by the declared numerics checks below instead of bitwise ids (llama.cpp's
``llama-perplexity --kl-divergence`` statistics are the model for them).

Which positions
---------------
Each measured ok sample of the arm is paired with the parity reference's sample of the same prompt, as parity
pairs them (same round, else the nearest round). Both outputs are greedy, so the two sides see the same context
up to and including their first diverging position ``d``; after it their contexts differ and their distributions
are not comparable. So a pair contributes its positions ``0..d`` (all positions when the ids never diverge),
where both sides captured logprobs. At each such position:

* ``kl``: KL(reference || arm) in nats over the ids both top-k lists hold, plus one bucket for the rest of the
  vocabulary (1 - the listed mass, on each side). Merging tokens into a bucket never raises a KL divergence (the
  data-processing inequality), so this is a **lower bound** of the full-vocabulary KL; more logprobs
  (``request.logprobs``, up to 20) tighten it.
* ``same_top``: 1 when both sides' most likely token is the same, else 0. With shared contexts this is the
  per-position agreement rate of greedy decoding (the first diverging position counts as a 0).
* ``delta_p``: p_arm(t) - p_ref(t) for the reference's most likely token t; a position where the arm's list does
  not hold t gives none.
* ``kl_vocab``: at the first output position alone, KL(reference || arm) over the **whole vocabulary**, where the
  run asked for whole rows (``request.full_logprobs``: the vendored engine and the transformers reference) and
  recorded their KL (``RunRecord.vocab_kl``, :mod:`abbench.vocabrows`); none elsewhere.

Statistics and checks
---------------------
Per (arm, prompt kind, length) the positions of the selected pairs are pooled: ``kl_mean`` (mean KL),
``kl_p99`` (99th percentile of KL; at least 100 positions), ``same_top`` (rate) and ``delta_p_rms`` (root mean
square of delta-p), and ``kl_vocab_mean`` (the mean whole-vocabulary KL at the first position, one value a
pair: the KL itself where ``kl_mean`` is a bound). Intervals are 95% cluster-bootstrap intervals that resample
whole pairs (positions of one output are not independent), seed 0. A declared numerics check (``kl_mean[fp8] <= 0.01``,
``same_top[fp8, fresh] >= 0.98``) is judged on the interval over every cell its selector picks, pooled into one
cell: pass when the whole interval is on the right side of the bound, fail when wholly on the wrong side, else
inconclusive (which fails). Fewer than two pairs give no interval: inconclusive.

With random weights (the vendored engine's presets) the figures exercise the machinery, not a trained model's
quality; the report says so.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from abbench.analysis.frames import frame, measured_ok, num, parity_reference_arm, prompt_targets, sort_rows
from abbench.analysis.parity import parity_frame
from abbench.analysis.timing import BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED, CONFIDENCE
from abbench.checkexpr import numerics_checked
from abbench.errors import ConfigError
from abbench.results import RunRecord, Sample

NUMERICS_METRICS = ("kl_mean", "kl_p99", "same_top", "delta_p_rms", "kl_vocab_mean")
"""The declared metrics this module computes (their grammar entries are in :mod:`abbench.checkexpr`)."""
P99_MIN_POSITIONS = 100
"""``kl_p99`` needs at least this many positions."""
_EPS = 1e-12
NO_VOCAB_KL = ("no whole-vocabulary KL recorded: the run needs request.full_logprobs = true and engines that return "
               "whole rows (the vendored engine, the transformers reference)")

POSITION_COLUMNS = ["arm", "prompt_id", "kind", "target_tokens", "round", "against_round", "pair", "position",
                    "kl", "same_top", "delta_p", "listed", "ref_mass", "kl_vocab"]


def numerics_arms(record: RunRecord) -> list[str]:
    """The arms whose profile entry declares ``parity = "numerics"`` (judged by numerics checks instead of
    bitwise ids), in profile order."""
    return [str(a["name"]) for a in record.profile.get("arms") or []
            if isinstance(a, dict) and a.get("name") and a.get("parity") == "numerics"]


def compared_arms(record: RunRecord) -> list[str]:
    """The arms whose numerics the report shows, in profile order: :func:`numerics_arms` and every arm a declared
    numerics check names (an arm whose ids are judged against its own ``parity_reference`` can still be measured
    against the run's parity reference)."""
    try:
        named = numerics_checked(list((record.profile.get("gate") or {}).get("checks") or []))
    except ConfigError:
        named = set()
    judged = set(numerics_arms(record))
    return [str(a["name"]) for a in record.profile.get("arms") or []
            if isinstance(a, dict) and a.get("name") and (a["name"] in judged or a["name"] in named)]


def _dist(top: Any) -> dict[int, float]:
    """A top-k list of (id, logprob) as {id: probability}, an id listed twice keeping its best."""
    out: dict[int, float] = {}
    for t in top or []:
        lp = num(t[1])
        if lp is not None and math.isfinite(lp):
            out[int(t[0])] = max(out.get(int(t[0]), 0.0), math.exp(lp))
    return out


def position_stats(ref_top: Any, arm_top: Any) -> tuple[float, int, float | None, int] | None:
    """(kl, same_top, delta_p, ids in both lists) at one position from the two sides' top-k lists (module
    docstring), or None when either side has no list there. ``kl`` is over the common ids plus a rest bucket."""
    p, q = _dist(ref_top), _dist(arm_top)
    if not p or not q:
        return None
    common = [i for i in p if i in q]
    kl = 0.0
    for i in common:
        kl += p[i] * math.log(p[i] / max(q[i], _EPS))
    rest_p = max(0.0, 1.0 - sum(p[i] for i in common))
    rest_q = max(0.0, 1.0 - sum(q[i] for i in common))
    if rest_p > _EPS:
        kl += rest_p * math.log(rest_p / max(rest_q, _EPS))
    top_p, top_q = max(p, key=lambda i: (p[i], -i)), max(q, key=lambda i: (q[i], -i))
    delta = q[top_p] - p[top_p] if top_p in q else None
    return max(kl, 0.0), int(top_p == top_q), delta, len(common)


def listed_mass(top: Any) -> float | None:
    """The probability mass a top-k list holds (the sum of its probabilities); None without a list. Where it is
    small, the KL over the lists plus a bucket (:func:`position_stats`) can be far below the whole vocabulary's."""
    p = _dist(top)
    return float(sum(p.values())) if p else None


def _positions(s: Sample, r: Sample, first: int | None) -> list[tuple[int, tuple[float, int, float | None, int]]]:
    last = (min(len(s.output_ids), len(r.output_ids)) - 1) if first is None else first
    out = []
    for pos in range(last + 1):
        a = s.logprobs[pos] if s.logprobs and pos < len(s.logprobs) else None
        b = r.logprobs[pos] if r.logprobs and pos < len(r.logprobs) else None
        st = position_stats(b, a)
        if st is not None:
            out.append((pos, st))
    return out


def numerics_positions(record: RunRecord, arms: list[str] | None = None) -> pd.DataFrame:
    """One row per compared position (module docstring) of each ``arms`` sample (default:
    :func:`compared_arms`) against the run's parity reference (not an arm's own ``parity_reference``: that one
    judges its ids); ``pair`` numbers the (sample, reference sample) pairs."""
    arms = compared_arms(record) if arms is None else arms
    ref = parity_reference_arm(record)
    by_step = {s.step: s for s in measured_ok(record)}
    ref_of = {(s.prompt_id, s.round): s for s in sorted(measured_ok(record), key=lambda s: s.step) if s.arm == ref}
    targets = prompt_targets(record)
    vocab = {(v.step, v.against): (math.inf if v.kl is None else v.kl) for v in record.vocab_kl}
    rows: list[dict[str, Any]] = []
    p = parity_frame(record, own_references=False)
    p = p[(p["check"] == "parity") & p["arm"].isin(arms) & p["match"].notna()]
    for pair, row in enumerate(p.itertuples()):
        s, r = by_step.get(int(row.step)), ref_of.get((row.prompt_id, int(row.against_round)))
        if s is None or r is None:
            continue
        first = None if pd.isna(row.first_diverging) else int(row.first_diverging)
        for pos, (kl, same, delta, listed) in _positions(s, r, first):
            rows.append({"arm": s.arm, "prompt_id": s.prompt_id, "kind": s.kind,
                         "target_tokens": targets.get(s.prompt_id, s.prompt_tokens), "round": s.round,
                         "against_round": r.round, "pair": pair, "position": pos, "kl": kl, "same_top": same,
                         "delta_p": delta, "listed": listed, "ref_mass": listed_mass(r.logprobs[pos]),
                         "kl_vocab": vocab.get((s.step, r.step)) if pos == 0 else None})
    return frame(rows, POSITION_COLUMNS, ints=["target_tokens", "against_round", "pair", "position", "same_top",
                                               "listed"])


# ------------------------------------------------------------------------------------------ statistics


def _kl_mean(g: pd.DataFrame) -> float:
    return float(g["kl"].mean())


def _kl_p99(g: pd.DataFrame) -> float:
    return float(np.quantile(g["kl"].to_numpy(dtype=float), 0.99))


def _same_top(g: pd.DataFrame) -> float:
    return float(g["same_top"].mean())


def _delta_p_rms(g: pd.DataFrame) -> float:
    d = g["delta_p"].dropna().to_numpy(dtype=float)
    return float(np.sqrt(np.mean(d * d))) if d.size else math.nan


def _kl_vocab_mean(g: pd.DataFrame) -> float:
    return float(g["kl_vocab"].mean())


STATISTICS: dict[str, Callable[[pd.DataFrame], float]] = {
    "kl_mean": _kl_mean, "kl_p99": _kl_p99, "same_top": _same_top, "delta_p_rms": _delta_p_rms,
    "kl_vocab_mean": _kl_vocab_mean}
STATISTIC_COLUMN = {"kl_mean": "kl", "kl_p99": "kl", "same_top": "same_top", "delta_p_rms": "delta_p",
                    "kl_vocab_mean": "kl_vocab"}
"""The one column each statistic reads (a resample carries that column alone)."""


def _array_mean(a: np.ndarray) -> float:
    """pandas' mean of a float column (NaN left out of the count and summed as zeros), on an array: the same sum
    in the same order, so the same bits."""
    nan = np.isnan(a)
    n = a.size - int(nan.sum())
    return float(np.where(nan, 0.0, a).sum() / n) if n else math.nan


def _array_rms(a: np.ndarray) -> float:
    d = a[~np.isnan(a)]
    return float(np.sqrt(np.mean(d * d))) if d.size else math.nan


ARRAY_STATISTICS: dict[str, Callable[[np.ndarray], float]] = {
    "kl_mean": _array_mean, "kl_p99": lambda a: float(np.quantile(a, 0.99)), "same_top": _array_mean,
    "delta_p_rms": _array_rms, "kl_vocab_mean": _array_mean}
"""``STATISTICS`` over the statistic's column as a float64 array (NaN where missing), for the bootstrap's
resamples: the same values as on a frame, without a frame per resample (pandas' take was most of a numerics
report's time)."""


@dataclass(frozen=True)
class Estimate:
    """A statistic over pooled positions with its cluster-bootstrap interval (None bounds: no interval)."""

    value: float
    low: float | None
    high: float | None
    pairs: int
    positions: int
    note: str = ""


def estimate(g: pd.DataFrame, metric: str, *, seed: int = BOOTSTRAP_SEED,
             n_resamples: int = BOOTSTRAP_RESAMPLES) -> Estimate:
    """``metric`` over the positions of ``g`` and a percentile interval from resampling its pairs whole."""
    stat = STATISTICS[metric]
    if metric == "kl_vocab_mean":  # the first position of the pairs with both whole rows
        g = g[g["kl_vocab"].notna()]
        if g.empty:
            return Estimate(math.nan, None, None, 0, 0, NO_VOCAB_KL)
    pairs = sorted(int(x) for x in g["pair"].unique())
    n_pos = len(g) if metric != "delta_p_rms" else int(g["delta_p"].notna().sum())
    value = stat(g) if n_pos else math.nan
    if metric == "kl_p99" and n_pos < P99_MIN_POSITIONS:
        return Estimate(value, None, None, len(pairs), n_pos,
                        f"{n_pos} positions: a p99 needs at least {P99_MIN_POSITIONS}")
    if len(pairs) < 2 or not n_pos:
        return Estimate(value, None, None, len(pairs), n_pos, f"{len(pairs)} pair(s): no interval")
    # A resample is the picked pairs' rows in pick order, taken from the statistic's column at once: the same
    # values in the same order as concatenating the pairs' frames, as an array (``ARRAY_STATISTICS``)
    column = g[STATISTIC_COLUMN[metric]].to_numpy(dtype=float, na_value=np.nan)
    array_stat = ARRAY_STATISTICS[metric]
    rows = [np.flatnonzero((g["pair"] == p).to_numpy(dtype=bool, na_value=False)) for p in pairs]
    rng = np.random.default_rng(seed)
    draws = []
    for _ in range(n_resamples // 4):  # 1,000 resamples: pooled statistics are costlier than a median's
        pick = rng.integers(0, len(rows), len(rows))
        v = array_stat(column[np.concatenate([rows[i] for i in pick])])
        if not math.isnan(v):
            draws.append(v)
    if not draws:
        return Estimate(value, None, None, len(pairs), n_pos, "no resample had a value")
    alpha = (1 - CONFIDENCE) / 2
    low, high = (float(x) for x in np.quantile(draws, [alpha, 1 - alpha]))
    return Estimate(value, low, high, len(pairs), n_pos)


NUMERICS_COLUMNS = ["arm", "pairs", "positions", "diverged", "kl_mean", "kl_mean_low", "kl_mean_high", "kl_p99",
                    "same_top", "same_top_low", "same_top_high", "delta_p_rms", "listed_median", "ref_mass_median",
                    "kl_vocab_pairs", "kl_vocab_mean", "kl_vocab_mean_low", "kl_vocab_mean_high"]


def numerics_table(record: RunRecord, positions: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per numerics arm, over all its compared positions: pairs, positions, pairs whose ids diverged, the four
    statistics (intervals for the mean KL and same-top rate), the median number of ids both lists held and the
    median probability mass of the reference's lists (how much of the distribution the KL bound saw)."""
    pos = numerics_positions(record) if positions is None else positions
    rows = []
    for arm, g in pos.groupby("arm", sort=False):
        kl, same = estimate(g, "kl_mean"), estimate(g, "same_top")
        whole = estimate(g, "kl_vocab_mean") if g["kl_vocab"].notna().any() else None
        rows.append({"arm": arm, "pairs": kl.pairs, "positions": kl.positions,
                     "diverged": int(g.groupby("pair")["same_top"].min().eq(0).sum()),
                     "kl_mean": kl.value, "kl_mean_low": kl.low, "kl_mean_high": kl.high,
                     "kl_p99": _kl_p99(g) if len(g) >= P99_MIN_POSITIONS else None,
                     "same_top": same.value, "same_top_low": same.low, "same_top_high": same.high,
                     "delta_p_rms": _delta_p_rms(g), "listed_median": float(g["listed"].median()),
                     "ref_mass_median": float(g["ref_mass"].median()),
                     "kl_vocab_pairs": whole.positions if whole else 0,
                     "kl_vocab_mean": whole.value if whole else None,
                     "kl_vocab_mean_low": whole.low if whole else None,
                     "kl_vocab_mean_high": whole.high if whole else None})
    out = frame(rows, NUMERICS_COLUMNS, ints=["pairs", "positions", "diverged", "kl_vocab_pairs"])
    return sort_rows(out, record, ["arm"])
