// Decode-time kernels: skinny matrix products y (M, N) = x (M, K) . W^T for a few rows M, with W (N, K)
// pre-packed in panels of 8 rows and stored as fp32, bf16 or fp16 (fp32 accumulation), and one-query
// attention over a KV cache. Both run on a small persistent thread pool of their own.
// Pure-PyTorch twins: lmforge.decoder.PackedLinear.reference and CachedDecoder.step's matmul path; the
// tests hold them equal.
#pragma once
#include <cstddef>
#include <cstdint>

namespace lmforge {

enum class WeightType { F32 = 0, BF16 = 1, F16 = 2 };

// y[m * ldy + n] = sum_k x[m * K + k] * W[n][k], for m < M, n < N, where w holds W packed in panels of 8
// rows: w[(p * K + k) * 8 + j] = W[8p + j][k] (zero past N); w's element type is `wt`.
// threads <= 1 runs on the calling thread only; concurrent calls from several threads are serialised.
// y must not overlap x or w.
void linear_rows(const float* x, size_t M, size_t K, const void* w, WeightType wt, size_t N, float* y, size_t ldy,
                 int threads);

// Attention of one new query per row over a KV cache, for decoding. q and out are (B, H, D); k and v are
// (B, Hkv, S, D) with H a multiple of Hkv (query head h reads cache head h / (H / Hkv)); row b attends to
// cache columns [0, lengths[b]), 1 <= lengths[b] <= S. Softmax in fp32 with the row maximum subtracted.
void attend_rows(const float* q, const float* k, const float* v, const int64_t* lengths, size_t B, size_t H,
                 size_t Hkv, size_t S, size_t D, float scale, float* out, int threads);

// Which instruction set the kernels use on this CPU: "avx2" or "scalar".
const char* linear_isa();

// Use the scalar kernels even where AVX2 is available (for tests holding both to the same reference).
void linear_force_scalar(bool on);

}  // namespace lmforge
