"""The load generator: load levels of one arm against one running service, asynchronous, with the exact
per-token arrival stamps of the synchronous client.

* :mod:`~abbench.loadgen.plan`: the load prompts (exact lengths drawn from ``[load]``'s distributions) and the
  open loop's seeded arrival times;
* :mod:`~abbench.loadgen.wire`: one streamed request over an asyncio HTTP/1.1 connection, stamped per chunk;
* :mod:`~abbench.loadgen.drive`: :func:`run_level`, one level (closed or open loop) recorded as a
  :class:`~abbench.loadrecords.LoadLevel`.

A runner strategy for load levels calls, per (arm, level, round): :func:`build_load_prompts` once per run,
:meth:`Level.from_spec` and :func:`run_level` against the arm's service (and, with ``parity_reference``, once
per arm and service a ``role="reference"`` level), then appends the record to ``RunRecord.load``; the analysis
(:mod:`abbench.analysis.load`) and the report read it from there.
"""

from abbench.loadgen.drive import PREOPEN, Level, Target, run_level
from abbench.loadgen.plan import (
    POSITION_BASE,
    LoadPrompt,
    arrivals,
    build_load_prompts,
    draw_lengths,
    prompt_plan,
    request_prompt,
)

__all__ = ["POSITION_BASE", "PREOPEN", "Level", "LoadPrompt", "Target", "arrivals", "build_load_prompts",
           "draw_lengths", "prompt_plan", "request_prompt", "run_level"]
