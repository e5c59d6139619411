"""RL cost: rollout tokens/s through the batched engine vs one reply at a time, where a step's time goes, LoRA vs full.

1. **Rollouts.** ``P`` prompts x ``K`` replies (the built-in arithmetic/calculator chat tasks), sampled three ways
   with the same seeds: ``engine``: :func:`lmforge.rl.sample_replies` decoding ``rl.prompts_per_decode`` prompts
   (``K`` rows each) per batch, as ``lmforge rl`` does; ``engine 1 prompt``: one prompt's ``K`` rows per batch;
   ``one at a time``: each reply alone through ``Generator.turn`` with a ``ToolUse`` (what ``lmforge chat`` does
   per reply). All three must produce the same ids (checked, else the script exits). Tokens/s counts every reply
   id (sampled and tool output). Also the cost of building the engine (packing the weights), paid once per
   step so that every step decodes with the weights the last update left.
2. **A step.** ``lmforge rl`` for ``--steps`` steps, full and with LoRA (rank 8 on every projection), each in its
   own child process (its peak RSS its own), alternating for ``--rounds`` rounds: the median step time, the share
   of it spent drawing rollouts (``rollout_seconds`` in ``metrics.jsonl``: engine, sampling, rewards, batches)
   vs the update (forward, backward, optimizer), peak RSS, trainable parameters and optimizer state.

The model: ``--base RUN`` (a chat run, e.g. a speedrun's ``sft/``), or by default one made here at the
speedrun's ``small`` shape (d_model 256, 4 layers, context 256) with a BPE tokenizer on synthetic text, one
pretraining and five SFT steps: its replies mostly run to ``max_new_tokens``, which is what throughput needs.

    python benchmarks/bench_rl.py                 # P 8, K 8, 48 new tokens, 3 rounds; steps of 8 x 8 replies
    python benchmarks/bench_rl.py --base runs/speedrun/sft
    python benchmarks/bench_rl.py --quick         # a smoke run (tiny model)

``--sampling DIR``: only what one RL step spends drawing its rollouts, ``P`` prompts x ``K`` replies through
:func:`lmforge.rl.sample_replies` on a fresh ``Engine`` (``rl.prompts_per_decode`` prompts per batch), for
``--rounds`` timed rounds after a warm-up: seconds per step (median, range), reply tokens/s, and the prompt prefills
the engine ran (prompt rows through ``Engine.prefill``/``Engine.admit`` and their tokens; forked rows are copies,
not prefills), with a digest of every reply's ids. ``DIR`` holds the chat run and task files, made there by the
first run that finds none, so two source trees measure the same model on the same prompts; it calls only public
APIs that ``7fda0be`` also has, so the tree on ``PYTHONPATH`` (or installed) is the one measured, and it prints
which. Make ``DIR`` with the older tree (a newer tree reads an older run's config, not the reverse):

    python benchmarks/bench_rl.py --sampling /tmp/rl-sampling            # P 8, K 8, 48 new tokens, 3 rounds
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from _common import (EOT, add_json_flag, child_report, median, run_child, spread, synthetic_documents,  # noqa: E402
                     write_json)

TASKS = ("arithmetic", "calculator")


def _chat_run(root: Path, quick: bool) -> Path:
    """A small chat run: synthetic BPE tokenizer and shards, one pretraining step, five SFT steps on the tasks."""
    from lmforge.chat.sft import sft
    from lmforge.data import prepare
    from lmforge.tokenizer import Tokenizer, train_bpe_from_iterator
    from lmforge.train import load_run_config, train

    docs = synthetic_documents(100_000 if quick else 1_000_000)
    vocab, merges = train_bpe_from_iterator(docs, 400 if quick else 1000, [EOT], progress=False)
    tok = Tokenizer(vocab, merges, [EOT])
    (root / "corpus.txt").write_text(EOT.join(docs), encoding="utf-8")
    prepare(tok, root / "corpus.txt", root / "shards", val_fraction=0.05, progress=False)
    d, layers, heads, ctx = (32, 2, 2, 96) if quick else (256, 4, 8, 256)
    cfg = {"model": {"vocab_size": 64 * -(-tok.vocab_size // 64), "context_length": ctx, "d_model": d,
                     "n_layers": layers, "n_heads": heads},
           "optimizer": {"lr": 1e-3, "warmup_steps": 0, "decay_steps": 10},
           "training": {"max_steps": 1, "batch_size": 4, "device": "cpu", "log_every": 1, "eval_every": 10**9},
           "data": {"dir": str(root / "shards"), "val_split": None}}
    train(load_run_config(base=cfg), root / "base", progress=False)
    sft(root / "base", _tasks(root, "train"), root / "sft", progress=False,
        overrides=["training.max_steps=5", "optimizer.warmup_steps=1", "training.eval_every=1000000"])
    return root / "sft"


def _tasks(root: Path, split: str) -> Path:
    """The built-in arithmetic and calculator chat tasks (over synthetic words) as ``root/{split}.jsonl``."""
    from lmforge.corpus.chat_data import chat_tasks, common_words, to_jsonl

    path = root / f"{split}.jsonl"
    if not path.exists():
        train, val = chat_tasks(common_words(" ".join(synthetic_documents(50_000))), n_train=200, n_val=20)
        for name, records in (("train", train), ("val", val)):
            (root / f"{name}.jsonl").write_text(to_jsonl(r for r in records if r["task"] in TASKS), encoding="utf-8")
    return path


# ----------------------------------------------------------------------------------------------------
# 1. Rollouts
# ----------------------------------------------------------------------------------------------------
def bench_rollouts(base: Path, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from lmforge.chat import ChatFormat, ToolUse
    from lmforge.evals import load_model
    from lmforge.generate import Generator
    from lmforge.generate.engine import Engine
    from lmforge.rl import rollout_seed, sample_replies
    from lmforge.rl.data import read_prompts

    model, tok, _ = load_model(base, device="cpu")
    fmt, gen = ChatFormat(tok), Generator(model, tok)
    prompts, _ = read_prompts(_tasks(root, "train"), fmt, model.cfg.context_length, args.new_tokens)
    ids = prompts.ids[: args.prompts]
    seeds = [[rollout_seed(0, 0, j, k) for k in range(args.k)] for j in range(len(ids))]
    sampling = dict(temperature=1.0, top_k=None, top_p=None, max_new_tokens=args.new_tokens, fmt=fmt,
                    vocab_limit=tok.vocab_size)

    def engine(per_batch: int) -> list[list[int]]:
        eng, out = Engine(model), []
        for c in range(0, len(ids), per_batch):
            out += [r.ids for g in sample_replies(eng, ids[c:c + per_batch], seeds[c:c + per_batch], **sampling)
                    for r in g]
        return out

    def one_at_a_time() -> list[list[int]]:
        out = []
        for p, ss in zip(ids, seeds):
            for s in ss:
                turn = gen.turn(p, args.new_tokens, temperature=1.0, rng=torch.Generator().manual_seed(s),
                                stop_ids=fmt.stop_ids, inject=ToolUse(fmt).feed)
                list(turn)
                out.append(turn.ids)
        return out

    sides = {f"engine, {args.per_decode} prompts x {args.k} rows per batch": lambda: engine(args.per_decode),
             f"engine, 1 prompt x {args.k} rows per batch": lambda: engine(1),
             "one at a time (Generator.turn)": one_at_a_time}
    times: dict[str, list[float]] = {s: [] for s in sides}
    outputs: dict[str, list[list[int]]] = {}
    for r in range(args.rounds + 1):  # round 0 warms up
        for name, fn in sides.items():
            t0 = time.perf_counter()
            outputs[name] = fn()
            if r:
                times[name].append(time.perf_counter() - t0)
    same = len({json.dumps(o) for o in outputs.values()}) == 1
    n_tokens = sum(map(len, next(iter(outputs.values()))))
    pack = []
    for _ in range(5):
        t0 = time.perf_counter()
        Engine(model)
        pack.append(time.perf_counter() - t0)
    print(f"## Rollouts: {len(ids)} prompts x {args.k} replies, up to {args.new_tokens} sampled tokens "
          f"({n_tokens:,} reply tokens; d_model {model.cfg.d_model}, {model.cfg.n_layers} layers, "
          f"{torch.get_num_threads()} threads, {args.rounds} rounds)\n")
    print("| side | seconds median (range) | reply tokens/s | vs one at a time |")
    print("|---|---|---|---|")
    ref = median(times["one at a time (Generator.turn)"])
    for name, xs in times.items():
        print(f"| {name} | {spread(xs)} | {n_tokens / median(xs):,.0f} | {ref / median(xs):.2f}x |")
    print(f"\nAll sides produced the same replies: {same}")
    print(f"Engine build (packing the weights, once per step): {1000 * median(pack):.1f} ms median "
          f"({1000 * min(pack):.1f}..{1000 * max(pack):.1f})\n")
    if not same:
        sys.exit("the sides sampled different replies: the comparison is void")
    return {"rollout_seconds": times, "reply_tokens": n_tokens, "same_replies": same}


def bench_sampling(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One step's rollout sampling, timed, with the engine's prompt prefills counted (module docstring)."""
    import hashlib

    import torch

    import lmforge
    from lmforge.chat import ChatFormat
    from lmforge.evals import load_model
    from lmforge.generate.engine import Engine
    from lmforge.rl import rollout_seed, sample_replies
    from lmforge.rl.data import read_prompts

    base = root / "sft"
    if not (base / "config.yaml").exists():
        _chat_run(root, args.quick)
    model, tok, _ = load_model(base, device="cpu")
    fmt = ChatFormat(tok)
    prompts, _ = read_prompts(_tasks(root, "train"), fmt, model.cfg.context_length, args.new_tokens)
    ids = prompts.ids[: args.prompts]
    seeds = [[rollout_seed(0, 0, j, k) for k in range(args.k)] for j in range(len(ids))]
    counts = {"rows": 0, "tokens": 0}

    def step() -> list[list[int]]:
        engine = Engine(model)  # as RL builds one per step (not timed)
        prefill, admit = engine.prefill, engine.admit

        def counted_prefill(rows, capacity):
            counts["rows"], counts["tokens"] = counts["rows"] + len(rows), counts["tokens"] + sum(map(len, rows))
            return prefill(rows, capacity)

        def counted_admit(prompt, start=0):
            counts["rows"], counts["tokens"] = counts["rows"] + 1, counts["tokens"] + len(prompt) - start
            return admit(prompt, start)

        engine.prefill, engine.admit = counted_prefill, counted_admit
        counts.update(rows=0, tokens=0)
        out = []
        t0 = time.perf_counter()
        for c in range(0, len(ids), args.per_decode):
            out += [r.ids for g in sample_replies(engine, ids[c:c + args.per_decode], seeds[c:c + args.per_decode],
                                                  temperature=1.0, top_k=None, top_p=None,
                                                  max_new_tokens=args.new_tokens, fmt=fmt, vocab_limit=tok.vocab_size)
                    for r in g]
        times.append(time.perf_counter() - t0)
        return out

    times: list[float] = []
    replies = [step() for _ in range(args.rounds + 1)][1:]  # round 0 warms up
    times = times[1:]
    same = all(r == replies[0] for r in replies)
    n_tokens = sum(map(len, replies[0]))
    digest = hashlib.sha256(json.dumps(replies[0]).encode()).hexdigest()[:16]
    print(f"## Rollout sampling: lmforge from {Path(lmforge.__file__).parent}; {len(ids)} prompts x {args.k} replies, "
          f"{args.per_decode} prompts per batch, up to {args.new_tokens} sampled tokens ({n_tokens:,} reply tokens; "
          f"d_model {model.cfg.d_model}, {model.cfg.n_layers} layers, {torch.get_num_threads()} threads, "
          f"{args.rounds} rounds)\n")
    print("| sampling seconds per step: median (range) | reply tokens/s | prompt rows prefilled | prompt tokens "
          "prefilled | replies sha256 |")
    print("|---|---|---|---|---|")
    print(f"| {spread(times)} | {n_tokens / median(times):,.0f} | {counts['rows']} | {counts['tokens']:,} | "
          f"{digest} |")
    print(f"\nEvery round sampled the same replies: {same}")
    if not same:
        sys.exit("the rounds sampled different replies: seeds are not honoured")
    return {"sampling_seconds": times, "reply_tokens": n_tokens, "prefill_rows": counts["rows"],
            "prefill_tokens": counts["tokens"], "replies_sha256": digest}


# ----------------------------------------------------------------------------------------------------
# 2. A step: rollouts vs the update, LoRA vs full
# ----------------------------------------------------------------------------------------------------
def child(side: str, base: str, root: str, run_dir: str, steps: int, args: argparse.Namespace) -> None:
    import torch

    from lmforge.checkpoint import CheckpointManager, read_checkpoint
    from lmforge.rl import rl
    from lmforge.train.finetune import build_model
    from lmforge.train import load_run_config
    from lmforge.train.metrics import step_seconds

    sets = [f"training.max_steps={steps}", f"rl.prompts_per_step={args.prompts}", f"rl.samples_per_prompt={args.k}",
            f"rl.max_new_tokens={args.new_tokens}", f"rl.prompts_per_decode={args.per_decode}",
            "training.checkpoint_every=1000000", "training.num_threads=2"]
    if side == "lora":
        sets += ["lora.rank=8", "lora.alpha=16"]
    m = rl(base, _tasks(Path(root), "train"), run_dir, overrides=sets, progress=False)
    recs = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    step_s = step_seconds(recs)[1:]  # the first step pays one-time costs
    recs = [r for r in recs if "reward" in r][1:]
    cfg = load_run_config(Path(run_dir) / "config.yaml")
    model = build_model(cfg, torch.device("cpu"), resuming=False)
    ck = read_checkpoint(CheckpointManager(Path(run_dir)).steps()[-1][1])
    opt = sum(t.numel() * t.element_size() for s in ck.optimizer["state"].values() for t in s.values()
              if hasattr(t, "element_size"))
    child_report(step=median(step_s), rollout=median([r["rollout_seconds"] for r in recs]),
                 trainable=sum(p.numel() for p in model.parameters() if p.requires_grad), optimizer_bytes=opt,
                 reply_tokens=median([r["reply_tokens"] for r in recs]), steps=m["step"])


def bench_step(base: Path, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    res: dict[str, list[dict]] = {"full": [], "lora": []}
    for r in range(args.rounds):
        for side in res:  # alternating: full, lora, full, lora, ...
            res[side].append(run_child(__file__, [side, str(base), str(root), str(root / f"rl_{side}_{r}"),
                                                  str(args.steps), *_flags(args)], threads=2))
    print(f"## One RL step: {args.prompts} prompts x {args.k} replies, {args.steps} steps per run "
          f"(median over steps after the first), {args.rounds} rounds alternating\n")
    print("| side | step seconds median (range over rounds) | rollouts | update | peak RSS MB | trainable "
          "parameters | optimizer state bytes |")
    print("|---|---|---|---|---|---|---|")
    for side, rs in res.items():
        step = [x["step"] for x in rs]
        share = median([x["rollout"] / x["step"] for x in rs])
        print(f"| {side} | {spread(step)} | {100 * share:.0f}% | {100 * (1 - share):.0f}% | "
              f"{median([x['rss_mb'] for x in rs]):,.0f} | {rs[0]['trainable']:,} | {rs[0]['optimizer_bytes']:,} |")
    f, lo = res["full"], res["lora"]
    print(f"\nLoRA / full: step time {median([x['step'] for x in lo]) / median([x['step'] for x in f]):.2f}x, "
          f"peak RSS {median([x['rss_mb'] for x in lo]) / median([x['rss_mb'] for x in f]):.2f}x, trainable "
          f"parameters {lo[0]['trainable'] / f[0]['trainable']:.1%}, optimizer state "
          f"{lo[0]['optimizer_bytes'] / f[0]['optimizer_bytes']:.1%}")
    return {"steps": res}


def _flags(args: argparse.Namespace) -> list[str]:
    return ["--prompts", str(args.prompts), "--k", str(args.k), "--new-tokens", str(args.new_tokens),
            "--per-decode", str(args.per_decode)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny model, few prompts and rounds: a smoke run")
    p.add_argument("--base", default=None, help="a chat run to use (default: make a small one)")
    p.add_argument("--prompts", type=int, default=None, help="prompts (P); default 8 (quick 2)")
    p.add_argument("--k", type=int, default=None, help="replies per prompt (K); default 8 (quick 4)")
    p.add_argument("--new-tokens", type=int, default=None, help="sampled tokens per reply at most; default 48")
    p.add_argument("--per-decode", type=int, default=None, help="prompts decoded together; default 4 (quick 2)")
    p.add_argument("--rounds", type=int, default=None, help="rounds; default 3 (quick 1)")
    p.add_argument("--steps", type=int, default=None, help="RL steps per run; default 4 (quick 2)")
    add_json_flag(p)
    p.add_argument("--sampling", default=None, metavar="DIR", help="only one step's rollout sampling, timed, its "
                   "prompt prefills counted; DIR holds (or gets) the chat run and task files (see the docstring)")
    p.add_argument("--child", nargs=5, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    q = args.quick
    args.prompts = args.prompts or (2 if q else 8)
    args.k = args.k or (4 if q else 8)
    args.new_tokens = args.new_tokens or (16 if q else 48)
    args.per_decode = args.per_decode or (2 if q else 4)
    args.rounds = args.rounds or (1 if q else 3)
    args.steps = args.steps or (2 if q else 4)
    if args.child:
        side, base, root, run_dir, steps = args.child
        child(side, base, root, run_dir, int(steps), args)
        return
    import torch

    from lmforge.hardware import matmul_peak_flops

    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    if args.sampling:
        Path(args.sampling).mkdir(parents=True, exist_ok=True)
        write_json(args.json, bench_sampling(Path(args.sampling), args))
        return
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base = Path(args.base) if args.base else _chat_run(root, q)
        load = " ".join(Path("/proc/loadavg").read_text().split()[:3]) if Path("/proc/loadavg").exists() else "n/a"
        peak = matmul_peak_flops("cpu", repeats=3 if q else 30)  # --quick: a smoke run, not a figure
        print(f"Measured fp32 matmul peak {peak / 1e9:,.0f} GFLOP/s; load average {load}\n")
        figures = bench_rollouts(base, root, args)
        figures.update(bench_step(base, root, args))
    write_json(args.json, figures)


if __name__ == "__main__":
    main()
