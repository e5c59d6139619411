"""The decode kernels' opt-in bf16-activation mode (``_core.linear_bf16_activations``, ``LMFORGE_BF16_ACTIVATIONS``):
bf16-weight products with each row of x rounded to bf16 and summed by AVX-512 BF16's vdpbf16ps. Held bit for bit to
an emulation of that instruction's order of sums, which stays within float32 summation error of the plain spec
(``x.bfloat16().float() @ W.float().T``); the default arithmetic, other weight kinds and capped instruction sets
are left as they are; the decode step runs it (a prompt's rows get the bits of single steps)."""

import os
import subprocess
import sys

import pytest
import torch
from conftest import cpu_flags, tiny_lm

from lmforge._native import core
from lmforge.generate.engine import Engine
from lmforge.generate.packed import INT4, PackedLinear, kernel_available

pytestmark = pytest.mark.skipif(not kernel_available(), reason="C++ extension not built")
SHAPES = [(100, 600), (37, 19), (300, 1344), (16, 2049)]  # N off the panel, K odd, K past one GEMM k-block (1024)
ROWS = (1, 2, 3, 7, 8, 11, 12, 29)  # the decode tiles below 12 rows, the GEMM from 12 on


def _flush(t: torch.Tensor) -> torch.Tensor:
    """Values below float32's normal range as zero (vdpbf16ps's DAZ on its inputs, FTZ on its sums)."""
    return torch.where(t.abs() < torch.finfo(torch.float32).tiny, torch.zeros_like(t), t)


def bf16_activation_products(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` as the bf16-activation kernel sums it (``csrc/decode/tiles.inc``, tile_pairs): x rounded to bf16,
    products of bf16 values (exact in float32) added one at a time from zero in float32, k in the order 1, 0, 3, 2,
    .. (vdpbf16ps adds a pair's odd element first; an odd K's last k pairs with a zero). ``w`` holds bf16 values."""
    xb, wb = _flush(x.to(torch.bfloat16).float()), _flush(w.to(torch.bfloat16).float())
    if xb.shape[1] % 2:
        xb, wb = torch.nn.functional.pad(xb, (0, 1)), torch.nn.functional.pad(wb, (0, 1))
    acc = torch.zeros(xb.shape[0], wb.shape[0])
    for k in torch.arange(xb.shape[1]).view(-1, 2).flip(1).reshape(-1).tolist():
        acc = _flush(acc + xb[:, k, None] * wb[None, :, k])
    return acc


def bf16_activation_spec(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The arithmetic the mode stands for: activations rounded to bf16, float32 products and sums in any order."""
    return x.to(torch.bfloat16).float() @ w.to(torch.bfloat16).float().T


@pytest.fixture
def bf16_mode():
    """The mode switched on for one test; skipped where it does not run (no AVX-512 BF16)."""
    c = core()
    c.linear_bf16_activations(True)
    try:
        if c.linear_isa() != "avx512_bf16":
            pytest.skip(f"this CPU has no AVX-512 BF16 for the bf16-activation products (the kernels run "
                        f"{c.linear_isa()})")
        yield c
    finally:
        c.linear_bf16_activations(False)


def test_the_emulation_is_the_spec_within_float32_summation_error():
    """The bit-exact emulation is the plain spec up to float32 rounding: within K * 2^-24 * sum|x_k w_k| (the
    bound on any order of K float32 additions of exact products)."""
    g = torch.Generator().manual_seed(0)
    for n, k in [(40, 600), (9, 19)]:
        x, w = torch.randn(5, k, generator=g), torch.randn(n, k, generator=g)
        bound = k * 2.0**-24 * (x.to(torch.bfloat16).float().abs() @ w.to(torch.bfloat16).float().abs().T)
        assert bool(((bf16_activation_products(x, w) - bf16_activation_spec(x, w)).abs() <= bound).all())
        assert not torch.equal(bf16_activation_spec(x, w), x @ w.to(torch.bfloat16).float().T)  # x was rounded


def test_bf16_activation_products_are_their_emulation_bit_for_bit(bf16_mode):
    """Every shape and row count (decode tiles and GEMM, K odd, K over a k-block, N off the panel), 1 and 2
    threads: the kernel's outputs are the emulation's bits, each row's whatever the rows beside it."""
    g = torch.Generator().manual_seed(1)
    for n, k in SHAPES:
        lin = PackedLinear(torch.randn(n, k, generator=g), torch.bfloat16)
        x = torch.randn(max(ROWS), k, generator=g) * 3
        want = bf16_activation_products(x, lin.weight())
        for rows in ROWS:
            for threads in (1, 2):
                got = lin(x[:rows], threads)
                assert torch.equal(got, want[:rows]), (n, k, rows, threads, (got - want[:rows]).abs().max().item())


def test_bf16_activation_products_flush_subnormals_and_carry_specials(bf16_mode):
    """Subnormal activations and weights count as zero (2^-127 * 1 and 2 * 2^-128 give 0), infinities and NaN go
    through as in float32."""
    tiny = torch.finfo(torch.float32).tiny  # 2^-126
    w = torch.tensor([[1.0, 2.0, 3.0], [tiny / 4, 1.0, 1.0], [4.0, 0.0, float("inf")], [1.0, 0.0, 0.0],
                      [tiny / 4, 0.0, 0.0]])
    x = torch.tensor([[tiny / 2, 1.0, 1.0], [1.0, float("nan"), 0.0], [2.0, 1.0, -1.0]])
    got = PackedLinear(w, torch.bfloat16)(x, 1)
    want = bf16_activation_products(x, w)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    inf = float("inf")
    assert got[0].tolist() == [5.0, 2.0, inf, 0.0, 0.0] and got[2].tolist() == [1.0, 0.0, -inf, 2.0, 0.0]
    assert bool(got[1].isnan().all())


def test_the_mode_leaves_other_products_and_capped_sets_alone(isa):
    """On each instruction set the CPU has, with the mode on: float32, fp16, int8 and int4 weights (float32 and
    int8 activations) give the bits they give with it off, and so do bf16 weights wherever vdpbf16ps does not run
    (a force switch on, or no AVX-512 BF16); linear_isa() says which."""
    c = core()
    g = torch.Generator().manual_seed(2)
    kinds = [(torch.float32, "float32"), (torch.bfloat16, "float32"), (torch.float16, "float32"),
             (torch.int8, "float32"), (INT4, "float32"), (torch.int8, "int8"), (INT4, "int8")]
    try:
        c.linear_bf16_activations(True)
        runs = c.linear_isa()
        assert runs in (isa, "avx512_bf16") and (runs == isa or isa == "avx512_vnni")
        for dtype, act in kinds:
            lin = PackedLinear(torch.randn(50, 70, generator=g), dtype, act)
            x = torch.randn(13, 70, generator=g)
            c.linear_bf16_activations(True)
            on = [lin(x[:1], 1), lin(x, 2)]
            c.linear_bf16_activations(False)
            off = [lin(x[:1], 1), lin(x, 2)]
            same = all(torch.equal(a, b) for a, b in zip(on, off))
            assert same == (dtype != torch.bfloat16 or runs != "avx512_bf16"), (isa, dtype, act)
    finally:
        c.linear_bf16_activations(False)
    assert c.linear_isa() == isa


def test_linear_isa_names_the_mode_where_the_cpu_runs_it():
    """With the mode on, linear_isa() is "avx512_bf16" exactly when /proc/cpuinfo lists avx512_bf16 (with the
    AVX-512 base set); each force switch takes it back to the capped set's name; off, the widest set's name."""
    flags = cpu_flags()
    if not flags:
        pytest.skip("no x86 feature flags in /proc/cpuinfo to check the choice against")
    c = core()
    widest = c.linear_isa()
    has = {"avx512f", "avx512vl", "avx512bw", "avx512dq", "avx512_bf16", "avx2", "fma", "f16c"} <= flags
    try:
        c.linear_bf16_activations(True)
        assert c.linear_isa() == ("avx512_bf16" if has else widest)
        for switch, name in [(c.linear_force_avx512, "avx512"), (c.linear_force_avx2, "avx2"),
                             (c.linear_force_scalar, "scalar")]:
            switch(True)
            assert c.linear_isa() in (name, "avx2", "scalar") and c.linear_isa() != "avx512_bf16"
            switch(False)
    finally:
        c.linear_bf16_activations(False)
    assert c.linear_isa() == widest


def test_the_decode_step_runs_the_mode_batch_invariant(bf16_mode):
    """An engine with bf16 weights, the mode on: a 14-token prompt prefilled whole (the GEMM) gives the bits of its
    tokens fed one by one (the decode tiles); the logits moved off the float32-activation ones, by
    less than the rounding of the activations explains."""
    model = tiny_lm(7, n_kv_heads=2)
    eng = Engine(model, weight_dtype="bfloat16")
    prompt = torch.randint(0, 97, (14,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.inference_mode():
        whole = eng.prefill([prompt], 48)[0].clone()
        eng.open_slots(1, 48)
        eng.admit(prompt[:1])
        for t in prompt[1:-1]:
            eng.step(torch.tensor([t]))
        assert torch.equal(eng.step(torch.tensor([prompt[-1]]))[0], whole)
        bf16_mode.linear_bf16_activations(False)
        exact = eng.prefill([prompt], 48)[0]
    assert not torch.equal(whole, exact)
    assert float((whole - exact).abs().max()) < 0.05 * float(exact.abs().max())


def test_the_environment_variable_turns_the_mode_on_and_refuses_other_values():
    """LMFORGE_BF16_ACTIVATIONS=1 switches the mode on when the extension loads, 0 leaves it off; anything else
    is refused with one line naming the variable."""
    env = {k: v for k, v in os.environ.items() if k != "LMFORGE_BF16_ACTIVATIONS"}
    probe = "from lmforge._native import core; print(core().linear_isa())"
    runs = {}
    for value in ("0", "1", "yes"):
        out = subprocess.run([sys.executable, "-c", probe], env=env | {"LMFORGE_BF16_ACTIVATIONS": value},
                             capture_output=True, text=True, timeout=60)
        runs[value] = out
    assert runs["0"].returncode == 0 and runs["1"].returncode == 0, (runs["0"].stderr + runs["1"].stderr)[-2000:]
    c = core()
    try:
        c.linear_bf16_activations(True)
        assert runs["1"].stdout.strip() == c.linear_isa()
    finally:
        c.linear_bf16_activations(False)
    assert runs["0"].stdout.strip() == c.linear_isa()
    last = runs["yes"].stderr.strip().splitlines()[-1]
    assert runs["yes"].returncode != 0 and last.startswith("ValueError") and "LMFORGE_BF16_ACTIVATIONS" in last
