// Hashing and the small open-addressing hash maps used by the counter, the BPE trainer and the encoder
// (tokenizer/ only).
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

namespace lmforge {

inline uint64_t load64(const uint8_t* p) { uint64_t v; std::memcpy(&v, p, 8); return v; }
inline uint64_t load32(const uint8_t* p) { uint32_t v; std::memcpy(&v, p, 4); return v; }

// 64x64 -> 128 bit multiply, folded: the mixing step of wyhash-style hashes.
inline uint64_t mum(uint64_t a, uint64_t b) {
    __uint128_t r = (__uint128_t)a * b;
    return (uint64_t)r ^ (uint64_t)(r >> 64);
}

// Fast hash of a short byte string (pre-tokens are mostly 1-10 bytes); reads no byte outside [p, p+n).
inline uint64_t hash_bytes(const uint8_t* p, size_t n) {
    constexpr uint64_t k0 = 0xa0761d6478bd642full, k1 = 0xe7037ed1a0b428dbull;
    uint64_t a, b, seed = k0;
    if (n <= 16) {
        if (n >= 4) {
            size_t q = (n >> 3) << 2;  // 0 or 4: the two 4-byte reads overlap for n < 8
            a = (load32(p) << 32) | load32(p + q);
            b = (load32(p + n - 4) << 32) | load32(p + n - 4 - q);
        } else if (n > 0) {
            a = ((uint64_t)p[0] << 16) | ((uint64_t)p[n >> 1] << 8) | p[n - 1];
            b = 0;
        } else {
            a = b = 0;
        }
    } else {
        size_t i = n;
        while (i > 16) {
            seed = mum(load64(p) ^ k1, load64(p + 8) ^ seed);
            p += 16;
            i -= 16;
        }
        a = load64(p + i - 16);
        b = load64(p + i - 8);
    }
    return mum(k1 ^ n, mum(a ^ k1, b ^ seed));
}

// Equality of two byte strings of length n, inlined for the short keys that dominate (memcmp's
// call overhead was a quarter of the counting time).
inline bool bytes_equal(const uint8_t* a, const uint8_t* b, size_t n) {
    if (n >= 8) {
        if (n > 16) return std::memcmp(a, b, n) == 0;
        return load64(a) == load64(b) && load64(a + n - 8) == load64(b + n - 8);
    }
    if (n >= 4) return load32(a) == load32(b) && load32(a + n - 4) == load32(b + n - 4);
    for (size_t i = 0; i < n; ++i)
        if (a[i] != b[i]) return false;
    return true;
}

inline uint64_t hash_u64(uint64_t x) { return mum(x ^ 0xa0761d6478bd642full, 0xe7037ed1a0b428dbull); }

// Doubles an open-addressing table (linear probing, power-of-two size): every used slot is
// re-placed by its stored hash. used(slot) tells occupied slots; empty is the blank slot.
template <class Slot, class Used>
inline void grow_table(std::vector<Slot>& slots, size_t& mask, const Slot& empty, Used used) {
    std::vector<Slot> old;
    old.swap(slots);
    slots.assign(old.size() * 2, empty);
    mask = slots.size() - 1;
    for (const Slot& s : old) {
        if (!used(s)) continue;
        size_t i = s.hash & mask;
        while (used(slots[i])) i = (i + 1) & mask;
        slots[i] = s;
    }
}

// Open-addressing map uint64 -> uint64 (linear probing). Key UINT64_MAX is reserved as "empty".
class U64Map {
public:
    static constexpr uint64_t kEmpty = ~0ull;
    explicit U64Map(size_t expected = 16) { rehash(capacity_for(expected)); }

    const uint64_t* find(uint64_t key) const {
        size_t i = hash_u64(key) & mask_;
        while (true) {
            const Slot& s = slots_[i];
            if (s.key == key) return &s.value;
            if (s.key == kEmpty) return nullptr;
            i = (i + 1) & mask_;
        }
    }
    // Value slot for `key`, inserting `init` if absent.
    uint64_t& get_or_insert(uint64_t key, uint64_t init, bool* inserted = nullptr) {
        if ((size_ + 1) * 2 > slots_.size()) rehash(slots_.size() * 2);
        size_t i = hash_u64(key) & mask_;
        while (true) {
            Slot& s = slots_[i];
            if (s.key == key) { if (inserted) *inserted = false; return s.value; }
            if (s.key == kEmpty) {
                s.key = key;
                s.value = init;
                ++size_;
                if (inserted) *inserted = true;
                return s.value;
            }
            i = (i + 1) & mask_;
        }
    }
    size_t size() const { return size_; }

private:
    struct Slot { uint64_t key; uint64_t value; };
    static size_t capacity_for(size_t n) {
        size_t c = 16;
        while (c < n * 2) c <<= 1;
        return c;
    }
    void rehash(size_t cap) {
        std::vector<Slot> old;
        old.swap(slots_);
        slots_.assign(cap, Slot{kEmpty, 0});
        mask_ = cap - 1;
        size_ = 0;
        for (const Slot& s : old)
            if (s.key != kEmpty) get_or_insert(s.key, s.value);
    }
    std::vector<Slot> slots_;
    size_t mask_ = 0, size_ = 0;
};

// Append-only storage for byte strings whose addresses must stay valid (blocks never move).
class Arena {
public:
    const uint8_t* store(const uint8_t* p, size_t n) {
        if (n > kBlock / 4) {  // big strings get their own block
            blocks_.emplace_back(new uint8_t[n]);
            std::memcpy(blocks_.back().get(), p, n);
            bytes_ += n;
            return blocks_.back().get();
        }
        if (blocks_.empty() || used_ + n > kBlock) {
            blocks_.emplace_back(new uint8_t[kBlock]);
            cur_ = blocks_.back().get();
            used_ = 0;
        }
        uint8_t* dst = cur_ + used_;
        std::memcpy(dst, p, n);
        used_ += n;
        bytes_ += n;
        return dst;
    }
    size_t bytes() const { return bytes_; }

private:
    static constexpr size_t kBlock = 1 << 20;
    std::vector<std::unique_ptr<uint8_t[]>> blocks_;
    uint8_t* cur_ = nullptr;
    size_t used_ = 0, bytes_ = 0;
};

// Open-addressing map byte string -> int64 count. Keys are borrowed pointers: the owner decides
// their lifetime (input buffer for per-thread maps, an Arena for the long-lived table).
class StrCountMap {
public:
    struct Entry {
        const uint8_t* ptr;  // nullptr = empty slot
        uint32_t len;
        uint32_t hash;
        int64_t count;
    };
    explicit StrCountMap(size_t cap = 1 << 12) { reset(cap); }

    // Add `count` to key (p, n) with hash h; returns the entry and whether it was new (then
    // entry->ptr == p, so the caller may redirect it to owned storage).
    Entry* add(const uint8_t* p, uint32_t n, uint64_t h, int64_t count, bool* inserted) {
        if ((size_ + 1) * 4 > slots_.size() * 3) grow();  // load factor <= 3/4 (memory matters here)
        uint32_t h32 = (uint32_t)(h >> 32);
        size_t i = h32 & mask_;
        while (true) {
            Entry& e = slots_[i];
            if (e.ptr == nullptr) {
                e = Entry{p, n, h32, count};
                ++size_;
                *inserted = true;
                return &e;
            }
            if (e.hash == h32 && e.len == n && bytes_equal(e.ptr, p, n)) {
                e.count += count;
                *inserted = false;
                return &e;
            }
            i = (i + 1) & mask_;
        }
    }
    size_t size() const { return size_; }
    const std::vector<Entry>& slots() const { return slots_; }

private:
    void reset(size_t cap) {
        slots_.assign(cap, Entry{nullptr, 0, 0, 0});
        slots_.shrink_to_fit();
        mask_ = cap - 1;
        size_ = 0;
    }
    void grow() { grow_table(slots_, mask_, Entry{nullptr, 0, 0, 0}, [](const Entry& e) { return e.ptr != nullptr; }); }
    std::vector<Entry> slots_;
    size_t mask_ = 0, size_ = 0;
};

// An 8-byte signature of a short byte string that, together with its length, identifies it
// exactly when n <= 8 (overlapping loads, no byte outside [p, p+n) is read).
inline uint64_t short_sig(const uint8_t* p, size_t n) {
    if (n >= 8) return load64(p);
    if (n >= 4) return load32(p) | (load32(p + n - 4) << 32);
    return n ? ((uint64_t)p[0] | ((uint64_t)p[n >> 1] << 8) | ((uint64_t)p[n - 1] << 16)) : 0;
}

// Per-thread counts of the pre-tokens of one input buffer. Slots hold the key's offset in that
// buffer plus its 8-byte signature, so keys of up to 8 bytes (most pre-tokens) compare without
// touching the buffer (a cache miss) and counting allocates nothing per pre-token.
class ChunkCountMap {
public:
    struct Slot {
        uint64_t sig;
        uint32_t off, len;  // len == 0: empty (pre-tokens are never empty)
        uint32_t hash, count;
    };
    explicit ChunkCountMap(const uint8_t* base) : base_(base) {
        slots_.assign(1 << 12, Slot{0, 0, 0, 0, 0});
        mask_ = slots_.size() - 1;
    }
    void add(const uint8_t* p, uint32_t n) {
        if ((size_ + 1) * 4 > slots_.size() * 3) grow();
        // The low half of the hash: the long-lived StrCountMap places keys by the high half, so walking
        // this table in slot order and inserting into that one does not pile keys into long probe runs
        // (with the same bits it did: ~160 probes per key when the tables were merged).
        const uint32_t h = (uint32_t)hash_bytes(p, n);
        const uint64_t sig = short_sig(p, n);
        size_t i = h & mask_;
        while (true) {
            Slot& s = slots_[i];
            if (s.len == 0) {
                s = Slot{sig, (uint32_t)(p - base_), n, h, 1};
                ++size_;
                return;
            }
            if (s.hash == h && s.len == n && s.sig == sig && (n <= 8 || bytes_equal(base_ + s.off, p, n))) {
                ++s.count;
                return;
            }
            i = (i + 1) & mask_;
        }
    }
    template <class F>
    void for_each(F&& f) const {
        for (const Slot& s : slots_)
            if (s.len) f(base_ + s.off, s.len, s.count);
    }

private:
    void grow() { grow_table(slots_, mask_, Slot{0, 0, 0, 0, 0}, [](const Slot& s) { return s.len != 0; }); }
    const uint8_t* base_;
    std::vector<Slot> slots_;
    size_t mask_ = 0, size_ = 0;
};

}  // namespace lmforge
