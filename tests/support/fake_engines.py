"""Loopback fakes of vLLM, SGLang and llama.cpp's server, each speaking that engine's documented wire format.

They exist so the client's adapters and the runner can be tested end to end over real HTTP without the
engines. Each is a stdlib ``ThreadingHTTPServer`` (HTTP/1.1, keep-alive, chunked SSE), usable in-process::

    with FakeEngine(FakeEngineConfig("sglang")) as eng:
        eng.base_url, eng.stats()

or as an engine service (what the runner launches)::

    python tests/support/fake_engines.py --engine {vllm,sglang,llamacpp} --port N [--tokenizer qwen3]
        [--incremental-streaming-output] [--enable-metrics]          (sglang)
        [--slot-save-path DIR] [--metrics] [-np 1]                   (llama.cpp)
    (vLLM's dev routes, /reset_prefix_cache, answer only with VLLM_SERVER_DEV_MODE=1 in the environment)

The "model": prompt token ids come from a real tokenizer (default ``qwen3``, so the harness's exact-length
prompts are counted as it built them). It is autoregressive and deterministic: the next token is a function
of the whole history (prompt and output so far; :func:`greedy`), drawn from the ids of an English sentence so
the text is readable, so a prompt extended by its own output continues the same way (what the probe relies
on). Each position's top logprobs are the chosen token at :func:`logprob_of` and alternatives 1, 2, ... nats
below. ``--flip-at-length L`` makes a near-tied choice go the other way when the history is L tokens long
(the kind of divergence two arms of one engine produce). A request field ``fake_diverge_at: K`` changes
the ids from output position K on; ``fake_hold_first_text_s: S`` sends the first token
with empty text and its text S seconds later with the second token (to test time-to-first-text);
``fake_token_delay_s`` sleeps between token events. ``fake_mode`` misbehaves on purpose: ``abort`` (SGLang:
the last event's finish reason is an abort), ``no-final`` (llama.cpp: the stream ends without its
``stop: true`` event), ``after-final`` (llama.cpp: one more event after it), ``old-stop-fields`` (llama.cpp:
``stopped_limit`` instead of ``stop_type``, as servers before late 2024). ``fake_mid_char: [j, ...]``
(llama.cpp): the tokens at those output positions end inside a UTF-8 character, as the real server (commit
0c1e570) handles them: streamed, they send no event and the next event carries their text but only its own
id; not streamed, ``completion_probabilities`` leaves them out while ``tokens`` lists every id. When the
last output token is one of them (the output ends inside a character), the stream never carries its text and
the body's ``content`` ends with U+FFFD in place of its last character, as the real server decodes the
incomplete bytes.

A prefix cache is simulated per server: a prompt reuses the longest common prefix with any prompt served
since the last reset (at most all but its last token), reported the way each engine reports it; the reset
endpoint empties it and counts resets (``GET /stats`` returns the counters as JSON).

Wire formats (what the adapters in ``abbench/client.py`` parse; the same documents are cited there):

* vLLM ``POST /v1/completions``: ``text_completion`` chunks, one per token, ``token_ids`` and (first chunk)
  ``prompt_token_ids`` with ``return_token_ids``; ``logprobs`` keyed ``token_id:N`` with
  ``return_tokens_as_token_ids``; the last token's chunk carries ``finish_reason``; with
  ``stream_options.include_usage`` a ``choices: []`` chunk with ``usage`` (and
  ``prompt_tokens_details.cached_tokens``); ``data: [DONE]``. ``POST /reset_prefix_cache`` (dev mode);
  ``/metrics``: ``vllm:prompt_tokens_total``, ``vllm:prefix_cache_queries_total``,
  ``vllm:prefix_cache_hits_total``.
* SGLang ``POST /generate``: ``{"text"|"input_ids", "sampling_params": {...}, "stream", "return_logprob",
  "top_logprobs_num"}``; events ``{"text", "output_ids", "meta_info"}``, cumulative unless
  ``--incremental-streaming-output``; ``meta_info.finish_reason`` ``{"type": "length", "length": N}`` on the
  last; ``data: [DONE]``. ``GET|POST /flush_cache``; ``/metrics`` with ``--enable-metrics``.
* llama.cpp ``POST /completion``: one event per token ``{"content", "tokens", "stop": false,
  "completion_probabilities"}``, then ``{"stop": true, "stop_type", "tokens_evaluated", "tokens_predicted",
  "timings": {"cache_n", "prompt_n", ...}}``, no ``[DONE]``. ``POST /slots/0?action=erase`` (needs
  ``--slot-save-path``, else 501 as the real server); ``/metrics`` with ``--metrics`` (else 501).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

ENGINES = ("vllm", "sglang", "llamacpp")
_SENTENCE = (
    " the quick brown fox jumps over the lazy dog while seven small birds sing about rivers mountains"
    " and old stone bridges near a quiet town"
)


@dataclass(frozen=True)
class FakeEngineConfig:
    engine: str
    model: str = "fake-model"
    tokenizer: str = "qwen3"
    vllm_dev_mode: bool = True  # vLLM: serve /reset_prefix_cache (VLLM_SERVER_DEV_MODE=1)
    sglang_incremental: bool = False  # SGLang --incremental-streaming-output
    sglang_metrics: bool = True  # SGLang --enable-metrics
    sglang_flush_busy: bool = False  # SGLang: /flush_cache answers 400, as while another client's requests run
    llamacpp_slot_save_path: str | None = "/tmp"  # llama.cpp --slot-save-path (slot actions need it)
    llamacpp_metrics: bool = True  # llama.cpp --metrics
    # llama.cpp (0c1e570) closes the connection after every streamed response, once its completion callback
    # has run, and drops a request that arrived on it meanwhile unanswered: after this many seconds (None: keep
    # the connection alive, as other servers do)
    llamacpp_close_after_stream_s: float | None = None
    token_delay_s: float = 0.0
    flip_at_length: int | None = None  # a near-tied choice flips when the history is this long

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"unknown engine {self.engine!r}; one of {', '.join(ENGINES)}")


EngineConfig = FakeEngineConfig  # the former name (not the engine's abbench.engine.EngineConfig)


# ------------------------------------------------------------------------------------------- the "model"


TOP_K = 6  # alternatives the model knows per position (vLLM sends k+1)
VOCAB_SIZE = 151936


def logprob_of(token_id: int) -> float:
    """The chosen token's logprob; alternatives j = 1, 2, ... are ``logprob_of(id) - j``."""
    return -0.05 - (token_id % 97) / 1000


def _step(h: bytes, token_id: int) -> bytes:
    return hashlib.sha256(h + token_id.to_bytes(4, "little")).digest()


def history_hash(ids: list[int], h: bytes = b"") -> bytes:
    for i in ids:
        h = _step(h, i)
    return h


def greedy(prompt_ids: list[int], n: int, choices: list[int], *, diverge_at: int | None = None,
           flip_at_length: int | None = None) -> tuple[list[int], list[list[tuple[int, float]]]]:
    """The model's greedy output of ``n`` tokens after ``prompt_ids`` and each position's top logprobs
    (best first, :data:`TOP_K` of them)."""
    h = history_hash(prompt_ids)
    ids: list[int] = []
    tops: list[list[tuple[int, float]]] = []
    for j in range(n):
        hh = hashlib.sha256(h + b"diverged").digest() if diverge_at is not None and j >= diverge_at else h
        best = choices[int.from_bytes(hh[:4], "little") % len(choices)]
        lp = logprob_of(best)
        top = [(best, lp)] + [((best + 1 + a) % VOCAB_SIZE, lp - 1.0 - a) for a in range(TOP_K - 1)]
        if flip_at_length is not None and len(prompt_ids) + j == flip_at_length:
            top = [(top[1][0], lp), (best, lp - 0.002)] + top[2:]  # a near tie that went the other way
        ids.append(top[0][0])
        tops.append(top)
        h = _step(h, top[0][0])
    return ids, tops


def output_ids(prompt_ids: list[int], n: int, choices: list[int], **kw: Any) -> list[int]:
    """The greedy output ids alone (see :func:`greedy`)."""
    return greedy(prompt_ids, n, choices, **kw)[0]


class _Model:
    def __init__(self, spec: str) -> None:
        from abbench.engine.serve.tokenizer import IncrementalDetokenizer, load_tokenizer

        self.tok = load_tokenizer(spec)
        self._detok = IncrementalDetokenizer
        self.choices = self.tok.encode(_SENTENCE)
        self.vocab_size = VOCAB_SIZE

    def encode(self, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            return self.tok.encode(prompt)
        if isinstance(prompt, list) and all(isinstance(i, int) for i in prompt):
            return list(prompt)
        raise TypeError("prompt must be text or a list of token ids")

    def generate(self, prompt_ids: list[int], n: int, diverge_at: int | None, flip_at_length: int | None
                 ) -> tuple[list[int], list[str], list[list[tuple[int, float]]]]:
        """Output ids, the text piece each one adds (pieces join to ``decode(ids)``), and top logprobs."""
        ids, tops = greedy(prompt_ids, n, self.choices, diverge_at=diverge_at, flip_at_length=flip_at_length)
        detok = self._detok(self.tok)
        pieces = [detok.push(i) for i in ids]
        if pieces:
            pieces[-1] += detok.flush()
        return ids, pieces, tops

    def text(self, token_id: int) -> str:
        return self.tok.decode([token_id])


# ------------------------------------------------------------------------------------------- the server


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, addr: tuple[str, int], config: FakeEngineConfig, model: _Model) -> None:
        super().__init__(addr, _Handler)
        self.config = config
        self.model = model
        self.lock = threading.Lock()
        self.cache: list[list[int]] = []  # prompts served since the last reset
        self.counters = {"requests": 0, "completions": 0, "resets": 0, "prompt_tokens": 0,
                         "processed_prompt_tokens": 0, "cached_tokens": 0, "generation_tokens": 0}

    def count(self, **incr: int) -> dict[str, int]:
        with self.lock:
            for k, v in incr.items():
                self.counters[k] += v
            return dict(self.counters)

    def lookup(self, ids: list[int]) -> int:
        """Prompt tokens served from the prefix cache (and remember this prompt)."""
        with self.lock:
            best = 0
            for old in self.cache:
                n = 0
                for a, b in zip(old, ids):
                    if a != b:
                        break
                    n += 1
                best = max(best, n)
            self.cache.append(list(ids))
            return min(best, len(ids) - 1)

    def reset(self) -> int:
        with self.lock:
            n = sum(len(p) for p in self.cache)
            self.cache.clear()
            self.counters["resets"] += 1
            return n


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        logging.getLogger("fake_engines").debug("%s " + format, self.client_address[0], *args)

    # -- plumbing ----------------------------------------------------------------------------------------

    def _send(self, status: int, data: bytes, ctype: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _json(self, status: int, obj: Any) -> None:
        self._send(status, json.dumps(obj).encode(), "application/json")

    def _text(self, status: int, text: str, ctype: str = "text/plain; version=0.0.4; charset=utf-8") -> None:
        self._send(status, text.encode(), ctype)

    def _stream_start(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def _event(self, obj: Any) -> None:
        data = b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _stream_end(self) -> None:
        self.wfile.write(b"0\r\n\r\n")

    def _body(self) -> dict[str, Any] | None:
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        try:
            body = json.loads(raw) if raw else {}
            if not isinstance(body, dict):
                raise ValueError("not an object")
            return body
        except ValueError as e:
            self._json(400, {"error": {"message": f"invalid JSON body: {e}", "code": 400}})
            return None

    # -- routes ------------------------------------------------------------------------------------------

    def do_GET(self) -> None:
        self.server.count(requests=1)
        url = urlsplit(self.path)
        eng = self.server.config.engine
        if url.path == "/health":
            self._json(200, {"status": "ok"}) if eng == "llamacpp" else self._send(200, b"", "text/plain")
        elif url.path == "/stats":
            self._json(200, self.server.count())
        elif url.path == "/metrics":
            self._metrics()
        elif url.path == "/flush_cache" and eng == "sglang":
            self._sglang_flush()
        elif url.path == "/slots" and eng == "llamacpp":
            self._json(200, [{"id": 0, "n_ctx": 40960, "is_processing": False}])
        else:
            self._json(404, {"error": {"message": f"no route GET {url.path}", "code": 404}})

    def do_POST(self) -> None:
        self.server.count(requests=1)
        url = urlsplit(self.path)
        eng = self.server.config.engine
        body = self._body()
        if body is None:
            return
        if eng == "vllm" and url.path == "/v1/completions":
            self._vllm(body)
        elif eng == "vllm" and url.path == "/reset_prefix_cache" and self.server.config.vllm_dev_mode:
            self.server.reset()
            self._send(200, b"", "text/plain")
        elif eng == "sglang" and url.path == "/generate":
            self._sglang(body)
        elif eng == "sglang" and url.path == "/flush_cache":
            self._sglang_flush()
        elif eng == "llamacpp" and url.path == "/completion":
            self._llamacpp(body)
        elif eng == "llamacpp" and url.path.startswith("/slots/"):
            self._llamacpp_slot(url.path.rsplit("/", 1)[1], parse_qs(url.query).get("action", [""])[0])
        else:
            self._json(404, {"error": {"message": f"no route POST {url.path}", "code": 404}})

    def _metrics(self) -> None:
        cfg, c = self.server.config, self.server.count()
        labels = f'model_name="{cfg.model}"'
        if cfg.engine == "vllm":
            rows = [("vllm:prompt_tokens_total", c["prompt_tokens"]),
                    ("vllm:generation_tokens_total", c["generation_tokens"]),
                    ("vllm:prefix_cache_queries_total", c["prompt_tokens"]),
                    ("vllm:prefix_cache_hits_total", c["cached_tokens"])]
            labels = f'engine="0",{labels}'
        elif cfg.engine == "sglang":
            if not cfg.sglang_metrics:
                self._json(404, {"detail": "Not Found"})
                return
            rows = [("sglang:prompt_tokens_total", c["prompt_tokens"]),
                    ("sglang:generation_tokens_total", c["generation_tokens"]),
                    ("sglang:cached_tokens_total", c["cached_tokens"])]
        else:
            if not cfg.llamacpp_metrics:
                self._json(501, {"error": {"code": 501, "type": "not_supported_error", "message":
                                           "This server does not support metrics endpoint. Start it with `--metrics`"}})
                return
            rows = [("llamacpp:prompt_tokens_total", c["processed_prompt_tokens"]),
                    ("llamacpp:tokens_predicted_total", c["generation_tokens"])]
            labels = ""
        lines = []
        for name, value in rows:
            lines += [f"# HELP {name} fake counter", f"# TYPE {name} counter",
                      f"{name}{{{labels}}} {float(value)}" if labels else f"{name} {float(value)}"]
        self._text(200, "\n".join(lines) + "\n")

    # -- one completion, engine-independent --------------------------------------------------------------

    def _run(self, prompt: Any, n: int, body: dict[str, Any]) -> dict[str, Any] | None:
        srv = self.server
        try:
            prompt_ids = srv.model.encode(prompt)
        except TypeError as e:
            self._json(400, {"error": {"message": str(e), "code": 400}})
            return None
        if not prompt_ids:
            self._json(400, {"error": {"message": "empty prompt", "code": 400}})
            return None
        cached = srv.lookup(prompt_ids)
        ids, pieces, tops = srv.model.generate(prompt_ids, n, body.get("fake_diverge_at"), srv.config.flip_at_length)
        srv.count(completions=1, prompt_tokens=len(prompt_ids), processed_prompt_tokens=len(prompt_ids) - cached,
                  cached_tokens=cached, generation_tokens=len(ids))
        hold = float(body.get("fake_hold_first_text_s") or 0.0)
        delays = [0.0] * len(ids)
        if hold and len(pieces) > 1:  # the first token's text travels with the second token
            pieces[1] = pieces[0] + pieces[1]
            pieces[0] = ""
            delays[1] = hold
        token_delay = float(body.get("fake_token_delay_s") or srv.config.token_delay_s)
        for j in range(1, len(delays)):
            delays[j] += token_delay
        return {"prompt_ids": prompt_ids, "cached": cached, "ids": ids, "pieces": pieces, "tops": tops,
                "delays": delays, "t0": time.perf_counter()}

    # -- vLLM ----------------------------------------------------------------------------------------------

    def _vllm(self, body: dict[str, Any]) -> None:
        cfg = self.server.config
        run = self._run(body.get("prompt"), int(body.get("max_tokens") or 16), body)
        if run is None:
            return
        k = body.get("logprobs")
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        with_ids = bool(body.get("return_token_ids"))
        rid, created = f"cmpl-fake-{self.server.count()['completions']}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": body.get("model") or cfg.model}
        ids, pieces = run["ids"], run["pieces"]
        usage = {"prompt_tokens": len(run["prompt_ids"]), "completion_tokens": len(ids),
                 "total_tokens": len(run["prompt_ids"]) + len(ids),
                 "prompt_tokens_details": {"cached_tokens": run["cached"]}}

        def key(i: int) -> str:
            return f"token_id:{i}" if as_ids else self.server.model.text(i)

        def logprobs(at: list[int], offset: int) -> dict[str, Any] | None:
            if k is None:
                return None
            out: dict[str, Any] = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
            for j in at:
                i, top = ids[j], run["tops"][j]
                out["text_offset"].append(offset)
                out["tokens"].append(key(i))
                out["token_logprobs"].append(top[0][1])
                out["top_logprobs"].append({key(t): lp for t, lp in top[: k + 1]})  # vLLM: the top k and the chosen
                offset += len(self.server.model.text(i))
            return out

        if not body.get("stream"):
            every = list(range(len(ids)))
            choice: dict[str, Any] = {"index": 0, "text": "".join(pieces), "logprobs": logprobs(every, 0),
                                      "finish_reason": "length", "stop_reason": None}
            if with_ids:
                choice["token_ids"] = ids
                choice["prompt_token_ids"] = run["prompt_ids"]
            self._json(200, {**head, "choices": [choice], "usage": usage})
            return
        self._stream_start()
        offset = 0
        for j, (i, piece) in enumerate(zip(ids, pieces)):
            time.sleep(run["delays"][j])
            choice = {"index": 0, "text": piece, "logprobs": logprobs([j], offset),
                      "finish_reason": "length" if j == len(ids) - 1 else None, "stop_reason": None}
            if with_ids:
                choice["token_ids"] = [i]
                if j == 0:
                    choice["prompt_token_ids"] = run["prompt_ids"]
            offset += len(piece)
            self._event({**head, "choices": [choice]})
        if (body.get("stream_options") or {}).get("include_usage"):
            self._event({**head, "choices": [], "usage": usage})
        self._event(b"[DONE]")
        self._stream_end()

    # -- SGLang ----------------------------------------------------------------------------------------------

    def _sglang_flush(self) -> None:
        if self.server.config.sglang_flush_busy:  # http_server.py flush_cache: BAD_REQUEST unless it flushed
            self._text(400, "Cache flushed.\nPlease check backend logs for more details. (When there are running or "
                            "waiting requests, the operation will not be performed.)\n", "text/plain; charset=utf-8")
            return
        self.server.reset()
        self._text(200, "Cache flushed.\nPlease check backend logs for more details. (When there are running or "
                        "waiting requests, the operation will not be performed.)\n", "text/plain; charset=utf-8")

    def _sglang(self, body: dict[str, Any]) -> None:
        cfg = self.server.config
        sp = body.get("sampling_params") or {}
        prompt = body["input_ids"] if "input_ids" in body else body.get("text")
        run = self._run(prompt, int(sp.get("max_new_tokens", 128)), body)
        if run is None:
            return
        k = int(body.get("top_logprobs_num") or 0)
        with_lp = bool(body.get("return_logprob"))
        rid = f"fake-{self.server.count()['completions']}"
        ids, pieces = run["ids"], run["pieces"]

        def meta(upto: int, start: int) -> dict[str, Any]:
            done = upto == len(ids)
            finish: Any = {"type": "length", "length": len(ids)} if done else None
            if done and body.get("fake_mode") == "abort":
                finish = {"type": "abort", "message": "fake abort (out of memory)", "status_code": 503}
            m: dict[str, Any] = {
                "id": rid, "finish_reason": finish,
                "prompt_tokens": len(run["prompt_ids"]), "weight_version": "default", "completion_tokens": upto,
                "cached_tokens": run["cached"],
            }
            if with_lp:
                tops = run["tops"][start:upto]
                m["input_token_logprobs"] = [[None, run["prompt_ids"][-1], None]]
                m["output_token_logprobs"] = [[top[0][1], i, None] for i, top in zip(ids[start:upto], tops)]
                m["output_top_logprobs"] = [[[lp, t, None] for t, lp in top[:k]] if k else None for top in tops]
            if done:
                m["e2e_latency"] = time.perf_counter() - run["t0"]
            return m

        if not body.get("stream"):
            self._json(200, {"text": "".join(pieces), "output_ids": ids, "meta_info": meta(len(ids), 0)})
            return
        self._stream_start()
        for j in range(len(ids)):
            time.sleep(run["delays"][j])
            if cfg.sglang_incremental:
                self._event({"text": pieces[j], "output_ids": [ids[j]], "meta_info": meta(j + 1, j)})
            else:
                self._event({"text": "".join(pieces[: j + 1]), "output_ids": ids[: j + 1], "meta_info": meta(j + 1, 0)})
        self._event(b"[DONE]")
        self._stream_end()

    # -- llama.cpp -------------------------------------------------------------------------------------------

    def _llamacpp_slot(self, slot: str, action: str) -> None:
        if self.server.config.llamacpp_slot_save_path is None:
            self._json(501, {"error": {"code": 501, "type": "not_supported_error", "message":
                                       "This server does not support slots action. Start it with `--slot-save-path`"}})
            return
        if slot != "0":
            self._json(400, {"error": {"code": 400, "type": "invalid_request_error", "message": "Invalid slot ID"}})
            return
        if action != "erase":
            self._json(400, {"error": {"code": 400, "type": "invalid_request_error", "message": "Invalid action"}})
            return
        self._json(200, {"id_slot": 0, "n_erased": self.server.reset()})

    def _llamacpp(self, body: dict[str, Any]) -> None:
        cfg = self.server.config
        run = self._run(body.get("prompt"), int(body.get("n_predict", -1)), body)
        if run is None:
            return
        k = int(body.get("n_probs") or 0)
        model = self.server.model
        ids, pieces, n_prompt = run["ids"], run["pieces"], len(run["prompt_ids"])

        post = bool(body.get("post_sampling_probs"))
        mode = body.get("fake_mode")

        def probs(j: int) -> dict[str, Any]:
            def entry(t: int, lp: float) -> dict[str, Any]:
                e: dict[str, Any] = {"id": t, "token": model.text(t), "bytes": list(model.text(t).encode())}
                if post:
                    e["prob"] = math.exp(lp)
                else:
                    e["logprob"] = lp
                return e

            top = run["tops"][j]
            return {**entry(ids[j], top[0][1]),
                    "top_probs" if post else "top_logprobs": [entry(t, lp) for t, lp in top[:k]]}

        elapsed_ms = (time.perf_counter() - run["t0"]) * 1e3
        final = {
            "index": 0, "content": "", "tokens": [], "id_slot": 0, "stop": True, "model": cfg.model,
            "tokens_predicted": len(ids), "tokens_evaluated": n_prompt,
            "generation_settings": {"n_predict": len(ids), "temperature": body.get("temperature", 0.8),
                                    "ignore_eos": body.get("ignore_eos", False), "n_probs": k},
            "prompt": "", "has_new_line": False, "truncated": False, "stop_type": "limit", "stopping_word": "",
            "tokens_cached": n_prompt + len(ids),
            "timings": {"cache_n": run["cached"], "prompt_n": n_prompt - run["cached"], "prompt_ms": 1.0,
                        "prompt_per_token_ms": 0.1, "prompt_per_second": 1e4, "predicted_n": len(ids),
                        "predicted_ms": elapsed_ms, "predicted_per_token_ms": 1.0, "predicted_per_second": 1e3},
        }
        if mode == "old-stop-fields":
            del final["stop_type"]
            final.update(stopped_eos=False, stopped_word=False, stopped_limit=True)
        mid = {int(j) for j in body.get("fake_mid_char") or ()}
        if not body.get("stream"):
            final["content"] = "".join(pieces)
            if len(ids) - 1 in mid and final["content"]:  # the incomplete last character, decoded
                final["content"] = final["content"][:-1] + "\ufffd"
            final["tokens"] = ids if body.get("return_tokens") else []
            if k:
                final["completion_probabilities"] = [probs(j) for j in range(len(ids)) if j not in mid]
            self._json(200, final)
            return
        self._stream_start()
        held = ""
        for j, (i, piece) in enumerate(zip(ids, pieces)):
            time.sleep(run["delays"][j])
            if j in mid:  # text ends inside a character: no event, the text waits for the next token's
                held += piece
                continue
            piece, held = held + piece, ""
            ev: dict[str, Any] = {"index": 0, "content": piece, "tokens": [i], "stop": False, "id_slot": 0,
                                  "tokens_predicted": j + 1, "tokens_evaluated": n_prompt}
            if k:
                ev["completion_probabilities"] = [probs(j)]
            self._event(ev)
        if mode != "no-final":
            self._event(final)  # no [DONE] on the native endpoint
        if mode == "after-final":
            self._event({"index": 0, "content": " extra", "tokens": [0], "stop": False})
        self._stream_end()
        if cfg.llamacpp_close_after_stream_s is not None:
            self.wfile.flush()
            time.sleep(cfg.llamacpp_close_after_stream_s)
            self.close_connection = True  # without reading what the client sent since


# ------------------------------------------------------------------------------------- in-process and CLI


class FakeEngine:
    """One fake engine serving from a background thread on a loopback port."""

    def __init__(self, config: FakeEngineConfig, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.config = config
        self._httpd = _Server((host, port), config, _Model(config.tokenizer))
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def tokenizer(self) -> Any:
        return self._httpd.model.tok

    def stats(self) -> dict[str, int]:
        return self._httpd.count()

    def start(self) -> FakeEngine:
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=f"fake-{self.config.engine}", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._httpd.serve_forever()

    def stop(self) -> None:
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join(5)
        self._httpd.server_close()

    def __enter__(self) -> FakeEngine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Fake vLLM / SGLang / llama.cpp server for abbench's tests.")
    ap.add_argument("--engine", required=True, choices=ENGINES)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--tokenizer", default="qwen3")
    ap.add_argument("--model", default="fake-model")
    ap.add_argument("--token-delay", type=float, default=0.0)
    ap.add_argument("--incremental-streaming-output", action="store_true", help="SGLang: delta events")
    ap.add_argument("--enable-metrics", action="store_true", help="SGLang: serve /metrics")
    ap.add_argument("--slot-save-path", default=None, help="llama.cpp: enables slot actions (erase)")
    ap.add_argument("--metrics", action="store_true", help="llama.cpp: serve /metrics")
    ap.add_argument("-np", "--parallel", type=int, default=1, help="llama.cpp: slots (accepted, one is served)")
    ap.add_argument("--flip-at-length", type=int, default=None,
                    help="a near-tied choice goes the other way when the history (prompt + output) is this long")
    args = ap.parse_args(argv)
    logging.basicConfig(level="INFO", stream=sys.stderr, format="%(asctime)s fake-%(name)s %(message)s")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    config = FakeEngineConfig(
        engine=args.engine, model=args.model, tokenizer=args.tokenizer, token_delay_s=args.token_delay,
        vllm_dev_mode=os.environ.get("VLLM_SERVER_DEV_MODE") == "1",
        sglang_incremental=args.incremental_streaming_output, sglang_metrics=args.enable_metrics,
        llamacpp_slot_save_path=args.slot_save_path, llamacpp_metrics=args.metrics,
        flip_at_length=args.flip_at_length,
    )
    engine = FakeEngine(config, host=args.host, port=args.port)
    logging.getLogger(args.engine).info("listening on %s", engine.base_url)
    try:
        engine.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
