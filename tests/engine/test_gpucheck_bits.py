"""``tools.gpucheck_bits``: the same bits every time, in one process and across processes, and the distance
between two configurations; ``tools.gpucheck_memory``: where a budgeted engine's memory goes (the tiny hybrid on
CPU; on a GPU they are run by hand or in a device chain); and the allocator setting that memory check led to."""

from __future__ import annotations

import json

import numpy as np
import pytest

from abbench.engine.tools.gpucheck_bits import compare, kl, main, parse_engine


def test_two_processes_agree_and_fp8_is_measured_against_the_first_engine(tmp_path) -> None:
    out = tmp_path / "bits.json"
    assert main(["--device", "cpu", "--tokens", "128", "--repeats", "2", "--processes", "2", "--max-tokens", "4",
                 "--autotune-cache", "on", "--engines", "resident:prefill_mode=resident",
                 "fp8:prefill_mode=layer-major,expert_dtype=fp8,chunk_tokens=64", "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["self_consistent"] and got["processes"] == 2
    resident, fp8 = got["lines"]
    assert (resident["engine"], resident["path"], fp8["engine"], fp8["path"]) == (
        "resident", "resident", "fp8", "layer-major")
    for line in (resident, fp8):
        assert line["repeats_same"] and len(line["ids"]) == 4
        [other] = line["processes"]
        assert other == {"same": True, "ids_differ_at": None, "max_abs_diff": 0.0, "kl": 0.0}
    assert resident["vs_first_engine"] == {"engine": "resident", "kl": 0.0, "max_abs_diff": 0.0,
                                           "ids_differ_at": None, "same_top": True}
    assert fp8["vs_first_engine"]["kl"] > 0 and fp8["vs_first_engine"]["max_abs_diff"] > 0  # FP8 rounds


def test_a_process_that_gave_other_bits_is_a_failure(tmp_path) -> None:
    rows = [np.log(np.full(4, 0.25)), np.log(np.array([0.4, 0.2, 0.2, 0.2]))]
    dirs = []
    for i, row in enumerate(rows):
        (tmp_path / f"p{i}").mkdir()
        np.save(tmp_path / f"p{i}" / "a-8-0.npy", row)
        dirs.append(tmp_path / f"p{i}")
    rec = {"engine": "a", "tokens": 8, "repeat": 0, "path": "resident", "ids": [1, 2]}
    lines, ok = compare([[{**rec, "sha": "x"}], [{**rec, "sha": "y", "ids": [1, 3]}]], dirs)
    assert not ok and not lines[0]["self_consistent"]
    [other] = lines[0]["processes"]
    assert other["ids_differ_at"] == 1 and other["kl"] == pytest.approx(kl(rows[0], rows[1])) and other["kl"] > 0
    assert other["max_abs_diff"] == pytest.approx(np.log(0.4 / 0.25))


def test_engine_specs() -> None:
    assert parse_engine("r:prefill_mode=resident,chunk_tokens=64,prefill_graphs=false") == (
        "r", {"prefill_mode": "resident", "chunk_tokens": 64, "prefill_graphs": False})
    with pytest.raises(ValueError, match="not FIELD=VALUE"):
        parse_engine("r:no_such_field=1")
    with pytest.raises(ValueError, match="no name"):
        parse_engine(":prefill_mode=resident")


def test_the_memory_check_runs_both_slot_layouts_on_cpu(tmp_path) -> None:
    """``tools.gpucheck_memory`` end to end on CPU: each engine built under the budget with its plan, and the
    four points (no memory figures off CUDA)."""
    from abbench.engine.tools.gpucheck_memory import main as memory_main

    out = tmp_path / "mem.json"
    assert memory_main(["--device", "cpu", "--budget", "2.3", "--max-context", "512", "--tokens", "128",
                        "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["engine"] for r in rows] == ["shared", "beside"]
    assert "in one allocation" in rows[0]["plan"] and "in one allocation" not in rows[1]["plan"]
    assert all(r["plan_total_gib"] <= 2.3 and r["plan_reserve_gib"] == 2.0 for r in rows)
    assert [p["at"] for p in rows[0]["points"]] == ["start", "after a request", "after empty_cache",
                                                   "after a second request"]
    assert all(p["allocated"] is None for r in rows for p in r["points"])


def test_depth_continues_the_layer_pattern_and_refuses_qwen4() -> None:
    from abbench.engine.config import PRESETS
    from abbench.engine.tools.gpucheck_bits import deepen

    mc = PRESETS["qwen3.5-tiny"]
    deep = deepen(mc, 10)
    assert deep.num_hidden_layers == 10 and deep.layer_types == (mc.layer_types * 3)[:10]
    assert deep.attention_layers == (3, 7) and deep.hidden_size == mc.hidden_size
    assert deepen(PRESETS["tiny"], 6).num_hidden_layers == 6
    with pytest.raises(ValueError, match="Qwen4-Exp"):
        deepen(PRESETS["qwen4-exp-tiny"], 6)


def test_the_engine_turns_on_expandable_segments_on_cuda_unless_the_environment_configures_the_allocator() -> None:
    import torch

    from abbench.engine.runtime.engine import allocator_settings

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert allocator_settings(cuda, {}) == "expandable_segments:True"
    assert allocator_settings(cuda, {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}) is None
    assert allocator_settings(cuda, {"PYTORCH_ALLOC_CONF": "expandable_segments:False"}) is None
    assert allocator_settings(cpu, {}) is None
