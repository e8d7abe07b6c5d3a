"""Any client can drive the engine: ``/v1/chat/completions`` (the conversation rendered by the model's chat
template, then served as a completion: same ids, native ``token_ids``, usage, logprobs in chat's shape, streamed or
whole) and the sampling fields common clients send at their neutral values (``vllm bench serve`` sends
``repetition_penalty`` 1.0 with every completion), refused with the field's name at any other value. The real tiny
engine on CPU behind a real server on loopback."""

from __future__ import annotations

import json

import httpx
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("fastapi")

from abbench.engine.config import EngineConfig  # noqa: E402
from abbench.engine.runtime.engine import Engine  # noqa: E402
from abbench.engine.serve.chat import ChatMessage, render  # noqa: E402
from abbench.engine.serve.server import create_app  # noqa: E402
from abbench.engine.serve.tokenizer import load_tokenizer  # noqa: E402
from tests.support.uvicorn_thread import ServerThread  # noqa: E402

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime."}]


@pytest.fixture(scope="module")
def served():
    tok = load_tokenizer("qwen3")
    engine = Engine(EngineConfig(model="tiny", weights="random:0", device="cpu", chunk_tokens=16, max_context=256))
    server = ServerThread(create_app(engine, tok, served_model_name="tiny"))
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client, tok
    server.stop()


def events(r: httpx.Response) -> list[dict]:
    out = []
    for line in r.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    assert r.text.rstrip().endswith("data: [DONE]")
    return out


def test_the_conversation_is_rendered_as_chatml_for_the_builtin_vocabulary() -> None:
    text = render([ChatMessage(**m) for m in MESSAGES], load_tokenizer("qwen3"))
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nName a prime.<|im_end|>\n"
                    "<|im_start|>assistant\n")
    parts = render([ChatMessage(role="user", content=[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}])],
                   load_tokenizer("qwen3"))
    assert "<|im_start|>user\nab<|im_end|>" in parts


def test_chat_is_the_completion_of_the_rendered_conversation(served) -> None:
    client, tok = served
    prompt = render([ChatMessage(**m) for m in MESSAGES], tok)
    comp = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0,
                                                "ignore_eos": True}).json()
    chat = client.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_completion_tokens": 6,
                                                     "temperature": 0, "ignore_eos": True, "logprobs": True,
                                                     "top_logprobs": 2})
    assert chat.status_code == 200, chat.text
    body = chat.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["token_ids"] == comp["choices"][0]["token_ids"] and len(choice["token_ids"]) == 6
    assert choice["message"] == {"role": "assistant", "content": comp["choices"][0]["text"]}
    assert body["usage"]["prompt_tokens"] == len(tok.encode(prompt)) and body["usage"]["completion_tokens"] == 6
    content = choice["logprobs"]["content"]
    assert len(content) == 6 and all(len(c["top_logprobs"]) == 2 for c in content)
    assert [c["top_logprobs"][0]["id"] for c in content] == choice["token_ids"]  # greedy: the best is chosen


def test_chat_streams_a_role_then_one_delta_a_token_then_usage(served) -> None:
    client, _tok = served
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 5, "temperature": 0,
                                                  "ignore_eos": True, "stream": True,
                                                  "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    evs = events(r)
    assert all(e["object"] == "chat.completion.chunk" for e in evs)
    assert evs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    ids = [i for e in evs for c in e["choices"] for i in c.get("token_ids", [])]
    assert len(ids) == 5 and [c["finish_reason"] for c in evs[-2]["choices"]] == ["length"]
    assert evs[-1]["choices"] == [] and evs[-1]["usage"]["completion_tokens"] == 5 and "abbench" in evs[-1]
    whole = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 5, "temperature": 0,
                                                      "ignore_eos": True}).json()
    text = "".join(c["delta"].get("content", "") for e in evs for c in e["choices"])
    assert whole["choices"][0]["token_ids"] == ids and whole["choices"][0]["message"]["content"] == text


@pytest.mark.parametrize("field, neutral", [("repetition_penalty", 1.0), ("presence_penalty", 0), ("frequency_penalty", 0.0),
                                            ("top_k", -1), ("min_p", 0), ("best_of", 1), ("logit_bias", {})])
def test_neutral_sampling_fields_are_accepted_and_others_refused(served, field, neutral) -> None:
    client, _tok = served
    ok = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 1, "temperature": 0, field: neutral})
    assert ok.status_code == 200, ok.text
    bad = {"repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": -1, "top_k": 5, "min_p": 0.1,
           "best_of": 2, "logit_bias": {"11": 5.0}}[field]
    for path, body in (("/v1/completions", {"prompt": "Hello"}), ("/v1/chat/completions", {"messages": MESSAGES})):
        r = client.post(path, json={**body, "max_tokens": 1, field: bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        assert "is supported" in r.json()["error"]["message"]


def test_chat_refuses_what_it_cannot_serve(served) -> None:
    client, _tok = served
    for body, param in (({"messages": []}, "messages"), ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
                        ({"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
                        ({"messages": MESSAGES, "tools": []}, "tools")):
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_the_official_openai_client_drives_both_apis(served) -> None:
    openai = pytest.importorskip("openai")
    client, _tok = served
    oc = openai.OpenAI(base_url=str(client.base_url) + "/v1", api_key="unused")
    comp = oc.completions.create(model="tiny", prompt="Hello", max_tokens=3, temperature=0, logprobs=2)
    assert len(comp.choices[0].logprobs.tokens) == 3
    chat = oc.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 3
    stream = oc.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3, temperature=0, stream=True,
                                        stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 3
