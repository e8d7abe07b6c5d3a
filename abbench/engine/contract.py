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
:class:`Cancelled` at the next step after ``cancel`` is set (:func:`check_cancel`); one request runs at a time.
``reset`` flushes its caches. ``info`` (:class:`BackendInfo`) is what the server reports about it
(``/v1/models``, the per-request ``abbench`` object, ``/metrics``), ``counters`` its lifetime counts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, Union

from abbench.engine.config import DECODE_MISSES, MAX_ATTENTION_BATCH, PREFILL_MODES

__all__ = ["Backend", "BackendInfo", "CancelLike", "Cancelled", "ContextOverflow", "GenerateRequest", "Override",
           "RequestStats", "TokenEvent", "check_cancel", "check_request", "drain", "override"]


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


def override(doc: str, kind: str, default: Any = None, **limits: Any) -> Any:
    """A :class:`GenerateRequest` field that is a per-request engine knob (:class:`Override`: ``kind`` and its
    limits); the API's schema and the server's ``--allow-request-overrides`` gate take it from here."""
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
    decode_misses: str | None = None  # decode: who handled the misses ("host", "device"; None: resident)
    decode_steps_whole: int = 0  # decode steps that ran as one piece (no expert could miss)
    decode_steps_per_layer: int = 0  # decode steps that read the router back layer by layer
    peak_device_bytes: int | None = None  # torch's peak allocated device memory during the request (CUDA)
    start_device_bytes: int | None = None  # torch's allocated device memory when it started: what the engine holds
    chunk_tokens: int | None = None  # the prefill chunk length this request ran with
    alloc_retries: int | None = None  # CUDA caching-allocator retries (free cache + cudaMalloc again) during it
    copy_wait_s: float | None = None  # prefill: GPU time compute waited for streamed expert copies (CUDA)
    prefill_graph_replays: int | None = None  # prefill layer half-steps replayed from CUDA graphs
    attention_batch: int | None = None  # layer-major: chunks per attention call asked for
    attention_batched: int | None = None  # attention groups that ran as one call
    attention_fallbacks: dict | None = None  # groups that ran one call per chunk, by reason (runtime.steps)
    auto: dict | None = None  # prefill_mode auto: the path it picked, why, and its estimates (runtime.policy)
    layer_trace: list | None = None  # trace_layers: per layer and sub-block, the last prompt position (ops.trace)


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


class Backend(Protocol):
    """What the HTTP layer needs of a serving backend (module docstring)."""

    info: BackendInfo
    counters: dict[str, Any]  # lifetime counters the metrics endpoint reads

    def generate(self, request: GenerateRequest, cancel: CancelLike = None) -> Iterator[TokenEvent]: ...

    def reset(self) -> None: ...
