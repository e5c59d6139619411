"""A tiny chat model for the RL tests: 4 pretraining steps, then 40 SFT steps on one-digit sums and calculator
calls (it ends its replies and sometimes calls the calculator, and is right now and then: rewards vary)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from conftest import make_documents


def _item(rng: random.Random) -> dict:
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    if rng.random() < 0.3:
        return {"task": "calculator", "messages": [
            {"role": "user", "content": f"calc {a}*{b}"},
            {"role": "assistant", "content": "ok", "tool_call": f"{a}*{b}"},
            {"role": "tool", "content": str(a * b)}, {"role": "assistant", "content": str(a * b)}]}
    return {"task": "add", "messages": [{"role": "user", "content": f"{a}+{b}?"},
                                        {"role": "assistant", "content": str(a + b)}]}


def write_tasks(path: Path, n: int, seed: int) -> Path:
    rng = random.Random(seed)
    path.write_text("".join(json.dumps(_item(rng)) + "\n" for _ in range(n)), encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def rl_tasks(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("rl_tasks")
    return {"train": write_tasks(d / "train.jsonl", 200, 0), "val": write_tasks(d / "val.jsonl", 16, 1)}


@pytest.fixture(scope="session")
def chat_run(tmp_path_factory, rl_tasks) -> Path:
    from lmforge.chat.sft import sft
    from lmforge.data import prepare
    from lmforge.tokenizer import EOT, Tokenizer, train_bpe
    from lmforge.train import load_run_config, train

    d = tmp_path_factory.mktemp("rl_chat")
    corpus = d / "corpus.txt"
    corpus.write_text(EOT.join(make_documents(300, seed=3)), encoding="utf-8")
    tok = Tokenizer(*train_bpe(corpus, 300, [EOT], progress=False), [EOT])
    prepare(tok, corpus, d / "shards", val_fraction=0.1, progress=False)
    cfg = load_run_config(base={
        "model": {"vocab_size": 320, "context_length": 64, "d_model": 32, "n_layers": 2, "n_heads": 2},
        "optimizer": {"lr": 3e-3, "warmup_steps": 1},
        "training": {"max_steps": 4, "batch_size": 4, "device": "cpu", "eval_every": 4, "eval_batches": 2,
                     "checkpoint_every": 4, "num_threads": 1},
        "data": {"dir": str(d / "shards")}})
    train(cfg, d / "base", progress=False)
    sft(d / "base", rl_tasks["train"], d / "sft", progress=False,
        overrides=["training.max_steps=40", "optimizer.lr=1e-2", "training.batch_size=8", "training.log_every=10"])
    return d / "sft"
