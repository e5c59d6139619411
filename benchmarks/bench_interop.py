"""Export and import time for the demo-sized model (``lmforge speedrun``'s ``small`` preset: d_model 256, 4 layers,
8 heads, context 256, tied embeddings, a 4096-token BPE of Shakespeare; ~4.2M parameters, 17 MB of float32).

A run with that shape and random weights is written once (training does not change the time of a copy); then,
alternating for several rounds in one process:

* export: ``export_hf`` (HF folder), ``export_gguf`` as f32 and as q8_0 — no peer writes lmforge runs;
* import/load: ``import_hf`` (HF folder -> a new run: read, map, write a checkpoint); ``open_run`` of the
  imported run (read and verify the checkpoint's checksum); loading it into a model the way ``generate`` does
  (``open_run`` + ``TransformerLM(cfg)``, whose random init is drawn first, + ``apply_checkpoint``); and the peer,
  ``transformers.AutoModelForCausalLM.from_pretrained`` of the same folder (which builds on the meta device).

    python benchmarks/bench_interop.py            # demo size, 5 rounds
    python benchmarks/bench_interop.py --quick    # a tiny model, 2 rounds: a smoke run
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (EOT, add_json_flag, alternate, median, ratio, shakespeare_documents, spread,  # noqa: E402
                     synthetic_documents, write_json, write_run)


def make_run(root: Path, a: argparse.Namespace) -> Path:
    """A run directory of the demo shape with random weights and a BPE trained on Shakespeare (synthetic text
    with ``--quick``)."""
    from lmforge.model import ModelConfig
    from lmforge.tokenizer import Tokenizer, train_bpe_from_iterator

    docs = synthetic_documents(30_000) if a.quick else shakespeare_documents()
    vocab, merges = train_bpe_from_iterator(docs, a.vocab, [EOT], progress=False)
    tok = Tokenizer(vocab, merges, [EOT])
    cfg = ModelConfig(vocab_size=tok.vocab_size, context_length=a.context, d_model=a.d_model, n_layers=a.layers,
                      n_heads=a.heads, tie_embeddings=True)
    return write_run(root, tok, cfg)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a tiny model and 2 rounds (a smoke run)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    add_json_flag(p)
    a = p.parse_args()
    shape = dict(d_model=256, layers=4, heads=8, context=256, vocab=4096)
    if a.quick:
        shape = dict(d_model=32, layers=2, heads=2, context=32, vocab=300)
        a.rounds = min(a.rounds, 2)
    for k, v in shape.items():
        setattr(a, k, v)

    import torch
    import transformers

    from lmforge.checkpoint import apply_checkpoint
    from lmforge.config import from_dict
    from lmforge.interop.gguf import export_gguf
    from lmforge.interop.hf_export import export_hf
    from lmforge.interop.hf_import import import_hf
    from lmforge.model import ModelConfig, TransformerLM
    from lmforge.run import open_run

    torch.set_num_threads(a.threads)
    transformers.logging.set_verbosity_error()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        run = make_run(root, a)
        hf = export_hf(run, root / "hf")
        imported = import_hf(hf, root / "imported")
        size_mb = sum(f.stat().st_size for f in hf.glob("*.safetensors")) / 1e6

        def load_imported() -> None:
            r = open_run(imported)
            apply_checkpoint(r.checkpoint, TransformerLM(from_dict(ModelConfig, r.config["model"], path="model")))

        exports = alternate({
            "export hf": lambda: export_hf(run, root / "hf2", force=True),
            "export gguf f32": lambda: export_gguf(run, root / "m.gguf", force=True),
            "export gguf q8_0": lambda: export_gguf(run, root / "q.gguf", dtype="q8_0", force=True),
        }, a.rounds)
        loads = alternate({
            "lmforge import hf": lambda: import_hf(hf, root / "imported2", force=True),
            "lmforge open_run": lambda: open_run(imported),
            "lmforge load model": load_imported,
            "transformers from_pretrained": lambda: transformers.AutoModelForCausalLM.from_pretrained(
                hf, dtype=torch.float32),
        }, a.rounds)

    print(f"\n### Interop: export and import, d_model {a.d_model}, {a.layers} layers, vocab {a.vocab} "
          f"({size_mb:.1f} MB of float32 weights), {a.rounds} rounds, {a.threads} threads\n")
    print("| operation | time (s): median (range) | MB/s (median) | time / lmforge |")
    print("|---|---:|---:|---:|")
    for name, times in exports.items():
        print(f"| {name} | {spread(times)} | {size_mb / median(times):.0f} | - |")
    base = loads["lmforge load model"]
    for name, times in loads.items():
        rel = f"{ratio(times, base):.2f}x" if name in ("lmforge load model", "transformers from_pretrained") else "-"
        print(f"| {name} | {spread(times)} | {size_mb / median(times):.0f} | {rel} |")
    write_json(a.json, {"weights_mb": size_mb, "seconds": {**exports, **loads}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
