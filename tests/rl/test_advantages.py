"""Advantages and masking on hand-made rollouts; the loop's weighted loss is the REINFORCE formula."""

from __future__ import annotations

import pytest
import torch

from lmforge.chat import ChatFormat, add_chat_tokens
from lmforge.data.conversations import IGNORE_INDEX
from lmforge.model import ModelConfig, TransformerLM
from lmforge.rl import Rollout, group_advantages, pass_at_k, rollout_batches, rollout_seed
from lmforge.rl.advantages import STD_EPS
from lmforge.tokenizer import Tokenizer


def _fmt() -> ChatFormat:
    return ChatFormat(add_chat_tokens(Tokenizer({i: bytes([i]) for i in range(256)}, [])))


def test_group_advantages_are_reward_minus_group_mean_and_optionally_over_std() -> None:
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 1.0]])
    a = group_advantages(r)
    assert a.tolist() == [[0.5, -0.5, -0.5, 0.5], [0.0] * 4, [-0.25, -0.25, -0.25, 0.75]]
    s = group_advantages(r, std=True)
    std3 = (0.75 * 0.25) ** 0.5  # population std of [0, 0, 0, 1]
    want = [[x / (0.5 + STD_EPS) for x in (0.5, -0.5, -0.5, 0.5)], [0.0] * 4,
            [x / (std3 + STD_EPS) for x in (-0.25, -0.25, -0.25, 0.75)]]
    torch.testing.assert_close(s, torch.tensor(want))
    with pytest.raises(ValueError, match="group of one"):
        group_advantages(torch.tensor([[1.0], [0.0]]))


def test_rollout_batches_train_the_sampled_ids_only_weighted_by_their_advantage() -> None:
    """The worked example of lmforge.rl.advantages: a tool's output, the prompt and padding are ignored; every
    sampled id (the stop id included) is a target weighing its reply's advantage."""
    fmt = _fmt()
    sp = fmt.ids
    prompt = fmt.render_for_completion([{"role": "user", "content": "2*2?"}])
    out = fmt.tool_output_ids("4")
    r0 = Rollout(prompt, ids=[ord("a"), ord("b")], sampled=[True, True], stop=fmt.assistant_end_id, finish="stop")
    r1 = Rollout(prompt, ids=[sp["<|python_start|>"], ord("2"), sp["<|python_end|>"], *out, ord("c")],
                 sampled=[True, True, True] + [False] * len(out) + [True], finish="length", tool_calls=1)
    adv = group_advantages(torch.tensor([[1.0, 0.0]]))[0].tolist()
    weights = [[adv[0]] * 3, [adv[1]] * len(r1.ids)]
    (x, y, w), = rollout_batches([r0, r1], weights, micro_batch=2, context_length=64, pad_id=0)
    P = len(prompt)
    assert x.shape == y.shape == w.shape == (2, P + len(r1.ids) - 1)
    assert x[0].tolist() == (prompt + r0.ids + [0] * (len(r1.ids) - 3))[: x.shape[1]]  # r0 padded after its stop
    assert (y[:, : P - 1] == IGNORE_INDEX).all()  # nothing of the prompt is trained
    assert y[0, P - 1: P + 2].tolist() == [ord("a"), ord("b"), fmt.assistant_end_id]
    assert (y[0, P + 2:] == IGNORE_INDEX).all()
    want = [sp["<|python_start|>"], ord("2"), sp["<|python_end|>"]] + [IGNORE_INDEX] * len(out) + [ord("c")]
    assert y[1, P - 1:].tolist() == want
    assert ((y != IGNORE_INDEX) == (w != 0)).all()
    assert w[0, P - 1: P + 2].tolist() == [0.5] * 3 and (w[1][y[1] != IGNORE_INDEX] == -0.5).all()
    assert int((y != IGNORE_INDEX).sum()) == r0.sampled_count + r1.sampled_count == 7


def test_the_loops_weighted_loss_is_reinforce_over_the_sampled_tokens() -> None:
    """``model(x, targets=y, reduction="sum", weights=w) / n`` == ``-(1/n) sum_t A_t log p(y_t)`` from the logits."""
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(vocab_size=300, context_length=32, d_model=32, n_layers=1, n_heads=2))
    x = torch.randint(0, 300, (3, 12))
    y = torch.randint(0, 300, (3, 12))
    y[:, :4] = IGNORE_INDEX
    y[2, 9:] = IGNORE_INDEX
    w = torch.randn(3, 12) * (y != IGNORE_INDEX)
    n = int((y != IGNORE_INDEX).sum())
    loss = model(x, targets=y, ignore_index=IGNORE_INDEX, reduction="sum", weights=w) / n
    logp = torch.log_softmax(model(x).float(), -1)
    keep = y != IGNORE_INDEX
    ref = -(w[keep] * logp[keep].gather(1, y[keep][:, None]).squeeze(1)).sum() / n
    torch.testing.assert_close(loss, ref)
    g = torch.autograd.grad(loss, model.lm_head.weight)[0]
    g_ref = torch.autograd.grad(ref, model.lm_head.weight)[0]
    torch.testing.assert_close(g, g_ref)


def test_rollout_seeds_are_distinct_and_stable() -> None:
    seeds = {rollout_seed(1337, s, j, k) for s in range(3) for j in range(4) for k in range(8)}
    assert len(seeds) == 96 and all(0 <= s < 2 ** 63 for s in seeds)
    assert rollout_seed(1337, 2, 3, 4) == rollout_seed(1337, 2, 3, 4) != rollout_seed(1338, 2, 3, 4)
    assert rollout_seed(0, 0, 0, 0) == 6297888086361682660  # fixed across processes and versions


def test_pass_at_k_is_the_unbiased_estimator() -> None:
    assert pass_at_k(8, 0, 8) == 0.0 and pass_at_k(8, 1, 8) == 1.0
    assert pass_at_k(8, 2, 1) == pytest.approx(0.25)
    assert pass_at_k(10, 3, 2) == pytest.approx(1 - (7 * 6) / (10 * 9))
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 2)
