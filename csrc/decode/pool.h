// The decode kernels' thread pool (used by products.cpp and attention.cpp; Python: lmforge.generate.engine).
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#include "decode/simd.h"
#include "forksafe.h"

namespace lmforge {

// A small persistent thread pool. A decode step (step.cpp) runs ~20 products and attentions on it per
// token, tens to hundreds of microseconds each, so starting threads per call would cost a large share. Work is split in chunks
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
            stop_.store(true);
            wake_.fetch_add(1);
        }
        cv_.notify_all();
        for (auto& t : workers_) t.join();
    }
    int size() const { return (int)workers_.size() + 1; }

    // Run fn(ctx, c) for every chunk c in [0, chunks), on the caller and the workers; returns when all ran.
    void run(void (*fn)(void*, uint32_t), void* ctx, uint32_t chunks) {
        if (chunks > kMaxChunks) {  // more than a ticket holds (callers make about 8 per thread): the caller alone
            for (uint32_t c = 0; c < chunks; ++c) fn(ctx, c);
            return;
        }
        fn_.store(fn, std::memory_order_relaxed);
        ctx_.store(ctx, std::memory_order_relaxed);
        done_.store(0, std::memory_order_relaxed);
        const uint64_t job = ++job_;
        ticket_.store(job << 32 | (uint64_t)chunks << 16, std::memory_order_release);  // publishes the fields above
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

    // Claim and run chunks of job `job` until none is left (or a newer job has replaced it). A claim is one
    // compare-and-swap on the ticket, which holds the job, its chunk count and the next chunk: the count a
    // claim is checked against is always its own job's. (With the count in a separate atomic, a worker
    // holding the last job's spent ticket could read the next job's larger count while the caller was
    // between the two stores, claim a chunk that job never had, and count it done in the next job: a
    // double run, a wrong result, or a caller waiting forever for a count it had passed.)
    void work(uint64_t job) {
        uint64_t t = ticket_.load(std::memory_order_acquire);
        for (;;) {
            if ((t >> 32) != job || (t & kMaxChunks) >= (t >> 16 & kMaxChunks)) return;
            // A successful claim means the job is still current: the caller waits for this chunk, so
            // the job's fields stay valid until done_ counts it.
            if (ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel, std::memory_order_acquire)) {
                fn_.load(std::memory_order_relaxed)(ctx_.load(std::memory_order_relaxed), (uint32_t)(t & kMaxChunks));
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
            if (stop_.load()) return;
            work(ticket_.load(std::memory_order_acquire) >> 32);
        }
    }

    // Decode steps call the kernel every few tens of microseconds; spinning (politely, see loop()) through
    // those gaps saves a sleep and wake-up per call, and 0.5 ms of spinning after the last call costs little.
    static constexpr int kSpinMicros = 500;
    static constexpr uint32_t kMaxChunks = 0xFFFF;  // the ticket's 16-bit fields: the count and the next chunk
    std::vector<std::thread> workers_;
    std::atomic<uint64_t> wake_{0};    // bumped once per job: wakes the workers
    std::atomic<uint64_t> ticket_{0};  // job << 32 | chunks << 16 | next chunk to claim
    std::atomic<uint32_t> done_{0};    // chunks of the current job that have run
    std::atomic<void (*)(void*, uint32_t)> fn_{nullptr};
    std::atomic<void*> ctx_{nullptr};
    uint64_t job_ = 0;  // caller only
    std::atomic<int> sleepers_{0};
    std::mutex mu_;
    std::condition_variable cv_;
    std::atomic<bool> stop_{false};  // set before the wake-up that ends the workers, read by them (atomic: TSan)
};

// The process's pool with `threads` threads counting the caller (made or remade to that size). Callers
// hold g_pool_mu around it and the job they run on it: one job in the pool at a time.
Pool* pool_of(int threads);
extern ForkSafeMutex g_pool_mu;  // fork() waits for the job that holds it (forksafe.h)

// Runs `jobs` tiny jobs back to back on pool_of(threads) and returns how many chunks ran other than
// exactly once (for tests: a race between jobs shows here, or as a hang).
constexpr uint32_t kSelfcheckMaxChunks = 16;
uint64_t pool_selfcheck(uint64_t jobs, int threads);

}  // namespace lmforge
