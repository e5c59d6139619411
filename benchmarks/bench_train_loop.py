"""Training-loop overhead: ``lmforge.train.train`` vs a bare nanoGPT-style loop, same model and optimizer.

Both sides train the same ``TransformerLM`` with the same ``AdamW`` on the same shards; the bare loop
does only what nanoGPT's does per step (random windows with ``get_batch``, forward, backward, clip,
step, ``loss.item()``), while lmforge's adds the block loader with exact resume, token-normalised
gradient accumulation, the non-finite check and metrics. Only step time is compared (lmforge reports
it as ``train_seconds``; evaluation and checkpoint saves are excluded on both sides). Each (side, round)
runs in its own child process; rounds alternate and the best round of each side is kept.

    python benchmarks/bench_train_loop.py            # d_model 256, 4 layers, T 256, B 8, 60 steps, 3 rounds
    python benchmarks/bench_train_loop.py --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _make_shards(root: Path, vocab_size: int) -> Path:
    sys.path.insert(0, str(Path(__file__).parent))
    from _common import synthetic_documents

    from lmforge.data import prepare
    from lmforge.tokenizer import Tokenizer, train_bpe_from_iterator

    docs = synthetic_documents(2_000_000)
    vocab, merges = train_bpe_from_iterator(docs, vocab_size, ["<|endoftext|>"], progress=False)
    tok = Tokenizer(vocab, merges, ["<|endoftext|>"])
    corpus = root / "corpus.txt"
    corpus.write_text("<|endoftext|>".join(docs), encoding="utf-8")
    prepare(tok, corpus, root / "shards", progress=False)
    return root / "shards"


def _config(args: argparse.Namespace, shards: str) -> dict:
    return {"model": {"vocab_size": args.vocab, "context_length": args.context, "d_model": args.d_model,
                      "n_layers": args.layers, "n_heads": args.heads},
            "optimizer": {"lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 5},
            "training": {"max_steps": args.steps, "batch_size": args.batch, "device": "cpu", "log_every": 10,
                         "eval_every": 10**9, "checkpoint_every": 10**9, "keep_last": 1},
            "data": {"dir": shards, "val_split": None}}


def _child_lmforge(args: argparse.Namespace) -> dict:
    from lmforge.train import load_run_config, train

    cfg = load_run_config(base=_config(args, args.shards))
    with tempfile.TemporaryDirectory() as run_dir:
        m = train(cfg, run_dir, progress=False)
    return {"tokens_per_s": m["tokens"] / m["train_seconds"]}


def _child_bare(args: argparse.Namespace) -> dict:
    import torch

    from lmforge.data import TokenDataset, get_batch
    from lmforge.model import TransformerLM
    from lmforge.train.optim import AdamW, clip_grad_norm, cosine_lr, param_groups_for
    from lmforge.train import load_run_config

    cfg = load_run_config(base=_config(args, args.shards))
    torch.manual_seed(cfg.training.seed)
    tokens = TokenDataset(args.shards, "train").shards[0]
    model = TransformerLM(cfg.model)
    oc = cfg.optimizer
    opt = AdamW(param_groups_for(model, oc.weight_decay), lr=oc.lr, betas=oc.betas, eps=oc.eps)
    elapsed = 0.0
    for it in range(args.steps):
        t0 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = cosine_lr(it + 1, oc.lr, oc.min_lr, oc.warmup_steps, args.steps)
        x, y = get_batch(tokens, args.batch, args.context)
        loss = model(x, targets=y)
        loss.backward()
        clip_grad_norm(model.parameters(), oc.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        elapsed += time.perf_counter() - t0
    return {"tokens_per_s": args.steps * args.batch * args.context / elapsed}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny model, few steps, one round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--child", choices=["lmforge", "bare"], help=argparse.SUPPRESS)
    p.add_argument("--shards", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        out = _child_lmforge(args) if args.child == "lmforge" else _child_bare(args)
        print(json.dumps(out))
        return
    if args.quick:
        args.rounds, args.steps, args.d_model, args.layers, args.heads, args.context, args.vocab = 1, 10, 64, 2, 4, 64, 512
    with tempfile.TemporaryDirectory() as tmp:
        shards = _make_shards(Path(tmp), args.vocab)
        best: dict[str, float] = {}
        forwarded = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                     if k in ("steps", "d_model", "layers", "heads", "context", "batch", "vocab")]
        for r in range(args.rounds):
            for side in ("lmforge", "bare"):
                cmd = [sys.executable, __file__, "--child", side, "--shards", str(shards), *forwarded]
                res = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
                best[side] = max(best.get(side, 0.0), res["tokens_per_s"])
                print(f"round {r + 1}: {side:8s} {res['tokens_per_s']:>10,.0f} tokens/s", flush=True)
    ratio = best["lmforge"] / best["bare"]
    print(f"\nbest of {args.rounds}: lmforge train() {best['lmforge']:,.0f} tok/s, bare loop {best['bare']:,.0f} tok/s, "
          f"ratio {ratio:.3f} (1.0 = no loop overhead)")


if __name__ == "__main__":
    main()
