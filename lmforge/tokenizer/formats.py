"""Tokenizer file formats: lmforge JSON, GPT-2 ``vocab.json``/``merges.txt``, HF ``tokenizer.json``, tiktoken.

Every reader returns the same four things -- ``(vocab, merges, special_tokens, pattern)`` -- and
every writer takes them, so :class:`lmforge.tokenizer.Tokenizer` can wrap all formats with a few
lines each. Writers are atomic and refuse to overwrite an existing file unless ``force`` is set.

The lmforge format is one human-readable, versioned JSON file::

    {
     "format": "lmforge-bpe",
     "version": 1,
     "pattern": "gpt2",
     "special_tokens": {"<|pad|>": 256},
     "vocab_size": 259,
     "vocab": [
      "\\\\x00",            <- id 0: byte 0x00, escaped
      ...
      "a",                 <- id 97
      ...
     ],
     "merges": [
      [" ", "t"],          <- merge 0: b" " + b"t"
      ...
     ]
    }

Token bytes are written as text where printable ASCII stands for itself, a backslash is written
``\\\\`` and any other byte is ``\\xNN`` (see :func:`escape_token`), so ASCII tokens read
naturally and every byte string round-trips exactly.
"""

from __future__ import annotations

import codecs
import itertools
import json
import os
import re
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from lmforge.tokenizer.reference import PATTERNS, bytes_to_unicode, resolve_pattern, unicode_to_bytes
from lmforge.common import atomic_write_text, check_input_file, check_output_path

FORMAT_NAME = "lmforge-bpe"
FORMAT_VERSION = 1

Vocab = dict[int, bytes]
Merges = list[tuple[bytes, bytes]]
Loaded = tuple[Vocab, Merges, list[str], str]


# --------------------------------------------------------------------------------------------------
# Escaping token bytes as readable text
# --------------------------------------------------------------------------------------------------
def escape_token(tok: bytes) -> str:
    r"""Readable, reversible text for token bytes: printable ASCII as is, ``\\`` for ``\``, else ``\xNN``.

    >>> escape_token(b" the"), escape_token(b"\n"), escape_token(b"\\"), escape_token("é".encode())
    (' the', '\\x0a', '\\\\', '\\xc3\\xa9')
    """
    return tok.decode("latin-1").translate(_ESCAPE_TABLE)  # byte b -> chr(b) -> its escape (C loops, no Python)


# chr(b) -> what escape_token writes for byte b, for the bytes not written as themselves.
_ESCAPE_TABLE = {b: "\\\\" if b == 0x5C else f"\\x{b:02x}" for b in range(256) if b == 0x5C or not 0x20 <= b <= 0x7E}
# json.dumps(s) for a str s, without json.dumps's per-call Python overhead (the same C encoder it uses).
_json_str = json.encoder.encode_basestring_ascii
# chr(b) -> the body of _json_str(escape_token(bytes([b]))), for the bytes where that is not chr(b) itself (the
# escaped ones, and '"'): escaping and JSON quoting in one step, for all of a file's tokens at once.
_JSON_ESCAPES = {chr(b): _json_str(escape_token(bytes([b])))[1:-1] for b in range(256)}
_JSON_ESCAPES = {c: t for c, t in _JSON_ESCAPES.items() if t != c}
_SEP = "\u0100"  # joins tokens decoded as latin-1 (U+0000..U+00FF): it can be none of their characters
_NEEDS_ESCAPE = re.compile("[^" + "".join(re.escape(chr(b)) for b in range(256) if chr(b) not in _JSON_ESCAPES)
                           + _SEP + "]")


def _json_bodies(tokens: Iterable[bytes]) -> list[str]:
    """``_json_str(escape_token(t))[1:-1]`` for each token: one join, one scan, one split (C loops; most
    tokens need no escape, so the per-match replacement runs rarely)."""
    text = _SEP.join(map(bytes.decode, tokens, itertools.repeat("latin-1")))
    return _NEEDS_ESCAPE.sub(lambda m: _JSON_ESCAPES[m[0]], text).split(_SEP)


def join_pairs(items: list[str], inner: str, outer: str) -> str:
    """``outer.join(inner.join(pair) for pair in pairs of items)``, for an even number of items, by one join.

    >>> join_pairs(["a", "b", "c", "d"], "+", " / ")
    'a+b / c+d'
    """
    n = len(items) // 2
    out = [""] * max(4 * n - 1, 0)  # a0 inner b0 outer a1 inner b1 ...
    out[0::2] = items
    out[1::4] = [inner] * n
    out[3::4] = [outer] * (n - 1)
    return "".join(out)


_WELL_FORMED = re.compile(r"(?:[ -\[\]-~]|\\\\|\\x[0-9a-fA-F]{2})*")


def unescape_token(s: str) -> bytes:
    """Inverse of :func:`escape_token` (``ValueError`` on a malformed escape)."""
    if "\\" not in s and s.isascii() and s.isprintable():
        return s.encode("ascii")
    if _WELL_FORMED.fullmatch(s):
        return codecs.escape_decode(s.encode("ascii"))[0]  # only \\ and \xNN can occur here
    out = bytearray()  # slow path: find the malformed part and say what it is
    i = 0
    while i < len(s):
        c = s[i]
        if c != "\\":
            if not " " <= c <= "~":
                raise ValueError(f"token text {s!r} has a raw non-ASCII character {c!r}; write bytes as \\xNN")
            out.append(ord(c))
            i += 1
        elif s.startswith("\\\\", i):
            out.append(0x5C)
            i += 2
        elif s.startswith("\\x", i) and len(s) >= i + 4:
            try:
                out.append(int(s[i + 2:i + 4], 16))
            except ValueError:
                raise ValueError(f"bad escape {s[i:i + 4]!r} in token text {s!r}; use \\xNN with two hex digits") from None
            i += 4
        else:
            raise ValueError(f"bad escape at position {i} in token text {s!r}; use \\\\ or \\xNN")
    return bytes(out)


# --------------------------------------------------------------------------------------------------
# lmforge JSON
# --------------------------------------------------------------------------------------------------
def _describe_foreign(obj: Any) -> str | None:
    """Say what a JSON object that is not ours looks like, and which loader to use instead."""
    if isinstance(obj, dict) and "model" in obj and ("added_tokens" in obj or "pre_tokenizer" in obj):
        return "it looks like a Hugging Face tokenizer.json; load it with Tokenizer.from_hf(path)"
    if isinstance(obj, dict) and obj and all(isinstance(v, int) for v in list(obj.values())[:100]):
        return ("it looks like a GPT-2 vocab.json; load it with Tokenizer.from_files(vocab_json, merges_txt) "
                "(CLI: --tokenizer DIR containing vocab.json and merges.txt)")
    return None


def dumps_lmforge(vocab: Mapping[int, bytes], merges: Sequence[tuple[bytes, bytes]],
                  special_tokens: Mapping[str, int], pattern: str) -> str:
    """The lmforge JSON text: one vocab entry and one merge per line, so diffs stay readable."""
    n = len(vocab)
    assert sorted(vocab) == list(range(n)), "vocab ids must be dense"
    head = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "pattern": pattern,
            "special_tokens": dict(special_tokens), "vocab_size": n}
    lines = ["{"]
    lines += [f" {json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}," for k, v in head.items()]
    lines.append(' "vocab": [')
    lines.append('  "' + '",\n  "'.join(_json_bodies(map(vocab.__getitem__, range(n)))) + '"' if n else "")
    lines.append(" ],")
    lines.append(' "merges": [')
    # each line '  ["a", "b"]', as f'  [{_json_str(escape_token(a))}, {_json_str(escape_token(b))}]'
    lines.append('  ["' + join_pairs(_json_bodies(itertools.chain.from_iterable(merges)), '", "', '"],\n  ["') + '"]'
                 if merges else "")
    lines.append(" ]")
    lines.append("}")
    return "\n".join(lines) + "\n"


def save_lmforge(path: str | os.PathLike, vocab: Mapping[int, bytes], merges: Sequence[tuple[bytes, bytes]],
                 special_tokens: Mapping[str, int], pattern: str, force: bool = False) -> Path:
    """Write the lmforge JSON format atomically; refuses to overwrite unless ``force``."""
    p = check_output_path(path, force)
    atomic_write_text(p, dumps_lmforge(vocab, merges, special_tokens, pattern))
    return p


def _read_json(path: str | os.PathLike, what: str) -> Any:
    p = check_input_file(path)
    try:
        with open(p, encoding="utf-8") as f:
            return json.load(f)
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} {p} is not UTF-8 text (byte {e.start}); is it the right file?") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} {p} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); "
                         "the file is corrupt or truncated") from None


def load_lmforge(path: str | os.PathLike) -> Loaded:
    """Read the lmforge JSON format, with a clear ``ValueError`` for anything that is not one."""
    obj = _read_json(path, "tokenizer file")
    if not isinstance(obj, dict) or obj.get("format") != FORMAT_NAME:
        hint = _describe_foreign(obj)
        raise ValueError(f"{path} is not an lmforge tokenizer file (no \"format\": \"{FORMAT_NAME}\")"
                         + (f"; {hint}" if hint else ""))
    version = obj.get("version")
    if version != FORMAT_VERSION:
        raise ValueError(f"{path} has lmforge tokenizer format version {version!r}, but this lmforge reads "
                         f"version {FORMAT_VERSION}; upgrade lmforge or re-save the tokenizer")
    try:
        pattern = obj["pattern"]
        specials_obj = obj["special_tokens"]
        vocab_list = obj["vocab"]
        merges_list = obj["merges"]
        if not isinstance(specials_obj, dict) or not isinstance(vocab_list, list) or not isinstance(merges_list, list):
            raise TypeError("special_tokens must be an object, vocab and merges lists")
        vocab = {i: unescape_token(t) for i, t in enumerate(vocab_list)}
        merges = [(unescape_token(a), unescape_token(b)) for a, b in merges_list]
        specials = sorted(specials_obj, key=lambda s: specials_obj[s])
        for s, i in specials_obj.items():
            if not isinstance(i, int) or vocab.get(i) != s.encode("utf-8"):
                raise ValueError(f"special token {s!r} has id {i!r} but vocab[{i!r}] is not that token")
        if obj.get("vocab_size", len(vocab)) != len(vocab):
            raise ValueError(f"vocab_size is {obj.get('vocab_size')} but the vocab lists {len(vocab)} tokens")
        resolve_pattern(pattern)
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        detail = f"missing field {e}" if isinstance(e, KeyError) else str(e)
        raise ValueError(f"{path} is an inconsistent lmforge tokenizer file: {detail}") from None
    return vocab, merges, specials, pattern


# --------------------------------------------------------------------------------------------------
# GPT-2 vocab.json + merges.txt
# --------------------------------------------------------------------------------------------------
def _unmap(s: str, where: str) -> bytes:
    dec = unicode_to_bytes()
    try:
        return bytes(dec[c] for c in s)
    except KeyError as e:
        raise ValueError(f"{where}: token {s!r} has character {e.args[0]!r} outside GPT-2's byte-to-unicode "
                         "alphabet; is this a byte-level BPE file?") from None


def _map(tok: bytes) -> str:
    enc = bytes_to_unicode()
    return "".join(enc[b] for b in tok)


def read_gpt2(vocab_json: str | os.PathLike, merges_txt: str | os.PathLike) -> tuple[Vocab, Merges]:
    """Read GPT-2 style ``vocab.json`` (mapped token -> id) and ``merges.txt`` (``a b`` per line)."""
    obj = _read_json(vocab_json, "vocab file")
    if not isinstance(obj, dict) or not all(isinstance(v, int) for v in obj.values()):
        hint = "it looks like an lmforge tokenizer file; use Tokenizer.load(path)" if isinstance(obj, dict) and \
            obj.get("format") == FORMAT_NAME else "expected a JSON object mapping token strings to integer ids"
        raise ValueError(f"{vocab_json} is not a GPT-2 vocab.json: {hint}")
    vocab = {i: _unmap(s, str(vocab_json)) for s, i in obj.items()}
    p = check_input_file(merges_txt)
    merges: Merges = []
    with open(p, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\r\n")
            if not line.strip() or (lineno == 1 and line.startswith("#version")):
                continue
            parts = line.split(" ")
            if len(parts) != 2:
                raise ValueError(f"{p}:{lineno}: expected two space-separated tokens, got {line!r}")
            merges.append((_unmap(parts[0], f"{p}:{lineno}"), _unmap(parts[1], f"{p}:{lineno}")))
    return vocab, merges


def write_gpt2(vocab_json: str | os.PathLike, merges_txt: str | os.PathLike, vocab: Mapping[int, bytes],
               merges: Sequence[tuple[bytes, bytes]], force: bool = False) -> None:
    """Write GPT-2 style ``vocab.json`` + ``merges.txt`` (both checked before either is written)."""
    pv, pm = check_output_path(vocab_json, force), check_output_path(merges_txt, force)
    mapped: dict[str, int] = {}
    for i in sorted(vocab):
        s = _map(vocab[i])
        if s in mapped:
            raise ValueError(f"ids {mapped[s]} and {i} have the same bytes {vocab[i]!r}; vocab.json cannot hold both")
        mapped[s] = i
    atomic_write_text(pv, json.dumps(mapped, ensure_ascii=False) + "\n")
    atomic_write_text(pm, "#version: 0.2\n" + "".join(f"{_map(a)} {_map(b)}\n" for a, b in merges))


# --------------------------------------------------------------------------------------------------
# Hugging Face tokenizer.json
# --------------------------------------------------------------------------------------------------
def hf_tokenizer_dict(vocab: Mapping[int, bytes], merges: Sequence[tuple[bytes, bytes]],
                      special_tokens: Mapping[str, int], pattern: str) -> dict[str, Any]:
    """A ``tokenizers`` JSON document for our BPE: Split(our regex) + ByteLevel, BPE model, ByteLevel decoder."""
    special_ids = set(special_tokens.values())
    model_vocab: dict[str, int] = {}
    for i in sorted(vocab):
        model_vocab.setdefault(_map(vocab[i]) if i not in special_ids else vocab[i].decode("utf-8"), i)
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for s, i in special_tokens.items()],
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": resolve_pattern(pattern)}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        ]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": model_vocab, "merges": [f"{_map(a)} {_map(b)}" for a, b in merges]},
    }


def save_hf(path: str | os.PathLike, vocab: Mapping[int, bytes], merges: Sequence[tuple[bytes, bytes]],
            special_tokens: Mapping[str, int], pattern: str, force: bool = False) -> Path:
    """Write a HF ``tokenizer.json`` atomically (loadable by ``tokenizers`` and ``transformers``)."""
    p = check_output_path(path, force)
    atomic_write_text(p, json.dumps(hf_tokenizer_dict(vocab, merges, special_tokens, pattern),
                                    ensure_ascii=False, indent=1) + "\n")
    return p


def _hf_pattern(pre: Any, path: str | os.PathLike) -> str:
    """Recover our pattern from a HF pre-tokenizer (Split regex, or ByteLevel's built-in GPT-2 regex)."""
    items = pre.get("pretokenizers", []) if isinstance(pre, dict) and pre.get("type") == "Sequence" else [pre]
    for item in items:
        if isinstance(item, dict) and item.get("add_prefix_space"):
            raise ValueError(f"{path}: pre-tokenizers with add_prefix_space=true (RoBERTa style) are not supported; "
                             "lmforge would encode differently")
    for item in items:
        if isinstance(item, dict) and item.get("type") == "Split":
            regex_str = (item.get("pattern") or {}).get("Regex")
            if regex_str and item.get("behavior", "Isolated") == "Isolated" and not item.get("invert", False):
                return next((name for name, rx in PATTERNS.items() if rx == regex_str), regex_str)
        if isinstance(item, dict) and item.get("type") == "ByteLevel" and item.get("use_regex", True):
            return "gpt2"
    raise ValueError(f"{path}: unsupported pre_tokenizer {json.dumps(pre)[:200]}; lmforge reads byte-level BPE "
                     "with a Split regex or ByteLevel(use_regex=true)")


def load_hf(path: str | os.PathLike) -> Loaded:
    """Read a byte-level BPE ``tokenizer.json`` written by us or by HF (e.g. GPT-2's)."""
    obj = _read_json(path, "tokenizer.json")
    model = obj.get("model") if isinstance(obj, dict) else None
    if not isinstance(model, dict):
        hint = _describe_foreign(obj) if not (isinstance(obj, dict) and obj.get("format") == FORMAT_NAME) \
            else "it is an lmforge tokenizer file; use Tokenizer.load(path)"
        raise ValueError(f"{path} is not a Hugging Face tokenizer.json" + (f"; {hint}" if hint else ""))
    if model.get("type", "BPE") != "BPE":
        raise ValueError(f"{path} holds a {model.get('type')} model; lmforge reads byte-level BPE only")
    if obj.get("normalizer") is not None or model.get("ignore_merges"):
        raise ValueError(f"{path} uses a normalizer or ignore_merges=true, which lmforge's BPE does not implement; "
                         "its ids would differ")
    specials = {t["content"]: t["id"] for t in obj.get("added_tokens", []) if t.get("special", True)}
    vocab: Vocab = {}
    for s, i in model["vocab"].items():
        vocab[i] = s.encode("utf-8") if s in specials and specials[s] == i else _unmap(s, str(path))
    for s, i in specials.items():
        vocab[i] = s.encode("utf-8")
    merges = []
    for m in model.get("merges", []):
        a, b = m.split(" ") if isinstance(m, str) else m
        merges.append((_unmap(a, str(path)), _unmap(b, str(path))))
    pattern = _hf_pattern(obj.get("pre_tokenizer"), path)
    return vocab, merges, sorted(specials, key=specials.get), pattern


# --------------------------------------------------------------------------------------------------
# tiktoken
# --------------------------------------------------------------------------------------------------
def to_tiktoken(vocab: Mapping[int, bytes], special_tokens: Mapping[str, int], pattern: str,
                name: str = "lmforge") -> Any:
    """A ``tiktoken.Encoding`` with ranks = our ids.

    tiktoken stores no merges: in each pre-token it repeatedly joins the adjacent pair whose
    *concatenation* has the lowest rank, while merge-rank BPE joins only pairs that are in the
    merge list. The two agree when no token can be assembled from a pair that was never a merge --
    true for GPT-2's files and for the tokenizers lmforge trains on its test corpora (tested). A
    hand-made merge list can break it: with merges ``(b,c), (a,b), (ab,c)``, BPE encodes ``"abc"``
    as ``[a, bc]`` but tiktoken joins ``a+bc`` into ``abc``. :class:`Tokenizer` is always exact.
    """
    import tiktoken  # here: an optional dependency (pip install tiktoken)

    special_ids = set(special_tokens.values())
    ranks: dict[bytes, int] = {}
    for i in sorted(vocab):
        if i not in special_ids:
            ranks.setdefault(vocab[i], i)
    return tiktoken.Encoding(name=name, pat_str=resolve_pattern(pattern), mergeable_ranks=ranks,
                             special_tokens=dict(special_tokens))
