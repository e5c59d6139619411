// Decode-time skinny matrix products y = x . W^T for a few rows x (contract in kernels.h; Python:
// lmforge.generate.packed.PackedLinear; the decode step of step.cpp), and the switches of the kernels'
// instruction set: scalar, AVX2 or AVX-512, picked at run time (the vector kernels in tiles.inc; AVX-512 VNNI
// serves only the integer products of qdot.cpp), and the opt-in bf16-activation mode of bf16 weights (AVX-512
// BF16's vdpbf16ps, a third build of tiles.inc).
//
// Shape of the work: one decode step multiplies a few activation rows (M = batch size, 1..8) by every
// weight matrix of the model once. At M = 1 each weight is used for a single multiply-add, so the time
// is the time to stream the weights from memory; BLAS libraries tuned for large products reach only part
// of the bandwidth there and lose more at M = 2..8, where they pack and block for shapes that never
// come. Here weights are pre-packed in panels read as one sequential stream, each thread claims chunks
// of panels, and each panel is multiplied with all M rows while it sits in L1, so every weight byte is
// read from memory once per call whatever M is. Weights may be stored as 16-bit floats (half the bytes)
// or as int8 codes with a float32 scale per output row (a quarter).
//
// AVX-512 on Zen 4 runs a 512-bit operation as two 256-bit halves, so 512-bit vectors add no multiply-adds
// per cycle there; measured, a 512-bit version (two k columns of a panel per vector) was ~10% slower at one
// row for bf16 and int8 and about the same for fp32. What AVX-512 does give is 32 vector registers
// (AVX-512VL), so the AVX-512 build keeps 256-bit vectors and holds up to 24 accumulators instead of 8:
// for a d512 model's products on one Zen 4 thread (indicative, a shared machine), 11-23% less time for fp32
// at 2..8 rows, 5-20% for bf16 at 2..8, ~13% for int8 at 2 rows; the same at one row (bandwidth-bound) and
// for int8 at 4..8 rows (within +-5%: its conversions, not the accumulator chains, set the pace there).
#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <vector>

#include "decode/kernels.h"
#include "decode/pool.h"
#include "decode/simd.h"

namespace lmforge {
namespace {

// ---------------------------------------------------------------------------------------------------
// 16-bit floats to fp32 (scalar; exact, as torch's .float() converts them; fp16: simd.h).

inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
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

// Scalar kernels: every CPU (the compiler vectorizes the j loops). Panels [p0, p1), all M rows; each output
// summed over k in order, as the vector tiles do (same order, not the same bits: no FMA here).
template <WeightType WT>
void block_scalar(const float* x, const float*, size_t M, size_t K, const void* w, const void*, size_t N, size_t p0,
                  size_t p1, float* y, size_t ldy) {
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

// int4 (layout in tiles.inc, tile4): per group of 32 k, the even and the odd k summed apart, part = even + odd,
// then acc += s * (part - 8 * xs[g]).
void block_scalar4(const float* x, const float* xs, size_t M, size_t K, const void* wv, const void* scv, size_t N,
                   size_t p0, size_t p1, float* y, size_t ldy) {
    const auto* w = static_cast<const uint8_t*>(wv);
    const auto* sc = static_cast<const uint16_t*>(scv);
    const size_t G = (K + 31) / 32, KP = 16 * G;
    for (size_t p = p0; p < p1; ++p) {
        for (size_t m = 0; m < M; ++m) {
            float acc[kPanel] = {0, 0, 0, 0, 0, 0, 0, 0};
            const float* xr = x + m * K;
            for (size_t g = 0; g < G; ++g) {
                float even[kPanel] = {0, 0, 0, 0, 0, 0, 0, 0}, odd[kPanel] = {0, 0, 0, 0, 0, 0, 0, 0};
                for (size_t k = 32 * g; k < std::min(K, 32 * g + 32); ++k) {
                    const uint8_t* at = w + (p * KP + k / 2) * kPanel;
                    if (k & 1) {
                        for (size_t j = 0; j < kPanel; ++j) odd[j] += xr[k] * (float)(at[j] >> 4);
                    } else {
                        for (size_t j = 0; j < kPanel; ++j) even[j] += xr[k] * (float)(at[j] & 0xF);
                    }
                }
                const uint16_t* s = sc + (p * G + g) * kPanel;
                const float x8 = 8.0f * xs[m * G + g];
                for (size_t j = 0; j < kPanel; ++j) acc[j] += f16_to_f32(s[j]) * ((even[j] + odd[j]) - x8);
            }
            for (size_t j = 0; j < kPanel && p * kPanel + j < N; ++j) y[m * ldy + p * kPanel + j] = acc[j];
        }
    }
}

template <WeightType WT>
constexpr size_t sizeof_w() { return WT == WeightType::F32 ? 4 : WT == WeightType::I8 || WT == WeightType::I4 ? 1 : 2; }
constexpr size_t kPrefetch = 1024;  // weights ahead (in elements): software prefetch over the stream

#ifdef LMFORGE_X86
// The vector kernels (simd.h says when each runs), one source compiled for two instruction sets.
#define LMFORGE_TILES LMFORGE_AVX2
namespace avx2 {
constexpr bool kWide = false, kBf16Dot = false;
#include "decode/tiles.inc"
}  // namespace avx2
#undef LMFORGE_TILES
#define LMFORGE_TILES LMFORGE_AVX512
namespace avx512 {
constexpr bool kWide = true, kBf16Dot = false;
#include "decode/tiles.inc"
}  // namespace avx512
#undef LMFORGE_TILES
#define LMFORGE_TILES LMFORGE_AVX512_BF16
namespace avx512bf16 {  // only block<BF16> is used: bf16 weights times bf16 activations
constexpr bool kWide = true, kBf16Dot = true;
#include "decode/tiles.inc"
}  // namespace avx512bf16
#undef LMFORGE_TILES
#endif  // LMFORGE_X86

using BlockFn = void (*)(const float*, const float*, size_t, size_t, const void*, const void*, size_t, size_t,
                         size_t, float*, size_t);

template <WeightType WT>
BlockFn pick_typed() {
#ifdef LMFORGE_X86
    const Isa isa = kernel_isa();  // VNNI adds nothing to float products: they run the AVX-512 build there
    if (isa >= Isa::Avx512) return avx512::block<WT>;
    if (isa == Isa::Avx2) return avx2::block<WT>;
#endif
    if constexpr (WT == WeightType::I4) return block_scalar4;
    else return block_scalar<WT>;
}

BlockFn pick_block(WeightType wt) {
    switch (wt) {
        case WeightType::BF16: return pick_typed<WeightType::BF16>();
        case WeightType::F16: return pick_typed<WeightType::F16>();
        case WeightType::I8: return pick_typed<WeightType::I8>();
        case WeightType::I4: return pick_typed<WeightType::I4>();
        default: return pick_typed<WeightType::F32>();
    }
}

struct Job {
    BlockFn block;
    const float* x;
    const float* xs;  // int4: the group sums of x (M, G); bf16 activations: x's bf16 pairs; else null
    size_t M, K;
    const void* w;
    size_t N;
    float* y;
    size_t ldy;
    size_t panels_per_chunk;
    const void* scales;   // int8: float32 per output row, applied after the products; int4: fp16 per group (tiles)
    bool row_scales;      // int8
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
    j.block(j.x, j.xs, j.M, j.K, j.w, j.scales, j.N, p0, p1, j.y, j.ldy);
    if (j.row_scales) apply_scales(static_cast<const float*>(j.scales), j.M, p0 * kPanel, std::min(j.N, p1 * kPanel), j.y, j.ldy);
}

}  // namespace

void linear_rows(const float* x, size_t M, size_t K, const void* w, WeightType wt, size_t N, float* y, size_t ldy,
                 int threads, const void* scales) {
    if (M == 0 || N == 0) return;
    if (wt == WeightType::I8Q8 || wt == WeightType::I4Q8)
        return linear_rows_q8(x, M, K, w, wt, N, y, ldy, threads, scales);
    std::lock_guard<ForkSafeMutex> lk(g_pool_mu);
    BlockFn block = pick_block(wt);
    // int4: each row's sum over each group of 32 k, in order (the tiles take 8 * xs off per group)
    thread_local std::vector<float> xs;
    // bf16 activations: each row's x rounded to bf16 once, k = 2t and 2t + 1 in word t (the odd K's last high half 0)
    thread_local std::vector<uint32_t> xp;
    const float* side = nullptr;
    if (wt == WeightType::I4) {
        const size_t G = (K + 31) / 32;
        xs.assign(M * G, 0.0f);
        for (size_t m = 0; m < M; ++m)
            for (size_t k = 0; k < K; ++k) xs[m * G + k / 32] += x[m * K + k];
        side = xs.data();
    }
#ifdef LMFORGE_X86
    if (wt == WeightType::BF16 && bf16_dot_runs()) {
        const size_t KH = (K + 1) / 2;
        xp.assign(M * KH, 0u);
        for (size_t m = 0; m < M; ++m)
            for (size_t k = 0; k < K; ++k) xp[m * KH + k / 2] |= (uint32_t)f32_to_bf16(x[m * K + k]) << (16 * (k & 1));
        block = avx512bf16::block<WeightType::BF16>;
        side = reinterpret_cast<const float*>(xp.data());  // the block reads them back as uint32_t
    }
#endif
    Job job{block, x, side, M, K, w, N, y, ldy, 0, scales, wt == WeightType::I8};
    const size_t panels = (N + kPanel - 1) / kPanel;
    // Below ~64k weights (a 256 x 256 matrix) the hand-off costs more than the second thread saves.
    if (threads <= 1 || N * K < (size_t)65536 || N < 64) {
        job.panels_per_chunk = panels;
        run_chunk(&job, 0);
        return;
    }
    threads = std::min(threads, 64);
    // About 8 chunks per thread, each a multiple of 4 panels (the kernel's panel groups). Threads split the
    // outputs, never a sum over k: every output is one thread's, in the same order whatever the thread count.
    job.panels_per_chunk = std::max<size_t>(4, (panels / (8 * (size_t)threads) + 3) & ~(size_t)3);
    pool_of(threads)->run(run_chunk, &job, (uint32_t)((panels + job.panels_per_chunk - 1) / job.panels_per_chunk));
}

const char* linear_isa() {
    if (bf16_dot_runs()) return "avx512_bf16";
    switch (kernel_isa()) {
        case Isa::Avx512Vnni: return "avx512_vnni";
        case Isa::Avx512: return "avx512";
        case Isa::Avx2: return "avx2";
        default: return "scalar";
    }
}

void linear_force_scalar(bool on) { g_force_scalar.store(on); }

void linear_force_avx2(bool on) { g_force_avx2.store(on); }

void linear_force_avx512(bool on) { g_force_avx512.store(on); }

void linear_bf16_activations(bool on) { g_bf16_activations.store(on); }

}  // namespace lmforge
