"""Interop with Hugging Face ``transformers`` Llama: one declarative key map, written once.

Our state-dict names follow CS336 (``layers.{i}.attn.q_proj.weight`` ...); HF's ``LlamaForCausalLM`` uses
``model.layers.{i}.self_attn.q_proj.weight`` ... The architectures are the same (pre-norm RMSNorm, SwiGLU,
RoPE, no biases) except for one detail: our RoPE rotates *adjacent* pairs ``(2i, 2i+1)`` of each head while
HF rotates *halves* ``(i, i + D/2)``. Both use frequency ``theta^(-2i/D)`` for pair ``i``, so permuting the
rows of ``q_proj`` and ``k_proj`` inside each head (``[0, 2, 4, ..., 1, 3, 5, ...]``) maps one onto the
other exactly; attention scores are unchanged because q and k are permuted alike.

This module also owns the model half of the config mapping: :func:`hf_config_dict` writes ``config.json``
from a ``ModelConfig`` (refusing any option Llama cannot express, :func:`check_llama_expressible`) and
:func:`model_config_from_hf` reads one back (refusing any HF option lmforge's model lacks). Used by the
generation benchmark (same weights in both models), by HF export/import (:mod:`lmforge.interop.hf_export`,
:mod:`lmforge.interop.hf_import`) and by GGUF export. ``transformers`` is imported lazily, only by
:func:`hf_config`.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from lmforge.model import ModelConfig
from lmforge.model.transformer import MAX_CONTEXT_LENGTH, options_beyond

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


# --------------------------------------------------------------------------------------------------
# Config: ModelConfig <-> config.json
# --------------------------------------------------------------------------------------------------
# The ModelConfig fields Llama expresses, and where. Any other field (a new model option) is refused on export unless
# it has its default value or leaves the forward unchanged (lmforge.model.transformer.options_beyond): a model Llama
# cannot express must not leave lmforge silently changed.
LLAMA_EXPRESSES: dict[str, str] = {
    "vocab_size": "vocab_size", "context_length": "max_position_embeddings", "d_model": "hidden_size",
    "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads",
    "d_ff": "intermediate_size", "rope_theta": "rope_theta", "tie_embeddings": "tie_word_embeddings",
    "norm_eps": "rms_norm_eps",
}
"""``ModelConfig`` field -> the ``config.json`` key (HF ``LlamaConfig``) that holds it; the fields that do not
change the forward (``NUMERICS_ONLY``, ``INIT_ONLY`` of :mod:`lmforge.model.transformer`) need none."""


def check_llama_expressible(cfg: ModelConfig) -> None:
    """``ValueError`` naming the first option of ``cfg`` that a Llama model (HF or GGUF, and PEFT adapters for
    one) cannot express."""
    beyond = options_beyond(cfg, LLAMA_EXPRESSES)
    if beyond:
        name, value, default = beyond[0]
        raise ValueError(f"model.{name}={value!r} has no counterpart in a Llama model (HF LlamaForCausalLM "
                         f"or GGUF llama), so exporting would change the model; only runs with model.{name}="
                         f"{default!r} can be exported (or teach lmforge.interop.hf.LLAMA_EXPRESSES the mapping)")


def hf_config_dict(cfg: ModelConfig, bos_token_id: int | None = None,
                   eos_token_id: int | list[int] | None = None) -> dict[str, Any]:
    """The ``config.json`` of a ``LlamaForCausalLM`` with the architecture of ``cfg`` (checked expressible).

    Written with the classic keys (``rope_theta``, ``rope_scaling: null``) that every ``transformers``
    version, vLLM and llama.cpp's converter read.
    """
    check_llama_expressible(cfg)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.context_length,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": float(cfg.rope_theta),
        "rope_scaling": None,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": "float32",
    }


def hf_config(cfg: ModelConfig) -> Any:
    """A ``transformers.LlamaConfig`` with the same architecture as our ``ModelConfig`` ``cfg``."""
    from transformers import LlamaConfig  # here: an optional dependency (the test extras install it)

    d = hf_config_dict(cfg)
    for key in ("architectures", "model_type", "torch_dtype", "rope_scaling", "bos_token_id", "eos_token_id"):
        d.pop(key)  # file-only keys; bos/eos keep LlamaConfig's defaults (no tokenizer here)
    return LlamaConfig(**d)


def _rope_theta(d: dict[str, Any], where: str) -> float:
    """RoPE base of an HF config, refusing scaled RoPE (classic ``rope_scaling`` or v5 ``rope_parameters``)."""
    params = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling")
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type")) if scaling else params.get("rope_type")
    if scaling or rope_type not in (None, "default"):
        raise ValueError(f"{where}: RoPE scaling ({rope_type or scaling}) is not supported; lmforge's model has "
                         "plain RoPE (rope_scaling null / rope_type default)")
    theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or not theta > 0:
        raise ValueError(f"{where}: rope_theta must be a positive number, got {theta!r}")
    return float(theta)


def _context_length(d: dict[str, Any], where: str) -> int:
    """``max_position_embeddings`` (default 2048) as a context length lmforge can hold, or ``ValueError``."""
    v = d.get("max_position_embeddings", 2048)
    n = int(v) if isinstance(v, float) and v.is_integer() else v  # JSON writes 1e15 or 2048.0 as floats
    if isinstance(n, bool) or not isinstance(n, int) or not 0 < n <= MAX_CONTEXT_LENGTH:
        shown = f"{v:g}" if isinstance(v, float) else repr(v)
        raise ValueError(f"{where}: max_position_embeddings={shown} is not a context length lmforge can hold (an "
                         f"integer from 1 to {MAX_CONTEXT_LENGTH:,}); set it to the context the model was trained on")
    return n


def model_config_from_hf(d: dict[str, Any], where: str = "config.json") -> ModelConfig:
    """The ``ModelConfig`` of an HF Llama ``config.json`` (as a dict); ``ValueError`` for anything else.

    Refused, each with its own message: another architecture (named), biases, an activation other than SiLU,
    a head dim other than ``hidden_size / num_attention_heads``, scaled RoPE, dropout, a
    ``max_position_embeddings`` above :data:`~lmforge.model.transformer.MAX_CONTEXT_LENGTH`.
    """
    archs = d.get("architectures") or []
    if d.get("model_type") != "llama" or (archs and "LlamaForCausalLM" not in archs):
        name = ", ".join(archs) if archs else f"model_type {d.get('model_type')!r}"
        raise ValueError(f"{where} describes {name}, not LlamaForCausalLM; lmforge imports Llama-architecture "
                         "checkpoints only (model_type \"llama\")")
    for key in ("attention_bias", "mlp_bias"):
        if d.get(key):
            raise ValueError(f"{where}: {key}=true, but lmforge's model has no biases; it cannot hold this model")
    if d.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act={d['hidden_act']!r}, but lmforge's feed-forward is SwiGLU with SiLU")
    if d.get("attention_dropout") or d.get("hidden_dropout"):
        raise ValueError(f"{where}: dropout is set (attention_dropout={d.get('attention_dropout')}), but lmforge's "
                         "model has no dropout; set it to 0 in config.json if you accept training without it")
    context_length = _context_length(d, where)
    try:
        hidden, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
        kw = dict(vocab_size=int(d["vocab_size"]), context_length=context_length,
                  d_model=hidden, n_layers=int(d["num_hidden_layers"]), n_heads=heads,
                  n_kv_heads=int(d.get("num_key_value_heads") or heads), d_ff=int(d["intermediate_size"]))
    except KeyError as e:
        raise ValueError(f"{where} has no {e.args[0]!r}; is it a complete Llama config.json?") from None
    except (TypeError, ValueError):
        raise ValueError(f"{where}: hidden_size, num_attention_heads, num_hidden_layers, intermediate_size and "
                         "vocab_size must be integers") from None
    head_dim = d.get("head_dim")
    if head_dim is not None and head_dim != hidden // heads:
        raise ValueError(f"{where}: head_dim={head_dim} differs from hidden_size/num_attention_heads="
                         f"{hidden // heads}; lmforge's attention has head dim d_model/n_heads")
    eps = d.get("rms_norm_eps", 1e-6)
    try:
        return ModelConfig(**kw, rope_theta=_rope_theta(d, where), norm_eps=float(eps),
                           tie_embeddings=bool(d.get("tie_word_embeddings", False)))
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
