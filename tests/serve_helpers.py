"""Helpers of the server tests: small run directories (random, all-zero or hand-set weights) and a server in a thread."""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch
import yaml

from lmforge.chat import add_chat_tokens
from lmforge.checkpoint import CheckpointManager, save_checkpoint
from lmforge.model import ModelConfig, TransformerLM
from lmforge.run import mark
from lmforge.tokenizer import Tokenizer

NO_PROXY = "127.0.0.1,localhost"


def byte_chat_tokenizer(extra: tuple[bytes, ...] = ()) -> Tokenizer:
    """Every byte a token, then ``extra`` whole-word tokens (decode only), then the chat special tokens."""
    vocab = {i: bytes([i]) for i in range(256)}
    for k, b in enumerate(extra):
        vocab[256 + k] = b
    return add_chat_tokens(Tokenizer(vocab, []))


def write_run(path: Path, tok: Tokenizer, cfg: ModelConfig, fill: Callable[[TransformerLM], None] | None = None,
              seed: int = 0, init: bool = True) -> Path:
    """A run directory (marker, config, tokenizer, one checkpoint) holding ``TransformerLM(cfg)`` after ``fill``.
    ``init=False``: the weights start uninitialised (seconds saved on wide models), for a ``fill`` setting them all."""
    torch.manual_seed(seed)
    model = TransformerLM(cfg) if init else TransformerLM(cfg, device="meta").to_empty(device="cpu")
    if fill is not None:
        with torch.no_grad():
            fill(model)
    path.mkdir(parents=True)
    tok.save(path / "tokenizer.json")
    (path / "config.yaml").write_text(yaml.safe_dump({"model": dataclasses.asdict(cfg)}))
    save_checkpoint(model, None, 1, CheckpointManager(path).path_for(1))
    mark(path)
    return path


def random_chat_run(path: Path, context_length: int = 96) -> Path:
    """An untrained model with the chat tokens: varied, prompt-dependent output."""
    tok = byte_chat_tokenizer()
    cfg = ModelConfig(vocab_size=tok.vocab_size, context_length=context_length, d_model=32, n_layers=2, n_heads=2)
    return write_run(path, tok, cfg)


def zero_run(path: Path, context_length: int = 4096, d_model: int = 64, n_layers: int = 6) -> Path:
    """All weights zero: every logit is 0, so greedy decoding repeats token 0 (byte NUL) and never stops early.
    Six layers over a 4096-token context: a long request takes seconds (the limit tests need one running)."""
    tok = byte_chat_tokenizer()
    cfg = ModelConfig(vocab_size=tok.vocab_size, context_length=context_length, d_model=d_model, n_layers=n_layers,
                      n_heads=4)

    def zero(model: TransformerLM) -> None:
        for p in model.parameters():
            p.zero_()

    return write_run(path, tok, cfg, zero, init=False)


SCRIPT_WORDS = (b"<script>", b"alert('pwned')", b"</script>")


def chain_run(path: Path, chain: list[int | str], extra: tuple[bytes, ...] = (),
              also: tuple[tuple[int | str, int | str], ...] = ()) -> Path:
    """Hand-set weights that make greedy decoding follow ``chain`` (token ids, or chat special tokens by name):
    after ``chain[k]`` comes ``chain[k + 1]`` (and after ``a`` comes ``b`` for each pair in ``also``). Attention
    and MLP outputs are zero, so the next token depends on the current one only: each such token's embedding
    is one-hot in its own dimension, and the head maps that dimension to the next token."""
    tok = byte_chat_tokenizer(extra)

    def tid(t: int | str) -> int:
        return tok.special_tokens[t] if isinstance(t, str) else t

    pairs = [(tid(a), tid(b)) for a, b in [*zip(chain, chain[1:]), *also]]
    cfg = ModelConfig(vocab_size=tok.vocab_size, context_length=256, d_model=16, n_layers=1, n_heads=2)
    assert len(pairs) <= cfg.d_model

    def fill(model: TransformerLM) -> None:
        for p in model.parameters():
            p.zero_()
        for name in ("ln1.weight", "ln2.weight"):
            model.layers[0].get_parameter(name).fill_(1.0)
        model.ln_final.weight.fill_(1.0)
        for k, (cur, nxt) in enumerate(pairs):
            model.token_embeddings.weight[cur, k] = 1.0
            model.lm_head.weight[nxt, k] = 10.0

    return write_run(path, tok, cfg, fill)


def script_run(path: Path) -> Path:
    """After ``<|assistant_start|>`` the model says ``<script>alert('pwned')</script>`` (three whole-word tokens,
    one per step) and ends its turn."""
    return chain_run(path, ["<|assistant_start|>", 256, 257, 258, "<|assistant_end|>"], SCRIPT_WORDS)


def calculator_run(path: Path, then: str = "") -> Path:
    """The model calls the calculator (``6*7``) and, once the tool's output has been fed in, says ``then`` (one
    token per character, each distinct and none of ``6*7``) and ends its turn."""
    after = ["<|output_end|>", *map(ord, then), "<|assistant_end|>"]
    return chain_run(path, ["<|assistant_start|>", "<|python_start|>", ord("6"), ord("*"), ord("7"),
                            "<|python_end|>"], also=tuple(zip(after, after[1:])))


def wide_zero_run(path: Path) -> Path:
    """The all-zero model with wide layers: a few ms per token even on a quiet machine, so 4,000 tokens take
    many seconds (a budget no request can reach within a test's one-second deadline)."""
    return zero_run(path, d_model=512, n_layers=4)


def recorded_prompts(served: Any, monkeypatch: Any) -> list[list[int]]:
    """The prompt ids of every request ``served``'s scheduler receives from now on (its ``submit_many``, which
    ``submit`` and the server call, wrapped; one entry per prompt, however many samples it has)."""
    seen: list[list[int]] = []
    submit_many = served.scheduler.submit_many

    def record(reqs: Any) -> None:
        seen.append(list(reqs[0].prompt))
        submit_many(reqs)

    monkeypatch.setattr(served.scheduler, "submit_many", record)
    return seen


class ThreadServer:
    """``create_app(served, **app_kw)`` under ``uvicorn.Server`` in a thread, on a free loopback port, with the
    settings ``lmforge serve`` uses (:func:`~lmforge.serve.server.uvicorn_config`; ``header_timeout`` goes there)."""

    def __init__(self, served: Any, **app_kw: Any) -> None:
        import uvicorn

        from lmforge.serve import bind
        from lmforge.serve.app import create_app
        from lmforge.serve.server import uvicorn_config

        self.served = served
        self.sock = bind("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        header_kw = {"header_timeout": app_kw.pop("header_timeout")} if "header_timeout" in app_kw else {}
        self.server = uvicorn.Server(uvicorn_config(create_app(served, **app_kw), log_level="warning", **header_kw))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


def openai_client(url: str, api_key: str = "unused", **kw: Any) -> Any:
    """The official client, immune to proxy variables (loopback requests must not go to a proxy)."""
    import openai

    os.environ["NO_PROXY"] = os.environ["no_proxy"] = NO_PROXY
    return openai.OpenAI(base_url=url + "/v1", api_key=api_key,
                         http_client=openai.DefaultHttpxClient(trust_env=False), **kw)
