"""Calculator calls through the chat API: shown in a text markup (never as special-token text) and read back
from it, so a conversation that goes through the server renders to the ids ``lmforge chat`` renders.

The model is hand-set (:func:`serve_helpers.calculator_run`): after ``<|assistant_start|>`` it calls the
calculator with ``6*7`` and, once the server has fed the tool's output in, says ``then`` and ends its turn.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from lmforge.chat import ChatFormat  # noqa: E402
from lmforge.serve import ServedModel  # noqa: E402
from lmforge.serve.server import messages_from_text  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1]))
from serve_helpers import ThreadServer, calculator_run, chain_run, openai_client, recorded_prompts  # noqa: E402

USER = {"role": "user", "content": "What is 6*7?"}
USER2 = {"role": "user", "content": "And again?"}
SHOWN = "<calculator>6*7</calculator><output>42</output>"


@pytest.fixture(scope="module")
def calc(tmp_path_factory):
    """A server whose model calls the calculator, then says "!"."""
    s = ThreadServer(ServedModel.from_run(calculator_run(tmp_path_factory.mktemp("t") / "calc", then="!")))
    yield s
    s.close()


def test_a_reply_shows_the_call_in_markup_streamed_or_not(calc):
    client = openai_client(calc.url)
    r = client.chat.completions.create(model="calc", messages=[USER], temperature=0, max_tokens=30)
    assert r.choices[0].message.content == SHOWN + "!" and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == 5 + 4 + 1  # the call, the tool's output, "!"
    chunks = list(client.chat.completions.create(model="calc", messages=[USER], temperature=0, max_tokens=30,
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == SHOWN + "!"


def test_a_round_trip_through_the_openai_client_renders_the_chat_formats_ids(calc, monkeypatch):
    """Turn 2 as a client sends it (the reply's content, or the reply's message object itself): the prompt the
    scheduler receives is ChatFormat's render of the structured conversation (tool_call and tool messages),
    which is also turn 1's prompt + the ids the model generated + <|assistant_end|> + the next user turn."""
    fmt = ChatFormat(calc.served.tokenizer)
    sp = fmt.ids
    prompts = recorded_prompts(calc.served, monkeypatch)
    client = openai_client(calc.url)
    first = client.chat.completions.create(model="calc", messages=[USER], temperature=0, max_tokens=30)
    structured = [USER, {"role": "assistant", "content": "", "tool_call": "6*7"}, {"role": "tool", "content": "42"},
                  {"role": "assistant", "content": "!"}, USER2]
    want = fmt.render_for_completion(structured)
    generated = [sp["<|python_start|>"], *b"6*7", sp["<|python_end|>"], *fmt.tool_output_ids("42"), ord("!")]
    assert want == prompts[0] + generated + [sp["<|assistant_end|>"], sp["<|user_start|>"], *b"And again?",
                                             sp["<|user_end|>"], sp["<|assistant_start|>"]]
    as_dict = {"role": "assistant", "content": first.choices[0].message.content}
    for reply in (as_dict, first.choices[0].message):
        second = client.chat.completions.create(model="calc", messages=[USER, reply, USER2], temperature=0,
                                                max_tokens=30)
        assert second.choices[0].message.content == SHOWN + "!"
        assert prompts[-1] == want
    assert len(prompts) == 3


def test_a_reply_that_ends_right_after_the_tool_output_round_trips(tmp_path, monkeypatch):
    """Nothing said after the output (the chat format's training data never has this, a model may): sent back,
    it renders as generated, <|output_end|><|assistant_end|>, instead of being refused."""
    s = ThreadServer(ServedModel.from_run(calculator_run(tmp_path / "calc")))
    try:
        fmt = ChatFormat(s.served.tokenizer)
        prompts = recorded_prompts(s.served, monkeypatch)
        client = openai_client(s.url)
        reply = client.chat.completions.create(model="calc", messages=[USER], temperature=0)
        content = reply.choices[0].message.content
        assert content == SHOWN
        client.chat.completions.create(model="calc", messages=[USER, {"role": "assistant", "content": content}, USER2],
                                       temperature=0)
        sp = fmt.ids
        turn = prompts[0] + [sp["<|python_start|>"], *b"6*7", sp["<|python_end|>"], *fmt.tool_output_ids("42"),
                             sp["<|assistant_end|>"]]
        assert prompts[1][: len(turn)] == turn and prompts[1][len(turn)] == sp["<|user_start|>"]
    finally:
        s.close()


def test_markup_in_user_text_stays_text(calc, monkeypatch):
    """Only assistant messages are read for calls: a user typing the markup gets its plain bytes, never the
    special ids (as with typed special-token text)."""
    sp = ChatFormat(calc.served.tokenizer).ids
    prompts = recorded_prompts(calc.served, monkeypatch)
    typed = {"role": "user", "content": SHOWN}
    openai_client(calc.url).chat.completions.create(model="calc", messages=[typed], temperature=0, max_tokens=1)
    assert not {sp["<|python_start|>"], sp["<|output_start|>"]} & set(prompts[0])
    assert bytes(t for t in prompts[0] if t < 256) == SHOWN.encode()


def test_messages_from_text():
    assert messages_from_text("plain") == [{"role": "assistant", "content": "plain"}]
    two = messages_from_text(f"a{SHOWN}b<calculator>1+1</calculator><output>2</output>")
    assert two == [{"role": "assistant", "content": "a", "tool_call": "6*7"}, {"role": "tool", "content": "42"},
                   {"role": "assistant", "content": "b", "tool_call": "1+1"}, {"role": "tool", "content": "2"},
                   {"role": "assistant", "content": ""}]
    # an unfinished call (cut by max_tokens) and a blank one stay text, as lmforge chat keeps them
    for text in ("x<calculator>6*", "<calculator> </calculator><output>error</output>", "<output>42</output>"):
        assert messages_from_text(text) == [{"role": "assistant", "content": text}]


def test_chat_replies_stop_at_user_start(tmp_path):
    """A model that goes on to write the user's next turn is stopped there, as ChatSession stops it."""
    run = chain_run(tmp_path / "chatty", ["<|assistant_start|>", ord("h"), ord("i"), "<|user_start|>", ord("x"),
                                          ord("y"), "<|assistant_end|>"])
    s = ThreadServer(ServedModel.from_run(run))
    try:
        r = openai_client(s.url).chat.completions.create(model="chatty", messages=[USER], temperature=0, max_tokens=20)
        assert r.choices[0].message.content == "hi" and r.choices[0].finish_reason == "stop"
        assert r.usage.completion_tokens == 2
    finally:
        s.close()


def test_server_doctests_hold():
    import doctest

    from lmforge.serve import server

    failures, tried = doctest.testmod(server)
    assert tried and not failures
