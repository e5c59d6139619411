"""Encoding speed: lmforge ``Tokenizer`` vs tiktoken with the same vocabulary, side by side in one run.

Five workloads on the same text, each in a fresh child process that holds both tools:

1. ``string``  -- one big string, one thread (``encode``);
2. ``docs1``   -- the text as a batch of documents (the works, split at ``<|endoftext|>``) on 1 thread
   (``encode_batch``);
3. ``docs2``   -- the same batch on 2 threads;
4. ``paras1``  -- many small documents (paragraphs, like short web texts) on 1 thread;
5. ``paras2``  -- the same on 2 threads.

tiktoken runs each workload two ways and the ratio is taken against the faster: its batch API
(``encode_batch(num_threads=N)``; ``encode`` for the string) and a plain Python loop of
``encode_ordinary`` (for the string: over its ``<|endoftext|>``-separated pieces, with the special id
between them), which on many short texts at one thread beats ``encode_batch`` by avoiding its thread
pool. The three runs alternate (lmforge, tiktoken batch, tiktoken loop, lmforge, ...) for ``--reps``
rounds after one warm-up round; the table gives median, range and the ratio of medians.

The vocabulary is GPT-2's (``--vocab-json``/``--merges-txt``, default: the CS336 fixtures beside the
repo); ``--quick`` trains a small tokenizer on a synthetic corpus instead, so the smoke test needs no
files. The corpus is Shakespeare repeated to ``--mb`` MB. Token ids must be identical between lmforge
and both tiktoken ways (checked via a digest of every way's output). Target: lmforge >= 2x tiktoken.

    python benchmarks/bench_tokenizer_encode.py [--quick] [--mb 10] [--reps 5]
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (EOT, alternate, child_report, corpus_file, default_cache_dir, median, print_table,  # noqa: E402
                     run_child)

FIXTURES = Path(__file__).resolve().parents[2] / "shared/fixtures/cs336/fixtures"
WORKLOADS = {"string": 1, "docs1": 1, "docs2": 2, "paras1": 1, "paras2": 2}


def load_tokenizer(spec: str):
    """``gpt2:VOCAB_JSON:MERGES_TXT`` or ``lmforge:TOKENIZER_JSON``."""
    from lmforge.tokenizer import Tokenizer

    kind, *paths = spec.split("::")
    if kind == "gpt2":
        return Tokenizer.from_files(paths[0], paths[1], [EOT])
    return Tokenizer.load(paths[0])


def documents(text: str, workload: str) -> list[str]:
    """Whole documents (``docs*``: split at ``<|endoftext|>``) or paragraphs (``paras*``: many small ones)."""
    if workload.startswith("docs"):
        return [d for d in text.split(EOT) if d]
    return [p for doc in text.split(EOT) for p in doc.split("\n\n") if p]


def digest(ids_lists) -> str:
    import numpy as np

    h = hashlib.sha256()
    for ids in ids_lists:
        h.update(np.asarray(ids, dtype=np.uint32).tobytes())
    return h.hexdigest()[:16]


def encode_ways(spec: str, corpus: str, workload: str, reps: int) -> dict:
    """Child side: alternate lmforge and both tiktoken ways for ``reps`` rounds; times and id digests of each."""
    tok = load_tokenizer(spec)
    enc = tok.to_tiktoken()
    text = Path(corpus).read_text(encoding="utf-8")
    threads = WORKLOADS[workload]
    if workload == "string":
        pieces = text.split(EOT)
        eot = enc.encode_single_token(EOT)

        def tiktoken_loop() -> list[list[int]]:
            ids = enc.encode_ordinary(pieces[0])
            for piece in pieces[1:]:
                ids.append(eot)
                ids.extend(enc.encode_ordinary(piece))
            return [ids]

        fns = {"lmforge": lambda: [tok.encode(text)],
               "tiktoken encode": lambda: [enc.encode(text, allowed_special="all")],
               "tiktoken loop of encode_ordinary": tiktoken_loop}
    else:
        docs = documents(text, workload)
        fns = {"lmforge": lambda: tok.encode_batch(docs, num_threads=threads),
               "tiktoken encode_batch": lambda: enc.encode_batch(docs, num_threads=threads),
               "tiktoken loop of encode_ordinary": lambda: [enc.encode_ordinary(d) for d in docs]}
    out = {name: fn() for name, fn in fns.items()}  # the ids each way produces (also a warm-up)
    times = alternate(fns, reps, warmup=0)
    return {"times": times, "digests": {name: digest(ids) for name, ids in out.items()},
            "tokens": sum(len(x) for x in out["lmforge"])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke test: 0.5 MB synthetic text, small trained vocab, 1 run")
    ap.add_argument("--mb", type=float, default=10.0, help="corpus size in MB (default 10)")
    ap.add_argument("--reps", type=int, default=5, help="timed runs per tool and workload (median)")
    ap.add_argument("--vocab-json", type=Path, default=FIXTURES / "gpt2_vocab.json")
    ap.add_argument("--merges-txt", type=Path, default=FIXTURES / "gpt2_merges.txt")
    ap.add_argument("--cache-dir", type=Path, default=None, help="where corpora are cached (default: temp dir)")
    ap.add_argument("--child", nargs=4, metavar=("SPEC", "CORPUS", "WORKLOAD", "REPS"), help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.child:
        spec, corpus, workload, reps = args.child
        child_report(**encode_ways(spec, corpus, workload, int(reps)))
        return 0

    cache = args.cache_dir or default_cache_dir()
    if args.quick:
        from lmforge.tokenizer import train_bpe, Tokenizer

        path = corpus_file(0.5, "synthetic", cache)
        tok_path = Path(cache) / "quick_tokenizer.json"
        if not tok_path.exists():
            vocab, merges = train_bpe(path, 1000, [EOT], progress=False)
            Tokenizer(vocab, merges, [EOT]).save(tok_path, force=True)
        spec, reps, label = f"lmforge::{tok_path}", 2, "small trained vocab (quick)"
    else:
        if not args.vocab_json.exists() or not args.merges_txt.exists():
            raise SystemExit(f"GPT-2 vocab/merges not found ({args.vocab_json}); pass --vocab-json and --merges-txt")
        path = corpus_file(args.mb, "shakespeare", cache)
        spec, reps, label = f"gpt2::{args.vocab_json}::{args.merges_txt}", args.reps, "GPT-2 vocab"
    size_mb = path.stat().st_size / 1e6
    print(f"Encoding {size_mb:.1f} MB ({path.name}) with the {label}; {reps} alternating rounds, median (range)")
    summary = []
    for workload, threads in WORKLOADS.items():
        r = run_child(__file__, [spec, str(path), workload, str(reps)], threads)
        if len(set(r["digests"].values())) != 1:
            raise SystemExit(f"{workload}: token ids differ between lmforge and tiktoken: {r['digests']}")
        rows = [{"tool": name, "times": t} for name, t in r["times"].items()]
        best = min(rows[1:], key=lambda row: median(row["times"]))
        print_table(f"{workload} ({threads} thread{'s' if threads > 1 else ''}; {r['tokens']} tokens, "
                    "identical ids)", rows, size_mb)
        x = median(best["times"]) / median(r["times"]["lmforge"])
        print(f"faster tiktoken way: {best['tool']}; lmforge is {x:.2f}x it (ratio of medians)")
        summary.append((workload, best["tool"], x))
    print("\nsummary (lmforge vs the faster tiktoken way): "
          + "; ".join(f"{w} {x:.2f}x vs {t.removeprefix('tiktoken ')}" for w, t, x in summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
