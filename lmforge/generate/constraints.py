"""Constrained decoding: which tokens a row may sample next, from a JSON Schema, a regular expression or a choice list.

The grammar work is llguidance's (``pip install 'lmforge[serve]'``): for a parser state it computes the vocabulary
tokens whose bytes keep the text a prefix of some valid document (multi-byte and partial-UTF-8 tokens included).
lmforge's part is the integration: :class:`Grammars` (the vocabulary, compiled grammars) and :class:`RowConstraint`
(one row's mask, applied to its logits in place, so the row's own sampler draws from the constrained distribution).

Hostile grammars: :func:`json_grammar` runs the caller's ``check`` on a schema before llguidance sees it (the
server's limits, :mod:`lmforge.serve.limits`); :class:`Grammars` compiles each new grammar first in a sacrificial
process (:mod:`~lmforge.generate.grammar_check`); a grammar that fails while decoding ends its row with an error,
never a ``stop``. Errors are one bounded line (never llguidance's grammar dump).

Why llguidance (over xgrammar and outlines-core): no invalid document on lmforge's byte-level vocabularies, fast
compiles, no dependencies, and unsupported JSON-Schema keywords refused by name, which the server turns into a 400
naming the keyword. Figures: ``benchmarks/bench_constrained.py --libraries``, docs/benchmarks.md.
"""

from __future__ import annotations

import collections
import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Sequence

import torch

from lmforge.common import is_unicode
from lmforge.generate.grammar_check import LIMITS, GrammarCheck, lower_priority, one_line
from lmforge.tokenizer import Tokenizer

__all__ = ["ConstraintError", "Grammar", "Grammars", "RowConstraint", "choice_grammar", "json_grammar",
           "regex_grammar"]

JSON_SEPARATORS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
"""How constrained JSON is laid out: Python's ``json.dumps`` defaults (``", "`` and ``": "``, no other
whitespace), the layout the chat format renders tool-call arguments in."""


class ConstraintError(ValueError):
    """A grammar that cannot be used: ``keyword`` names the JSON-Schema keyword at fault when there is one,
    ``limit`` the limit a schema is over (a field of :class:`lmforge.serve.limits.SchemaLimits`)."""

    def __init__(self, message: str, keyword: str | None = None, limit: str | None = None) -> None:
        super().__init__(message)
        self.keyword, self.limit = keyword, limit


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


def _refusal(grammar: Grammar, err: str) -> ConstraintError:
    """The ConstraintError for llguidance's error ``err`` on ``grammar`` (one line; unsupported keywords named)."""
    found = _UNIMPLEMENTED.search(err)
    if found:
        keys = [k.strip().strip('"') for k in found.group(1).split(",") if k.strip()]
        return ConstraintError(f"the {grammar.what} uses {one_line(', '.join(keys), 120)}, which constrained "
                               f"decoding does not support; remove {'it' if len(keys) == 1 else 'them'}",
                               keys[0] if keys else None)
    return ConstraintError(f"the {grammar.what} cannot be used: {one_line(err)}")


def json_grammar(schema: Any, check: Callable[[dict[str, Any]], None] | None = None) -> Grammar:
    """The grammar of JSON documents valid under ``schema`` (a JSON Schema as a dict; ``True``/``{}``: any JSON),
    laid out as :data:`JSON_SEPARATORS`. ``ConstraintError`` for a schema that is not an object or that ``check``
    refuses (it raises ``ConstraintError``: a server's limits); unsupported keywords are found when the grammar is
    compiled (:meth:`Grammars.compile`)."""
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise ConstraintError(f"a JSON Schema must be an object, got {type(schema).__name__} {schema!r:.60}")
    if check is not None:
        check(schema)
    try:
        text = _llg().LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=JSON_SEPARATORS)
    except ValueError as e:
        raise ConstraintError(f"the JSON Schema is not valid: {one_line(str(e))}") from None
    return Grammar(text, "JSON Schema")


def regex_grammar(pattern: str) -> Grammar:
    """The grammar of texts matching ``pattern`` as a whole (Rust ``regex`` syntax, no look-around)."""
    if not isinstance(pattern, str) or not pattern or not is_unicode(pattern):
        raise ConstraintError(f"a regular expression must be a non-empty string of valid Unicode, got {pattern!r:.60}")
    return Grammar(_llg().LLMatcher.grammar_from_regex(pattern), "regular expression")


def choice_grammar(choices: Sequence[str]) -> Grammar:
    """The grammar of exactly one of ``choices`` (non-empty strings)."""
    if (not isinstance(choices, (list, tuple)) or not choices
            or any(not isinstance(c, str) or not c for c in choices)):
        raise ConstraintError(f"a choice list must be a non-empty list of non-empty strings, got {choices!r:.60}")
    bad = next((c for c in choices if not is_unicode(c)), None)
    if bad is not None:
        raise ConstraintError(f"choice {bad!r:.60} is not valid Unicode text (a lone surrogate); send UTF-8 text")
    alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in dict.fromkeys(choices))
    return Grammar(_llg().LLMatcher.grammar_from_lark(f"start: {alternatives}\n"), "choice list")


class Grammars:
    """llguidance's view of ``tokenizer``'s vocabulary (built once) and a cache of compiled grammars.

    Token ``i < vocab_size`` is its bytes (``tokenizer.decode_bytes([i])``), a special token is ``0xFF`` + its
    name (llguidance's mark for tokens no grammar text can contain), and id ``vocab_size`` (past the vocabulary,
    never sampled) is the end of the constrained text: a mask allows it where the document may end.
    Each new grammar is compiled first in the check process (module docstring; ``check_timeout`` seconds at most,
    ``isolate=False``: none). Compiled grammars are cached by their text, least recently used dropped first,
    within ``max_cache_bytes`` (each entry counted at :meth:`entry_bytes`). Compiles run one at a time, at the
    lower priority :data:`~lmforge.generate.grammar_check.NICE` gives them. Thread-safe.
    """

    def __init__(self, tokenizer: Tokenizer, max_cache_bytes: int = 256 << 20, check_timeout: float = 10.0,
                 isolate: bool = True) -> None:
        llg = _llg()
        self.vocab_size = tokenizer.vocab_size
        self.end = self.vocab_size  # "the text may end here"
        names = {i: s for s, i in tokenizer.special_tokens.items()}  # the special ids
        self.tokens = [b"\xff" + names[i].encode() if i in names else tokenizer.decode_bytes([i])
                       for i in range(self.vocab_size)] + [b"\xff<|end of constrained text|>"]

        class Vocabulary:  # what llguidance.TokenizerWrapper reads
            eos_token_id, bos_token_id, tokens = self.end, None, self.tokens
            special_token_ids = sorted([*names, self.end])

            def __call__(self, text: bytes | str) -> list[int]:  # llguidance tokenizes forced text with it
                if isinstance(text, bytes):
                    text = text.decode("utf-8", "replace")
                return tokenizer.encode(text, special="plain")

        self.lltokenizer = llg.LLTokenizer(llg.TokenizerWrapper(Vocabulary()), n_vocab=self.vocab_size + 1)
        self.limits = llg.LLParserLimits(**LIMITS)
        self.check = (GrammarCheck(self.tokens, Vocabulary.special_token_ids, self.end, check_timeout) if isolate
                      else None)
        self.words = (self.vocab_size + 1 + 31) // 32  # int32 words of a bitmask
        self._shifts = torch.arange(32, dtype=torch.int32)
        self._cache: collections.OrderedDict[str, tuple[Any, int]] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._compiler = ThreadPoolExecutor(1, "lmforge-grammar", initializer=lower_priority, initargs=(True,))
        self.max_cache_bytes = max_cache_bytes
        self.cached_bytes = 0  # the cache's entries, as entry_bytes counts them
        self.compiled = 0  # grammars compiled (cache misses), for tests and benchmarks

    @staticmethod
    def entry_bytes(grammar: Grammar) -> int:
        """The memory one compiled grammar is counted at: 64 KiB plus 100 bytes per character of its text
        (measured: compiled JSON-Schema grammars take 20-80 bytes of RSS per character of grammar text)."""
        return (64 << 10) + 100 * len(grammar.text)

    def compile(self, grammar: Grammar) -> Any:
        """The compiled matcher of ``grammar`` in its initial state (from the cache, or compiled now): copy it
        (``deep_copy()``) for each row. ``ConstraintError`` saying what is wrong in one line, naming the keyword
        when a JSON Schema uses one llguidance does not implement; a grammar that crashed or timed out the
        check process is refused saying so. Blocks for the compile: call it off an event loop."""
        with self._lock:
            hit = self._cache.get(grammar.text)
            if hit is not None:
                self._cache.move_to_end(grammar.text)
                return hit[0]
        if self.check is not None and (err := self.check.check(grammar.text)) is not None:
            raise _refusal(grammar, err)
        m = self._compiler.submit(_llg().LLMatcher, self.lltokenizer, grammar.text, log_level=0,
                                  limits=self.limits).result()
        if m.is_error():
            raise _refusal(grammar, m.get_error())
        size = self.entry_bytes(grammar)
        with self._lock:
            self.compiled += 1
            if size <= self.max_cache_bytes and grammar.text not in self._cache:
                self._cache[grammar.text] = (m, size)
                self.cached_bytes += size
                while self.cached_bytes > self.max_cache_bytes:
                    self.cached_bytes -= self._cache.popitem(last=False)[1][1]
        return m

    def allowed(self, matcher: Any) -> torch.Tensor:
        """The matcher's next-token set as a bool tensor ``(vocab_size + 1,)`` (the last entry: may end here)."""
        words = torch.empty(self.words, dtype=torch.int32)
        matcher.unsafe_compute_mask_ptr(words.data_ptr(), self.words * 4)
        bits = (words[:, None] >> self._shifts) & 1  # (words, 32), little-endian bits: token 32w + b
        return bits.reshape(-1)[: self.vocab_size + 1].bool()


@dataclass
class RowConstraint:
    """One row's constraint: its grammar's regions and which tokens may come between them.

    ``grammar``'s regions open at once (``start is None``: a response format) or each time ``start`` is taken (a
    tool call's ``<|call_start|>``; a fresh matcher copied from the cache each time), and close when ``close_id``
    is taken (allowed only where the grammar may end; while a region is open nothing else outside the grammar is
    allowed). At most ``max_regions`` regions open (then ``start`` is banned). After a region closed, only
    ``after`` ids are allowed outside regions (None: anything). ``force``: ids fed before the row samples anything
    (a tool call the request requires). ``source``: where the grammar came from (a request's parameter, for
    messages). ``regions`` holds each closed region's ids; ``failure`` says why the grammar failed while decoding
    (:meth:`apply` then raises ``ConstraintError``, which ends the row in error).
    """

    grammars: Grammars
    grammar: Grammar | None
    close_id: int | None = None
    start: int | None = None
    max_regions: int | None = None
    after: Collection[int] | None = None
    force: Sequence[int] = ()
    source: str | None = None
    regions: list[list[int]] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        if self.grammar is None and self.start is None:
            raise ValueError("a constraint without a grammar only bans tokens: give start (the banned trigger)")
        if self.grammar is not None and self.close_id is None:
            raise ValueError("a grammar region needs close_id, the token that ends it")
        # ConstraintError now, before the row is admitted
        self._initial = None if self.grammar is None else self.grammars.compile(self.grammar)
        self._matcher: Any = None  # the open region's matcher, or None outside regions
        self.failure: str | None = None  # why the grammar failed while decoding (then the row ends in error)
        self.after = None if self.after is None else frozenset(self.after)
        if self.start is None:
            self._open()

    def _open(self) -> None:
        self._matcher = self._initial.deep_copy()
        self._ids: list[int] = []  # the open region's ids (read only while one is open)

    def partial_text(self) -> str:
        """The text taken so far in the open region ("" outside regions): what a row cut short had generated."""
        if self._matcher is None:
            return ""
        return b"".join(self.grammars.tokens[t] for t in self._ids).decode("utf-8", "replace")

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
            if self._matcher.is_error() or not bool(allowed.any()):  # (an error state allows only the end)
                self.failure = (f"the {self.grammar.what} cannot be decoded here: "
                                f"{one_line(self._matcher.get_error() or 'no token can follow')}")
                raise ConstraintError(self.failure)
            keep = torch.zeros(V, dtype=torch.bool)
            keep[:n] = allowed[:n]
            keep[self.close_id] = allowed[n]
            logits.masked_fill_(~keep, float("-inf"))
            return
        if self.regions and self.after is not None:
            keep = torch.zeros(V, dtype=torch.bool)
            keep[list(self.after)] = True
            logits.masked_fill_(~keep, float("-inf"))
        if self.start is not None and self._exhausted():
            logits[self.start] = float("-inf")

    def take(self, token: int) -> None:
        """Advance by the token the row took (sampled under :meth:`apply`'s mask, or forced)."""
        if self._matcher is None:
            if token == self.start and not self._exhausted():
                self._open()
        elif token == self.close_id:
            self.regions.append(self._ids)
            self._matcher = None
        elif not self._matcher.consume_token(token):  # the grammar over a parser limit (or an engine bug)
            self.failure = (f"the {self.grammar.what} cannot be decoded here (token {token}): "
                            f"{one_line(self._matcher.get_error())}")
            raise ConstraintError(self.failure)
        else:
            self._ids.append(token)
