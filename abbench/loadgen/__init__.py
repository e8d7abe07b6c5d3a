"""The load generator: load levels of one arm against one running service, asynchronous, with the exact
per-token arrival stamps of the synchronous client.

* :mod:`~abbench.loadgen.plan`: the load prompts (exact lengths drawn from ``[load]``'s distributions) and the
  open loop's seeded arrival times;
* :mod:`~abbench.loadgen.wire`: one streamed request over an asyncio HTTP/1.1 connection, stamped per chunk;
* :mod:`~abbench.loadgen.drive`: :func:`run_level`, one level (closed or open loop) recorded as a
  :class:`~abbench.loadrecords.LoadLevel`.

A runner strategy for load levels (:mod:`abbench.runner.plans.load`) builds the prompts once
(:func:`build_load_prompts`, or :func:`build_load_items` to record them with the run's prompts), takes the steps of
:func:`level_plan` from :func:`resume_at` on, and for each runs :meth:`Level.from_spec` with
:func:`run_level` against the step's arm's service, appending the record to ``RunRecord.load``; the analysis
(:mod:`abbench.analysis.load`) and the report read it from there.
"""

from abbench.loadgen.drive import PREOPEN, Level, Target, run_level
from abbench.loadgen.plan import (
    POSITION_BASE,
    LevelStep,
    LoadPrompt,
    arrivals,
    build_load_items,
    build_load_prompts,
    build_warmup_prompts,
    draw_lengths,
    level_plan,
    load_prompt,
    prompt_plan,
    request_prompt,
    resume_at,
)

__all__ = ["POSITION_BASE", "PREOPEN", "Level", "LevelStep", "LoadPrompt", "Target", "arrivals",
           "build_load_items", "build_load_prompts", "build_warmup_prompts", "draw_lengths", "load_prompt",
           "level_plan", "prompt_plan", "request_prompt", "resume_at", "run_level"]
