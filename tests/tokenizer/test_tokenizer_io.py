"""Tokenizer file formats: lmforge JSON, GPT-2 files, HF tokenizer.json, tiktoken -- round trips and bad files."""

from __future__ import annotations

import json

import pytest
from conftest import make_corpus_text, make_documents
from hypothesis import given, settings
from hypothesis import strategies as st

from lmforge.tokenizer import formats as tokenizer_io
from lmforge.tokenizer.reference import train_bpe_reference
from lmforge.tokenizer import Tokenizer, load_tokenizer

EOT = "<|endoftext|>"


@pytest.fixture(scope="module", params=["gpt2", "gpt4"])
def trained(request):
    vocab, merges = train_bpe_reference(make_corpus_text(60, seed=11).split(EOT), 450, [EOT], request.param)
    return Tokenizer(vocab, merges, [EOT], request.param)


def _texts():
    return [make_corpus_text(8, seed=21), "Héllo 世界 🙂 don't  \n\n 12345 x\\y\t!", f"a{EOT}{EOT}b", ""]


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=12))
def test_escape_roundtrip(b):
    s = tokenizer_io.escape_token(b)
    assert tokenizer_io.unescape_token(s) == b and s.isascii()


def test_escape_is_readable_for_ascii():
    assert tokenizer_io.escape_token(b" the") == " the"
    with pytest.raises(ValueError, match="bad escape"):
        tokenizer_io.unescape_token("\\q")
    with pytest.raises(ValueError, match="two hex digits"):
        tokenizer_io.unescape_token("\\xZZ")


# --------------------------------------------------------------------------------------------------
# lmforge JSON
# --------------------------------------------------------------------------------------------------
def test_save_load_roundtrip(trained, tmp_path):
    p = tmp_path / "tok.json"
    trained.save(p)
    text = p.read_text(encoding="utf-8")
    head = json.loads(text)
    assert head["format"] == "lmforge-bpe" and head["version"] == 1 and head["pattern"] == trained.pattern
    assert '"the"' in text or '" the"' in text  # ASCII tokens are readable as they are
    back = Tokenizer.load(p)
    assert back.vocab == trained.vocab and back.merges == trained.merges
    assert back.special_tokens == trained.special_tokens and back.fingerprint() == trained.fingerprint()
    for t in _texts():
        assert back.encode(t) == trained.encode(t)


def test_save_refuses_overwrite_and_is_atomic(trained, tmp_path):
    p = tmp_path / "tok.json"
    p.write_text("precious", encoding="utf-8")
    with pytest.raises(ValueError, match="already exists.*force"):
        trained.save(p)
    assert p.read_text(encoding="utf-8") == "precious"
    trained.save(p, force=True)
    assert Tokenizer.load(p).fingerprint() == trained.fingerprint()
    assert sorted(x.name for x in tmp_path.iterdir()) == ["tok.json"]  # no temp files left behind
    with pytest.raises(ValueError, match="is a directory"):
        trained.save(tmp_path)


def test_custom_pattern_and_weird_bytes_roundtrip(tmp_path):
    vocab = {i: bytes([i]) for i in range(256)} | {256: b"\\\x00", 257: b"\\\x00\xff"}
    tok = Tokenizer(vocab, [(b"\\", b"\x00"), (b"\\\x00", b"\xff")], ["<|x|>"], pattern=r"\S+|\s+")
    tok.save(tmp_path / "t.json")
    back = Tokenizer.load(tmp_path / "t.json")
    assert back.vocab == tok.vocab and back.merges == tok.merges and back.pattern == r"\S+|\s+"


def _bad(tmp_path, content: str):
    p = tmp_path / "bad.json"
    p.write_text(content, encoding="utf-8")
    return p


def test_load_corrupt_and_foreign_files(trained, tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        Tokenizer.load(tmp_path / "none.json")
    with pytest.raises(ValueError, match="not valid JSON.*corrupt or truncated"):
        Tokenizer.load(_bad(tmp_path, '{"format": "lmforge-bpe", "vers'))
    (tmp_path / "bin.json").write_bytes(b"\x80\x81\x82")
    with pytest.raises(ValueError, match="not UTF-8"):
        Tokenizer.load(tmp_path / "bin.json")
    trained.save_hf(tmp_path / "hf.json")
    with pytest.raises(ValueError, match="Hugging Face tokenizer.json; load it with Tokenizer.from_hf"):
        Tokenizer.load(tmp_path / "hf.json")
    trained.save_gpt2(tmp_path / "vocab.json", tmp_path / "merges.txt")
    with pytest.raises(ValueError, match="GPT-2 vocab.json; load it with Tokenizer.from_files"):
        Tokenizer.load(tmp_path / "vocab.json")
    with pytest.raises(ValueError, match="not an lmforge tokenizer file"):
        Tokenizer.load(_bad(tmp_path, "[1, 2, 3]"))


def test_load_unsupported_version_and_inconsistent(trained, tmp_path):
    good = json.loads(tokenizer_io.dumps_lmforge(trained.vocab, trained.merges, trained.special_tokens, "gpt2"))

    def variant(**changes):
        return _bad(tmp_path, json.dumps(good | changes))

    with pytest.raises(ValueError, match="format version 2.*upgrade lmforge"):
        Tokenizer.load(variant(version=2))
    with pytest.raises(ValueError, match="inconsistent.*special token"):
        Tokenizer.load(variant(special_tokens={EOT: 5}))
    with pytest.raises(ValueError, match="inconsistent.*vocab_size"):
        Tokenizer.load(variant(vocab_size=3))
    with pytest.raises(ValueError, match="inconsistent.*missing field 'merges'"):
        Tokenizer.load(_bad(tmp_path, json.dumps({k: v for k, v in good.items() if k != "merges"})))
    with pytest.raises(ValueError, match="inconsistent.*merge 0"):
        Tokenizer.load(variant(merges=[["zzz", "q"]] + good["merges"]))
    with pytest.raises(ValueError, match="inconsistent.*unknown pattern name"):
        Tokenizer.load(variant(pattern="gpt3"))
    with pytest.raises(ValueError, match="inconsistent.*lacks the single byte"):
        Tokenizer.load(variant(vocab=good["vocab"][1:], vocab_size=len(good["vocab"]) - 1, special_tokens={},
                               merges=[]))


# --------------------------------------------------------------------------------------------------
# GPT-2 files, HF tokenizer.json, tiktoken
# --------------------------------------------------------------------------------------------------
def test_gpt2_files_roundtrip(trained, tmp_path):
    trained.save_gpt2(tmp_path / "vocab.json", tmp_path / "merges.txt")
    assert (tmp_path / "merges.txt").read_text(encoding="utf-8").startswith("#version")
    back = Tokenizer.from_files(tmp_path / "vocab.json", tmp_path / "merges.txt", [EOT], pattern=trained.pattern)
    assert back.vocab == trained.vocab and back.merges == trained.merges
    assert load_tokenizer(tmp_path).special_tokens == {EOT: trained.eot_id}
    with pytest.raises(ValueError, match="already exists"):
        trained.save_gpt2(tmp_path / "vocab.json", tmp_path / "merges.txt")
    (tmp_path / "merges.txt").write_text("#version: 0.2\na b c\n", encoding="utf-8")
    with pytest.raises(ValueError, match="merges.txt:2: expected two space-separated tokens"):
        Tokenizer.from_files(tmp_path / "vocab.json", tmp_path / "merges.txt")


def test_gpt2_fixture_roundtrips_through_every_format(shared_fixtures, tmp_path):
    tok = Tokenizer.from_files(shared_fixtures / "gpt2_vocab.json", shared_fixtures / "gpt2_merges.txt", [EOT])
    tok.save(tmp_path / "gpt2.json")
    tok.save_hf(tmp_path / "tokenizer.json")
    for back in (Tokenizer.load(tmp_path / "gpt2.json"), Tokenizer.from_hf(tmp_path / "tokenizer.json"),
                 load_tokenizer(tmp_path / "tokenizer.json")):
        assert back.fingerprint() == tok.fingerprint()
    text = (shared_fixtures / "tinystories_sample.txt").read_text(encoding="utf-8")
    assert tok.to_tiktoken().encode(text, allowed_special="all") == tok.encode(text)


def test_hf_tokenizer_json_encodes_identically(trained, tmp_path):
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    p = trained.save_hf(tmp_path / "tokenizer.json")
    with pytest.raises(ValueError, match="already exists"):
        trained.save_hf(p)
    hf = tokenizers.Tokenizer.from_file(str(p))
    fast = PreTrainedTokenizerFast(tokenizer_file=str(p))
    for text in _texts():
        ids = trained.encode(text)
        assert hf.encode(text).ids == ids
        assert fast(text)["input_ids"] == ids
        assert fast.decode(ids) == text
    back = Tokenizer.from_hf(p)
    assert back.fingerprint() == trained.fingerprint() and back.pattern == trained.pattern


def test_tiktoken_export_encodes_identically(trained):
    enc = trained.to_tiktoken()
    assert enc.n_vocab == trained.vocab_size
    for text in _texts() + make_documents(30, seed=12):
        assert enc.encode(text, allowed_special="all") == trained.encode(text)
    assert enc.decode(trained.encode(_texts()[1])) == _texts()[1]


def test_load_tokenizer_dispatch(trained, tmp_path):
    trained.save(tmp_path / "a.json")
    trained.save_hf(tmp_path / "b.json")
    assert load_tokenizer(tmp_path / "a.json").fingerprint() == load_tokenizer(tmp_path / "b.json").fingerprint()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="neither vocab.json"):
        load_tokenizer(tmp_path / "empty")
    with pytest.raises(ValueError, match="not an lmforge tokenizer file"):
        load_tokenizer(_bad(tmp_path, '{"hello": "world"}'))


def test_tiktoken_divergence_documented_case():
    # merges (b,c), (a,b), (ab,c): merge-rank BPE never joins (a, bc); tiktoken joins it because
    # b"abc" has a rank. This is the caveat in to_tiktoken's docstring.
    vocab = {i: bytes([i]) for i in range(256)} | {256: b"bc", 257: b"ab", 258: b"abc"}
    tok = Tokenizer(vocab, [(b"b", b"c"), (b"a", b"b"), (b"ab", b"c")])
    assert tok.encode("abc") == [ord("a"), 256]
    assert tok.to_tiktoken().encode("abc") == [258]


@pytest.mark.parametrize("change,msg", [
    (lambda d: d.update(normalizer={"type": "NFC"}), "normalizer"),
    (lambda d: d["model"].update(type="WordPiece"), "WordPiece model"),
    (lambda d: d["pre_tokenizer"]["pretokenizers"][1].update(add_prefix_space=True), "add_prefix_space"),
    (lambda d: d.update(pre_tokenizer={"type": "Whitespace"}), "unsupported pre_tokenizer"),
])
def test_hf_files_we_would_misread_are_refused(trained, tmp_path, change, msg):
    doc = tokenizer_io.hf_tokenizer_dict(trained.vocab, trained.merges, trained.special_tokens, trained.pattern)
    change(doc)
    p = tmp_path / "tokenizer.json"
    p.write_text(json.dumps(doc), encoding="utf-8")
    with pytest.raises(ValueError, match=msg):
        Tokenizer.from_hf(p)


def test_reads_hf_written_gpt2_tokenizer_json(shared_fixtures, tmp_path):
    from tokenizers import ByteLevelBPETokenizer

    hf = ByteLevelBPETokenizer(str(shared_fixtures / "gpt2_vocab.json"), str(shared_fixtures / "gpt2_merges.txt"))
    hf.add_special_tokens([EOT])
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path / "tokenizer.json")
    assert tok.pattern == "gpt2" and tok.eot_id == 50256 and tok.vocab_size == 50257
    text = (shared_fixtures / "tinystories_sample.txt").read_text(encoding="utf-8")
    assert tok.encode(text) == hf.encode(text).ids
