"""Training-recipe pieces of the model (modded-nanogpt and nanochat), each behind a :class:`ModelConfig` option
that is off by default: previous-token mixing of the embeddings (``smear``), smeared keys, the partial key offset,
logit soft-capping, and the parameter-free RMS norm that QK-norm applies to each head.

The smear, the key smear, the key offset and the soft-cap each have two forms, as the model's other primitives do:
the fast path's and a reference (``*_reference``, what ``model.fast: false`` runs) written separately from the
formula in the docstring, through other tensor operations, so that ``tests/model/test_recipe.py``'s fast ==
reference checks catch a slip in either.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lmforge.model.layers import Device, DType

__all__ = ["Smear", "SMEAR_GATE_CHANNELS", "softcap", "softcap_reference", "rms_norm_heads", "smear_keys",
           "smear_keys_reference", "key_smear_init", "offset_keys", "offset_keys_reference"]

SMEAR_GATE_CHANNELS = 24
"""How many leading channels of a token's embedding its smear gate reads (nanochat's choice; fewer when
``d_model`` is smaller)."""


class Smear(nn.Module):
    """Previous-token mixing ("smear"): ``e'_t = e_t + lam · sigmoid(gate · e_t[:G]) · e_{t-1}``.

    ``e`` are the token embeddings ``(B, T, d_model)``, ``G`` = :data:`SMEAR_GATE_CHANNELS` (at most ``d_model``);
    before a sequence's first token ``e_{-1} = 0``. Each position then sees the token before it from the first
    block on, which is what an induction head needs (Olsson et al. 2022 smear the keys for the same reason):
    in-context copying forms early. Parameters: ``gate (G,)`` and ``lam (1,)``, both 1-D (optimizer groups put
    them with the norms: no weight decay, AdamW), both initialised to zero, so the model starts as if without
    it and ``lam`` grows from its gradient ``Σ_t sigmoid(0)·<dL/de'_t, e_{t-1}>``. ``fast``: the fast path's form,
    else the reference's (the same numbers).
    """

    def __init__(self, d_model: int, device: Device = None, dtype: DType = None, fast: bool = True) -> None:
        super().__init__()
        self.fast = fast
        self.channels = min(SMEAR_GATE_CHANNELS, d_model)
        self.gate = nn.Parameter(torch.zeros(self.channels, device=device, dtype=dtype))
        self.lam = nn.Parameter(torch.zeros(1, device=device, dtype=dtype))

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.gate.zero_()
            self.lam.zero_()

    def forward(self, x: Tensor, prev: Tensor) -> Tensor:
        """``x (B, T, d)`` the embeddings, ``prev (B, 1, d)`` the embedding before ``x[:, 0]`` (zeros when there
        is none, e.g. in training or for a row's first token) -> ``(B, T, d)``."""
        if not self.fast:
            return self._forward_reference(x, prev)
        before = torch.cat([prev.to(x.dtype), x[:, :-1]], dim=1)  # (B, T, d): e_{t-1}
        g = self.lam * torch.sigmoid(x[..., :self.channels] @ self.gate)  # (B, T)
        return x + g.unsqueeze(-1) * before

    def _forward_reference(self, x: Tensor, prev: Tensor) -> Tensor:
        """The class docstring's formula term by term: ``e_{t-1}`` by rolling the positions one on (``prev`` into
        position 0), the gate as a sum of products over the first ``G`` channels."""
        e_prev = x.roll(1, dims=1)  # (B, T, d): position t holds e_{t-1}; position 0 holds e_{T-1} ...
        e_prev[:, 0] = prev[:, 0].to(x.dtype)  # ... replaced by the token before the first
        gate = (x[:, :, :self.channels] * self.gate).sum(dim=-1, keepdim=True)  # (B, T, 1): gate · e_t[:G]
        return x + self.lam * torch.sigmoid(gate) * e_prev

    def extra_repr(self) -> str:
        return f"gate_channels={self.channels}"


def softcap(logits: Tensor, cap: float | None) -> Tensor:
    """Logit soft-capping: ``cap · tanh(logits / cap)`` (identity for ``cap=None``); keeps every logit inside
    ``(-cap, cap)`` while leaving small ones almost unchanged (Gemma 2; modded-nanogpt)."""
    return logits if cap is None else cap * torch.tanh(logits / cap)


def softcap_reference(logits: Tensor, cap: float | None) -> Tensor:
    """:func:`softcap` through ``tanh(u) = 2·sigmoid(2u) - 1``: ``cap · (2·sigmoid(2·logits/cap) - 1)``."""
    if cap is None:
        return logits
    return cap * (2.0 * torch.sigmoid(logits * (2.0 / cap)) - 1.0)


def rms_norm_heads(x: Tensor, eps: float) -> Tensor:
    """``x / sqrt(mean(x²) + eps)`` over the last (head) dimension, no gain, in float32 and cast back: QK-norm's
    normalisation of each query and key head, and the reference form of ``model.embed_norm`` over the embedding."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)).to(x.dtype)


def key_smear_init(n_kv_heads: int) -> Tensor:
    """The key-smear logits at init, ``(n_kv_heads,)``: spread evenly over ``[-2, 2]`` (one head: 0), so that the
    heads start between mostly their own key (``sigmoid(-2) = 0.12`` of the previous one) and mostly the previous
    token's (0.88): some heads can match previous tokens, an induction head's first half, from the first step."""
    return torch.linspace(-2.0, 2.0, n_kv_heads) if n_kv_heads > 1 else torch.zeros(1)


def smear_keys(k: Tensor, logits: Tensor) -> Tensor:
    """Smeared keys (Olsson et al. 2022): ``k'_j = k_j + sigmoid(a_h)·(k_{j-1} - k_j)`` per key head ``h``, with
    ``k_{-1} = 0``. ``k (B, KV, S, D)``: the keys of columns ``0 .. S-1`` (after RoPE), ``logits (KV,)`` the
    parameters ``a``. The cache holds the keys before smearing, so a step smears every cached column again (no
    per-row state: copying or padding rows needs nothing more)."""
    prev = F.pad(k, (0, 0, 1, 0))[..., :-1, :]  # (B, KV, S, D): column j-1's key, zeros before column 0
    share = torch.sigmoid(logits.float()).to(k.dtype)[:, None, None]  # (KV, 1, 1)
    return k + share * (prev - k)


def smear_keys_reference(k: Tensor, logits: Tensor) -> Tensor:
    """:func:`smear_keys` as a mix ``(1 - s_h)·k_j + s_h·k_{j-1}``, ``s_h = sigmoid(a_h)``: each head's share of
    the previous column's key, that key found by rolling the columns one on and zeroing column 0."""
    k_prev = k.roll(1, dims=-2)  # (..., KV, S, D): column j holds k_{j-1}; column 0 the last column's key ...
    k_prev[..., 0, :] = 0  # ... replaced by k_{-1} = 0
    s = torch.sigmoid(logits.float()).to(k.dtype).reshape(-1, 1, 1)  # (KV, 1, 1)
    return (1 - s) * k + s * k_prev


def offset_keys(k: Tensor) -> Tensor:
    """Partial key offset (modded-nanogpt's record #49, "Partial Key Offset"): the second half of each key head's
    dimensions at column ``j`` is column ``j-1``'s (column 0 keeps its own); the first half stays. ``k (..., S, D)``:
    the keys of columns ``0 .. S-1`` after RoPE, where the second half holds RoPE's slowest-turning pairs (modded-
    nanogpt leaves that half unrotated and moves it). A query can then match the token before a key's own, which is
    what one layer needs to be an induction head. The cache holds the keys before the offset, so a step offsets every
    cached column again (no per-row state, as :func:`smear_keys`)."""
    half = k.shape[-1] // 2
    moved = torch.cat([k[..., :1, half:], k[..., :-1, half:]], dim=-2)  # (..., S, D - half): column j-1's, j >= 1
    return torch.cat([k[..., :half], moved], dim=-1)


def offset_keys_reference(k: Tensor) -> Tensor:
    """:func:`offset_keys` as one gather: element ``(j, d)`` reads column ``j - [d >= D/2]``, clamped at column 0."""
    S, D = k.shape[-2:]
    back = (torch.arange(D, device=k.device) >= D // 2).long()  # (D,): 1 where the column is the previous one
    src = (torch.arange(S, device=k.device)[:, None] - back).clamp(min=0)  # (S, D)
    return torch.gather(k, -2, src.expand(k.shape))
