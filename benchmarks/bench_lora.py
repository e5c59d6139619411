"""LoRA training cost: lmforge LoRA vs PEFT LoRA on HF ``LlamaForCausalLM`` (the peer), and vs lmforge full
fine-tuning, same shapes, same base weights, same adapter weights, side by side in one process.

* Same work: the HF Llama holds lmforge's base weights (``lmforge.interop.hf``) and PEFT's adapters hold
  lmforge's (``lmforge.interop.peft_adapters``: q/k ``lora_B`` rows permuted like the weights), with a non-zero
  ``B`` so the adapters matter; the first step's losses must agree to ``LOSS_TOL`` before anything is timed.
* Speed: the three training steps (forward, backward, AdamW on the trainable parameters) are interleaved
  (full, lmforge LoRA, PEFT LoRA, full, ...), so a shared machine's load falls on all alike; median, range and
  ratios of medians are printed.
* Size: trainable parameters and optimizer state bytes (AdamW's two moments, after one step) of each.

    python benchmarks/bench_lora.py            # d_model 256, 4 layers, 8 heads, T 256, B 8, V 4096, rank 8, every projection
    python benchmarks/bench_lora.py --quick    # a tiny model, a few steps: a smoke run
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, spread  # noqa: E402

LOSS_TOL = 1e-4  # |loss_lmforge_lora - loss_peft| on the first step, fp32, same weights and batch
HF_TARGETS = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "output_proj": "o_proj",
              "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _state_bytes(opt) -> int:
    """Bytes of every tensor in an optimizer's state (AdamW: exp_avg, exp_avg_sq, step)."""
    return sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if hasattr(t, "numel"))


def build(a: argparse.Namespace):
    """``{name: (step(x, y) -> loss, trainable params, optimizer)}`` for full, lmforge LoRA and PEFT LoRA."""
    import peft
    import torch
    from transformers import LlamaForCausalLM

    from lmforge.interop import hf
    from lmforge.interop.peft_adapters import to_peft_state_dict
    from lmforge.model import ModelConfig, TransformerLM
    from lmforge.model.lora import LoraConfig, apply_lora, lora_parameters, lora_state_dict
    from lmforge.train.optim import AdamW, param_groups_for

    cfg = ModelConfig(vocab_size=a.vocab, context_length=a.context, d_model=a.d_model, n_layers=a.layers,
                      n_heads=a.heads)
    torch.manual_seed(0)
    full = TransformerLM(cfg)
    base_sd = {k: v.clone() for k, v in full.state_dict().items()}
    lora = TransformerLM(cfg)
    lora.load_state_dict(base_sd)
    lcfg = LoraConfig(rank=a.rank, alpha=2.0 * a.rank, targets=a.targets.split(","))
    apply_lora(lora, lcfg)
    with torch.no_grad():
        for p in lora_parameters(lora):
            p.normal_(0.0, 0.02)
    hcfg = hf.hf_config(cfg)
    hcfg._attn_implementation = "sdpa"
    llama = LlamaForCausalLM(hcfg)
    llama.load_state_dict(hf.to_hf_state_dict(base_sd, cfg))
    pm = peft.get_peft_model(llama, peft.LoraConfig(r=lcfg.rank, lora_alpha=lcfg.alpha, lora_dropout=0.0,
                                                     target_modules=sorted({HF_TARGETS[t] for t in lcfg.targets})))
    mapped = to_peft_state_dict(lora_state_dict(lora), cfg)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if ".lora_" in name:
                p.copy_(mapped[name.replace(".default.weight", ".weight")])

    def make(model, loss_fn, params, opt):
        def step(x, y):
            loss = loss_fn(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return float(loss.detach())
        return step, sum(p.numel() for p in params), opt

    out = {}
    opt = AdamW(param_groups_for(full, 0.0), lr=1e-4)
    out["lmforge full fine-tuning"] = make(full, lambda x, y: full(x, targets=y), list(full.parameters()), opt)
    opt = AdamW(param_groups_for(lora, 0.0), lr=1e-4)
    out["lmforge LoRA"] = make(lora, lambda x, y: lora(x, targets=y), lora_parameters(lora), opt)
    params = [p for p in pm.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0, fused=True)
    out["PEFT LoRA (HF Llama)"] = make(pm, lambda x, y: pm(input_ids=x, labels=x, shift_labels=y).loss, params, opt)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a tiny model, 1 warm-up + 3 timed steps each")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per implementation (interleaved)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--d-model", dest="d_model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--targets", default="q_proj,k_proj,v_proj,output_proj,w1,w2,w3")
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    if a.quick:
        a.d_model, a.layers, a.heads, a.context, a.batch, a.vocab, a.steps, a.warmup = 64, 2, 4, 32, 2, 512, 2, 1
    import time

    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    impls = build(a)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, a.vocab, (a.batch, a.context + 1), generator=g) for _ in range(a.warmup + a.steps)]
    xy = [(b[:, :-1].contiguous(), b[:, 1:].contiguous()) for b in batches]
    first = {name: step(*xy[0]) for name, (step, _, _) in impls.items()}
    diff = abs(first["lmforge LoRA"] - first["PEFT LoRA (HF Llama)"])
    print(f"same weights, same batch: first-step loss lmforge LoRA {first['lmforge LoRA']:.6f}, "
          f"PEFT {first['PEFT LoRA (HF Llama)']:.6f}, |diff| {diff:.2e}")
    if not diff <= LOSS_TOL:
        sys.exit(f"lmforge LoRA and PEFT are not doing the same work: first losses differ by {diff:.2e} > {LOSS_TOL}")
    times: dict[str, list[float]] = {name: [] for name in impls}
    for i, (x, y) in enumerate(xy[1:]):
        for name, (step, _, _) in impls.items():
            t0 = time.perf_counter()
            step(x, y)
            if i >= a.warmup - 1:
                times[name].append(time.perf_counter() - t0)
    tokens = a.batch * a.context
    full_t, full_n, full_opt = times["lmforge full fine-tuning"], *impls["lmforge full fine-tuning"][1:]
    print(f"\n### LoRA training step (d_model {a.d_model}, {a.layers} layers, T {a.context}, B {a.batch}, "
          f"V {a.vocab}, rank {a.rank} on {a.targets}; fp32, {torch.get_num_threads()} threads, "
          f"{os.cpu_count()} cores, loaded machine)\n")
    print("| run | trainable params | optimizer state | step (s): median (range) | tokens/s | step / lmforge LoRA |")
    print("|---|---:|---:|---:|---:|---:|")
    lora_t = times["lmforge LoRA"]
    for name, (_, n, opt) in impls.items():
        t = times[name]
        print(f"| {name} | {n:,} ({n / full_n:.1%}) | {_state_bytes(opt) / 2**20:.2f} MiB "
              f"({_state_bytes(opt) / _state_bytes(full_opt):.1%}) | {spread(t)} | {tokens / median(t):,.0f} | "
              f"{median(t) / median(lora_t):.2f}x |")
    print(f"\nlmforge LoRA / full fine-tuning step time: {median(lora_t) / median(full_t):.2f}x; "
          f"PEFT / lmforge LoRA: {median(times['PEFT LoRA (HF Llama)']) / median(lora_t):.2f}x")


if __name__ == "__main__":
    main()
