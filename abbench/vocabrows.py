"""Whole next-token distributions of a run: kept aside while it runs, turned into whole-vocabulary KLs at its end.

With ``request.full_logprobs = true`` every request asks the engine (the vendored engine or the transformers
reference) for its first output position's log-probabilities over the whole vocabulary: the ``abbench`` object's
``full_logprobs``, base64 float32 little-endian. A row is about 4 bytes a vocabulary entry (608 KB for the Qwen
vocabularies), too much for ``requests.jsonl``. So the runner takes it out of the sample (:func:`take_row`) and
writes it to ``rows/<step>.npy`` beside the record (a measured ok sample's alone). When the run stops it records,
for every pair of a sample and a sample of the parity reference on the same prompt (every round of each), the KL
of the two rows over the whole vocabulary (:func:`vocab_kls`, ``RunRecord.vocab_kl``); a complete run then drops
the rows (:func:`drop_rows`), a partial one keeps them for its resume.

The numerics verdict's ``kl_mean`` is a lower bound from the top-k lists both sides return; at the first output
position ``kl_vocab_mean`` is the KL itself (:mod:`abbench.analysis.numerics`).
"""

from __future__ import annotations

import base64
import math
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from abbench.results import RunRecord, Sample, VocabKL

ROWS_DIR = "rows"
FIELD = "full_logprobs"
"""The ``abbench`` object's field (and the request field that asks for it)."""


def decode_row(b64: str) -> np.ndarray:
    """An ``abbench.full_logprobs`` value as a float64 array of log-probabilities."""
    return np.frombuffer(base64.b64decode(b64), dtype="<f4").astype(np.float64)


def vocab_kl(ref: np.ndarray, arm: np.ndarray) -> float:
    """KL(reference || arm) in nats over the whole vocabulary, in float64, from two log-probability rows: +inf
    where the arm gives no probability to an id the reference does; ValueError when the vocabularies differ."""
    if ref.shape != arm.shape:
        raise ValueError(f"the two sides' vocabularies differ ({ref.size} and {arm.size} entries): no KL")
    p = np.exp(ref)
    live = p > 0
    with np.errstate(invalid="ignore"):
        kl = float(np.sum(p[live] * (ref[live] - arm[live])))
    return max(kl, 0.0) if not math.isnan(kl) else math.inf


def _row_path(run_dir: Path, step: int) -> Path:
    return run_dir / ROWS_DIR / f"{step}.npy"


def take_row(run_dir: Path, sample: Sample) -> None:
    """Take the row out of ``sample.engine`` (it never reaches the sample's record) and, for a measured ok sample,
    write it to ``rows/<step>.npy`` (whole or not at all: a crash leaves no half row)."""
    engine = sample.engine
    if not engine or FIELD not in engine:
        return
    b64 = engine.pop(FIELD)
    if not b64 or not sample.ok or sample.excluded:
        return
    path = _row_path(run_dir, sample.step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.save(f, np.frombuffer(base64.b64decode(b64), dtype="<f4"))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _load(run_dir: Path, step: int) -> np.ndarray | None:
    path = _row_path(run_dir, step)
    return np.load(path).astype(np.float64) if path.is_file() else None


def vocab_kls(run_dir: Path, record: RunRecord, reference: str) -> list[VocabKL]:
    """KL(reference sample || sample) over the whole vocabulary for every measured ok sample with a row and every
    measured ok sample of ``reference`` with a row on the same prompt (itself left out), in step order."""
    usable = [s for s in record.samples if s.ok and not s.excluded]
    refs: dict[str, list[Sample]] = {}
    for s in usable:
        if s.arm == reference:
            refs.setdefault(s.prompt_id, []).append(s)
    out: list[VocabKL] = []
    cache: dict[int, Any] = {}

    def row(step: int) -> np.ndarray | None:
        if step not in cache:
            cache[step] = _load(run_dir, step)
        return cache[step]

    prompt = None
    for s in sorted(usable, key=lambda s: (s.prompt_id, s.step)):  # one prompt's rows in memory at a time
        if s.prompt_id != prompt:
            prompt = s.prompt_id
            cache.clear()
        mine = None
        for r in refs.get(s.prompt_id, []):
            if r.step == s.step:
                continue
            mine = row(s.step) if mine is None else mine
            theirs = row(r.step)
            if mine is None or theirs is None or mine.shape != theirs.shape:
                continue
            kl = vocab_kl(theirs, mine)
            out.append(VocabKL(step=s.step, against=r.step, kl=kl if math.isfinite(kl) else None,
                               vocab=int(mine.size)))
    return sorted(out, key=lambda v: (v.step, v.against))


def has_rows(run_dir: Path) -> bool:
    return (run_dir / ROWS_DIR).is_dir()


def drop_rows(run_dir: Path) -> None:
    """Remove the rows (a complete run's KLs are recorded)."""
    shutil.rmtree(run_dir / ROWS_DIR, ignore_errors=True)
