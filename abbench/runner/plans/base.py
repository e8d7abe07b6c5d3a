"""The interface every kind of plan implements (:class:`PlanStrategy`), and what its :meth:`~PlanStrategy.next`
hands the run (:class:`Extension`). The strategies and their registry are :mod:`abbench.runner.plans`.

A kind of plan may also have steps of a kind of its own (load levels: one cell of many requests, not one
request): :meth:`PlanStrategy.own_steps` lists those still to run (each an :class:`OwnStep`: the arm, round and
service it needs) and :meth:`PlanStrategy.execute` runs one against its running service, with what the run lends
it (:class:`StepContext`), recording what it measured through the context at once."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Protocol

from abbench.loadrecords import LoadLevel
from abbench.profile import Profile
from abbench.prompts import BuiltPrompt
from abbench.results import PromptRecord, RunRecord, Step

Notify = Callable[..., None]
"""``notify(kind, message, done=None, total=None)``: a progress line for the run's observer (kind "service",
"prompts" or "warning"); ``done`` / ``total`` where the plan counts its own steps (a load run's cells)."""


class OwnStep(Protocol):
    """A step of a kind of plan's own kind: the service it runs on (``service``, the key of a plan block, as an
    ordinary step's) for ``arm`` in ``round``, at ``position`` in the round's arm order."""

    @property
    def arm(self) -> str: ...

    @property
    def round(self) -> int: ...

    @property
    def service(self) -> str: ...

    @property
    def position(self) -> int: ...


@dataclass(frozen=True)
class StepContext:
    """What the run lends :meth:`PlanStrategy.execute`: the tokenizer, each arm's request headers (its API key),
    the TLS rules, the engine's cache reset (``reset(arm, base_url)``: a no-op where the profile has none),
    ``record_load(level)`` (appends a load level to the record and saves run.json at once, signals held) and the
    progress lines."""

    tokenizer: Any
    headers: Callable[[str], dict[str, str]]
    verify: Any
    reset: Callable[[str, str], None]
    record_load: Callable[[LoadLevel], None]
    notify: Notify


class Extension(NamedTuple):
    """What a plan adds when the steps so far have run: ``prompts`` (built, not yet in the record) and
    ``commit(record) -> steps``, which records the decision in the plan's state and returns the steps to
    append ([] when the run stops). The run calls ``commit`` with the prompts already in ``record.prompts``,
    then appends the steps and saves, with signals held: all of it is in run.json, or none."""

    prompts: list[BuiltPrompt]
    commit: Callable[[RunRecord], list[Step]]


class PlanStrategy:
    """One kind of plan. A subclass sets :attr:`kind` (and :attr:`state_field` when it keeps a state in the run
    record) and implements :meth:`applies`, :meth:`plan` and, when the plan can grow, :meth:`next`; the other
    methods have defaults for a plan that is fixed before the run starts."""

    kind: ClassVar[str] = ""
    sequential: ClassVar[bool] = True
    """Whether the run builds the profile's own prompts ([prompts]) for ordinary steps; False for a kind of plan
    that runs only steps of its own (:meth:`own_steps`)."""
    state_field: ClassVar[str | None] = None
    """The :class:`~abbench.results.RunRecord` field that holds the state (a JSON-able dict), or None."""

    def __init__(self, profile: Profile) -> None:
        self.profile = profile

    @classmethod
    def applies(cls, profile: Profile) -> bool:
        """Whether ``profile`` asks for this kind of plan."""
        raise NotImplementedError

    def new_state(self) -> dict[str, Any] | None:
        """The state of a new run (recorded in :attr:`state_field` from the start)."""
        return None

    def state(self, existing: RunRecord | None) -> dict[str, Any] | None:
        """The state to plan from: a resumed run's recorded one, else :meth:`new_state`."""
        recorded = getattr(existing, self.state_field) if existing is not None and self.state_field else None
        return recorded if recorded else self.new_state()

    def record_fields(self, state: dict[str, Any] | None) -> dict[str, Any]:
        """The new run record's fields this plan sets (its state, under :attr:`state_field`)."""
        return {self.state_field: state} if self.state_field else {}

    def prompts(self, tokenizer: Any, state: dict[str, Any] | None) -> list[BuiltPrompt]:
        """Prompts the plan needs beyond the profile's own (built with ``tokenizer``), for everything ``state``
        has recorded so far."""
        return []

    def plan(self, prompts: list[PromptRecord], state: dict[str, Any] | None,
             recorded: list[Step] | None) -> list[Step]:
        """The steps of everything planned so far: a new run's first steps, or (``recorded``: a resumed run's
        plan) the same steps the run recorded, rebuilt (the resume refuses a plan that differs)."""
        raise NotImplementedError

    def next(self, record: RunRecord, tokenizer: Any, notify: Notify) -> Extension | None:
        """After every planned step has run: what to add (:class:`Extension`), or None when the plan was fixed
        from the start."""
        return None

    def request_fields(self, step: Step) -> dict[str, Any]:
        """Request fields the plan adds to ``step``'s over its arm's."""
        return {}

    def own_steps(self, record: RunRecord) -> list[OwnStep]:
        """The steps of this plan's own kind that ``record`` does not hold done yet, in order; the run takes them
        after the ordinary steps. Default: none."""
        return []

    def execute(self, step: OwnStep, base_url: str, ctx: StepContext) -> None:
        """Run one of :meth:`own_steps` against the running service at ``base_url`` and record it through
        ``ctx``; raises :class:`KeyboardInterrupt` after recording a step an interrupt stopped."""
        raise NotImplementedError(f"{self.kind} plans have no steps of their own")
