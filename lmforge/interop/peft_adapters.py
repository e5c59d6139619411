"""lmforge LoRA adapters in PEFT's on-disk format, for the HF Llama that :mod:`lmforge.interop.hf` exports.

A directory written by :func:`save_peft_adapters` loads with ``PeftModel.from_pretrained(llama, directory)``
on the ``LlamaForCausalLM`` holding the same base weights, and gives the same logits; :func:`load_peft_adapters`
reads such a directory (also one PEFT wrote) onto an lmforge model.

How the adapters map: module names go through the HF key map (``layers.{i}.attn.q_proj`` ->
``model.layers.{i}.self_attn.q_proj``, ``ffn.w1`` -> ``mlp.gate_proj`` ...). HF rotates RoPE halves where
lmforge rotates adjacent pairs, so the *rows* of ``q_proj``/``k_proj`` are permuted inside each head. A LoRA
update ``B A`` is a matrix of the same shape as the weight: its rows are ``B``'s rows, its columns ``A``'s
columns. So ``lora_B`` of q/k is permuted exactly like the weight and ``lora_A`` is copied unchanged; every
other factor is copied as is. Only a model a Llama expresses has such adapters: saving or loading them for any
other (``mlp: relu2``, QK-norm, a soft-cap, ...) is refused as the HF export refuses it
(:func:`~lmforge.interop.hf.check_llama_expressible`). Files: ``adapter_model.safetensors`` with keys
``base_model.model.<HF module>.lora_{A,B}.weight``, and PEFT's ``adapter_config.json`` (``peft_type: LORA``,
``r``, ``lora_alpha``, ``lora_dropout``, ``target_modules`` = the full HF module names). ``peft`` itself is not
needed to write or read them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from safetensors.torch import load as load_safetensors

from lmforge.common import check_input_file
from lmforge.interop.hf import (_HF_TO_OURS, _OURS_TO_HF, _convert, _halves_to_pairs, _pairs_to_halves,
                                check_llama_expressible)
from lmforge.model.lora import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, LoraConfig, apply_lora, check_adapters_fit, has_lora,
                                load_lora_state_dict, lora_modules, lora_state_dict, write_adapter_files)

__all__ = ["to_peft_state_dict", "from_peft_state_dict", "save_peft_adapters", "load_peft_adapters"]

_PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the wrapped LlamaForCausalLM


def _map_module(name: str, cfg: Any, to_hf: bool, b: Any) -> tuple[str, Any]:
    """``(mapped module name, B with its rows permuted as the weight's)`` through the HF key map."""
    table, permute = (_OURS_TO_HF, _pairs_to_halves) if to_hf else (_HF_TO_OURS, _halves_to_pairs)
    ((key, b2),) = _convert({f"{name}.weight": b}, cfg, table, permute).items()
    return key.removesuffix(".weight"), b2


def to_peft_state_dict(lora_sd: dict[str, Any], cfg: Any) -> dict[str, Any]:
    """:func:`~lmforge.model.lora.lora_state_dict` of a model with ``ModelConfig`` ``cfg`` -> PEFT's saved keys
    for the HF Llama (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` ...); ``ValueError`` when
    ``cfg`` is not a Llama's (:func:`~lmforge.interop.hf.check_llama_expressible`)."""
    check_llama_expressible(cfg)
    out: dict[str, Any] = {}
    for key in sorted(k for k in lora_sd if k.endswith(".lora_A")):
        mod = key.removesuffix(".lora_A")
        hf, b = _map_module(mod, cfg, True, lora_sd[f"{mod}.lora_B"])
        out[f"{_PREFIX}{hf}.lora_A.weight"] = lora_sd[key].contiguous()
        out[f"{_PREFIX}{hf}.lora_B.weight"] = b.contiguous()
    return out


def from_peft_state_dict(peft_sd: dict[str, Any], cfg: Any) -> dict[str, Any]:
    """Inverse of :func:`to_peft_state_dict` (PEFT keys with or without the adapter name ``.default``)."""
    check_llama_expressible(cfg)
    out: dict[str, Any] = {}
    factors: dict[str, dict[str, Any]] = {}
    for key, t in peft_sd.items():
        k = key.removeprefix(_PREFIX).replace(".default.weight", ".weight")
        for ab in ("A", "B"):
            if k.endswith(f".lora_{ab}.weight"):
                factors.setdefault(k.removesuffix(f".lora_{ab}.weight"), {})[ab] = t
                break
        else:
            raise ValueError(f"PEFT adapter key {key!r} is not a LoRA factor (lora_A/lora_B); only plain LoRA "
                             "adapters map onto lmforge")
    for hf, ab in sorted(factors.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"PEFT adapter for {hf!r} lacks lora_{'A' if 'A' not in ab else 'B'}")
        mod, b = _map_module(hf, cfg, False, ab["B"])
        out[f"{mod}.lora_A"], out[f"{mod}.lora_B"] = ab["A"].contiguous(), b.contiguous()
    return out


def save_peft_adapters(directory: str | os.PathLike, model: Any, lora: LoraConfig, force: bool = False) -> Path:
    """Write ``model``'s adapters (``lora`` is their config) as PEFT does for the HF-exported Llama; atomic
    writes, refusing to overwrite existing adapter files unless ``force``. Returns the directory. ``ValueError``
    (before anything is written) for a model a Llama cannot express."""
    sd = lora_state_dict(model)
    if not sd:
        raise ValueError("the model has no LoRA adapters to save; call apply_lora(model, cfg) first")
    cfg = model.cfg
    tensors = to_peft_state_dict({k: v.cpu() for k, v in sd.items()}, cfg)
    targets = [_map_module(m, cfg, True, sd[f"{m}.lora_B"].cpu())[0] for m in lora_modules(model)]
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": None, "revision": None,
              "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "target_modules": targets,
              "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
              "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
              "rank_pattern": {}, "alpha_pattern": {}}
    return write_adapter_files(directory, tensors, config, {"format": "pt"}, force)


def load_peft_adapters(directory: str | os.PathLike, model: Any) -> LoraConfig:
    """Apply and load PEFT-format LoRA adapters for the HF Llama onto the plain lmforge ``model`` (same base
    weights as that Llama: there is no fingerprint in PEFT's format). Returns the :class:`LoraConfig` used
    (targets = the exact lmforge module names). ``ValueError`` for adapter types lmforge does not have, or a model a
    Llama cannot express."""
    d = Path(directory)
    path = check_input_file(d / ADAPTER_CONFIG)
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise ValueError(f"{path} is not a PEFT LoRA config (peft_type {config.get('peft_type') if isinstance(config, dict) else None!r}); "
                         "lmforge's own adapters load with lmforge.model.lora.load_adapters")
    unsupported = [k for k in ("use_dora", "use_rslora", "fan_in_fan_out") if config.get(k)]
    unsupported += [k for k in ("rank_pattern", "alpha_pattern") if config.get(k)]
    if config.get("bias", "none") != "none":
        unsupported.append(f"bias={config['bias']!r}")
    if unsupported:
        raise ValueError(f"{path}: PEFT options {unsupported} have no lmforge counterpart; train plain LoRA")
    if has_lora(model):
        raise ValueError("the model already has LoRA adapters; load PEFT adapters onto the plain base model")
    weights = check_input_file(d / ADAPTER_WEIGHTS)
    try:
        peft_sd = load_safetensors(weights.read_bytes())
    except Exception as e:  # safetensors' own error type on a damaged file
        raise ValueError(f"{weights} is not a readable safetensors file ({e})") from None
    sd = from_peft_state_dict(peft_sd, model.cfg)
    names = sorted({k.rsplit(".", 1)[0] for k in sd})
    try:
        lora = LoraConfig(rank=config["r"], alpha=config["lora_alpha"], dropout=config.get("lora_dropout", 0.0),
                          targets=names)
    except KeyError as e:
        raise ValueError(f"{path} lacks the field {e}") from None
    check_adapters_fit(model, lora, sd)
    apply_lora(model, lora)
    load_lora_state_dict(model, sd)
    return lora
