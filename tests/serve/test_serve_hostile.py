"""The server against hostile or careless clients: bad values, failures while a request joins, clients that
leave (streaming, not streaming, still queued), slow bodies and headers, deep nesting.

Each test runs a real server (:class:`serve_helpers.ThreadServer`) and drives it with the official ``openai``
client where a client would, raw sockets where the point is a misbehaving connection. Long requests use the
wide all-zero model (:func:`serve_helpers.wide_zero_run`: milliseconds per token, so a 4,000-token budget
takes far longer than any deadline below), and every "freed" check is bounded by about a second.
"""

from __future__ import annotations

import contextlib
import json
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
import httpx  # noqa: E402  (a dependency of openai)

from lmforge.generate import scheduler as scheduler_module  # noqa: E402
from lmforge.serve import ServedModel  # noqa: E402
from lmforge.serve.app import create_app  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1]))
from serve_helpers import ThreadServer, openai_client, wide_zero_run, zero_run  # noqa: E402

LONG = 4000  # tokens: many seconds on the wide model, a budget no request reaches within a test's deadline


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("hostile")
    return {"zero": zero_run(d / "zero"), "wide": wide_zero_run(d / "wide")}


@pytest.fixture(scope="module")
def wide(runs):
    """The wide model, four rows and four waiting places."""
    s = ThreadServer(ServedModel.from_run(runs["wide"], max_batch=4, max_queue=4))
    yield s
    s.close()


@pytest.fixture
def http():
    with httpx.Client(trust_env=False, timeout=60) as c:
        yield c


def health(server: ThreadServer) -> dict:
    return httpx.get(server.url + "/health", trust_env=False, timeout=30).json()


def wait_for(server: ThreadServer, ok: Callable[[dict], bool], seconds: float) -> float:
    """Seconds until ``ok(/health)`` holds; AssertionError naming the last state after ``seconds``."""
    t0 = time.monotonic()
    while not ok(h := health(server)):
        assert time.monotonic() - t0 < seconds, f"not within {seconds} s: {h}"
        time.sleep(0.01)
    return time.monotonic() - t0


def raw_post(url: str, body: dict, path: str = "/v1/completions") -> socket.socket:
    """A socket that has sent ``POST path`` with ``body`` (the reply is left unread)."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def stream_text(stream) -> tuple[str, str | None]:
    text, finish = "", None
    for c in stream:
        text += c.choices[0].text
        finish = c.choices[0].finish_reason or finish
    return text, finish


# --------------------------------------------------------------------------------------------------
# One request's failure is its own
# --------------------------------------------------------------------------------------------------
def test_a_failure_while_one_request_joins_fails_it_alone(wide, monkeypatch):
    """A fault injected into one request's admission (building its row): that request gets a 500; the stream
    running beside it goes on to its full length, and the next request is served."""
    real_row = scheduler_module._row
    live_at_fault: list[int] = []

    def row(req, *args):
        if req.seed == 666:
            live_at_fault.append(wide.served.scheduler.engine.active)
            raise RuntimeError("injected fault while joining")
        return real_row(req, *args)

    monkeypatch.setattr(scheduler_module, "_row", row)
    client = openai_client(wide.url, max_retries=0, timeout=30)
    stream = client.completions.create(model="wide", prompt="go", max_tokens=300, temperature=0, stream=True)
    first = next(iter(stream))
    with pytest.raises(openai.InternalServerError, match="injected fault while joining"):
        client.completions.create(model="wide", prompt="hi", max_tokens=2, seed=666)
    text, finish = stream_text(stream)
    assert live_at_fault == [1]  # the stream's row was live when the other request failed
    assert first.choices[0].text + text == "\x00" * 300 and finish == "length"
    assert client.completions.create(model="wide", prompt="hi", max_tokens=2, seed=7).choices[0].finish_reason == \
        "length"


def test_an_out_of_range_seed_is_a_400_and_touches_no_one(wide):
    """seed=2**70 used to end every live row ("Overflow when unpacking long long") and never answer itself."""
    client = openai_client(wide.url, max_retries=0, timeout=30)
    stream = client.completions.create(model="wide", prompt="go", max_tokens=200, temperature=0, stream=True)
    first = next(iter(stream))
    for seed in (2 ** 70, 2 ** 63, -(2 ** 63) - 1):
        with pytest.raises(openai.BadRequestError, match="seed") as e:
            client.completions.create(model="wide", prompt="hi", max_tokens=2, seed=seed)
        assert e.value.param == "seed"
    with pytest.raises(openai.BadRequestError, match="seed"):
        client.chat.completions.create(model="wide", messages=[{"role": "user", "content": "hi"}], seed=2 ** 70)
    text, finish = stream_text(stream)
    assert first.choices[0].text + text == "\x00" * 200 and finish == "length"
    for seed in (2 ** 63 - 1, -(2 ** 63)):  # OpenAI's range, both ends
        assert client.completions.create(model="wide", prompt="hi", max_tokens=2, seed=seed).choices[0].text


def test_tiny_temperature_and_top_p_are_greedy(runs):
    """temperature 1e-40 overflowed float32 (inf logits) and top_p 1e-50 rounded to 0 (no token kept): both
    were a 500. Now a temperature under the floor is greedy and top_p keeps the likeliest token."""
    from serve_helpers import random_chat_run

    run = random_chat_run(runs["zero"].parent / "chatty")
    s = ThreadServer(ServedModel.from_run(run))
    try:
        client = openai_client(s.url, max_retries=0)
        msg = [{"role": "user", "content": "Hello there"}]
        greedy = client.chat.completions.create(model="chatty", messages=msg, max_tokens=12, temperature=0)
        for kw in (dict(temperature=1e-40), dict(temperature=1.0, top_p=1e-50), dict(temperature=1e-300, top_p=1e-300)):
            r = client.chat.completions.create(model="chatty", messages=msg, max_tokens=12, seed=1, **kw)
            assert r.choices[0].message.content == greedy.choices[0].message.content, kw
    finally:
        s.close()


# --------------------------------------------------------------------------------------------------
# Clients that leave
# --------------------------------------------------------------------------------------------------
@pytest.mark.serial
def test_a_plain_request_whose_client_leaves_is_cancelled_within_a_second(wide):
    """The openai client times out (1.5 s) and retries once: each try leaves a 4,000-token request behind.
    Tokens keep arriving for them, yet both rows are freed within a second of their client leaving."""
    client = openai_client(wide.url, max_retries=1, timeout=1.5)
    with pytest.raises(openai.APITimeoutError):
        client.completions.create(model="wide", prompt="go", max_tokens=LONG, temperature=0)
    wait_for(wide, lambda h: h["active"] == 0 and h["waiting"] == 0, 1.0)


@pytest.mark.serial
def test_disconnected_waiting_requests_leave_the_queue_at_once(runs, http):
    """One row, busy; four clients wait (two streaming, two not), then leave: /health says waiting 0 within a
    second, and a new request is queued (not refused with 429) and answered when the row frees."""
    s = ThreadServer(ServedModel.from_run(runs["wide"], max_batch=1, max_queue=4))
    url = s.url + "/v1/completions"
    long = {"model": "wide", "prompt": "go", "max_tokens": LONG, "temperature": 0}
    box: dict[str, object] = {}
    client = openai_client(s.url, max_retries=0, timeout=60)  # (no retry: a 429 would raise RateLimitError)

    def late() -> None:
        try:
            box["r"] = client.completions.create(model="wide", prompt="go", max_tokens=2, temperature=0)
        except openai.APIError as e:
            box["r"] = e

    try:
        with http.stream("POST", url, json={**long, "stream": True}) as busy:
            lines = busy.iter_lines()  # (kept: a dropped iterator closes the response)
            next(lines)
            with contextlib.ExitStack() as waiting:
                for _ in range(2):
                    c = waiting.enter_context(httpx.Client(trust_env=False, timeout=60))
                    waiting.enter_context(c.stream("POST", url, json={**long, "stream": True}))
                for _ in range(2):
                    waiting.callback(raw_post(s.url, long).close)
                wait_for(s, lambda h: h["waiting"] == 4, 30)
                assert http.post(url, json={**long, "max_tokens": 2}).status_code == 429  # the queue is full
            wait_for(s, lambda h: h["waiting"] == 0, 1.0)  # the four left
            t = threading.Thread(target=late)
            t.start()
            wait_for(s, lambda h: h["waiting"] == 1 and h["active"] == 1, 10)  # queued behind the busy row
            assert "r" not in box
        t.join(60)  # the busy stream left: the queued request gets the row
        assert isinstance(box["r"], openai.types.Completion), box["r"]
        assert box["r"].choices[0].text == "\x00\x00"
    finally:
        s.close()


# --------------------------------------------------------------------------------------------------
# Connections and bodies
# --------------------------------------------------------------------------------------------------
@pytest.mark.serial
def test_slow_bodies_headers_and_silent_connections_are_closed(runs):
    """300 connections that would hold the server forever (100 trickle a body one byte at a time, 100 trickle
    header lines, 100 send nothing) are all closed within seconds: the body ones with a 408. Meanwhile a
    stream that lasts longer than those deadlines, and a kept-alive connection, are served as usual."""
    s = ThreadServer(ServedModel.from_run(runs["zero"]), body_timeout=1.0, header_timeout=1.0)
    host, port = s.url.removeprefix("http://").split(":")
    kinds = ["body", "headers", "silent"] * 100
    socks = []
    try:
        for kind in kinds:
            sock = socket.create_connection((host, int(port)))
            if kind == "body":
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                             b"Content-Length: 1000\r\n\r\n{")
            elif kind == "headers":
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            sock.setblocking(False)
            socks.append(sock)
        with httpx.Client(trust_env=False, timeout=60) as c:  # a stream outliving both deadlines is not cut
            with c.stream("POST", s.url + "/v1/completions", json={"model": "zero", "prompt": "go", "temperature": 0,
                                                                    "max_tokens": 1500, "stream": True}) as r:
                t0 = time.monotonic()
                last = [ln for ln in r.iter_lines() if ln][-2]
                assert json.loads(last[6:])["choices"][0]["finish_reason"] == "length", last
            time.sleep(0.5)  # a kept-alive connection, reused within the deadline, still works
            assert c.get(s.url + "/health").status_code == 200
        got = {i: b"" for i in range(len(socks))}
        closed: set[int] = set()
        deadline = t0 + 8
        while len(closed) < len(socks) and time.monotonic() < deadline:
            for i, sock in enumerate(socks):
                if i in closed:
                    continue
                try:
                    while data := sock.recv(65536):
                        got[i] += data
                    closed.add(i)  # end of stream: the server closed it
                    continue
                except BlockingIOError:
                    pass
                except OSError:
                    closed.add(i)
                    continue
                with contextlib.suppress(BlockingIOError, OSError):  # keep trickling
                    sock.send({"body": b" ", "headers": b"X-Slow: 1\r\n", "silent": b""}[kinds[i]])
            time.sleep(0.2)
        open_ = [kinds[i] for i in range(len(socks)) if i not in closed]
        assert not open_, f"{len(open_)} connections still open ({', '.join(sorted(set(open_)))})"
        bodies = [got[i] for i, k in enumerate(kinds) if k == "body"]
        assert all(b.startswith(b"HTTP/1.1 408") and b"did not arrive within 1 s" in b for b in bodies), bodies[0]
        assert all(b"\r\nconnection: close\r\n" in b.lower() for b in bodies)  # the rest of the body is not read
        assert health(s)["status"] == "ok"
    finally:
        for sock in socks:
            sock.close()
        s.close()


@pytest.mark.parametrize("body", [b"[" * 100_000, b'{"model": "wide", "prompt": ' + b"[" * 100_000,
                                  b'{"model": "wide", "stream_options": ' + b'{"a": ' * 50_000])
def test_deeply_nested_json_is_a_400(wide, http, body):
    r = http.post(wide.url + "/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("key, words", [("my key", "holds a space"), ("clé", "holds 'é'"),
                                        ("tab\tkey", r"holds '\\t'"), ("", "is empty")])
def test_an_api_key_that_could_never_match_is_refused_at_start(wide, key, words):
    with pytest.raises(ValueError, match=words):
        create_app(wide.served, api_key=key)


def test_serve_help_points_to_the_environment_variable_and_refuses_a_bad_one(runs, monkeypatch, capsys):
    """A key on the command line shows in `ps`: --help says to use LMFORGE_API_KEY; a key there that could never
    match is refused at start, in one line naming the variable (exit 2, before the model loads)."""
    from lmforge import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "environment variable LMFORGE_API_KEY" in text and "shows in `ps`" in text
    monkeypatch.setenv("LMFORGE_API_KEY", "two words")
    assert cli.main(["-q", "serve", "--run", str(runs["zero"]), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "$LMFORGE_API_KEY: the API key holds a space" in err[0], err


def test_a_prompt_with_a_lone_surrogate_is_a_400(wide, http):
    """JSON may spell a lone surrogate ("\\ud800"); the tokenizer cannot encode it: a 400 naming the prompt, not a 500."""
    r = http.post(wide.url + "/v1/completions", content=b'{"model": "wide", "prompt": "a\\ud800b", "max_tokens": 2}',
                  headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and "surrogate" in r.text, r.text


def test_streams_whose_clients_leave_do_not_flood_the_log(runs, caplog, monkeypatch):
    """Clients that leave fast streams mid-burst (a slowed event loop lets tokens pile up): the server stops
    writing to them at once (asyncio logs a warning for every write to a lost connection, "socket.send() raised
    exception": the hostile sweep's clients filled the log with them)."""
    from lmforge.serve import api

    sse = api.sse

    def slow_sse(obj):
        time.sleep(0.002)  # the event loop busy: 8 rows of ~1 ms tokens outrun it
        return sse(obj)

    monkeypatch.setattr(api, "sse", slow_sse)
    s = ThreadServer(ServedModel.from_run(runs["zero"], max_batch=8))
    try:
        body = {"model": "zero", "prompt": "go", "max_tokens": 3000, "temperature": 0, "stream": True}

        def leave_after(n: int) -> None:
            with httpx.Client(trust_env=False, timeout=60) as c, c.stream("POST", s.url + "/v1/completions",
                                                                          json=body) as r:
                for k, _ in enumerate(r.iter_raw(64)):  # reading along, then gone with data unread (a reset)
                    if k == n:
                        break

        threads = [threading.Thread(target=leave_after, args=(20 * n,)) for n in range(1, 9)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        wait_for(s, lambda h: h["active"] == 0, 5)
    finally:
        s.close()
    assert not [r for r in caplog.records if "socket.send() raised exception" in r.getMessage()]
