"""The CPU decode kernels (lmforge._core.linear_rows / attend_rows) against their PyTorch twins, and the
decoder options built on them (16-bit weights, thread handling)."""

import multiprocessing
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import cpu_flags
from conftest import tiny_lm as _model

from lmforge._native import core
from lmforge.generate.engine import Engine
from lmforge.generate.packed import INT4, PackedLinear, kernel_available, quantize_q4_0, weight_dtype_of
from lmforge.generate import Generator
from lmforge.model import KVCache, TransformerLM

pytestmark = pytest.mark.skipif(not kernel_available(), reason="C++ extension not built")
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, INT4]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, scale: float,
            threads: int) -> torch.Tensor:
    """The engine's one-query attention kernel (``_core.attend_rows``) as a function returning ``(B, H, D)``."""
    q = q.contiguous()
    out = torch.empty_like(q)
    core().attend_rows(q.numpy(), k.numpy(), v.numpy(), lengths.numpy(), scale, out.numpy(), threads)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 16, 70])
def test_packed_linear_equals_reference(dtype, rows, isa):
    g = torch.Generator().manual_seed(rows)
    for n, k in [(1000, 64), (37, 19), (129, 512), (8, 1), (300, 333)]:  # N off the panel size, K odd, tiny
        w, x = torch.randn(n, k, generator=g), torch.randn(rows, k, generator=g)
        lin = PackedLinear(w, dtype)
        ref = lin.reference(x)
        if dtype == torch.int8:  # codes times row scales: within half a step of the weight
            assert ((lin.weight() - w).abs() <= w.abs().amax(1, keepdim=True) / 254 * 1.0001).all()
        elif dtype == INT4:  # half a step of each block of 32 (step: max|block| / 8), plus the fp16 scale's rounding;
            # Q4_0 codes -8..7: a value near minus the block's extreme clamps to 7 steps (within one step)
            blocks = torch.nn.functional.pad(w, (0, -k % 32)).view(n, -1, 32)
            step = (blocks.abs().amax(2, keepdim=True) / 8).expand(-1, -1, 32).reshape(n, -1)[:, :k]
            err, top = (lin.weight() - w).abs(), quantize_q4_0(w)[0][:, :k] == 15
            assert (err[~top] <= step[~top] * (0.5 + 8 / 2048) * 1.0001).all()
            assert (err <= step * (1 + 8 / 2048) * 1.0001).all()
        else:
            torch.testing.assert_close(lin.weight(), w.to(dtype).float(), rtol=0, atol=0)  # packing loses nothing
        for threads in (1, 2, 3):
            torch.testing.assert_close(lin(x, threads), ref, rtol=1e-5, atol=1e-4 * k ** 0.5)


def test_int4_rounds_as_llama_cpp_q4_0():
    """int4 codes and scales are the gguf package's Q4_0 (ggml's reference rounding) bit for bit, so a q4_0
    export and the int4 decoder hold the same weights; blocks of equal magnitudes and zeros included."""
    gguf = pytest.importorskip("gguf")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 128, generator=g)
    w[0, :32] = 0  # an all-zero block: scale 0, codes 8
    w[1, :32] = 1.5
    w[1, 5] = -1.5  # equal magnitudes: the first is the one that sets the sign of the scale
    w[2] *= 1e-6
    codes, scales = quantize_q4_0(w)
    blocks = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q4_0).reshape(-1, 18)  # 2-byte d + 16
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32).reshape(24, 4)
    qs = blocks[:, 2:]
    theirs = np.concatenate([qs & 0xF, qs >> 4], axis=1).reshape(24, 128)  # low nibbles: the block's first 16
    np.testing.assert_array_equal(codes.numpy(), theirs)
    np.testing.assert_array_equal(scales.numpy(), d)
    back = gguf.quants.dequantize(gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q4_0),
                                  gguf.GGMLQuantizationType.Q4_0)
    np.testing.assert_array_equal(PackedLinear(w, INT4).weight().numpy(), back.reshape(24, 128))


def test_the_widest_instruction_set_the_cpu_has_is_chosen_and_each_switch_caps_it():
    """``linear_isa()`` names what the kernels run: the widest set whose instructions the CPU reports (AVX-512
    VNNI where it has avx512_vnni: the integer products then use vpdpbusd), and each test switch caps it, the
    narrowest one winning."""
    flags = cpu_flags()
    if not flags:
        pytest.skip("no x86 feature flags in /proc/cpuinfo to check the choice against")
    order = ["scalar", "avx2", "avx512", "avx512_vnni"]
    need = [set(), {"avx2", "fma", "f16c"}, {"avx512f", "avx512vl", "avx512bw", "avx512dq"}, {"avx512_vnni"}]
    widest = 0
    while widest + 1 < len(order) and need[widest + 1] <= flags:
        widest += 1
    c = core()
    try:
        assert c.linear_isa() == order[widest]
        for cap, switch in [(2, c.linear_force_avx512), (1, c.linear_force_avx2), (0, c.linear_force_scalar)]:
            switch(True)  # the switches pile up: each one narrower than the ones already on
            assert c.linear_isa() == order[min(widest, cap)]
        c.linear_force_avx2(False)
        c.linear_force_avx512(False)
        assert c.linear_isa() == "scalar"
    finally:
        for switch in (c.linear_force_scalar, c.linear_force_avx2, c.linear_force_avx512):
            switch(False)
    assert c.linear_isa() == order[widest]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_packed_linear_16bit_special_values(dtype, isa):
    """16-bit weights decode exactly: subnormals, extremes and infinities (fp16 has its own scalar decoder)."""
    vals = torch.tensor([0.0, 6e-8, -6e-8, 1e-5, 65504.0, -65504.0, 1.0, -2.5, 3e-6, 1e-40, float("inf"), -float("inf")])
    w = vals.view(-1, 1)  # K = 1, so y = 1 * w exactly
    lin = PackedLinear(w, dtype)
    assert torch.equal(lin(torch.ones(1, 1), 1)[0], w.to(dtype).float()[:, 0])


def _anon_huge_kib(address: int) -> int | None:
    """AnonHugePages (KiB) of this process's mapping holding ``address`` (None: no such mapping)."""
    found = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
            lo, hi = (int(a, 16) for a in head.split("-"))
            found = lo <= address < hi
        elif found and head == "AnonHugePages:":
            return int(line.split()[1])
    return None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "int4"])
def test_packed_weights_are_on_huge_pages_where_linux_gives_them(dtype):
    """Big packed matrices sit on a private anonymous mapping advised MADV_HUGEPAGE; contents and the kernel's
    results are unchanged, and the memory outlives every other reference."""
    from lmforge.generate.packed import HUGE_PAGE, on_huge_pages

    torch.manual_seed(0)
    w = torch.randn(4096, 1024)  # 4 MiB at 1 byte a weight, 16 at float32
    lin = PackedLinear(w, weight_dtype_of(dtype), "int8" if dtype in ("int8", "int4") else "float32")
    x = torch.randn(2, 1024)
    assert torch.equal(lin(x), lin(x.clone())) and torch.allclose(lin(x), lin.reference(x), rtol=1e-4, atol=1e-3)
    small = torch.randn(8, 8)
    assert torch.equal(on_huge_pages(small), small)
    for t in (torch.randn(HUGE_PAGE // 2, 3)[:, 1], torch.randn(3, HUGE_PAGE // 4).to(torch.bfloat16)):
        copy = on_huge_pages(t)
        assert copy.is_contiguous() and copy.dtype == t.dtype and torch.equal(copy, t)
    import gc
    arr = lin._array
    del lin
    gc.collect()
    assert arr.sum() is not None  # still mapped: a freed mapping would fault here
    thp = "/sys/kernel/mm/transparent_hugepage/enabled"
    if sys.platform != "linux" or not os.path.exists(thp) or "[never]" in open(thp).read():
        pytest.skip("this system gives no transparent huge pages")
    import mmap

    control = mmap.mmap(-1, 4 * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    control.madvise(mmap.MADV_HUGEPAGE)
    page = np.frombuffer(control, np.uint8)
    page[::4096] = 1  # fault every page in
    if not _anon_huge_kib(page.ctypes.data):  # fragmented memory, or defrag off: the system's choice, not ours
        pytest.skip("this system gave no huge page to a mapping advised MADV_HUGEPAGE")
    kib = _anon_huge_kib(arr.ctypes.data)
    assert kib is not None and kib >= HUGE_PAGE // 1024, f"packed weights on 4 KiB pages ({kib} KiB huge)"
    del page


def test_packed_linear_rejects_bad_shapes():
    from lmforge import _core

    lin = PackedLinear(torch.randn(16, 8))
    with pytest.raises(ValueError, match="packed"):
        _core.linear_rows(np.zeros((1, 9), np.float32), lin._array, 0, np.zeros((1, 16), np.float32), 1)
    with pytest.raises(ValueError, match="y must be"):
        _core.linear_rows(np.zeros((2, 8), np.float32), lin._array, 0, np.zeros((1, 16), np.float32), 1)
    with pytest.raises(ValueError, match="float32 for kind 0"):
        _core.linear_rows(np.zeros((1, 8), np.float32), lin._array, 1, np.zeros((1, 16), np.float32), 1)
    with pytest.raises(ValueError, match="2-D"):
        PackedLinear(torch.randn(4))
    with pytest.raises(ValueError, match="bfloat16 instead"):
        PackedLinear(torch.full((8, 8), 1e5), torch.float16)
    with pytest.raises(ValueError, match="finite"):
        PackedLinear(torch.full((8, 8), float("inf")), torch.int8)
    with pytest.raises(ValueError, match="int4 weights need finite"):
        PackedLinear(torch.full((8, 8), float("nan")), INT4)
    with pytest.raises(ValueError, match="need scales"):
        _core.linear_rows(np.zeros((1, 8), np.float32), PackedLinear(torch.randn(16, 8), torch.int8)._array, 3,
                          np.zeros((1, 16), np.float32), 1)
    q4 = PackedLinear(torch.randn(16, 40), INT4)  # K = 40: two groups, (2, 32, 8) codes, 2 * 2 * 8 scales
    assert q4._array.shape == (2, 32, 8) and q4._scales.shape == (32,)
    assert q4._scales.dtype == np.uint16  # float16 bits: 2 bytes per 32 weights, as Q4_0
    with pytest.raises(ValueError, match="int4 weights one fp16 .* per 8 rows x 32 columns"):
        _core.linear_rows(np.zeros((1, 40), np.float32), q4._array, 4, np.zeros((1, 16), np.float32), 1, q4._scales[:31])
    with pytest.raises(ValueError, match="int4 weights one fp16"):  # float32 scales: the wrong dtype
        _core.linear_rows(np.zeros((1, 40), np.float32), q4._array, 4, np.zeros((1, 16), np.float32), 1,
                          q4.scales.view(-1).numpy())
    with pytest.raises(ValueError, match=r"16 ceil\(K / 32\)"):
        _core.linear_rows(np.zeros((1, 70), np.float32), q4._array, 4, np.zeros((1, 16), np.float32), 1, q4._scales)


def _attention_reference(q, k, v, lengths, scale):
    B, H, D = q.shape
    G = H // k.shape[1]
    out = torch.empty_like(q)
    for b in range(B):
        n = int(lengths[b])
        kk = k[b, :, :n].repeat_interleave(G, 0)  # (H, n, D)
        vv = v[b, :, :n].repeat_interleave(G, 0)
        p = torch.softmax((kk @ q[b, :, :, None]).squeeze(-1).double() * scale, -1).float()  # (H, n)
        out[b] = (p[:, None, :] @ vv).squeeze(1)
    return out


@pytest.mark.parametrize("H,Hkv,D,S", [(4, 4, 16, 40), (8, 2, 32, 40), (6, 3, 12, 40), (2, 1, 8, 40),
                                        (4, 2, 64, 300), (2, 2, 72, 61), (2, 1, 128, 97)])
def test_attend_equals_reference(H, Hkv, D, S, isa):
    g = torch.Generator().manual_seed(H * D)
    B = 5
    q = torch.randn(B, H, D, generator=g)
    k, v = torch.randn(B, Hkv, S, D, generator=g) * 3, torch.randn(B, Hkv, S, D, generator=g)
    lengths = torch.tensor([1, 7, S, S - 17, 2])
    ref = _attention_reference(q, k, v, lengths, D ** -0.5)
    for threads in (1, 2):
        torch.testing.assert_close(_attend(q, k, v, lengths, D ** -0.5, threads), ref, rtol=1e-5, atol=1e-5)


def test_attend_rejects_bad_lengths():
    q, k = torch.zeros(2, 2, 8), torch.zeros(2, 2, 4, 8)
    with pytest.raises(ValueError, match="length"):
        _attend(q, k, k, torch.tensor([0, 4]), 1.0, 1)
    with pytest.raises(ValueError, match="length"):
        _attend(q, k, k, torch.tensor([5, 4]), 1.0, 1)


def _rounded(model, dtype):
    """A float32 copy of ``model`` whose matrices (not embeddings or norms) are stored as the decoder stores them."""
    sd = {k: PackedLinear(v, dtype).weight() if ("proj" in k or "ffn" in k or k == "lm_head.weight") else v
          for k, v in model.state_dict().items()}
    copy = TransformerLM(model.cfg).eval()
    copy.load_state_dict(sd)
    return copy


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "int8", "int4"])
def test_low_precision_weights_match_the_rounded_model(dtype):
    """With bf16/fp16/int8/int4 weights and float32 activations the decoder computes the model whose matrices are
    stored that way."""
    model = _model(n_kv_heads=2)
    rounded = _rounded(model, weight_dtype_of(dtype))
    dec = Engine(model, weight_dtype=dtype, activations="float32")
    seq = torch.randint(0, 97, (3, 30))
    with torch.inference_mode():
        full = rounded(seq)
        got = [dec.prefill(seq[:, :10].tolist(), 30)] + [dec.step(seq[:, t]) for t in range(10, 29)]
        torch.testing.assert_close(torch.stack(got, 1), full[:, 9:29], rtol=1e-4, atol=1e-4)
        assert (full - model(seq)).abs().max() > 1e-4  # the rounding is visible: the check above means something
    exact = Engine(model)
    with torch.inference_mode():
        assert (exact.prefill(seq.tolist(), 30) - model(seq)[:, -1]).abs().max() < 1e-4


def test_generator_weight_dtype_and_refresh():
    model = _model()
    gen = Generator(model, weight_dtype="bf16")
    assert gen.engine.weight_dtype == torch.bfloat16
    out = gen.generate_ids([1, 2, 3], 20, temperature=0)
    assert len(out) == 20
    gen.refresh()
    assert gen.engine.weight_dtype == torch.bfloat16
    assert gen.generate_ids([1, 2, 3], 20, temperature=0) == out


def test_weight_dtype_errors():
    with pytest.raises(ValueError, match="unknown weight dtype"):
        Engine(_model(), weight_dtype="int3")
    with pytest.raises(ValueError, match="float32, bfloat16, float16, int8 or int4"):
        Engine(_model(), weight_dtype=torch.float64)
    with pytest.raises(ValueError, match="needs the CPU decode kernel"):
        Engine(_model().double(), weight_dtype="bf16")
    # int4 on a device without the kernel (CUDA, or here the meta device standing in for one): one line
    with pytest.raises(ValueError, match=r"^int4 weights run on the CPU decode kernel only .* torch.float32 on meta, and "
                                         r"int4 has no path there yet: decode on CPU \(--device cpu\)$"):
        Engine(_model().to("meta"), weight_dtype="int4")


def test_decoder_restores_torch_threads(monkeypatch):
    """A kernel step runs PyTorch on one thread (the kernel has its own pool, given PyTorch's count) and puts
    the count back; so does a prefill (it does not run a step)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        dec = Engine(_model())
        seen = []
        original = Engine._step_kernel

        def spy(self, *a, **k):
            seen.append((torch.get_num_threads(), self._threads))
            return original(self, *a, **k)

        monkeypatch.setattr(Engine, "_step_kernel", spy)
        with torch.inference_mode():
            logits = dec.prefill([[1, 2], [3, 4]], 10)
            assert not seen and torch.get_num_threads() == 2
            dec.step(logits.argmax(-1))
        assert seen == [(1, 2)]
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_kernel_prefill_allocates_its_cache_on_one_torch_thread(monkeypatch):
    """On the kernel path a prefill zeroes its cache with PyTorch on one thread (after a parallel fill PyTorch's
    OpenMP workers spin on the cores the kernel's pool then needs) and puts PyTorch's count back after."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        dec, seen = Engine(_model()), []
        original = KVCache.for_model

        def spy(*a, **k):
            seen.append((torch.get_num_threads(), dec._threads))
            return original(*a, **k)

        monkeypatch.setattr(KVCache, "for_model", spy)
        dec.prefill([[1, 2, 3]], 10)
        assert seen == [(1, 2)] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_kernel_decoder_on_one_thread():
    """With PyTorch on one thread (OMP_NUM_THREADS=1, taskset) the kernel path runs on one thread and gives
    the PyTorch path's logits and tokens (it used to pass ``threads=None`` to the kernel: a TypeError).
    The thread count is put back by conftest's autouse fixture."""
    torch.set_num_threads(1)
    model = _model(seed=5)
    fast, ref = Engine(model), Engine(model, use_kernel=False)
    assert fast._kernel
    with torch.inference_mode():
        a, b = fast.prefill([[1, 2, 3], [4, 5]], 20), ref.prefill([[1, 2, 3], [4, 5]], 20)
        for _ in range(5):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
            a, b = fast.step(a.argmax(-1)), ref.step(a.argmax(-1))
    assert torch.get_num_threads() == 1
    gen = Generator(model)
    assert gen.generate_ids([[1, 2, 3]], 8, temperature=0) == gen.generate_ids([[1, 2, 3]], 8, temperature=0, naive=True)


def _child(conn, lin):
    # only small tensor ops here: PyTorch's own OpenMP pool does not survive fork (big ops hang in a child)
    conn.send(lin(torch.ones(2, 512), 2).sum().item())


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_kernel_pool_survives_fork():
    """The kernel works in a forked child (the parent's pool threads do not exist there): no hang, right sums."""
    lin = PackedLinear(torch.ones(256, 512))
    assert lin(torch.ones(2, 512), 2).sum().item() == 2 * 256 * 512  # the parent's pool is running
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_child, args=(child, lin))
    p.start()
    try:
        assert parent.poll(60), "the forked child hung in the kernel"
        assert parent.recv() == 2 * 256 * 512
    finally:
        p.kill()
        p.join(10)


def test_a_kernel_step_inside_serial_torch_skips_the_wrappers(monkeypatch):
    """Inside ``serial_torch`` (the decode loops of Generator, the scheduler and RL) a kernel step goes straight to
    the C++ step, not through ``_step``'s inference-mode and serial-torch wrappers (~30 us a token), with the
    logits the wrapped step gives."""
    model = _model(seed=5)
    fast, wrapped = Engine(model), Engine(model)
    assert fast._kernel
    with torch.inference_mode():
        a, b = fast.prefill([[1, 2, 3]], 20), wrapped.prefill([[1, 2, 3]], 20)
        want = wrapped.step(b.argmax(-1))
    monkeypatch.setattr(Engine, "_step", lambda self, tokens: pytest.fail("the wrapped step ran"))
    with torch.inference_mode(), fast.serial_torch():
        got = fast.step(a.argmax(-1))
    assert torch.equal(got, want)


def test_kernel_pool_runs_each_chunk_once_across_back_to_back_jobs():
    """Hundreds of thousands of tiny pool jobs back to back, chunk counts rising and falling: every chunk runs
    exactly once and the caller never waits forever. (A claim checked against the next job's chunk count
    hung this within 100k jobs in most runs, and hung an RL rollout under load; a hang here is the
    subprocess's timeout.)"""
    code = "from lmforge import _core; print(*(_core.pool_selfcheck(300_000, t) for t in (2, 3, 4)))"
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    except subprocess.TimeoutExpired:
        pytest.fail("the decode kernels' pool hung: a job's caller waited for a chunk count it never saw")
    assert out.stdout.split() == ["0", "0", "0"], out.stdout  # chunks run twice or out of range, per thread count


@pytest.mark.parametrize("kw", [{}, {"n_kv_heads": 2}, {"n_kv_heads": 1, "tie_embeddings": True}])
def test_kernel_decoder_equals_pytorch_path(kw, isa):
    """Prefill + steps with the C++ kernels give the PyTorch path's logits, with rows of different lengths
    and through a slide past the context (the window re-prefill)."""
    model = _model(seed=3, context_length=24, **kw)
    fast, ref = Engine(model, window_drop=5), Engine(model, window_drop=5, use_kernel=False)
    rows = [[1, 2, 3, 4, 5, 6, 7], [9, 8], [4] * 12]
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        a, b = fast.prefill(rows, 24), ref.prefill(rows, 24)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        for _ in range(30):  # the longest row fills the 24-token context and slides
            tok = torch.randint(0, 97, (3,), generator=g)
            a, b = fast.step(tok), ref.step(tok)
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert fast.lengths == ref.lengths
    assert torch.equal(fast.tokens, ref.tokens)


def test_use_kernel_needs_cpu_float32():
    with pytest.raises(ValueError, match="use_kernel=True needs"):
        Engine(_model().double(), use_kernel=True)


def test_small_decode_ops_equal_pytorch():
    from lmforge import _core

    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(3, 40, generator=g), torch.randn(40, generator=g)
    out = torch.empty(3, 40)
    _core.rms_norm_rows(x.numpy(), w.numpy(), 1e-5, out.numpy())
    torch.testing.assert_close(out, torch.nn.functional.rms_norm(x, (40,), w, 1e-5))
    gu = torch.randn(2, 18, generator=g)
    act = torch.empty(2, 9)
    _core.swiglu_rows(gu.numpy(), act.numpy())
    torch.testing.assert_close(act, torch.nn.functional.silu(gu[:, :9]) * gu[:, 9:])
    with pytest.raises(ValueError, match="swiglu_rows"):
        _core.swiglu_rows(gu.numpy(), torch.empty(2, 8).numpy())
    with pytest.raises(ValueError, match="rms_norm_rows"):
        _core.rms_norm_rows(x.numpy(), w[:5].numpy(), 1e-5, out.numpy())
    k = torch.zeros(1, 1, 4, 4)
    with pytest.raises(ValueError, match="position"):
        _core.rope_cache_rows(torch.zeros(1, 12).numpy(), torch.zeros(8, 2).numpy(), torch.zeros(8, 2).numpy(),
                              np.array([4], np.int64), k.numpy(), k.clone().numpy(), torch.zeros(1, 1, 4).numpy())


@pytest.mark.parametrize("C", [1, 7, 8, 40, 517, 768])
def test_rms_norm_rows_same_bits_on_every_isa(C):
    """RMSNorm's sum of squares runs in 8 lanes on both paths, added in one order: the vector and the scalar code
    give the same bits (a prompt's rows and a decode step's agree whichever runs), and both follow PyTorch's."""
    from lmforge import _core

    g = torch.Generator().manual_seed(C)
    x = torch.randn(5, C, generator=g) * torch.logspace(-3, 3, 5)[:, None]
    w = torch.randn(C, generator=g)
    outs = []
    for scalar in (False, True):
        _core.linear_force_scalar(scalar)
        try:
            out = torch.empty(5, C)
            _core.rms_norm_rows(x.numpy(), w.numpy(), 1e-5, out.numpy())
        finally:
            _core.linear_force_scalar(False)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    torch.testing.assert_close(outs[0], torch.nn.functional.rms_norm(x, (C,), w, 1e-5), rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("F", [1, 8, 13, 1344])
def test_swiglu_rows_vector_and_scalar_equal_float64(F, isa):
    """The vector kernel's own exp (clamped to float's range) against silu(g) * u in float64, g from -120 to 120."""
    from lmforge import _core

    g = torch.Generator().manual_seed(F)
    M = max(3, 40_000 // F)
    gate = torch.linspace(-120, 120, M * F).view(M, F)
    gate[1] = torch.randn(F, generator=g) * 4
    gu = torch.cat([gate, torch.randn(M, F, generator=g)], 1)
    act = torch.empty(M, F)
    _core.swiglu_rows(gu.numpy(), act.numpy())
    d = gu.double()
    # 4e-7: two float ulps; the exp's own error is ~1 ulp (a wrong polynomial coefficient shows up here)
    torch.testing.assert_close(act.double(), torch.nn.functional.silu(d[:, :F]) * d[:, F:], rtol=4e-7, atol=1e-30)
    bad = gu.clone()
    bad[0, 0] = float("nan")
    _core.swiglu_rows(bad.numpy(), act.numpy())
    assert act[0, 0].isnan() and act[0, 1:].isfinite().all()  # NaN is not clamped away
