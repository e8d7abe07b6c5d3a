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
  its first token before this iteration decodes one token, all of them in one batched step
  (``Decoder.step_batch``: each over its own cache, the slot cache shared; per layer one host read of the
  routing for all of them where the host handles the misses), then each one's token is sampled from its own
  logits and emitted. The batch's list order is the order of the slot lookups in each layer: arrival order on
  even iterations and the reverse on odd ones: the sequences' experts meet in each layer's LRU slot block, and
  a scan in a fixed order over more experts than the block holds misses on nearly every lookup, where
  alternating the direction reuses what the last sequences left (a simulation with per-sequence routing that
  mostly stays: 0.72 of lookups missed in a fixed order, 0.42 alternating). A sequence leaves when it
  finishes, fails or is cancelled; the next iteration may admit another.
- **Policy between prefill and decode:** prefill first. A decoding sequence waits at most one prefill batch per
  token, and a batch holds at most ``max_prefill_batch_tokens`` uncached prompt tokens (a first prompt longer
  than that runs alone), so that bound is what a long prompt costs the others' inter-token latency.
- **Outputs do not depend on the batch, by construction:** a batch-prefilled prompt makes exactly the layer
  calls it makes alone (``prefill.layer_major_parts``) and each sequence's decode step is the step it takes
  alone, over its own cache and buffers, inside the batched step as well; the experts read from the slot
  cache are the same weights wherever they sit. So a prompt's greedy ids and logprobs are bitwise the same
  alone and in any batch, on every device (tested on CPU; the CUDA run is listed in docs/batching.md). What
  batching shares is the weight reads: the bank streams of a prefill batch, and the slot cache's experts
  within and between the decode steps (an expert one sequence loaded is a hit for the next), and a decode
  step's host syncs. Decode still computes one GEMV-shaped step per sequence: its compute is not batched.
- **Prefix cache per sequence cache:** each cache keeps the tokens whose KV it holds (prompt and output of its
  last sequence); a request takes the free cache that shares the longest prefix with its prompt (at most
  len(prompt) - 1 tokens; hybrids: exactly the last prompt's snapshot), the first such cache on a tie, so
  requests one at a time always run in the first cache, with the prefix cache of an engine with one cache.
  ``reset()`` (idle only) empties them all.
- **Cancellation** of one sequence never disturbs the others: a queued one leaves the queue (``withdraw``, or
  at its prefill's first layer step); a decoding one is looked at before the batched step (then it leaves
  before it) and, inside it, before each of its layers from the second on where the host handles the misses
  (it leaves the remaining layers; a whole step is not interrupted): it gets ``Cancelled``, the others' step
  goes on; a prefill batch stops when all its members are cancelled, and a member cancelled while the others
  go on gets ``Cancelled`` when the batch's prefill ends.
- **Failures** in decode: an exception raised by one sequence's own work in the batched step (its attention
  half, slot lookup and copies, MoE half, head or whole step) or by its sampling fails that sequence only. One
  that no sequence raised (the batch's shared routing read, where an asynchronous CUDA error of any of them
  surfaces; the device counts' read; a bug in the step itself) cannot be attributed: every sequence of the
  batch fails with it.
- **Accounting per sequence:** its own decode steps' bytes, slot-cache hits and misses and step counts (each
  expert copy of a batched step is charged to the sequence whose lookup missed: the store's counters around
  its own lookup, or the device table's counts either side of its own whole step; a sequence that hits what
  another loaded is charged the hit; a batch that fails unattributed charges what it moved to each of its
  sequences, as a prefill batch does; the engine's totals count everything once); its
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
from abbench.engine.runtime.decode import DecodeItem
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
    prefetched: int = 0  # experts the decode prefetch copied in for it
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
        if decoding:
            self._decode(decoding)

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
                self._charge(seq, moved, SlotStats(hits, misses))

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
        seq.sampler = Sampler(req.temperature, req.seed, engine.device, req.logprobs, full=req.full_logprobs)
        seq.event = engine._sample(seq.sampler, logits)
        seq.times["first_token"] = time.perf_counter()
        seq.n_out, seq.pos = 1, len(prompt)
        seq.emit(seq.event)
        self._maybe_finish(seq)

    # -- decode -------------------------------------------------------------------------------------------------
    def _decode(self, seqs: list[Sequence]) -> None:
        """One batched decode step of ``seqs`` (in this order: the order of their slot lookups), then each one's
        token sampled and emitted. What fails or is cancelled leaves alone (module docstring)."""
        engine, store, counters = self.engine, self.engine.store, self.engine.counters
        live = []
        for seq in seqs:
            try:
                check_cancel(seq.cancel)
            except BaseException as exc:  # noqa: BLE001 - Cancelled, or whatever its flag raised: this one fails
                self._fail(seq, exc)
                continue
            live.append(seq)
        if not live:
            return
        items = [DecodeItem(s.event.token_id, s.pos, s.slot.index, s.cancel, s.request.decode_misses) for s in live]
        t0, s0 = store.lifetime.snapshot(), SlotStats(store.slot_lifetime.hits, store.slot_lifetime.misses)
        try:
            try:
                with engine._on_device():
                    results = engine.decoder.step_batch(items)
                events: list[TokenEvent | None] = []
                for seq, r in zip(live, results, strict=True):  # the batch's logits, each in its cache's buffer
                    event = None
                    if r.error is None:
                        try:
                            event = engine._sample(seq.sampler, r.logits)
                        except Exception as exc:  # noqa: BLE001 - this sequence's sampling
                            r.error = exc
                    events.append(event)
                with engine._on_device():
                    engine.decoder.settle(results)  # the device-side lookups' counts, per sequence
            finally:
                moved = store.lifetime.minus(t0)  # the engine's totals: everything the batch moved
                counters["h2d_bytes_total"] += moved.h2d_bytes
                counters["d2d_bytes_total"] += moved.d2d_bytes
                counters["expert_copies_total"] += moved.expert_copies
        except BaseException as exc:  # noqa: BLE001 - not one sequence's: every sequence of the batch fails
            hits, misses = store.slot_lifetime.hits - s0.hits, store.slot_lifetime.misses - s0.misses
            for seq in live:  # what the batch moved is charged to each of them, as a prefill batch's is
                self._charge(seq, moved, SlotStats(hits, misses))
                self._fail(seq, exc)
            return
        for seq, r, event in zip(live, results, events, strict=True):
            self._charge(seq, r.traffic, r.lookups)  # its own lookups' copies, hits and misses
            seq.prefetched += r.prefetched
            if r.way:
                seq.steps[r.way] += 1
            if r.error is not None:
                self._fail(seq, r.error)
                continue
            seq.slot.tokens.append(seq.event.token_id)
            seq.pos += 1
            seq.event = event
            seq.n_out += 1
            seq.emit(seq.event)
            self._maybe_finish(seq)

    @staticmethod
    def _charge(seq: Sequence, traffic: Traffic, lookups: SlotStats) -> None:
        seq.traffic = Traffic(seq.traffic.h2d_bytes + traffic.h2d_bytes, seq.traffic.d2d_bytes + traffic.d2d_bytes,
                              seq.traffic.expert_copies + traffic.expert_copies)
        seq.lookups = SlotStats(seq.lookups.hits + lookups.hits, seq.lookups.misses + lookups.misses)

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
            slot_misses=seq.lookups.misses, decode_prefetched=seq.prefetched, decode_steps_whole=seq.steps["whole"],
            decode_steps_per_layer=seq.steps["per_layer"], decode_misses=req.decode_misses,
            peak_device_bytes=engine.peak_bytes(), start_device_bytes=seq.start_bytes, chunk_tokens=req.chunk_tokens,
            alloc_retries=None if retries is None else retries - seq.retries0, copy_wait_s=seq.copy_wait_s,
            prefill_graph_replays=p.graph_replays, attention_batch=p.attention_batch,
            attention_batched=p.attention_batched, attention_fallbacks=p.attention_fallbacks, auto=p.auto,
            layer_trace=seq.trace, full_logprobs=seq.sampler.first_full_b64() if seq.sampler else None,
            prefill_batch=p.batch_prompts, first_layer_primed=p.primed, queue_s=round(seq.admitted - seq.submitted, 6))

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
