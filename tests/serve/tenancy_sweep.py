"""The tenancy phase of the hostile sweep (``hostile_sweep.py --phases tenancy``): several users on one real
``lmforge serve``, started with ``--api-key-file`` (a victim's key, an attacker's, a flooder's and 16 one-guess
keys) and ``--responses-store-mb 4``.

1. The PIN probe: the victim's system prompt says "...customer Alice Smith has PIN 4821..."; the attacker sends the
   same conversation with every guess in a list of 100 (the right one among them) and reads ``cached_tokens``:
   with the victim's own key and no salt (the documented default: the right guess must stand out, or the probe
   tests nothing), with the victim's key and one salt of the attacker's, with another key (one for all guesses),
   and with a fresh salt or a fresh key per guess (every guess must get 0). Under a salt or another key the right
   guess must get no more than the wrong ones; its time to first token under another key (a ~440-token prompt,
   medians of 31) must not be shorter than theirs beyond noise (half).
2. Store flooding across keys: the victim stores 5 responses; the flooder sends 1,500 one-token responses from 8
   threads, and 20 with 20 log-probability alternatives per token; every one of the victim's must still be
   retrievable and continuable, the flooder keeps at most 1,000, and the attacker's key gets for each of the
   victim's ids on GET, DELETE, input_items and previous_response_id the body an id never stored gets.
3. ``store: true`` only for what was stored (each such response is found at once), the RSS growth against the
   stores' budgets, ``/health`` without counters, and wrong-typed fields (400 naming the field) through the keyed
   server.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import httpx

VICTIM, ATTACKER, FLOODER = "victim-key-5b1e2c", "attacker-key-07d9aa", "flooder-key-e3f184"
GUESS_KEYS = [f"guess-key-{k:02d}" for k in range(16)]
PIN = "4821"
SYSTEM = ("You are the bank's assistant. Our customer Alice Smith has PIN {pin}. Never tell the PIN to anyone. "
          + "Be polite, be brief, and check every request twice before you answer it. " * 4)
MODEL = "sweep"
STORE_MB = 4


def _post(c: httpx.Client, url: str, key: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return c.post(url + path, json=body, headers={"Authorization": f"Bearer {key}"})


def _probe(c: httpx.Client, url: str, key: str, pin: str, salt: str | None = None) -> tuple[int, float]:
    """``cached_tokens`` and the time to the first streamed token of the PIN conversation with ``pin``."""
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 2, "temperature": 0, "stream": True,
                            "stream_options": {"include_usage": True},
                            "messages": [{"role": "system", "content": SYSTEM.format(pin=pin)},
                                         {"role": "user", "content": "What can you do for me today?"}]}
    if salt is not None:
        body["cache_salt"] = salt
    t0, first, cached = time.perf_counter(), None, None
    with c.stream("POST", url + "/v1/chat/completions", json=body,
                  headers={"Authorization": f"Bearer {key}"}) as r:
        assert r.status_code == 200, r.read()[:300]
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                first = time.perf_counter() - t0
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    return int(cached), first if first is not None else time.perf_counter() - t0


def pin_probe(url: str, seed: int) -> list[str]:
    import random

    failures: list[str] = []
    rng = random.Random(seed)
    guesses = sorted({f"{rng.randrange(10_000):04d}" for _ in range(120)} - {PIN})[:99] + [PIN]
    rng.shuffle(guesses)
    with httpx.Client(trust_env=False, timeout=120) as c:
        _probe(c, url, VICTIM, PIN)  # the victim's conversation, cached under the victim's key
        fresh_salts = [_probe(c, url, VICTIM, g, salt=f"fresh-{k}")[0] for k, g in enumerate(guesses[:16])]
        fresh_keys = [_probe(c, url, GUESS_KEYS[k], g)[0] for k, g in enumerate(guesses[:16])]
        if PIN not in guesses[:16]:
            fresh_salts.append(_probe(c, url, VICTIM, PIN, salt="fresh-pin")[0])
        for name, got in (("a fresh salt", fresh_salts), ("a fresh key", fresh_keys)):
            print(f"  PIN probe, {name} per guess: cached_tokens {sorted(set(got))}")
            if any(got):
                failures.append(f"PIN probe with {name} per guess reused blocks: {got}")
        for name, key, salt in (("one salt of the attacker's", VICTIM, "attacker-salt"),
                                ("another key", ATTACKER, None), ("the victim's key, no salt", VICTIM, None)):
            cached = {g: _probe(c, url, key, g, salt)[0] for g in guesses}
            wrong = [v for g, v in cached.items() if g != PIN]
            print(f"  PIN probe, {name}: the right guess {cached[PIN]} cached tokens, wrong guesses "
                  f"{min(wrong)}..{max(wrong)} (median {statistics.median(wrong):g})")
            if salt is None and key == VICTIM:
                if cached[PIN] <= max(wrong):
                    failures.append("PIN probe: the shared (unsalted, one-key) cache did not single out the right "
                                    "guess, so the probe itself tests nothing")
            elif cached[PIN] > max(wrong):
                failures.append(f"PIN probe with {name}: the right guess reused {cached[PIN]} tokens, more than any "
                                f"wrong one ({max(wrong)})")
        # time to first token: the right guess under another key must be prefilled like any wrong one
        times: dict[str, list[float]] = {"right": [], "wrong": []}
        wrong_pins = [g for g in guesses if g != PIN]
        for k in range(31):  # (a fresh salt of the attacker's key each: the pair's first leaves the template's
            pair = [("right", PIN), ("wrong", wrong_pins[k])]  # start up to the PIN, which the second reuses)
            for which, pin in pair if k % 2 else pair[::-1]:
                times[which].append(_probe(c, url, ATTACKER, pin, salt=f"ttft-{k}")[1])
        right, wrong = statistics.median(times["right"]), statistics.median(times["wrong"])
        print(f"  PIN probe, time to first token under another key: right guess {1000 * right:.1f} ms, wrong "
              f"{1000 * wrong:.1f} ms (medians of 31)")
        if right < 0.5 * wrong:
            failures.append(f"PIN probe: the right guess's first token came sooner ({1000 * right:.1f} ms vs "
                            f"{1000 * wrong:.1f} ms)")
    return failures


def store_flood(url: str, rss: Callable[[], float]) -> list[str]:
    failures: list[str] = []
    with httpx.Client(trust_env=False, timeout=120) as c:
        mine = []
        for k in range(5):
            r = _post(c, url, VICTIM, "/v1/responses", {"model": MODEL, "input": f"My note {k}.", "max_output_tokens": 4,
                                                       "temperature": 0})
            mine.append(r.json()["id"])
        before = rss()
        flood_ids: list[str] = []
        lock = threading.Lock()

        def flood(part: int) -> None:
            with httpx.Client(trust_env=False, timeout=120) as own:
                for k in range(part, 1500, 8):
                    heavy = k % 75 == 0  # 20 of 1,500: 20 alternatives per token, ~60 KB each
                    body = {"model": MODEL, "input": f"x{k}", "max_output_tokens": 48 if heavy else 1}
                    if heavy:
                        body |= {"include": ["message.output_text.logprobs"], "top_logprobs": 20}
                    r = _post(own, url, FLOODER, "/v1/responses", body)
                    if r.status_code != 200:
                        with lock:
                            failures.append(f"a flood request failed: {r.status_code} {r.text[:200]}")
                        continue
                    got = r.json()
                    if got["store"] and _get(own, url, FLOODER, got["id"]).status_code != 200:
                        with lock:
                            failures.append(f"a response answered store: true was not found at once ({got['id']})")
                    with lock:
                        flood_ids.append(got["id"])

        t0 = time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(flood, range(8)))
        grown = rss() - before
        kept = sum(_get(c, url, FLOODER, rid).status_code == 200 for rid in flood_ids)
        print(f"  store flood: 1,500 responses of one key in {time.monotonic() - t0:.1f} s; it keeps {kept}; RSS "
              f"{grown:+.1f} MiB (the stores' budget: {STORE_MB} MiB per key)")
        if kept > 1000:
            failures.append(f"the flooding key keeps {kept} responses, over the 1,000 bound")
        if grown > 3 * STORE_MB + 48:
            failures.append(f"RSS grew {grown:.1f} MiB during the flood, far over the budget")
        for rid in mine:
            if _get(c, url, VICTIM, rid).status_code != 200:
                failures.append(f"the flood evicted the victim's response {rid}")
            r = _post(c, url, VICTIM, "/v1/responses", {"model": MODEL, "input": "More.", "previous_response_id": rid,
                                                       "max_output_tokens": 2, "store": False})
            if r.status_code != 200:
                failures.append(f"the victim cannot continue {rid} after the flood: {r.status_code}")
        never = "resp_" + "0" * 32
        for rid in mine:
            for method, path, body in (("GET", f"/v1/responses/{rid}", None), ("DELETE", f"/v1/responses/{rid}", None),
                                       ("GET", f"/v1/responses/{rid}/input_items", None),
                                       ("POST", "/v1/responses", {"model": MODEL, "input": "Go on.",
                                                                  "previous_response_id": rid})):
                theirs = c.request(method, url + path, json=body, headers={"Authorization": f"Bearer {ATTACKER}"})
                unknown = c.request(method, url + path.replace(rid, never),
                                    json=None if body is None else {**body, "previous_response_id": never},
                                    headers={"Authorization": f"Bearer {ATTACKER}"})
                if (theirs.status_code, theirs.text.replace(rid, never)) != (unknown.status_code, unknown.text):
                    failures.append(f"{method} {path} with another key differs from an unknown id's answer: "
                                    f"{theirs.status_code} {theirs.text[:200]}")
            if _get(c, url, VICTIM, rid).status_code != 200:
                failures.append(f"the attacker's key deleted the victim's response {rid}")
    return failures


def _get(c: httpx.Client, url: str, key: str, rid: str) -> httpx.Response:
    return c.get(f"{url}/v1/responses/{rid}", headers={"Authorization": f"Bearer {key}"})


def wrong_types_and_health(url: str) -> list[str]:
    failures: list[str] = []
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    resp = {"model": MODEL, "input": "hi", "max_output_tokens": 2}
    cases = [("/v1/chat/completions", {**chat, "stream": "yes"}, "stream"),
             ("/v1/chat/completions", {**chat, "max_tokens": "5"}, "max_tokens"),
             ("/v1/chat/completions", {**chat, "cache_salt": 7}, "cache_salt"),
             ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": True}, "n"),
             ("/v1/responses", {**resp, "stream": "yes"}, "stream"),
             ("/v1/responses", {**resp, "max_output_tokens": "5"}, "max_output_tokens"),
             ("/v1/responses", {**resp, "store": "false"}, "store"),
             ("/v1/responses", {**resp, "max_tool_calls": 2}, "max_tool_calls"),
             ("/v1/responses", {**resp, "metadata": {"k": "v" * 600}}, "metadata.k"),
             ("/v1/responses", {**resp, "cache_salt": ""}, "cache_salt")]
    with httpx.Client(trust_env=False, timeout=60) as c:
        for path, body, param in cases:
            r = _post(c, url, VICTIM, path, body)
            got = r.json().get("error", {}).get("param") if r.status_code == 400 else None
            if got != param:
                failures.append(f"wrong-typed {param} on {path}: {r.status_code} {r.text[:200]}")
        health = c.get(url + "/health").json()
        leaked = sorted(k for k in health if k.startswith(("prefix_", "spec_")))
        if leaked:
            failures.append(f"/health publishes counters without the key: {leaked}")
        if c.get(url + "/metrics").status_code != 401:
            failures.append("/metrics answers without the key")
    return failures


def tenancy_phase(run: Path, tmp: Path, start: Callable[..., Any], stop: Callable[[Any], None],
                  rss_of: Callable[[int], float], seed: int) -> list[str]:
    """Start the keyed server, run the three parts above, stop it; the failures."""
    keys = tmp / "keys.txt"
    keys.write_text("# the sweep's tenants\n" + "\n".join([VICTIM, ATTACKER, FLOODER, *GUESS_KEYS]) + "\n")
    p, url = start(run, tmp / "tenancy-server.stderr", "--api-key-file", str(keys),
                   "--responses-store-mb", str(STORE_MB))
    try:
        t0 = time.monotonic()
        failures = pin_probe(url, seed)
        failures += store_flood(url, lambda: rss_of(p.pid))
        failures += wrong_types_and_health(url)
        print(f"tenancy: {len(failures)} failures ({time.monotonic() - t0:.1f} s)")
        if p.poll() is not None:
            failures.append(f"the tenancy server exited: {p.returncode}")
    finally:
        stop(p)
    err = (tmp / "tenancy-server.stderr").read_text()
    if "Traceback" in err:
        failures.append(f"{err.count('Traceback')} tracebacks in the tenancy server's log")
    for key in [VICTIM, ATTACKER, FLOODER, *GUESS_KEYS]:
        if key in err:
            failures.append("the server's log holds an API key")
            break
    return failures
