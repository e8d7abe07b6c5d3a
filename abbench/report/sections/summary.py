"""The report's frame: the header (profile, arms, rounds, status), the verdict, the small-n notes, the problems
and missing data, and the list of plots.
"""

from __future__ import annotations

import pandas as pd

from abbench import analysis as an
from abbench.report.format import DASH, Col, bullets, code, command_of, table, when
from abbench.report.sections.base import PLOTS, ReportInput
from abbench.results import RunRecord


def header_section(ri: ReportInput) -> list[str]:
    record, a = ri.record, ri.analysis
    prof = record.profile
    status = record.status + (f" ({record.status_reason})" if record.status_reason else "")
    duration = (f"{record.finished_at - record.created_at:.0f} s"
                if record.finished_at is not None else "unfinished")
    rounds = (sorted({st.round for st in record.plan}) or sorted({s.round for s in record.samples})
              or sorted({lv.round for lv in record.load}))
    lines = [
        f"# abbench report: {record.run_id}",
        "",
        f"- **Status:** {status}",
        f"- **Profile:** {prof.get('name', DASH)}" + (f" — {prof['description']}" if prof.get("description") else ""),
        f"- **Date:** {when(record.created_at)} (duration {duration})",
        f"- **Arms:** {', '.join(a.arms) or DASH}; reference **{a.reference or DASH}**",
        f"- **Rounds:** {len(rounds)} (arm order reversed every round: ABBA)" + _auto_rounds(record),
        f"- **abbench:** {record.abbench_version}, schema {record.schema_version}",
    ]
    cmd = command_of(record.environment)
    if cmd:
        lines.append(f"- **Command:** {code(cmd)}")
    if cpu_only(record):
        lines.append("- **Device:** CPU only (this host has no GPU and launched every arm's server): the figures "
                     "check the harness, the engines' arithmetic and their byte accounting, not a GPU's speed")
    return lines


def cpu_only(record: RunRecord) -> bool:
    """Whether every arm ran on this run's CPU: the harness launched each arm's server (no ``base_url``: a
    server started elsewhere may have a GPU) on a host where it found no GPU."""
    env = record.environment or {}
    if env.get("gpus") != [] or not record.services:
        return False  # a GPU, or no record of the host's (an older run), or nothing launched
    prof = record.profile or {}
    arms = prof.get("arms") or []
    return not (prof.get("engine") or {}).get("base_url") and not any(a.get("base_url") for a in arms)


def _auto_rounds(record: RunRecord) -> str:
    """'; auto: <why it stopped>' for a run with run.rounds = "auto"."""
    auto = record.auto_rounds
    if not auto:
        return ""
    rule = (auto.get("rule") or {}).get("text") or "rule not recorded"
    stopped = auto.get("stopped") or "not stopped yet (the run did not finish)"
    return f"; **auto** ({rule}): {stopped}"


def verdict_section(ri: ReportInput) -> list[str]:
    a = ri.analysis
    g = a.gate
    head = "**Gate: PASS**" if g.passed else f"**Gate: FAIL** ({len(g.failures)} failure(s))"
    checks = pd.DataFrame([{"name": c.name, "result": c.result or ("pass" if c.passed else "FAIL"), "detail": c.detail}
                           for c in g.checks])
    lines = ["## Verdict", "", f"{head} — parity over the first {g.parity_tokens} token ids.", "",
             table(checks, [Col("name", "Check", right=False), Col("result", "Result", right=False),
                            Col("detail", "Detail", right=False)], drop_constant=False)]
    if g.failures:
        lines += ["", "Failures:", "", bullets(g.failures)]
    if g.notes:
        lines += ["", "Notes:", "", bullets(g.notes)]
    return lines


def problems_section(ri: ReportInput) -> list[str]:
    record, a, problems, plot_missing = ri.record, ri.analysis, ri.problems, ri.plot_missing
    c = a.completeness
    items: list[str] = list(problems)
    if record.status != "complete":
        items.append(f"run status is {record.status}" + (f": {record.status_reason}" if record.status_reason else ""))
    load_run = bool(record.load) and not record.samples and not c.has_plan
    if not c.has_plan and not load_run:
        items.append("the run holds no plan: completeness cannot be checked")
    items += [f"missing: {an.where(st)}, step {st.index}: no sample" for st in c.missing]
    items += [f"failed: {an.where(s)}, step {s.step}: {s.error_kind or 'error'}" + (f": {s.error}" if s.error else "")
              for s in c.failed]
    items += [f"sample of step {s.step} ({an.where(s)}) does not match the plan" for s in c.unplanned]
    df = a.samples[a.samples["measured"] & a.samples["ok"]] if not a.samples.empty else a.samples
    if not df.empty:
        if df["prefill_path"].isna().all() and df["h2d_bytes"].isna().all():
            items.append("the engine reported no per-request object (path, H2D counters, timings)")
        if df["nvml_pcie_rx_bytes"].isna().all():
            items.append("no NVML PCIe estimate (no GPU or NVML unavailable)")
        if not df["has_logprobs"].any():
            items.append("no logprobs captured: divergence margins cannot be given")
        retok = int((df["ids_source"] == "retokenized").sum())
        if retok:
            items.append(f"{retok} sample(s) carry ids retokenized from text, not the engine's own")
    if not record.memory:
        items.append("no background memory samples")
    items += [f"plot {name}.png not drawn: {why}" for name, why in plot_missing.items()]
    counts = (f"{c.ok}/{c.planned} measured planned steps have an ok sample ({c.present} have a sample); "
              f"{c.excluded_planned} step(s) excluded by the pre-registered rule (run, not counted), {c.excluded_ok} of them ok.")
    if load_run:  # load levels only: what they hold (the gate's load-levels check judges them against the plan)
        reqs = [r for lv in record.load for r in lv.requests]
        stopped = sum(1 for lv in record.load if lv.stopped)
        counts = (f"{len(record.load)} load levels ({stopped} stopped by an interrupt), {len(reqs)} requests, "
                  f"{sum(r.ok for r in reqs)} ok; no sequential samples (a load run).")
        items += [f"failed: arm {lv.arm} {lv.label}, round {lv.round}, request {r.index}: {r.error_kind}"
                  + (f" {r.status}" if r.status else "") for lv in record.load for r in lv.requests if not r.ok][:20]
    lines = ["## Problems and missing data", "", counts, ""]
    lines.append(bullets(items) if items else "None.")
    return lines


def small_n_section(ri: ReportInput) -> list[str]:
    notes = ri.analysis.notes
    return ["## Small-n notes", "", bullets(notes) if notes else "None."]


def plots_section(ri: ReportInput) -> list[str]:
    lines = ["## Plots", ""]
    names = [*PLOTS, *(n for n in ri.plots if n not in PLOTS)]  # a sweep's plot too
    lines += [f"- [{name}.png]({ri.plots[name]})" for name in names if ri.plots.get(name)]
    lines += [f"- {name}.png: not drawn ({why})" for name, why in ri.plot_missing.items()]
    return lines
