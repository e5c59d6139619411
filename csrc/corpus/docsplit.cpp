// Splitting delimited text into documents (see docsplit.h).
#include "corpus/docsplit.h"

#include <cstring>

#include "utf8.h"

namespace lmforge {

namespace {

// Slice-by-8 tables of the reflected polynomial 0xEDB88320, built once.
struct CrcTables {
    uint32_t t[8][256];
    CrcTables() {
        for (uint32_t i = 0; i < 256; ++i) {
            uint32_t c = i;
            for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
            t[0][i] = c;
        }
        for (uint32_t i = 0; i < 256; ++i)
            for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFF];
    }
};
const CrcTables& crc_tables() {
    static const CrcTables tables;
    return tables;
}

// Length of the whitespace character that starts at p (0 if none); p < end, valid UTF-8 assumed.
inline size_t space_at(const uint8_t* p, const uint8_t* end) {
    uint8_t c = *p;
    if (c < 0x80) return is_py_space(c) ? 1 : 0;
    if (c != 0xC2 && c != 0xE1 && c != 0xE2 && c != 0xE3) return 0;  // lead bytes of every non-ASCII space
    Char ch = decode_char(p, end - p);
    return is_py_space(ch.cp) ? ch.len : 0;
}

// Length of the whitespace character that ends just before q (0 if none); begin < q.
inline size_t space_before(const uint8_t* begin, const uint8_t* q) {
    uint8_t c = q[-1];
    if (c < 0x80) return is_py_space(c) ? 1 : 0;
    const uint8_t* p = q - 1;  // back to the lead byte (at most 3 continuation bytes)
    while (p > begin && q - p < 4 && (*p & 0xC0) == 0x80) --p;
    size_t len = space_at(p, q);
    return p + len == q ? len : 0;
}

}  // namespace

bool is_py_space(uint32_t cp) {
    if (cp < 0x80) return cp == ' ' || (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x1F);
    return cp == 0x85 || cp == 0xA0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 ||
           cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

uint32_t crc32(uint32_t crc, const uint8_t* p, size_t n) {
    const auto& t = crc_tables().t;
    crc = ~crc;
    while (n >= 8) {
        uint32_t lo, hi;
        std::memcpy(&lo, p, 4);  // little-endian hosts (x86-64, aarch64)
        std::memcpy(&hi, p + 4, 4);
        lo ^= crc;
        crc = t[7][lo & 0xFF] ^ t[6][(lo >> 8) & 0xFF] ^ t[5][(lo >> 16) & 0xFF] ^ t[4][lo >> 24] ^
              t[3][hi & 0xFF] ^ t[2][(hi >> 8) & 0xFF] ^ t[1][(hi >> 16) & 0xFF] ^ t[0][hi >> 24];
        p += 8;
        n -= 8;
    }
    while (n--) crc = (crc >> 8) ^ t[0][(crc ^ *p++) & 0xFF];
    return ~crc;
}

void split_documents(const uint8_t* buf, size_t n, const std::string& sep, bool final, bool want_crc, DocSpans& out) {
    out = DocSpans{};
    const size_t m = sep.size();
    const uint8_t* s = (const uint8_t*)sep.data();
    auto piece = [&](size_t a, size_t b) {  // one piece buf[a:b]; false stops the scan (invalid UTF-8)
        if (utf8_error_offset(buf + a, b - a) >= 0) {
            out.bad_piece = (long long)out.pieces;
            return false;
        }
        ++out.pieces;
        const uint8_t *p = buf + a, *q = buf + b;
        for (size_t k; p < q && (k = space_at(p, q)) > 0;) p += k;
        for (size_t k; q > p && (k = space_before(p, q)) > 0;) q -= k;
        if (p == q) return true;
        out.starts.push_back(p - buf);
        out.ends.push_back(q - buf);
        if (want_crc) out.crc.push_back(crc32(0, p, q - p));
        return true;
    };
    size_t a = 0;
    if (m > 0) {
        for (size_t i = 0; i + m <= n;) {
            const void* hit = std::memchr(buf + i, s[0], n - m + 1 - i);
            if (!hit) break;
            i = (const uint8_t*)hit - buf;
            if (std::memcmp(buf + i, s, m) != 0) { ++i; continue; }
            if (!piece(a, i)) return;
            i += m;
            a = i;
            out.consumed = a;
        }
    }
    if (final) {
        if (!piece(a, n)) return;
        out.consumed = n;
    }
}

}  // namespace lmforge
