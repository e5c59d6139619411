// The small per-token operations of a decode step: RMSNorm, RoPE into the KV cache, SwiGLU (contract in
// kernels.h; called by the decode step, step.cpp; Python twins: the model's own layers). Rows are few (the
// batch), so these run on the calling thread.
#include <cmath>
#include <cstring>

#include "decode/kernels.h"
#include "decode/simd.h"

namespace lmforge {

#ifdef LMFORGE_X86
namespace {

// silu(g) * u for F columns, 8 at a time (the tail scalar).
LMFORGE_AVX2 void swiglu_row_avx2(const float* g, const float* u, size_t F, float* out) {
    size_t f = 0;
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; f + 8 <= F; f += 8) {
        const __m256 gv = _mm256_loadu_ps(g + f);
        const __m256 den = _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv)));
        _mm256_storeu_ps(out + f, _mm256_mul_ps(_mm256_div_ps(gv, den), _mm256_loadu_ps(u + f)));
    }
    for (; f < F; ++f) out[f] = g[f] / (1.0f + std::exp(-g[f])) * u[f];
}

}  // namespace
#endif

void rms_norm_rows(const float* x, size_t M, size_t C, const float* w, float eps, float* out) {
    for (size_t m = 0; m < M; ++m) {
        const float* xr = x + m * C;
        float ss = 0;
        for (size_t c = 0; c < C; ++c) ss += xr[c] * xr[c];
        const float r = 1.0f / std::sqrt(ss / (float)C + eps);
        for (size_t c = 0; c < C; ++c) out[m * C + c] = xr[c] * r * w[c];
    }
}

void rope_cache_rows(const float* qkv, size_t B, size_t H, size_t Hkv, size_t D, const float* cos, const float* sin,
                     const int64_t* pos, float* k_cache, float* v_cache, size_t S, float* q_out, size_t T) {
    const size_t half = D / 2, width = (H + 2 * Hkv) * D;
    for (size_t b = 0; b < B; ++b) {
        const float* row = qkv + b * width;
        const float* c = cos + pos[b] * half;
        const float* s = sin + pos[b] * half;
        auto rotate = [&](const float* in, float* out) {  // pairs (2i, 2i+1) as complex numbers times e^{i angle}
            for (size_t i = 0; i < half; ++i) {
                const float a = in[2 * i], bb = in[2 * i + 1];
                out[2 * i] = a * c[i] - bb * s[i];
                out[2 * i + 1] = a * s[i] + bb * c[i];
            }
        };
        for (size_t h = 0; h < H; ++h) rotate(row + h * D, q_out + (b * H + h) * D);
        for (size_t h = 0; h < Hkv; ++h) {
            const size_t at = ((b / T * Hkv + h) * S + (size_t)pos[b]) * D;
            rotate(row + (H + h) * D, k_cache + at);
            std::memcpy(v_cache + at, row + (H + Hkv + h) * D, D * sizeof(float));
        }
    }
}

void swiglu_rows(const float* gate_up, size_t M, size_t F, float* out) {
    bool vec = false;
#ifdef LMFORGE_X86
    vec = cpu_has_avx2() && !g_force_scalar.load(std::memory_order_relaxed);
#endif
    for (size_t m = 0; m < M; ++m) {
        const float* g = gate_up + m * 2 * F;
        const float* u = g + F;
#ifdef LMFORGE_X86
        if (vec) {
            swiglu_row_avx2(g, u, F, out + m * F);
            continue;
        }
#endif
        for (size_t f = 0; f < F; ++f) out[m * F + f] = g[f] / (1.0f + std::exp(-g[f])) * u[f];
    }
}

}  // namespace lmforge
