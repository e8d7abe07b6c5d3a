"""Per-request engine statistics: the ``abbench`` object of the vendored engine's completion responses.

The engine's server fills a :class:`AbbenchStats` for every finished request (the last streamed event, or
the non-streamed body, carries it as ``"abbench"``); the harness keeps it verbatim in ``Sample.engine`` and
reads it back with :meth:`AbbenchStats.read`. This module imports only pydantic: the harness reads it
without torch, and it imports nothing from the harness.

Reading is lenient: a field that is missing, or that holds a value of another type, reads as None, and
fields this model does not name are kept (``extra="allow"``: other engines' objects, such as the
``engine_prompt_tokens`` the adapters add, and fields a newer engine adds), so every ``run.json`` loads.
New fields are optional (default None) so that older results still read.

Timings are seconds relative to ``received`` (when the server's ASGI app got the request), so
``first_token`` is the engine's own time to first token.
"""

from __future__ import annotations

import functools
from typing import Any, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")

    @classmethod
    def read(cls, obj: Any) -> Any:
        """The model from a recorded object; fields that do not validate read as None (never raises)."""
        if not isinstance(obj, dict):
            return cls()
        data = dict(obj)
        for name, field, nested in _nested_fields(cls):
            if name in data and not (data[name] is None and not field.is_required() and field.default is None):
                data[name] = nested.read(data[name])
        for _ in range(len(cls.model_fields) + 1):
            try:
                return cls.model_validate(data)
            except ValidationError as e:
                for err in e.errors():
                    data[err["loc"][0]] = None
        return cls()


@functools.cache
def _nested_fields(cls: type[_Lenient]) -> tuple[tuple[str, Any, type[_Lenient]], ...]:
    """(name, field, lenient model) of each field of ``cls`` that holds a lenient model, in field order: worked
    out once a class (looking through every field's annotation was 70% of a read)."""
    fields = ((name, field, _lenient_class(field.annotation)) for name, field in cls.model_fields.items())
    return tuple((name, field, nested) for name, field, nested in fields if nested is not None)


def _lenient_class(annotation: Any) -> type[_Lenient] | None:
    """The lenient model an annotation holds (``X`` or ``X | None``), if any."""
    for t in (annotation, *get_args(annotation)):
        if isinstance(t, type) and issubclass(t, _Lenient):
            return t
    return None


class AbbenchTimings(_Lenient):
    """Seconds after ``received`` (None: that point was not reached or not measured)."""

    received: float | None = Field(0.0, description="The ASGI app got the request (the origin: 0).")
    prefill_start: float | None = Field(None, description="The worker started the prefill.")
    prefill_end: float | None = Field(None, description="The prefill's last chunk finished.")
    first_token: float | None = Field(None, description="The first output token was sampled.")
    finished: float | None = Field(None, description="The last output token was sampled.")
    first_item: float | None = Field(None, description="The event loop got the first token from the worker.")
    first_event: float | None = Field(None, description="The first event was handed to the transport.")


class AbbenchDecode(_Lenient):
    """The decode steps of one request and the decode slot cache."""

    slot_hits: int | None = Field(None, description="Routed experts found in the decode slot cache.")
    slot_misses: int | None = Field(None, description="Routed experts copied into the slot cache.")
    prefetched: int | None = Field(None, description="Experts the decode prefetch copied into the slot cache ahead "
                                   "of their lookup (in decode_h2d_bytes and expert_copies; not hits or misses).")
    steps_whole: int | None = Field(None, description="Decode steps run whole (every layer's experts resident).")
    steps_per_layer: int | None = Field(None, description="Decode steps run layer by layer.")
    mode: str | None = Field(None, description="The decoder's mode.")
    kernels: str | None = Field(None, description="The decode kernels that ran (experts=..., attention=...).")
    misses: str | None = Field(None, description="Who looked up the slot cache and copied its misses: host (a "
                               "host round trip per layer) or device (kernels of the step); none when resident.")
    slots_per_layer: int | None = Field(None, description="Decode slot cache size per layer.")


class AbbenchStats(_Lenient):
    """What the engine did for one request: its prefill path, its byte counters, its timings."""

    prefill_path: str | None = Field(None, description="The prefill mode that ran (chunked, layer-major, ...).")
    fallback_reason: str | None = Field(None, description="Why the requested path did not run, if it did not.")
    h2d_bytes: int | None = Field(None, description="Host-to-device bytes of the whole request.")
    d2d_bytes: int | None = Field(None, description="Device-to-device bytes of the whole request.")
    prefill_h2d_bytes: int | None = Field(None, description="Host-to-device bytes of the prefill.")
    decode_h2d_bytes: int | None = Field(None, description="Host-to-device bytes of the decode.")
    bank_bytes: int | None = Field(None, description="Bytes of one bank (every layer's experts).")
    expert_format: str | None = Field(None, description="How the host bank stores the experts (the compute dtype, "
                                      "or fp8-e4m3 with per-row scales: copies move its bytes, scales included).")
    expert_copies: int | None = Field(None, description="Expert copies to the device.")
    cached_prompt_tokens: int | None = Field(None, description="Prompt tokens served from the prefix cache.")
    n_chunks: int | None = Field(None, description="Prefill chunks (1: a one-chunk prompt).")
    n_windows: int | None = Field(None, description="Layer-major windows (one bank copy each).")
    measured_h2d_gbps: float | None = Field(None, description="The engine's measured H2D bandwidth (GB/s).")
    timings: AbbenchTimings = Field(default_factory=AbbenchTimings)
    queue_wait_s: float | None = Field(None, description="Seconds the request waited for the worker.")
    decode: AbbenchDecode | None = Field(None, description="Decode steps and the slot cache (newer engines).")
    peak_device_bytes: int | None = Field(None, description="Peak device memory during the request.")
    start_device_bytes: int | None = Field(None, description="Device memory allocated when the request started: "
                                           "what the engine holds between requests (weights, caches, buffers); "
                                           "peak - start is what the request itself added.")
    chunk_tokens: int | None = Field(None, description="The prefill chunk length this request ran with.")
    alloc_retries: int | None = Field(None, description="CUDA caching-allocator retries during the request (it "
                                      "freed its cache and called cudaMalloc again: a sign of memory pressure).")
    copy_wait_s: float | None = Field(None, description="Prefill: GPU time the compute stream waited for "
                                      "streamed expert copies (CUDA timing events; None off CUDA).")
    first_layer_primed: bool | None = Field(None, description="Prefill: the first layer's bank copy had started "
                                            "when the request arrived, at an idle engine (--no-prime-first-layer "
                                            "turns it off), and this prefill took it instead of copying again.")
    prefill_graph_replays: int | None = Field(None, description="Prefill layer half-steps replayed from CUDA "
                                              "graphs (0: every step ran eagerly).")
    attention_batch: int | None = Field(None, description="Layer-major: chunks per attention call asked for.")
    attention_batched: int | None = Field(None, description="Attention groups of attention_batch chunks that ran "
                                          "as one call.")
    attention_fallbacks: dict[str, int] | None = Field(
        None, description="Attention groups that ran one call per chunk instead, by reason (not-bit-identical, "
        "window-end, short-chunk, long-context); None when no batching was asked for.")
    auto: dict[str, Any] | None = Field(
        None, description="prefill_mode auto: {path, reason, routing (uniform|observed), estimates_s per path, and "
        "with calibration calibrated_s per path and calibration {demand_copies_factor, demand_prefills}} "
        "(abbench.engine.runtime.policy); None for requests that named their mode.")
    prefill_batch: int | None = Field(None, description="Prompts prefilled together with this one, itself included "
                                      "(the vendored engine batches queued layer-major prompts: one bank stream per "
                                      "window for all of them; the bytes and windows above are the batch's).")
    layer_trace: list[dict[str, Any]] | None = Field(
        None, description="With trace_layers: per layer and sub-block {layer, block, hash, rms, values} of the last "
        "prompt position (abbench.engine.ops.trace)."
    )
    full_logprobs: str | None = Field(
        None, description="With full_logprobs: the first output position's log-probabilities over the whole "
        "vocabulary, base64 float32 little-endian (abbench.engine.ops.sampling; what `abbench probe --numerics` "
        "compares exactly).")

    @property
    def engine_ttft_s(self) -> float | None:
        """The engine's own time to first token: first_token - received."""
        t = self.timings
        return None if t.first_token is None else t.first_token - (t.received or 0.0)

    @property
    def prefill_s(self) -> float | None:
        t = self.timings
        return None if t.prefill_start is None or t.prefill_end is None else t.prefill_end - t.prefill_start
