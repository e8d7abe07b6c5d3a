"""``POST /v1/chat/completions``: OpenAI's chat API over the same engine, so chat clients and the load tools that
speak chat (``vllm bench serve --backend openai-chat``, guidellm, AIPerf) can drive it.

A chat request is a completion request whose prompt is the conversation rendered by the model's chat template
(:func:`render`): a Hugging Face tokenizer directory's own ``chat_template`` when it has one, else the ChatML
layout of the Qwen chat templates (``<|im_start|>ROLE\\nCONTENT<|im_end|>\\n`` per message, then
``<|im_start|>assistant\\n``), which is what the built-in Qwen vocabularies' models expect for plain text
messages. :func:`decode_chat` parses the body and returns the :class:`~abbench.engine.serve.api.CompletionRequest`
the server runs (so every knob, override and check is the completions path's), and the rendered text.
:class:`ChatFormat` shapes the answer: ``chat.completion`` (one ``message``) or a stream of
``chat.completion.chunk`` events (a first ``delta`` with the role, one ``delta.content`` per output token, a last
one with the finish reason, usage with ``stream_options.include_usage``), each choice carrying the engine's native
``token_ids`` as the completions API does, and the ``abbench`` object in the last event. Logprobs in chat's shape:
``logprobs: true`` with ``top_logprobs: k`` (0-20).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError, create_model

from abbench.engine.contract import GenerateRequest
from abbench.engine.serve.api import (
    APIError, CompletionRequest, NeutralSampling, finite, override_field, reject_constant, validation_error,
)

CHATML_START, CHATML_END = "<|im_start|>", "<|im_end|>"


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: str = Field(..., pattern="^text$", description="Only text parts.")
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")  # name, tool_calls, ...: not used by a plain-text template
    role: str = Field(..., pattern="^(system|developer|user|assistant)$")
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class OpenAIChat(NeutralSampling):
    """The OpenAI fields of a chat request that this engine serves (unknown fields are refused)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: StrictInt | None = Field(None, gt=0, description="Deprecated by OpenAI; max_completion_tokens wins.")
    max_completion_tokens: StrictInt | None = Field(None, gt=0)
    temperature: float = Field(1.0, ge=0.0, allow_inf_nan=False)
    seed: StrictInt | None = None
    ignore_eos: StrictBool = False
    stream: StrictBool = False
    stream_options: dict[str, StrictBool] | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    n: StrictInt | None = None
    top_p: float | None = None
    stop: None = None
    user: str | None = None


ChatRequest = create_model(
    "ChatRequest", __base__=OpenAIChat, __doc__="``POST /v1/chat/completions`` body: the OpenAI fields and the "
    "engine's per-request overrides.",
    **{name: override_field(o) for name, o in GenerateRequest.overrides().items()})


def render(messages: list[ChatMessage], tokenizer: Any) -> str:
    """The conversation as the prompt text, ending where the assistant's answer starts (module docstring)."""
    simple = [{"role": m.role, "content": m.text()} for m in messages]
    hf = getattr(tokenizer, "hf", None)
    if hf is not None and getattr(hf, "chat_template", None):
        return str(hf.apply_chat_template(simple, add_generation_prompt=True, tokenize=False))
    return "".join(f"{CHATML_START}{m['role']}\n{m['content']}{CHATML_END}\n" for m in simple) + \
        f"{CHATML_START}assistant\n"


def decode_chat(body: bytes, tokenizer: Any) -> tuple[CompletionRequest, Any]:
    """The chat body as the completion request the server runs, and the parsed chat request; :class:`APIError`
    (400) naming the problem."""
    try:
        obj = json.loads(body, parse_constant=reject_constant)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    try:
        chat = ChatRequest.model_validate(obj)
        if chat.top_logprobs is not None and not chat.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
        fields = {k: v for k, v in chat.model_dump().items()
                  if k in CompletionRequest.model_fields and k not in ("logprobs", "stream_options", "max_tokens")}
        fields.update(prompt=render(chat.messages, tokenizer),
                      max_tokens=chat.max_completion_tokens or chat.max_tokens or None,
                      logprobs=(chat.top_logprobs or 0) if chat.logprobs else None,
                      stream_options=chat.stream_options)
        return CompletionRequest.model_validate(fields), chat
    except ValidationError as exc:
        raise validation_error(exc) from None


class CompletionFormat:
    """How ``/v1/completions`` answers (the text-completion shapes)."""

    object, chunk = "text_completion", "text_completion"

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def opening(self) -> list[dict[str, Any]]:
        return []

    def token_choice(self, piece: str, token_id: int, lp: dict[str, Any] | None) -> dict[str, Any]:
        return {"index": 0, "text": piece, "finish_reason": None, "logprobs": lp, "token_ids": [int(token_id)]}

    def last_choice(self, rest: str, finish_reason: str) -> dict[str, Any]:
        return {"index": 0, "text": rest, "finish_reason": finish_reason, "logprobs": None, "token_ids": []}

    def whole_choice(self, text: str, finish_reason: str, lp: dict[str, Any] | None, ids: list[int]) -> dict[str, Any]:
        return {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": lp, "token_ids": ids}

    def logprobs(self, block: dict[str, Any]) -> dict[str, Any]:
        return block


class ChatFormat(CompletionFormat):
    """How ``/v1/chat/completions`` answers (module docstring)."""

    object, chunk = "chat.completion", "chat.completion.chunk"

    def opening(self) -> list[dict[str, Any]]:
        return [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None,
                 "token_ids": []}]

    def token_choice(self, piece: str, token_id: int, lp: dict[str, Any] | None) -> dict[str, Any]:
        return {"index": 0, "delta": {"content": piece}, "logprobs": lp, "finish_reason": None,
                "token_ids": [int(token_id)]}

    def last_choice(self, rest: str, finish_reason: str) -> dict[str, Any]:
        return {"index": 0, "delta": {"content": rest} if rest else {}, "logprobs": None,
                "finish_reason": finish_reason, "token_ids": []}

    def whole_choice(self, text: str, finish_reason: str, lp: dict[str, Any] | None, ids: list[int]) -> dict[str, Any]:
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                "finish_reason": finish_reason, "token_ids": ids}

    def logprobs(self, block: dict[str, Any]) -> dict[str, Any]:
        """A completions logprobs block (:func:`~abbench.engine.serve.api.logprobs_block`) in chat's shape."""
        content = []
        for tok, lp, ids in zip(block["tokens"], block["token_logprobs"], block["top_logprob_ids"]):
            top = [{"token": self.tokenizer.decode([i]), "logprob": finite(x), "id": i,
                    "bytes": list(self.tokenizer.decode([i]).encode())} for i, x in ids]
            content.append({"token": tok, "logprob": lp, "bytes": list(tok.encode()), "top_logprobs": top})
        return {"content": content}


__all__ = ["ChatFormat", "ChatMessage", "ChatRequest", "CompletionFormat", "OpenAIChat", "decode_chat", "render"]
