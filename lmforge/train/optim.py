"""Optimizers and schedules written out: ``SGD``, ``AdamW``, ``Muon``, the cosine and WSD learning-rate schedules,
Muon's momentum warm-up, gradient clipping and the parameter groups (weight decay; Muon's matrices vs AdamW's rest).

``AdamW`` gives the same numbers as ``torch.optim.AdamW`` (to float rounding) and updates every tensor
of a parameter group with a handful of ``torch._foreach_*`` calls instead of a Python loop over tensors.
``Muon``'s reference step gives the same numbers as ``torch.optim.Muon`` bit for bit; its batched step
orthogonalises all same-shape matrices at once.
Optimizer state holds only tensors and plain numbers, so ``state_dict()`` can be stored with safetensors
+ JSON and ``load_state_dict()`` restores it exactly.
"""

from __future__ import annotations

import math
import sys
from collections import defaultdict
from typing import Any, Iterable, Sequence

import torch
from torch import Tensor, nn

from lmforge.hardware import native_bf16

__all__ = ["SGD", "AdamW", "Muon", "newton_schulz", "newton_schulz_batched", "muon_lr_ratio", "muon_param_groups", "adamw_param_groups", "param_roles", "describe_groups", "cosine_lr", "wsd_lr", "muon_momentum_at", "dmodel_lr_scale", "clip_grad_norm", "param_groups_for", "global_grad_norm"]


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
            self._adamw_group(group)
        return loss

    def _adamw_group(self, group: dict[str, Any]) -> None:
        """The AdamW update of one parameter group (also used by :class:`Muon` for its AdamW groups)."""
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


# --------------------------------------------------------------------------------------------------
# Muon: orthogonalised momentum for the hidden matrices, AdamW for the rest
# --------------------------------------------------------------------------------------------------
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic: steepest slope at 0, 5 steps suffice
_NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def newton_schulz(g: Tensor, coefficients: tuple[float, float, float] = NS_COEFFICIENTS, steps: int = 5,
                  eps: float = 1e-7, dtype: str = "bf16") -> Tensor:
    """Approximately orthogonalise ``g`` (rows, cols): ``≈ U·S'·Vᵀ`` for ``g = U·S·Vᵀ``, ``S'ᵢᵢ`` in ~[0.5, 1.5].

    The reference (one matrix): in ``dtype``, transpose a tall matrix so ``X`` is wide (rows <= cols),
    ``X ← X / max(‖X‖_F, eps)`` (spectral norm <= 1), then ``steps`` times, with ``A = X·Xᵀ`` (rows, rows):
    ``X ← a·X + (b·A + c·A·A)·X``; transpose back. Same ops in the same order as ``torch.optim.Muon``.
    Returns a tensor of ``dtype`` and ``g``'s shape.
    """
    a, b, c = coefficients
    x = g.to(_NS_DTYPES[dtype])
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T  # (r, r)
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b·A + c·A·A
        x = torch.addmm(x, poly, x, beta=a)  # a·X + poly·X
    return x.T if tall else x


def newton_schulz_batched(g: Tensor, coefficients: tuple[float, float, float] = NS_COEFFICIENTS, steps: int = 5,
                          eps: float = 1e-7, dtype: str = "bf16") -> Tensor:
    """:func:`newton_schulz` of a stack of same-shape matrices ``g`` (N, rows, cols) with batched matmuls."""
    a, b, c = coefficients
    x = g.to(_NS_DTYPES[dtype])
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT  # (N, cols, rows): wide
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT  # (N, r, r)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a)
    return x.mT if tall else x


def muon_lr_ratio(shape: Sequence[int], adjust_lr: str) -> float:
    """Muon's per-matrix LR multiplier: ``original`` (Keller Jordan) ``sqrt(max(1, rows/cols))``;
    ``match_rms_adamw`` (Moonshot) ``0.2·sqrt(max(rows, cols))``, which lets Muon reuse AdamW's lr and decay."""
    rows, cols = shape[0], shape[1]
    if adjust_lr == "original":
        return math.sqrt(max(1.0, rows / cols))
    if adjust_lr == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"Muon adjust_lr must be 'original' or 'match_rms_adamw', got {adjust_lr!r}")


def _is_dtensor(t: Tensor) -> bool:
    """Whether ``t`` is an FSDP2 shard. No DTensor exists before ``torch.distributed.tensor`` is imported (by FSDP),
    so it is not imported here: importing it costs every process about a second of CPU."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


def _full(t: Tensor) -> Tensor:
    """The whole matrix of ``t``: all-gathered if it is an FSDP2 shard (a DTensor), else ``t`` itself."""
    return t.full_tensor() if _is_dtensor(t) else t


def _like(full: Tensor, ref: Tensor) -> Tensor:
    """``full`` laid out like ``ref``: this rank's shard of it when ``ref`` is a DTensor. Every rank holds the
    same ``full`` (same gathered input, same deterministic iteration), so each keeps its slice, no communication."""
    if _is_dtensor(ref):
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(full, ref.device_mesh, ref.placements, src_data_rank=None)
    return full


class Muon(AdamW):
    """Muon (Keller Jordan; ``torch.optim.Muon`` semantics) for groups with ``use_muon=True``, AdamW for the others.

    Muon groups hold 2-D matrices only. Per matrix ``p`` (rows, cols), gradient ``g``, momentum buffer ``m``:
    ``m ← μ·m + (1−μ)·g``; ``u = (1−μ)·g + μ·m`` (Nesterov; ``u = m`` without); ``o = newton_schulz(u)``;
    ``p ← p·(1 − lr·wd)``; ``p ← p − lr·muon_lr_ratio(p.shape)·o``. State: ``momentum_buffer`` (like ``p``).

    The Newton–Schulz iteration runs in bf16 by default (``ns_dtype``), as in Keller Jordan's Muon, nanochat and
    ``torch.optim.Muon``: it only has to bring singular values to ~[0.5, 1.5], bf16 does that, and halves the
    matmul cost on GPUs; ``fp32`` gives closer agreement between the reference and the batched path.

    ``impl="batched"`` (default) stacks same-shape matrices into one (N, rows, cols) tensor per shape and runs
    the iteration with batched matmuls, momentum and weight decay with ``torch._foreach_*``; ``"reference"``
    is a per-matrix Python loop written as the formula above. Both give the same updates (to bf16 rounding).

    Data parallel: with DDP the gradients are all-reduced before ``step``, so every rank computes the same update.
    With FSDP2 the parameters, gradients and momentum are DTensor shards; the orthogonalisation needs the whole
    matrix, so each rank all-gathers every Muon update (``full_tensor()``), orthogonalises it (the same result on
    every rank) and keeps its own shard of the result; momentum and weight decay stay sharded. This costs one
    all-gather of the Muon matrices per step and world-size-fold redundant Newton–Schulz work (not spread
    over ranks as nanochat's distributed Muon does).
    """

    def __init__(self, params: Iterable, lr: float = 0.02, momentum: float = 0.95, nesterov: bool = True,
                 ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS, ns_steps: int = 5, ns_eps: float = 1e-7,
                 ns_dtype: str = "bf16", adjust_lr: str = "original", weight_decay: float = 0.0,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, impl: str = "batched",
                 adamw_impl: str = "auto") -> None:
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"Muon momentum must be in [0, 1), got {momentum}")
        if len(ns_coefficients) != 3 or not 1 <= ns_steps < 100:
            raise ValueError(f"Muon needs 3 ns_coefficients and 1 <= ns_steps < 100, got {ns_coefficients}, {ns_steps}")
        params = list(params)
        if ns_dtype == "auto":  # bf16 where it is native; an AVX2-only CPU multiplies bf16 ~100x slower than fp32
            first = next((p for g in params for p in (g["params"] if isinstance(g, dict) else [g])), None)
            ns_dtype = "bf16" if first is None or native_bf16(first.device) else "fp32"
        if ns_dtype not in _NS_DTYPES:
            raise ValueError(f"Muon ns_dtype must be 'bf16', 'fp32' or 'auto', got {ns_dtype!r}")
        muon_lr_ratio((1, 1), adjust_lr)  # validates adjust_lr
        if impl not in ("batched", "reference"):
            raise ValueError(f"Muon impl must be 'batched' or 'reference', got {impl!r}")
        self.muon_impl = impl
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, impl=adamw_impl)
        muon_defaults = dict(use_muon=False, momentum=momentum, nesterov=nesterov,
                             ns_coefficients=tuple(ns_coefficients), ns_steps=ns_steps, ns_eps=ns_eps,
                             ns_dtype=ns_dtype, adjust_lr=adjust_lr)
        self.defaults.update(muon_defaults)
        for group in self.param_groups:
            for k, v in muon_defaults.items():
                group.setdefault(k, v)
            bad = [tuple(p.shape) for p in group["params"] if group["use_muon"] and p.dim() != 2]
            if bad:
                raise ValueError(f"Muon orthogonalises 2-D matrices only, but a use_muon group holds shapes {bad}; "
                                 "put them in a group with use_muon=False (AdamW), as muon_param_groups does")

    @torch.no_grad()
    def step(self, closure=None):
        loss = _evaluate(closure)
        for group in self.param_groups:
            if not group["use_muon"]:
                self._adamw_group(group)
            elif self.muon_impl == "reference":
                self._muon_group_reference(group)
            else:
                self._muon_group_batched(group)
        return loss

    def _momentum(self, p: Tensor) -> Tensor:
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state["momentum_buffer"]

    def _muon_group_reference(self, group: dict[str, Any]) -> None:
        """The spec: one matrix at a time, exactly the formula in the class docstring."""
        lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
        for p in group["params"]:
            if p.grad is None:
                continue
            g, m = p.grad, self._momentum(p)
            m.lerp_(g, 1.0 - mu)  # m = μ m + (1-μ) g
            u = g.lerp(m, mu) if group["nesterov"] else m  # (1-μ) g + μ m
            o = _like(newton_schulz(_full(u), group["ns_coefficients"], group["ns_steps"], group["ns_eps"],
                                    group["ns_dtype"]), p)
            p.mul_(1.0 - lr * wd)
            p.add_(o, alpha=-lr * muon_lr_ratio(p.shape, group["adjust_lr"]))

    def _muon_group_batched(self, group: dict[str, Any]) -> None:
        """The same update: foreach momentum and decay, one batched Newton–Schulz per matrix shape."""
        lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
        ps = [p for p in group["params"] if p.grad is not None]
        if not ps:
            return
        gs, ms = [p.grad for p in ps], [self._momentum(p) for p in ps]
        for bucket in _buckets(list(zip(ps, gs, ms)), key=lambda r: tuple(r[0].shape)).values():
            bp, bg, bm = ([r[i] for r in bucket] for i in range(3))
            torch._foreach_lerp_(bm, bg, 1.0 - mu)
            us = torch._foreach_lerp(bg, bm, mu) if group["nesterov"] else bm
            full = torch.stack([_full(u) for u in us])  # (N, rows, cols)
            os_ = newton_schulz_batched(full, group["ns_coefficients"], group["ns_steps"], group["ns_eps"],
                                        group["ns_dtype"]).unbind(0)
            if wd != 0:
                torch._foreach_mul_(bp, 1.0 - lr * wd)
            alpha = -lr * muon_lr_ratio(bp[0].shape, group["adjust_lr"])
            torch._foreach_add_(bp, [_like(o, p) for o, p in zip(os_, bp)], alpha=alpha)


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


def wsd_lr(t: int, max_lr: float, min_lr: float, warmup_iters: int, total_iters: int, cooldown_iters: int) -> float:
    """Learning rate at step ``t`` of a warmup-stable-decay schedule (Hägele et al. 2024; modded-nanogpt).

    ``t < Tw``: ``t/Tw · max_lr``; then ``max_lr`` until the cooldown starts at ``Td = total − cooldown``;
    ``Td <= t <= total``: linear from ``max_lr`` to ``min_lr``; after ``total``: ``min_lr``. A cooldown longer
    than the steps after warmup is cut to them.
    """
    if warmup_iters < 0 or cooldown_iters < 0 or total_iters < warmup_iters:
        raise ValueError(f"need 0 <= warmup_iters <= total_iters and cooldown_iters >= 0, got {warmup_iters}, "
                         f"{total_iters} and {cooldown_iters}")
    if t < warmup_iters:
        return t / warmup_iters * max_lr
    start = max(warmup_iters, total_iters - cooldown_iters)
    if t <= start:
        return max_lr
    if t <= total_iters:
        return max_lr + (t - start) / (total_iters - start) * (min_lr - max_lr)
    return min_lr


def muon_momentum_at(step: int, momentum: float, start: float, warmup_steps: int) -> float:
    """Muon's momentum at the 0-based optimizer step ``step``: linear from ``start`` at step 0 to ``momentum`` at step
    ``warmup_steps`` and after; ``momentum`` at every step when ``warmup_steps`` is 0. A function of the step alone,
    so a resumed run sets the same momentum as an uninterrupted one."""
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if warmup_steps == 0:
        return momentum
    return start + min(step / warmup_steps, 1.0) * (momentum - start)


def dmodel_lr_scale(d_model: int) -> float:
    """``(d_model / 768) ** -0.5``: nanochat's factor on its AdamW rates (embeddings, head), tuned at width 768, so
    that a narrower model takes larger steps (1.73 at d_model 256) and a wider one smaller."""
    return (d_model / 768) ** -0.5


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

    On a CPU the decision reads the norm on the host (free there) and skips the pass when nothing is clipped; on
    a GPU that read would be a host sync per step (three), so there the factor stays on the device: 1 when not
    clipping (``x * 1.0 == x``): the same float32 gradients either way (a 16-bit gradient is scaled by the factor
    rounded to its dtype).
    """
    if not max_norm > 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm}; to disable clipping do not call clip_grad_norm")
    params = [p for p in params if p.grad is not None]
    norm = global_grad_norm(params)
    if not params:
        return norm
    buckets = _buckets([(p.grad,) for p in params], key=lambda r: None).values()
    if _host_reads_free(params[0].grad):
        if torch.isfinite(norm) and norm > max_norm:
            scale = float(max_norm / (norm + eps))
            for bucket in buckets:
                torch._foreach_mul_([r[0] for r in bucket], scale)
        return norm
    if _is_dtensor(norm):  # FSDP: the global norm as a plain tensor, as torchtitan does
        norm = norm.full_tensor()
    clip = torch.isfinite(norm) & (norm > max_norm)
    coef = torch.where(clip, max_norm / (norm + eps), torch.ones_like(norm))  # 0-dim, on the device
    for bucket in buckets:
        grads = [r[0] for r in bucket]
        torch._foreach_mul_(grads, coef.to(grads[0].device))
    return norm


def _host_reads_free(t: Tensor) -> bool:
    """Whether reading a value of ``t`` on the host costs nothing (a CPU tensor: no device to wait for)."""
    return t.device.type == "cpu"


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


def param_roles(model: nn.Module) -> dict[str, list[Tensor]]:
    """Every trainable tensor (tied ones once) by its role, from one rule, in ``named_parameters`` order:

    * ``embeddings``: the tables that map token ids to vectors: the weights of ``Embedding`` modules and any
      tensor whose name says ``embed`` (the token embedding, value embeddings);
    * ``hidden``: the other 2-D matrices inside the Transformer blocks (``model.layers``: attention q/k/v/output,
      FFN w1/w2/w3), which map hidden states to hidden states;
    * ``head``: the other tensors of 2+ dims whose first dimension is the vocabulary (the LM head);
    * ``scalars``: everything else: norm gains, biases, gates, skip and mixing weights (vectors, scalars and
      small matrices outside the blocks).
    """
    embed_ids = {id(m.weight) for m in model.modules()
                 if isinstance(m, nn.Embedding) or type(m).__name__ == "Embedding" and hasattr(m, "weight")}
    hidden = {id(p) for p in model.layers.parameters()} if hasattr(model, "layers") else set()
    vocab = getattr(getattr(model, "cfg", None), "vocab_size", None)
    roles: dict[str, list[Tensor]] = {"hidden": [], "embeddings": [], "head": [], "scalars": []}
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if id(p) in embed_ids or "embed" in name.lower():
            roles["embeddings"].append(p)
        elif id(p) in hidden and p.dim() == 2:
            roles["hidden"].append(p)
        elif id(p) not in hidden and p.dim() >= 2 and (vocab is None or p.shape[0] == vocab):
            roles["head"].append(p)
        else:
            roles["scalars"].append(p)
    grouped = [id(p) for ps in roles.values() for p in ps]
    assert len(grouped) == len(set(grouped)) == len(seen), "a parameter landed in zero or two groups"
    return roles


def muon_param_groups(model: nn.Module, lr: float, muon_lr: float, weight_decay: float,
                      muon_weight_decay: float = 0.0, embed_lr: float | None = None, head_lr: float | None = None,
                      scalar_lr: float | None = None, embed_head_scale: float = 1.0) -> list[dict[str, Any]]:
    """Groups for :class:`Muon` from :func:`param_roles` (nanochat's split): the blocks' hidden matrices go to Muon
    at ``muon_lr``; everything else to AdamW: the embeddings and LM head (matrices that map tokens, not hidden
    states) with ``weight_decay``, the scalars (norm gains, biases, gates, skip weights) without decay.

    With neither ``embed_lr`` nor ``head_lr`` given, embeddings and head share one group at ``lr`` (three groups:
    ``muon``, ``adamw_embeddings_head``, ``adamw_norms_biases``); with either, they get a group each at their own
    learning rate (``None`` = ``lr``): four groups. ``scalar_lr`` (``None`` = ``lr``) is the scalars' rate.
    ``embed_head_scale`` multiplies the embeddings' and the head's rates (e.g. :func:`dmodel_lr_scale`).

    Each group carries a ``name`` and ``lr_scale`` (its learning rate over ``lr``), which the training loop
    multiplies with the scheduled ``lr``. Every parameter (tied ones once) lands in exactly one group.
    """
    roles = param_roles(model)
    groups = [{"params": roles["hidden"], "use_muon": True, "lr": muon_lr, "weight_decay": muon_weight_decay,
               "name": "muon"}]
    if embed_lr is None and head_lr is None:
        groups.append({"params": roles["embeddings"] + roles["head"], "lr": lr * embed_head_scale,
                       "weight_decay": weight_decay, "name": "adamw_embeddings_head"})
    else:
        groups += [{"params": roles["embeddings"], "lr": (embed_lr or lr) * embed_head_scale,
                    "weight_decay": weight_decay, "name": "adamw_embeddings"},
                   {"params": roles["head"], "lr": (head_lr or lr) * embed_head_scale, "weight_decay": weight_decay,
                    "name": "adamw_head"}]
    groups.append({"params": roles["scalars"], "lr": scalar_lr or lr, "weight_decay": 0.0,
                   "name": "adamw_norms_biases"})
    for g in groups:
        g.setdefault("use_muon", False)
        g["lr_scale"] = g["lr"] / lr
    return groups


def adamw_param_groups(model: nn.Module, lr: float, weight_decay: float, embed_lr: float | None = None,
                       head_lr: float | None = None, scalar_lr: float | None = None,
                       embed_head_scale: float = 1.0) -> list[dict[str, Any]]:
    """Four AdamW groups from :func:`param_roles`, each at its own learning rate (``None`` = ``lr``): the blocks'
    hidden matrices (``hidden``, at ``lr``), ``embeddings`` (``embed_lr``), ``head`` (``head_lr``), all three with
    ``weight_decay``, and ``scalars`` (``scalar_lr``) without decay; the embeddings' and head's rates times
    ``embed_head_scale``. Each group carries ``name`` and ``lr_scale``."""
    roles = param_roles(model)
    rates = {"hidden": lr, "embeddings": (embed_lr or lr) * embed_head_scale,
             "head": (head_lr or lr) * embed_head_scale, "scalars": scalar_lr or lr}
    return [{"params": roles[r], "lr": rates[r], "lr_scale": rates[r] / lr, "name": r,
             "weight_decay": 0.0 if r == "scalars" else weight_decay} for r in roles]


def describe_groups(groups: list[dict[str, Any]]) -> str:
    """One line naming each group's tensor count and size, e.g. ``muon: 8 tensors (0.03M params); ...``."""
    return "; ".join(f"{g['name']}: {len(g['params'])} tensors ({sum(p.numel() for p in g['params']) / 1e6:.3g}M "
                     f"params, lr x{g.get('lr_scale', 1.0):.3g})" for g in groups)
