"""The interleaved, reversed-order plan (pure: no I/O).

Arms run in rounds; round 1 takes the arms in profile order (A, B, C), round 2 reversed (C, B, A), and so
on (ABBA...), so drift over time (thermal, caches, a noisy neighbour) falls equally on every arm.

* Separate services (default): each arm gets a fresh service per round. Its block is: warm-ups, the
  optional long JIT warm-up, then every sample group in order. Key of the service: ``<arm>@r<round>``.
* Shared service (``engine.shared_service``): one service for the run; each arm's warm-ups (and JIT
  warm-up) run first, then for every group the arms alternate in the round's order. Key: ``shared``.
  When arms name services (``services``: arm -> service name), each service's arms form a block per round;
  blocks run in the order the round's arm order first reaches them (so they reverse too), each service's
  arms warm up at its first block, and within a block the arms alternate per group as above. Key: the
  service's name (a service stopped for another block is relaunched and primed with its warm-ups).

A sample group is one fresh prompt, or a cold prompt followed by its continuation (same arm, back to
back, no reset between them, so the continuation can hit the prefix cache). The engine is reset before
every group when the profile says so. Exclusion is decided here, from the profile's rule, before any
request runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from abbench.results import PromptRecord, Step


@dataclass(frozen=True)
class Group:
    """Prompts that run back to back on one arm (a fresh prompt, or cold + continuation)."""

    name: str
    prompt_ids: tuple[str, ...]


def groups_from_prompts(prompts: list[PromptRecord]) -> tuple[list[str], list[str], list[Group]]:
    """Split prompt records into warm-up ids, JIT warm-up ids and measured groups (in order)."""
    warmups = [p.id for p in prompts if p.kind == "warmup"]
    jit = [p.id for p in prompts if p.kind == "jit"]
    groups: list[Group] = []
    children: dict[str, list[str]] = {}
    for p in prompts:
        if p.kind == "continuation":
            if p.parent is None:
                raise ValueError(f"continuation prompt {p.id} has no parent")
            children.setdefault(p.parent, []).append(p.id)
    for p in prompts:
        if p.kind == "fresh":
            groups.append(Group(p.id, (p.id,)))
        elif p.kind == "cold":
            groups.append(Group(p.id, (p.id, *children.get(p.id, []))))
    return warmups, jit, groups


def arm_order(arms: list[str], round_no: int) -> list[str]:
    """Round 1 in profile order, round 2 reversed, round 3 in order again, ..."""
    return list(arms) if round_no % 2 == 1 else list(reversed(arms))


def build_plan(
    prompts: list[PromptRecord],
    arms: list[str],
    rounds: int,
    *,
    shared_service: bool,
    reset_between_samples: bool,
    exclude_kinds: list[str],
    services: dict[str, str] | None = None,
) -> list[Step]:
    if not arms:
        raise ValueError("no arms")
    if rounds < 1:
        raise ValueError("rounds must be >= 1")
    kinds = {p.id: p.kind for p in prompts}
    warmups, jit, groups = groups_from_prompts(prompts)
    excluded = set(exclude_kinds)
    steps: list[Step] = []

    def add(round_no: int, arm: str, position: int, prompt_id: str, group: str, service: str, reset: bool) -> None:
        kind = kinds[prompt_id]
        steps.append(
            Step(
                index=len(steps),
                round=round_no,
                arm=arm,
                position=position,
                prompt_id=prompt_id,
                kind=kind,
                group=group,
                service=service,
                reset_before=reset,
                excluded=kind in excluded,
            )
        )

    def warm(round_no: int, arm: str, position: int, service: str) -> None:
        for pid in warmups + jit:
            add(round_no, arm, position, pid, pid, service, False)

    def run_group(round_no: int, arm: str, position: int, g: Group, service: str) -> None:
        for i, pid in enumerate(g.prompt_ids):
            add(round_no, arm, position, pid, g.name, service, reset_between_samples and i == 0)

    if shared_service:
        service_of = {a: (services or {}).get(a) or "shared" for a in arms}
        warmed: set[str] = set()
        for r in range(1, rounds + 1):
            order = arm_order(arms, r)
            blocks = list(dict.fromkeys(service_of[a] for a in order))  # services in first-reached order
            for service in blocks:
                if service not in warmed:
                    warmed.add(service)
                    for pos, arm in enumerate(order if r == 1 else arm_order(arms, 1)):
                        if service_of[arm] == service:
                            warm(r, arm, pos, service)
                for g in groups:
                    for pos, arm in enumerate(order):
                        if service_of[arm] == service:
                            run_group(r, arm, pos, g, service)
    else:
        for r in range(1, rounds + 1):
            for pos, arm in enumerate(arm_order(arms, r)):
                service = f"{arm}@r{r}"
                warm(r, arm, pos, service)
                for g in groups:
                    run_group(r, arm, pos, g, service)
    return steps
