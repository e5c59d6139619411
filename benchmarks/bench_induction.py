"""How many steps an induction circuit takes to form on a pure copy task, per model option.

Each row of a batch is ``--context`` random ids (of ``--vocab``) with one span of ``L`` ids (8..24) repeated after a
gap of ``0..L`` ids, at a random place. The loss is on the repeat only (its first id excepted: nothing in the row
predicts it), so it starts at ``ln(vocab)`` and falls towards 0 only when the model copies: the span, the gap and the
place vary, so no head can do it by attending a fixed distance back; it has to find the earlier occurrence of the
current id and read the id after it (an induction circuit). This isolates what the copy mixture
(``data.copy_fraction``) asks of pretraining, without the corpus around it.

The model is lmforge's ``TransformerLM`` with the variant's options (``plain``, ``key-offset``, ``smear-keys``); the
optimizer is the speedrun's recipe (``speedrun._run_config``'s optimizer section through the training loop's
``_build_optimizer``: Muon for the hidden matrices, AdamW groups for the rest) at its base rates, no schedule. Load-
independent and deterministic per seed: the figure is the step at which the loss first falls below ``--below``.

    python benchmarks/bench_induction.py --variants plain key-offset --d-model 64 --layers 2 --steps 1200
    python benchmarks/bench_induction.py --variants key-offset --d-model 256 --layers 4 --steps 700
    python benchmarks/bench_induction.py --quick
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_json_flag, write_json  # noqa: E402

OPTIONS = {"plain": {}, "key-offset": {"key_offset": True}, "smear-keys": {"smear_keys": True}}
"""Each variant's ``ModelConfig`` options."""
SPAN = (8, 24)
"""The repeated span's length range (ids, inclusive)."""


def copy_batch(gen: Any, rows: int, context: int, vocab: int) -> tuple[Any, Any]:
    """``(ids (rows, context), mask (rows, context - 1))``: random ids with one span repeated per row; ``mask``
    marks the targets (``ids[:, 1:]``) that copy an earlier id: the repeat after its first id."""
    import torch

    lo, hi = SPAN
    if context < 3 * hi:
        raise ValueError(f"--context must be at least {3 * hi} (a span of {hi}, its gap and its repeat)")
    ids = torch.randint(0, vocab, (rows, context), generator=gen)
    mask = torch.zeros(rows, context - 1, dtype=torch.bool)
    for b in range(rows):
        n = int(torch.randint(lo, hi + 1, (1,), generator=gen))
        gap = int(torch.randint(0, n + 1, (1,), generator=gen))
        at = int(torch.randint(0, context - 2 * n - gap + 1, (1,), generator=gen))
        second = at + n + gap
        ids[b, second:second + n] = ids[b, at:at + n]
        mask[b, second:second + n - 1] = True  # target j is ids[j + 1]: the repeat's ids after its first
    return ids, mask


def run(variant: str, a: argparse.Namespace, seed: int) -> dict[str, Any]:
    """Train one model on :func:`copy_batch` rows for ``a.steps`` steps; the loss every ``a.every`` steps and the
    first step at which it fell below ``a.below`` (None if it never did)."""
    import torch
    import torch.nn.functional as F

    from lmforge.model import TransformerLM
    from lmforge.model.transformer import ModelConfig
    from lmforge.speedrun import PRESETS, _run_config
    from lmforge.train.loop import _build_optimizer

    torch.manual_seed(seed)
    heads = max(1, a.d_model // 32)
    cfg = ModelConfig(vocab_size=a.vocab, context_length=a.context, d_model=a.d_model, n_layers=a.layers,
                      n_heads=heads, n_kv_heads=heads, d_ff=int(a.d_model * 2.75), **OPTIONS[variant])
    model = TransformerLM(cfg)
    recipe = _run_config(PRESETS["tiny"], a.vocab, Path("."), Path("tokenizer.json"), torch.device("cpu"), a.steps,
                         None).optimizer
    opt = _build_optimizer(model, recipe)
    gen = torch.Generator().manual_seed(seed + 1)
    curve, reached = [], None
    for step in range(1, a.steps + 1):
        ids, mask = copy_batch(gen, a.batch, a.context, a.vocab)
        logits = model(ids[:, :-1])
        losses = F.cross_entropy(logits.float().transpose(1, 2), ids[:, 1:], reduction="none")
        loss = losses[mask].mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % a.every == 0:
            value = loss.item()
            curve.append((step, round(value, 4)))
            print(f"{variant} seed {seed} step {step}: copy loss {value:.3f} nats", flush=True)
            if reached is None and value < a.below:
                reached = step
                if a.stop:
                    break
    return {"variant": variant, "seed": seed, "d_model": a.d_model, "layers": a.layers, "vocab": a.vocab,
            "context": a.context, "batch": a.batch, "steps_to_below": reached, "below": a.below, "curve": curve}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", nargs="+", default=["plain", "key-offset"], choices=list(OPTIONS))
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--every", type=int, default=100, help="steps between reported losses")
    ap.add_argument("--below", type=float, default=1.0, help="the copy loss (nats) that counts as copying")
    ap.add_argument("--stop", action="store_true", help="stop a run once its loss is below --below")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1337])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--quick", action="store_true", help="a small vocabulary and model: seconds")
    add_json_flag(ap)
    a = ap.parse_args(argv)
    if a.quick:
        a.vocab, a.d_model, a.layers, a.steps, a.every, a.batch = 32, 32, 2, 60, 20, 16
    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    rows = [run(v, a, s) for v in a.variants for s in a.seeds]
    print("\n| variant | seed | model | steps to < {:g} nats | last copy loss |\n|---|---|---|---:|---:|".format(a.below))
    for r in rows:
        print(f"| {r['variant']} | {r['seed']} | d{r['d_model']}x{r['layers']}, V {r['vocab']}, T {r['context']}, "
              f"B {r['batch']} | {r['steps_to_below'] or 'not within ' + str(a.steps)} | {r['curve'][-1][1]} |")
    write_json(a.json, {"rows": rows})
    return rows


if __name__ == "__main__":
    main()
