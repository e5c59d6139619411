"""``lmforge tokenizer train | encode | decode | stats``."""

from __future__ import annotations

import argparse
import io
import itertools
import json
import sys
from pathlib import Path
from typing import Iterator, TextIO

from lmforge.cli import Command
from lmforge.common import check_input_file, check_output_path
from lmforge.tokenizer import EOT, load_tokenizer, text_stats, train_bpe
from lmforge.tokenizer import reference as bpe
from lmforge.tokenizer.formats import save_lmforge
from lmforge.tokenizer.tokenizer import fingerprint

_TOKENIZER_HELP = "tokenizer: an lmforge .json file, a HF tokenizer.json, or a directory with vocab.json + merges.txt"


def _train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", nargs="+", required=True, metavar="PATH",
                   help="files, directories or quoted globs: .txt, .jsonl, .parquet (+ .gz / .zst), read as by "
                        "`data prepare`")
    p.add_argument("--vocab-size", type=int, required=True, metavar="N",
                   help="total ids: 256 bytes + specials + merges; if the corpus runs out of pairs first, a warning "
                        "names the size reached and the smaller tokenizer is written")
    p.add_argument("--special-token", action="append", default=[], metavar="S", dest="special_tokens",
                   help=f"special token, e.g. '{EOT}' (repeatable; never merged, splits documents)")
    p.add_argument("--text-field", metavar="KEY", help="JSON key / Parquet column with the text (default: text)")
    p.add_argument("--delimiter", default=EOT,
                   help="document separator in text files: a string (never counted), 'blankline' or 'line' "
                        f"(default {EOT})")
    p.add_argument("--pattern", default="gpt2", help="pre-tokenizer: gpt2, gpt4, cl100k, nanochat or a regex (default gpt2)")
    p.add_argument("--out", required=True, metavar="PATH", help="where to write the tokenizer (lmforge JSON)")
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    p.add_argument("--errors", "--utf8-errors", choices=["strict", "replace"], default="strict", dest="errors",
                   help="invalid UTF-8: stop with its byte offset (strict) or read it as U+FFFD (replace)")
    p.add_argument("--threads", type=int, default=None, metavar="N", help="worker threads (default: all cores)")


def _train(args: argparse.Namespace) -> int:
    check_output_path(args.out, args.force)  # fail before the work, not after
    vocab, merges = train_bpe(args.input, args.vocab_size, args.special_tokens, pattern=args.pattern,
                              num_threads=args.threads, errors=args.errors, progress=not args.quiet,
                              text_field=args.text_field, delimiter=args.delimiter)
    # Only saved, never used to encode: written straight from the trainer's output, which is consistent by
    # construction, without a Tokenizer (its checks and lookup tables cost ~9 ms at vocab 10k). The file and the
    # fingerprint are Tokenizer(vocab, merges, specials).save(...) and .fingerprint()'s (a test holds them).
    special_ids = bpe.special_ids(vocab, args.special_tokens)
    save_lmforge(args.out, vocab, merges, special_ids, args.pattern, force=args.force)
    print(f"wrote {args.out}: vocab_size={len(vocab)} merges={len(merges)} "
          f"fingerprint={fingerprint(vocab, merges, special_ids, args.pattern)}", file=sys.stderr)
    return 0


def _io_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokenizer", required=True, metavar="T", help=_TOKENIZER_HELP)
    p.add_argument("file", nargs="?", default="-", metavar="FILE", help="input file, or - for stdin (default)")


class _text_input:  # noqa: N801 - used like a function: `with _text_input(path) as f:`
    """A UTF-8 text stream for FILE or ``-`` (stdin), newlines untouched whatever the locale says."""

    def __init__(self, path: str):
        self.path, self.file, self.wrapper = path, None, None

    def __enter__(self) -> TextIO:
        if self.path != "-":
            self.file = open(check_input_file(self.path), encoding="utf-8", newline="")
            return self.file
        buf = getattr(sys.stdin, "buffer", None)
        if buf is None:  # stdin replaced by a text-only stream (e.g. in tests)
            return sys.stdin
        self.wrapper = io.TextIOWrapper(buf, encoding="utf-8", newline="")
        return self.wrapper

    def __exit__(self, *exc: object) -> None:
        if self.file is not None:
            self.file.close()
        if self.wrapper is not None:
            self.wrapper.detach()  # leave sys.stdin itself open


def _encode_args(p: argparse.ArgumentParser) -> None:
    _io_args(p)
    p.add_argument("--format", choices=["ids", "json", "tokens"], default="ids",
                   help="ids: space-separated on one line (default); json: a JSON list; "
                        "tokens: a JSON list of the token texts, to see how the text was split")
    p.add_argument("--special", choices=["allowed", "disallowed", "plain"], default="allowed",
                   help="special tokens in the text: emit their ids, refuse them, or encode as plain text")


def _encode(args: argparse.Namespace) -> int:
    tok = load_tokenizer(args.tokenizer)
    try:
        with _text_input(args.file) as f:
            ids = tok.encode_iterable(f, special=args.special)
            if args.format == "tokens":  # bytes that are not whole characters show as \xNN
                _write_ids((json.dumps(tok.vocab[i].decode("utf-8", "backslashreplace"), ensure_ascii=False)
                            for i in ids), "json")
            else:
                _write_ids(ids, args.format)
    except UnicodeDecodeError as e:
        raise ValueError(f"input {args.file} is not valid UTF-8 ({e.reason} at byte {e.start} of a read block); "
                         "fix or re-encode the file") from None
    return 0


def _write_ids(ids: Iterator[int | str], fmt: str) -> None:
    """Stream ids (or JSON-quoted tokens) to stdout: space-separated on one line, or as one JSON list."""
    sep = ", " if fmt == "json" else " "
    sys.stdout.write("[" if fmt == "json" else "")
    first = True
    while batch := list(itertools.islice(ids, 8192)):
        sys.stdout.write(("" if first else sep) + sep.join(map(str, batch)))
        first = False
    sys.stdout.write("]\n" if fmt == "json" else "\n")


def _decode(args: argparse.Namespace) -> int:
    tok = load_tokenizer(args.tokenizer)
    with _text_input(args.file) as f:
        text = f.read()
    try:
        ids = json.loads(text) if text.lstrip().startswith("[") else [int(x) for x in text.split()]
    except (ValueError, json.JSONDecodeError):
        raise ValueError(f"input {args.file} must hold integer ids separated by spaces, or a JSON list") from None
    if not all(isinstance(i, int) for i in ids):
        raise ValueError(f"input {args.file}: the JSON list must hold integer ids only")
    sys.stdout.write(tok.decode(ids))
    return 0


def _show(tok: bytes) -> str:
    """A token for display: its text quoted, or a bytes literal when it is not whole UTF-8 characters."""
    try:
        return repr(tok.decode("utf-8"))
    except UnicodeDecodeError:
        return repr(tok)


def _stats_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokenizer", required=True, metavar="A", help=_TOKENIZER_HELP)
    p.add_argument("--compare", metavar="B", help="a second tokenizer to compare side by side (same forms as --tokenizer)")
    p.add_argument("files", nargs="+", metavar="FILE", help="UTF-8 text files to measure on")


def _stats(args: argparse.Namespace) -> int:
    names = [args.tokenizer] + ([args.compare] if args.compare else [])
    toks = [load_tokenizer(n) for n in names]
    labels = [Path(n).name or n for n in names]
    for path in args.files:
        try:
            text = check_input_file(path).read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{path} is not valid UTF-8 (byte offset {e.start}); fix or re-encode the file") from None
        stats = [text_stats(t, text) for t in toks]
        print(f"{path}: {stats[0]['bytes']} bytes, {stats[0]['words']} words")
        rows = [("vocab size", [str(t.vocab_size) for t in toks]),
                ("tokens", [str(s["tokens"]) for s in stats]),
                ("bytes / token", [f"{s['bytes_per_token']:.3f}" for s in stats]),
                ("tokens / word", [f"{s['tokens_per_word']:.3f}" for s in stats]),
                ("vocab used", [f"{100 * s['vocab_used']:.1f}%" for s in stats]),
                ("longest tokens", [" ".join(_show(x) for x in s["longest"][:3]) for s in stats])]
        width = max(24, *(len(c) for _, cells in rows for c in cells[:-1] or [""]))
        print(f"  {'':<16}" + "".join(f"{lab[:width]:<{width + 2}}" for lab in labels))
        for name, cells in rows:
            print(f"  {name:<16}" + "".join(f"{c:<{width + 2}}" for c in cells))
        if len(stats) == 2 and stats[1]["tokens"]:
            print(f"  {labels[0]} uses {stats[0]['tokens'] / stats[1]['tokens']:.3f}x the tokens of {labels[1]}")
    return 0


SUBCOMMANDS: list[Command] = [
    ("train", "train a byte-level BPE tokenizer on text files", _train_args, _train),
    ("encode", "encode text to token ids", _encode_args, _encode),
    ("decode", "decode token ids back to text", _io_args, _decode),
    ("stats", "compression statistics (bytes/token, tokens/word, vocab usage), optionally side by side",
     _stats_args, _stats),
]
