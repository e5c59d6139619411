"""Rows: what each decoded token means, for every driver of the :class:`~lmforge.generate.engine.Engine`.

The engine computes tensors (prefill, step, verify, rollback, fork); a driver decides who waits (the server's
:class:`~lmforge.generate.scheduler.Scheduler`, the :class:`~lmforge.generate.generator.Generator`'s turns, RL
rollouts). Between them, a :class:`Row` is one sequence being decoded and :class:`RowStep` takes its next token
from the logits the engine gave it:

* a forced token first (a tool's output, a constraint's fixed opening), fed one per step and not sampled;
* else a sample with the row's own temperature/top-k/top-p and seeded ``torch.Generator``, after its
  constraint's mask (:class:`~lmforge.generate.constraints.RowConstraint`), with its log-probability when asked
  (``logprobs``, 0..20 alternatives: under the distribution it was drawn from, after the mask, temperature, top-k
  and top-p; at a greedy temperature the masked logits' softmax; a forced token's is 0);
* a stop id ends the row (not part of the reply); the token's bytes go through the row's :class:`TextStream`
  (UTF-8 whole, stop strings held back and cut); a constraint's captured region (a tool call's JSON) is not text;
* the row ends at ``max_tokens`` (counting forced tokens, or with ``count_forced=False`` sampled ones only: then
  the tool's output that follows the last sampled token still belongs to the reply);
* drafting (:meth:`RowStep.speculate`): a row alone feeds prompt-lookup drafts with its next token in one
  ``Engine.verify`` pass and takes each position's token through the same path, up to the first that is not the
  draft or that ends the row (a forced token is checked like any other), then rolls back the rest
  (:mod:`lmforge.generate.speculative`): the same tokens, fewer passes. Every kind of row drafts.

A row's ``emit`` (if set) is called with the row whenever a taken token adds text or closes a captured region and
the row goes on; the driver reads ``pending``/``pending_lp``/``regions`` and clears them.
"""

from __future__ import annotations

import codecs
import collections
import logging
from dataclasses import dataclass
from typing import Any, Callable, Collection, Mapping, Sequence

import torch

from lmforge.generate.constraints import RowConstraint
from lmforge.generate.sampling import draw, is_greedy, sample_next, sampling_logits, seeded
from lmforge.generate.speculative import DraftPolicy, NgramDrafter, SpecStats

logger = logging.getLogger("lmforge")

__all__ = ["Row", "RowStep", "TextStream", "TokenLogprob", "token_bytes"]


def token_bytes(tokenizer: Any) -> list[bytes]:
    """Each id's bytes (a special token's are its string's), indexed by id."""
    return [tokenizer.vocab[i] for i in range(tokenizer.vocab_size)]


class TextStream:
    """Turns one row's token bytes into text pieces, cutting at the first stop string.

    Bytes go through an incremental UTF-8 decoder (an incomplete character waits for its next bytes). The longest
    tail of the text that is a proper prefix of some stop string is held back until the next token shows whether
    the stop string completes, so it is found even when split across tokens.
    """

    def __init__(self, stop: Sequence[str] = ()) -> None:
        self.stop = [s for s in stop if s]
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.held = ""
        self.done = False

    def feed(self, data: bytes) -> str:
        """Text that is final after appending ``data`` (possibly empty)."""
        text = self.held + self.decoder.decode(data)
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.done, self.held = True, ""
            return text[: min(hits)]
        keep = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), keep, -1):
                if text.endswith(s[:n]):
                    keep = n
                    break
        self.held = text[len(text) - keep:]
        return text[: len(text) - keep]

    def finish(self) -> str:
        """Flush at the end of generation (a dangling partial character becomes U+FFFD)."""
        text = "" if self.done else self.held + self.decoder.decode(b"", final=True)
        self.done, self.held = True, ""
        return text


@dataclass(frozen=True)
class TokenLogprob:
    """A taken token's log-probability and the ``top`` most likely alternatives ``((id, logprob), ...)``."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class Row:
    """One sequence being decoded (module docstring): its sampler, stops, text, forced tokens, constraint, drafts.

    ``seed`` None draws fresh entropy, unless ``gen`` (a generator shared across turns) is given. ``tool(token_id)
    -> list[int] | None`` is called with each sampled token before the row's end is decided (so it may raise
    ``max_tokens``); ids it returns are forced next. ``token_text`` maps ids to the text shown for them instead of
    their own (a server's markup for special tokens). ``log``: keep ``(id, text, forced)`` of each taken token in
    :attr:`log` (a driver that streams tokens). ``owner``: whatever the driver keeps with the row.
    """

    def __init__(self, prompt: Sequence[int], max_tokens: int, *, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, seed: int | None = None, gen: torch.Generator | None = None,
                 device: Any = "cpu", stop_ids: Collection[int] = (), stop: Sequence[str] = (),
                 tool: Callable[[int], Sequence[int] | None] | None = None, token_text: Mapping[int, str] | None = None,
                 constraint: RowConstraint | None = None, capture_regions: bool = False, logprobs: int | None = None,
                 draft: bool = False, count_forced: bool = True, emit: Callable[["Row"], None] | None = None,
                 log: bool = False, owner: Any = None) -> None:
        self.prompt, self.max_tokens, self.owner, self.emit = prompt, max_tokens, owner, emit
        self.log: list[tuple[int, str, bool]] | None = [] if log else None  # (id, its text, forced) per token
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.stop_ids, self.tool, self.count_forced = stop_ids, tool, count_forced
        self.constraint, self.capture_regions, self.logprobs = constraint, capture_regions, logprobs
        self.drafter = NgramDrafter(prompt) if draft else None
        self.policy = DraftPolicy()
        self.gen = gen if gen is not None else seeded(seed, device)
        self.stream = TextStream(list(stop))
        self.shown = {int(t): text.encode() for t, text in (token_text or {}).items()}  # ids shown as other text
        self.forced: collections.deque[int] = collections.deque(constraint.force if constraint is not None else ())
        self.ids: list[int] = []  # every taken id
        self.sampled: list[bool] = []  # per id: sampled (True) or forced
        self.stop: int | None = None  # the stop id that ended the row
        self.n = 0  # completion tokens counted against max_tokens
        self.cached = 0  # prompt tokens the prefix cache gave
        self.next = -1  # the token to feed at the next step
        self.pending = ""  # text not yet emitted
        self.pending_lp: list[TokenLogprob] = []  # their log-probabilities
        self.regions: list[str] = []  # captured regions closed since the last emit
        self.finish: str | None = None
        self.error: str | None = None


class RowStep:
    """Takes rows' next tokens from their logits (module docstring): ``token_bytes`` gives each id's bytes (ids at or
    past its length are never sampled), ``decode`` a captured region's text."""

    def __init__(self, token_bytes: Sequence[bytes], decode: Callable[[list[int]], str] | None = None) -> None:
        self.bytes = token_bytes
        self.vocab_limit = len(token_bytes)
        self.decode = decode
        self.spec_stats = SpecStats()

    @classmethod
    def of(cls, tokenizer: Any, model_vocab: int) -> "RowStep":
        """The row step over ``tokenizer``'s ids (None: ``model_vocab`` ids without text); ``ValueError`` if the
        tokenizer has more ids than the model."""
        if tokenizer is None:
            return cls([b""] * model_vocab)
        if tokenizer.vocab_size > model_vocab:
            raise ValueError(f"tokenizer has {tokenizer.vocab_size} tokens but the model only {model_vocab}; "
                             "load the tokenizer the model was trained with (the run's tokenizer.json)")
        return cls(token_bytes(tokenizer), tokenizer.decode)

    def step(self, engine: Any, rows: Sequence[Row]) -> None:
        """One engine pass for ``rows`` (row ``i`` in engine row ``i``), each then taking its next token: a row alone
        verifies its drafts if it has any (:meth:`speculate`), else one batched step feeds every row its next token.
        A row that already ended (a batch kept in lockstep) only draws its next feed, a plain sample."""
        if len(rows) == 1 and self.speculate(engine, rows[0]):
            return
        feed = torch.tensor([r.next for r in rows], dtype=torch.long, device=engine.device)
        with torch.inference_mode(), engine.serial_torch():  # sampling too: see Engine.serial_torch
            logits = engine.step(feed)
            greedy = logits[:, : self.vocab_limit].argmax(dim=-1).tolist()  # one op for every greedy row
            for i, r in enumerate(rows):
                if r.finish is None:
                    self.advance(r, logits[i], greedy[i])
                else:
                    r.next = self.sample(r, logits[i])

    def end_full(self, engine: Any, rows: Sequence[Row]) -> None:
        """Rows (row ``i`` in engine row ``i``) whose cache has no room to feed their next token end with
        ``finish="context"`` (the tokens a tool still forces belong to the reply: they are taken, not fed)."""
        for i, r in enumerate(rows):
            if r.finish is None and engine.lengths[i] >= engine.cache.capacity:
                self.drain(r)
                r.finish = "context"
                r.pending += r.stream.finish()

    def run(self, engine: Any, groups: Sequence[Sequence[Row]]) -> None:
        """Decode ``groups`` of rows to their ends as one batch on ``engine``, a cache row each: a group's rows share
        its first row's prompt, prefilled once (``Engine.admit``) and copied (``Engine.fork``) into the others; then
        one :meth:`step` per token, each row leaving as it ends (a stop, ``max_tokens``, a full context: no sliding)."""
        engine.open_slots(max(1, sum(map(len, groups))), engine.context_length)
        live: list[Row] = []  # live[b] decodes in engine row b
        with torch.inference_mode():
            for g in (g for g in groups if g):
                first, logits = engine.admit(g[0].prompt)
                for _ in g[1:]:
                    engine.fork(first)
                for r in g:
                    self.advance(r, logits)
                live += g
        while True:
            self.end_full(engine, live)
            for b in sorted((b for b, r in enumerate(live) if r.finish), reverse=True):
                moved = engine.release(b)  # the last live row moves into row b
                if moved is not None:
                    live[b] = live[moved]
                live.pop()
            if not live:
                return
            self.step(engine, live)

    def speculate(self, engine: Any, r: Row) -> bool:
        """One pass of engine row 0 with row ``r``'s next token and its drafts, if it has any; False when it drafted
        nothing (the caller steps it plainly)."""
        if r.drafter is None or r.forced:
            return False
        k = min(r.policy.draft_length(r.n), r.max_tokens - r.n - 1, engine.cache.capacity - engine.lengths[0] - 1)
        drafts = r.drafter.propose(k) if k > 0 else []
        if not drafts:
            return False
        with torch.inference_mode(), engine.serial_torch():
            logits = engine.verify(0, [r.next] + drafts)  # (1 + k, V)
            greedy = logits[:, : self.vocab_limit].argmax(dim=-1).tolist()
            for kept in range(len(drafts) + 1):  # the drafts before the position where taking stops are kept
                self.advance(r, logits[kept], greedy[kept])
                if kept == len(drafts) or r.finish is not None or r.next != drafts[kept]:
                    break
            engine.rollback(0, len(drafts) - kept)
        r.policy.record(r.n, len(drafts), kept)
        st = self.spec_stats
        st.passes, st.drafted, st.accepted = st.passes + 1, st.drafted + len(drafts), st.accepted + kept
        return True

    def advance(self, r: Row, logits: torch.Tensor, argmax: int | None = None) -> None:
        """Take the row's next token: a forced one, or one sampled from ``logits (V,)`` (``argmax``: its greedy pick,
        already computed); mark the row if it ends. An error ends this row only (``finish="error"``)."""
        try:
            if r.forced:
                t = r.forced.popleft()
                if r.logprobs is not None:
                    r.pending_lp.append(TokenLogprob(t, 0.0, ((t, 0.0),) if r.logprobs else ()))
                self.take(r, t, False)
            elif (t := self.sample(r, logits, argmax)) in r.stop_ids:
                if r.logprobs is not None:
                    r.pending_lp.pop()  # a stop id is not part of the completion
                r.finish, r.stop, r.next = "stop", t, t
            else:
                self.take(r, t, True)
            if r.finish is not None:
                if r.finish == "length" and not r.count_forced:
                    self.drain(r)
                r.pending += r.stream.finish()  # a held-back tail that turned out not to be a stop string
        except Exception as e:  # noqa: BLE001  (one row's failure ends that row only)
            logger.exception("a request failed")
            r.finish, r.error = "error", f"internal error: {type(e).__name__}: {e}"

    def drain(self, r: Row) -> None:
        """Take the row's remaining forced tokens without feeding them (it ends: they are its reply's tail)."""
        while r.forced and not r.stream.done:
            self.take(r, r.forced.popleft(), False)

    def sample(self, r: Row, logits: torch.Tensor, argmax: int | None = None) -> int:
        """The row's next token from ``logits (V,)`` under its constraint and sampling parameters (and, when it asks
        for log-probabilities, the token's added to its pending ones)."""
        greedy = is_greedy(r.temperature)
        if greedy and argmax is not None and r.constraint is None and r.logprobs is None:
            return argmax  # == sample_next at temperature 0
        row = logits[None, : self.vocab_limit].float()  # (1, V)
        if r.constraint is not None:
            row = row.clone()  # the mask is this row's (a group's rows share their prefill's logits)
            r.constraint.apply(row[0])
        dist = row if greedy else sampling_logits(row, r.temperature, r.top_k, r.top_p)  # what the token is drawn from
        t = int(sample_next(dist, 0.0)[0] if greedy else draw(dist, r.gen)[0])
        if r.logprobs is not None:
            lp = torch.log_softmax(dist[0], dim=-1)
            top: tuple[tuple[int, float], ...] = ()
            if r.logprobs:
                values, ids = torch.topk(lp, min(r.logprobs, lp.shape[0]))
                top = tuple((int(i), float(v)) for i, v in zip(ids, values) if v > float("-inf"))
            r.pending_lp.append(TokenLogprob(t, float(lp[t]), top))
        return t

    def take(self, r: Row, t: int, sampled: bool) -> None:
        """Token ``t`` is the row's next reply token: its text, and whether it ends the row."""
        if sampled or r.count_forced:
            r.n += 1
        r.next = t
        r.ids.append(t)
        r.sampled.append(sampled)
        if r.drafter is not None:
            r.drafter.append(t)
        c = r.constraint
        captured = False
        if c is not None:
            was = c.in_region
            c.take(t)
            captured = r.capture_regions and (was or c.in_region)
            if captured and was and not c.in_region:  # a region closed
                r.regions.append(self.decode(c.regions[-1]))
        if captured and r.pending_lp and r.pending_lp[-1].token == t:
            r.pending_lp.pop()  # a captured token is not text: no log-probability either
        piece = "" if captured else r.stream.feed(r.shown.get(t, self.bytes[t]))
        r.pending += piece
        if r.log is not None:
            r.log.append((t, piece, not sampled))
        if r.tool is not None and sampled and not r.stream.done and (r.n < r.max_tokens or not r.count_forced):
            # the tool may raise r.max_tokens; with count_forced=False its output after the last sampled token is kept
            extra = r.tool(t) or ()
            bad = [x for x in extra if not 0 <= int(x) < self.vocab_limit]
            if bad:
                raise ValueError(f"the tool forced token id {bad[0]}, out of range [0, {self.vocab_limit})")
            r.forced.extend(int(x) for x in extra)
        if r.stream.done:
            r.finish = "stop"
        elif r.n >= r.max_tokens and (sampled or r.count_forced):
            r.finish = "length"  # the caller flushes the stream
        elif (r.pending or r.regions) and r.emit is not None:
            r.emit(r)
