"""A hostile-client sweep of a real ``lmforge serve`` (run by hand, not part of the suite: about two minutes).

    .venv/bin/python tests/serve/hostile_sweep.py [--requests 200] [--seed 0]

It starts the real command on a small random chat model, then:

1. bad values in every request field (chat and completions): each must be a 4xx in the OpenAI shape, never a
   500, and the server must stay up;
2. rounds of ``--requests`` mixed requests from 24 threads at once: greedy and seeded chat and completions,
   streamed or not, tiny sampling values, stop strings, calculator markup sent back, bad values, and clients
   that disconnect at random moments (queued, mid-stream, mid-wait); while the first round runs, 300 slow
   connections (trickled bodies, trickled headers, silent) are opened;
3. checks that every request that was not meant to fail got exactly the answer it gets alone (the oracle: the
   same request sent alone before the sweep), that no request got a 5xx or a 429, that ``/health`` returns
   to ``active 0, waiting 0``, that the slow connections were all closed, and that the server's RSS is flat
   from round to round.

It prints the figures and exits 1 if any check fails.
"""

from __future__ import annotations

import argparse
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
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parents[1]))
from serve_helpers import NO_PROXY, random_chat_run  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MODEL = "sweep"
SHOWN = "<calculator>6*7</calculator><output>42</output>"


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def start(run: Path) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, NO_PROXY=NO_PROXY, no_proxy=NO_PROXY)
    p = subprocess.Popen([sys.executable, "-m", "lmforge.cli", "serve", "--run", str(run), "--port", "0",
                          "--max-batch", "8", "--max-queue", "64"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env, cwd=ROOT)
    line = p.stdout.readline()
    if "http://" not in line:
        p.kill()
        raise SystemExit(f"the server did not start: {line!r} {p.stderr.read()[-2000:]}")
    return p, line.split(" on ")[1].split()[0]


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
        "max_tokens": [0, -1, 10 ** 9, 2 ** 70, "x", 1.5, [], {}],
        "temperature": [-1, 2.5, "hot", 1e309, -1e-9, None, [0.5]],
        "top_p": [0, -0.1, 1.5, "all", 1e309],
        "stop": [["a", "b", "c", "d", "e"], "", [""], [3], 7, {"a": 1}],
        "seed": [2 ** 70, 2 ** 63, -(2 ** 63) - 1, 1.5, "seven", [1]],
        "stream": ["maybe", 2, [True]],  # (pydantic's lax mode takes "yes"/"true"/1 as true, as vLLM's does)
        "stream_options": ["x", [1]],
        "n": [0, -3, "two", 9, 129, 1.5],  # 9: more than --max-batch 8
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="lmforge-sweep-"))
    run = random_chat_run(tmp / MODEL, context_length=512)
    p, url = start(run)
    failures: list[str] = []
    try:
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
        if p.poll() is not None:
            failures.append(f"the server exited: {p.returncode}")
    finally:
        p.terminate()
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
        err = p.stderr.read()
    (tmp / "server.stderr").write_text(err)
    tracebacks = err.count("Traceback")
    print(f"server stderr: {len(err.splitlines())} lines, {tracebacks} tracebacks ({tmp / 'server.stderr'})")
    if tracebacks:
        failures.append(f"{tracebacks} tracebacks in the server's log")
    for f in failures[:30]:
        print("FAIL", f)
    print("OK" if not failures else f"{len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
