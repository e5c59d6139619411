"""Interop with Hugging Face ``transformers`` Llama: one declarative key map, written once.

Our state-dict names follow CS336 (``layers.{i}.attn.q_proj.weight`` ...); HF's ``LlamaForCausalLM`` uses
``model.layers.{i}.self_attn.q_proj.weight`` ... The architectures are the same (pre-norm RMSNorm, SwiGLU,
RoPE, no biases) except for one detail: our RoPE rotates *adjacent* pairs ``(2i, 2i+1)`` of each head while
HF rotates *halves* ``(i, i + D/2)``. Both use frequency ``theta^(-2i/D)`` for pair ``i``, so permuting the
rows of ``q_proj`` and ``k_proj`` inside each head (``[0, 2, 4, ..., 1, 3, 5, ...]``) maps one onto the
other exactly; attention scores are unchanged because q and k are permuted alike.

Used by the generation benchmark (same weights in both models) and later by HF export.
``transformers`` is imported lazily, only by :func:`hf_config`.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch

# (our name, HF name, permutation applied to the rows: None, "q" or "k").  ``{i}`` is the layer index.
KEY_MAP: list[tuple[str, str, str | None]] = [
    ("token_embeddings.weight", "model.embed_tokens.weight", None),
    ("layers.{i}.ln1.weight", "model.layers.{i}.input_layernorm.weight", None),
    ("layers.{i}.attn.q_proj.weight", "model.layers.{i}.self_attn.q_proj.weight", "q"),
    ("layers.{i}.attn.k_proj.weight", "model.layers.{i}.self_attn.k_proj.weight", "k"),
    ("layers.{i}.attn.v_proj.weight", "model.layers.{i}.self_attn.v_proj.weight", None),
    ("layers.{i}.attn.output_proj.weight", "model.layers.{i}.self_attn.o_proj.weight", None),
    ("layers.{i}.ln2.weight", "model.layers.{i}.post_attention_layernorm.weight", None),
    ("layers.{i}.ffn.w1.weight", "model.layers.{i}.mlp.gate_proj.weight", None),
    ("layers.{i}.ffn.w3.weight", "model.layers.{i}.mlp.up_proj.weight", None),
    ("layers.{i}.ffn.w2.weight", "model.layers.{i}.mlp.down_proj.weight", None),
    ("ln_final.weight", "model.norm.weight", None),
    ("lm_head.weight", "lm_head.weight", None),
]


def _pattern(template: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(template).replace(re.escape("{i}"), r"(\d+)") + "$")


_OURS_TO_HF = [(_pattern(ours), hf, perm) for ours, hf, perm in KEY_MAP]
_HF_TO_OURS = [(_pattern(hf), ours, perm) for ours, hf, perm in KEY_MAP]


def _heads(cfg: Any, which: str) -> tuple[int, int]:
    """(number of heads, head dim) of the q or k projection of ``cfg`` (a ``ModelConfig``)."""
    n_heads = cfg.n_heads
    n_kv = getattr(cfg, "n_kv_heads", None) or n_heads
    return (n_heads if which == "q" else n_kv), cfg.d_model // n_heads


def _pairs_to_halves(w: "torch.Tensor", n_heads: int, head_dim: int) -> "torch.Tensor":
    """Reorder rows of each head from adjacent-pair RoPE layout to rotate-half layout."""
    d_in = w.shape[-1]
    w = w.reshape(n_heads, head_dim // 2, 2, d_in)  # (H, D/2, 2, C): row 2i+j of a head is [i, j]
    return w.transpose(1, 2).reshape(n_heads * head_dim, d_in)  # (H*D, C): evens first, then odds


def _halves_to_pairs(w: "torch.Tensor", n_heads: int, head_dim: int) -> "torch.Tensor":
    """Inverse of :func:`_pairs_to_halves`."""
    d_in = w.shape[-1]
    w = w.reshape(n_heads, 2, head_dim // 2, d_in)  # (H, 2, D/2, C)
    return w.transpose(1, 2).reshape(n_heads * head_dim, d_in)  # (H*D, C)


def _convert(sd: dict[str, "torch.Tensor"], cfg: Any, table: list, permute: Any) -> dict[str, "torch.Tensor"]:
    out: dict[str, torch.Tensor] = {}
    for name, tensor in sd.items():
        for pat, target, perm in table:
            m = pat.match(name)
            if m is None:
                continue
            new_name = target.replace("{i}", m.group(1)) if m.groups() else target
            if perm is not None:
                tensor = permute(tensor, *_heads(cfg, perm))
            out[new_name] = tensor.contiguous()
            break
        else:
            raise ValueError(f"state-dict key {name!r} has no counterpart in the HF Llama key map; "
                             "is this a TransformerLM / LlamaForCausalLM state dict?")
    return out


def to_hf_state_dict(sd: dict[str, "torch.Tensor"], cfg: Any) -> dict[str, "torch.Tensor"]:
    """Our ``TransformerLM`` state dict (CS336 names) → HF ``LlamaForCausalLM`` state dict.

    With tied embeddings HF expects no separate ``lm_head.weight``: it is dropped when it equals the
    embedding.
    """
    out = _convert(sd, cfg, _OURS_TO_HF, _pairs_to_halves)
    if getattr(cfg, "tie_embeddings", False):
        out.pop("lm_head.weight", None)
    return out


def from_hf_state_dict(sd: dict[str, "torch.Tensor"], cfg: Any) -> dict[str, "torch.Tensor"]:
    """HF ``LlamaForCausalLM`` state dict → ours (inverse of :func:`to_hf_state_dict`).

    Buffers HF keeps in its state dict (``rotary_emb.inv_freq``) are skipped.
    """
    sd = {k: v for k, v in sd.items() if not k.endswith("rotary_emb.inv_freq")}
    out = _convert(sd, cfg, _HF_TO_OURS, _halves_to_pairs)
    if "lm_head.weight" not in out and not getattr(cfg, "tie_embeddings", False):
        raise ValueError("HF state dict has no lm_head.weight but the config does not tie embeddings; "
                         "set tie_embeddings=True")
    return out


def hf_config(cfg: Any) -> Any:
    """A ``transformers.LlamaConfig`` with the same architecture as our ``ModelConfig`` ``cfg``."""
    from transformers import LlamaConfig  # here: an optional dependency (the test extras install it)

    return LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=getattr(cfg, "n_kv_heads", None) or cfg.n_heads,
        max_position_embeddings=cfg.context_length,
        rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=bool(getattr(cfg, "tie_embeddings", False)),
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
    )
