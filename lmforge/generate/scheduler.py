"""Continuous batching: many requests decoded together on one :class:`~lmforge.generate.engine.Engine`.

A :class:`Scheduler` owns an engine whose KV cache has ``max_batch`` rows (slots) and a queue of waiting
requests (:class:`Job`). One iteration (:meth:`Scheduler.run_once`):

1. rows whose request was cancelled (a client that disconnected) leave, freeing their slots (a cancelled
   request that was still waiting has already left the queue: :meth:`Scheduler.cancel` removes it at once);
2. waiting requests join while slots are free: a prompt is prefilled once into its row and copied (``Engine.fork``)
   into the rows of the requests queued with it (:meth:`Scheduler.submit_many`: several samples of one prompt),
   all or nothing: requests that fail to join end alone (``finish_reason="error"``), freeing every row they took;
3. one pass of the row step (:meth:`RowStep.step <lmforge.generate.rows.RowStep.step>`) takes each live row's next
   token, with its own sampling and seeded ``torch.Generator`` (a request's output does not depend on the others);
   forced tool ids count in ``max_tokens``. A row alone drafts (a request's ``speculative=False`` opts out);
4. rows that ended free their slots at once.

Text goes out through each request's ``emit``, called on the engine thread with an :class:`Update`: text as it is
final (UTF-8 whole, stop strings never emitted), then one update with ``finish_reason``. :meth:`Scheduler.start`
runs the loop in its own thread, so a server's event loop never waits on the model.

Prefix cache (``prefix_cache``, a :class:`~lmforge.generate.prefix_cache.PrefixCache`): a joining prompt's longest
cached prefix of whole blocks is copied into its row and only the rest is prefilled; a row's prompt and reply are
kept when it leaves. All of it under the request's ``cache_salt`` (the prefix cache's tenancy).
"""
from __future__ import annotations

import atexit
import collections
import logging
import threading
from dataclasses import asdict, dataclass, field
from typing import Callable, Collection, Mapping, Sequence

import torch

from lmforge.generate.constraints import RowConstraint
from lmforge.generate.engine import Engine
from lmforge.generate.prefix_cache import PrefixCache, PrefixStats, admit_cached, check_salt, keep_row
from lmforge.generate.rows import Row, RowStep, TokenLogprob
from lmforge.generate.sampling import check_sampling, check_seed
from lmforge.model.cache import check_context
from lmforge.tokenizer import Tokenizer

logger = logging.getLogger("lmforge")

__all__ = ["Job", "MAX_LOGPROBS", "QueueFull", "Scheduler", "TokenLogprob", "Update"]

MAX_LOGPROBS = 20
"""The most alternatives a request may ask for per token (the OpenAI API's bound)."""


@dataclass(frozen=True)
class Update:
    """What a request gets from the engine thread: new ``text`` and, on its last update, why it ended.

    ``finish_reason``: None while it runs, then ``"stop"`` (a stop id or stop string), ``"length"``
    (``max_tokens`` generated), ``"cancelled"`` (the scheduler stopped before it finished) or ``"error"``;
    ``error`` says why in either case. ``completion_tokens`` counts generated tokens so far (a stop id is not
    counted); ``prompt_tokens`` is the prompt's length, ``cached_tokens`` how many of them came from the prefix
    cache instead of being prefilled; ``logprobs`` and ``regions`` (a ``capture_regions`` constraint's closed regions'
    text): the row's since the last update.
    """

    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None = None
    error: str | None = None
    logprobs: tuple["TokenLogprob", ...] = ()
    regions: tuple[str, ...] = ()
    cached_tokens: int = 0


@dataclass(eq=False)
class Job:
    """One generation: prompt ids, limits and sampling parameters, and where its updates go.

    ``emit`` is called on the engine thread; it must not block (a server hands the update to its event
    loop). The sampling, stop, tool, text, constraint and log-probability fields are its
    :class:`~lmforge.generate.rows.Row`'s; ``seed`` is a signed 64-bit integer; ``speculative`` False: never draft.
    ``cache_salt`` (None, or 1 to :data:`~lmforge.generate.prefix_cache.MAX_SALT_CHARS` characters): the prefix
    cache's space this request reads and writes; requests under different salts never reuse each other's blocks
    (and report 0 cached tokens). A server folds its tenant's identity into it.
    """

    prompt: list[int]
    max_tokens: int
    emit: Callable[[Update], None]
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop_ids: Collection[int] = ()
    stop: Sequence[str] = ()
    tool: Callable[[int], list[int] | None] | None = None
    token_text: Mapping[int, str] = field(default_factory=dict)
    constraint: RowConstraint | None = None
    capture_regions: bool = False
    logprobs: int | None = None
    speculative: bool = True
    cache_salt: str | None = None
    cancelled: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.top_k, self.top_p)
        check_seed(self.seed)
        check_salt(self.cache_salt)
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer (got {self.max_tokens!r})")
        if not self.prompt:
            raise ValueError("the prompt is empty; give at least one token")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop_ids = frozenset(int(t) for t in self.stop_ids)
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] or None (got {self.logprobs!r})")


class QueueFull(RuntimeError):
    """:meth:`Scheduler.submit` found ``max_queue`` requests already waiting (a server answers 429)."""


def _row(req: Job, device: torch.device, speculative: bool, emit: Callable[[Row], None]) -> Row:
    """The row a request decodes in (its sampling, stops, tool, constraint; drafts unless it opts out)."""
    return Row(req.prompt, req.max_tokens, temperature=req.temperature, top_k=req.top_k, top_p=req.top_p,
               seed=req.seed, device=device, stop_ids=req.stop_ids, stop=req.stop, tool=req.tool,
               token_text=req.token_text, constraint=req.constraint, capture_regions=req.capture_regions,
               logprobs=req.logprobs, draft=speculative and req.speculative, emit=emit, owner=req)


class Scheduler:
    """Continuous batching of :class:`Job` objects on ``engine`` (see the module docstring).

    ``max_batch`` rows are decoded together; up to ``max_queue`` more requests wait for a free row.
    Thread-safe: :meth:`submit` and :meth:`cancel` may be called from any thread while the loop runs.
    """

    def __init__(self, engine: Engine, tokenizer: Tokenizer, max_batch: int = 8, max_queue: int = 64,
                 prefix_cache: PrefixCache | None = None, speculative: bool = True) -> None:
        for name, v in (("max_batch", max_batch), ("max_queue", max_queue)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer (got {v!r})")
        self.rows = RowStep.of(tokenizer, engine.cfg.vocab_size)
        self.engine = engine
        self.max_batch, self.max_queue = max_batch, max_queue
        engine.open_slots(max_batch)
        self.prefix_cache = prefix_cache
        self.speculative = bool(speculative)
        self._rows: list[Row] = []  # _rows[i] decodes in engine row i; its owner is its request
        self._waiting: collections.deque[list[Job]] = collections.deque()  # entries: requests joining together
        self._cv = threading.Condition()
        self.engine_lock = threading.Lock()
        """Held by the engine thread while it uses the model; another thread using the model (a server's
        embeddings) takes it too, between steps."""
        self._stopping = False
        self._thread: threading.Thread | None = None

    # Called from any thread
    def check(self, prompt_tokens: int, max_tokens: int, what: str = "the prompt", limit: str = "max_tokens") -> None:
        """``ValueError`` unless a prompt of ``prompt_tokens`` plus ``max_tokens`` new ones fits the context
        (the message names both numbers, and the limit ``limit``)."""
        check_context(prompt_tokens + max_tokens, self.engine.context_length,
                      f"{what} ({prompt_tokens} tokens) plus {limit} ({max_tokens})")

    def submit(self, req: Job) -> None:
        """Queue ``req``; it joins the batch at the next step with a free row.

        ``ValueError`` if it does not fit the context or holds out-of-range ids, :class:`QueueFull` if
        ``max_queue`` requests are already waiting, ``RuntimeError`` if the scheduler is stopping.
        """
        self.submit_many([req])

    def submit_many(self, reqs: Sequence[Job]) -> None:
        """Queue requests with one prompt as one entry (as :meth:`submit`): they join together, the prompt
        prefilled once and copied into their rows. ``ValueError`` also for more requests than rows, or prompts or
        cache salts that differ."""
        reqs = list(reqs)
        if not reqs or len(reqs) > self.max_batch:
            raise ValueError(f"{len(reqs)} requests cannot join together: between 1 and max_batch={self.max_batch}")
        for name in ("prompt", "cache_salt"):
            if any(getattr(r, name) != getattr(reqs[0], name) for r in reqs[1:]):
                raise ValueError(f"requests that join together must have the same {name}")
        for req in reqs:
            self.check(len(req.prompt), req.max_tokens)
        bad = [t for t in reqs[0].prompt if not 0 <= t < self.rows.vocab_limit]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is out of range [0, {self.rows.vocab_limit})")
        with self._cv:
            if self._stopping:
                raise RuntimeError("the scheduler is stopping; it takes no new requests")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are already waiting (max_queue={self.max_queue}); "
                                "retry later")
            self._waiting.append(reqs)
            self._cv.notify()

    def cancel(self, req: Job) -> None:
        """Drop ``req``: it leaves the queue now (its place is free for another) or frees its row at the next
        step, and gets no more updates."""
        req.cancelled = True
        with self._cv:
            for entry in self._waiting:  # at most max_queue entries; Job compares by identity
                if any(r is req for r in entry) and all(r.cancelled for r in entry):
                    self._waiting.remove(entry)
                    break
            self._cv.notify()

    def load(self) -> dict[str, int]:
        """``{"active", "waiting", "max_batch", "max_queue"}`` right now (``waiting``: queued requests), the prefix
        cache's :class:`~lmforge.generate.prefix_cache.PrefixStats` (each ``prefix_`` + its field; 0 without a cache)
        and speculative decoding's (``spec_passes``, ``spec_drafted``, ``spec_accepted``)."""
        with self._cv:
            now = {"active": len(self._rows), "waiting": sum(len(e) for e in self._waiting),
                   "max_batch": self.max_batch, "max_queue": self.max_queue}
        stats = self.prefix_cache.stats if self.prefix_cache is not None else PrefixStats()
        return now | {"prefix_" + name: n for name, n in asdict(stats).items()} | self.rows.spec_stats.as_dict()

    def start(self) -> None:
        """Run the loop in a daemon thread until :meth:`stop`, called at the latest when the interpreter exits:
        a thread left inside a kernel that released the GIL would abort the process (SIGABRT) when it takes the
        GIL back from a finalizing interpreter."""
        assert self._thread is None, "already started"
        self._thread = threading.Thread(target=self._loop, name="lmforge-engine", daemon=True)
        self._thread.start()
        atexit.register(self.stop)

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stop the loop and wait for the engine thread to end (it finishes its current step first): requests
        still running or waiting end with ``finish_reason="cancelled"``."""
        atexit.unregister(self.stop)
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self._drop_all("cancelled", "the request was cancelled: the server is stopping")

    # On the engine thread
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._stopping or self._waiting or self._rows):
                    self._cv.wait()
                if self._stopping:
                    return
            try:
                with self.engine_lock:
                    self.run_once()
            except Exception as e:  # noqa: BLE001  (the engine failed: end the live requests, keep serving)
                logger.exception("engine step failed")
                self._drop_all("error", f"internal error in the engine: {type(e).__name__}: {e}")
                self.engine.open_slots(self.max_batch)

    def _drop_all(self, reason: str, error: str | None) -> None:
        """End every live request (and, when cancelling, every waiting one) with ``reason``."""
        with self._cv:
            ended = [(r.owner, r.n) for r in self._rows]
            self._rows = []
            if reason == "cancelled":
                ended += [(req, 0) for entry in self._waiting for req in entry]
                self._waiting.clear()
        for req, n in ended:
            self._send(req, Update("", len(req.prompt), n, reason, error))

    def _send(self, req: Job, update: Update) -> None:
        if req.cancelled:
            return
        try:
            req.emit(update)
        except Exception:  # noqa: BLE001  (the receiver is gone: treat it as a cancel)
            logger.warning("a request's receiver failed; cancelling it", exc_info=True)
            req.cancelled = True

    def run_once(self) -> bool:
        """One iteration: cancelled rows leave, waiting requests join, one batched step. False if idle."""
        self._release([i for i, r in enumerate(self._rows) if r.owner.cancelled])
        while self.engine.free_slots:
            with self._cv:
                if not self._waiting or len(self._waiting[0]) > self.engine.free_slots:
                    break
                entry = [req for req in self._waiting.popleft() if not req.cancelled]
            if entry:
                self._join(entry)
        # engine row i must be _rows[i]'s: a slip ends the batch loudly (the loop drops it) rather than step a
        # request in another's row
        if self.engine.active != len(self._rows):
            raise RuntimeError(f"the engine has {self.engine.active} live rows but the scheduler {len(self._rows)}")
        if not self._rows:
            return False
        self._finish_rows()
        if self._rows:
            self.rows.step(self.engine, self._rows)
            self._finish_rows()
        return True

    def _join(self, entry: list[Job]) -> None:
        """Requests with one prompt take rows (one prefill, copied for the others) and their first tokens. All or
        nothing: when any part of joining fails, these requests end with an error and every engine row they took
        is freed, so the engine's live rows stay the scheduler's (the others go on as if they had never come)."""
        base = self.engine.active
        try:  # everything about these requests joining: their rows' state, the prefill, the copies
            rows = [_row(req, self.engine.device, self.speculative, self._emit) for req in entry]
            first, logits, cached = admit_cached(self.engine, self.prefix_cache, entry[0].prompt, entry[0].cache_salt)
            for _ in entry[1:]:
                self.engine.fork(first)
            if first != base or self.engine.active != base + len(entry) or len(self._rows) != base:
                raise RuntimeError(f"joining took engine rows {base}..{self.engine.active - 1} for {len(entry)} "
                                   f"request(s) at row {first} beside {len(self._rows)} live")
            for row in rows:
                row.cached = cached
            with self._cv:
                self._rows.extend(rows)
        except Exception as e:  # noqa: BLE001  (these requests failed to join; the others go on)
            logger.exception("a request failed to join the batch")
            try:
                while self.engine.active > base:  # the rows taken are the last ones: freeing them moves nothing
                    self.engine.release(self.engine.active - 1)
            finally:
                for req in entry:
                    self._send(req, Update("", len(req.prompt), 0, "error",
                                           f"internal error: {type(e).__name__}: {e}"))
            return
        for row in rows:
            self.rows.advance(row, logits)  # its own errors end this row only

    def _emit(self, r: Row) -> None:
        """Send the row's request an update with its pending text, log-probabilities and closed regions (then
        cleared)."""
        u = Update(r.pending, len(r.prompt), r.n, r.finish, r.error, tuple(r.pending_lp), tuple(r.regions),
                   r.cached)
        r.pending, r.pending_lp, r.regions = "", [], []
        self._send(r.owner, u)

    def _finish_rows(self) -> None:
        done = [i for i, r in enumerate(self._rows) if r.finish is not None]
        for i in done:
            self._emit(self._rows[i])
        self._release(done)

    def _release(self, rows: list[int]) -> None:
        """Free engine rows ``rows`` (highest first, so the row moved into a freed one is always live), each row's
        tokens kept in the prefix cache first, under its request's salt."""
        for i in sorted(rows, reverse=True):
            try:
                keep_row(self.engine, self.prefix_cache, i, self._rows[i].owner.cache_salt)
            except Exception:  # noqa: BLE001  (a cache that cannot keep a row must not end the others)
                logger.exception("the prefix cache failed to keep a row")
            moved = self.engine.release(i)
            with self._cv:
                if moved is not None:
                    self._rows[i] = self._rows[moved]
                self._rows.pop()
