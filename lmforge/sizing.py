"""Sizing the speedrun's model to the machine and the budget: candidate shapes, their measured step times, one rule.

The rule (:func:`choose`) is compute-optimal sizing with a ratio fitted on this project's own isoFLOP screen
(``benchmarks/bench_recipe.py isoflop``; :func:`fit_ratio`): a candidate trained for the budget sees
``tokens = steps x batch x context`` tokens, where ``steps`` is the budget divided by the candidate's *measured*
step time (so a shape the machine runs at a poor FLOP rate pays for it), and the candidate whose tokens per
parameter lie nearest :data:`TOKENS_PER_PARAM` (in log space) is chosen. Parameters are the weights each token
multiplies through (:func:`~lmforge.model.transformer.matmul_params_per_token`: every projection and the LM head,
not the embedding lookup), the ``N`` of ``6 N`` FLOPs per token. Candidates that would pass over the training split
more than :data:`MAX_EPOCHS` times are left out, since the ratio was fitted on runs that see their data about once
(a smaller model trained for the whole budget would see a small corpus many times).
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from lmforge.hardware import resolve_train_dtype
from lmforge.model import ModelConfig, TransformerLM
from lmforge.model.transformer import flops_per_token, matmul_params_per_token
from lmforge.train.allocator import retain_freed_memory
from lmforge.train.loop import _build_optimizer  # the loop's own builder: the step timed is the step trained

__all__ = ["Preset", "CANDIDATES", "TOKENS_PER_PARAM", "BUDGET_SHARE", "step_seconds", "params_of", "flops_of",
           "plan_tokens", "choose", "fit_ratio", "size", "model_config", "family", "MAX_EPOCHS"]


@dataclasses.dataclass(frozen=True)
class Preset:
    """Model and batch shape of a ``--model-size``."""

    d_model: int
    n_layers: int
    n_heads: int
    context_length: int
    batch_size: int
    lr: float


def family(name: str) -> Preset:
    """The shape ``d{width}x{depth}`` of the candidates' family (``d192x3``): heads of 32 dimensions, context 256, batch 16 (4,096 tokens a step:
    the demo's), the demo's schedule peak (under the speedrun's Muon recipe only the schedule's shape comes from it)."""
    m = re.fullmatch(r"d(\d+)x(\d+)", name)
    if m is None or int(m.group(1)) % 32 or int(m.group(1)) < 32 or int(m.group(2)) < 1:
        raise ValueError(f"shape {name!r} is not d<width>x<depth> with a width that is a multiple of 32")
    d_model, n_layers = int(m.group(1)), int(m.group(2))
    return Preset(d_model=d_model, n_layers=n_layers, n_heads=d_model // 32, context_length=256, batch_size=16,
                  lr=2e-3)


CANDIDATES: dict[str, Preset] = {name: family(name) for name in
                                  ("d64x2", "d96x2", "d128x2", "d192x3", "d256x4", "d320x5", "d384x6")}
"""The shapes ``--model-size auto`` times and chooses from: width 64 x depth from two layers up (two narrower
two-layer shapes below), from 0.37M to 12.2M matmul parameters at a 4,096-token vocabulary (``d256x4`` is the
``small`` preset)."""

TOKENS_PER_PARAM = 8.1
"""The tokens-per-parameter ratio that :func:`choose` aims at: the best ratio of the isoFLOP screen
(``benchmarks/bench_recipe.py isoflop``, the mean of two seeds; docs/benchmarks.md, "Model sizing")."""

MAX_EPOCHS = 3.0
"""The most passes over the training split a candidate may plan: below the ~4 epochs up to which repeated tokens are
worth nearly fresh ones at scale (Muennighoff et al., "Scaling Data-Constrained Language Models", 2023), because a
demo-sized model on Shakespeare was measured getting worse on validation between its third and fourth pass
(docs/benchmarks.md, "Model sizing")."""

BUDGET_SHARE = 0.9
"""The share of a minutes budget planned as training steps; the rest is left for evaluations and checkpoints."""


def model_config(preset: Preset, vocab_size: int) -> ModelConfig:
    """The ``ModelConfig`` of ``preset`` at ``vocab_size`` (rounded up to a multiple of 64, as the speedrun does)."""
    return ModelConfig(vocab_size=64 * math.ceil(vocab_size / 64), context_length=preset.context_length,
                       d_model=preset.d_model, n_layers=preset.n_layers, n_heads=preset.n_heads,
                       tie_embeddings=False)


def params_of(preset: Preset, vocab_size: int) -> int:
    """``N``: the weights a token multiplies through at ``preset`` (projections and LM head, no embedding lookup)."""
    return matmul_params_per_token(model_config(preset, vocab_size))


def flops_of(preset: Preset, vocab_size: int) -> int:
    """Training FLOPs of one token at ``preset`` (``6 N + 12 L d T``)."""
    return flops_per_token(model_config(preset, vocab_size))


def step_seconds(cfg: Any, device: Any, steps: int = 4) -> float:
    """Wall time of one training step (forward, backward, the run's optimizer) at ``cfg``'s shapes, on random
    tokens, in the precision the run trains in (``training.dtype``, ``auto`` resolved).

    The fastest of ``steps`` (after a warm-up step): what the machine does when nothing else competes
    for it, so the planned number of steps, and with it the result, does not depend on momentary load. On the CPU
    the process keeps freed memory first, as the training loop does (:mod:`lmforge.train.allocator`).
    """
    if device.type == "cpu":
        retain_freed_memory()
    tc = cfg.training
    model = TransformerLM(cfg.model).to(device)
    opt = _build_optimizer(model, cfg.optimizer)
    bf16 = resolve_train_dtype(tc.dtype, device) == "bf16"
    x = torch.randint(0, cfg.model.vocab_size, (tc.batch_size, cfg.context_length), device=device)
    best = float("inf")
    for i in range(steps + 1):
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = model(x, targets=x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:  # the first step pays one-time costs
            best = min(best, time.perf_counter() - t0)
    return best


def plan_tokens(preset: Preset, budget: tuple[str, float], step_s: float | None) -> tuple[int, int]:
    """``(steps, tokens)`` that ``budget`` (``("minutes", m)`` or ``("steps", n)``) buys at ``preset``: minutes are
    :data:`BUDGET_SHARE` of the budget over the measured ``step_s`` (at least 10 steps)."""
    kind, amount = budget
    if kind == "steps":
        steps = int(amount)
    else:
        if not step_s or step_s <= 0:
            raise ValueError("a minutes budget needs a measured step time")
        steps = max(10, int(BUDGET_SHARE * amount * 60 / step_s))
    return steps, steps * preset.batch_size * preset.context_length


def choose(rows: Sequence[dict[str, Any]], ratio: float = TOKENS_PER_PARAM,
           max_epochs: float | None = None) -> dict[str, Any]:
    """The row whose ``tokens / params`` is nearest ``ratio`` in log space (a tie: the fewer parameters), among the
    rows whose ``epochs`` is at most ``max_epochs`` (``None``: every row; none within it: the fewest epochs).

    ``rows``: one per candidate, each with ``params`` and ``tokens`` (:func:`plan_tokens`), and ``epochs`` (planned
    passes over the training split) when ``max_epochs`` is given."""
    if not rows:
        raise ValueError("no candidate shapes to choose from")
    if not ratio > 0:
        raise ValueError(f"the tokens-per-parameter ratio must be > 0, got {ratio!r}")
    if max_epochs is not None:
        within = [r for r in rows if r["epochs"] <= max_epochs]
        if not within:
            return min(rows, key=lambda r: r["epochs"])
        rows = within
    return min(rows, key=lambda r: (abs(math.log(r["tokens"] / r["params"] / ratio)), r["params"]))


def fit_ratio(points: Sequence[tuple[float, float]]) -> dict[str, float]:
    """The tokens-per-parameter ratio at the minimum of a parabola fitted (least squares) to ``(tokens/params,
    loss)`` points of one compute budget, in ``log(tokens/params)``: the isoFLOP screen's best ratio.

    Returns ``ratio``, ``loss`` (the parabola's minimum) and ``bracketed`` (1.0 when the minimum lies inside the
    measured ratios, 0.0 when it is an extrapolation; then ``ratio`` is the measured point with the lowest loss).
    Needs 3 distinct ratios and a parabola that opens upward."""
    xs = [math.log(r) for r, _ in points]
    if len(set(xs)) < 3:
        raise ValueError("fit_ratio needs points at 3 or more distinct ratios")
    a, b, c = (float(v) for v in np.polyfit(xs, [y for _, y in points], 2))  # least squares
    lo, hi = min(xs), max(xs)
    if a > 0 and lo <= -b / (2 * a) <= hi:
        x = -b / (2 * a)
        return {"ratio": math.exp(x), "loss": a * x * x + b * x + c, "bracketed": 1.0}
    best = min(points, key=lambda p: p[1])
    return {"ratio": best[0], "loss": best[1], "bracketed": 0.0}


def size(budget: tuple[str, float], vocab_size: int, train_tokens: int, time_step: Callable[[Preset], float],
         candidates: Mapping[str, Preset] | None = None, ratio: float | None = None,
         max_epochs: float | None = None) -> dict[str, Any]:
    """Time each candidate (``time_step(preset)``: seconds per training step; not called for a budget in steps),
    work out the tokens the budget buys each (:func:`plan_tokens`) and choose by :func:`choose`; ``train_tokens``:
    the training split's size, for the epochs each would plan.

    Returns the plan stage's sizing record: ``candidates`` (one row each: shape, ``params``, ``flops_per_token``,
    ``step_seconds``, the FLOP rate achieved, ``steps``, ``tokens``, ``tokens_per_param``, ``epochs``, ``compute``
    in FLOPs), ``chosen`` (its name), ``ratio`` and ``max_epochs`` (the rule's constants), ``rule`` and ``text``
    (the choice and why, in words). ``candidates``, ``ratio`` and ``max_epochs`` default to :data:`CANDIDATES`,
    :data:`TOKENS_PER_PARAM` and :data:`MAX_EPOCHS`."""
    candidates = CANDIDATES if candidates is None else candidates
    ratio = TOKENS_PER_PARAM if ratio is None else ratio
    max_epochs = MAX_EPOCHS if max_epochs is None else max_epochs
    if train_tokens < 1:
        raise ValueError(f"the training split has no tokens ({train_tokens})")
    rows = []
    for name, preset in candidates.items():
        step_s = None if budget[0] == "steps" else time_step(preset)
        steps, tokens = plan_tokens(preset, budget, step_s)
        params, fpt = params_of(preset, vocab_size), flops_of(preset, vocab_size)
        per_step = preset.batch_size * preset.context_length
        rows.append({"name": name, "preset": dataclasses.asdict(preset), "params": params, "flops_per_token": fpt,
                     "step_seconds": step_s, "flops_per_s": fpt * per_step / step_s if step_s else None,
                     "steps": steps, "tokens": tokens, "tokens_per_param": tokens / params, "epochs": tokens / train_tokens,
                     "compute": tokens * fpt})
    best = choose(rows, ratio, max_epochs)
    basis = ("the budget in steps" if budget[0] == "steps" else
             f"{BUDGET_SHARE:.0%} of {budget[1]:g} min at each candidate's measured step time")
    rule = (f"tokens = steps x batch x context from {basis}; among the candidates that pass over the "
            f"{train_tokens:,}-token training split at most {max_epochs:g} times, choose the one whose tokens per "
            f"parameter (matmul weights) is nearest {ratio:g} in log space")
    text = (f"{best['name']} (d_model {best['preset']['d_model']}, {best['preset']['n_layers']} layers, context "
            f"{best['preset']['context_length']}, batch {best['preset']['batch_size']}): {best['tokens']:,} tokens for "
            f"{best['params']:,} parameters = {best['tokens_per_param']:.3g} tokens per parameter at "
            f"{best['compute']:.3g} FLOPs and {best['epochs']:.2g} epochs, the nearest of {len(rows)} candidates to "
            f"the fitted {ratio:g} within {max_epochs:g} epochs")
    return {"candidates": rows, "chosen": best["name"], "ratio": ratio, "max_epochs": max_epochs, "rule": rule,
            "text": text}
