"""A Llama-style decoder-only Transformer LM built from the primitives in :mod:`lmforge.model.layers`.

``TransformerLM``: token embeddings -> ``n_layers`` pre-norm blocks (causal self-attention with RoPE and
optional grouped-query attention, SwiGLU feed-forward) -> final RMSNorm (:meth:`TransformerLM.hidden`) -> LM head
and what the recipe applies to its output (:meth:`TransformerLM.logits`: the one place hidden states become logits,
for the forward, the inference engine, the evals and RL alike).

Two numerically equivalent paths, chosen by ``ModelConfig.fast`` (``set_fast`` switches at run time):

* reference (``fast=False``): the CS336 formulas written out with tensor ops; the spec.
* fast (``fast=True``, default): PyTorch's fused attention kernel (flash), Q/K/V and W1/W3 projections
  with a hand-written backward that accumulates ``dx`` inside the GEMMs (one matmul over concatenated
  weights when decoding), complex-multiply RoPE, RMSNorm with a hand-written backward, and when
  ``targets`` are given a chunked LM head + cross-entropy that never materialises the ``(B·T, V)`` logits.
  Measured on CPU (``benchmarks/bench_train_step.py``): fusing the weights for training did not pay
  there (same GEMM efficiency, plus concatenation copies), the lean backward and the loss did.

Parameter names follow the CS336 convention in both paths, so checkpoints are interchangeable:
``token_embeddings.weight``, ``layers.{i}.attn.{q,k,v,output}_proj.weight``, ``layers.{i}.ln1.weight``,
``layers.{i}.ffn.{w1,w2,w3}.weight``, ``layers.{i}.ln2.weight``, ``ln_final.weight``, ``lm_head.weight``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lmforge.checkpoint import grow_rows
from lmforge.model.blocks import MLPS, CausalSelfAttention, TransformerBlock
from lmforge.model.cache import KVCache, check_context
from lmforge.model.fused import Norm, cached_projections
from lmforge.model.layers import (Device, DType, Embedding, Linear, RMSNorm, RotaryPositionalEmbedding, SwiGLU,
                                  _trunc_normal_, default_d_ff, scaled_dot_product_attention, silu, softmax)
from lmforge.model.losses import compiled_softmax_grad, cross_entropy, linear_cross_entropy
from lmforge.model.recipe import Smear, rms_norm_heads, softcap, softcap_reference

__all__ = ["ModelConfig", "MAX_CONTEXT_LENGTH", "TransformerLM", "TransformerBlock", "CausalSelfAttention", "KVCache",
           "Linear", "Embedding", "RMSNorm", "SwiGLU", "RotaryPositionalEmbedding", "softmax", "silu",
           "scaled_dot_product_attention", "cross_entropy", "linear_cross_entropy", "num_params",
           "flops_per_token", "matmul_params_per_token", "cached_projections", "Norm", "RECIPE_OPTIONS",
           "NUMERICS_ONLY", "INIT_ONLY", "options_beyond"]


RECIPE_OPTIONS = ("smear", "smear_keys", "value_embeds", "unet_skips", "mlp", "logit_softcap", "qk_norm", "zero_init",
                  "head_init_std", "embed_norm", "qk_norm_scale", "key_offset")
"""The training-recipe options of :class:`ModelConfig` (all off by default)."""

NUMERICS_ONLY = ("fast",)
"""``ModelConfig`` fields that choose how the same function is computed, not which."""
INIT_ONLY = ("zero_init", "head_init_std")
"""``ModelConfig`` fields that choose only how training starts (the trained model is the same architecture)."""

MAX_CONTEXT_LENGTH = 1 << 20
"""The longest ``context_length`` a model may have (1,048,576 tokens): the RoPE tables are built for every
position, so an absurd value (``max_position_embeddings: 1e15`` in a config.json) fails here, in one line, rather
than in every later command as an allocation of petabytes."""


@dataclass
class ModelConfig:
    """Shape and numerics of a :class:`TransformerLM`; validated on construction."""

    vocab_size: int
    """Number of token ids (the tokenizer's ``vocab_size``)."""
    context_length: int
    """Longest sequence the model accepts (the RoPE table size); at most :data:`MAX_CONTEXT_LENGTH`."""
    d_model: int
    """Width of the residual stream."""
    n_layers: int
    """Number of Transformer blocks."""
    n_heads: int
    """Query heads per attention layer; ``d_model`` must be divisible by it (head dim = d_model/n_heads, even)."""
    n_kv_heads: int | None = None
    """Key/value heads (grouped-query attention); ``None`` = ``n_heads`` (plain multi-head attention)."""
    d_ff: int | None = None
    """Hidden width of the SwiGLU feed-forward; ``None`` = 8/3·d_model rounded to a multiple of 64."""
    rope_theta: float = 10000.0
    """RoPE base: pair ``i`` turns by ``position · theta^(-2i/head_dim)``."""
    tie_embeddings: bool = False
    """Share one matrix between the token embeddings and the LM head."""
    norm_eps: float = 1e-5
    """Epsilon inside every RMSNorm."""
    fast: bool = True
    """Use the fused fast path (same numbers as the reference path within float tolerance)."""
    smear: bool = False
    """Previous-token mixing: each token's embedding gets a learned, gated share of the previous token's
    (:class:`~lmforge.model.recipe.Smear`; starts at zero), so in-context copying (induction) can form early."""
    smear_keys: bool = False
    """Smeared keys (Olsson et al. 2022): each key head mixes in the previous token's key with a learned share
    (heads start spread from 0.12 to 0.88), so a head matching the current token against previous ones -- half of
    an induction head -- exists from the start."""
    key_offset: bool = False
    """Partial key offset (modded-nanogpt's record #49): in every layer, the second half of each key head's
    dimensions (after RoPE: its slowest-turning pairs) at position ``t`` is position ``t-1``'s, so a query matches
    the token before a key's position against its own -- a one-layer induction head. modded-nanogpt moves the half
    its RoPE leaves unrotated, in its long-window layers; every layer here attends over the whole context."""
    value_embeds: int = 0
    """Value embeddings (modded-nanogpt): this many extra token-embedding tables of width ``n_kv_heads·head_dim``;
    table ``j`` is added (times a learned per-layer scalar) to the attention values of layer ``j`` and of layer
    ``n_layers - value_embeds + j``. 0 = none; at most ``n_layers // 2``."""
    unet_skips: bool = False
    """U-net skip connections: layer ``n_layers-1-j`` (for ``j < n_layers // 2``) adds ``skip_weights[j]`` (learned,
    starts at 1) times the output of layer ``j`` to its input."""
    mlp: str = "swiglu"
    """The feed-forward: ``swiglu`` (Llama's) or ``relu2`` (``w2(relu(w1 x)²)``; its ``d_ff`` default is
    ``4·d_model``, which matches SwiGLU's 3·d_model·(8/3·d_model) parameters)."""
    logit_softcap: float | None = None
    """Soft-cap the logits at ``cap·tanh(logits/cap)`` (e.g. 15; in the loss too); ``null`` = off."""
    qk_norm: bool = False
    """RMS-normalise (no gain) every query and key head before RoPE."""
    qk_norm_scale: float | None = None
    """With ``qk_norm``: the attention scores are ``qk_norm_scale · q·k`` over the normalised heads (each of norm
    ``sqrt(head_dim)``, so a score is at most ``qk_norm_scale · head_dim``); ``null`` = ``1/sqrt(head_dim)``, which
    bounds every score by ``sqrt(head_dim)``. nanochat multiplies the normalised queries and keys by 1.2 each
    (``1.44/sqrt(head_dim)``); modded-nanogpt used 0.12 at head_dim 128."""
    embed_norm: bool = False
    """RMS-normalise (no gain) each token's embedding before the first block (and the smear), as nanochat does."""
    zero_init: bool = False
    """Initialise the attention output and feed-forward down projections (``output_proj``, ``ffn.w2``) to zero,
    so every block starts as the identity (init only: the trained model is the same architecture)."""
    head_init_std: float | None = None
    """The untied LM head's init std (truncated normal; 0 = zeros, e.g. 0.001 as nanochat); ``null`` = the
    default ``sqrt(2/(d_model+vocab))``. Init only."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context_length", "d_model", "n_layers", "n_heads"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"model.{name} must be a positive integer, got {v!r}")
        if self.context_length > MAX_CONTEXT_LENGTH:
            raise ValueError(f"model.context_length={self.context_length:,} is above lmforge's limit of "
                             f"{MAX_CONTEXT_LENGTH:,} tokens (the RoPE tables hold every position); use a shorter "
                             "context")
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.mlp not in MLPS:
            raise ValueError(f"model.mlp must be one of {', '.join(MLPS)}, got {self.mlp!r}")
        if self.d_ff is None:
            self.d_ff = 4 * self.d_model if self.mlp == "relu2" else default_d_ff(self.d_model)
        for name in ("n_kv_heads", "d_ff"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"model.{name} must be a positive integer (or null for the default), got {v!r}")
        if self.d_model % self.n_heads:
            near = _divisors_near(self.d_model, self.n_heads)
            raise ValueError(f"model.d_model={self.d_model} must be divisible by model.n_heads={self.n_heads}; "
                             f"pick n_heads among the divisors of d_model, e.g. {near}")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError(f"head dimension d_model/n_heads = {self.d_model // self.n_heads} must be even for RoPE; "
                             "change model.d_model or model.n_heads")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"model.n_heads={self.n_heads} must be divisible by model.n_kv_heads={self.n_kv_heads}; "
                             f"pick n_kv_heads among {_divisors(self.n_heads)}")
        if not (isinstance(self.rope_theta, (int, float)) and self.rope_theta > 0):
            raise ValueError(f"model.rope_theta must be a positive number, got {self.rope_theta!r}")
        if not (isinstance(self.norm_eps, (int, float)) and self.norm_eps > 0):
            raise ValueError(f"model.norm_eps must be a positive number, got {self.norm_eps!r}")
        self._check_recipe()
        for name in ("tie_embeddings", "fast", "smear", "smear_keys", "unet_skips", "qk_norm", "zero_init",
                     "embed_norm", "key_offset"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"model.{name} must be true or false, got {getattr(self, name)!r}")

    def _check_recipe(self) -> None:
        ve = self.value_embeds
        if isinstance(ve, bool) or not isinstance(ve, int) or not 0 <= ve <= self.n_layers // 2:
            raise ValueError(f"model.value_embeds must be an integer in [0, n_layers // 2 = {self.n_layers // 2}] "
                             f"(table j serves layer j and layer n_layers - value_embeds + j), got {ve!r}")
        if self.unet_skips is True and self.n_layers < 2:
            raise ValueError("model.unet_skips needs at least 2 layers (it joins layer j to layer n_layers-1-j)")
        for name in ("logit_softcap", "head_init_std"):
            v = getattr(self, name)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or (
                    v == 0 and name == "logit_softcap"):
                raise ValueError(f"model.{name} must be a positive number (or null for off), got {v!r}")
        s = self.qk_norm_scale
        if s is not None and (isinstance(s, bool) or not isinstance(s, (int, float)) or not 0 < s < math.inf):
            raise ValueError(f"model.qk_norm_scale must be a positive number (or null for 1/sqrt(head_dim)), got {s!r}")
        if s is not None and self.qk_norm is not True:
            raise ValueError("model.qk_norm_scale scales the scores of normalised queries and keys; set model.qk_norm: "
                             "true with it (or qk_norm_scale: null)")
        if self.head_init_std is not None and self.tie_embeddings is True:
            raise ValueError("model.head_init_std sets the untied LM head's init; with tie_embeddings the head is the "
                             "embedding matrix: drop one of them")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


def options_beyond(cfg: ModelConfig, implemented: Iterable[str]) -> list[tuple[str, Any, Any]]:
    """``(name, value, default)`` of each field of ``cfg`` (a :class:`ModelConfig`, or a dataclass extending it)
    that a computation implementing only the fields ``implemented`` would get wrong: every field neither in it nor
    in :data:`NUMERICS_ONLY` / :data:`INIT_ONLY` whose value is not its default (a field without a default always).

    An allow-list, for those that compute the model without its forward (the HF and GGUF export:
    ``lmforge.interop.hf.LLAMA_EXPRESSES``; the C++ decode step: ``lmforge.generate.packed.KERNEL_IMPLEMENTS``): a
    new field counts as changing the forward until one of them says it implements it.
    """
    out = []
    for f in dataclasses.fields(cfg):
        if f.name in implemented or f.name in NUMERICS_ONLY or f.name in INIT_ONLY:
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        value = getattr(cfg, f.name)
        if default is dataclasses.MISSING or value != default:
            out.append((f.name, value, default))
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _divisors_near(n: int, k: int) -> list[int]:
    return sorted(_divisors(n), key=lambda d: abs(d - k))[:3]


class TransformerLM(nn.Module):
    """Decoder-only language model; ``forward(idx) -> logits``.

    Build from a :class:`ModelConfig` (``TransformerLM(cfg)``) or with the CS336 signature
    ``TransformerLM(vocab_size, context_length, d_model, num_layers, num_heads, d_ff, rope_theta)``; the
    latter builds the reference path unless given ``fast=True`` (other ``ModelConfig`` fields go by keyword).
    """

    def __init__(self, vocab_size: int | ModelConfig, context_length: int | None = None, d_model: int | None = None,
                 num_layers: int | None = None, num_heads: int | None = None, d_ff: int | None = None,
                 rope_theta: float = 10000.0, *, device: Device = None,
                 dtype: DType = None, **config_kwargs) -> None:
        super().__init__()
        if isinstance(vocab_size, ModelConfig):
            cfg = vocab_size
        else:
            if None in (context_length, d_model, num_layers, num_heads):
                raise ValueError("TransformerLM needs a ModelConfig or vocab_size, context_length, d_model, "
                                 "num_layers and num_heads")
            config_kwargs.setdefault("fast", False)  # the CS336 signature builds the reference model
            cfg = ModelConfig(vocab_size=vocab_size, context_length=context_length, d_model=d_model,
                              n_layers=num_layers, n_heads=num_heads, d_ff=d_ff, rope_theta=rope_theta, **config_kwargs)
        self.cfg = cfg
        self.token_embeddings = Embedding(cfg.vocab_size, cfg.d_model, device=device, dtype=dtype)
        rope = RotaryPositionalEmbedding(cfg.rope_theta, cfg.head_dim, cfg.context_length, device=device)
        n, ve = cfg.n_layers, cfg.value_embeds
        self.layers = nn.ModuleList(
            TransformerBlock(cfg.d_model, cfg.n_heads, cfg.d_ff, cfg.context_length, num_kv_heads=cfg.n_kv_heads,
                             eps=cfg.norm_eps, rope=rope, fast=cfg.fast, device=device, dtype=dtype, mlp=cfg.mlp,
                             qk_norm=cfg.qk_norm, value_embed=i < ve or i >= n - ve, smear_keys=cfg.smear_keys,
                             qk_scale=cfg.qk_norm_scale, key_offset=cfg.key_offset)
            for i in range(n))
        # recipe options (None when off, so a default model's state dict is unchanged)
        self.smear = Smear(cfg.d_model, device=device, dtype=dtype, fast=cfg.fast) if cfg.smear else None
        self.value_embeddings = nn.ModuleList(Embedding(cfg.vocab_size, cfg.n_kv_heads * cfg.head_dim, device=device,
                                                        dtype=dtype) for _ in range(ve)) if ve else None
        self.skip_weights = (nn.Parameter(torch.ones(n // 2, device=device, dtype=dtype)) if cfg.unet_skips
                             else None)
        self.ln_final = Norm(cfg.d_model, cfg.norm_eps, fast=cfg.fast, device=device, dtype=dtype)
        self.lm_head = Linear(cfg.d_model, cfg.vocab_size, device=device, dtype=dtype)
        # torch.compile options for the fused loss's elementwise part off the CPU (training.compile sets them:
        # lmforge.train.distributed.compile_blocks); None runs it eagerly
        self.loss_compile: dict[str, Any] | None = None
        # what the logits (and so the loss) are divided by, after the soft-cap: RL's loss sets its sampling
        # temperature here (lmforge.rl.source.tempered_logits); 1 everywhere else
        self.logit_temperature = 1.0
        if cfg.tie_embeddings:
            self.lm_head.weight = self.token_embeddings.weight
        self.init_weights()

    @classmethod
    def from_config(cls, cfg: ModelConfig, device: Device = None, dtype: DType = None) -> TransformerLM:
        return cls(cfg, device=device, dtype=dtype)

    @classmethod
    def for_loading(cls, cfg: ModelConfig, device: Device = None, dtype: DType = None) -> TransformerLM:
        """The model with *uninitialised* parameters, for a checkpoint to fill (``load_state_dict(strict=True)``
        overwrites every one): built on the meta device, so no random init is drawn -- most of the time a
        loaded model used to take. The RoPE tables are computed and tied embeddings stay tied."""
        model = cls(cfg, device="meta", dtype=dtype)
        model.to_empty(device=torch.device("cpu") if device is None else device)
        for module in model.modules():
            if isinstance(module, RotaryPositionalEmbedding):
                module.cos, module.sin = module._tables(module.cos.device)
        if model.cfg.tie_embeddings:  # to_empty made two tensors of the one shared matrix
            model.lm_head.weight = model.token_embeddings.weight
        return model

    def init_weights(self) -> None:
        """Initialise every parameter (called once by the constructor; call again to re-draw):

        * ``token_embeddings.weight``: truncated normal, std 1, cut at ±3.
        * every projection (``q/k/v/output_proj``, ``ffn.w1/w2/w3``, ``lm_head``): truncated normal,
          std ``sqrt(2 / (fan_in + fan_out))``, cut at ±3σ.
        * every RMSNorm weight (``ln1``, ``ln2``, ``ln_final``): ones.
        * tied embeddings: the shared matrix gets the ``lm_head`` init (std ``sqrt(2 / (d_model + vocab))``),
          since std-1 logits would saturate the softmax at the start of training.
        * ``model.zero_init``: ``output_proj`` and ``ffn.w2`` of every block: zeros.
        * ``model.head_init_std``: ``lm_head``: truncated normal with that std (zeros for 0).
        * value embeddings (``value_embeddings.{j}``): as the token embeddings; their per-layer scales
          (``layers.{i}.attn.ve_lambda``): 0.5; ``smear.gate``, ``smear.lam``: zeros; ``skip_weights``: ones;
          the key-smear logits (``layers.{i}.attn.key_smear``): evenly from -2 to 2 over the key heads.
        """
        for module in self.modules():
            if module is not self and hasattr(module, "reset_parameters"):
                module.reset_parameters()
        if self.cfg.tie_embeddings:
            self.lm_head.reset_parameters()
        with torch.no_grad():
            if self.skip_weights is not None:
                self.skip_weights.fill_(1.0)
            if self.cfg.zero_init:
                for layer in self.layers:
                    layer.attn.output_proj.weight.zero_()
                    layer.ffn.w2.weight.zero_()
            if self.cfg.head_init_std == 0:
                self.lm_head.weight.zero_()
            elif self.cfg.head_init_std is not None:
                _trunc_normal_(self.lm_head.weight, self.cfg.head_init_std)

    def resize_vocab(self, vocab_size: int) -> TransformerLM:
        """Grow the token embeddings and the LM head to ``vocab_size`` rows (for special tokens appended to
        the tokenizer, e.g. the chat tokens); call it before building the optimizer, since it makes new tensors.

        The existing rows are kept, so the logits of the old ids do not change. Each new embedding row is the
        mean of the old embedding rows (each value-embedding table's likewise), and each new head row the mean of
        the old head rows: a new token's logit is then the mean of the old logits, below the top ones, so the
        distribution over old tokens moves little (Hewitt 2021, "Initializing new word embeddings"); a zero head row would give logit 0,
        which can beat every old token. Tied embeddings stay one matrix (the mean row serves both).
        """
        old = self.cfg.vocab_size
        if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < old:
            raise ValueError(f"resize_vocab can only grow the vocabulary ({old} ids) and needs an integer, got "
                             f"{vocab_size!r}; shrinking would drop trained rows")
        if vocab_size == old:
            return self

        def grown(weight: Tensor) -> nn.Parameter:
            with torch.no_grad():
                rows = grow_rows(weight, vocab_size)  # (vocab_size, d_model)
            return nn.Parameter(rows, requires_grad=weight.requires_grad)

        emb = grown(self.token_embeddings.weight)
        self.token_embeddings.weight, self.token_embeddings.num_embeddings = emb, vocab_size
        self.lm_head.weight = emb if self.cfg.tie_embeddings else grown(self.lm_head.weight)
        self.lm_head.out_features = vocab_size
        for table in self.value_embeddings or ():  # value embeddings: a token's table rows, grown the same way
            table.weight, table.num_embeddings = grown(table.weight), vocab_size
        self.cfg = dataclasses.replace(self.cfg, vocab_size=vocab_size)
        return self

    def set_fast(self, fast: bool) -> TransformerLM:
        """Switch every block between the fast and the reference path (same weights)."""
        self.cfg = dataclasses.replace(self.cfg, fast=fast)  # a copy: the caller's config is not touched
        for m in self.modules():
            if hasattr(m, "fast"):
                m.fast = fast
        return self

    def hidden(self, idx: Tensor, token_positions: Tensor | None = None, cache: KVCache | None = None) -> Tensor:
        """``idx (B, T)`` int64 -> the final-normed hidden states ``(B, T, d_model)`` (what :meth:`logits` reads).

        With ``cache`` the new tokens go after each row's cached ones (positions = cache columns), attend to
        them, and are appended to the cache.
        """
        if idx.dim() != 2 or idx.dtype.is_floating_point or idx.dtype.is_complex or idx.dtype == torch.bool:
            raise ValueError(f"idx must be integer token ids of shape (batch, seq), got {idx.dtype} "
                             f"{tuple(idx.shape)}; add a batch dimension with idx[None] if needed")
        # On the CPU only: on a GPU reading the ids back would stall every forward (every decoded token) on a
        # host sync; there the embedding kernel's bounds check (a device-side assert) stops a bad id, and lmforge's
        # callers check ids before they reach the device (shards' recorded max id, prompts through token_ids).
        if idx.device.type == "cpu" and not torch.compiler.is_compiling() and idx.numel():
            lo, hi = (int(v) for v in torch.aminmax(idx))  # one pass; a negative id would index from the end
            if lo < 0 or hi >= self.cfg.vocab_size:
                raise ValueError(f"token id {lo if lo < 0 else hi} is out of range [0, {self.cfg.vocab_size}) for "
                                 "this model; the ids come from another tokenizer or the model's vocab_size is too small")
        T = idx.shape[1]
        if cache is not None:
            if token_positions is not None:
                raise ValueError("give token_positions or a cache, not both: with a cache, positions are cache columns")
            token_positions = cache.begin(T)  # checks the context
        elif token_positions is None:
            check_context(T, self.cfg.context_length)
        x = self._token_embedding(idx)
        if self.smear is not None:
            x = self.smear(x, self._previous_embedding(x, cache))
        if cache is not None and self.smear is not None:
            cache.write_ids(idx)
        ves = [self._embed(idx, table) for table in self.value_embeddings] if self.value_embeddings else []
        blocks = self._blocks if self.cfg.fast else self._blocks_reference
        x = blocks(x, ves, token_positions, cache)
        if cache is not None:
            cache.advance(T)
        return self.ln_final(x)  # (B, T, d_model)

    def _blocks(self, x: Tensor, ves: list[Tensor], token_positions: Tensor | None, cache: KVCache | None) -> Tensor:
        """The blocks over the embeddings ``x (B, T, d_model)`` with the value embeddings ``ves`` and U-net skips."""
        n, half = len(self.layers), len(self.layers) // 2
        skips: list[Tensor] = []
        for i, layer in enumerate(self.layers):
            if self.skip_weights is not None and i >= n - half:  # U-net: layer n-1-j reads layer j's output
                x = x + self.skip_weights[n - 1 - i] * skips[n - 1 - i]
            # table j serves layer j and layer n - len(ves) + j (None: the layer has none)
            ve = ves[i] if i < len(ves) else ves[i - n + len(ves)] if i >= n - len(ves) else None
            # the layer index only with a cache: an int argument that differs per block would make torch 2.11
            # compile a second graph for the blocks (2.13 shares one; tests/train/test_distributed.py)
            x = layer(x, token_positions, ve=ve) if cache is None else layer(x, token_positions, cache, i, ve)
            if self.skip_weights is not None and i < half:
                skips.append(x)
        return x

    def _blocks_reference(self, x: Tensor, ves: list[Tensor], token_positions: Tensor | None,
                          cache: KVCache | None) -> Tensor:
        """:meth:`_blocks` (the reference path's) with the routing written as the :class:`ModelConfig` docstrings
        state it: value-embedding table ``j`` feeds layers ``j`` and ``n_layers - value_embeds + j``; for
        ``j < n_layers // 2``, layer ``n_layers-1-j`` adds ``skip_weights[j]`` times layer ``j``'s output."""
        n, k = len(self.layers), len(ves)
        table_of = {layer: j for j in range(k) for layer in (j, n - k + j)}
        skip_from = {n - 1 - j: j for j in range(n // 2)} if self.skip_weights is not None else {}
        outputs: list[Tensor] = []
        for i, layer in enumerate(self.layers):
            if i in skip_from:
                j = skip_from[i]
                x = x + self.skip_weights[j] * outputs[j]
            ve = ves[table_of[i]] if i in table_of else None
            x = layer(x, token_positions, ve=ve) if cache is None else layer(x, token_positions, cache, i, ve)
            outputs.append(x)
        return x

    def _token_embedding(self, idx: Tensor) -> Tensor:
        """The token embeddings of ``idx`` ``(..., d_model)``; under ``model.embed_norm`` RMS-normalised without a gain
        (the fast path by ``F.rms_norm``, the reference by the formula, :func:`~lmforge.model.recipe.rms_norm_heads`)."""
        x = self._embed(idx, self.token_embeddings)
        if not self.cfg.embed_norm:
            return x
        eps = self.cfg.norm_eps
        return F.rms_norm(x, (x.shape[-1],), eps=eps) if self.cfg.fast else rms_norm_heads(x, eps)

    def _embed(self, idx: Tensor, table: Embedding) -> Tensor:
        # The fast path looks rows up with F.embedding: its backward sums each row's gradients in index order,
        # where indexing's (index_put_ with accumulate) adds them with atomics from parallel threads, so its sums
        # depended on thread timing and training was bit for bit only at one thread.
        return F.embedding(idx, table.weight) if self.cfg.fast else table(idx)  # (..., width)

    def _previous_embedding(self, x: Tensor, cache: KVCache | None) -> Tensor:
        """The embedding of the token before each row's first new token ``(B, 1, d_model)``: zeros without a cache
        (a sequence's first token has none), else that of the row's last cached token (zeros for an empty row)."""
        if cache is None:
            return x.new_zeros(x.shape[0], 1, x.shape[2])
        ids, held = cache.last_ids()  # (B,), (B,)
        prev = self._token_embedding(ids[:, None])  # (B, 1, d_model)
        return prev * held[:, None, None].to(prev.dtype)

    def logits(self, hidden: Tensor) -> Tensor:
        """The logits ``(..., V)`` of final-normed hidden states ``(..., d_model)`` (:meth:`hidden`): the LM head,
        the soft-cap ``cap·tanh(l/cap)`` (``model.logit_softcap``), divided by ``logit_temperature`` (computed with
        the temperature in front of the head: :meth:`_head_input`).

        The one place hidden states become logits: the forward, the inference engine (prefill, steps, static
        steps, verifying drafts), the log-likelihood scorer and RL call it; the fused loss computes the same
        logits through :meth:`_head_input`."""
        h, cap = self._head_input(hidden)
        return (softcap if self.cfg.fast else softcap_reference)(self.lm_head(h), cap)  # (..., V)

    def _head_input(self, hidden: Tensor) -> tuple[Tensor, float | None]:
        """``(h, cap)`` such that the logits are ``softcap(lm_head(h), cap)``: the cap is ``model.logit_softcap``,
        and a temperature ``t`` moves in front of the head (linear, no bias), since
        ``softcap(z, cap) / t = softcap(z / t, cap / t)``."""
        t, cap = self.logit_temperature, self.cfg.logit_softcap
        if t == 1:
            return hidden, cap
        return hidden / t, None if cap is None else cap / t

    def forward(self, idx: Tensor, token_positions: Tensor | None = None, cache: KVCache | None = None, *,
                targets: Tensor | None = None, ignore_index: int | None = None, reduction: str = "mean",
                weights: Tensor | None = None) -> Tensor:
        """``idx (B, T)`` int64 -> logits ``(B, T, vocab_size)``; see :meth:`hidden` for ``cache``.

        With ``targets (B, T)`` the cross-entropy loss (``reduction`` ``"mean"``/``"sum"``/``"none"``) is
        returned instead of the logits; the fast path then never builds the full logits tensor. ``weights (B, T)``
        multiply each target's loss (a policy gradient's per-token advantages).
        """
        x = self.hidden(idx, token_positions, cache)
        if targets is None:
            return self.logits(x)  # (B, T, V)
        if self.cfg.fast and type(self.lm_head) is Linear:  # a LoRA-wrapped head goes through its module
            # (inside a whole-model compile the chunk is traced with the rest, and torch 2.11 cannot pass a compiled
            # function through an autograd.Function there)
            chunk_fn = (None if self.loss_compile is None or torch.compiler.is_compiling() else
                        compiled_softmax_grad(**self.loss_compile))
            h, cap = self._head_input(x)
            return linear_cross_entropy(h, self.lm_head.weight, targets, ignore_index, reduction, weights=weights,
                                        chunk_fn=chunk_fn, softcap=cap)
        return cross_entropy(self.logits(x), targets, ignore_index, reduction, weights)


# --------------------------------------------------------------------------------------------------
# Counting
# --------------------------------------------------------------------------------------------------
def num_params(model: nn.Module, exclude_embeddings: bool = False) -> int:
    """Number of distinct parameters; ``exclude_embeddings`` drops the input embedding table unless it
    is tied to the LM head (then it is also a matmul weight and stays counted)."""
    seen: set[int] = set()
    total = 0
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if exclude_embeddings and name.endswith("token_embeddings.weight"):
            lm_head = getattr(model, "lm_head", None)
            if lm_head is None or lm_head.weight is not p:
                continue
        total += p.numel()
    return total


def matmul_params_per_token(cfg: ModelConfig) -> int:
    """Weights each token multiplies through in one forward pass (all projections + the LM head)."""
    D, H, KV = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    ffn_mats = 2 if cfg.mlp == "relu2" else 3
    per_layer = cfg.d_model * (H * D + 2 * KV * D) + H * D * cfg.d_model + ffn_mats * cfg.d_model * cfg.d_ff
    return cfg.n_layers * per_layer + cfg.d_model * cfg.vocab_size


def flops_per_token(cfg: ModelConfig, context_length: int | None = None) -> int:
    """Training FLOPs per token (forward + backward): ``6·N + 12·n_layers·d_model·T``.

    ``N`` = :func:`matmul_params_per_token`; the second term is attention's ``QKᵀ`` and ``AV`` at
    sequence length ``T`` (default: ``cfg.context_length``), counted without causal savings as in the
    PaLM paper's MFU definition, so numbers compare with other projects.
    """
    T = cfg.context_length if context_length is None else context_length
    return 6 * matmul_params_per_token(cfg) + 12 * cfg.n_layers * cfg.d_model * T
