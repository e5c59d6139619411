"""Training speed and memory: lmforge's TransformerLM + AdamW vs Hugging Face ``LlamaForCausalLM`` +
``torch.optim.AdamW``, same shapes, random init, side by side in one run.

Each (implementation, round) runs in its own child process, so peak RSS is that model's alone and the
two never compete for the cores. Rounds alternate (lmforge, HF, lmforge, HF, ...) and the best round of
each is kept, which is the fairest reading on a shared machine. The 4096² matmul peak is measured first
and MFU = tokens/s · FLOPs/token / peak, FLOPs/token = 6·N + 12·L·d·T for both.

    python benchmarks/bench_train_step.py            # d_model 512, 4 layers, 16 heads, d_ff 1344, T 256, B 8, V 10k
    python benchmarks/bench_train_step.py --quick    # one round, few steps: a smoke run
    python benchmarks/bench_train_step.py --dtype bf16 --compile
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time


def _rss_mb() -> float:
    """Current resident set size in MiB (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _build(impl: str, a: argparse.Namespace):
    """(model, optimizer, step function) for ``impl``; the step does forward, backward, update."""
    import torch

    if impl == "lmforge":
        from lmforge.model import ModelConfig, TransformerLM
        from lmforge.optim import AdamW, param_groups_for

        cfg = ModelConfig(vocab_size=a.vocab, context_length=a.context, d_model=a.d_model, n_layers=a.layers,
                          n_heads=a.heads, d_ff=a.d_ff, fast=not a.reference)
        model = TransformerLM(cfg)
        opt = AdamW(param_groups_for(model, 0.1), lr=3e-4, betas=(0.9, 0.95))

        def loss_fn(x, y):
            return model(x, targets=y)
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        hcfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.d_model, intermediate_size=a.d_ff,
                           num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.heads,
                           max_position_embeddings=a.context, rope_theta=10000.0, rms_norm_eps=1e-5,
                           tie_word_embeddings=False, attn_implementation="sdpa")
        model = LlamaForCausalLM(hcfg)
        # torch's defaults: on CPU that is the per-tensor loop; --hf-fused gives HF the fused kernel too
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                                fused=True if a.hf_fused else None)

        def loss_fn(x, y):  # standard HF usage: labels are shifted inside, logits upcast to float32
            return model(input_ids=x, labels=x).loss
    model.train()
    fwd = torch.compile(loss_fn) if a.compile else loss_fn

    def step(x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.dtype == "bf16"):
            loss = fwd(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return model, step


def child(impl: str, a: argparse.Namespace) -> dict:
    """Time ``a.steps`` training steps of ``impl`` after ``a.warmup`` and report speed and memory."""
    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    if impl == "hf":
        import transformers  # noqa: F401  (import cost outside the measured memory)
    torch.manual_seed(0)
    rss_before = _rss_mb()
    model, step = _build(impl, a)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, a.vocab, (a.batch, a.context + 1), generator=g) for _ in range(4)]
    for i in range(a.warmup):
        b = batches[i % 4]
        step(b[:, :-1], b[:, 1:])
    times = []
    for i in range(a.steps):
        b = batches[i % 4]
        t0 = time.perf_counter()
        loss = step(b[:, :-1], b[:, 1:])
        float(loss)
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB on Linux
    n_params = sum(p.numel() for p in model.parameters())
    return {"impl": impl, "step_s": statistics.median(times), "min_step_s": min(times), "peak_rss_mb": peak,
            "step_rss_mb": peak - rss_before, "params": n_params, "threads": torch.get_num_threads()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one round, 1 warm-up + 3 timed steps")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds per implementation (best is kept)")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per round")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--d-model", dest="d_model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--d-ff", dest="d_ff", type=int, default=1344)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=10_000)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--compile", action="store_true", help="torch.compile the loss function of both")
    ap.add_argument("--reference", action="store_true", help="lmforge's reference path instead of the fast one")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--hf-fused", dest="hf_fused", action="store_true",
                    help="give HF torch.optim.AdamW(fused=True) (default: torch's default AdamW)")
    ap.add_argument("--impls", default="lmforge,hf")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a)))
        return
    if a.quick:
        a.rounds, a.steps, a.warmup = 1, 3, 1

    import torch

    from lmforge.model import ModelConfig, flops_per_token

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_matmul_peak import matmul_peak_gflops

    if a.threads:
        torch.set_num_threads(a.threads)
    peak = matmul_peak_gflops(4096, torch.float32 if a.dtype == "fp32" else torch.bfloat16, repeats=3 if a.quick else 5)
    cfg = ModelConfig(vocab_size=a.vocab, context_length=a.context, d_model=a.d_model, n_layers=a.layers,
                      n_heads=a.heads, d_ff=a.d_ff)
    fpt = flops_per_token(cfg, a.context)
    print(f"shapes: d_model {a.d_model}, {a.layers} layers, {a.heads} heads, d_ff {a.d_ff}, T {a.context}, "
          f"B {a.batch}, V {a.vocab}, {a.dtype}{', compiled' if a.compile else ''}; threads {torch.get_num_threads()}")
    print(f"matmul peak (4096², {a.dtype}): {peak:.1f} GFLOP/s;  FLOPs/token {fpt / 1e6:.1f} M;  "
          f"HF optimizer: torch.optim.AdamW({'fused=True' if a.hf_fused else 'defaults'})")

    impls = a.impls.split(",")
    best: dict[str, dict] = {}
    argv = [s for s in sys.argv[1:] if s != "--quick"]
    extra = ["--steps", str(a.steps), "--warmup", str(a.warmup)]
    for r in range(a.rounds):
        for impl in impls:
            out = subprocess.run([sys.executable, os.path.abspath(__file__), *argv, *extra, "--child", impl],
                                 capture_output=True, text=True)
            if out.returncode:
                sys.exit(f"{impl} child failed:\n{out.stderr[-3000:]}")
            res = json.loads(out.stdout.strip().splitlines()[-1])
            tps = a.batch * a.context / res["step_s"]
            print(f"  round {r + 1} {impl:>8}: {tps:8.0f} tok/s  (median step {res['step_s'] * 1e3:.0f} ms, "
                  f"peak RSS {res['peak_rss_mb']:.0f} MiB)", flush=True)
            if impl not in best or res["step_s"] < best[impl]["step_s"]:
                best[impl] = res
            best[impl]["peak_rss_mb"] = max(best[impl]["peak_rss_mb"], res["peak_rss_mb"])

    print(f"\n| impl | tokens/s | GFLOP/s | MFU | peak RSS MiB | step RSS MiB | params |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for impl, res in best.items():
        tps = a.batch * a.context / res["step_s"]
        gf = tps * fpt / 1e9
        print(f"| {impl} | {tps:,.0f} | {gf:.0f} | {100 * gf / peak:.0f}% | {res['peak_rss_mb']:.0f} | "
              f"{res['step_rss_mb']:.0f} | {res['params'] / 1e6:.1f} M |")
    if "lmforge" in best and "hf" in best:
        speed = best["hf"]["step_s"] / best["lmforge"]["step_s"]
        mem = best["lmforge"]["step_rss_mb"] / best["hf"]["step_rss_mb"]
        print(f"\nlmforge / HF: speed {speed:.2f}x, training-step memory {mem:.2f}x")


if __name__ == "__main__":
    main()
