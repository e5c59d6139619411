"""The Transformer block and its two halves: causal self-attention (RoPE, grouped-query attention, optional
QK-norm and value embeddings) and the feed-forward (SwiGLU, or ReLU² under ``model.mlp: relu2``), each with a
reference path (the spec, from :mod:`lmforge.model.layers`) and a fast path (:mod:`lmforge.model.fused`)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lmforge.model.cache import KVCache, check_context
from lmforge.model.fused import Norm, _project_modules, _rope_fast
from lmforge.model.layers import (Device, DType, Linear, RotaryPositionalEmbedding, SwiGLU, scaled_dot_product_attention)
from lmforge.model.recipe import (key_smear_init, offset_keys, offset_keys_reference, rms_norm_heads, smear_keys,
                                  smear_keys_reference)

__all__ = ["CausalSelfAttention", "FeedForward", "ReluSquared", "MLPS", "TransformerBlock"]


class CausalSelfAttention(nn.Module):
    """Causal multi-head self-attention with RoPE on queries and keys and optional grouped-query attention.

    ``num_kv_heads < num_heads`` shares each key/value head among ``num_heads / num_kv_heads`` query heads
    (query head ``h`` reads kv head ``h // group``). Without ``theta`` no RoPE is applied.

    ``qk_norm``: each query and key head is RMS-normalised (no gain) before RoPE (``model.qk_norm``); ``qk_scale``
    (``model.qk_norm_scale``): the scores are ``qk_scale · q·k`` instead of ``q·k / sqrt(head_dim)`` (the reference
    path multiplies the queries by ``qk_scale·sqrt(head_dim)`` before its ``/ sqrt(head_dim)``, the fast path gives
    the kernel the scale).
    ``value_embed``: the forward takes ``ve (B, T, num_kv_heads·head_dim)``, the token's value embedding, and
    adds ``ve_lambda · ve`` to the values (``model.value_embeds``); ``ve_lambda (1,)`` starts at 0.5.
    ``smear_keys``: each key head mixes in the previous column's key (:func:`~lmforge.model.recipe.smear_keys`, the
    reference path :func:`~lmforge.model.recipe.smear_keys_reference`; ``model.smear_keys``) with the learned logits
    ``key_smear (num_kv_heads,)`` (init: ``key_smear_init``).
    ``key_offset``: the second half of each key head's dimensions is the previous column's, after the smear if any
    (:func:`~lmforge.model.recipe.offset_keys`, the reference path's
    :func:`~lmforge.model.recipe.offset_keys_reference`; ``model.key_offset``). The cache keeps the raw keys; both
    are applied to every cached column at each pass.
    """

    def __init__(self, d_model: int, num_heads: int, max_seq_len: int | None = None, theta: float | None = None,
                 num_kv_heads: int | None = None, rope: RotaryPositionalEmbedding | None = None, fast: bool = False,
                 device: Device = None, dtype: DType = None, *, qk_norm: bool = False, value_embed: bool = False,
                 smear_keys: bool = False, eps: float = 1e-5, qk_scale: float | None = None,
                 key_offset: bool = False) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if d_model % num_heads or num_heads % num_kv_heads:
            raise ValueError(f"need d_model ({d_model}) divisible by num_heads ({num_heads}) and num_heads "
                             f"divisible by num_kv_heads ({num_kv_heads})")
        self.d_model, self.num_heads, self.num_kv_heads = d_model, num_heads, num_kv_heads
        self.head_dim = d_model // num_heads
        self.fast = fast
        self.qk_norm, self.eps, self.qk_scale = qk_norm, eps, qk_scale
        self.key_offset = key_offset
        self.ve_lambda = nn.Parameter(torch.full((1,), 0.5, device=device, dtype=dtype)) if value_embed else None
        self.key_smear = (nn.Parameter(key_smear_init(num_kv_heads).to(device=device, dtype=dtype)) if smear_keys
                          else None)
        self.q_proj = Linear(d_model, num_heads * self.head_dim, device=device, dtype=dtype)
        self.k_proj = Linear(d_model, num_kv_heads * self.head_dim, device=device, dtype=dtype)
        self.v_proj = Linear(d_model, num_kv_heads * self.head_dim, device=device, dtype=dtype)
        self.output_proj = Linear(num_heads * self.head_dim, d_model, device=device, dtype=dtype)
        if rope is None and theta is not None:
            if max_seq_len is None:
                raise ValueError("RoPE needs max_seq_len together with theta")
            rope = RotaryPositionalEmbedding(theta, self.head_dim, max_seq_len, device=device)
        self.rope = rope

    def reset_parameters(self) -> None:
        with torch.no_grad():
            if self.ve_lambda is not None:
                self.ve_lambda.fill_(0.5)
            if self.key_smear is not None:
                self.key_smear.copy_(key_smear_init(self.num_kv_heads))

    def forward(self, x: Tensor, token_positions: Tensor | None = None, cache: KVCache | None = None,
                layer_idx: int = 0, ve: Tensor | None = None) -> Tensor:
        """``x (B, T, d_model) -> (B, T, d_model)``; positions default to ``0 .. T-1``; ``ve`` the value
        embeddings of the tokens (exactly when built with ``value_embed``).

        With ``cache`` (planned by :meth:`KVCache.begin`, whose positions the model passes as
        ``token_positions``) the new keys/values are stored in layer ``layer_idx`` and each row attends over
        its cached prefix.
        """
        if (ve is None) != (self.ve_lambda is None):
            raise ValueError("value embeddings go to exactly the attention layers built with value_embed=True")
        if self.fast:
            return self._forward_fast(x, token_positions, cache, layer_idx, ve)
        return self._forward_reference(x, token_positions, cache, layer_idx, ve)

    def _attended_keys(self, k: Tensor, reference: bool) -> Tensor:
        """The keys the queries attend to, from the raw keys ``k (B, KV, S, D)`` of columns ``0 .. S-1``: smeared
        (``smear_keys``), then offset (``key_offset``); in the reference path's forms or the fast path's."""
        if self.key_smear is not None:
            k = (smear_keys_reference if reference else smear_keys)(k, self.key_smear)
        if self.key_offset:
            k = (offset_keys_reference if reference else offset_keys)(k)
        return k

    def _forward_reference(self, x: Tensor, token_positions: Tensor | None, cache: KVCache | None,
                           layer_idx: int, ve: Tensor | None = None) -> Tensor:
        *lead, T, _ = x.shape
        H, KV, D = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_proj(x).unflatten(-1, (H, D)).transpose(-3, -2)  # (..., H, T, D)
        k = self.k_proj(x).unflatten(-1, (KV, D)).transpose(-3, -2)  # (..., KV, T, D)
        v = self.v_proj(x)  # (..., T, KV*D)
        if ve is not None:
            v = (v + self.ve_lambda * ve).to(v.dtype)
        v = v.unflatten(-1, (KV, D)).transpose(-3, -2)  # (..., KV, T, D)
        if self.qk_norm:
            q, k = rms_norm_heads(q, self.eps), rms_norm_heads(k, self.eps)
        if self.rope is not None:
            pos = token_positions
            pos = pos.unsqueeze(-2) if pos is not None and pos.dim() >= 2 else pos  # (B, 1, T): broadcast over heads
            q, k = self.rope(q, pos), self.rope(k, pos)
        if self.qk_scale is not None:  # scaled_dot_product_attention divides by sqrt(D)
            q = q * (self.qk_scale * math.sqrt(D))
        if cache is not None:
            k, v = cache.write(layer_idx, k, v)  # (B, KV, S, D) with S = cached + T
            k = self._attended_keys(k, reference=True)
            mask = cache.mask(T)  # None, (T, S) or (B, 1, T, S)
            if mask is None:  # plain causal over the last T of S columns (S == T, or one query that sees all)
                S = k.shape[-2]
                mask = torch.ones(T, S, dtype=torch.bool, device=x.device).tril(S - T)
        else:
            k = self._attended_keys(k, reference=True)
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()  # (T, T)
        if KV != H:
            k = k.repeat_interleave(H // KV, dim=-3)  # (..., H, S, D)
            v = v.repeat_interleave(H // KV, dim=-3)
        y = scaled_dot_product_attention(q, k, v, mask)  # (..., H, T, D)
        return self.output_proj(y.transpose(-3, -2).flatten(-2))  # (..., T, H*D) -> (..., T, d_model)

    def _forward_fast(self, x: Tensor, token_positions: Tensor | None, cache: KVCache | None,
                      layer_idx: int, ve: Tensor | None = None) -> Tensor:
        B, T, _ = x.shape
        H, KV, D = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = _project_modules(self, x, (self.q_proj, self.k_proj, self.v_proj))  # (B, T, h·D)
        if ve is not None:
            v = torch.addcmul(v, self.ve_lambda.to(v.dtype), ve.to(v.dtype))
        q, k, v = q.unflatten(-1, (H, D)), k.unflatten(-1, (KV, D)), v.unflatten(-1, (KV, D))  # (B, T, h, D)
        if self.qk_norm:
            q, k = F.rms_norm(q, (D,), eps=self.eps).to(q.dtype), F.rms_norm(k, (D,), eps=self.eps).to(k.dtype)
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
            k = self._attended_keys(k, reference=False)
            y = causal_attention(q, k, v, KV != H, self.qk_scale)
        else:
            k, v = cache.write(layer_idx, k, v)  # (B, KV, S, D)
            k = self._attended_keys(k, reference=False)
            mask = cache.mask(T)
            if mask is None:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1, enable_gqa=KV != H, scale=self.qk_scale)
            else:
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=KV != H, scale=self.qk_scale)
        y = y.transpose(1, 2).reshape(B, T, H * D)  # (B, T, H*D)
        return self.output_proj(y)  # (B, T, d_model)


def causal_attention(q: Tensor, k: Tensor, v: Tensor, gqa: bool, scale: float | None) -> Tensor:
    """Causal ``F.scaled_dot_product_attention`` of ``(B, h, T, D)`` heads over the whole sequence.

    On the CPU, bf16 heads that need gradients (bf16 autocast training) are attended in float32 and the result is
    cast back to bf16: torch's CPU flash-attention backward is slower in bf16 than in float32 at the model's head
    sizes (``benchmarks/bench_train_step.py --profile`` times both), and float32 only rounds less. Elsewhere the
    heads are attended in their own dtype."""
    if q.device.type == "cpu" and q.dtype == torch.bfloat16 and torch.is_grad_enabled() and q.requires_grad:
        with torch.autocast("cpu", enabled=False):  # autocast would cast the float32 heads back to bf16
            y = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, enable_gqa=gqa,
                                               scale=scale)
        return y.to(torch.bfloat16)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa, scale=scale)


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


class ReluSquared(nn.Module):
    """ReLU² feed-forward (modded-nanogpt, nanochat): ``w2(relu(w1 x)²)``; ``w1: d_model -> d_ff``,
    ``w2: d_ff -> d_model``, no gate. The reference squares ``clamp(h, min=0)``; the fast path ``F.relu(h)``
    (the same numbers: both are exact)."""

    def __init__(self, d_model: int, d_ff: int, fast: bool = False, device: Device = None, dtype: DType = None) -> None:
        super().__init__()
        self.d_model, self.d_ff, self.fast = d_model, d_ff, fast
        self.w1 = Linear(d_model, d_ff, device=device, dtype=dtype)
        self.w2 = Linear(d_ff, d_model, device=device, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        h = self.w1(x)  # (B, T, d_ff)
        return self.w2(F.relu(h).square() if self.fast else h.clamp(min=0) ** 2)  # (B, T, d_model)


MLPS = ("swiglu", "relu2")
"""The feed-forward kinds ``model.mlp`` names."""


class TransformerBlock(nn.Module):
    """Pre-norm block: ``x + attn(ln1(x))`` then ``x + ffn(ln2(x))``.

    ``mlp``: the feed-forward, ``"swiglu"`` (:class:`FeedForward`) or ``"relu2"`` (:class:`ReluSquared`);
    ``qk_norm``, ``qk_scale``, ``value_embed``, ``smear_keys`` and ``key_offset`` go to :class:`CausalSelfAttention`."""

    def __init__(self, d_model: int, num_heads: int, d_ff: int | None = None, max_seq_len: int | None = None,
                 theta: float | None = None, num_kv_heads: int | None = None, eps: float = 1e-5,
                 rope: RotaryPositionalEmbedding | None = None, fast: bool = False, device: Device = None,
                 dtype: DType = None, *, mlp: str = "swiglu", qk_norm: bool = False, value_embed: bool = False,
                 smear_keys: bool = False, qk_scale: float | None = None, key_offset: bool = False) -> None:
        super().__init__()
        if mlp not in MLPS:
            raise ValueError(f"unknown feed-forward {mlp!r}; use one of {', '.join(MLPS)}")
        self.attn = CausalSelfAttention(d_model, num_heads, max_seq_len, theta, num_kv_heads, rope=rope, fast=fast,
                                        device=device, dtype=dtype, qk_norm=qk_norm, value_embed=value_embed,
                                        smear_keys=smear_keys, eps=eps, qk_scale=qk_scale, key_offset=key_offset)
        self.ln1 = Norm(d_model, eps, fast=fast, device=device, dtype=dtype)
        if mlp == "relu2":
            self.ffn: nn.Module = ReluSquared(d_model, d_ff or 4 * d_model, fast=fast, device=device, dtype=dtype)
        else:
            self.ffn = FeedForward(d_model, d_ff, fast=fast, device=device, dtype=dtype)
        self.ln2 = Norm(d_model, eps, fast=fast, device=device, dtype=dtype)

    def forward(self, x: Tensor, token_positions: Tensor | None = None, cache: KVCache | None = None,
                layer_idx: int = 0, ve: Tensor | None = None) -> Tensor:
        x = x + self.attn(self.ln1(x), token_positions, cache, layer_idx, ve)
        return x + self.ffn(self.ln2(x))
