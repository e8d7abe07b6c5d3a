"""``abbench run --resume`` refuses to mix two environments, two prompt sets or two plans in one run.

One real run (tests/support/fakeserver.py as the engine) is cut after its first sample, as an interrupt leaves it;
each test changes one recorded thing in a copy of it and resumes. A refusal must name the field and leave
the partial run untouched; where the check were skipped, the resume would run the missing step and pass.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest

from abbench import runner
from abbench.errors import ResultsError
from abbench.profile import profile_from_dict
from abbench.results import load_run

from tests.support import cli
from tests.support import faultkit as fk

RUN_FILE, SAMPLES_FILE = "run.json", "requests.jsonl"


@pytest.fixture(scope="module")
def cut_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], str]:
    """A finished two-arm run, cut after its first sample (status partial)."""
    mark = fk.new_mark()
    prof = fk.fake_profile(mark, arms=[{"name": "a"}, {"name": "b"}], prompts={"warmup": 0})
    base = tmp_path_factory.mktemp("resume")
    record = runner.execute(profile_from_dict(prof), base / "full")
    assert record.status == "complete" and len(record.samples) == 2
    fk.assert_no_leftovers(mark)
    cut = base / "cut"
    shutil.copytree(base / "full", cut)
    raw = json.loads((cut / RUN_FILE).read_text())
    raw["samples"] = raw["samples"][:1]
    raw["status"], raw["status_reason"] = "partial", "interrupted (test)"
    (cut / RUN_FILE).write_text(json.dumps(raw))
    first = (cut / SAMPLES_FILE).read_bytes().splitlines(keepends=True)[0]
    (cut / SAMPLES_FILE).write_bytes(first)
    return cut, prof, mark


def _tampered(cut_run, tmp_path: Path, change: Callable[[dict[str, Any]], None]) -> Path:
    src, _, _ = cut_run
    dst = tmp_path / "run"
    shutil.copytree(src, dst)
    raw = json.loads((dst / RUN_FILE).read_text())
    change(raw)
    (dst / RUN_FILE).write_text(json.dumps(raw))
    return dst


def _refused(cut_run, run_dir: Path, *fragments: str) -> None:
    _, prof, mark = cut_run
    before = {p: (run_dir / p).read_bytes() for p in (RUN_FILE, SAMPLES_FILE)}
    with pytest.raises(ResultsError) as e:
        runner.execute(profile_from_dict(prof), run_dir, resume=True)
    msg = " ".join(str(e.value).split())
    for frag in fragments:
        assert frag in msg, msg
    assert {p: (run_dir / p).read_bytes() for p in before} == before  # the partial run is left as it was
    fk.assert_no_leftovers(mark)  # refused before any service started


def _env(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(raw: dict[str, Any]) -> None:
        cur = raw["environment"]
        *parents, last = path.split(".")
        for p in parents:
            cur = cur.setdefault(p, {})
        cur[last] = value
    return change


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        ("packages.torch", "1.0.0+other", "packages.torch"),
        ("packages.transformers", "0.0.1", "packages.transformers"),
        ("gpus", [{"index": 0, "name": "NVIDIA H200"}], "gpu_models"),
        ("driver_version", "580.159.04", "driver_version"),
        ("cuda_driver_version", "13.0", "cuda_driver_version"),
        ("engine_commit", "0123456789abcdef0123456789abcdef01234567", "engine_commit"),
    ],
)
def test_a_changed_key_field_refuses_the_resume(cut_run, tmp_path: Path, path: str, value: Any, field: str) -> None:
    run_dir = _tampered(cut_run, tmp_path, _env(path, value))
    _refused(cut_run, run_dir, f"cannot resume: {field} was {value!r}" if field != "gpu_models"
             else "cannot resume: gpu_models was ['NVIDIA H200']", "Start a new run instead")


def test_a_dirty_tree_at_another_commit_refuses_the_resume(cut_run, tmp_path: Path) -> None:
    src, _, _ = cut_run
    now = json.loads((src / RUN_FILE).read_text())["environment"]["engine_commit"]
    dirty_hash = now.partition("+dirty.")[2] or "e012b6e4ad77"
    old = "0123456789abcdef0123456789abcdef01234567+dirty." + dirty_hash
    run_dir = _tampered(cut_run, tmp_path, _env("engine_commit", old))
    _refused(cut_run, run_dir, f"cannot resume: engine_commit was {old!r}")


def test_other_local_changes_on_the_same_commit_resume_with_a_note(cut_run, tmp_path: Path) -> None:
    """The documented exception: the same commit with other local changes (``+dirty.<hash>`` differs, e.g.
    a README edit) resumes, and the difference is recorded in the run and announced."""
    src, prof, mark = cut_run
    now = json.loads((src / RUN_FILE).read_text())["environment"]["engine_commit"]
    old = now.partition("+dirty.")[0] + "+dirty.000000000000"
    run_dir = _tampered(cut_run, tmp_path, _env("engine_commit", old))
    events: list[runner.ProgressEvent] = []
    record = runner.execute(profile_from_dict(prof), run_dir, resume=True, observer=events.append)
    assert record.status == "complete"
    (resumed,) = record.environment["resumed"]
    assert resumed["notes"] == [f"note: engine_commit {old} -> {now} (same commit, other local changes)"]
    assert any(e.kind == "warning" and f"resuming with engine_commit {old} -> {now}" in e.message for e in events)
    fk.assert_no_leftovers(mark)


def test_changed_prompts_refuse_the_resume(cut_run, tmp_path: Path) -> None:
    def change(raw: dict[str, Any]) -> None:
        raw["prompts"][-1]["sha256"] = "0" * 64  # as if the tokenizer or a corpus had changed
    _refused(cut_run, _tampered(cut_run, tmp_path, change), "the prompts rebuilt now differ from the run's",
             "cannot resume")


@pytest.mark.parametrize("what", ["arm order", "reset", "exclusion"])
def test_a_changed_plan_refuses_the_resume(cut_run, tmp_path: Path, what: str) -> None:
    def change(raw: dict[str, Any]) -> None:
        plan = raw["plan"]
        if what == "arm order":
            plan[0]["arm"], plan[1]["arm"] = plan[1]["arm"], plan[0]["arm"]
        elif what == "reset":
            plan[1]["reset_before"] = not plan[1]["reset_before"]
        else:
            plan[1]["excluded"] = not plan[1]["excluded"]
    _refused(cut_run, _tampered(cut_run, tmp_path, change), "the plan rebuilt now differs from the run's",
             "cannot resume")


def test_refusal_through_the_cli_exits_2_and_names_the_field(cut_run, tmp_path: Path) -> None:
    run_dir = _tampered(cut_run, tmp_path, _env("packages.torch", "1.0.0+other"))
    res = cli.abbench("run", "--resume", str(run_dir), "-q", "--no-report", cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    assert "cannot resume: packages.torch was '1.0.0+other'" in fk.flat(res.stderr)
    record, _ = load_run(run_dir)
    assert record.status == "partial" and len(record.samples) == 1 and "resumed" not in record.environment
