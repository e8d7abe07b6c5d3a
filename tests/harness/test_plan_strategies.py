"""The runner's plans as strategies (abbench.runner.plans): each profile gets one kind of plan, and a new kind
plugs in as one class, whose plan, next steps and per-request fields the run follows without knowing it, and
whose plan a resume rebuilds. The engine is tests/support/fakeserver.py, launched by the real runner; the
fields a strategy adds are seen on the wire (``fake_mode = "http-500"`` makes the engine refuse those steps)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Iterator

import pytest

from abbench import runner
from abbench.profile import profile_from_dict
from abbench.results import PromptRecord, RunRecord, Step
from abbench.runner import plans
from abbench.runner.plans import AutoRounds, Extension, FixedRounds, Notify, PlanStrategy, SweepPasses
from abbench.runner.rounds import plan_for, planned_rounds

from tests.support import faultkit as fk


def test_each_profile_gets_its_kind_of_plan() -> None:
    base = fk.fake_profile("x")
    assert type(plans.for_profile(profile_from_dict(base))) is FixedRounds
    auto = fk.fake_profile("x", arms=[{"name": "a"}, {"name": "b"}], run={"rounds": "auto", "max_rounds": 3,
                                                                                    "target_halfwidth": 0.05})
    auto["gate"] = {"checks": ["ttft_ratio[b] <= 2"]}
    assert type(plans.for_profile(profile_from_dict(auto))) is AutoRounds
    sweep = fk.fake_profile("x", prompts={"lengths": []})
    sweep["sweep"] = {"vary": "length", "points": [16, 32]}
    assert type(plans.for_profile(profile_from_dict(sweep))) is SweepPasses
    assert list(plans.STRATEGIES)[-1] == "fixed"  # the fallback is asked last


class TwoPhases(PlanStrategy):
    """Round 1 as planned; then, once, a second round whose arm-b requests carry ``fake_mode = "http-500"``."""

    kind = "two-phases"

    @classmethod
    def applies(cls, profile: Any) -> bool:
        return profile.name == "two-phases"

    def plan(self, prompts: list[PromptRecord], state: dict[str, Any] | None,
             recorded: list[Step] | None) -> list[Step]:
        return plan_for(self.profile, prompts, planned_rounds(recorded) if recorded else 1)

    def next(self, record: RunRecord, tokenizer: Any, notify: Notify) -> Extension:
        if planned_rounds(record.plan) >= 2:
            return Extension([], lambda _record: [])
        notify("service", "phase two")
        steps = plan_for(self.profile, record.prompts, 2)[len(record.plan):]
        return Extension([], lambda _record: steps)

    def request_fields(self, step: Step) -> dict[str, Any]:
        return {"fake_mode": "http-500"} if step.round == 2 and step.arm == "b" else {}


@pytest.fixture
def two_phases(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(plans, "STRATEGIES", dict(plans.STRATEGIES))
    plans.register(TwoPhases)
    assert list(plans.STRATEGIES) == ["load", "sweep", "auto", "two-phases", "fixed"]
    yield


def test_a_new_kind_of_plan_is_one_class(two_phases: None, tmp_path: Path) -> None:
    mark = fk.new_mark()
    prof = fk.fake_profile(mark, name="two-phases", arms=[{"name": "a"}, {"name": "b"}], prompts={"warmup": 0})
    events: list[runner.ProgressEvent] = []
    record = runner.execute(profile_from_dict(prof), tmp_path / "run", observer=events.append)
    fk.assert_no_leftovers(mark)
    assert record.status == "complete" and planned_rounds(record.plan) == 2 and len(record.samples) == 4
    assert [(s.round, s.arm, s.ok, s.error_kind) for s in record.samples] == [
        (1, "a", True, None), (1, "b", True, None), (2, "b", False, "http"), (2, "a", True, None)]
    assert any(e.message == "phase two" for e in events)

    # a resume rebuilds the plan the strategy made (two rounds) and runs the failed step again
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "run", cut)
    raw = json.loads((cut / "run.json").read_text())
    raw["samples"], raw["status"] = raw["samples"][:3], "partial"
    (cut / "run.json").write_text(json.dumps(raw))
    (cut / "requests.jsonl").write_bytes(b"".join((tmp_path / "run" / "requests.jsonl").read_bytes()
                                                  .splitlines(keepends=True)[:3]))
    again = runner.execute(profile_from_dict(prof), cut, resume=True)
    fk.assert_no_leftovers(mark)
    assert [(s.round, s.arm, s.ok) for s in again.samples] == [(1, "a", True), (1, "b", True), (2, "b", False),
                                                                (2, "a", True)]
    assert again.environment["resumed"][-1]["retried"][0]["arm"] == "b"


def test_register_refuses_a_kind_without_a_name_of_its_own(two_phases: None) -> None:
    with pytest.raises(ValueError, match="a name of its own"):
        plans.register(TwoPhases)
    with pytest.raises(ValueError, match="a name of its own"):
        plans.register(type("Nameless", (PlanStrategy,), {}))
