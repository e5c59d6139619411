// A whole decode step in one call (contract in kernels.h; Python: lmforge.generate.engine.Engine.step): the
// embedding rows, every block, the final norm and the head, on the model's KV cache, through the kernels of
// kernels.h in the order of the model's forward (lmforge.model.transformer). Until it existed the engine
// called those kernels one by one from Python; the results are the same, and what goes is the cost between
// calls (the interpreter, array wrapping, PyTorch ops and allocations, ~0.6 ms a step at d512 x 4 layers).
// The pool's workers spin between the products of a step (pool.h): woken at most once per step.
#include <cmath>
#include <cstring>
#include <vector>

#include "decode/kernels.h"

namespace lmforge {

namespace {

void linear(const PackedMatrix& w, const float* x, size_t M, float* y, int threads) {
    linear_rows(x, M, w.K, w.w, w.wt, w.N, y, w.N, threads, w.scales);
}

void add_into(float* x, const float* y, size_t n) {
    for (size_t i = 0; i < n; ++i) x[i] += y[i];
}

}  // namespace

void decode_step(const DecodeModel& m, const int64_t* tokens, size_t B, float* k, float* v, size_t rows, size_t S,
                 int64_t* lengths, float* logits, int threads) {
    if (B == 0) return;
    const size_t C = m.C, H = m.H, Hkv = m.Hkv, D = m.D, F = m.F;
    const size_t layer_stride = rows * Hkv * S * D;  // one layer of the cache, all its rows
    // Scratch for the step: the residual stream x, the normed rows h, the fused projections, q, the attention
    // output, gate|up and the SwiGLU activation, one product's output y (B rows each).
    std::vector<float> x(B * C), h(B * C), qkv(B * (H + 2 * Hkv) * D), q(B * H * D), att(B * H * D),
        gate_up(B * 2 * F), act(B * F), y(B * C);
    std::vector<int64_t> ends(B);
    for (size_t b = 0; b < B; ++b) {
        std::memcpy(x.data() + b * C, m.embed + (size_t)tokens[b] * C, C * sizeof(float));
        ends[b] = lengths[b] + 1;  // attention sees the new token too
    }
    const float scale = (float)(1.0 / std::sqrt((double)D));  // as Python's 1 / math.sqrt(D) passed as a float
    for (size_t l = 0; l < m.layers.size(); ++l) {
        const DecodeLayer& L = m.layers[l];
        float* kl = k + l * layer_stride;
        float* vl = v + l * layer_stride;
        rms_norm_rows(x.data(), B, C, L.ln1, m.eps, h.data());
        linear(L.qkv, h.data(), B, qkv.data(), threads);
        rope_cache_rows(qkv.data(), B, H, Hkv, D, m.cos, m.sin, lengths, kl, vl, S, q.data());
        attend_rows(q.data(), kl, vl, ends.data(), B, H, Hkv, S, D, scale, att.data(), threads);
        linear(L.out, att.data(), B, y.data(), threads);
        add_into(x.data(), y.data(), B * C);
        rms_norm_rows(x.data(), B, C, L.ln2, m.eps, h.data());
        linear(L.up, h.data(), B, gate_up.data(), threads);
        swiglu_rows(gate_up.data(), B, F, act.data());
        linear(L.down, act.data(), B, y.data(), threads);
        add_into(x.data(), y.data(), B * C);
    }
    rms_norm_rows(x.data(), B, C, m.ln_final, m.eps, h.data());
    linear(m.head, h.data(), B, logits, threads);
    for (size_t b = 0; b < B; ++b) lengths[b] = ends[b];
}

}  // namespace lmforge
