// The process-wide instance of the decode kernels' thread pool (class in pool.h).
#include "decode/pool.h"

#include <pthread.h>

namespace lmforge {

std::mutex g_pool_mu;

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

}  // namespace lmforge
