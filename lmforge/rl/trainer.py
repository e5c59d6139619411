"""``rl(base, data, run_dir)``: reinforcement learning from verifiable rewards through the one training loop.

What happens, in order (every check runs before anything is written):

1. The base run is opened through :func:`lmforge.run.open_run` (a LoRA run as every reader sees it); it must be a
   chat model (its tokenizer holds the chat tokens: run ``lmforge sft`` first).
2. The run config is the base's model and batch settings, :data:`RL_DEFAULTS` on top (a constant learning rate,
   every step logged), then the user's YAML, then ``--set`` overrides (``chat.sft.sft_config``); the step's
   batch is ``rl.prompts_per_step x rl.samples_per_prompt`` replies (``training.global_batch_size``).
3. The prompts of ``data`` (and ``val_data``) are read as chat task items with exact answers
   (:mod:`lmforge.rl.data`) and kept in ``RUN/rl_data``; the base is recorded in ``RUN/base.json``.
4. With ``val_data``: the starting model is scored (greedy exact match, pass@1, pass@k:
   :mod:`lmforge.rl.evaluate`) into ``RUN/rl.json`` ``{"before": ...}``.
5. :func:`lmforge.train.train` runs with ``source=`` :func:`~lmforge.rl.source.rollout_source`: each step
   samples its rollouts from the current weights, scores them, and takes a policy-gradient step
   (:mod:`lmforge.rl.source`); checkpoints and exact resume as every run.
6. The trained model is scored the same way into ``rl.json`` ``{"after": ...}``; the run card shows both.

Resuming refuses a changed data file or a changed ``rl`` section (reward, K, sampling: the rollouts would change).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from lmforge.chat.format import CHAT_SPECIAL_TOKENS, ChatFormat
from lmforge.chat.sft import base_record, check_finetune_dir, check_lora_targets, lora_record, sft_config
from lmforge.common import atomic_write_text, check_apart, sha256_file
from lmforge.config import load_yaml
from lmforge.data.conversations import ConversationDataset
from lmforge.evals.evaluate import load_model
from lmforge.generate.sampling import check_sampling
from lmforge.rl.data import DATA_DIR, PromptSet, load_prompts, read_prompts, write_prompts
from lmforge.rl.evaluate import evaluate_policy
from lmforge.rl.source import rollout_source
from lmforge.run import BASE_FILE, mark, open_run, source_dirs, write_base
from lmforge.tokenizer import Tokenizer
from lmforge.train import RunConfig, train
from lmforge.train.distributed import barrier, cleanup_distributed, is_main_process, setup_distributed

logger = logging.getLogger("lmforge")

__all__ = ["RL_DEFAULTS", "RESULTS_FILE", "rl", "rl_config", "read_rl_results"]

RL_DEFAULTS: dict[str, dict[str, Any]] = {
    "optimizer": {"name": "adamw", "lr": 3e-5, "min_lr": 0.0, "warmup_steps": 0, "decay_steps": None,
                  "schedule": "constant", "weight_decay": 0.0, "grad_clip": 1.0},
    "training": {"max_steps": 50, "log_every": 1, "eval_every": 1_000_000, "checkpoint_every": 10, "keep_last": 2},
    "rl": {},
}
"""What ``rl`` changes from the base run's config (any of it can be overridden with ``--set``). The learning rate
is small: AdamW moves every weight by about the learning rate whatever the gradient's size, and a policy
gradient from 64 replies is mostly noise, so at 1e-4 the speedrun's SFT model lost its calculator skill (46% ->
0% in 60 steps) where 2e-5..5e-5 took it to 66-80%."""

RESULTS_FILE = "rl.json"
"""The RL run's evaluation before and after training (``{"before", "after"}``), read by the run card."""


def rl_config(base_config: dict[str, Any], vocab_size: int, run_dir: Path, base: dict[str, Any], has_val: bool,
              config: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> RunConfig:
    """The RL run's config (see the module docstring): ``sft_config`` with :data:`RL_DEFAULTS` and prompts, and
    ``training.global_batch_size`` set to the step's replies."""
    def build(extra: Sequence[str]) -> RunConfig:
        return sft_config(base_config, vocab_size, run_dir, base, has_val, config, [*overrides, *extra],
                          defaults=RL_DEFAULTS, kind="prompts", data_dir=DATA_DIR)

    first = build(["training.micro_batch_size=null"])  # before the batch is known, a micro-batch cap cannot apply
    G = first.rl.prompts_per_step * first.rl.samples_per_prompt
    cfg = build([f"training.global_batch_size={G}"])
    try:
        check_sampling(cfg.rl.temperature, cfg.rl.top_k, cfg.rl.top_p)
    except ValueError as e:
        raise ValueError(f"rl: {e}") from None
    return cfg


def read_rl_results(run_dir: str | os.PathLike) -> dict[str, Any]:
    """``RUN/rl.json`` as a dict (``{}`` when the run has none)."""
    p = Path(run_dir) / RESULTS_FILE
    return json.loads(p.read_text(encoding="utf-8")) if p.is_file() else {}


def _record(run_dir: Path, key: str, value: dict[str, Any]) -> None:
    results = read_rl_results(run_dir)
    results[key] = value
    atomic_write_text(run_dir / RESULTS_FILE, json.dumps(results, indent=1) + "\n")


def _check_resume(run_dir: Path, splits: dict[str, str]) -> None:
    """An RL run being resumed: it must be one, and its data files unchanged since it started."""
    cfg = load_yaml(run_dir / "config.yaml") if (run_dir / "config.yaml").is_file() else {}
    if not cfg.get("rl"):
        raise ValueError(f"--run-dir {run_dir} holds a fine-tuning run that is not an RL run; choose a new --run-dir")
    for split, path in splits.items():
        try:
            old = ConversationDataset(run_dir / DATA_DIR, split).info.get("sources") or []
        except ValueError:
            old = []
        if old and [s["sha256"] for s in old] != [sha256_file(path)]:
            raise ValueError(f"the {split} data {path} changed since this run started (sha256 differs from the one "
                             f"recorded in {run_dir / DATA_DIR}); restore the file to resume, or use a new --run-dir")


def _evaluate(run: Path, checkpoint: Any, prompts: PromptSet, cfg: RunConfig) -> dict[str, Any]:
    model, tok, info = load_model(run, checkpoint, device=str(cfg.training.device))
    with torch.inference_mode():
        out = evaluate_policy(model, tok, prompts, cfg.rl, cfg.training.seed)
    out.update(run=str(run), checkpoint=info["checkpoint"], step=info["step"])
    logger.info("%s (step %d): greedy exact match %.3f, pass@1 %.3f, pass@%d %.3f on %d prompts", run.name,
                info["step"], out["greedy_exact_match"]["value"], out["pass_at_1"]["value"], out["k"],
                out["pass_at_k"]["value"], out["n"])
    return out


def rl(base: str | os.PathLike, data: str | os.PathLike, run_dir: str | os.PathLike, *,
       val_data: str | os.PathLike | None = None, config: str | os.PathLike | None = None,
       overrides: Sequence[str] = (), checkpoint: str | os.PathLike | None = None, force: bool = False,
       progress: bool = True) -> dict[str, Any]:
    """Train the chat run ``base`` by RL on the prompts of ``data`` into ``run_dir`` (resumed if it is this RL run
    already); see the module docstring. Returns :func:`lmforge.train.train`'s metrics plus ``prompts``,
    ``skipped`` and, with ``val_data``, ``before`` and ``after`` (:func:`~lmforge.rl.evaluate.evaluate_policy`).
    ``ValueError`` for every bad input, before anything is written."""
    run_dir, base_dir = Path(run_dir).absolute(), Path(base).absolute()
    base_run = open_run(base_dir, checkpoint)
    check_apart(run_dir, *source_dirs(base_dir), flag="--run-dir")
    splits = {"train": str(data)} if val_data is None else {"train": str(data), "val": str(val_data)}
    for path in splits.values():
        check_apart(run_dir, path, flag="--run-dir")
    tok = Tokenizer.load(base_run.tokenizer_path)
    missing = [t for t in CHAT_SPECIAL_TOKENS if t not in tok.special_tokens]
    if missing:
        raise ValueError(f"{base} is not a chat model: its tokenizer lacks the chat tokens ({missing[0]} and "
                         f"{len(missing) - 1} more); fine-tune it first (lmforge sft --base {base} --data FILE.jsonl "
                         "--run-dir SFT), then run rl --base SFT")
    fmt = ChatFormat(tok)
    resuming = check_finetune_dir(run_dir, base_dir, force)
    started = resuming and any((run_dir / "checkpoints").glob("step_*.safetensors"))
    if resuming:
        _check_resume(run_dir, splits)
    record = base_record(base_dir, base_run, run_dir, started)
    cfg = rl_config(base_run.config, tok.vocab_size, run_dir, record, val_data is not None, config, overrides)
    check_lora_targets(cfg)
    prompts = {split: (*read_prompts(path, fmt, cfg.context_length, cfg.rl.max_new_tokens), path)
               for split, path in splits.items()}
    owns_group = not (dist.is_available() and dist.is_initialized())
    info = setup_distributed(cfg.training.device)
    try:
        barrier()
        if info.is_main and not started:  # nothing depends on the prompts before the first checkpoint
            mark(run_dir)
            write_base(run_dir, {**record, "lora": lora_record(cfg)})
            write_prompts(run_dir / DATA_DIR, prompts, tok)
        barrier()
        logger.info("RL of %s on %d prompts (%d skipped: too long, or calling function tools), %d x %d replies per step, reward %s, into %s",
                    base_dir, len(prompts["train"][0]), prompts["train"][1], cfg.rl.prompts_per_step,
                    cfg.rl.samples_per_prompt, cfg.rl.reward, run_dir)
        val = load_prompts(run_dir / DATA_DIR, "val") if val_data is not None else None
        if val is not None and is_main_process() and "before" not in read_rl_results(run_dir):
            _record(run_dir, "before", _evaluate(base_dir, record["checkpoint"] or None, val, cfg))
        barrier()
        metrics = train(cfg, run_dir, progress=progress, force=force, source=rollout_source)
        if val is not None and is_main_process():
            done = read_rl_results(run_dir).get("after") or {}
            if done.get("step") != metrics["step"]:  # not yet scored at this step
                _record(run_dir, "after", _evaluate(run_dir, None, val, cfg))
        barrier()
    finally:
        if owns_group:
            cleanup_distributed()
    results = read_rl_results(run_dir)
    metrics.update(prompts=len(prompts["train"][0]), skipped=prompts["train"][1], base_file=str(run_dir / BASE_FILE),
                   before=results.get("before"), after=results.get("after"))
    return metrics
