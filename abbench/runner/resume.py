"""Resume checks: a partial run continues only with the same prompts, the same plan and the same key
environment fields (:data:`abbench.fingerprint.KEY_FIELDS`); each resume is listed in
``environment["resumed"]``.

A resume runs again the steps whose sample failed (a server that died once, an arm skipped because its
service could not start), unless told to keep them: :func:`drop_failed` takes the failed samples out of the
record, and :func:`rewrite_log` out of ``requests.jsonl`` (every other line stays byte for byte), and the
resume's entry lists what it retried (``retried``: step, arm, prompt, error kind and error of each).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from abbench.errors import ResultsError
from abbench.fingerprint import KEY_FIELDS, key_value
from abbench.results import SAMPLES_FILE, PromptRecord, RunRecord, Step


def environment_notes(run_dir: Path, old: dict, new: dict) -> list[str]:
    """Key fingerprint fields that differ between the run and this process. A difference only in the
    local-changes hash of the checkout (``engine_commit`` ``+dirty.<hash>``) is returned as a note
    (prefixed ``note:``); any other difference refuses the resume."""
    notes: list[str] = []
    for field in KEY_FIELDS:
        a, b = key_value(old, field), key_value(new, field)
        if a == b:
            continue
        if field == "engine_commit" and isinstance(a, str) and isinstance(b, str) \
                and a.split("+dirty")[0] == b.split("+dirty")[0]:
            notes.append(f"note: engine_commit {a} -> {b} (same commit, other local changes)")
            continue
        raise ResultsError(
            f"{run_dir}: cannot resume: {field} was {a!r} when the run started and is {b!r} now; samples "
            "from two environments would be mixed in one run. Start a new run instead"
        )
    return notes


def check_resumable(run_dir: Path, existing: RunRecord, prompts: list[PromptRecord], plan: list[Step],
                    env: dict) -> list[str]:
    """Refuse (:class:`ResultsError`) when the prompts, the plan or a key environment field differ from the
    run's; return the notes of tolerated differences."""
    old = {p.id: p.sha256 for p in existing.prompts}
    new = {p.id: p.sha256 for p in prompts}
    if old != new:
        raise ResultsError(f"{run_dir}: the prompts rebuilt now differ from the run's (tokenizer or "
                           "corpus changed); cannot resume")
    if [s.model_dump() for s in existing.plan] != [s.model_dump() for s in plan]:
        raise ResultsError(f"{run_dir}: the plan rebuilt now differs from the run's; cannot resume")
    return environment_notes(run_dir, existing.environment, env)


def mark_resumed(record: RunRecord, env: dict, argv: list[str] | None, notes: list[str]) -> None:
    """Append this resume to ``environment["resumed"]`` and set the run running again."""
    record.environment.setdefault("resumed", []).append({
        "at": time.time(), "argv": argv or [], "after_samples": len(record.samples),
        "previous_status": record.status, "previous_reason": record.status_reason,
        "engine_commit": env.get("engine_commit"), "notes": notes,
    })
    record.status = "running"
    record.status_reason = None


def drop_failed(record: RunRecord) -> list[dict[str, Any]]:
    """Take the failed samples out of ``record`` (their steps are run again) and note them in its last resume
    entry (``retried``); returns the notes."""
    failed = [s for s in record.samples if not s.ok]
    if not failed:
        return []
    record.samples = [s for s in record.samples if s.ok]
    notes = [{"step": s.step, "arm": s.arm, "prompt_id": s.prompt_id, "error_kind": s.error_kind, "error": s.error}
             for s in failed]
    resumed = record.environment.get("resumed") or [{}]
    resumed[-1]["retried"] = notes
    return notes


def rewrite_log(run_dir: Path, steps: set[int]) -> None:
    """Remove the failed samples of ``steps`` from ``requests.jsonl`` (written whole to a new file, then
    renamed over it: a crash leaves the old file or the new one). Every other line stays byte for byte."""
    path = run_dir / SAMPLES_FILE
    if not path.exists():
        return
    kept: list[bytes] = []
    for line in path.read_bytes().splitlines(keepends=True):
        try:
            raw = json.loads(line)
        except ValueError:
            raw = None
        if isinstance(raw, dict) and raw.get("ok") is False and raw.get("step") in steps:
            continue
        kept.append(line)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(b"".join(kept))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
