"""The speedrun: corpus -> tokenizer -> shards -> pretraining -> evaluation -> samples -> ``report.md``.

This is what ``make demo`` runs (``lmforge speedrun``): the whole pipeline on one machine in about ten
minutes on 2 CPU cores, by default on Shakespeare's complete works. Each stage is one library call, so
the function below doubles as documentation of how the pieces fit together:

====================  ======================================================  ==========================
stage                 call                                                    artifact in ``--out``
====================  ======================================================  ==========================
corpus                ``corpora.get_dataset`` / ``sources.expand_inputs``      (the input files)
tokenizer             ``tokenizer.train_bpe_from_iterator``                   ``tokenizer.json``
data                  ``data.prepare`` (train/val split by document)          ``data/``
plan                  timed training steps -> shape (``auto``), ``max_steps``  ``speedrun.json``
train                 ``train.train`` (resumes from its checkpoints)           ``run/``
eval                  bits/byte over the validation split; context probes    ``speedrun.json``
samples               ``generate.Generator`` with the KV cache                ``speedrun.json``
chat-data             ``corpus.chat_data.chat_tasks`` (the corpus's words)    ``chat-tasks/``
chat-base             ``evals.exact_match`` on the base + chat tokens          ``speedrun.json``
midtrain              ``chat.midtrain`` (corpus + chat tasks, every token)     ``midtrain/``
chat-mid              ``evals.exact_match`` + bits/byte on the corpus          ``speedrun.json``
sft                   ``chat.sft`` (the same loop, masked loss)                ``sft/``
chat-sft              ``evals.exact_match`` + a ``ChatSession`` sample         ``speedrun.json``
rl                    ``rl.rl`` on the tasks the SFT model half solves        ``rl/``, ``rl-tasks/``
chat-rl               ``evals.exact_match`` on every task again                ``speedrun.json``
report                ``report.write_speedrun_report``                        ``report.md``
====================  ======================================================  ==========================

Re-running the same command reuses every finished stage (recorded with a digest of what it depends on in
``speedrun.json``) and resumes training from its newest checkpoint; ``force=True`` starts over. The
training budget is wall-clock minutes (turned into a number of steps once, by timing a few steps, so
that a resumed run follows the same learning-rate schedule) or an exact number of steps. The chat stages' bodies
live in :mod:`lmforge.speedrun_chat`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import torch

from lmforge.common import atomic_write_text, resolve_device, sha256_file
from lmforge.config import to_dict
from lmforge.corpus import DATASETS, EOT, expand_inputs, get_dataset, iter_documents
from lmforge.data import TokenDataset, load_manifest, prepare
from lmforge.evals.evaluate import load_model
from lmforge.evals.probes import PROBES_VERSION, context_probes
from lmforge.generate import Generator
from lmforge.hardware import resolve_train_dtype, train_peak_flops
from lmforge.model import TransformerLM
from lmforge.report import REPORT_FILE, write_speedrun_report
from lmforge.run import read_base
from lmforge.tokenizer import Tokenizer, train_bpe_from_iterator
from lmforge.train import evaluate_run, load_run_config, train
from lmforge import sizing
from lmforge.sizing import Preset, plan_tokens, step_seconds

from lmforge.speedrun_chat import (  # noqa: F401  (the chat stages; tests import them from here too)
    CHAT_SAMPLE, RL_DIR, RL_SETTINGS, RL_TASKS_DIR, RL_WINDOW, SFT_SETTINGS, _chat_base, _chat_data, _chat_data_rules,
    _chat_eval, _chat_sft, _digest, _jsonable, _rl, _sft, _sft_steps, MIDTRAIN_DIR, MIDTRAIN_CHAT_FRACTION,
    MIDTRAIN_SETTINGS, _chat_mid, _midtrain)

logger = logging.getLogger("lmforge")

__all__ = ["speedrun", "parse_budget", "PRESETS", "Preset", "AUTO"]


PRESETS: dict[str, Preset] = {
    # smoke tests: learns little, runs anywhere in seconds
    "tiny": Preset(d_model=64, n_layers=2, n_heads=4, context_length=64, batch_size=8, lr=3e-3),
    # the CPU demo: 4.3M matmul parameters; 1.7-2.7k tokens/s measured on a busy 2-core VM (about 200-300 steps,
    # a third to half an epoch of Shakespeare in 8 minutes), more on an idle machine
    "small": Preset(d_model=256, n_layers=4, n_heads=8, context_length=256, batch_size=16, lr=2e-3),
    # for a GPU (or a patient CPU)
    "medium": Preset(d_model=384, n_layers=6, n_heads=6, context_length=256, batch_size=32, lr=1.5e-3),
}
AUTO = "auto"
"""The ``model_size`` that sizes the model to the machine and the budget (:func:`lmforge.sizing.size`)."""

DEFAULT_CORPUS = "shakespeare"
SAMPLE_PROMPTS = ["ROMEO:\n", "To be, or not to be", "KING HENRY.\n", "The "]
STATE_FILE = "speedrun.json"
CHAT_DIR = "chat-tasks"
_STAGES = ("tokenizer", "data", "plan", "train", "eval", "samples", "chat-data", "chat-base", "midtrain", "chat-mid",
           "sft", "chat-sft", "rl",
           "chat-rl")
MIDTRAIN_SHARE = 0.4
"""The part of the chat budget ``midtrain_budget="auto"`` gives to midtraining (the demo: 1 of 2.5 minutes)."""
EVAL_BATCHES = 64
"""Validation batches of the final figure (the split's first 64, or all of a smaller split) and of the check that
judges ``--target-bpb``: a target is judged on the figure the report states."""
RECIPE: tuple[str, ...] = ("optimizer.name=muon", "optimizer.embed_lr=0.2", "optimizer.head_lr=0.004",
                           "optimizer.scalar_lr=0.02", "optimizer.weight_decay=0.0", "optimizer.betas=[0.8, 0.95]",
                           "optimizer.eps=1e-10", "optimizer.muon_momentum_start=0.85", "optimizer.muon_momentum=0.95",
                           "optimizer.muon_momentum_warmup_steps=300")
"""The pretraining recipe: ``section.key=value`` settings on top of the preset and the fitted schedule, each kept
because it measured better (``benchmarks/bench_recipe.py``, ``benchmarks/bench_speedrun.py``; docs/benchmarks.md,
"Training recipe ablation"): Muon for the blocks' matrices, its momentum raised from 0.85 to 0.95 over the first 300
steps, and AdamW at learning rates of their own for the embeddings (0.2) and head (0.004: nanochat's base rates,
without its ``(d_model / 768) ** -0.5`` scaling) and the norm gains (0.02), with nanochat's betas (0.8, 0.95), eps
1e-10 and no weight decay. The schedule is :func:`_run_config`'s (warmup and a cosine to a tenth), not nanochat's;
docs/guide/pretraining.md lists the differences. ``optimizer.lr`` is then no group's rate: only the schedule's shape
comes from it."""


def parse_budget(budget: str | int | float) -> tuple[str, float]:
    """``"8"``/``"8min"``/``"8m"`` -> ``("minutes", 8.0)``; ``"300steps"`` -> ``("steps", 300)``."""
    text = str(budget).strip().lower().replace(" ", "")
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(min|m|minutes?|steps?)?", text)
    if m is None or float(m.group(1)) <= 0:
        raise ValueError(f"budget {budget!r} is not understood; give minutes ('8', '8min') or steps ('300steps')")
    unit = m.group(2) or "min"
    if unit.startswith("step"):
        if not float(m.group(1)).is_integer():
            raise ValueError(f"budget {budget!r}: a number of steps must be a whole number")
        return "steps", float(int(m.group(1)))
    return "minutes", float(m.group(1))


# ==================================================================================================
# Bookkeeping: which stages are done, and with what inputs
# ==================================================================================================
def _refuse_foreign(out: Path) -> None:
    """``ValueError`` when ``out`` is a non-empty folder that no speedrun wrote (``--force`` never empties it)."""
    if out.is_dir() and any(out.iterdir()) and not (out / STATE_FILE).exists():
        raise ValueError(f"{out} exists and is not a speedrun directory (no {STATE_FILE}); choose another --out, or "
                         "empty it")


class _State:
    """``speedrun.json``: the settings of the run and one record per finished stage (written atomically)."""

    def __init__(self, out: Path, settings: dict[str, Any], force: bool) -> None:
        self.path = out / STATE_FILE  # a foreign ``out`` was refused already (speedrun: _refuse_foreign)
        if force and out.exists() and any(out.iterdir()):
            _remove_artifacts(out)
        if self.path.exists():
            self.data = json.loads(self.path.read_text(encoding="utf-8"))
            old = self.data.get("settings", {})
            changed = {k: (old.get(k), v) for k, v in settings.items() if old.get(k) != v}
            if changed:
                what = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changed.items())
                raise ValueError(f"{out} holds a speedrun with other settings ({what}); pass --force to start over "
                                 "there, or use another --out")
        else:
            self.data = {"settings": settings, "stages": {}}
        out.mkdir(parents=True, exist_ok=True)
        self.save()

    def done(self, stage: str, key: str) -> dict[str, Any] | None:
        """The record of ``stage`` if it finished with the same inputs (``key``), else None."""
        rec = self.data["stages"].get(stage)
        return rec if rec is not None and rec.get("key") == key else None

    def finish(self, stage: str, key: str, seconds: float, info: dict[str, Any]) -> dict[str, Any]:
        rec = {"key": key, "seconds": round(seconds, 2), **info}
        self.data["stages"][stage] = rec
        self.save()
        return rec

    def save(self) -> None:
        atomic_write_text(self.path, json.dumps(self.data, indent=1) + "\n")


def _remove_artifacts(out: Path) -> None:
    """Delete what a speedrun wrote in ``out`` (only its own artifacts, never other files)."""
    logger.info("--force: removing the previous speedrun in %s", out)
    for name in ("tokenizer.json", REPORT_FILE, "loss.png", STATE_FILE):
        (out / name).unlink(missing_ok=True)
    for name in ("data", "run", CHAT_DIR, MIDTRAIN_DIR, "sft", RL_DIR, RL_TASKS_DIR):
        shutil.rmtree(out / name, ignore_errors=True)


def _resolve_corpus(corpus: str) -> list[Path]:
    """Input files of ``corpus``: a named dataset (``shakespeare``, ``tinystories``, ...) or a path/glob."""
    if corpus in DATASETS and not Path(corpus).exists():
        return get_dataset(corpus)
    if re.fullmatch(r"[a-z][a-z0-9-]*", corpus) and not Path(corpus).exists():
        raise ValueError(f"corpus {corpus!r} is neither a named dataset ({', '.join(sorted(DATASETS))}) nor an "
                         "existing path/glob; give text files (e.g. --corpus 'data/*.txt') or --corpus shakespeare")
    return expand_inputs(corpus)


def _train_tokenizer(paths: list[Path], vocab_size: int, dest: Path, progress: bool) -> dict[str, Any]:
    vocab, merges = train_bpe_from_iterator(iter_documents(paths), vocab_size, [EOT], progress=progress)
    tok = Tokenizer(vocab, merges, [EOT])
    tok.save(dest, force=True)
    return {"fingerprint": tok.fingerprint(), "vocab_size": tok.vocab_size}


def _data_stats(data_dir: Path) -> dict[str, Any]:
    out = {}
    for split in ("train", "val"):
        try:
            ds = TokenDataset(data_dir, split)
        except ValueError as e:
            raise ValueError(f"no {split} data after splitting the corpus by document ({e}); the speedrun needs "
                             f"several documents separated by {EOT} (or several files) so that both "
                             "splits get some; raise val_fraction or add documents") from e
        out[split] = {"tokens": ds.num_tokens, "documents": ds.num_documents, "text_bytes": ds.text_bytes,
                      "bytes_per_token": ds.bytes_per_token}
    return out


def _run_config(preset: Preset, vocab_size: int, data_dir: Path, tokenizer: Path, device: Any, max_steps: int,
                peak_flops: float | None, recipe: tuple[str, ...] = RECIPE, target_bpb: float | None = None) -> Any:
    """The pretraining run's config: ``preset``'s shapes, the schedule fitted to ``max_steps``, then ``recipe``."""
    model_vocab = 64 * math.ceil(vocab_size / 64)  # a multiple of 64 keeps the LM-head matmul aligned
    warmup = max(0, min(100, max_steps // 10, max_steps - 1))
    return load_run_config(overrides=recipe, base={
        "model": {"vocab_size": model_vocab, "context_length": preset.context_length, "d_model": preset.d_model,
                  "n_layers": preset.n_layers, "n_heads": preset.n_heads, "tie_embeddings": False},
        "optimizer": {"lr": preset.lr, "min_lr": float(f"{preset.lr / 10:.3g}"), "warmup_steps": warmup, "weight_decay": 0.1,
                      "betas": [0.9, 0.95], "grad_clip": 1.0},
        "training": {"max_steps": max_steps, "batch_size": preset.batch_size, "device": str(device),
                     "dtype": "auto", "seed": 1337, "target_val_bpb": target_bpb,
                     "log_every": max(1, min(10, max_steps // 20)),
                     "eval_every": max(10, max_steps // (5 if target_bpb is None else 20)),
                     "eval_batches": 10, "target_eval_batches": EVAL_BATCHES,
                     "checkpoint_every": max(10, max_steps // 5), "keep_last": 2, "peak_flops": peak_flops},
        "data": {"dir": str(data_dir), "tokenizer": str(tokenizer), "val_split": "val"},
    })


def _plan(preset: Preset | None, vocab_size: int, data_dir: Path, tokenizer: Path, device: Any,
          budget: tuple[str, float]) -> dict[str, Any]:
    """Decide the shape and ``max_steps``: ``preset``, or (``None``) the candidate :func:`lmforge.sizing.size`
    chooses from the candidates' measured step times; then the budget in steps, or minutes divided by the shape's
    measured step time. The record keeps the shape (``preset``), so a resumed run trains the same one."""
    kind, amount = budget
    # CUDA: the datasheet figure. A budget in steps needs the peak only for the MFU it reports: a short measurement
    # (5 products, as the run card's) instead of the 30 that a budget in minutes plans its steps beside.
    quick = {} if kind == "minutes" else {"repeats": 5}
    # elsewhere the matmul peak measured in the precision the run trains in (bf16 where native: auto)
    dtype = _run_config(preset or PRESETS["tiny"], vocab_size, data_dir, tokenizer, device, 10, None).training.dtype
    peak, peak_dtype = (None, None) if device.type == "cuda" else train_peak_flops(dtype, device, **quick)
    peak = None if peak is None else float(f"{peak:.4g}")
    info: dict[str, Any] = {"peak_flops": peak, "peak_dtype": peak_dtype}

    def timed(shape: Preset) -> float:
        return step_seconds(_run_config(shape, vocab_size, data_dir, tokenizer, device, 10, peak), device)

    if preset is None:
        info["sizing"] = sizing.size(budget, vocab_size, TokenDataset(data_dir, "train").num_tokens, timed)
        row = next(r for r in info["sizing"]["candidates"] if r["name"] == info["sizing"]["chosen"])
        preset, step_s = Preset(**row["preset"]), row["step_seconds"]
        logger.info("plan: model size %s", info["sizing"]["text"])
    else:
        step_s = None if kind == "steps" else timed(preset)
    max_steps = plan_tokens(preset, budget, step_s)[0]
    if step_s is None:
        logger.info("plan: %d steps as asked", max_steps)
    else:
        logger.info("plan: %.3f s/step measured -> %d steps (~%.1f min)", step_s, max_steps, max_steps * step_s / 60)
    return {"max_steps": max_steps, "step_seconds": step_s, "preset": dataclasses.asdict(preset), **info}


def _evaluate(run_dir: Path, device: Any, max_batches: int = EVAL_BATCHES) -> dict[str, Any]:
    """Loss, perplexity and bits per byte of the final checkpoint over (up to ``max_batches`` of) the validation
    split, and its context probes (:func:`~lmforge.evals.probes.context_probes`, keys
    :data:`~lmforge.evals.probes.PROBE_FIELDS`): loss on the first and second occurrence of random sequences of the
    ids the training split uses (60 ids, or half the context where that is shorter), in order and shuffled; of
    validation passages given twice; and of a made-up name mentioned twice."""
    ev = evaluate_run(run_dir, split="val", max_batches=max_batches, device=str(device))
    model, tok, _ = load_model(run_dir, device=str(device))
    data = load_run_config(run_dir / "config.yaml").data
    probes = context_probes(model, tok, TokenDataset(data.dir, data.train_split),
                            TokenDataset(data.dir, data.val_split) if data.val_split else None,
                            model.cfg.context_length)
    return {"checkpoint": ev["checkpoint"], "step": ev["step"], "val_loss": ev["loss"], "val_ppl": ev["ppl"],
            "val_bpb": ev["bpb"], "val_tokens": ev["tokens"], **probes}


def _target_summary(run_dir: Path, target: float, train_rec: dict[str, Any], plan: dict[str, Any],
                    ev: dict[str, Any]) -> dict[str, Any]:
    """Whether pretraining reached ``target`` bits/byte, when, and the best it reached, all judged on the figure the
    report states: the final evaluation ``ev`` and the loop's target checks over the same :data:`EVAL_BATCHES`
    (a periodic estimate on fewer batches reaching the target is not the target reached)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
               if line.strip()]
    judged = {r["step"]: r["target_eval_bpb"] for r in records if r.get("target_eval_bpb") is not None}
    judged.setdefault(ev["step"], ev["val_bpb"])
    vals = sorted(judged.items())
    best_step, best = min(vals, key=lambda v: v[1])
    hit = next(((s, b) for s, b in vals if b <= target), None)
    rec: dict[str, Any] = {"target_bpb": target, "reached": hit is not None, "best_bpb": best, "best_step": best_step,
                           "tokens": ev["val_tokens"]}
    if hit is not None:
        step_s = plan.get("step_seconds")
        rec.update(step=hit[0], bpb=hit[1], train_seconds=train_rec["seconds"],
                   projected_quiet_seconds=hit[0] * step_s if step_s else None)
        quiet = f"; {hit[0]} steps x {step_s:.3f} s/step = {hit[0] * step_s:.0f} s at the planned speed" if step_s else ""
        rec["text"] = (f"reached the target of {target:g} bits/byte at step {hit[0]} ({hit[1]:.4f} over "
                       f"{ev['val_tokens']:,} validation tokens) after {train_rec['seconds']:.0f} s of "
                       f"pretraining{quiet}")
    else:
        never = " (a target <= 0 can never be reached)" if target <= 0 else ""
        rec["text"] = (f"did not reach the target of {target:g} bits/byte within the budget{never}; the best over "
                       f"{ev['val_tokens']:,} validation tokens was {best:.4f} at step {best_step}")
    return rec


def _samples(run_dir: Path, device: Any, max_new_tokens: int) -> dict[str, Any]:
    """Continue each of :data:`SAMPLE_PROMPTS` (temperature 0.8, top-k 50, seed 0) and time the generation."""
    gen = Generator.from_run(run_dir, device=str(device))
    rows = [gen.tokenizer.encode(p) for p in SAMPLE_PROMPTS]
    max_new_tokens = min(max_new_tokens, gen.cfg.context_length - max(map(len, rows)) + 1)  # what the context allows
    t0 = time.perf_counter()
    ids = gen.generate_ids(rows, max_new_tokens, temperature=0.8, top_k=50, seed=0)
    dt = time.perf_counter() - t0
    return {"samples": [{"prompt": p, "text": gen.tokenizer.decode(r)} for p, r in zip(SAMPLE_PROMPTS, ids)],
            "generation_tokens_per_s": sum(map(len, ids)) / dt, "generation_batch": len(rows)}


def speedrun(out: str | os.PathLike = "runs/speedrun", corpus: str = DEFAULT_CORPUS, model_size: str = "small",
             budget: str | int | float = "8min", device: str = "auto", vocab_size: int = 4096,
             val_fraction: float = 0.1, sample_tokens: int = 200, force: bool = False,
             progress: bool = True, sft_budget: str | int | float | None = "2.5min",
             chat_eval_items: int = 40, target_bpb: float | None = None,
             rl_budget: str | int | float | None = "2min",
             midtrain_budget: str | int | float | None = None) -> dict[str, Any]:
    """Run (or resume) the whole pipeline in ``out`` and write ``out/report.md``; returns the stage records.

    ``corpus``: ``"shakespeare"`` or a path/glob of text/jsonl/parquet files. ``model_size``: a key of
    :data:`PRESETS`, or ``"auto"``: the shape of :data:`lmforge.sizing.CANDIDATES` that the plan stage chooses for
    this machine and budget (its record ``stages["plan"]["sizing"]``: the candidates, their measured step times,
    the rule and the choice; a resumed run keeps the recorded shape). ``budget``: training minutes (``"8min"``) or steps (``"300steps"``). ``device``:
    ``auto`` uses CUDA (with bf16) when present. ``sft_budget``: the chat fine-tuning on the built-in chat
    tasks after pretraining (minutes or steps, like ``budget``; ``None`` skips the chat stages), scored before
    and after on the first ``chat_eval_items`` validation items of each task. ``target_bpb``: stop pretraining
    once the validation bits per byte over :data:`EVAL_BATCHES` (the final figure's batches, scored whenever the
    periodic estimate reaches the target) is at or below it, and report the time to it (a target <= 0, or one not
    reached within the budget, is reported at the end with the best reached); the record is ``stages["target"]``.
    ``rl_budget``: reinforcement learning after SFT on the tasks whose exact match lies in :data:`RL_WINDOW`
    (minutes or steps; ``None`` or ``0`` skips it), then every task scored again. ``midtrain_budget``: the part of
    ``sft_budget`` (in its unit; ``"auto"``: :data:`MIDTRAIN_SHARE` of it) given to midtraining before SFT (:mod:`lmforge.chat.midtrain`: the corpus mixed
    with the chat tasks, :data:`MIDTRAIN_CHAT_FRACTION` of the rows; ``None`` or ``0`` skips it), the rest to SFT;
    the midtrained model is scored on the tasks and on the corpus's validation bits per byte.
    """
    if model_size not in PRESETS and model_size != AUTO:
        raise ValueError(f"unknown model size {model_size!r}; choose {AUTO} or one of {', '.join(PRESETS)}")
    if not 256 + 1 <= vocab_size <= 65536:
        raise ValueError(f"vocab_size must be in [257, 65536] (256 bytes + {EOT} at least), got {vocab_size}")
    if sample_tokens < 1:
        raise ValueError(f"sample_tokens must be >= 1, got {sample_tokens}")
    preset, plan_budget = PRESETS.get(model_size), parse_budget(budget)
    chat_budget = parse_budget(sft_budget) if sft_budget is not None else None
    off = lambda b: b is None or re.fullmatch(r"0*\.?0*(min|m|minutes?|steps?)?",  # noqa: E731
                                              str(b).strip().lower()) is not None
    rl_plan = parse_budget(rl_budget) if not off(rl_budget) and chat_budget is not None else None
    if midtrain_budget == "auto" and chat_budget is not None:  # MIDTRAIN_SHARE of the chat budget, in its unit
        part = chat_budget[1] * MIDTRAIN_SHARE
        midtrain_budget = f"{int(part)}steps" if chat_budget[0] == "steps" else f"{part:g}min"
    mid_plan = parse_budget(midtrain_budget) if not off(midtrain_budget) and chat_budget is not None else None
    if mid_plan is not None and (mid_plan[0] != chat_budget[0] or mid_plan[1] >= chat_budget[1]):
        raise ValueError(f"midtrain_budget {midtrain_budget!r} is a part of sft_budget {sft_budget!r}: give it in the "
                         "same unit (minutes or steps) and smaller, so that SFT keeps the rest")
    if isinstance(chat_eval_items, bool) or not isinstance(chat_eval_items, int) or chat_eval_items < 1:
        raise ValueError(f"chat_eval_items must be a positive integer, got {chat_eval_items!r}")
    if target_bpb is not None and not (isinstance(target_bpb, (int, float)) and math.isfinite(target_bpb)):
        raise ValueError(f"target_bpb must be a number of bits per byte, got {target_bpb!r}")
    if target_bpb is not None and target_bpb <= 0:
        logger.warning("--target-bpb %g: bits per byte are never <= 0, so the target cannot be reached; training "
                       "the whole budget", target_bpb)
    dev = resolve_device(device)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"speedrun output {out} is an existing file; choose another --out directory")
    _refuse_foreign(out)  # before the corpus: a named one may be downloaded first
    t_start = time.perf_counter()
    paths = _resolve_corpus(corpus)
    inputs = [(str(p), p.stat().st_size, sha256_file(p)) for p in paths]
    settings = {"corpus": corpus, "inputs": _digest(inputs), "vocab_size": vocab_size, "model_size": model_size,
                "budget": list(plan_budget), "val_fraction": val_fraction,
                "sft_budget": list(chat_budget) if chat_budget else None, "chat_eval_items": chat_eval_items,
                "target_bpb": target_bpb}
    state = _State(out, settings, force)
    tok_path, data_dir, run_dir = out / "tokenizer.json", out / "data", out / "run"
    ran: list[str] = []
    logger.info("speedrun in %s: %d input file(s), model %s, budget %s, device %s", out, len(paths), model_size,
                budget, dev)

    def stage(name: str, key: str, fn: Callable[[], dict[str, Any]],
              valid: Callable[[dict[str, Any]], bool] = lambda rec: True) -> dict[str, Any]:
        """Reuse ``name``'s record if it finished with the same ``key`` and its artifact is intact; else run it."""
        rec = state.done(name, key)
        if rec is not None and valid(rec):
            logger.info("stage %s: reusing the finished result", name)
            return rec
        logger.info("stage %s: running", name)
        t0 = time.perf_counter()
        info = fn()
        ran.append(name)
        return state.finish(name, key, time.perf_counter() - t0, info)

    # ---- tokenizer: byte-level BPE trained on the corpus ------------------------------------------------
    tok = stage("tokenizer", _digest(settings["inputs"], vocab_size),
                lambda: _train_tokenizer(paths, vocab_size, tok_path, progress),
                lambda rec: tok_path.exists() and Tokenizer.load(tok_path).fingerprint() == rec["fingerprint"])
    # ---- data: train/val shards ------------------------------------------------------------------------
    stage("data", _digest(settings["inputs"], tok["fingerprint"], val_fraction),
          lambda: _prepare(paths, tok_path, data_dir, val_fraction, rebuild="tokenizer" in ran, progress=progress),
          lambda rec: _shards_fingerprint(data_dir) == tok["fingerprint"])
    # ---- plan: how many steps fit in the budget --------------------------------------------------------
    shapes = (dataclasses.asdict(preset) if preset is not None else  # auto: what the choice depends on
              {AUTO: {n: dataclasses.asdict(p) for n, p in sizing.CANDIDATES.items()}, "ratio": sizing.TOKENS_PER_PARAM,
               "max_epochs": sizing.MAX_EPOCHS})
    plan = stage("plan", _digest(tok["fingerprint"], shapes, plan_budget),
                 lambda: _plan(preset, vocab_size, data_dir, tok_path, dev, plan_budget))
    stop_at = target_bpb if target_bpb is not None and target_bpb > 0 else None
    shape = Preset(**plan["preset"]) if "preset" in plan else preset  # a plan recorded before it kept its shape
    cfg = _run_config(shape, vocab_size, data_dir, tok_path, dev, plan["max_steps"], plan["peak_flops"],
                      target_bpb=stop_at)
    # ---- train (resumes from the newest checkpoint in run/) -------------------------------------------
    cfg_dict = to_dict(cfg)
    train_key = _digest({k: v for k, v in cfg_dict.items() if k != "training"},
                        {k: v for k, v in cfg_dict["training"].items() if k != "device"})
    tr = stage("train", train_key, lambda: _jsonable(train(cfg, run_dir, progress=progress)),
               lambda rec: Path(rec.get("checkpoint") or "").exists())
    # ---- eval: validation loss and bits per byte of the final model ------------------------------------
    ev = stage("eval", _digest(tr["checkpoint"], tr["step"], "copy-probe", PROBES_VERSION),
               lambda: _evaluate(run_dir, dev))
    logger.info("final validation loss %.4f (%.4f bits/byte)", ev["val_loss"], ev["val_bpb"])
    if target_bpb is not None:  # not a stage: a reading of the run's metrics, redone each time
        state.data["stages"]["target"] = _target_summary(run_dir, target_bpb, tr, plan, ev)
        state.save()
        logger.info("%s", state.data["stages"]["target"]["text"])
    # ---- samples ---------------------------------------------------------------------------------------
    stage("samples", _digest(tr["checkpoint"], tr["step"], SAMPLE_PROMPTS, sample_tokens),
          lambda: _samples(run_dir, dev, sample_tokens))

    # ---- chat: the built-in tasks, scored before and after fine-tuning on them ---------------------------
    if chat_budget is not None:
        train_path, val_path = out / CHAT_DIR / "train.jsonl", out / CHAT_DIR / "val.jsonl"
        chat = stage("chat-data", _digest(settings["inputs"], _chat_data_rules(), tok["fingerprint"]),
                     lambda: _chat_data(paths, out / CHAT_DIR, tokenizer=tok_path),
                     lambda rec: val_path.exists() and sha256_file(val_path) == rec["val_sha256"])
        stage("chat-base", _digest(tr["checkpoint"], tr["step"], chat["val_sha256"], chat_eval_items),
              lambda: _chat_base(run_dir, val_path, dev, chat_eval_items))
        # ---- midtrain: the corpus mixed with the chat tasks, every token trained (a part of the chat budget) ----
        sft_base, sft_budget_left, base_key = run_dir, chat_budget, (tr["checkpoint"], tr["step"])
        mid_dir = out / MIDTRAIN_DIR
        if mid_plan is not None:
            mid_steps = _sft_steps(plan, mid_plan)
            mid_key = _digest(tr["checkpoint"], tr["step"], chat, mid_steps, MIDTRAIN_SETTINGS, MIDTRAIN_CHAT_FRACTION)
            old_mid = state.data["stages"].get("midtrain")
            if mid_dir.exists() and ("train" in ran or (old_mid is not None and old_mid.get("key") != mid_key)):
                shutil.rmtree(mid_dir)  # the base or the steps changed: midtrain from the start
            mt = stage("midtrain", mid_key, lambda: _midtrain(run_dir, train_path, mid_dir, mid_steps, dev, progress),
                       lambda rec: Path(rec.get("checkpoint") or "").exists())
            stage("chat-mid", _digest(mt["checkpoint"], mt["step"], chat["val_sha256"], chat_eval_items, EVAL_BATCHES),
                  lambda: _chat_mid(mid_dir, val_path, data_dir, dev, chat_eval_items, EVAL_BATCHES))
            sft_base, base_key = mid_dir, (mt["checkpoint"], mt["step"])
            sft_budget_left = (chat_budget[0], chat_budget[1] - mid_plan[1])
        else:
            for name in ("midtrain", "chat-mid"):  # a midtraining of an earlier run no longer shown
                state.data["stages"].pop(name, None)
        sft_dir, steps = out / "sft", _sft_steps(plan, sft_budget_left)
        sft_key = _digest(*base_key, chat, steps, SFT_SETTINGS)
        old_sft, started_on = state.data["stages"].get("sft"), (read_base(sft_dir) or {}).get("run")
        if sft_dir.exists() and ("train" in ran or "midtrain" in ran or (old_sft is not None and old_sft.get("key") !=
                                 sft_key) or started_on not in (None, str(sft_base.absolute()))):
            shutil.rmtree(sft_dir)  # another base or length: fine-tune from the start (else an interrupted one resumes)
        ft = stage("sft", sft_key, lambda: _sft(sft_base, train_path, val_path, sft_dir, steps, dev, progress),
                   lambda rec: Path(rec.get("checkpoint") or "").exists())
        after_sft = stage("chat-sft", _digest(ft["checkpoint"], ft["step"], chat["val_sha256"], chat_eval_items,
                                              CHAT_SAMPLE), lambda: _chat_sft(sft_dir, val_path, dev, chat_eval_items))
        # ---- rl: the tasks the SFT model half solves, learned from their exact-match reward ----------------
        if rl_plan is not None:
            tasks_dir, rl_dir = out / RL_TASKS_DIR, out / RL_DIR
            rl_key = _digest(ft["checkpoint"], ft["step"], after_sft["tasks"], chat["train_sha256"], rl_plan,
                             RL_SETTINGS, RL_WINDOW)
            old_rl = state.data["stages"].get("rl")
            if rl_dir.exists() and ("sft" in ran or (old_rl is not None and old_rl.get("key") != rl_key)):
                shutil.rmtree(rl_dir)  # the SFT model or the RL settings changed: start RL from the SFT model again
            rec = stage("rl", rl_key, lambda: _rl(after_sft, out / CHAT_DIR, tasks_dir, sft_dir, rl_dir, rl_plan, dev,
                                                  progress),
                        lambda rec: not rec["tasks"] or Path(rec.get("checkpoint") or "").exists())
            if not rec["tasks"]:
                state.data["stages"].pop("chat-rl", None)  # a score of an earlier RL run no longer shown
            else:
                stage("chat-rl", _digest(rec["checkpoint"], rec["step"], chat["val_sha256"], chat_eval_items),
                      lambda: _chat_eval(*load_model(rl_dir, device=str(dev))[:2], val_path, chat_eval_items))

    # ---- report ---------------------------------------------------------------------------------------
    stages = [s for s in _STAGES if s in state.data["stages"]]
    report = write_speedrun_report(out, cfg, state.data, ran, time.perf_counter() - t_start, dev, stages)
    logger.info("wrote %s", report)
    return state.data["stages"]



def _shards_fingerprint(data_dir: Path) -> str | None:
    """Tokenizer fingerprint of a finished shard directory (None if absent, unfinished or inconsistent)."""
    try:
        m = load_manifest(data_dir)
    except (ValueError, OSError):
        return None
    return None if m.get("pending") else m["tokenizer"]["fingerprint"]


def _prepare(paths: list[Path], tok_path: Path, data_dir: Path, val_fraction: float, rebuild: bool,
             progress: bool) -> dict[str, Any]:
    tok = Tokenizer.load(tok_path)
    stale = data_dir.exists() and _shards_fingerprint(data_dir) not in (None, tok.fingerprint())
    prepare(tok, paths, data_dir, val_fraction=val_fraction, force=rebuild or stale, progress=progress)
    stats = _data_stats(data_dir)
    return {"splits": stats}
