"""The GPU check's training stages, one per process (``tools/gpu_check.py`` runs them, each under a time cap):

* ``probe``: torch, CUDA, the device, bf16 support, the measured bf16 matmul peak (``lmforge.hardware``: the best
  of a few 8192² products on random data) and the datasheet peak of that GPU model.
* ``train``: bf16 training throughput and MFU (against the measured peak and against the datasheet, both named)
  at one shape, lmforge (``TransformerLM`` + its AdamW; compiled as ``training.compile`` compiles: each block in
  place) against HF ``LlamaForCausalLM`` from the same weights in the configuration an HF user runs: SDPA,
  ``torch.compile`` of the whole model, ``torch.optim.AdamW(fused=True)`` (CUDA-only: ``foreach`` on the CPU of a dry
  run, and labelled so), bf16 autocast; each eager and compiled, peak memory. Every record names its
  configuration (``config``). ``hf:compiled_layers`` (not run by default) is a weaker variant, labelled so: HF's
  decoder layers compiled one by one, its head and float32 cross-entropy eager. Before any timing, both compute the
  first loss of the same batch from the same weights: they must agree within bf16 tolerance, or the stage fails
  (they would not be doing the same work).
* ``profile``: one compiled lmforge step at the GPT-2 shape under ``torch.profiler``: device time by kind (GEMM,
  attention, compiled kernels, optimizer, other) and the top kernels.
* ``loop``: lmforge's own ``train()`` (data loader, syncs, logging included) at the GPT-2 shape, bf16, compiled.
* ``resume``: an FSDP2 run at world size 1 (NCCL on a GPU, Gloo on the CPU) with DCP checkpoints, SIGKILLed after
  a checkpoint and resumed, against an uninterrupted run: losses bit for bit under
  ``torch.use_deterministic_algorithms`` (warn-only), else the largest relative difference is reported.

Each stage appends JSON lines to ``--result`` as it finishes each part, so a stage killed at its cap leaves what it
measured. ``--dry-run``: tiny shapes on the CPU; ``--quick`` besides: a step or two of each, a 100 kB corpus (the
test suite runs that through ``gpu_check.py --quick``).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# name: (d_model, n_layers, n_heads, context, vocab, batch). gpt2: GPT-2 small's shape (a 50257 vocabulary padded to
# a multiple of 128); d20: nanochat's d20 (head_dim 128). Batch 32 x 1024 tokens fits both implementations in 80 GB
# (HF materialises the float32 logits); an out-of-memory run is retried at half the batch, and says so.
SHAPES = {"gpt2": (768, 12, 12, 1024, 50304, 32), "d20": (1280, 20, 10, 1024, 50304, 32),
          "small": (256, 4, 4, 256, 8192, 8),  # the resume check on a GPU
          "tiny": (32, 2, 2, 32, 320, 2), "tiny20": (48, 3, 2, 32, 320, 2)}  # the dry run's stand-ins
LOSS_TOL_BF16 = 2e-2  # |first loss lmforge - first loss HF|, bf16 autocast, same weights and batch
FP8_LOSS_TOL = 0.01  # float8's last loss within 1% of bf16's after the same steps from the same weights and batches
LAST_LOSS_TOL = 5e-2  # spread of the runs' last losses after the same 13 steps (measured: 3e-4 between runs that agree)


def emit(path: str | None, record: dict[str, Any]) -> None:
    """Append ``record`` as one JSON line to ``path`` (flushed: a stage killed later keeps it) and print it."""
    line = json.dumps(record)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
    print(line, flush=True)


def _device(a: argparse.Namespace) -> Any:
    import torch

    return torch.device("cpu" if a.dry_run else "cuda")


def _dry_compile(a: argparse.Namespace) -> None:
    """A dry run compiles with ``aot_eager``: the CPU traces in seconds, no C++ build."""
    if a.dry_run:
        from lmforge.train import distributed

        distributed._COMPILE_OPTIONS.update(backend="aot_eager")


def _sync(dev: Any) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _model_config(shape: str) -> Any:
    from lmforge.model import ModelConfig

    d, layers, heads, ctx, vocab, _ = SHAPES[shape]
    return ModelConfig(vocab_size=vocab, context_length=ctx, d_model=d, n_layers=layers, n_heads=heads)


# --------------------------------------------------------------------------------------------------
# probe
# --------------------------------------------------------------------------------------------------
def probe(a: argparse.Namespace) -> None:
    import torch

    from lmforge.hardware import datasheet_peak, matmul_peak_flops

    dev = _device(a)
    rec: dict[str, Any] = {"kind": "probe", "torch": torch.__version__, "cuda": torch.version.cuda,
                           "python": sys.version.split()[0], "device": str(dev)}
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        rec.update(name=p.name, capability=list(torch.cuda.get_device_capability(dev)), sms=p.multi_processor_count,
                   memory_gib=round(p.total_memory / 2**30, 1), bf16=torch.cuda.is_bf16_supported(),
                   datasheet_bf16_flops=datasheet_peak(p.name))
    else:
        rec.update(name="cpu", bf16=True, datasheet_bf16_flops=None)
    n = 64 if a.quick else 256 if a.dry_run else 8192
    dt = torch.bfloat16 if rec["bf16"] else torch.float16
    rec["peak_n"] = n
    rec["peak_flops"] = matmul_peak_flops(dev, n, dt, repeats=1 if a.quick else 3 if a.dry_run else 20)
    emit(a.result, rec)


# --------------------------------------------------------------------------------------------------
# train: MFU, lmforge vs HF
# --------------------------------------------------------------------------------------------------
# impl:mode -> what runs. HF's "compiled" is what an HF user does; "compiled_layers" only as a labelled weaker variant.
MODES = {"lmforge": ("eager", "compiled", "compiled_fp8"), "hf": ("eager", "compiled", "compiled_layers")}
WEAKER = {("hf", "compiled_layers")}
KNOWN_RUNS = ", ".join(f"{i}:{m}" for i, ms in MODES.items() for m in ms)


def run_config(impl: str, mode: str, dev_type: str) -> str:
    """The configuration a training run measures, in words (the report's ``config`` column)."""
    if impl == "lmforge":
        how = {"eager": "eager", "compiled": "each block compiled in place (training.compile)",
               "compiled_fp8": "each block compiled in place, its projections in float8 (training.fp8: e4m3 "
                               "forward, e5m2 gradients, tensorwise scales)"}[mode]
        return f"lmforge TransformerLM, {how}, lmforge AdamW, bf16 autocast, fused LM-head loss"
    how = {"eager": "eager", "compiled": "torch.compile(whole model)",
           "compiled_layers": "WEAKER VARIANT: decoder layers compiled one by one, head and fp32 loss eager"}[mode]
    opt = ("torch.optim.AdamW(fused=True)" if dev_type == "cuda"
           else "torch.optim.AdamW(foreach=True) (fused is CUDA-only: dry run)")
    return f"HF LlamaForCausalLM, SDPA, {how}, {opt}, bf16 autocast"


def _build(impl: str, cfg: Any, hf_state: dict, dev: Any, mode: str) -> tuple[Any, Any, Any]:
    """(model, optimizer, loss function) of ``impl`` in ``mode`` (``MODES``) from HF's weights ``hf_state``, on
    ``dev``: lmforge as ``training.compile`` runs it; HF at its best (whole-model ``torch.compile``, fused AdamW on
    CUDA, foreach on the CPU), or its labelled weaker variant ``compiled_layers``."""
    import torch

    from lmforge.interop import hf
    from lmforge.train.distributed import _COMPILE_OPTIONS, compile_blocks

    if mode not in MODES.get(impl, ()):
        raise ValueError(f"unknown training run {impl}:{mode}; known: {KNOWN_RUNS}")
    if impl == "lmforge":
        from lmforge.model import TransformerLM
        from lmforge.train.optim import AdamW, param_groups_for

        model = TransformerLM(cfg)
        model.load_state_dict(hf.from_hf_state_dict(hf_state, cfg))
        model.to(dev)
        if mode == "compiled_fp8":
            from lmforge.model.fp8 import check_fp8_device, convert_to_float8

            check_fp8_device(dev)
            convert_to_float8(model)  # exactly what training.fp8 does, before the compile
        if mode in ("compiled", "compiled_fp8"):
            compile_blocks(model)  # exactly what training.compile does
        opt = AdamW(param_groups_for(model, 0.1), lr=3e-4, betas=(0.9, 0.95))
        run = model
    else:
        from transformers import LlamaForCausalLM

        hcfg = hf.hf_config(cfg)
        hcfg._attn_implementation = "sdpa"
        with torch.device(dev):
            model = LlamaForCausalLM(hcfg)
        model.load_state_dict(hf_state)
        run = model
        if mode == "compiled":  # what an HF user does: the whole model, head and loss included
            run = torch.compile(model, **_COMPILE_OPTIONS)
        elif mode == "compiled_layers":  # the weaker variant: decoder layers only
            for layer in model.model.layers:
                layer.compile(**_COMPILE_OPTIONS)
        cuda = dev.type == "cuda"
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                                fused=cuda, foreach=not cuda)

    if impl == "lmforge":
        def loss_fn(x: Any, y: Any) -> Any:
            return run(x, targets=y)
    else:
        def loss_fn(x: Any, y: Any) -> Any:  # HF's loss (float32 logits); shift_labels: lmforge's targets
            return run(input_ids=x, labels=y, shift_labels=y).loss
    model.train()
    return run, opt, loss_fn


def _hf_init(cfg: Any, dev: Any) -> dict:
    """HF's seeded random init (on ``dev``): both implementations start from these weights."""
    import torch
    from transformers import LlamaForCausalLM

    from lmforge.interop import hf

    torch.manual_seed(0)
    with torch.device(dev):
        ref = LlamaForCausalLM(hf.hf_config(cfg))
    return {k: v.detach() for k, v in ref.state_dict().items()}


def _first_losses(cfg: Any, hf_state: dict, batch: Any, dev: Any) -> dict[str, float]:
    import torch

    out = {}
    for impl in ("lmforge", "hf"):
        model, _, loss_fn = _build(impl, cfg, hf_state, dev, "eager")
        with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16):
            out[impl] = float(loss_fn(*batch))
        del model
        _free(dev)
    return out


def _split(seq: Any, dev: Any) -> tuple[Any, Any]:
    """(inputs, targets) of ``(B, T + 1)`` token rows, contiguous on ``dev`` (HF views the labels flat)."""
    return seq[:, :-1].contiguous().to(dev), seq[:, 1:].contiguous().to(dev)


def _free(dev: Any) -> None:
    import torch

    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def _stepper(impl: str, model: Any, opt: Any, loss_fn: Any, dev: Any) -> Any:
    """One optimizer step on a batch, bf16 autocast, gradients clipped to norm 1 (each implementation's own
    clipping); returns the detached loss."""
    import torch

    from lmforge.train.optim import clip_grad_norm

    params = [p for p in model.parameters() if p.requires_grad]

    def step(b: tuple[Any, Any]) -> Any:
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = loss_fn(*b)
        loss.backward()
        if impl == "lmforge":
            clip_grad_norm(params, 1.0)
        else:
            torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def _time_run(impl: str, mode: str, cfg: Any, hf_state: dict, batches: list, dev: Any, warmup: int,
              steps: int) -> dict[str, Any]:
    """Warm-up steps (the first compiles), then ``steps`` timed optimizer steps: tokens/s, step time, peak memory."""
    import torch

    model, opt, loss_fn = _build(impl, cfg, hf_state, dev, mode)
    step = _stepper(impl, model, opt, loss_fn, dev)
    t0 = time.perf_counter()
    first = step(batches[0])
    for i in range(1, warmup):
        step(batches[i % len(batches)])
    _sync(dev)
    warm = time.perf_counter() - t0
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    losses = []
    t0 = time.perf_counter()
    for i in range(steps):
        losses.append(step(batches[i % len(batches)]))
    _sync(dev)
    dt = time.perf_counter() - t0
    B, T = batches[0][0].shape
    peak_mem = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None
    del model, opt
    _free(dev)
    return {"tokens_per_s": B * T * steps / dt, "step_ms": 1e3 * dt / steps, "warmup_s": warm,
            "peak_mem_gib": peak_mem, "first_step_loss": float(first), "last_loss": float(losses[-1])}


def train(a: argparse.Namespace) -> None:
    import torch

    from lmforge.model import flops_per_token

    dev = _device(a)
    _dry_compile(a)
    cfg = _model_config(a.shape)
    batch = SHAPES[a.shape][5]
    T = cfg.context_length
    fpt = flops_per_token(cfg, T)
    hf_state = _hf_init(cfg, dev)
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, cfg.vocab_size, (batch, T + 1), generator=g) for _ in range(4)]
    first = _first_losses(cfg, hf_state, _split(data[0][:2], dev), dev)
    same = abs(first["lmforge"] - first["hf"]) <= LOSS_TOL_BF16 and all(map(math.isfinite, first.values()))
    emit(a.result, {"kind": "same_work", "shape": a.shape, "ok": same, "loss_lmforge": first["lmforge"],
                    "loss_hf": first["hf"], "tolerance": LOSS_TOL_BF16})
    if not same:
        sys.exit(f"lmforge and HF disagree on the first loss from the same weights ({first}): not the same work; "
                 "check the weight mapping (lmforge.interop.hf)")
    warmup, steps = (1, 1) if a.quick else (2, 2) if a.dry_run else (3, 10)
    last: dict[str, tuple[int, float]] = {}  # run -> (batch, its last training loss)
    runs = [tuple(run.split(":", 1)) for run in a.runs.split(",")]
    if bad := [":".join(r) for r in runs if len(r) != 2 or r[1] not in MODES.get(r[0], ())]:
        sys.exit(f"unknown training run(s) {', '.join(bad)}; known: {KNOWN_RUNS}")
    for impl, mode in runs:
        run = f"{impl}:{mode}"
        b = batch
        while True:
            try:
                batches = [_split(x[:b], dev) for x in data]
                rec = _time_run(impl, mode, cfg, hf_state, batches, dev, warmup, steps)
                break
            except torch.cuda.OutOfMemoryError:
                if b == 1:
                    raise
            batches = []
            _free(dev)  # here, past the except block: its traceback no longer holds the failed run's tensors
            b //= 2
        tps = rec["tokens_per_s"]
        emit(a.result, {"kind": "train", "shape": a.shape, "impl": impl, "compile": mode, "batch": b, "context": T,
                        "config": run_config(impl, mode, dev.type), "weaker_variant": (impl, mode) in WEAKER,
                        "flops_per_token": fpt, "mfu": tps * fpt / a.peak if a.peak else None,
                        "mfu_datasheet": tps * fpt / a.datasheet if a.datasheet else None, "ok": True, **rec})
        last[run] = (b, rec["last_loss"])
    # The same steps from the same weights on the same batches train the same: a compiled run whose gradients went
    # wrong (torch 2.11, 2026-11-27: 9.77 against 10.02 after 13 steps) fails here though its first loss agreed.
    full = {r: loss for r, (b, loss) in last.items() if b == batch and not r.endswith("_fp8")}
    spread = max(full.values()) - min(full.values()) if full else 0.0
    emit(a.result, {"kind": "same_training", "shape": a.shape, "ok": spread <= LAST_LOSS_TOL, "last_losses": full,
                    "spread": spread, "tolerance": LAST_LOSS_TOL})
    # float8 rounds every product: its training is held to bf16's within FP8_LOSS_TOL (relative), not bit-equal
    if "lmforge:compiled_fp8" in last and "lmforge:compiled" in last:
        f8, bf = last["lmforge:compiled_fp8"][1], last["lmforge:compiled"][1]
        emit(a.result, {"kind": "fp8_training", "shape": a.shape, "ok": abs(f8 - bf) <= FP8_LOSS_TOL * bf,
                        "loss_fp8": f8, "loss_bf16": bf, "tolerance": FP8_LOSS_TOL})


# --------------------------------------------------------------------------------------------------
# profile: where one compiled training step spends its device time
# --------------------------------------------------------------------------------------------------
# attention first: the memory-efficient attention kernel is a cutlass kernel too
_KINDS = (("attention", ("flash", "fmha", "attention", "sdpa")),
          ("gemm", ("gemm", "xmma", "cutlass", "nvjet", "matmul", "addmm", "aten::mm", "aten::bmm")),
          ("compiled (triton / inductor)", ("triton", "cpp_fused")), ("optimizer", ("adam", "multi_tensor", "foreach")))


def kind_of(name: str) -> str:
    """The class of a profiled kernel (or CPU op) by its name: GEMM, attention, compiled, optimizer or other."""
    low = name.lower()
    return next((k for k, keys in _KINDS if any(x in low for x in keys)), "other")


def timed_rows(averages: Iterable[Any], steps: int, on_device: bool) -> list[tuple[str, float, int]]:
    """(name, ms per step, calls per step) of each profiled event that took time. On a device only the kernels
    count: an op's own device time is the kernels it launched, so counting ops too counted each kernel twice (the
    H100 run of 2026-11-27 summed 148 ms for a 76 ms step). On the CPU, each op's self time."""
    from torch.autograd import DeviceType

    rows = []
    for e in averages:
        if on_device:
            t = e.self_device_time_total if e.device_type != DeviceType.CPU else 0
        else:
            t = e.self_cpu_time_total
        if t > 0:
            rows.append((e.key, t / steps / 1e3, e.count // steps))
    return rows


def profile(a: argparse.Namespace) -> None:
    """One compiled lmforge training step at the GPT-2 shape under ``torch.profiler``: its device time by kind and
    the top kernels (the next step towards the MFU target is knowing what the non-GEMM time is)."""
    import torch
    from torch.profiler import ProfilerActivity

    dev = _device(a)
    _dry_compile(a)
    shape = "tiny" if a.dry_run else "gpt2"
    cfg = _model_config(shape)
    batch = SHAPES[shape][5]
    hf_state = _hf_init(cfg, dev)
    g = torch.Generator().manual_seed(1)
    batches = [_split(torch.randint(0, cfg.vocab_size, (batch, cfg.context_length + 1), generator=g), dev)
               for _ in range(2)]
    step = _stepper("lmforge", *_build("lmforge", cfg, hf_state, dev, "compiled"), dev)
    for i in range(3):  # the compiles, then steady state
        step(batches[i % 2])
    _sync(dev)
    steps = 1 if a.quick else 2
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with torch.profiler.profile(activities=acts) as prof:
        for i in range(steps):
            step(batches[i % 2])
        _sync(dev)
    rows = timed_rows(prof.key_averages(), steps, on_device=dev.type == "cuda")
    total = sum(t for _, t, _ in rows) or 1.0
    shares: dict[str, float] = {}
    for name, t, _ in rows:
        shares[kind_of(name)] = shares.get(kind_of(name), 0.0) + t / total
    top = sorted(rows, key=lambda r: -r[1])[:12]
    emit(a.result, {"kind": "profile", "shape": shape, "batch": batch, "ms_per_step": total,
                    "time": "device" if dev.type == "cuda" else "cpu (self)", "shares": shares,
                    "top": [{"name": n[:120], "ms": t, "calls": c, "kind": kind_of(n)} for n, t, c in top],
                    "ok": total > 0})


# --------------------------------------------------------------------------------------------------
# data for the loop and resume stages
# --------------------------------------------------------------------------------------------------
def corpus_slice(corpus: str | None, n_bytes: int, eot: str) -> str:
    """The first ``n_bytes`` of ``corpus`` (synthetic English-like text if None) as ~10 kB documents joined by
    ``eot``: cut at line ends, so that a split by document gives every split some (Shakespeare has 41 works)."""
    if corpus is None:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from _common import synthetic_documents

        return eot.join(synthetic_documents(n_bytes))
    with open(corpus, encoding="utf-8") as f:
        text = f.read(n_bytes).replace(eot, "\n")
    docs, start = [], 0
    while start < len(text):
        end = text.find("\n", start + 10_000)
        end = len(text) if end < 0 else end + 1
        docs.append(text[start:end])
        start = end
    return eot.join(docs)


def shards(work: Path, corpus: str | None, vocab: int, synthetic_bytes: int = 400_000) -> Path:
    """Token shards of ``corpus`` (a local text file; ``synthetic_bytes`` of synthetic English-like text if None)
    with a BPE tokenizer of ``vocab`` tokens trained on it; built once in ``work`` and reused by later stages."""
    out = work / f"shards_{vocab}"
    if (out / "manifest.json").exists():
        return out
    from lmforge.corpus import EOT
    from lmforge.data import prepare
    from lmforge.tokenizer import Tokenizer, train_bpe

    work.mkdir(parents=True, exist_ok=True)
    text = work / "corpus.txt"  # 3 MB of a corpus (400 kB synthetic): tokenizer and shards in seconds
    text.write_text(corpus_slice(corpus, 3_000_000 if corpus else synthetic_bytes, EOT), encoding="utf-8")
    v, merges = train_bpe(text, vocab, [EOT], progress=False)
    prepare(Tokenizer(v, merges, [EOT]), text, out, val_fraction=0.1, progress=False)
    return out


def _shards(a: argparse.Namespace) -> Path:
    """The loop and resume stages' shards (the same for both: built by the first)."""
    return shards(Path(a.work), a.corpus, 300 if a.dry_run else 8192, 100_000 if a.quick else 400_000)


def _run_config(data: Path, shape: str, dev: Any, **training: Any) -> dict[str, Any]:
    d, layers, heads, ctx, vocab, batch = SHAPES[shape]
    return {"model": {"vocab_size": vocab, "context_length": ctx, "d_model": d, "n_layers": layers, "n_heads": heads},
            "optimizer": {"lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 5, "grad_clip": 1.0},
            "training": {"batch_size": batch, "device": str(dev), "dtype": "bf16", "log_every": 1,
                         "eval_every": 10**6, "eval_batches": 1, "checkpoint_every": 10**6, **training},
            "data": {"dir": str(data)}}


# --------------------------------------------------------------------------------------------------
# loop: lmforge's own train()
# --------------------------------------------------------------------------------------------------
def loop(a: argparse.Namespace) -> None:
    from lmforge.train import load_run_config, train as run_train

    dev = _device(a)
    _dry_compile(a)
    shape = "tiny" if a.dry_run else "gpt2"
    steps, every = (6, 2) if a.dry_run else (30, 10)  # past the warm-up's 5 steps
    data = _shards(a)
    cfg = load_run_config(base=_run_config(data, shape, dev, max_steps=steps, log_every=every, compile=True,
                                           num_threads=None))
    t0 = time.perf_counter()
    m = run_train(cfg, Path(a.work) / "loop_run", progress=False, force=True)
    wall = time.perf_counter() - t0
    recs = [json.loads(x) for x in (Path(a.work) / "loop_run" / "metrics.jsonl").read_text().splitlines()]
    tps = [r["tokens_per_s"] for r in recs if "tokens_per_s" in r][1:]  # the first interval holds the compile
    best = sorted(tps)[len(tps) // 2] if tps else None
    from lmforge.model import flops_per_token

    fpt = flops_per_token(cfg.model, cfg.context_length)
    emit(a.result, {"kind": "loop", "shape": shape, "steps": m["step"], "tokens_per_s": best, "wall_s": wall,
                    "mfu": best * fpt / a.peak if best and a.peak else None,
                    "mfu_datasheet": best * fpt / a.datasheet if best and a.datasheet else None, "loss": m["loss"],
                    "ok": m["step"] == steps and m["loss"] is not None and math.isfinite(m["loss"])})


# --------------------------------------------------------------------------------------------------
# resume: FSDP2 + DCP, SIGKILL, resume
# --------------------------------------------------------------------------------------------------
_DETERMINISTIC = ("import sys, torch; torch.use_deterministic_algorithms(True, warn_only=True); "
                  "from lmforge.common import setup_logging; from lmforge.train import load_run_config, train; "
                  "setup_logging(); train(load_run_config(sys.argv[1]), sys.argv[2], progress=False)")


def _launch(cfg_path: Path, run_dir: Path, log: Path) -> subprocess.Popen:
    """``train()`` as rank 0 of a group of one (the torchrun variables), deterministic algorithms on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               CUBLAS_WORKSPACE_CONFIG=":4096:8", PYTHONUNBUFFERED="1")
    with open(log, "a") as f:
        return subprocess.Popen([sys.executable, "-c", _DETERMINISTIC, str(cfg_path), str(run_dir)], stdout=f,
                                stderr=subprocess.STDOUT, env=env, cwd=ROOT)


def _losses(run_dir: Path) -> dict[int, float]:
    """``{step: train loss}`` of the complete lines of a run's ``metrics.jsonl`` (a killed run may leave half one)."""
    path = run_dir / "metrics.jsonl"
    out = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "loss" in r:
            out[r["step"]] = r["loss"]
    return out


def _fail(what: str, log: Path) -> None:
    """Show the end of the runs' log (it lives in the scratch folder, removed after the check), then exit 1."""
    print("\n".join(log.read_text(errors="replace").splitlines()[-30:]))
    sys.exit(what)


def resume(a: argparse.Namespace) -> None:
    import yaml

    dev = _device(a)
    work = Path(a.work)
    data = _shards(a)
    # killed once a step past kill_at is logged; steps - kill_at - 1 steps, a checkpoint and the eval are the room
    steps, every, kill_at = (8, 4, 4) if a.quick else (12, 4, 8)
    cfg = _run_config(data, "tiny" if a.dry_run else "small", dev, max_steps=steps, checkpoint_every=every,
                      parallel="fsdp", checkpoint_format="dcp", dtype="fp32" if a.dry_run else "bf16",
                      num_threads=None)
    cfg_path = work / "resume.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    log = work / "resume.log"
    ref, killed = work / "resume_ref", work / "resume_killed"
    if _launch(cfg_path, ref, log).wait() != 0:
        _fail("the uninterrupted FSDP run failed", log)
    p = _launch(cfg_path, killed, log)
    marker = killed / "checkpoints" / f"step_{kill_at:08d}.dcp" / "lmforge-dcp.json"  # written last: complete
    while p.poll() is None and not marker.exists():
        time.sleep(0.02)
    soon = time.monotonic() + 5  # then mid-run: a step past the checkpoint logged (the resume must forget it)
    while p.poll() is None and time.monotonic() < soon and max(_losses(killed), default=0) <= kill_at:
        time.sleep(0.02)
    if p.poll() is not None:
        _fail(f"the run to kill ended (exit {p.returncode}) before it could be killed after its step-{kill_at} "
              "checkpoint", log)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    killed_after = max(_losses(killed), default=0)
    if _launch(cfg_path, killed, log).wait() != 0:
        _fail("the resumed FSDP run failed", log)
    want, got = _losses(ref), _losses(killed)
    same_steps = sorted(want) == sorted(got) == list(range(1, steps + 1))
    rel = max((abs(got[s] - want[s]) / max(abs(want[s]), 1e-12) for s in want if s in got), default=math.inf)
    emit(a.result, {"kind": "resume", "ok": same_steps and rel <= (0.0 if a.dry_run else 1e-2),
                    "bitwise": same_steps and rel == 0.0, "max_rel_diff": rel, "killed_after_step": killed_after,
                    "checkpoint_step": kill_at, "steps": steps, "backend": "nccl" if dev.type == "cuda" else "gloo",
                    "deterministic_algorithms": "warn_only"})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stage", choices=("probe", "train", "profile", "loop", "resume"))
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU")
    ap.add_argument("--quick", action="store_true", help="with --dry-run: a step or two of each part")
    ap.add_argument("--result", default=None, help="append JSON lines here")
    ap.add_argument("--shape", default="gpt2", choices=list(SHAPES))
    ap.add_argument("--runs", default="lmforge:eager,hf:eager,lmforge:compiled,hf:compiled,lmforge:compiled_fp8",
                    help="IMPL:MODE,... timed in this order (lmforge:eager|compiled|compiled_fp8, hf:eager|compiled, "
                         "and hf:compiled_layers, a weaker variant labelled so)")
    ap.add_argument("--peak", type=float, default=None, help="measured peak FLOP/s (MFU's denominator)")
    ap.add_argument("--datasheet", type=float, default=None, help="the GPU's datasheet bf16 peak FLOP/s")
    ap.add_argument("--work", default="gpu-check-out/work", help="scratch folder (shards, runs)")
    ap.add_argument("--corpus", default=None, help="a local text file for the loop/resume data (default: synthetic)")
    a = ap.parse_args()
    {"probe": probe, "train": train, "profile": profile, "loop": loop, "resume": resume}[a.stage](a)


if __name__ == "__main__":
    main()
