"""``lmforge export hf|gguf`` and ``lmforge import hf``: runs to and from Hugging Face and llama.cpp.

Two command groups share this module: :data:`EXPORT` (``export hf``, ``export gguf``) and :data:`IMPORT`
(``import hf``); the CLI table names them as ``lmforge.cli.interop:EXPORT`` / ``:IMPORT``.
"""

from __future__ import annotations

import argparse
import re

from lmforge.cli import Command


def _size(text: str) -> int:
    """argparse type: a byte count such as ``2000000``, ``500MB``, ``5GB`` or ``1GiB``."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"expected a size such as 500MB or 5GB, got {text!r}")
    unit = (m.group(2) or "").upper().rstrip("B")
    scale = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
             "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}[unit]
    value = int(float(m.group(1)) * scale)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive size, got {text!r}")
    return value


def _source_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run", required=True, help="run directory to export (config.yaml, tokenizer.json, checkpoints/)")
    p.add_argument("--checkpoint", default=None,
                   help="checkpoint file to export, or 'best' (default: the newest valid one in the run)")
    p.add_argument("--force", action="store_true", help="replace the output if it exists")


def _export_hf_args(p: argparse.ArgumentParser) -> None:
    _source_args(p)
    p.add_argument("--out", required=True, help="output folder (must not exist or be empty unless --force)")
    p.add_argument("--max-shard-size", type=_size, default="5GB",
                   help="largest weights file before the export is sharded with an index (default 5GB)")


def _export_hf(args: argparse.Namespace) -> int:
    from lmforge.interop.hf_export import export_hf  # here: loads torch

    out = export_hf(args.run, args.out, checkpoint=args.checkpoint, force=args.force,
                    max_shard_size=args.max_shard_size)
    print(f"wrote {out} (load it with transformers.AutoModelForCausalLM.from_pretrained({str(out)!r}))")
    return 0


def _export_gguf_args(p: argparse.ArgumentParser) -> None:
    _source_args(p)
    p.add_argument("--out", required=True, help="output .gguf file (refused if it exists, unless --force)")
    p.add_argument("--dtype", default="f32",
                   help="weight type: f32 (exact), f16, q8_0 (8-bit blocks) or q4_0 (4-bit blocks, the rounding of "
                        "lmforge's int4 decoder); norms stay f32 (default f32)")


def _export_gguf(args: argparse.Namespace) -> int:
    from lmforge.interop.gguf import export_gguf  # here: loads torch and gguf

    out = export_gguf(args.run, args.out, dtype=args.dtype, checkpoint=args.checkpoint, force=args.force)
    print(f"wrote {out} ({args.dtype}; run it with llama.cpp: llama-cli -m {out})")
    return 0


def _import_hf_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help="local HF Llama checkpoint folder (config.json, tokenizer.json, model.safetensors)")
    p.add_argument("--out", required=True, help="run directory to create (must not exist or be empty unless --force)")
    p.add_argument("--force", action="store_true", help="write into --out even if it is not empty")


def _import_hf(args: argparse.Namespace) -> int:
    from lmforge.interop.hf_import import import_hf  # here: loads torch

    out = import_hf(args.model, args.out, force=args.force)
    print(f"wrote run {out} (try: lmforge generate --run {out} --prompt 'Hello')")
    return 0


EXPORT: list[Command] = [
    ("hf", "write a run as a Hugging Face LlamaForCausalLM folder (safetensors, tokenizer, chat template)",
     _export_hf_args, _export_hf),
    ("gguf", "write a run as one GGUF file for llama.cpp (f32, f16, q8_0 or q4_0)", _export_gguf_args, _export_gguf),
]
IMPORT: list[Command] = [
    ("hf", "turn a local Hugging Face Llama checkpoint folder into an lmforge run", _import_hf_args, _import_hf),
]
