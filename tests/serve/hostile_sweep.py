"""A hostile-client sweep of a real ``lmforge serve`` (run by hand, not part of the suite: about four minutes).

    .venv/bin/python tests/serve/hostile_sweep.py [--requests 200] [--seed 0] [--phases bad,rounds,hostile,tenancy]

It starts the real command on a small random chat model, then:

1. bad values in every request field (chat, completions and responses; values of the wrong type among them, which
   strict types refuse rather than coerce): each must be a 4xx in the OpenAI shape, never a 500, and the server
   must stay up;
2. rounds of ``--requests`` mixed requests from 24 threads at once: greedy and seeded chat and completions,
   streamed or not, tiny sampling values, stop strings, calculator markup sent back, bad values, and clients
   that disconnect at random moments (queued, mid-stream, mid-wait); while the first round runs, 300 slow
   connections (trickled bodies, trickled headers, silent) are opened;
3. checks that every request that was not meant to fail got exactly the answer it gets alone (the oracle: the
   same request sent alone before the sweep), that no request got a 5xx or a 429, that ``/health`` returns
   to ``active 0, waiting 0``, that the slow connections were all closed, and that the server's RSS is flat
   from round to round;
4. (``hostile``) every variant of the schema, metrics, cross-origin and number attacks (issue 37, items 1-10),
   ~4,300 requests from 4 threads at this server and at a second one started with ``--api-key``, while 3
   threads send normal requests (each must get its alone-answer) and a separate process polls ``/health``
   every 10 ms: ``$ref`` chains (3,000 plain, 2,000 nested arrays) and schemas with no finite document
   (``{"$ref": "#"}``, mutual ``$defs``, a required self), 13,000 properties, 5,000 patterns, 500+ optional
   properties, a compile over the 10 s deadline, remote ``$ref``s, each in ``response_format`` and in
   ``tools[0].function.parameters``; 40 distinct ~350 KB enum schemas, then 48 distinct ~190 KB ones that
   compile (RSS before and after); 2,000 distinct 404 paths per server and label injections (the
   ``/metrics`` series must stay few and parse as lmforge's own); ``text/plain`` and other simple-request
   bodies (415) and ``Host`` names of other sites (400); 5,000-digit, NaN and infinite numbers, lone
   surrogates; ``logit_bias``, ``response_format`` on completions, completions ``logprobs: true`` (400 by
   name); replies cut by ``max_tokens`` inside a required call (the call's text so far, finish ``length``).
   Each hostile request must get its 4xx (a 200 where stated) in the OpenAI shape with a message under 1 KB,
   no CORS grant, and a kept-alive connection that stays usable; ``/health`` must answer within 100 ms
   during every compile (max and p99 printed, beside the same poller's figures outside compiles and idle);
5. (``tenancy``, :mod:`tenancy_sweep`) several users on a server started with ``--api-key-file``: the PIN probe
   through ``cached_tokens`` and the time to first token with and without salts and keys, store flooding across
   keys (and every route of another key's stored response), ``store: true`` only for what was stored, wrong-typed
   fields, and ``/health`` without counters.

It prints the figures and exits 1 if any check fails.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from dataclasses import field as dc_field
from pathlib import Path
from typing import Any, Callable

import httpx

sys.path.insert(0, str(Path(__file__).parents[1]))
from serve_helpers import NO_PROXY, random_chat_run  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from tenancy_sweep import tenancy_phase  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MODEL = "sweep"
SHOWN = "<calculator>6*7</calculator><output>42</output>"


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def start(run: Path, log: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    """The real ``lmforge serve`` of ``run`` (its stderr into ``log``, so a full pipe never blocks it) and its URL."""
    env = dict(os.environ, NO_PROXY=NO_PROXY, no_proxy=NO_PROXY)
    with open(log, "w") as err:
        p = subprocess.Popen([sys.executable, "-m", "lmforge.cli", "serve", "--run", str(run), "--port", "0",
                              "--max-batch", "8", "--max-queue", "64", *extra], stdout=subprocess.PIPE,
                             stderr=err, text=True, env=env, cwd=ROOT)
    line = p.stdout.readline()
    if "http://" not in line:
        p.kill()
        raise SystemExit(f"the server did not start: {line!r} {log.read_text()[-2000:]}")
    return p, line.split(" on ")[1].split()[0]


def stop_server(p: subprocess.Popen) -> None:
    p.terminate()
    try:
        p.wait(30)
    except subprocess.TimeoutExpired:
        p.kill()


# --------------------------------------------------------------------------------------------------
# 1. Bad values in every field
# --------------------------------------------------------------------------------------------------
def bad_bodies() -> list[tuple[str, Any]]:
    """``(path, body)`` pairs, each wrong in one field (a body given as bytes is sent raw)."""
    msg = [{"role": "user", "content": "hi"}]
    chat = {"model": MODEL, "messages": msg, "max_tokens": 4}
    comp = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
    values = {
        "model": [None, 3, "gpt-9", "", ["x"]],
        "max_tokens": [0, -1, 10 ** 9, 2 ** 70, "x", 1.5, [], {}, "5", 5.0, True],
        "temperature": [-1, 2.5, "hot", 1e309, -1e-9, None, [0.5], "0.5", True],
        "top_p": [0, -0.1, 1.5, "all", 1e309],
        "stop": [["a", "b", "c", "d", "e"], "", [""], [3], 7, {"a": 1}],
        "seed": [2 ** 70, 2 ** 63, -(2 ** 63) - 1, 1.5, "seven", [1], "7", True],
        "stream": ["maybe", 2, [True], "yes", "true", 1],  # (strict types: never coerced, as OpenAI's API)
        "stream_options": ["x", [1]],
        "n": [0, -3, "two", 9, 129, 1.5, "2", True],  # 9: more than --max-batch 8
        "cache_salt": [7, "", "s" * 513, ["a"], True],
        "speculative": ["no", 0],
    }
    fn = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    chat_only = {  # the fields issue 26 added, each wrong in one way
        "logprobs": [5, "x", [True]],
        "top_logprobs": [21, -1, "x", 2],  # (2 without logprobs: true)
        "tools": ["x", [{"type": "function"}], [{"type": "function", "function": {"name": "a b"}}],
                  [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}],
                  [{"type": "function", "function": {"name": "f", "parameters": {"type": "wrong"}}}],
                  [fn, fn], [fn] * 200],
        "tool_choice": ["maybe", {"type": "function", "function": {"name": "zz"}}, "required", 3],
        "parallel_tool_calls": ["x", [1]],
        "response_format": ["x", {"type": "xml"}, {"type": "json_schema"},
                            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"uniqueItems": True}}},
                            {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}},
                            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}}],
        "structured_outputs": [{"regex": "("}, {"choice": []}, {"regex": "a", "choice": ["a"]}, {"x": 1}, "x",
                               {"choice": [""]}],
    }
    comp_only = {"logprobs": [21, -1, "x", 1.5]}
    out: list[tuple[str, Any]] = []
    for field, vals in values.items():
        for v in vals:
            out.append(("/v1/chat/completions", {**chat, field: v}))
            out.append(("/v1/completions", {**comp, field: v}))
    for field, vals in chat_only.items():
        out += [("/v1/chat/completions", {**chat, field: v}) for v in vals]
    for field, vals in comp_only.items():
        out += [("/v1/completions", {**comp, field: v}) for v in vals]
    called = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    out += [("/v1/chat/completions", {**chat, "tools": [fn], "response_format": {"type": "json_object"}}),
            ("/v1/chat/completions", {**chat, "n": 4, "max_tokens": 150}),  # n x max_tokens over the cap (512)
            ("/v1/chat/completions", {**chat, "messages": msg + [called, {"role": "tool", "content": "1"}]}),
            ("/v1/chat/completions", {**chat, "messages": msg + [called, {"role": "tool", "tool_call_id": "zz",
                                                                        "content": "1"}]}),
            ("/v1/chat/completions", {**chat, "messages": msg + [called]}),
            ("/v1/chat/completions", {**chat, "messages": msg + [{**called, "tool_calls": "x"}]})]
    for body in ({"model": MODEL, "input": []}, {"model": MODEL, "input": 3}, {"model": MODEL, "input": [[-1]]},
                 {"model": MODEL, "input": "x" * 5000}, {"model": MODEL, "input": [""]},
                 {"model": "gpt-9", "input": "x"}, {"model": MODEL, "input": "x", "dimensions": 3}):
        out.append(("/v1/embeddings", body))
    for body in ({}, {"prompt": "x", "messages": msg}, {"messages": []}, {"prompt": "\ud800"},
                 {"messages": [{"role": "tool", "content": "x"}]}):
        out.append(("/tokenize", body))
    for body in ({}, {"tokens": [-1]}, {"tokens": "x"}, {"tokens": [10 ** 9]}, {"tokens": [1.5]}):
        out.append(("/detokenize", body))
    for v in ([], None, "hi", [{"role": "robot", "content": "x"}], [{"role": "user"}], [{"role": "user", "content": 3}],
              [{"role": "user", "content": ""}], [{"role": "assistant", "content": "x"}], [{"content": "x"}],
              [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
              [{"role": "tool", "content": "42"}], [{"role": "user", "content": "x" * 5000}],
              [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], [[[[[]]]]]):
        out.append(("/v1/chat/completions", {**chat, "messages": v}))
    out += [("/v1/chat/completions", {**chat, "max_completion_tokens": 0}),
            ("/v1/chat/completions", {**chat, "tools": [{"type": "function"}]})]
    for v in ("", [], ["a", "b"], 3, [1, 2, 3], None, "x" * 5000):
        out.append(("/v1/completions", {**comp, "prompt": v}))
    out.append(("/v1/completions", {**comp, "echo": True}))
    for raw in (b"", b"{", b"[1]", b"null", b'"x"', b"[" * 100_000, b'{"model": ' + b"[" * 100_000,
                b"\xff\xfe", b'{"model": "sweep", "prompt": "\\ud800", "max_tokens": 2}', b"NaN"):
        out.append(("/v1/completions", raw))
    out.append(("/v1/completions", b"x" * (2 << 20)))  # over --max-body: 413
    resp = {"model": MODEL, "input": "hi", "max_output_tokens": 4}
    for field, vals in {"stream": ["yes", 1], "store": ["false", 0], "max_output_tokens": ["5", 5.0, True],
                        "temperature": ["0"], "top_logprobs": ["3"], "max_tool_calls": [0, 3],
                        "metadata": [{"k": 3}, {"k": "v" * 513}, {"k" * 65: "v"}, {f"k{i}": "v" for i in range(17)}],
                        "cache_salt": ["", 5], "parallel_tool_calls": ["no"]}.items():
        out += [("/v1/responses", {**resp, field: v}) for v in vals]
    return out


def sweep_bad_values(url: str) -> dict[str, Any]:
    codes: dict[int, int] = {}
    wrong = []
    with httpx.Client(trust_env=False, timeout=60) as c:
        for path, body in bad_bodies():
            try:
                r = c.post(url + path, content=body if isinstance(body, bytes) else json.dumps(body).encode(),
                           headers={"Content-Type": "application/json"})
            except httpx.TransportError as e:
                wrong.append((path, str(body)[:80], "no answer", repr(e)))
                continue
            codes[r.status_code] = codes.get(r.status_code, 0) + 1
            try:
                shaped = set(r.json()["error"]) == {"message", "type", "param", "code"}
            except (ValueError, KeyError, TypeError):
                shaped = False
            if not 400 <= r.status_code < 500 or not shaped:
                wrong.append((path, str(body)[:80], r.status_code, r.text[:200]))
    return {"sent": sum(codes.values()), "codes": codes, "wrong": wrong}


# --------------------------------------------------------------------------------------------------
# 2. Mixed load
# --------------------------------------------------------------------------------------------------
GOOD_KINDS = ["chat-greedy", "chat-greedy-stream", "chat-seeded", "chat-seeded-stream", "comp-greedy",
              "comp-greedy-stream", "comp-seeded", "chat-tiny", "comp-stop", "chat-markup", "chat-json",
              "chat-json-stream", "chat-tools", "chat-n", "chat-logprobs-stream", "comp-logprobs"]
ALL_KINDS = GOOD_KINDS + ["bad", "leave-plain", "leave-stream"]


def good_request(kind: str, i: int) -> tuple[str, dict]:
    """The request of ``kind`` number ``i`` (a few distinct prompts per kind, so the oracle stays small)."""
    k = i % 5
    user = [{"role": "user", "content": f"Question {k}: tell me about item {k * 7}."}]
    if kind.startswith("chat"):
        body: dict[str, Any] = {"model": MODEL, "messages": user, "max_tokens": 24 + k}
        if "greedy" in kind:
            body["temperature"] = 0
        elif "seeded" in kind:
            body.update(temperature=0.9, top_p=0.9, seed=1000 + k)
        elif kind == "chat-tiny":
            body.update(temperature=1e-40, top_p=1e-50, seed=k)
        elif kind == "chat-markup":
            body["messages"] = user + [{"role": "assistant", "content": f"Let me see.{SHOWN}So 42."},
                                       {"role": "user", "content": f"And {k}?"}]
            body["temperature"] = 0
        elif kind.startswith("chat-json"):
            body.update(temperature=1.0, seed=k, max_tokens=120, response_format={"type": "json_schema", "json_schema": {
                "name": "r", "schema": {"type": "object", "properties": {"a": {"type": "string", "maxLength": 4},
                                                                         "b": {"enum": [1, "é", None]}},
                                        "required": ["a", "b"], "additionalProperties": False}}})
        elif kind == "chat-tools":
            body.update(temperature=1.0, seed=k, max_tokens=60, tool_choice="required", parallel_tool_calls=False,
                        tools=[{"type": "function", "function": {"name": "f", "parameters": {
                            "type": "object", "properties": {"x": {"enum": ["p", "q"]}}, "required": ["x"]}}}])
        elif kind == "chat-n":
            body.update(temperature=1.0, seed=k, n=3, max_tokens=10)
        elif kind == "chat-logprobs-stream":
            body.update(temperature=0.7, seed=k, logprobs=True, top_logprobs=2)
        path = "/v1/chat/completions"
    else:
        body = {"model": MODEL, "prompt": f"Once upon a time {k}", "max_tokens": 20 + k}
        if "greedy" in kind:
            body["temperature"] = 0
        elif kind == "comp-seeded":
            body.update(temperature=1.0, seed=2 ** 63 - 1 - k)
        elif kind == "comp-stop":
            body.update(temperature=0, stop=["e", "\n"])
        elif kind == "comp-logprobs":
            body.update(temperature=0.5, seed=k, logprobs=3)
        path = "/v1/completions"
    body["stream"] = kind.endswith("-stream")
    return path, body


def ask(c: httpx.Client, url: str, path: str, body: dict) -> tuple[int, str, str | None]:
    """``(status, text, finish_reason)`` of one request, streamed or not."""
    if not body.get("stream"):
        r = c.post(url + path, json=body)
        if r.status_code != 200:
            return r.status_code, r.text[:200], None
        chs = r.json()["choices"]
        text = "|".join(json.dumps([ch["message"]["content"], [c["function"] for c in ch["message"].get("tool_calls")
                                                                or []]])
                        if "message" in ch else ch["text"] for ch in chs)  # every choice; calls without their ids
        return 200, text, chs[0]["finish_reason"]
    text, finish = "", None
    with c.stream("POST", url + path, json=body) as r:
        if r.status_code != 200:
            return r.status_code, r.read().decode()[:200], None
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                return 500, json.dumps(ev)[:200], None
            if ev.get("choices"):
                ch = ev["choices"][0]
                text += (ch.get("delta") or {}).get("content") or ch.get("text") or ""
                finish = ch["finish_reason"] or finish
    if path.endswith("chat/completions"):  # as a plain answer shows it (streams here have no calls, one choice)
        text = json.dumps([text, []])
    return 200, text, finish


def leave(url: str, rng: random.Random, stream: bool) -> None:
    """A client that sends a long request and goes away at a random moment."""
    body = {"model": MODEL, "prompt": "Tell a long story", "max_tokens": 200, "temperature": 0.8, "stream": stream}
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    with socket.create_connection((host, int(port))) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        time.sleep(rng.uniform(0, 0.4))
        if rng.random() < 0.5:
            s.settimeout(0.2)
            try:
                s.recv(rng.randint(1, 4096))  # part of the answer (or of the stream) first
            except OSError:
                pass


def one(url: str, kind: str, i: int, oracle: dict, seed: int) -> tuple[str, bool, str]:
    try:
        return _one(url, kind, i, oracle, seed)
    except httpx.TransportError as e:
        return kind, False, f"no answer: {e!r}"


def _one(url: str, kind: str, i: int, oracle: dict, seed: int) -> tuple[str, bool, str]:
    rng = random.Random(seed * 100_003 + i)
    with httpx.Client(trust_env=False, timeout=120) as c:
        if kind == "bad":
            path, body = random.Random(i).choice(bad_bodies()[:-1])  # (not the 2 MiB one: it dominates the run)
            r = c.post(url + path, content=body if isinstance(body, bytes) else json.dumps(body).encode(),
                       headers={"Content-Type": "application/json"})
            return kind, 400 <= r.status_code < 500 and r.status_code != 429, f"{r.status_code}"
        if kind.startswith("leave"):
            leave(url, rng, kind.endswith("stream"))
            return kind, True, ""
        path, body = good_request(kind, i)
        got = ask(c, url, path, body)
        want = oracle[json.dumps([path, {**body, "stream": False}], sort_keys=True)]
        return kind, got[0] == 200 and got[1:] == want[1:], f"{got} vs {want}"


def slow_connections(url: str, n: int, until: float) -> dict[str, int]:
    """``n`` connections that trickle a body, trickle headers or stay silent; counts how many the server closed."""
    host, port = url.removeprefix("http://").split(":")
    socks = []
    for k in range(n):
        s = socket.create_connection((host, int(port)))
        if k % 3 == 0:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n{")
        elif k % 3 == 1:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        s.setblocking(False)
        socks.append(s)
    closed: set[int] = set()
    while time.monotonic() < until and len(closed) < n:
        for k, s in enumerate(socks):
            if k in closed:
                continue
            try:
                while s.recv(65536):
                    pass
                closed.add(k)
                continue
            except BlockingIOError:
                pass
            except OSError:
                closed.add(k)
                continue
            try:
                s.send([b" ", b"X-Slow: 1\r\n", b""][k % 3])
            except OSError:
                pass
        time.sleep(0.5)
    for s in socks:
        s.close()
    return {"opened": n, "closed_by_server": len(closed)}


# --------------------------------------------------------------------------------------------------
# 4. Hostile schemas, paths and headers beside normal load (issue 37, items 1-10)
# --------------------------------------------------------------------------------------------------
KEY = "sweep-key-0123456789"
MAX_MESSAGE = 1024  # bytes an error message may have
CALL_HEAD = '{"name": "f", "arguments": '  # how every call to CALLER's function starts
CALLER = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}}}]
INJECT = "%22%7D%209999%0Almforge_fake_metric%7Bx%3D%22"  # '"} 9999\nlmforge_fake_metric{x="'

HEALTH_POLLER = r"""
import http.client, json, select, sys, time
host, port, out = sys.argv[1], int(sys.argv[2]), []
while not select.select([sys.stdin], [], [], 0)[0]:  # until the parent closes stdin
    t0 = time.monotonic()
    conn = http.client.HTTPConnection(host, port, timeout=30)
    try:
        conn.request("GET", "/health")
        r = conn.getresponse()
        r.read()
        status = r.status
    except OSError:
        status = 0
    out.append((t0, time.monotonic() - t0, status))
    conn.close()
    time.sleep(0.01)
print(json.dumps(out))
"""
"""A separate process polls ``/health`` every 10 ms (the sweep's own threads must not delay it), on a new
connection each time (on a kept-alive one every answer waits ~40 ms for the client's delayed ACK, see
:func:`keep_alive_ms`), and prints ``[(start, seconds, status), ...]`` (``time.monotonic``, the same clock here)."""


def keep_alive_ms(url: str, n: int = 30) -> tuple[float, float]:
    """Median ``/health`` latency (ms) on one kept-alive connection and on a new connection per request. A
    server socket without ``TCP_NODELAY`` holds each answer's second write (uvicorn writes head and body
    apart) until the client ACKs the first, which a kept-alive client delays by up to 40 ms."""
    host, port = url.removeprefix("http://").split(":")
    out = []
    for fresh in (False, True):
        conn, lat = http.client.HTTPConnection(host, int(port), timeout=30), []
        for _ in range(n):
            if fresh:
                conn.close()
                conn = http.client.HTTPConnection(host, int(port), timeout=30)
            t0 = time.perf_counter()
            conn.request("GET", "/health")
            conn.getresponse().read()
            lat.append(time.perf_counter() - t0)
            time.sleep(0.01)
        conn.close()
        out.append(1000 * sorted(lat)[n // 2])
    return out[0], out[1]


@dataclass
class Hostile:
    """One hostile request and what must come back: a status in ``want`` (empty: any 4xx); a 4xx in the OpenAI
    shape, its message under :data:`MAX_MESSAGE` bytes and naming ``param`` when given; never a CORS grant.
    ``check(body)`` says what is wrong with a 200 (None: nothing). ``compiles``: its schema reaches the compiler
    (``/health`` is timed against these). ``keyed``: sent to the server started with ``--api-key``."""

    name: str
    path: str
    body: bytes | None = None
    want: tuple[int, ...] = ()
    headers: dict[str, str] = dc_field(default_factory=dict)
    method: str = "POST"
    param: str | None = None
    compiles: bool = False
    check: Callable[[bytes], str | None] | None = None
    keyed: bool = False


def _rf(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def ref_chain(n: int, arrays: bool = False) -> dict[str, Any]:
    """Item 1's crash schema: ``n`` definitions, each a ``$ref`` to the next (or an array of the next)."""
    defs: dict[str, Any] = {f"d{i}": {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}} if arrays
                            else {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def patterns(n: int, tag: str = "") -> dict[str, Any]:
    """``n`` required string properties, each with its own pattern (item 2: 5,000 of them froze the server)."""
    return {"type": "object", "required": [f"p{i}" for i in range(n)], "properties": {
        f"p{i}": {"type": "string", "pattern": f"^([a-z]{{1,20}}@[a-z0-9]{{{i % 7 + 2},20}}\\.(com|org|n{i}{tag}))$"}
        for i in range(n)}}


def enum_schema(k: int, values: int, width: int) -> dict[str, Any]:
    """Item 3: distinct (by ``k``) enums of ``values`` strings of ``width`` letters."""
    return {"enum": ["".join(chr(97 + (i * j + k) % 26) for j in range(width)) + f"-{k}-{i}" for i in range(values)]}


def hostile_schemas() -> list[tuple[str, Any, int]]:
    """``(name, schema, want)``: items 1, 2, 4 and 5 and variants (``want``: 400, or 200 for a slow compile that
    is within the limits)."""
    no_doc = [("self-ref", {"$ref": "#"}),
              ("mutual-defs", {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}),
              ("mutual-3", {"$defs": {"a": {"allOf": [{"$ref": "#/$defs/b"}]}, "b": {"anyOf": [{"$ref": "#/$defs/c"}]},
                                      "c": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}),
              ("required-self", {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}),
              ("array-of-self", {"type": "array", "items": {"$ref": "#"}, "minItems": 1}),
              ("false", {"type": "object", "properties": {"a": False}, "required": ["a"]})]
    nested: Any = {"type": "integer"}
    for _ in range(300):
        nested = {"type": "array", "items": nested}
    out = [("ref-chain-3000", ref_chain(3000), 400), ("ref-chain-2500", ref_chain(2500), 400),
           ("ref-chain-129", ref_chain(129), 400), ("array-refs-2000", ref_chain(2000, arrays=True), 400),
           ("array-refs-1100", ref_chain(1100, arrays=True), 400), ("inline-arrays-300", nested, 400),
           ("props-13000", {"type": "object", "properties": {f"p{i}": {"type": "integer"}
                                                             for i in range(13_000)}}, 400),
           ("patterns-5000", patterns(5000), 400), ("props-1001", {"type": "object", "properties": {
               f"p{i}": {} for i in range(1001)}}, 400),
           ("anyof-6000", {"anyOf": [{"const": i} for i in range(6000)]}, 400),
           ("enum-5000", enum_schema(0, 5000, 60), 400),
           ("remote-ref", {"$ref": "http://evil.example/s.json"}, 400),
           ("file-ref", {"$ref": "file:///etc/passwd"}, 400),
           ("pattern-props-900", {"type": "object", "patternProperties": {  # a compile over the 10 s deadline
               f"^p{i}[a-z]{{1,20}}$": {"type": "integer"} for i in range(900)}}, 400)]
    out += [(name, s, 400) for name, s in no_doc]
    out += [(f"optional-{n}", {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}}, 400)
            for n in (500, 800, 1000)]  # compile, then fail at the first token (a 500 before)
    out += [(f"patterns-1000-{k}", patterns(1000, tag=f"s{k}"), 200) for k in range(4)]  # slow, within the limits
    return out


def _chat(**kw: Any) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kw}).encode()


def _comp(**kw: Any) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 4, **kw}).encode()


def _cut_call(body: bytes) -> str | None:
    """Item 10: a reply cut by max_tokens inside a required call returns the call's text so far, finish length."""
    if body.startswith(b"data: "):
        chunks = [json.loads(x[6:]) for x in body.decode().splitlines() if x.startswith("data: {")]
        chs = [c["choices"][0] for c in chunks if c.get("choices")]
        text = "".join(ch["delta"].get("content") or "" for ch in chs)
        calls = [ch for ch in chs if ch["delta"].get("tool_calls")]
        finish = [ch["finish_reason"] for ch in chs if ch["finish_reason"]]
    else:
        ch = json.loads(body)["choices"][0]
        text, calls, finish = ch["message"]["content"] or "", ch["message"].get("tool_calls"), [ch["finish_reason"]]
    if finish != ["length"] or calls or not text or not (CALL_HEAD.startswith(text) or text.startswith(CALL_HEAD)):
        return f"cut call: content {text[:80]!r}, calls {calls!r:.80}, finish {finish}"
    return None


def hostile_requests(port: int, seed: int) -> list[Hostile]:
    """Every variant of items 1-10 (see each group's comment)."""
    rng = random.Random(seed)
    out: list[Hostile] = []
    chat, comp = "/v1/chat/completions", "/v1/completions"
    # items 1, 2, 4, 5: each schema in response_format and as a function's parameters
    for name, schema, want in hostile_schemas():
        params = {"type": "object", **schema} if "type" not in schema else schema
        out.append(Hostile(f"schema:{name}:response_format", chat, _chat(max_tokens=2, response_format=_rf(schema)),
                           (want,), param="response_format.json_schema.schema" if want == 400 else None,
                           compiles=True))
        out.append(Hostile(f"schema:{name}:tools", chat, _chat(max_tokens=2, tools=[{"type": "function", "function": {
            "name": "g", "parameters": params}}], tool_choice="required"), (400,),  # (a usable one: its prompt
            param="tools.0.function.parameters" if want == 400 else "messages", compiles=True))  # is too long)
    # item 3: 40 distinct ~350 KB enum schemas (over the limits now), sent beside the RSS check's accepted ones
    for k in range(40):
        values, width = (4000, 80) if k % 2 else (2000, 170)  # over max_enum, or over max_bytes
        out.append(Hostile(f"enum-350KB:{k}", chat, _chat(response_format=_rf(enum_schema(1000 + k, values, width))),
                           (400,), param="response_format.json_schema.schema", compiles=True))
    # item 6: 2,000 distinct 404 paths per server (no key; --api-key, with and without it), label injection
    kinds = ["/static/{}", "/v1/models/{}", "/{}", "/v1/{}/x", "/{}/{}%0A"]
    for keyed in (False, True):
        for k in range(2000):
            word = f"{rng.getrandbits(40):x}" + rng.choice(["", "%22", "%7D", "%0A", "%20x", "~", "%C3%A9"])
            path = rng.choice(kinds).format(word, k)
            with_key = keyed and k % 2 == 0
            want = (401, 404, 405) if keyed and not with_key else (404, 405)  # (no route: 404 before the key)
            out.append(Hostile(f"404{'-keyed' if keyed else ''}:{path}", path, None, want, method=rng.choice(
                ["GET"] * 6 + ["DELETE", "PUT"]), headers={"Authorization": f"Bearer {KEY}"} if with_key else {},
                keyed=keyed))
        for path in (f"/static/{INJECT}", f"/v1/models/{INJECT}", f"/{INJECT}", f"/v1/{INJECT}/x"):
            want = (401, 404) if keyed else (404,)
            out.append(Hostile(f"inject{'-keyed' if keyed else ''}:{path}", path, None, want, method="GET",
                               keyed=keyed))
        for path in ("/static/" + "a" * 8000, "/v1/models/" + "a" * 8000, "/" + "a/" * 4000):  # long paths
            want = (401, 404) if keyed else (404,)
            out.append(Hostile(f"long-path{'-keyed' if keyed else ''}:{path[:20]}", path, None, want, method="GET",
                               keyed=keyed))
    # item 7: cross-origin simple requests (text/plain and friends) and DNS rebinding (a Host naming another site)
    crash = _chat(response_format=_rf(ref_chain(3000)))
    for path, body in ((chat, crash), (comp, _comp()), ("/v1/embeddings", b'{"model": "sweep", "input": "x"}'),
                       ("/tokenize", b'{"prompt": "x"}'), ("/detokenize", b'{"tokens": [1]}')):
        for kind in ("text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                     "multipart/form-data; boundary=x", "application/jsonx", "text/plain; application/json", None):
            out.append(Hostile(f"content-type:{path}:{kind}", path, body, (415,),
                               headers={"Content-Type": kind, "Origin": "http://evil.example"}))
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.nip.io", "localhost.evil.example", "évil",
                 "a" * 5000, "0x7f.1", "2130706433", "[::ffff:evil]", f"localhost:{port}:{port}"):
        for path, body, method in (("/health", None, "GET"), ("/v1/models", None, "GET"), (chat, _chat(), "POST"),
                                   ("/metrics", None, "GET")):
            out.append(Hostile(f"host:{host[:30]}:{path}", path, body, (400,), method=method, param="Host",
                               headers={"Host": host, "Origin": f"http://{host[:30]}"}))
    for host in ("localhost", f"127.0.0.1:{port}", f"[::1]:{port}", "LOCALHOST."):
        out.append(Hostile(f"host-ok:{host}", chat, _chat(), (200,), headers={"Host": host}))
    out.append(Hostile("preflight", chat, None, (405,), method="OPTIONS", headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"}))
    # item 8: malformed numbers and lone surrogates
    digits = "9" * 5000
    raw = [(chat, _chat()[:-1] + f', "max_tokens": {digits}}}'.encode()),
           (comp, _comp()[:-1] + f', "max_tokens": {digits}}}'.encode())]
    for field in ("max_tokens", "n", "seed", "temperature", "top_p", "logprobs"):
        raw.append((comp, _comp()[:-1] + f', "{field}": {"9" * 4000}}}'.encode()))
        raw.append((comp, _comp()[:-1] + f', "{field}": -{"9" * 4000}}}'.encode()))
    for field in ("max_tokens", "n", "seed", "temperature", "top_p"):
        for v in ("NaN", "Infinity", "-Infinity", "1e999"):
            raw.append((chat, _chat()[:-1] + f', "{field}": {v}}}'.encode()))
    raw += [(chat, _chat()[:-1] + b', "logprobs": true, "top_logprobs": ' + b"9" * 4000 + b"}"),
            (chat, _chat()[:-1] + b', "response_format": {"type": "json_schema", "json_schema": {"name": "x", '
                                  b'"schema": {"type": "integer", "maximum": ' + b"9" * 4000 + b"}}}}"),
            (chat, _chat()[:-1] + b', "response_format": {"type": "json_schema", "json_schema": {"name": "x", '
                                  b'"schema": {"type": "number", "minimum": NaN}}}}'),
            ("/detokenize", b'{"tokens": [' + b"9" * 4000 + b"]}"),
            ("/v1/embeddings", b'{"model": "sweep", "input": [' + b"9" * 4000 + b"]}"),
            ("/v1/embeddings", b'{"model": "sweep", "input": [-1]}')]
    out += [Hostile(f"number:{path}:{body[-60:].decode()[:40]}", path, body) for path, body in raw]
    out.append(Hostile("number:/v1/embeddings:[5, 6]", "/v1/embeddings", b'{"model": "sweep", "input": [5, 6]}',
                       (200,)))  # (one input as token ids, as OpenAI's API takes it)
    s = "\ud800"
    lone = [(chat, _chat(structured_outputs={"choice": ["a" + s]}), "structured_outputs.choice"),
            (chat, _chat(structured_outputs={"regex": "a" + s}), "structured_outputs.regex"),
            (chat, _chat(messages=[{"role": "user", "content": s}]), None), (comp, _comp(prompt=s), "prompt"),
            (comp, _comp(stop=[s]), "stop"), (chat, _chat(stop=s), "stop"),
            (chat, _chat(response_format=_rf({"enum": ["a" + s]})), "response_format.json_schema.schema"),
            (chat, _chat(response_format=_rf({"const": s})), "response_format.json_schema.schema"),
            (chat, _chat(response_format=_rf({"type": "string", "pattern": s})), "response_format.json_schema.schema"),
            (chat, _chat(response_format={"type": "json_schema", "json_schema": {"name": s, "schema": {}}}), None),
            (chat, _chat(tools=[{"type": "function", "function": {"name": s}}]), None),
            (chat, _chat(tools=[{"type": "function", "function": {"name": "f", "description": s}}]), None),
            (chat, _chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {
                "type": "object", "properties": {s: {"type": "integer"}}}}}]), "tools.0.function.parameters"),
            ("/tokenize", json.dumps({"prompt": s}).encode(), None),
            ("/v1/embeddings", json.dumps({"model": MODEL, "input": [s]}).encode(), None)]
    out += [Hostile(f"surrogate:{path}:{body[40:100].decode()}", path, body, param=param) for path, body, param in lone]
    out.append(Hostile("surrogate:user (ignored)", chat, _chat(user=s), (200,)))
    out += [Hostile(f"long-value:{path}", path, body, (404,), param="model") for path, body in (  # echoed back?
        (chat, _chat(model="m" * 100_000)), (comp, _comp(model="m" * 100_000)))]
    # item 9: parameters that change the answer, refused by name
    refused = [(chat, {"logit_bias": {"65": 100}}, "logit_bias"), (comp, {"logit_bias": {"65": -100}}, "logit_bias"),
               (chat, {"presence_penalty": 0.5}, "presence_penalty"),
               (comp, {"frequency_penalty": -1}, "frequency_penalty"),
               (comp, {"response_format": {"type": "json_object"}}, "response_format"),
               (comp, {"response_format": _rf({"type": "integer"})}, "response_format"),
               (comp, {"logprobs": True}, "logprobs"), (comp, {"best_of": 3}, "best_of"),
               (comp, {"suffix": "x"}, "suffix"), (comp, {"echo": True}, "echo"),
               (chat, {"response_format": {"type": "json_object"}, "stop": ["{"]}, "stop"),
               (chat, {"structured_outputs": {"choice": ["a", "b"]}, "stop": "a"}, "stop"),
               (chat, {"tools": [{"type": "function", "function": {"name": "s", "parameters": {"type": "string"}}}]},
                "tools.0.function.parameters")]
    out += [Hostile(f"refused:{path}:{param}", path, (_chat if path == chat else _comp)(**kw), (400,), param=param)
            for path, kw, param in refused]
    # item 10: a reply cut by max_tokens inside a required call returns the call's text so far
    for k, n in enumerate((3, 5, 9, 17, 30)):
        for stream in (False, True):
            out.append(Hostile(f"cut-call:{n}{':stream' if stream else ''}", chat, _chat(
                max_tokens=n, temperature=1.0, seed=k, tools=CALLER, tool_choice="required", stream=stream), (200,),
                check=_cut_call))
    return out


class Sender:
    """One thread's keep-alive connection per server: sends :class:`Hostile` requests and judges the answers. A
    connection the server drops after an answer without ``Connection: close`` is a failure (item 8)."""

    def __init__(self, urls: dict[bool, str]) -> None:
        self.urls, self.conns, self.last = urls, {}, {}

    def _conn(self, keyed: bool) -> http.client.HTTPConnection:
        if keyed not in self.conns:
            host, port = self.urls[keyed].removeprefix("http://").split(":")
            self.conns[keyed] = http.client.HTTPConnection(host, int(port), timeout=120)
        return self.conns[keyed]

    def send(self, h: Hostile) -> tuple[int, str | None, float, float]:
        """``(status, what is wrong or None, start, end)``."""
        headers = {"Content-Type": "application/json"} if h.body is not None else {}
        headers.update(h.headers)
        headers = {k: v for k, v in headers.items() if v is not None}
        if h.body is not None:
            headers["Content-Length"] = str(len(h.body))
        t0 = time.monotonic()
        for attempt in range(2):
            c = self._conn(h.keyed)
            try:
                c.putrequest(h.method, h.path, skip_host="Host" in headers, skip_accept_encoding=True)
                for k, v in headers.items():
                    c.putheader(k, v.encode("utf-8") if isinstance(v, str) else v)
                c.endheaders(h.body)
                r = c.getresponse()
                data = r.read()
                break
            except (http.client.HTTPException, OSError) as e:
                c.close()
                del self.conns[h.keyed]
                prev = self.last.get(h.keyed)
                if attempt == 0 and prev is not None and time.monotonic() - prev[1] < 3:  # (keep-alive lasts 5 s)
                    return 0, f"the connection was dropped after answering {prev[0]!r} ({e!r})", t0, time.monotonic()
                if attempt == 1:
                    return 0, f"no answer: {e!r}", t0, time.monotonic()
        t1 = time.monotonic()
        if (r.getheader("connection") or "").lower() == "close":
            c.close()
            del self.conns[h.keyed]
            self.last.pop(h.keyed, None)
        else:
            self.last[h.keyed] = (h.name, t1)
        return r.status, self.judge(h, r, data), t0, t1

    @staticmethod
    def judge(h: Hostile, r: http.client.HTTPResponse, data: bytes) -> str | None:
        cors = [k for k, _ in r.getheaders() if k.lower().startswith("access-control-allow")]
        if cors:
            return f"a CORS grant {cors}"
        if (r.status not in h.want) if h.want else not 400 <= r.status < 500:
            return f"status {r.status} (want {h.want or '4xx'}): {data[:200]!r}"
        if r.status == 200:
            return h.check(data) if h.check is not None else None
        try:
            err = json.loads(data)["error"]
            assert set(err) == {"message", "type", "param", "code"}
        except (ValueError, KeyError, TypeError, AssertionError):
            return f"not an OpenAI error: {data[:200]!r}"
        size = len(err["message"].encode("utf-8", "replace"))
        if size >= MAX_MESSAGE:
            return f"a {size:,}-byte message: {err['message'][:120]!r}..."
        if h.param is not None and err["param"] != h.param:
            return f"param {err['param']!r}, want {h.param!r}: {err['message'][:150]!r}"
        return None


FAMILIES = {"lmforge_requests", "lmforge_prompt_tokens", "lmforge_generation_tokens", "lmforge_requests_running",
            "lmforge_requests_waiting", "lmforge_time_to_first_token_seconds", "lmforge_inter_token_latency_seconds",
            "lmforge_prefix_cache_queries", "lmforge_prefix_cache_hits", "lmforge_prefix_cache_query_tokens",
            "lmforge_prefix_cache_hit_tokens", "lmforge_prefix_cache_bytes", "lmforge_speculative_passes",
            "lmforge_speculative_drafted_tokens", "lmforge_speculative_accepted_tokens",
            "lmforge_prefix_cache_evicted_blocks", "lmforge_responses_stored", "lmforge_responses_stored_bytes"}


def metrics_series(url: str, headers: dict[str, str]) -> tuple[int, int, list[str]]:
    """``(request series, all samples, what is wrong)`` of ``/metrics``, parsed by prometheus_client's own
    parser: every family must be one of :data:`FAMILIES` (no injected sample)."""
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(url + "/metrics", headers=headers, trust_env=False, timeout=30)
    if r.status_code != 200:
        return 0, 0, [f"/metrics: {r.status_code}"]
    wrong = [f"/metrics line {line[:80]!r}" for line in r.text.splitlines() if line.startswith("lmforge_fake")]
    samples, series = 0, 0
    try:
        for fam in text_string_to_metric_families(r.text):
            if fam.name.removesuffix("_created") not in FAMILIES:  # (the parser lists each _created apart)
                wrong.append(f"/metrics family {fam.name!r}")
            samples += len(fam.samples)
            series += sum(s.name == "lmforge_requests_total" for s in fam.samples)
    except ValueError as e:
        wrong.append(f"/metrics does not parse: {e}")
    return series, samples, wrong


def tree_rss_mib(pid: int) -> tuple[float, float]:
    """``(the process's RSS, its children's)`` in MiB (the children: the grammar check process)."""
    child = 0.0
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                child += rss_mib(int(d.name))
        except (OSError, RuntimeError, IndexError, ValueError):
            pass  # (gone meanwhile)
    return rss_mib(pid), child


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def hostile_phase(p: subprocess.Popen, url: str, keyed_url: str, oracle: dict, seed: int) -> list[str]:
    """Items 1-10 and their variants at both servers from 4 threads, with 3 threads of normal requests (each
    checked against its alone-answer) and the ``/health`` poller alongside; then 48 distinct enum schemas within
    the limits (the compiled-grammar cache's memory bound) and the ``/metrics`` checks."""
    failures: list[str] = []
    host, port = url.removeprefix("http://").split(":")

    def poll() -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", HEALTH_POLLER, host, port], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)

    idle = poll()  # the baseline: the same poller with no other request running
    time.sleep(5)
    idle_lat = [lat for _, lat, _ in json.loads(idle.communicate(timeout=60)[0])]
    poller = poll()
    stop = threading.Event()
    normal: list[tuple[str, bool, str]] = []

    def load(t: int) -> None:
        i = 0
        while not stop.is_set():
            normal.append(one(url, GOOD_KINDS[(i + t) % len(GOOD_KINDS)], i, oracle, seed))
            i += 1

    loaders = [threading.Thread(target=load, args=(t,)) for t in range(3)]
    for t in loaders:
        t.start()
    auth = {"Authorization": f"Bearer {KEY}"}
    series0 = {k: metrics_series(u, auth)[0] for k, u in ((False, url), (True, keyed_url))}
    rss0 = tree_rss_mib(p.pid)
    cases = hostile_requests(int(port), seed)
    rng = random.Random(seed)
    rng.shuffle(cases)
    windows: list[tuple[float, float, str]] = []  # (start, end, name) of each request whose schema compiles
    results: dict[str, list[int]] = {}
    local = threading.local()
    t0 = time.monotonic()

    def fire(h: Hostile) -> tuple[Hostile, int, str | None]:
        if not hasattr(local, "sender"):
            local.sender = Sender({False: url, True: keyed_url})
        status, wrong, a, b = local.sender.send(h)
        if h.compiles:
            windows.append((a, b, h.name))
        return h, status, wrong

    with ThreadPoolExecutor(4) as pool:
        for h, status, wrong in pool.map(fire, cases):
            group = h.name.split(":")[0].removesuffix("-keyed")
            results.setdefault(group, [0, 0])[0 if wrong is None else 1] += 1
            if wrong is not None:
                failures.append(f"hostile {h.name[:70]!r}: {wrong}")
    hostile_s = time.monotonic() - t0
    rss1 = tree_rss_mib(p.pid)

    # item 3: distinct enum schemas within the limits (~190 KB each): compiled and cached
    enums = [Hostile(f"enum-190KB:{k}", "/v1/chat/completions", _chat(
        max_tokens=8, temperature=1.0, seed=k, response_format=_rf(enum_schema(k, 2000, 84))), (200,), compiles=True)
        for k in range(48)]
    rss_steps = [rss1]
    for k in range(0, len(enums), 8):
        with ThreadPoolExecutor(2) as pool:
            for h, status, wrong in pool.map(fire, enums[k:k + 8]):
                results.setdefault("enum-190KB", [0, 0])[0 if wrong is None else 1] += 1
                if wrong is not None:
                    failures.append(f"hostile {h.name!r}: {wrong}")
        rss_steps.append(tree_rss_mib(p.pid))
    stop.set()
    for t in loaders:
        t.join()
    polls = json.loads(poller.communicate(timeout=60)[0])  # (closing its stdin stops it)
    kept, fresh = keep_alive_ms(url)

    print(f"hostile: {len(cases)} requests in {hostile_s:.1f} s, then {len(enums)} enum schemas within the limits")
    for group, (ok, bad) in sorted(results.items()):
        print(f"  {group:>14}: {ok}/{ok + bad} answered as required")
    good = sum(ok for _, ok, _ in normal)
    print(f"  normal requests alongside: answered as alone {good}/{len(normal)}")
    failures += [f"alongside: {kind}: {detail[:300]}" for kind, ok, detail in normal if not ok]
    if not normal:
        failures.append("no normal request ran alongside")

    def overlapping(start: float, lat: float) -> list[str]:
        return [name for a, b, name in windows if a <= start + lat and start <= b]

    inside = [bool(overlapping(start, lat)) for start, lat, _ in polls]
    during = [lat for (_, lat, _), x in zip(polls, inside) if x]
    outside = [lat for (_, lat, _), x in zip(polls, inside) if not x]
    not_ok = sum(status != 200 for _, _, status in polls)

    def stats(xs: list[float]) -> str:
        over = sum(x >= 0.1 for x in xs)
        return (f"{len(xs)} polls, max {1000 * max(xs, default=float('nan')):.1f} ms, p99 {1000 * _pct(xs, 0.99):.1f}"
                f", median {1000 * _pct(xs, 0.5):.1f}, {over} over 100 ms")

    print(f"  /health ({not_ok} polls not 200): during compiles {stats(during)}; outside compiles (normal load) "
          f"{stats(outside)}; idle before the phase {stats(idle_lat)}")
    print(f"  /health on one kept-alive connection: median {kept:.1f} ms (a new connection each time: {fresh:.1f} ms)")
    if not_ok or len(during) < 20:
        failures.append(f"/health: {not_ok} polls failed, {len(during)} during compiles")
    for start, lat, _ in polls:
        if lat >= 0.1:
            print(f"    /health took {1000 * lat:.0f} ms at {start - t0:+.1f} s, beside {overlapping(start, lat)[:4]}")
    if during and max(during) >= 0.1:
        failures.append(f"/health took {1000 * max(during):.0f} ms during a compile (limit 100 ms); slowest "
                        f"{[round(1000 * x) for x in sorted(during)[-5:]]} ms (the same poller's max outside compiles: "
                        f"{1000 * max(outside, default=0):.0f} ms, idle: {1000 * max(idle_lat, default=0):.0f} ms)")
    if kept > 20:
        failures.append(f"a kept-alive connection waits {kept:.0f} ms per answer (a new one {fresh:.0f} ms): the "
                        "server's sockets lack TCP_NODELAY (serve/server.py bind() makes its socket with proto 0, so "
                        "asyncio does not set it), and each answer's second write waits for a delayed ACK")

    steps = ", ".join(f"{a:.0f}+{b:.0f}" for a, b in rss_steps)
    growth = sum(rss_steps[-1]) - sum(rss0)
    print(f"  RSS (server+grammar check, MiB): before {rss0[0]:.0f}+{rss0[1]:.0f}, after the hostile requests "
          f"(40 x 350 KB enums among them) {rss1[0]:.0f}+{rss1[1]:.0f}, every 8 accepted ~190 KB enums: {steps}; "
          f"growth {growth:+.0f} MiB")
    if growth > 256:  # the grammar cache's bound
        failures.append(f"RSS grew by {growth:.0f} MiB over the hostile phase")

    for keyed, u in ((False, url), (True, keyed_url)):
        series, samples, wrong = metrics_series(u, auth)
        name = "--api-key" if keyed else "no key"
        print(f"  /metrics ({name}): lmforge_requests_total series {series0[keyed]} -> {series} after 2,000 "
              f"distinct 404 paths and 4 injections; {samples} samples in all")
        failures += [f"{name}: {w}" for w in wrong]
        if series > 40:
            failures.append(f"{name}: {series} request series after the 404 flood")
    r = httpx.get(keyed_url + "/metrics", trust_env=False, timeout=30)
    if r.status_code != 401:
        failures.append(f"/metrics without the key: {r.status_code}")
    if p.poll() is not None:
        failures.append(f"the server exited during the hostile phase: {p.returncode}")
    return failures


def mixed_rounds(p: subprocess.Popen, url: str, oracle: dict, rss: list[float],
                 args: argparse.Namespace) -> list[str]:
    """Phase 2: ``--rounds`` rounds of mixed load (300 slow connections beside the first); ``rss`` holds the
    RSS after the oracle and gets one entry per round."""
    failures: list[str] = []
    rng = random.Random(args.seed)
    slow: dict[str, int] = {}
    for rnd in range(args.rounds):
        kinds = [rng.choice(ALL_KINDS) for _ in range(args.requests)]
        slow_thread = None
        if rnd == 0:  # 300 slow connections beside the first round (closed within the 10 s / 30 s deadlines)
            slow_thread = threading.Thread(target=lambda: slow.update(slow_connections(url, 300,
                                                                                      time.monotonic() + 45)))
            slow_thread.start()
        t0 = time.monotonic()
        with ThreadPoolExecutor(24) as pool:
            results = list(pool.map(lambda a: one(url, a[1], a[0], oracle, args.seed * 1000 + rnd),
                                    enumerate(kinds)))
        wall = time.monotonic() - t0
        if slow_thread is not None:
            slow_thread.join()
        t1 = time.monotonic()
        while (h := httpx.get(url + "/health", trust_env=False).json())["active"] or h["waiting"]:
            if time.monotonic() - t1 > 5:
                failures.append(f"round {rnd}: /health did not return to idle: {h}")
                break
            time.sleep(0.05)
        rss.append(rss_mib(p.pid))
        by_kind: dict[str, list[int]] = {}
        for kind, ok, detail in results:
            by_kind.setdefault(kind, [0, 0])[0 if ok else 1] += 1
            if not ok:
                failures.append(f"round {rnd}: {kind}: {detail}")
        good = sum(v[0] for k, v in by_kind.items() if k in GOOD_KINDS)
        n_good = sum(sum(v) for k, v in by_kind.items() if k in GOOD_KINDS)
        print(f"round {rnd}: {len(kinds)} requests in {wall:.1f} s; answered as alone {good}/{n_good}; bad "
              f"values a 4xx {by_kind.get('bad', [0, 0])[0]}/{sum(by_kind.get('bad', [0, 0]))}; clients that "
              f"left {sum(by_kind.get('leave-plain', [0])) + sum(by_kind.get('leave-stream', [0]))}; "
              f"/health after: active {h['active']}, waiting {h['waiting']}; RSS {rss[-1]:.0f} MiB")
    print(f"slow connections: {slow}")
    if slow.get("closed_by_server") != slow.get("opened"):
        failures.append(f"slow connections left open: {slow}")
    growth = rss[-1] - rss[1]
    print(f"RSS (MiB): after the oracle {rss[0]:.0f}, after each round {', '.join(f'{x:.0f}' for x in rss[1:])}; "
          f"growth from round 1 to round {args.rounds}: {growth:+.1f} MiB")
    if growth > 20:
        failures.append(f"RSS grew by {growth:.1f} MiB from round 1 to round {args.rounds}")
    return failures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--phases", default="bad,rounds,hostile,tenancy",
                    help="which of bad, rounds, hostile, tenancy to run")
    args = ap.parse_args()
    phases = set(args.phases.split(","))
    tmp = Path(tempfile.mkdtemp(prefix="lmforge-sweep-"))
    run = random_chat_run(tmp / MODEL, context_length=512)
    p, url = start(run, tmp / "server.stderr")
    failures: list[str] = []
    try:
        if "bad" in phases:
            t0 = time.monotonic()
            bad = sweep_bad_values(url)
            print(f"bad values: {bad['sent']} requests, status codes {dict(sorted(bad['codes'].items()))}, "
                  f"{len(bad['wrong'])} not a 4xx in the OpenAI shape ({time.monotonic() - t0:.1f} s)")
            failures += [f"bad value answered wrongly: {w}" for w in bad["wrong"]]

        oracle = {}  # each distinct good request, sent alone
        with httpx.Client(trust_env=False, timeout=120) as c:
            for kind in GOOD_KINDS:
                for i in range(5):
                    path, body = good_request(kind, i)
                    key = json.dumps([path, {**body, "stream": False}], sort_keys=True)
                    if key not in oracle:
                        oracle[key] = ask(c, url, path, {**body, "stream": False})
                        if oracle[key][0] != 200:
                            failures.append(f"alone: {kind} {i} -> {oracle[key]}")
        rss = [rss_mib(p.pid)]
        print(f"oracle: {len(oracle)} distinct requests answered alone; RSS {rss[0]:.0f} MiB")

        if "rounds" in phases:
            failures += mixed_rounds(p, url, oracle, rss, args)
        if "hostile" in phases:
            keyed, keyed_url = start(run, tmp / "keyed-server.stderr", "--api-key", KEY)
            try:
                failures += hostile_phase(p, url, keyed_url, oracle, args.seed)
                if keyed.poll() is not None:
                    failures.append(f"the --api-key server exited: {keyed.returncode}")
            finally:
                stop_server(keyed)
        if "tenancy" in phases:
            failures += tenancy_phase(run, tmp, start, stop_server, rss_mib, args.seed)
        if p.poll() is not None:
            failures.append(f"the server exited: {p.returncode}")
    finally:
        stop_server(p)
    err = (tmp / "server.stderr").read_text()
    err_keyed = (tmp / "keyed-server.stderr").read_text() if (tmp / "keyed-server.stderr").exists() else ""
    tracebacks = err.count("Traceback") + err_keyed.count("Traceback")
    print(f"server stderr: {len(err.splitlines())} + {len(err_keyed.splitlines())} lines (the --api-key server), "
          f"{tracebacks} tracebacks ({tmp / 'server.stderr'})")
    if tracebacks:
        failures.append(f"{tracebacks} tracebacks in the server's log")
    for f in failures[:60]:
        print("FAIL", f)
    print("OK" if not failures else f"{len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
