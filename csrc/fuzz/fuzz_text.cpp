// A seeded random fuzzer of the text code on bytes that need not be UTF-8: the pre-tokenizers, the encoder and
// the document splitter. Built only by the sanitizer build (tools/sanitize.sh, CMake -DLMFORGE_SANITIZE=...),
// which runs it under ASan + UBSan. Each input lives in a heap block of exactly its size, so a read one byte
// past it is a heap-buffer-overflow report (utf8.h's decode_char used to trust a lead byte's length: a text
// ending in 0xF0 was read 3 bytes past its end). Checks: the pre-tokens tile the input, the encoder's tokens
// give back its bytes, the documents lie inside it.
// Usage: fuzz_text [iterations] [seed]; exit status 1 (and the input in hex) on a failed check.
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "corpus/docsplit.h"
#include "tokenizer/encoder.h"
#include "tokenizer/pretokenize.h"
#include "utf8.h"

using namespace lmforge;

namespace {

// Bytes that make the pre-tokenizer rules fire: ASCII classes, apostrophe contractions, CR/LF, a special
// token's bytes, lead bytes of every length, continuation bytes and bytes that start nothing.
const uint8_t kPool[] = {' ', ' ', 'a', 'Z', 's', 'l', 'e', '7', '\'', '.', '\n', '\r', '<', '|', '>', 'x',
                         0xC2, 0xA0, 0xC3, 0xA9, 0xE2, 0x80, 0x83, 0xE3, 0x81, 0x82, 0xF0, 0x9F, 0x98, 0x80,
                         0xED, 0xA0, 0xF4, 0x90, 0xE0, 0xBF, 0xFF, 0xF8, 0xC0};

int fail(const char* what, const uint8_t* s, size_t n) {
    std::fprintf(stderr, "fuzz_text: %s on input (%zu bytes):", what, n);
    for (size_t i = 0; i < n; ++i) std::fprintf(stderr, " %02x", s[i]);
    std::fprintf(stderr, "\n");
    return 1;
}

}  // namespace

int main(int argc, char** argv) {
    const long iterations = argc > 1 ? std::atol(argv[1]) : 100000;
    std::mt19937_64 rng(argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 0);
    std::vector<std::string> vocab;
    for (int b = 0; b < 256; ++b) vocab.emplace_back(1, (char)b);
    const std::vector<std::pair<int64_t, int64_t>> merges = {{'a', 'Z'}};
    vocab.push_back("aZ");
    const std::vector<std::pair<std::string, int64_t>> specials = {{"<|x|>", 300}};
    const Encoder encoders[3] = {{vocab, merges, specials, kGPT2}, {vocab, merges, specials, kGPT4},
                                 {vocab, merges, specials, kNanochat}};
    for (long it = 0; it < iterations; ++it) {
        const size_t n = rng() % 24;
        std::unique_ptr<uint8_t[]> buf(new uint8_t[n ? n : 1]);
        uint8_t* s = buf.get();
        for (size_t i = 0; i < n; ++i) s[i] = rng() % 8 ? kPool[rng() % sizeof(kPool)] : (uint8_t)rng();
        for (int pattern = kGPT2; pattern <= kNanochat; ++pattern) {
            size_t covered = 0;
            bool tiles = true;
            pretokenize_piece(pattern, s, n, [&](const uint8_t* p, size_t len) {
                tiles = tiles && p == s + covered && len > 0;
                covered += len;
            });
            if (!tiles || covered != n) return fail("pre-tokens do not tile the text", s, n);
            std::vector<uint32_t> ids;
            encoders[pattern].encode(s, n, true, ids);
            std::vector<int64_t> wide(ids.begin(), ids.end());
            if (encoders[pattern].decode_bytes(wide) != std::string((const char*)s, n))
                return fail("the tokens do not give back the text", s, n);
        }
        if (utf8_error_offset(s, n) < 0) {  // valid: decode_char walks it character by character
            size_t at = 0;
            while (at < n) at += decode_char(s + at, n - at).len;
            if (at != n) return fail("decode_char's lengths do not add up", s, n);
        }
        DocSpans d;
        split_documents(s, n, "\n\n", true, true, d);
        for (size_t k = 0; k < d.starts.size(); ++k)
            if (d.starts[k] < 0 || d.starts[k] >= d.ends[k] || (size_t)d.ends[k] > n)
                return fail("a document outside the text", s, n);
    }
    std::printf("fuzz_text: %ld inputs, all checks passed\n", iterations);
    return 0;
}
