"""Run tasks on a run's model: resolve a task name or file, score it, summarise it, record it in the run.

``evaluate_tasks(run_dir, ["arc_easy", "my.jsonl"])`` is what ``lmforge eval RUN --task ...`` calls. Each result
is a JSON-able dict; accuracies carry a 95% Wilson interval (:mod:`lmforge.evals.stats`). Results are appended to
``evals.jsonl`` in the run directory (:data:`EVALS_FILE`), which the run card reads.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from lmforge.chat import ChatFormat
from lmforge.common import atomic_open
from lmforge.corpus import iter_documents
from lmforge.evals.benchmarks import BENCHMARKS, load_benchmark
from lmforge.evals.builtin import BUILTIN_TASKS, builtin_task
from lmforge.evals.generative import exact_match
from lmforge.evals.loglik import score_requests
from lmforge.evals.perplexity import perplexity_of_shards, perplexity_of_texts
from lmforge.evals.stats import wilson_interval
from lmforge.evals.tasks import Task, read_task_file
from lmforge.generate import Generator
from lmforge.generate.generator import load_run_model
from lmforge.model import TransformerLM
from lmforge.tokenizer import Tokenizer

logger = logging.getLogger("lmforge")

__all__ = ["EVALS_FILE", "load_model", "resolve_task", "run_task", "evaluate_tasks", "read_results", "format_result",
           "task_names"]

EVALS_FILE = "evals.jsonl"
"""Eval results of a run, one JSON object per task scored, appended by :func:`evaluate_tasks`."""


def task_names() -> list[str]:
    """Every task a name selects: the built-in ones, then the converted benchmarks."""
    return [*BUILTIN_TASKS, *BENCHMARKS]


def load_model(run_dir: str | Path, checkpoint: str | Path | None = None,
               device: str = "auto") -> tuple[TransformerLM, Tokenizer, dict[str, Any]]:
    """The model (eval mode) and tokenizer of a run, and ``{"checkpoint", "step"}`` of the checkpoint loaded."""
    model, tokenizer, info = load_run_model(run_dir, checkpoint, device)
    return model.eval(), tokenizer, info


def resolve_task(spec: str | Path, cache_dir: str | Path | None = None) -> Task:
    """A task from a built-in or benchmark name, a task JSONL file, a ``.txt`` file or a shard directory."""
    p = Path(spec)
    if p.is_dir():
        if not (p / "manifest.json").is_file():
            raise ValueError(f"{p} is a directory without manifest.json; give a shard directory made by "
                             "`lmforge data prepare`, or a task file")
        return Task(p.name, "text", [], str(p), shards=p)
    if p.is_file():
        if p.suffix == ".txt":
            docs = [d for d in iter_documents([p]) if d.strip()]
            if not docs:
                raise ValueError(f"{p} holds no text to score")
            return Task(p.stem, "text", docs, str(p))
        return read_task_file(p)
    name = str(spec)
    if name in BUILTIN_TASKS:
        return builtin_task(name, cache_dir)
    if name in BENCHMARKS:
        return load_benchmark(name, cache_dir)
    if name.endswith((".jsonl", ".jsonl.gz", ".txt")) or "/" in name:
        raise ValueError(f"task file {name} does not exist; check the path")
    raise ValueError(f"unknown task {name!r}: give a task JSONL file, a .txt file, a shard directory, or one of "
                     f"{', '.join(task_names())} (benchmarks need `lmforge data get evals` once)")


def _accuracy(prefix: str, hits: Sequence[bool]) -> dict[str, Any]:
    k, n = int(sum(hits)), len(hits)
    return {prefix: k / n if n else float("nan"), f"{prefix}_ci": list(wilson_interval(k, n))}


def run_task(model: TransformerLM, tokenizer: Tokenizer, task: Task, limit: int | None = None,
             batch_size: int = 16, details: bool = False) -> dict[str, Any]:
    """Score ``task`` (its first ``limit`` items) and summarise it (see :mod:`lmforge.evals.tasks` for the metrics).

    ``details``: also return per-item records under ``"items"`` (log-likelihoods, replies).
    """
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive integer, got {limit!r}")
    items = task.items[:limit] if limit else task.items
    t0 = time.perf_counter()
    out: dict[str, Any] = {"task": task.name, "type": task.type, "source": task.source}
    per_item: list[Any] = []
    if task.type == "choice":
        requests = [r for it in items for r in it.requests]
        scored = iter(score_requests(model, tokenizer, requests, batch_size))
        acc, acc_norm, acc_bytes, truncated = [], [], [], 0
        for it in items:
            s = [next(scored) for _ in it.requests]
            lls = np.array([x.ll for x in s])
            texts = it.choice_texts  # lm-eval's doc_to_choice: the continuations, or the contexts (Winogrande)
            chars = np.array([len(c) for c in texts], dtype=np.float64)
            n_bytes = np.array([len(c.encode("utf-8")) for c in texts], dtype=np.float64)
            acc.append(int(np.argmax(lls)) == it.gold)  # np.argmax: ties go to the first choice, as in lm-eval
            acc_norm.append(int(np.argmax(lls / chars)) == it.gold)
            acc_bytes.append(int(np.argmax(lls / n_bytes)) == it.gold)
            truncated += any(x.truncated for x in s)
            per_item.append({"lls": lls.tolist(), "gold": it.gold})
        out.update(n=len(items), **_accuracy("acc", acc), **_accuracy("acc_norm", acc_norm),
                   **_accuracy("acc_bytes", acc_bytes), truncated=truncated)
    elif task.type == "cloze":
        scored = score_requests(model, tokenizer, [(it.context, it.continuation) for it in items], batch_size)
        nats = -sum(s.ll for s in scored)
        n_bytes = sum(len(it.continuation.encode("utf-8")) for it in items)
        n_tok = sum(s.n_tokens for s in scored)
        out.update(n=len(items), **_accuracy("acc", [s.greedy for s in scored]),
                   ppl=math.exp(min(nats / max(n_tok, 1), 700.0)), bpb=nats / math.log(2) / max(n_bytes, 1),
                   truncated=sum(s.truncated for s in scored))
        per_item = [{"ll": s.ll, "greedy": s.greedy} for s in scored]
    elif task.type == "text":
        if task.shards is not None:
            out.update(perplexity_of_shards(model, tokenizer, task.shards, limit, batch_size))
        else:
            out.update(perplexity_of_texts(model, tokenizer, items, batch_size))
    elif task.type == "chat":
        gen = Generator(model, tokenizer)
        r = exact_match(gen, items, batch_size)
        out.update(n=r["n"], **_accuracy("exact_match", r["correct"]), truncated=r["truncated"],
                   ended=sum(r["ended"]) / max(r["n"], 1), tool_calls=r["tool_calls"])
        per_item = [{"reply": rep, "answer": it.answer, "correct": c}
                    for rep, it, c in zip(r["replies"], items, r["correct"])]
    else:  # pragma: no cover - Task.type comes from tasks.TASK_TYPES
        raise AssertionError(task.type)
    out["seconds"] = time.perf_counter() - t0
    out["interval"] = "Wilson score, 95%"
    if details:
        out["items"] = per_item
    return out


def format_result(r: dict[str, Any]) -> str:
    """One line for a person: the task, its size and its metrics (accuracies with their 95% interval)."""
    parts = []
    for key in ("acc", "acc_norm", "acc_bytes", "exact_match"):
        if key in r:
            lo, hi = r[f"{key}_ci"]
            parts.append(f"{key} {r[key]:.4f} [{lo:.4f}, {hi:.4f}]")
    for key, fmt in (("loss", "{:.4f}"), ("ppl", "{:.2f}"), ("bpb", "{:.4f}")):
        if r.get(key) is not None:
            parts.append(f"{key} {fmt.format(r[key])}")
    size = f"{r['n']:,} items" if r["type"] != "text" else f"{r.get('tokens', 0):,} tokens"
    line = f"{r['task']} ({r['type']}, {size}): " + ", ".join(parts)
    if any(k.endswith("_ci") for k in r):
        line += " (95% Wilson interval)"
    if r.get("truncated"):
        line += f"; {r['truncated']} truncated from the left to fit the context"
    return line


def read_results(run_dir: str | Path) -> list[dict[str, Any]]:
    """The eval results recorded in a run directory (oldest first; none yet is ``[]``)."""
    p = Path(run_dir) / EVALS_FILE
    if not p.is_file():
        return []
    return [json.loads(line) for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]


def _record(run_dir: Path, results: list[dict[str, Any]]) -> None:
    old = (run_dir / EVALS_FILE).read_text(encoding="utf-8") if (run_dir / EVALS_FILE).is_file() else ""
    with atomic_open(run_dir / EVALS_FILE) as f:
        f.write(old)
        for r in results:
            f.write(json.dumps({k: v for k, v in r.items() if k != "items"}) + "\n")


def evaluate_tasks(run_dir: str | Path, tasks: Sequence[str | Path], checkpoint: str | Path | None = None,
                   limit: int | None = None, batch_size: int = 16, device: str = "auto", record: bool = True,
                   cache_dir: str | Path | None = None, details: bool = False) -> list[dict[str, Any]]:
    """Score each task on the run's checkpoint; with ``record`` append the results to ``run_dir/evals.jsonl``.

    Every task is resolved (and checked) before the model runs, so a typo fails fast.
    """
    if not tasks:
        raise ValueError("no task given; pass --task NAME|FILE (see `lmforge eval --help`)")
    resolved = [resolve_task(t, cache_dir) for t in tasks]
    model, tok, info = load_model(run_dir, checkpoint, device)
    chat = [t.name for t in resolved if t.type == "chat"]
    if chat:
        try:
            ChatFormat(tok)  # the chat format's own check of its special tokens
        except ValueError:
            raise ValueError(f"{', '.join(chat)} is a chat task but {run_dir} is not a chat model (its tokenizer "
                             f"lacks the chat special tokens); fine-tune it first with `lmforge sft --base {run_dir} "
                             "--data CHATS.jsonl --run-dir OUT`, then evaluate OUT") from None
    results = []
    for task in resolved:
        r = run_task(model, tok, task, limit, batch_size, details)
        r.update(info, time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        logger.info("scored %s: %d items in %.1f s", task.name, r.get("n", 0), r["seconds"])
        results.append(r)
    if record:
        _record(Path(run_dir), results)
    return results
