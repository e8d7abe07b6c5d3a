"""Parity: the arms' token ids against the reference's, and the reference against itself across rounds.

Parity
------
Each measured ok sample of another arm is compared with the parity reference's sample of the same prompt
(``gate.parity_reference``, else ``run.reference``: one arm can be the yardstick of speed and another that
of ids; an arm that names its own ``parity_reference`` is compared with that arm instead, which is then checked
for stability as the run's reference is) in the same round (the nearest other round when that one is missing,
failed or carries no ids; the row says so). The first K ids (``gate.parity_tokens``) must be equal. Rows also
give the first diverging position over the whole output, the agreeing prefix out of ``request.max_tokens``, and
at the divergence the top-2 logprob margin of both sides: "near-tie" when either margin is below :data:`NEAR_TIE_NATS`,
"divergence" when both are clear, "margin unknown" without logprobs. The reference arm is checked against
itself across rounds (its lowest round is the baseline): a reference that is not deterministic makes
parity meaningless. ``ids_source`` 'retokenized' is flagged; 'none' cannot be checked.

Verdicts
--------
Every row also gets a ``verdict`` over the first K ids (:func:`flip_verdict`): ``equal`` (no divergence
before K); ``near-tie flip`` (the first divergence is a flip between near-tied tokens: on every side that
captured at least two top logprobs there, its own choice is its best and the other side's choice is among its
top logprobs, less than the tolerance below it; with top-2 logprobs that is "each side's choice is the other's
runner-up", with more a flip among three or more near-equal tokens is shown too); ``broken`` (anything else:
another token, a clear margin, different lengths, or no logprobs to show a near tie); ``unchecked``. The tolerance of a ``parity`` row is its arm's
own ``accept_near_ties``, else ``gate.accept_near_ties``; where either is set the gate accepts that row's
near-tie flip (the reference's own ``stability`` rows must stay equal). Where neither is, the tolerance is
:data:`NEAR_TIE_NATS` (reported, not accepted). Each row also says how closely the two sides' logprobs agree
over the prefix where their ids agree (:func:`logprob_agreement`): the measured spread a tolerance for
another engine should come from.

:func:`classify` names a divergence from the top-2 margins at its position (:mod:`abbench.diagnostics.diff`
and the probe use it too).
"""

from __future__ import annotations

import statistics
from typing import Any

import pandas as pd

from abbench.analysis.frames import (
    frame,
    gate_spec,
    max_tokens,
    measured_ok,
    num,
    arm_parity_references,
    arm_tolerances,
    parity_reference_arm,
    prompt_targets,
    sort_rows,
)
from abbench.results import RunRecord, Sample

NEAR_TIE_NATS = 0.05
"""A top-2 logprob margin below this (nats) at the divergence makes it a near-tie flip, not a bug."""


# ------------------------------------------------------------------------------------------ parity


PARITY_COLUMNS = [
    "check", "prompt_id", "kind", "target_tokens", "arm", "round", "position", "step", "against_arm",
    "against_round", "other_round", "k", "match", "first_diverging", "agree", "max_tokens", "n_ids",
    "n_ids_against", "id", "id_against", "margin", "margin_against", "classification", "verdict",
    "flip_margin", "tolerance", "accepts", "verdict_why", "ids_source", "ids_source_against",
    "lp_positions", "lp_delta_median", "lp_delta_max", "margin_delta_max", "note",
]


def logprob_margin(logprobs: list[list[tuple[int, float]]] | None, pos: int) -> float | None:
    """Top-2 logprob margin (nats) at output position ``pos``, when captured with at least two entries."""
    if not logprobs or pos >= len(logprobs):
        return None
    top = logprobs[pos]
    if not top or len(top) < 2:
        return None
    a, b = num(top[0][1]), num(top[1][1])
    return None if a is None or b is None else a - b


def _at(logprobs: list[list[tuple[int, float]]] | None, pos: int) -> list[tuple[int, float]] | None:
    return logprobs[pos] if logprobs and pos < len(logprobs) else None


def compare_ids(a: list[int], b: list[int], k: int) -> tuple[bool, int | None, int]:
    """(match within the first k ids, first diverging position or None when identical, agreeing prefix).
    Outputs of different lengths diverge where the shorter one ends."""
    n = min(len(a), len(b))
    agree = next((i for i in range(n) if a[i] != b[i]), n)
    if agree < n or len(a) != len(b):
        first: int | None = agree
    else:
        first = None
    return (first is None or first >= k), first, agree


def classify(first: int | None, margins: list[float | None], near_tie: float) -> str:
    if first is None:
        return "identical"
    known = [m for m in margins if m is not None]
    if not known:
        return "margin unknown"
    return "near-tie" if min(known) < near_tie else "divergence"


def _top_lp(top: Any, token: int) -> float | None:
    for t in top or []:
        if int(t[0]) == token:
            return num(t[1])
    return None


def flip_verdict(own: int | None, other: int | None, top_own: Any, top_other: Any,
                 tolerance: float) -> tuple[str, float | None, str]:
    """Verdict on a first divergence where this side chose ``own`` and the other side ``other``, from each
    side's top logprobs at that position (lists of (id, logprob), either may be None): ("near-tie flip" |
    "broken", the largest gap of the sides that show one, why). A near-tie flip needs at least one side with two
    entries, and on every such side its own choice first and the other's choice among its entries, less than
    ``tolerance`` nats below (the gap). A side whose list stops before the other's choice cannot show a near
    tie: broken; the reason says how far below its best the other's choice lies at least (its last entry), and,
    where that bound is within the tolerance, that more logprobs could settle it."""
    if own is None or other is None:
        return "broken", None, "the outputs differ in length"
    gaps: list[float] = []
    ranks: list[int] = []
    for top, mine, theirs in ((top_own, own, other), (top_other, other, own)):
        if not top or len(top) < 2:
            continue
        ranked = sorted(((int(t[0]), num(t[1])) for t in top if num(t[1]) is not None), key=lambda t: -t[1])
        ids, lp = [i for i, _ in ranked], dict(reversed(ranked))  # an id listed twice: its best
        if theirs not in lp:  # below the last entry captured: at least that far under this side's best
            shown = (f"token {theirs} is not the runner-up where {mine} was chosen" if len(ranked) <= 2
                     else f"token {theirs} is not among the top {len(ranked)} where {mine} was chosen")
            floor = ranked[0][1] - ranked[-1][1]
            if floor >= tolerance:
                return "broken", None, f"{shown}: at least {floor:.4f} nats below, not within {tolerance:g}"
            return "broken", None, (f"{shown} (at least {floor:.4f} nats below, which the {tolerance:g}-nat "
                                    f"tolerance allows): too few logprobs captured to show a near tie; ask for "
                                    f"more (request.logprobs)")
        if mine not in lp:
            return "broken", None, f"token {mine} was chosen but is not among its own top {len(ranked)}"
        gap = lp[mine] - ranked[0][1]
        if gap < 0:
            return "broken", gap, f"token {mine} was chosen over the more likely {ranked[0][0]} (not greedy)"
        gaps.append(ranked[0][1] - lp[theirs])
        ranks.append(ids.index(theirs) + 1)
    if not gaps:
        return "broken", None, "no top-2 logprobs at the divergence: a near tie cannot be shown"
    margin = max(gaps)
    kind = "runner-up flip" if max(ranks) == 2 else f"near-tie flip (rank {max(ranks)} on one side)"
    if margin < tolerance:
        return "near-tie flip", margin, f"{kind}, margin {margin:.4f} < {tolerance:g} nats"
    return "broken", margin, f"{kind} but margin {margin:.4f} >= {tolerance:g} nats"


def near_tie_tolerance(record: RunRecord) -> float:
    """``gate.accept_near_ties`` when the profile sets it, else :data:`NEAR_TIE_NATS`."""
    return gate_spec(record).accept_near_ties or NEAR_TIE_NATS


def logprob_agreement(a: Sample, b: Sample, upto: int) -> dict[str, Any]:
    """How closely two samples' logprobs agree over their first ``upto`` positions (where their ids agree):
    the number of positions with the chosen token's logprob on both sides, the median and largest absolute
    difference of that logprob, and the largest absolute difference of the top-2 margin. Two engines that
    compute the same model differ here by their arithmetic alone; a flip whose margin lies within that
    spread is what such noise produces."""
    lp: list[float] = []
    dm: list[float] = []
    for pos in range(min(upto, len(a.output_ids), len(b.output_ids))):
        tok = a.output_ids[pos]
        x, y = _top_lp(_at(a.logprobs, pos), tok), _top_lp(_at(b.logprobs, pos), tok)
        if x is not None and y is not None:
            lp.append(abs(x - y))
        ma, mb = logprob_margin(a.logprobs, pos), logprob_margin(b.logprobs, pos)
        if ma is not None and mb is not None:
            dm.append(abs(ma - mb))
    return {"lp_positions": len(lp), "lp_delta_median": statistics.median(lp) if lp else None,
            "lp_delta_max": max(lp) if lp else None, "margin_delta_max": max(dm) if dm else None}


def parity_tokens_of(record: RunRecord, parity_tokens: int | None = None) -> int:
    return int(parity_tokens) if parity_tokens else gate_spec(record).parity_tokens


def parity_frame(record: RunRecord, *, parity_tokens: int | None = None,
                 near_tie_nats: float = NEAR_TIE_NATS, tolerance: float | None = None,
                 own_references: bool = True) -> pd.DataFrame:
    """Parity rows: ``check`` 'parity' (a sample vs its parity reference: its arm's own ``parity_reference``,
    else the run's, :func:`parity_reference_arm`; with ``own_references`` False, the run's for every arm) and
    'stability' (a sample of a reference arm of a later round vs its lowest round). ``match`` is None when the row
    could not be checked (``note`` says why); ``classification``: identical / near-tie / divergence / margin
    unknown / unchecked; ``verdict`` (module docstring) with the row's ``tolerance``: the arm's own
    ``accept_near_ties``, else ``tolerance`` (the gate's, default :func:`near_tie_tolerance`); ``accepts``:
    whether the gate accepts that row's near-tie flip (a parity row with a tolerance set by its arm, by
    ``gate.accept_near_ties`` or by ``tolerance``). ``lp_*``/``margin_delta_max``: :func:`logprob_agreement`
    over the agreeing prefix."""
    k = parity_tokens_of(record, parity_tokens)
    gate_tol = near_tie_tolerance(record) if tolerance is None else tolerance
    gate_accepts = tolerance is not None or gate_spec(record).accept_near_ties is not None
    own_tol = arm_tolerances(record)
    ref = parity_reference_arm(record)
    own_ref = arm_parity_references(record) if own_references else {}
    refs = {ref, *own_ref.values()}
    n_max = max_tokens(record)
    targets = prompt_targets(record)
    samples = sorted(measured_ok(record), key=lambda s: s.step)
    ref_by: dict[tuple[str | None, str], dict[int, Sample]] = {}
    for s in samples:
        if s.arm in refs and s.ids_source != "none":
            ref_by.setdefault((s.arm, s.prompt_id), {})[s.round] = s  # the last usable one per round
    rows: list[dict[str, Any]] = []

    def row(check: str, s: Sample, r: Sample | None, other_round: bool, note: list[str],
            against: str | None) -> None:
        tol = own_tol.get(s.arm, gate_tol) if check == "parity" else gate_tol
        accepts = check == "parity" and (s.arm in own_tol or gate_accepts)
        base = {
            "check": check, "prompt_id": s.prompt_id, "kind": s.kind,
            "target_tokens": targets.get(s.prompt_id, s.prompt_tokens), "arm": s.arm, "round": s.round,
            "position": s.position, "step": s.step, "k": k, "max_tokens": n_max or len(s.output_ids),
            "n_ids": len(s.output_ids), "ids_source": s.ids_source,
        }
        if s.ids_source == "retokenized":
            note.append(f"{s.arm} ids retokenized from text")
        if r is None or s.ids_source == "none":
            if s.ids_source == "none":
                note.append("engine returned no token ids")
            rows.append({**base, "against_arm": against, "match": None, "classification": "unchecked",
                         "verdict": "unchecked", "tolerance": tol, "accepts": accepts, "other_round": other_round,
                         "note": "; ".join(note)})
            return
        if r.ids_source == "retokenized":
            note.append(f"{r.arm} ids retokenized from text")
        match, first, agree = compare_ids(s.output_ids, r.output_ids, k)
        m_s = m_r = None
        id_s = id_r = None
        if first is not None:
            m_s, m_r = logprob_margin(s.logprobs, first), logprob_margin(r.logprobs, first)
            id_s = s.output_ids[first] if first < len(s.output_ids) else None
            id_r = r.output_ids[first] if first < len(r.output_ids) else None
            if m_s is None and m_r is None:
                note.append("no logprobs at the divergence")
        verdict, flip_margin, why = "equal", None, None
        if not match:
            verdict, flip_margin, why = flip_verdict(id_s, id_r, _at(s.logprobs, first), _at(r.logprobs, first), tol)
        rows.append(
            {**base, "against_arm": r.arm, "against_round": r.round, "other_round": other_round,
             "match": match, "first_diverging": first, "agree": agree, "n_ids_against": len(r.output_ids),
             "id": id_s, "id_against": id_r, "margin": m_s, "margin_against": m_r,
             "classification": classify(first, [m_s, m_r], near_tie_nats), "verdict": verdict,
             "flip_margin": flip_margin, "tolerance": tol, "accepts": accepts, "verdict_why": why,
             "ids_source_against": r.ids_source, **logprob_agreement(s, r, agree), "note": "; ".join(note)}
        )

    for s in samples:
        if s.arm == ref:
            continue
        against = own_ref.get(s.arm, ref)
        by_round = ref_by.get((against, s.prompt_id), {})
        if s.round in by_round:
            row("parity", s, by_round[s.round], False, [], against)
        elif by_round:
            other = min(by_round, key=lambda rr: (abs(rr - s.round), rr))
            row("parity", s, by_round[other], True,
                [f"reference round {s.round} missing or failed; compared with its round {other}"], against)
        else:
            row("parity", s, None, False, [f"no usable {against} sample of this prompt in any round"], against)
    for by_round in ref_by.values():
        base_round = min(by_round)
        for rnd, s in sorted(by_round.items()):
            if rnd != base_round:
                row("stability", s, by_round[base_round], False, [], s.arm)
    for s in samples:  # reference samples without ids: unchecked stability rows, so nothing hides
        if s.arm in refs and s.ids_source == "none":
            row("stability", s, None, False, [], s.arm)
    out = frame(rows, PARITY_COLUMNS, ints=["target_tokens", "against_round", "first_diverging", "agree",
                                             "n_ids_against", "id", "id_against", "lp_positions"],
                 bools=["match", "other_round", "accepts"])
    return sort_rows(out, record, ["check", "arm", "kind", "target_tokens", "prompt_id", "round"])
