"""The inference engine: a model, its one KV cache, and the C++ decode step as the fast path.

``Engine.prefill`` runs the prompts into a :class:`~lmforge.model.KVCache`; ``Engine.step`` feeds one token per
row. On CPU with float32 weights and the C++ extension built, both call the C++ decode step
(``_core.DecodeModel.step``, on weights packed for decoding; what it computes:
:data:`~lmforge.generate.packed.KERNEL_IMPLEMENTS`): a step feeds one token per row, a prompt its T tokens as the T
rows of each product (the weights read once for all of them). Its kernels are batch invariant, so a row's numbers
are the same bits whatever else is in the batch, and a prompt's tokens get the numbers T steps would give them.
Everywhere else, and for a model with an option the step does not implement
(:func:`~lmforge.generate.packed.kernel_unsupported`), prefill and steps are the model's own forward over the cache
(``TransformerLM.hidden``, then ``TransformerLM.logits``); tests hold the kernel path to that forward.

Rows join and leave between steps (continuous batching: ``open_slots``, ``admit``, ``fork``, ``release``); the
drivers of :mod:`lmforge.generate.rows` decide who waits.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from lmforge._native import core
from lmforge.checkpoint import unwrap_model
from lmforge.generate.graphs import StepGraphs
from lmforge.generate.packed import (INT4, PackedLinear, Q8Linear, activations_of, kernel_available, kernel_unsupported,
                                     weight_dtype_of)
from lmforge.model import KVCache, cached_projections
from lmforge.model.lora import has_lora, merged_copy

__all__ = ["Engine"]

class Engine:
    """Prefill + one-token-per-step decoding of a ``TransformerLM`` over a preallocated KV cache (its rows:
    :class:`~lmforge.model.KVCache`).

    When a row's cache is full (``context_length`` tokens) and ``step`` must feed it one more token, the row
    slides: of its ``context_length + 1`` tokens (the new one included) it drops the oldest ``window_drop``, re-runs
    the rest into its emptied cache row at positions from 0, and goes on; so a row re-prefills once per
    ``window_drop`` steps (default: a quarter of the context).

    On the kernel path the weights are packed once: a copy, and CUDA graphs replay on the weights they were
    captured with, so build a new engine (``Generator.refresh()``) after changing the model. ``weight_dtype`` (kernel
    path only; :data:`~lmforge.generate.packed.WEIGHT_DTYPES`) stores them rounded and ``activations``
    (:data:`~lmforge.generate.packed.ACTIVATIONS`) picks the products' arithmetic; ``self.model`` then becomes a
    copy that computes exactly that (the rounded matrices; with int8 activations,
    :class:`~lmforge.generate.packed.Q8Linear` projections), which the reference, ``Engine(engine.model,
    use_kernel=False)``, runs. ``use_kernel=False`` forces the PyTorch path; ``static_steps`` (that path; default:
    on CUDA) runs its steps with fixed shapes, as CUDA graphs on a GPU (:mod:`lmforge.generate.graphs`).
    ``compile_steps`` (with static steps; True, or ``torch.compile`` options) compiles that step first, once per
    batch size, so the graph replays fewer, fused kernels (opt-in: the compile takes tens of seconds).
    """

    def __init__(self, model: Any, window_drop: int | None = None,
                 weight_dtype: torch.dtype | str | None = None, use_kernel: bool | None = None,
                 activations: str | None = None, static_steps: bool | None = None,
                 compile_steps: bool | dict[str, Any] = False) -> None:
        model = unwrap_model(model)
        if has_lora(model):  # the kernels pack plain weights: decode a merged copy (the same logits)
            model = merged_copy(model)
        self.cfg = model.cfg
        self.context_length = int(self.cfg.context_length)
        if window_drop is None:
            window_drop = max(1, self.context_length // 4)
        if isinstance(window_drop, bool) or not isinstance(window_drop, int) \
                or not 1 <= window_drop <= self.context_length:
            raise ValueError(f"window_drop must be an integer in [1, {self.context_length}] (got {window_drop!r})")
        self.window_drop = window_drop
        p = model.lm_head.weight
        self.device, self.dtype = p.device, p.dtype
        self.weight_dtype = weight_dtype_of(weight_dtype) or self.dtype
        unsupported = kernel_unsupported(self.cfg)
        if use_kernel and unsupported:
            raise ValueError(f"use_kernel=True: the C++ decode step does not implement this model's "
                             f"{', '.join(unsupported)}; leave use_kernel unset (the model's forward decodes it)")
        can = self.device.type == "cpu" and self.dtype == torch.float32 and kernel_available() and not unsupported
        if use_kernel and not can:
            raise ValueError(f"use_kernel=True needs a float32 model on CPU and lmforge's C++ extension "
                             f"(this model is {self.dtype} on {self.device})")
        self._kernel = can if use_kernel is None else bool(use_kernel)
        self.activations = activations_of(activations, self.weight_dtype)  # the settings' own conflicts first
        if self.weight_dtype == INT4 and not self._kernel:
            raise ValueError(f"int4 weights run on the CPU decode kernel only (a float32 model on CPU with lmforge's "
                             f"C++ extension); this model is {self.dtype} on {self.device.type}, and int4 has no "
                             f"path there yet: decode on CPU (--device cpu)")
        if self.weight_dtype != self.dtype and not self._kernel:
            raise ValueError(f"weight_dtype={self.weight_dtype} needs the CPU decode kernel (a float32 model on CPU "
                             f"with lmforge's C++ extension built); this model is {self.dtype} on {self.device}: leave "
                             f"it unset, or decode on CPU (--device cpu)")
        self.model = model
        self._decoder: Any = None  # the C++ step's model (kernel path)
        self._arrays: tuple[np.ndarray, ...] = ()  # numpy views of cache.k, .v, .lengths and tokens (kernel path)
        self._vocab = 0  # logits per row of a kernel step
        if self._kernel:
            self._pack(model)
        self.cache: KVCache | None = None
        self.tokens: torch.Tensor | None = None  # (B, capacity): each row's tokens, the cache's token_ids
        self.active = 0  # live rows (0 .. active-1); all of them after prefill
        self._threads: int | None = None  # the kernel's threads inside serial_torch
        static = self.device.type == "cuda" and not self._kernel if static_steps is None else bool(static_steps)
        if static and self._kernel:
            raise ValueError("static_steps is the PyTorch path's (CUDA graphs); the CPU decode kernel has its own "
                             "steps: pass use_kernel=False with it, or leave static_steps unset")
        if compile_steps and not static:
            raise ValueError("compile_steps compiles the static steps: use it with static_steps (the default on CUDA)")
        run = lambda t, c: self._run(t, c, None)  # noqa: E731
        if compile_steps:  # one compile per batch size (static shapes), then captured like the eager step
            run = torch.compile(run, dynamic=False, **(compile_steps if isinstance(compile_steps, dict) else {}))
        self._graphs = (StepGraphs(run, self.device.type == "cuda", lambda: cached_projections(self.model))
                        if static else None)

    def _pack(self, model: Any) -> None:
        """Pack the matrices for the kernel and build the C++ step's model (``self._decoder``): per layer
        ``(ln1, q|k|v, out, ln2, w1|w3, w2)``, then the final norm and the head; with rounded storage,
        ``self.model`` becomes the copy the class docstring describes."""
        sd = {k: v.detach() for k, v in model.state_dict().items()}
        twin = copy.deepcopy(model) if self.weight_dtype != self.dtype else None
        q8 = self.activations == "int8"

        def pack(*names: str) -> PackedLinear:
            w = torch.cat([sd[n] for n in names]) if len(names) > 1 else sd[names[0]]  # (sum of outs, in)
            packed = PackedLinear(w, self.weight_dtype, self.activations)
            if twin is not None:
                for n, part in zip(names, packed.weight().split([sd[n].shape[0] for n in names])):
                    with torch.no_grad():
                        twin.get_parameter(n).copy_(part)
                    if q8:  # the projection computes the integer arithmetic (same codes: per output, as fused)
                        parent, _, leaf = n.removesuffix(".weight").rpartition(".")
                        setattr(twin.get_submodule(parent) if parent else twin, leaf,
                                Q8Linear(twin.get_parameter(n), PackedLinear(sd[n], self.weight_dtype, "int8")))
            return packed

        def vec(name: str) -> Any:
            return sd[name].contiguous().numpy()

        layers = []
        for i in range(self.cfg.n_layers):
            p = f"layers.{i}."
            layers.append((vec(p + "ln1.weight"),
                           pack(p + "attn.q_proj.weight", p + "attn.k_proj.weight", p + "attn.v_proj.weight").spec(),
                           pack(p + "attn.output_proj.weight").spec(), vec(p + "ln2.weight"),
                           pack(p + "ffn.w1.weight", p + "ffn.w3.weight").spec(), pack(p + "ffn.w2.weight").spec()))
        head = pack("lm_head.weight")
        if twin is not None:
            self.model = (twin.set_fast(False) if q8 else twin).eval()
        rope = self.model.layers[0].attn.rope  # the model's one RoPE table
        # The embedding the model's forward reads (the rounded head's, when tied and rounded).
        embed = self.model.token_embeddings.weight.detach().contiguous().numpy()
        self._decoder = core().DecodeModel(embed, rope.cos.contiguous().numpy(), rope.sin.contiguous().numpy(),
                                           self.cfg.n_heads, self.cfg.n_kv_heads, self.cfg.d_ff,
                                           float(self.cfg.norm_eps), layers, vec("ln_final.weight"), head.spec(),
                                           head.n)
        self._vocab = head.n

    @contextlib.contextmanager
    def serial_torch(self) -> Iterator[None]:
        """Within: PyTorch's ops on one thread, the decode kernel on PyTorch's thread count (restored after).

        The kernel has its own thread pool. Left multi-threaded, PyTorch's OpenMP workers spin-wait after
        each parallel op and take the cores the kernel's threads need, while a decode step's small ops gain
        nothing from threads.
        ``step`` enters it itself; a caller also sampling from the logits (a parallel op at batch 8 x 10k
        vocab) can hold it around both. Nests; no-op off the kernel path.
        """
        n = torch.get_num_threads()
        if not self._kernel or self._threads is not None:  # nothing to do, or already inside
            yield
            return
        self._threads = n  # also at n == 1: the kernel calls need a count, never None
        if n > 1:
            torch.set_num_threads(1)
        try:
            yield
        finally:
            if n > 1:
                torch.set_num_threads(n)
            self._threads = None

    @property
    def lengths(self) -> list[int]:
        """Tokens each row holds in the cache."""
        return [] if self.cache is None else self.cache.lengths.tolist()

    def _new_cache(self, rows: int, capacity: int) -> None:
        """An empty cache of ``rows`` rows (``tokens``: its token ids); on the kernel path also its numpy views. A cache
        of the same shape is emptied in place instead: with static steps zeroed (its captured graphs stay valid);
        on the kernel path only its lengths and tokens, since the kernels never read a row's keys and values past
        its length (no fresh pages to fault in and zero)."""
        same = self.cache is not None and (self.cache.batch_size, self.cache.capacity) == (rows, capacity)
        if same and (self._kernel or self._graphs is not None):
            kv = () if self._kernel else (self.cache.k, self.cache.v)
            for t in (*kv, self.cache.lengths, self.tokens):
                t.zero_()
            return
        if self._graphs is not None:
            self._graphs.reset()
        self.cache = KVCache.for_model(self.model, rows, capacity)
        self.tokens = self.cache.token_ids
        if self._kernel:  # the step's bookkeeping in numpy: a few microseconds less per token than in torch ops
            self._arrays = (self.cache.k.numpy(), self.cache.v.numpy(), self.cache.lengths.numpy(), self.tokens.numpy())

    def _run(self, tokens: torch.Tensor, cache: KVCache, last: torch.Tensor | None) -> torch.Tensor:
        """The model's forward over ``cache``; logits ``(B, V)`` at column ``last[b]`` of each row (None: the last)."""
        h = self.model.hidden(tokens, cache=cache)  # (B, T, C)
        h = h[:, -1] if last is None else h[torch.arange(h.shape[0], device=h.device), last]  # (B, C)
        return self.model.logits(h)  # (B, V)

    def _fill(self, cache: KVCache, rows: Sequence[Sequence[int]], first: int = 0, start: int = 0) -> torch.Tensor:
        """Run the prompts ``rows`` into ``cache`` (on the kernel path they are rows ``first ..`` of ``self.cache``),
        whose rows already hold the keys and values of their first ``start`` tokens (0: none); next-token logits."""
        T = max(len(r) for r in rows)
        assert 0 <= start < min(len(r) for r in rows) and T <= cache.capacity, (start, T, cache.capacity)
        lengths = torch.tensor([len(r) for r in rows], device=self.device)  # (B,)
        ids = cache.token_ids
        ids[:, start:T] = 0  # right-padded prompts
        for b, r in enumerate(rows):
            ids[b, : len(r)] = torch.as_tensor(list(r), dtype=torch.long)
        if self._kernel:
            return torch.cat([self._prompt_kernel(first + b, ids[b, start: len(r)], start)
                              for b, r in enumerate(rows)])
        # Right padding: a row's real tokens never see its pads under causal attention (pads come after).
        cache.lengths.fill_(start)
        logits = self._run(ids[:, start:T], cache, None if bool((lengths == T).all()) else lengths - 1 - start)
        cache.lengths.copy_(lengths)  # the pads are forgotten: their columns are overwritten next
        return logits

    def _prompt_kernel(self, row: int, ids: torch.Tensor, start: int | None = 0, every: bool = False) -> torch.Tensor:
        """Kernel path: the tokens ``ids (T,)`` into cache row ``row`` of ``self.cache`` after its first ``start``
        columns (None: after the tokens it holds), as one call of the C++ step with the tokens as rows (the same
        kernels and numbers as T single steps: batch invariant); the next token's logits ``(1, V)``, or with
        ``every`` the logits after each token ``(T, V)``."""
        k, v, lengths, _ = self._arrays
        if start is not None:
            lengths[row] = start
        logits = torch.empty(len(ids) if every else 1, self._vocab)
        with self.serial_torch():
            self._decoder.step(np.ascontiguousarray(ids.numpy(), dtype=np.int64), k, v, lengths[row: row + 1],
                               logits.numpy(), self._threads, row)
        return logits

    @torch.inference_mode()
    def prefill(self, rows: Sequence[Sequence[int]], capacity: int) -> torch.Tensor:
        """Start a generation: a cache of ``capacity`` columns (the last one reused if it has this shape), run
        the prompts ``rows``; returns the logits of the next token of each row ``(B, V)``.

        ``capacity`` must not exceed the model's context length; rows slide (class docstring) only if it equals
        it. A new cache is zeroed inside :meth:`serial_torch` too (its reason holds for a parallel fill).
        """
        B, T = len(rows), max(len(r) for r in rows)
        assert 0 < T <= capacity <= self.context_length, (T, capacity, self.context_length)
        with self.serial_torch():
            self._new_cache(B, capacity)
            self.active = B
            return self._fill(self.cache, rows)

    # Continuous batching: rows join and leave between steps
    @torch.inference_mode()
    def open_slots(self, n_slots: int, capacity: int | None = None) -> None:
        """Start serving: an empty cache of ``n_slots`` rows of ``capacity`` columns (default: the context).

        Live rows are always ``0 .. active-1``: :meth:`admit` prefills new prompts into the next free rows,
        :meth:`release` frees a row by moving the last live row into it, and :meth:`step` feeds the live rows
        only (one batched step over a prefix of the cache, whose per-layer tensors stay contiguous).
        """
        capacity = self.context_length if capacity is None else capacity
        if isinstance(n_slots, bool) or not isinstance(n_slots, int) or n_slots < 1:
            raise ValueError(f"n_slots must be a positive integer (got {n_slots!r})")
        self._new_cache(n_slots, capacity)
        self.active = 0

    @property
    def free_slots(self) -> int:
        """Rows :meth:`admit` can still fill (0 before :meth:`open_slots`)."""
        return 0 if self.cache is None else self.cache.batch_size - self.active

    @torch.inference_mode()
    def admit(self, prompt: Sequence[int], start: int = 0) -> tuple[int, torch.Tensor]:
        """Prefill ``prompt`` into the next free row; returns ``(row, next-token logits (V,))``.

        The prompt runs alone through the model's forward into a view of its row, so its numbers do not
        depend on which other rows are live. ``start > 0``: the row's cache columns ``0 .. start-1`` already hold
        the keys and values of ``prompt[:start]`` (a prefix cache restored them); only the rest runs.
        """
        assert self.cache is not None and self.active < self.cache.batch_size, "no free row: release one first"
        row = self.active
        logits = self._fill(self.cache.rows(row), [prompt], first=row, start=start)
        self.active += 1
        return row, logits[0]

    @torch.inference_mode()
    def release(self, row: int) -> int | None:
        """Free live row ``row`` at once. The last live row moves into its place (cache columns, tokens,
        length); returns that row's old index, or None when ``row`` was the last one (nothing moved)."""
        assert self.cache is not None and 0 <= row < self.active, (row, self.active)
        last = self.active - 1
        if row != last:
            self.cache.copy_row(last, row)
        self.cache.lengths[last] = 0
        self.active = last
        return None if row == last else last

    @torch.inference_mode()
    def fork(self, row: int) -> int:
        """Copy live row ``row`` (cache columns, tokens, length) into the next free row and return that row:
        several samples of one prompt share its prefill."""
        assert self.cache is not None and 0 <= row < self.active < self.cache.batch_size, (row, self.active)
        self.cache.copy_row(row, self.active)
        self.active += 1
        return self.active - 1

    def _refill(self, rows: slice, kept: torch.Tensor) -> None:
        """Empty the cache rows ``rows`` and run ``kept (b, n)`` into them (a sliding row's re-prefill)."""
        view = self.cache.rows(rows)
        view.reset()
        if self._kernel:
            for b in range(kept.shape[0]):
                self._prompt_kernel(rows.start + b, kept[b])
        else:
            self.model.hidden(kept, cache=view)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row ``(B,)`` after each row's cached tokens; returns next-token logits ``(B, V)``.

        A row whose cache is full slides first (class docstring).
        """
        assert self.cache is not None, "prefill not called"
        B = tokens.shape[0]
        assert 0 < B <= self.cache.batch_size, (B, self.cache.batch_size)
        if self._kernel and self._threads is not None:
            # inside serial_torch (the decode loops): the kernel step makes no autograd graph, so skip _step's wrappers
            return self._step_kernel(tokens)
        return self._step(tokens)

    @torch.inference_mode()
    def _step(self, tokens: torch.Tensor) -> torch.Tensor:
        """:meth:`step` in inference mode with PyTorch on one thread (the kernel's pool on its thread count)."""
        B = tokens.shape[0]
        if self._kernel:
            with self.serial_torch():
                return self._step_kernel(tokens)
        lengths = self.cache.lengths[:B]  # the live rows'
        self._slide_full(B, lengths)
        self.tokens[torch.arange(B, device=self.device), lengths] = tokens
        if self._graphs is not None:
            return self._graphs.step(self.cache, tokens)
        cache = self.cache if B == self.cache.batch_size else self.cache.rows(slice(0, B))
        return self._run(tokens[:, None], cache, None)

    def _slide_full(self, B: int, lengths: Any) -> None:
        """Slide the rows among the live rows ``0 .. B-1`` whose cache is full (``lengths``: theirs, a tensor
        or an array; one cheap check per step, the row list only when needed): each keeps its newest ``keep - 1``
        tokens, re-prefilled (the next token makes ``keep``)."""
        capacity = self.cache.capacity
        if int(lengths.max()) < capacity:
            return
        assert capacity == self.context_length, "only a full context slides"
        full = [b for b in range(B) if int(lengths[b]) == capacity]
        keep = self.context_length + 1 - self.window_drop  # >= 1
        for rows in [slice(0, B)] if len(full) == B else [slice(b, b + 1) for b in full]:
            kept = self.tokens[rows, capacity - keep + 1:].clone()  # (b, keep - 1)
            self.tokens[rows, : keep - 1] = kept
            if keep > 1:
                self._refill(rows, kept)
            else:
                self.cache.rows(rows).reset()

    def _step_kernel(self, tokens: torch.Tensor) -> torch.Tensor:
        """``step`` on CPU: one call into the C++ decode step, on the cache's own tensors (the live rows are
        its first ``B``); it writes their keys, values and lengths."""
        B = tokens.shape[0]
        k, v, lengths, history = self._arrays
        lengths = lengths[:B]  # a view: the step moves the cache's lengths on
        self._slide_full(B, lengths)
        ids = np.ascontiguousarray(tokens.numpy(), dtype=np.int64)
        history[np.arange(B), lengths] = ids
        logits = torch.empty(B, self._vocab)  # (B, V)
        self._decoder.step(ids, k, v, lengths, logits.numpy(), self._threads)
        return logits

    # Speculative decoding: several tokens of one row in one pass, and taking back the rejected ones
    @torch.inference_mode()
    def verify(self, row: int, tokens: Sequence[int]) -> torch.Tensor:
        """Feed ``tokens (T,)`` to live row ``row`` after its cached tokens; returns the logits after each
        ``(T, V)``. The row must have room for them (no sliding here); :meth:`rollback` takes back the tail."""
        assert self.cache is not None and 0 <= row < self.active, (row, self.active)
        n, T = int(self.cache.lengths[row]), len(tokens)
        assert 0 < T and n + T <= self.cache.capacity, (n, T, self.cache.capacity)
        ids = torch.as_tensor(list(tokens), dtype=torch.long, device=self.device)
        self.tokens[row, n: n + T] = ids
        if not self._kernel:
            h = self.model.hidden(ids[None], cache=self.cache.rows(row))  # (1, T, C)
            return self.model.logits(h[0])  # (T, V)
        return self._prompt_kernel(row, ids, None, every=True)

    def rollback(self, row: int, n: int) -> None:
        """Forget the last ``n`` tokens of live row ``row`` (rejected drafts: their columns are overwritten next)."""
        assert self.cache is not None and 0 <= row < self.active and 0 <= n <= int(self.cache.lengths[row])
        self.cache.lengths[row] -= n
