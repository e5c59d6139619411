"""Generation speed: lmforge's cached decoder vs Hugging Face ``LlamaForCausalLM.generate``, same weights.

Both models get identical random weights (HF init, mapped into ours with ``lmforge.interop.hf``); the script first
checks that their logits agree, then times greedy decoding of N new tokens at batch 1 and batch 8 (CPU
unless --device says otherwise) and prints tokens/s and the ratio (best of --repeats runs, the two sides
alternating) and whether both produced the same tokens. Prompt: 16 random tokens. HF runs in fp32 (its
fastest on a CPU without bf16 hardware); lmforge runs in fp32 (the same weights, the same tokens) and, on
CPU, with its decoder's weights stored as bf16, fp16 and int8 (rounded weights: faster, not the same
model; the script prints how far their logits move).

It also prints a floor: the same weight matrices multiplied in a chain with nothing else (no attention,
norms or sampling), at 1 and at 8 rows, with MKL in fp32 and with lmforge's decode kernel in each storage
dtype, plus the machine's memory read bandwidth. At batch 1 the chain is bound by reading the weights.

    python benchmarks/bench_generate.py            # d_model 512, 4 layers, 16 heads, 256 new tokens
    python benchmarks/bench_generate.py --quick    # smaller and shorter, a smoke run
"""

from __future__ import annotations

import argparse
import time

import torch


def build_models(args: argparse.Namespace):
    """(ours, HF) with the same weights, both in eval mode on ``args.device``."""
    from transformers import LlamaForCausalLM

    from lmforge.interop import hf
    from lmforge.model import ModelConfig, TransformerLM

    cfg = ModelConfig(vocab_size=args.vocab, context_length=args.context, d_model=args.d_model,
                      n_layers=args.layers, n_heads=args.heads, d_ff=args.d_ff)
    torch.manual_seed(0)
    ref = LlamaForCausalLM(hf.hf_config(cfg)).eval()
    ref.generation_config.eos_token_id = None
    ref.generation_config.pad_token_id = 0
    ours = TransformerLM(cfg).eval()
    ours.load_state_dict(hf.from_hf_state_dict(ref.state_dict(), cfg))
    ours.to(args.device)
    ref.to(args.device)
    idx = torch.randint(0, cfg.vocab_size, (2, 32), device=args.device)
    with torch.inference_mode():
        diff = (ours(idx) - ref(idx).logits).abs().max().item()
    print(f"max |logits(lmforge) - logits(HF)| = {diff:.2e}")
    assert diff < 1e-3, "weight mapping broken: logits differ"
    return cfg, ours, ref


def timed_pair(fn_a, fn_b, repeats: int) -> tuple[float, float]:
    """Best wall time of ``fn_a()`` and of ``fn_b()``, run alternately ``repeats`` times after one warm-up each.

    Alternating and keeping the minimum makes the ratio robust to other processes on a shared machine:
    both sides see the same background load, and the best run is the one it disturbed least.
    """
    fn_a()
    fn_b()
    best_a = best_b = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn_a()
        best_a = min(best_a, time.perf_counter() - t0)
        t0 = time.perf_counter()
        fn_b()
        best_b = min(best_b, time.perf_counter() - t0)
    return best_a, best_b


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


def read_bandwidth(mb: int = 256, repeats: int = 10) -> float:
    """Memory read bandwidth (bytes/s): best time to sum a float32 tensor much larger than the caches."""
    big = torch.ones(mb * 2**20 // 4)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        big.sum()
        best = min(best, time.perf_counter() - t0)
    return big.numel() * 4 / best


def print_floor(cfg) -> None:
    """Memory bandwidth and the weight-product chain at 1 and 8 rows (see the module docstring)."""
    mb = 4 * sum(o * i for o, i in _chain_shapes(cfg)) / 1e6
    print(f"floor: memory read bandwidth {read_bandwidth() / 1e9:.1f} GB/s; one step reads {mb:.0f} MB of fp32 "
          f"weights ({mb / 2:.0f} MB in bf16/fp16, {mb / 4:.0f} MB in int8)")
    for rows in (1, 8):
        parts = [f"MKL fp32 {weight_chain(cfg, rows, None) * 1e3:.2f}"]
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16),
                            ("int8", torch.int8)):
            parts.append(f"lmforge {name} {weight_chain(cfg, rows, dtype) * 1e3:.2f}")
        print(f"floor: weight products alone at {rows} row(s), ms/step: " + ", ".join(parts))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small model, 64 new tokens, one repeat")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = p.parse_args()
    args.vocab, args.context, args.d_model, args.layers, args.heads, args.d_ff = 10_000, 512, 512, 4, 16, 1344
    if args.quick:
        args.d_model, args.layers, args.heads, args.d_ff, args.new_tokens, args.repeats = 256, 2, 8, 672, 64, 1
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
          f"{torch.get_num_threads()} threads")
    if args.device == "cpu":
        print_floor(cfg)
    probe = torch.randint(0, cfg.vocab_size, (2, 64)).tolist()
    with torch.inference_mode():
        exact = gens["fp32"].decoder.prefill(probe, 64)
        for name, _ in variants[1:]:
            diff = (gens[name].decoder.prefill(probe, 64) - exact).abs().max().item()
            print(f"lmforge with {name} weights: max |logit - fp32 logit| = {diff:.1e} (its tokens may differ from "
                  f"fp32's at near-ties; not the same weights)")
    head = f"{'batch':>5} {'HF fp32 tok/s':>14}" + "".join(f" {'lmforge ' + name:>13} {'ratio':>6}" for name, _ in variants)
    print(head + "  same tokens (fp32)")
    for batch in args.batch:
        prompt = torch.randint(0, cfg.vocab_size, (batch, prompt_len), device=args.device)
        with torch.inference_mode():
            hf_out = ref.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False)[:, prompt_len:]
        same = hf_out.tolist() == gens["fp32"].generate_ids(prompt.tolist(), n, temperature=0, stop_ids=[])

        def run_hf() -> None:
            with torch.inference_mode():
                ref.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False)

        times, t_hf = {}, float("inf")
        for name, _ in variants:
            gen = gens[name]

            def run_ours() -> None:
                gen.generate_ids(prompt.tolist(), n, temperature=0, stop_ids=[])

            t_h, times[name] = timed_pair(run_hf, run_ours, args.repeats)
            t_hf = min(t_hf, t_h)  # HF's best over all its runs in this row
        row = f"{batch:>5} {batch * n / t_hf:>14.0f}"
        row += "".join(f" {batch * n / times[name]:>13.0f} {t_hf / times[name]:>5.2f}x" for name, _ in variants)
        print(f"{row}  {same}")


if __name__ == "__main__":
    main()
