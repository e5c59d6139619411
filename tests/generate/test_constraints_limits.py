"""Constrained decoding against hostile grammars: a grammar that crashes the compiler (only the check process dies),
a compile past its deadline, the cache bounded by bytes, a grammar that fails while decoding, and where ``after``
applies (the server's schema limits: tests/serve/test_limits.py)."""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

import pytest
import torch

llguidance = pytest.importorskip("llguidance")

from lmforge.generate import constraints  # noqa: E402
from lmforge.generate.constraints import (JSON_SEPARATORS, ConstraintError, Grammar, Grammars,  # noqa: E402
                                          RowConstraint, choice_grammar, json_grammar, regex_grammar)

sys.path.insert(0, str(Path(__file__).parents[1]))
from serve_helpers import byte_chat_tokenizer  # noqa: E402

TOK = byte_chat_tokenizer()
END = TOK.special_tokens["<|assistant_end|>"]
START, CLOSE = TOK.special_tokens["<|call_start|>"], TOK.special_tokens["<|call_end|>"]


def ref_chain(n: int, arrays: bool = False) -> dict:
    """The issue's crash schema: ``n`` definitions, each a ``$ref`` to the next (or an array of the next)."""
    defs = {f"d{i}": {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}} if arrays
            else {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def patterns(n: int, tag: str = "") -> dict:
    """``n`` required string properties, each with its own pattern: a slow compile within the limits."""
    return {"type": "object", "required": [f"p{i}" for i in range(n)], "properties": {
        f"p{i}": {"type": "string", "pattern": f"^([a-z]{{1,20}}@[a-z0-9]{{{i % 7 + 2},20}}\\.(com|org|n{i}{tag}))$"}
        for i in range(n)}}


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    g = Grammars(TOK)
    yield g
    g.check.close()


def test_a_grammar_that_crashes_the_compiler_costs_only_the_check_process(grammars):
    """The crash schema's grammar handed over directly (past the schema limits): the check process dies of
    it, the compile is refused saying so, and the next grammar compiles in a new check process."""
    text = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(ref_chain(3000)), overrides=JSON_SEPARATORS)
    grammars.compile(json_grammar({"type": "string"}))
    started = grammars.check.started
    with pytest.raises(ConstraintError, match="crashed the grammar compiler"):
        grammars.compile(Grammar(text, "JSON Schema"))
    m = grammars.compile(json_grammar({"type": "integer", "minimum": 3}))
    assert not m.is_error() and grammars.check.started == started + 1


def test_a_compile_past_the_deadline_is_refused():
    g = Grammars(TOK, check_timeout=0.05)
    try:
        with pytest.raises(ConstraintError, match="took over 0.05 s"):
            g.compile(json_grammar(patterns(1000)))
        assert not g.compile(json_grammar({"type": "boolean"})).is_error()  # a new check process
    finally:
        g.check.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priorities are Linux's")
def test_compiles_run_below_the_callers_priority(grammars, monkeypatch):
    """A long compile must yield the cores to the server's event loop and decoding threads: the check process
    and the in-process compile thread run NICE below the caller (the caller's own priority unchanged)."""
    from lmforge.generate.grammar_check import NICE

    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen = []

    class Spy:  # llguidance, recording the priority of the thread each compile runs on
        def __getattr__(self, name):
            return getattr(llguidance, name)

        def LLMatcher(self, *args, **kwargs):  # noqa: N802
            seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
            return llguidance.LLMatcher(*args, **kwargs)

    grammar = json_grammar({"type": "array", "items": {"type": "integer", "maximum": 7}})
    monkeypatch.setattr(constraints, "_llg", lambda: Spy())
    grammars.compile(grammar)
    assert seen == [min(mine + NICE, 19)]
    assert os.getpriority(os.PRIO_PROCESS, grammars.check._proc.pid) == min(os.getpriority(os.PRIO_PROCESS, 0)
                                                                           + NICE, 19)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine


def test_errors_are_one_bounded_line(grammars):
    """llguidance's errors can hold the whole grammar and parser state: only the first line, capped, is kept."""
    opt = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(500)}}
    with pytest.raises(ConstraintError, match="Current row has") as e:
        grammars.compile(json_grammar(opt))  # found by the check's probe: it fails only once decoding starts
    assert "\n" not in str(e.value) and len(str(e.value)) < 400
    for bad in (lambda: choice_grammar(["a\ud800"]), lambda: regex_grammar("a\udfff")):
        with pytest.raises(ConstraintError, match="valid Unicode"):
            bad()


def test_the_cache_is_bounded_by_bytes():
    schemas = [{"enum": [f"k{k}-{i}" for i in range(10)]} for k in range(6)]  # grammars of one length
    g = Grammars(TOK, max_cache_bytes=3 * Grammars.entry_bytes(json_grammar(schemas[0])), isolate=False)
    for s in schemas:
        g.compile(json_grammar(s))
        assert g.cached_bytes <= g.max_cache_bytes
    assert g.compiled == 6 and len(g._cache) == 3
    g.compile(json_grammar(schemas[5]))  # recent: cached
    assert g.compiled == 6
    g.compile(json_grammar(schemas[0]))  # dropped first: compiled again
    assert g.compiled == 7
    big = json_grammar({"enum": [f"value-{i:05d}" for i in range(1500)]})
    assert Grammars.entry_bytes(big) > g.max_cache_bytes
    g.compile(big)  # larger than the whole budget: compiled, never cached
    assert g.cached_bytes <= g.max_cache_bytes and big.text not in g._cache


def test_a_grammar_failing_while_decoding_is_an_error_never_a_stop():
    """Grammars that compile but fail once decoding starts (compiled here without the check's probe): the
    row's mask raises, naming the failure, instead of allowing only the close token (which ended such rows
    with "stop" and no document)."""
    g = Grammars(TOK, isolate=False)
    self_ref = llguidance.LLMatcher.grammar_from_json_schema('{"$ref": "#"}', overrides=JSON_SEPARATORS)
    c = RowConstraint(g, Grammar(self_ref, "JSON Schema"), close_id=END, source="response_format")
    with pytest.raises(ConstraintError, match="cannot be decoded"):
        c.apply(torch.zeros(TOK.vocab_size))
    assert c.failure is not None and "\n" not in c.failure
    opt = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(500)}}
    c = RowConstraint(g, json_grammar(opt), close_id=END)
    c.apply(torch.zeros(TOK.vocab_size))
    with pytest.raises(ConstraintError, match="Current row has"):
        c.take(ord("{"))
    assert c.failure is not None


def test_after_applies_only_once_a_region_closed(grammars):
    """Before the first call anything not banned may be said; after one, only ``after`` (another call or the end)."""
    c = RowConstraint(grammars, choice_grammar(["go"]), close_id=CLOSE, start=START, after=[START, END])
    logits = torch.zeros(TOK.vocab_size)
    c.apply(logits)
    assert logits[ord("h")] == 0 and logits[START] == 0  # text before a call is allowed
    for t in (START, *b"go", CLOSE):
        c.take(t)
    assert c.regions == [list(b"go")] and c.partial_text() == ""
    logits = torch.zeros(TOK.vocab_size)
    c.apply(logits)
    assert torch.isinf(logits).sum() == TOK.vocab_size - 2 and logits[START] == 0 and logits[END] == 0
    c.take(START)
    c.take(ord("g"))
    assert c.partial_text() == "g"  # a call cut here: what it had generated
