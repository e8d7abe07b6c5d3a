"""``abbench compare BASE CAND``: one profile run at two commits (main against a PR), side by side.

Per arm, prompt kind and length (measured ok samples): median TTFT, decode rate, engine H2D bytes and peak
device memory (the engine's ``peak_device_bytes``, else NVML's peak for the service's processes) in each
run, and the change cand/base - 1 with a 95% percentile-bootstrap interval (``scipy.stats.bootstrap``, the
two runs resampled independently, seed 0, ratio of the medians). "not significant" when the interval
contains 0; "same" when both runs hold the same values (a deterministic counter, or a run against a copy of
itself); "too few to judge" when either run has fewer than :data:`MIN_N` samples in the cell (an interval
of two samples is about their range: noise, not evidence). A *regression* is a metric worse than
``threshold`` (TTFT, H2D and memory higher, the decode rate lower) with its whole interval beyond it; a cell
too few to judge is never one.

Per arm and metric, over all its cells (every kind and length with at least 2 samples a side), the arm's
change is the geometric mean of the cells' ratios of medians, exp(mean of log(cand/base)) - 1, with a 95%
*stratified* bootstrap interval (each cell's two runs resampled within that cell, :data:`RESAMPLES` times,
seed 0, the cells' log-ratios averaged per resample) and a one-sided *sign test* across the cells: how
many cells moved beyond the threshold the worse way, against Binomial(K, 1/2). An arm regresses when its
whole interval is beyond the threshold *and* the sign test's p <= :data:`SIGN_ALPHA` (so at least
:data:`MIN_CELLS` cells, every one of them worse at K = 5 or 6): a consistent slowdown across cells is a
regression at n = 2 a cell, one outlying cell is not. docs/compare.md states the assumptions.

Exit codes (:func:`exit_code`): 0 no regression, 1 a regression (a cell's or an arm's), 3 nothing could be
judged (every cell too few and no arm with enough cells: "No regression" would claim what was not tested).

Contract:

* :func:`compare` raises :class:`CompareRefused` (exit 2) when the two runs do not measure the same thing:
  another profile (its name), another prompt set (a prompt id in one run only, or one id built from other
  text: prompt sha256) or another tokenizer. The message says what differs. Cells (arm, kind, length)
  present in one run only (e.g. ``--arms``, or a sweep's refinement point that only one run added) are
  listed, not compared.
* :func:`render_markdown` gives GitHub Markdown to paste into a PR: the verdict, the environment and
  profile differences, and one row per (arm, kind, length, metric); descriptive columns that are the same
  in every row are stated once above the table, and a metric equal in every cell of both runs is named
  once instead of filling rows ("only what differs is shown", as pyperf and llama.cpp's compare script).
* :func:`plot_changes` draws the changes with their intervals (PNG).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from abbench.analysis.frames import arm_rank, measured_ok_frame, peak_bytes
from abbench.analysis.sweep import SWEEP_PREFIX
from abbench.compare_load import load_changes, load_lines
from abbench.errors import AbbenchError
from abbench.fingerprint import key_value
from abbench.report.format import DASH, Col, bullets, code, fmt_gb, fmt_gib, fmt_int, fmt_num, fmt_s, table, when
from abbench.results import RunRecord

SEED = 0
RESAMPLES = 4000
CONFIDENCE = 0.95
DEFAULT_THRESHOLD = 0.05
SMALL_N = 5
MIN_N = 3
"""Fewer samples than this in a cell on either side: "too few to judge", never a regression."""
TOO_FEW = "too few to judge"
SIGN_ALPHA = 0.05
"""The sign test's level: an arm regresses only when this few of its cells' moves could be chance."""
MIN_CELLS = 5
"""The fewest cells whose sign test can reach :data:`SIGN_ALPHA` (2**-5 = 0.031; 2**-4 = 0.0625 cannot)."""
TOO_FEW_CELLS = "too few cells to judge"
EXIT_NOTHING_JUDGED = 3
"""compare's exit code when no cell and no arm could be judged."""


class CompareRefused(AbbenchError):
    """The two runs do not measure the same thing (profile, prompt set or tokenizer differ): exit 2."""


@dataclass(frozen=True)
class MetricSpec:
    key: str
    label: str
    higher_is_worse: bool
    fmt: Any


METRICS = (
    MetricSpec("ttft_s", "TTFT", True, fmt_s),
    MetricSpec("decode_tok_s", "Decode tok/s", False, lambda v: fmt_num(v, 1)),
    MetricSpec("h2d_bytes", "Engine H2D", True, fmt_gb),
    MetricSpec("peak_bytes", "Peak device memory", True, fmt_gib),
)

CHANGE_COLUMNS = ["arm", "kind", "target_tokens", "metric", "n_base", "n_cand", "base", "cand", "change",
                  "ci_low", "ci_high", "verdict", "regression"]
ARM_COLUMNS = ["arm", "metric", "cells", "beyond", "change", "ci_low", "ci_high", "p_sign", "verdict",
               "regression"]


@dataclass
class Comparison:
    base: RunRecord
    cand: RunRecord
    threshold: float
    changes: pd.DataFrame
    identical: list[str]
    """Metrics equal in every sample of both runs (not shown row by row)."""
    env_diffs: list[str]
    profile_diffs: list[str]
    only_base: list[str] = field(default_factory=list)
    only_cand: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """What the verdict cannot tell apart (see :func:`drift_notes`)."""
    arms: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=ARM_COLUMNS))
    """One row per (arm, metric): the test over all the arm's cells (:func:`arm_changes`)."""
    load: pd.DataFrame | None = None
    """Runs with load levels: one row per (arm, level, metric) (:func:`abbench.compare_load.load_changes`)."""

    @property
    def regressions(self) -> pd.DataFrame:
        """Cells that regressed."""
        return self.changes[self.changes["regression"]]

    @property
    def arm_regressions(self) -> pd.DataFrame:
        """Arms that regressed over all their cells."""
        return self.arms[self.arms["regression"].astype(bool)] if len(self.arms) else self.arms

    @property
    def regression_count(self) -> int:
        return int(len(self.regressions) + len(self.arm_regressions) + (
            int(self.load["regression"].sum()) if self.load is not None and len(self.load) else 0))

    @property
    def judged(self) -> bool:
        """Whether anything that differs could be judged: a cell or an arm with a verdict other than "same"
        (a deterministic counter's), or both runs the same throughout. With neither, "no regression" would
        claim what was never tested."""
        unjudged = ("no interval", "base is 0")
        verdicts = pd.concat([self.changes["verdict"], self.arms["verdict"] if len(self.arms) else None,
                              self.load["verdict"] if self.load is not None and len(self.load) else None])
        if verdicts.empty or (verdicts == "same").all():
            return not verdicts.empty
        judged = ((verdicts != "same") & ~verdicts.str.startswith(TOO_FEW) & ~verdicts.str.startswith(TOO_FEW_CELLS)
                  & ~verdicts.isin(unjudged))
        return bool(judged.any())

    @property
    def exit_code(self) -> int:
        """0 no regression, 1 a regression (cell or arm), :data:`EXIT_NOTHING_JUDGED` nothing judged."""
        return 1 if self.regression_count else 0 if self.judged else EXIT_NOTHING_JUDGED

    @property
    def too_few(self) -> pd.DataFrame:
        """Cells with fewer than :data:`MIN_N` samples on a side (not judged)."""
        return self.changes[self.changes["verdict"].str.startswith(TOO_FEW)]


# ---------------------------------------------------------------------------------------- refusals


def _ids(ids: list[str], most: int = 8) -> str:
    return ", ".join(ids[:most]) + (f" and {len(ids) - most} more" if len(ids) > most else "")


def _check_same_inputs(base: RunRecord, cand: RunRecord) -> None:
    nb, nc = base.profile.get("name"), cand.profile.get("name")
    if nb != nc:
        raise CompareRefused(f"the runs are of different profiles: {base.run_id} ran {nb!r}, {cand.run_id} ran "
                             f"{nc!r}; compare runs of one profile at two commits (an A/B of arms is one run's "
                             "report)")
    b = {p.id: p.sha256 for p in base.prompts}
    c = {p.id: p.sha256 for p in cand.prompts}
    differ = sorted(i for i in b.keys() & c.keys() if b[i] != c[i])
    only_b, only_c = sorted(b.keys() - c.keys()), sorted(c.keys() - b.keys())
    # a sweep refines where its own pairs put the crossover: a point of one run only is a cell of one run only
    only_b = [i for i in only_b if not i.startswith(SWEEP_PREFIX)]
    only_c = [i for i in only_c if not i.startswith(SWEEP_PREFIX)]
    if differ or only_b or only_c:
        what = ([f"{_ids(differ)} have another sha256 in {cand.run_id} than in {base.run_id} (another corpus, "
                 "seed or tokenizer)"] if differ else [])
        what += [f"{_ids(ids)} only in {rid}" for ids, rid in ((only_b, base.run_id), (only_c, cand.run_id)) if ids]
        raise CompareRefused(f"the prompt sets differ: {'; '.join(what)}; the runs do not measure the same "
                             "prompts (run both with the same profile and --lengths)")
    tb, tc = base.environment.get("tokenizer") or {}, cand.environment.get("tokenizer") or {}
    src_b = (base.profile.get("tokenizer") or {}).get("source")
    src_c = (cand.profile.get("tokenizer") or {}).get("source")
    fields = sorted(k for k in tb.keys() | tc.keys() if tb.get(k) != tc.get(k))
    if src_b != src_c:
        fields.insert(0, "source")
    if fields:
        what = ", ".join(f"{k} {(tb.get(k) if k != 'source' else src_b)!r} != "
                         f"{(tc.get(k) if k != 'source' else src_c)!r}" for k in fields)
        raise CompareRefused(f"the tokenizers differ ({what}); token counts and ids are not comparable")


# --------------------------------------------------------------------------------------- differences


ENV_FIELDS = ("engine_commit", "git.commit", "git.dirty", "git.branch", "hostname", "platform.release", "gpu_models",
              "gpus[].uuid", "gpus[].clocks_mhz.sm_max", "gpus[].clocks_mhz.mem_max", "gpus[].power_limit_w",
              "driver_version", "cuda_driver_version", "python.version", "cpu.model", "cpu.logical",
              "cpu.freq_max_mhz", "ram_total")


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): d}


def env_differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """'field: base -> cand' for the fingerprint fields that differ (packages and env variables included)."""
    keys = list(ENV_FIELDS)
    for section in ("packages", "env"):
        keys += sorted(f"{section}.{k}" for k in set(a.get(section) or {}) | set(b.get(section) or {}))
    return [f"{k}: {key_value(a, k)!r} -> {key_value(b, k)!r}" for k in keys if key_value(a, k) != key_value(b, k)]


def profile_differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    fa, fb = _flatten({k: v for k, v in a.items() if k != "source_path"}), _flatten(
        {k: v for k, v in b.items() if k != "source_path"})
    return [f"{k}: {fa.get(k)!r} -> {fb.get(k)!r}" for k in sorted(fa.keys() | fb.keys()) if fa.get(k) != fb.get(k)]


# ------------------------------------------------------------------------------------------ changes


def change_ci(base: np.ndarray, cand: np.ndarray, *, seed: int = SEED, n_resamples: int = RESAMPLES
              ) -> tuple[float | None, float | None, float | None]:
    """cand median / base median - 1 and its 95% percentile-bootstrap interval (``scipy.stats.bootstrap``,
    each run resampled on its own); (change, None, None) with fewer than 2 samples on a side or when the
    bootstrap gives no finite interval; all None when the base median is 0."""
    from scipy import stats

    base, cand = np.asarray(base, dtype=float), np.asarray(cand, dtype=float)
    mb, mc = float(np.median(base)), float(np.median(cand))
    if mb == 0:
        return (0.0, 0.0, 0.0) if mc == 0 else (None, None, None)
    change = mc / mb - 1
    if len(base) < 2 or len(cand) < 2:
        return change, None, None

    def ratio(b: np.ndarray, c: np.ndarray, axis: int = -1) -> np.ndarray:
        return np.median(c, axis=axis) / np.median(b, axis=axis) - 1

    seeded = ({"rng": np.random.default_rng(seed)} if "rng" in inspect.signature(stats.bootstrap).parameters
              else {"random_state": np.random.default_rng(seed)})  # scipy < 1.15
    try:
        with np.errstate(divide="ignore", invalid="ignore"):  # a resample whose base median is 0: no interval
            res = stats.bootstrap((base, cand), ratio, paired=False, vectorized=True, n_resamples=n_resamples,
                                  confidence_level=CONFIDENCE, method="percentile", **seeded)
    except ValueError:  # e.g. a degenerate resample scipy refuses: no interval, said by the caller
        return change, None, None
    lo, hi = float(res.confidence_interval.low), float(res.confidence_interval.high)
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return change, None, None
    return change, lo, hi


def _verdict(m: MetricSpec, same: bool, change: float | None, lo: float | None, hi: float | None,
             threshold: float, n: int) -> tuple[str, bool]:
    if same:
        return "same", False
    if change is None:
        return "base is 0", False
    if n < MIN_N:
        return f"{TOO_FEW} (n={n})", False
    if lo is None or hi is None:
        return "no interval", False
    if lo <= 0 <= hi:
        return "not significant", False
    up = lo > 0
    worse = up == m.higher_is_worse
    words = {"ttft_s": ("slower", "faster"), "decode_tok_s": ("faster", "slower")}.get(m.key, ("more", "less"))
    word = words[0] if up else words[1]
    beyond = lo > threshold if m.higher_is_worse else hi < -threshold
    if worse and beyond:
        return f"{word}: REGRESSION (beyond {threshold:.0%})", True
    return word, False


def _log_ratio_resamples(vb: np.ndarray, vc: np.ndarray, rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` bootstrap resamples of log(median cand / median base) for one cell (each side on its own)."""
    mb = np.median(vb[rng.integers(0, vb.size, size=(n, vb.size))], axis=1)
    mc = np.median(vc[rng.integers(0, vc.size, size=(n, vc.size))], axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.log(mc) - np.log(mb)


def sign_p(beyond: int, cells: int) -> float:
    """One-sided sign test: P(X >= beyond) for X ~ Binomial(cells, 1/2)."""
    return float(sum(math.comb(cells, k) for k in range(beyond, cells + 1)) / 2 ** cells)


def arm_change(m: MetricSpec, cells: list[tuple[np.ndarray, np.ndarray]], threshold: float, *, seed: int = SEED,
               n_resamples: int = RESAMPLES) -> dict[str, Any]:
    """The test of one arm and metric over all its cells (module docstring): the geometric-mean change, its
    stratified-bootstrap interval, how many cells moved beyond ``threshold`` the worse way, the sign test's
    p, and the verdict. ``cells``: (base, cand) samples per cell, each side with at least 2 values and a
    base median above 0."""
    rng = np.random.default_rng(seed)
    k = len(cells)
    logs = np.array([math.log(float(np.median(c)) / float(np.median(b))) if np.median(c) > 0 else -math.inf
                     for b, c in cells])
    same = all(np.array_equal(np.sort(b), np.sort(c)) or np.unique(np.concatenate([b, c])).size == 1
               for b, c in cells)
    limit = math.log1p(threshold) if m.higher_is_worse else math.log1p(-min(threshold, 0.999999))
    beyond = int((logs > limit).sum() if m.higher_is_worse else (logs < limit).sum())
    row = {"cells": k, "beyond": beyond, "change": None, "ci_low": None, "ci_high": None,
           "p_sign": sign_p(beyond, k), "regression": False}
    if same:
        return {**row, "change": 0.0, "verdict": "same"}
    if not np.isfinite(logs).all():
        return {**row, "verdict": "no interval"}
    row["change"] = math.expm1(float(logs.mean()))
    boot = np.mean([_log_ratio_resamples(b, c, rng, n_resamples) for b, c in cells], axis=0)
    if not np.isfinite(boot).all():
        return {**row, "verdict": "no interval"}
    lo, hi = (float(np.quantile(boot, q)) for q in ((1 - CONFIDENCE) / 2, (1 + CONFIDENCE) / 2))
    row["ci_low"], row["ci_high"] = math.expm1(lo), math.expm1(hi)
    if k < MIN_CELLS:
        return {**row, "verdict": f"{TOO_FEW_CELLS} ({k} < {MIN_CELLS})"}
    if lo <= 0 <= hi:
        return {**row, "verdict": "not significant"}
    up = lo > 0
    words = {"ttft_s": ("slower", "faster"), "decode_tok_s": ("faster", "slower")}.get(m.key, ("more", "less"))
    word = words[0] if up else words[1]
    if up != m.higher_is_worse:
        return {**row, "verdict": word}
    whole_beyond = lo > limit if m.higher_is_worse else hi < limit
    if whole_beyond and row["p_sign"] <= SIGN_ALPHA:
        return {**row, "regression": True,
                "verdict": f"{word}: REGRESSION (beyond {threshold:.0%}, {beyond} of {k} cells)"}
    if whole_beyond:
        return {**row, "verdict": f"{word} (beyond {threshold:.0%} in only {beyond} of {k} cells, sign test p = "
                                  f"{row['p_sign']:.2f})"}
    return {**row, "verdict": word}


def arm_changes(samples: dict[tuple[str, str], list[tuple[np.ndarray, np.ndarray]]], threshold: float
                ) -> pd.DataFrame:
    """:func:`arm_change` for every (arm, metric) with a cell to judge."""
    rows = []
    for (arm, key), cells in samples.items():
        usable = [(b, c) for b, c in cells if b.size >= 2 and c.size >= 2 and np.median(b) > 0]
        if usable:
            m = next(x for x in METRICS if x.key == key)
            rows.append({"arm": arm, "metric": key, **arm_change(m, usable, threshold)})
    return pd.DataFrame(rows, columns=ARM_COLUMNS)


def drift_notes(changes: pd.DataFrame, base: RunRecord, cand: RunRecord, threshold: float,
                arms: pd.DataFrame | None = None) -> list[str]:
    """Notes for what the intervals cannot hold: both runs of one clean commit (every change is the
    machine's), and a regressing metric whose median change moved beyond the threshold, the worse way, in
    every arm (the whole run shifted: a busier machine looks like a regression of every cell)."""
    notes = []
    cb, cc = base.environment.get("engine_commit"), cand.environment.get("engine_commit")
    if cb and cb == cc and "+dirty" not in str(cb):
        notes.append(f"Both runs are of one commit ({str(cb)[:12]}): any change here is the machine's or the "
                     "run's, not the code's.")
    judged = changes[~changes["verdict"].str.startswith(TOO_FEW) & changes["change"].notna()]
    shifted = []
    for m in METRICS:
        arm_reg = arms is not None and len(arms) and bool(
            arms[(arms["metric"] == m.key) & arms["regression"].astype(bool)].shape[0])
        if not changes[(changes["metric"] == m.key) & changes["regression"]].shape[0] and not arm_reg:
            continue
        per_arm = judged[judged["metric"] == m.key].groupby("arm")["change"].median()
        worse = per_arm > threshold if m.higher_is_worse else per_arm < -threshold
        if len(per_arm) and bool(worse.all()):
            shifted.append(f"{m.label} " + ", ".join(f"{a} {v * 100:+.1f}%" for a, v in per_arm.items()))
    if shifted:
        notes.append(f"Every arm moved the worse way (median change per arm: {'; '.join(shifted)}): drift "
                     "between two runs (another load on the machine, another clock) looks the same as a "
                     "regression. To tell them apart, run both commits as two arms of one run (ABBA rounds "
                     "cancel drift) and gate on their ratio.")
    return notes


def _frame(record: RunRecord) -> pd.DataFrame:
    df = measured_ok_frame(record)
    if df.empty:
        return df.assign(peak_bytes=pd.Series(dtype=float))
    return df.assign(peak_bytes=peak_bytes(df))


def _cells(df: pd.DataFrame) -> dict[tuple[str, str, int], pd.DataFrame]:
    return {(str(a), str(k), int(t)): g for (a, k, t), g in df.groupby(["arm", "kind", "target_tokens"])}


def compare(base: RunRecord, cand: RunRecord, *, threshold: float = DEFAULT_THRESHOLD) -> Comparison:
    """Compare two runs cell by cell (see the module docstring)."""
    _check_same_inputs(base, cand)
    cb, cc = _cells(_frame(base)), _cells(_frame(cand))
    rows = []
    per_arm: dict[tuple[str, str], list[tuple[np.ndarray, np.ndarray]]] = {}
    for key in sorted(cb.keys() & cc.keys()):
        gb, gc = cb[key], cc[key]
        for m in METRICS:
            vb = pd.to_numeric(gb[m.key], errors="coerce").dropna().to_numpy(float)
            vc = pd.to_numeric(gc[m.key], errors="coerce").dropna().to_numpy(float)
            if vb.size == 0 or vc.size == 0:
                continue
            per_arm.setdefault((key[0], m.key), []).append((vb, vc))
            same = bool(vb.size == vc.size and np.array_equal(np.sort(vb), np.sort(vc))
                        or np.unique(np.concatenate([vb, vc])).size == 1)  # one value throughout (a counter)
            n = min(vb.size, vc.size)
            change, lo, hi = (0.0, None, None) if same else change_ci(vb, vc)
            if n < MIN_N:  # no interval shown where there is too little to judge
                lo = hi = None
            verdict, regression = _verdict(m, same, change, lo, hi, threshold, n)
            rows.append({"arm": key[0], "kind": key[1], "target_tokens": key[2], "metric": m.key,
                         "n_base": len(vb), "n_cand": len(vc), "base": float(np.median(vb)),
                         "cand": float(np.median(vc)), "change": change, "ci_low": lo, "ci_high": hi,
                         "verdict": verdict, "regression": regression})
    changes = pd.DataFrame(rows, columns=CHANGE_COLUMNS)
    identical = []
    for m in METRICS:
        sel = changes[changes["metric"] == m.key]
        if not sel.empty and (sel["verdict"] == "same").all():
            identical.append(m.label)
    changes = _sorted(changes, base)
    arms = _sorted_arms(arm_changes(per_arm, threshold), base)
    label = lambda k: f"{k[0]} {k[1]} {k[2]}"  # noqa: E731
    return Comparison(base=base, cand=cand, threshold=threshold, changes=changes, identical=identical,
                      env_diffs=env_differences(base.environment, cand.environment),
                      profile_diffs=profile_differences(base.profile, cand.profile),
                      only_base=sorted(label(k) for k in cb.keys() - cc.keys()),
                      only_cand=sorted(label(k) for k in cc.keys() - cb.keys()),
                      notes=drift_notes(changes, base, cand, threshold, arms), arms=arms,
                      load=load_changes(base, cand, threshold))


def _sorted_arms(df: pd.DataFrame, record: RunRecord) -> pd.DataFrame:
    ranks, metrics = arm_rank(record), {m.key: i for i, m in enumerate(METRICS)}
    order = sorted(range(len(df)), key=lambda i: (ranks.get(df["arm"].iloc[i], 99), metrics[df["metric"].iloc[i]]))
    return df.iloc[order].reset_index(drop=True)


def _sorted(df: pd.DataFrame, record: RunRecord) -> pd.DataFrame:
    if df.empty:
        return df
    ranks = arm_rank(record)
    kinds = {"fresh": 0, "cold": 1, "continuation": 2}
    metrics = {m.key: i for i, m in enumerate(METRICS)}
    key = df.apply(lambda r: (ranks.get(r["arm"], 99), kinds.get(r["kind"], 9), r["target_tokens"],
                              metrics[r["metric"]]), axis=1)
    return df.iloc[sorted(range(len(df)), key=lambda i: key.iloc[i])].reset_index(drop=True)


# ------------------------------------------------------------------------------------------- output


def _pct(v: Any) -> str:
    return DASH if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v * 100:+.1f}%"


def _run_line(r: RunRecord) -> str:
    git = r.environment.get("git") or {}
    commit = r.environment.get("engine_commit") or git.get("commit") or DASH
    return f"`{r.run_id}` (commit {code(str(commit))}, {when(r.created_at)}, status {r.status})"


def render_markdown(c: Comparison, plot_link: str | None = None) -> str:
    """The comparison as GitHub Markdown (see the module docstring)."""
    regs, arm_regs = c.regressions, c.arm_regressions
    verdict = (f"**{c.regression_count} regression(s)** beyond {c.threshold:.0%}" if c.regression_count else
               f"**No regression** beyond {c.threshold:.0%}" if c.judged else
               "**Nothing could be judged** (exit 3): no cell has enough samples and no arm enough cells")
    few = c.too_few
    judged = (f"; {len(few)} of {len(c.changes)} cells {TOO_FEW} (fewer than {MIN_N} samples a side: run more "
              "rounds)" if len(few) else "")
    lines = [f"## abbench compare: {c.base.run_id} → {c.cand.run_id}", "",
             f"- **Base:** {_run_line(c.base)}", f"- **Candidate:** {_run_line(c.cand)}",
             f"- **Verdict:** {verdict} (a metric worse by more than the threshold with its whole "
             f"{CONFIDENCE:.0%} interval beyond it, in a cell or over all of an arm's cells){judged}", ""]
    if c.regression_count:
        lines += [bullets([f"{r.arm} (all {r.cells} cells): {_label(r.metric)} {_pct(r.change)} (CI "
                           f"{_pct(r.ci_low)} – {_pct(r.ci_high)}; {r.beyond} of {r.cells} cells beyond, sign test "
                           f"p = {r.p_sign:.3f})" for r in arm_regs.itertuples()]
                          + [f"{r.arm} {r.kind} {r.target_tokens}: {_label(r.metric)} {_pct(r.change)} "
                             f"(CI {_pct(r.ci_low)} – {_pct(r.ci_high)})" for r in regs.itertuples()]), ""]
    for n in c.notes:
        lines += [f"Note: {n}", ""]
    lines += ["### Environment differences", "",
              bullets(c.env_diffs) if c.env_diffs else "None in the recorded fingerprint fields.", ""]
    if c.profile_diffs:
        lines += ["### Profile differences", "", bullets(c.profile_diffs), ""]
    lines += ["### Changes", "",
              (f"Change = candidate median / base median - 1 per arm, kind and length (measured ok samples), with a "
               f"{CONFIDENCE:.0%} percentile-bootstrap interval (scipy.stats.bootstrap, each run resampled on its "
               f"own, seed {SEED}, {RESAMPLES} resamples); \"not significant\": the interval contains 0; "
               f"\"{TOO_FEW}\": fewer than {MIN_N} samples on a side, never a regression."), ""]
    small = int(min(c.changes["n_base"].min(), c.changes["n_cand"].min())) if not c.changes.empty else 0
    if 0 < small < SMALL_N:
        lines += [f"Note: n = {small} per side in some cells. The interval holds only the spread *within* each "
                  "run (more rounds narrow it); drift *between* the two runs (another load on the machine, another "
                  "boot) is never in it: for that, run both commits as two arms of one run.", ""]
    if c.identical:
        lines += [f"Identical in every sample of both runs (not listed): {', '.join(c.identical)}.", ""]
    shown = c.changes[~c.changes["metric"].map(_label).isin(c.identical)].copy()
    if shown.empty:
        lines.append("No cell of both runs has a metric to compare.")
    else:
        shown["base_s"] = [_fmt(m, v) for m, v in zip(shown["metric"], shown["base"])]
        shown["cand_s"] = [_fmt(m, v) for m, v in zip(shown["metric"], shown["cand"])]
        shown["label"] = shown["metric"].map(_label)
        shown["ci"] = [DASH if lo is None or pd.isna(lo) else f"{_pct(lo)} – {_pct(hi)}"
                       for lo, hi in zip(shown["ci_low"], shown["ci_high"])]
        shown["n"] = [f"{a}/{b}" for a, b in zip(shown["n_base"], shown["n_cand"])]
        lines.append(table(shown, [
            Col("arm", "Arm", descriptive=True, right=False), Col("kind", "Kind", descriptive=True, right=False),
            Col("target_tokens", "Prompt tokens", fmt_int, descriptive=True),
            Col("label", "Metric", descriptive=True, right=False), Col("n", "n base/cand", descriptive=True),
            Col("base_s", "Base"), Col("cand_s", "Candidate"), Col("change", "Change", _pct),
            Col("ci", "95% CI"), Col("verdict", "Verdict", right=False)]))
    lines += _arm_section(c) + load_lines(c.load)
    for name, cells in (("base", c.only_base), ("candidate", c.only_cand)):
        if cells:
            lines += ["", f"Only in the {name} run (not compared): {', '.join(cells)}."]
    if plot_link:
        lines += ["", f"![Changes with 95% intervals]({plot_link})"]
    return "\n".join(lines).rstrip() + "\n"


def _arm_section(c: Comparison) -> list[str]:
    shown = c.arms[~c.arms["metric"].map(_label).isin(c.identical)].copy() if len(c.arms) else c.arms
    if shown.empty:
        return []
    shown["label"] = shown["metric"].map(_label)
    shown["ci"] = [DASH if lo is None or pd.isna(lo) else f"{_pct(lo)} – {_pct(hi)}"
                   for lo, hi in zip(shown["ci_low"], shown["ci_high"])]
    shown["moved"] = [f"{b} of {k}" for b, k in zip(shown["beyond"], shown["cells"])]
    shown["p"] = [f"{p:.3f}" for p in shown["p_sign"]]
    return ["", "### Per arm, over all its cells", "",
            (f"Change = geometric mean of the cells' ratios of medians - 1, with a {CONFIDENCE:.0%} stratified "
             f"bootstrap interval (each cell's runs resampled within the cell, seed {SEED}, {RESAMPLES} resamples); "
             f"a regression also needs the one-sided sign test across cells (cells beyond {c.threshold:.0%} the "
             f"worse way, against Binomial(cells, 1/2)) at p <= {SIGN_ALPHA}, so at least {MIN_CELLS} cells."), "",
            table(shown, [Col("arm", "Arm", descriptive=True, right=False),
                          Col("label", "Metric", descriptive=True, right=False),
                          Col("cells", "Cells", fmt_int, descriptive=True), Col("change", "Change", _pct),
                          Col("ci", "95% CI"), Col("moved", f"Beyond {c.threshold:.0%}"),
                          Col("p", "Sign test p"), Col("verdict", "Verdict", right=False)])]


def _label(key: str) -> str:
    return next(m.label for m in METRICS if m.key == key)


def _fmt(key: str, v: Any) -> str:
    return next(m.fmt for m in METRICS if m.key == key)(v)


def plot_changes(c: Comparison, path: Path) -> bool:
    """The changes (%) with their intervals, one panel per metric that is not identical; False when there
    is nothing to draw."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    df = c.changes[c.changes["change"].notna() & ~c.changes["metric"].map(_label).isin(c.identical)]
    metrics = [m for m in METRICS if (df["metric"] == m.key).any()]
    if not metrics:
        return False
    height = max(2.5, 0.28 * max((df["metric"] == m.key).sum() for m in metrics) + 1.2)
    fig = Figure(figsize=(4.2 * len(metrics), height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    for i, m in enumerate(metrics):
        ax = fig.add_subplot(1, len(metrics), i + 1)
        g = df[df["metric"] == m.key].iloc[::-1]
        y = np.arange(len(g))
        ch = g["change"].to_numpy(float) * 100
        lo = np.where(g["ci_low"].isna(), ch, g["ci_low"].astype(float) * 100)
        hi = np.where(g["ci_high"].isna(), ch, g["ci_high"].astype(float) * 100)
        colours = ["tab:red" if r else "tab:blue" for r in g["regression"]]
        ax.errorbar(ch, y, xerr=[ch - lo, hi - ch], fmt="none", ecolor="grey", capsize=3)
        ax.scatter(ch, y, c=colours, zorder=3)
        ax.axvline(0, color="black", lw=0.8)
        for t in (c.threshold * 100, -c.threshold * 100):
            ax.axvline(t, color="tab:red", lw=0.6, ls="--")
        ax.set_yticks(y, [f"{a} {k} {t}" for a, k, t in zip(g["arm"], g["kind"], g["target_tokens"])], fontsize=7)
        ax.set_xlabel(f"{m.label}: change (%)")
        ax.grid(True, axis="x", alpha=0.3)
    fig.suptitle(f"{c.cand.run_id} vs {c.base.run_id}", fontsize=9)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return True
