"""Time to first token: per cell, the latency percentiles (TTFT, TPOT, ITL), the engines side by side, the
paired ratios, the floor (and the gap to it), and the client's overhead.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from abbench import analysis as an
from abbench.report.format import DASH, Col, fmt_gb, fmt_gib, fmt_int, fmt_num, fmt_pct, fmt_ratio, fmt_s, is_na, table
from abbench.report.sections.base import CELL_COLS, ReportInput, plot_link
from abbench.report.sections.transfer import probe_spread_note


def ttft_section(ri: ReportInput) -> list[str]:
    a, plots = ri.analysis, ri.plots
    lines = ["## TTFT per arm and prompt length", ""]
    if a.ttft.empty:
        return lines + ["No measured ok sample with a TTFT: nothing to show."]
    lines += [
        ("Time to first token measured by the harness (from just before the request to the first streamed "
        "text), measured ok samples only. Decode tok/s: the median of each request's (output tokens - 1) / "
        "(total - TTFT)."), "",
        table(a.ttft, [*CELL_COLS, Col("median_s", "Median", fmt_s),
                       Col("min_s", "Min", fmt_s), Col("max_s", "Max", fmt_s),
                       Col("decode_tok_s", "Decode tok/s", lambda v: fmt_num(v, 1), descriptive=True)]),
    ]
    return lines + plot_link(plots, "ttft", "TTFT per arm and length")


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
    return lines + plot_link(plots, "ratios", "Paired ratios")


def floor_section(ri: ReportInput) -> list[str]:
    a = ri.analysis
    if a.floor.empty:  # said where the floors went when the probes left none (and no resident arm sets one)
        spread = _spread_lines(ri)
        return (["## Distance to the floor", "", *spread, "No resident arm sets a compute floor either: no cell has "
                 "a floor."] if spread else [])
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
    ] + _spread_lines(ri) + _gap_lines(a)


def _spread_lines(ri: ReportInput) -> list[str]:
    spread = an.probe_spread(ri.record)
    return [] if spread is None else [probe_spread_note(spread), ""]


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
        ("What the harness adds to TTFT: harness TTFT minus the engine's own span from receiving the request to "
         "handing its first event to the transport, i.e. the client, the socket and the server's HTTP parsing "
         "before its application sees the request (target: at most 1 ms median and 1.5 ms p90). 'With the "
         "server's write' (median) is harness TTFT minus the engine's time from receiving the request to its "
         "first token: it adds the server's own HTTP/SSE stack from the token to the event."), "",
        table(a.overhead, [Col("arm", "Arm", descriptive=True, right=False), Col("n", "n", fmt_int, descriptive=True),
                           Col("harness_s", "Median", fmt_s), Col("harness_p90_s", "p90", fmt_s),
                           Col("harness_max_s", "Max", fmt_s),
                           Col("with_write_s", "With the server's write", fmt_s),
                           Col("queue_wait_s", "Engine queue wait", fmt_s, descriptive=True)]),
    ]
