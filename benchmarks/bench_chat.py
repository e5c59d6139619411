"""Chat speed: time to first token and tokens/s of ``lmforge chat``'s session vs HF ``generate``, same weights.

A chat model (random weights, HF init, mapped into ours with ``lmforge.interop.hf``; a 4,000-token BPE tokenizer
trained on 2 MB of the built-in Shakespeare corpus, with the chat tokens added) holds a conversation of ``--turns`` user messages. lmforge runs it
through :class:`lmforge.chat.ChatSession` (render the history with the chat format, prefill, stream the reply
from the decode kernels); HF gets the same prompt ids (the same renderer) each turn and runs
``LlamaForCausalLM.generate`` with a streamer that timestamps every token. Both decode greedily exactly
``--new-tokens`` tokens per reply (the end token is ignored so every reply has the same length; tools off) and
must produce the same tokens, else the script exits. Both re-read the whole history each turn (no cache
kept between turns), as the chat does.

Sides alternate (one conversation each per round, ``--repeats`` rounds after a warm-up each). Reported per side:
time to first token (median over rounds and turns, range), decode tokens/s after the first token, and the wall
time of a conversation; ratios are HF / lmforge (> 1: lmforge faster).

    python benchmarks/bench_chat.py            # d_model 512, 4 layers, 4 turns, 64 tokens per reply
    python benchmarks/bench_chat.py --quick    # smaller and shorter, a smoke run

``--prefix-reuse``: lmforge alone, a ~2,000-token conversation (the demo's small shape, d_model 256, 4 layers, 8
heads, context 2048, random weights): turn 1 is a long user message, turn 2 a short one. Each round holds the
conversation twice, alternating: with the prefix cache (``lmforge chat``'s default) and without
(``--prefix-cache-mb 0``). Reported per side and turn: time to the first token (the turn's first token out of
``Generator.turn``, median and range over rounds) and the prompt tokens prefilled; the ratio turn 1 / turn 2 with
reuse (the issue's target: >= 5x); the replies must be the same on both sides.

    python benchmarks/bench_chat.py --prefix-reuse            # ~1,900-token turn 1, 32 tokens per reply, 5 rounds
    python benchmarks/bench_chat.py --prefix-reuse --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (add_json_flag, alternate, median, shakespeare_documents, spread, synthetic_documents,  # noqa: E402
                     write_json)
from bench_generate import build_models  # noqa: E402

MESSAGES = ["Hello there, how are you today?", "Tell me about the king and the queen of the land.",
            "What did the lord say to the lady at night?", "Why is the sweet heart of heaven so good?",
            "Say it again, please, but shorter.", "Thank you, good night."]


def chat_tokenizer(vocab_size: int, quick: bool):
    """A BPE tokenizer with the chat tokens appended, trained on 2 MB of Shakespeare (synthetic text if quick)."""
    from lmforge.chat import add_chat_tokens
    from lmforge.tokenizer import Tokenizer, train_bpe

    docs = synthetic_documents(500_000) if quick else shakespeare_documents()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "corpus.txt")
        with open(path, "w", encoding="utf-8") as f:
            f.write("<|endoftext|>".join(docs)[:2_000_000])
        tok = Tokenizer(*train_bpe(path, vocab_size, ["<|endoftext|>"], progress=False), ["<|endoftext|>"])
    return add_chat_tokens(tok)


class Stamps:
    """An HF streamer recording the time of each generated token (the first ``put`` is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.tokens: list[int] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())
        self.tokens.extend(value.flatten().tolist())

    def end(self) -> None:
        pass


class FirstToken:
    """``Generator.turn`` as the chat calls it, stamping when each turn's first token comes out."""

    def __init__(self, gen) -> None:
        self.turn, self.times = gen.turn, []

    def __call__(self, *args, **kwargs):
        return Stamped(self.turn(*args, **kwargs), self.times)


class Stamped:
    """A turn that appends the time of its first token to ``times``."""

    def __init__(self, turn, times: list[float]) -> None:
        self.turn, self.times = turn, times

    def __iter__(self):
        for i, item in enumerate(self.turn):
            if i == 0:
                self.times.append(time.perf_counter())
            yield item

    def __getattr__(self, name: str):
        return getattr(self.turn, name)


def prefix_reuse(args: argparse.Namespace) -> None:
    """Time to first token of a long conversation's turns 1 and 2, with the prefix cache and without."""
    from lmforge.chat.session import ChatSession
    from lmforge.generate import Generator
    from lmforge.generate.prefix_cache import PrefixCache
    from lmforge.model import ModelConfig, TransformerLM

    ctx, d, layers, heads, vocab, n = (512, 64, 2, 4, 400, 8) if args.quick else (2048, 256, 4, 8, 4000, 32)
    tok = chat_tokenizer(vocab, args.quick)
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64 * -(-tok.vocab_size // 64), context_length=ctx, d_model=d, n_layers=layers,
                      n_heads=heads)
    gen = Generator(TransformerLM(cfg).eval(), tok)
    stamp = gen.turn = FirstToken(gen)
    docs = synthetic_documents(200_000) if args.quick else shakespeare_documents()
    short = MESSAGES[1]
    room = ctx - 2 * n - len(tok.encode(short)) - 24  # turn 2 holds turn 1, its reply, the short message, chat tokens
    long = tok.decode(tok.encode(" ".join(" ".join(docs[:3]).split()))[:room])
    sides = {"prefix cache": True, "no prefix cache": False}
    ttft: dict[str, list[list[float]]] = {s: [[], []] for s in sides}
    prefilled: dict[str, list[int]] = {}
    prompts: list[int] = []
    replies: dict[str, list[list[int]]] = {}

    def conversation(side: str) -> None:
        gen.prefix_cache = PrefixCache(256 << 20) if sides[side] else None
        session = ChatSession(gen, max_new_tokens=n, temperature=0, tools=False)
        session.stop_ids = []  # fixed-length replies
        out, counts = [], []
        for turn, msg in enumerate((long, short)):
            t0 = time.perf_counter()
            stream = session.send(msg)
            for _ in stream:
                pass
            if stream.reply.dropped_turns:
                raise SystemExit("turn 2 dropped turn 1 to fit the context: shorten the first message")
            ttft[side][turn].append(stamp.times[-1] - t0)
            out.append(stream.reply.ids)
            counts.append(getattr(stream.reply, "prefilled", None))  # None: a tree without Reply.prefilled
            prompts[turn:turn + 1] = [len(stream.prompt)]
        replies[side], prefilled[side] = out, counts

    alternate({s: (lambda s=s: conversation(s)) for s in sides}, args.repeats, warmup=1)
    for side in sides:  # drop the warm-up round
        ttft[side] = [xs[1:] for xs in ttft[side]]
    same = replies["prefix cache"] == replies["no prefix cache"]
    print(f"model: d_model {d}, {layers} layers, {heads} heads, vocab {cfg.vocab_size}, context {ctx}, random "
          f"weights; 2 turns: prompts of {prompts[0]:,} and {prompts[1]:,} tokens, {n} new tokens each, greedy, cpu, "
          f"{torch.get_num_threads()} threads; {args.repeats} alternating rounds\n")
    print("| side | turn 1: time to first token, ms | turn 2: time to first token, ms | turn 1 / turn 2 | "
          "prompt tokens prefilled (turn 1, turn 2) |")
    print("|---|---:|---:|---:|---:|")
    for side in sides:
        t1, t2 = ttft[side]
        print(f"| {side} | {spread([t * 1e3 for t in t1], '.1f')} | {spread([t * 1e3 for t in t2], '.1f')} | "
              f"{median(t1) / median(t2):.1f}x | {', '.join(map(str, prefilled[side]))} |")
    reuse = ttft["prefix cache"]
    print(f"\nwith the prefix cache turn 2 answers its first token {median(reuse[0]) / median(reuse[1]):.1f}x faster "
          f"than turn 1, {median(ttft['no prefix cache'][1]) / median(reuse[1]):.1f}x faster than turn 2 without it")
    print(f"same replies with and without the prefix cache: {same}")
    write_json(args.json, {"time_to_first_token_s": ttft, "prefilled_tokens": prefilled, "prompt_tokens": prompts,
                           "same_tokens": same})
    if not same:
        raise SystemExit("the replies differ with and without the prefix cache")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small model, 2 turns of 16 tokens, 2 rounds")
    p.add_argument("--prefix-reuse", action="store_true", help="lmforge alone: a long conversation's turn 1 vs turn "
                   "2, with and without the prefix cache (see the docstring)")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=64, help="tokens per reply")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds (each side once per round)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    add_json_flag(p)
    args = p.parse_args()
    args.context, args.d_model, args.layers, args.heads, vocab = 512, 512, 4, 16, 4000
    if args.quick:
        args.d_model, args.layers, args.heads, vocab = 128, 2, 4, 400
        args.turns, args.new_tokens, args.repeats = 2, 16, 2
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.prefix_reuse:
        return prefix_reuse(args)
    if not 1 <= args.turns <= len(MESSAGES):
        raise SystemExit(f"--turns must be in [1, {len(MESSAGES)}]")

    from lmforge.chat import ChatFormat
    from lmforge.chat.session import ChatSession
    from lmforge.generate import Generator

    tok = chat_tokenizer(vocab, args.quick)
    args.vocab, args.d_ff, args.device = tok.vocab_size, None, "cpu"
    cfg, ours, ref = build_models(args)  # the same weights in both, logits checked
    fmt = ChatFormat(tok)
    gen = Generator(ours, tok)
    n = args.new_tokens
    print(f"model: d_model {cfg.d_model}, {cfg.n_layers} layers, {cfg.n_heads} heads, vocab {cfg.vocab_size}, "
          f"context {cfg.context_length}; {args.turns} turns of {n} new tokens, greedy, cpu, "
          f"{torch.get_num_threads()} threads; {args.repeats} alternating rounds")

    ttft: dict[str, list[float]] = {"lmforge": [], "HF": []}
    rate: dict[str, list[float]] = {"lmforge": [], "HF": []}
    replies: dict[str, list[list[int]]] = {}

    def lmforge_chat() -> None:
        session = ChatSession(gen, max_new_tokens=n, temperature=0, tools=False)
        session.stop_ids = []  # fixed-length replies, as HF's min_new_tokens gives
        out = []
        for msg in MESSAGES[:args.turns]:
            t0 = time.perf_counter()
            stream = session.send(msg)
            first = None
            for _ in stream:
                first = first or time.perf_counter()
            t1 = time.perf_counter()
            ids = stream.reply.ids
            ttft["lmforge"].append((first or t1) - t0)
            rate["lmforge"].append((len(ids) - 1) / (t1 - (first or t1)))
            out.append(ids)
        replies["lmforge"] = out

    def hf_chat() -> None:
        history: list[dict] = []
        out = []
        for msg in MESSAGES[:args.turns]:
            t0 = time.perf_counter()
            prompt = fmt.render_for_completion(history + [{"role": "user", "content": msg}])
            stamps = Stamps()
            with torch.inference_mode():
                ref.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             streamer=stamps)
            ttft["HF"].append(stamps.times[0] - t0)
            rate["HF"].append((len(stamps.tokens) - 1) / (stamps.times[-1] - stamps.times[0]))
            history += [{"role": "user", "content": msg}, {"role": "assistant", "content": tok.decode(stamps.tokens)}]
            out.append(stamps.tokens)
        replies["HF"] = out

    walls = alternate({"lmforge": lmforge_chat, "HF": hf_chat}, args.repeats, warmup=1)
    k = args.turns  # drop the warm-up round's measurements
    for side in ttft:
        ttft[side], rate[side] = ttft[side][k:], rate[side][k:]
    same = replies["lmforge"] == replies["HF"]
    print("\n| side | time to first token, ms: median (range) | decode tok/s: median (range) | "
          "conversation wall s: median (range) |")
    print("|---|---:|---:|---:|")
    for side in ("lmforge", "HF"):
        print(f"| {side} | {spread([t * 1e3 for t in ttft[side]], '.1f')} | {spread(rate[side], ',.0f')} | "
              f"{spread(walls[side], '.2f')} |")
    print(f"\nHF / lmforge: time to first token {median(ttft['HF']) / median(ttft['lmforge']):.2f}x, "
          f"decode tok/s {median(rate['lmforge']) / median(rate['HF']):.2f}x (lmforge/HF), "
          f"conversation wall time {median(walls['HF']) / median(walls['lmforge']):.2f}x")
    print(f"lmforge produced HF's tokens: {same}")
    write_json(args.json, {"time_to_first_token_s": ttft, "decode_tokens_per_s": rate, "conversation_wall_s": walls,
                           "same_tokens": same})
    if not same:
        raise SystemExit("lmforge and HF replies differ: not the same work")


if __name__ == "__main__":
    main()
