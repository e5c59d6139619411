"""BPE training, whole process: lmforge's CLI vs rustbpe vs HF ``tokenizers``, each a fresh interpreter per run.

Vocabulary 10,000, special token ``<|endoftext|>``, GPT-2 pattern, the same thread count for every tool. What
is timed is what a user waits for: the whole child process, from ``exec`` to exit (interpreter start, imports,
extension load, thread start, reading, pre-tokenization, merges, writing the result), measured by the parent,
after one untimed warm-up run per tool (bytecode cached as after a pip install, under the temp dir; files in
the page cache). CPU seconds (user + sys of the child, all threads) are printed too: on a shared machine they
move less than wall time.
lmforge runs its command line (``lmforge tokenizer train ... --out``, in-process through
``lmforge.cli.main`` so the child can report its peak RSS); rustbpe reads the file, trains on its documents and
writes its merges; HF trains from the file and saves ``tokenizer.json``. The tools run in turn (lmforge,
rustbpe, HF, lmforge, ...) for ``--reps`` rounds; each table gives median, range, MB/s, peak RSS (``VmHWM`` of
the child) and the ratio of medians. Before timing, lmforge's merges are checked against the pure-Python
reference on the first corpus (first ``--check-merges`` merges: the reference is too slow for all of them).

Corpora (``--corpora``, built once and cached under ``$LMFORGE_BENCH_CACHE`` or the temp dir):

* ``1`` / ``9.5`` / ``100``: Shakespeare (lmforge's built-in corpus, ~5 MB) cut or repeated to 1, 9.5 and 100
  MB -- 100 MB of it is *repetitive* text (few unique pre-tokens, counting dominates);
* ``100v``: 100 MB of *varied* text -- the Python sources and docs on this machine (standard library, then
  site-packages: ``.py .pyi .rst .md .txt``), sorted by path, one file per document, UTF-8 only, cycled if
  short. Deterministic for a given environment.

Same work for every tool: no tool learns merges across ``<|endoftext|>`` (lmforge splits on it, rustbpe gets the
documents between them, HF's pre-tokenizer removes it with a ``Split`` before its byte-level GPT-2 split). Each
peer's learned tokens (the bytes each merge creates, in merge order) are compared with lmforge's: the length
of the identical prefix and the overlap of the two sets (ties between equally frequent pairs are broken
differently by each tool, so the orders may part early while the vocabularies stay almost the same).

    python benchmarks/bench_tokenizer_train.py [--quick] [--corpora 1 9.5 100 100v] [--reps 5] [--threads N]

Targets (issue 18): lmforge >= 3x rustbpe on every corpus, >= 5x at 100 MB; peak RSS flat in corpus size.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import EOT, corpus_file, default_cache_dir, median, print_table, ratio  # noqa: E402

TOOLS = ("lmforge", "rustbpe", "hf")
DEFAULT_CORPORA = ["1", "9.5", "100", "100v"]

# Each child ends by printing one JSON line with its peak RSS (VmHWM: unlike ru_maxrss it does not survive
# exec, so the parent's size at fork time cannot leak in).
_RSS = ("import json as _j\nfor _l in open('/proc/self/status'):\n    if _l.startswith('VmHWM:'):\n"
        "        print(_j.dumps(dict(rss_mb=int(_l.split()[1]) / 1024)))\n")

_LMFORGE = """import sys
from lmforge.cli import main
rc = main(['-q', 'tokenizer', 'train', '--input', {path!r}, '--vocab-size', '{vocab}', '--special-token', {eot!r},
           '--threads', '{threads}', '--out', {out!r}, '--force'])
""" + _RSS + "sys.exit(rc)\n"

_RUSTBPE = """import json, rustbpe
pattern = {pattern!r}
eot = {eot!r}
with open({path!r}, encoding='utf-8') as f:
    docs = [d for d in f.read().split(eot) if d]
tok = rustbpe.Tokenizer()
tok.train_from_iterator(iter(docs), {vocab} - 1, pattern=pattern)
ranks = sorted(tok.get_mergeable_ranks(), key=lambda kv: kv[1])
with open({out!r}, 'w') as f:
    json.dump([bytes(b).hex() for b, rank in ranks if rank >= 256], f)
""" + _RSS

_HF = """import re
from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.Sequence([
    pre_tokenizers.Split(Regex(re.escape({eot!r})), behavior='removed'),
    pre_tokenizers.ByteLevel(add_prefix_space=False)])
trainer = trainers.BpeTrainer(vocab_size={vocab}, special_tokens=[{eot!r}], show_progress=False,
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
tok.train([{path!r}], trainer)
tok.save({out!r})
""" + _RSS


def run_tool(tool: str, path: Path, vocab: int, threads: int, out: Path) -> dict:
    """Run one tool in a fresh interpreter; wall seconds of the whole process and its peak RSS."""
    from lmforge.tokenizer.reference import PATTERNS

    code = {"lmforge": _LMFORGE, "rustbpe": _RUSTBPE, "hf": _HF}[tool].format(
        path=str(path), vocab=vocab, threads=threads, out=str(out), eot=EOT, pattern=PATTERNS["gpt2"])
    # RAYON_NUM_THREADS caps the Rust tools at the same thread count as lmforge's --threads. Bytecode is
    # cached (as after any pip install) but outside the repository; the untimed warm-up run fills the cache.
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="true",
               PYTHONPYCACHEPREFIX=str(Path(tempfile.gettempdir()) / "lmforge-bench-pycache"))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=3600)
    secs = time.perf_counter() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode != 0:
        raise RuntimeError(f"{tool} failed on {path}:\n{r.stderr[-3000:]}")
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    return {"seconds": secs, "cpu_seconds": cpu, **json.loads(r.stdout.strip().splitlines()[-1])}


def learned_tokens(tool: str, out: Path) -> list[str]:
    """The learned tokens (hex bytes, in merge order) from a tool's output file."""
    if tool == "lmforge":
        from lmforge.tokenizer import Tokenizer

        return [(a + b).hex() for a, b in Tokenizer.load(out).merges]
    if tool == "rustbpe":
        return json.loads(out.read_text())
    from tokenizers import Tokenizer as HFTokenizer

    return [_hf_bytes(a + b).hex() for a, b in _hf_merges(HFTokenizer.from_file(str(out)))]


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


def varied_corpus_file(mb: float, cache_dir: Path) -> Path:
    """``mb`` MB of varied text: this machine's Python sources and docs, one file per document (cached)."""
    from lmforge.common import atomic_open

    path = Path(cache_dir) / f"varied_{mb:g}MB.txt"
    if path.exists():
        return path
    roots = [Path(sysconfig.get_paths()["stdlib"]), Path(sysconfig.get_paths()["purelib"])]
    files = [f for root in roots for f in sorted(root.rglob("*"))
             if f.suffix in (".py", ".pyi", ".rst", ".md", ".txt") and f.is_file()]
    target, size = int(mb * 1e6), 0
    with atomic_open(path, "w") as out:
        while size < target:
            before = size
            for f in files:
                try:
                    text = f.read_text(encoding="utf-8")
                except (UnicodeDecodeError, OSError):
                    continue
                if not text.strip() or EOT in text:
                    continue
                out.write(text + EOT)
                size += len(text.encode()) + len(EOT)
                if size >= target:
                    break
            if size == before:
                raise SystemExit("no Python sources found to build the varied corpus")
    return path


def corpus_path(name: str, cache: Path, quick: bool) -> tuple[Path, str]:
    """The file for a ``--corpora`` name and its description."""
    varied = name.endswith("v")
    mb = float(name.rstrip("v"))
    if varied:
        return varied_corpus_file(mb, cache), "varied: Python sources and docs"
    source = "synthetic" if quick else "shakespeare"
    return corpus_file(mb, source, cache), ("repetitive: " if mb >= 20 else "") + source


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke test: 1 MB synthetic corpus, vocab 1000, 2 rounds")
    ap.add_argument("--corpora", nargs="+", default=DEFAULT_CORPORA,
                    help="sizes in MB; a 'v' suffix means varied text (default 1 9.5 100 100v)")
    ap.add_argument("--vocab", type=int, default=10_000)
    ap.add_argument("--reps", type=int, default=5, help="runs per tool; the median is reported")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--tools", nargs="+", default=list(TOOLS), choices=TOOLS)
    ap.add_argument("--check-merges", type=int, default=200, help="merges compared with the reference (0 = skip)")
    ap.add_argument("--cache-dir", type=Path, default=None, help="where corpora are cached (default: temp dir)")
    args = ap.parse_args()
    if args.quick:
        args.corpora, args.vocab, args.reps = ["1"], 1000, 2
        args.check_merges = min(args.check_merges, 50)
    cache = args.cache_dir or default_cache_dir()
    print(f"BPE training, whole process: vocab {args.vocab}, special {EOT}, gpt2 pattern, {args.threads} threads, "
          f"{args.reps} alternating rounds; python {sys.version.split()[0]}; cpus {os.cpu_count()}; "
          f"load average {os.getloadavg()[0]:.1f} at start")
    summary = []
    with tempfile.TemporaryDirectory() as tmp:
        for k, name in enumerate(args.corpora):
            path, what = corpus_path(name, cache, args.quick)
            size_mb = path.stat().st_size / 1e6
            if k == 0 and args.check_merges > 0:
                check_against_reference(path, args.vocab, args.check_merges, args.threads)
            tools = ["lmforge"] + [t for t in args.tools if t != "lmforge"]
            outs = {t: Path(tmp) / f"{t}_{k}.out" for t in tools}
            runs: dict[str, list[dict]] = {t: [] for t in tools}
            learned: dict[str, set[str]] = {t: set() for t in tools}
            for tool in tools:  # untimed warm-up: bytecode cache, page cache of the corpus and of the libraries
                run_tool(tool, path, args.vocab, args.threads, outs[tool])
            for _ in range(args.reps):  # the tools in turn, so background load falls on all alike
                for tool in tools:
                    runs[tool].append(run_tool(tool, path, args.vocab, args.threads, outs[tool]))
                    learned[tool].add(json.dumps(learned_tokens(tool, outs[tool])))
            if len(learned["lmforge"]) != 1:
                raise SystemExit("lmforge learned different merges in different runs")
            rows = [{"tool": t, "times": [r["seconds"] for r in runs[t]], "rss_mb": max(r["rss_mb"] for r in runs[t]),
                     "learned": json.loads(next(iter(learned[t])))} for t in tools]
            print_table(f"{size_mb:.1f} MB ({what}), load average {os.getloadavg()[0]:.1f} after", rows, size_mb)
            lm = rows[0]
            print("CPU seconds (user + sys, all threads; robust to a busy machine), median: " + ", ".join(
                f"{t} {median([r['cpu_seconds'] for r in runs[t]]):.3f}" for t in tools))
            for r in rows[1:]:
                print(f"- {r['tool']}: {ratio(r['times'], lm['times']):.2f}x lmforge's median time, "
                      f"RSS {r['rss_mb']:.0f} MB vs {lm['rss_mb']:.0f} MB; {len(r['learned'])} vs {len(lm['learned'])} "
                      f"merges; {agreement(lm['learned'], r['learned'])}")
                summary.append(f"{size_mb:.1f} MB {what.split(':')[0]}: {ratio(r['times'], lm['times']):.2f}x "
                               f"{r['tool']}")
    print("\nsummary (peer's median whole-process time / lmforge's): " + "; ".join(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
