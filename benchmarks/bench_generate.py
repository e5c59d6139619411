"""Generation speed: lmforge's cached decoder vs Hugging Face ``LlamaForCausalLM.generate``, same weights.

Both models get identical random weights (HF init, mapped into ours with ``lmforge.hf``); the script first
checks that their logits agree, then times greedy decoding of N new tokens at batch 1 and batch 8 (fp32,
CPU unless --device says otherwise) and prints tokens/s and the ratio (best of --repeats runs, the two sides
alternating) and whether both produced the same tokens. Prompt: 16 random tokens.

It also prints a floor: the same weight matrices multiplied in a chain with nothing else (no attention,
norms or sampling), at 1 and at 8 rows, in fp32 and in bf16, plus the machine's memory read bandwidth.
A decode step cannot be faster than its fp32 chain; at batch 1 the chain is bound by reading the weights.

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

    from lmforge import hf
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


def weight_chain(cfg, rows: int, dtype: torch.dtype, device: str, repeats: int = 30) -> float:
    """Best seconds for one decode step's weight products alone: per layer q|k|v, output, w1|w3, w2, then the
    LM head; the faster of ``x @ W`` (``W`` stored ``(in, out)``) and ``W @ x.T`` (stored ``(out, in)``)."""
    return min(_chain(cfg, rows, dtype, device, repeats, rows_major) for rows_major in (True, False))


def _chain(cfg, rows: int, dtype: torch.dtype, device: str, repeats: int, rows_major: bool) -> float:
    C, H, F, V = cfg.d_model, cfg.n_heads, cfg.d_ff, cfg.vocab_size
    kv = (cfg.n_kv_heads or H) * (C // H)
    shapes = [(C, C + 2 * kv), (C, C), (C, 2 * F), (F, C)] * cfg.n_layers + [(C, V)]
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(i, o, generator=g).to(device, dtype) for i, o in shapes]
    if not rows_major:
        ws = [w.t().contiguous() for w in ws]
    xs = [torch.randn(rows, i, generator=g).to(device, dtype) for i, _ in shapes]

    def chain() -> None:
        for x, w in zip(xs, ws):
            x @ w if rows_major else w @ x.t()

    with torch.inference_mode():
        chain()
        best = float("inf")
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


def print_floor(cfg, device: str) -> None:
    """Memory bandwidth and the weight-product chain at 1 and 8 rows, fp32 and bf16 (see the module docstring)."""
    C, F, V = cfg.d_model, cfg.d_ff, cfg.vocab_size
    kv = (cfg.n_kv_heads or cfg.n_heads) * (C // cfg.n_heads)
    mb = 4 * (cfg.n_layers * (C * (C + 2 * kv) + C * C + 3 * C * F) + C * V) / 1e6
    if device == "cpu":
        print(f"floor: memory read bandwidth {read_bandwidth() / 1e9:.1f} GB/s; one step reads {mb:.0f} MB of fp32 "
              f"weights")
    for rows in (1, 8):
        t32 = weight_chain(cfg, rows, torch.float32, device)
        t16 = weight_chain(cfg, rows, torch.bfloat16, device)
        print(f"floor: weight products alone at {rows} row(s): fp32 {t32 * 1e3:.2f} ms/step = {rows / t32:.0f} tok/s; "
              f"bf16 {t16 * 1e3:.2f} ms/step = {rows / t16:.0f} tok/s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small model, 64 new tokens, one repeat")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = p.parse_args()
    args.vocab, args.context, args.d_model, args.layers, args.heads, args.d_ff = 10_000, 512, 512, 4, 16, 1344
    if args.quick:
        args.d_model, args.layers, args.heads, args.d_ff, args.new_tokens, args.repeats = 256, 2, 8, 672, 64, 1
    if args.threads:
        torch.set_num_threads(args.threads)

    from lmforge.generate import Generator

    cfg, ours, ref = build_models(args)
    gen = Generator(ours)
    prompt_len, n = 16, args.new_tokens
    print(f"model: d_model {cfg.d_model}, {cfg.n_layers} layers, {cfg.n_heads} heads, d_ff {cfg.d_ff}, "
          f"vocab {cfg.vocab_size}; prompt {prompt_len} tokens, {n} new tokens, greedy, {args.device}, "
          f"{torch.get_num_threads()} threads")
    print_floor(cfg, args.device)
    print(f"{'batch':>5} {'HF tok/s':>10} {'lmforge tok/s':>14} {'ratio':>6}  same tokens")
    for batch in args.batch:
        prompt = torch.randint(0, cfg.vocab_size, (batch, prompt_len), device=args.device)
        with torch.inference_mode():
            hf_out = ref.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False)[:, prompt_len:]
        ours_out = gen.generate_ids(prompt.tolist(), n, temperature=0, stop_ids=[])
        same = hf_out.tolist() == ours_out

        def run_hf() -> None:
            with torch.inference_mode():
                ref.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False)

        def run_ours() -> None:
            gen.generate_ids(prompt.tolist(), n, temperature=0, stop_ids=[])

        t_hf, t_ours = timed_pair(run_hf, run_ours, args.repeats)
        tps_hf, tps_ours = batch * n / t_hf, batch * n / t_ours
        print(f"{batch:>5} {tps_hf:>10.0f} {tps_ours:>14.0f} {tps_ours / tps_hf:>5.2f}x  {same}")


if __name__ == "__main__":
    main()
