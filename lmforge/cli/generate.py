"""``lmforge generate``: continue prompts with a trained run's model (KV cache, sampling, streaming)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lmforge.cli import AddArgs, CLIError, Handler, positive_int
from lmforge.common import check_input_file
from lmforge.generate import Generator, check_sampling
from lmforge.generate.sampling import check_seed


def _generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run", default=None, help="run directory (config.yaml, tokenizer.json, checkpoints/)")
    p.add_argument("--checkpoint", default=None,
                   help="checkpoint file to load, or 'best' (default: the newest valid one in the run directory)")
    p.add_argument("--prompt", action="append", default=[], help="text to continue (repeatable: one output each)")
    p.add_argument("--prompt-file", default=None, help="read one prompt from this UTF-8 file")
    p.add_argument("--max-new-tokens", type=positive_int, default=200,
                   help="tokens to generate per prompt (default 200); past the model's context length generation "
                        "goes on: the oldest quarter of the context is dropped and the rest re-read")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy; higher = more random (default 0.8)")
    p.add_argument("--top-k", type=positive_int, default=None, help="sample only from the k most likely tokens")
    p.add_argument("--top-p", type=float, default=None,
                   help="sample only from the smallest set of tokens with total probability >= p, in (0, 1]")
    p.add_argument("--seed", type=int, default=None,
                   help="random seed, an integer in [-2**63, 2**63 - 1] (same seed, same output)")
    p.add_argument("--stop", action="append", default=[], help="stop at this string, not printed (repeatable)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps (default auto)")
    p.add_argument("--weight-dtype", default=None,
                   choices=["float32", "bfloat16", "float16", "fp32", "bf16", "fp16", "int8", "int4"],
                   help="CPU only: store the decoder's weights in 16 bits (bf16/fp16: half the bytes read per token), "
                        "as int8 with a scale per row (a quarter) or int4 with a scale per 32 weights (llama.cpp's "
                        "Q4_0 rounding), faster; outputs then follow the rounded weights (default: the model's "
                        "float32, exact)")
    p.add_argument("--activations", default=None, choices=["float32", "int8"],
                   help="with int8/int4 weights: int8 (their default) rounds each product's input to 8 bits per 32 "
                        "values and multiplies in integers, as llama.cpp does (faster); float32 multiplies the "
                        "rounded weights exactly")
    p.add_argument("--no-stream", action="store_true", help="print each result when done (batches several prompts)")
    p.add_argument("--no-draft", action="store_true", help="decode one token per pass: no prompt-lookup drafts "
                   "(a streamed prompt drafts by default; drafting gives the same tokens in fewer passes)")


def _prompts(args: argparse.Namespace) -> list[str]:
    """The prompts of ``--prompt`` and ``--prompt-file``, refusing none and empty ones."""
    prompts = list(args.prompt)
    if args.prompt_file:
        prompts.append(check_input_file(args.prompt_file).read_text(encoding="utf-8"))
    if not prompts:
        raise CLIError("no prompt given; pass --prompt TEXT (repeatable) or --prompt-file FILE")
    if any(not p for p in prompts):
        raise CLIError("a prompt is empty; give some text to continue (a file given to --prompt-file must not be empty)")
    return prompts


def _run_dir(args: argparse.Namespace) -> str | Path:
    """``--run``, or the run directory holding ``--checkpoint`` (its ``checkpoints/`` parent)."""
    if args.run is not None:
        return args.run
    if args.checkpoint is None:
        raise CLIError("give --run DIR (a training run directory), or --checkpoint FILE inside one")
    ckpt_dir = Path(args.checkpoint).resolve().parent
    return ckpt_dir.parent if ckpt_dir.name == "checkpoints" else ckpt_dir


def _generate(args: argparse.Namespace) -> int:
    check_sampling(args.temperature, args.top_k, args.top_p)  # before loading or printing anything
    check_seed(args.seed)
    prompts = _prompts(args)
    gen = Generator.from_run(_run_dir(args), args.checkpoint, device=args.device, weight_dtype=args.weight_dtype,
                               activations=args.activations)
    gen.speculative = not args.no_draft
    opts = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                top_p=args.top_p, seed=args.seed, stop=args.stop)
    if args.no_stream:
        outputs = gen.generate(prompts, **opts)
        for i, (prompt, out) in enumerate(zip(prompts, outputs)):
            if len(prompts) > 1:
                print(f"=== sample {i + 1} ===")
            print(prompt + out)
        return 0
    for i, prompt in enumerate(prompts):
        stream = iter(gen.generate(prompt, **opts, stream=True))
        first = next(stream, "")  # the prompt is checked (length, emptiness) before anything is printed
        if len(prompts) > 1:
            print(f"=== sample {i + 1} ===")
        sys.stdout.write(prompt + first)
        sys.stdout.flush()
        for piece in stream:
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
    return 0


COMMANDS: dict[str, tuple[AddArgs, Handler]] = {"generate": (_generate_args, _generate)}
