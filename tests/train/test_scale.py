"""Scale-out: the global batch, elastic exact resume across world sizes (torchrun + gloo on CPU), sharded (DCP)
checkpoints and their consolidation, activation checkpointing.

Tolerance: runs that split a step's batch differently (world 1 vs 2, other micro-batches) sum the same
per-token losses in another order, so their losses agree to float32 rounding, not bit for bit: ``rel=1e-5``
(measured differences are ~1e-7). A resume at the *same* split is bit-exact (tests/train/test_train.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from lmforge import cli
from lmforge.train import load_run_config, train
from lmforge.train.batching import plan_batch
from lmforge.train.config import TrainingConfig
from test_train import _SLOW_MAIN, _cfg_dict, _losses, _make_shards

TOL = 1e-5


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return _make_shards(tmp_path_factory.mktemp("data"), 200)


def _scfg(data: Path, **training) -> dict:
    """A tiny run with a global batch of 8 sequences; ``training`` overrides (e.g. micro_batch_size)."""
    t = {"max_steps": 8, "global_batch_size": 8, "checkpoint_every": 3, "eval_every": 100, "keep_last": 5,
         "num_threads": 1, **training}
    return _cfg_dict(data, training=t)


def _train(d: dict, run: Path) -> dict:
    return train(load_run_config(base=d), run, progress=False)


def _approx(a: list, b: list) -> None:
    assert [s for s, _ in a] == [s for s, _ in b]
    assert [v for _, v in a] == pytest.approx([v for _, v in b], rel=TOL)


# --------------------------------------------------------------------------------------------------
# The batch plan
# --------------------------------------------------------------------------------------------------
def test_plan_batch_derives_micro_batch_and_accumulation() -> None:
    legacy = TrainingConfig(batch_size=4, grad_accum_steps=3)
    assert (plan_batch(legacy, 2).global_batch, plan_batch(legacy, 2).micro_batch, plan_batch(legacy, 2).accum_steps) \
        == (24, 4, 3)  # without global_batch_size the global batch grows with the world size
    g = TrainingConfig(global_batch_size=16, micro_batch_size=4)
    assert [(plan_batch(g, w).micro_batch, plan_batch(g, w).accum_steps) for w in (1, 2, 4)] == [(4, 4), (4, 2), (4, 1)]
    nocap = TrainingConfig(global_batch_size=16)
    assert [(plan_batch(nocap, w).micro_batch, plan_batch(nocap, w).accum_steps) for w in (1, 2)] == [(16, 1), (8, 1)]
    assert plan_batch(g, 2).tokens_per_step(32) == 16 * 32
    with pytest.raises(ValueError, match=r"global_batch_size=16 cannot be split over 3 processes; run with a world "
                                         r"size that divides it \(1, 2, 4, 8, 16\)"):
        plan_batch(g, 3)
    with pytest.raises(ValueError, match=r"8 sequences per rank, not a multiple of training.micro_batch_size=3; set "
                                         r"micro_batch_size to one of 1, 2, 4, 8"):
        plan_batch(TrainingConfig(global_batch_size=16, micro_batch_size=3), 2)
    with pytest.raises(ValueError, match="micro_batch_size only applies with training.global_batch_size"):
        TrainingConfig(micro_batch_size=2)
    with pytest.raises(ValueError, match=r"training.global_batch_size must be >= 1"):
        TrainingConfig(global_batch_size=0)


def test_global_batch_is_the_same_optimisation_for_any_micro_batch(shards, tmp_path) -> None:
    _train(_scfg(shards, max_steps=4), tmp_path / "one")  # 1 micro-batch of 8
    m = _train(_scfg(shards, max_steps=4, micro_batch_size=2), tmp_path / "four")  # 4 accumulated micro-batches of 2
    _approx(_losses(tmp_path / "four"), _losses(tmp_path / "one"))
    assert m["tokens"] == 4 * 8 * 32
    # the global batch is part of the run: another one is refused on resume, the micro-batch may change
    with pytest.raises(ValueError, match=r"training.global_batch_size: 8 -> 16"):
        _train(_scfg(shards, max_steps=6, global_batch_size=16), tmp_path / "one")
    _train(_scfg(shards, max_steps=5, micro_batch_size=4), tmp_path / "four")
    assert [s for s, _ in _losses(tmp_path / "four")] == [1, 2, 3, 4, 5]


def test_bad_global_batch_on_the_command_line(shards, tmp_path, capsys) -> None:
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(_scfg(shards)))
    rc = cli.main(["train", str(cfg), "--run-dir", str(tmp_path / "r"), "--no-progress",
                   "--set", "training.micro_batch_size=3"])
    err = capsys.readouterr().err
    assert rc == 2 and "not a multiple of training.micro_batch_size=3" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "r").exists()


# --------------------------------------------------------------------------------------------------
# Activation checkpointing
# --------------------------------------------------------------------------------------------------
def test_activation_checkpointing_gives_the_same_losses_and_names(shards, tmp_path) -> None:
    from lmforge.model import TransformerLM
    from lmforge.train.distributed import checkpoint_blocks

    _train(_scfg(shards, max_steps=3), tmp_path / "plain")
    _train(_scfg(shards, max_steps=3, activation_checkpointing=True), tmp_path / "ac")
    assert _losses(tmp_path / "ac") == _losses(tmp_path / "plain")  # the same arithmetic, recomputed
    cfg = load_run_config(base=_scfg(shards)).model
    model = TransformerLM(cfg)
    names = [n for n, _ in model.named_parameters()]
    assert checkpoint_blocks(model) == cfg.n_layers and [n for n, _ in model.named_parameters()] == names
    x = torch.randint(0, cfg.vocab_size, (2, 16))
    saved = []  # tensors autograd keeps for backward: with checkpointing only the blocks' inputs
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        model(x, targets=x).backward()
    plain = TransformerLM(cfg)
    saved_plain = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved_plain.append(t.numel()) or t, lambda t: t):
        plain(x, targets=x).backward()
    assert sum(saved) < sum(saved_plain)


# --------------------------------------------------------------------------------------------------
# Sharded checkpoints in one process
# --------------------------------------------------------------------------------------------------
def test_dcp_resume_in_process_and_consolidate(shards, tmp_path, capsys) -> None:
    from lmforge.checkpoint import read_checkpoint
    from lmforge.train import evaluate_run

    ref, run = tmp_path / "ref", tmp_path / "run"
    _train(_scfg(shards, max_steps=6), ref)
    _train(_scfg(shards, max_steps=4, checkpoint_format="dcp"), run)
    ck = run / "checkpoints"
    assert sorted(p.name for p in ck.iterdir()) == ["step_00000003.dcp", "step_00000004.dcp"]
    assert sorted(p.name for p in (ck / "step_00000004.dcp").iterdir()) == [
        ".metadata", "__0_0.distcp", "extra.safetensors", "lmforge-dcp.json"]
    (ck / ".step_00000005.dcp.partial").mkdir()  # a save killed half-way is never taken for a checkpoint
    _train(_scfg(shards, max_steps=6, checkpoint_format="dcp"), run)
    assert _losses(run) == _losses(ref)  # bit for bit: same split, resumed from the shards
    assert not (ck / ".step_00000005.dcp.partial").exists()

    with pytest.raises(ValueError, match="holds sharded checkpoints only .*`lmforge checkpoint consolidate"):
        evaluate_run(run, device="cpu")
    assert cli.main(["checkpoint", "consolidate", str(run)]) == 0
    assert "step_00000006.safetensors" in capsys.readouterr().out
    mine, theirs = read_checkpoint(ck / "step_00000006.safetensors"), read_checkpoint(
        ref / "checkpoints" / "step_00000006.safetensors")
    assert mine.iteration == 6 and mine.model.keys() == theirs.model.keys()
    assert all(torch.equal(mine.model[k], theirs.model[k]) for k in mine.model)
    assert mine.extra["train"]["loader"] == theirs.extra["train"]["loader"]
    assert evaluate_run(run, device="cpu")["step"] == 6  # every command reads the consolidated file
    # a consolidated file resumes a single-file run exactly
    _train(_scfg(shards, max_steps=7), run)
    _train(_scfg(shards, max_steps=7), ref)
    assert _losses(run) == _losses(ref)

    assert cli.main(["checkpoint", "consolidate", str(run), "--step", "6"]) == 2
    assert "already exists; pass --force" in capsys.readouterr().err
    assert cli.main(["checkpoint", "consolidate", str(run), "--step", "2"]) == 2
    assert "no sharded checkpoint of step 2; it has steps 3, 4, 6" in capsys.readouterr().err
    assert cli.main(["checkpoint", "consolidate", str(ref)]) == 2
    assert "holds no sharded checkpoint" in capsys.readouterr().err


def test_dcp_refuses_another_model_config_and_a_missing_shard(shards, tmp_path) -> None:
    from lmforge.model import ModelConfig, TransformerLM
    from lmforge.train.dcp import load_dcp

    run = tmp_path / "run"
    _train(_scfg(shards, max_steps=3, checkpoint_format="dcp"), run)
    path = run / "checkpoints" / "step_00000003.dcp"
    wider = TransformerLM(ModelConfig(vocab_size=320, context_length=32, d_model=64, n_layers=2, n_heads=2))
    with pytest.raises(ValueError, match=r"checkpoint tensor 'token_embeddings.weight' has shape \(320, 32\) but this "
                                         r"model's has \(320, 64\)"):
        load_dcp(path, wider)
    (path / "__0_0.distcp").unlink()
    with pytest.raises(ValueError, match=r"step_00000003.dcp is missing __0_0.distcp \(one of the 2 files DCP "
                                         r"wrote for 1 ranks\); copy it back"):
        _train(_scfg(shards, max_steps=5, checkpoint_format="dcp"), run)
    assert [s for s, _ in _losses(run)] == [1, 2, 3]  # nothing restarted from scratch


# --------------------------------------------------------------------------------------------------
# torchrun with 2 processes (gloo): elastic exact resume
# --------------------------------------------------------------------------------------------------
def _torchrun(script: Path, delay: float, cfg: Path, run: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
           str(delay), "-q", "train", str(cfg), "--run-dir", str(run), "--no-progress"]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)


def _plain(script: Path, delay: float, cfg: Path, run: Path) -> subprocess.Popen:
    cmd = [sys.executable, str(script), str(delay), "-q", "train", str(cfg), "--run-dir", str(run), "--no-progress"]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)


def _finish(p: subprocess.Popen, what: str, seconds: float = 150) -> None:
    try:
        rc = p.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        _sigkill_tree(p.pid)
        pytest.fail(f"{what} did not finish within {seconds} s; stderr:\n{p.stderr.read().decode()[-2000:]}")
    assert rc == 0, f"{what} failed:\n{p.stderr.read().decode()[-3000:]}"


def _children(pid: int) -> list[int]:
    """Process ids whose parent is ``pid`` (from /proc)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d.name))
    return out


def _sigkill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and its descendants: torchrun starts each rank in a session of its own, so killing
    torchrun's process group alone would leave the ranks running (a lost node takes them all)."""
    tree, i = [pid], 0
    while i < len(tree):
        tree += _children(tree[i])
        i += 1
    for p in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def _kill_at(procs: dict[str, tuple[subprocess.Popen, Path]], step: int) -> None:
    """SIGKILL each process and its whole process group (torchrun and its ranks) as soon as its run logged
    ``step``; all are watched at once, so none runs to its end while another is awaited."""
    left, deadline = dict(procs), time.time() + 150
    while left and time.time() < deadline:
        for what, (p, run) in list(left.items()):
            metrics = run / "metrics.jsonl"
            if metrics.exists() and any(json.loads(ln).get("step", 0) >= step
                                        for ln in metrics.read_text().splitlines() if ln.endswith("}")):
                assert p.poll() is None, f"{what} finished before it could be killed"
                _sigkill_tree(p.pid)
                p.wait(timeout=30)
                del left[what]
            elif p.poll() is not None:
                pytest.fail(f"{what} ended before step {step}:\n{p.stderr.read().decode()[-3000:]}")
        time.sleep(0.01)
    assert not left, f"{', '.join(left)} logged no step {step} within 150 s"


def _sample_state(run: Path) -> dict:
    """The loader position (epoch, global blocks consumed, data) of a run's last checkpoint, without the split."""
    from lmforge.train.dcp import read_dcp_extra, read_dcp_meta

    last = sorted((run / "checkpoints").glob("step_*.dcp"))[-1]
    state = read_dcp_extra(last, read_dcp_meta(last))["train"]["loader"]
    return {k: v for k, v in state.items() if k not in ("batch_size", "world_size")}


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_torchrun_elastic_resume_across_world_sizes(shards, tmp_path) -> None:
    """FSDP2 + sharded checkpoints + a global batch of 8. World 2 (micro-batch 2, 2 accumulation steps) equals
    world 1 (micro-batch 2, 4 steps) at every step; SIGKILL at world 2 then resume at world 1, and SIGKILL at
    world 1 then resume at world 2, both give the uninterrupted losses and the same sample sequence."""
    d = _scfg(shards, max_steps=8, micro_batch_size=2, parallel="fsdp", checkpoint_format="dcp")
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(d))
    script = tmp_path / "slow_main.py"
    script.write_text(_SLOW_MAIN)
    ref, w2, down, up = (tmp_path / n for n in ("ref", "w2", "down", "up"))
    procs = [_torchrun(script, 0.0, cfg, w2), _torchrun(script, 0.25, cfg, down), _plain(script, 0.25, cfg, up)]
    try:
        _kill_at({"the world-2 run": (procs[1], down), "the world-1 run": (procs[2], up)}, 4)  # checkpoint at 3
        logged = {run: _losses(run) for run in (down, up)}
        _train(d, ref)  # world 1, in this process
        assert {run: _losses(run) for run in (down, up)} == logged  # no rank outlived the kill
        _finish(procs[0], "the uninterrupted world-2 run")
        assert 4 <= max(s for s, _ in _losses(down)) < 8 and 4 <= max(s for s, _ in _losses(up)) < 8
        _train(d, down)  # resume at world 1
        resume = _torchrun(script, 0.0, cfg, up)  # resume at world 2
        procs.append(resume)
        _finish(resume, "the world-2 resume")
    finally:
        for p in procs:
            if p.poll() is None:
                _sigkill_tree(p.pid)
                p.wait()
    for run in (w2, down, up):
        _approx(_losses(run), _losses(ref))
        assert _sample_state(run) == _sample_state(ref)
    assert json.loads((down / "checkpoints" / "step_00000008.dcp" / "lmforge-dcp.json").read_text())["world_size"] == 1
    assert json.loads((up / "checkpoints" / "step_00000008.dcp" / "lmforge-dcp.json").read_text())["world_size"] == 2
    assert sorted(p.name for p in (up / "checkpoints" / "step_00000008.dcp").glob("*.distcp")) == [
        "__0_0.distcp", "__1_0.distcp"]  # each rank wrote its own shard
    # a world-2 sharded checkpoint consolidates in one plain process
    shutil.rmtree(w2 / "checkpoints" / "step_00000008.dcp")  # consolidate the step-6 one (written at world 2)
    assert cli.main(["checkpoint", "consolidate", str(w2), "--out", str(tmp_path / "w2.safetensors")]) == 0
    assert cli.main(["checkpoint", "consolidate", str(ref), "--step", "6", "--out", str(tmp_path / "ref.safetensors")]) == 0
    from lmforge.checkpoint import read_checkpoint
    got, want = read_checkpoint(tmp_path / "w2.safetensors"), read_checkpoint(tmp_path / "ref.safetensors")
    assert got.iteration == want.iteration == 6 and got.model.keys() == want.model.keys()
    for k in want.model:
        torch.testing.assert_close(got.model[k], want.model[k], rtol=1e-4, atol=1e-6)


def test_fsdp_with_activation_checkpointing_and_dcp_in_a_group_of_one(shards, tmp_path) -> None:
    """FSDP2 + activation checkpointing + sharded checkpoints at world size 1 (a process group of one): the
    plain run's losses; resumed from its shards in a plain process (no group), the same again."""
    import torch.distributed as dist

    from lmforge.train.distributed import setup_distributed

    _train(_scfg(shards, max_steps=5), tmp_path / "plain")
    setup_distributed("cpu", init_method=f"file://{tmp_path / 'pg'}")
    try:
        _train(_scfg(shards, max_steps=3, parallel="fsdp", activation_checkpointing=True, checkpoint_format="dcp"),
               tmp_path / "fsdp")
    finally:
        dist.destroy_process_group()
    _train(_scfg(shards, max_steps=5, activation_checkpointing=True, checkpoint_format="dcp"), tmp_path / "fsdp")
    _approx(_losses(tmp_path / "fsdp"), _losses(tmp_path / "plain"))
