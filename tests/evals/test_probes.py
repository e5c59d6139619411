"""The copy probe (moved here from benchmarks/bench_chat_tasks.py): a copier scores ~0 on the second occurrence."""

import math

import pytest
import torch

from lmforge.evals.probes import copy_probe


class _Copier(torch.nn.Module):
    """Predicts, ``length`` positions into the input, the id that followed the same position one period earlier;
    before that, nothing (uniform logits)."""

    def __init__(self, vocab: int, length: int, copies: bool = True) -> None:
        super().__init__()
        self.vocab, self.length, self.copies = vocab, length, copies
        self.w = torch.nn.Parameter(torch.zeros(()))  # a device for the probe

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        R, P = ids.shape
        logits = torch.zeros(R, P, self.vocab)
        if self.copies:
            for t in range(self.length - 1, P):  # position t predicts id t + 1 = id t + 1 - length
                logits[torch.arange(R), t, ids[:, t + 1 - self.length]] = 50.0
        return logits


def test_copy_probe_tells_a_copier_from_a_model_that_cannot_copy():
    first, second = copy_probe(_Copier(100, 20), 100, rows=3, length=20)
    assert first == pytest.approx(math.log(100)) and second == pytest.approx(0.0, abs=1e-6)
    first, second = copy_probe(_Copier(100, 20, copies=False), 100, rows=3, length=20)
    assert first == pytest.approx(math.log(100)) and second == pytest.approx(math.log(100))


def test_copy_probe_rejects_bad_sizes():
    with pytest.raises(ValueError, match="length >= 2"):
        copy_probe(_Copier(100, 1), 100, length=1)
