"""Rollouts through the one engine: the chat's replies (tool calls run as ChatSession runs them), the kernel held
to the PyTorch path, and every step decoding with the weights the previous update left (never stale ones)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from rl_helpers import chat_run, rl_tasks  # noqa: F401  (fixtures)
from lmforge.chat import ChatFormat, ToolUse
from lmforge.evals import load_model
from lmforge.generate import Generator
from lmforge.generate.engine import Engine
from lmforge.rl import RolloutSource, rl_config, rollout_seed, sample_replies
from lmforge.rl.data import read_prompts
from lmforge.rl.source import step_prompts
from lmforge.run import open_run
from lmforge.tokenizer import Tokenizer
from lmforge.train.distributed import DistInfo

SAMPLING = {"temperature": 1.0, "top_k": None, "top_p": None, "max_new_tokens": 12}


def _prompts(fmt: ChatFormat) -> list[list[int]]:
    msgs = ["calc 7*8", "3+4?", "calc 2*9", "5+5?"]
    return [fmt.render_for_completion([{"role": "user", "content": m}]) for m in msgs]


def _seeds(n_prompts: int, k: int, step: int = 0) -> list[list[int]]:
    return [[rollout_seed(7, step, j, s) for s in range(k)] for j in range(n_prompts)]


def test_each_prompt_is_prefilled_once_and_copied_into_its_k_rows(chat_run, monkeypatch) -> None:
    """K = 8 replies to each of 4 prompts: 4 prefills of one prompt each (the prompt tokens run once, not 8 times)
    and 7 copies of each prefilled row."""
    model, tok, _ = load_model(chat_run, device="cpu")
    fmt, engine = ChatFormat(tok), Engine(model)
    prompts, prefilled, forks = _prompts(fmt), [], []
    admit, fork = engine.admit, engine.fork
    monkeypatch.setattr(engine, "admit", lambda p, *a: (prefilled.append(len(p)), admit(p, *a))[1])
    monkeypatch.setattr(engine, "fork", lambda row: (forks.append(row), fork(row))[1])
    groups = sample_replies(engine, prompts, _seeds(4, 8), fmt=fmt, vocab_limit=tok.vocab_size, **SAMPLING)
    assert prefilled == [len(p) for p in prompts] and len(forks) == 4 * 7
    assert [len(g) for g in groups] == [8] * 4 and all(r.ids or r.stop is not None for g in groups for r in g)


def test_replies_are_the_chats_own_tool_calls_run_and_fed_back(chat_run) -> None:
    """Each row of a batch of 4 prompts x 4 samples equals ``Generator.turn`` alone on its prompt with its seed and
    a ``ToolUse`` (what ChatSession does): the same ids, forced output included, the same finish; the forced ids
    are exactly the calculator's output, flagged as not sampled."""
    model, tok, _ = load_model(chat_run, device="cpu")
    fmt, gen = ChatFormat(tok), Generator(model, tok)
    prompts, seeds = _prompts(fmt), _seeds(4, 4)
    groups = sample_replies(gen.engine, prompts, seeds, fmt=fmt, vocab_limit=tok.vocab_size, **SAMPLING)
    calls = 0
    for p, group, ss in zip(prompts, groups, seeds):
        for r, seed in zip(group, ss):
            turn = gen.turn(p, SAMPLING["max_new_tokens"], temperature=1.0, rng=torch.Generator().manual_seed(seed),
                            stop_ids=fmt.stop_ids, inject=ToolUse(fmt).feed)
            list(turn)
            assert r.ids == turn.ids and r.finish == turn.finish_reason
            forced = [t for t, s in zip(r.ids, r.sampled) if not s]
            tool = ToolUse(fmt)
            expected = [t for t in r.ids if not (out := tool.feed(t)) is None for t in out]
            assert forced == expected and r.tool_calls == len(tool.calls)
            calls += r.tool_calls
    assert calls > 0, "the test needs replies that call the calculator"
    assert len({tuple(r.ids) for g in groups for r in g}) > 8  # the seeds differ: so do the replies


def test_kernel_rollouts_equal_the_pytorch_engines(chat_run) -> None:
    model, tok, _ = load_model(chat_run, device="cpu")
    fmt = ChatFormat(tok)
    prompts, seeds = _prompts(fmt), _seeds(4, 4)
    fast = sample_replies(Engine(model), prompts, seeds, fmt=fmt, vocab_limit=tok.vocab_size, **SAMPLING)
    ref = sample_replies(Engine(model, use_kernel=False), prompts, seeds, fmt=fmt, vocab_limit=tok.vocab_size,
                         **SAMPLING)
    assert [[r.ids for r in g] for g in fast] == [[r.ids for r in g] for g in ref]


def test_each_step_decodes_with_the_updated_weights(chat_run, rl_tasks, tmp_path: Path) -> None:
    """The source's step-1 rollouts equal a fresh engine's on the weights after the step-0 update, and differ
    from an engine packed before it (stale weights)."""
    run = open_run(chat_run)
    tok = Tokenizer.load(run.tokenizer_path)
    fmt = ChatFormat(tok)
    base = {"run": str(chat_run), "checkpoint": str(run.checkpoint_path), "sha256": ""}
    cfg = rl_config(run.config, tok.vocab_size, tmp_path, base, False,
                    overrides=["rl.prompts_per_step=4", "rl.samples_per_prompt=4", "rl.max_new_tokens=12",
                               "rl.prompts_per_decode=2", f"rl.temperature={SAMPLING['temperature']}"])
    prompts, _ = read_prompts(rl_tasks["train"], fmt, cfg.context_length, cfg.rl.max_new_tokens)
    model, _, _ = load_model(chat_run, device="cpu")
    model.train()
    src = RolloutSource(cfg, prompts, fmt, DistInfo(0, 0, 1, torch.device("cpu")), micro_batch=16)
    src.bind(model)
    x, y, w = src.next_batch()  # step 0
    stale = Engine(copy.deepcopy(model))
    loss = model(x, targets=y, ignore_index=-100, reduction="sum", weights=w) / (y != -100).sum()
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 1.0 * p.grad  # a large step: the sampled replies must change
    src.next_batch()  # step 1, drawn with the updated weights
    got = [r.ids for r in src.last_rollouts]
    idx = step_prompts(len(prompts), cfg.training.seed, 1, 4)
    chunks = [[0, 1], [2, 3]]

    def draw(engine: Engine) -> list[list[int]]:
        out = []
        for c in chunks:
            groups = sample_replies(engine, [prompts.ids[idx[j]] for j in c],
                                    [[rollout_seed(cfg.training.seed, 1, j, k) for k in range(4)] for j in c],
                                    fmt=fmt, vocab_limit=tok.vocab_size, **SAMPLING)
            out += [r.ids for g in groups for r in g]
        return out

    assert got == draw(Engine(copy.deepcopy(model).eval()))
    assert got != draw(stale)


@pytest.mark.parametrize("bad", ["empty", "long"])
def test_a_prompt_without_room_for_a_reply_is_refused(chat_run, bad) -> None:
    model, tok, _ = load_model(chat_run, device="cpu")
    fmt = ChatFormat(tok)
    p = list(range(5)) * 20 if bad == "long" else []
    with pytest.raises(ValueError, match="leaves no room for a reply"):
        sample_replies(Engine(model), [p], [[1, 2]], fmt=fmt, vocab_limit=tok.vocab_size, **SAMPLING)


def test_items_with_function_tools_are_skipped_and_a_file_of_only_them_refused(chat_run, tmp_path: Path) -> None:
    """`data get chat-tasks` writes function_call items (with "tools"): their answers need a function's result,
    which a rollout cannot produce, so they are skipped like a too-long prompt; a file of only them is refused."""
    import json

    from lmforge.corpus.chat_data import FUNCTION_TOOLS

    fmt = ChatFormat(Tokenizer.load(open_run(chat_run).tokenizer_path))
    plain = {"task": "arithmetic", "messages": [{"role": "user", "content": "3+4?"},
                                                 {"role": "assistant", "content": "7"}]}
    call = {"task": "function_call", "tools": FUNCTION_TOOLS, "messages": [
        {"role": "user", "content": "What is the weather in Rome?"},
        {"role": "assistant", "content": "It is 20 °C and sunny in Rome."}]}
    mixed, only = tmp_path / "mixed.jsonl", tmp_path / "only.jsonl"
    mixed.write_text("".join(json.dumps(r) + "\n" for r in (plain, call, plain)))
    only.write_text(json.dumps(call) + "\n")
    prompts, skipped = read_prompts(mixed, fmt, 256, 8)
    assert (len(prompts), skipped, prompts.tasks) == (2, 1, ["arithmetic", "arithmetic"])
    with pytest.raises(ValueError, match="function tools"):
        read_prompts(only, fmt, 256, 8)
