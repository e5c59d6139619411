"""A Llama-style decoder-only Transformer LM built from the primitives in :mod:`lmforge.model.layers`.

``TransformerLM``: token embeddings -> ``n_layers`` pre-norm blocks (causal self-attention with RoPE and
optional grouped-query attention, SwiGLU feed-forward) -> final RMSNorm -> LM head (logits).

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
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lmforge.checkpoint import grow_rows
from lmforge.model.layers import (Device, DType, Embedding, Linear, RMSNorm, RotaryPositionalEmbedding, SwiGLU, default_d_ff,
                            scaled_dot_product_attention, silu, softmax)
from lmforge.model.cache import KVCache, check_context
from lmforge.model.losses import compiled_softmax_grad, cross_entropy, linear_cross_entropy

__all__ = ["ModelConfig", "MAX_CONTEXT_LENGTH", "TransformerLM", "TransformerBlock", "CausalSelfAttention", "KVCache",
           "Linear", "Embedding", "RMSNorm", "SwiGLU", "RotaryPositionalEmbedding", "softmax", "silu",
           "scaled_dot_product_attention", "cross_entropy", "linear_cross_entropy", "num_params",
           "flops_per_token", "matmul_params_per_token", "cached_projections"]


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
        if self.d_ff is None:
            self.d_ff = default_d_ff(self.d_model)
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
        for name in ("tie_embeddings", "fast"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"model.{name} must be true or false, got {getattr(self, name)!r}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _divisors_near(n: int, k: int) -> list[int]:
    return sorted(_divisors(n), key=lambda d: abs(d - k))[:3]


# --------------------------------------------------------------------------------------------------
# Fast-path helpers
# --------------------------------------------------------------------------------------------------
class _Projections(torch.autograd.Function):
    """``x @ W_i.T`` for several weights reading the same ``x`` (Q, K, V; or W1, W3).

    Backward accumulates ``dx = Σ g_i W_i`` inside the GEMMs (``addmm_`` with beta 1), so neither the
    ``torch.cat`` of the output gradients that a fused-weight matmul needs nor autograd's sum of separate
    ``dx`` tensors is ever materialised. Under autocast the matmuls run in the autocast dtype, as
    ``x @ W.T`` would.
    """

    @staticmethod
    def forward(ctx, x: Tensor, *weights: Tensor) -> tuple[Tensor, ...]:
        dev = x.device.type
        cdtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        with torch.autocast(dev, enabled=False):
            xc = x.to(cdtype)
            outs = tuple(xc @ w.to(cdtype).T for w in weights)  # (..., out_i)
        ctx.save_for_backward(xc, *weights)
        ctx.x_dtype, ctx.cdtype = x.dtype, cdtype
        return outs

    @staticmethod
    def backward(ctx, *grads: Tensor):
        xc, *weights = ctx.saved_tensors
        x2 = xc.reshape(-1, xc.shape[-1])  # (N, d_in)
        grad_x = None
        grad_ws = []
        with torch.autocast(xc.device.type, enabled=False):
            for i, (g, w) in enumerate(zip(grads, weights)):
                if g is None:
                    grad_ws.append(None)
                    continue
                g2 = g.reshape(-1, g.shape[-1]).to(ctx.cdtype)  # (N, out_i)
                wc = w.to(ctx.cdtype)
                if grad_x is None:
                    grad_x = g2 @ wc  # (N, d_in)
                else:
                    grad_x.addmm_(g2, wc)
                # a frozen weight (LoRA's base) gets no gradient: skip the (out_i, d_in) GEMM
                grad_ws.append((g2.T @ x2).to(w.dtype) if ctx.needs_input_grad[1 + i] else None)
        if grad_x is not None:
            grad_x = grad_x.reshape(xc.shape).to(ctx.x_dtype)
        return (grad_x, *grad_ws)


def _project(module: nn.Module, x: Tensor, weights: list[Tensor]) -> tuple[Tensor, ...]:
    """``tuple(x @ w.T for w in weights)``, the fastest way for training or for decoding.

    Training: :class:`_Projections` (lean backward). Without autograd (decoding) one matmul over the
    concatenated weights, whose concatenation is cached on ``module`` until a weight changes (tracked
    through data pointers and in-place version counters) or autograd is needed again; a compiled decode step
    multiplies by each weight (the compiler schedules them).
    """
    if torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights)):
        if not torch.compiler.is_compiling():  # torch 2.11's dynamo breaks the graph on a __dict__.pop
            module.__dict__.pop("_fused_cache", None)
        return _Projections.apply(x, *weights)
    if torch.compiler.is_compiling():  # a traced decode step: no data pointers there; one product per weight
        return tuple(x @ w.T for w in weights)
    key = tuple((w.data_ptr(), w._version, w.dtype, w.device) for w in weights)
    hit = module.__dict__.get("_fused_cache")
    if hit is None or hit[0] != key:
        hit = (key, torch.cat(weights, dim=0))
        module.__dict__["_fused_cache"] = hit
    return (x @ hit[1].T).split([w.shape[0] for w in weights], dim=-1)


def cached_projections(model: nn.Module) -> list[Tensor]:
    """The concatenated weights :func:`_project` caches on ``model``'s modules for decoding. A CUDA graph that
    reads them holds these references, so a later concatenation cannot free the memory the graph replays on."""
    return [hit[1] for m in model.modules() if (hit := m.__dict__.get("_fused_cache")) is not None]


def _project_modules(owner: nn.Module, x: Tensor, modules: tuple[nn.Module, ...]) -> tuple[Tensor, ...]:
    """``tuple(m(x) for m in modules)`` through :func:`_project` on their weights; a projection that is not a
    plain :class:`Linear` (a LoRA-wrapped one, :mod:`lmforge.model.lora`) adds its ``adapter(x)``."""
    outs = _project(owner, x, [m.weight for m in modules])
    return tuple(o if type(m) is Linear else o + m.adapter(x) for o, m in zip(outs, modules))


def _rope_fast(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE on adjacent pairs as a complex multiply: ``(x0 + i·x1) · (cos + i·sin)``.

    ``x (B, T, H, D)``; ``cos, sin`` broadcastable to ``(B, T, 1, D/2)``.
    """
    if torch.compiler.is_compiling():  # inductor cannot generate code for complex ops; it fuses this form
        x0, x1 = x[..., 0::2].float(), x[..., 1::2].float()  # (B, T, H, D/2)
        return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2).to(x.dtype)
    xc = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))  # (B, T, H, D/2) complex
    return torch.view_as_real(xc * torch.complex(cos, sin)).flatten(-2).to(x.dtype)  # (B, T, H, D)


class _RMSNormFn(torch.autograd.Function):
    """RMSNorm with a hand-written backward: about half the passes over memory of autograd's."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        x32 = x.float()
        d = x.shape[-1]
        inv = torch.rsqrt(torch.linalg.vector_norm(x32, dim=-1, keepdim=True).square_().div_(d).add_(eps))  # (..., 1)
        xn = x32 * inv  # (..., d)
        ctx.save_for_backward(xn, inv, weight)
        ctx.x_dtype = x.dtype
        y = xn * weight
        # No ``.to`` that returns ``y`` itself: torch 2.11's dynamo then routes the gradient wrongly when compiled
        # (every gradient before a norm came out wrong on an H100 and on the CPU: tests/model/test_compile.py fails
        # there without this; the aliased-output bug class of pytorch/pytorch#180642, fixed for 2.12).
        return y if y.dtype == x.dtype else y.to(x.dtype)

    @staticmethod
    def backward(ctx, g: Tensor):
        xn, inv, weight = ctx.saved_tensors
        g = g.float()
        grad_w = (g * xn).flatten(0, -2).sum(0).to(weight.dtype)  # (d,)
        gxn = g * weight  # (..., d)
        # d/dx of x·inv: inv · (gxn - xn · mean(gxn · xn))
        dot = torch.linalg.vecdot(gxn, xn, dim=-1).unsqueeze(-1).div_(xn.shape[-1])  # (..., 1)
        grad_x = gxn.addcmul_(xn, dot, value=-1.0).mul_(inv)
        return grad_x.to(ctx.x_dtype), grad_w, None


class Norm(RMSNorm):
    """:class:`RMSNorm` with a fast path (:class:`_RMSNormFn`); same parameter, same numbers."""

    def __init__(self, d_model: int, eps: float = 1e-5, fast: bool = False, device: Device = None,
                 dtype: DType = None) -> None:
        super().__init__(d_model, eps, device=device, dtype=dtype)
        self.fast = fast

    def forward(self, x: Tensor) -> Tensor:
        return _RMSNormFn.apply(x, self.weight, self.eps) if self.fast else super().forward(x)


# --------------------------------------------------------------------------------------------------
# Blocks
# --------------------------------------------------------------------------------------------------
class CausalSelfAttention(nn.Module):
    """Causal multi-head self-attention with RoPE on queries and keys and optional grouped-query attention.

    ``num_kv_heads < num_heads`` shares each key/value head among ``num_heads / num_kv_heads`` query heads
    (query head ``h`` reads kv head ``h // group``). Without ``theta`` no RoPE is applied.
    """

    def __init__(self, d_model: int, num_heads: int, max_seq_len: int | None = None, theta: float | None = None,
                 num_kv_heads: int | None = None, rope: RotaryPositionalEmbedding | None = None, fast: bool = False,
                 device: Device = None, dtype: DType = None) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if d_model % num_heads or num_heads % num_kv_heads:
            raise ValueError(f"need d_model ({d_model}) divisible by num_heads ({num_heads}) and num_heads "
                             f"divisible by num_kv_heads ({num_kv_heads})")
        self.d_model, self.num_heads, self.num_kv_heads = d_model, num_heads, num_kv_heads
        self.head_dim = d_model // num_heads
        self.fast = fast
        self.q_proj = Linear(d_model, num_heads * self.head_dim, device=device, dtype=dtype)
        self.k_proj = Linear(d_model, num_kv_heads * self.head_dim, device=device, dtype=dtype)
        self.v_proj = Linear(d_model, num_kv_heads * self.head_dim, device=device, dtype=dtype)
        self.output_proj = Linear(num_heads * self.head_dim, d_model, device=device, dtype=dtype)
        if rope is None and theta is not None:
            if max_seq_len is None:
                raise ValueError("RoPE needs max_seq_len together with theta")
            rope = RotaryPositionalEmbedding(theta, self.head_dim, max_seq_len, device=device)
        self.rope = rope

    def forward(self, x: Tensor, token_positions: Tensor | None = None, cache: KVCache | None = None,
                layer_idx: int = 0) -> Tensor:
        """``x (B, T, d_model) -> (B, T, d_model)``; positions default to ``0 .. T-1``.

        With ``cache`` (planned by :meth:`KVCache.begin`, whose positions the model passes as
        ``token_positions``) the new keys/values are stored in layer ``layer_idx`` and each row attends over
        its cached prefix.
        """
        if self.fast:
            return self._forward_fast(x, token_positions, cache, layer_idx)
        return self._forward_reference(x, token_positions, cache, layer_idx)

    def _forward_reference(self, x: Tensor, token_positions: Tensor | None, cache: KVCache | None,
                           layer_idx: int) -> Tensor:
        *lead, T, _ = x.shape
        H, KV, D = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_proj(x).unflatten(-1, (H, D)).transpose(-3, -2)  # (..., H, T, D)
        k = self.k_proj(x).unflatten(-1, (KV, D)).transpose(-3, -2)  # (..., KV, T, D)
        v = self.v_proj(x).unflatten(-1, (KV, D)).transpose(-3, -2)  # (..., KV, T, D)
        if self.rope is not None:
            pos = token_positions
            pos = pos.unsqueeze(-2) if pos is not None and pos.dim() >= 2 else pos  # (B, 1, T): broadcast over heads
            q, k = self.rope(q, pos), self.rope(k, pos)
        if cache is not None:
            k, v = cache.write(layer_idx, k, v)  # (B, KV, S, D) with S = cached + T
            mask = cache.mask(T)  # None, (T, S) or (B, 1, T, S)
            if mask is None:  # plain causal over the last T of S columns (S == T, or one query that sees all)
                S = k.shape[-2]
                mask = torch.ones(T, S, dtype=torch.bool, device=x.device).tril(S - T)
        else:
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()  # (T, T)
        if KV != H:
            k = k.repeat_interleave(H // KV, dim=-3)  # (..., H, S, D)
            v = v.repeat_interleave(H // KV, dim=-3)
        y = scaled_dot_product_attention(q, k, v, mask)  # (..., H, T, D)
        return self.output_proj(y.transpose(-3, -2).flatten(-2))  # (..., T, H*D) -> (..., T, d_model)

    def _forward_fast(self, x: Tensor, token_positions: Tensor | None, cache: KVCache | None,
                      layer_idx: int) -> Tensor:
        B, T, _ = x.shape
        H, KV, D = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = _project_modules(self, x, (self.q_proj, self.k_proj, self.v_proj))  # (B, T, h·D)
        q, k, v = q.unflatten(-1, (H, D)), k.unflatten(-1, (KV, D)), v.unflatten(-1, (KV, D))  # (B, T, h, D)
        if self.rope is not None:
            if token_positions is None:
                check_context(T, self.rope.max_seq_len)
                cos, sin = self.rope.cos[:T, None, :], self.rope.sin[:T, None, :]  # (T, 1, D/2)
            else:
                if cache is None:  # the cache checked its columns already
                    self.rope.check_positions(token_positions)
                cos = self.rope.cos[token_positions].unsqueeze(-2)  # (B|1, T, 1, D/2)
                sin = self.rope.sin[token_positions].unsqueeze(-2)
            q, k = _rope_fast(q, cos, sin), _rope_fast(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, h, T, D)
        if cache is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=KV != H)
        else:
            k, v = cache.write(layer_idx, k, v)  # (B, KV, S, D)
            mask = cache.mask(T)
            if mask is None:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1, enable_gqa=KV != H)
            else:
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=KV != H)
        y = y.transpose(1, 2).reshape(B, T, H * D)  # (B, T, H*D)
        return self.output_proj(y)  # (B, T, d_model)


class FeedForward(SwiGLU):
    """:class:`SwiGLU` with a fast path that projects through ``w1`` and ``w3`` together (:func:`_project`)."""

    def __init__(self, d_model: int, d_ff: int | None = None, fast: bool = False, device: Device = None,
                 dtype: DType = None) -> None:
        super().__init__(d_model, d_ff, device=device, dtype=dtype)
        self.fast = fast

    def forward(self, x: Tensor) -> Tensor:
        if not self.fast:
            return super().forward(x)
        a, b = _project_modules(self, x, (self.w1, self.w3))  # (B, T, d_ff) each
        return self.w2(F.silu(a) * b)  # (B, T, d_model)


class TransformerBlock(nn.Module):
    """Pre-norm block: ``x + attn(ln1(x))`` then ``x + ffn(ln2(x))``."""

    def __init__(self, d_model: int, num_heads: int, d_ff: int | None = None, max_seq_len: int | None = None,
                 theta: float | None = None, num_kv_heads: int | None = None, eps: float = 1e-5,
                 rope: RotaryPositionalEmbedding | None = None, fast: bool = False, device: Device = None,
                 dtype: DType = None) -> None:
        super().__init__()
        self.attn = CausalSelfAttention(d_model, num_heads, max_seq_len, theta, num_kv_heads, rope=rope, fast=fast,
                                        device=device, dtype=dtype)
        self.ln1 = Norm(d_model, eps, fast=fast, device=device, dtype=dtype)
        self.ffn = FeedForward(d_model, d_ff, fast=fast, device=device, dtype=dtype)
        self.ln2 = Norm(d_model, eps, fast=fast, device=device, dtype=dtype)

    def forward(self, x: Tensor, token_positions: Tensor | None = None, cache: KVCache | None = None,
                layer_idx: int = 0) -> Tensor:
        x = x + self.attn(self.ln1(x), token_positions, cache, layer_idx)
        return x + self.ffn(self.ln2(x))


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
        self.layers = nn.ModuleList(
            TransformerBlock(cfg.d_model, cfg.n_heads, cfg.d_ff, cfg.context_length, num_kv_heads=cfg.n_kv_heads,
                             eps=cfg.norm_eps, rope=rope, fast=cfg.fast, device=device, dtype=dtype)
            for _ in range(cfg.n_layers))
        self.ln_final = Norm(cfg.d_model, cfg.norm_eps, fast=cfg.fast, device=device, dtype=dtype)
        self.lm_head = Linear(cfg.d_model, cfg.vocab_size, device=device, dtype=dtype)
        # torch.compile options for the fused loss's elementwise part off the CPU (training.compile sets them:
        # lmforge.train.distributed.compile_blocks); None runs it eagerly
        self.loss_compile: dict[str, Any] | None = None
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
        """
        for module in self.modules():
            if module is not self and hasattr(module, "reset_parameters"):
                module.reset_parameters()
        if self.cfg.tie_embeddings:
            self.lm_head.reset_parameters()

    def resize_vocab(self, vocab_size: int) -> TransformerLM:
        """Grow the token embeddings and the LM head to ``vocab_size`` rows (for special tokens appended to
        the tokenizer, e.g. the chat tokens); call it before building the optimizer, since it makes new tensors.

        The existing rows are kept, so the logits of the old ids do not change. Each new embedding row is the
        mean of the old embedding rows, and each new head row the mean of the old head rows: a new token's
        logit is then the mean of the old logits, below the top ones, so the distribution over old tokens
        moves little (Hewitt 2021, "Initializing new word embeddings"); a zero head row would give logit 0,
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
        """``idx (B, T)`` int64 -> the final-normed hidden states ``(B, T, d_model)`` (what the LM head reads).

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
        # (B, T, d_model). The fast path looks rows up with F.embedding: its backward sums each row's gradients
        # in index order, where indexing's (index_put_ with accumulate) adds them with atomics from parallel
        # threads, so its sums depended on thread timing and training was bit for bit only at one thread.
        x = F.embedding(idx, self.token_embeddings.weight) if self.cfg.fast else self.token_embeddings(idx)
        for i, layer in enumerate(self.layers):
            # the layer index only with a cache: an int argument that differs per block would make torch 2.11
            # compile a second graph for the blocks (2.13 shares one; tests/train/test_distributed.py)
            x = layer(x, token_positions) if cache is None else layer(x, token_positions, cache, i)
        if cache is not None:
            cache.advance(T)
        return self.ln_final(x)  # (B, T, d_model)

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
            return self.lm_head(x)  # (B, T, V)
        if self.cfg.fast and type(self.lm_head) is Linear:  # a LoRA-wrapped head goes through its module
            # (inside a whole-model compile the chunk is traced with the rest, and torch 2.11 cannot pass a compiled
            # function through an autograd.Function there)
            chunk_fn = (None if self.loss_compile is None or torch.compiler.is_compiling() else
                        compiled_softmax_grad(**self.loss_compile))
            return linear_cross_entropy(x, self.lm_head.weight, targets, ignore_index, reduction, weights=weights,
                                        chunk_fn=chunk_fn)
        return cross_entropy(self.lm_head(x), targets, ignore_index, reduction, weights)


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
    per_layer = cfg.d_model * (H * D + 2 * KV * D) + H * D * cfg.d_model + 3 * cfg.d_model * cfg.d_ff
    return cfg.n_layers * per_layer + cfg.d_model * cfg.vocab_size


def flops_per_token(cfg: ModelConfig, context_length: int | None = None) -> int:
    """Training FLOPs per token (forward + backward): ``6·N + 12·n_layers·d_model·T``.

    ``N`` = :func:`matmul_params_per_token`; the second term is attention's ``QKᵀ`` and ``AV`` at
    sequence length ``T`` (default: ``cfg.context_length``), counted without causal savings as in the
    PaLM paper's MFU definition, so numbers compare with other projects.
    """
    T = cfg.context_length if context_length is None else context_length
    return 6 * matmul_params_per_token(cfg) + 12 * cfg.n_layers * cfg.d_model * T
