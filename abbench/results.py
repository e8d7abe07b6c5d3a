"""The result schema of a run, and reading/writing it.

A run directory holds:

* ``run.json``       — one :class:`RunRecord` (versioned; rewritten atomically at every service boundary and
                        at the end, with ``status`` "running", "partial" or "complete");
* ``requests.jsonl`` — one :class:`Sample` per line, appended and flushed as each request finishes, so a
                        crash loses nothing that finished;
* ``logs/``          — one log file per service instance (stdout and stderr together).

Only raw observations are stored (timestamps, ids, counters); derived metrics (ratios, tokens/s, medians)
are computed by :mod:`abbench.analysis` and never stored twice. ``report`` and ``gate`` read these files only.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from abbench.errors import ResultsError
from abbench.loadrecords import LoadLevel

SCHEMA_VERSION = 1
RUN_FILE = "run.json"
SAMPLES_FILE = "requests.jsonl"
LOGS_DIR = "logs"

PromptKind = Literal["warmup", "jit", "fresh", "cold", "continuation"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PromptRecord(_Model):
    """One exact-length prompt. The text is not stored (it is rebuilt deterministically); its hash is."""

    id: str = Field(description="Stable id, e.g. 'fresh-1024-0', 'pair0-cold', 'pair0-cont', 'warmup-1'.")
    kind: PromptKind
    target_tokens: int = Field(description="Exact token count the prompt was built to.")
    token_count: int = Field(description="Token count measured by re-encoding the text (== target).")
    sha256: str = Field(description="sha256 of the UTF-8 prompt text.")
    corpus: str = Field(description="Corpus the text was cut from.")
    parent: str | None = Field(None, description="For a continuation: the id of the cold prompt it extends.")
    preview: str = Field("", description="The first characters of the text, for humans.")


class Step(_Model):
    """One planned request."""

    index: int = Field(description="Position in the plan (execution order).")
    round: int = Field(description="Round number, from 1. Warm-up steps carry the round of their service.")
    arm: str
    position: int = Field(description="Index of the arm in this round's arm order (0 = ran first).")
    prompt_id: str
    kind: PromptKind
    group: str = Field(description="Sample group: a fresh prompt alone, or a cold/continuation pair.")
    service: str = Field(description="Key of the service instance that serves this step.")
    reset_before: bool = Field(description="POST the engine's reset path before this step.")
    excluded: bool = Field(description="Excluded by the profile's pre-registered rule (still run).")


class Telemetry(_Model):
    """Per-request telemetry gathered around one request."""

    metrics_before: dict[str, float] | None = Field(None, description="Engine /metrics scrape before.")
    metrics_after: dict[str, float] | None = Field(None, description="Engine /metrics scrape after.")
    nvml_pcie_rx_bytes: float | None = Field(
        None, description="Host->device bytes estimated from NVML PCIe RX throughput samples over the request."
    )
    gpu_mem_used_peak: int | None = None
    proc_gpu_mem_peak: int | None = None
    host_rss_peak: int | None = Field(None, description="Peak RSS of the service's process tree (bytes).")
    host_cpu_busy: float | None = Field(None, description="Fraction of all host CPUs' time busy during the request.")
    host_cpu_steal: float | None = Field(
        None, description="Fraction of all host CPUs' time stolen by the hypervisor during the request (Linux).")
    service_cpu_s: float | None = Field(
        None, description="CPU seconds (user + system) of the service's process tree during the request.")


class Sample(_Model):
    """One finished (or failed) request. Appended to requests.jsonl when it finishes."""

    step: int
    arm: str
    round: int
    position: int
    prompt_id: str
    kind: PromptKind
    excluded: bool
    service: str
    ok: bool = Field(description="False if the request failed; then error_kind/error say why.")
    error_kind: str | None = None
    error: str | None = None
    started_at: float = Field(description="Wall-clock time (unix seconds) just before the request.")
    ttft_s: float | None = Field(None, description="perf_counter from before the request to the first event with text.")
    total_s: float | None = Field(None, description="perf_counter from before the request to the end of the response.")
    token_times_s: list[float] | None = Field(
        None, description="Streamed: perf_counter from before the request to the arrival of each output token (the "
        "chunk that carried it; one entry per native id, or per text event when the engine sends no ids).")
    output_ids: list[int] = Field(default_factory=list)
    ids_source: Literal["native", "retokenized", "none"] = "none"
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int | None = Field(None, description="usage.prompt_tokens reported by the server.")
    completion_tokens: int | None = None
    saw_done: bool = False
    logprobs: list[list[tuple[int, float]]] | None = Field(
        None, description="Per output position: top-k (id, logprob), best first, when captured."
    )
    engine: dict[str, Any] | None = Field(None, description="The engine's own per-request object (abbench).")
    telemetry: Telemetry = Field(default_factory=Telemetry)


class ServiceRecord(_Model):
    key: str
    arms: list[str]
    round: int | None
    command: list[str] | None = Field(None, description="argv as launched (None: an existing base_url).")
    env: dict[str, str] = Field(default_factory=dict, description="Environment the profile added.")
    base_url: str
    log: str | None = Field(None, description="Log file, relative to the run directory.")
    started_at: float | None = None
    ready_s: float | None = Field(None, description="Seconds from launch to healthy.")
    stopped_at: float | None = None
    exit_code: int | None = None
    gpu_idle_before: bool | None = None
    gpu_idle_after: bool | None = None
    error: str | None = None
    control: dict[str, Any] | None = Field(
        None, description="The start-up probe of the reset and metrics paths: each path's HTTP status, the "
        "engine counters its /metrics holds, warnings (abbench.runner.slot.probe_control_paths).")


class MemoryPoint(_Model):
    t: float = Field(description="Wall-clock time (unix seconds).")
    service: str
    gpu_mem_used: int | None = None
    proc_gpu_mem: int | None = None
    host_rss: int | None = None
    pcie_rx_bytes_per_s: float | None = None
    pcie_tx_bytes_per_s: float | None = None


class VocabKL(_Model):
    """The whole-vocabulary KL at the first output position of one sample against one sample of the parity
    reference on the same prompt (``request.full_logprobs``: abbench.vocabrows)."""

    step: int = Field(description="The sample's step.")
    against: int = Field(description="The parity reference's sample's step.")
    kl: float | None = Field(description="KL(reference || sample) over the whole vocabulary, nats (None: infinite, "
                             "the sample gives no probability to an id the reference does).")
    vocab: int = Field(description="Entries of each row.")


class RunRecord(_Model):
    schema_version: int = SCHEMA_VERSION
    run_id: str
    status: Literal["running", "partial", "complete"]
    status_reason: str | None = Field(None, description="Why a run is partial (interrupt, stop on failure).")
    created_at: float
    finished_at: float | None = None
    abbench_version: str
    profile: dict[str, Any] = Field(description="The effective profile (after CLI overrides).")
    environment: dict[str, Any] = Field(default_factory=dict, description="Fingerprint: GPU, driver, versions...")
    prompts: list[PromptRecord] = Field(default_factory=list)
    plan: list[Step] = Field(default_factory=list)
    samples: list[Sample] = Field(default_factory=list)
    services: list[ServiceRecord] = Field(default_factory=list)
    memory: list[MemoryPoint] = Field(default_factory=list, description="Background samples over time.")
    auto_rounds: dict[str, Any] | None = Field(
        None, description="With run.rounds = 'auto': the stopping rule fixed before the run, each decision "
        "after a round, and why the run stopped (abbench.runner.rounds).")
    sweep: dict[str, Any] | None = Field(
        None, description="With a [sweep] table: its rule, each pass (stage, arms, points, why), each decision "
        "after a pass, why the sweep stopped and its result: per arm pair the points and the crossover "
        "(abbench.runner.sweep).")
    load: list[LoadLevel] = Field(
        default_factory=list, description="With a [load] table: every (arm, level, round) cell as it ran, with "
        "each request's stamps, ids and errors (abbench.loadrecords); empty otherwise.")
    vocab_kl: list[VocabKL] = Field(
        default_factory=list, description="With request.full_logprobs: the whole-vocabulary KL at the first output "
        "position of every measured sample against every measured sample of the parity reference on the same "
        "prompt (abbench.vocabrows); empty otherwise.")


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_run(run_dir: Path, record: RunRecord) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / RUN_FILE
    _atomic_write(path, record.model_dump_json(indent=1))
    return path


class SampleLog:
    """Append-only JSONL of samples; each line is flushed and fsynced as it is written.

    Opening an existing file (a resumed run) first repairs a torn last line, the trace of a crash in the
    middle of a write: a last line without its newline is completed when it holds a whole sample and cut
    off otherwise (it was never a sample), so the next sample starts on a line of its own. ``repaired``
    says what was done (None when nothing was needed)."""

    def __init__(self, run_dir: Path) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / SAMPLES_FILE
        self.repaired: str | None = _repair_tail(self.path)
        self._f = open(self.path, "a", encoding="utf-8")

    def append(self, sample: Sample) -> None:
        self._f.write(sample.model_dump_json() + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()

    def __enter__(self) -> SampleLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _repair_tail(path: Path) -> str | None:
    try:
        with open(path, "rb+") as f:
            size = f.seek(0, os.SEEK_END)
            if size == 0:
                return None
            f.seek(size - 1)
            if f.read(1) == b"\n":
                return None
            back = min(size, 64 * 1024 * 1024)  # one sample is far smaller
            f.seek(size - back)
            data = f.read(back)
            cut = data.rfind(b"\n") + 1  # 0 when the file is one torn line
            tail = data[cut:]
            try:
                Sample.model_validate_json(tail)
            except ValidationError:
                if cut == 0 and back < size:  # no line end in reach: isolate the tail instead of guessing
                    f.write(b"\n")
                    f.flush()
                    os.fsync(f.fileno())
                    return f"{path.name}: ended an unreadable last line of over {back} bytes"
                f.truncate(size - back + cut)
                what = f"cut off a torn last line of {len(tail)} bytes"
            else:
                f.write(b"\n")
                what = "completed a last line that lacked its newline"
            f.flush()
            os.fsync(f.fileno())
            return f"{path.name}: {what}"
    except FileNotFoundError:
        return None


def read_samples(path: Path) -> tuple[list[Sample], list[str]]:
    """Samples from a JSONL file, and a list of problems (a torn last line after a crash is reported, not
    fatal; a corrupt line in the middle is reported too)."""
    samples: list[Sample] = []
    problems: list[str] = []
    if not path.exists():
        return samples, [f"{path.name} is missing"]
    try:
        f = open(path, "rb")  # bytes: a line that is not UTF-8 is one unreadable sample, not a crash
    except OSError as e:
        return samples, [f"{path.name} cannot be read: {e.strerror or e}"]
    with f:
        lines = f.read().split(b"\n")
    torn = bool(lines) and lines[-1].strip() != b""  # the file does not end with a newline
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            samples.append(Sample.model_validate_json(line))
        except ValidationError as e:
            if torn and n == len(lines):
                problems.append(f"{path.name} line {n}: torn last line (a write cut short by a crash); skipped")
            else:
                problems.append(f"{path.name} line {n}: unreadable sample ({e.error_count()} errors); skipped")
    return samples, problems


def resolve_run_dir(run: str | Path, results_root: Path | None = None) -> Path:
    """A run directory, a run.json path, or a run id under ``results/``."""
    p = Path(run)
    if p.is_file() and p.name == RUN_FILE:
        return p.parent
    if p.is_dir():
        return p
    if results_root is not None and (results_root / str(run)).is_dir():
        return results_root / str(run)
    raise ResultsError(f"no run at {run}: pass a run directory (holding {RUN_FILE}) or a run id under results/")


def tracked_runs(results_root: Path) -> set[str]:
    """Names of the run folders under ``results_root`` whose ``run.json`` git tracks (a project's committed runs);
    empty without git or outside a checkout."""
    import subprocess

    try:
        r = subprocess.run(["git", "-C", str(results_root), "ls-files", "-z", "--", f"*/{RUN_FILE}"],
                           capture_output=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return set()
    if r.returncode != 0:
        return set()
    return {Path(p).parent.name for p in r.stdout.decode("utf-8", "surrogateescape").split("\0") if p}


def latest_run(results_root: Path) -> Path:
    """The most recent run directory under ``results_root``: of the folders that hold a ``run.json``, the one
    whose ``run.json`` was written last (a run rewrites it at every service boundary and at the end; a
    resumed run counts from its resume). Runs that git tracks are the project's committed evidence, not the
    user's latest: they are left out (a fresh clone's checkout gives them all one time). :class:`ResultsError`
    when there is none."""
    found: list[tuple[float, str, Path]] = []
    try:
        children = list(results_root.iterdir()) if results_root.is_dir() else []
    except OSError as e:
        raise ResultsError(f"{results_root}: cannot be listed ({e.strerror or e})") from None
    for d in children:
        try:
            found.append(((d / RUN_FILE).stat().st_mtime, d.name, d))
        except OSError:
            continue
    committed = tracked_runs(results_root) if found else set()
    mine = [f for f in found if f[1] not in committed]
    where = results_root.resolve() if results_root.exists() else results_root
    if not mine and found:
        raise ResultsError(f"no run given, and the {len(found)} runs under {where} are the project's committed ones "
                           "(git tracks them): pass one (e.g. `abbench report results/<run>`), or run `abbench run` "
                           "first")
    if not mine:
        raise ResultsError(f"no run given and no run under {where} (no folder there holds a {RUN_FILE}): pass a "
                           "run directory, or run `abbench run` here first")
    return max(mine)[2]


def load_run(run: str | Path, results_root: Path | None = None) -> tuple[RunRecord, list[str]]:
    """Load a run. Samples come from requests.jsonl when it holds more than run.json (a crash between the
    two). Returns the record and a list of problems found (for the report to state)."""
    run_dir = resolve_run_dir(run, results_root)
    path = run_dir / RUN_FILE
    if not path.exists():
        raise ResultsError(f"{run_dir}: no {RUN_FILE}; this is not an abbench run directory")
    try:
        raw = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ResultsError(f"{path}: corrupt JSON ({e}); requests.jsonl may still hold the samples") from None
    except RecursionError:
        raise ResultsError(f"{path}: corrupt JSON (nested too deeply)") from None
    except OSError as e:
        raise ResultsError(f"{path}: cannot be read: {e.strerror or e}") from None
    version = raw.get("schema_version") if isinstance(raw, dict) else None
    if version != SCHEMA_VERSION:
        raise ResultsError(f"{path}: schema_version {version!r}, this abbench reads {SCHEMA_VERSION}")
    try:
        record = RunRecord.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise ResultsError(f"{path}: does not match the run schema at {loc}: {first['msg']}") from None
    jsonl, problems = read_samples(run_dir / SAMPLES_FILE)
    if run_dir.name != record.run_id:  # a run moved after it was made (e.g. from a GPU machine's scratch folder)
        problems.append(f"run recorded as {record.run_id!r}; named after its directory, {run_dir.name!r}")
        record.run_id = run_dir.name
    if len(jsonl) > len(record.samples):
        problems.append(
            f"run.json holds {len(record.samples)} samples, requests.jsonl {len(jsonl)}: using requests.jsonl"
        )
        record.samples = jsonl
    return record, problems

