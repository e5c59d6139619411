// lmforge._core: the Python bindings of the whole C++ core, and the only file that includes nanobind.
// Serves lmforge.tokenizer (tokenizer/), lmforge.corpus (corpus/) and lmforge.generate (decode/), which
// load it through lmforge/_native.py. Contract: docs/DESIGN.md; signatures: lmforge/_core.pyi.
// Bytes in, ints out: no file I/O, no configuration, no policy. Heavy work runs with the GIL released.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "corpus/docsplit.h"
#include "decode/kernels.h"
#include "decode/pool.h"
#include "tokenizer/bpe_training.h"
#include "tokenizer/counter.h"
#include "tokenizer/encoder.h"
#include "utf8.h"

namespace nb = nanobind;
using namespace lmforge;

namespace {

// UTF-8 view of a Python str (cached inside the str object, so valid while it lives).
std::pair<const uint8_t*, size_t> utf8_of(nb::handle s) {
    if (!PyUnicode_Check(s.ptr())) throw nb::type_error("expected str");
    Py_ssize_t n;
    const char* p = PyUnicode_AsUTF8AndSize(s.ptr(), &n);
    if (!p) {
        PyErr_Clear();
        throw std::invalid_argument("text cannot be encoded as UTF-8 (it contains lone surrogates); "
                                    "clean it with .encode('utf-8', 'replace').decode()");
    }
    return {(const uint8_t*)p, (size_t)n};
}

std::vector<std::pair<const uint8_t*, size_t>> utf8_all(const nb::list& texts, std::vector<nb::object>& keep) {
    std::vector<std::pair<const uint8_t*, size_t>> docs;
    docs.reserve(nb::len(texts));
    keep.reserve(nb::len(texts));
    for (nb::handle h : texts) {
        docs.push_back(utf8_of(h));
        keep.push_back(nb::borrow(h));
    }
    return docs;
}

// The Python-facing Encoder keeps one Python int per vocabulary id, so building result lists costs an
// incref per token instead of an allocation (most of the time of list output otherwise).
class PyEncoder : public Encoder {
public:
    using Encoder::Encoder;
    ~PyEncoder() {
        for (PyObject* o : ints_) Py_XDECREF(o);
    }
    nb::list to_list(const std::vector<uint32_t>& ids) const { return to_list(ids.data(), ids.size()); }
    // GIL held.
    nb::list to_list(const uint32_t* ids, size_t n) const {
        if (ints_.empty()) {
            ints_.resize(vocab_size());
            for (size_t i = 0; i < ints_.size(); ++i) ints_[i] = PyLong_FromSize_t(i);
        }
        PyObject* l = PyList_New((Py_ssize_t)n);
        if (!l) throw nb::python_error();
        for (size_t i = 0; i < n; ++i) {
            uint32_t id = ids[i];
            PyObject* o;
            if (id < ints_.size()) {
                o = ints_[id];
                Py_INCREF(o);
            } else {
                o = PyLong_FromUnsignedLong(id);
            }
            PyList_SET_ITEM(l, (Py_ssize_t)i, o);
        }
        return nb::steal<nb::list>(l);
    }

private:
    mutable std::vector<PyObject*> ints_;
};

// A read-only view of any contiguous bytes-like object (bytes, bytearray, memoryview); released in
// the destructor, which must run with the GIL held (declare it outside any gil_scoped_release).
class ByteView {
public:
    explicit ByteView(nb::handle h) {
        if (PyObject_GetBuffer(h.ptr(), &view_, PyBUF_SIMPLE) != 0) {
            PyErr_Clear();
            throw nb::type_error("expected bytes or a contiguous bytes-like object (bytearray, memoryview)");
        }
    }
    ~ByteView() { PyBuffer_Release(&view_); }
    ByteView(const ByteView&) = delete;
    ByteView& operator=(const ByteView&) = delete;
    const uint8_t* data() const { return (const uint8_t*)view_.buf; }
    size_t size() const { return (size_t)view_.len; }

private:
    Py_buffer view_;
};

std::vector<std::string> bytes_list(const nb::list& items, const char* what) {
    std::vector<std::string> out;
    out.reserve(nb::len(items));
    for (nb::handle h : items) {
        if (!PyBytes_Check(h.ptr())) throw std::invalid_argument(std::string(what) + " must be bytes");
        out.emplace_back(PyBytes_AS_STRING(h.ptr()), (size_t)PyBytes_GET_SIZE(h.ptr()));
    }
    return out;
}

template <class T>
nb::ndarray<nb::numpy, T, nb::ndim<1>> to_numpy(std::vector<T>&& v) {
    auto* heap = new std::vector<T>(std::move(v));
    nb::capsule owner(heap, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
    return nb::ndarray<nb::numpy, T, nb::ndim<1>>(heap->data(), {heap->size()}, owner);
}

constexpr size_t kReleaseGilBytes = 4096;  // below this, releasing the GIL costs more than it frees

// How a packed matrix of each weight type is stored (decode/kernels.h, linear_rows).
nb::dlpack::dtype packed_dtype(WeightType wt) {
    switch (wt) {
        case WeightType::F32: return nb::dtype<float>();
        case WeightType::I8: return nb::dtype<int8_t>();
        case WeightType::I8Q8: return nb::dtype<int8_t>();
        case WeightType::I4: case WeightType::I4Q8: return nb::dtype<uint8_t>();
        default: return nb::dtype<uint16_t>();
    }
}
// Sizes from Python are untrusted: a product or sum that wraps would pass a bound check and send a kernel
// outside its arrays. ceil_div never wraps; mul and add throw where the result does not fit size_t.
size_t ceil_div(size_t a, size_t b) { return a / b + (a % b != 0); }
size_t mul(size_t a, size_t b, const char* what) {
    size_t r;
    if (__builtin_mul_overflow(a, b, &r)) throw std::invalid_argument(std::string(what) + ": sizes overflow");
    return r;
}
size_t add(size_t a, size_t b, const char* what) {
    size_t r;
    if (__builtin_add_overflow(a, b, &r)) throw std::invalid_argument(std::string(what) + ": sizes overflow");
    return r;
}
bool needs_scales(WeightType wt) { return (int)wt >= (int)WeightType::I8; }
bool is_int4(WeightType wt) { return wt == WeightType::I4 || wt == WeightType::I4Q8; }
size_t packed_k(WeightType wt, size_t K) {
    return is_int4(wt) ? 16 * ceil_div(K, 32) : wt == WeightType::I8Q8 ? 32 * ceil_div(K, 32) : K;
}
// Called once the packed array's shape matched (N, K): then the count is below the array's size.
size_t scale_count(WeightType wt, size_t N, size_t K) { return is_int4(wt) ? ceil_div(N, 8) * ceil_div(K, 32) * 8 : N; }
// int8 scales are float32, int4 scales fp16 bit patterns (uint16), as decode/kernels.h stores them.
nb::dlpack::dtype scale_dtype(WeightType wt) { return is_int4(wt) ? nb::dtype<uint16_t>() : nb::dtype<float>(); }

// The whole decode step (decode/step.cpp). The model points into the weight arrays it was built from;
// it keeps them alive, and refuses arrays it would have to convert (a converted copy would not live).
struct StepModel {
    DecodeModel m;
    std::vector<nb::object> keep;
    template <class T>
    T take(nb::handle h, const char* what) {
        T arr;
        if (!nb::try_cast<T>(h, arr, false))
            throw std::invalid_argument(std::string("DecodeModel: ") + what +
                                        " must be a C-contiguous CPU array of the right dtype and rank");
        keep.push_back(nb::borrow(h));
        return arr;
    }
    const float* vec(nb::handle h, size_t n, const char* what) {
        auto a = take<nb::ndarray<nb::ro, float, nb::ndim<1>, nb::c_contig, nb::device::cpu>>(h, what);
        if (a.shape(0) != n) throw std::invalid_argument(std::string("DecodeModel: ") + what + " must have d_model floats");
        return a.data();
    }
    PackedMatrix matrix(nb::handle spec, size_t N, size_t K, const char* what) {
        const std::string name = std::string("DecodeModel: ") + what;
        nb::tuple t;
        if (!nb::try_cast<nb::tuple>(spec, t) || t.size() != 3)
            throw std::invalid_argument(name + " must be (packed array, kind, scales or None)");
        auto w = take<nb::ndarray<nb::ro, nb::ndim<3>, nb::c_contig, nb::device::cpu>>(t[0], what);
        const int kind = nb::cast<int>(t[1]);
        if (kind < 0 || kind > 6) throw std::invalid_argument(name + ": kind is 0 .. 6");
        PackedMatrix pm;
        pm.wt = (WeightType)kind;
        pm.N = N;
        pm.K = K;
        if (w.dtype() != packed_dtype(pm.wt)) throw std::invalid_argument(name + " has the wrong dtype for its kind");
        // K >= 1 (the model's sizes are checked first), so a matching shape holds at least N * K / 2 bytes: N is real.
        if (w.shape(0) != ceil_div(pm.N, 8) || w.shape(1) != packed_k(pm.wt, K) || w.shape(2) != 8)
            throw std::invalid_argument(name + " must be packed as (ceil(N / 8), K, 8) (int4: (ceil(N / 8), "
                                        "16 ceil(K / 32), 8); kind 5: (ceil(N / 8), 32 ceil(K / 32), 8)) with N = " + std::to_string(pm.N) + ", K = " +
                                        std::to_string(K));
        if (needs_scales(pm.wt)) {
            if (t[2].is_none()) throw std::invalid_argument(name + ": int8 and int4 weights need scales");
            auto sc = take<nb::ndarray<nb::ro, nb::ndim<1>, nb::c_contig, nb::device::cpu>>(t[2], what);
            if (sc.dtype() != scale_dtype(pm.wt))
                throw std::invalid_argument(name + ": scales are float32 for int8 weights, fp16 bits (uint16) for int4");
            if (sc.shape(0) < scale_count(pm.wt, N, K))
                throw std::invalid_argument(name + ": one scale per output row (int8) or per 8 rows x 32 columns (int4)");
            pm.scales = sc.data();
        }
        pm.w = w.data();
        return pm;
    }
};

}  // namespace

NB_MODULE(_core, m) {
    m.doc() = "lmforge C++ core: pre-tokenization, pre-token counting, BPE training and encoding, document splitting, decode-time matrix products and attention";
    m.attr("ABI_VERSION") = 9;  // checked by lmforge._native.core(): bump both when a binding changes
    m.attr("PATTERN_GPT2") = (int)kGPT2;
    m.attr("PATTERN_GPT4") = (int)kGPT4;
    m.attr("PATTERN_NANOCHAT") = (int)kNanochat;
    m.attr("PATTERN_CUSTOM") = (int)kCustom;

    m.def(
        "utf8_error_offset",
        [](nb::handle data) {
            ByteView v(data);
            if (v.size() < kReleaseGilBytes) return utf8_error_offset(v.data(), v.size());
            nb::gil_scoped_release release;
            return utf8_error_offset(v.data(), v.size());
        },
        nb::arg("data"), nb::sig("def utf8_error_offset(data: bytes | bytearray | memoryview) -> int"),
        "Offset of the first invalid UTF-8 byte in data, or -1 if it is valid UTF-8.");

    m.def(
        "linear_rows",
        [](nb::ndarray<nb::ro, float, nb::ndim<2>, nb::c_contig, nb::device::cpu> x,
           nb::ndarray<nb::ro, nb::ndim<3>, nb::c_contig, nb::device::cpu> w, int kind,
           nb::ndarray<float, nb::ndim<2>, nb::device::cpu> y, int threads,
           std::optional<nb::ndarray<nb::ro, nb::ndim<1>, nb::c_contig, nb::device::cpu>> scales) {
            // A shape (0, K) x may claim any K: only the shapes below that real memory backs are trusted.
            const size_t M = x.shape(0), K = x.shape(1), N = y.shape(1);
            if (y.shape(0) != M || y.stride(1) != 1 || y.stride(0) < (int64_t)N)
                throw std::invalid_argument("linear_rows: y must be (M, N) with contiguous rows, M = len(x)");
            if (kind < 0 || kind > 6)
                throw std::invalid_argument("linear_rows: kind is 0 (fp32), 1 (bf16), 2 (fp16), 3 (int8), 4 (int4), "
                                            "5 (int8, int8 activations) or 6 (int4, int8 activations)");
            const auto wt = (WeightType)kind;
            if (w.shape(0) != ceil_div(N, 8) || w.shape(1) != packed_k(wt, K) || w.shape(2) != 8)
                throw std::invalid_argument("linear_rows: w must be packed as (ceil(N / 8), K, 8) (int4: (ceil(N / 8), "
                                            "16 ceil(K / 32), 8); kind 5: (ceil(N / 8), 32 ceil(K / 32), 8)) for x "
                                            "(M, K), y (M, N)");
            if (w.dtype() != packed_dtype(wt))
                throw std::invalid_argument("linear_rows: w must be float32 for kind 0, uint16 bits for kinds 1, 2, "
                                            "int8 for kinds 3 and 5 and uint8 for kinds 4 and 6");
            const void* sp = nullptr;
            if (needs_scales(wt)) {
                if (!scales || scales->dtype() != scale_dtype(wt) || scales->shape(0) < scale_count(wt, N, K))
                    throw std::invalid_argument("linear_rows: int8 weights need scales, one float32 per output row; "
                                                "int4 weights one fp16 (as uint16 bits) per 8 rows x 32 columns");
                sp = scales->data();
            }
            const float* xp = x.data();
            const void* wp = w.data();
            float* yp = y.data();
            const size_t ldy = (size_t)y.stride(0);
            nb::gil_scoped_release release;
            linear_rows(xp, M, K, wp, wt, N, yp, ldy, threads, sp);
        },
        nb::arg("x"), nb::arg("w"), nb::arg("kind"), nb::arg("y").noconvert(), nb::arg("threads"),
        nb::arg("scales") = nb::none(),
        "y[:] = x @ W.T for a few rows x (M, K) float32; W (N, K) comes packed in panels of 8 rows, "
        "w[p, k, j] = W[8p + j, k] (zero past N), as float32 (kind 0), bf16/fp16 bits in uint16 (kind 1/2) or "
        "int8 codes (kind 3, W = w * scales[n] per output row) or int4 codes (kind 4, uint8 (ceil(N / 8), 16 ceil(K / 32), 8): "
        "two k per byte, low nibble first; W = scales[(p * G + k // 32) * 8 + j] * (q - 8), scales fp16 bits in uint16); kinds 5 and 6: the same codes "
        "in the integer layouts of decode/kernels.h, x rounded to int8 per block of 32, int32 block sums. Accumulates in float32 on up "
        "to `threads` threads; each output's sum runs in the same order whatever M and the threads (batch invariant).");
    m.def(
        "attend_rows",
        [](nb::ndarray<nb::ro, float, nb::ndim<3>, nb::c_contig, nb::device::cpu> q,
           nb::ndarray<nb::ro, float, nb::ndim<4>, nb::c_contig, nb::device::cpu> k,
           nb::ndarray<nb::ro, float, nb::ndim<4>, nb::c_contig, nb::device::cpu> v,
           nb::ndarray<nb::ro, int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> lengths, float scale,
           nb::ndarray<float, nb::ndim<3>, nb::c_contig, nb::device::cpu> out, int threads) {
            const size_t B = q.shape(0), H = q.shape(1), D = q.shape(2), Hkv = k.shape(1), S = k.shape(2);
            if (k.shape(0) != B || k.shape(3) != D || v.shape(0) != B || v.shape(1) != Hkv || v.shape(2) != S ||
                v.shape(3) != D)
                throw std::invalid_argument("attend_rows: q is (B, H, D); k and v must be (B, Hkv, S, D)");
            if (Hkv == 0 || H % Hkv != 0) throw std::invalid_argument("attend_rows: H must be a multiple of Hkv");
            if (out.shape(0) != B || out.shape(1) != H || out.shape(2) != D)
                throw std::invalid_argument("attend_rows: out must be (B, H, D) like q");
            if (lengths.shape(0) != B) throw std::invalid_argument("attend_rows: lengths must be (B,)");
            for (size_t b = 0; b < B; ++b)
                if (lengths(b) < 1 || (size_t)lengths(b) > S)
                    throw std::invalid_argument("attend_rows: each length must be in [1, S]");
            const float *qp = q.data(), *kp = k.data(), *vp = v.data();
            const int64_t* lp = lengths.data();
            float* op = out.data();
            nb::gil_scoped_release release;
            attend_rows(qp, kp, vp, lp, B, H, Hkv, S, D, scale, op, threads);
        },
        nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("lengths"), nb::arg("scale"), nb::arg("out").noconvert(),
        nb::arg("threads"),
        "out[b, h] = softmax(scale * q[b, h] . k[b, h // G, :n].T) @ v[b, h // G, :n] with n = lengths[b], "
        "G = H // Hkv: one decode step's attention over a KV cache (B, Hkv, S, D), float32.");
    m.def(
        "rms_norm_rows",
        [](nb::ndarray<nb::ro, float, nb::ndim<2>, nb::c_contig, nb::device::cpu> x,
           nb::ndarray<nb::ro, float, nb::ndim<1>, nb::c_contig, nb::device::cpu> w, float eps,
           nb::ndarray<float, nb::ndim<2>, nb::c_contig, nb::device::cpu> out) {
            if (w.shape(0) != x.shape(1) || out.shape(0) != x.shape(0) || out.shape(1) != x.shape(1))
                throw std::invalid_argument("rms_norm_rows: x and out are (M, C), w is (C,)");
            rms_norm_rows(x.data(), x.shape(0), x.shape(1), w.data(), eps, out.data());
        },
        nb::arg("x"), nb::arg("w"), nb::arg("eps"), nb::arg("out").noconvert(),
        "out = x / sqrt(mean(x**2, -1) + eps) * w for x (M, C) float32 (decode-step RMSNorm).");
    m.def(
        "rope_cache_rows",
        [](nb::ndarray<nb::ro, float, nb::ndim<2>, nb::c_contig, nb::device::cpu> qkv,
           nb::ndarray<nb::ro, float, nb::ndim<2>, nb::c_contig, nb::device::cpu> cos,
           nb::ndarray<nb::ro, float, nb::ndim<2>, nb::c_contig, nb::device::cpu> sin,
           nb::ndarray<nb::ro, int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> pos,
           nb::ndarray<float, nb::ndim<4>, nb::c_contig, nb::device::cpu> k_cache,
           nb::ndarray<float, nb::ndim<4>, nb::c_contig, nb::device::cpu> v_cache,
           nb::ndarray<float, nb::ndim<3>, nb::c_contig, nb::device::cpu> q_out) {
            const size_t B = qkv.shape(0), H = q_out.shape(1), D = q_out.shape(2), Hkv = k_cache.shape(1),
                         S = k_cache.shape(2);
            if (q_out.shape(0) != B || k_cache.shape(0) != B || k_cache.shape(3) != D || D % 2 ||
                v_cache.shape(0) != B || v_cache.shape(1) != Hkv || v_cache.shape(2) != S || v_cache.shape(3) != D ||
                qkv.shape(1) != (H + 2 * Hkv) * D || pos.shape(0) != B || cos.shape(1) != D / 2 ||
                sin.shape(0) != cos.shape(0) || sin.shape(1) != D / 2)
                throw std::invalid_argument("rope_cache_rows: shapes do not agree (qkv (B, (H + 2 Hkv) D), tables "
                                            "(P, D/2), caches (B, Hkv, S, D), q_out (B, H, D), D even)");
            for (size_t b = 0; b < B; ++b)
                if (pos(b) < 0 || (size_t)pos(b) >= S || (size_t)pos(b) >= cos.shape(0))
                    throw std::invalid_argument("rope_cache_rows: a position is outside the cache or the tables");
            rope_cache_rows(qkv.data(), B, H, Hkv, D, cos.data(), sin.data(), pos.data(), k_cache.data(),
                            v_cache.data(), S, q_out.data());
        },
        nb::arg("qkv"), nb::arg("cos"), nb::arg("sin"), nb::arg("pos"), nb::arg("k_cache").noconvert(),
        nb::arg("v_cache").noconvert(), nb::arg("q_out").noconvert(),
        "RoPE at positions pos on the q and k heads of fused projections qkv; q to q_out, k and v into the caches "
        "at column pos[b] (one decode step).");
    m.def(
        "swiglu_rows",
        [](nb::ndarray<nb::ro, float, nb::ndim<2>, nb::c_contig, nb::device::cpu> gate_up,
           nb::ndarray<float, nb::ndim<2>, nb::c_contig, nb::device::cpu> out) {
            if (gate_up.shape(1) != 2 * out.shape(1) || gate_up.shape(0) != out.shape(0))
                throw std::invalid_argument("swiglu_rows: gate_up is (M, 2F) and out (M, F)");
            swiglu_rows(gate_up.data(), gate_up.shape(0), out.shape(1), out.data());
        },
        nb::arg("gate_up"), nb::arg("out").noconvert(), "out = silu(g) * u for gate_up = [g | u] (M, 2F), float32.");
    m.def(
        "pool_selfcheck",
        [](uint64_t jobs, int threads) {
            if (threads < 2 || threads > 64) throw std::invalid_argument("pool_selfcheck: threads must be in [2, 64]");
            nb::gil_scoped_release release;
            return pool_selfcheck(jobs, threads);
        },
        nb::arg("jobs"), nb::arg("threads"),
        "Run `jobs` tiny jobs back to back on the decode kernels' pool; the number of chunks that ran other than "
        "exactly once (0 when the pool is right; for tests).");
    m.def("linear_isa", &linear_isa,
          "Instruction set the decode kernels use on this CPU: 'avx512_bf16' (linear_bf16_activations is on and "
          "runs: the bf16-weight products on AVX-512 BF16), 'avx512_vnni' (the int8-activation products on "
          "AVX-512 VNNI, the rest on AVX-512), 'avx512', 'avx2' or 'scalar'.");
    m.def("linear_force_scalar", &linear_force_scalar, nb::arg("on"),
          "Run the decode kernels' scalar code even on AVX2 CPUs (for tests).");
    m.def("linear_force_avx2", &linear_force_avx2, nb::arg("on"),
          "Run the decode kernels' AVX2 code even on AVX-512 CPUs (for tests).");
    m.def("linear_force_avx512", &linear_force_avx512, nb::arg("on"),
          "Run the decode kernels' AVX-512F code (no VNNI) even on AVX-512 VNNI CPUs (for tests).");
    m.def("linear_bf16_activations", &linear_bf16_activations, nb::arg("on"),
          "Opt-in numerics of bf16-weight products (kind 1): round each row of x to bf16, sum the products in "
          "float32 with vdpbf16ps (k = 1, 0, 3, 2, ..). Runs where the CPU has AVX-512 BF16 and no force switch "
          "is on (linear_isa() says 'avx512_bf16'); elsewhere nothing changes. Process-wide.");

    using F2 = nb::ndarray<nb::ro, float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
    nb::class_<StepModel>(m, "DecodeModel",
                          "A model's weights for its decode step (.step): packed matrices (fp32/bf16/fp16/int8/int4), norms, embeddings "
                          "and the RoPE tables, borrowed (kept alive) from the arrays given.")
        .def(
            "__init__",
            [](StepModel* self, nb::handle embed, nb::handle cos, nb::handle sin, size_t n_heads, size_t n_kv_heads,
               size_t d_ff, float eps, nb::list layers, nb::handle ln_final, nb::handle head, size_t head_n) {
                auto* s = new (self) StepModel();
                try {
                    DecodeModel& d = s->m;
                    auto e = s->take<F2>(embed, "embed");
                    auto c = s->take<F2>(cos, "cos");
                    auto sn = s->take<F2>(sin, "sin");
                    d.vocab = e.shape(0), d.C = e.shape(1), d.embed = e.data();
                    d.H = n_heads, d.Hkv = n_kv_heads, d.F = d_ff, d.eps = eps;
                    d.D = 2 * c.shape(1), d.positions = c.shape(0), d.cos = c.data(), d.sin = sn.data();
                    if (d.H == 0 || d.Hkv == 0 || d.H % d.Hkv || d.D == 0 || sn.shape(0) != c.shape(0) ||
                        sn.shape(1) != c.shape(1))
                        throw std::invalid_argument("DecodeModel: n_heads must be a multiple of n_kv_heads, cos and sin "
                                                    "(positions, head_dim / 2)");
                    if (d.vocab == 0 || d.C == 0 || d.F == 0 || head_n == 0)
                        throw std::invalid_argument("DecodeModel: embed (V, C), d_ff and head_n must not be empty");
                    const size_t C = d.C, H = d.H, Hkv = d.Hkv, D = d.D, F = d.F;
                    const size_t qkv_n = mul(add(H, mul(2, Hkv, "DecodeModel"), "DecodeModel"), D, "DecodeModel");
                    const size_t hd = mul(H, D, "DecodeModel"), ff2 = mul(2, F, "DecodeModel");
                    for (nb::handle item : layers) {
                        nb::tuple t;
                        if (!nb::try_cast<nb::tuple>(item, t) || t.size() != 6)
                            throw std::invalid_argument("DecodeModel: a layer is (ln1, qkv, out, ln2, up, down)");
                        DecodeLayer L;
                        L.ln1 = s->vec(t[0], C, "ln1");
                        L.qkv = s->matrix(t[1], qkv_n, C, "qkv");
                        L.out = s->matrix(t[2], C, hd, "out");
                        L.ln2 = s->vec(t[3], C, "ln2");
                        L.up = s->matrix(t[4], ff2, C, "up");
                        L.down = s->matrix(t[5], C, F, "down");
                        d.layers.push_back(L);
                    }
                    d.ln_final = s->vec(ln_final, C, "ln_final");
                    d.head = s->matrix(head, head_n, C, "head");
                } catch (...) {
                    s->~StepModel();
                    throw;
                }
            },
            nb::arg("embed"), nb::arg("cos"), nb::arg("sin"), nb::arg("n_heads"), nb::arg("n_kv_heads"),
            nb::arg("d_ff"), nb::arg("eps"), nb::arg("layers"), nb::arg("ln_final"), nb::arg("head"),
            nb::arg("head_n"),
            "embed (V, C) and cos, sin (P, head_dim / 2) float32; layers: [(ln1, qkv, out, ln2, up, down)] with "
            "norms (C,) and matrices (packed (ceil(N/8), K, 8), kind, scales or None): qkv = [q | k | v] "
            "((H + 2 Hkv) D, C), out (C, H D), up = [w1 | w3] (2 d_ff, C), down (C, d_ff); head (head_n, C).")
        .def(
            "step",
            [](StepModel& s, nb::ndarray<nb::ro, int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> tokens,
               nb::ndarray<float, nb::ndim<5>, nb::c_contig, nb::device::cpu> k,
               nb::ndarray<float, nb::ndim<5>, nb::c_contig, nb::device::cpu> v,
               nb::ndarray<int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> lengths,
               nb::ndarray<float, nb::ndim<2>, nb::c_contig, nb::device::cpu> logits, int threads, size_t first) {
                const DecodeModel& d = s.m;
                const size_t B = lengths.shape(0), rows = k.shape(1), S = k.shape(3);
                if (k.shape(0) != d.layers.size() || k.shape(2) != d.Hkv || k.shape(4) != d.D)
                    throw std::invalid_argument("DecodeModel.step: k and v must be (layers, rows, n_kv_heads, S, head_dim)");
                for (size_t i = 0; i < 5; ++i)
                    if (v.shape(i) != k.shape(i)) throw std::invalid_argument("DecodeModel.step: v must be shaped like k");
                // first > rows - B, not first + B > rows: first comes from Python and the sum could wrap.
                if (B == 0 || B > rows || first > rows - B || tokens.shape(0) == 0 || tokens.shape(0) % B ||
                    (logits.shape(0) != B && logits.shape(0) != tokens.shape(0)) || logits.shape(1) != d.head.N)
                    throw std::invalid_argument("DecodeModel.step: lengths (B,) with 0 < B <= rows - first, tokens "
                                                "(B * T,), logits (B, head_n) or (B * T, head_n)");
                const size_t T = tokens.shape(0) / B;
                // The step's scratch: M = B * T rows of the model's widest product (decode/step.cpp).
                const size_t widest = std::max({d.C, d.head.N, d.layers.empty() ? 0 : d.layers[0].qkv.N,
                                                d.layers.empty() ? 0 : d.layers[0].up.N});
                mul(B * T, widest, "DecodeModel.step");
                for (size_t i = 0; i < B * T; ++i)
                    if (tokens(i) < 0 || (size_t)tokens(i) >= d.vocab)
                        throw std::invalid_argument("DecodeModel.step: token id " + std::to_string(tokens(i)) +
                                                    " outside the vocabulary [0, " + std::to_string(d.vocab) + ")");
                for (size_t b = 0; b < B; ++b)
                    if (lengths(b) < 0 || T > S || T > d.positions || (size_t)lengths(b) > S - T ||
                        (size_t)lengths(b) > d.positions - T)
                        throw std::invalid_argument("DecodeModel.step: a row's cache is full (or its length is "
                                                    "outside the cache and the RoPE tables)");
                const int64_t* tp = tokens.data();
                float *kp = k.data(), *vp = v.data(), *lp = logits.data();
                int64_t* np = lengths.data();
                nb::gil_scoped_release release;
                const bool all = logits.shape(0) != B;  // (B * T, head_n): every token's logits
                decode_step(d, tp, B, T, kp, vp, rows, first, S, np, lp, threads, all);
            },
            nb::arg("tokens"), nb::arg("k").noconvert(), nb::arg("v").noconvert(), nb::arg("lengths").noconvert(),
            nb::arg("logits").noconvert(), nb::arg("threads"), nb::arg("first") = 0,
            "Feed T = len(tokens) // B tokens to each of B = len(lengths) rows: row b's tokens "
            "tokens[b * T:(b + 1) * T] go to cache row first + b at columns lengths[b] .. lengths[b] + T - 1 of the "
            "cache k, v (layers, rows, n_kv_heads, S, head_dim); writes their keys and values there, the logits "
            "(B, head_n) of the token after each row's last (logits shaped (B * T, head_n): after each of its tokens, "
            "row b * T + t), and lengths[b] += T. T = 1: a decode step; T > 1: a prompt, its tokens as the rows of "
            "each product. On up to `threads` threads; batch invariant (a row's "
            "numbers do not depend on the other rows, on T or on the threads).");

    m.def(
        "split_documents",
        [](nb::handle data, nb::bytes sep, bool final, bool want_crc) {
            ByteView v(data);
            std::string sp(sep.c_str(), sep.size());
            if (sp.empty()) throw std::invalid_argument("the delimiter must not be empty");
            DocSpans d;
            {
                nb::gil_scoped_release release;
                split_documents(v.data(), v.size(), sp, final, want_crc, d);
            }
            nb::object crc = want_crc ? nb::cast(to_numpy(std::move(d.crc))) : nb::none();
            return nb::make_tuple(d.consumed, d.pieces, to_numpy(std::move(d.starts)), to_numpy(std::move(d.ends)),
                                  crc, d.bad_piece);
        },
        nb::arg("data"), nb::arg("sep"), nb::arg("final"), nb::arg("want_crc"),
        nb::sig("def split_documents(data: bytes | bytearray | memoryview, sep: bytes, final: bool, want_crc: bool) -> tuple[int, int, numpy.ndarray, numpy.ndarray, numpy.ndarray | None, int]"),
        "Split data on sep into stripped documents: (consumed, pieces, starts, ends, crc32 or None, bad_piece).");

    m.def(
        "crc32",
        [](nb::handle data, uint32_t value) {
            ByteView v(data);
            return crc32(value, v.data(), v.size());
        },
        nb::arg("data"), nb::arg("value") = 0, nb::sig("def crc32(data: bytes | bytearray | memoryview, value: int = 0) -> int"),
        "zlib.crc32, for holding the C++ checksum to zlib's.");

    m.def(
        "pretokenize",
        [](nb::handle text, int pattern) {
            ByteView v(text);
            const uint8_t* s = v.data();
            size_t n = v.size();
            if (pattern < kGPT2 || pattern > kNanochat)
                throw std::invalid_argument("unknown pattern id " + std::to_string(pattern) +
                                            "; use PATTERN_GPT2, PATTERN_GPT4 or PATTERN_NANOCHAT");
            long long bad = utf8_error_offset(s, n);
            if (bad >= 0) throw std::invalid_argument("invalid UTF-8 at byte offset " + std::to_string(bad));
            nb::list out;
            pretokenize_piece(pattern, s, n, [&](const uint8_t* p, size_t len) {
                out.append(nb::bytes((const char*)p, len));
            });
            return out;
        },
        nb::arg("text"), nb::arg("pattern"),
        nb::sig("def pretokenize(text: bytes | bytearray | memoryview, pattern: int) -> list[bytes]"),
        "Split UTF-8 text into pre-tokens, exactly like regex.findall(PATTERNS[name], text).");

    nb::class_<PretokenCounter>(m, "PretokenCounter",
                                "Counts unique pre-tokens of text fed in chunks; memory grows with the number "
                                "of unique pre-tokens only.")
        .def(
            "__init__",
            [](PretokenCounter* self, int pattern, nb::list special_tokens) {
                new (self) PretokenCounter(pattern, bytes_list(special_tokens, "special tokens"));
            },
            nb::arg("pattern"), nb::arg("special_tokens"),
            nb::sig("def __init__(self, pattern: int, special_tokens: list[bytes]) -> None"))
        .def(
            "add",
            [](PretokenCounter& c, nb::handle data, int num_threads) {
                ByteView v(data);  // bytes-like: a memoryview slice avoids a copy
                nb::gil_scoped_release release;
                c.add(v.data(), v.size(), num_threads);
            },
            nb::arg("data"), nb::arg("num_threads"),
            nb::sig("def add(self, data: bytes | bytearray | memoryview, num_threads: int) -> None"),
            "Split on special tokens (never counted), pre-tokenize on num_threads threads and count.")
        .def(
            "add_counts",
            [](PretokenCounter& c, nb::list words, std::vector<int64_t> counts) {
                c.add_counts(bytes_list(words, "words"), counts);
            },
            nb::arg("words"), nb::arg("counts"),
            nb::sig("def add_counts(self, words: list[bytes], counts: list[int]) -> None"), "Add counts of words pre-tokenized elsewhere (custom patterns).")
        .def("__len__", &PretokenCounter::size)
        .def("total", &PretokenCounter::total, "Number of pre-tokens counted (with multiplicity).")
        .def(
            "items",
            [](const PretokenCounter& c) {
                nb::list out;
                c.for_each([&](const uint8_t* p, uint32_t len, int64_t count) {
                    out.append(nb::make_tuple(nb::bytes((const char*)p, len), count));
                });
                return out;
            },
            nb::sig("def items(self) -> list[tuple[bytes, int]]"), "All (pre-token bytes, count) pairs.");

    m.def(
        "train_bpe",
        [](const PretokenCounter& counter, long long num_merges, nb::object progress) {
            std::function<void(long long)> cb;
            if (!progress.is_none())
                cb = [&progress](long long k) {
                    nb::gil_scoped_acquire acquire;
                    progress(k);
                };
            std::vector<std::pair<std::string, std::string>> merges;
            {
                nb::gil_scoped_release release;
                merges = train_bpe(counter, num_merges, cb);
            }
            nb::list out;
            for (const auto& [a, b] : merges)
                out.append(nb::make_tuple(nb::bytes(a.data(), a.size()), nb::bytes(b.data(), b.size())));
            return out;
        },
        nb::arg("counter"), nb::arg("num_merges"), nb::arg("progress") = nb::none(),
        nb::sig("def train_bpe(counter: PretokenCounter, num_merges: int, progress: typing.Callable[[int], object] | None = None) -> list[tuple[bytes, bytes]]"),
        "Learn up to num_merges BPE merges from the counter's pre-tokens (ties: greatest byte pair).");

    nb::class_<PyEncoder>(m, "Encoder", "Token ids from text with a byte-level BPE vocabulary and merge ranks.")
        .def(
            "__init__",
            [](PyEncoder* self, nb::list vocab, std::vector<std::pair<int64_t, int64_t>> merges, nb::dict special_tokens,
               int pattern) {
                std::vector<std::pair<std::string, int64_t>> specials;
                for (auto [k, v] : special_tokens) {
                    auto [p, n] = utf8_of(k);
                    specials.emplace_back(std::string((const char*)p, n), nb::cast<int64_t>(v));
                }
                new (self) PyEncoder(bytes_list(vocab, "vocab entries"), merges, specials, pattern);
            },
            nb::arg("vocab"), nb::arg("merges"), nb::arg("special_tokens"), nb::arg("pattern"),
            nb::sig("def __init__(self, vocab: list[bytes], merges: list[tuple[int, int]], special_tokens: dict[str, int], pattern: int) -> None"))
        .def(
            "encode",
            [](const PyEncoder& e, nb::str text, bool allow_special) {
                auto [p, n] = utf8_of(text);
                std::vector<uint32_t> ids;
                if (n >= kReleaseGilBytes) {
                    nb::gil_scoped_release release;
                    e.encode(p, n, allow_special, ids);
                } else {
                    e.encode(p, n, allow_special, ids);
                }
                return e.to_list(ids);
            },
            nb::arg("text"), nb::arg("allow_special"), nb::sig("def encode(self, text: str, allow_special: bool) -> list[int]"))
        .def(
            "encode_words",
            [](const PyEncoder& e, nb::list words) {
                std::vector<std::pair<const uint8_t*, size_t>> ws;
                for (nb::handle h : words) {
                    if (!PyBytes_Check(h.ptr())) throw std::invalid_argument("words must be bytes");
                    ws.emplace_back((const uint8_t*)PyBytes_AS_STRING(h.ptr()), (size_t)PyBytes_GET_SIZE(h.ptr()));
                }
                std::vector<uint32_t> ids;
                e.encode_words(ws, ids);
                return e.to_list(ids);
            },
            nb::arg("words"), nb::sig("def encode_words(self, words: list[bytes]) -> list[int]"), "Apply the merges to words pre-tokenized in Python (custom patterns).")
        .def(
            "encode_batch",
            [](const PyEncoder& e, nb::list texts, int num_threads, bool allow_special) {
                std::vector<nb::object> keep;  // own the strs: the list may change while the GIL is released
                std::vector<std::pair<const uint8_t*, size_t>> docs = utf8_all(texts, keep);
                Encoder::Batch res;
                {
                    nb::gil_scoped_release release;
                    e.encode_batch(docs, num_threads, allow_special, res);
                }
                // Thousands of fresh lists would trigger the cyclic GC over and over (they hold only
                // ints: no cycles), so it is paused while they are built.
                struct GcPause {
                    int was = PyGC_Disable();
                    ~GcPause() { if (was) PyGC_Enable(); }
                } pause;
                PyObject* out = PyList_New((Py_ssize_t)docs.size());
                if (!out) throw nb::python_error();
                nb::list result = nb::steal<nb::list>(out);
                for (size_t i = 0; i < docs.size(); ++i) {
                    auto [p, n] = res.ids(i);
                    PyList_SET_ITEM(out, (Py_ssize_t)i, e.to_list(p, n).release().ptr());
                }
                return result;
            },
            nb::arg("texts"), nb::arg("num_threads"), nb::arg("allow_special"),
            nb::sig("def encode_batch(self, texts: list[str], num_threads: int, allow_special: bool) -> list[list[int]]"))
        .def(
            "encode_batch_flat",
            [](const PyEncoder& e, nb::list texts, int num_threads, bool allow_special) {
                std::vector<nb::object> keep;
                std::vector<std::pair<const uint8_t*, size_t>> docs = utf8_all(texts, keep);
                std::vector<uint32_t> flat;
                std::vector<int64_t> offsets{0};
                {
                    nb::gil_scoped_release release;
                    Encoder::Batch res;
                    e.encode_batch(docs, num_threads, allow_special, res);
                    flat.resize(res.total());
                    offsets.reserve(docs.size() + 1);
                    size_t at = 0;
                    for (size_t i = 0; i < docs.size(); ++i) {
                        auto [p, n] = res.ids(i);
                        if (n) std::memcpy(flat.data() + at, p, n * sizeof(uint32_t));
                        at += n;
                        offsets.push_back((int64_t)at);
                    }
                }
                return std::make_pair(to_numpy(std::move(flat)), to_numpy(std::move(offsets)));
            },
            nb::arg("texts"), nb::arg("num_threads"), nb::arg("allow_special"),
            "Encode documents into one uint32 token array plus int64 offsets (len(texts) + 1).")
        .def(
            "encode_spans",
            [](const PyEncoder& e, nb::handle data,
               nb::ndarray<nb::ro, int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> starts,
               nb::ndarray<nb::ro, int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> ends, int num_threads,
               bool allow_special,
               int64_t bos, int64_t eos, int itemsize) {
                ByteView v(data);
                if (starts.shape(0) != ends.shape(0)) throw std::invalid_argument("starts and ends differ in length");
                if (itemsize != 2 && itemsize != 4) throw std::invalid_argument("itemsize must be 2 or 4");
                const size_t n = starts.shape(0);
                const int64_t limit = itemsize == 2 ? 65536 : (int64_t)UINT32_MAX;
                if (bos >= limit || eos >= limit) throw std::invalid_argument("BOS/EOS id does not fit the output dtype");
                std::vector<std::pair<const uint8_t*, size_t>> docs(n);
                for (size_t i = 0; i < n; ++i) {
                    int64_t a = starts(i), b = ends(i);
                    if (a < 0 || b < a || (size_t)b > v.size())
                        throw std::invalid_argument("span " + std::to_string(i) + " [" + std::to_string(a) + ", " +
                                                    std::to_string(b) + ") is outside the buffer of " +
                                                    std::to_string(v.size()) + " bytes");
                    docs[i] = {v.data() + a, (size_t)(b - a)};
                }
                // Each span must be whole UTF-8 (the pre-tokenizer's classes assume it; a span that cuts a
                // character would also read, as part of it, bytes the caller did not give).
                size_t bad_doc = n;
                long long bad_at = -1;
                {
                    nb::gil_scoped_release release;
                    for (size_t i = 0; i < n && bad_at < 0; ++i)
                        if ((bad_at = utf8_error_offset(docs[i].first, docs[i].second)) >= 0) bad_doc = i;
                }
                if (bad_at >= 0)
                    throw std::invalid_argument("span " + std::to_string(bad_doc) + " is not valid UTF-8 (at byte " +
                                                std::to_string((long long)(docs[bad_doc].first - v.data()) + bad_at) +
                                                " of the buffer)");
                std::vector<int64_t> lengths(n);
                std::vector<uint16_t> out16;
                std::vector<uint32_t> out32;
                bool too_big = false;
                {
                    nb::gil_scoped_release release;
                    Encoder::Batch res;
                    e.encode_batch(docs, num_threads, allow_special, res);
                    const size_t extra = (bos >= 0) + (eos >= 0);
                    size_t total = res.total() + extra * n, at = 0;
                    auto fill = [&](auto& out) {
                        using T = typename std::decay_t<decltype(out)>::value_type;
                        out.resize(total);
                        T* o = out.data();
                        uint32_t mx = 0;
                        for (size_t i = 0; i < n; ++i) {
                            auto [p, k] = res.ids(i);
                            if (bos >= 0) o[at++] = (T)bos;
                            for (size_t j = 0; j < k; ++j) { mx |= p[j]; o[at + j] = (T)p[j]; }
                            at += k;
                            if (eos >= 0) o[at++] = (T)eos;
                            lengths[i] = (int64_t)(k + extra);
                        }
                        return mx;
                    };
                    if (itemsize == 2) too_big = fill(out16) >= 65536;  // an OR of all ids >= 2^16 iff one id is
                    else fill(out32);
                }
                if (too_big) throw std::invalid_argument("a token id does not fit uint16; use uint32 output");
                nb::object toks = itemsize == 2 ? nb::cast(to_numpy(std::move(out16))) : nb::cast(to_numpy(std::move(out32)));
                return nb::make_tuple(toks, to_numpy(std::move(lengths)));
            },
            nb::arg("data"), nb::arg("starts"), nb::arg("ends"), nb::arg("num_threads"), nb::arg("allow_special"),
            nb::arg("bos"), nb::arg("eos"), nb::arg("itemsize"),
            "Encode the documents data[starts[i]:ends[i]] (each valid UTF-8, else ValueError) into one uint16/uint32 array with optional "
            "BOS/EOS (-1: none) around each, plus int64 per-document lengths.")
        .def(
            "decode_bytes",
            [](const PyEncoder& e, std::vector<int64_t> ids) {
                std::string s = e.decode_bytes(ids);
                return nb::bytes(s.data(), s.size());
            },
            nb::arg("ids"), nb::sig("def decode_bytes(self, ids: list[int]) -> bytes"), "Concatenated token bytes; ValueError names an out-of-range id.")
        .def_prop_ro("pattern", [](const PyEncoder& e) { return e.pattern(); })
        .def_prop_ro("vocab_size", [](const PyEncoder& e) { return e.vocab_size(); });
}
