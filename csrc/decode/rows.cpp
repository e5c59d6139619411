// The small per-token operations of a decode step: RMSNorm, RoPE into the KV cache, SwiGLU (contract in
// kernels.h; called by the decode step, step.cpp, which spreads a prompt's rows over the pool; Python twins:
// the model's own layers). Each call runs on the calling thread.
#include <cmath>
#include <cstring>

#include "decode/kernels.h"
#include "decode/simd.h"

namespace lmforge {

namespace {

// A row's sum of squares, in the order both paths use: 8 lane sums (lane l over c = l, l + 8, ..), the lanes
// added as hsum adds them ((l, l + 4), then (0, 2) and (1, 3), then the two), then the tail past the last 8.
// Each product and sum rounded on its own (no FMA), so the two paths give the same bits.
float sum_squares_scalar(const float* x, size_t C) {
    float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    size_t c = 0;
    for (; c + 8 <= C; c += 8)
        for (size_t l = 0; l < 8; ++l) lane[l] = lane[l] + x[c + l] * x[c + l];
    const float s4[4] = {lane[0] + lane[4], lane[1] + lane[5], lane[2] + lane[6], lane[3] + lane[7]};
    float s = (s4[0] + s4[2]) + (s4[1] + s4[3]);
    for (; c < C; ++c) s = s + x[c] * x[c];
    return s;
}

}  // namespace

#ifdef LMFORGE_X86
namespace {

LMFORGE_AVX2 float sum_squares_avx2(const float* x, size_t C) {
    __m256 acc = _mm256_setzero_ps();
    size_t c = 0;
    for (; c + 8 <= C; c += 8) {
        const __m256 v = _mm256_loadu_ps(x + c);
        acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
    }
    float s = hsum(acc);
    for (; c < C; ++c) s = s + x[c] * x[c];
    return s;
}

// x * r * w for C columns, 8 at a time (the tail scalar): the scalar loop's two roundings per element.
LMFORGE_AVX2 void scale_row_avx2(const float* x, float r, const float* w, size_t C, float* out) {
    const __m256 rv = _mm256_set1_ps(r);
    size_t c = 0;
    for (; c + 8 <= C; c += 8)
        _mm256_storeu_ps(out + c, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + c), rv), _mm256_loadu_ps(w + c)));
    for (; c < C; ++c) out[c] = x[c] * r * w[c];
}

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
    bool vec = false;
#ifdef LMFORGE_X86
    vec = kernel_isa() >= Isa::Avx2;
#endif
    for (size_t m = 0; m < M; ++m) {
        const float* xr = x + m * C;
#ifdef LMFORGE_X86
        if (vec) {
            const float r = 1.0f / std::sqrt(sum_squares_avx2(xr, C) / (float)C + eps);
            scale_row_avx2(xr, r, w, C, out + m * C);
            continue;
        }
#endif
        const float r = 1.0f / std::sqrt(sum_squares_scalar(xr, C) / (float)C + eps);
        for (size_t c = 0; c < C; ++c) out[m * C + c] = xr[c] * r * w[c];
    }
}

void rope_cache_rows(const float* qkv, size_t B, size_t H, size_t Hkv, size_t D, const float* cos, const float* sin,
                     const int64_t* pos, float* k_cache, float* v_cache, size_t S, float* q_out, size_t T,
                     size_t b0) {
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
            const size_t at = (((b0 + b) / T * Hkv + h) * S + (size_t)pos[b]) * D;
            rotate(row + (H + h) * D, k_cache + at);
            std::memcpy(v_cache + at, row + (H + Hkv + h) * D, D * sizeof(float));
        }
    }
}

void swiglu_rows(const float* gate_up, size_t M, size_t F, float* out) {
    bool vec = false;
#ifdef LMFORGE_X86
    vec = kernel_isa() >= Isa::Avx2;
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
