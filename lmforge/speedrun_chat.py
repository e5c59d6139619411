"""The speedrun's chat stages: the built-in chat tasks from the corpus's words (every vocabulary word spelled in a
training item), their exact match after each stage, midtraining (the corpus mixed with the chat tasks, every token
trained), the fine-tuning itself, and RL on the tasks the fine-tuned model half solves.

Each function is one stage's body; :func:`lmforge.speedrun.speedrun` decides when each runs (and reuses its record
when what it depends on is unchanged)."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

from lmforge.chat import add_chat_tokens
from lmforge.chat.midtrain import midtrain
from lmforge.chat.session import ChatSession
from lmforge.chat.sft import sft as fine_tune
from lmforge.common import atomic_write_text, sha256_file
from lmforge.corpus import iter_documents
from lmforge.corpus.chat_data import chat_tasks, common_words, to_jsonl, vocabulary_words
from lmforge.data import TokenDataset
from lmforge.data.conversations import ConversationDataset
from lmforge.evals import read_task_file
from lmforge.evals.evaluate import load_model
from lmforge.evals.generative import exact_match
from lmforge.generate import Generator
from lmforge.rl import rl as reinforce
from lmforge.rl.data import DATA_DIR as RL_DATA_DIR
from lmforge.tokenizer import Tokenizer
from lmforge.train import load_run_config
from lmforge.train.evaluate import evaluate, validation_batches
from lmforge.train.metrics import step_seconds

logger = logging.getLogger("lmforge")

CHAT_SAMPLE = ("Hi, my name is Ada. Who are you?", "What is 48+7?", "Spell the word honour.",
               "Use the calculator: what is 123*45?")
"""The user messages of the sample conversation in the report (one conversation, in order)."""
SFT_SETTINGS = ("optimizer.lr=1e-3", "optimizer.min_lr=1e-4", "training.eval_every=1000000")
"""The speedrun's fine-tuning settings on top of ``chat.sft``'s defaults (a small model takes a higher rate;
the chat stages measure accuracy instead of a validation loss every few steps)."""
RL_DIR, RL_TASKS_DIR = "rl", "rl-tasks"
RL_WINDOW = (0.05, 0.80)
"""RL trains on the chat tasks whose exact match after SFT lies in this range: below it the model rarely samples a
right answer (no reward to learn from), above it there is little left to gain."""
MIDTRAIN_DIR = "midtrain"
MIDTRAIN_CHAT_FRACTION = 0.5
"""The share of each midtraining batch's rows that are chat conversations (the rest: the corpus's blocks)."""
MIDTRAIN_SETTINGS = ("training.eval_every=1000000",)
"""The speedrun's midtraining settings on top of ``chat.midtrain``'s defaults (the base's recipe and batch)."""
RL_SETTINGS = ("rl.samples_per_prompt=8", "rl.prompts_per_step=8", "rl.prompts_per_decode=4", "rl.max_new_tokens=24",
               "training.checkpoint_every=5")
"""The speedrun's RL settings on top of ``lmforge rl``'s defaults (64 replies per step, short replies)."""



def _chat_data(paths: list[Path], dest: Path, max_bytes: int = 20 << 20, teach: bool = False,
               tokenizer: Path | None = None) -> dict[str, Any]:
    """The built-in chat tasks over the corpus's common words (the first ``max_bytes`` of text) in ``dest``:
    ``train.jsonl`` and ``val.jsonl``, as ``lmforge data get chat-tasks`` makes them from Shakespeare's
    (``teach``: see :func:`~lmforge.corpus.chat_data.chat_tasks`); with ``tokenizer``, one ``spelling_bee`` training
    item for every word of its vocabulary and of the task words (validation items unchanged)."""
    text, size = [], 0
    for doc in iter_documents(paths):
        text.append(doc)
        size += len(doc)
        if size >= max_bytes:
            break
    words = common_words("\n".join(text))
    n_val = max(1, min(50, len(words) // 5))  # 50 per task (as `data get chat-tasks`) unless the corpus is tiny
    spell = _spell_words(Tokenizer.load(tokenizer), words) if tokenizer is not None else []
    train, val = chat_tasks(words, n_train=min(1000, 20 * n_val), n_val=n_val, teach=teach, spell_words=spell)
    dest.mkdir(parents=True, exist_ok=True)
    rec: dict[str, Any] = {"train_conversations": len(train), "val_conversations": len(val),
                           "spelled_words": len(spell)}
    for name, records in (("train", train), ("val", val)):
        atomic_write_text(dest / f"{name}.jsonl", to_jsonl(records))
        rec[f"{name}_sha256"] = sha256_file(dest / f"{name}.jsonl")
    return rec


def _spell_words(tokenizer: Any, words: list[str]) -> list[str]:
    """The words the spelling items cover: the task words, then every word of ``tokenizer``'s vocabulary."""
    pieces = (tokenizer.vocab[i] for i in range(tokenizer.vocab_size))
    return list(dict.fromkeys(words + vocabulary_words(pieces)))


def _chat_data_rules(teach: bool = False) -> str:
    """A digest of how the chat tasks are generated and taught: the records ``chat_tasks`` draws from a fixed
    word list (with the spelling items). Part of the ``chat-data`` stage's key, so a speedrun directory made before
    the generator or its teaching changed writes its chat data again instead of reusing the old."""
    words = ["honour", "sword", "crown", "light", "night", "heart"]
    return _digest(to_jsonl(sum(chat_tasks(words, n_train=3, n_val=2, seed=0, teach=teach, spell_words=words), [])))


def _chat_eval(model: Any, tokenizer: Any, val_path: Path, per_task: int) -> dict[str, Any]:
    """Exact match (greedy, tools run) of ``model`` on the first ``per_task`` validation items of each chat task,
    and the share of replies that ended with ``<|assistant_end|>``."""
    tags = [json.loads(line).get("task", "all") for line in val_path.read_text(encoding="utf-8").splitlines()
            if line.strip()]
    items = read_task_file(val_path).items  # the evals' reading of the file (prompt up to the last user turn)
    gen, tasks, t0 = Generator(model, tokenizer), {}, time.perf_counter()
    for tag in dict.fromkeys(tags):
        chosen = [it for it, t in zip(items, tags) if t == tag][:per_task]
        r = exact_match(gen, chosen)
        tasks[tag] = {"n": r["n"], "correct": int(sum(r["correct"])), "ended": int(sum(r["ended"])),
                      "example": {"answer": chosen[0].answer, "reply": r["replies"][0]}}
    n = sum(t["n"] for t in tasks.values())
    return {"tasks": tasks, "accuracy": sum(t["correct"] for t in tasks.values()) / n,
            "ended": sum(t["ended"] for t in tasks.values()) / n, "seconds": time.perf_counter() - t0}


def _chat_base(run_dir: Path, val_path: Path, device: Any, per_task: int) -> dict[str, Any]:
    """The chat tasks scored on the pretrained model as fine-tuning starts from it: chat tokens appended,
    the embedding and head grown with mean rows (what ``lmforge sft`` does before its first step)."""
    model, tok, _ = load_model(run_dir, device=str(device))
    tok = add_chat_tokens(tok)
    if tok.vocab_size > model.cfg.vocab_size:
        model.resize_vocab(tok.vocab_size)
    return _chat_eval(model, tok, val_path, per_task)


def _chat_sft(sft_dir: Path, val_path: Path, device: Any, per_task: int) -> dict[str, Any]:
    """The chat tasks scored on the fine-tuned model, and a sample conversation through ``ChatSession``."""
    model, tok, _ = load_model(sft_dir, device=str(device))
    rec = _chat_eval(model, tok, val_path, per_task)
    chat = ChatSession(Generator(model, tok), temperature=0.0, max_new_tokens=48)
    for text in CHAT_SAMPLE:
        for _ in chat.send(text):
            pass
    rec["conversation"] = chat.messages()
    return rec


def _midtrain(run_dir: Path, train_path: Path, mid_dir: Path, steps: int, device: Any,
              progress: bool) -> dict[str, Any]:
    """Midtrain the pretrained run for ``steps`` steps: :data:`MIDTRAIN_CHAT_FRACTION` of each batch's rows the chat
    tasks' training conversations, the rest the corpus's blocks, every token trained (:mod:`lmforge.chat.midtrain`)."""
    return _jsonable(midtrain(run_dir, train_path, mid_dir, chat_fraction=MIDTRAIN_CHAT_FRACTION, progress=progress,
                              overrides=[f"training.max_steps={steps}", f"optimizer.warmup_steps={min(10, steps // 4)}",
                                         f"training.device={device.type}", *MIDTRAIN_SETTINGS]))


def _chat_mid(mid_dir: Path, val_path: Path, data_dir: Path, device: Any, per_task: int,
              eval_batches: int) -> dict[str, Any]:
    """The chat tasks scored on the midtrained model, and its bits per byte on the corpus's validation split (its
    first ``eval_batches`` batches: the blocks of the pretrained model's final figure)."""
    model, tok, _ = load_model(mid_dir, device=str(device))
    rec = _chat_eval(model, tok, val_path, per_task)
    tc, T = load_run_config(mid_dir / "config.yaml").training, model.cfg.context_length
    ds = TokenDataset(data_dir, "val")
    batches, _, tokens = validation_batches(ds, tc.eval_batch_size or tc.batch_size, tc.context_length or T,
                                            eval_batches)
    ev = evaluate(model, batches, ds.bytes_per_token, tc.dtype, device)
    return {**rec, "val_loss": ev.loss, "val_bpb": ev.bpb, "val_tokens": tokens}


def _sft(run_dir: Path, train_path: Path, val_path: Path, sft_dir: Path, steps: int, device: Any,
         progress: bool) -> dict[str, Any]:
    """Fine-tune the pretrained run on the chat tasks for ``steps`` steps with :data:`SFT_SETTINGS`."""
    return _jsonable(fine_tune(run_dir, train_path, sft_dir, val_data=val_path, progress=progress, overrides=[
        f"training.max_steps={steps}", f"optimizer.warmup_steps={min(10, steps // 4)}",
        f"training.device={device.type}", *SFT_SETTINGS]))


def _sft_steps(plan: dict[str, Any], budget: tuple[str, float]) -> int:
    """Fine-tuning steps: the budget's steps, or its minutes over the pretraining step time (the same shape)."""
    unit, amount = budget
    if unit == "steps" or not plan.get("step_seconds"):
        return max(1, int(amount)) if unit == "steps" else 100
    return max(10, int(amount * 60 / plan["step_seconds"]))


def _rl_tasks(after_sft: dict[str, Any], chat_dir: Path, dest: Path) -> dict[str, Any]:
    """Write the train and validation items of the tasks the SFT model solves within :data:`RL_WINDOW` into
    ``dest``; returns ``{"tasks", ...sha256}`` (``tasks`` empty when no task is in the window)."""
    lo, hi = RL_WINDOW
    chosen = [t for t, r in after_sft["tasks"].items() if lo <= r["correct"] / r["n"] <= hi]
    dest.mkdir(parents=True, exist_ok=True)
    rec: dict[str, Any] = {"tasks": chosen}
    for name in ("train", "val"):
        lines = [ln for ln in (chat_dir / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()
                 if ln.strip() and json.loads(ln).get("task") in chosen]
        atomic_write_text(dest / f"{name}.jsonl", "".join(ln + "\n" for ln in lines))
        rec[f"{name}_sha256"] = sha256_file(dest / f"{name}.jsonl")
    return rec


def _rl(after_sft: dict[str, Any], chat_dir: Path, tasks_dir: Path, sft_dir: Path, rl_dir: Path,
        budget: tuple[str, float], device: Any, progress: bool) -> dict[str, Any]:
    """``lmforge rl`` from the SFT run on the tasks :func:`_rl_tasks` picks (nothing when none): the budget's steps,
    or its minutes over the time of the second step (the first two run first, alone; the rest resumes from their
    checkpoint: a constant learning rate, so the number of steps changes no step)."""
    picked = _rl_tasks(after_sft, chat_dir, tasks_dir)
    try:  # an RL run on other tasks (another window, another SFT model): start again rather than refuse it
        old = ConversationDataset(rl_dir / RL_DATA_DIR, "train").info["sources"][0]["sha256"]
    except (ValueError, OSError, KeyError, IndexError):
        old = None
    if old is not None and old != picked["train_sha256"]:
        shutil.rmtree(rl_dir)
    if not picked["tasks"]:
        logger.info("RL: no chat task has an exact match in [%.0f%%, %.0f%%] after SFT; nothing to train", 100 *
                    RL_WINDOW[0], 100 * RL_WINDOW[1])
        return picked
    base = ["training.device=" + device.type, *RL_SETTINGS]
    unit, amount = budget
    if unit == "steps":
        steps, step_s = int(amount), None
    else:
        reinforce(sft_dir, tasks_dir / "train.jsonl", rl_dir, overrides=[*base, "training.max_steps=2"],
                  progress=progress)
        step_s = step_seconds(list(map(json.loads, (rl_dir / "metrics.jsonl").read_text().splitlines())))[1]
        steps = max(2, int(amount * 60 / step_s))
        logger.info("RL plan: %.1f s for the second step (the first warms up at about half speed) -> %d steps "
                    "(~%.1f min)", step_s, steps, steps * step_s / 60)
    m = reinforce(sft_dir, tasks_dir / "train.jsonl", rl_dir, overrides=[*base, f"training.max_steps={steps}"],
                  progress=progress)
    recs = [r for r in map(json.loads, (rl_dir / "metrics.jsonl").read_text().splitlines()) if "reward" in r]
    return {**picked, **_jsonable(m), "planned_step_seconds": step_s,
            "reward_first": recs[0]["reward"], "reward_last10": sum(r["reward"] for r in recs[-10:]) / len(recs[-10:])}


# ==================================================================================================
# The pipeline
# ==================================================================================================
def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (v if isinstance(v, (int, float, str, type(None))) else str(v)) for k, v in d.items()}


def _digest(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


# ==================================================================================================
# Stages
# ==================================================================================================
