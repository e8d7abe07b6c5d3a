"""Running a sweep: ``[sweep]`` in a profile makes ``abbench run`` (or ``abbench sweep``) measure its arms at the
points of one quantity and refine the points near where two arms' TTFT cross.

A sweep is one ordinary run: its prompts are ordinary prompts (fresh ones, or cold/continuation pairs), its
plan ordinary ABBA rounds (:func:`abbench.schedule.build_plan`), its samples ordinary samples, so ``report``,
``gate`` and ``compare`` read it like any run. What is particular to it:

* **Points and their prompts.** Point x of ``vary = "length"`` is ``per_point`` fresh prompts of x tokens
  (ids ``sweep-<x>-<i>``); of ``vary = "suffix"``, ``per_point`` pairs: a cold prompt of ``prefix_tokens``
  (``sweep-<x>-<i>-cold``) and its continuation by x tokens (``sweep-<x>-<i>-cont``), so the continuation's
  uncached suffix is x after a cached prefix. A point's prompts are built at positions of their own in the
  prompt set (from :data:`POSITION_BASE`, a function of x and i: :func:`abbench.prompts.build_prompt_items`): their
  text depends on the point alone, so two runs that refine to the same point measure the same prompts.
* **Stages.** With ``engine.shared_service`` the arms of each service form a stage (services in the order the
  profile's arms first name them); otherwise all arms are one stage. The sweep runs one stage at a time, so a
  shared service starts once for all its points (two routings on two services: two stages). The arms of a
  declared crossover share a stage (the profile validates it): the arms it compares are interleaved.
* **Passes.** A stage's first pass is the grid: its warm-ups, the profile's ordinary prompts and every grid
  point, in ``run.rounds`` ABBA rounds over the stage's arms. After each pass, every declared crossover of the
  stage (``sweep.crossovers``) is located (:func:`abbench.analysis.sweep.crossover`); one whose interval or
  bracket is wider than ``target_width`` of it, with fewer than ``max_refinements`` points added, asks for the
  geometric midpoint of its bracket (:func:`abbench.analysis.sweep.refinement_point`). Those points (every arm of the
  stage, every round) are the next pass; without any, the next stage's grid; without a next stage the sweep
  stops. On a shared service a later pass runs on the same service (no warm-ups again); with separate services
  each pass launches its services again (keys ``<arm>@r<round>.p<pass>``), warm-ups included.
* **Requests.** The cold prompts of a suffix sweep carry ``sweep.prefix_request`` over their arm's request
  fields (:func:`request_fields`): every arm can build its prefix the same, cheap way.
* **Record.** ``run.json``'s ``sweep`` holds the rule, each pass (stage, arms, points, why), each decision (per
  crossover: where it stood and what was done), why the sweep stopped, and its ``result``
  (:func:`abbench.analysis.sweep.sweep_summary`) once it has. A resumed run rebuilds its prompts and its plan
  from the recorded passes (the same steps, in the same order) and goes on deciding by the same rule.
"""

from __future__ import annotations

from typing import Any

from abbench.analysis.sweep import SWEEP_PREFIX, crossover, refinement_point, sweep_summary
from abbench.profile import Profile, SweepSpec
from abbench.prompts import BuiltPrompt, PromptItem, build_prompt_items
from abbench.results import PromptRecord, RunRecord, Step
from abbench.schedule import build_plan

__all__ = ["POSITION_BASE", "all_points", "build_points", "initial_state", "is_sweep", "next_pass",
           "point_prompt_ids", "record_pass", "request_fields", "rule", "stages", "sweep_plan"]

POSITION_BASE = 1_000_000
"""Sweep points' prompts sit at positions from here in the prompt set, clear of any profile's own prompts."""


def _position(k: int) -> int:
    """The position of a point's k-th prompt (k = x * per_point + i < 2^32): a bijective 32-bit mix of k
    (xorshift-multiply, each step invertible), so no two prompts share a position and the corpora (a position's
    corpus is position mod their count) rotate even over points that are powers of two."""
    h = k & 0xFFFFFFFF
    for _ in range(2):
        h ^= h >> 16
        h = (h * 0x45D9F3B) & 0xFFFFFFFF
    h ^= h >> 16
    return POSITION_BASE + h

WARMUP_KINDS = ("warmup", "jit")


def is_sweep(profile: Profile) -> bool:
    return profile.sweep is not None


def _spec(profile: Profile) -> SweepSpec:
    assert profile.sweep is not None, "not a sweep profile"
    return profile.sweep


def stages(profile: Profile) -> list[list[str]]:
    """The arms of each stage, in order (module docstring)."""
    if not profile.engine.shared_service:
        return [[a.name for a in profile.arms]]
    return [[a.name for a in arms] for arms in profile.service_groups().values()]


def point_prompt_ids(spec: SweepSpec, x: int) -> list[str]:
    """The ids of point ``x``'s prompts, in order."""
    if spec.vary == "suffix":
        return [f"{SWEEP_PREFIX}{x}-{i}-{part}" for i in range(spec.per_point) for part in ("cold", "cont")]
    return [f"{SWEEP_PREFIX}{x}-{i}" for i in range(spec.per_point)]


def _items(spec: SweepSpec, xs: list[int]) -> list[tuple[int, PromptItem]]:
    out = []
    for x in xs:
        for i in range(spec.per_point):
            base = f"{SWEEP_PREFIX}{x}-{i}"
            position = _position(x * spec.per_point + i)
            if spec.vary == "suffix":
                assert spec.prefix_tokens is not None
                out.append((position, PromptItem(base, "pair", (spec.prefix_tokens, spec.prefix_tokens + x),
                                                 (f"{base}-cold", f"{base}-cont"))))
            else:
                out.append((position, PromptItem(base, "fresh", (x,), (base,))))
    return out


def build_points(tok: Any, profile: Profile, xs: list[int]) -> list[BuiltPrompt]:
    """The exact-length prompts of points ``xs`` (module docstring)."""
    return build_prompt_items(tok, profile.prompts, _items(_spec(profile), sorted(xs)), base_dir=profile.profile_dir)


def rule(profile: Profile) -> dict[str, Any]:
    """The sweep's rule as recorded in run.json."""
    sw = _spec(profile)
    what = (f"uncached suffix after a cached {sw.prefix_tokens}-token prefix" if sw.vary == "suffix"
            else "fresh prompt length")
    pairs = ", ".join(f"{a} vs {b}" for a, b in sw.crossovers) or "none declared"
    return {"vary": sw.vary, "grid": list(sw.points), "target_width": sw.target_width,
            "max_refinements": sw.max_refinements, "crossovers": [list(p) for p in sw.crossovers],
            "stages": stages(profile),
            "text": (f"{what} at {', '.join(map(str, sw.points))} tokens, {sw.per_point} prompt(s) per point; "
                     f"crossovers ({pairs}) refined by bisection of their bracket until its 95% interval and the "
                     f"bracket are each at most {sw.target_width:g} of the crossover wide, at most "
                     f"{sw.max_refinements} point(s) each")}


def initial_state(profile: Profile) -> dict[str, Any]:
    """The sweep record of a new run: the rule and the first pass (stage 0's grid)."""
    return {"rule": rule(profile), "passes": [_grid_pass(profile, 0)], "decisions": []}


def _grid_pass(profile: Profile, stage: int) -> dict[str, Any]:
    return {"stage": stage, "arms": stages(profile)[stage], "points": list(_spec(profile).points), "pairs": [],
            "why": "grid"}


def all_points(state: dict[str, Any]) -> list[int]:
    """Every point of every pass recorded so far, ascending."""
    return sorted({int(x) for p in state["passes"] for x in p["points"]})


def _pass_prompts(profile: Profile, prompts: list[PromptRecord], state: dict[str, Any], k: int) -> list[PromptRecord]:
    """The prompts of pass ``k``: the warm-ups when its services are new, the profile's own prompts in a grid
    pass, and its points' prompts."""
    spec, p = _spec(profile), state["passes"][k]
    first_of_stage = all(q["stage"] != p["stage"] for q in state["passes"][:k])
    fresh_services = first_of_stage or not profile.engine.shared_service
    by_id = {r.id: r for r in prompts}
    out = [r for r in prompts if r.kind in WARMUP_KINDS and fresh_services]
    if p["why"] == "grid":
        out += [r for r in prompts if r.kind not in WARMUP_KINDS and not r.id.startswith(SWEEP_PREFIX)]
    out += [by_id[i] for x in p["points"] for i in point_prompt_ids(spec, int(x))]
    return out


def _pass_plan(profile: Profile, prompts: list[PromptRecord], state: dict[str, Any], k: int,
               offset: int) -> list[Step]:
    p = state["passes"][k]
    steps = build_plan(_pass_prompts(profile, prompts, state, k), list(p["arms"]), int(profile.run.rounds),
                       shared_service=profile.engine.shared_service,
                       services={a.name: a.service for a in profile.arms if a.service},
                       reset_between_samples=profile.run.reset_between_samples,
                       exclude_kinds=list(profile.run.exclude_kinds))
    relaunch = k > 0 and not profile.engine.shared_service  # a pass of its own services
    return [s.model_copy(update={"index": offset + s.index,
                                 "service": f"{s.service}.p{k}" if relaunch else s.service}) for s in steps]


def sweep_plan(profile: Profile, prompts: list[PromptRecord], state: dict[str, Any]) -> list[Step]:
    """The plan of every pass recorded in ``state``, in order (a new run's first pass; a resumed run's all)."""
    plan: list[Step] = []
    for k in range(len(state["passes"])):
        plan += _pass_plan(profile, prompts, state, k, len(plan))
    return plan


def request_fields(profile: Profile, step: Step) -> dict[str, Any]:
    """Request fields a sweep adds to ``step``'s over its arm's: ``prefix_request`` on a suffix sweep's cold
    prompts."""
    sw = profile.sweep
    if sw is not None and sw.prefix_request and step.kind == "cold" and step.prompt_id.startswith(SWEEP_PREFIX):
        return dict(sw.prefix_request)
    return {}


def _decide(record: RunRecord, profile: Profile, stage: int) -> tuple[list[int], list[list[str]], list[dict]]:
    """After the passes so far: the points to add to ``stage``, the crossovers asking for them, and one
    decision entry per crossover of the stage."""
    spec, state = _spec(profile), record.sweep or {}
    arms = set(stages(profile)[stage])
    measured = {int(x) for p in state["passes"] if p["stage"] == stage for x in p["points"]}
    new: list[int] = []
    asking: list[list[str]] = []
    entries = []
    for a, b in spec.crossovers:
        if a not in arms or b not in arms:
            continue
        c = crossover(record, a, b)
        done = sum(1 for p in state["passes"] if p["stage"] == stage and [a, b] in p.get("pairs", []))
        x = refinement_point(c, spec.target_width)
        if c.status not in ("crossing", "several"):
            action = "no crossing to refine"
        elif x is None:
            action = (f"settled: interval and bracket at most {spec.target_width:g} of the crossover wide, or no "
                      "point between")
        elif done >= spec.max_refinements:
            action = f"max_refinements reached ({spec.max_refinements}); would add {x}"
        elif x in measured:
            action = f"point {x} was measured already without pairs of both arms; not refined further"
        else:
            action = f"add point {x}"
            new.append(x)
            asking.append([a, b])
        entries.append({"pair": [a, b], "status": c.status, "estimate": c.estimate, "low": c.low, "high": c.high,
                        "summary": c.summary, "refinements": done, "action": action})
    return sorted(set(new)), asking, entries


def next_pass(record: RunRecord, profile: Profile) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Decide after the passes of ``record.sweep`` (all run): (the decision, the next pass or None when the
    sweep stops). Records nothing: :func:`record_pass` does, once the pass's prompts exist, so a run stopped in
    between keeps a plan its passes rebuild."""
    state = record.sweep
    assert state is not None, "a sweep run without its sweep record"
    stage = int(state["passes"][-1]["stage"])
    xs, asking, entries = _decide(record, profile, stage)
    decision: dict[str, Any] = {"after_pass": len(state["passes"]) - 1, "stage": stage, "crossovers": entries}
    if xs:
        nxt = {"stage": stage, "arms": stages(profile)[stage], "points": xs, "pairs": asking,
               "why": "refine " + "; ".join(f"{a} vs {b}" for a, b in asking)}
    elif stage + 1 < len(stages(profile)):
        nxt = _grid_pass(profile, stage + 1)
    else:
        nxt = None
    decision["next"] = nxt["why"] + f" at {', '.join(map(str, nxt['points']))}" if nxt else "stop"
    if nxt is None:
        decision["stopped"] = "; ".join(f"{e['pair'][0]} vs {e['pair'][1]}: {e['action']}" for e in entries) or \
            "the grid ran (no crossovers declared)"
    return decision, nxt


def record_pass(record: RunRecord, decision: dict[str, Any], nxt: dict[str, Any] | None) -> None:
    """Append ``decision`` and the pass it chose to ``record.sweep``; when the sweep stops, why and its result."""
    state = record.sweep
    assert state is not None, "a sweep run without its sweep record"
    state["decisions"].append(decision)
    if nxt is None:
        state["stopped"] = decision["stopped"]
        state["result"] = sweep_summary(record)
    else:
        state["passes"].append(nxt)
