"""The prefix cache across requests: time to first token of a growing conversation, and prefill work of many clients
sharing one system prompt, with the cache off and on.

Both run on the library's :class:`~lmforge.generate.scheduler.Scheduler` (what ``lmforge serve`` runs; no HTTP) over
a model with random weights (prefill work does not depend on the weights), on the CPU decode kernels:

(a) a conversation of ``--turns`` turns: a 200-token system prompt, then per turn a 100-token user message and an
    80-token reply; each turn re-sends the whole history (ids), as every chat client does, growing to ~2,000 tokens.
    Time to first token of turns 2.. (submit to first update), off vs on.
(b) ``--clients`` requests sharing one 1,000-token system prompt with a distinct 20-token question each, all
    submitted at once (8 rows): prompt tokens prefilled (work: looked up minus served from the cache) and wall time.

Sides alternate (off, on, off, on, ...) for ``--rounds`` rounds after a warm-up, a fresh scheduler and cache each;
times are medians with their range. The token counts do not depend on the machine's load; the times do (run it on
a quiet machine).

    python benchmarks/bench_prefix.py                 # the demo shape and the GPT-2-small shape
    python benchmarks/bench_prefix.py --quick         # a small model, fewer turns: a smoke run
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import add_json_flag, alternate, median, spread, write_json  # noqa: E402

from lmforge.generate import Engine  # noqa: E402
from lmforge.generate.prefix_cache import PrefixCache  # noqa: E402
from lmforge.generate.scheduler import Job, Scheduler, Update  # noqa: E402
from lmforge.model import ModelConfig, TransformerLM  # noqa: E402
from lmforge.tokenizer import Tokenizer  # noqa: E402

SHAPES = {"demo": dict(d_model=384, n_layers=6, n_heads=6, vocab_size=8192),
          "gpt2-small": dict(d_model=768, n_layers=12, n_heads=12, vocab_size=50304),
          "tiny": dict(d_model=64, n_layers=2, n_heads=4, vocab_size=512)}


def build(shape: str, context: int) -> tuple[TransformerLM, Tokenizer]:
    """A random-weight model of ``shape`` and a tokenizer over its vocabulary: the 256 bytes, then ASCII tokens
    (``<300>``); with :data:`SHOWN` every token's update goes out at once (ids only matter here)."""
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(context_length=context, **SHAPES[shape])).eval()
    vocab = {i: bytes([i]) if i < 256 else f"<{i}>".encode() for i in range(SHAPES[shape]["vocab_size"])}
    return model, Tokenizer(vocab, [])


SHOWN = {i: "?" for i in range(128, 256)}
"""The non-ASCII byte tokens shown as text (alone they are not UTF-8, which a reply holds back until complete)."""


def ids(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


class Timed:
    """An ``emit`` target that records the seconds from its making (the submit) to the first update."""

    def __init__(self) -> None:
        self.t0, self.first, self.done, self.n = time.perf_counter(), None, threading.Event(), 0

    def __call__(self, u: Update) -> None:
        if self.first is None:
            self.first = time.perf_counter() - self.t0
        if u.finish_reason is not None:
            self.n = u.completion_tokens
            self.done.set()


def run_all(s: Scheduler, reqs: list[Job]) -> None:
    for r in reqs:
        s.submit(r)
    while s.run_once() or s.load()["waiting"]:
        pass


def conversation(model: Any, tok: Tokenizer, turns: int, cache_mb: float) -> dict[str, Any]:
    """(a): each turn's time to first token and prompt tokens prefilled."""
    cache = PrefixCache(int(cache_mb * 2**20)) if cache_mb else None
    s = Scheduler(Engine(model), tok, max_batch=1, prefix_cache=cache, speculative=False)
    V = model.cfg.vocab_size
    history = ids(200, 0, V)
    ttft, work = [], []
    for t in range(turns):
        history = history + ids(100, 1 + t, V)
        out = Timed()
        before = s.load()["prefix_hit_tokens"]
        run_all(s, [Job(list(history), 81, out, temperature=0, token_text=SHOWN)])  # on this thread
        ttft.append(out.first)
        work.append(len(history) - (s.load()["prefix_hit_tokens"] - before))
        # the reply's first 80 tokens, fed to the row and still in its token buffer
        history = history + s.engine.tokens[0, len(history): len(history) + 80].tolist()
    return {"ttft": ttft, "prefilled": work, "tokens": len(history)}


def shared_system(model: Any, tok: Tokenizer, clients: int, cache_mb: float) -> dict[str, Any]:
    """(b): prompt tokens prefilled for ``clients`` requests sharing a 1,000-token system prompt."""
    cache = PrefixCache(int(cache_mb * 2**20)) if cache_mb else None
    s = Scheduler(Engine(model), tok, max_batch=8, max_queue=clients, prefix_cache=cache, speculative=False)
    V = model.cfg.vocab_size
    system = ids(1000, 0, V)
    prompts = [system + ids(20, 100 + c, V) for c in range(clients)]
    outs = [Timed() for _ in prompts]
    run_all(s, [Job(p, 1, o, temperature=0) for p, o in zip(prompts, outs)])
    load = s.load()
    return {"prefilled": sum(map(len, prompts)) - load["prefix_hit_tokens"], "prompt_tokens": sum(map(len, prompts))}


def parser(doc: str, quick: str) -> argparse.ArgumentParser:
    """The flags both benchmarks share: ``--shapes``, ``--rounds``, ``--quick`` (its help: ``quick``), ``--json``."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=["demo", "gpt2-small"], choices=sorted(SHAPES))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help=quick)
    add_json_flag(p)
    return p


def main() -> None:
    p = parser(__doc__, "the tiny shape, 4 turns, 16 clients, 1 round")
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--cache-mb", type=float, default=512)
    a = p.parse_args()
    if a.quick:
        a.shapes, a.turns, a.clients, a.rounds = ["tiny"], 4, 16, 1
    figures: dict[str, Any] = {}
    print(f"prefix cache, CPU decode kernels, {torch.get_num_threads()} threads")
    for shape in a.shapes:
        model, tok = build(shape, 2048)
        res: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
        sides = {"off": lambda: res["off"].append(conversation(model, tok, a.turns, 0)),
                 "on": lambda: res["on"].append(conversation(model, tok, a.turns, a.cache_mb))}
        alternate(sides, a.rounds, warmup=0 if a.quick else 1)
        later = {k: [x for r in v[-a.rounds:] for x in r["ttft"][1:]] for k, v in res.items()}
        work = {k: v[-1]["prefilled"] for k, v in res.items()}
        print(f"\n(a) {shape}: {a.turns}-turn conversation to {res['on'][-1]['tokens']} tokens, TTFT of turns 2..{a.turns}"
              f" (s, median (range) over {a.rounds} round(s))")
        print(f"| cache | TTFT turns 2.. | prompt tokens prefilled, turns 2.. |\n|---|---|---|")
        for k in ("off", "on"):
            print(f"| {k} | {spread(later[k], '.4f')} | {sum(work[k][1:])} |")
        speed = median(later["off"]) / median(later["on"])
        print(f"TTFT speed-up: {speed:.1f}x; prefill work: {sum(work['off'][1:]) / max(1, sum(work['on'][1:])):.1f}x less")
        shared: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
        times = alternate({"off": lambda: shared["off"].append(shared_system(model, tok, a.clients, 0)),
                           "on": lambda: shared["on"].append(shared_system(model, tok, a.clients, a.cache_mb))},
                          a.rounds, warmup=0)
        off, on = shared["off"][-1]["prefilled"], shared["on"][-1]["prefilled"]
        print(f"\n(b) {shape}: {a.clients} clients sharing a 1,000-token system prompt (8 rows)")
        print("| cache | prompt tokens prefilled | wall s |\n|---|---|---|")
        for k, n in (("off", off), ("on", on)):
            print(f"| {k} | {n} | {spread(times[k])} |")
        print(f"prefill work: {off / max(1, on):.1f}x less")
        figures[shape] = {"ttft_later": later, "prefilled_per_turn": work, "shared_prefilled": {"off": off, "on": on},
                          "shared_seconds": times, "ttft_speedup": speed, "shared_work_ratio": off / max(1, on)}
    write_json(a.json, figures)


if __name__ == "__main__":
    main()
