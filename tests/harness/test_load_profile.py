"""The ``[load]`` table and the load grammar: levels, arrivals, lengths, SLOs and level selectors are checked
before any request, with errors that name the field."""

from __future__ import annotations

import math
from typing import Any

import pytest

from abbench.checkexpr import level_label, parse_check, parse_slo
from abbench.errors import ConfigError
from abbench.profile import parse_levels, profile_from_dict


def _profile(load: dict[str, Any] | None, checks: list[str] | None = None, **more: Any) -> Any:
    data: dict[str, Any] = {"name": "x", "engine": {"base_url": "http://127.0.0.1:1"},
                            "arms": [{"name": "a"}, {"name": "b"}], "gate": {"checks": checks or []}, **more}
    if load is not None:
        data["load"] = load
    return profile_from_dict(data)


def test_levels_round_trip_through_the_recorded_profile() -> None:
    p = _profile({"concurrency": [1, 4, 16], "rate": [2, "inf"], "slo": ["ttft_s <= 2", "tpot_s <= 0.05"]},
                 ["parity_under_load[b, c=16]", "throughput_ratio[b, rate=inf] >= 1.2"])
    assert p.load.levels() == [("concurrency", 1.0), ("concurrency", 4.0), ("concurrency", 16.0),
                               ("rate", 2.0), ("rate", math.inf)]
    dumped = p.model_dump()
    assert dumped["load"]["rate"] == [2.0, "inf"]  # JSON has no infinity
    assert profile_from_dict(dumped).load.rate == [2.0, math.inf]
    assert p.load.n_requests == 32 and p.load.n_prompts == 32


def test_a_profile_without_load_dumps_none() -> None:
    assert _profile(None).load is None


@pytest.mark.parametrize(("load", "needle"), [
    ({"concurrency": [0]}, "load.concurrency.0: Input should be greater than 0"),
    ({"rate": [-1]}, "rate -1: a rate is requests/s above 0"),
    ({"rate": [0]}, "a rate of 0 would send nothing"),
    ({"concurrency": [1], "slo": ["latency <= 1"]}, "unknown metric 'latency'"),
    ({"concurrency": [1], "slo": ["ttft_s < 1"]}, "not of the form METRIC <= VALUE"),
    ({}, "give at least one level"),
    ({"concurrency": [1], "requests": 4, "duration_s": 3}, "requests or duration_s"),
    ({"concurrency": [1], "burstiness": 0.5}, "burstiness applies to arrival = \"gamma\""),
    ({"concurrency": [2, 2]}, "distinct"),
    ({"concurrency": [1], "prompt_tokens": {"uniform": [9, 3]}}, "low is above high"),
    ({"concurrency": [1], "prompt_tokens": {"values": [8, 16], "weights": [1]}}, "weights needs values"),
    ({"concurrency": [1], "prompt_tokens": {}}, "give exactly one of"),
    ({"concurrency": [1], "warmup": 3}, "unknown field"),
    ({"rate": [4, "inf"], "duration_s": 30}, "rate = inf sends every request at once"),
])
def test_bad_load_tables_are_refused_naming_the_field(load: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError, match=None) as e:
        _profile(load)
    assert needle in str(e.value), str(e.value)


def test_cross_table_rules() -> None:
    with pytest.raises(ConfigError, match="request.stream must be true"):
        _profile({"concurrency": [1]}, request={"stream": False})
    with pytest.raises(ConfigError, match="add a \\[load\\] table"):
        _profile(None, ["goodput[a, c=4] >= 1"])
    with pytest.raises(ConfigError, match="selects c=8, which is not a level"):
        _profile({"concurrency": [1, 4]}, ["ttft_p99_s[a, c=8] <= 1"])
    with pytest.raises(ConfigError, match="needs load.slo"):
        _profile({"concurrency": [4]}, ["goodput[a, c=4] >= 1"])
    with pytest.raises(ConfigError, match="needs load.parity_reference"):
        _profile({"concurrency": [4], "parity_reference": False}, ["parity_under_load[b, c=4]"])
    with pytest.raises(ConfigError, match="is the reference arm"):
        _profile({"concurrency": [4]}, ["throughput_ratio[a, c=4] >= 1"])
    with pytest.raises(ConfigError, match="fixed number of rounds"):
        _profile({"concurrency": [4]}, ["ttft_ratio[b] <= 1"], run={"rounds": "auto"})


def test_level_selectors_parse_and_print() -> None:
    c = parse_check("parity_under_load[b, c=16]")
    assert (c.metric, c.level, c.op, c.value, c.load) == ("parity_under_load", "c=16", ">=", 1.0, True)
    assert c.name == "parity_under_load[b, c=16] >= 1"
    c = parse_check("throughput_ratio[b, rate=8, vs a] >= 1.5")
    assert (c.level, c.vs, c.name) == ("rate=8", "a", "throughput_ratio[b, rate=8, vs a] >= 1.5")
    assert parse_check("ttft_p99_s[a, rate=inf] <= 2").level == "rate=inf"
    assert parse_check("ttft_p99_s[a, rate=0.50] <= 2").level == "rate=0.5"
    assert not parse_check("ttft_p99_s[a] <= 2").load  # a sequential check, as before
    assert parse_check("goodput[a] >= 1").load and parse_check("goodput[a] >= 1").level is None
    assert level_label("concurrency", 4.0) == "c=4" and level_label("rate", math.inf) == "rate=inf"


@pytest.mark.parametrize(("expr", "needle"), [
    ("ttft_ratio[b, c=4] <= 1", "not measured per load level"),
    ("goodput[a, fresh, c=4] >= 1", "selected by its level"),
    ("ttft_s[a, c=0] <= 1", "c=0 is not a concurrency"),
    ("ttft_s[a, c=1.5] <= 1", "not a concurrency"),
    ("ttft_s[a, rate=-2] <= 1", "rate=-2 is not a request rate"),
    ("ttft_s[a, rate=x] <= 1", "is not a number"),
    ("goodput[a, c=4]", "missing comparison"),
])
def test_bad_level_selectors(expr: str, needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_check(expr)
    assert needle in str(e.value)


def test_slos_and_command_line_levels() -> None:
    s = parse_slo("tpot_s <= 0.05")
    assert (s.metric, s.op, s.value) == ("tpot_s", "<=", 0.05)
    assert s.met(0.05) and not s.met(0.051) and not s.met(None)
    assert parse_slo("e2e_s >= 0").met(0.0)
    with pytest.raises(ConfigError, match="finite"):
        parse_slo("ttft_s <= inf")
    assert parse_levels("1,4,16", "concurrency") == [1.0, 4.0, 16.0]
    assert parse_levels("2, 8, inf", "rate") == [2.0, 8.0, math.inf]
    for text, kind, needle in (("1,0", "concurrency", "0 is not a concurrency"), ("2,-1", "rate", "-1 is not a rate"),
                               ("0", "rate", "0 is not a rate"), ("a", "rate", "'a' is not a number")):
        with pytest.raises(ConfigError, match=needle):
            parse_levels(text, kind)  # type: ignore[arg-type]


def test_command_line_levels_replace_the_tables() -> None:
    p = _profile({"concurrency": [1, 4], "rate": [8], "slo": ["ttft_s <= 2"]})
    q = p.with_overrides(concurrency=[2.0, 16.0])
    assert (q.load.concurrency, q.load.rate, q.load.slo) == ([2, 16], [], ["ttft_s <= 2"])
    r = p.with_overrides(rate=[math.inf])
    assert (r.load.concurrency, r.load.rate) == ([], [math.inf])
    fresh = _profile(None).with_overrides(concurrency=[4.0])
    assert fresh.load.concurrency == [4] and fresh.load.requests is None and fresh.load.n_requests == 32
    assert _profile(None).with_overrides(rounds=3).load is None


def test_the_level_plan_runs_the_arms_abba_at_each_level_and_resumes_where_it_stopped() -> None:
    from abbench.loadgen import level_plan, resume_at
    from abbench.loadrecords import LoadLevel
    from abbench.profile import LoadSpec

    load = LoadSpec(concurrency=[1, 4], rate=[8])
    plan = level_plan(["a", "b"], load, 2)
    cells = [(s.round, s.role, s.kind[0] + str(int(s.value)), s.arm, s.position) for s in plan]
    assert cells[:8] == [(1, "reference", "c1", "a", 0), (1, "reference", "c1", "b", 1),
                         (1, "load", "c1", "a", 0), (1, "load", "c1", "b", 1), (1, "load", "c4", "a", 0),
                         (1, "load", "c4", "b", 1), (1, "load", "r8", "a", 0), (1, "load", "r8", "b", 1)]
    assert [c[3] for c in cells[8:]] == ["b", "a"] * 4  # round 2 reversed
    assert len(level_plan(["a", "b"], LoadSpec(concurrency=[1], parity_reference=False), 3)) == 6

    def record(step, stopped=None):  # type: ignore[no-untyped-def]
        return LoadLevel(arm=step.arm, round=step.round, role=step.role, kind=step.kind, value=step.value,
                         started_at=0.0, window_start_s=0.0, window_end_s=0.0, elapsed_s=0.0, stopped=stopped)

    assert resume_at(plan, []) == 0
    assert resume_at(plan, [record(s) for s in plan[:5]]) == 5
    assert resume_at(plan, [record(s) for s in plan[:4]] + [record(plan[4], "interrupted")]) == 4
    assert resume_at(plan, [record(s) for s in plan]) == len(plan)


def test_command_line_levels_leave_out_the_checks_on_levels_they_do_not_run() -> None:
    """`abbench run -p cpu-tiny-load --concurrency 1,2` was refused because the profile checks c=4: the flags
    replace the levels, so the checks on the levels they drop go too (as --arms drops other arms' checks)."""
    checks = ["parity_under_load[b, c=4]", "throughput_ratio[b, rate=inf] >= 1.2", "ttft_ratio[b] <= 2"]
    p = _profile({"concurrency": [1, 4], "rate": ["inf"]}, checks)
    assert p.with_overrides(concurrency=[1.0, 2.0]).gate.checks == ["ttft_ratio[b] <= 2"]
    assert p.with_overrides(concurrency=[4.0], rate=[math.inf]).gate.checks == checks
    assert p.with_overrides(rate=[math.inf]).gate.checks == checks[1:]
