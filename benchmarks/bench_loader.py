"""Loader speed and memory: ``BlockLoader`` / ``get_batch`` against a nanoGPT-style loader and a training step.

In one run, on synthetic shards of random uint16 tokens:

* batches/s of ``BlockLoader.next_batch`` (shuffled blocks, exact resume), of ``get_batch`` on one
  memmap, and of the nanoGPT recipe (re-open ``np.memmap`` every batch, ``torch.stack`` of
  ``torch.from_numpy`` slices) -- written here from its description, as the peer;
* the time of one training step (forward + backward of an ``lmforge.model.TransformerLM`` of the
  ``examples/shakespeare_cpu.yaml`` shape, the smallest, hence the hardest to outrun, of the example
  configs; same batch shape) and the ratio "loader batches per training step" (target >= 100);
* anonymous memory (RSS minus shared file pages) of the loader for two corpus sizes (target: the
  same; the memmapped tokens are page cache, not process memory).

Usage::

    python benchmarks/bench_loader.py [--quick] [--batch 16] [--context 256]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def make_shards(d: Path, n_tokens: int, vocab: int = 8192, shard_tokens: int = 1 << 25) -> Path:
    """A shard directory of random tokens (hand-built with the lmforge shard API)."""
    from lmforge.data import shards

    d.mkdir(parents=True)
    m = shards.new_manifest({"fingerprint": "bench" * 4, "vocab_size": vocab, "eot_id": None}, "uint16",
                            shard_tokens, None, None)
    rng = np.random.default_rng(0)
    done = 0
    while done < n_tokens:
        n = min(shard_tokens, n_tokens - done)
        name = shards.shard_name("train", len(m["shards"]))
        toks = rng.integers(0, vocab, n, dtype=np.uint16)
        sha = shards.write_shard(d / name, toks, np.arange(0, n, 1000), vocab, "bench" * 4)
        m["shards"].append({"name": name, "split": "train", "tokens": n, "documents": len(range(0, n, 1000)),
                            "sha256": sha})
        done += n
    m["splits"]["train"] = {"tokens": n_tokens, "documents": sum(s["documents"] for s in m["shards"]),
                            "shards": len(m["shards"]), "text_bytes": 0}
    m["sources"].append({"path": "random", "size": 0, "sha256": "0", "tokens": {"train": n_tokens}})
    shards.save_manifest(d, m)
    return d


def anon_mb() -> float:
    import psutil

    mi = psutil.Process().memory_info()
    return (mi.rss - mi.shared) / 2**20


def rate(fn, n: int) -> float:
    """Calls per second of ``fn`` over ``n`` calls (after 5 warm-up calls)."""
    for _ in range(5):
        fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return n / (time.perf_counter() - t0)


def nanogpt_style_batch(path: Path, batch: int, T: int) -> tuple:
    """The nanoGPT recipe: a fresh memmap per batch, random starts, stacked int64 slices."""
    import torch

    data = np.memmap(path, dtype=np.uint16, mode="r", offset=256)
    ix = torch.randint(len(data) - T, (batch,))
    x = torch.stack([torch.from_numpy(data[i:i + T].astype(np.int64)) for i in ix.tolist()])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + T].astype(np.int64)) for i in ix.tolist()])
    return x, y


def step_time(batch: int, T: int, vocab: int, d_model: int, n_layers: int, steps: int) -> float:
    import torch
    import torch.nn.functional as F

    from lmforge.model import ModelConfig, TransformerLM

    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(vocab_size=vocab, context_length=T, d_model=d_model, n_layers=n_layers,
                                      n_heads=8, tie_embeddings=True))
    x = torch.randint(vocab, (batch, T))
    y = torch.randint(vocab, (batch, T))

    def step() -> None:
        logits = model(x)
        F.cross_entropy(logits.view(-1, vocab), y.view(-1)).backward()

    step()  # warm-up
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - t0) / steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small corpora, few batches (smoke test)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=256)
    args = ap.parse_args()
    sizes = (2_000_000, 8_000_000) if args.quick else (50_000_000, 200_000_000)
    n_batches = 200 if args.quick else 2000
    B, T = args.batch, args.context

    import torch  # noqa: F401  (imported before the memory baseline: the loader imports it lazily)

    from lmforge.data import BlockLoader, TokenDataset, get_batch

    print(f"batch {B} x context {T}; pid {os.getpid()}")
    results = {}
    with tempfile.TemporaryDirectory(prefix="lmforge-bench-loader-") as tmp:
        for n_tokens in sizes:
            d = make_shards(Path(tmp) / f"c{n_tokens}", n_tokens)
            before = anon_mb()
            loader = BlockLoader(TokenDataset(d), B, T, seed=0)
            r_block = rate(loader.next_batch, n_batches)
            mem = anon_mb() - before
            ds = TokenDataset(d)
            r_get = rate(lambda: get_batch(ds.shards[0], B, T), n_batches)
            r_nano = rate(lambda: nanogpt_style_batch(d / ds.shard_names[0], B, T), n_batches)
            results[n_tokens] = (r_block, r_get, r_nano, mem)
            print(f"  corpus {n_tokens / 1e6:6.0f}M tokens: BlockLoader {r_block:8.0f} batches/s, get_batch "
                  f"{r_get:8.0f}/s, nanoGPT-style {r_nano:8.0f}/s; loader anonymous memory +{mem:.1f} MiB")
    t_step = step_time(B, T, 2048, 256, 4, 2 if args.quick else 5)
    r_block, r_get, r_nano, _ = results[sizes[-1]]
    print(f"training step (examples/shakespeare_cpu.yaml shape: d_model 256, 4 layers, vocab 2048, forward+backward): "
          f"{t_step * 1e3:.0f} ms")
    print(f"BlockLoader batches per training step: {r_block * t_step:,.0f}x  (target >= 100x)")
    print(f"BlockLoader vs nanoGPT-style loader: {r_block / r_nano:.2f}x; get_batch vs nanoGPT-style: "
          f"{r_get / r_nano:.2f}x")
    m0, m1 = results[sizes[0]][3], results[sizes[-1]][3]
    print(f"loader memory, {sizes[0] / 1e6:.0f}M vs {sizes[-1] / 1e6:.0f}M tokens: +{m0:.1f} vs +{m1:.1f} MiB "
          "(the shuffled order is computed, not stored; the tokens stay on disk as page cache)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
