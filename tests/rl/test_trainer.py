"""``lmforge rl`` end to end: it learns from the reward, resumes bit for bit (in process and after SIGKILL), gives
the same steps on two ranks as on one, trains LoRA adapters, applies the KL penalty, and refuses bad input."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from rl_helpers import chat_run, rl_tasks  # noqa: F401  (fixtures)
from lmforge import cli
from lmforge.checkpoint import read_checkpoint
from lmforge.rl import rl

SMALL = ("training.max_steps=6", "rl.prompts_per_step=4", "rl.samples_per_prompt=4", "rl.max_new_tokens=12",
         "rl.eval_samples=4", "training.num_threads=1", "optimizer.lr=1e-2", "training.checkpoint_every=2",
         "rl.prompts_per_decode=2")
_TIMING = ("tokens_per_s", "rollout_seconds", "mfu")
# LoRA with dropout and a KL penalty: the reference model is built after the resume restored the RNG
LORA_KL = ("lora.rank=4", "lora.alpha=8", "lora.dropout=0.1", "rl.kl_coef=0.5")


def _steps(run: Path) -> list[dict]:
    """Every logged step without its timings (which differ between runs); the rest must match exactly."""
    return [{k: v for k, v in e.items() if k not in _TIMING}
            for e in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in e]


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return read_checkpoint(sorted((run / "checkpoints").glob("step_*.safetensors"))[-1]).model


def test_rl_end_to_end_learns_from_the_reward_and_reports_before_and_after(chat_run, rl_tasks, tmp_path,
                                                                          capsys) -> None:
    """The format reward (end with <|assistant_end|>) rises; every step logs reward, reply length and tool-call
    share; rl.json and the run card hold greedy exact match, pass@1 and pass@k before and after, with intervals."""
    out = tmp_path / "rl"
    argv = ["-q", "rl", "--base", str(chat_run), "--data", str(rl_tasks["train"]), "--val-data", str(rl_tasks["val"]),
            "--run-dir", str(out), "--no-progress", "--set", "rl.reward=format", "--set", "rl.temperature=2.5"]
    for s in SMALL:
        argv += ["--set", s]
    assert cli.main(argv) == 0
    line = capsys.readouterr().out
    assert re.search(r"step 6; 200 prompts \(0 skipped.*greedy exact match \d+\.\d% \[\d+\.\d, \d+\.\d\] -> ", line)
    steps = _steps(out)
    assert [s["step"] for s in steps] == list(range(1, 7))
    for s in steps:
        assert 0 <= s["reward"] <= 1 and s["reply_tokens"] > 0 and 0 <= s["tool_call_share"] <= 1
        assert s["reward"] == s["ended_share"]  # the format reward is the share of replies that ended
    # tokens (and so tokens/s and MFU) count the positions the update ran: 16 rollouts padded to their longest,
    # far fewer than 16 rows of the whole context (what a full step would run, and what was counted before)
    context = int(re.search(r"context_length: (\d+)", (out / "config.yaml").read_text())[1])
    ran = [b["tokens"] - a["tokens"] for a, b in zip([{"tokens": 0}, *steps], steps)]
    assert all(0 < n < 16 * context / 2 for n in ran) and len(set(ran)) > 1, (ran, context)
    rewards = [s["reward"] for s in steps]
    # at temperature 2.5 the SFT model ends 5/8 of its replies at step 1, and 0.81, 0.81, 0.88 at the last three
    # (with the learning rate at 1e-9, 0.69, 0.81, 0.56: the rise is the gradient's, not the seeds')
    assert rewards[0] < 0.95 and min(rewards[-3:]) > rewards[0], rewards
    res = json.loads((out / "rl.json").read_text())
    for when in ("before", "after"):
        for key in ("greedy_exact_match", "pass_at_1", "pass_at_k"):
            v = res[when][key]
            assert v["ci"][0] <= v["value"] <= v["ci"][1]
        assert res[when]["n"] == 16 and res[when]["k"] == 4 and set(res[when]["tasks"]) == {"add", "calculator"}
    assert res["before"]["step"] == 40 and res["after"]["step"] == 6
    card = (out / "report.md").read_text()
    assert "## Reinforcement learning" in card and "| pass@k |" in card and "calculator: greedy exact match" in card
    cfg = (out / "config.yaml").read_text()
    assert "kind: prompts" in cfg and "global_batch_size: 16" in cfg
    assert json.loads((out / "base.json").read_text())["run"] == str(chat_run)
    capsys.readouterr()
    assert cli.main(["-q", "eval", str(out)]) == 2  # no text to take a loss on: said in one line
    assert "is an RL run" in capsys.readouterr().err
    assert cli.main(["-q", "eval", str(out), "--task", str(rl_tasks["val"])]) == 0  # read as any run
    assert "exact_match" in capsys.readouterr().out


@pytest.fixture(scope="module")
def small_run(chat_run, rl_tasks, tmp_path_factory) -> Path:
    """An uninterrupted run of :data:`SMALL` (6 steps, checkpoints every 2): what a resumed run must equal."""
    out = tmp_path_factory.mktemp("rl_small") / "full"
    rl(chat_run, rl_tasks["train"], out, overrides=SMALL, progress=False)
    return out


def test_resume_in_process_equals_uninterrupted(small_run, chat_run, rl_tasks, tmp_path) -> None:
    full, split = small_run, tmp_path / "split"
    rl(chat_run, rl_tasks["train"], split, overrides=SMALL + ("training.max_steps=3",), progress=False)  # ckpt at 2, 3
    (split / "checkpoints" / "step_00000003.safetensors").unlink()  # resume from 2: step 3's rollouts drawn again
    rl(chat_run, rl_tasks["train"], split, overrides=SMALL, progress=False)
    assert _steps(split) == _steps(full) and len({s["loss"] for s in _steps(full)}) > 1
    a, b = _weights(split), _weights(full)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_lora_rl_trains_adapters_only_and_resumes_exactly(chat_run, rl_tasks, tmp_path) -> None:
    """With LoRA dropout (the one consumer of torch's RNG while training) and the KL penalty (whose reference model
    is built after the resume restored the RNG): the resumed run draws the same dropout masks as the full run."""
    lora = SMALL + LORA_KL + ("training.max_steps=4",)
    full, split = tmp_path / "full", tmp_path / "split"
    rl(chat_run, rl_tasks["train"], full, overrides=lora, progress=False)
    rl(chat_run, rl_tasks["train"], split, overrides=lora + ("training.max_steps=2",), progress=False)
    rl(chat_run, rl_tasks["train"], split, overrides=lora, progress=False)
    assert _steps(split) == _steps(full) and _steps(full)[-1]["kl"] != 0.0
    w = _weights(full)
    assert w and all(k.endswith((".lora_A", ".lora_B")) for k in w)
    assert any(float(v.abs().sum()) > 0 for k, v in w.items() if k.endswith(".lora_B"))  # the adapters moved
    assert json.loads((full / "base.json").read_text())["lora"]["rank"] == 4


def test_kl_penalty_is_zero_at_the_start_and_changes_the_steps(chat_run, rl_tasks, tmp_path) -> None:
    rl(chat_run, rl_tasks["train"], tmp_path / "kl", overrides=SMALL + ("rl.kl_coef=0.5", "training.max_steps=3"),
       progress=False)
    rl(chat_run, rl_tasks["train"], tmp_path / "plain", overrides=SMALL + ("training.max_steps=3",), progress=False)
    kl, plain = _steps(tmp_path / "kl"), _steps(tmp_path / "plain")
    assert kl[0]["kl"] == 0.0 and kl[0]["loss"] == plain[0]["loss"]  # the policy is the reference at step 1
    assert kl[1]["kl"] != 0.0 and kl[2]["loss"] != plain[2]["loss"] and "kl" not in plain[0]


# --------------------------------------------------------------------------------------------------
# A real SIGKILL and restart, and two ranks under torchrun
# --------------------------------------------------------------------------------------------------
_SLOW_MAIN = """
import sys, time
from lmforge.rl import source
draw = source.RolloutSource._draw
def slow(self, step):  # sleeping changes no number; it keeps the run alive long enough to be killed mid-way
    time.sleep(float(sys.argv[1]))
    return draw(self, step)
source.RolloutSource._draw = slow
from lmforge.cli import main
sys.exit(main(sys.argv[2:]))
"""


def _rl_cmd(chat_run: Path, rl_tasks: dict, run_dir: Path, *sets: str) -> list[str]:
    cmd = ["-q", "rl", "--base", str(chat_run), "--data", str(rl_tasks["train"]), "--run-dir", str(run_dir),
           "--no-progress"]
    for s in sets:
        cmd += ["--set", s]
    return cmd


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("extra", [(), LORA_KL], ids=["full", "lora-dropout-kl"])
def test_sigkill_and_restart_equals_uninterrupted(small_run, chat_run, rl_tasks, tmp_path, extra) -> None:
    """Killed between checkpoints (after step 3 was logged, checkpoints every 2), restarted: the same rollouts,
    rewards, losses and weights as a run that never stopped (``small_run``, or the same settings in this
    process)."""
    import signal
    import subprocess
    import sys
    import time

    sets = SMALL + extra
    if extra:
        small_run = tmp_path / "full"
        rl(chat_run, rl_tasks["train"], small_run, overrides=sets, progress=False)
    script = tmp_path / "slow_main.py"
    script.write_text(_SLOW_MAIN)
    start = lambda run, delay: subprocess.Popen(  # noqa: E731
        [sys.executable, str(script), str(delay), *_rl_cmd(chat_run, rl_tasks, run, *sets)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    killed = tmp_path / "killed"
    proc = start(killed, 0.3)
    try:
        metrics, deadline = killed / "metrics.jsonl", time.time() + 150
        while time.time() < deadline:
            if metrics.exists() and any(json.loads(ln).get("step", 0) >= 3
                                        for ln in metrics.read_text().splitlines() if ln.endswith("}")):
                break
            assert proc.poll() is None, proc.stderr.read().decode()
            time.sleep(0.005)
        else:
            pytest.fail("the run to be killed logged no step 3 within 150 s")
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
        assert 3 <= _steps(killed)[-1]["step"] < 6
        proc = start(killed, 0.0)
        assert proc.wait(timeout=150) == 0, proc.stderr.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert [s["step"] for s in _steps(killed)] == list(range(1, 7))
    assert _steps(killed) == _steps(small_run)  # rewards, reply lengths, tool calls and losses, bit for bit
    a, b = _weights(killed), _weights(small_run)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torchrun_two_ranks_equal_one_process(chat_run, rl_tasks, tmp_path) -> None:
    """2 ranks x 2 prompts sample the same replies per step as 1 process x 4 (whole decode chunks of the global
    prompt slots; step 2 samples from the updated weights), so rewards and reply figures are equal and losses
    equal to float summation order."""
    import subprocess
    import sys

    sets = SMALL + ("training.max_steps=2", "optimizer.name=sgd", "optimizer.lr=0.5", "optimizer.grad_clip=0")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "lmforge.cli",
           *_rl_cmd(chat_run, rl_tasks, tmp_path / "ddp", *sets)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr
    rl(chat_run, rl_tasks["train"], tmp_path / "single", overrides=sets, progress=False)
    ddp, single = _steps(tmp_path / "ddp"), _steps(tmp_path / "single")
    assert [s["step"] for s in ddp] == [1, 2]
    for a, b in zip(ddp, single):
        assert {k: a[k] for k in ("reward", "reply_tokens", "tool_call_share", "ended_share")} == \
               {k: b[k] for k in ("reward", "reply_tokens", "tool_call_share", "ended_share")}
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7)
    a, b = _weights(tmp_path / "ddp"), _weights(tmp_path / "single")
    for k in a:  # SGD: the update is the gradient, equal to float summation order
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6)


# --------------------------------------------------------------------------------------------------
# Bad input: one line, exit 2, nothing written
# --------------------------------------------------------------------------------------------------
_BAD_FILES = {
    "noanswer.jsonl": '{"messages": [{"role": "user", "content": "1+1?"}]}\n',
    "choice.jsonl": '{"context": "a", "choices": [" b", " c"], "gold": 0}\n',
    "blank.jsonl": '{"messages": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": " "}]}\n',
}


@pytest.mark.parametrize("argv, pattern", [
    ("--set rl.reward=regex", r"rl\.reward' must be one of 'exact_match', 'format', got 'regex'"),
    ("--set rl.samples_per_prompt=1", r"rl\.samples_per_prompt=1: an advantage is a reward minus its group's mean, "
                                      r"which is always 0"),
    ("--set rl.temperature=0", r"rl\.temperature must be a finite number > 0"),
    ("--set rl.top_p=0", r"rl\.top_p must be in \(0, 1\]"),
    ("--set rl.kl_coef=-1", r"rl\.kl_coef must be a finite number >= 0"),
    ("--set rl.prompts_per_step=4 --set rl.prompts_per_decode=3", r"rl\.prompts_per_decode=3 must divide"),
    ("--set rl.max_new_tokens=64", r"every prompt is too long to leave rl\.max_new_tokens=64"),
    ("--set rl.samplesperprompt=4", r"did you mean 'rl\.samples_per_prompt'"),
    ("--data {tmp}/noanswer.jsonl", r"noanswer\.jsonl:1: .*rl --data needs chat items with exact answers"),
    ("--data {tmp}/choice.jsonl", r"holds choice items, not chat items with exact answers"),
    ("--data {tmp}/blank.jsonl", r"blank\.jsonl:1: message 1 \(assistant\) has empty content"),
    ("--data {tmp}/nope.jsonl", r"input file .*nope\.jsonl does not exist"),
    ("--base {plain}", r"is not a chat model: its tokenizer lacks the chat tokens .*lmforge sft --base"),
    ("--run-dir {base}/inside", r"--run-dir .*inside is inside .*, which this command reads"),
    ("--run-dir {tmp}/notes", r"not an lmforge run directory; .* --force"),
])
def test_bad_input_one_line_exit_2_nothing_written(chat_run, rl_tasks, tmp_path, capsys, argv, pattern) -> None:
    for name, text in _BAD_FILES.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "mine.txt").write_text("keep")
    plain = chat_run.parent / "base"
    args = argv.format(tmp=tmp_path, plain=plain, base=chat_run).split()
    for flag, value in (("--base", chat_run), ("--data", rl_tasks["train"]), ("--run-dir", tmp_path / "out")):
        if flag not in args:
            args += [flag, str(value)]
    before = {p: p.stat().st_mtime_ns for p in chat_run.parent.rglob("*") if p.is_file()}
    rc = cli.main(["-q", "rl", *args, "--no-progress", "--set", "rl.max_new_tokens=12"] if "max_new_tokens" not in argv
                  else ["-q", "rl", *args, "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert re.search(pattern, err), err
    assert not (tmp_path / "out").exists() and not (chat_run / "inside").exists()
    assert {p: p.stat().st_mtime_ns for p in chat_run.parent.rglob("*") if p.is_file()} == before
    assert [p.name for p in (tmp_path / "notes").iterdir()] == ["mine.txt"]


@pytest.mark.parametrize("change", ["rl.reward=format", "rl.samples_per_prompt=8"])
def test_resuming_with_another_reward_or_k_is_refused(chat_run, rl_tasks, tmp_path, capsys, change) -> None:
    out = tmp_path / "rl"
    rl(chat_run, rl_tasks["train"], out, overrides=SMALL + ("training.max_steps=2",), progress=False)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    argv = ["-q", "rl", "--base", str(chat_run), "--data", str(rl_tasks["train"]), "--run-dir", str(out),
            "--no-progress"]
    for s in SMALL + (change,):
        argv += ["--set", s]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    key = change.split("=")[0].replace(".", r"\.")
    assert len(err.strip().splitlines()) == 1 and re.search(rf"incompatible config \(.*{key}: ", err), err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_changed_data_on_resume_is_refused(chat_run, rl_tasks, tmp_path) -> None:
    data = tmp_path / "train.jsonl"
    data.write_bytes(rl_tasks["train"].read_bytes())
    out = tmp_path / "rl"
    rl(chat_run, data, out, overrides=SMALL + ("training.max_steps=2",), progress=False)
    with open(data, "a", encoding="utf-8") as f:
        f.write(json.dumps({"messages": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]})
                + "\n")
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(ValueError, match=r"train data .* changed since this run started"):
        rl(chat_run, data, out, overrides=SMALL, progress=False)
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none visible to torch)")
def test_rl_on_cuda_samples_trains_and_resumes(chat_run, rl_tasks, tmp_path) -> None:
    """On CUDA the rollouts take the engine's PyTorch path with per-row CUDA generators; bf16 autocast trains; a
    resumed run continues from its checkpoint (CUDA kernels need not be bit-reproducible, so steps are compared
    up to the checkpoint only)."""
    cuda = SMALL + ("training.device=cuda", "training.dtype=bf16", "training.num_threads=null", "training.max_steps=4")
    full, split = tmp_path / "full", tmp_path / "split"
    rl(chat_run, rl_tasks["train"], full, overrides=cuda, progress=False)
    rl(chat_run, rl_tasks["train"], split, overrides=cuda + ("training.max_steps=2",), progress=False)
    rl(chat_run, rl_tasks["train"], split, overrides=cuda, progress=False)
    assert [s["step"] for s in _steps(full)] == [1, 2, 3, 4] == [s["step"] for s in _steps(split)]
    assert all(math.isfinite(s["loss"]) and 0 <= s["reward"] <= 1 for s in _steps(split))
    assert _steps(split)[0]["reward"] == _steps(full)[0]["reward"]  # the same seeds, the same starting weights
