"""A seeded random fuzzer of lmforge._core's bindings, as a hostile or careless caller would call them: byte
spans that cut characters or leave the buffer, cache rows and lengths at and past every bound (2**64 - 1
included), shapes that disagree, counts near 2**63, every packed weight kind. Each call must give the answer its
contract says or refuse with ValueError/TypeError, and leave its outputs alone when it refuses. Each iteration runs
on one of the decode kernels' instruction sets that the CPU has (``_core.linear_isa()``'s names, the wider ones
switched off; "avx512_bf16": the bf16-activation mode on), picked at random, and a product's answer must be the
scalar code's bits. ``make sanitize`` runs it against the ASan + UBSan build, where a read or write out of bounds
aborts; ``tests/tools/test_fuzz_core.py`` runs a few hundred iterations on the normal build.

Usage: python tools/fuzz_core.py [--iterations N] [--seed S]
"""

from __future__ import annotations

import argparse
import random
import sys

import numpy as np

from lmforge import _native

POOL = [b" ", b"a", b"Z", b"7", b"'s", b"\n", b"\xc3\xa9", b"\xe2\x80\x83", b"\xf0\x9f\x98\x80", b"\xc3", b"\xe2\x80",
        b"\xf0", b"\xf0\x9f", b"\xff", b"\x80", b"\xed\xa0\x80", b"<|x|>"]
U64 = 2**64


def _text(rng: random.Random, n: int) -> bytes:
    return b"".join(rng.choice(POOL) for _ in range(n))


def _valid(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def fuzz_encode_spans(c, enc, rng: random.Random) -> None:
    buf = _text(rng, rng.randrange(12))
    n = rng.randrange(1, 4)
    edges = [-1, 0, len(buf), len(buf) + 1, 2**62]
    starts = [rng.choice([rng.randrange(len(buf) + 1)] * 4 + edges) for _ in range(n)]
    ends = [rng.choice([rng.randrange(len(buf) + 1)] * 4 + edges) for _ in range(n)]
    ok = all(0 <= a <= b <= len(buf) and _valid(buf[a:b]) for a, b in zip(starts, ends))
    try:
        tokens, lengths = enc.encode_spans(buf, np.array(starts, np.int64), np.array(ends, np.int64), 2, True, -1,
                                           -1, 4)
    except ValueError:
        assert not ok, (buf, starts, ends)
        return
    assert ok, ("encode_spans took a span it must refuse", buf, starts, ends)
    assert enc.decode_bytes(tokens.tolist()) == b"".join(buf[a:b] for a, b in zip(starts, ends))
    assert lengths.tolist() == [len(enc.encode(buf[a:b].decode(), True)) for a, b in zip(starts, ends)]


def fuzz_pretokenize(c, rng: random.Random) -> None:
    text = _text(rng, rng.randrange(10))
    try:
        pieces = c.pretokenize(text, rng.choice([c.PATTERN_GPT2, c.PATTERN_GPT4, c.PATTERN_NANOCHAT]))
    except ValueError:
        assert not _valid(text)
        return
    assert _valid(text) and b"".join(pieces) == text


def fuzz_split_documents(c, rng: random.Random) -> None:
    data = b"\n\n".join(_text(rng, rng.randrange(5)) for _ in range(rng.randrange(4)))
    consumed, pieces, starts, ends, crc, bad = c.split_documents(data, b"\n\n", True, True)
    assert all(0 <= a < b <= len(data) for a, b in zip(starts.tolist(), ends.tolist()))
    assert consumed <= len(data)


def fuzz_counts(c, rng: random.Random) -> None:
    counter = c.PretokenCounter(c.PATTERN_CUSTOM, [])
    total = 0
    for _ in range(3):
        counts = [rng.choice([0, 1, 2**62, 2**63 - 1, rng.randrange(2**63)]) for _ in range(rng.randrange(1, 3))]
        try:
            counter.add_counts([_text(rng, 2) or b"a" for _ in counts], counts)
        except ValueError:
            assert total + sum(counts) >= 2**63
            continue
        total += sum(counts)
        assert total < 2**63 and counter.total() == total
    try:
        c.train_bpe(counter, 3)
    except ValueError as e:
        assert "pair counts" in str(e)


# the decode kernels' instruction sets, widest first; "avx512_bf16" is the opt-in bf16-activation mode, whose
# products equal the others' bits here: activations and weights are small integers, exact in bf16
ISAS = ("avx512_bf16", "avx512_vnni", "avx512", "avx2", "scalar")


def use_isa(c, name: str) -> str:
    """Switch the decode kernels to instruction set ``name`` or the widest below it; returns what they run."""
    c.linear_bf16_activations(name == "avx512_bf16")
    c.linear_force_scalar(name == "scalar")
    c.linear_force_avx2(name == "avx2")
    c.linear_force_avx512(name == "avx512")
    return c.linear_isa()


def isas_of(c) -> list[str]:
    """The instruction sets this CPU runs the kernels on (the switches left off)."""
    found = [name for name in ISAS if use_isa(c, name) == name]
    use_isa(c, ISAS[1])  # the default: the widest set, the bf16-activation mode off
    return found


def packed_k(kind: int, k: int) -> int:
    """The packed array's middle dimension for ``k`` inputs (decode/kernels.h's layouts)."""
    return 16 * -(-k // 32) if kind in (4, 6) else 32 * -(-k // 32) if kind == 5 else k


def packed(rng: np.random.Generator, kind: int, n: int, k: int, extra: int = 0) -> tuple:
    """A random ``(n, k)`` matrix as ``linear_rows`` and ``DecodeModel`` take it: ``(w, kind, scales or None)``.
    Weights are small integers and scales powers of two, so every sum is exact and every instruction set (any
    order of sums) gives the same bits. ``extra`` adds rows to the packed ``k`` dimension (a wrong shape)."""
    shape = (-(-n // 8), packed_k(kind, k) + extra, 8)
    ints = rng.integers(-3, 4, shape).astype(np.float32)
    if kind == 0:
        w = ints
    elif kind == 1:
        w = (ints.view(np.uint32) >> 16).astype(np.uint16)  # bfloat16: the top half of the float32 (exact here)
    elif kind == 2:
        w = ints.astype(np.float16).view(np.uint16)
    elif kind in (3, 5):
        w = rng.integers(-127, 128, shape, dtype=np.int8)
    else:
        w = rng.integers(0, 256, shape, dtype=np.uint8)
    pow2 = 2.0 ** rng.integers(-8, 1, -(-n // 8) * 8 * -(-k // 32))
    scales = (None if kind < 3 else pow2.astype(np.float16).view(np.uint16) if kind in (4, 6)
              else pow2[:n].astype(np.float32))
    return w, kind, scales


class Step:
    """Random tiny models for DecodeModel.step, one per packed weight kind (0..6): vocab 13, C 8, 2 heads of 4,
    1 KV head, 2 layers."""

    def __init__(self, c, rng: np.random.Generator) -> None:
        self.V, self.C, self.H, self.Hkv, self.D, self.F, self.P, self.L = 13, 8, 2, 1, 4, 12, 9, 2
        ones = np.ones(self.C, np.float32)
        table = rng.standard_normal((self.P, self.D // 2)).astype(np.float32)
        self.models = []
        for kind in range(7):
            layer = (ones, packed(rng, kind, (self.H + 2 * self.Hkv) * self.D, self.C),
                     packed(rng, kind, self.C, self.H * self.D), ones, packed(rng, kind, 2 * self.F, self.C),
                     packed(rng, kind, self.C, self.F))
            self.models.append(c.DecodeModel(rng.standard_normal((self.V, self.C)).astype(np.float32), table, table,
                                             self.H, self.Hkv, self.F, 1e-5, [layer] * self.L, ones,
                                             packed(rng, kind, self.V, self.C), self.V))

    def fuzz(self, rng: random.Random) -> None:
        rows, S = rng.randrange(1, 4), rng.randrange(1, 8)
        shape = (self.L, rows, self.Hkv, S, self.D)
        k, v = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
        B, T = rng.randrange(1, rows + 2), rng.randrange(1, 4)
        first = rng.choice([0, rows - B, rows - B + 1, rows, U64 - 1, U64 - rows, U64 - B, 2**63, rng.randrange(U64)])
        first = first % U64 if first >= 0 else 0
        lengths = np.array([rng.choice([0, 1, S - T, S - T + 1, S, self.P - T, 2**62, -1]) for _ in range(B)], np.int64)
        tokens = np.array([rng.choice([0, 5, self.V - 1, self.V, -1]) if rng.random() < 0.1 else rng.randrange(self.V)
                           for _ in range(B * T)], np.int64)
        logits = np.zeros((B, self.V), np.float32)
        ok = (first + B <= rows and all(0 <= n and n + T <= min(S, self.P) for n in lengths.tolist())
              and all(0 <= t < self.V for t in tokens.tolist()))
        before = lengths.copy()
        try:
            rng.choice(self.models).step(tokens, k, v, lengths, logits, rng.choice([1, 2]), first)
        except ValueError:
            assert not ok, (rows, S, B, T, first, before, tokens)
            assert np.array_equal(lengths, before) and not k.any() and not v.any() and not logits.any()
            return
        assert ok, ("step took arguments it must refuse", rows, S, B, T, first, before, tokens)
        assert np.array_equal(lengths, before + T) and np.isfinite(logits).all()


def fuzz_linear_rows(c, rng: random.Random, isa: str) -> None:
    """A product of a random kind and shape (at times a wrong one); answered, it is the scalar code's bits."""
    M, K, N = rng.choice([rng.randrange(1, 4), rng.randrange(1, 30)]), rng.randrange(1, 70), rng.randrange(1, 40)
    kind = rng.randrange(7)
    wn = rng.choice([N, N, N + 8, max(N - 8, 0)])
    w, _, scales = packed(np.random.default_rng(rng.randrange(2**32)), kind, wn, K, rng.choice([0, 0, 1]))
    count = N if kind in (3, 5) else -(-N // 8) * 8 * -(-K // 32)  # scales needed
    if scales is not None:
        scales = scales[: rng.choice([len(scales), count, count - 1])]
    x = np.random.default_rng(rng.randrange(2**32)).integers(-3, 4, (M, K)).astype(np.float32)
    y = np.zeros((M, N), np.float32)
    ok = (-(-wn // 8) == -(-N // 8) and w.shape[1] == packed_k(kind, K)
          and (scales is None if kind < 3 else len(scales) >= count))
    threads = rng.choice([1, 2])
    try:
        c.linear_rows(x, w, kind, y, threads, scales)
    except ValueError:
        assert not ok and not y.any()
        return
    assert ok
    if isa != "scalar":
        ref = np.zeros_like(y)
        use_isa(c, "scalar")
        c.linear_rows(x, w, kind, ref, threads, scales)
        use_isa(c, isa)
        assert np.array_equal(y, ref, equal_nan=True), (isa, kind, M, K, N)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    c = _native.core()
    rng = random.Random(args.seed)
    enc = c.Encoder([bytes([b]) for b in range(256)], [], {"<|x|>": 256}, c.PATTERN_GPT4)
    step = Step(c, np.random.default_rng(args.seed))
    isas = isas_of(c)
    try:
        for _ in range(args.iterations):
            isa = use_isa(c, rng.choice(isas))
            fuzz_encode_spans(c, enc, rng)
            fuzz_pretokenize(c, rng)
            fuzz_split_documents(c, rng)
            fuzz_counts(c, rng)
            step.fuzz(rng)
            fuzz_linear_rows(c, rng, isa)
    finally:
        use_isa(c, ISAS[1])
    print(f"fuzz_core: {args.iterations} iterations of each binding on the decode kernels' {', '.join(isas)}, all "
          "answers as their contracts say")
    return 0


if __name__ == "__main__":
    sys.exit(main())
