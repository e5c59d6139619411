"""``lmforge eval --task``, run cards and ``lmforge report`` end to end on a real (tiny) trained run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from lmforge import cli
from lmforge.evals import read_results, wilson_interval
from lmforge.report import compare_runs, write_run_card


@pytest.fixture
def run(tmp_path: Path, tiny_run: Path) -> Path:
    """A private copy of the session's tiny run (evals and cards write into the run directory)."""
    return Path(shutil.copytree(tiny_run, tmp_path / "run"))


def _task(tmp_path: Path, rows: list) -> Path:
    p = tmp_path / "task.jsonl"
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return p


ITEMS = [{"context": "The cat sat on the", "choices": [" mat", " dog ran", " happy"], "gold": k % 3} for k in range(5)]


def test_eval_task_prints_accuracy_with_interval_records_it_and_writes_the_card(run, tmp_path, capsys):
    task = _task(tmp_path, ITEMS)
    assert cli.main(["eval", str(run), "--task", str(task), "--batch-size", "2"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("task (choice, 5 items): acc ") and "(95% Wilson interval)" in line
    (r,) = read_results(run)
    k = round(r["acc"] * 5)
    assert r["acc_ci"] == list(wilson_interval(k, 5)) and r["step"] == 4 and r["n"] == 5
    card = json.loads((run / "report.json").read_text())
    assert card["evals"][0]["task"] == "task" and card["checkpoint"]["step"] == 4
    assert card["tokenizer"]["fingerprint"] == card["data"]["tokenizer_fingerprint"]
    assert card["data"]["shards"] and all(len(h) == 64 for h in card["data"]["shards"].values())
    md = (run / "report.md").read_text()
    assert "| task | acc |" in md and "(loss.png)" in md and (run / "loss.png").is_file()
    assert "## Samples" in md and len(card["samples"]) == 2
    # --json, --limit: the same numbers as a JSON list; a second result is appended
    assert cli.main(["eval", str(run), "--task", str(task), "--limit", "2", "--json", "--no-card"]) == 0
    (j,) = json.loads(capsys.readouterr().out)
    assert j["n"] == 2 and len(read_results(run)) == 2


def test_eval_without_task_keeps_the_validation_loss(run, capsys):
    assert cli.main(["eval", str(run), "--batches", "1"]) == 0
    assert "perplexity" in capsys.readouterr().out and (run / "report.md").is_file()


def test_eval_of_each_task_type(run, tmp_path, capsys):
    text = tmp_path / "docs.jsonl"
    text.write_text(json.dumps({"text": "the cat sat on the mat. " * 20}) + "\n")
    txt = tmp_path / "plain.txt"
    txt.write_text("a dog ran to the house.<|endoftext|>the sun was big.")
    cloze = tmp_path / "cloze.jsonl"
    cloze.write_text(json.dumps({"context": "the cat sat on the", "continuation": " mat"}) + "\n")
    assert cli.main(["eval", str(run), "--task", str(text), "--task", str(txt), "--task", str(cloze),
                     "--no-card", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert [r["type"] for r in res] == ["text", "text", "cloze"]
    assert all(r["bpb"] > 0 for r in res) and res[1]["n"] == 2


def test_eval_on_a_shard_directory(run, tiny_run, capsys):
    shards = tiny_run.parent / "shards"
    assert cli.main(["eval", str(run), "--task", str(shards), "--limit", "8", "--no-card"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("shards (text, 256 tokens): loss ")


@pytest.mark.parametrize("argv, match", [
    (["--task", "{tmp}/bad.jsonl"], r"bad\.jsonl:2: a multiple-choice item needs at least 2 choices, got 1"),
    (["--task", "{tmp}/junk.jsonl"], r"junk\.jsonl:1: not valid JSON"),
    (["--task", "no-such-task"], r"unknown task 'no-such-task': give a task JSONL file"),
    (["--task", "{tmp}/missing.jsonl"], r"task file .*missing\.jsonl does not exist"),
    (["--task", "{tmp}/bad.jsonl", "--split", "val"], r"--split and --batches apply to the validation loss"),
    (["--task", "{tmp}/bad.jsonl", "--limit", "0"], r"--limit: expected a positive integer"),
    (["--task", "{tmp}"], r"is a directory without manifest\.json"),
    (["--task", "{tmp}/chat.jsonl"], r"^lmforge: error: chat is a chat task but .*run is not a chat model .*"
                                     r"fine-tune it first with `lmforge sft --base .*run --data CHATS\.jsonl "
                                     r"--run-dir OUT`, then evaluate OUT$"),
])
def test_eval_bad_input_is_one_line_and_exit_2(run, tmp_path, capsys, argv, match):
    import re

    (tmp_path / "bad.jsonl").write_text(json.dumps(ITEMS[0]) + "\n" + json.dumps(
        {"context": "x", "choices": [" a"], "gold": 0}) + "\n")
    (tmp_path / "junk.jsonl").write_text("{nope\n")
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "1+1="},
                                                                  {"role": "assistant", "content": "2"}]}) + "\n")
    before = sorted(p.name for p in run.iterdir())
    try:
        code = cli.main(["eval", str(run), *[a.format(tmp=tmp_path) for a in argv]])
    except SystemExit as e:  # argparse's own errors
        code = e.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(match, err), err
    assert sorted(p.name for p in run.iterdir()) == before  # nothing written


def test_report_compares_runs_side_by_side(run, tmp_path, capsys):
    other = Path(shutil.copytree(run, tmp_path / "other"))
    task = _task(tmp_path, ITEMS)
    assert cli.main(["eval", str(other), "--task", str(task), "--no-card"]) == 0
    out_md = tmp_path / "cmp.md"
    assert cli.main(["report", str(run), str(other), "--out", str(out_md)]) == 0
    text = capsys.readouterr().out
    assert "|  | run | other |" in text and "| task acc | n/a | " in text and out_md.read_text() in text
    assert (run / "report.md").is_file() and (other / "report.json").is_file()
    assert cli.main(["report", str(run), "--out", str(out_md), "--no-card"]) == 2  # exists: refused
    assert "already exists" in capsys.readouterr().err
    assert compare_runs([run], out=out_md, force=True).startswith("# lmforge runs compared")


def test_run_card_records_base_run_and_skips_samples(run):
    from lmforge.run import write_base
    write_base(run, {"run": "/runs/base", "checkpoint": "/runs/base/checkpoints/step_00000004.safetensors",
                     "sha256": "ab" * 32, "lora": None})
    path = write_run_card(run, samples=0)
    card = json.loads((run / "report.json").read_text())
    assert card["base_run"]["run"] == "/runs/base" and "samples" not in card
    assert "/runs/base" in path.read_text() and "## Samples" not in path.read_text()
