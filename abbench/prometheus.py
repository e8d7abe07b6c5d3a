"""Prometheus scrapes: the engines' ``/metrics`` text flattened to numbers, and counter deltas.

Contract
--------
* :func:`parse_prometheus` flattens Prometheus text into ``name{label="v",...}`` keys (labels sorted,
  values escaped as in the exposition format) -> float, via ``prometheus_client`` (imported on first use).
  Text that is not the exposition format raises :class:`ValueError` naming the problem (strict, the
  default) or, with ``strict=False``, yields the samples of every line that parses on its own. Empty text
  gives ``{}``. Samples whose value is not finite (``NaN``, ``+Inf``: legal in the format, e.g. a gauge
  an engine did not measure) are left out: a run record holds JSON numbers only.
* :func:`metrics_delta` gives counter deltas between two scrapes (``after - before`` per key; a key only
  in ``after`` counts from 0, ``*_created`` timestamps are skipped).

* :data:`ENGINE_COUNTERS` names, per adapter, the engine's counters behind the report's common keys
  (``prompt_tokens``, ``cached_prompt_tokens``, ...); :func:`common_counters` reads them from a parsed
  scrape or a delta. The adapters (:mod:`abbench.adapters`) and the analysis share this table, so the
  analysis reads recorded scrapes without importing the wire formats.

Pure functions of text and dicts: no I/O, no state. The runner scrapes (``EngineClient.metrics_text``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType

__all__ = ["ENGINE_COUNTERS", "common_counters", "metrics_delta", "parse_prometheus"]

Counters = Mapping[str, tuple[str, ...]]
"""Common key -> the engine's metric names for it, first present wins."""

ENGINE_COUNTERS: Mapping[str, Counters] = MappingProxyType({
    "openai": MappingProxyType({
        "prompt_tokens": ("abbench_engine_prompt_tokens_total",),
        "cached_prompt_tokens": ("abbench_engine_cached_prompt_tokens_total",),
    }),
    "vllm": MappingProxyType({
        "prompt_tokens": ("vllm:prompt_tokens_total",),
        "cached_prompt_tokens": ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
        "prefix_cache_queries": ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
    }),
    "sglang": MappingProxyType({
        "prompt_tokens": ("sglang:prompt_tokens_total",),
        "cached_prompt_tokens": ("sglang:cached_tokens_total",),
    }),
    "llamacpp": MappingProxyType({
        "prompt_tokens": ("llamacpp:prompt_tokens_total",),
    }),
})


def common_counters(counters: Counters, metrics: Mapping[str, float] | None) -> dict[str, float]:
    """``counters`` (an entry of :data:`ENGINE_COUNTERS`) read from parsed Prometheus text (or a
    :func:`metrics_delta`): each key's value is the sum over the label sets of the first of its metric names
    that is present; keys the engine does not expose are left out."""
    out: dict[str, float] = {}
    if not metrics:
        return out
    for key, names in counters.items():
        for name in names:
            values = [v for k, v in metrics.items() if k == name or k.startswith(name + "{")]
            if values:
                out[key] = float(sum(values))
                break
    return out


def _escape_label(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _sample_key(name: str, labels: dict[str, str]) -> str:
    if not labels:
        return name
    inner = ",".join(f'{k}="{_escape_label(str(labels[k]))}"' for k in sorted(labels))
    return f"{name}{{{inner}}}"


def parse_prometheus(text: str, *, strict: bool = True) -> dict[str, float]:
    """Flatten Prometheus text exposition into ``{'name{a="x",b="y"}': value}`` (labels sorted).

    ``strict=True`` (default): text that does not parse raises ValueError ("not Prometheus text: ...");
    the caller decides (the runner records the scrape as missing). ``strict=False``: lines that do not
    parse are skipped and the rest is returned. Empty text gives {}."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    try:
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if math.isfinite(float(s.value)):
                    out[_sample_key(s.name, s.labels)] = float(s.value)
        return out
    except Exception as e:  # noqa: BLE001 - the parser raises ValueError, IndexError, ...
        if strict:
            first = next((ln for ln in text.splitlines() if ln.strip() and not ln.startswith("#")), "")
            raise ValueError(
                f"not Prometheus text exposition format ({type(e).__name__}: {e}); "
                f"first sample line: {first[:120]!r}"
            ) from None
    out = {}
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            for fam in text_string_to_metric_families(line + "\n"):
                for s in fam.samples:
                    if math.isfinite(float(s.value)):
                        out[_sample_key(s.name, s.labels)] = float(s.value)
        except Exception:  # noqa: BLE001
            continue
    return out


def metrics_delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float]:
    """``after - before`` per key, for counters. A key only in ``after`` counts from 0 (prometheus_client
    creates labelled counters on first use); keys only in ``before`` are dropped; ``*_created`` keys
    (timestamps) are skipped. A negative delta means the counter reset (the service restarted). Deltas
    of gauges are returned too but mean little; pick the counters you need."""
    if after is None:
        return {}
    before = before or {}
    out: dict[str, float] = {}
    for k, v in after.items():
        name = k.split("{", 1)[0]
        if name.endswith("_created"):
            continue
        out[k] = v - before.get(k, 0.0)
    return out
