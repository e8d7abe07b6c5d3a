"""Replay a run's requests through the auto policy's calibration: what would ``--prefill-mode auto`` have picked?

``python -m abbench.engine.policy_replay RUN_DIR [--window N]`` reads a run of an engine started with
``--prefill-mode auto`` whose arms include auto and the explicit paths (a sweep such as
``profiles/h200-qwen3-30b-a3b-sweep.toml``), and walks its samples in the order they ran:

- every offloaded prefill (any arm) is compared with the model's raw estimate for its prompt and path (from the
  auto arm's response for that prompt, ``abbench.auto.estimates_s``) and fed to a :class:`Calibration` of
  ``--window`` prefills per path, as the engine does (``EngineConfig.auto_calibration``);
- at every measured (not excluded) auto sample it picks the cheapest calibrated estimate, and scores that pick and the engine's own by
  the median measured TTFT of the explicit arms at that prompt (1.0: the fastest path).

``--window 0`` replays the model alone and must reproduce what the engine picked when it ran without
calibration (a check of the replay itself). Pure: JSON in, a table out; no torch, no engine.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from .policy import Calibration

PATHS = ("demand", "chunked", "layer-major")


@dataclass(frozen=True)
class Pick:
    prompt_id: str
    round: int
    engine_path: str  # what the engine picked when the run was made
    replay_path: str  # what the replayed policy picks
    engine_vs_best: float  # median TTFT of the engine's pick / of the fastest explicit arm at this prompt
    replay_vs_best: float
    factors: dict[str, float]


def replay(samples: list[dict], window: int) -> list[Pick]:
    """The auto samples of ``samples`` (a run.json's list) replayed with a calibration window (0: none)."""
    ok = sorted((s for s in samples if s.get("ok") and s.get("engine")), key=lambda s: s["started_at"])
    raw: dict[str, dict[str, float]] = {}
    for s in ok:
        if s["engine"].get("auto"):
            raw[s["prompt_id"]] = s["engine"]["auto"]["estimates_s"]
    ttft: dict[tuple[str, str], list[float]] = defaultdict(list)
    for s in ok:
        ttft[(s["prompt_id"], s["arm"])].append(s["ttft_s"])
    median = {k: statistics.median(v) for k, v in ttft.items()}
    cal = Calibration(window) if window else None
    picks: list[Pick] = []
    for s in ok:
        pid, eng = s["prompt_id"], s["engine"]
        auto = eng.get("auto")
        if auto and not s.get("excluded") and pid in raw and all((pid, p) in median for p in PATHS):
            est = raw[pid]
            scaled = {p: v * (cal.factor(p) if cal else 1.0) for p, v in est.items()}
            order = [p for p in ("layer-major", "chunked", "demand") if p in scaled]
            pick = min(order, key=lambda p: (scaled[p], order.index(p)))
            best = min(median[(pid, p)] for p in PATHS)
            picks.append(Pick(pid, int(s["round"]), auto["path"], pick, median[(pid, auto["path"])] / best,
                              median[(pid, pick)] / best, cal.factors() if cal else {}))
        path, t = eng.get("prefill_path"), eng.get("timings") or {}
        if cal and pid in raw and path in raw[pid] and "prefill_end" in t and "prefill_start" in t:
            cal.observe(path, raw[pid][path], t["prefill_end"] - t["prefill_start"])
    return picks


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m abbench.engine.policy_replay", description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="a run directory (its run.json)")
    ap.add_argument("--window", type=int, default=16, help="calibration window in prefills per path (0: none)")
    args = ap.parse_args(argv)
    samples = json.loads((args.run / "run.json").read_text())["samples"]
    picks = replay(samples, args.window)
    if not picks:
        print("no auto samples with every explicit arm at the same prompt: nothing to replay")
        return 1
    print(f"{'prompt':<24} {'round':>5} {'engine':>12} {'x best':>7} {'replay':>12} {'x best':>7}  factors")
    for p in picks:
        f = " ".join(f"{k}={v:.3f}" for k, v in p.factors.items())
        print(f"{p.prompt_id:<24} {p.round:>5} {p.engine_path:>12} {p.engine_vs_best:>7.3f} {p.replay_path:>12} "
              f"{p.replay_vs_best:>7.3f}  {f}")
    print(f"worst: engine {max(p.engine_vs_best for p in picks):.3f}x, replay (window {args.window}) "
          f"{max(p.replay_vs_best for p in picks):.3f}x the fastest path")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
