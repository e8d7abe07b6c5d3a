"""Load-cell metrics against hand-computed small cases, the throughput ratio paired by level and round, goodput,
errors, in-flight, parity under load (planted near tie, planted divergence) and the load checks."""

from __future__ import annotations

from typing import Any

import pytest

from abbench.analysis import load as al
from abbench.analysis.declared import describe_cell, judge, parse_check
from abbench.loadgen import Level, LoadPrompt, Target, run_level
from abbench.loadrecords import LoadLevel, LoadRequest
from abbench.profile import RequestSpec, profile_from_dict
from abbench.results import RunRecord
from tests.support.fastsse import FastServer


def _req(index: int, sent: float, times: list[float] | None, *, ok: bool = True, prompt: str = "load-0",
         ids: list[int] | None = None, logprobs: Any = None, **kw: Any) -> LoadRequest:
    if not ok:
        return LoadRequest(index=index, prompt_id=prompt, target_tokens=8, max_tokens=3, sent_s=sent, end_s=sent,
                           ok=False, **kw)
    assert times
    ids = ids if ids is not None else [1, 2, 3][: len(times)]
    return LoadRequest(index=index, prompt_id=prompt, target_tokens=8, max_tokens=len(ids), sent_s=sent,
                       first_token_s=sent + times[0], end_s=sent + times[-1], token_times_s=times, ok=True,
                       output_ids=ids, ids_source="native", completion_tokens=len(ids), logprobs=logprobs, **kw)


def _level(arm: str, requests: list[LoadRequest], *, rnd: int = 1, role: str = "load", lo: float = 1.0,
           hi: float = 5.0) -> LoadLevel:
    return LoadLevel(arm=arm, round=rnd, role=role, kind="concurrency", value=2, started_at=0.0,  # type: ignore[arg-type]
                     window_start_s=lo, window_end_s=hi, elapsed_s=max((r.end_s or 0) for r in requests),
                     requests=requests)


def _record(levels: list[LoadLevel], slo: list[str] | None = None, checks: list[str] | None = None,
            **gate: Any) -> RunRecord:
    prof = profile_from_dict({"name": "t", "engine": {"base_url": "http://127.0.0.1:1"},
                              "arms": [{"name": "a"}, {"name": "b"}],
                              "load": {"concurrency": [2], "slo": slo or []},
                              "gate": {"checks": checks or [], **gate}})
    rec = RunRecord(run_id="t", status="complete", created_at=0.0, abbench_version="0", profile=prof.model_dump(),
                    load=levels)
    return RunRecord.model_validate_json(rec.model_dump_json())  # as read back from run.json


HAND = [
    _req(0, 0.5, [0.2, 0.6, 1.0]),  # sent before the window: not measured; tokens at 0.7, 1.1, 1.5
    _req(1, 1.0, [0.5, 1.0, 1.5]),  # ttft 0.5, e2e 1.5, tpot 0.5, itl 0.5 0.5; tokens at 1.5, 2.0, 2.5
    _req(2, 2.0, None, ok=False, error_kind="http", status=429, error="refused"),
    _req(3, 4.0, [0.2, 1.0, 2.0]),  # ttft 0.2, e2e 2.0, tpot 0.9, itl 0.8 1.0; tokens at 4.2, 5.0, 6.0
    _req(4, 5.5, [0.1, 0.2, 0.3]),  # after the window
]


def test_a_level_by_hand() -> None:
    lv = _level("a", HAND)
    assert [r.index for r in al.measured(lv)] == [1, 2, 3]
    m = al.request_metrics(HAND[3])
    assert m["ttft"] == pytest.approx(0.2) and m["e2e"] == pytest.approx(2.0) and m["tpot"] == pytest.approx(0.9)
    assert list(m["itl"]) == pytest.approx([0.8, 1.0]) and m["lag"] is None
    f = al.round_figures(lv, [])
    # window 1..5 (4 s): ok ends in it r0 (1.5), r1 (2.5); tokens in it: r0 2, r1 3, r3 2 (4.2, 5.0)
    assert f == {"request_s": pytest.approx(0.5), "output_tok_s": pytest.approx(7 / 4),
                 "decode_output_tok_s": f["decode_output_tok_s"], "goodput": None, "error_rate": pytest.approx(1 / 3)}
    from abbench.checkexpr import parse_slo

    # goodput: measured ok requests that ended in the window and met the SLO: r1 only (r3 ends at 6.0)
    assert al.round_figures(lv, [parse_slo("ttft_s <= 1")])["goodput"] == pytest.approx(1 / 4)
    assert al.round_figures(lv, [parse_slo("ttft_s <= 0.3")])["goodput"] == 0
    # in flight: 2 over 1.0-1.5, 1 over 1.5-2.5, 0 to 4.0, 1 to 5.0: area 3.0 over 4 s
    assert al._in_flight_window(lv) == (pytest.approx(0.75), 2)


def test_an_open_loop_counts_its_throughput_until_the_measured_requests_ended() -> None:
    """The same requests at a rate: the window of sends still picks the measured ones (r1, r2, r3), but the
    throughput runs to r3's end (6.0), since the arrivals set the pace; at rate=inf every send is at 0 and the
    window of sends is empty, yet the level's throughput is what the server drained."""
    lv = _level("a", HAND).model_copy(update={"kind": "rate", "value": 2.0})
    assert al.throughput_window(lv) == (1.0, 6.0)
    f = al.round_figures(lv, [])
    # window 1..6 (5 s): ok ends r0 (1.5), r1 (2.5), r3 (6.0), r4 (5.8); tokens r0 2, r1 3, r3 3, r4 3
    assert f["request_s"] == pytest.approx(4 / 5) and f["output_tok_s"] == pytest.approx(11 / 5)
    burst = [_req(i, 0.0, [0.5 + i, 1.0 + i, 1.5 + i]) for i in range(4)]  # served one after another
    inf = LoadLevel(arm="a", round=1, role="load", kind="rate", value=float("inf"), started_at=0.0,  # type: ignore[arg-type]
                    window_start_s=0.0, window_end_s=0.0, elapsed_s=4.5, requests=burst)
    assert inf.window_s == 0 and al.throughput_window(inf) == (0.0, 4.5)
    assert al.round_figures(inf, []) == {"request_s": pytest.approx(4 / 4.5), "output_tok_s": pytest.approx(12 / 4.5),
                                         "decode_output_tok_s": pytest.approx(2.0), "goodput": None, "error_rate": 0.0}
    assert al._in_flight_window(inf)[1] == 4
    assert al.decode_spans(inf) == [(3.5, 4.5)]  # the others waited until r3's first token: r3's 2 tokens in 1 s
    closed = _level("a", HAND)  # a closed loop keeps the window of sends (the drain is left out)
    assert al.throughput_window(closed) == (1.0, 5.0)


def test_the_cell_table_and_its_intervals() -> None:
    rec = _record([_level("a", HAND), _level("a", HAND, rnd=2)], slo=["ttft_s <= 1"])
    t = al.cell_table(rec)
    row = t.iloc[0]
    assert (row["arm"], row["level"], row["rounds"], row["sent"], row["measured"], row["ok"], row["failed"]) == (
        "a", "c=2", 2, 10, 6, 4, 2)
    assert row["errors"] == "http 429: 2"
    assert row["ttft_p50_s"] == pytest.approx(0.35)  # 0.5, 0.2, 0.5, 0.2
    assert row["ttft_p50_s_low"] == pytest.approx(0.2) and row["ttft_p50_s_high"] == pytest.approx(0.5)
    assert row["ttft_p90_s"] is None or row["ttft_p90_s"] != row["ttft_p90_s"]  # 4 values: no p90
    assert row["output_tok_s"] == pytest.approx(1.75) and row["goodput"] == pytest.approx(0.25)
    assert row["error_rate"] == pytest.approx(1 / 3) and row["in_flight_max"] == 2
    assert row["slo_met"] == 4  # measured ok requests within the SLO: r1 and r3 of each round


def _tokens(n: int) -> list[float]:
    return [0.1 + 3.8 * i / max(1, n - 1) for i in range(n)]  # all n arrive inside the window 1..5


def test_throughput_scaling_divides_each_level_by_the_arms_lightest_in_the_same_round() -> None:
    """What the load buys an arm: output tok/s at a level over its own at the lightest level (the fewest in flight,
    whatever the order the levels ran in), paired by round; the lightest level itself has none."""
    def at(arm: str, c: int, n: int, rnd: int) -> LoadLevel:
        return _level(arm, [_req(0, 1.0, _tokens(n), ids=list(range(n)))], rnd=rnd).model_copy(update={"value": float(c)})

    levels = [at("a", 8, 12, 1), at("a", 1, 4, 1), at("b", 1, 4, 1), at("b", 8, 4, 1),
              at("a", 1, 4, 2), at("a", 8, 16, 2), at("b", 8, 6, 2), at("b", 1, 4, 2)]
    rec = _record(levels)
    s = al.throughput_scalings(rec)
    assert sorted(zip(s["arm"], s["level"], s["round"], s["value"])) == [
        ("a", "c=8", 1, pytest.approx(3.0)), ("a", "c=8", 2, pytest.approx(4.0)),
        ("b", "c=8", 1, pytest.approx(1.0)), ("b", "c=8", 2, pytest.approx(1.5))]
    cells = judge(rec, parse_check("throughput_scaling[a, c=8] >= 3"))
    assert [(c.kind, c.status) for c in cells] == [("c=8", "pass")] and cells[0].value == pytest.approx(3.5)
    assert "n=2 rounds" in describe_cell(parse_check("throughput_scaling[a, c=8] >= 3"), cells[0])
    assert judge(rec, parse_check("throughput_scaling[b, c=8] >= 2"))[0].status == "fail"
    assert [c.kind for c in judge(rec, parse_check("throughput_scaling[a] >= 1"))] == ["c=8"]  # c=1 has none


def test_decode_throughput_leaves_out_the_time_a_prompt_waits_for_its_first_token() -> None:
    """r0 decodes from 1.0; r1, sent at 1.8, waits (queued, prefilling) until its first token at 2.6, and r0's
    tokens stall meanwhile. Decode spans: 1.0-1.8 and 2.6-3.6 (1.8 s). Counted: a token whose previous one of
    the same request arrived in the same span: r0's 1.4 and 1.8, r0's 3.0 and 3.4, r1's 3.0 and 3.4 (six);
    r0's 2.6 follows its 1.8 across r1's prefill and is not counted. output_tok_s counts all 9 over 5 s."""
    r0 = _req(0, 0.0, [1.0, 1.4, 1.8, 2.6, 3.0, 3.4], ids=list(range(6)))
    r1 = _req(1, 1.8, [0.8, 1.2, 1.6], ids=list(range(3)))  # first token at 2.6, then 3.0 and 3.4
    r2 = _req(2, 4.5, None, ok=False, error_kind="http", status=429)  # refused at once: no wait to speak of
    lv = _level("a", [r0, r1, r2], lo=0.0, hi=5.0)
    assert al.decode_spans(lv) == [(pytest.approx(1.0), pytest.approx(1.8)), (pytest.approx(2.6), pytest.approx(3.4))]
    f = al.round_figures(lv, [])
    assert f["decode_output_tok_s"] == pytest.approx(6 / (0.8 + 0.8)) and f["output_tok_s"] == pytest.approx(9 / 5)
    # a request still waiting when the window closes holds the rest of it: r0 alone decodes 1.0-1.8 only
    lone = _level("a", [r0, _req(1, 1.8, [9.0], ids=[0])], lo=0.0, hi=5.0)
    assert al.decode_spans(lone) == [(pytest.approx(1.0), pytest.approx(1.8))]
    assert al.round_figures(lone, [])["decode_output_tok_s"] == pytest.approx(2 / 0.8)
    # one token per request: nothing decoded, no figure
    assert al.round_figures(_level("a", [_req(0, 1.0, [0.5], ids=[0])]), [])["decode_output_tok_s"] is None


def test_decode_scaling_pairs_each_level_with_the_lightest_by_round_and_drives_a_check() -> None:
    """8 sequences that decode together (a step every 0.1 s, 8 tokens a step) against one alone (a step every
    0.05 s): 80 against 20 tok/s, 4x, though the prefill before the 8 makes their output_tok_s scale less."""
    def alone(rnd: int) -> LoadLevel:
        return _level("a", [_req(0, 0.0, [0.5 + 0.05 * i for i in range(41)], ids=list(range(41)))], rnd=rnd,
                      lo=0.0, hi=2.6).model_copy(update={"value": 1.0})

    def eight(rnd: int, step: float) -> LoadLevel:
        rs = [_req(i, 0.0, [1.6 + step * k for k in range(11)], ids=list(range(11))) for i in range(8)]
        return _level("a", rs, rnd=rnd, lo=0.0, hi=1.6 + 10 * step).model_copy(update={"value": 8.0})

    rec = _record([alone(1), eight(1, 0.1), alone(2), eight(2, 0.125)])
    s = al.throughput_scalings(rec, "decode_output_tok_s")
    assert sorted(zip(s["level"], s["round"], s["value"])) == [("c=8", 1, pytest.approx(4.0)),
                                                              ("c=8", 2, pytest.approx(3.2))]
    assert al.values(rec, "decode_scaling")["value"].tolist() == s["value"].tolist()
    out = al.throughput_scalings(rec)  # output tokens/s: the 1.6 s prefill counts, so it scales less
    assert max(out["value"]) < 2.5
    cells = judge(rec, parse_check("decode_scaling[a, c=8] >= 3"))
    assert [(c.kind, c.status) for c in cells] == [("c=8", "pass")] and cells[0].value == pytest.approx(3.6)
    assert "n=2 rounds" in describe_cell(parse_check("decode_scaling[a, c=8] >= 3"), cells[0])
    assert judge(rec, parse_check("decode_scaling[a, c=8] >= 4.5"))[0].status == "fail"
    assert judge(rec, parse_check("decode_output_tok_s[a, c=1] >= 20"))[0].status == "pass"
    t = al.cell_table(rec)
    assert t.set_index("level").loc["c=8", "decode_output_tok_s"] == pytest.approx(72.0)  # median of 80 and 64


def test_throughput_ratio_is_paired_by_level_and_round() -> None:
    levels = [_level("a", [_req(0, 1.0, _tokens(4), ids=list(range(4)))], rnd=1),
              _level("b", [_req(0, 1.0, _tokens(8), ids=list(range(8)))], rnd=1),
              _level("a", [_req(0, 1.0, _tokens(4), ids=list(range(4)))], rnd=2),
              _level("b", [_req(0, 1.0, _tokens(6), ids=list(range(6)))], rnd=2)]
    rec = _record(levels)
    r = al.throughput_ratios(rec)
    assert sorted(zip(r["round"], r["value"])) == [(1, pytest.approx(2.0)), (2, pytest.approx(1.5))]
    cells = judge(rec, parse_check("throughput_ratio[b, c=2] >= 1.2"))
    assert [(c.kind, c.status) for c in cells] == [("c=2", "pass")] and cells[0].value == pytest.approx(1.75)
    assert describe_cell(parse_check("throughput_ratio[b, c=2] >= 1.2"), cells[0]).startswith("c=2: 1.75 (95% CI 1.5")
    assert judge(rec, parse_check("throughput_ratio[b, c=2] >= 1.6"))[0].status == "inconclusive"
    assert judge(rec, parse_check("throughput_ratio[b, c=2] >= 2.5"))[0].status == "fail"
    assert judge(rec, parse_check("throughput_ratio[a, c=2, vs b] <= 0.8"))[0].status == "pass"
    assert judge(rec, parse_check("output_tok_s[b, c=2] >= 1"))[0].n == 2


def _lp(chosen: int, other: int, gap: float) -> list[tuple[int, float]]:
    return [(chosen, -0.5), (other, -0.5 - gap)]


def test_parity_under_load_with_a_planted_near_tie_and_a_real_difference() -> None:
    ref_ids = [10, 11, 12, 13]
    ref_lp = [_lp(10, 90, 2.0), _lp(11, 91, 0.01), _lp(12, 92, 2.0), _lp(13, 93, 2.0)]
    refs = [_req(i, 0.0 + i, [0.1, 0.2, 0.3, 0.4], prompt=f"load-{i}", ids=ref_ids, logprobs=ref_lp) for i in range(3)]
    same = _req(0, 1.0, [0.1, 0.2, 0.3, 0.4], prompt="load-0", ids=ref_ids, logprobs=ref_lp)
    # position 1: the load run chose 91, the reference's runner-up 0.01 nats below its 11: a near tie
    tie = _req(1, 1.1, [0.1, 0.2, 0.3, 0.4], prompt="load-1", ids=[10, 91, 7, 7],
               logprobs=[_lp(10, 90, 2.0), _lp(91, 11, 0.01), _lp(7, 8, 1.0), _lp(7, 8, 1.0)])
    # position 2: 55 where the reference chose 12 with a clear margin: a real difference
    diff = _req(2, 1.2, [0.1, 0.2, 0.3, 0.4], prompt="load-2", ids=[10, 11, 55, 13],
                logprobs=[_lp(10, 90, 2.0), _lp(11, 91, 0.01), _lp(55, 12, 1.5), _lp(13, 93, 2.0)])
    levels = [_level("b", refs, role="reference", lo=0.0, hi=3.0), _level("b", [same, tie, diff])]
    rec = _record(levels, checks=["parity_under_load[b, c=2]"])
    p = al.parity_under_load(rec).iloc[0]
    assert (p["prompts"], p["identical"], p["near_tie"], p["broken"], p["kept"]) == (3, 1, 1, 1, 1)
    assert p["first_diverging"] == 1 and p["example"] == "load-2 at 2" and not p["accepts"]
    assert judge(rec, parse_check("parity_under_load[b, c=2]"))[0].status == "fail"
    accepted = _record(levels, accept_near_ties=0.1)
    p = al.parity_under_load(accepted).iloc[0]
    assert (p["kept"], p["accepts"]) == (2, True)
    assert judge(accepted, parse_check("parity_under_load[b, c=2] >= 0.6"))[0].status == "pass"
    # beyond K the difference does not count: K = 2 keeps the third prompt
    p = al.parity_under_load(_record(levels, parity_tokens=2)).iloc[0]
    assert (p["identical"], p["near_tie"], p["broken"]) == (2, 1, 0)
    # the same difference from a request that met the prefix cache beyond its reference: the example says so
    cached = diff.model_copy(update={"engine": {"cached_prompt_tokens": 4095}})
    refs_cached = [r.model_copy(update={"engine": {"cached_prompt_tokens": 8}}) for r in refs]
    p = al.parity_under_load(_record([_level("b", refs_cached, role="reference", lo=0.0, hi=3.0),
                                      _level("b", [same, tie, cached])])).iloc[0]
    assert p["broken"] == 1 and p["example"] == "load-2 at 2 (4,087 more prompt tokens cached)"


def test_parity_under_load_through_a_real_server() -> None:
    prompts = [LoadPrompt(f"load-{i}", 3, 6, f"alpha{i} beta gamma") for i in range(4)]
    with FastServer(tie_at=2) as srv:
        def level(extra: dict[str, Any], role: str = "load") -> LoadLevel:
            lv = Level("concurrency", 1 if role == "reference" else 4, requests=4, role=role)
            return run_level(lv, Target(srv.base_url, RequestSpec(max_tokens=6), extra=extra, arm="b"), prompts)

        ref, tie, broken = level({}, "reference"), level({"flip_tie": True}), level({"diverge_at": 1})
    tie = tie.model_copy(update={"value": 4.0})
    broken = broken.model_copy(update={"value": 8.0, "round": 1})
    rec = _record([ref, tie, broken])
    p = al.parity_under_load(rec).set_index("level")
    assert (p.loc["c=4", "near_tie"], p.loc["c=4", "first_diverging"]) == (4, 2)
    assert (p.loc["c=8", "broken"], p.loc["c=8", "first_diverging"]) == (4, 1)
