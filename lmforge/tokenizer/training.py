"""Fast BPE training: stream files in large chunks, count pre-tokens in parallel (C++), learn merges.

Results are identical to :func:`lmforge.tokenizer.reference.train_bpe_reference` (the spec); only the speed and
memory differ. Memory is bounded by the table of unique pre-tokens plus one chunk: a file is
never read whole. Each chunk ends where splitting cannot change pre-tokenization:

* before the last special token in the chunk (specials already split the text);
* otherwise before a single ASCII space that follows printable ASCII and precedes an ASCII
  letter -- every built-in pattern ends a pre-token there and starts the next one at the space.
  (A file with neither is read whole: memory then grows with it.)

Inputs are read like ``data prepare`` reads them (:mod:`lmforge.corpus.sources`): files, directories and
globs; ``.gz``/``.zst`` decompressed on the fly. Plain text with a string delimiter is counted as is,
in chunks (the fast path: the C++ counter reads the file's buffer, no copy); the delimiter, like a
special token, separates documents and is never counted. JSON Lines and Parquet records, and text
split on ``"blankline"``/``"line"``, come from the document readers (stripped, as prepare stores
them) and are joined with a special token (or the delimiter) that is never counted.

Each file, each document, and each item of :func:`train_bpe_from_iterator` is a separate document:
no pre-token and no merge spans two of them. When ``lmforge._core`` is not built, counting and
merging fall back to the reference implementation (same results, slower).
"""

from __future__ import annotations

import functools
import itertools
import logging
import operator
import os
import time
from collections import Counter
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from lmforge import _native
from lmforge.common import num_threads_default
from lmforge.corpus import sources
from lmforge.corpus.specials import EOT
from lmforge.tokenizer import reference as bpe
from lmforge.progress import progress as progress_bar

if TYPE_CHECKING:
    import regex

logger = logging.getLogger("lmforge")

Vocab = dict[int, bytes]
Merges = list[tuple[bytes, bytes]]
PathLike = str | os.PathLike

CHUNK_BYTES = 4 << 20  # bytes read per step (cut back to a safe boundary); peak memory is a few chunks


@functools.cache
def _ws_cut() -> "regex.Pattern[bytes]":
    """The safe space cut (see the module docstring), searched from the end; compiled on first use (a file
    whose chunks all end at a special token never needs the ``regex`` module)."""
    import regex

    return regex.compile(rb"(?<=[!-~]) (?=[A-Za-z])", regex.REVERSE)


class _PyCounter:
    """The reference stand-in for ``_core.PretokenCounter`` (same methods, same counts)."""

    def __init__(self, pattern: str, special_tokens: Sequence[str]):
        self.pattern, self.specials, self.counts = pattern, list(special_tokens), Counter()

    def add(self, data: bytes | memoryview, num_threads: int) -> None:
        bpe.count_pretokens([bytes(data).decode("utf-8")], self.specials, self.pattern, self.counts)

    def add_counts(self, words: list[bytes], counts: list[int]) -> None:
        for w, c in zip(words, counts):
            self.counts[w] += c

    def __len__(self) -> int:
        return len(self.counts)

    def total(self) -> int:
        return sum(self.counts.values())

    def items(self) -> list[tuple[bytes, int]]:
        return list(self.counts.items())


def _core() -> Any:
    return _native.core() if _native.available("PretokenCounter") and _native.available("train_bpe") else None


_CORE_PATTERN_ATTR = {"gpt2": "PATTERN_GPT2", "gpt4": "PATTERN_GPT4", "cl100k": "PATTERN_GPT4",
                      "nanochat": "PATTERN_NANOCHAT"}


class _Counting:
    """Feeds documents into a pre-token counter: C++ for built-in patterns, Python regex otherwise."""

    def __init__(self, special_tokens: list[str], pattern: str, num_threads: int):
        self.specials, self.pattern, self.num_threads = special_tokens, pattern, num_threads
        self.core = _core()
        if self.core is not None and pattern in _CORE_PATTERN_ATTR:
            self.counter: Any = self.core.PretokenCounter(getattr(self.core, _CORE_PATTERN_ATTR[pattern]),
                                                          [s.encode("utf-8") for s in special_tokens])
            self.custom = False
        elif self.core is not None:  # custom regex: pre-tokenize here, count in C++
            self.counter = self.core.PretokenCounter(getattr(self.core, "PATTERN_CUSTOM", self.core.PATTERN_GPT2), [])
            self.custom = True
        else:
            self.counter = _PyCounter(pattern, special_tokens)
            self.custom = False

    def add(self, data: bytes | memoryview) -> None:
        """Count one document (or one safely-cut chunk of one); ``data`` is valid UTF-8."""
        if self.custom:
            counts = bpe.count_pretokens([bytes(data).decode("utf-8")], self.specials, self.pattern)
            self.counter.add_counts(list(counts), list(counts.values()))
        else:
            self.counter.add(data, self.num_threads)

    def merges(self, num_merges: int, progress: bool) -> Merges:
        if num_merges <= 0 or len(self.counter) == 0:
            return []
        bar = _bar(num_merges, "merges", progress, unit="merge")
        last = [0]

        def tick(k: int) -> None:
            bar.update(k - last[0])
            last[0] = k

        try:
            if self.core is not None:  # a list of (bytes, bytes) already
                return self.core.train_bpe(self.counter, num_merges, tick if progress else None)
            return bpe.learn_merges(dict(self.counter.items()), num_merges, tick if progress else None)
        finally:
            bar.close()


def _bar(total: int | None, desc: str, enabled: bool, unit: str = "B") -> Any:
    return progress_bar(total, desc, unit, enabled, leave=False)


def _utf8_error_offset(data: bytes | memoryview) -> int:
    """Offset of the first byte that is not valid UTF-8, or -1 (C++ scan when built: no copy)."""
    core = _core()
    if core is not None and hasattr(core, "utf8_error_offset"):
        return int(core.utf8_error_offset(data))
    try:
        bytes(data).decode("utf-8")
        return -1
    except UnicodeDecodeError as e:
        return e.start


def _check_utf8(data: bytes | memoryview, errors: str, where: str, offset: int) -> bytes | memoryview:
    """Return valid UTF-8: ``ValueError`` naming the byte offset, or U+FFFD replacements."""
    bad = _utf8_error_offset(data)
    if bad < 0:
        return data
    if errors == "replace":
        return bytes(data).decode("utf-8", errors="replace").encode("utf-8")
    raise ValueError(f"{where} is not valid UTF-8 at byte offset {offset + bad}; fix the file or pass "
                     "errors='replace' (CLI: --errors replace) to read bad bytes as U+FFFD")


def _cut_point(buf: bytes | bytearray, specials: list[bytes], end: int | None = None) -> int:
    """Where a chunk of ``buf[:end]`` may end: before the last special token, else at a safe space (0 = none).

    The space cut is also used between specials that are far apart, unless a special token itself
    contains a space (it could then straddle the cut).
    """
    end = len(buf) if end is None else end
    if specials:
        best = max(buf.rfind(s, 0, end) for s in specials)
        changed = best > 0
        while changed:  # a special overlapping the one found (e.g. a longer one) may start earlier
            changed = False
            for s in specials:
                j = buf.rfind(s, 0, best + len(s) - 1)
                if 0 <= j < best < j + len(s):
                    best, changed = j, True
        if best > 0 or any(b" " in s for s in specials):
            return max(best, 0)
    m = _ws_cut().search(buf, 0, end)
    return m.start() if m else 0


def _iter_file_chunks(path: PathLike, specials: list[bytes], chunk_bytes: int) -> Iterable[tuple[int, memoryview]]:
    """Yield ``(offset, chunk)`` pieces of a (possibly compressed) text file that can be counted independently.

    One buffer of ``chunk_bytes`` is read into again and again (no allocation, no page faults and no copy per
    chunk): each chunk is a memoryview of it up to the cut point, and only the short tail after the cut moves
    to the front. Consume each chunk before asking for the next: the next read overwrites it. The buffer
    doubles only while it holds no cut point (text without spaces or specials). Offsets are in the
    decompressed bytes.
    """
    with sources.open_binary(path) as f:
        buf = bytearray(chunk_bytes)
        have = 0  # bytes of buf in use: the tail left by the last cut, then what was read after it
        offset = 0
        while True:
            if have == len(buf):  # a full buffer without a cut point: keep reading into a bigger one
                buf.extend(bytes(len(buf)))
            with memoryview(buf) as view, view[have:] as free:
                n = f.readinto(free)
            if not n:
                break
            have += n
            cut = _cut_point(buf, specials, have)
            if cut <= 0:
                continue
            with memoryview(buf) as view, view[:cut] as chunk:
                yield offset, chunk
            offset += cut
            buf[:have - cut] = buf[cut:have]
            have -= cut
        if have:
            with memoryview(buf) as view, view[:have] as chunk:
                yield offset, chunk


def _check_has_text(counting: _Counting) -> None:
    """``ValueError`` unless some pre-token holds more than whitespace (specials are never counted)."""
    if not any(w.decode("utf-8", "replace").strip() for w, _ in counting.counter.items()):
        raise ValueError("the corpus holds no text to train on (it is empty, or only whitespace and special "
                         "tokens); check the input files and, for JSON Lines / Parquet, text_field= "
                         "(CLI: --text-field), for text files delimiter= (CLI: --delimiter)")


def _merges_show_text(merges: Merges) -> bool:
    """True if a learned token proves that some pre-token holds more than whitespace (the condition of
    :func:`_check_has_text`): a token that is valid UTF-8 with a non-space character is part of a pre-token
    that has one. (A token that splits a character proves nothing: U+3000, a space, is three bytes.)"""
    for a, b in merges:
        try:
            if (a + b).decode("utf-8").strip():
                return True
        except UnicodeDecodeError:
            continue
    return False


def _finish(counting: _Counting, vocab_size: int, specials: list[str], progress: bool, nbytes: int,
            t0: float) -> tuple[Vocab, Merges]:
    secs = max(time.perf_counter() - t0, 1e-9)
    logger.info("counted %.1f MB in %.1fs (%.1f MB/s): %d unique pre-tokens", nbytes / 1e6, secs,
                nbytes / 1e6 / secs, len(counting.counter))
    vocab = bpe.base_vocab(specials)
    t1 = time.perf_counter()
    merges = counting.merges(vocab_size - len(vocab), progress)
    if not _merges_show_text(merges):  # else the full check (reads every pre-token: 0.13 s at 275k of them)
        _check_has_text(counting)
    vocab.update(zip(itertools.count(len(vocab)), itertools.starmap(operator.add, merges)))  # id -> a + b
    logger.info("learned %d merges in %.1fs (vocab size %d)", len(merges), time.perf_counter() - t1, len(vocab))
    if len(vocab) < vocab_size:  # like HF tokenizers' BpeTrainer: stop early, but say so
        logger.warning("vocab_size=%d cannot be reached: the corpus ran out of pairs to merge at vocab size %d "
                       "(256 bytes + %d special tokens + %d merges); the tokenizer has %d ids. Train on more "
                       "text or ask for at most %d", vocab_size, len(vocab), len(specials), len(merges),
                       len(vocab), len(vocab))
    return vocab, merges


def _setup(vocab_size: int, special_tokens: Sequence[str] | None, pattern: str, errors: str) -> list[str]:
    specials = bpe.check_special_tokens(special_tokens)
    bpe.check_vocab_size(vocab_size, specials)
    bpe.resolve_pattern(pattern)
    if errors not in ("strict", "replace"):
        raise ValueError(f"errors must be 'strict' or 'replace', got {errors!r}")
    return specials


def _threads(num_threads: int | None) -> int:
    """``num_threads`` checked (>= 1), or every usable core when None."""
    if num_threads is None:
        return num_threads_default()
    if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"num_threads must be a positive integer (or None for all cores), got {num_threads!r}")
    return num_threads


def _split_strings(specials: list[str], delimiter: str) -> list[str]:
    """What the counter splits on and never counts: the special tokens, plus a string delimiter."""
    if not isinstance(delimiter, str) or not delimiter:
        raise ValueError(f"delimiter must be a non-empty string, 'blankline' or 'line', got {delimiter!r}")
    if delimiter in ("blankline", "line") or delimiter in specials:
        return specials
    return specials + [delimiter]


def _count_documents(counting: _Counting, texts: Iterable[str], errors: str, joiner: bytes | None,
                     batch_bytes: int, bar: Any) -> int:
    """Count each text as one document (joined by ``joiner`` into large batches); returns the UTF-8 bytes."""
    nbytes = size = 0
    batch: list[bytes] = []

    def flush() -> None:
        nonlocal batch, size
        if batch:
            counting.add(joiner.join(batch) if joiner is not None else batch[0])
        batch, size = [], 0

    for k, text in enumerate(texts):
        if not isinstance(text, str):
            raise ValueError(f"document {k} is {type(text).__name__}, not str; decode it first")
        data = text.encode("utf-8", errors="surrogatepass")  # lone surrogates: refused or U+FFFD below
        data = _check_utf8(data, errors, f"document {k}", 0)
        batch.append(data)
        size += len(data)
        nbytes += len(data)
        bar.update(len(data))
        if joiner is None or size >= batch_bytes:
            flush()
    flush()
    return nbytes


def train_bpe(input_path: PathLike | Sequence[PathLike], vocab_size: int, special_tokens: list[str] | None = None,
              *, pattern: str = "gpt2", num_threads: int | None = None, errors: str = "strict",
              progress: bool = True, chunk_bytes: int = CHUNK_BYTES, text_field: str | None = None,
              delimiter: str = EOT, batch_bytes: int = 1 << 20) -> tuple[Vocab, Merges]:
    """Train byte-level BPE on files, directories or globs (the CS336 ``train_bpe`` interface).

    Inputs are read as by ``data prepare`` (see the module docstring): ``.txt`` documents separated
    by ``delimiter``, ``.jsonl`` / ``.parquet`` records' ``text_field`` (default ``"text"``),
    optionally ``.gz``/``.zst``. A plain text file gives ``(vocab, merges)`` exactly as
    :func:`lmforge.tokenizer.reference.train_bpe_reference` would on its contents split at the delimiter. Refuses
    (``ValueError``) a corpus without text; logs a warning when the corpus runs out of pairs before
    ``vocab_size``. ``errors="replace"`` reads invalid UTF-8 as U+FFFD instead of refusing the file.
    ``num_threads`` defaults to the usable cores.
    """
    specials = _setup(vocab_size, special_tokens, pattern, errors)
    split = _split_strings(specials, delimiter)
    paths = sources.expand_inputs(input_path)
    counting = _Counting(split, pattern, _threads(num_threads))
    fast = [sources.file_format(p) == "text" and delimiter not in ("blankline", "line") for p in paths]
    plain = all(f and p.suffix.lower() not in sources.COMPRESSION_SUFFIXES for f, p in zip(fast, paths))
    sb = [s.encode("utf-8") for s in split]
    joiner = sb[0] if sb else None
    reader_errors = "error" if errors == "strict" else errors
    nbytes = 0
    t0 = time.perf_counter()
    with _bar(sum(p.stat().st_size for p in paths) if plain else None, "counting", progress) as bar:
        for p, is_text in zip(paths, fast):
            if is_text:  # raw chunks straight into the counter
                for offset, chunk in sources._read_errors_named(p, _iter_file_chunks(p, sb, chunk_bytes)):
                    counting.add(_check_utf8(chunk, errors, str(p), offset))
                    bar.update(len(chunk))
                    nbytes += len(chunk)
            else:  # documents from the same readers as data prepare
                docs = sources.iter_file_documents(p, text_field=text_field, delimiter=delimiter,
                                                   errors=reader_errors)
                nbytes += _count_documents(counting, docs, errors, joiner, batch_bytes, bar)
    return _finish(counting, vocab_size, specials, progress, nbytes, t0)


def train_bpe_from_iterator(texts: Iterable[str], vocab_size: int, special_tokens: list[str] | None = None,
                            *, pattern: str = "gpt2", num_threads: int | None = None, progress: bool = True,
                            batch_bytes: int = 1 << 20, errors: str = "strict") -> tuple[Vocab, Merges]:
    """Train on an iterable of documents (e.g. ``lmforge.corpus.sources.iter_documents``); each item is one document.

    Documents are joined with a special token into batches of about ``batch_bytes`` so the C++
    counter works on large pieces; the joining special is never counted and separates documents
    exactly like a document boundary. Refuses a corpus without text and warns about an unreachable
    ``vocab_size`` like :func:`train_bpe`.
    """
    specials = _setup(vocab_size, special_tokens, pattern, errors)
    counting = _Counting(specials, pattern, _threads(num_threads))
    joiner = specials[0].encode("utf-8") if specials else None
    t0 = time.perf_counter()
    with _bar(None, "counting", progress) as bar:
        nbytes = _count_documents(counting, texts, errors, joiner, batch_bytes, bar)
    return _finish(counting, vocab_size, specials, progress, nbytes, t0)


__all__ = ["train_bpe", "train_bpe_from_iterator", "CHUNK_BYTES"]
