"""Run directories: what counts as one, what training may write into, how readers open one."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from lmforge.checkpoint import CheckpointManager
from lmforge.common import atomic_write_text, remove_stale_temporaries, temporary_target
from lmforge.run import MARKER, check_new_or_run, is_run_dir, mark, require_run


def test_what_training_may_write_into(tmp_path: Path) -> None:
    assert check_new_or_run(tmp_path / "new") == tmp_path / "new"
    (tmp_path / "empty").mkdir()
    check_new_or_run(tmp_path / "empty")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "metrics.jsonl").write_text("{}")
    with pytest.raises(ValueError, match=r"mine is not empty \(metrics\.jsonl\) and is not an lmforge run"):
        check_new_or_run(tmp_path / "mine")
    check_new_or_run(tmp_path / "mine", force=True)
    mark(tmp_path / "mine")
    check_new_or_run(tmp_path / "mine")  # a run: resumed
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="is an existing file"):
        check_new_or_run(tmp_path / "f", force=True)


def test_a_run_from_before_the_marker_is_recognised_by_its_training_checkpoint(tmp_path: Path) -> None:
    run = tmp_path / "old"
    run.mkdir()
    (run / "config.yaml").write_text("model: {}\n")
    model = torch.nn.Linear(2, 2)
    CheckpointManager(run).save(model, None, 3, {"step": 3})  # not written by train: no training state
    assert not is_run_dir(run)
    CheckpointManager(run).save(model, None, 4, {"train": {"loader": {}, "rng": {}}})
    assert is_run_dir(run) and not (run / MARKER).exists()
    assert require_run(run) == run


def test_stale_temporaries_are_only_lmforges_own(tmp_path: Path) -> None:
    atomic_write_text(tmp_path / "config.yaml", "a: 1\n")
    ours = tmp_path / ".config.yaml.lmforge-abc123.tmp"
    other = tmp_path / ".loss.png.lmforge-x.tmp"
    for p in (ours, other, tmp_path / ".notes.tmp", tmp_path / ".config.yaml.abc.tmp"):
        p.write_text("half")
    assert temporary_target(ours) == "config.yaml" and temporary_target(tmp_path / ".notes.tmp") is None
    assert remove_stale_temporaries(tmp_path, ["config.yaml"]) == [ours]
    assert other.exists()
    assert remove_stale_temporaries(tmp_path) == [other]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".config.yaml.abc.tmp", ".notes.tmp", "config.yaml"]


def test_get_batch_refuses_bad_sizes() -> None:
    from lmforge.data import get_batch

    tokens = np.arange(100, dtype=np.uint16)
    for kw, name in (({"batch_size": -1}, "batch_size"), ({"batch_size": 0}, "batch_size"),
                     ({"context_length": 0}, "context_length"), ({"batch_size": 2.5}, "batch_size")):
        args = {"batch_size": 2, "context_length": 8, **kw}
        with pytest.raises(ValueError, match=rf"{name} must be a positive integer"):
            get_batch(tokens, **args)
    x, y = get_batch(tokens, 3, 8)
    assert x.shape == y.shape == (3, 8)
