"""``export_hf``: an lmforge run -> a folder ``transformers.AutoModelForCausalLM.from_pretrained`` loads.

The folder holds what ``LlamaForCausalLM.save_pretrained`` plus a fast tokenizer would write::

    config.json                    LlamaForCausalLM (lmforge.interop.hf.hf_config_dict)
    generation_config.json         bos/eos ids (eos: the end-of-text token, and <|assistant_end|> for chat runs)
    model.safetensors              float32 weights under HF names, q/k rows permuted (the key map)
      or model-0000k-of-0000n.safetensors + model.safetensors.index.json above max_shard_size
    tokenizer.json, tokenizer_config.json, special_tokens_map.json   (lmforge.interop.hf_tokenizer: the
                                   end-of-text token is the BOS and is added to every text, as lmforge's evals
                                   condition on it; chat runs carry the chat template)

Nothing is written before every check has passed (run, checkpoint, config expressible in Llama, target).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from lmforge.common import atomic_write_bytes, atomic_write_text, check_apart, remove_stale_temporaries
from lmforge.interop.hf import hf_config_dict, to_hf_state_dict
from lmforge.interop.hf_tokenizer import stop_token_ids, write_hf_tokenizer
from lmforge.interop.source import check_output_dir, open_export_source
from lmforge.run import source_dirs
from lmforge.tokenizer import EOT

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["export_hf", "save_hf_weights", "DEFAULT_MAX_SHARD_SIZE", "WEIGHTS_NAME", "INDEX_NAME"]

logger = logging.getLogger("lmforge")

DEFAULT_MAX_SHARD_SIZE = 5 * 1000**3
"""Bytes per weights file before the export shards (``transformers``' own default, 5 GB)."""
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


def _shard_name(k: int, n: int) -> str:
    return f"model-{k:05d}-of-{n:05d}.safetensors"


def _remove_old_weights(out: Path) -> None:
    """Delete weight files a previous export left in ``out`` (a stale index beside new weights would win)."""
    for p in [out / WEIGHTS_NAME, out / INDEX_NAME, *out.glob("model-*-of-*.safetensors")]:
        p.unlink(missing_ok=True)


def save_hf_weights(state: dict[str, "torch.Tensor"], out: str | os.PathLike,
                    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE) -> list[Path]:
    """Write an HF state dict as ``model.safetensors``, or as shards plus ``model.safetensors.index.json``
    when it exceeds ``max_shard_size`` bytes (tensors kept whole, in order). Returns the files written."""
    from safetensors.torch import save  # here: safetensors' torch half imports torch

    if isinstance(max_shard_size, bool) or not isinstance(max_shard_size, int) or max_shard_size < 1:
        raise ValueError(f"max_shard_size must be a positive number of bytes, got {max_shard_size!r}")
    out = Path(out)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous()
        size += nbytes
    _remove_old_weights(out)
    meta = {"format": "pt"}
    if len(shards) == 1:
        atomic_write_bytes(out / WEIGHTS_NAME, save(shards[0], metadata=meta))
        return [out / WEIGHTS_NAME]
    written, weight_map = [], {}
    for k, shard in enumerate(shards, 1):
        name = _shard_name(k, len(shards))
        atomic_write_bytes(out / name, save(shard, metadata=meta))
        weight_map.update({t: name for t in shard})
        written.append(out / name)
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    atomic_write_text(out / INDEX_NAME, json.dumps(index, indent=2) + "\n")
    return [*written, out / INDEX_NAME]


def export_hf(run_dir: str | os.PathLike, out: str | os.PathLike, checkpoint: str | os.PathLike | None = None,
              force: bool = False, max_shard_size: int = DEFAULT_MAX_SHARD_SIZE) -> Path:
    """Export a run's checkpoint as an HF ``LlamaForCausalLM`` folder ``out`` (see the module docstring).

    ``checkpoint``: a file, ``"best"`` or None (the newest valid one). ``out`` must not exist or be empty
    unless ``force``, and never the run itself (or inside it, or its base). Returns ``out``. ``ValueError`` (before
    anything is written) for a missing run or checkpoint, a model option Llama cannot express, or an existing
    target without ``force``.
    """
    check_apart(out, *source_dirs(run_dir))
    target = check_output_dir(out, force)
    src = open_export_source(run_dir, checkpoint)
    tok = src.tokenizer
    eot = tok.special_tokens.get(EOT)
    stops = stop_token_ids(tok)
    config = hf_config_dict(src.cfg, bos_token_id=eot, eos_token_id=stops[0] if len(stops) == 1 else stops or None)
    hf_state = to_hf_state_dict(src.state, src.cfg)
    target.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(target)  # a killed export's half-written files (lmforge's own temporaries only)
    save_hf_weights(hf_state, target, max_shard_size)
    atomic_write_text(target / "config.json", json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": eot, "eos_token_id": config["eos_token_id"], "do_sample": False}
    atomic_write_text(target / "generation_config.json", json.dumps(generation, indent=2) + "\n")
    write_hf_tokenizer(tok, target, src.cfg.context_length)
    logger.info("exported %s (step %d) to %s", src.run.checkpoint_path, src.step, target)
    return target
