"""Derived numbers and the gate's verdict, computed from one :class:`~abbench.results.RunRecord` (pure: no
I/O, no network, no adapters; results only).

* :mod:`~abbench.analysis.frames`: the run's arms and reference, one row per sample, memory, completeness;
* :mod:`~abbench.analysis.timing`: TTFT, ABBA pairs, paired ratios with bootstrap intervals, client overhead;
* :mod:`~abbench.analysis.parity`: token-id parity against the reference, :func:`classify`;
* :mod:`~abbench.analysis.paths`: the active prefill path against ``expect_path``;
* :mod:`~abbench.analysis.transfer`: H2D bytes, the TTFT floor, the engine's prefix-cache counters;
* :mod:`~abbench.analysis.decode`: decode rate, decode H2D per step, slot-cache hit rate, peak device memory;
* :mod:`~abbench.analysis.latency`: TTFT, TPOT and inter-token latency percentiles (p50/p90/p99 where n allows);
* :mod:`~abbench.analysis.checks`: the gate, a list of checks ``(GateInput) -> CheckResult``;
* :mod:`~abbench.analysis.declared`: declared checks (``METRIC[ARM, KIND, LENGTH] OP VALUE``) and their metrics;
* :mod:`~abbench.analysis.summary`: :func:`analyze`, everything the report shows.
"""

from abbench.analysis.checks import (
    CHECKS,
    Check,
    CheckResult,
    GateInput,
    GateVerdict,
    declared_check,
    gate,
    gate_checks,
    run_checks,
)
from abbench.analysis.declared import METRICS, DeclaredCheck, parse_check
from abbench.analysis.frames import (
    KIND_ORDER,
    MEMORY_COLUMNS,
    SAMPLE_COLUMNS,
    Completeness,
    arm_names,
    arm_parity_references,
    arm_tolerances,
    completeness,
    expected_paths,
    gate_spec,
    max_tokens,
    measured_ok,
    memory_table,
    parity_reference_arm,
    reference_arm,
    samples_frame,
    service_arms,
    where,
)
from abbench.analysis.parity import (
    NEAR_TIE_NATS,
    PARITY_COLUMNS,
    classify,
    compare_ids,
    parity_frame,
    parity_tokens_of,
)
from abbench.analysis.paths import (
    PATH_COLUMNS,
    PATH_SUMMARY_COLUMNS,
    active_path_samples,
    active_path_summary,
)
from abbench.analysis.decode import DECODE_COLUMNS, TTFT_MEMORY_COLUMNS, decode_table, ttft_memory_table
from abbench.analysis.summary import Analysis, analyze
from abbench.analysis.timing import (
    BOOTSTRAP_RESAMPLES,
    BOOTSTRAP_SEED,
    CONFIDENCE,
    PAIR_COLUMNS,
    RATIO_COLUMNS,
    SMALL_N,
    MedianCI,
    median_ci,
    overhead_table,
    paired_ratios,
    ratio_summary,
    small_n_notes,
    ttft_table,
    verdict,
)
from abbench.analysis.transfer import (
    ENGINE_COUNTER_COLUMNS,
    FLOOR_COLUMNS,
    FLOOR_KINDS,
    H2D_COLUMNS,
    engine_counter_table,
    floor_table,
    h2d_table,
    probe_spread,
)

__all__ = [
    "BOOTSTRAP_RESAMPLES", "BOOTSTRAP_SEED", "CHECKS", "CONFIDENCE", "DECODE_COLUMNS", "decode_table", "TTFT_MEMORY_COLUMNS", "ttft_memory_table",
    "ENGINE_COUNTER_COLUMNS", "FLOOR_COLUMNS",
    "FLOOR_KINDS", "H2D_COLUMNS", "KIND_ORDER", "MEMORY_COLUMNS", "NEAR_TIE_NATS", "PAIR_COLUMNS", "PARITY_COLUMNS",
    "PATH_COLUMNS", "PATH_SUMMARY_COLUMNS", "RATIO_COLUMNS", "SAMPLE_COLUMNS", "SMALL_N", "Analysis", "Check",
    "CheckResult", "Completeness", "DeclaredCheck", "METRICS", "declared_check", "gate_checks", "parse_check", "GateInput", "GateVerdict", "MedianCI", "active_path_samples",
    "active_path_summary", "analyze", "arm_names", "arm_parity_references", "arm_tolerances", "classify", "compare_ids", "completeness",
    "engine_counter_table", "expected_paths", "floor_table", "gate", "gate_spec", "h2d_table", "max_tokens",
    "measured_ok", "median_ci", "memory_table", "overhead_table", "paired_ratios", "parity_frame",
    "parity_reference_arm", "parity_tokens_of", "probe_spread", "ratio_summary", "reference_arm", "samples_frame", "service_arms", "small_n_notes",
    "ttft_table", "verdict", "where",
]
