"""Bytes and memory: host-to-device bytes, the engine's own counters, decode, host CPU, and memory over time.
"""

from __future__ import annotations

from abbench import analysis as an
from abbench.analysis.frames import measured_ok_frame, sort_rows
from abbench.report.format import (
    DASH,
    Col,
    bullets,
    fmt_gb,
    fmt_gib,
    fmt_int,
    fmt_num,
    fmt_pct,
    fmt_ratio,
    fmt_s,
    is_na,
    table,
)
from abbench.report.sections.base import CELL_COLS, ReportInput, plot_link


def _fmt_gbps(v) -> str:
    """One decimal, or two significant digits below 1 GB/s (an FP8 bank dequantized on a CPU: 0.02, not 0.0)."""
    if is_na(v) or float(v) >= 1 or float(v) == 0:
        return fmt_num(v, 1)
    return f"{float(v):.2g}"


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
    # shown only where an engine primed a first layer ("k/n", k > 0)
    has_primed = any(isinstance(p, str) and not p.startswith("0/") for p in a.h2d["primed"])
    # the bank's format, shown when an arm's is not the compute dtype (an FP8 bank moves about half the bytes)
    has_format = a.h2d["expert_format"].astype(str).str.startswith("fp8").any()
    lines += [
        ("Medians per request. Banks = prefill H2D bytes / the engine's bank size (all layers' experts). "
        "Floor = windows x bank / measured H2D bandwidth: the copy-bound lower limit of a prompt's TTFT "
        "(given for prompts that start from an empty cache)."
        + (" Copy wait = GPU time the engine's compute stream waited for streamed expert copies during prefill "
           "(CUDA timing events): the part of the copies that compute did not hide." if has_wait else "")
        + (" Alloc retries = the most CUDA caching-allocator retries in one request (it freed its cache and "
           "called cudaMalloc again: memory pressure that costs time)." if has_retries else "")
        + (" Primed = requests whose first layer's copy the engine started as they arrived, while their body was "
           "read and tokenized: inside their TTFT and their bytes, before their prefill." if has_primed else "")),
        "",
        table(a.h2d, [*CELL_COLS, Col("h2d_bytes", "Engine H2D", fmt_gb),
                      Col("prefill_h2d_bytes", "Prefill", fmt_gb, descriptive=True),
                      Col("decode_h2d_bytes", "Decode", fmt_gb, descriptive=True),
                      Col("bank_bytes", "Bank", fmt_gb, descriptive=True)]
              + ([Col("expert_format", "Bank format", descriptive=True, right=False)] if has_format else [])
              + [Col("banks", "Banks", fmt_num),
                      Col("nvml_bytes", "NVML PCIe RX", fmt_gb), Col("engine_over_nvml", "Engine/NVML", fmt_ratio),
                      Col("n_windows", "Windows", fmt_num, descriptive=True),
                      Col("measured_h2d_gbps", "H2D GB/s", _fmt_gbps, descriptive=True),
                      Col("floor_s", "Floor", fmt_s), Col("ttft_s", "TTFT", fmt_s),
                      Col("ttft_over_floor", "TTFT/floor", fmt_ratio)]
              + ([Col("copy_wait_s", "Copy wait", fmt_s)] if has_wait else [])
              + ([Col("alloc_retries", "Alloc retries", fmt_int)] if has_retries else [])
              + ([Col("primed", "Primed", descriptive=True)] if has_primed else [])),
    ]
    spread = an.probe_spread(ri.record)
    if spread is not None:
        lines += ["", probe_spread_note(spread)]
    if not has_engine:
        lines += ["", "The engine reported no H2D counters: only NVML's estimate is shown."]
    if not has_nvml:
        lines += ["", "NVML gave no PCIe RX estimate: the engine's counters are not cross-checked."]
    return lines + plot_link(plots, "h2d", "H2D bytes per arm and length")


def probe_spread_note(spread: tuple[float, float]) -> str:
    """Why a run's copy floors are left out: its services measured H2D bandwidths too far apart."""
    lo, hi = spread
    return (f"No copy floor: the services' H2D bandwidth probes disagree ({lo:.2f} to {hi:.2f} GB/s, more than "
            f"{an.transfer.PROBE_SPREAD_LIMIT:g}x apart), as on a CPU host, where the probe times a memory copy "
            "beside whatever else runs, not a PCIe link. The byte columns stand; a floor divided by such a "
            "bandwidth would be noise.")


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
    has_misses = a.decode["decode_misses"].notna().any()  # engines that name who copies the misses
    lines += [
        ("Medians per request. Step = (total - TTFT) / (output tokens - 1) as the harness saw it, and Decode "
         "tok/s = 1 / Step (the median step: with an even n it can differ from the TTFT table's median of the "
         "requests' rates); decode H2D per "
         "step = experts copied into the decode slot cache; hit rate = routed (layer, expert) pairs found in "
         "the slot cache. Peak device memory: the engine's own peak allocation during the request (torch), and "
         "NVML's peak for the service's processes."
         + (" Added = the most a request added to what the engine held when it started (weights, KV cache, "
            "buffers and slot cache stay between requests): the memory the request itself needed."
            if has_added else "")
         + (" The step's breakdown: Copies = decode H2D per step / measured H2D bandwidth; Cached = the cached "
            "step (the median step, for the same prompt, of an arm whose decode copied nothing, with the same "
            "decode kernels where the engine names them); Expected = Copies + Cached; Other = Step - Expected (host "
            "round trips, copies slower than the probe, contention)." if has_model else "")
         + (" Misses: who looked up the slot cache and copied its misses (host: the router's choice read back "
            "every layer; device: kernels of the step)." if has_misses else "")), "",
        table(a.decode, [*CELL_COLS, Col("tok_s", "Decode tok/s", lambda v: fmt_num(v, 1)),
                         Col("step_s", "Step", fmt_s),
                         Col("h2d_per_step", "Decode H2D/step", fmt_gb),
                         Col("hit_rate", "Slot hit rate", lambda v: fmt_pct(v, 1)),
                         Col("slots_per_layer", "Slots/layer", fmt_int, descriptive=True),
                         Col("decode_mode", "Decoder", descriptive=True, right=False),
                         *([Col("decode_kernels", "Kernels", descriptive=True, right=False)]
                           if a.decode["decode_kernels"].notna().any() else []),  # engines that name them
                         *([Col("decode_misses", "Misses", descriptive=True, right=False)] if has_misses else []),
                         *([Col("copy_s", "Copies", fmt_s), Col("cached_step_s", "Cached", fmt_s),
                            Col("other_s", "Other", fmt_s)] if has_model else []),
                         Col("expected_step_s", "Expected step", fmt_s),
                         Col("over_expected", "Step/expected", fmt_ratio),
                         Col("peak_device_bytes", "Peak device (engine)", fmt_gib)]
                        + ([Col("added_device_bytes", "Added (engine)", fmt_gib)] if has_added else [])
                        + [Col("proc_gpu_mem_peak", "Peak device (NVML)", fmt_gib)]),
    ]
    return lines + plot_link(ri.plots, "ttft_memory", "TTFT against peak device memory")


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
    return lines + plot_link(plots, "memory", "Memory over time")
