"""Supervised fine-tuning (``lmforge sft``): masks, packing, the global target count, resume, the base record."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from conftest import make_documents
from lmforge import cli
from lmforge.chat import CHAT_SPECIAL_TOKENS, ChatFormat, add_chat_tokens
from lmforge.chat.sft import sft
from lmforge.data.conversations import (IGNORE_INDEX, ConversationDataset, ConversationLoader,
                                        conversation_val_batches, write_conversations)
from lmforge.tokenizer import EOT, Tokenizer


# --------------------------------------------------------------------------------------------------
# A tiny base run (its model has exactly the tokenizer's 300 ids: the chat tokens make it grow)
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def base_run(tmp_path_factory) -> Path:
    from lmforge.data import prepare
    from lmforge.tokenizer import train_bpe
    from lmforge.train import load_run_config, train

    d = tmp_path_factory.mktemp("sft_base")
    corpus = d / "corpus.txt"
    corpus.write_text(EOT.join(make_documents(300, seed=3)), encoding="utf-8")
    tok = Tokenizer(*train_bpe(corpus, 300, [EOT], progress=False), [EOT])
    prepare(tok, corpus, d / "shards", val_fraction=0.1, progress=False)
    cfg = load_run_config(base={
        "model": {"vocab_size": 300, "context_length": 48, "d_model": 32, "n_layers": 2, "n_heads": 2},
        "optimizer": {"lr": 3e-3, "warmup_steps": 1},
        "training": {"max_steps": 4, "batch_size": 4, "device": "cpu", "eval_every": 4, "eval_batches": 2,
                     "checkpoint_every": 4, "num_threads": 1},
        "data": {"dir": str(d / "shards")}})
    train(cfg, d / "run", progress=False)
    return d / "run"


def _conv(q: str, a: str, system: str | None = None) -> dict:
    msgs = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return {"messages": msgs}


def _write_jsonl(path: Path, n: int, seed: int, long_every: int = 0) -> Path:
    """Addition questions with answers of uneven length (and every ``long_every``-th one too long to fit)."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for k in range(n):
            a, b = rng.randint(0, 999), rng.randint(0, 99)
            conv = _conv(f"{a}+{b}?", f"{a} plus {b} is {a + b}." if k % 3 else str(a + b),
                         system="Be brief." if k % 4 == 0 else None)
            if long_every and k % long_every == long_every - 1:
                conv = _conv("tell me a long story " * 10, "no " * 40)
            f.write(json.dumps(conv) + "\n")
    return path


@pytest.fixture(scope="module")
def convs(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("convs")
    return {"train": _write_jsonl(d / "train.jsonl", 80, 0, long_every=20), "val": _write_jsonl(d / "val.jsonl", 12, 1)}


SMALL = ("training.max_steps=8", "training.eval_every=4", "training.checkpoint_every=3", "training.log_every=1",
         "optimizer.lr=3e-3", "optimizer.warmup_steps=2", "optimizer.decay_steps=40", "training.batch_size=4")


def _losses(run: Path) -> list[tuple[int, float]]:
    return [(e["step"], e["loss"]) for e in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if "loss" in e]


# --------------------------------------------------------------------------------------------------
# Masks and packing
# --------------------------------------------------------------------------------------------------
def _tok() -> Tokenizer:
    return add_chat_tokens(Tokenizer({i: bytes([i]) for i in range(256)}, []))


def test_packed_rows_train_exactly_the_assistant_tokens(tmp_path) -> None:
    """Hand-made conversations: every target is the next id where the renderer's mask is 1, else -100; whole
    conversations only, padding ignored."""
    tok = _tok()
    fmt = ChatFormat(tok)
    convs = [_conv("2+2?", "4"), _conv("hi", "hello there", system="Be nice."), _conv("x", "yz")]
    rendered = [fmt.render(c["messages"]) for c in convs]
    write_conversations(tmp_path, {"train": (rendered, {})}, tok.fingerprint(), tok.special_tokens[EOT])
    ds = ConversationDataset(tmp_path, "train")
    T = 40  # rows of 41 tokens: conversations 0 (16) + 2 (15) fit one row, 1 (48) is longer: see the skip test
    rows = ds.rows(T, np.array([0, 2]))
    assert [r.tolist() for r in rows] == [[0, 2]]
    x, y = ds.fill(rows, T)
    ids = rendered[0][0] + rendered[2][0]
    mask = rendered[0][1] + rendered[2][1]
    n = len(ids)
    assert x[0, :n].tolist() == ids[:n] and (x[0, n:] == tok.special_tokens[EOT]).all()  # padded with EOT
    want = [ids[i + 1] if mask[i + 1] else IGNORE_INDEX for i in range(n - 1)] + [IGNORE_INDEX] * (T - n + 1)
    assert y[0].tolist() == want
    trained = tok.decode([t for t in y[0].tolist() if t != IGNORE_INDEX])
    assert trained == "4<|assistant_end|>yz<|assistant_end|>"


def test_loader_resumes_exactly_and_covers_each_epoch(tmp_path) -> None:
    tok = _tok()
    fmt = ChatFormat(tok)
    rendered = [fmt.render(_conv(f"q{i}", "a" * (i % 7 + 1))["messages"]) for i in range(30)]
    write_conversations(tmp_path, {"train": (rendered, {})}, tok.fingerprint(), 0)
    ds = ConversationDataset(tmp_path, "train")
    a = ConversationLoader(ds, 2, 40, seed=3)
    first = [a.next_batch() for _ in range(a.steps_per_epoch + 3)]  # into the second epoch
    b = ConversationLoader(ds, 2, 40, seed=3)
    for _ in range(4):
        b.next_batch()
    c = ConversationLoader(ds, 2, 40, seed=3)
    c.load_state_dict(json.loads(json.dumps(b.state_dict())))
    for (x1, y1), (x2, y2) in zip(first[4:], [c.next_batch() for _ in range(len(first) - 4)]):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    # two ranks split each global batch: together they are the single-rank batch
    r0, r1 = (ConversationLoader(ds, 1, 40, seed=3, rank=r, world_size=2) for r in (0, 1))
    x0, x1 = r0.next_batch()[0], r1.next_batch()[0]
    assert torch.equal(torch.cat([x0, x1]), first[0][0])
    with pytest.raises(ValueError, match="batch_size=4 but this loader has 2"):
        c.load_state_dict({**b.state_dict(), "batch_size": 4})
    val = conversation_val_batches(ds, 4, 40, max_batches=2)
    assert len(val) == 2 and all(x.shape == (4, 40) for x, _ in val)


# --------------------------------------------------------------------------------------------------
# End to end
# --------------------------------------------------------------------------------------------------
def test_sft_end_to_end_records_base_and_is_a_run(base_run, convs, tmp_path) -> None:
    out = tmp_path / "sft"
    m = sft(base_run, convs["train"], out, val_data=convs["val"], overrides=SMALL, progress=False)
    assert m["step"] == 8 and m["conversations"] == 76 and m["skipped"] == 4 and m["val_skipped"] == 0
    base = json.loads((out / "base.json").read_text())
    from lmforge.common import sha256_file
    ckpt = base_run / "checkpoints" / "step_00000004.safetensors"
    assert base == {"run": str(base_run), "checkpoint": str(ckpt), "sha256": sha256_file(ckpt), "lora": None}
    tok = Tokenizer.load(out / "tokenizer.json")
    assert all(t in tok.special_tokens for t in CHAT_SPECIAL_TOKENS) and tok.vocab_size == 314  # + the tool tokens
    from lmforge.run import open_run
    run = open_run(out)
    assert run.config["model"]["vocab_size"] == 314 and run.config["data"]["kind"] == "conversations"
    assert run.checkpoint.model["token_embeddings.weight"].shape == (314, 32)
    losses = [v for _, v in _losses(out)]
    assert len(losses) == 8 and losses[-1] < losses[0]  # it learns
    # the base's rows moved (full fine-tuning), and every --run reader opens the run
    from lmforge.generate import Generator
    gen = Generator.from_run(out, device="cpu")
    assert gen.cfg.vocab_size == 314 and isinstance(gen.generate("1+2?", max_new_tokens=3, seed=0), str)
    from lmforge.train import evaluate_run
    ev = evaluate_run(out, device="cpu")
    assert ev["split"] == "val" and ev["loss"] == pytest.approx(m["val_loss"], rel=1e-6)
    assert cli.main(["-q", "generate", "--run", str(out), "--prompt", "hi", "--max-new-tokens", "2"]) == 0


def test_new_rows_start_at_the_mean_and_old_logits_of_the_base(base_run, convs, tmp_path) -> None:
    """Step 0 of a fine-tuning run is the base model grown: the loop loads the base checkpoint, not a fresh init."""
    from lmforge.config import from_dict
    from lmforge.model import ModelConfig, TransformerLM
    from lmforge.run import open_run
    from lmforge.train.finetune import build_model
    from lmforge.train import load_run_config

    out = tmp_path / "sft"
    sft(base_run, convs["train"], out, overrides=SMALL + ("training.max_steps=3",), progress=False)
    cfg = load_run_config(out / "config.yaml")
    grown = build_model(cfg, torch.device("cpu"), resuming=False)
    b = open_run(base_run)
    base = TransformerLM(from_dict(ModelConfig, b.config["model"]))
    base.load_state_dict(b.checkpoint.model)
    idx = torch.randint(0, 300, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(grown(idx)[..., :300], base(idx), rtol=0, atol=0)
        mean = base.token_embeddings.weight.mean(0)
        assert torch.allclose(grown.token_embeddings.weight[300:], mean.expand(14, -1))


def test_accumulation_with_uneven_masks_equals_one_big_batch(base_run, convs, tmp_path) -> None:
    """Rows hold different numbers of trained targets, so a mean of micro-batch means would differ: the loss is
    normalised by the step's global target count. SGD without clipping shows a wrong scale at step 2."""
    sgd = ("optimizer.name=sgd", "optimizer.lr=0.5", "optimizer.min_lr=0", "optimizer.warmup_steps=0",
           "optimizer.grad_clip=0", "training.max_steps=4", "training.eval_every=100", "training.log_every=1")
    sft(base_run, convs["train"], tmp_path / "big", overrides=sgd + ("training.batch_size=4",), progress=False)
    sft(base_run, convs["train"], tmp_path / "acc", overrides=sgd + ("training.batch_size=2",
                                                                      "training.grad_accum_steps=2"), progress=False)
    a, b = [v for _, v in _losses(tmp_path / "big")], [v for _, v in _losses(tmp_path / "acc")]
    assert a == pytest.approx(b, rel=1e-5) and a[0] != a[-1]
    x, y = ConversationLoader(ConversationDataset(tmp_path / "big" / "sft_data", "train"), 4, 48).next_batch()
    counts = (y != IGNORE_INDEX).sum(1).tolist()
    assert len(set(counts)) > 1, counts  # the masks really are uneven


def test_resume_in_process_equals_uninterrupted(base_run, convs, tmp_path) -> None:
    full, split = tmp_path / "full", tmp_path / "split"
    sft(base_run, convs["train"], full, val_data=convs["val"], overrides=SMALL, progress=False)
    sft(base_run, convs["train"], split, val_data=convs["val"], overrides=SMALL + ("training.max_steps=5",),
        progress=False)  # checkpoints at 3 and 5
    sft(base_run, convs["train"], split, val_data=convs["val"], overrides=SMALL, progress=False)
    assert _losses(split) == _losses(full)  # float equality, every step


def test_pretrain_mix_resumes_exactly(base_run, convs, tmp_path) -> None:
    mix = SMALL + ("sft.pretrain_mix=0.25",)
    full, split = tmp_path / "full", tmp_path / "split"
    sft(base_run, convs["train"], full, overrides=mix, progress=False)
    sft(base_run, convs["train"], split, overrides=mix + ("training.max_steps=5",), progress=False)
    sft(base_run, convs["train"], split, overrides=mix, progress=False)
    assert _losses(split) == _losses(full)
    plain = tmp_path / "plain"
    sft(base_run, convs["train"], plain, overrides=SMALL, progress=False)
    assert _losses(plain) != _losses(full)  # the mix changes what is trained on


def test_changed_data_on_resume_is_refused(base_run, convs, tmp_path) -> None:
    data = tmp_path / "train.jsonl"
    data.write_bytes(convs["train"].read_bytes())
    out = tmp_path / "sft"
    sft(base_run, data, out, overrides=SMALL + ("training.max_steps=3",), progress=False)
    with open(data, "a", encoding="utf-8") as f:
        f.write(json.dumps(_conv("1+1?", "2")) + "\n")
    before = (out / "sft_data" / "train_ids.npy").read_bytes()
    with pytest.raises(ValueError, match=r"train data .* changed since this run started"):
        sft(base_run, data, out, overrides=SMALL, progress=False)
    assert (out / "sft_data" / "train_ids.npy").read_bytes() == before


# --------------------------------------------------------------------------------------------------
# A real SIGKILL and restart, and two ranks under torchrun
# --------------------------------------------------------------------------------------------------
_SLOW_MAIN = """
import sys, time
from lmforge.data import conversations
next_batch = conversations.ConversationLoader.next_batch
def slow(self):  # sleeping changes no number; it keeps the run alive long enough to be killed mid-way
    time.sleep(float(sys.argv[1]))
    return next_batch(self)
conversations.ConversationLoader.next_batch = slow
from lmforge.cli import main
sys.exit(main(sys.argv[2:]))
"""


def _sft_cmd(base_run: Path, convs: dict, run_dir: Path, *sets: str) -> list[str]:
    cmd = ["-q", "sft", "--base", str(base_run), "--data", str(convs["train"]), "--val-data", str(convs["val"]),
           "--run-dir", str(run_dir), "--no-progress"]
    for s in sets:
        cmd += ["--set", s]
    return cmd


def kill_and_restart(script: Path, argv_of: Any, full: Path, killed: Path, kill_at: int, steps: int) -> None:
    """Run ``script DELAY *argv_of(run)`` into ``full`` and, slowed, into ``killed`` at once; SIGKILL the slowed one
    once it has logged step ``kill_at`` (before step ``steps``), start it again, and wait for both to finish."""
    import signal
    import subprocess
    import sys
    import time

    start = lambda run, delay: subprocess.Popen(  # noqa: E731
        [sys.executable, str(script), str(delay), *argv_of(run)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    procs = [start(full, 0.0), start(killed, 0.05)]
    try:
        proc = procs[1]
        metrics, deadline = killed / "metrics.jsonl", time.time() + 90
        while time.time() < deadline:
            if metrics.exists() and any(json.loads(ln).get("step", 0) >= kill_at
                                        for ln in metrics.read_text().splitlines() if ln.endswith("}")):
                break
            assert proc.poll() is None, proc.stderr.read().decode()
            time.sleep(0.005)
        else:
            pytest.fail(f"the run to be killed logged no step {kill_at} within 90 s")
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
        logged = [json.loads(ln)["step"] for ln in metrics.read_text().splitlines() if '"loss"' in ln]
        assert kill_at <= logged[-1] < steps
        restart = start(killed, 0.0)
        procs.append(restart)
        assert restart.wait(timeout=90) == 0, restart.stderr.read().decode()
        assert procs[0].wait(timeout=60) == 0, procs[0].stderr.read().decode()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sigkill_and_restart_equals_uninterrupted(base_run, convs, tmp_path) -> None:
    sets = SMALL + ("training.max_steps=20", "training.checkpoint_every=5", "training.eval_every=10")
    script = tmp_path / "slow_main.py"
    script.write_text(_SLOW_MAIN)
    full, killed = tmp_path / "full", tmp_path / "killed"
    kill_and_restart(script, lambda run: _sft_cmd(base_run, convs, run, *sets), full, killed, 7, 20)  # ckpts 5, 10
    assert [s for s, _ in _losses(killed)] == list(range(1, 21))
    assert _losses(killed) == _losses(full)  # bit for bit
    vals = lambda r: [(e["step"], e["val_loss"]) for e in map(json.loads, (r / "metrics.jsonl").read_text()  # noqa: E731
                                                               .splitlines()) if "val_loss" in e]
    assert vals(killed) == vals(full) and len(vals(full)) == 2


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_torchrun_two_ranks_with_uneven_masks_equal_one_process(base_run, convs, tmp_path) -> None:
    """2 ranks x 2 rows see the same rows per step as 1 process x 4; each rank's rows hold a different number
    of trained targets, so only the globally counted denominator makes the two agree."""
    import subprocess
    import sys

    sgd = ("optimizer.name=sgd", "optimizer.lr=0.5", "optimizer.min_lr=0", "optimizer.warmup_steps=0",
           "optimizer.grad_clip=0", "training.max_steps=3", "training.eval_every=100", "training.log_every=1",
           "training.num_threads=1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "lmforge.cli",
           *_sft_cmd(base_run, convs, tmp_path / "ddp", *sgd, "training.batch_size=2")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=200)
    assert out.returncode == 0, out.stderr
    sft(base_run, convs["train"], tmp_path / "single", val_data=convs["val"], overrides=sgd + ("training.batch_size=4",),
        progress=False)
    ddp, single = _losses(tmp_path / "ddp"), _losses(tmp_path / "single")
    assert [s for s, _ in ddp] == [1, 2, 3]
    assert [v for _, v in ddp] == pytest.approx([v for _, v in single], rel=1e-5)
    ds = ConversationDataset(tmp_path / "single" / "sft_data", "train")
    ranks = [ConversationLoader(ds, 2, 48, seed=1337, rank=r, world_size=2).next_batch()[1] for r in (0, 1)]
    assert int((ranks[0] != IGNORE_INDEX).sum()) != int((ranks[1] != IGNORE_INDEX).sum())


# --------------------------------------------------------------------------------------------------
# LoRA
# --------------------------------------------------------------------------------------------------
LORA = SMALL + ("lora.rank=4", "lora.alpha=8", "optimizer.lr=1e-2")


def _logits(model, idx):
    with torch.no_grad():
        return model.eval()(idx)


def test_lora_run_saves_adapters_only_and_every_reader_sees_base_plus_adapters(base_run, convs, tmp_path) -> None:
    from lmforge.checkpoint import read_checkpoint
    from lmforge.config import from_dict
    from lmforge.model import ModelConfig, TransformerLM
    from lmforge.model.lora import LoraConfig, apply_lora, load_lora_state_dict
    from lmforge.run import open_run
    from lmforge.train import load_run_config
    from lmforge.train.finetune import build_model

    out = tmp_path / "lora"
    m = sft(base_run, convs["train"], out, val_data=convs["val"], overrides=LORA, progress=False)
    losses = [v for _, v in _losses(out)]
    assert losses[-1] < losses[0]
    ck = read_checkpoint(out / "checkpoints" / "step_00000008.safetensors")
    assert ck.model and all(k.endswith((".lora_A", ".lora_B")) for k in ck.model)  # never a copy of the base
    assert len(ck.model) == 2 * 7 * 2  # 7 projections x 2 layers x (A, B)
    adapter_params = sum(t.numel() for t in ck.model.values())
    # only adapters are trainable and in the optimizer
    cfg = load_run_config(out / "config.yaml")
    model = build_model(cfg, torch.device("cpu"), resuming=False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert sum(p.numel() for p in trainable) == adapter_params
    assert sum(len(v["exp_avg"].reshape(-1)) for v in ck.optimizer["state"].values()) == adapter_params
    # the reference: base grown + the lora module's own wrapping with the saved factors
    b = open_run(base_run)
    ref = TransformerLM(from_dict(ModelConfig, b.config["model"]))
    ref.load_state_dict(b.checkpoint.model)
    ref.resize_vocab(314)
    apply_lora(ref, LoraConfig(rank=4, alpha=8))
    load_lora_state_dict(ref, ck.model)
    idx = torch.randint(0, 310, (2, 12))
    want = _logits(ref, idx)
    # open_run folds the adapters into the base: a plain model (generate, eval, chat, serve, export read it so)
    run = open_run(out)
    plain = TransformerLM(from_dict(ModelConfig, run.config["model"]))
    plain.load_state_dict(run.checkpoint.model)
    torch.testing.assert_close(_logits(plain, idx), want, rtol=1e-5, atol=1e-5)
    from lmforge.train import evaluate_run
    assert evaluate_run(out, device="cpu")["loss"] == pytest.approx(m["val_loss"], rel=1e-5)
    # lora merge writes a plain run with the same logits, and refuses to overwrite it
    assert cli.main(["lora", "merge", "--run", str(out), "--out", str(tmp_path / "merged")]) == 0
    merged = open_run(tmp_path / "merged")
    assert json.loads((tmp_path / "merged" / "base.json").read_text())["lora"] is None
    plain2 = TransformerLM(from_dict(ModelConfig, merged.config["model"]))
    plain2.load_state_dict(merged.checkpoint.model)
    torch.testing.assert_close(_logits(plain2, idx), want, rtol=1e-5, atol=1e-5)
    assert cli.main(["lora", "merge", "--run", str(out), "--out", str(tmp_path / "merged")]) == 2
    assert cli.main(["lora", "merge", "--run", str(out), "--out", str(tmp_path / "merged"), "--force"]) == 0
    assert cli.main(["-q", "generate", "--run", str(out), "--prompt", "hi", "--max-new-tokens", "2"]) == 0


def test_a_lora_run_on_a_base_with_value_embeddings_loads_with_the_chat_tokens(tmp_path, convs) -> None:
    """The chat tokens grow every table indexed by token id (the value embeddings too) when a LoRA run's
    adapters are folded into its base: the run opens, with the logits of the base grown + its adapters."""
    from lmforge.checkpoint import read_checkpoint
    from lmforge.config import from_dict
    from lmforge.data import prepare
    from lmforge.model import ModelConfig, TransformerLM
    from lmforge.model.lora import LoraConfig, apply_lora, load_lora_state_dict
    from lmforge.run import open_run
    from lmforge.tokenizer import train_bpe
    from lmforge.train import load_run_config, train

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(EOT.join(make_documents(200, seed=4)), encoding="utf-8")
    tok = Tokenizer(*train_bpe(corpus, 300, [EOT], progress=False), [EOT])
    prepare(tok, corpus, tmp_path / "shards", val_fraction=0.1, progress=False)
    train(load_run_config(base={
        "model": {"vocab_size": 300, "context_length": 48, "d_model": 32, "n_layers": 2, "n_heads": 2,
                  "value_embeds": 1},
        "optimizer": {"lr": 3e-3, "warmup_steps": 1},
        "training": {"max_steps": 2, "batch_size": 4, "device": "cpu", "eval_every": 2, "eval_batches": 1,
                     "checkpoint_every": 2, "num_threads": 1},
        "data": {"dir": str(tmp_path / "shards")}}), tmp_path / "base", progress=False)
    out = tmp_path / "lora"
    sft(tmp_path / "base", convs["train"], out, overrides=LORA + ("training.max_steps=2",), progress=False)
    run, b = open_run(out), open_run(tmp_path / "base")
    ref = TransformerLM(from_dict(ModelConfig, b.config["model"]))
    ref.load_state_dict(b.checkpoint.model)
    ref.resize_vocab(int(run.config["model"]["vocab_size"]))
    apply_lora(ref, LoraConfig(rank=4, alpha=8))
    load_lora_state_dict(ref, read_checkpoint(sorted((out / "checkpoints").glob("step_*"))[-1]).model)
    plain = TransformerLM(from_dict(ModelConfig, run.config["model"]))
    plain.load_state_dict(run.checkpoint.model)
    idx = torch.randint(0, 310, (2, 12))
    torch.testing.assert_close(_logits(plain, idx), _logits(ref, idx), rtol=1e-5, atol=1e-5)


def test_lora_resume_in_process_equals_uninterrupted(base_run, convs, tmp_path) -> None:
    drop = LORA + ("lora.dropout=0.1",)  # dropout draws from torch's RNG: restored with the checkpoint
    full, split = tmp_path / "full", tmp_path / "split"
    sft(base_run, convs["train"], full, overrides=drop, progress=False)
    sft(base_run, convs["train"], split, overrides=drop + ("training.max_steps=5",), progress=False)
    sft(base_run, convs["train"], split, overrides=drop, progress=False)
    assert _losses(split) == _losses(full)


def test_lora_on_a_changed_base_is_refused(base_run, convs, tmp_path) -> None:
    import shutil

    base = tmp_path / "base"
    shutil.copytree(base_run, base)
    out = tmp_path / "lora"
    sft(base, convs["train"], out, overrides=LORA + ("training.max_steps=3",), progress=False)
    ckpt = base / "checkpoints" / "step_00000004.safetensors"
    from lmforge.checkpoint import read_checkpoint, save_checkpoint
    ck = read_checkpoint(ckpt)
    ck.model["ln_final.weight"] = ck.model["ln_final.weight"] * 2
    save_checkpoint(_View(ck.model), None, 4, ckpt, ck.extra)
    rc = cli.main(["-q", "generate", "--run", str(out), "--prompt", "hi"])
    assert rc == 2
    from lmforge.run import open_run
    with pytest.raises(ValueError, match=r"LoRA adapters trained on another base: .* changed since"):
        open_run(out)
    with pytest.raises(ValueError, match=r"changed since this run was made"):  # resuming training refuses it too
        sft(base, convs["train"], out, overrides=LORA + ("training.max_steps=5",), progress=False)


def test_sft_from_a_lora_run_starts_from_its_folded_model(base_run, convs, tmp_path) -> None:
    """``sft --base <a LoRA run>`` fine-tunes the model every reader sees (base + adapters, as ``open_run`` folds
    it), fully or with new adapters; each result opens as base + first adapters (+ second adapters)."""
    from lmforge.config import from_dict
    from lmforge.model import ModelConfig, TransformerLM
    from lmforge.run import open_run
    from lmforge.train import load_run_config
    from lmforge.train.finetune import build_model

    def plain(run_dir):
        run = open_run(run_dir)
        m = TransformerLM(from_dict(ModelConfig, run.config["model"]))
        m.load_state_dict(run.checkpoint.model)
        return m

    lora1 = tmp_path / "lora1"
    sft(base_run, convs["train"], lora1, overrides=LORA + ("training.max_steps=3",), progress=False)
    idx = torch.randint(0, 310, (2, 12))
    folded = _logits(plain(lora1), idx)
    for name, sets in [("full", SMALL + ("training.max_steps=2", "sft.pretrain_mix=0.25")),  # the base's own shards
                       ("lora2", LORA + ("training.max_steps=2",))]:
        out = tmp_path / name
        args = ["-q", "sft", "--base", str(lora1), "--data", str(convs["train"]), "--run-dir", str(out),
                "--no-progress"]
        assert cli.main(args + [a for s in sets for a in ("--set", s)]) == 0
        cfg = load_run_config(out / "config.yaml")
        start = build_model(cfg, torch.device("cpu"), resuming=False)  # what step 1 trained from
        torch.testing.assert_close(_logits(start, idx), folded, rtol=0, atol=0)
        assert _logits(plain(out), idx).shape == folded.shape  # every reader opens the result
        assert cli.main(["-q", "generate", "--run", str(out), "--prompt", "hi", "--max-new-tokens", "2"]) == 0
    # the second adapters open on top of the first: base + adapters 1 + adapters 2 (build_model + the saved factors)
    from lmforge.checkpoint import CheckpointManager
    from lmforge.model.lora import load_lora_state_dict
    cfg = load_run_config(tmp_path / "lora2" / "config.yaml")
    ref = build_model(cfg, torch.device("cpu"), resuming=False)
    load_lora_state_dict(ref, CheckpointManager(tmp_path / "lora2").load_latest()[1].model)
    torch.testing.assert_close(_logits(plain(tmp_path / "lora2"), idx), _logits(ref, idx), rtol=1e-5, atol=1e-5)


def test_lora_merge_never_writes_onto_its_inputs_or_another_run(base_run, convs, tiny_run, tmp_path, capsys) -> None:
    """``lora merge --force`` refuses --out = the LoRA run (it would delete the adapters), its base (it would
    replace the base checkpoint the adapters need), a trained run (its newer checkpoints would outrank the merge)
    and a file; ``sft`` refuses --run-dir = its base. Each in one line, exit 2, nothing changed."""
    import shutil

    base = tmp_path / "base"
    shutil.copytree(base_run, base)
    lora = tmp_path / "lora"
    sft(base, convs["train"], lora, overrides=LORA + ("training.max_steps=3",), progress=False)
    trained = tmp_path / "trained"
    shutil.copytree(tiny_run, trained)
    (tmp_path / "afile").write_text("mine")
    cases = [(["lora", "merge", "--run", str(lora), "--out", str(lora), "--force"], r"--out .*lora is .*lora, which "
              r"this command reads: writing there \(even with --force\) would replace its own input"),
             (["lora", "merge", "--run", str(lora), "--out", str(base), "--force"], r"--out .*base is .*base, which"),
             (["lora", "merge", "--run", str(lora), "--out", str(lora / "merged"), "--force"], r"is inside .*lora"),
             (["lora", "merge", "--run", str(lora), "--out", str(trained), "--force"],
              r"--out .*trained holds another model's checkpoints \(step_00000004\.safetensors"),
             (["lora", "merge", "--run", str(lora), "--out", str(tmp_path / "afile")], r"afile is an existing file"),
             (["sft", "--base", str(base), "--data", str(convs["train"]), "--run-dir", str(base), "--force"],
              r"--run-dir .*base is .*base, which this command reads")]
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    for argv, pattern in cases:
        assert cli.main(["-q", *argv]) == 2, argv
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and re.search(pattern, lines[0]), (argv, lines)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


class _View:
    def __init__(self, sd):
        self.sd = sd

    def state_dict(self):
        return self.sd


# --------------------------------------------------------------------------------------------------
# Bad input: one line, exit code 2, nothing written
# --------------------------------------------------------------------------------------------------
_BAD_LINES = {
    "badjson.jsonl": ('{"messages": [}\n', r"badjson\.jsonl:1: not valid JSON"),
    "role.jsonl": (json.dumps({"messages": [{"role": "bot", "content": "x"}]}) + "\n",
                   r"role\.jsonl:1: message 0 has unknown role 'bot'"),
    "noassistant.jsonl": (json.dumps(_conv("a", "b")) + "\n" + json.dumps(
        {"messages": [{"role": "user", "content": "hi"}]}) + "\n", r"noassistant\.jsonl:2: .*no assistant message"),
    "empty.jsonl": (json.dumps({"messages": [{"role": "user", "content": " "}, {"role": "assistant", "content": "x"}]})
                    + "\n", r"empty\.jsonl:1: message 0 \(user\) has empty content"),
    "nothing.jsonl": ("", r"nothing\.jsonl holds no conversations \(it is empty, or blank lines only\)"),
    "blank.jsonl": ("\n  \n", r"blank\.jsonl holds no conversations"),
    "surrogate.jsonl": (json.dumps(_conv("ok", "fine")) + "\n" + json.dumps(_conv("hi \ud800", "x")) + "\n",
                        r"surrogate\.jsonl:2: text cannot be encoded as UTF-8 \(it contains lone surrogates\)"),
}


@pytest.mark.parametrize("argv, pattern", [
    *[("--data {tmp}/" + name, pat) for name, (_, pat) in _BAD_LINES.items()],
    ("--data {tmp}/nope.jsonl", r"input file .*nope\.jsonl does not exist"),
    ("--data {good} --base {tmp}/nobase", r"run directory .*nobase does not exist"),
    ("--data {good} --base {tmp}/nockpt", r"no checkpoint in .*nockpt/checkpoints"),
    ("--data {good} --base {tmp}/badtok", r"tokenizer .*badtok/tokenizer\.json cannot take the chat tokens"),
    ("--data {good} --set lora.rank=0", r"lora\.rank must be an integer >= 1, got 0"),
    ("--data {good} --set lora.targets=[nothing]", r"LoRA target pattern\(s\) \['nothing'\] match no Linear module; "
                                                  r"available: \['layers\.0\.attn\.q_proj'"),
    ("--data {good} --set lora.rank=4 --set training.parallel=fsdp", r"training\.parallel=fsdp with a lora section"),
    ("--data {good} --set sft.pretrain_mix=1.5", r"sft\.pretrain_mix must be in \[0, 1\)"),
    ("--data {good} --set sft.pretrain_mix=0.9", r"sft\.pretrain_mix=0\.9 leaves no conversation row"),
    ("--data {val} --set training.batch_size=64", r"split 'train' packs into \d+ rows of 49 tokens, fewer than one "
                                                  r"global batch \(64 rows"),
    ("--data {good} --set training.context_length=4", r"every conversation is longer than context_length \+ 1 = 5"),
    ("--data {val} --val-data {tmp}/nothing.jsonl", r"nothing\.jsonl holds no conversations"),
    ("--data {good} --run-dir {other}", r"holds another run \(not a fine-tuning of this base\)"),
    ("--data {good} --run-dir {tmp}/notes", r"not an lmforge run directory; .* --force"),
])
def test_bad_input_one_line_exit_2_nothing_written(base_run, convs, tiny_run, tmp_path, capsys, argv, pattern) -> None:
    import shutil

    for name, (text, _) in _BAD_LINES.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    nockpt = tmp_path / "nockpt"
    shutil.copytree(base_run, nockpt, ignore=shutil.ignore_patterns("*.safetensors"))
    badtok = tmp_path / "badtok"
    shutil.copytree(base_run, badtok)
    (badtok / "tokenizer.json").write_text('{"not": "a tokenizer"}')
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "mine.txt").write_text("keep")
    out = tmp_path / "out"
    args = argv.format(tmp=tmp_path, good=convs["train"], val=convs["val"], other=tiny_run).split()
    if "--base" not in args:
        args += ["--base", str(base_run)]
    if "--run-dir" not in args:
        args += ["--run-dir", str(out)]
    before = sorted(p.name for p in tiny_run.rglob("*"))
    rc = cli.main(["-q", "sft", *args, "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    import re
    assert re.search(pattern, err), err
    assert not out.exists()
    assert sorted(p.name for p in tiny_run.rglob("*")) == before
    assert (tmp_path / "notes" / "mine.txt").read_text() == "keep" and len(list((tmp_path / "notes").iterdir())) == 1


def test_render_file_trains_function_calls_with_their_tools(tmp_path) -> None:
    """SFT data with ``tools``: the tools block is rendered (never trained), the JSON call and its tokens are
    trained, the tool's result is not: as the chat format's mask says, through the file reader SFT uses."""
    from lmforge.chat.sft import render_file
    from lmforge.corpus.chat_data import FUNCTION_TASKS, with_function_tasks

    _, val = with_function_tasks([], [], [f"w{i}" for i in range(40)], n_train=1, n_val=2)
    path = tmp_path / "fn.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in val))
    fmt = ChatFormat(add_chat_tokens(Tokenizer({i: bytes([i]) for i in range(256)}, [])))
    rendered, skipped = render_file(path, fmt, 4096)
    assert skipped == 0 and len(rendered) == 2 and set(FUNCTION_TASKS) == {val[0]["task"]}
    for (ids, mask), rec in zip(rendered, val):
        assert (ids, mask) == fmt.render(rec["messages"], rec["tools"])
        trained = fmt.tokenizer.decode([i for i, m in zip(ids, mask) if m])
        assert trained.startswith('<|call_start|>{"name": "get_') and "<|tools_start|>" not in trained
        assert rec["messages"][2]["content"] not in trained  # the tool's result
