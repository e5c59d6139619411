"""The CPU speedrun ablation: one change at a time to the speedrun's pretraining recipe, measured by steps.

Every variant is the speedrun's own run config (``lmforge.speedrun._run_config``: the ``small`` preset, the
schedule fitted to ``--steps``, the current ``RECIPE``) with a few ``section.key=value`` settings changed.
Wall time on a shared machine is noise, so the two halves of the answer are measured apart:

* **quality by steps** (``train`` mode, deterministic): each (variant, seed) pretrains ``--steps`` steps on the
  speedrun's Shakespeare shards, evaluating every ``--eval-every`` steps on the loop's fixed validation batches;
  reported: the first evaluated step at or below ``--target`` bits/byte and the final bits/byte over the whole
  validation split. One training process at a time.
* **step time** (``time`` mode): the variants' training steps timed in alternating rounds in one process
  (``lmforge.sizing.step_seconds``: forward, backward and the run's optimizer), with the fp32 matmul peak
  and the load average of the same run; median and range over rounds.

Time to target = steps to target × step time. Results append to ``OUT/results.jsonl`` (one line per run), so
a long ablation can be run in pieces and tabled at the end (``table`` mode).

    python benchmarks/bench_speedrun.py train --variants baseline muon --steps 300 --seeds 1337
    python benchmarks/bench_speedrun.py time --variants baseline muon --rounds 5
    python benchmarks/bench_speedrun.py table
    python benchmarks/bench_speedrun.py train --quick      # seconds: a smoke run on a synthetic corpus
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import default_cache_dir, spread, synthetic_documents  # noqa: E402

VARIANTS: dict[str, tuple[str, ...]] = {
    "baseline": (),
    "adamw": ("optimizer.name=adamw",),
    "muon": ("optimizer.name=muon",),
    "lr-3e-3": ("optimizer.lr=3e-3", "optimizer.min_lr=3e-4"),
    "lr-1e-3": ("optimizer.lr=1e-3", "optimizer.min_lr=1e-4"),
    "wsd": ("optimizer.schedule=wsd", "optimizer.cooldown_frac=0.4"),
    "min-lr-0": ("optimizer.min_lr=0.0",),
    "batch-8": ("training.batch_size=8",),
    "batch-32": ("training.batch_size=32",),
    "d192-l6": ("model.d_model=192", "model.n_layers=6", "model.n_heads=6"),
    "d384-l2": ("model.d_model=384", "model.n_layers=2", "model.n_heads=6"),
    "d192-l4": ("model.d_model=192", "model.n_layers=4", "model.n_heads=6"),
    "ctx-128": ("model.context_length=128", "training.batch_size=32"),
    "tied": ("model.tie_embeddings=true",),
    "bos-aligned": ("data.bos_aligned=true",),
    "warmup-0": ("optimizer.warmup_steps=0",),
    "wd-0": ("optimizer.weight_decay=0.0",),
}
"""Each ablation: its settings on top of the speedrun's ``RECIPE`` (recorded with every result, since the recipe
moves as changes are kept: the first rows were measured with an empty recipe, AdamW). A ``+`` joins variants
(``muon+wsd``)."""


def settings_of(name: str) -> tuple[str, ...]:
    """The ``section.key=value`` settings of a variant name (``a+b`` = both; ``vocab-N`` only picks the data)."""
    out: list[str] = []
    for part in name.split("+"):
        if part.startswith("vocab-"):
            continue
        if part not in VARIANTS:
            raise SystemExit(f"bench_speedrun: unknown variant {part!r}; have {', '.join(VARIANTS)} and vocab-N")
        out.extend(VARIANTS[part])
    return tuple(out)


def vocab_of(name: str, default: int) -> int:
    return next((int(p[6:]) for p in name.split("+") if p.startswith("vocab-")), default)


def prepared(root: Path, vocab: int, quick: bool) -> Path:
    """A speedrun folder with ``tokenizer.json`` and ``data/`` for ``vocab`` (made once by the speedrun's own
    tokenizer and data stages: 2 training steps, no chat)."""
    from lmforge.speedrun import speedrun

    out = root / f"{'synthetic' if quick else 'shakespeare'}-v{vocab}"
    if not (out / "data" / "manifest.json").exists():
        corpus = "shakespeare"
        if quick:
            root.mkdir(parents=True, exist_ok=True)
            corpus = str(root / "synthetic.txt")
            Path(corpus).write_text("<|endoftext|>".join(synthetic_documents(100_000)), encoding="utf-8")
        speedrun(out, corpus=corpus, model_size="tiny" if quick else "small", budget="2steps", vocab_size=vocab,
                 device="cpu", progress=False, sft_budget=None, force=True)
    return out


def config_for(name: str, prep: Path, steps: int, seed: int, eval_every: int, quick: bool, target: float | None):
    import torch

    from lmforge.config import to_dict
    from lmforge.speedrun import PRESETS, RECIPE, _run_config
    from lmforge.tokenizer import Tokenizer
    from lmforge.train import load_run_config

    vocab = Tokenizer.load(prep / "tokenizer.json").vocab_size
    cfg = _run_config(PRESETS["tiny" if quick else "small"], vocab, prep / "data", prep / "tokenizer.json",
                      torch.device("cpu"), steps, None, recipe=(*RECIPE, *settings_of(name)), target_bpb=target)
    return load_run_config(base=to_dict(cfg), overrides=[
        f"training.seed={seed}", f"training.eval_every={eval_every}", f"training.checkpoint_every={steps}",
        f"training.log_every={max(1, eval_every // 5)}", "training.keep_last=1"])


def train_mode(a: argparse.Namespace) -> None:
    from lmforge.speedrun import RECIPE, _evaluate
    from lmforge.train import train

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for seed in a.seeds:
        for name in a.variants:
            prep = prepared(Path(a.cache), vocab_of(name, a.vocab), a.quick)
            cfg = config_for(name, prep, a.steps, seed, a.eval_every, a.quick, None)
            with tempfile.TemporaryDirectory(dir=out) as tmp:
                run_dir = out / "runs" / f"{name}-s{seed}-{a.steps}" if a.keep else Path(tmp) / "run"
                t0 = time.perf_counter()
                res = train(cfg, run_dir, progress=False)
                wall = time.perf_counter() - t0
                recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
                curve = [(r["step"], r["val_bpb"]) for r in recs if "val_bpb" in r]
                final = _evaluate(run_dir, "cpu")
            hit = next((s for s, b in curve if b <= a.target), None)
            row = {"variant": name, "recipe": list(RECIPE), "settings": list(settings_of(name)),
                   "vocab": vocab_of(name, a.vocab),
                   "seed": seed, "steps": a.steps, "target": a.target, "steps_to_target": hit,
                   "final_bpb": final["val_bpb"], "curve": curve, "train_seconds": res["train_seconds"],
                   "wall_seconds": wall, "load": os.getloadavg()[0], "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                                           time.gmtime())}
            with open(out / "results.jsonl", "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")
            print(f"{name} seed {seed}: final {final['val_bpb']:.4f} bpb, target {a.target} at step {hit}, "
                  f"curve {[(s, round(b, 3)) for s, b in curve]} ({wall:.0f} s, load {row['load']:.1f})", flush=True)


def time_mode(a: argparse.Namespace) -> None:
    import torch

    from lmforge.hardware import matmul_peak_flops
    from lmforge.sizing import step_seconds
    from lmforge.speedrun import RECIPE

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cfgs = {n: config_for(n, prepared(Path(a.cache), vocab_of(n, a.vocab), a.quick), a.steps, 1337, a.eval_every,
                          a.quick, None) for n in a.variants}
    repeats = 3 if a.quick else 30  # --quick: the smoke run prints the figure, it does not need its best
    peak_before, load_before = matmul_peak_flops("cpu", repeats=repeats), os.getloadavg()[0]
    times: dict[str, list[float]] = {n: [] for n in cfgs}
    for _ in range(a.rounds):
        for n, cfg in cfgs.items():
            times[n].append(step_seconds(cfg, torch.device("cpu"), steps=a.step_repeats))
    peak_after, load_after = matmul_peak_flops("cpu", repeats=repeats), os.getloadavg()[0]
    row = {"mode": "time", "recipe": list(RECIPE), "times": times, "peak_flops": [peak_before, peak_after], "load": [load_before, load_after],
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    with open(out / "results.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
    print(f"fp32 matmul peak {peak_before / 1e9:.0f} / {peak_after / 1e9:.0f} GFLOP/s (before / after); load average "
          f"{load_before:.1f} / {load_after:.1f}; best of {a.step_repeats} steps per round, {a.rounds} rounds\n")
    print("| variant | step time (s): median (range) | / baseline |\n|---|---:|---:|")
    base = statistics.median(next(iter(times.values())))
    for n, ts in times.items():
        print(f"| {n} | {spread(ts)} | "
              f"{statistics.median(ts) / base:.2f}x |")


def table_mode(a: argparse.Namespace) -> None:
    rows = [json.loads(x) for x in (Path(a.out) / "results.jsonl").read_text().splitlines() if x.strip()]
    timed: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        if r.get("mode") == "time":
            for n, ts in r["times"].items():
                timed.setdefault((n, " ".join(r.get("recipe", [])) or "-"), []).extend(ts)
    by: dict[tuple[str, str, int], list[dict]] = {}
    for r in rows:
        if r.get("mode") != "time":
            by.setdefault((r["variant"], " ".join(r.get("recipe", [])) or "-", r["steps"]), []).append(r)
    print("| variant | on recipe | steps | seeds | final bits/byte: median (range) | steps to target: median (range) | "
          "step time (s) | time to target (s) |\n|---|---|---:|---:|---:|---:|---:|---:|")
    for (name, recipe, steps), rs in by.items():
        finals = [r["final_bpb"] for r in rs]
        hits = [r["steps_to_target"] for r in rs if r["steps_to_target"] is not None]
        st = statistics.median(timed[name, recipe]) if (name, recipe) in timed else None
        hit = (f"{statistics.median(hits):.0f} ({min(hits)}..{max(hits)})" + ("" if len(hits) == len(rs) else
               f", {len(rs) - len(hits)} never") if hits else "never")
        ttt = f"{statistics.median(hits) * st:.0f}" if hits and st else "-"
        print(f"| {name} | {recipe} | {steps} | {len(rs)} | {statistics.median(finals):.4f} ({min(finals):.4f}..{max(finals):.4f})"
              f" | {hit} | {f'{st:.3f}' if st else '-'} | {ttt} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=["train", "time", "table"])
    ap.add_argument("--variants", nargs="+", default=["baseline"], help=f"of {', '.join(VARIANTS)}, vocab-N; a+b")
    ap.add_argument("--steps", type=int, default=300, help="training steps (the schedule is fitted to them)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1337])
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--target", type=float, default=1.95, help="bits/byte to reach")
    ap.add_argument("--vocab", type=int, default=4096, help="vocabulary size unless the variant says vocab-N")
    ap.add_argument("--rounds", type=int, default=5, help="time mode: alternating rounds")
    ap.add_argument("--step-repeats", type=int, default=3, help="time mode: steps per round (the best counts)")
    ap.add_argument("--out", default=str(default_cache_dir() / "speedrun-ablation"))
    ap.add_argument("--cache", default=str(default_cache_dir() / "speedrun-data"))
    ap.add_argument("--keep", action="store_true", help="train mode: keep each run in OUT/runs/ (else deleted)")
    ap.add_argument("--quick", action="store_true",
                    help="a synthetic corpus, the tiny preset, the peak from 3 products: a smoke run")
    a = ap.parse_args()
    if a.quick:
        a.steps, a.eval_every, a.rounds, a.step_repeats, a.vocab = min(a.steps, 6), 3, min(a.rounds, 2), 1, 300
    {"train": train_mode, "time": time_mode, "table": table_mode}[a.mode](a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
