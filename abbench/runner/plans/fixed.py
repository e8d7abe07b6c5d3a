"""Fixed rounds (``run.rounds = N``): N ABBA rounds over the profile's prompts, planned before the run starts."""

from __future__ import annotations

from typing import Any

from abbench.profile import Profile
from abbench.results import PromptRecord, Step
from abbench.runner.plans.base import PlanStrategy
from abbench.runner.rounds import plan_for


class FixedRounds(PlanStrategy):
    """``run.rounds`` rounds; nothing is decided while the run goes (the fallback: it applies to any profile)."""

    kind = "fixed"

    @classmethod
    def applies(cls, profile: Profile) -> bool:
        return True

    def plan(self, prompts: list[PromptRecord], state: dict[str, Any] | None,
             recorded: list[Step] | None) -> list[Step]:
        return plan_for(self.profile, prompts, int(self.profile.run.rounds))
