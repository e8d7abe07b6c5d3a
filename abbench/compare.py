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

    @property
    def regressions(self) -> pd.DataFrame:
        return self.changes[self.changes["regression"]]

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


def drift_notes(changes: pd.DataFrame, base: RunRecord, cand: RunRecord, threshold: float) -> list[str]:
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
        if not changes[(changes["metric"] == m.key) & changes["regression"]].shape[0]:
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
    for key in cb.keys() & cc.keys():
        gb, gc = cb[key], cc[key]
        for m in METRICS:
            vb = pd.to_numeric(gb[m.key], errors="coerce").dropna().to_numpy(float)
            vc = pd.to_numeric(gc[m.key], errors="coerce").dropna().to_numpy(float)
            if vb.size == 0 or vc.size == 0:
                continue
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
    label = lambda k: f"{k[0]} {k[1]} {k[2]}"  # noqa: E731
    return Comparison(base=base, cand=cand, threshold=threshold, changes=changes, identical=identical,
                      env_diffs=env_differences(base.environment, cand.environment),
                      profile_diffs=profile_differences(base.profile, cand.profile),
                      only_base=sorted(label(k) for k in cb.keys() - cc.keys()),
                      only_cand=sorted(label(k) for k in cc.keys() - cb.keys()),
                      notes=drift_notes(changes, base, cand, threshold))


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
    regs = c.regressions
    verdict = (f"**{len(regs)} regression(s)** beyond {c.threshold:.0%}" if len(regs) else
               f"**No regression** beyond {c.threshold:.0%}")
    few = c.too_few
    judged = (f"; {len(few)} of {len(c.changes)} cells {TOO_FEW} (fewer than {MIN_N} samples a side: run more "
              "rounds)" if len(few) else "")
    lines = [f"## abbench compare: {c.base.run_id} → {c.cand.run_id}", "",
             f"- **Base:** {_run_line(c.base)}", f"- **Candidate:** {_run_line(c.cand)}",
             f"- **Verdict:** {verdict} (a metric worse by more than the threshold with its whole "
             f"{CONFIDENCE:.0%} interval beyond it){judged}", ""]
    if len(regs):
        lines += [bullets(f"{r.arm} {r.kind} {r.target_tokens}: {_label(r.metric)} {_pct(r.change)} "
                          f"(CI {_pct(r.ci_low)} – {_pct(r.ci_high)})" for r in regs.itertuples()), ""]
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
    for name, cells in (("base", c.only_base), ("candidate", c.only_cand)):
        if cells:
            lines += ["", f"Only in the {name} run (not compared): {', '.join(cells)}."]
    if plot_link:
        lines += ["", f"![Changes with 95% intervals]({plot_link})"]
    return "\n".join(lines).rstrip() + "\n"


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
