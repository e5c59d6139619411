"""Serving throughput: ``lmforge serve`` (continuous batching) at 1, 4 and 16 concurrent clients over loopback vs
the same requests run one after another through Hugging Face ``generate``, same weights.

The weights are HF's random init mapped into lmforge with ``lmforge.interop.hf`` (the script checks the logits
agree) and written as a run directory; ``lmforge serve --run DIR --max-batch 16`` runs in its own process. The
tokenizer is byte-level for prompts, with extra decode-only tokens up to the model's vocabulary and no end-of-text
token, so every request generates exactly ``--new-tokens`` tokens on both sides. Requests are greedy
``/v1/completions`` with ``stream: true``: each client sends ``--per-client`` requests one after another, all
clients at once; time to first token (TTFT) is measured at the first streamed piece, latency at ``[DONE]``.

HF runs the same requests (same prompts, greedy, same number of new tokens) one after another with its default
generate (batch 1, dynamic cache): its TTFT is a one-token ``generate`` of the prompt (prefill + first token),
its latency the whole ``generate``. Each round runs the server side and then HF on the same request set
(alternating), ``--rounds`` rounds per concurrency; tables give medians with ranges and the throughput ratio.
The server's greedy text at concurrency 1 must equal HF's tokens (printed).

    python benchmarks/bench_serve.py            # d_model 512, 4 layers, 64 new tokens
    python benchmarks/bench_serve.py --quick    # tiny model, 8 new tokens, 1 round: a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import hf_twins, median, spread  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NO_PROXY = "127.0.0.1,localhost"


def build(args: argparse.Namespace, run_dir: Path):
    """(HF model, lmforge tokenizer) with the same weights; the run directory written for the server."""
    import dataclasses

    import yaml

    from lmforge.checkpoint import CheckpointManager, save_checkpoint
    from lmforge.model import ModelConfig
    from lmforge.run import mark
    from lmforge.tokenizer import Tokenizer

    cfg = ModelConfig(vocab_size=args.vocab, context_length=args.context, d_model=args.d_model,
                      n_layers=args.layers, n_heads=args.heads, d_ff=args.d_ff)
    ours, ref = hf_twins(cfg, check_tokens=16)
    vocab = {i: bytes([i]) for i in range(256)}
    vocab.update({i: f"<{i}>".encode() for i in range(256, cfg.vocab_size)})  # decode-only tokens
    tok = Tokenizer(vocab, [])
    run_dir.mkdir(parents=True)
    tok.save(run_dir / "tokenizer.json")
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"model": dataclasses.asdict(cfg)}))
    save_checkpoint(ours, None, 1, CheckpointManager(run_dir).path_for(1))
    mark(run_dir)
    return ref, tok


def prompts(n: int) -> list[str]:
    words = "the king said to his queen that night would bring a storm over the sea and all".split()
    return [f"Request {i}: " + " ".join(words[(i + k) % len(words)] for k in range(3)) for i in range(n)]


def start_server(run_dir: Path, max_batch: int, device: str = "auto") -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, NO_PROXY=NO_PROXY, no_proxy=NO_PROXY)
    p = subprocess.Popen([sys.executable, "-m", "lmforge.cli", "-q", "serve", "--run", str(run_dir), "--port", "0",
                          "--max-batch", str(max_batch), "--max-queue", "1024", "--device", device],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    line = p.stdout.readline()
    if "http://" not in line:
        p.kill()
        raise SystemExit(f"the server did not start: {line!r}\n{p.stderr.read()[-3000:]}")
    return p, line.split(" on ")[1].split()[0]


async def one_request(client, url: str, model: str, prompt: str, n: int) -> tuple[float, float, str]:
    """(TTFT s, latency s, text) of one streamed greedy completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    ttft, text = None, []
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {await r.aread()}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            piece = json.loads(line[6:])["choices"][0]["text"]
            if piece and ttft is None:
                ttft = time.perf_counter() - t0
            text.append(piece)
    return ttft if ttft is not None else time.perf_counter() - t0, time.perf_counter() - t0, "".join(text)


async def server_round(url: str, model: str, reqs: list[list[str]], n: int) -> tuple[float, list, list, list[str]]:
    """All clients at once, each its requests one after another: (wall s, TTFTs, latencies, texts in order)."""
    import httpx

    async with httpx.AsyncClient(trust_env=False, timeout=600, limits=httpx.Limits(max_connections=256)) as client:
        async def client_run(ps: list[str]) -> list[tuple[float, float, str]]:
            return [await one_request(client, url, model, p, n) for p in ps]

        t0 = time.perf_counter()
        results = await asyncio.gather(*(client_run(ps) for ps in reqs))
        wall = time.perf_counter() - t0
    flat = [r for rs in results for r in rs]
    return wall, [r[0] for r in flat], [r[1] for r in flat], [r[2] for r in flat]


def hf_round(ref, tok, reqs: list[list[str]], n: int) -> tuple[float, list, list, list[str]]:
    """The same requests one after another through HF generate: (wall s, TTFTs, latencies, texts)."""
    ttfts, lats, texts = [], [], []
    t0 = time.perf_counter()
    for p in (p for ps in reqs for p in ps):
        ids = torch.tensor([tok.encode(p)])
        with torch.inference_mode():
            t = time.perf_counter()
            ref.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
            ttfts.append(time.perf_counter() - t)
            t = time.perf_counter()
            out = ref.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            lats.append(time.perf_counter() - t)
        texts.append(tok.decode(out[0, ids.shape[1]:].tolist()))
    return time.perf_counter() - t0 - sum(ttfts), ttfts, lats, texts


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else xs[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny model, 8 new tokens, 1 round, 1 request per client")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--per-client", type=int, default=2, help="requests each client sends one after another")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    args.vocab, args.context, args.d_model, args.layers, args.heads, args.d_ff = 8192, 512, 512, 4, 16, 1344
    if args.quick:
        args.vocab, args.d_model, args.layers, args.heads, args.d_ff = 512, 64, 2, 4, 128
        args.new_tokens, args.rounds, args.per_client = 8, 1, 1
    n = args.new_tokens
    with tempfile.TemporaryDirectory(prefix="lmforge-bench-serve-") as tmp:
        run_dir = Path(tmp) / "bench"
        ref, tok = build(args, run_dir)
        server, url = start_server(run_dir, max(args.concurrency))
        try:
            print(f"model: d_model {args.d_model}, {args.layers} layers, {args.heads} heads, d_ff {args.d_ff}, vocab "
                  f"{args.vocab}; {n} new tokens per request, greedy; {args.per_client} request(s) per client; "
                  f"server --max-batch {max(args.concurrency)} in its own process; {torch.get_num_threads()} torch "
                  f"threads for HF; {args.rounds} alternating round(s)")
            asyncio.run(server_round(url, "bench", [prompts(1)], n))  # warm-up (server's first request)
            rows = []
            for c in args.concurrency:
                reqs = [prompts(c * args.per_client)[i::c] for i in range(c)]
                ours, theirs = [], []
                for _ in range(args.rounds):
                    ours.append(asyncio.run(server_round(url, "bench", reqs, n)))
                    theirs.append(hf_round(ref, tok, reqs, n))
                if c == args.concurrency[0]:
                    same = ours[0][3] == theirs[0][3]
                    print(f"server's greedy text equals HF generate's tokens: {same}")
                    if not same:
                        raise SystemExit("the server and HF produced different tokens: not the same work")
                total = c * args.per_client * n
                rows.append((c, [total / r[0] for r in ours], [total / r[0] for r in theirs],
                             [x for r in ours for x in r[1]], [x for r in ours for x in r[2]],
                             [x for r in theirs for x in r[1]], [x for r in theirs for x in r[2]]))
        finally:
            server.terminate()
            server.wait(60)
    print("\n| clients | lmforge serve tok/s: median (range) | HF generate sequential tok/s | ratio | "
          "TTFT p50/p95 (ms) serve | HF | latency p50/p95 (ms) serve | HF |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for c, ours_tps, hf_tps, ttft, lat, hf_ttft, hf_lat in rows:
        print(f"| {c} | {spread(ours_tps, '.0f')} | {spread(hf_tps, '.0f')} | {median(ours_tps) / median(hf_tps):.2f}x"
              f" | {pct(ttft, 50) * 1e3:.0f}/{pct(ttft, 95) * 1e3:.0f} | {pct(hf_ttft, 50) * 1e3:.0f}/"
              f"{pct(hf_ttft, 95) * 1e3:.0f} | {pct(lat, 50) * 1e3:.0f}/{pct(lat, 95) * 1e3:.0f} | "
              f"{pct(hf_lat, 50) * 1e3:.0f}/{pct(hf_lat, 95) * 1e3:.0f} |")


if __name__ == "__main__":
    main()
