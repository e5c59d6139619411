// The registry of live ForkSafeMutexes and the pthread_atfork handlers that take and release them all.
#include "forksafe.h"

#include <pthread.h>

namespace lmforge {

struct ForkRegistry {
    std::mutex mu;  // guards the list; held from prepare to parent/child, so none is added or removed meanwhile
    ForkSafeMutex* head = nullptr;

    static ForkRegistry& get() {
        static ForkRegistry* r = [] {  // never destroyed: mutexes of other objects may outlive static destruction
            auto* reg = new ForkRegistry();
            pthread_atfork(prepare, release, release);
            return reg;
        }();
        return *r;
    }
    static void prepare() {
        ForkRegistry& r = get();
        r.mu.lock();
        for (ForkSafeMutex* m = r.head; m; m = m->next_) m->mu_.lock();
    }
    // Parent and child alike: the forking thread holds every lock, and in the child it is the only thread.
    static void release() {
        ForkRegistry& r = get();
        for (ForkSafeMutex* m = r.head; m; m = m->next_) m->mu_.unlock();
        r.mu.unlock();
    }
};

ForkSafeMutex::ForkSafeMutex() {
    ForkRegistry& r = ForkRegistry::get();
    std::lock_guard<std::mutex> lk(r.mu);
    next_ = r.head;
    if (r.head) r.head->prev_ = this;
    r.head = this;
}

ForkSafeMutex::~ForkSafeMutex() {
    ForkRegistry& r = ForkRegistry::get();
    std::lock_guard<std::mutex> lk(r.mu);
    if (prev_) prev_->next_ = next_;
    else r.head = next_;
    if (next_) next_->prev_ = prev_;
}

}  // namespace lmforge
