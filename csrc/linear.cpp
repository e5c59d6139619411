// Decode-time kernels (contract in linear.h): skinny matrix products and one-query attention.
//
// Shape of the work: one decode step multiplies a few activation rows (M = batch size, 1..8) by every
// weight matrix of the model once. At M = 1 each weight is used for a single multiply-add, so the time
// is the time to stream the weights from memory; BLAS libraries tuned for large products reach only part
// of the bandwidth there and lose more at M = 2..8, where they pack and block for shapes that never
// come. Here weights are pre-packed in panels read as one sequential stream, each thread claims chunks
// of panels, and each panel is multiplied with all M rows while it sits in L1, so every weight byte is
// read from memory once per call whatever M is. Weights may be stored as 16-bit floats (half the bytes)
// or as int8 codes with a float32 scale per output row (a quarter).
#include "linear.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cmath>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define LMFORGE_X86 1
#endif

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
// AVX2 + FMA (+ F16C for fp16) kernel, compiled for those instructions whatever the build flags and
// used only when the CPU reports them.

#define LMFORGE_AVX2 __attribute__((target("avx2,fma,f16c")))

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

bool cpu_has_avx2() {
    static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                           __builtin_cpu_supports("f16c");
    return ok;
}
#endif  // LMFORGE_X86

using BlockFn = void (*)(const float*, size_t, size_t, const void*, size_t, size_t, size_t, float*, size_t);

std::atomic<bool> g_force_scalar{false};  // tests: run the scalar kernels on an AVX2 machine too

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

// ---------------------------------------------------------------------------------------------------
// A small persistent thread pool. Decoding calls the kernel ~20 times per token, tens to hundreds of
// microseconds each, so starting threads per call would cost a large share. Work is split in chunks
// that the caller and the workers claim from one atomic counter: a worker that wakes late (on a busy or
// virtualised machine waking a sleeping thread can take far longer than a product) finds fewer chunks
// or none, and the caller never waits for a thread that has not started. Workers spin for a while after
// a job, since the next call usually comes soon, and then sleep on a condition variable, so an idle
// pool costs no CPU.

class Pool {
public:
    explicit Pool(int n_workers) {
        for (int i = 0; i < n_workers; ++i) workers_.emplace_back([this] { loop(); });
    }
    ~Pool() {
        {
            std::lock_guard<std::mutex> lk(mu_);
            stop_ = true;
            wake_.fetch_add(1);
        }
        cv_.notify_all();
        for (auto& t : workers_) t.join();
    }
    int size() const { return (int)workers_.size() + 1; }

    // Run fn(ctx, c) for every chunk c in [0, chunks), on the caller and the workers; returns when all ran.
    void run(void (*fn)(void*, uint32_t), void* ctx, uint32_t chunks) {
        fn_.store(fn, std::memory_order_relaxed);
        ctx_.store(ctx, std::memory_order_relaxed);
        chunks_.store(chunks, std::memory_order_relaxed);
        done_.store(0, std::memory_order_relaxed);
        const uint64_t job = ++job_;
        ticket_.store(job << 32, std::memory_order_release);  // publishes the fields above
        wake_.fetch_add(1);  // seq_cst: a worker going to sleep either sees it or is seen in sleepers_
        if (sleepers_.load() > 0) {
            std::lock_guard<std::mutex> lk(mu_);
            cv_.notify_all();
        }
        work(job);
        while (done_.load(std::memory_order_acquire) != chunks) pause();
    }

private:
    static void pause() {
#ifdef LMFORGE_X86
        _mm_pause();
#else
        std::this_thread::yield();
#endif
    }

    // Claim and run chunks of job `job` until none is left (or a newer job has replaced it).
    void work(uint64_t job) {
        uint64_t t = ticket_.load(std::memory_order_acquire);
        for (;;) {
            if ((t >> 32) != job || (uint32_t)t >= chunks_.load(std::memory_order_relaxed)) return;
            // A successful claim means the job is still current: the caller waits for this chunk, so
            // the job's fields stay valid until done_ counts it.
            if (ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel, std::memory_order_acquire)) {
                fn_.load(std::memory_order_relaxed)(ctx_.load(std::memory_order_relaxed), (uint32_t)t);
                done_.fetch_add(1, std::memory_order_release);
                t = ticket_.load(std::memory_order_acquire);
            }
        }
    }

    void loop() {
        uint64_t seen = 0;
        for (;;) {
            uint64_t w = wake_.load(std::memory_order_acquire);
            if (w == seen) {
                const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(kSpinMicros);
                for (int i = 0; (w = wake_.load(std::memory_order_acquire)) == seen; ++i) {
                    pause();
                    if ((i & 63) != 63) continue;
                    // Let any other runnable thread on this core go first (PyTorch's OpenMP workers,
                    // say): a spinning pool must not delay the work between two kernel calls.
                    std::this_thread::yield();
                    if (std::chrono::steady_clock::now() > until) {
                        std::unique_lock<std::mutex> lk(mu_);
                        sleepers_.fetch_add(1);
                        cv_.wait(lk, [&] { return wake_.load() != seen; });
                        sleepers_.fetch_sub(1);
                    }
                }
            }
            seen = w;
            if (stop_) return;
            work(ticket_.load(std::memory_order_acquire) >> 32);
        }
    }

    // Decode steps call the kernel every few tens of microseconds; spinning (politely, see loop()) through
    // those gaps saves a sleep and wake-up per call, and 0.5 ms of spinning after the last call costs little.
    static constexpr int kSpinMicros = 500;
    std::vector<std::thread> workers_;
    std::atomic<uint64_t> wake_{0};    // bumped once per job: wakes the workers
    std::atomic<uint64_t> ticket_{0};  // (job << 32) | next chunk to claim
    std::atomic<uint32_t> chunks_{0};  // chunks of the current job
    std::atomic<uint32_t> done_{0};    // chunks of the current job that have run
    std::atomic<void (*)(void*, uint32_t)> fn_{nullptr};
    std::atomic<void*> ctx_{nullptr};
    uint64_t job_ = 0;  // caller only
    std::atomic<int> sleepers_{0};
    std::mutex mu_;
    std::condition_variable cv_;
    bool stop_ = false;  // written under mu_ before the wake-up that ends the workers
};

// The pool lives for the process. After fork() the child has none of the parent's threads, so the
// parent's pool object is abandoned there (not destroyed: its threads cannot be joined) and a new one
// is made on first use.
Pool* g_pool = nullptr;
std::once_flag g_atfork_once;
std::mutex g_pool_mu;  // held by each kernel call: one job in the pool at a time

Pool* pool_of(int threads) {
    std::call_once(g_atfork_once, [] { pthread_atfork(nullptr, nullptr, [] { g_pool = nullptr; }); });
    if (g_pool == nullptr || g_pool->size() != threads) {
        delete g_pool;
        g_pool = new Pool(threads - 1);
    }
    return g_pool;
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

namespace {

// One query row against n cached keys/values of dimension D: out = softmax(scale * q.K^T) V.
#ifdef LMFORGE_X86
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

// One query over n cached positions: scores, a vectorised softmax, then the weighted sum of values with
// the output's D floats held in registers across all positions (D / 8 independent accumulator chains, up
// to 64 floats per pass).
LMFORGE_AVX2 void attend_one_avx2(const float* q, const float* k, const float* v, size_t n, size_t D, float scale,
                                  float* scores, float* out) {
    float mx = -INFINITY;
    size_t j = 0;
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
    for (size_t d0 = 0; d0 < D; d0 += 64) {
        const size_t nb = std::min<size_t>(8, (D - d0) / 8);
        __m256 acc[8];
        for (size_t b = 0; b < nb; ++b) acc[b] = _mm256_setzero_ps();
        const float* vp = v + d0;
        for (j = 0; j < n; ++j, vp += D) {
            const __m256 p = _mm256_set1_ps(scores[j]);
            for (size_t b = 0; b < nb; ++b) acc[b] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vp + 8 * b), acc[b]);
        }
        for (size_t b = 0; b < nb; ++b) _mm256_storeu_ps(out + d0 + 8 * b, _mm256_mul_ps(acc[b], inv));
    }
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
    size_t B, H, Hkv, S, D, per;
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
        const size_t b = i / j.H, h = i % j.H;
        const size_t base = (b * j.Hkv + h / G) * j.S * j.D;
        const float* q = j.q + i * j.D;
        float* o = j.out + i * j.D;
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
                 size_t Hkv, size_t S, size_t D, float scale, float* out, int threads) {
    if (B == 0 || H == 0) return;
    std::lock_guard<std::mutex> lk(g_pool_mu);
    bool vec = false;
#ifdef LMFORGE_X86
    vec = cpu_has_avx2() && D % 8 == 0 && !g_force_scalar.load(std::memory_order_relaxed);
#endif
    const size_t pairs = B * H;
    size_t per = std::max<size_t>(1, pairs / (8 * (size_t)std::max(threads, 1)));
    AttendJob job{q, k, v, lengths, B, H, Hkv, S, D, per, scale, out, vec};
    const uint32_t chunks = (uint32_t)((pairs + per - 1) / per);
    if (threads <= 1 || pairs < 4) {
        for (uint32_t c = 0; c < chunks; ++c) attend_chunk(&job, c);
        return;
    }
    pool_of(std::min(threads, 64))->run(attend_chunk, &job, chunks);
}

// ---------------------------------------------------------------------------------------------------
// The small per-token operations of a decode step, one call each instead of several PyTorch ops.
// Rows are few (the batch), so these run on the calling thread.

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
                     const int64_t* pos, float* k_cache, float* v_cache, size_t S, float* q_out) {
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
            const size_t at = ((b * Hkv + h) * S + (size_t)pos[b]) * D;
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

const char* linear_isa() {
#ifdef LMFORGE_X86
    if (cpu_has_avx2() && !g_force_scalar.load(std::memory_order_relaxed)) return "avx2";
#endif
    return "scalar";
}

void linear_force_scalar(bool on) { g_force_scalar.store(on); }

}  // namespace lmforge
