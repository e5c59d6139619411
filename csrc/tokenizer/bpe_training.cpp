// BPE training (Python: lmforge.tokenizer.training.train_bpe), incremental: pair counts + pair -> words
// index + a max-heap with lazy invalidation.
//
// Each merge touches only the words that contain the merged pair; within a word only the pairs
// that overlap a merged position change, so the update is local and exact. Heap entries are
// (count, pair); an entry whose count differs from the pair's current count is stale. Increases
// push a fresh entry; decreases are found lazily when the stale (higher) entry is popped.
//
// The pair -> words index lives in one pool of fixed-size chunks (a singly linked list per pair,
// chunks of merged pairs recycled): no allocation per pair, no vector regrowth.
#include "tokenizer/bpe_training.h"

#include <algorithm>
#include <stdexcept>
#include <unordered_map>

namespace lmforge {

namespace {

inline uint64_t pair_key(uint32_t a, uint32_t b) { return ((uint64_t)a << 32) | b; }

constexpr uint32_t kNone = ~0u;

struct PairInfo {
    uint32_t a = 0, b = 0;
    int32_t touched = -1;                // last merge step that increased the count (dedupes heap pushes)
    uint32_t head = kNone, tail = kNone;  // chunk list of the words that contain (or once contained) it
    uint32_t fill = 0;                    // words in the tail chunk
};

// A piece of a pair's word list: up to 7 word ids, then the next chunk (32 bytes, half a cache line).
struct Chunk {
    static constexpr uint32_t kCap = 7;
    uint32_t w[kCap];
    uint32_t next;
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
        // A pair's count is a sum of word counts, one per occurrence, and merges only remove occurrences: if
        // the sum of count x (len - 1) over the words fits int64, no pair count can overflow.
        int64_t pairs_total = 0;
        counter.for_each([&](const uint8_t* p, uint32_t len, int64_t count) {
            if (len < 2 || count <= 0) return;  // no pairs in a single byte
            int64_t occ;
            if (__builtin_mul_overflow(count, (int64_t)len - 1, &occ) ||
                __builtin_add_overflow(pairs_total, occ, &pairs_total))
                throw std::invalid_argument("train_bpe: the pair counts (count x pairs of each pre-token, summed) "
                                            "exceed 2**63 - 1; scale the counts down");
            words_.push_back({(uint64_t)syms_.size(), len, count});
            for (uint32_t k = 0; k < len; ++k) syms_.push_back(p[k]);
        });
        pool_.reserve(syms_.size() / Chunk::kCap + 1024);  // about one entry per symbol, at first
        for (uint32_t w = 0; w < words_.size(); ++w) {
            const uint32_t* s = &syms_[words_[w].off];
            for (uint32_t k = 0; k + 1 < words_[w].len; ++k) {
                uint32_t id = pair_id(s[k], s[k + 1]);
                count_[id] += words_[w].count;
                add_word(id, w);
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
            merge(top.pair, (int32_t)merges.size());
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

    // Append word w to pair id's list (unless it is already the last entry: one word adds a pair
    // several times in a row).
    void add_word(uint32_t id, uint32_t w) {
        PairInfo& pi = pairs_[id];
        if (pi.tail != kNone) {
            Chunk& c = pool_[pi.tail];
            if (c.w[pi.fill - 1] == w) return;
            if (pi.fill < Chunk::kCap) {
                c.w[pi.fill++] = w;
                return;
            }
        }
        uint32_t nc;
        if (free_ != kNone) {
            nc = free_;
            free_ = pool_[nc].next;
        } else {
            nc = (uint32_t)pool_.size();
            pool_.emplace_back();
        }
        pool_[nc].w[0] = w;
        pool_[nc].next = kNone;
        if (pi.tail == kNone) pi.head = nc;
        else pool_[pi.tail].next = nc;
        pi.tail = nc;
        pi.fill = 1;
    }

    // Move pair id's word list into out and recycle its chunks.
    void take_words(uint32_t id, std::vector<uint32_t>& out) {
        out.clear();
        PairInfo& pi = pairs_[id];
        for (uint32_t c = pi.head; c != kNone;) {
            const Chunk& ch = pool_[c];
            const uint32_t n = c == pi.tail ? pi.fill : Chunk::kCap;
            out.insert(out.end(), ch.w, ch.w + n);
            const uint32_t next = ch.next;
            pool_[c].next = free_;
            free_ = c;
            c = next;
        }
        pi.head = pi.tail = kNone;
        pi.fill = 0;
    }

    void dec(uint32_t x, uint32_t y, int64_t cnt) { count_[*pair_index_.find(pair_key(x, y))] -= cnt; }

    void inc(uint32_t x, uint32_t y, int64_t cnt, uint32_t w, int32_t step) {
        const uint32_t id = pair_id(x, y);  // may grow pairs_: no references kept across it
        count_[id] += cnt;
        add_word(id, w);
        if (pairs_[id].touched != step) {
            pairs_[id].touched = step;
            increased_.push_back(id);
        }
    }

    // Merge every non-overlapping (a, b), left to right, in every word that has it, in one pass per
    // word. The pairs that change are those that touch a merged position: in the old word, (x, a)
    // left of an occurrence (unless x ended the previous occurrence) and (b, y) right of it; in the
    // new word, every pair next to a new symbol m, once. (a, b) itself ends at count 0.
    void merge(uint32_t pidx, int32_t step) {
        const uint32_t a = pairs_[pidx].a, b = pairs_[pidx].b;
        const uint32_t m = token_for(tok_[a] + tok_[b]);
        take_words(pidx, visit_);
        increased_.clear();
        const size_t nw = visit_.size();
        for (size_t wi = 0; wi < nw; ++wi) {
            // The loop is bound by cache misses on words_ and syms_ (random words): fetch ahead, the word
            // record 16 words ahead and its symbols 8 ahead (that record was fetched 8 iterations ago).
            if (wi + 16 < nw) __builtin_prefetch(&words_[visit_[wi + 16]]);
            if (wi + 8 < nw) __builtin_prefetch(&syms_[words_[visit_[wi + 8]].off]);
            const uint32_t w = visit_[wi];
            Word& word = words_[w];
            uint32_t* s = &syms_[word.off];
            const uint32_t L = word.len;
            const int64_t cnt = word.count;
            // In place: k (write) <= i (read), so s[i - 1] and s[i + 2] still hold old symbols when read.
            uint32_t k = 0;
            bool prev_merged = false;  // the last symbol written is m (old position i - 1 was merged)
            for (uint32_t i = 0; i < L;) {
                const uint32_t x = s[i];
                if (x == a && i + 1 < L && s[i + 1] == b) {
                    if (i > 0 && !prev_merged) dec(s[i - 1], a, cnt);
                    if (i + 2 < L) dec(b, s[i + 2], cnt);
                    if (k > 0) inc(s[k - 1], m, cnt, w, step);
                    s[k++] = m;
                    prev_merged = true;
                    i += 2;
                } else {
                    if (prev_merged) inc(m, x, cnt, w, step);
                    s[k++] = x;
                    prev_merged = false;
                    ++i;
                }
            }
            word.len = k;  // unchanged when the pair is gone (a stale index entry)
        }
        count_[pidx] = 0;
        auto c = cmp();
        for (uint32_t p : increased_) {
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
    std::vector<Chunk> pool_;  // the chunks of every pair's word list
    uint32_t free_ = kNone;    // recycled chunks, linked through next
    std::vector<uint32_t> visit_, increased_;  // scratch of merge()
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
