"""Declared checks: performance targets written as expressions, in a profile (``[gate] checks = [...]``) or on
the command line (``abbench gate RUN --check EXPR``), and judged by the gate next to its built-in checks.

Grammar
-------
::

    METRIC[ARM(, KIND)(, >=TOKENS | <=TOKENS | TOKENS)(, vs ARM)] OP VALUE        OP: <=  >=  ==
    crossover[ARM, ARM] OP VALUE

``ARM`` is an arm of the run; ``KIND`` one of fresh, cold, continuation (default: every kind); ``TOKENS`` a
prompt length (``32768`` or ``32k``) with ``>=``/``<=`` for a range, bare for exactly that length; ``vs ARM``
(the paired metrics only) the arm to divide by, instead of the run's reference arm. Examples:
``ttft_ratio[layer-major, fresh, >=32768] <= 0.15``, ``h2d_banks[layer-major, fresh, <=65536] == 1``,
``x_floor[layer-major] <= 1.10``, ``decode_tok_s[layer-major] >= 100``,
``ttft_ratio[layer-major-8k, fresh, >=32768, vs giant-chunk] <= 1.05``,
``peak_vram_ratio[layer-major-8k, fresh, >=32768, vs giant-chunk] <= 0.60``,
``ttft_ratio[auto, continuation, vs demand|chunked|layer-major] <= 1.05`` (``vs A|B|C``: in each cell, against
whichever of those arms has the lowest median TTFT there), ``crossover[demand, chunked] >= 512``.

Metrics (:data:`METRICS`), each per (arm, kind, prompt length) cell over measured ok samples:

* interval metrics, judged on the 95% bootstrap interval of the cell's median (:func:`~abbench.analysis.
  timing.median_ci`): ``ttft_ratio`` (paired TTFT(arm) / TTFT(reference), same prompt and round), ``x_floor``
  (TTFT / the cell's floor, :func:`~abbench.analysis.transfer.floor_table`), ``ttft_s``, ``decode_tok_s``,
  ``tpot_s`` and ``itl_s`` (:mod:`~abbench.analysis.latency`: one TPOT per request, one ITL per gap between
  streamed arrivals), ``decode_ratio`` (paired decode tok/s(arm) / decode tok/s(reference), same prompt and
  round: "decodes at least as fast as the peer" is ``decode_ratio[ARM, vs PEER] >= 1``). With ``vs ARM``,
  ``ttft_ratio`` and ``decode_ratio`` pair with that arm instead of the reference.
  The percentile metrics ``ttft_p90_s``, ``ttft_p99_s``, ``tpot_p90_s``, ``tpot_p99_s``, ``itl_p90_s`` and
  ``itl_p99_s`` are judged the same way on the interval of that percentile
  (:func:`~abbench.analysis.timing.quantile_ci`); a cell with fewer values than the percentile needs (10 for
  p90, 100 for p99) is inconclusive.
  ``<=``: pass when the whole interval is at or below VALUE, fail when it is wholly above, otherwise
  *inconclusive* (which fails, with a rough estimate of the rounds that might settle it: the interval's
  half-width taken to shrink as 1/sqrt(n)). One sample gives no interval: inconclusive. ``==`` is refused.
* ``crossover[A, B]`` (runs with a ``[sweep]``): the swept quantity where TTFT(A) / TTFT(B) crosses 1, with A
  the arm faster below it; one cell, judged on the crossover's 95% interval the same way (an interval that
  reaches past the swept range is open on that side; no interval is inconclusive): :mod:`~abbench.analysis.sweep`.
* numerics metrics (an arm that changes arithmetic on purpose, ``parity = "numerics"``, though any arm can be
  checked): ``kl_mean``, ``kl_p99``, ``same_top`` and ``delta_p_rms`` of the arm's next-token distributions
  against the parity reference's, from their top-k logprobs, over the positions where both saw the same context;
  one cell pooling every pair the selector picks, judged the same way on a 95% cluster-bootstrap interval that
  resamples whole pairs (:mod:`~abbench.analysis.numerics`). Fewer than two pairs: inconclusive.
* counter metrics, judged on every sample: ``h2d_banks`` (prefill H2D bytes / the bank; the whole
  request's bytes when the engine gives no split), ``banks_per_window`` (the same over the engine's
  layer-major windows, at least 1: one bank per window is the layer-major promise at any length), ``nvml_process_peak_gib``
  (NVML's peak for the service's processes during the request, in GiB: the process fits a card of size VALUE when
  it passes ``<= VALUE``) and ``peak_vram_gib`` (``peak_vram_gb``, its older name, gives the same values: the engine's ``peak_device_bytes``
  when present, else NVML's peak for the service's processes; GiB = 2^30 bytes) and ``peak_vram_ratio``
  (that peak over the peak of the reference arm, or of ``vs ARM``, for the same prompt in the same round:
  one value per pair), ``h2d_ratio`` (prefill H2D bytes over the reference arm's, or ``vs ARM``'s, for the same
  prompt in the same round: what an FP8 bank or a cheaper path moves, scales included), ``cached_tokens`` (the prompt tokens the engine says, in its response, it served from
  its prefix cache: ``engine.cached_prompt_tokens``, e.g. vLLM's ``usage.prompt_tokens_details.cached_tokens``)
  and ``metrics_cached_tokens`` (the same read from its Prometheus counters around the request, the adapter's
  ``cached_prompt_tokens`` counter: after - before). ``<=``: the largest sample <= VALUE; ``>=``: the
  smallest >= VALUE; ``==``: every sample equal (relative tolerance 1e-6).

Load checks (a run with ``[load]``): a load metric, or a latency metric with a level selector (``c=16``,
``rate=8``), is judged per level of its arm on the values :func:`abbench.analysis.load.values` gives:
``throughput_ratio``, ``throughput_scaling``, ``decode_scaling``, ``output_tok_s``, ``decode_output_tok_s``,
``request_s`` and ``goodput`` one value per round (their interval is
over rounds), the latency percentiles one per request (ITL: per gap), ``error_rate`` per round and
``parity_under_load`` one per level (the fraction of prompts kept; bare it means ``>= 1``).

Every cell the selector picks must pass; a selector that picks no cell with data fails (the gate never
passes on missing data). :func:`parse_check` raises :class:`~abbench.errors.ConfigError` (exit 2) naming
the problem; :func:`bind` also checks the arm against a run.

The grammar itself (metrics, kinds, operators, :func:`parse_check`, :func:`check_arms`) is
:mod:`abbench.checkexpr`, below both the profile and this module; it is re-exported here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pandas as pd

from abbench.analysis.frames import (
    arm_adapters,
    arm_names,
    measured_ok,
    measured_ok_frame,
    peak_bytes,
    prompt_targets,
    reference_arm,
    sample_decode_tok_s,
    sample_peak_bytes,
    sample_prefill_h2d_bytes,
)
from abbench.analysis.decode import decode_over_expected
from abbench.analysis.latency import itl_values, min_n, tpot_values, ttft_values
from abbench.analysis.load import values as load_values
from abbench.analysis.numerics import NO_VOCAB_KL, estimate, numerics_positions
from abbench.analysis.sweep import crossover, judge_crossover, sweep_pairs, sweep_spec
from abbench.analysis.timing import CONFIDENCE, paired_ratios, quantile_ci
from abbench.analysis.transfer import FLOOR_KINDS, floor_table
from abbench.checkexpr import KINDS, METRICS, NUMERICS, OPS, PAIRED, DeclaredCheck, Metric, check_arms, parse_check, parse_checks
from abbench.prometheus import ENGINE_COUNTERS, common_counters, metrics_delta
from abbench.results import RunRecord, Sample

__all__ = [  # the grammar (abbench.checkexpr) is re-exported: callers of the analysis reach it here too
    "KINDS", "METRICS", "OPS", "PAIRED", "TOLERANCE", "VALUES", "Cell", "DeclaredCheck", "Metric", "bind",
    "check_arms", "declared_exprs", "describe_cell", "fmt_value", "judge", "overall", "parse_check",
    "parse_checks", "rounds_to_settle",
]

TOLERANCE = 1e-6


def bind(record: RunRecord, exprs: list[str], where: str = "--check") -> list[DeclaredCheck]:
    """Parse ``exprs`` and check their arms against the run."""
    checks = parse_checks(exprs)
    check_arms(checks, arm_names(record), reference_arm(record), f"{where} ({record.run_id})")
    return checks


def declared_exprs(record: RunRecord) -> list[str]:
    """The checks the run's recorded profile declares (``gate.checks``)."""
    return [str(x) for x in ((record.profile.get("gate") or {}).get("checks") or [])]


# ------------------------------------------------------------------------------------------ values


VALUE_COLUMNS = ["arm", "kind", "target_tokens", "round", "value"]


def _rows(df: pd.DataFrame, values: pd.Series) -> pd.DataFrame:
    out = pd.DataFrame({"arm": df["arm"], "kind": df["kind"], "target_tokens": df["target_tokens"],
                        "round": df["round"], "value": pd.to_numeric(values, errors="coerce")})
    return out[out["value"].notna()].reset_index(drop=True)


def _pairs(p: pd.DataFrame) -> pd.DataFrame:
    return _rows(p, p["ratio"]) if not p.empty else pd.DataFrame(columns=VALUE_COLUMNS)


PAIRED_VALUE: dict[str, Callable[[Sample], float | None]] = {
    "ttft_ratio": lambda s: s.ttft_s, "peak_vram_ratio": sample_peak_bytes, "decode_ratio": sample_decode_tok_s,
    "h2d_ratio": sample_prefill_h2d_bytes}
"""The per-sample figure each paired metric divides."""


def _paired(metric: str) -> Callable[[RunRecord], pd.DataFrame]:
    """A paired metric's values against the reference arm."""
    return lambda record: _pairs(paired_ratios(record, value=PAIRED_VALUE[metric]))


def _values(record: RunRecord, c: DeclaredCheck) -> pd.DataFrame:
    """The check's values: a paired metric against ``c.vs`` when given, else ``VALUES`` (against the
    reference)."""
    if len(c.vs_arms) > 1:
        return _fastest_pairs(record, c)
    if c.vs is not None:
        return _pairs(paired_ratios(record, against=c.vs, value=PAIRED_VALUE[c.metric]))
    return VALUES[c.metric](record)


def _fastest_pairs(record: RunRecord, c: DeclaredCheck) -> pd.DataFrame:
    """``ttft_ratio[ARM, ..., vs A|B|C]``: in each (kind, length) cell, the pairs with whichever of A, B, C has
    the lowest median TTFT there."""
    df = measured_ok_frame(record)
    df = df[df["arm"].isin(c.vs_arms) & df["ttft_s"].notna()]
    if df.empty:
        return pd.DataFrame(columns=VALUE_COLUMNS)
    med = df.groupby(["kind", "target_tokens", "arm"], sort=False)["ttft_s"].median().reset_index()
    best = med.sort_values("ttft_s", kind="stable").drop_duplicates(["kind", "target_tokens"])
    parts = []
    for arm, cells in best.groupby("arm", sort=False):
        p = _pairs(paired_ratios(record, against=str(arm)))
        keys = set(zip(cells["kind"], cells["target_tokens"]))
        parts.append(p[[(k, t) in keys for k, t in zip(p["kind"], p["target_tokens"])]])
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=VALUE_COLUMNS)


def _crossover_cells(record: RunRecord, c: DeclaredCheck) -> list[Cell]:
    """``crossover[A, B]``: one cell, the sweep's quantity, judged on the crossover's interval
    (:func:`abbench.analysis.sweep.judge_crossover`); none when the run is not a sweep or has no pairs."""
    sw = sweep_spec(record)
    pairs = sweep_pairs(record, c.arm, str(c.vs)) if sw is not None else None
    if pairs is None or pairs.empty:
        return []
    x = crossover(record, c.arm, str(c.vs), pairs)
    status, why = judge_crossover(x, c.op, c.value)
    value = x.estimate if x.estimate is not None else math.nan
    return [Cell(str(sw.get("vary")), None, len(pairs), int(pairs["round"].nunique()), value, x.low, x.high,
                 status, why or x.summary)]


def _x_floor(record: RunRecord) -> pd.DataFrame:
    floors = floor_table(record)
    df = measured_ok_frame(record)
    if floors.empty or df.empty:
        return pd.DataFrame(columns=VALUE_COLUMNS)
    floor = {(a, k, int(t)): f for a, k, t, f in zip(floors["arm"], floors["kind"], floors["target_tokens"],
                                                    floors["floor_s"]) if pd.notna(t) and pd.notna(f) and f > 0}
    df = df[df["kind"].isin(FLOOR_KINDS)]
    f = [floor.get((a, k, int(t))) if pd.notna(t) else None
         for a, k, t in zip(df["arm"], df["kind"], df["target_tokens"])]
    return _rows(df, df["ttft_s"] / pd.Series(f, index=df.index, dtype=float))


def _column(col: str, scale: float = 1.0) -> Callable[[RunRecord], pd.DataFrame]:
    def values(record: RunRecord) -> pd.DataFrame:
        df = measured_ok_frame(record)
        return _rows(df, df[col] / scale) if not df.empty else pd.DataFrame(columns=VALUE_COLUMNS)
    return values


def _h2d_banks(record: RunRecord) -> pd.DataFrame:
    df = measured_ok_frame(record)
    if df.empty:
        return pd.DataFrame(columns=VALUE_COLUMNS)
    prefill = df["prefill_h2d_bytes"].where(df["prefill_h2d_bytes"].notna(), df["h2d_bytes"])
    return _rows(df, prefill / df["bank_bytes"].where(df["bank_bytes"] > 0))


def _banks_per_window(record: RunRecord) -> pd.DataFrame:
    banks = _h2d_banks(record)
    if banks.empty:
        return banks
    df = measured_ok_frame(record)
    prefill = df["prefill_h2d_bytes"].where(df["prefill_h2d_bytes"].notna(), df["h2d_bytes"])
    windows = df["n_windows"].fillna(1.0).clip(lower=1.0)
    return _rows(df, prefill / df["bank_bytes"].where(df["bank_bytes"] > 0) / windows)


def _peak_vram(record: RunRecord) -> pd.DataFrame:
    df = measured_ok_frame(record)
    if df.empty:
        return pd.DataFrame(columns=VALUE_COLUMNS)
    return _rows(df, peak_bytes(df) / 2**30)


def _metrics_cached(record: RunRecord) -> pd.DataFrame:
    """Per measured ok sample with both scrapes: the adapter's ``cached_prompt_tokens`` counter, after - before."""
    adapters, targets = arm_adapters(record), prompt_targets(record)
    rows = []
    for smp in measured_ok(record):
        t = smp.telemetry
        if t.metrics_after is None or t.metrics_before is None:
            continue
        c = common_counters(ENGINE_COUNTERS.get(adapters.get(smp.arm, "openai"), {}),
                            metrics_delta(t.metrics_before, t.metrics_after))
        if "cached_prompt_tokens" in c:
            rows.append({"arm": smp.arm, "kind": smp.kind, "target_tokens": targets.get(smp.prompt_id, smp.prompt_tokens),
                         "round": smp.round, "value": c["cached_prompt_tokens"]})
    return pd.DataFrame(rows, columns=VALUE_COLUMNS)


VALUES: dict[str, Callable[[RunRecord], pd.DataFrame]] = {
    "ttft_ratio": _paired("ttft_ratio"), "x_floor": _x_floor, "ttft_s": _column("ttft_s"),
    "decode_tok_s": _column("decode_tok_s"), "decode_ratio": _paired("decode_ratio"),
    "decode_x_floor": decode_over_expected, "h2d_banks": _h2d_banks,
    "banks_per_window": _banks_per_window,
    "peak_vram_gib": _peak_vram, "peak_vram_gb": _peak_vram, "peak_vram_ratio": _paired("peak_vram_ratio"),
    "h2d_ratio": _paired("h2d_ratio"),
    "nvml_process_peak_gib": _column("proc_gpu_mem_peak", 2**30),
    "ttft_p90_s": ttft_values, "ttft_p99_s": ttft_values, "tpot_s": tpot_values, "tpot_p90_s": tpot_values,
    "tpot_p99_s": tpot_values, "itl_s": itl_values, "itl_p90_s": itl_values, "itl_p99_s": itl_values,
    "cached_tokens": _column("cached_prompt_tokens"), "metrics_cached_tokens": _metrics_cached,
}
"""Per metric, against the reference arm where paired: one row per measured ok sample (or pair): arm, kind,
target_tokens, round, value (:func:`_values` pairs with another arm)."""


# ------------------------------------------------------------------------------------------ judging


@dataclass(frozen=True)
class Cell:
    """One (kind, length) cell of a check: its value, interval (or range) and verdict."""

    kind: str
    tokens: int | None
    n: int
    rounds: int
    value: float
    low: float | None
    high: float | None
    status: str
    """'pass', 'fail' or 'inconclusive'."""
    why: str = ""

    @property
    def halfwidth(self) -> float | None:
        """Half the interval's width relative to the value (None without an interval)."""
        if self.low is None or self.high is None or not self.value:
            return None
        return (self.high - self.low) / 2 / abs(self.value)


def rounds_to_settle(value: float, low: float, high: float, bound: float, n: int, rounds: int) -> str:
    """Roughly how many rounds might settle an interval that contains ``bound``: the half-width taken to
    shrink as 1/sqrt(n)."""
    half, gap = (high - low) / 2, abs(value - bound)
    if gap <= 0 or half <= 0:
        return "the median sits on the bound: no number of rounds is likely to settle it"
    need_n = n * (half / gap) ** 2
    per_round = max(n / max(rounds, 1), 1e-9)
    total = max(rounds + 1, math.ceil(need_n / per_round))
    side = "below" if value < bound else "above"
    return f"roughly {total} rounds (now {rounds}) might settle it (median {value:.4g} is {side} {bound:g})"


def interval_status(c: DeclaredCheck, value: float, low: float, high: float, n: int, rounds: int) -> tuple[str, str]:
    """(status, why) of an interval against the check's bound: pass when the whole interval is on the right side,
    fail when wholly on the wrong side, else inconclusive with the rounds that might settle it."""
    if (high <= c.value) if c.op == "<=" else (low >= c.value):
        return "pass", ""
    if (low > c.value) if c.op == "<=" else (high < c.value):
        return "fail", f"the whole interval is {'above' if c.op == '<=' else 'below'} {c.value:g}"
    return "inconclusive", f"the interval contains {c.value:g}; " + rounds_to_settle(value, low, high, c.value, n,
                                                                                      rounds)


def _judge_interval(c: DeclaredCheck, vals: np.ndarray, rounds: int) -> tuple[float, float | None, float | None,
                                                                              str, str]:
    q = c.spec.quantile
    if len(vals) < min_n(q):
        return float(np.quantile(vals, q)), None, None, "inconclusive", (
            f"n={len(vals)}: a p{q * 100:g} needs at least {min_n(q)} values; run more rounds or prompts")
    ci = quantile_ci(vals, q)
    if ci.low is None or ci.high is None:
        return ci.median, None, None, "inconclusive", (f"n={len(vals)}: no {CONFIDENCE:.0%} interval; at least "
                                                        "2 rounds are needed")
    status, why = interval_status(c, ci.median, ci.low, ci.high, len(vals), rounds)
    return ci.median, ci.low, ci.high, status, why


def _numerics_cells(record: RunRecord, c: DeclaredCheck) -> list[Cell]:
    """A numerics metric (:mod:`abbench.analysis.numerics`): one cell pooling every position of the pairs the
    selector picks, judged on the cluster-bootstrap interval."""
    pos = numerics_positions(record, [c.arm])
    keep = [c.selects(str(k), None if pd.isna(t) else int(t)) for k, t in zip(pos["kind"], pos["target_tokens"])]
    pos = pos[np.asarray(keep, dtype=bool)] if len(pos) else pos
    if pos.empty:
        return []
    est = estimate(pos, c.metric)
    rounds = int(pos["round"].nunique())
    kind = c.kind or "all"
    if est.low is None or est.high is None:
        why = est.note if est.note == NO_VOCAB_KL else f"{est.note}; run more rounds or prompts"
        return [Cell(kind, c.tokens if c.tokens_op == "==" else None, est.pairs, rounds, est.value, None, None,
                     "inconclusive", why)]
    status, why = interval_status(c, est.value, est.low, est.high, est.pairs, rounds)
    return [Cell(kind, c.tokens if c.tokens_op == "==" else None, est.pairs, rounds, est.value, est.low, est.high,
                 status, why or f"{est.positions} positions")]


def _judge_counter(c: DeclaredCheck, vals: np.ndarray) -> tuple[float, float, float, str, str]:
    lo, hi, med = float(vals.min()), float(vals.max()), float(np.median(vals))
    tol = TOLERANCE * max(1.0, abs(c.value))
    if c.op == "<=":
        ok, why = hi <= c.value + tol, f"largest sample {hi:.4g} > {c.value:g}"
    elif c.op == ">=":
        ok, why = lo >= c.value - tol, f"smallest sample {lo:.4g} < {c.value:g}"
    else:
        off = int(np.sum(np.abs(vals - c.value) > tol))
        ok, why = off == 0, f"{off}/{len(vals)} sample(s) differ from {c.value:g} (range {lo:.4g}-{hi:.4g})"
    return med, lo, hi, "pass" if ok else "fail", "" if ok else why


def _load_cells(record: RunRecord, c: DeclaredCheck) -> list[Cell]:
    """A load check's cells: one per level of its arm (``kind`` holds the level, e.g. ``c=16``), judged as the
    other metrics are (:mod:`abbench.analysis.load` defines the values)."""
    df = load_values(record, c.metric, c.vs)
    df = df[df["arm"] == c.arm]
    cells: list[Cell] = []
    for label, g in df.groupby("level", sort=False):
        if not c.selects_level(str(label)):
            continue
        cells.append(_judged(c, str(label), None, g))
    return cells


def _judged(c: DeclaredCheck, kind: str, tokens: int | None, g: pd.DataFrame) -> Cell:
    """One cell of ``c`` from its rows ``g`` (value, round): on the interval or on every sample, as the metric is."""
    vals = g["value"].astype(float).to_numpy()
    rounds = int(g["round"].nunique())
    if c.spec.interval:
        v, lo, hi, status, why = _judge_interval(c, vals, rounds)
    else:
        v, lo, hi, status, why = _judge_counter(c, vals)
    return Cell(kind, tokens, len(vals), rounds, v, lo, hi, status, why)


def judge(record: RunRecord, c: DeclaredCheck, values: pd.DataFrame | None = None) -> list[Cell]:
    """The check's cells (kind, length) for its arm, each with its value, interval and verdict; a load check's
    cells are its levels."""
    if c.metric == "crossover":
        return _crossover_cells(record, c)
    if c.load and values is None:
        return _load_cells(record, c)
    if c.metric in NUMERICS:
        return _numerics_cells(record, c)
    df = _values(record, c) if values is None else values
    df = df[df["arm"] == c.arm]
    cells: list[Cell] = []
    for (kind, tokens), g in df.groupby(["kind", "target_tokens"], sort=False, dropna=False):
        t = None if pd.isna(tokens) else int(tokens)
        if not c.selects(str(kind), t):
            continue
        cells.append(_judged(c, str(kind), t, g))
    order = {"fresh": 0, "cold": 1, "continuation": 2}
    return sorted(cells, key=lambda x: (order.get(x.kind, 9), x.tokens or 0))


def fmt_value(v: float | None) -> str:
    return "—" if v is None or math.isnan(v) else f"{v:.4g}"


def describe_cell(c: DeclaredCheck, cell: Cell) -> str:
    """'fresh 32768: 0.146 (95% CI 0.143-0.148, n=2 pairs) pass'."""
    what = ("pairs" if c.metric in PAIRED or c.metric in ("crossover", *NUMERICS) else
            "rounds" if c.metric in ("output_tok_s", "decode_output_tok_s", "request_s", "goodput", "error_rate",
                                     "throughput_scaling", "decode_scaling") else
            "level" if c.metric == "parity_under_load" else "samples")
    if cell.low is None:
        span = f"n={cell.n} {what}"
    else:
        label = f"{CONFIDENCE:.0%} CI" if c.spec.interval else "range"
        span = f"{label} {fmt_value(cell.low)}–{fmt_value(cell.high)}, n={cell.n} {what}"
    length = "" if cell.tokens is None else f" {cell.tokens}"
    return f"{cell.kind}{length}: {fmt_value(cell.value)} ({span}) {cell.status}"


def overall(cells: list[Cell]) -> str:
    """'fail' when a cell fails (or there is none), else 'inconclusive' when one is, else 'pass'."""
    if not cells or any(x.status == "fail" for x in cells):
        return "fail"
    return "inconclusive" if any(x.status == "inconclusive" for x in cells) else "pass"
