"""Frames: the tables read straight from one :class:`~abbench.results.RunRecord`, and the helpers every
analysis module shares.

Contract
--------
Every function in :mod:`abbench.analysis` reads a ``RunRecord`` and returns pandas DataFrames or dataclasses:
no I/O, no printing, no network, no randomness beyond a fixed-seed bootstrap. Nothing computed is written
back into the run (derived metrics are never stored twice). Units: seconds (``*_s``), bytes (``*_bytes``),
ratios as plain floats; :mod:`abbench.report` formats them for humans.

Which samples count
-------------------
*Measured* samples are those the profile's pre-registered rule did not exclude (``Sample.excluded`` is
False); only measured samples with ``ok`` enter the statistics. When one planned step has several samples
(a retried request), the last ok one is used.

This module: the run's arms, reference and gate table; :func:`samples_frame` (one row per sample; the
engine's per-request object read through :class:`abbench.engine.stats.AbbenchStats`); :func:`memory_table`;
:func:`completeness` (planned measured steps against the samples).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
from pydantic import ValidationError

from abbench.engine.stats import AbbenchDecode, AbbenchStats
from abbench.errors import ResultsError
from abbench.profile import GateSpec
from abbench.results import RunRecord, Sample, Step

KIND_ORDER = {"fresh": 0, "cold": 1, "continuation": 2, "jit": 3, "warmup": 4}


# --------------------------------------------------------------------------------------------- basics


def arm_names(record: RunRecord) -> list[str]:
    """Arms in profile order, then any arm that only the plan or the samples name."""
    names: list[str] = []
    for a in record.profile.get("arms") or []:
        if isinstance(a, dict) and a.get("name") and a["name"] not in names:
            names.append(a["name"])
    for x in [*record.plan, *record.samples]:
        if x.arm not in names:
            names.append(x.arm)
    return names


def reference_arm(record: RunRecord) -> str | None:
    """``run.reference`` of the profile, else its first arm, else the first arm of the plan."""
    ref = (record.profile.get("run") or {}).get("reference")
    if ref:
        return str(ref)
    names = arm_names(record)
    return names[0] if names else None


def parity_reference_arm(record: RunRecord) -> str | None:
    """``gate.parity_reference`` of the profile (the arm parity compares with), else :func:`reference_arm`."""
    ref = (record.profile.get("gate") or {}).get("parity_reference")
    return str(ref) if ref else reference_arm(record)


def arm_parity_references(record: RunRecord) -> dict[str, str]:
    """The arms that name their own ``parity_reference`` (the arm their ids must equal): name -> that arm."""
    return {str(a["name"]): str(a["parity_reference"]) for a in record.profile.get("arms") or []
            if isinstance(a, dict) and a.get("parity_reference")}


def arm_tolerances(record: RunRecord) -> dict[str, float]:
    """The arms that set their own ``accept_near_ties``: name -> nats."""
    return {str(a["name"]): float(a["accept_near_ties"]) for a in record.profile.get("arms") or []
            if isinstance(a, dict) and a.get("accept_near_ties")}


def gate_spec(record: RunRecord) -> GateSpec:
    """The profile's ``gate`` table, with the schema's defaults filled in."""
    try:
        return GateSpec.model_validate(record.profile.get("gate") or {})
    except ValidationError as e:
        raise ResultsError(f"run {record.run_id}: the recorded profile's gate table is invalid: {e}") from None


def expected_paths(record: RunRecord) -> dict[str, str | None]:
    return {
        a["name"]: a.get("expect_path")
        for a in record.profile.get("arms") or []
        if isinstance(a, dict) and a.get("name")
    }


def arm_adapters(record: RunRecord) -> dict[str, str]:
    """Each arm's wire format: its own ``adapter``, else ``engine.adapter``, else 'openai'."""
    default = str((record.profile.get("engine") or {}).get("adapter") or "openai")
    out = {a["name"]: str(a.get("adapter") or default) for a in record.profile.get("arms") or []
           if isinstance(a, dict) and a.get("name")}
    for name in arm_names(record):
        out.setdefault(name, default)
    return out


def max_tokens(record: RunRecord) -> int | None:
    v = (record.profile.get("request") or {}).get("max_tokens")
    return int(v) if v else None


def prompt_targets(record: RunRecord) -> dict[str, int]:
    return {p.id: p.target_tokens for p in record.prompts}


def arm_rank(record: RunRecord) -> dict[str, int]:
    return {a: i for i, a in enumerate(arm_names(record))}


def sort_rows(df: pd.DataFrame, record: RunRecord, by: list[str]) -> pd.DataFrame:
    """Sort by arm in profile order, kind in a fixed order, then the other columns as they are."""
    if df.empty:
        return df.reset_index(drop=True)
    ranks = arm_rank(record)
    keys: dict[str, Any] = {}
    for col in by:
        if col in ("arm", "against_arm"):
            keys[col] = lambda s: s.map(lambda a: ranks.get(a, len(ranks)))
        elif col == "kind":
            keys[col] = lambda s: s.map(lambda k: KIND_ORDER.get(k, 9))
    return df.sort_values(by, key=lambda s: keys[s.name](s) if s.name in keys else s, kind="stable").reset_index(
        drop=True
    )


def frame(rows: list[dict[str, Any]], columns: list[str], ints: Iterable[str] = (), bools: Iterable[str] = ()) -> pd.DataFrame:
    df = pd.DataFrame(rows, columns=columns)
    for c in ints:
        df[c] = pd.array([None if is_missing(v) else int(v) for v in df[c]], dtype="Int64")
    for c in bools:
        df[c] = pd.array([None if is_missing(v) else bool(v) for v in df[c]], dtype="boolean")
    return df


def is_missing(v: Any) -> bool:
    if v is None or v is pd.NA:
        return True
    return isinstance(v, float) and math.isnan(v)


def is_value(v: Any, value: bool) -> bool:
    """``v`` is a known boolean equal to ``value`` (False for None/NA)."""
    return not is_missing(v) and bool(v) is value


def num(v: Any) -> float | None:
    if v is None or isinstance(v, bool):
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) else f


def median_of(values: Iterable[Any]) -> float | None:
    xs = [x for x in (num(v) for v in values) if x is not None]
    return float(np.median(xs)) if xs else None


def int_or_none(v: Any) -> int | None:
    f = num(v)
    return None if f is None else int(f)


def max_of(values: Iterable[Any]) -> float | None:
    xs = [x for x in (num(v) for v in values) if x is not None]
    return max(xs) if xs else None


def measured_ok(record: RunRecord) -> list[Sample]:
    """Measured ok samples, one per planned step (the last ok one when a step was retried)."""
    by_step: dict[tuple[int, str, int, str], Sample] = {}
    for s in record.samples:
        if s.ok and not s.excluded:
            by_step[(s.step, s.arm, s.round, s.prompt_id)] = s
    return list(by_step.values())


def where(s: Sample | Step) -> str:
    """'prompt P, arm A, round R (position N)' — how failures name a sample or step."""
    return f"prompt {s.prompt_id}, arm {s.arm}, round {s.round} (position {s.position})"


# ---------------------------------------------------------------------------------------- samples


SAMPLE_COLUMNS = [
    "step", "arm", "round", "position", "prompt_id", "kind", "target_tokens", "excluded", "measured",
    "service", "ok", "error_kind", "error", "started_at", "ttft_s", "total_s", "decode_s", "decode_tok_s",
    "prompt_tokens", "completion_tokens", "n_output_ids", "ids_source", "finish_reason", "has_logprobs",
    "prefill_path", "fallback_reason", "n_chunks", "n_windows", "cached_prompt_tokens", "h2d_bytes",
    "prefill_h2d_bytes", "decode_h2d_bytes", "d2d_bytes", "bank_bytes", "expert_format", "expert_copies",
    "measured_h2d_gbps", "engine_ttft_s", "engine_prefill_s", "queue_wait_s", "client_overhead_s", "after_write_s", "nvml_pcie_rx_bytes",
    "gpu_mem_used_peak", "proc_gpu_mem_peak", "host_rss_peak", "slot_hits", "slot_misses", "decode_steps_whole",
    "decode_steps_per_layer", "decode_mode", "decode_kernels", "decode_misses", "slots_per_layer",
    "peak_device_bytes",
    "start_device_bytes", "copy_wait_s", "first_layer_primed",
    "chunk_tokens", "alloc_retries", "host_cpu_busy", "host_cpu_steal", "service_cpu_s",
]


def samples_frame(record: RunRecord) -> pd.DataFrame:
    """One row per sample (all of them: ``measured`` says which count). Derived columns:
    ``decode_s`` = total - TTFT; ``decode_tok_s`` = (completion_tokens - 1) / decode_s; ``engine_ttft_s`` =
    the engine's first_token - received; ``client_overhead_s`` = harness TTFT - engine_ttft_s."""
    return sample_frame(record, record.samples)


_FRAMES: contextvars.ContextVar[dict | None] = contextvars.ContextVar("abbench_sample_frames", default=None)


@contextlib.contextmanager
def frames_cached() -> Iterator[None]:
    """Inside it, :func:`sample_frame` builds each (record, samples) frame once and hands out copies: one
    analysis or gate computes a dozen tables from the same samples, and building the frame (a pydantic read of
    every sample's engine stats) was most of their time. Only for code that does not change the record
    meanwhile (:func:`abbench.analysis.summary.analyze`, :func:`abbench.analysis.checks.gate`)."""
    token = _FRAMES.set({})
    try:
        yield
    finally:
        _FRAMES.reset(token)


def sample_frame(record: RunRecord, samples: list[Sample]) -> pd.DataFrame:
    cache = _FRAMES.get()
    if cache is None:
        return _sample_frame(record, samples)
    key = (id(record), tuple(id(s) for s in samples))
    if key not in cache:
        cache[key] = _sample_frame(record, samples)
    return cache[key].copy()


def _sample_frame(record: RunRecord, samples: list[Sample]) -> pd.DataFrame:
    targets = prompt_targets(record)
    rows = []
    for s in samples:
        e = AbbenchStats.read(s.engine)
        d = e.decode or AbbenchDecode()
        decode_s = s.total_s - s.ttft_s if s.total_s is not None and s.ttft_s is not None else None
        tok_s = sample_decode_tok_s(s)
        eng_ttft = num(e.engine_ttft_s)
        first_event = num(e.timings.first_event)
        rows.append(
            {
                "step": s.step, "arm": s.arm, "round": s.round, "position": s.position,
                "prompt_id": s.prompt_id, "kind": s.kind,
                "target_tokens": targets.get(s.prompt_id, s.prompt_tokens),
                "excluded": s.excluded, "measured": not s.excluded, "service": s.service, "ok": s.ok,
                "error_kind": s.error_kind, "error": s.error, "started_at": s.started_at,
                "ttft_s": s.ttft_s, "total_s": s.total_s, "decode_s": decode_s, "decode_tok_s": tok_s,
                "prompt_tokens": s.prompt_tokens, "completion_tokens": s.completion_tokens,
                "n_output_ids": len(s.output_ids), "ids_source": s.ids_source,
                "finish_reason": s.finish_reason, "has_logprobs": bool(s.logprobs),
                "prefill_path": e.prefill_path, "fallback_reason": e.fallback_reason,
                "n_chunks": num(e.n_chunks), "n_windows": num(e.n_windows),
                "cached_prompt_tokens": num(e.cached_prompt_tokens),
                "h2d_bytes": num(e.h2d_bytes), "prefill_h2d_bytes": num(e.prefill_h2d_bytes),
                "decode_h2d_bytes": num(e.decode_h2d_bytes), "d2d_bytes": num(e.d2d_bytes),
                "bank_bytes": num(e.bank_bytes), "expert_format": e.expert_format,
                "expert_copies": num(e.expert_copies),
                "measured_h2d_gbps": num(e.measured_h2d_gbps),
                "engine_ttft_s": eng_ttft,
                "engine_prefill_s": num(e.prefill_s),
                "queue_wait_s": num(e.queue_wait_s),
                "client_overhead_s": s.ttft_s - eng_ttft if s.ttft_s is not None and eng_ttft is not None else None,
                "after_write_s": s.ttft_s - first_event if s.ttft_s is not None and first_event is not None else None,
                "nvml_pcie_rx_bytes": s.telemetry.nvml_pcie_rx_bytes,
                "gpu_mem_used_peak": s.telemetry.gpu_mem_used_peak,
                "proc_gpu_mem_peak": s.telemetry.proc_gpu_mem_peak,
                "host_rss_peak": s.telemetry.host_rss_peak,
                "host_cpu_busy": s.telemetry.host_cpu_busy, "host_cpu_steal": s.telemetry.host_cpu_steal,
                "service_cpu_s": s.telemetry.service_cpu_s,
                "slot_hits": num(d.slot_hits), "slot_misses": num(d.slot_misses),
                "decode_steps_whole": num(d.steps_whole), "decode_steps_per_layer": num(d.steps_per_layer),
                "decode_mode": d.mode, "decode_kernels": d.kernels, "decode_misses": d.misses,
                "slots_per_layer": num(d.slots_per_layer),
                "peak_device_bytes": num(e.peak_device_bytes), "start_device_bytes": num(e.start_device_bytes),
                "copy_wait_s": num(e.copy_wait_s),
                "first_layer_primed": e.first_layer_primed,
                "chunk_tokens": num(e.chunk_tokens), "alloc_retries": num(e.alloc_retries),
            }
        )
    df = pd.DataFrame(rows, columns=SAMPLE_COLUMNS)
    return sort_rows(df, record, ["step"])


def measured_ok_frame(record: RunRecord) -> pd.DataFrame:
    return sample_frame(record, measured_ok(record))


def peak_bytes(df: pd.DataFrame) -> pd.Series:
    """Each sample's peak device memory: the engine's own figure (``peak_device_bytes``), else NVML's peak
    for the service's processes during the request."""
    peak = df["peak_device_bytes"].where(df["peak_device_bytes"].notna(), df["proc_gpu_mem_peak"])
    return pd.to_numeric(peak, errors="coerce")


def sample_decode_tok_s(s: Sample) -> float | None:
    """One sample's decode rate after the first token: (completion_tokens - 1) / (total - TTFT); None when
    it decoded fewer than two tokens or took no time."""
    if s.total_s is None or s.ttft_s is None or not s.completion_tokens or s.completion_tokens < 2:
        return None
    decode_s = s.total_s - s.ttft_s
    return (s.completion_tokens - 1) / decode_s if decode_s > 0 else None


def sample_prefill_h2d_bytes(s: Sample) -> float | None:
    """The engine's prefill host-to-device bytes of one sample (the whole request's when it gives no split)."""
    st = AbbenchStats.read(s.engine)
    b = st.prefill_h2d_bytes if st.prefill_h2d_bytes is not None else st.h2d_bytes
    return float(b) if b is not None else None


def sample_peak_bytes(s: Sample) -> float | None:
    """:func:`peak_bytes` of one sample."""
    peak = AbbenchStats.read(s.engine).peak_device_bytes
    return float(peak) if peak is not None else num(s.telemetry.proc_gpu_mem_peak)


# ------------------------------------------------------------------------------------------ memory


MEMORY_COLUMNS = ["arms", "services", "n_points", "gpu_mem_used_peak", "proc_gpu_mem_peak", "host_rss_peak"]


def service_arms(record: RunRecord) -> dict[str, list[str]]:
    """Arms served by each service key (from the service records, else the plan and samples)."""
    out: dict[str, list[str]] = {s.key: list(s.arms) for s in record.services}
    for x in [*record.plan, *record.samples]:
        arms = out.setdefault(x.service, [])
        if x.arm not in arms and not any(s.key == x.service for s in record.services):
            arms.append(x.arm)
    ranks = arm_rank(record)
    return {k: sorted(v, key=lambda a: ranks.get(a, len(ranks))) for k, v in out.items()}


def memory_table(record: RunRecord) -> pd.DataFrame:
    """Peak memory (bytes) per arm — or per set of arms sharing a service — over the background samples
    (RunRecord.memory) and the per-request peaks (Sample.telemetry): whole-GPU used, the service's
    processes on the GPU, host RSS of the service's process tree."""
    by_service = service_arms(record)
    peaks: dict[str, dict[str, list[Any]]] = {}
    points: dict[str, int] = {}
    services: dict[str, set[str]] = {}

    def label(service: str) -> str:
        return ", ".join(by_service.get(service) or [service])

    for m in record.memory:
        lab = label(m.service)
        d = peaks.setdefault(lab, {"gpu": [], "proc": [], "rss": []})
        d["gpu"].append(m.gpu_mem_used)
        d["proc"].append(m.proc_gpu_mem)
        d["rss"].append(m.host_rss)
        points[lab] = points.get(lab, 0) + 1
        services.setdefault(lab, set()).add(m.service)
    for s in record.samples:
        lab = label(s.service)
        d = peaks.setdefault(lab, {"gpu": [], "proc": [], "rss": []})
        d["gpu"].append(s.telemetry.gpu_mem_used_peak)
        d["proc"].append(s.telemetry.proc_gpu_mem_peak)
        d["rss"].append(s.telemetry.host_rss_peak)
        services.setdefault(lab, set()).add(s.service)
    rows = []
    for lab, d in peaks.items():
        gpu, proc, rss = max_of(d["gpu"]), max_of(d["proc"]), max_of(d["rss"])
        if gpu is None and proc is None and rss is None:
            continue
        rows.append({"arms": lab, "services": len(services.get(lab, ())), "n_points": points.get(lab, 0),
                     "gpu_mem_used_peak": gpu, "proc_gpu_mem_peak": proc, "host_rss_peak": rss})
    out = frame(rows, MEMORY_COLUMNS, ints=["gpu_mem_used_peak", "proc_gpu_mem_peak", "host_rss_peak"])
    ranks = arm_rank(record)
    if not out.empty:
        order = out["arms"].map(lambda a: ranks.get(a.split(", ")[0], len(ranks)))
        out = out.iloc[np.argsort(order.to_numpy(), kind="stable")].reset_index(drop=True)
    return out


# ------------------------------------------------------------------------------------ completeness


@dataclass(frozen=True)
class Completeness:
    """Planned measured steps against what the run holds."""

    status: str
    status_reason: str | None
    planned: int
    """Measured (not excluded) steps in the plan."""
    present: int
    """...of which have at least one sample."""
    ok: int
    """...of which have an ok sample."""
    missing: list[Step]
    """Measured planned steps with no sample at all."""
    failed: list[Sample]
    """The last failed sample of each measured planned step that has samples but none ok."""
    unplanned: list[Sample]
    """Samples whose step index is not in the plan (a plan/sample mismatch)."""
    excluded_planned: int
    excluded_ok: int

    @property
    def has_plan(self) -> bool:
        return self.planned > 0 or self.excluded_planned > 0


def completeness(record: RunRecord) -> Completeness:
    plan = {st.index: st for st in record.plan}
    by_step: dict[int, list[Sample]] = {}
    unplanned = []
    for s in sorted(record.samples, key=lambda x: x.step):
        if s.step in plan and plan[s.step].arm == s.arm and plan[s.step].prompt_id == s.prompt_id:
            by_step.setdefault(s.step, []).append(s)
        else:
            unplanned.append(s)
    measured = [st for st in record.plan if not st.excluded]
    excluded = [st for st in record.plan if st.excluded]
    missing = [st for st in measured if st.index not in by_step]
    failed = [by_step[st.index][-1] for st in measured
              if st.index in by_step and not any(s.ok for s in by_step[st.index])]
    ok = sum(1 for st in measured if any(s.ok for s in by_step.get(st.index, [])))
    return Completeness(
        status=record.status, status_reason=record.status_reason, planned=len(measured),
        present=len(measured) - len(missing), ok=ok, missing=missing, failed=failed, unplanned=unplanned,
        excluded_planned=len(excluded),
        excluded_ok=sum(1 for st in excluded if any(s.ok for s in by_step.get(st.index, []))),
    )
