"""``lmforge data prepare`` throughput against the tokenizer alone and against HF ``tokenizers`` + numpy writes.

Three ways to turn the same corpus into a uint16 token file, timed in one run on the same machine:

1. ``tokenizer``  -- the lmforge tokenizer's ``encode_batch`` (lists; the issue's yardstick) and
                     ``encode_batch_flat`` (one numpy array) on documents already in memory as ``str``,
                     in prepare's batch size (the floor);
2. ``prepare``    -- ``lmforge.data.prepare`` end to end: hash the file, read it in chunks, split + strip +
                     validate the documents and tokenize their bytes in place (C++ ``split_documents`` +
                     ``encode_spans``), add EOT, write shards and the manifest (target: within 10% of 1.);
3. ``hf``         -- HF ``tokenizers`` ``encode_batch`` of the same vocabulary (``Tokenizer.save_hf``) on
                     documents in memory + numpy concatenation + file write (target: slower than 2.).

The corpus is Shakespeare (``lmforge data get shakespeare``; one document per paragraph, like web
text) repeated to ``--mb`` megabytes, or ``--corpus FILE``. The four run in turn for ``--repeat`` rounds after
one untimed warm-up round of each (which also checks that they produce the same number of tokens); each is
reported by its median and its range. Usage::

    python benchmarks/bench_data_prepare.py [--quick] [--mb 20] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import EOT, alternate, median, spread  # noqa: E402


def build_corpus(tmp: Path, mb: float, corpus: str | None) -> Path:
    from lmforge.corpus.datasets import get_dataset
    from lmforge.corpus.sources import iter_documents

    src = Path(corpus) if corpus else get_dataset("shakespeare")[0]
    paragraphs = list(iter_documents(src, delimiter="blankline" if not corpus else "<|endoftext|>"))
    text = f"\n{EOT}\n".join(paragraphs)
    reps = max(1, int(mb * 1e6 / len(text.encode())) + 1)
    out = tmp / "corpus.txt"
    with open(out, "w", encoding="utf-8") as f:
        for _ in range(reps):
            f.write(text + f"\n{EOT}\n")
    size = out.stat().st_size
    with open(out, "r+b") as f:  # trim to the requested size at a document boundary
        f.seek(min(size, int(mb * 1e6)))
        rest = f.read()
        cut = rest.find(EOT.encode())
        if cut >= 0:
            f.truncate(min(size, int(mb * 1e6)) + cut)
    return out


def peak_rss_mb(tok_path: Path, inputs: list[Path], out: Path, threads: int) -> float:
    """Peak resident memory (MiB) of ``prepare`` run in a fresh child process (``_common.peak_rss_mb``)."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from _common import peak_rss_mb; "
            "from lmforge.data import prepare; from lmforge.tokenizer import Tokenizer; "
            "prepare(Tokenizer.load(sys.argv[2]), sys.argv[5:], sys.argv[3], num_threads=int(sys.argv[4]), "
            "progress=False); print(peak_rss_mb())")
    res = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent), str(tok_path), str(out), str(threads),
                          *map(str, inputs)], capture_output=True, text=True, check=True)
    return float(res.stdout.split()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 MB smoke test")
    ap.add_argument("--mb", type=float, default=20.0, help="corpus size in MB (default 20)")
    ap.add_argument("--corpus", help="a text file with <|endoftext|>-separated documents instead of Shakespeare")
    ap.add_argument("--vocab", type=int, default=4096, help="tokenizer vocabulary size (default 4096)")
    ap.add_argument("--threads", type=int, default=None, help="threads (default: all cores)")
    ap.add_argument("--repeat", type=int, default=3, help="timed rounds of all four, after a warm-up (default 3)")
    args = ap.parse_args()
    if args.quick:
        args.mb, args.repeat = 2.0, 2

    import tokenizers

    from lmforge.common import num_threads_default
    from lmforge.data.pipeline import BATCH_BYTES, prepare
    from lmforge.corpus.sources import iter_documents
    from lmforge.tokenizer import Tokenizer, train_bpe

    threads = args.threads or num_threads_default()
    with tempfile.TemporaryDirectory(prefix="lmforge-bench-prepare-") as tmp_s:
        tmp = Path(tmp_s)
        corpus = build_corpus(tmp, args.mb, args.corpus)
        mb = corpus.stat().st_size / 1e6
        vocab, merges = train_bpe(corpus, args.vocab, [EOT], progress=False)
        tok = Tokenizer(vocab, merges, [EOT])
        hf_path = tok.save_hf(tmp / "hf.json")
        hf = tokenizers.Tokenizer.from_file(str(hf_path))
        docs = list(iter_documents(corpus))
        batches, cur, size = [], [], 0  # the same document batches prepare uses
        for d in docs:
            cur.append(d)
            size += len(d)
            if size >= BATCH_BYTES:
                batches.append(cur)
                cur, size = [], 0
        batches.append(cur)
        print(f"corpus: {mb:.1f} MB, {len(docs):,} documents, {len(batches)} batches; vocab {tok.vocab_size}; "
              f"{threads} threads; pid {os.getpid()}")

        # 1. the tokenizer alone (documents already in memory), 2. lmforge prepare, end to end from the file,
        # 3. HF tokenizers encode_batch + numpy + write: in turn, after a warm-up round of each.
        os.environ["RAYON_NUM_THREADS"] = str(threads)
        eot = np.array([tok.eot_id], dtype=np.uint16)

        def run_tok() -> int:
            return sum(len(ids) for b in batches for ids in tok.encode_batch(b, num_threads=threads))

        def run_flat() -> int:
            return sum(len(tok.encode_batch_flat(b, num_threads=threads)[0]) for b in batches)

        def run_prepare() -> int:
            m = prepare(tok, corpus, tmp / "shards", num_threads=threads, progress=False, force=True)
            return m["splits"]["train"]["tokens"]

        def run_hf() -> int:
            with open(tmp / "hf.bin", "wb") as f:
                for b in batches:
                    encs = hf.encode_batch(b, add_special_tokens=False)
                    arr = np.concatenate([x for e in encs for x in (np.asarray(e.ids, dtype=np.uint16), eot)])
                    f.write(arr.tobytes())
            return (tmp / "hf.bin").stat().st_size // 2

        n_tok = run_tok()
        counts = {"encode_batch_flat": run_flat(), "prepare": run_prepare() - len(docs),
                  "HF tokenizers": run_hf() - len(docs)}
        wrong = {k: v for k, v in counts.items() if v != n_tok}
        if wrong:
            raise SystemExit(f"not the same work: encode_batch gives {n_tok:,} tokens, but {wrong}")
        cpu: dict[str, list[float]] = {"flat": [], "prepare": []}

        def cpu_timed(name: str, fn):
            def run() -> None:
                c0 = time.process_time()
                fn()
                cpu[name].append(time.process_time() - c0)
            return run

        times = alternate({"tok": run_tok, "flat": cpu_timed("flat", run_flat),
                           "prepare": cpu_timed("prepare", run_prepare), "hf": run_hf}, args.repeat, warmup=0)
        c_flat, c_prep = median(cpu["flat"]), median(cpu["prepare"])

        # 4. peak memory of prepare in a fresh process, for the corpus and for 4 copies of it
        peaks = {}
        if not args.quick:
            tok.save(tmp / "tok.json")
            for copies in (1, 4):
                inputs = [corpus] + [tmp / f"copy{i}.txt" for i in range(1, copies)]
                for p in inputs[1:]:
                    p.write_bytes(corpus.read_bytes() + f"{p.name}{EOT}".encode())  # distinct content
                peaks[copies] = peak_rss_mb(tmp / "tok.json", inputs, tmp / f"mem{copies}", threads)

    rows = [("tokenizer encode_batch (in memory)", "tok"), ("tokenizer encode_batch_flat (in memory)", "flat"),
            ("lmforge prepare (file -> shards)", "prepare"), ("HF tokenizers encode_batch + numpy write", "hf")]
    print(f"{args.repeat} alternating rounds after a warm-up; identical token counts ({n_tok:,} + {len(docs):,} EOT)")
    print(f"  {'':<42} {'seconds: median (range)':>26} {'MB/s':>7} {'M tok/s':>8}")
    for name, key in rows:
        t = median(times[key])
        print(f"  {name:<42} {spread(times[key], '.2f'):>26} {mb / t:7.2f} {n_tok / t / 1e6:8.2f}")
    t_tok, t_flat, t_prep, t_hf = (median(times[k]) for k in ("tok", "flat", "prepare", "hf"))
    print(f"prepare glue overhead vs the tokenizer alone (medians): {100 * (t_prep / t_tok - 1):+.1f}% vs encode_batch, "
          f"{100 * (t_prep / t_flat - 1):+.1f}% vs encode_batch_flat  (target <= +10%)")
    print(f"CPU time (all threads, median; robust to a busy machine): encode_batch_flat {c_flat:.2f} s, prepare "
          f"{c_prep:.2f} s -> glue {100 * (c_prep / c_flat - 1):+.1f}% CPU")
    if peaks:
        print(f"prepare peak RSS (fresh process): {peaks[1]:.0f} MiB for {mb:.0f} MB of text, {peaks[4]:.0f} MiB for "
              f"{4 * mb:.0f} MB (bounded: tokens fill one shard buffer per split, at most 128 MiB of uint16, "
              "then it is written out; plus a few 4 MiB read chunks)")
    print(f"prepare speed-up over HF tokenizers + numpy (warmed, ratio of medians): {t_hf / t_prep:.2f}x  "
          "(target > 1)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
