"""The grammar of declared checks: the metrics, kinds and operators, :func:`parse_check` and :func:`check_arms`.

A declared check is a performance target written as an expression, in a profile (``[gate] checks = [...]``)
or on the command line (``abbench gate RUN --check EXPR``)::

    METRIC[ARM(, KIND)(, >=TOKENS | <=TOKENS | TOKENS)(, vs ARM)] OP VALUE        OP: <=  >=  ==
    crossover[ARM, ARM] OP VALUE
    METRIC[ARM, c=N | rate=R(, vs ARM)] OP VALUE                                  (a run with [load])
    parity_under_load[ARM, c=N | rate=R]

``ARM`` is an arm of the run; ``KIND`` one of fresh, cold, continuation (default: every kind); ``TOKENS`` a
prompt length (``32768`` or ``32k``) with ``>=``/``<=`` for a range, bare for exactly that length; ``vs ARM``
(the paired metrics, :data:`PAIRED`, only) the arm to divide by, instead of the run's reference arm. ``vs
A|B|C`` (``ttft_ratio`` only) divides, in each cell, by whichever of those arms has the lowest median TTFT
there: "within 5% of the fastest arm at every point". ``crossover[A, B]`` (a run with a ``[sweep]``) is the
swept quantity at which TTFT(A) / TTFT(B) crosses 1, A being the arm faster below it
(:mod:`abbench.analysis.sweep`).

Load levels (a run with a ``[load]`` table): ``c=16`` selects the closed-loop level of 16 requests in flight,
``rate=8`` (or ``rate=inf``) the open-loop level of 8 requests/s; without one, every level. The load metrics
(:data:`LOAD_METRIC_SPECS`) need a level selector or apply to every level; ``ttft_p99_s``, ``itl_p99_s`` and the
other latency metrics judge the load cell instead of the sequential samples when a level is selected.
``parity_under_load[ARM, c=16]`` alone means ``>= 1``: every prompt at that level kept its greedy ids (or
differs by an accepted near tie) against the same prompt run alone.

SLOs (``[load] slo = ["ttft_s <= 2", "tpot_s <= 0.05"]``): :func:`parse_slo` reads ``METRIC OP VALUE`` with a
per-request metric of :data:`SLO_METRICS` and ``<=`` or ``>=``.

This module is pure (no numbers, no run): the profile validates its ``gate.checks`` with it, and
:mod:`abbench.analysis.declared` computes and judges the metrics it names (the semantics of each metric and
of "inconclusive" are documented there). :func:`parse_check` raises :class:`~abbench.errors.ConfigError`
(exit 2) naming the problem; :func:`check_arms` checks the arms a check names against a list of arms;
:func:`checks_within` keeps the checks that still apply to a subset of the arms.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from abbench.errors import ConfigError

GRAMMAR = "METRIC[ARM(, KIND)(, >=TOKENS|<=TOKENS|TOKENS)(, vs ARM)] OP VALUE"
"""The grammar in one line (help texts and errors quote it)."""
KINDS = ("fresh", "cold", "continuation")
OPS = ("<=", ">=", "==")


@dataclass(frozen=True)
class Metric:
    name: str
    unit: str
    interval: bool
    """True: judged on the 95% interval of the median; False: a counter judged on every sample."""
    ratio: bool
    """A ratio (what auto rounds narrow)."""
    description: str
    quantile: float = 0.5
    """Interval metrics: the quantile of the cell's values that is judged (0.5: the median; 0.9: p90)."""


METRICS: dict[str, Metric] = {m.name: m for m in (
    Metric("ttft_ratio", "x", True, True, "paired TTFT(arm) / TTFT(reference arm), same prompt and round"),
    Metric("x_floor", "x", True, True, "TTFT / the floor (max of the resident TTFT and one bank's copy)"),
    Metric("ttft_s", "s", True, False, "time to first token (seconds)"),
    Metric("decode_tok_s", "tok/s", True, False, "decode rate after the first token"),
    Metric("decode_ratio", "x", True, True,
           "paired decode tok/s(arm) / decode tok/s(reference arm, or vs ARM), same prompt and round"),
    Metric("decode_x_floor", "x", True, True,
           "offloaded decode step / (its H2D per step / measured bandwidth + the step of an arm that copied "
           "nothing, same prompt and decode kernels): how close decode comes to its copy floor"),
    Metric("ttft_p90_s", "s", True, False, "90th percentile of the TTFT (seconds; needs 10 samples)", 0.9),
    Metric("ttft_p99_s", "s", True, False, "99th percentile of the TTFT (seconds; needs 100 samples)", 0.99),
    Metric("tpot_s", "s", True, False, "time per output token after the first, per request (seconds)"),
    Metric("tpot_p90_s", "s", True, False, "90th percentile of the TPOT (seconds; needs 10 requests)", 0.9),
    Metric("tpot_p99_s", "s", True, False, "99th percentile of the TPOT (seconds; needs 100 requests)", 0.99),
    Metric("itl_s", "s", True, False, "inter-token latency: gaps between streamed arrivals (seconds)"),
    Metric("itl_p90_s", "s", True, False, "90th percentile of the inter-token latency (seconds)", 0.9),
    Metric("itl_p99_s", "s", True, False, "99th percentile of the inter-token latency (seconds)", 0.99),
    Metric("h2d_banks", "banks", False, False, "prefill host-to-device bytes / the expert bank"),
    Metric("banks_per_window", "banks", False, False, "h2d_banks / the engine's layer-major windows (at least 1)"),
    Metric("peak_vram_gib", "GiB", False, False, "peak device memory in GiB (engine's peak_device_bytes, else NVML)"),
    Metric("peak_vram_gb", "GiB", False, False, "the older name of peak_vram_gib (the same GiB values; runs that "
           "declared it keep reporting as they did)"),
    Metric("nvml_process_peak_gib", "GiB", False, False,
           "NVML's peak for the service's processes during the request, in GiB: what the driver sees the process "
           "hold (CUDA context, workspaces, caches, graph pools and the allocator's reserve included); "
           "<= the card's size means the process fits it"),
    Metric("peak_vram_ratio", "x", False, False,
           "paired peak device memory(arm) / peak(reference arm, or vs ARM), same prompt and round"),
    Metric("h2d_ratio", "x", False, False,
           "paired prefill host-to-device bytes(arm) / bytes(reference arm, or vs ARM), same prompt and round"),
    Metric("cached_tokens", "tokens", False, False,
           "prompt tokens served from the engine's prefix cache, as its response says"),
    Metric("metrics_cached_tokens", "tokens", False, False,
           "prompt tokens served from the prefix cache, from the engine's /metrics counters around the request"),
    Metric("crossover", "tokens", True, False,
           "a sweep's quantity where TTFT(arm) / TTFT(other arm) crosses 1 (crossover[A, B]; needs [sweep])"),
    Metric("kl_mean", "nats", True, False,
           "mean KL(parity reference || arm) per position where both saw the same context, a lower bound from "
           "the top-k logprobs (abbench.analysis.numerics)"),
    Metric("kl_p99", "nats", True, False, "99th percentile of that per-position KL (needs 100 positions)", 0.99),
    Metric("same_top", "rate", True, False,
           "share of those positions where both sides' most likely token is the same"),
    Metric("delta_p_rms", "", True, False,
           "root mean square of p_arm(t) - p_reference(t), t the reference's most likely token"),
    Metric("kl_vocab_mean", "nats", True, False,
           "mean KL(parity reference || arm) over the whole vocabulary at the first output position (needs "
           "request.full_logprobs: the vendored engine or the transformers reference)"),
)}
PAIRED = ("ttft_ratio", "peak_vram_ratio", "decode_ratio", "throughput_ratio", "h2d_ratio")
"""Metrics that divide by another arm's sample of the same prompt and round (``vs ARM``, else the reference)."""
LOAD_METRIC_SPECS: dict[str, Metric] = {m.name: m for m in (
    Metric("throughput_ratio", "x", True, True,
           "load: output tokens/s(arm) / output tokens/s(reference arm, or vs ARM), paired by level and round"),
    Metric("throughput_scaling", "x", True, False,
           "load: output tokens/s of the arm at a level / its own at the run's first level (its lightest load, "
           "e.g. c=1), paired by round: what the load buys"),
    Metric("decode_scaling", "x", True, False,
           "load: decode_output_tok_s of the arm at a level / its own at the run's first level, paired by round: "
           "what the load buys the decode step alone"),
    Metric("output_tok_s", "tok/s", True, False, "load: output tokens/s over a level's measured window, per round"),
    Metric("decode_output_tok_s", "tok/s", True, False,
           "load: output tokens/s while every request in flight was decoding (no prompt waiting for its first "
           "token), per round"),
    Metric("request_s", "req/s", True, False, "load: completed requests/s over a level's measured window, per round"),
    Metric("goodput", "req/s", True, False,
           "load: requests/s over the measured window that met every SLO of [load] slo, per round"),
    Metric("e2e_p99_s", "s", True, False, "load: 99th percentile of the end-to-end latency (seconds)", 0.99),
    Metric("error_rate", "x", False, False, "load: failed or refused requests / requests sent, per level and round"),
    Metric("parity_under_load", "x", False, False,
           "load: fraction of a level's prompts whose greedy ids match the prompt run alone (accepted near ties "
           "count as kept); parity_under_load[ARM, c=N] alone means >= 1"),
)}
"""The metrics of load cells alone (a run with ``[load]``); :data:`ALL_METRICS` holds both."""
ALL_METRICS: dict[str, Metric] = {**METRICS, **LOAD_METRIC_SPECS}
NUMERICS = ("kl_mean", "kl_p99", "same_top", "delta_p_rms", "kl_vocab_mean")
"""Metrics of an arm's next-token distributions against the parity reference's, from their top-k logprobs: one
cell over everything the selector picks, judged on a cluster-bootstrap interval (:mod:`abbench.analysis.numerics`)."""
TWO_ARMS = ("crossover",)
"""Metrics of two arms, both named in the selector: ``crossover[A, B]`` (the second is held in ``vs``)."""
LOAD_METRICS = tuple(LOAD_METRIC_SPECS)
"""Metrics of load cells only (a run with ``[load]``); they take a level selector (``c=16``, ``rate=8``) or none."""
LOAD_LATENCY = ("ttft_s", "ttft_p90_s", "ttft_p99_s", "tpot_s", "tpot_p90_s", "tpot_p99_s", "itl_s", "itl_p90_s",
                "itl_p99_s")
"""Latency metrics that judge a load cell when the check selects a level."""
SLO_METRICS = {"ttft_s": "time to first token", "tpot_s": "time per output token after the first",
               "itl_s": "the request's longest inter-token gap", "e2e_s": "end-to-end latency"}
"""Per-request metrics an SLO may bound (seconds)."""

_EXPR = re.compile(r"^\s*(?P<metric>[A-Za-z_][A-Za-z0-9_]*)\s*\[(?P<sel>[^\[\]]*)\]\s*(?P<op><=|>=|==|=<|=>|<|>|=)?"
                   r"\s*(?P<value>\S*)\s*$")
_TOKENS = re.compile(r"^(?P<op><=|>=|==)?\s*(?P<n>\d+)(?P<k>[kK])?$")
_VS = re.compile(r"^vs\s+(?P<arm>\S.*)$")
_LEVEL = re.compile(r"^(?P<kind>c|rate)\s*=\s*(?P<v>\S+)$")


@dataclass(frozen=True)
class DeclaredCheck:
    """One parsed expression."""

    expr: str
    metric: str
    arm: str
    kind: str | None
    tokens_op: str | None
    """'>=', '<=' or '==' (a bare length), None: every length."""
    tokens: int | None
    op: str
    value: float
    vs: str | None = None
    """The arm a paired metric divides by (None: the run's reference arm); ``A|B|C``: the fastest of those arms
    in each cell; for ``crossover[A, B]``: B."""
    level: str | None = None
    """A load level (``c=16``, ``rate=8``, ``rate=inf``: :func:`level_label`); None: none selected."""

    @property
    def load(self) -> bool:
        """Whether the check judges load cells (a load metric, or a latency metric with a level)."""
        return self.metric in LOAD_METRICS or self.level is not None

    def selects_level(self, label: str) -> bool:
        return self.level is None or self.level == label

    @property
    def vs_arms(self) -> tuple[str, ...]:
        """The arms ``vs`` names (one, or the candidates of ``vs A|B|C``)."""
        return tuple(self.vs.split("|")) if self.vs else ()

    @property
    def name(self) -> str:
        if self.metric in TWO_ARMS:
            return f"{self.metric}[{self.arm}, {self.vs}] {self.op} {self.value:g}"
        sel = [self.arm] + ([self.kind] if self.kind else [])
        if self.tokens is not None:
            sel.append(f"{'' if self.tokens_op == '==' else self.tokens_op}{self.tokens}")
        if self.level is not None:
            sel.append(self.level)
        if self.vs is not None:
            sel.append(f"vs {self.vs}")
        return f"{self.metric}[{', '.join(sel)}] {self.op} {self.value:g}"

    @property
    def spec(self) -> Metric:
        return ALL_METRICS[self.metric]

    def selects(self, kind: str, tokens: int | None) -> bool:
        if self.kind is not None and kind != self.kind:
            return False
        if self.tokens is None:
            return True
        if tokens is None:
            return False
        return {"<=": tokens <= self.tokens, ">=": tokens >= self.tokens, "==": tokens == self.tokens}[
            str(self.tokens_op)]


def parse_check(expr: str) -> DeclaredCheck:
    """Parse one expression (grammar in the module docstring); :class:`ConfigError` names the problem."""
    where = f"check {expr!r}"
    m = _EXPR.match(expr or "")
    if not m:
        raise ConfigError(f"{where}: not of the form {GRAMMAR}, e.g. "
                          "'ttft_ratio[layer-major, fresh, >=32768] <= 0.15'")
    metric = m["metric"]
    if metric not in ALL_METRICS:
        raise ConfigError(f"{where}: unknown metric {metric!r}; metrics are {', '.join(ALL_METRICS)}")
    op, text = m["op"], m["value"]
    if metric == "parity_under_load" and not op and not text:  # bare: every prompt kept its ids
        op, text = ">=", "1"
    if op not in OPS:
        raise ConfigError(f"{where}: " + ("missing comparison" if not op else f"unknown comparison {op!r}")
                          + "; use <=, >= or ==")
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{where}: {text!r} is not a number" if text else
                          f"{where}: no value after {op}") from None
    if not math.isfinite(value):
        raise ConfigError(f"{where}: the value must be a finite number")
    if op == "==" and ALL_METRICS[metric].interval:
        raise ConfigError(f"{where}: {metric} is judged on an interval; use <= or >= (== is for counters: "
                          f"{', '.join(m.name for m in ALL_METRICS.values() if not m.interval)})")
    parts = [p.strip() for p in m["sel"].split(",")]
    if metric in TWO_ARMS:
        return _two_arms(expr, where, metric, parts, op, value)
    if not parts[0]:
        raise ConfigError(f"{where}: the selector needs an arm first, e.g. {metric}[layer-major]")
    arm, kind, tokens_op, tokens, vs, level = parts[0], None, None, None, None, None
    for p in parts[1:]:
        t, v, lv = _TOKENS.match(p), _VS.match(p), _LEVEL.match(p)
        if vs is not None:
            raise ConfigError(f"{where}: 'vs ARM' comes last in the selector (ARM, KIND, LENGTH, vs ARM)")
        if lv and level is None:
            level = _level(where, metric, lv["kind"], lv["v"])
        elif p in KINDS and kind is None and tokens is None:
            kind = p
        elif t and tokens is None:
            tokens_op, tokens = t["op"] or "==", int(t["n"]) * (1024 if t["k"] else 1)
        elif v:
            if metric not in PAIRED:
                raise ConfigError(f"{where}: 'vs ARM' is for the paired metrics ({', '.join(PAIRED)}); {metric} "
                                  "is not measured against another arm")
            vs = _vs_arms(where, metric, v["arm"])
        else:
            raise ConfigError(f"{where}: selector part {p!r} is neither a kind ({', '.join(KINDS)}), a "
                              "prompt length (>=32768, <=65536 or 32768), a load level (c=16, rate=8) nor "
                              "'vs ARM', in the order ARM, KIND, LENGTH, vs ARM")
    if (metric in LOAD_METRICS or level is not None) and (kind is not None or tokens is not None):
        raise ConfigError(f"{where}: a load cell is selected by its level (c=N or rate=R), not by a prompt kind "
                          "or length")
    return DeclaredCheck(expr=expr, metric=metric, arm=arm, kind=kind, tokens_op=tokens_op, tokens=tokens, op=op,
                         value=value, vs=vs, level=level)


def level_label(kind: str, value: float) -> str:
    """A load level's name as selectors write it: ``c=16``, ``rate=8``, ``rate=0.5``, ``rate=inf``."""
    if kind in ("c", "concurrency"):
        return f"c={int(value)}"
    return "rate=inf" if math.isinf(value) else f"rate={value:g}"


def _level(where: str, metric: str, kind: str, text: str) -> str:
    if metric not in LOAD_METRICS and metric not in LOAD_LATENCY:
        raise ConfigError(f"{where}: {metric} is not measured per load level; the load metrics are "
                          f"{', '.join(LOAD_METRICS + LOAD_LATENCY)}")
    try:
        v = float(text)
    except ValueError:
        raise ConfigError(f"{where}: level {kind}={text!r} is not a number") from None
    if kind == "c" and (not v.is_integer() or v < 1):
        raise ConfigError(f"{where}: c={text} is not a concurrency (a whole number of requests in flight, >= 1)")
    if kind == "rate" and not (v > 0):
        raise ConfigError(f"{where}: rate={text} is not a request rate (requests/s above 0, or inf)")
    return level_label(kind, v)


@dataclass(frozen=True)
class Slo:
    """One service-level objective of ``[load] slo``: a per-request ``metric`` (:data:`SLO_METRICS`) bounded."""

    expr: str
    metric: str
    op: str
    value: float

    def met(self, v: float | None) -> bool:
        if v is None or math.isnan(v):
            return False
        return v <= self.value if self.op == "<=" else v >= self.value


_SLO = re.compile(r"^\s*(?P<metric>[A-Za-z_][A-Za-z0-9_]*)\s*(?P<op><=|>=)\s*(?P<value>\S+)\s*$")


def parse_slo(expr: str) -> Slo:
    """``ttft_s <= 2``: a per-request metric of :data:`SLO_METRICS`, ``<=`` or ``>=``, a finite number.
    :class:`ConfigError` names the problem."""
    m = _SLO.match(expr or "")
    if not m:
        raise ConfigError(f"slo {expr!r}: not of the form METRIC <= VALUE, e.g. 'ttft_s <= 2'")
    if m["metric"] not in SLO_METRICS:
        raise ConfigError(f"slo {expr!r}: unknown metric {m['metric']!r}; an SLO bounds one of "
                          f"{', '.join(SLO_METRICS)} (seconds, per request)")
    try:
        value = float(m["value"])
    except ValueError:
        raise ConfigError(f"slo {expr!r}: {m['value']!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise ConfigError(f"slo {expr!r}: the bound must be a finite number of seconds, >= 0")
    return Slo(expr=expr, metric=m["metric"], op=m["op"], value=value)


def _vs_arms(where: str, metric: str, text: str) -> str:
    """The ``vs`` part: one arm, or ``A|B|C`` (ttft_ratio: the fastest of them per cell)."""
    arms = [a.strip() for a in text.split("|")]
    if len(arms) > 1 and metric != "ttft_ratio":
        raise ConfigError(f"{where}: 'vs A|B' (the fastest of several arms) is for ttft_ratio only")
    if not all(arms) or len(set(arms)) != len(arms):
        raise ConfigError(f"{where}: 'vs {text.strip()}' must name distinct arms separated by '|'")
    return "|".join(arms)


def _two_arms(expr: str, where: str, metric: str, parts: list[str], op: str, value: float) -> DeclaredCheck:
    """``crossover[A, B]``: exactly two distinct arms and nothing else."""
    if len(parts) != 2 or not all(parts) or any(" " in p or p in KINDS for p in parts):
        raise ConfigError(f"{where}: {metric} takes two arms and nothing else, e.g. {metric}[demand, chunked] "
                          ">= 512 (the arm faster below the crossover first)")
    if parts[0] == parts[1]:
        raise ConfigError(f"{where}: {metric} compares two different arms; {parts[0]!r} is named twice")
    return DeclaredCheck(expr=expr, metric=metric, arm=parts[0], kind=None, tokens_op=None, tokens=None, op=op,
                         value=value, vs=parts[1])


def parse_checks(exprs: list[str]) -> list[DeclaredCheck]:
    return [parse_check(e) for e in exprs]


def numerics_checked(exprs: list[str]) -> set[str]:
    """The arms that declared checks ``exprs`` judge by a numerics metric (``kl_mean[fp8] <= 0.01``)."""
    return {c.arm for c in parse_checks(exprs) if c.metric in NUMERICS}


def check_arms(checks: list[DeclaredCheck], arms: list[str], reference: str | None, where: str) -> None:
    """:class:`ConfigError` when a check names an arm that is not there, or compares an arm with itself."""
    for c in checks:
        for a in (c.arm, *c.vs_arms):
            if a not in arms:
                raise ConfigError(f"{where}: check {c.expr!r}: unknown arm {a!r}; arms are {', '.join(arms)}")
        if c.metric in PAIRED and c.arm in (c.vs_arms or (reference,)):
            raise ConfigError(f"{where}: check {c.expr!r}: {c.arm} is " + (
                "the arm it is compared with" if c.vs else "the reference arm") + f"; {c.metric} compares another "
                "arm with it" + ("" if c.vs else " (or name one with 'vs ARM')"))


def checks_within(exprs: list[str], arms: list[str], reference: str) -> list[str]:
    """The declared checks that still apply after ``--arms`` picked ``arms``: those naming a dropped arm
    (their own, or the one a paired metric divides by) or pairing an arm with itself go, as allow_fallback
    entries do."""
    keep = []
    for e in exprs:
        c = parse_check(e)
        if c.arm in arms and all(a in arms for a in c.vs_arms) and not (
                c.metric in PAIRED and c.arm in (c.vs_arms or (reference,))):
            keep.append(e)
    return keep
