"""``export_gguf``: an lmforge run -> one GGUF v3 file llama.cpp loads as a ``llama`` model.

Written with the ``gguf`` package's ``GGUFWriter`` (``pip install 'lmforge[export]'``) from lmforge's own
weights and tokenizer; llama.cpp's HF converter is not involved. What goes in:

* metadata: ``general.architecture = llama`` and the ``llama.*`` hyperparameters (context, width, blocks,
  feed-forward, heads, KV heads, RoPE base and dimension, RMSNorm epsilon, vocab size), ``general.file_type``.
* tokenizer: ``tokenizer.ggml.model = gpt2`` (byte-level BPE), ``tokenizer.ggml.pre`` = the llama.cpp
  pre-tokenizer whose regex is lmforge's split pattern (:data:`PRE_TOKENIZERS`; other patterns are refused),
  the tokens in id order (ordinary tokens in GPT-2's byte-to-unicode spelling, special tokens as their text,
  typed NORMAL / CONTROL, padding rows UNUSED), the merges, and the bos/eos/eot ids (chat runs: eot is
  ``<|assistant_end|>``, and the chat template rides along as ``tokenizer.chat_template``). The BOS is the
  end-of-text token and ``tokenizer.ggml.add_bos_token`` is true: llama.cpp starts every tokenized text with
  it, as lmforge's evals condition every context on it and the HF export's tokenizer adds it (a chat prompt,
  whose template already starts with it, gets it once).
* tensors under llama.cpp's names (:data:`TENSOR_NAMES`), in float32 (``f32``), float16 (``f16``), 8-bit
  blocks (``q8_0``) or 4-bit blocks (``q4_0``: a float16 scale per 32 values, the rounding of lmforge's int4
  decoder, :func:`lmforge.generate.packed.quantize_q4_0`); norms stay float32 as llama.cpp's converter keeps
  them. A matrix whose rows are not a multiple of 32 long is written as float16 under ``q8_0`` (llama.cpp's
  converter does the same) and refused under ``q4_0`` (a 4-bit file with 16-bit matrices would not be what
  was asked for). numpy's ``(rows, cols)`` becomes
  ggml's ``ne = [cols, rows]`` (the reader reports shapes reversed).

The q/k layout: llama.cpp's ``llama`` architecture applies RoPE to *adjacent* pairs ``(2i, 2i+1)`` of each head
(``LLAMA_ROPE_TYPE_NORM``). HF checkpoints rotate halves ``(i, i + D/2)``, so llama.cpp's
``convert_hf_to_gguf.py`` permutes HF's q/k rows back to interleaved pairs (``LlamaModel.permute``). lmforge's
model rotates adjacent pairs natively (:mod:`lmforge.interop.hf` explains the difference), so its q/k weights
go into the file exactly as they are: no permutation here, and applying the HF one would break the model.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from lmforge.common import atomic_path, check_apart, check_output_path
from lmforge.interop.hf_tokenizer import chat_template, has_chat_tokens, stop_token_ids
from lmforge.interop.source import ExportSource, open_export_source
from lmforge.run import source_dirs
from lmforge.tokenizer import EOT
from lmforge.tokenizer.reference import PATTERNS, bytes_to_unicode, resolve_pattern

__all__ = ["export_gguf", "gguf_tensors", "gguf_pre_tokenizer", "GGUF_DTYPES", "LLAMA3_REGEX", "PRE_TOKENIZERS",
           "TENSOR_NAMES"]

logger = logging.getLogger("lmforge")

GGUF_DTYPES = ("f32", "f16", "q8_0", "q4_0")
"""Weight types ``export_gguf`` writes (norm vectors are always float32)."""

PRE_TOKENIZERS: dict[str, str] = {"gpt2": "gpt-2", "gpt4": "llama-bpe", "cl100k": "llama-bpe"}
"""lmforge pattern name -> llama.cpp ``tokenizer.ggml.pre``. ``gpt-2`` is GPT-2's regex (lmforge's ``gpt2``);
``llama-bpe`` is Llama 3's, which splits text exactly as cl100k's (lmforge's ``gpt4``): it differs only in
possessive quantifiers and ``\\s*[\\r\\n]+`` for ``\\s*[\\r\\n]``, neither of which changes a match. No llama.cpp
pre-tokenizer splits digits in groups of two (``nanochat``), and a custom regex has no name there (except Llama
3's own, :data:`LLAMA3_REGEX`)."""

LLAMA3_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
"""Llama 3's split regex as its ``tokenizer.json`` spells it (a run imported from a Llama 3 checkpoint carries
it as a custom pattern): llama.cpp's ``llama-bpe``."""

# Our name -> llama.cpp's (``{i}``: the block). ``lm_head`` is absent with tied embeddings: llama.cpp then
# reads the output projection from ``token_embd``.
TENSOR_NAMES: dict[str, str] = {
    "token_embeddings.weight": "token_embd.weight",
    "layers.{i}.ln1.weight": "blk.{i}.attn_norm.weight",
    "layers.{i}.attn.q_proj.weight": "blk.{i}.attn_q.weight",
    "layers.{i}.attn.k_proj.weight": "blk.{i}.attn_k.weight",
    "layers.{i}.attn.v_proj.weight": "blk.{i}.attn_v.weight",
    "layers.{i}.attn.output_proj.weight": "blk.{i}.attn_output.weight",
    "layers.{i}.ln2.weight": "blk.{i}.ffn_norm.weight",
    "layers.{i}.ffn.w1.weight": "blk.{i}.ffn_gate.weight",
    "layers.{i}.ffn.w3.weight": "blk.{i}.ffn_up.weight",
    "layers.{i}.ffn.w2.weight": "blk.{i}.ffn_down.weight",
    "ln_final.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_pre_tokenizer(pattern: str) -> str:
    """llama.cpp's ``tokenizer.ggml.pre`` for an lmforge split ``pattern`` (``ValueError`` if it has none)."""
    regex = resolve_pattern(pattern)
    if regex == LLAMA3_REGEX:
        return "llama-bpe"
    for name, rx in PATTERNS.items():
        if rx == regex and name in PRE_TOKENIZERS:
            return PRE_TOKENIZERS[name]
    shown = pattern if pattern in PATTERNS else f"custom regex {pattern!r:.60}"
    raise ValueError(f"the tokenizer's split pattern ({shown}) has no llama.cpp pre-tokenizer, so llama.cpp would "
                     f"tokenize text differently; GGUF export supports the patterns {', '.join(PRE_TOKENIZERS)} "
                     "(HF export carries any pattern)")


def gguf_tensors(src: ExportSource) -> list[tuple[str, np.ndarray]]:
    """``(llama.cpp name, float32 array in our (rows, cols) layout)`` for every tensor, in llama.cpp's order."""
    out = []
    names = [("token_embeddings.weight", None)]
    names += [(ours, i) for i in range(src.cfg.n_layers) for ours in TENSOR_NAMES if "{i}" in ours]
    names += [("ln_final.weight", None)] + ([] if src.cfg.tie_embeddings else [("lm_head.weight", None)])
    for ours, i in names:
        theirs = TENSOR_NAMES[ours]
        if i is not None:
            ours, theirs = ours.format(i=i), theirs.format(i=i)
        out.append((theirs, src.state[ours].numpy()))  # q/k as they are: see the module docstring
    return out


def _vocab(src: ExportSource) -> tuple[list[str], list[int], list[str]]:
    """Tokens (id order, padded to the model's vocab), their llama.cpp token types, and the merges."""
    from gguf import TokenType  # here: an optional dependency (the export extra)

    tok = src.tokenizer
    enc = bytes_to_unicode()
    spell = lambda b: "".join(enc[x] for x in b)  # noqa: E731  GPT-2's byte-to-unicode spelling
    special_ids = {i: s for s, i in tok.special_tokens.items()}
    tokens, types = [], []
    for i in range(tok.vocab_size):
        if i in special_ids:
            tokens.append(special_ids[i])
            types.append(int(TokenType.CONTROL))
        else:
            tokens.append(spell(tok.vocab[i]))
            types.append(int(TokenType.NORMAL))
    for i in range(tok.vocab_size, src.cfg.vocab_size):  # the model's rows beyond the tokenizer: never produced
        tokens.append(f"[PAD{i}]")
        types.append(int(TokenType.UNUSED))
    merges = [f"{spell(a)} {spell(b)}" for a, b in tok.merges]
    return tokens, types, merges


def _add_tensor(writer: Any, name: str, w: np.ndarray, dtype: str) -> None:
    from gguf import GGMLQuantizationType, quants  # here: an optional dependency (the export extra)

    if w.ndim == 1 or dtype == "f32":
        writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))
    elif dtype == "f16" or w.shape[-1] % 32:  # q8_0 packs rows in blocks of 32; llama.cpp's fallback is f16
        writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float16))  # (q4_0 refused such rows before)
    else:
        qtype = GGMLQuantizationType.Q8_0 if dtype == "q8_0" else GGMLQuantizationType.Q4_0
        q = quants.quantize(np.ascontiguousarray(w, dtype=np.float32), qtype)
        writer.add_tensor(name, q, raw_dtype=qtype)


def check_blocks(src: ExportSource, dtype: str) -> None:
    """``ValueError`` naming the first matrix whose rows do not split into q4_0's blocks of 32."""
    if dtype != "q4_0":
        return
    for name, w in gguf_tensors(src):
        if w.ndim == 2 and w.shape[1] % 32:
            raise ValueError(f"q4_0 stores each row in blocks of 32 values, but {name} is {w.shape[0]} x {w.shape[1]} "
                             f"(rows of {w.shape[1]}); export this model with --dtype q8_0 (which writes such "
                             "matrices as f16) or f16, or train it with sizes that are multiples of 32")


def _write(src: ExportSource, path: str, dtype: str, name: str) -> None:
    import gguf  # here: an optional dependency (the export extra)

    cfg, tok = src.cfg, src.tokenizer
    writer = gguf.GGUFWriter(path, arch="llama")
    writer.add_name(name)
    writer.add_context_length(cfg.context_length)
    writer.add_embedding_length(cfg.d_model)
    writer.add_block_count(cfg.n_layers)
    writer.add_feed_forward_length(cfg.d_ff)
    writer.add_head_count(cfg.n_heads)
    writer.add_head_count_kv(cfg.n_kv_heads)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(float(cfg.rope_theta))
    writer.add_layer_norm_rms_eps(float(cfg.norm_eps))
    writer.add_vocab_size(cfg.vocab_size)
    file_type = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                 "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[dtype]
    writer.add_file_type(int(file_type))
    if dtype in ("q8_0", "q4_0"):
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)

    tokens, types, merges = _vocab(src)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(gguf_pre_tokenizer(tok.pattern))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    eot = tok.special_tokens.get(EOT)
    stops = stop_token_ids(tok)
    if eot is not None:
        writer.add_bos_token_id(eot)
        writer.add_eos_token_id(eot)
    if stops:
        writer.add_eot_token_id(stops[-1])
    writer.add_add_bos_token(eot is not None)  # llama.cpp starts a text with EOT, as HF export and lmforge's evals do
    writer.add_add_eos_token(False)
    if has_chat_tokens(tok):
        writer.add_chat_template(chat_template())

    for tname, w in gguf_tensors(src):
        _add_tensor(writer, tname, w, dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def export_gguf(run_dir: str | os.PathLike, out: str | os.PathLike, dtype: str = "f32",
                checkpoint: str | os.PathLike | None = None, force: bool = False) -> Path:
    """Write a run's checkpoint as the GGUF file ``out`` (see the module docstring); returns its path.

    ``dtype``: ``f32``, ``f16``, ``q8_0`` or ``q4_0`` (matrices; norms stay f32). ``ValueError`` before anything
    is written for an unknown dtype, an existing ``out`` without ``force``, a missing run or checkpoint, a model
    option Llama cannot express, a split pattern llama.cpp has no pre-tokenizer for, or (``q4_0``) a matrix
    whose rows are not a multiple of 32 long.
    """
    if dtype not in GGUF_DTYPES:
        raise ValueError(f"GGUF dtype {dtype!r} is not supported; use one of {', '.join(GGUF_DTYPES)}")
    import importlib.util

    if importlib.util.find_spec("gguf") is None:
        raise ValueError("GGUF export needs the gguf package: pip install 'lmforge[export]' (or pip install gguf)")
    check_apart(out, *source_dirs(run_dir))
    p = check_output_path(out, force)
    src = open_export_source(run_dir, checkpoint)
    gguf_pre_tokenizer(src.tokenizer.pattern)  # refuse before writing
    check_blocks(src, dtype)
    with atomic_path(p) as tmp:  # GGUFWriter opens the file itself; renamed over ``out`` only on success
        _write(src, str(tmp), dtype, name=src.run.path.resolve().name)
    logger.info("exported %s (step %d) to %s (%s)", src.run.checkpoint_path, src.step, p, dtype)
    return p
