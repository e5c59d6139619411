"""Runs made directly (no training) for the interop tests: a chat-capable tokenizer and random weights."""

from __future__ import annotations

from pathlib import Path

import torch

from conftest import make_documents
from lmforge.chat import add_chat_tokens
from lmforge.checkpoint import CheckpointManager
from lmforge.config import dump_yaml
from lmforge.model import ModelConfig, TransformerLM
from lmforge.run import mark
from lmforge.tokenizer import EOT, Tokenizer
from lmforge.tokenizer.reference import train_bpe_reference
from lmforge.train.config import DataConfig, RunConfig

# Text that exercises the pre-tokenizer: unicode, whitespace runs, digits, contractions, special tokens in text.
TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "  leading spaces,\ttabs\tand\n\nnewlines   \n  trailing  ",
    "numbers 1234567 3.14159 -42 and 2+2=4; 10,000,000 000",
    "unicode: café naïve Ünïcödé 日本語のテキスト Ελληνικά 🙂🚀 emoji",
    "contractions: don't I'm we'll they've she'd IT'S",
    f"one document{EOT}and another{EOT}",
    "<|user_start|>hi there<|user_end|><|assistant_start|>hello<|assistant_end|>",
    "almost special <|user_start| and <|nope|> stay text",
    "\n\n\n", "   ", "a" * 70, "x\r\ny\r\n",
]


def make_tokenizer(vocab_size: int = 420, pattern: str = "gpt2", chat: bool = True) -> Tokenizer:
    """A small byte-level BPE trained on synthetic documents plus :data:`TEXTS` (chat tokens appended)."""
    docs = make_documents(60, seed=5) + [t.replace(EOT, " ") for t in TEXTS] * 3
    vocab, merges = train_bpe_reference(docs, vocab_size, [EOT], pattern=pattern)
    tok = Tokenizer(vocab, merges, [EOT], pattern=pattern)
    return add_chat_tokens(tok) if chat else tok


def random_model(cfg: ModelConfig, seed: int = 0) -> TransformerLM:
    """Random weights with non-trivial norm gains (so a swapped or dropped norm would show)."""
    torch.manual_seed(seed)
    model = TransformerLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("ln1.weight", "ln2.weight", "ln_final.weight")):
                p.uniform_(0.5, 1.5)
    return model


def make_run(path: Path, tokenizer: Tokenizer, cfg: ModelConfig, seed: int = 0) -> tuple[Path, TransformerLM]:
    """An lmforge run directory (marker, config.yaml, tokenizer.json, one checkpoint) holding random weights."""
    model = random_model(cfg, seed)
    path.mkdir(parents=True)
    tokenizer.save(path / "tokenizer.json")
    dump_yaml(RunConfig(model=cfg, data=DataConfig(dir=str(path / "data"))), path / "config.yaml")
    CheckpointManager(path).save(model, None, 3)
    mark(path)
    return path, model
