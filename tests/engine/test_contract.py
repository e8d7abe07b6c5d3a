"""The backend contract (abbench.engine.contract): one typed request from the HTTP body to the backend, each
per-request engine knob declared once.

No engine is started here: the request, the API schema built from it and the checks every backend shares.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

pytest.importorskip("fastapi")

from abbench.engine.contract import (  # noqa: E402
    ContextOverflow, GenerateRequest, check_request, override,
)
from abbench.engine.serve.api import NEUTRAL, APIError, CompletionRequest, completion_schema, decode_request  # noqa: E402


def test_the_api_declares_exactly_the_contracts_overrides() -> None:
    """Every override of the request is a field of the body's schema with its description, and nothing else of
    the schema is an engine knob: the schema is built from the contract, not written beside it."""
    overrides = GenerateRequest.overrides()
    assert list(overrides) == ["prefill_mode", "chunk_tokens", "attention_batch", "decode_misses", "trace_layers",
                              "full_logprobs"]
    fields = CompletionRequest.model_fields
    for name, o in overrides.items():
        assert fields[name].default is None and fields[name].description.startswith(o.doc)
    openai = {"model", "prompt", "max_tokens", "temperature", "seed", "ignore_eos", "stream", "stream_options",
              "logprobs", "n", "top_p", "stop", "echo", "user"}
    assert set(fields) == openai | set(NEUTRAL) | set(overrides)  # NEUTRAL: sampling fields at neutral values only


def test_a_new_knob_is_one_field_of_the_request() -> None:
    """A request type with one more override: the body's schema takes it (typed, with its limits), the request
    built from the parsed body carries it, and it counts as overridden; nothing else was written for it."""

    @dataclasses.dataclass(frozen=True)
    class WithKnob(GenerateRequest):
        warp_factor: int | None = override("How fast.", "int", ge=1, le=9)

    schema = completion_schema(WithKnob)
    body = schema.model_validate({"prompt": [1, 2], "max_tokens": 3, "warp_factor": 7})
    req = WithKnob.build([1, 2], body)
    assert req.warp_factor == 7 and req.max_tokens == 3 and req.overridden() == ["warp_factor"]
    with pytest.raises(Exception, match="less than or equal to 9"):
        schema.model_validate({"prompt": [1], "warp_factor": 10})
    assert WithKnob.build([1], schema.model_validate({"prompt": [1]})).overridden() == []


def test_the_request_built_from_a_body_takes_the_contracts_defaults_for_nulls() -> None:
    body = decode_request(json.dumps({"prompt": "hi", "max_tokens": None, "temperature": 0, "trace_layers": None,
                                      "chunk_tokens": 64}).encode())
    req = GenerateRequest.build([5, 6], body)
    assert req == GenerateRequest(prompt_ids=[5, 6], max_tokens=16, temperature=0.0, chunk_tokens=64)
    assert req.overridden() == ["chunk_tokens"] and req.trace_layers is False
    with pytest.raises(APIError):
        decode_request(json.dumps({"prompt": "hi", "decode_misses": "auto"}).encode())  # the engine's, not a request's


@pytest.mark.parametrize(("fields", "error", "match"), [
    ({"prompt_ids": []}, ValueError, "empty"),
    ({"prompt_ids": [1, 100]}, ValueError, r"\[0, 100\)"),
    ({"prompt_ids": [1], "max_tokens": 0}, ValueError, "max_tokens"),
    ({"prompt_ids": [1] * 10, "max_tokens": 7}, ContextOverflow, "17 tokens exceeds max_context 16"),
    ({"prompt_ids": [1], "max_tokens": 2, "logprobs": 101}, ValueError, "logprobs"),
    ({"prompt_ids": [1], "max_tokens": 2, "temperature": -1.0}, ValueError, "temperature"),
])
def test_check_request_refuses_before_any_work(fields, error, match) -> None:
    with pytest.raises(error, match=match):
        check_request(GenerateRequest(**fields), vocab=100, max_context=16)
    assert check_request(GenerateRequest([3, 4], 2), vocab=100, max_context=16) == [3, 4]
