"""The kinds of plan a run can follow, one strategy each, behind one interface
(:class:`~abbench.runner.plans.base.PlanStrategy`), so that :class:`abbench.runner.run.Run` is one loop:

* :class:`~abbench.runner.plans.fixed.FixedRounds` (``fixed.py``): ``run.rounds = N``, planned before the run;
* :class:`~abbench.runner.plans.auto.AutoRounds` (``auto.py``): ``run.rounds = "auto"``, a round at a time until
  the declared ratio checks' intervals are narrow;
* :class:`~abbench.runner.plans.sweep.SweepPasses` (``sweep.py``): a ``[sweep]``, pass after pass of points;
* :class:`~abbench.runner.plans.load.LoadLevels` (``load.py``): a ``[load]`` table, its levels' cells, each many
  requests at once, as steps of their own (no sequential rounds).

How the run uses a strategy (:func:`for_profile` picks it):

1. ``state(existing)``: the state to plan from, a resumed run's recorded one or ``new_state()``; a new run's
   record gets ``record_fields(state)`` (the state under ``state_field``, a :class:`~abbench.results.RunRecord`
   field).
2. ``prompts(tokenizer, state)``: the prompts it needs beyond the profile's own; then ``plan(prompts, state,
   recorded)``: the steps planned so far (for a resumed run, the same steps again: the resume compares them).
3. The run measures every step. Each request carries ``request_fields(step)`` over its arm's fields.
4. When every step has run, ``next(record, tokenizer, notify)``: None (nothing more, ever), or an
   :class:`~abbench.runner.plans.base.Extension`: new prompts, and ``commit(record)``, which records the
   decision in the state and returns the steps to append. The run appends the prompts and the steps and saves
   run.json, then measures those steps; [] ends the run (complete).
5. Steps of the plan's own kind (``own_steps(record)``: those not yet done; a strategy with ``sequential =
   False`` has only those, and the run builds none of the profile's ``[prompts]``) run after the ordinary
   ones: the run starts (or reuses) the step's service as for any step, then ``execute(step, base_url, ctx)``
   runs it and records it through ``ctx`` (:class:`~abbench.runner.plans.base.StepContext`).

A new kind of plan (load levels, say) is one new file: a subclass of ``PlanStrategy`` with its ``kind``, its
``applies(profile)`` (what in the profile asks for it), ``plan`` and, when it decides as it goes, ``next``
(and ``state_field`` with a :class:`~abbench.results.RunRecord` field when it records a state), named in
:data:`STRATEGIES` before the fallback (or added with :func:`register`). The steps it plans are ordinary steps
(:func:`abbench.schedule.build_plan`): the run, resume, report and gate read them as any others. A plan must be
rebuildable: ``plan`` on a resumed run's state gives the steps it recorded, and ``commit`` only appends.
"""

from __future__ import annotations

from abbench.profile import Profile
from abbench.runner.plans.auto import AutoRounds
from abbench.runner.plans.base import Extension, Notify, OwnStep, PlanStrategy, StepContext
from abbench.runner.plans.fixed import FixedRounds
from abbench.runner.plans.load import LoadLevels
from abbench.runner.plans.sweep import SweepPasses

STRATEGIES: dict[str, type[PlanStrategy]] = {s.kind: s for s in (LoadLevels, SweepPasses, AutoRounds, FixedRounds)}
"""Every kind of plan by its name, in the order :func:`for_profile` asks them; the last (fixed rounds) applies to
any profile."""


def register(cls: type[PlanStrategy]) -> type[PlanStrategy]:
    """Add a kind of plan to :data:`STRATEGIES`, before the fallback (fixed rounds); returns ``cls``."""
    if not cls.kind or cls.kind in STRATEGIES:
        raise ValueError(f"a kind of plan needs a name of its own: {cls.kind!r}")
    fallback = STRATEGIES.pop(FixedRounds.kind)
    STRATEGIES[cls.kind] = cls
    STRATEGIES[FixedRounds.kind] = fallback
    return cls


def for_profile(profile: Profile) -> PlanStrategy:
    """The strategy of the first kind of plan that ``profile`` asks for."""
    for cls in STRATEGIES.values():
        if cls.applies(profile):
            return cls(profile)
    raise AssertionError("fixed rounds apply to every profile")


__all__ = ["STRATEGIES", "AutoRounds", "Extension", "FixedRounds", "LoadLevels", "Notify", "OwnStep",
           "PlanStrategy", "StepContext", "SweepPasses", "for_profile", "register"]
