"""Midtraining (``lmforge midtrain``): the base's shards mixed with chat conversations, every token trained, the one
loop's checkpoints and exact resume after SIGKILL."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import yaml

from lmforge import cli
from lmforge.chat import ChatFormat, add_chat_tokens, load_conversations
from lmforge.data.conversations import ConversationDataset
from lmforge.tokenizer import Tokenizer


def _write_convs(path: Path, n: int, seed: int) -> Path:
    """Short conversations, every other one through the calculator (a tool call and its output)."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for k in range(n):
            a, b = rng.randint(0, 99), rng.randint(0, 9)
            msgs = [{"role": "user", "content": f"{a}+{b}?"}]
            if k % 2:
                msgs += [{"role": "assistant", "content": "", "tool_call": f"{a}+{b}"},
                         {"role": "tool", "content": str(a + b)}]
            f.write(json.dumps({"messages": msgs + [{"role": "assistant", "content": str(a + b)}]}) + "\n")
    return path


@pytest.fixture(scope="module")
def convs(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("mid_convs")
    return {"train": _write_convs(d / "train.jsonl", 40, 0), "val": _write_convs(d / "val.jsonl", 8, 1)}


SETS = ("training.max_steps=6", "training.log_every=1", "training.checkpoint_every=3", "training.eval_every=3",
        "optimizer.warmup_steps=2", "data.copy_fraction=0.2", "data.copy_span=[3, 5]")


def _argv(base: Path, convs: dict, out: Path, *sets: str, extra: tuple[str, ...] = ()) -> list[str]:
    argv = ["-q", "midtrain", "--base", str(base), "--data", str(convs["train"]), "--val-data", str(convs["val"]),
            "--run-dir", str(out), "--chat-fraction", "0.5", "--no-progress", *extra]
    for s in sets:
        argv += ["--set", s]
    return argv


def _losses(run: Path) -> list[tuple[int, float, float]]:
    return [(e["step"], e["loss"], e.get("copy_data_share", -1.0))
            for e in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in e]


def test_midtrain_cli_mixes_shards_and_trains_every_token(tiny_run, convs, tmp_path, capsys) -> None:
    out = tmp_path / "mid"
    assert cli.main(_argv(tiny_run, convs, out, *SETS)) == 0
    assert "conversations mixed in" in capsys.readouterr().out
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    base = yaml.safe_load((tiny_run / "config.yaml").read_text())
    assert cfg["sft"]["pretrain_mix"] == 0.5 and cfg["sft"]["pretrain_dir"] == base["data"]["dir"]
    assert cfg["optimizer"]["name"] == base["optimizer"]["name"] and cfg["optimizer"]["schedule"] == "wsd"
    assert cfg["optimizer"]["lr"] == base["optimizer"]["lr"] and cfg["data"]["copy_fraction"] == 0.2
    ds = ConversationDataset(out / "sft_data", "train")
    assert ds.info["targets"] == "all" and ds.mask.all() and len(ds) == 40  # every token a target
    fmt = ChatFormat(add_chat_tokens(Tokenizer.load(tiny_run / "tokenizer.json")))
    rendered = [fmt.render(m)[0] for m in load_conversations(convs["train"])]
    assert [list(ds.ids[ds.offsets[k]:ds.offsets[k + 1]]) for k in range(len(ds))] == rendered  # the one renderer
    assert fmt.ids["<|python_start|>"] in rendered[1]  # tool calls among them
    losses = _losses(out)
    assert [s for s, _, _ in losses] == list(range(1, 7)) and all(0 < c < 0.5 for _, _, c in losses)
    # the assistant's tokens only: other targets, other losses
    assistant = tmp_path / "assistant"
    assert cli.main(_argv(tiny_run, convs, assistant, *SETS, extra=("--targets", "assistant"))) == 0
    mask = ConversationDataset(assistant / "sft_data", "train").mask
    assert 0 < mask.sum() < len(mask) and _losses(assistant) != losses
    # started as one, resumed only as the same: other targets are refused, nothing rewritten
    before = (out / "sft_data" / "train_mask.npy").read_bytes()
    assert cli.main(_argv(tiny_run, convs, out, *SETS, extra=("--targets", "assistant"))) == 2
    assert "started training the all tokens" in capsys.readouterr().err
    assert (out / "sft_data" / "train_mask.npy").read_bytes() == before


@pytest.mark.parametrize("argv_of, pattern", [
    (lambda b, c, o: ["0" if a == "0.5" else a for a in _argv(b, c, o)], r"--chat-fraction: must be in \(0, 1\]"),
    (lambda b, c, o: _argv(b, c, o, "sft.pretrain_mix=1.5"), r"sft\.pretrain_mix must be in \[0, 1\)"),
    (lambda b, c, o: _argv(b, c, o, "data.copy_fraction=0.9"), r"data\.copy_fraction must be"),
])
def test_bad_input_one_line_exit_2_nothing_written(tiny_run, convs, tmp_path, capsys, argv_of, pattern) -> None:
    out = tmp_path / "mid"
    try:
        code = cli.main(argv_of(tiny_run, convs, out))
    except SystemExit as e:  # a flag argparse refuses
        code = e.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(pattern, err), err
    assert not out.exists()


def test_a_folder_that_is_not_a_run_is_not_overwritten_without_force(tiny_run, convs, tmp_path, capsys) -> None:
    out = tmp_path / "notes"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert cli.main(_argv(tiny_run, convs, out, "training.max_steps=2", "optimizer.warmup_steps=1")) == 2
    assert "--force" in capsys.readouterr().err and sorted(p.name for p in out.iterdir()) == ["keep.txt"]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sigkill_and_restart_equals_uninterrupted(tiny_run, convs, tmp_path) -> None:
    from test_sft import _SLOW_MAIN, kill_and_restart  # the conversation rows slowed: a mixed batch waits for them

    sets = SETS + ("training.max_steps=16", "training.checkpoint_every=4", "training.eval_every=8")
    script = tmp_path / "slow_main.py"
    script.write_text(_SLOW_MAIN)
    full, killed = tmp_path / "full", tmp_path / "killed"
    kill_and_restart(script, lambda run: _argv(tiny_run, convs, run, *sets), full, killed, 6, 16)  # ckpts 4, 8
    assert [s for s, _, _ in _losses(killed)] == list(range(1, 17))
    assert _losses(killed) == _losses(full)  # bit for bit, the copy share too
