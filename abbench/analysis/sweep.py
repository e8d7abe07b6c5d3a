"""Sweeps: the paired TTFT ratio of two arms against a swept quantity, and where it crosses 1.

A run with a ``[sweep]`` table (:class:`abbench.profile.SweepSpec`, run by :mod:`abbench.runner.sweep`) measures
prompts at the points of one quantity: ``vary = "suffix"``, the uncached tokens of a continuation after its cold
prompt (the cached prefix); ``vary = "length"``, the tokens of a fresh prompt. Its prompts' ids start with
:data:`SWEEP_PREFIX`; each prompt's quantity is read from the run's prompt records (:func:`points`).

Per point, for arms (A, B): the pairs are the ordinary ABBA pairs (same prompt, same round:
:func:`~abbench.analysis.timing.paired_ratios` against B), ratio = TTFT(A) / TTFT(B); per point the median and
its 95% percentile-bootstrap interval (:func:`~abbench.analysis.timing.median_ci`).

The crossover (:func:`locate`)
------------------------------
Let y(x) = log(median ratio at x); y < 0 where A is faster. A *crossing* lies between adjacent points whose y
have opposite signs (a median of exactly 1 counts as "not faster"). Its estimate interpolates y linearly in log x
between the two bracketing points: log x* = log x_i + y_i / (y_i - y_j) * (log x_j - log x_i) (exact when the
ratio is a power of x). Its 95% interval: the bracketing points' pairs are resampled independently
(``scipy.stats.bootstrap``, two samples, percentile method, seed 0), each resample's two medians give a crossing
by the same interpolation (extrapolated when both lie on one side of 1, and clipped to the swept range), and
the interval is the middle 95% of those. Fewer than 2 pairs at either bracketing point: no interval.

* one crossing: ``status`` "crossing" (``direction`` says whether A is faster below it, as named, or above);
* several (the ratio wanders across 1): ``status`` "several": the interval spans every crossing's interval
  (its bracket where it has none) and there is no single estimate;
* none: the first arm of a pair is the one named to be faster *below* the crossover, so when A is faster at
  every point the crossover lies above the largest point (``status`` "above", interval [x_max, inf)), and when
  it is slower at every point, below the smallest (``status`` "below", interval (0, x_min]).

:func:`judge_crossover` judges ``crossover[A, B] OP V`` on that interval like the other interval metrics: pass
when it lies wholly on the right side of V, fail when wholly on the wrong side, inconclusive otherwise (and when
there is no interval).

The interval is the interpolation's sampling uncertainty: it does not hold the error of interpolating between
the bracketing points where log-ratio is not linear in log x, which only a narrower bracket removes. So
:func:`refinement_point`, where a sweep adds a point, bisects (geometric midpoint) the bracket of the crossing
whose interval *or* bracket is widest relative to its estimate, while that width exceeds the target: refinement
settles when both are narrow. None when the crossover is settled or cannot be bracketed. With fewer than 5
pairs at a bracketing point the percentile interval tends to be too narrow (as every median interval here):
:attr:`Crossover.note` says so.

Pure, like the rest of :mod:`abbench.analysis`: no I/O; the bootstrap has a fixed seed.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from abbench.analysis.frames import frame
from abbench.checkexpr import parse_check
from abbench.analysis.timing import (BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED, CONFIDENCE, SMALL_N, median_ci, paired_ratios,
                                     verdict)
from abbench.results import RunRecord

__all__ = [
    "POINT_COLUMNS", "SWEEP_PREFIX", "Crossing", "Crossover", "SweepPair", "analyze_sweep", "crossover",
    "judge_crossover", "locate", "point_table", "points", "quantity", "refinement_point", "sweep_pairs",
    "sweep_pair_list", "sweep_spec", "sweep_summary",
]

SWEEP_PREFIX = "sweep-"
"""The ids of a sweep's prompts start with this (``sweep-<point>-<i>``, ``...-cold``/``...-cont`` for suffixes)."""
QUANTITY = {"suffix": "uncached suffix tokens", "length": "prompt tokens"}


def sweep_spec(record: RunRecord) -> dict[str, Any] | None:
    """The run's ``[sweep]`` table as recorded (None: not a sweep)."""
    sw = record.profile.get("sweep")
    return sw if isinstance(sw, dict) else None


def points(record: RunRecord) -> dict[str, int]:
    """Prompt id -> the swept quantity, for the prompts a sweep measures: continuations (their tokens beyond
    their cold prompt's) for ``vary = "suffix"``, fresh prompts for ``vary = "length"``."""
    sw = sweep_spec(record)
    if sw is None:
        return {}
    targets = {p.id: p.target_tokens for p in record.prompts}
    out: dict[str, int] = {}
    for p in record.prompts:
        if not p.id.startswith(SWEEP_PREFIX):
            continue
        if sw.get("vary") == "suffix" and p.kind == "continuation" and p.parent in targets:
            out[p.id] = p.target_tokens - targets[p.parent]
        elif sw.get("vary") == "length" and p.kind == "fresh":
            out[p.id] = p.target_tokens
    return out


def sweep_pair_list(record: RunRecord) -> list[tuple[str, str]]:
    """The arm pairs a sweep run shows: ``sweep.crossovers``, then those of ``crossover[...]`` checks."""
    sw = sweep_spec(record) or {}
    pairs = [(str(a), str(b)) for a, b in sw.get("crossovers") or []]
    for expr in (record.profile.get("gate") or {}).get("checks") or []:
        c = parse_check(str(expr))
        if c.metric == "crossover" and (c.arm, str(c.vs)) not in pairs:
            pairs.append((c.arm, str(c.vs)))
    return pairs


SWEEP_PAIR_COLUMNS = ["x", "prompt_id", "round", "a_ttft_s", "b_ttft_s", "ratio"]


def sweep_pairs(record: RunRecord, a: str, b: str) -> pd.DataFrame:
    """One row per ABBA pair (A and B on the same sweep prompt in the same round): the point ``x`` and
    ratio = TTFT(A) / TTFT(B)."""
    pts = points(record)
    p = paired_ratios(record, against=b)
    p = p[(p["arm"] == a) & p["prompt_id"].isin(list(pts))] if not p.empty else p
    rows = [{"x": pts[r.prompt_id], "prompt_id": r.prompt_id, "round": r.round, "a_ttft_s": r.arm_ttft_s,
             "b_ttft_s": r.ref_ttft_s, "ratio": r.ratio} for r in p.itertuples()]
    out = frame(rows, SWEEP_PAIR_COLUMNS, ints=["x", "round"])
    return out.sort_values(["x", "prompt_id", "round"], kind="stable").reset_index(drop=True) if rows else out


POINT_COLUMNS = ["x", "n", "median_ratio", "ci_low", "ci_high", "verdict", "note"]


def point_table(record: RunRecord, a: str, b: str, pairs: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per point: the pairs, the median ratio TTFT(A) / TTFT(B), its 95% interval and the verdict ('faster':
    A is faster, the whole interval below 1)."""
    pairs = sweep_pairs(record, a, b) if pairs is None else pairs
    rows = []
    for x, g in pairs.groupby("x", sort=True):
        ci = median_ci(g["ratio"].astype(float))
        rows.append({"x": int(x), "n": len(g), "median_ratio": ci.median, "ci_low": ci.low, "ci_high": ci.high,
                     "verdict": verdict(ci.low, ci.high), "note": ci.note})
    return frame(rows, POINT_COLUMNS, ints=["x", "n"])


@dataclass(frozen=True)
class Crossing:
    """One sign change of the median ratio between adjacent points ``lo`` < ``hi``."""

    lo: int
    hi: int
    estimate: float
    low: float | None
    high: float | None
    """The 95% interval (None: fewer than 2 pairs at a bracketing point)."""
    a_faster_below: bool
    n: int = 0
    """The fewer of the two bracketing points' pairs."""

    @property
    def width(self) -> float:
        """The wider of the interval and the bracket, relative to the estimate: (high - low) / estimate."""
        spread = self.hi - self.lo
        if self.low is not None and self.high is not None:
            spread = max(spread, self.high - self.low)
        return spread / self.estimate


@dataclass(frozen=True)
class Crossover:
    """Where TTFT(a) / TTFT(b) crosses 1 over the swept quantity (module docstring)."""

    a: str
    b: str
    status: str
    """'crossing', 'several', 'above' (a faster at every point), 'below' (slower at every point), 'none' (no
    point with pairs)."""
    estimate: float | None
    low: float | None
    high: float | None
    """The 95% interval; 0 and inf stand for "below the smallest point" and "above the largest"."""
    x_min: int | None = None
    x_max: int | None = None
    crossings: list[Crossing] = field(default_factory=list)
    n_points: int = 0

    @property
    def has_interval(self) -> bool:
        return self.low is not None and self.high is not None

    @property
    def note(self) -> str | None:
        """A plain note when an interval rests on fewer than :data:`SMALL_N` pairs at a bracketing point."""
        n = min((c.n for c in self.crossings), default=None)
        if n is not None and 2 <= n < SMALL_N:
            return f"n={n} pairs at a bracketing point: too few for a reliable interval (it tends to be too narrow)"
        return None

    @property
    def summary(self) -> str:
        """One line for humans: where the arms cross, how sure, or why there is no crossing."""
        a, b = self.a, self.b
        if self.status == "none":
            return f"{a} vs {b}: no point has pairs of both arms"
        if self.status == "above":
            return f"{a} is faster than {b} at every point up to {self.x_max}: the crossover lies above it"
        if self.status == "below":
            return f"{a} is slower than {b} at every point from {self.x_min}: the crossover lies below it"
        ci = f"95% CI {_fmt(self.low)}-{_fmt(self.high)}" if self.has_interval else "no interval (n < 2 at a point)"
        if self.status == "several":
            at = ", ".join(f"{c.estimate:.0f}" for c in self.crossings)
            return f"{a} vs {b} cross {len(self.crossings)} times (near {at}): {ci}"
        c = self.crossings[0]
        side = "below" if c.a_faster_below else "above"
        return f"{a} vs {b} cross at {self.estimate:.0f} ({ci}); {a} is faster {side} it"

    def as_dict(self) -> dict[str, Any]:
        """JSON-able: an interval open above (status "above") has ``high`` null."""
        d = asdict(self)
        d["summary"], d["note"] = self.summary, self.note
        if self.high is not None and math.isinf(self.high):
            d["high"] = None
        return d


def _fmt(v: float | None) -> str:
    return "-" if v is None else "inf" if math.isinf(v) else f"{v:.0f}"


def _bootstrap_crossing(ri: np.ndarray, rj: np.ndarray, xi: int, xj: int, x_min: int, x_max: int,
                        a_faster_below: bool) -> tuple[float | None, float | None]:
    """The 95% percentile-bootstrap interval of the interpolated crossing between points ``xi`` < ``xj``."""
    from scipy import stats

    if ri.size < 2 or rj.size < 2:
        return None, None
    lxi, lxj, lo, hi = math.log(xi), math.log(xj), math.log(x_min), math.log(x_max)

    def crossing(si: np.ndarray, sj: np.ndarray, axis: int = -1) -> np.ndarray:
        yi, yj = np.log(np.median(si, axis=axis)), np.log(np.median(sj, axis=axis))
        with np.errstate(divide="ignore", invalid="ignore"):
            lx = lxi + yi / (yi - yj) * (lxj - lxi)
        # a flat resample has no crossing line: A faster at both points puts it past the side A wins beyond
        past = np.where((yi < 0) == a_faster_below, hi, lo)
        lx = np.where(yi == yj, np.where(yi == 0, (lxi + lxj) / 2, past), lx)
        return np.exp(np.clip(lx, lo, hi))

    kwargs: dict[str, Any] = {}
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    if "rng" in inspect.signature(stats.bootstrap).parameters:
        kwargs["rng"] = rng
    else:  # scipy < 1.15
        kwargs["random_state"] = rng
    try:
        res = stats.bootstrap((ri, rj), crossing, n_resamples=BOOTSTRAP_RESAMPLES, confidence_level=CONFIDENCE,
                              method="percentile", vectorized=True, axis=-1, **kwargs)
    except Exception:  # noqa: BLE001 - any failure means: no interval
        return None, None
    low, high = float(res.confidence_interval.low), float(res.confidence_interval.high)
    return (None, None) if math.isnan(low) or math.isnan(high) else (low, high)


def locate(xs: list[int], ratios: list[np.ndarray], a: str = "A", b: str = "B") -> Crossover:
    """The crossover of ratio = TTFT(a) / TTFT(b) given the pairs' ratios at each point ``xs`` (ascending,
    distinct; each with at least one ratio). The arithmetic of the module docstring."""
    if not xs:
        return Crossover(a, b, "none", None, None, None)
    meds = [float(np.median(r)) for r in ratios]
    faster = [m < 1.0 for m in meds]
    x_min, x_max = xs[0], xs[-1]
    base = dict(x_min=x_min, x_max=x_max, n_points=len(xs))
    found: list[Crossing] = []
    for i in range(len(xs) - 1):
        if faster[i] == faster[i + 1]:
            continue
        yi, yj = math.log(meds[i]), math.log(meds[i + 1])
        lxi, lxj = math.log(xs[i]), math.log(xs[i + 1])
        est = math.exp(lxi + yi / (yi - yj) * (lxj - lxi)) if yi != yj else math.sqrt(xs[i] * xs[i + 1])
        low, high = _bootstrap_crossing(np.asarray(ratios[i], float), np.asarray(ratios[i + 1], float), xs[i],
                                        xs[i + 1], x_min, x_max, faster[i])
        found.append(Crossing(xs[i], xs[i + 1], est, low, high, faster[i], min(len(ratios[i]), len(ratios[i + 1]))))
    if not found:
        if all(faster):
            return Crossover(a, b, "above", None, float(x_max), math.inf, **base)
        return Crossover(a, b, "below", None, 0.0, float(x_min), **base)
    if len(found) == 1:
        c = found[0]
        return Crossover(a, b, "crossing", c.estimate, c.low, c.high, crossings=found, **base)
    low = min(c.low if c.low is not None else c.lo for c in found)
    high = max(c.high if c.high is not None else c.hi for c in found)
    return Crossover(a, b, "several", None, float(low), float(high), crossings=found, **base)


def crossover(record: RunRecord, a: str, b: str, pairs: pd.DataFrame | None = None) -> Crossover:
    """The crossover of arms ``a`` and ``b`` over the run's sweep (:func:`locate` on its pairs)."""
    pairs = sweep_pairs(record, a, b) if pairs is None else pairs
    xs, ratios = [], []
    for x, g in pairs.groupby("x", sort=True):
        xs.append(int(x))
        ratios.append(g["ratio"].astype(float).to_numpy())
    return locate(xs, ratios, a, b)


def refinement_point(c: Crossover, target_width: float) -> int | None:
    """The point a sweep adds next for ``c`` (module docstring), or None."""
    if c.status not in ("crossing", "several"):
        return None
    widest = max(c.crossings, key=lambda k: k.width)
    if widest.width <= target_width:
        return None
    mid = round(math.sqrt(widest.lo * widest.hi))
    return mid if widest.lo < mid < widest.hi else None


def judge_crossover(c: Crossover, op: str, value: float) -> tuple[str, str]:
    """('pass' | 'fail' | 'inconclusive', why) for ``crossover[a, b] OP value``."""
    if c.status == "none":
        return "fail", "no point has pairs of both arms"
    if not c.has_interval:
        return "inconclusive", "no 95% interval: fewer than 2 pairs at a bracketing point (run more rounds)"
    assert c.low is not None and c.high is not None
    ok = c.low >= value if op == ">=" else c.high <= value
    bad = c.high < value if op == ">=" else c.low > value
    if ok:
        return "pass", ""
    if bad:
        return "fail", f"the whole interval is {'below' if op == '>=' else 'above'} {value:g} ({c.summary})"
    return "inconclusive", f"the interval contains {value:g} ({c.summary})"


@dataclass(frozen=True)
class SweepPair:
    """One arm pair of a sweep: its pairs, its points and its crossover."""

    a: str
    b: str
    pairs: pd.DataFrame
    points: pd.DataFrame
    crossover: Crossover


def analyze_sweep(record: RunRecord) -> list[SweepPair]:
    """Every pair of :func:`sweep_pair_list`, analysed; [] when the run is not a sweep."""
    if sweep_spec(record) is None:
        return []
    out = []
    for a, b in sweep_pair_list(record):
        pairs = sweep_pairs(record, a, b)
        out.append(SweepPair(a, b, pairs, point_table(record, a, b, pairs), crossover(record, a, b, pairs)))
    return out


def quantity(record: RunRecord) -> str:
    """What the sweep's points count, in words."""
    return QUANTITY.get(str((sweep_spec(record) or {}).get("vary")), "swept quantity")


def sweep_summary(record: RunRecord, analysed: list[SweepPair] | None = None) -> dict[str, Any]:
    """The sweep's result as JSON: the quantity, and per pair every point (median ratio, interval, verdict) and
    the crossover. Empty when the run is not a sweep."""
    sw = sweep_spec(record)
    if sw is None:
        return {}
    pairs = []
    for p in analyze_sweep(record) if analysed is None else analysed:
        pts = [{k: (None if pd.isna(v) else v.item() if hasattr(v, "item") else v) for k, v in row.items()}
               for row in p.points.to_dict("records")]
        pairs.append({"a": p.a, "b": p.b, "points": pts, "crossover": p.crossover.as_dict()})
    return {"vary": sw.get("vary"), "quantity": quantity(record), "pairs": pairs}
