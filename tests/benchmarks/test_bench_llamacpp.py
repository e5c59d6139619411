"""benchmarks/bench_llamacpp.py: without llama-bench it says how to get it and exits 0; with it (``$LLAMA_BENCH``
or the repository's ``.llama.cpp/`` build), ``--quick`` prints a row with both sides' speeds per precision."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks/bench_llamacpp.py"
sys.path.insert(0, str(ROOT / "benchmarks"))


def test_without_llama_bench_it_says_how_to_get_it(tmp_path):
    env = dict(os.environ, LLAMA_BENCH=str(tmp_path / "no-such-llama-bench"))
    out = subprocess.run([sys.executable, str(SCRIPT), "--quick"], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "llama-bench not found" in out.stdout and "--build" in out.stdout and "LLAMA_BENCH" in out.stdout
    assert list(tmp_path.iterdir()) == []


def test_bench_llamacpp_quick(tmp_path):
    pytest.importorskip("gguf")
    from bench_llamacpp import find_llama_bench

    if find_llama_bench() is None:
        pytest.skip("llama-bench not built (python benchmarks/bench_llamacpp.py --build, or set LLAMA_BENCH)")
    out = subprocess.run([sys.executable, str(SCRIPT), "--quick"], capture_output=True, text=True, timeout=600,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert re.search(r"Read bandwidth [\d.]+ GB/s, fp32 matmul peak \d+ GFLOP/s, load average", out.stdout)
    for pair in ("float32 / f32", "bfloat16 / f16", "float16 / f16", "int8 / q8_0", "int4 / q4_0", "int8+a8 / q8_0",
                 "int4+a8 / q4_0"):
        row = next(x for x in out.stdout.splitlines() if x.startswith(f"| {pair} |"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        speeds = [float(cells[i].split()[0].replace(",", "")) for i in (1, 2, 5, 6)]
        assert all(s > 0 for s in speeds), row
        assert cells[3].endswith("x") and cells[7].endswith("x"), row
        assert cells[8] in ("avx512_vnni", "avx512", "avx2", "scalar"), row
    assert "int4 / int8 decode (lmforge):" in out.stdout
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("tied", [True, False])
def test_bytes_per_token_count_every_matrix_once(tied):
    """The decode rows' GB/s: a step reads each matrix once, a tied head included once (it was counted twice)."""
    import torch

    from bench_llamacpp import Lmforge, _weight_bytes
    from lmforge.model import ModelConfig, TransformerLM

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=256, context_length=32, d_model=64, n_layers=2, n_heads=4, d_ff=128,
                      tie_embeddings=tied)
    model = TransformerLM(cfg)
    read = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and n != "token_embeddings.weight")
    if tied:
        read += cfg.vocab_size * cfg.d_model  # the head is the embedding table
    assert sum(_weight_bytes(p) for p in Lmforge._packed(model, "float32")) == 4 * read
    int4 = sum(_weight_bytes(p) for p in Lmforge._packed(model, "int4"))
    assert int4 == read // 2 + 2 * (read // 32)  # two codes per byte, a float16 scale per 32 weights (Q4_0's 4.5 bits)


def test_each_row_names_the_instruction_set_its_products_run_on():
    """The table's last column: VNNI is named only for the int8-activation rows (the float32 products have no VNNI
    code), AVX-512 BF16 only for the bf16-activation row, whose mode is on around its own calls alone; it is the
    kernels' own name for the row's arithmetic."""
    from bench_llamacpp import Lmforge, kernel_path
    from lmforge._native import available, core
    from lmforge.model import ModelConfig, TransformerLM

    assert kernel_path("avx512_vnni", "int8") == "avx512_vnni" and kernel_path("avx512_vnni", "float32") == "avx512"
    assert kernel_path("avx2", "int8") == "avx2" and kernel_path("scalar", "float32") == "scalar"
    if not available("linear_rows"):
        pytest.skip("C++ extension not built")
    import torch

    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(vocab_size=64, context_length=16, d_model=32, n_layers=1, n_heads=2, d_ff=64))
    isa = core().linear_isa()
    assert Lmforge(model, "int8+a8", 4, 2, 16).path == isa
    assert Lmforge(model, "bfloat16", 4, 2, 16).path == isa.removesuffix("_vnni")
    core().linear_bf16_activations(True)  # the bf16-activation row: "avx512_bf16" where the CPU runs that mode
    bf16a = core().linear_isa()
    core().linear_bf16_activations(False)
    row = Lmforge(model, "bfloat16+bf16a", 4, 2, 16)
    assert row.path == bf16a.removesuffix("_vnni") and core().linear_isa() == isa  # the mode off again
    assert row.prefill() > 0 and core().linear_isa() == isa
