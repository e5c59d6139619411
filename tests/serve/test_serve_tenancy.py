"""Several users on one server, as hostile tenants would try it: a PIN probe through the prefix cache's
``cached_tokens`` (shared within a key without a salt, as documented; nothing across salts or keys), several API
keys (``--api-key a,b``, ``--api-key-file``), stored responses that belong to the key that made them (another key
gets the 404 of an id never stored), per-key store bounds (one key's flood evicts nothing of another's), ``store``
true only for what was stored, ``/health`` without the counters ``/metrics`` keeps behind the key, and ``/metrics``
counting every answer.

One real server (:class:`serve_helpers.ThreadServer`) for the module, driven by the official ``openai`` client.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
parser = pytest.importorskip("prometheus_client.parser")
import httpx  # noqa: E402  (a dependency of openai)

from lmforge.serve import ServedModel  # noqa: E402
from lmforge.serve.response_store import ResponseStore  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1]))
from serve_helpers import ThreadServer, chain_run, openai_client, random_chat_run  # noqa: E402

ALICE, MALLORY = "alice-key-7f3a", "mallory-key-91c2"
GUESS_KEYS = [f"guess-key-{k}" for k in range(4)]
KEYS = [ALICE, MALLORY, "carol-key-0d1e", *GUESS_KEYS]
SYSTEM = "You are the bank's assistant. Our customer Alice Smith has PIN {}. Never tell the PIN to anyone."
GUESSES = ["1111", "4820", "4821", "9999"]  # 4821 is right


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    """The model that answers ``Hi`` and ends its turn, three keys, a store of 3 responses / 8 KiB per key."""
    run = chain_run(tmp_path_factory.mktemp("tenancy") / "hi", ["<|assistant_start|>", ord("H"), ord("i"),
                                                                  "<|assistant_end|>"])
    s = ThreadServer(ServedModel.from_run(run), api_key=KEYS, response_store=ResponseStore(max_items=3,
                                                                                            max_bytes=8 << 10))
    yield s
    s.close()


def client(srv: ThreadServer, key: str):
    return openai_client(srv.url, api_key=key, max_retries=0)


def families(text: str) -> dict[str, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in parser.text_string_to_metric_families(text) for s in f.samples}


def metrics(srv: ThreadServer) -> dict:
    return families(httpx.get(srv.url + "/metrics", headers={"Authorization": f"Bearer {KEYS[2]}"},
                              trust_env=False).text)


def probe(c, pin: str, **extra) -> int:
    """The prompt tokens the prefix cache gave a chat request whose system prompt says ``pin``."""
    r = c.chat.completions.create(model="hi", messages=[{"role": "system", "content": SYSTEM.format(pin)},
                                                         {"role": "user", "content": "What can you do?"}],
                                  max_tokens=3, temperature=0, extra_body=extra or None)
    return r.usage.prompt_tokens_details.cached_tokens


# --------------------------------------------------------------------------------------------------
def test_a_pin_probe_learns_nothing_across_salts_and_keys(srv):
    """Alice's request holds her customer's PIN. Guessing it and reading ``cached_tokens``: under another API key,
    or Alice's key with a salt of one's own, every guess reuses nothing (0, as on a server that never saw her
    prompt). With Alice's own key and no salt, requests share the cache, as the serving guide says: there the
    right guess reuses more than any wrong one."""
    alice = client(srv, ALICE)
    assert probe(alice, "4821") == 0
    for k, pin in enumerate(GUESSES):  # a key each, a salt each: nothing of anyone's reused
        assert probe(client(srv, GUESS_KEYS[k]), pin) == 0, pin
        assert probe(alice, pin, cache_salt=f"attacker-salt-{k}") == 0, pin
    mallory = [probe(client(srv, MALLORY), pin) for pin in GUESSES]  # one key for every guess: its own blocks only
    assert mallory[0] == 0 and len(set(mallory[1:])) == 1, mallory  # the right guess stands out in nothing
    r = client(srv, MALLORY).responses.create(model="hi", instructions=SYSTEM.format("4821"), input="What can you do?",
                                              temperature=0, extra_body={"cache_salt": "x"})
    assert r.usage.input_tokens_details.cached_tokens == 0
    shared = [probe(alice, pin) for pin in GUESSES]
    assert shared[2] > max(shared[:2] + shared[3:]) and shared[2] >= 64, shared
    salted = [probe(alice, "4821", cache_salt="s1"), probe(alice, "4821", cache_salt="s1")]
    assert salted[0] == 0 and salted[1] == shared[2]  # one salt, one space: its own requests share


def test_every_key_is_accepted_and_no_other(srv):
    for key in KEYS:
        assert client(srv, key).responses.create(model="hi", input="A", temperature=0).output_text == "Hi"
    for wrong in ("", ALICE + "x", ALICE[:-1], f"{ALICE},{MALLORY}"):
        with pytest.raises(openai.AuthenticationError):
            client(srv, wrong or "none").models.list()


def test_a_stored_response_belongs_to_its_key(srv):
    """Mallory, holding another valid key, gets for Alice's response id exactly the 404 of an id never stored, on
    every route and as previous_response_id; Alice's response is untouched."""
    alice, mallory = client(srv, ALICE), client(srv, MALLORY)
    mine = alice.responses.create(model="hi", input="My secret is 1234.", temperature=0)
    never = "resp_" + "0" * 32
    for rid in (mine.id, never):
        answers = []
        for call in (lambda: mallory.responses.retrieve(rid), lambda: mallory.responses.delete(rid),
                     lambda: mallory.responses.input_items.list(rid),
                     lambda: mallory.responses.create(model="hi", input="Go on.", previous_response_id=rid)):
            with pytest.raises(openai.NotFoundError) as e:
                call()
            answers.append({k: v for k, v in e.value.body.items()})
        if rid == never:
            assert [a["message"].replace(never, mine.id) for a in answers] == [a["message"] for a in first]
            assert [(a["code"], a["param"]) for a in answers] == [(a["code"], a["param"]) for a in first]
        first = answers
    assert alice.responses.retrieve(mine.id).output_text == "Hi"
    assert [i.content[0].text for i in alice.responses.input_items.list(mine.id).data] == ["My secret is 1234."]
    follow = alice.responses.create(model="hi", input="Go on.", previous_response_id=mine.id, temperature=0)
    assert follow.usage.input_tokens > mine.usage.input_tokens


def test_one_keys_flood_never_evicts_anothers_responses(srv):
    """Mallory stores 20 responses (over the 3-per-key bound, and large ones over the 8 KiB budget): Alice's
    3 stay, each continuable; each key holds at most its own bounds."""
    alice, mallory = client(srv, ALICE), client(srv, MALLORY)
    mine = [alice.responses.create(model="hi", input=f"Note {k}.", temperature=0).id for k in range(3)]
    for k in range(20):
        mallory.responses.create(model="hi", input="x" * (1 + k * 11 % 150), metadata={"pad": "p" * 500}, temperature=0)
    for rid in mine:
        assert alice.responses.retrieve(rid).id == rid
        assert alice.responses.create(model="hi", input="More.", previous_response_id=rid, store=False,
                                      temperature=0).output_text == "Hi"
    m = metrics(srv)
    assert m[("lmforge_responses_stored", ())] <= 3 * len(KEYS)
    assert 0 < m[("lmforge_responses_stored_bytes", ())] <= 3 * (8 << 10)


def test_store_is_true_only_for_what_was_stored(srv):
    """A response whose entry alone is over its key's budget is answered with store: false (plain and streamed),
    and is not found afterwards; one that fits says store: true and is found."""
    alice = client(srv, ALICE)
    big = {f"k{i}": "v" * 512 for i in range(16)}  # 8 KiB of metadata, echoed in the response: with the
    r = alice.responses.create(model="hi", input="A", metadata=big, temperature=0)  # history, over 8 KiB
    assert r.output_text == "Hi" and r.store is False
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(r.id)
    events = list(alice.responses.create(model="hi", input="A", metadata=big, temperature=0, stream=True))
    assert events[0].response.store is True and events[-1].type == "response.completed"  # (the request's)
    assert events[-1].response.store is False
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(events[-1].response.id)
    small = alice.responses.create(model="hi", input="A", temperature=0)
    assert small.store is True and alice.responses.retrieve(small.id).store is True
    assert alice.responses.create(model="hi", input="A", store=False, temperature=0).store is False


def test_health_says_up_and_load_never_the_counters(srv):
    """/health is open (the page and load balancers read it): status, model, load; no prompt-token, cache-hit or
    drafting counts, which would tell anyone who reaches the port what others send. /metrics has them, behind
    the key."""
    client(srv, ALICE).chat.completions.create(model="hi", messages=[{"role": "user", "content": "A"}])
    h = httpx.get(srv.url + "/health", trust_env=False).json()
    assert set(h) == {"status", "model", "chat", "auth", "context_length", "active", "waiting", "max_batch",
                      "max_queue"}, h
    assert h["status"] == "ok" and h["auth"] is True
    assert httpx.get(srv.url + "/metrics", trust_env=False).status_code == 401
    assert ("lmforge_prefix_cache_query_tokens_total", ()) in metrics(srv)


def test_metrics_count_every_answer(srv):
    """Successful GET and DELETE of a response, its input_items and /v1/models are counted, as errors are."""
    alice = client(srv, ALICE)
    before = metrics(srv)
    rid = alice.responses.create(model="hi", input="A", temperature=0).id
    alice.responses.retrieve(rid)
    alice.responses.input_items.list(rid)
    alice.models.list()
    alice.models.retrieve("hi")
    alice.responses.delete(rid)
    after = metrics(srv)

    def count(route: str) -> float:
        key = ("lmforge_requests_total", (("endpoint", route), ("status", "200")))
        return after.get(key, 0) - before.get(key, 0)

    assert count("/v1/responses/{response_id}") == 2 and count("/v1/responses/{response_id}/input_items") == 1
    assert count("/v1/models") == 1 and count("/v1/models/{name}") == 1 and count("/v1/responses") == 1
    assert not any("tenant" in str(k) or ALICE in str(k) for k in after)  # no label names a key or tenant


# --------------------------------------------------------------------------------------------------
# The command line: several keys
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return random_chat_run(tmp_path_factory.mktemp("keys") / "chat")


def served_keys(run: Path, monkeypatch, *argv: str) -> list[str] | None:
    """The keys ``lmforge serve --run RUN ARGV`` hands to the server."""
    import lmforge.serve
    from lmforge import cli

    seen = {}
    monkeypatch.setattr(lmforge.serve, "serve", lambda *a, api_key=None, **k: seen.setdefault("keys", api_key))
    assert cli.main(["-q", "serve", "--run", str(run), *argv]) == 0
    return seen["keys"]


def test_the_cli_takes_a_key_list_a_key_file_and_the_environment(run, tmp_path, monkeypatch):
    monkeypatch.delenv("LMFORGE_API_KEY", raising=False)
    assert served_keys(run, monkeypatch, "--api-key", "k1,k2, k3") == ["k1", "k2", "k3"]
    keys = tmp_path / "keys.txt"
    keys.write_text("# the team's keys\nalpha-1\n\n   beta-2  \n#gamma-3\r\ndelta,4\n")
    assert served_keys(run, monkeypatch, "--api-key-file", str(keys)) == ["alpha-1", "beta-2", "delta,4"]
    assert served_keys(run, monkeypatch, "--api-key", "k1", "--api-key-file", str(keys))[:2] == ["k1", "alpha-1"]
    monkeypatch.setenv("LMFORGE_API_KEY", "e1,e2")
    assert served_keys(run, monkeypatch) == ["e1", "e2"]
    assert served_keys(run, monkeypatch, "--api-key-file", str(keys)) == ["alpha-1", "beta-2", "delta,4"]
    monkeypatch.delenv("LMFORGE_API_KEY")
    assert served_keys(run, monkeypatch) is None


@pytest.mark.parametrize("content, argv, words", [
    (None, ["--api-key-file", "{tmp}/missing.txt"], "--api-key-file {tmp}/missing.txt: cannot read it (No such file"),
    ("", ["--api-key-file", "{file}"], "holds no key; write one key a line"),
    ("# only a comment\n\n", ["--api-key-file", "{file}"], "holds no key"),
    (b"\xff\xfe", ["--api-key-file", "{file}"], "cannot read it (it is not UTF-8 text)"),
    ("good-key\nsecret value\n", ["--api-key-file", "{file}"], "{file}, line 2: the API key holds a space"),
    (None, ["--api-key", "k1,,k3"], "--api-key, key 2 of 3: the API key is empty"),
    (None, ["--api-key", "ok,clé"], "--api-key, key 2 of 2: the API key holds 'é'"),
])
def test_the_cli_refuses_a_bad_key_or_key_file_in_one_line(run, tmp_path, capsys, monkeypatch, content, argv, words):
    """Exit 2, one line naming where the key came from, never the key itself."""
    from lmforge import cli

    monkeypatch.delenv("LMFORGE_API_KEY", raising=False)
    file = tmp_path / "keys.txt"
    if content is not None:
        file.write_bytes(content if isinstance(content, bytes) else content.encode())
    argv = [a.format(tmp=tmp_path, file=file) for a in argv]
    assert cli.main(["-q", "serve", "--run", str(run), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words.format(tmp=tmp_path, file=file) in err[0], err
    assert "secret value" not in err[0]
