"""The demo's chat tasks, change by change: exact match per task after the speedrun's fine-tuning.

From one pretrained run (a speedrun's ``run/``, or any run on the speedrun's tokenizer), each variant writes the
built-in chat tasks (``lmforge.speedrun._chat_data``: the corpus's common words, the same validation items every
time), fine-tunes ``--steps`` steps exactly as the speedrun's ``sft`` stage does (``_sft``: ``SFT_SETTINGS``),
and scores the first ``--items`` validation items of each task (``_chat_eval``: greedy, tools run). Steps, not
minutes, so the comparison does not depend on the machine's load; fine-tuning and scoring are deterministic.

Before fine-tuning, the base's **in-context copying** is probed (``lmforge.evals.probes.copy_probe``): every task but counting
asks the model to copy a token of the question it has never copied in training (a name, a word, the digits of a
tool call), which is what an induction head does; a base that has one predicts the second occurrence of a random
sequence far better than the first.

Variants: ``plain`` (the training items as the validation items are asked and answered), ``teach``
(``chat_tasks(teach=True)``: arithmetic, spelling and uppercase through the calculator, spelling and uppercase
over every word).

    python benchmarks/bench_chat_tasks.py --base runs/speedrun/run --steps 190
    python benchmarks/bench_chat_tasks.py --quick     # a smoke run: a tiny speedrun as the base
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import synthetic_documents  # noqa: E402

from lmforge.evals.probes import copy_probe  # noqa: E402  (the speedrun's report and bench_recipe use it too)

VARIANTS = {"plain": False, "teach": True}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", help="the pretrained run directory (a speedrun's run/)")
    ap.add_argument("--corpus", default="shakespeare", help="the corpus the words come from (as the speedrun's)")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--steps", type=int, default=190, help="fine-tuning steps (the demo's 2.5 min, quiet)")
    ap.add_argument("--items", type=int, default=40, help="validation items scored per task")
    ap.add_argument("--out", default=None, help="keep the fine-tuned runs and results here (default: a temp dir)")
    ap.add_argument("--quick", action="store_true", help="a tiny speedrun on a synthetic corpus as the base")
    a = ap.parse_args()

    import torch

    from lmforge.speedrun import _chat_data, _chat_eval, _resolve_corpus, _sft, speedrun
    from lmforge.evals.evaluate import load_model

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(a.out or tmp)
        out.mkdir(parents=True, exist_ok=True)
        if a.quick:
            corpus = out / "synthetic.txt"
            corpus.write_text("<|endoftext|>".join(synthetic_documents(100_000)), encoding="utf-8")
            speedrun(out / "base", corpus=str(corpus), model_size="tiny", budget="4steps", vocab_size=300,
                     device="cpu", progress=False, sft_budget=None, sample_tokens=4)
            base, a.corpus, a.steps, a.items = out / "base" / "run", str(corpus), 2, 2
        elif not a.base:
            ap.error("give --base RUN (or --quick)")
        else:
            base = Path(a.base)
        paths, rows = _resolve_corpus(a.corpus), {}
        model, tok, _ = load_model(base, device="cpu")
        first, second = copy_probe(model, tok.vocab_size, length=min(60, model.cfg.context_length // 2))
        print(f"in-context copying of the base: {first:.2f} nats on a random sequence's first occurrence, "
              f"{second:.2f} on its second (gain {first - second:+.2f})", flush=True)
        for name in a.variants:
            data = out / f"chat-{name}"
            _chat_data(paths, data, teach=VARIANTS[name])
            t0 = time.perf_counter()
            ft = _sft(base, data / "train.jsonl", data / "val.jsonl", out / f"sft-{name}", a.steps,
                      torch.device("cpu"), progress=False)
            model, tok, _ = load_model(out / f"sft-{name}", device="cpu")
            rows[name] = _chat_eval(model, tok, data / "val.jsonl", a.items)
            rows[name].update(steps=ft["step"], seconds=time.perf_counter() - t0, load=os.getloadavg()[0])
            print(f"{name}: {100 * rows[name]['accuracy']:.1f}% exact match after {ft['step']} steps "
                  f"({rows[name]['seconds']:.0f} s, load {rows[name]['load']:.1f})", flush=True)
        if a.out:
            (out / "results.json").write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    tasks = list(next(iter(rows.values()))["tasks"])
    print(f"\nbase {base}; {a.steps} fine-tuning steps; first {a.items} validation items per task; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n")
    print("| variant | " + " | ".join(tasks) + " | all | replies ended |")
    print("|---|" + "---:|" * (len(tasks) + 2))
    for name, r in rows.items():
        cells = [f"{100 * r['tasks'][t]['correct'] / r['tasks'][t]['n']:.0f}%" for t in tasks]
        print(f"| {name} | " + " | ".join(cells) + f" | {100 * r['accuracy']:.1f}% | {100 * r['ended']:.0f}% |")
    for name, r in rows.items():
        for t in tasks:
            ex = r["tasks"][t]["example"]
            print(f"{name} {t}: wanted {ex['answer']!r}, replied {ex['reply']!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
