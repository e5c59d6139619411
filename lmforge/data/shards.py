"""Token shards on disk: the binary shard format, the JSON manifest, ``TokenDataset`` (memmaps), ``inspect``.

A shard directory holds ``manifest.json`` and shards ``{split}_{k:05d}.bin``. Each shard is::

    header (256 bytes)   magic b"LMFSHRD1", version, itemsize (2 = uint16, 4 = uint32), token count,
                         document count, vocab size, tokenizer fingerprint, CRC32 of the header
    tokens               token count x itemsize bytes, little-endian
    document starts      document count x uint32: offsets (in this shard) where a document begins

Shards are immutable once written (tmp file + rename), so a reader never sees half a shard, and a
training run that has memory-mapped them can resume exactly. Only shards listed in the manifest
exist as far as readers are concerned; the manifest is written last.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from lmforge.common import atomic_open, atomic_write_text, human_bytes, sha256_file
from lmforge.tokenizer import Tokenizer

logger = logging.getLogger("lmforge")

MAGIC = b"LMFSHRD1"
FORMAT_VERSION = 1
HEADER_SIZE = 256
_HEADER = struct.Struct("<8sIIQQQ128s")  # magic, version, itemsize, n_tokens, n_docs, vocab_size, fingerprint
MANIFEST = "manifest.json"
SHARD_NAME = re.compile(r"^(?P<split>[A-Za-z0-9-]+)_(?P<index>\d{5,})\.bin$")
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


def dtype_for_vocab(vocab_size: int) -> str:
    """``"uint16"`` when every token id fits in 16 bits, else ``"uint32"``."""
    if vocab_size <= 2**16:
        return "uint16"
    if vocab_size <= 2**32:
        return "uint32"
    raise ValueError(f"vocab size {vocab_size} does not fit in uint32 shards")


def shard_name(split: str, index: int) -> str:
    return f"{split}_{index:05d}.bin"


# --------------------------------------------------------------------------------------------------
# Shard header
# --------------------------------------------------------------------------------------------------
def pack_header(itemsize: int, n_tokens: int, n_docs: int, vocab_size: int, fingerprint: str) -> bytes:
    """The 256-byte shard header (CRC32 in the last 4 bytes)."""
    fp = fingerprint.encode("ascii")
    assert len(fp) <= 128, "tokenizer fingerprint longer than 128 bytes"
    body = _HEADER.pack(MAGIC, FORMAT_VERSION, itemsize, n_tokens, n_docs, vocab_size, fp)
    body = body.ljust(HEADER_SIZE - 4, b"\0")
    return body + struct.pack("<I", zlib.crc32(body))


def read_header(path: str | os.PathLike) -> dict[str, Any]:
    """Parse and check a shard header and the file size; ``ValueError`` for truncated or corrupt shards."""
    p = Path(path)
    size = p.stat().st_size
    with open(p, "rb") as f:
        raw = f.read(HEADER_SIZE)
    hint = "re-create it with `lmforge data prepare --force` (or restore it from a backup)"
    if len(raw) < HEADER_SIZE:
        raise ValueError(f"shard {p} is truncated ({size} bytes, shorter than its {HEADER_SIZE}-byte header); {hint}")
    body, crc = raw[:-4], struct.unpack("<I", raw[-4:])[0]
    magic, version, itemsize, n_tokens, n_docs, vocab_size, fp = _HEADER.unpack(body[:_HEADER.size])
    if magic != MAGIC:
        raise ValueError(f"{p} is not an lmforge shard (bad magic {magic!r}); {hint}")
    if zlib.crc32(body) != crc:
        raise ValueError(f"shard {p} has a corrupt header (checksum mismatch); {hint}")
    if version != FORMAT_VERSION:
        raise ValueError(f"shard {p} has format version {version}, this lmforge reads {FORMAT_VERSION}; "
                         "re-prepare the data with this version")
    expected = HEADER_SIZE + n_tokens * itemsize + n_docs * 4
    if size != expected:
        raise ValueError(f"shard {p} is {'truncated' if size < expected else 'too long'}: {size} bytes, header says "
                         f"{expected} ({n_tokens} tokens, {n_docs} documents); {hint}")
    return {"itemsize": itemsize, "tokens": n_tokens, "documents": n_docs, "vocab_size": vocab_size,
            "fingerprint": fp.rstrip(b"\0").decode("ascii")}


def write_shard(path: str | os.PathLike, tokens: np.ndarray, doc_starts: np.ndarray, vocab_size: int,
                fingerprint: str) -> str:
    """Write one shard atomically; return its SHA-256 (computed from the bytes written)."""
    header = pack_header(tokens.dtype.itemsize, len(tokens), len(doc_starts), vocab_size, fingerprint)
    starts = np.ascontiguousarray(doc_starts, dtype="<u4")
    h = hashlib.sha256()
    with atomic_open(path, "wb") as f:
        for part in (memoryview(header), memoryview(np.ascontiguousarray(tokens)).cast("B"),
                     memoryview(starts).cast("B")):
            f.write(part)
            h.update(part)
    return h.hexdigest()


def open_shard(path: str | os.PathLike) -> tuple[np.memmap, dict[str, Any]]:
    """Memory-map the tokens of a shard (read-only, nothing read yet) and return them with its header."""
    head = read_header(path)
    dtype = np.dtype(np.uint16 if head["itemsize"] == 2 else np.uint32).newbyteorder("<")
    tokens = np.memmap(path, dtype=dtype, mode="r", offset=HEADER_SIZE, shape=(head["tokens"],))
    return tokens, head


def read_doc_starts(path: str | os.PathLike, head: dict[str, Any]) -> np.ndarray:
    """The document start offsets stored after a shard's tokens (a small in-memory array)."""
    offset = HEADER_SIZE + head["tokens"] * head["itemsize"]
    with open(path, "rb") as f:
        f.seek(offset)
        return np.frombuffer(f.read(head["documents"] * 4), dtype="<u4").astype(np.int64)


# --------------------------------------------------------------------------------------------------
# Manifest
# --------------------------------------------------------------------------------------------------
def _inconsistent(d: Path, what: str) -> ValueError:
    return ValueError(f"{d / MANIFEST} is inconsistent: {what}. Was it edited by hand? Restore it, or rebuild the "
                      "directory with `lmforge data prepare --force`")


def load_manifest(d: str | os.PathLike) -> dict[str, Any]:
    """Read and check ``manifest.json`` of a shard directory (``ValueError`` if missing or inconsistent)."""
    d = Path(d)
    path = d / MANIFEST
    if not path.exists():
        raise ValueError(f"{d} is not a shard directory (no {MANIFEST}); create one with `lmforge data prepare`")
    try:
        m = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise _inconsistent(d, f"not valid JSON ({e})") from None
    check_manifest(m, d)
    return m


def save_manifest(d: str | os.PathLike, m: dict[str, Any]) -> None:
    """Check and atomically write ``manifest.json``."""
    check_manifest(m, Path(d))
    atomic_write_text(Path(d) / MANIFEST, json.dumps(m, indent=1, sort_keys=False) + "\n")


def new_manifest(tokenizer_info: dict[str, Any], dtype: str, shard_tokens: int, bos_id: int | None,
                 eos_id: int | None) -> dict[str, Any]:
    """An empty manifest for a fresh shard directory."""
    return {"format": "lmforge-shards", "version": FORMAT_VERSION, "tokenizer": tokenizer_info, "dtype": dtype,
            "shard_tokens": shard_tokens, "bos_id": bos_id, "eos_id": eos_id,
            "splits": {}, "shards": [], "sources": [], "pending": None}


def check_manifest(m: dict[str, Any], d: Path) -> None:
    """Internal consistency of a manifest: keys, dtype, shard names, per-split totals, sources."""
    try:
        _check_manifest(m, d)
    except (KeyError, TypeError, AttributeError) as e:
        raise _inconsistent(d, f"a field is missing or has the wrong type ({type(e).__name__}: {e})") from None


def _check_manifest(m: dict[str, Any], d: Path) -> None:
    if not isinstance(m, dict):
        raise _inconsistent(d, "the top level is not a JSON object")
    for key in ("format", "version", "tokenizer", "dtype", "splits", "shards", "sources"):
        if key not in m:
            raise _inconsistent(d, f"missing key {key!r}")
    if m["format"] != "lmforge-shards" or m["version"] != FORMAT_VERSION:
        raise _inconsistent(d, f"unknown format {m['format']!r} version {m['version']!r}")
    if m["dtype"] not in DTYPES:
        raise _inconsistent(d, f"dtype {m['dtype']!r} is not one of {sorted(DTYPES)}")
    if m["tokenizer"].get("vocab_size", 0) > np.iinfo(DTYPES[m["dtype"]]).max + 1:
        raise _inconsistent(d, f"vocab size {m['tokenizer']['vocab_size']} does not fit {m['dtype']}")
    names = [s["name"] for s in m["shards"]]
    if len(set(names)) != len(names):
        raise _inconsistent(d, "a shard is listed twice")
    hashes = [s["sha256"] for s in m["shards"]]
    if len(set(hashes)) != len(hashes):
        raise _inconsistent(d, "two shards have the same content hash (a shard was added twice)")
    totals: dict[str, dict[str, int]] = {}
    for s in m["shards"]:
        match = SHARD_NAME.match(s["name"])
        if not match or match["split"] != s["split"]:
            raise _inconsistent(d, f"shard name {s['name']!r} does not match its split {s['split']!r}")
        t = totals.setdefault(s["split"], {"tokens": 0, "documents": 0, "shards": 0})
        t["tokens"] += s["tokens"]
        t["documents"] += s["documents"]
        t["shards"] += 1
    for split, t in totals.items():
        info = m["splits"].get(split)
        if info is None:
            raise _inconsistent(d, f"shards of split {split!r} but no entry in 'splits'")
        for key in ("tokens", "documents", "shards"):
            if info.get(key) != t[key]:
                raise _inconsistent(d, f"split {split!r} says {key}={info.get(key)} but its shards add up to {t[key]}")
    for split, info in m["splits"].items():
        if split not in totals and info.get("tokens", 0):
            raise _inconsistent(d, f"split {split!r} claims {info['tokens']} tokens but has no shards")
    src_hashes = [s["sha256"] for s in m["sources"]]
    if len(set(src_hashes)) != len(src_hashes):
        raise _inconsistent(d, "a source file is listed twice")
    if m.get("pending") is None:  # source token counts match split totals once no run is in progress
        for split, info in m["splits"].items():
            src_tokens = sum(s["tokens"].get(split, 0) for s in m["sources"])
            if src_tokens != info["tokens"]:
                raise _inconsistent(d, f"sources add up to {src_tokens} {split} tokens, split says {info['tokens']}")


# --------------------------------------------------------------------------------------------------
# TokenDataset
# --------------------------------------------------------------------------------------------------
class TokenDataset:
    """The shards of one split of a shard directory, memory-mapped (nothing is read until indexed).

    Checks on open: the manifest is consistent, every shard exists, and each header and file size
    agree with the manifest (``verify=True`` also re-hashes every shard against its SHA-256).
    """

    def __init__(self, directory: str | os.PathLike, split: str = "train", verify: bool = False) -> None:
        self.dir = Path(directory)
        self.split = split
        self.manifest = load_manifest(self.dir)
        entries = [s for s in self.manifest["shards"] if s["split"] == split]
        if not entries:
            have = sorted(k for k, v in self.manifest["splits"].items() if v.get("tokens"))
            busy = " A prepare run is in progress or was interrupted: let it finish (or re-run it) first." \
                if self.manifest.get("pending") else ""
            raise ValueError(f"{self.dir} has no shards for split {split!r} (splits with data: {have}); "
                             f"prepare it with --val-fraction or --split.{busy}")
        self.entries = entries
        self.dtype = np.dtype(DTYPES[self.manifest["dtype"]])
        self.fingerprint: str = self.manifest["tokenizer"]["fingerprint"]
        self.vocab_size: int = int(self.manifest["tokenizer"]["vocab_size"])
        self.shards: list[np.memmap] = []
        self._heads: list[dict[str, Any]] = []
        for e in entries:
            path = self.dir / e["name"]
            if not path.exists():
                raise ValueError(f"shard {path} listed in the manifest is missing; restore it or re-run prepare --force")
            tokens, head = open_shard(path)
            problems = [k for k in ("tokens", "documents") if head[k] != e[k]]
            if head["itemsize"] != self.dtype.itemsize:
                problems.append("dtype")
            if head["fingerprint"] != self.fingerprint:
                problems.append("tokenizer fingerprint")
            if problems:
                raise ValueError(f"shard {path} does not match the manifest ({', '.join(problems)} differ); "
                                 "it was replaced or the manifest was edited; re-run prepare --force")
            if verify and sha256_file(path) != e["sha256"]:
                raise ValueError(f"shard {path} is corrupt (SHA-256 differs from the manifest); re-run prepare --force")
            self.shards.append(tokens)
            self._heads.append(head)
        info = self.manifest["splits"][split]
        self.num_tokens = int(info["tokens"])
        self.num_documents = int(info["documents"])
        self.text_bytes = int(info.get("text_bytes", 0))

    @property
    def shard_names(self) -> list[str]:
        return [e["name"] for e in self.entries]

    @property
    def bytes_per_token(self) -> float:
        """UTF-8 text bytes per token of this split: ``bpb = loss / ln(2) / bytes_per_token``."""
        return self.text_bytes / max(1, self.num_tokens)

    @property
    def max_token_id(self) -> int:
        """The largest token id in the split (from the manifest; scanned only for shards without a record)."""
        return max(int(e["max_id"]) if "max_id" in e else int(s.max(initial=0))
                   for e, s in zip(self.entries, self.shards))

    def doc_starts(self, i: int) -> np.ndarray:
        """Offsets (within shard ``i``) where documents begin."""
        return read_doc_starts(self.dir / self.entries[i]["name"], self._heads[i])

    def check_tokenizer(self, tokenizer: Any) -> None:
        """``ValueError`` unless ``tokenizer`` is the one these shards were made with."""
        fp = tokenizer.fingerprint()
        if fp != self.fingerprint:
            copy = self.dir / "tokenizer.json"
            made_by = f"the one saved as {copy}" if copy.exists() else "another tokenizer"
            raise ValueError(f"the shards in {self.dir} were made with a different tokenizer ({made_by}, fingerprint "
                             f"{self.fingerprint[:16]}, vocab {self.vocab_size}) than the one given (fingerprint "
                             f"{fp[:16]}, vocab {tokenizer.vocab_size}); use that tokenizer or re-run "
                             "`lmforge data prepare` with this one")

    def __len__(self) -> int:
        return self.num_tokens

    def __repr__(self) -> str:
        return (f"TokenDataset({str(self.dir)!r}, split={self.split!r}: {len(self.shards)} shards, "
                f"{self.num_tokens:,} tokens, {self.dtype.name})")


# --------------------------------------------------------------------------------------------------
# inspect
# --------------------------------------------------------------------------------------------------
def inspect(directory: str | os.PathLike, tokenizer: Any = None, sample_tokens: int = 64, verify: bool = False) -> str:
    """A human-readable summary of a shard directory, with a decoded sample of each split.

    ``tokenizer`` defaults to the ``tokenizer.json`` that ``prepare`` stored beside the shards.
    ``verify`` re-hashes every shard.
    """
    d = Path(directory)
    m = load_manifest(d)
    tok = m["tokenizer"]
    lines = [f"{d}: {len(m['shards'])} shards ({m['dtype']}), tokenizer {tok['fingerprint'][:16]}… "
             f"vocab {tok['vocab_size']:,}, bos_id={m['bos_id']} eos_id={m['eos_id']}"]
    if m.get("pending"):
        n = len(m["pending"]["shards"])
        lines.append(f"  an interrupted prepare is pending ({n} shards written); re-run the same command to resume")
    if tokenizer is None and (d / "tokenizer.json").exists():
        tokenizer = Tokenizer.load(d / "tokenizer.json")
    for split, info in sorted(m["splits"].items()):
        bpt = info.get("text_bytes", 0) / max(1, info["tokens"])
        lines.append(f"  {split}: {info['shards']} shards, {info['tokens']:,} tokens, {info['documents']:,} documents, "
                     f"{human_bytes(info.get('text_bytes', 0))} text ({bpt:.2f} bytes/token)")
        ds = TokenDataset(d, split, verify=verify)
        if tokenizer is not None:
            ds.check_tokenizer(tokenizer)
            sample = np.asarray(ds.shards[0][:sample_tokens], dtype=np.int64).tolist()
            lines.append(f"    sample: {tokenizer.decode(sample)!r}")
    lines.append(f"  {len(m['sources'])} sources:")
    for s in m["sources"]:
        toks = ", ".join(f"{k} {v:,}" for k, v in s["tokens"].items())
        dropped = ", ".join(f"{s[k]} {k.replace('_', ' ')}" for k in ("empty_skipped", "invalid_utf8") if s.get(k))
        lines.append(f"    {s['path']} ({human_bytes(s['size'])}, sha256 {s['sha256'][:12]}…): {toks} tokens"
                     + (f"; documents dropped/fixed: {dropped}" if dropped else ""))
    return "\n".join(lines)
