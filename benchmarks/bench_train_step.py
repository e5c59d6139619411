"""Training speed and memory: lmforge's TransformerLM + AdamW vs Hugging Face ``LlamaForCausalLM`` +
``torch.optim.AdamW``, same shapes, the same random weights, side by side in one run.

* Same work: HF's random init is copied into lmforge (``lmforge.interop.hf.from_hf_state_dict``) and both predict
  the same targets (HF through its ``shift_labels``), so the first step's losses must agree to
  ``LOSS_TOL`` (fp32; ``LOSS_TOL_BF16`` under bf16 autocast) before anything is timed; the script exits
  with an error otherwise. The second step's losses (after one optimizer update each) are printed too.
* Speed: both models live in this process and their training steps are *interleaved* (lmforge step,
  HF step, lmforge step, ...), so both see the same machine load; a shared machine slows both alike.
  Reported per implementation: median, range and best step; the ratio of medians and of bests.
* Memory: each implementation runs a few steps alone in a child process that reports its peak RSS, and
  the growth of RSS over the state right before the model was built ("step RSS").
* MFU = tokens/s · FLOPs/token / the 4096² matmul peak measured in the step's dtype (``--dtype``); FLOPs/token =
  6·N + 12·L·d·T for both. The script also prints the ceiling this sets: no implementation can beat HF by more
  than 1 / HF's MFU.

    python benchmarks/bench_train_step.py            # d_model 512, 4 layers, 16 heads, d_ff 1344, T 256, B 8, V 10k
    python benchmarks/bench_train_step.py --shape gpt2s   # near GPT-2 small: d 768, 12 layers, 12 heads, d_ff 2048,
                                                          # T 512, B 4, V 32k (~130 M parameters; minutes per run)
    python benchmarks/bench_train_step.py --quick    # a few steps: a smoke run
    python benchmarks/bench_train_step.py --dtype bf16 --compile
    python benchmarks/bench_train_step.py --profile  # the demo's own step (Muon, bf16 where native): where it goes

``--profile``: the speedrun's training step at the demo's shape (``lmforge.speedrun``'s ``small`` preset and
``RECIPE``: Muon, per-group AdamW, gradient clipping; bf16 autocast where ``training.dtype: auto`` picks it), its
time split by ``torch.profiler`` into the blocks' and head's matrix products, attention, the optimizer (Newton-Schulz
products apart), casts, norms, the loss, the remaining ops and what no op accounts for (Python, the autograd
engine); MFU of unprofiled steps against the matmul peak measured in the same run, beside the same step under
``training.compile`` (each block compiled; its compile time and the steps that pay it back) and Hugging Face's
``LlamaForCausalLM`` at the same shape in its strongest configuration here (bf16 autocast, the whole model under
``torch.compile``, ``torch.optim.AdamW(fused=True)``), steps interleaved.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

LOSS_TOL = 1e-4  # |loss_lmforge - loss_HF| on the first step, fp32, same weights and batch
LOSS_TOL_BF16 = 2e-2  # the same under bf16 autocast (different op orders round differently)


def _rss_mb() -> float:
    """Current resident set size in MiB (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _model_config(a: argparse.Namespace):
    """The lmforge ``ModelConfig`` of the benchmarked shapes."""
    from lmforge.model import ModelConfig

    return ModelConfig(vocab_size=a.vocab, context_length=a.context, d_model=a.d_model, n_layers=a.layers,
                       n_heads=a.heads, d_ff=a.d_ff, fast=not a.reference)


def _build(impl: str, a: argparse.Namespace, hf_state: dict | None = None):
    """(model, step function) for ``impl``; ``step(x, y)`` does forward, backward, optimizer update.

    ``hf_state``: an HF ``LlamaForCausalLM`` state dict to start from (lmforge maps it into its names);
    ``None`` keeps the implementation's own random init.
    """
    import torch

    cfg = _model_config(a)
    if impl == "lmforge":
        from lmforge.interop import hf
        from lmforge.model import TransformerLM
        from lmforge.train.optim import AdamW, param_groups_for

        model = TransformerLM(cfg)
        if hf_state is not None:
            model.load_state_dict(hf.from_hf_state_dict(hf_state, cfg))
        opt = AdamW(param_groups_for(model, 0.1), lr=3e-4, betas=(0.9, 0.95))

        def loss_fn(x, y):
            return model(x, targets=y)
    else:
        from transformers import LlamaForCausalLM

        from lmforge.interop import hf

        hcfg = hf.hf_config(cfg)
        hcfg._attn_implementation = "sdpa"
        model = LlamaForCausalLM(hcfg)
        if hf_state is not None:
            model.load_state_dict(hf_state)
        # HF at its fastest: torch's fused AdamW kernel (--hf-unfused: torch's default per-tensor loop, weaker)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                                fused=True if a.hf_fused else None)

        def loss_fn(x, y):  # HF's loss (logits upcast to float32); shift_labels: the same targets as lmforge's
            y = y.contiguous()  # HF views the labels flat
            return model(input_ids=x, labels=y, shift_labels=y).loss
    model.train()
    fwd = torch.compile(loss_fn) if a.compile else loss_fn

    def step(x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.dtype == "bf16"):
            loss = fwd(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return model, step


def _batches(a: argparse.Namespace) -> list:
    import torch

    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, a.vocab, (a.batch, a.context + 1), generator=g) for _ in range(4)]


def memory_child(impl: str, a: argparse.Namespace) -> dict:
    """Peak RSS of ``impl`` training alone (a few steps), in MiB."""
    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    if impl == "hf":
        import transformers  # noqa: F401  (import cost outside the measured growth)
    torch.manual_seed(0)
    rss_before = _rss_mb()
    _, step = _build(impl, a)
    for b in _batches(a)[:3]:
        step(b[:, :-1], b[:, 1:])
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _common import peak_rss_mb  # VmHWM: ru_maxrss survives exec and would report the parent's peak

    peak = peak_rss_mb()
    return {"peak_rss_mb": peak, "step_rss_mb": peak - rss_before}


def check_losses(ours: list[float], theirs: list[float], tol: float) -> None:
    """Exit with an error unless the first step's losses agree within ``tol``; print both steps' losses."""
    print(f"same weights, same batch: step 1 loss lmforge {ours[0]:.6f} vs HF {theirs[0]:.6f} "
          f"(|diff| {abs(ours[0] - theirs[0]):.1e}, tolerance {tol:g}); after one update: {ours[1]:.6f} vs "
          f"{theirs[1]:.6f} (|diff| {abs(ours[1] - theirs[1]):.1e})")
    if not abs(ours[0] - theirs[0]) <= tol:
        sys.exit(f"lmforge and HF disagree on the first loss from the same weights ({ours[0]:.6f} vs "
                 f"{theirs[0]:.6f}, tolerance {tol:g}): they are not doing the same work, so the timing would "
                 "compare different computations; check the weight mapping (lmforge.interop.hf) and the loss targets")


# (category, substrings of an op's name) in order: the first match names an op's own time (torch.profiler self time)
OP_CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("scaled_dot_product", "flash_attention")),
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_addmm_activation", "mkldnn_matmul")),
    ("loss", ("log_softmax", "nll_loss", "cross_entropy")),
    ("cast", ("aten::_to_copy", "aten::copy_", "aten::to")),
    ("norm", ("rsqrt", "norm")),
    ("embedding", ("embedding",)),
)
ANNOTATIONS = ("optimizer", "clip")  # record_function ranges of the step: their ops are counted as theirs


def classify(name: str, within: str | None) -> str:
    """The split category of an op called ``name`` run inside the ``within`` annotation (or none)."""
    base = next((cat for cat, keys in OP_CATEGORIES if any(k in name for k in keys)), "other ops")
    if within == "optimizer":
        return "optimizer: matmul (Newton-Schulz)" if base == "matmul" else "optimizer: other"
    if within == "clip":
        return "gradient clipping"
    return base


def split_profile(events, steps: int) -> dict[str, float]:
    """Seconds per step by :func:`classify` category from ``torch.profiler`` function events (self times); the
    annotation ranges (:data:`ANNOTATIONS`) and the step range themselves count nothing."""
    out: dict[str, float] = {}
    for e in events:
        if e.name in ANNOTATIONS or e.name == "step":
            continue
        within, p = None, e.cpu_parent
        while p is not None:
            if p.name in ANNOTATIONS:
                within = p.name
                break
            p = p.cpu_parent
        cat = classify(e.name, within)
        out[cat] = out.get(cat, 0.0) + e.self_cpu_time_total / 1e6 / steps
    return out


def _demo_step(a: argparse.Namespace, compile: bool = False):
    """(model config, batch size, bf16?, step function) of the speedrun's training step at preset ``a.preset``: the
    run config the speedrun builds (its RECIPE), the loop's own optimizer builder, loss scaling and clipping;
    ``compile``: each block compiled as ``training.compile`` does (:func:`lmforge.train.distributed.compile_blocks`)."""
    from pathlib import Path

    import torch

    from lmforge.hardware import resolve_train_dtype
    from lmforge.model import TransformerLM
    from lmforge.speedrun import PRESETS, _run_config
    from lmforge.train.allocator import retain_freed_memory
    from lmforge.train.loop import _build_optimizer
    from lmforge.train.optim import clip_grad_norm

    retain_freed_memory()  # as the training loop does on the CPU (process-wide: HF's steps here get it too)
    preset = PRESETS["tiny" if a.quick else a.preset]  # --quick: a smoke run, the same recipe
    cfg = _run_config(preset, a.vocab, Path("."), Path("tokenizer.json"), torch.device("cpu"), 500, None)
    model = TransformerLM(cfg.model)
    if compile:
        from lmforge.train.distributed import compile_blocks

        compile_blocks(model)
    opt = _build_optimizer(model, cfg.optimizer)
    bf16 = resolve_train_dtype(cfg.training.dtype if a.dtype_auto else a.dtype, "cpu") == "bf16"

    def step(x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(x, targets=y, reduction="sum")
        (loss / y.numel()).backward()
        with torch.profiler.record_function("clip"):
            clip_grad_norm(model.parameters(), cfg.optimizer.grad_clip)
        with torch.profiler.record_function("optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)
        return float(loss.detach()) / y.numel()

    return model.cfg, cfg.training.batch_size, bf16, step


def attention_ab(heads: tuple[int, int, int, int], rounds: int = 6) -> dict[str, float]:
    """Best seconds of one causal attention forward + backward on bf16 heads ``(B, h, T, D)``, two ways, alternated:
    torch's kernel in bf16, and the model's :func:`~lmforge.model.blocks.causal_attention` (float32 on the CPU)."""
    import torch
    import torch.nn.functional as F

    from lmforge.model.blocks import causal_attention

    g = torch.Generator().manual_seed(0)
    q0, k0, v0, dy = (torch.randn(heads, generator=g).to(torch.bfloat16) for _ in range(4))
    ways = {"bf16 kernel": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            "float32 (causal_attention)": lambda q, k, v: causal_attention(q, k, v, False, None)}
    best = {name: float("inf") for name in ways}
    for i in range(rounds + 1):
        for name, fn in ways.items():
            q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
            t0 = time.perf_counter()
            fn(q, k, v).backward(dy)
            if i:
                best[name] = min(best[name], time.perf_counter() - t0)
    return best


def profile_main(a: argparse.Namespace) -> None:
    """``--profile``: the demo's step split by the profiler, its MFU and HF's strongest configuration beside it."""
    import torch

    from lmforge.hardware import matmul_peak_flops
    from lmforge.model import flops_per_token
    from lmforge.model.transformer import matmul_params_per_token

    if a.threads:
        torch.set_num_threads(a.threads)
    mcfg, batch, bf16, step = _demo_step(a)
    a.d_model, a.layers, a.heads, a.d_ff, a.context, a.batch, a.vocab = (
        mcfg.d_model, mcfg.n_layers, mcfg.n_heads, mcfg.d_ff, mcfg.context_length, batch, mcfg.vocab_size)
    a.dtype, a.compile, a.reference = ("bf16" if bf16 else "fp32"), True, False
    dt = torch.bfloat16 if bf16 else torch.float32
    peak_n = 1024 if a.quick else 4096
    tokens, fpt = a.batch * a.context, flops_per_token(mcfg, a.context)
    print(f"the demo's step: d_model {a.d_model}, {a.layers} layers, {a.heads} heads, d_ff {a.d_ff}, T {a.context}, "
          f"B {a.batch}, V {a.vocab}, {a.dtype}; the speedrun's RECIPE (Muon + AdamW groups, gradient clipping); "
          f"threads {torch.get_num_threads()}")
    peaks = [matmul_peak_flops("cpu", peak_n, dt, repeats=3, max_seconds=10.0)]
    batches = _batches(a)
    hf_step = compiled_step = None
    if not a.no_hf:
        torch.manual_seed(0)
        _, hf_step = _build("hf", a)  # bf16 autocast, torch.compile of the whole loss (model), fused AdamW
    compile_s = None
    if not a.no_compiled:  # training.compile's step: its first call compiles (timed: the run pays it once)
        compiled_step = _demo_step(a, compile=True)[3]
        t0 = time.perf_counter()
        compiled_step(batches[0][:, :-1], batches[0][:, 1:])
        compile_s = time.perf_counter() - t0
    times: dict[str, list[float]] = {"lmforge": [], "lmforge-compiled": [], "hf": []}
    warm = max(a.warmup, 2)
    for i in range(warm + a.steps):
        b = batches[i % len(batches)]
        for name, fn in (("lmforge", step), ("lmforge-compiled", compiled_step), ("hf", hf_step)):
            if fn is None:
                continue
            t0 = time.perf_counter()
            fn(b[:, :-1], b[:, 1:])
            if i >= warm:
                times[name].append(time.perf_counter() - t0)
    prof_steps = 2 if a.quick else 5
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for i in range(prof_steps):
            b = batches[i % len(batches)]
            step(b[:, :-1], b[:, 1:])
        prof_wall = (time.perf_counter() - t0) / prof_steps
    peaks.append(matmul_peak_flops("cpu", peak_n, dt, repeats=3, max_seconds=10.0))
    peak = max(peaks)
    split = split_profile(prof.events(), prof_steps)
    split["not in any op (Python, autograd engine)"] = max(0.0, prof_wall - sum(split.values()))
    print(f"matmul peak ({peak_n}², {a.dtype}): {peak / 1e9:.1f} GFLOP/s (before {peaks[0] / 1e9:.0f}, after "
          f"{peaks[1] / 1e9:.0f}); FLOPs/token {fpt / 1e6:.1f} M\n")
    print(f"profiled: {prof_steps} steps, {1e3 * prof_wall:.1f} ms/step under the profiler\n")
    print("| part of the step | ms/step | share |\n|---|---:|---:|")
    for cat, sec in sorted(split.items(), key=lambda kv: -kv[1]):
        print(f"| {cat} | {1e3 * sec:.1f} | {100 * sec / prof_wall:.0f}% |")
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]
    print("\nthe ops with the most own time: " + "; ".join(
        f"{e.key} {e.self_cpu_time_total / 1e3 / prof_steps:.1f} ms ({e.count // prof_steps}x)" for e in ops))
    if bf16:
        ab = attention_ab((a.batch, a.heads, a.context, a.d_model // a.heads))
        print("\none layer's causal attention, forward + backward, best of 6: " +
              ", ".join(f"{name} {1e3 * sec:.1f} ms" for name, sec in ab.items()))
    mm = split.get("matmul", 0.0)
    if mm:
        print(f"\nthe model's matrix products: {6 * matmul_params_per_token(mcfg) * tokens / mm / 1e9:.0f} GFLOP/s "
              f"(6·N·tokens over their profiled time) = {100 * 6 * matmul_params_per_token(mcfg) * tokens / mm / peak:.0f}% "
              "of the peak; everything else is what keeps the step from it")
    print(f"\n| impl | tokens/s (median step) | tokens/s (best step) | MFU median | MFU best (vs the measured {a.dtype} "
          "peak) |\n|---|---:|---:|---:|---:|")
    label = {"lmforge": "lmforge, the speedrun's step (Muon, eager)",
             "lmforge-compiled": "lmforge, the same step with training.compile (each block compiled)",
             "hf": "HF Llama, bf16 autocast + torch.compile(whole model) + AdamW(fused=True)"}
    for name, ts in times.items():
        if ts:
            med, best = tokens / statistics.median(ts), tokens / min(ts)
            print(f"| {label[name]} | {med:,.0f} | {best:,.0f} | {100 * med * fpt / peak:.0f}% | "
                  f"{100 * best * fpt / peak:.0f}% |")
    if times["lmforge-compiled"]:
        gain = statistics.median(times["lmforge"]) - statistics.median(times["lmforge-compiled"])
        print(f"\ntraining.compile: first step {compile_s:.1f} s (the compile), then "
              f"{statistics.median(times['lmforge']) / statistics.median(times['lmforge-compiled']):.2f}x the eager "
              "step (median steps); it pays for itself after " +
              (f"{compile_s / gain:,.0f} steps" if gain > 0 else "no number of steps (it is not faster)"))
    if times["hf"]:
        print(f"\nlmforge / HF speed: {statistics.median(times['hf']) / statistics.median(times['lmforge']):.2f}x "
              f"(median steps), {min(times['hf']) / min(times['lmforge']):.2f}x (best steps); HF runs AdamW, lmforge "
              "the speedrun's Muon (more optimizer work)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small model, 2 warm-up + 3 timed steps each")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per implementation (interleaved)")
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
    ap.add_argument("--hf-unfused", dest="hf_fused", action="store_false",
                    help="a weaker HF variant: torch's default AdamW (the per-tensor loop) instead of "
                         "torch.optim.AdamW(fused=True)")
    ap.add_argument("--shape", choices=("d512", "gpt2s"), default=None,
                    help="a preset for the shape flags: d512 (the defaults) or gpt2s (near GPT-2 small)")
    ap.add_argument("--impls", default="lmforge,hf")
    ap.add_argument("--keep-freed", action="store_true",
                    help="malloc keeps freed memory in this process (train.allocator.retain_freed_memory), as "
                         "lmforge's training loop sets it on the CPU; process-wide, so both sides get it")
    ap.add_argument("--no-memory", dest="memory", action="store_false", help="skip the child-process RSS runs")
    ap.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--profile", action="store_true",
                    help="the speedrun's own step at --preset, split by torch.profiler, beside HF's strongest setup")
    ap.add_argument("--preset", default="small", help="--profile: the speedrun preset (default small: the demo's)")
    ap.add_argument("--no-hf", action="store_true", help="--profile: without HF")
    ap.add_argument("--no-compiled", action="store_true",
                    help="--profile: without the training.compile variant of the speedrun's step")
    if ap.parse_known_args()[0].shape == "gpt2s":  # a preset of defaults: flags given explicitly still win
        ap.set_defaults(d_model=768, layers=12, heads=12, d_ff=2048, context=512, batch=4, vocab=32_000)
    a = ap.parse_args()
    if a.profile:
        a.dtype_auto = "--dtype" not in sys.argv
        if a.quick:
            a.steps, a.warmup, a.vocab = 3, 1, 1000
        elif "--vocab" not in sys.argv:
            a.vocab = 4096  # the demo's
        profile_main(a)
        return
    if a.quick:
        a.steps, a.warmup = 3, 1
        a.d_model, a.layers, a.heads, a.d_ff, a.context, a.batch, a.vocab = 128, 2, 4, 352, 64, 2, 1000
    if a.memory_child:  # after the presets: the child measures the shape the parent times
        print(json.dumps(memory_child(a.memory_child, a)))
        return
    peak_n = 1024 if a.quick else 4096

    import torch

    from lmforge.hardware import matmul_peak_flops
    from lmforge.model import flops_per_token

    if a.threads:
        torch.set_num_threads(a.threads)
    if a.keep_freed:
        from lmforge.train.allocator import retain_freed_memory

        retain_freed_memory()
    impls = a.impls.split(",")
    cfg = _model_config(a)
    fpt = flops_per_token(cfg, a.context)
    tokens = a.batch * a.context
    print(f"shapes: d_model {a.d_model}, {a.layers} layers, {a.heads} heads, d_ff {a.d_ff}, T {a.context}, "
          f"B {a.batch}, V {a.vocab}, {a.dtype}{', compiled' if a.compile else ''}; threads {torch.get_num_threads()}; "
          f"HF optimizer: torch.optim.AdamW({'fused=True' if a.hf_fused else 'defaults: a weaker variant'})"
          f"{'; malloc keeps freed memory (both sides)' if a.keep_freed else ''}")

    # ---- memory: each implementation alone in a child process ----------------------------------------
    mem: dict[str, dict] = {}
    if a.memory:
        argv = sys.argv[1:]
        for impl in impls:
            out = subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--memory-child", impl],
                                 capture_output=True, text=True)
            if out.returncode:
                sys.exit(f"{impl} memory run failed:\n{out.stderr[-3000:]}")
            mem[impl] = json.loads(out.stdout.strip().splitlines()[-1])

    # ---- speed: interleaved steps in this process, bracketed by matmul-peak measurements -------------
    dt = torch.float32 if a.dtype == "fp32" else torch.bfloat16
    peaks = [matmul_peak_flops("cpu", peak_n, dt, repeats=3, max_seconds=10.0) / 1e9]
    torch.manual_seed(0)
    hf_state = _build("hf", a)[0].state_dict()  # HF's init: both models start from these weights
    steps = {impl: _build(impl, a, hf_state)[1] for impl in impls}
    del hf_state
    batches = _batches(a)
    times: dict[str, list[float]] = {impl: [] for impl in impls}
    losses: dict[str, list[float]] = {impl: [] for impl in impls}
    for i in range(max(a.warmup, 2) + a.steps):
        b = batches[i % len(batches)]
        for impl in impls:
            t0 = time.perf_counter()
            losses[impl].append(steps[impl](b[:, :-1], b[:, 1:]))
            if i >= max(a.warmup, 2):
                times[impl].append(time.perf_counter() - t0)
        if i == 1 and "lmforge" in impls and "hf" in impls:
            check_losses(losses["lmforge"][:2], losses["hf"][:2], LOSS_TOL if a.dtype == "fp32" else LOSS_TOL_BF16)
    peaks.append(matmul_peak_flops("cpu", peak_n, dt, repeats=3, max_seconds=10.0) / 1e9)
    peak = max(peaks)
    print(f"matmul peak ({peak_n}², {a.dtype}): {peak:.1f} GFLOP/s (before {peaks[0]:.0f}, after {peaks[1]:.0f}); "
          f"FLOPs/token {fpt / 1e6:.1f} M")

    print(f"\n{a.steps} interleaved steps each after {max(a.warmup, 2)} warm-up steps\n")
    print("| impl | tokens/s (median step) | tokens/s range | tokens/s (best step) | GFLOP/s (best) "
          f"| MFU (best) vs measured {a.dtype} matmul peak | peak RSS MiB | step RSS MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for impl in impls:
        med, best = tokens / statistics.median(times[impl]), tokens / min(times[impl])
        m = mem.get(impl, {})
        rss = f"{m['peak_rss_mb']:.0f} | {m['step_rss_mb']:.0f}" if m else "- | -"
        gflops = best * fpt / 1e9
        print(f"| {impl} | {med:,.0f} | {tokens / max(times[impl]):,.0f}..{best:,.0f} | {best:,.0f} | {gflops:.0f} "
              f"| {100 * gflops / peak:.0f}% | {rss} |")
    if "lmforge" in times and "hf" in times:
        med = statistics.median(times["hf"]) / statistics.median(times["lmforge"])
        best = min(times["hf"]) / min(times["lmforge"])
        line = f"\nlmforge / HF speed: {med:.2f}x (median steps), {best:.2f}x (best steps)"
        if mem:
            line += f"; training-step memory {mem['lmforge']['step_rss_mb'] / mem['hf']['step_rss_mb']:.2f}x"
        print(line)
        hf_mfu = tokens / min(times["hf"]) * fpt / 1e9 / peak
        print(f"ceiling: HF's best step runs at {100 * hf_mfu:.0f}% of the measured {a.dtype} matmul peak, so no "
              f"implementation can be more than {1 / hf_mfu:.2f}x HF on this shape")


if __name__ == "__main__":
    main()
