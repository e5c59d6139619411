"""Fast cross-entropy: the same numbers as :func:`lmforge.model.layers.cross_entropy` with less memory traffic.

* :func:`cross_entropy` on given logits keeps one float32 log-softmax for backward and allocates one
  ``(N, V)`` gradient (PyTorch's ``F.cross_entropy`` allocates two in backward: NLL's and log-softmax's).
* :func:`linear_cross_entropy` fuses the LM head: it computes ``h Wᵀ`` a chunk of rows at a time and turns
  each chunk into its gradient at once, so the ``(N, V)`` logits never exist. ``TransformerLM.forward``
  uses it when given ``targets``. With a 10k vocabulary and 2k tokens per step that saves ~250 MB and a
  few passes over memory per step.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from lmforge.model.layers import cross_entropy as cross_entropy_reference
from lmforge.model.recipe import softcap as softcap_logits

__all__ = ["cross_entropy", "linear_cross_entropy", "cross_entropy_reference", "softmax_grad", "compiled_softmax_grad"]


# --------------------------------------------------------------------------------------------------
class _CrossEntropySum(torch.autograd.Function):
    """Summed cross-entropy over rows ``(N, V)``; keeps one float32 log-softmax for backward."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, valid: Tensor | None) -> Tensor:
        logp = torch.log_softmax(logits.float(), dim=-1)  # (N, V), one fused pass
        nll = -logp.gather(1, targets[:, None]).squeeze(1)  # (N,)
        ctx.save_for_backward(logp, targets, valid)
        ctx.in_dtype = logits.dtype
        return (nll * valid).sum() if valid is not None else nll.sum()

    @staticmethod
    def backward(ctx, g: Tensor):
        logp, targets, valid = ctx.saved_tensors
        scale = g if valid is None else (g * valid)[:, None]  # () or (N, 1)
        grad = logp.exp().mul_(scale)  # softmax · g
        grad.scatter_add_(1, targets[:, None], (-scale).expand(targets.shape[0], 1))  # - onehot · g
        return grad.to(ctx.in_dtype), None, None


class _LinearCrossEntropySum(torch.autograd.Function):
    """``scale`` times the summed cross-entropy of ``h Wᵀ``, computed ``chunk`` rows at a time.

    The ``(N, V)`` logits never exist at once: each chunk's logits turn into its gradient (softmax minus
    one-hot) right away, and the gradients of ``h`` and ``W`` are accumulated during the forward pass
    (they do not depend on anything later: the loss is the end of the graph). ``scale`` (``1/N`` for a
    mean) rides in the GEMMs' ``alpha``, so backward has nothing left to do when the incoming gradient
    is 1 (``loss.backward()``) and scales the two saved gradients otherwise.

    Per chunk, in float32: logits GEMM into buffer A; softmax A -> B (one fused kernel); the loss of a
    row is ``-log p[target]`` (exact ``logsumexp - logit`` from A for rows whose ``p[target]`` is below
    1e-30, where ``log`` would lose digits); B becomes ``p - onehot`` in place and feeds both gradient GEMMs.
    That test of ``p[target]`` is a host sync per chunk and a data-dependent branch, free on a CPU but a
    stall on a GPU and a graph break for ``torch.compile``: off the CPU, and when compiled, each chunk takes
    the sync-free form instead (:func:`_chunk_sync_free`: log-softmax, exact for any ``p[target]``, then
    ``exp`` for the gradient; one more pass over the chunk, no branch).
    """

    @staticmethod
    def forward(ctx, h: Tensor, w: Tensor, targets: Tensor, valid: Tensor | None, chunk: int, cdtype,
                scale: float, chunk_fn: Any = None, softcap: float | None = None) -> Tensor:
        N = h.shape[0]
        f32 = cdtype == torch.float32
        if not _sync_ok(h):
            with torch.autocast(h.device.type, enabled=False):
                loss, grad_h, grad_w = _chunk_sync_free(h.to(cdtype), w.to(cdtype), targets, valid, chunk, scale,
                                                        ctx.needs_input_grad[1], chunk_fn, softcap)
            ctx.save_for_backward(grad_h, grad_w)
            ctx.dtypes = (h.dtype, w.dtype)
            ctx.used = False
            return loss
        with torch.autocast(h.device.type, enabled=False):
            hc, wc = h.to(cdtype), w.to(cdtype)  # no copy when already cdtype
            grad_h = torch.empty_like(hc)  # (N, d)
            # a frozen head (LoRA) gets no gradient: skip its (V, d) GEMM per chunk
            grad_w = torch.empty(w.shape, dtype=torch.float32, device=w.device) if ctx.needs_input_grad[1] else None
            # Chunk buffers reused by every chunk: a fresh tensor of a chunk's logits per chunk costs page faults
            # (a 32 MB float32 chunk is above glibc's mmap threshold: every allocation maps fresh pages), which
            # made the logits GEMM ~25% slower and bf16's float32 softmax ~5x slower on the CPU.
            logits_buf = torch.empty(min(chunk, N), w.shape[0], dtype=cdtype, device=h.device)
            p_buf = torch.empty(logits_buf.shape, dtype=torch.float32, device=h.device)  # the float32 softmax
            pc_buf = None if f32 else torch.empty_like(logits_buf)  # its gradient in the compute dtype
            losses = []
            for s in range(0, N, chunk):
                e = min(N, s + chunk)
                t = targets[s:e, None]  # (n, 1)
                logits = torch.mm(hc[s:e], wc.T, out=logits_buf[:e - s])  # (n, V)
                if softcap is not None:  # the capped logits cap·tanh(l/cap), float32; tanh kept for the chain rule
                    th = torch.tanh(logits.float() / softcap)
                    logits = th * softcap
                if f32:
                    p = torch.ops.aten._softmax.out(logits, -1, False, out=p_buf[:e - s])  # (n, V)
                else:  # a float32 copy of the logits, softmaxed in place (the same numbers as softmax(l.float()))
                    p = p_buf[:e - s].copy_(logits)
                    p = torch.ops.aten._softmax.out(p, -1, False, out=p)
                pt = p.gather(1, t).squeeze(1)  # (n,)
                nll = pt.log().neg_()
                tiny = pt < 1e-30
                if bool(tiny.any()):  # p[target] (nearly) underflowed: exact formula for those rows
                    rows = tiny.nonzero().squeeze(1)
                    lg = logits[rows].float()
                    nll[rows] = torch.logsumexp(lg, -1) - lg.gather(1, t[rows]).squeeze(1)
                p.scatter_add_(1, t, torch.full_like(t, -1.0, dtype=p.dtype))  # d(sum nll)/d logits = p - onehot
                if softcap is not None:  # through the cap: d/dl cap·tanh(l/cap) = 1 - tanh²
                    p.mul_(th.square_().neg_().add_(1.0))
                if valid is not None:
                    nll = nll * valid[s:e]
                    p.mul_(valid[s:e, None])
                losses.append(nll.sum())
                if f32:  # scale and accumulate inside the GEMMs: no extra pass, no (V, d) temporary
                    torch.addmm(grad_h[s:e], p, wc, beta=0.0, alpha=scale, out=grad_h[s:e])  # (n, d)
                    if grad_w is not None:
                        grad_w.addmm_(p.T, hc[s:e], beta=0.0 if s == 0 else 1.0, alpha=scale)
                else:
                    if scale != 1.0:
                        p.mul_(scale)
                    p = pc_buf[:e - s].copy_(p)
                    torch.mm(p, wc, out=grad_h[s:e])
                    if grad_w is not None and s == 0:
                        grad_w.copy_(p.T @ hc[s:e])
                    elif grad_w is not None:
                        grad_w.add_(p.T @ hc[s:e])
        ctx.save_for_backward(grad_h, grad_w)  # None is saved as None
        ctx.dtypes = (h.dtype, w.dtype)
        ctx.used = False
        return torch.stack(losses).sum() * scale

    @staticmethod
    def backward(ctx, g: Tensor):
        grad_h, grad_w = ctx.saved_tensors
        h_dtype, w_dtype = ctx.dtypes
        if not _sync_ok(g):  # a GPU or a compiled graph: scale out of place (x * 1.0 == x), no host read of g
            return ((grad_h * g).to(h_dtype), None if grad_w is None else (grad_w * g).to(w_dtype),
                    None, None, None, None, None, None, None)
        if ctx.used:  # the saved gradients are scaled in place below, so a second pass would be wrong
            raise RuntimeError("linear_cross_entropy: backward through the same loss twice is not supported; "
                               "recompute the loss instead of retain_graph=True")
        ctx.used = True
        if float(g) != 1.0:  # loss.backward(): already scaled
            grad_h.mul_(g)
            if grad_w is not None:
                grad_w.mul_(g)
        return (grad_h.to(h_dtype), None if grad_w is None else grad_w.to(w_dtype), None, None, None, None, None, None,
                None)


def _sync_ok(t: Tensor) -> bool:
    """Whether the fused loss may read values on the host: on a CPU (where that is free), eager only."""
    return t.device.type == "cpu" and not torch.compiler.is_compiling()


def softmax_grad(logits: Tensor, t: Tensor, valid: Tensor | None, scale: float,
                 inplace: bool = False, softcap: float | None = None) -> tuple[Tensor, Tensor]:
    """``(Σ nll, d(scale · Σ nll)/d logits)`` of one chunk of logits ``(n, V)`` against targets ``t (n, 1)`` (rows
    weighted by ``valid (n,)``), the gradient in the logits' dtype: :func:`_chunk_sync_free`'s elementwise part.

    Their float32 log-softmax gives the loss exactly however small ``p[target]`` is; its ``exp`` is the softmax,
    which becomes ``p - onehot``. ``inplace`` reuses the float32 buffer for that (eagerly: less memory);
    without it there is no in-place op, so that a compiler fuses the whole into a pass or two over the chunk
    (``training.compile`` runs it so off the CPU: eagerly it is ~6 passes over a float32 chunk). Both give the
    same numbers. ``softcap``: the loss is that of the capped logits ``cap·tanh(l/cap)``, the gradient the
    capped one's times ``1 - tanh²``.
    """
    z = logits.float()
    if softcap is not None:
        th = torch.tanh(z / softcap)
        z = th * softcap
    logp = torch.log_softmax(z, dim=-1)  # (n, V)
    nll = logp.gather(1, t).squeeze(1).neg()  # (n,)
    minus = torch.full_like(t, -1.0, dtype=logp.dtype)
    p = logp.exp_().scatter_add_(1, t, minus) if inplace else logp.exp().scatter_add(1, t, minus)  # p - onehot
    if valid is not None:
        nll = nll * valid
        p = p.mul_(valid[:, None]) if inplace else p * valid[:, None]
    if softcap is not None:
        p = p.mul_(1.0 - th * th) if inplace else p * (1.0 - th * th)
    if scale != 1.0:
        p = p.mul_(scale) if inplace else p * scale
    return nll.sum(), p.to(logits.dtype)


_COMPILED: dict[tuple, Any] = {}


def compiled_softmax_grad(**options: Any) -> Any:
    """:func:`softmax_grad` under ``torch.compile(**options)`` with static shapes, built once per set of options."""
    key = tuple(sorted(options.items()))
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(softmax_grad, dynamic=False, **options)
    return _COMPILED[key]


def _chunk_sync_free(hc: Tensor, wc: Tensor, targets: Tensor, valid: Tensor | None, chunk: int, scale: float,
                     want_w: bool, chunk_fn: Any = None,
                     softcap: float | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(scale · summed loss, its gradient for h, for w or None)`` of ``hc wcᵀ``, ``chunk`` rows at a time,
    with no host sync and no data-dependent branch (the GPU and compiled form of :class:`_LinearCrossEntropySum`).

    Per chunk: logits in the compute dtype, :func:`softmax_grad` (in place, or ``chunk_fn``: it compiled) for the
    loss and the logits' gradient, which feeds both gradient GEMMs (``h``'s in the compute dtype, ``w``'s
    accumulated in float32).
    """
    N = hc.shape[0]
    fn = chunk_fn or functools.partial(softmax_grad, inplace=True)
    grad_w = torch.zeros(wc.shape, dtype=torch.float32, device=wc.device) if want_w else None
    losses, grads_h = [], []
    for s in range(0, N, chunk):
        e = min(N, s + chunk)
        nll_sum, pc = fn(hc[s:e] @ wc.T, targets[s:e, None], None if valid is None else valid[s:e], scale,
                         softcap=softcap)
        losses.append(nll_sum)
        grads_h.append(pc @ wc)  # (n, d)
        if grad_w is not None:
            grad_w.add_(pc.T @ hc[s:e])  # (V, d)
    return torch.stack(losses).sum() * scale, torch.cat(grads_h), grad_w


def _valid_rows(targets: Tensor, ignore_index: int | None,
                weights: Tensor | None = None) -> tuple[Tensor, Tensor | None, Tensor | int]:
    """(targets safe to gather, float factor of each row (0 for an ignored one, else its weight, else 1) or None,
    number of counted rows)."""
    if ignore_index is None:
        factor = None if weights is None else weights.reshape(-1).float()
        return targets, factor, targets.numel()
    valid = targets != ignore_index
    safe = torch.where(valid, targets, torch.zeros_like(targets))
    factor = valid.float() if weights is None else valid.float() * weights.reshape(-1).float()
    return safe, factor, valid.sum().clamp(min=1)


def _check_targets(targets: Tensor, n_rows: int, vocab_size: int) -> None:
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"targets must be an integer tensor of token ids, got dtype {targets.dtype}")
    if targets.numel() != n_rows:
        raise ValueError(f"targets hold {targets.numel()} ids but the logits have {n_rows} rows; "
                         "targets must have the logits' shape without the vocabulary dimension")


def cross_entropy(logits: Tensor, targets: Tensor, ignore_index: int | None = None, reduction: str = "mean",
                  weights: Tensor | None = None) -> Tensor:
    """Cross-entropy of ``logits (..., V)`` against ``targets (...)``, in float32.

    Same numbers as :func:`lmforge.model.layers.cross_entropy` (the reference formula) with one float32
    ``(N, V)`` buffer in backward where ``F.cross_entropy`` needs two. ``ignore_index`` targets count for nothing;
    ``reduction``: ``"mean"`` over counted targets (0 if none), ``"sum"`` (divide by the step's target
    count yourself), or ``"none"``. ``weights (...)`` multiply each target's loss (and its gradient).
    """
    if reduction == "none":
        return cross_entropy_reference(logits, targets, ignore_index, "none", weights)
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    V = logits.shape[-1]
    logits2 = logits.reshape(-1, V)  # (N, V)
    _check_targets(targets, logits2.shape[0], V)
    safe, valid, count = _valid_rows(targets.reshape(-1).long(), ignore_index, weights)
    total = _CrossEntropySum.apply(logits2, safe, valid)
    return total if reduction == "sum" else total / count


# Logits per chunk of linear_cross_entropy, by device type. CPU: ~8 M (32 MB in float32), measured at 2048 x 10k
# on 2 threads (three chunks of 683 rows beat five of 410). Elsewhere (a GPU): 128 M, so that the GEMMs have
# thousands of rows (~2.7k at a 50k vocabulary) and a step launches few chunks, for ~1.6 GB of temporaries
# (the chunk's logits, their float32 log-softmax, its compute-dtype copy). On an H100 (2026-11-27) GPT-2-small
# training with it peaked at 14-16 GiB at 32 x 1024 tokens (HF, which builds the logits: 33-37 GiB); other sizes
# not yet compared there.
_CHUNK_LOGITS = {"cpu": 1 << 23}
_CHUNK_LOGITS_ACCELERATOR = 1 << 27


def _chunk_rows(n_rows: int, vocab_size: int, device_type: str = "cpu") -> int:
    """Rows per chunk of :func:`linear_cross_entropy`: the rows split evenly into chunks of at most
    ``_CHUNK_LOGITS`` logits for the device (equal chunks avoid a short last GEMM)."""
    budget = max(64, _CHUNK_LOGITS.get(device_type, _CHUNK_LOGITS_ACCELERATOR) // vocab_size)
    n_chunks = max(1, -(-n_rows // budget))
    return max(1, -(-n_rows // n_chunks))


def linear_cross_entropy(h: Tensor, weight: Tensor, targets: Tensor, ignore_index: int | None = None,
                         reduction: str = "mean", chunk_rows: int | None = None,
                         weights: Tensor | None = None, chunk_fn: Any = None, softcap: float | None = None) -> Tensor:
    """``cross_entropy(h @ weight.T, targets, weights=weights)`` without materialising the ``(N, V)`` logits; with
    ``softcap`` the loss of the capped logits ``softcap·tanh(h @ weight.T / softcap)`` (``model.logit_softcap``).

    ``h (..., d)``, ``weight (V, d)``. Under autocast the matmuls run in the autocast dtype and the
    softmax in float32, like the unfused path. ``chunk_fn`` (off the CPU): a compiled :func:`softmax_grad`.
    """
    if reduction == "none":
        return cross_entropy_reference(softcap_logits(h @ weight.T, softcap), targets, ignore_index, "none", weights)
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    h2 = h.reshape(-1, h.shape[-1])  # (N, d)
    _check_targets(targets, h2.shape[0], weight.shape[0])
    safe, valid, count = _valid_rows(targets.reshape(-1).long(), ignore_index, weights)
    dev = h.device.type
    cdtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else h.dtype
    chunk = chunk_rows or _chunk_rows(h2.shape[0], weight.shape[0], dev)
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        if reduction == "mean" and valid is None and h2.shape[0]:  # the 1/N rides in the GEMMs (see _LinearCrossEntropySum)
            return _LinearCrossEntropySum.apply(h2, weight, safe, valid, chunk, cdtype, 1.0 / h2.shape[0], chunk_fn,
                                                softcap)
        total = _LinearCrossEntropySum.apply(h2, weight, safe, valid, chunk, cdtype, 1.0, chunk_fn, softcap)
    else:  # evaluation: chunked loss only
        parts = []
        for s in range(0, h2.shape[0], chunk):
            logits = softcap_logits((h2[s:s + chunk].to(cdtype) @ weight.to(cdtype).T).float(), softcap)  # (n, V)
            nll = torch.logsumexp(logits, -1) - logits.gather(1, safe[s:s + chunk, None]).squeeze(1)
            parts.append((nll * valid[s:s + chunk]).sum() if valid is not None else nll.sum())
        total = torch.stack(parts).sum()
    return total if reduction == "sum" else total / count
