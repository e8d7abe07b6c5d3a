"""Active path: the prefill path each measured request reported against the arm's ``expect_path``
(active, fallback with the engine's reason, silent fallback, unreported), and a summary per arm.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pandas as pd

from abbench.analysis.frames import (
    arm_names,
    expected_paths,
    frame,
    gate_spec,
    is_missing,
    measured_ok,
    num,
    prompt_targets,
    sort_rows,
)
from abbench.engine.stats import AbbenchStats
from abbench.results import RunRecord


# ------------------------------------------------------------------------------------- active path


PATH_COLUMNS = ["arm", "prompt_id", "kind", "target_tokens", "round", "position", "step", "expect_path",
                "prefill_path", "fallback_reason", "n_chunks", "eligible", "status", "allowed"]


def active_path_samples(record: RunRecord) -> pd.DataFrame:
    """Per measured ok sample: the expected and the reported prefill path, and a ``status``:
    'active' (as expected), 'fallback' (another path, with the engine's reason), 'silent' (another path,
    no reason), 'unreported' (the engine reported no path), 'no expectation' (the arm sets none).
    ``eligible`` is False for a one-chunk prompt (engine n_chunks <= 1), True for more, NA when unknown.
    ``allowed`` is the gate's judgement of the sample alone (see the module docstring; the gate also needs
    each arm with expect_path to show its path at least once)."""
    expect = expected_paths(record)
    allow = set(gate_spec(record).allow_fallback)
    targets = prompt_targets(record)
    rows = []
    for s in sorted(measured_ok(record), key=lambda x: x.step):
        e = AbbenchStats.read(s.engine)
        exp, got, reason = expect.get(s.arm), e.prefill_path, e.fallback_reason
        n_chunks = num(e.n_chunks)
        if exp is None:
            status = "no expectation"
        elif got is None:
            status = "unreported"
        elif got == exp:
            status = "active"
        elif reason:
            status = "fallback"
        else:
            status = "silent"
        eligible = None if n_chunks is None else n_chunks > 1
        allowed = status in ("active", "no expectation") or (
            status == "fallback" and (s.arm in allow or eligible is False)
        )
        rows.append(
            {"arm": s.arm, "prompt_id": s.prompt_id, "kind": s.kind,
             "target_tokens": targets.get(s.prompt_id, s.prompt_tokens), "round": s.round,
             "position": s.position, "step": s.step, "expect_path": exp, "prefill_path": got,
             "fallback_reason": reason, "n_chunks": n_chunks,
             "eligible": eligible, "status": status, "allowed": allowed}
        )
    out = frame(rows, PATH_COLUMNS, ints=["target_tokens", "n_chunks"], bools=["eligible", "allowed"])
    return sort_rows(out, record, ["arm", "step"])


def _counts(values: Iterable[Any], none_label: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        key = none_label if is_missing(v) else str(v)
        out[key] = out.get(key, 0) + 1
    return out


PATH_SUMMARY_COLUMNS = ["arm", "expect_path", "n", "paths", "fallback_reasons", "active", "fallback",
                        "fallback_ineligible", "silent", "unreported", "allow_fallback", "passed"]


def active_path_summary(record: RunRecord, samples: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per arm: expected path, counts of reported paths (``paths``: dict) and fallback reasons, and how
    many samples were active / fell back (with a reason; of which on ineligible one-chunk prompts) /
    silently differed / reported nothing; ``passed`` is the gate's judgement of the arm."""
    if samples is None:
        samples = active_path_samples(record)
    allow = set(gate_spec(record).allow_fallback)
    expect = expected_paths(record)
    rows = []
    for arm in arm_names(record):
        g = samples[samples["arm"] == arm]
        if g.empty:
            continue
        st = g["status"]
        fb = g[st == "fallback"]
        rows.append(
            {"arm": arm, "expect_path": expect.get(arm), "n": len(g),
             "paths": _counts(g["prefill_path"], "(not reported)"),
             "fallback_reasons": _counts(g["fallback_reason"].dropna(), ""),
             "active": int((st == "active").sum()), "fallback": len(fb),
             "fallback_ineligible": int((fb["eligible"] == False).sum()),
             "silent": int((st == "silent").sum()), "unreported": int((st == "unreported").sum()),
             "allow_fallback": arm in allow,
             "passed": bool(g["allowed"].all()) and (expect.get(arm) is None or bool((st == "active").any()))}
        )
    return frame(rows, PATH_SUMMARY_COLUMNS)


# ------------------------------------------------------------------------------------- attention batching


BATCHING_COLUMNS = ["arm", "kind", "target_tokens", "n", "attention_batch", "batched", "fallbacks"]


def _whole(x: float) -> float | int:
    """A median of counts: an int when it is whole (two samples can give a half)."""
    return int(x) if float(x).is_integer() else float(x)


def attention_batching_table(record: RunRecord) -> pd.DataFrame:
    """Per (arm, kind, prompt length) over measured ok samples whose engine asked for more than one chunk per
    attention call (the vendored engine's ``attention_batch``): the chunks per call, the median number of groups
    that ran as one call, and the median count of groups that fell back, by reason. Empty when no sample did."""
    targets = prompt_targets(record)
    rows = []
    for s in measured_ok(record):
        e = AbbenchStats.read(s.engine)
        k = num(e.attention_batch)
        if k is None or k <= 1:
            continue
        rows.append({"arm": s.arm, "kind": s.kind, "target_tokens": targets.get(s.prompt_id, s.prompt_tokens),
                     "attention_batch": int(k), "batched": num(e.attention_batched),
                     "fallbacks": dict(e.attention_fallbacks or {})})
    if not rows:
        return pd.DataFrame(columns=BATCHING_COLUMNS)
    df = pd.DataFrame(rows)
    out = []
    for (arm, kind, tokens), g in df.groupby(["arm", "kind", "target_tokens"], sort=False):
        reasons = sorted({r for d in g["fallbacks"] for r in d})
        out.append({"arm": arm, "kind": kind, "target_tokens": tokens, "n": len(g),
                    "attention_batch": int(g["attention_batch"].max()),
                    "batched": _whole(pd.to_numeric(g["batched"]).median()),
                    "fallbacks": {r: _whole(pd.Series([d.get(r, 0) for d in g["fallbacks"]]).median())
                                  for r in reasons}})
    return sort_rows(pd.DataFrame(out, columns=BATCHING_COLUMNS), record, ["arm", "kind", "target_tokens"])
