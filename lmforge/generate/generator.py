"""Text generation from a trained ``TransformerLM``: :class:`Generator` (ids, text, a chat's turn), the user API over
the :class:`~lmforge.generate.engine.Engine` (the tensors) and the row step (:mod:`lmforge.generate.rows`: what each
token means). ``naive=True`` recomputes the model's full forward at every step (no cache): the oracle the cached path
is tested against (greedy tokens must be identical).
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Callable, Iterator, Sequence

import torch

from lmforge.checkpoint import apply_checkpoint, unwrap_model
from lmforge.common import resolve_device, token_ids
from lmforge.config import from_dict
from lmforge.generate.engine import Engine
from lmforge.generate.packed import weight_dtype_of
from lmforge.generate.prefix_cache import PrefixCache, admit_cached, keep_row
from lmforge.generate.rows import Row, RowStep
from lmforge.generate.sampling import check_sampling, check_seed, seeded
from lmforge.model import ModelConfig, TransformerLM
from lmforge.run import open_run
from lmforge.tokenizer import EOT, Tokenizer

logger = logging.getLogger("lmforge")

__all__ = ["Generator", "Turn", "load_run_model"]


def load_run_model(run_dir: str | os.PathLike, checkpoint: str | os.PathLike | None = None,
                   device: str = "auto") -> tuple[TransformerLM, Tokenizer, dict[str, Any]]:
    """A run's model with its checkpoint's weights on ``device`` (train mode as built), its tokenizer, and
    ``{"checkpoint", "step"}`` of the checkpoint loaded (see :func:`lmforge.run.open_run` for ``checkpoint``)."""
    run = open_run(run_dir, checkpoint)
    dev = resolve_device(device)
    model = TransformerLM.for_loading(from_dict(ModelConfig, run.config.get("model"), path="model"))
    step = apply_checkpoint(run.checkpoint, model)  # strict: fills every parameter
    return model.to(dev), Tokenizer.load(run.tokenizer_path), {"checkpoint": str(run.checkpoint_path), "step": step}


class Generator:
    """Generate text with a trained ``TransformerLM`` and its ``Tokenizer``.

    >>> gen = Generator.from_run("runs/speedrun")                      # doctest: +SKIP
    >>> gen.generate("ROMEO:", max_new_tokens=50, temperature=0.8, seed=0)  # doctest: +SKIP
    """

    def __init__(self, model: Any, tokenizer: "Tokenizer | None" = None, device: Any = None,
                 window_drop: int | None = None, weight_dtype: torch.dtype | str | None = None,
                 activations: str | None = None) -> None:
        """``window_drop``, ``weight_dtype`` and ``activations`` are the :class:`~lmforge.generate.engine.Engine`'s
        (a full row's slide; the weights stored rounded, CPU only, default the model's own dtype; the products'
        arithmetic): the cached path then matches the model rounded that way, ``naive=True`` runs it as given."""
        if device is not None:
            model = model.to(resolve_device(device) if isinstance(device, str) else device)
        self.model = model.eval()
        self.cfg = unwrap_model(model).cfg
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.rows = RowStep.of(tokenizer, self.cfg.vocab_size)
        """What each token means (:mod:`~lmforge.generate.rows`); ids past the tokenizer's (padding) never sampled."""
        self.engine = Engine(model, window_drop, weight_dtype, activations=activations)
        self.prefix_cache: PrefixCache | None = None
        """Set to keep the KV of each :meth:`turn`'s prompt and reply for the next (a chat re-sends its history)."""
        self.speculative = True
        """:meth:`turn` and one prompt's :meth:`generate` draft unless False (:mod:`~lmforge.generate.speculative`)."""

    @classmethod
    def from_run(cls, run_dir: str | os.PathLike, checkpoint: str | os.PathLike | None = None,
                 device: str = "auto", weight_dtype: torch.dtype | str | None = None,
                 activations: str | None = None) -> "Generator":
        """Load model + tokenizer from a run directory (``checkpoint``: see :func:`lmforge.run.open_run`).
        ``weight_dtype`` and ``activations`` as in the constructor; packed weights (anything but float32) run on
        the CPU decode kernels only, so with them ``device="auto"`` means the CPU, also where a GPU is.
        """
        if device == "auto" and weight_dtype_of(weight_dtype) not in (None, torch.float32):
            device = "cpu"
        model, tokenizer, info = load_run_model(run_dir, checkpoint, device)
        logger.info("loaded %s (step %d) on %s", info["checkpoint"], info["step"], next(model.parameters()).device)
        return cls(model, tokenizer, weight_dtype=weight_dtype, activations=activations)

    def refresh(self) -> None:
        """Re-read the model's weights (call after changing them; the decoder packs a copy; the prefix cache, whose
        keys and values are the old weights', is emptied)."""
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        self.engine = Engine(self.model, self.engine.window_drop, self.engine.weight_dtype,
                             activations=self.engine.activations)

    def rng(self, seed: int | None = None) -> torch.Generator:
        """A random generator on the model's device, as :func:`~lmforge.generate.sampling.seeded` makes them."""
        return seeded(seed, self.device)

    def _check_prompts(self, rows: list[list[int]], max_new_tokens: int, overflow: str, temperature: float,
                       top_k: int | None, top_p: float | None, seed: int | None = None) -> int:
        """Validate token rows and sampling; returns how many new tokens to generate (with ``overflow="stop"``: how
        many fit in the context, with a warning if fewer than asked)."""
        check_sampling(temperature, top_k, top_p)
        check_seed(seed)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer (got {max_new_tokens!r})")
        if overflow not in ("slide", "stop"):
            raise ValueError(f"overflow must be 'slide' or 'stop' (got {overflow!r}): 'slide' drops the oldest tokens "
                             "when the context is full and goes on, 'stop' ends generation there")
        if not rows:
            raise ValueError("no prompts given; pass at least one prompt")
        ctx = self.cfg.context_length
        for i, r in enumerate(rows):
            if len(r) == 0:
                raise ValueError(f"prompt {i} is empty; give at least one token (e.g. {EOT} to start a document)")
            if len(r) > ctx:
                raise ValueError(f"prompt {i} has {len(r)} tokens but the model's context length is {ctx}; "
                                 "shorten the prompt")
            token_ids(r, self.cfg.vocab_size, what=f"prompt {i}: token id")
        longest = max(len(r) for r in rows)
        fit = ctx - longest + 1  # the last new token is sampled, never fed back
        if overflow == "stop" and max_new_tokens > fit:
            logger.warning("prompt (%d tokens) + max_new_tokens (%d) exceeds the context length %d: generation "
                           "stops after %d new tokens", longest, max_new_tokens, ctx, fit)
            return fit
        return max_new_tokens

    def _steps(self, prompts: list[list[int]], n_new: int, temperature: float, top_k: int | None,
               top_p: float | None, seed: int | None, stop_ids: Sequence[int] | None, stops: Sequence[str],
               naive: bool) -> Iterator[tuple[int, int, str]]:
        """The prompts as one batch through the row step: ``(row, id, text)`` per token taken, ``(row, -1, tail)``
        when a row's stream held text back at its end. ``stop_ids`` None: the tokenizer's ``EOT``. The rows share one
        seeded generator and step in lockstep until all have ended (:meth:`RowStep.step`), so a seed's draws do not
        depend on when a row ends. One prompt (not naive) drafts; ``naive``: through :class:`_Recompute`."""
        if stop_ids is None:
            eot = getattr(self.tokenizer, "eot_id", None)
            stop_ids = [] if eot is None else [eot]
        gen = self.rng(seed)
        rows = [Row(p, n_new, temperature=temperature, top_k=top_k, top_p=top_p, gen=gen, stop_ids=set(stop_ids),
                    stop=stops, draft=self.speculative and len(prompts) == 1 and not naive, log=True) for p in prompts]
        longest = max(len(p) for p in prompts)
        capacity = max(min(self.cfg.context_length, longest + n_new - 1), longest)  # a full cache slides
        engine = _Recompute(self) if naive else self.engine
        with torch.inference_mode():
            logits = engine.prefill(prompts, capacity)
            for b, r in enumerate(rows):
                self.rows.advance(r, logits[b])
        while True:
            for b, r in enumerate(rows):
                yield from ((b, t, piece) for t, piece, _ in _taken(r))
            if all(r.finish is not None for r in rows):
                break
            self.rows.step(engine, rows)
        for r in rows:
            if r.error is not None:
                raise ValueError(r.error)

    def generate_ids(self, prompt_ids: Sequence[int] | Sequence[Sequence[int]], max_new_tokens: int = 128,
                     temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                     seed: int | None = None, stop_ids: Sequence[int] | None = None, naive: bool = False,
                     stream: bool = False, overflow: str = "slide") -> Any:
        """Generate token ids after one prompt (a list of ids) or several (a list of lists).

        Returns the new ids (a list, or a list of lists), without the prompt and without the stop token that ended a
        row. ``stop_ids`` defaults to the tokenizer's ``EOT``. ``stream=True`` returns an iterator instead: of ids for
        one prompt, of ``(row, id)`` pairs for several. ``naive=True``: the oracle (module docstring).
        Past the context length (``overflow="slide"``, the default) a row slides (:class:`Engine`: it drops its
        oldest ``window_drop`` tokens and goes on); ``overflow="stop"`` ends generation when the context is full
        instead (with a warning). A prompt longer than the context is an error.
        """
        if hasattr(prompt_ids, "tolist"):  # a tensor or an array (a float one is refused below, not truncated)
            prompt_ids = prompt_ids.tolist()
        single = len(prompt_ids) > 0 and not isinstance(prompt_ids[0], (list, tuple))
        rows = [list(prompt_ids)] if single else [list(r) for r in prompt_ids]
        n_new = self._check_prompts(rows, max_new_tokens, overflow, temperature, top_k, top_p, seed)
        stop_ids = None if stop_ids is None else list(stop_ids)  # read now, not when a stream starts
        it = ((b, t) for b, t, _ in self._steps(rows, n_new, temperature, top_k, top_p, seed, stop_ids, (), naive)
              if t >= 0)
        if stream:
            return (t for _, t in it) if single else it
        out: list[list[int]] = [[] for _ in rows]
        for b, t in it:
            out[b].append(t)
        return out[0] if single else out

    def turn(self, prompt_ids: Sequence[int], max_new_tokens: int = 256, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, rng: torch.Generator | None = None,
             stop_ids: Sequence[int] = (), inject: Callable[[int], Sequence[int] | None] | None = None) -> "Turn":
        """One streamed reply to ``prompt_ids`` with forced tokens: a :class:`Turn` to iterate.

        Each sampled id is passed to ``inject`` (if given); when it returns ids, they are fed to the model
        after the sampled one, one step each, before sampling goes on (a tool's output). The reply ends at a
        ``stop_ids`` token (not yielded), after ``max_new_tokens`` sampled tokens, or when the context is full
        (no sliding: a chat drops whole turns instead). ``rng``: the random generator (default: fresh entropy). It
        drafts as :attr:`speculative` says; the prompt's longest prefix held by :attr:`prefix_cache` is not prefilled.
        """
        rows = [list(prompt_ids)]
        self._check_prompts(rows, max_new_tokens, "slide", temperature, top_k, top_p)  # (a turn never slides)
        if self.tokenizer is None:
            raise ValueError("this Generator has no tokenizer; pass tokenizer= to stream text")
        row = Row(rows[0], max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, gen=rng or self.rng(),
                  stop_ids=set(stop_ids), tool=inject, draft=self.speculative, count_forced=False, log=True)
        return Turn(self, row)

    def generate(self, prompts: str | Sequence[str], max_new_tokens: int = 128, temperature: float = 1.0,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                 stop: Sequence[str] | str | None = None, stream: bool = False, naive: bool = False,
                 overflow: str = "slide") -> Any:
        """Continue one prompt (``str``) or several (``list[str]``, batched) and return the new text.

        Generation of a row ends at ``EOT``, at the first of the ``stop`` strings (which is not returned, even when it
        spans several tokens), or after ``max_new_tokens`` tokens; past the context length it slides (``overflow``:
        see :meth:`generate_ids`). ``stream=True`` returns an iterator of text pieces (for several prompts:
        ``(row, piece)`` pairs); a piece never ends inside a UTF-8 character.
        """
        if self.tokenizer is None:
            raise ValueError("this Generator has no tokenizer; use generate_ids, or pass tokenizer=")
        single = isinstance(prompts, str)
        texts = [prompts] if single else list(prompts)
        for i, t in enumerate(texts):
            if not isinstance(t, str) or t == "":
                raise ValueError(f"prompt {i} is empty (or not a string); give some text to continue")
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        rows = [self.tokenizer.encode(t) for t in texts]
        n_new = self._check_prompts(rows, max_new_tokens, overflow, temperature, top_k, top_p, seed)
        it = ((b, piece) for b, _, piece in self._steps(rows, n_new, temperature, top_k, top_p, seed, None, stops,
                                                         naive) if piece)
        if stream:
            return (p for _, p in it) if single else it
        out = [""] * len(rows)
        for b, piece in it:
            out[b] += piece
        return out[0] if single else out


class Turn:
    """A reply being generated (see :meth:`Generator.turn`): iterate for ``(token_id, text, forced)``.

    ``text`` is the final text the token completes (possibly empty: a UTF-8 character can span tokens; a
    special token is its own string); ``forced`` marks ids that ``inject`` returned. After iteration,
    ``ids`` holds every id of the reply in order (forced ones included, the stop token not) and
    ``finish_reason`` is ``"stop"`` (a stop token), ``"length"`` (``max_new_tokens``) or ``"context"`` (the
    context is full). A reply that ends inside a UTF-8 character ends with ``(-1, "\ufffd", False)``.
    ``prefilled``: the prompt tokens run through the model (the rest came from the prefix cache).
    """

    def __init__(self, gen: Generator, row: Row) -> None:
        self._gen, self._row = gen, row
        self.ids = row.ids  # the row's own list, filled as it decodes

    @property
    def finish_reason(self) -> str | None:
        return self._row.finish

    @property
    def prefilled(self) -> int:
        return len(self._row.prompt) - self._row.cached

    def __iter__(self) -> Iterator[tuple[int, str, bool]]:
        """Decode the row alone to its end (:meth:`Generator.turn`); its prompt and reply stay in the prefix cache."""
        r, engine, steps, cache = self._row, self._gen.engine, self._gen.rows, self._gen.prefix_cache
        engine.open_slots(1, engine.context_length)
        with torch.inference_mode():
            _, logits, r.cached = admit_cached(engine, cache, r.prompt)
        try:
            steps.advance(r, logits)
            yield from _taken(r)
            while r.finish is None:
                steps.end_full(engine, [r])
                if r.finish is None:
                    steps.step(engine, [r])
                yield from _taken(r)
            if r.error is not None:
                raise ValueError(r.error)
        finally:
            if cache is not None and engine.active:
                keep_row(engine, cache, 0)


def _taken(r: Row) -> Iterator[tuple[int, str, bool]]:
    """The tokens row ``r`` took since the last call, then (once it ended) the text its stream still held."""
    log, r.log = r.log, []
    yield from log
    r.pending = r.pending[sum(len(p) for _, p, _ in log):]
    if r.finish is not None and r.pending:
        tail, r.pending = r.pending, ""
        yield -1, tail, False


class _Recompute:
    """The naive path as an engine (the oracle): each step runs the model's whole forward over every row's window,
    no cache; a window over the context drops its oldest ``window_drop`` tokens, as the engine's rows slide."""

    def __init__(self, gen: Generator) -> None:
        self.model, self.device, self.ctx = gen.model, gen.device, gen.cfg.context_length
        self.keep = self.ctx + 1 - gen.engine.window_drop
        self.seqs: list[list[int]] = []

    def prefill(self, rows: Sequence[Sequence[int]], capacity: int) -> torch.Tensor:
        self.seqs = [list(r) for r in rows]
        return self._logits()

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        for s, t in zip(self.seqs, tokens.tolist()):
            s.append(t)
            if len(s) > self.ctx:
                del s[: len(s) - self.keep]
        return self._logits()

    def _logits(self) -> torch.Tensor:  # (called in inference mode)
        return torch.cat([self.model(torch.tensor([s], device=self.device))[:, -1] for s in self.seqs])

    def serial_torch(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()
