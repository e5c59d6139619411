"""Structured output, tools, log-probabilities, n, embeddings, tokenize and metrics through the official ``openai``
client (streaming and not), and the constrained-decoding property test (seeded random schemas, checked with
``jsonschema``; the 1,000-request run is benchmarks/bench_constrained.py)."""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")
import httpx  # noqa: E402

from lmforge.chat import ChatFormat  # noqa: E402
from lmforge.generate import Generator  # noqa: E402
from lmforge.serve import ServedModel  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1]))
sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
from bench_constrained import random_schema  # noqa: E402
from serve_helpers import ThreadServer, openai_client, random_chat_run  # noqa: E402

MSG = [{"role": "user", "content": "Weather?"}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 5},
                                           "temp": {"type": "integer", "minimum": -9, "maximum": 40},
                                           "sky": {"enum": ["sunny", "雨", "☁️"]}},
          "required": ["city", "temp", "sky"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
    "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
    "additionalProperties": False}}}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return random_chat_run(tmp_path_factory.mktemp("structured") / "chatty", context_length=1024)


@pytest.fixture(scope="module")
def srv(run):
    s = ThreadServer(ServedModel.from_run(run, max_batch=4))
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(srv):
    return openai_client(srv.url)


def _stream_text(chunks) -> tuple[str, str | None]:
    text, finish = "", None
    for c in chunks:
        if c.choices:
            text += c.choices[0].delta.content or ""
            finish = c.choices[0].finish_reason or finish
    return text, finish


def test_response_format_json_schema_and_json_object(client):
    kw = dict(model="chatty", messages=MSG, max_tokens=200, temperature=1.0, seed=3,
              response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}})
    r = client.chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "stop"
    doc = json.loads(r.choices[0].message.content)
    jsonschema.validate(doc, SCHEMA)
    text, finish = _stream_text(client.chat.completions.create(**kw, stream=True))
    assert text == r.choices[0].message.content and finish == "stop"  # the same seed: the same document
    r = client.chat.completions.create(model="chatty", messages=MSG, max_tokens=200, temperature=1.0, seed=4,
                                       response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_structured_outputs_choice_and_regex(client):
    for seed in range(3):
        r = client.chat.completions.create(model="chatty", messages=MSG, max_tokens=20, temperature=1.0, seed=seed,
                                           extra_body={"structured_outputs": {"choice": ["oui", "non", "日本"]}})
        assert r.choices[0].message.content in ("oui", "non", "日本")
    text, _ = _stream_text(client.chat.completions.create(
        model="chatty", messages=MSG, max_tokens=30, temperature=1.0, seed=1, stream=True,
        extra_body={"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2}"}}))
    import re
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", text), text


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def test_tools_required_named_auto_none_and_the_conversation_goes_on(client, srv, run):
    base = dict(model="chatty", messages=MSG, max_tokens=120, temperature=1.0, tools=[WEATHER, TIME])
    r = client.chat.completions.create(**base, seed=1, tool_choice="required", parallel_tool_calls=False)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    (name, args), = _calls(choice.message)
    fn = {"get_weather": WEATHER, "get_time": TIME}[name]["function"]
    jsonschema.validate(args, fn["parameters"])
    assert choice.message.tool_calls[0].id.startswith("call_") and choice.message.tool_calls[0].type == "function"

    r = client.chat.completions.create(**base, seed=2, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert [n for n, _ in _calls(r.choices[0].message)][0] == "get_time"
    assert all(a["tz"] in ("UTC", "CET") for _, a in _calls(r.choices[0].message))

    r = client.chat.completions.create(**{**base, "max_tokens": 30}, seed=3, tool_choice="none")
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")

    # streamed: the call arrives as a tool_calls delta, as OpenAI streams them
    chunks = list(client.chat.completions.create(**base, seed=1, tool_choice="required", parallel_tool_calls=False,
                                                 stream=True))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(d.function.name, json.loads(d.function.arguments)) for d in deltas] == [(name, args)]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]

    # the conversation goes on with the tool's result; the prompt is what the chat format renders
    call = choice.message.tool_calls[0]
    follow = MSG + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                    {"role": "tool", "tool_call_id": call.id, "content": "21 degrees"}]
    r2 = client.chat.completions.create(model="chatty", messages=follow, tools=[WEATHER, TIME], max_tokens=5,
                                        temperature=0, tool_choice="none")
    assert r2.choices[0].finish_reason in ("stop", "length")
    ids = httpx.post(srv.url + "/tokenize", json={"messages": follow, "tools": [WEATHER, TIME]},
                     trust_env=False).json()["tokens"]
    fmt = ChatFormat(Generator.from_run(run, device="cpu").tokenizer)
    chat_follow = MSG + [{"role": "assistant", "content": "", "tool_calls": [call.model_dump()]},
                         {"role": "tool", "tool_call_id": call.id, "content": "21 degrees"}]
    assert ids == fmt.render_for_completion(chat_follow, [WEATHER, TIME])
    assert fmt.ids["<|call_start|>"] in ids and fmt.ids["<|tools_start|>"] in ids


def test_logprobs_chat_and_completions(client, run):
    r = client.chat.completions.create(model="chatty", messages=MSG, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert b"".join(bytes(t.bytes) for t in content).decode("utf-8", "replace") == r.choices[0].message.content
    gen = Generator.from_run(run, device="cpu")
    prompt = ChatFormat(gen.tokenizer).render_for_completion(MSG)
    with torch.no_grad():
        first = torch.log_softmax(gen.engine.model(torch.tensor([prompt]))[0, -1, : gen.tokenizer.vocab_size], -1)
    assert abs(content[0].logprob - float(first.max())) < 1e-4  # greedy: the model's own distribution
    for t in content:
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob >= t.top_logprobs[-1].logprob
        assert t.logprob == t.top_logprobs[0].logprob  # greedy picks the most likely
    chunks = list(client.chat.completions.create(model="chatty", messages=MSG, max_tokens=6, temperature=0,
                                                 logprobs=True, top_logprobs=3, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.logprob for t in streamed] == [t.logprob for t in content]

    c = client.completions.create(model="chatty", prompt="Once upon", max_tokens=5, temperature=0.7, seed=1,
                                  logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.token_logprobs) == c.usage.completion_tokens and all(v <= 0 for v in lp.token_logprobs)
    assert all(len(t) <= 2 for t in lp.top_logprobs) and lp.text_offset[0] == 0
    s = list(client.completions.create(model="chatty", prompt="Once upon", max_tokens=5, temperature=0.7, seed=1,
                                       logprobs=2, stream=True))
    assert [v for x in s if x.choices[0].logprobs for v in x.choices[0].logprobs.token_logprobs] == lp.token_logprobs


def test_n_choices_share_the_prompt_and_choice_0_is_the_seeded_sample(client, srv):
    r = client.chat.completions.create(model="chatty", messages=MSG, max_tokens=8, temperature=1.0, seed=5, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    one = client.chat.completions.create(model="chatty", messages=MSG, max_tokens=8, temperature=1.0, seed=5)
    assert r.choices[0].message.content == one.choices[0].message.content
    assert len({c.message.content for c in r.choices}) > 1
    assert r.usage.completion_tokens == sum(len(c.message.content.encode()) for c in r.choices) or \
        r.usage.completion_tokens >= 3
    chunks = list(client.chat.completions.create(model="chatty", messages=MSG, max_tokens=8, temperature=1.0, seed=5,
                                                 n=3, stream=True))
    texts = {k: "" for k in range(3)}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
    assert [texts[k] for k in range(3)] == [c.message.content for c in r.choices]
    t = client.completions.create(model="chatty", prompt="ab", max_tokens=4, temperature=1.0, seed=2, n=2)
    assert [c.index for c in t.choices] == [0, 1]
    assert httpx.get(srv.url + "/health", trust_env=False).json()["active"] == 0


def test_embeddings_tokenize_detokenize_and_metrics(client, srv, run):
    e = client.embeddings.create(model="chatty", input=["hello", "a longer text"])
    vecs = [d.embedding for d in e.data]
    gen = Generator.from_run(run, device="cpu")
    ids = gen.tokenizer.encode("hello")
    with torch.no_grad():
        want = gen.engine.model.hidden(torch.tensor([ids]))[0].mean(0)
    want = want / want.norm()
    assert len(vecs) == 2 and abs(math.fsum(x * x for x in vecs[0]) - 1) < 1e-5
    assert torch.allclose(torch.tensor(vecs[0]), want, atol=1e-5)
    assert e.usage.prompt_tokens == len(ids) + len(gen.tokenizer.encode("a longer text"))
    b64 = client.embeddings.create(model="chatty", input="hello", encoding_format="base64")
    import base64
    import struct
    raw = base64.b64decode(b64.data[0].embedding)
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == pytest.approx(vecs[0], abs=1e-7)  # float32 bytes

    http = httpx.Client(trust_env=False, timeout=30)
    tok = http.post(srv.url + "/tokenize", json={"prompt": "héllo"}).json()
    assert tok["tokens"] == gen.tokenizer.encode("héllo") and tok["count"] == len(tok["tokens"])
    assert http.post(srv.url + "/detokenize", json={"tokens": tok["tokens"]}).json() == {"prompt": "héllo"}
    r = http.post(srv.url + "/detokenize", json={"tokens": [10 ** 6]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    r = http.post(srv.url + "/v1/embeddings", json={"model": "chatty", "input": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    r = http.post(srv.url + "/v1/embeddings", json={"model": "chatty", "input": "x" * 1100})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"

    client.chat.completions.create(model="chatty", messages=MSG, max_tokens=4)
    m = http.get(srv.url + "/metrics")
    assert m.status_code == 200 and m.headers["content-type"].startswith("text/plain")
    lines = dict(ln.rsplit(" ", 1) for ln in m.text.splitlines() if ln and not ln.startswith("#"))
    lines = {k: float(v) for k, v in lines.items()}  # (prometheus_client writes counts as 1.0)
    assert lines['lmforge_requests_total{endpoint="/v1/chat/completions",status="200"}'] >= 1
    assert lines["lmforge_generation_tokens_total"] >= 4 and lines["lmforge_requests_waiting"] == 0
    assert lines["lmforge_time_to_first_token_seconds_count"] >= 1
    assert lines['lmforge_inter_token_latency_seconds_bucket{le="+Inf"}'] == \
        lines["lmforge_inter_token_latency_seconds_count"] >= 3
    assert lines['lmforge_requests_total{endpoint="/detokenize",status="400"}'] == 1


def test_random_schemas_are_always_valid(srv):
    """The property test: 48 seeded random schemas (object/properties/required, string/number/integer/boolean/
    null, enum with multi-byte values, arrays with min/max items, nested objects, additionalProperties false)
    decoded by the untrained model at temperature 1 on the server's scheduler, 8 rows at a time: every output
    finishes and validates with jsonschema."""
    from lmforge.generate.constraints import RowConstraint, json_grammar
    from lmforge.generate.scheduler import Job, Update

    served = srv.served
    end = served.chat.assistant_end_id
    rng = random.Random(2026)
    schemas = [random_schema(rng) for _ in range(48)]
    results: dict[int, list[Update]] = {k: [] for k in range(len(schemas))}
    import threading
    done = threading.Semaphore(0)

    def emit(k):
        def f(u):
            results[k].append(u)
            if u.finish_reason is not None:
                done.release()
        return f

    prompt = served.chat_prompt(MSG)
    for k, sc in enumerate(schemas):
        c = RowConstraint(served.grammars, json_grammar(sc), close_id=end)
        served.scheduler.submit(Job(prompt, 500 - len(prompt), emit(k), temperature=1.0, seed=k,
                                        stop_ids=[end], constraint=c))
    for _ in schemas:
        assert done.acquire(timeout=120)
    for k, sc in enumerate(schemas):
        text = "".join(u.text for u in results[k])
        assert results[k][-1].finish_reason == "stop", (sc, text)
        jsonschema.validate(json.loads(text), sc)
