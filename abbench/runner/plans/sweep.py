"""A sweep (a ``[sweep]`` table): its points' passes, refined near where two arms' TTFT cross, as
:mod:`abbench.runner.sweep` decides them (recorded in ``run.json``'s ``sweep``)."""

from __future__ import annotations

from typing import Any

from abbench.profile import Profile
from abbench.prompts import BuiltPrompt
from abbench.results import PromptRecord, RunRecord, Step
from abbench.runner import sweep as sweeps
from abbench.runner.plans.base import Extension, Notify, PlanStrategy


class SweepPasses(PlanStrategy):
    """The grid of the first stage first; after each pass, a refinement of the same stage, the next stage's
    grid, or the end."""

    kind = "sweep"
    state_field = "sweep"

    @classmethod
    def applies(cls, profile: Profile) -> bool:
        return sweeps.is_sweep(profile)

    def new_state(self) -> dict[str, Any]:
        return sweeps.initial_state(self.profile)

    def prompts(self, tokenizer: Any, state: dict[str, Any] | None) -> list[BuiltPrompt]:
        """The prompts of every point of every pass recorded (a new run: the grid's)."""
        assert state is not None
        return sweeps.build_points(tokenizer, self.profile, sweeps.all_points(state))

    def plan(self, prompts: list[PromptRecord], state: dict[str, Any] | None,
             recorded: list[Step] | None) -> list[Step]:
        assert state is not None
        return sweeps.sweep_plan(self.profile, prompts, state)

    def next(self, record: RunRecord, tokenizer: Any, notify: Notify) -> Extension:
        """The next pass (:func:`abbench.runner.sweep.next_pass`) with its new points' prompts built; its
        decision is recorded by the commit, with the prompts and the pass's steps."""
        profile = self.profile
        decision, nxt = sweeps.next_pass(record, profile)
        notify("service", f"sweep: {decision['next']}")
        known = {p.id for p in record.prompts}
        todo = [x for x in (nxt or {}).get("points", [])
                if not set(sweeps.point_prompt_ids(profile.sweep, x)) <= known]
        if todo:
            notify("prompts", f"building the prompts of {', '.join(map(str, todo))}")
        built = sweeps.build_points(tokenizer, profile, todo)

        def commit(rec: RunRecord) -> list[Step]:
            sweeps.record_pass(rec, decision, nxt)
            assert rec.sweep is not None
            full = sweeps.sweep_plan(profile, rec.prompts, rec.sweep)
            done = len(rec.plan)
            if [x.model_dump() for x in full[:done]] != [x.model_dump() for x in rec.plan]:
                raise AssertionError("a sweep's passes no longer rebuild the plan they made")
            return full[done:]

        return Extension(built, commit)

    def request_fields(self, step: Step) -> dict[str, Any]:
        return sweeps.request_fields(self.profile, step)
