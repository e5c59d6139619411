"""Scoring a policy on validation prompts: greedy exact match, pass@1 and pass@k, with 95% intervals.

* **greedy exact match**: :func:`lmforge.evals.generative.exact_match`, the very function ``lmforge eval --task``
  runs (greedy, calculator calls run, each reply within the answer's tokens + 16).
* **pass@1 / pass@k**: ``n = rl.eval_samples`` replies per prompt sampled as in training (the rollout
  temperature, top-k/p, ``max_new_tokens``, tools), seeded by prompt and sample index only
  (:func:`~lmforge.rl.rollout.rollout_seed` with step -1), so a model scored before and after training sees
  the same random draws. With ``c`` of a prompt's ``n`` replies correct, pass@1 is the mean of ``c/n`` and
  pass@k (``k = n``) the share of prompts with ``c > 0`` (Chen et al. 2021's unbiased estimator
  ``1 - C(n-c, k)/C(n, k)`` at ``k = n``; :func:`pass_at_k` gives it for any ``k <= n``).

Intervals are Wilson's over prompts (:func:`lmforge.evals.wilson_interval`); for pass@1, whose per-prompt
values are fractions, the Wilson interval of ``sum(c/n)`` successes in ``P`` prompts is conservative (a fraction's
variance is at most a Bernoulli's of the same mean).
"""

from __future__ import annotations

import math
import time
from typing import Any

from lmforge.chat.format import ChatFormat
from lmforge.evals.generative import exact_match
from lmforge.evals.stats import wilson_interval
from lmforge.generate import Generator
from lmforge.rl.data import PromptSet
from lmforge.rl.rewards import exact_match_reward
from lmforge.rl.rollout import rollout_seed, sample_replies

__all__ = ["pass_at_k", "evaluate_policy"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of ``c`` correct among ``n`` samples: ``1 - C(n - c, k) / C(n, k)`` (``k <= n``)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _rate(successes: float, n: int) -> dict[str, Any]:
    lo, hi = wilson_interval(successes, n)
    return {"value": successes / n if n else 0.0, "ci": [lo, hi]}


def evaluate_policy(model: Any, tokenizer: Any, prompts: PromptSet, rl: Any, seed: int) -> dict[str, Any]:
    """Greedy exact match, pass@1 and pass@k of ``model`` on the first ``rl.eval_prompts`` of ``prompts`` (all when
    null), overall and per task, with intervals; ``rl`` the run's :class:`~lmforge.train.config.RLConfig`."""
    t0 = time.perf_counter()
    n_prompts = min(len(prompts), rl.eval_prompts or len(prompts))
    items, tags = prompts.items[:n_prompts], prompts.tasks[:n_prompts]
    fmt, gen = ChatFormat(tokenizer), Generator(model, tokenizer)
    greedy = exact_match(gen, items)["correct"]
    n, correct, tokens, tools = rl.eval_samples, [], 0, 0
    for s in range(0, n_prompts, rl.prompts_per_decode):
        chunk = range(s, min(n_prompts, s + rl.prompts_per_decode))
        groups = sample_replies(gen.engine, [prompts.ids[i] for i in chunk],
                                [[rollout_seed(seed, -1, i, k) for k in range(n)] for i in chunk],
                                temperature=rl.temperature, top_k=rl.top_k, top_p=rl.top_p,
                                max_new_tokens=rl.max_new_tokens, fmt=fmt, vocab_limit=tokenizer.vocab_size,
                                tools=rl.tools)
        for i, group in zip(chunk, groups):
            correct.append(int(sum(exact_match_reward(fmt, r, items[i].answer) for r in group)))
            tokens += sum(r.sampled_count for r in group)
            tools += sum(r.tool_calls > 0 for r in group)

    def scores(idx: list[int]) -> dict[str, Any]:
        return {"n": len(idx), "greedy_exact_match": _rate(sum(greedy[i] for i in idx), len(idx)),
                "pass_at_1": _rate(sum(correct[i] / n for i in idx), len(idx)),
                "pass_at_k": _rate(sum(pass_at_k(n, correct[i], n) for i in idx), len(idx))}

    out = scores(list(range(n_prompts)))
    out.update(k=n, reply_tokens=tokens / (n * n_prompts), tool_call_share=tools / (n * n_prompts),
               seconds=time.perf_counter() - t0,
               tasks={t: scores([i for i in range(n_prompts) if tags[i] == t]) for t in dict.fromkeys(tags)})
    return out
