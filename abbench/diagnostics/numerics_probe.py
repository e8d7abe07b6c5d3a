"""The numerics probe (``abbench probe RUN --arm A --numerics``): the full-vocabulary KL where a run has a bound.

A run's numerics verdict (:mod:`abbench.analysis.numerics`) computes each position's KL from the top-k logprobs
both sides returned, with the rest of the vocabulary as one bucket: a lower bound of the KL over the whole
vocabulary. Engines that can return the whole distribution (the vendored engine and the transformers reference:
the request field ``full_logprobs``) let this probe measure the KL itself at every compared position, and how
tight the run's bound was (a run with ``request.full_logprobs`` records it at the first position alone).

:func:`probe_numerics` sends the run's parity reference arm (the one the verdict compares against) and the probed
arm the same histories: the prompt plus the reference's first ``i`` output ids of the run, for ``i`` = 0 up to
the first position where the arm's run output diverged from the reference's (every output position when it never
did), as the verdict compares. Each side's services run one after the other, launched from the recorded profile
(or given by URL), the cache reset before the first history. At each position it takes both sides' full
log-softmax rows and computes, in float64: ``kl`` = KL(reference || arm) over the whole vocabulary; ``kl_topk``
= the verdict's bound (:func:`abbench.analysis.numerics.position_stats`) from the same two rows' top-``k`` lists,
``k`` the run's ``request.logprobs``; ``same_top``; ``delta_p`` = p_arm(t) - p_ref(t) for the reference's most
likely token ``t``.

Each history is prefilled in one request (its first ids served from the prefix cache) where the run decoded the
output ids one at a time, so a row can differ from the run's in its last bits; the comparison between the two
arms is like for like.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from abbench.analysis import compare_ids
from abbench.analysis.numerics import position_stats
from abbench.client import EngineClient
from abbench.diagnostics.diff import pick_round, usable
from abbench.diagnostics.layers import engine_field, serving
from abbench.diagnostics.probe import recorded_prompt_ids
from abbench.errors import ConfigError
from abbench.profile import RequestSpec, profile_from_dict
from abbench.results import RunRecord
from abbench.vocabrows import decode_row, vocab_kl


@dataclass(frozen=True)
class NumericsStep:
    """One compared position (module docstring)."""

    position: int
    ref_id: int  # the reference's id at this position in the run: the next id of the history
    kl: float  # KL(reference || arm) over the whole vocabulary, nats
    kl_topk: float  # the run's lower bound, from the same rows' top-k lists
    same_top: int
    delta_p: float


@dataclass(frozen=True)
class NumericsProbe:
    prompt_id: str
    arm: str
    reference: str
    ref_round: int
    k: int  # the top-k of the run's bound (request.logprobs)
    vocab: int
    diverged_at: int | None  # where the arm's run output first left the reference's (None: never)
    steps: list[NumericsStep]

    @property
    def kl_mean(self) -> float:
        return float(np.mean([s.kl for s in self.steps])) if self.steps else math.nan

    @property
    def kl_topk_mean(self) -> float:
        return float(np.mean([s.kl_topk for s in self.steps])) if self.steps else math.nan


def _top(row: np.ndarray, k: int) -> list[tuple[int, float]]:
    """The row's top-``k`` (id, logprob), highest first, the lower id first on ties (as the engine lists them)."""
    idx = np.lexsort((np.arange(row.size), -row))[:k]
    return [(int(i), float(row[i])) for i in idx]


def compare_rows(ref: np.ndarray, arm: np.ndarray, k: int) -> tuple[float, float, int, float]:
    """(kl, kl_topk, same_top, delta_p) of two full log-probability rows (module docstring)."""
    try:
        kl = vocab_kl(ref, arm)  # +inf where the arm gives 0 to a live id
    except ValueError as e:
        raise ConfigError(str(e)) from None
    bound = position_stats(_top(ref, k), _top(arm, k))
    t = int(np.argmax(ref))  # the first of equal maxima: the lowest id, as greedy decoding takes it
    return kl, (bound[0] if bound is not None else 0.0), int(t == int(np.argmax(arm))), \
        float(math.exp(arm[t]) - math.exp(ref[t]))


def probe_numerics(record: RunRecord, prompt_id: str, arm: str, **kwargs: Any) -> NumericsProbe:
    """The full-vocabulary KL of ``arm`` against the run's parity reference on ``prompt_id`` (module docstring);
    ``kwargs`` as :func:`probe_numerics_prompts`."""
    return probe_numerics_prompts(record, [prompt_id], arm, **kwargs)[0]


def probe_numerics_prompts(record: RunRecord, prompt_ids: list[str], arm: str, *,
                           base_urls: dict[str, str] | None = None, round: int | None = None,
                           positions: int | None = None,
                           progress: Callable[[str, int, int], None] | None = None) -> list[NumericsProbe]:
    """:func:`probe_numerics` for each of ``prompt_ids``, each side's service launched once for all of them.
    ``base_urls``: servers already running an arm's configuration (with ``--allow-request-overrides``);
    ``positions``: at most the first N of each prompt; ``progress(arm, done, total)`` after each request."""
    profile = profile_from_dict(record.profile, where=f"run {record.run_id} profile")
    names = [a.name for a in profile.arms]
    if arm not in names:
        raise ConfigError(f"--arm: run {record.run_id} has no arm {arm!r}; its arms are {', '.join(names)}")
    ref = profile.parity_reference_arm  # the verdict's: numerics are judged against the run's parity reference
    for name in (ref, arm):
        if profile.arm_engine(name).adapter != "openai":
            raise ConfigError(f"--numerics: arm {name} uses adapter {profile.arm_engine(name).adapter!r}; whole "
                              "distributions come from the vendored engine or the transformers reference (adapter "
                              "openai)")
    plans = []  # (prompt id, reference round, its output ids, where the arm left them, positions to compare)
    for prompt_id in prompt_ids:
        if prompt_id not in {p.id for p in record.prompts}:
            raise ConfigError(f"--prompt: run {record.run_id} has no prompt {prompt_id!r}")
        ref_samples = pick_round([s for s in record.samples if s.prompt_id == prompt_id and s.arm == ref
                                  and usable(s)], round)
        if not ref_samples:
            raise ConfigError(f"the reference arm {ref} has no ok sample with token ids of prompt {prompt_id}")
        r = min(ref_samples)
        ref_ids = list(ref_samples[r].output_ids)
        arm_samples = pick_round([s for s in record.samples if s.prompt_id == prompt_id and s.arm == arm
                                  and usable(s)], r)
        diverged = None
        if r in arm_samples and arm != ref:
            _, diverged, _ = compare_ids(arm_samples[r].output_ids, ref_ids, len(ref_ids))
        n = len(ref_ids) if diverged is None else min(diverged + 1, len(ref_ids))  # positions 0..d, as the verdict
        plans.append((prompt_id, r, ref_ids, diverged, n if positions is None else min(n, positions)))
    k = max(1, profile.request.logprobs or 1)
    request = RequestSpec(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=None, stream=False,
                          timeout_s=profile.request.timeout_s, extra=dict(profile.request.extra))
    histories = [recorded_prompt_ids(record, profile, p[0]) for p in plans]
    total = sum(p[4] for p in plans)
    rows: dict[str, list[list[np.ndarray]]] = {}
    with EngineClient() as client:
        for name in dict.fromkeys((ref, arm)):  # one service at a time: an arm probed against itself runs once
            ae = profile.arm_engine(name)
            got = rows[name] = []
            done = 0
            with serving(profile, name, client, (base_urls or {}).get(name)) as url:
                for (_, _, ref_ids, _, n), prompt in zip(plans, histories):
                    if ae.reset_path:
                        client.reset(url, ae.reset_path)
                    got.append([])
                    for i in range(n):
                        history = prompt + ref_ids[:i]
                        _, b64 = engine_field(client, url, profile, name, history, request, "full_logprobs",
                                              "full_logprobs")
                        got[-1].append(decode_row(b64))
                        done += 1
                        if progress is not None:
                            progress(name, done, total)
    out = []
    for j, (prompt_id, r, ref_ids, diverged, n) in enumerate(plans):
        steps = []
        for i in range(n):
            kl, bound, same, delta = compare_rows(rows[ref][j][i], rows[arm][j][i], k)
            steps.append(NumericsStep(i, ref_ids[i], kl, bound, same, delta))
        vocab = int(rows[ref][j][0].size) if n else 0
        out.append(NumericsProbe(prompt_id=prompt_id, arm=arm, reference=ref, ref_round=r, k=k, vocab=vocab,
                                 diverged_at=diverged, steps=steps))
    return out


def format_numerics(result: NumericsProbe) -> str:
    """The probe as text: one row per position, then the means."""
    lines = [f"numerics probe: arm {result.arm} against {result.reference} on prompt {result.prompt_id} "
             f"(reference round {result.ref_round}; the whole vocabulary: {result.vocab:,} ids; the run's bound "
             f"from the top {result.k})",
             "the run's output " + ("never left the reference's" if result.diverged_at is None else
                                    f"first left the reference's at position {result.diverged_at}")
             + f": positions 0..{len(result.steps) - 1} compared",
             "",
             f"{'pos':>4} {'ref id':>8} {'KL (full)':>12} {'KL (top-k)':>12} {'bound/full':>10} {'same top':>8} "
             f"{'delta p':>10}"]
    for s in result.steps:
        share = f"{s.kl_topk / s.kl:.3f}" if s.kl > 0 and math.isfinite(s.kl) else "-"
        lines.append(f"{s.position:>4} {s.ref_id:>8} {s.kl:>12.4e} {s.kl_topk:>12.4e} {share:>10} {s.same_top:>8} "
                     f"{s.delta_p:>+10.2e}")
    if result.steps:
        same = sum(s.same_top for s in result.steps) / len(result.steps)
        lines += ["", f"mean KL over the whole vocabulary {result.kl_mean:.4e} nats; the run's top-{result.k} bound "
                      f"{result.kl_topk_mean:.4e}; same top {same:.1%}"]
    return "\n".join(lines) + "\n"


def format_numerics_summary(results: list[NumericsProbe]) -> str:
    """Several prompts' probes as text: one line per prompt, then every compared position pooled."""
    if not results:
        return "no prompt compared\n"
    head = results[0]
    lines = [f"numerics probe: arm {head.arm} against {head.reference}, {len(results)} prompts (the whole vocabulary: "
             f"{head.vocab:,} ids; the run's bound from the top {head.k})", "",
             f"{'prompt':<24} {'round':>5} {'positions':>9} {'KL (full), mean':>16} {'KL (top-k), mean':>17} "
             f"{'same top':>8}"]
    for r in results:
        same = sum(s.same_top for s in r.steps) / len(r.steps) if r.steps else math.nan
        lines.append(f"{r.prompt_id:<24} {r.ref_round:>5} {len(r.steps):>9} {r.kl_mean:>16.4e} {r.kl_topk_mean:>17.4e} "
                     f"{same:>8.1%}")
    steps = [s for r in results for s in r.steps]
    if steps:
        kl, bound = float(np.mean([s.kl for s in steps])), float(np.mean([s.kl_topk for s in steps]))
        lines += ["", f"every compared position ({len(steps)}): mean KL over the whole vocabulary {kl:.4e} nats, "
                      f"max {max(s.kl for s in steps):.4e}; the run's top-{head.k} bound {bound:.4e}; same top "
                      f"{sum(s.same_top for s in steps) / len(steps):.1%}"]
    return "\n".join(lines) + "\n"
