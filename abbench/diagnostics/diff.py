"""Divergence diagnostics: where two arms' greedy outputs part, and why.

Contract
--------
* :func:`diff_prompt` reads a :class:`~abbench.results.RunRecord` (no I/O beyond the tokenizer) and pairs the
  reference arm's sample of one prompt with another arm's sample of it (same round; by default the first
  arm and lowest round where the two differ, else the lowest round where both have an ok sample; measured
  samples before excluded ones), aligning their id streams
  position by position: id, token text (the run's tokenizer, no clean-up), top-2 logprobs and their margin
  when captured. The first diverging position and its classification (identical / near-tie / divergence /
  margin unknown) follow :mod:`abbench.analysis` exactly (:func:`~abbench.analysis.compare_ids`,
  :data:`~abbench.analysis.NEAR_TIE_NATS`). :func:`format_diff` renders it as plain text.
* :func:`first_divergence` finds where a run's outputs first part from the parity reference's (the earliest
  output position over every measured prompt, arm and round; ties: the prompt, arm and round that come
  first): what ``diff`` and ``probe`` look at when no ``--prompt``, ``--arm`` or ``--position`` is given.
* :class:`ProbeResult` is what a forced-continuation probe found (:func:`abbench.diagnostics.probe.probe_prompt`,
  which launches services) and :func:`format_probe` renders it. This module reads results only.

"The reference" is the run's parity reference, except for an arm that names its own ``parity_reference``
(an FP8 streaming arm against a resident FP8 arm): there, that arm, as the gate judges it; ``probe`` too.

Errors are :class:`~abbench.errors.ConfigError` (unknown prompt, arm, round; nothing to compare) or the
service/request errors of the layers below.
"""

from __future__ import annotations

import json
import math
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from abbench import analysis as an
from abbench.errors import ConfigError
from abbench.results import RunRecord, Sample

TopLogprobs = list[tuple[int, float]]
DEFAULT_PROBE_THRESHOLD = 0.01
"""Nats: a probed logprob further than this from the reference's own counts as a difference."""


# ------------------------------------------------------------------------------------------------- diff


@dataclass(frozen=True)
class Side:
    """One arm's view of a position: its id, the token's text, and its captured top logprobs."""

    id: int | None
    text: str | None
    top: TopLogprobs | None

    @property
    def margin(self) -> float | None:
        if not self.top or len(self.top) < 2:
            return None
        return self.top[0][1] - self.top[1][1]


@dataclass(frozen=True)
class Position:
    index: int
    ref: Side
    arm: Side

    @property
    def same(self) -> bool:
        return self.ref.id is not None and self.ref.id == self.arm.id


@dataclass
class PromptDiff:
    prompt_id: str
    kind: str
    target_tokens: int | None
    reference: str
    arm: str
    ref_round: int
    arm_round: int
    first_diverging: int | None
    agree: int
    classification: str
    positions: list[Position]
    notes: list[str] = field(default_factory=list)


def usable(s: Sample) -> bool:
    return s.ok and s.ids_source != "none"


def pick_round(samples: list[Sample], round_no: int | None) -> dict[int, Sample]:
    """Per round, the sample to use: measured before excluded, the last one of a retried step."""
    out: dict[int, Sample] = {}
    for s in sorted(samples, key=lambda x: (not x.excluded, x.step)):  # excluded first, so measured win
        if round_no is None or s.round == round_no:
            out[s.round] = s
    return out


def _decode(tokenizer: Any, token_id: int | None) -> str | None:
    if tokenizer is None or token_id is None:
        return None
    from abbench.tokenizers import decode_ids

    try:
        return decode_ids(tokenizer, [token_id])
    except Exception:  # noqa: BLE001 - an id the tokenizer does not know (a padded embedding row)
        return None


@dataclass(frozen=True)
class Divergence:
    """Where an arm's output first parts from the parity reference's: a prompt, an arm, a round, an output
    position (0 = the first generated token)."""

    prompt_id: str
    arm: str
    round: int
    position: int

    def describe(self) -> str:
        return f"prompt {self.prompt_id}, arm {self.arm}, round {self.round}, output position {self.position}"


def first_divergence(record: RunRecord, *, prompt_id: str | None = None, arm: str | None = None,
                     round: int | None = None) -> Divergence | None:
    """The earliest divergence of a measured sample from its parity reference's sample of its prompt and round
    (its arm's own ``parity_reference``, else the run's; restricted to ``prompt_id``, ``arm`` and ``round`` when
    given); None when every output equals its reference's."""
    ref = an.parity_reference_arm(record)
    own = an.arm_parity_references(record)
    prompt_rank = {p.id: i for i, p in enumerate(record.prompts)}
    arm_rank = {a: i for i, a in enumerate(an.arm_names(record))}
    latest: dict[tuple[str, str, int], Sample] = {}
    for s in sorted(record.samples, key=lambda x: x.step):
        if usable(s) and not s.excluded:
            latest[(s.arm, s.prompt_id, s.round)] = s
    best: tuple[tuple[int, int, int, int], Divergence] | None = None
    for (a, p, r), s in latest.items():
        if a == ref or (arm is not None and a != arm) or (prompt_id is not None and p != prompt_id) or (
                round is not None and r != round):
            continue
        r_s = latest.get((own.get(a, str(ref)), p, r))
        if r_s is None:
            continue
        _, first, _ = an.compare_ids(s.output_ids, r_s.output_ids, 1)
        if first is None:
            continue
        key = (first, prompt_rank.get(p, len(prompt_rank)), arm_rank.get(a, len(arm_rank)), r)
        if best is None or key < best[0]:
            best = (key, Divergence(p, a, r, first))
    return best[1] if best else None


def diff_prompt(record: RunRecord, prompt_id: str, *, arm: str | None = None, round: int | None = None,
                tokenizer: Any = None, near_tie_nats: float = an.NEAR_TIE_NATS) -> PromptDiff:
    """Align the reference arm's and ``arm``'s outputs for ``prompt_id`` (see the module docstring)."""
    prompts = {p.id: p for p in record.prompts}
    if prompt_id not in prompts:
        listed = ", ".join(p.id for p in record.prompts) or "(none)"
        raise ConfigError(f"--prompt: run {record.run_id} has no prompt {prompt_id!r}; its prompts are {listed}")
    ref = an.parity_reference_arm(record)
    arms = an.arm_names(record)
    if ref is None:
        raise ConfigError(f"run {record.run_id} has no arms")
    if arm is not None and arm not in arms:
        raise ConfigError(f"--arm: run {record.run_id} has no arm {arm!r}; its arms are {', '.join(arms)}")
    if arm == ref:
        raise ConfigError(f"--arm {arm} is the reference arm; name another arm to compare with it")
    of_prompt = [s for s in record.samples if s.prompt_id == prompt_id and usable(s)]
    own = an.arm_parity_references(record)  # an arm's own parity reference replaces the run's for it
    refs_by = {r: pick_round([s for s in of_prompt if s.arm == r], round) for r in {ref, *own.values()}}
    ref_by = refs_by[ref]
    if not ref_by and (arm is None or arm not in own):
        where = f" in round {round}" if round is not None else ""
        raise ConfigError(f"the reference arm {ref} has no ok sample with token ids of prompt {prompt_id}{where}")
    candidates = [arm] if arm is not None else [a for a in arms if a != ref]
    best: tuple[int, str, int] | None = None  # (diverges? 0 first, arm order, round)
    for rank, a in enumerate(candidates):
        arm_by = pick_round([s for s in of_prompt if s.arm == a], round)
        ref_by = refs_by[own.get(a, ref)]
        for r in sorted(set(arm_by) & set(ref_by)):
            _, first, _ = an.compare_ids(arm_by[r].output_ids, ref_by[r].output_ids, 1)
            key = (0 if first is not None else 1, rank, r)
            if best is None or key < best:
                best = key
    if best is None:
        which = f"arm {arm} has" if arm is not None else "no arm but the reference has"
        where = f" in round {round}" if round is not None else " in a round where the reference has one"
        raise ConfigError(f"{which} no ok sample with token ids of prompt {prompt_id}{where}")
    other = candidates[best[1]]
    r = best[2]
    ref = own.get(other, ref)
    s_ref = refs_by[ref][r]
    s_arm = pick_round([s for s in of_prompt if s.arm == other], r)[r]
    _, first, agree = an.compare_ids(s_arm.output_ids, s_ref.output_ids, 1)
    positions = []
    for i in range(max(len(s_ref.output_ids), len(s_arm.output_ids))):
        def side(s: Sample) -> Side:
            tid = s.output_ids[i] if i < len(s.output_ids) else None
            top = [(int(t), float(v)) for t, v in s.logprobs[i]] if s.logprobs and i < len(s.logprobs) else None
            return Side(tid, _decode(tokenizer, tid), top)

        positions.append(Position(i, side(s_ref), side(s_arm)))
    margins = [positions[first].arm.margin, positions[first].ref.margin] if first is not None else []
    notes = []
    for s in (s_ref, s_arm):
        if s.excluded:
            notes.append(f"{s.arm} round {s.round}: only an excluded ({s.kind}) sample of this prompt")
        if s.ids_source == "retokenized":
            notes.append(f"{s.arm} ids were retokenized from text, not the engine's own")
        if not s.logprobs:
            notes.append(f"{s.arm} captured no logprobs (request.logprobs)")
    return PromptDiff(
        prompt_id=prompt_id, kind=prompts[prompt_id].kind, target_tokens=prompts[prompt_id].target_tokens,
        reference=ref, arm=other, ref_round=r, arm_round=r, first_diverging=first, agree=agree,
        classification=an.classify(first, margins, near_tie_nats), positions=positions, notes=notes,
    )


def _fmt_text(t: str | None, width: int = 14) -> str:
    if t is None:
        return ""
    s = json.dumps(t, ensure_ascii=False)
    return s if len(s) <= width else s[: width - 1] + "…"


def _fmt_top(top: TopLogprobs | None, tokenizer: Any, n: int = 2) -> str:
    if not top:
        return ""
    parts = [f"{i} {_fmt_text(_decode(tokenizer, i), 10)} {lp:.4f}" for i, lp in top[:n]]
    return " | ".join(parts)


def _display_width(text: str) -> int:
    """Terminal columns of ``text``: East Asian wide characters take two, combining marks none."""
    w = 0
    for ch in text:
        if unicodedata.combining(ch) or unicodedata.category(ch) in ("Mn", "Me", "Cf"):
            continue
        w += 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1
    return w


def _columns(rows: list[list[str]]) -> list[str]:
    """Rows of cells as left-aligned text columns (two spaces apart), padded by display width."""
    widths = [max(_display_width(r[c]) for r in rows) for c in range(len(rows[0]))]
    return ["  ".join(cell + " " * (w - _display_width(cell)) for cell, w in zip(r, widths)).rstrip()
            for r in rows]


def _fmt_margin(m: float | None) -> str:
    return "" if m is None else f"{m:.4f}"


def format_diff(d: PromptDiff, *, tokenizer: Any = None, context: int | None = None) -> str:
    """Plain-text rendering: a header, the verdict line, and one row per position (``context`` rows either
    side of the first divergence only, when given); ``>>`` marks the first divergence, ``!`` later
    differences."""
    head = [
        f"prompt {d.prompt_id} ({d.kind}, {d.target_tokens} tokens): {d.reference} (reference) round {d.ref_round}"
        f" vs {d.arm} round {d.arm_round}",
    ]
    n = len(d.positions)
    if d.first_diverging is None:
        head.append(f"identical over all {n} ids")
    else:
        p = d.positions[d.first_diverging]
        head.append(
            f"first divergence at position {d.first_diverging} (agree {d.agree}/{n}): {d.reference} "
            f"{p.ref.id} {_fmt_text(p.ref.text, 30)} vs {d.arm} {p.arm.id} {_fmt_text(p.arm.text, 30)}; "
            f"top-2 margin {_fmt_margin(p.ref.margin) or 'n/a'} ({d.reference}) / "
            f"{_fmt_margin(p.arm.margin) or 'n/a'} ({d.arm}) nats: {d.classification}"
        )
    head += [f"note: {x}" for x in d.notes]
    lo, hi = 0, n
    if context is not None and d.first_diverging is not None:
        lo, hi = max(0, d.first_diverging - context), min(n, d.first_diverging + context + 1)
    rows = [["", "pos", f"{d.reference} id", "token", "top-2 (id token logprob)", "margin",
             f"{d.arm} id", "token", "top-2 (id token logprob)", "margin"]]
    for p in d.positions[lo:hi]:
        mark = ">>" if p.index == d.first_diverging else ("!" if not p.same else "")
        rows.append([mark, str(p.index), "" if p.ref.id is None else str(p.ref.id), _fmt_text(p.ref.text),
                     _fmt_top(p.ref.top, tokenizer), _fmt_margin(p.ref.margin),
                     "" if p.arm.id is None else str(p.arm.id), _fmt_text(p.arm.text),
                     _fmt_top(p.arm.top, tokenizer), _fmt_margin(p.arm.margin)])
    body = _columns(rows)
    if lo > 0 or hi < n:
        body.append(f"(positions {lo}..{hi - 1} of 0..{n - 1}; --context to widen)")
    return "\n".join(head + [""] + body) + "\n"


# ------------------------------------------------------------------------------------------------ probe


@dataclass(frozen=True)
class ProbeStep:
    index: int
    ref_id: int
    ref_top: TopLogprobs | None  # what the reference captured at this position in its own run
    probe_id: int  # what the probed engine chooses, given prompt + ref[:index]
    probe_top: TopLogprobs | None
    delta: float | None  # max |logprob difference| over the ids both top lists hold; inf: none in common

    @property
    def same(self) -> bool:
        return self.ref_id == self.probe_id

    @property
    def probe_margin(self) -> float | None:
        return Side(None, None, self.probe_top).margin

    @property
    def ref_margin(self) -> float | None:
        return Side(None, None, self.ref_top).margin


@dataclass
class ProbeResult:
    prompt_id: str
    arm: str
    reference: str
    ref_round: int
    base_url: str
    threshold: float
    steps: list[ProbeStep]
    free_run_divergence: int | None  # where the arm's own free-running output left the reference's (if known)
    free_run_arm_id: int | None
    reset_each: bool

    @property
    def first_over_threshold(self) -> ProbeStep | None:
        return next((s for s in self.steps if s.delta is not None and s.delta > self.threshold), None)

    @property
    def first_choice_change(self) -> ProbeStep | None:
        return next((s for s in self.steps if not s.same), None)


def logprob_delta(a: TopLogprobs | None, b: TopLogprobs | None) -> float | None:
    """Max |logprob(a) - logprob(b)| over the ids both lists hold (inf when they share none, None when
    either is missing)."""
    if not a or not b:
        return None
    da, db = dict(a), dict(b)
    common = set(da) & set(db)
    if not common:
        return math.inf
    return max(abs(da[i] - db[i]) for i in common)



def format_probe(p: ProbeResult, *, tokenizer: Any = None) -> str:
    """Plain-text rendering of a probe: the verdict lines, then one row per probed position."""
    cache = "reset before every step" if p.reset_each else "prefix cache kept between steps"
    lines = [
        f"probe: prompt {p.prompt_id}, arm {p.arm} fed the reference's ({p.reference} round {p.ref_round}) ids one "
        f"position at a time ({len(p.steps)} positions, {cache})",
    ]
    over, change = p.first_over_threshold, p.first_choice_change
    lines.append(
        f"first logprob difference over {p.threshold:g} nats: "
        + (f"position {over.index} (max |delta| {over.delta:.4g})" if over else "none")
    )
    if change is None:
        lines.append(f"{p.arm} chooses the reference's token at every probed position")
    else:
        cls = an.classify(change.index, [change.probe_margin, change.ref_margin], an.NEAR_TIE_NATS)
        lines.append(
            f"first position where {p.arm}, given the reference's history, chooses another token: {change.index} "
            f"({p.arm} {change.probe_id} {_fmt_text(_decode(tokenizer, change.probe_id), 30)} vs {p.reference} "
            f"{change.ref_id} {_fmt_text(_decode(tokenizer, change.ref_id), 30)}; top-2 margin "
            f"{_fmt_margin(change.probe_margin) or 'n/a'} ({p.arm}) / {_fmt_margin(change.ref_margin) or 'n/a'} "
            f"({p.reference}) nats: {cls})"
        )
    if p.free_run_divergence is not None:
        agrees = change is not None and change.index == p.free_run_divergence and change.probe_id == p.free_run_arm_id
        lines.append(
            f"in the run, {p.arm}'s own output left the reference's at position {p.free_run_divergence} "
            f"(id {p.free_run_arm_id}): " + ("the probe reproduces it" if agrees else
                                              "the probe does not reproduce it at that position")
        )
    rows = [["", "pos", "ref id", "token", f"{p.reference} top-2 (run)", "margin", f"{p.arm} choice",
             f"{p.arm} top-2 (probe)", "margin", "max|delta|"]]
    for s in p.steps:
        mark = ">>" if change is not None and s.index == change.index else ("!" if not s.same else "")
        if over is not None and s.index == over.index and not mark:
            mark = "~"
        rows.append([mark, str(s.index), str(s.ref_id), _fmt_text(_decode(tokenizer, s.ref_id)),
                     _fmt_top(s.ref_top, tokenizer), _fmt_margin(s.ref_margin), str(s.probe_id),
                     _fmt_top(s.probe_top, tokenizer), _fmt_margin(s.probe_margin),
                     "" if s.delta is None else f"{s.delta:.4g}"])
    body = _columns(rows)
    return "\n".join(lines + [""] + body + ["", ">> first changed choice, ! other changed choices, "
                                               "~ first difference over the threshold"]) + "\n"


def load_run_tokenizer(record: RunRecord) -> Any:
    """The run's tokenizer (``profile.tokenizer.source``, relative to the profile's folder); None when it
    cannot be loaded (the diff then shows ids only)."""
    from abbench.tokenizers import load_tokenizer

    source = (record.profile.get("tokenizer") or {}).get("source") or "qwen3"
    src_path = record.profile.get("source_path")
    base = Path(src_path).parent if src_path else None
    return load_tokenizer(source, base_dir=base)
