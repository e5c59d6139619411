// A whole decode step in one call (contract in kernels.h; Python: lmforge.generate.engine.Engine.step and
// the kernel path's prefill, a prompt's tokens as the rows of one call): the embedding rows, every block, the
// final norm and the head, on the model's KV cache, through the kernels of kernels.h in the order of the
// model's forward (lmforge.model.transformer). Until it existed the engine
// called those kernels one by one from Python; the results are the same, and what goes is the cost between
// calls (the interpreter, array wrapping, PyTorch ops and allocations, ~0.6 ms a step at d512 x 4 layers).
// The pool's workers spin between the products of a step (pool.h): woken at most once per step.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <vector>

#include "decode/kernels.h"
#include "decode/pool.h"

namespace lmforge {

namespace {

void linear(const PackedMatrix& w, const float* x, size_t M, float* y, int threads) {
    linear_rows(x, M, w.K, w.w, w.wt, w.N, y, w.N, threads, w.scales);
}

void add_into(float* x, const float* y, size_t n) {
    for (size_t i = 0; i < n; ++i) x[i] += y[i];
}

// fn(r0, r1) over the rows [0, M): a prompt's rows in chunks on the pool, a decode step's few on this thread.
// Every row's result is its own, whichever thread computes it. Measured (d512 x 4, a 256-token prompt) the
// norms, RoPE, SwiGLU and adds on the calling thread were ~4% of the prefill, the pool's worker idle meanwhile.
template <class F>
void for_rows(size_t M, int threads, F&& fn) {
    constexpr size_t kMinRows = 16;  // below, one hand-off costs about what a second thread saves
    if (threads <= 1 || M < kMinRows) return fn(size_t{0}, M);
    const size_t per = (M + 4 * (size_t)threads - 1) / (4 * (size_t)threads);  // ~4 chunks a thread
    struct Ctx {
        F* fn;
        size_t M, per;
    } ctx{&fn, M, per};
    auto chunk = [](void* c, uint32_t i) {
        const Ctx& j = *static_cast<const Ctx*>(c);
        const size_t r0 = i * j.per, r1 = std::min(j.M, r0 + j.per);
        if (r0 < r1) (*j.fn)(r0, r1);
    };
    std::lock_guard<ForkSafeMutex> lk(g_pool_mu);
    pool_of(std::min(threads, 64))->run(chunk, &ctx, (uint32_t)((M + per - 1) / per));
}

void norm_rows(const float* x, size_t M, size_t C, const float* w, float eps, float* out, int threads) {
    for_rows(M, threads, [&](size_t r0, size_t r1) { rms_norm_rows(x + r0 * C, r1 - r0, C, w, eps, out + r0 * C); });
}

void add_rows(float* x, const float* y, size_t M, size_t C, int threads) {
    for_rows(M, threads, [&](size_t r0, size_t r1) { add_into(x + r0 * C, y + r0 * C, (r1 - r0) * C); });
}

}  // namespace

void decode_step(const DecodeModel& m, const int64_t* tokens, size_t B, size_t T, float* k, float* v, size_t rows,
                 size_t first, size_t S, int64_t* lengths, float* logits, int threads, bool all) {
    if (B == 0 || T == 0) return;
    const size_t C = m.C, H = m.H, Hkv = m.Hkv, D = m.D, F = m.F, M = B * T;  // M: one activation row per token
    const size_t layer_stride = rows * Hkv * S * D;  // one layer of the cache, all its rows
    const size_t row0 = first * Hkv * S * D;         // the batch's first cache row within a layer
    // Scratch for the step: the residual stream x, the normed rows h, the fused projections, q, the attention
    // output, gate|up and the SwiGLU activation, one product's output y (M rows each).
    std::vector<float> x(M * C), h(M * C), qkv(M * (H + 2 * Hkv) * D), q(M * H * D), att(M * H * D),
        gate_up(M * 2 * F), act(M * F), y(M * C);
    std::vector<int64_t> pos(M), ends(M);  // each token's cache column, and the columns its query sees
    for (size_t r = 0; r < M; ++r) {
        std::memcpy(x.data() + r * C, m.embed + (size_t)tokens[r] * C, C * sizeof(float));
        pos[r] = lengths[r / T] + (int64_t)(r % T);
        ends[r] = pos[r] + 1;  // attention sees the token itself and those before it
    }
    const float scale = (float)(1.0 / std::sqrt((double)D));  // as Python's 1 / math.sqrt(D) passed as a float
    size_t n = M, per = T;  // the rows the layer carries on past its cache writes, and the queries per cache row
    for (size_t l = 0; l < m.layers.size(); ++l) {
        const DecodeLayer& L = m.layers[l];
        float* kl = k + l * layer_stride + row0;
        float* vl = v + l * layer_stride + row0;
        norm_rows(x.data(), M, C, L.ln1, m.eps, h.data(), threads);
        linear(L.qkv, h.data(), M, qkv.data(), threads);
        const size_t width = (H + 2 * Hkv) * D;
        for_rows(M, threads, [&](size_t r0, size_t r1) {
            rope_cache_rows(qkv.data() + r0 * width, r1 - r0, H, Hkv, D, m.cos, m.sin, pos.data() + r0, kl, vl, S,
                            q.data() + r0 * H * D, T, r0);
        });
        if (l + 1 == m.layers.size() && T > 1 && !all) {
            // The last layer's keys and values are in the cache; past them only each row's last token reaches
            // the head, so its attention, projections and MLP run for those B tokens alone (moved to rows
            // 0 .. B-1). Each kernel works per row, so they get the bits they would get among all T.
            for (size_t b = 0; b < B; ++b) {
                const size_t r = b * T + T - 1;
                std::memmove(q.data() + b * H * D, q.data() + r * H * D, H * D * sizeof(float));
                std::memmove(x.data() + b * C, x.data() + r * C, C * sizeof(float));
                ends[b] = ends[r];
            }
            n = B, per = 1;
        }
        attend_rows(q.data(), kl, vl, ends.data(), n, H, Hkv, S, D, scale, att.data(), threads, per);
        linear(L.out, att.data(), n, y.data(), threads);
        add_rows(x.data(), y.data(), n, C, threads);
        norm_rows(x.data(), n, C, L.ln2, m.eps, h.data(), threads);
        linear(L.up, h.data(), n, gate_up.data(), threads);
        for_rows(n, threads, [&](size_t r0, size_t r1) {
            swiglu_rows(gate_up.data() + r0 * 2 * F, r1 - r0, F, act.data() + r0 * F);
        });
        linear(L.down, act.data(), n, y.data(), threads);
        add_rows(x.data(), y.data(), n, C, threads);
    }
    if (all) {  // every token's logits (checking drafted tokens): the final norm and the head over all M rows
        norm_rows(x.data(), M, C, m.ln_final, m.eps, h.data(), threads);
        linear(m.head, h.data(), M, logits, threads);
    } else {
        for (size_t b = 0; b < B; ++b)  // the last token of each row (rows of per tokens now): the final norm, the head
            rms_norm_rows(x.data() + (b * per + per - 1) * C, 1, C, m.ln_final, m.eps, h.data() + b * C);
        linear(m.head, h.data(), B, logits, threads);
    }
    for (size_t b = 0; b < B; ++b) lengths[b] += (int64_t)T;
}

}  // namespace lmforge
