"""Load cells: what each (arm, level) measured, the throughput ratio between arms, goodput, errors, the number in
flight, and parity under load. Pure functions of a run's ``RunRecord.load`` (:mod:`abbench.loadrecords`).

Definitions
-----------
A **cell** is (arm, level); its rounds are the levels of that arm and level in each round (ABBA: the arms run
at each level in the rounds' order). Levels of ``role`` "reference" (every prompt alone) are the parity
reference, never a cell. A level an interrupt stopped (``stopped``) is read only while no complete level of the
same (arm, role, level, round) exists: a resumed run runs it again, and the complete one replaces it.

A **load run** (:func:`is_load_run`: its profile has a ``[load]`` table) runs load levels only; its planned cells
(:func:`planned_cells`) are every arm at every level in every round of ``run.rounds``, and each arm's parity
reference per round with ``parity_reference``.

* **Measured requests**: those sent in the level's window ``[window_start_s, window_end_s]`` (warm-up and
  cool-down excluded); a request cut off by an interrupt is not counted at all.
* Per request, as ``vllm bench serve`` defines them: **TTFT** from its send to its first token; **TPOT** =
  (end - first token) / (output tokens - 1); **ITL** = gaps between successive distinct arrivals of output
  (one per network chunk, :func:`abbench.analysis.latency.gaps`); **E2E** from send to end; the generator's
  **lag** = sent - scheduled (open loop). ``ttft_sched_s`` counts TTFT from the due time instead, so a
  generator that fell behind cannot hide it.
* Percentiles p50/p90/p99 over the cell's measured ok requests of every round, with a 95% percentile-bootstrap
  interval (:func:`abbench.analysis.timing.quantile_ci`); a percentile needs 1 / (1 - q) values
  (:func:`abbench.analysis.latency.min_n`), else it is not given. ITL gaps of one request are not independent,
  so an ITL interval is narrower than the truth; the report says so.
* Per round, over the **throughput window** (:func:`throughput_window`): the measured window in a closed loop (the
  drain after the last send has fewer in flight and is left out); in an open loop (``rate``) from its start to
  the end of the last measured request, since the arrivals, not the responses, set the pace there (at
  ``rate=inf`` every request is sent at once, and the window of sends is empty). **request_s** = ok requests that
  ended in the window / its length; **output_tok_s** = output tokens that arrived in the window / its length (a
  token's arrival is its stamp); **goodput** = measured ok requests
  that met every SLO of ``[load] slo`` and ended in the window / its length; **error_rate** = measured failed
  requests / measured requests. The cell's figure is the median over rounds, with a bootstrap interval over
  rounds from two rounds up.
* **Decode throughput** per round, **decode_output_tok_s**: output tokens made while every request in flight was
  decoding, over that time (:func:`decode_spans`). The spans are the throughput window's times when some
  request had its first token and none was waiting for one (sent, no first token yet: queued or prefilling);
  a token counts when it and the same request's token before it both arrived within one span, so no
  prefill's time is credited to decode. ``output_tok_s`` counts every token over the whole window and so
  mixes in prefill: with 4K prompts and 64 output tokens it is mostly prefill. None when no span holds a
  counted token.
* **throughput_ratio**: output_tok_s(arm) / output_tok_s(reference arm, or ``vs ARM``) at the same level and
  round (the pair ABBA makes), median over rounds with its interval.
* **throughput_scaling**: output_tok_s(arm, level) / output_tok_s(arm, the run's first level) in the same round
  (what the load buys an arm: at c=8 over c=1, the aggregate over one sequence's), median over rounds with its
  interval; the first level has none. **decode_scaling**: the same of decode_output_tok_s (what the load buys the
  decode step alone: at c=8 over c=1, 8 sequences' tokens/s over one's).
* **In flight** over time: the step function of sends and ends (:func:`in_flight`); its mean over the window
  and its maximum.
* **Parity between arms** (:func:`alone_parity`): each arm's run alone of a prompt against the parity reference
  arm's, same round, over K tokens, by the same near-tie rule.
* **Parity under load**: each measured ok request's native ids against the same prompt's run alone on the same
  arm (its ``reference`` level of the same round, else any round): identical over the gate's K tokens
  (``gate.parity_tokens``), else a near-tie flip by :func:`abbench.analysis.parity.flip_verdict` with the arm's
  tolerance, else broken. Per prompt, its worst request decides; a prompt is **kept** when identical, or a
  near-tie flip that the gate accepts (the arm's or the gate's ``accept_near_ties``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from typing import Any

import numpy as np
import pandas as pd

from abbench.analysis.frames import arm_names, arm_tolerances, gate_spec, parity_reference_arm, reference_arm
from abbench.analysis.latency import min_n
from abbench.analysis.parity import NEAR_TIE_NATS, compare_ids, flip_verdict
from abbench.analysis.timing import quantile_ci
from abbench.checkexpr import Slo, parse_slo
from abbench.loadrecords import LoadLevel, LoadRequest
from abbench.results import RunRecord

__all__ = ["CELL_COLUMNS", "PARITY_COLUMNS", "REQUEST_COLUMNS", "alone_parity", "cell_table", "decode_figure",
           "decode_spans", "in_flight", "is_load_run", "level_rounds", "load_levels", "planned_cells", "load_slos",
           "measured", "parity_under_load", "request_metrics", "requests_table", "round_figures",
           "throughput_ratios", "values"]

PERCENTILES = (50, 90, 99)
RESAMPLES = 1000
LATENCIES = ("ttft", "tpot", "itl", "e2e")
CELL_COLUMNS = (["arm", "level", "kind", "value", "rounds", "sent", "measured", "ok", "failed", "errors"]
                + [f"{m}_p{p}_s{x}" for m in LATENCIES for p in PERCENTILES for x in ("", "_low", "_high")]
                + [f"{f}{x}" for f in ("request_s", "output_tok_s", "decode_output_tok_s", "goodput", "error_rate")
                   for x in ("", "_low", "_high")]
                + ["in_flight_mean", "in_flight_max", "lag_p99_s", "ttft_sched_p99_s", "slo_met"])
REQUEST_COLUMNS = ["arm", "round", "position", "role", "level", "index", "prompt_id", "target_tokens", "max_tokens",
                   "scheduled_s", "sent_s", "first_token_s", "end_s", "measured", "ok", "error_kind", "status",
                   "ttft_s", "tpot_s", "e2e_s", "itl_max_s", "lag_s", "prompt_tokens", "completion_tokens",
                   "ids_source", "output_ids", "error"]
PARITY_COLUMNS = ["arm", "level", "prompts", "identical", "near_tie", "broken", "unchecked", "kept",
                  "first_diverging", "example", "tolerance", "accepts"]


def _key(lv: LoadLevel) -> tuple[str, str, str, float, int]:
    return (lv.arm, lv.role, lv.kind, float(lv.value), lv.round)


def load_levels(record: RunRecord, role: str = "load") -> list[LoadLevel]:
    """The levels of ``role``; a stopped level only where no complete one of its key replaced it."""
    complete = {_key(lv) for lv in record.load if lv.stopped is None}
    return [lv for lv in record.load if lv.role == role and (lv.stopped is None or _key(lv) not in complete)]


def is_load_run(record: RunRecord) -> bool:
    """Whether the run's profile has a ``[load]`` table (``abbench run`` then runs its load levels only)."""
    return bool(record.profile.get("load"))


def planned_cells(record: RunRecord) -> list[tuple[str, str, str, float, int]]:
    """Every (arm, role, kind, value, round) a load run plans (module docstring), in run order."""
    load = record.profile.get("load") or {}
    rounds = (record.profile.get("run") or {}).get("rounds")
    n = int(rounds) if isinstance(rounds, (int, float)) or str(rounds).isdigit() else 0
    levels = [("concurrency", float(c)) for c in load.get("concurrency") or []] + [
        ("rate", float(r)) for r in load.get("rate") or []]
    out = []
    for r in range(1, n + 1):
        for a in arm_names(record):
            if load.get("parity_reference", True):
                out.append((a, "reference", "concurrency", 1.0, r))
            out += [(a, "load", kind, value, r) for kind, value in levels]
    return out


def load_slos(record: RunRecord) -> list[Slo]:
    return [parse_slo(e) for e in ((record.profile.get("load") or {}).get("slo") or [])]


def measured(level: LoadLevel) -> list[LoadRequest]:
    """The requests sent in the level's window (an interrupted one is not counted)."""
    lo, hi = level.window_start_s, level.window_end_s
    return [r for r in level.requests if lo <= r.sent_s <= hi and r.error_kind != "interrupted"]


def request_metrics(r: LoadRequest) -> dict[str, Any]:
    """One ok request's TTFT, TPOT, ITL gaps, E2E, lag and TTFT from its due time (seconds; None where undefined)."""
    ttft = r.ttft_s
    e2e = r.e2e_s
    n = r.completion_tokens or len(r.output_ids)
    tpot = ((e2e - ttft) / (n - 1)) if e2e is not None and ttft is not None and n > 1 else None
    times = np.unique(np.asarray(r.token_times_s or [], dtype=float))
    itl = np.diff(times) if times.size > 1 else np.empty(0)
    lag = None if r.scheduled_s is None else r.sent_s - r.scheduled_s
    sched = None if ttft is None or r.scheduled_s is None else r.first_token_s - r.scheduled_s  # type: ignore[operator]
    return {"ttft": ttft, "tpot": tpot, "itl": itl, "e2e": e2e, "lag": lag, "ttft_sched": sched,
            "itl_max": float(itl.max()) if itl.size else None}


def _slo_value(slo: Slo, m: dict[str, Any]) -> float | None:
    return {"ttft_s": m["ttft"], "tpot_s": m["tpot"], "e2e_s": m["e2e"],
            "itl_s": m["itl_max"] if m["itl_max"] is not None else 0.0}[slo.metric]


def throughput_window(level: LoadLevel) -> tuple[float, float]:
    """(start, end) on the level clock of the window its throughput is counted over (module docstring): the
    measured window, extended in an open loop to the end of the last measured request that ended."""
    lo, hi = level.window_start_s, level.window_end_s
    if level.kind == "rate":
        ends = [r.end_s for r in measured(level) if r.end_s is not None]
        hi = max([hi, *ends])
    return lo, hi


def _union(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted disjoint union of closed intervals (empty ones dropped)."""
    out: list[list[float]] = []
    for a, b in sorted(s for s in spans if s[1] > s[0]):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _minus(spans: list[tuple[float, float]], holes: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """``spans`` less ``holes`` (both sorted and disjoint, as :func:`_union` gives them)."""
    out, j = [], 0
    for a, b in spans:
        while j < len(holes) and holes[j][1] <= a:
            j += 1
        k, start = j, a
        while k < len(holes) and holes[k][0] < b:
            if holes[k][0] > start:
                out.append((start, holes[k][0]))
            start = max(start, holes[k][1])
            k += 1
        if start < b:
            out.append((start, b))
    return out


def decode_spans(level: LoadLevel) -> list[tuple[float, float]]:
    """The times (level clock, sorted, disjoint) within :func:`throughput_window` when some request was decoding
    (past its first token, before its end) and none was waiting for its first token (sent, no first token yet,
    not ended): what the decode step alone produced in. A request that failed before its first token waited
    until its end."""
    lo, hi = throughput_window(level)
    decoding = _union((max(lo, r.first_token_s), min(hi, r.end_s)) for r in level.requests
                      if r.first_token_s is not None and r.end_s is not None)
    waiting = _union((r.sent_s, r.first_token_s if r.first_token_s is not None else
                      (r.end_s if r.end_s is not None else level.elapsed_s)) for r in level.requests)
    return _minus(decoding, waiting)


def _decode_tokens(level: LoadLevel, spans: list[tuple[float, float]]) -> int:
    """Output tokens whose arrival and the same request's previous arrival fall within one span."""
    if not spans:
        return 0
    starts = np.asarray([a for a, _ in spans])
    ends = np.asarray([b for _, b in spans])
    n = 0
    for r in level.requests:
        if not r.token_times_s or len(r.token_times_s) < 2:
            continue
        t = r.sent_s + np.asarray(r.token_times_s, dtype=float)
        i = np.searchsorted(starts, t, side="right") - 1  # the span starting at or before each arrival
        inside = (i >= 0) & (t <= ends[np.clip(i, 0, None)] + 1e-9)
        n += int(np.sum(inside[1:] & inside[:-1] & (i[1:] == i[:-1])))
    return n


def decode_figure(level: LoadLevel) -> float | None:
    """decode_output_tok_s of one level (module docstring): tokens made within :func:`decode_spans` over their time."""
    spans = decode_spans(level)
    tokens = _decode_tokens(level, spans)
    total = sum(b - a for a, b in spans)
    return tokens / total if tokens and total > 0 else None


def round_figures(level: LoadLevel, slos: list[Slo]) -> dict[str, float | None]:
    """One level's per-round figures: request_s, output_tok_s, decode_output_tok_s, goodput (None without SLOs),
    error_rate (module docstring), over :func:`throughput_window`; all None when that window is empty."""
    lo, hi = throughput_window(level)
    w = max(0.0, hi - lo)
    meas = measured(level)
    rate = (sum(not r.ok for r in meas) / len(meas)) if meas else None
    if w <= 0:
        return {"request_s": None, "output_tok_s": None, "decode_output_tok_s": None, "goodput": None,
                "error_rate": rate}
    done = [r for r in level.requests if r.ok and r.end_s is not None and lo <= r.end_s <= hi]
    tokens = 0
    for r in level.requests:
        if r.ok and r.token_times_s:
            tokens += sum(1 for t in r.token_times_s if lo <= r.sent_s + t <= hi)
    good = None
    if slos:
        good = sum(1 for r in meas if r.ok and r.end_s is not None and r.end_s <= hi
                   and all(s.met(_slo_value(s, request_metrics(r))) for s in slos)) / w
    return {"request_s": len(done) / w, "output_tok_s": tokens / w, "decode_output_tok_s": decode_figure(level),
            "goodput": good, "error_rate": rate}


def in_flight(level: LoadLevel) -> list[tuple[float, int]]:
    """The number of requests in flight after each send and each end: (level clock, count), in time order."""
    events = [(r.sent_s, 1) for r in level.requests] + [
        (r.end_s if r.end_s is not None else level.elapsed_s, -1) for r in level.requests]
    events.sort(key=lambda e: (e[0], e[1]))
    out, n = [], 0
    for t, d in events:
        n += d
        out.append((t, n))
    return out


def _in_flight_window(level: LoadLevel) -> tuple[float | None, int | None]:
    """Time-weighted mean and maximum of the number in flight over the throughput window."""
    steps, (lo, hi) = in_flight(level), throughput_window(level)
    if not steps or hi <= lo:
        return None, None
    area, n, t_prev, peak = 0.0, 0, lo, 0
    for t, count in steps:
        if t > lo:
            seg_end = min(t, hi)
            if seg_end > t_prev:
                area += n * (seg_end - t_prev)
                t_prev = seg_end
                peak = max(peak, n)
        n = count
        if t >= hi:
            break
    if t_prev < hi:
        area += n * (hi - t_prev)
        peak = max(peak, n)
    return area / (hi - lo), peak


def level_rounds(record: RunRecord) -> dict[tuple[str, str], list[LoadLevel]]:
    """(arm, level label) -> its levels, one per round, in round order; cells in run order."""
    out: dict[tuple[str, str], list[LoadLevel]] = {}
    for lv in sorted(load_levels(record), key=lambda x: (x.kind != "concurrency", x.value, x.round)):
        out.setdefault((lv.arm, lv.label), []).append(lv)
    order = {a: i for i, a in enumerate(arm_names(record))}
    return dict(sorted(out.items(), key=lambda kv: (kv[1][0].kind != "concurrency", kv[1][0].value,
                                                     order.get(kv[0][0], 99))))


def _ci(values: Iterable[float], q: float) -> tuple[float | None, float | None, float | None]:
    xs = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    if not xs or len(xs) < min_n(q):
        return None, None, None
    ci = quantile_ci(xs, q, n_resamples=RESAMPLES)
    return ci.median, ci.low, ci.high


def _latency(name: str, rows: list[dict[str, Any]]) -> list[float]:
    if name == "itl":
        return [float(g) for m in rows for g in m["itl"]]
    return [m[name] for m in rows if m[name] is not None]


def cell_table(record: RunRecord) -> pd.DataFrame:
    """One row per cell (:data:`CELL_COLUMNS`; seconds, requests/s, tokens/s)."""
    slos = load_slos(record)
    rows = []
    for (arm, label), levels in level_rounds(record).items():
        meas = [r for lv in levels for r in measured(lv)]
        oks = [request_metrics(r) for r in meas if r.ok]
        errors: dict[str, int] = {}
        for r in meas:
            if not r.ok:
                key = f"{r.error_kind} {r.status}" if r.error_kind == "http" and r.status else str(r.error_kind)
                errors[key] = errors.get(key, 0) + 1
        row: dict[str, Any] = {"arm": arm, "level": label, "kind": levels[0].kind, "value": levels[0].value,
                               "rounds": len(levels), "sent": sum(len(lv.requests) for lv in levels),
                               "measured": len(meas), "ok": len(oks), "failed": len(meas) - len(oks),
                               "errors": ", ".join(f"{k}: {v}" for k, v in sorted(errors.items())) or None}
        for name in LATENCIES:
            vals = _latency(name, oks)
            for p in PERCENTILES:
                row[f"{name}_p{p}_s"], row[f"{name}_p{p}_s_low"], row[f"{name}_p{p}_s_high"] = _ci(vals, p / 100)
        per_round = [round_figures(lv, slos) for lv in levels]
        for f in ("request_s", "output_tok_s", "decode_output_tok_s", "goodput", "error_rate"):
            row[f], row[f"{f}_low"], row[f"{f}_high"] = _ci([x[f] for x in per_round if x[f] is not None], 0.5)
        flight = [_in_flight_window(lv) for lv in levels]
        means = [m for m, _ in flight if m is not None]
        row["in_flight_mean"] = statistics.median(means) if means else None
        row["in_flight_max"] = max((p for _, p in flight if p is not None), default=None)
        lags = [m["lag"] for m in (request_metrics(r) for r in meas) if m["lag"] is not None]
        row["lag_p99_s"] = float(np.percentile(lags, 99)) if lags else None
        sched = [m["ttft_sched"] for m in oks if m["ttft_sched"] is not None]
        row["ttft_sched_p99_s"] = float(np.percentile(sched, 99)) if len(sched) >= min_n(0.99) else None
        row["slo_met"] = (sum(all(s.met(_slo_value(s, m)) for s in slos) for m in oks) if slos else None)
        rows.append(row)
    return pd.DataFrame(rows, columns=CELL_COLUMNS)


def throughput_ratios(record: RunRecord, against: str | None = None) -> pd.DataFrame:
    """Per (arm, level, round): output_tok_s(arm) / output_tok_s(``against``, default the reference arm) at the
    same level and round. Columns: arm, level, round, value."""
    ref = against or reference_arm(record)
    return _over(_output_tok_s(record, load_levels(record)), lambda arm, label, rnd: (ref, label, rnd))


def _output_tok_s(record: RunRecord, levels: list[LoadLevel],
                  figure: str = "output_tok_s") -> dict[tuple[str, str, int], float | None]:
    """(arm, level label, round) -> that level's ``figure`` of :func:`round_figures` (output tokens/s over its
    throughput window, or decode_output_tok_s)."""
    slos = load_slos(record)
    return {(lv.arm, lv.label, lv.round): round_figures(lv, slos)[figure] for lv in levels}


def _over(figures: dict[tuple[str, str, int], float | None], base_of) -> pd.DataFrame:
    """Each figure over its base's (``base_of(arm, label, round)``, a key of ``figures``), where both are known and
    the cell is not its own base. Columns: arm, level, round, value."""
    rows = []
    for key, v in figures.items():
        base_key = base_of(*key)
        base = figures.get(base_key)
        if key == base_key or v is None or not base:
            continue
        rows.append({"arm": key[0], "level": key[1], "round": key[2], "value": v / base})
    return pd.DataFrame(rows, columns=["arm", "level", "round", "value"])


def throughput_scalings(record: RunRecord, figure: str = "output_tok_s") -> pd.DataFrame:
    """Per (arm, level, round) past the run's first level: output_tok_s(arm, level) / output_tok_s(arm, first
    level) in the same round (the first level: its lightest load, the fewest in flight, else the lowest rate;
    c=1 where it is one); ``figure="decode_output_tok_s"``: decode_scaling, the same of the decode throughput.
    Columns: arm, level, round, value."""
    levels = load_levels(record)
    if not levels:
        return pd.DataFrame(columns=["arm", "level", "round", "value"])
    # the lightest load: the fewest in flight, else the lowest rate (inf last)
    first = min(levels, key=lambda lv: (lv.kind != "concurrency", float(lv.value))).label
    return _over(_output_tok_s(record, levels, figure), lambda arm, label, rnd: (arm, first, rnd))


def _tolerance(record: RunRecord, arm: str) -> tuple[float, bool]:
    own = arm_tolerances(record).get(arm)
    gate = gate_spec(record).accept_near_ties
    if own is not None:
        return own, True
    return (gate, True) if gate is not None else (NEAR_TIE_NATS, False)


def _references(record: RunRecord) -> dict[tuple[str, int, str], LoadRequest]:
    """(arm, round, prompt id) -> its ok run alone; round 0 holds the first of any round."""
    out: dict[tuple[str, int, str], LoadRequest] = {}
    for lv in load_levels(record, "reference"):
        for r in lv.requests:
            if r.ok and r.ids_source == "native":
                out.setdefault((lv.arm, lv.round, r.prompt_id), r)
                out.setdefault((lv.arm, 0, r.prompt_id), r)
    return out


def _verdict(r: LoadRequest, ref: LoadRequest | None, k: int, tol: float) -> tuple[str, int | None]:
    if ref is None or not r.ok or r.ids_source != "native":
        return "unchecked", None
    match, first, _ = compare_ids(r.output_ids, ref.output_ids, k)
    if match or first is None:
        return "identical", None
    if first >= min(len(r.output_ids), len(ref.output_ids)):
        return "broken", first  # one output ended before K
    own, other = r.output_ids[first], ref.output_ids[first]
    lp_own = r.logprobs[first] if r.logprobs and first < len(r.logprobs) else None
    lp_ref = ref.logprobs[first] if ref.logprobs and first < len(ref.logprobs) else None
    verdict, _, _ = flip_verdict(own, other, lp_own, lp_ref, tol)
    return ("near-tie" if verdict == "near-tie flip" else "broken"), first


def _cached(r: LoadRequest) -> int:
    """Prompt tokens the engine says it served from its prefix cache (0 when it does not say)."""
    n = (r.engine or {}).get("cached_prompt_tokens")
    return int(n) if isinstance(n, (int, float)) else 0


def parity_under_load(record: RunRecord) -> pd.DataFrame:
    """Per cell (:data:`PARITY_COLUMNS`): prompts checked and how many kept identical ids over K, were near-tie
    flips, broke, or could not be checked; the earliest divergence; ``kept`` (identical, plus near ties the
    gate accepts); an example, which says when that request met the prefix cache beyond its reference (its
    prompt's last tokens then ran in other chunks than alone, so other sums are expected)."""
    k = gate_spec(record).parity_tokens
    refs = _references(record)
    rank = {"unchecked": 0, "identical": 1, "near-tie": 2, "broken": 3}
    rows = []
    for (arm, label), levels in level_rounds(record).items():
        tol, accepts = _tolerance(record, arm)
        worst: dict[str, tuple[str, int | None]] = {}
        cached: dict[str, int] = {}  # prompt -> cached prompt tokens of its worst request beyond its reference's
        for lv in levels:
            for r in measured(lv):
                ref = refs.get((arm, lv.round, r.prompt_id)) or refs.get((arm, 0, r.prompt_id))
                v = _verdict(r, ref, k, tol)
                if r.prompt_id not in worst or rank[v[0]] > rank[worst[r.prompt_id][0]]:
                    worst[r.prompt_id] = v
                    cached[r.prompt_id] = _cached(r) - (_cached(ref) if ref is not None else 0)
        counts = {name: sum(1 for v, _ in worst.values() if v == name) for name in rank}
        firsts = [f for _, f in worst.values() if f is not None]

        def said(p: str, f: int | None) -> str:  # a request that met the prefix cache ran other sums than its reference
            return f"{p} at {f}" + (f" ({cached[p]:,} more prompt tokens cached)" if cached.get(p, 0) > 0 else "")

        example = next((said(p, f) for p, (v, f) in sorted(worst.items()) if v == "broken"), None) or next(
            (said(p, f) for p, (v, f) in sorted(worst.items()) if v == "near-tie"), None)
        rows.append({"arm": arm, "level": label, "prompts": len(worst), "identical": counts["identical"],
                     "near_tie": counts["near-tie"], "broken": counts["broken"], "unchecked": counts["unchecked"],
                     "kept": counts["identical"] + (counts["near-tie"] if accepts else 0),
                     "first_diverging": min(firsts) if firsts else None, "example": example, "tolerance": tol,
                     "accepts": accepts})
    return pd.DataFrame(rows, columns=PARITY_COLUMNS)


def alone_parity(record: RunRecord) -> list[dict[str, Any]]:
    """A load run's parity between arms: each arm's run alone of each prompt (its ``reference`` level) against
    the parity reference arm's of the same round (else its first), over ``gate.parity_tokens``, with the near-tie
    rule of :func:`_verdict`. One row per (arm, round, prompt): verdict ("identical", "near-tie", "broken",
    "unchecked"), first diverging position, tolerance and whether it is accepted."""
    k = gate_spec(record).parity_tokens
    against = parity_reference_arm(record)
    refs = _references(record)
    rows = []
    for lv in load_levels(record, "reference"):
        if lv.arm == against:
            continue
        tol, accepts = _tolerance(record, lv.arm)
        for r in lv.requests:
            ref = refs.get((against, lv.round, r.prompt_id)) or refs.get((against, 0, r.prompt_id))
            verdict, first = _verdict(r, ref, k, tol)
            rows.append({"arm": lv.arm, "round": lv.round, "prompt_id": r.prompt_id, "against": against,
                         "verdict": verdict, "first_diverging": first, "tolerance": tol,
                         "accepted": verdict == "identical" or (verdict == "near-tie" and accepts)})
    return rows


def values(record: RunRecord, metric: str, vs: str | None = None) -> pd.DataFrame:
    """A declared check's values per load cell: columns arm, level, round, value (one row per request, gap, round
    or prompt, as the metric is defined; module docstring)."""
    cols = ["arm", "level", "round", "value"]
    rows: list[dict[str, Any]] = []
    if metric == "throughput_ratio":
        return throughput_ratios(record, vs)
    if metric == "throughput_scaling":
        return throughput_scalings(record)
    if metric == "decode_scaling":
        return throughput_scalings(record, "decode_output_tok_s")
    if metric == "parity_under_load":
        p = parity_under_load(record)
        rows = [{"arm": a, "level": lv, "round": 0, "value": kept / n} for a, lv, n, kept
                in zip(p["arm"], p["level"], p["prompts"] - p["unchecked"], p["kept"]) if n > 0]
        return pd.DataFrame(rows, columns=cols)
    slos = load_slos(record)
    for (arm, label), levels in level_rounds(record).items():
        for lv in levels:
            if metric in ("request_s", "output_tok_s", "decode_output_tok_s", "goodput", "error_rate"):
                v = round_figures(lv, slos)[metric]
                if v is not None:
                    rows.append({"arm": arm, "level": label, "round": lv.round, "value": v})
                continue
            name = {"e2e_p99_s": "e2e"}.get(metric, metric.split("_")[0])
            oks = [request_metrics(r) for r in measured(lv) if r.ok]
            rows += [{"arm": arm, "level": label, "round": lv.round, "value": v} for v in _latency(name, oks)]
    return pd.DataFrame(rows, columns=cols)


def requests_table(record: RunRecord) -> pd.DataFrame:
    """One row per load request of every level, references included (:data:`REQUEST_COLUMNS`; stamps on the
    level's clock, ``measured`` says whether it counts, output ids space-separated)."""
    rows = []
    for lv in record.load:
        inside = {id(r) for r in measured(lv)} if lv.role == "load" else set()
        for r in lv.requests:
            m = request_metrics(r) if r.ok else {}
            rows.append({
                "arm": lv.arm, "round": lv.round, "position": lv.position, "role": lv.role, "level": lv.label,
                "index": r.index, "prompt_id": r.prompt_id, "target_tokens": r.target_tokens,
                "max_tokens": r.max_tokens, "scheduled_s": r.scheduled_s, "sent_s": r.sent_s,
                "first_token_s": r.first_token_s, "end_s": r.end_s, "measured": id(r) in inside, "ok": r.ok,
                "error_kind": r.error_kind, "status": r.status, "ttft_s": m.get("ttft"), "tpot_s": m.get("tpot"),
                "e2e_s": m.get("e2e"), "itl_max_s": m.get("itl_max"), "lag_s": m.get("lag"),
                "prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
                "ids_source": r.ids_source, "output_ids": " ".join(map(str, r.output_ids)), "error": r.error})
    return pd.DataFrame(rows, columns=REQUEST_COLUMNS)
