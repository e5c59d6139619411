"""The run config: typed sections (optimizer, data, training) around the model's ``ModelConfig``.

``RunConfig`` is what a run is made of; ``load_run_config`` reads it from YAML with ``--set`` overrides and
validates every field (a ``ValueError`` that names the field and the fix). The resolved config is saved as
``config.yaml`` in every run directory.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal, Sequence

from lmforge.config import apply_overrides, from_dict, load_yaml
from lmforge.data.mixture import check_copy_settings
from lmforge.model import ModelConfig
from lmforge.model.lora import LoraConfig

__all__ = ["OptimConfig", "DataConfig", "TrainingConfig", "SFTConfig", "RLConfig", "RunConfig", "load_run_config",
           "REWARDS"]

REWARDS = ("exact_match", "format")
"""The built-in rewards ``rl.reward`` may name (``lmforge.rl.rewards`` computes them); no user code is loaded."""


# ==================================================================================================
# Config
# ==================================================================================================
@dataclasses.dataclass
class OptimConfig:
    """Optimizer and learning-rate schedule."""

    name: Literal["adamw", "sgd", "muon"] = "adamw"
    """``adamw`` (decoupled weight decay), plain ``sgd``, or ``muon`` (Muon for the blocks' matrices, AdamW for
    embeddings, head, norms and biases)."""
    lr: float = 3e-4
    """Peak of the learning-rate schedule, and the peak rate of every parameter group without a rate of its own:
    with ``adamw`` the blocks' matrices and each of embeddings, head and scalars whose own rate (``embed_lr``,
    ``head_lr``, ``scalar_lr``) is null; with ``muon`` the latter only (the blocks' matrices take ``muon_lr``); with
    ``sgd`` every parameter. ``dmodel_lr_scale`` multiplies the embeddings' and head's rate, ``lr`` included. Each
    group follows the schedule in proportion (its peak times the scheduled rate over ``lr``), so with every group's
    rate set, as in the speedrun's recipe, ``lr`` is no group's rate: only the schedule's shape (``min_lr / lr``)
    comes from it."""
    min_lr: float = 3e-5
    """The schedule's floor (the end of the cosine or WSD decay, and after it), in ``lr``'s terms: each group ends at
    its own peak times ``min_lr / lr``."""
    warmup_steps: int = 100
    """Steps of linear warmup from 0 to ``lr`` (each group to its own peak)."""
    decay_steps: int | None = None
    """Step at which the cosine reaches ``min_lr``; ``null`` = ``training.max_steps``."""
    schedule: Literal["cosine", "constant", "wsd"] = "cosine"
    """``cosine``: warmup, cosine decay to ``min_lr``; ``constant``: warmup, then ``lr``; ``wsd``: warmup, ``lr``,
    then a linear decay to ``min_lr`` over the last ``cooldown_frac`` of the steps up to ``decay_steps``: with
    ``T = decay_steps`` (or ``training.max_steps``) and ``W = round(cooldown_frac·T)``, 0-based step ``s >= T - W``
    runs at ``min_lr + (lr - min_lr)·(T - 1 - s)/W``, so step ``T - 1`` at ``min_lr``. With ``warmup_steps: 0``,
    ``cooldown_frac: 0.2`` and ``min_lr: 0`` this is nanochat's schedule one step earlier: nanochat's step ``s`` runs
    at ``lr·min(1, (T - s)/W)``, its last at ``lr/W`` where this one's runs at 0 (and changes no weight)."""
    cooldown_frac: float = 0.4
    """With ``wsd``: the share of the run (up to ``decay_steps`` or ``training.max_steps``) spent decaying."""
    weight_decay: float = 0.1
    """Decoupled weight decay of the matrices AdamW trains: with ``adamw`` every tensor of 2+ dims (blocks'
    matrices, embeddings, head), with ``muon`` the embeddings and head only (Muon's matrices take
    ``muon_weight_decay``; nanochat: 0 for both). Vectors, norms and biases are never decayed."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW moment decay rates (with ``muon``: of the AdamW groups; nanochat: ``[0.8, 0.95]``)."""
    eps: float = 1e-8
    """AdamW denominator epsilon (nanochat: 1e-10)."""
    grad_clip: float = 1.0
    """Clip the global gradient L2 norm to this value; 0 disables clipping."""
    embed_lr: float | None = None
    """Peak learning rate of the embeddings (the token embedding, value embeddings; AdamW); ``null`` = ``lr``. The
    schedule scales every group alike; ``dmodel_lr_scale`` multiplies it."""
    head_lr: float | None = None
    """Peak learning rate of the LM head (AdamW); ``null`` = ``lr``; ``dmodel_lr_scale`` multiplies it."""
    dmodel_lr_scale: bool = False
    """Multiply the embeddings' and the head's peak rates (``embed_lr``, ``head_lr``, or ``lr`` where null) by
    ``(model.d_model / 768) ** -0.5``, as nanochat does with the rates it tuned at width 768 (1.73 at d_model 256)."""
    scalar_lr: float | None = None
    """Peak learning rate of the vectors and scalars (norm gains, biases, gates, skip weights; AdamW, never decayed);
    ``null`` = ``lr``."""
    muon_lr: float = 0.02
    """Muon's peak learning rate; the schedule scales it like ``lr`` (its floor is ``min_lr * muon_lr / lr``)."""
    muon_momentum: float = 0.95
    """Muon's momentum (an EMA of gradients); after ``muon_momentum_warmup_steps``, if any."""
    muon_momentum_warmup_steps: int = 0
    """Steps over which Muon's momentum rises linearly from ``muon_momentum_start`` (step 0) to ``muon_momentum``
    (nanochat: 300 steps from 0.85 to 0.95); 0 = ``muon_momentum`` from the first step. Set by the loop from the step
    number, so a resumed run continues it exactly."""
    muon_momentum_start: float = 0.85
    """With ``muon_momentum_warmup_steps``: Muon's momentum at the first step."""
    muon_nesterov: bool = True
    """Muon updates with Nesterov momentum."""
    muon_weight_decay: float = 0.0
    """Decoupled weight decay of the Muon matrices (nanochat: 0; ``weight_decay`` covers the AdamW matrices)."""
    muon_ns_steps: int = 5
    """Newton–Schulz iterations per step."""
    muon_ns_coefficients: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
    """Coefficients (a, b, c) of the quintic Newton–Schulz iteration (Keller Jordan's)."""
    muon_ns_dtype: Literal["bf16", "fp32", "auto"] = "auto"
    """Precision of the Newton–Schulz iteration: ``bf16`` as Keller Jordan, nanochat and torch.optim.Muon;
    ``auto`` = ``bf16`` where the device multiplies it natively (CUDA, avx512_bf16/AMX), else ``fp32``."""
    muon_adjust_lr: Literal["original", "match_rms_adamw"] = "original"
    """Per-matrix LR multiplier: ``original`` sqrt(max(1, rows/cols)); ``match_rms_adamw`` 0.2*sqrt(max(rows, cols))
    (then ``muon_lr`` near AdamW's ``lr`` is the usual choice)."""

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"optimizer.lr must be > 0, got {self.lr}; typical values are 1e-4 .. 3e-3")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"optimizer.min_lr must be in [0, optimizer.lr={self.lr}], got {self.min_lr}")
        if self.warmup_steps < 0:
            raise ValueError(f"optimizer.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.decay_steps is not None and self.decay_steps <= self.warmup_steps:
            raise ValueError(f"optimizer.decay_steps={self.decay_steps} must exceed optimizer.warmup_steps="
                             f"{self.warmup_steps} (or be null for training.max_steps)")
        if not 0 <= self.cooldown_frac <= 1:
            raise ValueError(f"optimizer.cooldown_frac must be in [0, 1] (a share of the run), got {self.cooldown_frac}")
        if self.weight_decay < 0:
            raise ValueError(f"optimizer.weight_decay must be >= 0, got {self.weight_decay}")
        if not all(0 <= b < 1 for b in self.betas) or len(self.betas) != 2:
            raise ValueError(f"optimizer.betas must be two numbers in [0, 1), got {list(self.betas)}; e.g. [0.9, 0.95]")
        if not self.eps > 0:
            raise ValueError(f"optimizer.eps must be > 0, got {self.eps}")
        if self.grad_clip < 0:
            raise ValueError(f"optimizer.grad_clip must be >= 0 (0 disables clipping), got {self.grad_clip}")
        for name in ("embed_lr", "head_lr", "scalar_lr"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ValueError(f"optimizer.{name} must be > 0 (or null for optimizer.lr), got {getattr(self, name)}")
        if self.name == "sgd" and (self.embed_lr, self.head_lr, self.scalar_lr) != (None, None, None):
            raise ValueError("optimizer.embed_lr/head_lr/scalar_lr apply to adamw and muon; with sgd set them to null")
        if self.name == "sgd" and self.dmodel_lr_scale:
            raise ValueError("optimizer.dmodel_lr_scale scales AdamW's embedding and head rates; with sgd set it false")
        if not self.muon_lr > 0:
            raise ValueError(f"optimizer.muon_lr must be > 0, got {self.muon_lr}; typical: 0.02 (muon_adjust_lr: "
                             "original) or near optimizer.lr (match_rms_adamw)")
        if not 0 <= self.muon_momentum < 1:
            raise ValueError(f"optimizer.muon_momentum must be in [0, 1), got {self.muon_momentum}; e.g. 0.95")
        if self.muon_momentum_warmup_steps < 0:
            raise ValueError(f"optimizer.muon_momentum_warmup_steps must be >= 0 (0 = off), got "
                             f"{self.muon_momentum_warmup_steps}")
        if not 0 <= self.muon_momentum_start < 1:
            raise ValueError(f"optimizer.muon_momentum_start must be in [0, 1), got {self.muon_momentum_start}; e.g. 0.85")
        if self.muon_weight_decay < 0:
            raise ValueError(f"optimizer.muon_weight_decay must be >= 0, got {self.muon_weight_decay}")
        if not 1 <= self.muon_ns_steps < 100:
            raise ValueError(f"optimizer.muon_ns_steps must be in [1, 100), got {self.muon_ns_steps}; 5 is usual")
        if len(self.muon_ns_coefficients) != 3:
            raise ValueError(f"optimizer.muon_ns_coefficients must be three numbers (a, b, c), got "
                             f"{list(self.muon_ns_coefficients)}; e.g. [3.4445, -4.7750, 2.0315]")


@dataclasses.dataclass
class DataConfig:
    """Where the token shards (from ``lmforge data prepare``) and their tokenizer are."""

    dir: str = ""
    """Shard directory (``manifest.json`` + ``{split}_*.bin``)."""
    tokenizer: str | None = None
    """Tokenizer file the shards were made with; ``null`` = the path recorded in the manifest, else ``<dir>/tokenizer.json``."""
    train_split: str = "train"
    """Split to train on."""
    val_split: str | None = "val"
    """Split to evaluate on; ``null`` disables validation."""
    bos_aligned: bool = False
    """Start every training block at a document start (needs a BOS/EOT token in the shards)."""
    kind: Literal["tokens", "conversations", "prompts"] = "tokens"
    """``tokens``: token shards (pretraining); ``conversations``: rendered conversations with loss masks, packed
    whole into rows (``lmforge.data.conversations``; written by ``lmforge sft``); ``prompts``: rendered chat
    prompts with exact answers, whose batches are sampled replies (written and run by ``lmforge rl``)."""
    copy_fraction: float = 0.0
    """Share of each pretraining block's tokens overwritten on the fly by synthetic text that repeats itself, so
    that in-context copying is learned early (``lmforge.data.mixture``); 0 = off, at most 0.5. Seeded by the block's
    place in the run: resuming is exact. The share measured is logged as ``copy_data_share``. In a fine-tuning run
    (``lmforge midtrain``) it applies to the blocks of ``sft.pretrain_mix``."""
    copy_sources: tuple[Literal["repeat", "names", "random"], ...] = ("repeat", "names", "random")
    """The synthetic sources, drawn in equal shares: ``repeat`` (a span of the block's text repeated after a gap),
    ``names`` (template sentences that mention a made-up name twice), ``random`` (random ids, a gap, the same ids)."""
    copy_span: tuple[int, int] = (16, 64)
    """``[lo, hi]``: tokens in a ``repeat`` or ``random`` segment's half (uniform; at most a third of the block)."""

    def __post_init__(self) -> None:
        if not self.dir:
            raise ValueError("data.dir is empty; set it to a shard directory made by `lmforge data prepare`")
        check_copy_settings(self.copy_fraction, self.copy_sources, self.copy_span)
        if self.copy_fraction and self.kind == "prompts":
            raise ValueError("data.copy_fraction mixes copy data into pretraining blocks (data.kind: tokens, or the "
                             "blocks of sft.pretrain_mix), not into prompts; set it to 0")


@dataclasses.dataclass
class TrainingConfig:
    """The loop: length, batch, numerics, devices, how often to log/evaluate/save."""

    max_steps: int = 1000
    """Optimizer steps in the whole run (a resumed run continues up to this)."""
    batch_size: int = 16
    """Sequences per micro-batch on each rank."""
    grad_accum_steps: int = 1
    """Micro-batches per optimizer step; tokens/step = batch_size x context x grad_accum_steps x ranks."""
    global_batch_size: int | None = None
    """Sequences per optimizer step over all ranks, the same at any world size (then ``batch_size`` and
    ``grad_accum_steps`` are unused); ``null`` = ``batch_size x grad_accum_steps x ranks``. See train/batching.py."""
    micro_batch_size: int | None = None
    """With ``global_batch_size``: sequences per forward/backward on one rank (a memory cap; the rest is gradient
    accumulation); ``null`` = ``global_batch_size / ranks``."""
    batch_warmup_steps: int = 0
    """Batch-size warm-up: over the first this many steps the global batch grows linearly from
    ``batch_warmup_start`` of its rows to all of them (each micro-batch trains on its first rows; the rest of
    those blocks are skipped). 0 = off. Pretraining (``data.kind: tokens``) only."""
    batch_warmup_start: float = 0.25
    """With ``batch_warmup_steps``: the share of each micro-batch's rows the first step trains on, in (0, 1]."""
    activation_checkpointing: bool = False
    """Recompute each Transformer block's activations in the backward pass instead of storing them (less memory,
    ~1/3 more compute; the same losses)."""
    checkpoint_format: Literal["file", "dcp"] = "file"
    """``file``: one safetensors file per checkpoint (gathered to rank 0 under FSDP); ``dcp``: a directory of
    per-rank shards written with torch.distributed.checkpoint, loadable at any world size (``lmforge checkpoint
    consolidate`` turns one into a file)."""
    context_length: int | None = None
    """Training sequence length; ``null`` = ``model.context_length`` (may not exceed it: the RoPE table size)."""
    device: str = "auto"
    """``auto`` (cuda > mps > cpu), ``cpu``, ``cuda``, ``cuda:N`` or ``mps``."""
    dtype: Literal["fp32", "bf16", "auto"] = "fp32"
    """``bf16`` runs forward/backward under bfloat16 autocast (weights and optimizer stay fp32); ``auto`` = ``bf16``
    where the device multiplies bf16 natively (CUDA, a CPU with avx512_bf16 or AMX), else ``fp32``. A run saves
    the dtype it resolved to. ``bf16`` on a CPU without native bf16 works but warns: it is many times slower."""
    compile: bool = False
    """Compile each Transformer block with ``torch.compile``, in place (one graph serves every block)."""
    fp8: bool = False
    """Multiply the blocks' projections in float8 while training (e4m3 forward, e5m2 gradients, a scale per tensor;
    :mod:`lmforge.model.fp8`): CUDA GPUs of compute capability 8.9+ (the CPU too, slowly, for tests). Master weights,
    optimizer state and checkpoints are unchanged; evaluation and decoding use the plain products."""
    parallel: Literal["ddp", "fsdp"] = "ddp"
    """Data parallelism under ``torchrun``: ``ddp`` (replicate) or ``fsdp`` (shard); ignored in one process."""
    seed: int = 1337
    """Seed for weight init and data order."""
    num_threads: int | None = None
    """CPU threads for torch; ``null`` = torch's default."""
    log_every: int = 10
    """Write a train-loss event to metrics.jsonl every this many steps."""
    eval_every: int = 200
    """Validate every this many steps (and at the end)."""
    eval_batches: int = 20
    """Validation batches per evaluation (a fixed, deterministic set)."""
    eval_batch_size: int | None = None
    """Sequences per validation batch; ``null`` = ``batch_size`` (lower it for a small validation split)."""
    target_val_bpb: float | None = None
    """Stop once the validation bits per byte over ``target_eval_batches`` is at or below this (saving a checkpoint
    there); ``null`` = train ``max_steps``. The periodic evaluation (``eval_batches``) only says when to look: when
    its estimate reaches the target, the larger set is scored, and training stops only if that figure reaches it too
    (else one log line gives both figures, and training goes on)."""
    target_eval_batches: int | None = None
    """Validation batches (of ``eval_batch_size`` sequences, the split's first blocks in order) of the figure that
    judges ``target_val_bpb``; ``null`` = the whole validation split."""
    checkpoint_every: int = 500
    """Save a checkpoint every this many steps (and at the end)."""
    keep_last: int = 3
    """Step checkpoints to keep (the best by val loss is kept separately)."""
    peak_flops: float | None = None
    """Peak FLOP/s of one device, for MFU; ``null`` = known GPUs' bf16 peak, else MFU is not reported."""
    wandb: bool = False
    """Mirror metrics to Weights & Biases (``pip install wandb``)."""
    wandb_project: str = "lmforge"
    """wandb project name."""
    wandb_mode: Literal["online", "offline", "disabled"] = "online"
    """``offline`` logs locally without an account (sync later with ``wandb sync``)."""

    def __post_init__(self) -> None:
        for name in ("max_steps", "batch_size", "grad_accum_steps", "log_every", "eval_every", "eval_batches",
                     "checkpoint_every", "keep_last"):
            if getattr(self, name) < 1:
                raise ValueError(f"training.{name} must be >= 1, got {getattr(self, name)}")
        if self.batch_warmup_steps < 0:
            raise ValueError(f"training.batch_warmup_steps must be >= 0 (0 = off), got {self.batch_warmup_steps}")
        if not 0 < self.batch_warmup_start <= 1:
            raise ValueError(f"training.batch_warmup_start must be in (0, 1] (a share of the batch's rows), got "
                             f"{self.batch_warmup_start}")
        if self.context_length is not None and self.context_length < 1:
            raise ValueError(f"training.context_length must be >= 1 (or null), got {self.context_length}")
        for name in ("global_batch_size", "micro_batch_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"training.{name} must be >= 1 (or null), got {getattr(self, name)}")
        if self.micro_batch_size is not None and self.global_batch_size is None:
            raise ValueError("training.micro_batch_size only applies with training.global_batch_size; set "
                             "global_batch_size, or use batch_size and grad_accum_steps instead")
        if self.eval_batch_size is not None and self.eval_batch_size < 1:
            raise ValueError(f"training.eval_batch_size must be >= 1 (or null for batch_size), got {self.eval_batch_size}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"training.num_threads must be >= 1 (or null), got {self.num_threads}")
        if self.target_eval_batches is not None and self.target_eval_batches < 1:
            raise ValueError(f"training.target_eval_batches must be >= 1 (or null for the whole validation split), got "
                             f"{self.target_eval_batches}")
        if self.target_val_bpb is not None and not self.target_val_bpb > 0:
            raise ValueError(f"training.target_val_bpb must be > 0 (or null), got {self.target_val_bpb}")
        if self.peak_flops is not None and not self.peak_flops > 0:
            raise ValueError(f"training.peak_flops must be > 0 (or null), got {self.peak_flops}")


@dataclasses.dataclass
class SFTConfig:
    """Fine-tuning from a base run (written by ``lmforge sft``; the base fields are filled in, not typed)."""

    base_run: str = ""
    """The base run directory."""
    base_checkpoint: str = ""
    """The base checkpoint file the weights start from."""
    base_sha256: str = ""
    """sha256 of ``base_checkpoint``: a different file is refused (and a LoRA run cannot load onto it)."""
    base_vocab_size: int = 1
    """Rows of the base model's embedding; the model grows to ``model.vocab_size`` with mean rows."""
    pretrain_mix: float = 0.0
    """Fraction of each batch's rows taken from the base run's token shards (``pretrain_dir``), in [0, 1)."""
    pretrain_dir: str | None = None
    """Token shards for ``pretrain_mix``; ``null`` = the base run's ``data.dir``."""

    def __post_init__(self) -> None:
        if not self.base_run or not self.base_checkpoint:
            raise ValueError("sft.base_run and sft.base_checkpoint are empty; start fine-tuning with "
                             "`lmforge sft --base RUN`, which fills them in")
        if not 0 <= self.pretrain_mix < 1:
            raise ValueError(f"sft.pretrain_mix must be in [0, 1) (a fraction of each batch's rows), got "
                             f"{self.pretrain_mix}")

    def pretrain_rows(self, batch_size: int) -> int:
        """Rows of each micro-batch taken from the pretraining shards: ``round(pretrain_mix * batch_size)``, at
        least one when the mix is not 0."""
        return max(1, round(self.pretrain_mix * batch_size)) if self.pretrain_mix > 0 else 0


@dataclasses.dataclass
class RLConfig:
    """Reinforcement learning from verifiable rewards (``lmforge rl``): rollouts, reward, advantages, evaluation."""

    samples_per_prompt: int = 8
    """K: replies sampled per prompt; each reply's advantage is its reward minus its group's mean (K >= 2)."""
    prompts_per_step: int = 8
    """Prompts per optimizer step over all ranks; the step trains on ``prompts_per_step x samples_per_prompt``
    replies (split over ranks by whole prompts)."""
    reward: Literal[REWARDS] = "exact_match"  # type: ignore[valid-type]  (the names live in REWARDS)
    """``exact_match``: 1 when the reply's final text equals the prompt's answer, as ``lmforge eval --task`` scores
    it, else 0; ``format``: 1 when the reply ends with ``<|assistant_end|>``, else 0."""
    std_advantages: bool = False
    """Divide each group's advantages by the group's reward standard deviation (GRPO). Off by default: it weights
    prompts the model almost always (or almost never) solves as much as the ones it is learning (Dr. GRPO,
    Liu et al. 2025), and nanochat's RL does without it."""
    temperature: float = 0.5
    """Sampling temperature of the rollouts and of pass@k (> 0: at 0 all K replies would be the same). Below 1 by
    default: a small model's distribution at 1 is so flat that right replies are rare (the speedrun's SFT model
    samples a right calculator reply 2% of the time at 1, 28% at 0.5, greedy 46%), and a reward never seen teaches
    nothing. The update trains the distribution that sampled: the loss's and the KL term's log-probabilities are
    the model's at this temperature (its logits divided by it), so the trained policy is the model sampled at
    ``rl.temperature``, not at 1."""
    top_k: int | None = None
    """Sample among the ``top_k`` most likely tokens only; ``null`` = all."""
    top_p: float | None = None
    """Nucleus sampling: the smallest set of tokens with this much probability; ``null`` = all."""
    max_new_tokens: int = 64
    """Sampled tokens per reply at most (a calculator's output fed back is not counted)."""
    tools: bool = True
    """Run calculator calls while sampling (their output is fed back and masked out of the loss), as the chat does."""
    kl_coef: float = 0.0
    """Weight of a KL penalty to the starting (SFT) model, on each sampled token's log-ratio; 0 = none (nanochat)."""
    prompts_per_decode: int = 1
    """Prompts whose replies are decoded together in one batch (``samples_per_prompt`` rows each). A reply depends
    only on the batch it is decoded in, so it must divide ``prompts_per_step / world size``; more is faster."""
    eval_samples: int = 8
    """Replies sampled per validation prompt for pass@1 and pass@k (k = this), before and after training."""
    eval_prompts: int | None = None
    """Score the first this many validation prompts; ``null`` = all of them."""

    def __post_init__(self) -> None:
        if self.samples_per_prompt < 2:
            raise ValueError(f"rl.samples_per_prompt={self.samples_per_prompt}: an advantage is a reward minus its "
                             "group's mean, which is always 0 for a group of one; use 2 or more (8 or 16 are usual)")
        for name in ("prompts_per_step", "max_new_tokens", "prompts_per_decode", "eval_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"rl.{name} must be >= 1, got {getattr(self, name)}")
        if self.eval_prompts is not None and self.eval_prompts < 1:
            raise ValueError(f"rl.eval_prompts must be >= 1 (or null for all), got {self.eval_prompts}")
        if not 0 < self.temperature < float("inf"):
            raise ValueError(f"rl.temperature must be a finite number > 0, got {self.temperature}; at 0 (greedy) "
                             "every sample of a prompt is the same and no advantage is ever nonzero")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"rl.top_k must be >= 1 (or null for all tokens), got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"rl.top_p must be in (0, 1] (or null), got {self.top_p}")
        if not 0 <= self.kl_coef < float("inf"):
            raise ValueError(f"rl.kl_coef must be a finite number >= 0 (0: no KL penalty), got {self.kl_coef}")
        if self.prompts_per_step % self.prompts_per_decode:
            raise ValueError(f"rl.prompts_per_decode={self.prompts_per_decode} must divide rl.prompts_per_step="
                             f"{self.prompts_per_step}")


@dataclasses.dataclass
class RunConfig:
    """Everything a run needs; saved as ``config.yaml`` in the run directory."""

    model: ModelConfig
    data: DataConfig
    optimizer: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    training: TrainingConfig = dataclasses.field(default_factory=TrainingConfig)
    sft: SFTConfig | None = None
    """Fine-tuning from a base run (``lmforge sft``); ``null`` for pretraining."""
    lora: LoraConfig | None = None
    """Train LoRA adapters ``{rank, alpha, dropout, targets}`` instead of every weight (needs ``sft``); the
    run's checkpoints then hold the adapters and their optimizer state only."""
    rl: RLConfig | None = None
    """Reinforcement learning on prompts with exact answers (``lmforge rl``, with ``data.kind: prompts``)."""

    def __post_init__(self) -> None:
        if self.lora is not None and self.sft is None:
            raise ValueError("a lora section needs a base model to adapt: fine-tune with `lmforge sft --base RUN` "
                             "(pretraining trains every weight)")
        if self.lora is not None and self.training.parallel == "fsdp":
            raise ValueError("training.parallel=fsdp with a lora section: adapters are a few MB, so sharding saves "
                             "nothing and the checkpoint keeps adapters only; use training.parallel=ddp")
        if self.sft is not None and self.sft.pretrain_rows(self.training.batch_size) >= self.training.batch_size:
            raise ValueError(f"sft.pretrain_mix={self.sft.pretrain_mix} leaves no conversation row in a batch of "
                             f"training.batch_size={self.training.batch_size}; lower the mix or raise the batch size")
        if self.data.copy_fraction and self.data.kind == "conversations" and \
                (self.sft is None or not self.sft.pretrain_mix):
            raise ValueError("data.copy_fraction mixes copy data into pretraining blocks, which conversations have "
                             "only with sft.pretrain_mix > 0 (as lmforge midtrain mixes them); set it to 0 or mix "
                             "pretraining blocks in")
        if (self.rl is None) != (self.data.kind != "prompts"):
            raise ValueError("an rl section and data.kind: prompts go together (reinforcement learning samples its "
                             "batches from prompts); start such a run with `lmforge rl --base RUN`")
        if self.rl is not None and self.sft is None:
            raise ValueError("an rl section needs a base model to start from; start it with `lmforge rl --base RUN`")
        if self.training.batch_warmup_steps and self.data.kind != "tokens":
            raise ValueError(f"training.batch_warmup_steps applies to pretraining (data.kind: tokens), not to "
                             f"data.kind: {self.data.kind}; set it to 0")
        T = self.training.context_length
        if T is not None and T > self.model.context_length:
            raise ValueError(f"training.context_length={T} is longer than model.context_length="
                             f"{self.model.context_length} (the RoPE table); lower it or raise model.context_length")
        if self.optimizer.warmup_steps >= self.training.max_steps and self.optimizer.schedule != "constant" \
                and self.optimizer.decay_steps is None:
            raise ValueError(f"optimizer.warmup_steps={self.optimizer.warmup_steps} must be < training.max_steps="
                             f"{self.training.max_steps}; shorten the warmup")

    @property
    def context_length(self) -> int:
        return self.training.context_length or self.model.context_length


def load_run_config(path: str | Path | None = None, overrides: Sequence[str] = (),
                    base: dict[str, Any] | None = None) -> RunConfig:
    """Read a YAML run config (or ``base``), apply ``section.key=value`` overrides, validate into a RunConfig."""
    d = load_yaml(path) if path is not None else dict(base or {})
    d = apply_overrides(d, overrides)
    for section in ("model", "data"):
        if section not in d:
            raise ValueError(f"the config has no '{section}' section; see examples/tiny.yaml")
    return from_dict(RunConfig, d)


# Changing these between runs in one directory would make the checkpoints meaningless.
_INCOMPATIBLE = ("model.", "data.dir", "data.train_split", "data.bos_aligned", "training.batch_size",
                 "training.batch_warmup", "training.grad_accum_steps", "training.global_batch_size",
                 "training.context_length", "training.seed", "data.kind", "data.copy_", "sft.", "lora.", "rl.")
# the fast path computes the same function with the same weights; evaluation settings change no step
_HARMLESS = ("model.fast", "rl.eval_samples", "rl.eval_prompts")
# data.tokenizer may move (its fingerprint must still match the shards); data.val_split only changes evaluation.
