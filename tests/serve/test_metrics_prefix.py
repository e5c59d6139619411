"""The prefix cache and speculative decoding through the real server and the official ``openai`` client: the same
replies with them on and off, and their counts on ``/metrics``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")
import httpx  # noqa: E402

from lmforge.serve import ServedModel  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1]))
from serve_helpers import ThreadServer, openai_client, random_chat_run  # noqa: E402


def conversation(url: str, **sampling) -> list[str]:
    """Three turns, each re-sending the whole history (as every chat client does); the replies."""
    client = openai_client(url)
    messages = [{"role": "system", "content": "You are terse. Say little, and say it plainly, every time."},
                {"role": "user", "content": "Hello there"}]
    replies = []
    for turn in ("And then?", "Say it again."):
        r = client.chat.completions.create(model="chat", messages=messages, max_tokens=10, **sampling)
        replies.append(r.choices[0].message.content)
        messages += [{"role": "assistant", "content": replies[-1]}, {"role": "user", "content": turn}]
    r = client.chat.completions.create(model="chat", messages=messages, max_tokens=10, **sampling)
    return replies + [r.choices[0].message.content]


def families(text: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_replies_are_the_same_with_the_prefix_cache_on_and_off_and_metrics_count_it(tmp_path):
    run = random_chat_run(tmp_path / "chat", context_length=256)
    got = {}
    for mb in (0, 8):
        s = ThreadServer(ServedModel.from_run(run, max_batch=2, prefix_cache_mb=mb))
        try:
            got[mb] = (conversation(s.url, temperature=0), conversation(s.url, temperature=0.9, seed=7))
            got[mb, "metrics"] = families(httpx.get(s.url + "/metrics", trust_env=False).text)
        finally:
            s.close()
    assert got[0] == got[8]
    on, off = got[8, "metrics"], got[0, "metrics"]
    assert off["lmforge_prefix_cache_queries_total"] == 0 and off["lmforge_prefix_cache_bytes"] == 0
    assert on["lmforge_prefix_cache_queries_total"] == 6 and on["lmforge_prefix_cache_hits_total"] >= 5
    assert 0 < on["lmforge_prefix_cache_hit_tokens_total"] < on["lmforge_prefix_cache_query_tokens_total"]
    assert 0 < on["lmforge_prefix_cache_bytes"] <= 8 * 2**20
    assert "lmforge_speculative_accepted_tokens_total" in on


def test_served_model_refuses_a_negative_budget(tmp_path):
    run = random_chat_run(tmp_path / "chat")
    with pytest.raises(ValueError, match="prefix_cache_mb"):
        ServedModel.from_run(run, prefix_cache_mb=-1)


@pytest.mark.parametrize("argv", [["serve", "--run", "{run}", "--prefix-cache-mb", "-1"],
                                  ["serve", "--run", "{run}", "--prefix-cache-mb", "inf"],
                                  ["chat", "--run", "{run}", "--prefix-cache-mb", "-2"]])
def test_the_cli_refuses_a_bad_budget_in_one_line(tmp_path, capsys, argv):
    from lmforge import cli

    code = cli.main(["-q", *(a.format(run=tmp_path / "none") for a in argv)])
    err = capsys.readouterr().err
    assert code == 2 and "--prefix-cache-mb must be a non-negative number" in err and len(err.strip().splitlines()) == 1


def test_a_request_can_turn_drafting_off_and_gets_the_same_reply(tmp_path):
    """``speculative`` (lmforge's extension, on chat, completions and responses): false drafts nothing for that
    request; the reply is the same token for token; a non-boolean is a 400 naming the field."""
    run = random_chat_run(tmp_path / "chat", context_length=256)
    s = ThreadServer(ServedModel.from_run(run, max_batch=2))
    try:
        client = openai_client(s.url)
        prompt = "the cat sat on the mat. " * 6

        def drafted() -> float:
            return families(httpx.get(s.url + "/metrics", trust_env=False).text)[
                "lmforge_speculative_drafted_tokens_total"]

        replies, counts = [], []
        for extra in ({}, {"speculative": False}):
            before = drafted()
            r = client.completions.create(model="chat", prompt=prompt, max_tokens=24, temperature=0, extra_body=extra)
            replies.append(r.choices[0].text)
            counts.append(drafted() - before)
        assert replies[0] == replies[1] and counts[0] > 0 and counts[1] == 0, counts
        before = drafted()
        client.responses.create(model="chat", input=prompt, max_output_tokens=8, temperature=0,
                                extra_body={"speculative": False})
        assert drafted() == before
        r = httpx.post(s.url + "/v1/chat/completions", trust_env=False, json={
            "model": "chat", "messages": [{"role": "user", "content": "hi"}], "speculative": "no"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "speculative", r.text
    finally:
        s.close()


def test_usage_reports_the_prompt_tokens_the_cache_gave(tmp_path):
    """``usage.prompt_tokens_details.cached_tokens`` (chat, streamed chat, completions) and the Responses API's
    ``input_tokens_details.cached_tokens``: 0 without the cache; with it, whole 16-token blocks of the shared
    prefix, and over all requests the sum /metrics counts as hit tokens."""
    run = random_chat_run(tmp_path / "chat", context_length=256)
    system = {"role": "system", "content": "You answer questions about the weather in one short sentence. " * 2}
    for mb in (0, 8):
        s = ThreadServer(ServedModel.from_run(run, max_batch=2, prefix_cache_mb=mb))
        try:
            client = openai_client(s.url)
            cached = []
            for q in ("Rain?", "Sun?"):
                r = client.chat.completions.create(model="chat", messages=[system, {"role": "user", "content": q}],
                                                   max_tokens=3, temperature=0)
                cached.append((r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens))
            chunks = list(client.chat.completions.create(
                model="chat", messages=[system, {"role": "user", "content": "Snow?"}], max_tokens=3, temperature=0,
                stream=True, stream_options={"include_usage": True}))
            cached.append((chunks[-1].usage.prompt_tokens, chunks[-1].usage.prompt_tokens_details.cached_tokens))
            r = client.responses.create(model="chat", instructions=system["content"], input="Wind?",
                                        max_output_tokens=3, temperature=0)
            cached.append((r.usage.input_tokens, r.usage.input_tokens_details.cached_tokens))
            hit = families(httpx.get(s.url + "/metrics", trust_env=False).text)["lmforge_prefix_cache_hit_tokens_total"]
        finally:
            s.close()
        if mb == 0:
            assert all(c == 0 for _, c in cached) and hit == 0, cached
        else:
            assert cached[0][1] == 0 and all(0 < c < n and c % 16 == 0 for n, c in cached[1:]), cached
            assert sum(c for _, c in cached) == hit


@pytest.mark.parametrize("flag,value", [("--responses-store-mb", "0"), ("--responses-store-mb", "inf"),
                                        ("--responses-ttl", "-5"), ("--responses-ttl", "nan")])
def test_the_cli_refuses_a_bad_response_store_bound_in_one_line(tmp_path, capsys, flag, value):
    from lmforge import cli

    code = cli.main(["-q", "serve", "--run", str(tmp_path / "none"), flag, value])
    err = capsys.readouterr().err
    assert code == 2 and f"{flag} must be a positive number" in err and len(err.strip().splitlines()) == 1


def test_serve_hands_its_response_store_bounds_to_the_app(tmp_path, monkeypatch):
    """``lmforge serve --responses-store-mb 2 --responses-ttl 60``: the app's store has those bounds."""
    import lmforge.serve
    from lmforge import cli

    seen = {}
    monkeypatch.setattr(lmforge.serve, "serve", lambda *a, response_store=None, **k: seen.setdefault("store", response_store))
    run = random_chat_run(tmp_path / "chat")
    assert cli.main(["-q", "serve", "--run", str(run), "--responses-store-mb", "2", "--responses-ttl", "60"]) == 0
    assert (seen["store"].max_bytes, seen["store"].ttl) == (2 << 20, 60.0)


def test_prefix_cache_evictions_are_exported(tmp_path):
    """A cache of two blocks' budget: distinct prompts push blocks out, and /metrics says how many."""
    s = ThreadServer(ServedModel.from_run(random_chat_run(tmp_path / "chat"), prefix_cache_mb=0.02))
    try:
        client = openai_client(s.url)
        for q in ("Rain today, or tomorrow?", "Sun all week, they say?", "Snow in the hills again?"):
            client.chat.completions.create(model="chat", messages=[{"role": "user", "content": q * 2}], max_tokens=2)
        got = families(httpx.get(s.url + "/metrics", trust_env=False).text)
        evicted = s.served.scheduler.prefix_cache.stats.evicted_blocks
        assert evicted > 0 and got["lmforge_prefix_cache_evicted_blocks_total"] == evicted
    finally:
        s.close()
