"""``import_hf``: a local HF Llama checkpoint folder -> an lmforge run directory.

Reads ``config.json`` (a ``LlamaForCausalLM``: :func:`lmforge.interop.hf.model_config_from_hf` refuses what
lmforge's model lacks), ``tokenizer.json`` (byte-level BPE only) and the safetensors weights
(``model.safetensors`` or the shards named by ``model.safetensors.index.json``; never a pickle), maps the
weights through the one key map (:func:`lmforge.interop.hf.from_hf_state_dict`) in float32, and writes a run::

    lmforge-run.json               the run marker
    config.yaml                    model = the checkpoint's architecture; data.dir = RUN/data (empty: prepare
                                   shards there with the run's tokenizer to evaluate loss or continue pretraining)
    tokenizer.json                 the tokenizer in lmforge's format
    checkpoints/step_00000000.safetensors   the weights (no optimizer state), extra.imported_from = the folder

that ``generate``, ``chat``, ``eval``, ``sft`` and ``serve`` open like any trained run.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from lmforge.checkpoint import CheckpointManager, check_state_dict_fits, save_checkpoint
from lmforge.common import check_apart, check_input_file, remove_stale_temporaries
from lmforge.config import dump_yaml, to_dict
from lmforge.interop.hf import from_hf_state_dict, model_config_from_hf
from lmforge.interop.source import architecture, check_output_dir
from lmforge.run import check_no_other_checkpoints, mark
from lmforge.tokenizer import Tokenizer
from lmforge.train.config import DataConfig, RunConfig

__all__ = ["import_hf", "read_hf_weights", "check_byte_level"]

logger = logging.getLogger("lmforge")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(check_input_file(path).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); the checkpoint folder is damaged") from None


def _require(folder: Path, name: str, why: str) -> Path:
    p = folder / name
    if not p.is_file():
        raise ValueError(f"{folder} has no {name} ({why}); give a local HF Llama checkpoint folder with config.json, "
                         "tokenizer.json and model.safetensors (or its sharded index)")
    return p


def check_byte_level(tok_json: dict[str, Any], where: str) -> None:
    """``ValueError`` unless ``tok_json`` (a parsed HF ``tokenizer.json``) is a byte-level BPE tokenizer."""
    model = tok_json.get("model") if isinstance(tok_json, dict) else None
    if not isinstance(model, dict) or model.get("type", "BPE") != "BPE":
        kind = model.get("type") if isinstance(model, dict) else "no model"
        raise ValueError(f"{where} holds a {kind} tokenizer, not byte-level BPE; lmforge's tokenizer is byte-level "
                         "BPE (GPT-2 / Llama 3 style)")
    parts: list[Any] = []
    for key in ("pre_tokenizer", "decoder"):
        item = tok_json.get(key) or {}
        parts += item.get("pretokenizers", item.get("decoders", [item])) if isinstance(item, dict) else []
    kinds = {p.get("type") for p in parts if isinstance(p, dict)}
    if "ByteLevel" not in kinds or model.get("byte_fallback"):
        shown = ", ".join(sorted(k for k in kinds if k)) or "none"
        raise ValueError(f"{where} is a BPE tokenizer but not byte-level (pre-tokenizer/decoder: {shown}"
                         f"{', byte_fallback' if model.get('byte_fallback') else ''}); SentencePiece-style "
                         "tokenizers (Metaspace, byte fallback: Llama 1/2, Mistral) cannot be imported")


def read_hf_weights(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The state dict of an HF checkpoint folder's safetensors weights (single file or sharded with an index)."""
    from safetensors.torch import load_file  # here: safetensors' torch half

    folder = Path(folder)
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.is_file():
        files = [single]
    elif index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no weight_map; the checkpoint folder is damaged")
        files = [folder / f for f in dict.fromkeys(weight_map.values())]
        for f in files:
            if not f.is_file():
                raise ValueError(f"{folder} has no {f.name}, a weights shard {index.name} lists; copy the complete "
                                 "checkpoint folder")
    else:
        pickles = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt*"))
        hint = (f" (it has {pickles[0]}: pickled weights, which lmforge never loads; convert them to safetensors "
                "with transformers' save_pretrained(..., safe_serialization=True))") if pickles else ""
        raise ValueError(f"{folder} has no model.safetensors or model.safetensors.index.json{hint}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(f))
        except Exception as e:  # safetensors raises its own error type for a damaged file
            raise ValueError(f"{f} is not a readable safetensors file ({e})") from None
    return state


def import_hf(model_dir: str | os.PathLike, out: str | os.PathLike, force: bool = False) -> Path:
    """Turn the HF Llama folder ``model_dir`` into the lmforge run ``out`` (see the module docstring).

    ``out`` must not exist or be empty unless ``force``; it is never ``model_dir`` (nor inside it), nor a run
    holding checkpoints other than the step 0 an import writes (they would outrank the imported weights).
    Every check (files, architecture, options, tokenizer, weights fitting the model) runs before anything is
    written. Returns ``out``.
    """
    folder = Path(model_dir)
    if not folder.is_dir():
        raise ValueError(f"{folder} is not a directory; give a local HF checkpoint folder (config.json, "
                         "tokenizer.json, model.safetensors)")
    check_apart(out, folder)
    target = check_output_dir(out, force)
    check_no_other_checkpoints(target, 0)
    config_path = _require(folder, "config.json", "the model architecture")
    tok_path = _require(folder, "tokenizer.json", "the byte-level BPE tokenizer")
    cfg = model_config_from_hf(_read_json(config_path), where=str(config_path))
    tok_json = _read_json(tok_path)
    check_byte_level(tok_json, str(tok_path))
    post = tok_json.get("post_processor") or {}
    adders = {p.get("type") for p in post.get("processors", [post])} & {"TemplateProcessing", "BertProcessing",
                                                                     "RobertaProcessing"}
    if adders:
        logger.warning("%s has a post-processor (%s) that adds tokens around encoded text (e.g. a BOS); lmforge's "
                       "tokenizer encodes the text only, so add such tokens to prompts yourself", tok_path,
                       ", ".join(sorted(adders)))
    tokenizer = Tokenizer.from_hf(tok_path)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ValueError(f"{tok_path} has {tokenizer.vocab_size} tokens but config.json's vocab_size is "
                         f"{cfg.vocab_size}; the tokenizer does not belong to this model")
    hf_state = {k: v.float() for k, v in read_hf_weights(folder).items()}
    try:
        state = from_hf_state_dict(hf_state, cfg)
    except ValueError as e:
        raise ValueError(f"{folder}: {e}") from None
    if cfg.tie_embeddings and "token_embeddings.weight" in state:  # tied as transformers ties: a stored head is ignored
        state["lm_head.weight"] = state["token_embeddings.weight"]
    model = architecture(cfg)  # shapes only: the imported tensors are assigned, no random init is drawn
    try:  # the checkpoint API's check, with one-line messages
        check_state_dict_fits(state, model.state_dict())
    except ValueError as e:
        raise ValueError(f"{folder}: weights do not fit config.json: {e}") from None
    model.load_state_dict(state, strict=True, assign=True)  # its RoPE tables stay on meta: saved, never run
    run_cfg = RunConfig(model=cfg, data=DataConfig(dir=str((target / "data").resolve()),
                                                   tokenizer=str((target / "tokenizer.json").resolve())))

    target.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(target)  # a killed import's half-written files (lmforge's own temporaries only)
    tokenizer.save(target / "tokenizer.json", force=True)
    dump_yaml(run_cfg, target / "config.yaml")
    save_checkpoint(model, None, 0, CheckpointManager(target).path_for(0),
                    extra={"imported_from": {"path": str(folder.resolve()), "format": "hf-llama"},
                           "config": to_dict(run_cfg)})
    mark(target)
    logger.info("imported %s into %s (%s)", folder, target, ", ".join(f"{k}={v}" for k, v in
                                                                         to_dict(cfg).items() if k != "fast"))
    return target
