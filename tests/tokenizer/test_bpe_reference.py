"""The pure-Python reference (lmforge.tokenizer.reference): worked examples, semantics, errors, and a naive oracle."""

from __future__ import annotations

import doctest
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmforge.tokenizer import reference as bpe
from lmforge.tokenizer.reference import (PATTERNS, bytes_to_unicode, encode_reference, learn_merges, pretokenize,
                         split_on_specials, train_bpe_reference, unicode_to_bytes)


def test_doctests_hold():
    failures, tried = doctest.testmod(bpe)
    assert tried >= 5 and failures == 0


def test_worked_example_aaabdaaabac():
    vocab, merges = train_bpe_reference(["aaabdaaabac"], 259)
    assert merges == [(b"a", b"a"), (b"aa", b"a"), (b"aaa", b"b")]
    assert vocab[256] == b"aa" and vocab[258] == b"aaab" and len(vocab) == 259
    assert encode_reference("aaabdaaabac", vocab, merges) == [258, ord("d"), 258, ord("a"), ord("c")]


def test_vocab_layout_bytes_then_specials_then_merges():
    vocab, merges = train_bpe_reference(["low low lower"], 262, ["<|a|>", "<|b|>"])
    assert [vocab[i] for i in range(256)] == [bytes([i]) for i in range(256)]
    assert vocab[256] == b"<|a|>" and vocab[257] == b"<|b|>"
    assert [vocab[258 + k] for k in range(len(merges))] == [a + b for a, b in merges]


def test_patterns_named_and_number_grouping():
    assert PATTERNS["gpt4"] == PATTERNS["cl100k"]
    assert pretokenize("12345", "gpt2") == ["12345"]
    assert pretokenize("12345", "gpt4") == ["123", "45"]
    assert pretokenize("12345", "nanochat") == ["12", "34", "5"]
    assert pretokenize("Hello world  \n\nHOW'S", "gpt4") == ["Hello", " world", "  \n\n", "HOW", "'S"]
    assert pretokenize("a  b", "gpt2") == ["a", " ", " b"]


def test_unknown_pattern_name_lists_names():
    with pytest.raises(ValueError, match="unknown pattern name 'gpt3'.*gpt2"):
        bpe.resolve_pattern("gpt3")
    with pytest.raises(ValueError, match=r"custom pattern '\(unclosed' is not a valid regex"):
        bpe.resolve_pattern("(unclosed")
    assert pretokenize("ab cd", r"\S+|\s+") == ["ab", " ", "cd"]


def test_special_tokens_split_longest_first():
    specials = ["<|endoftext|>", "<|endoftext|><|endoftext|>"]
    parts = split_on_specials("a<|endoftext|><|endoftext|>b<|endoftext|>", specials)
    assert parts == [("a", False), ("<|endoftext|><|endoftext|>", True), ("b", False), ("<|endoftext|>", True)]


def test_specials_never_counted_and_no_merge_across_them():
    vocab, merges = train_bpe_reference(["<|endoftext|>" * 50], 300, ["<|endoftext|>"])
    assert merges == [] and len(vocab) == 257
    # "x" and "y" are only ever adjacent across a special token or a document boundary.
    _, merges = train_bpe_reference(["x<|s|>y<|s|>" * 20, "x", "y"], 300, ["<|s|>"])
    assert (b"x", b"y") not in merges and (b"y", b"x") not in merges
    _, merges = train_bpe_reference(["abab", "cdcd"], 300)
    assert all(a + b in (b"ab", b"cd", b"abab", b"cdcd", b"ba", b"dc", b"bab", b"dcd", b"aba", b"cdc")
               for a, b in merges)


def test_tie_break_lexicographically_greatest_pair():
    # (a,b) and (c,d) both occur twice: the greater pair of bytes is merged first.
    _, merges = train_bpe_reference(["ab cd ab cd"], 257)
    assert merges == [(b"c", b"d")]
    # Comparison is on (left, right) bytes: (b"b", b"a") > (b"a", b"z").
    _, merges = train_bpe_reference(["az ba"], 257)
    assert merges == [(b"b", b"a")]


def test_stops_when_no_pair_left():
    vocab, merges = train_bpe_reference(["ab"], 1000)
    assert merges == [(b"a", b"b")] and len(vocab) == 257


def test_empty_corpus_returns_base_vocab():
    vocab, merges = train_bpe_reference([], 500, ["<|endoftext|>"])
    assert merges == [] and vocab == bpe.base_vocab(["<|endoftext|>"])
    vocab, merges = train_bpe_reference([""], 300)
    assert merges == [] and len(vocab) == 256


@pytest.mark.parametrize("vocab_size,specials", [(255, None), (256, ["<|x|>"]), (257, ["<|a|>", "<|b|>"])])
def test_vocab_size_too_small(vocab_size, specials):
    with pytest.raises(ValueError, match="vocab_size=.* is too small"):
        train_bpe_reference(["abc"], vocab_size, specials)


@pytest.mark.parametrize("specials,msg", [(["<|a|>", "<|a|>"], "given twice"), ([""], "non-empty"),
                                          ("<|a|>", "list of strings"), ([b"<|a|>"], "must be strings")])
def test_bad_special_tokens(specials, msg):
    with pytest.raises(ValueError, match=msg):
        train_bpe_reference(["abc"], 300, specials)


def test_bytes_to_unicode_is_printable_bijection():
    m = bytes_to_unicode()
    assert len(set(m.values())) == 256 and all(c.isprintable() and not c.isspace() for c in m.values())
    assert all(unicode_to_bytes()[c] == b for b, c in m.items())
    assert m[ord(" ")] == "Ġ" and m[ord("\n")] == "Ċ" and m[0] == "Ā"


def _naive_merges(words: Counter, num_merges: int) -> list[tuple[bytes, bytes]]:
    """Recount every pair from scratch after each merge: obviously right, and slow."""
    seqs = {w: [bytes([b]) for b in w] for w in words}
    merges = []
    for _ in range(num_merges):
        pairs: Counter = Counter()
        for w, seq in seqs.items():
            for p in zip(seq, seq[1:]):
                pairs[p] += words[w]
        if not pairs:
            break
        best = max(pairs, key=lambda p: (pairs[p], p))
        merges.append(best)
        seqs = {w: bpe._merge_word(seq, best) for w, seq in seqs.items()}
    return merges


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.binary(min_size=1, max_size=8), st.integers(1, 5), max_size=30), st.integers(0, 40))
def test_incremental_merges_equal_naive_recount(words, num_merges):
    assert learn_merges(words, num_merges) == _naive_merges(Counter(words), num_merges)


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.sampled_from("ab c\n'é1<|>"), max_size=60))
def test_reference_roundtrip_with_specials(text):
    vocab, merges = train_bpe_reference([text, "ab ab cab"], 280, ["<|>"])
    ids = encode_reference(text, vocab, merges, ["<|>"])
    assert bpe.decode_reference(ids, vocab) == text
    assert ids.count(256) == text.count("<|>")


def test_corpus_en_merges_match_cs336(shared_fixtures):
    text = (shared_fixtures / "corpus.en").read_text(encoding="utf-8")
    vocab, merges = train_bpe_reference([text], 500, ["<|endoftext|>"])
    assert len(vocab) == 500 and len(merges) == 243
    # The first merges of the CS336 assignment-1 reference solution on this corpus.
    assert merges[:5] == [(b" ", b"t"), (b" ", b"a"), (b"h", b"e"), (b"i", b"n"), (b" t", b"he")]
    assert b"<|endoftext|>" in vocab.values()
