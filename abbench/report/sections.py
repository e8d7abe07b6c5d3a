"""The report's Markdown sections: each is a function ``(ReportInput) -> lines``, and :data:`SECTIONS` lists
them in the report's order (:func:`render_markdown` joins them). A section without data says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from abbench import analysis as an
from abbench.report.format import (
    DASH,
    Col,
    bullets,
    code,
    command_of,
    env_value,
    fmt_bool,
    fmt_counts,
    fmt_gb,
    fmt_gib,
    fmt_int,
    fmt_num,
    fmt_pct,
    fmt_ratio,
    fmt_s,
    is_na,
    table,
    when,
)
from abbench.analysis.frames import measured_ok_frame, sort_rows
from abbench.results import RunRecord

PLOTS = ("ttft", "ratios", "h2d", "memory", "ttft_memory")


@dataclass
class ReportInput:
    """What every section reads: the run, the problems its loading found, its analysis, and the plots
    (name -> link relative to the Markdown, or why a plot was not drawn)."""

    record: RunRecord
    analysis: an.Analysis
    problems: list[str] = field(default_factory=list)
    plots: dict[str, str | None] = field(default_factory=dict)
    plot_missing: dict[str, str] = field(default_factory=dict)


CELL_COLS = (Col("arm", "Arm", descriptive=True, right=False), Col("kind", "Kind", descriptive=True, right=False),
             Col("target_tokens", "Prompt tokens", fmt_int, descriptive=True),
             Col("n", "n", fmt_int, descriptive=True))
"""The first columns of every per-cell table: arm, kind, prompt length and samples."""


def header_section(ri: ReportInput) -> list[str]:
    record, a = ri.record, ri.analysis
    prof = record.profile
    status = record.status + (f" ({record.status_reason})" if record.status_reason else "")
    duration = (f"{record.finished_at - record.created_at:.0f} s"
                if record.finished_at is not None else "unfinished")
    rounds = sorted({st.round for st in record.plan}) or sorted({s.round for s in record.samples})
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
    return lines


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


def ttft_section(ri: ReportInput) -> list[str]:
    a, plots = ri.analysis, ri.plots
    lines = ["## TTFT per arm and prompt length", ""]
    if a.ttft.empty:
        return lines + ["No measured ok sample with a TTFT: nothing to show."]
    lines += [
        ("Time to first token measured by the harness (from just before the request to the first streamed "
        "text), measured ok samples only."), "",
        table(a.ttft, [*CELL_COLS, Col("median_s", "Median", fmt_s),
                       Col("min_s", "Min", fmt_s), Col("max_s", "Max", fmt_s),
                       Col("decode_tok_s", "Decode tok/s", lambda v: fmt_num(v, 1), descriptive=True)]),
    ]
    return lines + _plot_link(plots, "ttft", "TTFT per arm and length")


def latency_section(ri: ReportInput) -> list[str]:
    """TTFT, TPOT and ITL percentiles per cell (:mod:`abbench.analysis.latency`), as serving benchmarks give
    them."""
    lat = ri.analysis.latency
    if lat.empty:
        return []
    lines = ["## Latency percentiles", "",
             ("TTFT per request; TPOT = (total - TTFT) / (output tokens - 1) per request; ITL = the gaps between "
              "successive streamed arrivals of output (tokens in one chunk arrive together), over every request "
              "of the cell. Percentiles as `vllm bench serve` computes them, each given where n allows it: p90 "
              "from 10 values, p99 from 100 (a dash otherwise)."), ""]
    pcols = []
    for name, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL")):
        if name != "ttft":
            pcols.append(Col(f"n_{name}", f"n {label}", fmt_int, descriptive=True))
        pcols += [Col(f"{name}_p{p}_s", f"{label} p{p}", fmt_s) for p in (50, 90, 99)]
    if not lat["n_itl"].fillna(0).astype(int).any():
        lines += ["No sample recorded token arrival times (a run made before abbench recorded them, or no "
                  "streamed request): no ITL.", ""]
        pcols = [c for c in pcols if not c.key.startswith(("itl_", "n_itl"))]
    empty = [c for c in pcols if c.key.endswith("_s") and lat[c.key].isna().all()]
    if empty:
        lines += [f"Not shown, n too small in every cell: {', '.join(c.header for c in empty)}.", ""]
    return lines + [table(lat, [*CELL_COLS, *[c for c in pcols if c not in empty]])]


def _cells(frame: pd.DataFrame, cols: list[str]) -> pd.DataFrame:
    """``frame``'s per-cell key columns and ``cols`` (the ones it has), for a left join on the cell."""
    keys = ["arm", "kind", "target_tokens"]
    if frame.empty or not set(keys) <= set(frame.columns):
        return pd.DataFrame(columns=keys)
    return frame[keys + [c for c in cols if c in frame.columns]]


def engines_section(ri: ReportInput) -> list[str]:
    """Arms of different engines (adapters) side by side: one row per cell with TTFT, the paired ratio, the
    bytes over PCIe and the peak device memory by the same yardstick for every arm (NVML) beside the
    engine's own counters where it has them, and the decode rate. Only for runs whose arms speak more than one
    wire format (another engine beside the vendored one)."""
    record, a = ri.record, ri.analysis
    adapters = an.frames.arm_adapters(record)
    if len(set(adapters.values())) < 2 or a.ttft.empty:
        return []
    rows = _cells(a.ttft, ["n", "median_s"])
    ratios = a.ratios[a.ratios["reference"] == a.reference] if "reference" in a.ratios.columns else a.ratios
    for frame, cols in ((ratios, ["median_ratio"]), (a.h2d, ["nvml_bytes", "h2d_bytes"]),
                        (a.decode, ["proc_gpu_mem_peak", "peak_device_bytes", "tok_s"])):
        rows = rows.merge(_cells(frame, cols), on=["arm", "kind", "target_tokens"], how="left")
        for c in cols:  # a frame without the column (no such data in this run): shown as a dash
            if c not in rows.columns:
                rows[c] = None
    rows.insert(1, "adapter", [adapters.get(arm, DASH) for arm in rows["arm"]])
    return [
        "## Engines side by side", "",
        (f"The arms speak {len(set(adapters.values()))} wire formats ({', '.join(sorted(set(adapters.values())))}): "
         "one engine's counters cannot be read for another, so PCIe bytes and peak device memory are given by "
         "the same yardstick for every arm, NVML (PCIe RX during the request; the peak of the service's "
         "processes), beside the engine's own figures where it reports them. Medians per request; ratio = "
         f"paired TTFT / TTFT({a.reference}), as in *Paired ratios*."), "",
        table(rows, [Col("arm", "Arm", descriptive=True, right=False),
                     Col("adapter", "Adapter", descriptive=True, right=False),
                     *CELL_COLS[1:], Col("median_s", "TTFT", fmt_s),
                     Col("median_ratio", f"vs {a.reference}", fmt_ratio),
                     Col("nvml_bytes", "PCIe RX (NVML)", fmt_gb), Col("h2d_bytes", "H2D (engine)", fmt_gb),
                     Col("proc_gpu_mem_peak", "Peak device (NVML)", fmt_gib),
                     Col("peak_device_bytes", "Peak device (engine)", fmt_gib),
                     Col("tok_s", "Decode tok/s", lambda v: fmt_num(v, 1))]),
    ]


def _verdict_words(r: Any) -> str:
    if r.verdict == "faster":
        return f"{1 / r.median_ratio:.2f}x faster"
    if r.verdict == "slower":
        return f"{r.median_ratio:.2f}x slower"
    return str(r.verdict)


def ratios_section(ri: ReportInput) -> list[str]:
    a, plots = ri.analysis, ri.plots
    lines = ["## Paired ratios", ""]
    if a.ratios.empty:
        why = ("there is only one arm" if len(a.arms) < 2 else
               f"no prompt has ok samples of both an arm and the reference ({a.reference}) in the same round")
        return lines + [f"No pairs: {why}."]
    rows = a.ratios.copy()
    rows["ci"] = [DASH if is_na(lo) else f"{lo:.3f}x – {hi:.3f}x" for lo, hi in zip(rows["ci_low"], rows["ci_high"])]
    rows["words"] = [_verdict_words(r) for r in rows.itertuples()]
    lines += [
        (f"Ratio = TTFT(arm) / TTFT({a.reference}) for the same prompt in the same round (ABBA pairing); below "
        f"1 the arm is faster. Median over pairs with a {an.CONFIDENCE:.0%} percentile-bootstrap interval of "
        f"the median (seed {an.BOOTSTRAP_SEED}, {an.BOOTSTRAP_RESAMPLES} resamples). \"not significant\": "
        "the interval contains 1."), "",
        table(rows, [Col("arm", "Arm", descriptive=True, right=False),
                     Col("reference", "vs", descriptive=True, right=False),
                     Col("kind", "Kind", descriptive=True, right=False),
                     Col("target_tokens", "Prompt tokens", fmt_int, descriptive=True),
                     Col("n", "Pairs", fmt_int, descriptive=True), Col("median_ratio", "Median ratio", fmt_ratio),
                     Col("ci", "95% CI"), Col("words", "Verdict", right=False),
                     Col("note", "Note", descriptive=True, right=False)]),
        "", "<details><summary>Every pair</summary>", "",
        table(a.pairs, [Col("arm", "Arm", descriptive=True, right=False),
                        Col("prompt_id", "Prompt", descriptive=True, right=False),
                        Col("round", "Round", fmt_int), Col("arm_position", "Arm position", fmt_int),
                        Col("ref_position", "Ref position", fmt_int), Col("arm_ttft_s", "Arm TTFT", fmt_s),
                        Col("ref_ttft_s", "Ref TTFT", fmt_s), Col("ratio", "Ratio", fmt_ratio)]),
        "", "</details>",
    ]
    return lines + _plot_link(plots, "ratios", "Paired ratios")


def h2d_section(ri: ReportInput) -> list[str]:
    a, plots = ri.analysis, ri.plots
    lines = ["## Host-to-device transfers", ""]
    if a.h2d.empty:
        return lines + [("No H2D data: the engine reported no transfer counters and NVML gave no PCIe estimate "
                        "(another engine, or no GPU).")]
    has_engine = a.h2d["h2d_bytes"].notna().any()
    has_nvml = a.h2d["nvml_bytes"].notna().any()
    has_wait = a.h2d["copy_wait_s"].notna().any()  # engines that time their copy stalls (the vendored one on CUDA)
    has_retries = bool((a.h2d["alloc_retries"].fillna(0) > 0).any())  # shown only when the allocator retried
    lines += [
        ("Medians per request. Banks = prefill H2D bytes / the engine's bank size (all layers' experts). "
        "Floor = windows x bank / measured H2D bandwidth: the copy-bound lower limit of a prompt's TTFT "
        "(given for prompts that start from an empty cache)."
        + (" Copy wait = GPU time the engine's compute stream waited for streamed expert copies during prefill "
           "(CUDA timing events): the part of the copies that compute did not hide." if has_wait else "")
        + (" Alloc retries = the most CUDA caching-allocator retries in one request (it freed its cache and "
           "called cudaMalloc again: memory pressure that costs time)." if has_retries else "")), "",
        table(a.h2d, [*CELL_COLS, Col("h2d_bytes", "Engine H2D", fmt_gb),
                      Col("prefill_h2d_bytes", "Prefill", fmt_gb, descriptive=True),
                      Col("decode_h2d_bytes", "Decode", fmt_gb, descriptive=True),
                      Col("bank_bytes", "Bank", fmt_gb, descriptive=True), Col("banks", "Banks", fmt_num),
                      Col("nvml_bytes", "NVML PCIe RX", fmt_gb), Col("engine_over_nvml", "Engine/NVML", fmt_ratio),
                      Col("n_windows", "Windows", fmt_num, descriptive=True),
                      Col("measured_h2d_gbps", "H2D GB/s", lambda v: fmt_num(v, 1), descriptive=True),
                      Col("floor_s", "Floor", fmt_s), Col("ttft_s", "TTFT", fmt_s),
                      Col("ttft_over_floor", "TTFT/floor", fmt_ratio)]
              + ([Col("copy_wait_s", "Copy wait", fmt_s)] if has_wait else [])
              + ([Col("alloc_retries", "Alloc retries", fmt_int)] if has_retries else [])),
    ]
    if not has_engine:
        lines += ["", "The engine reported no H2D counters: only NVML's estimate is shown."]
    if not has_nvml:
        lines += ["", "NVML gave no PCIe RX estimate: the engine's counters are not cross-checked."]
    return lines + _plot_link(plots, "h2d", "H2D bytes per arm and length")


def engine_counters_section(ri: ReportInput) -> list[str]:
    record, df = ri.record, ri.analysis.engine_counters
    lines = ["## Engine counters", ""]
    if df.empty:
        return lines + ["The engine reported no prefix-cache numbers in its responses and no prompt counters "
                        "on its metrics endpoint (or the profile scrapes none)."]
    adapters = an.frames.arm_adapters(record)
    if len(set(adapters.values())) == 1:
        which = f"adapter `{next(iter(adapters.values()))}`"
    else:
        which = "adapters: " + ", ".join(f"{a} `{ad}`" for a, ad in adapters.items())
    lines += [
        (f"Medians per request ({which}). Prompt tokens: as the server counted them. Cached: "
         "prompt tokens the engine reports serving from its prefix cache in the response (vLLM needs "
         "`--enable-prompt-tokens-details`; SGLang `meta_info.cached_tokens`; llama.cpp `timings.cache_n`). "
         "/metrics: the engine's Prometheus counters after minus before the request (llama.cpp counts only "
         "the prompt tokens it computed). A cold prompt should show 0 cached: more means the cache reset did "
         "not take."), "",
        table(df, [*CELL_COLS, Col("prompt_tokens", "Server prompt tokens", fmt_num),
                   Col("engine_cached", "Cached (response)", fmt_num),
                   Col("metrics_prompt", "Prompt tokens (/metrics)", fmt_num),
                   Col("metrics_cached", "Cached (/metrics)", fmt_num)]),
    ]
    return lines


def decode_section(ri: ReportInput) -> list[str]:
    a = ri.analysis
    lines = ["## Decode", ""]
    if a.decode.empty:
        return lines + ["No decode data: no measured request generated more than one token."]
    has_model = a.decode["expected_step_s"].notna().any()
    has_added = a.decode["added_device_bytes"].notna().any()  # engines that report memory held at the start
    lines += [
        ("Medians per request. Step = (total - TTFT) / (output tokens - 1) as the harness saw it; decode H2D per "
         "step = experts copied into the decode slot cache; hit rate = routed (layer, expert) pairs found in "
         "the slot cache. Peak device memory: the engine's own peak allocation during the request (torch), and "
         "NVML's peak for the service's processes."
         + (" Added = the most a request added to what the engine held when it started (weights, KV cache, "
            "buffers and slot cache stay between requests): the memory the request itself needed."
            if has_added else "")
         + (" Expected = decode H2D per step / measured H2D bandwidth + the cached step (the median step, for "
            "the same prompt, of an arm whose decode copied nothing)." if has_model else "")), "",
        table(a.decode, [*CELL_COLS, Col("tok_s", "Decode tok/s", lambda v: fmt_num(v, 1)),
                         Col("step_s", "Step", fmt_s),
                         Col("h2d_per_step", "Decode H2D/step", fmt_gb),
                         Col("hit_rate", "Slot hit rate", lambda v: fmt_pct(v, 1)),
                         Col("slots_per_layer", "Slots/layer", fmt_int, descriptive=True),
                         Col("decode_mode", "Decoder", descriptive=True, right=False),
                         Col("expected_step_s", "Expected step", fmt_s),
                         Col("over_expected", "Step/expected", fmt_ratio),
                         Col("peak_device_bytes", "Peak device (engine)", fmt_gib)]
                        + ([Col("added_device_bytes", "Added (engine)", fmt_gib)] if has_added else [])
                        + [Col("proc_gpu_mem_peak", "Peak device (NVML)", fmt_gib)]),
    ]
    return lines + _plot_link(ri.plots, "ttft_memory", "TTFT against peak device memory")


def host_cpu_section(ri: ReportInput) -> list[str]:
    """Per arm and prompt: how busy the host's CPUs were while the requests ran, the hypervisor's steal, and
    the CPU seconds the service spent; skipped for runs recorded before these were measured."""
    df = measured_ok_frame(ri.record)
    if df.empty or (df["service_cpu_s"].isna().all() and df["host_cpu_busy"].isna().all()):
        return []
    rows = df.groupby(["arm", "kind", "target_tokens"], sort=False).agg(
        n=("ttft_s", "size"), ttft_s=("ttft_s", "median"), busy=("host_cpu_busy", "median"),
        steal=("host_cpu_steal", "median"), cpu_s=("service_cpu_s", "median")).reset_index()
    pct = lambda v: fmt_pct(v, 1)  # noqa: E731
    secs = lambda v: DASH if is_na(v) else f"{float(v):.2f} s"  # noqa: E731
    return ["## Host CPU", "",
            ("Medians per request: the fraction of all the host's CPU time busy while it ran, the fraction the "
             "hypervisor stole (a virtual machine sharing its cores), and the CPU seconds of the service's "
             "process tree (an engine that works on the CPU shows it here). A slower or contended host slows "
             "such an engine more than one that only waits on the GPU."), "",
            table(sort_rows(rows, ri.record, ["arm", "kind", "target_tokens"]), [
                Col("arm", "Arm", right=False), Col("kind", "Kind", descriptive=True, right=False),
                Col("target_tokens", "Prompt tokens", fmt_int), Col("n", "n", fmt_int),
                Col("ttft_s", "TTFT", fmt_s), Col("busy", "Host CPU busy", pct), Col("steal", "Steal", pct),
                Col("cpu_s", "Service CPU", secs)])]


def memory_section(ri: ReportInput) -> list[str]:
    a, record, plots = ri.analysis, ri.record, ri.plots
    lines = ["## Memory", ""]
    if a.memory.empty:
        return lines + ["No memory samples: neither background sampling nor per-request peaks were recorded."]
    lines += [
        ("Peaks over the background samples and the per-request telemetry. GPU used: the whole device; "
        "process GPU: the service's processes; host RSS: the service's process tree."), "",
        table(a.memory, [Col("arms", "Arms", descriptive=True, right=False),
                         Col("services", "Services", fmt_int, descriptive=True),
                         Col("n_points", "Samples", fmt_int, descriptive=True),
                         Col("gpu_mem_used_peak", "GPU used peak", fmt_gib),
                         Col("proc_gpu_mem_peak", "Process GPU peak", fmt_gib),
                         Col("host_rss_peak", "Host RSS peak", fmt_gib)]),
    ]
    idle = [f"{s.key}: GPU not idle {'before' if s.gpu_idle_before is False else 'after'} the service"
            for s in record.services if s.gpu_idle_before is False or s.gpu_idle_after is False]
    if idle:
        lines += ["", "GPU idle check:", "", bullets(idle)]
    return lines + _plot_link(plots, "memory", "Memory over time")


def _parity_detail_cols(k: int) -> list[Col]:
    return [
        Col("check", "Check", descriptive=True, right=False),
        Col("prompt_id", "Prompt", descriptive=True, right=False),
        Col("arm", "Arm", descriptive=True, right=False), Col("round", "Round", fmt_int, descriptive=True),
        Col("against", "Against", descriptive=True, right=False), Col("match", f"Match (first {k})", fmt_bool),
        Col("first_diverging", "First diverging", fmt_int), Col("agree_of", "Agree"),
        Col("margin", "Margin arm", lambda v: DASH if is_na(v) else f"{float(v):.3f}"),
        Col("margin_against", "Margin ref", lambda v: DASH if is_na(v) else f"{float(v):.3f}"),
        Col("classification", "Class", right=False), Col("verdict", f"Verdict (first {k})", right=False),
        Col("verdict_why", "Why", descriptive=True, right=False),
        Col("note", "Note", descriptive=True, right=False),
    ]


_VERDICT_RANK = {"equal": 0, "near-tie flip": 1, "unchecked": 2, "broken": 3}


def _verdicts_per_prompt(p: pd.DataFrame) -> list[str]:
    """One line per prompt and arm of the parity rows: the worst verdict over its rounds."""
    rows = p[p["check"] == "parity"]
    if rows.empty:
        return []
    out = []
    for (prompt, arm), g in rows.groupby(["prompt_id", "arm"], sort=False):
        worst = max(g["verdict"].fillna("unchecked"), key=lambda v: _VERDICT_RANK.get(v, 3))
        margins = g["flip_margin"].dropna()
        out.append({"prompt_id": prompt, "arm": arm, "rounds": len(g), "verdict": worst,
                    "flip_margin": float(margins.max()) if not margins.empty else None})
    return ["Verdict per prompt (the worst over its rounds):", "", table(pd.DataFrame(out), [
        Col("prompt_id", "Prompt", right=False), Col("arm", "Arm", right=False), Col("rounds", "Rounds", fmt_int),
        Col("verdict", "Verdict", right=False),
        Col("flip_margin", "Flip margin", lambda v: DASH if is_na(v) else f"{float(v):.4f}")], drop_constant=False)]


def _logprob_agreement(p: pd.DataFrame, ref: str | None) -> list[str]:
    """Per arm: how closely its logprobs agree with the parity reference's where their ids agree (the spread
    its arithmetic alone makes), beside its tolerance and its largest flip margin."""
    rows = p[(p["check"] == "parity") & (p["lp_positions"].fillna(0) > 0)]
    if rows.empty:
        return []
    out = []
    for arm, g in rows.groupby("arm", sort=False):
        flips = g["flip_margin"].dropna()
        out.append({"arm": arm, "positions": int(g["lp_positions"].sum()),
                    "median": float(g["lp_delta_median"].median()), "max": float(g["lp_delta_max"].max()),
                    "margin": None if g["margin_delta_max"].isna().all() else float(g["margin_delta_max"].max()),
                    "tolerance": float(g["tolerance"].iloc[0]), "accepts": bool(g["accepts"].fillna(False).any()),
                    "flip": float(flips.max()) if not flips.empty else None})
    nats = lambda v: DASH if is_na(v) else f"{float(v):.4f}"  # noqa: E731
    return ["", f"Logprob agreement with {ref} where the ids agree (the positions before each row's first "
            "divergence): |Δ| of the chosen token's logprob (median of the rows' medians, and the largest) and "
            "the largest |Δ| of the top-2 margin. An engine that computes the same model differs from the "
            "reference by its arithmetic alone; a flip whose margin lies within that spread is such noise.", "",
            table(pd.DataFrame(out), [
                Col("arm", "Arm", right=False), Col("positions", "Positions", fmt_int),
                Col("median", "Median |Δ logprob|", nats), Col("max", "Max |Δ logprob|", nats),
                Col("margin", "Max |Δ margin|", nats),
                Col("tolerance", "Tolerance", lambda v: f"{float(v):g}"),
                Col("accepts", "Accepted by the gate", fmt_bool),
                Col("flip", "Largest flip margin", nats)], drop_constant=False)]


def parity_section(ri: ReportInput) -> list[str]:
    a = ri.analysis
    k = a.parity_tokens
    lines = ["## Parity", ""]
    p = a.parity
    if p.empty:
        return lines + ["No parity rows: there is no measured ok sample to compare."]
    accept = an.gate_spec(ri.record).accept_near_ties
    own = {arm: t for arm, t in an.arm_tolerances(ri.record).items() if arm != a.parity_reference}
    tolerances = ([f"{accept:g} nats (gate.accept_near_ties)"] if accept else
                  [f"{an.NEAR_TIE_NATS:g} nats (the default; reported, not accepted)"])
    tolerances += [f"arm {arm}: {t:g} nats (its own accept_near_ties)" for arm, t in own.items()]
    if accept:
        accepts = "The gate accepts the near-tie flips of parity rows."
    elif own:
        accepts = f"The gate accepts near-tie flips of {', '.join(own)} only."
    else:
        accepts = "The gate accepts no mismatch (gate.accept_near_ties is not set)."
    against = (f"the parity reference ({a.parity_reference}, gate.parity_reference)"
               if a.parity_reference != a.reference else f"the reference ({a.reference})")
    lines += [(f"Each measured sample's first {k} greedy ids against {against} in the same "
              "round; 'stability' rows compare the reference with its own lowest round. Margin = top-2 "
              f"logprob gap (nats) at the first divergence; below {an.NEAR_TIE_NATS} in either arm: near-tie. "
              f"Verdict over the first {k} ids: equal; near-tie flip (each side's choice is the other's "
              "runner-up, margin below the row's tolerance); broken (anything else). Tolerance: "
              + "; ".join(tolerances) + ". " + accepts),
              ""]
    summary = []
    for (check, arm), g in p.groupby(["check", "arm"], sort=False):
        summary.append({
            "check": check, "arm": arm, "rows": len(g), "match": int((g["match"] == True).sum()),
            "identical": int((g["classification"] == "identical").sum()),
            "min_agree": None if g["agree"].isna().all() else int(g["agree"].min()),
            "near": int((g["classification"] == "near-tie").sum()),
            "div": int(g["classification"].isin(["divergence", "margin unknown"]).sum()),
            "unchecked": int(g["match"].isna().sum()),
            "v_equal": int((g["verdict"] == "equal").sum()),
            "v_flip": int((g["verdict"] == "near-tie flip").sum()),
            "v_broken": int((g["verdict"] == "broken").sum()),
        })
    n_max = p["max_tokens"].dropna()
    of = f"/{int(n_max.max())}" if not n_max.empty else ""
    lines.append(table(pd.DataFrame(summary), [
        Col("check", "Check", right=False), Col("arm", "Arm", right=False), Col("rows", "Compared", fmt_int),
        Col("match", f"Match (first {k})", fmt_int), Col("identical", "Identical (all ids)", fmt_int),
        Col("min_agree", "Min agree", lambda v: DASH if is_na(v) else f"{int(v)}{of}"),
        Col("near", "Near-ties", fmt_int), Col("div", "Divergences", fmt_int),
        Col("unchecked", "Unchecked", fmt_int), Col("v_equal", "Verdict: equal", fmt_int),
        Col("v_flip", "near-tie flip", fmt_int), Col("v_broken", "broken", fmt_int)], drop_constant=False))
    lines += ["", *_verdicts_per_prompt(p), *_logprob_agreement(p, a.parity_reference)]
    rows = p.copy()
    rows["against"] = [DASH if is_na(ar) else (f"{ar} r{int(rr)}" if not is_na(rr) else str(ar))
                       for ar, rr in zip(rows["against_arm"], rows["against_round"])]
    rows["agree_of"] = [DASH if is_na(ag) else f"{int(ag)}/{int(mt)}" for ag, mt in zip(rows["agree"], rows["max_tokens"])]
    diverged = rows[(rows["classification"] != "identical").to_numpy(dtype=bool)]
    if diverged.empty:
        lines += ["", "Every compared output is identical over all its ids."]
    else:
        lines += ["", "Rows that diverge anywhere or could not be checked:", "",
                  table(diverged, _parity_detail_cols(k))]
    lines += ["", "<details><summary>Every parity row</summary>", "", table(rows, _parity_detail_cols(k)), "",
              "</details>"]
    return lines


def active_path_section(ri: ReportInput) -> list[str]:
    a, record = ri.analysis, ri.record
    lines = ["## Active path", ""]
    s = a.path_summary
    if s.empty:
        return lines + ["No measured ok samples: nothing to check."]
    if s["expect_path"].isna().all() and all(p == {"(not reported)": n} for p, n in zip(s["paths"], s["n"])):
        return lines + ["No arm sets expect_path and the engine reported no prefill path."]
    rows = s.copy()
    rows["fallback_text"] = [f"{fb} ({ine} one-chunk)" if ine else str(fb)
                             for fb, ine in zip(rows["fallback"], rows["fallback_ineligible"])]
    req = an.gate_spec(record).require_active_path
    rows["gate"] = [("pass" if ok else "FAIL") if req else "not gated" for ok in rows["passed"]]
    lines += [
        ("Prefill path the engine reported per measured request. A fallback with the engine's reason passes "
         "on a one-chunk prompt (n_chunks <= 1: nothing to reorder), and on longer prompts only for arms in "
         "gate.allow_fallback; a different path without a reason (silent), no reported path, or an arm that "
         "never shows its path fails.")
        + ("" if req else " gate.require_active_path is off: shown, not gated."), "",
        table(rows, [Col("arm", "Arm", right=False), Col("expect_path", "Expected", descriptive=True, right=False),
                     Col("n", "n", fmt_int, descriptive=True), Col("paths", "Reported paths", fmt_counts, right=False),
                     Col("fallback_reasons", "Fallback reasons", fmt_counts, descriptive=True, right=False),
                     Col("active", "Active", fmt_int), Col("fallback_text", "Fallback"),
                     Col("silent", "Silent", fmt_int), Col("unreported", "Unreported", fmt_int),
                     Col("allow_fallback", "Allowed to fall back", fmt_bool, descriptive=True),
                     Col("gate", "Gate", right=False)]),
    ]
    return lines


def attention_batching_section(ri: ReportInput) -> list[str]:
    t = ri.analysis.attention_batching
    if t.empty:
        return []
    return [
        "## Attention batching", "",
        ("Arms whose engine ran layer-major prefill with more than one chunk per attention call (the vendored "
         "engine's attention_batch, in full-attention layers). Medians per request: groups of that many adjacent "
         "chunks that ran as one call, and groups that ran one call per chunk instead, by the engine's reason "
         "(not-bit-identical: the joint call is not exact on this device; window-end: fewer chunks left in the "
         "window; short-chunk: a chunk shorter than the chunk length; long-context: the group ends past the "
         "batching limit)."), "",
        table(t, [Col("arm", "Arm", right=False), Col("kind", "Kind", descriptive=True, right=False),
                  Col("target_tokens", "Prompt tokens", fmt_int), Col("n", "n", fmt_int, descriptive=True),
                  Col("attention_batch", "Chunks per call", fmt_int, descriptive=True),
                  Col("batched", "Batched groups", fmt_int), Col("fallbacks", "Fallbacks", fmt_counts, right=False)]),
    ]


def floor_section(ri: ReportInput) -> list[str]:
    a = ri.analysis
    if a.floor.empty:
        return []
    return [
        "## Distance to the floor", "",
        ("The physical floor of a fresh prompt's TTFT: max(compute floor, copy floor). Compute floor = the "
         "fastest median TTFT among the resident arms (every expert on the device, nothing streamed; 'Set by' "
         "names it, so a run with resident arms at several chunk sizes is judged against the best of them); "
         "copy floor = one bank / the engine's measured H2D bandwidth. 'x floor' = the arm's median TTFT over "
         "that floor (1.00x = at the floor)."), "",
        table(a.floor, [*CELL_COLS, Col("ttft_s", "TTFT", fmt_s),
                        Col("compute_floor_s", "Compute floor", fmt_s),
                        Col("compute_floor_arm", "Set by", descriptive=True, right=False),
                        Col("copy_floor_s", "Copy floor", fmt_s),
                        Col("floor_s", "Floor", fmt_s), Col("bound", "Bound by", descriptive=True, right=False),
                        Col("over_floor", "x floor", fmt_ratio)]),
        "",
    ] + _gap_lines(a)


def _gap_lines(a: an.Analysis) -> list[str]:
    if a.gap.empty:
        return []
    return [
        ("Where a streaming arm's time goes (medians): TTFT = a resident arm's TTFT at the same chunk length "
         "(the same kernels with every expert on the device; 'Resident') + the gap; gap = copy wait (GPU time "
         "compute stalled on streamed experts: the copies not hidden) + the rest (host work, allocator "
         "pressure, kernels slowed beside the copies). A copy wait near the gap means the copies were not "
         "hidden; a large rest is the part no counter explains yet."), "",
        table(a.gap, [*CELL_COLS, Col("chunk_tokens", "Chunk", fmt_int, descriptive=True),
                      Col("ttft_s", "TTFT", fmt_s),
                      Col("resident_arm", "Resident", descriptive=True, right=False),
                      Col("resident_ttft_s", "Resident TTFT", fmt_s), Col("gap_s", "Gap", fmt_s),
                      Col("copy_wait_s", "Copy wait", fmt_s), Col("rest_s", "Rest", fmt_s),
                      Col("rest_share", "Rest / gap", fmt_pct)]),
        "",
    ]


def overhead_section(ri: ReportInput) -> list[str]:
    a = ri.analysis
    lines = ["## Client overhead", ""]
    if a.overhead.empty:
        return lines + ["The engine reported no timings (first_token - received): client overhead is not measured."]
    return lines + [
        ("Harness TTFT minus the engine's own time from receiving the request to its first token: the "
        "server's HTTP stack and SSE framing, the socket and the client. 'After server write' (median): "
        "harness TTFT minus the server's span from receiving the request to handing the first event to the "
        "transport, i.e. the client, the socket and the server's HTTP parsing before the app sees the "
        "request."), "",
        table(a.overhead, [Col("arm", "Arm", descriptive=True, right=False), Col("n", "n", fmt_int, descriptive=True),
                           Col("median_s", "Median", fmt_s), Col("min_s", "Min", fmt_s), Col("max_s", "Max", fmt_s),
                           Col("after_write_s", "After server write", fmt_s),
                           Col("queue_wait_s", "Engine queue wait", fmt_s, descriptive=True)]),
    ]


def problems_section(ri: ReportInput) -> list[str]:
    record, a, problems, plot_missing = ri.record, ri.analysis, ri.problems, ri.plot_missing
    c = a.completeness
    items: list[str] = list(problems)
    if record.status != "complete":
        items.append(f"run status is {record.status}" + (f": {record.status_reason}" if record.status_reason else ""))
    if not c.has_plan:
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
    lines = ["## Problems and missing data", "", counts, ""]
    lines.append(bullets(items) if items else "None.")
    return lines


def _plot_link(plots: dict[str, str | None], name: str, title: str) -> list[str]:
    rel = plots.get(name)
    return ["", f"![{title}]({rel})"] if rel else []


def _dig(d: Any, path: str) -> Any:
    for part in path.split("."):
        if not isinstance(d, dict):
            return None
        d = d.get(part)
    return d


def key_environment(env: dict[str, Any]) -> list[tuple[str, Any]]:
    """The fingerprint's key fields (the ones :mod:`abbench.fingerprint` compares runs on, and what a reader
    looks for first), as (label, value) pairs; absent fields are left out."""
    gpus = env.get("gpus")
    names = [g.get("name") for g in gpus if isinstance(g, dict) and g.get("name")] if isinstance(gpus, list) else []
    pcie = _dig(gpus[0], "pcie") if isinstance(gpus, list) and gpus and isinstance(gpus[0], dict) else None
    link = (f"Gen{pcie.get('gen_current')} x{pcie.get('width_current')}"
            if isinstance(pcie, dict) and pcie.get("gen_current") else None)
    fields: list[tuple[str, Any]] = [
        ("GPU", ", ".join(names) if names else env.get("gpu")),
        ("PCIe link (GPU 0)", link),
        ("Driver", env.get("driver_version") or env.get("driver")),
        ("CUDA driver", env.get("cuda_driver_version") or env.get("cuda")),
        ("torch", _dig(env, "packages.torch") or env.get("torch")),
        ("transformers", _dig(env, "packages.transformers") or env.get("transformers")),
        ("Engine commit", env.get("engine_commit")),
        ("Host", env.get("hostname")),
        ("CPU", _dig(env, "cpu.model")),
        ("Python", _dig(env, "python.version") or (env.get("python") if isinstance(env.get("python"), str) else None)),
        ("Platform", _dig(env, "platform.platform") or (env.get("platform") if isinstance(env.get("platform"), str) else None)),
        ("Tokenizer", env.get("tokenizer")),
    ]
    return [(k, v) for k, v in fields if v not in (None, "", [], {})]


def _flatten_all(v: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(v, dict) and v:
        for k, x in v.items():
            _flatten_all(x, f"{prefix}.{k}" if prefix else str(k), out)
    elif isinstance(v, list) and v and any(isinstance(x, (dict, list)) for x in v):
        for i, x in enumerate(v):
            _flatten_all(x, f"{prefix}[{i}]", out)
    else:
        out[prefix] = v


def environment_section(ri: ReportInput) -> list[str]:
    record = ri.record
    lines = ["## Environment", ""]
    env = record.environment
    if not env:
        lines.append("No environment fingerprint was recorded.")
    else:
        key = key_environment(env)
        if key:
            lines.append(bullets([f"**{k}:** {env_value(v)}" for k, v in key], limit=len(key)))
        else:
            lines.append("None of the key fields (GPU, driver, CUDA, torch, transformers, engine commit) "
                         "was recorded.")
        flat: dict[str, Any] = {}
        _flatten_all(env, "", flat)
        lines += ["", "<details><summary>Full fingerprint</summary>", "",
                  bullets([f"{k}: {env_value(v)}" for k, v in flat.items()], limit=len(flat)), "", "</details>"]
    if record.prompts:
        pf = pd.DataFrame([{"id": p.id, "kind": p.kind, "tokens": p.target_tokens, "count": p.token_count,
                            "sha": p.sha256[:12], "corpus": p.corpus} for p in record.prompts])
        lines += ["", "<details><summary>Prompts</summary>", "",
                  table(pf, [Col("id", "Prompt", right=False), Col("kind", "Kind", right=False),
                             Col("tokens", "Target tokens", fmt_int), Col("count", "Re-encoded", fmt_int),
                             Col("sha", "sha256", code, right=False),
                             Col("corpus", "Corpus", descriptive=True, right=False)]), "", "</details>"]
    services = [s for s in record.services if s.command]
    if services:
        lines += ["", "<details><summary>Service commands</summary>", "",
                  bullets([f"{s.key}: {env_value(s.command, 400)}" for s in services], limit=len(services)),
                  "", "</details>"]
    return lines


def small_n_section(ri: ReportInput) -> list[str]:
    notes = ri.analysis.notes
    return ["## Small-n notes", "", bullets(notes) if notes else "None."]


def plots_section(ri: ReportInput) -> list[str]:
    lines = ["## Plots", ""]
    lines += [f"- [{name}.png]({ri.plots[name]})" for name in PLOTS if ri.plots.get(name)]
    lines += [f"- {name}.png: not drawn ({why})" for name, why in ri.plot_missing.items()]
    return lines


SECTIONS = [
    header_section, verdict_section, ttft_section, engines_section, ratios_section, h2d_section, floor_section,
    engine_counters_section, decode_section, latency_section, host_cpu_section, memory_section, parity_section,
    active_path_section, attention_batching_section, overhead_section, environment_section, small_n_section,
    problems_section, plots_section,
]
"""The report's sections, in order."""


def render_markdown(record: RunRecord, problems: list[str], a: an.Analysis, plot_links: dict[str, str],
                    plot_missing: dict[str, str]) -> str:
    """The report's Markdown, given the analysis and the plots' relative links (pure)."""
    ri = ReportInput(record=record, analysis=a, problems=list(problems), plots=dict(plot_links),
                     plot_missing=dict(plot_missing))
    return "\n\n".join("\n".join(lines) for section in SECTIONS if (lines := section(ri))).rstrip() + "\n"
