"""``lmforge serve``: a real server on a loopback port, driven by the official ``openai`` client and raw HTTP.

Servers run in-process (``uvicorn.Server`` in a thread, :class:`serve_helpers.ThreadServer`) and as the real
``lmforge serve`` command (a subprocess). Runs are tiny: a random chat model (varied output), an all-zero model
(greedy repeats one token and never stops early: long requests on demand) and a hand-set model whose reply is
``<script>...</script>`` (for the page's escaping, in test_serve_page.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
import httpx  # noqa: E402  (a dependency of openai)

from lmforge.generate import Generator  # noqa: E402
from lmforge.serve import ServedModel, exposure_warning  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1]))
from serve_helpers import NO_PROXY, ThreadServer, openai_client, random_chat_run, wide_zero_run, zero_run  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
JSON = {"Content-Type": "application/json"}  # what a body sent as bytes must declare (json= sets it)
MSG = [{"role": "user", "content": "Hello, who are you?"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
    "additionalProperties": False}}}
CALLED = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("serve")
    return {"chat": random_chat_run(d / "chatty"), "zero": zero_run(d / "zero"), "wide": wide_zero_run(d / "wide")}


@pytest.fixture(scope="module")
def srv(runs):
    s = ThreadServer(ServedModel.from_run(runs["chat"], max_batch=4))
    yield s
    s.close()


@pytest.fixture(scope="module")
def guarded(runs):
    """Key required, one row, one waiting request, 4 KiB bodies: the limits, on the wide all-zero model (4,000
    tokens take many seconds: a budget no request reaches within the tests' deadlines)."""
    s = ThreadServer(ServedModel.from_run(runs["wide"], max_batch=1, max_queue=1), api_key="sekrit", max_body=4096)
    yield s
    s.close()


@pytest.fixture
def http():
    with httpx.Client(trust_env=False, timeout=60) as c:
        yield c


def expected_reply(run: Path, messages, n: int) -> tuple[str, int]:
    """The greedy reply computed by the library alone (no server): the oracle for the server's text."""
    from lmforge.chat import ChatFormat

    gen = Generator.from_run(run, device="cpu")
    fmt = ChatFormat(gen.tokenizer)
    prompt = fmt.render_for_completion(messages)
    ids = gen.generate_ids(prompt, n, temperature=0, stop_ids=[fmt.assistant_end_id, gen.tokenizer.eot_id])
    return gen.tokenizer.decode(ids), len(prompt)


# --------------------------------------------------------------------------------------------------
# The official client
# --------------------------------------------------------------------------------------------------
def test_openai_client_models_chat_and_completions(srv, runs):
    client = openai_client(srv.url)
    assert [m.id for m in client.models.list()] == ["chatty"]
    want, n_prompt = expected_reply(runs["chat"], MSG, 12)

    r = client.chat.completions.create(model="chatty", messages=MSG, max_tokens=12, temperature=0)
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == n_prompt and 0 < r.usage.completion_tokens <= 12

    chunks = list(client.chat.completions.create(model="chatty", messages=MSG, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert all(isinstance(c, openai.types.chat.ChatCompletionChunk) for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    final = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(final) == 1 and final[0].choices[0].finish_reason == r.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens

    c = client.completions.create(model="chatty", prompt="Once upon a time", max_tokens=6, temperature=0)
    gen = Generator.from_run(runs["chat"], device="cpu")
    ids = gen.generate_ids(gen.tokenizer.encode("Once upon a time"), 6, temperature=0)
    assert c.choices[0].text == gen.tokenizer.decode(ids) and c.usage.completion_tokens == len(ids)
    streamed = list(client.completions.create(model="chatty", prompt="Once upon a time", max_tokens=6,
                                              temperature=0, stream=True))
    assert "".join(s.choices[0].text for s in streamed) == c.choices[0].text
    assert streamed[-1].choices[0].finish_reason == c.choices[0].finish_reason and streamed[-1].usage is not None


def test_responses_validate_against_the_official_types(srv, http):
    from openai.types import Completion, Model
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    body = {"model": "chatty", "messages": MSG, "max_tokens": 4, "seed": 3, "stop": ["\n\n"]}
    ChatCompletion.model_validate(http.post(srv.url + "/v1/chat/completions", json=body).json(), strict=False)
    Completion.model_validate(http.post(srv.url + "/v1/completions",
                                        json={"model": "chatty", "prompt": "Hi", "max_tokens": 3}).json())
    Model.model_validate(http.get(srv.url + "/v1/models").json()["data"][0])
    with http.stream("POST", srv.url + "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]" and all(ln.startswith("data: ") for ln in lines)
    for ln in lines[:-1]:
        ChatCompletionChunk.model_validate(json.loads(ln[6:]))


def test_seeded_sampling_repeats(srv):
    client = openai_client(srv.url)
    kw = dict(model="chatty", messages=MSG, max_tokens=10, temperature=1.0, top_p=0.9)
    a, b = (client.chat.completions.create(seed=5, **kw).choices[0].message.content for _ in range(2))
    others = {client.chat.completions.create(seed=s, **kw).choices[0].message.content for s in range(6, 10)}
    assert a == b and len(others | {a}) > 1


def test_sixteen_concurrent_streams_are_independent(srv, runs):
    """16 streaming clients at once (max_batch 4: rows join and leave): all finish; greedy ones give the text
    they give alone; seeded ones give what they give alone."""
    client = openai_client(srv.url, max_retries=0)
    prompts = [[{"role": "user", "content": f"Question number {i}?"}] for i in range(16)]
    alone = {}
    for i in (0, 5):
        alone[i] = client.chat.completions.create(model="chatty", messages=prompts[i], max_tokens=20,
                                                  temperature=0).choices[0].message.content
    alone[9] = client.chat.completions.create(model="chatty", messages=prompts[9], max_tokens=20, temperature=0.8,
                                              seed=9).choices[0].message.content
    results: dict[int, tuple[str, str | None]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(16)

    def worker(i: int) -> None:
        try:
            start.wait()
            kw = dict(temperature=0) if i in (0, 5) else dict(temperature=0.8, seed=i)
            text, finish = "", None
            for ch in client.chat.completions.create(model="chatty", messages=prompts[i], max_tokens=20,
                                                     stream=True, **kw):
                if ch.choices:
                    text += ch.choices[0].delta.content or ""
                    finish = ch.choices[0].finish_reason or finish
            results[i] = (text, finish)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert len(results) == 16 and all(f in ("stop", "length") for _, f in results.values())
    for i, text in alone.items():
        assert results[i][0] == text, i
    assert len({t for t, _ in results.values()}) > 8  # independent outputs, not one shared row
    assert http_get(srv.url + "/health")["active"] == 0


def http_get(url: str) -> dict:
    return httpx.get(url, trust_env=False, timeout=30).json()


# --------------------------------------------------------------------------------------------------
# Errors, in the OpenAI shape
# --------------------------------------------------------------------------------------------------
def _err(r: httpx.Response, status: int, param: str | None = None) -> str:
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["message"]
    if param is not None:
        assert e["param"] == param, e
    return e["message"]


@pytest.mark.parametrize("body,param,words", [
    (b"{not json", None, "not valid JSON"),
    (b"[1, 2]", None, "JSON object"),
    (b'{"messages": []}', "model", "Field required"),
    (json.dumps({"model": "chatty"}).encode(), "messages", "Field required"),
    (json.dumps({"model": "chatty", "messages": [{"role": "robot", "content": "x"}]}).encode(), "messages.0.role",
     "robot"),
    (json.dumps({"model": "chatty", "messages": MSG, "temperature": "hot"}).encode(), "temperature", "hot"),
    (json.dumps({"model": "chatty", "messages": MSG, "temperature": 3}).encode(), "temperature", "2"),
    (json.dumps({"model": "chatty", "messages": MSG, "max_tokens": 0}).encode(), "max_tokens", "1"),
    (json.dumps({"model": "chatty", "messages": MSG, "n": 5}).encode(), "n", "at most 4 rows"),
    (json.dumps({"model": "chatty", "messages": MSG, "n": 3, "max_tokens": 40}).encode(), "n", "3 × 40 = 120"),
    (json.dumps({"model": "chatty", "messages": MSG, "logprobs": True, "top_logprobs": 21}).encode(),
     "top_logprobs", "20"),
    (json.dumps({"model": "chatty", "messages": MSG, "top_logprobs": 2}).encode(), "top_logprobs", "logprobs: true"),
    (json.dumps({"model": "chatty", "messages": MSG, "tools": [TOOL], "response_format": {"type": "json_object"}}
                ).encode(), "response_format", "cannot be combined with tools"),
    (json.dumps({"model": "chatty", "messages": MSG, "tools": [TOOL], "tool_choice": {
        "type": "function", "function": {"name": "nope"}}}).encode(), "tool_choice", "'nope'"),
    (json.dumps({"model": "chatty", "messages": MSG, "tool_choice": "required"}).encode(), "tool_choice", "needs tools"),
    (json.dumps({"model": "chatty", "messages": MSG, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "not": {"required": ["a"]}}}}]}).encode(),
     "tools.0.function.parameters", "not"),
    (json.dumps({"model": "chatty", "messages": MSG, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": "x"}}]}).encode(), "tools.0.function.parameters", "dictionary"),
    (json.dumps({"model": "chatty", "messages": MSG, "tools": [{"type": "function", "function": {
        "name": "bad name!"}}]}).encode(), "tools.0.function.name", "pattern"),
    (json.dumps({"model": "chatty", "messages": MSG, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "uniqueItems": True}}}}).encode(),
     "response_format.json_schema.schema", "uniqueItems"),
    (json.dumps({"model": "chatty", "messages": MSG, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "strange"}}}}).encode(), "response_format.json_schema.schema", "strange"),
    (json.dumps({"model": "chatty", "messages": MSG, "response_format": {"type": "xml"}}).encode(),
     "response_format.type", "xml"),
    (json.dumps({"model": "chatty", "messages": MSG, "structured_outputs": {"regex": "(unclosed"}}).encode(),
     "structured_outputs.regex", "regular expression"),
    (json.dumps({"model": "chatty", "messages": MSG + [CALLED, {"role": "tool", "tool_call_id": "other",
                                                                "content": "1"}]}).encode(), "messages", "'other'"),
    (json.dumps({"model": "chatty", "messages": MSG + [CALLED, {"role": "tool", "content": "1"}]}).encode(),
     "messages.2.tool_call_id", "tool_call_id"),
    (json.dumps({"model": "chatty", "messages": MSG + [{"role": "assistant", "content": "hi"}]}).encode(),
     "messages", "must end with a user message"),
    # strict types, as OpenAI's API has them: a value of another type is refused, never coerced
    (json.dumps({"model": "chatty", "messages": MSG, "stream": "yes"}).encode(), "stream", "valid boolean"),
    (json.dumps({"model": "chatty", "messages": MSG, "max_tokens": "5"}).encode(), "max_tokens", "valid integer"),
    (json.dumps({"model": "chatty", "messages": MSG, "max_tokens": 5.0}).encode(), "max_tokens", "valid integer"),
    (json.dumps({"model": "chatty", "messages": MSG, "n": True}).encode(), "n", "valid integer"),
    (json.dumps({"model": "chatty", "messages": MSG, "temperature": "0.5"}).encode(), "temperature", "valid number"),
    (json.dumps({"model": "chatty", "messages": MSG, "logprobs": 1}).encode(), "logprobs", "valid boolean"),
    (json.dumps({"model": "chatty", "messages": MSG, "stream": 1}).encode(), "stream", "valid boolean"),
    (json.dumps({"model": "chatty", "messages": MSG, "cache_salt": 5}).encode(), "cache_salt", "valid string"),
    (json.dumps({"model": "chatty", "messages": MSG, "cache_salt": ""}).encode(), "cache_salt", "at least 1"),
    (json.dumps({"model": "chatty", "messages": MSG, "cache_salt": "s" * 513}).encode(), "cache_salt", "at most 512"),
])
def test_bad_requests_are_400_naming_the_field(srv, http, body, param, words):
    msg = _err(http.post(srv.url + "/v1/chat/completions", content=body, headers=JSON), 400, param)
    assert words in msg


def test_context_overflow_names_both_numbers(srv, http):
    r = http.post(srv.url + "/v1/chat/completions", json={"model": "chatty", "messages": MSG, "max_tokens": 90})
    msg = _err(r, 400, "max_tokens")
    assert "max_tokens (90)" in msg and "context length is 96" in msg and r.json()["error"]["code"] == \
        "context_length_exceeded"
    r = http.post(srv.url + "/v1/completions", json={"model": "chatty", "prompt": "x" * 200})
    assert "200 tokens" in _err(r, 400, "prompt") and "96" in r.json()["error"]["message"]


def test_unknown_model_and_route_are_404(srv, http):
    r = http.post(srv.url + "/v1/chat/completions", json={"model": "gpt-9", "messages": MSG})
    assert "'chatty'" in _err(r, 404, "model") and r.json()["error"]["code"] == "model_not_found"
    _err(http.get(srv.url + "/v1/models/gpt-9"), 404, "model")
    _err(http.get(srv.url + "/v2/nothing"), 404)
    with pytest.raises(openai.NotFoundError):
        openai_client(srv.url).chat.completions.create(model="gpt-9", messages=MSG)


def test_a_base_run_serves_completions_and_refuses_chat(tiny_run, http):
    s = ThreadServer(ServedModel.from_run(tiny_run))
    try:
        r = http.post(s.url + "/v1/chat/completions", json={"model": "run", "messages": MSG})
        assert "no chat format" in _err(r, 400, "messages") and "/v1/completions" in r.json()["error"]["message"]
        c = openai_client(s.url).completions.create(model="run", prompt="The cat", max_tokens=5)
        assert c.choices[0].finish_reason in ("stop", "length") and c.usage.prompt_tokens > 0
        assert http.get(s.url + "/health").json()["chat"] is False
    finally:
        s.close()


@pytest.mark.serial
def test_api_key_body_limit_and_queue_limit(guarded, http):
    url = guarded.url + "/v1/completions"
    body = {"model": "wide", "prompt": "hi", "max_tokens": 2, "temperature": 0}
    assert "API key" in _err(http.post(url, json=body), 401)
    _err(http.post(url, json=body, headers={"Authorization": "Bearer wrong"}), 401)
    for other in ("Basic sekrit", "sekrit", "Token sekrit", "Bearer sekrit2", "Bearer"):  # only Bearer, only the key
        _err(http.post(url, json=body, headers={"Authorization": other}), 401)
    _err(http.get(guarded.url + "/v1/models"), 401)
    with pytest.raises(openai.AuthenticationError):
        openai_client(guarded.url, api_key="wrong").models.list()
    ok = openai_client(guarded.url, api_key="sekrit")
    assert ok.completions.create(**body).choices[0].text == "\x00\x00"
    assert http.get(guarded.url + "/health").status_code == 200  # the page and health stay open
    key = {"Authorization": "Bearer sekrit"}
    assert "4096" in _err(http.post(url, json={**body, "prompt": "x" * 5000}, headers=key), 413)

    def chunked():  # no Content-Length: the limit holds while reading
        yield json.dumps({**body, "prompt": "y" * 3000})[:-1].encode()
        yield b", " + json.dumps({"stop": ["z" * 3000]})[1:].encode()
    _err(http.post(url, content=chunked(), headers={**key, **JSON}), 413)

    # one row and one waiting place: a third request is refused with 429 + Retry-After
    long = {"model": "wide", "prompt": "go", "max_tokens": 4000, "stream": True, "temperature": 0}
    with httpx.Client(trust_env=False, timeout=60) as a, httpx.Client(trust_env=False, timeout=60) as b:
        with a.stream("POST", url, json=long, headers=key) as first:
            running = first.iter_lines()  # (kept: a dropped iterator closes the response)
            next(running)
            with b.stream("POST", url, json=long, headers=key):  # waits for the row
                deadline = time.monotonic() + 30
                while http.get(guarded.url + "/health").json()["waiting"] < 1:
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
                r = http.post(url, json=body, headers=key)
                assert "busy" in _err(r, 429) and r.headers["retry-after"] == "1"
                with pytest.raises(openai.RateLimitError):
                    openai_client(guarded.url, api_key="sekrit", max_retries=0).completions.create(**body)
        # both clients went away mid-generation: their rows are freed at once, not after 4000 tokens
    deadline = time.monotonic() + 1.0
    while (h := http.get(guarded.url + "/health").json())["active"] or h["waiting"]:
        assert time.monotonic() < deadline, h
        time.sleep(0.02)
    assert ok.completions.create(**body).choices[0].finish_reason == "length"


def test_one_failing_request_does_not_take_down_the_others(srv, http, monkeypatch):
    """A fault injected into one request's tool hook: that request gets a 500 in the OpenAI shape (or an error
    event when streaming); a request running beside it and the ones after it are answered."""
    def broken() -> object:
        def feed(token: int) -> None:
            raise RuntimeError("injected fault")
        return feed

    monkeypatch.setattr(srv.served, "chat_tool", broken)
    box: dict[str, httpx.Response] = {}
    t = threading.Thread(target=lambda: box.update(c=http.post(srv.url + "/v1/completions", json={
        "model": "chatty", "prompt": "side by side", "max_tokens": 30, "temperature": 0})))
    t.start()
    # greedy: the first token is not a stop token (a sampled stop at token 0 would never reach the hook)
    r = http.post(srv.url + "/v1/chat/completions", json={"model": "chatty", "messages": MSG, "max_tokens": 30,
                                                          "temperature": 0})
    assert "injected fault" in _err(r, 500) and r.json()["error"]["type"] == "server_error"
    with http.stream("POST", srv.url + "/v1/chat/completions",
                     json={"model": "chatty", "messages": MSG, "max_tokens": 30, "stream": True,
                           "temperature": 0}) as s:
        events = [ln for ln in s.iter_lines() if ln]
    assert "injected fault" in json.loads(events[-2][6:])["error"]["message"] and events[-1] == "data: [DONE]"
    t.join(60)
    assert box["c"].status_code == 200 and box["c"].json()["choices"][0]["finish_reason"] in ("stop", "length")
    monkeypatch.undo()
    assert openai_client(srv.url).chat.completions.create(model="chatty", messages=MSG, max_tokens=3).choices


def test_exposure_warning():
    assert exposure_warning("127.0.0.1", None) is None and exposure_warning("::1", None) is None
    assert exposure_warning("localhost", None) is None and exposure_warning("0.0.0.0", "key") is None
    assert "without an API key" in exposure_warning("0.0.0.0", None)
    assert "--api-key" in exposure_warning("192.168.1.5", None)


# --------------------------------------------------------------------------------------------------
# The real command
# --------------------------------------------------------------------------------------------------
def _start(run: Path, *args: str) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, NO_PROXY=NO_PROXY, no_proxy=NO_PROXY)
    p = subprocess.Popen([sys.executable, "-m", "lmforge.cli", "serve", "--run", str(run), "--port", "0", *args],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    line = p.stdout.readline()
    if "http://" not in line:
        p.kill()
        raise AssertionError(f"no URL printed: {line!r} {p.stderr.read()[-2000:]}")
    return p, line.split(" on ")[1].split()[0]


def test_lmforge_serve_command_serves_the_client_and_drains_on_sigterm(runs):
    p, url = _start(runs["zero"], "--max-batch", "2", "--allowed-hosts", "chat.example.com, box.lan")
    try:
        assert url.startswith("http://127.0.0.1:")
        for host, status in (("chat.example.com", 200), ("box.lan:80", 200), ("evil.example", 400)):  # rebinding
            assert httpx.get(url + "/health", headers={"Host": host}, trust_env=False).status_code == status
        client = openai_client(url)
        assert [m.id for m in client.models.list()] == ["zero"]
        r = client.chat.completions.create(model="zero", messages=MSG, max_tokens=3, temperature=0)
        assert r.choices[0].message.content == "\x00" * 3 and r.choices[0].finish_reason == "length"
        page = httpx.get(url + "/", trust_env=False)
        assert page.status_code == 200 and "lmforge" in page.text and "<script src=\"/static/app.js\">" in page.text
        # a stream in flight when SIGTERM arrives is finished, then the process exits cleanly
        with httpx.stream("POST", url + "/v1/completions", trust_env=False, timeout=120, json={
                "model": "zero", "prompt": "go", "max_tokens": 800, "temperature": 0, "stream": True}) as s:
            lines = s.iter_lines()
            assert next(lines).startswith("data: ")
            p.send_signal(signal.SIGTERM)
            rest = [ln for ln in lines if ln]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
        assert p.wait(60) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health", trust_env=False)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_chat_runs_the_calculator_tool_inside_the_reply(tmp_path, http):
    """The model calls the calculator; the server force-feeds the tool's output (the chat stage's ToolUse on
    the scheduler's forced-token path) and the model, seeing it, ends its turn. The reply shows the call in the
    server's markup (test_serve_tools.py), not as special-token text."""
    from serve_helpers import calculator_run

    s = ThreadServer(ServedModel.from_run(calculator_run(tmp_path / "calc")))
    try:
        r = openai_client(s.url).chat.completions.create(model="calc", messages=MSG, temperature=0, max_tokens=30)
        assert r.choices[0].message.content == "<calculator>6*7</calculator><output>42</output>"
        assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 5 + 4  # call + tool output
    finally:
        s.close()
