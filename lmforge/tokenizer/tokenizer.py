"""``Tokenizer``: byte-level BPE encoding and decoding with special tokens, batches, streams and file formats.

The constructor takes the CS336 assignment-1 arguments -- ``Tokenizer(vocab, merges, special_tokens)``
-- and encodes with the C++ core (``lmforge._core.Encoder``) when it is built, else with the
pure-Python reference (:mod:`lmforge.tokenizer.reference`). Both give identical ids; ``backend="python"`` forces the
reference so tests can hold the fast path to it.

>>> from lmforge.tokenizer.reference import train_bpe_reference
>>> vocab, merges = train_bpe_reference(["low lower lowest"] * 3, 270, [EOT])
>>> tok = Tokenizer(vocab, merges, [EOT])
>>> ids = tok.encode("lower" + EOT)
>>> ids[-1] == tok.eot_id, tok.decode(ids) == "lower" + EOT
(True, True)
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Literal, Mapping, Sequence

from lmforge.tokenizer import reference as bpe

from lmforge.tokenizer import formats as tokenizer_io
from lmforge import _native
from lmforge.common import token_ids
from lmforge.corpus.specials import EOT
from lmforge.tokenizer.training import _threads, train_bpe, train_bpe_from_iterator

if TYPE_CHECKING:
    import numpy as np  # here: encoding and training need no numpy (~13 MB)
    import regex  # compiled on first use: the C++ encoder needs no Python regex

__all__ = ["Tokenizer", "fingerprint", "load_tokenizer", "text_stats", "train_bpe", "train_bpe_from_iterator"]

logger = logging.getLogger("lmforge")

Special = Literal["allowed", "disallowed", "plain"]
_CORE_PATTERNS = {"gpt2": "PATTERN_GPT2", "gpt4": "PATTERN_GPT4", "cl100k": "PATTERN_GPT4",
                  "nanochat": "PATTERN_NANOCHAT"}


@functools.cache
def _safe_cut() -> "regex.Pattern[str]":
    """A cut point for streaming: a single ASCII space after a printable ASCII char and before a letter.
    Every built-in pattern ends a pre-token before such a space and starts the next one at it."""
    import regex

    return regex.compile(r"(?<=[!-~]) (?=[A-Za-z])", regex.REVERSE)

_STREAM_CHUNK = 1 << 13  # characters buffered by encode_iterable before it looks for a cut point


def _core_encoder_class() -> Any:
    """``lmforge._core.Encoder`` when the C++ extension is built with it, else None."""
    return _native.core().Encoder if _native.available("Encoder") else None


def fingerprint(vocab: Mapping[int, bytes], merges: Sequence[tuple[bytes, bytes]], special_ids: Mapping[str, int],
                pattern: str) -> str:
    """:meth:`Tokenizer.fingerprint` of a tokenizer with these parts (ids dense, tokens ``bytes``).

    The first 16 hex digits of the SHA-256 of ``json.dumps(doc, sort_keys=True)``, where ``doc`` is
    ``{"vocab": [hex of each id's bytes], "merges": [[hex a, hex b], ...], "special_tokens": sorted
    (token, id) pairs, "pattern": the pattern's regex}``. The long lists are written here with C-level
    joins instead of ``json.dumps`` (same text: hex digits need no JSON escaping; a test holds the two
    equal).
    """
    pairs = tokenizer_io.join_pairs(list(map(bytes.hex, itertools.chain.from_iterable(merges))), '", "', '"], ["')
    vocab_hex = '", "'.join(map(bytes.hex, map(vocab.__getitem__, range(len(vocab)))))
    text = ('{"merges": ' + ('[["' + pairs + '"]]' if merges else "[]")
            + ', "pattern": ' + json.dumps(bpe.resolve_pattern(pattern))
            + ', "special_tokens": ' + json.dumps(sorted(special_ids.items()))
            + ', "vocab": ' + ('["' + vocab_hex + '"]' if vocab else "[]") + "}")
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class Tokenizer:
    """A byte-level BPE tokenizer: ``vocab`` (id -> bytes), ``merges`` in rank order, specials, pattern.

    Special tokens missing from ``vocab`` are appended with new ids (as in CS336). ``pattern`` is a
    name from :data:`lmforge.tokenizer.reference.PATTERNS` or a custom regex. ``backend`` is ``"auto"`` (C++ when
    available), ``"cpp"`` (error if not built) or ``"python"`` (the reference).
    """

    def __init__(self, vocab: Mapping[int, bytes], merges: Sequence[tuple[bytes, bytes]],
                 special_tokens: Sequence[str] | None = None, pattern: str = "gpt2", *, backend: str = "auto"):
        specials = bpe.check_special_tokens(special_tokens)
        self.pattern = pattern
        bpe.resolve_pattern(pattern)  # ValueError now for a bad pattern; compiled on first use (_regex)
        vocab = dict(vocab)
        for i, tok in vocab.items():
            if not isinstance(i, int) or not isinstance(tok, bytes):
                raise ValueError(f"vocab must map int ids to bytes; got {i!r}: {tok!r}")
        for s in specials:
            if s.encode("utf-8") not in vocab.values():
                vocab[len(vocab)] = s.encode("utf-8")
        if sorted(vocab) != list(range(len(vocab))):
            missing = next(i for i in range(len(vocab)) if i not in vocab)
            raise ValueError(f"vocab ids must be 0..{len(vocab) - 1} without gaps; id {missing} is missing")
        self.vocab: dict[int, bytes] = vocab
        self.merges: list[tuple[bytes, bytes]] = [(bytes(a), bytes(b)) for a, b in merges]
        self._special_ids = bpe.special_ids(vocab, specials)
        self._to_id = bpe.token_ids(vocab, specials)
        missing_bytes = [b for b in range(256) if bytes([b]) not in self._to_id]
        if missing_bytes:
            raise ValueError(f"vocab lacks the single byte {bytes([missing_bytes[0]])!r} (and {len(missing_bytes) - 1} "
                             "more); a byte-level BPE vocab must hold all 256 bytes so any text can be encoded")
        for r, (a, b) in enumerate(self.merges):
            for part in (a, b, a + b):
                if part not in self._to_id:
                    raise ValueError(f"merge {r} ({a!r}, {b!r}) uses token {part!r}, which is not in the vocab")
        self._ranks = {pair: r for r, pair in enumerate(self.merges)}
        self._cache: dict[str, list[int]] = {}
        self._core = self._make_core(backend)
        self.backend = "cpp" if self._core is not None else "python"

    def _make_core(self, backend: str) -> Any:
        if backend not in ("auto", "cpp", "python"):
            raise ValueError(f"backend must be 'auto', 'cpp' or 'python', got {backend!r}")
        if backend == "python":
            return None
        cls = _core_encoder_class()
        if cls is None:
            if backend == "cpp":
                raise ValueError("backend='cpp' requested but lmforge._core.Encoder is not built; "
                                 f"run `{_native.REBUILD_COMMAND}` or use backend='python'")
            return None
        _core = _native.core()

        # Custom regexes are pre-tokenized here and passed to encode_words.
        pat = getattr(_core, _CORE_PATTERNS.get(self.pattern, "PATTERN_CUSTOM"), None)
        if pat is None:
            return None
        merges = [(self._to_id[a], self._to_id[b]) for a, b in self.merges]
        return cls([self.vocab[i] for i in range(len(self.vocab))], merges, dict(self._special_ids), pat)

    @functools.cached_property
    def _regex(self) -> "regex.Pattern[str]":
        """The compiled pre-tokenization regex (the Python paths only; built on first use)."""
        return bpe.compile_pattern(self.pattern)

    @functools.cached_property
    def _splitter(self) -> "regex.Pattern[str] | None":
        """The regex matching any special token, or None (built on first use)."""
        return bpe.special_splitter(list(self._special_ids))

    # ----------------------------------------------------------------------------------------------
    # Properties
    # ----------------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of ids (ordinary tokens + specials); ids are ``0 .. vocab_size - 1``."""
        return len(self.vocab)

    @property
    def special_tokens(self) -> dict[str, int]:
        """Special token string -> id."""
        return dict(self._special_ids)

    @property
    def eot_id(self) -> int | None:
        """Id of ``EOT`` (the document separator), or None when it is not a special token."""
        return self._special_ids.get(EOT)

    def id_to_token(self, i: int) -> bytes:
        """The bytes of token ``i`` (``ValueError`` when out of range)."""
        (i,) = token_ids([i], len(self.vocab))
        return self.vocab[i]

    def token_to_id(self, token: bytes | str) -> int:
        """Id of a token given as bytes, or as a string (a special token or the token's UTF-8)."""
        if isinstance(token, str):
            if token in self._special_ids:
                return self._special_ids[token]
            token = token.encode("utf-8")
        if token not in self._to_id:
            raise ValueError(f"token {token!r} is not in the vocabulary")
        return self._to_id[token]

    def fingerprint(self) -> str:
        """A stable 16-hex-digit hash of vocab, merges, specials and the pattern's regex.

        Two tokenizers with the same fingerprint produce the same ids for every text; shards
        record it so that a model is never trained on tokens from a different tokenizer.
        """
        return fingerprint(self.vocab, self.merges, self._special_ids, self.pattern)

    def with_special_tokens(self, tokens: Sequence[str]) -> "Tokenizer":
        """A copy that also has the special ``tokens``, each new one appended with id ``vocab_size``, ``+1``, ...

        No retraining: every existing id, merge and special keeps its meaning, so ids encoded before still
        decode the same and a model only needs new embedding rows. Tokens that are already special are
        skipped (adding the same tokens twice is a no-op). A token whose bytes are an ordinary token still
        gets a new id: text keeps encoding to the ordinary one, and only the special id means the special.
        """
        tokens = [t for t in bpe.check_special_tokens(tokens) if t not in self._special_ids]
        vocab = dict(self.vocab)
        for t in tokens:
            vocab[len(vocab)] = t.encode("utf-8")
        specials = sorted(self._special_ids, key=self._special_ids.__getitem__) + tokens
        return Tokenizer(vocab, self.merges, specials, self.pattern, backend=self.backend)

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, merges={len(self.merges)}, "
                f"special_tokens={list(self._special_ids)}, pattern={self.pattern!r}, backend={self.backend!r})")

    # ----------------------------------------------------------------------------------------------
    # Encoding
    # ----------------------------------------------------------------------------------------------
    def _check_special_mode(self, text: str, special: str) -> bool:
        """Validate ``special`` and return whether specials in ``text`` become special ids."""
        if special == "allowed":
            return True
        if special == "plain":
            return False
        if special == "disallowed":
            if self._splitter is not None and (m := self._splitter.search(text)):
                raise ValueError(f"text contains the special token {m.group()!r} at character {m.start()}, "
                                 "but special='disallowed'; use special='allowed' to emit its id or "
                                 "special='plain' to encode it as ordinary text")
            return False
        raise ValueError(f"special must be 'allowed', 'disallowed' or 'plain', got {special!r}")

    def _encode_chunk_py(self, text: str) -> list[int]:
        ids: list[int] = []
        cache = self._cache
        for w in self._regex.findall(text):
            toks = cache.get(w)
            if toks is None:
                toks = [self._to_id[t] for t in bpe.bpe_word(w.encode("utf-8"), self._ranks)]
                if len(cache) > 200_000:
                    cache.clear()
                cache[w] = toks
            ids.extend(toks)
        return ids

    def _encode_ordinary(self, text: str) -> list[int]:
        if self._core is None:
            return self._encode_chunk_py(text)
        if self.pattern in _CORE_PATTERNS:
            return list(self._core.encode(text, False))
        return list(self._core.encode_words([w.encode("utf-8") for w in self._regex.findall(text)]))

    def encode(self, text: str, special: Special = "allowed") -> list[int]:
        """Encode ``text`` to ids.

        ``special``: ``"allowed"`` turns special tokens in the text into their ids (longest match
        first), ``"disallowed"`` raises ``ValueError`` if the text holds one, ``"plain"`` encodes
        them as ordinary text.
        """
        if not isinstance(text, str):
            raise ValueError(f"encode expects str, got {type(text).__name__}; decode bytes first")
        allow = self._check_special_mode(text, special)
        if self._core is not None and self.pattern in _CORE_PATTERNS:
            return self._core.encode(text, allow)  # already a fresh list
        if not allow or self._splitter is None:
            return self._encode_ordinary(text)
        ids: list[int] = []
        for piece, is_special in bpe.split_on_specials(text, list(self._special_ids)):
            if is_special:
                ids.append(self._special_ids[piece])
            else:
                ids.extend(self._encode_ordinary(piece))
        return ids

    def encode_batch(self, texts: Sequence[str], num_threads: int | None = None,
                     special: Special = "allowed") -> list[list[int]]:
        """Encode many documents (in parallel threads with the C++ backend)."""
        texts = list(texts)
        allow = all([self._check_special_mode(t, special) for t in texts]) if texts else True
        if self._core is not None and self.pattern in _CORE_PATTERNS:
            return self._core.encode_batch(texts, _threads(num_threads), allow)  # fresh lists
        return [self.encode(t, special) for t in texts]

    def encode_batch_flat(self, texts: Sequence[str], num_threads: int | None = None,
                          special: Special = "allowed") -> tuple["np.ndarray", "np.ndarray"]:
        """Encode many documents into one flat ``uint32`` array plus ``int64`` offsets (length n+1).

        Document ``k`` is ``tokens[offsets[k]:offsets[k+1]]``. This is the shape the shard writer
        wants: no Python list per token.
        """
        import numpy as np  # here: encoding and training need no numpy (~13 MB)

        texts = list(texts)
        allow = all([self._check_special_mode(t, special) for t in texts]) if texts else True
        if self._core is not None and self.pattern in _CORE_PATTERNS and hasattr(self._core, "encode_batch_flat"):
            tokens, offsets = self._core.encode_batch_flat(texts, _threads(num_threads), allow)
            return np.asarray(tokens, dtype=np.uint32), np.asarray(offsets, dtype=np.int64)
        docs = [self.encode(t, special) for t in texts]
        offsets = np.zeros(len(docs) + 1, dtype=np.int64)
        np.cumsum([len(d) for d in docs], out=offsets[1:])
        tokens = np.fromiter((i for d in docs for i in d), dtype=np.uint32, count=int(offsets[-1]))
        return tokens, offsets

    def encode_spans(self, buf: bytes, starts: "np.ndarray", ends: "np.ndarray", num_threads: int | None = None,
                     bos_id: int | None = None, eos_id: int | None = None,
                     dtype: str = "uint32") -> tuple["np.ndarray", "np.ndarray"]:
        """Encode the documents ``buf[starts[i]:ends[i]]`` (valid UTF-8) into one array, BOS/EOS around each.

        Returns ``(tokens, lengths)``: ``tokens`` in ``dtype`` (``uint16`` or ``uint32``) and each
        document's token count including its BOS/EOS. Special tokens in the text are allowed. This is
        what ``prepare`` calls on raw file chunks: the C++ core reads the bytes in place, so no Python
        string or list is made per document or token.
        """
        import numpy as np  # here: encoding and training need no numpy (~13 MB)

        if dtype not in ("uint16", "uint32"):
            raise ValueError(f"dtype must be 'uint16' or 'uint32', got {dtype!r}")
        starts = np.ascontiguousarray(starts, dtype=np.int64)
        ends = np.ascontiguousarray(ends, dtype=np.int64)
        if self._core is not None and self.pattern in _CORE_PATTERNS and hasattr(self._core, "encode_spans"):
            itemsize = np.dtype(dtype).itemsize
            try:
                return self._core.encode_spans(buf, starts, ends, _threads(num_threads), True,
                                               -1 if bos_id is None else bos_id, -1 if eos_id is None else eos_id,
                                               itemsize)
            except ValueError as e:
                raise ValueError(f"encode_spans: {e}") from None
        mv = memoryview(buf)
        docs = [self.encode(str(mv[a:b], "utf-8")) for a, b in zip(starts.tolist(), ends.tolist())]
        pre, post = [] if bos_id is None else [bos_id], [] if eos_id is None else [eos_id]
        flat = [i for d in docs for i in (*pre, *d, *post)]
        if flat and max(flat) > np.iinfo(dtype).max:
            raise ValueError(f"encode_spans: a token id does not fit {dtype}; use uint32 output")
        lengths = np.array([len(d) + len(pre) + len(post) for d in docs], dtype=np.int64)
        return np.array(flat, dtype=dtype), lengths

    def _safe_cut(self, buf: str) -> int:
        """Last index where ``buf`` can be split without changing its encoding (0 if none).

        The cut is before a single space that follows printable ASCII and precedes a letter, and no
        special token may straddle it (including one that more text could still complete).
        """
        for m in _safe_cut().finditer(buf):
            c = m.start()
            if not any(self._straddles(buf, c, s) for s in self._special_ids):
                return c
        return 0

    @staticmethod
    def _straddles(buf: str, c: int, s: str) -> bool:
        for k in range(1, len(s)):
            if buf.endswith(s[:k], 0, c):
                rest = buf[c:c + len(s) - k]
                if s[k:].startswith(rest):
                    return True
        return False

    def encode_iterable(self, iterable: Iterable[str], special: Special = "allowed") -> Iterator[int]:
        """Lazily encode a stream of strings (e.g. a text file's lines); memory stays flat.

        The result equals ``encode("".join(iterable))``: text is buffered until a cut point is
        found where neither pre-tokenization nor a special token can change across the join.
        """
        parts: list[str] = []
        size = 0
        for piece in iterable:
            parts.append(piece)
            size += len(piece)
            if size >= _STREAM_CHUNK:
                buf = "".join(parts)
                cut = self._safe_cut(buf)
                if cut > 0:
                    yield from self.encode(buf[:cut], special)
                    buf = buf[cut:]
                parts, size = [buf], len(buf)
                if cut == 0:  # no cut point yet: wait for twice as much text before looking again
                    size = -size
        if parts:
            yield from self.encode("".join(parts), special)

    # ----------------------------------------------------------------------------------------------
    # Decoding
    # ----------------------------------------------------------------------------------------------
    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """The concatenated bytes of ``ids`` (may end inside a multi-byte character)."""
        ids = token_ids(ids, len(self.vocab))
        if self._core is not None and hasattr(self._core, "decode_bytes"):
            return bytes(self._core.decode_bytes(ids))
        return b"".join(self.vocab[i] for i in ids)

    def decode(self, ids: Iterable[int]) -> str:
        """Decode ids to text; byte sequences that are not valid UTF-8 become U+FFFD."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    # ----------------------------------------------------------------------------------------------
    # Files
    # ----------------------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike, force: bool = False) -> Path:
        """Save in lmforge's JSON format (atomic; refuses to overwrite unless ``force``)."""
        return tokenizer_io.save_lmforge(path, self.vocab, self.merges, self._special_ids, self.pattern, force)

    @classmethod
    def load(cls, path: str | os.PathLike, *, backend: str = "auto") -> "Tokenizer":
        """Load a file written by :meth:`save` (``ValueError`` for corrupt, foreign or inconsistent files)."""
        vocab, merges, specials, pattern = tokenizer_io.load_lmforge(path)
        return cls._checked(path, vocab, merges, specials, pattern, backend)

    @classmethod
    def _checked(cls, path: Any, vocab: Any, merges: Any, specials: Any, pattern: str, backend: str) -> "Tokenizer":
        try:
            return cls(vocab, merges, specials, pattern, backend=backend)
        except ValueError as e:
            raise ValueError(f"{path}: inconsistent tokenizer: {e}") from None

    @classmethod
    def from_files(cls, vocab_json: str | os.PathLike, merges_txt: str | os.PathLike,
                   special_tokens: Sequence[str] | None = None, pattern: str = "gpt2",
                   *, backend: str = "auto") -> "Tokenizer":
        """Load GPT-2 style ``vocab.json`` + ``merges.txt`` (the CS336 helper's signature)."""
        vocab, merges = tokenizer_io.read_gpt2(vocab_json, merges_txt)
        return cls._checked(vocab_json, vocab, merges, special_tokens, pattern, backend)

    def save_gpt2(self, vocab_json: str | os.PathLike, merges_txt: str | os.PathLike, force: bool = False) -> None:
        """Write GPT-2 style ``vocab.json`` + ``merges.txt`` (specials are in vocab.json; the pattern is not saved)."""
        tokenizer_io.write_gpt2(vocab_json, merges_txt, self.vocab, self.merges, force)

    @classmethod
    def from_hf(cls, path: str | os.PathLike, *, backend: str = "auto") -> "Tokenizer":
        """Load a byte-level BPE Hugging Face ``tokenizer.json`` (ours or e.g. GPT-2's)."""
        vocab, merges, specials, pattern = tokenizer_io.load_hf(path)
        return cls._checked(path, vocab, merges, specials, pattern, backend)

    def save_hf(self, path: str | os.PathLike, force: bool = False) -> Path:
        """Write a HF ``tokenizer.json`` that ``tokenizers`` and ``transformers`` load and encode identically."""
        return tokenizer_io.save_hf(path, self.vocab, self.merges, self._special_ids, self.pattern, force)

    def to_tiktoken(self, name: str = "lmforge") -> Any:
        """A ``tiktoken.Encoding`` with the same ids (see :func:`lmforge.tokenizer.formats.to_tiktoken` for the caveat)."""
        return tokenizer_io.to_tiktoken(self.vocab, self._special_ids, self.pattern, name)


def load_tokenizer(path: str | os.PathLike, *, backend: str = "auto") -> Tokenizer:
    """Load any supported tokenizer: lmforge JSON, HF ``tokenizer.json``, or a directory with GPT-2 files.

    For a directory, ``<|...|>`` entries of ``vocab.json`` (e.g. GPT-2's end-of-text token, ``EOT``) become
    special tokens.
    """
    p = Path(path)
    if p.is_dir():
        vj, mt = p / "vocab.json", p / "merges.txt"
        if vj.is_file() and mt.is_file():
            vocab, merges = tokenizer_io.read_gpt2(vj, mt)
            specials = [t.decode() for _, t in sorted(vocab.items())
                        if t.startswith(b"<|") and t.endswith(b"|>") and len(t) > 4]
            return Tokenizer._checked(p, vocab, merges, specials, "gpt2", backend)
        if (p / "tokenizer.json").is_file():
            return load_tokenizer(p / "tokenizer.json", backend=backend)
        raise ValueError(f"directory {p} holds neither vocab.json + merges.txt nor tokenizer.json; "
                         "give a tokenizer file")
    with open(tokenizer_io.check_input_file(p), "rb") as f:
        head = f.read(4096)
    if b'"lmforge-bpe"' in head:
        return Tokenizer.load(p, backend=backend)
    if b'"model"' in head or b'"added_tokens"' in head or b'"pre_tokenizer"' in head:
        return Tokenizer.from_hf(p, backend=backend)
    return Tokenizer.load(p, backend=backend)  # raises a ValueError that says what the file looks like


def text_stats(tokenizer: Tokenizer, text: str, top: int = 5) -> dict[str, Any]:
    """Compression statistics of ``tokenizer`` on ``text`` (specials in the text encoded as plain text).

    ``bytes_per_token`` (higher = better compression), ``tokens_per_word`` (whitespace-separated
    words), ``vocab_used`` (fraction of the vocabulary's ids that occur) and the ``longest`` tokens
    that occur (bytes).
    """
    ids = tokenizer.encode(text, special="plain")
    n_bytes, n_words = len(text.encode("utf-8")), len(text.split())
    used = set(ids)
    longest = sorted(used, key=lambda i: (-len(tokenizer.vocab[i]), i))[:top]
    return {"bytes": n_bytes, "tokens": len(ids), "words": n_words,
            "bytes_per_token": n_bytes / len(ids) if ids else 0.0,
            "tokens_per_word": len(ids) / n_words if n_words else 0.0,
            "vocab_used": len(used) / tokenizer.vocab_size,
            "longest": [tokenizer.vocab[i] for i in longest]}
