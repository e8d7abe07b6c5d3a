"""The ABBA plan: order reverses every round, pairs stay together, exclusion is decided up front."""

from __future__ import annotations

import pytest

from abbench.results import PromptRecord
from abbench.schedule import arm_order, build_plan


def rec(pid: str, kind: str, n: int = 64, parent: str | None = None) -> PromptRecord:
    return PromptRecord(id=pid, kind=kind, target_tokens=n, token_count=n, sha256="0" * 64, corpus="essays",
                        parent=parent)


PROMPTS = [
    rec("warmup-0", "warmup", 8),
    rec("jit-0", "jit", 256),
    rec("fresh-128-0", "fresh", 128),
    rec("fresh-512-0", "fresh", 512),
    rec("pair0-cold", "cold", 256),
    rec("pair0-cont", "continuation", 300, parent="pair0-cold"),
]


def test_arm_order_reverses_each_round() -> None:
    assert arm_order(["A", "B", "C"], 1) == ["A", "B", "C"]
    assert arm_order(["A", "B", "C"], 2) == ["C", "B", "A"]
    assert arm_order(["A", "B", "C"], 3) == ["A", "B", "C"]


def test_separate_services_abba_blocks() -> None:
    plan = build_plan(PROMPTS, ["A", "B"], 2, shared_service=False, reset_between_samples=True,
                      exclude_kinds=["warmup", "jit"])
    services = []
    for s in plan:
        if not services or services[-1] != s.service:
            services.append(s.service)
    assert services == ["A@r1", "B@r1", "B@r2", "A@r2"]
    assert [s.index for s in plan] == list(range(len(plan)))
    # Each block: warm-ups first, then every group; the continuation right after its cold prompt, no reset.
    block = [s for s in plan if s.service == "B@r2"]
    assert [s.prompt_id for s in block] == ["warmup-0", "jit-0", "fresh-128-0", "fresh-512-0", "pair0-cold",
                                            "pair0-cont"]
    assert [s.reset_before for s in block] == [False, False, True, True, True, False]
    assert all(s.position == 0 for s in block)  # B runs first in round 2
    assert {s.position for s in plan if s.service == "A@r2"} == {1}


def test_exclusion_is_decided_by_the_rule() -> None:
    plan = build_plan(PROMPTS, ["A", "B"], 2, shared_service=False, reset_between_samples=True,
                      exclude_kinds=["warmup", "jit"])
    assert {s.kind for s in plan if s.excluded} == {"warmup", "jit"}
    assert all(not s.excluded for s in plan if s.kind in ("fresh", "cold", "continuation"))
    plan2 = build_plan(PROMPTS, ["A"], 1, shared_service=False, reset_between_samples=True, exclude_kinds=[])
    assert not any(s.excluded for s in plan2)


def test_shared_service_interleaves_per_group() -> None:
    plan = build_plan(PROMPTS, ["A", "B"], 2, shared_service=True, reset_between_samples=True,
                      exclude_kinds=["warmup", "jit"])
    assert {s.service for s in plan} == {"shared"}
    measured = [(s.round, s.arm, s.prompt_id) for s in plan if not s.excluded]
    assert measured[:4] == [(1, "A", "fresh-128-0"), (1, "B", "fresh-128-0"), (1, "A", "fresh-512-0"),
                            (1, "B", "fresh-512-0")]
    # A pair runs back to back on one arm, then the other arm.
    assert measured[4:8] == [(1, "A", "pair0-cold"), (1, "A", "pair0-cont"), (1, "B", "pair0-cold"),
                             (1, "B", "pair0-cont")]
    assert measured[8][:2] == (2, "B")  # round 2 reversed
    # Every arm gets its warm-ups once, before any measured sample.
    warm = [(s.arm, s.prompt_id) for s in plan if s.excluded]
    assert warm == [("A", "warmup-0"), ("A", "jit-0"), ("B", "warmup-0"), ("B", "jit-0")]
    assert plan.index(next(s for s in plan if not s.excluded)) == 4


def test_every_arm_sees_every_prompt_every_round() -> None:
    arms = ["A", "B", "C"]
    plan = build_plan(PROMPTS, arms, 3, shared_service=False, reset_between_samples=False, exclude_kinds=[])
    for r in (1, 2, 3):
        for a in arms:
            got = sorted(s.prompt_id for s in plan if s.round == r and s.arm == a)
            assert got == sorted(p.id for p in PROMPTS)
    assert not any(s.reset_before for s in plan)


def test_bad_input() -> None:
    with pytest.raises(ValueError):
        build_plan(PROMPTS, [], 1, shared_service=False, reset_between_samples=True, exclude_kinds=[])
    with pytest.raises(ValueError):
        build_plan([rec("c", "continuation", parent=None)], ["A"], 1, shared_service=False,
                   reset_between_samples=True, exclude_kinds=[])


def test_named_services_form_blocks_that_reverse_each_round():
    """Offloaded arms on one service, resident on its own: per round one block per service, in the order the
    round's arm order reaches them; warm-ups once per service; positions are the round's order."""
    prompts = [rec("w0", "warmup", 8), rec("f1", "fresh", 64), rec("f2", "fresh", 128)]
    services = {"chunked": "offloaded", "layer-major": "offloaded", "resident": "resident"}
    plan = build_plan(prompts, ["chunked", "layer-major", "resident"], 2, shared_service=True,
                      reset_between_samples=True, exclude_kinds=["warmup"], services=services)
    seq = [(s.round, s.service, s.arm, s.prompt_id, s.position) for s in plan]
    assert seq == [
        (1, "offloaded", "chunked", "w0", 0), (1, "offloaded", "layer-major", "w0", 1),
        (1, "offloaded", "chunked", "f1", 0), (1, "offloaded", "layer-major", "f1", 1),
        (1, "offloaded", "chunked", "f2", 0), (1, "offloaded", "layer-major", "f2", 1),
        (1, "resident", "resident", "w0", 2), (1, "resident", "resident", "f1", 2), (1, "resident", "resident", "f2", 2),
        (2, "resident", "resident", "f1", 0), (2, "resident", "resident", "f2", 0),
        (2, "offloaded", "layer-major", "f1", 1), (2, "offloaded", "chunked", "f1", 2),
        (2, "offloaded", "layer-major", "f2", 1), (2, "offloaded", "chunked", "f2", 2),
    ]
    assert all(s.excluded == (s.kind == "warmup") for s in plan)
