"""The gate: a list of check functions, each ``(GateInput) -> CheckResult``, that :func:`gate` runs in order.

A check reads the record (and the frames the gate computed from it once: completeness, parity rows,
active-path rows) and returns its verdict line, the failures that name prompt, arm, round and position, and
the notes a reader should know. :data:`CHECKS` is the list the gate runs: declared checks plug in here.

Gate rules (:func:`gate`)
-------------------------
The gate passes only when every check passes; it never passes on missing data.

* ``run-complete``: ``status`` is "complete" (a partial or still-running run fails).
* ``samples``: the plan has measured steps and at least one ok sample; every measured planned step has a
  sample (a missing step always fails), no sample contradicts the plan (a step index that is not planned,
  or planned for another arm or prompt), and at most ``gate.max_failed_samples`` steps have only failed
  samples.
* ``reference``: the reference arm (and the parity reference, ``gate.parity_reference``, when that is
  another arm) has ok measured samples.
* ``token-ids``: no measured ok sample has ``ids_source`` 'none'.
* ``parity``: every sample of another arm equals the parity reference over the first K ids, and every
  prompt has a reference sample to compare with. A plan with other arms of which no sample could be compared
  is "not checked", and fails (a run of the reference arm alone has nothing to compare, and passes). With a tolerance T (nats: the arm's own
  ``accept_near_ties``, else ``gate.accept_near_ties``) a mismatch whose verdict is a near-tie flip under T
  (:func:`abbench.analysis.parity.flip_verdict`) is accepted and listed in the notes; every failure names
  its verdict (near-tie flip or broken) either way.
  An arm with ``parity = "numerics"`` (one that changes arithmetic on purpose) is not judged here but by its
  declared numerics checks (:mod:`abbench.analysis.numerics`); how many of its samples differ is noted.
* ``reference-stable``: the parity reference's first K ids are equal across rounds.
* ``active-path`` (when ``gate.require_active_path``): for an arm with ``expect_path``, each measured ok
  sample must report that path, or another path *with* the engine's ``fallback_reason`` where either the
  prompt was *ineligible* (the engine reports ``n_chunks`` <= 1: one chunk, where a multi-chunk path and
  chunked prefill are the same loop, so the fallback is legitimate) or the arm is in
  ``gate.allow_fallback``. A path that differs without a reason (silent fallback) or no reported path at all
  fails whatever allow_fallback says; so does a fallback on an eligible (or unknown-eligibility) prompt of
  an arm not in allow_fallback. And each such arm must show its path at least once: an arm whose every
  sample fell back proved nothing, allowed or not. Allowed fallbacks are listed in the verdict's notes.

A **load run** (its profile has a ``[load]`` table: :func:`abbench.analysis.load.is_load_run`) has no sequential
samples; :data:`LOAD_CHECKS` judge it on its load levels instead of ``samples`` to ``active-path``:

* ``run-complete`` as above;
* ``load-levels``: every planned cell (:func:`abbench.analysis.load.planned_cells`: each arm at each level in
  each round, and its run alone per round with ``load.parity_reference``) is recorded complete (a missing or
  interrupted cell fails), at least one request is ok, and at most ``gate.max_failed_samples`` measured requests
  failed (a refused one, HTTP 429, counts as failed);
* ``reference``: the reference arm has ok measured load requests;
* ``token-ids``: no ok request a parity check reads lacks native ids (only with ``load.parity_reference``);
* ``parity``: each arm's run alone of every prompt equals the parity reference arm's (same round) over K ids, or
  is a near-tie flip the arm's or the gate's ``accept_near_ties`` accepts; a prompt not compared fails;
* ``parity-under-load``: in every cell, every prompt's requests under load equal its run alone on the same arm
  (or are an accepted near tie); a prompt not compared fails. With ``load.parity_reference = false`` both parity
  checks say "not run" and pass: the profile chose not to run prompts alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import numpy as np
import pandas as pd

from abbench.analysis.declared import DeclaredCheck, bind, declared_exprs, describe_cell, fmt_value, judge, overall
from abbench.analysis.frames import (
    Completeness,
    arm_parity_references,
    arm_tolerances,
    completeness,
    expected_paths,
    frames_cached,
    gate_spec,
    is_missing,
    is_value,
    measured_ok,
    parity_reference_arm,
    reference_arm,
    where,
)
from abbench.analysis.load import (
    alone_parity,
    is_load_run,
    load_levels,
    measured,
    parity_under_load,
    planned_cells,
)
from abbench.analysis.numerics import numerics_arms
from abbench.analysis.parity import parity_frame, parity_tokens_of
from abbench.analysis.paths import active_path_samples
from abbench.profile import GateSpec
from abbench.results import RunRecord, Sample


class Check(NamedTuple):
    """One line of the verdict."""

    name: str
    passed: bool
    detail: str
    result: str = ""
    """'pass', 'FAIL', 'inconclusive' (a declared check whose interval straddles its bound; fails) or 'not checked'
    (parity with nothing to compare; fails)."""


@dataclass
class CheckResult:
    """What one check found: its verdict line, the failures (each names where) and the notes."""

    name: str
    passed: bool
    detail: str
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    status: str | None = None
    """Overrides the verdict word ('inconclusive', 'not checked'); default 'pass' / 'FAIL'."""

    @property
    def check(self) -> Check:
        return Check(self.name, self.passed, self.detail, self.status or ("pass" if self.passed else "FAIL"))


@dataclass
class GateVerdict:
    """The gate's verdict. ``failures`` name prompt, arm, round and position (and the token position for
    parity); ``notes`` are things that passed but a reader should know (allowed fallbacks, tolerated
    failures, retokenized ids)."""

    passed: bool
    checks: list[Check]
    failures: list[str]
    parity_tokens: int
    notes: list[str] = field(default_factory=list)


@dataclass
class GateInput:
    """The record and what the gate derives from it once, for every check."""

    record: RunRecord
    parity_tokens: int
    spec: GateSpec
    reference: str | None
    parity_reference: str | None
    completeness: Completeness
    parity: pd.DataFrame
    paths: pd.DataFrame
    ok_samples: list[Sample]

    @classmethod
    def of(cls, record: RunRecord, k: int, comp: Completeness | None = None, parity: pd.DataFrame | None = None,
           paths: pd.DataFrame | None = None) -> GateInput:
        return cls(record=record, parity_tokens=k, spec=gate_spec(record), reference=reference_arm(record),
                   parity_reference=parity_reference_arm(record),
                   completeness=completeness(record) if comp is None else comp,
                   parity=parity_frame(record, parity_tokens=k) if parity is None else parity,
                   paths=active_path_samples(record) if paths is None else paths,
                   ok_samples=measured_ok(record))


def _flags(values: Any, value: bool) -> np.ndarray:
    """Per value: a known boolean equal to ``value`` (NA and None are neither)."""
    return np.array([is_value(v, value) for v in values], dtype=bool)


def _fmt_margin(m: Any) -> str:
    return "n/a" if is_missing(m) else f"{float(m):.3f}"


def _parity_failure(r: Any, ref: str | None) -> str:
    head = f"prompt {r.prompt_id}, arm {r.arm}, round {r.round} (position {r.position})"
    if is_missing(r.match):
        return f"{head}: not checked ({r.note or 'no reference'})"
    d = int(r.first_diverging)
    if is_missing(r.id) or is_missing(r.id_against):
        what = f"output length differs at token {d} ({r.n_ids} vs {r.n_ids_against} ids)"
    else:
        what = f"token {d} differs ({r.arm} {int(r.id)} vs {r.against_arm} {int(r.id_against)})"
    against = f"{r.against_arm} round {int(r.against_round)}"
    margins = f"top-2 margin {_fmt_margin(r.margin)} / {_fmt_margin(r.margin_against)} nats: {r.classification}"
    verdict = f"; verdict {r.verdict} ({r.verdict_why})" if not is_missing(r.verdict_why) else ""
    extra = f"; {r.note}" if r.note else ""
    return f"{head}: {what} from {against}; agree {int(r.agree)}/{r.max_tokens}; {margins}{verdict}{extra}"


def check_run_complete(g: GateInput) -> CheckResult:
    """``status`` is "complete"."""
    record = g.record
    if record.status == "complete":
        return CheckResult("run-complete", True, "status complete")
    why = f" ({record.status_reason})" if record.status_reason else ""
    return CheckResult("run-complete", False, f"status {record.status}{why}",
                       [f"run {record.run_id} is {record.status}{why}: the gate does not pass an unfinished run"])


def check_samples(g: GateInput) -> CheckResult:
    """Every measured planned step has a sample, none contradicts the plan, few enough failed."""
    comp, spec = g.completeness, g.spec
    fails: list[str] = []
    notes: list[str] = []
    if not comp.has_plan:
        fails.append("the run holds no plan: completeness cannot be checked")
    elif comp.planned == 0:
        fails.append("the plan has no measured steps (every step is excluded)")
    if comp.has_plan and comp.planned and comp.ok == 0:
        fails.append("no measured step has an ok sample")
    for st in comp.missing:
        fails.append(f"missing: {where(st)}, step {st.index}: no sample")
    if comp.has_plan:  # results that do not match their own plan are not trusted
        for s in comp.unplanned:
            fails.append(f"unplanned: the sample of step {s.step} ({where(s)}) matches no planned step")
    if len(comp.failed) > spec.max_failed_samples:
        for s in comp.failed:
            fails.append(f"failed: {where(s)}, step {s.step}: {s.error_kind or 'error'}: {s.error or ''}".rstrip(": "))
    elif comp.failed:
        notes.append(f"{len(comp.failed)} failed measured sample(s) tolerated "
                     f"(gate.max_failed_samples = {spec.max_failed_samples})")
    detail = (f"{comp.ok}/{comp.planned} measured steps ok, {len(comp.missing)} missing, "
              f"{len(comp.failed)} failed (tolerated: {spec.max_failed_samples})")
    if comp.has_plan and comp.unplanned:
        detail += f", {len(comp.unplanned)} unplanned"
    return CheckResult("samples", not fails, detail, fails, notes)


def check_reference(g: GateInput) -> CheckResult:
    """The reference arm, and the parity reference when it is another arm, have ok measured samples."""
    if g.reference is None:
        return CheckResult("reference", False, "no reference arm", ["no reference arm"])
    refs = [(g.reference, "reference arm", "")]
    if g.parity_reference not in (None, g.reference):
        refs.append((g.parity_reference, "parity reference", " (parity reference)"))
    for arm, own in arm_parity_references(g.record).items():
        if own not in (r for r, _, _ in refs):
            refs.append((own, f"arm {arm}'s parity reference", f" ({arm}'s parity reference)"))
    details, failures = [], []
    for ref, what, suffix in refs:
        n = sum(1 for s in g.ok_samples if s.arm == ref)
        details.append(f"{ref}: {n} ok measured samples{suffix}")
        if not n:
            failures.append(f"{what} {ref} has no ok measured sample")
    return CheckResult("reference", not failures, "; ".join(failures or details), failures)


def check_token_ids(g: GateInput) -> CheckResult:
    """No measured ok sample lacks token ids."""
    none = sorted((s for s in g.ok_samples if s.ids_source == "none"), key=lambda s: s.step)
    retok = [s for s in g.ok_samples if s.ids_source == "retokenized"]
    failures = [f"token ids: {where(s)}: the engine returned no token ids (ids_source none); parity cannot be checked"
                for s in none]
    detail = f"{len(none)} sample(s) without token ids"
    notes = []
    if retok:
        detail += f", {len(retok)} retokenized from text"
        notes.append(f"{len(retok)} sample(s) carry ids retokenized from text, not the engine's own")
    return CheckResult("token-ids", not none, detail, failures, notes)


def _parity_rows(g: GateInput, check: str, name: str) -> CheckResult:
    rows = g.parity[g.parity["check"] == check]
    mismatch = _flags(rows["match"], False)
    unchecked = (rows["match"].isna() & (rows["ids_source"] != "none")).to_numpy(dtype=bool)
    accepted = mismatch & (rows["verdict"] == "near-tie flip").to_numpy(dtype=bool) & _flags(rows["accepts"], True)
    bad = rows[(mismatch & ~accepted) | unchecked]
    ref = g.parity_reference
    failures = [f"{name}: {_parity_failure(r, ref)}" for r in bad.itertuples()]
    n_checked = int(rows["match"].notna().sum())
    own = arm_tolerances(g.record)
    notes = [f"{name}: accepted near-tie flip ({_tolerance_source(r.arm, own)} = {float(r.tolerance):g}): "
             f"{_parity_failure(r, ref)}" for r in rows[accepted].itertuples()]
    if check == "stability" and rows.empty:
        detail = "one round of the reference per prompt: stability not checked"
    else:
        detail = f"{n_checked - int(mismatch.sum())}/{n_checked} equal over the first {g.parity_tokens} ids"
        if accepted.any():
            tols = sorted({float(t) for t in rows[accepted]["tolerance"]})
            detail += (f", {int(accepted.sum())} near-tie flip(s) accepted (< "
                       f"{' / '.join(f'{t:g}' for t in tols)} nats)")
        n_unchecked = int(rows["match"].isna().sum())
        if n_unchecked:
            detail += f", {n_unchecked} not checked"
    if check == "parity" and rows.empty:
        others = sorted({s.arm for s in g.record.plan if not s.excluded and s.arm != ref})
        if others:  # arms to compare, and not one sample of theirs to compare: nothing was checked
            why = f"not checked: no sample of {', '.join(others)} to compare with the reference {ref}"
            return CheckResult(name, False, why, [f"{name}: {why}"], status="not checked")
        detail = "no non-reference sample to compare"
    other = _flags(rows["other_round"], True)
    if check == "parity" and not rows.empty and other.any():
        notes.append(f"{int(other.sum())} parity row(s) compared with the reference of another round (its own "
                     "round's sample missing or failed)")
    return CheckResult(name, bad.empty, detail, failures, notes)


def _tolerance_source(arm: str, own: dict[str, float]) -> str:
    return f"arm {arm}'s accept_near_ties" if arm in own else "gate.accept_near_ties"


def check_parity(g: GateInput) -> CheckResult:
    """Every non-reference sample equals the reference over the first K ids; an arm with ``parity =
    "numerics"`` is left to its numerics checks (its differing ids are noted)."""
    numerics = numerics_arms(g.record)
    if not numerics:
        return _parity_rows(g, "parity", "parity")
    theirs = (g.parity["check"] == "parity") & g.parity["arm"].isin(numerics)
    notes = []
    for arm, rows in g.parity[theirs].groupby("arm", sort=False):
        differ = int(_flags(rows["match"], False).sum())
        notes.append(f"parity: arm {arm} has parity = \"numerics\": {differ}/{int(rows['match'].notna().sum())} of "
                     f"its samples differ from {g.parity_reference} within the first {g.parity_tokens} ids; its "
                     "numerics checks judge it")
    if not (g.parity["check"] == "parity")[~theirs].any():
        return CheckResult("parity", True, f"no arm is judged by ids ({', '.join(numerics)}: by numerics checks)",
                           notes=notes)
    result = _parity_rows(replace(g, parity=g.parity[~theirs]), "parity", "parity")
    result.notes.extend(notes)
    return result


def check_reference_stable(g: GateInput) -> CheckResult:
    """Each parity reference's first K ids (the run's, and any arm's own) are equal across rounds."""
    return _parity_rows(g, "stability", "reference-stable")


def _path_failure(r: Any) -> str:
    head = f"active path: prompt {r.prompt_id}, arm {r.arm}, round {r.round} (position {r.position})"
    if r.status == "unreported":
        return f"{head}: expected {r.expect_path}, the engine reported no prefill path"
    if r.status == "silent":
        return (f"{head}: expected {r.expect_path}, engine ran {r.prefill_path} with no fallback reason "
                "(silent fallback)")
    elig = ("a multi-chunk prompt" if is_value(r.eligible, True) else
            "a prompt of unknown eligibility (the engine gave no n_chunks)")
    return (f"{head}: expected {r.expect_path}, engine fell back to {r.prefill_path} on {elig} "
            f"({r.fallback_reason}); list {r.arm} in gate.allow_fallback if this is expected")


def check_active_path(g: GateInput) -> CheckResult:
    """Arms with ``expect_path`` ran it (fallbacks only where allowed) and showed it at least once."""
    if not g.spec.require_active_path:
        return CheckResult("active-path", True, "not required (gate.require_active_path = false)")
    expecting = g.paths[g.paths["expect_path"].notna()]
    bad = expecting[_flags(expecting["allowed"], False)]
    failures = [_path_failure(r) for r in bad.itertuples()]
    notes: list[str] = []
    never: list[str] = []
    for arm, rows in expecting.groupby("arm", sort=False):
        if not (rows["status"] == "active").any():
            never.append(str(arm))
            failures.append(f"active path: arm {arm} never reported {rows['expect_path'].iloc[0]} on any of its "
                            f"{len(rows)} measured sample(s): the path was not shown to run")
    fallback = (expecting["status"] == "fallback").to_numpy(dtype=bool)
    allowed_fb = expecting[fallback & _flags(expecting["allowed"], True)]
    if not allowed_fb.empty:
        # the engine's reason may start with the mode it fell back from ("layer-major: prompt fits in one
        # chunk"): where that is the arm's name too, the arm is not named twice
        why = sorted({f"{r if str(r).startswith(f'{a}: ') else f'{a}: {r}'} "
                      f"({'one-chunk prompt' if is_value(e, False) else 'gate.allow_fallback'})"
                      for a, r, e in zip(allowed_fb["arm"], allowed_fb["fallback_reason"], allowed_fb["eligible"])})
        notes.append(f"{len(allowed_fb)} allowed fallback(s): " + ", ".join(why))
    if expecting.empty:
        detail = "no arm sets expect_path" if not any(expected_paths(g.record).values()) else \
            "no measured ok sample of an arm with expect_path"
    else:
        detail = (f"{int((expecting['status'] == 'active').sum())}/{len(expecting)} on the expected path, "
                  f"{len(allowed_fb)} allowed fallback(s), {len(bad)} not allowed")
        if never:
            detail += f"; never on the expected path: {', '.join(never)}"
    return CheckResult("active-path", bad.empty and not never, detail, failures, notes)


def _load_where(lv: Any) -> str:
    what = "alone" if lv.role == "reference" else lv.label
    return f"arm {lv.arm} {what}, round {lv.round}"


def check_load_levels(g: GateInput) -> CheckResult:
    """A load run: every planned cell recorded complete, some request ok, few enough failed."""
    record, spec = g.record, g.spec
    done = {(lv.arm, lv.role, lv.kind, float(lv.value), lv.round) for lv in record.load if lv.stopped is None}
    planned = planned_cells(record)
    fails = [f"missing: arm {a} {'alone' if role == 'reference' else f'{kind} {v:g}'}, round {r}: no complete "
             "level recorded" for a, role, kind, v, r in planned if (a, role, kind, v, r) not in done]
    levels = load_levels(record) + load_levels(record, "reference")
    reqs = [(lv, r) for lv in levels for r in (measured(lv) if lv.role == "load" else lv.requests)]
    ok = sum(1 for _, r in reqs if r.ok)
    failed = [(lv, r) for lv, r in reqs if not r.ok]
    if not planned:
        fails.append("the load run plans no level (no rounds or no levels): nothing to judge")
    elif not ok:
        fails.append("no load request is ok")
    notes = []
    if len(failed) > spec.max_failed_samples:
        fails += [f"failed: {_load_where(lv)}, request {r.index} ({r.prompt_id}): {r.error_kind or 'error'}"
                  + (f" {r.status}" if r.status else "") + f": {r.error or ''}" for lv, r in failed]
    elif failed:
        notes.append(f"{len(failed)} failed load request(s) tolerated (gate.max_failed_samples = "
                     f"{spec.max_failed_samples})")
    detail = (f"{sum(1 for c in planned if c in done)}/{len(planned)} planned levels complete; "
              f"{ok}/{len(reqs)} measured requests ok, {len(failed)} failed (tolerated: {spec.max_failed_samples})")
    return CheckResult("load-levels", not fails, detail, fails, notes)


def check_load_reference(g: GateInput) -> CheckResult:
    """A load run: the reference arm has ok measured load requests."""
    ref = g.reference
    n = sum(1 for lv in load_levels(g.record) if lv.arm == ref for r in measured(lv) if r.ok)
    if ref is None or not n:
        why = "no reference arm" if ref is None else f"reference arm {ref} has no ok measured load request"
        return CheckResult("reference", False, why, [why])
    return CheckResult("reference", True, f"{ref}: {n} ok measured load requests")


def _parity_run(g: GateInput) -> bool:
    return bool((g.record.profile.get("load") or {}).get("parity_reference", True))


def check_load_token_ids(g: GateInput) -> CheckResult:
    """A load run with parity references: every ok request carries the engine's own ids."""
    if not _parity_run(g):
        return CheckResult("token-ids", True, "not needed (load.parity_reference = false)")
    levels = load_levels(g.record) + load_levels(g.record, "reference")
    bad = [(lv, r) for lv in levels for r in lv.requests if r.ok and r.ids_source != "native"]
    fails = [f"token ids: {_load_where(lv)}, request {r.index} ({r.prompt_id}): ids_source {r.ids_source}; parity "
             "needs the engine's own ids" for lv, r in bad]
    return CheckResult("token-ids", not bad, f"{len(bad)} ok load request(s) without native ids", fails)


def check_load_parity(g: GateInput) -> CheckResult:
    """A load run: each arm's run alone equals the parity reference arm's over K ids (accepted near ties noted)."""
    if not _parity_run(g):
        return CheckResult("parity", True, "not run (load.parity_reference = false)", status="pass")
    rows = alone_parity(g.record)
    others = sorted({a for a, *_ in planned_cells(g.record)} - {g.parity_reference})
    if not rows and others:
        why = f"not checked: no run alone of {', '.join(others)} to compare with {g.parity_reference}'s"
        return CheckResult("parity", False, why, [f"parity: {why}"], status="not checked")
    head = "parity: prompt {prompt_id}, arm {arm} alone, round {round}"
    fails = [head.format(**r) + (": not compared (no ok run alone on one side)" if r["verdict"] == "unchecked" else
             f": {r['verdict']} at token {r['first_diverging']} against {r['against']}")
             for r in rows if not r["accepted"]]
    notes = [head.format(**r) + f": accepted near-tie flip at token {r['first_diverging']} (< {r['tolerance']:g} "
             "nats)" for r in rows if r["accepted"] and r["verdict"] == "near-tie"]
    same = sum(1 for r in rows if r["verdict"] == "identical")
    detail = (f"{same}/{len(rows)} runs alone equal to {g.parity_reference}'s over the first {g.parity_tokens} ids"
              if rows else "no arm besides the parity reference")
    return CheckResult("parity", not fails, detail, fails, notes)


def check_parity_under_load(g: GateInput) -> CheckResult:
    """A load run: in every cell every prompt kept its ids of the run alone (accepted near ties counted)."""
    if not _parity_run(g):
        return CheckResult("parity-under-load", True, "not run (load.parity_reference = false)")
    table = parity_under_load(g.record)
    if table.empty:
        why = "not checked: no load level recorded"
        return CheckResult("parity-under-load", False, why, [f"parity-under-load: {why}"], status="not checked")
    fails = []
    for r in table.itertuples():
        if r.kept < r.prompts:
            fails.append(f"parity-under-load: arm {r.arm} {r.level}: {r.kept}/{r.prompts} prompts kept their ids "
                         f"alone ({r.broken} broken, {r.near_tie} near-tie, {r.unchecked} not compared"
                         + (f"; e.g. {r.example}" if r.example else "") + ")")
    kept, total = int(table["kept"].sum()), int(table["prompts"].sum())
    return CheckResult("parity-under-load", not fails,
                       f"{kept}/{total} (cell, prompt) pairs kept their ids alone over the first "
                       f"{g.parity_tokens} ids", fails)


def declared_check(c: DeclaredCheck) -> Callable[[GateInput], CheckResult]:
    """A declared check (:mod:`abbench.analysis.declared`) as a gate check: every cell its selector picks
    must pass; a cell whose interval straddles the bound is inconclusive, which fails."""

    def check(g: GateInput) -> CheckResult:
        cells = judge(g.record, c)
        status = overall(cells)
        if not cells:
            msg = f"no measured data for {c.metric} of arm {c.arm} matches the selector"
            return CheckResult(c.name, False, msg, [f"{c.name}: {msg}"], status="FAIL")
        detail = "; ".join(describe_cell(c, x) for x in cells)
        failures = [f"{c.name}: {x.kind}{'' if x.tokens is None else f' {x.tokens}'}: {x.status}: "
                    f"{fmt_value(x.value)}, {x.why}" for x in cells if x.status != "pass"]
        return CheckResult(c.name, status == "pass", detail, failures,
                           status={"pass": "pass", "fail": "FAIL"}.get(status, status))

    check.__name__ = f"declared[{c.name}]"
    return check


CHECKS: list[Callable[[GateInput], CheckResult]] = [
    check_run_complete, check_samples, check_reference, check_token_ids, check_parity, check_reference_stable,
    check_active_path,
]
"""The checks the gate runs, in order (their verdict lines, failures and notes keep this order)."""

LOAD_CHECKS: list[Callable[[GateInput], CheckResult]] = [
    check_run_complete, check_load_levels, check_load_reference, check_load_token_ids, check_load_parity,
    check_parity_under_load,
]
"""The checks the gate runs on a load run (module docstring), in order."""


def run_checks(g: GateInput, checks: list[Callable[[GateInput], CheckResult]] | None = None) -> GateVerdict:
    """Run ``checks`` (default :data:`CHECKS`) on ``g``; the gate passes only when every check passes."""
    results = [c(g) for c in (CHECKS if checks is None else checks)]
    return GateVerdict(passed=all(r.passed for r in results), checks=[r.check for r in results],
                       failures=[f for r in results for f in r.failures], parity_tokens=g.parity_tokens,
                       notes=[n for r in results for n in r.notes])


def gate_checks(record: RunRecord, extra: list[str] | None = None) -> list[Callable[[GateInput], CheckResult]]:
    """:data:`CHECKS` (:data:`LOAD_CHECKS` for a load run), then the run's declared checks (its profile's ``gate.checks``), then ``extra``
    expressions (``abbench gate --check``). :class:`~abbench.errors.ConfigError` on a bad expression or an
    unknown arm."""
    declared = bind(record, declared_exprs(record), "gate.checks") + bind(record, list(extra or []), "--check")
    unique = {c.name: c for c in declared}  # the same check declared twice is judged once
    return [*(LOAD_CHECKS if is_load_run(record) else CHECKS), *(declared_check(c) for c in unique.values())]


def gate(record: RunRecord, *, parity_tokens: int | None = None, checks: list[str] | None = None,
         accept_near_ties: float | None = None) -> GateVerdict:
    """The gate's verdict on a run (rules in the module docstring). ``parity_tokens`` overrides
    ``gate.parity_tokens`` of the recorded profile, ``accept_near_ties`` its ``gate.accept_near_ties``;
    ``checks`` adds declared checks to the profile's."""
    with frames_cached():
        return _gate(record, parity_tokens, checks, accept_near_ties)


def _gate(record: RunRecord, parity_tokens: int | None, checks: list[str] | None,
          accept_near_ties: float | None) -> GateVerdict:
    k = parity_tokens_of(record, parity_tokens)
    if accept_near_ties is None:
        g = GateInput.of(record, k)
    else:
        g = GateInput.of(record, k, parity=parity_frame(record, parity_tokens=k, tolerance=accept_near_ties))
        g.spec = g.spec.model_copy(update={"accept_near_ties": accept_near_ties})
    return run_checks(g, gate_checks(record, checks))
