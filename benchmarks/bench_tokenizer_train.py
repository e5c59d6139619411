"""BPE training speed and memory: lmforge vs rustbpe vs HF ``tokenizers``, side by side in one run.

Vocabulary 10,000, special token ``<|endoftext|>``, GPT-2 pattern, all cores for every tool. The
corpora are Shakespeare (lmforge's default corpus) repeated to ~10 MB and ~100 MB, documents joined
by ``<|endoftext|>``; each training runs in a fresh child process, the tools in turn (lmforge, rustbpe,
HF, lmforge, ...) for ``--reps`` rounds; the table gives median, range and peak RSS. lmforge goes through
the user-facing ``lmforge.tokenizer.train_bpe(path)``. Before timing, lmforge's merges are checked
against the pure-Python reference on the smallest corpus (first ``--check-merges`` merges: the
reference is too slow for all of them; merges are a prefix).

Same work for every tool: no tool learns merges across ``<|endoftext|>`` (lmforge splits on it,
rustbpe gets the documents between them, HF's pre-tokenizer removes it with a ``Split`` before its
byte-level GPT-2 split). Each peer's learned tokens (the bytes each merge creates, in merge order)
are compared with lmforge's: the length of the identical prefix and the overlap of the two sets.
Ties between equally frequent pairs are broken differently by each tool, so the orders may part
early while the vocabularies stay almost the same.

    python benchmarks/bench_tokenizer_train.py [--quick] [--sizes 10 100] [--reps 3] [--threads N]

Target: lmforge >= 3x faster than rustbpe, peak RSS <= HF tokenizers'.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (EOT, child_report, corpus_file, default_cache_dir, iter_file_documents, median,  # noqa: E402
                     print_table, ratio, run_child)

TOOLS = ("lmforge", "rustbpe", "hf")


def train_once(tool: str, path: str, vocab_size: int, threads: int) -> dict:
    """Child side: train with one tool; seconds and the learned tokens (hex bytes, in merge order)."""
    if tool == "lmforge":
        import tempfile

        from lmforge.tokenizer import train_bpe

        with tempfile.TemporaryDirectory() as tmp:  # warm-up: lazy imports (tqdm, ...) are not the work
            (Path(tmp) / "w.txt").write_text("warm up " * 100)
            train_bpe(Path(tmp) / "w.txt", 300, [EOT], num_threads=threads, progress=False)
        t0 = time.perf_counter()
        _, merges = train_bpe(path, vocab_size, [EOT], num_threads=threads, progress=False)
        secs = time.perf_counter() - t0
        return {"seconds": secs, "learned": [(a + b).hex() for a, b in merges]}
    if tool == "rustbpe":
        import rustbpe

        from lmforge.tokenizer.reference import PATTERNS

        tok = rustbpe.Tokenizer()
        t0 = time.perf_counter()
        # rustbpe has no special tokens: feed it the documents (the same text lmforge counts).
        tok.train_from_iterator(iter_file_documents(Path(path)), vocab_size - 1, pattern=PATTERNS["gpt2"])
        secs = time.perf_counter() - t0
        ranks = sorted(tok.get_mergeable_ranks(), key=lambda kv: kv[1])
        return {"seconds": secs, "learned": [bytes(b).hex() for b, rank in ranks if rank >= 256]}
    if tool == "hf":
        from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        # Split removes <|endoftext|> before the GPT-2 byte-level split, as lmforge and rustbpe do.
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(re.escape(EOT)), behavior="removed"),
            pre_tokenizers.ByteLevel(add_prefix_space=False)])
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        t0 = time.perf_counter()
        tok.train([path], trainer)
        secs = time.perf_counter() - t0
        return {"seconds": secs, "learned": [_hf_bytes(a + b).hex() for a, b in _hf_merges(tok)]}
    raise ValueError(f"unknown tool {tool!r}")


def _hf_merges(tok) -> list[tuple[str, str]]:
    """The merges of an HF ``tokenizers`` BPE model, in order (either JSON form: ``"a b"`` or ``["a", "b"]``)."""
    merges = json.loads(tok.to_str())["model"]["merges"]
    return [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in merges]


def _hf_bytes(token: str) -> bytes:
    """Bytes of a GPT-2 byte-level token string (each byte is shown as one printable character)."""
    from lmforge.tokenizer.reference import unicode_to_bytes

    decode = unicode_to_bytes()
    return bytes(decode[c] for c in token)


def agreement(ours: list[str], peer: list[str]) -> str:
    """How far a peer's learned tokens agree with lmforge's: identical prefix and set overlap."""
    prefix = next((i for i, (a, b) in enumerate(zip(ours, peer)) if a != b), min(len(ours), len(peer)))
    common = len(set(ours) & set(peer))
    return (f"same first {prefix} merges; vocabulary overlap {common}/{len(ours)} "
            f"({100 * common / max(len(ours), 1):.2f}%)")


def check_against_reference(path: Path, vocab_size: int, n_check: int, threads: int) -> None:
    """lmforge's first merges == lmforge.tokenizer.reference reference (pure Python) on the same file."""
    from lmforge.tokenizer import reference as bpe
    from lmforge.tokenizer import train_bpe

    _, merges = train_bpe(path, vocab_size, [EOT], num_threads=threads, progress=False)
    text = path.read_text(encoding="utf-8")
    t0 = time.perf_counter()
    counts = bpe.count_pretokens([text], [EOT], "gpt2")
    ref = bpe.learn_merges(counts, min(n_check, len(merges)))
    if merges[:len(ref)] != ref:
        k = next(i for i, (a, b) in enumerate(zip(merges, ref)) if a != b)
        raise SystemExit(f"MISMATCH with the Python reference at merge {k}: {merges[k]} vs {ref[k]}")
    print(f"merges identical to the Python reference (first {len(ref)} of {len(merges)}; "
          f"reference took {time.perf_counter() - t0:.1f}s)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke test: 1 MB synthetic corpus, vocab 1000, 2 rounds")
    ap.add_argument("--sizes", type=float, nargs="+", default=[10, 100], help="corpus sizes in MB (default 10 100)")
    ap.add_argument("--vocab", type=int, default=10_000)
    ap.add_argument("--reps", type=int, default=3, help="runs per tool; the median is reported")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--source", choices=["shakespeare", "synthetic"], default=None)
    ap.add_argument("--tools", nargs="+", default=list(TOOLS), choices=TOOLS)
    ap.add_argument("--check-merges", type=int, default=200, help="merges compared with the reference (0 = skip)")
    ap.add_argument("--cache-dir", type=Path, default=None, help="where corpora are cached (default: temp dir)")
    ap.add_argument("--child", nargs=4, metavar=("TOOL", "PATH", "VOCAB", "THREADS"), help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.child:
        tool, path, vocab, threads = args.child
        child_report(**train_once(tool, path, int(vocab), int(threads)))
        return 0

    if args.quick:
        args.sizes, args.vocab, args.reps = [1.0], 1000, 2
        args.check_merges = min(args.check_merges, 50)
    source = args.source or ("synthetic" if args.quick else "shakespeare")
    cache = args.cache_dir or default_cache_dir()
    print(f"BPE training: vocab {args.vocab}, special {EOT}, gpt2 pattern, {args.threads} threads, "
          f"{source} corpus, median of {args.reps}")
    for k, mb in enumerate(args.sizes):
        path = corpus_file(mb, source, cache)
        size_mb = path.stat().st_size / 1e6
        if k == 0 and args.check_merges > 0:
            check_against_reference(path, args.vocab, args.check_merges, args.threads)
        tools = ["lmforge"] + [t for t in args.tools if t != "lmforge"]
        runs: dict[str, list[dict]] = {t: [] for t in tools}
        for _ in range(args.reps):  # the tools in turn, so background load falls on all alike
            for tool in tools:
                runs[tool].append(run_child(__file__, [tool, str(path), str(args.vocab), str(args.threads)],
                                            args.threads))
        if len({json.dumps(r["learned"]) for r in runs["lmforge"]}) != 1:
            raise SystemExit("lmforge learned different merges in different runs")
        rows = [{"tool": t, "times": [r["seconds"] for r in runs[t]], "rss_mb": max(r["rss_mb"] for r in runs[t]),
                 "learned": runs[t][0]["learned"]} for t in tools]
        print_table(f"{size_mb:.1f} MB", rows, size_mb)
        lm = rows[0]
        for r in rows[1:]:
            print(f"- {r['tool']}: {ratio(r['times'], lm['times']):.2f}x lmforge's median time, "
                  f"RSS {r['rss_mb']:.0f} MB vs {lm['rss_mb']:.0f} MB; {len(r['learned'])} vs {len(lm['learned'])} "
                  f"merges; {agreement(lm['learned'], r['learned'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
