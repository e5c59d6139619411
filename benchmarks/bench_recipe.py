"""The training-recipe ablation: tokens to a validation bits/byte, each technique alone and combined.

Every variant is the speedrun's run config at the demo's model size (``lmforge.speedrun._run_config``, the
``small`` preset, the schedule fitted to ``--steps``) on the speedrun's Shakespeare shards, with the **old recipe
pinned** (:data:`BASELINE`: AdamW at the preset's learning rate, whatever the speedrun's defaults are now) and
the variant's ``section.key=value`` settings on top. A ``+`` joins variants (``muon+smear``). A name that starts
with ``recipe`` is the speedrun's own config instead (its preset and ``speedrun.RECIPE``, nothing pinned) with the
rest on top: ``recipe+nc-wd0`` is nanochat's weight decay on the current recipe, ``recipe+nanochat`` all the
``nc-*`` settings together; those compare with ``recipe``, the others with ``baseline``.

* ``train`` (load-independent, deterministic): each (variant, seed) trains until the validation bits/byte (the
  loop's fixed validation batches, every ``--eval-every`` steps) reaches the lowest ``--targets`` or ``--steps``
  end; recorded: the **tokens to reach each target**, the curve, the final bits/byte over the whole validation
  split, and every probe of the speedrun's eval stage (``lmforge.speedrun._evaluate``; its ``copy_*`` and
  ``natural_*`` fields, e.g. the copy probe's loss on the first and the second occurrence of a random sequence),
  each a column of the table. One training process at a time.
* ``time`` (needs a quiet machine): the variants' full-batch training steps timed in alternating rounds
  (``lmforge.sizing.step_seconds``: forward, backward, the run's optimizer) with the fp32 matmul peak measured
  before and after in the same run; median and range over rounds.
* ``table``: both joined; wall time to a target = tokens to it / the variant's quiet tokens per second.
* ``isoflop`` (load-independent, deterministic): the speedrun's recipe at each of ``--shapes``
  (``d<width>x<depth>`` of ``lmforge.sizing.family``, the candidates' family) trained for the **same number of FLOPs** (``--flops``; steps = FLOPs / (FLOPs per
  token x tokens per step), the schedule fitted to them); recorded: parameters, tokens, tokens per parameter and the
  final bits/byte over the speedrun's final-figure batches. ``isoflop-table`` averages the seeds per shape and fits
  the best tokens-per-parameter ratio of each budget (``lmforge.sizing.fit_ratio``): the ratio
  ``--model-size auto`` aims at.

Results append to ``OUT/results.jsonl``, so an ablation can run in pieces.

    python benchmarks/bench_recipe.py train --variants baseline muon --seeds 1337 1338
    python benchmarks/bench_recipe.py train --size tiny --variants recipe recipe+nc-wd0 recipe+nanochat --seeds 1337 1338
    python benchmarks/bench_recipe.py time --variants baseline muon --rounds 5
    python benchmarks/bench_recipe.py table --json recipe.json
    python benchmarks/bench_recipe.py isoflop --shapes d128x2 d192x3 d256x4 --flops 8.6e12 --seeds 1337 1338 --threads 1
    python benchmarks/bench_recipe.py isoflop-table --json isoflop.json
    python benchmarks/bench_recipe.py --quick      # seconds: train, time and table on a synthetic corpus
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
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_json_flag, default_cache_dir, figure, spread, write_json  # noqa: E402
from bench_speedrun import prepared  # noqa: E402  (the speedrun's own tokenizer and shards, made once)

BASELINE: tuple[str, ...] = ("optimizer.name=adamw", "optimizer.weight_decay=0.1", "optimizer.betas=[0.9, 0.95]")
"""Today's recipe before this ablation (the demo's AdamW), pinned so that it stays the reference; with
:data:`BASELINE_SHAPE`: the preset's learning rate and batch as they were."""
BASELINE_SHAPE = {"tiny": (3e-3, 8), "small": (2e-3, 16), "medium": (1.5e-3, 32)}
"""Per ``--size``: the preset's AdamW learning rate (min_lr a tenth of it) and batch size before this ablation."""

VARIANTS: dict[str, tuple[str, ...]] = {
    "baseline": (),
    "muon": ("optimizer.name=muon",),
    "muon-lr": ("optimizer.name=muon", "optimizer.embed_lr=0.02", "optimizer.head_lr=0.004",
                "optimizer.scalar_lr=0.02"),
    "muon-lr-hi": ("optimizer.name=muon", "optimizer.muon_lr=0.04", "optimizer.embed_lr=0.02",
                   "optimizer.head_lr=0.004", "optimizer.scalar_lr=0.02"),
    "muon-nanochat": ("optimizer.name=muon", "optimizer.embed_lr=0.2", "optimizer.head_lr=0.004",
                      "optimizer.scalar_lr=0.02"),
    "scalar-lr": ("optimizer.scalar_lr=0.03",),
    "batch-warmup": ("training.batch_warmup_steps=50",),
    "wsd": ("optimizer.schedule=wsd", "optimizer.cooldown_frac=0.4"),
    "smear": ("model.smear=true",),
    "smear-keys": ("model.smear_keys=true",),
    "value-embeds": ("model.value_embeds=1",),
    "unet": ("model.unet_skips=true",),
    "relu2": ("model.mlp=relu2",),
    "softcap": ("model.logit_softcap=15.0",),
    "zero-init": ("model.zero_init=true", "model.head_init_std=0.001"),
    "qk-norm": ("model.qk_norm=true",),
    "copy-data": ("data.copy_fraction=0.12",),  # repeats, name echoes and random-id repeats: 12% of the tokens
    "key-offset": ("model.key_offset=true",),
    "copy-dense": ("data.copy_fraction=0.5",),  # the most the mixture writes: half of each block's tokens
    "copy-random": ("data.copy_fraction=0.5", "data.copy_sources=[random]"),  # random-id repeats only, dense
    "recipe": (),  # the speedrun's RECIPE (settings_of fills it in): the base of recipe+... variants
    # nanochat's pretraining settings that the speedrun's recipe lacks (scripts/base_train.py, nanochat/gpt.py)
    "nc-wd0": ("optimizer.weight_decay=0.0",),
    "nc-betas": ("optimizer.betas=[0.8, 0.95]", "optimizer.eps=1e-10"),
    "nc-scale": ("optimizer.dmodel_lr_scale=true",),
    "nc-momentum": ("optimizer.muon_momentum_start=0.85", "optimizer.muon_momentum=0.95",
                    "optimizer.muon_momentum_warmup_steps=300"),
    "nc-warmdown": ("optimizer.schedule=wsd", "optimizer.warmup_steps=0", "optimizer.cooldown_frac=0.2",
                    "optimizer.min_lr=0.0"),
    "nc-embed-norm": ("model.embed_norm=true",),
    "nc-qk-scale": ("model.qk_norm=true", "model.qk_norm_scale={nanochat_qk_scale}"),
}
"""Each technique on top of :data:`BASELINE` (or, joined to ``recipe``, of the speedrun's recipe). The model options'
keys are the model's ``ModelConfig`` fields; ``{nanochat_qk_scale}`` is ``1.44 / sqrt(head_dim)`` of the preset
(nanochat multiplies the normalised queries and keys by 1.2 each)."""
VARIANTS["nanochat"] = tuple(s for name, kv in VARIANTS.items() if name.startswith("nc-") for s in kv)
"""Every ``nc-*`` setting together: with ``recipe``, nanochat's pretraining recipe as far as lmforge has it."""


def settings_of(name: str, size: str = "small") -> tuple[str, ...]:
    """The ``section.key=value`` settings of a variant at preset ``size`` (``a+b``: both, later ones win)."""
    out: list[str] = []
    for part in name.split("+"):
        if part not in VARIANTS:
            raise SystemExit(f"bench_recipe: unknown variant {part!r}; have {', '.join(VARIANTS)} (a+b joins)")
        if part == "recipe":
            from lmforge.speedrun import RECIPE

            out.extend(RECIPE)
        out.extend(VARIANTS[part])
    if any("{nanochat_qk_scale}" in s for s in out):
        from lmforge.speedrun import PRESETS

        preset = PRESETS[size]
        scale = 1.44 / (preset.d_model // preset.n_heads) ** 0.5
        out = [s.format(nanochat_qk_scale=f"{scale:.6g}") for s in out]
    return tuple(out)


def reference_of(name: str) -> str:
    """The variant a variant's tokens are compared with: ``recipe`` for ``recipe+...``, else ``baseline``."""
    return "recipe" if name.split("+")[0] == "recipe" else "baseline"


def pinned_of(name: str, size: str) -> tuple[str, ...]:
    """The settings under a variant's own: :data:`BASELINE` with the preset's old learning rate and batch, or none
    for a ``recipe`` variant (the speedrun's config as it is)."""
    if reference_of(name) == "recipe":
        return ()
    lr, batch = BASELINE_SHAPE[size]
    return (*BASELINE, f"optimizer.lr={lr}", f"optimizer.min_lr={lr / 10:.3g}", f"training.batch_size={batch}")


PROBES = ("copy_", "natural_", "name_")
"""The fields of the speedrun's eval record (``lmforge.speedrun._evaluate``) that the table shows, by prefix."""


def config_for(name: str, prep: Path, steps: int, seed: int, eval_every: int, size: str, stop: float | None,
               threads: int | None = None):
    """The run config of variant ``name`` at preset ``size``: the speedrun's, with :func:`pinned_of` (:data:`BASELINE`
    and the preset's old learning rate and batch, or nothing for a ``recipe`` variant) and the variant's settings."""
    import torch

    from lmforge.config import to_dict
    from lmforge.speedrun import PRESETS, _run_config
    from lmforge.tokenizer import Tokenizer
    from lmforge.train import load_run_config

    vocab = Tokenizer.load(prep / "tokenizer.json").vocab_size
    cfg = _run_config(PRESETS[size], vocab, prep / "data", prep / "tokenizer.json", torch.device("cpu"), steps, None,
                      recipe=(*pinned_of(name, size), *settings_of(name, size)), target_bpb=stop)
    return load_run_config(base=to_dict(cfg), overrides=[
        f"training.seed={seed}", f"training.eval_every={eval_every}", f"training.checkpoint_every={steps}",
        f"training.log_every={eval_every // 5 if eval_every % 5 == 0 else 1}", "training.keep_last=1",
        f"training.num_threads={'null' if threads is None else threads}"])


def bpb_curve(run_dir: Path) -> list[tuple[int, float, int]]:
    """``(step, validation bits/byte, tokens trained by then)`` at every evaluation of a run's metrics.jsonl."""
    events = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    tokens = {e["step"]: e["tokens"] for e in events if "tokens" in e}  # train events (eval steps are logged ones)
    return [(e["step"], e["val_bpb"], tokens[e["step"]]) for e in events if "val_bpb" in e]


def tokens_to(curve: list[tuple[int, float, int]], target: float) -> int | None:
    """Tokens trained when the curve ``(step, bpb, tokens)`` first reached ``target`` (None: never)."""
    return next((tok for _, bpb, tok in curve if bpb <= target), None)


def train_mode(a: argparse.Namespace) -> None:
    from lmforge.speedrun import _evaluate
    from lmforge.train import train

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    prep = prepared(Path(a.cache), a.vocab, a.quick)
    for seed in a.seeds:
        for name in a.variants:
            stop = None if a.full else min(a.targets)
            cfg = config_for(name, prep, a.steps, seed, a.eval_every, a.size, stop, a.threads)
            with tempfile.TemporaryDirectory(dir=out) as tmp:
                run_dir = out / "runs" / f"{name}-s{seed}-{a.steps}" if a.keep else Path(tmp) / "run"
                t0 = time.perf_counter()
                res = train(cfg, run_dir, progress=False)
                wall = time.perf_counter() - t0
                curve = bpb_curve(run_dir)
                final = _evaluate(run_dir, "cpu")  # the speedrun's eval stage: whole-split bits/byte, the probes
            probes = {k: v for k, v in final.items() if k.startswith(PROBES)}
            row = {"variant": name, "size": a.size, "settings": list(settings_of(name, a.size)),
                   "baseline": list(pinned_of(name, a.size)), "seed": seed,
                   "steps": a.steps, "threads": a.threads, "stopped_at": res["step"], "targets": a.targets,
                   "tokens_to": {str(t): tokens_to(curve, t) for t in a.targets},
                   "tokens_per_step": cfg.training.batch_size * cfg.context_length, "final_bpb": final["val_bpb"],
                   **probes, "curve": curve,
                   "train_seconds": res["train_seconds"], "wall_seconds": wall, "load": os.getloadavg()[0],
                   "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
            with open(out / "results.jsonl", "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")
            print(f"{name} seed {seed}: tokens to {row['tokens_to']}, stopped at step {res['step']}, final "
                  f"{final['val_bpb']:.4f} bpb, " + ", ".join(f"{k} {_cell(v)}" for k, v in probes.items()) +
                  f" ({wall:.0f} s, load {row['load']:.1f})", flush=True)


def time_mode(a: argparse.Namespace) -> None:
    import torch

    from lmforge.hardware import matmul_peak_flops
    from lmforge.sizing import step_seconds

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    prep = prepared(Path(a.cache), a.vocab, a.quick)
    cfgs = {n: config_for(n, prep, a.steps, 1337, a.eval_every, a.size, None) for n in a.variants}
    repeats = 3 if a.quick else 30
    peak_before, load_before = matmul_peak_flops("cpu", repeats=repeats), os.getloadavg()[0]
    times: dict[str, list[float]] = {n: [] for n in cfgs}
    for _ in range(a.rounds):  # alternating: a, b, a, b, ... (drifts in the machine's speed hit every variant)
        for n, cfg in cfgs.items():
            times[n].append(step_seconds(cfg, torch.device("cpu"), steps=a.step_repeats))
    peak_after, load_after = matmul_peak_flops("cpu", repeats=repeats), os.getloadavg()[0]
    tokens = {n: c.training.batch_size * c.context_length for n, c in cfgs.items()}
    row = {"mode": "time", "size": a.size, "times": times, "tokens_per_step": tokens, "peak_flops": [peak_before, peak_after],
           "load": [load_before, load_after], "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    with open(out / "results.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
    print(f"fp32 matmul peak {peak_before / 1e9:.0f} / {peak_after / 1e9:.0f} GFLOP/s (before / after); load average "
          f"{load_before:.1f} / {load_after:.1f}; best of {a.step_repeats} steps per round, {a.rounds} rounds\n")
    print("| variant | step time (s): median (range) |\n|---|---:|")
    for n, ts in times.items():
        print(f"| {n} | {spread(ts)} |")


def isoflop_mode(a: argparse.Namespace) -> None:
    import torch

    from lmforge.config import to_dict
    from lmforge.sizing import family, flops_of, params_of
    from lmforge.speedrun import EVAL_BATCHES, RECIPE, _run_config
    from lmforge.tokenizer import Tokenizer
    from lmforge.train import evaluate_run, load_run_config, train

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    prep = prepared(Path(a.cache), a.vocab, a.quick)
    vocab = Tokenizer.load(prep / "tokenizer.json").vocab_size
    for seed in a.seeds:
        for shape in a.shapes:
            preset = family(shape)
            per_step = preset.batch_size * preset.context_length
            fpt = flops_of(preset, vocab)
            steps = max(10, round(a.flops / (fpt * per_step)))
            cfg = _run_config(preset, vocab, prep / "data", prep / "tokenizer.json", torch.device("cpu"), steps, None,
                              recipe=RECIPE)
            cfg = load_run_config(base=to_dict(cfg), overrides=[
                f"training.seed={seed}", f"training.eval_every={steps}", f"training.checkpoint_every={steps}",
                f"training.log_every={max(1, steps // 10)}", "training.keep_last=1",
                f"training.num_threads={'null' if a.threads is None else a.threads}"])
            with tempfile.TemporaryDirectory(dir=out) as tmp:
                t0 = time.perf_counter()
                res = train(cfg, Path(tmp) / "run", progress=False)
                wall = time.perf_counter() - t0
                ev = evaluate_run(Path(tmp) / "run", split="val", max_batches=EVAL_BATCHES, device="cpu")
            params = params_of(preset, vocab)
            row = {"mode": "isoflop", "shape": shape, "preset": vars(preset), "seed": seed, "flops": a.flops,
                   "flops_per_token": fpt, "steps": steps, "tokens": steps * per_step, "params": params,
                   "tokens_per_param": steps * per_step / params, "final_bpb": ev["bpb"], "val_tokens": ev["tokens"],
                   "train_seconds": res["train_seconds"], "wall_seconds": wall, "threads": a.threads,
                   "load": os.getloadavg()[0], "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
            with open(out / "isoflop.jsonl", "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")
            print(f"{shape} seed {seed}: {steps} steps, {row['tokens']:,} tokens, {row['tokens_per_param']:.2f} "
                  f"tokens/param -> {ev['bpb']:.4f} bpb ({wall:.0f} s, load {row['load']:.1f})", flush=True)


def isoflop_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per FLOP budget: each shape's seeds averaged (tokens per parameter, final bits/byte) and the fitted best
    ratio (``lmforge.sizing.fit_ratio`` over the shapes' means; absent with fewer than 3 shapes)."""
    from lmforge.sizing import fit_ratio

    out: dict[str, Any] = {}
    for r in rows:
        b = out.setdefault(f"{r['flops']:.3g}", {"shapes": {}})
        s = b["shapes"].setdefault(r["shape"], {"params": r["params"], "tokens": r["tokens"],
                                                "tokens_per_param": r["tokens_per_param"], "seeds": [], "bpb": []})
        s["seeds"].append(r["seed"])
        s["bpb"].append(r["final_bpb"])
    for b in out.values():
        for s in b["shapes"].values():
            s["mean_bpb"] = statistics.mean(s["bpb"])
        points = [(s["tokens_per_param"], s["mean_bpb"]) for s in b["shapes"].values()]
        if len({p for p, _ in points}) >= 3:
            b["fit"] = fit_ratio(points)
    return out


def isoflop_table_mode(a: argparse.Namespace) -> None:
    rows = [json.loads(x) for x in (Path(a.out) / "isoflop.jsonl").read_text().splitlines() if x.strip()]
    summary = isoflop_summary(rows)
    write_json(a.json, {"budgets": summary})
    for flops, b in summary.items():
        print(f"\n{flops} FLOPs per run\n\n| shape | params | tokens | tokens/param | seeds | final bpb (each) | mean |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for shape, s in sorted(b["shapes"].items(), key=lambda kv: kv[1]["params"]):
            print(f"| {shape} | {s['params']:,} | {s['tokens']:,} | {s['tokens_per_param']:.2f} | {len(s['seeds'])} | "
                  f"{', '.join(f'{x:.4f}' for x in s['bpb'])} | {s['mean_bpb']:.4f} |")
        if "fit" in b:
            f = b["fit"]
            how = "the parabola's minimum" if f["bracketed"] else "no minimum inside the measured ratios: the best point"
            print(f"\nfitted best tokens/param: {f['ratio']:.3g} ({how}; {f['loss']:.4f} bpb)")


def _cell(x: Any) -> str:
    """One probe value in the table: a number to 2 decimals, nothing recorded as ``-``, anything else as JSON."""
    if x is None:
        return "-"
    return f"{x:.2f}" if isinstance(x, (int, float)) and not isinstance(x, bool) else json.dumps(x)


def _key(variant: str, row: dict[str, Any]) -> str:
    """A variant's name in the summary: ``muon`` at the demo's size, ``muon @tiny`` at another preset."""
    size = row.get("size", "small")
    return variant if size == "small" else f"{variant} @{size}"


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per variant: seeds, tokens to each target (every seed), final bits/byte, each probe field (``copy_*``,
    ``natural_*``; ``None`` for a seed whose row lacks it), and with a timing row the quiet step time and the wall
    time to each target."""
    timed: dict[str, dict[str, Any]] = {}
    for r in rows:
        if r.get("mode") == "time":
            for n, ts in r["times"].items():
                t = timed.setdefault(_key(n, r), {"times": [], "tokens_per_step": r["tokens_per_step"][n], "peaks": []})
                t["times"] += ts
                t["peaks"] += r["peak_flops"]
    out: dict[str, Any] = {}
    trained = [r for r in rows if r.get("mode") != "time"]
    probes = sorted({k for r in trained for k in r if k.startswith(PROBES)})
    for r in trained:
        v = out.setdefault(_key(r["variant"], r), {"settings": r["settings"], "seeds": [], "tokens_to": {},
                                                   "final_bpb": [], **{k: [] for k in probes}})
        v["seeds"].append(r["seed"])
        for t, tok in r["tokens_to"].items():
            v["tokens_to"].setdefault(t, []).append(tok)
        v["final_bpb"].append(r["final_bpb"])
        for k in probes:
            v[k].append(r.get(k))
    for name, v in out.items():
        if name in timed:
            t = timed[name]
            v["step_seconds"] = t["times"]
            v["peak_flops"] = t["peaks"]
            tps = t["tokens_per_step"] / statistics.median(t["times"])
            v["seconds_to"] = {k: [tok / tps if tok is not None else None for tok in toks]
                               for k, toks in v["tokens_to"].items()}
    return out


def table_mode(a: argparse.Namespace) -> None:
    rows = [json.loads(x) for x in (Path(a.out) / "results.jsonl").read_text().splitlines() if x.strip()]
    summary = summarise(rows)
    write_json(a.json, {"variants": summary, "baseline": list(BASELINE), "recipe": list(settings_of("recipe"))})
    targets = sorted({t for v in summary.values() for t in v["tokens_to"]}, key=float, reverse=True)
    probes = sorted({k for v in summary.values() for k in v if k.startswith(PROBES)})

    def toks(name: str, v: dict[str, Any], t: str) -> str:
        variant, _, size = name.partition(" @")
        xs, base = v["tokens_to"][t], summary.get(reference_of(variant) + (f" @{size}" if size else ""))
        shown = ", ".join("never" if x is None else f"{x:,}" for x in xs)
        if base and t in base["tokens_to"] and None not in xs and None not in base["tokens_to"][t]:
            shown += f" ({statistics.mean(xs) / statistics.mean(base['tokens_to'][t]):.0%})"
        return shown

    print("| variant | seeds | " + " | ".join(f"tokens to {t} bpb (vs baseline or recipe)" for t in targets) +
          " | final bpb | " + "".join(f"{k} | " for k in probes) + "step time (s) | " +
          " | ".join(f"wall to {t} (s)" for t in targets) + " |")
    print("|---|---:|" + "---:|" * (2 * len(targets) + 2 + len(probes)))
    for name, v in summary.items():
        st = spread(v["step_seconds"]) if "step_seconds" in v else "-"
        walls = [", ".join("never" if s is None else figure(s, ".0f") for s in v.get("seconds_to", {}).get(t, []))
                 or "-" for t in targets]
        cells = [toks(name, v, t) if t in v["tokens_to"] else "-" for t in targets]
        probed = "".join(", ".join(_cell(x) for x in v.get(k, [])) + " | " for k in probes)
        print(f"| {name} | {len(v['seeds'])} | " + " | ".join(cells) +
              f" | {', '.join(f'{b:.4f}' for b in v['final_bpb'])} | {probed}{st} | " + " | ".join(walls) + " |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", nargs="?", choices=["train", "time", "table", "isoflop", "isoflop-table"],
                    help="omit with --quick: train, time and table")
    ap.add_argument("--variants", nargs="+", default=["baseline"], help=f"of {', '.join(VARIANTS)}; a+b")
    ap.add_argument("--size", default="small", choices=list(BASELINE_SHAPE),
                    help="the speedrun preset (small: the demo's model); --quick uses tiny")
    ap.add_argument("--steps", type=int, default=500, help="training steps (the schedule is fitted to them)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1337])
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--targets", type=float, nargs="+", default=[2.10, 2.00], help="bits/byte to reach")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=5, help="time mode: alternating rounds")
    ap.add_argument("--step-repeats", type=int, default=3, help="time mode: steps per round (the best counts)")
    ap.add_argument("--out", default=str(default_cache_dir() / "recipe-ablation"))
    ap.add_argument("--cache", default=str(default_cache_dir() / "speedrun-data"))
    ap.add_argument("--full", action="store_true",
                    help="train mode: every run to --steps (no stop at the lowest target): copy probes at one step")
    ap.add_argument("--threads", type=int, default=None,
                    help="train and isoflop modes: torch threads per run (1 on a shared machine: no thread waits on a busy core)")
    ap.add_argument("--keep", action="store_true", help="train mode: keep each run in OUT/runs/ (else deleted)")
    ap.add_argument("--shapes", nargs="+", default=["d128x2", "d192x3", "d256x4"],
                    help="isoflop mode: shapes d<width>x<depth> of lmforge.sizing.family (the candidates' family)")
    ap.add_argument("--flops", type=float, default=8.6e12, help="isoflop mode: training FLOPs of every run")
    ap.add_argument("--quick", action="store_true", help="a synthetic corpus and the tiny preset: a smoke run")
    add_json_flag(ap)
    a = ap.parse_args()
    if a.quick:
        a.steps, a.eval_every, a.rounds, a.step_repeats, a.vocab = min(a.steps, 6), 3, min(a.rounds, 2), 1, 300
        a.size = "tiny"
        a.targets = [100.0, 50.0] if a.targets == [2.10, 2.00] else a.targets
    elif a.mode is None:
        ap.error("give a mode (train, time, table) or --quick")
    for mode in [a.mode] if a.mode else ["train", "time", "table"]:
        {"train": train_mode, "time": time_mode, "table": table_mode, "isoflop": isoflop_mode,
         "isoflop-table": isoflop_table_mode}[mode](a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
