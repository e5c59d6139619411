// Integer dot products for int8 and int4 weights (kinds I8Q8 and I4Q8 of kernels.h; Python:
// lmforge.generate.packed.PackedLinear with activations="int8", whose .reference is this file's arithmetic in
// PyTorch). The activations are rounded to int8 per block of 32 along a row, as llama.cpp's Q8_0 rounds them
// (quantize_rows_q8 below), the products of a block are summed exactly in int32, and each block's sum is
// scaled once in float32. The float32 path (products.cpp) converts every weight to float, which on AVX2 is ~6
// weights per cycle per core; here a 32-byte vector of weights costs ~4 integer operations (int8) or a
// 32-byte vector of 64 int4 codes ~7 (with AVX-512 VNNI's vpdpbusd: 1 and ~5): the weights stream at the speed
// memory gives them.
//
// Per output y[m][n], with q the activation codes, d[m][g] their scales, blocks g = 0 .. G-1 in that order and
// isum = sum over the block of q[m][k] * c[n][k] (an exact int32):
//   I8Q8 (codes c in [-127, 127], a scale s[n] per row):     acc = acc + float(isum) * d[m][g];  y = acc * s[n]
//   I4Q8 (codes c = code - 8 in [-8, 7], scales s[n][g], fp16): acc = acc + float(isum) * (d[m][g] * s[n][g])
// each operation rounded to float32 on its own (no FMA: the build has -ffp-contract=off), acc starting at 0.
// The order depends only on K: batch invariant, and the scalar, AVX2 and AVX-512 VNNI code give the same bits.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>
#include <vector>

#include "decode/kernels.h"
#include "decode/pool.h"
#include "decode/simd.h"

namespace lmforge {
namespace {

constexpr size_t kBlock = 32;  // activations per scale, and weights per int4 scale
constexpr size_t kPanel = 8;   // output rows per panel

// ---------------------------------------------------------------------------------------------------
// Rounding the activations (llama.cpp's quantize_row_q8_0 as its AVX2 build computes it, with the scale
// kept in float32): per block of 32 (a row's tail padded with zeros) amax = max |x|, d = amax / 127,
// id = 127 / amax (0 when amax = 0), q = round-half-to-even(x * id) in [-127, 127]. A block holding a
// non-finite value gets d = NaN and codes 0, so its outputs are NaN, as float32 products would make them.
// Also the block's code sum (int4 takes 8 * sum off). xq (M, 32 G), d and xsum (M, G).

void quantize_block_scalar(const float* x, size_t n, int8_t* q, float* d, int32_t* sum) {
    float amax = 0.0f;
    bool bad = false;
    for (size_t k = 0; k < n; ++k) {
        const float a = std::fabs(x[k]);
        if (!(a <= std::numeric_limits<float>::max())) bad = true;
        else if (a > amax) amax = a;
    }
    if (bad) {
        std::memset(q, 0, kBlock);
        *d = std::numeric_limits<float>::quiet_NaN();
        *sum = 0;
        return;
    }
    const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
    *d = amax / 127.0f;
    int32_t s = 0;
    for (size_t k = 0; k < kBlock; ++k) {
        float v = k < n ? std::nearbyint(x[k] * id) : 0.0f;  // the default rounding mode: half to even
        v = std::min(127.0f, std::max(-127.0f, v));
        q[k] = (int8_t)v;
        s += (int32_t)v;
    }
    *sum = s;
}

void quantize_rows_scalar(const float* x, size_t M, size_t K, int8_t* xq, float* d, int32_t* xsum) {
    const size_t G = (K + kBlock - 1) / kBlock;
    for (size_t m = 0; m < M; ++m)
        for (size_t g = 0; g < G; ++g)
            quantize_block_scalar(x + m * K + g * kBlock, std::min(kBlock, K - g * kBlock), xq + (m * G + g) * kBlock,
                                  d + m * G + g, xsum + m * G + g);
}

// ---------------------------------------------------------------------------------------------------
// Scalar products: every CPU; the reference order above.

// One block's exact integer sums of row m against the 8 rows of panel p (layouts in kernels.h).
void isums_i8(const int8_t* xs, const int8_t* w, size_t p, size_t g, size_t Kp, int32_t* isum) {
    for (size_t s = 0; s < kBlock / 4; ++s) {  // 4 k per step: w[p][g * 8 + s][j][i] = c[8p + j][32g + 4s + i]
        const int8_t* at = w + (p * Kp + g * kBlock + 4 * s) * kPanel;
        for (size_t j = 0; j < kPanel; ++j)
            for (size_t i = 0; i < 4; ++i) isum[j] += (int32_t)xs[4 * s + i] * (int32_t)at[4 * j + i];
    }
}

void isums_i4(const int8_t* xs, const uint8_t* w, size_t p, size_t g, size_t G, int32_t xsum, int32_t* isum) {
    const uint8_t* blk = w + (p * G + g) * 4 * 32;  // 4 vectors of 8 rows x 4 bytes
    for (size_t v = 0; v < 4; ++v)
        for (size_t j = 0; j < kPanel; ++j)
            for (size_t i = 0; i < 4; ++i) {
                const uint8_t b = blk[v * 32 + 4 * j + i];
                isum[j] += (int32_t)xs[4 * v + i] * (b & 0xF) + (int32_t)xs[16 + 4 * v + i] * (b >> 4);
            }
    for (size_t j = 0; j < kPanel; ++j) isum[j] -= 8 * xsum;
}

template <bool I4>
void block_scalar(const int8_t* xq, const float* d, const int32_t* xsum, size_t M, size_t G, const void* w,
                  const void* scv, size_t N, size_t p0, size_t p1, float* y, size_t ldy) {
    const size_t Kp = G * kBlock;
    const auto* sc = static_cast<const uint16_t*>(scv);  // int4: fp16 scales (int8's row scales: run_qchunk)
    for (size_t p = p0; p < p1; ++p)
        for (size_t m = 0; m < M; ++m) {
            float acc[kPanel] = {0, 0, 0, 0, 0, 0, 0, 0};
            for (size_t g = 0; g < G; ++g) {
                int32_t isum[kPanel] = {0, 0, 0, 0, 0, 0, 0, 0};
                const int8_t* xs = xq + m * Kp + g * kBlock;
                if constexpr (I4) isums_i4(xs, static_cast<const uint8_t*>(w), p, g, G, xsum[m * G + g], isum);
                else isums_i8(xs, static_cast<const int8_t*>(w), p, g, Kp, isum);
                for (size_t j = 0; j < kPanel; ++j) {
                    const float dd = I4 ? d[m * G + g] * f16_to_f32(sc[(p * G + g) * kPanel + j]) : d[m * G + g];
                    const float t = (float)isum[j] * dd;
                    acc[j] = acc[j] + t;
                }
            }
            for (size_t j = 0; j < kPanel && p * kPanel + j < N; ++j) y[m * ldy + p * kPanel + j] = acc[j];
        }
}

#ifdef LMFORGE_X86
// ---------------------------------------------------------------------------------------------------
// AVX2: the rounding of the activations (every vector build), then the tiles. AVX-512 CPUs without VNNI run the
// AVX2 tiles (256-bit integer ops are what Zen 4 executes at full rate anyway; VNNI gets its own build).

LMFORGE_AVX2 void quantize_rows_avx2(const float* x, size_t M, size_t K, int8_t* xq, float* d, int32_t* xsum) {
    const size_t G = (K + kBlock - 1) / kBlock;
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 big = _mm256_set1_ps(std::numeric_limits<float>::max());
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the lane interleave of the packs
    for (size_t m = 0; m < M; ++m)
        for (size_t g = 0; g < G; ++g) {
            const float* xb = x + m * K + g * kBlock;
            int8_t* q = xq + (m * G + g) * kBlock;
            if ((g + 1) * kBlock > K) {  // a row's tail: the scalar code (same operations, same bits)
                quantize_block_scalar(xb, K - g * kBlock, q, d + m * G + g, xsum + m * G + g);
                continue;
            }
            __m256 v[4], mx = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
            for (int i = 0; i < 4; ++i) {
                v[i] = _mm256_loadu_ps(xb + 8 * i);
                const __m256 a = _mm256_and_ps(v[i], absmask);
                bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, big, _CMP_NLE_UQ));  // > max, or NaN
                mx = _mm256_max_ps(mx, a);
            }
            if (_mm256_movemask_ps(bad)) {
                quantize_block_scalar(xb, kBlock, q, d + m * G + g, xsum + m * G + g);
                continue;
            }
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            h = _mm_max_ss(h, _mm_movehdup_ps(h));
            const float amax = _mm_cvtss_f32(h);
            const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
            d[m * G + g] = amax / 127.0f;
            const __m256 idv = _mm256_set1_ps(id), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
            __m256i r[4];
            for (int i = 0; i < 4; ++i) {
                __m256 t = _mm256_round_ps(_mm256_mul_ps(v[i], idv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                r[i] = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, t)));
            }
            __m256i s = _mm256_add_epi32(_mm256_add_epi32(r[0], r[1]), _mm256_add_epi32(r[2], r[3]));
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
            s4 = _mm_hadd_epi32(s4, s4);
            s4 = _mm_hadd_epi32(s4, s4);
            xsum[m * G + g] = _mm_cvtsi128_si32(s4);
            const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(b, order));
        }
}

LMFORGE_AVX2 inline __m256i bcast4(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

// A tile of vectors (float sums or int32/int16 block sums) set to zero.
template <class V, int MR, int PR>
LMFORGE_AVX2 inline void zero_tile(V (&t)[MR][PR]) {
    for (int i = 0; i < MR; ++i)
        for (int q = 0; q < PR; ++q) t[i][q] = V{};
}

// A tile's outputs: rows m0.., panels p0..
template <int MR, int PR>
LMFORGE_AVX2 inline void store_tile(const __m256 (&acc)[MR][PR], float* y, size_t m0, size_t ldy, size_t p0,
                                    size_t N) {
    for (int i = 0; i < MR; ++i)
        for (int q = 0; q < PR; ++q) store8(acc[i][q], y + (m0 + i) * ldy, (p0 + q) * kPanel, N);
}

// The tiles (qtiles.inc): one source compiled for AVX2 and for AVX-512 VNNI.
#define LMFORGE_QTILES LMFORGE_AVX2
namespace avx2 {
constexpr bool kVnni = false;
#include "decode/qtiles.inc"
}  // namespace avx2
#undef LMFORGE_QTILES
#define LMFORGE_QTILES LMFORGE_AVX512_VNNI
namespace vnni {
constexpr bool kVnni = true;
#include "decode/qtiles.inc"
}  // namespace vnni
#undef LMFORGE_QTILES
#endif  // LMFORGE_X86

using QBlockFn = void (*)(const int8_t*, const float*, const int32_t*, size_t, size_t, const void*, const void*,
                          size_t, size_t, size_t, float*, size_t);

struct QJob {
    QBlockFn block;
    const int8_t* xq;
    const float* d;
    const int32_t* xsum;
    size_t M, G;
    const void* w;
    const void* scales;  // I8Q8: float32 per row; I4Q8: fp16 per 8 rows x 32 k
    size_t N;
    float* y;
    size_t ldy;
    size_t panels_per_chunk;
    bool row_scales;  // I8Q8: y[m][n] *= scales[n] after the sums
};

void run_qchunk(void* ctx, uint32_t chunk) {
    const QJob& j = *static_cast<const QJob*>(ctx);
    const size_t panels = (j.N + kPanel - 1) / kPanel;
    const size_t p0 = std::min(panels, j.panels_per_chunk * chunk), p1 = std::min(panels, p0 + j.panels_per_chunk);
    if (p0 >= p1) return;
    j.block(j.xq, j.d, j.xsum, j.M, j.G, j.w, j.scales, j.N, p0, p1, j.y, j.ldy);
    if (j.row_scales) {
        const auto* s = static_cast<const float*>(j.scales);
        for (size_t m = 0; m < j.M; ++m)
            for (size_t n = p0 * kPanel; n < std::min(j.N, p1 * kPanel); ++n) j.y[m * j.ldy + n] *= s[n];
    }
}

bool use_avx2() { return kernel_isa() >= Isa::Avx2; }

}  // namespace

void quantize_rows_q8(const float* x, size_t M, size_t K, int8_t* xq, float* d, int32_t* xsum) {
#ifdef LMFORGE_X86
    if (use_avx2()) return quantize_rows_avx2(x, M, K, xq, d, xsum);
#endif
    quantize_rows_scalar(x, M, K, xq, d, xsum);
}

void linear_rows_q8(const float* x, size_t M, size_t K, const void* w, WeightType wt, size_t N, float* y,
                    size_t ldy, int threads, const void* scales) {
    const bool i4 = wt == WeightType::I4Q8;
    QBlockFn block = i4 ? block_scalar<true> : block_scalar<false>;
#ifdef LMFORGE_X86
    const Isa isa = kernel_isa();
    if (isa == Isa::Avx512Vnni) block = i4 ? vnni::block<true> : vnni::block<false>;
    else if (isa >= Isa::Avx2) block = i4 ? avx2::block<true> : avx2::block<false>;
#endif
    const size_t G = (K + kBlock - 1) / kBlock;
    thread_local std::vector<int8_t> xq;
    thread_local std::vector<float> d;
    thread_local std::vector<int32_t> xsum;
    xq.resize(M * G * kBlock);
    d.resize(M * G);
    xsum.resize(M * G);
    quantize_rows_q8(x, M, K, xq.data(), d.data(), xsum.data());
    QJob job{block, xq.data(), d.data(), xsum.data(), M, G, w, scales, N, y, ldy, 0, !i4};
    const size_t panels = (N + kPanel - 1) / kPanel;
    if (threads <= 1 || N * K < (size_t)65536 || N < 64) {  // as linear_rows: small products on one thread
        job.panels_per_chunk = panels;
        run_qchunk(&job, 0);
        return;
    }
    threads = std::min(threads, 64);
    job.panels_per_chunk = std::max<size_t>(4, (panels / (8 * (size_t)threads) + 3) & ~(size_t)3);
    std::lock_guard<ForkSafeMutex> lk(g_pool_mu);
    pool_of(threads)->run(run_qchunk, &job, (uint32_t)((panels + job.panels_per_chunk - 1) / job.panels_per_chunk));
}

}  // namespace lmforge
