"""Generation speed: lmforge's cached decoder vs Hugging Face ``LlamaForCausalLM.generate``, same weights.

Both models get identical random weights (HF init, mapped into ours with ``lmforge.interop.hf``); the script first
checks that their logits agree, then times greedy decoding of N new tokens at batch 1 and batch 8 (CPU
unless --device says otherwise). Prompt: 16 random tokens.

HF runs in every configuration that may be its fastest, each a row: fp32 with its default dynamic cache,
fp32 with a static cache (``cache_implementation="static"``), fp32 static cache with ``torch.compile`` on
its forward (skipped, with the reason printed, if compiling fails or exceeds ``--compile-budget`` seconds;
``--quick`` skips it), bf16 weights (dynamic cache, and static + compile) and, on CPU, PyTorch's dynamic int8
quantization of every linear layer (``torch.ao.quantization.quantize_dynamic``: int8 weights, activations
quantized per call). The fp32 configurations must produce the same tokens as HF's default (else the script
exits); the others print how many of their tokens agree. lmforge runs in fp32 (the same weights: it must
produce HF's tokens) and, on CPU, with its decoder's weights stored as bf16, fp16 and int8 (rounded weights:
faster, not the same model; the script prints how far their logits move). All rows alternate (one run each
per round, ``--repeats`` rounds after a warm-up run each); each is reported by its median tokens/s and range.
Every lmforge row is set against the fastest HF row overall and against the fastest HF row that stores its
weights at the same precision (fp32; 16-bit; int8): like for like.

It also prints a floor: the same weight matrices multiplied in a chain with nothing else (no attention,
norms or sampling), at 1 and at 8 rows, with MKL in fp32 and with lmforge's decode kernel in each storage
dtype, plus the machine's memory read bandwidth. At batch 1 the chain is bound by reading the weights.

After each table, every lmforge row is set against the machine's limits: ms per decode step, the weight bytes
it reads per step divided by the step time (GB/s, and that as a share of the measured read bandwidth: near 100%
the row is bandwidth bound, far below it is dispatch bound -- Python, kernel launches, attention) and the
GFLOP/s of its weight products (2 FLOPs per weight per row).

    python benchmarks/bench_generate.py                 # d_model 512, 4 layers, 16 heads, vocab 10k, 256 new tokens
    python benchmarks/bench_generate.py --shape gpt2s   # near GPT-2 small: d 768, 12 layers, 12 heads, vocab 32k
    python benchmarks/bench_generate.py --quick         # smaller and shorter, a smoke run
"""

from __future__ import annotations

import argparse
import copy
import os
import signal
import sys
import time
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import alternate, hf_twins, median, read_bandwidth  # noqa: E402

# --shape presets: (vocab, context, d_model, layers, heads, d_ff)
SHAPES = {"d512": (10_000, 512, 512, 4, 16, 1344), "gpt2s": (32_000, 512, 768, 12, 12, 2048)}


def build_models(args: argparse.Namespace):
    """(config, ours, HF) with the same weights, both in eval mode on ``args.device``."""
    from lmforge.model import ModelConfig

    cfg = ModelConfig(vocab_size=args.vocab, context_length=args.context, d_model=args.d_model,
                      n_layers=args.layers, n_heads=args.heads, d_ff=args.d_ff)
    ours, ref = hf_twins(cfg, args.device)
    return cfg, ours, ref


class _Timeout(Exception):
    """Raised by :func:`within` when its time budget runs out."""


def within(seconds: float, fn: Callable[[], object]) -> object:
    """``fn()``, or :class:`_Timeout` if it runs longer than ``seconds`` (SIGALRM; main thread, Unix)."""
    def on_alarm(signum, frame):
        raise _Timeout(f"over the {seconds:.0f} s budget")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def hf_configs(ref, args: argparse.Namespace) -> dict[str, tuple[object, dict]]:
    """HF's candidate configurations: name -> (model, extra ``generate`` kwargs)."""
    configs: dict[str, tuple[object, dict]] = {"HF fp32": (ref, {}),
                                               "HF fp32 static": (ref, {"cache_implementation": "static"})}
    if args.compile:
        compiled = copy.deepcopy(ref)
        compiled.forward = torch.compile(compiled.forward, fullgraph=True)
        configs["HF fp32 static+compile"] = (compiled, {"cache_implementation": "static"})
    bf16 = copy.deepcopy(ref).to(torch.bfloat16)
    configs["HF bf16"] = (bf16, {})
    if args.compile:
        compiled = copy.deepcopy(bf16)
        compiled.forward = torch.compile(compiled.forward, fullgraph=True)
        configs["HF bf16 static+compile"] = (compiled, {"cache_implementation": "static"})
    if args.device == "cpu":  # PyTorch's int8 for CPU inference: int8 weights, activations quantized per call
        configs["HF int8 dynamic"] = (torch.ao.quantization.quantize_dynamic(
            copy.deepcopy(ref), {torch.nn.Linear}, dtype=torch.qint8), {})
    return configs


def precision(row: str) -> str:
    """The weight precision a row's name states: fp32, 16-bit (bf16, fp16) or int8."""
    return "int8" if "int8" in row else "16-bit" if ("bf16" in row or "fp16" in row) else "fp32"


def _chain_shapes(cfg) -> list[tuple[int, int]]:
    """(out, in) of one decode step's weight products: per layer q|k|v, output, w1|w3, w2; then the LM head."""
    C, H, F, V = cfg.d_model, cfg.n_heads, cfg.d_ff, cfg.vocab_size
    kv = (cfg.n_kv_heads or H) * (C // H)
    return [(C + 2 * kv, C), (C, C), (2 * F, C), (C, F)] * cfg.n_layers + [(V, C)]


def weight_chain(cfg, rows: int, dtype: torch.dtype | None, repeats: int = 30) -> float:
    """Best seconds for one decode step's weight products alone, at ``rows`` rows.

    ``dtype=None``: PyTorch (MKL) in float32, the faster of ``x @ W`` (``W`` stored ``(in, out)``) and
    ``W @ x.T``; else lmforge's decode kernel on weights stored in ``dtype``.
    """
    from lmforge.generate.engine import PackedLinear

    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(o, i, generator=g) for o, i in _chain_shapes(cfg)]
    xs = [torch.randn(rows, i, generator=g) for _, i in _chain_shapes(cfg)]
    if dtype is None:
        wts = [w.t().contiguous() for w in ws]
        chains = [lambda: [x @ w for x, w in zip(xs, wts)], lambda: [w @ x.t() for x, w in zip(xs, ws)]]
    else:
        packed = [PackedLinear(w, dtype) for w in ws]
        chains = [lambda: [p(x) for x, p in zip(xs, packed)]]
    best = float("inf")
    with torch.inference_mode():
        for chain in chains:
            chain()
            for _ in range(repeats):
                t0 = time.perf_counter()
                chain()
                best = min(best, time.perf_counter() - t0)
    return best


def print_floor(cfg) -> float:
    """Memory bandwidth and the weight-product chain at 1 and 8 rows (see the module docstring); returns the bandwidth."""
    mb = 4 * sum(o * i for o, i in _chain_shapes(cfg)) / 1e6
    bw = read_bandwidth()
    print(f"floor: memory read bandwidth {bw / 1e9:.1f} GB/s; one step reads {mb:.0f} MB of fp32 "
          f"weights ({mb / 2:.0f} MB in bf16/fp16, {mb / 4:.0f} MB in int8)")
    for rows in (1, 8):
        parts = [f"MKL fp32 {weight_chain(cfg, rows, None) * 1e3:.2f}"]
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16),
                            ("int8", torch.int8)):
            parts.append(f"lmforge {name} {weight_chain(cfg, rows, dtype) * 1e3:.2f}")
        print(f"floor: weight products alone at {rows} row(s), ms/step: " + ", ".join(parts))
    return bw


WEIGHT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1}


def print_limits(cfg, batch: int, n: int, times: dict[str, list[float]], bandwidth: float | None) -> None:
    """Each lmforge row against the machine: ms/step, weight GB/s (share of read bandwidth), GFLOP/s."""
    weights = sum(o * i for o, i in _chain_shapes(cfg))
    for name, t in times.items():
        if not name.startswith("lmforge "):
            continue
        step = median(t) / n  # seconds per decode step (the prompt's prefill is a small share of the run)
        gbs = weights * WEIGHT_BYTES[name.split()[1]] / step / 1e9
        share = f" = {100 * gbs * 1e9 / bandwidth:.0f}% of the read bandwidth" if bandwidth else ""
        print(f"{name}: {step * 1e3:.2f} ms/step; weights read at {gbs:.1f} GB/s{share}; "
              f"weight products {2 * weights * batch / step / 1e9:.1f} GFLOP/s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small model, 32 new tokens, 2 rounds, no torch.compile")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--repeats", type=int, default=5, help="timed rounds (every row once per round)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="skip the HF torch.compile row")
    p.add_argument("--compile-budget", type=float, default=300.0,
                   help="seconds the first (compiling) HF static+compile run may take before the row is skipped")
    p.add_argument("--shape", choices=sorted(SHAPES), default="d512",
                   help="d512: d_model 512, 4 layers, vocab 10k (default); gpt2s: near GPT-2 small")
    args = p.parse_args()
    args.vocab, args.context, args.d_model, args.layers, args.heads, args.d_ff = SHAPES[args.shape]
    if args.quick:
        args.d_model, args.layers, args.heads, args.d_ff, args.new_tokens, args.repeats = 256, 2, 8, 672, 32, 2
        if args.compile:
            print("--quick: HF static+compile row skipped (compiling takes minutes on a CPU); run without --quick")
            args.compile = False
    if args.threads:
        torch.set_num_threads(args.threads)

    from lmforge.generate.engine import kernel_available
    from lmforge.generate import Generator

    cfg, ours, ref = build_models(args)
    variants = [("fp32", None)]
    if args.device == "cpu" and kernel_available():
        variants += [("bf16", torch.bfloat16), ("fp16", torch.float16), ("int8", torch.int8)]
    gens = {name: Generator(ours, weight_dtype=dtype) for name, dtype in variants}
    prompt_len, n = 16, args.new_tokens
    print(f"model: d_model {cfg.d_model}, {cfg.n_layers} layers, {cfg.n_heads} heads, d_ff {cfg.d_ff}, "
          f"vocab {cfg.vocab_size}; prompt {prompt_len} tokens, {n} new tokens, greedy, {args.device}, "
          f"{torch.get_num_threads()} threads; {args.repeats} alternating rounds, median tok/s (range)")
    if args.device == "cpu" and kernel_available():
        from lmforge._native import core
        print(f"lmforge decode kernels: {core().linear_isa()}")
    bandwidth = print_floor(cfg) if args.device == "cpu" else None
    probe = torch.randint(0, cfg.vocab_size, (2, 64)).tolist()
    with torch.inference_mode():
        exact = gens["fp32"].engine.prefill(probe, 64)
        for name, _ in variants[1:]:
            diff = (gens[name].engine.prefill(probe, 64) - exact).abs().max().item()
            print(f"lmforge with {name} weights: max |logit - fp32 logit| = {diff:.1e} (its tokens may differ from "
                  f"fp32's at near-ties; not the same weights)")
    configs = hf_configs(ref, args)
    for batch in args.batch:
        print(f"\n### batch {batch}\n")
        prompt = torch.randint(0, cfg.vocab_size, (batch, prompt_len), device=args.device)

        def hf_run(model, extra: dict) -> Callable[[], list]:
            def run() -> list:
                with torch.inference_mode():
                    out = model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, **extra)
                return out[:, prompt_len:].tolist()
            return run

        fns: dict[str, Callable[[], object]] = {}
        hf_tokens = hf_run(ref, {})()  # HF's default: the reference every fp32 row must reproduce
        for name, (model, extra) in configs.items():
            run = hf_run(model, extra)
            try:  # the first run is the warm-up (and, for the compiled row, the compile)
                t0 = time.perf_counter()
                toks = within(args.compile_budget, run) if "compile" in name else run()
                first = time.perf_counter() - t0
            except Exception as e:  # noqa: BLE001  (a failed compile skips its row, loudly)
                print(f"{name}: skipped -- {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
                continue
            if "fp32" in name and toks != hf_tokens:
                raise SystemExit(f"{name} produced different tokens from HF's default generate: not the same work")
            if "compile" in name:
                print(f"{name}: first run (compiling) took {first:.1f} s; not part of the timing")
            if "fp32" not in name:
                agree = sum(a == b for ra, rb in zip(toks, hf_tokens) for a, b in zip(ra, rb))
                print(f"{name}: {agree}/{batch * n} tokens equal to HF fp32's (rounded weights: not the same model)")
            fns[name] = run
        for name, _ in variants:
            gen = gens[name]
            fns[f"lmforge {name}"] = (lambda g: lambda: g.generate_ids(prompt.tolist(), n, temperature=0,
                                                                       stop_ids=[]))(gen)
        same = fns["lmforge fp32"]() == hf_tokens  # also the warm-up of the lmforge rows
        for name, _ in variants[1:]:
            fns[f"lmforge {name}"]()
        times = alternate(fns, args.repeats, warmup=0)
        hf_names = [k for k in fns if k.startswith("HF")]
        fastest = min(hf_names, key=lambda k: median(times[k]))
        # like for like: the fastest HF row storing its weights at the same precision as the row
        peer = {prec: min((k for k in hf_names if precision(k) == prec), key=lambda k: median(times[k]), default=None)
                for prec in ("fp32", "16-bit", "int8")}
        print(f"| row | tok/s (median) | tok/s range | vs fastest HF ({fastest}) | vs fastest HF at its precision |")
        print("|---|---:|---:|---:|---:|")
        for name, t in times.items():
            same_prec = peer[precision(name)]
            like = (f"{median(times[same_prec]) / median(t):.2f}x ({same_prec})"
                    if same_prec and not name.startswith("HF") else "")
            print(f"| {name} | {batch * n / median(t):,.0f} | {batch * n / max(t):,.0f}..{batch * n / min(t):,.0f} "
                  f"| {median(times[fastest]) / median(t):.2f}x | {like} |")
        print(f"lmforge fp32 produced HF's tokens: {same}")
        print_limits(cfg, batch, n, times, bandwidth)


if __name__ == "__main__":
    main()
