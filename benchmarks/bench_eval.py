"""Multiple-choice scoring speed: ``lmforge.evals`` vs the same scoring through ``transformers``, same weights.

Both models hold identical random weights (lmforge's init mapped into ``LlamaForCausalLM`` by
``lmforge.interop.hf``). The task is ``--items`` synthetic questions (a context of ~``--context-words`` words and
``--choices`` continuations of 3-12 words), or a task file / benchmark name with ``--task``.

* lmforge: ``lmforge.evals.run_task`` — each batch's distinct contexts are prefilled once into the KV cache and
  every choice continues from a copy of its context's cache row (``--batch-size`` requests per pass).
* transformers: what lm-eval-harness's HF backend does per item — every choice's full sequence
  ``context + continuation[:-1]``, right-padded into one batch with an attention mask, one forward, the
  continuation's log-probabilities gathered. Same tokenization (``lmforge.evals.encode_request``).

Before timing, the per-choice log-likelihoods of the two must agree within ``LL_TOL``, else the script exits.
The two then alternate for ``--rounds`` rounds after a warm-up; reported: items/s median (range) and the ratio.

    python benchmarks/bench_eval.py            # 64 items x 4 choices, d_model 256, 4 layers, context 256
    python benchmarks/bench_eval.py --quick    # a smoke run
    python benchmarks/bench_eval.py --task arc_easy --items 100   # after `lmforge data get evals`
"""

from __future__ import annotations

import argparse
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import alternate, median, spread, synthetic_documents  # noqa: E402

LL_TOL = 1e-4  # max |log-likelihood difference| per choice, fp32, same weights


def synthetic_task(docs: list[str], n_items: int, n_choices: int, context_words: int, seed: int = 0):
    """Multiple-choice items cut from ``docs``: a context of words, the true next words and distractors."""
    from lmforge.evals import ChoiceItem, Task

    rng = random.Random(seed)
    words = " ".join(docs).split()
    items = []
    for _ in range(n_items):
        s = rng.randrange(len(words) - context_words - 40)
        ctx = " ".join(words[s: s + context_words])
        choices = []
        for k in range(n_choices):
            at = s + context_words if k == 0 else rng.randrange(len(words) - 20)
            choices.append(" " + " ".join(words[at: at + rng.randint(3, 12)]))
        rng.shuffle(choices)
        items.append(ChoiceItem(tuple((ctx, c) for c in choices), 0))
    return Task("synthetic", "choice", items, "bench_eval")


def hf_scorer(model, tokenizer, task):
    """Per item, per choice log-likelihoods through ``transformers`` (one padded forward per item)."""
    from lmforge.evals import encode_request

    encoded = [[encode_request(tokenizer, c, x) for c, x in it.requests] for it in task.items]
    ctx_len = model.config.max_position_embeddings

    def run() -> list[list[float]]:
        out = []
        with torch.inference_mode():
            for reqs in encoded:
                seqs = []
                for c, x in reqs:
                    over = len(c) + len(x) - (ctx_len + 1)
                    seqs.append((c[over:] if over > 0 else c, x))
                width = max(len(c) + len(x) - 1 for c, x in seqs)
                ids = torch.zeros(len(seqs), width, dtype=torch.long)
                mask = torch.zeros(len(seqs), width, dtype=torch.long)
                for i, (c, x) in enumerate(seqs):
                    row = c + x[:-1]
                    ids[i, : len(row)] = torch.tensor(row)
                    mask[i, : len(row)] = 1
                lp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), -1)
                lls = []
                for i, (c, x) in enumerate(seqs):
                    tgt = torch.tensor(x)
                    lls.append(float(lp[i, len(c) - 1: len(c) - 1 + len(x)].gather(1, tgt[:, None]).sum()))
                out.append(lls)
        return out

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model and task: a smoke run")
    ap.add_argument("--task", help="a task file or name (default: synthetic items)")
    ap.add_argument("--items", type=int, default=64)
    ap.add_argument("--choices", type=int, default=4)
    ap.add_argument("--context-words", type=int, default=60)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=400, help="BPE vocabulary trained on the synthetic text (it runs out of "
                    "merges at 420)")
    ap.add_argument("--batch-size", type=int, default=16, help="lmforge: requests per forward pass")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    if a.quick:
        a.items, a.d_model, a.layers, a.heads, a.context, a.vocab, a.rounds = 6, 64, 2, 4, 128, 300, 1

    import transformers

    from lmforge.evals import resolve_task, run_task
    from lmforge.interop import hf
    from lmforge.model import ModelConfig, TransformerLM
    from lmforge.tokenizer import EOT, Tokenizer, train_bpe

    docs = synthetic_documents(200_000 if not a.quick else 30_000)
    corpus = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"lmforge-bench-eval-{os.getpid()}.txt")
    with open(corpus, "w", encoding="utf-8") as f:
        f.write(EOT.join(docs))
    try:
        tok = Tokenizer(*train_bpe(corpus, a.vocab, [EOT], progress=False), [EOT])
    finally:
        os.unlink(corpus)
    task = resolve_task(a.task) if a.task else synthetic_task(docs, a.items, a.choices, a.context_words)
    if task.type != "choice":
        sys.exit(f"--task must be a multiple-choice task, got a {task.type} task")
    task.items = task.items[: a.items]
    cfg = ModelConfig(vocab_size=tok.vocab_size, context_length=a.context, d_model=a.d_model, n_layers=a.layers,
                      n_heads=a.heads)
    torch.manual_seed(0)
    ours = TransformerLM(cfg).eval()
    theirs = transformers.LlamaForCausalLM(hf.hf_config(cfg)).eval()
    theirs.load_state_dict(hf.to_hf_state_dict(ours.state_dict(), cfg))
    hf_run = hf_scorer(theirs, tok, task)

    r = run_task(ours, tok, task, batch_size=a.batch_size, details=True)
    diff = max(abs(x - y) for it, h in zip(r["items"], hf_run()) for x, y in zip(it["lls"], h))
    n_req = sum(len(it.requests) for it in task.items)
    print(f"{len(task.items)} items, {n_req} choices; d_model {a.d_model}, {a.layers} layers, context {a.context}, "
          f"vocab {tok.vocab_size}, {torch.get_num_threads()} threads")
    print(f"same weights: max |log-likelihood difference| {diff:.2e} (tolerance {LL_TOL:g})")
    if diff > LL_TOL:
        sys.exit("lmforge and transformers disagree: not doing the same work")
    times = alternate({"lmforge": lambda: run_task(ours, tok, task, batch_size=a.batch_size),
                       "transformers": hf_run}, rounds=a.rounds)
    n = len(task.items)
    print("\n| scorer | items/s: median (range) | seconds: median (range) |")
    print("|---|---:|---:|")
    for name, ts in times.items():
        ips = [n / t for t in ts]
        print(f"| {name} | {spread(ips, '.1f')} | {spread(ts)} |")
    print(f"\nlmforge / transformers speed: {median(times['transformers']) / median(times['lmforge']):.2f}x "
          "(ratio of median times; > 1: lmforge is faster)")


if __name__ == "__main__":
    main()
