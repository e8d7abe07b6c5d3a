"""The report's *Sweep* section (runs with a ``[sweep]`` table): what was swept and how the points were chosen,
then per arm pair the paired TTFT ratio at every point with its 95% interval and the crossover with its
interval (:mod:`abbench.analysis.sweep`), and the plot (``sweep.png``: ratio against the quantity on a log axis,
the interval as a band, the crossover marked). Nothing for other runs.
"""

from __future__ import annotations

import math

from abbench.analysis.sweep import SweepPair, quantity
from abbench.report.format import DASH, Col, bullets, fmt_int, fmt_ratio, fmt_text, table
from abbench.report.sections.base import ReportInput, plot_link
from abbench.results import RunRecord


def _words(v: str, a: str) -> str:
    return {"faster": f"{a} faster", "slower": f"{a} slower"}.get(v, v)


def _passes(record: RunRecord) -> list[str]:
    state = record.sweep or {}
    stages = (state.get("rule") or {}).get("stages") or []
    out = []
    for p in state.get("passes") or []:
        arms = ", ".join(p.get("arms") or [])
        where = f" (stage {p['stage'] + 1}: {arms})" if len(stages) > 1 else ""
        out.append(f"{p.get('why')}{where}: {', '.join(map(str, p.get('points') or []))}")
    if state.get("stopped"):
        out.append(f"stopped: {state['stopped']}")
    elif state:
        out.append("not stopped yet (the run did not finish)")
    return out


def _interval(low: float | None, high: float | None) -> str:
    if low is None or high is None:
        return DASH
    lo = "0" if low == 0 else f"{low:.0f}"
    hi = "∞" if math.isinf(high) else f"{high:.0f}"
    return f"{lo} – {hi}"


def _pair_lines(p: SweepPair, what: str) -> list[str]:
    c = p.crossover
    lines = [f"### {p.a} vs {p.b}", ""]
    if p.points.empty:
        return lines + [f"No point has pairs of both {p.a} and {p.b}."]
    rows = p.points.copy()
    rows["ci"] = [DASH if lo is None or lo != lo else f"{lo:.3f}x – {hi:.3f}x"
                  for lo, hi in zip(rows["ci_low"], rows["ci_high"])]
    rows["words"] = [_words(str(v), p.a) for v in rows["verdict"]]
    lines += [table(rows, [Col("x", what[0].upper() + what[1:], fmt_int), Col("n", "Pairs", fmt_int, descriptive=True),
                           Col("median_ratio", f"TTFT {p.a} / {p.b}", fmt_ratio), Col("ci", "95% CI"),
                           Col("words", "Verdict", right=False), Col("note", "Note", fmt_text, descriptive=True,
                                                                     right=False)]), ""]
    head = f"**Crossover:** {c.summary}."
    if c.status in ("crossing", "several"):
        brackets = "; ".join(f"between {k.lo} and {k.hi} (n={k.n})" for k in c.crossings)
        head += f" Interval {_interval(c.low, c.high)} {what}; bracketed {brackets}."
    lines.append(head)
    if c.note:
        lines += ["", f"Note: {c.note}."]
    return lines


def sweep_section(ri: ReportInput) -> list[str]:
    record, sweep = ri.record, ri.analysis.sweep
    state = record.sweep
    if not state and not sweep:
        return []
    what = quantity(record)
    rule = (state or {}).get("rule") or {}
    lines = ["## Sweep: where the arms cross", ""]
    if rule.get("text"):
        lines += [f"Swept: {rule['text']}.", ""]
    lines += [
        ("Per point, the ratio TTFT(A) / TTFT(B) of the pairs (the same prompt in the same round, ABBA), its median "
         "and 95% percentile-bootstrap interval; the crossover interpolates log-ratio linearly in log "
         f"{what} between the two points where the median ratio crosses 1, and its interval resamples those two "
         "points' pairs. The interval does not hold the error of that interpolation, which the refinement "
         "shrinks by bisecting the bracket. A pair's first arm is the one named to be faster below its crossover."),
        "", "Passes:", "", bullets(_passes(record)),
    ]
    if not sweep:
        lines += ["", "No arm pair to show: declare sweep.crossovers or a crossover[...] check."]
    for p in sweep:
        lines += [""] + _pair_lines(p, what)
    return lines + plot_link(ri.plots, "sweep", "Paired TTFT ratio against the swept quantity")
