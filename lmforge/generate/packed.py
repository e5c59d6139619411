"""Weights packed for the C++ decode kernel: one matrix ``(N, K)`` stored in panels of 8 output rows.

``packed[p, k, j] = W[8p + j, k]``, so one product streams the weights once, sequentially, whatever the number
of rows. The weights may be stored in float32 (exact), bfloat16 / float16 (half the bytes), as int8 codes with
one float32 scale per output row (a quarter; ``w ~ code * max|row| / 127``) or as int4 codes with a float16 scale
per group of 32 weights along a row (4.5 bits a weight, as llama.cpp's Q4_0, named by :data:`INT4`), rounded
exactly as Q4_0 rounds them (:func:`quantize_q4_0`).

Two arithmetics (``activations``): ``"float32"`` multiplies float32 activations by the stored weights converted to
float32 (exactly the model whose matrices are rounded); ``"int8"`` (int8 and int4 weights only) rounds the
activations to int8 per block of 32 first and sums the block's products exactly in integers, as llama.cpp does
(:func:`quantize_rows_q8`, :func:`q8_products`: the arithmetic written out; ``csrc/decode/qdot.cpp`` runs it).
At batch 1 a decode step is bound by reading the weights, so smaller weights make it faster; the outputs then
follow a model whose matrices were rounded that way (:meth:`PackedLinear.weight`), not the float32 model.
:meth:`PackedLinear.reference` is the pure-PyTorch twin the tests hold the kernel to.
"""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from lmforge._native import available, core
from lmforge.model.transformer import options_beyond

__all__ = ["PackedLinear", "WEIGHT_DTYPES", "INT4", "GROUP", "ACTIVATIONS", "weight_dtype_of", "activations_of",
           "kernel_available", "kernel_unsupported", "KERNEL_IMPLEMENTS", "quantize_q4_0", "quantize_rows_q8",
           "q8_products", "Q8Linear"]

HUGE_PAGE = 2 << 20  # bytes in one of Linux's transparent huge pages on x86-64 and most arm64 kernels
PANEL = 8  # output rows per panel of a packed weight (one AVX2 vector of float32 outputs)
GROUP = 32  # int4: weights per scale along a row (llama.cpp's Q4_0 block)
INT4 = torch.quint4x2
"""The dtype that names int4 storage (4-bit codes, two per byte, a scale per :data:`GROUP` weights)."""
# Weight storage the decode kernel reads, with the kernel's code for each.
_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.int8: 3, INT4: 4}
_Q8_KINDS = {torch.int8: 5, INT4: 6}  # the same weights multiplied with int8 activations (integer dot products)
ACTIVATIONS = ("float32", "int8")
"""The products' arithmetic: float32 activations times the weights in float32, or activations rounded to int8."""
WEIGHT_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                 "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16, "int8": torch.int8,
                 "int4": INT4}


def kernel_available() -> bool:
    """Whether the C++ decode kernels (``lmforge._core.linear_rows`` and friends) are built."""
    return available("linear_rows")


KERNEL_IMPLEMENTS: dict[str, str] = {
    "vocab_size": "the embedding's rows and the head's outputs (``DecodeModel``'s ``embed`` and ``head``)",
    "context_length": "the RoPE tables' rows (the model's ``cos``/``sin``) and the cache's columns",
    "d_model": "the width of the embedding, every norm and projection",
    "n_layers": "one ``(ln1, q|k|v, out, ln2, w1|w3, w2)`` entry per block",
    "n_heads": "``n_heads``; the head dimension is ``d_model / n_heads``, the scores scaled by its root",
    "n_kv_heads": "``n_kv_heads``: query head ``h`` reads key/value head ``h // (n_heads / n_kv_heads)``",
    "d_ff": "``d_ff``: the SwiGLU's width (``w1|w3`` packed together, then ``w2``)",
    "rope_theta": "the model's RoPE tables, passed as they are",
    "tie_embeddings": "the embedding and the head are read from their own arrays (one matrix when tied)",
    "norm_eps": "every RMSNorm's epsilon",
}
"""The allow-list of the C++ decode step (``_core.DecodeModel``, ``csrc/decode/step.cpp``): each ``ModelConfig``
field it computes at every value the config accepts, and how it gets it. With the fields that do not change the
forward (``lmforge.model.NUMERICS_ONLY``, ``INIT_ONLY``) that is all of it: the step computes a Llama (pre-norm
RMSNorm, RoPE, grouped-query attention, SwiGLU, the raw head's logits). Any other field off its default
(:func:`kernel_unsupported`) decodes through the model's forward."""


def kernel_unsupported(cfg: Any) -> list[str]:
    """The fields of model config ``cfg`` off their default that the C++ decode step does not implement (those it
    does: :data:`KERNEL_IMPLEMENTS`), as ``model.<name>=<value>``; empty: the step computes this model's forward."""
    return [f"model.{name}={value!r}" for name, value, _ in options_beyond(cfg, KERNEL_IMPLEMENTS)]


def weight_dtype_of(value: torch.dtype | str | None) -> torch.dtype | None:
    """``None``, a ``torch.dtype`` or a name (``"bf16"``, ``"float16"``, ...) as a dtype the kernel reads."""
    dtype = value if value is None or isinstance(value, torch.dtype) else WEIGHT_DTYPES.get(str(value).lower())
    if dtype is None and value is not None:
        raise ValueError(f"unknown weight dtype {value!r}; use one of float32, bfloat16, float16, int8, int4")
    if dtype is not None and dtype not in _KINDS:
        raise ValueError(f"weights can be stored as float32, bfloat16, float16, int8 or int4 for decoding, not {dtype}")
    return dtype


def activations_of(value: str | None, weight_dtype: torch.dtype | None) -> str:
    """The arithmetic ``value`` checked against the weights it multiplies: ``"int8"`` needs int8 or int4 weights
    (16- and 32-bit weights have no integer codes to multiply). None picks the default: ``"int8"`` for int8 and int4
    weights (llama.cpp's choice too; the trade measured in docs/benchmarks.md), ``"float32"`` otherwise."""
    act = ("int8" if weight_dtype in _Q8_KINDS else "float32") if value is None else str(value).lower()
    if act not in ACTIVATIONS:
        raise ValueError(f"unknown activations {value!r}; use float32 (exact products on the stored weights) or int8 "
                         "(activations rounded to int8 per 32, integer dot products)")
    if act == "int8" and weight_dtype not in _Q8_KINDS:
        raise ValueError(f"activations='int8' needs int8 or int4 weights (weight_dtype is {weight_dtype}); "
                         "set weight_dtype='int8' or 'int4', or leave activations at float32")
    return act


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """The rows of ``x (M, K)`` in float32, zero-padded to ``32 G`` and cut into blocks: ``(M, G, 32)``."""
    return F.pad(x.float(), (0, -x.shape[1] % GROUP)).unflatten(1, (-1, GROUP))


def quantize_rows_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, d)``: ``x (M, K)`` float32 rounded to int8 per block of 32 along a row, as llama.cpp's
    ``quantize_row_q8_0`` (its AVX2 build) rounds activations, with the scale kept in float32.

    A row is zero-padded to ``32 G``. Per block: ``amax = max|x|``, ``d = amax / 127``, ``id = 127 / amax`` (0 when
    ``amax`` is 0), ``code = round_half_even(x * id)`` in [-127, 127], so ``x ~ d * code``. A block holding a
    non-finite value gets ``d = nan`` and codes 0. Returns codes ``(M, 32 G)`` int8 and ``d (M, G)`` float32.
    """
    blocks = _blocks(x)  # (M, G, 32)
    bad = ~blocks.isfinite().all(2)  # (M, G)
    amax = blocks.abs().amax(2)
    # 127 / amax as one correctly rounded division, like the kernel: ``127.0 / amax`` would be
    # ``amax.reciprocal() * 127`` in PyTorch, two roundings, one float32 unit off on some blocks.
    inv = torch.where(bad | (amax == 0), torch.zeros_like(amax), torch.full_like(amax, 127.0) / amax)
    d = torch.where(bad, torch.full_like(amax, float("nan")), amax / 127.0)
    safe = torch.where(bad[..., None], torch.zeros_like(blocks), blocks)
    codes = torch.round(safe * inv[..., None]).clamp_(-127, 127).to(torch.int8)
    return codes.flatten(1), d


def q8_products(x: torch.Tensor, codes: torch.Tensor, row_scales: torch.Tensor | None = None,
                block_scales: torch.Tensor | None = None) -> torch.Tensor:
    """``x (M, K)`` times weights ``codes (N, 32 G)`` (integers: int8 codes, or int4 codes minus 8) in the integer
    arithmetic of ``csrc/decode/qdot.cpp``, the spec it is held to bit for bit.

    ``x`` is rounded by :func:`quantize_rows_q8` (codes ``q``, scales ``d``); per block ``g`` the products sum
    exactly, ``isum = sum_k q[m, k] * codes[n, k]``; then in float32, each operation rounded on its own and the
    blocks in order from ``acc = 0``: with a scale per row (int8), ``acc = acc + isum * d[m, g]`` and finally
    ``y = acc * row_scales[n]``; with a scale per block (int4), ``acc = acc + isum * (d[m, g] * block_scales[n, g])``.
    """
    q, d = quantize_rows_q8(x.float())
    groups = d.shape[1]
    assert codes.shape[1] == groups * GROUP, (codes.shape, groups)
    # every block's integer sums at once, (G, M, N): exact in float32 (each partial sum is an integer < 2^20)
    isums = torch.bmm(q.float().view(-1, groups, GROUP).transpose(0, 1),
                      codes.float().view(-1, groups, GROUP).permute(1, 2, 0))
    acc = torch.zeros(q.shape[0], codes.shape[0])
    for g in range(groups):
        scale = d[:, g, None] if block_scales is None else d[:, g, None] * block_scales[None, :, g]
        acc = acc + isums[g] * scale
    return acc if row_scales is None else acc * row_scales[None, :]


def quantize_q4_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scales)`` of ``w (N, K)`` float32 in llama.cpp's Q4_0 rounding, per block of 32 along a row.

    A row is zero-padded to a multiple of 32. Per block: ``d = m / -8`` with ``m`` the value of largest magnitude,
    ``codes = min(15, trunc(w / d + 8.5))`` (``w * (1/d)`` as ggml computes it), the scale stored as float16;
    the weight is then ``float16(d) * (code - 8)``. Returns codes ``(N, 32 G)`` uint8 and scales ``(N, G)`` float32
    (the float16 values). ``tests/generate/test_decoder.py`` holds it to the ``gguf`` package's Q4_0.
    """
    blocks = _blocks(w)  # (N, G, 32)
    peak = blocks.gather(2, blocks.abs().argmax(2, keepdim=True))  # (N, G, 1): signed, first of equals
    d = peak / -8
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    codes = torch.trunc(blocks * inv + 8.5).clamp_(0, 15).to(torch.uint8)
    return codes.flatten(1), d[..., 0].to(torch.float16).float()


def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` in memory that Linux may back with 2 MiB pages (``madvise(MADV_HUGEPAGE)`` on a
    private anonymous mapping; a system left at ``transparent_hugepage=madvise`` gives them only when asked).

    A decode step streams every packed weight once; with 4 KiB pages each 4 KiB costs a TLB miss and restarts the
    hardware prefetcher's stream. Tensors under a huge page, and systems without ``MADV_HUGEPAGE``, get a plain copy.
    """
    nbytes = t.numel() * t.element_size()
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or nbytes < HUGE_PAGE:
        return t.contiguous()
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # shared ones are shmem: no THP
    try:
        buf.madvise(advice)  # before the first touch: the pages are faulted in huge
    except OSError:  # a kernel built without transparent huge pages: 4 KiB pages, the same bytes
        pass
    out = torch.frombuffer(buf, dtype=t.dtype, count=t.numel()).view(t.shape)  # keeps buf alive
    out.copy_(t)
    return out


class PackedLinear:
    """A weight ``W (N, K)`` packed for the decode kernel; ``lin(x)`` is ``x @ W.T`` for ``x (M, K)`` float32.

    ``dtype`` is the storage and ``activations`` the arithmetic (module docstring; int8 codes are
    ``round(W / scale)`` with ``scale[n] = max|W[n]| / 127``). The packed copy is independent of ``W`` (later
    changes to ``W`` are not seen).
    """

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype = torch.float32, activations: str = "float32") -> None:
        if weight.dim() != 2:
            raise ValueError(f"expected a 2-D weight (out, in), got shape {tuple(weight.shape)}")
        self.n, self.k = (int(s) for s in weight.shape)
        self.dtype = dtype
        self.activations = activations_of(activations, dtype)
        q8 = self.activations == "int8"
        self.kind = _Q8_KINDS[dtype] if q8 else _KINDS[dtype]
        if dtype == torch.float16 and bool(((weight.detach().abs() > 65504.0) & weight.detach().isfinite()).any()):
            raise ValueError("weights exceed float16's range (|w| > 65504); store them as bfloat16 instead")
        w = weight.detach().to("cpu", torch.float32)
        if dtype in (torch.int8, INT4) and not bool(w.isfinite().all()):
            raise ValueError(f"{'int8' if dtype == torch.int8 else 'int4'} weights need finite values; store them as "
                             "float32 instead")
        self.scales: torch.Tensor | None = None
        panels = -(-self.n // PANEL)
        to_panels = (0, 0, 0, panels * PANEL - self.n)  # F.pad's widths: rows up to whole panels
        if dtype == torch.int8:
            peak = w.abs().amax(1)
            self.scales = torch.where(peak > 0, peak / 127, torch.ones_like(peak))  # (N,)
            w = torch.round(w / self.scales[:, None]).clamp_(-127, 127)
        if dtype == INT4:
            codes, scales = quantize_q4_0(w)  # (N, 32 G), (N, G)
            groups = scales.shape[1]
            pad = F.pad(codes, to_panels, value=8)  # code 8: weight 0
            self.codes = pad.view(panels, PANEL, groups * GROUP).transpose(1, 2)  # (P, 32 G, 8)
            if q8:  # per panel and block, byte [v, j, i] = code[j][4v + i] | code[j][16 + 4v + i] << 4
                c = pad.view(panels, PANEL, groups, 2, 4, 4)  # (P, j, G, half, v, i)
                self.packed = on_huge_pages((c[:, :, :, 0] | (c[:, :, :, 1] << 4)).permute(0, 2, 3, 1, 4).reshape(
                    panels, 16 * groups, PANEL))  # (P, G, v, j, i) as (P, 16 G, 8)
            else:
                self.packed = on_huge_pages(self.codes[:, 0::2] | (self.codes[:, 1::2] << 4))  # (P, 16 G, 8)
            self.scales = F.pad(scales, to_panels).view(panels, PANEL, groups).transpose(1, 2).contiguous()  # (P, G, 8)
        elif q8:  # codes zero-padded to 32 G columns; per panel byte [s, j, i] = code[j][4s + i]
            codes = F.pad(w.to(torch.int8), (0, -self.k % GROUP, 0, panels * PANEL - self.n))
            kp = codes.shape[1]
            self.packed = on_huge_pages(
                codes.view(panels, PANEL, kp // 4, 4).permute(0, 2, 1, 3).reshape(panels, kp, PANEL))
        else:
            padded = F.pad(w.to(dtype), to_panels)
            self.packed = on_huge_pages(padded.view(panels, PANEL, self.k).transpose(1, 2))  # (P, K, 8)
        # what the kernel reads: 16-bit floats as their bit patterns in uint16 (numpy has no bfloat16), the rest as is
        half = dtype in (torch.bfloat16, torch.float16)
        self._array = self.packed.view(torch.int16).numpy().view(np.uint16) if half else self.packed.numpy()
        self._scales = None if self.scales is None else self.scales.numpy()
        if dtype == INT4:  # its scales as the float16 they are (exact), as bit patterns too
            self._scales = self.scales.view(-1).to(torch.float16).view(torch.int16).numpy().view(np.uint16)

    def spec(self) -> tuple[np.ndarray, int, np.ndarray | None]:
        """``(packed array, kind, scales or None)``: the matrix as ``_core.DecodeModel`` takes it (arrays shared)."""
        return self._array, self.kind, self._scales

    def weight(self) -> torch.Tensor:
        """The stored weight as ``(N, K)`` float32 (rounded to ``dtype``; int8 codes times their row scale; int4
        ``scale * (code - 8)`` per group, exact in float32)."""
        if self.dtype == INT4:
            codes, scales = self._int4_rows()
            return (codes[:, : self.k].float() - 8) * scales.repeat_interleave(GROUP, 1)[:, : self.k]
        w = self._rows()[:, : self.k].float()
        return w if self.scales is None else w * self.scales[:, None]

    def _int4_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """int4 weights' codes ``(N, 32 G)`` (0..15, 8 past ``K``) and scales ``(N, G)``, unpacked from the panels."""
        codes = self.codes.transpose(1, 2).reshape(-1, self.codes.shape[1])[: self.n]
        return codes, self.scales.transpose(1, 2).reshape(-1, self.scales.shape[1])[: self.n]

    def _rows(self) -> torch.Tensor:
        """A float or int8 weight's stored values (int8: its codes) ``(N, K)``, unpacked from the panels (the integer
        layout's: ``(N, 32 G)``, zero past ``K``)."""
        if self.kind == _Q8_KINDS[torch.int8]:
            p, kp, _ = self.packed.shape
            return self.packed.view(p, kp // 4, PANEL, 4).permute(0, 2, 1, 3).reshape(p * PANEL, kp)[: self.n]
        return self.packed.transpose(1, 2).reshape(-1, self.k)[: self.n]

    def __call__(self, x: torch.Tensor, threads: int | None = None) -> torch.Tensor:
        """``x @ W.T`` on ``threads`` threads of the kernel's own pool (default: ``torch.get_num_threads()``)."""
        x = x.float().contiguous()
        y = torch.empty(x.shape[0], self.n)
        core().linear_rows(x.numpy(), self._array, self.kind, y.numpy(), threads or torch.get_num_threads(),
                          self._scales)
        return y

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` in PyTorch from the same stored weights, in the same arithmetic (the kernel's test oracle):
        float32 products, or with ``activations="int8"`` :func:`q8_products`."""
        if self.activations == "float32":
            return x.float() @ self.weight().T
        if self.dtype == INT4:
            codes, scales = self._int4_rows()
            return q8_products(x, codes.to(torch.int16) - 8, block_scales=scales)
        return q8_products(x, self._rows(), row_scales=self.scales)


class Q8Linear(torch.nn.Module):
    """A projection ``x @ W.T`` computed as :meth:`PackedLinear.reference` with int8 activations: what a model's
    ``Linear`` is swapped for in the reference twin of an engine with ``activations="int8"``.

    ``weight`` is the stored (rounded) weight as a parameter (shared, e.g. a tied head's with the embedding), so the
    model's state dict is unchanged; ``packed`` holds the codes and scales the arithmetic multiplies.
    """

    def __init__(self, weight: torch.nn.Parameter, packed: PackedLinear) -> None:
        super().__init__()
        self.weight = weight
        self.packed = packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.packed.reference(x.reshape(-1, x.shape[-1]))  # (rows, N)
        return y.reshape(*x.shape[:-1], self.packed.n).to(x.dtype)
