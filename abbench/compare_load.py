"""``abbench compare`` for load levels: per (arm, level) cell of both runs, the change of its throughput, goodput
and latency percentiles, cand/base - 1, with a 95% percentile-bootstrap interval and the same verdicts as the
sequential cells (:mod:`abbench.compare`).

Values (:func:`abbench.analysis.load.values`): ``output_tok_s``, ``decode_output_tok_s`` and ``goodput`` one per
round (the statistic is their median), ``ttft_p50_s``, ``ttft_p99_s`` and ``itl_p99_s`` one per measured request
(ITL: per gap; the statistic is that percentile). Each run is resampled on its own (seed 0, :data:`RESAMPLES`
resamples). A cell with fewer than :data:`MIN_ROUNDS` rounds a side (throughput, goodput) or fewer values than
its percentile needs (:func:`abbench.analysis.latency.min_n`, and at least 5) is "too few to judge", never a
regression.
A regression is a change worse than the threshold (throughput and goodput lower, latency higher) with its whole
interval beyond it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from abbench.analysis.latency import min_n
from abbench.analysis.load import values
from abbench.report.format import DASH, Col, fmt_num, fmt_s, table
from abbench.results import RunRecord

__all__ = ["LOAD_CHANGE_COLUMNS", "LOAD_METRICS", "load_changes", "load_lines"]

SEED = 0
RESAMPLES = 2000
MIN_ROUNDS = 2
TOO_FEW = "too few to judge"
LOAD_CHANGE_COLUMNS = ["arm", "level", "metric", "n_base", "n_cand", "base", "cand", "change", "ci_low", "ci_high",
                       "verdict", "regression"]


@dataclass(frozen=True)
class LoadMetric:
    key: str
    label: str
    source: str
    """The metric of :func:`abbench.analysis.load.values` its values come from."""
    q: float
    lower_is_better: bool
    per_round: bool


LOAD_METRICS = (
    LoadMetric("output_tok_s", "Output tok/s", "output_tok_s", 0.5, False, True),
    LoadMetric("decode_output_tok_s", "Decode tok/s", "decode_output_tok_s", 0.5, False, True),
    LoadMetric("goodput", "Goodput req/s", "goodput", 0.5, False, True),
    LoadMetric("ttft_p50_s", "TTFT p50", "ttft_s", 0.5, True, False),
    LoadMetric("ttft_p99_s", "TTFT p99", "ttft_s", 0.99, True, False),
    LoadMetric("itl_p99_s", "ITL p99", "itl_s", 0.99, True, False),
)


def _change(vb: np.ndarray, vc: np.ndarray, q: float) -> tuple[float, float, float]:
    """cand/base - 1 of the ``q`` quantile, and its percentile-bootstrap interval (each run resampled alone)."""
    rng = np.random.default_rng(SEED)
    est = float(np.quantile(vc, q) / np.quantile(vb, q) - 1)
    rb = np.quantile(rng.choice(vb, (RESAMPLES, vb.size)), q, axis=1)
    rc = np.quantile(rng.choice(vc, (RESAMPLES, vc.size)), q, axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = rc / rb - 1
    ratios = ratios[np.isfinite(ratios)]
    if ratios.size < RESAMPLES // 2:
        return est, math.nan, math.nan
    return est, float(np.quantile(ratios, 0.025)), float(np.quantile(ratios, 0.975))


def _verdict(m: LoadMetric, lo: float, hi: float, threshold: float) -> tuple[str, bool]:
    if math.isnan(lo):
        return "no interval", False
    worse_lo, worse_hi = (lo, hi) if m.lower_is_better else (-hi, -lo)  # "worse" as a positive change
    if worse_lo > threshold:
        return "worse", True
    if worse_hi < 0:
        return "better", False
    if worse_lo > 0:
        return "worse (within the threshold)", False
    return "not significant", False


def load_changes(base: RunRecord, cand: RunRecord, threshold: float) -> pd.DataFrame:
    """One row per (arm, level, metric) of the cells both runs have (:data:`LOAD_CHANGE_COLUMNS`)."""
    rows = []
    if not base.load or not cand.load:
        return pd.DataFrame(rows, columns=LOAD_CHANGE_COLUMNS)
    for m in LOAD_METRICS:
        vb_all, vc_all = values(base, m.source), values(cand, m.source)
        keys = sorted(set(zip(vb_all["arm"], vb_all["level"])) & set(zip(vc_all["arm"], vc_all["level"])))
        for arm, level in keys:
            vb = vb_all[(vb_all["arm"] == arm) & (vb_all["level"] == level)]["value"].to_numpy(float)
            vc = vc_all[(vc_all["arm"] == arm) & (vc_all["level"] == level)]["value"].to_numpy(float)
            need = MIN_ROUNDS if m.per_round else max(5, min_n(m.q))
            b, c = float(np.quantile(vb, m.q)), float(np.quantile(vc, m.q))
            if min(vb.size, vc.size) < need or b == 0:
                change, lo, hi, verdict, reg = (c / b - 1 if b else math.nan), math.nan, math.nan, TOO_FEW, False
            else:
                change, lo, hi = _change(vb, vc, m.q)
                verdict, reg = _verdict(m, lo, hi, threshold)
            rows.append({"arm": arm, "level": level, "metric": m.key, "n_base": int(vb.size), "n_cand": int(vc.size),
                         "base": b, "cand": c, "change": change, "ci_low": None if math.isnan(lo) else lo,
                         "ci_high": None if math.isnan(hi) else hi, "verdict": verdict, "regression": reg})
    return pd.DataFrame(rows, columns=LOAD_CHANGE_COLUMNS)


def _pct(v: object) -> str:
    return DASH if v is None or (isinstance(v, float) and math.isnan(v)) else f"{100 * float(v):+.1f}%"


def load_lines(changes: pd.DataFrame | None) -> list[str]:
    """The comparison's *Load levels* Markdown (nothing when neither run has load levels in common)."""
    if changes is None or changes.empty:
        return []
    fmt = {m.key: (fmt_s if m.lower_is_better else (lambda v: fmt_num(v, 1))) for m in LOAD_METRICS}
    label = {m.key: m.label for m in LOAD_METRICS}
    shown = changes.copy()
    shown["label"] = shown["metric"].map(label)
    shown["base_s"] = [fmt[m](v) for m, v in zip(shown["metric"], shown["base"])]
    shown["cand_s"] = [fmt[m](v) for m, v in zip(shown["metric"], shown["cand"])]
    shown["ci"] = [DASH if lo is None or pd.isna(lo) else f"{_pct(lo)} – {_pct(hi)}"
                   for lo, hi in zip(shown["ci_low"], shown["ci_high"])]
    shown["n"] = [f"{a}/{b}" for a, b in zip(shown["n_base"], shown["n_cand"])]
    regs = [f"{r.arm} {r.level}: {r.label} {_pct(r.change)} (CI {_pct(r.ci_low)} – {_pct(r.ci_high)})"
            for r in shown[shown["regression"].astype(bool)].itertuples()]
    return ["", "### Load levels", "", *([f"Regressions: {'; '.join(regs)}.", ""] if regs else []),
            ("Per arm and level: throughput and goodput per round (their median), TTFT and ITL percentiles over the "
             f"measured requests; change = candidate / base - 1 with a 95% percentile-bootstrap interval (each run "
             f"resampled on its own, seed {SEED}); \"{TOO_FEW}\": fewer than {MIN_ROUNDS} rounds a side, or fewer "
             "values than the percentile needs."), "",
            table(shown, [Col("arm", "Arm", descriptive=True, right=False), Col("level", "Level", right=False),
                          Col("label", "Metric", right=False), Col("n", "n base/cand"), Col("base_s", "Base"),
                          Col("cand_s", "Candidate"), Col("change", "Change", _pct), Col("ci", "95% CI"),
                          Col("verdict", "Verdict", right=False)])]
