"""Load levels (a ``[load]`` table): round by round, each prompt alone on every arm (the parity reference), then
each level with the arms in the round's ABBA order (:func:`abbench.loadgen.level_plan`), every (arm, level)
cell run by :func:`abbench.loadgen.run_level` against that arm's running service and recorded in
``RunRecord.load`` the moment it ends.

Contract
--------
* A load run runs its load levels only: no sequential rounds (the profile's ``[prompts]`` are neither built nor
  sent; ``run.rounds`` is the number of rounds of levels). Its prompts are the load prompts
  (:func:`abbench.loadgen.build_load_prompts`), recorded in ``run.json``'s ``prompts`` so a resume (and a replay)
  rebuilds and checks them; ``run.json``'s ``plan`` stays empty. The gate judges such a run on its levels
  (:mod:`abbench.analysis.checks`).
* A cell's service is the one its arm's ordinary steps would use (:func:`service_key`): ``shared`` (or the arm's
  named service) with ``engine.shared_service``, else ``<arm>@r<round>``; consecutive cells on one service reuse
  it, so separate launched services are launched again at every change of arm (attach with ``base_url``, or
  share one service, to avoid it).
* Before each cell the engine's cache is reset (where the profile has a reset path and
  ``run.reset_between_samples``), so no cell meets prompts another cell left in the prefix cache.
* ``[load] warmup_requests`` > 0: before each level (not the parity reference) that many warm-up requests run
  on the cell's service (:meth:`abbench.loadgen.Level.warmup_of`, prompts of
  :func:`abbench.loadgen.build_warmup_prompts`), unrecorded, then the cache is reset again: a launched service is
  fresh at every change of arm, and a cold engine's first requests (kernel compilation, graph capture) would
  otherwise fall inside the measured window.
* Resume: the cells from :func:`abbench.loadgen.resume_at` on run again; a cell an interrupt stopped keeps its
  record (every request it finished) beside the cell that replaces it, which the analysis reads instead.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from abbench.loadgen import (
    Level,
    LevelStep,
    LoadPrompt,
    Target,
    build_load_items,
    build_warmup_prompts,
    level_plan,
    load_prompt,
    resume_at,
    run_level,
)
from abbench.profile import LoadSpec, Profile
from abbench.prompts import BuiltPrompt
from abbench.results import PromptRecord, RunRecord, Step
from abbench.runner.plans.base import PlanStrategy, StepContext


class LoadCell(NamedTuple):
    """One step of a load run: a :class:`~abbench.loadgen.LevelStep` and the key of the service it runs on."""

    level: LevelStep
    service: str

    @property
    def arm(self) -> str:
        return self.level.arm

    @property
    def round(self) -> int:
        return self.level.round

    @property
    def position(self) -> int:
        return self.level.position

    def describe(self) -> str:
        lv = self.level
        what = "alone (parity reference)" if lv.role == "reference" else (
            f"c={int(lv.value)}" if lv.kind == "concurrency" else f"rate={lv.value:g}")
        return f"{lv.arm} {what}, round {lv.round}"


def service_key(profile: Profile, arm: str, round_no: int) -> str:
    """The service a cell of ``arm`` in ``round_no`` runs on (as :func:`abbench.schedule.build_plan` keys them)."""
    if profile.engine.shared_service:
        return profile.arm(arm).service or "shared"
    return f"{arm}@r{round_no}"


def _load(profile: Profile) -> LoadSpec:
    assert profile.load is not None
    return profile.load


class LoadLevels(PlanStrategy):
    """Every cell of :func:`abbench.loadgen.level_plan`, run as steps of their own (module docstring)."""

    kind = "load"
    sequential = False

    def __init__(self, profile: Profile) -> None:
        super().__init__(profile)
        self._prompts: list[LoadPrompt] | None = None
        self._warmup: list[LoadPrompt] = []

    @classmethod
    def applies(cls, profile: Profile) -> bool:
        return profile.load is not None

    def prompts(self, tokenizer: Any, state: dict[str, Any] | None) -> list[BuiltPrompt]:
        p = self.profile
        items = build_load_items(tokenizer, p.prompts, _load(p), p.request.max_tokens, base_dir=p.profile_dir)
        self._prompts = [load_prompt(b, out) for b, out in items]
        self._warmup = build_warmup_prompts(tokenizer, p.prompts, _load(p), p.request.max_tokens,
                                            base_dir=p.profile_dir)
        return [b for b, _ in items]

    def plan(self, prompts: list[PromptRecord], state: dict[str, Any] | None,
             recorded: list[Step] | None) -> list[Step]:
        return []

    def cells(self) -> list[LoadCell]:
        """Every cell of the run, in order."""
        p = self.profile
        steps = level_plan([a.name for a in p.arms], _load(p), int(p.run.rounds))
        return [LoadCell(s, service_key(p, s.arm, s.round)) for s in steps]

    def own_steps(self, record: RunRecord) -> list[LoadCell]:  # type: ignore[override]
        cells = self.cells()
        return cells[resume_at([c.level for c in cells], record.load):]

    def execute(self, step: LoadCell, base_url: str, ctx: StepContext) -> None:  # type: ignore[override]
        """Reset the engine's cache, run the cell, record it; an interrupted cell is recorded, then re-raised."""
        if self._prompts is None:
            self.prompts(ctx.tokenizer, None)
        assert self._prompts is not None
        p, lv = self.profile, step.level
        eng = p.arm_engine(lv.arm)
        if p.run.reset_between_samples:
            ctx.reset(lv.arm, base_url)
        target = Target(base_url, p.request, adapter=eng.adapter,
                        extra={**p.request.extra, **p.arm(lv.arm).request}, model=eng.model,
                        headers=ctx.headers(lv.arm), metrics_path=eng.metrics_path or "", arm=lv.arm,
                        service=step.service, position=lv.position, verify=ctx.verify)
        cells = [c.level for c in self.cells()]
        at = cells.index(lv) if lv in cells else 0
        retokenize = lambda text: ctx.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
        if self._warmup and lv.role != "reference":
            ctx.notify("service", f"load: {step.describe()}: {len(self._warmup)} warm-up request(s)", done=at,
                       total=len(cells))
            warm = run_level(Level.warmup_of(_load(p), lv.kind, lv.value, round=lv.round), target, self._warmup,
                             retokenize=retokenize)
            if warm.stopped is not None:
                raise KeyboardInterrupt(warm.stopped)
            failed = [r for r in warm.requests if not r.ok]
            if failed:
                ctx.notify("warning", f"load: {step.describe()}: {len(failed)}/{len(warm.requests)} warm-up "
                           f"request(s) failed (the first: {failed[0].error_kind}: {failed[0].error}); the "
                           "level runs anyway", done=at, total=len(cells))
            if p.run.reset_between_samples:
                ctx.reset(lv.arm, base_url)
        ctx.notify("service", f"load: {step.describe()}", done=at, total=len(cells))
        level = Level.from_spec(_load(p), lv.kind, lv.value, round=lv.round, role=lv.role)
        record = run_level(level, target, self._prompts, retokenize=retokenize)
        ctx.record_load(record)
        ctx.notify("service", f"load: {step.describe()}: done", done=at + 1, total=len(cells))
        if record.stopped is not None:
            raise KeyboardInterrupt(record.stopped)
