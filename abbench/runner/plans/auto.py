"""Auto rounds (``run.rounds = "auto"``): ABBA rounds until every declared ratio check's interval is narrow, by the
stopping rule of :mod:`abbench.runner.rounds` (recorded in ``run.json``'s ``auto_rounds``)."""

from __future__ import annotations

from typing import Any

from abbench.profile import Profile
from abbench.results import PromptRecord, RunRecord, Step
from abbench.runner.plans.base import Extension, Notify, PlanStrategy
from abbench.runner.rounds import is_auto, next_round, plan_for, planned_rounds, rule


class AutoRounds(PlanStrategy):
    """``run.min_rounds`` rounds first (a resumed run: the rounds it recorded), then one round at a time while
    the rule asks for more."""

    kind = "auto"
    state_field = "auto_rounds"

    @classmethod
    def applies(cls, profile: Profile) -> bool:
        return is_auto(profile)

    def new_state(self) -> dict[str, Any]:
        return {"rule": rule(self.profile), "decisions": []}

    def plan(self, prompts: list[PromptRecord], state: dict[str, Any] | None,
             recorded: list[Step] | None) -> list[Step]:
        rounds = planned_rounds(recorded) if recorded else int(self.profile.run.min_rounds)
        return plan_for(self.profile, prompts, rounds)

    def next(self, record: RunRecord, tokenizer: Any, notify: Notify) -> Extension:
        """Decide after the rounds run so far (the decision is recorded at once); the next round's steps, or
        none when the rule stops the run."""
        steps = next_round(record, self.profile)
        decision = record.auto_rounds["decisions"][-1] if record.auto_rounds else {}
        notify("warning" if not steps and "max_rounds" in str(decision.get("reason")) else "service",
               f"auto rounds after round {decision.get('round')}: "
               + (f"one more ({decision.get('reason')})" if steps else f"stop: {decision.get('reason')}"))
        return Extension([], lambda _record: steps)
