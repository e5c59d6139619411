"""Corpus sources: streaming document readers, a deterministic train/val split, named datasets.

Everything here streams: a text file is read in chunks, JSON Lines line by line, Parquet one row group
at a time, so memory stays flat however large the corpus is. Compressed variants (``.gz``, ``.zst``)
are decompressed on the fly.

Documents in plain text files are separated by a delimiter: ``EOT`` (the default, as in
TinyStories and OpenWebText dumps), any other string, ``"blankline"`` (paragraphs) or ``"line"`` (one
document per line). Leading and trailing whitespace of each document is stripped and empty documents
are dropped.

Named datasets (``get_dataset``) download once into the cache directory (``$LMFORGE_CACHE``, else the
platform user cache dir) and return local paths; the download code lives in :mod:`lmforge.corpus.datasets`.
"""

from __future__ import annotations

import glob
import io
import json
import logging
import os
import re
import zlib
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Iterator, Sequence

from lmforge import _native
from lmforge.common import check_input_file
from lmforge.corpus.specials import EOT

if TYPE_CHECKING:  # numpy is imported where it is used: reading and counting text (train_bpe) never needs it
    import numpy as np  # here: tokenizer training reads text without numpy (~13 MB)

logger = logging.getLogger("lmforge")

TEXT_SUFFIXES = (".txt", ".text", ".md")
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
PARQUET_SUFFIXES = (".parquet",)
COMPRESSION_SUFFIXES = (".gz", ".zst")
UTF8_POLICIES = ("error", "skip", "replace")
_READ_CHUNK = 4 << 20  # bytes read from a text file at a time
MAX_DOCUMENT_BYTES = 256 << 20  # a longer "document" almost always means a wrong delimiter
_BLANKLINE = re.compile(rb"\n[ \t\r\f\v]*\n")


# ReadStats and DocBatch are plain classes, not dataclasses: importing dataclasses (and the inspect module it
# loads) costs ~8 ms, paid by every `lmforge tokenizer train` that reads files through this module.
class ReadStats:
    """Counters filled in while reading: what was read, what was dropped and why."""

    __slots__ = ("documents", "text_bytes", "empty_skipped", "invalid_utf8", "files")

    def __init__(self, documents: int = 0, text_bytes: int = 0, empty_skipped: int = 0, invalid_utf8: int = 0,
                 files: list[str] | None = None):
        self.documents = documents
        self.text_bytes = text_bytes  # UTF-8 bytes of the documents yielded
        self.empty_skipped = empty_skipped  # empty / whitespace-only documents dropped
        self.invalid_utf8 = invalid_utf8  # documents that contained invalid UTF-8 (skipped or replaced, per policy)
        self.files: list[str] = [] if files is None else files

    def __repr__(self) -> str:
        return "ReadStats(" + ", ".join(f"{k}={getattr(self, k)!r}" for k in self.__slots__) + ")"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ReadStats):
            return NotImplemented
        return all(getattr(self, k) == getattr(other, k) for k in self.__slots__)


# --------------------------------------------------------------------------------------------------
# Finding input files
# --------------------------------------------------------------------------------------------------
def _base_suffix(path: Path) -> str:
    """The format suffix of ``path`` ignoring a compression suffix: ``a.jsonl.gz -> .jsonl``."""
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in COMPRESSION_SUFFIXES:
        suffixes = suffixes[:-1]
    return suffixes[-1] if suffixes else ""


def file_format(path: str | os.PathLike) -> str:
    """``"text" | "jsonl" | "parquet"`` from a file name (compression suffixes ignored).

    Files without a known suffix are read as plain text.
    """
    s = _base_suffix(Path(path))
    if s in JSONL_SUFFIXES:
        return "jsonl"
    if s in PARQUET_SUFFIXES:
        if Path(path).suffix.lower() in COMPRESSION_SUFFIXES:
            raise ValueError(f"{path}: compressed Parquet is not supported (Parquet compresses internally); "
                             "decompress it first")
        return "parquet"
    return "text"


def expand_inputs(inputs: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
    """Turn files, directories and glob patterns into a list of input files.

    Directories contribute their (recursive) files with a known suffix, sorted; globs are sorted too,
    so the order (and thus every later shard) is deterministic. A pattern matching nothing is an error.
    """
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    # A directory contributes .json files only when named explicitly: a stray config or tokenizer.json
    # in a corpus directory is not JSON Lines.
    known = TEXT_SUFFIXES + tuple(s for s in JSONL_SUFFIXES if s != ".json") + PARQUET_SUFFIXES
    out: list[Path] = []
    for item in inputs:
        p = Path(item)
        if any(ch in str(item) for ch in "*?["):
            matches = sorted(Path(m) for m in glob.glob(str(item), recursive=True) if os.path.isfile(m))
            if not matches:
                raise ValueError(f"the pattern {item!r} matches no files; check the path (quote globs in the shell)")
            out.extend(matches)
        elif p.is_dir():
            matches = sorted(m for m in p.rglob("*") if m.is_file() and _base_suffix(m) in known
                             and not m.name.startswith("."))
            if not matches:
                raise ValueError(f"directory {p} holds no .txt/.jsonl/.parquet files (optionally .gz/.zst)")
            out.extend(matches)
        else:
            out.append(check_input_file(p))
    if not out:
        raise ValueError("no input files given; pass files, directories or glob patterns")
    return out


def open_binary(path: str | os.PathLike) -> IO[bytes]:
    """Open a file for binary reading, decompressing ``.gz`` / ``.zst`` transparently (streaming)."""
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix == ".gz":
        import gzip  # here: plain text files need no gzip (~1 ms to import)

        return gzip.open(p, "rb")  # type: ignore[return-value]
    if suffix == ".zst":
        return io.BufferedReader(_ZstdRaw(open(p, "rb")), buffer_size=1 << 20)
    return open(p, "rb")


class _ZstdRaw(io.RawIOBase):
    """Streaming zstd decompression that, unlike ``zstandard``'s stream reader, reports a truncated file
    (``EOFError``) instead of silently returning fewer bytes; concatenated frames are read in turn."""

    def __init__(self, f: IO[bytes]) -> None:
        import zstandard  # here: only .zst inputs need it

        self._f, self._z = f, zstandard.ZstdDecompressor()
        self._d = self._z.decompressobj()
        self._buf, self._pos, self._any = b"", 0, False

    def readable(self) -> bool:
        return True

    def readinto(self, b: "bytearray | memoryview") -> int:  # type: ignore[override]
        while self._pos == len(self._buf):
            raw = self._f.read(1 << 20)
            if not raw:
                if self._any and not self._d.eof:
                    raise EOFError("the zstd stream ends in the middle of a frame (truncated file)")
                return 0
            self._any = True
            out = [self._d.decompress(raw)]
            while self._d.eof and self._d.unused_data:  # the next frame starts in this read
                rest = self._d.unused_data
                self._d = self._z.decompressobj()
                out.append(self._d.decompress(rest))
            self._buf, self._pos = b"".join(out), 0
        n = min(len(b), len(self._buf) - self._pos)
        b[:n] = self._buf[self._pos:self._pos + n]
        self._pos += n
        return n

    def close(self) -> None:
        self._f.close()
        super().close()


# --------------------------------------------------------------------------------------------------
# Decoding and cleaning lists of documents (list-level, so that per-document Python cost stays tiny)
# --------------------------------------------------------------------------------------------------
def _decode_all(pieces: list[bytes], errors: str, where: str, first: int, stats: ReadStats) -> list[str]:
    """Decode raw documents with the invalid-UTF-8 policy (documents skipped by the policy are left out)."""
    try:
        return [p.decode("utf-8") for p in pieces]
    except UnicodeDecodeError:
        pass
    out = []
    for k, raw in enumerate(pieces):
        try:
            out.append(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            if errors == "error":
                raise ValueError(f"{where} (document {first + k + 1}): invalid UTF-8 at byte {e.start} of the document "
                                 f"({raw[e.start:e.start + 4]!r}); fix the file or pass errors='skip' / 'replace' "
                                 "(CLI: --utf8-errors skip|replace)") from None
            stats.invalid_utf8 += 1
            if errors == "replace":
                out.append(raw.decode("utf-8", errors="replace"))
    return out


def _keep(docs: list[str], stats: ReadStats) -> list[str]:
    """Strip documents, drop (and count) empty ones, count the rest and their UTF-8 bytes."""
    kept = list(filter(None, map(str.strip, docs)))  # no per-document bytecode: ~25% faster than a comprehension
    stats.empty_skipped += len(docs) - len(kept)
    stats.documents += len(kept)
    stats.text_bytes += utf8_length(kept)
    return kept


def utf8_length(docs: list[str]) -> int:
    """Total UTF-8 bytes of ``docs`` (without copying them when they are ASCII)."""
    if all(map(str.isascii, docs)):
        return sum(map(len, docs))
    return sum(len(d.encode("utf-8", "surrogatepass")) for d in docs)


# --------------------------------------------------------------------------------------------------
# Documents as byte spans (what prepare tokenizes), and the splitter that makes them
# --------------------------------------------------------------------------------------------------
class DocBatch:
    """Consecutive documents as UTF-8 byte spans ``buf[starts[i]:ends[i]]`` (stripped, non-empty).

    ``crc`` holds each document's CRC-32 when the train/val split needs it (see :func:`lmforge.corpus.splits.val_mask`).
    Prepare passes these straight to the tokenizer: no Python string per document on the fast path.
    """

    __slots__ = ("buf", "starts", "ends", "crc")

    def __init__(self, buf: bytes, starts: np.ndarray, ends: np.ndarray, crc: np.ndarray | None = None):
        self.buf = buf
        self.starts = starts  # int64
        self.ends = ends  # int64
        self.crc = crc  # uint32

    def __repr__(self) -> str:
        return f"DocBatch({len(self)} documents, {len(self.buf)} bytes, crc={self.crc is not None})"

    def __len__(self) -> int:
        return len(self.starts)

    @property
    def sizes(self) -> np.ndarray:
        """UTF-8 bytes per document."""
        return self.ends - self.starts

    @classmethod
    def from_texts(cls, docs: Sequence[str], want_crc: bool = False) -> "DocBatch":
        import numpy as np  # here: tokenizer training reads text without numpy (~13 MB)

        raw = [d.encode("utf-8", "surrogatepass") for d in docs]
        sizes = np.fromiter(map(len, raw), np.int64, len(raw))
        ends = np.cumsum(sizes)
        crc = np.fromiter(map(zlib.crc32, raw), np.uint32, len(raw)) if want_crc else None
        return cls(b"".join(raw), ends - sizes, ends, crc)

    @classmethod
    def concat(cls, batches: Sequence["DocBatch"]) -> "DocBatch":
        """One batch holding ``batches`` in order (no copy for a single batch)."""
        import numpy as np  # here: tokenizer training reads text without numpy (~13 MB)

        if len(batches) == 1:
            return batches[0]
        shift = np.cumsum([0] + [len(b.buf) for b in batches[:-1]])
        crcs = [b.crc for b in batches]
        return cls(b"".join(b.buf for b in batches), np.concatenate([b.starts + k for b, k in zip(batches, shift)]),
                   np.concatenate([b.ends + k for b, k in zip(batches, shift)]),
                   None if any(c is None for c in crcs) else np.concatenate(crcs))

    def take(self, idx: np.ndarray) -> "DocBatch":
        """The documents at ``idx`` (same buffer)."""
        return DocBatch(self.buf, self.starts[idx], self.ends[idx], None if self.crc is None else self.crc[idx])

    def texts(self) -> list[str]:
        """The documents as ``str`` (for tokenizers without a span encoder)."""
        mv = memoryview(self.buf)
        return [str(mv[a:b], "utf-8", "surrogatepass") for a, b in zip(self.starts.tolist(), self.ends.tolist())]


def split_documents_reference(buf: bytes, sep: bytes, final: bool, want_crc: bool
                              ) -> tuple[int, int, np.ndarray, np.ndarray, np.ndarray | None, int]:
    """Pure-Python :func:`split_documents` (the specification the C++ splitter is tested against)."""
    import numpy as np  # here: tokenizer training reads text without numpy (~13 MB)

    data = bytes(buf)
    pieces = data.split(sep)
    if not final:
        pieces.pop()  # the bytes after the last delimiter wait for more data
    starts: list[int] = []
    ends: list[int] = []
    crcs: list[int] = []
    pos = consumed = count = 0
    bad = -1
    for i, raw in enumerate(pieces):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            bad = i
            break
        count += 1
        kept = text.strip()
        if kept:
            a = pos + len(text[:len(text) - len(text.lstrip())].encode("utf-8"))
            starts.append(a)
            ends.append(a + len(kept.encode("utf-8")))
            crcs.append(zlib.crc32(data[a:ends[-1]]))
        pos += len(raw) + (len(sep) if i < len(pieces) - 1 or not final else 0)
        consumed = pos
    return (consumed, count, np.array(starts, np.int64), np.array(ends, np.int64),
            np.array(crcs, np.uint32) if want_crc else None, bad)


def split_documents(buf: bytes, sep: bytes, final: bool, want_crc: bool = False
                    ) -> tuple[int, int, np.ndarray, np.ndarray, np.ndarray | None, int]:
    """Split ``buf`` on ``sep`` into documents stripped like ``str.strip()``, without making strings.

    Returns ``(consumed, pieces, starts, ends, crc, bad_piece)``: the bytes covered (through the last
    delimiter, or all of ``buf`` when ``final``), the number of pieces including empty ones, the byte
    spans of the non-empty documents, their CRC-32 (if ``want_crc``), and the index of the first piece
    that is not valid UTF-8 (-1 if none; the scan stops there). C++ when built, else the reference.
    """
    if _native.available("split_documents"):
        return _native.core().split_documents(buf, sep, final, want_crc)
    return split_documents_reference(buf, sep, final, want_crc)


# --------------------------------------------------------------------------------------------------
# Readers, one per format; each yields lists of documents
# --------------------------------------------------------------------------------------------------
def _utf8_cut(buf: bytes) -> int:
    """The start of the last (possibly incomplete) UTF-8 character of ``buf``: decoding ``buf[:cut]`` never
    splits a character."""
    k = len(buf) - 1
    while k > 0 and len(buf) - k < 4 and 0x80 <= buf[k] < 0xC0:  # continuation bytes
        k -= 1
    return max(k, 0)


def _check_runaway(path: Path, rest: bytes, doc_number: int, delimiter: str) -> None:
    """``ValueError`` when the bytes still waiting for a delimiter exceed :data:`MAX_DOCUMENT_BYTES`."""
    if len(rest) > MAX_DOCUMENT_BYTES:
        raise ValueError(f"{path}: document {doc_number} is longer than {MAX_DOCUMENT_BYTES >> 20} MiB "
                         f"without a {delimiter!r} delimiter; is the delimiter right? (CLI: --delimiter "
                         f"'{EOT}' | blankline | line | any string)")


def _text_batches(path: Path, delimiter: str, errors: str, stats: ReadStats) -> Iterator[list[str]]:
    """Documents of a plain-text file split on ``delimiter`` (read in 4 MiB chunks).

    Each chunk is scanned left to right, exactly like splitting the whole file at once; the piece
    after the last delimiter is carried into the next chunk. Fast path for string delimiters: the
    chunk is decoded in one call and split as ``str`` (UTF-8 is self-synchronising, so splitting text
    and bytes agree); only a chunk with invalid UTF-8 is split and decoded document by document.
    """
    if not delimiter:
        raise ValueError("delimiter must be a non-empty string, 'blankline' or 'line'")
    text_sep = "\n" if delimiter == "line" else delimiter
    sep = text_sep.encode("utf-8")
    n = 0
    rest = b""
    with open_binary(path) as f:
        while True:
            chunk = f.read(_READ_CHUNK)
            if not chunk and not n and not rest:  # nothing (more) to read; the end of a file with
                break  # documents is still processed below: its last piece may be an empty one
            buf = rest + chunk if rest else chunk
            docs = None
            if delimiter != "blankline":
                cut = _utf8_cut(buf) if chunk else len(buf)
                try:
                    docs = str(memoryview(buf)[:cut], "utf-8").split(text_sep)  # no copy of the chunk
                except UnicodeDecodeError:
                    docs = None  # the slow path below reports or repairs it
                else:  # the piece after the last delimiter may continue in the next chunk
                    rest = docs.pop().encode("utf-8") + buf[cut:] if chunk else b""
                    count = len(docs)
            if docs is None:
                pieces = _BLANKLINE.split(buf) if delimiter == "blankline" else buf.split(sep)
                rest = pieces.pop() if chunk else b""
                docs, count = _decode_all(pieces, errors, str(path), n, stats), len(pieces)
            _check_runaway(path, rest, n + count + 1, delimiter)
            if count:
                yield _keep(docs, stats)
                n += count
            if not chunk:
                break


def _text_spans(path: Path, delimiter: str, errors: str, stats: ReadStats, want_crc: bool) -> Iterator[DocBatch]:
    """:func:`_text_batches` without Python strings: the same chunking and the same documents, as spans."""
    sep = ("\n" if delimiter == "line" else delimiter).encode("utf-8")
    n = 0
    rest = b""
    with open_binary(path) as f:
        while True:
            chunk = f.read(_READ_CHUNK)
            if not chunk and not n and not rest:  # as in _text_batches
                break
            buf = rest + chunk if rest else chunk
            consumed, count, starts, ends, crc, bad = split_documents(buf, sep, not chunk, want_crc)
            if bad < 0:
                rest = buf[consumed:]
                batch = DocBatch(buf, starts, ends, crc)
                stats.documents += len(batch)
                stats.empty_skipped += count - len(batch)
                stats.text_bytes += int((ends - starts).sum())
            else:  # invalid UTF-8 somewhere in this chunk: the policy applies, document by document
                pieces = buf.split(sep)
                rest = pieces.pop() if chunk else b""
                count = len(pieces)
                batch = DocBatch.from_texts(_keep(_decode_all(pieces, errors, str(path), n, stats), stats), want_crc)
            _check_runaway(path, rest, n + count + 1, delimiter)
            if len(batch):
                yield batch
            n += count
            if not chunk:
                break


def _jsonl_error(path: Path, lineno: int, raw: bytes, text_field: str, errors: str, stats: ReadStats) -> str | None:
    """The slow path for one line: the text, ``None`` (skip), or a ``ValueError`` that says what is wrong."""
    decoded = _decode_all([raw], errors, f"{path}:{lineno}", 0, stats)
    if not decoded:
        return None
    try:
        obj = json.loads(decoded[0])
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg}); each line must be one JSON object") from None
    if not isinstance(obj, dict) or text_field not in obj:
        keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise ValueError(f"{path}:{lineno}: no field {text_field!r} (found {keys}); "
                         "pass the right one with text_field= (CLI: --text-field)")
    text = obj[text_field]
    if not isinstance(text, str):
        raise ValueError(f"{path}:{lineno}: field {text_field!r} is a {type(text).__name__}, not a string; "
                         "choose a text field with --text-field")
    return text


def _jsonl_batches(path: Path, text_field: str, errors: str, stats: ReadStats) -> Iterator[list[str]]:
    """The ``text_field`` string of every JSON object, one per line, about 4 MiB of lines at a time."""
    lineno = 0
    with open_binary(path) as f:
        while lines := f.readlines(_READ_CHUNK):
            lines = [ln for ln in lines if not ln.isspace()] if any(ln.isspace() for ln in lines) else lines
            try:  # fast path: every line valid UTF-8 JSON with a string field
                texts = [json.loads(ln)[text_field] for ln in lines]
                ok = all(type(t) is str for t in texts)
            except (ValueError, KeyError, TypeError):
                ok = False
            if not ok:
                texts = [_jsonl_error(path, lineno + k + 1, ln, text_field, errors, stats) for k, ln in enumerate(lines)]
                texts = [t for t in texts if t is not None]
            lineno += len(lines)
            yield _keep(texts, stats)


def _parquet_batches(path: Path, text_field: str, stats: ReadStats) -> Iterator[list[str]]:
    """The ``text_field`` column of a Parquet file, one row group in memory at a time."""
    import pyarrow as pa  # here: only .parquet inputs need it (~0.3 s to import)
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise ValueError(f"{path}: not a readable Parquet file ({e})") from None
    schema = pf.schema_arrow
    if text_field not in schema.names:
        raise ValueError(f"{path}: no column {text_field!r} (columns: {schema.names}); "
                         "pass the right one with text_field= (CLI: --text-field)")
    col_type = schema.field(text_field).type
    if not (pa.types.is_string(col_type) or pa.types.is_large_string(col_type)):
        raise ValueError(f"{path}: column {text_field!r} has type {col_type}, not string; choose a text column")
    for rg in range(pf.num_row_groups):
        texts = pf.read_row_group(rg, columns=[text_field]).column(0).to_pylist()
        yield _keep([t for t in texts if t is not None], stats)


def _checked_open(path: str | os.PathLike, errors: str, stats: ReadStats | None) -> tuple[Path, ReadStats]:
    if errors not in UTF8_POLICIES:
        raise ValueError(f"unknown UTF-8 error policy {errors!r}; use one of {UTF8_POLICIES}")
    p = check_input_file(path)
    st = stats if stats is not None else ReadStats()
    st.files.append(str(p))
    return p, st


def _read_errors_named(p: Path, batches: Iterator[Any]) -> Iterator[Any]:
    """Yield from ``batches``, turning read errors (truncated ``.gz``/``.zst``, I/O) into ``ValueError``."""
    read_errors: tuple[type[BaseException], ...] = (OSError, EOFError)
    if p.suffix.lower() == ".zst":
        import zstandard  # here: only .zst inputs need it

        read_errors += (zstandard.ZstdError,)
    try:
        yield from batches
    except read_errors as e:
        raise ValueError(f"{p}: cannot be read ({type(e).__name__}: {e}); is the file complete and really "
                         f"{''.join(p.suffixes) or 'text'}?") from None


def iter_file_batches(path: str | os.PathLike, text_field: str | None = None, delimiter: str = EOT,
                      errors: str = "error", stats: ReadStats | None = None) -> Iterator[list[str]]:
    """Like :func:`iter_file_documents`, but yields lists of documents (a chunk / row group at a time)."""
    p, st = _checked_open(path, errors, stats)
    fmt = file_format(p)
    if fmt == "jsonl":
        batches = _jsonl_batches(p, text_field or "text", errors, st)
    elif fmt == "parquet":
        batches = _parquet_batches(p, text_field or "text", st)
    else:
        batches = _text_batches(p, delimiter, errors, st)
    yield from _read_errors_named(p, batches)


def iter_file_spans(path: str | os.PathLike, text_field: str | None = None, delimiter: str = EOT,
                    errors: str = "error", stats: ReadStats | None = None,
                    want_crc: bool = False) -> Iterator[DocBatch]:
    """The documents of :func:`iter_file_batches` as :class:`DocBatch` es (UTF-8 spans of one buffer).

    Plain text with a string delimiter takes the fast path: raw chunks are split, stripped, validated
    and checksummed in one pass in C++ (:func:`split_documents`) and never become Python strings;
    a chunk with invalid UTF-8 goes through the ``str`` path with the ``errors`` policy. Other formats
    are read as strings and packed into batches.
    """
    p, st = _checked_open(path, errors, stats)
    if file_format(p) == "text" and delimiter != "blankline":
        if not delimiter:
            raise ValueError("delimiter must be a non-empty string, 'blankline' or 'line'")
        yield from _read_errors_named(p, _text_spans(p, delimiter, errors, st, want_crc))
        return
    st.files.pop()  # iter_file_batches records the file again
    for docs in iter_file_batches(p, text_field=text_field, delimiter=delimiter, errors=errors, stats=st):
        if docs:
            yield DocBatch.from_texts(docs, want_crc)


def iter_file_documents(path: str | os.PathLike, text_field: str | None = None,
                        delimiter: str = EOT, errors: str = "error",
                        stats: ReadStats | None = None) -> Iterator[str]:
    """Stream the documents of one file (text, JSON Lines or Parquet; ``.gz``/``.zst`` allowed).

    ``text_field`` names the JSON key / Parquet column holding the text (default ``"text"``).
    ``errors`` is the invalid-UTF-8 policy: ``"error"`` raises ``ValueError`` naming the file and
    document, ``"skip"`` drops the document, ``"replace"`` substitutes U+FFFD; both count the document
    in ``stats.invalid_utf8``.
    """
    for batch in iter_file_batches(path, text_field=text_field, delimiter=delimiter, errors=errors, stats=stats):
        yield from batch


def iter_documents(paths: str | os.PathLike | Sequence[str | os.PathLike], text_field: str | None = None,
                   delimiter: str = EOT, errors: str = "error",
                   stats: ReadStats | None = None) -> Iterator[str]:
    """Stream the documents of files, directories and globs in a deterministic order.

    >>> docs = list(iter_documents("corpus.txt"))  # doctest: +SKIP
    """
    for p in expand_inputs(paths):
        yield from iter_file_documents(p, text_field=text_field, delimiter=delimiter, errors=errors, stats=stats)
