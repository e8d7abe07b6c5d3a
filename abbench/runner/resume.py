"""Resume checks: a partial run continues only with the same prompts, the same plan and the same key
environment fields (:data:`abbench.fingerprint.KEY_FIELDS`); each resume is listed in
``environment["resumed"]``.
"""

from __future__ import annotations

import time
from pathlib import Path

from abbench.errors import ResultsError
from abbench.fingerprint import KEY_FIELDS, key_value
from abbench.results import PromptRecord, RunRecord, Step


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
