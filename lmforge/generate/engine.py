"""The inference engine under :mod:`lmforge.generate`: weights packed for decoding and a static KV cache.

* :class:`PackedLinear` is one weight matrix ``(N, K)`` stored for the decode kernel
  (``lmforge._core.linear_rows``): panels of 8 output rows, ``packed[p, k, j] = W[8p + j, k]``, so one
  product streams the weights once, sequentially, whatever the number of rows. It can store the weights
  in float32 (exact), in bfloat16 / float16 (half the bytes) or as int8 codes with one float32 scale per
  output row (a quarter; ``w ~ code * max|row| / 127``); activations and sums stay float32. At batch 1 a
  decode step is bound by reading the weights, so smaller weights make it faster; the outputs then match
  a model whose matrices were rounded that way (:meth:`PackedLinear.weight`), not the float32 model.
  :meth:`PackedLinear.reference` is the pure-PyTorch twin the tests hold the kernel to.
* :class:`CachedDecoder` prefills prompts and decodes one token per step over a preallocated KV cache.

On CPU (with the C++ extension built) every matrix product of the decoder runs in that kernel; on other
devices, or without the extension, it runs ``torch.nn.functional.linear`` on the model's own weights.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any, Callable, Iterator, Sequence, TypeVar

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["CachedDecoder", "PackedLinear", "model_config", "kernel_available", "WEIGHT_DTYPES"]

PANEL = 8  # output rows per panel of a packed weight (one AVX2 vector of float32 outputs)
# Weight storage the decode kernel reads, with the kernel's code for each.
_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.int8: 3}
WEIGHT_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                 "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16, "int8": torch.int8}


def kernel_available() -> bool:
    """Whether the C++ decode kernel (``lmforge._core.linear_rows``) is built."""
    try:
        from lmforge import _core
    except ImportError:
        return False
    return hasattr(_core, "linear_rows")


def weight_dtype_of(value: torch.dtype | str | None) -> torch.dtype | None:
    """``None``, a ``torch.dtype`` or a name (``"bf16"``, ``"float16"``, ...) as a dtype the kernel reads."""
    if value is None or isinstance(value, torch.dtype):
        dtype = value
    else:
        dtype = WEIGHT_DTYPES.get(str(value).lower())
        if dtype is None:
            raise ValueError(f"unknown weight dtype {value!r}; use one of float32, bfloat16, float16, int8")
    if dtype is not None and dtype not in _KINDS:
        raise ValueError(f"weights can be stored as float32, bfloat16, float16 or int8 for decoding, not {dtype}")
    return dtype


class PackedLinear:
    """A weight ``W (N, K)`` packed for the decode kernel; ``lin(x)`` is ``x @ W.T`` for ``x (M, K)`` float32.

    ``dtype`` is the storage precision (float32, bfloat16, float16, or int8 with a scale per output row:
    ``scale[n] = max|W[n]| / 127``, codes ``round(W / scale)``); products accumulate in float32. The packed
    copy is independent of ``W`` (later changes to ``W`` are not seen).
    """

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> None:
        if weight.dim() != 2:
            raise ValueError(f"expected a 2-D weight (out, in), got shape {tuple(weight.shape)}")
        self.n, self.k = (int(s) for s in weight.shape)
        self.dtype = dtype
        self.kind = _KINDS[dtype]
        if dtype == torch.float16 and bool(((weight.detach().abs() > 65504.0) & weight.detach().isfinite()).any()):
            raise ValueError("weights exceed float16's range (|w| > 65504); store them as bfloat16 instead")
        w = weight.detach().to("cpu", torch.float32)
        self.scales: torch.Tensor | None = None
        if dtype == torch.int8:
            if not bool(w.isfinite().all()):
                raise ValueError("int8 weights need finite values; store them as float32 instead")
            peak = w.abs().amax(1)
            self.scales = torch.where(peak > 0, peak / 127, torch.ones_like(peak))  # (N,)
            w = torch.round(w / self.scales[:, None]).clamp_(-127, 127)
        panels = -(-self.n // PANEL)
        padded = torch.zeros(panels * PANEL, self.k, dtype=dtype)
        padded[: self.n] = w.to(dtype)
        self.packed = padded.view(panels, PANEL, self.k).transpose(1, 2).contiguous()  # (P, K, 8)
        # what the kernel reads: float32 or int8, or the 16-bit patterns as uint16 (numpy has no bfloat16)
        self._array = (self.packed.view(torch.int16).numpy().view(np.uint16) if dtype in (torch.bfloat16, torch.float16)
                       else self.packed.numpy())
        self._scales = None if self.scales is None else self.scales.numpy()

    def weight(self) -> torch.Tensor:
        """The stored weight as ``(N, K)`` float32 (rounded to ``dtype``; int8 codes times their row scale)."""
        w = self.packed.transpose(1, 2).reshape(-1, self.k)[: self.n].float()
        return w if self.scales is None else w * self.scales[:, None]

    def __call__(self, x: torch.Tensor, threads: int | None = None) -> torch.Tensor:
        """``x @ W.T`` on ``threads`` threads of the kernel's own pool (default: ``torch.get_num_threads()``)."""
        from lmforge import _core

        x = x.float().contiguous()
        y = torch.empty(x.shape[0], self.n)
        _core.linear_rows(x.numpy(), self._array, self.kind, y.numpy(), threads or torch.get_num_threads(),
                          self._scales)
        return y

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` in PyTorch from the same stored weights (the kernel's test oracle)."""
        return x.float() @ self.weight().T


_F = TypeVar("_F", bound=Callable[..., Any])


def _serial_torch(method: _F) -> _F:
    """Run a decoder method inside :meth:`CachedDecoder.serial_torch` (see there)."""
    @functools.wraps(method)
    def wrapper(self: "CachedDecoder", *args: Any, **kwargs: Any) -> Any:
        with self.serial_torch():
            return method(self, *args, **kwargs)
    return wrapper  # type: ignore[return-value]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, scale: float,
            threads: int | None) -> torch.Tensor:
    """One decode step's attention in the C++ kernel: ``q (B, H, D)`` over caches ``(B, Hkv, S, D)``, row ``b``
    over its first ``lengths[b]`` columns; returns ``(B, H, D)``. ``CachedDecoder.step``'s matmul path
    (off CPU) computes the same; the tests hold both to a direct formula."""
    from lmforge import _core

    q = q.contiguous()
    out = torch.empty_like(q)
    _core.attend_rows(q.numpy(), k.numpy(), v.numpy(), lengths.numpy(), scale, out.numpy(),
                      threads or torch.get_num_threads())
    return out


class _TorchLinear:
    """``x @ W.T`` with ``torch.nn.functional.linear``: the path off CPU or without the C++ extension."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.w = weight

    def __call__(self, x: torch.Tensor, threads: int | None = None) -> torch.Tensor:
        return F.linear(x, self.w)


def model_config(model: Any) -> Any:
    """The ``ModelConfig`` of a ``TransformerLM`` (also through DDP/compile wrappers)."""
    for obj in (model, getattr(model, "module", None), getattr(model, "_orig_mod", None)):
        for attr in ("cfg", "config"):
            cfg = getattr(obj, attr, None)
            if cfg is not None and hasattr(cfg, "n_layers"):
                return cfg
    raise ValueError(f"{type(model).__name__} has no ModelConfig (.cfg/.config); pass an lmforge TransformerLM")


class CachedDecoder:
    """Prefill + one-token-per-step decoding of a ``TransformerLM`` with a preallocated KV cache.

    The weights are read from the model's state dict (CS336 names) and packed for decoding: ``q|k|v`` and
    ``w1|w3`` concatenated, so each layer does three matrix products per token. The decoder therefore does
    not see later changes to the model's parameters; build a new one (``Generator.refresh()``) after
    training further. The arithmetic is the model's: pre-norm RMSNorm, RoPE on adjacent pairs
    ``(2i, 2i+1)``, causal (grouped-query) attention, SwiGLU, final norm, LM head.

    On CPU every matrix product runs in the C++ decode kernel on :class:`PackedLinear` weights, stored as
    ``weight_dtype`` (default: the model's float32, exact; bfloat16 or float16 halve the bytes read per
    token, int8 quarters them), and ``step`` also does its attention, RMSNorm, RoPE and SwiGLU in C++ (see :meth:`serial_torch`
    for how threads are shared with PyTorch). Elsewhere, or without the C++ extension, or with ``use_kernel=False`` (the PyTorch reference
    path the tests compare the kernels with), products use ``F.linear`` on the model's weights and
    ``weight_dtype`` must be left unset.

    Rows are independent: row ``b`` holds its tokens in cache columns ``0 .. lengths[b]-1`` (prompts are
    right-padded, so plain causal attention serves the prefill and RoPE positions are cache columns). When
    a row's cache is full (``context_length`` tokens) and ``step`` must feed it one more token, the row
    slides: of its ``context_length + 1`` tokens (the new one included) it drops the oldest ``window_drop``,
    recomputes the keys and values of the rest with positions restarting at 0, and goes on. So a row
    re-prefills once per ``window_drop`` steps; ``window_drop`` (default: a quarter of the context) trades
    that cost against how much context is lost at once (``1`` is a window sliding by one token per step,
    a re-prefill per step).
    """

    def __init__(self, model: Any, window_drop: int | None = None,
                 weight_dtype: torch.dtype | str | None = None, use_kernel: bool | None = None) -> None:
        cfg = model_config(model)
        self.cfg = cfg
        for wrapper_attr in ("module", "_orig_mod"):  # DDP / torch.compile wrappers prefix the state-dict names
            model = getattr(model, wrapper_attr, model)
        # a private copy: later changes to the model (training on) are not seen; Generator.refresh() rebuilds
        self._sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.n_heads = cfg.n_heads
        self.n_kv = getattr(cfg, "n_kv_heads", None) or cfg.n_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        self.eps = float(cfg.norm_eps)
        self.context_length = int(cfg.context_length)
        if window_drop is None:
            window_drop = max(1, self.context_length // 4)
        if not 1 <= window_drop <= self.context_length:
            raise ValueError(f"window_drop must be in [1, {self.context_length}] (got {window_drop})")
        self.window_drop = int(window_drop)
        self._scale = 1.0 / math.sqrt(self.head_dim)
        self.embedding = self._sd["token_embeddings.weight"]
        self.device = self.embedding.device
        self.dtype = self.embedding.dtype
        self.ln_final = self._sd["ln_final.weight"]
        wd = weight_dtype_of(weight_dtype)
        can = self.device.type == "cpu" and self.dtype == torch.float32 and kernel_available()
        if use_kernel and not can:
            raise ValueError(f"use_kernel=True needs a float32 model on CPU and lmforge's C++ extension "
                             f"(this model is {self.dtype} on {self.device})")
        self._kernel = can if use_kernel is None else use_kernel
        if wd is not None and wd != self.dtype and not self._kernel:
            raise ValueError(f"weight_dtype={wd} needs the CPU decode kernel (a float32 model on CPU with lmforge's "
                             f"C++ extension built); this model is {self.dtype} on {self.device}: leave it unset")
        self.weight_dtype = wd or self.dtype
        self._layers, self._head = self._pack()
        self._sd = {}  # the packed weights are the copy now
        # RoPE as complex rotations: pair i of a head at position t turns by t * theta^(-2i/D).
        half = self.head_dim // 2
        inv_freq = 1.0 / (float(cfg.rope_theta) ** (torch.arange(half, dtype=torch.float64) * 2 / self.head_dim))
        angles = torch.outer(torch.arange(self.context_length, dtype=torch.float64), inv_freq)  # (S, D/2)
        self.rope = torch.polar(torch.ones_like(angles), angles).to(torch.complex64).to(self.device)
        self._cos_sin = (self.rope.real.contiguous().numpy(), self.rope.imag.contiguous().numpy()) if self._kernel else None
        # Per-generation state, set by prefill(): caches (L, B, Hkv, S, D), the tokens in the cache (B, S),
        # each row's cached length (a list, and a (B,) tensor for indexing).
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.tokens: torch.Tensor | None = None
        self.lengths: list[int] = []
        self._lengths_t: torch.Tensor | None = None
        self._threads: int | None = None  # the kernel's threads inside prefill/step (see _serial_torch)

    # ---------------------------------------------------------------------------------------------
    def _pack(self) -> tuple[list[tuple[Any, ...]], Any]:
        """Per layer ``(ln1, qkv, out, ln2, w1|w3, w2)`` and the LM head, as callables ``x -> x @ W.T``."""
        sd = self._sd

        def fuse(*names: str) -> Any:
            w = torch.cat([sd[n] for n in names]) if len(names) > 1 else sd[names[0]]  # (sum of outs, in)
            return PackedLinear(w, self.weight_dtype) if self._kernel else _TorchLinear(w)

        layers = []
        for i in range(self.cfg.n_layers):
            p = f"layers.{i}."
            layers.append((sd[p + "ln1.weight"], fuse(p + "attn.q_proj.weight", p + "attn.k_proj.weight",
                                                      p + "attn.v_proj.weight"),
                           fuse(p + "attn.output_proj.weight"), sd[p + "ln2.weight"],
                           fuse(p + "ffn.w1.weight", p + "ffn.w3.weight"), fuse(p + "ffn.w2.weight")))
        head = fuse("lm_head.weight" if "lm_head.weight" in sd else "token_embeddings.weight")
        return layers, head

    def _rms_norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """RMSNorm in float32, as the model computes it."""
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), w, self.eps)
        return F.rms_norm(x.float(), (x.shape[-1],), w.float(), self.eps).to(x.dtype)

    def _forward(self, tokens: torch.Tensor, rows: slice, last: torch.Tensor | None) -> torch.Tensor:
        """Prefill: run ``tokens`` (B, T) in cache rows ``rows``, columns ``0 .. T-1`` (causal attention).

        Returns the logits at column ``last[b]`` of each row (B, V) (``last=None``: column T-1).
        """
        B, T = tokens.shape
        H, Hkv, D = self.n_heads, self.n_kv, self.head_dim
        layers, head = self._layers, self._head
        rot = self.rope[:T].view(1, T, 1, -1)  # (1, T, 1, D/2)
        x = F.embedding(tokens.reshape(-1), self.embedding)  # (B*T, C)
        for layer, (ln1, w_qkv, w_o, ln2, w_13, w_2) in enumerate(layers):
            qkv = w_qkv(self._rms_norm(x, ln1), self._threads)  # (B*T, (H + 2 Hkv) D)
            qk = torch.view_as_complex(qkv[:, : (H + Hkv) * D].float().reshape(B, T, H + Hkv, D // 2, 2))
            qk = torch.view_as_real(qk * rot).reshape(B, T, H + Hkv, D).to(x.dtype)  # RoPE on q and k heads
            q = qk[:, :, :H].transpose(1, 2)  # (B, H, T, D)
            k_cache, v_cache = self.k_cache[layer, rows], self.v_cache[layer, rows]  # (B, Hkv, S, D)
            k_cache[:, :, :T] = qk[:, :, H:].transpose(1, 2)
            v_cache[:, :, :T] = qkv[:, (H + Hkv) * D :].view(B, T, Hkv, D).transpose(1, 2)
            att = F.scaled_dot_product_attention(q, k_cache[:, :, :T], v_cache[:, :, :T], is_causal=True,
                                                 enable_gqa=Hkv != H)  # (B, H, T, D)
            x = x + w_o(att.transpose(1, 2).reshape(B * T, H * D), self._threads)  # (B*T, C)
            gate, up = w_13(self._rms_norm(x, ln2), self._threads).chunk(2, dim=-1)  # (B*T, F) each
            x = x + w_2(F.silu(gate) * up, self._threads)
        x = x.view(B, T, -1)
        x = x[:, -1] if last is None else x[torch.arange(B, device=self.device), last]  # (B, C)
        return head(self._rms_norm(x, self.ln_final), self._threads)  # (B, V)

    def _step_kernel(self, tokens: torch.Tensor) -> torch.Tensor:
        """``step`` on CPU: each operation one call into the C++ kernels (the PyTorch path below is the reference)."""
        from lmforge import _core

        B, C = tokens.shape[0], self.cfg.d_model
        H, D, th = self.n_heads, self.head_dim, self._threads
        pos = self._lengths_t  # (B,) the column (= RoPE position) of the new token
        self.tokens[torch.arange(B), pos] = tokens
        ends = pos + 1
        pos_np, ends_np = pos.numpy(), ends.numpy()
        cos, sin = self._cos_sin
        x = F.embedding(tokens, self.embedding)  # (B, C), updated in place below
        x_np = x.numpy()
        h = torch.empty(B, C)
        h_np = h.numpy()
        q, att = torch.empty(B, H, D), torch.empty(B, H, D)
        q_np, att_np = q.numpy(), att.numpy()
        for layer, (ln1, w_qkv, w_o, ln2, w_13, w_2) in enumerate(self._layers):
            k_np, v_np = self.k_cache[layer].numpy(), self.v_cache[layer].numpy()
            _core.rms_norm_rows(x_np, ln1.numpy(), self.eps, h_np)
            _core.rope_cache_rows(w_qkv(h, th).numpy(), cos, sin, pos_np, k_np, v_np, q_np)
            _core.attend_rows(q_np, k_np, v_np, ends_np, self._scale, att_np, th)
            x += w_o(att.view(B, H * D), th)
            _core.rms_norm_rows(x_np, ln2.numpy(), self.eps, h_np)
            gate_up = w_13(h, th)
            act = torch.empty(B, gate_up.shape[1] // 2)
            _core.swiglu_rows(gate_up.numpy(), act.numpy())
            x += w_2(act, th)
        self.lengths = [n + 1 for n in self.lengths]
        self._lengths_t = ends
        _core.rms_norm_rows(x_np, self.ln_final.numpy(), self.eps, h_np)
        return self._head(h, th)  # (B, V)

    @contextlib.contextmanager
    def serial_torch(self) -> Iterator[None]:
        """Within: PyTorch's ops on one thread, the decode kernel on PyTorch's thread count (restored after).

        The kernel has its own thread pool. Left multi-threaded, PyTorch's OpenMP workers spin-wait after
        each parallel op and take the cores the kernel's threads need (measured: at batch 8 the kernel's
        second thread did 5% of the work), while a decode step's small ops gain nothing from threads.
        ``prefill`` and ``step`` enter it themselves; a caller also sampling from the logits (a parallel
        op at batch 8 x 10k vocab) can hold it around both. Nests; no-op off the kernel path.
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

    # ---------------------------------------------------------------------------------------------
    @_serial_torch
    def prefill(self, rows: Sequence[Sequence[int]], capacity: int) -> torch.Tensor:
        """Start a generation: allocate a cache of ``capacity`` columns, run the prompts ``rows``.

        Returns the logits of the next token of each row ``(B, V)``. ``capacity`` must not exceed the
        model's context length; rows slide (see the class docstring) only if it equals it.
        """
        B, T = len(rows), max(len(r) for r in rows)
        assert 0 < T <= capacity <= self.context_length, (T, capacity, self.context_length)
        self.lengths = [len(r) for r in rows]
        self._lengths_t = torch.tensor(self.lengths, device=self.device)  # (B,)
        self.tokens = torch.zeros(B, capacity, dtype=torch.long, device=self.device)  # right-padded prompts
        for b, r in enumerate(rows):
            self.tokens[b, : len(r)] = torch.as_tensor(list(r), dtype=torch.long)
        shape = (self.cfg.n_layers, B, self.n_kv, capacity, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        # Right padding: a row's real tokens never see its pads under causal attention (pads come after).
        last = None if min(self.lengths) == T else self._lengths_t - 1
        return self._forward(self.tokens[:, :T], slice(None), last)

    def _slide(self, full: list[int]) -> None:
        """Rows ``full`` (at capacity) keep their newest ``keep - 1`` tokens, re-prefilled (the next token makes ``keep``)."""
        assert self.k_cache is not None and self.k_cache.shape[3] == self.context_length, "cache full"
        keep = self.context_length + 1 - self.window_drop  # >= 1
        groups = [slice(None)] if len(full) == len(self.lengths) else [slice(b, b + 1) for b in full]
        for rows in groups:
            kept = self.tokens[rows, self.context_length - keep + 1 :].clone()  # (b, keep - 1)
            self.tokens[rows, : keep - 1] = kept
            if keep > 1:
                self._forward(kept, rows, None)
        for b in full:
            self.lengths[b] = keep - 1
        self._lengths_t = torch.tensor(self.lengths, device=self.device)

    @_serial_torch
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row ``(B,)`` after each row's cached tokens; returns next-token logits ``(B, V)``.

        A row whose cache is full slides first (class docstring).
        """
        assert self.k_cache is not None, "prefill not called"
        S = self.k_cache.shape[3]
        full = [b for b, n in enumerate(self.lengths) if n == S]
        if full:
            self._slide(full)
        if self._kernel:
            return self._step_kernel(tokens)
        B = tokens.shape[0]
        H, Hkv, D = self.n_heads, self.n_kv, self.head_dim
        G = H // Hkv
        lengths = self.lengths
        uniform = min(lengths) == max(lengths)
        end = max(lengths) + 1  # attend to the valid prefix only
        pos = self._lengths_t  # (B,) the column (= RoPE position) of the new token
        if uniform:
            col = lengths[0]
            rot = self.rope[col : col + 1].view(1, 1, -1)  # (1, 1, D/2)
            self.tokens[:, col] = tokens
            mask = None
        else:
            rot = self.rope[pos].view(B, 1, -1)  # (B, 1, D/2)
            self.tokens[torch.arange(B, device=self.device), pos] = tokens
            # the cache viewed as (L, B*Hkv*S, D): row b, head h, column c is entry (b*Hkv + h)*S + c
            slot = ((torch.arange(B * Hkv, device=self.device) * S).view(B, Hkv) + pos[:, None]).view(-1)
            mask = (torch.arange(end, device=self.device)[None, :] <= pos[:, None]).view(B, 1, 1, end)
        layers, head = self._layers, self._head
        scale = 1.0 / math.sqrt(D)
        ends = (pos + 1).cpu()  # (B,) cached tokens per row after this step's
        x = F.embedding(tokens, self.embedding)  # (B, C)
        for layer, (ln1, w_qkv, w_o, ln2, w_13, w_2) in enumerate(layers):
            qkv = w_qkv(self._rms_norm(x, ln1), self._threads)  # (B, (H + 2 Hkv) D)
            qk = torch.view_as_complex(qkv[:, : (H + Hkv) * D].float().view(B, H + Hkv, D // 2, 2))
            qk = torch.view_as_real(qk * rot).view(B, H + Hkv, D).to(x.dtype)  # RoPE on q and k heads
            k_new, v_new = qk[:, H:], qkv[:, (H + Hkv) * D :].view(B, Hkv, D)  # (B, Hkv, D)
            k_cache, v_cache = self.k_cache[layer], self.v_cache[layer]  # (B, Hkv, S, D)
            if uniform:
                k_cache[:, :, col] = k_new
                v_cache[:, :, col] = v_new
            else:
                k_cache.view(-1, D).index_copy_(0, slot, k_new.reshape(-1, D))
                v_cache.view(-1, D).index_copy_(0, slot, v_new.reshape(-1, D))
            if self._kernel:  # each row over its own cached prefix, in the C++ kernel's thread pool
                att = _attend(qk[:, :H], k_cache, v_cache, ends, scale, self._threads)  # (B, H, D)
            else:  # one query per row: (B, Hkv, G, D) @ (B, Hkv, D, end) -> scores (B, Hkv, G, end)
                q = qk[:, :H].view(B, Hkv, G, D)
                scores = torch.matmul(q, k_cache[:, :, :end].transpose(-1, -2)).mul_(scale)
                if mask is not None:
                    scores.masked_fill_(~mask, float("-inf"))
                att = torch.matmul(torch.softmax(scores, dim=-1), v_cache[:, :, :end])  # (B, Hkv, G, D)
            x = x + w_o(att.reshape(B, H * D), self._threads)  # (B, C)
            gate, up = w_13(self._rms_norm(x, ln2), self._threads).chunk(2, dim=-1)  # (B, F) each
            x = x + w_2(F.silu(gate) * up, self._threads)
        self.lengths = [n + 1 for n in lengths]
        self._lengths_t = pos + 1
        return head(self._rms_norm(x, self.ln_final), self._threads)  # (B, V)


