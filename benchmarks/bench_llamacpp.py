"""Inference speed against llama.cpp on the same model: decode and prefill at every weight precision.

One run directory with random weights (the d512 x 4 shape with a vocab of 8k, or ``--shape gpt2s``: d768 x 12,
12 heads, vocab 50304, tied embeddings) is exported with ``lmforge export gguf`` as f32, f16, q8_0 and q4_0; then,
alternating for ``--rounds`` rounds (medians and ranges), llama.cpp's own ``llama-bench`` on each file (``-p N``:
prefill of an N-token prompt in one batch; ``-n N``: N tokens decoded one at a time from an empty context) and
lmforge's ``Engine`` at batch 1 on the same run with the decoder's weights stored at the matching precision:

| lmforge ``weight_dtype`` | llama.cpp file |
|---|---|
| float32 | f32 |
| bfloat16, float16 | f16 |
| int8 (a scale per row) | q8_0 (a scale per 32) |
| int4 (Q4_0's rounding) | q4_0 |
| int8+a8, int4+a8: the same weights, ``activations="int8"`` | q8_0, q4_0 |
| bfloat16+bf16a: bf16 weights, the kernels' opt-in bf16 activations | f16 |

The ``+a8`` rows round each product's input to int8 per block of 32 and sum in integers, as llama.cpp does with
its Q8_0/Q8_K activations; the plain rows multiply float32 activations by the stored weights (exact). The
``+bf16a`` row switches ``_core.linear_bf16_activations`` on around its own calls: each product's input rounded to
bf16 and summed by AVX-512 BF16's vdpbf16ps (where the CPU has it; elsewhere the row is the bfloat16 row again,
and its kernels column says so).

lmforge's prefill is ``Engine.prefill`` of one prompt (its logits included); its decode is a 1-token prompt
followed by N ``Engine.step`` calls, each fed the argmax of the last logits (greedy, as a ``Generator`` does).
Both sides run on ``--threads`` threads (``llama-bench -t``, ``torch.set_num_threads``). The table gives tokens/s
(median and range) and the ratio of medians (> 1: lmforge faster); beside decode, the weight bytes read per token
over the time per token as a share of the machine's read bandwidth, measured in the same run, and the fp32
matmul peak and the load average, so a reader can tell a quiet run from a busy one. The last column is the
instruction set lmforge's products ran on for the row (:func:`kernel_path`: ``avx512_vnni`` for the int8-activation
rows on a CPU with AVX-512 VNNI, ``avx512_bf16`` for the bf16-activation row on one with AVX-512 BF16, ``avx512``,
``avx2`` or ``scalar``).

llama-bench is not shipped with lmforge. The script finds it at ``$LLAMA_BENCH``, then ``.llama.cpp/bin/llama-bench``
in the repository (an ignored folder); ``--build`` builds it there from the llama.cpp sources vendored in the
``llama-cpp-python`` 0.3.36 sdist (``pip download``, then CMake with ``GGML_NATIVE=ON``; ~10 minutes on 2 cores).
Without llama-bench it says how to get it and exits 0 (``make bench`` goes on).

    python benchmarks/bench_llamacpp.py --build          # build llama-bench once
    python benchmarks/bench_llamacpp.py                  # d512 x 4, vocab 8k, 3 rounds
    python benchmarks/bench_llamacpp.py --shape gpt2s    # the GPT-2-small shape
    python benchmarks/bench_llamacpp.py --quick          # a tiny model, 1 round (a smoke run)
    python benchmarks/bench_llamacpp.py --only bfloat16 bfloat16+bf16a --rounds 5   # the bf16 products' two paths
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import EOT, median, precision, read_bandwidth, synthetic_documents, write_run  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LOCAL = ROOT / ".llama.cpp"  # ignored by git: the build tree of llama.cpp
SDIST = "llama-cpp-python==0.3.36"
# --shape: (vocab, context, d_model, layers, heads, d_ff, tied)
SHAPES = {"d512": (8192, 512, 512, 4, 16, 1344, False), "gpt2s": (50304, 1024, 768, 12, 12, 2048, True),
          "tiny": (512, 128, 64, 2, 4, 192, False)}
# lmforge weight dtype -> the llama.cpp file type it is measured against
PAIRS = [("float32", "f32"), ("bfloat16", "f16"), ("float16", "f16"), ("int8", "q8_0"), ("int4", "q4_0"),
         ("int8+a8", "q8_0"), ("int4+a8", "q4_0"), ("bfloat16+bf16a", "f16")]
BF16A = "+bf16a"  # a row name's suffix: the kernels' bf16-activation mode on for that row


def find_llama_bench() -> Path | None:
    """``$LLAMA_BENCH`` if set (it must exist), else the repository's own build, else None."""
    env = os.environ.get("LLAMA_BENCH")
    if env:
        return Path(env) if Path(env).is_file() else None
    local = LOCAL / "bin" / "llama-bench"
    return local if local.is_file() else None


def build_llama_bench(jobs: int) -> Path:
    """Build ``llama-bench`` into ``.llama.cpp/`` from the llama.cpp sources in the llama-cpp-python sdist."""
    with tempfile.TemporaryDirectory() as tmp:
        # --no-build-isolation: pip only reads the sdist's metadata (no isolated build of CMake from source)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python",
                        "--no-build-isolation", SDIST, "-d", tmp], check=True)
        archive = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        src = next(Path(tmp).glob("llama_cpp_python-*/vendor/llama.cpp"))
        subprocess.run(["cmake", "-S", str(src), "-B", str(LOCAL), "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
                        "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                        "-DLLAMA_BUILD_SERVER=OFF"], check=True)
        subprocess.run(["cmake", "--build", str(LOCAL), "--target", "llama-bench", f"-j{jobs}"], check=True)
    return LOCAL / "bin" / "llama-bench"


def make_run(root: Path, shape: str) -> Path:
    """A run directory of ``shape`` with random weights (speed does not depend on them) and a small BPE: the
    model's vocabulary beyond the tokenizer's is padding rows (exported as unused tokens)."""
    from lmforge.model import ModelConfig
    from lmforge.tokenizer import Tokenizer, train_bpe_from_iterator

    vocab, context, d, layers, heads, d_ff, tied = SHAPES[shape]
    bpe_vocab, merges = train_bpe_from_iterator(synthetic_documents(20_000), min(vocab, 400), [EOT], progress=False)
    tok = Tokenizer(bpe_vocab, merges, [EOT])
    cfg = ModelConfig(vocab_size=vocab, context_length=context, d_model=d, n_layers=layers, n_heads=heads,
                      d_ff=d_ff, tie_embeddings=tied)
    return write_run(root, tok, cfg)


def llama_bench(exe: Path, model: Path, prompt: int, gen: int, threads: int) -> float:
    """Tokens/s of one llama-bench test (``-p prompt -n 0`` or ``-p 0 -n gen``), one repetition after its warm-up."""
    cmd = [str(exe), "-m", str(model), "-p", str(prompt), "-n", str(gen), "-t", str(threads), "-r", "1",
           "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({' '.join(cmd)}):\n{out.stderr[-2000:]}")
    return float(json.loads(out.stdout)[0]["avg_ts"])


def kernel_path(isa: str, activations: str) -> str:
    """The instruction set a row's products run on, given ``_core.linear_isa()`` (the kernels' widest, with the row's
    bf16-activation mode): AVX-512 VNNI serves the products with int8 activations only, the float32 ones run the
    AVX-512 code there; "avx512_bf16" (the mode running) names the bf16 row's products."""
    return isa if activations == "int8" else isa.removesuffix("_vnni")


@contextmanager
def bf16_activations(on: bool) -> Iterator[None]:
    """The decode kernels' bf16-activation mode ``on`` within the block, off after it."""
    from lmforge._native import core

    core().linear_bf16_activations(on)
    try:
        yield
    finally:
        core().linear_bf16_activations(False)


class Lmforge:
    """lmforge's engine on the run, its decoder's weights stored as ``dtype`` (a name of :data:`PAIRS`): prefill
    and decode speed."""

    def __init__(self, model, dtype: str, prompt: int, gen: int, context: int) -> None:
        import torch

        from lmforge._native import core
        from lmforge.generate.engine import Engine

        self.bf16a = dtype.endswith(BF16A)
        weights, activations = precision(dtype.removesuffix(BF16A))
        self.engine = Engine(model, weight_dtype=weights, activations=activations)
        with bf16_activations(self.bf16a):
            self.path = kernel_path(core().linear_isa(), self.engine.activations)
        g = torch.Generator().manual_seed(1)
        self.prompt = torch.randint(0, model.cfg.vocab_size, (prompt,), generator=g).tolist()
        self.gen, self.capacity = gen, min(context, max(prompt, gen + 1))
        self.bytes_per_token = sum(_weight_bytes(p) for p in self._packed(model, weights))

    @staticmethod
    def _packed(model, dtype: str):
        """The matrices a decode step reads, packed as the decoder packs them (for the bytes they take): every
        2-D weight once — the head, tied or not (a step reads one embedding row, not the table)."""
        from lmforge.generate.packed import PackedLinear, weight_dtype_of

        wd = weight_dtype_of(dtype)
        for name, p in model.state_dict().items():  # a tied head is listed once, as lm_head.weight
            if p.dim() == 2 and name != "token_embeddings.weight":
                yield PackedLinear(p, wd)

    def prefill(self) -> float:
        import torch

        with torch.inference_mode(), bf16_activations(self.bf16a):
            t0 = time.perf_counter()
            self.engine.prefill([self.prompt], self.capacity)
            return len(self.prompt) / (time.perf_counter() - t0)

    def decode(self) -> float:
        import torch

        with torch.inference_mode(), bf16_activations(self.bf16a):
            logits = self.engine.prefill([self.prompt[:1]], self.capacity)
        from lmforge.generate.sampling import sample_next

        # the greedy pick too, as Generator decodes
        with torch.inference_mode(), self.engine.serial_torch(), bf16_activations(self.bf16a):
            t0 = time.perf_counter()
            for _ in range(self.gen):
                logits = self.engine.step(sample_next(logits, 0.0))
            return self.gen / (time.perf_counter() - t0)


def _weight_bytes(lin) -> int:
    return lin._array.nbytes + (0 if lin._scales is None else lin._scales.nbytes)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="d512")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt", type=int, default=256, help="prefill prompt length (default 256)")
    p.add_argument("--gen", type=int, default=128, help="tokens decoded (default 128)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--only", nargs="*", choices=[a for a, _ in PAIRS], default=None, help="lmforge dtypes to run")
    p.add_argument("--build", action="store_true", help="build llama-bench into .llama.cpp/ first, then run")
    p.add_argument("--jobs", type=int, default=2, help="parallel jobs of the build (default 2)")
    p.add_argument("--quick", action="store_true", help="a tiny model, 1 round, short prompt (a smoke run)")
    a = p.parse_args()
    if a.quick:
        a.shape, a.rounds, a.prompt, a.gen = "tiny", 1, 32, 16
    exe = build_llama_bench(a.jobs) if a.build else find_llama_bench()
    if exe is None:
        print("llama-bench not found: build it with `python benchmarks/bench_llamacpp.py --build` (CMake and a C++ "
              "compiler; the llama.cpp sources of the llama-cpp-python 0.3.36 sdist, into .llama.cpp/) or point "
              "LLAMA_BENCH at an existing llama-bench binary. Skipped.")
        return 0
    import torch

    from lmforge.hardware import matmul_peak_flops
    from lmforge.interop.gguf import export_gguf

    torch.set_num_threads(a.threads)
    pairs = [(ours, theirs) for ours, theirs in PAIRS if a.only is None or ours in a.only]
    with tempfile.TemporaryDirectory() as tmp:
        run = make_run(Path(tmp), a.shape)
        files = {t: export_gguf(run, Path(tmp) / f"m-{t}.gguf", dtype=t) for t in sorted({t for _, t in pairs})}
        from lmforge.generate import Generator

        model = Generator.from_run(str(run), device="cpu").model
        cfg = model.cfg
        ours = {d: Lmforge(model, d, a.prompt, a.gen, cfg.context_length) for d, _ in pairs}
        peak = matmul_peak_flops()
        bandwidth = read_bandwidth()
        speeds: dict[tuple[str, str], list[float]] = {}
        for d, _ in pairs:  # warm-up: pools, caches, lazy imports
            ours[d].prefill()
            ours[d].decode()
        for _ in range(a.rounds):
            for d, t in pairs:
                for what in ("prefill", "decode"):
                    speeds.setdefault((d, what), []).append(getattr(ours[d], what)())
                    if (t, what) not in speeds or len(speeds[(t, what)]) < len(speeds[(d, what)]):
                        n = (a.prompt, 0) if what == "prefill" else (0, a.gen)
                        speeds.setdefault((t, what), []).append(llama_bench(exe, files[t], *n, a.threads))
        bandwidth = max(bandwidth, read_bandwidth())
        load = os.getloadavg()
        print(f"\n### lmforge vs llama.cpp ({a.shape}: d_model {cfg.d_model}, {cfg.n_layers} layers, vocab "
              f"{cfg.vocab_size}), {datetime.date.today()}\n")
        print(f"{a.threads} threads; prefill {a.prompt} tokens, decode {a.gen} tokens at batch 1; {a.rounds} "
              f"alternating rounds: median (range) tokens/s. Read bandwidth {bandwidth / 1e9:.1f} GB/s, fp32 matmul "
              f"peak {peak / 1e9:.0f} GFLOP/s, load average {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} "
              f"({os.cpu_count()} CPUs).\n")
        print("| lmforge / llama.cpp | decode tok/s lmforge | llama.cpp | ratio | lmforge GB/s (share) | "
              "prefill tok/s lmforge | llama.cpp | ratio | lmforge kernels |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
        for d, t in pairs:
            dec, ldec = speeds[(d, "decode")], speeds[(t, "decode")]
            pre, lpre = speeds[(d, "prefill")], speeds[(t, "prefill")]
            gbs = ours[d].bytes_per_token * median(dec)
            print(f"| {d} / {t} | {_spread(dec)} | {_spread(ldec)} | {median(dec) / median(ldec):.2f}x | "
                  f"{gbs / 1e9:.1f} ({gbs / bandwidth:.0%}) | {_spread(pre)} | {_spread(lpre)} | "
                  f"{median(pre) / median(lpre):.2f}x | {ours[d].path} |")
        for a4, a8 in (("int4", "int8"), ("int4+a8", "int8+a8"), ("int4+a8", "int8")):
            if a4 in ours and a8 in ours:
                ratio = median(speeds[(a4, 'decode')]) / median(speeds[(a8, 'decode')])
                print(f"\n{a4} / {a8} decode (lmforge): {ratio:.2f}x")
    return 0


def _spread(xs: list[float]) -> str:
    return f"{median(xs):,.0f} ({min(xs):,.0f}..{max(xs):,.0f})"


if __name__ == "__main__":
    sys.exit(main())
