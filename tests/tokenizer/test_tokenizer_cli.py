"""`lmforge tokenizer train|encode|decode|stats` end to end, through cli.main and one real subprocess."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import make_corpus_text

from lmforge.cli import main
from lmforge.tokenizer import Tokenizer

EOT = "<|endoftext|>"


@pytest.fixture
def trained_path(tiny_corpus, tmp_path):
    out = tmp_path / "tok.json"
    assert main(["-q", "tokenizer", "train", "--input", str(tiny_corpus), "--vocab-size", "350",
                 "--special-token", EOT, "--out", str(out), "--threads", "1"]) == 0
    return out


def test_train_writes_loadable_tokenizer(trained_path, tiny_corpus):
    from lmforge.tokenizer.reference import train_bpe_reference

    tok = Tokenizer.load(trained_path)
    vocab, merges = train_bpe_reference([tiny_corpus.read_text(encoding="utf-8")], 350, [EOT])
    assert tok.vocab == vocab and tok.merges == merges and tok.eot_id == 256


def test_train_refuses_to_clobber(trained_path, tiny_corpus, capsys):
    before = trained_path.read_bytes()
    args = ["tokenizer", "train", "--input", str(tiny_corpus), "--vocab-size", "300", "--out", str(trained_path)]
    assert main(args) == 2
    assert "already exists" in capsys.readouterr().err and trained_path.read_bytes() == before
    assert main(["-q", *args, "--force"]) == 0
    assert Tokenizer.load(trained_path).vocab_size == 300


@pytest.mark.parametrize("extra,msg", [
    (["--vocab-size", "100"], "too small"),
    (["--special-token", "<|a|>", "--special-token", "<|a|>"], "given twice"),
    (["--special-token", ""], "non-empty"),
    (["--pattern", "gpt3"], "unknown pattern name"),
])
def test_train_bad_arguments(tiny_corpus, tmp_path, capsys, extra, msg):
    args = ["tokenizer", "train", "--input", str(tiny_corpus), "--vocab-size", "300", "--out", str(tmp_path / "o.json")]
    assert main(args + extra) == 2
    err = capsys.readouterr().err
    assert msg in err and err.count("\n") == 1 and not (tmp_path / "o.json").exists()


def test_train_bad_inputs(tmp_path, capsys):
    out = str(tmp_path / "o.json")
    assert main(["tokenizer", "train", "--input", str(tmp_path / "nope.txt"), "--vocab-size", "300", "--out", out]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["tokenizer", "train", "--input", str(tmp_path), "--vocab-size", "300", "--out", out]) == 2
    assert "holds no .txt/.jsonl/.parquet files" in capsys.readouterr().err
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"abc \xff def")
    assert main(["tokenizer", "train", "--input", str(bad), "--vocab-size", "300", "--out", out]) == 2
    assert "byte offset 4" in capsys.readouterr().err
    assert main(["-q", "tokenizer", "train", "--input", str(bad), "--vocab-size", "300", "--out", out,
                 "--errors", "replace"]) == 0


def test_train_reads_jsonl_compressed_directories_and_globs(tmp_path, capsys):
    import gzip

    from conftest import make_documents

    docs = make_documents(30, seed=5)
    want = Tokenizer.load(_train_cli(tmp_path, "want.json", [], _write(tmp_path / "c.txt", EOT.join(docs))))
    (tmp_path / "d").mkdir()
    _write(tmp_path / "d" / "a.jsonl", "".join(json.dumps({"body": t}) + "\n" for t in docs[:10]))
    (tmp_path / "d" / "b.txt.gz").write_bytes(gzip.compress(EOT.join(docs[10:]).encode()))
    for i, inputs in enumerate([[str(tmp_path / "d")], [str(tmp_path / "d" / "*.jsonl"), str(tmp_path / "d" / "b*")]]):
        got = Tokenizer.load(_train_cli(tmp_path, f"got{i}.json", ["--text-field", "body"], *inputs))
        assert (got.vocab, got.merges) == (want.vocab, want.merges)
    capsys.readouterr()
    assert main(["-q", "tokenizer", "train", "--input", str(tmp_path / "d"), "--vocab-size", "400",
                 "--out", str(tmp_path / "x.json")]) == 2  # field "text" missing: one line, exit 2
    err = capsys.readouterr().err
    assert "a.jsonl:1: no field 'text' (found ['body'])" in err and err.count("\n") == 1


def _write(path, text: str):
    path.write_text(text, encoding="utf-8")
    return path


def _train_cli(tmp_path, out: str, extra: list[str], *inputs, vocab: str = "400") -> str:
    path = str(tmp_path / out)
    assert main(["-q", "tokenizer", "train", "--input", *map(str, inputs), "--vocab-size", vocab,
                 "--special-token", EOT, "--out", path, "--threads", "1", *extra]) == 0
    return path


def test_train_empty_corpus_and_unreachable_vocab(tmp_path, capsys):
    empty = _write(tmp_path / "e.txt", f" {EOT}\n\n{EOT} ")
    args = ["-q", "tokenizer", "train", "--input", str(empty), "--vocab-size", "300", "--special-token", EOT,
            "--out", str(tmp_path / "e.json")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("lmforge: error: the corpus holds no text") and err.count("\n") == 1
    assert not (tmp_path / "e.json").exists()
    small = _write(tmp_path / "s.txt", "hello hello")  # a real process: the warning as a user sees it
    res = subprocess.run([sys.executable, "-m", "lmforge.cli", "-q", "tokenizer", "train", "--input", str(small),
                          "--vocab-size", "5000", "--out", str(tmp_path / "s.json")], capture_output=True, text=True)
    lines = res.stderr.splitlines()
    assert res.returncode == 0 and len(lines) == 2 and lines[1].startswith("wrote "), res.stderr
    assert "WARNING vocab_size=5000 cannot be reached" in lines[0]
    assert f"the tokenizer has {Tokenizer.load(tmp_path / 's.json').vocab_size} ids" in lines[0]


def test_encode_decode_roundtrip(trained_path, tmp_path, capsys):
    text = make_corpus_text(5, seed=7) + "\n"
    src = tmp_path / "in.txt"
    src.write_text(text, encoding="utf-8")
    assert main(["tokenizer", "encode", "--tokenizer", str(trained_path), str(src)]) == 0
    ids_text = capsys.readouterr().out
    assert [int(x) for x in ids_text.split()] == Tokenizer.load(trained_path).encode(text)
    (tmp_path / "ids.txt").write_text(ids_text, encoding="utf-8")
    assert main(["tokenizer", "decode", "--tokenizer", str(trained_path), str(tmp_path / "ids.txt")]) == 0
    assert capsys.readouterr().out == text
    assert main(["tokenizer", "encode", "--tokenizer", str(trained_path), "--format", "json", str(src)]) == 0
    as_json = capsys.readouterr().out
    assert json.loads(as_json) == [int(x) for x in ids_text.split()]
    (tmp_path / "ids.json").write_text(as_json, encoding="utf-8")
    assert main(["tokenizer", "decode", "--tokenizer", str(trained_path), str(tmp_path / "ids.json")]) == 0
    assert capsys.readouterr().out == text


def test_encode_decode_errors(trained_path, tmp_path, capsys):
    (tmp_path / "ids.txt").write_text("1 2 99999", encoding="utf-8")
    assert main(["tokenizer", "decode", "--tokenizer", str(trained_path), str(tmp_path / "ids.txt")]) == 2
    assert "token id 99999 is out of range" in capsys.readouterr().err
    (tmp_path / "ids.txt").write_text("1 two 3", encoding="utf-8")
    assert main(["tokenizer", "decode", "--tokenizer", str(trained_path), str(tmp_path / "ids.txt")]) == 2
    assert "integer ids" in capsys.readouterr().err
    (tmp_path / "e.txt").write_text(f"a{EOT}b", encoding="utf-8")
    assert main(["tokenizer", "encode", "--tokenizer", str(trained_path), "--special", "disallowed",
                 str(tmp_path / "e.txt")]) == 2
    assert "special token" in capsys.readouterr().err
    (tmp_path / "corrupt.json").write_text("{nope", encoding="utf-8")
    assert main(["tokenizer", "encode", "--tokenizer", str(tmp_path / "corrupt.json"), str(tmp_path / "e.txt")]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    (tmp_path / "bad.txt").write_bytes(b"ok \xff")
    assert main(["tokenizer", "encode", "--tokenizer", str(trained_path), str(tmp_path / "bad.txt")]) == 2
    assert "not valid UTF-8" in capsys.readouterr().err


def test_stats_side_by_side(trained_path, tmp_path, capsys):
    """Two different tokenizers (the trained BPE and plain bytes, as a GPT-2 directory): every count is theirs."""
    a = Tokenizer.load(trained_path)
    b = Tokenizer({i: bytes([i]) for i in range(256)} | {256: EOT.encode()}, [], [EOT])  # one token per byte
    (tmp_path / "bytes").mkdir()
    b.save_gpt2(tmp_path / "bytes/vocab.json", tmp_path / "bytes/merges.txt")
    en, zh = tmp_path / "en.txt", tmp_path / "zh.txt"
    en.write_text(make_corpus_text(3, seed=1), encoding="utf-8")
    zh.write_text("你好，世界。这是一个测试。", encoding="utf-8")
    assert main(["tokenizer", "stats", "--tokenizer", str(trained_path), "--compare", str(tmp_path / "bytes"),
                 str(en), str(zh)]) == 0
    out = capsys.readouterr().out
    for label in ("bytes / token", "tokens / word", "vocab used", "longest tokens"):
        assert out.count(label) == 2
    for path, block in zip((en, zh), out.split(f"{zh}:")):
        text = path.read_text(encoding="utf-8")
        na, nb = len(a.encode(text, special="plain")), len(b.encode(text, special="plain"))
        assert nb == len(text.encode()) and na < nb  # different tokenizers, different counts
        rows = {line[2:18].strip(): line[18:].split() for line in block.splitlines() if line.startswith("  ")}
        assert rows["tokens"] == [str(na), str(nb)] and rows["vocab size"] == ["350", "257"]
        assert rows["bytes / token"] == [f"{nb / na:.3f}", "1.000"]
        assert rows["tokens / word"] == [f"{na / len(text.split()):.3f}", f"{nb / len(text.split()):.3f}"]
        assert f"tok.json uses {na / nb:.3f}x the tokens of bytes" in block


def test_real_subprocess(trained_path, tmp_path):
    r = subprocess.run([sys.executable, "-m", "lmforge.cli", "tokenizer", "encode", "--tokenizer", str(trained_path)],
                       input="the cat sat", capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and [int(x) for x in r.stdout.split()] == Tokenizer.load(trained_path).encode("the cat sat")
    r = subprocess.run([sys.executable, "-m", "lmforge.cli", "tokenizer", "decode", "--tokenizer",
                        str(tmp_path / "missing.json")], input="1", capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("lmforge: error:") and "Traceback" not in r.stderr


def test_tokenizer_flag_accepts_hf_json_and_gpt2_dir(trained_path, tmp_path, capsys):
    tok = Tokenizer.load(trained_path)
    tok.save_hf(tmp_path / "tokenizer.json")
    tok.save_gpt2(tmp_path / "vocab.json", tmp_path / "merges.txt")
    (tmp_path / "in.txt").write_text("the cat sat on the mat", encoding="utf-8")
    want = " ".join(map(str, tok.encode("the cat sat on the mat")))
    for spec in (trained_path, tmp_path / "tokenizer.json", tmp_path):
        assert main(["tokenizer", "encode", "--tokenizer", str(spec), str(tmp_path / "in.txt")]) == 0
        assert capsys.readouterr().out.strip() == want


def test_encode_tokens_format_shows_the_split(trained_path, tmp_path, capsys):
    (tmp_path / "in.txt").write_text("the cat 世", encoding="utf-8")
    assert main(["tokenizer", "encode", "--tokenizer", str(trained_path), "--format", "tokens",
                 str(tmp_path / "in.txt")]) == 0
    pieces = json.loads(capsys.readouterr().out)
    tok = Tokenizer.load(trained_path)
    assert pieces == [tok.vocab[i].decode("utf-8", "backslashreplace") for i in tok.encode("the cat 世")]
    assert "".join(pieces).startswith("the cat")
