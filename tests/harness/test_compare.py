"""abbench compare on real cpu-tiny runs: two runs of `abbench run --rounds 3 --lengths 256 --arms
chunked,layer-major` made back to back at one clean commit (189e3ff) on a 2-core machine shared with other
jobs (tests/support/fixtures/compare/base and cand), copies of them doctored (a candidate whose layer-major
TTFTs are 2x, only two rounds, a prompt of other text, another prompt set, another profile, another
tokenizer), and the committed H200 runs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from abbench.cli import app
from abbench.compare import CompareRefused, change_ci, compare, render_markdown
from abbench.results import load_run

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "support" / "fixtures" / "compare"
BASE, CAND = FIXTURES / "base", FIXTURES / "cand"
runner = CliRunner()


def doctored(src: Path, dst: Path, *, samples=None, record=None) -> Path:
    """A copy of the run ``src`` whose samples (in run.json and requests.jsonl) and run.json pass through
    the given functions."""
    shutil.copytree(src, dst)
    run = json.loads((dst / "run.json").read_text())
    if record:
        record(run)
    if samples:
        run["samples"] = [samples(s) for s in run["samples"]]
        lines = [json.loads(x) for x in (dst / "requests.jsonl").read_text().splitlines() if x.strip()]
        (dst / "requests.jsonl").write_text("".join(json.dumps(samples(s)) + "\n" for s in lines))
    (dst / "run.json").write_text(json.dumps(run))
    return dst


def slower_layer_major(s: dict) -> dict:
    if s["arm"] == "layer-major" and s.get("ttft_s") is not None:
        extra = s["ttft_s"]
        s["ttft_s"] += extra
        s["total_s"] += extra
    return s


def two_rounds(src: Path, dst: Path) -> Path:
    """A copy of ``src`` cut to its first two rounds (plan, samples and requests.jsonl)."""
    def cut(run: dict) -> None:
        run["samples"] = [s for s in run["samples"] if s["round"] <= 2]
        run["plan"] = [s for s in run["plan"] if s["round"] <= 2]
        run["profile"]["run"]["rounds"] = 2

    doctored(src, dst, record=cut)
    lines = [x for x in (dst / "requests.jsonl").read_text().splitlines() if x.strip()]
    (dst / "requests.jsonl").write_text("".join(x + "\n" for x in lines if json.loads(x)["round"] <= 2))
    return dst


def test_a_run_against_itself_is_all_the_same(tmp_path: Path) -> None:
    copy = doctored(BASE, tmp_path / "copy")
    r = runner.invoke(app, ["compare", str(BASE), str(copy)])
    assert r.exit_code == 0, r.output
    assert "**No regression** beyond 5%" in r.output
    assert "Identical in every sample of both runs (not listed): TTFT, Decode tok/s, Engine H2D." in r.output


def test_a_doctored_regression_exits_1_and_names_the_cells(tmp_path: Path) -> None:
    cand = doctored(BASE, tmp_path / "slow", samples=slower_layer_major)
    out = tmp_path / "pr" / "compare.md"
    r = runner.invoke(app, ["compare", str(BASE), str(cand), "--out", str(out)])
    assert r.exit_code == 1, r.output
    md = out.read_text()
    assert "regression(s)** beyond 5%" in md
    assert "Same in every row: Metric: TTFT" in md  # decode untouched (total_s moved with the TTFT): identical
    rows = {tuple(x.split(" | ")[:3]): x for x in md.splitlines() if x.startswith("| ")}
    cold = rows[("| layer-major", "cold", "384")]
    assert "+100.0%" in cold and "REGRESSION" in cold
    # 2x its median, but the fresh cell's three samples spread too widely to put the interval beyond 5%
    assert "not significant" in rows[("| layer-major", "fresh", "256")]
    assert rows[("| chunked", "fresh", "256")].endswith("| +0.0% | — | same |")
    assert "Every arm moved the worse way" not in md  # only layer-major moved: not a shift of the whole run
    assert (out.parent / "compare.png").is_file() and "![Changes with 95% intervals](compare.png)" in md
    # a threshold above the change: no regression, the change is still shown
    r = runner.invoke(app, ["compare", str(BASE), str(cand), "--threshold", "1.5"])
    assert r.exit_code == 0 and "slower" in r.output and "REGRESSION" not in r.output


def test_two_runs_of_one_profile_at_one_commit_do_not_regress() -> None:
    """The two real runs, three samples a cell and side: no regression at the default threshold, every
    interval holding the spread within each run."""
    c = compare(load_run(BASE)[0], load_run(CAND)[0])
    md = render_markdown(c)
    assert len(c.regressions) == 0 and "**No regression** beyond 5%" in md
    assert c.env_diffs == [] and "None in the recorded fingerprint fields." in md
    assert "Engine H2D" in c.identical  # the byte counters are deterministic
    assert set(c.changes["metric"]) == {"ttft_s", "decode_tok_s", "h2d_bytes"}  # no GPU: no peak memory
    assert set(c.changes["n_base"]) == set(c.changes["n_cand"]) == {3}
    assert c.too_few.empty and c.changes[c.changes["verdict"] != "same"]["ci_low"].notna().all()
    assert "Both runs are of one commit (189e3ff6a714)" in md
    r = runner.invoke(app, ["compare", str(BASE), str(CAND)])
    assert r.exit_code == 0, r.output


def test_fewer_than_three_samples_a_side_are_too_few_to_judge(tmp_path: Path) -> None:
    """The same two runs cut to two rounds (as `--rounds 2` makes them): an interval of two samples is about
    their range, so no cell is judged on its own, whichever run is the base. Each arm is still judged over its
    five cells: base -> cand (every arm faster) is no regression; cand -> base regresses where every cell of an
    arm moved beyond 5% (the machine's drift between the runs, which the notes name)."""
    base, cand = two_rounds(BASE, tmp_path / "b2"), two_rounds(CAND, tmp_path / "c2")
    for b, c in ((base, cand), (cand, base)):
        cmp = compare(load_run(b)[0], load_run(c)[0])
        judged = cmp.changes[cmp.changes["verdict"] != "same"]
        assert len(judged) and (judged["verdict"] == "too few to judge (n=2)").all()
        assert judged["ci_low"].isna().all() and len(cmp.regressions) == 0
        assert set(cmp.arms["cells"]) == {5} and cmp.judged
        r = runner.invoke(app, ["compare", str(b), str(c)])
        assert r.exit_code == cmp.exit_code, r.output
        assert f"{len(judged)} of {len(cmp.changes)} cells too few to judge (fewer than 3 samples a side" in r.output
    forward = compare(load_run(base)[0], load_run(cand)[0])
    assert forward.exit_code == 0 and forward.arm_regressions.empty
    backward = compare(load_run(cand)[0], load_run(base)[0])
    assert backward.exit_code == 1 and len(backward.arm_regressions)
    assert (backward.arm_regressions["beyond"] == backward.arm_regressions["cells"]).all()
    md = render_markdown(backward)
    assert "Every arm moved the worse way" in md or "Both runs are of one commit" in md


def only_kind(kind: str):
    def cut(run: dict) -> None:
        run["samples"] = [s for s in run["samples"] if s["kind"] == kind]
    return cut


def test_nothing_judged_exits_3(tmp_path: Path) -> None:
    """Two rounds and one cell an arm (only the fresh prompt kept): no cell has 3 samples a side and no arm the
    5 cells a sign test needs, so compare says nothing could be judged and exits 3, not 0 with "No regression"."""
    base = doctored(two_rounds(BASE, tmp_path / "b2"), tmp_path / "b1", record=only_kind("fresh"))
    cand = doctored(two_rounds(CAND, tmp_path / "c2"), tmp_path / "c1", record=only_kind("fresh"))
    for d in (base, cand):
        lines = [x for x in (d / "requests.jsonl").read_text().splitlines() if x.strip()]
        (d / "requests.jsonl").write_text("".join(x + "\n" for x in lines if json.loads(x)["kind"] == "fresh"))
    c = compare(load_run(base)[0], load_run(cand)[0])
    assert not c.judged and c.exit_code == 3 and c.regression_count == 0
    timed = c.arms[c.arms["metric"] != "h2d_bytes"]  # the byte counter is the same in both: "same"
    assert len(timed) and timed["verdict"].str.startswith("too few cells to judge").all()
    r = runner.invoke(app, ["compare", str(base), str(cand)])
    assert r.exit_code == 3, r.output
    assert "**Nothing could be judged** (exit 3)" in r.output and "No regression" not in r.output
    r = runner.invoke(app, ["compare", str(base), str(cand), "--json"])
    assert r.exit_code == 3 and json.loads(r.stdout)["exit_code"] == 3


README_RUN = REPO / "results" / "readme-cpu-tiny"


def test_a_2x_slowdown_of_one_arm_at_the_default_n_is_a_regression(tmp_path: Path) -> None:
    """The committed default run (cpu-tiny, 2 rounds: n = 2 a cell) against a copy whose layer-major TTFTs are
    all doubled: every cell alone is too few to judge, but the arm over its 6 cells is a regression, exit 1."""
    assert json.loads((README_RUN / "run.json").read_text())["profile"]["run"]["rounds"] == 2
    cand = doctored(README_RUN, tmp_path / "slow", samples=slower_layer_major)
    c = compare(load_run(README_RUN)[0], load_run(cand)[0])
    cells = c.changes[(c.changes["arm"] == "layer-major") & (c.changes["metric"] == "ttft_s")]
    assert len(cells) == 6 and cells["verdict"].str.startswith("too few to judge").all()
    arm = c.arms[(c.arms["arm"] == "layer-major") & (c.arms["metric"] == "ttft_s")].iloc[0]
    assert arm["regression"] and arm["beyond"] == arm["cells"] == 6 and abs(arm["change"] - 1.0) < 1e-9
    assert arm["ci_low"] > 0.05 and arm["p_sign"] == 1 / 64
    assert set(c.arm_regressions["arm"]) == {"layer-major"}  # the untouched arms are "same"
    r = runner.invoke(app, ["compare", str(README_RUN), str(cand)])
    assert r.exit_code == 1, r.output
    assert "**1 regression(s)** beyond 5%" in r.output and "layer-major (all 6 cells): TTFT +100.0%" in r.output
    assert "No regression" not in r.output


def test_an_unchanged_copy_of_the_default_run_is_no_regression(tmp_path: Path) -> None:
    copy = doctored(README_RUN, tmp_path / "copy")
    c = compare(load_run(README_RUN)[0], load_run(copy)[0])
    assert c.exit_code == 0 and c.judged and (c.arms["verdict"] == "same").all()
    r = runner.invoke(app, ["compare", str(README_RUN), str(copy)])
    assert r.exit_code == 0 and "**No regression** beyond 5%" in r.output, r.output


def test_the_machine_drifting_between_runs_is_named(tmp_path: Path) -> None:
    """The candidate run was made while the shared machine was less busy: every arm of it is faster. Taken the
    other way round, the within-run intervals cannot hold that drift and cells regress; the report says both
    runs are of one commit and that every arm moved, and how to tell drift from a change."""
    c = compare(load_run(CAND)[0], load_run(BASE)[0])
    assert len(c.regressions) > 0
    md = render_markdown(c)
    assert "Both runs are of one commit (189e3ff6a714)" in md
    assert "Every arm moved the worse way (median change per arm: TTFT chunked +" in md
    assert "run both commits as two arms of one run" in md


def test_prompts_of_other_text_exit_2(tmp_path: Path) -> None:
    def other_prompt(run: dict) -> None:
        run["prompts"][3]["sha256"] = "0" * 64

    cand = doctored(CAND, tmp_path / "other", record=other_prompt)
    pid = json.loads((cand / "run.json").read_text())["prompts"][3]["id"]
    r = runner.invoke(app, ["compare", str(BASE), str(cand)])
    assert r.exit_code == 2 and "the prompt sets differ" in r.output and pid in r.output


def test_another_prompt_set_exits_2(tmp_path: Path) -> None:
    """A run made with other --lengths holds other prompts: refused, naming the ids only one run has."""
    def one_more(run: dict) -> None:
        run["prompts"].append({**run["prompts"][0], "id": "fresh-2048-0", "target_tokens": 2048,
                               "token_count": 2048, "sha256": "1" * 64})

    cand = doctored(CAND, tmp_path / "more", record=one_more)
    r = runner.invoke(app, ["compare", str(BASE), str(cand)])
    assert r.exit_code == 2, r.output
    assert "the prompt sets differ: fresh-2048-0 only in more" in " ".join(r.output.split())


def test_another_profile_exits_2(tmp_path: Path) -> None:
    """cpu-tiny against cpu-tiny-auto (a renamed copy here): refused, naming both profiles."""
    def renamed(run: dict) -> None:
        run["profile"]["name"] = "cpu-tiny-auto"

    cand = doctored(CAND, tmp_path / "auto", record=renamed)
    r = runner.invoke(app, ["compare", str(BASE), str(cand)])
    out = " ".join(r.output.split())
    assert r.exit_code == 2 and "the runs are of different profiles: base ran 'cpu-tiny', auto ran 'cpu-tiny-auto'" in out


def test_another_tokenizer_exits_2(tmp_path: Path) -> None:
    def other_tokenizer(run: dict) -> None:
        run["environment"]["tokenizer"]["vocab_sha256"] = "f" * 64

    cand = doctored(CAND, tmp_path / "tok", record=other_tokenizer)
    r = runner.invoke(app, ["compare", str(BASE), str(cand)])
    assert r.exit_code == 2 and "the tokenizers differ (vocab_sha256" in r.output
    with pytest.raises(CompareRefused):
        compare(load_run(BASE)[0], load_run(cand)[0])


def test_fingerprint_and_profile_differences_are_listed(tmp_path: Path) -> None:
    def other_commit(run: dict) -> None:
        run["environment"]["engine_commit"] = "0123456789abcdef0123456789abcdef01234567"
        run["environment"]["packages"]["torch"] = "9.9.9"
        run["profile"]["request"]["timeout_s"] = 60.0

    cand = doctored(CAND, tmp_path / "pr", record=other_commit)
    md = render_markdown(compare(load_run(BASE)[0], load_run(cand)[0]))
    assert "- engine_commit: " in md and "-> '0123456789abcdef0123456789abcdef01234567'" in md
    assert "- packages.torch: " in md and "-> '9.9.9'" in md
    assert "### Profile differences" in md and "- request.timeout_s: 120.0 -> 60.0" in md


def test_the_h200_runs_at_two_commits() -> None:
    """results/20261129 (9d32dc6) against 20261129b (4fcb60f): same prompts, same tokenizer."""
    c = compare(load_run(REPO / "results/20261129-h200-qwen3-30b-a3b")[0],
                load_run(REPO / "results/20261129b-h200-qwen3-30b-a3b")[0])
    assert len(c.regressions) == 0 and c.identical == ["Engine H2D"]
    row = c.changes[(c.changes["arm"] == "layer-major") & (c.changes["kind"] == "fresh")
                    & (c.changes["target_tokens"] == 32768) & (c.changes["metric"] == "ttft_s")].iloc[0]
    assert row["verdict"] == "too few to judge (n=2)" and abs(row["change"]) < 0.01  # two rounds each
    # the 20261130 run has two more lengths, and built its pair prompts from another rotation: refused
    with pytest.raises(CompareRefused, match="pair0-cold, pair0-cont have another sha256"):
        compare(load_run(REPO / "results/20261129b-h200-qwen3-30b-a3b")[0],
                load_run(REPO / "results/20261130-h200-qwen3-30b-a3b")[0])


def test_change_ci() -> None:
    import numpy as np

    ch, lo, hi = change_ci(np.array([1.0, 1.0]), np.array([1.1, 1.1]))
    assert ch == pytest.approx(0.1) and lo == pytest.approx(0.1) and hi == pytest.approx(0.1)
    assert change_ci(np.array([0.0]), np.array([0.0])) == (0.0, 0.0, 0.0)
    assert change_ci(np.array([0.0]), np.array([1.0])) == (None, None, None)
    assert change_ci(np.array([2.0]), np.array([3.0]))[1:] == (None, None)
    # scipy.stats.bootstrap's percentile interval: it holds the change and lies within the extreme ratios
    base, cand = np.array([1.0, 1.1, 0.9, 1.05]), np.array([1.3, 1.2, 1.25, 1.4])
    ch, lo, hi = change_ci(base, cand)
    assert lo < ch < hi and 1.2 / 1.1 - 1 <= lo and hi <= 1.4 / 0.9 - 1
    assert change_ci(base, cand) == (ch, lo, hi)  # seeded
    assert change_ci(np.array([0.0, 0.0, 1.0]), np.array([1.0, 1.0, 1.0])) == (None, None, None)


def test_environment_differences_name_the_machine() -> None:
    """Two runs on two machines of one model: the GPU's uuid, its clock and power configuration, the host's
    kernel build and CPU clock are listed; a GPU's current clock (it idles down) is not."""
    from abbench.compare import env_differences

    def fp(uuid: str, release: str, sm: int, power: float) -> dict:
        return {"platform": {"release": release}, "cpu": {"model": "Xeon", "freq_max_mhz": None},
                "gpus": [{"name": "NVIDIA H200", "uuid": uuid, "power_limit_w": power,
                          "clocks_mhz": {"sm": sm, "sm_max": 1980, "mem": 3201, "mem_max": 3201}}]}

    same = env_differences(fp("GPU-a", "6.18-v657", 345, 700.0), fp("GPU-a", "6.18-v657", 1980, 700.0))
    assert same == []
    diff = env_differences(fp("GPU-a", "6.18-v657", 345, 700.0), fp("GPU-b", "6.18-v973", 345, 600.0))
    assert diff == ["platform.release: '6.18-v657' -> '6.18-v973'", "gpus[].uuid: ['GPU-a'] -> ['GPU-b']",
                    "gpus[].power_limit_w: [700.0] -> [600.0]"]
