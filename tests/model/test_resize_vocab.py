"""``TransformerLM.resize_vocab``: the embedding and LM head grow by mean rows; old logits are unchanged."""

import pytest
import torch

from lmforge.checkpoint import load_checkpoint, save_checkpoint
from lmforge.model import ModelConfig, TransformerLM


def _model(tie: bool, fast: bool = True) -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(ModelConfig(vocab_size=40, context_length=16, d_model=32, n_layers=2, n_heads=2,
                                     tie_embeddings=tie, fast=fast))


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("fast", [False, True])
def test_old_logits_are_unchanged_and_new_rows_are_the_means(tie, fast):
    model = _model(tie, fast)
    idx = torch.randint(0, 40, (2, 12))
    with torch.no_grad():
        before = model(idx)  # (2, 12, 40)
        emb_mean = model.token_embeddings.weight.mean(0)
        head_mean = model.lm_head.weight.mean(0)
    assert model.resize_vocab(43) is model
    assert model.cfg.vocab_size == 43 and model.token_embeddings.num_embeddings == 43
    assert model.lm_head.out_features == 43
    assert model.token_embeddings.weight.shape == model.lm_head.weight.shape == (43, 32)
    assert (model.lm_head.weight is model.token_embeddings.weight) == tie
    torch.testing.assert_close(model.token_embeddings.weight[40:], emb_mean.expand(3, -1))
    torch.testing.assert_close(model.lm_head.weight[40:], head_mean.expand(3, -1))
    with torch.no_grad():
        after = model(idx)  # (2, 12, 43)
    torch.testing.assert_close(after[..., :40], before, rtol=1e-5, atol=1e-5)
    # the head is linear, so a mean head row gives each new token the mean of the old logits
    torch.testing.assert_close(after[..., 40:], before.mean(-1, keepdim=True).expand(-1, -1, 3), rtol=1e-4, atol=1e-4)
    # over the old ids the softmax is the old one, renormalised
    p_old, p_new = before.softmax(-1), after.softmax(-1)[..., :40]
    torch.testing.assert_close(p_new / p_new.sum(-1, keepdim=True), p_old, rtol=1e-4, atol=1e-6)
    # the new ids are usable as input and trainable
    ids = torch.tensor([[41, 3, 42]])
    model(ids, targets=torch.tensor([[3, 42, 40]])).backward()
    assert model.token_embeddings.weight.grad.shape == (43, 32)
    assert model.token_embeddings.weight.grad[41].abs().sum() > 0


@pytest.mark.parametrize("tie", [False, True])
def test_grown_model_round_trips_through_a_checkpoint(tie, tmp_path):
    model = _model(tie).resize_vocab(45)
    path = tmp_path / "grown.safetensors"
    save_checkpoint(model, None, 3, path)
    fresh = TransformerLM(model.cfg)  # a model built from the grown config
    assert load_checkpoint(path, fresh) == 3
    idx = torch.tensor([[44, 1, 2, 43]])
    with torch.no_grad():
        torch.testing.assert_close(fresh(idx), model(idx), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"shape \(45, 32\)"):
        load_checkpoint(path, _model(tie))  # the old shape is told apart


def test_resize_vocab_only_grows():
    model = _model(False)
    w = model.lm_head.weight
    assert model.resize_vocab(40) is model and model.lm_head.weight is w  # same size: nothing changes
    for bad in (39, 40.5, True):
        with pytest.raises(ValueError, match="can only grow"):
            model.resize_vocab(bad)
