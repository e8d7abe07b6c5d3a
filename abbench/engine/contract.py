"""The contract between the HTTP layer and a serving backend.

:class:`GenerateRequest` is what the HTTP layer (:mod:`abbench.engine.serve.server`) asks of a backend for one
completion, its fields already validated by the API schema (:class:`abbench.engine.serve.api.CompletionRequest`)
and the per-request overrides already allowed. :class:`Backend` is what a backend offers the HTTP layer and
its queue (:mod:`abbench.engine.serve.serving`): ``generate`` takes every field of :class:`GenerateRequest` as a
keyword argument (:meth:`GenerateRequest.options`) plus ``cancel``, and returns a generator of token events
(``TokenEvent``: ``token_id``, ``logprob``, ``top``), one per output token, whose return value is the
request's ``RequestStats``; it raises ``ValueError`` (the server answers 400) for a value it cannot serve,
``ContextOverflow`` before any work, ``Cancelled`` at the next step after ``cancel`` is set; one request runs at
a time. ``reset`` flushes its caches. The attributes are what the server reports (``/v1/models``, the
per-request ``abbench`` object, ``/metrics``).

Both backends implement it: the vendored :class:`abbench.engine.runtime.engine.Engine` and the transformers
:class:`abbench.engine.serve.reference.ReferenceEngine` (which refuses the fields it has no use for, e.g.
``prefill_mode``). No torch here.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any, Protocol

__all__ = ["Backend", "GenerateRequest"]


@dataclass(frozen=True)
class GenerateRequest:
    """One completion, as the HTTP layer hands it to a backend."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k logprobs per output token; None: none
    prefill_mode: str | None = None  # None: the backend's own
    chunk_tokens: int | None = None  # this request's prefill chunk length; None: the backend's own
    attention_batch: int | None = None  # chunks per attention call in layer-major prefill; None: the backend's
    trace_layers: bool = False  # return the prefill's layer trace in RequestStats.layer_trace
    decode_misses: str | None = None  # who handles decode's slot-cache misses: host or device; None: the backend's

    def options(self) -> dict[str, Any]:
        """The keyword arguments of ``Backend.generate`` after ``prompt_ids`` and ``max_tokens``."""
        out = asdict(self)
        del out["prompt_ids"], out["max_tokens"]
        return out


class Backend(Protocol):
    """What the HTTP layer needs of a serving backend (module docstring)."""

    config: Any  # .model (the name or path it was built from), .max_context
    model_config: Any  # .name, .vocab_size, .max_position_embeddings
    counters: dict[str, Any]  # lifetime counters the metrics endpoint reads
    measured_h2d_gbps: float
    bank_bytes: int
    startup_s: float
    slots_per_layer: int | None
    decoder: Any  # .mode

    def generate(self, prompt_ids: list[int], max_tokens: int, *, temperature: float = 0.0,
                 seed: int | None = None, ignore_eos: bool = False, logprobs: int | None = None,
                 prefill_mode: str | None = None, cancel: Any = None, trace_layers: bool = False,
                 chunk_tokens: int | None = None, attention_batch: int | None = None,
                 decode_misses: str | None = None) -> Iterator[Any]: ...

    def reset(self) -> None: ...
