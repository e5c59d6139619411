"""The terminal chat: ``ToolUse``, ``Generator.turn`` with forced tool output, ``ChatSession`` history and
truncation, and ``lmforge chat --run`` driven through the real CLI with piped stdin."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmforge.chat import ChatFormat, ToolUse, add_chat_tokens, check_conversation, run_tool
from lmforge.chat.session import ChatSession, messages_from_reply
from lmforge.checkpoint import CheckpointManager, save_checkpoint
from lmforge.generate import Generator
from lmforge.model import ModelConfig
from serve_helpers import write_run


def make_chat_run(path: Path, tokenizer, context_length: int = 96, seed: int = 0) -> Path:
    """A run directory holding an untrained model whose tokenizer has the chat tokens (what SFT starts from)."""
    tok = add_chat_tokens(tokenizer)
    cfg = ModelConfig(vocab_size=tok.vocab_size, context_length=context_length, d_model=32, n_layers=2, n_heads=2)
    return write_run(path, tok, cfg, seed=seed)


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory, tiny_tokenizer) -> Path:
    return make_chat_run(tmp_path_factory.mktemp("chat") / "run", tiny_tokenizer)


@pytest.fixture
def fmt(tiny_tokenizer) -> ChatFormat:
    return ChatFormat(add_chat_tokens(tiny_tokenizer))


# --------------------------------------------------------------------------------------------------
# ToolUse: the per-sequence state machine
# --------------------------------------------------------------------------------------------------
def _call(fmt: ChatFormat, expr: str) -> list[int]:
    sp = fmt.ids
    return [sp["<|python_start|>"], *fmt.tokenizer.encode(expr, special="plain"), sp["<|python_end|>"]]


@pytest.mark.parametrize("expr, out", [("12*7", "84"), ("(3+4)*10", "70"), ("__import__('os')", "error: calculator"),
                                       ("9**9**9", "error: calculator"), ("1/0", "error: calculator"), ("", "error")])
def test_tool_use_runs_the_calculator_and_returns_the_output_ids(fmt, expr, out):
    use = ToolUse(fmt)
    ids = fmt.tokenizer.encode("so ", special="plain") + _call(fmt, expr)
    results = [use.feed(t) for t in ids]
    assert results[:-1] == [None] * (len(ids) - 1) and not use.in_call
    forced = results[-1]
    text = fmt.tokenizer.decode(forced)
    assert text.startswith("<|output_start|>" + out) and text.endswith("<|output_end|>")
    assert forced == fmt.tool_output_ids(run_tool(expr))
    assert use.calls == [(expr, run_tool(expr))]
    assert use.feed(fmt.ids["<|python_end|>"]) is None  # a stray end outside a call does nothing


def test_tool_use_bounds_the_call_length(fmt):
    use = ToolUse(fmt, max_call_tokens=5)
    forced = [use.feed(t) for t in _call(fmt, "1+" * 20 + "1")][-1]
    assert "error: the call is longer than 5 tokens" in fmt.tokenizer.decode(forced)


def test_run_tool_never_raises():
    assert run_tool("2+3") == "5"
    for bad in ["(" * 500 + "1" + ")" * 500, "x" * 10_000, "1e308*10", "lambda: 1", "\x00"]:
        assert run_tool(bad).startswith("error: ")


# --------------------------------------------------------------------------------------------------
# Generator.turn: a scripted model writes a tool call; its output is fed back in the same turn
# --------------------------------------------------------------------------------------------------
def _scripted(gen: Generator, script: list[int], monkeypatch) -> list[torch.Tensor]:
    """Make ``gen`` pick the ``script`` ids in order (the real model still runs); returns the logits it saw."""
    seen: list[torch.Tensor] = []

    def sample(row, logits, argmax=None):
        seen.append(logits[None].clone())
        return script[len(seen) - 1]

    monkeypatch.setattr(gen.rows, "sample", sample)
    return seen


def test_tool_output_is_fed_to_the_model_and_kept_in_history(chat_run, monkeypatch):
    session = ChatSession(Generator.from_run(chat_run, device="cpu"), temperature=0)
    fmt = session.fmt
    enc = lambda s: fmt.tokenizer.encode(s, special="plain")  # noqa: E731
    script = enc("let me see") + _call(fmt, "123*45") + enc("it is 5535") + [fmt.assistant_end_id]
    seen = _scripted(session.generator, script, monkeypatch)
    stream = session.send("what is 123*45?")
    text = "".join(stream)
    reply = stream.reply
    output = fmt.tool_output_ids("5535")
    n_call = len(enc("let me see") + _call(fmt, "123*45"))
    assert reply.ids == script[:n_call] + output + script[n_call:-1]
    assert text == "let me see<|python_start|>123*45<|python_end|><|output_start|>5535<|output_end|>it is 5535"
    assert reply.finish_reason == "stop" and reply.tool_calls == [("123*45", "5535")]
    assert session.history == [
        {"role": "user", "content": "what is 123*45?"},
        {"role": "assistant", "content": "let me see", "tool_call": "123*45"},
        {"role": "tool", "content": "5535"},
        {"role": "assistant", "content": "it is 5535"}]
    # the model really saw the forced ids: the logits after them equal a full forward over prompt + reply
    prompt = fmt.render_for_completion([{"role": "user", "content": "what is 123*45?"}])
    k = n_call + len(output)  # the first pick after the tool output
    with torch.no_grad():
        want = session.generator.model(torch.tensor([prompt + reply.ids[:k]]))[0, -1]
    torch.testing.assert_close(seen[n_call][0], want, rtol=1e-4, atol=1e-4)
    # the history renders back to exactly the ids the model saw, ready for the next turn
    ids, mask = fmt.render(session.messages())
    assert ids == prompt + reply.ids + [fmt.assistant_end_id]
    assert sum(mask[len(prompt) + n_call:len(prompt) + k]) == 0  # the tool output is never trained


def test_turn_ends_at_max_new_tokens_and_at_the_context(chat_run, monkeypatch):
    gen = Generator.from_run(chat_run, device="cpu")
    fmt = ChatFormat(gen.tokenizer)
    prompt = fmt.render_for_completion([{"role": "user", "content": "hi"}])
    turn = gen.turn(prompt, max_new_tokens=5, temperature=0, stop_ids=[])
    # (a reply ending inside a UTF-8 character adds (-1, "\ufffd", False): not a token)
    assert len([t for t, _, _ in turn if t >= 0]) == 5 and turn.finish_reason == "length"
    ctx = gen.cfg.context_length
    turn = gen.turn(prompt, max_new_tokens=1000, temperature=0, stop_ids=[])
    ids = [t for t, _, _ in turn if t >= 0]
    assert turn.finish_reason == "context" and len(prompt) + len(ids) == ctx + 1  # the last one is never fed
    with pytest.raises(ValueError, match="max_new_tokens must be a positive integer"):
        gen.turn(prompt, max_new_tokens=0)


def test_seeded_sampling_repeats_and_greedy_matches_generate_ids(chat_run):
    gen = Generator.from_run(chat_run, device="cpu")
    fmt = ChatFormat(gen.tokenizer)
    prompt = fmt.render_for_completion([{"role": "user", "content": "hello there"}])
    runs = [[t for t, _, _ in gen.turn(prompt, 12, temperature=1.0, rng=gen.rng(3))] for _ in range(2)]
    assert runs[0] == runs[1]
    greedy = [t for t, _, _ in gen.turn(prompt, 12, temperature=0)]
    assert greedy == gen.generate_ids(prompt, 12, temperature=0, stop_ids=[])


# --------------------------------------------------------------------------------------------------
# ChatSession: history, /reset, /system, dropping the oldest turns when the context is full
# --------------------------------------------------------------------------------------------------
def test_history_is_dropped_oldest_first_when_the_context_is_full(chat_run, monkeypatch):
    gen = Generator.from_run(chat_run, device="cpu")
    session = ChatSession(gen, system="be brief", max_new_tokens=8, temperature=0)
    fmt = session.fmt
    answer = fmt.tokenizer.encode("ok fine", special="plain") + [fmt.assistant_end_id]
    _cycle(gen, answer, monkeypatch)
    seen_prompts = _capture_prompts(gen, monkeypatch)
    dropped = []
    for i in range(12):
        stream = session.send(f"message number {i} with some words")
        assert "".join(stream) == "ok fine"
        dropped.append(stream.reply.dropped_turns)
        # the ids the model actually got: the system message, the newest turns kept, then this message
        prompt = seen_prompts[-1]
        assert prompt == fmt.render_for_completion(session.messages()[:-1])
        assert len(prompt) + session.reserve <= session.context_length
        if i > 0:  # the previous turn is always the last one dropped
            assert f"message number {i - 1} with" in fmt.tokenizer.decode(prompt)
        if sum(dropped):
            assert "message number 0 with" not in fmt.tokenizer.decode(prompt)
    assert sum(dropped) > 0 and dropped[0] == 0
    # a message too long even alone is refused before anything is dropped: the conversation survives
    before = session.messages()
    with pytest.raises(ValueError, match="has .* tokens but the model's context length is 96"):
        session.send("word " * 200)
    assert session.messages() == before and len(seen_prompts) == 12
    msgs = session.messages()
    assert msgs[0] == {"role": "system", "content": "be brief"}
    assert msgs[-2]["content"] == "message number 11 with some words"
    assert check_conversation(msgs) and len(msgs) - 1 == 2 * (12 - sum(dropped))
    session.set_system(None)
    assert session.messages()[0]["role"] == "user"
    session.reset()
    assert session.messages() == []
    with pytest.raises(ValueError, match="the message is empty"):
        session.send("  ")
    with pytest.raises(ValueError, match="has .* tokens but the model's context length is 96"):
        session.send("word " * 200)


def _capture_prompts(gen: Generator, monkeypatch) -> list[list[int]]:
    """Record the prompt ids of every ``gen.turn`` call (what generation actually receives)."""
    seen: list[list[int]] = []
    real = gen.turn

    def turn(prompt_ids, *args, **kwargs):
        seen.append(list(prompt_ids))
        return real(prompt_ids, *args, **kwargs)

    monkeypatch.setattr(gen, "turn", turn)
    return seen


def _cycle(gen: Generator, ids: list[int], monkeypatch) -> None:
    """Make ``gen`` pick ``ids`` over and over (the real model still runs every step)."""
    _scripted(gen, ids * 100, monkeypatch)


def test_messages_from_reply_edge_cases(fmt):
    enc = lambda s: fmt.tokenizer.encode(s, special="plain")  # noqa: E731
    assert messages_from_reply(fmt, enc("hi")) == [{"role": "assistant", "content": "hi"}]
    assert messages_from_reply(fmt, []) == []  # an empty reply is not kept
    unfinished = enc("a") + [fmt.ids["<|python_start|>"]] + enc("1+")
    assert messages_from_reply(fmt, unfinished) == [{"role": "assistant", "content": "a<|python_start|>1+"}]
    only_tool = _call(fmt, "1+1") + fmt.tool_output_ids("2")
    assert messages_from_reply(fmt, only_tool) == []  # nothing said after the tool: not representable


def test_a_base_run_is_refused_with_one_clear_line(tiny_run):
    with pytest.raises(ValueError, match=r"is not a chat model: its tokenizer lacks the chat tokens .*lmforge sft"):
        ChatSession.from_run(tiny_run, device="cpu")


# --------------------------------------------------------------------------------------------------
# The real CLI with piped stdin
# --------------------------------------------------------------------------------------------------
def _cli(args: list[str], stdin: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONIOENCODING="utf-8", OMP_NUM_THREADS="1")  # a tiny model: one thread is fastest
    return subprocess.run([sys.executable, "-m", "lmforge.cli", *args], input=stdin, capture_output=True,
                          text=True, env=env, timeout=120)


def test_cli_chat_with_piped_stdin_prints_one_line_per_reply(chat_run):
    args = ["chat", "--run", str(chat_run), "--temperature", "0", "--max-new-tokens", "6", "--device", "cpu"]
    out = _cli(args, "hello\n\n/system be nice\nhow are you?\n/reset\n/system\nhello\n/quit\nnever read\n")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split("\n")
    assert len(lines) == 4 and lines[-1] == "", out.stdout  # three replies, each on its own line
    assert lines[0] == lines[2]  # after /reset the same greedy reply to the same first message
    assert "system message set" in out.stderr and "conversation reset" in out.stderr
    assert "Traceback" not in out.stderr
    same = _cli(args + ["--no-draft", "--prefix-cache-mb", "0"], "hello\nhow are you?\n")  # drafts, cache off
    assert same.stdout.split("\n")[0] == lines[0]


def test_cli_chat_on_a_terminal_streams_after_a_prompt(chat_run):
    """On a TTY: a ``you>`` prompt, the reply after ``model>``, and Ctrl-D (EOF) leaves with exit code 0."""
    import pty
    import select
    import time

    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "lmforge.cli", "chat", "--run", str(chat_run), "--temperature", "0",
                             "--max-new-tokens", "4", "--device", "cpu"], stdin=follower, stdout=follower,
                            stderr=follower, close_fds=True)
    os.close(follower)
    seen = b""

    def read_until(marker: bytes, count: int = 1, timeout: float = 60) -> None:
        nonlocal seen
        end = time.time() + timeout
        while seen.count(marker) < count and time.time() < end:
            if select.select([leader], [], [], 0.5)[0]:
                try:
                    seen += os.read(leader, 4096)
                except OSError:
                    break
        assert marker in seen, seen

    try:
        read_until(b"you> ")
        os.write(leader, b"hello\n")
        read_until(b"model> ")
        read_until(b"you> ", count=2)  # the reply streamed, then the next prompt
        os.write(leader, b"\x04")  # Ctrl-D
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(leader)
    assert b"chatting with" in seen and b"Traceback" not in seen


def test_a_model_trained_to_call_the_calculator_gets_its_output_through_the_cli(tmp_path, tiny_tokenizer):
    """End to end: a tiny model overfit on one tool-use conversation (whose tool message is deliberately wrong)
    writes the call; the chat runs the real calculator and feeds its result, which the reply shows."""
    run = make_chat_run(tmp_path / "run", tiny_tokenizer, context_length=64, seed=1)
    gen = Generator.from_run(run, device="cpu")
    fmt = ChatFormat(gen.tokenizer)
    convo = [{"role": "user", "content": "Use the calculator: what is 123*45?"},
             {"role": "assistant", "content": "", "tool_call": "123*45"},
             {"role": "tool", "content": "WRONG"},  # the calculator's own 5535 must appear at chat time
             {"role": "assistant", "content": "done"}]
    ids, mask = fmt.render(convo)
    x, y = torch.tensor([ids[:-1]]), torch.tensor([ids[1:]])
    y = torch.where(torch.tensor([mask[1:]]).bool(), y, torch.tensor(-100))
    model = gen.model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.set_num_threads(1)  # tiny ops: threads only contend on a loaded machine (conftest restores the count)
    for _ in range(150):
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.05
    save_checkpoint(model, None, 2, CheckpointManager(run).path_for(2))
    out = _cli(["chat", "--run", str(run), "--temperature", "0", "--max-new-tokens", "20", "--device", "cpu"],
               "Use the calculator: what is 123*45?\n")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("<|python_start|>123*45<|python_end|><|output_start|>5535<|output_end|>"), out.stdout
    assert out.stdout.count("\n") == 1
