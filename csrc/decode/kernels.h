// The decode kernels' contract (Python: lmforge.generate.engine and .packed, through the bindings): a whole
// decode step of the model in one call (step.cpp), built from skinny matrix products y (M, N) = x (M, K) . W^T
// for a few rows M, with W (N, K) pre-packed in panels of 8 rows and stored as fp32, bf16, fp16, int8 with
// a scale per row or int4 with a scale per group of 32, fp32 accumulation (products.cpp; many rows: the GEMM of
// tiles.inc), or int8/int4 codes times activations rounded to int8 per 32 with int32 sums (qdot.cpp);
// one-query attention over a KV cache (attention.cpp),
// both on a small persistent thread pool of their own (pool.h); the per-token RMSNorm, RoPE and SwiGLU rows
// (rows.cpp). Pure-PyTorch twins: lmforge.generate.packed.PackedLinear.reference and the model's own forward
// (Engine(use_kernel=False)); tests/generate/test_decoder.py and tests/generate/test_decode_step.py hold them equal.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace lmforge {

// F32 .. I4 multiply float32 activations by the weights converted to float32 (the model whose matrices are
// rounded, exactly; BF16 with linear_bf16_activations on, where it runs: activations rounded to bf16); I8Q8 and I4Q8 hold the same codes and scales as I8 and I4 in another layout and round the
// activations to int8 per block of 32 first (integer dot products, llama.cpp's arithmetic: qdot.cpp).
enum class WeightType { F32 = 0, BF16 = 1, F16 = 2, I8 = 3, I4 = 4, I8Q8 = 5, I4Q8 = 6 };

// y[m * ldy + n] = sum_k x[m * K + k] * W[n][k], for m < M, n < N, where w holds W packed in panels of 8
// rows: w[(p * K + k) * 8 + j] = W[8p + j][k] (zero past N); w's element type is `wt`. For I8 the weights
// are int8 codes and W[n][k] = w * scales[n] (scales: at least N floats). For I4 (groups of 32 k, G =
// ceil(K / 32)) w holds codes q in [0, 15], two k per byte: w[(p * 16 G + k / 2) * 8 + j] has q[8p + j][k] in
// its low nibble for even k, its high nibble for odd k, and W[n][k] = scales[(p * G + k / 32) * 8 + j] * (q - 8)
// (scales: ceil(N / 8) * G * 8 fp16 bit patterns, uint16, 2 bytes per 32 weights as in llama.cpp's Q4_0). Other
// types ignore scales.
// I8Q8 (K padded to 32 G with zero codes): w[(p * 32 G + 4 s) * 8 + 4 j + i] = c[8p + j][4s + i], four k of
// each row per 32 bytes; scales as I8. I4Q8: per panel p and group g 128 bytes, w[(p * G + g) * 128 + 32 v +
// 4 j + i] = q[8p + j][32g + 4v + i] | q[8p + j][32g + 16 + 4v + i] << 4; scales as I4. Their sums: qdot.cpp.
// Batch invariant: each y[m][n] is summed in an order that depends only on K (not on M, m, other rows or the
// thread count), so a row's outputs are the same bits whatever it is multiplied with.
// threads <= 1 runs on the calling thread only; concurrent calls from several threads are serialised.
// y must not overlap x or w.
void linear_rows(const float* x, size_t M, size_t K, const void* w, WeightType wt, size_t N, float* y, size_t ldy,
                 int threads, const void* scales = nullptr);

// Attention of one new query per row over a KV cache, for decoding. q and out are (B, H, D); k and v are
// (B / T, Hkv, S, D) with H a multiple of Hkv (query head h reads cache head h / (H / Hkv)); query row b reads
// cache row b / T (T queries per cache row: a prompt's tokens) and attends to its columns [0, lengths[b]),
// 1 <= lengths[b] <= S. Softmax in fp32 with the row maximum subtracted; each query alone, on one thread.
void attend_rows(const float* q, const float* k, const float* v, const int64_t* lengths, size_t B, size_t H,
                 size_t Hkv, size_t S, size_t D, float scale, float* out, int threads, size_t T = 1);

// The small operations of a decode step (calling thread only), matching the model's definitions:
// out = x / sqrt(mean(x^2) + eps) * w per row of x (M, C), the sum of squares in 8 lanes (rows.cpp: the order).
void rms_norm_rows(const float* x, size_t M, size_t C, const float* w, float eps, float* out);
// From fused projections qkv (B, (H + 2 Hkv) D): RoPE (pairs (2i, 2i+1) turned by the angle at position
// pos[b], tables cos/sin (positions, D/2)) on the q and k heads; q to q_out (B, H, D), k and v written
// into the caches (B / T, Hkv, S, D) at column pos[b] of cache row (b0 + b) / T (b0: the first row's index in
// the batch, when a part of it is passed).
void rope_cache_rows(const float* qkv, size_t B, size_t H, size_t Hkv, size_t D, const float* cos, const float* sin,
                     const int64_t* pos, float* k_cache, float* v_cache, size_t S, float* q_out, size_t T = 1,
                     size_t b0 = 0);
// out (M, F) = silu(g) * u for gate_up (M, 2F) = [g | u].
void swiglu_rows(const float* gate_up, size_t M, size_t F, float* out);

// The integer path of linear_rows for I8Q8 and I4Q8 (qdot.cpp, which states the arithmetic).
void linear_rows_q8(const float* x, size_t M, size_t K, const void* w, WeightType wt, size_t N, float* y,
                    size_t ldy, int threads, const void* scales);
// x (M, K) rounded per block of 32 along a row (G = ceil(K / 32) blocks, the tail padded with zeros):
// codes xq (M, 32 G) in [-127, 127], scales d (M, G), code sums xsum (M, G) (qdot.cpp says how).
void quantize_rows_q8(const float* x, size_t M, size_t K, int8_t* xq, float* d, int32_t* xsum);

// Which instruction set the kernels use on this CPU: "avx512_bf16" (the bf16-activation mode is on and runs:
// BF16 products on vdpbf16ps, the rest as under "avx512_vnni" or "avx512"), "avx512_vnni" (AVX-512 with VNNI: the
// integer products of I8Q8 and I4Q8 use vpdpbusd, the rest the AVX-512 code), "avx512", "avx2" or "scalar".
const char* linear_isa();

// Use the scalar kernels even where AVX2 is available (for tests holding both to the same reference).
void linear_force_scalar(bool on);

// Use at most AVX2 even where AVX-512 is available (tests: every instruction set held to the reference).
void linear_force_avx2(bool on);

// Use at most AVX-512F (no VNNI) even where AVX-512 VNNI is available (tests, as above).
void linear_force_avx512(bool on);

// Opt-in numerics for BF16 weights (off: the products above, unchanged): each row of x is rounded to bf16 (to
// nearest even) and the products summed in fp32 by vdpbf16ps, in the order k = 1, 0, 3, 2, .. (tiles.inc says
// exactly), subnormal bf16 inputs and fp32 partial sums flushed to zero. Runs only where the CPU has AVX-512 BF16
// and no force switch is on (linear_isa() then says "avx512_bf16"); elsewhere BF16 products stay as they are.
void linear_bf16_activations(bool on);

// ---------------------------------------------------------------------------------------------------
// A whole decode step (step.cpp). The pointers are borrowed: the caller keeps the arrays alive and unchanged.

// One packed matrix W (N, K), as linear_rows reads it.
struct PackedMatrix {
    const void* w = nullptr;
    WeightType wt = WeightType::F32;
    size_t N = 0, K = 0;
    const void* scales = nullptr;  // I8, I8Q8: N floats; I4, I4Q8: ceil(N / 8) * ceil(K / 32) * 8 fp16 (uint16)
};

// One pre-norm block: x += out(attention(rope(qkv(rms(x) * ln1)))); x += down(swiglu(up(rms(x) * ln2))),
// with qkv the fused [q | k | v] projections ((H + 2 Hkv) D rows) and up the fused [w1 | w3] (2F rows).
struct DecodeLayer {
    const float* ln1 = nullptr;
    PackedMatrix qkv, out;
    const float* ln2 = nullptr;
    PackedMatrix up, down;
};

struct DecodeModel {
    size_t C = 0, H = 0, Hkv = 0, D = 0, F = 0;  // d_model, heads, kv heads, head dim, d_ff
    float eps = 1e-5f;
    const float* embed = nullptr;  // (vocab, C) token embeddings, float32
    size_t vocab = 0;
    std::vector<DecodeLayer> layers;
    const float* ln_final = nullptr;  // (C,)
    PackedMatrix head;                // (V, C): the logits
    const float *cos = nullptr, *sin = nullptr;  // RoPE tables (positions, D / 2)
    size_t positions = 0;
};

// T tokens per row for rows b < B: logits (B, head.N) of the token after the last of row b's tokens
// tokens[b * T .. b * T + T - 1], which go to cache columns lengths[b] .. lengths[b] + T - 1 (their RoPE
// positions) of cache row first + b. k and v are the model's whole cache (layers, rows, Hkv, S, D) with
// first + B <= rows; the new keys and values are written there and lengths[b] += T. T = 1 is a decode step;
// T > 1 a prompt (prefill), whose T tokens go through the products as T rows: weights are read once for all
// of them. Runs the same kernels, in the same order, as the per-operation calls above (embedding, then per
// layer: rms_norm_rows, linear_rows, rope_cache_rows, attend_rows, linear_rows and the residual add,
// rms_norm_rows, linear_rows, swiglu_rows, linear_rows and the add; then the final norm and the head on each
// row's last token). In the last layer a prompt's tokens stop after writing their keys and values: only each
// row's last token, the one whose logits are returned, goes on through attention, projections and MLP (at
// d512 x 4 layers a fifth of a 256-token prompt's products). Every kernel is batch invariant, so a token's
// numbers are the same bits whether it comes in a prompt of T or in a step, and whatever the other rows are.
// all: every token goes on through the last layer and the head, and logits is (B * T, head_n), row b * T + t the
// logits after row b's token t (checking drafted tokens in one call: the same bits as T single steps).
// The caller checks the shapes, token ids (< vocab) and lengths (lengths[b] + T <= S and <= positions).
void decode_step(const DecodeModel& m, const int64_t* tokens, size_t B, size_t T, float* k, float* v, size_t rows,
                 size_t first, size_t S, int64_t* lengths, float* logits, int threads, bool all = false);

}  // namespace lmforge
