"""Muon vs AdamW at equal wall time: validation bits per byte reached, step time, optimizer-state bytes.

Both sides train the same ``TransformerLM`` from the same seed on the same shards (``lmforge data prepare``
output: Shakespeare, lmforge's built-in corpus, or a synthetic corpus with ``--quick``), reading batches with
the same ``BlockLoader`` and evaluating with the same fixed validation batches (``lmforge.train.evaluate``).
Each side trains for ``--seconds`` of wall time (forward, backward, clip, step; evaluation and the first,
warm-up step excluded) with
linear warmup and then a constant learning rate, since the number of steps is not known in advance. Each
(optimizer, round) runs in its own child process; the rounds alternate (adamw, muon, adamw, muon, ...) so a
shared machine's load falls on both alike. Reported per optimizer: median (range) over rounds.

A second table times the optimizer step alone on the same model with fixed gradients, interleaved in one
process: lmforge AdamW, lmforge Muon (batched and reference), and ``torch.optim.Muon`` + ``torch.optim.AdamW``
on the same groups (the equal-update test is ``tests/train/test_optim.py::test_muon_reference_equals_torch_optim_muon``).

    python benchmarks/bench_muon.py              # d_model 192, 4 layers, T 128, B 16, 90 s per run, 3 rounds
    python benchmarks/bench_muon.py --steps 150  # equal steps instead (a loaded machine cannot skew it)
    python benchmarks/bench_muon.py --quick      # seconds: a smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (add_json_flag, run_child, shakespeare_documents, spread, synthetic_documents,  # noqa: E402
                     write_json)

OPTIMIZERS = ("adamw", "muon")


def make_shards(root: Path, vocab_size: int, source: str) -> Path:
    """Tokenizer + train/val shards of ``source`` (``shakespeare`` or ``synthetic``) under ``root``."""
    from lmforge.data import prepare
    from lmforge.tokenizer import Tokenizer, train_bpe_from_iterator

    docs = synthetic_documents(100_000) if source == "synthetic" else shakespeare_documents()
    sample, size = [], 0
    for d in docs:  # the tokenizer learns from the first ~2 MB
        sample.append(d)
        size += len(d)
        if size > 2_000_000:
            break
    vocab, merges = train_bpe_from_iterator(sample, vocab_size, ["<|endoftext|>"], progress=False)
    tok = Tokenizer(vocab, merges, ["<|endoftext|>"])
    corpus = root / "corpus.txt"
    corpus.write_text("<|endoftext|>".join(docs), encoding="utf-8")
    prepare(tok, corpus, root / "shards", val_fraction=0.05, progress=False)
    return root / "shards"


def _optim_config(name: str, a: argparse.Namespace):
    from lmforge.train import OptimConfig

    return OptimConfig(name=name, lr=a.lr, min_lr=a.lr, warmup_steps=a.warmup, schedule="constant",
                       muon_lr=a.muon_lr, weight_decay=0.1)


def _model(a: argparse.Namespace):
    import torch

    from lmforge.model import ModelConfig, TransformerLM

    torch.manual_seed(0)
    return TransformerLM(ModelConfig(vocab_size=a.vocab, context_length=a.context, d_model=a.d_model,
                                     n_layers=a.layers, n_heads=a.heads))


def state_bytes(optimizer) -> int:
    """Bytes of every tensor in the optimizer's state (momentum, Adam moments)."""
    return sum(v.numel() * v.element_size() for st in optimizer.state.values() for v in st.values()
               if hasattr(v, "numel"))


def train_child(a: argparse.Namespace) -> dict:
    """Train ``a.child`` for ``a.seconds`` of step time (or ``a.steps`` steps); return val loss/bpb, steps, median step time, state bytes."""
    import torch

    from lmforge.data import BlockLoader, TokenDataset, val_batches
    from lmforge.train.evaluate import evaluate
    from lmforge.train.loop import _build_optimizer, _lr_at
    from lmforge.train.optim import clip_grad_norm

    torch.set_num_threads(a.threads)
    oc = _optim_config(a.child, a)
    model = _model(a)
    opt = _build_optimizer(model, oc)  # the loop's own builder: nanochat's split and per-group lr_scale
    train_ds, val_ds = TokenDataset(a.shards, "train"), TokenDataset(a.shards, "val")
    loader = BlockLoader(train_ds, a.batch, a.context, seed=0)
    val = val_batches(val_ds, a.batch, a.context, a.eval_batches)
    step, elapsed, times = 0, 0.0, []
    while (step < a.steps) if a.steps else (elapsed < a.seconds or step < 2):
        t0 = time.perf_counter()
        lr = _lr_at(step, oc, 10**9)
        for g in opt.param_groups:
            g["lr"] = lr * g.get("lr_scale", 1.0)
        x, y = loader.next_batch()
        model(x, targets=y).backward()
        clip_grad_norm(model.parameters(), oc.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        if step > 0:  # the first step (lazy initialisation, state allocation) is not timed, on either side
            elapsed += dt
            times.append(dt)
        step += 1
    ev = evaluate(model, val, val_ds.bytes_per_token, "fp32", torch.device("cpu"))
    return {"val_loss": ev.loss, "val_bpb": ev.bpb, "steps": step, "step_ms": 1e3 * statistics.median(times),
            "state_mb": state_bytes(opt) / 2**20}


def optimizer_step_times(a: argparse.Namespace, steps: int) -> dict[str, list[float]]:
    """Milliseconds per ``optimizer.step()`` with fixed gradients, the variants interleaved step by step."""
    import torch

    from lmforge.train.optim import AdamW, Muon, muon_param_groups, param_groups_for

    torch.set_num_threads(a.threads)
    variants = {}
    for name in ("lmforge AdamW", "lmforge Muon (batched)", "lmforge Muon (reference)",
                 "torch.optim.Muon + AdamW"):
        model = _model(a)
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-2
        if name == "lmforge AdamW":
            opts = [AdamW(param_groups_for(model, 0.1), lr=a.lr, betas=(0.9, 0.95))]
        elif name.startswith("lmforge Muon"):
            opts = [Muon(muon_param_groups(model, a.lr, a.muon_lr, 0.1), impl="batched" if "batched" in name
                         else "reference")]
        else:
            muon, embed_head, other = muon_param_groups(model, a.lr, a.muon_lr, 0.1)
            opts = [torch.optim.Muon(muon["params"], lr=a.muon_lr, weight_decay=0.0),
                    torch.optim.AdamW([{"params": embed_head["params"], "weight_decay": 0.1},
                                       {"params": other["params"], "weight_decay": 0.0}], lr=a.lr,
                                      betas=(0.9, 0.95))]
        variants[name] = opts
    times: dict[str, list[float]] = {n: [] for n in variants}
    for i in range(steps + 2):
        for name, opts in variants.items():
            t0 = time.perf_counter()
            for o in opts:
                o.step()
            if i >= 2:  # two warm-up steps (state allocation)
                times[name].append(1e3 * (time.perf_counter() - t0))
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, synthetic corpus, 3 s per run (or --seconds), 1 round")
    ap.add_argument("--seconds", type=float, default=None, help="wall time of training per (optimizer, round); 90")
    ap.add_argument("--steps", type=int, default=None,
                    help="train this many steps instead of --seconds (equal steps: immune to machine load)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--corpus", choices=("shakespeare", "synthetic"), default="shakespeare")
    ap.add_argument("--d-model", dest="d_model", type=int, default=192)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=3e-3, help="AdamW lr (and Muon's AdamW groups)")
    ap.add_argument("--muon-lr", dest="muon_lr", type=float, default=0.02)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--eval-batches", dest="eval_batches", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    add_json_flag(ap)
    ap.add_argument("--child", choices=OPTIMIZERS, help=argparse.SUPPRESS)
    ap.add_argument("--shards", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(train_child(a)), flush=True)
        return
    a.seconds = a.seconds or (3.0 if a.quick else 90.0)
    if a.quick:
        a.seconds, a.rounds, a.corpus, a.eval_batches, a.warmup = a.seconds, 1, "synthetic", 2, 5
        a.d_model, a.layers, a.heads, a.context, a.batch, a.vocab = 64, 2, 2, 64, 8, 300
    print(f"model: d_model {a.d_model}, {a.layers} layers, {a.heads} heads, T {a.context}, B {a.batch}, V {a.vocab}; "
          f"{a.corpus}; {f'{a.steps} steps' if a.steps else f'{a.seconds:g} s'} per run, {a.rounds} rounds, {a.threads} threads; AdamW lr {a.lr:g}, "
          f"Muon lr {a.muon_lr:g} (+ AdamW lr {a.lr:g} for embeddings, head, norms); warmup {a.warmup}, then constant")
    results: dict[str, list[dict]] = {o: [] for o in OPTIMIZERS}
    with tempfile.TemporaryDirectory() as tmp:
        shards = make_shards(Path(tmp), a.vocab, a.corpus)
        forwarded = [f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items()
                     if v is not None and k in ("seconds", "steps", "d_model", "layers", "heads", "context", "batch",
                                                "vocab", "lr", "muon_lr", "warmup", "eval_batches", "threads")]
        for r in range(a.rounds):
            for name in OPTIMIZERS:
                res = run_child(__file__, [name, "--shards", str(shards), *forwarded], a.threads)
                results[name].append(res)
                print(f"round {r + 1}: {name:5s} val bpb {res['val_bpb']:.4f}, val loss {res['val_loss']:.4f}, "
                      f"{res['steps']} steps, {res['step_ms']:.1f} ms/step", flush=True)
    budget = f"Equal steps ({a.steps} per run)" if a.steps else f"Equal wall time ({a.seconds:g} s of training per run)"
    print(f"\n### {budget}, median (range) over {a.rounds} rounds\n")
    print("| optimizer | val bits/byte | val loss | steps | step time (ms) | optimizer state (MiB) |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, rs in results.items():
        col = lambda k, f: spread([r[k] for r in rs], f)
        print(f"| {name} | {col('val_bpb', '.4f')} | {col('val_loss', '.4f')} | {col('steps', '.0f')} | "
              f"{col('step_ms', '.1f')} | {rs[0]['state_mb']:.2f} |")
    times = optimizer_step_times(a, 5 if a.quick else 30)
    print("\n### optimizer.step() alone, same model, fixed gradients, interleaved: ms, median (range)\n")
    print("| optimizer | step (ms) | / lmforge AdamW |")
    print("|---|---:|---:|")
    base = statistics.median(times["lmforge AdamW"])
    for name, ts in times.items():
        print(f"| {name} | {spread(ts, '.2f')} | {statistics.median(ts) / base:.2f}x |")
    write_json(a.json, {"runs": results, "optimizer_step_ms": times})


if __name__ == "__main__":
    main()
