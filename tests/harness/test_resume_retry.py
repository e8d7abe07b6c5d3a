"""``--resume`` runs again the steps whose sample failed (``--keep-failed`` keeps them), every stop that leaves a
partial run names the exact resume command, and the warnings say what happens to an attached server (it is
waited for, never "launched again").

Two arms on two in-process fake engines (tests/support/fakeserver.py with the qwen3 vocabulary) attached by
``base_url``; the test stops arm b's server after its first sample, as a server that dies, and starts it again
on the same port before resuming."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
from typer.testing import CliRunner

from abbench import runner
from abbench.cli import app
from abbench.engine.serve.tokenizer import load_tokenizer
from abbench.errors import ResultsError, ServiceError
from abbench.profile import profile_from_dict
from abbench.runner.run import ProgressEvent

from tests.support import faultkit as fk
from tests.support.fakeserver import FakeConfig, FakeServer


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer("qwen3")


def _profile(a: str, b: str, *, rounds: int, per_length: int) -> dict[str, Any]:
    return fk.fake_profile("unused", engine={"command": [], "health_timeout_s": 10},
                           prompts={"lengths": [24], "per_length": per_length, "warmup": 0},
                           arms=[{"name": "a", "base_url": a}, {"name": "b", "base_url": b}], run={"rounds": rounds})


def _stop_after_first_b(srv: FakeServer, events: list[ProgressEvent]) -> Callable[[ProgressEvent], None]:
    def observe(ev: ProgressEvent) -> None:
        events.append(ev)
        if ev.kind == "sample" and ev.sample is not None and ev.sample.arm == "b" and srv.stats()["completions"]:
            srv.stop()  # idempotent: later samples of b find it stopped

    return observe


def _lines(run_dir: Path) -> list[bytes]:
    return (run_dir / "requests.jsonl").read_bytes().splitlines(keepends=True)


def test_a_failed_sample_is_run_again_on_resume(tmp_path: Path, tok: Any) -> None:
    """b's server dies after its first sample: its second sample fails (connect), the warning says the
    attached server is waited for, the run ends complete with a failed sample. With the server back, a resume
    runs that step alone again; every other line of requests.jsonl stays byte for byte."""
    out = tmp_path / "run"
    events: list[ProgressEvent] = []
    with FakeServer(FakeConfig(), tokenizer=tok) as a:
        b = FakeServer(FakeConfig(), tokenizer=tok).start()
        port = b.port
        record = runner.execute(profile_from_dict(_profile(a.base_url, b.base_url, rounds=1, per_length=2)), out,
                                observer=_stop_after_first_b(b, events))
        failed = [s for s in record.samples if not s.ok]
        assert record.status == "complete" and [(s.arm, s.error_kind) for s in failed] == [("b", "connect")]
        warning = [e.message for e in events if e.kind == "warning"]
        assert len(warning) == 1 and f"abbench did not start it ({b.base_url}), so cannot restart it" in warning[0]
        assert "launched again" not in warning[0]
        before = _lines(out)
        assert len(before) == 4

        keep = tmp_path / "keep"
        shutil.copytree(out, keep)
        with pytest.raises(ResultsError, match=r"already complete; nothing to resume \(its 1 failed sample\(s\) are "
                                               "kept with --keep-failed\\)"):
            runner.execute(profile_from_dict(_profile(a.base_url, b.base_url, rounds=1, per_length=2)), keep,
                           resume=True, keep_failed=True)

        with FakeServer(FakeConfig(), port=port, tokenizer=tok) as again:
            events.clear()
            resumed = runner.execute(profile_from_dict(json.loads((out / "run.json").read_text())["profile"]), out,
                                     resume=True, observer=events.append)
            assert again.stats()["completions"] == 1  # the failed step alone
    assert resumed.status == "complete" and all(s.ok for s in resumed.samples) and len(resumed.samples) == 4
    assert [s.step for s in resumed.samples] == sorted(s.step for s in record.samples if s.ok) + [failed[0].step]
    after = _lines(out)
    assert after[:3] == [x for x in before if json.loads(x)["ok"]]  # the others untouched, the failed line gone
    assert json.loads(after[3])["step"] == failed[0].step and json.loads(after[3])["ok"]
    entry = json.loads((out / "run.json").read_text())["environment"]["resumed"][-1]
    assert [(r["step"], r["arm"], r["error_kind"]) for r in entry["retried"]] == [(failed[0].step, "b", "connect")]
    assert any(e.kind == "warning" and "1 failed sample(s) run again" in e.message for e in events)


def test_a_server_that_cannot_be_attached_again_stops_with_the_resume_command(tmp_path: Path, tok: Any) -> None:
    """Two rounds: b's server dies after round 1; round 2 starts with b, whose attach is refused: the run stops
    partial, the error names the exact resume command, and the resume with the server back finishes it."""
    out = tmp_path / "run"
    with FakeServer(FakeConfig(), tokenizer=tok) as a:
        b = FakeServer(FakeConfig(), tokenizer=tok).start()
        port = b.port
        prof = _profile(a.base_url, b.base_url, rounds=2, per_length=1)
        with pytest.raises(ServiceError) as e:
            runner.execute(profile_from_dict(prof), out, observer=_stop_after_first_b(b, []))
        msg = str(e.value)
        assert msg.splitlines()[0].startswith("service b@r2: connection refused")
        assert msg.splitlines()[-1] == (f"the run is saved as partial (2 samples); resume it with "
                                        f"`abbench run --resume {out}`")
        assert json.loads((out / "run.json").read_text())["status"] == "partial"
        with FakeServer(FakeConfig(), port=port, tokenizer=tok):
            resumed = runner.execute(profile_from_dict(prof), out, resume=True)
    assert resumed.status == "complete" and len(resumed.samples) == 4 and all(s.ok for s in resumed.samples)


def test_keep_failed_needs_resume() -> None:
    res = CliRunner().invoke(app, ["run", "--keep-failed"])
    assert res.exit_code == 2 and "--keep-failed applies to a resumed run" in " ".join(res.output.split())
