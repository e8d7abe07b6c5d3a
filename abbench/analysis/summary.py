"""Everything the report shows, computed once from one run (:func:`analyze`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

from abbench.analysis.checks import GateInput, GateVerdict, gate_checks, run_checks
from abbench.analysis.decode import decode_table, ttft_memory_table
from abbench.analysis.latency import latency_table
from abbench.analysis.load import cell_table, parity_under_load, throughput_ratios
from abbench.analysis.frames import (
    Completeness,
    arm_names,
    completeness,
    frames_cached,
    memory_table,
    parity_reference_arm,
    reference_arm,
    samples_frame,
)
from abbench.analysis.numerics import compared_arms, numerics_positions, numerics_table
from abbench.analysis.parity import NEAR_TIE_NATS, parity_frame, parity_tokens_of
from abbench.analysis.paths import active_path_samples, active_path_summary, attention_batching_table
from abbench.analysis.sweep import SweepPair, analyze_sweep
from abbench.analysis.timing import overhead_table, paired_ratios, ratio_summary, small_n_notes, ttft_table
from abbench.analysis.transfer import engine_counter_table, floor_table, gap_table, h2d_table
from abbench.results import RunRecord


@dataclass
class Analysis:
    """Everything :mod:`abbench.report` shows, computed once."""

    reference: str | None
    parity_reference: str | None
    arms: list[str]
    parity_tokens: int
    samples: pd.DataFrame
    ttft: pd.DataFrame
    latency: pd.DataFrame
    pairs: pd.DataFrame
    ratios: pd.DataFrame
    parity: pd.DataFrame
    path_samples: pd.DataFrame
    path_summary: pd.DataFrame
    attention_batching: pd.DataFrame
    h2d: pd.DataFrame
    floor: pd.DataFrame
    gap: pd.DataFrame
    engine_counters: pd.DataFrame
    decode: pd.DataFrame
    ttft_memory: pd.DataFrame
    overhead: pd.DataFrame
    memory: pd.DataFrame
    completeness: Completeness
    notes: list[str]
    gate: GateVerdict
    sweep: list[SweepPair] = field(default_factory=list)
    load: pd.DataFrame | None = None
    """A run with load levels: one row per (arm, level) cell (:func:`abbench.analysis.load.cell_table`)."""
    load_ratios: pd.DataFrame | None = None
    """Its throughput ratios per (arm, level, round) against the reference arm."""
    load_parity: pd.DataFrame | None = None
    """Its parity under load per cell (:func:`abbench.analysis.load.parity_under_load`)."""
    numerics_positions: pd.DataFrame = field(default_factory=pd.DataFrame)
    """Per compared position of each ``parity = "numerics"`` arm and each arm a numerics check names
    (:mod:`~abbench.analysis.numerics`)."""
    numerics: pd.DataFrame = field(default_factory=pd.DataFrame)
    """Per numerics arm: KL, same-top rate and delta-p over its compared positions."""


def analyze(record: RunRecord, *, parity_tokens: int | None = None, near_tie_nats: float = NEAR_TIE_NATS,
            checks: list[str] | None = None) -> Analysis:
    """Everything the report shows; ``checks`` adds declared checks to the profile's ``gate.checks``."""
    with frames_cached():
        return _analyze(record, parity_tokens=parity_tokens, near_tie_nats=near_tie_nats, checks=checks)


def _analyze(record: RunRecord, *, parity_tokens: int | None, near_tie_nats: float,
             checks: list[str] | None) -> Analysis:
    k = parity_tokens_of(record, parity_tokens)
    ttft = ttft_table(record)
    pairs = paired_ratios(record)
    ratios = ratio_summary(record, pairs)
    parity = parity_frame(record, parity_tokens=k, near_tie_nats=near_tie_nats)
    path_samples = active_path_samples(record)
    path_summary = active_path_summary(record, path_samples)
    comp = completeness(record)
    positions = numerics_positions(record) if compared_arms(record) else pd.DataFrame()
    return Analysis(
        reference=reference_arm(record), parity_reference=parity_reference_arm(record), arms=arm_names(record),
        parity_tokens=k,
        samples=samples_frame(record), ttft=ttft, latency=latency_table(record), pairs=pairs, ratios=ratios,
        parity=parity, path_samples=path_samples, path_summary=path_summary,
        attention_batching=attention_batching_table(record), h2d=h2d_table(record),
        floor=floor_table(record), gap=gap_table(record), engine_counters=engine_counter_table(record), decode=decode_table(record),
        ttft_memory=ttft_memory_table(record), overhead=overhead_table(record),
        memory=memory_table(record), completeness=comp,
        notes=small_n_notes(record, ratios, ttft),
        gate=run_checks(GateInput.of(record, k, comp, parity, path_samples), gate_checks(record, checks)),
        sweep=analyze_sweep(record),
        load=cell_table(record) if record.load else None,
        load_ratios=throughput_ratios(record) if record.load else None,
        load_parity=parity_under_load(record) if record.load else None,
        numerics_positions=positions,
        numerics=numerics_table(record, positions) if not positions.empty else pd.DataFrame(),
    )
