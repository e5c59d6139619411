"""Token shards: prepare (round trip, crash resume, duplicates, append), shard checks, and the loaders."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from lmforge.data import pipeline as data

from lmforge.data import shards
from lmforge.data import BlockLoader, TokenDataset, get_batch, prepare, val_batches
from lmforge.corpus.splits import split_of
from lmforge.tokenizer import Tokenizer

EOT = "<|endoftext|>"
WORDS = "the cat sat on a mat and then ran far away from home to see the wide blue sea where fish swim".split()


def make_docs(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"Doc {seed}-{i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 60))) + "."
            for i in range(n)]


def write_corpus(path: Path, docs: list[str]) -> Path:
    path.write_text(f"\n{EOT}\n".join(docs), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from lmforge.tokenizer import Tokenizer, train_bpe

    p = write_corpus(tmp_path_factory.mktemp("tok") / "train.txt", make_docs(200, seed=99))
    vocab, merges = train_bpe(p, 320, [EOT], progress=False)
    return Tokenizer(vocab, merges, [EOT])


def all_tokens(ds: TokenDataset) -> np.ndarray:
    return np.concatenate([np.asarray(s) for s in ds.shards])


def shard_hashes(d: Path) -> dict[str, str]:
    return {s["name"]: s["sha256"] for s in json.loads((d / "manifest.json").read_text())["shards"]}


# --------------------------------------------------------------------------------------------------
# prepare
# --------------------------------------------------------------------------------------------------
def test_round_trip_text_to_shards_to_text(tmp_path, tok):
    docs = make_docs(120)
    src = write_corpus(tmp_path / "c.txt", docs)
    m = prepare(tok, src, tmp_path / "sh", shard_tokens=500, progress=False)
    ds = TokenDataset(tmp_path / "sh", "train", verify=True)
    assert len(ds.shards) > 3 and all(len(s) == 500 for s in ds.shards[:-1]) and ds.dtype == np.uint16
    toks = all_tokens(ds)
    assert tok.decode(toks.tolist()) == "".join(d + EOT for d in docs)
    assert ds.num_documents == 120 and m["splits"]["train"]["documents"] == 120
    assert ds.text_bytes == sum(len(d.encode()) for d in docs)
    assert ds.bytes_per_token == pytest.approx(ds.text_bytes / len(toks))
    starts = np.concatenate([ds.doc_starts(i) + 500 * i for i in range(len(ds.shards))])
    eots = np.flatnonzero(toks == tok.eot_id)
    assert starts.tolist() == [0] + (eots[:-1] + 1).tolist()  # a document starts after every <|endoftext|>
    (src_rec,) = m["sources"]
    assert src_rec["sha256"] == shards.sha256_file(src) and src_rec["size"] == src.stat().st_size
    assert src_rec["tokens"] == {"train": len(toks)} and src_rec["documents"] == {"train": 120}
    assert (tmp_path / "sh" / "tokenizer.json").exists()
    assert ds.max_token_id == int(toks.max())  # recorded per shard at write time


def test_hash_split_bos_and_uint32(tmp_path, tok):
    docs = make_docs(200)
    src = write_corpus(tmp_path / "c.txt", docs)
    prepare(tok, src, tmp_path / "sh", val_fraction=0.2, split_seed=3, bos=EOT, eos=None, dtype="uint32",
            progress=False)
    want_val = [d for d in docs if split_of(d, 0.2, 3) == "val"]
    val = TokenDataset(tmp_path / "sh", "val")
    assert val.dtype == np.uint32 and 20 < len(want_val) < 60
    assert tok.decode(all_tokens(val).tolist()) == "".join(EOT + d for d in want_val)
    train = TokenDataset(tmp_path / "sh", "train")
    assert train.num_documents + val.num_documents == 200


@pytest.mark.parametrize("val_fraction", [0.0, 0.3])
def test_fast_prepare_equals_the_pure_python_reference(tmp_path, tok, monkeypatch, val_fraction):
    """C++ splitting + span encoding gives the very shards and manifest of the pure-Python path
    (Python splitter, Python tokenizer), through small read chunks, Unicode whitespace, empty and
    invalid-UTF-8 documents (replaced), a hash split and BOS+EOS."""
    from lmforge.corpus import sources

    docs = make_docs(150, seed=7)
    text = "".join(f"{d}\u3000\n{EOT}\x85 {EOT} \n{EOT}" if i % 7 else f"é{d}{EOT}" for i, d in enumerate(docs))
    raw = text.encode()
    raw = raw[:500] + b"\xff" + raw[500:]
    src = tmp_path / "c.txt"
    src.write_bytes(raw)
    monkeypatch.setattr(sources, "_READ_CHUNK", 997)
    kw = dict(val_fraction=val_fraction, bos=EOT, utf8_errors="replace", shard_tokens=700, progress=False)
    fast = prepare(tok, src, tmp_path / "fast", **kw)
    monkeypatch.setattr(sources, "split_documents", sources.split_documents_reference)
    ref_tok = Tokenizer(tok.vocab, tok.merges, [EOT], backend="python")
    ref = prepare(ref_tok, src, tmp_path / "ref", **kw)
    assert fast["shards"] == ref["shards"] and fast["splits"] == ref["splits"]
    assert fast["sources"][0]["invalid_utf8"] == 1 and fast["sources"] == ref["sources"]
    assert sum(ref["splits"][k]["documents"] for k in ref["splits"]) == 150


def test_prepare_mixed_formats_in_a_directory(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    docs = make_docs(40, seed=7)
    d = tmp_path / "in"
    d.mkdir()
    pq.write_table(pa.table({"text": docs[:20]}), d / "a.parquet", row_group_size=6)
    lines = "".join(json.dumps({"text": t}) + "\n" for t in docs[20:])
    (d / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))
    m = prepare(tok, d, tmp_path / "sh", val_fraction=0.3, progress=False)
    assert [Path(s["path"]).name for s in m["sources"]] == ["a.parquet", "b.jsonl.zst"]
    got = "".join(tok.decode(all_tokens(TokenDataset(tmp_path / "sh", s)).tolist()) for s in ("train", "val"))
    want = "".join(t + EOT for t in docs if split_of(t, 0.3) == "train")
    want += "".join(t + EOT for t in docs if split_of(t, 0.3) == "val")
    assert got == want


def test_explicit_split_and_bad_split_names(tmp_path, tok):
    src = write_corpus(tmp_path / "c.txt", make_docs(10))
    prepare(tok, src, tmp_path / "sh", split="val", progress=False)
    assert TokenDataset(tmp_path / "sh", "val").num_documents == 10
    with pytest.raises(ValueError, match=r"no shards for split 'train' \(splits with data: \['val'\]\)"):
        TokenDataset(tmp_path / "sh", "train")
    with pytest.raises(ValueError, match="split name"):
        prepare(tok, src, tmp_path / "x", split="a/b", progress=False)
    with pytest.raises(ValueError, match="not both"):
        prepare(tok, src, tmp_path / "x", split="val", val_fraction=0.1, progress=False)
    assert not (tmp_path / "x").exists()  # bad arguments are caught before anything is created


@pytest.mark.parametrize("fail_at", [1, 3, 6])
def test_interrupted_prepare_resumes_to_identical_shards(tmp_path, tok, monkeypatch, caplog, fail_at):
    srcs = [write_corpus(tmp_path / f"c{i}.txt", make_docs(60, seed=i)) for i in range(3)]
    kw = dict(val_fraction=0.25, shard_tokens=700, progress=False)
    prepare(tok, srcs, tmp_path / "ref", **kw)
    monkeypatch.setattr(data, "BATCH_BYTES", 900)  # several batches per source: the crash lands mid-source
    calls = {"n": 0}
    real = data.write_shard

    def crashing(*a, **k):
        calls["n"] += 1
        if calls["n"] == fail_at:
            raise KeyboardInterrupt("simulated crash")
        return real(*a, **k)

    monkeypatch.setattr(data, "write_shard", crashing)
    with pytest.raises(KeyboardInterrupt):
        prepare(tok, srcs, tmp_path / "sh", **kw)
    assert f"the {fail_at - 1} shards written so far are safe" in caplog.text
    m = json.loads((tmp_path / "sh" / "manifest.json").read_text())
    assert m["pending"] is not None and len(m["pending"]["shards"]) == fail_at - 1
    assert not list((tmp_path / "sh").glob(".*.tmp"))  # no half shard left behind
    with pytest.raises(ValueError, match="interrupted prepare"):
        prepare(tok, srcs[:2], tmp_path / "sh", **kw)  # different inputs: refuse, don't mix
    prepare(tok, srcs, tmp_path / "sh", **{**kw, "shard_tokens": 999})  # the resumed run keeps its shard size
    assert shard_hashes(tmp_path / "sh") == shard_hashes(tmp_path / "ref")
    for split in ("train", "val"):
        a, b = TokenDataset(tmp_path / "sh", split), TokenDataset(tmp_path / "ref", split)
        assert (a.num_tokens, a.num_documents, a.text_bytes) == (b.num_tokens, b.num_documents, b.text_bytes)


def test_interrupted_append_resumes(tmp_path, tok, monkeypatch):
    a = write_corpus(tmp_path / "a.txt", make_docs(50, seed=1))
    b = write_corpus(tmp_path / "b.txt", make_docs(50, seed=2))
    prepare(tok, a, tmp_path / "ref", shard_tokens=500, progress=False)
    prepare(tok, b, tmp_path / "ref", shard_tokens=500, append=True, progress=False)
    prepare(tok, a, tmp_path / "sh", shard_tokens=500, progress=False)
    n_a = len(TokenDataset(tmp_path / "sh").shards)
    real, calls = data.write_shard, {"n": 0}

    def crashing(*args, **kw):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("disk full")
        return real(*args, **kw)

    monkeypatch.setattr(data, "write_shard", crashing)
    with pytest.raises(OSError):
        prepare(tok, b, tmp_path / "sh", shard_tokens=500, append=True, progress=False)
    assert len(TokenDataset(tmp_path / "sh").shards) == n_a  # the unfinished run's shard stays invisible
    monkeypatch.setattr(data, "write_shard", real)
    prepare(tok, b, tmp_path / "sh", shard_tokens=500, append=True, progress=False)
    assert shard_hashes(tmp_path / "sh") == shard_hashes(tmp_path / "ref")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        prepare(tok, a, tmp_path / "file", progress=False)


KILL_SCRIPT = """
import os, signal, sys
from lmforge.data import pipeline as data
from lmforge.data import shards
from lmforge.common import atomic_open
from lmforge.tokenizer import Tokenizer
calls = []

def dying_write(path, tokens, *args):
    calls.append(path)
    if len(calls) < 3:
        return shards.write_shard(path, tokens, *args)
    with atomic_open(path, "wb") as f:  # half a shard reaches the disk, then the process is killed
        f.write(tokens[: len(tokens) // 2].tobytes())
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)

data.write_shard = dying_write
data.prepare(Tokenizer.load(sys.argv[1]), sys.argv[2], sys.argv[3], shard_tokens=400, progress=False)
"""


def test_prepare_killed_mid_shard_resumes_cleanly(tmp_path, tok):
    import subprocess
    import sys

    src = write_corpus(tmp_path / "c.txt", make_docs(80))
    tok.save(tmp_path / "tok.json")
    prepare(tok, src, tmp_path / "ref", shard_tokens=400, progress=False)
    res = subprocess.run([sys.executable, "-c", KILL_SCRIPT, str(tmp_path / "tok.json"), str(src), str(tmp_path / "sh")],
                         capture_output=True, text=True)
    assert res.returncode == -9, res.stderr
    assert list((tmp_path / "sh").glob(".train_00002.bin.*.tmp"))  # the half shard, under a temporary name
    (tmp_path / "sh" / ".manifest.json.lmforge-x1y2.tmp").write_text("{half")  # as if killed while saving the manifest
    prepare(tok, src, tmp_path / "sh", shard_tokens=400, progress=False)
    assert not list((tmp_path / "sh").glob(".*.tmp"))
    assert shard_hashes(tmp_path / "sh") == shard_hashes(tmp_path / "ref")
    TokenDataset(tmp_path / "sh", verify=True)


def test_restart_discards_only_the_interrupted_run(tmp_path, tok, monkeypatch):
    a = write_corpus(tmp_path / "a.txt", make_docs(50, seed=1))
    b = write_corpus(tmp_path / "b.txt", make_docs(50, seed=2))
    c = write_corpus(tmp_path / "c.txt", make_docs(5, seed=3))
    prepare(tok, a, tmp_path / "sh", shard_tokens=500, progress=False)
    n_a = len(TokenDataset(tmp_path / "sh").shards)
    real, calls = data.write_shard, []
    monkeypatch.setattr(data, "write_shard", lambda *args: real(*args) if len(calls.append(1) or calls) < 2 else 1 / 0)
    with pytest.raises(ZeroDivisionError):  # b fails half way (say, a bad line the user then fixes)
        prepare(tok, b, tmp_path / "sh", shard_tokens=500, append=True, progress=False)
    monkeypatch.setattr(data, "write_shard", real)
    with pytest.raises(ValueError, match=r"restart=True \(CLI: --restart\)"):  # other inputs: refused, not mixed
        prepare(tok, c, tmp_path / "sh", shard_tokens=500, append=True, progress=False)
    m = prepare(tok, c, tmp_path / "sh", shard_tokens=500, append=True, restart=True, progress=False)
    assert [Path(s["path"]).name for s in m["sources"]] == ["a.txt", "c.txt"]  # a's shards were kept
    assert len(TokenDataset(tmp_path / "sh", verify=True).shards) == n_a + 1
    assert not (tmp_path / "sh" / shards.shard_name("train", n_a + 1)).exists()  # b's partial shards are gone


def test_crash_between_shard_and_manifest_leaves_no_valid_looking_orphan(tmp_path, tok, monkeypatch):
    src = write_corpus(tmp_path / "c.txt", make_docs(80))
    prepare(tok, src, tmp_path / "ref", shard_tokens=600, progress=False)
    real, calls = data.save_manifest, {"n": 0}

    def crashing(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:  # after the 2nd shard file was renamed into place
            raise RuntimeError("simulated crash")
        return real(*a, **k)

    monkeypatch.setattr(data, "save_manifest", crashing)
    with pytest.raises(RuntimeError):
        prepare(tok, src, tmp_path / "sh", shard_tokens=600, progress=False)
    monkeypatch.setattr(data, "save_manifest", real)
    assert (tmp_path / "sh" / "train_00001.bin").exists()  # on disk but not in the manifest
    with pytest.raises(ValueError, match="no shards for split .* in progress or was interrupted"):
        TokenDataset(tmp_path / "sh", "train")  # readers only see committed shards
    prepare(tok, src, tmp_path / "sh", shard_tokens=600, progress=False)
    assert shard_hashes(tmp_path / "sh") == shard_hashes(tmp_path / "ref")


def test_duplicates_append_and_force(tmp_path, tok, caplog):
    a = write_corpus(tmp_path / "a.txt", make_docs(30, seed=1))
    b = write_corpus(tmp_path / "b.txt", make_docs(30, seed=2))
    copy = tmp_path / "a_copy.txt"
    copy.write_bytes(a.read_bytes())
    out = tmp_path / "sh"
    m = prepare(tok, [a, copy], out, shard_tokens=400, progress=False)
    assert len(m["sources"]) == 1 and "same content as" in caplog.text
    n_a = m["splits"]["train"]["tokens"]
    with pytest.raises(ValueError, match="already holds shards; pass append=True"):
        prepare(tok, b, out, progress=False)
    caplog.clear()
    m = prepare(tok, [a, b], out, append=True, shard_tokens=400, progress=False)
    assert "already in the shards" in caplog.text
    assert [Path(s["path"]).name for s in m["sources"]] == ["a.txt", "b.txt"]
    ds = TokenDataset(out, "train", verify=True)
    assert tok.decode(all_tokens(ds)[n_a:].tolist()).startswith("Doc 2-0:")
    before = m
    assert prepare(tok, copy, out, append=True, progress=False) == before  # nothing new: unchanged
    m = prepare(tok, b, out, force=True, shard_tokens=400, progress=False)
    assert len(m["sources"]) == 1 and not (out / "train_00009.bin").exists()


def test_bad_inputs_and_settings(tmp_path, tok):
    src = write_corpus(tmp_path / "c.txt", make_docs(5))
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty.txt is empty"):
        prepare(tok, [src, empty], tmp_path / "a", progress=False)
    prepare(tok, src, tmp_path / "a", progress=False)  # the failed attempt left nothing in the way
    with data._exclusive(tmp_path / "a"), pytest.raises(ValueError, match="another `prepare` is writing"):
        prepare(tok, src, tmp_path / "a", append=True, progress=False)
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not an lmforge shard directory"):
        prepare(tok, src, junk, force=True, progress=False)
    assert (junk / "notes.txt").read_text() == "mine"
    with pytest.raises(ValueError, match="EOS token '<eos>' is not a special token"):
        prepare(tok, src, tmp_path / "b", eos="<eos>", progress=False)

    class Huge:  # a tokenizer whose ids do not fit uint16
        vocab_size, eot_id, special_tokens = 70_000, None, {}

        def fingerprint(self):
            return "f" * 16

    with pytest.raises(ValueError, match="70000 tokens, which do not fit in uint16"):
        prepare(Huge(), src, tmp_path / "c", dtype="uint16", progress=False)
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"fine<|endoftext|>broken \xff here<|endoftext|>fine again")
    with pytest.raises(ValueError, match="invalid UTF-8"):
        prepare(tok, bad, tmp_path / "d", progress=False)
    m = prepare(tok, bad, tmp_path / "d", utf8_errors="skip", force=True, progress=False)
    assert m["sources"][0]["invalid_utf8"] == 1 and m["splits"]["train"]["documents"] == 2
    assert "documents dropped/fixed: 1 invalid utf8" in shards.inspect(tmp_path / "d")
    prepare(tok, src, tmp_path / "e", progress=False)
    other = type(tok)(dict(enumerate(bytes([i]) for i in range(256))), [], [EOT])
    with pytest.raises(ValueError, match="different tokenizer"):
        prepare(other, bad, tmp_path / "e", append=True, progress=False)
    with pytest.raises(ValueError, match=r"made with a different tokenizer \(the one saved as .*e/tokenizer.json"):
        TokenDataset(tmp_path / "e").check_tokenizer(other)
    TokenDataset(tmp_path / "e").check_tokenizer(tok)


# --------------------------------------------------------------------------------------------------
# Shard and manifest checks
# --------------------------------------------------------------------------------------------------
@pytest.fixture
def shard_dir(tmp_path, tok):
    prepare(tok, write_corpus(tmp_path / "c.txt", make_docs(60)), tmp_path / "sh", shard_tokens=300, progress=False)
    return tmp_path / "sh"


def test_truncated_and_corrupt_shards(shard_dir):
    p = shard_dir / "train_00001.bin"
    raw = p.read_bytes()
    p.write_bytes(raw[:-3])
    with pytest.raises(ValueError, match="train_00001.bin is truncated"):
        TokenDataset(shard_dir)
    p.write_bytes(raw[:100])
    with pytest.raises(ValueError, match="shorter than its 256-byte header"):
        TokenDataset(shard_dir)
    p.write_bytes(raw[:20] + b"\x07" + raw[21:])
    with pytest.raises(ValueError, match="corrupt header"):
        TokenDataset(shard_dir)
    p.write_bytes(b"NOTSHARD" + raw[8:])
    with pytest.raises(ValueError, match="not an lmforge shard"):
        TokenDataset(shard_dir)
    body = bytearray(raw)
    body[300] ^= 1
    p.write_bytes(bytes(body))
    TokenDataset(shard_dir)  # header and size fine ...
    with pytest.raises(ValueError, match="SHA-256 differs"):
        TokenDataset(shard_dir, verify=True)  # ... the content hash is not
    p.unlink()
    with pytest.raises(ValueError, match="listed in the manifest is missing"):
        TokenDataset(shard_dir)


@pytest.mark.parametrize("edit,msg", [
    (lambda m: m["splits"]["train"].__setitem__("tokens", 5), "says tokens=5 but its shards add up"),
    (lambda m: m["shards"].append(dict(m["shards"][0])), "listed twice"),
    (lambda m: m["shards"][1].__setitem__("sha256", m["shards"][0]["sha256"]), "added twice"),
    (lambda m: m["shards"][0].__setitem__("name", "val_00000.bin"), "does not match its split"),
    (lambda m: m.__setitem__("dtype", "int8"), "dtype 'int8'"),
    (lambda m: m["sources"][0]["tokens"].__setitem__("train", 1), "sources add up to 1 train tokens"),
    (lambda m: m["shards"][0].__setitem__("tokens", 1), "add up to"),
    (lambda m: m["shards"][0].pop("tokens"), "a field is missing or has the wrong type"),
    (lambda m: m.__setitem__("splits", []), "a field is missing or has the wrong type"),
])
def test_hand_edited_manifest_is_rejected(shard_dir, edit, msg):
    path = shard_dir / "manifest.json"
    m = json.loads(path.read_text())
    edit(m)
    path.write_text(json.dumps(m))
    with pytest.raises(ValueError, match=msg):
        TokenDataset(shard_dir)


def test_manifest_shard_mismatch_and_bad_json(shard_dir):
    path = shard_dir / "manifest.json"
    m = json.loads(path.read_text())
    m["shards"][0]["documents"] += 1
    m["splits"]["train"]["documents"] += 1
    path.write_text(json.dumps(m))
    with pytest.raises(ValueError, match="does not match the manifest"):
        TokenDataset(shard_dir)
    path.write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        TokenDataset(shard_dir)
    with pytest.raises(ValueError, match="not a shard directory"):
        TokenDataset(shard_dir.parent)


# --------------------------------------------------------------------------------------------------
# get_batch
# --------------------------------------------------------------------------------------------------
def test_get_batch_semantics():
    tokens = np.arange(100, dtype=np.uint16)
    x, y = get_batch(tokens, 64, 8, "cpu", generator=torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (64, 8) and x.dtype == y.dtype == torch.int64
    assert torch.equal(y, x + 1) and torch.equal(x[:, 1:], x[:, :-1] + 1)
    starts = torch.cat([get_batch(tokens, 256, 8)[0][:, 0] for _ in range(20)])
    assert starts.min() == 0 and starts.max() == 100 - 8 - 1  # every valid start can occur
    a = get_batch(tokens, 4, 8, generator=torch.Generator().manual_seed(1))
    b = get_batch(tokens, 4, 8, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a[0], b[0])
    with pytest.raises(ValueError, match="fewer than context_length"):
        get_batch(tokens[:8], 1, 8)


# --------------------------------------------------------------------------------------------------
# BlockLoader
# --------------------------------------------------------------------------------------------------
def block_ids(x: torch.Tensor, tokens: np.ndarray, T: int) -> list[int]:
    """Recover the block index of each row (rows are unique since blocks hold distinct token runs)."""
    view = tokens[: len(tokens) // (T + 1) * (T + 1)].reshape(-1, T + 1)[:, :T]
    lookup = {row.tobytes(): i for i, row in enumerate(view.astype(np.int64))}
    return [lookup[r.numpy().tobytes()] for r in x]


@pytest.fixture
def arange_dir(tmp_path):
    """A hand-made shard directory whose tokens are 0, 1, 2, ... so every block is identifiable."""
    return _arange_shards(tmp_path / "ar", [(0, 330), (330, 660)])


def _arange_shards(d: Path, ranges: list[tuple[int, int]], append_to: dict | None = None) -> Path:
    d.mkdir(exist_ok=True)
    m = append_to or shards.new_manifest({"fingerprint": "ab" * 8, "vocab_size": 65536, "eot_id": None}, "uint16",
                                         1000, None, None)
    m["sources"].append({"path": f"r{len(m['sources'])}", "size": 1, "sha256": str(ranges), "tokens": {"train": 0}})
    for lo, hi in ranges:
        name = shards.shard_name("train", len(m["shards"]))
        toks = np.arange(lo, hi, dtype=np.uint16)
        starts = np.arange(0, hi - lo, 7)
        sha = shards.write_shard(d / name, toks, starts, 65536, "ab" * 8)
        m["shards"].append({"name": name, "split": "train", "tokens": hi - lo, "documents": len(starts), "sha256": sha})
        info = m["splits"].setdefault("train", {"tokens": 0, "documents": 0, "shards": 0, "text_bytes": 0})
        info["tokens"] += hi - lo
        info["documents"] += len(starts)
        info["shards"] += 1
        m["sources"][-1]["tokens"]["train"] += hi - lo
    shards.save_manifest(d, m)
    return d


def test_block_loader_epochs_cover_every_block_once(arange_dir):
    ds = TokenDataset(arange_dir)
    T = 9  # blocks of 10 tokens: 33 per shard, 66 in all
    assert ds.max_token_id == 659  # no record in this hand-made manifest: scanned
    loader = BlockLoader(ds, 4, T, seed=0)
    assert loader.steps_per_epoch == 16
    seen = []
    for _ in range(16):
        x, y = loader.next_batch()
        assert x.shape == (4, T) and x.dtype == torch.int64 and torch.equal(y, x + 1)
        assert (x[:, 0] % 10 == 0).all()  # blocks are aligned on multiples of T+1 within a shard
        seen += x[:, 0].tolist()
    assert len(set(seen)) == 64 and loader.epoch == 0
    loader.next_batch()
    assert loader.epoch == 1  # the 2-block remainder is dropped, the next epoch reshuffles
    other = BlockLoader(ds, 4, T, seed=1)
    assert not torch.equal(other.next_batch()[0], BlockLoader(ds, 4, T, seed=0).next_batch()[0])


def test_permute_is_a_keyed_bijection():
    from lmforge.data.loader import _round_keys, permute

    for n in [1, 2, 3, 4, 5, 16, 17, 255, 256, 257, 1000, 4097]:
        p = permute(np.arange(n), n, _round_keys(1, 2, 3))
        assert sorted(p.tolist()) == list(range(n))
    a = permute(np.arange(1000), 1000, _round_keys(0, 0, 0))
    b = permute(np.arange(1000), 1000, _round_keys(0, 1, 0))
    assert (a != b).mean() > 0.9 and abs(np.corrcoef(np.arange(1000), a)[0, 1]) < 0.2  # shuffled, per key
    assert 0.3 < np.abs(np.diff(a)).mean() / 1000 < 0.37  # neighbours land ~n/3 apart, as in a random permutation
    assert np.array_equal(permute(np.array([5, 999]), 1000, _round_keys(0, 0, 0)), a[[5, 999]])  # pointwise


@pytest.mark.timeout(30)  # well under 1 s: a resume that loops must fail here, not hang for the 300 s default
@pytest.mark.parametrize("n", [0, 1, 7, 16, 23])
def test_block_loader_resume_is_exact(arange_dir, n):
    ds = TokenDataset(arange_dir)
    ref = BlockLoader(ds, 4, 9, seed=5)
    want = [ref.next_batch() for _ in range(n + 12)][n:]
    a = BlockLoader(ds, 4, 9, seed=5)
    for _ in range(n):
        a.next_batch()
    state = json.loads(json.dumps(a.state_dict()))  # must survive JSON
    b = BlockLoader(TokenDataset(arange_dir), 4, 9, seed=5)
    b.load_state_dict(state)
    for wx, wy in want:
        x, y = b.next_batch()
        assert torch.equal(x, wx) and torch.equal(y, wy)
    with pytest.raises(ValueError, match=r"global batch of 4 sequences per step \(batch_size=4 x world_size=1\) "
                                         r"but this loader takes 2 .* training.global_batch_size=4"):
        BlockLoader(ds, 2, 9, seed=5).load_state_dict(state)


def _step_blocks(loaders: list, accum: int) -> list[int]:
    """First token of every block one optimizer step hands to all ranks, in global order (micro-batch, rank)."""
    return [v for _ in range(accum) for loader in loaders for v in loader.next_batch()[0][:, 0].tolist()]


@pytest.mark.parametrize("world, micro", [(1, 2), (2, 4), (2, 1), (4, 2)])
def test_global_batch_steps_see_the_same_blocks_at_any_world_size(arange_dir, world, micro):
    # 66 blocks, G = 8: 8 steps per epoch, then a new epoch at a step boundary whatever the micro-batch split
    ds = TokenDataset(arange_dir)
    ref = BlockLoader(ds, 8, 9, seed=3, global_batch_size=8)
    want = [_step_blocks([ref], 1) for _ in range(20)]
    accum = 8 // (world * micro)
    ranks = [BlockLoader(ds, micro, 9, seed=3, rank=r, world_size=world, global_batch_size=8) for r in range(world)]
    got = [_step_blocks(ranks, accum) for _ in range(11)]
    # elastic resume: the state saved at this world size continues at world 1 (micro-batch 2) with the same blocks
    one = BlockLoader(TokenDataset(arange_dir), 2, 9, seed=3, global_batch_size=8)
    one.load_state_dict(json.loads(json.dumps(ranks[0].state_dict())))
    got += [_step_blocks([one], 4) for _ in range(9)]
    assert got == want and ranks[0].epoch == 1
    with pytest.raises(ValueError, match="must be a positive multiple of batch_size x world_size"):
        BlockLoader(ds, 3, 9, world_size=2, global_batch_size=8)


def test_ranks_are_disjoint_and_cover_the_epoch(arange_dir):
    ds = TokenDataset(arange_dir)
    per_rank = []
    for rank in range(3):
        loader = BlockLoader(ds, 2, 9, seed=0, rank=rank, world_size=3)
        per_rank.append([v for _ in range(loader.steps_per_epoch) for v in loader.next_batch()[0][:, 0].tolist()])
    sets = [set(r) for r in per_rank]
    assert all(len(s) == 22 for s in sets) and not (sets[0] & sets[1] or sets[0] & sets[2] or sets[1] & sets[2])
    assert set().union(*sets) == set(range(0, 660, 10))  # 66 blocks = 11 steps x 2 x 3 ranks: all covered
    single = BlockLoader(ds, 6, 9, seed=0)
    first = single.next_batch()[0][:, 0].tolist()
    assert first == per_rank[0][:2] + per_rank[1][:2] + per_rank[2][:2]  # same global order as one big batch
    with pytest.raises(ValueError, match="rank must be in"):
        BlockLoader(ds, 2, 9, rank=3, world_size=3)


@pytest.mark.timeout(30)  # well under 1 s
def test_appended_shards_join_the_unseen_rest_of_the_epoch(arange_dir):
    ds = TokenDataset(arange_dir)
    a = BlockLoader(ds, 4, 9, seed=2)
    seen = [v for _ in range(5) for v in a.next_batch()[0][:, 0].tolist()]
    state = a.state_dict()
    m = shards.load_manifest(arange_dir)
    _arange_shards(arange_dir, [(660, 990)], append_to=m)  # 33 more blocks arrive between restarts
    b = BlockLoader(TokenDataset(arange_dir), 4, 9, seed=2)
    b.load_state_dict(state)
    assert b.steps_per_epoch == 24  # (66 + 33) // 4
    rest = [v for _ in range(24 - 5) for v in b.next_batch()[0][:, 0].tolist()]
    assert b.epoch == 0 and not set(seen) & set(rest)  # nothing already seen repeats in this epoch
    assert len(set(seen + rest)) == 96 and any(v >= 660 for v in rest)
    # A second restart after the merge replays it exactly.
    c = BlockLoader(TokenDataset(arange_dir), 4, 9, seed=2)
    c.load_state_dict(state)
    c.next_batch()
    state2 = c.state_dict()
    assert state2["merges"] == [{"at": 20, "shards": ["train_00002.bin"]}]
    want = [c.next_batch()[0] for _ in range(25)]  # crosses into epoch 1, which includes all shards
    d = BlockLoader(TokenDataset(arange_dir), 4, 9, seed=2)
    d.load_state_dict(json.loads(json.dumps(state2)))
    assert all(torch.equal(d.next_batch()[0], w) for w in want)


def test_removed_or_duplicated_shards_are_refused(arange_dir):
    ds = TokenDataset(arange_dir)
    state = BlockLoader(ds, 4, 9).state_dict()
    state["epoch_shards"].append("train_00009.bin")
    with pytest.raises(ValueError, match="missing: train_00009.bin"):
        BlockLoader(ds, 4, 9).load_state_dict(state)
    state = BlockLoader(ds, 4, 9).state_dict()
    state["shards"]["train_00001.bin"] = "0" * 64
    with pytest.raises(ValueError, match="was replaced"):
        BlockLoader(ds, 4, 9).load_state_dict(state)


def test_dataset_shorter_than_a_batch(arange_dir):
    with pytest.raises(ValueError, match="fewer than one global batch"):
        BlockLoader(TokenDataset(arange_dir), 4, 400)
    with pytest.raises(ValueError, match="not enough for one batch"):
        val_batches(TokenDataset(arange_dir), 4, 400, 2)


def test_bos_aligned_blocks_and_positions(tmp_path, tok):
    docs = make_docs(80)
    prepare(tok, write_corpus(tmp_path / "c.txt", docs), tmp_path / "sh", bos=EOT, eos=None, shard_tokens=800,
            progress=False)
    ds = TokenDataset(tmp_path / "sh")
    loader = BlockLoader(ds, 8, 32, seed=0, bos_aligned=True, positions=True)
    for _ in range(loader.steps_per_epoch):
        x, y, pos = loader.next_batch()
        assert (x[:, 0] == tok.eot_id).all()  # every row starts at a document (BOS)
        assert torch.equal(x[:, 1:], y[:, :-1])
        assert pos.shape == x.shape and (pos[:, 0] == 0).all()
        restart = x == tok.eot_id  # positions restart at each BOS and count up in between
        expect = torch.zeros_like(pos)
        for t in range(1, x.shape[1]):
            expect[:, t] = torch.where(restart[:, t], 0, expect[:, t - 1] + 1)
        assert torch.equal(pos, expect)


def test_val_batches_are_fixed_and_sequential(arange_dir):
    ds = TokenDataset(arange_dir)
    batches = val_batches(ds, 4, 9, max_batches=3)
    assert len(batches) == 3
    assert batches[0][0][:, 0].tolist() == [0, 10, 20, 30] and torch.equal(batches[0][1], batches[0][0] + 1)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, val_batches(ds, 4, 9, 3)))
    assert len(val_batches(ds, 4, 9, 100)) == 16  # all 66 blocks -> 16 full batches


@pytest.mark.timeout(90)  # about 5 s on 2 shared cores
def test_resume_and_epoch_invariants_property(tmp_path_factory):
    """For random shard sizes, batch shapes, ranks and save points: resume is exact, epochs never repeat a block."""
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies

    @hypothesis.settings(max_examples=25, deadline=None)
    @hypothesis.given(sizes=st.lists(st.integers(40, 300), min_size=1, max_size=4), B=st.integers(1, 4),
                      T=st.integers(1, 12), W=st.integers(1, 3), seed=st.integers(0, 2**31), n=st.integers(0, 30),
                      extra=st.lists(st.integers(40, 300), max_size=2))
    def check(sizes, B, T, W, seed, n, extra):
        edges = np.cumsum([0] + sizes + extra)
        d = tmp_path_factory.mktemp("prop")
        _arange_shards(d, [(int(a), int(b)) for a, b in zip(edges[:len(sizes)], edges[1:len(sizes) + 1])])
        ds = TokenDataset(d)
        total = sum(s // (T + 1) for s in sizes)
        hypothesis.assume(total >= B * W)
        ranks = [BlockLoader(ds, B, T, seed=seed, rank=r, world_size=W) for r in range(W)]
        seen: dict[int, set] = {}
        for _ in range(n):
            for loader in ranks:
                x = loader.next_batch()[0]
                ep = seen.setdefault(loader.epoch, set())
                firsts = set(x[:, 0].tolist())
                assert not ep & firsts and len(firsts) == B  # no block twice in an epoch, across ranks
                ep |= firsts
        state = json.loads(json.dumps(ranks[0].state_dict()))
        assert all(r.state_dict() == ranks[0].state_dict() for r in ranks)  # one state for all ranks
        if extra:  # data arrives between restarts
            m = shards.load_manifest(d)
            tail = edges[len(sizes):]
            _arange_shards(d, [(int(a), int(b)) for a, b in zip(tail[:-1], tail[1:])], append_to=m)
        restored = [BlockLoader(TokenDataset(d), B, T, seed=seed, rank=r, world_size=W) for r in range(W)]
        for r, loader in enumerate(restored):
            loader.load_state_dict(state)
        again = BlockLoader(TokenDataset(d), B, T, seed=seed, rank=0, world_size=W)
        again.load_state_dict(state)
        epoch = restored[0].epoch
        for _ in range(8):
            rows = [loader.next_batch()[0] for loader in restored]
            assert torch.equal(again.next_batch()[0], rows[0])  # restoring twice gives the same run
            if not extra:
                assert all(torch.equal(row, ref.next_batch()[0]) for row, ref in zip(rows, ranks))  # == no restart
            if restored[0].epoch == epoch:
                firsts = set(torch.cat(rows)[:, 0].tolist())
                assert not seen.get(epoch, set()) & firsts
                seen.setdefault(epoch, set()).update(firsts)

    check()


class _FlatOnly:
    """A tokenizer with only ``encode_batch_flat`` (prepare's fallback for tokenizers other than lmforge's)."""

    def __init__(self, tok):
        self.encode_batch_flat = tok.encode_batch_flat


@pytest.mark.parametrize("bos,eos", [(None, None), (None, 0), (0, None), (0, 0), (1, 0)])
@pytest.mark.parametrize("first_offset", [0, 2])
@pytest.mark.parametrize("kind", ["cpp", "python", "flat-only"])
@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_encode_batch_with_bos_eos_matches_per_document_reference(tok, bos, eos, first_offset, kind, dtype):
    """prepare's BOS/EOS placement (C++ spans, Python spans, or vectorised numpy) equals the plain
    per-document construction."""
    from lmforge.corpus.sources import DocBatch

    docs = make_docs(30, seed=5) + ["é ü", "x", "a<|endoftext|>b"]
    ids = {None: None, 0: tok.eot_id, 1: tok.eot_id - 1}
    b, e = ids[bos], ids[eos]
    per_doc = [([b] if b is not None else []) + tok.encode(d) + ([e] if e is not None else []) for d in docs]
    enc = {"cpp": tok, "python": Tokenizer(tok.vocab, tok.merges, ["<|endoftext|>"], backend="python"),
           "flat-only": _FlatOnly(tok)}[kind]
    if kind == "cpp" and tok.backend != "cpp":
        pytest.skip("C++ core not built")
    toks, lengths, is_start, text_bytes = data._encode(enc, DocBatch.from_texts(docs), b, e, first_offset, 2, dtype)
    assert toks.dtype == np.dtype(dtype)
    assert toks.tolist() == [t for p in per_doc for t in p][first_offset:]
    assert lengths.tolist() == [len(per_doc[0]) - first_offset] + [len(p) for p in per_doc[1:]]
    assert is_start.tolist() == [not first_offset] + [True] * (len(docs) - 1)
    assert text_bytes.tolist() == [len(d.encode()) for d in docs]
