"""The server's HTTP edge against hostile clients: ``/metrics`` labels (bounded, escaped), cross-site bodies
(``Content-Type``), DNS rebinding (``Host``), and a 500 that leaves its keep-alive connection usable.

Each test runs a real server (:class:`serve_helpers.ThreadServer`) on a random-weight chat model, drives it with
raw HTTP where the point is what a client sends, and ends with a normal request that must succeed.
"""

from __future__ import annotations

import http.client as httplib
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")
parser = pytest.importorskip("prometheus_client.parser")
import httpx  # noqa: E402  (a dependency of openai)

from lmforge.serve import ServedModel  # noqa: E402
from lmforge.serve.access import AllowedHosts, host_name  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1]))
from serve_helpers import ThreadServer, openai_client, random_chat_run  # noqa: E402

MSG = [{"role": "user", "content": "Hi"}]
KEY = {"Authorization": "Bearer sekrit"}
METRICS = {"lmforge_requests", "lmforge_prompt_tokens", "lmforge_generation_tokens", "lmforge_requests_running",
           "lmforge_requests_waiting", "lmforge_time_to_first_token_seconds", "lmforge_inter_token_latency_seconds",
           "lmforge_prefix_cache_queries", "lmforge_prefix_cache_hits", "lmforge_prefix_cache_query_tokens",
           "lmforge_prefix_cache_hit_tokens", "lmforge_prefix_cache_bytes", "lmforge_speculative_passes",
           "lmforge_speculative_drafted_tokens", "lmforge_speculative_accepted_tokens",
           "lmforge_prefix_cache_evicted_blocks", "lmforge_responses_stored", "lmforge_responses_stored_bytes"}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return random_chat_run(tmp_path_factory.mktemp("http") / "chatty")


@pytest.fixture
def http():
    with httpx.Client(trust_env=False, timeout=60) as c:
        yield c


def served(run: Path, **app_kw) -> ThreadServer:
    return ThreadServer(ServedModel.from_run(run), **app_kw)


def chat_ok(server: ThreadServer, key: str = "unused") -> None:
    """A normal request through the official client succeeds."""
    r = openai_client(server.url, api_key=key).chat.completions.create(model="chatty", messages=MSG, max_tokens=3)
    assert r.choices[0].finish_reason in ("stop", "length")


def families(text: str) -> dict[str, list]:
    """The exposition parsed by prometheus_client's own parser: family name -> samples."""
    return {f.name: f.samples for f in parser.text_string_to_metric_families(text)}


# --------------------------------------------------------------------------------------------------
INJECT = "/static/%22%7D%209999%0Almforge_fake_metric%7Bx%3D%22"


def test_metrics_label_routes_not_paths_and_cannot_be_injected(run, http):
    """With a key, /static/* and unknown paths stay open: 300 distinct 404s (and the label-injection path) add
    one series per route template, and the text parses to exactly the server's metrics."""
    s = served(run, api_key="sekrit")
    try:
        paths = [f"/static/x{i}" for i in range(100)] + [f"/nope/{i}" for i in range(100)] + [INJECT]
        paths += [f"/v1/models/m{i}" for i in range(100)]  # with the key: the 404 of an unknown model
        for p in paths:
            assert http.get(s.url + p, headers=KEY).status_code == 404
        chat_ok(s, "sekrit")
        text = http.get(s.url + "/metrics", headers=KEY).text
        assert "lmforge_fake_metric" not in {ln.split("{")[0] for ln in text.splitlines()}
        got = families(text)
        assert {n for n in got if not n.endswith("_created")} == METRICS, sorted(got)
        requests = {(x.labels["endpoint"], x.labels["status"]): x.value for x in got["lmforge_requests"]
                    if x.name == "lmforge_requests_total"}
        assert requests == {("/static/{name}", "404"): 101, ("other", "404"): 100, ("/v1/models/{name}", "404"): 100,
                            ("/v1/chat/completions", "200"): 1}
        assert got["lmforge_requests_waiting"][0].value == 0
    finally:
        s.close()


def test_each_app_has_its_own_metrics(run, http):
    """Two servers in one process: each counts only its own requests (no shared global registry)."""
    a, b = served(run), served(run)
    try:
        for _ in range(3):
            assert http.get(a.url + "/v1/models/nope").status_code == 404
        assert http.get(b.url + "/v1/models/nope").status_code == 404
        for s, n in ((a, 3), (b, 1)):
            [x] = [x for x in families(http.get(s.url + "/metrics").text)["lmforge_requests"]
                   if x.name == "lmforge_requests_total"]
            assert x.labels == {"endpoint": "/v1/models/{name}", "status": "404"} and x.value == n
        chat_ok(b)
    finally:
        a.close()
        b.close()


# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def srv(run):
    s = served(run, allowed_hosts=["chat.example.com"])
    yield s
    s.close()


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"model": "chatty", "messages": MSG, "max_tokens": 2}),
    ("/v1/completions", {"model": "chatty", "prompt": "hi", "max_tokens": 2}),
    ("/v1/embeddings", {"model": "chatty", "input": "hi"}),
    ("/tokenize", {"prompt": "hi"}),
    ("/detokenize", {"tokens": [104]}),
])
def test_api_posts_need_a_json_content_type(srv, http, path, body):
    """A cross-site page can POST text/plain (or a form) without a CORS preflight: such bodies are a 415 in the
    OpenAI shape, never parsed; application/json, with a charset or in any case, is served."""
    data = json.dumps(body).encode()
    for kind in ("text/plain", "text/plain; charset=utf-8", "application/x-www-form-urlencoded",
                 "multipart/form-data; boundary=x", None, "application/jsonx", "text/json"):
        r = http.post(srv.url + path, content=data, headers={"Content-Type": kind} if kind else {})
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type", (kind, r.text)
        assert "application/json" in r.json()["error"]["message"]
    for kind in ("application/json", "application/json; charset=utf-8", "Application/JSON;charset=UTF-8"):
        r = http.post(srv.url + path, content=data, headers={"Content-Type": kind})
        assert r.status_code == 200, (kind, r.text)
    chat_ok(srv)


def test_a_host_that_is_not_this_server_is_refused(srv, http):
    """DNS rebinding: a page on evil.example re-pointed at 127.0.0.1 sends ``Host: evil.example``. Names other
    than localhost and the allowed ones are a 400 on every route (the page, /health, the API); IP addresses,
    localhost (with or without the port) and allowed names are served."""
    port = srv.url.rsplit(":", 1)[1]
    bad = ["evil.example", f"evil.example:{port}", "localhost.evil.example", "127.0.0.1.nip.io", "chat.example.com.evil"]
    for host in bad:
        for r in (http.get(srv.url + "/", headers={"Host": host}),
                  http.get(srv.url + "/health", headers={"Host": host}),
                  http.post(srv.url + "/v1/completions", headers={"Host": host},
                            json={"model": "chatty", "prompt": "hi", "max_tokens": 2})):
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host", (host, r.text)
            assert "--allowed-hosts" in r.json()["error"]["message"]
    good = ["localhost", f"localhost:{port}", "LOCALHOST.", "127.0.0.1", f"127.0.0.1:{port}", f"[::1]:{port}",
            "[::1]", "10.1.2.3:80", "chat.example.com", f"Chat.Example.com:{port}"]
    for host in good:
        assert http.get(srv.url + "/health", headers={"Host": host}).status_code == 200, host
    chat_ok(srv)


def test_allowed_hosts_names_and_star(run, http, capsys):
    from lmforge import cli

    assert host_name("[::1]:8000") == "::1" and host_name("LocalHost.:80") == "localhost"
    assert AllowedHosts(["*"]).allows("anything.example") and not AllowedHosts().allows("anything.example")
    for bad in (["a b"], [""], ["user@host"], ["http://x/"]):
        with pytest.raises(ValueError, match="not a host name"):
            AllowedHosts(bad)
    assert cli.main(["-q", "serve", "--run", str(run), "--port", "0", "--allowed-hosts", "ok.lan,a b"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--allowed-hosts: allowed host 'a b' is not a host name" in err[0], err
    s = served(run, allowed_hosts=["*"])
    try:
        assert http.get(s.url + "/health", headers={"Host": "proxy.example"}).status_code == 200
        chat_ok(s)
    finally:
        s.close()


# --------------------------------------------------------------------------------------------------
def test_a_500_leaves_the_keep_alive_connection_usable(run, monkeypatch):
    """A served model whose method raises: the request gets the OpenAI-shaped 500 and the next request on the
    same keep-alive connection is answered (no silent EOF)."""
    s = served(run)
    try:
        def boom(*a, **kw):
            raise RuntimeError("boom")

        monkeypatch.setattr(s.served, "chat_prompt", boom)
        host, port = s.url.removeprefix("http://").split(":")
        conn = httplib.HTTPConnection(host, int(port), timeout=30)
        body = json.dumps({"messages": MSG})
        conn.request("POST", "/tokenize", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        err = json.loads(r.read())["error"]
        assert r.status == 500 and err["type"] == "server_error" and "RuntimeError: boom" in err["message"]
        sock = conn.sock
        assert sock is not None and r.getheader("connection") != "close"
        for _ in range(2):  # the same socket answers again
            conn.request("GET", "/health")
            r = conn.getresponse()
            assert r.status == 200 and json.loads(r.read())["status"] == "ok"
            assert conn.sock is sock
        conn.request("POST", "/tokenize", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 500 and r.read()
        monkeypatch.undo()
        conn.request("POST", "/tokenize", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read())["count"] > 0 and conn.sock is sock
        conn.close()
        assert 'endpoint="/tokenize",status="500"} 2.0' in httpx.get(s.url + "/metrics", trust_env=False).text
        chat_ok(s)
    finally:
        s.close()
