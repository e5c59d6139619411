"""Speculative decoding with prompt-lookup drafts at batch 1: tokens/s and forward passes per token, off vs on.

One request at a time through the library's :class:`~lmforge.generate.scheduler.Scheduler` (what ``lmforge serve``
runs), a 500-token prompt (``--prompt-tokens``), ``--new-tokens`` tokens, on a random-weight model of each shape:

- ``repeat``: greedy decoding after a prompt that is a 50-token passage said over and over, where a random model
  soon repeats itself (loops of tokens it already said): text that quotes its own context, the case prompt-lookup
  drafts are for. A random model does not quote its prompt the way a trained one rewriting a passage does; the
  drafts' arithmetic is the same (they are checked, not trusted), only how many are kept differs.
- ``free``: sampling at temperature 1, where the context rarely repeats: drafting must pause itself (never slower).

Sides: ``kernel`` (the CPU decode kernels, the default CPU path: one token per step; its verify pass would be
single steps, so it does not draft), ``torch off`` and ``torch on`` (the PyTorch path, which verifies a row's drafts
in one forward of k + 1 positions). The greedy tokens of ``torch on`` must equal ``torch off``'s, else the script exits.
Reported: median tokens/s over ``--rounds`` alternating rounds (range), forward passes per generated token and drafts
kept per pass (counts: independent of the machine's load; the times are not, so run it on a quiet machine).

    python benchmarks/bench_speculative.py             # the demo shape and the GPT-2-small shape
    python benchmarks/bench_speculative.py --quick     # the tiny shape, fewer tokens: a smoke run
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import alternate, median, spread, write_json  # noqa: E402
from bench_prefix import SHOWN, Timed, build, ids, parser, run_all  # noqa: E402

from lmforge.generate import Engine  # noqa: E402
from lmforge.generate.scheduler import Request, Scheduler  # noqa: E402

TASKS = {"repeat": dict(temperature=0.0), "free": dict(temperature=1.0, seed=1)}


def decode(engine: Engine, tok: Any, prompt: list[int], n: int, spec: bool, **sampling: Any) -> dict[str, Any]:
    """One request alone: its tokens (the row's fed tokens) and the scheduler's drafting counts."""
    s = Scheduler(engine, tok, max_batch=1, speculative=spec)
    out = Timed()
    with torch.inference_mode():
        run_all(s, [Request(prompt, n + 1, out, token_text=SHOWN, **sampling)])
    load = s.load()
    return {"tokens": engine.tokens[0, len(prompt): len(prompt) + n].tolist(), "passes": load["spec_passes"],
            "drafted": load["spec_drafted"], "accepted": load["spec_accepted"], "n": out.n, "first": out.first}


def main() -> None:
    p = parser(__doc__, "the tiny shape, a 100-token prompt, 48 tokens, 1 round")
    p.add_argument("--new-tokens", type=int, default=200)
    p.add_argument("--prompt-tokens", type=int, default=500)
    a = p.parse_args()
    if a.quick:
        a.shapes, a.prompt_tokens, a.new_tokens, a.rounds = ["tiny"], 100, 48, 1
    figures: dict[str, Any] = {}
    print(f"speculative decoding (prompt lookup), batch 1, {torch.get_num_threads()} threads")
    for shape in a.shapes:
        model, tok = build(shape, 1024)
        passage = ids(50, 0, model.cfg.vocab_size)
        prompts = {"repeat": (passage * (a.prompt_tokens // 50 + 1))[: a.prompt_tokens],
                   "free": ids(a.prompt_tokens, 0, model.cfg.vocab_size)}
        engines = {"kernel": Engine(model), "torch": Engine(model, use_kernel=False)}
        for task, sampling in TASKS.items():
            got: dict[str, dict[str, Any]] = {}
            rates: dict[str, list[float]] = {"kernel": [], "torch off": [], "torch on": []}

            def side(name: str, eng: str, spec: bool) -> Any:
                def run() -> None:
                    t0 = time.perf_counter()
                    got[name] = r = decode(engines[eng], tok, prompts[task], a.new_tokens, spec, **sampling)
                    rates[name].append((r["n"] - 1) / (time.perf_counter() - t0 - r["first"]))  # after the first
                return run

            times = alternate({"kernel": side("kernel", "kernel", False), "torch off": side("torch off", "torch", False),
                               "torch on": side("torch on", "torch", True)}, a.rounds, warmup=0 if a.quick else 1)
            if task == "repeat" and got["torch on"]["tokens"] != got["torch off"]["tokens"]:
                sys.exit(f"{shape}: drafting changed the greedy tokens")
            on = got["torch on"]
            n = on["n"] - 1  # tokens after the prefill's
            passes = (n - on["accepted"]) / n
            print(f"\n{shape}, {task} ({a.new_tokens} tokens after a {a.prompt_tokens}-token prompt; decode tokens/s "
                  f"after the first token, median (range))")
            print("| side | tokens/s | passes per token | drafts kept per pass |\n|---|---|---|---|")
            for name in times:
                rate = rates[name][-a.rounds:]
                extra = (f"{passes:.2f} | {on['accepted'] / max(1, on['passes']):.2f} ({on['accepted']}/{on['drafted']})"
                         if name == "torch on" else "1.00 | -")
                print(f"| {name} | {spread(rate, '.1f')} | {extra} |")
            speed = median(rates["torch on"][-a.rounds:]) / median(rates["torch off"][-a.rounds:])
            print(f"torch on / torch off: {speed:.2f}x; "
                  f"greedy tokens identical: {got['torch on']['tokens'] == got['torch off']['tokens']}")
            figures[f"{shape}/{task}"] = {"seconds": times, "rates": rates, "speedup": speed, "passes_per_token": passes,
                                          **{k: v for k, v in on.items() if k != "tokens"}}
    write_json(a.json, figures)


if __name__ == "__main__":
    main()
