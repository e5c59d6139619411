// Mutexes that fork() cannot leave locked in the child. fork() copies only the calling thread, so a mutex that
// another thread held at that moment (a kernel running with the GIL released) stays locked in the child for
// good, and the child's first call that takes it hangs. Every ForkSafeMutex is taken by fork's prepare step
// (the fork waits for the holders to finish) and released after it in the parent and in the child.
// Users: the decode kernels' pool lock (decode/pool.h), each Encoder's cache pool and each PretokenCounter.
// Rule that keeps the prepare step from deadlocking: never wait for another ForkSafeMutex, or for the GIL,
// while holding one.
#pragma once
#include <mutex>

namespace lmforge {

class ForkSafeMutex {
public:
    ForkSafeMutex();  // registers it (and, the first time, the pthread_atfork handlers)
    ~ForkSafeMutex();
    ForkSafeMutex(const ForkSafeMutex&) = delete;
    ForkSafeMutex& operator=(const ForkSafeMutex&) = delete;
    void lock() { mu_.lock(); }
    void unlock() { mu_.unlock(); }
    bool try_lock() { return mu_.try_lock(); }

private:
    friend struct ForkRegistry;
    std::mutex mu_;
    ForkSafeMutex* prev_ = nullptr;  // the registry's doubly linked list of live mutexes
    ForkSafeMutex* next_ = nullptr;
};

}  // namespace lmforge
