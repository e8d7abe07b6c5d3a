"""The vendored engine's HTTP API: the request schema, API errors in OpenAI's shape, and the pieces of a
response (usage, logprobs, SSE framing, the per-request ``abbench`` object).

No routes and no queue here: :mod:`abbench.engine.serve.serving` runs requests on the engine one at a time,
:mod:`abbench.engine.serve.server` routes HTTP requests to it. The ``abbench`` object is
:class:`abbench.engine.stats.AbbenchStats`, the model the harness reads back.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import (
    BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, ValidationError, create_model, field_validator,
)

from abbench.engine.contract import BackendInfo, ContextOverflow, GenerateRequest, Override, RequestStats
from abbench.engine.stats import AbbenchDecode, AbbenchStats, AbbenchTimings

log = logging.getLogger("abbench.engine.serve.server")

MIN_TEMPERATURE = 1e-5  # below it (and above 0), logits / temperature overflows float32 to inf -> NaN probs


# ------------------------------------------------------------------------------------------ request schema


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = Field(False, description="Send a final chunk with choices [] and usage.")


NEUTRAL: dict[str, tuple[Any, ...]] = {
    "repetition_penalty": (1, 1.0), "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0),
    "top_k": (-1, 0), "min_p": (0, 0.0), "best_of": (1,), "logit_bias": ({},), "suffix": ("",),
}
"""Sampling fields common clients send with every request (``vllm bench serve`` sends ``repetition_penalty`` 1.0,
OpenAI's SDK may send the penalties), accepted at their neutral values (or null) and refused otherwise, since this
engine samples with temperature and seed alone."""


class NeutralSampling(BaseModel):
    """The fields of :data:`NEUTRAL`: null or their neutral value, else a 400 naming the field."""

    model_config = ConfigDict(extra="forbid")

    repetition_penalty: StrictFloat | StrictInt | None = Field(None, description="Must be 1 (no penalty).")
    presence_penalty: StrictFloat | StrictInt | None = Field(None, description="Must be 0.")
    frequency_penalty: StrictFloat | StrictInt | None = Field(None, description="Must be 0.")
    top_k: StrictInt | None = Field(None, description="Must be -1 or 0 (every token).")
    min_p: StrictFloat | StrictInt | None = Field(None, description="Must be 0.")
    best_of: StrictInt | None = Field(None, description="Must be 1.")
    logit_bias: dict[str, float] | None = Field(None, description="Must be empty.")
    suffix: str | None = Field(None, description="Must be empty.")

    @field_validator(*NEUTRAL)
    @classmethod
    def _neutral(cls, v: Any, info: Any) -> Any:
        allowed = NEUTRAL[info.field_name]
        if v is not None and (isinstance(v, bool) or v not in allowed):
            raise ValueError(f"only {_said(allowed)} is supported (this engine samples with temperature and seed "
                             "alone)")
        return v


def _said(allowed: tuple[Any, ...]) -> str:
    """'1', '-1 or 0', '{}': the neutral values as a user would write them."""
    out: list[str] = []
    for a in allowed:
        text = json.dumps(a) if not isinstance(a, float) else f"{a:g}"
        if text not in out:
            out.append(text)
    return " or ".join(out)


class OpenAICompletion(NeutralSampling):
    """The OpenAI fields of a ``POST /v1/completions`` body (:data:`CompletionRequest` adds the engine's
    overrides). Unknown fields are refused; a few harmless OpenAI fields are accepted only at their neutral
    values (``n``=1, ``top_p``=1, ``stop`` null, ``echo`` false, ``user``, and :data:`NEUTRAL`'s)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="Must equal the served model name when given.")
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]] = Field(
        ..., description="Text, or token ids; a list holding one of either is accepted too (no batches)."
    )
    max_tokens: StrictInt | None = Field(16, gt=0, description="Output tokens to generate (null -> 16).")
    temperature: StrictFloat = Field(1.0, ge=0.0, allow_inf_nan=False,
                                     description="0 = greedy; >0 seeded sampling (OpenAI's default is 1). "
                                     f"Between 0 and {MIN_TEMPERATURE:g}: refused (logits / t overflow).")
    seed: StrictInt | None = Field(None, ge=-(2**63), le=2**64 - 1,
                                   description="Sampling seed, a 64-bit integer (only used when temperature > 0).")
    ignore_eos: StrictBool = Field(False, description="Keep generating past the EOS token.")
    stream: StrictBool = Field(False, description="Stream SSE chunks, one per output token.")
    stream_options: StreamOptions | None = Field(None, description="OpenAI stream options.")
    logprobs: StrictInt | None = Field(None, ge=0, le=20, description="Top-k logprobs per output token.")
    # Accepted and ignored at their neutral values only.
    n: StrictInt | None = Field(None, description="Must be 1.")
    top_p: StrictFloat | None = Field(None, description="Must be 1.")
    stop: None = Field(None, description="Must be null.")
    echo: StrictBool | None = Field(None, description="Must be false.")
    user: str | None = Field(None, description="Ignored.")

    @field_validator("temperature")
    @classmethod
    def _temperature_not_tiny(cls, v: float) -> float:
        if 0.0 < v < MIN_TEMPERATURE:
            raise ValueError(f"must be 0 (greedy) or at least {MIN_TEMPERATURE:g} (got {v:g}: logits / temperature "
                             "would overflow)")
        return v

    @field_validator("n")
    @classmethod
    def _n_is_one(cls, v: int | None) -> int | None:
        if v not in (None, 1):
            raise ValueError("only n=1 is supported")
        return v

    @field_validator("top_p")
    @classmethod
    def _top_p_is_one(cls, v: float | None) -> float | None:
        if v not in (None, 1.0):
            raise ValueError("only top_p=1 is supported")
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("echo is not supported")
        return v

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request; raises APIError for batches and empty prompts."""
        p = self.prompt
        if isinstance(p, list) and p and not isinstance(p[0], int):
            if len(p) != 1:
                raise APIError(400, f"batched prompts are not supported (got {len(p)}); send one per request",
                               param="prompt")
            p = p[0]
        if len(p) == 0:
            raise APIError(400, "prompt is empty", param="prompt")
        return p


def override_field(o: Override) -> tuple[Any, Any]:
    """The schema of one engine override (:meth:`abbench.engine.contract.GenerateRequest.overrides`): its type
    (null allowed: the server's own) and its limits and description."""
    kind = {"int": StrictInt, "flag": StrictBool, "choice": Literal[o.choices]}[o.kind]
    limits = {k: v for k, v in (("gt", o.gt), ("ge", o.ge), ("le", o.le)) if v is not None}
    gate = " Needs --allow-request-overrides." if o.gated else ""
    return kind | None, Field(None, description=f"{o.doc}{gate}", **limits)


def completion_schema(request_type: type[GenerateRequest] = GenerateRequest) -> type[OpenAICompletion]:
    """The ``POST /v1/completions`` body's model: the OpenAI fields and one field per override of
    ``request_type`` (:meth:`~abbench.engine.contract.GenerateRequest.overrides`), so a new per-request knob is
    declared once, in the contract."""
    return create_model(
        "CompletionRequest", __base__=OpenAICompletion, __doc__="``POST /v1/completions`` body: the OpenAI fields "
        "and the engine's per-request overrides.",
        **{name: override_field(o) for name, o in request_type.overrides().items()})


CompletionRequest = completion_schema()


# ------------------------------------------------------------------------------------------------- errors


_ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
                413: "invalid_request_error", 429: "rate_limit_error", 499: "client_closed_request",
                500: "server_error", 503: "server_error"}


class APIError(Exception):
    """An error that becomes an OpenAI-shaped JSON response."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": _ERROR_TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def validation_error(exc: ValidationError) -> APIError:
    """The first problem of a request body, named by its field (``param``)."""
    first = exc.errors()[0]
    loc = [str(x) for x in first["loc"]]
    if first["type"] == "extra_forbidden":
        return APIError(400, f"unknown field '{'.'.join(loc)}'", param=".".join(loc), code="unknown_field")
    if loc and loc[0] == "prompt":  # a union: pydantic reports every alternative; say it plainly
        return APIError(400, "prompt must be a string, a list of token ids (integers), or a list holding "
                        "one of either", param="prompt", code="invalid_value")
    return APIError(400, f"{'.'.join(loc)}: {first['msg']}", param=".".join(loc) or None, code="invalid_value")


def engine_error(exc: BaseException) -> APIError:
    """Map an exception raised by the engine (before the response started) to an APIError."""
    import torch  # deferred: the schema and the response pieces load without it

    if isinstance(exc, ContextOverflow):
        return APIError(400, f"prompt does not fit the context: {exc}", param="prompt",
                        code="context_length_exceeded")
    if isinstance(exc, torch.OutOfMemoryError):
        return APIError(503, f"device out of memory while serving this request: {exc}", code="out_of_memory")
    if isinstance(exc, ValueError):
        return APIError(400, str(exc), code="invalid_value")
    log.exception("engine failed", exc_info=exc)
    return APIError(500, f"engine error: {type(exc).__name__}: {exc}", code="engine_error")


def reject_constant(token: str) -> Any:
    """``json.loads(parse_constant=...)``: NaN and Infinity are not JSON."""
    raise ValueError(f"{token} is not valid JSON")


def decode_request(body: bytes) -> CompletionRequest:
    """The request body as a :class:`CompletionRequest`; raises :class:`APIError` (400) naming the problem."""
    try:
        obj = json.loads(body, parse_constant=reject_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:  # e.g. "[[[[..." a few thousand deep: valid JSON but too deep to decode
        raise APIError(400, "request body is nested too deeply to decode", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    try:
        return CompletionRequest.model_validate(obj)
    except ValidationError as exc:
        raise validation_error(exc) from None


# --------------------------------------------------------------------------------------- response pieces


@dataclass
class RequestContext:
    """What one completion request carries from parsing to its last byte."""

    rid: str
    created: int
    model: str
    received: float
    queue_wait_s: float = 0.0
    logprobs: int | None = None
    first_event: float | None = None  # streamed: perf_counter when the first event reached the transport
    first_item: float | None = None  # perf_counter when the event loop got the first token from the worker


SAME_NAMED = ("prefill_path", "fallback_reason", "h2d_bytes", "d2d_bytes", "prefill_h2d_bytes", "decode_h2d_bytes",
              "bank_bytes", "expert_copies", "cached_prompt_tokens", "n_chunks", "n_windows", "peak_device_bytes",
              "start_device_bytes", "chunk_tokens", "alloc_retries", "prefill_graph_replays", "attention_batch",
              "attention_batched", "attention_fallbacks", "auto", "layer_trace", "full_logprobs", "prefill_batch",
              "first_layer_primed")
"""The fields of the ``abbench`` object that are the request's stats of the same name, as they are."""


def abbench_object(ctx: RequestContext, stats: RequestStats, finished: float, info: BackendInfo) -> dict[str, Any]:
    """The response's ``abbench`` object (:class:`~abbench.engine.stats.AbbenchStats`) from the runtime's
    per-request stats; timings in seconds after ``received``."""

    def rel(t: float | None) -> float | None:
        return None if t is None else round(t - ctx.received, 6)

    return AbbenchStats(
        **{name: getattr(stats, name) for name in SAME_NAMED},
        measured_h2d_gbps=finite(info.measured_h2d_gbps), expert_format=info.expert_format,
        timings=AbbenchTimings(received=0.0, prefill_start=rel(stats.prefill_start),
                               prefill_end=rel(stats.prefill_end), first_token=rel(stats.first_token),
                               finished=rel(finished), first_item=rel(ctx.first_item),
                               first_event=rel(ctx.first_event)),
        queue_wait_s=round(ctx.queue_wait_s, 6),
        decode=AbbenchDecode(slot_hits=stats.slot_hits, slot_misses=stats.slot_misses,
                             prefetched=stats.decode_prefetched,
                             steps_whole=stats.decode_steps_whole, steps_per_layer=stats.decode_steps_per_layer,
                             mode=info.decode_mode, kernels=info.decode_kernels, misses=stats.decode_misses,
                             slots_per_layer=info.slots_per_layer),
        copy_wait_s=(None if stats.copy_wait_s is None else round(stats.copy_wait_s, 6)),
    ).model_dump()


def usage(stats: RequestStats) -> dict[str, Any]:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.completion_tokens,
            "total_tokens": stats.prompt_tokens + stats.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": stats.cached_prompt_tokens}}


def logprobs_block(tokenizer: Any, events: list[Any], offset0: int = 0) -> dict[str, Any]:
    """OpenAI completions logprobs for ``events`` plus ``top_logprob_ids`` (texts can collide)."""
    tokens, token_logprobs, top, top_ids, offsets = [], [], [], [], []
    offset = offset0
    for ev in events:
        text = tokenizer.decode([ev.token_id])
        tokens.append(text)
        token_logprobs.append(finite(ev.logprob))
        pairs = [(int(i), finite(lp)) for i, lp in (ev.top_logprobs or [])]
        top.append({tokenizer.decode([i]): lp for i, lp in pairs})
        top_ids.append([[i, lp] for i, lp in pairs])
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
            "text_offset": offsets, "top_logprob_ids": top_ids}


def finite(x: float | None) -> float | None:
    """JSON has no -inf/NaN: a logprob that is not finite is sent as null."""
    return None if x is None or not math.isfinite(x) else float(x)


def sse_event(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
