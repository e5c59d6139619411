"""Constrained decoding: which tokens a row may sample next, from a JSON Schema, a regular expression or a choice list.

The grammar work is llguidance's (``pip install 'lmforge[serve]'``): it compiles a JSON Schema, a regex or a Lark
grammar and, for a parser state, computes the set of vocabulary tokens whose bytes keep the text a prefix of some
valid document (multi-byte and partial-UTF-8 tokens included). lmforge's part is the integration:

* :class:`Grammars` hands llguidance the tokenizer's vocabulary exactly, once: token ``i``'s bytes for every
  ordinary token, the special tokens marked special (never allowed inside a grammar), and one extra id past the
  vocabulary that stands for "the text may end here"; and it compiles each grammar once, keeping the compiled
  matcher in an LRU cache keyed by the grammar's canonical text, so a schema sent again costs a copy.
* :class:`RowConstraint` is one row's state (a fresh matcher copied from the cache per region): outside a grammar
  region it only bans tokens; inside one it allows what the matcher allows, and the region's ``close_id`` only
  where the matcher accepts. :meth:`RowConstraint.apply` sets the logits of every other token to ``-inf`` in
  place, so the row's sampler (temperature, top-p, its own seeded generator) draws from the constrained
  distribution; :meth:`RowConstraint.take` advances the state with the token taken.

A region opens at once (``start=None``: a response format) or after a trigger token (a tool call's
``<|call_start|>``); ``force`` lists tokens fed before the row samples (a tool call the request requires).

Why llguidance: on lmforge's byte-level vocabularies it gave no invalid document where xgrammar 0.2.8 let raw
control characters into JSON strings; it compiles a schema in about a millisecond (xgrammar ~0.1 s, outlines-core
~0.3 s); its per-token mask time is like theirs (tens of microseconds); it depends on nothing (xgrammar pulls in
triton, ~1 GB); and it refuses the JSON-Schema keywords it does not implement by name, which the server turns into
a 400 naming the keyword. Figures: ``benchmarks/bench_constrained.py --libraries``, docs/benchmarks.md.
"""

from __future__ import annotations

import collections
import json
import re
import threading
from dataclasses import dataclass, field
from typing import Any, Collection, Sequence

import torch

from lmforge.tokenizer import Tokenizer

__all__ = ["ConstraintError", "Grammar", "Grammars", "RowConstraint", "choice_grammar", "json_grammar",
           "regex_grammar"]

JSON_SEPARATORS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
"""How constrained JSON is laid out: Python's ``json.dumps`` defaults (``", "`` and ``": "``, no other
whitespace), the layout the chat format renders tool-call arguments in."""


class ConstraintError(ValueError):
    """A grammar that cannot be used: ``keyword`` names the JSON-Schema keyword at fault when there is one."""

    def __init__(self, message: str, keyword: str | None = None) -> None:
        super().__init__(message)
        self.keyword = keyword


@dataclass(frozen=True)
class Grammar:
    """A grammar in llguidance's format (``text``) and what it was made from (``what``: for messages)."""

    text: str
    what: str


def _llg() -> Any:
    try:
        import llguidance
    except ImportError:  # the optional extra
        raise ConstraintError("constrained decoding needs llguidance: pip install 'lmforge[serve]'") from None
    return llguidance


_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[([^\]]*)\]")


def json_grammar(schema: Any) -> Grammar:
    """The grammar of JSON documents valid under ``schema`` (a JSON Schema as a dict; ``True``/``{}``: any JSON),
    laid out as :data:`JSON_SEPARATORS`. ``ConstraintError`` for a schema that is not an object; unsupported
    keywords are found when the grammar is compiled (:meth:`Grammars.compile`)."""
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise ConstraintError(f"a JSON Schema must be an object, got {type(schema).__name__} {schema!r:.60}")
    try:
        text = _llg().LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=JSON_SEPARATORS)
    except ValueError as e:
        raise ConstraintError(f"the JSON Schema is not valid: {e}") from None
    return Grammar(text, "JSON Schema")


def regex_grammar(pattern: str) -> Grammar:
    """The grammar of texts matching ``pattern`` as a whole (Rust ``regex`` syntax, no look-around)."""
    if not isinstance(pattern, str) or not pattern:
        raise ConstraintError(f"a regular expression must be a non-empty string, got {pattern!r:.60}")
    return Grammar(_llg().LLMatcher.grammar_from_regex(pattern), "regular expression")


def choice_grammar(choices: Sequence[str]) -> Grammar:
    """The grammar of exactly one of ``choices`` (non-empty strings)."""
    if (not isinstance(choices, (list, tuple)) or not choices
            or any(not isinstance(c, str) or not c for c in choices)):
        raise ConstraintError(f"a choice list must be a non-empty list of non-empty strings, got {choices!r:.60}")
    alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in dict.fromkeys(choices))
    return Grammar(_llg().LLMatcher.grammar_from_lark(f"start: {alternatives}\n"), "choice list")


class Grammars:
    """llguidance's view of ``tokenizer``'s vocabulary (built once) and a cache of compiled grammars.

    Token ``i < vocab_size`` is its bytes (``tokenizer.decode_bytes([i])``), a special token is ``0xFF`` + its
    name (llguidance's mark for tokens no grammar text can contain), and id ``vocab_size`` (past the vocabulary,
    never sampled) is the end of the constrained text: a mask allows it where the document may end.
    Thread-safe. ``max_cached`` compiled grammars are kept (least recently used dropped first).
    """

    def __init__(self, tokenizer: Tokenizer, max_cached: int = 256) -> None:
        llg = _llg()
        self.vocab_size = tokenizer.vocab_size
        self.end = self.vocab_size  # "the text may end here"
        special = set(tokenizer.special_tokens.values())
        names = {i: s for s, i in tokenizer.special_tokens.items()}
        tokens = [b"\xff" + names[i].encode() if i in special else tokenizer.decode_bytes([i])
                  for i in range(self.vocab_size)] + [b"\xff<|end of constrained text|>"]

        class Vocabulary:  # what llguidance.TokenizerWrapper reads
            eos_token_id, bos_token_id = self.end, None
            special_token_ids = sorted(special | {self.end})

            def __init__(self) -> None:
                self.tokens = tokens

            def __call__(self, text: bytes | str) -> list[int]:  # only for llguidance's own helpers
                if isinstance(text, bytes):
                    text = text.decode("utf-8", "replace")
                return tokenizer.encode(text, special="plain")

        self.tokens = tokens
        self.special = frozenset(special)
        self.lltokenizer = llg.LLTokenizer(llg.TokenizerWrapper(Vocabulary()), n_vocab=self.vocab_size + 1)
        self.words = (self.vocab_size + 1 + 31) // 32  # int32 words of a bitmask
        self._shifts = torch.arange(32, dtype=torch.int32)
        self._cache: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.max_cached = max_cached
        self.compiled = 0  # grammars compiled (cache misses), for tests and benchmarks

    def compile(self, grammar: Grammar) -> Any:
        """The compiled matcher of ``grammar`` in its initial state (from the cache, or compiled now): copy it
        (``deep_copy()``) for each row. ``ConstraintError`` saying what is wrong, naming the keyword when a JSON
        Schema uses one llguidance does not implement."""
        with self._lock:
            m = self._cache.get(grammar.text)
            if m is not None:
                self._cache.move_to_end(grammar.text)
                return m
        llg = _llg()
        m = llg.LLMatcher(self.lltokenizer, grammar.text, log_level=0)
        if m.is_error():
            err = m.get_error()
            found = _UNIMPLEMENTED.search(err)
            if found:
                keys = [k.strip().strip('"') for k in found.group(1).split(",") if k.strip()]
                raise ConstraintError(f"the {grammar.what} uses {', '.join(keys)}, which constrained decoding does "
                                      f"not support; remove {'it' if len(keys) == 1 else 'them'}",
                                      keys[0] if keys else None)
            raise ConstraintError(f"the {grammar.what} cannot be used: {err.splitlines()[0][:300]}")
        with self._lock:
            self.compiled += 1
            self._cache[grammar.text] = m
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        return m

    def allowed(self, matcher: Any) -> torch.Tensor:
        """The matcher's next-token set as a bool tensor ``(vocab_size + 1,)`` (the last entry: may end here)."""
        words = torch.empty(self.words, dtype=torch.int32)
        matcher.unsafe_compute_mask_ptr(words.data_ptr(), self.words * 4)
        bits = (words[:, None] >> self._shifts) & 1  # (words, 32), little-endian bits: token 32w + b
        return bits.reshape(-1)[: self.vocab_size + 1].bool()


@dataclass
class RowConstraint:
    """One row's constraint (see the module docstring).

    ``grammar``'s regions open at once (``start is None``) or each time ``start`` is taken, and close when
    ``close_id`` is taken (allowed only where the grammar may end; while a region is open nothing else outside
    the grammar is allowed). At most ``max_regions`` regions open (then ``start`` is banned). Outside regions
    ``banned`` ids are never allowed and, after a region closed, only ``after`` ids are (None: anything not
    banned). ``force``: ids fed before the row samples anything. ``regions`` holds each closed region's ids.
    """

    grammars: Grammars
    grammar: Grammar | None
    close_id: int | None = None
    start: int | None = None
    max_regions: int | None = None
    banned: Collection[int] = ()
    after: Collection[int] | None = None
    force: Sequence[int] = ()
    regions: list[list[int]] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        if self.grammar is None and self.start is None:
            raise ValueError("a constraint without a grammar only bans tokens: give start (the banned trigger)")
        if self.grammar is not None and self.close_id is None:
            raise ValueError("a grammar region needs close_id, the token that ends it")
        # ConstraintError now, before the row is admitted
        self._initial = None if self.grammar is None else self.grammars.compile(self.grammar)
        self._matcher: Any = None  # the open region's matcher, or None outside regions
        self._ids: list[int] = []
        self.banned = frozenset(self.banned)
        self.after = None if self.after is None else frozenset(self.after)
        if self.start is None:
            self._open()

    def _open(self) -> None:
        self._matcher = self._initial.deep_copy()
        self._ids = []

    @property
    def in_region(self) -> bool:
        """Whether a grammar region is open (its tokens are constrained by the grammar)."""
        return self._matcher is not None

    def _exhausted(self) -> bool:
        return self._initial is None or (self.max_regions is not None and len(self.regions) >= self.max_regions)

    def apply(self, logits: torch.Tensor) -> None:
        """Set the logits ``(V,)`` of the tokens not allowed next to ``-inf``, in place (``V`` may exceed the
        tokenizer's vocabulary: the extra ids are never allowed)."""
        V, n = logits.shape[0], self.grammars.vocab_size
        if self._matcher is not None:
            allowed = self.grammars.allowed(self._matcher)
            if not bool(allowed.any()):  # a matcher in an error state: nothing can follow
                raise RuntimeError(f"the {self.grammar.what} allows no next token: {self._matcher.get_error()}")
            may_end = bool(allowed[n])
            keep = torch.zeros(V, dtype=torch.bool)
            keep[:n] = allowed[:n]
            keep[self.close_id] = may_end
            logits.masked_fill_(~keep, float("-inf"))
            return
        if self.regions and self.after is not None:
            keep = torch.zeros(V, dtype=torch.bool)
            keep[list(self.after)] = True
            if self.start is not None and self._exhausted():
                keep[self.start] = False
            logits.masked_fill_(~keep, float("-inf"))
            return
        ban = set(self.banned)
        if self.start is not None and self._exhausted():
            ban.add(self.start)
        if ban:
            logits[list(ban)] = float("-inf")

    def take(self, token: int) -> None:
        """Advance by the token the row took (sampled under :meth:`apply`'s mask, or forced)."""
        if self._matcher is None:
            if token == self.start and not self._exhausted():
                self._open()
            return
        if token == self.close_id:
            self.regions.append(self._ids)
            self._matcher = None
            return
        if not self._matcher.consume_token(token):  # a forced token the grammar refuses: an engine bug
            raise RuntimeError(f"token {token} is not allowed by the {self.grammar.what}: "
                               f"{self._matcher.get_error()}")
        self._ids.append(token)
