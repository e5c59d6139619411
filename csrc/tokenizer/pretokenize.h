// Hand-written pre-tokenizers equivalent to regex.findall with the gpt2 / gpt4 / nanochat patterns,
// working on valid UTF-8 bytes (on any other bytes they never read past the text: utf8.h's decode_char), plus special-token splitting and thread-safe split points. Used by the
// counter and the encoder (Python: lmforge.tokenizer) and bound as _core.pretokenize for the tests.
//
// How findall runs these patterns (tried in order at each position; every character is one of
// letter L, number N, whitespace S or "other" O, so some alternative always matches):
//   gpt2: '(?:[sdmt]|ll|ve|re) | ' '?L+ | ' '?N+ | ' '?O+ | \s+(?!\S) | \s+
//   gpt4: '(?i:[sdmt]|ll|ve|re) | [^\r\nLN]?+L+ | N{1,3} | ' '?O++[\r\n]* | \s*[\r\n] | \s+(?!\S) | \s+
// A whitespace run [i, k) that is not taken by a prefix rule becomes (gpt4 first takes everything up
// to the run's last \r or \n): the whole run if it ends the text, else the run minus its last
// character (so that character can prefix the next word), else (a single character) itself.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "utf8.h"

namespace lmforge {

enum Pattern : int { kCustom = -1, kGPT2 = 0, kGPT4 = 1, kNanochat = 2 };

inline bool is_fold(uint32_t cp, const uint32_t* set, size_t n) {
    for (size_t k = 0; k < n; ++k)
        if (set[k] == cp) return true;
    return false;
}
#define LMF_FOLD(letter, cp) is_fold(cp, kFold_##letter, sizeof(kFold_##letter) / sizeof(uint32_t))

// End of the run of characters of class `cls` starting at i: cls is kFlagL or kFlagN, or 0 for
// "other" (no flag set), or kFlagS.
template <uint8_t cls>
inline size_t run_end(const uint8_t* s, size_t i, size_t n) {
    while (i < n) {
        uint8_t c = s[i];
        if (c < 0x80) {
            uint8_t f = latin1_flags(c);
            if (cls == 0 ? f != 0 : !(f & cls)) break;
            ++i;
        } else {
            Char ch = decode_char(s + i, n - i);
            if (cls == 0 ? ch.flags != 0 : !(ch.flags & cls)) break;
            i += ch.len;
        }
    }
    return i;
}

// Whitespace run starting at i (s[i] is whitespace): returns its end; *last = start of its last
// character; *crlf = one past its last '\r' or '\n' (or 0 if it holds none).
inline size_t ws_run(const uint8_t* s, size_t i, size_t n, size_t* last, size_t* crlf) {
    *crlf = 0;
    *last = i;
    while (i < n) {
        uint8_t c = s[i];
        if (c < 0x80) {
            if (!(latin1_flags(c) & kFlagS)) break;
            if (c == '\r' || c == '\n') *crlf = i + 1;
            *last = i;
            ++i;
        } else {
            Char ch = decode_char(s + i, n - i);
            if (!(ch.flags & kFlagS)) break;
            *last = i;
            i += ch.len;
        }
    }
    return i;
}

// The whitespace tail rule shared by both patterns (\s+(?!\S) then \s+).
inline size_t ws_token_end(size_t i, size_t k, size_t last, size_t n) {
    if (k == n) return n;        // \s+(?!\S) at end of text: the whole run
    if (last > i) return last;   // backtrack one character so it can prefix the next token
    return k;                    // single character: plain \s+
}

// GPT-2 pattern. emit(ptr, len) is called for each pre-token in order.
template <class Emit>
inline void pretok_gpt2(const uint8_t* s, size_t n, Emit&& emit) {
    size_t i = 0;
    while (i < n) {
        uint8_t c = s[i];
        if (c == '\'' && i + 1 < n) {  // '(?:[sdmt]|ll|ve|re), case-sensitive
            uint8_t d = s[i + 1];
            if (d == 's' || d == 'd' || d == 'm' || d == 't') { emit(s + i, 2); i += 2; continue; }
            if (i + 2 < n) {
                uint8_t e = s[i + 2];
                if ((d == 'l' && e == 'l') || (d == 'v' && e == 'e') || (d == 'r' && e == 'e')) {
                    emit(s + i, 3);
                    i += 3;
                    continue;
                }
            }
        }
        Char ch = decode_char(s + i, n - i);
        size_t j = i;  // where the class run starts (after an optional ' ')
        uint8_t f = ch.flags;
        if (c == ' ' && i + 1 < n) {
            Char nx = decode_char(s + i + 1, n - i - 1);
            if (!(nx.flags & kFlagS)) { j = i + 1; f = nx.flags; }
        }
        size_t end;
        if (f & kFlagL) end = run_end<kFlagL>(s, j, n);
        else if (f & kFlagN) end = run_end<kFlagN>(s, j, n);
        else if (!(f & kFlagS)) end = run_end<0>(s, j, n);
        else {
            size_t last, crlf;
            size_t k = ws_run(s, i, n, &last, &crlf);
            end = ws_token_end(i, k, last, n);
        }
        emit(s + i, end - i);
        i = end;
    }
}

// GPT-4 (cl100k) pattern; nanochat is the same with max_digits = 2.
template <class Emit>
inline void pretok_gpt4(const uint8_t* s, size_t n, int max_digits, Emit&& emit) {
    size_t i = 0;
    while (i < n) {
        Char ch = decode_char(s + i, n - i);
        if (ch.cp == '\'' && i + 1 < n) {  // '(?i:[sdmt]|ll|ve|re)
            Char d = decode_char(s + i + 1, n - i - 1);
            if (LMF_FOLD(s, d.cp) || LMF_FOLD(d, d.cp) || LMF_FOLD(m, d.cp) || LMF_FOLD(t, d.cp)) {
                emit(s + i, 1 + d.len);
                i += 1 + d.len;
                continue;
            }
            size_t k = i + 1 + d.len;
            if (k < n && (LMF_FOLD(l, d.cp) || LMF_FOLD(v, d.cp) || LMF_FOLD(r, d.cp))) {
                Char e = decode_char(s + k, n - k);
                if ((LMF_FOLD(l, d.cp) && LMF_FOLD(l, e.cp)) || (LMF_FOLD(v, d.cp) && LMF_FOLD(e, e.cp)) ||
                    (LMF_FOLD(r, d.cp) && LMF_FOLD(e, e.cp))) {
                    emit(s + i, 1 + d.len + e.len);
                    i = k + e.len;
                    continue;
                }
            }
        }
        const uint8_t f = ch.flags;
        size_t end;
        if (f & kFlagL) {  // [^\r\n\p{L}\p{N}]?+\p{L}+ without the prefix
            end = run_end<kFlagL>(s, i + ch.len, n);
            emit(s + i, end - i);
            i = end;
            continue;
        }
        if (!(f & kFlagN) && ch.cp != '\r' && ch.cp != '\n' && i + ch.len < n) {  // ... with a prefix
            Char nx = decode_char(s + i + ch.len, n - i - ch.len);
            if (nx.flags & kFlagL) {
                end = run_end<kFlagL>(s, i + ch.len + nx.len, n);
                emit(s + i, end - i);
                i = end;
                continue;
            }
        }
        if (f & kFlagN) {  // \p{N}{1,max_digits}
            end = i + ch.len;
            for (int d = 1; d < max_digits && end < n; ++d) {
                uint32_t len;
                if (!(char_flags(s + end, n - end, &len) & kFlagN)) break;
                end += len;
            }
            emit(s + i, end - i);
            i = end;
            continue;
        }
        size_t j = f == 0 ? i : n;  // start of an "other" run: ' '?[^\s\p{L}\p{N}]++[\r\n]*
        if (ch.cp == ' ' && i + 1 < n) {
            uint32_t len;
            if (char_flags(s + i + 1, n - i - 1, &len) == 0) j = i + 1;
        }
        if (j < n) {
            end = run_end<0>(s, j, n);
            while (end < n && (s[end] == '\r' || s[end] == '\n')) ++end;
            emit(s + i, end - i);
            i = end;
            continue;
        }
        size_t last, crlf;  // whitespace: \s*[\r\n] | \s+(?!\S) | \s+
        size_t k = ws_run(s, i, n, &last, &crlf);
        end = crlf ? crlf : ws_token_end(i, k, last, n);
        emit(s + i, end - i);
        i = end;
    }
}

template <class Emit>
inline void pretokenize_piece(int pattern, const uint8_t* s, size_t n, Emit&& emit) {
    if (pattern == kGPT2) pretok_gpt2(s, n, emit);
    else pretok_gpt4(s, n, pattern == kNanochat ? 2 : 3, emit);
}

// Splits text on special tokens: at each position the longest special token that starts there wins
// (like a regex alternation sorted longest first), scanning left to right.
class SpecialSplitter {
public:
    SpecialSplitter() = default;
    // `tokens` must be non-empty strings; ids[k] belongs to tokens[k] (may be empty for the counter).
    SpecialSplitter(std::vector<std::string> tokens, std::vector<uint32_t> ids) {
        std::vector<size_t> order(tokens.size());
        for (size_t k = 0; k < order.size(); ++k) order[k] = k;
        std::stable_sort(order.begin(), order.end(),
                         [&](size_t a, size_t b) { return tokens[a].size() > tokens[b].size(); });
        std::memset(first_, 0, sizeof(first_));
        for (size_t k : order) {
            toks_.push_back(tokens[k]);
            ids_.push_back(ids.empty() ? 0 : ids[k]);
            first_[(uint8_t)tokens[k][0]] = true;
        }
        int distinct = 0;
        for (int c = 0; c < 256; ++c)
            if (first_[c]) { ++distinct; single_first_ = c; }
        if (distinct != 1) single_first_ = -1;
    }
    bool empty() const { return toks_.empty(); }

    // First special-token match in [pos, end) in scanning order: returns its index (into the sorted
    // list) and sets *mpos, or returns -1.
    long find(const uint8_t* s, size_t pos, size_t end, size_t* mpos) const {
        if (toks_.empty()) return -1;
        while (pos < end) {
            if (single_first_ >= 0) {
                const void* q = std::memchr(s + pos, single_first_, end - pos);
                if (!q) return -1;
                pos = (const uint8_t*)q - s;
            } else if (!first_[s[pos]]) {
                ++pos;
                continue;
            }
            long k = match_at(s, pos, end);
            if (k >= 0) { *mpos = pos; return k; }
            ++pos;
        }
        return -1;
    }
    // Index of the longest special token starting exactly at pos (ending by `end`), or -1.
    long match_at(const uint8_t* s, size_t pos, size_t end) const {
        for (size_t k = 0; k < toks_.size(); ++k) {
            const std::string& t = toks_[k];
            if (t.size() <= end - pos && std::memcmp(s + pos, t.data(), t.size()) == 0) return (long)k;
        }
        return -1;
    }
    // True if some occurrence of a special token straddles position p (starts before, ends after).
    bool straddles(const uint8_t* s, size_t n, size_t p) const {
        for (const std::string& t : toks_)
            for (size_t off = 1; off < t.size() && off <= p; ++off)
                if (p - off + t.size() <= n && std::memcmp(s + p - off, t.data(), t.size()) == 0) return true;
        return false;
    }
    size_t token_len(long k) const { return toks_[k].size(); }
    uint32_t token_id(long k) const { return ids_[k]; }
    const std::vector<std::string>& tokens() const { return toks_; }

private:
    std::vector<std::string> toks_;
    std::vector<uint32_t> ids_;
    bool first_[256] = {};
    int single_first_ = -1;
};

// Calls piece(ptr, len) for each run of ordinary text in [0, n) and special(k) for each special token.
template <class Piece, class Special>
inline void split_specials(const SpecialSplitter& sp, const uint8_t* s, size_t n, Piece&& piece, Special&& special) {
    size_t pos = 0;
    while (pos < n) {
        size_t m;
        long k = sp.find(s, pos, n, &m);
        if (k < 0) { piece(s + pos, n - pos); return; }
        if (m > pos) piece(s + pos, m - pos);
        special(k);
        pos = m + sp.token_len(k);
    }
}

// A position p >= from where the text may be cut without changing pre-tokenization or special-token
// splitting (for all three patterns), or n when there is none. Either
//  * s[p] is ' ', s[p-1] is printable ASCII (! to ~) and s[p+1] an ASCII letter: p is a pre-token
//    boundary that no rule looks across (the token before p ends at p-1 whatever follows, and
//    ' '+letter starts a new token); or
//  * a special token starts at p (text without spaces, e.g. Chinese documents, still splits);
// and no special-token occurrence straddles p (so the left-to-right special scan reaches p).
inline size_t safe_split_point(const uint8_t* s, size_t n, size_t from, const SpecialSplitter& sp) {
    size_t space_cut = n;
    for (size_t p = std::max<size_t>(from, 1); p + 1 < n; ++p) {
        const void* q = std::memchr(s + p, ' ', n - 1 - p);
        if (!q) break;
        p = (const uint8_t*)q - s;
        uint8_t a = s[p - 1], b = s[p + 1];
        bool letter = (b | 0x20) >= 'a' && (b | 0x20) <= 'z';
        if (a >= 0x21 && a <= 0x7e && letter && !sp.straddles(s, n, p)) { space_cut = p; break; }
    }
    for (size_t pos = std::max<size_t>(from, 1); pos < space_cut;) {  // an earlier special-token start?
        size_t m;
        if (sp.find(s, pos, space_cut, &m) < 0) break;
        if (!sp.straddles(s, n, m)) return m;
        pos = m + 1;
    }
    return space_cut;
}

}  // namespace lmforge
