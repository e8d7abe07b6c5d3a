"""Running experiments: everything that launches services and sends requests.

* :mod:`abbench.runner.run`: :func:`execute` and the :class:`Run` (start_service / prime / measure / on_failure /
  finish); :func:`prepare` builds a profile's prompts.
* :mod:`abbench.runner.preflight`: every arm's service checked before the first sample of any arm.
* :mod:`abbench.runner.slot`: the service slot (launch, attach, stop, monitor) and the launch-command check.
* :mod:`abbench.runner.rundir`: the run directory (refused when taken, opened, removed when nothing was measured)
  and the command that resumes a partial run.
* :mod:`abbench.runner.lock`: the run lock and the signal handling.
* :mod:`abbench.runner.resume`: what must match before a partial run is resumed.
* :mod:`abbench.runner.plans`: the kinds of plan (fixed rounds, auto rounds, sweeps), one strategy each behind
  one interface; how a new kind plugs in is said there.
* :mod:`abbench.runner.rounds`: ``rounds = "auto"``: the stopping rule and the plan extended.
* :mod:`abbench.runner.sweep`: a sweep's points, stages and passes.

The divergence diagnostics (``abbench diff``/``probe``), which launch services through this package, are
:mod:`abbench.diagnostics`; nothing here loads them.
"""

from abbench.runner.lock import LOCK_FILE, RunLock
from abbench.runner.run import (
    DEATH_GRACE_S,
    WARMUP_KINDS,
    Interrupted,
    Observer,
    ProgressEvent,
    Run,
    execute,
    new_run_id,
    prepare,
    priming_steps,
    profile_dir,
)
from abbench.runner.rundir import check_run_dir_free, resume_hint
from abbench.runner.slot import ServiceSlot, check_launch_commands

__all__ = [
    "DEATH_GRACE_S", "LOCK_FILE", "WARMUP_KINDS", "Interrupted", "Observer", "ProgressEvent", "Run", "RunLock",
    "ServiceSlot", "check_launch_commands", "check_run_dir_free", "execute", "new_run_id", "prepare", "resume_hint",
    "priming_steps", "profile_dir",
]
