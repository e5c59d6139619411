"""Shared helpers for the benchmarks: corpora, child-process runs, alternating rounds, medians, tables.

Every tool runs in its own child process (``script --child TOOL ...``) so that its peak RSS is its
own and one tool's caches cannot help another. The child times only the work (not interpreter start
or imports) and prints one JSON line, which :func:`run_child` reads back.

Timings: lmforge and its peers run alternately (``a, b, a, b, ...``, :func:`alternate`) for several
rounds, so a shared machine's background load falls on both alike; every table gives the median, the
range (fastest..slowest) and the ratio of medians (:func:`spread`, :func:`ratio`).
"""

from __future__ import annotations

import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

EOT = "<|endoftext|>"


def default_cache_dir() -> Path:
    """Where built corpora are cached: ``$LMFORGE_BENCH_CACHE`` or a folder under the temp dir (never the repo)."""
    return Path(os.environ.get("LMFORGE_BENCH_CACHE") or Path(tempfile.gettempdir()) / "lmforge-bench")


def synthetic_documents(n_bytes: int, seed: int = 0) -> list[str]:
    """Deterministic English-like documents (no download): for --quick smoke runs."""
    rng = random.Random(seed)
    words = ("the a of and to in is was he she it that with for his her they said on at by but not "
             "king queen lord good sweet love death night day heaven heart eyes thou thee thy hath doth "
             "don't I'll we're 1 42 1600 naïve café").split()
    docs, size = [], 0
    while size < n_bytes:
        lines = []
        for _ in range(rng.randint(5, 40)):
            line = " ".join(rng.choice(words) for _ in range(rng.randint(3, 14)))
            lines.append(line.capitalize() + rng.choice([".", ",", "!", "?", ";"]))
        doc = "\n".join(lines)
        docs.append(doc)
        size += len(doc.encode()) + len(EOT)
    return docs


def shakespeare_documents() -> list[str]:
    """The works of Shakespeare (lmforge's built-in default corpus), one document per work."""
    from lmforge.corpus.datasets import get_dataset
    from lmforge.corpus.sources import iter_documents

    return list(iter_documents(get_dataset("shakespeare"), delimiter=EOT))


def corpus_file(mb: float, source: str, cache_dir: Path) -> Path:
    """A UTF-8 file of about ``mb`` MB: the source documents repeated and joined by ``<|endoftext|>``.

    Built once and cached (written atomically) under ``cache_dir``.
    """
    from lmforge.common import atomic_open

    path = Path(cache_dir) / f"{source}_{mb:g}MB.txt"
    if path.exists():
        return path
    docs = synthetic_documents(int(mb * 1e6)) if source == "synthetic" else shakespeare_documents()
    target = int(mb * 1e6)
    size = 0
    with atomic_open(path, "w") as f:
        while size < target:
            for d in docs:
                f.write(d + EOT)
                size += len(d.encode()) + len(EOT)
                if size >= target:
                    break
    return path


def iter_file_documents(path: Path, chunk: int = 1 << 20) -> Iterator[str]:
    """Stream the ``<|endoftext|>``-separated documents of a file (flat memory)."""
    rest = ""
    with open(path, encoding="utf-8") as f:
        while block := f.read(chunk):
            parts = (rest + block).split(EOT)
            rest = parts.pop()
            yield from (p for p in parts if p)
    if rest:
        yield rest


def peak_rss_mb() -> float:
    """Peak resident set size of this process in MB.

    Linux: ``VmHWM`` of /proc/self/status. Not ``ru_maxrss``, which survives ``execve`` and so would
    report the parent's peak when the parent was bigger at fork time.
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20 if sys.platform == "darwin" else 1024)


def read_bandwidth(mb: int = 256, repeats: int = 10) -> float:
    """Memory read bandwidth (bytes/s): best time to sum a float32 tensor much larger than the caches.

    The physical limit of batch-1 decoding, which reads every weight once per token (torch is imported here:
    the tokenizer benchmarks never need it).
    """
    import torch

    big = torch.ones(mb * 2**20 // 4)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        big.sum()
        best = min(best, time.perf_counter() - t0)
    return big.numel() * 4 / best


def child_report(**fields: Any) -> None:
    """Print the child's result line (adds its peak RSS)."""
    print(json.dumps({**fields, "rss_mb": peak_rss_mb()}), flush=True)


def run_child(script: str, args: Sequence[str], threads: int, timeout: float = 1800) -> dict[str, Any]:
    """Run ``script --child ...`` in a fresh interpreter and return its JSON result.

    ``RAYON_NUM_THREADS`` caps the Rust tools (rustbpe, HF tokenizers) at the same thread count.
    """
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="true")
    r = subprocess.run([sys.executable, script, "--child", *args], capture_output=True, text=True, env=env,
                       timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"child {args} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def median(xs: Sequence[float]) -> float:
    """The median of ``xs`` (the statistic every table reports)."""
    return statistics.median(xs)


def alternate(fns: dict[str, Callable[[], Any]], rounds: int, warmup: int = 1) -> dict[str, list[float]]:
    """Wall seconds of each of ``fns``, run in turn (``a, b, a, b, ...``) for ``rounds`` timed rounds.

    ``warmup`` untimed rounds come first (lazy imports, thread pools, caches), for every function alike.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def figure(x: float, fmt: str = ".3f") -> str:
    """``x`` formatted with ``fmt``, or to 3 significant digits where ``fmt`` would print a non-zero ``x`` as zero:
    a run faster than a table's rounding still prints what it measured (``0.0004`` s is ``0.0004``, not ``0.000``)."""
    text = f"{x:{fmt}}"
    if x != 0 and float(text.replace(",", "")) == 0:
        return f"{x:.3g}"
    return text


def spread(xs: Sequence[float], fmt: str = ".3f") -> str:
    """``median (min..max)`` of ``xs``, e.g. ``1.234 (1.200..1.300)``; each as :func:`figure` prints it."""
    return f"{figure(median(xs), fmt)} ({figure(min(xs), fmt)}..{figure(max(xs), fmt)})"


def ratio(peer: Sequence[float], ours: Sequence[float]) -> float:
    """How many times longer the peer's median time is than lmforge's (> 1: lmforge is faster)."""
    return median(peer) / median(ours)


def add_json_flag(parser: Any) -> None:
    """``--json PATH`` on an ``argparse`` parser: where :func:`write_json` puts the run's unrounded figures."""
    parser.add_argument("--json", type=Path, default=None, metavar="PATH",
                        help="also write the unrounded figures (every round's seconds, rates) to PATH as JSON")


def write_json(path: Path | None, figures: dict[str, Any]) -> None:
    """Write ``figures`` to ``path`` (``--json``) when given: what a table prints rounded, unrounded, for tests and
    tools that must not depend on the table's rounding (a fast machine's run can be shorter than it)."""
    if path is not None:
        Path(path).write_text(json.dumps(figures, indent=1) + "\n", encoding="utf-8")


def print_table(title: str, rows: list[dict[str, Any]], mb: float) -> None:
    """Markdown table: tool, median seconds (range), MB/s at the median, peak RSS, median time relative to lmforge.

    Each row has ``tool``, ``times`` (seconds of every round) and optionally ``rss_mb`` and ``note``.
    """
    base = next(r["times"] for r in rows if r["tool"] == "lmforge")
    print(f"\n### {title}\n")
    print("| tool | time (s): median (range) | MB/s (median) | peak RSS (MB) | time / lmforge |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        rss = f"{r['rss_mb']:.0f}" if r.get("rss_mb") is not None else "-"
        name = r["tool"] + (f" ({r['note']})" if r.get("note") else "")
        print(f"| {name} | {spread(r['times'])} | {mb / median(r['times']):.1f} | {rss} | "
              f"{ratio(r['times'], base):.2f}x |")
    sys.stdout.flush()


def precision(name: str) -> tuple[str, str]:
    """A benchmark row's precision as ``(weight_dtype, activations)`` for ``Engine``: ``"int4"`` is int4 weights with
    float32 activations, ``"int4+a8"`` the same weights with ``activations="int8"``."""
    weights, a8, _ = name.partition("+a8")
    return weights, "int8" if a8 else "float32"


def write_run(root: Path, tok: Any, cfg: Any) -> Path:
    """``root/run``: a run directory holding ``tok``, a config with ``cfg`` and one checkpoint of a ``TransformerLM``
    of ``cfg`` with random weights (seed 0), as training would leave it (for the export and llama.cpp benchmarks)."""
    import torch

    from lmforge.checkpoint import CheckpointManager
    from lmforge.config import dump_yaml
    from lmforge.model import TransformerLM
    from lmforge.run import mark
    from lmforge.train.config import DataConfig, RunConfig

    torch.manual_seed(0)
    run = root / "run"
    run.mkdir()
    tok.save(run / "tokenizer.json")
    dump_yaml(RunConfig(model=cfg, data=DataConfig(dir=str(root / "data"))), run / "config.yaml")
    CheckpointManager(run).save(TransformerLM(cfg), None, 1)
    mark(run)
    return run


def hf_twins(cfg: Any, device: str = "cpu", check_tokens: int = 32) -> tuple[Any, Any]:
    """``(ours, HF)``: lmforge's ``TransformerLM`` and a ``LlamaForCausalLM`` with the same weights (HF's seeded
    random init mapped through ``lmforge.interop.hf``), both in eval mode on ``device``; exits if their logits
    differ (the same-work check of the generation, chat and serving benchmarks)."""
    import torch
    from transformers import LlamaForCausalLM

    from lmforge.interop import hf
    from lmforge.model import TransformerLM

    torch.manual_seed(0)
    ref = LlamaForCausalLM(hf.hf_config(cfg)).eval()
    ref.generation_config.eos_token_id = None  # HF generates every asked token, as lmforge does
    ref.generation_config.pad_token_id = 0
    ours = TransformerLM(cfg).eval()
    ours.load_state_dict(hf.from_hf_state_dict(ref.state_dict(), cfg))
    ours.to(device)
    ref.to(device)
    idx = torch.randint(0, cfg.vocab_size, (2, check_tokens), device=device)
    with torch.inference_mode():
        diff = (ours(idx) - ref(idx).logits).abs().max().item()
    print(f"max |logits(lmforge) - logits(HF)| = {diff:.2e}")
    assert diff < 1e-3, "weight mapping broken: logits differ"
    return ours, ref
