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

struct HeapEntry {
    int64_t count;
    uint32_t pair;  // index into pairs
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
            woff_.push_back(syms_.size());
            wlen_.push_back(len);
            wcount_.push_back(count);
            for (uint32_t k = 0; k < len; ++k) syms_.push_back(p[k]);
        });
        for (uint32_t w = 0; w < wlen_.size(); ++w) {
            const uint32_t* s = &syms_[woff_[w]];
            for (uint32_t k = 0; k + 1 < wlen_[w]; ++k) {
                uint32_t id = pair_id(s[k], s[k + 1]);
                count_[id] += wcount_[w];
                std::vector<uint32_t>& ws = pairs_[id].words;
                if (ws.empty() || ws.back() != w) ws.push_back(w);
            }
        }
        for (uint32_t i = 0; i < pairs_.size(); ++i) heap_.push_back({count_[i], i});
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
                    heap_.push_back({cur, top.pair});
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
            const PairInfo& px = t->pairs_[x.pair];
            const PairInfo& py = t->pairs_[y.pair];
            int c = t->tok_[px.a].compare(t->tok_[py.a]);
            if (c != 0) return c < 0;
            return t->tok_[px.b].compare(t->tok_[py.b]) < 0;
        }
    };
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
        for (uint32_t w : words) {
            uint32_t* s = &syms_[woff_[w]];
            const uint32_t L = wlen_[w];
            const int64_t cnt = wcount_[w];
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
            wlen_[w] = k;
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
            heap_.push_back({count_[p], p});
            std::push_heap(heap_.begin(), heap_.end(), c);
        }
    }

    std::vector<std::string> tok_;
    std::unordered_map<std::string, uint32_t> tok_id_;
    std::vector<uint32_t> syms_;
    std::vector<uint64_t> woff_;
    std::vector<uint32_t> wlen_;
    std::vector<int64_t> wcount_;
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
