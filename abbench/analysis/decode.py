"""Decode: how fast each arm generates after its first token, what decode copied over PCIe, how often the
decode slot cache held the routed experts, and the device memory each request peaked at.

:func:`decode_table` gives, per arm, kind and prompt length (medians over measured ok samples):

- ``step_s``: seconds per decode step = (total - TTFT) / (completion_tokens - 1), as the harness saw it;
  ``tok_s`` = 1 / step_s;
- ``h2d_per_step``: the engine's decode H2D bytes / (completion_tokens - 1) (experts copied into the slot
  cache on misses);
- ``hit_rate``: slot-cache hits / (hits + misses) over the request's routed (layer, expert) pairs (None when
  the engine reported none: resident experts, or another engine);
- ``expected_step_s`` = h2d_per_step / measured H2D bandwidth + the *cached step*: the median step of an arm
  that copied nothing during decode (every expert resident or cached) for the same prompt, with the same decode
  kernels when the engine names them (``decode.kernels``), and
  ``over_expected`` = step_s / expected_step_s: how close an offloaded decode comes to "the copies it must
  make, plus a step with nothing to copy"; the step's breakdown: ``copy_s`` = h2d_per_step / bandwidth (the
  copies at the measured bandwidth), ``cached_step_s``, and ``other_s`` = step_s - expected_step_s (what
  neither explains: host round trips, copies slower than the probe, contention);
- ``decode_misses``: who handled the slot cache's misses, as the engine names it (``decode.misses``: host or
  device);
- ``peak_device_bytes``: torch's peak allocated device memory during the request (the engine's own figure),
  and ``proc_gpu_mem_peak``: NVML's peak for the service's processes while the request ran;
  ``added_device_bytes``: the most any request added to what the engine held when it started (peak -
  ``start_device_bytes``: weights, KV cache, buffers and slot cache are held between requests), i.e. the
  memory the request's own prefill and decode needed (None when the engine gives no start figure).

:func:`ttft_memory_table` pairs each arm's median TTFT with its peak device memory, per kind and length: the
speed/memory trade (layer-major against one giant chunk, say) at a glance.
"""

from __future__ import annotations

import pandas as pd

from abbench.analysis.frames import int_or_none, max_of, measured_ok_frame, median_of, sort_rows
from abbench.results import RunRecord

DECODE_COLUMNS = ["arm", "kind", "target_tokens", "n", "step_s", "tok_s", "h2d_per_step", "hit_rate",
                  "slots_per_layer", "decode_mode", "decode_kernels", "decode_misses", "cached_step_s", "copy_s",
                  "other_s", "expected_step_s", "over_expected", "peak_device_bytes", "added_device_bytes",
                  "proc_gpu_mem_peak"]


def _steps(record: RunRecord) -> tuple[pd.DataFrame, dict]:
    """The measured ok samples with their decode step and H2D per step, and the cached step per (prompt,
    decode kernels): the median step of the samples whose decode copied nothing."""
    df = measured_ok_frame(record)
    if df.empty:
        return df, {}
    steps = (df["completion_tokens"] - 1).where(df["completion_tokens"] > 1)
    df = df.assign(step_s=df["decode_s"] / steps, h2d_per_step=df["decode_h2d_bytes"] / steps,
                   hits_total=df["slot_hits"] + df["slot_misses"],
                   added=pd.to_numeric(df["peak_device_bytes"]) - pd.to_numeric(df["start_device_bytes"]),
                   decode_kernels=df["decode_kernels"].fillna(""))
    no_copy = df[(df["decode_h2d_bytes"] == 0) & df["step_s"].notna()]
    cached = {key: median_of(g["step_s"]) for key, g in no_copy.groupby(["prompt_id", "decode_kernels"])}
    return df, cached


def decode_over_expected(record: RunRecord) -> pd.DataFrame:
    """Per measured ok sample that copied during decode: arm, kind, target_tokens, round and ``value`` = its
    step / (its decode H2D per step / its measured bandwidth + the cached step of its prompt and kernels), the
    values the ``decode_x_floor`` check judges."""
    df, cached = _steps(record)
    cols = ["arm", "kind", "target_tokens", "round", "value"]
    if df.empty:
        return pd.DataFrame(columns=cols)
    cache = pd.Series([cached.get(k) for k in zip(df["prompt_id"], df["decode_kernels"])], index=df.index,
                      dtype=float)
    expected = df["h2d_per_step"] / (pd.to_numeric(df["measured_h2d_gbps"]) * 1e9) + cache
    keep = (df["decode_h2d_bytes"] > 0) & expected.notna() & (expected > 0)
    return df.loc[keep, cols[:-1]].assign(value=(df["step_s"] / expected)[keep]).reset_index(drop=True)


def decode_table(record: RunRecord) -> pd.DataFrame:
    df, cached = _steps(record)
    if df.empty:
        return pd.DataFrame(columns=DECODE_COLUMNS)
    rows = []
    for (arm, kind, tokens), g in df.groupby(["arm", "kind", "target_tokens"], sort=False, dropna=False):
        step = median_of(g["step_s"])
        if step is None:
            continue
        hits = g["slot_hits"].sum(min_count=1)
        total = g["hits_total"].sum(min_count=1)
        hit_rate = float(hits / total) if pd.notna(total) and total > 0 else None
        per_step = median_of(g["h2d_per_step"])
        gbps = median_of(g["measured_h2d_gbps"])
        cached_step = median_of([cached.get(key) for key in zip(g["prompt_id"], g["decode_kernels"])])
        expected = copy = None
        if per_step is not None and gbps:
            copy = per_step / (gbps * 1e9)
        if cached_step is not None and copy is not None:
            expected = copy + cached_step
        modes = sorted({m for m in g["decode_mode"] if isinstance(m, str)})
        kernels = sorted({k for k in g["decode_kernels"] if k})
        misses = sorted({m for m in g["decode_misses"] if isinstance(m, str)})
        rows.append({
            "arm": arm, "kind": kind, "target_tokens": int_or_none(tokens), "n": len(g), "step_s": step,
            "tok_s": 1.0 / step if step > 0 else None, "h2d_per_step": per_step, "hit_rate": hit_rate,
            "slots_per_layer": median_of(g["slots_per_layer"]), "decode_mode": ", ".join(modes) or None,
            "decode_kernels": "; ".join(kernels) or None, "decode_misses": ", ".join(misses) or None,
            "cached_step_s": cached_step, "copy_s": copy,
            "other_s": step - expected if expected is not None else None, "expected_step_s": expected,
            "over_expected": step / expected if expected else None,
            "peak_device_bytes": max_of(g["peak_device_bytes"]), "added_device_bytes": max_of(g["added"]),
            "proc_gpu_mem_peak": max_of(g["proc_gpu_mem_peak"]),
        })
    out = pd.DataFrame(rows, columns=DECODE_COLUMNS)
    return sort_rows(out, record, ["arm", "kind", "target_tokens"])


TTFT_MEMORY_COLUMNS = ["arm", "kind", "target_tokens", "n", "ttft_s", "peak_bytes", "peak_source"]


def ttft_memory_table(record: RunRecord) -> pd.DataFrame:
    """The trade between speed and memory: per arm, kind and length, the median TTFT and the highest device
    memory any of those requests peaked at: the engine's own figure (torch's peak allocation) where it gave
    one, else NVML's peak for the service's processes during the request. Rows only with a memory figure."""
    df = measured_ok_frame(record)
    rows = []
    for (arm, kind, tokens), g in df.groupby(["arm", "kind", "target_tokens"], sort=False, dropna=False):
        engine_peak, nvml_peak = max_of(g["peak_device_bytes"]), max_of(g["proc_gpu_mem_peak"])
        peak, source = (engine_peak, "engine") if engine_peak is not None else (nvml_peak, "nvml")
        ttft = median_of(g["ttft_s"])
        if peak is None or ttft is None:
            continue
        rows.append({"arm": arm, "kind": kind, "target_tokens": int_or_none(tokens), "n": len(g), "ttft_s": ttft,
                     "peak_bytes": peak, "peak_source": source})
    out = pd.DataFrame(rows, columns=TTFT_MEMORY_COLUMNS)
    return sort_rows(out, record, ["arm", "kind", "target_tokens"])
