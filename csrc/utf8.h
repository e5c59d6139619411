// UTF-8 validation and decoding, plus the character classes of the pre-tokenizer regexes. Shared by the
// document splitter (corpus/), the pre-tokenizers (tokenizer/) and the bindings (_core.utf8_error_offset).
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "unicode_tables.h"

namespace lmforge {

// Offset of the first byte that is not part of a well-formed UTF-8 sequence, or -1 if `s` is valid.
// Rejects overlongs, surrogates (U+D800..U+DFFF) and code points above U+10FFFF, like Python's decoder.
inline long long utf8_error_offset(const uint8_t* s, size_t n) {
    size_t i = 0;
    while (i < n) {
        // ASCII fast path: 8 bytes at a time.
        while (i + 8 <= n) {
            uint64_t v;
            std::memcpy(&v, s + i, 8);
            if (v & 0x8080808080808080ull) break;
            i += 8;
        }
        if (i >= n) break;
        uint8_t c = s[i];
        if (c < 0x80) { ++i; continue; }
        size_t len;
        uint8_t lo = 0x80, hi = 0xBF;  // allowed range of the second byte
        if (c >= 0xC2 && c <= 0xDF) len = 2;
        else if (c >= 0xE0 && c <= 0xEF) {
            len = 3;
            if (c == 0xE0) lo = 0xA0;       // no overlongs
            else if (c == 0xED) hi = 0x9F;  // no surrogates
        } else if (c >= 0xF0 && c <= 0xF4) {
            len = 4;
            if (c == 0xF0) lo = 0x90;
            else if (c == 0xF4) hi = 0x8F;  // <= U+10FFFF
        } else return (long long)i;
        if (i + 1 >= n || s[i + 1] < lo || s[i + 1] > hi) return (long long)i;
        for (size_t k = 2; k < len; ++k)
            if (i + k >= n || (s[i + k] & 0xC0) != 0x80) return (long long)i;
        i += len;
    }
    return -1;
}

// One decoded character: code point, byte length and class flags (kFlagL/kFlagN/kFlagS).
struct Char {
    uint32_t cp;
    uint32_t len;
    uint8_t flags;
};

// Decode the character at s[0], n >= 1 bytes being available there. Meant for valid UTF-8, but never reads
// past s[n - 1] whatever the bytes: a lead byte whose sequence would run past n, or a byte that cannot start a
// sequence, decodes as one character U+FFFD of one byte (class "other"), so a scan always moves on.
inline Char decode_char(const uint8_t* s, size_t n) {
    uint8_t c = s[0];
    if (c < 0x80) return {c, 1, latin1_flags(c)};
    uint32_t cp, len = c < 0xC0 ? 0 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : c < 0xF8 ? 4 : 0;
    if (len == 0 || len > n) return {0xFFFD, 1, 0};
    if (len == 2) cp = ((c & 0x1Fu) << 6) | (s[1] & 0x3Fu);
    else if (len == 3) cp = ((c & 0x0Fu) << 12) | ((s[1] & 0x3Fu) << 6) | (s[2] & 0x3Fu);
    else cp = ((c & 0x07u) << 18) | ((s[1] & 0x3Fu) << 12) | ((s[2] & 0x3Fu) << 6) | (s[3] & 0x3Fu);
    return {cp, len, unicode_flags(cp)};
}

// Flags of the character starting at s[0] (n >= 1 bytes available) without returning its length (for run scanning).
inline uint8_t char_flags(const uint8_t* s, size_t n, uint32_t* len) {
    if (s[0] < 0x80) { *len = 1; return latin1_flags(s[0]); }
    Char c = decode_char(s, n);
    *len = c.len;
    return c.flags;
}

}  // namespace lmforge
