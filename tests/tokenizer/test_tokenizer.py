"""train_bpe (fast path) and Tokenizer, held to the pure-Python reference and to tiktoken's GPT-2."""

from __future__ import annotations

import os
import tracemalloc

import numpy as np
import pytest
from conftest import characters, make_corpus_text, make_documents
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lmforge.tokenizer.tokenizer as tokmod
from lmforge.tokenizer.reference import PATTERNS, encode_reference, train_bpe_reference
from lmforge.tokenizer import Tokenizer, train_bpe, train_bpe_from_iterator

EOT = "<|endoftext|>"
_TEXT = st.text(alphabet=st.sampled_from("ab cd\n\t'sé世1234!.<|endoftext|>"), max_size=80)


# --------------------------------------------------------------------------------------------------
# train_bpe == reference
# --------------------------------------------------------------------------------------------------
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(docs=st.lists(_TEXT, min_size=1, max_size=3), vocab_size=st.integers(257, 330),
       pattern=st.sampled_from(["gpt2", "gpt4", "nanochat"]), chunk=st.sampled_from([7, 64, 1 << 20]))
def test_train_bpe_equals_reference_on_random_files(tmp_path_factory, docs, vocab_size, pattern, chunk):
    d = tmp_path_factory.mktemp("c")
    paths = []
    for k, doc in enumerate(docs):
        paths.append(d / f"{k}.txt")
        paths[-1].write_bytes(doc.encode("utf-8"))
    if not any(doc.replace(EOT, "").strip() for doc in docs):  # nothing but whitespace and specials
        with pytest.raises(ValueError, match="no text to train on"):
            train_bpe(paths, vocab_size, [EOT], pattern=pattern, progress=False, chunk_bytes=chunk)
        return
    got = train_bpe(paths, vocab_size, [EOT], pattern=pattern, progress=False, chunk_bytes=chunk)
    assert got == train_bpe_reference(docs, vocab_size, [EOT], pattern)


@pytest.mark.parametrize("specials", [[EOT], []])
def test_train_bpe_chunking_does_not_change_result(tmp_path, specials):
    text = make_corpus_text(60, seed=3)
    p = tmp_path / "c.txt"
    p.write_text(text, encoding="utf-8")
    want = train_bpe_reference(text.split(EOT), 420, specials)  # the delimiter separates documents either way
    for chunk in (50, 997, 1 << 25):
        assert train_bpe(p, 420, specials, progress=False, chunk_bytes=chunk) == want


def test_train_bpe_corpus_en_equals_reference(shared_fixtures):
    path = shared_fixtures / "corpus.en"
    vocab, merges = train_bpe(path, 500, [EOT], progress=False)
    assert (vocab, merges) == train_bpe_reference([path.read_text(encoding="utf-8")], 500, [EOT])


def test_train_bpe_from_iterator_and_custom_pattern(tmp_path):
    docs = make_documents(30, seed=5)
    assert train_bpe_from_iterator(docs, 350, [EOT], progress=False, batch_bytes=500) == \
        train_bpe_reference(docs, 350, [EOT])
    assert train_bpe_from_iterator(docs, 350, progress=False) == train_bpe_reference(docs, 350)
    custom = r"\S+|\s+"
    p = tmp_path / "c.txt"
    p.write_text(EOT.join(docs), encoding="utf-8")
    assert train_bpe(p, 350, [EOT], pattern=custom, progress=False) == train_bpe_reference(docs, 350, [EOT], custom)


def test_train_bpe_bad_inputs(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        train_bpe(tmp_path / "missing.txt", 300, progress=False)
    with pytest.raises(ValueError, match="holds no .txt/.jsonl/.parquet files"):
        train_bpe(tmp_path, 300, progress=False)
    with pytest.raises(ValueError, match="matches no files"):
        train_bpe(str(tmp_path / "*.txt"), 300, progress=False)
    with pytest.raises(ValueError, match="no input files"):
        train_bpe([], 300, progress=False)
    p = tmp_path / "ok.txt"
    p.write_text("hello world", encoding="utf-8")
    with pytest.raises(ValueError, match="too small"):
        train_bpe(p, 256, [EOT], progress=False)
    with pytest.raises(ValueError, match="given twice"):
        train_bpe(p, 300, [EOT, EOT], progress=False)
    with pytest.raises(ValueError, match="non-empty"):
        train_bpe(p, 300, [""], progress=False)
    with pytest.raises(ValueError, match="unknown pattern name 'gpt3'"):
        train_bpe(p, 300, pattern="gpt3", progress=False)
    with pytest.raises(ValueError, match="errors must be"):
        train_bpe(p, 300, errors="ignore", progress=False)


def test_train_bpe_unreadable_file(tmp_path, monkeypatch):
    p = tmp_path / "secret.txt"
    p.write_text("x", encoding="utf-8")
    p.chmod(0)
    monkeypatch.setattr(os, "access", lambda *a, **k: False)  # root could read it anyway
    with pytest.raises(ValueError, match="not readable"):
        train_bpe(p, 300, progress=False)


def test_train_bpe_invalid_utf8_says_where_and_replace_works(tmp_path):
    p = tmp_path / "bad.txt"
    p.write_bytes(b"hello world " * 10 + b"\xff\xfe oops")
    with pytest.raises(ValueError, match=r"bad.txt is not valid UTF-8 at byte offset 120.*errors='replace'"):
        train_bpe(p, 300, progress=False)
    got = train_bpe(p, 300, errors="replace", progress=False)
    assert got == train_bpe_reference([p.read_bytes().decode("utf-8", errors="replace")], 300)


@pytest.mark.parametrize("name,data", [
    ("empty.txt", b""), ("blank.txt", "  \n\n\t \u3000".encode()),
    ("specials.txt", f"{EOT}\n{EOT} {EOT}".encode()), ("empty.jsonl", b'{"text": ""}\n{"text": "  "}\n'),
])
def test_train_bpe_refuses_a_corpus_without_text(tmp_path, name, data):
    p = tmp_path / name
    p.write_bytes(data)
    with pytest.raises(ValueError, match="no text to train on .*--text-field.*--delimiter"):
        train_bpe(p, 1000, [EOT], progress=False)
    with pytest.raises(ValueError, match="no text to train on"):
        train_bpe_from_iterator(["", " \n"], 1000, [EOT], progress=False)


def test_train_bpe_warns_when_the_vocab_size_cannot_be_reached(tmp_path, caplog):
    p = tmp_path / "small.txt"
    p.write_text("ab ab ab", encoding="utf-8")
    with caplog.at_level("WARNING", logger="lmforge"):
        vocab, merges = train_bpe(p, 1000, [EOT], progress=False)
    assert (vocab, merges) == train_bpe_reference(["ab ab ab"], 1000, [EOT]) and len(vocab) == 259
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "vocab_size=1000 cannot be reached" in warnings[0]
    assert "at vocab size 259 " in warnings[0] and "at most 259" in warnings[0]
    caplog.clear()
    with caplog.at_level("WARNING", logger="lmforge"):
        train_bpe(p, 259, [EOT], progress=False)
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def _write_formats(d, docs: list[str]) -> dict[str, object]:
    """The same documents as every input kind train_bpe reads; returns name -> what to pass."""
    import gzip
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    d.mkdir()
    text = EOT.join(docs).encode()
    jsonl = "".join(json.dumps({"id": i, "body": t}) + "\n" for i, t in enumerate(docs)).encode()
    (d / "c.txt").write_bytes(text)
    (d / "c.txt.gz").write_bytes(gzip.compress(text))
    (d / "c.txt.zst").write_bytes(zstandard.ZstdCompressor().compress(text))
    (d / "c.jsonl").write_bytes(jsonl)
    (d / "c.jsonl.gz").write_bytes(gzip.compress(jsonl))
    (d / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(jsonl))
    pq.write_table(pa.table({"body": docs}), d / "c.parquet", row_group_size=7)
    half = len(docs) // 2  # file boundaries are document boundaries
    (d / "dir").mkdir()
    (d / "dir" / "a.txt").write_bytes(EOT.join(docs[:half]).encode())
    (d / "dir" / "b.jsonl").write_bytes(b"".join(jsonl.splitlines(True)[half:]))
    (d / "glob").mkdir()
    for i in range(0, len(docs), 10):
        (d / "glob" / f"p{i:03d}.txt").write_bytes(EOT.join(docs[i:i + 10]).encode())
    return {k: d / k for k in ("c.txt", "c.txt.gz", "c.txt.zst", "c.jsonl", "c.jsonl.gz", "c.jsonl.zst",
                               "c.parquet", "dir")} | {"glob": str(d / "glob" / "p*.txt")}


@pytest.mark.parametrize("specials", [[EOT], [], ["<|s|>"]])
def test_train_bpe_reads_every_input_kind_like_prepare(tmp_path, specials):
    """txt == jsonl == parquet == compressed == directory == glob, and each == the reference on the documents."""
    docs = make_documents(60, seed=3)
    inputs = _write_formats(tmp_path / "in", docs)
    want = train_bpe_reference(docs, 420, specials)
    for name, path in inputs.items():
        assert train_bpe(path, 420, specials, text_field="body", progress=False) == want, name


def test_train_bpe_merges_never_cross_documents(tmp_path):
    docs = ["x", "y"] * 50  # no pair inside a document; "xy" / "yx" everywhere across boundaries
    inputs = _write_formats(tmp_path / "in", docs)
    for specials in ([EOT], []):
        for name, path in inputs.items():
            vocab, merges = train_bpe(path, 300, specials, text_field="body", progress=False)
            assert merges == [], (name, specials)
    (tmp_path / "b.txt").write_text("xx\n\nyy xy\n \nyx", encoding="utf-8")
    got = train_bpe(tmp_path / "b.txt", 300, delimiter="blankline", progress=False)
    assert got == train_bpe_reference(["xx", "yy xy", "yx"], 300)
    (tmp_path / "l.jsonl").write_text('{"text": "x<|endoftext|>y"}\n', encoding="utf-8")
    assert train_bpe(tmp_path / "l.jsonl", 300, delimiter="line", progress=False) == \
        train_bpe_reference(["x<|endoftext|>y"], 300)  # "line" splits text files only; no string to skip


def test_train_bpe_delimiter_is_never_counted(tmp_path):
    p = tmp_path / "c.txt"
    p.write_text("ab cd<|endoftext|>ab<|endoftext|>cd ab", encoding="utf-8")
    assert train_bpe(p, 300, progress=False) == train_bpe_reference(["ab cd", "ab", "cd ab"], 300)
    p.write_text("ab cd##ab##cd ab", encoding="utf-8")
    assert train_bpe(p, 300, [EOT], delimiter="##", progress=False) == \
        train_bpe_reference(["ab cd", "ab", "cd ab"], 300, [EOT])
    with pytest.raises(ValueError, match="delimiter must be a non-empty string"):
        train_bpe(p, 300, delimiter="", progress=False)


def test_train_bpe_reader_errors_name_the_file(tmp_path):
    (tmp_path / "raw.jsonl").write_text('{"txt": "typo"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"raw.jsonl:1: no field 'text' \(found \['txt'\]\)"):
        train_bpe(tmp_path / "raw.jsonl", 300, progress=False)
    (tmp_path / "cut.txt.gz").write_bytes(__import__("gzip").compress(b"hello world " * 1000)[:50])
    with pytest.raises(ValueError, match="cut.txt.gz: cannot be read .*complete"):
        train_bpe(tmp_path / "cut.txt.gz", 300, progress=False)
    (tmp_path / "bad.jsonl").write_bytes(b'{"text": "ok \xff"}\n{"text": "fine text"}\n')
    with pytest.raises(ValueError, match="bad.jsonl.*invalid UTF-8"):
        train_bpe(tmp_path / "bad.jsonl", 300, progress=False)
    assert train_bpe(tmp_path / "bad.jsonl", 300, errors="replace", progress=False) == \
        train_bpe_reference(["ok \ufffd", "fine text"], 300)


def test_train_bpe_each_file_is_a_document(tmp_path):
    (tmp_path / "a.txt").write_text("xy" * 5 + "x", encoding="utf-8")
    (tmp_path / "b.txt").write_text("y" + "zz", encoding="utf-8")
    got = train_bpe([tmp_path / "a.txt", tmp_path / "b.txt"], 300, progress=False)
    assert got == train_bpe_reference(["xy" * 5 + "x", "yzz"], 300)


# --------------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------------
def test_special_modes(tiny_tokenizer):
    tok = tiny_tokenizer
    text = f"the cat{EOT}a dog"
    ids = tok.encode(text)
    assert ids.count(tok.eot_id) == 1 and tok.decode(ids) == text
    plain = tok.encode(text, special="plain")
    assert tok.eot_id not in plain and tok.decode(plain) == text
    with pytest.raises(ValueError, match=r"special token '<\|endoftext\|>' at character 7"):
        tok.encode(text, special="disallowed")
    assert tok.encode("the cat", special="disallowed") == tok.encode("the cat")
    with pytest.raises(ValueError, match="special must be"):
        tok.encode("x", special="yes")


def test_overlapping_specials_longest_first(tiny_tokenizer):
    double = EOT + EOT
    tok = Tokenizer(tiny_tokenizer.vocab, tiny_tokenizer.merges, [EOT, double])
    ids = tok.encode(f"a{double}b{EOT}")
    assert tok.special_tokens[double] in ids and ids.count(tok.eot_id) == 1
    assert tok.decode(ids) == f"a{double}b{EOT}"


def test_decode_errors_and_invalid_utf8(tiny_tokenizer):
    tok = tiny_tokenizer
    with pytest.raises(ValueError, match=r"token id 400 is out of range \[0, 400\)"):
        tok.decode([1, 400])
    with pytest.raises(ValueError, match="token id -1 is out of range"):
        tok.decode([-1])
    assert tok.decode([0xE4, 0xBD]) == "\ufffd"  # a truncated 3-byte character
    assert tok.decode([ord("a"), 0xFF, ord("b")]) == "a\ufffdb"
    assert tok.decode_bytes([0xE4, 0xBD, 0xA0]) == "你".encode()


def test_properties_and_lookups(tiny_tokenizer):
    tok = tiny_tokenizer
    assert tok.vocab_size == 400 and tok.special_tokens == {EOT: 256} and tok.eot_id == 256
    assert tok.id_to_token(97) == b"a" and tok.token_to_id("a") == 97 and tok.token_to_id(EOT) == 256
    with pytest.raises(ValueError, match="not in the vocabulary"):
        tok.token_to_id(b"zzzzzzzz")
    no_eot = Tokenizer(tok.vocab, tok.merges)
    assert no_eot.eot_id is None


def test_fingerprint_stable_and_sensitive(tiny_tokenizer):
    tok = tiny_tokenizer
    same = Tokenizer(dict(tok.vocab), list(tok.merges), [EOT], backend="python")
    assert tok.fingerprint() == same.fingerprint() and len(tok.fingerprint()) == 16
    assert Tokenizer(tok.vocab, tok.merges, [EOT], "gpt4").fingerprint() != tok.fingerprint()
    assert Tokenizer(tok.vocab, tok.merges[:-1], [EOT]).fingerprint() != tok.fingerprint()
    assert Tokenizer(tok.vocab, tok.merges, [EOT], "gpt4").fingerprint() == \
        Tokenizer(tok.vocab, tok.merges, [EOT], "cl100k").fingerprint()


def test_constructor_validates_vocab(tiny_tokenizer):
    v, m = dict(tiny_tokenizer.vocab), tiny_tokenizer.merges
    with pytest.raises(ValueError, match="without gaps; id 5 is missing"):
        Tokenizer({k: b for k, b in v.items() if k != 5}, [])
    with pytest.raises(ValueError, match="lacks the single byte"):
        Tokenizer({i: bytes([i]) for i in range(255)} | {255: b"ab"}, [])
    with pytest.raises(ValueError, match="merge 0 .* not in the vocab"):
        Tokenizer(v, [(b"q", b"qqqqqqqqqq")] + m)
    with pytest.raises(ValueError, match="backend must be"):
        Tokenizer(v, m, backend="rust")
    tok = Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|new|>"])
    assert tok.special_tokens == {"<|new|>": 256}  # missing specials are appended (CS336)


@settings(max_examples=150, deadline=None)
@given(text=_TEXT)
def test_roundtrip_and_fast_equals_reference(tiny_tokenizer, text):
    tok = tiny_tokenizer
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode(text, special="plain")) == text
    assert ids == encode_reference(text, tok.vocab, tok.merges, [EOT])
    assert ids == Tokenizer(tok.vocab, tok.merges, [EOT], backend="python").encode(text)


@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=60))
def test_roundtrip_arbitrary_unicode(tiny_tokenizer, text):
    assert tiny_tokenizer.decode(tiny_tokenizer.encode(text)) == text


@pytest.mark.parametrize("pattern", ["gpt4", "nanochat", r"\S+|\s+"])
def test_other_patterns_encode_like_reference(pattern):
    docs = make_documents(20, seed=1)
    vocab, merges = train_bpe_reference(docs, 360, [EOT], pattern)
    tok = Tokenizer(vocab, merges, [EOT], pattern)
    text = EOT.join(make_documents(5, seed=9))
    assert tok.encode(text) == encode_reference(text, vocab, merges, [EOT], pattern)
    assert tok.decode(tok.encode(text)) == text


def test_encode_batch_and_flat(tiny_tokenizer):
    docs = make_documents(12, seed=2) + ["", EOT]
    want = [tiny_tokenizer.encode(d) for d in docs]
    assert tiny_tokenizer.encode_batch(docs, num_threads=2) == want
    tokens, offsets = tiny_tokenizer.encode_batch_flat(docs, num_threads=2)
    assert tokens.dtype == np.uint32 and offsets.dtype == np.int64 and len(offsets) == len(docs) + 1
    assert [tokens[offsets[k]:offsets[k + 1]].tolist() for k in range(len(docs))] == want
    tokens, offsets = tiny_tokenizer.encode_batch_flat([])
    assert len(tokens) == 0 and offsets.tolist() == [0]


def test_encode_iterable_equals_encode_across_cuts(tiny_tokenizer, monkeypatch):
    monkeypatch.setattr(tokmod, "_STREAM_CHUNK", 16)  # force a cut attempt after nearly every line
    text = make_corpus_text(30, seed=4) + "\n  a b" + "Zz" + "\n" + EOT + " the end  \n\n"
    lines = text.splitlines(keepends=True)
    assert list(tiny_tokenizer.encode_iterable(lines)) == tiny_tokenizer.encode(text)
    # A special token containing a cut point ("x y") must not be split across the cut.
    tok = Tokenizer(tiny_tokenizer.vocab, tiny_tokenizer.merges, [EOT, "the cat"])
    text2 = "a the cat sat, the dog sat, the cat! " * 20
    assert list(tok.encode_iterable([text2[i:i + 5] for i in range(0, len(text2), 5)])) == tok.encode(text2)


def test_encode_iterable_fixture_files(shared_fixtures):
    tok = Tokenizer.from_files(shared_fixtures / "gpt2_vocab.json", shared_fixtures / "gpt2_merges.txt", [EOT])
    for name in ("tinystories_sample.txt", "corpus.en", "special_token_double_newlines_non_whitespace.txt"):
        with open(shared_fixtures / name, encoding="utf-8") as f:
            streamed = list(tok.encode_iterable(f))
        assert streamed == tok.encode((shared_fixtures / name).read_text(encoding="utf-8")), name


@pytest.mark.slow
def test_encode_iterable_memory_is_flat(tiny_tokenizer, tmp_path):
    p = tmp_path / "big.txt"
    text = make_corpus_text(200, seed=8)
    with open(p, "w", encoding="utf-8") as f:
        for _ in range(2_000_000 // len(text) + 1):
            f.write(text)
    size = p.stat().st_size
    tracemalloc.start()
    n = 0
    with open(p, encoding="utf-8") as f:
        for _ in tiny_tokenizer.encode_iterable(f):
            n += 1
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert n > size // 4 and peak < size / 10, (peak, size)  # ~20x smaller in practice


def test_gpt2_matches_tiktoken_exactly(shared_fixtures):
    import tiktoken

    tok = Tokenizer.from_files(shared_fixtures / "gpt2_vocab.json", shared_fixtures / "gpt2_merges.txt", [EOT])
    ranks = {b: i for i, b in tok.vocab.items() if i != 50256}
    ref = tiktoken.Encoding("gpt2-offline", pat_str=PATTERNS["gpt2"], mergeable_ranks=ranks,
                            special_tokens={EOT: 50256})
    texts = [p.read_text(encoding="utf-8") for p in sorted(shared_fixtures.glob("*.txt"))]
    texts += [(shared_fixtures / "corpus.en").read_text(encoding="utf-8"), "Héllo 世界 🙂 don't  \n\n 12345"]
    for text in texts:
        assert tok.encode(text) == ref.encode(text, allowed_special="all")
        assert tok.decode(tok.encode(text)) == text
    assert tok.eot_id == 50256 and tok.vocab_size == 50257


def test_fast_backend_is_used_when_built(tiny_tokenizer):
    core = pytest.importorskip("lmforge._core")
    if not hasattr(core, "Encoder"):
        pytest.skip("lmforge._core.Encoder is not built yet")
    assert tiny_tokenizer.backend == "cpp"
    assert Tokenizer(tiny_tokenizer.vocab, tiny_tokenizer.merges, backend="python").backend == "python"


def test_train_bpe_streams_in_bounded_chunks_and_logs(tmp_path, monkeypatch, caplog):
    import lmforge.tokenizer.training as tt

    p = tmp_path / "c.txt"
    p.write_text(make_corpus_text(150, seed=6), encoding="utf-8")
    sizes: list[int] = []
    real_add = tt._Counting.add
    monkeypatch.setattr(tt._Counting, "add", lambda self, data: (sizes.append(len(data)), real_add(self, data)))
    monkeypatch.setattr(tt.logger, "propagate", True)  # the CLI tests may have configured it for stderr
    with caplog.at_level("INFO", logger="lmforge"):
        got = train_bpe(p, 400, [EOT], progress=False, chunk_bytes=2000)
    assert got == train_bpe_reference([p.read_text(encoding="utf-8")], 400, [EOT])
    assert len(sizes) > 10 and max(sizes) <= 4000 and sum(sizes) == p.stat().st_size
    assert any("MB/s" in r.message and "unique pre-tokens" in r.message for r in caplog.records)


@settings(max_examples=40, deadline=None)
@given(docs=st.lists(st.text(characters(), max_size=40), min_size=1, max_size=3),
       pattern=st.sampled_from(["gpt2", "gpt4"]))
def test_full_unicode_training_and_encoding_match_reference(docs, pattern):
    if not any(d.replace(EOT, "").strip() for d in docs):
        with pytest.raises(ValueError, match="no text to train on"):
            train_bpe_from_iterator(docs, 300, [EOT], pattern=pattern, progress=False)
        return
    ref = train_bpe_reference(docs, 300, [EOT], pattern)
    assert train_bpe_from_iterator(docs, 300, [EOT], pattern=pattern, progress=False) == ref
    tok = Tokenizer(*ref, [EOT], pattern)
    for d in docs:
        assert tok.encode(d) == encode_reference(d, *ref, [EOT], pattern)


_STREAM_TEXT = st.lists(st.sampled_from(["a", "b", "Ab", " ", "  ", "\n", "'s", "1", "!", "é", EOT, "x y", "x"]),
                        max_size=40).map("".join)


@settings(max_examples=80, deadline=None)
@given(text=_STREAM_TEXT, cuts=st.lists(st.integers(0, 120), max_size=12),
       pattern=st.sampled_from(["gpt2", "gpt4", "nanochat"]))
def test_encode_iterable_equals_encode_for_any_split(tiny_tokenizer, text, cuts, pattern):
    tok = Tokenizer(tiny_tokenizer.vocab, tiny_tokenizer.merges, [EOT, "x y"], pattern)
    bounds = sorted({0, len(text), *(c for c in cuts if c < len(text))})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    old = tokmod._STREAM_CHUNK
    tokmod._STREAM_CHUNK = 4  # look for a cut after almost every piece
    try:
        assert list(tok.encode_iterable(pieces)) == tok.encode(text)
    finally:
        tokmod._STREAM_CHUNK = old


def test_train_bpe_long_document_between_specials_is_still_chunked(tmp_path, monkeypatch):
    import lmforge.tokenizer.training as tt

    text = make_corpus_text(2, seed=2).replace(EOT, " ") * 20 + EOT + "the end"
    p = tmp_path / "long.txt"
    p.write_text(text, encoding="utf-8")
    sizes: list[int] = []
    real_add = tt._Counting.add
    monkeypatch.setattr(tt._Counting, "add", lambda self, data: (sizes.append(len(data)), real_add(self, data)))
    assert train_bpe(p, 350, [EOT], progress=False, chunk_bytes=500) == train_bpe_reference([text], 350, [EOT])
    assert max(sizes) <= 1000 and len(sizes) > 5
    sizes.clear()  # a special token holding " <letter>" could straddle a space cut: only cut at specials
    assert train_bpe(p, 350, ["the end"], progress=False, chunk_bytes=500) == \
        train_bpe_reference(text.split(EOT), 350, ["the end"])  # the delimiter <|endoftext|> is not counted


def test_train_from_iterator_lone_surrogates():
    with pytest.raises(ValueError, match="document 1 is not valid UTF-8 at byte offset 2"):
        train_bpe_from_iterator(["ok", "ab\ud800cd"], 300, progress=False)
    got = train_bpe_from_iterator(["ok", "ab\ud800cd"], 300, progress=False, errors="replace")
    assert got == train_bpe_reference(["ok", "ab\ufffd\ufffd\ufffdcd"], 300)


def test_decode_refuses_floats_bools_and_negative_ids(tiny_tokenizer) -> None:
    """``int(3.7)`` would decode token 3; a negative id would index from the end: both are refused."""
    import numpy as np
    import torch

    tok = tiny_tokenizer
    ids = tok.encode("the cat")
    assert tok.decode(np.array(ids, dtype=np.int64)) == tok.decode(torch.tensor(ids)) == "the cat"
    for bad, msg in (([1.0], "must be integers, got 1.0"), ([3.7], "must be integers"), ([True], "got True"),
                     (np.array([1.5]), "array of float64"), (torch.tensor([1.0]), "array of torch.float32"),
                     ([-1], r"token id -1 is out of range"), (["7"], "must be integers, got '7'")):
        with pytest.raises(ValueError, match=msg):
            tok.decode(bad)
    with pytest.raises(ValueError, match="out of range"):
        tok.id_to_token(-1)


def test_train_bpe_on_text_does_not_import_numpy(tmp_path):
    """The fast path's memory is the pre-token table: importing the readers must not add numpy (~13 MB RSS)."""
    import subprocess
    import sys

    p = tmp_path / "c.txt"
    p.write_text(make_corpus_text(5), encoding="utf-8")
    code = ("import sys; from lmforge.tokenizer import train_bpe; "
            f"train_bpe({str(p)!r}, 300, ['<|endoftext|>'], progress=False); print('numpy' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "False"
