"""`abbench memory-plan`: the engine's device-memory plan per chunk length, as the engine applies it."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from abbench import cli
from abbench.cli import app
from abbench.engine.config import EngineConfig
from abbench.engine.runtime.memory import plan_device_memory


@pytest.fixture(autouse=True)
def wide(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI's console took its width when it was created (80 columns without a terminal): widen it so that
    no cell wraps."""
    monkeypatch.setattr(cli.out, "_width", 250)
    monkeypatch.setattr(cli.console, "_width", 250)


def _rows(output: str) -> dict[int, list[str]]:
    rows = {}
    for line in output.splitlines():
        cells = [c.strip() for c in line.strip("│ ").split("│")]
        if cells and re.fullmatch(r"[\d,]+", cells[0]):
            rows[int(cells[0].replace(",", ""))] = cells
    return rows


def test_each_chunk_length_gets_the_plan_the_engine_applies() -> None:
    res = CliRunner().invoke(app, ["memory-plan", "--model", "qwen3-30b-a3b-2507", "--max-context", "65600",
                                   "--budget", "24", "--chunk-tokens", "2048,8192,16384"])
    assert res.exit_code == 0, res.output
    rows = _rows(res.output)
    assert sorted(rows) == [2048, 8192, 16384]
    slots = []
    for chunk, cells in rows.items():
        cfg = EngineConfig(model="qwen3-30b-a3b-2507", device="cuda", dtype="bfloat16", chunk_tokens=chunk,
                           max_context=65600, max_num_seqs=1).resolved()
        plan = plan_device_memory(cfg, 24 * 2**30)  # --budget is in GiB
        assert cells[1:7] == [f"{plan.kv_bytes / 2**30:.2f}", f"{plan.workspace_bytes / 2**30:.2f}", f"{plan.fixed_bytes / 2**30:.2f}",
                              str(plan.slots_per_layer), f"{plan.slots_per_layer * plan.slot_bytes / 2**30:.2f}",
                              f"{plan.total_bytes / 2**30:.2f}"]
        assert 23 * 2**30 < plan.total_bytes <= 24 * 2**30  # a 24 GiB card, and nearly all of it used
        slots.append(plan.slots_per_layer)
    assert slots == sorted(slots, reverse=True) and slots[0] > slots[-1]  # longer chunks leave fewer slots


def test_without_a_budget_it_gives_the_least_each_length_needs_and_a_small_budget_does_not_fit() -> None:
    runner = CliRunner()
    res = runner.invoke(app, ["memory-plan", "--model", "qwen3-30b-a3b-2507", "--chunk-tokens", "2048"])
    assert res.exit_code == 0, res.output
    (cells,) = _rows(res.output).values()
    need = float(re.search(r"needs at least ([\d.]+) GiB \(8 slots per layer\)", cells[7])[1])
    assert cells[4] == "8" and need == float(cells[6])
    tight = runner.invoke(app, ["memory-plan", "--model", "qwen3-30b-a3b-2507", "--chunk-tokens", "2048",
                                "--budget", str(need - 0.2)])
    assert tight.exit_code == 0 and "does not fit" in tight.output and "decode needs 8" in tight.output
    ok = runner.invoke(app, ["memory-plan", "--model", "qwen3-30b-a3b-2507", "--chunk-tokens", "2048",
                             "--budget", str(need + 0.01)])
    assert _rows(ok.output)[2048][4] == "8"


@pytest.mark.parametrize("args, words", [
    (["--chunk-tokens", "0"], "positive token counts"),
    (["--chunk-tokens", "big"], "positive token counts"),
    (["--model", "no-such-preset"], "no-such-preset"),
])
def test_bad_input_is_exit_2_naming_it(args: list[str], words: str) -> None:
    res = CliRunner().invoke(app, ["memory-plan", *args])
    assert res.exit_code == 2 and words in res.output, res.output


def test_max_num_seqs_plans_a_kv_cache_per_sequence_and_leaves_fewer_slots() -> None:
    runner = CliRunner()
    args = ["memory-plan", "--model", "qwen3-30b-a3b", "--budget", "24", "--max-context", "8192", "--chunk-tokens",
            "2048"]
    one, eight = (_rows(runner.invoke(app, args + ["--max-num-seqs", n]).output)[2048] for n in ("1", "8"))
    assert float(eight[1]) == pytest.approx(8 * float(one[1]), abs=0.01)  # KV (GiB): one cache per sequence
    assert int(eight[4]) < int(one[4])  # slots per layer pay for it, within the same budget


def test_an_fp8_bank_plans_its_staging_area_as_the_engine_does() -> None:
    args = ["memory-plan", "--model", "qwen3-30b-a3b", "--budget", "16", "--max-context", "32768", "--chunk-tokens",
            "2048"]
    res = CliRunner().invoke(app, args + ["--expert-dtype", "fp8"])
    assert res.exit_code == 0 and "fp8 expert bank" in res.output, res.output
    plain, fp8 = _rows(CliRunner().invoke(app, args).output)[2048], _rows(res.output)[2048]
    cfg = EngineConfig(model="qwen3-30b-a3b", device="cuda", dtype="bfloat16", chunk_tokens=2048, max_context=32768,
                       max_num_seqs=1, expert_dtype="fp8").resolved()
    plan = plan_device_memory(cfg, 16 * 2**30)
    # the staging area costs some; slots holding the bank's float8 values and scales give about twice as many
    assert int(fp8[4]) == plan.slots_per_layer > int(plain[4]) and plan.slot_dtype == "fp8"
    assert float(fp8[3]) == pytest.approx(plan.fixed_bytes / 2**30, abs=0.005)


def test_the_defaults_plan_the_model_at_its_own_context_as_the_engine_does() -> None:
    res = CliRunner().invoke(app, ["memory-plan"])
    assert res.exit_code == 0, res.output
    assert "max context 40,960" in res.output  # tiny's max_position_embeddings, the engine's default


def test_it_marks_the_chunk_length_the_engines_auto_takes() -> None:
    """The hybrid at 16 GiB: 4096 where its plan holds decode's slots (33K context), 2048 at 256K where 4096 leaves
    none, and a caption when that length is not among the rows."""
    runner = CliRunner()
    base = ["memory-plan", "--model", "qwen3.5-35b-a3b", "--budget", "16"]
    short = _rows(runner.invoke(app, [*base, "--max-context", "33024", "--window-tokens", "32768",
                                      "--chunk-tokens", "2048,4096"]).output)
    assert "auto takes this" in short[4096][7] and "auto" not in " ".join(short[2048])
    res = runner.invoke(app, [*base, "--max-context", "262144", "--window-tokens", "65536", "--chunk-tokens", "4096"])
    assert "does not fit" in _rows(res.output)[4096][7] and "--chunk-tokens auto takes 2,048 tokens" in res.output
