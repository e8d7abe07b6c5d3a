"""Positions on a shared service follow each round's order, and a reference sample without token ids is
never used as the reference."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from abbench.results import PromptRecord
from abbench.schedule import build_plan

from tests.support import cli
from tests.support import mdtables as mt

REPO = Path(__file__).resolve().parents[2]


def rec(pid: str, kind: str, n: int = 64, parent: str | None = None) -> PromptRecord:
    return PromptRecord(id=pid, kind=kind, target_tokens=n, token_count=n, sha256="0" * 64, corpus="essays",
                        parent=parent)


PROMPTS = [rec("warmup-0", "warmup", 8), rec("fresh-128-0", "fresh", 128), rec("pair0-cold", "cold", 256),
           rec("pair0-cont", "continuation", 300, parent="pair0-cold")]


def round_order(arms: list[str], rnd: int) -> list[str]:
    """ABBA, written out here: odd rounds in profile order, even rounds reversed."""
    return list(arms) if rnd % 2 else list(reversed(arms))


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "separate"])
def test_positions_follow_the_round_order(shared: bool) -> None:
    arms = ["A", "B", "C"]
    plan = build_plan(PROMPTS, arms, 3, shared_service=shared, reset_between_samples=True, exclude_kinds=["warmup"])
    for st in plan:
        if st.excluded and shared:  # the shared service's warm-ups run once, in round 1's order
            assert st.round == 1 and st.position == arms.index(st.arm), st
            continue
        assert st.position == round_order(arms, st.round).index(st.arm), st
    for rnd in (1, 2, 3):  # and the arms really run in that order within every group of the round
        for group in ("fresh-128-0", "pair0-cold"):
            seen = [st.arm for st in plan if st.round == rnd and st.group == group and not st.excluded]
            assert list(dict.fromkeys(seen)) == round_order(arms, rnd), (rnd, group, seen)
    if shared:
        assert [st.position for st in plan if st.round == 2 and st.prompt_id == "fresh-128-0"] == [0, 1, 2]
        assert [st.arm for st in plan if st.round == 2 and st.prompt_id == "fresh-128-0"] == ["C", "B", "A"]


def test_the_recorded_shared_run_has_round_order_positions() -> None:
    """The committed H200 run (one shared service, four arms, two rounds): its plan, as rebuilt today, and
    every recorded sample put each arm at its round's position."""
    raw = json.loads((REPO / "results" / "20261129b-h200-qwen3-30b-a3b" / "run.json").read_text())
    assert raw["profile"]["engine"]["shared_service"] is True
    arms = [a["name"] for a in raw["profile"]["arms"]]
    prompts = [PromptRecord.model_validate(p) for p in raw["prompts"]]
    plan = build_plan(prompts, arms, raw["profile"]["run"]["rounds"], shared_service=True,
                      reset_between_samples=raw["profile"]["run"]["reset_between_samples"],
                      exclude_kinds=raw["profile"]["run"]["exclude_kinds"])
    assert [st.model_dump() for st in plan] == raw["plan"]
    measured = [s for s in raw["samples"] if not s["excluded"]]
    assert measured and {s["round"] for s in measured} == {1, 2}
    for s in measured:
        assert s["position"] == round_order(arms, s["round"]).index(s["arm"]), s["step"]


# ------------------------------------------------------------------------ reference sample without ids


def _report(run_dir: Path, out: Path) -> dict[str, str]:
    res = cli.abbench("report", str(run_dir), "--out", str(out), cwd=REPO)
    assert res.returncode == 0, res.stderr
    (md,) = out.glob("*.md")  # named by the run id
    return mt.sections(md.read_text())


def _gate(run_dir: Path) -> cli.Result:
    return cli.abbench("gate", str(run_dir), cwd=REPO)


def test_a_reference_sample_without_ids_is_not_the_reference(tmp_path: Path) -> None:
    """The reference arm's round-2 sample of one prompt came back without token ids: the other arms' round-2
    samples of that prompt are compared with the reference's round 1 (said in the note), not with an empty
    id list; the id-less sample is an unchecked stability row; the gate fails on it by name, not on parity."""
    src = REPO / "results" / "readme-cpu-tiny"
    run_dir = tmp_path / "no-ids"
    run_dir.mkdir()
    raw = json.loads((src / "run.json").read_text())
    ref = raw["profile"]["run"].get("reference") or raw["profile"]["arms"][0]["name"]
    victim = next(s for s in raw["samples"] if s["arm"] == ref and s["round"] == 2 and s["prompt_id"] == "fresh-384-0")

    def strip(s: dict) -> dict:
        if s["step"] == victim["step"]:
            s.update(output_ids=[], ids_source="none", logprobs=None)
        return s

    raw["samples"] = [strip(s) for s in raw["samples"]]
    (run_dir / "run.json").write_text(json.dumps(raw))
    lines = [json.dumps(strip(json.loads(x))) for x in (src / "requests.jsonl").read_text().splitlines() if x.strip()]
    (run_dir / "requests.jsonl").write_text("\n".join(lines) + "\n")
    others = [a["name"] for a in raw["profile"]["arms"] if a["name"] != ref]

    sec = _report(run_dir, tmp_path / "reports")
    detail = mt.tables(sec["Parity"])[-1]  # "Every parity row"
    rows = {(r["Check"], r["Prompt"], r["Arm"], r["Round"]): r for r in detail}
    for arm in others:
        r = rows[("parity", "fresh-384-0", arm, "2")]
        assert r["Against"] == f"{ref} r1", r
        assert r["Match (first 8)"] == "yes" and r["Class"] == "identical", r
        assert r["Note"] == "reference round 2 missing or failed; compared with its round 1", r
        assert rows[("parity", "fresh-384-0", arm, "1")]["Against"] == f"{ref} r1"
    r = rows[("stability", "fresh-384-0", ref, "2")]
    assert r["Match (first 8)"] == "—" and r["Class"] == "unchecked" and r["Note"] == "engine returned no token ids"

    (checks,) = mt.tables(sec["Verdict"])
    by = {r["Check"]: r for r in checks}
    assert by["token-ids"]["Result"] == "FAIL" and by["token-ids"]["Detail"].startswith("1 sample(s) without token ids")
    assert by["parity"]["Result"] == "pass" and by["parity"]["Detail"] == "24/24 equal over the first 8 ids"
    res = _gate(run_dir)
    assert res.returncode == 1
    fails = [" ".join(line.split()) for line in res.stdout.splitlines() if line.startswith("FAIL ")]
    assert fails == ["FAIL token ids: prompt fresh-384-0, arm chunked, round 2 (position 2): the engine returned no "
                     "token ids (ids_source none); parity cannot be checked"], res.stdout
