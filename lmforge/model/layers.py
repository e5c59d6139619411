"""Transformer building blocks written from tensor primitives (the CS336 assignment-1 components).

Every block here is an ``nn.Module`` holding ``nn.Parameter``s and computing with plain tensor ops
(matmul, indexing, elementwise math): no ``nn.Linear``, ``nn.Embedding``, ``nn.LayerNorm`` or
``torch.nn.functional`` layers. This file is the *reference*: small, readable, and the spec that the
fast path in :mod:`lmforge.model` is tested against.

Numerics: RMSNorm, softmax and cross-entropy compute in float32 and cast back, so the blocks also work
under ``torch.autocast(..., dtype=torch.bfloat16)``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

Device = torch.device | str | None
"""Where to allocate parameters (``None``: PyTorch's default device)."""
DType = torch.dtype | None
"""Parameter dtype (``None``: PyTorch's default dtype)."""


def _trunc_normal_(w: Tensor, std: float) -> Tensor:
    """Fill ``w`` in place from N(0, std²) truncated at ±3σ."""
    return nn.init.trunc_normal_(w, mean=0.0, std=std, a=-3.0 * std, b=3.0 * std)


class Linear(nn.Module):
    """``y = x Wᵀ`` without bias; ``weight`` has shape ``(out_features, in_features)``.

    Init: truncated normal, std ``sqrt(2 / (in_features + out_features))``, cut at ±3σ.
    """

    def __init__(self, in_features: int, out_features: int, device: Device = None, dtype: DType = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.reset_parameters()

    @property
    def init_std(self) -> float:
        return math.sqrt(2.0 / (self.in_features + self.out_features))

    def reset_parameters(self) -> None:
        with torch.no_grad():
            _trunc_normal_(self.weight, self.init_std)

    def forward(self, x: Tensor) -> Tensor:
        return x @ self.weight.T  # (..., in) @ (in, out) -> (..., out)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias=False"


class Embedding(nn.Module):
    """Lookup table: row ``i`` of ``weight`` ``(num_embeddings, embedding_dim)`` is the vector of token ``i``.

    Init: truncated normal, std 1, cut at ±3.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, device: Device = None, dtype: DType = None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, device=device, dtype=dtype))
        self.reset_parameters()

    init_std = 1.0

    def reset_parameters(self) -> None:
        with torch.no_grad():
            _trunc_normal_(self.weight, self.init_std)

    def forward(self, token_ids: Tensor) -> Tensor:
        return self.weight[token_ids]  # (...,) -> (..., embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x²) + eps) * weight``, computed in float32 and cast back to the input dtype.

    Init: ``weight`` all ones (the identity gain).
    """

    def __init__(self, d_model: int, eps: float = 1e-5, device: Device = None, dtype: DType = None) -> None:
        super().__init__()
        self.d_model, self.eps = d_model, eps
        self.weight = nn.Parameter(torch.ones(d_model, device=device, dtype=dtype))

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.fill_(1.0)

    def forward(self, x: Tensor) -> Tensor:
        in_dtype = x.dtype
        x32 = x.float()
        inv_rms = torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)  # (..., 1)
        return (x32 * inv_rms * self.weight.float()).to(in_dtype)

    def extra_repr(self) -> str:
        return f"{self.d_model}, eps={self.eps}"


def silu(x: Tensor) -> Tensor:
    """``x * sigmoid(x)`` (a.k.a. swish)."""
    return x * torch.sigmoid(x)


def default_d_ff(d_model: int) -> int:
    """≈ 8/3 · d_model rounded to the nearest multiple of 64 (at least 64): 512 -> 1344, 768 -> 2048."""
    return max(64, 64 * round(8 * d_model / 3 / 64))


class SwiGLU(nn.Module):
    """Gated feed-forward: ``w2(silu(w1 x) * w3 x)``; ``w1, w3: d_model -> d_ff``, ``w2: d_ff -> d_model``."""

    def __init__(self, d_model: int, d_ff: int | None = None, device: Device = None, dtype: DType = None) -> None:
        super().__init__()
        d_ff = default_d_ff(d_model) if d_ff is None else d_ff
        self.d_model, self.d_ff = d_model, d_ff
        self.w1 = Linear(d_model, d_ff, device=device, dtype=dtype)
        self.w2 = Linear(d_ff, d_model, device=device, dtype=dtype)
        self.w3 = Linear(d_model, d_ff, device=device, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(silu(self.w1(x)) * self.w3(x))


class RotaryPositionalEmbedding(nn.Module):
    """Rotary position embedding (RoPE) over adjacent pairs ``(x[2i], x[2i+1])`` of the last dimension.

    Pair ``i`` at position ``p`` is rotated by the angle ``p · theta^(-2i/d_k)``. ``cos``/``sin`` tables
    for positions ``0 .. max_seq_len-1`` are cached as non-persistent buffers (they are not weights and
    never appear in a state dict). The useful property: ``<rope(q, m), rope(k, n)>`` depends on ``m - n``
    only, so attention sees relative positions.
    """

    def __init__(self, theta: float, d_k: int, max_seq_len: int, device: Device = None) -> None:
        super().__init__()
        if d_k % 2:
            raise ValueError(f"RoPE needs an even head dimension, got d_k={d_k}; choose d_model/n_heads even")
        self.theta, self.d_k, self.max_seq_len = theta, d_k, max_seq_len
        cos, sin = self._tables(device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _tables(self, device: Device) -> tuple[Tensor, Tensor]:
        """float32 ``cos, sin (max_seq_len, d_k/2)``; angles in float64 (``p · freq`` loses digits in float32)."""
        inv_freq = self.theta ** (-torch.arange(0, self.d_k, 2, dtype=torch.float64, device=device) / self.d_k)
        angles = torch.arange(self.max_seq_len, dtype=torch.float64, device=device)[:, None] * inv_freq  # (S, d_k/2)
        return angles.cos().float(), angles.sin().float()

    def _apply(self, fn, *args, **kwargs):
        """Follow ``.to(device)``, but keep the tables float32 under ``.to(torch.bfloat16)`` and friends:
        rounding cos/sin to bf16 would turn every rotation by up to 0.4 %."""
        super()._apply(fn, *args, **kwargs)
        if self.cos.dtype != torch.float32:
            self.cos, self.sin = self._tables(self.cos.device)
        return self

    def check_positions(self, token_positions: Tensor) -> None:
        """``ValueError`` if a position is negative or beyond the cached table."""
        if not token_positions.numel():
            return
        lo, hi = int(token_positions.min()), int(token_positions.max())
        if lo < 0 or hi >= self.max_seq_len:
            raise ValueError(
                f"token positions must lie in [0, {self.max_seq_len}) (the RoPE table / context length), "
                f"got range [{lo}, {hi}]; "
                "shorten the input or build the model with a larger context_length")

    def forward(self, x: Tensor, token_positions: Tensor | None = None) -> Tensor:
        """Rotate ``x (..., seq, d_k)``; ``token_positions (..., seq)`` default to ``0 .. seq-1``."""
        seq = x.shape[-2]
        if token_positions is None:
            if seq > self.max_seq_len:
                raise ValueError(f"sequence length {seq} exceeds the RoPE table size {self.max_seq_len}; "
                                 "shorten the input or build the model with a larger context_length")
            cos, sin = self.cos[:seq], self.sin[:seq]  # (seq, d_k/2)
        else:
            self.check_positions(token_positions)
            cos, sin = self.cos[token_positions], self.sin[token_positions]  # (..., seq, d_k/2)
        x_even, x_odd = x[..., 0::2].float(), x[..., 1::2].float()  # (..., seq, d_k/2)
        out = torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1)  # (..., seq, d_k/2, 2)
        return out.flatten(-2).to(x.dtype)  # (..., seq, d_k)

    def extra_repr(self) -> str:
        return f"theta={self.theta}, d_k={self.d_k}, max_seq_len={self.max_seq_len}"


def softmax(x: Tensor, dim: int = -1) -> Tensor:
    """Numerically stable softmax: subtract the max before ``exp`` so nothing overflows; float32 inside."""
    x32 = x.float()
    e = torch.exp(x32 - x32.amax(dim=dim, keepdim=True))
    return (e / e.sum(dim=dim, keepdim=True)).to(x.dtype)


def scaled_dot_product_attention(Q: Tensor, K: Tensor, V: Tensor, mask: Tensor | None = None) -> Tensor:
    """``softmax(Q Kᵀ / sqrt(d_k)) V`` for any leading batch dims.

    Q ``(..., n, d_k)``, K ``(..., m, d_k)``, V ``(..., m, d_v)``; ``mask`` ``(n, m)`` or broadcastable,
    ``True`` = may attend. Returns ``(..., n, d_v)``. A query row whose mask is all ``False`` yields NaN.
    """
    scores = (Q @ K.transpose(-2, -1)) / math.sqrt(Q.shape[-1])  # (..., n, m)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return softmax(scores, dim=-1) @ V  # (..., n, d_v)


def cross_entropy(logits: Tensor, targets: Tensor, ignore_index: int | None = None, reduction: str = "mean",
                  weights: Tensor | None = None) -> Tensor:
    """Cross-entropy ``logsumexp(logits) - logits[target]`` in float32 (reference formula).

    ``logits (..., V)``, ``targets (...)`` int64. Targets equal to ``ignore_index`` contribute nothing;
    ``reduction="mean"`` divides by the number of counted targets (0 if there are none), ``"sum"`` lets a
    training loop divide by the target count of a whole step, ``"none"`` returns per-position losses.
    ``weights (...)``: each position's loss times its weight (any sign: a policy gradient's advantages); the
    mean still divides by the number of counted targets.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    logits = logits.reshape(-1, logits.shape[-1]).float()  # (N, V)
    targets = targets.reshape(-1)  # (N,)
    valid = torch.ones_like(targets, dtype=torch.bool) if ignore_index is None else targets != ignore_index
    safe_targets = torch.where(valid, targets, torch.zeros_like(targets))
    lse = torch.logsumexp(logits, dim=-1)  # (N,)
    losses = (lse - logits.gather(1, safe_targets[:, None]).squeeze(1)) * valid  # (N,)
    if weights is not None:
        losses = losses * weights.reshape(-1).float()
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / valid.sum().clamp(min=1)
