"""RL's prompts: chat items with exact answers, read like ``eval --task`` reads them, kept inside the run.

A data file is a chat task file (``lmforge data get chat-tasks`` writes them): one ``{"messages": [...]}`` per
line whose final assistant message is the exact answer; the prompt is the conversation up to its last user
message (:func:`lmforge.evals.read_task_file`), rendered by ``ChatFormat.render_for_completion``. An optional
``"task"`` key names the item's task (per-task accuracies). A prompt that leaves fewer than
``rl.max_new_tokens`` tokens of the context for its reply is skipped (counted and logged), and so is an item with
function ``tools`` (its answer needs a function's result, which a rollout cannot produce).

``lmforge rl`` keeps what it trains on in ``RUN/rl_data`` (:data:`DATA_DIR`): the rendered prompts as a
conversation directory (:mod:`lmforge.data.conversations`: the tokenizer's fingerprint, the source files'
sha256, masks all 0) that the training loop opens and checks like SFT's, and per split ``{split}.jsonl``, the
kept items themselves (prompt and answer), which rewards and evaluation read.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from lmforge.chat.format import ChatFormat
from lmforge.common import atomic_write_text, sha256_file
from lmforge.data.conversations import ConversationDataset, write_conversations
from lmforge.evals.tasks import ChatItem, read_task_file
from lmforge.tokenizer import EOT

__all__ = ["DATA_DIR", "PromptSet", "read_prompts", "write_prompts", "load_prompts"]

DATA_DIR = "rl_data"
"""Folder of an RL run that holds its prompts."""


@dataclasses.dataclass
class PromptSet:
    """Prompts with their answers: ``ids[i]`` (rendered), ``items[i]`` (messages and answer), ``tasks[i]``."""

    ids: list[list[int]]
    items: list[ChatItem]
    tasks: list[str]

    def __len__(self) -> int:
        return len(self.ids)


def _tags(path: Path) -> list[tuple[str, bool]]:
    """``(task, has function tools)`` of each non-blank line of a JSONL file (task ``"all"`` where a line names
    none)."""
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            record = json.loads(line)
            tag = record.get("task")
            out.append((tag if isinstance(tag, str) and tag else "all", bool(record.get("tools"))))
    return out


def read_prompts(path: str | os.PathLike, fmt: ChatFormat, context_length: int,
                 max_new_tokens: int) -> tuple[PromptSet, int]:
    """``(prompts, skipped)`` of a chat task file; ``ValueError`` (``path:line:`` where it applies) for a file
    that is not one, and for a file whose every prompt is too long for a reply of ``max_new_tokens``."""
    p = Path(path)
    try:
        task = read_task_file(p)
    except ValueError as e:
        raise ValueError(f"{e} (rl --data needs chat items with exact answers: one {{\"messages\": [...]}} per "
                         "line ending with the assistant's answer, e.g. `lmforge data get chat-tasks`)") from None
    if task.type != "chat":
        raise ValueError(f"{p} holds {task.type} items, not chat items with exact answers; rl needs one "
                         "{\"messages\": [...]} per line ending with the assistant's answer (e.g. `lmforge data get "
                         "chat-tasks`)")
    tags = _tags(p)
    keep = PromptSet([], [], [])
    skipped = 0
    for item, (tag, functions) in zip(task.items, tags):
        ids = fmt.render_for_completion(list(item.prompt))
        # an item with function tools answers from a function's result, which only a client can supply: a
        # rollout (which runs the calculator alone) could never earn its reward
        if functions or len(ids) + max_new_tokens > context_length + 1:
            skipped += 1
            continue
        keep.ids.append(ids)
        keep.items.append(item)
        keep.tasks.append(tag)
    if not keep.ids and all(f for _, f in tags):
        raise ValueError(f"{p}: every item calls function tools (\"tools\"), whose results a rollout cannot "
                         "produce; rl needs items answered by the model (and the calculator) alone")
    if not keep.ids:
        raise ValueError(f"{p}: every prompt is too long to leave rl.max_new_tokens={max_new_tokens} tokens of the "
                         f"context ({context_length}) for its reply ({skipped} skipped); lower rl.max_new_tokens")
    return keep, skipped


def _item_json(item: ChatItem, task: str) -> str:
    messages = [*item.prompt, {"role": "assistant", "content": item.answer}]
    return json.dumps({"task": task, "messages": messages}, ensure_ascii=False)


def write_prompts(data_dir: Path, splits: dict[str, tuple[PromptSet, int, str]], tokenizer: Any) -> None:
    """Write ``{split: (prompts, skipped, source path)}`` into ``data_dir`` (see the module docstring)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    rendered = {}
    for split, (ps, skipped, source) in splits.items():
        atomic_write_text(data_dir / f"{split}.jsonl",
                          "".join(_item_json(it, t) + "\n" for it, t in zip(ps.items, ps.tasks)))
        sources = [{"path": str(Path(source).absolute()), "sha256": sha256_file(source)}]
        rendered[split] = ([(ids, [0] * len(ids)) for ids in ps.ids], {"skipped": skipped, "sources": sources})
    tokenizer.save(data_dir / "tokenizer.json", force=True)
    write_conversations(data_dir, rendered, tokenizer.fingerprint(), tokenizer.special_tokens[EOT])  # manifest last


def load_prompts(data_dir: str | os.PathLike, split: str) -> PromptSet:
    """The prompts of ``split`` kept in an RL run's ``rl_data`` (rendered ids and items, which must agree)."""
    ds = ConversationDataset(data_dir, split)
    path = Path(data_dir) / f"{split}.jsonl"
    task = read_task_file(path)
    if len(task.items) != len(ds):
        raise ValueError(f"{path} holds {len(task.items)} items but {data_dir} {len(ds)} rendered prompts (changed by "
                         "hand?); start the run again in a new --run-dir")
    ids = [ds.ids[int(ds.offsets[k]):int(ds.offsets[k + 1])].tolist() for k in range(len(ds))]
    return PromptSet(ids, list(task.items), [tag for tag, _ in _tags(path)])
