// Documents of a delimited text buffer: split, strip, validate and checksum in one pass over the bytes,
// for the corpus readers (Python: lmforge.corpus.sources.split_documents, read by tokenizer training and
// data prepare). The byte-level twin of lmforge.corpus.sources.split_documents_reference (the tests
// hold them equal).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace lmforge {

struct DocSpans {
    size_t consumed = 0;          // bytes of the buffer covered by the pieces (through the last delimiter)
    size_t pieces = 0;            // pieces split off, empty ones included
    std::vector<int64_t> starts;  // per kept (non-empty after strip) document: byte span in the buffer
    std::vector<int64_t> ends;
    std::vector<uint32_t> crc;    // CRC-32 (zlib's) of each kept document, when asked for
    long long bad_piece = -1;     // index of the first piece that is not valid UTF-8 (then nothing else is valid)
};

// Split buf on sep. With final=false the bytes after the last delimiter are left for the next call
// (consumed stops after that delimiter); with final=true they form the last piece. Each piece is
// stripped of leading and trailing Unicode whitespace exactly as Python's str.strip() does.
void split_documents(const uint8_t* buf, size_t n, const std::string& sep, bool final, bool want_crc, DocSpans& out);

// zlib-compatible CRC-32 (IEEE 802.3, reflected), continuing from crc (0 to start).
uint32_t crc32(uint32_t crc, const uint8_t* p, size_t n);

// Whether code point cp is whitespace for Python's str.isspace() / str.strip().
bool is_py_space(uint32_t cp);

}  // namespace lmforge
