"""``POST /v1/responses`` through the official ``openai`` client (``client.responses.create``, its stream helper
``client.responses.stream``, ``retrieve``, ``delete``) against a real server: replies equal to the chat endpoint's
for the same conversation, the streamed events, function calls and their outputs, ``text.format``, stored
conversations, and hostile requests answered with OpenAI-shaped 4xx."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")
import httpx  # noqa: E402

from lmforge.serve import ServedModel  # noqa: E402
from lmforge.serve.response_store import ResponseStore  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1]))
from serve_helpers import (ThreadServer, chain_run, openai_client, random_chat_run, recorded_prompts,  # noqa: E402
                           zero_run)

WEATHER = {"type": "function", "name": "get_weather", "description": "weather", "strict": True, "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
    "additionalProperties": False}}
KEY = "sekrit-key"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 5},
                                           "temp": {"type": "integer", "minimum": -9, "maximum": 40}},
          "required": ["city", "temp"], "additionalProperties": False}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("responses")
    return {"chatty": random_chat_run(d / "chatty", context_length=512),
            "hi": chain_run(d / "hi", ["<|assistant_start|>", ord("H"), ord("i"), "<|assistant_end|>"])}


@pytest.fixture(scope="module")
def srv(runs):
    s = ThreadServer(ServedModel.from_run(runs["chatty"], max_batch=4), max_body=64 << 10)
    yield s
    s.close()


@pytest.fixture(scope="module")
def hi(runs):
    """The model that answers ``Hi`` and ends its turn, with a store of two responses, behind an API key."""
    s = ThreadServer(ServedModel.from_run(runs["hi"]), response_store=ResponseStore(max_items=2), api_key=KEY)
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(srv):
    return openai_client(srv.url)


def _post(server: ThreadServer, body: dict | bytes, **kw) -> httpx.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + "/v1/responses", content=data, trust_env=False, timeout=60,
                      headers={"Content-Type": "application/json", **kw.pop("headers", {})}, **kw)


def test_greedy_and_seeded_replies_equal_the_chat_endpoints(client):
    """Instructions, system, developer, user and assistant items (string and part contents) as one chat."""
    items = [{"role": "system", "content": "Terse."},
             {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "No lists."}]},
             {"role": "user", "content": "Hi"},
             {"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": "Yo", "annotations": []}]},
             {"role": "user", "content": [{"type": "input_text", "text": "Wh"}, {"type": "input_text", "text": "y?"}]}]
    messages = [{"role": "system", "content": "Be kind.\n\nTerse.\n\nNo lists."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Yo"}, {"role": "user", "content": "Why?"}]
    for kw in ({"temperature": 0}, {"temperature": 1.0, "seed": 7}):
        chat = client.chat.completions.create(model="chatty", messages=messages, max_tokens=24, **kw)
        extra = {"extra_body": {"seed": kw["seed"]}} if "seed" in kw else {}
        r = client.responses.create(model="chatty", instructions="Be kind.", input=items, max_output_tokens=24,
                                    temperature=kw["temperature"], **extra)
        assert r.output_text == chat.choices[0].message.content and r.output_text
        assert r.object == "response" and r.id.startswith("resp_") and r.model == "chatty"
        assert (r.status, r.incomplete_details.reason) == ("incomplete", "max_output_tokens")  # 24 tokens, no end
        assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, 24)
        assert r.usage.total_tokens == r.usage.input_tokens + 24
        streamed = "".join(e.delta for e in client.responses.create(
            model="chatty", instructions="Be kind.", input=items, max_output_tokens=24, stream=True,
            temperature=kw["temperature"], **extra) if e.type == "response.output_text.delta")
        assert streamed == r.output_text
    one = client.responses.create(model="chatty", input="Why?", max_output_tokens=8, temperature=0)
    chat = client.chat.completions.create(model="chatty", messages=[{"role": "user", "content": "Why?"}],
                                          max_tokens=8, temperature=0)
    assert one.output_text == chat.choices[0].message.content  # a string input: one user message


def test_logprobs_equal_the_chat_endpoints(client):
    chat = client.chat.completions.create(model="chatty", messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                          temperature=0, logprobs=True, top_logprobs=3)
    want = [t.model_dump() for t in chat.choices[0].logprobs.content]
    kw = dict(model="chatty", input="Hi", max_output_tokens=6, temperature=0, top_logprobs=3,
              include=["message.output_text.logprobs"])
    r = client.responses.create(**kw)
    assert [t.model_dump() for t in r.output[0].content[0].logprobs] == want and len(want) == 6
    assert all(len(t["top_logprobs"]) == 3 for t in want)
    events = list(client.responses.create(**kw, stream=True))
    brief = [{"token": t["token"], "logprob": t["logprob"],
              "top_logprobs": [{"token": x["token"], "logprob": x["logprob"]} for x in t["top_logprobs"]]}
             for t in want]
    assert [x.model_dump() for e in events if e.type == "response.output_text.delta" for x in e.logprobs] == brief
    assert [x.model_dump() for x in next(e for e in events if e.type == "response.output_text.done").logprobs] == brief
    assert client.responses.create(**{**kw, "include": None}).output[0].content[0].logprobs == []


def test_stream_events_in_order_and_the_stream_helper_accepts_them(client, hi):
    events = list(client.responses.create(model="chatty", input="Hello", max_output_tokens=6, temperature=0,
                                          stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * (len(kinds) - 8),
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.incomplete"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    last = events[-1].response
    assert events[-4].text == last.output_text == "".join(e.delta for e in events if hasattr(e, "delta"))
    assert len({events[0].response.id, last.id}) == 1 and last.usage.output_tokens == 6
    assert events[2].item.id == events[-2].item.id == last.output[0].id and events[-2].item.status == "incomplete"

    c = openai_client(hi.url, api_key=KEY)
    with c.responses.stream(model="hi", input="Hello", temperature=0) as s:
        deltas = [e.delta for e in s if e.type == "response.output_text.delta"]
        final = s.get_final_response()
    assert final.output_text == "".join(deltas) == "Hi" and final.status == "completed"
    assert final.incomplete_details is None and final.usage.output_tokens == 2 and final.completed_at


def test_function_call_and_its_output_round_trip(client, srv, monkeypatch):
    tools = [WEATHER]
    r = client.responses.create(model="chatty", input="Weather?", tools=tools, tool_choice="required",
                                parallel_tool_calls=False, max_output_tokens=120, temperature=1.0,
                                extra_body={"seed": 1})
    assert r.status == "completed" and [o.type for o in r.output] == ["function_call"]
    call = r.output[0]
    assert call.call_id.startswith("call_") and call.id.startswith("fc_") and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert r.tools[0].name == "get_weather" and r.tool_choice == "required"
    # the chat endpoint makes the same call for the same request (call ids aside)
    chat_tool = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
    chat = client.chat.completions.create(model="chatty", messages=[{"role": "user", "content": "Weather?"}],
                                          tools=[chat_tool], tool_choice="required", parallel_tool_calls=False,
                                          max_tokens=120, temperature=1.0, seed=1)
    assert chat.choices[0].message.tool_calls[0].function.arguments == call.arguments

    # the call's output, sent after previous_response_id or with the call itself: the chat's prompt either way
    seen = recorded_prompts(srv.served, monkeypatch)
    out = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    r2 = client.responses.create(model="chatty", previous_response_id=r.id, input=[out], tools=tools,
                                 max_output_tokens=5, temperature=0)
    r3 = client.responses.create(model="chatty", tools=tools, max_output_tokens=5, temperature=0, input=[
        {"role": "user", "content": "Weather?"}, call.model_dump(exclude_none=True), out])
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": call.call_id, "type": "function",
                     "function": {"name": "get_weather", "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}]
    chat = client.chat.completions.create(model="chatty", messages=messages, tools=[chat_tool], max_tokens=5,
                                          temperature=0)
    assert seen[0] == seen[1] == seen[2] and r2.output_text == r3.output_text == chat.choices[0].message.content
    # the stored input items, newest first by default, a page at a time
    assert [i.type for i in client.responses.input_items.list(r2.id)] == ["function_call_output"]
    items = list(client.responses.input_items.list(r3.id, limit=1))  # (the client follows the pages)
    assert [i.type for i in items] == ["function_call_output", "function_call", "message"]
    assert (items[0].call_id, items[0].output, items[1].arguments) == (call.call_id, "sunny", call.arguments)
    assert items[2].content[0].text == "Weather?" and len({i.id for i in items}) == 3
    page = client.responses.input_items.list(r3.id, order="asc", limit=2)
    assert [i.type for i in page.data] == ["message", "function_call"] and page.has_more
    for query in ("order=up", "limit=0", "limit=x", "after=nope"):
        got = httpx.get(f"{srv.url}/v1/responses/{r3.id}/input_items?{query}", trust_env=False)
        assert (got.status_code, got.json()["error"]["param"]) == (400, query.partition("=")[0])
    # a reply's text and its calls are one assistant message
    client.responses.create(model="chatty", tools=tools, max_output_tokens=1, temperature=0, input=[
        {"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "Let me see."},
        call.model_dump(exclude_none=True), out])
    client.chat.completions.create(model="chatty", tools=[chat_tool], max_tokens=1, temperature=0, messages=[
        messages[0], {**messages[1], "content": "Let me see."}, messages[2]])
    assert seen[3] == seen[4]

    # streamed: the call's item and its arguments' events, and the helper's final response
    with client.responses.stream(model="chatty", input="Weather?", tools=tools, tool_choice="required",
                                 parallel_tool_calls=False, max_output_tokens=120, temperature=1.0,
                                 extra_body={"seed": 1}) as s:
        events = list(s)
        final = s.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[2:-1] == ["response.output_item.added", "response.function_call_arguments.delta",
                           "response.function_call_arguments.done", "response.output_item.done"]
    assert events[2].item.arguments == "" and events[4].arguments == call.arguments
    assert final.output[0].arguments == call.arguments and final.output[0].name == "get_weather"


def test_text_format_json_schema_and_json_object(client):
    fmt = {"type": "json_schema", "name": "weather", "schema": SCHEMA, "strict": True}
    r = client.responses.create(model="chatty", input="Weather?", text={"format": fmt}, max_output_tokens=80,
                                temperature=1.0, extra_body={"seed": 3})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    assert r.text.format.type == "json_schema" and r.text.format.name == "weather" and r.text.format.schema_ == SCHEMA
    chat = client.chat.completions.create(
        model="chatty", messages=[{"role": "user", "content": "Weather?"}], max_tokens=80, temperature=1.0, seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}})
    assert chat.choices[0].message.content == r.output_text
    r = client.responses.create(model="chatty", input="Weather?", text={"format": {"type": "json_object"}},
                                max_output_tokens=200, temperature=1.0, extra_body={"seed": 4})
    assert r.status == "completed" and isinstance(json.loads(r.output_text), dict)
    assert r.text.format.type == "json_object" and not hasattr(r.text.format, "schema_")


def test_previous_response_id_continues_the_stored_conversation(hi, monkeypatch):
    c = openai_client(hi.url, api_key=KEY)
    seen = recorded_prompts(hi.served, monkeypatch)
    r1 = c.responses.create(model="hi", instructions="Rule one.", input="A", temperature=0)
    r2 = c.responses.create(model="hi", instructions="Rule two.", input="B", previous_response_id=r1.id,
                            temperature=0)
    assert r1.output_text == r2.output_text == "Hi" and r2.previous_response_id == r1.id
    # the instructions are not carried over; the first turn and its reply are
    assert seen[1] == hi.served.chat_prompt([{"role": "system", "content": "Rule two."},
                                             {"role": "user", "content": "A"}, {"role": "assistant", "content": "Hi"},
                                             {"role": "user", "content": "B"}])
    got = c.responses.retrieve(r2.id)
    assert got.output_text == "Hi" and got.id == r2.id and got.usage.input_tokens == len(seen[1])
    c.responses.delete(r2.id)
    for call in (lambda: c.responses.retrieve(r2.id), lambda: c.responses.delete(r2.id)):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["code"] == "not_found"
    # store: false keeps nothing; the store holds two entries, the oldest leaves first
    r = c.responses.create(model="hi", input="C", store=False, temperature=0)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(r.id)
    ids = [c.responses.create(model="hi", input=x, temperature=0).id for x in "DEF"]
    with pytest.raises(openai.NotFoundError) as e:
        c.responses.create(model="hi", input="G", previous_response_id=ids[0])
    assert e.value.body["param"] == "previous_response_id" and e.value.body["code"] == "previous_response_not_found"
    assert c.responses.retrieve(ids[2]).output_text == "Hi"
    # the API key guards every route of it
    for call in (lambda o: o.responses.create(model="hi", input="A"), lambda o: o.responses.retrieve(ids[2]),
                 lambda o: o.responses.delete(ids[2])):
        with pytest.raises(openai.AuthenticationError):
            call(openai_client(hi.url, api_key="wrong"))
    assert c.responses.retrieve(ids[2]).id == ids[2]


def test_hostile_requests_get_openai_shaped_4xx(srv, client):
    base = {"model": "chatty", "input": "Hi", "max_output_tokens": 4}
    cases = [
        ({**base, "input": 5}, 400, "input"),
        ({**base, "input": [{"role": "robot", "content": "x"}]}, 400, "input.0.role"),
        ({**base, "input": [{"role": "user", "content": [{"type": "input_text"}]}]}, 400, "input.0.content"),
        ({**base, "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400,
         "input.0.content.0.type"),
        ({**base, "input": [{"type": "web_search_call", "id": "x"}]}, 400, "input.0.type"),
        ({**base, "input": []}, 400, "input"),
        ({**base, "input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]}, 400, "input.0"),
        ({**base, "temperature": "hot"}, 400, "temperature"),
        ({**base, "temperature": "0.5"}, 400, "temperature"),  # strict types: never coerced
        ({**base, "stream": "yes"}, 400, "stream"),
        ({**base, "store": 1}, 400, "store"),
        ({**base, "max_output_tokens": "5"}, 400, "max_output_tokens"),
        ({**base, "max_output_tokens": 5.0}, 400, "max_output_tokens"),
        ({**base, "max_tool_calls": 3}, 400, "max_tool_calls"),
        ({**base, "max_tool_calls": 0}, 400, "max_tool_calls"),
        ({**base, "metadata": {f"k{i}": "v" for i in range(17)}}, 400, "metadata"),  # OpenAI's bounds
        ({**base, "metadata": {"k" * 65: "v"}}, 400, "metadata"),
        ({**base, "metadata": {"k" * 50_000: "v"}}, 400, "metadata"),
        ({**base, "metadata": {"k": "v" * 513}}, 400, "metadata.k"),
        ({**base, "metadata": {"k": 3}}, 400, "metadata.k"),
        ({**base, "cache_salt": ["s"]}, 400, "cache_salt"),
        ({**base, "cache_salt": "s" * 513}, 400, "cache_salt"),
        ({**base, "max_output_tokens": 0}, 400, "max_output_tokens"),
        ({**base, "max_output_tokens": 10 ** 6}, 400, "max_output_tokens"),
        ({**base, "tools": [{"type": "web_search"}]}, 400, "tools.0.type"),
        ({**base, "tools": [{**WEATHER, "parameters": {"type": "array"}}]}, 400, "tools.0.parameters"),
        ({**base, "tools": [WEATHER], "tool_choice": {"type": "function", "name": "other"}}, 400, "tool_choice"),
        ({**base, "tool_choice": {"type": "file_search"}}, 400, "tool_choice"),
        ({**base, "text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format.schema"),
        ({**base, "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}}, 400,
         "text.format.schema"),
        ({**base, "text": {"format": {"type": "yaml"}}}, 400, "text.format.type"),
        ({**base, "reasoning": {"effort": "high"}}, 400, "reasoning"),
        ({**base, "include": ["message.output_text.logprobs", "reasoning.encrypted_content"]}, 400, "include.1"),
        ({**base, "top_logprobs": 99}, 400, "top_logprobs"),
        ({**base, "truncation": "auto"}, 400, "truncation"),
        ({**base, "previous_response_id": "resp_nope"}, 404, "previous_response_id"),
        ({**base, "model": "gpt-9"}, 404, "model"),
        ({**base, "input": "x" * 600}, 400, "input"),  # over the 512-token context
        ({**base, "metadata": {"k": "\ud800"}}, 400, "metadata.k"),
        ({**base, "input": [{"role": "user", "content": "\ud800"}]}, 400, "input.0.content"),
        ({**base, "tools": [{**WEATHER, "parameters": {"type": "object", "title": "\ud800"}}]}, 400,
         "tools.0.parameters"),
    ]
    for body, status, param in cases:
        r = _post(srv, body)
        err = r.json()["error"]
        assert (r.status_code, err["param"]) == (status, param), (body, r.text)
        assert set(err) == {"message", "type", "param", "code"} and len(err["message"]) < 900
    assert _post(srv, {**base, "input": "y" * (70 << 10)}).status_code == 413  # over the body limit
    assert _post(srv, b"{not json").status_code == 400
    assert _post(srv, json.dumps(base).encode(), headers={"Content-Type": "text/plain"}).status_code == 415
    for rid in ("resp_nope", "x" * 300):
        assert httpx.get(f"{srv.url}/v1/responses/{rid}", trust_env=False).status_code == 404
    with pytest.raises(openai.BadRequestError):  # the client's own error type
        client.responses.create(model="chatty", input=[{"role": "user", "content": "a"}],
                                tools=[{"type": "code_interpreter", "container": {"type": "auto"}}])
    metrics = httpx.get(srv.url + "/metrics", trust_env=False).text
    assert 'endpoint="/v1/responses",status="400"' in metrics
    assert 'endpoint="/v1/responses/{response_id}",status="404"' in metrics
    assert "resp_nope" not in metrics  # a route template, never a client's path


def test_metadata_at_openais_bounds_is_echoed(client):
    meta = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)}
    r = client.responses.create(model="chatty", input="Hi", max_output_tokens=2, metadata=meta)
    assert r.metadata == meta and client.responses.retrieve(r.id).metadata == meta


def test_a_late_developer_message_is_read_as_user_text(client, srv, monkeypatch):
    """OpenAI accepts a developer (or system) message anywhere; the chat format has one system message, first: a
    later one joins the user message before it (or after it) as text, or stands as a user message."""
    seen = recorded_prompts(srv.served, monkeypatch)
    cases = [
        ([{"role": "user", "content": "a"}, {"role": "developer", "content": "Answer in French."}],
         [{"role": "user", "content": "a\n\nAnswer in French."}]),
        ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
          {"role": "developer", "content": "Be brief."}, {"role": "user", "content": "c"}],
         [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
          {"role": "user", "content": "Be brief.\n\nc"}]),
        ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
          {"role": "system", "content": "Now stop."}],
         [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
          {"role": "user", "content": "Now stop."}]),
    ]
    for items, messages in cases:
        r = client.responses.create(model="chatty", instructions="Rules.", input=items, max_output_tokens=2,
                                    temperature=0)  # greedy: a sampled reply could end within the 2 tokens
        assert r.status == "incomplete"
        assert seen[-1] == srv.served.chat_prompt([{"role": "system", "content": "Rules."}, *messages])


def test_errors_name_the_clients_input_items(srv):
    """An error the chat renderer finds names the client's item (``input.3``), not a message of the merged
    history (instructions, the stored conversation and the items, with a function call joined to its text)."""
    items = [{"role": "developer", "content": "d"}, {"role": "user", "content": "a"},
             {"role": "assistant", "content": "b"},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "other", "output": "1"}]
    r = _post(srv, {"model": "chatty", "instructions": "i", "input": items, "max_output_tokens": 2})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "input.4", err
    assert err["message"].startswith("input.4 (function_call_output) answers tool_call_id 'other'"), err
    r = _post(srv, {"model": "chatty", "input": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "input.1") and "input.1 (user)" in r.text


def test_a_stream_left_early_frees_its_row(tmp_path):
    s = ThreadServer(ServedModel.from_run(zero_run(tmp_path / "zero"), max_batch=2))
    try:
        c = openai_client(s.url)
        stream = c.responses.create(model="zero", input="go", max_output_tokens=4000, stream=True, temperature=0)
        for e in stream:
            if e.type == "response.output_text.delta":
                break
        stream.close()
        deadline = time.monotonic() + 5
        while s.served.scheduler.load()["active"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert s.served.scheduler.load()["active"] == 0
        r = c.responses.create(model="zero", input="go", max_output_tokens=3, temperature=0)
        assert r.output_text == "\0\0\0"  # and the server goes on answering
    finally:
        s.close()


HOSTILE_VALUES = [None, True, -1, 0, 2 ** 70, 1e308, "", "x" * 3000, "\0", [], {}, [[[]]], {"type": "x"},
                  [{"type": "function_call"}], {"role": "user"}, "resp_nope", [None], {"format": None}]


def _paths(node, path=()):
    """Every (path, value) in a JSON document, the root's children first."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield path + (k,), v
            yield from _paths(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield path + (i,), v
            yield from _paths(v, path + (i,))


def _mutated(body: dict, rng) -> dict:
    body = json.loads(json.dumps(body))
    for _ in range(1 if rng.random() < 0.6 else 2):
        paths = list(_paths(body))
        path, _ = rng.choice(paths)
        parent = body
        for p in path[:-1]:
            parent = parent[p]
        roll = rng.random()
        if roll < 0.15 and isinstance(parent, dict):
            del parent[path[-1]]
        elif roll < 0.25 and isinstance(parent, dict):
            parent[rng.choice(["extra", "type", "role", "content", "call_id", "stream", "store"])] = \
                rng.choice(HOSTILE_VALUES)
        else:
            parent[path[-1]] = rng.choice(HOSTILE_VALUES)
    return body


def test_mutated_requests_never_get_a_5xx(srv):
    """Seeded random mutations of valid requests (values of every kind in every field, keys removed and added):
    each is answered with a 200 (a response object, or a stream ending in completed/incomplete) or an
    OpenAI-shaped 4xx, and the server goes on answering."""
    import random

    stored = _post(srv, {"model": "chatty", "input": "Hi", "max_output_tokens": 2}).json()["id"]
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'}
    bases = [
        {"model": "chatty", "input": "Hi", "max_output_tokens": 3, "temperature": 0},
        {"model": "chatty", "instructions": "Be brief.", "max_output_tokens": 3, "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]}, call,
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}], "tools": [WEATHER]},
        {"model": "chatty", "input": "Hi", "max_output_tokens": 3, "tools": [WEATHER], "tool_choice": "auto",
         "stream": True},
        {"model": "chatty", "input": "Hi", "max_output_tokens": 3, "previous_response_id": stored,
         "text": {"format": {"type": "json_schema", "name": "w", "schema": SCHEMA}}},
    ]
    rng = random.Random(0)
    statuses = []
    for k in range(80):
        body = _mutated(bases[k % len(bases)], rng)
        if isinstance(body.get("max_output_tokens"), int) and not isinstance(body["max_output_tokens"], bool):
            body["max_output_tokens"] = min(body["max_output_tokens"], 3)  # (a fast test: short replies)
        r = _post(srv, body)
        statuses.append(r.status_code)
        assert r.status_code == 200 or 400 <= r.status_code < 500, (body, r.text)
        if r.status_code != 200:
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and len(err["message"]) < 900, r.text
        elif r.headers["content-type"].startswith("text/event-stream"):
            last = json.loads(r.text.strip().split("\n")[-1].removeprefix("data: "))
            assert last["type"] in ("response.completed", "response.incomplete"), r.text[-300:]
        else:
            assert r.json()["object"] == "response" and r.json()["status"] in ("completed", "incomplete")
    assert statuses.count(200) >= 5 and 400 in statuses  # (the mutations reach both sides)
    assert _post(srv, bases[0]).status_code == 200


def test_a_continued_conversation_starts_from_the_prefix_cache(hi, monkeypatch):
    """The next turn's prompt is the previous prompt and reply plus the new input, so the server's prefix cache
    holds its whole blocks up to the end of the previous reply; the reply is the one a fresh chat request gets."""
    c = openai_client(hi.url, api_key=KEY)
    seen = recorded_prompts(hi.served, monkeypatch)
    load = hi.served.scheduler.load
    kw = dict(model="hi", instructions="You answer in one short sentence, politely, and never more.", temperature=0)
    r1 = c.responses.create(**kw, input="Where is Oslo?")
    before = load()["prefix_hit_tokens"]
    r2 = c.responses.create(**kw, input="And Bergen?", previous_response_id=r1.id)
    block = hi.served.scheduler.prefix_cache.block
    assert seen[1][:len(seen[0])] == seen[0] and len(seen[0]) >= 4 * block
    assert load()["prefix_hit_tokens"] - before >= (len(seen[0]) + len("Hi")) // block * block
    chat = c.chat.completions.create(model="hi", temperature=0, messages=[
        {"role": "system", "content": kw["instructions"]}, {"role": "user", "content": "Where is Oslo?"},
        {"role": "assistant", "content": "Hi"}, {"role": "user", "content": "And Bergen?"}])
    assert r2.output_text == chat.choices[0].message.content == "Hi"
