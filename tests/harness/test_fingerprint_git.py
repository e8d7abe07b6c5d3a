"""The fingerprint's git state: a real checkout (clean, then dirty), and a copy of the tree without .git
whose commit comes from ABBENCH_GIT_COMMIT (refused unless it is a hex sha) and whose dirty flag from
ABBENCH_GIT_DIRTY."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from abbench import fingerprint
from abbench.errors import ConfigError

SHA = "4fcb60f0123456789abcdef0123456789abcdef0"


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


@pytest.fixture(autouse=True)
def no_given_state(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("ABBENCH_GIT_COMMIT", "ABBENCH_GIT_DIRTY", "ABBENCH_GIT_CHANGES_SHA256"):
        monkeypatch.delenv(k, raising=False)


def test_a_checkout_records_its_commit_and_a_dirty_tree(tmp_path: Path) -> None:
    git(tmp_path, "init", "-q")
    (tmp_path / "a.txt").write_text("one\n")
    git(tmp_path, "add", "a.txt")
    git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    head = git(tmp_path, "rev-parse", "HEAD").strip()
    clean = fingerprint.git_state(tmp_path)
    assert clean["commit"] == head and clean["dirty"] is False
    assert fingerprint.environment_fingerprint(repo_dir=tmp_path)["engine_commit"] == head
    (tmp_path / "a.txt").write_text("two\n")
    dirty = fingerprint.git_state(tmp_path)
    assert dirty["dirty"] is True and len(dirty["changes_sha256"]) == 64
    fp = fingerprint.environment_fingerprint(repo_dir=tmp_path)
    assert fp["engine_commit"] == f"{head}+dirty.{dirty['changes_sha256'][:12]}"


@pytest.mark.parametrize("value", ["COMMIT_PLACEHOLDER", "4fcb60", "main", "4fcb60f!", "g" * 40, "a" * 41])
def test_a_commit_that_is_not_a_hex_sha_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   value: str) -> None:
    monkeypatch.setenv("ABBENCH_GIT_COMMIT", value)
    with pytest.raises(ConfigError, match=r"is not a git commit sha \(7 to 40 hex digits\)") as e:
        fingerprint.environment_fingerprint(repo_dir=tmp_path)
    assert repr(value) in str(e.value) and "git rev-parse HEAD" in str(e.value)


def test_a_given_commit_and_dirty_flag_are_recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ABBENCH_GIT_COMMIT", SHA.upper())
    state = fingerprint.git_state(tmp_path)
    assert state["commit"] == SHA and state["dirty"] is None and state["source"] == "ABBENCH_GIT_COMMIT"
    assert fingerprint.environment_fingerprint(repo_dir=tmp_path)["engine_commit"] == f"{SHA}+dirty-unknown"
    monkeypatch.setenv("ABBENCH_GIT_DIRTY", "0")
    assert fingerprint.environment_fingerprint(repo_dir=tmp_path)["engine_commit"] == SHA
    monkeypatch.setenv("ABBENCH_GIT_DIRTY", "1")
    assert fingerprint.environment_fingerprint(repo_dir=tmp_path)["engine_commit"] == f"{SHA}+dirty"
    monkeypatch.setenv("ABBENCH_GIT_CHANGES_SHA256", "ab" * 32)
    fp = fingerprint.environment_fingerprint(repo_dir=tmp_path)
    assert fp["engine_commit"] == f"{SHA}+dirty.{'ab' * 6}" and fp["git"]["dirty"] is True
    monkeypatch.setenv("ABBENCH_GIT_DIRTY", "maybe")
    with pytest.raises(ConfigError, match="ABBENCH_GIT_DIRTY='maybe': use 1"):
        fingerprint.git_state(tmp_path)


def test_a_given_commit_wins_over_a_stale_checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A copied tree may carry a .git of another commit: the commit whoever copied it gives is recorded, and what
    the .git says is kept beside it."""
    git(tmp_path, "init", "-q")
    (tmp_path / "a.txt").write_text("one\n")
    git(tmp_path, "add", "a.txt")
    git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    stale = git(tmp_path, "rev-parse", "HEAD").strip()
    (tmp_path / "a.txt").write_text("the copied tree\n")
    monkeypatch.setenv("ABBENCH_GIT_COMMIT", SHA)
    monkeypatch.setenv("ABBENCH_GIT_DIRTY", "0")
    state = fingerprint.git_state(tmp_path)
    assert state["commit"] == SHA and state["dirty"] is False and state["source"] == "ABBENCH_GIT_COMMIT"
    assert state["checkout"]["commit"] == stale and state["checkout"]["dirty"] is True
    assert fingerprint.environment_fingerprint(repo_dir=tmp_path)["engine_commit"] == SHA


def test_no_git_and_no_given_commit_is_none(tmp_path: Path) -> None:
    assert fingerprint.git_state(tmp_path) is None
    assert fingerprint.environment_fingerprint(repo_dir=tmp_path)["engine_commit"] is None


def test_what_a_default_run_writes_does_not_dirty_the_next_runs_commit(tmp_path: Path) -> None:
    """A checkout with the repository's .gitignore: a run's results/<id>/ and reports/<id>.md + reports/<id>/
    (what `abbench run` writes in the checkout) leave it clean; a committed report that changes, or another
    untracked file, is dirty."""
    repo_ignore = (Path(__file__).resolve().parents[2] / ".gitignore").read_text()
    git(tmp_path, "init", "-q")
    (tmp_path / ".gitignore").write_text(repo_ignore)
    (tmp_path / "reports").mkdir()
    (tmp_path / "reports" / "committed.md").write_text("a committed report\n")
    git(tmp_path, "add", ".gitignore")
    git(tmp_path, "add", "-f", "reports/committed.md")
    git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    run_id = "20991231-000000-cpu-tiny"
    for rel in (f"results/{run_id}/run.json", f"results/{run_id}/requests.jsonl", f"results/{run_id}/logs/a.log",
                f"reports/{run_id}.md", f"reports/{run_id}/ttft.png"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    assert fingerprint.git_state(tmp_path)["dirty"] is False
    (tmp_path / "reports" / "committed.md").write_text("regenerated\n")
    assert fingerprint.git_state(tmp_path)["dirty"] is True
    git(tmp_path, "checkout", "-q", "reports/committed.md")
    (tmp_path / "notes.txt").write_text("mine")
    assert fingerprint.git_state(tmp_path)["dirty"] is True
