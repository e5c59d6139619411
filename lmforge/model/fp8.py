"""Float8 training matmuls (``training.fp8``): the Transformer's projections in float8, swapped in from outside.

:func:`convert_to_float8` replaces every projection :class:`~lmforge.model.layers.Linear` inside the blocks
(attention q/k/v/out, the feed-forward's matrices) by a :class:`Float8Linear` holding the *same* weight
Parameter, so state dicts, checkpoints, optimizers and exact resume are unchanged. While autograd records, a
:class:`Float8Linear` computes ``x Wᵀ`` as torchao and torchtitan's "tensorwise" recipe does::

    forward   y  = scaled_mm(e4m3(x), e4m3(W))        each tensor scaled by its own amax / 448
    backward  dx = scaled_mm(e5m2(dy), e4m3(W))       the gradient in e5m2 (range over precision), / 57344
              dW = scaled_mm(e5m2(dy)ᵀ, e4m3(x))

with ``torch._scaled_mm`` (float8 tensor cores on GPUs of compute capability 8.9 and up; PyTorch's own kernel on
the CPU, which the tests use) and float32 accumulation. Master weights and optimizer state keep the run's dtype;
the embedding, the head and the norms are untouched. Without autograd (evaluation, decoding) it is the plain
product, so the model decodes exactly as a converted-back one. :func:`scaled_mm_reference` is the arithmetic's
spec: dequantize both operands (``float(q) · scale``) and multiply in float32.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lmforge.model.layers import Linear

__all__ = ["E4M3", "E5M2", "Float8Linear", "check_fp8_device", "convert_to_float8", "float8_modules",
           "scaled_mm", "scaled_mm_reference", "to_float8"]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
_MAX = {E4M3: 448.0, E5M2: 57344.0}  # the largest finite value of each format
_ALIGN = 16  # torch._scaled_mm needs every dimension a multiple of 16 on CUDA


def check_fp8_device(device: torch.device) -> None:
    """``ValueError`` in one line unless ``device`` multiplies float8 natively (CUDA 8.9+) or is the CPU (slow,
    exact: PyTorch's reference kernel)."""
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 9):
            raise ValueError(f"training.fp8 needs float8 matmuls: a GPU of compute capability 8.9 or newer (Ada, "
                             f"Hopper, Blackwell); {torch.cuda.get_device_name(device)} is {cap[0]}.{cap[1]}: "
                             f"train in bf16 (training.dtype: bf16) instead")
    elif device.type != "cpu":
        raise ValueError(f"training.fp8 runs on CUDA GPUs of compute capability 8.9+ (or, slowly, the CPU), "
                         f"not on {device.type}")


def to_float8(t: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``t`` rounded to float8 ``dtype`` with one float32 scale for the tensor: ``(q, scale)`` where
    ``float(q) · scale ≈ t`` and the largest magnitude lands on the format's largest finite value."""
    amax = t.detach().abs().amax().float().clamp(min=1e-12)
    scale = amax / _MAX[dtype]
    q = (t.float() / scale).clamp(-_MAX[dtype], _MAX[dtype]).to(dtype)
    return q, scale


def scaled_mm(a: Tensor, sa: Tensor, b: Tensor, sb: Tensor, out_dtype: torch.dtype) -> Tensor:
    """``(a · sa) @ (b · sb)`` for float8 ``a (M, K)`` and ``b (K, N)`` through ``torch._scaled_mm`` (it wants
    ``a`` row-major and ``b`` column-major: made so here), accumulated in float32, returned as ``out_dtype``."""
    a = a if a.stride(-1) == 1 else a.contiguous()
    b = b if b.stride(0) == 1 else b.t().contiguous().t()
    return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=out_dtype)


def scaled_mm_reference(a: Tensor, sa: Tensor, b: Tensor, sb: Tensor, out_dtype: torch.dtype) -> Tensor:
    """The spec of :func:`scaled_mm`: both operands dequantized to float32, multiplied, rounded to ``out_dtype``."""
    return ((a.float() * sa) @ (b.float() * sb)).to(out_dtype)


def _pad_rows(t: Tensor) -> Tensor:
    n = t.shape[0]
    return t if n % _ALIGN == 0 else torch.cat([t, t.new_zeros(_ALIGN - n % _ALIGN, t.shape[1])])


class _Float8Matmul(torch.autograd.Function):
    """``x @ w.T`` with float8 operands in both passes (see the module docstring); ``x (N, in)``, ``w (out, in)``.
    Saves the float8 copies of ``x`` and ``w`` for backward (a quarter of float32's memory)."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, out_dtype: torch.dtype) -> Tensor:
        n = x.shape[0]
        x8, sx = to_float8(_pad_rows(x), E4M3)
        w8, sw = to_float8(w, E4M3)
        y = scaled_mm(x8, sx, w8.t(), sw, out_dtype)[:n]  # (N, out)
        ctx.save_for_backward(x8, sx, w8, sw)
        ctx.n, ctx.x_dtype, ctx.w_dtype = n, x.dtype, w.dtype
        return y

    @staticmethod
    def backward(ctx, g: Tensor):
        x8, sx, w8, sw = ctx.saved_tensors
        g8, sg = to_float8(_pad_rows(g.reshape(-1, g.shape[-1])), E5M2)  # (N', out)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = scaled_mm(g8, sg, w8, sw, torch.float32)[: ctx.n].to(ctx.x_dtype)  # (N, in)
        if ctx.needs_input_grad[1]:
            grad_w = scaled_mm(g8.t(), sg, x8, sx, torch.float32).to(ctx.w_dtype)  # (out, in); pad rows add 0
        return grad_x, grad_w, None


class Float8Linear(Linear):
    """A :class:`Linear` whose products run in float8 while autograd records (training), plainly otherwise.
    It holds the weight Parameter of the ``Linear`` it replaced (same name in the state dict)."""

    projects_itself = True  # the fast path's fused projections call this module instead of reading its weight

    @classmethod
    def from_linear(cls, linear: Linear) -> "Float8Linear":
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        m.in_features, m.out_features = linear.in_features, linear.out_features
        m.weight = linear.weight  # the same Parameter: optimizer state and checkpoints see no change
        return m

    def forward(self, x: Tensor) -> Tensor:
        if not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)):
            return x @ self.weight.T
        dev = x.device.type
        out_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        with torch.autocast(dev, enabled=False):
            y = _Float8Matmul.apply(x.reshape(-1, x.shape[-1]), self.weight, out_dtype)
        return y.reshape(*x.shape[:-1], self.out_features)


def float8_modules(model: nn.Module) -> dict[str, Float8Linear]:
    """The model's :class:`Float8Linear` modules by name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, Float8Linear)}


def convert_to_float8(model: nn.Module) -> list[str]:
    """Swap every plain :class:`Linear` inside ``model.layers`` whose sides are multiples of 16 for a
    :class:`Float8Linear` on the same weight; the names swapped. ``ValueError`` if the model has no blocks or
    none fits (the sides float8 matmuls need)."""
    layers = getattr(model, "layers", None)
    if layers is None:
        raise ValueError("training.fp8 converts a TransformerLM's blocks (model.layers); this model has none")
    names = []
    for name, m in list(layers.named_modules()):
        if type(m) is Linear and m.in_features % _ALIGN == 0 and m.out_features % _ALIGN == 0:
            parent, _, leaf = name.rpartition(".")
            setattr(layers.get_submodule(parent) if parent else layers, leaf, Float8Linear.from_linear(m))
            names.append(f"layers.{name}")
    if not names:
        raise ValueError(f"training.fp8: no projection has both sides a multiple of {_ALIGN} (float8 matmuls "
                         f"need it): widen d_model / d_ff or leave fp8 off")
    return names
