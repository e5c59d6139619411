// Encoder: text -> token ids with a BPE vocabulary (merge ranks), special tokens and a cache
// (Python: lmforge.tokenizer.tokenizer.Tokenizer, its C++ backend).
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "forksafe.h"
#include "tokenizer/hash.h"
#include "tokenizer/pretokenize.h"

namespace lmforge {

// Pre-token -> ids cache owned by one thread at a time (the Encoder keeps a pool of them).
class EncodeCache {
public:
    EncodeCache() { reset(); }
    // Ids of the cached pre-token (p, n) with hash h, or nullptr; *count = number of ids.
    const uint32_t* find(const uint8_t* p, uint32_t n, uint64_t h, uint32_t* count) const;
    void insert(const uint8_t* p, uint32_t n, uint64_t h, const uint32_t* ids, uint32_t count);

private:
    struct Slot { uint64_t hash; uint32_t koff, klen, ioff, icount; };  // klen == 0: empty
    void reset();
    // Then the cache starts over: ~5 MB per cache at most, enough for the frequent pre-tokens.
    static constexpr size_t kMaxEntries = 1 << 16;
    std::vector<Slot> slots_;
    std::vector<uint8_t> keys_;
    std::vector<uint32_t> ids_;
    size_t mask_ = 0, size_ = 0;
};

// Merging rule: repeatedly merge the adjacent pair of lowest rank, leftmost first (tiktoken's rule).
// For merge lists where every merge's parts are created by earlier merges (GPT-2, tiktoken, anything
// trained by BPE) this equals lmforge.bpe's "merge every occurrence of the best pair" rule.
class Encoder {
public:
    Encoder(std::vector<std::string> vocab, const std::vector<std::pair<int64_t, int64_t>>& merges,
            const std::vector<std::pair<std::string, int64_t>>& special_tokens, int pattern);

    // Encode UTF-8 text (valid UTF-8 assumed: it comes from a Python str). Thread-safe.
    void encode(const uint8_t* s, size_t n, bool allow_special, std::vector<uint32_t>& out) const;
    // Apply the merges to each already pre-tokenized word (custom patterns; no specials).
    void encode_words(const std::vector<std::pair<const uint8_t*, size_t>>& words, std::vector<uint32_t>& out) const;
    // Ids of many documents: each worker thread appends to its own buffer, so there is no
    // allocation per document. ids(i) is document i's span.
    struct Batch {
        std::vector<std::vector<uint32_t>> bufs;  // one per thread
        std::vector<uint32_t> thread;             // per document: which buffer
        std::vector<size_t> start, len;           // per document: span in that buffer
        std::pair<const uint32_t*, size_t> ids(size_t i) const { return {bufs[thread[i]].data() + start[i], len[i]}; }
        size_t total() const {
            size_t t = 0;
            for (const auto& b : bufs) t += b.size();
            return t;
        }
    };
    // Encode many documents on num_threads threads (documents handed out in small groups).
    void encode_batch(const std::vector<std::pair<const uint8_t*, size_t>>& docs, int num_threads,
                      bool allow_special, Batch& out) const;
    // Concatenated bytes of ids; throws std::invalid_argument naming the first out-of-range id.
    std::string decode_bytes(const std::vector<int64_t>& ids) const;

    int pattern() const { return pattern_; }
    size_t vocab_size() const { return vocab_.size(); }

private:
    void encode_with(const uint8_t* s, size_t n, bool allow_special, std::vector<uint32_t>& out,
                     EncodeCache& cache) const;
    void encode_piece(const uint8_t* s, size_t n, std::vector<uint32_t>& out, EncodeCache& cache) const;
    void bpe(const uint8_t* s, size_t n, std::vector<uint32_t>& out) const;
    void bpe_long(const uint8_t* s, size_t n, std::vector<uint32_t>& out) const;
    // (rank << 32 | merged id) for the pair (a, b), or ~0 if the pair is not a merge.
    uint64_t lookup(uint32_t a, uint32_t b) const {
        const uint64_t* v = ranks_.find(((uint64_t)a << 32) | b);
        return v ? *v : ~0ull;
    }
    std::unique_ptr<EncodeCache> acquire_cache() const;
    void release_cache(std::unique_ptr<EncodeCache> c) const;

    std::vector<std::string> vocab_;
    std::unordered_map<uint32_t, std::string> special_bytes_;  // special ids beyond the vocab
    uint32_t byte_id_[256];
    U64Map ranks_;
    SpecialSplitter specials_;
    int pattern_;
    mutable ForkSafeMutex pool_mu_;  // a fork() mid-encode leaves it unlocked in the child (forksafe.h)
    mutable std::vector<std::unique_ptr<EncodeCache>> pool_;
};

}  // namespace lmforge
