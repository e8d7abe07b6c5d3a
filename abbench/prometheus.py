"""Prometheus scrapes: the engines' ``/metrics`` text flattened to numbers, and counter deltas.

Contract
--------
* :func:`parse_prometheus` flattens Prometheus text into ``name{label="v",...}`` keys (labels sorted,
  values escaped as in the exposition format) -> float, via ``prometheus_client`` (imported on first use).
  Text that is not the exposition format raises :class:`ValueError` naming the problem (strict, the
  default) or, with ``strict=False``, yields the samples of every line that parses on its own. Empty text
  gives ``{}``.
* :func:`metrics_delta` gives counter deltas between two scrapes (``after - before`` per key; a key only
  in ``after`` counts from 0, ``*_created`` timestamps are skipped).

Pure functions of text and dicts: no I/O, no state. The runner scrapes (``EngineClient.metrics_text``);
:func:`abbench.adapters.engine_counters` maps the result to the report's common keys.
"""

from __future__ import annotations

__all__ = ["metrics_delta", "parse_prometheus"]


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
