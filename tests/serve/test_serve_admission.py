"""The server when a request fails while it joins the batch: it fails alone, and the next request gets its own reply.

A real server (:class:`serve_helpers.ThreadServer`) on a random-weight chat model with the prefix cache on (the
default), driven by the official ``openai`` client; its twin, never touched, gives the replies to compare with.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from lmforge.serve import ServedModel  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1]))
from serve_helpers import ThreadServer, openai_client, random_chat_run  # noqa: E402

FAILING = [{"role": "system", "content": "Customer Alice Smith has PIN 4821."}, {"role": "user", "content": "My PIN?"}]
NEXT = [{"role": "user", "content": "Tell me a story about a fox."}]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Two servers of one random chat model: ``hurt`` (faults are injected into it) and ``clean`` (never)."""
    run = random_chat_run(tmp_path_factory.mktemp("admission") / "chatty")
    both = {name: ThreadServer(ServedModel.from_run(run, max_batch=2)) for name in ("hurt", "clean")}
    yield both
    for s in both.values():
        s.close()


def reply(server: ThreadServer, messages: list[dict]) -> tuple[str, str, list[float]]:
    """A seeded sampled chat reply: its text, finish reason and each token's log-probability (a random model's
    tokens hardly depend on the context, their log-probabilities do: the C++ steps give the same bits for the same
    context, whatever else ran before)."""
    r = openai_client(server.url, max_retries=0, timeout=60).chat.completions.create(
        model="chatty", messages=messages, max_tokens=12, temperature=1.0, seed=3, logprobs=True)
    c = r.choices[0]
    return c.message.content, c.finish_reason, [t.logprob for t in c.logprobs.content]


def test_a_store_failure_while_joining_fails_that_request_alone(servers, monkeypatch):
    """The prefix cache's store raises (out of memory) after the failing request's prompt was prefilled into its
    row: that request gets an OpenAI-shaped 500, the engine holds no row for it, and the next request's reply is
    the untouched server's, token for token. The row used to stay taken: the next request was stepped in it and
    streamed the failed request's continuation, then every live request ended with an IndexError."""
    hurt, clean = servers["hurt"], servers["clean"]
    scheduler = hurt.served.scheduler
    store, armed = scheduler.prefix_cache.store, [True]

    def store_once(*args, **kw):
        if armed and armed.pop():
            raise MemoryError("injected while storing a prefix")
        return store(*args, **kw)

    monkeypatch.setattr(scheduler.prefix_cache, "store", store_once)
    with pytest.raises(openai.InternalServerError, match="injected while storing a prefix") as e:
        reply(hurt, FAILING)
    error = e.value.response.json()["error"]
    assert e.value.status_code == 500 and error["type"] == "server_error" and "MemoryError" in error["message"]
    assert not armed and scheduler.engine.active == 0
    want = reply(clean, NEXT)
    assert reply(hurt, NEXT) == want and want[1] == "length"
    assert reply(hurt, FAILING) == reply(clean, FAILING)  # the failed request, sent again, is served as usual
