// Decode-time attention: one new query per row over a KV cache (contract in kernels.h; Python:
// lmforge.generate.engine.Engine.step, through the decode step of step.cpp).
#include <algorithm>
#include <cmath>
#include <mutex>
#include <vector>

#include "decode/kernels.h"
#include "decode/pool.h"
#include "decode/simd.h"

namespace lmforge {
namespace {

// One query row against n cached keys/values of dimension D: out = softmax(scale * q.K^T) V.

#ifdef LMFORGE_X86
// The dot products of q with 8 keys k[j * D ..], j < 8, as one vector (lane j). Each key's partial sums are
// 8 lanes wide; the horizontal sums of all 8 are done together (hadd tree), ~2 operations per key, not ~6.
LMFORGE_AVX2 inline __m256 dot8(const float* q, const float* k, size_t D) {
    __m256 a[8];
    for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
    for (size_t d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + j * D + d), a[j]);
    }
    // u0 lanes: key 0..3's sums of lanes 0-3, then of lanes 4-7; u1: the same for keys 4..7
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// One query over n cached positions: scores 8 keys at a time, a vectorised softmax, then the weighted sum of
// values with the output's D floats held in registers across all positions (two sets of accumulators, even
// and odd positions, so 2 * D / 8 chains hide the FMA latency; up to 32 floats per pass).
LMFORGE_AVX2 void attend_one_avx2(const float* q, const float* k, const float* v, size_t n, size_t D, float scale,
                                  float* scores, float* out) {
    const __m256 sv = _mm256_set1_ps(scale);
    __m256 mx8 = _mm256_set1_ps(-INFINITY);
    size_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 s = _mm256_mul_ps(dot8(q, k + j * D, D), sv);
        _mm256_storeu_ps(scores + j, s);
        mx8 = _mm256_max_ps(mx8, s);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, mx8);
    float mx = -INFINITY;
    for (float l : lanes) mx = std::max(mx, l);
    for (; j < n; ++j) {
        const float* kj = k + j * D;
        __m256 acc = _mm256_setzero_ps();
        for (size_t d = 0; d < D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(kj + d), acc);
        const float s = hsum(acc) * scale;
        scores[j] = s;
        mx = std::max(mx, s);
    }
    const __m256 mv = _mm256_set1_ps(mx);
    __m256 tot = _mm256_setzero_ps();
    for (j = 0; j + 8 <= n; j += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + j), mv));
        _mm256_storeu_ps(scores + j, e);
        tot = _mm256_add_ps(tot, e);
    }
    float total = hsum(tot);
    if (j < n) {  // the tail through a padded buffer; its pads are never summed or stored
        alignas(32) float t[8];
        for (size_t i = 0; i < 8; ++i) t[i] = j + i < n ? scores[j + i] - mx : -100.0f;
        _mm256_store_ps(t, exp8(_mm256_load_ps(t)));
        for (size_t i = 0; j + i < n; ++i) total += (scores[j + i] = t[i]);
    }
    const __m256 inv = _mm256_set1_ps(1.0f / total);
    for (size_t d0 = 0; d0 < D; d0 += 32) {
        const size_t nb = std::min<size_t>(4, (D - d0) / 8);
        __m256 even[4], odd[4];
        for (size_t b = 0; b < nb; ++b) even[b] = odd[b] = _mm256_setzero_ps();
        const float* vp = v + d0;
        for (j = 0; j + 2 <= n; j += 2, vp += 2 * D) {
            const __m256 p0 = _mm256_set1_ps(scores[j]), p1 = _mm256_set1_ps(scores[j + 1]);
            for (size_t b = 0; b < nb; ++b) {
                even[b] = _mm256_fmadd_ps(p0, _mm256_loadu_ps(vp + 8 * b), even[b]);
                odd[b] = _mm256_fmadd_ps(p1, _mm256_loadu_ps(vp + D + 8 * b), odd[b]);
            }
        }
        if (j < n) {
            const __m256 p0 = _mm256_set1_ps(scores[j]);
            for (size_t b = 0; b < nb; ++b) even[b] = _mm256_fmadd_ps(p0, _mm256_loadu_ps(vp + 8 * b), even[b]);
        }
        for (size_t b = 0; b < nb; ++b)
            _mm256_storeu_ps(out + d0 + 8 * b, _mm256_mul_ps(_mm256_add_ps(even[b], odd[b]), inv));
    }
}
#endif

void attend_one_scalar(const float* q, const float* k, const float* v, size_t n, size_t D, float scale,
                       float* scores, float* out) {
    float mx = -INFINITY;
    for (size_t j = 0; j < n; ++j) {
        float s = 0;
        for (size_t d = 0; d < D; ++d) s += q[d] * k[j * D + d];
        scores[j] = s * scale;
        mx = std::max(mx, scores[j]);
    }
    float total = 0;
    for (size_t j = 0; j < n; ++j) total += (scores[j] = std::exp(scores[j] - mx));
    const float inv = 1.0f / total;
    for (size_t d = 0; d < D; ++d) out[d] = 0;
    for (size_t j = 0; j < n; ++j)
        for (size_t d = 0; d < D; ++d) out[d] += scores[j] * v[j * D + d];
    for (size_t d = 0; d < D; ++d) out[d] *= inv;
}

struct AttendJob {
    const float *q, *k, *v;
    const int64_t* lengths;
    size_t B, H, Hkv, S, D, per, T;
    float scale;
    float* out;
    bool vec;
};

void attend_chunk(void* ctx, uint32_t chunk) {
    const AttendJob& j = *static_cast<const AttendJob*>(ctx);
    thread_local std::vector<float> scores;
    if (scores.size() < j.S) scores.resize(j.S);
    const size_t G = j.H / j.Hkv, end = std::min(j.B * j.H, (chunk + 1) * j.per);
    for (size_t i = chunk * j.per; i < end; ++i) {
        // head-major: consecutive pairs are the rows of one head, so a prompt's rows (T > 1) reuse that head's
        // keys and values from L1/L2 instead of cycling through every head's (each pair is computed alone: the
        // order changes no result)
        const size_t h = i / j.B, b = i % j.B;
        const size_t base = (b / j.T * j.Hkv + h / G) * j.S * j.D;
        const float* q = j.q + (b * j.H + h) * j.D;
        float* o = j.out + (b * j.H + h) * j.D;
#ifdef LMFORGE_X86
        if (j.vec) {
            attend_one_avx2(q, j.k + base, j.v + base, (size_t)j.lengths[b], j.D, j.scale, scores.data(), o);
            continue;
        }
#endif
        attend_one_scalar(q, j.k + base, j.v + base, (size_t)j.lengths[b], j.D, j.scale, scores.data(), o);
    }
}

}  // namespace

void attend_rows(const float* q, const float* k, const float* v, const int64_t* lengths, size_t B, size_t H,
                 size_t Hkv, size_t S, size_t D, float scale, float* out, int threads, size_t T) {
    if (B == 0 || H == 0) return;
    std::lock_guard<ForkSafeMutex> lk(g_pool_mu);
    bool vec = false;
#ifdef LMFORGE_X86
    vec = kernel_isa() >= Isa::Avx2 && D % 8 == 0;
#endif
    const size_t pairs = B * H;
    size_t per = std::max<size_t>(1, pairs / (8 * (size_t)std::max(threads, 1)));
    AttendJob job{q, k, v, lengths, B, H, Hkv, S, D, per, T, scale, out, vec};
    const uint32_t chunks = (uint32_t)((pairs + per - 1) / per);
    if (threads <= 1 || pairs < 4) {
        for (uint32_t c = 0; c < chunks; ++c) attend_chunk(&job, c);
        return;
    }
    pool_of(std::min(threads, 64))->run(attend_chunk, &job, chunks);
}

}  // namespace lmforge
