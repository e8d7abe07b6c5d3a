"""Latency distributions as serving benchmarks report them: TTFT, TPOT and ITL percentiles per cell.

Definitions (those of ``vllm bench serve``, so numbers read the same):

* **TTFT**: the harness's time to first token (``Sample.ttft_s``).
* **TPOT** (time per output token), one value per request: (total - TTFT) / (output tokens - 1); requests of
  one output token have none. It is the inverse of the decode rate the other tables show.
* **ITL** (inter-token latency), one value per gap: the time between successive arrivals of output in one
  request's stream (``Sample.token_times_s``). Tokens that arrive in one network chunk share its arrival,
  and count as one arrival, as vLLM counts one ITL per chunk. Only streamed samples recorded with token
  times have ITLs (runs made before abbench recorded them have none: their ITL columns are empty).

Percentiles are numpy's (linear interpolation). A percentile is given only where n allows it: the q-th
needs at least 1 / (1 - q) values (10 for p90, 100 for p99), else it is None (the report shows a dash): a p99
of 20 samples is their maximum, not a 99th percentile. The median is given from one value up.

:func:`latency_table` is the report's table (measured ok samples, one row per arm, kind and length);
:func:`ttft_values`, :func:`tpot_values` and :func:`itl_values` give one row per value, for declared checks.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from abbench.analysis.frames import frame, int_or_none, measured_ok, measured_ok_frame, prompt_targets, sort_rows
from abbench.results import RunRecord, Sample

PERCENTILES = (50, 90, 99)
VALUE_COLUMNS = ["arm", "kind", "target_tokens", "round", "value"]
LATENCY_COLUMNS = (["arm", "kind", "target_tokens", "n"] + [f"ttft_p{p}_s" for p in PERCENTILES] + ["n_tpot"]
                   + [f"tpot_p{p}_s" for p in PERCENTILES] + ["n_itl"] + [f"itl_p{p}_s" for p in PERCENTILES])


def min_n(q: float) -> int:
    """The fewest values a ``q`` quantile is given for: 1 / (1 - q), rounded up (1 for the median)."""
    return 1 if q <= 0.5 else math.ceil(1 / (1 - q) - 1e-9)


def percentile(values: np.ndarray, p: float) -> float | None:
    """The ``p``-th percentile of ``values``, or None when there are too few of them (module docstring)."""
    if values.size == 0 or values.size < min_n(p / 100):
        return None
    return float(np.percentile(values, p))


def gaps(s: Sample) -> np.ndarray:
    """The sample's inter-token latencies: gaps between successive distinct arrivals of output (seconds)."""
    if not s.token_times_s or len(s.token_times_s) < 2:
        return np.empty(0)
    t = np.unique(np.asarray(s.token_times_s, dtype=float))  # sorted; one arrival per chunk
    return np.diff(t)


def _empty() -> pd.DataFrame:
    return pd.DataFrame(columns=VALUE_COLUMNS)


def ttft_values(record: RunRecord) -> pd.DataFrame:
    """One row per measured ok sample with a TTFT: arm, kind, target_tokens, round, value (seconds)."""
    df = measured_ok_frame(record)
    if df.empty:
        return _empty()
    df = df[df["ttft_s"].notna()]
    return pd.DataFrame({"arm": df["arm"], "kind": df["kind"], "target_tokens": df["target_tokens"],
                         "round": df["round"], "value": df["ttft_s"].astype(float)}).reset_index(drop=True)


def tpot_values(record: RunRecord) -> pd.DataFrame:
    """One row per measured ok sample of more than one output token: its TPOT (seconds)."""
    df = measured_ok_frame(record)
    if df.empty:
        return _empty()
    tok = pd.to_numeric(df["completion_tokens"], errors="coerce")
    tpot = pd.to_numeric(df["decode_s"], errors="coerce") / (tok - 1).where(tok > 1)
    keep = tpot.notna() & (tpot > 0)
    return pd.DataFrame({"arm": df["arm"], "kind": df["kind"], "target_tokens": df["target_tokens"],
                         "round": df["round"], "value": tpot})[keep].reset_index(drop=True)


def itl_values(record: RunRecord) -> pd.DataFrame:
    """One row per inter-token gap of every measured ok sample with token times (seconds)."""
    targets = prompt_targets(record)
    rows = [{"arm": s.arm, "kind": s.kind, "target_tokens": targets.get(s.prompt_id, s.prompt_tokens),
             "round": s.round, "value": float(g)} for s in measured_ok(record) for g in gaps(s)]
    return pd.DataFrame(rows, columns=VALUE_COLUMNS) if rows else _empty()


def _by_cell(df: pd.DataFrame) -> dict[tuple[str, str, int | None], np.ndarray]:
    return {(str(a), str(k), int_or_none(t)): g["value"].astype(float).to_numpy()
            for (a, k, t), g in df.groupby(["arm", "kind", "target_tokens"], sort=False, dropna=False)}


def latency_table(record: RunRecord) -> pd.DataFrame:
    """Per arm, kind and length: n and TTFT p50/p90/p99, n_tpot and TPOT p50/p90/p99, n_itl and ITL
    p50/p90/p99 (seconds; None where n does not allow the percentile)."""
    ttft, tpot, itl = _by_cell(ttft_values(record)), _by_cell(tpot_values(record)), _by_cell(itl_values(record))
    rows = []
    for key, t in ttft.items():
        row: dict[str, object] = {"arm": key[0], "kind": key[1], "target_tokens": key[2], "n": t.size}
        for name, vals in (("ttft", t), ("tpot", tpot.get(key, np.empty(0))), ("itl", itl.get(key, np.empty(0)))):
            if name != "ttft":
                row[f"n_{name}"] = vals.size
            for p in PERCENTILES:
                row[f"{name}_p{p}_s"] = percentile(vals, p)
        rows.append(row)
    out = frame(rows, LATENCY_COLUMNS, ints=["target_tokens"])
    return sort_rows(out, record, ["arm", "kind", "target_tokens"])
