"""Tests of the C++ core ``lmforge._core`` against the ``regex`` module and small Python oracles.

Everything here is hermetic (data made in the test) except the GPT-2 parity test, which needs the
CS336 fixtures and skips without them.
"""

from __future__ import annotations

import functools
import json
import random
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import regex
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import characters, regex_knows_the_tables

_core = pytest.importorskip("lmforge._core")

# Copies of lmforge.tokenizer.reference.PATTERNS: the C++ matchers must equal regex.findall with exactly these.
PATTERNS = {
    "gpt2": r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",
    "gpt4": r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+""",
    "nanochat": r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+""",
}
PATTERN_IDS = {"gpt2": _core.PATTERN_GPT2, "gpt4": _core.PATTERN_GPT4, "nanochat": _core.PATTERN_NANOCHAT}
COMPILED = {k: regex.compile(v) for k, v in PATTERNS.items()}
EOT = "<|endoftext|>"

# Characters that exercise every rule: letters of many scripts, combining marks, non-ASCII digits and
# numerals, every whitespace code point (and \x1c-\x1f, which str.isspace() accepts but \s does not),
# apostrophes with case variants incl. U+017F (long s, folds to s) and U+212A (Kelvin, folds to k),
# CR/LF, emoji, private use, punctuation.
WHITESPACE = "".join(chr(c) for c in range(0x3001) if regex.match(r"\s", chr(c)))  # all 25 of them
ALPHABET = (list("aAbsSdDmMtTlLvVeErRkK'’\"0123456789.,!?-_()") + list(WHITESPACE)
            + ["\r\n", "\x1c", "\x1d", "\x1e", "\x1f", "\u017f", "\u212a", "\u0130", "\u0131", "ß", "é", "e\u0301",
               "\u0301", "²", "³", "½", "Ⅻ", "٣", "৪", "一", "日本", "Ωμέγα", "Привет", "مرحبا", "ก", "😀", "👍🏽",
               "\ue000", "\U000f0000", "\x00", "\x7f", "\u200b", "\ufeff", "ǅ", "ǈ", "ﬁ"])

text_strategy = st.lists(st.one_of(st.sampled_from(ALPHABET), characters()),
                         max_size=40).map("".join)


def findall_bytes(name: str, text: str) -> list[bytes]:
    return [t.encode("utf-8") for t in COMPILED[name].findall(text)]


# --------------------------------------------------------------------------------------------------
# Pre-tokenization
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(PATTERNS))
@settings(max_examples=400, deadline=None, database=None)
@given(text=text_strategy)
def test_pretokenize_matches_regex_fuzz(name: str, text: str) -> None:
    assert _core.pretokenize(text.encode("utf-8"), PATTERN_IDS[name]) == findall_bytes(name, text)


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_pretokenize_all_pairs_and_triples(name: str) -> None:
    """Every ordered pair (and many triples) of representative characters, joined into one text per
    first character so that the regex and C++ runs stay cheap."""
    chars = ALPHABET[:60]
    small = ["a", "A", "'", "s", "S", "\u017f", "1", "²", " ", "\t", "\n", "\r", "\xa0", "\u3000", ".", "é", "😀"]
    texts = [a + b for a in chars for b in chars] + [a + b + c for a in small for b in small for c in small]
    for t in texts:
        got = _core.pretokenize(t.encode("utf-8"), PATTERN_IDS[name])
        assert got == findall_bytes(name, t), repr(t)


@pytest.mark.slow
@pytest.mark.skipif(not regex_knows_the_tables(), reason="the installed regex is older than the C++ tables' source")
def test_pretokenize_code_points() -> None:
    """Every code point below U+3400, every 5th above and each 256-block's edges, in contexts
    that reveal its class: 'a c c 1' tokenizes differently for letter / number / space / other, and
    "'cc" (gpt4) tells whether c case-folds to a contraction letter."""
    cps = [c for c in range(0x110000) if not 0xD800 <= c < 0xE000
           and (c < 0x3400 or c % 5 == 0 or c & 0xFF in (0, 255))]
    for lo in range(0, len(cps), 1 << 16):
        block = [chr(c) for c in cps[lo:lo + (1 << 16)]]
        gpt2_text = "".join(f"a{c}{c}1" for c in block)
        assert _core.pretokenize(gpt2_text.encode(), _core.PATTERN_GPT2) == findall_bytes("gpt2", gpt2_text)
        gpt4_text = "".join(f"'{c}{c}\x01" for c in block)
        assert _core.pretokenize(gpt4_text.encode(), _core.PATTERN_GPT4) == findall_bytes("gpt4", gpt4_text)


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_pretokenize_edge_cases(name: str) -> None:
    cases = ["", " ", "   ", "a ", "a  ", "a  b", " \n", "\n ", "x \t\ny", "\r\n\r\n  z", "  \u3000x", "it's 'S 'LL 'Ve",
             "'\u017f '\u212a", "12345678", "1²3½Ⅻ4", "!!\n\nx", " !?\r\n", "\u0085\u00a0a", "\x1c\x1d a", "a" * 1000,
             " " * 1000 + "a", "\n" * 50 + " " * 50]
    for t in cases:
        assert _core.pretokenize(t.encode(), PATTERN_IDS[name]) == findall_bytes(name, t), repr(t)


def test_pretokenize_rejects_invalid_utf8_and_bad_pattern() -> None:
    with pytest.raises(ValueError, match="byte offset 2"):
        _core.pretokenize(b"ab\xc3(", _core.PATTERN_GPT2)
    with pytest.raises(ValueError, match="pattern"):
        _core.pretokenize(b"ab", 7)


@settings(max_examples=300, deadline=None, database=None)
@given(data=st.binary(max_size=40) | text_strategy.map(lambda s: s.encode("utf-8") + b"\xed\xa0\x80"))
def test_utf8_error_offset_matches_python(data: bytes) -> None:
    try:
        data.decode("utf-8")
        expected = -1
    except UnicodeDecodeError as e:
        expected = e.start
    assert _core.utf8_error_offset(data) == expected


@pytest.mark.parametrize("bad", [b"\xc0\x80", b"\xc1\xbf", b"\xe0\x80\x80", b"\xed\xa0\x80", b"\xf0\x80\x80\x80",
                                 b"\xf4\x90\x80\x80", b"\xf5\x80\x80\x80", b"\xff", b"\x80", b"\xe2\x82", b"\xf0\x9f\x98"])
def test_utf8_error_offset_rejects_malformed(bad: bytes) -> None:
    data = "héllo wörld ".encode() * 3 + bad + b" tail"
    assert _core.utf8_error_offset(data) == len("héllo wörld ".encode() * 3)
    assert _core.utf8_error_offset(data[:-len(bad) - 5]) == -1


# --------------------------------------------------------------------------------------------------
# PretokenCounter
# --------------------------------------------------------------------------------------------------
def reference_counts(text: str, specials: list[str], name: str) -> Counter[bytes]:
    """Split on specials (longest first), findall on the rest."""
    counts: Counter[bytes] = Counter()
    pieces = [text]
    if specials:
        alts = "|".join(regex.escape(s) for s in sorted(specials, key=len, reverse=True))
        pieces = regex.split(f"(?:{alts})", text)
    for piece in pieces:
        counts.update(findall_bytes(name, piece))
    return counts


def random_corpus(n_words: int, seed: int, specials: tuple[str, ...] = (EOT,)) -> str:
    rng = random.Random(seed)
    words = ["the", "cat", "don't", "we'll", "Ωμέγα", "日本", "42", "3.14", "x", "naïve", "it's", "😀", "hello"]
    seps = [" ", " ", " ", "  ", "\n", "\n\n", ", ", ". ", "\t", " \u3000", "\r\n"] + list(specials)
    return "".join(rng.choice(words) + rng.choice(seps) for _ in range(n_words))


SAFE_CUT = regex.compile(r"(?<=[\x21-\x7e]) (?=[A-Za-z])")  # the counter's thread split rule


@settings(max_examples=300, deadline=None, database=None)
@given(text=st.lists(st.sampled_from(ALPHABET + ["a b", "x Y", "'s t", "1 a", ". z"]), max_size=30).map("".join))
def test_thread_split_points_never_change_pretokenization(text: str) -> None:
    """With the regex module as the oracle: cutting before a ' ' that follows printable ASCII and
    precedes an ASCII letter gives the same pre-tokens for every pattern."""
    for m in SAFE_CUT.finditer(text):
        p = m.start()
        for name in PATTERNS:
            assert COMPILED[name].findall(text[:p]) + COMPILED[name].findall(text[p:]) == COMPILED[name].findall(text)


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_counter_matches_reference_and_is_thread_independent(name: str) -> None:
    specials = [EOT, EOT + EOT, "a b"]  # overlapping specials; one with a space (cut points must avoid it)
    text = random_corpus(160_000, seed=1, specials=tuple(specials)) + "a b" * 3
    data = text.encode("utf-8")
    assert len(data) > 4 * 256 * 1024  # large enough for 4 threads to share the work
    results = []
    for threads in (1, 2, 4):
        c = _core.PretokenCounter(PATTERN_IDS[name], [s.encode() for s in specials])
        c.add(data, threads)
        results.append(dict(c.items()))
        assert c.total() == sum(results[-1].values())
    assert results[0] == results[1] == results[2]
    assert results[0] == reference_counts(text, specials, name)


def test_counter_splits_text_without_spaces_at_special_tokens() -> None:
    """Chinese-like documents have no ' '+letter cut points; threads split at special tokens instead."""
    rng = random.Random(8)
    docs = ["".join(rng.choice("日本語中文字的是了。，！1２") for _ in range(rng.randint(1, 4000))) for _ in range(300)]
    text = EOT.join(docs)
    results = []
    for threads in (1, 2, 3):
        c = _core.PretokenCounter(_core.PATTERN_GPT4, [EOT.encode()])
        c.add(text.encode(), threads)
        results.append(dict(c.items()))
    assert results[0] == results[1] == results[2] == reference_counts(text, [EOT], "gpt4")


def test_counter_special_tokens_longest_first_and_never_counted() -> None:
    c = _core.PretokenCounter(_core.PATTERN_GPT2, [EOT.encode(), (EOT + EOT).encode()])
    c.add(f"a{EOT}{EOT}b{EOT}{EOT}{EOT}c <|end".encode(), 1)
    items = dict(c.items())
    assert items == {b"a": 1, b"b": 1, b"c": 1, b" <|": 1, b"end": 1}
    assert not any(b"endoftext" in k for k in items)


def test_counter_accumulates_with_bounded_table() -> None:
    c = _core.PretokenCounter(_core.PATTERN_GPT4, [])
    data = random_corpus(2000, seed=3, specials=()).encode()
    c.add(data, 2)
    n, total = len(c), c.total()
    for _ in range(20):  # the same data again: more counts, no new entries
        c.add(data, 2)
    assert len(c) == n and c.total() == 21 * total
    assert all(v % 21 == 0 for _, v in c.items())


def test_counter_invalid_utf8_offset_with_threads() -> None:
    data = bytearray(("hello world " * 100_000).encode())
    data[700_001] = 0xFF
    c = _core.PretokenCounter(_core.PATTERN_GPT2, [])
    with pytest.raises(ValueError, match="invalid UTF-8 at byte offset 700001"):
        c.add(bytes(data), 2)
    assert len(c) == 0  # nothing half-counted


def test_counter_accepts_bytes_like_views() -> None:
    data = b"xx hello world, hello!" * 10
    ref = _core.PretokenCounter(_core.PATTERN_GPT2, [])
    ref.add(data[2:], 1)
    for view in (memoryview(data)[2:], bytearray(data[2:])):
        c = _core.PretokenCounter(_core.PATTERN_GPT2, [])
        c.add(view, 2)
        assert dict(c.items()) == dict(ref.items())
    assert _core.utf8_error_offset(memoryview(b"ok\xff")[1:]) == 1
    with pytest.raises(TypeError):
        ref.add("a str", 1)


def test_counter_add_counts_and_errors() -> None:
    c = _core.PretokenCounter(_core.PATTERN_CUSTOM, [])
    c.add_counts([b"ab", b"cd", b"ab"], [2, 3, 1])
    assert dict(c.items()) == {b"ab": 3, b"cd": 3} and c.total() == 6
    with pytest.raises(ValueError, match="custom pattern"):
        c.add(b"abc", 1)
    with pytest.raises(ValueError, match="differ in length"):
        c.add_counts([b"a"], [1, 2])
    with pytest.raises(ValueError, match="pattern"):
        _core.PretokenCounter(9, [])
    with pytest.raises(ValueError, match="non-empty"):
        _core.PretokenCounter(0, [b""])
    with pytest.raises(ValueError, match="num_threads"):
        _core.PretokenCounter(0, []).add(b"abc", 0)


# --------------------------------------------------------------------------------------------------
# train_bpe
# --------------------------------------------------------------------------------------------------
def brute_force_merges(counts: dict[bytes, int], num_merges: int) -> list[tuple[bytes, bytes]]:
    """Recount every pair from scratch each step; ties -> greatest (left, right) bytes."""
    words = {tuple(bytes([b]) for b in w): c for w, c in counts.items()}
    merges = []
    for _ in range(num_merges):
        pairs: Counter[tuple[bytes, bytes]] = Counter()
        for w, c in words.items():
            for p in zip(w, w[1:]):
                pairs[p] += c
        if not pairs:
            break
        best = max(pairs, key=lambda p: (pairs[p], p))
        merges.append(best)
        new_words: Counter[tuple[bytes, ...]] = Counter()
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(w[i] + w[i + 1])
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            new_words[tuple(out)] += c
        words = dict(new_words)
    return merges


def counter_of(counts: dict[bytes, int]) -> "_core.PretokenCounter":
    c = _core.PretokenCounter(_core.PATTERN_CUSTOM, [])
    c.add_counts(list(counts), list(counts.values()))
    return c


@settings(max_examples=150, deadline=None, database=None)
@given(counts=st.dictionaries(st.binary(min_size=1, max_size=12).map(lambda b: bytes(x % 4 + 97 for x in b))
                              | st.binary(min_size=1, max_size=6), st.integers(1, 5), max_size=25),
       num_merges=st.integers(0, 40))
def test_train_bpe_matches_brute_force(counts: dict[bytes, int], num_merges: int) -> None:
    """Small alphabets make ties and same-bytes-different-path tokens (ab+c vs a+bc) common."""
    assert _core.train_bpe(counter_of(counts), num_merges) == brute_force_merges(counts, num_merges)


def test_train_bpe_ties_and_exhaustion() -> None:
    counts = {b"ab": 1, b"ba": 1, b"cd": 1, b"\xff\x00": 1}
    merges = _core.train_bpe(counter_of(counts), 100)
    assert merges == [(b"\xff", b"\x00"), (b"c", b"d"), (b"b", b"a"), (b"a", b"b")]  # all tie: greatest first
    assert _core.train_bpe(counter_of({b"aaaa": 3}), 10) == [(b"a", b"a"), (b"aa", b"aa")]
    with pytest.raises(ValueError, match="num_merges"):
        _core.train_bpe(counter_of(counts), -1)


def test_train_bpe_on_corpus_matches_brute_force_and_reports_progress() -> None:
    c = _core.PretokenCounter(_core.PATTERN_GPT2, [EOT.encode()])
    c.add(random_corpus(3000, seed=5).encode(), 2)
    seen: list[int] = []
    merges = _core.train_bpe(c, 60, seen.append)
    assert merges == brute_force_merges(dict(c.items()), 60)
    assert seen and seen[-1] == len(merges)


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_train_bpe_matches_the_python_spec(name: str) -> None:
    """Counts and merges equal lmforge.tokenizer.reference (the pure-Python reference) end to end."""
    from lmforge.tokenizer import reference as bpe

    text = random_corpus(4000, seed=6) + "".join(ALPHABET) * 3
    counts = bpe.count_pretokens([text], [EOT], name)
    c = _core.PretokenCounter(PATTERN_IDS[name], [EOT.encode()])
    c.add(text.encode(), 2)
    assert dict(c.items()) == counts
    assert _core.train_bpe(c, 150) == bpe.learn_merges(counts, 150)


def test_train_bpe_progress_exception_propagates() -> None:
    def boom(k: int) -> None:
        raise KeyError("stop")
    with pytest.raises(KeyError):
        _core.train_bpe(counter_of({b"abc": 2}), 5, boom)


# --------------------------------------------------------------------------------------------------
# Encoder
# --------------------------------------------------------------------------------------------------
def naive_encode_word(word: bytes, ranks: dict[tuple[bytes, bytes], int]) -> list[bytes]:
    parts = [bytes([b]) for b in word]
    while len(parts) > 1:
        cands = [(ranks[p], i) for i, p in enumerate(zip(parts, parts[1:])) if p in ranks]
        if not cands:
            break
        _, i = min(cands)
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return parts


def build_tokenizer(corpus: str, num_merges: int, name: str, seed: int, specials: tuple[str, ...] = ()):
    """Train merges on corpus, then lay the vocabulary out in a random id order."""
    c = _core.PretokenCounter(PATTERN_IDS[name], [s.encode() for s in specials])
    c.add(corpus.encode(), 1)
    merges = _core.train_bpe(c, num_merges)
    tokens = [bytes([b]) for b in range(256)] + list(dict.fromkeys(a + b for a, b in merges))
    random.Random(seed).shuffle(tokens)
    tokens += [s.encode() for s in specials]
    ids = {t: i for i, t in enumerate(tokens)}
    enc = _core.Encoder(tokens, [(ids[a], ids[b]) for a, b in merges],
                        {s: len(tokens) - len(specials) + k for k, s in enumerate(specials)}, PATTERN_IDS[name])
    return enc, tokens, ids, {m: r for r, m in enumerate(merges)}


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_encoder_matches_naive_rank_merge(name: str) -> None:
    corpus = random_corpus(2000, seed=7, specials=())
    enc, tokens, ids, ranks = build_tokenizer(corpus, 300, name, seed=11, specials=(EOT,))
    rng = random.Random(0)
    texts = [random_corpus(rng.randint(0, 60), seed=s, specials=()) for s in range(40)]
    texts += ["hello" * 40 + " " + "the" * 60, "ab" * 300, "😀" * 50]  # long pre-tokens: heap path
    for t in texts:
        expected = [ids[p] for w in findall_bytes(name, t) for p in naive_encode_word(w, ranks)]
        assert enc.encode(t, False) == expected
        assert enc.decode_bytes(expected) == t.encode()
    words = [w for t in texts for w in findall_bytes(name, t)]
    assert enc.encode_words(words) == [ids[p] for w in words for p in naive_encode_word(w, ranks)]


@settings(max_examples=100, deadline=None, database=None)
@given(text=text_strategy)
def test_encoder_fuzz_roundtrip_and_reference(text: str) -> None:
    enc, tokens, ids, ranks = fuzz_tokenizer()
    expected = [ids[p] for w in findall_bytes("gpt4", text) for p in naive_encode_word(w, ranks)]
    assert enc.encode(text, True) == expected
    assert enc.decode_bytes(expected) == text.encode()


@functools.lru_cache(maxsize=1)
def fuzz_tokenizer():
    return build_tokenizer(random_corpus(1500, seed=9, specials=()) + "".join(ALPHABET) * 5, 400, "gpt4", 3)


def test_encoder_specials_and_batches() -> None:
    specials = (EOT, EOT + EOT, "<|pad|>")
    enc, tokens, ids, ranks = build_tokenizer(random_corpus(500, seed=2), 100, "gpt2", 5, specials)
    eot, eot2, pad = (len(tokens) - 3, len(tokens) - 2, len(tokens) - 1)
    out = enc.encode(f"hi{EOT}{EOT}{EOT}<|pad|>", True)
    assert out[-3:] == [eot2, eot, pad]
    plain = enc.encode(f"hi{EOT}", False)
    assert eot not in plain and enc.decode_bytes(plain) == f"hi{EOT}".encode()
    docs = [random_corpus(random.Random(k).randint(0, 300), seed=k) for k in range(50)]
    one = [enc.encode(d, True) for d in docs]
    assert enc.encode_batch(docs, 1, True) == one
    assert enc.encode_batch(docs, 3, True) == one
    flat, offsets = enc.encode_batch_flat(docs, 2, True)
    assert flat.dtype.name == "uint32" and offsets.dtype.name == "int64" and len(offsets) == len(docs) + 1
    assert [flat[offsets[i]:offsets[i + 1]].tolist() for i in range(len(docs))] == one
    assert enc.encode_batch([], 2, True) == []
    big = "".join(docs) * 3  # > 4 KiB: encoded with the GIL released
    assert enc.decode_bytes(enc.encode(big, True)) == big.encode()


def test_encoder_is_thread_safe_across_python_threads() -> None:
    from concurrent.futures import ThreadPoolExecutor

    enc, *_ = build_tokenizer(random_corpus(1000, seed=4), 200, "gpt2", 1, (EOT,))
    texts = [random_corpus(3000, seed=s) for s in range(8)]  # > 4 KiB each: GIL released while encoding
    expected = [enc.encode(t, True) for t in texts]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda t: enc.encode(t, True), texts * 3))
    assert got == expected * 3


def share_while(fn) -> float:
    """Run fn on a thread; the share of its run during which this thread ran Python (best of 3).

    A call that holds the GIL lets this thread run only after it returns (at most one switch
    interval, 5 ms, before the caller stamps its end), so its share stays near 0 for a call of
    tens of milliseconds; a call that releases the GIL gives a share near 1. Best of three so
    that a scheduler that leaves this thread off the CPU for one whole call cannot fail the test.
    """
    import threading

    best = 0.0
    for _ in range(3):
        span: list[int] = []
        started = threading.Event()

        def target() -> None:
            started.set()
            span.append(time.perf_counter_ns())
            fn()
            span.append(time.perf_counter_ns())

        t = threading.Thread(target=target)
        t.start()
        started.wait()
        stamps = []
        while t.is_alive():
            stamps.append(time.perf_counter_ns())
        t.join()
        inside = [s for s in stamps if span[0] < s < span[1]]
        if len(inside) >= 2:
            best = max(best, (inside[-1] - inside[0]) / (span[1] - span[0]))
    return best


@pytest.mark.serial
def test_share_while_tells_a_held_gil_from_a_released_one() -> None:
    """The measure itself: catastrophic backtracking in `re` holds the GIL; a sleep releases it."""
    assert share_while(lambda: re.fullmatch(r"(a+)+b", "a" * 21)) < 0.3
    assert share_while(lambda: time.sleep(0.05)) > 0.6


@pytest.mark.serial
def test_heavy_calls_release_the_gil() -> None:
    text = random_corpus(400_000, seed=12)
    data = text.encode()
    c = _core.PretokenCounter(_core.PATTERN_GPT2, [EOT.encode()])
    assert share_while(lambda: c.add(data, 1)) > 0.6
    enc, *_ = build_tokenizer(random_corpus(500, seed=4), 100, "gpt2", 1, (EOT,))
    docs = [text[k:k + 5000] for k in range(0, len(text) // 2, 5000)]
    assert share_while(lambda: enc.encode_batch(docs, 1, True)) > 0.6


def test_encoder_cache_overflow_keeps_results_exact() -> None:
    """More unique pre-tokens than one cache holds (it starts over): same ids as fresh encoders."""
    corpus = random_corpus(800, seed=13)
    rng = random.Random(0)
    words = [" " + "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(8)) for _ in range(80_000)]
    enc = build_tokenizer(corpus, 200, "gpt2", 2)[0]
    got = enc.encode("".join(words), False)
    expected = []
    for k in range(0, len(words), 20_000):
        fresh = build_tokenizer(corpus, 200, "gpt2", 2)[0]
        expected += fresh.encode("".join(words[k:k + 20_000]), False)
    assert got == expected
    assert enc.encode("".join(words), False) == expected  # again, from a cache that started over


@pytest.mark.serial
def test_encoder_long_run_is_not_quadratic() -> None:
    tokens = [bytes([b]) for b in range(256)] + [b"aa", b"aaaa", b"aaaaaaaa"]
    a = ord("a")
    enc = _core.Encoder(tokens, [(a, a), (256, 256), (257, 257)], {}, _core.PATTERN_GPT2)
    t0 = time.perf_counter()
    ids = enc.encode("a" * 1_000_003, False)
    assert time.perf_counter() - t0 < 5.0
    assert ids == [258] * 125_000 + [256, a]


def test_encoder_errors() -> None:
    tokens = [bytes([b]) for b in range(256)] + [b"ab"]
    with pytest.raises(ValueError, match="byte 0"):
        _core.Encoder(tokens[1:], [], {}, 0)
    with pytest.raises(ValueError, match="not in the vocabulary"):
        _core.Encoder(tokens, [(ord("b"), ord("a"))], {}, 0)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        _core.Encoder(tokens, [(0, 999)], {}, 0)
    with pytest.raises(ValueError, match="pattern"):
        _core.Encoder(tokens, [], {}, 5)
    with pytest.raises(ValueError, match="other bytes"):
        _core.Encoder(tokens, [], {"<|x|>": 65}, 0)
    enc = _core.Encoder(tokens, [(ord("a"), ord("b"))], {"<|x|>": 1000}, 0)
    assert enc.decode_bytes([256, 1000]) == b"ab<|x|>"
    assert enc.encode("ab<|x|>b", True) == [256, 1000, ord("b")]
    for bad in (257, -1, 999, 2**40):
        with pytest.raises(ValueError, match=f"token id {bad} is out of range"):
            enc.decode_bytes([1, bad])
    with pytest.raises(ValueError, match="surrogates"):
        enc.encode("a\ud800", False)
    custom = _core.Encoder(tokens, [(ord("a"), ord("b"))], {}, _core.PATTERN_CUSTOM)
    with pytest.raises(ValueError, match="encode_words"):
        custom.encode("ab", False)
    assert custom.encode_words([b"abab", b"b"]) == [256, 256, ord("b")]


def gpt2_files(fixtures: Path) -> tuple[list[bytes], list[tuple[int, int]]]:
    byte_chars = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    extra = [b for b in range(256) if b not in byte_chars]
    char_to_byte = {chr(b): b for b in byte_chars} | {chr(256 + k): b for k, b in enumerate(extra)}
    raw = json.loads((fixtures / "gpt2_vocab.json").read_text(encoding="utf-8"))
    vocab = [b""] * len(raw)
    for s, i in raw.items():
        vocab[i] = bytes(char_to_byte[ch] for ch in s)
    ids = {t: i for i, t in enumerate(vocab)}
    merges = []
    for line in (fixtures / "gpt2_merges.txt").read_text(encoding="utf-8").splitlines():
        if line and not line.startswith("#version"):
            a, b = line.split(" ")
            merges.append((ids[bytes(char_to_byte[c] for c in a)], ids[bytes(char_to_byte[c] for c in b)]))
    return vocab, merges


def test_encoder_matches_tiktoken_gpt2(shared_fixtures: Path) -> None:
    tiktoken = pytest.importorskip("tiktoken")
    vocab, merges = gpt2_files(shared_fixtures)
    enc = _core.Encoder(vocab, merges, {EOT: 50256}, _core.PATTERN_GPT2)
    ref = tiktoken.Encoding(name="gpt2-test", pat_str=PATTERNS["gpt2"],
                            mergeable_ranks={t: i for i, t in enumerate(vocab[:50256])},
                            special_tokens={EOT: 50256})
    text = (shared_fixtures / "corpus.en").read_text(encoding="utf-8")
    text += (shared_fixtures / "tinystories_sample.txt").read_text(encoding="utf-8") + "".join(ALPHABET)
    assert enc.encode(text, True) == ref.encode(text, allowed_special="all")
    lines = text.splitlines()
    assert enc.encode_batch(lines, 2, False) == ref.encode_ordinary_batch(lines)


def test_type_stub_lists_every_public_name() -> None:
    stub = (Path(__file__).resolve().parents[2] / "lmforge" / "_core.pyi").read_text()
    names = [n for n in dir(_core) if not n.startswith("_")]
    names += [f"def {m}(" for cls in (_core.Encoder, _core.PretokenCounter) for m in vars(cls) if not m.startswith("_")]
    missing = [n for n in names if n not in stub]
    assert not missing, f"lmforge/_core.pyi is stale (regenerate it, see its header): {missing}"


# --------------------------------------------------------------------------------------------------
# Benchmarks: --quick smoke runs
# --------------------------------------------------------------------------------------------------
BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.slow
@pytest.mark.parametrize("script", ["bench_tokenizer_train.py", "bench_tokenizer_encode.py"])
def test_benchmark_quick(script: str, tmp_path: Path) -> None:
    if not (BENCH / script).exists():
        pytest.skip(f"{script} not present")
    r = subprocess.run([sys.executable, str(BENCH / script), "--quick", "--cache-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "| lmforge" in r.stdout


# --------------------------------------------------------------------------------------------------
# split_documents / crc32 / encode_spans (prepare's fast path)
# --------------------------------------------------------------------------------------------------
def _same_split(a: tuple, b: tuple) -> bool:
    import numpy as np

    return (a[0], a[1], a[5]) == (b[0], b[1], b[5]) and np.array_equal(a[2], b[2]) and np.array_equal(a[3], b[3]) \
        and (a[4] is None) == (b[4] is None) and (a[4] is None or np.array_equal(a[4], b[4]))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["a", "é", "𝄞", " ", "\n", "\t", "\u3000", "\x85", "\xa0", "\u2028", "\u200b",
                                 "\x1c", "<|eot|>", "<|eo", "\xff", "\xc3", "\xed\xa0\x80"]), max_size=40),
       st.booleans(), st.booleans())
def test_split_documents_matches_reference(parts: list[str], final: bool, want_crc: bool) -> None:
    from lmforge.corpus.sources import split_documents_reference

    # the last three items stand for invalid byte sequences
    raw = b"".join(p.encode("latin-1") if p in ("\xff", "\xc3", "\xed\xa0\x80") else p.encode() for p in parts)
    for sep in (b"<|eot|>", b"\n", b"a"):
        assert _same_split(_core.split_documents(raw, sep, final, want_crc),
                           split_documents_reference(raw, sep, final, want_crc)), (raw, sep)


def test_split_documents_strips_exactly_python_whitespace() -> None:
    """C++ strips a character iff str.strip() does: every code point below U+4000 (all of Python's
    whitespace lies there) and every lead-byte pattern above it."""
    from lmforge.corpus.sources import split_documents_reference

    cps = [c for c in list(range(0x4000)) + list(range(0x4000, 0x110000, 97)) if c != ord("|") and not 0xD800 <= c <= 0xDFFF]
    assert all(not chr(c).isspace() for c in range(0x4000, 0x110000))
    text = "|".join(f"{chr(c)}x{chr(c)}" for c in cps).encode()
    got = _core.split_documents(text, b"|", True, True)
    assert _same_split(got, split_documents_reference(text, b"|", True, True))
    stripped = [text[a:b].decode() for a, b in zip(got[2].tolist(), got[3].tolist())]
    assert stripped == [f"{chr(c)}x{chr(c)}".strip() for c in cps]


def test_crc32_matches_zlib() -> None:
    import zlib

    rng = random.Random(0)
    for n in list(range(0, 40)) + [1000, 4097]:
        data = bytes(rng.getrandbits(8) for _ in range(n))
        assert _core.crc32(data) == zlib.crc32(data)
        assert _core.crc32(data[n // 2:], _core.crc32(data[:n // 2])) == zlib.crc32(data)


def test_split_documents_rejects_empty_delimiter() -> None:
    with pytest.raises(ValueError, match="delimiter must not be empty"):
        _core.split_documents(b"abc", b"", True, False)
