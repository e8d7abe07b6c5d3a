"""Exact-length prompts and prompt sets, with the real Qwen vocabularies: exact counts that round-trip, pairs
that extend token for token, the id contract, determinism, distinct prefixes and clear errors."""

from __future__ import annotations

import hashlib
import re
import unicodedata
from pathlib import Path
from typing import Any

import pytest

from abbench import prompts
from abbench.errors import ConfigError, PromptError
from abbench.profile import PairSpec, PromptsSpec
from abbench.prompts import (
    BUILTIN_CORPORA,
    BuiltPrompt,
    build_prompts,
    document_text,
    exact_nested_prompts,
    exact_prompt,
    load_corpus,
)
from abbench.tokenizers import decode_ids, encode_ids, load_tokenizer

LENGTHS = [1, 2, 3, 7, 31, 64, 127, 500, 1001, 2047, 3333]
# CJK, emoji, combining sequences, math letters, digits, whitespace runs
HARD_TEXT = "天地玄黄，宇宙洪荒。🙂🎉👍🏽 Ñandú naïve 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ∑∫ 1234567   \n\t" * 200  # noqa: E501


# The tokenizers come from the cache every run reads (ABBENCH_CACHE_DIR, else ~/.cache/abbench): each vocabulary
# is converted once on the machine, by whichever test or run needs it first (the cache is written atomically).
# The conversion itself is tested from a fresh cache in test_tokenizers.


@pytest.fixture(scope="session")
def qwen3() -> Any:
    return load_tokenizer("qwen3")


@pytest.fixture(scope="session")
def qwen36() -> Any:
    return load_tokenizer("qwen3.6")


@pytest.fixture(scope="session")
def full_set(qwen3: Any) -> list[BuiltPrompt]:
    return build_prompts(qwen3, FULL_SPEC)


FULL_SPEC = PromptsSpec(
    lengths=[1, 17, 256, 1999],
    per_length=2,
    pairs=[PairSpec(cold=100, extend=1), PairSpec(cold=257, extend=33)],
    warmup=2,
    warmup_tokens=32,
    jit_warmup_tokens=300,
    seed=3,
)


def assert_exact(tok: Any, text: str, ids: list[int], n: int) -> None:
    assert len(ids) == n
    assert encode_ids(tok, text) == ids
    assert decode_ids(tok, ids) == text


def long_source(n_chars: int = 20000) -> str:
    return document_text(load_corpus("science"), seed=0, ordinal=1, start=0, min_chars=n_chars)


@pytest.mark.parametrize("n", LENGTHS)
def test_exact_prompt_lengths(qwen3: Any, n: int) -> None:
    text, ids = exact_prompt(qwen3, long_source(), n)
    assert_exact(qwen3, text, ids, n)


def test_exact_prompt_moves_cuts_that_do_not_round_trip(
    qwen3: Any, qwen36: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # CJK, emoji and rare letters: many cuts split a character between two byte tokens and must move.
    moves: list[int] = []
    drop_word = prompts._drop_word
    monkeypatch.setattr(prompts, "_drop_word", lambda s, pos: moves.append(pos) or drop_word(s, pos))
    for tok in (qwen3, qwen36):
        for n in list(range(1, 60)) + [333, 1001]:
            text, ids = exact_prompt(tok, HARD_TEXT, n)
            assert_exact(tok, text, ids, n)
    assert moves  # the text above does exercise moved cuts


class _LossyTokenizer:
    """A fake tokenizer whose decode never round-trips: one id per character, decode appends a '!'."""

    class _Backend:
        truncation = None
        padding = None

        def encode(self, text: str, add_special_tokens: bool = False) -> Any:
            return type("Enc", (), {"ids": [ord(c) for c in text]})()

    backend_tokenizer = _Backend()

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        return "".join(map(chr, ids)) + "!"

    def __call__(self, text: str, **kwargs: Any) -> dict[str, Any]:
        return {"offset_mapping": [(i, i + 1) for i in range(len(text))]}


def test_exact_prompt_gives_up_with_a_clear_error() -> None:
    with pytest.raises(PromptError) as e:
        exact_prompt(_LossyTokenizer(), "word " * 400, 50)
    msg = str(e.value)
    assert "50 tokens" in msg and "the text source" in msg and "re-encoding gives 51 tokens" in msg


def test_exact_prompt_too_short_source(qwen3: Any) -> None:
    with pytest.raises(PromptError, match=r"500 tokens .* only \d+ tokens"):
        exact_prompt(qwen3, "A short text.", 500)


def test_nested_prompts_are_prefixes(qwen36: Any) -> None:
    (short_text, short_ids), (long_text, long_ids) = exact_nested_prompts(qwen36, HARD_TEXT, [41, 300])
    assert_exact(qwen36, short_text, short_ids, 41)
    assert_exact(qwen36, long_text, long_ids, 300)
    assert long_text.startswith(short_text) and long_ids[:41] == short_ids


def test_set_ids_kinds_and_order(full_set: list[BuiltPrompt]) -> None:
    ids = [b.record.id for b in full_set]
    assert ids == [
        "warmup-0", "warmup-1", "jit-0",
        "fresh-1-0", "fresh-1-1", "fresh-17-0", "fresh-17-1", "fresh-256-0", "fresh-256-1",
        "fresh-1999-0", "fresh-1999-1",
        "pair0-cold", "pair0-cont", "pair1-cold", "pair1-cont",
    ]  # fmt: skip
    kinds = {b.record.id: b.record.kind for b in full_set}
    assert kinds["warmup-1"] == "warmup" and kinds["jit-0"] == "jit" and kinds["fresh-17-1"] == "fresh"
    assert kinds["pair1-cold"] == "cold" and kinds["pair1-cont"] == "continuation"
    targets = {b.record.id: b.record.target_tokens for b in full_set}
    assert targets["warmup-0"] == 32 and targets["jit-0"] == 300 and targets["fresh-1999-1"] == 1999
    assert targets["pair0-cont"] == 101 and targets["pair1-cold"] == 257 and targets["pair1-cont"] == 290
    parents = {b.record.id: b.record.parent for b in full_set}
    assert parents["pair1-cont"] == "pair1-cold" and parents["pair1-cold"] is None and parents["fresh-1-0"] is None


def test_set_records_are_exact_and_hashed(qwen3: Any, full_set: list[BuiltPrompt]) -> None:
    for b in full_set:
        assert_exact(qwen3, b.text, b.ids, b.record.target_tokens)
        assert b.record.token_count == b.record.target_tokens
        assert b.record.sha256 == hashlib.sha256(b.text.encode("utf-8")).hexdigest()
        assert b.text.startswith(b.record.preview) and 0 < len(b.record.preview) <= 60


def test_continuation_extends_cold_token_for_token(qwen3: Any, full_set: list[BuiltPrompt]) -> None:
    by_id = {b.record.id: b for b in full_set}
    for k, pair in enumerate(FULL_SPEC.pairs):
        cold, cont = by_id[f"pair{k}-cold"], by_id[f"pair{k}-cont"]
        assert cont.text.startswith(cold.text)
        assert encode_ids(qwen3, cont.text)[: pair.cold] == cold.ids == encode_ids(qwen3, cold.text)
        assert len(encode_ids(qwen3, cont.text)) == pair.cold + pair.extend
        assert cont.record.corpus == cold.record.corpus


def test_same_spec_same_prompts(qwen3: Any, full_set: list[BuiltPrompt]) -> None:
    again = build_prompts(qwen3, FULL_SPEC)
    assert [b.record for b in again] == [b.record for b in full_set]
    other = build_prompts(qwen3, FULL_SPEC.model_copy(update={"seed": 4}))
    assert {b.record.sha256 for b in other if b.record.target_tokens > 200}.isdisjoint(
        b.record.sha256 for b in full_set
    )


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def test_prompts_share_no_prefix_and_no_body_start(full_set: list[BuiltPrompt]) -> None:
    def group(b: BuiltPrompt) -> str:
        return b.record.parent or b.record.id

    for i, a in enumerate(full_set):
        for b in full_set[i + 1 :]:
            if group(a) != group(b) and min(len(a.ids), len(b.ids)) > 4:
                assert _common_prefix(a.ids, b.ids) <= 4, (a.record.id, b.record.id)
    # Each document (a pair is one) starts with its own header and its own first paragraph.
    docs = [b for b in full_set if b.record.kind != "continuation" and b.record.target_tokens >= 256]
    headers = [b.text.split("\n", 1)[0] for b in docs]
    assert len(set(headers)) == len(headers)
    bodies = [b.text.split("Section 1\n\n", 1)[1][:80] for b in docs]
    assert len(set(bodies)) == len(bodies)


def test_corpora_rotate(full_set: list[BuiltPrompt]) -> None:
    docs = [b for b in full_set if b.record.kind != "continuation"]
    corpora = list(FULL_SPEC.corpora)
    assert [b.record.corpus for b in docs] == [corpora[i % len(corpora)] for i in range(len(docs))]
    assert docs[1].text.startswith(f"Document 2 ({corpora[1]})")


def test_long_prompt(qwen3: Any) -> None:
    built = build_prompts(qwen3, PromptsSpec(lengths=[40000], warmup=0, corpora=["fiction"]))
    (b,) = built
    assert_exact(qwen3, b.text, b.ids, 40000)
    assert len(re.findall(r"^Section \d+$", b.text, flags=re.M)) > 27  # cycled past one pass of the corpus


def test_qwen36_set(qwen36: Any) -> None:
    spec = PromptsSpec(lengths=[5, 1234], pairs=[PairSpec(cold=333, extend=77)], warmup=1, seed=9)
    built = build_prompts(qwen36, spec)
    assert [b.record.id for b in built] == ["warmup-0", "fresh-5-0", "fresh-1234-0", "pair0-cold", "pair0-cont"]
    for b in built:
        assert_exact(qwen36, b.text, b.ids, b.record.target_tokens)
    cold, cont = built[-2:]
    assert cont.ids[:333] == cold.ids and cont.text.startswith(cold.text)


def test_builtin_corpora_are_distinct_and_substantial() -> None:
    assert len(BUILTIN_CORPORA) >= 4
    seen: set[str] = set()
    for name in BUILTIN_CORPORA:
        corpus = load_corpus(name)
        assert len(corpus.paragraphs) >= 25, name
        assert len({p[:40] for p in corpus.paragraphs}) == len(corpus.paragraphs)
        assert all(len(p.split()) >= 60 for p in corpus.paragraphs)
        assert all(unicodedata.is_normalized("NFC", p) for p in corpus.paragraphs)
        assert seen.isdisjoint(corpus.paragraphs)
        seen.update(corpus.paragraphs)


def test_tiny_user_corpus_is_cycled(qwen3: Any, tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "tiny.txt").write_text("Just one short line.\n", encoding="utf-8")
    spec = PromptsSpec(lengths=[3000], warmup=1, warmup_tokens=7, corpora=["data/tiny.txt"])
    built = build_prompts(qwen3, spec, base_dir=tmp_path)
    for b in built:
        assert_exact(qwen3, b.text, b.ids, b.record.target_tokens)
        assert b.record.corpus == "data/tiny.txt"
    assert built[1].text.startswith("Document 2 (tiny)")


def test_user_corpus_is_nfc_normalised(tmp_path: Path) -> None:
    (tmp_path / "c.txt").write_text("Cafe\u0301 one.\n\n\n  Second paragraph.  \r\n", encoding="utf-8")
    corpus = load_corpus("c.txt", base_dir=tmp_path)
    assert corpus.paragraphs == ("Caf\u00e9 one.", "Second paragraph.") and corpus.title == "c"


@pytest.mark.parametrize("name", ["novels", "scince"])
def test_unknown_corpus_names_it(qwen3: Any, name: str) -> None:
    with pytest.raises(ConfigError) as e:
        build_prompts(qwen3, PromptsSpec(corpora=["essays", name]))
    assert repr(name) in str(e.value) and "essays, science, history, fiction" in str(e.value)


def test_bad_corpus_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_corpus("missing.txt", base_dir=tmp_path)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_corpus("latin1.txt", base_dir=tmp_path)
    (tmp_path / "empty.txt").write_text("\n\n  \n")
    with pytest.raises(ConfigError, match="holds no text"):
        load_corpus(str(tmp_path / "empty.txt"))


def test_empty_corpora_list(qwen3: Any) -> None:
    with pytest.raises(ConfigError, match="prompts.corpora is empty"):
        build_prompts(qwen3, PromptsSpec(corpora=[]))


def test_max_tokens_hint(qwen3: Any) -> None:
    spec = PromptsSpec(lengths=[64], pairs=[PairSpec(cold=4000, extend=200)], warmup=0)
    with pytest.raises(ConfigError, match="pair0-cont needs 4200 tokens.*4096"):
        build_prompts(qwen3, spec, max_tokens_hint=4096)
    assert len(build_prompts(qwen3, spec, max_tokens_hint=4200)) == 3


def test_document_text_is_deterministic() -> None:
    corpus = load_corpus("history")
    a = document_text(corpus, seed=1, ordinal=5, start=3, min_chars=50000)
    assert a == document_text(corpus, seed=1, ordinal=5, start=3, min_chars=50000)
    assert a.startswith(f"Document 5 (history)\n\nSection 1\n\n{corpus.paragraphs[3]}\n\n")
    assert a != document_text(corpus, seed=2, ordinal=5, start=3, min_chars=50000)
    assert len(a) >= 50000


def test_a_length_far_too_big_fails_fast_without_memory_growth(qwen3: Any) -> None:
    """`--lengths 99999999` used to generate ~500 MB of text and tokenise it until the kernel killed the
    process (21.6 GB): it is refused before any text is made, naming the largest length and why."""
    import tracemalloc

    from abbench.prompts import MAX_PROMPT_TOKENS, build_prompts, check_lengths

    spec = PromptsSpec(lengths=[384, 99_999_999], per_length=1, pairs=[], warmup=0, jit_warmup_tokens=0)
    tracemalloc.start()
    try:
        with pytest.raises(ConfigError) as e:
            build_prompts(qwen3, spec)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    msg = str(e.value)
    assert "fresh-99999999-0 needs 99,999,999 tokens" in msg and f"{MAX_PROMPT_TOKENS:,} tokens" in msg
    assert "bytes a token" in msg and "GB" in msg
    assert peak < 4 << 20, peak  # nothing of the prompt's size was built (the prompt's text alone is ~500 MB)
    pair = PromptsSpec(lengths=[384], pairs=[PairSpec(cold=MAX_PROMPT_TOKENS, extend=1)], warmup=0)
    with pytest.raises(ConfigError, match="pair0-cont needs 1,048,577 tokens"):
        check_lengths(pair)
    check_lengths(PromptsSpec(lengths=[MAX_PROMPT_TOKENS], warmup=0))  # the bound itself is allowed


def test_the_cli_refuses_a_huge_length_under_a_memory_limit() -> None:
    """`abbench prompts --lengths 99999999` under a 2 GB address-space limit: exit 2 with the message (before,
    the process grew until it was killed)."""
    import os
    import resource
    import subprocess
    import sys

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    res = subprocess.run([sys.executable, "-m", "abbench", "prompts", "--lengths", "99999999"], capture_output=True,
                         text=True, timeout=120, preexec_fn=limit, env={**os.environ, "COLUMNS": "200"})
    assert res.returncode == 2, res.stderr
    assert "more than the largest prompt abbench builds" in " ".join(res.stderr.split())
