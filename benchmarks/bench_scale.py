"""Scale-out on this CPU: DDP at 2 processes vs 1, gloo all-reduce per step, activation checkpointing, and
checkpoint save/load gathered to rank 0 vs sharded (DCP).

* **DDP**: ``lmforge train`` with the same global batch, once as 1 process with 2 threads and once as
  ``torchrun --nproc_per_node 2`` with 1 thread each (the same 2 cores), alternating for ``--rounds``
  rounds; tokens/s from the run's ``metrics.jsonl`` (the first logged interval, with warm-up, excluded).
  Beside it, a torchrun child times ``dist.all_reduce`` (gloo) of one model's worth of float32 gradients:
  the communication DDP adds to each step.
* **Activation checkpointing**: forward + backward of one micro-batch with and without
  ``checkpoint_blocks`` (each in its own child, alternating): median step time, the bytes autograd keeps
  for the backward pass (counted with ``saved_tensors_hooks``: exact), and the child's peak RSS.
* **Checkpoints**: a torchrun child with 2 ranks (FSDP2, AdamW state) times saving and loading the same state
  gathered to one file on rank 0 (``training.checkpoint_format: file``) and sharded (``dcp``), interleaved.

Muon vs AdamW at equal wall time is ``benchmarks/bench_muon.py``.

    python benchmarks/bench_scale.py            # d_model 256, 4 layers, T 256: ~5 minutes
    python benchmarks/bench_scale.py --quick    # a tiny model, 1 round: a smoke run (~1 minute)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import child_report, run_child, spread  # noqa: E402
from bench_muon import make_shards  # noqa: E402

SCRIPT = str(Path(__file__).resolve())


def _model_cfg(a: argparse.Namespace) -> dict:
    return {"vocab_size": a.vocab, "context_length": a.context, "d_model": a.d_model, "n_layers": a.layers,
            "n_heads": a.heads}


def _model(a: argparse.Namespace):
    import torch

    from lmforge.model import ModelConfig, TransformerLM

    torch.manual_seed(0)
    return TransformerLM(ModelConfig(**_model_cfg(a)))


# --------------------------------------------------------------------------------------------------
# DDP: 2 processes vs 1, and the gloo all-reduce
# --------------------------------------------------------------------------------------------------
def _train_cmd(world: int, cfg: Path, run: Path) -> list[str]:
    tail = ["-m", "lmforge.cli", "-q", "train", str(cfg), "--run-dir", str(run), "--no-progress"]
    if world == 1:
        return [sys.executable, *tail]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}", *tail]


def ddp_rounds(a: argparse.Namespace, shards: Path, tmp: Path) -> dict[int, list[float]]:
    """tokens/s of ``lmforge train`` at world 1 (2 threads) and world 2 (1 thread each), alternating."""
    import yaml

    out: dict[int, list[float]] = {1: [], 2: []}
    for r in range(a.rounds):
        for world in (1, 2):
            cfg = {"model": _model_cfg(a), "data": {"dir": str(shards), "val_split": None},
                   "optimizer": {"lr": 1e-3, "warmup_steps": 2, "schedule": "constant"},
                   "training": {"max_steps": a.steps, "global_batch_size": a.batch, "device": "cpu",
                                "num_threads": 2 // world, "log_every": max(1, a.steps // 4), "eval_every": 10**6,
                                "checkpoint_every": 10**6, "parallel": "ddp"}}
            path, run = tmp / f"ddp{world}.yaml", tmp / f"ddp{world}_{r}"
            path.write_text(yaml.safe_dump(cfg))
            p = subprocess.run(_train_cmd(world, path, run), capture_output=True, text=True, timeout=1800,
                               env=dict(os.environ, OMP_NUM_THREADS=str(2 // world)))
            if p.returncode:
                raise RuntimeError(f"world {world} failed:\n{p.stderr[-3000:]}")
            tps = [json.loads(ln)["tokens_per_s"] for ln in (run / "metrics.jsonl").read_text().splitlines()
                   if '"tokens_per_s"' in ln][1:]  # the first interval holds the warm-up
            out[world].append(statistics.median(tps))
            shutil.rmtree(run)
    return out


def allreduce_child(a: argparse.Namespace) -> None:
    """Under torchrun: median ms of a gloo all-reduce of one model's float32 gradients (DDP's traffic)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    n = sum(p.numel() for p in _model(a).parameters())
    buf = torch.ones(n)
    times = []
    for i in range(a.allreduce_iters + 2):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    if dist.get_rank() == 0:
        child_report(params=n, ms=1e3 * statistics.median(times))
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------
# Activation checkpointing
# --------------------------------------------------------------------------------------------------
def ac_child(a: argparse.Namespace) -> None:
    """Forward + backward of one micro-batch, with (``--ac``) or without activation checkpointing."""
    import torch

    from lmforge.train.distributed import checkpoint_blocks

    torch.set_num_threads(a.threads)
    model = _model(a)
    if a.ac:
        checkpoint_blocks(model)
    x = torch.randint(0, a.vocab, (a.batch, a.context))
    saved = [0]

    def pack(t):
        saved[0] += t.numel() * t.element_size()
        return t

    times = []
    for i in range(a.steps + 1):
        saved[0] = 0
        t0 = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(x, targets=x)
        loss.backward()
        model.zero_grad(set_to_none=True)
        if i:
            times.append(time.perf_counter() - t0)
    child_report(step_ms=1e3 * statistics.median(times), saved_mb=saved[0] / 2**20)


# --------------------------------------------------------------------------------------------------
# Checkpoints: gathered vs DCP
# --------------------------------------------------------------------------------------------------
def ckpt_child(a: argparse.Namespace) -> None:
    """Under torchrun (FSDP2): save/load time of the same state, gathered to rank 0 vs sharded, interleaved."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from lmforge.checkpoint import CheckpointManager, read_checkpoint, save_checkpoint
    from lmforge.train.dcp import load_dcp, save_dcp
    from lmforge.train.distributed import full_state_dicts, load_full_optimizer_state, setup_distributed, wrap_model
    from lmforge.train.optim import AdamW

    torch.set_num_threads(1)
    info = setup_distributed("cpu")
    model = wrap_model(_model(a), "fsdp", info)
    opt = AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, a.vocab, (2, a.context))
    model(x, targets=x).backward()
    opt.step()
    root = Path(a.ckpt_dir)
    ckpts = CheckpointManager(root, keep_last=1)
    times: dict[str, list[float]] = {k: [] for k in ("file save", "file load", "dcp save", "dcp load")}

    def timed(name, fn):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        times[name].append(time.perf_counter() - t0)

    def file_save():
        m, o = full_state_dicts(model, opt)
        if info.is_main:
            save_checkpoint(m, o, 1, root / "gathered.safetensors")

    def file_load():
        ck = read_checkpoint(root / "gathered.safetensors")
        set_model_state_dict(model, ck.model, options=StateDictOptions(full_state_dict=True))
        load_full_optimizer_state(model, opt, ck.optimizer)

    for _ in range(a.rounds):
        timed("file save", file_save)
        timed("file load", file_load)
        timed("dcp save", lambda: save_dcp(ckpts, model, opt, 1, {"train": {}}))
        timed("dcp load", lambda: load_dcp(ckpts.dcp_path_for(1), model, opt))
    if info.is_main:
        size = {"file": (root / "gathered.safetensors").stat().st_size,
                "dcp": sum(p.stat().st_size for p in ckpts.dcp_path_for(1).iterdir())}
        child_report(times=times, mb={k: v / 2**20 for k, v in size.items()})
    dist.destroy_process_group()


def _torchrun_child(args: list[str]) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", SCRIPT, "--child",
           *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if p.returncode:
        raise RuntimeError(f"torchrun child {args} failed:\n{p.stderr[-3000:]}")
    return json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("{")][-1])


# --------------------------------------------------------------------------------------------------
def _shape_args(a: argparse.Namespace) -> list[str]:
    return ["--vocab", str(a.vocab), "--context", str(a.context), "--d-model", str(a.d_model), "--layers",
            str(a.layers), "--heads", str(a.heads), "--batch", str(a.batch), "--steps", str(a.steps),
            "--rounds", str(a.rounds)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a tiny model and 1 round: a smoke run")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=384)
    ap.add_argument("--batch", type=int, default=8, help="global batch (sequences per step)")
    ap.add_argument("--steps", type=int, default=24, help="training steps per DDP run; timed AC steps")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--allreduce-iters", type=int, default=20)
    ap.add_argument("--child", choices=("allreduce", "ac", "ckpt"), help=argparse.SUPPRESS)
    ap.add_argument("--ac", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ckpt-dir", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.quick and not a.child:
        a.d_model, a.layers, a.heads, a.context, a.vocab, a.batch, a.steps, a.rounds = 64, 2, 2, 64, 300, 4, 8, 1
        a.allreduce_iters = 5
    if a.child == "allreduce":
        return allreduce_child(a)
    if a.child == "ac":
        return ac_child(a)
    if a.child == "ckpt":
        return ckpt_child(a)

    print(f"model: d_model {a.d_model}, {a.layers} layers, T {a.context}, V {a.vocab}; global batch {a.batch}; "
          f"{a.rounds} round(s). CPU, {os.cpu_count()} cores; figures from a shared (loaded) machine.\n")
    with tempfile.TemporaryDirectory(prefix="lmforge-bench-scale-") as tmp_:
        tmp = Path(tmp_)
        (tmp / "data").mkdir()
        shards = make_shards(tmp / "data", a.vocab, "synthetic")
        ddp = ddp_rounds(a, shards, tmp)
        ar = _torchrun_child(["allreduce", *_shape_args(a), "--allreduce-iters", str(a.allreduce_iters)])
        tokens_per_step = a.batch * a.context
        step_ms_2 = 1e3 * tokens_per_step / statistics.median(ddp[2])
        print("### DDP on this CPU: tokens/s, median (range)\n")
        print("| processes x threads | tokens/s | vs 1 process |")
        print("|---|---:|---:|")
        for world in (1, 2):
            print(f"| {world} x {2 // world} | {spread(ddp[world], '.0f')} | "
                  f"{statistics.median(ddp[world]) / statistics.median(ddp[1]):.2f}x |")
        print(f"\ngloo all-reduce of {ar['params']:,} float32 gradients (one DDP step's traffic): {ar['ms']:.2f} ms "
              f"= {100 * ar['ms'] / step_ms_2:.1f}% of a {step_ms_2:.1f} ms world-2 step\n")

        res: dict[str, list[dict]] = {"off": [], "on": []}
        for _ in range(a.rounds):
            for mode in ("off", "on"):
                res[mode].append(run_child(SCRIPT, ["ac", *_shape_args(a), "--threads", str(a.threads),
                                                    *(["--ac"] if mode == "on" else [])], a.threads))
        print(f"### Activation checkpointing: forward + backward of {a.batch} x {a.context} tokens, median (range)\n")
        print("| activation checkpointing | step (ms) | kept for backward (MiB) | peak RSS (MiB) |")
        print("|---|---:|---:|---:|")
        for mode in ("off", "on"):
            col = lambda k, f: spread([r[k] for r in res[mode]], f)  # noqa: E731
            print(f"| {mode} | {col('step_ms', '.1f')} | {col('saved_mb', '.1f')} | {col('rss_mb', '.0f')} |")

        ck = _torchrun_child(["ckpt", *_shape_args(a), "--ckpt-dir", str(tmp / "ckpt")])
        print(f"\n### Checkpoints at 2 ranks (FSDP2, AdamW state): seconds, median (range); "
              f"file {ck['mb']['file']:.1f} MiB, dcp {ck['mb']['dcp']:.1f} MiB\n")
        print("| format | save (s) | load (s) |")
        print("|---|---:|---:|")
        for fmt in ("file", "dcp"):
            print(f"| {fmt} | {spread(ck['times'][f'{fmt} save'], '.3f')} | {spread(ck['times'][f'{fmt} load'], '.3f')} |")


if __name__ == "__main__":
    main()
