// The process-wide instance of the decode kernels' thread pool (class in pool.h).
#include "decode/pool.h"

#include <pthread.h>

#include <memory>

namespace lmforge {

ForkSafeMutex g_pool_mu;

namespace {
// The pool lives for the process. After fork() the child has none of the parent's threads, so the
// parent's pool object is abandoned there (not destroyed: its threads cannot be joined) and a new one
// is made on first use.
Pool* g_pool = nullptr;
std::once_flag g_atfork_once;
}  // namespace

Pool* pool_of(int threads) {
    std::call_once(g_atfork_once, [] { pthread_atfork(nullptr, nullptr, [] { g_pool = nullptr; }); });
    if (g_pool == nullptr || g_pool->size() != threads) {
        delete g_pool;
        g_pool = new Pool(threads - 1);
    }
    return g_pool;
}

namespace {
// One job of pool_selfcheck: how often each chunk ran, and runs of a chunk the job does not have.
struct CheckJob {
    uint32_t chunks = 0;
    std::atomic<uint32_t> runs[kSelfcheckMaxChunks];
    std::atomic<uint32_t> stray{0};
};

void check_chunk(void* ctx, uint32_t c) {
    auto* j = static_cast<CheckJob*>(ctx);
    if (c < j->chunks)
        j->runs[c].fetch_add(1, std::memory_order_relaxed);
    else
        j->stray.fetch_add(1, std::memory_order_relaxed);
}
}  // namespace

uint64_t pool_selfcheck(uint64_t jobs, int threads) {
    // Jobs back to back with chunk counts that rise and fall (1, 2, ..., 16, 1, ...): a claim that reads
    // the next job's count against the last job's ticket shows up as a chunk run twice or out of range.
    // The jobs' records live in a ring, so a late stray run lands in a record that is checked again.
    constexpr size_t kRing = 64;
    auto ring = std::make_unique<CheckJob[]>(kRing);
    uint64_t wrong = 0;
    std::lock_guard<ForkSafeMutex> lk(g_pool_mu);
    Pool* pool = pool_of(threads);
    for (uint64_t i = 0; i < jobs; ++i) {
        CheckJob& j = ring[i % kRing];
        j.chunks = 1 + (uint32_t)(i % kSelfcheckMaxChunks);
        pool->run(check_chunk, &j, j.chunks);
        for (uint32_t c = 0; c < j.chunks; ++c) wrong += j.runs[c].exchange(0, std::memory_order_relaxed) != 1;
        wrong += j.stray.exchange(0, std::memory_order_relaxed);
    }
    return wrong;
}

}  // namespace lmforge
