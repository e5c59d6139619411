"""The integer products (``activations="int8"``: int8/int4 weights times activations rounded to int8 per block of
32, ``csrc/decode/qdot.cpp``) against their PyTorch spec (:func:`lmforge.generate.packed.q8_products`), bit for
bit on every instruction set: the integer sums are exact and the float steps run in the spec's order."""

import math

import numpy as np
import pytest
import torch
from conftest import tiny_lm as _model

from lmforge._native import core
from lmforge.generate import Generator
from lmforge.generate.engine import Engine
from lmforge.generate.packed import (INT4, PackedLinear, activations_of, kernel_available, q8_products,
                                     quantize_rows_q8)

pytestmark = pytest.mark.skipif(not kernel_available(), reason="C++ extension not built")
SHAPES = [(1000, 64), (37, 19), (129, 512), (8, 1), (300, 333), (72, 96)]  # N off the panel, K off the block


def _inputs(rows: int, k: int, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(rows, k, generator=g) * torch.rand(rows, 1, generator=g) * 10
    if k >= 32:
        x[0, :32] = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5, 1.5, 126.5, -126.5] * 4)  # id = 1: exact ties
    if rows > 1 and k >= 64:
        x[1, 32:64] = 0  # an all-zero block: scale 0
    return x


@pytest.mark.parametrize("dtype", [torch.int8, INT4])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 70])
def test_integer_products_equal_the_spec_bit_for_bit(dtype, rows, isa):
    g = torch.Generator().manual_seed(rows)
    for n, k in SHAPES:
        w = torch.randn(n, k, generator=g)
        lin = PackedLinear(w, dtype, activations="int8")
        assert lin.kind == (5 if dtype == torch.int8 else 6)
        assert torch.equal(lin.weight(), PackedLinear(w, dtype).weight())  # the same stored weights
        x = _inputs(rows, k, g)
        ref = lin.reference(x)
        for threads in (1, 2, 3):
            got = lin(x, threads)
            assert torch.equal(got, ref), (dtype, n, k, rows, threads, (got - ref).abs().max().item())
        exact = PackedLinear(w, dtype).reference(x)  # the float32 arithmetic on the same weights: close, not equal
        rel = ((ref - exact).norm() / exact.norm()).item()
        assert rel < 0.02, rel
        if k >= 19:
            assert rel > 1e-5, rel  # the activations' rounding shows: the spec is not the float32 products


def test_activation_rounding_worked_example():
    """``quantize_rows_q8``: d = amax / 127, codes round(x * 127 / amax) half to even (llama.cpp's AVX2 Q8_0)."""
    x = torch.zeros(2, 40)
    x[0, :8] = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5, 1.5, 63.5, -1.0])
    x[0, 32:35] = torch.tensor([0.1, -0.2, 0.05])  # the second block, padded to 32 with zeros
    codes, d = quantize_rows_q8(x)
    assert codes.shape == (2, 64) and d.shape == (2, 2)
    assert codes[0, :8].tolist() == [127, 2, -4, 0, 0, 2, 64, -1]
    assert d[0, 0].item() == 1.0 and d[1].tolist() == [0.0, 0.0] and not codes[1].any()
    assert d[0, 1].item() == pytest.approx(0.2 / 127) and codes[0, 32:35].tolist() == [64, -127, 32]
    assert not codes[0, 35:].any()


def test_activation_rounding_divides_once(isa):
    """id = 127 / amax is one correctly rounded float32 division (the docstring's spec, the C++ kernel's
    ``127.0f / amax``), not 127 times a rounded reciprocal: here the two differ by one float32 unit and the code
    by one (x * id = 110.5000 vs 110.49999: 111 vs 110). The spec, the reference and the kernel agree."""
    x = torch.zeros(1, 32)
    x[0, :2] = torch.tensor([1.9757849, 2.2708116])
    xs, amax = np.float32(1.9757849), np.float32(2.2708116)
    spec = int(np.round(xs * (np.float32(127) / amax)))  # numpy: float32 division, round half to even
    assert spec == 111 and int(np.round(xs * (np.float32(1) / amax * np.float32(127)))) == 110
    codes, d = quantize_rows_q8(x)
    assert codes[0, :2].tolist() == [spec, 127] and d[0, 0].item() == amax / np.float32(127)
    # the kernel, on weights that read code 0 alone, gives the reference's bits (with code 110: another number)
    w = torch.zeros(8, 32)
    w[0, 0] = 1.0
    lin = PackedLinear(w, torch.int8, activations="int8")
    assert torch.equal(lin(x, 1), lin.reference(x))


def test_a_non_finite_activation_makes_its_row_nan(isa):
    """A block holding inf or nan has no scale: the row's outputs are nan (as float32 products would make
    them), the other rows untouched."""
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.int8, INT4):
        lin = PackedLinear(torch.randn(64, 96, generator=g), dtype, activations="int8")
        x = torch.randn(3, 96, generator=g)
        x[0, 40], x[2, 5] = float("inf"), float("nan")
        got, ref = lin(x, 1), lin.reference(x)
        assert got[0].isnan().all() and got[2].isnan().all() and ref[0].isnan().all() and ref[2].isnan().all()
        assert torch.equal(got[1], ref[1]) and got[1].isfinite().all()


def test_spec_sums_blocks_in_order():
    """The spec's float steps, written out for one output: acc = acc + isum_g * d_g over g, then the row scale."""
    g = torch.Generator().manual_seed(3)
    x, codes = torch.randn(1, 96, generator=g), torch.randint(-127, 128, (1, 96), generator=g)
    s = torch.tensor([0.013])
    q, d = quantize_rows_q8(x)
    acc = np.float32(0)
    for b in range(3):
        isum = int((q[0, 32 * b: 32 * b + 32].long() * codes[0, 32 * b: 32 * b + 32]).sum())
        acc = np.float32(acc + np.float32(np.float32(isum) * d[0, b].numpy()))
    assert q8_products(x, codes, row_scales=s).item() == np.float32(acc * s.numpy()[0])


def test_activations_setting_and_errors():
    assert activations_of(None, torch.int8) == "int8" and activations_of(None, INT4) == "int8"  # the defaults
    assert activations_of(None, torch.bfloat16) == "float32" and activations_of("Float32", INT4) == "float32"
    with pytest.raises(ValueError, match="unknown activations 'int4'"):
        activations_of("int4", torch.int8)
    with pytest.raises(ValueError, match="needs int8 or int4 weights"):
        PackedLinear(torch.randn(8, 8), torch.bfloat16, activations="int8")
    with pytest.raises(ValueError, match="needs int8 or int4 weights"):
        Engine(_model(), activations="int8")
    # the settings' own conflict comes before the device's (a GPU, or no kernel, said "needs the CPU decode kernel")
    with pytest.raises(ValueError, match="needs int8 or int4 weights"):
        Engine(_model(), weight_dtype="bf16", activations="int8", use_kernel=False)
    lin = PackedLinear(torch.randn(16, 40), torch.int8, activations="int8")  # K = 40: padded to 64 codes
    assert lin._array.shape == (2, 64, 8) and lin._array.dtype == np.int8
    with pytest.raises(ValueError, match=r"kind 5: \(ceil\(N / 8\), 32 ceil\(K / 32\), 8\)"):
        core().linear_rows(np.zeros((1, 40), np.float32), lin._array[:, :40].copy(), 5, np.zeros((1, 16), np.float32),
                           1, lin._scales)


def test_generator_keeps_its_arithmetic():
    gen = Generator(_model(), weight_dtype="int4", activations="int8")
    assert gen.engine.activations == "int8" and gen.engine.weight_dtype == INT4
    out = gen.generate_ids([1, 2, 3], 12, temperature=0)
    gen.refresh()
    assert gen.engine.activations == "int8"
    assert gen.generate_ids([1, 2, 3], 12, temperature=0) == out
    assert Generator(_model(), weight_dtype="int8").engine.activations == "int8"  # the default for int8/int4
    exact = Generator(_model(), weight_dtype="int8", activations="float32")
    assert exact.engine.activations == "float32" and Generator(_model()).engine.activations == "float32"
    assert math.isfinite(float(exact.engine.prefill([[1, 2]], 8).sum()))
