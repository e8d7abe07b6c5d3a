"""Machine-readable output: the JSON documents that ``--json`` prints (``gate``, ``compare``, ``profiles``,
``prompts``, ``sweep``) and the per-sample table of ``abbench export --csv``.

Every document is one JSON object on stdout whose ``schema`` names it and its version
(``abbench.gate/1``, ...); messages stay on stderr, and the exit code is the command's own. The fields are
documented in docs/json.md, which a test holds to these functions. Numbers are plain JSON numbers in the
units their names say (``*_s`` seconds, ``*_bytes`` bytes, ratios as fractions); a value that is unknown is
``null``, never NaN. A version changes only when a field is removed or changes meaning.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict
from typing import Any

import pandas as pd

from abbench.results import RunRecord

SCHEMAS = {"gate": "abbench.gate/1", "compare": "abbench.compare/1", "profiles": "abbench.profiles/1",
           "prompts": "abbench.prompts/1", "sweep": "abbench.sweep/1"}


def clean(v: Any) -> Any:
    """``v`` with numpy scalars as Python numbers and NaN/inf/NA as None, recursively."""
    if isinstance(v, dict):
        return {str(k): clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [clean(x) for x in v]
    if v is None or v is pd.NA or v is pd.NaT:
        return None
    if hasattr(v, "item") and not isinstance(v, (str, bytes)):  # numpy scalars
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def emit(doc: dict[str, Any]) -> None:
    """Print a document (and only it) on stdout."""
    sys.stdout.write(json.dumps(clean(doc), indent=2, ensure_ascii=False, allow_nan=False) + "\n")


def run_ref(record: RunRecord) -> dict[str, Any]:
    """What identifies a run in a document."""
    env = record.environment
    return {"run_id": record.run_id, "profile": record.profile.get("name"), "status": record.status,
            "created_at": record.created_at,
            "commit": env.get("engine_commit") or (env.get("git") or {}).get("commit")}


def gate_document(record: RunRecord, verdict: Any, problems: list[str], declared: list[str]) -> dict[str, Any]:
    """``abbench gate --json``: the verdict, every check, and the cells of every declared check."""
    from abbench.analysis.declared import bind, judge

    checks = bind(record, declared, "gate") if declared else []
    return {
        "schema": SCHEMAS["gate"], "run": run_ref(record), "passed": verdict.passed,
        "exit_code": 0 if verdict.passed else 1, "parity_tokens": verdict.parity_tokens,
        "checks": [{"name": c.name, "result": c.result, "passed": c.passed, "detail": c.detail}
                   for c in verdict.checks],
        "declared": [{"check": c.name, "metric": c.metric, "arm": c.arm,
                      "cells": [asdict(x) for x in judge(record, c)]} for c in checks],
        "failures": list(verdict.failures), "notes": list(verdict.notes), "problems": list(problems),
    }


def compare_document(c: Any) -> dict[str, Any]:
    """``abbench compare --json``: the verdict and one entry per (arm, kind, length, metric) cell."""
    cells = c.changes.to_dict(orient="records")
    return {
        "schema": SCHEMAS["compare"], "base": run_ref(c.base), "candidate": run_ref(c.cand),
        "threshold": c.threshold, "regressions": int(len(c.regressions)), "too_few_to_judge": int(len(c.too_few)),
        "arm_regressions": int(len(c.arm_regressions)), "judged": c.judged,
        "exit_code": c.exit_code, "cells": cells, "arms": c.arms.to_dict(orient="records"),
        "identical": list(c.identical),
        "environment_differences": list(c.env_diffs), "profile_differences": list(c.profile_diffs),
        "only_in_base": list(c.only_base), "only_in_candidate": list(c.only_cand), "notes": list(c.notes),
        "load": c.load.to_dict(orient="records") if c.load is not None else [],
    }


def profiles_document(dirs: list[tuple[str, Any]], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """``abbench profiles --json``: the folders searched, in order, and every profile found."""
    return {"schema": SCHEMAS["profiles"], "search": [{"source": s, "path": str(d)} for s, d in dirs],
            "profiles": rows}


def prompts_document(profile: Any, built: list[Any]) -> dict[str, Any]:
    """``abbench prompts --json``: every prompt the profile builds (no text: ``--show ID`` prints one)."""
    return {"schema": SCHEMAS["prompts"], "profile": profile.name, "tokenizer": profile.tokenizer.source,
            "total_tokens": sum(b.record.token_count for b in built),
            "prompts": [b.record.model_dump(mode="json") for b in built]}


def sweep_document(record: RunRecord) -> dict[str, Any]:
    """``abbench sweep --json``: the sweep's passes and, per arm pair, every point and the crossover."""
    from abbench.analysis.sweep import sweep_summary

    state = record.sweep or {}
    return {"schema": SCHEMAS["sweep"], "run": run_ref(record), **sweep_summary(record),
            "passes": state.get("passes") or [], "stopped": state.get("stopped")}


def samples_table(record: RunRecord) -> pd.DataFrame:
    """``abbench export --csv``: one row per sample (every sample: ``measured`` and ``ok`` say which count),
    the columns of :data:`abbench.analysis.SAMPLE_COLUMNS`, then ``tpot_s`` and the output ids (space-separated)."""
    from abbench.analysis import samples_frame

    df = samples_frame(record)
    tok = pd.to_numeric(df["completion_tokens"], errors="coerce")
    df["tpot_s"] = pd.to_numeric(df["decode_s"], errors="coerce") / (tok - 1).where(tok > 1)
    df["output_ids"] = [" ".join(map(str, s.output_ids)) for s in record.samples]
    df.insert(0, "run_id", record.run_id)
    return df
