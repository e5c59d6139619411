// Decode-time skinny matrix products y = x . W^T for a few rows x (contract in kernels.h; Python:
// lmforge.generate.engine.PackedLinear), and the switches of the kernels' instruction set.
//
// Shape of the work: one decode step multiplies a few activation rows (M = batch size, 1..8) by every
// weight matrix of the model once. At M = 1 each weight is used for a single multiply-add, so the time
// is the time to stream the weights from memory; BLAS libraries tuned for large products reach only part
// of the bandwidth there and lose more at M = 2..8, where they pack and block for shapes that never
// come. Here weights are pre-packed in panels read as one sequential stream, each thread claims chunks
// of panels, and each panel is multiplied with all M rows while it sits in L1, so every weight byte is
// read from memory once per call whatever M is. Weights may be stored as 16-bit floats (half the bytes)
// or as int8 codes with a float32 scale per output row (a quarter).
#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>

#include "decode/kernels.h"
#include "decode/pool.h"
#include "decode/simd.h"

namespace lmforge {
namespace {

// ---------------------------------------------------------------------------------------------------
// 16-bit floats to fp32 (scalar; exact, as torch's .float() converts them).

inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

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

template <WeightType WT>
inline float load1(const void* w, size_t i) {
    if constexpr (WT == WeightType::F32) return static_cast<const float*>(w)[i];
    else if constexpr (WT == WeightType::BF16) return bf16_to_f32(static_cast<const uint16_t*>(w)[i]);
    else if constexpr (WT == WeightType::F16) return f16_to_f32(static_cast<const uint16_t*>(w)[i]);
    else return (float)static_cast<const int8_t*>(w)[i];  // I8: the row scale is applied to y afterwards
}

// ---------------------------------------------------------------------------------------------------
// Weights come packed in panels of 8 output rows, P[p][k][j] = w[8p + j][k] (rows past N are zero), so a
// pass over the weights is one sequential stream, which the hardware prefetcher follows at full speed.
// (Row-major w read as 8 interleaved row streams ran at about half the bandwidth at batch 1.) For each
// k, the 8 weights of a panel are multiplied by the broadcast x[m][k] and added into 8 outputs at once,
// so no horizontal sums are needed either.

constexpr size_t kPanel = 8;

// Scalar kernel: every CPU (the compiler vectorizes the j loop). Panels [p0, p1), all M rows.
template <WeightType WT>
void block_scalar(const float* x, size_t M, size_t K, const void* w, size_t N, size_t p0, size_t p1, float* y,
                  size_t ldy) {
    for (size_t p = p0; p < p1; ++p) {
        for (size_t m = 0; m < M; ++m) {
            float acc[kPanel] = {0, 0, 0, 0, 0, 0, 0, 0};
            const float* xr = x + m * K;
            for (size_t k = 0; k < K; ++k) {
                const size_t base = (p * K + k) * kPanel;
                for (size_t j = 0; j < kPanel; ++j) acc[j] += xr[k] * load1<WT>(w, base + j);
            }
            for (size_t j = 0; j < kPanel && p * kPanel + j < N; ++j) y[m * ldy + p * kPanel + j] = acc[j];
        }
    }
}

#ifdef LMFORGE_X86
// ---------------------------------------------------------------------------------------------------
// The AVX2 kernel (simd.h says when it runs).

template <WeightType WT>
LMFORGE_AVX2 inline __m256 load8(const void* w, size_t i) {
    if constexpr (WT == WeightType::F32) {
        return _mm256_loadu_ps(static_cast<const float*>(w) + i);
    } else if constexpr (WT == WeightType::I8) {
        const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(w) + i));
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    } else {
        __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(w) + i));
        if constexpr (WT == WeightType::BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
        else return _mm256_cvtph_ps(h);
    }
}

template <WeightType WT>
constexpr size_t sizeof_w() { return WT == WeightType::F32 ? 4 : WT == WeightType::I8 ? 1 : 2; }
constexpr size_t kPrefetch = 1024;  // weights ahead (in elements): software prefetch over the stream

// Rows [m0, m0+MR) against panels [p0, p0+PR). KU independent partial sums over k (even/odd k) keep
// MR * PR * KU accumulator chains in flight, enough to hide the FMA latency when MR * PR is small.
template <WeightType WT, int MR, int PR, int KU>
LMFORGE_AVX2 void tile_avx2(const float* x, size_t m0, size_t K, const void* w, size_t N, size_t p0, float* y,
                            size_t ldy) {
    __m256 acc[KU][MR][PR];
    #pragma GCC unroll 8
    for (int u = 0; u < KU; ++u)
        #pragma GCC unroll 8
        for (int i = 0; i < MR; ++i)
            #pragma GCC unroll 8
            for (int q = 0; q < PR; ++q) acc[u][i][q] = _mm256_setzero_ps();
    const float* xm = x + m0 * K;
    size_t k = 0;
    for (; k + KU <= K; k += KU) {
        #pragma GCC unroll 8
        for (int u = 0; u < KU; ++u) {
            __m256 wv[PR];
            #pragma GCC unroll 8
            for (int q = 0; q < PR; ++q) {
                const size_t at = ((p0 + q) * K + k + u) * kPanel;
                if (u == 0) _mm_prefetch(static_cast<const char*>(w) + (at + kPrefetch) * sizeof_w<WT>(), _MM_HINT_T0);
                wv[q] = load8<WT>(w, at);
            }
            #pragma GCC unroll 8
            for (int i = 0; i < MR; ++i) {
                const __m256 xv = _mm256_broadcast_ss(xm + i * K + k + u);
                #pragma GCC unroll 8
                for (int q = 0; q < PR; ++q) acc[u][i][q] = _mm256_fmadd_ps(xv, wv[q], acc[u][i][q]);
            }
        }
    }
    for (; k < K; ++k) {  // K odd with KU = 2
        #pragma GCC unroll 8
        for (int q = 0; q < PR; ++q) {
            const __m256 wv = load8<WT>(w, ((p0 + q) * K + k) * kPanel);
            #pragma GCC unroll 8
            for (int i = 0; i < MR; ++i) acc[0][i][q] = _mm256_fmadd_ps(_mm256_broadcast_ss(xm + i * K + k), wv, acc[0][i][q]);
        }
    }
    #pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
        #pragma GCC unroll 8
        for (int q = 0; q < PR; ++q) {
            __m256 s = acc[0][i][q];
            #pragma GCC unroll 8
            for (int u = 1; u < KU; ++u) s = _mm256_add_ps(s, acc[u][i][q]);
            const size_t n = (p0 + q) * kPanel;
            float* out = y + (m0 + i) * ldy + n;
            if (n + kPanel <= N) {
                _mm256_storeu_ps(out, s);
            } else {  // the last panel, partly padding
                alignas(32) float tmp[kPanel];
                _mm256_store_ps(tmp, s);
                for (size_t j = 0; n + j < N; ++j) out[j] = tmp[j];
            }
        }
    }
}

// Rows [m0, m0+MR) against panels [p0, p1): PR panels at a time, then one at a time.
template <WeightType WT, int MR, int PR, int KU>
LMFORGE_AVX2 void rows_avx2(const float* x, size_t m0, size_t K, const void* w, size_t N, size_t p0, size_t p1,
                            float* y, size_t ldy) {
    size_t p = p0;
    for (; p + PR <= p1; p += PR) tile_avx2<WT, MR, PR, KU>(x, m0, K, w, N, p, y, ldy);
    for (; p < p1; ++p) tile_avx2<WT, MR, 1, (MR < 4 ? 2 : 1)>(x, m0, K, w, N, p, y, ldy);
}

template <WeightType WT>
LMFORGE_AVX2 void block_avx2(const float* x, size_t M, size_t K, const void* w, size_t N, size_t p0, size_t p1,
                             float* y, size_t ldy) {
    // Up to 8 accumulators plus the weight vectors and one broadcast fit the 16 ymm registers. Within a
    // group of 4 panels every row block reuses the panels from L1/L2, so memory sees each weight once per
    // chunk of MC rows; the chunk bounds the activations read per panel group (MC * K floats, in L2).
    constexpr size_t G = 4, MC = 64;
    for (size_t mc = 0; mc < M; mc += MC) {
        const size_t me = std::min(M, mc + MC);
        for (size_t g = p0; g < p1; g += G) {
            const size_t ge = std::min(p1, g + G);
            size_t m = mc;
            for (; m + 8 <= me; m += 8) rows_avx2<WT, 8, 1, 1>(x, m, K, w, N, g, ge, y, ldy);
            switch (me - m) {
                case 7: rows_avx2<WT, 7, 1, 1>(x, m, K, w, N, g, ge, y, ldy); break;
                case 6: rows_avx2<WT, 6, 1, 1>(x, m, K, w, N, g, ge, y, ldy); break;
                case 5: rows_avx2<WT, 5, 1, 1>(x, m, K, w, N, g, ge, y, ldy); break;
                case 4: rows_avx2<WT, 4, 2, 1>(x, m, K, w, N, g, ge, y, ldy); break;
                case 3: rows_avx2<WT, 3, 2, 1>(x, m, K, w, N, g, ge, y, ldy); break;
                case 2: rows_avx2<WT, 2, 2, 2>(x, m, K, w, N, g, ge, y, ldy); break;
                case 1: rows_avx2<WT, 1, 4, 2>(x, m, K, w, N, g, ge, y, ldy); break;
                default: break;
            }
        }
    }
}
#endif  // LMFORGE_X86

using BlockFn = void (*)(const float*, size_t, size_t, const void*, size_t, size_t, size_t, float*, size_t);

BlockFn pick_block(WeightType wt) {
#ifdef LMFORGE_X86
    if (cpu_has_avx2() && !g_force_scalar.load(std::memory_order_relaxed)) {
        switch (wt) {
            case WeightType::F32: return block_avx2<WeightType::F32>;
            case WeightType::BF16: return block_avx2<WeightType::BF16>;
            case WeightType::F16: return block_avx2<WeightType::F16>;
            case WeightType::I8: return block_avx2<WeightType::I8>;
        }
    }
#endif
    switch (wt) {
        case WeightType::BF16: return block_scalar<WeightType::BF16>;
        case WeightType::F16: return block_scalar<WeightType::F16>;
        case WeightType::I8: return block_scalar<WeightType::I8>;
        default: return block_scalar<WeightType::F32>;
    }
}

struct Job {
    BlockFn block;
    const float* x;
    size_t M, K;
    const void* w;
    size_t N;
    float* y;
    size_t ldy;
    size_t panels_per_chunk;
    const float* scales;  // int8 weights: per output row, applied after the products; else null
};

// y[m][n] *= scales[n] for outputs [n0, n1) of all rows (int8 weights hold w / scale).
void apply_scales(const float* scales, size_t M, size_t n0, size_t n1, float* y, size_t ldy) {
    for (size_t m = 0; m < M; ++m)
        for (size_t n = n0; n < n1; ++n) y[m * ldy + n] *= scales[n];
}

void run_chunk(void* ctx, uint32_t chunk) {
    const Job& j = *static_cast<const Job*>(ctx);
    const size_t panels = (j.N + kPanel - 1) / kPanel;
    const size_t p0 = std::min(panels, j.panels_per_chunk * chunk), p1 = std::min(panels, p0 + j.panels_per_chunk);
    if (p0 >= p1) return;
    j.block(j.x, j.M, j.K, j.w, j.N, p0, p1, j.y, j.ldy);
    if (j.scales) apply_scales(j.scales, j.M, p0 * kPanel, std::min(j.N, p1 * kPanel), j.y, j.ldy);
}

}  // namespace

void linear_rows(const float* x, size_t M, size_t K, const void* w, WeightType wt, size_t N, float* y, size_t ldy,
                 int threads, const float* scales) {
    if (M == 0 || N == 0) return;
    std::lock_guard<std::mutex> lk(g_pool_mu);
    const BlockFn block = pick_block(wt);
    const float* sc = wt == WeightType::I8 ? scales : nullptr;
    // Below ~64k weights (a 256 x 256 matrix) the hand-off costs more than the second thread saves.
    if (threads <= 1 || N * K < (size_t)65536 || N < 64) {
        block(x, M, K, w, N, 0, (N + kPanel - 1) / kPanel, y, ldy);
        if (sc) apply_scales(sc, M, 0, N, y, ldy);
        return;
    }
    threads = std::min(threads, 64);
    // About 8 chunks per thread, each a multiple of 4 panels (the kernel's panel groups).
    const size_t panels = (N + kPanel - 1) / kPanel;
    const size_t per = std::max<size_t>(4, (panels / (8 * (size_t)threads) + 3) & ~(size_t)3);
    Job job{block, x, M, K, w, N, y, ldy, per, sc};
    pool_of(threads)->run(run_chunk, &job, (uint32_t)((panels + per - 1) / per));
}

const char* linear_isa() {
#ifdef LMFORGE_X86
    if (cpu_has_avx2() && !g_force_scalar.load(std::memory_order_relaxed)) return "avx2";
#endif
    return "scalar";
}

void linear_force_scalar(bool on) { g_force_scalar.store(on); }

void linear_force_avx2(bool on) { g_force_avx2.store(on); }

}  // namespace lmforge
