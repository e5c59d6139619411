"""The training loop: ``train(cfg, run_dir)`` with exact resume.

``train`` reads top to bottom: check everything (config, data, run directory) before writing anything, build
(model, optimizer, loader), resume from the newest valid checkpoint in ``run_dir``, then loop over steps, each in
labelled sections -- step, log, evaluate, save. Everything that moves is checkpointed together (model,
optimizer, step, RNG states of Python/NumPy/torch, data-loader position), so a run killed at any moment and
started again logs the same losses, bit for bit on CPU, as one that never stopped.

A run directory holds ``config.yaml``, ``tokenizer.json``, ``checkpoints/``, ``metrics.jsonl``, ``loss.png`` and
the marker ``lmforge-run.json``; see ``docs/DESIGN.md``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from lmforge.checkpoint import CheckpointManager, apply_checkpoint, unwrap_model
from lmforge.hardware import peak_flops_for
from lmforge.common import remove_stale_temporaries, seed_everything
from lmforge.config import diff_dicts, dump_yaml, load_yaml, to_dict
from lmforge.data import BlockLoader, TokenDataset, val_batches
from lmforge.model import TransformerLM, flops_per_token
from lmforge.run import MARKER, check_new_or_run
from lmforge.run import mark as mark_run_dir
from lmforge.tokenizer import Tokenizer, load_tokenizer
from lmforge.train.config import _HARMLESS, _INCOMPATIBLE, DataConfig, OptimConfig, RunConfig
from lmforge.train.distributed import (all_reduce_mean, barrier, cleanup_distributed, full_state_dicts,
                                       load_full_optimizer_state, setup_distributed, wrap_model)
from lmforge.train.evaluate import evaluate
from lmforge.train.metrics import MetricsLog, require_wandb
from lmforge.train.optim import SGD, AdamW, clip_grad_norm, cosine_lr, global_grad_norm, param_groups_for

logger = logging.getLogger("lmforge")

__all__ = ["train", "NonFiniteLossError"]


# Files of a run directory that training writes atomically (their stale temporaries are removed on resume).
_RUN_FILES = ("config.yaml", "tokenizer.json", "metrics.jsonl", "loss.png", MARKER)


class NonFiniteLossError(ValueError):
    """The loss became NaN or infinite; the run stopped without saving the broken state."""


# ==================================================================================================
# Set-up helpers
# ==================================================================================================
def _check_run_dir(cfg: RunConfig, run_dir: Path, write: bool, started: bool) -> None:
    """Refuse a run directory made with an incompatible config; log allowed changes; save config.yaml.

    ``started``: the run has a checkpoint. Before the first one, nothing depends on the old config, so a run
    that failed early (a config refused, a crash in the first steps) may be started again with another.
    """
    path = run_dir / "config.yaml"
    new = to_dict(cfg)
    if path.exists():
        old = load_yaml(path)
        diffs = diff_dicts(old, new)
        bad = [d for d in diffs if d[0].startswith(_INCOMPATIBLE) and d[0] not in _HARMLESS]
        if bad and not started:
            logger.info("run directory %s has no checkpoint yet: its config is replaced", run_dir)
        elif bad:
            what = "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in bad)
            raise ValueError(f"run directory {run_dir} was made with an incompatible config ({what}); use a new "
                             "--run-dir, or put those values back to resume")
        for k, a, b in diffs:
            logger.info("config changed since this run directory was made: %s: %r -> %r", k, a, b)
    if write:
        dump_yaml(cfg, path)


def _resolve_tokenizer(cfg: DataConfig, dataset: Any, run_dir: Path, write: bool, started: bool) -> Any:
    """Load the shards' tokenizer, check it matches them, and copy it to ``run_dir/tokenizer.json``.

    A different ``tokenizer.json`` already in the run is refused once the run has a checkpoint (``started``),
    and replaced before that.
    """
    path = cfg.tokenizer or dataset.manifest.get("tokenizer", {}).get("path") or str(Path(cfg.dir) / "tokenizer.json")
    if not Path(path).exists():
        raise ValueError(f"tokenizer {path} not found; set data.tokenizer to the file the shards in {cfg.dir} were "
                         "made with")
    tok = load_tokenizer(path)
    dataset.check_tokenizer(tok)
    dest = run_dir / "tokenizer.json"
    same = dest.exists() and Tokenizer.load(dest).fingerprint() == tok.fingerprint()
    if dest.exists() and not same and started:
        raise ValueError(f"{dest} is a different tokenizer than {path}; this run directory belongs to another "
                         "tokenizer: use a new --run-dir")
    if write and not same:
        tok.save(dest, force=True)
    return tok


def _check_data(cfg: RunConfig, train_ds: Any, val_ds: Any | None, tokenizer: Any) -> None:
    """Token ids must fit the model's vocabulary; each split must hold at least one training window."""
    V = cfg.model.vocab_size
    T = cfg.context_length
    for ds in (train_ds, val_ds):
        if ds is None:
            continue
        top = ds.max_token_id  # recorded per shard by prepare; no scan of the data
        if top >= V:
            raise ValueError(f"{ds.dir} split {ds.split!r} holds token id {top}, which does not exist in a model with "
                             f"model.vocab_size={V}; set model.vocab_size >= {top + 1} or re-prepare the data")
        if len(ds) < T + 1:
            raise ValueError(f"{ds.dir} split {ds.split!r} has {len(ds)} tokens, fewer than one training window of "
                             f"context_length + 1 = {T + 1}; add data or lower training.context_length")
    if val_ds is not None:
        windows = sum(len(s) // (T + 1) for s in val_ds.shards)
        eval_b = cfg.training.eval_batch_size or cfg.training.batch_size
        if windows < eval_b:
            raise ValueError(f"{val_ds.dir} split {val_ds.split!r} holds {windows} validation windows of {T + 1} tokens, "
                             f"fewer than one eval batch of {eval_b}; set training.eval_batch_size <= {windows}, "
                             "or prepare more validation data (data prepare --val-fraction)")
    if tokenizer.vocab_size > V:  # the data fits, but generation could emit ids the model cannot embed
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens but model.vocab_size={V}; set "
                         f"model.vocab_size >= {tokenizer.vocab_size} (e.g. rounded up to a multiple of 64)")


def _lr_at(step: int, oc: OptimConfig, max_steps: int) -> float:
    """Learning rate for the optimizer step with 0-based index ``step``.

    The schedule is evaluated at ``step + 1`` (steps counted from 1) so the first step does not waste a
    batch at learning rate 0; the peak is reached at step ``warmup_steps``.
    """
    t = step + 1
    if oc.schedule == "constant":
        return oc.lr * min(1.0, t / oc.warmup_steps) if oc.warmup_steps else oc.lr
    return cosine_lr(t, oc.lr, oc.min_lr, oc.warmup_steps, oc.decay_steps or max_steps)


def _build_optimizer(model: Any, oc: OptimConfig) -> Any:
    groups = param_groups_for(model, oc.weight_decay)
    if oc.name == "sgd":
        return SGD(groups, lr=oc.lr)
    return AdamW(groups, lr=oc.lr, betas=tuple(oc.betas), eps=oc.eps, weight_decay=oc.weight_decay)


def _rng_state(device: Any) -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, Any], device: Any) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)



# ==================================================================================================
# The loop
# ==================================================================================================
def train(cfg: RunConfig, run_dir: str | Path, *, progress: bool = True, force: bool = False) -> dict[str, Any]:
    """Train ``cfg`` in ``run_dir``, resuming from its newest valid checkpoint; returns the final metrics.

    ``run_dir`` must not exist, be empty, or be an lmforge run; ``force`` also accepts a non-empty folder that is
    not a run (lmforge's files are then written beside what is there). Every check on the config and the data
    runs before anything is written.

    The returned dict holds ``step``, ``loss`` (last logged train loss), ``val_loss``, ``val_ppl``,
    ``val_bpb`` (last evaluation, None without a validation split), ``best_val_loss``, ``tokens``,
    ``tokens_per_s``, ``mfu``, ``train_seconds`` (step time of this session, excluding eval and saves) and
    ``checkpoint`` (path of the last one saved).
    Raises ``ValueError`` for bad configs or data and :class:`NonFiniteLossError` if the loss diverges.
    """
    tc, oc = cfg.training, cfg.optimizer
    run_dir = Path(run_dir)
    owns_group = not (dist.is_available() and dist.is_initialized())
    info = setup_distributed(tc.device)
    device, main = info.device, info.is_main
    cleanup = contextlib.ExitStack()
    try:
        # ---- data, tokenizer, run directory: check everything before writing anything --------------------
        if tc.num_threads:
            torch.set_num_threads(tc.num_threads)
        T, B, A = cfg.context_length, tc.batch_size, tc.grad_accum_steps
        train_ds = TokenDataset(cfg.data.dir, cfg.data.train_split)
        val_ds = TokenDataset(cfg.data.dir, cfg.data.val_split) if cfg.data.val_split else None
        check_new_or_run(run_dir, force)
        ckpts = CheckpointManager(run_dir, tc.keep_last)
        started = bool(ckpts.steps())
        _check_run_dir(cfg, run_dir, write=False, started=started)
        tokenizer = _resolve_tokenizer(cfg.data, train_ds, run_dir, write=False, started=started)
        _check_data(cfg, train_ds, val_ds, tokenizer)
        loader = BlockLoader(train_ds, B, T, seed=tc.seed, rank=info.rank, world_size=info.world_size,
                             bos_aligned=cfg.data.bos_aligned)
        val_set = val_batches(val_ds, tc.eval_batch_size or B, T, tc.eval_batches) if val_ds is not None else []
        if tc.wandb and main:
            require_wandb()
        if main:
            run_dir.mkdir(parents=True, exist_ok=True)
            mark_run_dir(run_dir)
            _resolve_tokenizer(cfg.data, train_ds, run_dir, write=True, started=started)
            _check_run_dir(cfg, run_dir, write=True, started=started)

        # ---- model, optimizer ----------------------------------------------------------------------------
        seed_everything(tc.seed)
        model = TransformerLM(cfg.model).to(device)
        fsdp = tc.parallel == "fsdp" and info.enabled  # FSDP: the optimizer is built on the sharded model below
        optimizer = None if fsdp else _build_optimizer(model, oc)

        # ---- resume from the newest checkpoint that verifies -----------------------------------------------
        log = MetricsLog(run_dir, enabled=main)
        step, last_ckpt, fsdp_optim_state = 0, None, None
        if main:  # half-written temporaries of a killed run (checkpoints, loss.png, metrics rewrite)
            ckpts.remove_stale_temporaries()
            remove_stale_temporaries(run_dir, _RUN_FILES)
        latest = ckpts.load_latest(quarantine=main)
        if latest is not None:
            path, ck = latest
            del latest  # the tensors are copied into the model/optimizer below; do not keep a second copy
            state = ck.extra.get("train")
            if not isinstance(state, dict):
                raise ValueError(f"{path} holds no training state (not written by `lmforge train`); move it out of "
                                 f"{ckpts.dir} or use a new --run-dir")
            step = apply_checkpoint(ck, model, optimizer)
            loader.load_state_dict(state["loader"])
            _set_rng_state(state["rng"], device)
            last_ckpt, fsdp_optim_state = path, ck.optimizer if fsdp else None
            del ck
            logger.info("resumed from %s at step %d", path, step)
        log.rewind(step)  # drop events logged after the checkpoint: the loop logs them again, identically
        best_val = ckpts.best_val_loss()

        def train_state() -> dict[str, Any]:
            return {"train": {"loader": loader.state_dict(), "rng": _rng_state(device)},
                    "config": to_dict(cfg)}

        # ---- wrap from outside: compile, data parallelism (the model code stays single-device) ----------
        model = wrap_model(model, tc.parallel, info, compile=tc.compile)
        raw_model = unwrap_model(model)
        if fsdp:
            optimizer = _build_optimizer(raw_model, oc)
            if fsdp_optim_state is not None:
                load_full_optimizer_state(raw_model, optimizer, fsdp_optim_state)
                fsdp_optim_state = None

        def snapshot() -> tuple[Any, Any]:
            """What a checkpoint saves (under FSDP gathered from all ranks: every rank must call this)."""
            return full_state_dicts(raw_model, optimizer) if fsdp else (raw_model, optimizer)

        autocast = dict(device_type=device.type, dtype=torch.bfloat16, enabled=tc.dtype == "bf16")
        tokens_per_step = B * T * A * info.world_size
        flops_tok = flops_per_token(cfg.model, T)
        peak = peak_flops_for(device, tc.peak_flops)
        if tc.wandb:
            log.start_wandb(tc.wandb_project, tc.wandb_mode, to_dict(cfg))
        logger.info("training %s params for %d steps (%d tokens/step) on %s, run dir %s",
                    f"{sum(p.numel() for p in raw_model.parameters()):,}", tc.max_steps, tokens_per_step, device,
                    run_dir)

        bar = tqdm(total=tc.max_steps, initial=step, desc="train", unit="step", dynamic_ncols=True,
                   disable=not (progress and main))
        if not bar.disable and any(isinstance(h, logging.StreamHandler) for h in logger.handlers):
            from tqdm.contrib.logging import logging_redirect_tqdm

            cleanup.enter_context(logging_redirect_tqdm([logger]))  # log lines above the bar, not through it
        elapsed, interval_time, interval_tokens = 0.0, 0.0, 0
        model.train()
        while step < tc.max_steps:
            # ---- step: schedule, micro-batches, forward, backward, clip, update -------------------------
            t0 = time.perf_counter()
            lr = _lr_at(step, oc, tc.max_steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            batches = [loader.next_batch() for _ in range(A)]
            n_targets = sum(y.numel() for _, y in batches)  # the loss is a mean over *all* targets of the step
            loss_sum = torch.zeros((), device=device)
            for i, (x, y) in enumerate(batches):
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                last_micro = i == A - 1
                no_sync = model.no_sync() if not last_micro and hasattr(model, "no_sync") else contextlib.nullcontext()
                with no_sync:
                    with torch.autocast(**autocast):
                        micro = model(x, targets=y, reduction="sum")
                    (micro / n_targets).backward()
                loss_sum += micro.detach()
            loss = all_reduce_mean(loss_sum.item() / n_targets, device)
            # the norm is taken before any update, so a NaN/inf loss or gradient never reaches the weights
            grad_norm = float(clip_grad_norm(model.parameters(), oc.grad_clip) if oc.grad_clip > 0
                              else global_grad_norm(model.parameters()))
            if not (math.isfinite(loss) and math.isfinite(grad_norm)):
                bar.close()
                what = f"loss is {loss}" if not math.isfinite(loss) else f"gradient norm is {grad_norm}"
                kept = f"the last good checkpoint is {last_ckpt}" if last_ckpt else "no checkpoint was saved yet"
                raise NonFiniteLossError(
                    f"{what} at step {step + 1} (lr {lr:.3g}); stopped without saving this state ({kept}). "
                    "Try a lower optimizer.lr or longer optimizer.warmup_steps, optimizer.grad_clip=1.0, "
                    "training.dtype=fp32, and check the data for corrupt shards")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            dt = time.perf_counter() - t0
            elapsed += dt
            interval_time += dt
            interval_tokens += tokens_per_step
            bar.update(1)

            # ---- log ------------------------------------------------------------------------------------------
            if step % tc.log_every == 0 or step == tc.max_steps:
                tps = interval_tokens / max(interval_time, 1e-9)
                mfu = tps / info.world_size * flops_tok / peak if peak else None
                log.log({"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_s": tps, "mfu": mfu,
                         "tokens": step * tokens_per_step})
                postfix = {"loss": f"{loss:.4f}", "lr": f"{lr:.2e}", "tok/s": f"{tps:,.0f}"}
                if mfu is not None:
                    postfix["mfu"] = f"{100 * mfu:.1f}%"
                bar.set_postfix(postfix, refresh=False)
                interval_time, interval_tokens = 0.0, 0

            # ---- evaluate ------------------------------------------------------------------------------------
            if val_set and (step % tc.eval_every == 0 or step == tc.max_steps):
                ev = evaluate(raw_model, val_set, val_ds.bytes_per_token, tc.dtype, device)
                log.log({"step": step, "val_loss": ev.loss, "val_ppl": ev.ppl, "val_bpb": ev.bpb})
                bpb = f", bpb {ev.bpb:.4f}" if ev.bpb is not None else ""
                logger.info("step %d: val loss %.4f, ppl %.2f%s", step, ev.loss, ev.ppl, bpb)
                better = best_val is None or ev.loss < best_val
                if better or fsdp:
                    state = snapshot()
                    if main and better:
                        ckpts.save_best(*state, step, ev.loss, train_state())
                best_val = ev.loss if better else best_val
                log.plot()

            # ---- save -----------------------------------------------------------------------------------------
            if step % tc.checkpoint_every == 0 or step == tc.max_steps:
                state = snapshot()
                if main:
                    last_ckpt = ckpts.save(*state, step, train_state())
                barrier()
        bar.close()

        # ---- report -------------------------------------------------------------------------------------------
        log.plot()
        log.close()
        last_train = next((r for r in reversed(log.records) if "loss" in r), {})
        last_val = next((r for r in reversed(log.records) if "val_loss" in r), {})
        return {"step": step, "loss": last_train.get("loss"), "val_loss": last_val.get("val_loss"),
                "val_ppl": last_val.get("val_ppl"), "val_bpb": last_val.get("val_bpb"), "best_val_loss": best_val,
                "tokens": step * tokens_per_step, "tokens_per_s": last_train.get("tokens_per_s"),
                "mfu": last_train.get("mfu"), "train_seconds": elapsed,
                "checkpoint": str(last_ckpt) if last_ckpt else None, "run_dir": str(run_dir)}
    finally:
        cleanup.close()
        if owns_group:
            cleanup_distributed()

