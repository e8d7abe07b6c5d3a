"""Per-request engine statistics: the ``abbench`` object of the vendored engine's completion responses.

The engine's server fills a :class:`RequestStats` for every finished request (the last streamed event, or
the non-streamed body, carries it as ``"abbench"``); the harness keeps it verbatim in ``Sample.engine`` and
reads it back with :meth:`RequestStats.read`. This module imports only pydantic: the harness reads it
without torch, and it imports nothing from the harness.

Reading is lenient: a field that is missing, or that holds a value of another type, reads as None, and
fields this model does not name are kept (``extra="allow"``: other engines' objects, such as the
``engine_prompt_tokens`` the adapters add, and fields a newer engine adds), so every ``run.json`` loads.
New fields are optional (default None) so that older results still read.

Timings are seconds relative to ``received`` (when the server's ASGI app got the request), so
``first_token`` is the engine's own time to first token.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")

    @classmethod
    def read(cls, obj: Any) -> Any:
        """The model from a recorded object; fields that do not validate read as None (never raises)."""
        if not isinstance(obj, dict):
            return cls()
        data = dict(obj)
        for name, field in cls.model_fields.items():
            if isinstance(field.annotation, type) and issubclass(field.annotation, _Lenient) and name in data:
                data[name] = field.annotation.read(data[name])
        for _ in range(len(cls.model_fields) + 1):
            try:
                return cls.model_validate(data)
            except ValidationError as e:
                for err in e.errors():
                    data[err["loc"][0]] = None
        return cls()


class RequestTimings(_Lenient):
    """Seconds after ``received`` (None: that point was not reached or not measured)."""

    received: float | None = Field(0.0, description="The ASGI app got the request (the origin: 0).")
    prefill_start: float | None = Field(None, description="The worker started the prefill.")
    prefill_end: float | None = Field(None, description="The prefill's last chunk finished.")
    first_token: float | None = Field(None, description="The first output token was sampled.")
    finished: float | None = Field(None, description="The last output token was sampled.")
    first_item: float | None = Field(None, description="The event loop got the first token from the worker.")
    first_event: float | None = Field(None, description="The first event was handed to the transport.")


class RequestStats(_Lenient):
    """What the engine did for one request: its prefill path, its byte counters, its timings."""

    prefill_path: str | None = Field(None, description="The prefill mode that ran (chunked, layer-major, ...).")
    fallback_reason: str | None = Field(None, description="Why the requested path did not run, if it did not.")
    h2d_bytes: int | None = Field(None, description="Host-to-device bytes of the whole request.")
    d2d_bytes: int | None = Field(None, description="Device-to-device bytes of the whole request.")
    prefill_h2d_bytes: int | None = Field(None, description="Host-to-device bytes of the prefill.")
    decode_h2d_bytes: int | None = Field(None, description="Host-to-device bytes of the decode.")
    bank_bytes: int | None = Field(None, description="Bytes of one bank (every layer's experts).")
    expert_copies: int | None = Field(None, description="Expert copies to the device.")
    cached_prompt_tokens: int | None = Field(None, description="Prompt tokens served from the prefix cache.")
    n_chunks: int | None = Field(None, description="Prefill chunks (1: a one-chunk prompt).")
    n_windows: int | None = Field(None, description="Layer-major windows (one bank copy each).")
    measured_h2d_gbps: float | None = Field(None, description="The engine's measured H2D bandwidth (GB/s).")
    timings: RequestTimings = Field(default_factory=RequestTimings)
    queue_wait_s: float | None = Field(None, description="Seconds the request waited for the worker.")

    @property
    def engine_ttft_s(self) -> float | None:
        """The engine's own time to first token: first_token - received."""
        t = self.timings
        return None if t.first_token is None else t.first_token - (t.received or 0.0)

    @property
    def prefill_s(self) -> float | None:
        t = self.timings
        return None if t.prefill_start is None or t.prefill_end is None else t.prefill_end - t.prefill_start
