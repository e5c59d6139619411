"""The speedrun pipeline end to end on a tiny synthetic corpus: artifacts, report sections, reuse, resume, errors."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
from unittest import mock

import pytest
import yaml
from conftest import make_corpus_text

import lmforge.corpus.chat_data as chat_data
from lmforge.speedrun import _chat_data_rules, _digest, parse_budget, speedrun
from lmforge.tokenizer import Tokenizer

SECTIONS = ["# lmforge speedrun report", "## Results", "final validation loss", "bits per byte", "training throughput",
            "MFU", "![loss curves](run/loss.png)", "## Time per stage", "## Tokenizer", "## Data", "| train |",
            "| val |", "## Samples", "**ROMEO:**", "## Configuration", "```yaml"]


@pytest.fixture
def corpus(tmp_path):
    p = tmp_path / "corpus.txt"
    p.write_text(make_corpus_text(n_docs=80, seed=1), encoding="utf-8")  # ~20 KB, 80 documents
    return p


def run(out, corpus, **kw):
    args = dict(corpus=str(corpus), model_size="tiny", budget="12steps", vocab_size=300, device="cpu",
                sample_tokens=16, progress=False, sft_budget=None, rl_budget=None)
    args.update(kw)
    return speedrun(out, **args)


def _interrupt_after_step_10(out):
    """Make ``out`` look like a 12-step speedrun interrupted after its step-10 checkpoint (before training ended)."""
    (out / "run/checkpoints/step_00000012.safetensors").unlink()
    state = json.loads((out / "speedrun.json").read_text())
    for stage in ("train", "eval", "samples"):
        del state["stages"][stage]
    (out / "speedrun.json").write_text(json.dumps(state))


@pytest.mark.slow
def test_speedrun_end_to_end_then_reuse_and_resume(tmp_path, corpus, caplog):
    out = tmp_path / "sr"
    stages = run(out, corpus)
    for rel in ("tokenizer.json", "data/manifest.json", "run/config.yaml", "run/tokenizer.json", "run/metrics.jsonl",
                "run/loss.png", "run/checkpoints/step_00000012.safetensors", "speedrun.json", "report.md"):
        assert (out / rel).is_file(), rel
    assert (out / "run/loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(stages) == {"tokenizer", "data", "plan", "train", "eval", "samples"}
    assert stages["tokenizer"]["vocab_size"] == 300
    assert stages["data"]["splits"]["train"]["documents"] + stages["data"]["splits"]["val"]["documents"] == 80
    assert stages["train"]["step"] == 12
    ev = stages["eval"]
    assert math.isfinite(ev["val_loss"]) and ev["val_loss"] < math.log(300)  # better than uniform: it learned
    assert ev["val_bpb"] == pytest.approx(ev["val_loss"] / math.log(2) / stages["data"]["splits"]["val"]["bytes_per_token"])
    assert len(stages["samples"]["samples"]) == 4 and stages["samples"]["generation_tokens_per_s"] > 0
    report = (out / "report.md").read_text(encoding="utf-8")
    for section in SECTIONS:
        assert section in report, section
    assert f"{ev['val_loss']:.4f}" in report
    # the context probes beside bits per byte: random ids in order and shuffled, validation text, a name
    for pair in (("copy_first", "copy_second", "copy_shuffled"), ("natural_first", "natural_second"),
                 ("name_first", "name_second")):
        assert all(0 < ev[k] < 2 * math.log(300) for k in pair), pair
    assert (f"| in-context copying: random ids given twice | {ev['copy_second'] / ev['copy_first']:.0%} of the first "
            f"occurrence's {ev['copy_first']:.2f} nats in order, {ev['copy_shuffled'] / ev['copy_first']:.0%} "
            "shuffled") in report
    assert (f"| in-context copying: validation text given twice | {ev['natural_second'] / ev['natural_first']:.0%} "
            f"({ev['natural_first']:.2f} -> {ev['natural_second']:.2f} nats) |") in report
    assert f"| in-context copying: a made-up name mentioned twice | {ev['name_second'] / ev['name_first']:.0%} (" in report
    # MFU names its denominator: the matmul peak measured in the precision the run trained in (auto resolved)
    dtype = stages["plan"]["peak_dtype"]
    assert dtype in ("fp32", "bf16") and f"vs the measured {dtype} matmul peak (" in report

    # Same command again: every stage is reused and the report says so.
    report_before = json.loads((out / "speedrun.json").read_text())
    run(out, corpus)
    assert "nothing (every stage was reused)" in (out / "report.md").read_text(encoding="utf-8")
    assert json.loads((out / "speedrun.json").read_text())["stages"] == report_before["stages"]

    # Training interrupted after step 10: the rerun resumes from that checkpoint, not from scratch.
    _interrupt_after_step_10(out)
    with caplog.at_level(logging.INFO, logger="lmforge"):
        stages = run(out, corpus)
    assert "resumed from" in caplog.text and "step_00000010" in caplog.text
    assert "stage tokenizer: reusing" in caplog.text and "stage data: reusing" in caplog.text
    assert stages["train"]["step"] == 12
    assert "ran: train, eval, samples" in (out / "report.md").read_text(encoding="utf-8")

    # Other settings in the same directory: refused unless --force.
    with pytest.raises(ValueError, match="other settings.*vocab_size"):
        run(out, corpus, vocab_size=320)
    stages = run(out, corpus, vocab_size=320, budget="4steps", force=True)
    assert stages["tokenizer"]["vocab_size"] == 320 and stages["train"]["step"] == 4
    assert not (out / "run/checkpoints/step_00000012.safetensors").exists()


def test_speedrun_chat_stages_fine_tune_and_score_before_and_after(tmp_path, corpus):
    """The chat stages on a tiny run: tasks from the corpus's words, the base scored, fine-tuned, scored again."""
    out = tmp_path / "sr"
    stages = run(out, corpus, budget="6steps", sft_budget="4steps", chat_eval_items=2)
    assert {"chat-data", "chat-base", "sft", "chat-sft"} <= set(stages)
    assert stages["sft"]["step"] == 4 and (out / "sft" / "base.json").is_file()
    base, after = stages["chat-base"], stages["chat-sft"]
    assert set(base["tasks"]) == set(after["tasks"]) and len(base["tasks"]) == 6
    assert all(t["n"] == 2 for t in after["tasks"].values())
    assert 0 <= after["accuracy"] <= 1 and 0 <= after["ended"] <= 1
    assert [m["role"] for m in after["conversation"][:2]] == ["user", "assistant"]
    report = (out / "report.md").read_text(encoding="utf-8")
    assert "## Chat: fine-tuned on the built-in tasks" in report and "| calculator |" in report
    assert f"`lmforge chat --run {out / 'sft'}`" in report  # a command that runs from where the speedrun ran
    val = (out / "chat-tasks" / "val.jsonl").read_text(encoding="utf-8").splitlines()
    train = set((out / "chat-tasks" / "train.jsonl").read_text(encoding="utf-8").splitlines())
    assert val and not train & set(val)
    again = run(out, corpus, budget="6steps", sft_budget="4steps", chat_eval_items=2)  # everything reused
    assert again["chat-sft"] == after
    settings = json.loads((out / "speedrun.json").read_text(encoding="utf-8"))["settings"]
    fingerprint = Tokenizer.load(out / "tokenizer.json").fingerprint()  # the vocabulary's words are spelled
    assert again["chat-data"]["key"] == _digest(settings["inputs"], _chat_data_rules(), fingerprint)  # the rules too
    assert 0 < again["chat-data"]["spelled_words"] and '"task": "spelling_bee"' in "\n".join(train)


def test_speedrun_midtrain_stage_takes_its_part_of_the_chat_budget(tmp_path, corpus):
    """With midtrain_budget the chat budget splits: midtraining (scored on the tasks and the corpus's bits per byte)
    then SFT from it; the report shows every stage's scores; a rerun reuses all; without it, SFT starts again from
    the pretrained run and the midtraining's records go."""
    out = tmp_path / "sr"
    stages = run(out, corpus, budget="6steps", sft_budget="6steps", midtrain_budget="2steps", chat_eval_items=2)
    assert stages["midtrain"]["step"] == 2 and stages["sft"]["step"] == 4
    mid = stages["chat-mid"]
    assert set(mid["tasks"]) == set(stages["chat-sft"]["tasks"]) and 0 < mid["val_bpb"] < 20
    assert mid["val_tokens"] == stages["eval"]["val_tokens"]  # the pretrained model's final figure's blocks
    assert json.loads((out / "sft" / "base.json").read_text())["run"] == str((out / "midtrain").absolute())
    mid_cfg = yaml.safe_load((out / "midtrain" / "config.yaml").read_text())
    assert mid_cfg["sft"]["pretrain_mix"] == 0.5 and mid_cfg["optimizer"]["name"] == "muon"  # the base's recipe
    report = (out / "report.md").read_text(encoding="utf-8")
    assert "| task | items | base | midtrained | SFT |" in report and "after midtraining:" in report
    again = run(out, corpus, budget="6steps", sft_budget="6steps", midtrain_budget="2steps", chat_eval_items=2)
    assert again == stages  # every stage reused
    auto = run(out, corpus, budget="6steps", sft_budget="6steps", midtrain_budget="auto", chat_eval_items=2)
    assert auto == stages  # auto: 40% of the 6 SFT steps, 2 (reused)
    plain = run(out, corpus, budget="6steps", sft_budget="6steps", chat_eval_items=2)
    assert "midtrain" not in plain and "chat-mid" not in plain and plain["sft"]["step"] == 6
    assert json.loads((out / "sft" / "base.json").read_text())["run"] == str((out / "run").absolute())
    assert "| midtrained |" not in (out / "report.md").read_text(encoding="utf-8")
    with pytest.raises(ValueError, match="a part of sft_budget"):
        run(out, corpus, budget="6steps", sft_budget="6steps", midtrain_budget="1min", chat_eval_items=2)


def test_chat_data_key_follows_the_teaching_rules(monkeypatch):
    """A speedrun directory made before the chat data's teaching changed writes the chat data again."""
    before = _chat_data_rules(teach=True)
    assert _chat_data_rules(teach=True) == before  # deterministic
    assert _chat_data_rules() != before  # taught or not: other data
    monkeypatch.delitem(chat_data._TEACH, "spelling")
    assert _chat_data_rules(teach=True) != before


def test_speedrun_rl_stage_trains_the_picked_tasks_and_scores_every_task(tmp_path, corpus, monkeypatch):
    """The RL stage picks the tasks whose SFT exact match is in the window (here widened to every task: a tiny
    model solves none), trains on their items only, scores every task again; the report shows both columns;
    a rerun reuses it; with no task in the window it records that and trains nothing."""
    import lmforge.speedrun as sr
    import lmforge.speedrun_chat as chat

    def setting(name: str, value: object) -> None:  # read by the stage (speedrun_chat) and its key (speedrun)
        monkeypatch.setattr(chat, name, value)
        monkeypatch.setattr(sr, name, value)

    out = tmp_path / "sr"
    setting("RL_WINDOW", (0.0, 1.0))
    setting("RL_SETTINGS", sr.RL_SETTINGS + ("rl.samples_per_prompt=2", "rl.prompts_per_step=4",
                                                             "rl.prompts_per_decode=2", "rl.max_new_tokens=8"))
    stages = run(out, corpus, budget="6steps", sft_budget="4steps", chat_eval_items=2, rl_budget="2steps")
    rl, after = stages["rl"], stages["chat-rl"]
    assert rl["tasks"] == list(stages["chat-sft"]["tasks"]) and rl["step"] == 2
    assert set(after["tasks"]) == set(stages["chat-sft"]["tasks"]) and all(t["n"] == 2 for t in after["tasks"].values())
    tasks = {json.loads(ln)["task"] for ln in (out / "rl-tasks" / "train.jsonl").read_text().splitlines()}
    assert tasks == set(rl["tasks"]) and (out / "rl" / "checkpoints" / "step_00000002.safetensors").is_file()
    report = (out / "report.md").read_text(encoding="utf-8")
    assert "## Reinforcement learning on the tasks SFT half solves" in report
    assert re.search(r"\| calculator \(trained\) \| 2 \| \d+% \[\d+, \d+\] \| \d+% \[\d+, \d+\] \| [+-]\d+ \|", report)
    again = run(out, corpus, budget="6steps", sft_budget="4steps", chat_eval_items=2, rl_budget="2steps")
    assert again["rl"] == rl and again["chat-rl"] == after  # reused
    setting("RL_SETTINGS", sr.RL_SETTINGS + ("optimizer.lr=2e-4",))  # other RL settings: RL again
    changed = run(out, corpus, budget="6steps", sft_budget="4steps", chat_eval_items=2, rl_budget="2steps")
    logged = [json.loads(ln) for ln in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert changed["rl"]["step"] == 2 and [r["lr"] for r in logged if "loss" in r] == [2e-4, 2e-4]  # from SFT
    setting("RL_WINDOW", (2.0, 3.0))  # no task can be in it
    none = run(out, corpus, budget="6steps", sft_budget="4steps", chat_eval_items=2, rl_budget="2steps")
    assert none["rl"]["tasks"] == [] and "chat-rl" not in none and not (out / "rl").exists()
    assert "so RL did not run" in (out / "report.md").read_text(encoding="utf-8")


@pytest.mark.slow
def test_cli_speedrun(tmp_path, corpus, capsys):
    from lmforge.cli import main

    out = tmp_path / "sr"
    args = ["speedrun", "--corpus", str(corpus), "--out", str(out), "--model-size", "tiny", "--budget", "3steps",
            "--sft-budget", "2steps", "--vocab-size", "280", "--device", "cpu", "--no-progress"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "validation loss" in printed and "exact match after fine-tuning" in printed and (out / "report.md").exists()
    assert (out / "sft" / "report.md").is_file()  # the fine-tuning run's card
    assert main([*args[:-1], "--model-size", "small", "--no-progress"]) == 2  # other settings, no --force
    assert "--force" in capsys.readouterr().err
    assert main([*args, "--target-bpb", "1000", "--force"]) == 0
    assert "pretraining reached the target of 1000 bits/byte at step" in capsys.readouterr().out
    assert main([*args[:-1], "--model-size", "small", "--no-progress"]) == 2  # other settings, no --force
    assert "--force" in capsys.readouterr().err


def test_speedrun_target_bpb_is_judged_on_the_figure_the_report_states(tmp_path, caplog):
    """A reachable target stops pretraining at the first evaluation at or below it and reports the time and the
    figure: the final evaluation's, over more validation tokens than the periodic estimate reads; one that cannot be
    reached (<= 0) is warned about at the start and reported at the end with the best reached."""
    from lmforge.speedrun import _target_summary

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(make_corpus_text(n_docs=900, seed=1), encoding="utf-8")  # a validation split of ~20 batches
    out = tmp_path / "sr"
    stages = run(out, corpus, budget="12steps", target_bpb=100.0)
    tgt, ev = stages["target"], stages["eval"]
    assert stages["train"]["step"] == 10 and stages["train"]["reached_target"]  # evaluations at 10 and 12
    assert ev["step"] == 10 and ev["val_tokens"] > 10 * 8 * 64  # more than the estimate's 10 batches of 8 x 64
    assert tgt["reached"] and tgt["step"] == 10 and tgt["bpb"] == pytest.approx(ev["val_bpb"], rel=1e-9)
    assert tgt["bpb"] <= 100 and tgt["train_seconds"] > 0
    assert (f"reached the target of 100 bits/byte at step 10 ({ev['val_bpb']:.4f} over {ev['val_tokens']:,} "
            "validation tokens)") in (out / "report.md").read_text()
    never = _target_summary(out / "run", -1, stages["train"], stages["plan"], ev)
    assert not never["reached"] and never["best_step"] == 10 and never["best_bpb"] == tgt["bpb"]
    assert never["text"] == ("did not reach the target of -1 bits/byte within the budget (a target <= 0 can never "
                             f"be reached); the best over {ev['val_tokens']:,} validation tokens was {tgt['bpb']:.4f} "
                             "at step 10")
    with caplog.at_level(logging.WARNING, logger="lmforge"), pytest.raises(ValueError, match="other settings"):
        run(out, corpus, budget="12steps", target_bpb=-1)  # warned before anything else is looked at
    assert "cannot be reached" in caplog.text
    with pytest.raises(ValueError, match="target_bpb must be a number"):
        run(tmp_path / "nan", corpus, target_bpb=float("nan"))


@pytest.mark.slow
def test_speedrun_auto_size_chooses_by_measured_steps_and_a_resume_keeps_the_plan(tmp_path, corpus, monkeypatch,
                                                                                 caplog):
    """``model_size="auto"``: the plan times every candidate, trains the one nearest the fitted tokens per parameter
    and records why (the report's Model size section); a resumed run reuses that plan even where timing the
    candidates again would choose another shape and step count."""
    import lmforge.speedrun as sr
    from lmforge import sizing

    tiny = {"d32x1": sizing.Preset(32, 1, 2, 64, 8, 3e-3), "d64x2": sizing.Preset(64, 2, 4, 64, 8, 3e-3)}
    monkeypatch.setattr(sizing, "CANDIDATES", tiny)
    monkeypatch.setattr(sizing, "TOKENS_PER_PARAM", 0.1)
    monkeypatch.setattr(sr, "train_peak_flops", lambda dtype, device, **kw: (1e11, "fp32"))
    times = {32: 0.9, 64: 0.9}  # 0.2 min -> 12 steps each: d64x2 sees 0.05 tokens/param, d32x1 0.3
    monkeypatch.setattr(sr, "step_seconds", lambda cfg, device: times[cfg.model.d_model])
    out = tmp_path / "sr"
    stages = run(out, corpus, model_size="auto", budget="0.2min")
    plan = stages["plan"]
    assert plan["sizing"]["chosen"] == "d64x2" and plan["preset"] == dataclasses.asdict(tiny["d64x2"])
    assert plan["max_steps"] == 12 and stages["train"]["step"] == 12
    assert [r["step_seconds"] for r in plan["sizing"]["candidates"]] == [0.9, 0.9]
    report = (out / "report.md").read_text(encoding="utf-8")
    assert "## Model size" in report and "`--model-size auto` chose d64x2 (d_model 64, 2 layers" in report
    assert "| **d64x2** |" in report and "| d32x1 |" in report
    # interrupted at step 10; timed again now, d32x1 (10 steps, 0.25 tokens/param) would beat d64x2 (120 steps, 0.48)
    times.update({32: 9.0, 64: 0.09})
    _interrupt_after_step_10(out)
    with caplog.at_level(logging.INFO, logger="lmforge"):
        stages = run(out, corpus, model_size="auto", budget="0.2min")
    assert "stage plan: reusing" in caplog.text and "resumed from" in caplog.text
    assert stages["plan"] == plan and stages["train"]["step"] == 12
    assert json.loads((out / "speedrun.json").read_text())["stages"]["plan"] == plan
    assert sr.load_run_config(out / "run/config.yaml").model.d_model == 64
    fresh = sr._plan(None, 300, out / "data", out / "tokenizer.json", sr.resolve_device("cpu"), ("minutes", 0.2))
    assert fresh["sizing"]["chosen"] == "d32x1" and fresh["max_steps"] == 10  # what a fresh plan would pick now


def test_speedrun_bad_input(tmp_path, corpus):
    with pytest.raises(ValueError, match="unknown model size"):
        run(tmp_path / "a", corpus, model_size="huge")
    with pytest.raises(ValueError, match="neither a named dataset"):
        run(tmp_path / "a", "tinystorie")
    with pytest.raises(ValueError, match="matches no files"):
        run(tmp_path / "a", tmp_path / "nothing*.txt")
    with pytest.raises(ValueError, match="vocab_size"):
        run(tmp_path / "a", corpus, vocab_size=100)
    one_doc = tmp_path / "one.txt"
    one_doc.write_text("a single document without delimiters " * 50)
    with pytest.raises(ValueError, match="several documents"):
        run(tmp_path / "b", one_doc)
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not a speedrun directory"):
        run(foreign, corpus, force=True)
    assert (foreign / "notes.txt").read_text() == "keep me"
    # refused before the corpus is fetched: a named dataset is not downloaded (no network on a GPU machine) first
    with mock.patch("lmforge.speedrun.get_dataset", side_effect=AssertionError("fetched the corpus")):
        with pytest.raises(ValueError, match="not a speedrun directory"):
            run(foreign, "shakespeare")


@pytest.mark.parametrize("text, want", [("8", ("minutes", 8.0)), ("8min", ("minutes", 8.0)), ("2.5m", ("minutes", 2.5)),
                                        ("300steps", ("steps", 300.0)), ("1 step", ("steps", 1.0))])
def test_parse_budget(text, want):
    assert parse_budget(text) == want


@pytest.mark.parametrize("text", ["", "0", "-3", "ten", "5h", "2.5steps"])
def test_parse_budget_rejects(text):
    with pytest.raises(ValueError, match="budget"):
        parse_budget(text)
