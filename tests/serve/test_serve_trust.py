"""The server against a hostile sweep's findings: embeddings of one token list, errors that never echo a client's
value at length, lone surrogates refused in every field (named), replies on a kept-alive connection without
Nagle's delay, and a served process whose startup heap is frozen out of the garbage collector's reach.

Each test runs a real server (:class:`serve_helpers.ThreadServer`, or :func:`lmforge.serve.serve` itself) on a
random-weight chat model and ends with a normal request that must succeed.
"""

from __future__ import annotations

import gc
import http.client as httplib
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("openai")
import httpx  # noqa: E402  (a dependency of openai)

from lmforge.serve import ServedModel, serve  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1]))
from serve_helpers import ThreadServer, openai_client, random_chat_run  # noqa: E402

MSG = [{"role": "user", "content": "Hi"}]
JSON = {"Content-Type": "application/json"}
HUGE = "9" * 4000  # a 4,000-digit number (under Python's 4,300-digit limit, so it parses)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return random_chat_run(tmp_path_factory.mktemp("trust") / "chatty")


@pytest.fixture(scope="module")
def srv(run):
    s = ThreadServer(ServedModel.from_run(run))
    yield s
    s.close()


@pytest.fixture(scope="module")
def http(srv):
    """One loopback client (proxy variables ignored) for the module's server."""
    c = httpx.Client(trust_env=False, timeout=60)
    yield c
    c.close()


def chat_ok(server: ThreadServer) -> None:
    r = openai_client(server.url).chat.completions.create(model="chatty", messages=MSG, max_tokens=3)
    assert r.choices[0].finish_reason in ("stop", "length")


def post(http: httpx.Client, url: str, raw: str, **headers: str) -> httpx.Response:
    return http.post(url, content=raw.encode(), headers={**JSON, **headers})


# --------------------------------------------------------------------------------------------------
def test_embeddings_take_one_flat_list_of_token_ids(srv, http):
    """OpenAI reads ``input: [5, 6]`` as one input of two token ids (a 500 before); ids out of range are 400s."""
    url = srv.url + "/v1/embeddings"
    one = http.post(url, json={"model": "chatty", "input": [5, 6]})
    assert one.status_code == 200, one.text
    got = one.json()
    assert len(got["data"]) == 1 and got["usage"]["prompt_tokens"] == 2
    nested = http.post(url, json={"model": "chatty", "input": [[5, 6]]}).json()
    assert got["data"][0]["embedding"] == pytest.approx(nested["data"][0]["embedding"])
    for raw in ('{"model": "chatty", "input": [-1]}', '{"model": "chatty", "input": [%s]}' % HUGE):
        r = post(http, url, raw)
        assert r.status_code == 400 and r.json()["error"]["param"] == "input" and len(r.content) < 1024, r.text[:300]
    chat_ok(srv)


def test_errors_never_echo_a_client_value_at_length(srv, http):
    """A 100 KB model name, 8 KB paths, a 4,000-digit max_tokens or token id, a long Content-Type, Host or
    tool_choice name: each error is short (values cut as validation errors cut them)."""
    long = "x" * 8000
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    cases = [
        post(http, srv.url + "/v1/chat/completions", json.dumps({"model": "m" * 100_000, "messages": MSG})),
        http.get(srv.url + "/" + long), http.get(srv.url + "/static/" + long), http.get(srv.url + "/v1/models/" + long),
        post(http, srv.url + "/v1/completions", '{"model": "chatty", "prompt": "a", "max_tokens": %s}' % HUGE),
        post(http, srv.url + "/v1/chat/completions", '{"model": "chatty", "messages": %s, "max_tokens": %s}'
             % (json.dumps(MSG), HUGE)),
        post(http, srv.url + "/detokenize", '{"tokens": [%s]}' % HUGE),
        http.post(srv.url + "/tokenize", content=b'{"prompt": "a"}', headers={"Content-Type": "text/" + long}),
        http.get(srv.url + "/health", headers={"Host": "h" * 4000}),
        post(http, srv.url + "/v1/chat/completions", json.dumps({
            "model": "chatty", "messages": MSG, "tools": [tool], "tool_choice": {"type": "function", "function": {
                "name": "n" * 50_000}}})),
    ]
    for r in cases:
        assert 400 <= r.status_code < 500 and len(r.content) < 1024, (r.status_code, len(r.content), r.text[:200])
        assert len(r.json()["error"]["message"]) < 400, r.text[:200]
    chat_ok(srv)


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "a", "stop": ["\ud800"]}, "stop"),
    ("/v1/chat/completions", {"messages": MSG, "stop": "\ud800"}, "stop"),
    ("/v1/chat/completions", {"messages": MSG, "tools": [{"type": "function", "function": {
        "name": "f", "description": "a\ud800", "parameters": {"type": "object"}}}]}, "tools.0.function.description"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\udfff"}]}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"\ud800": {}}}}}]}, "tools.0.function.parameters"),
    ("/v1/chat/completions", {"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"enum": ["a", "\ud800"]}}}}, "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"messages": MSG, "user": "\ud800"}, None),  # an ignored field: answered
])
def test_a_lone_surrogate_is_a_400_naming_its_field(srv, http, path, body, param):
    """JSON may spell a lone surrogate; UTF-8 cannot encode it: a 400 naming the field it is in (a schema as a
    whole), wherever it is, among the fields that are read (an ignored one, such as ``user``, stays ignored)."""
    r = post(http, srv.url + path, json.dumps({"model": "chatty", "max_tokens": 2, **body}))  # (ASCII escapes)
    if param is None:
        assert r.status_code == 200, r.text
        return
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "surrogate" in err["message"], err
    chat_ok(srv)


@pytest.mark.serial
def test_kept_alive_replies_do_not_wait_for_a_delayed_ack(srv):
    """The listening socket names TCP, so asyncio sets TCP_NODELAY on each connection: a reply written in two
    parts goes at once, not after the client's delayed ACK (~40 ms each, before)."""
    host, port = srv.url.removeprefix("http://").split(":")
    conn = httplib.HTTPConnection(host, int(port), timeout=30)
    times = []
    for _ in range(21):
        t0 = time.perf_counter()
        conn.request("GET", "/health")
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read())["status"] == "ok"
        times.append(time.perf_counter() - t0)
    conn.close()
    assert statistics.median(times[1:]) < 0.02, [round(t * 1000, 1) for t in times]


def test_serve_freezes_the_startup_heap_out_of_the_collector(run, monkeypatch):
    """``serve`` collects and freezes what loading left alive before it answers (a full collection over it
    paused the event loop ~300 ms), and unfreezes it when it returns."""
    servers = []

    class Recorded(uvicorn.Server):
        def __init__(self, *a, **kw) -> None:
            super().__init__(*a, **kw)
            servers.append(self)

    monkeypatch.setattr(uvicorn, "Server", Recorded)
    before, ready = gc.get_freeze_count(), {}
    served = ServedModel.from_run(run)
    t = threading.Thread(target=serve, args=(served,), kwargs={"port": 0, "on_ready": lambda url: ready.update(
        url=url, frozen=gc.get_freeze_count(), tracked=len(gc.get_objects()))}, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 60
        while not (servers and servers[0].started):
            assert t.is_alive() and time.monotonic() < deadline, "serve did not start"
            time.sleep(0.02)
        assert httpx.get(ready["url"] + "/health", trust_env=False, timeout=30).json()["status"] == "ok"
        assert ready["frozen"] - before > 50_000 and ready["tracked"] < ready["frozen"] / 4, ready
    finally:
        for s in servers:
            s.should_exit = True
        t.join(30)
    assert not t.is_alive() and gc.get_freeze_count() == 0
