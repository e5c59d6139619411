"""Weights packed for the C++ decode kernel: one matrix ``(N, K)`` stored in panels of 8 output rows.

``packed[p, k, j] = W[8p + j, k]``, so one product streams the weights once, sequentially, whatever the number
of rows. The weights may be stored in float32 (exact), bfloat16 / float16 (half the bytes), as int8 codes with
one float32 scale per output row (a quarter; ``w ~ code * max|row| / 127``) or as int4 codes with a scale per
group of 32 weights along a row (an eighth, plus the scales), rounded exactly as llama.cpp's Q4_0 rounds them
(:func:`quantize_q4_0`); activations and sums stay float32. int4 is named by ``torch.quint4x2`` (4-bit codes, two
per byte) or ``"int4"``.
At batch 1 a decode step is bound by reading the weights, so smaller weights make it faster; the outputs then
follow a model whose matrices were rounded that way (:meth:`PackedLinear.weight`), not the float32 model.
:meth:`PackedLinear.reference` is the pure-PyTorch twin the tests hold the kernel to.
"""

from __future__ import annotations

import numpy as np
import torch

from lmforge._native import available, core

__all__ = ["PackedLinear", "WEIGHT_DTYPES", "INT4", "GROUP", "weight_dtype_of", "kernel_available", "quantize_q4_0"]

PANEL = 8  # output rows per panel of a packed weight (one AVX2 vector of float32 outputs)
GROUP = 32  # int4: weights per scale along a row (llama.cpp's Q4_0 block)
INT4 = torch.quint4x2
"""The dtype that names int4 storage (4-bit codes, two per byte, a scale per :data:`GROUP` weights)."""
# Weight storage the decode kernel reads, with the kernel's code for each.
_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.int8: 3, INT4: 4}
WEIGHT_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                 "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16, "int8": torch.int8,
                 "int4": INT4}


def kernel_available() -> bool:
    """Whether the C++ decode kernels (``lmforge._core.linear_rows`` and friends) are built."""
    return available("linear_rows")


def weight_dtype_of(value: torch.dtype | str | None) -> torch.dtype | None:
    """``None``, a ``torch.dtype`` or a name (``"bf16"``, ``"float16"``, ...) as a dtype the kernel reads."""
    if value is None or isinstance(value, torch.dtype):
        dtype = value
    else:
        dtype = WEIGHT_DTYPES.get(str(value).lower())
        if dtype is None:
            raise ValueError(f"unknown weight dtype {value!r}; use one of float32, bfloat16, float16, int8, int4")
    if dtype is not None and dtype not in _KINDS:
        raise ValueError(f"weights can be stored as float32, bfloat16, float16, int8 or int4 for decoding, not {dtype}")
    return dtype


def quantize_q4_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scales)`` of ``w (N, K)`` float32 in llama.cpp's Q4_0 rounding, per block of 32 along a row.

    A row is zero-padded to a multiple of 32. Per block: ``d = m / -8`` with ``m`` the value of largest magnitude,
    ``codes = min(15, trunc(w / d + 8.5))`` (``w * (1/d)`` as ggml computes it), the scale stored as float16;
    the weight is then ``float16(d) * (code - 8)``. Returns codes ``(N, 32 G)`` uint8 and scales ``(N, G)`` float32
    (the float16 values). ``tests/generate/test_decoder.py`` holds it to the ``gguf`` package's Q4_0.
    """
    n, k = w.shape
    groups = -(-k // GROUP)
    blocks = torch.zeros(n, groups * GROUP, dtype=torch.float32)
    blocks[:, :k] = w
    blocks = blocks.view(n, groups, GROUP)
    peak = blocks.gather(2, blocks.abs().argmax(2, keepdim=True))  # (N, G, 1): signed, first of equals
    d = peak / -8
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    codes = torch.trunc(blocks * inv + 8.5).clamp_(0, 15).to(torch.uint8)
    return codes.view(n, groups * GROUP), d[..., 0].to(torch.float16).float()


class PackedLinear:
    """A weight ``W (N, K)`` packed for the decode kernel; ``lin(x)`` is ``x @ W.T`` for ``x (M, K)`` float32.

    ``dtype`` is the storage precision (float32, bfloat16, float16, int8 with a scale per output row:
    ``scale[n] = max|W[n]| / 127``, codes ``round(W / scale)``, or :data:`INT4`: :func:`quantize_q4_0`); products
    accumulate in float32. The packed copy is independent of ``W`` (later changes to ``W`` are not seen).
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
        if dtype in (torch.int8, INT4) and not bool(w.isfinite().all()):
            raise ValueError(f"{'int8' if dtype == torch.int8 else 'int4'} weights need finite values; store them as "
                             "float32 instead")
        self.scales: torch.Tensor | None = None
        panels = -(-self.n // PANEL)
        if dtype == INT4:
            codes, scales = quantize_q4_0(w)  # (N, 32 G), (N, G)
            groups = scales.shape[1]
            pad = torch.full((panels * PANEL, groups * GROUP), 8, dtype=torch.uint8)  # code 8: weight 0
            pad[: self.n] = codes
            self.codes = pad.view(panels, PANEL, groups * GROUP).transpose(1, 2)  # (P, 32 G, 8)
            self.packed = (self.codes[:, 0::2] | (self.codes[:, 1::2] << 4)).contiguous()  # (P, 16 G, 8)
            sc = torch.zeros(panels * PANEL, groups)
            sc[: self.n] = scales
            self.scales = sc.view(panels, PANEL, groups).transpose(1, 2).contiguous()  # (P, G, 8)
            self._array, self._scales = self.packed.numpy(), self.scales.view(-1).numpy()
            return
        if dtype == torch.int8:
            peak = w.abs().amax(1)
            self.scales = torch.where(peak > 0, peak / 127, torch.ones_like(peak))  # (N,)
            w = torch.round(w / self.scales[:, None]).clamp_(-127, 127)
        padded = torch.zeros(panels * PANEL, self.k, dtype=dtype)
        padded[: self.n] = w.to(dtype)
        self.packed = padded.view(panels, PANEL, self.k).transpose(1, 2).contiguous()  # (P, K, 8)
        # what the kernel reads: float32 or int8, or the 16-bit patterns as uint16 (numpy has no bfloat16)
        self._array = (self.packed.view(torch.int16).numpy().view(np.uint16) if dtype in (torch.bfloat16, torch.float16)
                       else self.packed.numpy())
        self._scales = None if self.scales is None else self.scales.numpy()

    def spec(self) -> tuple[np.ndarray, int, np.ndarray | None]:
        """``(packed array, kind, scales or None)``: the matrix as ``_core.DecodeModel`` takes it (arrays shared)."""
        return self._array, self.kind, self._scales

    def weight(self) -> torch.Tensor:
        """The stored weight as ``(N, K)`` float32 (rounded to ``dtype``; int8 codes times their row scale; int4
        ``scale * (code - 8)`` per group, exact in float32)."""
        if self.dtype == INT4:
            codes = self.codes.transpose(1, 2).reshape(-1, self.codes.shape[1])[: self.n, : self.k]  # (N, K)
            scales = self.scales.transpose(1, 2).reshape(-1, self.scales.shape[1])[: self.n]  # (N, G)
            return (codes.float() - 8) * scales.repeat_interleave(GROUP, 1)[:, : self.k]
        w = self.packed.transpose(1, 2).reshape(-1, self.k)[: self.n].float()
        return w if self.scales is None else w * self.scales[:, None]

    def __call__(self, x: torch.Tensor, threads: int | None = None) -> torch.Tensor:
        """``x @ W.T`` on ``threads`` threads of the kernel's own pool (default: ``torch.get_num_threads()``)."""
        x = x.float().contiguous()
        y = torch.empty(x.shape[0], self.n)
        core().linear_rows(x.numpy(), self._array, self.kind, y.numpy(), threads or torch.get_num_threads(),
                          self._scales)
        return y

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` in PyTorch from the same stored weights (the kernel's test oracle)."""
        return x.float() @ self.weight().T
