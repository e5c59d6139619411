"""The model's fast-path primitives: projections with a lean backward, complex-multiply RoPE, RMSNorm with a
hand-written backward. Each computes what its reference in :mod:`lmforge.model.layers` computes
(``tests/model/test_model.py`` holds them equal, gradients too)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lmforge.model.layers import Device, DType, Linear, RMSNorm

__all__ = ["Norm", "cached_projections"]


class _Projections(torch.autograd.Function):
    """``x @ W_i.T`` for several weights reading the same ``x`` (Q, K, V; or W1, W3).

    Backward accumulates ``dx = Σ g_i W_i`` inside the GEMMs (``addmm_`` with beta 1), so neither the
    ``torch.cat`` of the output gradients that a fused-weight matmul needs nor autograd's sum of separate
    ``dx`` tensors is ever materialised. Under autocast the matmuls run in the autocast dtype, as
    ``x @ W.T`` would.
    """

    @staticmethod
    def forward(ctx, x: Tensor, *weights: Tensor) -> tuple[Tensor, ...]:
        dev = x.device.type
        cdtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        with torch.autocast(dev, enabled=False):
            xc = x.to(cdtype)
            outs = tuple(xc @ w.to(cdtype).T for w in weights)  # (..., out_i)
        ctx.save_for_backward(xc, *weights)
        ctx.x_dtype, ctx.cdtype = x.dtype, cdtype
        return outs

    @staticmethod
    def backward(ctx, *grads: Tensor):
        xc, *weights = ctx.saved_tensors
        x2 = xc.reshape(-1, xc.shape[-1])  # (N, d_in)
        grad_x = None
        grad_ws = []
        with torch.autocast(xc.device.type, enabled=False):
            for i, (g, w) in enumerate(zip(grads, weights)):
                if g is None:
                    grad_ws.append(None)
                    continue
                g2 = g.reshape(-1, g.shape[-1]).to(ctx.cdtype)  # (N, out_i)
                wc = w.to(ctx.cdtype)
                if grad_x is None:
                    grad_x = g2 @ wc  # (N, d_in)
                else:
                    grad_x.addmm_(g2, wc)
                # a frozen weight (LoRA's base) gets no gradient: skip the (out_i, d_in) GEMM
                grad_ws.append((g2.T @ x2).to(w.dtype) if ctx.needs_input_grad[1 + i] else None)
        if grad_x is not None:
            grad_x = grad_x.reshape(xc.shape).to(ctx.x_dtype)
        return (grad_x, *grad_ws)


def _project(module: nn.Module, x: Tensor, weights: list[Tensor]) -> tuple[Tensor, ...]:
    """``tuple(x @ w.T for w in weights)``, the fastest way for training or for decoding.

    Training: :class:`_Projections` (lean backward). Without autograd (decoding) one matmul over the
    concatenated weights, whose concatenation is cached on ``module`` until a weight changes (tracked
    through data pointers and in-place version counters) or autograd is needed again; a compiled decode step
    multiplies by each weight (the compiler schedules them).
    """
    if torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights)):
        if not torch.compiler.is_compiling():  # torch 2.11's dynamo breaks the graph on a __dict__.pop
            module.__dict__.pop("_fused_cache", None)
        return _Projections.apply(x, *weights)
    if torch.compiler.is_compiling():  # a traced decode step: no data pointers there; one product per weight
        return tuple(x @ w.T for w in weights)
    key = tuple((w.data_ptr(), w._version, w.dtype, w.device) for w in weights)
    hit = module.__dict__.get("_fused_cache")
    if hit is None or hit[0] != key:
        hit = (key, torch.cat(weights, dim=0))
        module.__dict__["_fused_cache"] = hit
    return (x @ hit[1].T).split([w.shape[0] for w in weights], dim=-1)


def cached_projections(model: nn.Module) -> list[Tensor]:
    """The concatenated weights :func:`_project` caches on ``model``'s modules for decoding. A CUDA graph that
    reads them holds these references, so a later concatenation cannot free the memory the graph replays on."""
    return [hit[1] for m in model.modules() if (hit := m.__dict__.get("_fused_cache")) is not None]


def _project_modules(owner: nn.Module, x: Tensor, modules: tuple[nn.Module, ...]) -> tuple[Tensor, ...]:
    """``tuple(m(x) for m in modules)`` through :func:`_project` on their weights; a projection that is not a
    plain :class:`Linear` (a LoRA-wrapped one, :mod:`lmforge.model.lora`) adds its ``adapter(x)``; modules that
    project themselves (float8 training, :mod:`lmforge.model.fp8`) are called."""
    if any(getattr(m, "projects_itself", False) for m in modules):
        return tuple(m(x) for m in modules)
    outs = _project(owner, x, [m.weight for m in modules])
    return tuple(o if type(m) is Linear else o + m.adapter(x) for o, m in zip(outs, modules))


def _rope_fast(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE on adjacent pairs as a complex multiply: ``(x0 + i·x1) · (cos + i·sin)``.

    ``x (B, T, H, D)``; ``cos, sin`` broadcastable to ``(B, T, 1, D/2)``.
    """
    if torch.compiler.is_compiling():  # inductor cannot generate code for complex ops; it fuses this form
        x0, x1 = x[..., 0::2].float(), x[..., 1::2].float()  # (B, T, H, D/2)
        return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2).to(x.dtype)
    xc = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))  # (B, T, H, D/2) complex
    return torch.view_as_real(xc * torch.complex(cos, sin)).flatten(-2).to(x.dtype)  # (B, T, H, D)


class _RMSNormFn(torch.autograd.Function):
    """RMSNorm with a hand-written backward: about half the passes over memory of autograd's."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        x32 = x.float()
        d = x.shape[-1]
        inv = torch.rsqrt(torch.linalg.vector_norm(x32, dim=-1, keepdim=True).square_().div_(d).add_(eps))  # (..., 1)
        xn = x32 * inv  # (..., d)
        ctx.save_for_backward(xn, inv, weight)
        ctx.x_dtype = x.dtype
        y = xn * weight
        # No ``.to`` that returns ``y`` itself: torch 2.11's dynamo then routes the gradient wrongly when compiled
        # (every gradient before a norm came out wrong on an H100 and on the CPU: tests/model/test_compile.py fails
        # there without this; the aliased-output bug class of pytorch/pytorch#180642, fixed for 2.12).
        return y if y.dtype == x.dtype else y.to(x.dtype)

    @staticmethod
    def backward(ctx, g: Tensor):
        xn, inv, weight = ctx.saved_tensors
        g = g.float()
        grad_w = (g * xn).flatten(0, -2).sum(0).to(weight.dtype)  # (d,)
        gxn = g * weight  # (..., d)
        # d/dx of x·inv: inv · (gxn - xn · mean(gxn · xn))
        dot = torch.linalg.vecdot(gxn, xn, dim=-1).unsqueeze(-1).div_(xn.shape[-1])  # (..., 1)
        grad_x = gxn.addcmul_(xn, dot, value=-1.0).mul_(inv)
        return grad_x.to(ctx.x_dtype), grad_w, None


class Norm(RMSNorm):
    """:class:`RMSNorm` with a fast path (:class:`_RMSNormFn`); same parameter, same numbers."""

    def __init__(self, d_model: int, eps: float = 1e-5, fast: bool = False, device: Device = None,
                 dtype: DType = None) -> None:
        super().__init__(d_model, eps, device=device, dtype=dtype)
        self.fast = fast

    def forward(self, x: Tensor) -> Tensor:
        return _RMSNormFn.apply(x, self.weight, self.eps) if self.fast else super().forward(x)
