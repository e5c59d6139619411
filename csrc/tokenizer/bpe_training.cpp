// BPE training (Python: lmforge.tokenizer.training.train_bpe), incremental: pair counts + pair -> words
// index + a max-heap with lazy invalidation.
//
// Each merge touches only the words that contain the merged pair; within a word only the pairs
// that overlap a merged position change, so the update is local and exact. Heap entries are
// (count, pair); an entry whose count differs from the pair's current count is stale. Increases
// push a fresh entry; decreases are found lazily when the stale (higher) entry is popped.
#include "tokenizer/bpe_training.h"

#include <algorithm>
#include <stdexcept>
#include <unordered_map>

namespace lmforge {

namespace {

inline uint64_t pair_key(uint32_t a, uint32_t b) { return ((uint64_t)a << 32) | b; }

struct PairInfo {
    uint32_t a = 0, b = 0;
    long long touched = -1;       // last merge step that increased the count (dedupes heap pushes)
    std::vector<uint32_t> words;  // words that contain (or once contained) the pair
};

// A heap entry carries its own tie-break keys (the first 8 bytes of each side, big-endian, zero-padded,
// plus the lengths), so ordering two entries rarely reads the token strings: the heap was memory-latency
// bound on the pairs_ -> tok_ indirections.
struct HeapEntry {
    int64_t count;
    uint64_t ka, kb;     // prefix keys of the left and right token
    uint32_t pair;       // index into pairs
    uint32_t la, lb;     // byte lengths of the left and right token
};

inline uint64_t prefix_key(const std::string& s) {
    uint64_t k = 0;
    const size_t n = std::min<size_t>(s.size(), 8);
    for (size_t i = 0; i < n; ++i) k |= (uint64_t)(uint8_t)s[i] << (56 - 8 * i);
    return k;
}

// One pre-token: where its symbols start in syms_, how many there are now, and its count (one cache line
// for the fields the merge loop reads together).
struct Word {
    uint64_t off;
    uint32_t len;
    int64_t count;
};

class Trainer {
public:
    explicit Trainer(const PretokenCounter& counter) {
        for (int c = 0; c < 256; ++c) {
            tok_.push_back(std::string(1, (char)c));
            tok_id_.emplace(tok_.back(), c);
        }
        counter.for_each([&](const uint8_t* p, uint32_t len, int64_t count) {
            if (len < 2 || count <= 0) return;  // no pairs in a single byte
            words_.push_back({(uint64_t)syms_.size(), len, count});
            for (uint32_t k = 0; k < len; ++k) syms_.push_back(p[k]);
        });
        for (uint32_t w = 0; w < words_.size(); ++w) {
            const uint32_t* s = &syms_[words_[w].off];
            for (uint32_t k = 0; k + 1 < words_[w].len; ++k) {
                uint32_t id = pair_id(s[k], s[k + 1]);
                count_[id] += words_[w].count;
                std::vector<uint32_t>& ws = pairs_[id].words;
                if (ws.empty() || ws.back() != w) ws.push_back(w);
            }
        }
        for (uint32_t i = 0; i < pairs_.size(); ++i) heap_.push_back(entry(i));
        std::make_heap(heap_.begin(), heap_.end(), cmp());
    }

    std::vector<std::pair<std::string, std::string>> run(long long num_merges,
                                                         const std::function<void(long long)>& progress) {
        std::vector<std::pair<std::string, std::string>> merges;
        auto c = cmp();
        while ((long long)merges.size() < num_merges && !heap_.empty()) {
            std::pop_heap(heap_.begin(), heap_.end(), c);
            HeapEntry top = heap_.back();
            heap_.pop_back();
            const int64_t cur = count_[top.pair];
            if (cur != top.count) {
                // Stale. A lower current count has no entry yet (decreases are lazy): add it.
                if (cur > 0 && cur < top.count) {
                    heap_.push_back(entry(top.pair));
                    std::push_heap(heap_.begin(), heap_.end(), c);
                }
                continue;
            }
            if (cur <= 0) continue;
            merge(top.pair, (long long)merges.size());
            merges.emplace_back(tok_[pairs_[top.pair].a], tok_[pairs_[top.pair].b]);
            if (progress && (merges.size() % 256 == 0)) progress((long long)merges.size());
        }
        if (progress) progress((long long)merges.size());
        return merges;
    }

private:
    // Max-heap order: count, then (left bytes, right bytes) compared like Python bytes tuples.
    struct Cmp {
        const Trainer* t;
        bool operator()(const HeapEntry& x, const HeapEntry& y) const {
            if (x.count != y.count) return x.count < y.count;
            // Keys differ: the first differing byte is within 8 bytes (or the shorter side ran out): exact.
            if (x.ka != y.ka) return x.ka < y.ka;
            if (x.la > 8 || y.la > 8) {
                int c = t->tok_[t->pairs_[x.pair].a].compare(t->tok_[t->pairs_[y.pair].a]);
                if (c != 0) return c < 0;
            } else if (x.la != y.la) {
                return x.la < y.la;  // same first bytes, one is a prefix of the other
            }
            if (x.kb != y.kb) return x.kb < y.kb;
            if (x.lb > 8 || y.lb > 8)
                return t->tok_[t->pairs_[x.pair].b].compare(t->tok_[t->pairs_[y.pair].b]) < 0;
            return x.lb < y.lb;
        }
    };
    HeapEntry entry(uint32_t p) const {
        const std::string& a = tok_[pairs_[p].a];
        const std::string& b = tok_[pairs_[p].b];
        return {count_[p], prefix_key(a), prefix_key(b), p, (uint32_t)a.size(), (uint32_t)b.size()};
    }
    Cmp cmp() const { return Cmp{this}; }

    // Index of the pair (a, b) in pairs_ / count_, created with count 0 if new.
    uint32_t pair_id(uint32_t a, uint32_t b) {
        bool inserted;
        uint64_t idx = pair_index_.get_or_insert(pair_key(a, b), pairs_.size(), &inserted);
        if (inserted) {
            pairs_.emplace_back();
            pairs_.back().a = a;
            pairs_.back().b = b;
            count_.push_back(0);
        }
        return (uint32_t)idx;
    }

    uint32_t token_for(const std::string& bytes) {
        auto it = tok_id_.find(bytes);
        if (it != tok_id_.end()) return it->second;  // same bytes = same token (like the reference)
        uint32_t id = (uint32_t)tok_.size();
        tok_.push_back(bytes);
        tok_id_.emplace(bytes, id);
        return id;
    }

    void merge(uint32_t pidx, long long step) {
        const uint32_t a = pairs_[pidx].a, b = pairs_[pidx].b;
        const uint32_t m = token_for(tok_[a] + tok_[b]);
        std::vector<uint32_t> words;
        words.swap(pairs_[pidx].words);
        std::vector<uint32_t> increased;
        const size_t nw = words.size();
        for (size_t wi = 0; wi < nw; ++wi) {
            // The loop is bound by cache misses on words_ and syms_ (random words): fetch ahead, the word
            // record 16 words ahead and its symbols 8 ahead (that record was fetched 8 iterations ago).
            if (wi + 16 < nw) __builtin_prefetch(&words_[words[wi + 16]]);
            if (wi + 8 < nw) __builtin_prefetch(&syms_[words_[words[wi + 8]].off]);
            const uint32_t w = words[wi];
            Word& word = words_[w];
            uint32_t* s = &syms_[word.off];
            const uint32_t L = word.len;
            const int64_t cnt = word.count;
            // Find non-overlapping occurrences, left to right.
            covered_.assign(L, 0);
            bool any = false;
            for (uint32_t i = 0; i + 1 < L;) {
                if (s[i] == a && s[i + 1] == b) {
                    covered_[i] = covered_[i + 1] = 1;
                    any = true;
                    i += 2;
                } else {
                    ++i;
                }
            }
            if (!any) continue;  // stale index entry
            for (uint32_t j = 0; j + 1 < L; ++j)
                if (covered_[j] || covered_[j + 1]) count_[*pair_index_.find(pair_key(s[j], s[j + 1]))] -= cnt;
            // Rewrite in place; produced_[k] marks new symbols made by this merge.
            produced_.assign(L, 0);
            uint32_t k = 0;
            for (uint32_t i = 0; i < L;) {
                if (i + 1 < L && covered_[i] && s[i] == a && s[i + 1] == b && covered_[i + 1]) {
                    s[k] = m;
                    produced_[k++] = 1;
                    i += 2;
                } else {
                    s[k++] = s[i++];
                }
            }
            word.len = k;
            for (uint32_t j = 0; j + 1 < k; ++j) {
                if (!produced_[j] && !produced_[j + 1]) continue;
                const uint32_t id = pair_id(s[j], s[j + 1]);  // may grow pairs_: no references kept
                count_[id] += cnt;
                PairInfo& pi = pairs_[id];
                if (pi.words.empty() || pi.words.back() != w) pi.words.push_back(w);
                if (pi.touched != step) {
                    pi.touched = step;
                    increased.push_back(id);
                }
            }
        }
        count_[pidx] = 0;
        pairs_[pidx].words.shrink_to_fit();
        auto c = cmp();
        for (uint32_t p : increased) {
            if (count_[p] <= 0) continue;
            heap_.push_back(entry(p));
            std::push_heap(heap_.begin(), heap_.end(), c);
        }
    }

    std::vector<std::string> tok_;
    std::unordered_map<std::string, uint32_t> tok_id_;
    std::vector<uint32_t> syms_;
    std::vector<Word> words_;
    U64Map pair_index_;
    std::vector<PairInfo> pairs_;
    std::vector<int64_t> count_;  // count_[i]: current count of pairs_[i] (dense: the hot field)
    std::vector<HeapEntry> heap_;
    std::vector<uint8_t> covered_, produced_;
};

}  // namespace

std::vector<std::pair<std::string, std::string>> train_bpe(const PretokenCounter& counter, long long num_merges,
                                                           const std::function<void(long long)>& progress) {
    if (num_merges < 0)
        throw std::invalid_argument("num_merges must be >= 0, got " + std::to_string(num_merges));
    Trainer t(counter);
    return t.run(num_merges, progress);
}

}  // namespace lmforge
