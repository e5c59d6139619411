"""lmforge._core's tokenizer bindings on input no Python str could hold: byte spans that are not whole UTF-8
(``encode_spans`` read past its span, and past the buffer, where a lead byte promised more), arrays that say
they live on a GPU, and counts whose sums overflow int64."""

from __future__ import annotations

import numpy as np
import pytest
from native_helpers import cuda_labelled

from lmforge.tokenizer import Tokenizer

_core = pytest.importorskip("lmforge._core")


def _bytes_tokenizer(backend: str = "cpp") -> Tokenizer:
    return Tokenizer({i: bytes([i]) for i in range(256)}, [], pattern="gpt4", backend=backend)


def _spans(buf: bytes, starts: list[int], ends: list[int], backend: str = "cpp") -> bytes:
    tokens, lengths = _bytes_tokenizer(backend).encode_spans(buf, np.array(starts), np.array(ends))
    assert lengths.sum() == len(tokens)
    return bytes(tokens.astype(np.uint8))  # one token per byte: the bytes the encoder read


@pytest.mark.parametrize("buf, start, end", [
    (b"hi \xf0TOKEN=secret", 0, 4),  # a 4-byte lead at the span's end: it read TOK from past the span
    (b"hi \xf0", 0, 4),  # ... and past the buffer (a heap-buffer-overflow read under ASan)
    (b"caf\xc3\xa9", 0, 4),  # a span that cuts a character
    (b"caf\xc3\xa9", 4, 5),  # a span that starts inside one
    (b"a\xff b", 0, 4),  # a byte that starts nothing
    (b"\xed\xa0\x80", 0, 3),  # a surrogate, as Python's decoder refuses it
])
def test_encode_spans_refuses_a_span_that_is_not_whole_utf8(buf: bytes, start: int, end: int) -> None:
    with pytest.raises(ValueError, match=r"^encode_spans: span 0 is not valid UTF-8 \(at byte \d+ of the buffer\)$"):
        _spans(buf, [start], [end])
    with pytest.raises(ValueError):  # the pure-Python path refuses it as well (UnicodeDecodeError)
        _spans(buf, [start], [end], backend="python")


def test_encode_spans_names_the_bad_span_and_reads_only_the_good_ones() -> None:
    buf = "héllo wörld ".encode() + b"\xe2\x82"
    assert _spans(buf, [0, 6], [6, 13]) == "héllo wörld".encode()
    with pytest.raises(ValueError, match=r"span 1 is not valid UTF-8 \(at byte 14 of the buffer\)"):
        _spans(buf, [0, 6], [6, 16])
    with pytest.raises(ValueError, match=r"span 1 \[3, 17\) is outside the buffer of 16 bytes"):
        _spans(buf, [0, 3], [1, 17])


def test_encode_spans_arrays_must_be_on_the_cpu() -> None:
    enc = _bytes_tokenizer()._core
    buf, starts, ends = b"hello world", np.array([0], np.int64), np.array([5], np.int64)
    assert enc.encode_spans(buf, starts, ends, 1, True, -1, -1, 4)[0].tolist() == list(b"hello")
    with pytest.raises(TypeError):
        enc.encode_spans(buf, cuda_labelled(starts), ends, 1, True, -1, -1, 4)
    with pytest.raises(TypeError):
        enc.encode_spans(buf, starts, cuda_labelled(ends), 1, True, -1, -1, 4)


def test_pretoken_counts_that_overflow_int64_are_refused() -> None:
    c = _core.PretokenCounter(_core.PATTERN_CUSTOM, [])
    c.add_counts([b"a"], [2**62])
    with pytest.raises(ValueError, match="total count would exceed 2\\*\\*63 - 1; nothing was added"):
        c.add_counts([b"b", b"c"], [2**62, 2**62])  # was a total of -2**63
    assert c.total() == 2**62 and c.items() == [(b"a", 2**62)]
    c.add_counts([b"a"], [2**62 - 1])
    assert c.total() == 2**63 - 1 and c.items() == [(b"a", 2**63 - 1)]


def test_bpe_pair_counts_that_overflow_int64_are_refused() -> None:
    c = _core.PretokenCounter(_core.PATTERN_CUSTOM, [])
    c.add_counts([b"aaaa"], [2**62])  # the pair (a, a) three times: 3 * 2**62 (it wrapped, and no merge was made)
    with pytest.raises(ValueError, match="pair counts .* exceed 2\\*\\*63 - 1"):
        _core.train_bpe(c, 2)
    c = _core.PretokenCounter(_core.PATTERN_CUSTOM, [])
    c.add_counts([b"aaaa"], [2**61])  # 3 * 2**61 fits
    assert _core.train_bpe(c, 2) == [(b"a", b"a"), (b"aa", b"aa")]
