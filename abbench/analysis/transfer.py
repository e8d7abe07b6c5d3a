"""Transfer: host-to-device bytes (the engine's counters and NVML's PCIe estimate), the physical floor of a
fresh prompt's TTFT, and the engine's prefix-cache counters (from its responses and its Prometheus
counters around each request, read through :data:`abbench.prometheus.ENGINE_COUNTERS`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from abbench.analysis.frames import (
    arm_adapters,
    arm_parity_references,
    expected_paths,
    frame,
    int_or_none,
    max_of,
    measured_ok,
    measured_ok_frame,
    median_of,
    prompt_targets,
    sort_rows,
)
from abbench.prometheus import ENGINE_COUNTERS, common_counters, metrics_delta
from abbench.results import RunRecord


# --------------------------------------------------------------------------------------------- H2D


FLOOR_KINDS = ("fresh", "cold")
H2D_COLUMNS = ["arm", "kind", "target_tokens", "n", "h2d_bytes", "prefill_h2d_bytes", "decode_h2d_bytes",
               "bank_bytes", "expert_format", "banks", "nvml_bytes", "engine_over_nvml", "n_windows", "measured_h2d_gbps",
               "floor_s", "ttft_s", "ttft_over_floor", "copy_wait_s", "alloc_retries", "primed"]


def _primed(flags: pd.Series) -> str | None:
    """'k/n': k of the n requests that say whether their first layer was primed were; None when none says."""
    said = [bool(f) for f in flags if isinstance(f, (bool, np.bool_))]
    return f"{sum(said)}/{len(said)}" if said else None


PROBE_SPREAD_LIMIT = 3.0
"""The most the services' measured H2D bandwidths may differ within a run (max / min) for a copy floor to be
given. A GPU's PCIe link measures alike in every service (the 52 committed H100/H200 runs: within 1.46x); a
busy CPU host does not (its "H2D" is a memory copy timed beside other processes: 0.1 to 88 GB/s in
results/cpu-tiny-auto), and a floor divided by such a number is noise."""


def probe_spread(record: RunRecord) -> tuple[float, float] | None:
    """(min, max) of the measured H2D bandwidth (GB/s) over the run's measured ok samples, when they differ by
    more than :data:`PROBE_SPREAD_LIMIT` (the copy floors are then left out); None when they agree or none
    was measured."""
    df = measured_ok_frame(record)
    if df.empty or "measured_h2d_gbps" not in df:
        return None
    g = pd.to_numeric(df["measured_h2d_gbps"], errors="coerce")
    g = g[np.isfinite(g) & (g > 0)]
    if g.empty or g.max() <= PROBE_SPREAD_LIMIT * g.min():
        return None
    return float(g.min()), float(g.max())


def h2d_table(record: RunRecord) -> pd.DataFrame:
    """Per arm, kind and length (medians over measured ok samples): the engine's H2D bytes (whole request,
    and its prefill/decode split), the prefill bytes in banks (prefill_h2d / bank_bytes; the whole request's
    bytes when the engine gives no split), NVML's PCIe RX estimate and engine/NVML (median of per-sample
    ratios of the whole request's bytes), and the copy floor = n_windows x bank_bytes / measured H2D
    bandwidth (GB/s = 1e9 bytes/s; one bank per window), with the median TTFT over that floor. The floor is
    given only for prompts that start from an empty cache (kinds in :data:`FLOOR_KINDS`): a continuation
    served from the prefix cache may legitimately copy less. ``copy_wait_s``: the engine's GPU time spent
    waiting for streamed expert copies in prefill (the part of TTFT the copies did not hide);
    ``expert_format``: how the engine's host bank stores the experts (e.g. an FP8 bank), where it says;
    ``alloc_retries``: the most CUDA caching-allocator retries of one request (cache freed, cudaMalloc again:
    memory pressure that costs time); ``primed``: "k/n" requests whose first layer's copy had started as they
    arrived (the vendored engine's ``first_layer_primed``; their TTFT includes that copy, their bytes too), None
    where the engine does not say. Rows only where the engine or NVML gave numbers. No floor where the services'
    bandwidth probes disagree (:func:`probe_spread`)."""
    df = measured_ok_frame(record)
    unstable = probe_spread(record) is not None
    rows = []
    for (arm, kind, tokens), g in df.groupby(["arm", "kind", "target_tokens"], sort=False, dropna=False):
        if g["h2d_bytes"].isna().all() and g["nvml_pcie_rx_bytes"].isna().all():
            continue
        h2d, bank, nvml = g["h2d_bytes"], g["bank_bytes"], g["nvml_pcie_rx_bytes"]
        ratio = (h2d / nvml.where(nvml > 0)).dropna()
        windows = g["n_windows"].fillna(1.0).clip(lower=1.0)
        gbps = g["measured_h2d_gbps"]
        floor = (bank * windows / (gbps.where(gbps > 0) * 1e9)).dropna()
        if kind not in FLOOR_KINDS or unstable:
            floor = floor.iloc[0:0]
        prefill = g["prefill_h2d_bytes"].where(g["prefill_h2d_bytes"].notna(), h2d)
        med_h2d, med_bank = median_of(h2d), median_of(bank)
        floor_s, ttft = median_of(floor), median_of(g["ttft_s"])
        rows.append(
            {"arm": arm, "kind": kind, "target_tokens": int_or_none(tokens), "n": len(g), "h2d_bytes": med_h2d,
             "prefill_h2d_bytes": median_of(g["prefill_h2d_bytes"]),
             "decode_h2d_bytes": median_of(g["decode_h2d_bytes"]), "bank_bytes": med_bank,
             "expert_format": next((str(f) for f in g["expert_format"] if isinstance(f, str)), None),
             "banks": median_of((prefill / bank.where(bank > 0)).dropna()),
             "nvml_bytes": median_of(nvml), "engine_over_nvml": median_of(ratio),
             "n_windows": median_of(g["n_windows"]), "measured_h2d_gbps": median_of(gbps), "floor_s": floor_s,
             "ttft_s": ttft, "ttft_over_floor": ttft / floor_s if ttft and floor_s else None,
             "copy_wait_s": median_of(g["copy_wait_s"]), "alloc_retries": max_of(g["alloc_retries"]),
             "primed": _primed(g["first_layer_primed"])}
        )
    out = frame(rows, H2D_COLUMNS, ints=["target_tokens"])
    return sort_rows(out, record, ["arm", "kind", "target_tokens"])


def _resident_medians(g: pd.DataFrame, resident_arms: set[str]) -> dict[str, tuple[float, float | None]]:
    """Per resident arm in one (kind, length) cell: (median TTFT, median chunk length); arms without a TTFT
    are left out."""
    out: dict[str, tuple[float, float | None]] = {}
    for a, ga in g[g["arm"].isin(resident_arms)].groupby("arm", sort=False):
        t = median_of(ga["ttft_s"])
        if t is not None:
            out[a] = (t, median_of(ga["chunk_tokens"]))
    return out


def floor_table(record: RunRecord) -> pd.DataFrame:
    """The physical floor of a fresh prompt's TTFT, per kind and length (prompts that start from an empty
    cache): max(compute floor, copy floor) per arm, where the compute floor is the fastest median TTFT among the arms
    whose expected path is ``resident`` (nothing streamed; a profile may run resident arms at several chunk
    sizes, e.g. its own and one chunk as long as the prompt, and the fastest sets the floor:
    ``compute_floor_arm`` names it), except for an arm whose own ``parity_reference`` is a resident arm: that
    arm is its compute floor (the same arithmetic with every expert on the device, e.g. resident FP8 for a
    streamed FP8 arm, where another arithmetic may run faster or slower), and the copy floor is one bank over the measured H2D bandwidth (the arm's own
    bank where the arms' banks differ in size, e.g. an FP8 bank beside a bf16 one). Each
    arm's median TTFT over that floor says how close it gets (1.0 = at the floor). No copy floor where the
    services' bandwidth probes disagree (:func:`probe_spread`). Empty when the run has neither a resident arm
    nor engine bank/bandwidth numbers."""
    df = measured_ok_frame(record)
    if df.empty:
        return frame([], FLOOR_COLUMNS)
    unstable = probe_spread(record) is not None
    df = df[df["kind"].isin(FLOOR_KINDS)]
    resident_arms = {a for a, p in expected_paths(record).items() if p == "resident"}
    own = {a: r for a, r in arm_parity_references(record).items() if r in resident_arms}
    rows = []
    for (kind, tokens), g in df.groupby(["kind", "target_tokens"], sort=False, dropna=False):
        gbps = g["measured_h2d_gbps"]
        copy = (g["bank_bytes"] / (gbps.where(gbps > 0) * 1e9)).dropna()
        if unstable:
            copy = copy.iloc[0:0]
        # one copy floor per bank size: arms whose banks differ (an FP8 bank beside a bf16 one) each get their
        # own; arms with the same bank share the median over all their samples
        copy_by_bank = {bank: median_of(copy[g.loc[copy.index, "bank_bytes"] == bank])
                        for bank in g.loc[copy.index, "bank_bytes"].unique()}
        res = _resident_medians(g, resident_arms)
        fastest = min(res, key=lambda a: res[a][0]) if res else None
        if not copy_by_bank and fastest is None:
            continue
        for arm, ga in g.groupby("arm", sort=False):
            set_by = own[arm] if own.get(arm) in res else fastest
            compute_s = res[set_by][0] if set_by else None
            bank = median_of(ga["bank_bytes"])
            copy_s = copy_by_bank.get(bank) if len(copy_by_bank) > 1 else median_of(copy)
            known = [v for v in (copy_s, compute_s) if v is not None]
            if not known:
                continue
            floor_s = max(known)
            bound = "copy" if copy_s is not None and floor_s == copy_s else "compute"
            ttft = median_of(ga["ttft_s"])
            rows.append({"arm": arm, "kind": kind, "target_tokens": int_or_none(tokens), "n": len(ga),
                         "ttft_s": ttft, "compute_floor_s": compute_s, "compute_floor_arm": set_by,
                         "copy_floor_s": copy_s,
                         "floor_s": floor_s, "bound": bound,
                         "over_floor": ttft / floor_s if ttft and floor_s else None})
    out = frame(rows, FLOOR_COLUMNS, ints=["target_tokens"])
    return sort_rows(out, record, ["arm", "kind", "target_tokens"])


FLOOR_COLUMNS = ["arm", "kind", "target_tokens", "n", "ttft_s", "compute_floor_s", "compute_floor_arm",
                 "copy_floor_s", "floor_s", "bound", "over_floor"]


GAP_COLUMNS = ["arm", "kind", "target_tokens", "n", "ttft_s", "chunk_tokens", "resident_arm", "resident_ttft_s",
               "gap_s", "copy_wait_s", "rest_s", "rest_share"]


def gap_table(record: RunRecord) -> pd.DataFrame:
    """Where a streaming arm's time goes, for prompts that start from an empty cache: its median TTFT =
    the median TTFT of a resident arm at the same chunk length (the same kernels with every expert on the
    device: ``resident_arm``; the fastest resident arm when none ran at that length) + ``gap_s``, and the gap
    = the median copy wait (GPU time compute stalled on streamed experts: the copies not hidden) + ``rest_s``
    (everything else streaming cost: host work, allocator pressure, kernels slowed beside the copies);
    ``rest_share`` = rest / gap. An arm whose own ``parity_reference`` is a resident arm is set against that
    arm (the same arithmetic), as in ``floor_table``. Rows only for arms whose engine timed its copy waits (``copy_wait_s``) and
    kinds/lengths with a resident arm."""
    df = measured_ok_frame(record)
    if df.empty:
        return frame([], GAP_COLUMNS)
    df = df[df["kind"].isin(FLOOR_KINDS)]
    resident_arms = {a for a, p in expected_paths(record).items() if p == "resident"}
    own = arm_parity_references(record)
    rows = []
    for (kind, tokens), g in df.groupby(["kind", "target_tokens"], sort=False, dropna=False):
        res = _resident_medians(g, resident_arms)
        if not res:
            continue
        for arm, ga in g[~g["arm"].isin(resident_arms)].groupby("arm", sort=False):
            wait, ttft, chunk = median_of(ga["copy_wait_s"]), median_of(ga["ttft_s"]), median_of(ga["chunk_tokens"])
            if wait is None or ttft is None:
                continue
            same = [a for a, (_, c) in res.items() if chunk is not None and c == chunk]
            ref = own[arm] if own.get(arm) in res else min(same or res, key=lambda a: res[a][0])
            gap = ttft - res[ref][0]
            rest = gap - wait
            rows.append({"arm": arm, "kind": kind, "target_tokens": int_or_none(tokens), "n": len(ga),
                         "ttft_s": ttft, "chunk_tokens": int_or_none(chunk), "resident_arm": ref,
                         "resident_ttft_s": res[ref][0], "gap_s": gap, "copy_wait_s": wait, "rest_s": rest,
                         "rest_share": rest / gap if gap > 0 else None})
    out = frame(rows, GAP_COLUMNS, ints=["target_tokens", "chunk_tokens"])
    return sort_rows(out, record, ["arm", "kind", "target_tokens"])



ENGINE_COUNTER_COLUMNS = ["arm", "kind", "target_tokens", "n", "prompt_tokens", "engine_cached",
                          "metrics_prompt", "metrics_cached"]


def engine_counter_table(record: RunRecord) -> pd.DataFrame:
    """Per arm, kind and length (medians over measured ok samples): the prompt tokens the server counted
    (usage), the prompt tokens the engine says it served from its prefix cache (``engine.cached_prompt_tokens``
    of the response), and the same two read from its Prometheus counters around the request (the adapter's
    ``counters``: after - before). Rows only where the engine gave a cache or counter number."""
    adapters = arm_adapters(record)
    rows: list[dict[str, Any]] = []
    targets = prompt_targets(record)
    groups: dict[tuple[str, str, int | None], list[dict[str, Any]]] = {}
    for smp in sorted(measured_ok(record), key=lambda x: x.step):
        e = smp.engine or {}
        c = common_counters(ENGINE_COUNTERS.get(adapters.get(smp.arm, "openai"), {}), metrics_delta(smp.telemetry.metrics_before, smp.telemetry.metrics_after)
                            if smp.telemetry.metrics_after else None)
        groups.setdefault((smp.arm, smp.kind, targets.get(smp.prompt_id, smp.prompt_tokens)), []).append(
            {"prompt": e.get("engine_prompt_tokens", smp.prompt_tokens), "cached": e.get("cached_prompt_tokens"),
             "m_prompt": c.get("prompt_tokens"), "m_cached": c.get("cached_prompt_tokens")})
    for (arm, kind, tokens), g in groups.items():
        med = {k: median_of(x[k] for x in g) for k in ("prompt", "cached", "m_prompt", "m_cached")}
        if med["cached"] is None and med["m_prompt"] is None and med["m_cached"] is None:
            continue
        rows.append({"arm": arm, "kind": kind, "target_tokens": tokens, "n": len(g), "prompt_tokens": med["prompt"],
                     "engine_cached": med["cached"], "metrics_prompt": med["m_prompt"],
                     "metrics_cached": med["m_cached"]})
    out = frame(rows, ENGINE_COUNTER_COLUMNS, ints=["target_tokens"])
    return sort_rows(out, record, ["arm", "kind", "target_tokens"])
