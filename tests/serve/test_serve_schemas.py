"""Structured output and tools against hostile or careless clients, through the real server: schemas that crashed
or froze it, schemas with no document, decode-time grammar failures, 500s that are 400s, parameters that change
the answer, replies cut inside a call, and the tool-choice rules (hand-set models that call a function).
Every hostile test ends with a normal request on the same server."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
import httpx  # noqa: E402

from lmforge.serve import ServedModel  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1]))
sys.path.insert(0, str(Path(__file__).parents[1] / "generate"))
from serve_helpers import ThreadServer, chain_run, openai_client, random_chat_run  # noqa: E402
from test_constraints_limits import patterns, ref_chain  # noqa: E402

MSG = [{"role": "user", "content": "Weather?"}]
NOARGS = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {},
                                                                        "additionalProperties": False}}}
CALL = '{"name": "f", "arguments": {}}'  # the only text a call to NOARGS can have


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = ThreadServer(ServedModel.from_run(random_chat_run(tmp_path_factory.mktemp("schemas") / "chatty",
                                                          context_length=1024), max_batch=4))
    yield s
    s.close()


def post(srv, body: dict, path: str = "/v1/chat/completions") -> httpx.Response:
    data = json.dumps({"model": "chatty", **body}).encode()  # (ASCII escapes: lone surrogates can be sent)
    return httpx.post(srv.url + path, content=data, headers={"Content-Type": "application/json"}, trust_env=False,
                      timeout=60)


def still_up(srv) -> None:
    r = openai_client(srv.url).chat.completions.create(model="chatty", messages=MSG, max_tokens=30, seed=1,
                                                       extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert r.choices[0].message.content in ("yes", "no") and r.choices[0].finish_reason == "stop"


def rf(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def test_hostile_schemas_are_400s_and_the_server_stays_up(srv):
    """The 3,000-ref chain (SIGSEGV in llguidance's compile, before), in response_format and in a tool; nested
    array refs; no finite document (200 with "" and stop, before); compiles that fail once decoding starts
    (500 echoing the grammar, before); a 5,000-digit max_tokens and a lone surrogate in a choice (500s)."""
    tool = {"type": "function", "function": {"name": "g", "parameters": {"type": "object", **ref_chain(3000)}}}
    cases = [({"response_format": rf(ref_chain(3000))}, "response_format.json_schema.schema", "limit of 128"),
             ({"tools": [tool]}, "tools.0.function.parameters", "limit of 128"),
             ({"response_format": rf(ref_chain(2000, arrays=True))}, "response_format.json_schema.schema", "limit of 128"),
             ({"response_format": rf({"$ref": "#"})}, "response_format.json_schema.schema", "no finite document"),
             ({"response_format": rf({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                                      "$ref": "#/$defs/a"})}, "response_format.json_schema.schema", "no finite"),
             ({"response_format": rf({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]})},
              "response_format.json_schema.schema", "no finite document"),
             ({"response_format": rf({"type": "object", "properties": {f"p{i}": {"type": "integer"}
                                                                       for i in range(500)}})},
              "response_format.json_schema.schema", "Current row has"),
             ({"structured_outputs": {"choice": ["a\ud800"]}}, "structured_outputs.choice", "valid Unicode")]
    for body, param, says in cases:
        r = post(srv, {"messages": MSG, "max_tokens": 20, **body})
        assert r.status_code == 400, (param, r.text[:300])
        err = r.json()["error"]
        assert err["param"] == param and says in err["message"] and len(err["message"]) < 600, err
    r = httpx.post(srv.url + "/v1/chat/completions", content=b'{"model": "chatty", "messages": [{"role": "user", '
                   b'"content": "hi"}], "max_tokens": ' + b"9" * 5000 + b"}",
                   headers={"Content-Type": "application/json"}, trust_env=False, timeout=30)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    still_up(srv)


@pytest.mark.serial
def test_health_answers_within_100_ms_during_hostile_compiles(srv):
    """Three slow schemas (1,000 patterned properties, each ~0.3 s to compile) sent at once: /health answers
    within 100 ms throughout (each compile used to run on the event loop)."""
    results: list[int] = []

    def send(k: int) -> None:
        results.append(post(srv, {"messages": MSG, "max_tokens": 1,
                                  "response_format": rf(patterns(1000, tag=f"t{k}"))}).status_code)

    threads = [threading.Thread(target=send, args=(k,)) for k in range(3)]
    with httpx.Client(trust_env=False, timeout=30) as c:
        c.get(srv.url + "/health")
        for t in threads:
            t.start()
        latencies = []
        while any(t.is_alive() for t in threads):
            t0 = time.perf_counter()
            assert c.get(srv.url + "/health").status_code == 200
            latencies.append(time.perf_counter() - t0)
            time.sleep(0.01)
    for t in threads:
        t.join()
    assert results == [200] * 3 and len(latencies) >= 5
    assert max(latencies) < 0.1, sorted(latencies)[-5:]
    still_up(srv)


def test_parameters_that_change_the_answer_are_refused_by_name(srv):
    tool = {"type": "function", "function": {"name": "s", "parameters": {"type": "string"}}}
    chat = [({"logit_bias": {"65": 100}}, "logit_bias"), ({"presence_penalty": 0.5}, "presence_penalty"),
            ({"response_format": {"type": "json_object"}, "stop": ["{"]}, "stop"),
            ({"structured_outputs": {"regex": "[a-z]+"}, "stop": "x"}, "stop"),
            ({"tools": [tool]}, "tools.0.function.parameters")]
    for body, param in chat:
        r = post(srv, {"messages": MSG, "max_tokens": 5, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    text = [({"response_format": {"type": "json_object"}}, "response_format"), ({"logprobs": True}, "logprobs"),
            ({"logit_bias": {"65": 100}}, "logit_bias"), ({"best_of": 3}, "best_of"), ({"suffix": "end"}, "suffix")]
    for body, param in text:
        r = post(srv, {"prompt": "hi", "max_tokens": 5, **body}, "/v1/completions")
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    neutral = {"logit_bias": {}, "presence_penalty": 0, "frequency_penalty": 0.0, "user": "u", "metadata": {}}
    assert post(srv, {"messages": MSG, "max_tokens": 3, **neutral}).status_code == 200
    assert post(srv, {"prompt": "hi", "max_tokens": 3, "logprobs": 2, "best_of": 1, **neutral},
                "/v1/completions").status_code == 200
    still_up(srv)


# --------------------------------------------------------------------------------------------------
# Tool choice, with hand-set models that call f
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def callers(tmp_path_factory):
    """``again``: calls f, then calls again after every call; ``then_x``: calls f, then wants to say "x"."""
    d = tmp_path_factory.mktemp("callers")
    again = chain_run(d / "again", ["<|assistant_start|>", "<|call_start|>"], also=(("<|call_end|>", "<|call_start|>"),))
    then_x = chain_run(d / "then_x", ["<|assistant_start|>", "<|call_start|>"],
                       also=(("<|call_end|>", ord("x")), (ord("x"), "<|assistant_end|>")))
    servers = {k: ThreadServer(ServedModel.from_run(p)) for k, p in (("again", again), ("then_x", then_x))}
    yield servers
    for s in servers.values():
        s.close()


def ask(server, **kw):
    return openai_client(server.url).chat.completions.create(model=server.served.model_id, messages=MSG, temperature=0,
                                                              tools=[NOARGS], **kw)


def test_tool_choice_none_bans_calls_from_a_model_that_calls(callers):
    r = ask(callers["again"], max_tokens=40, tool_choice="none")
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"
    assert "name" not in r.choices[0].message.content  # no call text either
    assert ask(callers["again"], max_tokens=40).choices[0].message.tool_calls  # (it does call, when allowed)


def test_parallel_tool_calls_false_allows_one_call_and_then_only_the_end(callers):
    r = ask(callers["again"], max_tokens=100, parallel_tool_calls=False)
    assert len(r.choices[0].message.tool_calls) == 1 and r.choices[0].finish_reason == "tool_calls"
    r = ask(callers["then_x"], max_tokens=100, parallel_tool_calls=False)  # "x" after the call: not allowed
    assert r.choices[0].message.content is None and r.choices[0].finish_reason == "tool_calls"
    assert [c.function.arguments for c in r.choices[0].message.tool_calls] == ["{}"]


def test_a_reply_cut_inside_a_call_returns_what_was_generated(callers):
    """Parallel calls, 40 tokens: one call (32 tokens with its markers), then 8 tokens of the next (its marker
    and 7 characters): that call's text so far comes back as content with finish "length", streamed or not
    (it was lost before)."""
    cut = CALL[: 40 - (len(CALL) + 2) - 1]
    r = ask(callers["again"], max_tokens=40)
    c = r.choices[0]
    assert [t.function.name for t in c.message.tool_calls] == ["f"]
    assert c.message.content == cut and c.finish_reason == "length"
    chunks = list(ask(callers["again"], max_tokens=40, stream=True))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    calls = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert text == cut and len(calls) == 1 and finish == ["length"]
    r = ask(callers["again"], max_tokens=3, tool_choice="required")
    assert r.choices[0].message.content == CALL[:2] and r.choices[0].finish_reason == "length"
