"""The training loop: run-dir contents, exact resume (in process and after SIGKILL), bad input, NaN stop, DDP."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from conftest import make_documents
from lmforge import cli
from lmforge.config import load_yaml
from lmforge.train import NonFiniteLossError, RunConfig, load_run_config, train


# --------------------------------------------------------------------------------------------------
# Tiny data made here: a BPE tokenizer on a few KB and shards with train + val splits
# --------------------------------------------------------------------------------------------------
def _make_shards(d: Path, n_docs: int, vocab_size: int = 300) -> Path:
    from lmforge.data import prepare
    from lmforge.tokenizer import Tokenizer, train_bpe

    d.mkdir(parents=True, exist_ok=True)
    corpus = d / "corpus.txt"
    corpus.write_text("<|endoftext|>".join(make_documents(n_docs, seed=3)), encoding="utf-8")
    vocab, merges = train_bpe(corpus, vocab_size, ["<|endoftext|>"], progress=False)
    tok = Tokenizer(vocab, merges, ["<|endoftext|>"])
    prepare(tok, corpus, d / "shards", val_fraction=0.1, progress=False)
    return d / "shards"


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return _make_shards(tmp_path_factory.mktemp("data"), 300)


def _cfg_dict(data_dir: Path, **sections) -> dict:
    d = {
        "model": {"vocab_size": 320, "context_length": 32, "d_model": 32, "n_layers": 2, "n_heads": 2},
        "optimizer": {"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 2, "decay_steps": 40},
        "training": {"max_steps": 8, "batch_size": 4, "grad_accum_steps": 2, "device": "cpu", "log_every": 1,
                     "eval_every": 4, "eval_batches": 2, "checkpoint_every": 3, "keep_last": 2, "num_threads": 1},
        "data": {"dir": str(data_dir)},
    }
    for section, values in sections.items():
        d[section].update(values)
    return d


def _cfg(data_dir: Path, overrides: tuple[str, ...] = (), **sections) -> RunConfig:
    return load_run_config(base=_cfg_dict(data_dir, **sections), overrides=overrides)


def _events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(e["step"], e["loss"]) for e in _events(run_dir) if "loss" in e]


# --------------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("over, msg", [
    (["optimizer.lr=-1e-3"], r"optimizer\.lr must be > 0"),
    (["model.n_heads=3"], r"model\.d_model=32 must be divisible by model\.n_heads=3"),
    (["training.context_length=64"], r"training\.context_length=64 is longer than model\.context_length=32"),
    (["training.batch_size=0"], r"training\.batch_size must be >= 1"),
    (["training.max_stesp=3"], r"unknown config key 'training\.max_stesp' \(did you mean 'training\.max_steps'\?\)"),
    (["traning.max_steps=3"], r"unknown config key 'traning' \(did you mean 'training'\?\)"),
    (["training.max_steps=many"], r"'training\.max_steps' must be an integer"),
    (["training.dtype=fp8"], r"'training\.dtype' must be one of 'fp32', 'bf16'"),
    (["optimizer.betas=[0.9, 1.5]"], r"optimizer\.betas must be two numbers in \[0, 1\)"),
    (["optimizer.warmup_steps=50", "optimizer.decay_steps=null"], r"warmup_steps=50 must be < training\.max_steps"),
    (["data.dir="], r"data\.dir is empty"),
    (["optimizer.name=lion"], r"'optimizer\.name' must be one of 'adamw', 'sgd', 'muon', got 'lion'"),
    (["optimizer.muon_lr=0"], r"optimizer\.muon_lr must be > 0"),
    (["optimizer.head_lr=0"], r"optimizer\.head_lr must be > 0 \(or null for optimizer\.lr\)"),
    (["optimizer.name=sgd", "optimizer.embed_lr=0.1"], r"embed_lr/head_lr/scalar_lr apply to adamw and muon"),
    (["training.batch_warmup_steps=-1"], r"training\.batch_warmup_steps must be >= 0"),
    (["training.batch_warmup_start=0"], r"training\.batch_warmup_start must be in \(0, 1\]"),
    (["optimizer.muon_momentum=1.0"], r"optimizer\.muon_momentum must be in \[0, 1\)"),
    (["optimizer.muon_momentum_warmup_steps=-1"], r"optimizer\.muon_momentum_warmup_steps must be >= 0"),
    (["optimizer.muon_momentum_start=1.0"], r"optimizer\.muon_momentum_start must be in \[0, 1\)"),
    (["optimizer.name=sgd", "optimizer.dmodel_lr_scale=true"], r"optimizer\.dmodel_lr_scale scales AdamW's"),
    (["optimizer.muon_ns_steps=0"], r"optimizer\.muon_ns_steps must be in \[1, 100\)"),
    (["optimizer.muon_adjust_lr=spectral"], r"'optimizer\.muon_adjust_lr' must be one of 'original', 'match_rms_adamw'"),
])
def test_invalid_config_values(tmp_path, over, msg) -> None:
    with pytest.raises(ValueError, match=msg):
        _cfg(tmp_path, tuple(over))


def test_config_file_and_cli_errors(tmp_path, capsys) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(_cfg_dict(tmp_path)))
    cfg = load_run_config(path, ["training.max_steps=5", "optimizer.lr=1e-3"])
    assert (cfg.training.max_steps, cfg.optimizer.lr, cfg.context_length) == (5, 1e-3, 32)
    rc = cli.main(["train", str(path), "--set", "training.eval_evry=3", "--run-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert rc == 2 and "did you mean 'training.eval_every'" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "r").exists()


def test_a_model_too_large_for_memory_is_one_line(tiny_run, tmp_path, capsys) -> None:
    """An allocation that fails (here the embedding of 2**40 rows: 128 TiB) ends in one line, exit code 1."""
    rc = cli.main(["-q", "train", str(tiny_run / "config.yaml"), "--run-dir", str(tmp_path / "r"),
                   "--set", "model.vocab_size=1099511627776", "--set", "training.max_steps=2"])
    err = capsys.readouterr().err
    assert rc == 1 and len(err.strip().splitlines()) == 1, err
    assert "not enough memory: an allocation of 131,072.0 GiB failed; a smaller model" in err


def test_examples_parse() -> None:
    for path in sorted((Path(__file__).parents[2] / "examples").glob("*.yaml")):
        load_run_config(path)


# --------------------------------------------------------------------------------------------------
# A run and its directory
# --------------------------------------------------------------------------------------------------
def test_run_dir_contents_and_metrics(shards, tmp_path) -> None:
    run = tmp_path / "run"
    cfg = _cfg(shards, training={"peak_flops": 1e12})
    m = train(cfg, run, progress=True)
    assert m["step"] == 8 and m["tokens"] == 8 * 4 * 32 * 2
    assert m["val_loss"] < 6.0 and m["val_bpb"] > 0 and m["best_val_loss"] <= m["val_loss"] + 1e-12
    assert 0 < m["mfu"] < 1 and m["tokens_per_s"] > 0
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(r["mfu_basis"] == "vs training.peak_flops" for r in logged if r.get("mfu"))  # MFU names its peak
    assert any(r.get("mfu") for r in logged)
    assert load_run_config(run / "config.yaml") == cfg  # resolved config saved, loads back
    from lmforge.tokenizer import Tokenizer
    assert Tokenizer.load(run / "tokenizer.json").fingerprint() == Tokenizer.load(shards / "tokenizer.json").fingerprint()
    ck = run / "checkpoints"
    assert sorted(p.name for p in ck.iterdir()) == ["best.safetensors", "step_00000006.safetensors",
                                                   "step_00000008.safetensors"]  # keep_last=2, + best
    events = _events(run)
    assert [s for s, _ in _losses(run)] == list(range(1, 9))
    vals = [e for e in events if "val_loss" in e]
    assert [e["step"] for e in vals] == [4, 8] and vals[-1]["val_loss"] == m["val_loss"]
    assert abs(vals[-1]["val_ppl"] - torch.tensor(vals[-1]["val_loss"]).exp().item()) < 1e-3
    assert _losses(run)[-1][1] < _losses(run)[0][1]  # it learns
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    from lmforge.checkpoint import read_metadata
    assert read_metadata(ck / "best.safetensors")["extra"]["val_loss"] == min(e["val_loss"] for e in vals)

    # a finished run started again does nothing and reports the same metrics
    again = train(cfg, run, progress=False)
    assert again["step"] == 8 and again["val_loss"] == m["val_loss"] and _events(run) == events


def test_resume_in_process_equals_uninterrupted(shards, tmp_path) -> None:
    full = tmp_path / "full"
    train(_cfg(shards, training={"max_steps": 10}), full, progress=False)
    split = tmp_path / "split"
    train(_cfg(shards, training={"max_steps": 5}), split, progress=False)  # checkpoints at 3 and 5 (the end)
    for leftover in (split / ".loss.png.lmforge-x1.tmp", split / "checkpoints" / ".step_00000006.safetensors.lmforge-x2.tmp"):
        leftover.write_bytes(b"half-written by a killed process")
    train(_cfg(shards, training={"max_steps": 10}), split, progress=False)  # max_steps may change: resumes at 5
    assert _losses(split) == _losses(full)  # float equality, every step
    assert list(split.rglob(".*.tmp")) == []
    vals = lambda r: [(e["step"], e["val_loss"]) for e in _events(r) if "val_loss" in e and e["step"] != 5]
    assert vals(split) == vals(full)


def test_muon_resume_in_process_equals_uninterrupted(shards, tmp_path, caplog) -> None:
    muon = {"name": "muon", "muon_lr": 0.02}
    full, split, adamw = tmp_path / "full", tmp_path / "split", tmp_path / "adamw"
    with caplog.at_level(logging.INFO, logger="lmforge"):
        train(_cfg(shards, optimizer=muon, training={"max_steps": 8}), full, progress=False)
    groups = [r.getMessage() for r in caplog.records if r.getMessage().startswith("optimizer groups:")]
    assert groups == ["optimizer groups: muon: 14 tensors (0.0205M params, lr x6.67); adamw_embeddings_head: 2 "
                      "tensors (0.0205M params, lr x1); adamw_norms_biases: 5 tensors (0.00016M params, lr x1)"]
    train(_cfg(shards, optimizer=muon, training={"max_steps": 5}), split, progress=False)  # checkpoints at 3, 5
    train(_cfg(shards, optimizer=muon, training={"max_steps": 8}), split, progress=False)
    assert _losses(split) == _losses(full)  # float equality, every step
    train(_cfg(shards, training={"max_steps": 8}), adamw, progress=False)
    assert _losses(full) != _losses(adamw) and _losses(full)[-1][1] < _losses(full)[0][1]  # another optimizer; learns
    from lmforge.checkpoint import read_checkpoint
    groups = read_checkpoint(full / "checkpoints" / "step_00000008.safetensors").optimizer["param_groups"]
    lrs = {g["name"]: g["lr"] for g in groups}  # the schedule scaled every group by the same factor
    assert lrs["muon"] == pytest.approx(lrs["adamw_norms_biases"] * 0.02 / 3e-3) and lrs["adamw_norms_biases"] < 3e-3


def test_nanochat_optimizer_settings_reach_the_optimizer_and_resume_exactly(shards, tmp_path) -> None:
    """Muon with nanochat's AdamW settings (no weight decay, betas (0.8, 0.95), eps 1e-10, rates times
    (d_model/768)^-0.5) and its momentum warm-up: each reaches the saved optimizer groups, the momentum follows the
    step (0.85 + 0.1 * 7/10 at the eighth step), and a run stopped at step 5 resumes bit for bit."""
    from lmforge.checkpoint import read_checkpoint

    nc = {"name": "muon", "embed_lr": 0.2, "head_lr": 0.004, "scalar_lr": 0.02, "weight_decay": 0.0,
          "betas": [0.8, 0.95], "eps": 1e-10, "dmodel_lr_scale": True, "muon_momentum_warmup_steps": 10}
    full, split = tmp_path / "full", tmp_path / "split"
    train(_cfg(shards, optimizer=nc, training={"max_steps": 8}), full, progress=False)
    train(_cfg(shards, optimizer=nc, training={"max_steps": 5}), split, progress=False)  # checkpoints at 3 and 5
    train(_cfg(shards, optimizer=nc, training={"max_steps": 8}), split, progress=False)
    assert _losses(split) == _losses(full)  # float equality, every step
    for run in (full, split):
        saved = read_checkpoint(run / "checkpoints" / "step_00000008.safetensors").optimizer["param_groups"]
        g = {x["name"]: x for x in saved}
        assert g["muon"]["momentum"] == pytest.approx(0.92) and g["muon"]["weight_decay"] == 0.0
        scale = (32 / 768) ** -0.5
        assert [g[n]["lr_scale"] * 3e-3 for n in ("adamw_embeddings", "adamw_head", "adamw_norms_biases")] == \
            pytest.approx([0.2 * scale, 0.004 * scale, 0.02])
        for n in ("adamw_embeddings", "adamw_head", "adamw_norms_biases"):
            assert (tuple(g[n]["betas"]), g[n]["eps"], g[n]["weight_decay"]) == ((0.8, 0.95), 1e-10, 0.0)


def test_fp8_training_resumes_exactly_and_follows_float32(shards, tmp_path, caplog) -> None:
    """training.fp8 (on the CPU's float8 kernel): the blocks' projections multiply in float8, the run resumes bit
    for bit, its checkpoints hold the same tensors as a float32 run's, and its losses stay within 3% of them."""
    from lmforge.checkpoint import read_checkpoint

    full, split, plain = tmp_path / "full", tmp_path / "split", tmp_path / "plain"
    with caplog.at_level(logging.INFO, logger="lmforge"):
        train(_cfg(shards, training={"max_steps": 8, "fp8": True}), full, progress=False)
    assert any("14 projections multiply in float8" in r.getMessage() for r in caplog.records)
    train(_cfg(shards, training={"max_steps": 5, "fp8": True}), split, progress=False)  # checkpoints at 3, 5
    train(_cfg(shards, training={"max_steps": 8, "fp8": True}), split, progress=False)
    assert _losses(split) == _losses(full)  # float equality, every step
    train(_cfg(shards, training={"max_steps": 8}), plain, progress=False)
    f8, f32 = [v for _, v in _losses(full)], [v for _, v in _losses(plain)]
    assert f8 != f32 and max(abs(a - b) / b for a, b in zip(f8, f32)) < 0.03, list(zip(f8, f32))
    ck = lambda r: read_checkpoint(r / "checkpoints" / "step_00000008.safetensors").model  # noqa: E731
    assert {k: v.shape for k, v in ck(full).items()} == {k: v.shape for k, v in ck(plain).items()}


def test_a_second_trainer_in_the_same_run_directory_is_refused(shards, tmp_path, capsys) -> None:
    """Two processes training into one run directory interleaved their checkpoints and metrics: the one that
    comes second is refused in one line (exit 2) and writes nothing; once the first is gone, training resumes."""
    from lmforge import cli
    from lmforge.run import LOCK, run_lock

    run = tmp_path / "run"
    train(_cfg(shards, training={"max_steps": 3}), run, progress=False)
    before = sorted((p.name, p.stat().st_mtime_ns) for p in run.rglob("*") if p.name != LOCK)
    with run_lock(run):  # as the first trainer holds it
        with pytest.raises(ValueError, match=r"another process \(pid \d+\) is training in"):
            train(_cfg(shards, training={"max_steps": 6}), run, progress=False)
        cfg = tmp_path / "cfg.yaml"
        cfg.write_text(json.dumps(_cfg_dict(shards, training={"max_steps": 6})))
        assert cli.main(["-q", "train", str(cfg), "--run-dir", str(run)]) == 2
        err = capsys.readouterr().err
        assert "is training in" in err and len(err.strip().splitlines()) == 1
    assert sorted((p.name, p.stat().st_mtime_ns) for p in run.rglob("*") if p.name != LOCK) == before
    train(_cfg(shards, training={"max_steps": 6}), run, progress=False)
    assert _losses(run)[-1][0] == 6
    fresh = tmp_path / "fresh"
    with run_lock(fresh):
        pass  # a run that never began leaves only its lock: still a new run directory
    train(_cfg(shards, training={"max_steps": 2}), fresh, progress=False)


def test_batch_warmup_grows_the_batch_and_resumes_exactly(shards, tmp_path) -> None:
    warm = {"max_steps": 8, "batch_warmup_steps": 4}  # rows of each 4-row micro-batch: 1, 2, 3, 4, 4, ...
    full, split, plain = tmp_path / "full", tmp_path / "split", tmp_path / "plain"
    train(_cfg(shards, training=warm), full, progress=False)
    tokens = [e["tokens"] for e in _events(full) if "loss" in e]
    assert [b - a for a, b in zip([0] + tokens, tokens)] == [r * 32 * 2 for r in (1, 2, 3, 4, 4, 4, 4, 4)]
    train(_cfg(shards, training={**warm, "max_steps": 5}), split, progress=False)  # checkpoints at 3 and 5
    train(_cfg(shards, training=warm), split, progress=False)
    assert _losses(split) == _losses(full)  # float equality, every step
    train(_cfg(shards, training={"max_steps": 8}), plain, progress=False)
    assert _losses(plain)[0] != _losses(full)[0]  # the warm-up trained on fewer rows


def test_per_group_learning_rates_reach_the_optimizer(shards, tmp_path, caplog) -> None:
    rates = {"embed_lr": 0.01, "head_lr": 0.001, "scalar_lr": 0.006}
    for name, groups in (("adamw", ("hidden", "embeddings", "head", "scalars")),
                         ("muon", ("muon", "adamw_embeddings", "adamw_head", "adamw_norms_biases"))):
        run = tmp_path / name
        train(_cfg(shards, optimizer={"name": name, **rates}, training={"max_steps": 3}), run, progress=False)
        from lmforge.checkpoint import read_checkpoint
        saved = read_checkpoint(run / "checkpoints" / "step_00000003.safetensors").optimizer["param_groups"]
        lrs = {g["name"]: g["lr"] for g in saved}
        assert tuple(lrs) == groups
        base = lrs[groups[0]] / (0.02 / 3e-3 if name == "muon" else 1.0)  # the scheduled lr at step 3
        assert [lrs[g] / base for g in groups[1:]] == pytest.approx([0.01 / 3e-3, 0.001 / 3e-3, 0.006 / 3e-3])


def _draw() -> tuple[list[float], float, list[float]]:
    """One draw from each global generator a resume must restore: torch's, Python's, NumPy's."""
    import random

    import numpy as np
    return torch.rand(4).tolist(), random.random(), np.random.rand(4).tolist()


def test_rng_state_round_trips_through_a_checkpoint_file(tmp_path) -> None:
    """What `train` saves as its RNG state, written to a checkpoint file and read back, replays the same draws."""
    from lmforge.checkpoint import read_checkpoint, save_checkpoint
    from lmforge.common import seed_everything
    from lmforge.train.loop import _rng_state, _set_rng_state

    seed_everything(123)
    _draw()  # somewhere in the middle of the streams, not at a seed
    save_checkpoint(torch.nn.Linear(2, 2), None, 7, tmp_path / "c.safetensors",
                    {"train": {"rng": _rng_state(torch.device("cpu"))}})
    first, second = _draw(), _draw()
    assert first != second  # the draws move the generators: a replay below is not a coincidence
    _set_rng_state(read_checkpoint(tmp_path / "c.safetensors").extra["train"]["rng"], torch.device("cpu"))
    assert _draw() == first and _draw() == second


def test_resume_restores_the_global_rngs(shards, tmp_path, monkeypatch) -> None:
    """The loop itself draws nothing from the global generators, so the other resume tests cannot see a
    missing RNG restore. Here every training forward scales the loss by a draw from all three (as dropout
    would draw), so a resume that skips the restore repeats the first steps' draws and the losses differ."""
    from lmforge.model import TransformerLM

    forward = TransformerLM.forward

    def noisy(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        if self.training:
            t, p, n = _draw()
            out = out * (1 + 1e-2 * (t[0] + p + n[0]))
        return out

    monkeypatch.setattr(TransformerLM, "forward", noisy)
    full, split = tmp_path / "full", tmp_path / "split"
    train(_cfg(shards, training={"max_steps": 8}), full, progress=False)
    train(_cfg(shards, training={"max_steps": 4, "checkpoint_every": 4}), split, progress=False)
    train(_cfg(shards, training={"max_steps": 8}), split, progress=False)  # resumes at 4
    assert _losses(split) == _losses(full)


def test_resume_skips_corrupt_newest_checkpoint(shards, tmp_path, caplog) -> None:
    full, run = tmp_path / "full", tmp_path / "run"
    train(_cfg(shards, training={"max_steps": 9}), full, progress=False)
    train(_cfg(shards, training={"max_steps": 7, "checkpoint_every": 3, "keep_last": 3}), run, progress=False)
    newest = run / "checkpoints" / "step_00000007.safetensors"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"incompatible config \(data\.train_split: 'train' -> 'val'"):
        train(_cfg(shards, data={"train_split": "val"}, training={"max_steps": 3}), run, progress=False)
    with caplog.at_level(logging.INFO, logger="lmforge"):
        train(_cfg(shards, training={"max_steps": 9, "checkpoint_every": 3, "keep_last": 3}), run, progress=False)
    assert f"checkpoint {newest} is corrupt" in caplog.text and "falling back to" in caplog.text
    assert "resumed from" in caplog.text and "step_00000006" in caplog.text
    assert _losses(run) == _losses(full)


def test_grad_accumulation_matches_one_big_batch(shards, tmp_path) -> None:
    # SGD without clipping is sensitive to the gradient's scale, so a wrong normalisation shows at step 2.
    # Both runs see the same blocks in the same order: B=4 x 1 micro-batch == B=2 x 2 micro-batches.
    sgd = {"name": "sgd", "lr": 0.5, "min_lr": 0.0, "warmup_steps": 0, "grad_clip": 0.0}
    big, accum = tmp_path / "big", tmp_path / "accum"
    train(_cfg(shards, optimizer=sgd, training={"max_steps": 4, "batch_size": 4, "grad_accum_steps": 1}), big,
          progress=False)
    train(_cfg(shards, optimizer=sgd, training={"max_steps": 4, "batch_size": 2, "grad_accum_steps": 2}), accum,
          progress=False)
    a, b = [v for _, v in _losses(big)], [v for _, v in _losses(accum)]
    assert a == pytest.approx(b, rel=1e-5) and a[0] != a[-1]


def test_bf16_autocast_on_cpu(shards, tmp_path) -> None:
    """bf16 autocast follows the fp32 run to within one bf16 rounding (2**-8 relative; measured: 5e-5, the loss
    averages the errors out), and really runs in bf16 (the losses are not fp32's bit for bit)."""
    runs = {}
    for dtype in ("fp32", "bf16"):
        m = train(_cfg(shards, training={"max_steps": 4, "dtype": dtype, "eval_every": 4}), tmp_path / dtype,
                  progress=False)
        runs[dtype] = [v for _, v in _losses(tmp_path / dtype)], m["val_loss"]
    (fp32, val32), (bf16, val16) = runs["fp32"], runs["bf16"]
    assert len(bf16) == len(fp32) == 4 and bf16 != fp32
    assert bf16 == pytest.approx(fp32, rel=2**-8) and val16 == pytest.approx(val32, rel=2**-8)


def test_bf16_resume_in_process_equals_uninterrupted(shards, tmp_path) -> None:
    """Master weights and optimizer state stay fp32 under bf16 autocast, so a bf16 run resumes bit for bit."""
    bf16 = {"dtype": "bf16", "eval_every": 3}
    full, split = tmp_path / "full", tmp_path / "split"
    train(_cfg(shards, training={**bf16, "max_steps": 6}), full, progress=False)
    train(_cfg(shards, training={**bf16, "max_steps": 3}), split, progress=False)
    train(_cfg(shards, training={**bf16, "max_steps": 6}), split, progress=False)
    assert len(_losses(full)) == 6 and _losses(split) == _losses(full)  # float equality, every step
    from lmforge.checkpoint import read_checkpoint
    ck = read_checkpoint(full / "checkpoints" / "step_00000006.safetensors")
    assert {t.dtype for t in ck.model.values()} == {torch.float32}
    assert {v.dtype for st in ck.optimizer["state"].values() for v in st.values() if torch.is_tensor(v) and v.dim()} == {torch.float32}


def test_dtype_auto_resolves_per_device_and_bf16_without_native_warns(shards, tmp_path, monkeypatch, caplog) -> None:
    """``auto`` is saved as what the device runs fast (fp32 on a CPU without native bf16, bf16 where it is native);
    an explicit bf16 on a CPU without it trains, warning once with the two measured matmul rates."""
    import lmforge.hardware as hardware

    train(_cfg(shards, training={"max_steps": 2, "dtype": "auto"}), tmp_path / "cpu", progress=False)
    assert load_yaml(tmp_path / "cpu" / "config.yaml")["training"]["dtype"] == ("bf16" if hardware.native_bf16("cpu")
                                                                               else "fp32")
    monkeypatch.setattr(hardware, "native_bf16", lambda device: True)
    train(_cfg(shards, training={"max_steps": 2, "dtype": "auto"}), tmp_path / "native", progress=False)
    assert load_yaml(tmp_path / "native" / "config.yaml")["training"]["dtype"] == "bf16"
    monkeypatch.setattr(hardware, "native_bf16", lambda device: False)
    monkeypatch.setattr(hardware, "_warned_slow_bf16", set())
    with caplog.at_level(logging.WARNING, logger="lmforge"):
        for name in ("slow1", "slow2"):
            train(_cfg(shards, training={"max_steps": 2, "dtype": "bf16"}), tmp_path / name, progress=False)
    warned = [r.getMessage() for r in caplog.records if "without native bf16" in r.getMessage()]
    assert len(warned) == 1 and re.search(r"run at [\d.]+ GFLOP/s here against [\d.]+ in fp32", warned[0])
    assert load_yaml(tmp_path / "slow1" / "config.yaml")["training"]["dtype"] == "bf16"


def test_target_val_bpb_stops_at_the_first_evaluation_reaching_it(shards, tmp_path) -> None:
    m = train(_cfg(shards, training={"max_steps": 8, "eval_every": 2, "checkpoint_every": 100,
                                     "target_val_bpb": 1000.0}), tmp_path / "easy", progress=False)
    assert m["reached_target"] and m["step"] == 2 and m["checkpoint"].endswith("step_00000002.safetensors")
    assert [e["step"] for e in _events(tmp_path / "easy") if "val_bpb" in e] == [2]
    judged = [e for e in _events(tmp_path / "easy") if "target_eval_bpb" in e]  # the whole split, scored once
    assert [e["step"] for e in judged] == [2] and judged[0]["target_eval_bpb"] <= 1000.0
    m = train(_cfg(shards, training={"max_steps": 6, "eval_every": 2, "target_val_bpb": 1e-6}), tmp_path / "hard",
              progress=False)
    assert not m["reached_target"] and m["step"] == 6
    with pytest.raises(ValueError, match="target_val_bpb must be > 0"):
        _cfg(shards, training={"target_val_bpb": 0.0})


def test_target_val_bpb_is_judged_on_the_whole_split_not_on_the_periodic_estimate(tmp_path, caplog) -> None:
    """A validation split whose first blocks (the periodic estimate's) are training text and whose rest is noise:
    the estimate reaching the target does not stop the run while the whole split misses it; one log line gives
    both figures, and the extra evaluation leaves training untouched (the same losses as a run without a target)."""
    import random

    from lmforge.data import prepare
    from lmforge.tokenizer import Tokenizer, train_bpe
    from lmforge.train import evaluate_run

    docs = make_documents(200, seed=3)
    (tmp_path / "train.txt").write_text("<|endoftext|>".join(docs), encoding="utf-8")
    noise = "".join(random.Random(0).choice("qxzjkvwy0123456789#%&@") for _ in range(6000))
    (tmp_path / "val.txt").write_text(" ".join(docs[:20]) + noise, encoding="utf-8")  # one document: easy, then hard
    vocab, merges = train_bpe(tmp_path / "train.txt", 300, ["<|endoftext|>"], progress=False)
    tok = Tokenizer(vocab, merges, ["<|endoftext|>"])
    data = tmp_path / "shards"
    prepare(tok, tmp_path / "train.txt", data, split="train", progress=False)
    prepare(tok, tmp_path / "val.txt", data, split="val", append=True, progress=False)
    training = {"max_steps": 4, "eval_every": 2, "checkpoint_every": 2}
    train(_cfg(data, training=training), tmp_path / "plain", progress=False)
    estimate = next(e["val_bpb"] for e in _events(tmp_path / "plain") if e.get("val_bpb") and e["step"] == 2)
    whole = evaluate_run(tmp_path / "plain", tmp_path / "plain/checkpoints/step_00000002.safetensors",
                         max_batches=10**6, device="cpu")["bpb"]
    assert estimate < whole  # the data do what the test needs
    target = (estimate + whole) / 2
    with caplog.at_level(logging.INFO, logger="lmforge"):
        m = train(_cfg(data, training={**training, "target_val_bpb": target}), tmp_path / "target", progress=False)
    assert m["step"] == 4 and _losses(tmp_path / "target") == _losses(tmp_path / "plain")  # steps 3, 4 untouched
    said = [r.getMessage() for r in caplog.records if "reached the target" in r.getMessage()]
    assert re.fullmatch(rf"step 2: the estimate on 256 validation tokens, {estimate:.4f} bits/byte, reached the target "
                        rf"{target:.4f}, but the whole validation split \(\d+ tokens\) is at {whole:.4f}; training on",
                        said[0]), said
    assert not any(line.startswith("step 2") and "stopping" in line for line in said)
    judged = {e["step"]: e["target_eval_bpb"] for e in _events(tmp_path / "target") if "target_eval_bpb" in e}
    assert judged[2] == pytest.approx(whole, rel=1e-6)


# --------------------------------------------------------------------------------------------------
# The default thread count: two fresh runs under load, bit for bit
# --------------------------------------------------------------------------------------------------
_HOG = "import time\nend = time.time() + 600\nwhile time.time() < end:\n    pass\n"


@pytest.mark.slow
@pytest.mark.timeout(240)  # ~30-90 s measured on 2 shared cores
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core: no threads to race")
def test_default_threads_give_the_same_run_bit_for_bit_under_load(shards, tmp_path) -> None:
    """Two identical fresh runs with torch's default thread count, started together beside a busy-looping
    process: the same losses and the same final weights, bit for bit. (The embedding gradient once went
    through indexing's backward, whose atomic adds from parallel threads summed in timing order: such runs
    differed in the last bits within a few steps.)"""
    from lmforge.checkpoint import CheckpointManager

    cfg = _cfg_dict(shards, model={"context_length": 64, "d_model": 64, "n_heads": 2},
                    training={"max_steps": 6, "batch_size": 8, "grad_accum_steps": 1, "num_threads": None,
                              "eval_every": 100, "checkpoint_every": 100})
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    hog = subprocess.Popen([sys.executable, "-c", _HOG])
    procs = []
    try:
        for name in ("a", "b"):
            procs.append(subprocess.Popen([sys.executable, "-m", "lmforge.cli", "-q", "train", str(cfg_path),
                                           "--run-dir", str(tmp_path / name), "--no-progress"], env=env,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        for name, proc in zip("ab", procs):
            assert _wait(proc, 200, f"run {name}") == 0, proc.stderr.read().decode()
    finally:
        for p in [hog, *procs]:
            if p.poll() is None:
                p.kill()
                p.wait()
    a, b = _losses(tmp_path / "a"), _losses(tmp_path / "b")
    assert len(a) == 6 and [v.hex() for _, v in a] == [v.hex() for _, v in b]
    wa, wb = (CheckpointManager(tmp_path / n).load_latest()[1].model for n in "ab")
    assert all(torch.equal(wa[k], wb[k]) for k in wa), [k for k in wa if not torch.equal(wa[k], wb[k])]


# --------------------------------------------------------------------------------------------------
# Real SIGKILL + restart in a subprocess == uninterrupted
# --------------------------------------------------------------------------------------------------
_SLOW_MAIN = """
import sys, time
from lmforge.data import loader
next_batch = loader.BlockLoader.next_batch
def slow(self):  # sleeping changes no number; it only keeps the run alive long enough to be killed mid-way
    time.sleep(float(sys.argv[1]))
    return next_batch(self)
loader.BlockLoader.next_batch = slow
from lmforge.cli import main
sys.exit(main(sys.argv[2:]))
"""


def _start(cfg_path: Path, run_dir: Path, delay: float = 0.0) -> subprocess.Popen:
    script = cfg_path.parent / "slow_main.py"
    script.write_text(_SLOW_MAIN)
    cmd = [sys.executable, str(script), str(delay), "-q", "train", str(cfg_path), "--run-dir", str(run_dir),
           "--no-progress"]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


@pytest.mark.slow
@pytest.mark.timeout(180)  # 15-55 s measured on 2 shared cores; a hang must fail, not wait out the 300 s default
def test_sigkill_and_restart_equals_uninterrupted(shards, tmp_path) -> None:
    """The run grows its batch over the first 20 steps and is killed at step 13, inside the warm-up.

    Each wait has its own bound, so a run that hangs (say, a loader resume that never yields a batch) fails
    within 75 s, naming the process, with its stderr; every child is killed on the way out."""
    # with a batch-size warm-up over the first 20 steps: killed inside it (rows per micro-batch 1 -> 4)
    cfg = _cfg_dict(shards, training={"max_steps": 30, "checkpoint_every": 5, "eval_every": 10,
                                      "batch_warmup_steps": 20})
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    full, killed = tmp_path / "full", tmp_path / "killed"
    procs = [_start(cfg_path, full)]
    try:
        ref = procs[0]
        proc = _start(cfg_path, killed, delay=0.03)
        procs.append(proc)
        metrics = killed / "metrics.jsonl"
        deadline = time.time() + 75
        while time.time() < deadline:  # wait until step 13 is logged: between the checkpoints at 10 and 15
            if metrics.exists() and any(json.loads(ln).get("step", 0) >= 13
                                        for ln in metrics.read_text().splitlines() if ln.endswith("}")):
                break
            assert proc.poll() is None, proc.stderr.read().decode()
            time.sleep(0.005)
        else:
            pytest.fail("the run to be killed logged no step 13 within 75 s")
        assert proc.poll() is None, "the run finished before it could be killed"
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
        steps_before = [s for s, _ in _losses(killed)]
        assert 13 <= steps_before[-1] < 30

        restart = _start(cfg_path, killed)
        procs.append(restart)
        assert _wait(restart, 75, "the restarted run") == 0, restart.stderr.read().decode()
        assert _wait(ref, 30, "the uninterrupted run") == 0, ref.stderr.read().decode()  # no delays: done by now
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [s for s, _ in _losses(killed)] == list(range(1, 31))
    assert _losses(killed) == _losses(full)  # bit for bit
    vals = lambda r: [(e["step"], e["val_loss"]) for e in _events(r) if "val_loss" in e]
    assert vals(killed) == vals(full)
    assert list(killed.rglob(".*.tmp")) == []


def _wait(proc: subprocess.Popen, seconds: float, what: str) -> int:
    """``proc``'s exit code, or a test failure with its stderr if it runs longer than ``seconds``."""
    try:
        return proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"{what} did not finish within {seconds} s (hung?); stderr:\n{err.decode()[-2000:]}")


# --------------------------------------------------------------------------------------------------
# Bad input and divergence
# --------------------------------------------------------------------------------------------------
def test_nan_loss_stops_and_keeps_last_good_checkpoint(shards, tmp_path, monkeypatch) -> None:
    from lmforge.model import TransformerLM

    run = tmp_path / "run"
    cfg = _cfg(shards, training={"max_steps": 10})
    calls = {"n": 0}
    forward = TransformerLM.forward

    def poisoned(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        if self.training:
            calls["n"] += 1
            if calls["n"] > 2 * 4:  # from the 5th step on (2 micro-batches per step)
                out = out * float("nan")
        return out

    monkeypatch.setattr(TransformerLM, "forward", poisoned)
    with pytest.raises(NonFiniteLossError, match=r"loss is nan at step 5 .*step_00000003.*lower optimizer\.lr"):
        train(cfg, run, progress=False)
    monkeypatch.undo()
    assert [p.name for p in sorted((run / "checkpoints").glob("step_*"))] == ["step_00000003.safetensors"]
    assert max(s for s, _ in _losses(run)) == 4  # steps 1-4 logged, the NaN step not
    assert train(cfg, run, progress=False)["step"] == 10  # the run continues from the last good checkpoint


def test_train_restores_the_callers_thread_count(shards, tmp_path, monkeypatch) -> None:
    """training.num_threads holds while training only: on return and when train() raises."""
    from lmforge.model import TransformerLM

    torch.set_num_threads(3)  # conftest restores the session's count after the test
    seen = []
    forward = TransformerLM.forward

    def spy(self, *args, **kwargs):
        seen.append(torch.get_num_threads())
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(TransformerLM, "forward", spy)
    train(_cfg(shards, training={"max_steps": 2, "num_threads": 1}), tmp_path / "ok", progress=False)
    assert set(seen) == {1} and torch.get_num_threads() == 3
    with pytest.raises(ValueError, match="model.vocab_size"):  # raises after num_threads was applied
        train(_cfg(shards, model={"vocab_size": 64}, training={"num_threads": 2}), tmp_path / "bad", progress=False)
    assert torch.get_num_threads() == 3


def test_token_ids_beyond_model_vocab(shards, tmp_path) -> None:
    with pytest.raises(ValueError, match=r"holds token id \d+, which does not exist .*model\.vocab_size=200"):
        train(_cfg(shards, model={"vocab_size": 200}), tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()  # nothing written for a rejected config


def test_data_shorter_than_context(tmp_path) -> None:
    small = _make_shards(tmp_path / "small", n_docs=12, vocab_size=280)
    with pytest.raises(ValueError, match=r"fewer than one training window .* lower training\.context_length"):
        train(_cfg(small, model={"context_length": 4096}, data={"val_split": None}), tmp_path / "run", progress=False)


def test_incompatible_run_dir(shards, tmp_path, caplog) -> None:
    run = tmp_path / "run"
    train(_cfg(shards, training={"max_steps": 3}), run, progress=False)
    with pytest.raises(ValueError, match=r"incompatible config \(model\.d_model: 32 -> 64"):
        train(_cfg(shards, model={"d_model": 64}, training={"max_steps": 3}), run, progress=False)
    with pytest.raises(ValueError, match=r"incompatible config \(training\.batch_size: 4 -> 8\)"):
        train(_cfg(shards, training={"max_steps": 3, "batch_size": 8}), run, progress=False)
    with caplog.at_level(logging.INFO, logger="lmforge"):
        m = train(_cfg(shards, training={"max_steps": 4, "log_every": 2}), run, progress=False)  # allowed changes
    assert m["step"] == 4 and "training.max_steps: 3 -> 4" in caplog.text

    from lmforge.tokenizer.reference import train_bpe_reference
    from lmforge.tokenizer import Tokenizer

    saved = (run / "tokenizer.json").read_bytes()
    (run / "tokenizer.json").unlink()
    Tokenizer(*train_bpe_reference(["other text"] * 3, 260, ["<|endoftext|>"]), ["<|endoftext|>"]).save(
        run / "tokenizer.json")
    with pytest.raises(ValueError, match=r"tokenizer\.json is a different tokenizer .* use a new --run-dir"):
        train(_cfg(shards, training={"max_steps": 5}), run, progress=False)
    (run / "tokenizer.json").write_bytes(saved)
    assert train(_cfg(shards, training={"max_steps": 5}), run, progress=False)["step"] == 5


def _cli_train(cfg_path: Path, run: Path, capsys, *extra: str) -> tuple[int, str]:
    """``lmforge -q train`` in this process (the CLI's exit code and stderr, without a fresh torch import)."""
    rc = cli.main(["-q", "train", str(cfg_path), "--run-dir", str(run), "--no-progress", *extra])
    return rc, capsys.readouterr().err


def test_train_refuses_a_folder_that_is_not_a_run(shards, tmp_path, capsys) -> None:
    """A user's folder with files of the run's names is never overwritten unless --force; stray temps stay."""
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(_cfg_dict(shards, training={"max_steps": 2, "eval_every": 2})))
    mine = tmp_path / "mine"
    mine.mkdir()
    files = {"config.yaml": "my: notes\n", "metrics.jsonl": "{\"mine\": 1}\n", "loss.png": "not a png",
             ".notes.tmp": "draft"}
    for name, text in files.items():
        (mine / name).write_text(text)
    rc, err = _cli_train(cfg_path, mine, capsys)
    assert rc == 2, err
    assert err.count("\n") == 1 and "is not empty" in err and "not an lmforge run directory" in err
    assert {p.name: p.read_text() for p in mine.iterdir()} == files  # untouched

    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    rc, err = _cli_train(cfg_path, a_file, capsys)
    assert rc == 2 and err.count("\n") == 1 and "is an existing file" in err
    assert a_file.read_text() == "x"

    rc, err = _cli_train(cfg_path, mine, capsys, "--force")
    assert rc == 0, err
    assert (mine / ".notes.tmp").read_text() == "draft"  # stale-temp cleanup touches only lmforge's own temporaries
    assert (mine / "lmforge-run.json").is_file()
    assert [s for s, _ in _losses(mine)] == [1, 2]  # trained, not just marked
    rc, err = _cli_train(cfg_path, mine, capsys)  # now it is a run: resumed (finished), no --force needed
    assert rc == 0, err
    assert [s for s, _ in _losses(mine)] == [1, 2]  # finished: nothing trained again


def test_rejected_config_creates_nothing_and_an_unstarted_run_takes_a_new_config(tmp_path) -> None:
    small = _make_shards(tmp_path / "small", n_docs=60, vocab_size=280)  # a small validation split
    from lmforge.data import TokenDataset

    windows = sum(len(s) // 33 for s in TokenDataset(small, "val").shards)
    assert 0 < windows < 64
    run = tmp_path / "run"
    big_eval = _cfg(small, training={"batch_size": 64, "max_steps": 2})
    with pytest.raises(ValueError, match=rf"holds {windows} validation windows .* eval batch of 64; set "
                                         rf"training\.eval_batch_size <= {windows}"):
        train(big_eval, run, progress=False)
    assert not run.exists()  # validated before anything was created
    ok = _cfg(small, training={"batch_size": 64, "eval_batch_size": windows, "max_steps": 2, "eval_every": 2,
                               "checkpoint_every": 2})
    assert train(ok, run, progress=False)["step"] == 2

    # a run that failed before its first checkpoint may be started again with another config
    early = tmp_path / "early"
    cfg = _cfg(small, training={"max_steps": 4, "eval_batch_size": 1, "checkpoint_every": 4, "eval_every": 4})
    import lmforge.train.loop as train_mod
    real = train_mod.evaluate

    def boom(*a, **k):
        raise RuntimeError("crash before the first checkpoint")

    train_mod.evaluate = boom
    try:
        with pytest.raises(RuntimeError, match="crash before"):
            train(cfg, early, progress=False)
    finally:
        train_mod.evaluate = real
    assert (early / "config.yaml").exists() and not list((early / "checkpoints").glob("step_*"))
    changed = _cfg(small, training={"max_steps": 4, "batch_size": 2, "eval_batch_size": 1, "eval_every": 4})
    assert train(changed, early, progress=False)["step"] == 4
    assert yaml.safe_load((early / "config.yaml").read_text())["training"]["batch_size"] == 2


def test_wandb_calls_with_a_stand_in_module(shards, tmp_path, monkeypatch) -> None:
    """What lmforge asks of wandb (init once per run dir, offline mode, one log per event), without wandb."""
    import types

    calls: dict[str, list] = {"init": [], "log": [], "finish": []}

    class Run:
        def log(self, data, step):
            calls["log"].append((step, data))

        def finish(self):
            calls["finish"].append(True)

    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls["init"].append(kw) or Run()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    run = tmp_path / "run"
    train(_cfg(shards, training={"max_steps": 4, "wandb": True, "wandb_mode": "offline"}), run, progress=False)
    (init,) = calls["init"]
    assert init["mode"] == "offline" and init["dir"] == str(run) and init["config"]["training"]["max_steps"] == 4
    assert [s for s, d in calls["log"] if "loss" in d] == [1, 2, 3, 4]
    assert [s for s, d in calls["log"] if "val_loss" in d] == [4] and calls["finish"] == [True]


def test_wandb_missing_is_a_clear_error(shards, tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # import fails as if not installed
    with pytest.raises(ValueError, match=r"wandb package is not installed.*training\.wandb=false"):
        train(_cfg(shards, training={"max_steps": 2, "wandb": True}), tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_wandb_offline(shards, tmp_path, monkeypatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    m = train(_cfg(shards, training={"max_steps": 2, "wandb": True, "wandb_mode": "offline"}), tmp_path / "run",
              progress=False)
    assert m["step"] == 2 and (tmp_path / "run" / "wandb").is_dir()


def test_ddp_world_size_one_matches_single_process(shards, tmp_path) -> None:
    import torch.distributed as dist

    from lmforge.train.distributed import get_world_size, is_main_process, setup_distributed

    single = tmp_path / "single"
    train(_cfg(shards, training={"max_steps": 3}), single, progress=False)
    info = setup_distributed("cpu", init_method=f"file://{tmp_path / 'pg'}")
    try:
        assert dist.is_initialized() and get_world_size() == 1 and is_main_process() and info.device.type == "cpu"
        ddp = tmp_path / "ddp"
        train(_cfg(shards, training={"max_steps": 3, "parallel": "ddp"}), ddp, progress=False)
        assert dist.is_initialized()  # train() leaves a group it did not create alone
    finally:
        dist.destroy_process_group()
    assert _losses(ddp) == _losses(single)


@pytest.mark.slow
def test_fsdp_world_size_one_resumes_exactly(shards, tmp_path) -> None:
    import torch.distributed as dist

    from lmforge.train.distributed import setup_distributed

    single = tmp_path / "single"
    train(_cfg(shards, training={"max_steps": 5}), single, progress=False)
    setup_distributed("cpu", init_method=f"file://{tmp_path / 'pg'}")
    try:
        fsdp = {"parallel": "fsdp"}
        full, split = tmp_path / "full", tmp_path / "split"
        train(_cfg(shards, training={"max_steps": 5, **fsdp}), full, progress=False)
        train(_cfg(shards, training={"max_steps": 3, **fsdp}), split, progress=False)
        train(_cfg(shards, training={"max_steps": 5, **fsdp}), split, progress=False)
    finally:
        dist.destroy_process_group()
    assert _losses(split) == _losses(full)
    # the sharded run computes the same model as the single-device one
    assert [s for s, _ in _losses(full)] == [s for s, _ in _losses(single)]
    assert [v for _, v in _losses(full)] == pytest.approx([v for _, v in _losses(single)], rel=1e-5)
    from lmforge.checkpoint import read_checkpoint
    ck = read_checkpoint(full / "checkpoints" / "step_00000005.safetensors")
    assert all(isinstance(t, torch.Tensor) and type(t) is torch.Tensor for t in ck.model.values())


def test_eval_command_matches_training_eval(shards, tmp_path, capsys) -> None:
    from lmforge.train import evaluate_run

    run = tmp_path / "run"
    m = train(_cfg(shards, training={"max_steps": 4}), run, progress=False)
    ev = evaluate_run(run, device="cpu")
    assert ev["step"] == 4 and ev["split"] == "val" and ev["loss"] == pytest.approx(m["val_loss"], rel=1e-6)
    assert evaluate_run(run, checkpoint="best", device="cpu")["loss"] == pytest.approx(m["best_val_loss"], rel=1e-6)
    assert cli.main(["eval", str(run), "--split", "train", "--batches", "1"]) == 0
    assert "(step 4) on train" in capsys.readouterr().out
    assert cli.main(["eval", str(tmp_path / "nope")]) == 2
    assert "does not exist; train one first" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="is not an lmforge run directory"):
        evaluate_run(tmp_path / "empty")


@pytest.mark.slow
def test_torchrun_two_ranks_cpu_matches_one_process_with_double_batch(shards, tmp_path) -> None:
    # 2 ranks x batch 4 see the same 8 blocks per step as 1 process x batch 8; DDP averages gradients
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(_cfg_dict(shards, training={"max_steps": 4, "num_threads": 1})))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "lmforge.cli",
           "-q", "train", str(cfg_path), "--run-dir", str(tmp_path / "ddp"), "--no-progress"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("run directory") == 1  # only rank 0 reports
    train(_cfg(shards, training={"max_steps": 4, "batch_size": 8}), tmp_path / "single", progress=False)
    ddp, single = _losses(tmp_path / "ddp"), _losses(tmp_path / "single")
    assert [s for s, _ in ddp] == [1, 2, 3, 4]
    assert [v for _, v in ddp] == pytest.approx([v for _, v in single], rel=1e-5)
    assert sorted(p.name for p in (tmp_path / "ddp" / "checkpoints").glob("step_*")) == [
        "step_00000003.safetensors", "step_00000004.safetensors"]


@pytest.mark.slow
def test_muon_fsdp_world_size_one_resumes_exactly(shards, tmp_path) -> None:
    import torch.distributed as dist

    from lmforge.train.distributed import setup_distributed

    muon = {"name": "muon"}
    single, full, split = tmp_path / "single", tmp_path / "full", tmp_path / "split"
    train(_cfg(shards, optimizer=muon, training={"max_steps": 5}), single, progress=False)
    setup_distributed("cpu", init_method=f"file://{tmp_path / 'pg'}")
    try:
        fsdp = {"parallel": "fsdp"}  # DTensor parameters: Muon gathers each matrix, orthogonalises, keeps its shard
        train(_cfg(shards, optimizer=muon, training={"max_steps": 5, **fsdp}), full, progress=False)
        train(_cfg(shards, optimizer=muon, training={"max_steps": 3, **fsdp}), split, progress=False)
        train(_cfg(shards, optimizer=muon, training={"max_steps": 5, **fsdp}), split, progress=False)
    finally:
        dist.destroy_process_group()
    assert _losses(split) == _losses(full)
    assert [v for _, v in _losses(full)] == pytest.approx([v for _, v in _losses(single)], rel=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_torchrun_two_ranks_fsdp_muon_matches_one_process(shards, tmp_path) -> None:
    # FSDP2 shards every matrix over 2 ranks: Muon must orthogonalise the whole matrix, not each half
    muon = {"name": "muon"}
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(_cfg_dict(shards, optimizer=muon,
                                                 training={"max_steps": 4, "num_threads": 1, "parallel": "fsdp"})))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "lmforge.cli",
           "-q", "train", str(cfg_path), "--run-dir", str(tmp_path / "fsdp"), "--no-progress"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stderr
    train(_cfg(shards, optimizer=muon, training={"max_steps": 4, "batch_size": 8}), tmp_path / "single",
          progress=False)
    fsdp, single = _losses(tmp_path / "fsdp"), _losses(tmp_path / "single")
    assert [s for s, _ in fsdp] == [1, 2, 3, 4]
    assert [v for _, v in fsdp] == pytest.approx([v for _, v in single], rel=1e-5)


def test_distributed_helpers_without_a_process_group(monkeypatch) -> None:
    from lmforge.train import distributed as D

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    info = D.setup_distributed("cpu")
    assert (info.rank, info.world_size, info.is_main, info.enabled) == (0, 1, True, False)
    assert D.get_rank() == 0 and D.get_world_size() == 1 and D.is_main_process()
    assert D.all_reduce_sum([1.0, 2.0]) == [1.0, 2.0] and D.all_reduce_mean(3.0) == 3.0
    model = torch.nn.Linear(2, 2)
    assert D.wrap_model(model, "ddp", info) is model  # nothing to wrap in one process
    with pytest.raises(ValueError, match="training.parallel must be none, ddp or fsdp"):
        D.wrap_model(model, "zero3", info)
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"RANK=2 must be in \[0, WORLD_SIZE=2\)"):
        D.setup_distributed("cpu")
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="WORLD_SIZE='two' must be an integer"):
        D.setup_distributed("cpu")
