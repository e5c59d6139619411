"""Byte-level BPE in pure Python: the readable reference that the C++ core is tested against.

This module *is* the specification of lmforge's tokenizer. Everything fast (``lmforge._core``,
:mod:`lmforge.tokenizer.training`, :class:`lmforge.tokenizer.Tokenizer`) must give exactly the same
results as the functions here, and the tests hold them to it.

Training, in four steps (the CS336 assignment-1 semantics):

1. The vocabulary starts with the 256 single bytes (ids 0-255), then one id per special token.
2. Each document is split on the special tokens (longest first). Specials are never counted and
   no merge ever crosses a special token or a document boundary.
3. Each piece is split into *pre-tokens* by a regex (:data:`PATTERNS`), e.g. ``" hello"``,
   ``","``, ``" 42"``. A pre-token is a sequence of bytes; identical pre-tokens are counted once
   with their multiplicity.
4. Repeatedly, the most frequent adjacent pair of tokens (summed over pre-tokens, weighted by
   multiplicity) is merged into a new token. Ties go to the lexicographically greatest pair of
   byte strings. Training stops when the vocabulary has ``vocab_size`` entries or no pair is left.

Worked example (one pre-token, no specials, three merges)::

    aaabdaaabac        pairs: (a,a)=4 (a,b)=2 (b,d)=1 (d,a)=1 (b,a)=1 (a,c)=1
    aa a b d aa a b a c    merge 256 = a+a;   now (aa,a)=2 and (a,b)=2 tie, and (b"aa", b"a") > (b"a", b"b")
    aaa b d aaa b a c      merge 257 = aa+a;  (aaa,b)=2 is the most frequent pair
    aaab d aaab a c        merge 258 = aaa+b

>>> vocab, merges = train_bpe_reference(["aaabdaaabac"], vocab_size=259)
>>> merges
[(b'a', b'a'), (b'aa', b'a'), (b'aaa', b'b')]
>>> encode_reference("aaabdaaabac", vocab, merges)
[258, 100, 258, 97, 99]

Encoding applies the learned merges to each pre-token in the order they were learned (lowest
rank first), which reproduces exactly how the training corpus was segmented.
"""

from __future__ import annotations

import functools
import re
from collections import Counter
from typing import TYPE_CHECKING, Callable, Iterable, Mapping, Sequence

if TYPE_CHECKING:
    import regex  # imported where a pattern is compiled: ~10 ms that training a tokenizer in C++ never needs

# GPT-2's pre-tokenizer (also the CS336 pattern): contractions, letter runs, number runs,
# punctuation runs, each optionally with one leading space, and whitespace.
_GPT2 = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# GPT-4's cl100k_base pre-tokenizer: case-insensitive contractions, numbers in groups of <= 3,
# letters may take one leading non-letter, newlines kept with preceding whitespace/punctuation.
_GPT4 = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*"""
         r"""|\s*[\r\n]|\s+(?!\S)|\s+""")

#: Named pre-tokenization regexes. Any other string given as ``pattern`` is used as a custom regex.
PATTERNS: dict[str, str] = {
    "gpt2": _GPT2,
    "gpt4": _GPT4,
    "cl100k": _GPT4,
    "nanochat": _GPT4.replace(r"\p{N}{1,3}", r"\p{N}{1,2}"),  # nanochat: numbers in groups of <= 2
}

_NAME_LIKE = re.compile(r"[A-Za-z][A-Za-z0-9_.\-]*")


def resolve_pattern(pattern: str) -> str:
    """Return the regex for ``pattern``: a name in :data:`PATTERNS` or a custom regex string.

    A value that looks like a name (letters, digits, ``-_.``) but is not one of ours is refused
    with the list of names, because ``"gpt3"`` is far more likely a typo than a regex. A custom
    regex must compile with the ``regex`` module.
    """
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"pattern must be a non-empty string (one of {sorted(PATTERNS)} or a regex), got {pattern!r}")
    if pattern in PATTERNS:
        return PATTERNS[pattern]
    if _NAME_LIKE.fullmatch(pattern):
        raise ValueError(f"unknown pattern name {pattern!r}; use one of {', '.join(sorted(PATTERNS))} "
                         "or give a full regex")
    _compile(pattern)
    return pattern


@functools.lru_cache(maxsize=32)
def _compile(regex_str: str) -> "regex.Pattern[str]":
    import regex

    try:
        return regex.compile(regex_str)
    except regex.error as e:
        raise ValueError(f"custom pattern {regex_str!r} is not a valid regex: {e}") from e


def compile_pattern(pattern: str) -> "regex.Pattern[str]":
    """The compiled pre-tokenization regex for a pattern name or custom regex (cached)."""
    return _compile(resolve_pattern(pattern))


def pretokenize(text: str, pattern: str = "gpt2") -> list[str]:
    """Split ``text`` into pre-tokens (no special-token handling).

    >>> pretokenize("Hello, world! It's 2024.")
    ['Hello', ',', ' world', '!', ' It', "'s", ' 2024', '.']
    """
    return compile_pattern(pattern).findall(text)


# --------------------------------------------------------------------------------------------------
# Special tokens
# --------------------------------------------------------------------------------------------------
def check_special_tokens(special_tokens: Iterable[str] | None) -> list[str]:
    """Validate special tokens and return them as a list (order kept: it decides their ids).

    Empty strings, non-strings and duplicates are user errors (``ValueError``).
    """
    if special_tokens is None:
        return []
    if isinstance(special_tokens, (str, bytes)):
        raise ValueError(f"special_tokens must be a list of strings, not a single string {special_tokens!r}; "
                         f"write [{special_tokens!r}]")
    out = list(special_tokens)
    seen: set[str] = set()
    for s in out:
        if not isinstance(s, str):
            raise ValueError(f"special tokens must be strings, got {s!r} ({type(s).__name__})")
        if not s:
            raise ValueError("special tokens must be non-empty strings; remove the empty one")
        if s in seen:
            raise ValueError(f"special token {s!r} is given twice; list each special token once")
        seen.add(s)
    return out


def special_splitter(special_tokens: Sequence[str]) -> "regex.Pattern[str] | None":
    """A regex that matches any special token, longest first (so ``<|a|><|a|>`` beats ``<|a|>``)."""
    if not special_tokens:
        return None
    import regex

    alts = sorted(set(special_tokens), key=lambda s: (-len(s), s))
    return regex.compile("(" + "|".join(regex.escape(s) for s in alts) + ")")


def split_on_specials(text: str, special_tokens: Sequence[str]) -> list[tuple[str, bool]]:
    """Split ``text`` into ``(piece, is_special)`` parts; empty ordinary pieces are dropped.

    >>> split_on_specials("a<|eot|>b", ["<|eot|>"])
    [('a', False), ('<|eot|>', True), ('b', False)]
    """
    splitter = special_splitter(special_tokens)
    if splitter is None:
        return [(text, False)] if text else []
    parts = splitter.split(text)  # capturing group: odd indices are the specials
    return [(p, i % 2 == 1) for i, p in enumerate(parts) if p]


# --------------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------------
def count_pretokens(texts: Iterable[str], special_tokens: Sequence[str] = (), pattern: str = "gpt2",
                    counts: Counter[bytes] | None = None) -> Counter[bytes]:
    """Count the UTF-8 pre-tokens of every document in ``texts`` (specials removed, never counted)."""
    counts = Counter() if counts is None else counts
    rx = compile_pattern(pattern)
    for text in texts:
        for piece, is_special in split_on_specials(text, special_tokens):
            if not is_special:
                counts.update(w.encode("utf-8") for w in rx.findall(piece))
    return counts


def _pairs(word: list[bytes]) -> Iterable[tuple[bytes, bytes]]:
    return zip(word, word[1:])


def _merge_word(word: list[bytes], pair: tuple[bytes, bytes]) -> list[bytes]:
    """Replace every non-overlapping occurrence of ``pair`` in ``word``, left to right."""
    a, b = pair
    out: list[bytes] = []
    i = 0
    while i < len(word):
        if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
            out.append(a + b)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


def learn_merges(counts: Mapping[bytes, int], num_merges: int,
                 progress: Callable[[int], None] | None = None) -> list[tuple[bytes, bytes]]:
    """Learn up to ``num_merges`` merges from pre-token counts (step 4 of the module docstring).

    Pair counts are kept up to date incrementally: only the pre-tokens that contain the merged
    pair are re-counted, which makes this fast enough for test corpora of a few hundred KB.
    ``progress(k)`` is called after each merge ``k`` (1-based) when given.
    """
    words = [[bytes([b]) for b in w] for w in counts]
    freqs = list(counts.values())
    pair_counts: Counter[tuple[bytes, bytes]] = Counter()
    where: dict[tuple[bytes, bytes], set[int]] = {}
    for i, word in enumerate(words):
        for p in _pairs(word):
            pair_counts[p] += freqs[i]
            where.setdefault(p, set()).add(i)

    merges: list[tuple[bytes, bytes]] = []
    while len(merges) < num_merges and pair_counts:
        # Most frequent pair; ties -> lexicographically greatest (left bytes, right bytes).
        best = max(pair_counts.items(), key=lambda kv: (kv[1], kv[0]))[0]
        merges.append(best)
        for i in where.pop(best, ()):
            word = words[i]
            new = _merge_word(word, best)
            if len(new) == len(word):  # stale index: this pre-token no longer holds the pair
                continue
            for p in _pairs(word):
                pair_counts[p] -= freqs[i]
                if pair_counts[p] <= 0:
                    del pair_counts[p]
            for p in _pairs(new):
                pair_counts[p] += freqs[i]
                where.setdefault(p, set()).add(i)
            words[i] = new
        pair_counts.pop(best, None)
        if progress is not None:
            progress(len(merges))
    return merges


def base_vocab(special_tokens: Sequence[str] = ()) -> dict[int, bytes]:
    """Ids 0-255 are the single bytes, then one id per special token (UTF-8 bytes)."""
    vocab = {i: bytes([i]) for i in range(256)}
    for s in special_tokens:
        vocab[len(vocab)] = s.encode("utf-8")
    return vocab


def check_vocab_size(vocab_size: int, special_tokens: Sequence[str]) -> int:
    """``ValueError`` unless ``vocab_size`` leaves room for the 256 bytes and every special token."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise ValueError(f"vocab_size must be an integer, got {vocab_size!r}")
    need = 256 + len(special_tokens)
    if vocab_size < need:
        raise ValueError(f"vocab_size={vocab_size} is too small: it must be at least 256 (bytes) + "
                         f"{len(special_tokens)} (special tokens) = {need}")
    return vocab_size


def train_bpe_reference(texts: Iterable[str], vocab_size: int, special_tokens: Sequence[str] | None = None,
                        pattern: str = "gpt2") -> tuple[dict[int, bytes], list[tuple[bytes, bytes]]]:
    """Train a byte-level BPE tokenizer on in-memory documents (the reference for ``train_bpe``).

    Each element of ``texts`` is one document. Returns ``(vocab, merges)``: ``vocab`` maps id to
    token bytes (bytes, then specials, then merges in order); ``merges[i]`` is the i-th merge.
    """
    specials = check_special_tokens(special_tokens)
    check_vocab_size(vocab_size, specials)
    resolve_pattern(pattern)
    vocab = base_vocab(specials)
    counts = count_pretokens(texts, specials, pattern)
    merges = learn_merges(counts, vocab_size - len(vocab))
    for a, b in merges:
        vocab[len(vocab)] = a + b
    return vocab, merges


# --------------------------------------------------------------------------------------------------
# Encoding
# --------------------------------------------------------------------------------------------------
def bpe_word(word: bytes, ranks: Mapping[tuple[bytes, bytes], int]) -> list[bytes]:
    """Apply merges to one pre-token: repeatedly merge the adjacent pair with the lowest rank.

    >>> bpe_word(b"aaab", {(b"a", b"a"): 0, (b"aa", b"a"): 1, (b"aaa", b"b"): 2})
    [b'aaab']
    """
    parts = [bytes([b]) for b in word]
    while len(parts) > 1:
        best = min(_pairs(parts), key=lambda p: ranks.get(p, float("inf")))
        if best not in ranks:
            break
        parts = _merge_word(parts, best)
    return parts


def special_ids(vocab: Mapping[int, bytes], special_tokens: Sequence[str]) -> dict[str, int]:
    """Id of each special token: the highest id whose bytes are the token's UTF-8 (``ValueError`` if absent)."""
    by_bytes: dict[bytes, int] = {}
    for i, tok in vocab.items():
        if by_bytes.get(tok, -1) < i:
            by_bytes[tok] = i
    out = {}
    for s in special_tokens:
        if s.encode("utf-8") not in by_bytes:
            raise ValueError(f"special token {s!r} is not in the vocabulary; add it to the vocab or drop it")
        out[s] = by_bytes[s.encode("utf-8")]
    return out


def token_ids(vocab: Mapping[int, bytes], special_tokens: Sequence[str] = ()) -> dict[bytes, int]:
    """Map token bytes to id for ordinary tokens (special ids excluded; the lowest id wins a tie)."""
    skip = set(special_ids(vocab, special_tokens).values())
    out: dict[bytes, int] = {}
    for i in sorted(vocab):
        if i not in skip and vocab[i] not in out:
            out[vocab[i]] = i
    return out


def encode_reference(text: str, vocab: Mapping[int, bytes], merges: Sequence[tuple[bytes, bytes]],
                     special_tokens: Sequence[str] | None = None, pattern: str = "gpt2") -> list[int]:
    """Encode ``text`` with the given vocabulary and merges (specials in ``text`` become their ids)."""
    specials = check_special_tokens(special_tokens)
    ranks = {pair: r for r, pair in enumerate(merges)}
    to_id = token_ids(vocab, specials)
    special_id = special_ids(vocab, specials)
    rx = compile_pattern(pattern)
    ids: list[int] = []
    for piece, is_special in split_on_specials(text, specials):
        if is_special:
            ids.append(special_id[piece])
            continue
        for w in rx.findall(piece):
            ids.extend(to_id[t] for t in bpe_word(w.encode("utf-8"), ranks))
    return ids


def decode_reference(ids: Iterable[int], vocab: Mapping[int, bytes]) -> str:
    """Concatenate token bytes and decode as UTF-8 (invalid sequences become U+FFFD)."""
    return b"".join(vocab[i] for i in ids).decode("utf-8", errors="replace")


# --------------------------------------------------------------------------------------------------
# GPT-2's byte <-> printable unicode mapping (used by vocab.json / merges.txt / HF tokenizer.json)
# --------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from each byte to a printable character.

    Printable Latin-1 bytes map to themselves; the other 68 (control chars, space, ...) map to
    chr(256), chr(257), ... in byte order, so b" " becomes "Ġ" and b"\\n" becomes "Ċ".

    >>> bytes_to_unicode()[ord(" ")], bytes_to_unicode()[ord("\\n")], bytes_to_unicode()[ord("a")]
    ('Ġ', 'Ċ', 'a')
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


@functools.lru_cache(maxsize=1)
def unicode_to_bytes() -> dict[str, int]:
    """Inverse of :func:`bytes_to_unicode`."""
    return {c: b for b, c in bytes_to_unicode().items()}
