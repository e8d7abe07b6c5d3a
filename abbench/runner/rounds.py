"""Rounds until the answer is clear: ``[run] rounds = "auto"``.

The rule is fixed before the run starts and recorded in ``run.json`` (``auto_rounds.rule``): ABBA rounds go on
until every cell of every declared *ratio* check (``gate.checks`` whose metric is a ratio: ``ttft_ratio``,
``x_floor``) has a 95% interval whose half-width, relative to its median, is at most ``run.target_halfwidth``
("target reached"), or ``run.max_rounds`` rounds have run ("max_rounds reached"). At least
``run.min_rounds`` (default 2) rounds always run. A cell without an interval (one pair) is not narrow.

The plan stays deterministic: :func:`abbench.schedule.build_plan` with N + 1 rounds extends the plan of N
rounds (its first steps are the same), so when a round ends the runner appends the next round's steps
(:func:`next_round`). A resumed run rebuilds its plan with the rounds its recorded plan holds and goes on
with the same rule. Each decision is appended to ``auto_rounds.decisions`` (round, the widest relative
half-width, whether to go on) and the final reason is ``auto_rounds.stopped``; the report's header says it.
"""

from __future__ import annotations

from typing import Any

from abbench.analysis.declared import judge, parse_check
from abbench.profile import Profile
from abbench.results import PromptRecord, RunRecord, Step
from abbench.schedule import build_plan


def is_auto(profile: Profile) -> bool:
    return profile.run.rounds == "auto"


def ratio_checks(profile: Profile) -> list[str]:
    """The declared checks auto rounds narrow (ratio metrics)."""
    return [e for e in profile.gate.checks if parse_check(e).spec.ratio]


def rule(profile: Profile) -> dict[str, Any]:
    """The stopping rule as recorded in run.json."""
    r = profile.run
    return {"target_halfwidth": r.target_halfwidth, "min_rounds": r.min_rounds, "max_rounds": r.max_rounds,
            "checks": ratio_checks(profile),
            "text": (f"ABBA rounds until every cell of {', '.join(ratio_checks(profile))} has a 95% interval of "
                     f"relative half-width <= {r.target_halfwidth:g}, at least {r.min_rounds} and at most "
                     f"{r.max_rounds} rounds")}


def initial_rounds(profile: Profile) -> int:
    return int(profile.run.min_rounds) if is_auto(profile) else int(profile.run.rounds)


def plan_for(profile: Profile, prompts: list[PromptRecord], rounds: int) -> list[Step]:
    """The plan of ``rounds`` rounds for ``profile`` (the one place the runner builds it)."""
    return build_plan(prompts, [a.name for a in profile.arms], rounds, shared_service=profile.engine.shared_service,
                      services={a.name: a.service for a in profile.arms if a.service},
                      reset_between_samples=profile.run.reset_between_samples,
                      exclude_kinds=list(profile.run.exclude_kinds))


def planned_rounds(plan: list[Step]) -> int:
    return max((s.round for s in plan), default=0)


def widths(record: RunRecord, checks: list[str]) -> dict[str, float | None]:
    """Per cell of each ratio check ('check: kind length'): the relative half-width of its interval (None:
    no interval)."""
    out: dict[str, float | None] = {}
    for expr in checks:
        c = parse_check(expr)
        for cell in judge(record, c):
            out[f"{c.name}: {cell.kind} {cell.tokens}"] = cell.halfwidth
    return out


def decide(record: RunRecord, profile: Profile, rounds_done: int) -> tuple[bool, str, dict[str, Any]]:
    """(go on, reason, the decision recorded) after ``rounds_done`` rounds."""
    r = profile.run
    w = widths(record, ratio_checks(profile))
    known = [v for v in w.values() if v is not None]
    widest = max(known) if known and len(known) == len(w) else None
    narrow = bool(w) and widest is not None and widest <= float(r.target_halfwidth or 0)
    decision: dict[str, Any] = {"round": rounds_done, "widest_halfwidth": widest, "halfwidths": w}
    if rounds_done < int(r.min_rounds):
        go, reason = True, f"fewer than min_rounds ({r.min_rounds})"
    elif narrow:
        go, reason = False, (f"target reached: every ratio interval's relative half-width is <= "
                             f"{r.target_halfwidth:g} (widest {widest:.4f}) after {rounds_done} rounds")
    elif rounds_done >= int(r.max_rounds or 0):
        what = "no cell to measure" if not w else (
            f"widest relative half-width {widest:.4f}" if widest is not None else "a cell has no interval")
        go, reason = False, (f"max_rounds reached ({r.max_rounds}) before the target {r.target_halfwidth:g} "
                             f"({what})")
    else:
        what = "no interval yet" if widest is None else f"widest relative half-width {widest:.4f}"
        go, reason = True, f"{what} > {r.target_halfwidth:g}"
    decision.update(go_on=go, reason=reason)
    return go, reason, decision


def next_round(record: RunRecord, profile: Profile) -> list[Step]:
    """Decide after the rounds of ``record.plan`` (all done) and return the next round's steps to append, or
    [] when the run stops; records the decision (and the reason it stopped) in ``record.auto_rounds``."""
    done = planned_rounds(record.plan)
    go, reason, decision = decide(record, profile, done)
    state = record.auto_rounds if record.auto_rounds is not None else {"rule": rule(profile), "decisions": []}
    state["decisions"].append(decision)
    if not go:
        state["stopped"] = reason
        state["rounds"] = done
        record.auto_rounds = state
        return []
    record.auto_rounds = state
    longer = plan_for(profile, record.prompts, done + 1)
    if [s.model_dump() for s in longer[:len(record.plan)]] != [s.model_dump() for s in record.plan]:
        raise AssertionError("build_plan is not prefix-stable: the plan of N+1 rounds does not extend N's")
    return longer[len(record.plan):]
