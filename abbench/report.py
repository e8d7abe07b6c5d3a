"""The Markdown report of one run, with PNG plots.

Contract
--------
:func:`write_report` reads a :class:`~abbench.results.RunRecord` (and the problems :func:`~abbench.results.
load_run` found), computes everything through :mod:`abbench.analysis`, writes GitHub-flavoured Markdown to
``out_md`` and the plots into ``plots_dir``, and returns ``out_md``. It never prints and never raises on
missing data: a section without data says so, and so does "Problems and missing data".

Layout: the CLI's default is :func:`report_paths` — ``reports/<run-id>.md`` and ``reports/<run-id>/`` for
``ttft.png``, ``ratios.png``, ``h2d.png``, ``memory.png``; the Markdown links them relatively, so the pair
can be moved together. A plot without data is not drawn (a stale file of that name is removed) and the
report says why.

Tables follow llama.cpp's compare-llama-bench: a descriptive column whose value is the same in every row
is dropped and stated once above the table; measured values are always shown. Numbers are formatted for
humans: times in ms (s above 10 s), transfers in GB (10^9 bytes, like GB/s), memory in GiB, ratios as
``0.52x``.

matplotlib (Agg, through ``FigureCanvasAgg``: no global backend switch, no pyplot) is imported only inside
the plotting functions, so ``import abbench.report`` stays cheap.
"""

from __future__ import annotations

import datetime as dt
import os
import shlex
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from abbench import analysis as an
from abbench.results import RunRecord

PLOTS = ("ttft", "ratios", "h2d", "memory")
MAX_LISTED = 40
"""Longest list of failures/missing steps written out in full; the rest is counted."""
DASH = "—"


def report_paths(reports_dir: Path, run_id: str) -> tuple[Path, Path]:
    """Default locations: (``reports/<run-id>.md``, ``reports/<run-id>/`` for the plots)."""
    return reports_dir / f"{run_id}.md", reports_dir / run_id


# ------------------------------------------------------------------------------------ formatting


def _na(v: Any) -> bool:
    if v is None or v is pd.NA:
        return True
    try:
        return bool(pd.isna(v))
    except (TypeError, ValueError):
        return False


def fmt_s(v: Any) -> str:
    """Seconds for humans: '0.42 ms', '12.3 ms', '523.4 ms', '1234 ms', '12.35 s'."""
    if _na(v):
        return DASH
    x = float(v)
    ms = x * 1e3
    if abs(x) >= 10:
        return f"{x:.2f} s"
    if abs(ms) >= 1000:
        return f"{ms:.0f} ms"
    if abs(ms) >= 100:
        return f"{ms:.1f} ms"
    if abs(ms) >= 1:
        return f"{ms:.2f} ms"
    return f"{ms:.3f} ms"


def fmt_gb(v: Any) -> str:
    """Bytes as decimal GB (transfers, like GB/s); MB/kB below 1 GB."""
    if _na(v):
        return DASH
    x = float(v)
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f} B"


def fmt_gib(v: Any) -> str:
    """Bytes as binary GiB (memory); MiB below 1 GiB."""
    if _na(v):
        return DASH
    x = float(v)
    if abs(x) >= 2**30:
        return f"{x / 2**30:.2f} GiB"
    return f"{x / 2**20:.1f} MiB"


def fmt_ratio(v: Any) -> str:
    return DASH if _na(v) else f"{float(v):.3f}x"


def fmt_num(v: Any, digits: int = 2) -> str:
    if _na(v):
        return DASH
    x = float(v)
    return f"{int(x)}" if x == int(x) and abs(x) < 1e15 else f"{x:.{digits}f}"


def fmt_int(v: Any) -> str:
    return DASH if _na(v) else str(int(v))


def fmt_text(v: Any) -> str:
    return DASH if _na(v) or v == "" else str(v)


def fmt_bool(v: Any) -> str:
    return DASH if _na(v) else ("yes" if v else "no")


def fmt_counts(d: Any) -> str:
    if not isinstance(d, dict) or not d:
        return DASH
    return ", ".join(f"{k} ×{n}" for k, n in sorted(d.items(), key=lambda kv: (-kv[1], kv[0])))


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _code(text: str) -> str:
    text = text.replace("`", "'")
    return f"`{text}`"


@dataclass(frozen=True)
class Col:
    """One table column: the frame's key, its header, a formatter, whether it is descriptive (dropped when
    constant across rows) and right-aligned."""

    key: str
    header: str
    fmt: Callable[[Any], str] = fmt_text
    descriptive: bool = False
    right: bool = True


def table(df: pd.DataFrame, cols: list[Col], *, drop_constant: bool = True) -> str:
    """A GFM table. With more than one row, descriptive columns that hold one value are dropped and
    stated once above the table (compare-llama-bench style)."""
    if df.empty:
        return "_No rows._"
    cells = {c.key: [c.fmt(v) for v in df[c.key]] if c.key in df else [DASH] * len(df) for c in cols}
    shown, constant = [], []
    for c in cols:
        if drop_constant and c.descriptive and len(df) > 1 and len(set(cells[c.key])) == 1:
            constant.append(f"{c.header}: {cells[c.key][0]}")
        else:
            shown.append(c)
    lines = []
    if constant:
        lines += ["Same in every row: " + "; ".join(_cell(x) for x in constant) + ".", ""]
    lines.append("| " + " | ".join(_cell(c.header) for c in shown) + " |")
    lines.append("|" + "|".join("---:" if c.right else "---" for c in shown) + "|")
    for i in range(len(df)):
        lines.append("| " + " | ".join(_cell(cells[c.key][i]) for c in shown) + " |")
    return "\n".join(lines)


def _bullets(items: Iterable[str], limit: int = MAX_LISTED) -> str:
    items = list(items)
    out = [f"- {x}" for x in items[:limit]]
    if len(items) > limit:
        out.append(f"- ... and {len(items) - limit} more")
    return "\n".join(out)


def _when(t: float | None) -> str:
    if t is None:
        return DASH
    return dt.datetime.fromtimestamp(t, tz=dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _command(env: dict[str, Any]) -> str | None:
    for key in ("command", "argv", "cli", "cmdline"):
        v = env.get(key)
        if isinstance(v, list) and v:
            return shlex.join(str(x) for x in v)
        if isinstance(v, str) and v:
            return v
    return None


def _env_value(v: Any, limit: int = 160) -> str:
    if isinstance(v, list):
        text = shlex.join(str(x) for x in v) if all(isinstance(x, str) for x in v) else ", ".join(map(str, v))
    else:
        text = str(v)
    if len(text) > limit:
        text = text[: limit - 1] + "…"
    return _code(text)


def _group_label(kind: Any, tokens: Any) -> str:
    return f"{kind} {fmt_int(tokens)}"


# -------------------------------------------------------------------------------------- sections


def _header(record: RunRecord, a: an.Analysis) -> list[str]:
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
        f"- **Date:** {_when(record.created_at)} (duration {duration})",
        f"- **Arms:** {', '.join(a.arms) or DASH}; reference **{a.reference or DASH}**",
        f"- **Rounds:** {len(rounds)} (arm order reversed every round: ABBA)",
        f"- **abbench:** {record.abbench_version}, schema {record.schema_version}",
    ]
    cmd = _command(record.environment)
    if cmd:
        lines.append(f"- **Command:** {_code(cmd)}")
    return lines


def _verdict(a: an.Analysis) -> list[str]:
    g = a.gate
    head = "**Gate: PASS**" if g.passed else f"**Gate: FAIL** ({len(g.failures)} failure(s))"
    checks = pd.DataFrame([{"name": c.name, "result": "pass" if c.passed else "FAIL", "detail": c.detail}
                           for c in g.checks])
    lines = ["## Verdict", "", f"{head} — parity over the first {g.parity_tokens} token ids.", "",
             table(checks, [Col("name", "Check", right=False), Col("result", "Result", right=False),
                            Col("detail", "Detail", right=False)], drop_constant=False)]
    if g.failures:
        lines += ["", "Failures:", "", _bullets(g.failures)]
    if g.notes:
        lines += ["", "Notes:", "", _bullets(g.notes)]
    return lines


def _ttft(a: an.Analysis, plots: dict[str, str | None]) -> list[str]:
    lines = ["## TTFT per arm and prompt length", ""]
    if a.ttft.empty:
        return lines + ["No measured ok sample with a TTFT: nothing to show."]
    lines += [
        ("Time to first token measured by the harness (from just before the request to the first streamed "
        "text), measured ok samples only."), "",
        table(a.ttft, [Col("arm", "Arm", descriptive=True, right=False),
                       Col("kind", "Kind", descriptive=True, right=False),
                       Col("target_tokens", "Prompt tokens", fmt_int, descriptive=True),
                       Col("n", "n", fmt_int, descriptive=True), Col("median_s", "Median", fmt_s),
                       Col("min_s", "Min", fmt_s), Col("max_s", "Max", fmt_s),
                       Col("decode_tok_s", "Decode tok/s", lambda v: fmt_num(v, 1), descriptive=True)]),
    ]
    return lines + _plot_link(plots, "ttft", "TTFT per arm and length")


def _verdict_words(r: Any) -> str:
    if r.verdict == "faster":
        return f"{1 / r.median_ratio:.2f}x faster"
    if r.verdict == "slower":
        return f"{r.median_ratio:.2f}x slower"
    return str(r.verdict)


def _ratios(a: an.Analysis, plots: dict[str, str | None]) -> list[str]:
    lines = ["## Paired ratios", ""]
    if a.ratios.empty:
        why = ("there is only one arm" if len(a.arms) < 2 else
               f"no prompt has ok samples of both an arm and the reference ({a.reference}) in the same round")
        return lines + [f"No pairs: {why}."]
    rows = a.ratios.copy()
    rows["ci"] = [DASH if _na(lo) else f"{lo:.3f}x – {hi:.3f}x" for lo, hi in zip(rows["ci_low"], rows["ci_high"])]
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


def _h2d(a: an.Analysis, plots: dict[str, str | None]) -> list[str]:
    lines = ["## Host-to-device transfers", ""]
    if a.h2d.empty:
        return lines + [("No H2D data: the engine reported no transfer counters and NVML gave no PCIe estimate "
                        "(another engine, or no GPU).")]
    has_engine = a.h2d["h2d_bytes"].notna().any()
    has_nvml = a.h2d["nvml_bytes"].notna().any()
    lines += [
        ("Medians per request. Banks = prefill H2D bytes / the engine's bank size (all layers' experts). "
        "Floor = windows x bank / measured H2D bandwidth: the copy-bound lower limit of a prompt's TTFT "
        "(given for prompts that start from an empty cache)."), "",
        table(a.h2d, [Col("arm", "Arm", descriptive=True, right=False),
                      Col("kind", "Kind", descriptive=True, right=False),
                      Col("target_tokens", "Prompt tokens", fmt_int, descriptive=True),
                      Col("n", "n", fmt_int, descriptive=True), Col("h2d_bytes", "Engine H2D", fmt_gb),
                      Col("prefill_h2d_bytes", "Prefill", fmt_gb, descriptive=True),
                      Col("decode_h2d_bytes", "Decode", fmt_gb, descriptive=True),
                      Col("bank_bytes", "Bank", fmt_gb, descriptive=True), Col("banks", "Banks", fmt_num),
                      Col("nvml_bytes", "NVML PCIe RX", fmt_gb), Col("engine_over_nvml", "Engine/NVML", fmt_ratio),
                      Col("n_windows", "Windows", fmt_num, descriptive=True),
                      Col("measured_h2d_gbps", "H2D GB/s", lambda v: fmt_num(v, 1), descriptive=True),
                      Col("floor_s", "Floor", fmt_s), Col("ttft_s", "TTFT", fmt_s),
                      Col("ttft_over_floor", "TTFT/floor", fmt_ratio)]),
    ]
    if not has_engine:
        lines += ["", "The engine reported no H2D counters: only NVML's estimate is shown."]
    if not has_nvml:
        lines += ["", "NVML gave no PCIe RX estimate: the engine's counters are not cross-checked."]
    return lines + _plot_link(plots, "h2d", "H2D bytes per arm and length")


def _engine_counters(record: RunRecord) -> list[str]:
    lines = ["## Engine counters", ""]
    df = an.engine_counter_table(record)
    if df.empty:
        return lines + ["The engine reported no prefix-cache numbers in its responses and no prompt counters "
                        "on its metrics endpoint (or the profile scrapes none)."]
    adapter = (record.profile.get("engine") or {}).get("adapter") or "openai"
    lines += [
        (f"Medians per request (adapter `{adapter}`). Prompt tokens: as the server counted them. Cached: "
         "prompt tokens the engine reports serving from its prefix cache in the response (vLLM needs "
         "`--enable-prompt-tokens-details`; SGLang `meta_info.cached_tokens`; llama.cpp `timings.cache_n`). "
         "/metrics: the engine's Prometheus counters after minus before the request (llama.cpp counts only "
         "the prompt tokens it computed). A cold prompt should show 0 cached: more means the cache reset did "
         "not take."), "",
        table(df, [Col("arm", "Arm", descriptive=True, right=False), Col("kind", "Kind", descriptive=True, right=False),
                   Col("target_tokens", "Prompt tokens", fmt_int, descriptive=True),
                   Col("n", "n", fmt_int, descriptive=True),
                   Col("prompt_tokens", "Server prompt tokens", fmt_num),
                   Col("engine_cached", "Cached (response)", fmt_num),
                   Col("metrics_prompt", "Prompt tokens (/metrics)", fmt_num),
                   Col("metrics_cached", "Cached (/metrics)", fmt_num)]),
    ]
    return lines


def _memory(a: an.Analysis, record: RunRecord, plots: dict[str, str | None]) -> list[str]:
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
        lines += ["", "GPU idle check:", "", _bullets(idle)]
    return lines + _plot_link(plots, "memory", "Memory over time")


def _parity_detail_cols(k: int) -> list[Col]:
    return [
        Col("check", "Check", descriptive=True, right=False),
        Col("prompt_id", "Prompt", descriptive=True, right=False),
        Col("arm", "Arm", descriptive=True, right=False), Col("round", "Round", fmt_int, descriptive=True),
        Col("against", "Against", descriptive=True, right=False), Col("match", f"Match (first {k})", fmt_bool),
        Col("first_diverging", "First diverging", fmt_int), Col("agree_of", "Agree"),
        Col("margin", "Margin arm", lambda v: DASH if _na(v) else f"{float(v):.3f}"),
        Col("margin_against", "Margin ref", lambda v: DASH if _na(v) else f"{float(v):.3f}"),
        Col("classification", "Class", right=False), Col("note", "Note", descriptive=True, right=False),
    ]


def _parity(a: an.Analysis) -> list[str]:
    k = a.parity_tokens
    lines = ["## Parity", ""]
    p = a.parity
    if p.empty:
        return lines + ["No parity rows: there is no measured ok sample to compare."]
    lines += [(f"Each measured sample's first {k} greedy ids against the reference ({a.reference}) in the same "
              "round; 'stability' rows compare the reference with its own lowest round. Margin = top-2 "
              f"logprob gap (nats) at the first divergence; below {an.NEAR_TIE_NATS} in either arm: near-tie."),
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
        })
    n_max = p["max_tokens"].dropna()
    of = f"/{int(n_max.max())}" if not n_max.empty else ""
    lines.append(table(pd.DataFrame(summary), [
        Col("check", "Check", right=False), Col("arm", "Arm", right=False), Col("rows", "Compared", fmt_int),
        Col("match", f"Match (first {k})", fmt_int), Col("identical", "Identical (all ids)", fmt_int),
        Col("min_agree", "Min agree", lambda v: DASH if _na(v) else f"{int(v)}{of}"),
        Col("near", "Near-ties", fmt_int), Col("div", "Divergences", fmt_int),
        Col("unchecked", "Unchecked", fmt_int)], drop_constant=False))
    rows = p.copy()
    rows["against"] = [DASH if _na(ar) else (f"{ar} r{int(rr)}" if not _na(rr) else str(ar))
                       for ar, rr in zip(rows["against_arm"], rows["against_round"])]
    rows["agree_of"] = [DASH if _na(ag) else f"{int(ag)}/{int(mt)}" for ag, mt in zip(rows["agree"], rows["max_tokens"])]
    diverged = rows[(rows["classification"] != "identical").to_numpy(dtype=bool)]
    if diverged.empty:
        lines += ["", "Every compared output is identical over all its ids."]
    else:
        lines += ["", "Rows that diverge anywhere or could not be checked:", "",
                  table(diverged, _parity_detail_cols(k))]
    lines += ["", "<details><summary>Every parity row</summary>", "", table(rows, _parity_detail_cols(k)), "",
              "</details>"]
    return lines


def _active_path(a: an.Analysis, record: RunRecord) -> list[str]:
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


def _floor(a: an.Analysis) -> list[str]:
    if a.floor.empty:
        return []
    return [
        "## Distance to the floor", "",
        ("The physical floor of a fresh prompt's TTFT: max(compute floor, copy floor). Compute floor = median "
         "TTFT of the resident arm (every expert on the device, nothing streamed); copy floor = one bank / the "
         "engine's measured H2D bandwidth. 'x floor' = the arm's median TTFT over that floor (1.00x = at the "
         "floor)."), "",
        table(a.floor, [Col("arm", "Arm", descriptive=True, right=False),
                        Col("kind", "Kind", descriptive=True, right=False),
                        Col("target_tokens", "Prompt tokens", fmt_int, descriptive=True),
                        Col("n", "n", fmt_int, descriptive=True), Col("ttft_s", "TTFT", fmt_s),
                        Col("compute_floor_s", "Compute floor", fmt_s), Col("copy_floor_s", "Copy floor", fmt_s),
                        Col("floor_s", "Floor", fmt_s), Col("bound", "Bound by", descriptive=True, right=False),
                        Col("over_floor", "x floor", fmt_ratio)]),
        "",
    ]


def _overhead(a: an.Analysis) -> list[str]:
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


def _environment(record: RunRecord) -> list[str]:
    lines = ["## Environment", ""]
    env = record.environment
    if not env:
        lines.append("No environment fingerprint was recorded.")
    else:
        key = key_environment(env)
        if key:
            lines.append(_bullets([f"**{k}:** {_env_value(v)}" for k, v in key], limit=len(key)))
        else:
            lines.append("None of the key fields (GPU, driver, CUDA, torch, transformers, engine commit) "
                         "was recorded.")
        flat: dict[str, Any] = {}
        _flatten_all(env, "", flat)
        lines += ["", "<details><summary>Full fingerprint</summary>", "",
                  _bullets([f"{k}: {_env_value(v)}" for k, v in flat.items()], limit=len(flat)), "", "</details>"]
    if record.prompts:
        pf = pd.DataFrame([{"id": p.id, "kind": p.kind, "tokens": p.target_tokens, "count": p.token_count,
                            "sha": p.sha256[:12], "corpus": p.corpus} for p in record.prompts])
        lines += ["", "<details><summary>Prompts</summary>", "",
                  table(pf, [Col("id", "Prompt", right=False), Col("kind", "Kind", right=False),
                             Col("tokens", "Target tokens", fmt_int), Col("count", "Re-encoded", fmt_int),
                             Col("sha", "sha256", _code, right=False),
                             Col("corpus", "Corpus", descriptive=True, right=False)]), "", "</details>"]
    services = [s for s in record.services if s.command]
    if services:
        lines += ["", "<details><summary>Service commands</summary>", "",
                  _bullets([f"{s.key}: {_env_value(s.command, 400)}" for s in services], limit=len(services)),
                  "", "</details>"]
    return lines


def _problems(record: RunRecord, a: an.Analysis, problems: list[str], plot_missing: dict[str, str]) -> list[str]:
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
    lines.append(_bullets(items) if items else "None.")
    return lines


def _plot_link(plots: dict[str, str | None], name: str, title: str) -> list[str]:
    rel = plots.get(name)
    return ["", f"![{title}]({rel})"] if rel else []


# ------------------------------------------------------------------------------------------ plots


def _figure(width: float, height: float) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _groups(df: pd.DataFrame) -> list[tuple[Any, Any]]:
    order = {k: i for i, k in enumerate(an.KIND_ORDER)}
    keys = {(k, t) for k, t in zip(df["kind"], df["target_tokens"])}
    return sorted(keys, key=lambda kt: (order.get(kt[0], 9), -1 if _na(kt[1]) else int(kt[1])))


def _log_if_wide(ax: Any, values: Iterable[float]) -> None:
    xs = [float(v) for v in values if not _na(v) and float(v) > 0]
    if xs and max(xs) / min(xs) > 10:
        ax.set_yscale("log")


def plot_ttft(a: an.Analysis, path: Path) -> None:
    df = a.ttft
    groups = _groups(df)
    fig = _figure(max(6.0, 1.2 * len(groups) + 2), 4.2)
    ax = fig.add_subplot()
    arms = [x for x in a.arms if x in set(df["arm"])]
    width = 0.7 / max(1, len(arms))
    for i, arm in enumerate(arms):
        g = df[df["arm"] == arm]
        idx = {kt: j for j, kt in enumerate(groups)}
        xs = [idx[(k, t)] - 0.35 + width * (i + 0.5) for k, t in zip(g["kind"], g["target_tokens"])]
        med, lo, hi = g["median_s"].to_numpy(float), g["min_s"].to_numpy(float), g["max_s"].to_numpy(float)
        ax.errorbar(xs, med, yerr=[med - lo, hi - med], fmt="o", capsize=4, label=arm)
    ax.set_xticks(range(len(groups)), [_group_label(k, t) for k, t in groups])
    ax.set_xlabel("prompt (kind, tokens)")
    ax.set_ylabel("TTFT (s): median, min–max")
    _log_if_wide(ax, list(df["min_s"]) + list(df["max_s"]))
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(title="arm")
    ax.set_title("Time to first token")
    fig.savefig(path)


def plot_ratios(a: an.Analysis, path: Path) -> None:
    pairs, summ = a.pairs, a.ratios
    arms = [x for x in a.arms if x in set(pairs["arm"])]
    groups = _groups(pairs)
    fig = _figure(max(6.0, 1.2 * len(groups) + 2), 3.2 * len(arms) + 0.6)
    axes = fig.subplots(len(arms), 1, squeeze=False)[:, 0]
    idx = {kt: j for j, kt in enumerate(groups)}
    for ax, arm in zip(axes, arms):
        g = pairs[pairs["arm"] == arm]
        for (k, t), gg in g.groupby(["kind", "target_tokens"], sort=False):
            j = idx[(k, t)]
            n = len(gg)
            offsets = [0.0] if n == 1 else [-0.25 + 0.5 * i / (n - 1) for i in range(n)]
            ax.scatter([j + o for o in offsets], gg["ratio"], s=22, zorder=3, color="C0")
            s = summ[(summ["arm"] == arm) & (summ["kind"] == k) & (summ["target_tokens"] == t)]
            if not s.empty:
                r = s.iloc[0]
                ax.hlines(r["median_ratio"], j - 0.35, j + 0.35, color="C1", lw=2, zorder=2)
                if not _na(r["ci_low"]):
                    ax.fill_between([j - 0.35, j + 0.35], r["ci_low"], r["ci_high"], color="C1", alpha=0.2, lw=0)
        ax.axhline(1.0, color="gray", ls="--", lw=1)
        ax.set_xticks(range(len(groups)), [_group_label(k, t) for k, t in groups])
        ax.set_xlim(-0.6, len(groups) - 0.4)
        ax.set_ylabel(f"TTFT {arm} / {a.reference}")
        _log_if_wide(ax, list(g["ratio"]) + [1.0])
        ax.grid(True, axis="y", alpha=0.3)
        ax.set_title(f"{arm} vs {a.reference}: pairs (dots), median (line), 95% CI (band)", fontsize=10)
    fig.savefig(path)


def plot_h2d(a: an.Analysis, path: Path) -> None:
    df = a.h2d
    groups = _groups(df)
    arms = [x for x in a.arms if x in set(df["arm"])]
    fig = _figure(max(6.0, 1.2 * len(groups) + 2), 4.0)
    ax = fig.add_subplot()
    width = 0.7 / max(1, len(arms))
    idx = {kt: j for j, kt in enumerate(groups)}
    nvml_label = True
    for i, arm in enumerate(arms):
        g = df[df["arm"] == arm]
        xs = [idx[(k, t)] - 0.35 + width * (i + 0.5) for k, t in zip(g["kind"], g["target_tokens"])]
        eng = g["h2d_bytes"].astype(float) / 1e9
        if eng.notna().any():
            ax.bar(xs, eng.fillna(0.0), width=width * 0.9, label=arm)
        nv = g["nvml_bytes"].astype(float) / 1e9
        if nv.notna().any():
            ax.scatter(xs, nv, marker="x", color="black", zorder=3, label="NVML PCIe RX" if nvml_label else None)
            nvml_label = False
    ax.set_xticks(range(len(groups)), [_group_label(k, t) for k, t in groups])
    ax.set_xlabel("prompt (kind, tokens)")
    ax.set_ylabel("host→device per request (GB)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend()
    ax.set_title("H2D bytes (engine counters; NVML estimate as x)")
    fig.savefig(path)


def plot_memory(record: RunRecord, path: Path) -> None:
    """Memory over time per service, one colour per arm (or set of arms sharing a service): GPU used
    (solid) and the service's processes on the GPU (dashed); host RSS when there is no GPU sample."""
    from matplotlib.lines import Line2D

    pts = record.memory
    gpu = any(p.gpu_mem_used is not None or p.proc_gpu_mem is not None for p in pts)
    fig = _figure(8.0, 4.0)
    ax = fig.add_subplot()
    t0 = record.created_at
    arms_of = an.service_arms(record)
    labels: list[str] = []
    services: list[str] = []
    for p in sorted(pts, key=lambda p: p.t):
        if p.service not in services:
            services.append(p.service)
    for svc in services:
        label = ", ".join(arms_of.get(svc) or [svc])
        if label not in labels:
            labels.append(label)
        color = f"C{labels.index(label) % 10}"
        ps = sorted((p for p in pts if p.service == svc), key=lambda p: p.t)
        ts = [p.t - t0 for p in ps]

        def gib(vals: list[int | None]) -> list[float]:
            return [float("nan") if v is None else v / 2**30 for v in vals]

        if gpu:
            ax.plot(ts, gib([p.gpu_mem_used for p in ps]), color=color, marker=".", ms=3)
            ax.plot(ts, gib([p.proc_gpu_mem for p in ps]), color=color, ls="--")
        else:
            ax.plot(ts, gib([p.host_rss for p in ps]), color=color, marker=".", ms=3)
    handles = [Line2D([], [], color=f"C{i % 10}", label=lab) for i, lab in enumerate(labels)]
    if gpu:
        handles += [Line2D([], [], color="gray", label="GPU used (device)"),
                    Line2D([], [], color="gray", ls="--", label="service processes")]
    ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_xlabel("seconds since the run started")
    ax.set_ylabel("GiB")
    ax.set_title("GPU memory over time" if gpu else "Host RSS of the services over time (no GPU samples)")
    ax.grid(True, alpha=0.3)
    fig.savefig(path)


def write_plots(record: RunRecord, a: an.Analysis, plots_dir: Path) -> tuple[dict[str, Path], dict[str, str]]:
    """Draw every plot that has data. Returns (name -> file written, name -> why it was not drawn)."""
    plots_dir.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    skipped: dict[str, str] = {}
    has_memory = any(p.gpu_mem_used is not None or p.proc_gpu_mem is not None or p.host_rss is not None
                     for p in record.memory)
    jobs: dict[str, tuple[bool, str, Callable[[Path], None]]] = {
        "ttft": (not a.ttft.empty, "no measured ok sample with a TTFT", lambda p: plot_ttft(a, p)),
        "ratios": (not a.pairs.empty, "no paired samples", lambda p: plot_ratios(a, p)),
        "h2d": (not a.h2d.empty, "no engine H2D counters or NVML estimate", lambda p: plot_h2d(a, p)),
        "memory": (has_memory, "no background memory samples", lambda p: plot_memory(record, p)),
    }
    for name, (ok, why, draw) in jobs.items():
        path = plots_dir / f"{name}.png"
        if not ok:
            if path.exists():
                path.unlink()
            skipped[name] = why
            continue
        tmp = path.with_name(f".{name}.tmp.png")
        draw(tmp)
        os.replace(tmp, path)
        written[name] = path
    return written, skipped


# ------------------------------------------------------------------------------------------ entry


def render_markdown(record: RunRecord, problems: list[str], a: an.Analysis, plot_links: dict[str, str],
                    plot_missing: dict[str, str]) -> str:
    """The report's Markdown, given the analysis and the plots' relative links (pure)."""
    links: dict[str, str | None] = dict(plot_links)
    sections = [
        _header(record, a), _verdict(a), _ttft(a, links), _ratios(a, links), _h2d(a, links), _floor(a), _engine_counters(record),
        _memory(a, record, links),
        _parity(a), _active_path(a, record), _overhead(a), _environment(record),
        ["## Small-n notes", "", _bullets(a.notes) if a.notes else "None."],
        _problems(record, a, problems, plot_missing),
    ]
    plots = ["## Plots", ""]
    plots += [f"- [{name}.png]({links[name]})" for name in PLOTS if links.get(name)]
    plots += [f"- {name}.png: not drawn ({why})" for name, why in plot_missing.items()]
    sections.append(plots)
    return "\n\n".join("\n".join(s) for s in sections).rstrip() + "\n"


def write_report(record: RunRecord, problems: list[str], out_md: Path, plots_dir: Path) -> Path:
    """Write the Markdown report to ``out_md`` and its plots into ``plots_dir``; returns ``out_md``."""
    out_md = Path(out_md)
    plots_dir = Path(plots_dir)
    a = an.analyze(record)
    written, skipped = write_plots(record, a, plots_dir)
    out_md.parent.mkdir(parents=True, exist_ok=True)
    links = {name: Path(os.path.relpath(p, out_md.parent)).as_posix() for name, p in written.items()}
    text = render_markdown(record, problems, a, links, skipped)
    tmp = out_md.with_name(out_md.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, out_md)
    return out_md
