// PretokenCounter: split on specials, cut the input at safe points, count per thread, merge.
#include "tokenizer/counter.h"

#include <stdexcept>
#include <thread>

namespace lmforge {

PretokenCounter::PretokenCounter(int pattern, std::vector<std::string> special_tokens) : pattern_(pattern) {
    if (pattern < kCustom || pattern > kNanochat)
        throw std::invalid_argument("unknown pattern id " + std::to_string(pattern) +
                                    "; use PATTERN_GPT2, PATTERN_GPT4, PATTERN_NANOCHAT or -1 (custom)");
    for (const std::string& t : special_tokens)
        if (t.empty()) throw std::invalid_argument("special tokens must be non-empty; remove the empty one");
    specials_ = SpecialSplitter(std::move(special_tokens), {});
}

namespace {

// Count the pre-tokens of s[a, b) (cut at safe points) into `local`; returns the first invalid
// UTF-8 offset relative to s, or -1.
long long count_range(const uint8_t* s, size_t a, size_t b, int pattern, const SpecialSplitter& sp,
                      ChunkCountMap& local, int64_t& total) {
    long long bad = utf8_error_offset(s + a, b - a);
    if (bad >= 0) return (long long)a + bad;
    auto emit = [&](const uint8_t* p, size_t len) {
        local.add(p, (uint32_t)len);
        ++total;
    };
    split_specials(
        sp, s + a, b - a, [&](const uint8_t* p, size_t len) { pretokenize_piece(pattern, p, len, emit); },
        [](long) {});
    return -1;
}

}  // namespace

void PretokenCounter::merge_into_table(const ChunkCountMap& local) {
    local.for_each([&](const uint8_t* p, uint32_t len, uint32_t count) {
        bool inserted;
        auto* dst = map_.add(p, len, hash_bytes(p, len), count, &inserted);
        if (inserted) dst->ptr = arena_.store(p, len);  // own the key: the input goes away
    });
}

void PretokenCounter::add(const uint8_t* data, size_t n, int num_threads) {
    if (pattern_ == kCustom)
        throw std::invalid_argument("this counter has a custom pattern: pre-tokenize in Python and use add_counts");
    if (num_threads < 1)
        throw std::invalid_argument("num_threads must be >= 1, got " + std::to_string(num_threads));
    if (n >= (size_t(1) << 32))
        throw std::invalid_argument("add() takes at most 4 GiB at a time; feed the data in smaller chunks");
    std::lock_guard<ForkSafeMutex> lock(mu_);
    // Fewer threads for small inputs: below ~256 KiB per thread the thread start-up dominates.
    size_t max_threads = std::min<size_t>(256, std::max<size_t>(1, n / (256 * 1024)));
    size_t T = std::min<size_t>((size_t)num_threads, max_threads);
    std::vector<size_t> cuts{0};
    for (size_t t = 1; t < T; ++t) {
        size_t c = safe_split_point(data, n, std::max(cuts.back(), t * n / T), specials_);
        cuts.push_back(c);
    }
    cuts.push_back(n);
    T = cuts.size() - 1;

    std::vector<ChunkCountMap> locals(T, ChunkCountMap(data));
    std::vector<int64_t> totals(T, 0);
    std::vector<long long> bad(T, -1);
    auto work = [&](size_t t) {
        bad[t] = count_range(data, cuts[t], cuts[t + 1], pattern_, specials_, locals[t], totals[t]);
    };
    if (T == 1) {
        work(0);
    } else {
        std::vector<std::thread> threads;
        for (size_t t = 1; t < T; ++t) threads.emplace_back(work, t);
        work(0);
        for (auto& th : threads) th.join();
    }
    for (size_t t = 0; t < T; ++t)
        if (bad[t] >= 0)
            throw std::invalid_argument("invalid UTF-8 at byte offset " + std::to_string(bad[t]) +
                                        " of the data given to add(); decode/clean the input (e.g. "
                                        "errors='replace') before counting");
    int64_t sum = total_;
    for (size_t t = 0; t < T; ++t)
        if (__builtin_add_overflow(sum, totals[t], &sum))
            throw std::invalid_argument("add: the total count would exceed 2**63 - 1; nothing was added");
    for (size_t t = 0; t < T; ++t) {
        merge_into_table(locals[t]);
        total_ += totals[t];
        locals[t] = ChunkCountMap(data);  // free it now
    }
}

void PretokenCounter::add_counts(const std::vector<std::string>& words, const std::vector<int64_t>& counts) {
    if (words.size() != counts.size())
        throw std::invalid_argument("add_counts: words and counts differ in length (" + std::to_string(words.size()) +
                                    " vs " + std::to_string(counts.size()) + ")");
    std::lock_guard<ForkSafeMutex> lock(mu_);
    int64_t total = total_;  // every entry's count is at most the total: if it fits int64, they all do
    for (size_t k = 0; k < words.size(); ++k) {
        if (counts[k] < 0) throw std::invalid_argument("add_counts: counts must be >= 0");
        if (words[k].empty()) throw std::invalid_argument("add_counts: empty pre-token; drop empty words");
        if (__builtin_add_overflow(total, counts[k], &total))
            throw std::invalid_argument("add_counts: the total count would exceed 2**63 - 1; nothing was added");
    }
    for (size_t k = 0; k < words.size(); ++k) {
        if (counts[k] == 0) continue;
        const uint8_t* p = (const uint8_t*)words[k].data();
        uint32_t len = (uint32_t)words[k].size();
        bool inserted;
        auto* e = map_.add(p, len, hash_bytes(p, len), counts[k], &inserted);
        if (inserted) e->ptr = arena_.store(p, len);
        total_ += counts[k];
    }
}

}  // namespace lmforge
