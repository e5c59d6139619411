"""The tokenizer's fast paths hold their spec: heap tie-breaks on long tokens, no heavy imports for training."""

import json
import subprocess
import sys

import pytest

from lmforge import _native
from lmforge.tokenizer import reference as bpe
from lmforge.tokenizer.formats import escape_token

needs_core = pytest.mark.skipif(not _native.available("train_bpe"), reason="lmforge._core not built")


def _core_merges(counts: dict[bytes, int], n: int) -> list[tuple[bytes, bytes]]:
    core = _native.core()
    c = core.PretokenCounter(core.PATTERN_CUSTOM, [])
    c.add_counts(list(counts), list(counts.values()))
    return core.train_bpe(c, n)


@needs_core
def test_ties_between_long_tokens_sharing_eight_bytes_follow_the_reference() -> None:
    """The heap orders ties by an 8-byte prefix key first: tokens that share 8 leading bytes, that are
    prefixes of each other or that differ only by a trailing NUL must still break ties like the spec."""
    stem = b"abcdefgh"
    counts = {stem + b"ij": 3, stem + b"i\x00": 3, stem + b"ik": 3, stem + b"i": 3, stem: 3,
              b"\x00" * 10 + b"z": 3, b"\x00" * 9 + b"y": 3, b"zz": 3}
    n = 60
    assert _core_merges(counts, n) == bpe.learn_merges(counts, n)


@needs_core
@pytest.mark.parametrize("seed", range(6))
def test_one_pass_merge_follows_the_reference_on_runs_and_repeats(seed: int) -> None:
    """The trainer rewrites each word in one pass: runs of one symbol (``aaaa``: overlapping (a, a)),
    back-to-back occurrences (``abab``) and a word list that keeps visiting stale words must give the
    spec's merges, up to running out of pairs."""
    import random

    rng = random.Random(seed)
    alphabet = b"ab" if seed % 2 else b"abc\x00\xff"
    counts: dict[bytes, int] = {}
    for _ in range(300):
        word = bytes(rng.choice(alphabet) for _ in range(rng.randint(1, 14)))
        if rng.random() < 0.3:
            word = word[:1] * rng.randint(2, 12)  # a run
        counts[word] = counts.get(word, 0) + rng.randint(1, 5)
    n = 2000  # more than there are: both stop when no pair is left
    assert _core_merges(counts, n) == bpe.learn_merges(counts, n)


def test_escape_token_is_its_spec_on_every_byte() -> None:
    """escape_token (a translate table) equals the per-byte rule of its docstring."""
    def rule(tok: bytes) -> str:
        return "".join("\\\\" if b == 0x5C else chr(b) if 0x20 <= b <= 0x7E else f"\\x{b:02x}" for b in tok)

    every = bytes(range(256))
    assert escape_token(every) == rule(every)
    assert escape_token(b"") == ""
    assert json.loads(json.dumps(escape_token(every))) == rule(every)


@needs_core
def test_tokenizer_train_command_imports_no_heavy_module(tmp_path) -> None:
    """`lmforge tokenizer train` on text files loads neither torch, numpy, tqdm, the regex module nor the
    dataset registry (its fixed cost is what users wait for on small corpora)."""
    corpus = tmp_path / "c.txt"
    corpus.write_text(("the quick brown fox jumps over the lazy dog. " * 200 + "<|endoftext|>") * 5)
    out = tmp_path / "tok.json"
    code = ("import sys\nfrom lmforge.cli import main\n"
            f"rc = main(['-q', 'tokenizer', 'train', '--input', {str(corpus)!r}, '--vocab-size', '270', "
            f"'--special-token', '<|endoftext|>', '--out', {str(out)!r}])\n"
            "heavy = ('torch', 'numpy', 'tqdm', 'regex', 'lmforge.corpus.datasets', 'urllib.request')\n"
            "print(sorted(m for m in sys.modules if m in heavy))\nsys.exit(rc)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"
    assert json.loads(out.read_text())["vocab_size"] == 270


def test_whitespace_only_corpus_is_refused_even_with_multibyte_spaces(tmp_path) -> None:
    """The no-text check trusts a learned token only when it is whole UTF-8 with a non-space character:
    merges inside U+3000 / U+00A0 (multibyte spaces) must not count as text."""
    from lmforge.tokenizer import train_bpe

    p = tmp_path / "spaces.txt"
    p.write_text(("\u3000\u3000 \u00a0\u00a0\n\t  " * 50 + "<|endoftext|>") * 3, encoding="utf-8")
    with pytest.raises(ValueError, match="no text to train on"):
        train_bpe(p, 300, ["<|endoftext|>"], progress=False)
    q = tmp_path / "text.txt"
    q.write_text("\u3000\u3000 ab ab ab", encoding="utf-8")
    vocab, merges = train_bpe(q, 260, ["<|endoftext|>"], progress=False)
    assert merges


def _random_parts(seed: int) -> tuple[dict[int, bytes], list[tuple[bytes, bytes]], dict[str, int], str]:
    """A tokenizer's parts with awkward bytes: quotes, backslashes, controls, high bytes, two specials."""
    import random

    rng = random.Random(seed)
    vocab = {i: bytes([i]) for i in range(256)}
    merges = []
    for _ in range(rng.randint(0, 60)):
        a, b = vocab[rng.randrange(len(vocab))], vocab[rng.randrange(len(vocab))]
        if a + b not in vocab.values():
            merges.append((a, b))
            vocab[len(vocab)] = a + b
    specials = {"<|endoftext|>": len(vocab), 'say "\\é"': len(vocab) + 1}
    for s, i in specials.items():
        vocab[i] = s.encode("utf-8")
    return vocab, merges, specials, ["gpt2", r"""\s+|"[^"]*"|\p{L}+|é"""][seed % 2]


@pytest.mark.parametrize("seed", range(4))
def test_fingerprint_and_file_are_their_spec(seed: int) -> None:
    """fingerprint() builds its JSON with joins, the writer escapes all tokens at once: both equal the plain
    per-token definitions (json.dumps of the doc; _json_str(escape_token(t)) per line)."""
    import hashlib

    from lmforge.tokenizer import Tokenizer
    from lmforge.tokenizer.formats import _json_str, dumps_lmforge
    from lmforge.tokenizer.tokenizer import fingerprint

    vocab, merges, specials, pattern = _random_parts(seed)
    if seed == 0:
        merges = []  # the empty lists are written differently
    doc = {"vocab": [vocab[i].hex() for i in range(len(vocab))], "merges": [[a.hex(), b.hex()] for a, b in merges],
           "special_tokens": sorted(specials.items()), "pattern": bpe.resolve_pattern(pattern)}
    want = hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]
    assert fingerprint(vocab, merges, specials, pattern) == want
    if merges:
        assert Tokenizer(vocab, merges, list(specials), pattern, backend="python").fingerprint() == want
    text = dumps_lmforge(vocab, merges, specials, pattern)
    body = text[text.index(' "vocab": [\n') + len(' "vocab": [\n'):]
    vocab_lines = ",\n".join(f"  {_json_str(escape_token(vocab[i]))}" for i in range(len(vocab)))
    merge_lines = ",\n".join(f"  [{_json_str(escape_token(a))}, {_json_str(escape_token(b))}]" for a, b in merges)
    assert body == vocab_lines + '\n ],\n "merges": [\n' + merge_lines + "\n ]\n}\n"


def test_tokenizer_train_command_writes_what_tokenizer_save_writes(tmp_path, capsys) -> None:
    """The command writes the trainer's output without building a Tokenizer: byte for byte the file
    Tokenizer(...).save() writes, and the same fingerprint."""
    from lmforge.cli import main
    from lmforge.tokenizer import Tokenizer, train_bpe

    corpus = tmp_path / "c.txt"
    corpus.write_text(("Tab\there, \"quotes\" and \\ back\\slashes; naïve café 12 34!\n" * 30 + "<|endoftext|>") * 4,
                      encoding="utf-8")
    out = tmp_path / "tok.json"
    specials = ["<|endoftext|>", "<|pad|>"]
    assert main(["-q", "tokenizer", "train", "--input", str(corpus), "--vocab-size", "330", "--out", str(out),
                 "--special-token", specials[0], "--special-token", specials[1]]) == 0
    vocab, merges = train_bpe(corpus, 330, specials, progress=False)
    tok = Tokenizer(vocab, merges, specials, backend="python")
    tok.save(tmp_path / "general.json")
    assert out.read_bytes() == (tmp_path / "general.json").read_bytes()
    assert f"fingerprint={tok.fingerprint()}" in capsys.readouterr().err
