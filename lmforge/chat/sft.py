"""Supervised fine-tuning: ``sft(base, data, run_dir)`` renders conversations and trains through the one loop.

What happens, in order (every check runs before anything is written):

1. The base run is opened through :func:`lmforge.run.open_run` (its newest checkpoint, or the one given); a
   LoRA run is fine-tuned as every reader sees it, its adapters folded into its base.
2. Its tokenizer gets the chat special tokens it lacks (:func:`~lmforge.chat.format.add_chat_tokens`, new ids
   appended); ``model.vocab_size`` grows to fit them if needed (the loop grows the embedding and head with mean
   rows when it loads the base weights).
3. The run config is the base's model and batch settings, :data:`SFT_DEFAULTS` on top (a lower learning rate,
   a short run, frequent evaluation), then the user's YAML, then ``--set`` overrides.
4. Every conversation of ``data`` (and ``val_data``) is checked and rendered by the one renderer
   (:class:`~lmforge.chat.format.ChatFormat`) into ids + loss mask. A conversation longer than
   ``context_length + 1`` tokens is **skipped** (never truncated: a cut reply would teach the model to stop
   mid-sentence, or never to stop); the count is logged and returned.
5. The rendered splits go to ``RUN/sft_data`` (:mod:`lmforge.data.conversations`, with the source files'
   sha256), the base is recorded in ``RUN/base.json``, and :func:`lmforge.train.train` runs with
   ``data.kind: conversations``: masked targets, the loss over the step's global count of trained targets,
   checkpoints, exact resume. Resuming refuses a data file that changed since the run started.
"""

from __future__ import annotations

import copy
import logging
import os
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from lmforge.chat.format import ChatFormat, add_chat_tokens, read_records
from lmforge.checkpoint import CheckpointManager, apply_checkpoint, save_checkpoint
from lmforge.common import check_apart, remove_stale_temporaries, sha256_file
from lmforge.config import apply_overrides, dump_yaml, from_dict, load_yaml
from lmforge.data.conversations import ConversationDataset, check_packs, write_conversations
from lmforge.model import ModelConfig, TransformerLM
from lmforge.model.lora import apply_lora
from lmforge.run import (BASE_FILE, check_new_or_run, check_no_other_checkpoints, is_run_dir, mark, open_run,
                         read_base, source_dirs, write_base)
from lmforge.tokenizer import EOT, Tokenizer
from lmforge.train import RunConfig, load_run_config, train
from lmforge.train.distributed import barrier, cleanup_distributed, setup_distributed

logger = logging.getLogger("lmforge")

__all__ = ["SFT_DEFAULTS", "LORA_DEFAULTS", "sft", "render_file", "sft_config", "merge_run", "check_finetune_dir",
           "lora_record", "base_record", "check_lora_targets"]

SFT_DEFAULTS: dict[str, dict[str, Any]] = {
    "optimizer": {"name": "adamw", "lr": 1e-4, "min_lr": 1e-5, "warmup_steps": 10, "decay_steps": None,
                  "schedule": "cosine", "weight_decay": 0.0},
    "training": {"max_steps": 200, "log_every": 5, "eval_every": 50, "checkpoint_every": 50, "keep_last": 2},
}
"""What ``sft`` changes from the base run's config (any of it can be overridden with ``--set``)."""

LORA_DEFAULTS: dict[str, dict[str, Any]] = {"optimizer": {"lr": 1e-3, "min_lr": 1e-4}}
"""With a ``lora`` section: adapters start at zero and train few parameters, so a higher learning rate."""

# The base's training settings kept by a fine-tuning run (the rest come from SFT_DEFAULTS).
_KEPT_TRAINING = ("batch_size", "grad_accum_steps", "context_length", "device", "dtype", "compile", "parallel",
                  "seed", "num_threads", "eval_batches", "eval_batch_size", "peak_flops")
DATA_DIR = "sft_data"
"""Folder of a fine-tuning run that holds its rendered conversations."""


def _deep_update(d: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    for k, v in new.items():
        if isinstance(v, dict) and isinstance(d.get(k), dict):
            _deep_update(d[k], v)
        else:
            d[k] = copy.deepcopy(v)
    return d


def sft_config(base_config: dict[str, Any], vocab_size: int, run_dir: Path, base: dict[str, Any],
               has_val: bool, config: str | os.PathLike | None = None, overrides: Sequence[str] = (),
               defaults: dict[str, dict[str, Any]] = SFT_DEFAULTS, kind: str = "conversations",
               data_dir: str = DATA_DIR) -> RunConfig:
    """The fine-tuning run's config: base model (grown to ``vocab_size``) and batch settings, the ``defaults``,
    the user's YAML ``config`` and ``overrides`` (``section.key=value``); ``data.kind`` is ``kind`` in
    ``run_dir/data_dir`` (``lmforge rl`` builds its config here too, with its own defaults and prompts)."""
    bc = load_run_config(base=base_config)
    model = dict(base_config["model"], vocab_size=max(bc.model.vocab_size, vocab_size))
    training = {k: v for k, v in (base_config.get("training") or {}).items() if k in _KEPT_TRAINING}
    d: dict[str, Any] = {"model": model, "training": training,
                         "data": {"dir": str(run_dir / data_dir), "kind": kind, "train_split": "train",
                                  "val_split": "val" if has_val else None}}
    _deep_update(d, defaults)
    user = load_yaml(config) if config is not None else {}
    if "lora" in user or any(o.strip().startswith("lora.") for o in overrides):
        _deep_update(d, LORA_DEFAULTS)
    _deep_update(d, user)
    d = apply_overrides(d, overrides)
    d["sft"] = dict(d.get("sft") or {}, base_run=base["run"], base_checkpoint=base["checkpoint"],
                    base_sha256=base["sha256"], base_vocab_size=bc.model.vocab_size)
    if d["sft"].get("pretrain_dir") is None:  # a fine-tuned base's data.dir holds conversations: its own shards
        d["sft"]["pretrain_dir"] = bc.sft.pretrain_dir if bc.sft is not None else bc.data.dir
    return from_dict(RunConfig, d)


def render_file(path: str | os.PathLike, fmt: ChatFormat, context_length: int,
                every_token: bool = False) -> tuple[list, int]:
    """``([(ids, mask), ...], skipped)``: the conversations of a JSONL file rendered; those longer than
    ``context_length + 1`` tokens are skipped and counted. ``every_token``: the mask trains every token (the user's,
    the tool's output and the format's too, as midtraining does), not the assistant's alone."""
    rendered, skipped = [], 0
    conversations = read_records(path)
    if not conversations:
        raise ValueError(f"{path} holds no conversations (it is empty, or blank lines only); give a JSONL file with "
                         'one {"messages": [...]} object per line')
    for lineno, messages, tools in conversations:
        try:
            ids, mask = fmt.render(messages, tools)
        except ValueError as e:  # e.g. text the tokenizer cannot encode (a lone surrogate)
            raise ValueError(f"{path}:{lineno}: {e}") from None
        if len(ids) > context_length + 1:
            skipped += 1
            continue
        rendered.append((ids, [1] * len(ids) if every_token else mask))
    if not rendered:
        raise ValueError(f"{path}: every conversation is longer than context_length + 1 = {context_length + 1} "
                         f"tokens ({skipped} skipped); shorten them or raise training.context_length")
    if skipped:
        logger.warning("%s: %d conversation(s) longer than %d tokens skipped (not truncated)", path, skipped,
                       context_length + 1)
    return rendered, skipped


def check_finetune_dir(run_dir: Path, base_run: Path, force: bool) -> bool:
    """Whether ``run_dir`` is this fine-tuning run already (to resume); ``ValueError`` if it holds another run."""
    check_new_or_run(run_dir, force)
    if not is_run_dir(run_dir):
        return False
    record = read_base(run_dir)  # written first: a run whose training never started still names its base
    old = load_yaml(run_dir / "config.yaml") if (run_dir / "config.yaml").is_file() else {}
    old_base = record["run"] if record else (old.get("sft") or {}).get("base_run")
    if old_base is None or Path(old_base) != base_run:
        what = f"a fine-tuning run of {old_base}" if old_base else "another run (not a fine-tuning of this base)"
        raise ValueError(f"--run-dir {run_dir} holds {what}; choose a new --run-dir (a run is resumed only with "
                         "the same --base)")
    return True


def base_record(base_dir: Path, base_run: Any, run_dir: Path, started: bool) -> dict[str, str]:
    """``{"run", "checkpoint", "sha256"}`` of the base a fine-tuning run starts from: the opened ``base_run``'s
    checkpoint, or for a run that has started (``started``) the one its config recorded, even when the base run
    has newer checkpoints by now."""
    if started:
        old = load_yaml(run_dir / "config.yaml").get("sft") or {}
        return {"run": str(base_dir), "checkpoint": old.get("base_checkpoint", ""), "sha256": old.get("base_sha256", "")}
    return {"run": str(base_dir), "checkpoint": str(Path(base_run.checkpoint_path).absolute()),
            "sha256": sha256_file(base_run.checkpoint_path)}


def check_lora_targets(cfg: RunConfig) -> None:
    """``ValueError`` now, before anything is written, when the config's LoRA targets match no module."""
    if cfg.lora is not None:
        with torch.device("meta"):
            apply_lora(TransformerLM(cfg.model), cfg.lora)


def _check_sources(run_dir: Path, split: str, sources: list[dict[str, str]], targets: str) -> None:
    """Refuse a data file that changed since the run started (its conversations were rendered then), or trained
    targets (``assistant`` or ``all``) other than those it was rendered with."""
    try:
        info = ConversationDataset(run_dir / DATA_DIR, split).info
    except ValueError:
        return
    old = info.get("sources")
    if old is not None and [s["sha256"] for s in old] != [s["sha256"] for s in sources]:
        raise ValueError(f"the {split} data ({', '.join(s['path'] for s in sources)}) changed since this run "
                         f"started (sha256 differs from the one recorded in {run_dir / DATA_DIR}); restore the "
                         "file to resume, or fine-tune into a new --run-dir")
    if info.get("targets", "assistant") != targets:
        raise ValueError(f"this run was started training the {info.get('targets', 'assistant')} tokens of its "
                         f"conversations, not {targets}; resume it as it started, or use a new --run-dir")


def sft(base: str | os.PathLike, data: str | os.PathLike, run_dir: str | os.PathLike, *,
        val_data: str | os.PathLike | None = None, config: str | os.PathLike | None = None,
        overrides: Sequence[str] = (), checkpoint: str | os.PathLike | None = None, force: bool = False,
        progress: bool = True, defaults: dict[str, dict[str, Any]] | None = None,
        every_token: bool = False) -> dict[str, Any]:
    """Fine-tune the base run ``base`` on the conversations of ``data`` (JSONL of ``{"messages": [...]}``) into
    ``run_dir``; resumes ``run_dir`` if it is this fine-tuning run already. See the module docstring.

    ``defaults``: the config on top of the base's (default :data:`SFT_DEFAULTS`); ``every_token``: train every
    token of the conversations, not only the assistant's (``lmforge midtrain`` sets both,
    :mod:`lmforge.chat.midtrain`).

    Returns :func:`lmforge.train.train`'s metrics plus ``conversations``, ``skipped`` (too long) and
    ``val_skipped``. ``ValueError`` for every bad input, before anything is written.
    """
    run_dir, base_dir = Path(run_dir).absolute(), Path(base).absolute()
    base_run = open_run(base_dir, checkpoint)
    check_apart(run_dir, *source_dirs(base_dir), flag="--run-dir")
    resuming = check_finetune_dir(run_dir, base_dir, force)
    started = resuming and any((run_dir / "checkpoints").glob("step_*.safetensors"))
    try:
        tok = add_chat_tokens(Tokenizer.load(base_run.tokenizer_path))
        fmt = ChatFormat(tok)
    except ValueError as e:
        raise ValueError(f"the base run's tokenizer {base_run.tokenizer_path} cannot take the chat tokens: {e}") from None
    record = base_record(base_dir, base_run, run_dir, started)
    cfg = sft_config(base_run.config, tok.vocab_size, run_dir, record, val_data is not None, config, overrides,
                     SFT_DEFAULTS if defaults is None else defaults)
    targets = "all" if every_token else "assistant"
    check_lora_targets(cfg)
    T = cfg.context_length
    splits = {"train": data} if val_data is None else {"train": data, "val": val_data}
    rendered = {}
    for split, path in splits.items():
        sources = [{"path": str(Path(path).absolute()), "sha256": sha256_file(path)}] if Path(path).is_file() else []
        rendered[split] = (*render_file(path, fmt, T, every_token), sources)
        if started:
            _check_sources(run_dir, split, sources, targets)
    # Under torchrun every rank checked the same inputs above; rank 0 alone writes, the others wait for it.
    owns_group = not (dist.is_available() and dist.is_initialized())
    info = setup_distributed(cfg.training.device)
    try:
        rows = (cfg.training.batch_size - cfg.sft.pretrain_rows(cfg.training.batch_size)) * info.world_size
        check_packs([len(ids) for ids, _ in rendered["train"][0]], T, cfg.training.seed, rows, "train")
        barrier()
        if info.is_main and not started:  # (re)write the rendered data: nothing depends on it before a checkpoint
            mark(run_dir)
            write_base(run_dir, {**record, "lora": lora_record(cfg)})
            tok.save(run_dir / DATA_DIR / "tokenizer.json", force=True)
            write_conversations(run_dir / DATA_DIR, {split: (convs, {"skipped": skipped, "sources": sources,
                                                                     "targets": targets})
                                                     for split, (convs, skipped, sources) in rendered.items()},
                                tok.fingerprint(), tok.special_tokens[EOT])
        barrier()
        logger.info("fine-tuning %s (%s) on %d conversations (%d skipped as too long) into %s", base_dir,
                    Path(record["checkpoint"]).name, len(rendered["train"][0]), rendered["train"][1], run_dir)
        metrics = train(cfg, run_dir, progress=progress, force=force)
    finally:
        if owns_group:
            cleanup_distributed()
    metrics.update(conversations=len(rendered["train"][0]), skipped=rendered["train"][1],
                   val_skipped=rendered["val"][1] if "val" in rendered else 0, base_file=str(run_dir / BASE_FILE))
    return metrics


def lora_record(cfg: RunConfig) -> dict[str, Any] | None:
    """The adapters' settings for ``base.json`` (how a LoRA run's checkpoints load onto the base), or None."""
    if cfg.lora is None:
        return None
    return {"rank": cfg.lora.rank, "alpha": cfg.lora.alpha, "targets": list(cfg.lora.targets)}


def merge_run(run_dir: str | os.PathLike, out: str | os.PathLike, force: bool = False) -> Path:
    """Write ``out``: a plain run whose weights are the LoRA run ``run_dir``'s base with its adapters merged
    (``W + alpha/rank · B A``; the embedding grown as in training). Its logits equal base + adapters; every
    ``--run`` command reads it without the base. ``out`` must not exist (or be empty) unless ``force``, and is
    never the run or its base (nor inside them)."""
    src = open_run(run_dir)  # folds the adapters into the base (lmforge.run.open_run), refusing a changed base
    record = read_base(src.path)
    if record is None or not record.get("lora"):
        raise ValueError(f"{run_dir} is not a LoRA run (no adapters in {Path(run_dir) / BASE_FILE}); its "
                         "checkpoints already hold plain weights")
    check_apart(out, *source_dirs(run_dir))
    dest = Path(out)
    if dest.exists() and not dest.is_dir():
        raise ValueError(f"--out {dest} is an existing file; give a directory for the merged run")
    if dest.exists() and any(dest.iterdir()) and not force:
        raise ValueError(f"--out {dest} already exists and is not empty; choose another --out or pass --force")
    check_no_other_checkpoints(dest, src.checkpoint.iteration)
    config = copy.deepcopy(src.config)
    config["lora"] = None
    model = TransformerLM.for_loading(from_dict(ModelConfig, config["model"], path="model"))
    apply_checkpoint(src.checkpoint, model)  # checks every tensor's name and shape
    dest.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(dest)  # a killed merge's half-written files (lmforge's own temporaries only)
    mark(dest)
    dump_yaml(config, dest / "config.yaml")
    Tokenizer.load(src.tokenizer_path).save(dest / "tokenizer.json", force=True)
    write_base(dest, {**record, "lora": None, "merged_from": str(Path(run_dir).absolute()),
                      "adapters": dict(record["lora"])})
    step = src.checkpoint.iteration
    save_checkpoint(model, None, step, CheckpointManager(dest).path_for(step), {"config": config})
    logger.info("merged %s (step %d) into the plain run %s", run_dir, step, dest)
    return dest
