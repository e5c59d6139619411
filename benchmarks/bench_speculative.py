"""Speculative decoding with prompt-lookup drafts at batch 1: tokens/s and forward passes per token, off vs on.

One request at a time through the library's :class:`~lmforge.generate.scheduler.Scheduler` (what ``lmforge serve``
runs), a 500-token prompt (``--prompt-tokens``), ``--new-tokens`` tokens, on a random-weight model of each shape:

- ``repeat``: greedy decoding after a prompt that is a 50-token passage said over and over, where a random model
  soon repeats itself (loops of tokens it already said): text that quotes its own context, the case prompt-lookup
  drafts are for. A random model does not quote its prompt the way a trained one rewriting a passage does; the
  drafts' arithmetic is the same (they are checked, not trusted), only how many are kept differs.
- ``free``: sampling at temperature 1, where the context rarely repeats: drafting must pause itself (never slower).

Sides: ``kernel off`` and ``kernel on`` (the CPU decode kernels, the default CPU path: one C++ step call checks a
row's k drafted tokens and returns the logits after each), ``torch off`` and ``torch on`` (the PyTorch path: one
forward of k + 1 positions). Each ``on`` side's greedy tokens must equal its ``off`` side's, else the script exits.
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
from lmforge.generate.scheduler import Job, Scheduler  # noqa: E402

TASKS = {"repeat": dict(temperature=0.0), "free": dict(temperature=1.0, seed=1)}


def decode(engine: Engine, tok: Any, prompt: list[int], n: int, spec: bool, **sampling: Any) -> dict[str, Any]:
    """One request alone: its tokens (the row's fed tokens) and the scheduler's drafting counts."""
    s = Scheduler(engine, tok, max_batch=1, speculative=spec)
    out = Timed()
    with torch.inference_mode():
        run_all(s, [Job(prompt, n + 1, out, token_text=SHOWN, **sampling)])
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
            rates: dict[str, list[float]] = {"kernel off": [], "kernel on": [], "torch off": [], "torch on": []}

            def side(name: str, eng: str, spec: bool) -> Any:
                def run() -> None:
                    t0 = time.perf_counter()
                    got[name] = r = decode(engines[eng], tok, prompts[task], a.new_tokens, spec, **sampling)
                    rates[name].append((r["n"] - 1) / (time.perf_counter() - t0 - r["first"]))  # after the first
                return run

            times = alternate({f"{eng} {'on' if spec else 'off'}": side(f"{eng} {'on' if spec else 'off'}", eng, spec)
                               for eng in engines for spec in (False, True)}, a.rounds, warmup=0 if a.quick else 1)
            for eng in engines:
                if task == "repeat" and got[f"{eng} on"]["tokens"] != got[f"{eng} off"]["tokens"]:
                    sys.exit(f"{shape}: drafting changed the greedy tokens ({eng} path)")
            print(f"\n{shape}, {task} ({a.new_tokens} tokens after a {a.prompt_tokens}-token prompt; decode tokens/s "
                  f"after the first token, median (range))")
            print("| side | tokens/s | passes per token | drafts kept per pass |\n|---|---|---|---|")
            passes: dict[str, float] = {}
            for name in times:
                r, n = got[name], got[name]["n"] - 1  # tokens after the prefill's
                passes[name] = (n - r["accepted"]) / n
                kept = f"{r['accepted'] / r['passes']:.2f} ({r['accepted']}/{r['drafted']})" if r["passes"] else "-"
                print(f"| {name} | {spread(rates[name][-a.rounds:], '.1f')} | {passes[name]:.2f} | {kept} |")
            speed = {eng: median(rates[f"{eng} on"][-a.rounds:]) / median(rates[f"{eng} off"][-a.rounds:])
                     for eng in engines}
            print("; ".join(f"{eng} on / off: {x:.2f}x" for eng, x in speed.items()) + "; greedy tokens identical")
            figures[f"{shape}/{task}"] = {"seconds": times, "rates": rates, "speedup": speed, "passes_per_token": passes,
                                          **{k: v for k, v in got["kernel on"].items() if k != "tokens"}}
    write_json(a.json, figures)


if __name__ == "__main__":
    main()
