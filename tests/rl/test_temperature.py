"""The update is the policy gradient of the policy that sampled: by exact enumeration of every reply of a tiny
model, the loop's expected gradient at ``rl.temperature`` is the exact gradient of the expected reward under the
tempered distribution, and the KL term's log-ratios are the tempered ones (with the sign that pulls towards the
reference). With a soft-capped model the tempered distribution is the capped logits over the temperature, the one the
rollouts sample from the engine."""

from __future__ import annotations

import itertools
import types

import pytest
import torch

from lmforge.data.conversations import IGNORE_INDEX
from lmforge.generate.engine import Engine
from lmforge.generate.sampling import sampling_logits
from lmforge.model import ModelConfig, TransformerLM
from lmforge.rl import RolloutSource
from lmforge.rl.source import tempered_logits
from lmforge.train.config import OptimConfig, RLConfig, TrainingConfig
from lmforge.train.distributed import DistInfo
from lmforge.train.loop import _train_step

V, PROMPT = 4, [1, 2]  # a vocabulary of 4 tokens; every reply is two sampled ids after a prompt of two
CPU = torch.device("cpu")


CAPPED = {"logit_softcap": 0.5}  # below the logits' scale: the cap changes the distribution


def _model(seed: int, **kw) -> TransformerLM:
    torch.manual_seed(seed)
    return TransformerLM(ModelConfig(vocab_size=V, context_length=8, d_model=16, n_layers=1, n_heads=2, **kw))


def _source(model: TransformerLM, temperature: float, kl_coef: float = 0.0,
            ref: TransformerLM | None = None) -> RolloutSource:
    rl = RLConfig(temperature=temperature, samples_per_prompt=2, prompts_per_step=1, kl_coef=kl_coef)
    cfg = types.SimpleNamespace(rl=rl, training=types.SimpleNamespace(global_batch_size=2, parallel="none", seed=0))
    src = RolloutSource(cfg, None, None, DistInfo(0, 0, 1, CPU), micro_batch=1)
    src.ref = ref  # given, so bind() builds none
    src.bind(model)
    return src


def _reply_batch(y: tuple[int, int], weight: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The micro-batch ``rollout_batches`` makes of one reply ``y`` to :data:`PROMPT` with advantage ``weight``."""
    x = torch.tensor([PROMPT + [y[0]]])  # (1, 3)
    t = torch.tensor([[IGNORE_INDEX, y[0], y[1]]])
    return x, t, torch.tensor([[0.0, weight, weight]])


def _log_probs(model: TransformerLM, temperature: float) -> torch.Tensor:
    """``log p_T(y)`` of every reply ``y`` (in ``itertools.product`` order), from the model's logits / T."""
    logits = model(torch.tensor([PROMPT + [a] for a in range(V)])) / temperature  # (V, 3, V)
    lp = torch.log_softmax(logits.float(), -1)
    return torch.stack([lp[a, 1, a] + lp[a, 2, b] for a, b in itertools.product(range(V), repeat=2)])


class _Capture:
    """An optimizer that keeps the step's gradient and changes nothing."""

    def __init__(self, model: TransformerLM) -> None:
        self.model, self.param_groups, self.grads = model, [{}], None

    def step(self) -> None:
        self.grads = [p.grad.clone() for p in self.model.parameters()]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero_grad(set_to_none=set_to_none)


def _loop_gradient(model: TransformerLM, src: RolloutSource, batch: tuple) -> list[torch.Tensor]:
    """The gradient ``lmforge.train.loop`` takes for one step whose only micro-batch is ``batch`` (from ``src``)."""
    src._queue = [batch]
    opt = _Capture(model)
    run = types.SimpleNamespace(
        cfg=types.SimpleNamespace(training=TrainingConfig(max_steps=1, dtype="fp32"),
                                  optimizer=OptimConfig(lr=1.0, schedule="constant", warmup_steps=0, grad_clip=0.0)),
        info=DistInfo(0, 0, 1, CPU), model=model, loader=src, batch=types.SimpleNamespace(accum_steps=1, micro_batch=len(batch[0])),
        optimizer=opt, step=0, last_ckpt=None, elapsed=0.0, interval_time=0.0, interval_tokens=0, tokens=0)
    _train_step(run)
    return opt.grads


@pytest.mark.parametrize("temperature, options", [(0.5, {}), (2.0, {}), (0.5, CAPPED)],
                         ids=["0.5", "2.0", "0.5-soft-capped"])
def test_the_loops_expected_gradient_is_the_policy_gradient_at_the_sampling_temperature(temperature, options) -> None:
    """``E_{y ~ p_T}[loop's gradient on y with advantage r(y)] = -(1/2) ∇ E_{p_T}[r]`` (2 sampled tokens per reply;
    the reward depends on the first id only). At temperature 1 in the loss (the old code) the two differ; so do they
    when the loss divides the head's input by the temperature and caps after (``cap·tanh(z/(T·cap))``)."""
    model = _model(0, **options)
    params = list(model.parameters())
    replies = list(itertools.product(range(V), repeat=2))
    reward = torch.tensor([float(a == 3) + 0.5 * float(a == 1) for a, _ in replies])
    lp = _log_probs(model, temperature)
    exact = torch.autograd.grad((lp.exp() * reward).sum(), params)  # ∇ E_{p_T}[r]
    p = lp.detach().exp()
    assert float(p.sum()) == pytest.approx(1.0, abs=1e-5) and 0.05 < float(p.max()) < 0.95
    src = _source(model, temperature)
    expected = [torch.zeros_like(q) for q in params]
    for y, py, r in zip(replies, p, reward):
        for e, g in zip(expected, _loop_gradient(model, src, _reply_batch(y, float(r)))):
            e += py * g
    for e, g in zip(expected, exact):
        torch.testing.assert_close(-2 * e, g, rtol=1e-4, atol=1e-6)
    assert max(float(g.abs().max()) for g in exact) > 1e-3  # a gradient worth comparing


@pytest.mark.parametrize("temperature, options", [(0.5, {}), (1.0, {}), (0.5, CAPPED)],
                         ids=["0.5", "1.0", "0.5-soft-capped"])
def test_kl_weights_subtract_the_tempered_log_ratio_to_the_reference(temperature, options) -> None:
    """Each sampled token's weight loses ``kl_coef · (log p_T(y_t) - log p_ref,T(y_t))``: the policy's minus the
    reference's log-probability at the sampling temperature (a token the policy likes more than the reference
    is pushed down)."""
    model, ref = _model(0, **options), _model(1, **options)
    src = _source(model, temperature, kl_coef=0.25, ref=ref)
    replies = list(itertools.product(range(V), repeat=2))
    batches = [_reply_batch(y, 1.0) for y in replies]
    total, count = src._kl_weights(batches)
    with torch.no_grad():
        logits = {m: torch.log_softmax(m(torch.tensor([PROMPT + [a] for a in range(V)])) / temperature, -1)
                  for m in (model, ref)}
    ratios = []
    for (a, b), (_, _, w) in zip(replies, batches):
        lr = [float(logits[model][a, 1, a] - logits[ref][a, 1, a]), float(logits[model][a, 2, b] - logits[ref][a, 2, b])]
        assert w[0].tolist() == pytest.approx([0.0, 1 - 0.25 * lr[0], 1 - 0.25 * lr[1]], abs=1e-5)
        ratios += lr
    assert count == 2 * len(replies) and total == pytest.approx(sum(ratios), abs=1e-4)
    assert max(map(abs, ratios)) > 0.1  # the two models differ enough for the test to see a sign or a temperature


def test_the_kl_term_is_the_gradient_of_the_per_position_kls_at_fixed_contexts() -> None:
    """What ``lmforge.rl.advantages`` says the KL weight is: in expectation over replies, the loop's gradient with
    advantage 0 and ``kl_coef = b`` is ``(b/2) ∇ sum_t KL(p(.|c_t) || p_ref(.|c_t))`` with the context
    probabilities held fixed, which is not the gradient of the reply-level ``KL(p || p_ref)``."""
    T, b = 0.5, 0.5
    model, ref = _model(0), _model(1)
    params = list(model.parameters())
    src = _source(model, T, kl_coef=b, ref=ref)
    replies = list(itertools.product(range(V), repeat=2))
    lp = _log_probs(model, T)
    p = lp.detach().exp()
    expected = [torch.zeros_like(q) for q in params]
    for y, py in zip(replies, p):
        batch = _reply_batch(y, 0.0)
        src._kl_weights([batch])
        for e, g in zip(expected, _loop_gradient(model, src, batch)):
            e += py * g
    x = torch.tensor([PROMPT + [a] for a in range(V)])
    lq = torch.log_softmax(model(x) / T, -1)  # (V, 3, V)
    with torch.no_grad():
        lr_ = torch.log_softmax(ref(x) / T, -1)
    kl = lambda i, a: (lq[a, i].exp() * (lq[a, i] - lr_[a, i])).sum()  # noqa: E731  KL at position i, row a
    first = lq[0, 1].exp().detach()  # the contexts' probabilities, held fixed
    per_position = kl(1, 0) + sum(first[a] * kl(2, a) for a in range(V))
    fixed = torch.autograd.grad(per_position, params)
    for e, g in zip(expected, fixed):
        torch.testing.assert_close(2 * e / b, g, rtol=1e-4, atol=1e-6)
    lp_ref = _log_probs(ref, T).detach()
    whole = torch.autograd.grad((lp.exp() * (lp - lp_ref)).sum(), params)  # ∇ KL(p || p_ref) over replies
    assert max(float((g - w).abs().max()) for g, w in zip(fixed, whole)) > 1e-3


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_rollouts_sample_the_distribution_the_loss_trains(temperature) -> None:
    """A soft-capped model: the distribution the rollouts draw the first reply token from (the engine's logits
    through ``sample_next``'s ``sampling_logits``) is the one whose log-probabilities the loss takes under
    ``tempered_logits``. Once the engine read the head without the cap: it sampled one policy and trained another."""
    model = _model(0, **CAPPED).eval()
    with torch.inference_mode():
        sampled = torch.log_softmax(sampling_logits(Engine(model).prefill([PROMPT], 8), temperature), -1)[0]  # (V,)
    x = torch.tensor([PROMPT] * V)
    y = torch.tensor([[IGNORE_INDEX, a] for a in range(V)])
    with torch.no_grad(), tempered_logits(temperature, model):
        trained = -model(x, targets=y, ignore_index=IGNORE_INDEX, reduction="none").view(y.shape)[:, 1]  # log p_T(a)
    torch.testing.assert_close(trained, sampled, rtol=1e-5, atol=1e-6)
    assert model.logit_temperature == 1.0  # restored
    with torch.no_grad():
        raw = model.lm_head(model.hidden(torch.tensor([PROMPT])))
    assert float(raw.abs().max()) > 2 * CAPPED["logit_softcap"]  # the cap changes the distribution
