// Encoder: pre-tokenize, then apply merges by rank to each pre-token (cached), on C++ threads.
#include "tokenizer/encoder.h"

#include <algorithm>
#include <atomic>
#include <stdexcept>
#include <thread>
#include <unordered_map>

namespace lmforge {

namespace {
constexpr uint64_t kNone = ~0ull;
constexpr size_t kShortWord = 96;       // simple O(n^2) scan below this many bytes, heap above
constexpr uint32_t kMaxCachedLen = 128;  // longer pre-tokens are rare and not cached
constexpr size_t kMaxThreads = 256;      // a typo like num_threads=10**6 must not spawn a million threads
}  // namespace

// ----------------------------------------------------------------------------------------------
// EncodeCache
// ----------------------------------------------------------------------------------------------
void EncodeCache::reset() {
    slots_.assign(1 << 12, Slot{0, 0, 0, 0, 0});
    keys_.clear();
    ids_.clear();
    mask_ = slots_.size() - 1;
    size_ = 0;
}

const uint32_t* EncodeCache::find(const uint8_t* p, uint32_t n, uint64_t h, uint32_t* count) const {
    size_t i = h & mask_;
    while (true) {
        const Slot& s = slots_[i];
        if (s.klen == 0) return nullptr;
        if (s.hash == h && s.klen == n && bytes_equal(keys_.data() + s.koff, p, n)) {
            *count = s.icount;
            return ids_.data() + s.ioff;
        }
        i = (i + 1) & mask_;
    }
}

void EncodeCache::insert(const uint8_t* p, uint32_t n, uint64_t h, const uint32_t* ids, uint32_t count) {
    if (size_ >= kMaxEntries) reset();  // bounded memory: start over (rare)
    if ((size_ + 1) * 2 > slots_.size())
        grow_table(slots_, mask_, Slot{0, 0, 0, 0, 0}, [](const Slot& s) { return s.klen != 0; });
    size_t i = h & mask_;
    while (slots_[i].klen) i = (i + 1) & mask_;
    slots_[i] = Slot{h, (uint32_t)keys_.size(), n, (uint32_t)ids_.size(), count};
    keys_.insert(keys_.end(), p, p + n);
    ids_.insert(ids_.end(), ids, ids + count);
    ++size_;
}

// ----------------------------------------------------------------------------------------------
// Encoder
// ----------------------------------------------------------------------------------------------
Encoder::Encoder(std::vector<std::string> vocab, const std::vector<std::pair<int64_t, int64_t>>& merges,
                 const std::vector<std::pair<std::string, int64_t>>& special_tokens, int pattern)
    : vocab_(std::move(vocab)), ranks_(merges.size()), pattern_(pattern) {
    if (pattern < kCustom || pattern > kNanochat)
        throw std::invalid_argument("unknown pattern id " + std::to_string(pattern) +
                                    "; use PATTERN_GPT2, PATTERN_GPT4, PATTERN_NANOCHAT or -1 (custom)");
    if (vocab_.size() >= (size_t(1) << 32) - 1) throw std::invalid_argument("vocabulary too large (>= 2^32 tokens)");
    std::vector<std::string> stoks;
    std::vector<uint32_t> sids;
    std::unordered_map<uint32_t, bool> is_special;
    for (const auto& [text, id] : special_tokens) {
        if (text.empty()) throw std::invalid_argument("special tokens must be non-empty strings");
        if (id < 0 || id >= (int64_t)UINT32_MAX)
            throw std::invalid_argument("special token id " + std::to_string(id) + " is out of range");
        stoks.push_back(text);
        sids.push_back((uint32_t)id);
        is_special[(uint32_t)id] = true;
        if ((size_t)id >= vocab_.size()) special_bytes_[(uint32_t)id] = text;
        else if (vocab_[id] != text)
            throw std::invalid_argument("special token '" + text + "' has id " + std::to_string(id) +
                                        " but that vocabulary entry holds other bytes; give the id of the "
                                        "token's own entry (or an id past the vocabulary)");
    }
    specials_ = SpecialSplitter(std::move(stoks), std::move(sids));
    // Bytes -> id for ordinary tokens; the lowest id wins (as in the Python reference).
    std::unordered_map<std::string, uint32_t> to_id;
    to_id.reserve(vocab_.size() * 2);
    for (size_t i = 0; i < vocab_.size(); ++i)
        if (!is_special.count((uint32_t)i)) to_id.emplace(vocab_[i], (uint32_t)i);
    for (int b = 0; b < 256; ++b) {
        auto it = to_id.find(std::string(1, (char)b));
        if (it == to_id.end())
            throw std::invalid_argument("the vocabulary has no token for byte " + std::to_string(b) +
                                        "; a byte-level BPE vocabulary must contain all 256 single bytes");
        byte_id_[b] = it->second;
    }
    for (size_t r = 0; r < merges.size(); ++r) {
        auto [l, rt] = merges[r];
        if (l < 0 || rt < 0 || (size_t)l >= vocab_.size() || (size_t)rt >= vocab_.size())
            throw std::invalid_argument("merge " + std::to_string(r) + " (" + std::to_string(l) + ", " +
                                        std::to_string(rt) + ") refers to an id outside the vocabulary of " +
                                        std::to_string(vocab_.size()) + " tokens");
        auto it = to_id.find(vocab_[l] + vocab_[rt]);
        if (it == to_id.end())
            throw std::invalid_argument("merge " + std::to_string(r) + " (" + std::to_string(l) + ", " +
                                        std::to_string(rt) + ") makes a token that is not in the vocabulary; "
                                        "vocab and merges do not belong together");
        // A repeated pair keeps its last rank, like {pair: rank for rank, pair in enumerate(merges)}.
        ranks_.get_or_insert(((uint64_t)l << 32) | (uint64_t)rt, 0) = ((uint64_t)r << 32) | it->second;
    }
}

std::unique_ptr<EncodeCache> Encoder::acquire_cache() const {
    std::lock_guard<ForkSafeMutex> lock(pool_mu_);
    if (pool_.empty()) return std::make_unique<EncodeCache>();
    auto c = std::move(pool_.back());
    pool_.pop_back();
    return c;
}

void Encoder::release_cache(std::unique_ptr<EncodeCache> c) const {
    std::lock_guard<ForkSafeMutex> lock(pool_mu_);
    if (pool_.size() < 8) pool_.push_back(std::move(c));  // bounded: idle caches are kept, not hoarded
}

// Merge the lowest-rank adjacent pair (leftmost on ties) until no pair is a merge.
void Encoder::bpe(const uint8_t* s, size_t n, std::vector<uint32_t>& out) const {
    if (n > kShortWord) { bpe_long(s, n, out); return; }
    uint32_t sym[kShortWord];
    uint64_t rk[kShortWord];  // rk[i]: (rank << 32 | merged id) of the pair (sym[i], sym[i+1])
    size_t m = n;
    for (size_t i = 0; i < m; ++i) sym[i] = byte_id_[s[i]];
    for (size_t i = 0; i + 1 < m; ++i) rk[i] = lookup(sym[i], sym[i + 1]);
    while (m > 1) {
        size_t best = 0;
        for (size_t i = 1; i + 1 < m; ++i)
            if (rk[i] < rk[best]) best = i;
        if (rk[best] == kNone) break;
        sym[best] = (uint32_t)rk[best];
        // Drop sym[best + 1] and the merged pair's rank.
        std::memmove(sym + best + 1, sym + best + 2, (m - best - 2) * sizeof(uint32_t));
        if (m >= best + 3) std::memmove(rk + best + 1, rk + best + 2, (m - best - 3) * sizeof(uint64_t));
        --m;
        if (best > 0) rk[best - 1] = lookup(sym[best - 1], sym[best]);
        if (best + 1 < m) rk[best] = lookup(sym[best], sym[best + 1]);
    }
    out.insert(out.end(), sym, sym + m);
}

// O(n log n) version for long pre-tokens: a linked list of symbols and a min-heap of candidate
// merges keyed (rank << 32 | position of the left symbol), validated when popped.
void Encoder::bpe_long(const uint8_t* s, size_t n, std::vector<uint32_t>& out) const {
    constexpr uint32_t kEnd = ~0u, kDead = ~0u;
    std::vector<uint32_t> sym(n), nxt(n), prv(n);
    for (size_t i = 0; i < n; ++i) {
        sym[i] = byte_id_[s[i]];
        nxt[i] = i + 1 < n ? (uint32_t)(i + 1) : kEnd;
        prv[i] = i > 0 ? (uint32_t)(i - 1) : kEnd;
    }
    std::vector<uint64_t> heap;
    for (size_t i = 0; i + 1 < n; ++i) {
        uint64_t r = lookup(sym[i], sym[i + 1]);
        if (r != kNone) heap.push_back((r & ~0xFFFFFFFFull) | i);
    }
    auto gt = std::greater<uint64_t>();
    std::make_heap(heap.begin(), heap.end(), gt);
    auto push = [&](uint32_t pos) {  // candidate for the pair starting at pos, if it is a merge
        uint32_t q = nxt[pos];
        if (q == kEnd) return;
        uint64_t r = lookup(sym[pos], sym[q]);
        if (r == kNone) return;
        heap.push_back((r & ~0xFFFFFFFFull) | pos);
        std::push_heap(heap.begin(), heap.end(), gt);
    };
    while (!heap.empty()) {
        std::pop_heap(heap.begin(), heap.end(), gt);
        uint64_t key = heap.back();
        heap.pop_back();
        uint32_t pos = (uint32_t)key;
        if (sym[pos] == kDead || nxt[pos] == kEnd) continue;
        uint64_t r = lookup(sym[pos], sym[nxt[pos]]);
        if (r == kNone || (r >> 32) != (key >> 32)) continue;  // stale: the pair at pos changed
        uint32_t q = nxt[pos];
        sym[pos] = (uint32_t)r;
        sym[q] = kDead;
        nxt[pos] = nxt[q];
        if (nxt[q] != kEnd) prv[nxt[q]] = pos;
        if (prv[pos] != kEnd) push(prv[pos]);
        push(pos);
    }
    for (uint32_t i = 0; i != kEnd; i = nxt[i]) out.push_back(sym[i]);
}

void Encoder::encode_piece(const uint8_t* s, size_t n, std::vector<uint32_t>& out, EncodeCache& cache) const {
    pretokenize_piece(pattern_, s, n, [&](const uint8_t* p, size_t len) {
        if (len == 1) { out.push_back(byte_id_[*p]); return; }
        if (len > kMaxCachedLen) { bpe(p, len, out); return; }
        uint64_t h = hash_bytes(p, len);
        uint32_t count;
        if (const uint32_t* ids = cache.find(p, (uint32_t)len, h, &count)) {
            out.insert(out.end(), ids, ids + count);
            return;
        }
        size_t before = out.size();
        bpe(p, len, out);
        cache.insert(p, (uint32_t)len, h, out.data() + before, (uint32_t)(out.size() - before));
    });
}

void Encoder::encode_with(const uint8_t* s, size_t n, bool allow_special, std::vector<uint32_t>& out,
                          EncodeCache& cache) const {
    if (allow_special && !specials_.empty()) {
        split_specials(
            specials_, s, n, [&](const uint8_t* p, size_t len) { encode_piece(p, len, out, cache); },
            [&](long k) { out.push_back(specials_.token_id(k)); });
    } else {
        encode_piece(s, n, out, cache);
    }
}

void Encoder::encode(const uint8_t* s, size_t n, bool allow_special, std::vector<uint32_t>& out) const {
    if (pattern_ == kCustom)
        throw std::invalid_argument("this encoder has a custom pattern: pre-tokenize in Python and call encode_words");
    auto cache = acquire_cache();
    encode_with(s, n, allow_special, out, *cache);
    release_cache(std::move(cache));
}

void Encoder::encode_words(const std::vector<std::pair<const uint8_t*, size_t>>& words,
                           std::vector<uint32_t>& out) const {
    auto cache = acquire_cache();
    for (const auto& [p, len] : words) {
        if (len == 0) continue;
        if (len > kMaxCachedLen) { bpe(p, len, out); continue; }
        uint64_t h = hash_bytes(p, len);
        uint32_t count;
        if (const uint32_t* ids = cache->find(p, (uint32_t)len, h, &count)) {
            out.insert(out.end(), ids, ids + count);
            continue;
        }
        size_t before = out.size();
        bpe(p, len, out);
        cache->insert(p, (uint32_t)len, h, out.data() + before, (uint32_t)(out.size() - before));
    }
    release_cache(std::move(cache));
}

void Encoder::encode_batch(const std::vector<std::pair<const uint8_t*, size_t>>& docs, int num_threads,
                           bool allow_special, Batch& out) const {
    if (num_threads < 1) throw std::invalid_argument("num_threads must be >= 1, got " + std::to_string(num_threads));
    if (pattern_ == kCustom)
        throw std::invalid_argument("this encoder has a custom pattern: pre-tokenize in Python and call encode_words");
    constexpr size_t kGroup = 16;  // documents taken per atomic fetch
    const size_t n = docs.size();
    const size_t T = std::max<size_t>(1, std::min<size_t>({(size_t)num_threads, (n + kGroup - 1) / kGroup, kMaxThreads}));
    out.bufs.assign(T, {});
    out.thread.assign(n, 0);
    out.start.assign(n, 0);
    out.len.assign(n, 0);
    std::atomic<size_t> next{0};
    auto work = [&](size_t t) {
        auto cache = acquire_cache();  // one per thread for the whole batch
        std::vector<uint32_t>& buf = out.bufs[t];
        size_t g;
        while ((g = next.fetch_add(kGroup)) < n) {
            for (size_t i = g; i < std::min(n, g + kGroup); ++i) {
                out.thread[i] = (uint32_t)t;
                out.start[i] = buf.size();
                encode_with(docs[i].first, docs[i].second, allow_special, buf, *cache);
                out.len[i] = buf.size() - out.start[i];
            }
        }
        release_cache(std::move(cache));
    };
    if (T == 1) { work(0); return; }
    std::vector<std::thread> threads;
    for (size_t t = 1; t < T; ++t) threads.emplace_back(work, t);
    work(0);
    for (auto& th : threads) th.join();
}

std::string Encoder::decode_bytes(const std::vector<int64_t>& ids) const {
    std::string out;
    for (int64_t id : ids) {
        if (id >= 0 && (uint64_t)id < vocab_.size()) { out += vocab_[id]; continue; }
        auto it = id >= 0 && id < (int64_t)UINT32_MAX ? special_bytes_.find((uint32_t)id) : special_bytes_.end();
        if (it == special_bytes_.end())
            throw std::invalid_argument("token id " + std::to_string(id) + " is out of range: valid ids are 0.." +
                                        std::to_string(vocab_.size() - 1) + " (plus special token ids)");
        out += it->second;
    }
    return out;
}

}  // namespace lmforge
