"""Turn raw corpora into token shards (``prepare``): parallel, crash-resumable, deduplicated, appendable.

``prepare`` streams documents from the inputs (:mod:`lmforge.corpus.sources`) as byte spans of raw chunks
(split, stripped and validated in C++ for delimited text), routes each to a split (a seeded hash
of the document, or one split for all inputs), tokenizes batches of documents in parallel with the
tokenizer's ``encode_spans`` (BOS/EOS added, output already in the shard dtype), and fills
fixed-size shards (:mod:`lmforge.data.shards`). Reading, tokenizing and writing run in three threads.
Memory is flat: one shard buffer per split plus a few batches.

Crash safety: shards are written by tmp-file + rename and listed in the manifest, which is
rewritten (atomically) after every shard together with, for each split, the exact point in the
input stream -- (source, document, token offset) -- up to which that split is on disk. Running the
same ``prepare`` again after a crash resumes from there and produces the very same shards as an
uninterrupted run. Sources are identified by SHA-256: a file already in the manifest (or given
twice) is reported and skipped. ``append=True`` adds new sources to an existing directory as new
shards (a training run picks them up on its next restart, see :class:`lmforge.data.loader.BlockLoader`).

The loading side (and ``inspect``) lives in :mod:`lmforge.data.loader` and :mod:`lmforge.data.shards`.

Example::

    tok = Tokenizer.load("tokenizer.json")
    m = prepare(tok, "corpus/*.jsonl.zst", "data/web", val_fraction=0.01)    # crash? run it again
    print(m["splits"]["train"]["tokens"], m["splits"]["val"]["documents"])
    prepare(tok, "more/*.parquet", "data/web", append=True)                  # new shards, same manifest
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from lmforge.common import human_bytes, num_threads_default, temporary_target
from lmforge.corpus.datasets import get_dataset
from lmforge.data.shards import (MANIFEST, SHARD_NAME, dtype_for_vocab, load_manifest, new_manifest,
                                 save_manifest, shard_name, write_shard)
from lmforge.corpus.sources import DocBatch, ReadStats, expand_inputs, file_format, iter_file_spans
from lmforge.corpus.specials import EOT
from lmforge.corpus.splits import check_val_fraction, val_mask_from_crc
from lmforge.progress import progress as progress_bar

logger = logging.getLogger("lmforge")

Manifest = dict[str, Any]  # the parsed manifest.json (see lmforge.data.shards)
LOCK = ".prepare.lock"
DEFAULT_SHARD_TOKENS = 1 << 26  # 64 Mi tokens: 128 MiB per uint16 shard
BATCH_BYTES = 2 << 20  # text bytes per tokenizer call


# --------------------------------------------------------------------------------------------------
# One split's shard buffer
# --------------------------------------------------------------------------------------------------
class _SplitWriter:
    """Fills one split's shard buffer, writes full shards, and tracks exactly what is on disk."""

    def __init__(self, split: str, out_dir: Path, dtype: str, shard_tokens: int, vocab_size: int,
                 fingerprint: str, next_index: int, position: list[int], flushed: dict[str, dict[str, int]]):
        self.split, self.out_dir, self.vocab_size, self.fingerprint = split, out_dir, vocab_size, fingerprint
        self.buf = np.empty(shard_tokens, dtype=dtype)
        self.n = 0
        self.starts: list[np.ndarray] = []
        self.next_index = next_index
        self.position = list(position)  # (source, doc, token offset) of the first token not on disk
        self.flushed = flushed  # source index (str) -> {"tokens", "documents", "text_bytes"} on disk
        self.buffered: dict[str, dict[str, int]] = {}
        self.written: list[dict[str, Any]] = []

    def add(self, tokens: np.ndarray, lengths: np.ndarray, is_start: np.ndarray, text_bytes: np.ndarray,
            src: int, doc_ids: np.ndarray, first_offset: int, on_flush: Any) -> None:
        """Append a batch of documents of source ``src``; ``first_offset`` tokens of doc 0 were already written."""
        bounds = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=bounds[1:])
        key = str(src)
        pos = 0
        while pos < len(tokens):
            take = min(len(self.buf) - self.n, len(tokens) - pos)
            self.buf[self.n:self.n + take] = tokens[pos:pos + take]
            d0, d1 = np.searchsorted(bounds[:-1], [pos, pos + take], side="left")
            new = np.arange(d0, d1)[is_start[d0:d1]]
            self.starts.append(bounds[new] - pos + self.n)
            st = self.buffered.setdefault(key, {"tokens": 0, "documents": 0, "text_bytes": 0})
            st["tokens"] += take
            st["documents"] += len(new)
            st["text_bytes"] += int(text_bytes[new].sum())
            self.n += take
            pos += take
            if self.n == len(self.buf):
                d = int(np.searchsorted(bounds, pos, side="right")) - 1
                if d >= len(lengths):
                    self.position = [src, int(doc_ids[-1]) + 1, 0]
                else:
                    off = pos - int(bounds[d]) + (first_offset if d == 0 else 0)
                    self.position = [src, int(doc_ids[d]), off]
                self.flush()
                on_flush()

    def finish(self, src_count: int) -> None:
        """Write the last, partial shard; the split is then complete up to the end of all sources."""
        self.position = [src_count, 0, 0]
        if self.n:
            self.flush()

    def flush(self) -> None:
        name = shard_name(self.split, self.next_index)
        starts = np.concatenate(self.starts) if self.starts else np.zeros(0, np.int64)
        sha = write_shard(self.out_dir / name, self.buf[:self.n], starts, self.vocab_size, self.fingerprint)
        self.written.append({"name": name, "split": self.split, "tokens": int(self.n),
                             "documents": int(len(starts)), "sha256": sha, "max_id": int(self.buf[:self.n].max())})
        logger.info("wrote %s (%s tokens, %d documents)", name, f"{self.n:,}", len(starts))
        for key, st in self.buffered.items():
            acc = self.flushed.setdefault(key, {"tokens": 0, "documents": 0, "text_bytes": 0})
            for k, v in st.items():
                acc[k] += v
        self.buffered = {}
        self.next_index += 1
        self.n = 0
        self.starts = []


# --------------------------------------------------------------------------------------------------
# Reading (in a background thread, so that Python parsing overlaps tokenization)
# --------------------------------------------------------------------------------------------------
def _read_batches(sources: list[dict[str, Any]], opts: dict[str, Any], positions: dict[str, list[int]],
                  first_src: int) -> Iterator[tuple[Any, ...]]:
    """Yield ``("batch", split, src, doc_ids, DocBatch, first_offset)`` and ``("end", src, read_stats)``.

    Documents already on disk for their split (before ``positions[split]``) are skipped, so a resumed
    run tokenizes only what is missing. ``doc_ids`` index the source's non-empty documents.
    """
    val_fraction, seed, fixed = opts["val_fraction"], opts["split_seed"], opts["split"]
    single = fixed or ("train" if val_fraction == 0.0 else None)
    for si in range(first_src, len(sources)):
        stats = ReadStats()
        pending: dict[str, tuple[list[np.ndarray], list[DocBatch], int]] = {}
        sizes: dict[str, int] = {}
        di = 0
        for chunk in iter_file_spans(sources[si]["path"], text_field=opts["text_field"], delimiter=opts["delimiter"],
                                     errors=opts["utf8_errors"], stats=stats, want_crc=single is None):
            n = len(chunk)
            if single:
                routed = {single: (np.arange(di, di + n), None)}
            else:  # vectorised routing; splits in order of first appearance, as a per-document loop would
                assert chunk.crc is not None
                is_val = val_mask_from_crc(chunk.crc, chunk.sizes, val_fraction, seed)
                routed = {}
                for name, mask in sorted((("val", is_val), ("train", ~is_val)), key=lambda x: not x[1][0]):
                    if mask.any():
                        idx = np.flatnonzero(mask)
                        routed[name] = (idx + di, idx)
            di += n
            for split, (ids, idx) in routed.items():
                p_src, p_doc, p_off = positions.get(split, (0, 0, 0))
                if si < p_src:
                    continue
                cut = int(np.searchsorted(ids, p_doc)) if si == p_src else 0  # resuming: drop what is on disk
                if cut == len(ids):
                    continue
                if cut:
                    ids, idx = ids[cut:], (np.arange(cut, n) if idx is None else idx[cut:])
                docs = chunk if idx is None else chunk.take(idx)
                start_off = p_off if (si, int(ids[0])) == (p_src, p_doc) else 0
                b_ids, b_docs, _ = pending.setdefault(split, ([], [], start_off))
                b_ids.append(ids)
                b_docs.append(docs)
                sizes[split] = sizes.get(split, 0) + int(docs.sizes.sum())
                if sizes[split] >= BATCH_BYTES:
                    yield _batch_item(split, si, *pending.pop(split))
                    sizes[split] = 0
        for split, (ids, docs, first_off) in pending.items():
            yield _batch_item(split, si, ids, docs, first_off)
        yield ("end", si, stats)


def _batch_item(split: str, si: int, ids: list[np.ndarray], docs: list[DocBatch], first_off: int) -> tuple[Any, ...]:
    return ("batch", split, si, np.concatenate(ids), DocBatch.concat(docs), first_off)


def _prefetch(gen: Iterator[Any], depth: int = 4) -> Iterator[Any]:
    """Run ``gen`` in a daemon thread, ``depth`` items ahead; exceptions are re-raised here."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def work() -> None:
        try:
            for item in gen:
                if stop.is_set():
                    return
                q.put(item)
            q.put(done)
        except BaseException as e:  # handed to the consumer
            q.put(e)

    t = threading.Thread(target=work, daemon=True, name="lmforge-prepare-reader")
    t.start()
    try:
        while True:
            item = q.get()
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        while t.is_alive():  # unblock a producer waiting on a full queue
            try:
                q.get(timeout=0.05)
            except queue.Empty:
                pass


# --------------------------------------------------------------------------------------------------
# prepare
# --------------------------------------------------------------------------------------------------
def _special_id(tokenizer: Any, value: str | None, what: str) -> int | None:
    if value is None:
        return None
    if value == "auto":
        return tokenizer.eot_id
    specials = tokenizer.special_tokens
    if value not in specials:
        raise ValueError(f"{what} token {value!r} is not a special token of the tokenizer (it has {sorted(specials)}); "
                         f"train the tokenizer with it or choose another {what}")
    return int(specials[value])


def _clean_stray_files(out_dir: Path, keep: set[str]) -> None:
    """Remove shard files (and temp files of interrupted writes) that the manifest does not list."""
    for p in out_dir.iterdir():
        base = temporary_target(p)
        stray_tmp = base is not None and bool(SHARD_NAME.match(base) or base in (MANIFEST, "tokenizer.json"))
        if (SHARD_NAME.match(p.name) and p.name not in keep) or stray_tmp:
            logger.info("removing %s (left over from an interrupted prepare)", p.name)
            p.unlink()


def _open_out_dir(out_dir: Path, tok_info: dict[str, Any], dtype: str, shard_tokens: int, bos_id: int | None,
                  eos_id: int | None, append: bool, force: bool) -> tuple[Manifest, bool]:
    """Load or create the manifest of ``out_dir``; return it and whether it is new."""
    has_manifest = (out_dir / MANIFEST).exists()
    if has_manifest and force:
        logger.warning("force: deleting the shards in %s", out_dir)
        _clean_stray_files(out_dir, keep=set())
        (out_dir / MANIFEST).unlink()
        has_manifest = False
    if not has_manifest:
        out_dir.mkdir(parents=True, exist_ok=True)
        return new_manifest(tok_info, dtype, shard_tokens, bos_id, eos_id), True
    m = load_manifest(out_dir)
    if m["tokenizer"]["fingerprint"] != tok_info["fingerprint"]:
        raise ValueError(f"{out_dir} holds shards of a different tokenizer (fingerprint "
                         f"{m['tokenizer']['fingerprint'][:16]}…); use that tokenizer to add data, or a new "
                         "directory / --force for this one")
    for key, want in (("dtype", dtype), ("bos_id", bos_id), ("eos_id", eos_id)):
        have = m[key]
        if have != want:
            raise ValueError(f"{out_dir} was prepared with {key}={have}, this call asks for {want}; they must match "
                             "to add data (or use a new directory)")
    if m.get("pending") is None and not append:
        raise ValueError(f"{out_dir} already holds shards; pass append=True (CLI: --append) to add new sources, "
                         "or force=True (--force) to rebuild it from scratch")
    return m, False


def _hash_sources(paths: list[Path], m: Manifest, progress: bool) -> list[dict[str, Any]]:
    """SHA-256 of every input; duplicates (of committed sources or of each other) are reported and dropped."""
    sizes = [p.stat().st_size for p in paths]
    for p, size in zip(paths, sizes):
        if size == 0:
            raise ValueError(f"input file {p} is empty; remove it from the inputs")
    known = {s["sha256"]: s["path"] for s in m["sources"]}
    out = []
    seen: dict[str, str] = {}
    with progress_bar(sum(sizes), "hashing inputs", "B", progress and sum(sizes) >= 1 << 28) as bar:
        for p, size in zip(paths, sizes):
            h = hashlib.sha256()
            with open(p, "rb") as f:
                while chunk := f.read(8 << 20):
                    h.update(chunk)
                    bar.update(len(chunk))
            sha = h.hexdigest()
            if sha in seen:
                logger.warning("skipping %s: same content as %s given earlier", p, seen[sha])
                continue
            seen[sha] = str(p)
            if sha in known:
                logger.warning("skipping %s: already in the shards (added as %s)", p, known[sha])
                continue
            out.append({"path": str(p.resolve()), "size": size, "sha256": sha, "format": file_format(p)})
    return out


def prepare(tokenizer: Any, inputs: str | os.PathLike | Sequence[str | os.PathLike], out_dir: str | os.PathLike, *,
            split: str | None = None, val_fraction: float = 0.0, split_seed: int = 0, text_field: str | None = None,
            delimiter: str = EOT, utf8_errors: str = "error", bos: str | None = None,
            eos: str | None = "auto", dtype: str | None = None, shard_tokens: int = DEFAULT_SHARD_TOKENS,
            num_threads: int | None = None, append: bool = False, force: bool = False, restart: bool = False,
            progress: bool = True) -> Manifest:
    """Tokenize ``inputs`` into fixed-size shards in ``out_dir`` and return the manifest.

    ``split=None`` routes each document by a seeded hash (``val_fraction`` of them to ``"val"``,
    the rest to ``"train"``); ``split="val"`` (any name) puts all inputs in that split, for corpora
    with explicit train/valid files. ``eos="auto"`` appends ``EOT`` after each document
    when the tokenizer has it; ``bos`` / ``eos`` may name any special token, or be ``None``.
    ``dtype`` defaults to uint16 when the vocabulary fits. ``append`` adds new sources to an existing
    directory; ``force`` deletes its shards first. Re-running after a crash resumes exactly;
    ``restart`` instead discards the interrupted run (only its shards: committed data stays).
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"output path {out_dir} is a file; give a directory for the shards")
    if out_dir.exists() and not (out_dir / MANIFEST).exists() and any(p.name != LOCK for p in out_dir.iterdir()):
        raise ValueError(f"{out_dir} exists and is not an lmforge shard directory; choose a new or empty directory")
    val_fraction = check_val_fraction(val_fraction)
    if split is not None and not SHARD_NAME.match(f"{split}_00000.bin"):
        raise ValueError(f"split name {split!r} must be letters, digits or '-'")
    if split is not None and val_fraction:
        raise ValueError("give either split= (all inputs to one split) or val_fraction= (a hash split), not both")
    if not 1 <= shard_tokens < 2**32:
        raise ValueError(f"shard_tokens must be between 1 and 2**32-1, got {shard_tokens}")
    paths = expand_inputs(inputs)
    vocab_size = int(tokenizer.vocab_size)
    dtype = dtype or dtype_for_vocab(vocab_size)
    if dtype not in ("uint16", "uint32") or vocab_size > np.iinfo(dtype).max + 1:
        raise ValueError(f"the tokenizer has {vocab_size} tokens, which do not fit in {dtype} shards; "
                         "use dtype='uint32' (or leave dtype unset to choose automatically)")
    bos_id, eos_id = _special_id(tokenizer, bos, "BOS"), _special_id(tokenizer, eos, "EOS")
    tok_info = {"fingerprint": tokenizer.fingerprint(), "vocab_size": vocab_size, "eot_id": tokenizer.eot_id,
                "special_tokens": dict(tokenizer.special_tokens)}
    opts = {"split": split, "val_fraction": val_fraction, "split_seed": split_seed, "text_field": text_field,
            "delimiter": delimiter, "utf8_errors": utf8_errors}
    t0 = time.perf_counter()
    with _exclusive(out_dir):
        m, is_new = _open_out_dir(out_dir, tok_info, dtype, shard_tokens, bos_id, eos_id, append, force)
        pend = _start_or_resume(m, out_dir, _hash_sources(paths, m, progress), opts, shard_tokens, restart)
        if pend is None:
            logger.warning("nothing to add: every input is already in %s", out_dir)
            return m
        _clean_stray_files(out_dir, keep={s["name"] for s in m["shards"] + pend["shards"]})
        save_manifest(out_dir, m)
        if is_new and hasattr(tokenizer, "save"):  # a copy beside the shards, for inspect and for training checks
            tokenizer.save(out_dir / "tokenizer.json", force=True)
        try:
            n_tokens = _Run(tokenizer, out_dir, m, pend, dtype, bos_id, eos_id, num_threads).run(progress)
        except BaseException:
            logger.warning("prepare stopped; the %d shards written so far are safe in %s: run the same command "
                           "again to resume", len(pend["shards"]), out_dir)
            raise
        _commit(m, pend)
        save_manifest(out_dir, m)
    dt = time.perf_counter() - t0
    logger.info("prepared %d sources into %s: %s tokens in %.1fs (%s/s of input)", len(pend["sources"]), out_dir,
                f"{n_tokens:,}", dt, human_bytes(sum(s["size"] for s in pend["sources"]) / max(dt, 1e-9)))
    return m


def _start_or_resume(m: Manifest, out_dir: Path, sources: list[dict[str, Any]], opts: dict[str, Any],
                     shard_tokens: int, restart: bool) -> dict[str, Any] | None:
    """The run to do: the interrupted one (same inputs and options only), a new one, or ``None``."""
    pend = m.get("pending")
    if pend is not None and restart:
        logger.warning("discarding the interrupted prepare in %s (%d shards); committed shards are kept", out_dir,
                       len(pend["shards"]))
        m["pending"] = pend = None
    if pend is not None:
        if [s["sha256"] for s in sources] != [s["sha256"] for s in pend["sources"]] or pend["options"] != opts:
            raise ValueError(f"{out_dir} has an interrupted prepare of other inputs or options; re-run it with the "
                             "same inputs and options to resume, or pass restart=True (CLI: --restart) to discard "
                             "it (committed shards are kept)")
        logger.info("resuming the interrupted prepare in %s", out_dir)
        return pend
    if not sources:
        return None
    m["pending"] = {"sources": sources, "options": opts, "shard_tokens": shard_tokens, "positions": {}, "flushed": {},
                    "shards": [], "read_stats": {}}
    return m["pending"]


class _Run:
    """One prepare run: read, tokenize and write the pending sources, checkpointing after every shard."""

    def __init__(self, tokenizer: Any, out_dir: Path, m: Manifest, pend: dict[str, Any], dtype: str,
                 bos_id: int | None, eos_id: int | None, num_threads: int | None) -> None:
        self.tokenizer, self.out_dir, self.m, self.pend, self.dtype = tokenizer, out_dir, m, pend, dtype
        self.bos_id, self.eos_id = bos_id, eos_id
        self.threads = num_threads or num_threads_default()
        self.sources = pend["sources"]
        self.writers: dict[str, _SplitWriter] = {}
        for name in pend["positions"]:  # resuming: every split that had started
            self.writer(name)

    def writer(self, name: str) -> _SplitWriter:
        if name not in self.writers:
            m, pend = self.m, self.pend
            index = sum(1 for e in m["shards"] + pend["shards"] if e["split"] == name)
            self.writers[name] = _SplitWriter(
                name, self.out_dir, self.dtype, pend["shard_tokens"], m["tokenizer"]["vocab_size"],
                m["tokenizer"]["fingerprint"], index, pend["positions"].get(name, [0, 0, 0]),
                pend["flushed"].setdefault(name, {}))
        return self.writers[name]

    def checkpoint(self) -> None:
        """Record what is on disk (shards, per-split stream positions) in the manifest."""
        for name, w in self.writers.items():
            self.pend["positions"][name] = w.position
            self.pend["shards"].extend(w.written)
            w.written = []
        save_manifest(self.out_dir, self.m)

    def _encoded(self, first_src: int) -> Iterator[tuple[Any, ...]]:
        """The reader's batches, tokenized (this runs in its own thread: encoding overlaps shard writes)."""
        positions = {k: list(v) for k, v in self.pend["positions"].items()}
        for item in _prefetch(_read_batches(self.sources, self.pend["options"], positions, first_src)):
            if item[0] == "batch":
                _, name, si, doc_ids, docs, first_off = item
                item = ("batch", name, si, doc_ids, first_off,
                        _encode(self.tokenizer, docs, self.bos_id, self.eos_id, first_off, self.threads, self.dtype))
            yield item

    def _source_done(self, si: int, stats: ReadStats) -> None:
        self.pend["read_stats"][str(si)] = {"documents": stats.documents, "empty_skipped": stats.empty_skipped,
                                            "invalid_utf8": stats.invalid_utf8, "text_bytes": stats.text_bytes}
        path = self.sources[si]["path"]
        if stats.invalid_utf8:
            policy = "skipped" if self.pend["options"]["utf8_errors"] == "skip" else "replaced"
            logger.warning("%s: %d documents with invalid UTF-8 (%s)", path, stats.invalid_utf8, policy)
        if stats.documents == 0:
            logger.warning("%s holds no documents (empty or whitespace only)", path)

    def run(self, progress: bool) -> int:
        """Tokenize everything not yet on disk; return the number of tokens written."""
        first_src = min([p[0] for p in self.pend["positions"].values()] + [len(self.sources)]) \
            if self.pend["positions"] else 0
        plain = all(s["format"] != "parquet" and not s["path"].endswith((".gz", ".zst")) for s in self.sources)
        total = sum(s["size"] for s in self.sources[first_src:]) if plain else None
        bar = progress_bar(total, f"prepare {self.out_dir.name}", "B", progress)
        t0, n_tokens = time.perf_counter(), 0
        try:
            for item in _prefetch(self._encoded(first_src), depth=2):
                if item[0] == "end":
                    self._source_done(item[1], item[2])
                    continue
                _, name, si, doc_ids, first_off, (toks, lengths, is_start, text_bytes) = item
                self.writer(name).add(toks, lengths, is_start, text_bytes, si, np.asarray(doc_ids), first_off,
                                      self.checkpoint)
                n_tokens += len(toks)
                bar.set_postfix_str(f"{n_tokens / (time.perf_counter() - t0):,.0f} tok/s", refresh=False)
                bar.update(int(text_bytes.sum()))
            for w in self.writers.values():
                w.finish(len(self.sources))
            self.checkpoint()
            if bar.total:
                bar.update(bar.total - bar.n)  # the bar counted document bytes; the files also hold separators
        finally:
            bar.close()
        return n_tokens


@contextlib.contextmanager
def _exclusive(out_dir: Path) -> Iterator[None]:
    """Hold an advisory lock on ``out_dir`` so that two ``prepare`` runs never write it at once."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / LOCK, "w") as f:
        try:
            import fcntl  # here: POSIX only; elsewhere the lock is skipped
        except ImportError:  # pragma: no cover - Windows: no advisory locks, run one prepare at a time
            yield
            return
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ValueError(f"another `prepare` is writing {out_dir} right now; wait for it to finish") from None
        yield  # the lock is released when the file is closed, also if the process dies


def prepare_dataset(tokenizer: Any, name: str, out_dir: str | os.PathLike, *,
                    cache_dir: str | os.PathLike | None = None, val_fraction: float | None = None, shards: int = 1,
                    endpoint: str | None = None, force: bool = False, **kwargs: Any) -> Manifest:
    """Download (once) and prepare a named corpus with its natural train/val split.

    ``tinystories`` uses its own train and valid files; ``shakespeare`` and ``fineweb-edu`` (``shards``
    parquet files) split documents by seeded hash with ``val_fraction`` (default 0.1 for the 42 works
    of Shakespeare, 0.01 for FineWeb-Edu). Re-running is safe: it
    resumes an interrupted run and skips sources already in ``out_dir``. Other keyword arguments go
    to :func:`prepare`.
    """
    progress = kwargs.get("progress", True)
    if name == "tinystories":
        train, valid = get_dataset(name, cache_dir=cache_dir, endpoint=endpoint, progress=progress)
        prepare(tokenizer, train, out_dir, split="train", append=not force, force=force, **kwargs)
        return prepare(tokenizer, valid, out_dir, split="val", append=True, **kwargs)
    extra: dict[str, Any] = {}
    if name == "fineweb-edu":
        extra = {"shards": shards, "endpoint": endpoint, "progress": progress}
    paths = get_dataset(name, cache_dir=cache_dir, **extra)
    if val_fraction is None:
        val_fraction = 0.01 if name == "fineweb-edu" else 0.1
    return prepare(tokenizer, paths, out_dir, val_fraction=val_fraction, append=not force, force=force, **kwargs)


def _encode(tokenizer: Any, docs: DocBatch, bos_id: int | None, eos_id: int | None, first_offset: int,
            threads: int, dtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Tokenize a batch with BOS/EOS; return (tokens, per-doc lengths, per-doc is-start, per-doc text bytes).

    Tokenizers with ``encode_spans`` (lmforge's) read the documents' bytes in place; any other object
    with ``encode_batch_flat`` gets them as strings.
    """
    if hasattr(tokenizer, "encode_spans"):
        tokens, lengths = tokenizer.encode_spans(docs.buf, docs.starts, docs.ends, num_threads=threads,
                                                 bos_id=bos_id, eos_id=eos_id, dtype=dtype)
    else:
        flat, offsets = tokenizer.encode_batch_flat(docs.texts(), num_threads=threads)
        lengths = np.diff(np.asarray(offsets, dtype=np.int64)) + (bos_id is not None) + (eos_id is not None)
        tokens = np.empty(int(lengths.sum()), dtype=dtype)  # BOS/EOS written in place, the text tokens around them
        ends = np.cumsum(lengths)
        text = np.ones(len(tokens), dtype=bool)
        for pos, tid in ((ends - lengths, bos_id), (ends - 1, eos_id)):
            if tid is not None:
                tokens[pos] = tid
                text[pos] = False
        tokens[text] = flat
    is_start = np.ones(len(docs), dtype=bool)
    if first_offset:  # the first document's first tokens are already on disk (resume)
        tokens = tokens[first_offset:]
        lengths[0] -= first_offset
        is_start[0] = False
    return tokens, lengths, is_start, docs.sizes


def _commit(m: Manifest, pend: dict[str, Any]) -> None:
    """Move a finished run's shards and sources from ``pending`` into the manifest proper."""
    for e in pend["shards"]:
        m["shards"].append(e)
        info = m["splits"].setdefault(e["split"], {"tokens": 0, "documents": 0, "shards": 0, "text_bytes": 0})
        info["tokens"] += e["tokens"]
        info["documents"] += e["documents"]
        info["shards"] += 1
    for si, src in enumerate(pend["sources"]):
        per = {k: pend["flushed"].get(k, {}).get(str(si), {}) for k in pend["flushed"]}
        rec = dict(src)
        for key in ("tokens", "documents", "text_bytes"):
            rec[key] = {k: v.get(key, 0) for k, v in per.items() if v}
        read = pend["read_stats"].get(str(si), {})
        rec.update({k: read[k] for k in ("empty_skipped", "invalid_utf8") if k in read})
        rec["split"] = pend["options"]["split"] or ("hash" if pend["options"]["val_fraction"] else "train")
        m["sources"].append(rec)
        for k, b in rec["text_bytes"].items():
            m["splits"][k]["text_bytes"] = m["splits"][k].get("text_bytes", 0) + b
    m["pending"] = None
