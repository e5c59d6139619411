"""Constrained decoding: schema validity over seeded random schemas, decode speed with and without constraints,
mask-construction time (cold and cached), n samples vs n requests, seeded determinism.

Sections (all on a byte-level BPE trained here on Shakespeare plus some multi-byte text, chat tokens appended):

* ``validity``: ``--requests`` chat-style requests, each with a schema from :func:`random_schema` (seeded), run
  through the scheduler on an untrained model at temperature 1 (random text: the mask alone makes it valid);
  every output is parsed and checked with ``jsonschema``; the target is 100%.
* ``speed``: decode tokens/s at batch 1 and 8, unconstrained vs JSON-Schema-constrained, alternating rounds
  (median and range), with the measured fp32 matmul peak and the load average.
* ``masks``: compile time per schema (cold: a new schema; cached: the same schema again) and mask time per token.
* ``n``: one request with n = 8 samples (one prefill) vs 8 separate requests; and seeded determinism: a seeded
  request's text alone vs inside a batch of 8 mixed requests (printed, and the script fails if it differs).
* ``--libraries``: xgrammar, llguidance and outlines-core side by side (compile time, mask time per token,
  invalid outputs of random walks, schema keywords refused or accepted); needs the three installed.

    python benchmarks/bench_constrained.py               # d_model 256, 4 layers, 1,000 schemas
    python benchmarks/bench_constrained.py --quick       # tiny sizes: a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import shakespeare_documents, spread, synthetic_documents  # noqa: E402

MULTIBYTE = "café naïve 日本語のテキスト 東京 大阪 Ελληνικά κείμενο 😀🎉 ünïcödé "


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """A JSON Schema of the kinds clients send (object/properties/required, string/number/integer/boolean/null,
    enum, array/items with min/max items, nested objects, ``additionalProperties: false``), sized so that a
    random model's document fits in a few hundred tokens (bounded strings, ranges and item counts)."""
    kinds = ["string", "integer", "number", "boolean", "null", "enum"] + (["object", "array"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        lo = 1 if rng.random() < 0.3 else 0
        return {"type": "string", "minLength": lo, "maxLength": lo + rng.randint(0, 6)}
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 500)}
    if kind == "number":
        return {"type": "number", "minimum": -10, "maximum": 10}
    if kind in ("boolean", "null"):
        return {"type": kind}
    if kind == "enum":
        pool = ["a", "b", "東京", "café", "😀", 1, 2.5, True, None, "x y"]
        return {"enum": rng.sample(pool, rng.randint(1, 4))}
    if kind == "array":
        lo = rng.randint(0, 2)
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": lo, "maxItems": lo + rng.randint(0, 2)}
    names = rng.sample(["id", "name", "city", "tags", "ok", "n", "x", "ünï", "deep"], rng.randint(1, 4))
    props = {k: random_schema(rng, depth + 1) for k in names}
    required = [k for k in names if rng.random() < 0.6]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def tokenizer(quick: bool) -> Any:
    from lmforge.chat import add_chat_tokens
    from lmforge.tokenizer import EOT, Tokenizer
    from lmforge.tokenizer.training import train_bpe_from_iterator

    docs = synthetic_documents(200_000) if quick else shakespeare_documents()
    vocab, merges = train_bpe_from_iterator(iter(docs + [MULTIBYTE * 50] * 20), 1024 if quick else 8192, [EOT],
                                            progress=False)
    return add_chat_tokens(Tokenizer(vocab, merges, [EOT]))


def model(tok: Any, args: argparse.Namespace) -> Any:
    from lmforge.model import ModelConfig, TransformerLM

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=tok.vocab_size, context_length=args.context, d_model=args.d_model,
                      n_layers=args.layers, n_heads=args.heads)
    return TransformerLM(cfg).eval()


def run_requests(sched: Any, reqs: list[Any]) -> float:
    """Submit ``reqs`` and run the scheduler until they finish; seconds taken."""
    t0 = time.perf_counter()
    for r in reqs:
        sched.submit(r)
    while sched.run_once() or sched.load()["waiting"]:
        pass
    return time.perf_counter() - t0


class Sink:
    def __init__(self) -> None:
        self.text, self.finish, self.n = [], None, 0

    def __call__(self, u: Any) -> None:
        self.text.append(u.text)
        if u.finish_reason is not None:
            self.finish, self.n = u.finish_reason, u.completion_tokens


def validity(tok: Any, lm: Any, args: argparse.Namespace) -> dict[str, Any]:
    import jsonschema

    from lmforge.generate import Engine
    from lmforge.generate.constraints import Grammars, RowConstraint, json_grammar
    from lmforge.generate.scheduler import Job, Scheduler

    grammars = Grammars(tok)
    sched = Scheduler(Engine(lm), tok, max_batch=8, max_queue=args.requests)
    end = tok.special_tokens["<|assistant_end|>"]
    rng = random.Random(args.seed)
    schemas = [random_schema(rng) for _ in range(args.requests)]
    sinks = [Sink() for _ in schemas]
    prompt = tok.encode("Reply in JSON.")
    reqs = [Job(prompt, args.context - len(prompt), s, temperature=1.0, seed=k, stop_ids=[end],
                    constraint=RowConstraint(grammars, json_grammar(sc), close_id=end))
            for k, (sc, s) in enumerate(zip(schemas, sinks))]
    seconds = run_requests(sched, reqs)
    bad = []
    for k, (sc, s) in enumerate(zip(schemas, sinks)):
        text = "".join(s.text)
        try:
            if s.finish != "stop":
                raise ValueError(f"finished by {s.finish}")
            jsonschema.validate(json.loads(text), sc)
        except Exception as e:  # noqa: BLE001
            bad.append((k, str(e)[:100], text[:120]))
    return {"requests": len(schemas), "valid": len(schemas) - len(bad), "bad": bad[:5], "seconds": seconds,
            "tokens": sum(s.n for s in sinks), "multibyte_outputs": sum(any(ord(c) > 127 for c in "".join(s.text))
                                                                         for s in sinks)}


def speed(tok: Any, lm: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Decode tokens/s, unconstrained vs constrained, batch 1 and 8, alternating rounds."""
    from lmforge.generate import Engine
    from lmforge.generate.constraints import Grammars, RowConstraint, json_grammar
    from lmforge.generate.scheduler import Job, Scheduler

    grammars = Grammars(tok)
    engine = Engine(lm)
    schema = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string"}}},
              "required": ["items"], "additionalProperties": False}  # long documents: the budget ends them
    prompt = tok.encode("Reply in JSON.")
    rows = []
    for batch in (1, 8):
        times: dict[str, list[float]] = {"free": [], "json": []}
        for _ in range(args.rounds):
            for mode in ("free", "json"):
                sched = Scheduler(engine, tok, max_batch=batch)
                reqs = [Job(prompt, args.new_tokens, Sink(), temperature=1.0, seed=k,
                                constraint=RowConstraint(grammars, json_grammar(schema), close_id=tok.eot_id)
                                if mode == "json" else None) for k in range(batch)]
                for r in reqs:
                    sched.submit(r)
                sched.run_once()  # admission and the first step are not decoding
                t0 = time.perf_counter()
                while sched.run_once():
                    pass
                times[mode].append(batch * (args.new_tokens - 2) / (time.perf_counter() - t0))
        free, cons = statistics.median(times["free"]), statistics.median(times["json"])
        rows.append({"batch": batch, "free": spread(times["free"]), "json": spread(times["json"]),
                     "slowdown": 1 - cons / free})
    return rows


def masks(tok: Any, args: argparse.Namespace) -> dict[str, float]:
    from lmforge.generate.constraints import Grammars, json_grammar

    grammars = Grammars(tok)
    rng = random.Random(args.seed + 1)
    schemas = [random_schema(rng) for _ in range(50)]
    t0 = time.perf_counter()
    for sc in schemas:
        grammars.compile(json_grammar(sc))
    cold = (time.perf_counter() - t0) / len(schemas)
    t0 = time.perf_counter()
    for sc in schemas:
        grammars.compile(json_grammar(sc))
    cached = (time.perf_counter() - t0) / len(schemas)
    m = grammars.compile(json_grammar(schemas[0])).deep_copy()
    tm, r = [], random.Random(0)
    for _ in range(200):
        t0 = time.perf_counter()
        allowed = grammars.allowed(m)
        tm.append(time.perf_counter() - t0)
        ids = torch.nonzero(allowed[:-1]).flatten().tolist()
        if not ids:
            break
        m.consume_token(r.choice(ids))
    return {"compile_cold_ms": cold * 1e3, "compile_cached_ms": cached * 1e3,
            "mask_us": statistics.median(tm) * 1e6}


def samples(tok: Any, lm: Any, args: argparse.Namespace) -> dict[str, Any]:
    from lmforge.generate import Engine
    from lmforge.generate.scheduler import Job, Scheduler

    engine = Engine(lm)
    prompt = tok.encode("To be, or not to be, that is the question: " * 4)[: args.context // 2]
    n_new = min(args.new_tokens, args.context - len(prompt))
    t_many, t_sep = [], []
    for _ in range(args.rounds):
        sched = Scheduler(engine, tok, max_batch=8)
        reqs = [Job(prompt, n_new, Sink(), temperature=1.0, seed=k) for k in range(8)]
        t0 = time.perf_counter()
        sched.submit_many(reqs)
        while sched.run_once():
            pass
        t_many.append(time.perf_counter() - t0)
        sched = Scheduler(engine, tok, max_batch=8)
        t_sep.append(run_requests(sched, [Job(prompt, n_new, Sink(), temperature=1.0, seed=k) for k in range(8)]))
    # seeded determinism: alone vs in a batch of 8 mixed requests
    def text_of(reqs: list[Any], sink: Sink) -> str:
        run_requests(Scheduler(engine, tok, max_batch=8), reqs)
        return "".join(sink.text)

    alone_sink, mixed_sink = Sink(), Sink()
    alone = text_of([Job(prompt, n_new, alone_sink, temperature=0.8, seed=42)], alone_sink)
    others = [Job(tok.encode(f"other {k}"), n_new, Sink(), temperature=0.5 + 0.1 * k, seed=k) for k in range(7)]
    mixed = text_of(others[:3] + [Job(prompt, n_new, mixed_sink, temperature=0.8, seed=42)] + others[3:],
                    mixed_sink)
    return {"n8": spread(t_many), "separate8": spread(t_sep), "ratio": statistics.median(t_sep) / statistics.median(t_many),
            "prompt_tokens": len(prompt), "seeded_same": alone == mixed}


def libraries(tok: Any) -> None:
    """xgrammar vs llguidance vs outlines-core on this vocabulary (each skipped when not installed)."""
    import importlib.util

    import jsonschema
    import numpy as np

    V = tok.vocab_size
    special = set(tok.special_tokens.values())
    end = tok.special_tokens["<|assistant_end|>"]
    toks = [b"" if i in special else tok.decode_bytes([i]) for i in range(V)]
    rng = random.Random(7)
    schemas = [random_schema(rng) for _ in range(30)]
    struct = np.array([any(c in toks[i] for c in b'"}],') or i == end for i in range(V)])

    def walk(mask_fn: Any, consume: Any, seed: int) -> tuple[list[int], list[float]]:
        r, out, tm = random.Random(seed), [], []
        for _ in range(400):
            t0 = time.perf_counter()
            allowed = mask_fn()
            tm.append(time.perf_counter() - t0)
            idx = np.nonzero(allowed[:V])[0]
            if not len(idx):
                break
            s = idx[struct[idx]]
            t = int(r.choice(s if len(s) and r.random() < 0.3 else idx))
            if t == end:
                break
            consume(t)
            out.append(t)
        return out, tm

    def valid(out: list[int], schema: dict[str, Any]) -> bool:
        """Whether a walk's tokens decode to JSON that the schema accepts."""
        try:
            jsonschema.validate(json.loads(tok.decode(out)), schema)
        except Exception:  # noqa: BLE001
            return False
        return True

    def unpack(words: Any) -> Any:
        return np.unpackbits(np.asarray(words).view(np.uint8), bitorder="little").astype(bool)

    print("\n## Libraries on this vocabulary (30 random schemas, one biased random walk each)\n")
    print("| library | compile ms (median) | mask µs/token (median) | invalid outputs |")
    print("|---|---|---|---|")
    results = {}
    if importlib.util.find_spec("llguidance"):
        from lmforge.generate.constraints import Grammars, json_grammar
        g = Grammars(tok, isolate=False)  # the library alone, as the others run: no sacrificial check process
        comp, tm_all, bad = [], [], 0
        for k, sc in enumerate(schemas):
            t0 = time.perf_counter()
            m = g.compile(json_grammar(sc)).deep_copy()
            comp.append(time.perf_counter() - t0)
            words = torch.empty(g.words, dtype=torch.int32)

            def mask() -> Any:
                m.unsafe_compute_mask_ptr(words.data_ptr(), g.words * 4)
                a = unpack(words.numpy())
                a[end] = a[V]
                return a
            out, tm = walk(mask, m.consume_token, k)
            tm_all += tm
            bad += not valid(out, sc)
        results["llguidance"] = (statistics.median(comp) * 1e3, statistics.median(tm_all) * 1e6, bad)
    if importlib.util.find_spec("xgrammar"):
        import xgrammar as xgr
        info = xgr.TokenizerInfo(toks, vocab_type=xgr.VocabType.RAW, vocab_size=V, stop_token_ids=[end])
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        comp, tm_all, bad = [], [], 0
        bm = xgr.allocate_token_bitmask(1, V)
        for k, sc in enumerate(schemas):
            t0 = time.perf_counter()
            cg = compiler.compile_json_schema(json.dumps(sc), any_whitespace=False)
            comp.append(time.perf_counter() - t0)
            mt = xgr.GrammarMatcher(cg)

            def mask() -> Any:
                mt.fill_next_token_bitmask(bm)
                return unpack(bm.numpy())
            out, tm = walk(mask, mt.accept_token, k)
            tm_all += tm
            bad += not valid(out, sc)
        results["xgrammar"] = (statistics.median(comp) * 1e3, statistics.median(tm_all) * 1e6, bad)
    if importlib.util.find_spec("outlines_core"):
        import outlines_core as oc
        from outlines_core.json_schema import build_regex_from_schema
        d: dict[bytes, list[int]] = {}
        for i, b in enumerate(toks):
            if b:
                d.setdefault(b, []).append(i)
        voc = oc.Vocabulary(end, d)
        comp, tm_all, bad = [], [], 0
        for k, sc in enumerate(schemas):
            t0 = time.perf_counter()
            index = oc.Index(build_regex_from_schema(json.dumps(sc), whitespace_pattern=""), voc)
            comp.append(time.perf_counter() - t0)
            guide = oc.Guide(index)
            words = torch.zeros((V + 31) // 32, dtype=torch.int32)

            def mask() -> Any:
                guide.write_mask_into(words.data_ptr(), words.numel(), 4)
                return unpack(words.numpy())
            out, tm = walk(mask, guide.advance, k)
            tm_all += tm
            bad += not valid(out, sc)
        results["outlines-core"] = (statistics.median(comp) * 1e3, statistics.median(tm_all) * 1e6, bad)
    for name, (c, m, b) in results.items():
        print(f"| {name} | {c:.2f} | {m:.1f} | {b}/{len(schemas)} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    ap.add_argument("--requests", type=int, default=1000, help="random-schema requests for the validity check")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--libraries", action="store_true", help="also compare xgrammar, llguidance, outlines-core")
    args = ap.parse_args()
    args.context, args.d_model, args.layers, args.heads = 384, 256, 4, 4
    if args.quick:
        args.requests, args.rounds, args.new_tokens = min(args.requests, 24), 1, 16
        args.context, args.d_model, args.layers, args.heads = 256, 32, 1, 2
    torch.manual_seed(0)
    from lmforge.hardware import matmul_peak_flops

    peak = matmul_peak_flops()
    tok = tokenizer(args.quick)
    lm = model(tok, args)
    print(f"# Constrained decoding (vocab {tok.vocab_size}, d_model {args.d_model}, {args.layers} layers; "
          f"fp32 matmul peak {peak / 1e9:.0f} GFLOP/s; load average {os.getloadavg()[0]:.2f})\n")
    v = validity(tok, lm, args)
    print(f"schema-valid outputs: {v['valid']}/{v['requests']} ({v['tokens']} tokens in {v['seconds']:.1f} s; "
          f"{v['multibyte_outputs']} outputs hold multi-byte characters)")
    for b in v["bad"]:
        print("  invalid:", b)
    m = masks(tok, args)
    print(f"\nmask construction: compile {m['compile_cold_ms']:.2f} ms per new schema (cold), "
          f"{m['compile_cached_ms'] * 1e3:.1f} µs cached; mask {m['mask_us']:.1f} µs per token\n")
    print("| batch | unconstrained tok/s | JSON Schema tok/s | slowdown |")
    print("|---|---|---|---|")
    for r in speed(tok, lm, args):
        print(f"| {r['batch']} | {r['free']} | {r['json']} | {100 * r['slowdown']:.1f}% |")
    s = samples(tok, lm, args)
    print(f"\nn = 8 samples of one {s['prompt_tokens']}-token prompt: {s['n8']} s; 8 separate requests: "
          f"{s['separate8']} s ({s['ratio']:.2f}x)")
    print(f"seeded request alone == in a batch of 8 mixed requests: {s['seeded_same']}")
    if args.libraries:
        libraries(tok)
    if v["valid"] != v["requests"] or not s["seeded_same"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
