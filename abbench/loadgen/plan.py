"""What a load level sends and when: the load prompts (exact lengths drawn from the profile's distributions) and
the open loop's seeded arrival times.

Contract
--------
* :func:`prompt_plan` draws, from ``[load] seed``, each load prompt's length and output length: prompt ``i`` is
  ``load-<i>`` with ``prompt_tokens`` and ``output_tokens`` drawn in order (:func:`draw_lengths`). Pure.
* :func:`build_load_prompts` builds those prompts with the exact-length builder of :mod:`abbench.prompts`, each
  a document of its own at position :data:`POSITION_BASE` + i of the profile's corpora (so no load prompt
  shares a prefix with another or with the run's other prompts), and returns them with their
  :class:`~abbench.results.PromptRecord` (the sha256 that a replay checks).
* :func:`arrivals` is the open loop's schedule: seconds after the level's start at which each request is due,
  first at 0, then gaps drawn from a gamma distribution of shape ``burstiness`` and mean ``1 / rate`` (vLLM's
  ``--burstiness``; poisson: shape 1, exponential gaps), seeded by (seed, level, round): both arms of a round
  get the same schedule at a level, each round its own. ``rate = inf``: every request due at 0.
* A level's requests cycle through the prompts in order: request ``k`` sends prompt ``k % len(prompts)``
  (:func:`request_prompt`), so every level uses the same prompts and one run of each alone is the parity
  reference of every level.
* :func:`level_plan` is the order a run's load cells run in: round by round, each round's parity references
  first (with ``parity_reference``: every arm, every prompt alone), then level by level in the profile's order,
  the arms at each level in the round's ABBA order (:func:`abbench.schedule.arm_order`), so drift falls on
  every arm alike. :func:`resume_at` is the first step of that plan a run's records do not hold complete (a
  level stopped by an interrupt runs again).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from abbench.loadrecords import LoadLevel
from abbench.profile import LengthDist, LoadSpec, PromptsSpec
from abbench.prompts import BuiltPrompt, PromptItem, build_prompt_items
from abbench.results import PromptRecord
from abbench.schedule import arm_order

__all__ = ["POSITION_BASE", "WARMUP_POSITION_BASE", "LevelStep", "LoadPrompt", "arrivals", "build_load_items",
           "build_load_prompts", "build_warmup_prompts", "draw_lengths", "level_plan", "load_prompt", "prompt_plan",
           "request_prompt", "resume_at"]

POSITION_BASE = 1_000_000
"""Corpus position of load prompt 0: far past any position the run's own prompt sets use."""
WARMUP_POSITION_BASE = 2_000_000
"""Corpus position of warm-up prompt 0 (:func:`build_warmup_prompts`): past any load prompt's."""


@dataclass(frozen=True)
class LoadPrompt:
    """One load prompt: its id, exact length, output length and what is sent (text, or token ids)."""

    id: str
    target_tokens: int
    max_tokens: int
    prompt: str | list[int]
    record: PromptRecord | None = None


def draw_lengths(dist: LengthDist, n: int, rng: np.random.Generator) -> list[int]:
    """``n`` token counts from ``dist`` (fixed, uniform with both ends, or weighted values)."""
    if dist.fixed is not None:
        return [dist.fixed] * n
    if dist.uniform is not None:
        lo, hi = dist.uniform
        return [int(x) for x in rng.integers(lo, hi + 1, size=n)]
    values = list(dist.values or [])
    w = np.asarray(dist.weights if dist.weights is not None else [1.0] * len(values), dtype=float)
    idx = rng.choice(len(values), size=n, p=w / w.sum())
    return [values[int(i)] for i in idx]


def prompt_plan(load: LoadSpec, max_tokens: int) -> list[tuple[str, int, int]]:
    """(id, prompt tokens, output tokens) of every load prompt; output tokens default to ``max_tokens``."""
    n = load.n_prompts
    lengths = draw_lengths(load.prompt_tokens, n, np.random.default_rng([load.seed, 1]))
    outputs = (draw_lengths(load.output_tokens, n, np.random.default_rng([load.seed, 2]))
               if load.output_tokens is not None else [max_tokens] * n)
    return [(f"load-{i}", p, o) for i, (p, o) in enumerate(zip(lengths, outputs))]


def build_load_items(tok: Any, prompts: PromptsSpec, load: LoadSpec, max_tokens: int, *,
                     base_dir: Path | None = None) -> list[tuple[BuiltPrompt, int]]:
    """The load prompts as the exact-length builder gives them (text, ids, record), each with its output
    length (module docstring)."""
    plan = prompt_plan(load, max_tokens)
    items = [(POSITION_BASE + i, PromptItem(pid, "fresh", (n,), (pid,))) for i, (pid, n, _) in enumerate(plan)]
    spec = prompts.model_copy(update={"seed": load.seed})
    built = build_prompt_items(tok, spec, items, base_dir=base_dir)
    return [(b, out) for b, (_, _, out) in zip(built, plan)]


def build_warmup_prompts(tok: Any, prompts: PromptsSpec, load: LoadSpec, max_tokens: int, *,
                         base_dir: Path | None = None) -> list[LoadPrompt]:
    """``load.warmup_requests`` warm-up prompts: lengths drawn from the load's distributions by draws of their
    own, each a document at :data:`WARMUP_POSITION_BASE` + i, so none is a measured prompt or shares one's
    prefix (a warm-up must not leave a measured prompt's KV in a cache)."""
    n = load.warmup_requests
    if n == 0:
        return []
    lengths = draw_lengths(load.prompt_tokens, n, np.random.default_rng([load.seed, 4]))
    outputs = (draw_lengths(load.output_tokens, n, np.random.default_rng([load.seed, 5]))
               if load.output_tokens is not None else [max_tokens] * n)
    items = [(WARMUP_POSITION_BASE + i, PromptItem(f"warmup-{i}", "fresh", (p,), (f"warmup-{i}",)))
             for i, p in enumerate(lengths)]
    built = build_prompt_items(tok, prompts.model_copy(update={"seed": load.seed}), items, base_dir=base_dir)
    return [load_prompt(b, out) for b, out in zip(built, outputs, strict=True)]


def load_prompt(built: BuiltPrompt, max_tokens: int) -> LoadPrompt:
    """A built load prompt as a level sends it."""
    return LoadPrompt(id=built.record.id, target_tokens=built.record.target_tokens, max_tokens=max_tokens,
                      prompt=built.text, record=built.record)


def build_load_prompts(tok: Any, prompts: PromptsSpec, load: LoadSpec, max_tokens: int, *,
                       base_dir: Path | None = None) -> list[LoadPrompt]:
    """The load prompts, exact and checked, as text (module docstring)."""
    return [load_prompt(b, out) for b, out in build_load_items(tok, prompts, load, max_tokens, base_dir=base_dir)]


def arrivals(rate: float, *, n: int | None = None, duration_s: float | None = None, burstiness: float = 1.0,
             seed: int = 0, round: int = 1) -> list[float]:
    """Due times (seconds after the level's start) of ``n`` requests, or of every request due before
    ``duration_s`` (module docstring)."""
    if not rate > 0:
        raise ValueError(f"rate {rate!r}: a rate is requests/s above 0")
    if n is None and duration_s is None:
        raise ValueError("arrivals needs n or duration_s")
    if math.isinf(rate):
        if n is None:
            raise ValueError("rate = inf sends a fixed number of requests: give requests, not duration_s")
        return [0.0] * n
    key = int(rate * 1000 + 0.5) if rate < 1e12 else 0  # the level, in mHz
    rng = np.random.default_rng([seed, 3, key, round])
    scale = 1.0 / (rate * burstiness)
    out: list[float] = []
    t = 0.0
    while (n is None or len(out) < n):
        if duration_s is not None and t >= duration_s:
            break
        out.append(t)
        t += float(rng.gamma(burstiness, scale))
    return out


def request_prompt(prompts: list[LoadPrompt], k: int) -> LoadPrompt:
    """The prompt request ``k`` of a level sends: they cycle in order."""
    return prompts[k % len(prompts)]


@dataclass(frozen=True)
class LevelStep:
    """One cell of one round as the run takes it: the arm at a level (or its parity reference)."""

    round: int
    kind: str
    value: float
    arm: str
    position: int
    role: str = "load"

    def done_by(self, lv: LoadLevel) -> bool:
        """Whether ``lv`` is this step's record, complete (not stopped by an interrupt)."""
        return (lv.round, lv.arm, lv.role, lv.kind, lv.value) == (self.round, self.arm, self.role, self.kind,
                                                                     self.value) and lv.stopped is None


def level_plan(arms: list[str], load: LoadSpec, rounds: int) -> list[LevelStep]:
    """Every step of a load run, in order (module docstring)."""
    out: list[LevelStep] = []
    for r in range(1, rounds + 1):
        order = arm_order(arms, r)
        if load.parity_reference:
            out += [LevelStep(r, "concurrency", 1.0, a, i, "reference") for i, a in enumerate(order)]
        for kind, value in load.levels():
            out += [LevelStep(r, kind, value, a, i) for i, a in enumerate(order)]
    return out


def resume_at(plan: list[LevelStep], done: list[LoadLevel]) -> int:
    """The index of the first step of ``plan`` that ``done`` does not hold complete (``len(plan)``: none)."""
    for i, step in enumerate(plan):
        if not any(step.done_by(lv) for lv in done):
            return i
    return len(plan)
