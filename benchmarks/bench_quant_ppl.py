"""Perplexity cost of the decoder's weight precisions: a trained run's held-out perplexity with its matrices stored
as bfloat16, float16, int8 (a scale per row) and int4 (a scale per 32, llama.cpp's Q4_0 rounding), against float32;
int8 and int4 also with ``activations="int8"`` (rows ``+a8``: each product's input rounded to int8 per block of 32,
integer sums, llama.cpp's arithmetic).

Each precision is scored on the model the decoder computes with it (``Engine(model, weight_dtype=...).model``: the
float32 model whose matrices hold the rounded values, with ``+a8`` projections that compute the integer
arithmetic in PyTorch; embeddings and norms stay float32), over the first
``--limit`` blocks of the run's validation shards (``lmforge.evals.perplexity_of_shards``). Deterministic: no
timing, so a busy machine changes nothing but the wall time.

    lmforge speedrun --out runs/speedrun --no-chat          # a trained run (its shards hold a val split)
    python benchmarks/bench_quant_ppl.py --run runs/speedrun/run
    python benchmarks/bench_quant_ppl.py --quick            # a tiny run trained in seconds (a smoke run)
"""

from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import EOT, precision, synthetic_documents  # noqa: E402

DTYPES = ["float32", "bfloat16", "float16", "int8", "int4", "int8+a8", "int4+a8"]


def quick_run(root: Path) -> Path:
    """A tiny run trained for a few steps on synthetic text by ``lmforge speedrun`` (the smoke test's input)."""
    from lmforge.cli import main as cli

    corpus = root / "corpus.txt"
    corpus.write_text(EOT.join(synthetic_documents(100_000)), encoding="utf-8")
    argv = ["speedrun", "--corpus", str(corpus), "--out", str(root / "speedrun"), "--model-size", "tiny",
            "--budget", "10steps", "--no-chat", "--vocab-size", "300", "--device", "cpu", "--no-progress"]
    if cli(argv) != 0:
        raise SystemExit(f"bench_quant_ppl --quick: `lmforge {' '.join(argv)}` failed")
    return root / "speedrun" / "run"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", help="a trained run directory (its config names the shards)")
    p.add_argument("--data", help="shard directory to score (default: the run's data.dir)")
    p.add_argument("--limit", type=int, default=200, help="validation blocks to score (default 200)")
    p.add_argument("--quick", action="store_true", help="train a tiny run first (a smoke run)")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if a.quick:
            a.run, a.limit = str(quick_run(Path(tmp))), 20
        if not a.run:
            p.error("give --run (a trained run), or --quick")
        from lmforge.evals.perplexity import perplexity_of_shards
        from lmforge.generate import Generator
        from lmforge.generate.engine import Engine

        gen = Generator.from_run(a.run, device="cpu")
        data = a.data or yaml.safe_load((Path(a.run) / "config.yaml").read_text())["data"]["dir"]
        base = None
        print(f"\n### Held-out perplexity by weight precision ({Path(a.run).name}: d_model {gen.model.cfg.d_model}, "
              f"{gen.model.cfg.n_layers} layers, vocab {gen.model.cfg.vocab_size}), {datetime.date.today()}\n")
        print(f"{data}, first {a.limit} validation blocks of {gen.model.cfg.context_length} tokens\n")
        print("| weights | loss | perplexity | bits/byte | perplexity vs float32 |")
        print("|---|---:|---:|---:|---:|")
        for dtype in DTYPES:
            weights, activations = precision(dtype)
            model = Engine(gen.model, weight_dtype=weights, activations=activations).model
            r = perplexity_of_shards(model, gen.tokenizer, data, limit=a.limit)
            base = base or r
            bpb = f"{r['bpb']:.4f}" if r["bpb"] is not None else "-"
            print(f"| {dtype} | {r['loss']:.4f} | {r['ppl']:.3f} | {bpb} | {r['ppl'] / base['ppl'] - 1:+.2%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
