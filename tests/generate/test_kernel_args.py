"""The decode kernels' bindings (``_core.linear_rows`` .. ``DecodeModel.step``) on arguments that would send them
outside their arrays or write where no caller reads: a cache row ``first`` whose sum with the batch wraps,
head counts whose products wrap, output arrays of another dtype or layout (nanobind used to convert them into a
temporary, so the kernel's results were lost), arrays that say they live on a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import tiny_lm
from native_helpers import cuda_labelled

from lmforge._native import core
from lmforge.generate.engine import Engine
from lmforge.generate.packed import PackedLinear, kernel_available

pytestmark = pytest.mark.skipif(not kernel_available(), reason="C++ extension not built")
f32 = np.float32


def _calls() -> dict[str, tuple[object, list[np.ndarray | object], list[int]]]:
    """Per kernel: the function, a valid argument list and the positions of its outputs."""
    c = core()
    r = np.random.default_rng(0)
    x2 = r.standard_normal((2, 16)).astype(f32)
    return {
        "linear_rows": (c.linear_rows, [x2, r.standard_normal((2, 16, 8)).astype(f32), 0, np.zeros((2, 16), f32), 1], [3]),
        "attend_rows": (c.attend_rows, [r.standard_normal((1, 2, 4)).astype(f32), np.ones((1, 1, 3, 4), f32),
                                        np.ones((1, 1, 3, 4), f32), np.array([3]), 0.5, np.zeros((1, 2, 4), f32), 1],
                        [5]),
        "rms_norm_rows": (c.rms_norm_rows, [x2, np.ones(16, f32), 1e-5, np.zeros((2, 16), f32)], [3]),
        "rope_cache_rows": (c.rope_cache_rows, [np.ones((1, 16), f32), np.ones((5, 2), f32), np.zeros((5, 2), f32),
                                                np.array([1]), np.zeros((1, 1, 6, 4), f32), np.zeros((1, 1, 6, 4), f32),
                                                np.zeros((1, 2, 4), f32)], [4, 5, 6]),
        "swiglu_rows": (c.swiglu_rows, [np.ones((2, 8), f32), np.zeros((2, 4), f32)], [1]),
    }


def _wrong_outputs(a: np.ndarray) -> dict[str, np.ndarray]:
    """``a``'s shape in another dtype, and in a layout that is not C-contiguous."""
    strided = np.zeros(a.shape[:-1] + (2 * a.shape[-1],), a.dtype)[..., ::2]
    other = {"float32": np.float64, "int64": np.int32}[a.dtype.name]
    return {"dtype": np.zeros(a.shape, other), "strided": strided}


@pytest.mark.parametrize("name", ["linear_rows", "attend_rows", "rms_norm_rows", "rope_cache_rows", "swiglu_rows"])
def test_kernel_outputs_are_never_converted(name: str) -> None:
    fn, args, outs = _calls()[name]
    fn(*args)
    assert any(args[i].any() for i in outs)  # the valid call writes its outputs
    for i in outs:
        for how, wrong in _wrong_outputs(args[i]).items():
            bad = list(args)
            bad[i] = wrong
            with pytest.raises((TypeError, ValueError)) as e:  # linear_rows's y may be strided, by rows only
                fn(*bad)
            assert e.type is TypeError or (name, how) == ("linear_rows", "strided"), (name, i, how)


@pytest.mark.parametrize("name", ["linear_rows", "attend_rows", "rms_norm_rows", "rope_cache_rows", "swiglu_rows"])
def test_kernel_arrays_must_be_on_the_cpu(name: str) -> None:
    fn, args, _ = _calls()[name]
    for i, a in enumerate(args):
        if isinstance(a, np.ndarray):
            bad = list(args)
            bad[i] = cuda_labelled(a)
            with pytest.raises(TypeError):
                fn(*bad)


def _engine() -> Engine:
    eng = Engine(tiny_lm(0, n_kv_heads=2))
    with torch.inference_mode():
        eng.prefill([[1, 2, 3], [4, 5]], 8)
    return eng


def _step_args(eng: Engine) -> list:
    k, v, lengths, _ = eng._arrays
    return [np.array([7, 8], np.int64), k, v, lengths[:2], np.zeros((2, eng._vocab), f32), 1]


def test_step_refuses_a_first_row_whose_sum_wraps() -> None:
    """``first + B > rows`` passed for first = 2**64 - 1 (the sum wrapped to B - 1): RoPE and the cache writes
    landed before k and v."""
    eng = _engine()
    args = _step_args(eng)
    rows = args[1].shape[1]
    before = args[1].copy(), args[3].copy()
    for first in (2**64 - 1, 2**64 - 2, 2**64 - rows, rows - 1, rows, 2**63):
        with pytest.raises(ValueError, match="0 < B <= rows - first"):
            eng._decoder.step(*args, first)
    assert np.array_equal(args[1], before[0]) and np.array_equal(args[3], before[1])  # nothing written
    eng._decoder.step(*args, rows - 2)  # the last two rows: in bounds
    assert args[3].tolist() == [4, 3]


def test_step_outputs_are_never_converted() -> None:
    """A non-contiguous cache was copied (never written), int32 lengths never advanced, float64 logits lost."""
    eng = _engine()
    args = _step_args(eng)
    for i in (1, 2, 3, 4):
        for how, wrong in _wrong_outputs(args[i]).items():
            if i in (1, 2) and how == "strided":  # a 5-D cache: a Fortran-ordered copy, same shape and dtype
                wrong = np.asfortranarray(args[i])
            bad = list(args)
            bad[i] = wrong
            with pytest.raises(TypeError):
                eng._decoder.step(*bad)
    assert args[3].tolist() == [3, 2]
    for i, a in enumerate(args[:5]):
        bad = list(args)
        bad[i] = cuda_labelled(a)
        with pytest.raises(TypeError):
            eng._decoder.step(*bad)
    eng._decoder.step(*args)
    assert args[3].tolist() == [4, 3] and args[4].any()


def test_decode_model_refuses_head_counts_whose_products_wrap() -> None:
    """n_heads = 2**60 + 4 with head_dim 16: (H + 2 Hkv) D and H D wrap to the real matrices' 192 and 64, so the
    shapes matched and the step would have run 2**60 heads over 4 heads' buffers."""
    C, D, F, V = 64, 16, 96, 11
    g = torch.Generator().manual_seed(0)

    def spec(n: int, k: int) -> tuple:
        return PackedLinear(torch.randn(n, k, generator=g)).spec()

    layer = (np.ones(C, f32), spec(12 * D, C), spec(C, 4 * D), np.ones(C, f32), spec(2 * F, C), spec(C, F))
    tables = np.ones((8, D // 2), f32), np.zeros((8, D // 2), f32)
    make = core().DecodeModel
    args = (np.ones((V, C), f32), *tables)
    make(*args, 4, 4, F, 1e-5, [layer], np.ones(C, f32), spec(V, C), V)  # the real sizes
    with pytest.raises(ValueError, match="sizes overflow"):
        make(*args, 2**60 + 4, 4, F, 1e-5, [layer], np.ones(C, f32), spec(V, C), V)
    with pytest.raises(ValueError, match="must not be empty"):
        make(*args, 4, 4, 0, 1e-5, [], np.ones(C, f32), spec(V, C), V)


def test_a_model_option_the_kernel_lacks_decodes_through_the_forward(monkeypatch):
    """``kernel_unsupported`` routes a model the C++ step cannot run exactly to the model's forward (the same
    logits), and ``use_kernel=True`` on such a model is refused naming the option."""
    import lmforge.generate.engine as engine_module

    model = tiny_lm().eval()
    assert Engine(model)._kernel
    monkeypatch.setattr(engine_module, "kernel_unsupported", lambda cfg: ["model.example_option"])
    assert not Engine(model)._kernel
    with pytest.raises(ValueError, match="does not implement this model's model.example_option"):
        Engine(model, use_kernel=True)
