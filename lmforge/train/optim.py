"""Optimizers and schedules written out: ``SGD``, ``AdamW``, the cosine learning-rate schedule, gradient
clipping and the weight-decay parameter groups.

``AdamW`` gives the same numbers as ``torch.optim.AdamW`` (to float rounding) and updates every tensor
of a parameter group with a handful of ``torch._foreach_*`` calls instead of a Python loop over tensors.
Optimizer state holds only tensors and plain numbers, so ``state_dict()`` can be stored with safetensors
+ JSON and ``load_state_dict()`` restores it exactly.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Iterable

import torch
from torch import Tensor, nn

__all__ = ["SGD", "AdamW", "cosine_lr", "clip_grad_norm", "param_groups_for", "global_grad_norm"]


def _buckets(tensors_by_param: list[tuple[Tensor, ...]], key) -> dict[Any, list[tuple[Tensor, ...]]]:
    """Group rows of tensors so that each ``_foreach`` call sees one device and dtype (and ``key``)."""
    out: dict[Any, list[tuple[Tensor, ...]]] = defaultdict(list)
    for row in tensors_by_param:
        out[(row[0].device, row[0].dtype, key(row))].append(row)
    return out


def _evaluate(closure) -> Any:
    """Run the optional ``closure`` (re-computes the loss) with gradients on; ``None`` without one."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class SGD(torch.optim.Optimizer):
    """Stochastic gradient descent, ``torch.optim.SGD`` semantics: ``g += wd·p``; with momentum
    ``b = μ·b + g`` (``b = g`` on the first step); ``p -= lr·b``."""

    def __init__(self, params: Iterable, lr: float = 1e-3, momentum: float = 0.0, weight_decay: float = 0.0) -> None:
        if lr < 0:
            raise ValueError(f"SGD lr must be >= 0, got {lr}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"SGD momentum must be in [0, 1), got {momentum}")
        if weight_decay < 0:
            raise ValueError(f"SGD weight_decay must be >= 0, got {weight_decay}")
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = _evaluate(closure)
        for group in self.param_groups:
            lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad if wd == 0 else p.grad.add(p, alpha=wd)
                if mu:
                    state = self.state[p]
                    if "momentum_buffer" not in state:
                        state["momentum_buffer"] = g.clone()
                    else:
                        state["momentum_buffer"].mul_(mu).add_(g)
                    g = state["momentum_buffer"]
                p.add_(g, alpha=-lr)
        return loss


class AdamW(torch.optim.Optimizer):
    """Adam with decoupled weight decay (Loshchilov & Hutter), as ``torch.optim.AdamW``.

    ``impl="foreach"`` runs the update below as a few ``torch._foreach_*`` calls per group; ``"auto"``
    (default) uses PyTorch's fused one-pass AdamW kernel on CPU/CUDA (same formula) and foreach elsewhere.

    Per parameter, at step ``t`` (from 1): ``p ← p·(1 − lr·wd)``; ``m ← β1·m + (1−β1)·g``;
    ``v ← β2·v + (1−β2)·g²``; ``p ← p − lr/(1−β1ᵗ) · m / (sqrt(v/(1−β2ᵗ)) + eps)``.
    State per parameter: ``step`` (int), ``exp_avg`` and ``exp_avg_sq`` (tensors like the parameter).
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01, impl: str = "auto") -> None:
        if lr < 0:
            raise ValueError(f"AdamW lr must be >= 0, got {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"AdamW betas must lie in [0, 1), got {betas}")
        if eps < 0 or weight_decay < 0:
            raise ValueError(f"AdamW eps and weight_decay must be >= 0, got eps={eps}, weight_decay={weight_decay}")
        if impl not in ("auto", "fused", "foreach"):
            raise ValueError(f"AdamW impl must be 'auto', 'fused' or 'foreach', got {impl!r}")
        self.impl = impl
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    def _use_fused(self, device: torch.device, dtype: torch.dtype) -> bool:
        """PyTorch's one-pass AdamW kernel where it exists (CPU/CUDA floats): 4x less memory traffic
        than the foreach sequence. ``impl="foreach"`` forces the readable path below."""
        ok = device.type in ("cpu", "cuda") and dtype in (torch.float32, torch.bfloat16, torch.float16)
        if self.impl == "fused" and not ok:
            raise ValueError(f"AdamW impl='fused' is not available for {dtype} on {device.type}; use impl='auto'")
        return ok and self.impl != "foreach" and hasattr(torch, "_fused_adamw_")

    @torch.no_grad()
    def step(self, closure=None):
        loss = _evaluate(closure)
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            rows = []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError("AdamW does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                rows.append((p, p.grad, state["exp_avg"], state["exp_avg_sq"], state["step"]))
            # Tensors at the same step share the bias corrections, so one foreach call updates them all.
            for (_, _, step), bucket in _buckets(rows, key=lambda r: r[4]).items():
                ps, gs, ms, vs = ([r[i] for r in bucket] for i in range(4))
                if self._use_fused(ps[0].device, ps[0].dtype):
                    steps = [torch.full((), float(step), dtype=torch.float32, device=ps[0].device)] * len(ps)
                    torch._fused_adamw_(ps, gs, ms, vs, [], steps, amsgrad=False, lr=lr, beta1=beta1, beta2=beta2,
                                        weight_decay=wd, eps=eps, maximize=False, grad_scale=None, found_inf=None)
                    continue
                bc1 = 1.0 - beta1**step
                bc2_sqrt = math.sqrt(1.0 - beta2**step)
                if wd != 0:
                    torch._foreach_mul_(ps, 1.0 - lr * wd)
                torch._foreach_lerp_(ms, gs, 1.0 - beta1)  # m = β1 m + (1-β1) g
                torch._foreach_mul_(vs, beta2)
                torch._foreach_addcmul_(vs, gs, gs, 1.0 - beta2)  # v = β2 v + (1-β2) g²
                # m / (sqrt(v)/c + eps) == c·m / (sqrt(v) + eps·c) with c = sqrt(1-β2ᵗ): one pass fewer.
                denom = torch._foreach_sqrt(vs)
                torch._foreach_add_(denom, eps * bc2_sqrt)
                torch._foreach_addcdiv_(ps, ms, denom, -lr * bc2_sqrt / bc1)
        return loss


# --------------------------------------------------------------------------------------------------
# Schedule, clipping, parameter groups
# --------------------------------------------------------------------------------------------------
def cosine_lr(t: int, max_lr: float, min_lr: float, warmup_iters: int, cosine_cycle_iters: int) -> float:
    """Learning rate at step ``t``: linear warm-up, cosine decay, then constant (CS336 handout).

    ``t < Tw``: ``t/Tw · max_lr``; ``Tw <= t <= Tc``: ``min + ½(1 + cos(π (t−Tw)/(Tc−Tw))) (max − min)``;
    ``t > Tc``: ``min_lr``.
    """
    if warmup_iters < 0 or cosine_cycle_iters < warmup_iters:
        raise ValueError(f"need 0 <= warmup_iters <= cosine_cycle_iters, got {warmup_iters} and {cosine_cycle_iters}")
    if t < warmup_iters:
        return t / warmup_iters * max_lr
    if t <= cosine_cycle_iters:
        if cosine_cycle_iters == warmup_iters:
            return max_lr
        frac = (t - warmup_iters) / (cosine_cycle_iters - warmup_iters)
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * frac)) * (max_lr - min_lr)
    return min_lr


def global_grad_norm(params: Iterable[Tensor]) -> Tensor:
    """L2 norm of all gradients together (float32 0-dim tensor; 0 if there are none)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norms = []
    for bucket in _buckets([(g,) for g in grads], key=lambda r: None).values():
        per = torch._foreach_norm([r[0] for r in bucket], 2.0)
        norms.append(torch.linalg.vector_norm(torch.stack(per).float(), 2.0).to(grads[0].device))
    return torch.linalg.vector_norm(torch.stack(norms), 2.0)


def clip_grad_norm(params: Iterable[Tensor], max_norm: float, eps: float = 1e-6) -> Tensor:
    """Scale all gradients by ``max_norm / (norm + eps)`` when their global L2 ``norm`` exceeds ``max_norm``.

    Returns the norm before clipping (a 0-dim tensor; ``float()`` it to log). A non-finite norm leaves the
    gradients untouched, so the caller can see it and skip the step.
    """
    if not max_norm > 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm}; to disable clipping do not call clip_grad_norm")
    params = [p for p in params if p.grad is not None]
    norm = global_grad_norm(params)
    if params and torch.isfinite(norm) and norm > max_norm:
        scale = float(max_norm / (norm + eps))
        for bucket in _buckets([(p.grad,) for p in params], key=lambda r: None).values():
            torch._foreach_mul_([r[0] for r in bucket], scale)
    return norm


def param_groups_for(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two optimizer groups from one rule: tensors with 2+ dims (projections, embeddings, LM head) get
    ``weight_decay``; 1-D tensors (RMSNorm gains, any biases) get none, since shrinking a gain towards 0
    only fights the normalisation.

    Each parameter (tied ones once) lands in exactly one group; the group dicts carry a ``name``.
    """
    decay, no_decay, seen = [], [], set()
    for _, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if p.dim() >= 2 else no_decay).append(p)
    grouped = [id(p) for p in decay] + [id(p) for p in no_decay]
    assert len(grouped) == len(set(grouped)) == len(seen), "a parameter landed in zero or two groups"
    return [{"params": decay, "weight_decay": weight_decay, "name": "decay"},
            {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}]
