"""The report's *Load levels* section (runs with load levels): how the levels ran, then per (arm, level) cell the
latency percentiles with their 95% intervals, throughput, goodput, errors and the number in flight; the
throughput ratio of each arm to the reference at each level (paired by round); parity under load; the server's
gauges scraped during the levels; and the plot (``load.png``: TTFT p50/p99 and ITL p99 against achieved output
tokens/s, one line per arm, points labelled by level). Nothing for other runs.
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from abbench.analysis.load import load_levels, load_slos, throughput_window
from abbench.analysis.timing import median_ci, verdict
from abbench.report.format import DASH, Col, bullets, fmt_int, fmt_num, fmt_ratio, fmt_s, fmt_text, table
from abbench.report.sections.base import ReportInput, plot_link
from abbench.results import RunRecord

__all__ = ["GAUGE_WORDS", "load_section"]

GAUGE_WORDS = ("running", "waiting", "usage", "queue", "nvml_gpu")
"""Scraped series shown in the report: gauges whose name holds one of these (vLLM's num_requests_running and
num_requests_waiting, kv_cache_usage_perc, the vendored engine's queue, the GPUs' NVML samples); counters
(``_total``) are left out."""


def _ci_s(row: Any, key: str) -> str:
    v, lo, hi = row.get(key), row.get(f"{key}_low"), row.get(f"{key}_high")
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return DASH
    if lo is None or hi is None or (isinstance(lo, float) and math.isnan(lo)):
        return fmt_s(v)
    return f"{fmt_s(v)} ({fmt_s(lo)}–{fmt_s(hi)})"


def _ci_rate(row: Any, key: str) -> str:
    v, lo, hi = row.get(key), row.get(f"{key}_low"), row.get(f"{key}_high")
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return DASH
    if lo is None or hi is None or (isinstance(lo, float) and math.isnan(lo)):
        return fmt_num(v, 1)
    return f"{fmt_num(v, 1)} ({fmt_num(lo, 1)}–{fmt_num(hi, 1)})"


def _how(record: RunRecord) -> list[str]:
    spec: dict[str, Any] = record.profile.get("load") or {}
    levels = load_levels(record)
    out = []
    conc = sorted({int(lv.value) for lv in levels if lv.kind == "concurrency"})
    rates = sorted({lv.value for lv in levels if lv.kind == "rate"})
    if conc:
        out.append("closed loop (N requests always in flight): " + ", ".join(f"c={c}" for c in conc))
    if rates:
        arrival = spec.get("arrival", "poisson")
        b = spec.get("burstiness", 1.0)
        how = "Poisson arrivals" if arrival == "poisson" else f"gamma arrivals, burstiness {b:g}"
        out.append(f"open loop ({how}, seed {spec.get('seed', 0)}, sent on time however slow the server): "
                   + ", ".join("rate=inf" if math.isinf(r) else f"rate={r:g}/s" for r in rates))
    per = (f"{spec['duration_s']:g} s of sends" if spec.get("duration_s") else
           f"{spec.get('requests') or 32} requests")
    out.append(f"per level: {per}; measured: requests sent from {spec.get('warmup_s', 0):g} s after its start to "
               f"{spec.get('cooldown_s', 0):g} s before its last send; throughput counts what arrived in that window"
               + (" (at a rate, until the last measured request ended)" if rates else ""))
    if spec.get("warmup_requests"):
        out.append(f"warm-up: {spec['warmup_requests']} requests before each level on prompts of their own (closed "
                   "loop at its concurrency; a rate level's all at once), not recorded, then the cache reset")
    slos = load_slos(record)
    out.append("goodput SLOs: " + (", ".join(f"`{s.expr}`" for s in slos) if slos else "none declared"))
    refs = load_levels(record, "reference")
    out.append(f"parity reference: {'every prompt run alone per arm' if refs else 'none run'}")
    rounds = sorted({lv.round for lv in levels})
    out.append(f"rounds: {len(rounds)} (the arms in ABBA order at each level); intervals are 95% percentile "
               "bootstrap: latency percentiles over the cell's requests (ITL over gaps, which are not independent "
               "within a request: read its interval as a lower bound on the uncertainty), throughput over rounds")
    return out


def _cells(cells: pd.DataFrame) -> list[str]:
    rows = []
    for _, r in cells.iterrows():
        d = r.to_dict()
        rows.append({
            "arm": d["arm"], "level": d["level"], "rounds": d["rounds"], "measured": d["measured"], "ok": d["ok"],
            "errors": d["errors"] or ("none" if not d["failed"] else DASH),
            "ttft50": _ci_s(d, "ttft_p50_s"), "ttft99": _ci_s(d, "ttft_p99_s"), "tpot50": _ci_s(d, "tpot_p50_s"),
            "itl99": _ci_s(d, "itl_p99_s"), "e2e50": _ci_s(d, "e2e_p50_s"),
            "req": _ci_rate(d, "request_s"), "tok": _ci_rate(d, "output_tok_s"),
            "dec": _ci_rate(d, "decode_output_tok_s"), "good": _ci_rate(d, "goodput"),
            "flight": DASH if d["in_flight_mean"] is None or d["in_flight_mean"] != d["in_flight_mean"] else
            f"{d['in_flight_mean']:.1f} / {fmt_int(d['in_flight_max'])}",
            "lag": fmt_s(d["lag_p99_s"]),
        })
    cols = [Col("arm", "Arm", descriptive=True, right=False), Col("level", "Level", right=False),
            Col("rounds", "Rounds", fmt_int, descriptive=True), Col("measured", "Measured", fmt_int),
            Col("ok", "OK", fmt_int), Col("errors", "Errors", fmt_text, right=False),
            Col("ttft50", "TTFT p50"), Col("ttft99", "TTFT p99"), Col("tpot50", "TPOT p50"), Col("itl99", "ITL p99"),
            Col("e2e50", "E2E p50"), Col("req", "Req/s"), Col("tok", "Output tok/s"), Col("dec", "Decode tok/s"),
            Col("good", "Goodput req/s"),
            Col("flight", "In flight mean / max"), Col("lag", "Send lag p99")]
    return [table(pd.DataFrame(rows), cols)]


def _ratios(ratios: pd.DataFrame, reference: str | None, arms: int) -> list[str]:
    if ratios is None or ratios.empty:
        return ["One arm ran the levels: no ratio." if arms < 2 else
                "No arm has a level and round in common with the reference arm."]
    rows = []
    for (arm, level), g in ratios.groupby(["arm", "level"], sort=False):
        ci = median_ci(g["value"].astype(float))
        rows.append({"arm": arm, "level": level, "n": len(g), "median": ci.median,
                     "ci": DASH if ci.low is None else f"{ci.low:.3f}x – {ci.high:.3f}x",
                     "verdict": {"faster": "less", "slower": "more"}.get(verdict(ci.low, ci.high), "not significant")
                     if ci.low is not None else "undetermined (one round)",
                     "note": (ci.note or "").replace("pairs", "rounds")})
    cols = [Col("arm", "Arm", right=False), Col("level", "Level", right=False), Col("n", "Rounds", fmt_int),
            Col("median", f"Output tok/s / {reference}", fmt_ratio), Col("ci", "95% CI"),
            Col("verdict", "Throughput", right=False), Col("note", "Note", fmt_text, descriptive=True, right=False)]
    return [table(pd.DataFrame(rows), cols, drop_constant=False)]


def _parity(parity: pd.DataFrame, k: int) -> list[str]:
    if parity is None or parity.empty:
        return ["No level to check."]
    cols = [Col("arm", "Arm", descriptive=True, right=False), Col("level", "Level", right=False),
            Col("prompts", "Prompts", fmt_int), Col("identical", f"Identical over {k}", fmt_int),
            Col("near_tie", "Near-tie flips", fmt_int), Col("broken", "Broken", fmt_int),
            Col("unchecked", "Unchecked", fmt_int), Col("kept", "Kept", fmt_int),
            Col("first_diverging", "First difference at", fmt_int), Col("example", "Example", right=False)]
    return [table(parity, cols)]


def _peaks(scrapes: list[Any]) -> dict[str, float]:
    """Per gauge name (:data:`GAUGE_WORDS` in the name, counters left out): its peak over the scrapes, each
    scrape's value the sum over its label sets (vLLM labels by engine and model, waiting by reason)."""
    peaks: dict[str, float] = {}
    for s in scrapes:
        sums: dict[str, float] = {}
        for key, v in s.metrics.items():
            name = key.split("{", 1)[0]
            if name.endswith("_total") or not any(w in name.lower() for w in GAUGE_WORDS):
                continue
            sums[name] = sums.get(name, 0.0) + v
        for name, v in sums.items():
            peaks[name] = max(peaks.get(name, v), v)
    return dict(sorted(peaks.items())[:8])


def _gauges(record: RunRecord) -> list[str]:
    cells: dict[tuple[str, str], list[Any]] = {}
    for lv in load_levels(record):
        cells.setdefault((lv.arm, lv.label), []).append(lv)
    rows = []
    for (arm, label), levels in cells.items():
        scrapes = [s for lv in levels for s in lv.scrapes]
        if not scrapes:
            continue
        peaks = _peaks(scrapes)
        rows.append(f"{arm} {label}: {len(scrapes)} scrapes over {len(levels)} round(s); peak "
                    + (", ".join(f"`{k}` {v:.4g}" for k, v in peaks.items()) or "no matching gauge"))
    errors = [f"scraping stopped ({lv.arm} {lv.label} round {lv.round}): {lv.scrape_error}"
              for lv in load_levels(record) if lv.scrape_error]
    if not rows and not errors:
        return []
    return ["### Server metrics during the levels", "",
            "Peaks of the engine's gauges of running, waiting and queued requests and of cache usage, each summed "
            "over its label sets, scraped during the levels (and of the GPUs' memory and utilisation, from NVML).", "", bullets(rows + errors)]


def load_section(ri: ReportInput) -> list[str]:
    record, a = ri.record, ri.analysis
    if not record.load:
        return []
    lines = ["## Load levels", "", bullets(_how(record)), ""]
    stopped = [f"{lv.arm} {lv.label} round {lv.round}: {lv.stopped}" for lv in record.load if lv.stopped]
    if stopped:
        lines += ["Stopped early:", "", bullets(stopped), ""]
    empty = [f"{lv.arm} {lv.label} round {lv.round}" for lv in load_levels(record)
             if throughput_window(lv)[1] <= throughput_window(lv)[0]]
    if empty:
        lines += ["No measured window (warm-up and cool-down cover every send; no throughput, no goodput): "
                  + ", ".join(empty) + ".", ""]
    if a.load is None or a.load.empty:
        lines.append("No load level ran (only parity references).")
    else:
        lines += ["Per cell (arm, level), measured requests of every round; percentiles with their 95% interval "
                  "in brackets; a p99 needs 100 requests in the cell, a p90 ten. TTFT from each request's send; "
                  "send lag = sent - due (open loop). Decode tok/s: output tokens made while no request waited for its "
                  "first token, over that time (prefill left out; `decode_output_tok_s`).", "", *_cells(a.load)]
        lines += ["", "### Throughput against the reference arm", "",
                  "Output tokens/s of the arm over the reference's at the same level and round (ABBA pairs): "
                  "median over rounds and its 95% bootstrap interval.", "", *_ratios(a.load_ratios, a.reference,
                                                                                  a.load["arm"].nunique())]
    lines += ["", "### Parity under load", "",
              f"Each measured request's greedy ids against the same prompt run alone on the same arm, over the "
              f"first {a.parity_tokens} tokens (gate.parity_tokens); per prompt its worst request. Near-tie flips "
              "follow the parity rule (each side's choice is the other's runner-up within the tolerance); kept = "
              "identical, plus near-tie flips where the gate accepts them.", "", *_parity(a.load_parity,
                                                                                          a.parity_tokens)]
    gauges = _gauges(record)
    if gauges:
        lines += ["", *gauges]
    return lines + plot_link(ri.plots, "load", "TTFT and ITL against achieved output tokens/s, per arm and level")

