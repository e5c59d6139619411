"""Continuous batching: rows join and leave the engine between steps, each with its own sampling and stops.

The oracle is the Generator on each request alone (itself held to the naive full recompute in test_generate.py):
a request's tokens must not depend on which other requests share its steps.
"""

from __future__ import annotations

import threading

import pytest
import torch

from lmforge.generate import Engine, Generator
from lmforge.generate.prefix_cache import MAX_SALT_CHARS, PrefixCache
from lmforge.generate.scheduler import Job, QueueFull, Scheduler, Update
from lmforge.model import ModelConfig, TransformerLM
from lmforge.tokenizer import Tokenizer

VOCAB, CTX = 260, 48


def tiny_model(seed: int = 0, **kw) -> TransformerLM:
    torch.manual_seed(seed)
    return TransformerLM(ModelConfig(vocab_size=VOCAB, context_length=CTX, d_model=32, n_layers=2, n_heads=4,
                                     d_ff=64, **kw)).eval()


def byte_tokenizer() -> Tokenizer:
    vocab = {i: bytes([i]) for i in range(256)}
    vocab[256] = b"<|endoftext|>"
    return Tokenizer(vocab, [], ["<|endoftext|>"])


class Collect:
    """An ``emit`` target: the updates one request received."""

    def __init__(self) -> None:
        self.updates: list[Update] = []
        self.done = threading.Event()

    def __call__(self, u: Update) -> None:
        self.updates.append(u)
        if u.finish_reason is not None:
            self.done.set()

    @property
    def text(self) -> str:
        return "".join(u.text for u in self.updates)

    @property
    def last(self) -> Update:
        return self.updates[-1]


def drain(s: Scheduler, limit: int = 10_000) -> None:
    for _ in range(limit):
        if not s.run_once() and not s.load()["waiting"]:
            return
    raise AssertionError("scheduler did not finish")


def alone_ids(model, tok, prompt, n, **kw) -> list[int]:
    """The Generator on one prompt (no stop ids): the oracle."""
    return Generator(model, tok).generate_ids(prompt, max_new_tokens=n, stop_ids=[], **kw)


def alone(model, tok, prompt, n, **kw) -> str:
    return tok.decode(alone_ids(model, tok, prompt, n, **kw))


PROMPTS = [list(b"Hello there"), list(b"ab"), list(b"The quick brown fox"), list(b"x"), list(b"0123456789")]


@pytest.mark.parametrize("kernel", [True, False])
def test_staggered_greedy_requests_equal_each_alone(kernel):
    """Requests joining at different steps, leaving at different lengths: each gets its own greedy text."""
    model, tok = tiny_model(), byte_tokenizer()
    s = Scheduler(Engine(model, use_kernel=None if kernel else False), tok, max_batch=3)
    outs, lengths = [Collect() for _ in PROMPTS], [12, 5, 9, 15, 7]
    for k, (p, n, out) in enumerate(zip(PROMPTS, lengths, outs)):
        s.submit(Job(p, n, out, temperature=0))
        for _ in range(k):  # the k-th request joins k steps after the previous one
            s.run_once()
        assert s.engine.active <= 3
    drain(s)
    load = {"active": 0, "waiting": 0, "max_batch": 3, "max_queue": 64}
    assert s.engine.active == 0 and s.load().items() >= load.items()
    for p, n, out in zip(PROMPTS, lengths, outs):
        assert out.text == alone(model, tok, p, n, temperature=0)
        assert out.last.finish_reason == "length" and out.last.prompt_tokens == len(p)
        assert out.last.completion_tokens == n


def test_seeded_sampling_is_independent_of_the_batch():
    model, tok = tiny_model(1), byte_tokenizer()
    kw = dict(temperature=0.9, top_p=0.95, seed=7)
    solo = Collect()
    s = Scheduler(Engine(model), tok, max_batch=4)
    s.submit(Job(PROMPTS[0], 20, solo, **kw))
    drain(s)
    crowd = [Collect() for _ in range(4)]
    for i, c in enumerate(crowd):  # the same request among others with other seeds and temperatures
        s.submit(Job(PROMPTS[0], 20, c, **(kw if i == 2 else dict(temperature=1.3, seed=i))))
    drain(s)
    assert crowd[2].text == solo.text
    assert len({c.text for c in crowd}) > 1  # the others really sampled differently


def test_stop_ids_and_stop_strings():
    model, tok = tiny_model(), byte_tokenizer()
    ids = alone_ids(model, tok, PROMPTS[2], 16, temperature=0)
    free = tok.decode(ids)
    stop = free[5:7]
    s = Scheduler(Engine(model), tok)
    out, by_id = Collect(), Collect()
    s.submit(Job(PROMPTS[2], 16, out, temperature=0, stop=[stop]))
    k = ids.index(ids[3])
    s.submit(Job(PROMPTS[2], 16, by_id, temperature=0, stop_ids=[ids[3]]))
    drain(s)
    assert out.text == free[: free.index(stop)] and out.last.finish_reason == "stop"
    assert by_id.text == tok.decode(ids[:k]) and by_id.last.finish_reason == "stop"
    assert by_id.last.completion_tokens == k  # the stop id is not counted


def test_cancel_frees_the_row_at_the_next_step():
    model, tok = tiny_model(), byte_tokenizer()
    s = Scheduler(Engine(model), tok, max_batch=2)
    a, b, c = Collect(), Collect(), Collect()
    ra = Job(PROMPTS[0], 30, a, temperature=0)
    s.submit(ra)
    s.submit(Job(PROMPTS[1], 30, b, temperature=0))
    s.submit(Job(PROMPTS[3], 5, c, temperature=0))
    s.run_once()
    assert s.engine.active == 2 and s.load()["waiting"] == 1
    s.cancel(ra)
    s.run_once()  # a leaves, c joins in its row
    n_a = len(a.updates)
    assert s.load()["waiting"] == 0 and s.engine.active == 2
    drain(s)
    assert len(a.updates) == n_a and not a.done.is_set()  # a cancelled request gets nothing more
    assert c.text == alone(model, tok, PROMPTS[3], 5, temperature=0)
    assert b.text == alone(model, tok, PROMPTS[1], 30, temperature=0)


def test_forced_tokens_are_fed_before_sampling_again():
    """A tool forcing ids after the 3rd token: the row continues as if those ids had been generated."""
    model, tok = tiny_model(), byte_tokenizer()
    forced = list(b"=42;")
    seen: list[int] = []

    def tool(t: int) -> list[int] | None:
        seen.append(t)
        return forced if len(seen) == 3 else None

    out, other = Collect(), Collect()
    s = Scheduler(Engine(model), tok, max_batch=2)
    s.submit(Job(PROMPTS[4], 3 + len(forced) + 6, out, temperature=0, tool=tool))
    s.submit(Job(PROMPTS[0], 12, other, temperature=0))
    drain(s)
    head = alone_ids(model, tok, PROMPTS[4], 3, temperature=0)
    tail = alone_ids(model, tok, PROMPTS[4] + head + forced, 6, temperature=0)
    assert out.text == tok.decode(head + forced + tail)
    assert out.last.completion_tokens == 3 + len(forced) + 6 and len(seen) == 3 + 5  # not forced ids, nor the last token
    assert other.text == alone(model, tok, PROMPTS[0], 12, temperature=0)


def test_one_failing_request_does_not_disturb_the_others():
    model, tok = tiny_model(), byte_tokenizer()

    def broken_tool(t: int) -> list[int] | None:
        raise RuntimeError("tool exploded")

    s = Scheduler(Engine(model), tok, max_batch=3)
    bad, good = Collect(), [Collect(), Collect()]
    s.submit(Job(PROMPTS[0], 10, good[0], temperature=0))
    s.submit(Job(PROMPTS[1], 10, bad, temperature=0, tool=broken_tool))
    s.submit(Job(PROMPTS[2], 10, good[1], temperature=0))
    drain(s)
    assert bad.last.finish_reason == "error" and "tool exploded" in bad.last.error
    assert good[0].text == alone(model, tok, PROMPTS[0], 10, temperature=0)
    assert good[1].text == alone(model, tok, PROMPTS[2], 10, temperature=0)


def test_limits_queue_and_context():
    model, tok = tiny_model(), byte_tokenizer()
    s = Scheduler(Engine(model), tok, max_batch=1, max_queue=2)
    for _ in range(2):
        s.submit(Job([1, 2], 2, Collect()))
    with pytest.raises(QueueFull, match="max_queue=2"):
        s.submit(Job([1, 2], 2, Collect()))
    with pytest.raises(ValueError, match=r"\(40 tokens\) plus max_tokens \(9\) has 49 tokens .* is 48"):
        s.check(40, 9)
    with pytest.raises(ValueError, match="out of range"):
        Scheduler(Engine(model), tok).submit(Job([300], 2, Collect()))
    with pytest.raises(ValueError, match="max_tokens must be a positive integer"):
        Job([1], 0, Collect())
    with pytest.raises(ValueError, match="temperature"):
        Job([1], 3, Collect(), temperature=-1)
    with pytest.raises(ValueError, match="max_batch"):
        Scheduler(Engine(model), tok, max_batch=0)


def test_thread_runs_requests_and_stop_cancels_the_rest():
    model, tok = tiny_model(), byte_tokenizer()
    s = Scheduler(Engine(model), tok, max_batch=2)
    s.start()
    try:
        outs = [Collect() for _ in range(5)]
        for p, o in zip(PROMPTS, outs):
            s.submit(Job(p, 8, o, temperature=0))
        for p, o in zip(PROMPTS, outs):
            assert o.done.wait(30)
            assert o.text == alone(model, tok, p, 8, temperature=0)
        long = Collect()
        s.submit(Job(PROMPTS[0], 30, long, temperature=0))
    finally:
        s.stop()
    assert long.done.is_set() and long.last.finish_reason in ("cancelled", "length")
    with pytest.raises(RuntimeError, match="stopping"):
        s.submit(Job([1], 1, Collect()))


def test_engine_release_moves_the_last_row():
    """After a middle row is released, every live row's next logits still equal the model's on its sequence."""
    model = tiny_model(n_kv_heads=2)
    eng = Engine(model)
    eng.open_slots(3)
    seqs = [list(range(1, 9)), list(range(30, 35)), list(range(50, 61))]
    for q in seqs:
        eng.admit(q)
    assert eng.release(1) == 2 and eng.active == 2  # row 2 moved into row 1
    live = [seqs[0], seqs[2]]
    nxt = torch.tensor([3, 4])
    with torch.inference_mode():
        got = eng.step(nxt)
        want = torch.stack([model(torch.tensor([q + [t]]))[0, -1] for q, t in zip(live, nxt.tolist())])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert eng.release(1) is None and eng.free_slots == 2


def test_a_failure_while_joining_ends_that_request_only(monkeypatch):
    """Anything that fails while one request joins the batch (here: building its row) ends that request with an
    error; the rows already running and the requests after it go on as if it had never come."""
    from lmforge.generate import scheduler as scheduler_module

    model, tok = tiny_model(), byte_tokenizer()
    real_row = scheduler_module._row

    def row(req, device, *args):
        if req.seed == 666:
            raise RuntimeError("injected fault while joining")
        return real_row(req, device, *args)

    monkeypatch.setattr(scheduler_module, "_row", row)
    s = Scheduler(Engine(model), tok, max_batch=3)
    first, bad, after = Collect(), Collect(), Collect()
    s.submit(Job(PROMPTS[0], 12, first, temperature=0))
    s.run_once()
    s.run_once()  # the first request is running
    s.submit(Job(PROMPTS[1], 12, bad, temperature=0, seed=666))
    s.submit(Job(PROMPTS[2], 12, after, temperature=0))
    drain(s)
    assert bad.last.finish_reason == "error" and "injected fault while joining" in bad.last.error
    assert len(bad.updates) == 1 and s.engine.active == 0
    for out, p in ((first, PROMPTS[0]), (after, PROMPTS[2])):
        assert out.text == alone(model, tok, p, 12, temperature=0) and out.last.finish_reason == "length"



def raise_once(monkeypatch, owner, name: str, exc: BaseException) -> None:
    """``owner.name`` raises ``exc`` the next time it is called, then works as before."""
    real, armed = getattr(owner, name), [True]

    def once(*args, **kw):
        if armed and armed.pop():
            raise exc
        return real(*args, **kw)

    monkeypatch.setattr(owner, name, once)


def extra_row_once(monkeypatch, engine) -> None:
    """A slip to be caught: ``engine.admit`` takes one row more than it says, once."""
    real, armed = engine.admit, [True]

    def admit(*args):
        row, logits = real(*args)
        if armed and armed.pop():
            engine.fork(row)
        return row, logits

    monkeypatch.setattr(engine, "admit", admit)


@pytest.mark.parametrize("where", ["_row", "lookup", "restore", "admit", "store", "fork", "slip"])
def test_a_failure_at_any_step_of_joining_frees_the_rows_it_took(monkeypatch, where):
    """Two samples of one prompt join beside a running request and fail at one step of joining (their rows' state,
    the prefix cache's lookup, its restore, the prefill, the cache's store, the copy for the second sample, or an
    admit that took a row more than it said): both get one error update, the engine never has more live rows than
    the scheduler, and the running request and the next one give the tokens they give alone (no other context).
    A store that failed after the prefill used to leave its row taken: the next request was stepped in it."""
    from lmforge.generate import scheduler as scheduler_module

    model, tok = tiny_model(), byte_tokenizer()
    s = Scheduler(Engine(model), tok, max_batch=4, prefix_cache=PrefixCache(1 << 20, block=4), speculative=False)
    running, bad, after = Collect(), [Collect(), Collect()], Collect()
    s.submit(Job(PROMPTS[2], 12, running, temperature=1.0, seed=1))
    s.run_once()
    s.run_once()
    owner = {"_row": scheduler_module, "lookup": s.prefix_cache, "restore": s.prefix_cache, "admit": s.engine,
             "store": s.prefix_cache, "fork": s.engine}.get(where)
    if owner is None:
        extra_row_once(monkeypatch, s.engine)
    else:
        raise_once(monkeypatch, owner, where, MemoryError(f"injected at {where}"))
    s.submit_many([Job(PROMPTS[0], 12, o, temperature=1.0, seed=2 + k) for k, o in enumerate(bad)])
    s.submit(Job(PROMPTS[4], 12, after, temperature=1.0, seed=5))
    for _ in range(100):
        busy = s.run_once()
        assert s.engine.active == len(s._rows)
        if not busy and not s.load()["waiting"]:
            break
    for o in bad:
        assert len(o.updates) == 1 and o.last.finish_reason == "error", o.updates
        assert ("joining took engine rows" if owner is None else f"injected at {where}") in o.last.error
    assert running.text == alone(model, tok, PROMPTS[2], 12, temperature=1.0, seed=1)
    assert after.text == alone(model, tok, PROMPTS[4], 12, temperature=1.0, seed=5)
    assert running.last.finish_reason == after.last.finish_reason == "length" and s.engine.active == 0


def test_engine_and_scheduler_rows_that_disagree_end_the_batch_loudly():
    """A row the engine holds for no request (a slip outside joining) is caught at the next step: a RuntimeError
    (the engine thread's loop then ends the live requests and reopens the engine) instead of a step that feeds one
    request's token into another's row."""
    model, tok = tiny_model(), byte_tokenizer()
    s = Scheduler(Engine(model), tok, max_batch=3)
    live = Collect()
    s.submit(Job(PROMPTS[0], 12, live, temperature=0))
    s.run_once()
    s.engine.admit(PROMPTS[1])
    with pytest.raises(RuntimeError, match="the engine has 2 live rows but the scheduler 1"):
        s.run_once()
    s.start()  # the loop recovers: the live request ends with an error, the next one runs
    try:
        assert live.done.wait(30) and live.last.finish_reason == "error" and "live rows" in live.last.error
        nxt = Collect()
        s.submit(Job(PROMPTS[4], 6, nxt, temperature=0))
        assert nxt.done.wait(30) and nxt.text == alone(model, tok, PROMPTS[4], 6, temperature=0)
    finally:
        s.stop()


def test_cache_salt_is_checked():
    """``cache_salt``: None or a string of 1 to MAX_SALT_CHARS characters (one ValueError otherwise); requests that
    join together share one prefill, so they must share the salt too."""
    Job([1], 2, Collect(), cache_salt="x" * MAX_SALT_CHARS)
    for bad in ("", "x" * (MAX_SALT_CHARS + 1), b"tenant", 7, ["a"]):
        with pytest.raises(ValueError, match=f"cache_salt must be a string of 1 to {MAX_SALT_CHARS} characters"):
            Job([1], 2, Collect(), cache_salt=bad)
    s = Scheduler(Engine(tiny_model()), byte_tokenizer(), max_batch=2)
    with pytest.raises(ValueError, match="same cache_salt"):
        s.submit_many([Job([1], 2, Collect(), cache_salt="a"), Job([1], 2, Collect())])

def test_a_cancelled_waiting_request_leaves_the_queue_at_once():
    """Its place is free at once: the queue count drops and another request fits, with no engine step."""
    model, tok = tiny_model(), byte_tokenizer()
    s = Scheduler(Engine(model), tok, max_batch=1, max_queue=2)
    reqs = [Job([1, 2], 2, Collect()) for _ in range(2)]
    for r in reqs:
        s.submit(r)
    with pytest.raises(QueueFull):
        s.submit(Job([1, 2], 2, Collect()))
    s.cancel(reqs[1])
    assert s.load()["waiting"] == 1
    late = Collect()
    s.submit(Job([3, 4], 2, late, temperature=0))  # no QueueFull
    drain(s)
    assert late.text == alone(model, tok, [3, 4], 2, temperature=0) and not reqs[1].emit.updates


def test_seed_range_tiny_temperature_and_token_text():
    """Seeds are signed 64-bit integers (both ends work; beyond is a ValueError at once, not in the engine
    thread); a temperature below the floor is greedy; ``token_text`` shows ids as other text."""
    model, tok = tiny_model(), byte_tokenizer()
    for seed in (2 ** 63, -(2 ** 63) - 1, 2 ** 70, 1.5):
        with pytest.raises(ValueError, match=r"seed must be an integer in \[-2\*\*63, 2\*\*63 - 1\]"):
            Job([1], 2, Collect(), seed=seed)
    greedy = alone_ids(model, tok, PROMPTS[0], 8, temperature=0)
    s = Scheduler(Engine(model), tok, max_batch=4)
    outs = [Collect() for _ in range(4)]
    s.submit(Job(PROMPTS[0], 8, outs[0], temperature=1e-40, seed=2 ** 63 - 1))
    s.submit(Job(PROMPTS[0], 8, outs[1], temperature=1.0, top_p=1e-50, seed=-(2 ** 63)))
    shown = {greedy[0]: "<first>", greedy[3]: ""}
    s.submit(Job(PROMPTS[0], 8, outs[2], temperature=0, token_text=shown))
    s.submit(Job(PROMPTS[0], 8, outs[3], temperature=0.9, seed=2 ** 63 - 1))
    drain(s)
    assert outs[0].text == outs[1].text == tok.decode(greedy)
    want = b"".join(shown[t].encode() if t in shown else tok.decode_bytes([t]) for t in greedy)
    assert outs[2].text == want.decode(errors="replace") and outs[3].last.finish_reason == "length"


# --------------------------------------------------------------------------------------------------
# Batch invariance, constraints, log-probabilities, several samples of one prompt
# --------------------------------------------------------------------------------------------------
def _step_alone_and_batched(engine, prompts, feeds, sizes, seed=0):
    """Each prompt's next-token logits after one step, alone and inside random mixed batches of ``sizes``:
    ``[(row, alone logits, batched logits)]`` for every row of every batch."""
    import random

    def run(idx):
        engine.open_slots(len(idx))
        for i in idx:
            engine.admit(prompts[i])
        return engine.step(torch.tensor([feeds[i] for i in idx]))

    alone = [run([i])[0].clone() for i in range(len(prompts))]
    rng = random.Random(seed)
    out = []
    for B in sizes:
        idx = rng.sample(range(len(prompts)), B)
        logits = run(idx)
        out += [(i, alone[i], logits[k].clone()) for k, i in enumerate(idx)]
    return out


def test_decode_step_is_batch_invariant():
    """The C++ decode step gives a row the same logits, bit for bit, alone and in batches of 2..16 mixed rows:
    what a seeded sample needs to be the same whatever else is in the batch."""
    import random

    from lmforge.generate.packed import kernel_available

    if not kernel_available():
        pytest.skip("the C++ extension is not built")
    rng = random.Random(1)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(1, 8))] for _ in range(16)]
    engine = Engine(tiny_model(), use_kernel=True)  # (every weight dtype runs the same tiles)
    differ = [i for i, a, b in _step_alone_and_batched(engine, prompts, [7 + i for i in range(16)], range(2, 17))
              if not torch.equal(a, b)]
    assert differ == []


def test_linear_rows_is_batch_invariant_across_tile_sizes():
    """One packed product, row 0 alone vs among M = 2..9 rows (1-, 2-row and full tiles): the same bits, the
    property the step's batch invariance rests on."""
    from lmforge.generate.packed import PackedLinear, kernel_available

    if not kernel_available():
        pytest.skip("the C++ extension is not built")
    torch.manual_seed(0)
    p = PackedLinear(torch.randn(64, 96))
    x = torch.randn(9, 96)
    alone = p(x[:1], threads=1)[0]
    assert all(torch.equal(p(x[:m], threads=1)[0], alone) for m in range(2, 10))


def test_seeded_tokens_alone_and_in_a_batch_of_16_mixed_requests():
    """A seeded request's tokens equal its tokens alone while 15 other requests (greedy, other seeds, other
    temperatures, constrained or not) share its steps."""
    model, tok = tiny_model(), byte_tokenizer()

    def run(reqs):
        s = Scheduler(Engine(model), tok, max_batch=16)
        outs = [Collect() for _ in reqs]
        for (p, kw), out in zip(reqs, outs):
            s.submit(Job(p, 10, out, **kw))
        drain(s)
        return [o.text for o in outs]

    target = (list(b"seeded"), {"temperature": 0.9, "seed": 1234, "top_p": 0.95})
    others = [(list(b"other %d" % k), {"temperature": 0.3 + 0.1 * k, "seed": k} if k % 2 else {"temperature": 0})
              for k in range(15)]
    alone = run([target])[0]
    assert run([target] + others)[0] == alone
    assert run(others[:7] + [target] + others[7:])[7] == alone


def _grammars(tok):
    pytest.importorskip("llguidance")
    from lmforge.generate.constraints import Grammars

    return Grammars(tok)


def test_a_constrained_row_writes_schema_valid_json_beside_free_rows():
    """A JSON Schema region from the first token to the stop id: the untrained model's text is valid JSON under
    the schema (greedy and sampled), while a free row in the same batch keeps its unconstrained text."""
    import json

    from lmforge.generate.constraints import RowConstraint, json_grammar

    model, tok = tiny_model(), byte_tokenizer()
    grammars = _grammars(tok)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 3},
                                               "ok": {"type": "boolean"}, "tags": {"type": "array", "maxItems": 1,
                                                                                   "items": {"enum": ["a", "é"]}}},
              "required": ["name", "ok", "tags"], "additionalProperties": False}
    eot = tok.eot_id
    s = Scheduler(Engine(model), tok, max_batch=4)
    outs = [Collect() for _ in range(4)]
    for k, out in enumerate(outs[:3]):
        c = RowConstraint(grammars, json_grammar(schema), close_id=eot)
        s.submit(Job(list(b"j"), CTX - 1, out, temperature=0 if k == 0 else 1.0, seed=k, stop_ids=[eot],
                         constraint=c))
    s.submit(Job(PROMPTS[0], 12, outs[3], temperature=0))
    drain(s)
    for out in outs[:3]:
        assert out.last.finish_reason == "stop", out.text
        doc = json.loads(out.text)
        assert set(doc) == {"name", "ok", "tags"} and len(doc["name"]) <= 3 and isinstance(doc["ok"], bool)
        assert all(t in ("a", "é") for t in doc["tags"]) and len(doc["tags"]) <= 1
    assert outs[3].text == alone(model, tok, PROMPTS[0], 12, temperature=0)
    assert grammars.compiled == 1  # one schema: compiled once, copied for each row


def test_regions_after_a_trigger_are_captured_and_bans_hold():
    """A tool-call-like region: the model may open it with a trigger id; once open, only the grammar's tokens and
    (when it may end) the close id; after it, only the ``after`` ids. Forcing the trigger opens it at once."""
    from lmforge.generate.constraints import RowConstraint, choice_grammar

    model, tok = tiny_model(), byte_tokenizer()
    grammars = _grammars(tok)
    START, CLOSE, END = ord("{"), ord("}"), tok.eot_id
    out = Collect()
    c = RowConstraint(grammars, choice_grammar(["yes", "no"]), close_id=CLOSE, start=START, max_regions=1,
                      after=[START, END], force=[START])
    s = Scheduler(Engine(model), tok, max_batch=2)
    s.submit(Job(list(b"q"), 20, out, temperature=1.0, seed=5, stop_ids=[END], constraint=c, capture_regions=True))
    drain(s)
    regions = [r for u in out.updates for r in u.regions]
    assert regions in (["yes"], ["no"]) and out.text == "" and out.last.finish_reason == "stop"
    # never opened: the trigger banned (a tool_choice of none)
    out2 = Collect()
    ban = RowConstraint(grammars, None, start=0)
    logits = torch.zeros(VOCAB)
    logits[0] = 100.0
    s.submit(Job([0], 5, out2, temperature=0, constraint=ban))
    drain(s)
    assert out2.updates and "\x00" not in out2.text
    ban.apply(logits)
    assert logits[0] == float("-inf")


def test_logprobs_are_of_the_distribution_sampled_from():
    """Greedy: the chosen token's log-probability under the model's softmax equals what the Generator's logits
    give; at temperature T with a constraint, the log-probabilities sum to 1 over the allowed tokens only and
    the top alternatives are sorted and include the chosen token when it ranks."""
    import math

    from lmforge.generate.constraints import RowConstraint, regex_grammar

    model, tok = tiny_model(), byte_tokenizer()
    out = Collect()
    s = Scheduler(Engine(model), tok, max_batch=2)
    s.submit(Job(list(b"abc"), 3, out, temperature=0, logprobs=5))
    drain(s)
    lps = [lp for u in out.updates for lp in u.logprobs]
    assert [lp.token for lp in lps] == alone_ids(model, tok, list(b"abc"), 3, temperature=0)
    with torch.no_grad():
        first = torch.log_softmax(model(torch.tensor([list(b"abc")]))[0, -1, : tok.vocab_size].float(), -1)
    assert abs(lps[0].logprob - float(first.max())) < 1e-4
    assert lps[0].top[0][0] == lps[0].token and len(lps[0].top) == 5
    assert [v for _, v in lps[0].top] == sorted((v for _, v in lps[0].top), reverse=True)

    grammars = _grammars(tok)
    out = Collect()
    c = RowConstraint(grammars, regex_grammar("[ab]{4}"), close_id=tok.eot_id)
    s.submit(Job(list(b"x"), 8, out, temperature=0.7, seed=3, stop_ids=[tok.eot_id], constraint=c, logprobs=20))
    drain(s)
    lps = [lp for u in out.updates for lp in u.logprobs]
    assert len(out.text) == 4 and set(out.text) <= {"a", "b"} and len(lps) == 4
    for lp in lps:
        assert {t for t, _ in lp.top} <= {ord("a"), ord("b")}  # nothing outside the mask has a finite logprob
        assert abs(sum(math.exp(v) for _, v in lp.top) - 1) < 1e-5
        assert lp.token in {t for t, _ in lp.top}


def test_several_samples_of_one_prompt_share_one_prefill(monkeypatch):
    """``submit_many``: one prefill (``admit`` once) and ``fork`` for the others; each sample equals the same
    seeded request run alone; a group waits until it fits."""
    model, tok = tiny_model(), byte_tokenizer()
    engine = Engine(model)
    admits = []
    admit = engine.admit
    monkeypatch.setattr(engine, "admit", lambda p: admits.append(list(p)) or admit(p))
    s = Scheduler(engine, tok, max_batch=4)
    outs = [Collect() for _ in range(3)]
    s.submit_many([Job(list(b"share"), 8, o, temperature=1.0, seed=10 + k) for k, o in enumerate(outs)])
    drain(s)
    assert admits == [list(b"share")]
    for k, o in enumerate(outs):
        assert o.text == alone(model, tok, list(b"share"), 8, temperature=1.0, seed=10 + k)
    # the copy is the prefill: a forked row's cache is its source row's, bit for bit, and so are its next logits
    # step after step on the C++ kernels (one row at a time); the PyTorch forward runs the rows as one batched
    # product, whose rounding may differ by row position (torch 2.11's CPU GEMM: 4e-7), so there within 1e-5
    from lmforge.generate.packed import kernel_available

    for use_kernel in (False, True) if kernel_available() else (False,):
        e = Engine(model, use_kernel=use_kernel)
        e.open_slots(3)
        e.admit(list(b"a longer shared prompt"))
        assert e.fork(0) == 1 and e.fork(0) == 2 and e.lengths == [22, 22, 22]
        for cache in (e.cache.k, e.cache.v):
            for row in (1, 2):
                assert torch.equal(cache[:, 0, :, :22], cache[:, row, :, :22])
        for t in (5, 9, 77):
            logits = e.step(torch.tensor([t, t, t]))
            for other in (logits[1], logits[2]):
                if use_kernel:
                    assert torch.equal(logits[0], other)
                else:
                    torch.testing.assert_close(other, logits[0], rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="max_batch"):
        s.submit_many([Job([1], 2, Collect()) for _ in range(5)])
    with pytest.raises(ValueError, match="same prompt"):
        s.submit_many([Job([1], 2, Collect()), Job([2], 2, Collect())])
    assert s.load()["waiting"] == 0


EXIT_WHILE_GENERATING = """
import time
from lmforge.generate.engine import Engine
from lmforge.generate.scheduler import Job, Scheduler
from lmforge.model import ModelConfig, TransformerLM
from lmforge.tokenizer import Tokenizer

tok = Tokenizer({i: bytes([i]) for i in range(256)}, [])
cfg = ModelConfig(vocab_size=256, context_length=4096, d_model=128, n_layers=2, n_heads=2)
s = Scheduler(Engine(TransformerLM(cfg)), tok, max_batch=1)
s.start()
s.submit(Job([65] * 4000, 90, lambda u: u.finish_reason and print(u.finish_reason, flush=True)))
while s.load()["waiting"]:  # the engine thread took it: it is prefilling 4,000 tokens (0.1-0.5 s in one kernel call)
    time.sleep(0.001)
time.sleep(0.01)
print("exiting", flush=True)
"""


def test_the_interpreter_exits_cleanly_while_the_engine_thread_generates():
    """The script returns while the engine thread is inside a long prefill (a kernel call without the GIL): the
    scheduler is stopped and joined at exit (its request cancelled), so the process exits with 0. Left running,
    the daemon thread took the GIL back from the finalizing interpreter and the process died of SIGABRT."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", EXIT_WHILE_GENERATING], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert out.stdout.split() == ["exiting", "cancelled"], out.stdout
