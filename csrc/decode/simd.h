// CPU dispatch shared by the decode kernels in csrc/decode/ (Python: lmforge.generate.engine): whether
// the AVX2, AVX-512, AVX-512 VNNI and AVX-512 BF16 code may run, the switches that force a narrower set (tests),
// the widest set allowed (kernel_isa), the opt-in bf16-activation mode (bf16_dot_runs), the scalar fp16 and bf16
// conversions (fp16 weights, int4 scales; bf16 activations), and the AVX2 helpers f16x8_to_f32, store8, hsum
// and exp8.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define LMFORGE_X86 1
#endif

namespace lmforge {

inline std::atomic<bool> g_force_scalar{false};  // tests: run the scalar kernels on an AVX2 machine too
inline std::atomic<bool> g_force_avx2{false};    // tests: run the AVX2 kernels on an AVX-512 machine too
inline std::atomic<bool> g_force_avx512{false};  // tests: run the AVX-512F kernels (no VNNI) on a VNNI machine too
// Opt-in numerics (linear_bf16_activations): bf16-weight products round the activations to bf16 and use vdpbf16ps
// where the CPU has AVX-512 BF16; elsewhere, or while a force switch is on, it changes nothing.
inline std::atomic<bool> g_bf16_activations{false};

// An IEEE fp16 bit pattern as fp32 (exact; what F16C's vcvtph2ps gives, subnormals, inf and NaN included).
inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);  // inf / nan
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);  // normal: rebias 15 -> 127
    } else if (man == 0) {
        bits = sign;  // +-0
    } else {  // subnormal: value = man * 2^-24; normalise into an fp32 normal
        int e = -1;
        do { ++e; man <<= 1; } while (!(man & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

// fp32 to the nearest bf16, ties to even, NaN to the quiet NaN 0x7fc0: torch's .to(torch.bfloat16), bit for bit.
inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#ifdef LMFORGE_X86
// AVX2 + FMA (+ F16C for fp16) code is compiled for those instructions whatever the build flags and
// used only when the CPU reports them.
#define LMFORGE_AVX2 __attribute__((target("avx2,fma,f16c")))

inline bool cpu_has_avx2() {
    static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                           __builtin_cpu_supports("f16c");
    return ok;
}

// AVX-512 (F, VL, BW, DQ): the product kernels' wide build (products.cpp), also only when the CPU has it.
#define LMFORGE_AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq")))
inline bool cpu_has_avx512() {
    static const bool ok = cpu_has_avx2() && __builtin_cpu_supports("avx512f") &&
                           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw") &&
                           __builtin_cpu_supports("avx512dq");
    return ok;
}

// AVX-512 VNNI (vpdpbusd: four u8 x s8 products added into each int32 lane) on top of that set: the integer
// products' widest build (qdot.cpp, qtiles.inc). __builtin_cpu_supports reports an AVX-512 feature only when
// the OS saves the AVX-512 registers (XCR0), as for AVX2 and AVX-512F above.
#define LMFORGE_AVX512_VNNI \
    __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq,avx512vnni")))
inline bool cpu_has_avx512_vnni() {
    static const bool ok = cpu_has_avx512() && __builtin_cpu_supports("avx512vnni");
    return ok;
}

// AVX-512 BF16 (vdpbf16ps: per fp32 lane, two bf16 products added in turn, the odd element's first) on top of
// AVX-512F: the bf16-activation build of the bf16-weight products (products.cpp, tiles.inc), opt-in.
#define LMFORGE_AVX512_BF16 \
    __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq,avx512bf16")))
inline bool cpu_has_avx512_bf16() {
    static const bool ok = cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
    return ok;
}

// 8 fp16 bit patterns as fp32 (F16C; the vector twin of f16_to_f32): fp16 weights, int4 scales.
LMFORGE_AVX2 inline __m256 f16x8_to_f32(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// The 8 outputs n0 .. n0+7 of one row (those below N: a panel's last rows may be padding past N).
LMFORGE_AVX2 inline void store8(__m256 s, float* row, size_t n0, size_t N) {
    if (n0 + 8 <= N) {
        _mm256_storeu_ps(row + n0, s);
    } else {
        alignas(32) float tmp[8];
        _mm256_store_ps(tmp, s);
        for (size_t j = 0; n0 + j < N; ++j) row[n0 + j] = tmp[j];
    }
}

// The sum of the 8 lanes.
LMFORGE_AVX2 inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// e^x for 8 floats within 2 ulp of std::exp: x = n ln2 + r with |r| <= ln2/2, e^r by a degree-6 polynomial
// (Cephes' expf coefficients), 2^n put into the exponent bits. Inputs are clamped to the finite
// range of float (e^-87.3 ~ 1e-38 stands for 0, which a softmax or a sigmoid cannot tell apart); NaN stays NaN.
LMFORGE_AVX2 inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_set1_ps(88.3762626647949f), _mm256_max_ps(_mm256_set1_ps(-87.3365478515625f), x));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln2 in two parts: n * hi is exact
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    // The clamp keeps n in [-126, 127], so 2^n is a normal float built directly from its exponent bits.
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif  // LMFORGE_X86

// The instruction sets of the kernels, each a superset of the one before: what linear_isa() names.
enum class Isa { Scalar = 0, Avx2 = 1, Avx512 = 2, Avx512Vnni = 3 };

// The widest set this CPU has, capped by the test switches above (the narrowest switch set wins).
inline Isa kernel_isa() {
#ifdef LMFORGE_X86
    if (!cpu_has_avx2() || g_force_scalar.load(std::memory_order_relaxed)) return Isa::Scalar;
    if (!cpu_has_avx512() || g_force_avx2.load(std::memory_order_relaxed)) return Isa::Avx2;
    if (!cpu_has_avx512_vnni() || g_force_avx512.load(std::memory_order_relaxed)) return Isa::Avx512;
    return Isa::Avx512Vnni;
#else
    return Isa::Scalar;
#endif
}

// Whether the bf16-weight products run the bf16-activation tiles: the mode is on, the CPU has AVX-512 BF16 and no
// force switch caps the set.
inline bool bf16_dot_runs() {
#ifdef LMFORGE_X86
    return g_bf16_activations.load(std::memory_order_relaxed) && cpu_has_avx512_bf16() &&
           !g_force_scalar.load(std::memory_order_relaxed) && !g_force_avx2.load(std::memory_order_relaxed) &&
           !g_force_avx512.load(std::memory_order_relaxed);
#else
    return false;
#endif
}

}  // namespace lmforge
