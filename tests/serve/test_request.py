"""The one internal chat request, without HTTP: both OpenAI dialects parse into the same
:class:`~lmforge.serve.request.ChatRequest` and the service turns it into the same scheduler jobs; errors found
after parsing (the renderer, the context, the grammar) name each dialect's own parameters by construction."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")

from lmforge.chat.format import ConversationError, check_conversation  # noqa: E402
from lmforge.serve import ServedModel, responses  # noqa: E402
from lmforge.serve.api import ChatCompletionRequest, parse  # noqa: E402
from lmforge.serve.errors import APIError  # noqa: E402
from lmforge.serve.metrics import Metrics  # noqa: E402
from lmforge.serve.response_store import ResponseStore  # noqa: E402
from lmforge.serve.service import Service  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1]))
from serve_helpers import random_chat_run  # noqa: E402

FN = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


@pytest.fixture(scope="module")
def svc(tmp_path_factory) -> Service:
    served = ServedModel.from_run(random_chat_run(tmp_path_factory.mktemp("request") / "run", context_length=512))
    return Service(served, None, Metrics(lambda: {}), ResponseStore(), 1 << 20, 30.0)


def _chat(**kw) -> ChatCompletionRequest:
    return parse(ChatCompletionRequest, json.dumps({"model": "m", **kw}).encode())


def _responses(**kw):
    req = parse(responses.ResponseRequest, json.dumps({"model": "m", **kw}).encode())
    return responses.chat_request(req, *responses.conversation(req, []))


def _error(call) -> APIError:
    with pytest.raises(APIError) as e:
        asyncio.run(call())
    return e.value


def test_both_dialects_parse_into_one_request_and_the_same_jobs(svc):
    chat = _chat(messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Oslo?"}],
                 tools=[{"type": "function", "function": FN}], tool_choice={"type": "function",
                                                                          "function": {"name": "get_weather"}},
                 max_completion_tokens=9, temperature=0.5, seed=3, logprobs=True, top_logprobs=2).chat_request()
    resp = _responses(instructions="Be brief.", input="Oslo?", tools=[{"type": "function", **FN}],
                      tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=9, temperature=0.5,
                      seed=3, include=["message.output_text.logprobs"], top_logprobs=2)
    for field in ("messages", "max_tokens", "temperature", "top_p", "seed", "n", "stop", "logprobs", "tool_choice",
                  "tool_name", "parallel_tool_calls", "format"):
        assert getattr(chat, field) == getattr(resp, field), field
    assert chat.tool_dicts() == resp.tool_dicts()
    jobs = [asyncio.run(svc.chat_jobs(r, "")) for r in (chat, resp)]  # a service function called directly
    a, b = (j[0] for j in jobs)
    assert a.prompt == b.prompt and a.max_tokens == b.max_tokens == 9 and (a.seed, a.logprobs) == (b.seed, b.logprobs)
    assert a.constraint.source == b.constraint.source == "tools" and a.constraint.force == b.constraint.force


def test_errors_after_parsing_name_each_dialects_parameters(svc):
    """The renderer's fault in a message, a prompt over the context and a schema llguidance refuses: each front
    end's names (the message's own item, ``max_output_tokens``, ``text.format.schema``), never the other's."""
    items = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    chat = _error(lambda: svc.chat_jobs(_chat(messages=items).chat_request(), ""))
    resp = _error(lambda: svc.chat_jobs(_responses(input=items), ""))
    assert (chat.param, resp.param) == ("messages", "input.1")
    assert chat.message.startswith("messages: message 1 has role 'user'") and \
        resp.message.startswith("input.1 (user) has role 'user'"), (chat.message, resp.message)
    long = [{"role": "user", "content": "x" * 450}]
    chat = _error(lambda: svc.chat_jobs(_chat(messages=long, max_tokens=100).chat_request(), ""))
    resp = _error(lambda: svc.chat_jobs(_responses(input=long, max_output_tokens=100), ""))
    assert (chat.param, resp.param) == ("max_tokens", "max_output_tokens")
    assert "the messages (" in chat.message and "the input (" in resp.message and "max_tokens" not in resp.message
    bad = {"type": "array", "uniqueItems": True}
    chat = _error(lambda: svc.chat_jobs(_chat(messages=long[:1], response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": bad}}).chat_request(), ""))
    resp = _error(lambda: svc.chat_jobs(_responses(input="x", text={"format": {
        "type": "json_schema", "name": "x", "schema": bad}}), ""))
    assert (chat.param, resp.param) == ("response_format.json_schema.schema", "text.format.schema")
    assert resp.message.startswith("text.format.schema: ") and "response_format" not in resp.message
    tool = {**FN, "parameters": {"type": "array"}}
    resp = _error(lambda: svc.chat_jobs(_responses(input="x", tools=[{"type": "function", **tool}]), ""))
    assert resp.param == "tools.0.parameters" and resp.message.startswith("tools.0.parameters: ")


def test_renderer_faults_carry_the_message_index(svc):
    """check_conversation's error holds the index of the message at fault (``ConversationError.index``), which
    names the client's item; a fault only the split of a reply's calculator markup shows (its empty output) names
    no item of the client's."""
    with pytest.raises(ConversationError) as e:
        check_conversation([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], for_training=False)
    assert e.value.index == 1
    items = [{"role": "user", "content": "q"}, {"role": "user", "content": "r"}]
    assert _error(lambda: svc.chat_jobs(_responses(input=items), "")).param == "input.1"
    items = [{"role": "user", "content": "q"},
             {"role": "assistant", "content": "<calculator>1</calculator><output></output>"},
             {"role": "user", "content": "r"}]
    resp = _error(lambda: svc.chat_jobs(_responses(input=items), ""))
    assert resp.param == "input" and "(tool) has empty content" in resp.message, (resp.param, resp.message)
