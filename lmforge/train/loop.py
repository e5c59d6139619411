"""The training loop: ``train(cfg, run_dir)`` with exact resume.

``train`` reads top to bottom in named steps: ``_check`` (config, data, run directory; nothing is written before
every check passed), ``_build`` (model, optimizer), ``_resume`` (the newest valid checkpoint in ``run_dir``),
``_wrap`` (compile, DDP/FSDP), then per step ``_train_step``, ``_log``, ``_maybe_evaluate``, ``_maybe_checkpoint``,
and ``_finish``. They share one :class:`_Run`. Everything that moves is checkpointed together (model,
optimizer, step, RNG states of Python/NumPy/torch, data-loader position), so a run killed at any moment and
started again logs the same losses, bit for bit on CPU, as one that never stopped. That holds at torch's default
thread count, under any machine load: the fast path's kernels split their work by the thread count alone (the
embedding's backward sums each row in index order; indexing's backward, atomic adds from parallel threads,
made runs differ in the last bits), so two fresh runs give the same losses and weights
(``tests/train/test_train.py``); the thread count itself (``training.num_threads``) must be the same.

A run directory holds ``config.yaml``, ``tokenizer.json``, ``checkpoints/``, ``metrics.jsonl``, ``loss.png`` and
the marker ``lmforge-run.json``; see ``docs/DESIGN.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import random
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from lmforge.checkpoint import CheckpointManager, unwrap_model
from lmforge.hardware import mfu_denominator, resolve_train_dtype
from lmforge.common import cuda_matmul_defaults, remove_stale_temporaries, seed_everything
from lmforge.config import diff_dicts, dump_yaml, load_yaml, to_dict
from lmforge.data import BlockLoader, TokenDataset, copy_mixture, val_batches
from lmforge.data.conversations import IGNORE_INDEX, ConversationDataset
from lmforge.model import flops_per_token
from lmforge.model.fp8 import check_fp8_device, convert_to_float8
from lmforge.progress import progress as progress_bar
from lmforge.run import MARKER, check_new_or_run, run_lock
from lmforge.run import mark as mark_run_dir
from lmforge.tokenizer import Tokenizer, load_tokenizer
from lmforge.train.allocator import retain_freed_memory
from lmforge.train.batching import BatchPlan, plan_batch, warmup_rows
from lmforge.train.config import _HARMLESS, _INCOMPATIBLE, DataConfig, OptimConfig, RunConfig
from lmforge.train.dcp import load_dcp, read_dcp_extra, read_dcp_meta, save_dcp
from lmforge.train.distributed import (all_reduce_sum, barrier, cleanup_distributed, full_state_dicts,
                                       gradient_sync, is_main_process, load_full_optimizer_state, setup_distributed,
                                       wrap_model)
from lmforge.train.evaluate import evaluate, validation_batches
from lmforge.train.finetune import (build_model, conversation_data, global_target_count, load_trained_state,
                                    loss_scale, masked, trained_state)
from lmforge.train.metrics import MetricsLog, require_wandb
from lmforge.train.optim import (SGD, AdamW, Muon, adamw_param_groups, clip_grad_norm, cosine_lr, describe_groups,
                                 dmodel_lr_scale, global_grad_norm, muon_momentum_at, muon_param_groups,
                                 param_groups_for, wsd_lr)

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
    if oc.schedule == "wsd":
        total = oc.decay_steps or max_steps
        return wsd_lr(t, oc.lr, oc.min_lr, oc.warmup_steps, total, round(oc.cooldown_frac * total))
    return cosine_lr(t, oc.lr, oc.min_lr, oc.warmup_steps, oc.decay_steps or max_steps)


def _build_optimizer(model: Any, oc: OptimConfig) -> Any:
    """The configured optimizer over ``model``'s parameter groups (matrices decay, vectors and norms don't;
    with ``muon``: the blocks' matrices to Muon, the rest to AdamW, see :func:`muon_param_groups`; with a per-role
    rate ``embed_lr``/``head_lr``/``scalar_lr`` or ``dmodel_lr_scale``: one AdamW group per role, see
    :func:`adamw_param_groups`)."""
    scale = dmodel_lr_scale(model.cfg.d_model) if oc.dmodel_lr_scale else 1.0
    rates = dict(embed_lr=oc.embed_lr, head_lr=oc.head_lr, scalar_lr=oc.scalar_lr, embed_head_scale=scale)
    if oc.name == "muon":
        groups = muon_param_groups(model, oc.lr, oc.muon_lr, oc.weight_decay, oc.muon_weight_decay, **rates)
        if is_main_process():
            logger.info("optimizer groups: %s", describe_groups(groups))
        return Muon(groups, lr=oc.muon_lr, momentum=oc.muon_momentum, nesterov=oc.muon_nesterov,
                    ns_coefficients=tuple(oc.muon_ns_coefficients), ns_steps=oc.muon_ns_steps,
                    ns_dtype=oc.muon_ns_dtype, adjust_lr=oc.muon_adjust_lr, betas=tuple(oc.betas), eps=oc.eps)
    if oc.embed_lr or oc.head_lr or oc.scalar_lr or oc.dmodel_lr_scale:  # per-role rates (each scaled by lr_scale)
        groups = adamw_param_groups(model, oc.lr, oc.weight_decay, **rates)
        if is_main_process():
            logger.info("optimizer groups: %s", describe_groups(groups))
        return AdamW(groups, lr=oc.lr, betas=tuple(oc.betas), eps=oc.eps, weight_decay=oc.weight_decay)
    groups = param_groups_for(model, oc.weight_decay)
    if oc.name == "sgd":
        return SGD(groups, lr=oc.lr)
    return AdamW(groups, lr=oc.lr, betas=tuple(oc.betas), eps=oc.eps, weight_decay=oc.weight_decay)


def _rng_state(device: Any) -> dict[str, Any]:
    """The Python, NumPy, torch (and CUDA) RNG states, for the checkpoint."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, Any], device: Any) -> None:
    """Restore the RNG states saved by :func:`_rng_state`."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)



# ==================================================================================================
# The loop
# ==================================================================================================
@dataclasses.dataclass
class _Run:
    """What the loop's steps share: the run's inputs, what ``_build``/``_resume`` made, and the moving counters."""

    cfg: RunConfig
    run_dir: Path
    info: Any  # distributed.DistInfo: device, rank, world size, is_main
    loader: BlockLoader
    val_ds: TokenDataset | None
    val_set: list
    ckpts: CheckpointManager
    log: MetricsLog
    batch: BatchPlan  # global batch = world size x micro-batch x accumulation steps
    model: Any = None  # as trained: compiled and/or wrapped for data parallelism
    raw_model: Any = None  # the bare TransformerLM under ``model``
    optimizer: Any = None
    step: int = 0
    last_ckpt: Path | None = None
    best_val: float | None = None
    elapsed: float = 0.0  # step time of this session, excluding eval and saves
    interval_time: float = 0.0  # step time and tokens since the last logged step
    interval_tokens: int = 0
    tokens: int = 0  # input positions run through forward and backward since step 0 (every rank)
    flops_per_token: float = 0.0  # for MFU, with ``peak`` (None: unknown, MFU not reported)
    peak: float | None = None
    peak_basis: str | None = None  # what MFU divides by, named ("vs datasheet bf16 peak of <GPU>", ...)
    reached_target: bool = False  # the target check reached ``training.target_val_bpb``: save and stop
    target_set: tuple | None = None  # the target check's batches, ignore index and target count (built when first used)

    @property
    def fsdp(self) -> bool:
        return self.cfg.training.parallel == "fsdp" and self.info.enabled

    @property
    def tokens_per_step(self) -> int:
        """A full step's tokens (global batch x context); RL's padded rollouts run fewer (``_train_step`` counts)."""
        return self.batch.tokens_per_step(self.cfg.context_length)


def train(cfg: RunConfig, run_dir: str | Path, *, progress: bool = True, force: bool = False,
          source: Callable[..., tuple] | None = None) -> dict[str, Any]:
    """Train ``cfg`` in ``run_dir``, resuming from its newest valid checkpoint; returns the final metrics.

    ``run_dir`` must not exist, be empty, or be an lmforge run; ``force`` also accepts a non-empty folder that is
    not a run (lmforge's files are then written beside what is there). Every check on the config and the data
    runs before anything is written. ``training.num_threads`` applies while training; the caller's torch thread
    count is restored on return.

    The returned dict holds ``step``, ``loss`` (last logged train loss), ``val_loss``, ``val_ppl``,
    ``val_bpb`` (last evaluation, None without a validation split), ``best_val_loss``, ``tokens``,
    ``tokens_per_s``, ``mfu``, ``train_seconds`` (step time of this session, excluding eval and saves),
    ``checkpoint`` (path of the last one saved) and ``reached_target`` (the validation bits per byte over
    ``training.target_eval_batches`` reached ``training.target_val_bpb``, and training stopped there).
    Raises ``ValueError`` for bad configs or data and :class:`NonFiniteLossError` if the loss diverges.

    ``source``: where the batches of a run that is not pretraining come from, called as
    ``source(cfg, tokenizer, info, micro_batch) -> (train split, val split or None, val batches, loader)``;
    default :func:`~lmforge.train.finetune.conversation_data`. Its loader's ``next_batch()`` gives ``(x, y)`` or
    ``(x, y, weights)`` (each target's loss times its weight: RL's advantages); a loader with ``bind(model)`` is
    given the bare model before the first step (RL samples its batches from it), one with ``tempered()`` has the
    loss's forward run inside that context (RL: the logits divided by the sampling temperature), and one with
    ``step_metrics()`` adds their figures to each logged step. ``lmforge.rl`` plugs in here.
    """
    owns_group = not (dist.is_available() and dist.is_initialized())
    info = setup_distributed(cfg.training.device)
    cfg = dataclasses.replace(cfg, training=dataclasses.replace(  # dtype auto: what this device runs fast
        cfg.training, dtype=resolve_train_dtype(cfg.training.dtype, info.device)))
    tc = cfg.training
    threads = torch.get_num_threads()
    precision = cuda_matmul_defaults(info.device)  # TF32 for float32 matmuls on CUDA; restored below
    try:
        if tc.num_threads:
            torch.set_num_threads(tc.num_threads)
        with contextlib.ExitStack() as held:  # the run directory's lock, from its first write on (rank 0)
            run = _check(cfg, Path(run_dir), force, info, source, held)
            _build(run)
            pending = _resume(run)
            _wrap(run, pending)
            with progress_bar(tc.max_steps, "train", "step", progress and info.is_main, initial=run.step) as bar:
                run.model.train()
                while run.step < tc.max_steps:
                    loss, lr, grad_norm = _train_step(run)
                    if run.step % tc.log_every == 0 or run.step == tc.max_steps:
                        bar.set_postfix(_log(run, loss, lr, grad_norm), refresh=False)
                    bar.update(1)  # after the postfix, so a plain progress line shows this step's figures
                    _maybe_evaluate(run)
                    _maybe_checkpoint(run)
                    if run.reached_target:
                        break
            return _finish(run)
    finally:
        torch.set_num_threads(threads)
        torch.set_float32_matmul_precision(precision)
        if owns_group:
            cleanup_distributed()


def _check(cfg: RunConfig, run_dir: Path, force: bool, info: Any, source: Callable[..., tuple] | None,
           held: contextlib.ExitStack) -> _Run:
    """Open and check the data, tokenizer and run directory; only once all is valid, take the directory's lock
    (into ``held``: one trainer per run directory) and write the run's files."""
    tc = cfg.training
    tokens = cfg.data.kind == "tokens"
    if cfg.data.kind == "prompts" and source is None:
        raise ValueError(f"{cfg.data.dir} holds prompts for reinforcement learning (data.kind: prompts): their batches "
                         "are sampled from the model; run it with `lmforge rl`")
    if tokens:
        train_ds = TokenDataset(cfg.data.dir, cfg.data.train_split)
        val_ds = TokenDataset(cfg.data.dir, cfg.data.val_split) if cfg.data.val_split else None
    else:  # rendered conversations (or prompts): the loader, val set and checks come from train.finetune (or source)
        train_ds = ConversationDataset(cfg.data.dir, cfg.data.train_split)
    check_new_or_run(run_dir, force)
    ckpts = CheckpointManager(run_dir, tc.keep_last)
    started = bool(ckpts.steps() or ckpts.dcp_steps())
    _check_run_dir(cfg, run_dir, write=False, started=started)
    tokenizer = _resolve_tokenizer(cfg.data, train_ds, run_dir, write=False, started=started)
    batch = plan_batch(tc, info.world_size)
    if tokens:
        _check_data(cfg, train_ds, val_ds, tokenizer)
        loader = BlockLoader(train_ds, batch.micro_batch, cfg.context_length, seed=tc.seed, rank=info.rank,
                             world_size=info.world_size, bos_aligned=cfg.data.bos_aligned,
                             global_batch_size=batch.global_batch, mixture=copy_mixture(cfg.data, tokenizer))
        val_set = (val_batches(val_ds, tc.eval_batch_size or tc.batch_size, cfg.context_length, tc.eval_batches)
                   if val_ds is not None else [])
    else:
        train_ds, val_ds, val_set, loader = (source or conversation_data)(cfg, tokenizer, info, batch.micro_batch)
    if tc.wandb and info.is_main:
        require_wandb()
    barrier()  # every rank has checked the directory before rank 0 writes into it (else a late rank sees a non-run)
    if info.is_main:
        held.enter_context(run_lock(run_dir))  # creates the directory; refuses while another process trains in it
        mark_run_dir(run_dir)
        _resolve_tokenizer(cfg.data, train_ds, run_dir, write=True, started=started)
        _check_run_dir(cfg, run_dir, write=True, started=started)
    return _Run(cfg, run_dir, info, loader, val_ds, val_set, ckpts, MetricsLog(run_dir, enabled=info.is_main), batch)


def _build(run: _Run) -> None:
    """The model, seeded, and its optimizer (under FSDP the optimizer is built on the sharded model by ``_wrap``)."""
    seed_everything(run.cfg.training.seed)
    run.model = build_model(run.cfg, run.info.device, resuming=bool(run.ckpts.steps()))  # fresh, or from a base run
    run.optimizer = None if run.fsdp else _build_optimizer(run.model, run.cfg.optimizer)


def _resume(run: _Run) -> Any:
    """Load the newest checkpoint that verifies (model, optimizer, step, loader, RNG); forget later metrics.

    Returns what ``_wrap`` loads once the model is wrapped: the checkpoint's full optimizer state under FSDP,
    or the directory of a sharded (DCP) checkpoint, whose weights and optimizer state go in after wrapping.
    """
    main = run.info.is_main
    if main:  # half-written temporaries of a killed run (checkpoints, loss.png, metrics rewrite)
        run.ckpts.remove_stale_temporaries()
        remove_stale_temporaries(run.run_dir, _RUN_FILES)
    fsdp_optim_state = None
    sharded, files = run.ckpts.dcp_steps(), run.ckpts.steps()
    if sharded and (not files or sharded[-1][0] > files[-1][0]
                    or (sharded[-1][0] == files[-1][0] and run.cfg.training.checkpoint_format == "dcp")):
        step, path = sharded[-1]  # the newest checkpoint is sharded: at any world size, whatever the format now
        run.step, run.last_ckpt = step, path
        _restore_train_state(run, read_dcp_extra(path, read_dcp_meta(path))["train"])
        logger.info("resuming from sharded checkpoint %s at step %d", path, step)
        run.log.rewind(run.step)
        run.best_val = run.ckpts.best_val_loss()
        return path
    latest = run.ckpts.load_latest(quarantine=main)
    if latest is not None:
        path, ck = latest
        del latest  # the tensors are copied into the model/optimizer below; do not keep a second copy
        state = ck.extra.get("train")
        if not isinstance(state, dict):
            raise ValueError(f"{path} holds no training state (not written by `lmforge train`); move it out of "
                             f"{run.ckpts.dir} or use a new --run-dir")
        run.step = load_trained_state(run.cfg, ck, run.model, run.optimizer)
        _restore_train_state(run, state)
        run.last_ckpt, fsdp_optim_state = path, ck.optimizer if run.fsdp else None
        del ck
        logger.info("resumed from %s at step %d", path, run.step)
    run.log.rewind(run.step)  # drop events logged after the checkpoint: the loop logs them again, identically
    run.best_val = run.ckpts.best_val_loss()
    return fsdp_optim_state


def _restore_train_state(run: _Run, state: dict[str, Any]) -> None:
    """The data-loader position, RNG states and token count of a checkpoint's training state (``run.step`` set;
    older checkpoints hold no count: full steps)."""
    run.loader.load_state_dict(state["loader"])
    _set_rng_state(state["rng"], run.info.device)
    run.tokens = int(state.get("tokens", run.step * run.tokens_per_step))


def _wrap(run: _Run, pending: Any) -> None:
    """Compile and wrap for data parallelism from outside (the model code stays single-device), load what
    ``_resume`` left for the wrapped model (``pending``); start wandb."""
    tc, info = run.cfg.training, run.info
    if info.device.type == "cpu":  # every step reuses the memory the last one freed (train/allocator.py)
        retain_freed_memory()
    if tc.fp8:  # before the compile and the wrappers: they see the float8 projections
        check_fp8_device(info.device)
        names = convert_to_float8(run.model)
        logger.info("training.fp8: %d projections multiply in float8 (e4m3 forward, e5m2 gradients)", len(names))
    run.model = wrap_model(run.model, tc.parallel, info, compile=tc.compile,
                           activation_checkpointing=tc.activation_checkpointing)
    run.raw_model = unwrap_model(run.model)
    if hasattr(run.loader, "bind"):  # a loader that samples its batches from the model being trained (RL)
        run.loader.bind(run.raw_model)
    if run.fsdp:
        run.optimizer = _build_optimizer(run.raw_model, run.cfg.optimizer)
    if isinstance(pending, Path):  # a sharded checkpoint: resharded into this world size's model and optimizer
        step, _ = load_dcp(pending, run.raw_model, run.optimizer)
        assert step == run.step, (step, run.step)
    elif run.fsdp and pending is not None:
        load_full_optimizer_state(run.raw_model, run.optimizer, pending)
    run.flops_per_token = flops_per_token(run.cfg.model, run.cfg.context_length)
    run.peak, run.peak_basis = mfu_denominator(info.device, tc.peak_flops)
    if tc.wandb:
        run.log.start_wandb(tc.wandb_project, tc.wandb_mode, to_dict(run.cfg))
    logger.info("training %s params for %d steps (%d tokens/step) on %s, run dir %s",
                f"{sum(p.numel() for p in run.raw_model.parameters()):,}", tc.max_steps, run.tokens_per_step,
                info.device, run.run_dir)


def _train_step(run: _Run) -> tuple[float, float, float]:
    """One optimizer step: schedule, micro-batches, backward, clip, update. Returns ``(loss, lr, grad_norm)``.

    The loss is the mean over *all* trained target tokens of the step (every micro-batch, every rank; masked
    conversation targets, ``IGNORE_INDEX``, count for nothing), so gradient accumulation and data parallelism
    give the same gradient as one big batch, however unevenly the masks fall. A non-finite loss or gradient norm raises
    :class:`NonFiniteLossError` before the weights change.
    """
    tc, oc, device, model = run.cfg.training, run.cfg.optimizer, run.info.device, run.model
    t0 = time.perf_counter()
    lr = _lr_at(run.step, oc, tc.max_steps)
    momentum = muon_momentum_at(run.step, oc.muon_momentum, oc.muon_momentum_start, oc.muon_momentum_warmup_steps)
    for group in run.optimizer.param_groups:  # every group follows the schedule; Muon's at muon_lr / lr times it
        group["lr"] = lr * group.get("lr_scale", 1.0)
        if oc.muon_momentum_warmup_steps and group.get("use_muon"):
            group["momentum"] = momentum
    batches = [run.loader.next_batch() for _ in range(run.batch.accum_steps)]
    rows = warmup_rows(run.step, run.batch.micro_batch, tc.batch_warmup_steps, tc.batch_warmup_start)
    if rows < run.batch.micro_batch:  # batch-size warm-up: the first rows of each micro-batch (train/batching.py)
        batches = [tuple(t[:rows] for t in b) for b in batches]
    n_targets = global_target_count(batches, device)  # trained targets of the whole step, over every rank
    denom = loss_scale(n_targets, run.info.world_size)
    ignore = IGNORE_INDEX if masked(run.loader) else None
    tempered = getattr(run.loader, "tempered", contextlib.nullcontext)  # RL: the policy that sampled (T != 1)
    loss_sum, positions = torch.zeros((), device=device), 0
    for i, (x, y, *weights) in enumerate(batches):  # weights: each target's loss factor (RL's advantages)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        w = weights[0].to(device, non_blocking=True) if weights else None
        last_micro = i == run.batch.accum_steps - 1
        with gradient_sync(model, last_micro):  # DDP/FSDP reduce gradients once, after the last micro-batch
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=tc.dtype == "bf16"), tempered():
                micro = model(x, targets=y, ignore_index=ignore, reduction="sum", weights=w)
            (micro / denom).backward()
        loss_sum += micro.detach()
        positions += x.numel()
    # the positions run (RL's rollouts are padded to their longest row, not the context) make tokens/s and MFU
    total_loss, step_tokens = all_reduce_sum([loss_sum.item(), float(positions)], device)
    loss = total_loss / max(n_targets, 1.0)
    # the norm is taken before any update, so a NaN/inf loss or gradient never reaches the weights
    grad_norm = float(clip_grad_norm(model.parameters(), oc.grad_clip) if oc.grad_clip > 0
                      else global_grad_norm(model.parameters()))
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        what = f"loss is {loss}" if not math.isfinite(loss) else f"gradient norm is {grad_norm}"
        kept = f"the last good checkpoint is {run.last_ckpt}" if run.last_ckpt else "no checkpoint was saved yet"
        raise NonFiniteLossError(
            f"{what} at step {run.step + 1} (lr {lr:.3g}); stopped without saving this state ({kept}). "
            "Try a lower optimizer.lr or longer optimizer.warmup_steps, optimizer.grad_clip=1.0, "
            "training.dtype=fp32, and check the data for corrupt shards")
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.step += 1
    dt = time.perf_counter() - t0
    run.elapsed += dt
    run.interval_time += dt
    run.interval_tokens += int(step_tokens)
    run.tokens += int(step_tokens)
    return loss, lr, grad_norm


def _log(run: _Run, loss: float, lr: float, grad_norm: float) -> dict[str, str]:
    """Log the step to ``metrics.jsonl`` (and wandb) with the throughput since the last log; returns the
    figures for the progress display."""
    info = run.info
    tps = run.interval_tokens / max(run.interval_time, 1e-9)
    mfu = tps / info.world_size * run.flops_per_token / run.peak if run.peak else None
    extra = run.loader.step_metrics() if hasattr(run.loader, "step_metrics") else {}  # RL: reward, lengths
    basis = {"mfu_basis": run.peak_basis} if mfu is not None else {}
    run.log.log({"step": run.step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_s": tps, "mfu": mfu,
                 **basis, "tokens": run.tokens, **extra})
    run.interval_time, run.interval_tokens = 0.0, 0
    shown = {"loss": f"{loss:.4f}", "lr": f"{lr:.2e}", "tok/s": f"{tps:,.0f}"}
    if mfu is not None:
        shown["mfu"] = f"{100 * mfu:.1f}% ({'datasheet' if 'datasheet' in (run.peak_basis or '') else 'peak_flops'})"
    return shown


def _maybe_evaluate(run: _Run) -> None:
    """Every ``eval_every`` steps and at the end: validation loss; a new best is saved as ``best``."""
    tc = run.cfg.training
    if not run.val_set or not (run.step % tc.eval_every == 0 or run.step == tc.max_steps):
        return
    ev = evaluate(run.raw_model, run.val_set, run.val_ds.bytes_per_token, tc.dtype, run.info.device,
                  ignore_index=IGNORE_INDEX if masked(run.loader) else None)
    run.log.log({"step": run.step, "val_loss": ev.loss, "val_ppl": ev.ppl, "val_bpb": ev.bpb})
    bpb = f", bpb {ev.bpb:.4f}" if ev.bpb is not None else ""
    logger.info("step %d: val loss %.4f, ppl %.2f%s", run.step, ev.loss, ev.ppl, bpb)
    better = run.best_val is None or ev.loss < run.best_val
    if tc.checkpoint_format == "file" and (better or run.fsdp):  # under FSDP every rank takes part in gathering
        state = _snapshot(run)
        if run.info.is_main and better:
            run.ckpts.save_best(*state, run.step, ev.loss, _train_state(run))
    run.best_val = ev.loss if better else run.best_val
    if tc.target_val_bpb is not None and ev.bpb is not None and ev.bpb <= tc.target_val_bpb:
        _check_target(run, ev.bpb)
    run.log.plot()


def _check_target(run: _Run, estimate: float) -> None:
    """The periodic estimate reached ``training.target_val_bpb``: score ``training.target_eval_batches`` (the whole
    validation split by default; the figure a report states) and stop only if that reaches the target too.

    Runs only when the estimate crosses; it reads fixed batches and draws no random numbers, so exact resume holds.
    """
    tc = run.cfg.training
    if run.target_set is None:
        run.target_set = validation_batches(run.val_ds, tc.eval_batch_size or tc.batch_size, run.cfg.context_length,
                                            tc.target_eval_batches)
    batches, ignore, count = run.target_set
    ev = evaluate(run.raw_model, batches, run.val_ds.bytes_per_token, tc.dtype, run.info.device, ignore_index=ignore)
    run.log.log({"step": run.step, "target_eval_loss": ev.loss, "target_eval_bpb": ev.bpb,
                 "target_eval_tokens": count})
    whole = tc.target_eval_batches is None or len(batches) < tc.target_eval_batches  # the split ran out first
    what = "the whole validation split" if whole else f"the first {len(batches)} validation batches"
    if ev.bpb <= tc.target_val_bpb:
        run.reached_target = True
        logger.info("step %d: validation bits/byte %.4f over %s (%d tokens) reached the target %.4f; stopping",
                    run.step, ev.bpb, what, count, tc.target_val_bpb)
    else:
        logger.info("step %d: the estimate on %d validation tokens, %.4f bits/byte, reached the target %.4f, but "
                    "%s (%d tokens) is at %.4f; training on", run.step, sum(y.numel() for _, y in run.val_set),
                    estimate, tc.target_val_bpb, what, count, ev.bpb)


def _maybe_checkpoint(run: _Run) -> None:
    """Every ``checkpoint_every`` steps and at the end: save everything that moves, together."""
    tc = run.cfg.training
    due = run.step % tc.checkpoint_every == 0 or run.step == tc.max_steps or run.reached_target
    if due and tc.checkpoint_format == "dcp":
        run.last_ckpt = save_dcp(run.ckpts, run.raw_model, run.optimizer, run.step, _train_state(run))
    elif due:
        state = _snapshot(run)
        if run.info.is_main:
            run.last_ckpt = run.ckpts.save(*state, run.step, _train_state(run))
        barrier()


def _snapshot(run: _Run) -> tuple[Any, Any]:
    """What a checkpoint saves (under FSDP gathered from all ranks: every rank must call this)."""
    if run.fsdp:
        return full_state_dicts(run.raw_model, run.optimizer)
    return trained_state(run.cfg, run.raw_model), run.optimizer  # the whole model, or a LoRA run's adapters


def _train_state(run: _Run) -> dict[str, Any]:
    """The checkpoint's extra: data-loader position and RNG states, and the resolved config."""
    return {"train": {"loader": run.loader.state_dict(), "rng": _rng_state(run.info.device), "tokens": run.tokens},
            "config": to_dict(run.cfg)}


def _finish(run: _Run) -> dict[str, Any]:
    """Draw the loss curve, close the logs, and sum the run up (see :func:`train`)."""
    run.log.plot()
    run.log.close()
    last_train = next((r for r in reversed(run.log.records) if "loss" in r), {})
    last_val = next((r for r in reversed(run.log.records) if "val_loss" in r), {})
    return {"step": run.step, "loss": last_train.get("loss"), "val_loss": last_val.get("val_loss"),
            "val_ppl": last_val.get("val_ppl"), "val_bpb": last_val.get("val_bpb"), "best_val_loss": run.best_val,
            "tokens": run.tokens, "tokens_per_s": last_train.get("tokens_per_s"),
            "mfu": last_train.get("mfu"), "train_seconds": run.elapsed,
            "checkpoint": str(run.last_ckpt) if run.last_ckpt else None, "run_dir": str(run.run_dir),
            "reached_target": run.reached_target}
