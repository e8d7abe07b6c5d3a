"""The backend contract: what the HTTP layer asks of a serving backend, and what a backend gives back. No torch.

The flow: the API (:mod:`abbench.engine.serve.api`) validates a completion's body and builds one
:class:`GenerateRequest`; the queue (:mod:`abbench.engine.serve.serving`) hands it whole to
``Backend.generate(request, cancel)``; the backend (the vendored :class:`abbench.engine.runtime.engine.Engine`
or the transformers :class:`abbench.engine.serve.reference.ReferenceEngine`) resolves what the request left to
it and runs it. So a per-request knob is one field here: the API's schema builds its override fields from
:meth:`GenerateRequest.overrides` (type, limits, description) and the server checks ``--allow-request-overrides``
over the same list.

``Backend.generate`` validates eagerly, before any work: ``ValueError`` (the server answers 400) for a value it
cannot serve, :class:`ContextOverflow` when prompt + max_tokens > its context (:func:`check_request` makes the
checks every backend shares). It returns a generator of :class:`TokenEvent`, one per output token, whose return
value (``StopIteration.value``, :func:`drain`) is the request's :class:`RequestStats`; it raises
:class:`Cancelled` at the next step after ``cancel`` is set (:func:`check_cancel`); one request runs at a time
through ``generate``. The server runs requests through the backend's :class:`Scheduler` instead: the vendored
engine's batches several (:mod:`abbench.engine.runtime.scheduler`), a :class:`SerialScheduler` runs a
``generate``-only backend one request at a time.
``reset`` flushes its caches. ``info`` (:class:`BackendInfo`) is what the server reports about it
(``/v1/models``, the per-request ``abbench`` object, ``/metrics``), ``counters`` its lifetime counts.
``prime_prefill`` (a request has arrived at the idle backend: start what its prefill needs first; the engine
thread calls it) and ``drop_prime`` (that request failed first) are optional: the server skips a backend
without them.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, Union

from abbench.engine.config import DECODE_MISSES, MAX_ATTENTION_BATCH, PREFILL_MODES

__all__ = ["Backend", "BackendInfo", "CancelLike", "Cancelled", "ContextOverflow", "Finished", "GenerateRequest", "Handle",
           "Override", "RequestStats", "Scheduler", "SerialScheduler", "TokenEvent", "check_cancel", "check_request",
           "drain", "override"]


# ----------------------------------------------------------------------------------------------- the request


@dataclass(frozen=True)
class Override:
    """A per-request engine knob as the API declares it: a flag, an integer within limits, or one of choices."""

    doc: str
    kind: str  # "int" | "choice" | "flag"
    gt: int | None = None
    ge: int | None = None
    le: int | None = None
    choices: tuple[str, ...] = ()
    gated: bool = True  # the server takes it only with --allow-request-overrides (False: it asks for output alone)


def override(doc: str, kind: str, default: Any = None, **limits: Any) -> Any:
    """A :class:`GenerateRequest` field that is a per-request engine knob (:class:`Override`: ``kind`` and its
    limits); the API's schema and the server's ``--allow-request-overrides`` gate take it from here (an
    ungated one, ``gated=False``, asks for more output and changes nothing the engine computes: any request may)."""
    return field(default=default, metadata={"override": Override(doc, kind, **limits)})


@dataclass(frozen=True)
class GenerateRequest:
    """One completion, as the HTTP layer hands it to a backend. The fields after ``logprobs`` are the engine's
    per-request overrides (:meth:`overrides`); None (False for a flag) leaves the choice to the backend."""

    prompt_ids: list[int]
    max_tokens: int = 16
    temperature: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k logprobs per output token; None: none
    prefill_mode: str | None = override("Per-request prefill mode.", "choice", choices=PREFILL_MODES)
    chunk_tokens: int | None = override(
        "Per-request prefill chunk length (default: the server's --chunk-tokens). With --gpu-memory-budget, at "
        "most the server's chunk length (the budget was planned for it).", "int", gt=0)
    attention_batch: int | None = override(
        "Per-request chunks per attention call in layer-major prefill (default: the server's --attention-batch).",
        "int", ge=1, le=MAX_ATTENTION_BATCH)
    decode_misses: str | None = override(
        "Per-request: who handles the decode slot cache's misses, host (a host round trip per layer) or device "
        "(kernels of the step; needs the Triton experts); default the server's --decode-misses.", "choice",
        choices=tuple(m for m in DECODE_MISSES if m != "auto"))
    trace_layers: bool = override(
        "Return abbench.layer_trace: per layer and sub-block the hash and RMS of the last prompt position's hidden "
        "state (abbench.engine.ops.trace).", "flag", default=False)
    full_logprobs: bool = override(
        "Return abbench.full_logprobs: the first output position's log-probabilities over the whole vocabulary, "
        "base64 float32 little-endian (about 4 bytes a vocabulary entry). Output alone: any request may ask.",
        "flag", default=False, gated=False)

    @classmethod
    def overrides(cls) -> dict[str, Override]:
        """The per-request engine knobs, in field order: {name: how the API declares it}."""
        return {f.name: f.metadata["override"] for f in dataclasses.fields(cls) if "override" in f.metadata}

    @classmethod
    def build(cls, prompt_ids: list[int], source: Any) -> GenerateRequest:
        """A request of ``prompt_ids`` with every other field read from ``source``'s attribute of the same name
        (the API's parsed body); a missing attribute or a None takes the field's default."""
        values = {f.name: getattr(source, f.name, None) for f in dataclasses.fields(cls) if f.name != "prompt_ids"}
        return cls(prompt_ids=list(prompt_ids), **{k: v for k, v in values.items() if v is not None})

    def overridden(self) -> list[str]:
        """The overrides this request sets (not left to the backend), in field order."""
        return [name for name in self.overrides() if getattr(self, name) not in (None, False)]


CancelLike = Union[Callable[[], bool], Any, None]  # a threading.Event, a zero-argument callable, or None


class Cancelled(Exception):
    """The request's cancel flag was set; raised at the next layer step of prefill or decode."""


def check_cancel(cancel: CancelLike) -> None:
    """Raise :class:`Cancelled` when ``cancel`` (an object with ``is_set()``, or a callable) says so."""
    if cancel is None:
        return
    is_set = cancel.is_set() if hasattr(cancel, "is_set") else cancel()
    if is_set:
        raise Cancelled("request cancelled")


class ContextOverflow(ValueError):
    """prompt + max_tokens exceeds the backend's max_context."""


def check_request(request: GenerateRequest, vocab: int, max_context: int) -> list[int]:
    """The prompt as ints, after the checks every backend makes before any work (ValueError; ContextOverflow
    when prompt + max_tokens > max_context), the logprobs and temperature included."""
    prompt = [int(t) for t in request.prompt_ids]
    max_tokens = request.max_tokens
    if not prompt:
        raise ValueError("prompt_ids is empty")
    if min(prompt) < 0 or max(prompt) >= vocab:
        raise ValueError(f"prompt token ids must be in [0, {vocab}); got {min(prompt)}..{max(prompt)}")
    if int(max_tokens) < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if len(prompt) + int(max_tokens) > max_context:
        raise ContextOverflow(f"prompt of {len(prompt)} tokens + max_tokens {max_tokens} = "
                              f"{len(prompt) + int(max_tokens)} tokens exceeds max_context {max_context}")
    if request.logprobs is not None and not 0 <= int(request.logprobs) <= vocab:
        raise ValueError(f"logprobs must be in [0, {vocab}], got {request.logprobs}")
    if request.temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {request.temperature}")
    return prompt


# ------------------------------------------------------------------------------------------- what comes back


@dataclass
class TokenEvent:
    token_id: int
    logprob: float | None  # logprob of the chosen token when logprobs requested
    top_logprobs: list[tuple[int, float]] | None  # top-k (id, logprob) when requested


@dataclass
class RequestStats:
    prefill_path: str  # chunked|layer-major|demand|resident (what ran); "reference" for the transformers backend
    fallback_reason: str | None
    h2d_bytes: int  # prefill + decode of this request
    d2d_bytes: int
    prefill_h2d_bytes: int
    decode_h2d_bytes: int
    bank_bytes: int  # all layers' experts, one full pass
    expert_copies: int
    cached_prompt_tokens: int  # prefix-cache reuse
    prompt_tokens: int
    completion_tokens: int
    n_chunks: int
    n_windows: int
    prefill_start: float  # time.perf_counter() values
    prefill_end: float
    first_token: float
    finish_reason: str  # "length" | "stop"
    slot_hits: int = 0  # decode: routed (layer, expert) pairs found in the slot cache
    slot_misses: int = 0  # decode: routed pairs copied in from the host bank
    decode_prefetched: int = 0  # decode: experts the prefetch copied in ahead of their lookup (in the H2D bytes)
    decode_misses: str | None = None  # decode: who handled the misses ("host", "device"; None: resident)
    decode_steps_whole: int = 0  # decode steps that ran as one piece (no expert could miss)
    decode_steps_per_layer: int = 0  # decode steps that read the router back layer by layer
    peak_device_bytes: int | None = None  # torch's peak allocated device memory during the request (CUDA)
    start_device_bytes: int | None = None  # torch's allocated device memory when it started: what the engine holds
    chunk_tokens: int | None = None  # the prefill chunk length this request ran with
    alloc_retries: int | None = None  # CUDA caching-allocator retries (free cache + cudaMalloc again) during it
    copy_wait_s: float | None = None  # prefill: GPU time compute waited for streamed expert copies (CUDA)
    first_layer_primed: bool | None = None  # prefill: its first layer's copy had started as the request arrived
    prefill_graph_replays: int | None = None  # prefill layer half-steps replayed from CUDA graphs
    attention_batch: int | None = None  # layer-major: chunks per attention call asked for
    attention_batched: int | None = None  # attention groups that ran as one call
    attention_fallbacks: dict | None = None  # groups that ran one call per chunk, by reason (runtime.steps)
    auto: dict | None = None  # prefill_mode auto: the path it picked, why, and its estimates (runtime.policy)
    layer_trace: list | None = None  # trace_layers: per layer and sub-block, the last prompt position (ops.trace)
    full_logprobs: str | None = None  # full_logprobs: the first output position's log_softmax row (base64 float32)
    prefill_batch: int | None = None  # prompts prefilled together with this one (itself included; layer-major)
    queue_s: float | None = None  # seconds from submission to admission (waiting for a sequence cache)


def drain(gen: Iterator[TokenEvent]) -> tuple[list[TokenEvent], RequestStats]:
    """Run a ``generate`` generator to its end: (events, its return value, the RequestStats)."""
    events: list[TokenEvent] = []
    while True:
        try:
            events.append(next(gen))
        except StopIteration as stop:
            return events, stop.value


# ------------------------------------------------------------------------------------------------ a backend


@dataclass(frozen=True)
class BackendInfo:
    """What the server reports about a backend, fixed once it is built."""

    model: str  # the name or path it was built from (the served name's default)
    model_name: str  # the model's own name (``/v1/models``' root)
    vocab_size: int
    max_context: int
    startup_s: float  # seconds the backend took to build
    decode_mode: str  # "cuda-graphs", "eager", or the backend's own word
    decode_kernels: str | None = None
    measured_h2d_gbps: float = float("nan")  # host-to-device bandwidth measured at start; NaN: no offload
    bank_bytes: int = 0  # one full pass over every layer's offloaded experts
    slots_per_layer: int | None = None  # the decode slot cache's size; None: no slot cache
    expert_format: str | None = None  # how the host bank stores the experts ("bfloat16", "fp8-e4m3 (...)"); None: n/a


class Backend(Protocol):
    """What the HTTP layer needs of a serving backend (module docstring)."""

    info: BackendInfo
    counters: dict[str, Any]  # lifetime counters the metrics endpoint reads
    scheduler: Scheduler  # how the server runs many requests: the engine's own, or a SerialScheduler

    def generate(self, request: GenerateRequest, cancel: CancelLike = None) -> Iterator[TokenEvent]: ...

    def reset(self) -> None: ...


# ---------------------------------------------------------------------------------------------- scheduling


@dataclass
class Finished:
    """The last thing a scheduled request emits: its stats, and when the backend finished it (perf_counter)."""

    stats: RequestStats
    finished: float


class Handle(Protocol):
    """A submitted request as its scheduler keeps it."""

    submitted: float  # perf_counter at submission
    admitted: float | None  # perf_counter when it started on the backend (None: still queued)
    done: bool


class Scheduler(Protocol):
    """How the server's single engine thread runs requests (:mod:`abbench.engine.serve.serving`).

    ``submit(request, cancel, emit)`` queues a request (thread-safe: called from the event loop); everything it
    produces goes to ``emit`` from the engine thread, in order: each ``TokenEvent``, then a :class:`Finished`,
    or instead an exception (``ValueError``/``ContextOverflow`` when it cannot be served, ``Cancelled``,
    out-of-memory, a bug) after which nothing more comes. ``step()`` does one unit of work (the engine thread
    calls it while ``busy``); ``abort(handle)`` drops a request silently (engine thread); ``withdraw(handle)``
    takes a request out of the queue if it has not started (any thread; True if it was queued); ``fail_all(exc)`` ends every request
    with ``exc`` (the engine thread's last resort); ``waiting``/``running`` are the queued and started requests;
    ``free`` how many more could start now."""

    waiting: Any
    running: Any

    @property
    def busy(self) -> bool: ...

    @property
    def free(self) -> int: ...

    def submit(self, request: GenerateRequest, cancel: CancelLike, emit: Callable[[Any], None]) -> Handle: ...

    def step(self) -> None: ...

    def abort(self, handle: Any) -> None: ...

    def withdraw(self, handle: Any) -> bool: ...

    def fail_all(self, exc: BaseException) -> None: ...


@dataclass(eq=False)
class _Serial:
    request: GenerateRequest
    cancel: CancelLike
    emit: Callable[[Any], None]
    submitted: float = dataclasses.field(default_factory=time.perf_counter)
    admitted: float | None = None
    done: bool = False
    gen: Iterator[TokenEvent] | None = None


class SerialScheduler:
    """A :class:`Scheduler` for a backend that runs one request at a time (``generate``): requests start in
    arrival order; a step advances the running one by one token."""

    def __init__(self, backend: Backend):
        self.backend = backend
        self.waiting: deque[_Serial] = deque()
        self.running: list[_Serial] = []
        self._lock = threading.Lock()

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def free(self) -> int:
        return 0 if self.running else 1

    def submit(self, request: GenerateRequest, cancel: CancelLike, emit: Callable[[Any], None]) -> _Serial:
        seq = _Serial(request, cancel, emit)
        with self._lock:
            self.waiting.append(seq)
        return seq

    def step(self) -> None:
        if not self.running:
            with self._lock:
                if not self.waiting:
                    return
                seq = self.waiting.popleft()
            seq.admitted = time.perf_counter()
            try:
                check_cancel(seq.cancel)
                seq.gen = self.backend.generate(seq.request, seq.cancel)
            except BaseException as exc:  # noqa: BLE001 - refused before any work, or left while queued
                self._end(seq, exc)
                return
            self.running.append(seq)
        seq = self.running[0]
        try:
            event = next(seq.gen)
        except StopIteration as stop:
            self._end(seq, Finished(stop.value, time.perf_counter()))
            return
        except BaseException as exc:  # noqa: BLE001 - Cancelled, OOM, bugs: the consumer decides
            self._end(seq, exc)
            return
        seq.emit(event)

    def _end(self, seq: _Serial, last: Any) -> None:
        seq.done = True
        if seq in self.running:
            self.running.remove(seq)
        seq.emit(last)

    def withdraw(self, handle: Any) -> bool:
        with self._lock:
            if handle in self.waiting:
                self.waiting.remove(handle)
                handle.done = True
                return True
        return False

    def abort(self, handle: Any) -> None:
        with self._lock:
            if handle in self.waiting:
                self.waiting.remove(handle)
        if handle in self.running:
            self.running.remove(handle)
            handle.gen.close()
        handle.done = True

    def fail_all(self, exc: BaseException) -> None:
        with self._lock:
            seqs, self.waiting = [*self.running, *self.waiting], deque()
        self.running = []
        for seq in seqs:
            self._end(seq, exc)
