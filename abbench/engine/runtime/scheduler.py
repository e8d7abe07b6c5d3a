"""Continuous batching: the sequences the engine runs at once, their caches, and one iteration of work.

Contract (what :class:`~abbench.engine.runtime.engine.Engine` and the server's queue rely on):
- ``Scheduler(engine)``; ``submit(request, cancel, emit) -> Sequence`` queues a request the engine has resolved
  (``Engine.resolve``; thread-safe: the server submits from its event loop while the engine thread steps).
  Everything the sequence produces goes to ``emit``, in order, from the engine thread: one ``TokenEvent`` per
  output token, then a :class:`Finished` with its ``RequestStats``, or instead an exception (``Cancelled``,
  ``torch.OutOfMemoryError``, a bug) after which nothing more comes.
- ``step()`` runs one iteration: (1) **admission**: queued requests take free sequence caches (``EngineConfig.max_num_seqs``) in
  arrival order and are prefilled as one batch: consecutive layer-major requests with the same chunk length and
  attention batch join one batch up to ``max_prefill_batch_tokens`` uncached tokens (the first always runs),
  prefilled together (``prefill.prefill_batch``: each window's bank is streamed once for the whole batch);
  any other request is a batch of one; each emits its first token; (2) **decode**: every sequence that had
  its first token before this iteration decodes one token (``Decoder.step`` over its own cache, the slot cache
  shared), in arrival order on even iterations and in reverse on odd ones: the sequences' experts meet in each
  layer's LRU slot block, and a scan in a fixed order over more experts than the block holds misses on nearly
  every lookup, where alternating the direction reuses what the last sequences left (a simulation with
  per-sequence routing that mostly stays: 0.72 of lookups missed in a fixed order, 0.42 alternating). A
  sequence leaves when it finishes, fails or is cancelled; the next iteration may admit another.
- **Policy between prefill and decode:** prefill first. A decoding sequence waits at most one prefill batch per
  token, and a batch holds at most ``max_prefill_batch_tokens`` uncached prompt tokens (a first prompt longer
  than that runs alone), so that bound is what a long prompt costs the others' inter-token latency.
- **Outputs do not depend on the batch, by construction:** a batch-prefilled prompt makes exactly the layer
  calls it makes alone (``prefill.layer_major_parts``) and each sequence's decode step is the step it takes
  alone, over its own cache; the experts read from the slot cache are the same weights wherever they sit. So
  a prompt's greedy ids are bitwise the same alone and in any batch, on every device (tested). What batching
  shares is the weight reads: the bank streams of a prefill batch, and the slot cache's experts between the
  sequences' decode steps. Decode runs one GEMV-shaped step per sequence: its compute is not batched.
- **Prefix cache per sequence cache:** each cache keeps the tokens whose KV it holds (prompt and output of its
  last sequence); a request takes the free cache that shares the longest prefix with its prompt (at most
  len(prompt) - 1 tokens; hybrids: exactly the last prompt's snapshot), the first such cache on a tie, so
  requests one at a time always run in the first cache, with the prefix cache of an engine with one cache.
  ``reset()`` (idle only) empties them all.
- **Cancellation** of one sequence never disturbs the others: a queued one leaves the queue (``withdraw``, or
  at its prefill's first layer step); a decoding one
  stops at its next layer step; a prefill batch stops when all its members are cancelled, and a member
  cancelled while the others go on gets ``Cancelled`` when the batch's prefill ends.
- **Accounting per sequence:** its own decode steps' bytes, slot-cache hits and misses and step counts; its
  prefill batch's bytes, windows, copy waits and graph replays (shared: the stats say how many prompts
  ``prefill_batch`` held); ``peak_device_bytes`` is the device's peak over the sequence's life (other sequences
  included), ``queue_s`` how long it waited for admission.
"""

from __future__ import annotations

import contextlib
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from abbench.engine.contract import (
    CancelLike, Cancelled, Finished, GenerateRequest, RequestStats, TokenEvent, check_cancel,
)
from abbench.engine.ops.sampling import Sampler
from abbench.engine.ops.trace import LayerTrace
from abbench.engine.runtime.experts import SlotStats, Traffic
from abbench.engine.runtime.prefill import Part, PrefillStats, prefill_batch

__all__ = ["CachePool", "CacheSlot", "Scheduler", "Sequence"]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass(eq=False)
class CacheSlot:
    """One sequence cache and what it holds: the tokens whose KV is valid at [0, len(tokens)), and for a hybrid
    the position where its linear layers' states were snapshotted (0: none)."""

    index: int
    cache: Any
    tokens: list[int] = field(default_factory=list)
    states_at: int = 0
    busy: bool = False


class CachePool:
    """The sequence caches (module docstring: prefix cache per cache)."""

    def __init__(self, caches: list[Any], hybrid: bool):
        self.slots = [CacheSlot(i, c) for i, c in enumerate(caches)]
        self.hybrid = hybrid

    def free(self) -> int:
        return sum(not s.busy for s in self.slots)

    def reuse(self, slot: CacheSlot, prompt: list[int]) -> int:
        """Prompt tokens ``slot`` can serve from its cache (at least one token is always prefilled)."""
        reuse = min(common_prefix(slot.tokens, prompt), len(prompt) - 1)
        if self.hybrid:  # resume exactly at the snapshot (a continuation of the last prompt) or not at all
            reuse = slot.states_at if 0 < slot.states_at <= reuse else 0
        return reuse

    def best(self, prompt: list[int]) -> tuple[CacheSlot, int]:
        """The free slot that reuses the most of ``prompt`` (ties: the lowest index, so requests one at a time
        always use the first cache, as an engine with one cache would), and that reuse."""
        best = max((s for s in self.slots if not s.busy), key=lambda s: (self.reuse(s, prompt), -s.index))
        return best, self.reuse(best, prompt)

    def release(self, slot: CacheSlot) -> None:
        slot.busy = False

    def clear(self) -> None:
        for s in self.slots:
            s.tokens, s.states_at = [], 0
            if self.hybrid:
                s.cache.clear()


@dataclass(eq=False)
class Sequence:
    """One request on the engine, from submission to its last event (module docstring)."""

    request: GenerateRequest  # resolved
    cancel: CancelLike
    emit: Callable[[Any], None]
    submitted: float = field(default_factory=time.perf_counter)
    admitted: float | None = None
    slot: CacheSlot | None = None
    reuse: int = 0
    sampler: Sampler | None = None
    event: TokenEvent | None = None
    pos: int = 0
    n_out: int = 0
    done: bool = False
    traffic: Traffic = field(default_factory=Traffic)
    lookups: SlotStats = field(default_factory=SlotStats)
    steps: dict[str, int] = field(default_factory=lambda: {"whole": 0, "per_layer": 0})
    pstats: PrefillStats | None = None
    times: dict[str, float] = field(default_factory=dict)
    copy_wait_s: float | None = None
    start_bytes: int | None = None
    retries0: int | None = None
    trace: list | None = None

    def cancelled(self) -> bool:
        try:
            check_cancel(self.cancel)
        except Cancelled:
            return True
        return False


class _BatchCancel:
    """A prefill batch's cancel flag: set when every member's is (each member's flag is looked at)."""

    def __init__(self, seqs: list[Sequence]):
        self.seqs = seqs

    def is_set(self) -> bool:
        return all([s.cancelled() for s in self.seqs])  # a list: every member's flag is checked (and counted)


class Scheduler:
    """The engine's sequences and one iteration of work (module docstring)."""

    def __init__(self, engine: Any, caches: list[Any]):  # the Engine (runtime.engine imports this module)
        self.engine = engine
        self.pool = CachePool(caches, engine.model_config.is_hybrid)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.iterations = 0
        self._lock = threading.Lock()  # guards ``waiting`` (submit runs on another thread)

    # -- the queue ------------------------------------------------------------------------------------------
    def submit(self, request: GenerateRequest, cancel: CancelLike, emit: Callable[[Any], None]) -> Sequence:
        seq = Sequence(request, cancel, emit)
        with self._lock:
            self.waiting.append(seq)
        return seq

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def free(self) -> int:
        return self.pool.free()

    def fail_all(self, exc: BaseException) -> None:
        """End every queued and running sequence with ``exc`` (the engine thread's last resort after a bug)."""
        with self._lock:
            queued, self.waiting = list(self.waiting), deque()
        for seq in [*self.running, *queued]:
            self._leave(seq)
            seq.emit(exc)

    def withdraw(self, seq: Sequence) -> bool:
        """Take ``seq`` out of the queue if it has not started (any thread); True if it was queued."""
        with self._lock:
            if seq in self.waiting:
                self.waiting.remove(seq)
                seq.done = True
                return True
        return False

    def abort(self, seq: Sequence) -> None:
        """Take ``seq`` out without emitting anything (its consumer went away)."""
        with self._lock:
            if seq in self.waiting:
                self.waiting.remove(seq)
        if seq in self.running:
            self._leave(seq)

    # -- one iteration ------------------------------------------------------------------------------------------
    def step(self) -> None:
        """One iteration (module docstring)."""
        batch = self._admit()
        if batch:
            self._prefill(batch)
        decoding = [s for s in self.running if s not in batch]
        if self.iterations % 2:  # every other iteration in reverse order: the slot cache's LRU (module docstring)
            decoding.reverse()
        self.iterations += 1
        for seq in decoding:
            self._decode(seq)

    def _admit(self) -> list[Sequence]:
        cfg, batch, tokens = self.engine.config, [], 0
        with self._lock:
            while self.waiting and self.pool.free():
                seq = self.waiting[0]
                try:
                    seq.request = self.engine.resolve(seq.request)  # idempotent for a resolved request
                except ValueError as exc:  # ContextOverflow included: refused before any work
                    self.waiting.popleft()
                    seq.done = True
                    seq.emit(exc)
                    continue
                slot, reuse = self.pool.best(seq.request.prompt_ids)
                n = len(seq.request.prompt_ids) - reuse
                if batch and not (_joins(batch[0].request, seq.request)
                                  and tokens + n <= cfg.max_prefill_batch_tokens):
                    break
                self.waiting.popleft()
                slot.busy = True
                seq.slot, seq.reuse = slot, reuse
                batch.append(seq)
                tokens += n
                if not _batchable(seq.request):
                    break
        if batch:
            self._collect()  # device-side slot counts of the steps so far belong to the sequences that ran them
        return batch

    def _account(self, seqs: list[Sequence], fn: Callable[[], Any]) -> Any:
        """Run ``fn``; the store's traffic and slot lookups meanwhile go to each of ``seqs`` (and once to the
        engine's lifetime counters)."""
        store, counters = self.engine.store, self.engine.counters
        t0, s0 = store.lifetime.snapshot(), SlotStats(store.slot_lifetime.hits, store.slot_lifetime.misses)
        try:
            return fn()
        finally:
            moved = store.lifetime.minus(t0)
            hits, misses = store.slot_lifetime.hits - s0.hits, store.slot_lifetime.misses - s0.misses
            counters["h2d_bytes_total"] += moved.h2d_bytes
            counters["d2d_bytes_total"] += moved.d2d_bytes
            counters["expert_copies_total"] += moved.expert_copies
            for seq in seqs:
                seq.traffic = Traffic(seq.traffic.h2d_bytes + moved.h2d_bytes, seq.traffic.d2d_bytes + moved.d2d_bytes,
                                      seq.traffic.expert_copies + moved.expert_copies)
                seq.lookups = SlotStats(seq.lookups.hits + hits, seq.lookups.misses + misses)

    def _collect(self) -> None:
        """Fold the device table's counts into the one running sequence that ran the steps since the last fold."""
        engine = self.engine
        if len(self.running) == 1:
            with engine._on_device():
                self._account(self.running, engine.store.collect_decode_counts)

    # -- prefill ------------------------------------------------------------------------------------------------
    def _prefill(self, batch: list[Sequence]) -> None:
        engine, store = self.engine, self.engine.store
        if not self.running:
            engine.reset_peak()
        now = time.perf_counter()
        for seq in batch:
            self.running.append(seq)
            seq.admitted = now
            seq.start_bytes, seq.retries0 = engine.device_bytes(), engine._alloc_retries()
            if engine.model_config.is_hybrid and seq.reuse:
                with engine._on_device():
                    seq.slot.cache.restore()
            seq.slot.tokens = seq.slot.tokens[:seq.reuse]  # only the shared prefix stays valid from here on
        store.begin_request()  # the batch's copy waits
        try:
            results = self._account(batch, lambda: self._run_prefill(batch))
        except BaseException as exc:  # noqa: BLE001 - every member fails as the batch did
            for seq in batch:
                self._fail(seq, exc)
            return
        with engine._on_device():
            stall = store.copy_stall_seconds()
        end = time.perf_counter()
        for seq, (logits, pstats) in zip(batch, results, strict=True):
            seq.pstats, seq.copy_wait_s = pstats, stall
            seq.times.update(prefill_start=now, prefill_end=end)
            self._first_token(seq, logits, len(batch) > 1)

    def _run_prefill(self, batch: list[Sequence]) -> list[tuple[torch.Tensor, PrefillStats]]:
        engine = self.engine
        first = batch[0].request
        if len(batch) == 1:
            seq = batch[0]
            tracer = LayerTrace() if first.trace_layers else None
            engine.model.trace = tracer
            try:
                out = [engine._prefill(first.prompt_ids[seq.reuse:], seq.reuse, first.prefill_mode, seq.cancel,
                                       first.chunk_tokens, first.attention_batch, seq.slot.cache)]
            finally:
                engine.model.trace = None
            seq.trace = tracer.export() if tracer is not None else None
            return out
        with engine._on_device():
            parts = [Part(s.slot.cache, torch.tensor(s.request.prompt_ids[s.reuse:], dtype=torch.long,
                                                     device=engine.device), s.reuse) for s in batch]  # [T] each
            out = prefill_batch(engine.steps, engine.store, parts, chunk_tokens=first.chunk_tokens,
                                window_tokens=engine.config.layer_major_window_tokens, cancel=_BatchCancel(batch),
                                batching=engine._batching(first.attention_batch, first.chunk_tokens))
            if engine.device.type == "cuda":
                torch.cuda.synchronize(engine.device)
        return out

    def _first_token(self, seq: Sequence, logits: torch.Tensor, shared: bool) -> None:
        engine, req = self.engine, seq.request
        prompt = req.prompt_ids
        slot = seq.slot
        slot.tokens = list(prompt)
        if engine.model_config.is_hybrid:
            with engine._on_device():
                slot.cache.snapshot()
            slot.states_at = len(prompt)
        counters = engine.counters
        counters["requests_by_path"][seq.pstats.path] += 1
        counters["prefill_tokens_by_path"][seq.pstats.path] += seq.pstats.n_tokens
        counters["cached_prompt_tokens_total"] += seq.reuse
        if shared and seq.cancelled():  # cancelled while its batch went on (alone it stops in its prefill)
            self._fail(seq, Cancelled("request cancelled"))
            return
        seq.sampler = Sampler(req.temperature, req.seed, engine.device, req.logprobs)
        seq.event = engine._sample(seq.sampler, logits)
        seq.times["first_token"] = time.perf_counter()
        seq.n_out, seq.pos = 1, len(prompt)
        seq.emit(seq.event)
        self._maybe_finish(seq)

    # -- decode -------------------------------------------------------------------------------------------------
    def _decode(self, seq: Sequence) -> None:
        engine, req = self.engine, seq.request
        try:
            check_cancel(seq.cancel)
            steps0 = dict(engine.decoder.steps)

            def step() -> torch.Tensor:
                logits = engine._decode(seq.event.token_id, seq.pos, seq.cancel, req.decode_misses, seq.slot.index)
                if len(self.running) > 1:  # fold the device-side counts into this sequence now
                    with engine._on_device():
                        engine.store.collect_decode_counts()
                return logits

            logits = self._account([seq], step)
            for k in seq.steps:
                seq.steps[k] += engine.decoder.steps[k] - steps0[k]
            seq.slot.tokens.append(seq.event.token_id)
            seq.pos += 1
            seq.event = engine._sample(seq.sampler, logits)
            seq.n_out += 1
        except BaseException as exc:  # noqa: BLE001 - this sequence fails; the others go on
            self._fail(seq, exc)
            return
        seq.emit(seq.event)
        self._maybe_finish(seq)

    def _maybe_finish(self, seq: Sequence) -> None:
        req = seq.request
        eos = frozenset() if req.ignore_eos else self.engine.model_config.eos_ids
        stop = seq.event.token_id in eos
        if not stop and seq.n_out < req.max_tokens:
            return
        with self.engine._on_device():
            self._account([seq], self.engine.store.collect_decode_counts)
        stats = self._stats(seq, "stop" if stop else "length")
        self._leave(seq)
        seq.emit(Finished(stats, time.perf_counter()))

    def _stats(self, seq: Sequence, finish: str) -> RequestStats:
        engine, req, p = self.engine, seq.request, seq.pstats
        retries = engine._alloc_retries()
        return RequestStats(
            prefill_path=p.path, fallback_reason=p.fallback_reason,
            h2d_bytes=seq.traffic.h2d_bytes, d2d_bytes=seq.traffic.d2d_bytes, prefill_h2d_bytes=p.h2d_bytes,
            decode_h2d_bytes=seq.traffic.h2d_bytes - p.h2d_bytes, bank_bytes=engine.bank_bytes,
            expert_copies=seq.traffic.expert_copies, cached_prompt_tokens=seq.reuse, prompt_tokens=len(req.prompt_ids),
            completion_tokens=seq.n_out, n_chunks=p.n_chunks, n_windows=p.n_windows,
            prefill_start=seq.times["prefill_start"], prefill_end=seq.times["prefill_end"],
            first_token=seq.times["first_token"], finish_reason=finish, slot_hits=seq.lookups.hits,
            slot_misses=seq.lookups.misses, decode_steps_whole=seq.steps["whole"],
            decode_steps_per_layer=seq.steps["per_layer"], decode_misses=req.decode_misses,
            peak_device_bytes=engine.peak_bytes(), start_device_bytes=seq.start_bytes, chunk_tokens=req.chunk_tokens,
            alloc_retries=None if retries is None else retries - seq.retries0, copy_wait_s=seq.copy_wait_s,
            prefill_graph_replays=p.graph_replays, attention_batch=p.attention_batch,
            attention_batched=p.attention_batched, attention_fallbacks=p.attention_fallbacks, auto=p.auto,
            layer_trace=seq.trace, prefill_batch=p.batch_prompts,
            queue_s=round(seq.admitted - seq.submitted, 6))

    # -- leaving --------------------------------------------------------------------------------------------------
    def _leave(self, seq: Sequence) -> None:
        if not seq.done:
            self.engine.counters["requests_total"] += 1
        seq.done = True
        if seq in self.running:
            self.running.remove(seq)
        if seq.slot is not None:
            self.pool.release(seq.slot)

    def _fail(self, seq: Sequence, exc: BaseException) -> None:
        engine = self.engine
        if isinstance(exc, Cancelled):
            engine.counters["requests_cancelled"] += 1
        if isinstance(exc, torch.OutOfMemoryError):  # drop request-local tensors, the frames' locals included
            traceback.clear_frames(exc.__traceback__)
            if engine.device.type == "cuda":
                torch.cuda.empty_cache()
        with engine._on_device(), contextlib.suppress(RuntimeError):  # never mask the request's error
            self._account([seq], engine.store.collect_decode_counts)
        if seq.slot is not None and seq.pstats is None:  # failed in prefill: the cache holds garbage beyond the
            seq.slot.tokens = seq.slot.tokens[:seq.reuse]  # reused prefix (a hybrid's snapshot stays intact)
        self._leave(seq)
        seq.emit(exc)


def _batchable(req: GenerateRequest) -> bool:
    """Whether a request may share a prefill batch: layer-major, untraced."""
    return req.prefill_mode == "layer-major" and not req.trace_layers


def _joins(first: GenerateRequest, req: GenerateRequest) -> bool:
    return (_batchable(first) and _batchable(req) and req.chunk_tokens == first.chunk_tokens
            and req.attention_batch == first.attention_batch)
