"""Exact-length prompts and the prompt sets of a profile.

Contract
--------
``exact_prompt(tok, text_source, n)`` returns ``(text, ids)`` with ``len(ids) == n`` and
``encode(text) == ids`` (no special tokens added) and ``decode(ids) == text`` (no special-token skipping, no
clean-up). It encodes the source once, keeps the first ``n`` ids, decodes them and re-encodes the text to check.
When the cut does not round-trip (a merge across the cut, a multi-byte character split between two tokens) it
moves the cut deterministically: it deletes the word (at most 48 characters) that straddles the cut from the
source and tries again, at most ``MAX_ATTEMPTS`` times; then it raises :class:`~abbench.errors.PromptError`
saying the length, the source and why. ``exact_nested_prompts`` does the same for several lengths cut from one
source, each a token-for-token prefix of the next (cold/continuation pairs).

Corpora: the built-in ``essays``, ``science``, ``history`` and ``fiction`` (``abbench/corpora/<name>.txt``,
original prose, paragraphs separated by blank lines), or the path of a UTF-8 ``.txt`` file (relative to
``base_dir``), read the same way and NFC-normalised. A prompt's source text is a *document*: a header line
``Document <k> (<corpus>)`` that is unique in the set, then the corpus's paragraphs under numbered ``Section``
headings, starting at a paragraph no earlier prompt of that corpus started at and continuing in seeded shuffled
passes over the corpus for as long as the length needs (a tiny corpus is fine: it is cycled). The text is a
pure function of (corpus, seed, prompt position in the set), so the same spec gives the same sha256s, and two
prompts of a set share no prefix beyond the first tokens of the header.

``build_prompts(tok, spec)`` returns the set as :class:`BuiltPrompt` ``(record, text, ids)``, in this order
and with these ids (a contract with the scheduler, runner and report):

* ``warmup-0`` ... (kind ``warmup``): ``spec.warmup`` prompts of ``spec.warmup_tokens``;
* ``jit-0`` (kind ``jit``): one prompt of ``spec.jit_warmup_tokens``, only when that is > 0;
* ``fresh-<len>-<i>`` (kind ``fresh``): ``spec.per_length`` prompts per length, lengths in spec order;
* ``pair<k>-cold`` (kind ``cold``, ``pair.cold`` tokens) then ``pair<k>-cont`` (kind ``continuation``,
  ``cold + extend`` tokens, parent ``pair<k>-cold``): the continuation's text starts with the cold text and its
  ids start with the cold ids, token for token.

Prompts rotate through ``spec.corpora`` in that order. Each record holds the sha256 of the UTF-8 text, the
token count measured by re-encoding (== target) and a preview. Cost: about two encodes of the prompt's length
(one of the source, one check), e.g. under a second for 128K tokens on two CPU cores. A prompt longer than
:data:`MAX_PROMPT_TOKENS` is refused (:func:`check_lengths`, a :class:`ConfigError`) before any text is made:
peak memory is about :data:`BYTES_PER_TOKEN` bytes a token of the longest prompt, so the bound bounds it.
"""

from __future__ import annotations

import hashlib
import math
import random
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from abbench.errors import ConfigError, PromptError
from abbench.profile import PromptsSpec
from abbench.results import PromptRecord
from abbench.tokenizers import decode_ids, encode_ids

__all__ = [
    "BUILTIN_CORPORA",
    "CORPORA_DIR",
    "MAX_ATTEMPTS",
    "MAX_PROMPT_TOKENS",
    "BuiltPrompt",
    "Corpus",
    "PromptItem",
    "build_prompt_items",
    "build_prompts",
    "check_lengths",
    "document_text",
    "exact_nested_prompts",
    "exact_prompt",
    "load_corpus",
]

CORPORA_DIR = Path(__file__).resolve().parent / "corpora"
BUILTIN_CORPORA = ("essays", "science", "history", "fiction")
MAX_ATTEMPTS = 16  # cut moves per prompt before giving up
PREVIEW_CHARS = 60
_WORD_SPAN = 24  # a "word" deleted to move a cut reaches at most this far each side of it
_SOURCE_MARGIN = 1.12  # source text is sized to ~12% more tokens than needed
_GROW_ATTEMPTS = 6  # times a too-short source is regenerated larger
MAX_PROMPT_TOKENS = 1 << 20
"""The longest prompt abbench builds (1,048,576 tokens, 4x the longest context of the engines it drives). The
corpus text is cycled, so any length has text; the bound is memory: encoding a source and re-encoding its cut
holds the tokenizer's per-token state, about :data:`BYTES_PER_TOKEN` bytes a token at its peak (measured: 35 MB
for 131,072 tokens), so 100 million tokens would take about 26 GB and be killed by the kernel."""
BYTES_PER_TOKEN = 270
_REPLACEMENT = "\ufffd"


@dataclass(frozen=True)
class BuiltPrompt:
    """One prompt of a set: its record (stored in the run), its text (sent) and its token ids."""

    record: PromptRecord
    text: str
    ids: list[int]


@dataclass(frozen=True)
class Corpus:
    """A body of paragraphs prompts are cut from. ``name`` is how the profile named it (recorded); ``title`` the
    short name in document headers."""

    name: str
    title: str
    paragraphs: tuple[str, ...]


class _SourceTooShort(Exception):
    def __init__(self, have: int) -> None:
        super().__init__(have)
        self.have = have


# ------------------------------------------------------------------------------------------------ corpora


def load_corpus(name_or_path: str, *, base_dir: Path | None = None) -> Corpus:
    """A built-in corpus by name, or a UTF-8 text file (paragraphs separated by blank lines)."""
    if name_or_path in BUILTIN_CORPORA:
        return _read_corpus(CORPORA_DIR / f"{name_or_path}.txt", name_or_path, name_or_path)
    path = Path(name_or_path).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    looks_like_path = path.suffix != "" or "/" in name_or_path or "\\" in name_or_path or path.exists()
    if not looks_like_path:
        raise ConfigError(
            f"prompts.corpora: unknown corpus {name_or_path!r}: use one of {', '.join(BUILTIN_CORPORA)} or the "
            "path of a UTF-8 .txt file (relative to the profile)"
        )
    if not path.is_file():
        raise ConfigError(f"prompts.corpora: corpus file {name_or_path!r} does not exist (looked for {path})")
    return _read_corpus(path, name_or_path, path.stem or name_or_path)


def _read_corpus(path: Path, name: str, title: str) -> Corpus:
    try:
        raw = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"prompts.corpora: corpus {name!r} ({path}) is not UTF-8 text: {e}") from None
    except OSError as e:
        raise ConfigError(f"prompts.corpora: cannot read corpus {name!r} ({path}): {e}") from None
    text = unicodedata.normalize("NFC", raw.replace("\r\n", "\n").replace("\r", "\n"))
    paragraphs = tuple(p.strip() for p in re.split(r"\n[ \t]*\n", text) if p.strip())
    if not paragraphs:
        raise ConfigError(f"prompts.corpora: corpus {name!r} ({path}) holds no text")
    return Corpus(name=name, title=title, paragraphs=paragraphs)


def document_text(corpus: Corpus, *, seed: int, ordinal: int, start: int, min_chars: int) -> str:
    """The source document of prompt ``ordinal`` (1-based, unique in a set): a header, then sections whose
    paragraphs start at ``start`` and continue in seeded shuffled passes, at least ``min_chars`` long."""
    rng = random.Random(f"abbench-document/{seed}/{corpus.name}/{ordinal}")
    count = len(corpus.paragraphs)
    parts = [f"Document {ordinal} ({corpus.title})\n\n"]
    size = len(parts[0])
    order = [start % count]
    section = 0
    while size < min_chars:
        if not order:
            order = list(range(count))
            rng.shuffle(order)
        section += 1
        piece = f"Section {section}\n\n{corpus.paragraphs[order.pop(0)]}\n\n"
        parts.append(piece)
        size += len(piece)
    return "".join(parts)


# ------------------------------------------------------------------------------------- exact-length cuts


def exact_prompt(tok: Any, text_source: str, n: int) -> tuple[str, list[int]]:
    """Text of exactly ``n`` tokens cut from the start of ``text_source`` (see the module doc)."""
    return exact_nested_prompts(tok, text_source, [n])[0]


def exact_nested_prompts(
    tok: Any, text_source: str, lengths: list[int], *, where: str = "the text source"
) -> list[tuple[str, list[int]]]:
    """``(text, ids)`` for each of ``lengths`` (in the order given), all cut from one source: each shorter
    prompt's ids and text are prefixes of each longer one's. ``where`` names the source in errors."""
    try:
        return _cut_nested(tok, text_source, lengths, where)
    except _SourceTooShort as e:
        raise PromptError(
            f"cannot build a prompt of {max(lengths)} tokens from {where}: it has only {e.have} tokens; "
            "pass a longer text"
        ) from None


def _cut_nested(tok: Any, source: str, lengths: list[int], where: str) -> list[tuple[str, list[int]]]:
    cuts = sorted(set(lengths))
    if not cuts or cuts[0] < 1:
        raise PromptError(f"prompt lengths must be positive token counts, got {lengths}")
    reasons: list[str] = []
    for _attempt in range(MAX_ATTEMPTS):
        ids = encode_ids(tok, source)
        if len(ids) < cuts[-1]:
            raise _SourceTooShort(len(ids))
        done, bad_cut, why = _check_cuts(tok, ids, cuts)
        if bad_cut is None:
            return [done[n] for n in lengths]
        reasons.append(f"{bad_cut}: {why}")
        source = _drop_word(source, _cut_char(tok, source, bad_cut))
    raise PromptError(
        f"cannot build an exact prompt of {cuts[-1]} tokens from {where}: no cut near "
        f"{', '.join(str(c) for c in cuts)} tokens round-trips after {MAX_ATTEMPTS} attempts "
        f"(last reasons: {'; '.join(reasons[-3:])}); is the tokenizer lossless (decode(encode(text)) == text)?"
    )


def _check_cuts(
    tok: Any, ids: list[int], cuts: list[int]
) -> tuple[dict[int, tuple[str, list[int]]], int | None, str]:
    """Cut ``ids`` at each length (longest first); the first cut that fails and why, or (results, None, "")."""
    done: dict[int, tuple[str, list[int]]] = {}
    longest = ""
    for n in reversed(cuts):
        cand = ids[:n]
        text = decode_ids(tok, cand)
        if text.endswith(_REPLACEMENT):
            return done, n, "the cut splits a multi-byte character"
        if longest and not longest.startswith(text):
            return done, n, "the shorter text is not a prefix of the longer one"
        again = encode_ids(tok, text)
        if again != cand:
            return done, n, _mismatch(cand, again)
        done[n] = (text, cand)
        longest = longest or text
    return done, None, ""


def _mismatch(want: list[int], got: list[int]) -> str:
    if len(got) != len(want):
        return f"re-encoding gives {len(got)} tokens, not {len(want)}"
    first = next(i for i, (a, b) in enumerate(zip(want, got)) if a != b)
    return f"re-encoding differs at token {first} ({want[first]} -> {got[first]})"


def _cut_char(tok: Any, source: str, n: int) -> int:
    """Character offset in ``source`` where token ``n`` (the first one after the cut) begins."""
    enc = tok(source, add_special_tokens=False, return_offsets_mapping=True, truncation=False)
    offsets = enc["offset_mapping"]
    return int(offsets[n][0]) if n < len(offsets) else len(source)


def _drop_word(source: str, pos: int) -> str:
    """``source`` without the whitespace-delimited word around ``pos`` (at most ``_WORD_SPAN`` characters each
    side; at least one character), so the next cut lands on different text."""
    pos = max(0, min(pos, len(source) - 1))
    lo = pos
    while lo > max(0, pos - _WORD_SPAN) and not source[lo - 1].isspace():
        lo -= 1
    hi = pos
    while hi < min(len(source), pos + _WORD_SPAN) and not source[hi].isspace():
        hi += 1
    if hi < len(source) and source[hi] == " ":
        hi += 1
    if hi <= lo:
        hi = lo + 1
    return source[:lo] + source[hi:]


# ------------------------------------------------------------------------------------------- prompt sets


@dataclass(frozen=True)
class PromptItem:
    """One document's prompts: a warm-up, a fresh prompt or a pair (``kind`` "pair": cold + continuation)."""

    id: str
    kind: str
    lengths: tuple[int, ...]  # one length, or (cold, cold + extend) for a pair
    parent_ids: tuple[str, ...]  # the ids of the prompts cut from this document, parallel to lengths


def _plan(spec: PromptsSpec) -> list[PromptItem]:
    plan = [PromptItem(f"warmup-{i}", "warmup", (spec.warmup_tokens,), (f"warmup-{i}",)) for i in range(spec.warmup)]
    if spec.jit_warmup_tokens > 0:
        plan.append(PromptItem("jit-0", "jit", (spec.jit_warmup_tokens,), ("jit-0",)))
    for length in spec.lengths:
        for i in range(spec.per_length):
            pid = f"fresh-{length}-{i}"
            plan.append(PromptItem(pid, "fresh", (length,), (pid,)))
    for k, pair in enumerate(spec.pairs):
        plan.append(
            PromptItem(f"pair{k}", "pair", (pair.cold, pair.cold + pair.extend), (f"pair{k}-cold", f"pair{k}-cont"))
        )
    return plan


def build_prompts(
    tok: Any, spec: PromptsSpec, *, base_dir: Path | None = None, max_tokens_hint: int | None = None
) -> list[BuiltPrompt]:
    """Every prompt of ``spec``, exact and checked (see the module doc). ``max_tokens_hint``: the engine's
    context length if known; a prompt longer than it is a :class:`ConfigError` before anything is built."""
    plan = _plan(spec)
    if max_tokens_hint is not None:
        _check_fits(plan, max_tokens_hint)
    return build_prompt_items(tok, spec, list(enumerate(plan)), base_dir=base_dir)


def build_prompt_items(tok: Any, spec: PromptsSpec, items: list[tuple[int, PromptItem]], *,
                       base_dir: Path | None = None) -> list[BuiltPrompt]:
    """The prompts of ``items``, each at its position in a set: the document at position ``p`` is cut from
    corpus ``p % len(corpora)`` at the start that the prompts before it in that corpus leave, with ordinal
    ``p + 1``, so a prompt's text depends on (corpora, seed, position) alone. :func:`build_prompts` is the set
    at positions 0, 1, ...; a sweep builds its points' prompts at positions of their own."""
    check_lengths([item for _, item in items])
    if not spec.corpora:
        raise ConfigError(f"prompts.corpora is empty: name at least one of {', '.join(BUILTIN_CORPORA)} or a .txt file")
    corpora = [load_corpus(c, base_dir=base_dir) for c in spec.corpora]
    starts = {c.name: _start_order(c, spec.seed) for c in corpora}
    chars_per_token: dict[str, float] = {}
    built: list[BuiltPrompt] = []
    for position, item in items:
        corpus = corpora[position % len(corpora)]
        start = starts[corpus.name][_used_before(corpora, position) % len(corpus.paragraphs)]
        if corpus.name not in chars_per_token:
            chars_per_token[corpus.name] = _chars_per_token(tok, corpus, spec.seed)
        cuts = _build_document_prompts(
            tok, corpus, item, seed=spec.seed, ordinal=position + 1, start=start, cpt=chars_per_token[corpus.name]
        )
        built.extend(_records(item, corpus, cuts))
    return built


def _used_before(corpora: list[Corpus], position: int) -> int:
    """How many documents at positions before ``position`` come from the same corpus as it (the rotation)."""
    n, name = len(corpora), corpora[position % len(corpora)].name
    same = [j for j in range(n) if corpora[j].name == name]
    return (position // n) * len(same) + sum(1 for j in same if j < position % n)


def _check_fits(plan: list[PromptItem], limit: int) -> None:
    for item in plan:
        if max(item.lengths) > limit:
            raise ConfigError(
                f"prompts: {item.parent_ids[-1]} needs {max(item.lengths)} tokens, more than the engine's context "
                f"length {limit}; shorten prompts.lengths / prompts.pairs"
            )


def check_lengths(plan: list[PromptItem] | PromptsSpec) -> None:
    """:class:`ConfigError` when a prompt of ``plan`` (or of a spec's set) is longer than
    :data:`MAX_PROMPT_TOKENS`, before any text is generated: the message names the prompt, the largest length
    abbench builds, and why (the memory the tokenizer would need)."""
    items = _plan(plan) if isinstance(plan, PromptsSpec) else plan
    for item in items:
        need = max(item.lengths)
        if need > MAX_PROMPT_TOKENS:
            raise ConfigError(
                f"prompts: {item.parent_ids[-1]} needs {need:,} tokens, more than the largest prompt abbench builds, "
                f"{MAX_PROMPT_TOKENS:,} tokens: the corpus text is cycled without end, but encoding and checking a "
                f"prompt holds about {BYTES_PER_TOKEN} bytes a token in the tokenizer ({need:,} tokens: about "
                f"{need * BYTES_PER_TOKEN / 1e9:,.1f} GB); shorten prompts.lengths / prompts.pairs (--lengths)")


def _start_order(corpus: Corpus, seed: int) -> list[int]:
    """Paragraph indices at which successive documents of ``corpus`` start (distinct until they wrap)."""
    order = list(range(len(corpus.paragraphs)))
    random.Random(f"abbench-starts/{seed}/{corpus.name}").shuffle(order)
    return order


def _chars_per_token(tok: Any, corpus: Corpus, seed: int) -> float:
    sample = document_text(corpus, seed=seed, ordinal=0, start=0, min_chars=8000)
    return max(len(sample) / max(1, len(encode_ids(tok, sample))), 0.5)


def _build_document_prompts(
    tok: Any, corpus: Corpus, item: PromptItem, *, seed: int, ordinal: int, start: int, cpt: float
) -> list[tuple[str, list[int]]]:
    need = max(item.lengths)
    min_chars = int(math.ceil(need * cpt * _SOURCE_MARGIN)) + 64
    where = f"corpus {corpus.name!r} (prompt {item.parent_ids[-1]})"
    for _ in range(_GROW_ATTEMPTS):
        source = document_text(corpus, seed=seed, ordinal=ordinal, start=start, min_chars=min_chars)
        try:
            return _cut_nested(tok, source, list(item.lengths), where)
        except _SourceTooShort as e:
            min_chars = int(min_chars * max(1.5, need / max(1, e.have) * _SOURCE_MARGIN))
    raise PromptError(f"cannot build a prompt of {need} tokens from {where}: the generated text stays too short")


def _records(item: PromptItem, corpus: Corpus, cuts: list[tuple[str, list[int]]]) -> list[BuiltPrompt]:
    out: list[BuiltPrompt] = []
    for j, ((text, ids), length, pid) in enumerate(zip(cuts, item.lengths, item.parent_ids)):
        if item.kind == "pair":
            kind, parent = ("cold", None) if j == 0 else ("continuation", item.parent_ids[0])
        else:
            kind, parent = item.kind, None
        record = PromptRecord(
            id=pid,
            kind=kind,  # type: ignore[arg-type]
            target_tokens=length,
            token_count=len(ids),
            sha256=hashlib.sha256(text.encode("utf-8")).hexdigest(),
            corpus=corpus.name,
            parent=parent,
            preview=text[:PREVIEW_CHARS],
        )
        out.append(BuiltPrompt(record=record, text=text, ids=ids))
    return out
