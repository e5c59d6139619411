"""Special tokens appended to a trained tokenizer without retraining (``Tokenizer.with_special_tokens``).

``tests/fixtures/tokenizer_lmforge_v1.json`` was written by lmforge before this method existed (commit b27b155),
so loading it checks that old files still load and take new specials.
"""

from pathlib import Path

import pytest

from lmforge.tokenizer import Tokenizer, load_tokenizer

OLD_FILE = Path(__file__).parents[1] / "fixtures" / "tokenizer_lmforge_v1.json"
NEW = ["<|user_start|>", "<|user_end|>"]
BACKENDS = ["python", pytest.param("cpp", marks=pytest.mark.skipif(
    Tokenizer.load(OLD_FILE).backend != "cpp", reason="C++ encoder not built"))]


@pytest.mark.parametrize("backend", BACKENDS)
def test_new_specials_get_ids_after_the_vocab_and_encode_in_both_backends(backend):
    old = Tokenizer.load(OLD_FILE, backend=backend)
    assert old.vocab_size == 290 and old.special_tokens == {"<|endoftext|>": 256}
    new = old.with_special_tokens(NEW)
    assert new.backend == backend
    assert new.special_tokens == {"<|endoftext|>": 256, "<|user_start|>": 290, "<|user_end|>": 291}
    assert new.vocab_size == 292 and new.merges == old.merges
    assert all(new.vocab[i] == old.vocab[i] for i in range(old.vocab_size))
    text = "<|user_start|>the cat sat<|user_end|><|endoftext|>"
    ids = new.encode(text)
    assert ids[0] == 290 and ids[-2:] == [291, 256] and new.decode(ids) == text
    assert ids[1:-2] == old.encode("the cat sat")  # ordinary text encodes as before
    plain = new.encode(text, special="plain")
    assert 290 not in plain and 291 not in plain and new.decode(plain) == text
    with pytest.raises(ValueError, match="special='disallowed'"):
        new.encode(text, special="disallowed")
    assert old.vocab_size == 290, "the original tokenizer is not changed"


def test_backends_agree_on_appended_specials():
    py = Tokenizer.load(OLD_FILE, backend="python").with_special_tokens(NEW)
    auto = Tokenizer.load(OLD_FILE).with_special_tokens(NEW)
    text = "hello<|user_start|>hello world<|user_end|> the dog<|endoftext|>the"
    assert py.encode(text) == auto.encode(text)
    assert py.encode(text, special="plain") == auto.encode(text, special="plain")
    assert py.fingerprint() == auto.fingerprint()


def test_adding_twice_is_a_no_op_and_the_fingerprint_changes_once():
    old = Tokenizer.load(OLD_FILE)
    once = old.with_special_tokens(NEW)
    twice = once.with_special_tokens(NEW)
    assert once.fingerprint() != old.fingerprint()
    assert twice.fingerprint() == once.fingerprint() and twice.special_tokens == once.special_tokens
    assert old.with_special_tokens(["<|endoftext|>"]).fingerprint() == old.fingerprint()
    more = once.with_special_tokens(NEW + ["<|x|>"])  # only the missing one is appended
    assert more.special_tokens["<|x|>"] == 292 and more.vocab_size == 293


def test_appended_specials_survive_save_and_load(tmp_path):
    new = Tokenizer.load(OLD_FILE).with_special_tokens(NEW)
    p = new.save(tmp_path / "tok.json")
    for back in (Tokenizer.load(p), load_tokenizer(p), Tokenizer.load(p, backend="python")):
        assert back.special_tokens == new.special_tokens and back.fingerprint() == new.fingerprint()
    hf = Tokenizer.from_hf(new.save_hf(tmp_path / "tokenizer.json"))
    assert hf.special_tokens == new.special_tokens and hf.vocab == new.vocab


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_special_whose_bytes_are_an_ordinary_token_gets_its_own_id(backend):
    old = Tokenizer.load(OLD_FILE, backend=backend)
    the = old.encode("the")
    assert len(the) == 1, "the fixture has the merged token 'the'"
    new = old.with_special_tokens(["the"])
    assert new.special_tokens["the"] == 290 and new.vocab[290] == new.vocab[the[0]]
    assert new.encode("the", special="plain") == the and new.encode("the") == [290]
    assert new.decode([290]) == new.decode(the) == "the"


def test_bad_special_tokens_are_rejected():
    old = Tokenizer.load(OLD_FILE)
    with pytest.raises(ValueError, match="not a single string"):
        old.with_special_tokens("<|user_start|>")
    with pytest.raises(ValueError, match="non-empty"):
        old.with_special_tokens([""])
