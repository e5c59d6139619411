"""Fine-tuning cost: SFT tokens/s vs pretraining tokens/s on the same shape, and LoRA vs full SFT.

All three sides run the one training loop (``lmforge.train.train``) on the same model shape, batch and context:

* ``pretrain``: token shards (every target trained);
* ``sft``: ``lmforge sft`` on packed conversations (masked targets, loss over the global target count) —
  the goal is >= 0.95x pretraining's tokens/s: the mask must cost nothing;
* ``lora``: the same SFT with rank-8 adapters on every projection — trainable parameters and optimizer state
  bytes against full SFT (goal <= 5%), and step time.

Tokens/s counts every position of a step (batch x context x accumulation), masked or padded ones included,
so the three are comparable; the step time excludes evaluation and checkpoint saves (``train_seconds``). The
sides alternate for several rounds (``_common.alternate`` order) in one process; the table gives the median,
the range and the ratio of medians.

    python benchmarks/bench_sft.py            # d_model 128, 2 layers, T 128, B 8, 20 steps, 3 rounds
    python benchmarks/bench_sft.py --quick    # a smoke run (seconds)
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import EOT, median, spread, synthetic_documents  # noqa: E402


def _base_run(root: Path, args: argparse.Namespace) -> Path:
    """A base run: a BPE tokenizer and shards of synthetic text, one pretraining step."""
    from lmforge.data import prepare
    from lmforge.tokenizer import Tokenizer, train_bpe_from_iterator
    from lmforge.train import load_run_config, train

    docs = synthetic_documents(100_000 if args.quick else 2_000_000)
    vocab, merges = train_bpe_from_iterator(docs, min(args.vocab - 64, 400), [EOT], progress=False)
    tok = Tokenizer(vocab, merges, [EOT])
    (root / "corpus.txt").write_text(EOT.join(docs), encoding="utf-8")
    prepare(tok, root / "corpus.txt", root / "shards", val_fraction=0.05, progress=False)
    train(load_run_config(base=_config(args, str(root / "shards"), steps=1)), root / "base", progress=False)
    return root / "base"


def _config(args: argparse.Namespace, shards: str, steps: int) -> dict:
    return {"model": {"vocab_size": args.vocab, "context_length": args.context, "d_model": args.d_model,
                      "n_layers": args.layers, "n_heads": args.heads},
            "optimizer": {"lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 0, "decay_steps": 1000},
            "training": {"max_steps": steps, "batch_size": args.batch, "device": "cpu", "log_every": 10**9,
                         "eval_every": 10**9, "checkpoint_every": 10**9, "keep_last": 1},
            "data": {"dir": shards, "val_split": None}}


def _conversations(path: Path, n: int, longest: int) -> Path:
    """Conversations of uneven length (up to ``longest`` words, then an answer)."""
    rng = random.Random(0)
    words = "the a king queen love night day heaven heart eyes good sweet lord death".split()
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n):
            q = " ".join(rng.choice(words) for _ in range(rng.randint(2, longest)))
            a = " ".join(rng.choice(words) for _ in range(rng.randint(1, longest // 3 + 1)))
            f.write(json.dumps({"messages": [{"role": "user", "content": f"Repeat the last words: {q}"},
                                             {"role": "assistant", "content": a}]}) + "\n")
    return path


def _optimizer_bytes(run_dir: Path) -> int:
    from lmforge.checkpoint import CheckpointManager, read_checkpoint

    ck = read_checkpoint(CheckpointManager(run_dir).steps()[-1][1])
    return sum(t.numel() * t.element_size() for s in ck.optimizer["state"].values() for t in s.values()
               if hasattr(t, "element_size"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes and rounds: a smoke run")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--steps", type=int, default=None)
    args = p.parse_args()
    q = args.quick
    args.vocab, args.context, args.d_model, args.layers, args.heads, args.batch = (
        (384, 64, 32, 2, 2, 4) if q else (512, 128, 128, 2, 4, 8))
    rounds, steps = args.rounds or (2 if q else 3), args.steps or (3 if q else 20)

    import torch

    from lmforge.chat.sft import sft
    from lmforge.train import load_run_config, train

    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    sets = (f"training.max_steps={steps}", "training.eval_every=1000000", "training.checkpoint_every=1000000",
            "training.log_every=1000000", "optimizer.warmup_steps=0", "optimizer.decay_steps=1000")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base = _base_run(root, args)
        data = _conversations(root / "convs.jsonl", 200 if q else 3000, 8 if q else 30)
        results: dict[str, list[float]] = {"pretrain": [], "sft": [], "lora": []}
        extra: dict[str, dict] = {}
        for r in range(rounds):
            for side in results:  # alternating: pretrain, sft, lora, pretrain, ...
                out = root / f"{side}_{r}"
                if side == "pretrain":
                    m = train(load_run_config(base=_config(args, str(root / "shards"), steps)), out, progress=False)
                else:
                    lora = ("lora.rank=8", "lora.alpha=16") if side == "lora" else ()
                    m = sft(base, data, out, overrides=sets + lora, progress=False)
                results[side].append(m["tokens"] / m["train_seconds"])
                if r == 0 and side != "pretrain":
                    cfg = load_run_config(out / "config.yaml")
                    from lmforge.train.finetune import build_model

                    model = build_model(cfg, torch.device("cpu"), resuming=False)
                    extra[side] = {"trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
                                   "optimizer_bytes": _optimizer_bytes(out),
                                   "checkpoint_bytes": (out / "checkpoints").joinpath(
                                       f"step_{steps:08d}.safetensors").stat().st_size}
    shape = (f"d_model {args.d_model}, {args.layers} layers, context {args.context}, batch {args.batch}, "
             f"{steps} steps, {rounds} rounds, {torch.get_num_threads()} threads")
    print(f"## SFT vs pretraining, LoRA vs full SFT ({shape})\n")
    print("| side | tokens/s median (range) | vs pretraining |")
    print("|---|---|---|")
    for side, xs in results.items():
        print(f"| {side} | {spread(xs, ',.0f')} | {median(xs) / median(results['pretrain']):.2f}x |")
    f, lo = extra["sft"], extra["lora"]
    print(f"\nSFT / pretraining tokens/s: {median(results['sft']) / median(results['pretrain']):.2f}x (goal >= 0.95)")
    print(f"LoRA / full SFT: trainable parameters {lo['trainable']:,} / {f['trainable']:,} = "
          f"{lo['trainable'] / f['trainable']:.1%}; optimizer state {lo['optimizer_bytes']:,} / "
          f"{f['optimizer_bytes']:,} bytes = {lo['optimizer_bytes'] / f['optimizer_bytes']:.1%} (goal <= 5%); "
          f"checkpoint {lo['checkpoint_bytes']:,} / {f['checkpoint_bytes']:,} bytes; step time "
          f"{median(results['sft']) / median(results['lora']):.2f}x of full SFT's")


if __name__ == "__main__":
    main()
