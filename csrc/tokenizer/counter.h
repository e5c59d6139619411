// PretokenCounter: counts unique pre-tokens of a stream of text, in parallel, with bounded memory
// (Python: lmforge.tokenizer.training, the input of BPE training).
#pragma once
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "forksafe.h"
#include "tokenizer/hash.h"
#include "tokenizer/pretokenize.h"

namespace lmforge {

class PretokenCounter {
public:
    // pattern: kGPT2 / kGPT4 / kNanochat, or kCustom (then only add_counts may be used).
    PretokenCounter(int pattern, std::vector<std::string> special_tokens);

    // Split `data` on special tokens, pre-tokenize and count (GIL must be released by the caller).
    // Throws std::invalid_argument for invalid UTF-8 or a bad thread count.
    void add(const uint8_t* data, size_t n, int num_threads);
    // Add counts of already pre-tokenized words (custom patterns).
    void add_counts(const std::vector<std::string>& words, const std::vector<int64_t>& counts);

    size_t size() const { std::lock_guard<ForkSafeMutex> lock(mu_); return map_.size(); }
    int64_t total() const { std::lock_guard<ForkSafeMutex> lock(mu_); return total_; }
    int pattern() const { return pattern_; }
    // Calls f(ptr, len, count) for every unique pre-token (under the lock: an add() running on
    // another Python thread, with the GIL released, cannot change the table meanwhile).
    template <class F>
    void for_each(F&& f) const {
        std::lock_guard<ForkSafeMutex> lock(mu_);
        for (const auto& e : map_.slots())
            if (e.ptr) f(e.ptr, e.len, e.count);
    }

private:
    void merge_into_table(const ChunkCountMap& local);
    int pattern_;
    SpecialSplitter specials_;
    StrCountMap map_;  // keys live in arena_
    Arena arena_;
    int64_t total_ = 0;
    mutable ForkSafeMutex mu_;  // one add() at a time; readers wait for it; fork() waits for an add()
};

}  // namespace lmforge
